"""API contract (docs/api.md): errors, dtypes, zero-copy, output ownership, out=, batches, threads."""

from __future__ import annotations

import gc
import re
import threading
import tracemalloc
import weakref

import numpy as np
import pytest

import kvplan
from kvplan import (
    IndexBoundsError,
    KvPlanError,
    Layout,
    LayoutError,
    Pairing,
    PairingError,
    SizeMismatchError,
    Template,
)

from support import reference as ref
from support.robustness_checks import run_racing_threads


def has_num(msg: str, value) -> bool:
    return re.search(rf"(?<![0-9]){re.escape(str(value))}(?![0-9])", msg) is not None


def i32(*xs):
    return np.array(xs, dtype=np.int32)


# A small MLA peer pair used throughout: 3 layers, item 64, capacity 100 pages each side.
ITEM, CAP = 64, 100
SRC_PTRS = [1 << 20, 2 << 20, 3 << 20]
DST_PTRS = [1 << 30, 2 << 30, 3 << 30]


def mla_pair(cap_src=CAP, cap_dst=CAP):
    src = Layout.mla(SRC_PTRS, [cap_src * ITEM] * 3, ITEM, layer_ids=[0, 1, 2])
    dst = Layout.mla(DST_PTRS, [cap_dst * ITEM] * 3, ITEM, layer_ids=[0, 1, 2])
    rs = ref.RefLayout(SRC_PTRS, [cap_src * ITEM] * 3, [ITEM] * 3, [0, 1, 2])
    rd = ref.RefLayout(DST_PTRS, [cap_dst * ITEM] * 3, [ITEM] * 3, [0, 1, 2])
    return src, dst, rs, rd


@pytest.fixture(scope="module")
def mla():
    src, dst, rs, rd = mla_pair()
    return Template(src, dst), rs, rd


def expected_plan(rs, rd, sp, dp):
    return ref.plan_blocks(rs, rd, ref.template_pairs(rs, rd), list(sp), list(dp))


def lists(plan):
    return (
        [int(x) for x in plan.src_addrs],
        [int(x) for x in plan.dst_addrs],
        [int(x) for x in plan.lengths],
    )


def assert_plan_equals(plan, exp: ref.RefPlan):
    assert lists(plan) == (exp.src, exp.dst, exp.lengths)
    assert plan.n_blocks == exp.n_blocks
    assert plan.total_bytes == exp.total_bytes


FRAG_SRC = i32(0, 1, 2, 5, 6, 9, 40, 41)
FRAG_DST = i32(10, 11, 12, 13, 14, 20, 3, 4)


# ------------------------------------------------------------------------------ exceptions


def test_exception_hierarchy():
    assert issubclass(KvPlanError, ValueError)
    for cls in (PairingError, IndexBoundsError, SizeMismatchError, LayoutError):
        assert issubclass(cls, KvPlanError)
        assert cls is not KvPlanError
    assert issubclass(kvplan.TransferError, RuntimeError)
    assert not issubclass(kvplan.TransferError, KvPlanError)
    # distinct branches: a caller can tell them apart
    classes = [PairingError, IndexBoundsError, SizeMismatchError, LayoutError]
    for a_ in classes:
        for b_ in classes:
            if a_ is not b_:
                assert not issubclass(a_, b_)


# ------------------------------------------------------------------------------ group_contiguous: types


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.bool_, np.uint64])
@pytest.mark.parametrize("side", ["src", "dst", "both"])
def test_group_contiguous_wrong_dtype_is_type_error(dtype, side):
    good = np.array([1, 2, 3], dtype=np.int64)
    bad = np.array([1, 2, 3]).astype(dtype)
    src = bad if side in ("src", "both") else good
    dst = bad if side in ("dst", "both") else good
    with pytest.raises(TypeError):
        kvplan.group_contiguous(src, dst)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_group_contiguous_2d_is_type_error(dtype):
    x = np.arange(6, dtype=dtype).reshape(2, 3)
    with pytest.raises(TypeError):
        kvplan.group_contiguous(x, x)
    with pytest.raises(TypeError):
        kvplan.group_contiguous(np.arange(6, dtype=dtype), x.reshape(1, 6))


def test_group_contiguous_0d_is_type_error():
    x = np.array(5, dtype=np.int64)
    with pytest.raises(TypeError):
        kvplan.group_contiguous(x, x)


def test_group_contiguous_type_error_is_not_kvplan_error():
    with pytest.raises(TypeError) as ei:
        kvplan.group_contiguous(np.zeros(3), np.zeros(3))
    assert not isinstance(ei.value, KvPlanError)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_group_contiguous_unequal_lengths(dtype):
    with pytest.raises(KvPlanError) as ei:
        kvplan.group_contiguous(np.arange(5, dtype=dtype), np.arange(4, dtype=dtype))
    assert has_num(str(ei.value), 5) and has_num(str(ei.value), 4), str(ei.value)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("side", ["src", "dst"])
def test_group_contiguous_negative(dtype, side):
    good = np.array([1, 2, 3], dtype=dtype)
    bad = np.array([1, -7, 3], dtype=dtype)
    with pytest.raises(KvPlanError) as ei:
        kvplan.group_contiguous(bad if side == "src" else good, bad if side == "dst" else good)
    assert "-7" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("sd", [np.int32, np.int64])
@pytest.mark.parametrize("dd", [np.int32, np.int64])
def test_group_contiguous_both_dtypes_and_mixed(sd, dd):
    src = np.array([0, 1, 2, 5, 6, 9], dtype=sd)
    dst = np.array([10, 11, 12, 13, 14, 20], dtype=dd)
    s, d, n = kvplan.group_contiguous(src, dst)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 5, 9], [10, 13, 20], [3, 2, 1])


