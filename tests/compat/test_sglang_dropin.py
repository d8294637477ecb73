"""kvplan.compat.sglang.install on SGLang 0.5.23's real manager classes (loaded from the wheel).

For random requests on synthetic deployments (MLA, MHA, hybrid, draft layers, NPU groups; prefill
PP 1/2/4 -> decode PP 1), the original and the patched manager run the same call against a
recording engine. Compared: the destination byte maps (block lists may differ by merging), the
statuses, and the ground truth of where each byte belongs. Where SGLang's bytes are right the
patched manager's must be identical; where SGLang raises, or moves bytes to the wrong place or
drops them, the patched manager raises a typed kvplan error.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from support.sglang_models import (
    SESSION,
    STRIDE,
    Deployment,
    canonical,
    engine_blocks,
    last_rank,
    load_loader,
    load_sglang_or_fail,
    request,
)


@pytest.fixture(scope="module")
def sg() -> Any:
    return load_sglang_or_fail()


@contextlib.contextmanager
def installed(cls: type, **kw: Any) -> Iterator[None]:
    compat.install(cls, **kw)
    try:
        yield
    finally:
        compat.uninstall(cls)


def manager(sg: Any, cls: type, dep: Deployment, **attrs: Any) -> Any:
    hybrid_mla = dep.hybrid and dep.kind != "mha"
    attrs.setdefault("decode_kv_args_table", {SESSION: dep.register_info()})
    return sg.manager_object(
        cls, kv_args=dep.kv_args(),
        is_mla_backend=dep.kind in ("mla", "npu") and not hybrid_mla,
        is_hybrid_mla_backend=hybrid_mla, pp_size=dep.pp_size, **attrs)


def outcome(sg: Any, cls: type, dep: Deployment, src: np.ndarray, dst: np.ndarray,
            **attrs: Any) -> tuple[Any, ...]:
    mgr = manager(sg, cls, dep, **attrs)
    dptrs, _, dids = dep.dst_lists()
    try:
        rc = mgr.send_kvcache(SESSION, src, dptrs, dst, None, dst_layer_ids=dids)
    except Exception as exc:  # noqa: BLE001 - compared below
        return ("raise", exc)
    return ("ok", rc, canonical(engine_blocks(mgr.engine.calls)), mgr)


def check(sg: Any, cls: type, dep: Deployment, src: np.ndarray, dst: np.ndarray, *,
          install_kw: dict[str, Any] | None = None, may_fix: bool = False) -> str:
    """Run original and patched; return 'same', 'refused' (SGLang wrong or raising, kvplan
    raises) or 'fixed' (SGLang wrong, kvplan right: only where ``may_fix``)."""
    assert not compat.installed(cls)
    orig = outcome(sg, cls, dep, src, dst)
    with installed(cls, **(install_kw or {})):
        new = outcome(sg, cls, dep, src, dst)
    truth = dep.truth(src, dst)
    where = f"{dep} src={src.tolist()} dst={dst.tolist()}"
    if orig[0] == "ok" and orig[2] == truth:
        assert new[0] == "ok", f"kvplan raised {new[1]!r} where SGLang is right: {where}"
        assert new[1] == orig[1] == 0
        assert new[2] == orig[2], where
        return "same"
    if new[0] == "ok":
        assert may_fix and new[2] == truth, (
            f"SGLang {'raised ' + repr(orig[1]) if orig[0] == 'raise' else 'moved wrong bytes'}"
            f" and kvplan did not refuse: {where}")
        return "fixed"
    assert isinstance(new[1], kvplan.KvPlanError) or (
        orig[0] == "raise" and type(new[1]) is type(orig[1])), (where, new[1])
    return "refused"


def test_loader_runs_the_wheels_code(sg: Any) -> None:
    loader = load_loader()
    assert sg.version == loader.SGLANG_VERSION
    names = loader.verify_closure(sg)
    assert any("send_kvcache" in n for n in names)
    assert sg.MooncakeKVManager.__module__ == "sglang.srt.disaggregation.mooncake.conn"
    assert sg.AscendKVManager.__module__ == "sglang.srt.disaggregation.ascend.conn"


def test_install_uninstall_patch_and_restore_exactly(sg: Any) -> None:
    for cls in (sg.MooncakeKVManager, sg.AscendKVManager):
        before = {k: v for k, v in vars(cls).items()}
        names = compat.install(cls)
        expected = {"_send_kvcache_generic", "send_kvcache", "_send_mamba_state"}
        if cls is sg.MooncakeKVManager:
            expected |= {"_send_mamba_state_slice", "send_kvcache_slice", "send_kvcache_dcp",
                         "send_kvcache_staged"}
        assert set(names) == expected
        assert compat.installed(cls) == names
        assert compat.install(cls) == ()  # idempotent
        for n in names:
            assert getattr(cls, n) is not before.get(n)
        assert compat.uninstall(cls) == names
        after = {k: v for k, v in vars(cls).items()}
        assert after == before
    assert "send_kvcache_slice" in compat.REPLACED_METHODS["MooncakeKVManager"]


def test_install_on_both_classes_keeps_each_original(sg: Any) -> None:
    M, A = sg.MooncakeKVManager, sg.AscendKVManager
    orig_generic, orig_ascend = M._send_kvcache_generic, A.__dict__["send_kvcache"]
    compat.install(M)
    compat.install(A)
    try:
        from kvplan.compat.sglang.registry import _original_for

        assert _original_for(A, "_send_kvcache_generic") is orig_generic
        assert _original_for(A, "send_kvcache") is orig_ascend
    finally:
        compat.uninstall(A)
        compat.uninstall(M)
    assert M._send_kvcache_generic is orig_generic
    assert A.__dict__["send_kvcache"] is orig_ascend
    assert "_send_kvcache_generic" not in vars(A)


def _mooncake_cases() -> list[tuple[Any, ...]]:
    cases = []
    for kind, hybrid, pp, ids, draft in itertools.product(
            ("mla", "mha"), (False, True), (1, 2, 4), (True, False), (0, 1)):
        if hybrid and not ids and kind == "mha":
            continue  # SGLang's hybrid pools always publish ids
        for stage in range(pp):
            cases.append((kind, hybrid, pp, stage, ids, draft))
    return cases


@pytest.mark.parametrize("kind,hybrid,pp,stage,ids,draft", _mooncake_cases())
def test_mooncake_send_kvcache_moves_the_same_bytes(sg: Any, kind: str, hybrid: bool, pp: int,
                                                     stage: int, ids: bool, draft: int) -> None:
    n_layers = 12
    kv_layers = list(range(3, n_layers, 4)) if hybrid else list(range(n_layers))
    if hybrid:
        kv_layers = list(range(1, 24, 2))  # 12 of 24 layers carry KV
        n_layers = 24
    dep = Deployment(kind, n_layers, kv_layers, pp, stage, hybrid=hybrid, draft_layers=draft,
                     publish_ids=ids, item_seed=pp * 10 + stage)
    rng = np.random.default_rng(1000 + pp * 10 + stage)
    verdicts = set()
    for fragmented in (False, True, True):
        src, dst = request(rng, fragmented=fragmented)
        verdicts.add(check(sg, sg.MooncakeKVManager, dep, src, dst,
                           install_kw={"decode_kv_layers": len(kv_layers)},
                           may_fix=kind == "mha" and not ids))
    if ids or pp == 1 and not draft:
        assert verdicts == {"same"}, verdicts


def test_mla_pp_legacy_with_short_decode_is_refused_not_shifted(sg: Any) -> None:
    """SGLang slices dst[start:end] + dst[-draft:]; a decode that registered fewer target
    layers than the stage needs gets draft entries in target positions, silently."""
    dep = Deployment("mla", 8, list(range(8)), 2, 1, draft_layers=1, publish_ids=False)
    # Decode registered only 7 of the 8 layers (+ draft): stage 1 (layers 4..7) does not fit,
    # and SGLang's slice [kv4, kv5, kv6, draft] + [draft] has exactly the stage's length.
    dep.dst_entries = [("kv", x) for x in range(7)] + [("draft", 8)]
    src, dst = np.arange(4, dtype=np.int32), np.arange(10, 14, dtype=np.int32)
    mgr = manager(sg, sg.MooncakeKVManager, dep)
    dptrs, _, _ = dep.dst_lists()
    mgr.decode_kv_args_table = {}
    assert mgr.send_kvcache(SESSION, src, dptrs, dst, None) == 0  # SGLang: moved, wrongly
    in_draft = [d for d in mgr.engine.calls[0][2] if dptrs[-1] <= d < dptrs[-1] + STRIDE]
    assert len(in_draft) == 2  # layer 7 and the draft both land in the draft entry
    with installed(sg.MooncakeKVManager):
        mgr = manager(sg, sg.MooncakeKVManager, dep, decode_kv_args_table={})
        with pytest.raises(kvplan.PairingError):
            mgr.send_kvcache(SESSION, src, dptrs, dst, None)


def test_mha_uneven_split_sglang_mis_slices_v_kvplan_refuses_or_needs_layer_count(sg: Any) -> None:
    # 15 layers as 7 + 8, no ids: SGLang's modulo guess sends stage 0's V to the wrong entries.
    dep = Deployment("mha", 15, list(range(15)), 2, 0, publish_ids=False, splits=[7, 8])
    src, dst = np.arange(3, dtype=np.int32), np.arange(5, 8, dtype=np.int32)
    assert check(sg, sg.MooncakeKVManager, dep, src, dst) == "refused"
    assert check(sg, sg.MooncakeKVManager, dep, src, dst,
                 install_kw={"decode_kv_layers": 15}, may_fix=True) == "fixed"


def test_on_error_status_logs_kvplans_reason_and_returns_sglangs_failure_status(
        sg: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A live server's transfer worker turns a non-zero status into SGLang's failure path for
    # the request; an exception would end the prefill's transfer thread instead.
    dep = Deployment("mha", 4, list(range(4)), 1, 0)
    dptrs, _, dids = dep.dst_lists()
    short_ptrs, short_ids = dptrs[: len(dptrs) // 2], dids[: len(dids) // 2]  # 2 of 4 layers
    src, dst = np.arange(3, dtype=np.int32), np.arange(5, 8, dtype=np.int32)
    with installed(sg.MooncakeKVManager):
        mgr = manager(sg, sg.MooncakeKVManager, dep, decode_kv_args_table={})
        with pytest.raises(kvplan.PairingError):
            mgr.send_kvcache(SESSION, src, short_ptrs, dst, None, dst_layer_ids=short_ids)
    with installed(sg.MooncakeKVManager, on_error="status"):
        mgr = manager(sg, sg.MooncakeKVManager, dep, decode_kv_args_table={})
        with caplog.at_level("ERROR", logger="kvplan.compat.sglang"):
            status = mgr.send_kvcache(SESSION, src, short_ptrs, dst, None,
                                      dst_layer_ids=short_ids)
        assert status == compat.REFUSED_STATUS == -1
        assert mgr.engine.calls == []  # nothing moved
        [record] = [r for r in caplog.records if r.name == "kvplan.compat.sglang"]
        assert "kvplan refused _send_kvcache_generic for session" in record.getMessage()
        assert "PairingError" in record.getMessage()
    assert "_kvplan_on_error" not in vars(sg.MooncakeKVManager)  # uninstall removes it
    with pytest.raises(ValueError, match="on_error"):
        compat.install(sg.MooncakeKVManager, on_error="ignore")  # type: ignore[arg-type]


def test_one_sided_empty_indices_raise_instead_of_sending_nothing(sg: Any) -> None:
    dep = Deployment("mla", 4, list(range(4)), 1, 0)
    dptrs, _, dids = dep.dst_lists()
    mgr = manager(sg, sg.MooncakeKVManager, dep)
    empty, some = np.zeros(0, np.int32), np.arange(3, dtype=np.int32)
    assert mgr.send_kvcache(SESSION, some, dptrs, empty, None, dst_layer_ids=dids) == 0
    assert mgr.engine.calls == []  # SGLang: status 0, nothing moved
    with installed(sg.MooncakeKVManager):
        mgr = manager(sg, sg.MooncakeKVManager, dep)
        with pytest.raises(kvplan.KvPlanError, match="differ in length"):
            mgr.send_kvcache(SESSION, some, dptrs, empty, None, dst_layer_ids=dids)
        # both empty: nothing to do, as in SGLang
        assert mgr.send_kvcache(SESSION, empty, dptrs, empty, None, dst_layer_ids=dids) == 0
        assert mgr.engine.calls == []


def test_negative_and_out_of_pool_pages_raise(sg: Any) -> None:
    dep = Deployment("mla", 4, list(range(4)), 1, 0)
    dptrs, _, dids = dep.dst_lists()
    with installed(sg.MooncakeKVManager):
        mgr = manager(sg, sg.MooncakeKVManager, dep)
        for bad in ([-1, 0], [0, 64]):  # the prefill pool holds pages 0..63
            with pytest.raises(kvplan.IndexBoundsError):
                mgr.send_kvcache(SESSION, np.array(bad, np.int32), dptrs,
                                 np.array([1, 2], np.int32), None, dst_layer_ids=dids)


def test_decode_item_size_mismatch_is_refused(sg: Any) -> None:
    """SGLang addresses the decode with the prefill's item length: different decode sizes land
    at the wrong offsets. kvplan reads the decode's registered sizes and refuses."""
    dep = Deployment("mla", 4, list(range(4)), 1, 0)
    info = dep.register_info()
    info.dst_kv_item_lens = [x * 2 for x in info.dst_kv_item_lens]
    src, dst = np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int32)
    with installed(sg.MooncakeKVManager):
        mgr = manager(sg, sg.MooncakeKVManager, dep, decode_kv_args_table={SESSION: info})
        with pytest.raises(kvplan.SizeMismatchError):
            mgr.send_kvcache(SESSION, src, info.dst_kv_ptrs, dst, None,
                             dst_layer_ids=info.dst_kv_layer_ids)


