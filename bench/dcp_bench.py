"""Blocks and plan time per decode DCP rank: kvplan (direct and packed) against SGLang 0.5.23.

Kimi-K3-shaped request: 57,344 (56K) global tokens, 24 MLA layers of 576-byte FP8 rows, a prefill
at DCP 1 (64-token pages, consecutive) sending to a decode at DCP 8, 64-token decode pages that
are consecutive or have 30 % of their boundaries broken; and a smaller one (8,192 tokens, DCP 4).

Token round robin (interleave 1) is what SGLang deals, so there both sides run on the same
request: SGLang's real ``MooncakeKVManager.send_kvcache_dcp`` (which plans with its
``build_dcp_token_transfer_plan``), without a pack buffer (one block per token run per layer) and
with one (``try_pack_dcp_src``: its gather is a Triton kernel on a CUDA device that cannot run
here, so torch and the kernel are no-op stand-ins and what is timed is SGLang's Python around it,
the gather launch excluded), both with ``_transfer_data`` replaced by a recorder (planning only,
no hand-off to an engine); and kvplan's ``Template.plan`` and ``Template.plan_packed``. The byte
maps of SGLang's and kvplan's direct blocks, and of their network blocks from the same pack
buffer, are checked equal before timing. ``Template.plan_row_gather`` (the gather as source rows,
as a gather kernel takes it, and the same network plan, checked equal) is timed too. Page-sized
deals (interleave 64, vLLM) are kvplan only.

    .venv/bin/python bench/dcp_bench.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import types
from collections.abc import Callable
from typing import Any

import numpy as np
from harness.machine import summary  # importing harness puts tests/ on sys.path: support.*
from harness.timing import call_times_ns
from support import sglang_loader
from support.sglang_loader import BlockRecorder, HostPackBuffer
from support.sglang_models import SESSION, canonical

import kvplan
from kvplan.presets import fragmented_pages

LAYERS = 24
ROW = 576  # bytes of one token's latent row per layer (FP8)
PAGE = 64
CASES = ((57344, 8), (8192, 4))  # (global tokens, decode DCP size)
SRC_BASE, DST_BASE, PACK_BASE = 1 << 40, 1 << 46, 1 << 44


def layer_ptrs(base: int, pages: int) -> list[int]:
    return [base + k * PAGE * ROW * pages for k in range(LAYERS)]


def layout(pages: int, base: int, **dcp: int) -> kvplan.Layout:
    item = PAGE * ROW
    return kvplan.Layout.mla(layer_ptrs(base, pages), [item * pages] * LAYERS, item,
                             list(range(LAYERS)), page_size=PAGE, **dcp)


def blocks_of(plan: kvplan.TransferPlan) -> list[tuple[int, int, int]]:
    return list(zip(*plan.as_lists()))


def sglang_send(sg: Any, src_pages: np.ndarray, dst_pages: np.ndarray, *, n: int, size: int,
                rank: int, src_capacity: int, dst_capacity: int, pack: HostPackBuffer | None
                ) -> tuple[Callable[[], int], BlockRecorder]:
    """SGLang's send_kvcache_dcp on a manager built without ``__init__``; its one
    ``_transfer_data`` call goes to a recorder, so the call is planning only."""
    item = PAGE * ROW
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=layer_ptrs(SRC_BASE, src_capacity), kv_data_lens=[item * src_capacity] * LAYERS,
        kv_item_lens=[item] * LAYERS, kv_layer_ids=list(range(LAYERS)), num_draft_entries=0,
        page_size=PAGE, prefill_start_layer=0, engine_rank=0)
    recorder = BlockRecorder()
    mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=kv_args, is_mla_backend=True,
                            _transfer_data=recorder)
    dst_ptrs = layer_ptrs(DST_BASE, dst_capacity)

    def call() -> int:
        recorder.calls.clear()
        return mgr.send_kvcache_dcp(
            SESSION, src_pages, dst_ptrs, dst_pages, dcp_token_item_lens=[ROW] * LAYERS,
            dst_dcp_size=size, dst_dcp_rank=rank, src_page_offset=0, decode_prefix_len=0,
            num_kv_tokens=n, executor=None, dst_layer_ids=list(range(LAYERS)), pack_buffer=pack)

    return call, recorder


def median_us(fn: Callable[[], Any], repeat: int) -> float:
    return statistics.median(call_times_ns(fn, repeat, 3)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    sg = sglang_loader.load_sglang()
    sglang_loader.load_dcp_pack(sg)
    print(f"SGLang {sg.version}, {summary()}; {LAYERS} layers x {ROW}-byte rows, {PAGE}-token "
          f"pages, prefill DCP 1; median of {args.repeat} calls\n")
    sg_rows = []
    kv_rows = []
    for n, size in CASES:
        src_count = -(-n // PAGE)
        src = layout(2 * src_count, SRC_BASE)
        src_pages = np.arange(src_count, dtype=np.int32)
        for interleave in (1, PAGE):
            for frag in (0.0, 0.3):
                for rank in (0, size - 1):
                    share = sum(min(interleave, max(0, n - start))
                                for start in range(rank * interleave, n, size * interleave))
                    dst_count = -(-share // PAGE)
                    dst = layout(2 * dst_count, DST_BASE, dcp_size=size, dcp_rank=rank,
                                 dcp_interleave=interleave)
                    dst_pages = fragmented_pages(dst_count, frag, seed=rank,
                                                 capacity=2 * dst_count).astype(np.int32)
                    t = kvplan.Template(src, dst)
                    direct = t.plan(src_pages, dst_pages, n_tokens=n)
                    pack = (PACK_BASE, direct.total_bytes)
                    gather, network = t.plan_packed(src_pages, dst_pages, n_tokens=n, pack=pack)
                    rows, row_network = t.plan_row_gather(src_pages, dst_pages, n_tokens=n,
                                                          pack=pack)
                    assert row_network.as_lists() == network.as_lists()
                    d_us = median_us(lambda: t.plan(src_pages, dst_pages, n_tokens=n),
                                     args.repeat)
                    p_us = median_us(lambda: t.plan_packed(src_pages, dst_pages, n_tokens=n,
                                                           pack=pack), args.repeat)
                    r_us = median_us(lambda: t.plan_row_gather(src_pages, dst_pages, n_tokens=n,
                                                               pack=pack), args.repeat)
                    kv_rows.append((n, size, interleave, frag, rank, direct.n_blocks,
                                    gather.n_blocks, sum(r.size for r in rows.rows),
                                    network.n_blocks, direct.total_bytes / 2**20, d_us, p_us,
                                    r_us))
                    if interleave != 1:
                        continue
                    common = dict(n=n, size=size, rank=rank, src_capacity=2 * src_count,
                                  dst_capacity=2 * dst_count)
                    s_direct, rec_d = sglang_send(sg, src_pages, dst_pages, pack=None, **common)
                    s_packed, rec_p = sglang_send(
                        sg, src_pages, dst_pages, pack=HostPackBuffer(*pack), **common)
                    assert s_direct() == 0 and s_packed() == 0
                    assert len(rec_d.calls) == len(rec_p.calls) == 1
                    assert canonical(rec_d.calls[0]) == canonical(blocks_of(direct))
                    assert canonical(rec_p.calls[0]) == canonical(blocks_of(network))
                    b_us = median_us(lambda: sg.modules[
                        "sglang.srt.disaggregation.common.utils"].build_dcp_token_transfer_plan(
                            src_pages, dst_pages, physical_page_size=PAGE, dcp_size=size,
                            dcp_rank=rank, num_kv_tokens=n), args.repeat)
                    sd_us = median_us(s_direct, args.repeat)
                    sp_us = median_us(s_packed, args.repeat)
                    sg_rows.append((n, size, frag, rank, len(rec_d.calls[0]),
                                    len(rec_p.calls[0]), b_us, sd_us, sp_us, d_us, p_us, r_us,
                                    direct.n_blocks, network.n_blocks))

    print("Token round robin, SGLang and kvplan on the same request (blocks per decode rank, "
          "plan µs)\n")
    print("| tokens | DCP | decode fragmentation | rank | SGLang direct blocks | kvplan direct "
          "blocks | SGLang packed network blocks | kvplan network blocks | SGLang "
          "build_dcp_token_transfer_plan µs | SGLang send_kvcache_dcp µs | kvplan plan µs | "
          "ratio | SGLang send_kvcache_dcp + pack µs | kvplan plan_packed µs | ratio | kvplan "
          "plan_row_gather µs | ratio |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: | ---: | ---: |")
    for (n, size, frag, rank, sgd, sgp, b_us, sd_us, sp_us, d_us, p_us, r_us, kvd,
         kvn) in sg_rows:
        print(f"| {n:,} | {size} | {frag:.1f} | {rank} | {sgd:,} | {kvd:,} | {sgp:,} | {kvn:,} "
              f"| {b_us:,.1f} | {sd_us:,.1f} | {d_us:,.1f} | {sd_us / d_us:.1f}x | "
              f"{sp_us:,.1f} | {p_us:,.1f} | {sp_us / p_us:.1f}x | {r_us:,.1f} | "
              f"{sp_us / r_us:.1f}x |")
    print("\nkvplan, token and page-sized deals\n")
    print("| tokens | DCP | deal | decode fragmentation | rank | direct blocks | gather blocks "
          "| gather rows | network blocks | pack MiB | direct plan µs | plan_packed µs "
          "(block gather + network) | plan_row_gather µs (row gather + network) |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: |")
    for (n, size, interleave, frag, rank, kvd, kvg, kvr, kvn, mib, d_us, p_us,
         r_us) in kv_rows:
        deal = "token (I=1)" if interleave == 1 else f"page (I={interleave})"
        print(f"| {n:,} | {size} | {deal} | {frag:.1f} | {rank} | {kvd:,} | {kvg:,} | {kvr:,} "
              f"| {kvn:,} | {mib:.1f} | {d_us:,.1f} | {p_us:,.1f} | {r_us:,.1f} |")


if __name__ == "__main__":
    main()
