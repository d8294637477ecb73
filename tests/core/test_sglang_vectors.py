"""The worked examples of docs/semantics.md ("Worked examples", W-…), through kvplan's public API.

Every expected value below is copied from that table (SGLang 0.5.23's results), not produced by
running kvplan. Where SGLang raises RuntimeError, kvplan raises a KvPlanError subclass; where
SGLang is wrong (W-mha-pp-slice's uneven split, NPU id truncation in W-hybrid-ids), kvplan must
be right or refuse.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvplan
from kvplan import (
    KvPlanError,
    Layout,
    LayoutError,
    Pairing,
    PairingError,
    SizeMismatchError,
    Template,
)


def a(*xs: int) -> np.ndarray:
    """docs/semantics.md's a(...): an int32 numpy array."""
    return np.array(xs, dtype=np.int32)


def gcc(src, dst):
    """group_contiguous, converted to SGLang's ([[src run]], [[dst run]]) shape."""
    s, d, n = kvplan.group_contiguous(src, dst)
    for arr in (s, d, n):
        assert isinstance(arr, np.ndarray)
        assert arr.dtype == np.int64
        assert arr.ndim == 1
    assert len(s) == len(d) == len(n)
    return (
        [list(range(int(x), int(x) + int(k))) for x, k in zip(s, n)],
        [list(range(int(x), int(x) + int(k))) for x, k in zip(d, n)],
    )


def pairs(src_ids, dst_ids, n_src, n_dst, fallback=False, **kw):
    out = kvplan.pair_entries(src_ids, dst_ids, n_src, n_dst, fallback, **kw)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.int64
    assert out.shape == (len(out), 2)
    return [tuple(int(v) for v in row) for row in out]


def blocks(plan):
    src, dst, ln = plan.src_addrs, plan.dst_addrs, plan.lengths
    for arr in (src, dst, ln):
        assert arr.dtype == np.uint64
    return ([int(x) for x in src], [int(x) for x in dst], [int(x) for x in ln])


def has_num(msg: str, value) -> bool:
    return re.search(rf"(?<![0-9]){re.escape(str(value))}(?![0-9])", msg) is not None


# ------------------------------------------------- W-runs-basic, W-runs-break, W-runs-empty


def test_w_runs_basic():
    assert gcc(a(0, 1, 2, 5, 6, 9), a(10, 11, 12, 13, 14, 20)) == (
        [[0, 1, 2], [5, 6], [9]],
        [[10, 11, 12], [13, 14], [20]],
    )


def test_w_runs_basic_raw_arrays():
    s, d, n = kvplan.group_contiguous(a(0, 1, 2, 5, 6, 9), a(10, 11, 12, 13, 14, 20))
    assert s.tolist() == [0, 5, 9]
    assert d.tolist() == [10, 13, 20]
    assert n.tolist() == [3, 2, 1]


def test_w_runs_break_duplicates():
    assert gcc(a(3, 3, 4), a(7, 8, 9)) == ([[3], [3, 4]], [[7], [8, 9]])


def test_w_runs_break_descents():
    assert gcc(a(5, 4, 3), a(1, 2, 3)) == ([[5], [4], [3]], [[1], [2], [3]])


def test_w_runs_empty_both():
    assert gcc(a(), a()) == ([], [])


@pytest.mark.parametrize("src,dst", [(a(1, 2), a()), (a(), a(1, 2))])
def test_w_runs_empty_one_side_is_an_error_not_a_silent_drop(src, dst):
    # SGLang returns ([], []) here, silently dropping the pages of the non-empty side;
    # kvplan's own API is strict. kvplan.compat.sglang reproduces SGLang's result exactly.
    with pytest.raises(KvPlanError, match=f"src has {len(src)} indices but dst has {len(dst)}"):
        kvplan.group_contiguous(src, dst)


def test_w_runs_empty_unequal_lengths():
    with pytest.raises(KvPlanError) as ei:
        kvplan.group_contiguous(a(1, 2, 3), a(4, 5))
    msg = str(ei.value)
    assert has_num(msg, 3) and has_num(msg, 2), msg


# ------------------------------------------------ W-kv-fifo, W-unique-draft-ids, W-positional


def test_w_kv_fifo_pairing():
    assert pairs([3, 7, 3, 7], [3, 7, 11, 3, 7, 11], 4, 6) == [(0, 0), (1, 1), (2, 3), (3, 4)]


