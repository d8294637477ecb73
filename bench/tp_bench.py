"""Prefill TP != decode TP: kvplan's head-sliced templates against SGLang 0.5.23's
``MooncakeKVManager.send_kvcache_slice`` (run from the real wheel by
tests/support/sglang_loader.py).

    .venv-bench/bin/python bench/tp_bench.py            # check + timing + blocks table
    .venv-bench/bin/python bench/tp_bench.py --check    # only the equality check

Check: for every (tp_p, tp_d) in {1,2,4,8}², H in {2,8,16}, on MHA/NHD layouts (the case
``send_kvcache_slice`` handles), every pair kvplan plans (its elected senders) gets the same
blocks from both, after merging blocks contiguous on both sides (so the same destination
bytes from the same source bytes). Timing: one (prefill rank, decode rank) pair of an
80-layer, 8-KV-head, head-dim-128, bf16 model, page 64, 32k tokens, TP 8 -> 2 and 2 -> 8;
SGLang's time is the whole call (its engine stand-in only records the lists it is handed),
kvplan's is ``Template.plan`` (the template is built once per peer pair, outside the loop).
"""

from __future__ import annotations

import argparse
import time
import types

import numpy as np

from harness.timing import NS, call_times_ns  # harness puts tests/ on sys.path: support.*
from support.sglang_loader import InlineExecutor, RecordingEngine, load_head_slicing, load_sglang

import kvplan