def test_group_contiguous_large_values_int64():
    big = 2**40
    s, d, n = kvplan.group_contiguous(
        np.array([big, big + 1, 7], dtype=np.int64), np.array([3, 4, big], dtype=np.int64)
    )
    assert (s.tolist(), d.tolist(), n.tolist()) == ([big, 7], [3, big], [2, 1])


def test_group_contiguous_int32_extremes():
    top = 2**31 - 1
    s, d, n = kvplan.group_contiguous(i32(top - 1, top, 0), i32(0, 1, 2))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([top - 1, 0], [0, 2], [2, 1])


def test_group_contiguous_strided_view_correct_or_type_error():
    base = np.arange(20, dtype=np.int32)
    src = base[::2]  # 0, 2, 4, ... (not contiguous in memory, no +1 steps)
    dst = np.arange(100, 110, dtype=np.int32)
    try:
        s, d, n = kvplan.group_contiguous(src, dst)
    except TypeError:
        return
    assert list(zip(s.tolist(), d.tolist(), n.tolist())) == ref.group_runs(src.tolist(), dst.tolist())


def test_group_contiguous_byteswapped_correct_or_type_error():
    src = np.array([1, 2, 3, 9], dtype=">i4")
    dst = np.array([5, 6, 7, 8], dtype=">i8")
    try:
        s, d, n = kvplan.group_contiguous(src, dst)
    except TypeError:
        return
    assert (s.tolist(), d.tolist(), n.tolist()) == ([1, 9], [5, 8], [3, 1])


def test_group_contiguous_readonly_input():
    src = np.array([4, 5, 6], dtype=np.int32)
    dst = np.array([7, 8, 9], dtype=np.int32)
    src.flags.writeable = False
    dst.flags.writeable = False
    s, d, n = kvplan.group_contiguous(src, dst)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([4], [7], [3])


def test_group_contiguous_does_not_modify_input():
    src = np.array([3, 3, 4, 9], dtype=np.int32)
    dst = np.array([7, 8, 9, 1], dtype=np.int64)
    s0, d0 = src.copy(), dst.copy()
    kvplan.group_contiguous(src, dst)
    assert np.array_equal(src, s0) and np.array_equal(dst, d0)


# ------------------------------------------------------------------------------ zero-copy inputs


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_group_contiguous_does_not_copy_inputs(dtype):
    """A 4M-element input: converting or copying it through numpy would allocate >= 16 MB.

    numpy reports its data allocations to tracemalloc, so a conversion in the Python wrapper
    (np.asarray(x, np.int64), np.ascontiguousarray, ...) shows up in the traced peak."""
    n = 4_000_000
    src = np.arange(n, dtype=dtype)
    dst = np.arange(10, n + 10, dtype=dtype)
    kvplan.group_contiguous(src[:10], dst[:10])  # warm up lazy imports / caches
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        s, d, ln = kvplan.group_contiguous(src, dst)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (s.tolist(), d.tolist(), ln.tolist()) == ([0], [10], [n])
    assert peak - before < 1_000_000, f"traced peak grew by {peak - before} bytes"


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_plan_does_not_copy_page_arrays(dtype):
    n = 2_000_000
    lay_s = Layout.mla([1 << 40], [n * 8], 8, layer_ids=[0])
    lay_d = Layout.mla([1 << 41], [(n + 5) * 8], 8, layer_ids=[0])
    t = Template(lay_s, lay_d)
    src = np.arange(n, dtype=dtype)
    dst = np.arange(5, n + 5, dtype=dtype)
    t.plan(src[:4], dst[:4])
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        plan = t.plan(src, dst)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lists(plan) == ([1 << 40], [(1 << 41) + 40], [n * 8])
    assert peak - before < 1_000_000, f"traced peak grew by {peak - before} bytes"


# ------------------------------------------------------------------------------ pair_entries


def test_pair_entries_roles_length_mismatch_is_error():
    with pytest.raises((PairingError, LayoutError, TypeError)):
        kvplan.pair_entries([1, 2], [1, 2], 2, 2, src_roles=["k"], dst_roles=["k", "k"])


def test_pair_entries_output_shape_for_no_pairs():
    out = kvplan.pair_entries([9], [], 0, 0)
    assert out.dtype == np.int64 and out.shape == (0, 2)


# ------------------------------------------------------------------------------ layouts


def test_layout_list_lengths_differ():
    with pytest.raises(LayoutError):
        Layout([1000, 2000], [640], 64)
    with pytest.raises(LayoutError):
        Layout([1000, 2000], [640, 640], [64])
    with pytest.raises(LayoutError):
        Layout([1000, 2000], [640, 640], 64, layer_ids=[1])
    with pytest.raises(LayoutError):
        Layout([1000, 2000], [640, 640], 64, roles=["k"])


def test_layout_properties():
    lay = Layout([1000, 2000], [650, 6400], [64, 128], layer_ids=[3, 7], roles=["kv", "kv"])
    assert lay.n_entries == 2
    assert lay.data_ptrs == [1000, 2000]
    assert lay.data_lens == [650, 6400]
    assert lay.item_lens == [64, 128]
    assert lay.layer_ids == [3, 7]
    assert lay.roles == ["kv", "kv"]
    assert lay.kinds == ["page", "page"]
    assert lay.capacities == [10, 50]  # floor(650 / 64)
    assert lay.page_size == 1
    assert lay.device == "cpu"