def test_w_kv_fifo_pairing_with_roles():
    got = pairs(
        [3, 7, 3, 7],
        [3, 7, 11, 3, 7, 11],
        4,
        6,
        src_roles=["k", "k", "v", "v"],
        dst_roles=["k", "k", "k", "v", "v", "v"],
    )
    assert got == [(0, 0), (1, 1), (2, 3), (3, 4)]


def test_w_kv_fifo_roles_prevent_k_v_crossing():
    # Decode lists V before K: FIFO by id alone would pair K with V; (id, role) must not.
    got = pairs(
        [3, 7, 3, 7],
        [3, 7, 3, 7],
        4,
        4,
        src_roles=["k", "k", "v", "v"],
        dst_roles=["v", "v", "k", "k"],
    )
    assert got == [(0, 2), (1, 3), (2, 0), (3, 1)]


def test_w_unique_draft_ids_pp_stages():
    dst = [0, 1, 2, 3, 4, 5, 1000000]
    assert pairs([0, 1, 2, 3], dst, 4, 7) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert pairs([4, 5, 1000000], dst, 3, 7) == [(0, 4), (1, 5), (2, 6)]


def test_w_positional():
    assert pairs([], [], 3, 5, fallback=True) == [(0, 0), (1, 1), (2, 2)]
    assert pairs([1], [], 1, 3, fallback=True) == [(0, 0)]
    assert pairs([9], [], 0, 0) == []
    assert pairs(None, None, 2, 2) == [(0, 0), (1, 1)]


def test_w_positional_ids_as_numpy_arrays():
    # kvplan accepts numpy id arrays (SGLang's truthiness test would raise on them).
    got = pairs(np.array([3, 7, 3, 7]), np.array([3, 7, 11, 3, 7, 11]), 4, 6)
    assert got == [(0, 0), (1, 1), (2, 3), (3, 4)]
    assert pairs(np.array([], dtype=np.int64), None, 2, 2) == [(0, 0), (1, 1)]


def test_w_positional_one_sided():
    with pytest.raises(PairingError):
        kvplan.pair_entries([1], [], 1, 1)
    with pytest.raises(PairingError):
        kvplan.pair_entries([], [1], 1, 1)
    with pytest.raises(PairingError):
        kvplan.pair_entries(None, [1, 2], 2, 2)


def test_w_positional_metadata_length():
    with pytest.raises(PairingError) as ei:
        kvplan.pair_entries([1, 2], [1, 2, 3], 3, 3)
    msg = str(ei.value)
    assert has_num(msg, 2) and has_num(msg, 3), msg


def test_w_positional_missing_layer():
    with pytest.raises(PairingError) as ei:
        kvplan.pair_entries([1, 9], [1, 2, 3], 2, 3)
    assert has_num(str(ei.value), 9), str(ei.value)


def test_w_positional_missing_occurrence():
    with pytest.raises(PairingError) as ei:
        kvplan.pair_entries([3, 3, 3], [3, 3], 3, 2)
    assert has_num(str(ei.value), 3), str(ei.value)


def test_w_positional_count_mismatch_without_fallback():
    with pytest.raises(PairingError) as ei:
        kvplan.pair_entries([], [], 3, 5)
    msg = str(ei.value)
    assert has_num(msg, 3) and has_num(msg, 5), msg


def test_w_positional_fewer_dst_with_fallback():
    with pytest.raises(PairingError) as ei:
        kvplan.pair_entries([], [], 5, 3, True)
    msg = str(ei.value)
    assert has_num(msg, 5) and has_num(msg, 3), msg


# ------------------------------------------------------------------------------- W-hybrid-ids


def test_w_hybrid_ids_mla():
    lay = Layout.hybrid_linear([3, 7], [100, 200], [64, 64], 8)
    assert lay.layer_ids == [3, 7]
    assert lay.n_entries == 2


def test_w_hybrid_ids_mha():
    lay = Layout.hybrid_linear([3, 7], [100, 200, 300, 400], [64] * 4, 8, mla=False)
    assert lay.layer_ids == [3, 7, 3, 7]
    assert lay.roles == ["k", "k", "v", "v"]


@pytest.mark.parametrize("groups", [2, 3])
def test_w_hybrid_ids_npu_groups(groups):
    n = 2 * groups
    lay = Layout.npu_groups([3, 7], list(range(100, 100 + 100 * n, 100)), [64] * n, 8)
    assert lay.layer_ids == [3, 7] * groups
    assert lay.roles == [f"g{g}" for g in range(groups) for _ in range(2)]