class _FailingEngine:
    def __init__(self, status: int) -> None:
        self.status, self.calls = status, []

    def batch_transfer_sync(self, session: str, src: list[int], dst: list[int],
                            lengths: list[int]) -> int:
        self.calls.append((session, src, dst, lengths))
        return self.status


def test_engine_status_is_returned_and_batches_are_bounded(sg: Any) -> None:
    dep = Deployment("mla", 61, list(range(61)), 1, 0)
    dptrs, _, dids = dep.dst_lists()
    src = np.array([0, 2, 4, 6], np.int32)
    for status in (0, -1):
        results = []
        for patched in (False, True):
            ctx = installed(sg.MooncakeKVManager, max_blocks_per_batch=100) if patched \
                else contextlib.nullcontext()
            with ctx:
                mgr = manager(sg, sg.MooncakeKVManager, dep, engine=_FailingEngine(status))
                results.append((mgr.send_kvcache(SESSION, src, dptrs, src, None,
                                                 dst_layer_ids=dids), mgr.engine.calls))
        (rc0, calls0), (rc1, calls1) = results
        assert rc0 == rc1 == status
        assert len(calls0) == 1
        if status == 0:
            assert [len(c[1]) for c in calls1] == [100, 100, 44]
            assert canonical(engine_blocks(calls1)) == canonical(engine_blocks(calls0))
        else:
            assert len(calls1) == 1  # stops at the first failing batch


