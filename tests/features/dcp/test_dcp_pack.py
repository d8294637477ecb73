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


def _gather_rows(rows: kvplan.RowGather, src: list[np.ndarray], pack: np.ndarray) -> None:
    """Execute a row gather with NumPy, as a gather kernel does: per copy, every row of its lane
    from ``src_base + (r // rows_per_page) * page_stride + (r % rows_per_page) * row_stride``
    to ``pack_addr + k * len``; every address must fall inside the buffers given."""
    def region(addr: int, length: int, regions: list[np.ndarray]) -> tuple[np.ndarray, int]:
        for r in regions:
            base = r.ctypes.data
            if base <= addr and addr + length <= base + r.size:
                return r, addr - base
        raise AssertionError(f"row {addr:#x}+{length} outside every buffer")

    for lane, src_base, page_stride, row_stride, per_page, length, pack_addr in (
            rows.copies.tolist()):
        lane_rows = rows.rows[lane].astype(np.int64)
        starts = src_base + (lane_rows // per_page) * page_stride + (lane_rows % per_page) * (
            row_stride)
        for k, start in enumerate(starts.tolist()):
            buf, at = region(start, length, src)
            out, to = region(pack_addr + k * length, length, [pack])
            out[to:to + length] = buf[at:at + length]


@pytest.mark.parametrize(("mha", "ranks", "page", "deal"),
                         list(itertools.product([False, True], [2, 4], [4, 8], ["token", "page"])))