@pytest.mark.parametrize("n_ptrs", [5, 1, 3])
def test_w_hybrid_ids_npu_groups_not_whole_multiple(n_ptrs):
    # SGLang truncates ([3,7,3,7] for 5 entries) or silently goes positional ([] for 1).
    with pytest.raises(LayoutError) as ei:
        Layout.npu_groups([3, 7], list(range(100, 100 + 100 * n_ptrs, 100)), [64] * n_ptrs, 8)
    msg = str(ei.value)
    assert has_num(msg, n_ptrs) and has_num(msg, 2), msg


# ----------------------------------------------------------------------------- W-mla-pp-slice


def legacy(kind, n_src, n_dst, start, **kw):
    out = kvplan.legacy_pp_pairs(kind, n_src, n_dst, start, **kw)
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.shape == (len(out), 2)
    return [tuple(int(v) for v in row) for row in out]


def apply_pairs(src, dst, prs):
    """Turn index pairs into the (src list, sliced dst list) SGLang returns."""
    return [src[i] for i, _ in prs], [dst[j] for _, j in prs]


def test_w_mla_pp_slice():
    src, dst = [1, 2], [10, 11, 12, 13, 14]
    prs = legacy("mla", len(src), len(dst), 2)
    assert apply_pairs(src, dst, prs) == ([1, 2], [12, 13])
    assert len(prs) == 2


def test_w_mla_pp_slice_with_draft():
    src, dst = [1, 2, 9], [10, 11, 12, 13, 14, 19]
    prs = legacy("mla", len(src), len(dst), 2, num_draft_entries=1)
    assert apply_pairs(src, dst, prs) == ([1, 2, 9], [12, 13, 19])
    assert len(prs) == 3


def test_w_mla_pp_slice_equal_lengths_unchanged():
    src, dst = [1, 2], [3, 4]
    assert apply_pairs(src, dst, legacy("mla", 2, 2, 5)) == ([1, 2], [3, 4])


def test_mla_pp_slice_out_of_range_is_pairing_error():
    # SGLang: dst[4:6] of 5 entries is short -> IndexError later. kvplan: PairingError.
    with pytest.raises(PairingError):
        kvplan.legacy_pp_pairs("mla", 2, 5, 4)


# ----------------------------------------------------------------------------- W-mha-pp-slice


def mha_slices(src, dst, start, **kw):
    prs = legacy("mha", len(src), len(dst), start, **kw)
    n = len(src) // 2
    assert len(prs) == 2 * n
    k = [dst[j] for _, j in prs[:n]]
    v = [dst[j] for _, j in prs[n:]]
    assert [i for i, _ in prs] == list(range(2 * n))
    return k, v


def test_w_mha_pp_slice_even_split():
    src = [102, 103, 202, 203]
    dst = [100, 101, 102, 103, 200, 201, 202, 203]
    assert mha_slices(src, dst, 2, decode_num_layers=4) == ([102, 103], [202, 203])
    # Without the decode's layer count the same counts could be 3 layers + 1 draft layer:
    # kvplan refuses to guess (SGLang's guess is what mis-slices uneven splits).
    with pytest.raises(PairingError, match="decode's layer count is needed"):
        mha_slices(src, dst, 2)


def test_w_mha_pp_slice_draft_layout_with_decode_layer_count():
    # dst = K0..K3, V0..V3, draft K, draft K, draft V, draft V; prefill has the 4 main layers.
    K = [1000 + i for i in range(4)]
    V = [2000 + i for i in range(4)]
    dst = K + V + [3000, 3001, 4000, 4001]
    src = [10, 11, 12, 13, 20, 21, 22, 23]
    assert mha_slices(src, dst, 0, decode_num_layers=4) == (K, V)


# 15 layers split 7 + 8, decode PP 1, no draft, K=1000+i, V=2000+i (W-mha-pp-slice, uneven split).
UNEVEN_DST = [1000 + i for i in range(15)] + [2000 + i for i in range(15)]
UNEVEN_CASES = [
    # (stage layers, start, correct K, correct V, SGLang's wrong V)
    (7, 0, list(range(1000, 1007)), list(range(2000, 2007)), [1014] + list(range(2000, 2006))),
    (8, 7, list(range(1007, 1015)), list(range(2007, 2015)), list(range(2000, 2008))),
]


