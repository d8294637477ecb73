"""Ring-state entries (``Layout.with_rings``): per request slot a ring of R rows, position ``p``
in row ``slot * R + p % R``. ``Template.plan_ring`` moves the positions both rings hold, each
from its prefill row to its decode row, between rings of different sizes. Checked against the
byte oracle (``reference_ring_copy``, written from that definition) for every (R_prefill,
R_decode, positions) of a sweep, packed and padded rows, TP-sharded rows, and the rules."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvplan
from kvplan.testing.oracle import Memory, apply_plan, reference_copy, reference_ring_copy
from kvplan.testing.ranks import Model, Rank, rank_memory

ROW = 12  # bytes per ring row


def ring_side(rows: int, slots: int, *, pad: int = 0, seed: int | None = None,
              tp: tuple[int, int] = (0, 1), layers: int = 2, with_kv: bool = True
              ) -> tuple[kvplan.Layout, Memory]:
    """A peer with a small KV page entry per layer and a ring-state entry per layer of
    ``rows`` rows per slot (``ROW / tp_size`` bytes each, sharded over TP), in one arena."""
    row = ROW // tp[1]
    stride = row + pad
    kv_bytes = layers * 4 * 16
    ring_bytes = layers * slots * rows * stride
    arena = np.zeros(kv_bytes + ring_bytes + 64, dtype=np.uint8)
    if seed is not None:
        arena[:] = np.random.default_rng(seed).integers(1, 255, arena.size, dtype=np.uint8)
    base = int(arena.ctypes.data)
    ids = list(range(layers))
    layout = kvplan.Layout([base + i * 64 for i in ids], [64] * layers, 16, ids, ["kv"] * layers,
                           page_size=1, tp_rank=tp[0], tp_size=tp[1])
    at = base + kv_bytes
    span = slots * rows * stride
    layout = layout.with_state("ring", [at + i * span for i in ids], [span] * layers, row, ids,
                               strides=stride)
    layout = layout.with_rings([None] * layers + [rows] * layers)
    return layout, Memory(arena, base)


@pytest.mark.parametrize("pads", [(0, 0), (4, 0), (0, 4)])
def test_every_ring_size_pair_and_position_count_moves_the_live_rows(pads: tuple[int, int]
                                                                     ) -> None:
    for r_p in range(1, 6):
        for r_d in range(1, 7):
            src, src_mem = ring_side(r_p, 3, pad=pads[0], seed=r_p * 10 + r_d)
            dst, dst_mem = ring_side(r_d, 3, pad=pads[1])
            t = kvplan.Template(src, dst)
            for n in range(0, 2 * max(r_p, r_d) + 3):
                for slots in ((0, 2), (2, 1)):
                    got, want = dst_mem.copy(), dst_mem.copy()
                    written = np.zeros(got.data.size, dtype=bool)
                    plan = t.plan_ring(*slots, n)
                    apply_plan(plan, src_mem, got, written)
                    moved = reference_ring_copy(src, src_mem, dst, want, *slots, n)
                    assert plan.total_bytes == moved == 2 * min(r_p, r_d, n) * ROW
                    assert np.array_equal(got.data, want.data), (r_p, r_d, n, slots)
                    # Blocks: one per run of positions neither ring wraps in (packed rows).
                    live = range(n - min(r_p, r_d, n), n)
                    if pads == (0, 0):
                        cuts = sum(1 for p in live[1:] if p % r_p == 0 or p % r_d == 0)
                        assert len(plan) == 2 * (len(live) > 0) * (1 + cuts)
                    else:
                        assert len(plan) == 2 * len(live)


def test_sharded_ring_rows_between_tp_sizes() -> None:
    model = Model(layers=2, kv_heads=4, head_dim=2, dtype_size=2, state_bytes=ROW * 4)

    def side(rank: Rank, rows: int, seed: int | None = None) -> tuple[kvplan.Layout, Memory]:
        mem = rank_memory(model, rank, seed=seed)
        state = [rows if kind == "state" else None for kind in mem.layout.kinds]
        return mem.layout.with_rings(state), mem.memory

    dst, dst_mem = side(Rank(1, 2, 1, state_slots=8), 4)  # two slots of four rows
    got, want = dst_mem.copy(), dst_mem.copy()
    for r_p in range(4):  # every prefill rank writes its share of the decode rank's rows
        src, src_mem = side(Rank(r_p, 4, 1, state_slots=6), 3, seed=r_p + 1)
        t = kvplan.Template(src, dst)
        apply_plan(t.plan_ring(1, 0, 11), src_mem, got)
        reference_ring_copy(src, src_mem, dst, want, 1, 0, 11)
    assert np.array_equal(got.data, want.data)
    assert (got.data != dst_mem.data).sum() == 2 * 3 * ROW * 4 // 2  # 3 live rows, half of each


def test_a_slot_request_leaves_ring_entries_to_plan_ring() -> None:
    src, src_mem = ring_side(2, 2, seed=3)
    dst, dst_mem = ring_side(4, 2)
    t = kvplan.Template(src, dst)
    assert len(t.plan_state(0, 1)) == 0  # the only state entries are rings
    assert reference_copy(src, src_mem, dst, dst_mem.copy(), [], [], n_tokens=0, src_slot=0,
                          dst_slot=1) == 0


def test_a_ring_paired_with_a_slot_entry_is_refused_naming_both() -> None:
    src, _ = ring_side(2, 2)
    plain = src.with_rings([None] * len(src))
    with pytest.raises(kvplan.KvPlanError, match=r"prefill state entry 2 \(layer 0, role ring\) "
                       r"keeps a ring of 2 rows per request but its decode partner, entry 2, "
                       r"keeps one slot per request") as e:
        kvplan.Template(src, plain)
    assert e.value.kind == "geometry"


def test_ring_values_and_slots_are_checked() -> None:
    src, _ = ring_side(2, 2)
    n = len(src)
    with pytest.raises(kvplan.LayoutError, match="at least 1 row per request, got 0"):
        src.with_rings([None, None, 0, None])
    with pytest.raises(kvplan.LayoutError, match="a ring applies to state entries"):
        src.with_rings([3] + [None] * (n - 1))
    with pytest.raises(kvplan.LayoutError, match="rings"):
        src.with_rings([2])
    with pytest.raises(TypeError, match="rings must be None or a sequence"):
        src.with_rings(["2"] * n)  # type: ignore[list-item]
    dst, _ = ring_side(4, 2)
    t = kvplan.Template(src, dst)
    with pytest.raises(kvplan.IndexBoundsError, match="-1"):
        t.plan_ring(-1, 0, 5)
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan_ring(0, 2, 5)  # the decode holds two slots of four rows
    assert t.plan_ring(1, 1, 5).total_bytes == 2 * 2 * ROW
    plain = ring_side(2, 2)[0].with_rings([None] * n)
    with pytest.raises(kvplan.KvPlanError, match="no ring-state pairs"):
        kvplan.Template(plain, plain).plan_ring(0, 0, 1)


def test_rings_travel_on_the_wire_and_in_the_dict() -> None:
    src, _ = ring_side(3, 2, pad=4)
    assert src.rings == [None, None, 3, 3]
    assert [e.ring for e in src.entries("state")] == [3, 3]
    assert "ring=3" in repr(src.entries("state")[0])
    assert kvplan.Layout.from_bytes(src.to_bytes()) == src
    assert kvplan.Layout.from_dict(json.loads(json.dumps(src.to_dict()))) == src
    plain = src.with_rings([None] * len(src))
    assert "rings" not in plain.to_dict() and plain.to_bytes() != src.to_bytes()
