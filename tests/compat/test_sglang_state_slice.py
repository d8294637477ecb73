"""A hybrid model's state slot between prefill and decode of different attention TP sizes:
kvplan's TP channel split (``Layout.with_state(channels=...)``) against SGLang 0.5.23's own
``compute_mamba_state_slice_byte_blocks`` (real code from the wheel), and the Mooncake drop-in
``_send_mamba_state_slice`` against SGLang's method on a stand-in manager."""

from __future__ import annotations

import random
import types
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan import Layout, Template, capabilities
from kvplan.compat import sglang as compat
from support.sglang_models import load_sglang_or_fail

TPS = (1, 2, 4, 8)
BASE = 1 << 20


@pytest.fixture(scope="module")
def sg() -> Any:
    sg = load_sglang_or_fail()
    # SGLang's method logs through its own logger's warning_once (an SGLang addition that the
    # loader's plain logging.Logger lacks): a no-op here, restored after the module.
    logger = sg.modules["sglang.srt.disaggregation.mooncake.conn"].logger
    had = "warning_once" in vars(logger)
    if not hasattr(logger, "warning_once"):
        logger.warning_once = lambda *args, **kwargs: None
    yield sg
    if not had and "warning_once" in vars(logger):
        del logger.warning_once


def sglang_blocks(sg: Any) -> Any:
    return sg.modules["sglang.srt.disaggregation.utils"].compute_mamba_state_slice_byte_blocks


