"""Regressions for argument handling in the bindings: allocation failure, ``out=`` aliasing and
subclasses, concurrently mutated inputs, extreme and unsigned integer values, unaligned arrays.

Every case ends as a typed exception whose message names the problem, or as a correct result.
Cases that would have killed the interpreter (allocation aborts) run in a subprocess under
``RLIMIT_AS``, so a crash fails the test instead of pytest.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvplan
from kvplan import IndexBoundsError, KvPlanError, Layout, Template

from support import reference as ref
from support.robustness_checks import assert_invariants, ref_layout
from support.robustness_checks import run_isolated as run_in_subprocess



# Sets RLIMIT_AS to the address space in use plus `headroom` bytes, and back.
LIMITS = """
import re
import resource

def address_space():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmSize:\\s+(\\d+) kB", f.read()).group(1)) * 1024

def limit(headroom):
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + headroom, resource.RLIM_INFINITY))

def unlimit():
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

MB = 1 << 20
"""


def run_isolated(code: str, timeout: float = 120) -> str:
    """Runs LIMITS + `code` in a fresh interpreter; any non-zero exit (SIGABRT included) fails
    the test."""
    return run_in_subprocess(code, timeout, prelude=LIMITS)


def mla(ptrs, cap, item=64):
    n = len(ptrs)
    return Layout.mla(list(ptrs), [cap * item] * n, item, layer_ids=list(range(n)))


SRC = mla([1 << 20, 2 << 20], 100)
DST = mla([1 << 30, 2 << 30], 100)
TEMPLATE = Template(SRC, DST)


def check_plan(plan, sp, dp):
    """`plan` is TEMPLATE's plan of (sp, dp): the reference's blocks and the safety invariants."""
    rs, rd = ref_layout(SRC), ref_layout(DST)
    want = ref.plan_blocks(rs, rd, ref.template_pairs(rs, rd), sp, dp)
    assert plan.as_lists() == (want.src, want.dst, want.lengths)
    assert_invariants(plan, TEMPLATE, SRC, DST, len(sp))


# ------------------------------------------------------------------------ allocation failure


def test_pooled_plan_output_that_cannot_be_allocated_is_memory_error():
    out = run_isolated(
        """
        import numpy as np
        from kvplan import Layout, Template
        n_layers, n = 64, 1 << 20
        ptrs = [(k + 1) << 36 for k in range(n_layers)]
        lay = Layout.mla(ptrs, [1 << 30] * n_layers, 64, layer_ids=list(range(n_layers)))
        t = Template(lay, lay)
        pages = np.arange(0, 2 * n, 2, dtype=np.int32)  # every page its own run
        need = n * n_layers * 24                      # 1.5 GiB of plan output
        limit(256 * MB)
        try:
            np.empty(need // 8, np.uint64)
        except MemoryError:
            pass
        else:
            raise AssertionError("the limit does not hold")
        try:
            t.plan(pages, pages)
        except MemoryError as exc:
            assert str(exc).startswith("cannot allocate "), exc
            assert "plan output" in str(exc), exc
        else:
            raise AssertionError("an output larger than the limit was allocated")
        # the process is intact: a smaller plan still works under the same limit
        small = t.plan(pages[:1000], pages[:1000])
        assert len(small) == 1000 * n_layers
        unlimit()
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_allocations_sized_by_the_request_raise_memory_error():
    out = run_isolated(
        """
        import numpy as np
        import kvplan
        from kvplan import KvPlanError, Layout, Template

        def expect_memory_error(name, call):
            try:
                call()
            except MemoryError as exc:
                assert "cannot allocate" in str(exc), (name, exc)
                print(name, "MemoryError")
            else:
                raise AssertionError(name + ": no error")

        # legacy_pp_pairs: the core's pair list (16 bytes a pair) fits, its copy does not
        n = (280 * MB) // 16
        limit(400 * MB)
        expect_memory_error("legacy_pp_pairs copy", lambda: kvplan.legacy_pp_pairs("mla", n, n, 0))
        unlimit()
        # the core's own list: a count no memory holds is a MemoryError naming its size
        try:
            kvplan.legacy_pp_pairs("mla", 1 << 40, 1 << 40, 0)
        except MemoryError as exc:
            assert str(16 << 40) in str(exc) and "entry pairs" in str(exc), exc
        else:
            raise AssertionError("2**40 pairs allocated")

        # group_contiguous: three int64 outputs per run, twice the int32 input per output
        pages = np.arange(0, 2 << 22, 2, dtype=np.int32)  # 4M runs: 3 x 32 MiB out
        limit(48 * MB)
        expect_memory_error("group_contiguous", lambda: kvplan.group_contiguous(pages, pages))
        unlimit()

        # the destination-overlap check: 16 bytes per index
        lay = Layout.mla([1 << 40], [1 << 34], 64, layer_ids=[0])
        t = Template(lay, lay, check_dst_overlap=True)
        run = np.arange(1 << 22, dtype=np.int32)  # one run: a tiny plan, a 64 MiB check
        limit(32 * MB)
        expect_memory_error("check_dst_overlap", lambda: t.plan(run, run))
        unlimit()

        # Layout.from_bytes copies its input to decode without the GIL
        data = bytes(256 * MB)
        limit(128 * MB)
        expect_memory_error("from_bytes", lambda: kvplan.Layout.from_bytes(data))
        unlimit()

        # all of it again without the limit: nothing was left broken
        assert len(kvplan.legacy_pp_pairs("mla", 1000, 1000, 0)) == 1000
        assert len(kvplan.group_contiguous(pages, pages)[0]) == 1 << 22
        assert len(t.plan(run, run)) == 1
        print("ok")
        """
    )
    assert out.strip().endswith("ok")
    assert out.count("MemoryError") == 4, out


# ---------------------------------------------------------------------------- out= aliasing


def _views_of_one_buffer(offset_blocks):
    """A (3, 8) uint64 out array and a 3-long int64 index array made by two separate
    np.frombuffer calls on one bytearray (so they share no numpy base object)."""
    raw = bytearray(8 * 40)
    out = np.frombuffer(raw, np.uint64, count=24).reshape(3, 8)
    idx = np.frombuffer(raw, np.int64, count=3, offset=8 * offset_blocks)
    idx[:] = [0, 1, 5]
    return out, idx


@pytest.mark.parametrize("offset_blocks", [0, 10, 22])  # start, middle, overlapping the end
@pytest.mark.parametrize("side", ["src_pages", "dst_pages"])
def test_out_overlapping_an_input_through_another_view_is_refused(offset_blocks, side):
    out, idx = _views_of_one_buffer(offset_blocks)
    assert np.shares_memory(out, idx) and out.base is not idx.base
    other = np.array([0, 1, 5], np.int64)
    args = (idx, other) if side == "src_pages" else (other, idx)
    before = out.copy()
    with pytest.raises(KvPlanError, match=rf"^out overlaps {side} in memory \(out is bytes 0x"):
        TEMPLATE.plan(*args, out=out)
    assert np.array_equal(out, before)  # refused before anything was written


def test_out_next_to_an_input_in_one_buffer_is_accepted():
    # Adjacent ranges touch but do not overlap; an empty input overlaps nothing.
    raw = bytearray(8 * 30)
    out = np.frombuffer(raw, np.uint64, count=24).reshape(3, 8)
    idx = np.frombuffer(raw, np.int64, count=3, offset=8 * 24)
    idx[:] = [0, 1, 5]
    plan = TEMPLATE.plan(idx, idx, out=out)
    check_plan(plan, [0, 1, 5], [0, 1, 5])
    empty = np.frombuffer(raw, np.int64, count=0, offset=8)
    assert len(TEMPLATE.plan(empty, empty, out=out)) == 0


# -------------------------------------------------------------------- out= ndarray subclasses


class _ShuffledRows(np.ndarray):
    """An ndarray subclass whose indexing lies: every row index reads row 0."""

    def __getitem__(self, key):
        if isinstance(key, tuple):
            key = (0, *key[1:])
        return super().__getitem__(key)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix itself
@pytest.mark.parametrize("kind", ["matrix", "lying_subclass"])
def test_out_subclass_gives_plain_one_dimensional_columns(kind):
    base = np.zeros((3, 8), np.uint64)
    out = np.asmatrix(base) if kind == "matrix" else base.view(_ShuffledRows)
    sp, dp = np.array([0, 1, 5, 6, 9]), np.array([3, 4, 5, 6, 0])
    plan = TEMPLATE.plan(sp, dp, out=out)
    for col in (plan.src_addrs, plan.dst_addrs, plan.lengths):
        assert type(col) is np.ndarray and col.ndim == 1 and np.shares_memory(col, base)
    check_plan(plan, sp, dp)
    assert len(plan) == plan.n_blocks == 6
    assert sum(len(b.lengths) for b in plan.batches(4)) == 6
    assert all(type(b.src_addrs) is np.ndarray for b in plan.batches(4))


# --------------------------------------------------------------- concurrently mutated inputs


def test_group_contiguous_inputs_mutated_by_another_thread_give_a_tiling_or_a_clear_error():
    """Another thread rewrites the index arrays (including negative values) while
    group_contiguous runs with the GIL released. Every outcome must be a valid tiling (starts
    non-negative, no empty run, lengths summing to the input length) or IndexBoundsError; which
    of the two happens on a given call depends on scheduling, so only the union is asserted."""
    n = 1 << 14
    src = np.arange(n, dtype=np.int64)
    dst = np.arange(n, dtype=np.int64)
    patterns = [np.arange(n), np.arange(n)[::-1].copy(), np.arange(0, 2 * n, 2),
                np.full(n, -3), np.tile([5, -1], n // 2)]
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set():
            src[:] = patterns[k % len(patterns)]
            dst[::3] = patterns[(k + 1) % len(patterns)][::3]
            k += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            try:
                s, d, lengths = kvplan.group_contiguous(src, dst)
            except IndexBoundsError as exc:
                msg = str(exc)
                assert "output buffer" not in msg, msg
                assert "is negative" in msg or "changed while planning" in msg, msg
                continue
            assert len(s) == len(d) == len(lengths)
            assert (lengths >= 1).all() and int(lengths.sum()) == n
            assert (s >= 0).all() and (d >= 0).all()
    finally:
        stop.set()
        thread.join()


# ----------------------------------------------------------------------- extreme integers


@pytest.mark.parametrize(
    ("values", "dtype", "position", "shown"),
    [
        ([2**31 - 1, -(2**31)], np.int32, 1, "-2147483648"),
        ([-(2**63), 2**63 - 1], np.int64, 0, "-9223372036854775808"),
        ([2**63 - 1, -(2**63)], np.int64, 1, "-9223372036854775808"),
        ([0, -1], np.int64, 1, "-1"),
    ],
)
@pytest.mark.parametrize("side", ["src", "dst"])
def test_extreme_negative_values_are_refused_as_passed(values, dtype, position, shown, side):
    bad = np.array(values, dtype)
    good = np.array([0, 1], dtype)
    args = (bad, good) if side == "src" else (good, bad)
    want = rf"^{side} index {shown} at position {position} is negative$"
    with pytest.raises(IndexBoundsError, match=want):
        kvplan.group_contiguous(*args)
    with pytest.raises(IndexBoundsError, match=want):
        TEMPLATE.plan(*args)


def test_extreme_positive_values_are_grouped_exactly():
    s, d, lengths = kvplan.group_contiguous(
        np.array([2**63 - 2, 2**63 - 1], np.int64), np.array([2**31 - 2, 2**31 - 1], np.int32)
    )
    assert (s.tolist(), d.tolist(), lengths.tolist()) == ([2**63 - 2], [2**31 - 2], [2])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("side", ["src", "dst"])
def test_unsigned_index_arrays_are_type_errors_with_working_advice(dtype, side):
    # Unsigned dtypes are refused whatever the values (a uint64 of 2**64 - 1 has no int64
    # value to report): the message says so and how to convert.
    bad = np.array([0, np.iinfo(dtype).max], dtype)
    good = np.array([0, 1], np.int64)
    args = (bad, good) if side == "src" else (good, bad)
    for call, name in ((kvplan.group_contiguous, side), (TEMPLATE.plan, f"{side}_pages")):
        with pytest.raises(TypeError) as ei:
            call(*args)
        msg = str(ei.value)
        assert msg.startswith(f"{name} must be a 1-D numpy array of dtype int32 or int64"), msg
        assert np.dtype(dtype).name in msg and "unsigned dtypes are not accepted" in msg, msg
        assert ".astype(np.int64)" in msg and "-1" not in msg, msg
    # the advice works for values below 2**63
    small = np.array([3, 4], dtype)
    assert kvplan.group_contiguous(small.astype(np.int64), good)[2].tolist() == [2]


# ------------------------------------------------------------------------ unaligned arrays


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("side", ["src", "dst"])
def test_unaligned_index_arrays_say_unaligned_and_the_advice_works(dtype, side):
    itemsize = np.dtype(dtype).itemsize
    values = np.array([0, 1, 5, 6], dtype)
    raw = b"\0" + values.tobytes()
    unaligned = np.frombuffer(raw, dtype, offset=1)
    assert unaligned.flags.c_contiguous and not unaligned.flags.aligned
    # np.ascontiguousarray (the advice for strided arrays) returns it unchanged
    assert not np.ascontiguousarray(unaligned).flags.aligned
    good = np.array([2, 3, 4, 9], dtype)
    for call, name in ((kvplan.group_contiguous, side), (TEMPLATE.plan, f"{side}_pages")):
        args = (unaligned, good) if side == "src" else (good, unaligned)
        with pytest.raises(TypeError, match=rf"^{name} is unaligned .*multiple of {itemsize}.*{name}\.copy\(\)"):
            call(*args)
        fixed = (unaligned.copy(), good) if side == "src" else (good, unaligned.copy())
        call(*fixed)
    sp, dp = (values, good) if side == "src" else (good, values)
    check_plan(TEMPLATE.plan(*((unaligned.copy(), good) if side == "src" else (good, unaligned.copy()))), sp, dp)


def test_strided_arrays_keep_their_contiguity_advice():
    strided = np.arange(8, dtype=np.int64)[::2]
    with pytest.raises(TypeError, match=r"^src_pages must be C-contiguous \(use np.ascontiguousarray\)$"):
        TEMPLATE.plan(strided, np.arange(4))
    check_plan(TEMPLATE.plan(np.ascontiguousarray(strided), np.arange(4)), [0, 2, 4, 6], [0, 1, 2, 3])


# ------------------------------------------------------------ (addr, size) region arguments

REGION_CALLS = {
    "pack": lambda region: TEMPLATE.plan_packed(np.arange(4), np.arange(4), pack=region),
    "pack (row gather)": lambda region: TEMPLATE.plan_row_gather(
        np.arange(4), np.arange(4), n_tokens=4, pack=region),
    "src_staging": lambda region: TEMPLATE.plan_staged(
        np.arange(4), np.arange(4), src_staging=region, dst_staging=(1 << 40, 1 << 20)),
    "dst_staging": lambda region: TEMPLATE.plan_staged(
        np.arange(4), np.arange(4), src_staging=(1 << 40, 1 << 20), dst_staging=region),
}


@pytest.mark.parametrize("call", sorted(REGION_CALLS))
@pytest.mark.parametrize(("region", "shown"), [
    ((1 << 40,), r"got a tuple of 1 item\b"),
    ((1 << 40, 1 << 20, 7), r"got a tuple of 3 items\b"),
    ((), r"got a tuple of 0 items\b"),
    ([1 << 40, 1 << 20], r"got list\b"),
    ((1 << 40, 2.5), r"its size is a float\b"),
])
def test_a_region_of_the_wrong_shape_is_a_type_error_naming_the_argument(call, region, shown):
    name = call.split()[0]
    with pytest.raises(TypeError, match=rf"^{name} must be a tuple \(addr, size\) of two ints"
                                        rf".*{shown}"):
        REGION_CALLS[call](region)


@pytest.mark.parametrize("call", sorted(REGION_CALLS))
def test_a_region_int_out_of_range_is_an_overflow_error_naming_the_argument(call):
    name = call.split()[0]
    with pytest.raises(OverflowError, match=rf"^{name}'s addr must be an int in 0..2\*\*64, got -1"):
        REGION_CALLS[call]((-1, 1 << 20))
    # A well-formed region is accepted as before.
    REGION_CALLS[call]((1 << 40, 1 << 20))
