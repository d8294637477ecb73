"""Token plans between decode-context-parallel layouts, checked byte by byte in CPU memory.

Every (prefill DCP rank, decode DCP rank) template is planned and applied with NumPy; each
decode rank's pool must equal :mod:`kvplan.testing.oracle`'s copy (rank ``(t // I) % N`` holds
token ``t`` at local token ``(t // (I * N)) * I + t % I``; draft entries and state slots go whole
to every decode rank from one prefill rank), with no byte written twice.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvplan
from kvplan.testing.oracle import Memory, apply_plan, dcp_local_token, reference_copy

TOKEN = 8  # bytes of one MLA row per layer
LAYERS = [0, 1]
N_TOKENS = 37
STATE_ITEM, STATE_SLOTS = 24, 3


def _pages(count: int, capacity: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(capacity)[:count].astype(np.int64)


class Rank:
    """One DCP rank's MLA pool (``LAYERS`` target entries), optionally a draft entry after
    them (its pages hold ``page × size`` tokens) and one state entry; random bytes with
    ``fill``, zeros otherwise."""

    def __init__(self, page: int, size: int, rank: int, interleave: int, seed: int, *,
                 draft: bool = False, state: bool = False, fill: bool = False) -> None:
        share = sum(1 for t in range(N_TOKENS)
                    if dcp_local_token(t, size, rank, interleave) is not None)
        count = max(-(-share // page), -(-N_TOKENS // (page * size)) if draft else 0)
        self.capacity = count + 2
        self.pages = _pages(count, self.capacity, seed)
        items = [page * TOKEN] * len(LAYERS) + ([page * size * TOKEN] if draft else [])
        sizes = [self.capacity * item for item in items]
        state_bytes = STATE_SLOTS * STATE_ITEM if state else 0
        self.arena = np.zeros(sum(sizes) + state_bytes, np.uint8)
        if fill:
            self.arena[:] = np.random.default_rng(seed + 1000).integers(0, 256, self.arena.size,
                                                                        dtype=np.uint8)
        base = self.arena.ctypes.data
        ptrs = [base + sum(sizes[:k]) for k in range(len(sizes))]
        ids = [*LAYERS, len(LAYERS)] if draft else LAYERS
        self.layout = kvplan.Layout(ptrs, sizes, items, ids, ["kv"] * len(items),
                                    drafts=[False] * len(LAYERS) + [True] * draft,
                                    page_size=page, dcp_size=size, dcp_rank=rank,
                                    dcp_interleave=interleave)
        if state:
            self.layout = self.layout.with_state("mamba_temporal", [base + sum(sizes)],
                                                 [state_bytes], STATE_ITEM, [len(ids)])
        self.memory = Memory.of(self.arena)


def _check_decode_rank(sources: list[Rank], dst: Rank, slots: tuple[int, int] | None = None,
                       skip: int = 0) -> int:
    """Plans and applies every source into ``dst``; asserts the oracle's bytes and no byte
    written twice. Returns the bytes written. With ``skip`` K, ``dst`` holds the oracle's first
    K tokens before a delta plan moves the rest."""
    want = dst.memory.copy()
    written = np.zeros(dst.arena.size, bool)
    for src in sources:
        template = kvplan.Template(src.layout, dst.layout)
        if skip:
            reference_copy(src.layout, src.memory, dst.layout, dst.memory, src.pages,
                           dst.pages, n_tokens=skip)
        plan = template.plan(src.pages, dst.pages, n_tokens=N_TOKENS, skip_tokens=skip)
        if template.empty_reason is not None:
            assert plan.n_blocks == 0
        apply_plan(plan, src.memory, dst.memory, written)
        if slots is not None:
            apply_plan(template.plan_state(*slots), src.memory, dst.memory, written)
        reference_copy(src.layout, src.memory, dst.layout, want, src.pages, dst.pages,
                       n_tokens=N_TOKENS, src_slot=slots and slots[0],
                       dst_slot=slots and slots[1])
    bad = np.flatnonzero(dst.arena != want.data)
    assert bad.size == 0, f"{bad.size} wrong decode bytes, the first at offset {bad[0]}"
    return int(written.sum())


@pytest.mark.parametrize(("src_dcp", "dst_dcp", "pages"), [
    *[((m, i), (n, j), (ps, pd))
      for (m, n), (i, j), (ps, pd) in itertools.product(
          [(1, 2), (1, 4), (2, 4), (4, 2), (2, 2)], [(1, 1), (1, 4), (4, 2)], [(4, 4), (2, 4)])
      if (ps % i == 0 or i % ps == 0) and (pd % j == 0 or j % pd == 0)],
])
def test_every_decode_rank_pool_is_exact(src_dcp: tuple[int, int], dst_dcp: tuple[int, int],
                                         pages: tuple[int, int]) -> None:
    (m, i), (n, j) = src_dcp, dst_dcp
    sources = [Rank(pages[0], m, r, i, seed=r, fill=True) for r in range(m)]
    total = 0
    for rank in range(n):
        total += _check_decode_rank(sources, Rank(pages[1], n, rank, j, seed=100 + rank))
    # Every token of every layer reached exactly one decode rank.
    assert total == N_TOKENS * len(LAYERS) * TOKEN


@pytest.mark.parametrize(("m", "n"), [(1, 2), (2, 4), (4, 2)])
def test_draft_entries_and_state_go_whole_to_every_decode_rank(m: int, n: int) -> None:
    sources = [Rank(4, m, r, 1, seed=r, draft=True, state=True, fill=True) for r in range(m)]
    for rank in range(n):
        dst = Rank(4, n, rank, 1, seed=100 + rank, draft=True, state=True)
        got = _check_decode_rank(sources, dst, slots=(1, 2))
        share = sum(1 for t in range(N_TOKENS) if t % n == rank)
        # Its share of the target tokens, every draft token, one state slot.
        assert got == share * len(LAYERS) * TOKEN + N_TOKENS * TOKEN + STATE_ITEM


def test_a_rank_pair_without_common_tokens_says_why_and_n_tokens_is_required() -> None:
    a = Rank(4, 2, 0, 1, seed=1)
    b = Rank(4, 2, 1, 1, seed=2)
    template = kvplan.Template(a.layout, b.layout)
    assert "hold no token in common" in (template.empty_reason or "")
    assert template.plan(a.pages, b.pages, n_tokens=N_TOKENS).n_blocks == 0
    with pytest.raises(kvplan.KvPlanError, match="needs n_tokens"):
        template.plan(a.pages, b.pages)


@pytest.mark.parametrize("skip", [1, 5, 8, 13, 36, 37])
@pytest.mark.parametrize(("m", "n", "j"), [(1, 8, 1), (2, 8, 2), (8, 4, 1), (1, 4, 4)])
def test_delta_plans_between_dcp_ranks(skip: int, m: int, n: int, j: int) -> None:
    """A decode holding the first ``skip`` tokens gets exactly the rest, on every rank."""
    sources = [Rank(4, m, r, 1, seed=r, fill=True) for r in range(m)]
    total = 0
    for rank in range(n):
        total += _check_decode_rank(sources, Rank(4, n, rank, j, seed=100 + rank), skip=skip)
    assert total == (N_TOKENS - skip) * len(LAYERS) * TOKEN
