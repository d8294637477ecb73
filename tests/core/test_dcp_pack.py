"""Pack plans in CPU memory: a prefill at DCP 1 sends to each decode DCP rank through a pack buffer.

The gather half is executed with NumPy from the prefill pool into a real pack buffer, then the
network half from the pack buffer into the decode pool; the decode pool must equal byte for byte
what the direct plan writes into an identical pool, and the network must move at most one block
per entry per run of consecutive decode pages (the direct plan moves one block per token).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvplan

ROW = 16  # bytes of one token's row in one entry
LAYERS = [0, 1, 2]
N_TOKENS = 45


class Pool:
    """One side's KV pool: one NumPy buffer per entry (MLA: one per layer, MHA: K and V)."""

    def __init__(self, page: int, capacity: int, mha: bool, **dcp: int) -> None:
        entries = 2 * len(LAYERS) if mha else len(LAYERS)
        self.item = page * ROW
        self.buffers = [np.zeros(capacity * self.item, np.uint8) for _ in range(entries)]
        ptrs = [b.ctypes.data for b in self.buffers]
        lens = [b.size for b in self.buffers]
        n = len(LAYERS)
        context = {"page_size": page, **dcp}
        if mha:
            self.layout = kvplan.Layout.mha(ptrs[:n], ptrs[n:], lens[:n], lens[n:], self.item,
                                            self.item, LAYERS, **context)
        else:
            self.layout = kvplan.Layout.mla(ptrs, lens, self.item, LAYERS, **context)


def _copy(plan: kvplan.TransferPlan, regions: list[np.ndarray]) -> None:
    """Execute a plan with NumPy: every address must fall inside one of ``regions``."""
    def at(addr: int, length: int) -> np.ndarray:
        for r in regions:
            base = r.ctypes.data
            if base <= addr and addr + length <= base + r.size:
                return r[addr - base:addr - base + length]
        raise AssertionError(f"block {addr:#x}+{length} outside every buffer")
    for s, d, length in zip(*plan.as_lists()):
        at(d, length)[:] = at(s, length)


def _runs(pages: np.ndarray) -> int:
    return int(np.count_nonzero(np.diff(pages) != 1)) + int(pages.size > 0)


@pytest.mark.parametrize(("mha", "ranks", "page", "deal"),
                         list(itertools.product([False, True], [2, 4], [4, 8], ["token", "page"])))
def test_gather_then_network_matches_the_direct_plan(mha: bool, ranks: int, page: int,
                                                     deal: str) -> None:
    interleave = 1 if deal == "token" else page
    rng = np.random.default_rng(ranks * 10 + page)
    src_pages = rng.permutation(-(-N_TOKENS // page) + 2)[:-(-N_TOKENS // page)].astype(np.int64)
    src = Pool(page, src_pages.size + 2, mha)
    for b in src.buffers:
        b[:] = rng.integers(1, 256, b.size, dtype=np.uint8)
    for rank in range(ranks):
        share = sum(1 for t in range(N_TOKENS) if (t // interleave) % ranks == rank)
        count = -(-share // page)
        # Consecutive pages with one jump: a few destination runs.
        dst_pages = np.array([k + (k >= count // 2) for k in range(count)], np.int64)
        dst = Pool(page, count + 2, mha, dcp_size=ranks, dcp_rank=rank,
                   dcp_interleave=interleave)
        template = kvplan.Template(src.layout, dst.layout)
        direct = template.plan(src_pages, dst_pages, n_tokens=N_TOKENS)
        _copy(direct, src.buffers + dst.buffers)
        want = [b.copy() for b in dst.buffers]
        assert any(w.any() for w in want)
        for b in dst.buffers:
            b[:] = 0
        pack = np.zeros(direct.total_bytes + 64, np.uint8)
        gather, network = template.plan_packed(src_pages, dst_pages, n_tokens=N_TOKENS,
                                               pack=(pack.ctypes.data, pack.size))
        _copy(gather, src.buffers + [pack])
        assert not pack[direct.total_bytes:].any(), "gather wrote past the plan's bytes"
        _copy(network, [pack] + dst.buffers)
        for got, expected in zip(dst.buffers, want):
            np.testing.assert_array_equal(got, expected)
        assert gather.total_bytes == network.total_bytes == direct.total_bytes
        entries = len(dst.buffers)
        assert network.n_blocks <= entries * _runs(dst_pages)
        if interleave == 1:
            assert direct.n_blocks == entries * share  # one block per token per entry
            assert network.n_blocks < direct.n_blocks
        assert len(network.pair_offsets) == len(direct.pair_offsets)
        assert network.pair_offsets[-1] == network.n_blocks


def test_a_small_pack_buffer_names_the_bytes_needed_and_halves_have_no_group_views() -> None:
    src = Pool(4, 12, False)
    dst = Pool(4, 6, False, dcp_size=2, dcp_rank=0, dcp_interleave=1)
    template = kvplan.Template(src.layout, dst.layout)
    src_pages, dst_pages = np.arange(10, dtype=np.int64), np.arange(5, dtype=np.int64)
    need = 20 * ROW * len(LAYERS)  # 20 of 40 tokens on rank 0
    with pytest.raises(kvplan.SizeMismatchError, match=f"at least {need} bytes"):
        template.plan_packed(src_pages, dst_pages, n_tokens=40, pack=(1 << 40, need - 1))
    gather, network = template.plan_packed(src_pages, dst_pages, n_tokens=40,
                                           pack=(1 << 40, need))
    assert network.n_blocks == len(LAYERS)
    assert gather.n_blocks == 20 * len(LAYERS)
    with pytest.raises(kvplan.KvPlanError, match="no emission groups"):
        _ = network.group_offsets
