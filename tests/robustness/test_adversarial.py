"""Adversarial inputs: every bad input ends as a clear Python exception, every accepted
input gives a correct plan, and the process survives.

Each case either checks a plan against the naive reference (tests/support/reference.py) plus the safety
invariants (every block inside its entry's buffer, bytes conserved, no destination item written
twice when the overlap check is on), or expects ``KvPlanError`` / ``TypeError`` (``OverflowError``
only where Python itself refuses to convert an out-of-range int; see docs/robustness.md) with a
message that names the problem. Cases that could crash the interpreter if kvplan were wrong run
in a subprocess, so a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import gc
import threading

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
    Template,
)

from support import reference as ref
from support.robustness_checks import (
    assert_invariants,
    ref_layout,
    run_isolated,
    run_racing_threads,
)

U64_MAX = 2**64 - 1

# ------------------------------------------------------------------------------------ helpers


def check_plan(template: Template, src: Layout, dst: Layout, sp, dp, *, overlap=False):
    """Plans and checks the result against the reference and the safety invariants."""
    plan = template.plan(sp, dp)
    rs, rd = ref_layout(src), ref_layout(dst)
    pairs = ref.template_pairs(rs, rd)
    assert [tuple(p) for p in template.pairs.tolist()] == pairs
    exp = ref.plan_blocks(rs, rd, pairs, [int(x) for x in sp], [int(x) for x in dp])
    assert plan.as_lists() == (exp.src, exp.dst, exp.lengths)
    assert plan.n_runs == exp.n_runs
    assert_invariants(plan, template, src, dst, len(sp), overlap=overlap)
    return plan


def mla(ptrs, cap, item=64, ids=None, **ctx):
    n = len(ptrs)
    return Layout.mla(list(ptrs), [cap * item] * n, item,
                      layer_ids=list(range(n)) if ids is None else ids, **ctx)


SRC = mla([1 << 20, 2 << 20, 3 << 20], 100)
DST = mla([1 << 30, 2 << 30, 3 << 30], 100)
TEMPLATE = Template(SRC, DST)
OK_PAGES = np.array([0, 1, 2, 7], dtype=np.int64)

# ------------------------------------------------------------------------------------ dtypes

BAD_ARRAYS = {
    "float64": np.array([0.0, 1.0, 2.0, 7.0]),
    "float32": np.array([0, 1, 2, 7], dtype=np.float32),
    "float16": np.array([0, 1, 2, 7], dtype=np.float16),
    "bool": np.array([True, False, True, True]),
    "object": np.array([0, 1, 2, 7], dtype=object),
    "uint64": np.array([0, 1, 2, 7], dtype=np.uint64),
    "uint64_above_2_63": np.array([0, 1, 2, 2**63 + 5], dtype=np.uint64),
    "uint32": np.array([0, 1, 2, 7], dtype=np.uint32),
    "int16": np.array([0, 1, 2, 7], dtype=np.int16),
    "int8": np.array([0, 1, 2, 7], dtype=np.int8),
    "big_endian_int64": np.array([0, 1, 2, 7], dtype=">i8"),
    "big_endian_int32": np.array([0, 1, 2, 7], dtype=">i4"),
    "complex": np.array([0, 1, 2, 7], dtype=np.complex128),
    "str": np.array(["0", "1", "2", "7"]),
    "datetime": np.array([0, 1, 2, 7], dtype="datetime64[s]"),
}


@pytest.mark.parametrize("side", ["src_pages", "dst_pages"])
@pytest.mark.parametrize("name", sorted(BAD_ARRAYS))
def test_plan_wrong_dtype_is_clear_type_error(name, side):
    bad = BAD_ARRAYS[name]
    args = (bad, OK_PAGES) if side == "src_pages" else (OK_PAGES, bad)
    with pytest.raises(TypeError) as ei:
        TEMPLATE.plan(*args)
    msg = str(ei.value)
    assert msg.startswith(f"{side} must be a 1-D numpy array of dtype int32 or int64"), msg
    assert str(bad.dtype) in msg or bad.dtype.str in msg, msg
    assert not isinstance(ei.value, KvPlanError)


@pytest.mark.parametrize("name", ["float64", "uint64_above_2_63", "big_endian_int64", "object"])
def test_group_contiguous_wrong_dtype_is_clear_type_error(name):
    with pytest.raises(TypeError, match=r"^src must be a 1-D numpy array of dtype int32 or int64"):
        kvplan.group_contiguous(BAD_ARRAYS[name], OK_PAGES)


def test_byteswapped_native_view_is_rejected_not_misread():
    # Same bytes as a big-endian array: if kvplan ignored the byte order it would read 2**56.
    be = np.array([1, 2], dtype=">i8")
    with pytest.raises(TypeError, match="native byte order"):
        TEMPLATE.plan(be, np.array([1, 2]))
    # The explicit conversion is accepted and correct.
    check_plan(TEMPLATE, SRC, DST, be.astype(np.int64), np.array([1, 2]))


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda: [0, 1, 2, 7], "got list"),
        (lambda: (0, 1, 2, 7), "got tuple"),
        (lambda: range(4), "got range"),
        (lambda: memoryview(OK_PAGES), "got memoryview"),
        (lambda: np.int64(3), "got int64"),
        (lambda: 3, "got int"),
        (lambda: None, "got NoneType"),
        (lambda: "0123", "got str"),
        (lambda: OK_PAGES.tobytes(), "got bytes"),
    ],
)
def test_lists_and_other_sequences_are_type_errors(make, what):
    with pytest.raises(TypeError) as ei:
        TEMPLATE.plan(make(), OK_PAGES)
    assert what in str(ei.value) and "src_pages" in str(ei.value)


def test_non_contiguous_arrays_are_type_errors_not_hidden_copies():
    base = np.arange(20, dtype=np.int64)
    for bad in (base[::2], base[::-1][:10], np.arange(40, dtype=np.int32).reshape(10, 4)[:, 1]):
        with pytest.raises(TypeError, match="src_pages must be C-contiguous"):
            TEMPLATE.plan(bad, np.arange(len(bad)))
        with pytest.raises(TypeError, match="dst_pages must be C-contiguous"):
            TEMPLATE.plan(np.arange(len(bad)), bad)
    # the contiguous copy is accepted and correct
    check_plan(TEMPLATE, SRC, DST, np.ascontiguousarray(base[::2]), np.arange(10))


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 2), dtype=np.int64),
        np.zeros((1, 4), dtype=np.int32),
        np.zeros((0, 0), dtype=np.int64),
        np.zeros((4, 1, 1), dtype=np.int64),
        np.array(5, dtype=np.int64),
    ],
    ids=["2x2", "1x4", "0x0", "3d", "0d"],
)
def test_multi_dimensional_arrays_are_type_errors(bad):
    with pytest.raises(TypeError) as ei:
        TEMPLATE.plan(bad, bad)
    msg = str(ei.value)
    assert "1-D" in msg and (f"{bad.ndim}-D" in msg or "got int64" in msg), msg


def test_zero_size_arrays():
    for sd in (np.int32, np.int64):
        for dd in (np.int32, np.int64):
            plan = TEMPLATE.plan(np.empty(0, sd), np.empty(0, dd))
            assert (plan.n_blocks, plan.n_runs, plan.total_bytes) == (0, 0, 0)
            assert plan.as_lists() == ([], [], [])
            assert list(plan.batches(4)) == []
            assert plan.pair_offsets.tolist() == [0, 0, 0, 0]
    # zero-size but wrong dtype / shape is still a TypeError, and empty vs non-empty is an error
    with pytest.raises(TypeError):
        TEMPLATE.plan(np.empty(0), np.empty(0))
    with pytest.raises(KvPlanError, match="src has 0 indices but dst has 1"):
        TEMPLATE.plan(np.empty(0, np.int64), np.zeros(1, np.int64))
    s, d, n = kvplan.group_contiguous(np.empty(0, np.int32), np.empty(0, np.int64))
    assert len(s) == len(d) == len(n) == 0


# ------------------------------------------------------------------------------------ indices


def test_int32_max_index_is_planned_exactly():
    top = 2**31 - 1
    src = Layout.mla([1 << 40], [2**31], 1, layer_ids=[0])  # capacity 2**31: top is the last item
    dst = Layout.mla([1 << 44], [2**31 * 2], 2, layer_ids=[0])
    with pytest.raises(KvPlanError, match="item size mismatch"):
        Template(src, dst)
    dst = Layout.mla([1 << 44], [2**31], 1, layer_ids=[0])
    t = Template(src, dst)
    sp = np.array([top - 1, top], dtype=np.int32)
    plan = check_plan(t, src, dst, sp, np.array([0, 1], dtype=np.int32))
    assert plan.as_lists() == ([(1 << 40) + top - 1], [1 << 44], [2])
    # capacity exactly 2**31 - 1: the max int32 is one past the end
    small = Layout.mla([1 << 40], [2**31 - 1], 1, layer_ids=[0])
    with pytest.raises(IndexBoundsError, match=rf"src index {top} at position 0 is outside 0\.\.{top}"):
        Template(small, dst).plan(np.array([top], np.int32), np.array([0], np.int32))
    with pytest.raises(IndexBoundsError, match=r"index -2147483648 at position 1 is negative"):
        t.plan(np.array([0, -(2**31)], np.int32), np.array([0, 1], np.int32))


def test_int64_max_index_at_the_top_of_the_address_space():
    big = 2**63 - 1
    # item 1, buffer [0, 2**64 - 1): capacity 2**64 - 1, so 2**63 - 1 is inside
    src = Layout.mla([0], [U64_MAX], 1, layer_ids=[0])
    dst = Layout.mla([1 << 12], [U64_MAX - (1 << 12)], 1, layer_ids=[0])
    t = Template(src, dst)
    plan = check_plan(t, src, dst, np.array([big - 1, big], np.int64), np.array([big - 1, big], np.int64))
    assert plan.as_lists() == ([big - 1], [(1 << 12) + big - 1], [2])
    # item 2 over 2**64 - 2 bytes: capacity 2**63 - 1, so 2**63 - 1 is one past the end
    src2 = Layout.mla([0], [U64_MAX - 1], 2, layer_ids=[0])
    dst2 = Layout.mla([0], [U64_MAX - 1], 2, layer_ids=[0])
    t2 = Template(src2, dst2)
    plan = check_plan(t2, src2, dst2, np.array([big - 1], np.int64), np.array([0], np.int64))
    assert plan.as_lists() == ([2**64 - 4], [0], [2])
    with pytest.raises(IndexBoundsError, match=rf"dst index {big} at position 0 is outside 0\.\.{big}"):
        t2.plan(np.array([0], np.int64), np.array([big], np.int64))
    # i64::MIN after i64::MAX: negative, never a wrapped "contiguous" step
    with pytest.raises(IndexBoundsError, match="is negative"):
        t.plan(np.array([big, -(2**63)], np.int64), np.array([0, 1], np.int64))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("side", ["src", "dst"])
def test_negative_indices_name_side_value_and_position(dtype, side):
    good = np.array([3, 4, 5, 6], dtype=dtype)
    bad = np.array([3, 4, -7, 6], dtype=dtype)
    args = (bad, good) if side == "src" else (good, bad)
    with pytest.raises(IndexBoundsError, match=rf"^{side} index -7 at position 2 is negative$"):
        TEMPLATE.plan(*args)


def test_capacity_zero_buffers():
    # data_len < item_len: capacity 0; nothing fits, but an empty request is fine
    src = Layout.mla([4096, 8192], [63, 0], 64, layer_ids=[0, 1])
    dst = mla([1 << 30, 2 << 30], 100)
    t = Template(src, dst)
    assert src.capacities == [0, 0]
    with pytest.raises(IndexBoundsError, match=r"src index 0 at position 0 is outside 0\.\.0 of src entry 0"):
        t.plan(np.array([0], np.int32), np.array([0], np.int32))
    assert t.plan(np.empty(0, np.int32), np.empty(0, np.int32)).n_blocks == 0
    # state entries with capacity 0
    s = Layout.mla([], [], 64).with_state("mamba_conv", [4096], [10], 16, [0])
    d = Layout.mla([], [], 64).with_state("mamba_conv", [8192], [160], 16, [0])
    with pytest.raises(IndexBoundsError, match=r"outside 0\.\.0"):
        Template(s, d).plan_state(0, 0)


def test_item_len_zero_entries_are_elided_and_not_bounds_checked():
    src = Layout.mla([1 << 20, 2 << 20], [6400, 0], [64, 0], layer_ids=[0, 1])
    dst = Layout.mla([1 << 30, 2 << 30], [6400, 640], [64, 0], layer_ids=[0, 1])
    t = Template(src, dst)
    assert t.emitting == (True, False) and t.bytes_per_page == 64
    plan = check_plan(t, src, dst, np.array([0, 1, 99]), np.array([5, 6, 0]))
    assert plan.pair_offsets.tolist() == [0, 2, 2]
    # every entry elided: any non-negative index is accepted and nothing moves
    z_src = Layout.mla([1 << 20], [0], 0, layer_ids=[0])
    z_dst = Layout.mla([1 << 30], [0], 0, layer_ids=[0])
    tz = Template(z_src, z_dst)
    plan = check_plan(tz, z_src, z_dst, np.array([2**40]), np.array([2**50]))
    assert (plan.n_blocks, plan.total_bytes) == (0, 0)
    with pytest.raises(IndexBoundsError, match="negative"):
        tz.plan(np.array([-1]), np.array([0]))


def test_duplicate_destination_pages():
    sp = np.array([0, 1, 2, 3], dtype=np.int32)
    dp = np.array([5, 6, 5, 9], dtype=np.int32)
    # default: planned as asked (SGLang does the same), two blocks write dst page 5 per layer
    plan = check_plan(TEMPLATE, SRC, DST, sp, dp)
    d = plan.dst_addrs.tolist()
    assert len(d) != len(set(d))
    # with the overlap check: refused, naming the index and both positions
    t = Template(SRC, DST, check_dst_overlap=True)
    with pytest.raises(IndexBoundsError, match=r"^dst index 5 appears at positions 0 and 2"):
        t.plan(sp, dp)
    # overlap through runs: [5,6] and [6] overlap on page 6
    with pytest.raises(IndexBoundsError, match="dst index 6 appears at positions 1 and 2"):
        t.plan(np.array([0, 1, 7]), np.array([5, 6, 6]))
    # no duplicates: accepted and each destination item written once
    check_plan(t, SRC, DST, sp, np.array([5, 6, 7, 9]), overlap=True)


# ------------------------------------------------------------------------------------ layouts


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(data_ptrs=[-1]), OverflowError, "can't convert negative int to unsigned"),
        (dict(data_ptrs=[2**64]), OverflowError, "int too big to convert"),
        (dict(data_ptrs=[2**70]), OverflowError, "int too big to convert"),
        (dict(data_lens=[-640]), OverflowError, "can't convert negative int to unsigned"),
        (dict(data_lens=[2**64]), OverflowError, "int too big to convert"),
        (dict(item_lens=-64), TypeError, "item_lens must be a non-negative int below 2**64"),
        (dict(item_lens=[2**64]), TypeError, "got [18446744073709551616]"),
        (dict(data_ptrs=[1.5]), TypeError, "'float' object cannot be interpreted as an integer"),
        (dict(data_ptrs=["0x1000"]), TypeError, "'str' object cannot be interpreted as an integer"),
        (dict(data_ptrs=None), TypeError, "'None' is not an instance of 'Sequence'"),
        (dict(layer_ids=[2**63]), OverflowError, "too large to convert"),
        (dict(roles=[3]), TypeError, "'int' object is not an instance of 'str'"),
    ],
)
def test_bad_layout_values_raise_clear_exceptions(kwargs, exc, pattern):
    """Python ints outside u64 / i64 raise OverflowError (PyO3's conversion), wrong types
    TypeError; the message says what is wrong and a note (shown in tracebacks) names the
    argument. Never a PanicException (a BaseException) and never a silent truncation."""
    args = dict(data_ptrs=[4096], data_lens=[640], item_lens=64)
    args.update(kwargs)
    with pytest.raises(exc) as ei:
        Layout(**args)
    assert pattern in str(ei.value)
    (name,) = kwargs
    assert f"while processing '{name}'" in getattr(ei.value, "__notes__", []), ei.value
    # the same bad value in a named constructor fails the same way
    if name in ("data_ptrs", "data_lens", "item_lens", "layer_ids"):
        with pytest.raises(exc):
            Layout.mla(args["data_ptrs"], args["data_lens"], args["item_lens"],
                       layer_ids=args.get("layer_ids"))
    assert isinstance(ei.value, Exception)


def test_kvplan_checked_layout_values_raise_layout_error():
    with pytest.raises(LayoutError, match=r"entry 0: base address 0xfffffffffffffff6 \+ 640 bytes overflows u64"):
        Layout([2**64 - 10], [640], 64)
    with pytest.raises(LayoutError, match='unknown entry kind "pages"'):
        Layout([4096], [640], 64, kinds=["pages"])
    with pytest.raises(LayoutError, match="layout list data_lens has 2 values but data_ptrs has 1"):
        Layout([4096], [640, 640], 64)
    with pytest.raises(LayoutError, match="page_size must be at least 1"):
        Layout([4096], [640], 64, page_size=0)
    with pytest.raises(LayoutError, match="pp_rank 2 must be below pp_size 2"):
        Layout([4096], [640], 64, pp_rank=2, pp_size=2)


@pytest.mark.parametrize("ctx", [dict(pp_rank=-1), dict(tp_size=2**32), dict(page_size=-1),
                                 dict(num_model_layers=-3), dict(device=3)])
def test_out_of_range_layout_context_names_the_keyword(ctx):
    """Context keywords out of range: a TypeError that names the keyword, its range and value."""
    (key, value), = ctx.items()
    with pytest.raises(TypeError, match=f"^{key} must be .*, got {value!r}$"):
        Layout([4096], [640], 64, **ctx)


@pytest.mark.parametrize("item_lens", [-64, "x", [64, -1], 2**64])
def test_bad_item_lens_have_one_clear_message(item_lens):
    with pytest.raises(TypeError, match="item_lens must be a non-negative int below 2\\*\\*64"):
        Layout([4096, 8192], [640, 640], item_lens)


def test_layout_accepts_numpy_integers_and_full_u64_range():
    lay = Layout(np.array([2**64 - 8192], dtype=np.uint64), np.array([4096], dtype=np.uint64), np.uint64(64))
    assert lay.data_ptrs == [2**64 - 8192] and lay.capacities == [64]
    # a buffer ending exactly at 2**64 would make its end address unrepresentable
    with pytest.raises(LayoutError, match="overflows u64"):
        Layout(np.array([2**64 - 4096], dtype=np.uint64), [4096], 64)
    lay = Layout([2**64 - 4097], [4096], 64)  # ends at 2**64 - 1: fine
    assert lay.capacities == [64]


@pytest.mark.slow
def test_huge_layouts_one_million_entries():
    n = 1_000_000
    src = Layout.mla([(1 << 32) + 4096 * i for i in range(n)], [4096] * n, 64, layer_ids=list(range(n)))
    dst = Layout.mla([(1 << 44) + 8192 * i for i in range(n)], [8192] * n, 64, layer_ids=list(range(n)))
    assert src.n_entries == n
    t = Template(src, dst)
    assert t.n_pairs == n and t.bytes_per_page == 64 * n
    sp = np.array([0, 1, 2, 63], dtype=np.int32)
    dp = np.array([10, 11, 12, 127], dtype=np.int32)
    plan = t.plan(sp, dp)
    assert (plan.n_blocks, plan.n_runs, plan.total_bytes) == (2 * n, 2, 4 * 64 * n)
    s, d, ln = plan.src_addrs, plan.dst_addrs, plan.lengths
    k = np.arange(n, dtype=np.uint64)
    assert np.array_equal(s[0::2], (1 << 32) + 4096 * k)
    assert np.array_equal(s[1::2], (1 << 32) + 4096 * k + 63 * 64)
    assert np.array_equal(d[0::2], (1 << 44) + 8192 * k + 640)
    assert np.array_equal(d[1::2], (1 << 44) + 8192 * k + 127 * 64)
    assert np.array_equal(ln, np.tile(np.array([192, 64], np.uint64), n))
    with pytest.raises(IndexBoundsError, match=r"src index 64 at position 0 is outside 0\.\.64"):
        t.plan(np.array([64], np.int32), np.array([0], np.int32))
    # the wire format carries it (its limit is 2**20 entries)
    assert Layout.from_bytes(src.to_bytes()) == src
    del plan, s, d, ln, t, src, dst
    gc.collect()


def test_layouts_are_immutable_and_rebuilding_does_not_touch_a_template():
    ptrs = [1 << 20, 2 << 20]
    lens = [6400, 6400]
    src = Layout.mla(ptrs, lens, 64, layer_ids=[0, 1])
    dst = mla([1 << 30, 2 << 30], 100)
    t = Template(src, dst)
    sp, dp = np.array([0, 1, 2]), np.array([3, 4, 5])
    before = t.plan(sp, dp).as_lists()
    # mutate everything the layout was built from, and what it hands back
    ptrs[0] = 1 << 40
    lens[0] = 64
    src.data_ptrs.append(5)
    src.data_ptrs[0] = 7
    d = src.to_dict()
    for key in list(d):
        if isinstance(d[key], list) and d[key]:
            d[key][0] = None
    with pytest.raises(AttributeError):
        src.data_ptrs = [0, 0]  # type: ignore[misc]
    with pytest.raises(AttributeError):
        src.new_attribute = 1  # type: ignore[attr-defined]
    assert src.data_ptrs == [1 << 20, 2 << 20] and src.data_lens == [6400, 6400]
    # a layout rebuilt from the mutated lists is a different layout with its own template ...
    rebuilt = Layout.mla(ptrs, lens, 64, layer_ids=[0, 1])
    assert rebuilt != src
    t2 = Template(rebuilt, dst)
    with pytest.raises(IndexBoundsError, match=r"outside 0\.\.1"):
        t2.plan(sp, dp)
    # ... and the existing template still plans exactly as before
    assert t.plan(sp, dp).as_lists() == before
    check_plan(t, Layout.mla([1 << 20, 2 << 20], [6400, 6400], 64, layer_ids=[0, 1]), dst, sp, dp)


def test_to_dict_mutations_and_hostile_from_dict():
    good = SRC.to_dict()
    assert Layout.from_dict(good) == SRC
    for key in good:
        for bad in (None, "x", -1, 2**64, [None], [1.5]):
            d = dict(good)
            d[key] = bad
            try:
                lay = Layout.from_dict(d)
            except (KvPlanError, TypeError, OverflowError) as exc:
                assert str(exc)
            else:  # an accepted value must give a valid layout that round-trips
                assert Layout.from_bytes(lay.to_bytes()) == lay
    with pytest.raises(TypeError):
        Layout.from_dict(None)  # type: ignore[arg-type]
    with pytest.raises(KvPlanError, match="version"):
        Layout.from_dict({})


def test_hostile_wire_bytes():
    blob = SRC.to_bytes()
    rng = np.random.default_rng(6)
    rejected = 0
    for cut in range(len(blob)):
        with pytest.raises(KvPlanError, match="^wire data: "):
            Layout.from_bytes(blob[:cut])
    for _ in range(300):
        b = bytearray(blob)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        if bytes(b) == blob:
            continue
        with pytest.raises(KvPlanError):
            Layout.from_bytes(bytes(b))
        rejected += 1
    assert rejected > 250
    for bad in (b"", b"KVPL", b"\x00" * 100, bytes(range(256)) * 4):
        with pytest.raises(KvPlanError):
            Layout.from_bytes(bad)
    with pytest.raises(TypeError):
        Layout.from_bytes("KVPL")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ pairing inputs


def test_legacy_slicing_with_huge_decode_layer_count_is_a_pairing_error():
    # decode_num_layers * 2 used to wrap around in release builds: the slice was accepted and
    # the V entries paired with decode entry 2**63 (out of range; Template raised PanicException).
    with pytest.raises(PairingError, match="does not fit 4 decode entries"):
        kvplan.legacy_pp_pairs("mha", 2, 4, 0, decode_num_layers=2**63)
    with pytest.raises(PairingError, match="does not fit"):
        kvplan.legacy_pp_pairs("mha", 2, 4, 0, decode_num_layers=2**64 - 1)
    src = Layout([1, 2], [640] * 2, 64)
    for layers in (2**63, 2**63 + 1, 2**64 - 1):
        dst = Layout([1, 2, 3, 4], [640] * 4, 64, num_model_layers=layers)
        with pytest.raises(PairingError, match="does not fit"):
            Template(src, dst, Pairing.by_layer_id(prefill_start_layer=0, legacy_kind="mha"))
        rows = kvplan._core.check_pairs(
            src, dst, Pairing.by_layer_id(prefill_start_layer=0, legacy_kind="mha"))
        assert rows and all(isinstance(r[3], PairingError) for r in rows)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("mla", 2**63, 4, 0), {}),
        (("mla", 4, 4, 2**64 - 1), {}),
        (("mla", 1, 2**64 - 1, 2**64 - 1), {}),  # end saturated to n_dst: paired index n_dst
        (("mla", 3, 8, 2**64 - 1), {}),
        (("mla", 3, 8, 0), dict(num_draft_entries=2**64 - 1)),
        (("mha", 2, 2**64 - 2, 2**64 - 1), dict(decode_num_layers=2**63 - 1)),
        (("mha", 4, 8, 2**63), dict(decode_num_layers=4)),
        (("mha", 2**63, 4, 0), dict(decode_num_layers=2)),
    ],
)
def test_legacy_pp_pairs_extreme_counts(args, kwargs):
    try:
        pairs = kvplan.legacy_pp_pairs(*args, **kwargs)
    except PairingError as exc:
        assert "legacy positional slicing" in str(exc)
    else:
        n_src, n_dst = args[1], args[2]
        assert pairs.shape == (n_src, 2)
        assert pairs[:, 0].tolist() == list(range(n_src))
        assert all(0 <= j < n_dst for j in pairs[:, 1].tolist())
        assert len(set(pairs[:, 1].tolist())) == n_src


def test_absurd_entry_counts_are_errors_not_aborts():
    """Bare counts size the positional pair lists: 2**40 used to abort the process (failed
    allocation, SIGABRT) and 2**63 raised PanicException; now a MemoryError (a layout error
    before). Run under a 3 GiB address-space limit
    so the outcome does not depend on the machine's memory."""
    out = run_isolated(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        import kvplan
        calls = [
            lambda: kvplan.legacy_pp_pairs("mla", 2**40, 2**40, 0),
            lambda: kvplan.legacy_pp_pairs("mha", 2**41, 2**41, 0),
            lambda: kvplan.legacy_pp_pairs("mla", 2**62, 2**62 + 8, 0),
            lambda: kvplan.pair_entries(None, None, 2**63, 2**63, True),
            lambda: kvplan.pair_entries(None, None, 2**30, 2**30 + 1, True),
            lambda: kvplan.pair_entries([], [], 2**40, 2**40),
        ]
        for call in calls:
            try:
                call()
            except MemoryError as exc:
                assert "cannot allocate" in str(exc) and "entry pairs" in str(exc), exc
                print("MemoryError")
            else:
                raise AssertionError("accepted")
        """
    )
    assert out.split() == ["MemoryError"] * 6


def test_pair_entries_extreme_values():
    big = 2**63 - 1
    assert kvplan.pair_entries([big, -big], [-big, big], 2, 2).tolist() == [[0, 1], [1, 0]]
    with pytest.raises(OverflowError):
        kvplan.pair_entries(None, None, -1, 2)
    with pytest.raises(PairingError, match="metadata length must match"):
        kvplan.pair_entries([1, 2], [1, 2], 3, 2)
    with pytest.raises(PairingError):
        kvplan.pair_entries([1], [1], 1, 1, src_roles=["k"], dst_roles=["v"])
    with pytest.raises(TypeError):
        kvplan.pair_entries([1.5], [1], 1, 1)
    with pytest.raises(KvPlanError, match='legacy kind must be "mla" or "mha"'):
        kvplan.legacy_pp_pairs("gqa", 2, 2, 0)


def test_plan_state_extreme_slots():
    s = Layout.mla([], [], 64).with_state("mamba_conv", [0], [U64_MAX], 1, [0])
    d = Layout.mla([], [], 64).with_state("mamba_conv", [0], [U64_MAX], 1, [0])
    t = Template(s, d)
    big = 2**63 - 1
    plan = t.plan_state(big, 0)
    assert plan.as_lists() == ([big], [0], [1])
    with pytest.raises(IndexBoundsError, match="negative"):
        t.plan_state(0, -(2**63))
    with pytest.raises(OverflowError):
        t.plan_state(2**63, 0)
    with pytest.raises(TypeError):
        t.plan_state(1.0, 0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ lifetimes


def test_plans_outlive_their_inputs_and_pool_churn():
    run_isolated(
        """
        import gc
        import numpy as np
        import kvplan
        from kvplan import Layout, Template

        def make():
            src = Layout.mla([(k + 1) << 32 for k in range(4)], [1 << 24] * 4, 256, layer_ids=[0, 1, 2, 3])
            dst = Layout.mla([(k + 9) << 32 for k in range(4)], [1 << 24] * 4, 256, layer_ids=[0, 1, 2, 3])
            return src, dst, Template(src, dst)

        rng = np.random.default_rng(11)
        kept = []
        for r in range(40):
            src, dst, t = make()
            n = int(rng.integers(1, 5000))
            sp = rng.integers(0, 1 << 16, n).astype(np.int32)
            dp = rng.integers(0, 1 << 16, n).astype(np.int64)
            out = np.zeros((3, 4 * n), np.uint64) if r % 3 == 0 else None
            plan = t.plan(sp, dp, out=out)
            want = tuple(a.copy() for a in (plan.src_addrs, plan.dst_addrs, plan.lengths))
            # keep only one column of some plans, all columns of others; drop everything else
            views = (plan.src_addrs,) if r % 2 else (plan.src_addrs, plan.dst_addrs, plan.lengths)
            kept.append((views, want))
            del src, dst, t, sp, dp, out, plan
            gc.collect()
            # churn: other plans of other sizes, dropped immediately (their buffers are pooled)
            _, _, t2 = make()
            for _ in range(5):
                m = int(rng.integers(1, 20000))
                p = t2.plan(rng.integers(0, 1 << 16, m).astype(np.int64), rng.integers(0, 1 << 16, m).astype(np.int32))
                p.src_addrs[:] = 0xAB  # scribble on pooled memory we own
                del p
        for views, want in kept:
            for v, w in zip(views, want):
                assert np.array_equal(v, w), "a live plan array changed after its buffer was pooled"
        print("ok", len(kept), kvplan._core.pool_stats())
        """
    )


def test_out_buffer_aliasing_and_odd_out_arrays():
    run_isolated(
        """
        import numpy as np
        from kvplan import KvPlanError, Layout, Template
        src = Layout.mla([1 << 20], [6400], 64, layer_ids=[0])
        dst = Layout.mla([1 << 30], [6400], 64, layer_ids=[0])
        t = Template(src, dst)
        sp = np.array([0, 1, 5], np.int64)
        buf = np.zeros((3, 8), np.uint64)
        cases = {
            "alias_src": lambda: t.plan(buf.view(np.int64)[0, :3], sp, out=buf),
            "alias_dst": lambda: t.plan(sp, buf.view(np.int64)[2, :3], out=buf),
            "readonly": lambda: t.plan(sp, sp, out=np.frombuffer(bytes(48), np.uint64).reshape(3, 2)),
            "fortran": lambda: t.plan(sp, sp, out=np.zeros((3, 8), np.uint64, order="F")),
            "strided": lambda: t.plan(sp, sp, out=np.zeros((3, 16), np.uint64)[:, ::2]),
            "shape": lambda: t.plan(sp, sp, out=np.zeros((2, 8), np.uint64)),
            "small": lambda: t.plan(sp, sp, out=np.zeros((3, 1), np.uint64)),
            "empty": lambda: t.plan(sp, sp, out=np.zeros((3, 0), np.uint64)),
            "dtype": lambda: t.plan(sp, sp, out=np.zeros((3, 8), np.int64)),
            "1d": lambda: t.plan(sp, sp, out=np.zeros(24, np.uint64)),
        }
        # wrong type, dtype, shape or memory order: TypeError; a value problem: KvPlanError
        shape_errors = {"fortran", "strided", "shape", "dtype", "1d"}
        for name, call in cases.items():
            try:
                call()
            except (KvPlanError, TypeError) as exc:
                assert str(exc), name
                expected = TypeError if name in shape_errors else KvPlanError
                assert type(exc) is expected, (name, exc)
                print(name, type(exc).__name__)
            else:
                raise AssertionError(f"{name}: accepted")
        # input and out sharing memory is refused even when the input is the out buffer's tail
        plan = t.plan(sp, sp, out=buf)
        del buf
        assert plan.as_lists() == ([(1 << 20), (1 << 20) + 5 * 64], [(1 << 30), (1 << 30) + 5 * 64], [128, 64])
        print("ok")
        """
    )


def test_inputs_mutated_by_another_thread_never_yield_out_of_bounds_blocks():
    """docs: index arrays must not be mutated during a plan; if they are, kvplan raises rather
    than emitting an address outside a buffer. Hammer that in a subprocess."""
    out = run_isolated(
        """
        import threading
        import numpy as np
        from kvplan import KvPlanError, Layout, Template
        cap, item, n_layers = 1000, 64, 4
        src = Layout.mla([(k + 1) << 32 for k in range(n_layers)], [cap * item] * n_layers, item, layer_ids=list(range(n_layers)))
        dst = Layout.mla([(k + 9) << 32 for k in range(n_layers)], [cap * item] * n_layers, item, layer_ids=list(range(n_layers)))
        t = Template(src, dst)
        sp = np.arange(50_000, dtype=np.int64) % cap
        dp = np.arange(50_000, dtype=np.int64) % cap
        stop = threading.Event()

        def scribble():
            rng = np.random.default_rng(1)
            while not stop.is_set():
                i = int(rng.integers(0, len(dp)))
                dp[i] = int(rng.choice([-1, cap, 10**12, 5, i % cap]))
                sp[i] = int(rng.choice([-5, cap + 1, 3, i % cap]))

        th = threading.Thread(target=scribble)
        th.start()
        ok = err = 0
        try:
            for _ in range(300):
                try:
                    plan = t.plan(sp, dp)
                except KvPlanError:
                    err += 1
                    continue
                ok += 1
                s, d, ln = plan.src_addrs, plan.dst_addrs, plan.lengths
                for k in range(n_layers):
                    blocks = slice(plan.pair_offsets[k], plan.pair_offsets[k + 1])
                    sb, db = (k + 1) << 32, (k + 9) << 32
                    assert (s[blocks] >= sb).all() and (s[blocks] + ln[blocks] <= sb + cap * item).all()
                    assert (d[blocks] >= db).all() and (d[blocks] + ln[blocks] <= db + cap * item).all()
        finally:
            stop.set()
            th.join()
        print("ok", ok, "errors", err)
        """,
        timeout=180,
    )
    assert out.startswith("ok")


# ------------------------------------------------------------------------------ threads


def test_concurrent_planning_8_threads_mixed_requests_and_errors():
    n_layers, cap, item = 6, 2048, 128
    src = Layout.mla([(k + 1) << 32 for k in range(n_layers)], [cap * item] * n_layers, item,
                     layer_ids=list(range(n_layers))).with_state("mamba_conv", [1 << 50], [64 * 100], 64, [0])
    dst = Layout.mla([(k + 50) << 32 for k in range(n_layers)], [cap * item] * n_layers, item,
                     layer_ids=list(range(n_layers))).with_state("mamba_conv", [1 << 51], [64 * 100], 64, [0])
    t = Template(src, dst, check_dst_overlap=True)
    rng = np.random.default_rng(8)
    requests = []
    for r in range(64):
        n = int(rng.integers(1, 1500))
        sp = rng.integers(0, cap, n).astype(np.int32 if r % 2 else np.int64)
        dp = rng.permutation(cap)[:n].astype(np.int64 if r % 3 else np.int32)
        if r % 7 == 0:
            dp[n // 2] = cap + r  # out of bounds
        elif r % 11 == 0 and n > 1:
            dp[-1] = dp[0]  # duplicate destination
        requests.append((sp, dp))
    expected = []
    for sp, dp in requests:
        try:
            p = t.plan(sp, dp)
            expected.append(("ok", p.as_lists(), p.total_bytes))
        except IndexBoundsError as exc:
            expected.append(("err", str(exc), None))
    assert sum(e[0] == "err" for e in expected) >= 8
    # single-threaded baseline is right (spot check one accepted request against the reference)
    first_ok = next(i for i, e in enumerate(expected) if e[0] == "ok")
    rs, rd = ref_layout(src), ref_layout(dst)
    exp = ref.plan_blocks(rs, rd, ref.template_pairs(rs, rd), requests[first_ok][0].tolist(),
                          requests[first_ok][1].tolist())
    assert expected[first_ok][1] == (exp.src, exp.dst, exp.lengths)

    barrier = threading.Barrier(8)
    failures: list[object] = []

    def worker(tid: int) -> None:
        try:
            barrier.wait()
            for rep in range(4):
                for k in range(tid, len(requests), 8):
                    idx = (k + rep * 5) % len(requests)
                    sp, dp = requests[idx]
                    kind, want, total = expected[idx]
                    try:
                        out = np.empty((3, len(sp) * n_layers), np.uint64) if rep == 3 else None
                        p = t.plan(sp, dp, out=out)
                        got = ("ok", p.as_lists(), p.total_bytes)
                    except IndexBoundsError as exc:
                        got = ("err", str(exc), None)
                    if got != (kind, want, total):
                        failures.append((tid, idx))
                    st = t.plan_state(tid, 99 - tid)
                    if st.as_lists() != ([(1 << 50) + 64 * tid], [(1 << 51) + 64 * (99 - tid)], [64]):
                        failures.append((tid, "state"))
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    threads = run_racing_threads(worker, 8, switch_interval=1e-5)
    assert not any(th.is_alive() for th in threads)
    assert not failures, failures[:10]
