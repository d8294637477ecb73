"""Layer-wise streaming over real engines: the transfer tail of a streamed request against the
loopback bandwidth measured in the same run, and the per-slice cost of slicing and submission
bookkeeping measured in-process without an engine.

    .venv/bin/python bench/streaming.py [--engines mooncake,nixl] [--tokens 1024,4096]

Per (engine, model) one decode and one prefill process (``kvplan.testing``, real Mooncake TCP
or NIXL/UCX on loopback, DRAM to DRAM). Per prompt length:

1. **Bandwidth.** The request is sent monolithically (``transfer``: planned without layer
   groups, one ``submit``) and its bytes ÷ its transfer time is the loopback bandwidth of this
   request shape in this run; that time is also the monolithic tail (sent after the last layer,
   the decode waits for all of it).
2. **Streamed rows** (median tail of 3 runs). A synthetic forward sleeps ``layer_ms`` per layer, signals each layer in
   ascending order and seals; groups of 1, 4 and all layers. ``layer_ms`` is twice the measured
   per-layer transfer time (request bytes ÷ layers ÷ bandwidth), at least 0.5 ms, so compute
   exceeds transfer (the rows the tail target applies to); one more row per (engine, model)
   uses a quarter of it (compute below transfer: slices queue behind each other).
   The tail column is the median of 3 runs, the best of them in brackets; "wake-up lag" is
   the median overshoot of ``time.sleep(1 ms)`` measured just before, how late a woken
   thread runs on the machine at that moment.
3. **Tail target**: 1.2 × (last group's bytes ÷ bandwidth) + 200 µs, the last group being the
   slice of the last layer plus the seal (both leave after the last ready signal).
4. **Per-slice overhead**, in-process, no engine: ``LayerSlices.of(plan)`` per slice (core
   slicing), and a whole ``StreamingSubmitter`` request (open, every ready signal, seal,
   verdict) against a transport whose ``submit`` returns at once, per slice sent.

Models: DeepSeek-V3 (61 MLA layers, 1152 B per token per layer) and Kimi-Linear (48 layers:
12 MLA, 36 KDA with 2.1 MiB of per-request state each, which streams with its layer's group).
Pages of 64 tokens, source pages contiguous, destination pages fragmented (25 % of page
boundaries broken, runs shuffled). Writes the table to bench/results/streaming-run.md; a run is
recorded and read in bench/results/streaming-results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from harness.machine import describe
from harness.results import RESULTS_DIR, write_lines
from harness.timing import call_times_ns

import kvplan
from kvplan.engines import StreamingSubmitter, TransferStats
from kvplan.presets import ModelPreset, fragmented_pages, get_preset
from kvplan.testing import model_peers

PAGE_SIZE = 64
REPS = 3
FRAGMENTATION = 0.25
MODELS = ("deepseek-v3", "kimi-linear")


class NullTransport:
    """A transport whose ``submit`` does nothing: what is left is kvplan's own bookkeeping."""

    engine_name = "null"

    def submit(self, plan: Any, peer: str, max_blocks: int | None = None,
               **kw: Any) -> TransferStats:
        return TransferStats(peer, len(plan.lengths), 0, 1, 0.0)