def test_templates_are_cached_per_decode_peer(sg: Any) -> None:
    dep = Deployment("mla", 8, list(range(8)), 1, 0)
    dptrs, _, dids = dep.dst_lists()
    pages = np.arange(3, dtype=np.int32)
    with installed(sg.MooncakeKVManager):
        mgr = manager(sg, sg.MooncakeKVManager, dep)
        mgr.send_kvcache(SESSION, pages, dptrs, pages, None, dst_layer_ids=dids)
        cache = compat.template_cache(mgr)
        t1 = cache._entries[(SESSION, "kv")][1]
        mgr.send_kvcache(SESSION, pages, dptrs, pages, None, dst_layer_ids=dids)
        assert cache._entries[(SESSION, "kv")][1] is t1
        mgr.send_kvcache("other:2", pages, dptrs, pages, None, dst_layer_ids=dids)
        assert cache.sessions() == {SESSION, "other:2"}
        moved = [p + 0x1000000 for p in dptrs]  # the peer re-registered elsewhere
        mgr.send_kvcache(SESSION, pages, moved, pages, None, dst_layer_ids=dids)
        assert cache._entries[(SESSION, "kv")][1] is not t1
        cache.drop("other:2")
        assert cache.sessions() == {SESSION}


def test_custom_mem_pool_path_submits_per_pair_through_the_executor(sg: Any) -> None:
    import concurrent.futures

    dep = Deployment("mla", 6, list(range(6)), 1, 0)
    rng = np.random.default_rng(7)
    src, dst = request(rng, fragmented=True, n=9)
    dptrs, _, dids = dep.dst_lists()
    maps = []
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        for patched in (False, True):
            ctx = installed(sg.MooncakeKVManager) if patched else contextlib.nullcontext()
            with ctx:
                mgr = manager(sg, sg.MooncakeKVManager, dep, enable_custom_mem_pool=True)
                assert mgr.send_kvcache(SESSION, src, dptrs, dst, ex, dst_layer_ids=dids) == 0
                maps.append(canonical(engine_blocks(mgr.engine.calls)))
                assert len(mgr.engine.calls) == 6
    assert maps[0] == maps[1] == dep.truth(src, dst)