def test_row_gather_then_network_matches_the_direct_plan(mha: bool, ranks: int, page: int,
                                                         deal: str) -> None:
    """plan_row_gather: its network plan is plan_packed's, block for block, and its rows,
    executed like a gather kernel, fill the pack buffer as plan_packed's gather does, so the
    decode pool ends up byte for byte as the direct plan leaves it."""
    interleave = 1 if deal == "token" else page
    rng = np.random.default_rng(ranks * 10 + page + 7)
    n_src = -(-N_TOKENS // page)
    src_pages = rng.permutation(n_src + 2)[:n_src].astype(np.int64)
    src = Pool(page, n_src + 2, mha)
    for b in src.buffers:
        b[:] = rng.integers(1, 256, b.size, dtype=np.uint8)
    for rank in range(ranks):
        share = sum(1 for t in range(N_TOKENS) if (t // interleave) % ranks == rank)
        count = -(-share // page)
        dst_pages = np.array([k + (k >= count // 2) for k in range(count)], np.int64)
        dst = Pool(page, count + 2, mha, dcp_size=ranks, dcp_rank=rank,
                   dcp_interleave=interleave)
        template = kvplan.Template(src.layout, dst.layout)
        direct = template.plan(src_pages, dst_pages, n_tokens=N_TOKENS)
        _copy(direct, src.buffers + dst.buffers)
        want = [b.copy() for b in dst.buffers]
        for b in dst.buffers:
            b[:] = 0
        by_blocks = np.zeros(direct.total_bytes + 64, np.uint8)
        pack = np.zeros(direct.total_bytes + 64, np.uint8)
        _, network = template.plan_packed(src_pages, dst_pages, n_tokens=N_TOKENS,
                                          pack=(pack.ctypes.data, pack.size))
        rows, row_network = template.plan_row_gather(src_pages, dst_pages, n_tokens=N_TOKENS,
                                                     pack=(pack.ctypes.data, pack.size))
        assert row_network.as_lists() == network.as_lists()
        assert list(row_network.pair_offsets) == list(network.pair_offsets)
        assert rows.pack_bytes == direct.total_bytes
        # one row per token the rank holds, per lane; one copy per entry (MLA row, K or V)
        assert [r.size for r in rows.rows] == [share, 0]
        assert rows.copies.shape == (len(dst.buffers), 7)
        block_gather, _ = template.plan_packed(src_pages, dst_pages, n_tokens=N_TOKENS,
                                               pack=(by_blocks.ctypes.data, by_blocks.size))
        _copy(block_gather, src.buffers + [by_blocks])
        _gather_rows(rows, src.buffers, pack)
        np.testing.assert_array_equal(pack[:direct.total_bytes], by_blocks[:direct.total_bytes])
        assert not pack[direct.total_bytes:].any(), "row gather wrote past the plan's bytes"
        _copy(row_network, [pack] + dst.buffers)
        for got, expected in zip(dst.buffers, want):
            np.testing.assert_array_equal(got, expected)


def test_row_gather_rows_are_sglangs_source_token_rows() -> None:
    """From a prefill at DCP 1 with token round robin, lane 0's rows are the rank's source
    token rows (page * page_size + slot of every token t with t % N == rank), the row-index
    array a gather kernel takes."""
    page, ranks, tokens = 4, 4, 37
    src_pages = np.array([9, 2, 5, 0, 7, 3, 8, 1, 4, 6], np.int64)
    src = Pool(page, 10, False)
    for rank in range(ranks):
        share = sum(1 for t in range(tokens) if t % ranks == rank)
        dst = Pool(page, 4, False, dcp_size=ranks, dcp_rank=rank)
        template = kvplan.Template(src.layout, dst.layout)
        rows, _ = template.plan_row_gather(src_pages, np.arange(-(-share // page)),
                                           n_tokens=tokens, pack=(1 << 40, 1 << 20))
        want = [int(src_pages[t // page]) * page + t % page for t in range(rank, tokens, ranks)]
        assert rows.rows[0].tolist() == want


def test_row_gather_refusals_are_typed() -> None:
    src = Pool(4, 12, False)
    dst = Pool(4, 6, False, dcp_size=2, dcp_rank=0, dcp_interleave=1)
    template = kvplan.Template(src.layout, dst.layout)
    src_pages, dst_pages = np.arange(10, dtype=np.int64), np.arange(5, dtype=np.int64)
    need = 20 * ROW * len(LAYERS)
    with pytest.raises(kvplan.SizeMismatchError, match=f"at least {need} bytes"):
        template.plan_row_gather(src_pages, dst_pages, n_tokens=40, pack=(1 << 40, need - 1))
    with pytest.raises(kvplan.IndexBoundsError):
        template.plan_row_gather(src_pages + 5, dst_pages, n_tokens=40, pack=(1 << 40, need))
    plain = kvplan.Template(src.layout, Pool(4, 6, False).layout)
    with pytest.raises(kvplan.KvPlanError, match="row gather"):
        plain.plan_row_gather(src_pages[:5], dst_pages, pack=(1 << 40, need))


@pytest.mark.parametrize("ranks", [2, 4])
def test_row_gather_with_draft_entries_sent_whole(ranks: int) -> None:
    """A draft (MTP) entry is not dealt: its rows are lane 1 (every token), its pack region
    follows the target entries', and gather then network still write what the direct plan
    writes."""
    page, tokens = 4, 30
    rng = np.random.default_rng(ranks)

    def pool(capacity: int, dcp: dict[str, int], draft_page: int) -> tuple[kvplan.Layout,
                                                                        list[np.ndarray]]:
        items = [page * ROW] * len(LAYERS) + [draft_page * ROW]
        buffers = [np.zeros(capacity * item, np.uint8) for item in items]
        layout = kvplan.Layout([b.ctypes.data for b in buffers], [b.size for b in buffers],
                               items, [*LAYERS, len(LAYERS)],
                               drafts=[False] * len(LAYERS) + [True], page_size=page, **dcp)
        return layout, buffers

    n_src = -(-tokens // page)
    src_layout, src = pool(n_src + 2, {}, page)
    for b in src:
        b[:] = rng.integers(1, 256, b.size, dtype=np.uint8)
    src_pages = rng.permutation(n_src + 2)[:n_src].astype(np.int64)
    for rank in range(ranks):
        dst_layout, dst = pool(n_src + 2, {"dcp_size": ranks, "dcp_rank": rank}, page * ranks)
        template = kvplan.Template(src_layout, dst_layout)
        dst_pages = np.arange(1, n_src + 1, dtype=np.int64)
        direct = template.plan(src_pages, dst_pages, n_tokens=tokens)
        _copy(direct, src + dst)
        want = [b.copy() for b in dst]
        for b in dst:
            b[:] = 0
        pack = np.zeros(direct.total_bytes, np.uint8)
        rows, network = template.plan_row_gather(src_pages, dst_pages, n_tokens=tokens,
                                                 pack=(pack.ctypes.data, pack.size))
        share = sum(1 for t in range(tokens) if t % ranks == rank)
        assert [r.size for r in rows.rows] == [share, tokens]
        assert rows.copies[:, 0].tolist() == [0] * len(LAYERS) + [1]
        _, packed_network = template.plan_packed(src_pages, dst_pages, n_tokens=tokens,
                                                 pack=(pack.ctypes.data, pack.size))
        assert network.as_lists() == packed_network.as_lists()
        _gather_rows(rows, src, pack)
        _copy(network, [pack] + dst)
        for got, expected in zip(dst, want):
            np.testing.assert_array_equal(got, expected)