def test_layout_is_immutable():
    lay = Layout([1000], [640], 64)
    with pytest.raises((AttributeError, TypeError)):
        lay.data_ptrs = [5]  # type: ignore[misc]
    ptrs = lay.data_ptrs
    if isinstance(ptrs, list):
        ptrs.append(99)  # mutating the returned list must not change the layout
    assert lay.data_ptrs == [1000]


def test_layout_full_u64_addresses():
    top = 2**64 - 8192  # buffer ends 4 KiB below 2**64
    lay = Layout([top], [4096], 64)
    assert lay.data_ptrs == [top]
    t = Template(lay, Layout([1 << 20], [4096], 64))
    plan = t.plan(i32(63), i32(0))
    assert lists(plan) == ([top + 63 * 64], [1 << 20], [64])


def test_layout_buffer_overflowing_u64_is_rejected():
    with pytest.raises(KvPlanError):
        Layout([2**64 - 10], [4096], 64)


def test_layout_negative_or_huge_values_rejected():
    for bad in ([-1], [2**64]):
        with pytest.raises((KvPlanError, OverflowError, TypeError)):
            Layout(bad, [640], 64)


def test_npu_groups_not_whole_multiple():
    with pytest.raises(LayoutError) as ei:
        Layout.npu_groups([3, 7, 11], [1, 2, 3, 4, 5, 6, 7], [64] * 7, 8)
    assert has_num(str(ei.value), 7) and has_num(str(ei.value), 3), str(ei.value)


def test_npu_groups_group_roles():
    lay = Layout.npu_groups([3, 7], [100, 200, 300, 400], [64] * 4, 8, group_roles=["nope", "rope"])
    assert lay.roles == ["nope", "nope", "rope", "rope"]
    assert lay.layer_ids == [3, 7, 3, 7]


def test_hybrid_linear_ids_must_increase():
    with pytest.raises(LayoutError):
        Layout.hybrid_linear([7, 3], [100, 200], [64, 64], 8)
    with pytest.raises(LayoutError):
        Layout.hybrid_linear([3, 3], [100, 200], [64, 64], 8)


def test_hybrid_linear_pointer_count_must_match():
    # SGLang publishes [3, 7] for any pointer count (W-hybrid-ids); kvplan refuses the mismatch.
    with pytest.raises(LayoutError):
        Layout.hybrid_linear([3, 7], [100, 200, 300], [64] * 3, 8)


def test_mha_layout_shape():
    lay = Layout.mha([1, 2], [3, 4], [64, 64], [128, 128], 8, 16, layer_ids=[5, 9])
    assert lay.data_ptrs == [1, 2, 3, 4]
    assert lay.item_lens == [8, 8, 16, 16]
    assert lay.layer_ids == [5, 9, 5, 9]
    assert lay.roles == ["k", "k", "v", "v"]
    assert lay.capacities == [8, 8, 8, 8]


def test_with_draft_band():
    base = Layout.mha([1, 2], [3, 4], [64] * 2, [64] * 2, 8, 8, layer_ids=[0, 1])
    lay = base.with_draft(
        [10, 11, 12, 13], [64] * 4, 8, draft_layer_ids=[5, 2, 5, 2], num_hidden_layers=48,
        roles=["k", "k", "v", "v"],
    )
    # W-draft-band: ids remapped by first appearance above the model's 48 layers
    assert lay.layer_ids == [0, 1, 0, 1, 48, 49, 48, 49]
    assert lay.roles == ["k", "k", "v", "v", "draft_k", "draft_k", "draft_v", "draft_v"]


def test_with_state_kinds():
    lay = Layout.mla([1], [64], 8, layer_ids=[3]).with_state("mamba_conv", [100], [64], [16], [3])
    assert lay.kinds == ["page", "state"]
    assert lay.layer_ids == [3, 3]
    assert lay.roles[1] == "mamba_conv"
    assert lay.capacities == [8, 4]


# ------------------------------------------------------------------------------ template validation


def test_size_mismatch_raised_at_template_construction():
    src = Layout.mha([10, 11], [20, 21], [800] * 2, [1600] * 2, 8, 16, layer_ids=[4, 5])
    dst = Layout.mha(
        [100, 101, 102], [200, 201, 202], [800] * 3, [1600] * 3, 8, [16, 12, 16], layer_ids=[3, 4, 5]
    )
    with pytest.raises(SizeMismatchError) as ei:
        Template(src, dst)
    msg = str(ei.value)
    assert has_num(msg, 4) and has_num(msg, 16) and has_num(msg, 12), msg
    assert re.search(r"\bv\b", msg), msg


def test_size_mismatch_k_side():
    src = Layout.mla([10], [6400], 576, layer_ids=[60])
    dst = Layout.mla([100], [6400], 1152, layer_ids=[60])
    with pytest.raises(SizeMismatchError) as ei:
        Template(src, dst)
    msg = str(ei.value)
    assert has_num(msg, 60) and has_num(msg, 576) and has_num(msg, 1152) and "kv" in msg, msg


def test_unpaired_extra_dst_entry_may_differ_in_size():
    src = Layout.mla([10], [640], 64, layer_ids=[1])
    dst = Layout.mla([100, 200], [640, 640], [32, 64], layer_ids=[0, 1])
    t = Template(src, dst)
    assert t.pairs.tolist() == [[0, 1]]


