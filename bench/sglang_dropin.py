"""Per-request time of SGLang 0.5.23's manager send methods, original vs kvplan-patched.

Both run on real manager instances of the wheel's classes (tests/support/sglang_loader.py) with the
same inputs, including the engine submission to an engine whose ``batch_transfer_sync`` only
records its arguments (so the time is planning plus handing lists to the engine). The byte maps of
the two are checked equal before timing. ``send_kvcache_slice`` (prefill TP != decode TP) is
timed over ``--repeat`` / 10 calls.

    .venv/bin/python bench/sglang_dropin.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from harness.machine import summary  # importing harness puts tests/ on sys.path: support.*
from harness.timing import call_times_ns
from support import sglang_loader
from support.sglang_loader import InlineExecutor, RecordingEngine
from support.sglang_models import SESSION, Deployment, canonical, engine_blocks, request

from kvplan.compat import sglang as compat


@contextlib.contextmanager
def patched(cls: type, on: bool) -> Iterator[None]:
    if on:
        compat.install(cls)
    try:
        yield
    finally:
        if on:
            compat.uninstall(cls)


def kv_call(sg: Any, dep: Deployment, src: np.ndarray, dst: np.ndarray
            ) -> tuple[Any, Callable[[], int]]:
    hybrid_mla = dep.hybrid
    mgr = sg.manager_object(
        sg.MooncakeKVManager, kv_args=dep.kv_args(), engine=RecordingEngine(),
        is_mla_backend=not hybrid_mla, is_hybrid_mla_backend=hybrid_mla, pp_size=dep.pp_size,
        decode_kv_args_table={SESSION: dep.register_info()})
    dptrs, _, dids = dep.dst_lists()

    def call() -> int:
        mgr.engine.calls.clear()
        return mgr.send_kvcache(SESSION, src, dptrs, dst, None, dst_layer_ids=dids)

    return mgr, call


def mamba_call(sg: Any, n_src: int, n_dst: int) -> tuple[Any, Callable[[], int]]:
    src_ptrs = [0x1_0000_0000 + (i << 24) for i in range(n_src)]
    dst_ptrs = [0x9_0000_0000 + (j << 24) for j in range(n_dst)]
    items = [2 * 1024 * 1024] * n_src
    mgr = sg.manager_object(sg.MooncakeKVManager, engine=RecordingEngine(), pp_size=1,
                            kv_args=types.SimpleNamespace(state_data_ptrs=[src_ptrs],
                                                          state_data_lens=[[x * 8 for x in items]]))
    ids = list(range(n_src))
    req = types.SimpleNamespace(mooncake_session_id=SESSION)

    def call() -> int:
        mgr.engine.calls.clear()
        return mgr._send_mamba_state(req, [3], src_ptrs, items, dst_ptrs, [5], ids,
                                     list(range(n_dst)), [2 * 1024 * 1024] * n_dst)

    return mgr, call


SLICE = dict(layers=32, heads=8, head_bytes=256, page=16, pages=16)


def slice_call(sg: Any, tp_p: int, r_p: int, tp_d: int, r_d: int
               ) -> tuple[Any, Callable[[], int]]:
    """``send_kvcache_slice`` of one request: 32-layer MHA, 8 KV heads of 256 bytes (head dim
    128, bf16), page 16, 16 contiguous pages (256 tokens), NHD pools, layer ids published."""
    L, H, hb, page, n = (SLICE[k] for k in ("layers", "heads", "head_bytes", "page", "pages"))
    si, di = page * max(1, H // tp_p) * hb, page * max(1, H // tp_d) * hb
    cap = 64
    sptrs = [0x1_0000_0000 + e * si * cap for e in range(2 * L)]
    dptrs = [0x9_0000_0000 + e * di * cap for e in range(2 * L)]
    ids = list(range(L)) * 2
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=sptrs, kv_data_lens=[si * cap] * (2 * L), kv_item_lens=[si] * (2 * L),
        kv_layer_ids=ids, page_size=page, total_kv_head_num=H, kv_head_num=max(1, H // tp_p),
        engine_rank=r_p, prefill_start_layer=0)
    mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=kv_args, engine=RecordingEngine(),
                            attn_tp_size=tp_p)
    src = np.arange(3, 3 + n, dtype=np.int32)
    dst = np.arange(20, 20 + n, dtype=np.int32)
    ex = InlineExecutor()

    def call() -> int:
        mgr.engine.calls.clear()
        return mgr.send_kvcache_slice(SESSION, src, dptrs, dst, r_d, tp_d, di, ex,
                                      dst_layer_ids=ids)

    return mgr, call


def timed(call: Callable[[], int], repeat: int) -> float:
    """Median µs per call, after up to 50 untimed calls."""
    return statistics.median(call_times_ns(call, repeat, warmup=min(50, repeat))) / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    sg = sglang_loader.load_sglang()
    rng = np.random.default_rng(0)
    cases = {
        "61-layer MLA": Deployment("mla", 61, list(range(61)), 1, 0, publish_ids=False),
        "hybrid MLA, 12 of 48 layers KV (ids)": Deployment(
            "mla", 48, list(range(3, 48, 4)), 1, 0, hybrid=True),
    }
    rows = []
    for name, dep in cases.items():
        for fragmented in (False, True):
            src, dst = request(rng, fragmented=fragmented, n=64 if fragmented else 48)
            res = {}
            for on in (False, True):
                with patched(sg.MooncakeKVManager, on):
                    mgr, call = kv_call(sg, dep, src, dst)
                    assert call() == 0
                    res[on] = (canonical(engine_blocks(mgr.engine.calls)),
                               sum(len(c[1]) for c in mgr.engine.calls), timed(call, args.repeat))
            assert res[False][0] == res[True][0] == dep.truth(src, dst)
            rows.append((name, "fragmented" if fragmented else "contiguous", len(src),
                         res[False][1], res[False][2], res[True][2]))
    res = {}
    for on in (False, True):
        with patched(sg.MooncakeKVManager, on):
            mgr, call = mamba_call(sg, 36, 36)
            assert call() == 0
            res[on] = (canonical(engine_blocks(mgr.engine.calls)), timed(call, args.repeat))
    assert res[False][0] == res[True][0]
    rows.append(("hybrid Mamba state, 36 linear layers", "one slot", 1, 36, res[False][1],
                 res[True][1]))
    sglang_loader.load_head_slicing(sg)  # compute_head_slice_params, from the wheel
    for tp_p, r_p, tp_d, r_d in ((8, 5, 2, 1), (2, 1, 8, 5)):
        res = {}
        for on in (False, True):
            with patched(sg.MooncakeKVManager, on):
                mgr, call = slice_call(sg, tp_p, r_p, tp_d, r_d)
                assert call() == 0
                res[on] = (canonical(engine_blocks(mgr.engine.calls)),
                           sum(len(c[1]) for c in mgr.engine.calls),
                           timed(call, max(1, args.repeat // 10)))
        assert res[False][0] == res[True][0]
        rows.append((f"send_kvcache_slice, MHA TP {tp_p} -> {tp_d} (rank {r_p} -> {r_d})",
                     "contiguous", SLICE["pages"], res[False][1], res[False][2], res[True][2]))
    print(f"SGLang {sg.version}, {summary()}, median of {args.repeat} calls")
    print("| request | pages | n pages | blocks | SGLang (us) | kvplan-patched (us) | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, kind, pages, blocks, t_orig, t_new in rows:
        print(f"| {name} | {kind} | {pages} | {blocks} | {t_orig:.1f} | {t_new:.1f} | "
              f"{t_orig / t_new:.1f}x |")


if __name__ == "__main__":
    main()
