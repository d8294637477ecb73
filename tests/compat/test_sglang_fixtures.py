"""Each SGLang 0.5.23 transfer backend's verdict on the shared planning fixtures
(:mod:`kvplan.testing.fixtures`), computed by running SGLang's real code from the wheel.

For every fixture, SGLang's own ``MooncakeKVManager`` and ``NixlKVManager`` methods run the
fixture's request (the call SGLang's transfer worker makes for that class) against a recording
engine / recording NIXL agent; their blocks or descriptors, prepared descriptor lists expanded
and indexed as NIXL indexes them, are mapped to a byte map and compared with the fixture's
expected one. :data:`VERDICTS` is the table docs/sglang.md shows; the test fails if SGLang's code
gives another verdict. With kvplan installed, each backend's call writes the expected bytes.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvplan.compat import sglang as compat
from kvplan.testing.fixtures import (
    PlanningFixture,
    byte_map_of_blocks,
    fixtures,
    merge_byte_maps,
)
from support.sglang_loader import InlineExecutor
from support.sglang_models import engine_blocks, load_loader, load_sglang_or_fail
from support.sglang_nixl import RecordingAgent, load_nixl

SESSION = "decode-peer:1"
FIXTURES = {f.name: f for f in fixtures()}

#: (backend, fixture) -> "agrees" (SGLang's bytes are the fixture's), "not run here (why)".
VERDICTS: dict[tuple[str, str], str] = {
    ("mooncake", "mla-pp-stage1"): "agrees",
    ("mooncake", "mha-pp-stage0"): "agrees",
    ("mooncake", "equal-tp-rank1"): "agrees",
    ("mooncake", "hetero-tp-split"): "agrees",
    ("mooncake", "hetero-tp-merge"): "agrees",
    ("mooncake", "dcp-rank1"): "agrees",
    ("mooncake", "hybrid-state"): "agrees",
    ("nixl", "mla-pp-stage1"): "agrees",
    # SGLang's NIXL KV path slices MHA positionally (layer ids unused) and reads a decode with
    # more entries than the stage as one with draft layers: an uneven PP split (3 layers over
    # 2 stages) puts stage 0's V block at decode K2 / V0
    ("nixl", "mha-pp-stage0"): "differs: wrong bytes in decode k2, v0; missing in v1",
    ("nixl", "equal-tp-rank1"): "agrees",
    ("nixl", "hetero-tp-split"): "agrees",
    ("nixl", "hetero-tp-merge"): "agrees",
    ("nixl", "dcp-rank1"): "agrees",
    ("nixl", "hybrid-state"): "agrees",
}
#: Fixtures not run through SGLang here, and why.
NOT_RUN = {
    "staging-split": "needs SGLang's gather/scatter GPU kernels (the staged fixture's bytes "
                     "are the hetero-tp-split fixture's)",
}


@pytest.fixture(scope="module")
def sg() -> Any:
    sg = load_sglang_or_fail()
    load_loader().load_head_slicing(sg)
    sg.nixl = load_nixl(sg)
    return sg


@contextlib.contextmanager
def maybe_installed(cls: type, on: bool) -> Iterator[None]:
    if on:
        compat.install(cls)
    try:
        yield
    finally:
        if on:
            compat.uninstall(cls)


def _lists(layout: Any, kind: str = "page") -> tuple[list[int], list[int], list[int], list[int]]:
    idx = [i for i, k in enumerate(layout.kinds) if k == kind]
    return ([int(layout.data_ptrs[i]) for i in idx], [int(layout.data_lens[i]) for i in idx],
            [int(layout.item_lens[i]) for i in idx], [int(layout.layer_ids[i]) for i in idx])


def _kv_args(src: Any, fx: PlanningFixture, rank: int) -> types.SimpleNamespace:
    ptrs, lens, items, ids = _lists(src)
    sp, sl, si, sids = _lists(src, "state")
    heads = src.kv_heads or 1
    return types.SimpleNamespace(
        kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items, kv_layer_ids=ids,
        prefill_start_layer=int(fx.context.get("prefill_start_layer", 0)),
        prefill_end_layer=None, mla_compression_ratios=None, num_draft_entries=0,
        page_size=src.page_size, engine_rank=rank, pp_rank=src.pp_rank, gpu_id=0,
        total_kv_head_num=heads, kv_head_num=max(1, heads // src.tp_size),
        state_data_ptrs=[sp] if sp else [], state_data_lens=[sl] if sl else [],
        state_item_lens=[si] if si else [], state_layer_ids=[sids] if sids else [])


def _expand(rows: np.ndarray) -> np.ndarray:
    """NIXL's strided rows (addr, len, dev, stride, count) as one (addr, len) row per block,
    as NIXL's per-block fallback (``_expand_stride_descs``) expands them."""
    if rows.shape[1] == 3:
        return rows[:, :2]
    parts = [np.stack([a + np.arange(c, dtype=np.uint64) * s,
                       np.full(c, n, dtype=np.uint64)], axis=1)
             for a, n, _, s, c in rows.tolist()]
    return np.concatenate(parts) if parts else np.empty((0, 2), np.uint64)