def test_one_sided_ids_is_pairing_error_unless_fallback():
    src = Layout.mla([10, 20], [640] * 2, 64, layer_ids=[0, 1])
    dst = Layout.mla([100, 200], [640] * 2, 64)
    with pytest.raises(PairingError):
        Template(src, dst)
    with pytest.raises(PairingError):
        Template(dst, src)
    t = Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=True))
    assert t.pairs.tolist() == [[0, 0], [1, 1]]


def test_missing_decode_layer_is_pairing_error_naming_layer():
    src = Layout.mla([10, 20], [640] * 2, 64, layer_ids=[0, 17])
    dst = Layout.mla([100, 200], [640] * 2, 64, layer_ids=[0, 1])
    with pytest.raises(PairingError) as ei:
        Template(src, dst)
    assert has_num(str(ei.value), 17), str(ei.value)


def test_positional_count_mismatch_without_fallback():
    src = Layout.mla([10, 20], [640] * 2, 64)
    dst = Layout.mla([100, 200, 300], [640] * 3, 64)
    with pytest.raises(PairingError):
        Template(src, dst)
    t = Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=True))
    assert t.pairs.tolist() == [[0, 0], [1, 1]]


def test_template_legacy_mha_pp_even_split():
    # W-mha-pp-slice, even split, through a Template: stage start 2, 2 layers; decode 4 layers K then V.
    src = Layout.mha([102, 103], [202, 203], [64] * 2, [64] * 2, 8, 8)
    dst = Layout.mha([100, 101, 102, 103], [200, 201, 202, 203], [64] * 4, [64] * 4, 8, 8)
    t = Template(src, dst, Pairing.by_layer_id(prefill_start_layer=2, legacy_kind="mha"))
    assert t.pairs.tolist() == [[0, 2], [1, 3], [2, 6], [3, 7]]


# ------------------------------------------------------------------------------ plan: inputs


@pytest.mark.parametrize("dtype", [np.float64, np.bool_, np.uint64, np.float32])
def test_plan_wrong_dtype_is_type_error(mla, dtype):
    t, rs, rd = mla
    with pytest.raises(TypeError):
        t.plan(np.array([1, 2]).astype(dtype), i32(1, 2))
    with pytest.raises(TypeError):
        t.plan(i32(1, 2), np.array([1, 2]).astype(dtype))


def test_plan_2d_is_type_error(mla):
    t, rs, rd = mla
    x = np.arange(4, dtype=np.int32).reshape(2, 2)
    with pytest.raises(TypeError):
        t.plan(x, x)


def test_plan_unequal_lengths(mla):
    t, rs, rd = mla
    with pytest.raises(KvPlanError) as ei:
        t.plan(i32(1, 2, 3), i32(1, 2))
    assert has_num(str(ei.value), 3) and has_num(str(ei.value), 2)


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("bad", [CAP, CAP + 1, 10**6])
def test_plan_index_out_of_bounds_names_index_and_capacity(side, bad):
    src, dst, rs, rd = mla_pair(cap_src=CAP, cap_dst=CAP + 23)
    t = Template(src, dst)
    cap = CAP if side == "src" else CAP + 23
    idx = [0, 1, cap - 1, cap + (bad - CAP)]
    ok = i32(0, 1, 2, 3)
    arr = np.array(idx, dtype=np.int64)
    with pytest.raises(IndexBoundsError) as ei:
        t.plan(arr, ok) if side == "src" else t.plan(ok, arr)
    msg = str(ei.value)
    assert has_num(msg, idx[-1]) and has_num(msg, cap), msg
    # in range up to capacity - 1 is fine
    arr[-1] = cap - 1
    plan = t.plan(arr, ok) if side == "src" else t.plan(ok, arr)
    assert plan.n_blocks > 0


@pytest.mark.parametrize("side", ["src", "dst"])
def test_plan_negative_index(mla, side):
    t, rs, rd = mla
    bad, ok = i32(0, -3), i32(0, 1)
    with pytest.raises(IndexBoundsError) as ei:
        t.plan(bad, ok) if side == "src" else t.plan(ok, bad)
    assert "-3" in str(ei.value)


def test_plan_capacity_is_per_entry_minimum():
    # layer 1's decode buffer is smaller: index 50 fits layer 0 but not layer 1.
    src = Layout.mla([1 << 20, 2 << 20], [100 * 64] * 2, 64, layer_ids=[0, 1])
    dst = Layout.mla([1 << 30, 2 << 30], [100 * 64, 50 * 64], 64, layer_ids=[0, 1])
    t = Template(src, dst)
    with pytest.raises(IndexBoundsError) as ei:
        t.plan(i32(0), i32(50))
    assert has_num(str(ei.value), 50), str(ei.value)
    assert t.plan(i32(0), i32(49)).n_blocks == 2


def test_plan_huge_items_and_indices():
    # item_len * index near 2**63: the exact address must come out (no wrap, no float rounding).
    item = 2**40
    src = Layout([0], [2**63], item)  # capacity 2**23
    dst = Layout([0], [2**63], item)
    t = Template(src, dst)
    plan = t.plan(np.array([2**23 - 1], dtype=np.int64), np.array([0], dtype=np.int64))
    assert lists(plan) == ([(2**23 - 1) * item], [0], [item])
    with pytest.raises(IndexBoundsError):
        t.plan(np.array([2**23], dtype=np.int64), np.array([0], dtype=np.int64))


def test_plan_empty(mla):
    t, rs, rd = mla
    plan = t.plan(i32(), i32())
    assert plan.n_blocks == 0 and len(plan) == 0 and plan.total_bytes == 0
    for arr in (plan.src_addrs, plan.dst_addrs, plan.lengths):
        assert arr.dtype == np.uint64 and arr.shape == (0,)
    assert plan.pair_offsets.tolist() == [0, 0, 0, 0]
    assert list(plan.batches(4)) == [] or all(len(b.lengths) == 0 for b in plan.batches(4))