@pytest.mark.parametrize("case", UNEVEN_CASES, ids=["stage0", "stage1"])
@pytest.mark.parametrize("kw", [{"decode_num_layers": 15}, {}], ids=["with_layers", "no_layers"])
def test_w_mha_pp_slice_uneven_split_correct_or_error(case, kw):
    n, start, good_k, good_v, sglang_v = case
    src = list(range(2 * n))
    try:
        k, v = mha_slices(src, UNEVEN_DST, start, **kw)
    except PairingError:
        assert "decode_num_layers" not in kw, "decode layer count given: must slice correctly"
        return
    assert v != sglang_v, "SGLang's wrong slice for an uneven split"
    assert (k, v) == (good_k, good_v)


@pytest.mark.parametrize(
    "n_src,n_dst,start",
    [
        (5, 10, 0),  # odd MHA source count: SGLang drops the last V silently
        (4, 8, 3),  # slice runs into the V block
        (6, 8, 2),  # K slice 2..5 overruns the 4 decode layers (SGLang: IndexError / wrong layers)
    ],
)
def test_mha_legacy_strict_errors(n_src, n_dst, start):
    with pytest.raises(PairingError):
        kvplan.legacy_pp_pairs("mha", n_src, n_dst, start)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_legacy_empty_stage_no_crash(kind):
    # SGLang divides by zero for an empty MHA stage. kvplan: no pairs, or a PairingError.
    try:
        out = kvplan.legacy_pp_pairs(kind, 0, 8, 0)
    except PairingError:
        return
    assert out.shape == (0, 2)


# ------------------------------------ W-mla-flat-plan, W-mha-halves-plan, W-mha-hybrid-stage1


def test_w_mla_flat_plan():
    src = Layout.mla([1000, 2000], [1000, 1000], 64)
    dst = Layout.mla([5000, 6000], [1000, 1000], 64)
    t = Template(src, dst)
    assert t.pairs.tolist() == [[0, 0], [1, 1]]
    plan = t.plan(a(0, 1, 2, 7), a(10, 11, 12, 3))
    assert blocks(plan) == (
        [1000, 1448, 2000, 2448],
        [5640, 5192, 6640, 6192],
        [192, 64, 192, 64],
    )
    assert plan.n_blocks == 4
    assert plan.total_bytes == 512


@pytest.mark.parametrize("with_ids", [False, True])
def test_w_mha_halves_plan(with_ids):
    ids = [0, 1] if with_ids else None
    src = Layout.mha([100, 200], [300, 400], [100, 100], [128, 128], 8, 16, layer_ids=ids)
    dst = Layout.mha([1100, 1200], [1300, 1400], [100, 100], [128, 128], 8, 16, layer_ids=ids)
    assert src.item_lens == [8, 8, 16, 16]
    assert src.data_ptrs == [100, 200, 300, 400]
    plan = Template(src, dst).plan(a(1, 2), a(5, 6))
    assert blocks(plan) == (
        [108, 208, 316, 416],
        [1140, 1240, 1380, 1480],
        [16, 16, 32, 32],
    )


def test_w_mha_hybrid_stage1_layer_id_path():
    src = Layout(
        [10, 11, 20, 21], [64] * 4, 4, layer_ids=[7, 11, 7, 11], pp_rank=1, pp_size=2
    )
    dst = Layout([100, 101, 102, 200, 201, 202], [64] * 6, 4, layer_ids=[3, 7, 11, 3, 7, 11])
    t = Template(src, dst)
    assert t.pairs.tolist() == [[0, 1], [1, 2], [2, 4], [3, 5]]
    plan = t.plan(a(0, 1), a(5, 6))
    assert blocks(plan) == ([10, 11, 20, 21], [121, 122, 221, 222], [8, 8, 8, 8])


def test_w_mha_hybrid_stage1_named_constructor_and_roles():
    src = Layout.mha([10, 11], [20, 21], [64, 64], [64, 64], 4, 4, layer_ids=[7, 11])
    dst = Layout.mha(
        [100, 101, 102], [200, 201, 202], [64] * 3, [64] * 3, 4, 4, layer_ids=[3, 7, 11]
    )
    assert src.layer_ids == [7, 11, 7, 11]
    assert dst.layer_ids == [3, 7, 11, 3, 7, 11]
    plan = Template(src, dst).plan(a(0, 1), a(5, 6))
    assert blocks(plan) == ([10, 11, 20, 21], [121, 122, 221, 222], [8, 8, 8, 8])