def test_state_types_and_device_destinations_stay_sglangs(sg: Any) -> None:
    """Page-indexed state components (SWA, DSA, ...) go to SGLang's own method."""
    dep = Deployment("mla", 4, list(range(4)), 1, 0)
    sptrs, _, items, sids = dep.src_lists()
    dptrs, ditems, dids = dep.dst_lists()
    pages = np.arange(2, dtype=np.int32)
    calls = []
    for patched in (False, True):
        ctx = installed(sg.MooncakeKVManager) if patched else contextlib.nullcontext()
        with ctx:
            mgr = manager(sg, sg.MooncakeKVManager, dep)
            rc = mgr._send_kvcache_generic(SESSION, sptrs, dptrs, items, pages, pages, None,
                                           state_type=sg.StateType.SWA, src_layer_ids=sids,
                                           dst_layer_ids=dids)
            calls.append((rc, mgr.engine.calls))
    assert calls[0] == calls[1]


# ---------------------------------------------------------------------------------------------
# Ascend manager: NPU buffer groups, hybrid-MLA + PP > 1 dispatch
# ---------------------------------------------------------------------------------------------


def _ascend_cases() -> list[tuple[Any, ...]]:
    cases = []
    for kind, pp, draft in itertools.product(("npu", "mla-hybrid", "mha"), (1, 2, 4), (0, 1)):
        for stage in range(pp):
            cases.append((kind, pp, stage, draft))
    return cases