def _pages(tokens: int, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    n = tokens // PAGE_SIZE
    src = np.arange(n, dtype=np.int64)
    dst = fragmented_pages(n, FRAGMENTATION, seed=seed, shuffle_runs=True, capacity=capacity)
    return src, np.asarray(dst, dtype=np.int64)


def overhead(preset: ModelPreset, tokens: int, group_size: int) -> dict[str, float]:
    """Per-slice ns of core slicing and of the submitter's bookkeeping (no engine): a whole
    request's ns per slice sent, and the marginal ns of one more slice (against the same
    request as one group: the same ready signals, open, seal and verdict)."""
    mine = _request_ns(preset, tokens, group_size)
    if group_size >= preset.num_layers:
        return {**mine, "marginal_ns_per_slice": float("nan")}
    whole = _request_ns(preset, tokens, preset.num_layers)
    extra = mine["n_slices"] - whole["n_slices"]
    marginal = (mine["request_ns"] - whole["request_ns"]) / extra
    return {**mine, "marginal_ns_per_slice": marginal}


def _request_ns(preset: ModelPreset, tokens: int, group_size: int) -> dict[str, float]:
    from kvplan.testing import build_layout

    capacity = 2 * (tokens // PAGE_SIZE) + 8
    peers = model_peers(preset, pages=capacity, page_size=PAGE_SIZE,
                        state_slots=2)
    src = build_layout(peers.prefill[0], 1 << 40)
    dst = build_layout(peers.decode, 1 << 44)
    groups = kvplan.LayerGroups.fixed(group_size)
    template = kvplan.Template(src, dst, layer_groups=groups)
    slices = template.layer_slices(groups)
    sp, dp = _pages(tokens, capacity, seed=3)
    plan = template.plan(sp, dp)
    state = template.plan_state(0, 1) if len(template.state_pairs) else None
    n_slices = slices.n_slices + 1  # and the seal
    cut_ns = statistics.median(call_times_ns(lambda: slices.of(plan), 200, warmup=20))
    layers = list(range(preset.num_layers))
    with StreamingSubmitter(NullTransport(), slices, min_stream_bytes=0) as s:
        def request() -> None:
            req = s.open("r", plan, "peer", state_plan=state)
            for layer in layers:
                req.ready(layer)
            req.seal()
            req.wait(10)

        req_ns = statistics.median(call_times_ns(request, 41, warmup=5))
    return {"cut_ns_per_slice": cut_ns / n_slices, "submit_ns_per_slice": req_ns / n_slices,
            "request_ns": req_ns, "n_slices": n_slices}


def oversleep_ms(n: int = 100) -> float:
    """Median ms by which ``time.sleep(1 ms)`` overshoots here and now: how late a woken thread
    runs on this machine at the moment (every ready signal and completion pays it)."""
    late = []
    for _ in range(n):
        t0 = time.perf_counter()
        time.sleep(1e-3)
        late.append((time.perf_counter() - t0 - 1e-3) * 1e3)
    return statistics.median(late)


def run_engine(engine: str, preset: ModelPreset, token_counts: list[int]) -> list[dict[str, Any]]:
    from support.engine_peers import cluster

    capacity = 2 * (max(token_counts) // PAGE_SIZE) + 8  # room for the fragmented pages
    peers = model_peers(preset, pages=capacity, page_size=PAGE_SIZE, state_slots=2)
    decode, stage = peers.decode, peers.prefill[0]
    rows: list[dict[str, Any]] = []
    with cluster(decode, [stage], engine=engine) as c:
        prefill, dpeer = c.peers[stage.name], c.peers["decode"]
        session = c.sessions[stage.name]
        wire = dpeer.layout_wire

        def mono(name: str, sp: np.ndarray, dp: np.ndarray) -> dict[str, Any]:
            out = prefill.call("transfer", wire, session, sp, dp, 0, 1, None, name.encode(),
                               timeout=300)
            if engine == "nixl":
                dpeer.call("wait_notification", prefill.session, name.encode(), 60.0)
            return out

        def stream(name: str, sp: np.ndarray, dp: np.ndarray, group: int,
                   layer_ms: float) -> dict[str, Any]:
            spec = {"name": name, "session": session, "src_pages": sp, "dst_pages": dp,
                    "src_slot": 0, "dst_slot": 1}
            out = prefill.call("stream", wire, [spec], group, list(range(preset.num_layers)),
                               layer_ms, 0, (), 60.0, timeout=300)
            if engine == "nixl":
                dpeer.call("wait_notification", prefill.session, name.encode(), 60.0)
            r = out["requests"][name]
            if not r["ok"]:
                raise RuntimeError(f"{engine} {preset.key} {name}: {r['error']}")
            return r

        for tokens in token_counts:
            wake_ms = oversleep_ms()
            sp, dp = _pages(tokens, capacity, seed=tokens)
            mono("warm", sp, dp)  # connections and caches warm
            runs = [mono(f"m{tokens}.{k}", sp, dp) for k in range(3)]
            best = min(runs, key=lambda m: m["transfer_s"])
            bandwidth = best["bytes"] / best["transfer_s"]
            per_layer_s = best["bytes"] / preset.num_layers / bandwidth
            fast_ms = max(0.5, 2e3 * per_layer_s)
            plans = [(g, fast_ms, True) for g in (1, 4, preset.num_layers)]
            if tokens == token_counts[-1]:
                plans.append((4, fast_ms / 8, False))
            for group, layer_ms, compute_wins in plans:
                reps = [stream(f"s{tokens}.{group}.{k}", sp, dp, group, layer_ms)
                        for k in range(REPS)]
                r = sorted(reps, key=lambda x: x["tail_s"])[REPS // 2]  # the median tail
                best_tail = min(x["tail_s"] for x in reps)
                m = kvplan.WorkManifest.from_bytes(r["manifest"])
                sent = [nbytes for _, _, nbytes in m.slices if nbytes]
                last_bytes = (sent[-1] if sent else 0) + m.seal[1]
                ov = overhead(preset, tokens, group)
                rows.append({
                    "engine": engine, "model": preset.key, "tokens": tokens, "group": group,
                    "layer_ms": layer_ms, "compute_wins": compute_wins,
                    "per_layer_transfer_ms": per_layer_s * 1e3,
                    "bandwidth": bandwidth,
                    "mono_tail_ms": (best["plan_s"] + best["transfer_s"]) * 1e3,
                    "mono_blocks": best["blocks"],
                    "tail_ms": r["tail_s"] * 1e3, "best_tail_ms": best_tail * 1e3,
                    "total_ms": r["seconds"] * 1e3, "wake_ms": wake_ms,
                    "blocks": r["blocks"], "bytes": r["bytes"], "slices": r["slices"],
                    "submissions": r["submissions"], "last_bytes": last_bytes,
                    "target_ms": (1.2 * last_bytes / bandwidth + 200e-6) * 1e3, **ov})
                print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict[str, Any]) -> str:
    met = "yes" if r["tail_ms"] <= r["target_ms"] else "no"
    applies = "" if r["compute_wins"] else " (compute < transfer)"
    return (f"| {r['engine']} | {r['model']} | {r['tokens']} | {r['group']} | "
            f"{r['layer_ms']:.2f} / {r['per_layer_transfer_ms']:.2f}{applies} | "
            f"{r['bandwidth'] / 1e9:.2f} | {r['last_bytes'] / 2**20:.2f} | "
            f"{r['tail_ms']:.2f} ({r['best_tail_ms']:.2f}) | {r['target_ms']:.2f} | "
            f"{met if r['compute_wins'] else '-'} | {r['wake_ms']:.2f} | "
            f"{r['mono_tail_ms']:.2f} | {r['total_ms']:.1f} | {r['blocks']} | {r['slices']} | "
            f"{r['cut_ns_per_slice']:.0f} | {r['submit_ns_per_slice'] / 1e3:.1f} | "
            f"{_us(r['marginal_ns_per_slice'])} |")


def _us(ns: float) -> str:
    return "-" if ns != ns else f"{ns / 1e3:.1f}"


HEADER = [
    "| engine | model | tokens | group | layer ms / per-layer transfer ms | loopback GB/s "
    "| last group MiB | tail ms (best) | target ms | tail met | wake-up lag ms "
    "| monolithic tail ms | total ms "
    "| blocks | slices | slicing ns/slice | submitter µs/slice | marginal µs/slice |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="mooncake,nixl")
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    load = os.getloadavg()[0]
    token_counts = [int(t) for t in args.tokens.split(",")]
    t0 = time.perf_counter()
    print("\n".join(HEADER), flush=True)
    rows: list[dict[str, Any]] = []
    for engine in args.engines.split(","):
        for key in MODELS:
            rows += run_engine(engine, get_preset(key), token_counts)
    elapsed = time.perf_counter() - t0
    lines = ["# Layer-wise streaming: transfer tail and per-slice overhead", "",
             "Command:", "", f"    .venv/bin/python bench/streaming.py --engines "
             f"{args.engines} --tokens {args.tokens}", "", *describe(load, kvplan.__version__),
             f"- whole run: {elapsed:.0f} s", "", *HEADER, *(_row(r) for r in rows)]
    # The table alone; streaming-results.md quotes a run and says what it means.
    path = write_lines(args.out, "streaming-run.md", lines)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
