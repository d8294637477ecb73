"""Large page plans against the store-bandwidth floor, measured in one process: a 61-layer
DeepSeek-V3-like MLA request at page size 1 with every page its own run (61 blocks per page),
planned with ``out=`` into a warm buffer, next to ``ndarray.fill`` of the same ``(3, M)`` buffer
(writing 24 bytes per block, the cost no emitter with ordinary stores can beat).

    .venv/bin/python bench/emission_floor.py [--blocks 100000 2000000] [--repeat 30] [--tp]

Prints ns per block (best of ``repeat``) for the plan and for the fill, and their ratio. With
``--tp``, also the kvplan side of ``bench/tp_bench.py`` (head-sliced plans of one rank pair of an
80-layer, 8-KV-head model, page 64, 32k tokens, TP 8 -> 2 and 2 -> 8), which needs no SGLang.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvplan
from kvplan.presets import get_preset


def best_ns(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[100_000, 2_000_000])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--tp", action="store_true", help="also time head-sliced TP plans")
    args = ap.parse_args()
    preset = get_preset("deepseek-v3")
    print(f"kvplan {kvplan.__version__}: 61-layer MLA, page size 1, one run per page; "
          f"best of {args.repeat}")
    for want in args.blocks:
        pages = max(1, want // 61)
        src = preset.layout(range(61), page_size=1, capacity=2 * pages + 2)
        dst = preset.layout(range(61), page_size=1, capacity=2 * pages + 2,
                            base=0x9000_0000_0000)
        template = kvplan.Template(src, dst)
        sp = np.arange(0, 2 * pages, 2, dtype=np.int32)  # every page its own run
        dp = np.arange(1, 2 * pages + 1, 2, dtype=np.int32)
        n = template.plan(sp, dp).n_blocks
        out = np.empty((3, n), dtype=np.uint64)
        plan_ns = best_ns(lambda: template.plan(sp, dp, out=out), args.repeat) / n
        fill_ns = best_ns(lambda: out.fill(7), args.repeat) / n
        print(f"  {n:>9,} blocks: plan(out=) {plan_ns:.2f} ns/block, fill {fill_ns:.2f} "
              f"ns/block, ratio {plan_ns / fill_ns:.2f}")

    if args.tp:
        tp_timing(args.repeat)


def tp_timing(repeat: int) -> None:
    from tp_bench import kvplan_template  # bench/ is the working directory

    layers, heads, head_dim, dtype, page, tokens = 80, 8, 128, 2, 64, 32768
    n = tokens // page
    src_pages = np.arange(n, dtype=np.int64)
    dst_pages = np.arange(n, dtype=np.int64) + 7
    for order in ("NHD", "HND"):
        for tp_p, r_p, tp_d, r_d in ((8, 5, 2, 1), (2, 1, 8, 5)):
            t = kvplan_template(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype,
                                page=page, tp_p=tp_p, r_p=r_p, tp_d=tp_d, r_d=r_d,
                                src_base=1 << 40, dst_base=1 << 44, pages_cap=n + 8, order=order)
            blocks = t.plan(src_pages, dst_pages).n_blocks
            best = best_ns(lambda: t.plan(src_pages, dst_pages), repeat) / 1e3
            print(f"  TP {tp_p} -> {tp_d} ({order}, rank {r_p} -> {r_d}): {blocks:,} blocks, "
                  f"best {best:.1f} us")


if __name__ == "__main__":
    main()