# ------------------------------------------------------------------------------ plan: outputs


def test_plan_values_and_metadata(mla):
    t, rs, rd = mla
    plan = t.plan(FRAG_SRC, FRAG_DST)
    exp = expected_plan(rs, rd, FRAG_SRC.tolist(), FRAG_DST.tolist())
    assert_plan_equals(plan, exp)
    assert len(plan) == exp.n_blocks == 12
    assert plan.n_runs == 4
    assert plan.n_pairs == 3
    assert plan.pair_offsets.dtype == np.int64
    assert plan.pair_offsets.tolist() == [0, 4, 8, 12]
    for p in range(3):
        sl = plan.pair_blocks(p)
        assert isinstance(sl, slice)
        assert (sl.start, sl.stop) == (4 * p, 4 * p + 4)
        assert [int(x) for x in plan.src_addrs[sl]] == exp.src[4 * p: 4 * p + 4]
    s, d, ln = plan.as_lists()
    assert (s, d, ln) == (exp.src, exp.dst, exp.lengths)
    assert all(type(x) is int for x in s + d + ln)


def test_output_arrays_dtype_layout_and_ownership(mla):
    t, rs, rd = mla
    plan = t.plan(FRAG_SRC, FRAG_DST)
    for arr in (plan.src_addrs, plan.dst_addrs, plan.lengths):
        assert arr.dtype == np.uint64
        assert arr.ndim == 1
        assert arr.flags.c_contiguous
        assert not arr.flags.owndata  # wraps a kvplan-owned buffer, no copy
        owner = arr
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert owner is not None
        assert type(owner).__module__.startswith("kvplan"), type(owner)


def test_output_arrays_are_not_copies_per_access(mla):
    t, rs, rd = mla
    plan = t.plan(FRAG_SRC, FRAG_DST)
    a1, a2 = plan.src_addrs, plan.src_addrs
    assert a1.__array_interface__["data"][0] == a2.__array_interface__["data"][0]


def test_output_arrays_outlive_plan_and_inputs():
    src, dst, rs, rd = mla_pair()
    t = Template(src, dst)
    sp = np.array(FRAG_SRC, dtype=np.int32)
    dp = np.array(FRAG_DST, dtype=np.int64)
    exp = expected_plan(rs, rd, sp.tolist(), dp.tolist())
    plan = t.plan(sp, dp)
    s, d, ln = plan.src_addrs, plan.dst_addrs, plan.lengths
    plan_ref = weakref.ref(plan) if hasattr(plan, "__weakref__") else None
    del plan, sp, dp, t, src, dst
    gc.collect()
    if plan_ref is not None:
        assert plan_ref() is None
    # churn the pool: other plans must not reuse memory that live arrays still point to
    src2, dst2, rs2, rd2 = mla_pair()
    t2 = Template(src2, dst2)
    others = [t2.plan(i32(*range(k, k + 30, 3)), i32(*range(30, 0, -3))) for k in range(20)]
    del others
    gc.collect()
    for _ in range(20):
        t2.plan(i32(*range(0, 60, 2)), i32(*range(1, 61, 2)))
    assert ([int(x) for x in s], [int(x) for x in d], [int(x) for x in ln]) == (
        exp.src, exp.dst, exp.lengths
    )


def test_arrays_from_successive_plans_do_not_alias(mla):
    t, rs, rd = mla
    plans = [t.plan(i32(k, k + 1, k + 5), i32(k, k + 1, k + 2)) for k in range(8)]
    arrays = [(p.src_addrs, p.dst_addrs, p.lengths) for p in plans]
    del plans
    gc.collect()
    for k, (s, d, ln) in enumerate(arrays):
        exp = expected_plan(rs, rd, [k, k + 1, k + 5], [k, k + 1, k + 2])
        assert ([int(x) for x in s], [int(x) for x in d], [int(x) for x in ln]) == (
            exp.src, exp.dst, exp.lengths
        )
    for i in range(len(arrays)):
        for j in range(i + 1, len(arrays)):
            assert not np.shares_memory(arrays[i][0], arrays[j][0])


def test_pool_reuse_after_arrays_die_gives_correct_results(mla):
    t, rs, rd = mla
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 90))
        sp = rng.integers(0, CAP, n).astype(np.int32)
        dp = rng.integers(0, CAP, n).astype(np.int64)
        plan = t.plan(sp, dp)
        assert_plan_equals(plan, expected_plan(rs, rd, sp.tolist(), dp.tolist()))
        del plan


# ------------------------------------------------------------------------------ out=


def test_out_buffer_views(mla):
    t, rs, rd = mla
    exp = expected_plan(rs, rd, FRAG_SRC.tolist(), FRAG_DST.tolist())
    out = np.full((3, 20), 7, dtype=np.uint64)
    plan = t.plan(FRAG_SRC, FRAG_DST, out=out)
    assert_plan_equals(plan, exp)
    n = exp.n_blocks
    for row, arr in enumerate((plan.src_addrs, plan.dst_addrs, plan.lengths)):
        assert np.shares_memory(arr, out)
        assert arr.__array_interface__["data"][0] == out[row].__array_interface__["data"][0]
        assert arr.shape == (n,)
    assert out[0, :n].tolist() == exp.src
    assert out[1, :n].tolist() == exp.dst
    assert out[2, :n].tolist() == exp.lengths
    assert (out[:, n:] == 7).all()  # nothing written past the plan