def _nixl_blocks(agent: RecordingAgent) -> list[tuple[int, int, int]]:
    """Bytes a recording agent's transfers write: plain descriptor pairs, and prepared
    transfers' indices into their expanded lists."""
    blocks = agent.written()
    for _, s_side, s_idx, d_side, d_idx in agent.prepped:
        s_rows, d_rows = _expand(s_side.parts[0])[s_idx], _expand(d_side.parts[0])[d_idx]
        assert (s_rows[:, 1] == d_rows[:, 1]).all()
        blocks += list(zip(s_rows[:, 0].tolist(), d_rows[:, 0].tolist(), s_rows[:, 1].tolist()))
    return blocks


def _mooncake(sg: Any, fx: PlanningFixture) -> tuple[Any, ...]:
    srcs, dst = fx.layouts()
    dptrs, _, ditems, dids = _lists(dst)
    dsp, _, dsi, dsids = _lists(dst, "state")
    maps = []
    s_pages = np.asarray(fx.src_pages, np.int32)
    d_pages = np.asarray(fx.dst_pages, np.int32)
    for r, src in enumerate(srcs):
        kv = _kv_args(src, fx, src.tp_rank)
        mla = src.kv_heads is None
        mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=kv, is_mla_backend=mla,
                                pp_size=int(fx.context.get("pp_size", 1)),
                                attn_tp_size=src.tp_size)
        klass = fx.fixture_class
        if klass.startswith("hetero-tp"):
            rc = mgr.send_kvcache_slice(SESSION, s_pages, dptrs, d_pages, dst.tp_rank,
                                        dst.tp_size, ditems[0], InlineExecutor(),
                                        dst_layer_ids=dids)
        elif klass == "dcp":
            rc = mgr.send_kvcache_dcp(
                SESSION, s_pages, dptrs, d_pages,
                dcp_token_item_lens=[i // src.page_size for i in kv.kv_item_lens],
                dst_dcp_size=dst.dcp_size, dst_dcp_rank=dst.dcp_rank, src_page_offset=0,
                decode_prefix_len=0, num_kv_tokens=fx.n_tokens, executor=None,
                dst_layer_ids=dids)
        else:
            rc = mgr.send_kvcache(SESSION, s_pages, dptrs, d_pages, None, dst_layer_ids=dids)
        if fx.src_slot is not None:
            req = types.SimpleNamespace(mooncake_session_id=SESSION)
            rc = rc or mgr._send_mamba_state(req, [fx.src_slot], kv.state_data_ptrs[0],
                                             kv.state_item_lens[0], dsp, [fx.dst_slot],
                                             kv.state_layer_ids[0], dsids, dsi)
        assert rc == 0
        maps.append(byte_map_of_blocks(engine_blocks(mgr.engine.calls), r))
    return merge_byte_maps(*maps)


def _nixl(sg: Any, fx: PlanningFixture) -> tuple[Any, ...]:
    srcs, dst = fx.layouts()
    dptrs, _, ditems, dids = _lists(dst)
    dsp, _, _, dsids = _lists(dst, "state")
    s_pages = np.asarray(fx.src_pages, np.int32)
    d_pages = np.asarray(fx.dst_pages, np.int32)
    maps = []
    for r, src in enumerate(srcs):
        kv = _kv_args(src, fx, src.tp_rank)
        mla = src.kv_heads is None
        info = types.SimpleNamespace(
            dst_kv_ptrs=dptrs, dst_kv_item_lens=ditems, dst_kv_item_len=ditems[0],
            dst_kv_layer_ids=dids, decode_tp_size=dst.tp_size, decode_tp_rank=dst.tp_rank,
            dst_num_slots=None, gpu_id=1, dst_dcp_size=dst.dcp_size, dst_dcp_rank=dst.dcp_rank,
            dcp_token_item_lens=[i // src.page_size for i in kv.kv_item_lens],
            dcp_dst_region_indices=list(range(len(dptrs))), dst_homogeneous_mem_kind="VRAM")
        mgr = sg.manager_object(
            sg.nixl.NixlKVManager, kv_args=kv, agent=RecordingAgent(), prep_handles={},
            src_mem_kind="VRAM", is_mla_backend=mla, pp_size=int(fx.context.get("pp_size", 1)),
            attn_tp_size=src.tp_size, decode_kv_args_table={SESSION: info},
            prep_handle_slice_src=None, prep_handles_slice_dst={}, _use_strided_descs=True)
        klass = fx.fixture_class
        if klass.startswith("hetero-tp"):
            mgr._init_hetero_tp_prep_handle(SESSION, info)
            mgr.send_kvcache_slice(SESSION, s_pages, d_pages)
        elif klass == "dcp":
            plan = sg.nixl.build_dcp_token_transfer_plan(
                s_pages, d_pages, physical_page_size=src.page_size, dcp_size=dst.dcp_size,
                dcp_rank=dst.dcp_rank, num_kv_tokens=fx.n_tokens)
            mgr.send_kvcache_dcp(SESSION, info, plan, None)
        else:
            mgr.send_kvcache(SESSION, s_pages, dptrs, d_pages, 1)
        if fx.src_slot is not None:
            mgr._send_mamba_state(SESSION, [fx.src_slot], kv.state_data_ptrs[0],
                                  kv.state_item_lens[0], dsp, [fx.dst_slot], 1,
                                  kv.state_layer_ids[0], dsids)
        maps.append(byte_map_of_blocks(_nixl_blocks(mgr.agent), r))
    return merge_byte_maps(*maps)


def _byte_dict(segments: tuple[Any, ...]) -> dict[int, tuple[int, int]]:
    return {d + k: (i, s + k) for i, s, d, n in segments for k in range(n)}


def verdict(got: tuple[Any, ...], fx: PlanningFixture) -> str:
    """"agrees", or which decode entries receive wrong bytes and which miss theirs."""
    if got == fx.expected:
        return "agrees"
    _, dst = fx.layouts()
    want, have = _byte_dict(fx.expected), _byte_dict(got)

    def entries(addrs: set[int]) -> str:
        names = set()
        for a in addrs:
            for j, (p, n) in enumerate(zip(dst.data_ptrs, dst.data_lens)):
                if p <= a < p + n:
                    names.add(f"{dst.roles[j]}{dst.layer_ids[j]}")
        return ", ".join(sorted(names)) or "none"

    wrong = {a for a, v in have.items() if want.get(a) != v}
    missed = {a for a in want if a not in have}
    return f"differs: wrong bytes in decode {entries(wrong)}; missing in {entries(missed)}"


BACKENDS = {"mooncake": (_mooncake, "MooncakeKVManager"), "nixl": (_nixl, "NixlKVManager")}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", [n for n in FIXTURES if n not in NOT_RUN])
def test_sglangs_own_verdict_on_each_fixture(sg: Any, backend: str, name: str) -> None:
    fx = FIXTURES[name]
    run, _ = BACKENDS[backend]
    assert verdict(run(sg, fx), fx) == VERDICTS[(backend, name)]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", [n for n in FIXTURES if n not in NOT_RUN])
def test_with_kvplan_installed_each_backend_writes_the_fixture(sg: Any, backend: str,
                                                              name: str) -> None:
    fx = FIXTURES[name]
    run, cls_name = BACKENDS[backend]
    cls = sg.nixl.NixlKVManager if backend == "nixl" else sg.MooncakeKVManager
    with maybe_installed(cls, True):
        assert run(sg, fx) == fx.expected


def test_every_fixture_has_a_verdict_or_a_reason() -> None:
    for name in FIXTURES:
        for backend in BACKENDS:
            assert (backend, name) in VERDICTS or name in NOT_RUN, (backend, name)
