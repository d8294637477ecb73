"""Batch plans (``Template.plan_batch``): many requests to one peer in one plan, checked
against the published byte oracle (each request's reference copy), against the requests planned
one by one, and the per-request verdict helpers against their definitions; bad batches get
typed errors naming the requests."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.testing.oracle import apply_plan, reference_copy
from kvplan.testing.ranks import Model, Rank, rank_memory

MODELS = [Model(layers=3, kv_heads=2), Model(layers=2, mla=True),
          Model(layers=2, kv_heads=4)]
RANKS = [(Rank(capacity=64), Rank(capacity=64)),
         (Rank(capacity=64, cross_layer=True), Rank(capacity=64, cross_layer=True)),
         (Rank(capacity=64, page_size=2), Rank(capacity=32, page_size=4)),
         (Rank(capacity=64, tp_size=2), Rank(capacity=64))]


def draw_requests(rng: np.random.Generator, n: int, capacity: tuple[int, int],
                  dtype: type = np.int64) -> list[tuple[np.ndarray, np.ndarray]]:
    """Disjoint decode pages: some requests continue the previous one on both sides (they
    share a segment), others start elsewhere, some descending."""
    taken: set[int] = set()
    out: list[tuple[np.ndarray, np.ndarray]] = []
    while len(out) < n:
        k = int(rng.integers(1, 5))
        if out and rng.integers(2) == 0:
            s0, d0 = int(out[-1][0][-1]) + 1, int(out[-1][1][-1]) + 1
            src, dst = np.arange(s0, s0 + k), np.arange(d0, d0 + k)
        else:
            s0 = int(rng.integers(0, capacity[0] - k))
            d0 = int(rng.integers(0, capacity[1] - k))
            src, dst = np.arange(s0, s0 + k), np.arange(d0, d0 + k)
            if rng.integers(4) == 0:
                src, dst = src[::-1].copy(), dst[::-1].copy()
        if src.max() >= capacity[0] or dst.max() >= capacity[1] or taken & set(dst.tolist()):
            continue
        taken |= set(dst.tolist())
        out.append((src.astype(dtype), dst.astype(dtype)))
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("ranks", RANKS)
def test_a_batch_moves_what_each_request_moves(model: Model, ranks: tuple[Rank, Rank]) -> None:
    prefill, decode = ranks
    rng = np.random.default_rng(5)
    fused = 0
    for case in range(12):
        src = rank_memory(model, prefill, seed=case + 1)
        dst = rank_memory(model, decode)
        t = kvplan.Template(src.layout, dst.layout)
        n = int(rng.integers(1, 9))
        if t.by_token:
            # Two prefill pages per decode page: the tokens line up.
            pairs = draw_requests(rng, n, (decode.capacity, decode.capacity))
            requests = [(np.stack([2 * d, 2 * d + 1], axis=1).reshape(-1), d) for _, d in pairs]
        else:
            requests = draw_requests(rng, n, (prefill.capacity, decode.capacity))
        batch = t.plan_batch(requests, digests=True)
        want = dst.memory.copy()
        for s_pages, d_pages in requests:
            reference_copy(src.layout, src.memory, dst.layout, want, s_pages, d_pages)
        written = np.zeros(dst.memory.data.size, dtype=bool)
        apply_plan(batch, src.memory, dst.memory, written)
        assert np.array_equal(dst.memory.data, want.data), case

        alone = [t.plan(s, d) for s, d in requests]
        assert batch.n_requests == n
        assert batch.total_bytes == sum(p.total_bytes for p in alone)
        assert batch.request_bytes.tolist() == [p.total_bytes for p in alone]
        assert batch.request_n_blocks.tolist() == [p.n_blocks for p in alone]
        assert batch.request_digests.tolist() == [p.digest() for p in alone]
        assert batch.n_blocks <= sum(p.n_blocks for p in alone)
        offsets, firsts = batch.segment_offsets, batch.segment_requests
        assert offsets[0] == 0 and offsets[-1] == batch.n_blocks
        assert firsts[0] == 0 and firsts[-1] == n
        for s in range(batch.n_segments):
            held = range(int(firsts[s]), int(firsts[s + 1]))
            fused += len(held) - 1
            if len(held) == 1:
                # A request alone is planned exactly as Template.plan plans it.
                part = slice(int(offsets[s]), int(offsets[s + 1]))
                assert batch.src_addrs[part].tolist() == alone[held[0]].src_addrs.tolist()
                assert batch.lengths[part].tolist() == alone[held[0]].lengths.tolist()
            for r in held:
                assert batch.request_segments[r] == s
                blocks = batch.request_blocks(r)
                assert (blocks.start, blocks.stop) == (offsets[s], offsets[s + 1])
    if not t.by_token:
        assert fused > 0, "the draws fuse touching requests"


def test_touching_requests_share_blocks_and_every_call_names_its_requests() -> None:
    model, rank = Model(layers=4, mla=True), Rank(capacity=400)
    src, dst = rank_memory(model, rank, seed=1), rank_memory(model, rank)
    t = kvplan.Template(src.layout, dst.layout)
    # 32 requests of 4 pages, allocated back to back on both sides: one segment.
    requests = [(np.arange(4 * r, 4 * r + 4, dtype=np.int32),
                 np.arange(4 * r + 100, 4 * r + 104, dtype=np.int32)) for r in range(32)]
    batch = t.plan_batch(requests)
    whole = t.plan(np.arange(128, dtype=np.int32), np.arange(100, 228, dtype=np.int32))
    assert batch.n_segments == 1 and batch.n_blocks == whole.n_blocks == 4
    assert batch.src_addrs.tolist() == whole.src_addrs.tolist()
    assert batch.requests_in(0, 1).tolist() == list(range(32))

    # Every other request's prefill pages elsewhere: no two touch, 32 segments of 4 blocks;
    # calls of 8 blocks hold two whole segments each.
    requests = [(s + 200 * (r % 2), d) for r, (s, d) in enumerate(requests)]
    requests = [(s.astype(np.int64), d.astype(np.int64)) for s, d in requests]
    batch = t.plan_batch(requests)
    assert (batch.n_segments, batch.n_blocks) == (32, 128)
    assert batch.call_ranges(8).tolist() == [[8 * k, 8 * k + 8] for k in range(16)]
    assert batch.requests_in(8, 16).tolist() == [2, 3]
    assert batch.call_ranges(6).tolist()[:2] == [[0, 4], [4, 8]]
    calls = batch.call_ranges(8)
    assert calls[0, 0] == 0 and calls[-1, 1] == batch.n_blocks
    assert all((calls[1:, 0] == calls[:-1, 1]).tolist())
    assert all(((calls[:, 1] - calls[:, 0]) <= 8).tolist())
    for (start, stop), view in zip(calls.tolist(), batch.batches(8)):
        assert view.src_addrs.tolist() == batch.src_addrs[start:stop].tolist()
        held = batch.requests_in(start, stop).tolist()
        mine = [r for r in range(batch.n_requests)
                if batch.request_blocks(r).start < stop and start < batch.request_blocks(r).stop]
        assert held == mine


def test_bad_batches_name_the_requests() -> None:
    model, rank = Model(layers=2, mla=True), Rank(capacity=16)
    src, dst = rank_memory(model, rank, seed=1), rank_memory(model, rank)
    t = kvplan.Template(src.layout, dst.layout)
    a = np.array([0, 1]), np.array([3, 4])
    b = np.array([5]), np.array([9])
    c = np.array([7, 8]), np.array([12, 4])
    with pytest.raises(kvplan.IndexBoundsError, match="requests 0 and 2 .* dst page 4") as e:
        t.plan_batch([a, b, c])
    assert e.value.kind == "requests_overlap"
    with pytest.raises(kvplan.IndexBoundsError,
                       match=r"request 1 of the batch: dst index 16 at position 0") as e:
        t.plan_batch([a, (np.array([0]), np.array([16]))])
    assert e.value.kind == "index_bounds"
    with pytest.raises(kvplan.KvPlanError, match="request 0 of the batch: src has 2 indices"):
        t.plan_batch([(np.array([0, 1]), np.array([2]))])
    with pytest.raises(TypeError, match="request 1: every request of a batch takes the dtypes"):
        t.plan_batch([a, (b[0].astype(np.int32), b[1])])
    with pytest.raises(TypeError, match="request 0 must be a"):
        t.plan_batch([np.array([0])])
    with pytest.raises(TypeError, match="request 0 src_pages must be a 1-D numpy array"):
        t.plan_batch([([0], [1])])
    with pytest.raises(kvplan.KvPlanError, match="max_blocks must be positive"):
        t.plan_batch([a]).call_ranges(0)
    with pytest.raises(kvplan.KvPlanError, match="without request digests"):
        _ = t.plan_batch([a]).request_digests
    empty = t.plan_batch([])
    assert (empty.n_blocks, empty.n_segments, empty.call_ranges(4).shape) == (0, 0, (0, 2))