@pytest.mark.parametrize("kind,pp,stage,draft", _ascend_cases())
def test_ascend_send_kvcache_moves_the_same_bytes(sg: Any, kind: str, pp: int, stage: int,
                                                   draft: int) -> None:
    if kind == "npu":
        dep = Deployment("npu", 12, list(range(12)), pp, stage, groups=2, draft_layers=draft,
                         publish_ids=False, item_seed=stage)
    elif kind == "mla-hybrid":
        dep = Deployment("mla", 24, list(range(1, 24, 2)), pp, stage, hybrid=True,
                         draft_layers=draft, item_seed=stage)
    else:
        dep = Deployment("mha", 12, list(range(12)), pp, stage, draft_layers=draft,
                         publish_ids=False, item_seed=stage)
    rng = np.random.default_rng(2000 + pp * 10 + stage)
    verdicts = set()
    with last_rank(stage == pp - 1):
        for fragmented in (False, True):
            src, dst = request(rng, fragmented=fragmented)
            verdicts.add(check(sg, sg.AscendKVManager, dep, src, dst,
                               install_kw={"decode_kv_layers": 12}, may_fix=kind == "mha"))
    if kind != "mha" or not draft:
        assert verdicts == {"same"}, verdicts


def test_ascend_npu_groups_not_a_whole_multiple_are_refused_not_truncated(sg: Any) -> None:
    """SGLang's ``len(ptrs) // kv_buf_groups`` truncates: a stray prefill buffer makes it fail
    with an IndexError mid-planning; a stray decode buffer is silently left out of the group
    arithmetic. kvplan names the cause up front (LayoutError)."""
    dep = Deployment("npu", 4, list(range(4)), 2, 0, groups=2, publish_ids=False)
    dep.src_entries = dep.src_entries + [("g0", 9)]  # a stray fifth buffer
    dep.items[("g0", 9)] = 32
    dep.dst_entries = dep.dst_entries + [("g0", 9)]
    src, dst = np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int32)
    with last_rank(False):
        orig = outcome(sg, sg.AscendKVManager, dep, src, dst)
        assert orig[0] == "raise" and isinstance(orig[1], IndexError), orig
        with installed(sg.AscendKVManager):
            new = outcome(sg, sg.AscendKVManager, dep, src, dst)
    assert new[0] == "raise" and isinstance(new[1], kvplan.LayoutError), new
    assert "refusing to truncate" in str(new[1])


