"""Descriptors per request when pages come in descending order (offload / eviction order).

A request of ``--pages`` pages, handed over as descending stretches of ``--stretch`` pages on
both sides (e.g. ``[7, 6, 5] -> [3, 2, 1]``, stretches at random places), planned by kvplan (runs
that descend on both sides coalesce) and counted under SGLang's ascending-only rule
(``kvplan.group_contiguous`` runs x emitting entries). Both plans copy the same bytes (checked
here as totals; the tests check byte maps). Blocks, bytes per block and the reduction are
printed; no timing.

With ``--kernel-blocks K`` (K > 1) the pages are vLLM's logical blocks, each expanded into K
consecutive kernel blocks before planning (``_logical_to_kernel_block_ids``), and the rows are
kvplan on the blocks expanded as handed over, kvplan on the blocks reordered first
(``reverse_descending_runs``, what the vLLM Mooncake drop-in plans), and vLLM 0.34's rule
(stretches descending on both sides reversed, then ascending runs x entries).

    .venv/bin/python bench/descending_runs.py [--preset deepseek-v3] [--pages 4096] [--stretch 64]
                                              [--kernel-blocks 1]
"""

from __future__ import annotations

import argparse

import numpy as np

import kvplan
from kvplan._core import reverse_descending_runs
from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset


def descending_pages(n: int, stretch: int, capacity: int, seed: int) -> np.ndarray:
    """``n`` distinct pages in descending stretches of ``stretch`` pages at random places."""
    rng = np.random.default_rng(seed)
    starts = rng.permutation(capacity // stretch)[: -(-n // stretch)] * stretch
    pages = np.concatenate([np.arange(s + stretch - 1, s - 1, -1) for s in starts])
    return pages[:n].astype(np.int64)


def kernel_blocks(ids: np.ndarray, k: int) -> np.ndarray:
    """Each logical block id expanded into its ``k`` kernel block ids, as vLLM expands them."""
    return (ids[:, None] * k + np.arange(k)).reshape(-1)


def vllm_034_order(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vLLM 0.34's ``_normalize_paired_block_order``: each stretch of steps -1 on both sides,
    with the block before it, reversed in place."""
    s, d = src.copy(), dst.copy()
    down = (np.diff(src) == -1) & (np.diff(dst) == -1)
    for a, b in np.flatnonzero(np.diff(down, prepend=False, append=False)).reshape(-1, 2):
        s[a:b + 1], d[a:b + 1] = s[a:b + 1][::-1].copy(), d[a:b + 1][::-1].copy()
    return s, d


def kernel_rows(template: kvplan.Template, s: np.ndarray, d: np.ndarray,
                k: int) -> list[tuple[str, int, int, int]]:
    """``(planner, runs, blocks, bytes)`` of logical blocks ``s -> d`` expanded by ``k``."""
    as_given = template.plan(kernel_blocks(s, k), kernel_blocks(d, k))
    reordered = reverse_descending_runs(s, d) or (s, d)
    drop_in = template.plan(kernel_blocks(reordered[0], k), kernel_blocks(reordered[1], k))
    vs, vd = vllm_034_order(s, d)
    vllm_runs = len(kvplan.group_contiguous(kernel_blocks(vs, k), kernel_blocks(vd, k))[2])
    entries = sum(template.emitting)
    return [("kvplan, expanded as given", as_given.n_runs, as_given.n_blocks,
             as_given.total_bytes),
            ("kvplan, reordered first", drop_in.n_runs, drop_in.n_blocks, drop_in.total_bytes),
            ("vLLM 0.34 rule", vllm_runs, vllm_runs * entries, drop_in.total_bytes)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--stretch", type=int, default=64)
    ap.add_argument("--kernel-blocks", type=int, default=1,
                    help="kernel blocks per logical block (vLLM's expansion before planning)")
    args = ap.parse_args()
    preset = get_preset(args.preset)
    capacity = 4 * args.pages
    k = args.kernel_blocks
    layers = range(preset.num_layers)
    src = preset.layout(layers, page_size=1, capacity=capacity * k, base=PREFILL_BASE)
    dst = preset.layout(layers, page_size=1, capacity=capacity * k, base=DECODE_BASE)
    template = kvplan.Template(src, dst)
    sp = descending_pages(args.pages, args.stretch, capacity, seed=1)
    dp = descending_pages(args.pages, args.stretch, capacity, seed=2)
    print(f"{args.preset}: {preset.num_layers} layers, {args.pages} pages in descending "
          f"stretches of {args.stretch} on both sides"
          + (f", {k} kernel blocks per page" if k > 1 else ""))
    if k > 1:
        print(f"{'order':<12} {'planner':<28} {'runs':>7} {'blocks':>9} {'bytes/block':>12}")
        for order, (s, d) in [("descending", (sp, dp)),
                              ("ascending", (sp[::-1].copy(), dp[::-1].copy()))]:
            for name, runs, blocks, total in kernel_rows(template, s, d, k):
                print(f"{order:<12} {name:<28} {runs:>7,} {blocks:>9,} {total / blocks:>12,.0f}")
        return
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