def test_out_buffer_exact_size(mla):
    t, rs, rd = mla
    exp = expected_plan(rs, rd, FRAG_SRC.tolist(), FRAG_DST.tolist())
    out = np.zeros((3, exp.n_blocks), dtype=np.uint64)
    plan = t.plan(FRAG_SRC, FRAG_DST, out=out)
    assert_plan_equals(plan, exp)
    assert np.shares_memory(plan.lengths, out)


def test_out_buffer_too_small(mla):
    t, rs, rd = mla
    out = np.full((3, 11), 5, dtype=np.uint64)  # plan needs 12
    with pytest.raises(KvPlanError) as ei:
        t.plan(FRAG_SRC, FRAG_DST, out=out)
    assert has_num(str(ei.value), 12) and has_num(str(ei.value), 11), str(ei.value)


def test_out_buffer_reuse(mla):
    t, rs, rd = mla
    out = np.zeros((3, 64), dtype=np.uint64)
    p1 = t.plan(FRAG_SRC, FRAG_DST, out=out)
    e1 = expected_plan(rs, rd, FRAG_SRC.tolist(), FRAG_DST.tolist())
    assert_plan_equals(p1, e1)
    p2 = t.plan(i32(3, 4), i32(8, 9), out=out)
    assert_plan_equals(p2, expected_plan(rs, rd, [3, 4], [8, 9]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros((3, 20), dtype=np.int64),
        lambda: np.zeros((3, 20), dtype=np.float64),
        lambda: np.zeros((20, 3), dtype=np.uint64),
        lambda: np.zeros((2, 20), dtype=np.uint64),
        lambda: np.zeros(60, dtype=np.uint64),
        lambda: np.zeros((3, 20), dtype=np.uint64, order="F"),
        lambda: np.zeros((3, 40), dtype=np.uint64)[:, ::2],
    ],
    ids=["int64", "float64", "transposed", "two_rows", "1d", "fortran", "strided"],
)
def test_out_buffer_bad_shape_or_dtype_rejected(mla, make):
    t, rs, rd = mla
    out = make()
    snapshot = out.copy()
    # the wrong type, dtype, shape or memory order is an input-shape error
    with pytest.raises(TypeError):
        t.plan(FRAG_SRC, FRAG_DST, out=out)
    assert np.array_equal(out, snapshot)


def test_out_buffer_readonly_rejected(mla):
    t, rs, rd = mla
    out = np.zeros((3, 20), dtype=np.uint64)
    out.flags.writeable = False
    with pytest.raises(KvPlanError, match="cannot be written"):
        t.plan(FRAG_SRC, FRAG_DST, out=out)


# ------------------------------------------------------------------------------ batches