def sglang_slice(sg, *, layers, heads, head_dim, dtype, page, tp_p, r_p, tp_d, r_d,
                 src_base, dst_base, pages_cap, src_pages, dst_pages):
    """Blocks SGLang's send_kvcache_slice hands the engine for one pair: 3 flat lists."""
    M = sg.MooncakeKVManager
    src_item = page * max(1, heads // tp_p) * head_dim * dtype
    dst_item = page * max(1, heads // tp_d) * head_dim * dtype
    src_ptrs = [src_base + e * src_item * pages_cap for e in range(2 * layers)]
    dst_ptrs = [dst_base + e * dst_item * pages_cap for e in range(2 * layers)]
    ids = list(range(layers)) * 2
    kv_args = types.SimpleNamespace(
        kv_item_lens=[src_item] * (2 * layers), page_size=page, total_kv_head_num=heads,
        kv_head_num=max(1, heads // tp_p), engine_rank=r_p, kv_data_ptrs=src_ptrs,
        kv_layer_ids=ids, prefill_start_layer=0)
    self = types.SimpleNamespace(kv_args=kv_args, attn_tp_size=tp_p, pp_size=1,
                                 engine=RecordingEngine(),
                                 enable_deferred_decode_kv_release=False)
    self._await_transfer_futures = types.MethodType(M._await_transfer_futures, self)
    self.get_mha_kv_ptrs_with_pp = types.MethodType(sg.get_mha_kv_ptrs_with_pp, self)
    t0 = time.perf_counter()
    rc = M.send_kvcache_slice(self, "bench", np.asarray(src_pages, np.int32), dst_ptrs,
                              np.asarray(dst_pages, np.int32), r_d, tp_d, dst_item,
                              InlineExecutor(), dst_layer_ids=ids)
    dt = time.perf_counter() - t0
    assert rc == 0, rc
    calls = self.engine.calls
    src = [a for c in calls for a in c[1]]
    dst = [a for c in calls for a in c[2]]
    ln = [a for c in calls for a in c[3]]
    return (src, dst, ln), dt


def kvplan_template(*, layers, heads, head_dim, dtype, page, tp_p, r_p, tp_d, r_d, src_base,
                    dst_base, pages_cap, order="NHD"):
    def layout(base, tp, r):
        item = page * max(1, heads // tp) * head_dim * dtype
        ptrs = [base + e * item * pages_cap for e in range(2 * layers)]
        return kvplan.Layout.mha(ptrs[:layers], ptrs[layers:], [item * pages_cap] * layers,
                                 [item * pages_cap] * layers, item, item,
                                 layer_ids=list(range(layers)), page_size=page, tp_rank=r,
                                 tp_size=tp, kv_heads=heads, head_dim=head_dim,
                                 dtype_size=dtype, memory_order=order)
    return kvplan.Template(layout(src_base, tp_p, r_p), layout(dst_base, tp_d, r_d))


def merged(src, dst, ln):
    """Blocks sorted by destination, neighbours contiguous on both sides merged."""
    order = np.argsort(np.asarray(dst, np.uint64), kind="stable")
    s, d, n = (np.asarray(x, np.uint64)[order] for x in (src, dst, ln))
    out = []
    for a, b, c in zip(s.tolist(), d.tolist(), n.tolist()):
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1][2] += c
        else:
            out.append([a, b, c])
    return out


def check(sg) -> list[str]:
    lines, disagree = [], []
    cases = 0
    for heads in (2, 8, 16):
        for tp_p in (1, 2, 4, 8):
            for tp_d in (1, 2, 4, 8):
                for r_d in range(tp_d):
                    peers = kvplan.tp_peers(heads, tp_p, tp_d, decode_rank=r_d)
                    for r_p in peers.receive_from:
                        kw = dict(layers=3, heads=heads, head_dim=4, dtype=2, page=4, tp_p=tp_p,
                                  r_p=r_p, tp_d=tp_d, r_d=r_d, src_base=1 << 32,
                                  dst_base=1 << 40, pages_cap=8)
                        sp, dp = [0, 1, 2, 5, 6], [7, 3, 4, 0, 1]
                        (s, d, n), _ = sglang_slice(sg, src_pages=sp, dst_pages=dp, **kw)
                        plan = kvplan_template(**kw).plan(np.array(sp), np.array(dp))
                        a = merged(s, d, n)
                        b = merged(*plan.as_lists())
                        cases += 1
                        if a != b:
                            disagree.append(f"H={heads} TP {tp_p}->{tp_d} pair {r_p}->{r_d}: "
                                            f"SGLang {len(a)} merged blocks, kvplan {len(b)}")
    lines.append(f"equality check: {cases} elected (prefill rank, decode rank) pairs over "
                 f"H in {{2, 8, 16}}, TP {{1,2,4,8}}^2, MHA/NHD: "
                 f"{cases - len(disagree)} identical, {len(disagree)} differ")
    lines += disagree[:20]
    return lines


def timing(sg, repeat: int) -> list[str]:
    layers, heads, head_dim, dtype, page, tokens = 80, 8, 128, 2, 64, 32768
    n = tokens // page
    src_pages = np.arange(n, dtype=np.int64)
    dst_pages = np.arange(n, dtype=np.int64) + 7
    out = [f"model: {layers} layers, {heads} KV heads, head dim {head_dim}, bf16, page {page}, "
           f"{tokens} tokens ({n} pages), one contiguous run; best of {repeat}"]
    out.append("| pair | blocks | SGLang send_kvcache_slice | kvplan Template.plan | speed-up |")
    out.append("|---|---:|---:|---:|---:|")
    for tp_p, r_p, tp_d, r_d in ((8, 5, 2, 1), (2, 1, 8, 5)):
        kw = dict(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, page=page,
                  tp_p=tp_p, r_p=r_p, tp_d=tp_d, r_d=r_d, src_base=1 << 40, dst_base=1 << 44,
                  pages_cap=n + 8)
        sg_best = min(sglang_slice(sg, src_pages=src_pages, dst_pages=dst_pages, **kw)[1]
                      for _ in range(repeat))
        t = kvplan_template(**kw)
        kv_best = min(call_times_ns(lambda: t.plan(src_pages, dst_pages), repeat * 5)) * NS
        blocks = t.n_blocks_for(n, 1)
        out.append(f"| TP {tp_p} -> {tp_d} (prefill rank {r_p} -> decode rank {r_d}) | "
                   f"{blocks:,} | {sg_best * 1e3:,.1f} ms | {kv_best * 1e3:,.2f} ms | "
                   f"{sg_best / kv_best:,.0f}x |")
    out.append("")
    out.append("blocks per request (32k tokens, one pair, 512 pages as one run / as 512 runs):")
    out.append("| pair | NHD | HND |")
    out.append("|---|---:|---:|")
    for tp_p, r_p, tp_d, r_d in ((8, 5, 2, 1), (2, 1, 8, 5), (4, 1, 4, 1)):
        cells = []
        for order in ("NHD", "HND"):
            t = kvplan_template(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype,
                                page=page, tp_p=tp_p, r_p=r_p, tp_d=tp_d, r_d=r_d,
                                src_base=1 << 40, dst_base=1 << 44, pages_cap=n + 8, order=order)
            cells.append(f"{t.n_blocks_for(n, 1):,} / {t.n_blocks_for(n, n):,}")
        out.append(f"| TP {tp_p} -> {tp_d} (rank {r_p} -> {r_d}) | {cells[0]} | {cells[1]} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only the equality check")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sg = load_sglang()
    load_head_slicing(sg)
    print(f"sglang {sg.version} from {sg.root}; kvplan {kvplan.__version__}")
    for line in check(sg):
        print(line)
    if not args.check:
        print()
        for line in timing(sg, args.repeat):
            print(line)


if __name__ == "__main__":
    main()