def connected(tp_p: int, tp_d: int) -> list[tuple[int, int]]:
    """The (prefill rank, decode rank) pairs SGLang connects: in scatter the one prefill rank
    that feeds a decode rank, in aggregation each of its ``tp_p / tp_d`` writers."""
    if tp_p <= tp_d:
        return [(r_d * tp_p // tp_d, r_d) for r_d in range(tp_d)]
    w = tp_p // tp_d
    return [(r_p, r_d) for r_d in range(tp_d) for r_p in range(r_d * w, (r_d + 1) * w)]


def random_case(rng: random.Random) -> dict[str, Any]:
    """One state tensor: a temporal state, a GDN conv state (q|k|v sub-blocks), a Kimi conv
    state (K - 1 rows) or a replicated state."""
    kind = rng.choice(["temporal", "gdn_conv", "kimi_conv", "replicated"])
    groups = None
    outer = 1
    if kind == "temporal":
        total = 8 * rng.randint(1, 4)
        bpc = 2 * rng.randint(1, 32)
    elif kind == "gdn_conv":
        key, value = 8 * rng.randint(1, 4), 8 * rng.randint(1, 6)
        groups = [key, key, value]
        total = sum(groups)
        bpc = 2 * rng.randint(1, 4)
    elif kind == "kimi_conv":
        total = 8 * rng.randint(1, 6)
        outer = rng.randint(1, 4)
        bpc = 2 * rng.randint(1, 2)
        if rng.random() < 0.3:
            groups = [total // 2, total // 2] if total % 16 == 0 else None
    else:
        total, bpc = 0, 2 * rng.randint(1, 64)
    return {"kind": kind, "total": total, "groups": groups, "outer": outer, "bpc": bpc}


def item_len(case: dict[str, Any], tp: int) -> int:
    if case["total"] == 0:
        return int(case["bpc"])
    return int(case["outer"] * (case["total"] // tp) * case["bpc"])


def dim(case: dict[str, Any], tp: int) -> int:
    return int(case["total"] // tp)


def side(case: dict[str, Any], tp: int, rank: int) -> Layout:
    item = item_len(case, tp)
    return Layout([], [], [], tp_size=tp, tp_rank=rank).with_state(
        "conv", [BASE], [item], [item], [0], channels=dim(case, tp), outer_rows=case["outer"],
        shard_groups=[case["groups"]])


def kvplan_blocks(case: dict[str, Any], tp_p: int, r_p: int, tp_d: int,
                  r_d: int) -> list[tuple[int, int, int]]:
    plan = Template(side(case, tp_p, r_p), side(case, tp_d, r_d)).plan_state(0, 0)
    src, dst, lens = plan.as_lists()
    return [(s - BASE, d - BASE, n) for s, d, n in zip(src, dst, lens)]


def applied(blocks: list[tuple[int, int, int]], src: np.ndarray, dst_len: int) -> np.ndarray:
    out = np.full(dst_len, -1, dtype=np.int64)
    for s, d, n in blocks:
        assert s + n <= src.size and d + n <= dst_len
        out[d:d + n] = src[s:s + n]
    return out


def test_byte_maps_equal_sglangs_on_random_cases(sg: Any) -> None:
    """1,200 seeded cases over every TP pair of {1, 2, 4, 8}² and every connected rank pair:
    the decode slot kvplan writes equals the one SGLang's blocks write, byte for byte, with no
    more blocks."""
    reference = sglang_blocks(sg)
    rng = random.Random(20261207)
    compared = fewer = 0
    for _ in range(1200):
        case = random_case(rng)
        tp_p, tp_d = rng.choice(TPS), rng.choice(TPS)
        src_item, dst_item = item_len(case, tp_p), item_len(case, tp_d)
        for r_p, r_d in connected(tp_p, tp_d):
            theirs = reference(
                src_item_len=src_item, dst_item_len=dst_item, src_dim=dim(case, tp_p),
                dst_dim=dim(case, tp_d), outer_count=case["outer"], src_attn_tp_size=tp_p,
                dst_attn_tp_size=tp_d, dst_tp_rank_in_group=r_d, local_tp_rank_in_group=r_p,
                conv_shard_groups=case["groups"])
            ours = kvplan_blocks(case, tp_p, r_p, tp_d, r_d)
            src = np.arange(src_item, dtype=np.int64) + 1000 * r_p
            assert np.array_equal(applied(ours, src, dst_item), applied(theirs, src, dst_item)), \
                (case, tp_p, r_p, tp_d, r_d, ours, theirs)
            assert len(ours) <= len(theirs), (case, ours, theirs)
            compared += 1
            fewer += len(ours) < len(theirs)
    assert compared > 3000
    assert fewer > 0  # merged runs: rows or sub-blocks that continue each other


def test_a_rank_pair_sglang_does_not_connect_moves_nothing() -> None:
    case = {"kind": "gdn_conv", "total": 48, "groups": [16, 16, 16], "outer": 1, "bpc": 2}
    assert kvplan_blocks(case, 2, 1, 4, 0) == []  # decode rank 0 is prefill rank 0's
    replicated = {"kind": "replicated", "total": 0, "groups": None, "outer": 1, "bpc": 64}
    assert kvplan_blocks(replicated, 4, 1, 2, 0) == []  # writer 0 of decode rank 0 sends
    assert kvplan_blocks(replicated, 4, 0, 2, 0) == [(0, 0, 64)]


@pytest.mark.parametrize("src,dst,words", [
    ((2, 16, 3, None, 2), (4, 8, 2, None, 2), ["outer rows", "3", "2"]),
    ((2, 16, 1, None, 2), (4, 16, 1, None, 2), ["model channels", "32", "64"]),
    ((2, 16, 1, None, 2), (4, 8, 1, None, 4), ["bytes per channel", "2 bytes", "4 bytes"]),
    ((2, 16, 1, [8, 8, 16], 2), (4, 8, 1, None, 2), ["shard groups", "[8, 8, 16]", "none"]),
    ((2, 0, 1, None, 64), (4, 8, 1, None, 8), ["replication", "0 channels", "8 channels"]),
])
def test_splits_that_differ_are_refused_naming_both(src: tuple[Any, ...], dst: tuple[Any, ...],
                                                    words: list[str]) -> None:
    def layout(tp: int, channels: int, rows: int, groups: Any, bpc: int) -> Layout:
        item = bpc if channels == 0 else channels * rows * bpc
        return Layout([], [], [], tp_size=tp).with_state(
            "conv", [BASE], [item], [item], [0], channels=channels, outer_rows=rows,
            shard_groups=[groups])
    with pytest.raises(kvplan.KvPlanError) as err:
        Template(layout(*src), layout(*dst))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_descriptor_tables_refuse_a_sliced_state_template() -> None:
    src = Layout([], [], [], tp_size=1).with_state("conv", [BASE], [64], [64], [0], channels=32,
                                                   shard_groups=[[16, 16]])
    dst = Layout([], [], [], tp_size=2, tp_rank=1).with_state(
        "conv", [2 * BASE], [32], [32], [0], channels=16, shard_groups=[[16, 16]])
    t = Template(src, dst)
    assert t.plan_state(0, 0).as_lists() == ([BASE + 16, BASE + 48], [2 * BASE, 2 * BASE + 16],
                                             [16, 16])
    batch = t.plan_batch([kvplan.Request(slot=(0, 0))])
    assert batch.as_lists() == t.plan_state(0, 0).as_lists()
    with pytest.raises(kvplan.UnsupportedError, match="moves 1 state pairs") as err:
        t.descriptor_table("src")
    assert (err.value.planner, err.value.feature) == ("descriptor_table", "sliced_state")
    assert not capabilities.supports("descriptor_table", "sliced_state")
    assert capabilities.supports("plan_batch", "sliced_state")


def test_one_side_split_is_refused() -> None:
    split = Layout([], [], [], tp_size=2).with_state("conv", [BASE], [64], [64], [0], channels=16)
    whole = Layout([], [], [], tp_size=4).with_state("conv", [BASE], [32], [32], [0])
    with pytest.raises(kvplan.KvPlanError, match="presence"):
        Template(split, whole)


@pytest.mark.parametrize("item,kwargs,words", [
    (100, {"channels": 16, "outer_rows": 3}, "is not 3 rows of 16 channels"),
    (96, {"channels": 16, "shard_groups": [[8, 8]]}, "sum to 16 channels"),
    (96, {"channels": 6, "shard_groups": [[3, 3, 6]]}, "shard group of 3 channels"),
    (96, {"channels": 16, "outer_rows": 0}, "at least 1 outer row"),
    (96, {"channels": 0, "shard_groups": [[4]]}, "replicated state"),
])
def test_splits_that_do_not_fit_the_entry_are_layout_errors(item: int, kwargs: dict[str, Any],
                                                            words: str) -> None:
    with pytest.raises(kvplan.LayoutError, match=words):
        Layout([], [], [], tp_size=2).with_state("conv", [BASE], [item], [item], [0], **kwargs)


def test_outer_rows_without_channels_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="give channels too"):
        Layout([], [], [], tp_size=2).with_state("conv", [BASE], [64], [64], [0], outer_rows=2)


def test_the_split_survives_bytes_and_dict_round_trips() -> None:
    layout = Layout([], [], [], tp_size=2).with_state(
        "conv", [BASE, 2 * BASE], [96, 64], [96, 64], [0, 1], channels=[24, 0], outer_rows=[2, 1],
        shard_groups=[[8, 8, 32], None])
    want = [(24, 2, [8, 8, 32]), (0, 1, [])]
    assert layout.state_channels == want
    assert Layout.from_bytes(layout.to_bytes()).state_channels == want
    assert Layout.from_dict(layout.to_dict()).state_channels == want
    plain = Layout([], [], [], tp_size=2).with_state("conv", [BASE], [96], [96], [0])
    assert plain.fingerprint() != Layout([], [], [], tp_size=2).with_state(
        "conv", [BASE], [96], [96], [0], channels=24, outer_rows=2).fingerprint()


# ---------------------------------------------------------------------------------------------
# The Mooncake drop-in against SGLang's own method, on a stand-in manager
# ---------------------------------------------------------------------------------------------


class StandIn:
    """What SGLang's ``_send_mamba_state_slice`` reads, and a ``_transfer_data`` that keeps
    every block it is handed."""

    def __init__(self, tp: int, rank: int, pp_size: int = 1) -> None:
        self.state_tp_size = tp
        self.pp_size = pp_size
        self.enable_custom_mem_pool = False
        self.max_transfer_batch_indices = 0
        self.kv_args = types.SimpleNamespace(engine_rank=rank)
        self.blocks: list[tuple[int, int, int]] = []

    def _transfer_data(self, session: str, blocks: list[tuple[int, int, int]]) -> int:
        self.blocks.extend(blocks)
        return 0


def gdn_call(tp_p: int, r_p: int, tp_d: int, r_d: int) -> dict[str, Any]:
    """A GDN layer pair (conv [q|k|v] and temporal) and a replicated state, layers 3 and 7."""
    conv = {"total": 64, "groups": [16, 16, 32], "outer": 1, "bpc": 6}
    temporal = {"total": 8, "groups": None, "outer": 1, "bpc": 128}
    kimi = {"total": 32, "groups": None, "outer": 3, "bpc": 2}
    tensors = [conv, temporal, kimi]
    src_items = [item_len(t, tp_p) for t in tensors] + [48]
    dst_items = [item_len(t, tp_d) for t in tensors] + [48]
    return dict(
        req=types.SimpleNamespace(mooncake_session_id="s"), prefill_mamba_index=[2],
        src_state_data_ptrs=[BASE, 2 * BASE, 3 * BASE, 4 * BASE], src_state_item_lens=src_items,
        src_state_dim_per_tensor=[dim(t, tp_p) for t in tensors] + [0],
        dst_state_data_ptrs=[5 * BASE, 6 * BASE, 7 * BASE, 8 * BASE], dst_mamba_index=[5],
        dst_state_item_lens=dst_items,
        dst_state_dim_per_tensor=[dim(t, tp_d) for t in tensors] + [0],
        dst_tp_rank=r_d, dst_attn_tp_size=tp_d,
        src_state_conv_shard_groups=[conv["groups"], None, None, None],
        src_state_slice_outer_counts=[1, 1, 3, 1],
        src_layer_ids=[3, 3, 7, 7], dst_layer_ids=[3, 3, 7, 7])


def written(blocks: list[tuple[int, int, int]]) -> dict[int, int]:
    """Decode byte -> source byte of every block (a byte written twice must agree)."""
    out: dict[int, int] = {}
    for s, d, n in blocks:
        for k in range(n):
            assert out.setdefault(d + k, s + k) == s + k
    return out


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (1, 4), (4, 2), (8, 2), (2, 8)])
def test_dropin_writes_what_sglangs_method_writes(sg: Any, tp_p: int, tp_d: int) -> None:
    for r_p, r_d in connected(tp_p, tp_d):
        theirs = StandIn(tp_p, r_p)
        assert sg.MooncakeKVManager._send_mamba_state_slice(
            theirs, **gdn_call(tp_p, r_p, tp_d, r_d)) == 0
        compat.install(sg.MooncakeKVManager)
        try:
            assert compat.installed(sg.MooncakeKVManager)
            ours = StandIn(tp_p, r_p)
            assert sg.MooncakeKVManager._send_mamba_state_slice(
                ours, **gdn_call(tp_p, r_p, tp_d, r_d)) == 0
        finally:
            compat.uninstall(sg.MooncakeKVManager)
        assert written(ours.blocks) == written(theirs.blocks)
        assert 0 < len(ours.blocks) <= len(theirs.blocks)


def test_dropin_without_dims_calls_send_mamba_state_as_sglang_does(sg: Any) -> None:
    calls: list[tuple[Any, ...]] = []

    class Recording(StandIn):
        def _send_mamba_state(self, *args: Any) -> int:
            calls.append(args)
            return 0

    for on in (False, True):
        if on:
            compat.install(sg.MooncakeKVManager)
        try:
            kwargs = gdn_call(1, 0, 2, 0)
            kwargs["dst_state_dim_per_tensor"] = []
            assert sg.MooncakeKVManager._send_mamba_state_slice(Recording(1, 0), **kwargs) == 0
        finally:
            if on:
                compat.uninstall(sg.MooncakeKVManager)
    assert len(calls) == 2 and calls[0] == calls[1]


# ---------------------------------------------------------------------------------------------
# The NIXL drop-in against SGLang's own method, with a recording NIXL agent
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nx(sg: Any) -> Any:
    from support.sglang_nixl import load_nixl

    mod = load_nixl(sg)
    logger = mod.logger
    had = "warning_once" in vars(logger)
    if not hasattr(logger, "warning_once"):
        logger.warning_once = lambda *args, **kwargs: None
    yield types.SimpleNamespace(sg=sg, mod=mod, cls=mod.NixlKVManager)
    if not had and "warning_once" in vars(logger):
        del logger.warning_once


def nixl_run(nx: Any, patched: bool, tp_p: int, r_p: int, tp_d: int, r_d: int,
             null_dst: bool) -> tuple[Any, int]:
    from support.sglang_models import canonical
    from support.sglang_nixl import RecordingAgent

    kw = gdn_call(tp_p, r_p, tp_d, r_d)
    dptrs = list(kw["dst_state_data_ptrs"])
    if null_dst:
        dptrs[1] = 0  # SGLang skips a pair with a null decode pointer
    kv = types.SimpleNamespace(gpu_id=0, engine_rank=r_p, kv_data_ptrs=[], kv_data_lens=[],
                               kv_item_lens=[], prefill_start_layer=0)
    if patched:
        compat.install(nx.cls)
    try:
        mgr = nx.sg.manager_object(nx.cls, kv_args=kv, agent=RecordingAgent(), prep_handles={},
                                   src_mem_kind="VRAM", decode_kv_args_table={}, pp_size=1,
                                   state_tp_size=tp_p)
        mgr._send_mamba_state_slice(
            "peer", kw["prefill_mamba_index"], kw["src_state_data_ptrs"],
            kw["src_state_item_lens"], kw["src_state_dim_per_tensor"], dptrs,
            kw["dst_mamba_index"], kw["dst_state_item_lens"], kw["dst_state_dim_per_tensor"], 2,
            tp_d, r_d, kw["src_state_conv_shard_groups"], kw["src_state_slice_outer_counts"],
            kw["src_layer_ids"], kw["dst_layer_ids"])
    finally:
        if patched:
            compat.uninstall(nx.cls)
    return canonical(mgr.agent.written()), mgr.agent.descriptor_count()


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (4, 2), (2, 8)])
@pytest.mark.parametrize("null_dst", [False, True])
def test_nixl_dropin_writes_what_sglangs_method_writes(nx: Any, tp_p: int, tp_d: int,
                                                       null_dst: bool) -> None:
    for r_p, r_d in connected(tp_p, tp_d):
        theirs, their_count = nixl_run(nx, False, tp_p, r_p, tp_d, r_d, null_dst)
        ours, our_count = nixl_run(nx, True, tp_p, r_p, tp_d, r_d, null_dst)
        assert ours == theirs
        assert 0 < our_count <= their_count
