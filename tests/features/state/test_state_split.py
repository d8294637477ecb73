"""State entries with a TP channel split (``Layout.with_state(channels=, outer_rows=,
shard_groups=)``) against the byte oracle: random hybrid layouts (KV pages beside temporal
states of one sub-block, GDN conv states of three sub-blocks ``q|k|v`` of different sizes,
Kimi-like conv states of several rows, replicated states of 0 channels), every TP pair of
{1, 2, 4, 8}² and every prefill rank × decode rank. The decode memory a plan of one hybrid
request (pages and a slot) writes equals the oracle's byte for byte, and the prefill ranks
together write every byte of the decode rank's pages and slot exactly once (a replicated slot:
once per decode rank, from one prefill rank). The default run draws a few hundred seeded cases;
``KVPLAN_STATE_SPLIT_EXAMPLES`` raises the count."""

from __future__ import annotations

import os
import re
import random
from dataclasses import dataclass

import numpy as np
import pytest

import kvplan
from kvplan.testing.oracle import Memory, apply_plan, reference_copy, split_channels

EXAMPLES = int(os.environ.get("KVPLAN_STATE_SPLIT_EXAMPLES", "300"))
TPS = (1, 2, 4, 8)
SLOTS = 3
HEAD_DIM, DTYPE = 4, 2


@dataclass(frozen=True)
class State:
    """One state tensor of the model: its sub-blocks (model channel counts, ``[]`` for one
    sub-block of ``total``), rows, bytes per channel and slot padding."""

    role: str
    layer: int
    total: int  # model channels (0: a replicated slot)
    groups: tuple[int, ...]
    rows: int
    width: int  # bytes per channel, or the replicated slot's bytes
    pad: int  # bytes between slots beyond the item

    def channels(self, tp: int) -> int:
        return self.total // tp

    def item_len(self, tp: int) -> int:
        return self.width if self.total == 0 else self.rows * self.channels(tp) * self.width


@dataclass(frozen=True)
class Case:
    tp_p: int
    tp_d: int
    kv_heads: int | None  # None: a state-only model
    page: int
    tokens: int
    n_tokens: int | None
    states: tuple[State, ...]
    slots: tuple[int, int]
    seed: int


