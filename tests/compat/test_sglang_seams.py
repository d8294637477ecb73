"""kvplan's drop-ins keep SGLang 0.5.23's seams (real classes from the wheel).

SGLang's send methods call other methods on ``self``: ``_transfer_data(session, blocks)`` for
every block list, ``_send_kvcache_generic(**kwargs)`` from the Ascend dispatch and from
``send_kvcache``, ``_await_transfer_futures``, the pointer-slicing helpers. Code that extends a
manager through those methods (a subclass, an instance attribute, a stand-in object on which
SGLang's methods are called unbound) must see the same calls once kvplan is installed, and read
no attribute SGLang's method does not read. Where the manager uses SGLang's own
``_transfer_data``, kvplan's bounded engine batches must still be the path taken.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from support.sglang_loader import InlineExecutor
from support.sglang_models import (SESSION, Deployment, engine_blocks, last_rank, load_loader,
                                   load_sglang_or_fail)


@pytest.fixture(scope="module")
def sg() -> Any:
    sg = load_sglang_or_fail()
    load_loader().load_head_slicing(sg)  # compute_head_slice_params, from the wheel
    return sg


@contextlib.contextmanager
def patched(cls: type, on: bool = True, **kw: Any) -> Iterator[None]:
    if on:
        compat.install(cls, **kw)
    try:
        yield
    finally:
        if on:
            compat.uninstall(cls)


def both(sg_cls: type, run: Any) -> tuple[Any, Any]:
    """``run()`` with SGLang's own methods, then with kvplan installed on ``sg_cls``."""
    assert not compat.installed(sg_cls)
    before = run()
    with patched(sg_cls):
        after = run()
    return before, after


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return ("raise", type(exc), str(exc))


