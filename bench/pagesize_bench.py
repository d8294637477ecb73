"""Blocks and plan time of a 32k-token request when prefill and decode page sizes differ.

Prefill pages of 16 tokens to decode pages of 64 (token plans) against equal page sizes (16 to
16 and 64 to 64, whole-page plans), for DeepSeek-V3 (MLA latent, 61 layers, token-major) and
Qwen3-235B (4 KV heads x 128, K and V, 94 layers) in NHD and HND order. Pages are consecutive on
the prefill side; the decode side is contiguous or fragmented (a fraction of its page boundaries
broken). Plan time is the median of repeated ``Template.plan`` calls into a reused ``out=``.

    .venv/bin/python bench/pagesize_bench.py [--tokens 32768] [--repeat 50]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from harness.timing import call_times_ns

import kvplan
from kvplan.presets import fragmented_pages

MODELS = {
    # name: (layers, kv heads per rank, head_dim, separate K and V)
    "deepseek-v3": (61, 1, 576, False),
    "qwen3-235b": (94, 4, 128, True),
}


def layout(model: str, page_size: int, pages: int, base: int, order: str) -> kvplan.Layout:
    layers, heads, head_dim, kv = MODELS[model]
    item = page_size * heads * head_dim * 2
    geometry = dict(kv_heads=heads, head_dim=head_dim, dtype_size=2, memory_order=order,
                    page_size=page_size)
    n = 2 * layers if kv else layers
    ptrs = [base + i * item * pages for i in range(n)]
    ids = list(range(layers))
    if kv:
        return kvplan.Layout.mha(ptrs[:layers], ptrs[layers:], [item * pages] * layers,
                                 [item * pages] * layers, item, item, ids, **geometry)
    return kvplan.Layout.mla(ptrs, [item * pages] * n, item, ids, **geometry)


def measure(model: str, order: str, ps: int, pd: int, tokens: int, frag: float,
            repeat: int) -> tuple[int, float]:
    n_src, n_dst = tokens // ps, tokens // pd
    cap_src, cap_dst = 2 * n_src, 2 * n_dst
    src = layout(model, ps, cap_src, 1 << 40, order)
    dst = layout(model, pd, cap_dst, 1 << 46, order)
    t = kvplan.Template(src, dst)
    src_pages = np.arange(n_src, dtype=np.int32)
    dst_pages = fragmented_pages(n_dst, frag, seed=1, capacity=cap_dst).astype(np.int32)
    plan = t.plan(src_pages, dst_pages)
    out = np.empty((3, plan.n_blocks), dtype=np.uint64)
    times = call_times_ns(lambda: t.plan(src_pages, dst_pages, out=out), repeat)
    return plan.n_blocks, statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    print(f"{args.tokens} tokens; median of {args.repeat} plans into a reused out=\n")
    print("| model | order | prefill → decode page | decode fragmentation | blocks | plan µs |")
    print("| --- | --- | --- | --- | ---: | ---: |")
    for model in MODELS:
        orders = ["NHD"] if model == "deepseek-v3" else ["NHD", "HND"]
        for order in orders:
            for frag in (0.0, 0.3, 1.0):
                for ps, pd in ((16, 16), (64, 64), (16, 64), (64, 16)):
                    blocks, us = measure(model, order, ps, pd, args.tokens, frag, args.repeat)
                    print(f"| {model} | {order} | {ps} → {pd} | {frag:.1f} | {blocks:,} | "
                          f"{us:,.1f} |")


if __name__ == "__main__":
    main()
