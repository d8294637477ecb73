"""Network blocks and plan time per decode DCP rank, direct and through a pack buffer.

Kimi-K3-shaped request: 57,344 (56K) global tokens, 24 MLA layers of 576-byte FP8 rows, a prefill
at DCP 1 (64-token pages, consecutive) sending to a decode at DCP 8 with token round robin
(interleave 1, SGLang) or page-sized deals (interleave 64, vLLM), 64-token decode pages that are
consecutive or have 30 % of their boundaries broken. For each decode rank: the blocks of the
direct plan (every one a network descriptor), the gather and network blocks of the pack plan, and
the median time of `Template.plan` and of `Template.plan_packed` (gather + network, both planned).

    .venv/bin/python bench/dcp_bench.py [--tokens 57344] [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from harness.timing import call_times_ns

import kvplan
from kvplan.presets import fragmented_pages

LAYERS = 24
ROW = 576  # bytes of one token's latent row per layer (FP8)
PAGE = 64
DCP = 8


def layout(pages: int, base: int, **dcp: int) -> kvplan.Layout:
    item = PAGE * ROW
    ptrs = [base + k * item * pages for k in range(LAYERS)]
    return kvplan.Layout.mla(ptrs, [item * pages] * LAYERS, item, list(range(LAYERS)),
                             page_size=PAGE, **dcp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=57344)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    n = args.tokens
    src_count = -(-n // PAGE)
    src = layout(2 * src_count, 1 << 40)
    src_pages = np.arange(src_count, dtype=np.int32)
    print(f"{n} tokens x {LAYERS} layers x {ROW}-byte rows, prefill DCP 1 -> decode DCP {DCP}; "
          f"median of {args.repeat} calls\n")
    print("| deal | decode fragmentation | rank | direct blocks | gather blocks | network blocks "
          "| pack MiB | direct plan µs | gather + network plan µs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for interleave, deal in ((1, "token (I=1)"), (PAGE, f"page (I={PAGE})")):
        for frag in (0.0, 0.3):
            for rank in (0, DCP - 1):
                share = sum(min(interleave, max(0, n - start))
                            for start in range(rank * interleave, n, DCP * interleave))
                dst_count = -(-share // PAGE)
                dst = layout(2 * dst_count, 1 << 46, dcp_size=DCP, dcp_rank=rank,
                             dcp_interleave=interleave)
                dst_pages = fragmented_pages(dst_count, frag, seed=rank,
                                             capacity=2 * dst_count).astype(np.int32)
                t = kvplan.Template(src, dst)
                direct = t.plan(src_pages, dst_pages, n_tokens=n)
                pack = (1 << 44, direct.total_bytes)
                gather, network = t.plan_packed(src_pages, dst_pages, n_tokens=n, pack=pack)
                d_us = statistics.median(call_times_ns(
                    lambda: t.plan(src_pages, dst_pages, n_tokens=n), args.repeat, 3)) / 1e3
                p_us = statistics.median(call_times_ns(
                    lambda: t.plan_packed(src_pages, dst_pages, n_tokens=n, pack=pack),
                    args.repeat, 3)) / 1e3
                print(f"| {deal} | {frag:.1f} | {rank} | {direct.n_blocks:,} | "
                      f"{gather.n_blocks:,} | {network.n_blocks:,} | "
                      f"{direct.total_bytes / 2**20:.1f} | {d_us:,.1f} | {p_us:,.1f} |")


if __name__ == "__main__":
    main()
