"""A state slot request that gives the positions it has processed (``Request(slot=(s, d),
n_tokens=n)``) plans its whole state in one plan: one block per plain state pair, then the ring
rows both rings hold (the last ``min(R_prefill, R_decode, n)`` positions). Checked against the
byte oracle (``reference_copy`` for the slot, ``reference_ring_copy`` for the rings) and against
``plan_ring``, which is that request's ring rows alone."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.testing.oracle import Memory, apply_plan, reference_copy, reference_ring_copy

ROW = 12  # bytes per ring row
SLOT = 20  # bytes of a plain state slot
SLOTS = 3


def hybrid_side(rows: int, *, pad: int = 0, seed: int | None = None,
                rings: bool = True) -> tuple[kvplan.Layout, Memory]:
    """Two layers, each a small KV page entry, a plain state entry (one slot of ``SLOT``
    bytes per request) and a ring-state entry of ``rows`` rows per request, in one arena."""
    layers = [0, 1]
    stride = ROW + pad
    kv_bytes, slot_bytes, ring_bytes = 4 * 16, SLOTS * SLOT, SLOTS * rows * stride
    arena = np.zeros(2 * (kv_bytes + slot_bytes + ring_bytes) + 64, dtype=np.uint8)
    if seed is not None:
        arena[:] = np.random.default_rng(seed).integers(1, 255, arena.size, dtype=np.uint8)
    base = int(arena.ctypes.data)
    layout = kvplan.Layout([base + i * kv_bytes for i in layers], [kv_bytes] * 2, 16, layers,
                           ["kv"] * 2, page_size=1)
    at = base + 2 * kv_bytes
    layout = layout.with_state("mamba", [at + i * slot_bytes for i in layers], [slot_bytes] * 2,
                               SLOT, layers)
    at += 2 * slot_bytes
    layout = layout.with_state("ring", [at + i * ring_bytes for i in layers], [ring_bytes] * 2,
                               ROW, layers, strides=stride)
    ring = rows if rings else None
    layout = layout.with_rings([None] * 4 + [ring, ring])
    return layout, Memory(arena, base)


@pytest.mark.parametrize("pads", [(0, 0), (4, 0)])
def test_a_slot_request_with_positions_moves_its_slots_and_its_ring_rows(
        pads: tuple[int, int]) -> None:
    for r_p, r_d in [(2, 5), (4, 4), (6, 3)]:
        src, src_mem = hybrid_side(r_p, pad=pads[0], seed=r_p * 10 + r_d)
        dst, dst_mem = hybrid_side(r_d, pad=pads[1])
        t = kvplan.Template(src, dst)
        for n in range(0, 2 * max(r_p, r_d) + 2):
            for s, d in ((0, 2), (2, 1)):
                request = kvplan.Request(slot=(s, d), n_tokens=n)
                plan = t.plan(request)
                got, want = dst_mem.copy(), dst_mem.copy()
                written = np.zeros(got.data.size, dtype=bool)
                apply_plan(plan, src_mem, got, written)
                slot_bytes = reference_copy(src, src_mem, dst, want, [], [], n_tokens=0,
                                            src_slot=s, dst_slot=d)
                ring_bytes = reference_ring_copy(src, src_mem, dst, want, s, d, n)
                assert slot_bytes == 2 * SLOT and ring_bytes == 2 * min(r_p, r_d, n) * ROW
                assert plan.total_bytes == slot_bytes + ring_bytes
                assert np.array_equal(got.data, want.data), (r_p, r_d, n, s, d)
                # The slots' blocks, then exactly plan_ring's blocks; one range per pair.
                state, ring = t.plan_state(s, d), t.plan_ring(s, d, n)
                for column in ("src_addrs", "dst_addrs", "lengths"):
                    assert getattr(plan, column).tolist() == (
                        getattr(state, column).tolist() + getattr(ring, column).tolist())
                assert plan.pair_offsets.tolist() == (
                    state.pair_offsets.tolist() + [2 + o for o in ring.pair_offsets[1:]])
                assert plan.n_runs == 1 + ring.n_runs
                # plan_state takes the same request.
                assert t.plan_state(request).as_lists() == plan.as_lists()


def test_without_positions_a_slot_request_still_moves_its_slots_only() -> None:
    src, _ = hybrid_side(3, seed=1)
    dst, _ = hybrid_side(5)
    t = kvplan.Template(src, dst)
    plan = t.plan(kvplan.Request(slot=(1, 0)))
    assert plan.lengths.tolist() == [SLOT, SLOT]
    assert plan.as_lists() == t.plan_state(1, 0).as_lists()


def test_positions_on_a_template_without_rings_are_refused_naming_the_count() -> None:
    plain, _ = hybrid_side(3, rings=False)
    t = kvplan.Template(plain, plain)
    with pytest.raises(kvplan.KvPlanError, match=r"no ring-state pairs.*got n_tokens 7") as e:
        t.plan(kvplan.Request(slot=(0, 0), n_tokens=7))
    assert e.value.kind == "geometry"


def test_a_ring_slot_past_its_buffer_is_an_index_error_in_the_one_request() -> None:
    src, _ = hybrid_side(3)
    dst, _ = hybrid_side(5)
    t = kvplan.Template(src, dst)
    t.plan(kvplan.Request(slot=(SLOTS - 1, SLOTS - 1), n_tokens=9))
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan(kvplan.Request(slot=(0, SLOTS), n_tokens=9))


def test_planners_that_do_not_plan_ring_rows_refuse_them_by_name() -> None:
    src, _ = hybrid_side(3)
    dst, _ = hybrid_side(5)
    t = kvplan.Template(src, dst)
    request = kvplan.Request(slot=(1, 2), n_tokens=9)
    with pytest.raises(kvplan.UnsupportedError) as e:
        t.plan_batch([request])
    assert (e.value.planner, e.value.feature) == ("plan_batch", "ring")
    assert "n_tokens 9" in str(e.value)
    # Without positions the batch plans the slot, as before.
    assert t.plan_batch([kvplan.Request(slot=(1, 2))]).n_blocks == 2


def test_layer_slices_send_ring_rows_with_the_seal() -> None:
    src, _ = hybrid_side(3)
    dst, _ = hybrid_side(5)
    t = kvplan.Template(src, dst)
    plan = t.plan(kvplan.Request(slot=(1, 2), n_tokens=4))
    cut = t.layer_slices(kvplan.LayerGroups.every_layer()).of(plan)
    covered = sorted(k for ranges in cut.ranges for a, b in ranges for k in range(a, b))
    seal = [k for a, b in cut.seal_ranges for k in range(a, b)]
    assert sorted(covered + seal) == list(range(plan.n_blocks))
    assert seal == list(range(2, plan.n_blocks))
    assert sum(w[2] for w in cut.work) + cut.seal_work[1] == plan.total_bytes
