"""kvplan's ``send_kvcache_slice`` against SGLang 0.5.23's own (real code from the wheel).

Prefill attention TP != decode TP on MHA/NHD pools: for every (prefill TP, decode TP, KV heads)
combination, replicated heads included, and every prefill rank SGLang's decode asks for KV, the
original and the patched manager run the same call against a recording engine; their
destination byte maps (not block lists) and statuses must be identical, and over the prefill
ranks a decode rank asks, they must fill exactly that rank's heads with the right source bytes.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from support.sglang_loader import InlineExecutor
from support.sglang_models import canonical, engine_blocks, load_loader, load_sglang_or_fail

SESSION = "decode-peer:1"
SRC_BASE, DST_BASE, CAP = 1 << 36, 1 << 44, 16


@pytest.fixture(scope="module")
def sg() -> Any:
    sg = load_sglang_or_fail()
    load_loader().load_head_slicing(sg)  # compute_head_slice_params, from the wheel
    return sg


def items(heads: int, tp: int, page: int, head_bytes: int) -> int:
    return page * max(1, heads // tp) * head_bytes


def call(sg: Any, *, heads: int, tp_p: int, r_p: int, tp_d: int, r_d: int, src: Any, dst: Any,
         page: int = 4, head_bytes: int = 8, layers: int = 3, ids: bool = True,
         engine: Any = None, src_item: int | None = None, dst_item: int | None = None,
         item_lens: list[int] | None = None) -> tuple[Any, ...]:
    """One ``send_kvcache_slice`` call on SGLang's real class: ``("ok", status, byte map)`` or
    ``("raise", exc)``."""
    loader = load_loader()
    si = src_item or items(heads, tp_p, page, head_bytes)
    di = dst_item or items(heads, tp_d, page, head_bytes)
    sptrs = [SRC_BASE + e * si * CAP for e in range(2 * layers)]
    dptrs = [DST_BASE + e * di * CAP for e in range(2 * layers)]
    lids = list(range(layers)) * 2 if ids else []
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=sptrs, kv_data_lens=[si * CAP] * (2 * layers),
        kv_item_lens=item_lens or [si] * (2 * layers),
        kv_layer_ids=lids, page_size=page, total_kv_head_num=heads,
        kv_head_num=max(1, heads // tp_p), engine_rank=r_p, prefill_start_layer=0)
    mgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv_args, attn_tp_size=tp_p,
                                engine=engine)
    try:
        rc = mgr.send_kvcache_slice(SESSION, np.asarray(src, np.int32), dptrs,
                                    np.asarray(dst, np.int32), r_d, tp_d, di, InlineExecutor(),
                                    dst_layer_ids=lids or None)
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return ("raise", exc)
    return ("ok", rc, canonical(engine_blocks(mgr.engine.calls)), mgr)


def both(sg: Any, **kw: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    cls = sg.MooncakeKVManager
    assert not compat.installed(cls)
    orig = call(sg, **kw)
    compat.install(cls)
    try:
        new = call(sg, **kw)
    finally:
        compat.uninstall(cls)
    return orig, new


def asked(tp_p: int, tp_d: int, r_d: int) -> list[int]:
    """Prefill ranks SGLang 0.5.23's decode rank ``r_d`` asks for KV (its ``target_tp_ranks``)."""
    if tp_d > tp_p:
        return [r_d // (tp_d // tp_p)]
    k = tp_p // tp_d
    return list(range(r_d * k, (r_d + 1) * k))


def truth(*, heads: int, tp_d: int, r_d: int, tp_p: int, src: list[int], dst: list[int],
          page: int = 4, head_bytes: int = 8, layers: int = 3) -> set[tuple[int, int]]:
    """(dst byte address of one head of one token slot, prefill head) for decode rank r_d."""
    di = items(heads, tp_d, page, head_bytes)
    dst_hpr = max(1, heads // tp_d)
    first = r_d * heads // tp_d if heads >= tp_d else r_d // (tp_d // heads)
    out = set()
    for e in range(2 * layers):
        for d in dst:
            for slot in range(page):
                for h in range(dst_hpr):
                    addr = DST_BASE + e * di * CAP + d * di + (slot * dst_hpr + h) * head_bytes
                    out.add((addr, first + h))
    return out


def head_of_src(addr: int, *, heads: int, tp_p: int, r_p: int, page: int = 4,
                head_bytes: int = 8) -> int:
    si = items(heads, tp_p, page, head_bytes)
    hpr = max(1, heads // tp_p)
    first = r_p * heads // tp_p if heads >= tp_p else r_p // (tp_p // heads)
    return first + ((addr - SRC_BASE) % si // head_bytes) % hpr


CASES = [(h, p, d) for h in (1, 2, 8, 16) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8) if p != d]


@pytest.mark.parametrize("ids", [True, False], ids=["layer-ids", "k-then-v"])
@pytest.mark.parametrize("heads,tp_p,tp_d", CASES)
def test_slice_moves_the_same_bytes_as_sglang(sg: Any, heads: int, tp_p: int, tp_d: int,
                                              ids: bool) -> None:
    src, dst = [0, 1, 2, 5, 6, 9], [7, 3, 4, 0, 1, 12]
    for r_d in range(tp_d):
        received: set[tuple[int, int]] = set()
        for r_p in asked(tp_p, tp_d, r_d):
            kw = dict(heads=heads, tp_p=tp_p, r_p=r_p, tp_d=tp_d, r_d=r_d, src=src, dst=dst,
                      ids=ids)
            orig, new = both(sg, **kw)
            where = f"H={heads} TP {tp_p}->{tp_d} pair {r_p}->{r_d} ids={ids}"
            assert orig[0] == "ok" and new[0] == "ok", (where, orig[1], new[1])
            assert new[1] == orig[1] == 0, where
            assert new[2] == orig[2], where
            for s, d, n in new[2]:
                for off in range(0, n, 8):
                    received.add((d + off, head_of_src(s + off, heads=heads, tp_p=tp_p,
                                                       r_p=r_p)))
        assert received == truth(heads=heads, tp_d=tp_d, r_d=r_d, tp_p=tp_p, src=src, dst=dst)


def test_slice_uses_the_template_cache_and_bounded_batches(sg: Any) -> None:
    cls = sg.MooncakeKVManager
    kw: dict[str, Any] = dict(heads=8, tp_p=2, r_p=1, tp_d=8, r_d=5, src=list(range(12)),
                              dst=list(range(4, 16)))
    orig = call(sg, **kw)
    compat.install(cls, max_blocks_per_batch=50)
    try:
        new = call(sg, **kw)
        mgr = new[3]
        assert max(len(c[1]) for c in mgr.engine.calls) <= 50
        cache = compat.template_cache(mgr)
        t1 = cache._entries[(SESSION, "slice")][1]
        mgr.send_kvcache_slice(SESSION, np.arange(3, dtype=np.int32),
                               [DST_BASE + e * items(8, 8, 4, 8) * CAP for e in range(6)],
                               np.arange(3, dtype=np.int32), 5, 8, items(8, 8, 4, 8),
                               InlineExecutor(), dst_layer_ids=[0, 1, 2, 0, 1, 2])
        assert cache._entries[(SESSION, "slice")][1] is t1
    finally:
        compat.uninstall(cls)
    assert new[1] == orig[1] == 0 and new[2] == orig[2]


def test_slice_engine_failure_status_is_returned(sg: Any) -> None:
    class Failing:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def batch_transfer_sync(self, *a: Any) -> int:
            self.calls.append(a)
            return -1

    kw: dict[str, Any] = dict(heads=8, tp_p=4, r_p=2, tp_d=2, r_d=1, src=[1, 2], dst=[3, 4])
    orig = call(sg, engine=Failing(), **kw)
    compat.install(sg.MooncakeKVManager)
    try:
        new = call(sg, engine=Failing(), **kw)
    finally:
        compat.uninstall(sg.MooncakeKVManager)
    assert orig[1] == new[1] == -1
    assert len(new[3].engine.calls) == 1  # stops at the first failing batch


def test_slice_keeps_sglangs_failure_statuses(sg: Any) -> None:
    # Layer ids published and KV entries of different item lengths: both return -1 (SGLang
    # logs the cause), nothing moves.
    si = items(8, 2, 4, 8)
    orig, new = both(sg, heads=8, tp_p=2, r_p=0, tp_d=4, r_d=0, src=[1], dst=[2],
                     item_lens=[si] * 5 + [si * 2])
    assert orig[0] == new[0] == "ok" and orig[1] == new[1] == -1
    assert orig[2] == new[2] == []


def test_slice_refuses_where_sglang_writes_wrong_bytes(sg: Any) -> None:
    # Prefill rank 3 of TP 4 (heads 6-7) asked by decode rank 0 of TP 2 (heads 0-3): SGLang
    # writes heads 6-7 into the slots of heads 2-3.
    orig, new = both(sg, heads=8, tp_p=4, r_p=3, tp_d=2, r_d=0, src=[1], dst=[2])
    assert orig[0] == "ok" and orig[1] == 0 and orig[2]
    assert new[0] == "raise" and isinstance(new[1], kvplan.PairingError)
    # A prefill item that is not page * heads_per_rank * head bytes (the head size SGLang
    # derives from the decode's item): SGLang reads at wrong offsets.
    orig, new = both(sg, heads=8, tp_p=4, r_p=1, tp_d=2, r_d=0, src=[1], dst=[2],
                     src_item=items(8, 4, 4, 8) * 2)
    assert orig[0] == "ok" and new[0] == "raise"
    assert isinstance(new[1], kvplan.SizeMismatchError), new[1]
    # Page index arrays of different lengths.
    orig, new = both(sg, heads=8, tp_p=4, r_p=1, tp_d=2, r_d=0, src=[1, 2], dst=[2])
    assert new[0] == "raise" and isinstance(new[1], kvplan.KvPlanError)
    # A prefill page past the prefill buffer.
    orig, new = both(sg, heads=8, tp_p=4, r_p=1, tp_d=2, r_d=0, src=[CAP], dst=[2])
    assert new[0] == "raise" and isinstance(new[1], kvplan.IndexBoundsError)


def test_a_replica_plans_as_the_cores_elected_holder_of_its_heads() -> None:
    """A prefill rank holding replicated heads plans as the rank the core elects to send the
    decode rank those heads (``tp_peers``): the holder in the same group of replicas whose rank
    matches the decode rank modulo the replica count, and itself for heads the decode rank does
    not hold (the template is empty and says so)."""
    from kvplan.compat.sglang.templates import elected_replica

    checked = 0
    for heads in (1, 2, 4, 8):
        for tp_p in (1, 2, 4, 8, 16):
            for tp_d in (1, 2, 4, 8, 16):
                replicas = max(1, tp_p // heads)
                for r_p in range(tp_p):
                    mine = kvplan.tp_peers(heads, tp_p, tp_d, prefill_rank=r_p).heads
                    for r_d in range(tp_d):
                        start, stop = kvplan.tp_peers(heads, tp_p, tp_d, decode_rank=r_d).heads
                        got = elected_replica(r_p, r_d, heads, tp_p, tp_d)
                        if start <= mine[0] and mine[1] <= stop:
                            assert got == r_p // replicas * replicas + r_d % replicas
                            checked += 1
                        else:
                            assert got == r_p
    assert checked > 500
