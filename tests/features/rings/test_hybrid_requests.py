"""A hybrid model's whole request as one value: ``Request(src, dst, slot=(s, d), n_tokens=n)``
carries each side's KV pages and state slot, and one ``plan`` moves its pages (or tokens), then
its state slots, then its ring rows (the last ``min(R_prefill, R_decode, n)`` positions). Checked
against the byte oracle (``reference_copy`` with pages and slots, ``reference_ring_copy``) and
against the plans of the page request and the slot request made apart."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
import kvplan.capabilities
from kvplan.testing.oracle import Memory, apply_plan, reference_copy, reference_ring_copy

ROW = 12  # bytes per ring row
SLOT = 20  # bytes of a plain state slot
SLOTS = 3
PAGES = 16
TOKEN = 16


def hybrid_side(rows: int | None, *, pad: int = 0, seed: int | None = None,
                state: bool = True) -> tuple[kvplan.Layout, Memory]:
    """Two layers, each a KV entry of ``PAGES`` one-token pages, a plain state entry (one
    ``SLOT``-byte slot per request) and a ring-state entry of ``rows`` rows per request
    (``None``: a plain state entry), in one arena; ``state=False``: the KV entries alone."""
    layers = [0, 1]
    stride = ROW + pad
    kv_bytes, slot_bytes = PAGES * TOKEN, SLOTS * SLOT
    ring_bytes = SLOTS * (rows or 1) * stride
    arena = np.zeros(2 * (kv_bytes + slot_bytes + ring_bytes) + 64, dtype=np.uint8)
    if seed is not None:
        arena[:] = np.random.default_rng(seed).integers(1, 255, arena.size, dtype=np.uint8)
    base = int(arena.ctypes.data)
    layout = kvplan.Layout([base + i * kv_bytes for i in layers], [kv_bytes] * 2, TOKEN, layers,
                           ["kv"] * 2, page_size=1)
    if not state:
        return layout, Memory(arena, base)
    at = base + 2 * kv_bytes
    layout = layout.with_state("mamba", [at + i * slot_bytes for i in layers], [slot_bytes] * 2,
                               SLOT, layers)
    at += 2 * slot_bytes
    layout = layout.with_state("ring", [at + i * ring_bytes for i in layers], [ring_bytes] * 2,
                               ROW, layers, strides=stride)
    return layout.with_rings([None] * 4 + [rows, rows]), Memory(arena, base)


def _pages(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.permutation(PAGES)[:n].astype(np.int64)


def _columns(plan: kvplan.TransferPlan) -> list[list[int]]:
    return [plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist()]


@pytest.mark.parametrize("rings", [(2, 5), (4, 4), (6, 3)])
def test_one_request_moves_its_pages_then_its_slots_then_its_ring_rows(
        rings: tuple[int, int]) -> None:
    r_p, r_d = rings
    rng = np.random.default_rng(20261206 + r_p)
    src, src_mem = hybrid_side(r_p, pad=4, seed=r_p * 10 + r_d)
    dst, dst_mem = hybrid_side(r_d)
    t = kvplan.Template(src, dst)
    for n in (1, 3, 7, 12):
        for s, d in ((0, 2), (2, 1)):
            sp, dp = _pages(rng, n), _pages(rng, n)
            for skip in (0, n // 2):
                request = kvplan.Request(sp, dp, n_tokens=n, skip_tokens=skip, slot=(s, d))
                plan = t.plan(request)
                got, want = dst_mem.copy(), dst_mem.copy()
                written = np.zeros(got.data.size, dtype=bool)
                apply_plan(plan, src_mem, got, written)
                moved = reference_copy(src, src_mem, dst, want, sp, dp, n_tokens=n,
                                       skip_tokens=skip, src_slot=s, dst_slot=d)
                moved += reference_ring_copy(src, src_mem, dst, want, s, d, n)
                case = (r_p, r_d, n, s, d, skip)
                assert np.array_equal(got.data, want.data), case
                assert plan.total_bytes == moved == (
                    2 * (n - skip) * TOKEN + 2 * SLOT + 2 * min(r_p, r_d, n) * ROW), case
                # Byte for byte the page request's plan, then the slot request's.
                pages = t.plan(kvplan.Request(sp, dp, n_tokens=n, skip_tokens=skip))
                state = t.plan(kvplan.Request(slot=(s, d), n_tokens=n))
                assert _columns(plan) == [a + b for a, b in zip(_columns(pages),
                                                                _columns(state))], case
                at = pages.n_blocks
                assert plan.pair_offsets.tolist() == (
                    pages.pair_offsets.tolist() + [at + o for o in state.pair_offsets[1:]])
                assert plan.n_runs == pages.n_runs + state.n_runs
                assert t.n_blocks_for(request) == plan.n_blocks


def test_without_n_tokens_a_request_moves_whole_pages_then_its_slots() -> None:
    src, src_mem = hybrid_side(3, seed=5)
    dst, dst_mem = hybrid_side(5)
    t = kvplan.Template(src, dst)
    sp, dp = np.array([3, 4, 9], dtype=np.int64), np.array([0, 7, 8], dtype=np.int64)
    plan = t.plan(kvplan.Request(sp, dp, slot=(1, 0)))
    want = dst_mem.copy()
    got = dst_mem.copy()
    apply_plan(plan, src_mem, got, np.zeros(got.data.size, dtype=bool))
    moved = reference_copy(src, src_mem, dst, want, sp, dp, src_slot=1, dst_slot=0)
    assert np.array_equal(got.data, want.data)
    assert plan.total_bytes == moved == 2 * 3 * TOKEN + 2 * SLOT  # no ring positions given
    assert plan.as_lists()[2][-2:] == [SLOT, SLOT]


def test_a_request_with_window_pages_and_a_slot_is_its_tokens_then_its_slots() -> None:
    """A window pool of its own beside the state: the window pages travel in the same value."""
    def side(base_seed: int | None) -> tuple[kvplan.Layout, Memory]:
        arena = np.zeros(2 * PAGES * TOKEN * 4 + SLOTS * SLOT + 64, dtype=np.uint8)
        if base_seed is not None:
            arena[:] = np.random.default_rng(base_seed).integers(1, 255, arena.size,
                                                                 dtype=np.uint8)
        base = int(arena.ctypes.data)
        full, win = PAGES * TOKEN * 2, PAGES * TOKEN * 4
        layout = kvplan.Layout([base, base + full], [full, win], [2 * TOKEN, 4 * TOKEN],
                               [0, 1], ["kv"] * 2, page_size=2)
        layout = layout.with_windows([None, 5], window_page_size=4)
        at = base + full + win
        layout = layout.with_state("mamba", [at], [SLOTS * SLOT], SLOT, [2])
        return layout, Memory(arena, base)

    (src, src_mem), (dst, dst_mem) = side(11), side(None)
    t = kvplan.Template(src, dst)
    rng = np.random.default_rng(7)
    for n in (3, 9, 13):
        sp, dp = _pages(rng, -(-n // 2)), _pages(rng, -(-n // 2))
        sw, dw = _pages(rng, -(-n // 4)), _pages(rng, -(-n // 4))
        request = kvplan.Request(sp, dp, window_pages=(sw, dw), n_tokens=n, slot=(2, 0))
        plan = t.plan(request)
        got, want = dst_mem.copy(), dst_mem.copy()
        apply_plan(plan, src_mem, got, np.zeros(got.data.size, dtype=bool))
        moved = reference_copy(src, src_mem, dst, want, sp, dp, n_tokens=n,
                               window_pages=(sw, dw), src_slot=2, dst_slot=0)
        assert np.array_equal(got.data, want.data), n
        assert plan.total_bytes == moved
        tokens = t.plan(kvplan.Request(sp, dp, window_pages=(sw, dw), n_tokens=n))
        assert list(plan.as_lists()) == [a + b for a, b in zip(tokens.as_lists(),
                                                         t.plan_state(2, 0).as_lists())]


def test_plan_batch_of_combined_requests_holds_each_ones_own_plan() -> None:
    src, _ = hybrid_side(3, seed=2)
    dst, _ = hybrid_side(5)
    t = kvplan.Template(src, dst)
    rng = np.random.default_rng(99)
    dst_all = rng.permutation(PAGES).astype(np.int64)
    requests = [
        kvplan.Request(_pages(rng, 4), dst_all[0:4], n_tokens=3, slot=(0, 2)),
        kvplan.Request(_pages(rng, 4), dst_all[4:8], slot=(1, 0)),
        kvplan.Request(_pages(rng, 4), dst_all[8:12]),
        kvplan.Request(_pages(rng, 4), dst_all[12:16], n_tokens=4, slot=(2, 1)),
    ]
    batch = t.plan_batch(requests)
    lists = batch.as_lists()
    for r, request in enumerate(requests):
        single = t.plan(request).as_lists()
        blocks = batch.request_blocks(r)
        assert [column[blocks] for column in lists] == list(single), r
    assert batch.total_bytes == sum(t.plan(r).total_bytes for r in requests)
    # Two requests writing one decode slot are refused, naming both.
    clash = [requests[0], kvplan.Request(_pages(rng, 2), dst_all[4:6], slot=(1, 2))]
    with pytest.raises(kvplan.KvPlanError, match="state slot 2") as e:
        t.plan_batch(clash)
    assert e.value.kind == "requests_overlap"


def test_bad_slots_on_a_combined_request_are_refused_naming_the_values() -> None:
    src, _ = hybrid_side(3)
    dst, _ = hybrid_side(5)
    t = kvplan.Template(src, dst)
    a = np.array([0, 1], dtype=np.int64)
    with pytest.raises(kvplan.IndexBoundsError, match=r"slot\[0\] must be non-negative, got -1"):
        kvplan.Request(a, a, slot=(-1, 0))
    with pytest.raises(kvplan.IndexBoundsError, match=rf"\b{SLOTS}\b") as e:
        t.plan(kvplan.Request(a, a, slot=(0, SLOTS)))
    assert "dst" in str(e.value) or "decode" in str(e.value)
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan_batch([kvplan.Request(a, a, slot=(SLOTS, 0))])
    plain, _ = hybrid_side(None, state=False)
    pages_only = kvplan.Template(plain, plain)
    with pytest.raises(kvplan.KvPlanError, match=r"state slot \(1, 2\).*pairs no state") as g:
        pages_only.plan(kvplan.Request(a, a, slot=(1, 2)))
    assert g.value.kind == "geometry"


def _run_staged(staged: kvplan.StagedPlan, src_mem: Memory, got: Memory, written: np.ndarray,
                staging: tuple[np.ndarray, np.ndarray]) -> None:
    """Runs a staged plan's gather, network and scatter through host staging buffers (only
    the bytes the plan says it uses)."""
    src_st = Memory(staging[0][:staged.src_staging_bytes], int(staging[0].ctypes.data))
    dst_st = Memory(staging[1][:staged.dst_staging_bytes], int(staging[1].ctypes.data))
    apply_plan(staged.gather, src_mem, src_st, np.zeros(src_st.data.size, dtype=bool))
    apply_plan(staged.network, src_st, dst_st, np.zeros(dst_st.data.size, dtype=bool))
    apply_plan(staged.scatter, dst_st, got, written)


def _run_rounds(rounds: kvplan.StagedRounds, src_mem: Memory, got: Memory, written: np.ndarray,
                arenas: tuple[np.ndarray, np.ndarray]) -> None:
    """Runs every round through its round buffers, each block inside its own buffer."""
    src_arena, dst_arena = arenas
    src_at, dst_at = Memory(src_arena, int(src_arena.ctypes.data)), Memory(
        dst_arena, int(dst_arena.ctypes.data))
    src_buffer = src_arena.size // rounds.buffers
    offset = 0
    for k, one in enumerate(rounds):
        m = one.manifest
        assert (m.index, m.n_rounds, m.offset) == (k, len(rounds), offset)
        assert 0 < m.bytes <= rounds.buffer_bytes
        offset += m.bytes
        lo = src_at.base + m.buffer * src_buffer
        assert int(one.gather.dst_addrs.min()) >= lo
        assert int((one.gather.dst_addrs + one.gather.lengths).max()) <= lo + m.bytes
        start, end = m.dst_bytes_range
        assert rounds.dst_share[0] <= start and end <= rounds.dst_share[1]
        assert int(one.scatter.src_addrs.min()) >= dst_at.base + start
        assert int((one.scatter.src_addrs + one.scatter.lengths).max()) <= dst_at.base + end
        apply_plan(one.gather, src_mem, src_at)
        apply_plan(one.network, src_at, dst_at)
        apply_plan(one.scatter, dst_at, got, written)
    assert offset == rounds.bytes


@pytest.mark.parametrize("rings", [(2, 5), (6, 3)])
def test_staged_plans_and_rounds_move_a_hybrid_request_as_its_direct_plan(
        rings: tuple[int, int]) -> None:
    """A request with pages and a state slot (and its slot request alone, ring rows and all)
    is planned staged and in rounds; run on host memory through staging buffers, each writes
    the decode's bytes exactly as the direct plan does, every byte once."""
    r_p, r_d = rings
    rng = np.random.default_rng(20261207 + r_p)
    src, src_mem = hybrid_side(r_p, pad=4, seed=r_p * 7 + r_d)
    dst, dst_mem = hybrid_side(r_d)
    t = kvplan.Template(src, dst)
    for n in (1, 5, 12):
        sp, dp = _pages(rng, n), _pages(rng, n)
        s, d = int(rng.integers(SLOTS)), int(rng.integers(SLOTS))
        for request in (kvplan.Request(sp, dp, slot=(s, d)),
                        kvplan.Request(sp, dp, n_tokens=n, slot=(s, d)),
                        kvplan.Request(slot=(s, d), n_tokens=n)):
            direct = t.plan(request)
            want = dst_mem.copy()
            apply_plan(direct, src_mem, want, np.zeros(want.data.size, dtype=bool))
            staging = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
            staged = t.plan_staged(request, src_staging=(int(staging[0].ctypes.data), 4096),
                                   dst_staging=(int(staging[1].ctypes.data), 4096))
            assert staged.src_staging_bytes == direct.total_bytes
            got, written = dst_mem.copy(), np.zeros(dst_mem.data.size, dtype=bool)
            _run_staged(staged, src_mem, got, written, staging)
            case = (r_p, r_d, n, s, d, request)
            assert np.array_equal(got.data, want.data), case
            # Rounds of a few bytes, of about a third of the request, and one round.
            for size in (7, direct.total_bytes // 3 + 1, direct.total_bytes + 1):
                src_arena, dst_arena = np.zeros(2 * size, np.uint8), np.zeros(2 * size, np.uint8)
                rounds = t.plan_rounds(
                    request, src_arena=(int(src_arena.ctypes.data), src_arena.size),
                    dst_arena=(int(dst_arena.ctypes.data), dst_arena.size), buffers=2)
                assert rounds.bytes == direct.total_bytes
                assert len(rounds) == -(-direct.total_bytes // size)
                got, written = dst_mem.copy(), np.zeros(dst_mem.data.size, dtype=bool)
                _run_rounds(rounds, src_mem, got, written, (src_arena, dst_arena))
                assert np.array_equal(got.data, want.data), (case, size)


def test_planners_that_plan_pages_or_a_slot_refuse_both_by_name() -> None:
    src, _ = hybrid_side(4)
    dst, _ = hybrid_side(4)
    t = kvplan.Template(src, dst)
    a = np.array([0, 1], dtype=np.int64)
    request = kvplan.Request(a, a, slot=(1, 2))
    # A staged plan takes the request whole; a delta request it still refuses.
    delta = kvplan.Request(a, a, n_tokens=2, skip_tokens=1, slot=(1, 2))
    with pytest.raises(kvplan.UnsupportedError) as e:
        t.plan_staged(delta, src_staging=(1 << 40, 1 << 20), dst_staging=(1 << 41, 1 << 20))
    assert (e.value.planner, e.value.feature) == ("plan_staged", "delta")
    with pytest.raises(kvplan.UnsupportedError) as p:
        t.plan_packed(request, pack=(1 << 40, 1 << 20))
    assert (p.value.planner, p.value.feature) == ("plan_packed", "pages_with_state")
    assert kvplan.capabilities.supports("plan", "pages_with_state")
    assert kvplan.capabilities.supports("plan_batch", "pages_with_state")
    # The slot methods keep planning slots only.
    with pytest.raises(TypeError, match="plan_state plans a state slot"):
        t.plan_state(request)


def test_a_conversion_plan_refuses_a_request_with_a_state_slot() -> None:
    """Conversion widens page and token entries only: a hybrid request's slot is refused by
    name there, never planned past the scale layouts; its pages alone still convert."""
    ctx = dict(page_size=2, kv_heads=2, head_dim=4)
    src = kvplan.Layout([1 << 20], [64], [32], [0], ["k"], dtype_size=2, **ctx)
    src = src.with_representations(["bf16"]).with_state("mamba", [1 << 24], [64], 16, [0])
    dst = kvplan.Layout([1 << 30, 1 << 31], [32, 16], [16, 8], [0, 0], ["k", "k_scale"],
                        dtype_size=1, **ctx).with_representations(["fp8_e4m3:per_token", None])
    dst = dst.with_state("mamba", [1 << 25], [64], 16, [0])
    t = kvplan.ConversionTemplate(src, dst)
    a, b = np.array([0], dtype=np.int64), np.array([1], dtype=np.int64)
    with pytest.raises(kvplan.UnsupportedError) as e:
        t.plan(kvplan.Request(a, b, slot=(1, 2)), staging=(1 << 40, 4096))
    assert (e.value.planner, e.value.feature) == ("ConversionTemplate.plan", "pages_with_state")
    assert "state slot (1, 2)" in str(e.value)
    assert t.plan(kvplan.Request(a, b), staging=(1 << 40, 4096)).network_bytes > 0
