"""Token plans between decode-context-parallel layouts, checked byte by byte in CPU memory.

Each global token's bytes are a function of (layer, token, byte); every rank's pool is filled
from the layout definition alone (rank ``(t // I) % N`` holds token ``t`` at local token
``(t // (I * N)) * I + t % I``); every (prefill rank, decode rank) template is planned and
applied with NumPy, and each decode rank's pool must equal the naive per-token copy with no byte
written twice.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvplan

TOKEN = 8  # bytes of one MLA row per layer
LAYERS = [0, 1]
N_TOKENS = 37


def _pages(count: int, capacity: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(capacity)[:count].astype(np.int64)


def _local(t: int, size: int, interleave: int) -> int:
    return (t // (interleave * size)) * interleave + t % interleave


def _owner(t: int, size: int, interleave: int) -> int:
    return (t // interleave) % size


class Rank:
    def __init__(self, page: int, size: int, rank: int, interleave: int, seed: int) -> None:
        self.page, self.size, self.rank, self.interleave = page, size, rank, interleave
        share = sum(1 for t in range(N_TOKENS) if _owner(t, size, interleave) == rank)
        count = -(-share // page)
        self.capacity = count + 2
        self.pages = _pages(count, self.capacity, seed)
        self.pool = np.zeros((len(LAYERS), self.capacity * page * TOKEN), np.uint8)
        ptrs = [self.pool.ctypes.data + k * self.pool.shape[1] for k in range(len(LAYERS))]
        self.layout = kvplan.Layout.mla(ptrs, [self.pool.shape[1]] * len(LAYERS), page * TOKEN,
                                        LAYERS, page_size=page, dcp_size=size, dcp_rank=rank,
                                        dcp_interleave=interleave)

    def tokens(self) -> list[tuple[int, int]]:
        """(global token, byte offset in a layer's buffer) of every token this rank holds."""
        out = []
        for t in range(N_TOKENS):
            if _owner(t, self.size, self.interleave) == self.rank:
                local = _local(t, self.size, self.interleave)
                page = int(self.pages[local // self.page])
                out.append((t, (page * self.page + local % self.page) * TOKEN))
        return out


def _row(layer: int, t: int) -> np.ndarray:
    return ((np.arange(TOKEN) * 31 + t * 7 + layer * 101) % 251 + 1).astype(np.uint8)


@pytest.mark.parametrize(("src_dcp", "dst_dcp", "pages"), [
    *[((m, i), (n, j), (ps, pd))
      for (m, n), (i, j), (ps, pd) in itertools.product(
          [(1, 2), (1, 4), (2, 4), (4, 2), (2, 2)], [(1, 1), (1, 4), (4, 2)], [(4, 4), (2, 4)])
      if ps % i == 0 or i % ps == 0],
])
def test_every_decode_rank_pool_is_exact(src_dcp: tuple[int, int], dst_dcp: tuple[int, int],
                                         pages: tuple[int, int]) -> None:
    (m, i), (n, j) = src_dcp, dst_dcp
    if pages[1] % j and j % pages[1]:
        pytest.skip("interleave and page size must divide each other")
    sources = [Rank(pages[0], m, r, i, seed=r) for r in range(m)]
    for src in sources:
        for k, layer in enumerate(LAYERS):
            for t, at in src.tokens():
                src.pool[k, at:at + TOKEN] = _row(layer, t)
    for rank in range(n):
        dst = Rank(pages[1], n, rank, j, seed=100 + rank)
        written = np.zeros(dst.pool.size, bool)
        base = dst.pool.ctypes.data
        for src in sources:
            template = kvplan.Template(src.layout, dst.layout)
            plan = template.plan(src.pages, dst.pages, n_tokens=N_TOKENS)
            if template.empty_reason is not None:
                assert plan.n_blocks == 0
            flat_src = src.pool.reshape(-1)
            for s, d, length in zip(*plan.as_lists()):
                so, do = s - src.pool.ctypes.data, d - base
                assert not written[do:do + length].any(), "destination byte written twice"
                written[do:do + length] = True
                dst.pool.reshape(-1)[do:do + length] = flat_src[so:so + length]
        want = np.zeros_like(dst.pool)
        for k, layer in enumerate(LAYERS):
            for t, at in dst.tokens():
                want[k, at:at + TOKEN] = _row(layer, t)
        np.testing.assert_array_equal(dst.pool, want)


def test_a_rank_pair_without_common_tokens_says_why_and_n_tokens_is_required() -> None:
    a = Rank(4, 2, 0, 1, seed=1)
    b = Rank(4, 2, 1, 1, seed=2)
    template = kvplan.Template(a.layout, b.layout)
    assert "hold no token in common" in (template.empty_reason or "")
    assert template.plan(a.pages, b.pages, n_tokens=N_TOKENS).n_blocks == 0
    with pytest.raises(kvplan.KvPlanError, match="needs n_tokens"):
        template.plan(a.pages, b.pages)