@pytest.mark.parametrize("max_blocks", [1, 2, 5, 11, 12, 13, 1000])
def test_batches_cover_plan_exactly(mla, max_blocks):
    t, rs, rd = mla
    plan = t.plan(FRAG_SRC, FRAG_DST)
    exp = expected_plan(rs, rd, FRAG_SRC.tolist(), FRAG_DST.tolist())
    batches = list(plan.batches(max_blocks))
    sizes = [len(b.lengths) for b in batches]
    assert sum(sizes) == exp.n_blocks
    assert all(0 < s <= max_blocks for s in sizes)
    assert all(s == max_blocks for s in sizes[:-1])
    assert len(batches) == -(-exp.n_blocks // max_blocks)
    cat = [[], [], []]
    for b in batches:
        assert len(tuple(b)) == 3  # unpacks as src_addrs, dst_addrs, lengths
        for k, arr in enumerate(b):
            assert arr.dtype == np.uint64
            assert np.shares_memory(arr, (plan.src_addrs, plan.dst_addrs, plan.lengths)[k])
            cat[k].extend(int(x) for x in arr)
    assert tuple(cat) == (exp.src, exp.dst, exp.lengths)


def test_batches_with_out_buffer_are_views_of_out(mla):
    t, rs, rd = mla
    out = np.zeros((3, 32), dtype=np.uint64)
    plan = t.plan(FRAG_SRC, FRAG_DST, out=out)
    for b in plan.batches(5):
        assert np.shares_memory(b.src_addrs, out)


# ------------------------------------------------------------------------------ state slots


def test_plan_state_bounds_and_values():
    src = Layout.mla([500], [640], 64, layer_ids=[7]).with_state("mamba_conv", [10000], [100], [16], [7])
    dst = Layout.mla([600], [640], 64, layer_ids=[7]).with_state("mamba_conv", [20000], [160], [16], [7])
    t = Template(src, dst)
    plan = t.plan_state(5, 9)
    assert lists(plan) == ([10000 + 5 * 16], [20000 + 9 * 16], [16])
    with pytest.raises(IndexBoundsError) as ei:
        t.plan_state(6, 0)  # capacity 100 // 16 = 6
    assert has_num(str(ei.value), 6)
    with pytest.raises(IndexBoundsError):
        t.plan_state(0, 10)  # capacity 160 // 16 = 10
    with pytest.raises(IndexBoundsError):
        t.plan_state(-1, 0)


def test_state_and_page_entries_never_pair_across_kinds():
    # Same layer id 7 for the page entry and the state entry: kinds keep them apart.
    src = Layout.mla([500], [640], 64, layer_ids=[7]).with_state("mamba_conv", [10000], [640], [64], [7])
    dst = Layout.mla([600], [640], 64, layer_ids=[7]).with_state("mamba_conv", [20000], [640], [64], [7])
    t = Template(src, dst)
    assert t.pairs.tolist() == [[0, 0]]
    assert t.state_pairs.tolist() == [[1, 1]]
    plan = t.plan(i32(1), i32(2))
    assert lists(plan) == ([564], [728], [64])


# ------------------------------------------------------------------------------ elided entries


def test_elided_entries_emit_nothing():
    src = Layout([1000, 2000, 3000], [640, 0, 640], [64, 0, 64], layer_ids=[0, 1, 2])
    dst = Layout([5000, 6000, 7000], [640, 0, 640], [64, 0, 64], layer_ids=[0, 1, 2])
    t = Template(src, dst)
    plan = t.plan(i32(1, 2), i32(3, 4))
    assert lists(plan) == ([1064, 3064], [5192, 7192], [128, 128])
    assert plan.total_bytes == 256


# ------------------------------------------------------------------------------ threads


def test_concurrent_planning_shares_one_template():
    n_layers, cap = 8, 4096
    src = Layout.mla([(k + 1) << 32 for k in range(n_layers)], [cap * 1152] * n_layers, 1152,
                     layer_ids=list(range(n_layers)))
    dst = Layout.mla([(k + 100) << 32 for k in range(n_layers)], [cap * 1152] * n_layers, 1152,
                     layer_ids=list(range(n_layers)))
    t = Template(src, dst)
    rng = np.random.default_rng(2024)
    requests = []
    for r in range(8 * 6):
        n = int(rng.integers(100, 3000))
        sp = rng.permutation(cap)[:n].astype(np.int32 if r % 2 else np.int64)
        dp = np.sort(rng.permutation(cap)[:n]).astype(np.int32)
        requests.append((sp, dp))
    expected = []
    for sp, dp in requests:
        p = t.plan(sp, dp)
        expected.append((p.src_addrs.copy(), p.dst_addrs.copy(), p.lengths.copy(), p.total_bytes))
    # spot-check the single-threaded baseline against the reference
    rs = ref.RefLayout(src.data_ptrs, src.data_lens, src.item_lens, list(range(n_layers)))
    rd = ref.RefLayout(dst.data_ptrs, dst.data_lens, dst.item_lens, list(range(n_layers)))
    e0 = ref.plan_blocks(rs, rd, ref.template_pairs(rs, rd), requests[0][0].tolist(), requests[0][1].tolist())
    assert expected[0][0].tolist() == e0.src and expected[0][2].tolist() == e0.lengths

    n_threads = 8
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []
    mismatches: list[tuple[int, int]] = []

    def worker(tid: int) -> None:
        try:
            barrier.wait()
            for rep in range(3):
                for k in range(tid, len(requests), n_threads):
                    idx = (k + rep * 3) % len(requests)
                    sp, dp = requests[idx]
                    out = np.empty((3, len(sp) * n_layers), dtype=np.uint64) if rep == 2 else None
                    p = t.plan(sp, dp, out=out) if out is not None else t.plan(sp, dp)
                    e = expected[idx]
                    if not (
                        np.array_equal(p.src_addrs, e[0])
                        and np.array_equal(p.dst_addrs, e[1])
                        and np.array_equal(p.lengths, e[2])
                        and p.total_bytes == e[3]
                    ):
                        mismatches.append((tid, idx))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    run_racing_threads(worker, n_threads, switch_interval=1e-6)
    assert not errors, errors
    assert not mismatches, mismatches[:10]


# ------------------------------------------------------------------------------ more contract


def test_group_contiguous_python_lists_are_type_error():
    with pytest.raises(TypeError):
        kvplan.group_contiguous([1, 2, 3], [4, 5, 6])


def test_pair_entries_roles_on_one_side_only_pair_by_id():
    # Roles refine the key only when BOTH peers publish them (an SGLang peer publishes none).
    got = kvplan.pair_entries([3, 7, 3, 7], [3, 7, 11, 3, 7, 11], 4, 6, src_roles=["k", "k", "v", "v"])
    assert got.tolist() == [[0, 0], [1, 1], [2, 3], [3, 4]]


def test_pair_entries_roles_missing_key_names_layer():
    with pytest.raises(PairingError) as ei:
        kvplan.pair_entries([3, 3], [3, 3], 2, 2, src_roles=["k", "k"], dst_roles=["k", "v"])
    assert has_num(str(ei.value), 3), str(ei.value)


def test_check_dst_overlap():
    src, dst, rs, rd = mla_pair()
    loose = Template(src, dst)
    strict = Template(src, dst, check_dst_overlap=True)
    sp, dp = i32(1, 2, 9), i32(5, 6, 5)  # decode page 5 written twice
    plan = loose.plan(sp, dp)  # SGLang semantics: allowed
    assert_plan_equals(plan, expected_plan(rs, rd, [1, 2, 9], [5, 6, 5]))
    with pytest.raises(KvPlanError) as ei:
        strict.plan(sp, dp)
    assert has_num(str(ei.value), 5), str(ei.value)
    assert_plan_equals(strict.plan(i32(1, 2, 9), i32(5, 6, 7)), expected_plan(rs, rd, [1, 2, 9], [5, 6, 7]))


def test_large_fragmented_plan_matches_reference():
    """61 MLA layers (DeepSeek-V3 item 1152) x 4096 fully fragmented pages = 249,856 blocks."""
    n_layers, n_pages, item = 61, 4096, 1152
    cap = 2 * n_pages
    sp_ = [(k + 1) << 36 for k in range(n_layers)]
    dp_ = [(k + 200) << 36 for k in range(n_layers)]
    src = Layout.mla(sp_, [cap * item] * n_layers, item, layer_ids=list(range(n_layers)))
    dst = Layout.mla(dp_, [cap * item] * n_layers, item, layer_ids=list(range(n_layers)))
    rng = np.random.default_rng(61)
    s_pages = rng.permutation(cap)[:n_pages].astype(np.int32)
    d_pages = (2 * np.arange(n_pages)).astype(np.int32)  # every step is +2: no runs at all
    plan = Template(src, dst).plan(s_pages, d_pages)
    assert plan.n_blocks == n_layers * n_pages
    assert plan.total_bytes == n_layers * n_pages * item
    # reference formula per block, vectorised only in the comparison
    sp64, dp64 = s_pages.astype(np.uint64), d_pages.astype(np.uint64)
    exp_src = np.concatenate([np.uint64(b) + sp64 * np.uint64(item) for b in sp_])
    exp_dst = np.concatenate([np.uint64(b) + dp64 * np.uint64(item) for b in dp_])
    assert np.array_equal(plan.src_addrs, exp_src)
    assert np.array_equal(plan.dst_addrs, exp_dst)
    assert (plan.lengths == item).all()
    # and the pure-Python reference on a slice of layers
    rs = ref.RefLayout(sp_[:2], [cap * item] * 2, [item] * 2, [0, 1])
    rd = ref.RefLayout(dp_[:2], [cap * item] * 2, [item] * 2, [0, 1])
    e = ref.plan_blocks(rs, rd, [(0, 0), (1, 1)], s_pages.tolist(), d_pages.tolist())
    assert plan.src_addrs[: 2 * n_pages].tolist() == e.src
    assert plan.dst_addrs[: 2 * n_pages].tolist() == e.dst


def test_single_surviving_view_keeps_buffer():
    """Only one small view of one output array survives: the buffer must not go back to the pool."""
    src, dst, rs, rd = mla_pair()
    t = Template(src, dst)
    exp = expected_plan(rs, rd, FRAG_SRC.tolist(), FRAG_DST.tolist())
    plan = t.plan(FRAG_SRC, FRAG_DST)
    last_batch = list(plan.batches(5))[-1]
    lens_view = plan.lengths[3:9]
    del plan
    gc.collect()
    for k in range(30):  # same-sized plans would grab a returned buffer first
        t.plan(i32(*range(40, 48)), i32(*range(k, k + 16, 2)))
    assert [int(x) for x in lens_view] == exp.lengths[3:9]
    assert [int(x) for x in last_batch.src_addrs] == exp.src[10:]
    assert [int(x) for x in last_batch.dst_addrs] == exp.dst[10:]


def test_pool_takes_buffers_back():
    stats = getattr(kvplan._core, "pool_stats", None)
    if stats is None:
        pytest.skip("no pool statistics exposed")
    src, dst, rs, rd = mla_pair()
    t = Template(src, dst)
    sp = np.arange(CAP, dtype=np.int32)[::-1].copy()  # 100 runs x 3 pairs = 300 blocks
    dp = np.arange(CAP, dtype=np.int32)
    plan = t.plan(sp, dp)
    assert plan.n_blocks == 300
    del plan
    gc.collect()
    hits0, misses0 = stats()[2], stats()[3]
    for _ in range(5):
        plan = t.plan(sp, dp)
        assert plan.n_blocks == 300
        del plan
        gc.collect()
    hits1, misses1 = stats()[2], stats()[3]
    assert misses1 == misses0, "steady state must not allocate fresh output memory"
    assert hits1 == hits0 + 5


def test_unaligned_input_correct_or_type_error():
    raw = bytearray(4 * 6 + 1)
    src = np.frombuffer(raw, dtype=np.int32, offset=1, count=6)
    src[:] = [0, 1, 2, 5, 6, 9]
    assert not src.flags.aligned
    dst = np.array([10, 11, 12, 13, 14, 20], dtype=np.int32)
    try:
        s, d, n = kvplan.group_contiguous(src, dst)
    except TypeError:
        return
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 5, 9], [10, 13, 20], [3, 2, 1])