# ------------------------------------------------------ W-mamba-slot-stage1, W-mamba-slot-mismatch


def _mamba_layouts(src_item, dst_items, src_ids, dst_ids):
    """A hybrid layout: MLA page entries plus one Mamba conv state entry per layer."""
    n_dst = len(dst_items)
    if src_ids is None:
        # No ids published: raw entry lists with kinds (with_state always carries ids).
        src = Layout([500, 1000], [6400, 64], [64, src_item], roles=["kv", "mamba_conv"],
                     kinds=["page", "state"])
        dst = Layout(
            [600, 700][:n_dst] + [2000, 3000][:n_dst],
            [6400] * n_dst + [64] * n_dst,
            [64] * n_dst + list(dst_items),
            roles=["kv"] * n_dst + ["mamba_conv"] * n_dst,
            kinds=["page"] * n_dst + ["state"] * n_dst,
        )
        return src, dst
    src = Layout.mla([500], [6400], 64, layer_ids=src_ids)
    src = src.with_state("mamba_conv", [1000], [64], [src_item], src_ids)
    dst = Layout.mla([600, 700][:n_dst], [6400] * n_dst, 64, layer_ids=dst_ids)
    dst = dst.with_state("mamba_conv", [2000, 3000][:n_dst], [64] * n_dst, dst_items, dst_ids)
    return src, dst


def test_w_mamba_slot_stage1():
    src, dst = _mamba_layouts(16, [8, 16], [7], [3, 7])
    assert src.kinds == ["page", "state"]
    assert src.roles is None or src.roles[1] == "mamba_conv"
    t = Template(src, dst)
    assert t.state_pairs.tolist() == [[1, 3]]
    plan = t.plan_state(2, 3)
    assert blocks(plan) == ([1032], [3048], [16])
    assert plan.n_blocks == 1 and plan.total_bytes == 16


def test_w_mamba_slot_mismatch_with_ids():
    src, dst = _mamba_layouts(16, [32], [7], [7])
    with pytest.raises(SizeMismatchError) as ei:
        Template(src, dst)
    msg = str(ei.value)
    assert has_num(msg, 16) and has_num(msg, 32) and has_num(msg, 7), msg
    assert "mamba_conv" in msg, msg


def test_w_mamba_slot_mismatch_positional():
    src, dst = _mamba_layouts(16, [32], None, None)
    with pytest.raises(SizeMismatchError) as ei:
        Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=True))
    msg = str(ei.value)
    assert has_num(msg, 16) and has_num(msg, 32), msg


# ------------------------------------------------------------ W-ascend-pp1-flat, W-hybrid-pp-stage1


def test_w_ascend_pp1_flat():
    src = Layout.mla([1000, 2000, 3000], [1000] * 3, [10, 20, 30], device="npu")
    dst = Layout.mla([7000, 8000, 9000], [1000] * 3, [10, 20, 30], device="npu")
    plan = Template(src, dst).plan(a(1, 2, 5), a(4, 5, 9))
    assert blocks(plan) == (
        [1010, 1050, 2020, 2100, 3030, 3150],
        [7040, 7090, 8080, 8180, 9120, 9270],
        [20, 10, 40, 20, 60, 30],
    )
    assert plan.pair_offsets.tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize(
    "n_model,F,off",
    [(60, 8, 7), (60, 7, 0), (48, 5, 0)],
    ids=["60_layers_stage1", "60_layers_stage0", "48_layers_stage0"],
)
def test_w_hybrid_pp_stage1_by_layer_id(n_model, F, off):
    """W-hybrid-pp-stage1 / TestHybridSendUsesLayerIdPairing: full attention every 4th layer,
    one page 0 -> 0."""
    full = list(range(3, n_model, 4))
    N = len(full)
    stage = full[off:off + F]
    src_ptrs = [1000 + i for i in range(2 * F)]
    src_items = [10 + i for i in range(2 * F)]
    dst_ptrs = [2000 + i for i in range(2 * N)]
    # Decode item lengths equal the paired source lengths (kvplan checks them); unpaired: 10.
    dst_items = [10] * (2 * N)
    for i in range(F):
        dst_items[off + i] = 10 + i
        dst_items[N + off + i] = 10 + F + i
    src = Layout.hybrid_linear(
        stage, src_ptrs, [64] * (2 * F), src_items, mla=False, pp_rank=1 if off else 0, pp_size=2
    )
    dst = Layout.hybrid_linear(full, dst_ptrs, [64] * (2 * N), dst_items, mla=False)
    assert src.layer_ids == stage * 2
    plan = Template(src, dst).plan(a(0), a(0))
    # expected: (1000+i, 2000+off+i, 10+i) for i<F, then (1000+F+i, 2000+N+off+i, 10+F+i)
    assert blocks(plan) == (
        [1000 + i for i in range(F)] + [1000 + F + i for i in range(F)],
        [2000 + off + i for i in range(F)] + [2000 + N + off + i for i in range(F)],
        [10 + i for i in range(F)] + [10 + F + i for i in range(F)],
    )
    if (n_model, off) == (60, 7):  # W-hybrid-pp-stage1's literal numbers
        assert blocks(plan) == (
            list(range(1000, 1016)),
            list(range(2007, 2015)) + list(range(2022, 2030)),
            list(range(10, 26)),
        )