def pages(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


# ---------------------------------------------------------------------------------------------
# Stand-in managers: plain objects carrying only what SGLang's methods read
# ---------------------------------------------------------------------------------------------


class RecordingStandIn:
    """Not an SGLang class: the attributes SGLang's ``_send_kvcache_generic`` and
    ``_send_mamba_state`` read on the hybrid-PP path, and a ``_transfer_data`` that keeps every
    block it is handed. No engine, no ``get_*_kv_ptrs_with_pp``."""

    def __init__(self, *, pp_size: int, prefill_start_layer: int = 0) -> None:
        self.is_mla_backend = False
        self.is_hybrid_mla_backend = False
        self.enable_custom_mem_pool = False
        self.max_transfer_batch_indices = 0
        self.pp_size = pp_size
        self.kv_args = types.SimpleNamespace(prefill_start_layer=prefill_start_layer)
        self.blocks: list[tuple[int, int, int]] = []
        self.calls = 0

    def _transfer_data(self, session: str, blocks: list[tuple[int, int, int]]) -> int:
        self.calls += 1
        self.blocks.extend(blocks)
        return 0


def full_attention_layers(num_layers: int, every: int = 4) -> list[int]:
    """Global ids of the full-attention layers of a hybrid-linear model (every 4th layer)."""
    return [x for x in range(num_layers) if x % every == every - 1]


HYBRID_STAGES = [
    # (model layers, full-attention layers this prefill stage holds, their offset on decode)
    pytest.param(60, slice(7, None), 7, id="60-layers-stage1-8-of-15"),
    pytest.param(60, slice(0, 7), 0, id="60-layers-stage0-7-of-15"),
    pytest.param(48, slice(0, 5), 0, id="48-layers-5-of-12"),
]


@pytest.mark.parametrize("num_layers,stage,offset", HYBRID_STAGES)
def test_hybrid_pp_stage_blocks_reach_the_stand_ins_transfer_data(
        sg: Any, num_layers: int, stage: slice, offset: int) -> None:
    """K and V of a prefill PP stage, paired by layer id, land at the decode's entries for the
    same layers: K at ``offset + i``, V at ``decode layers + offset + i``."""
    model = full_attention_layers(num_layers)
    mine = model[stage]
    n, total = len(mine), len(model)
    src = [1000 + i for i in range(2 * n)]
    dst = [2000 + i for i in range(2 * total)]
    lens = [10 + i for i in range(2 * n)]
    expected = ([(src[i], dst[offset + i], lens[i]) for i in range(n)]
                + [(src[n + i], dst[total + offset + i], lens[n + i]) for i in range(n)])

    def run() -> tuple[Any, ...]:
        standin = RecordingStandIn(pp_size=2, prefill_start_layer=offset)
        rc = sg.MooncakeKVManager._send_kvcache_generic(
            standin, mooncake_session_id="s", src_data_ptrs=src, dst_data_ptrs=dst,
            item_lens=lens, prefill_data_indices=pages(0), dst_data_indices=pages(0),
            executor=None, src_layer_ids=mine * 2, dst_layer_ids=model * 2)
        return rc, standin.blocks, standin.calls

    before, after = both(sg.MooncakeKVManager, run)
    assert before == (0, expected, 1)
    assert after == before


class RecordingAscendStandIn:
    """Not an SGLang class: a hybrid-MLA Ascend stage at PP 2 whose ``_send_kvcache_generic``
    records its keyword arguments and answers 7. Nothing else (no ``is_mla_backend``, no
    ``enable_custom_mem_pool``, no engine)."""

    def __init__(self) -> None:
        self.is_hybrid_mla_backend = True
        self.pp_size = 2
        self.kv_args = types.SimpleNamespace(kv_data_ptrs=[101, 102, 103, 104],
                                             kv_item_lens=[11, 12, 13, 14],
                                             kv_layer_ids=[31, 35, 31, 35])
        self.generic_kwargs: dict[str, Any] | None = None

    def _validate_envelope_kv_layout(self, *args: Any) -> None:
        pass

    def _send_kvcache_generic(self, **kwargs: Any) -> int:
        self.generic_kwargs = kwargs
        return 7


def _comparable(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    assert kwargs is not None
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def test_ascend_hybrid_pp_dispatch_calls_the_managers_generic_method(sg: Any) -> None:
    decode_ids = [3, 7, 31, 35, 3, 7, 31, 35]

    def run() -> tuple[Any, ...]:
        standin = RecordingAscendStandIn()
        rc = sg.AscendKVManager.send_kvcache(
            standin, mooncake_session_id="s", prefill_kv_indices=pages(1),
            dst_kv_ptrs=list(range(8)), dst_kv_indices=pages(2), executor=None,
            dst_layer_ids=decode_ids)
        return rc, _comparable(standin.generic_kwargs)

    before, after = both(sg.AscendKVManager, run)
    assert before[0] == 7
    assert before[1]["src_layer_ids"] == [31, 35, 31, 35]
    assert before[1]["dst_layer_ids"] == decode_ids
    assert after == before  # same status, same keyword arguments, nothing added


def test_mamba_stage1_slot_blocks_reach_the_stand_ins_transfer_data(sg: Any) -> None:
    """Slot 2 -> 3 of 16-byte items; the stage's layer 7 is decode entry 1 (item lengths
    ``[8, 16]``): one block at ``1000 + 2*16`` -> ``3000 + 3*16``."""

    def run() -> tuple[Any, ...]:
        standin = RecordingStandIn(pp_size=2, prefill_start_layer=1)
        rc = sg.MooncakeKVManager._send_mamba_state(
            standin, req=types.SimpleNamespace(mooncake_session_id="s"),
            prefill_mamba_index=[2], src_state_data_ptrs=[1000], src_state_item_lens=[16],
            dst_state_data_ptrs=[2000, 3000], dst_mamba_index=[3], src_layer_ids=[7],
            dst_layer_ids=[3, 7], dst_state_item_lens=[8, 16])
        return rc, standin.blocks

    before, after = both(sg.MooncakeKVManager, run)
    assert before == (0, [(1032, 3048, 16)])
    assert after == before


def test_mamba_slot_size_mismatch_is_refused_before_any_transfer(sg: Any) -> None:
    results = []
    for on in (False, True):
        with patched(sg.MooncakeKVManager, on):
            standin = RecordingStandIn(pp_size=1)
            results.append(outcome(lambda: sg.MooncakeKVManager._send_mamba_state(
                standin, req=types.SimpleNamespace(mooncake_session_id="s"),
                prefill_mamba_index=[1], src_state_data_ptrs=[1000], src_state_item_lens=[16],
                dst_state_data_ptrs=[2000], dst_mamba_index=[1], dst_state_item_lens=[32])))
            assert standin.calls == 0 and standin.blocks == []
    (_, t0, m0), (_, t1, m1) = results
    assert t0 is RuntimeError and issubclass(t1, kvplan.SizeMismatchError)
    assert "Mamba slot size mismatch" in m0 and m1 == m0


class SlottedStandIn:
    """A stand-in without an instance ``__dict__``: kvplan keeps no template cache on it."""

    __slots__ = ("pp_size", "blocks")

    def __init__(self) -> None:
        self.pp_size = 2
        self.blocks: list[tuple[int, int, int]] = []

    def _transfer_data(self, session: str, blocks: list[tuple[int, int, int]]) -> int:
        self.blocks.extend(blocks)
        return 0


def test_an_object_without_instance_dict_is_accepted_as_sglang_accepts_it(sg: Any) -> None:
    def run() -> list[tuple[int, int, int]]:
        standin = SlottedStandIn()
        for slot in (2, 5):
            assert sg.MooncakeKVManager._send_mamba_state(
                standin, types.SimpleNamespace(mooncake_session_id="s"), [slot], [1000, 5000],
                [16, 32], [2000, 3000, 4000], [3], [7, 11], [3, 7, 11], None) == 0
        return standin.blocks

    before, after = both(sg.MooncakeKVManager, run)
    assert after == before == [(1032, 3048, 16), (5064, 4096, 32),
                               (1080, 3048, 16), (5160, 4096, 32)]


# ---------------------------------------------------------------------------------------------
# Real manager classes: a subclass overriding _transfer_data sees every block
# ---------------------------------------------------------------------------------------------


_TRACING: dict[type, type] = {}


def tracing(cls: type) -> type:
    """A subclass of SGLang's ``cls`` that keeps every ``_transfer_data`` call, then forwards
    it to SGLang's own (so the engine sees the blocks too)."""
    if cls not in _TRACING:
        def _transfer_data(self: Any, session: str, blocks: Any) -> int:
            self.seen.append(list(blocks))
            return int(super(_TRACING[cls], self)._transfer_data(session, blocks))

        _TRACING[cls] = type(f"Tracing{cls.__name__}", (cls,), {"_transfer_data": _transfer_data})
    return _TRACING[cls]


def tracing_manager(sg: Any, cls: type, dep: Deployment, **attrs: Any) -> Any:
    hybrid_mla = dep.hybrid and dep.kind != "mha"
    attrs.setdefault("decode_kv_args_table", {SESSION: dep.register_info()})
    attrs.setdefault("is_mla_backend", dep.kind in ("mla", "npu") and not hybrid_mla)
    mgr = sg.manager_object(tracing(cls), kv_args=dep.kv_args(), is_hybrid_mla_backend=hybrid_mla,
                            pp_size=dep.pp_size, **attrs)
    mgr.seen = []
    return mgr


def seen_and_sent(mgr: Any, rc: Any) -> tuple[Any, ...]:
    """Status, every ``_transfer_data`` call's blocks, and every engine call."""
    return rc, mgr.seen, mgr.engine.calls


KV_CASES = [
    pytest.param(dict(kind="mla", num_layers=6, kv_layers=list(range(6)), pp_size=1, stage=0,
                      publish_ids=False), {}, id="mla-pp1-positional"),
    pytest.param(dict(kind="mla", num_layers=8, kv_layers=list(range(8)), pp_size=2, stage=1,
                      draft_layers=1, publish_ids=False), {}, id="mla-pp2-draft-positional"),
    pytest.param(dict(kind="mla", num_layers=24, kv_layers=list(range(1, 24, 2)), pp_size=2,
                      stage=1, hybrid=True), {}, id="hybrid-mla-pp2-ids"),
    pytest.param(dict(kind="mha", num_layers=24, kv_layers=list(range(3, 24, 4)), pp_size=2,
                      stage=0, hybrid=True), {}, id="hybrid-mha-pp2-ids"),
    pytest.param(dict(kind="mha", num_layers=6, kv_layers=list(range(6)), pp_size=1, stage=0,
                      publish_ids=False), {}, id="mha-pp1-positional"),
    pytest.param(dict(kind="mla", num_layers=6, kv_layers=list(range(6)), pp_size=1, stage=0),
                 {"max_transfer_batch_indices": 3}, id="mla-index-windows"),
    pytest.param(dict(kind="mla", num_layers=6, kv_layers=list(range(6)), pp_size=1, stage=0),
                 {"enable_custom_mem_pool": True}, id="mla-custom-pool-per-layer"),
]


@pytest.mark.parametrize("method", ["send_kvcache", "_send_kvcache_generic"])
@pytest.mark.parametrize("dep_kw,attrs", KV_CASES)
def test_mooncake_kv_blocks_reach_an_overridden_transfer_data(
        sg: Any, method: str, dep_kw: dict[str, Any], attrs: dict[str, Any]) -> None:
    dep = Deployment(**dep_kw)
    src, dst = pages(0, 1, 2, 5, 9, 10, 11), pages(4, 5, 6, 7, 20, 21, 30)
    sptrs, _, items, sids = dep.src_lists()
    dptrs, _, dids = dep.dst_lists()

    def run() -> tuple[Any, ...]:
        mgr = tracing_manager(sg, sg.MooncakeKVManager, dep, **attrs)
        if method == "send_kvcache":
            rc = mgr.send_kvcache(SESSION, src, dptrs, dst, InlineExecutor(), dst_layer_ids=dids)
        else:
            rc = mgr._send_kvcache_generic(SESSION, sptrs, dptrs, items, src, dst,
                                           InlineExecutor(), src_layer_ids=sids,
                                           dst_layer_ids=dids)
        return seen_and_sent(mgr, rc)

    before, after = both(sg.MooncakeKVManager, run)
    assert before[0] == 0 and before[1] and sum(map(len, before[1])) == len(engine_blocks(
        before[2]))
    assert after == before  # same statuses, same _transfer_data calls, same engine calls


def test_mamba_blocks_reach_an_overridden_transfer_data(sg: Any) -> None:
    dep = Deployment("mla", 4, list(range(4)), 1, 0)

    def run() -> tuple[Any, ...]:
        mgr = tracing_manager(sg, sg.MooncakeKVManager, dep)
        mgr.kv_args.state_data_ptrs = [[1000, 5000]]
        mgr.kv_args.state_data_lens = [[16 * 64, 32 * 64]]
        rc = mgr._send_mamba_state(types.SimpleNamespace(mooncake_session_id=SESSION), [2],
                                   [1000, 5000], [16, 32], [2000, 3000, 4000], [3], [7, 11],
                                   [3, 7, 11], [8, 16, 32])
        return seen_and_sent(mgr, rc)

    before, after = both(sg.MooncakeKVManager, run)
    assert before == (0, [[(1032, 3048, 16), (5064, 4096, 32)]],
                      [(SESSION, [1032, 5064], [3048, 4096], [16, 32])])
    assert after == before


ASCEND_CASES = [
    pytest.param(dict(kind="npu", num_layers=8, kv_layers=list(range(8)), pp_size=2, stage=1,
                      groups=2, draft_layers=1, publish_ids=False), {}, id="npu-groups-pp2"),
    pytest.param(dict(kind="npu", num_layers=8, kv_layers=list(range(8)), pp_size=1, stage=0,
                      groups=2, publish_ids=False), {}, id="npu-groups-pp1"),
    pytest.param(dict(kind="mha", num_layers=8, kv_layers=list(range(8)), pp_size=2, stage=0,
                      publish_ids=False), {"kvplan_decode_kv_layers": 8}, id="mha-pp2"),
    pytest.param(dict(kind="mla", num_layers=24, kv_layers=list(range(1, 24, 2)), pp_size=2,
                      stage=1, hybrid=True), {}, id="hybrid-mla-pp2-ids"),
    pytest.param(dict(kind="npu", num_layers=8, kv_layers=list(range(8)), pp_size=1, stage=0,
                      groups=2, publish_ids=False), {"enable_custom_mem_pool": True},
                 id="npu-custom-pool-per-layer"),
]


@pytest.mark.parametrize("dep_kw,attrs", ASCEND_CASES)
def test_ascend_blocks_reach_an_overridden_transfer_data(
        sg: Any, dep_kw: dict[str, Any], attrs: dict[str, Any]) -> None:
    dep = Deployment(**dep_kw)
    src, dst = pages(0, 1, 2, 5, 9), pages(4, 5, 6, 7, 20)
    dptrs, _, dids = dep.dst_lists()

    def run() -> tuple[Any, ...]:
        mgr = tracing_manager(sg, sg.AscendKVManager, dep, **attrs)
        rc = mgr.send_kvcache(SESSION, src, dptrs, dst, InlineExecutor(), dst_layer_ids=dids)
        return seen_and_sent(mgr, rc)

    with last_rank(dep.stage == dep.pp_size - 1):
        before, after = both(sg.AscendKVManager, run)
    assert before[0] == 0 and before[1]
    assert after == before


def _slice_manager(sg: Any, cls: type, *, tp_p: int, r_p: int, ids: bool) -> Any:
    heads, page, head_bytes, layers = 4, 2, 8, 3
    src_item = page * (heads // tp_p) * head_bytes
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=[1 << 30 | e << 16 for e in range(2 * layers)],
        kv_data_lens=[src_item * 16] * (2 * layers), kv_item_lens=[src_item] * (2 * layers),
        kv_layer_ids=list(range(layers)) * 2 if ids else [], page_size=page,
        total_kv_head_num=heads, kv_head_num=heads // tp_p, engine_rank=r_p,
        prefill_start_layer=0)
    mgr = sg.manager_object(cls, kv_args=kv_args, attn_tp_size=tp_p)
    mgr.seen = []
    return mgr


@pytest.mark.parametrize("ids", [True, False])
@pytest.mark.parametrize("tp_p,r_p,tp_d,r_d", [(4, 3, 2, 1), (1, 0, 2, 1)])
def test_slice_keeps_sglangs_submission_through_the_engine(
        sg: Any, ids: bool, tp_p: int, r_p: int, tp_d: int, r_d: int) -> None:
    """SGLang's ``send_kvcache_slice`` hands each layer pair to ``self.engine`` itself (it never
    calls ``_transfer_data``): a subclass overriding ``_transfer_data`` sees nothing from it, with
    or without kvplan, and the engine receives the same blocks."""
    dst_item = 2 * (4 // tp_d) * 8
    dptrs = [1 << 40 | e << 16 for e in range(6)]
    src, dst = pages(1, 2, 7), pages(0, 3, 4)

    def run() -> tuple[Any, ...]:
        mgr = _slice_manager(sg, tracing(sg.MooncakeKVManager), tp_p=tp_p, r_p=r_p, ids=ids)
        rc = mgr.send_kvcache_slice(SESSION, src, dptrs, dst, r_d, tp_d, dst_item,
                                    InlineExecutor(), dst_layer_ids=list(range(3)) * 2 if ids
                                    else None)
        return rc, mgr.seen, sorted(engine_blocks(mgr.engine.calls))

    before, after = both(sg.MooncakeKVManager, run)
    assert before[0] == 0 and before[1] == [] and before[2]
    assert after == before


def test_slice_goes_through_an_overridden_await_transfer_futures(sg: Any) -> None:
    class Awaiting(sg.MooncakeKVManager):
        def _await_transfer_futures(self, futures: Any) -> int:
            self.awaited.append(len(futures))
            return int(super()._await_transfer_futures(futures))

    dptrs = [1 << 40 | e << 16 for e in range(6)]

    def run() -> tuple[Any, ...]:
        mgr = _slice_manager(sg, Awaiting, tp_p=4, r_p=3, ids=True)
        mgr.awaited = []
        rc = mgr.send_kvcache_slice(SESSION, pages(1, 2), dptrs, pages(0, 3), 1, 2, 32,
                                    InlineExecutor(), dst_layer_ids=list(range(3)) * 2)
        # kvplan orders one pair's blocks token-major, SGLang page-major: same blocks per call
        return rc, mgr.awaited, [sorted(zip(*c[1:])) for c in mgr.engine.calls]

    before, after = both(sg.MooncakeKVManager, run)
    assert before[1] == [6] and len(before[2]) == 6  # one task and engine call per layer pair
    assert after == before


def test_instance_attribute_transfer_data_is_a_seam_too(sg: Any) -> None:
    dep = Deployment("mla", 6, list(range(6)), 1, 0)
    dptrs, _, dids = dep.dst_lists()

    def run() -> tuple[Any, ...]:
        mgr = tracing_manager(sg, sg.MooncakeKVManager, dep)
        kept: list[Any] = []
        mgr._transfer_data = lambda session, blocks: kept.append(blocks) or -5
        rc = mgr.send_kvcache(SESSION, pages(0, 1, 4), dptrs, pages(2, 3, 9), None,
                              dst_layer_ids=dids)
        return rc, kept, mgr.engine.calls

    before, after = both(sg.MooncakeKVManager, run)
    assert before[0] == -5 and before[2] == []
    assert after == before


def test_ascend_hybrid_dispatch_reaches_a_subclass_generic_override(sg: Any) -> None:
    """The Ascend hybrid-PP branch calls ``self._send_kvcache_generic``: a subclass override
    receives SGLang's keyword arguments, and its ``super()`` call reaches kvplan's drop-in."""
    dep = Deployment("mla", 24, list(range(1, 24, 2)), 2, 1, hybrid=True)
    dptrs, _, dids = dep.dst_lists()

    class Spy(sg.AscendKVManager):
        def _send_kvcache_generic(self, **kwargs: Any) -> int:
            self.kwargs = _comparable(kwargs)
            return int(super()._send_kvcache_generic(**kwargs))

    def run() -> tuple[Any, ...]:
        mgr = sg.manager_object(Spy, kv_args=dep.kv_args(), is_hybrid_mla_backend=True,
                                pp_size=2)
        rc = mgr.send_kvcache(SESSION, pages(0, 1), dptrs, pages(5, 6), None,
                              dst_layer_ids=dids)
        return rc, mgr.kwargs, mgr.engine.calls

    before, after = both(sg.AscendKVManager, run)
    assert before[0] == 0 and before[2]
    assert after == before


# ---------------------------------------------------------------------------------------------
# SGLang's own _transfer_data: the bounded-batch fast path is the one taken
# ---------------------------------------------------------------------------------------------


def test_real_instances_take_the_bounded_batch_fast_path(sg: Any) -> None:
    """With SGLang's own ``_transfer_data``, SGLang makes one engine call per request; kvplan
    plans arrays and submits at most ``max_blocks_per_batch`` blocks per call, never building
    SGLang's tuple list. Seen through every patched method on real instances."""
    from kvplan.compat.sglang import submit as impl

    def no_tuples(*args: Any) -> Any:
        raise AssertionError("the seam path ran on a manager with SGLang's _transfer_data")

    mp = pytest.MonkeyPatch()
    mp.setattr(impl, "block_tuples", no_tuples)
    try:
        dep = Deployment("mla", 6, list(range(6)), 1, 0)
        dptrs, _, dids = dep.dst_lists()
        src, dst = pages(0, 2, 4), pages(1, 3, 5)
        with patched(sg.MooncakeKVManager, max_blocks_per_batch=4):
            mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=dep.kv_args(),
                                    is_mla_backend=True)
            assert mgr.send_kvcache(SESSION, src, dptrs, dst, None, dst_layer_ids=dids) == 0
            assert [len(c[1]) for c in mgr.engine.calls] == [4, 4, 4, 4, 2]  # 18 blocks
            mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=types.SimpleNamespace(
                state_data_ptrs=[[1000, 5000]], state_data_lens=[[1024, 2048]]), pp_size=1)
            assert mgr._send_mamba_state(types.SimpleNamespace(mooncake_session_id=SESSION),
                                         [2], [1000, 5000], [16, 32], [2000, 3000], [3]) == 0
            assert mgr.engine.calls == [(SESSION, [1032, 5064], [2048, 3096], [16, 32])]
            mgr = _slice_manager(sg, sg.MooncakeKVManager, tp_p=4, r_p=3, ids=True)
            assert mgr.send_kvcache_slice(
                SESSION, pages(1, 2, 7), [1 << 40 | e << 16 for e in range(6)], pages(0, 3, 4),
                1, 2, 32, None, dst_layer_ids=list(range(3)) * 2) == 0  # no executor needed
            # 6 entry pairs x 3 pages x 2 token slots, none contiguous with the next
            assert [len(c[1]) for c in mgr.engine.calls] == [4] * 9
        npu = Deployment("npu", 8, list(range(8)), 1, 0, groups=2, publish_ids=False)
        with patched(sg.AscendKVManager, max_blocks_per_batch=5):
            mgr = sg.manager_object(sg.AscendKVManager, kv_args=npu.kv_args(),
                                    is_mla_backend=True)
            assert mgr.send_kvcache(SESSION, src, npu.dst_lists()[0], dst, None) == 0
            assert [len(c[1]) for c in mgr.engine.calls] == [5, 5, 5, 5, 5, 5, 5, 5, 5, 3]
    finally:
        mp.undo()
