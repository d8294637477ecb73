"""Real vLLM prefill/decode servers: kvplan's Mooncake connector, direct against staged, per request.

    python bench/e2e_vllm_staged.py                  # short run (8 requests per side)
    python bench/e2e_vllm_staged.py --requests 30    # the recorded run, into
                                                     # bench/results/e2e-vllm-staged.md

Not part of CI or ``scripts/test``; like ``bench/e2e_vllm.py`` (whose model, prompts, fillers
and measurements it reuses) it needs the live-server set-up of ``scripts/e2e-vllm`` and runs
under the machine-wide server lock in a private network namespace.

Four servers at once, all with kvplan's ``KvplanMooncakeConnector`` (vLLM 0.32's connector
module, Mooncake TCP on loopback, through ``tests/e2e/vllm_support/e2e_kvplan_staged.py``,
which is kvplan's class unchanged plus one log line per staged request): a prefill and a
decode with ``kvplan_staging: off`` (kvplan's direct path: one Mooncake descriptor per block of
kvplan's plan) and a prefill and a decode with ``kvplan_staging: always`` (rounds through a
64 MiB arena per worker in two round buffers). The model is ``bench/e2e_vllm.py``'s 32-layer
random-weight Llama (1 MiB of KV a block, 32 KiB per block and layer), prompts of 59-64
blocks, each decode's block pool fragmented first by the same concurrent fillers, so that a
request's direct plan has about one block per block and layer.

Per request, the two sides alternate (A B B A ...) with the same prompt; the decodes' greedy
token ids must be equal. Measured per request: the transfer time the prefill records in
vLLM's Mooncake statistics (``Avg xfer time`` of the "KV Transfer metrics" log intervals that
saw one transfer; direct: the engine's batch write; staged: from the first round's gather to
the decode's acknowledgement of the last round's scatter, so the staged figure includes the
gather and the scatter the direct write does not need), the staged sends' own seconds and
direct-plan blocks (the probe's line), the client's decode response with the pull, and the
decode's time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import e2e_vllm as base  # noqa: E402  (puts tests/e2e on the path)
import e2e_harness as harness  # noqa: E402
import vllm_e2e as driver  # noqa: E402
from e2e_harness import Results, log  # noqa: E402

TAG = "e2e-vllm-staged-bench"
ARENA_MIB = 64
BUFFERS = 2
SIDES = {  # name -> kvplan_staging options
    "direct": {"kvplan_staging": "off"},
    "staged": {"kvplan_staging": "always", "kvplan_staging_arena_mib": ARENA_MIB,
               "kvplan_staging_buffers": BUFFERS},
}
PORTS = {"direct": (driver.PREFILL_PORT, driver.DECODE_PORT),
         "staged": (driver.OTHER_PREFILL_PORT, driver.LAYOUT_PREFILL_PORT)}


def connector(name: str) -> driver.Connector:
    return driver.Connector(f"mooncake kvplan {name}", "mooncake", "KvplanMooncakeConnector",
                            "e2e_kvplan_staged", extra=dict(SIDES[name]))


def run(setup_info: driver.Setup, requests: int, out: Path, results: Results) -> None:
    log_dir = harness.cache_root() / "logs" / time.strftime("vllm-staged-bench-%Y%m%d-%H%M%S")
    servers = driver.VllmServers(
        setup_info, log_dir, max_model_len=base.MAX_MODEL_LEN,
        extra_args=("--num-gpu-blocks-override", str(base.NUM_BLOCKS)),
        extra_env={"VLLM_LOG_STATS_INTERVAL": "1"})
    sides: list[base.Side] = []
    for name in SIDES:
        conn = connector(name)
        prefill_port, decode_port = PORTS[name]
        prefill = servers.server(f"{name}-prefill", base.MODEL_KEY, prefill_port, conn,
                                 "kv_producer")
        decode = servers.server(f"{name}-decode", base.MODEL_KEY, decode_port, conn,
                                "kv_consumer")
        sides.append(base.Side(name, conn, prefill, decode,
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
            fill_s = list(pool.map(lambda s: base.fill(s.decode), sides))
        log(f"fillers done in {max(fill_s):.0f} s")
        warm = base.prompts(requests + base.WARMUP)
        for ids in warm[:base.WARMUP]:
            for side in sides:
                side.pair.generate(ids, base.MAX_TOKENS)
        time.sleep(3.0)  # the warm-ups' transfer statistics are logged before the offset
        offsets = [side.prefill.log_size() for side in sides]
        measure_started = time.monotonic()
        for i, ids in enumerate(warm[base.WARMUP:]):
            order = sides if i % 2 == 0 else sides[::-1]
            for side in order:
                side.measure(ids)
                loads.append(os.getloadavg()[0])
            log(f"request {i + 1}/{requests}: " + ", ".join(
                f"{s.label} ttft {s.ttft_s[-1] * 1e3:.0f} ms" for s in sides))
        measure_s = time.monotonic() - measure_started
        time.sleep(3.0)
        for side, offset in zip(sides, offsets):
            side.xfer = base.transfer_lines(side.prefill, offset)
        probe = driver.staged_lines(sides[1].prefill, offsets[1])
        stray = driver.staged_lines(sides[0].prefill)
    uptime_end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    direct, staged = sides
    same = sum(a == b for a, b in zip(direct.outputs, staged.outputs))
    results.record("both sides' decodes give the same greedy token ids", same == requests,
                   f"{same} of {requests} requests")
    results.record("every measured request of the staged side went staged, none of the direct",
                   len(probe) == requests and not stray,
                   f"{len(probe)} staged lines for {requests} requests; direct side {len(stray)}")
    raw = {s.label: {k: getattr(s, k) for k in ("prefill_s", "decode_s", "ttft_s", "e2e_s",
                                                "xfer", "outputs")} for s in sides}
    (log_dir / "bench-raw.json").write_text(json.dumps(
        {"sides": raw, "probe": probe, "loads": loads, "uptime": [uptime_start, uptime_end],
         "seconds": [startup_s, max(fill_s), measure_s]}))
    text = report(sides, probe, requests, loads, uptime_start, uptime_end, startup_s,
                  max(fill_s), measure_s, log_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"wrote {out}; server logs: {log_dir}")
    print(text, flush=True)


def med(values: list[float]) -> str:
    return f"{base.ms(statistics.median(values))} ({base.ms(min(values))})" if values else "-"


def report(sides: list[base.Side], probe: list[dict[str, float | str]], requests: int,
           loads: list[float], uptime_start: str, uptime_end: str, startup_s: float,
           fill_s: float, measure_s: float, log_dir: Path) -> str:
    direct, staged = sides
    m = base.MODELS[base.MODEL_KEY]
    one = {s.label: [x / 1e3 for x in base.single(s.xfer, "Avg xfer time (ms)")] for s in sides}
    descs = {s.label: base.weighted(s.xfer, "Avg number of descriptors") for s in sides}
    probe_s = [float(r["seconds"]) for r in probe]
    plan_blocks = [float(r["direct_blocks"]) for r in probe]
    net_blocks = [float(r["network_blocks"]) for r in probe]
    rounds = [float(r["rounds"]) for r in probe]
    same = sum(a == b for a, b in zip(direct.outputs, staged.outputs))

    def ratio(a: list[float], b: list[float]) -> str:
        if not a or not b:
            return "-"
        return f"{statistics.median(a) / statistics.median(b):.2f}"

    lines = [
        "# kvplan's vLLM Mooncake connector: direct against staged, in real vLLM servers (CPU)",
        "",
        f"Generated by `python bench/e2e_vllm_staged.py --requests {requests}` (not part of "
        "CI; it needs the live-server set-up of `scripts/e2e-vllm`). The module docstring "
        "says what runs.",
        "",
        "## Machine and load",
        "",
        *base.machine_lines(),
        f"- `uptime` at the start: `{uptime_start}`",
        f"- `uptime` at the end: `{uptime_end}`",
        f"- 1-minute load average during the measured requests: median "
        f"{statistics.median(loads):.1f}, min {min(loads):.1f}, max {max(loads):.1f} (2 cores, "
        "shared with other sessions' work)",
        f"- four servers ready in {startup_s:.0f} s; fillers {fill_s:.0f} s; {requests} "
        f"requests per side in {measure_s:.0f} s",
        "",
        "## Shapes",
        "",
        f"- model: random-weight Llama, {m.num_layers} layers, hidden {m.hidden}, "
        f"{m.kv_heads} KV heads of {m.head_dim}, float32: 1 MiB of KV a block, 32 KiB per "
        f"block and layer ({m.num_layers} regions)",
        f"- servers: `--max-model-len {base.MAX_MODEL_LEN} --block-size {base.BLOCK} "
        f"--num-gpu-blocks-override {base.NUM_BLOCKS}`, `VLLM_LOG_STATS_INTERVAL=1`; direct: "
        f"`\"kvplan_staging\": \"off\"`; staged: `\"kvplan_staging\": \"always\", "
        f"\"kvplan_staging_arena_mib\": {ARENA_MIB}, \"kvplan_staging_buffers\": {BUFFERS}` "
        "on both peers",
        f"- requests: token-id prompts of {base.PROMPT_MIN}-{base.PROMPT_MAX} tokens (seeded), "
        f"{base.MAX_TOKENS} greedy tokens each; {base.WARMUP} warm-ups per side; each decode's "
        f"pool fragmented first by {base.FILLERS} concurrent fillers",
        "",
        "## Per request (medians; min in brackets)",
        "",
        "| | direct | staged | direct / staged (medians) |",
        "| --- | ---: | ---: | ---: |",
        f"| requests measured | {len(direct.decode_s)} | {len(staged.decode_s)} | |",
        f"| network descriptors per transfer (vLLM's statistics, weighted mean) | "
        f"{descs['direct']:,.1f} | {descs['staged']:,.1f} | "
        f"{descs['direct'] / descs['staged']:,.0f} |",
        f"| transfer time (vLLM's statistics, one-transfer intervals: "
        f"{len(one['direct'])} / {len(one['staged'])}) | {med(one['direct'])} | "
        f"{med(one['staged'])} | {ratio(one['direct'], one['staged'])} |",
        f"| decode response with the pull (client) | {med(direct.decode_s)} | "
        f"{med(staged.decode_s)} | {ratio(direct.decode_s, staged.decode_s)} |",
        f"| decode's time to first token | {med(direct.ttft_s)} | {med(staged.ttft_s)} | "
        f"{ratio(direct.ttft_s, staged.ttft_s)} |",
        f"| prefill response (client) | {med(direct.prefill_s)} | {med(staged.prefill_s)} | "
        f"{ratio(direct.prefill_s, staged.prefill_s)} |",
        "",
        "Paired by request (the same prompt, the two sides one after the other): "
        + "; ".join(f"{title}: staged lower in {sum(b < a for a, b in zip(x, y))} of "
                    f"{min(len(x), len(y))}" for title, x, y in (
                        ("decode response", direct.decode_s, staged.decode_s),
                        ("time to first token", direct.ttft_s, staged.ttft_s))) + ".",
        "",
        "## The staged sends (the prefill's per-request probe line)",
        "",
        f"- {len(probe)} staged requests; rounds per request median "
        f"{statistics.median(rounds) if rounds else float('nan'):.0f}, network blocks per "
        f"request median {statistics.median(net_blocks) if net_blocks else float('nan'):.0f}",
        f"- the direct plan of the same pages: median "
        f"{statistics.median(plan_blocks) if plan_blocks else float('nan'):,.0f} blocks per "
        f"request (the descriptors kvplan's direct path would write for it)",
        f"- send time, first gather to the last round's acknowledgement: {med(probe_s)}",
        "",
        f"Greedy token ids equal between the two decodes for {same} of {requests} requests. "
        f"Server logs of the run: `{log_dir}`.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8,
                        help="measured requests per side (default 8)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" /
                                             "e2e-vllm-staged.md"))
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
    return harness.drive(TAG, __file__, prepare=lambda: driver.setup(base.MODELS).to_json(),
                         setup_only=args.setup_only,
                         case_args=["--requests", str(args.requests), "--out",
                                    str(Path(args.out).resolve())])


if __name__ == "__main__":
    sys.exit(main())