def test_w_mha_draft_tail_15_plus_1():
    """W-mha-draft-tail / TestGetMhaKvPtrsWithPp: prefill 15 layers (30 ptrs 0..29), decode
    15 + 1 draft (32 ptrs 100..131, draft K/V at the end), start 0 -> dst_k 100..114,
    dst_v 115..129."""
    src = list(range(30))
    dst = list(range(100, 132))
    k, v = mha_slices(src, dst, 0, decode_num_layers=15)
    assert (k, v) == (list(range(100, 115)), list(range(115, 130)))


def test_w_mha_pp_slice_uneven_split_through_template():
    # Legacy peers (no ids): stage 1 of 15 layers split 7 + 8, decode PP 1 knows its 15 layers.
    K = [1000 + i for i in range(15)]
    V = [2000 + i for i in range(15)]
    dst = Layout.mha(K, V, [64] * 15, [64] * 15, 8, 8, num_model_layers=15)
    src = Layout.mha(list(range(8)), list(range(8, 16)), [64] * 8, [64] * 8, 8, 8,
                     pp_rank=1, pp_size=2)
    t = Template(src, dst, Pairing.by_layer_id(prefill_start_layer=7, legacy_kind="mha"))
    got = [dst.data_ptrs[j] for _, j in t.pairs.tolist()]
    assert got == K[7:] + V[7:]


@pytest.mark.parametrize(
    "n_main,n_draft,start",
    [(15, 1, 0), (4, 2, 0)],
    ids=["draft_tail_15_plus_1", "mha_pp_slice_draft_4_plus_2"],
)
def test_mha_draft_layout_without_decode_layer_count_correct_or_error(n_main, n_draft, start):
    """Decode = K main, V main, draft K, draft V; the caller does not pass decode_num_layers.

    From the counts alone the layout is ambiguous (uneven PP split vs. draft entries), so kvplan
    must either find the right V block or refuse; SGLang 0.5.23's heuristic gets these right, so
    a wrong slice here would be a new silent wrong copy."""
    L = n_main  # the prefill holds every main layer (PP 1 on both sides, draft only on decode)
    src = list(range(2 * L))
    K = [1000 + i for i in range(n_main)]
    V = [2000 + i for i in range(n_main)]
    dst = K + V + [3000 + i for i in range(n_draft)] + [4000 + i for i in range(n_draft)]
    try:
        k, v = mha_slices(src, dst, start)
    except PairingError:
        return
    assert (k, v) == (K, V)


def test_w_mla_pp_slice_with_draft_through_template():
    # Legacy MLA peers (no ids): stage start 2 owns layers 2, 3 plus one draft entry.
    src = Layout([1, 2, 9], [640] * 3, 64, roles=["kv", "kv", "draft"])
    dst = Layout([10, 11, 12, 13, 14, 19], [640] * 6, 64, roles=["kv"] * 5 + ["draft"])
    t = Template(src, dst, Pairing.by_layer_id(prefill_start_layer=2, legacy_kind="mla"))
    assert [dst.data_ptrs[j] for _, j in t.pairs.tolist()] == [12, 13, 19]
    plan = t.plan(a(0, 1), a(4, 5))
    assert blocks(plan) == ([1, 2, 9], [12 + 256, 13 + 256, 19 + 256], [128, 128, 128])
