"""The combined property: what a decode holds after a full plan of a request's first K tokens
and then a delta plan (``skip_tokens=K``) of the whole request is byte-identical to what a full
transfer of the whole request leaves on top of the same first K tokens, and to the oracle's.

One template combines what the other property tests check apart: unaligned K, page sizes 4×
apart (either way), a decode dealt over 8 decode-context-parallel ranks (every rank checked),
a sliding-window layer beside a full-attention layer, and a hybrid state entry. The default run
draws a few hundred cases (deterministic under CI); ``KVPLAN_UNION_EXAMPLES`` raises the count
for an open-ended search (``scripts/fuzz`` with fresh seeds)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.testing.oracle import Memory, apply_plan, dcp_local_token, reference_copy

EXAMPLES = int(os.environ.get("KVPLAN_UNION_EXAMPLES", "300"))
TOKEN = 6  # bytes per token of each layer's MLA row
STATE_ITEM, STATE_SLOTS = 20, 2
DCP = 8


@dataclass(frozen=True)
class Case:
    n_tokens: int
    skip: int
    src_page: int
    dst_page: int
    interleave: int
    window: int
    seed: int


class Peer:
    """One rank: a full-attention layer (0), a window layer (1, ``window`` tokens) and a state
    entry (layer 2), each its own buffer; random bytes with ``fill``, zeros otherwise."""

    def __init__(self, case: Case, *, page: int, tokens: int, dcp_rank: int | None,
                 fill: bool, seed: int) -> None:
        dcp = {} if dcp_rank is None else {"dcp_size": DCP, "dcp_rank": dcp_rank,
                                           "dcp_interleave": case.interleave}
        count = -(-tokens // page)
        # Room for the request and for one window (a window wider than its buffer is refused).
        self.capacity = max(count, -(-case.window // page)) + 3
        rng = np.random.default_rng(seed)
        self.pages = rng.permutation(self.capacity)[:count].astype(np.int64)
        item = page * TOKEN
        kv = self.capacity * item
        self.arena = np.zeros(2 * kv + STATE_SLOTS * STATE_ITEM, np.uint8)
        if fill:
            self.arena[:] = rng.integers(0, 256, self.arena.size, dtype=np.uint8)
        base = int(self.arena.ctypes.data)
        self.layout = kvplan.Layout([base, base + kv], [kv, kv], [item, item], [0, 1],
                                    ["kv", "kv"], windows=[None, case.window], page_size=page,
                                    **dcp).with_state(
            "mamba_temporal", [base + 2 * kv], [STATE_SLOTS * STATE_ITEM], STATE_ITEM, [2])
        self.memory = Memory.of(self.arena)

    def copy(self) -> Memory:
        return self.memory.copy()


@st.composite
def cases(draw: st.DrawFn) -> Case:
    small = draw(st.sampled_from([1, 2, 4]))
    src_page, dst_page = (small, 4 * small) if draw(st.booleans()) else (4 * small, small)
    n = draw(st.integers(1, 120))
    # Unaligned K mostly: page edges, interleave edges and the window's start are drawn too.
    skip = draw(st.one_of(st.integers(0, n),
                          st.sampled_from([0, n, max(0, n - 1)]),
                          st.integers(0, n // max(1, dst_page)).map(lambda p: p * dst_page)))
    interleave = draw(st.sampled_from([1, 2, dst_page]))
    return Case(n, min(skip, n), src_page, dst_page, interleave, draw(st.integers(1, 40)),
                draw(st.integers(0, 2**16)))


def check_union(case: Case) -> None:
    src = Peer(case, page=case.src_page, tokens=case.n_tokens, dcp_rank=None, fill=True,
               seed=case.seed)
    slots = (1, 0)
    for rank in range(DCP):
        share = sum(1 for t in range(case.n_tokens)
                    if dcp_local_token(t, DCP, rank, case.interleave) is not None)
        dst = Peer(case, page=case.dst_page, tokens=max(share, 1), dcp_rank=rank, fill=False,
                   seed=case.seed + 1 + rank)
        template = kvplan.Template(src.layout, dst.layout)
        state = template.plan_state(*slots)
        # What the decode held: a full plan of the first K tokens (and the state slot).
        held = np.zeros(dst.arena.size, bool)
        if case.skip:
            apply_plan(template.plan(src.pages, dst.pages, n_tokens=case.skip), src.memory,
                       dst.memory, held)
        before = dst.copy()
        # The union: the delta of the whole request on top.
        delta = template.plan(src.pages, dst.pages, n_tokens=case.n_tokens,
                              skip_tokens=case.skip)
        assert delta.skip_tokens == case.skip
        written = np.zeros(dst.arena.size, bool)
        apply_plan(delta, src.memory, dst.memory, written)
        apply_plan(state, src.memory, dst.memory, written)
        # A full transfer of the whole request over the same first K tokens.
        full = Memory(before.data.copy(), dst.memory.base)
        apply_plan(template.plan(src.pages, dst.pages, n_tokens=case.n_tokens), src.memory,
                   full)
        apply_plan(state, src.memory, full)
        # And the oracle's: the first K tokens, then the whole request and the slot.
        want = Memory(np.zeros_like(dst.arena), dst.memory.base)
        if case.skip:
            reference_copy(src.layout, src.memory, dst.layout, want, src.pages, dst.pages,
                           n_tokens=case.skip)
        reference_copy(src.layout, src.memory, dst.layout, want, src.pages, dst.pages,
                       n_tokens=case.n_tokens, src_slot=slots[0], dst_slot=slots[1])
        for name, other in (("a full transfer", full.data), ("the oracle", want.data)):
            bad = np.flatnonzero(dst.arena != other)
            assert bad.size == 0, (f"decode rank {rank}: {bad.size} bytes differ from {name}, "
                                   f"the first at offset {bad[0]} ({case})")
        # The delta moves exactly the oracle's bytes for tokens K.. (no byte twice).
        delta_bytes = reference_copy(src.layout, src.memory, dst.layout, before.copy(),
                                     src.pages, dst.pages, n_tokens=case.n_tokens,
                                     skip_tokens=case.skip)
        assert delta.total_bytes == delta_bytes, (rank, case)


@settings(max_examples=EXAMPLES)
@given(cases())
def test_held_prefix_plus_delta_equals_a_full_transfer(case: Case) -> None:
    check_union(case)


@pytest.mark.parametrize("case", [
    Case(37, 13, 4, 16, 1, 5, 1),  # K unaligned to pages, window ends past K
    Case(64, 63, 16, 4, 4, 40, 2),  # K one short of the request, window wider than a page
    Case(9, 0, 1, 4, 2, 30, 3),  # no prefix: the delta is the full plan
    Case(100, 100, 2, 8, 8, 3, 4),  # the decode holds everything: only state moves
    Case(50, 31, 8, 2, 1, 1, 5),  # window of one token, decode pages smaller
])
def test_union_fixed_cases(case: Case) -> None:
    check_union(case)


def test_a_draft_window_entry_under_dcp_is_refused_with_a_typed_error() -> None:
    """Draft tokens go whole to every DCP rank; a draft entry with a window is refused."""
    def layout(page: int, draft_item: int, **dcp: int) -> kvplan.Layout:
        base = 1 << 40 if dcp else 1 << 32
        items = [page * TOKEN, page * TOKEN, draft_item]
        return kvplan.Layout([base + k * (1 << 20) for k in range(3)], [64 * i for i in items],
                             items, [0, 1, 2], ["kv", "kv", "draft"],
                             drafts=[False, False, True], windows=[None, 8, 8], page_size=page,
                             **dcp)
    src = layout(4, 4 * TOKEN)
    dst = layout(4, 4 * DCP * TOKEN, dcp_size=DCP, dcp_rank=0)
    with pytest.raises(kvplan.KvPlanError, match="a draft entry with a sliding window under "
                                                 "decode context parallelism") as e:
        kvplan.Template(src, dst)
    assert e.value.kind == "geometry" and "layer 2, role draft" in str(e.value)