def random_state(rng: random.Random, role: str, layer: int) -> State:
    kind = rng.choice(["temporal", "gdn_conv", "kimi_conv", "replicated"])
    pad = rng.choice([0, 0, 8])
    if kind == "temporal":  # one sub-block, one row
        return State(role, layer, 8 * rng.randint(1, 4), (), 1, 2 * rng.randint(1, 16), pad)
    if kind == "gdn_conv":  # q | k | v, the value block larger, K - 1 rows
        key, value = 8 * rng.randint(1, 3), 8 * rng.randint(2, 5)
        return State(role, layer, 2 * key + value, (key, key, value), rng.randint(1, 3),
                     2 * rng.randint(1, 3), pad)
    if kind == "kimi_conv":  # [K - 1, channels], sometimes two sub-blocks
        total = 16 * rng.randint(1, 3)
        groups = (total // 2, total // 2) if rng.random() < 0.4 else ()
        return State(role, layer, total, groups, rng.randint(2, 4), 2 * rng.randint(1, 2), pad)
    return State(role, layer, 0, (), 1, 2 * rng.randint(1, 24), pad)


def random_case(rng: random.Random) -> Case:
    states = tuple(random_state(rng, rng.choice(["conv", "temporal"]), 10 + i)
                   for i in range(rng.randint(1, 3)))
    kv_heads = rng.choice([None, 1, 2, 4, 8, 16])
    page = rng.choice([1, 2, 4])
    tokens = page * rng.randint(1, 4)
    n_tokens = rng.choice([None, rng.randint(1, tokens)]) if kv_heads else None
    return Case(rng.choice(TPS), rng.choice(TPS), kv_heads, page, tokens, n_tokens, states,
                (rng.randrange(SLOTS), rng.randrange(SLOTS)), rng.randrange(1 << 30))


class Rank:
    """One rank's layout over one arena: two KV layers of ``capacity`` pages (when the model
    has attention), then each state entry's ``SLOTS`` slots; random bytes with ``fill``."""

    def __init__(self, case: Case, tp: int, rank: int, *, fill: bool, capacity: int) -> None:
        heads = 0 if case.kv_heads is None else max(1, case.kv_heads // tp)
        item = case.page * heads * HEAD_DIM * DTYPE
        sizes = [item * capacity] * (2 if heads else 0) + [
            SLOTS * (s.item_len(tp) + s.pad) for s in case.states]
        self.arena = np.zeros(sum(sizes) + 16, np.uint8)
        if fill:
            seed = case.seed * 131 + tp * 17 + rank
            self.arena[:] = np.random.default_rng(seed).integers(0, 256, self.arena.size,
                                                                 dtype=np.uint8)
        base = int(self.arena.ctypes.data)
        self.memory = Memory(self.arena, base)
        at, self.page_items = base, []
        if heads:
            ptrs = [base, base + sizes[0]]
            self.page_items = [(p, item) for p in ptrs]
            layout = kvplan.Layout(ptrs, sizes[:2], item, [0, 1], ["kv", "kv"],
                                   page_size=case.page, tp_size=tp, tp_rank=rank,
                                   kv_heads=case.kv_heads, head_dim=HEAD_DIM, dtype_size=DTYPE)
            at += 2 * sizes[0]
        else:
            layout = kvplan.Layout([], [], [], tp_size=tp, tp_rank=rank)
        self.slot_items = []
        for s, size in zip(case.states, sizes[len(sizes) - len(case.states):]):
            stride = s.item_len(tp) + s.pad
            layout = layout.with_state(
                s.role, [at], [size], [s.item_len(tp)], [s.layer], strides=stride,
                channels=s.channels(tp), outer_rows=s.rows, shard_groups=[list(s.groups) or None])
            self.slot_items.append((at, stride, s.item_len(tp)))
            at += size
        self.layout = layout


def check_case(case: Case) -> int:
    """Plans the case's request for every prefill rank × decode rank and checks every decode
    rank's memory against the oracle and for exactly-once coverage. Returns the pairs planned."""
    capacity = case.tokens // case.page + 2
    rng = np.random.default_rng(case.seed)
    src_pages = rng.permutation(capacity)[:case.tokens // case.page].astype(np.int64)
    dst_pages = rng.permutation(capacity)[:case.tokens // case.page].astype(np.int64)
    prefill = [Rank(case, case.tp_p, r, fill=True, capacity=capacity)
               for r in range(case.tp_p)]
    s_slot, d_slot = case.slots
    pages = case.kv_heads is not None
    request = kvplan.Request(src_pages, dst_pages, slot=case.slots, n_tokens=case.n_tokens) \
        if pages else kvplan.Request(slot=case.slots)
    planned = 0
    for r_d in range(case.tp_d):
        decode = Rank(case, case.tp_d, r_d, fill=False, capacity=capacity)
        got, want = decode.memory.copy(), decode.memory.copy()
        written = np.zeros(got.data.size, dtype=bool)
        for src in prefill:
            plan = kvplan.Template(src.layout, decode.layout).plan(request)
            apply_plan(plan, src.memory, got, written)  # a byte written twice fails here
            moved = reference_copy(
                src.layout, src.memory, decode.layout, want,
                src_pages if pages else [], dst_pages if pages else [],
                n_tokens=case.n_tokens, src_slot=s_slot, dst_slot=d_slot)
            assert plan.total_bytes == moved, (case, src.layout.tp_rank, r_d)
            planned += 1
        assert np.array_equal(got.data, want.data), (case, r_d)
        base = decode.memory.base
        for at, stride, item in decode.slot_items:
            lo = at - base + d_slot * stride
            assert written[lo:lo + item].all(), (case, r_d, "slot")
        if pages:
            n = case.tokens if case.n_tokens is None else case.n_tokens
            full = n // case.page
            for at, item in decode.page_items:
                for p in dst_pages[:full]:
                    lo = at - base + int(p) * item
                    assert written[lo:lo + item].all(), (case, r_d, "page", int(p))
    return planned


def test_split_states_match_the_oracle_on_random_hybrid_cases() -> None:
    rng = random.Random(20261207)
    planned = 0
    kinds: set[tuple[bool, int, bool]] = set()
    for _ in range(EXAMPLES):
        case = random_case(rng)
        planned += check_case(case)
        kinds.update((case.kv_heads is not None, len(s.groups), s.rows > 1)
                     for s in case.states)
    assert planned >= 3 * EXAMPLES
    if EXAMPLES >= 300:  # every kind of state met, with and without pages
        assert {(p, g) for p, g, _ in kinds} >= {(p, g) for p in (False, True)
                                                 for g in (0, 2, 3)}


def test_a_gdn_conv_state_between_tp_2_and_4_by_hand() -> None:
    """The oracle's channels written out: sub-blocks q|k|v of 8, 8, 16 channels; prefill rank 1
    of 2 holds q 4..8, k 12..16, v 24..32; decode rank 2 of 4 holds q 4..6, k 12..14, v 24..28,
    all of them in prefill rank 1's row at 0..2, 4..6, 8..12."""
    groups = [8, 8, 16]
    assert split_channels((16, 1, groups), 2, 1) == [*range(4, 8), *range(12, 16),
                                                     *range(24, 32)]
    assert split_channels((8, 1, groups), 4, 2) == [4, 5, 12, 13, 24, 25, 26, 27]
    state = State("conv", 10, 32, tuple(groups), 2, 2, 0)
    case = Case(2, 4, None, 1, 1, None, (state,), (1, 0), 7)
    assert check_case(case) == 8
    src = Rank(case, 2, 1, fill=True, capacity=1)
    dst = Rank(case, 4, 2, fill=False, capacity=1)
    plan = kvplan.Template(src.layout, dst.layout).plan(kvplan.Request(slot=(1, 0)))
    got = dst.memory.copy()
    apply_plan(plan, src.memory, got)
    at, stride, item = src.slot_items[0]
    s_row = src.arena[at - src.memory.base + stride:][:item]  # slot 1: 2 rows of 16 channels
    d_row = got.data[:2 * 8 * 2]  # slot 0: 2 rows of 8 channels
    for row in range(2):
        for d_at, s_at in zip(range(8), [0, 1, 4, 5, 8, 9, 10, 11]):
            assert bytes(d_row[(row * 8 + d_at) * 2:][:2]) == \
                bytes(s_row[(row * 16 + s_at) * 2:][:2])


@pytest.mark.parametrize("change", ["groups", "rows", "width", "replicated"])
def test_sides_describing_different_channels_are_refused_by_both(change: str) -> None:
    """A pair whose two sides describe different channels: the planner refuses it with a typed
    error, and the oracle has no answer for it either (it does not guess)."""
    state = State("conv", 10, 32, (8, 8, 16), 2, 2, 0)
    other = {"groups": State("conv", 10, 32, (16, 16), 2, 2, 0),
             "rows": State("conv", 10, 32, (8, 8, 16), 1, 4, 0),
             "width": State("conv", 10, 32, (8, 8, 16), 2, 4, 0),
             "replicated": State("conv", 10, 0, (), 1, 64, 0)}[change]
    src = Rank(Case(2, 2, None, 1, 1, None, (state,), (0, 0), 1), 2, 0, fill=True, capacity=1)
    dst = Rank(Case(2, 2, None, 1, 1, None, (other,), (0, 0), 1), 2, 0, fill=False,
               capacity=1)
    with pytest.raises(kvplan.KvPlanError, match="conv"):
        kvplan.Template(src.layout, dst.layout).plan(kvplan.Request(slot=(0, 0)))
    with pytest.raises(ValueError, match="conv"):
        reference_copy(src.layout, src.memory, dst.layout, dst.memory.copy(), [], [],
                       src_slot=0, dst_slot=0)


def test_a_split_layout_round_trips_through_its_json_form() -> None:
    """A layout's dict form read back from JSON (``kvplan explain --prefill FILE``) is the same
    layout, its state channel splits included."""
    import json

    state = State("conv", 10, 32, (8, 8, 16), 2, 2, 0)
    layout = Rank(Case(2, 2, 4, 1, 1, None, (state,), (0, 0), 1), 2, 1, fill=False,
                  capacity=1).layout
    assert kvplan.Layout.from_dict(layout.to_dict()) == layout  # tuples: read back
    assert kvplan.Layout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout



@pytest.mark.parametrize(("channels", "rows", "groups", "words"), [
    ([4, 8, 2], [1, 0, 1], None, r"a state channel split needs at least 1 outer row, got 0"),
    ([4, 0, 2], None, [None, [4], None], r"a replicated state .* has no shard groups"),
    ([4, 2, 2], None, [None, [1, 0], None], r"shard groups must be positive"),
    ([4, 2, 2], None, [None, [1, 1, 1, 1, 1], None], r"a state channel split has at most 4 .* got 5"),
])
def test_a_refused_split_names_its_entry_and_values(
        channels: list[int], rows: list[int] | None, groups: list[list[int] | None] | None,
        words: str) -> None:
    """``with_state``'s refusal of one entry's split names the layout entry (after the two
    page entries: entry 3), the argument's position and its values, as the C ABI's does."""
    base = kvplan.Layout([0x1000, 0x2000], [640, 640], 64, [0, 1])
    c, r = channels[1], 1 if rows is None else rows[1]
    g = "None" if groups is None or groups[1] is None else re.escape(str(groups[1]))
    with pytest.raises(kvplan.LayoutError,
                       match=rf"^entry 3 \(channels\[1\] = {c}, outer_rows\[1\] = {r}, "
                             rf"shard_groups\[1\] = {g}\): {words}") as caught:
        base.with_state("conv", [0x9000, 0xA000, 0xB000], [640] * 3, 64, [0, 1, 2],
                        channels=channels, outer_rows=rows, shard_groups=groups)
    assert caught.value.kind == "layout"