def test_layout_context_properties():
    lay = Layout.mla([4096, 8192], [4096, 4096], 1024, layer_ids=[30, 31], page_size=16, device="npu",
                     num_model_layers=61, pp_rank=1, pp_size=2, tp_rank=3, tp_size=4)
    assert (lay.page_size, lay.device, lay.num_model_layers) == (16, "npu", 61)
    assert (lay.pp_rank, lay.pp_size, lay.tp_rank, lay.tp_size) == (1, 2, 3, 4)
    assert lay.capacities == [4, 4]  # capacity counts items (pages), not tokens
    with pytest.raises(KvPlanError):
        Layout.mla([1], [64], 8, pp_rank=2, pp_size=2)


def test_elided_state_entries_emit_nothing_and_hold_no_slots():
    # Found by the hypothesis fuzz run: a state entry with item_len 0 (capacity 0) made every
    # slot "out of range", while page entries with item_len 0 are simply skipped.
    empty = Layout([], [], 1)
    src = empty.with_state("conv", [1000, 2000], [0, 160], [0, 16], [0, 1])
    dst = empty.with_state("conv", [5000, 6000], [0, 160], [0, 16], [0, 1])
    plan = Template(src, dst).plan_state(3, 4)
    assert plan.as_lists() == ([2000 + 3 * 16], [6000 + 4 * 16], [16])
    with pytest.raises(IndexBoundsError, match="src index 10"):
        Template(src, dst).plan_state(10, 0)