def test_ascend_hisparse_device_destinations_raise_as_sglang(sg: Any) -> None:
    dep = Deployment("npu", 4, list(range(4)), 1, 0, groups=2, publish_ids=False)
    dptrs, _, _ = dep.dst_lists()
    pages = np.arange(2, dtype=np.int32)
    with installed(sg.AscendKVManager):
        mgr = manager(sg, sg.AscendKVManager, dep)
        with pytest.raises(NotImplementedError, match="HiSparse"):
            mgr.send_kvcache(SESSION, pages, dptrs, pages, None, dst_device_kv_indices=pages)


# ---------------------------------------------------------------------------------------------
# Mamba state
# ---------------------------------------------------------------------------------------------


def _mamba(sg: Any, pp: int, *, src_ids: list[int], dst_ids: list[int], src_items: list[int],
           dst_items: list[int] | None, src_slot: int, dst_slot: int) -> tuple[Any, ...]:
    import types

    mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=types.SimpleNamespace(
        state_data_ptrs=[[1000 + 100000 * i for i in range(len(src_ids))]],
        state_data_lens=[[64 * x for x in src_items]]), pp_size=pp)
    req = types.SimpleNamespace(mooncake_session_id=SESSION)
    src_ptrs = [1000 + 100000 * i for i in range(len(src_ids))]
    dst_ptrs = [9000000 + 100000 * j for j in range(len(dst_ids))]
    try:
        rc = mgr._send_mamba_state(req, [src_slot], src_ptrs, src_items, dst_ptrs, [dst_slot],
                                   src_ids, dst_ids, dst_items)
    except Exception as exc:  # noqa: BLE001
        return ("raise", exc)
    return ("ok", rc, mgr.engine.calls)


