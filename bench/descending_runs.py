"""Descriptors per request when pages come in descending order (offload / eviction order).

A request of ``--pages`` pages, handed over as descending stretches of ``--stretch`` pages on
both sides (e.g. ``[7, 6, 5] -> [3, 2, 1]``, stretches at random places), planned by kvplan (runs
that descend on both sides coalesce) and counted under SGLang's ascending-only rule
(``kvplan.group_contiguous`` runs x emitting entries). Both plans copy the same bytes (checked
here as totals; the tests check byte maps). Blocks, bytes per block and the reduction are
printed; no timing.

    .venv/bin/python bench/descending_runs.py [--preset deepseek-v3] [--pages 4096] [--stretch 64]
"""

from __future__ import annotations

import argparse

import numpy as np

import kvplan
from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset


def descending_pages(n: int, stretch: int, capacity: int, seed: int) -> np.ndarray:
    """``n`` distinct pages in descending stretches of ``stretch`` pages at random places."""
    rng = np.random.default_rng(seed)
    starts = rng.permutation(capacity // stretch)[: -(-n // stretch)] * stretch
    pages = np.concatenate([np.arange(s + stretch - 1, s - 1, -1) for s in starts])
    return pages[:n].astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--stretch", type=int, default=64)
    args = ap.parse_args()
    preset = get_preset(args.preset)
    capacity = 4 * args.pages
    layers = range(preset.num_layers)
    src = preset.layout(layers, page_size=1, capacity=capacity, base=PREFILL_BASE)
    dst = preset.layout(layers, page_size=1, capacity=capacity, base=DECODE_BASE)
    template = kvplan.Template(src, dst)
    sp = descending_pages(args.pages, args.stretch, capacity, seed=1)
    dp = descending_pages(args.pages, args.stretch, capacity, seed=2)
    print(f"{args.preset}: {preset.num_layers} layers, {args.pages} pages in descending "
          f"stretches of {args.stretch} on both sides")
    print(f"{'order':<12} {'planner':<28} {'runs':>7} {'blocks':>9} {'bytes/block':>12}")
    for order, (s, d) in [("descending", (sp, dp)), ("ascending", (sp[::-1].copy(), dp[::-1].copy()))]:
        plan = template.plan(s, d)
        sglang_runs = len(kvplan.group_contiguous(s, d)[2])
        entries = sum(template.emitting)
        sglang_blocks = sglang_runs * entries
        rows = [("kvplan", plan.n_runs, plan.n_blocks),
                ("ascending-only (SGLang rule)", sglang_runs, sglang_blocks)]
        for name, runs, blocks in rows:
            print(f"{order:<12} {name:<28} {runs:>7,} {blocks:>9,} "
                  f"{plan.total_bytes / blocks:>12,.0f}")
        print(f"{'':<12} reduction: {sglang_blocks / plan.n_blocks:.1f}x fewer blocks")


if __name__ == "__main__":
    main()
