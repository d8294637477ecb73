"""Per-layer vs cross-layer KV layout for one DeepSeek-V3-like request: blocks per request and
plan time (in process), then a real Mooncake TCP transfer of the same request with both layouts
next to Mooncake's own throughput for one large block, measured in the same run between two
processes (``kvplan.testing.PeerProcess``, TCP on 127.0.0.1).

    .venv/bin/python bench/cross_layer.py [--tokens 32768] [--page-size 1]
        [--transfer-tokens 32768] [--transfer-page-size 16] [--reps 3]

Model: ``kvplan.presets`` 'deepseek-v3' (61 MLA layers, 1152 B per token per layer), prefill
PP=1 -> decode PP=1. Per-layer: one buffer per layer on each side. Cross-layer: one pool per side,
per page the 61 layers' items side by side (``ModelPreset.layout(..., cross_layer=True)``).
Source pages contiguous, destination pages with 5 % / 100 % breaks
(``kvplan.presets.fragmented_pages``, runs shuffled, seed 1).

Planning: ``Template.plan`` on synthetic addresses, median of ``--plan-reps`` calls after one
warm-up (template built once). Transfer: the prefill process plans and submits with
``MooncakeTransport.submit`` (batches of <= 1,024 blocks); the time is the submit (list
building + engine), median of ``--reps``. Every byte of the request is checked after the first
repetition of every case (``kvplan.testing.first_wrong_byte``, the whole decode arena). "one
large block" is one block of the request's byte count from the start of the prefill arena to the
start of the decode arena.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from typing import Any

import numpy as np
from harness.machine import summary
from harness.timing import call_times_ns

import kvplan
from kvplan.presets import DECODE_BASE, PREFILL_BASE, fragmented_pages, get_preset
from kvplan.testing import (
    SENTINEL,
    Arena,
    PeerProcess,
    arena_dir,
    fill_source,
    first_wrong_byte,
    preset_peer,
)

LAYOUTS = ("per-layer", "cross-layer")


def plan_table(tokens: int, page_size: int, fragmentations: list[float], reps: int
               ) -> list[str]:
    model = get_preset("deepseek-v3")
    n = tokens // page_size
    cap = 2 * n  # room for every break (max_gap 1)
    layers = range(model.num_layers)
    src_pages = np.arange(n, dtype=np.int64)
    rows = [f"Planning: DeepSeek-V3, {model.num_layers} layers, {tokens:,} tokens, page size "
            f"{page_size} ({n:,} pages); median of {reps} plans",
            "| fragmentation | layout | runs | blocks | blocks vs per-layer | plan (µs) |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for f in fragmentations:
        dst_pages = fragmented_pages(n, f, seed=1, shuffle_runs=True, capacity=cap)
        blocks = {}
        for lay in LAYOUTS:
            cross = lay == "cross-layer"
            t = kvplan.Template(
                model.layout(layers, page_size=page_size, capacity=cap, base=PREFILL_BASE,
                             cross_layer=cross),
                model.layout(layers, page_size=page_size, capacity=cap, base=DECODE_BASE,
                             cross_layer=cross))
            plan = t.plan(src_pages, dst_pages)  # warm-up (buffer pool)
            n_blocks, n_runs = plan.n_blocks, plan.n_runs
            del plan
            times = call_times_ns(lambda: t.plan(src_pages, dst_pages), reps)
            blocks[lay] = n_blocks
            ratio = ("1" if lay == "per-layer" else
                     f"÷{blocks['per-layer'] / n_blocks:.1f}")
            rows.append(f"| {f:.0%} | {lay} | {n_runs:,} | {n_blocks:,} | {ratio} | "
                        f"{statistics.median(times) / 1e3:,.0f} |")
    return rows


def transfer_table(tokens: int, page_size: int, fragmentations: list[float], reps: int,
                   timeout: float) -> list[str]:
    model = get_preset("deepseek-v3")
    n = tokens // page_size
    cap = 2 * n
    layers = range(model.num_layers)
    item = model.kv_bytes_per_token * page_size
    req_bytes = n * item * model.num_layers
    specs = {lay: (preset_peer(model, "prefill", layers, pages=n, page_size=page_size,
                               cross_layer=lay == "cross-layer"),
                   preset_peer(model, "decode", layers, pages=cap, page_size=page_size,
                               cross_layer=lay == "cross-layer"))
             for lay in LAYOUTS}
    s_size = max(s.size for s, _ in specs.values())
    d_size = max(d.size for _, d in specs.values())
    work = arena_dir(s_size + d_size)
    rows = [f"Transfer: Mooncake TCP on 127.0.0.1, two processes, {tokens:,} tokens, page size "
            f"{page_size} ({n:,} pages, {item:,} B per page per layer), "
            f"{req_bytes / 2**30:.2f} GiB per request; median of {reps}",
            "| fragmentation | layout | blocks | plan (ms) | transfer (ms) | MiB/s | "
            "vs per-layer |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    src_pages = np.arange(n, dtype=np.int64)
    s_arena = Arena(os.path.join(work, "prefill"), s_size, create=True)
    d_arena = Arena(os.path.join(work, "decode"), d_size, create=True)
    log = os.path.join(work, "engines.log")
    try:
        fill_source(s_arena, 1)
        per_layer_s: dict[float, float] = {}
        table: dict[tuple[float, str], str] = {}
        large: list[dict[str, Any]] = []
        for lay in LAYOUTS:
            s_spec, d_spec = specs[lay]
            dpeer = PeerProcess(d_spec, d_arena, wait=False, log_path=log)
            speer = PeerProcess(s_spec, s_arena, wait=False, log_path=log)
            try:
                dpeer.ready()
                speer.ready()
                # Warm-up: the first write to a peer opens its connection; keep it out.
                speer.call("submit_raw", dpeer.session, [0], [dpeer.base], [4096])
                d_arena.array[:4096] = SENTINEL
                for f in fragmentations:
                    dst_pages = fragmented_pages(n, f, seed=1, shuffle_runs=True, capacity=cap)
                    d_arena.array[:] = SENTINEL  # earlier cases wrote other pages
                    runs = []
                    for rep in range(reps):
                        runs.append(speer.call("transfer", dpeer.layout_wire, dpeer.session,
                                               src_pages, dst_pages, None, None, None,
                                               timeout=timeout))
                        if rep == 0:
                            err = first_wrong_byte(d_arena, d_spec, [
                                (s_arena, s_spec, src_pages, dst_pages, None, None)])
                            if err is not None:
                                raise SystemExit(f"{lay} {f:.0%}: {err}")
                    tr = statistics.median(r["transfer_s"] for r in runs)
                    plan_ms = statistics.median(r["plan_s"] for r in runs) * 1e3
                    if lay == "per-layer":
                        per_layer_s[f] = tr
                        vs = "1"
                    else:
                        vs = f"{per_layer_s[f] / tr:.1f}× shorter"
                    table[(f, lay)] = (f"| {f:.0%} | {lay} | {runs[0]['blocks']:,} | {plan_ms:.2f} | "
                                f"{tr * 1e3:,.1f} | {runs[0]['bytes'] / tr / 2**20:,.0f} | "
                                f"{vs} |")
                if lay == "cross-layer":
                    for _ in range(reps):
                        large.append(speer.call("submit_raw", dpeer.session, [0], [dpeer.base],
                                                [req_bytes], timeout=timeout))
            finally:
                speer.stop()
                dpeer.stop()
        rows += [table[(f, lay)] for f in fragmentations for lay in LAYOUTS]
        tr = statistics.median(r["seconds"] for r in large)
        rows.append(f"| – | one large block ({req_bytes / 2**20:,.0f} MiB) | 1 | – | "
                    f"{tr * 1e3:,.1f} | {req_bytes / tr / 2**20:,.0f} | – |")
    finally:
        s_arena.close()
        d_arena.close()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="tokens (planning table)")
    ap.add_argument("--page-size", type=int, default=1, help="page size (planning table)")
    ap.add_argument("--plan-reps", type=int, default=21)
    ap.add_argument("--transfer-tokens", type=int, default=32768)
    ap.add_argument("--transfer-page-size", type=int, default=16)
    ap.add_argument("--fragmentation", type=float, nargs="+", default=[0.05, 1.0])
    ap.add_argument("--reps", type=int, default=3, help="transfers per case")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per transfer")
    ap.add_argument("--no-transfer", action="store_true")
    args = ap.parse_args()
    print(f"kvplan {kvplan.__version__}, {summary()}")
    for line in plan_table(args.tokens, args.page_size, args.fragmentation, args.plan_reps):
        print(line, flush=True)
    if args.page_size != args.transfer_page_size:
        print()
        for line in plan_table(args.transfer_tokens, args.transfer_page_size,
                               args.fragmentation, args.plan_reps):
            print(line, flush=True)
    if not args.no_transfer:
        print()
        rows = transfer_table(args.transfer_tokens, args.transfer_page_size,
                              args.fragmentation, args.reps, args.timeout)
        print("\n".join(rows))


if __name__ == "__main__":
    main()