@pytest.mark.parametrize("seed", range(12))
def test_mamba_state_moves_the_same_bytes(sg: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    linear = [x for x in range(24) if x % 4 != 3]  # 18 linear-attention layers
    pp = int(rng.choice([1, 2, 4]))
    stage = int(rng.integers(0, pp))
    per = -(-len(linear) // pp)
    mine = linear[stage * per:(stage + 1) * per]
    items = {x: int(rng.choice([256, 512])) for x in linear}
    kw = dict(src_ids=mine, dst_ids=linear, src_items=[items[x] for x in mine],
              dst_items=[items[x] for x in linear] if seed % 2 else None,
              src_slot=int(rng.integers(0, 64)), dst_slot=int(rng.integers(0, 1000)))
    orig = _mamba(sg, pp, **kw)
    with installed(sg.MooncakeKVManager):
        new = _mamba(sg, pp, **kw)
    assert orig[0] == new[0] == "ok"
    assert orig[1] == new[1] == 0
    assert canonical(engine_blocks(orig[2])) == canonical(engine_blocks(new[2]))


def test_mamba_slot_size_mismatch_is_a_typed_error_with_sglangs_message(sg: Any) -> None:
    kw = dict(src_ids=[7], dst_ids=[3, 7], src_items=[16], dst_items=[8, 32], src_slot=2,
              dst_slot=3)
    orig = _mamba(sg, 2, **kw)
    assert orig[0] == "raise" and isinstance(orig[1], RuntimeError)
    with installed(sg.MooncakeKVManager):
        new = _mamba(sg, 2, **kw)
    assert new[0] == "raise" and isinstance(new[1], kvplan.SizeMismatchError)
    assert str(new[1]) == str(orig[1])


def test_mamba_slot_stage1_worked_example(sg: Any) -> None:
    """W-mamba-slot-stage1: one block (1032, 3048, 16)."""
    import types

    with installed(sg.MooncakeKVManager):
        mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=types.SimpleNamespace(
            state_data_ptrs=[[1000]], state_data_lens=[[16 * 64]]), pp_size=2)
        req = types.SimpleNamespace(mooncake_session_id=SESSION)
        assert mgr._send_mamba_state(req, [2], [1000], [16], [2000, 3000], [3], [7], [3, 7],
                                     [8, 16]) == 0
        assert mgr.engine.calls == [(SESSION, [1032], [3048], [16])]
        with pytest.raises(kvplan.IndexBoundsError):  # slot 64 is past the prefill's buffer
            mgr._send_mamba_state(req, [64], [1000], [16], [2000, 3000], [3], [7], [3, 7],
                                  [8, 16])


# ---------------------------------------------------------------------------------------------
# Layouts from SGLang's state
# ---------------------------------------------------------------------------------------------


def test_layouts_from_kv_args_and_register_info_pair_like_the_manager() -> None:
    dep = Deployment("mla", 24, list(range(1, 24, 2)), 2, 1, hybrid=True, draft_layers=1)
    kv_args = dep.kv_args()
    kv_args.state_types = ["mamba"]
    kv_args.state_data_ptrs = [[5000, 6000]]
    kv_args.state_data_lens = [[1600, 1600]]
    kv_args.state_item_lens = [[16, 16]]
    kv_args.state_layer_ids = [[12, 14]]
    src = compat.layout_from_kv_args(kv_args, is_mla_backend=True, pp_size=2)
    assert src.kinds.count("state") == 2 and src.roles[-3:] == ["draft", "mamba0", "mamba0"]
    info = dep.register_info()
    info.dst_state_data_ptrs = [[7000, 8000, 9000]]
    info.dst_state_item_lens = [[16, 16, 16]]
    info.dst_state_layer_ids = [[10, 12, 14]]
    dst = compat.layout_from_register_info(info, is_mla_backend=True, num_draft_entries=1,
                                           state_types=["mamba"])
    t = kvplan.Template(src, dst)
    where = {e: j for j, e in enumerate(dep.dst_entries)}
    assert t.pairs.tolist() == [[i, where[e]] for i, e in enumerate(dep.src_entries)]
    assert t.plan_state(1, 2).as_lists() == ([5016, 6016], [8032, 9032], [16, 16])
    with pytest.raises(kvplan.LayoutError, match="truncate"):
        kv_args.kv_buf_groups = 5
        compat.layout_from_kv_args(kv_args, is_mla_backend=True)


def _real_kv_args(sg: Any, *, engine_rank: int) -> Any:
    """SGLang's own ``KVArgs`` for an MLA prefill rank of 4 layers (no state)."""
    kv_args = sg.modules["sglang.srt.disaggregation.base.conn"].KVArgs()
    kv_args.engine_rank = engine_rank
    kv_args.kv_data_ptrs = [0x1000_0000 + i * 0x10000 for i in range(4)]
    kv_args.kv_data_lens = [64 * 32] * 4
    kv_args.kv_item_lens = [64] * 4
    kv_args.kv_layer_ids = []
    kv_args.page_size = 16
    kv_args.pp_rank = 0
    kv_args.state_types = []
    return kv_args


@pytest.mark.parametrize("engine_rank", [0, 1, 2, 3])
def test_layout_from_real_kv_args_has_the_attention_tp_rank_within_its_size(
        sg: Any, engine_rank: int) -> None:
    """``KVArgs.engine_rank`` is a TP rank, the TP size lives on the manager: kvplan used to set
    ``tp_rank=engine_rank`` with TP size 1 (``LayoutError`` for every rank but 0)."""
    kv_args = _real_kv_args(sg, engine_rank=engine_rank)
    plain = compat.layout_from_kv_args(kv_args, is_mla_backend=True)
    assert (plain.tp_rank, plain.tp_size) == (0, 1)  # no TP size given: no TP context
    for attn_tp_size in (2, 4):
        layout = compat.layout_from_kv_args(kv_args, is_mla_backend=True,
                                            attn_tp_size=attn_tp_size)
        assert (layout.tp_rank, layout.tp_size) == (engine_rank % attn_tp_size, attn_tp_size)
        assert layout.data_ptrs == kv_args.kv_data_ptrs and layout.page_size == 16
    with pytest.raises(kvplan.LayoutError, match="attn_tp_size must be positive"):
        compat.layout_from_kv_args(kv_args, is_mla_backend=True, attn_tp_size=-2)


def test_layout_from_real_register_info_uses_the_rank_modulo_the_attention_tp_size(
        sg: Any) -> None:
    """With DP attention the decode registers its global TP rank (5) and its attention TP size
    (2): SGLang's head slicing uses ``5 % 2``; kvplan used 5 and refused it."""
    import struct

    mooncake_conn = sg.modules["sglang.srt.disaggregation.mooncake.conn"]
    ptrs = [0x9000_0000 + i * 0x10000 for i in range(4)]
    info = mooncake_conn.KVArgsRegisterInfo.from_zmq([
        b"7", b"10.0.0.2", b"9000", SESSION.encode(), struct.pack("4Q", *ptrs),
        struct.pack("1Q", 0x5000_0000), b"", b"5", b"2", b"64", b"", b"",
        struct.pack("4I", 3, 7, 3, 7)])
    assert (info.dst_tp_rank, info.dst_attn_tp_size) == (5, 2)
    dst = compat.layout_from_register_info(info, is_mla_backend=False, num_layers=2)
    assert (dst.tp_rank, dst.tp_size) == (1, 2)
    assert dst.layer_ids == [3, 7, 3, 7] and dst.roles == ["k", "k", "v", "v"]


class _HoleEngine:
    """Records every call; fails (-1) a call writing any decode page in ``hole`` of entry 0's
    pages (items of ``item`` bytes from ``base``)."""

    def __init__(self, base: int, item: int, hole: range) -> None:
        self.lo, self.hi = base + hole.start * item, base + hole.stop * item
        self.calls: list[tuple[Any, ...]] = []

    def batch_transfer_sync(self, session: str, src: list[int], dst: list[int],
                            lengths: list[int]) -> int:
        self.calls.append((session, src, dst, lengths))
        return -1 if any(self.lo <= d < self.hi for d in dst) else 0


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_several_requests_to_one_session_as_one_batch_keep_each_requests_status(
        sg: Any, kind: str) -> None:
    """``send_kvcache_batch``: the requests of one decode session planned as one batch plan move
    the bytes SGLang's own ``send_kvcache`` moves for each of them, and a failing call fails
    only the requests whose blocks it held (each request's own status)."""
    dep = Deployment(kind, 8, list(range(8)), 1, 0)
    dptrs, items, dids = dep.dst_lists()
    rng = np.random.default_rng(77)
    order = rng.permutation(32)
    reqs, at = [], 0
    for k in (3, 1, 4, 2, 2, 5, 1):
        reqs.append((rng.choice(32, size=k, replace=False).astype(np.int32),
                     np.sort(order[at:at + k]).astype(np.int32)))
        at += k
    # SGLang's own method, request by request.
    mgr = manager(sg, sg.MooncakeKVManager, dep)
    assert [mgr.send_kvcache(SESSION, s, dptrs, d, None, dst_layer_ids=dids)
            for s, d in reqs] == [0] * len(reqs)
    theirs = canonical(engine_blocks(mgr.engine.calls))
    with installed(sg.MooncakeKVManager, max_blocks_per_batch=16):
        mgr = manager(sg, sg.MooncakeKVManager, dep)
        statuses = compat.send_kvcache_batch(mgr, SESSION, reqs, dptrs, None, dids)
        assert statuses == [0] * len(reqs)
        assert canonical(engine_blocks(mgr.engine.calls)) == theirs
        assert all(len(c[1]) <= 16 for c in mgr.engine.calls)
        # A hole of decode pages: the calls writing it fail, and only their requests.
        hole = range(int(reqs[2][1][0]), int(reqs[2][1][0]) + 1)
        engine = _HoleEngine(dptrs[0], items[0], hole)
        mgr = manager(sg, sg.MooncakeKVManager, dep, engine=engine)
        statuses = compat.send_kvcache_batch(mgr, SESSION, reqs, dptrs, None, dids)
        from kvplan.compat.sglang.dropins import _generic_template

        template = _generic_template(mgr, SESSION, mgr.kv_args.kv_data_ptrs, dptrs,
                                     mgr.kv_args.kv_item_lens, mgr.kv_args.kv_layer_ids, dids,
                                     False)
        assert template is not None
        batch = template.plan_batch(reqs)
        want = [0] * len(reqs)
        for lo, hi in batch.call_ranges(16).tolist():
            if any(engine.lo <= d < engine.hi for d in batch.dst_addrs[lo:hi].tolist()):
                for r in batch.requests_in(lo, hi).tolist():
                    want[r] = -1
        assert statuses == want and want[2] == -1 and 0 in want
        # Every call was made, the failed ones included.
        assert len(engine.calls) == len(batch.call_ranges(16))

