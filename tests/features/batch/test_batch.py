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


def flatten(requests: list[tuple[np.ndarray, np.ndarray]]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(src_pages, dst_pages, src offsets, dst offsets)`` of ``requests`` concatenated."""
    def side(i: int) -> tuple[np.ndarray, np.ndarray]:
        arrays = [r[i] for r in requests]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        dtype = arrays[0].dtype if arrays else np.int64
        return (np.concatenate(arrays) if arrays else np.zeros(0, dtype)), offsets
    (src, src_offsets), (dst, dst_offsets) = side(0), side(1)
    return src, dst, src_offsets, dst_offsets


def same_batch(a: kvplan.BatchPlan, b: kvplan.BatchPlan, digests: bool = False) -> None:
    """Two batch plans byte for byte: columns, segments and every per-request value."""
    assert (a.n_blocks, a.n_requests, a.n_segments, a.total_bytes) == (
        b.n_blocks, b.n_requests, b.n_segments, b.total_bytes)
    for name in ("src_addrs", "dst_addrs", "lengths", "segment_offsets", "segment_requests",
                 "request_segments", "request_bytes", "request_n_blocks"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    if digests:
        assert a.request_digests.tobytes() == b.request_digests.tobytes()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("dtypes", [(np.int32, np.int32), (np.int64, np.int64),
                                    (np.int32, np.int64), (np.int64, np.int32)])
def test_a_flat_batch_is_the_batch_of_its_requests(model: Model, ranks: tuple[Rank, Rank],
                                                   dtypes: tuple[type, type]) -> None:
    prefill, decode = ranks
    rng = np.random.default_rng(11)
    src = rank_memory(model, prefill, seed=1)
    dst = rank_memory(model, decode)
    t = kvplan.Template(src.layout, dst.layout)
    for case in range(8):
        n = int(rng.integers(1, 12))
        if t.by_token:
            # Two prefill pages per decode page: each side has its own page counts.
            pairs = draw_requests(rng, n, (decode.capacity, decode.capacity))
            requests = [(np.stack([2 * d, 2 * d + 1], axis=1).reshape(-1), d) for _, d in pairs]
        else:
            requests = draw_requests(rng, n, (prefill.capacity, decode.capacity))
        requests = [(s.astype(dtypes[0]), d.astype(dtypes[1])) for s, d in requests]
        s_pages, d_pages, s_offsets, d_offsets = flatten(requests)
        digests = case % 2 == 0
        want = t.plan_batch(requests, digests=digests)
        if np.array_equal(s_offsets, d_offsets):
            got = t.plan_batch_flat(s_pages, d_pages, s_offsets, digests=digests)
            same_batch(want, got, digests)
        got = t.plan_batch_flat(s_pages, d_pages, s_offsets, dst_offsets=d_offsets,
                                digests=digests)
        same_batch(want, got, digests)
        assert got.src_addrs.dtype == np.uint64


def test_a_flat_batch_of_token_requests_takes_their_token_counts() -> None:
    model = Model(layers=2, kv_heads=2)
    src = rank_memory(model, Rank(capacity=64, page_size=2), seed=1)
    dst = rank_memory(model, Rank(capacity=32, page_size=4))
    t = kvplan.Template(src.layout, dst.layout)
    requests = [(np.arange(0, 6), np.arange(10, 13), 11), (np.arange(20, 24), np.arange(3, 5), 7),
                (np.arange(40, 42), np.arange(20, 21), 3)]
    s_pages, d_pages, s_offsets, d_offsets = flatten([(s, d) for s, d, _ in requests])
    tokens = np.array([n for _, _, n in requests], dtype=np.int64)
    got = t.plan_batch_flat(s_pages, d_pages, s_offsets, dst_offsets=d_offsets,
                            n_tokens=tokens, digests=True)
    same_batch(t.plan_batch(requests, digests=True), got, digests=True)
    assert got.request_bytes.tolist() == [t.plan(s, d, n_tokens=n).total_bytes
                                          for s, d, n in requests]
    # The counts matter: without them every request moves the full pages of its shorter side.
    assert t.plan_batch_flat(s_pages, d_pages, s_offsets, dst_offsets=d_offsets).total_bytes \
        > got.total_bytes


def test_an_empty_flat_batch_is_an_empty_batch() -> None:
    model, rank = Model(layers=2, mla=True), Rank(capacity=16)
    t = kvplan.Template(rank_memory(model, rank, seed=1).layout, rank_memory(model, rank).layout)
    none = np.zeros(0, dtype=np.int32)
    empty = t.plan_batch_flat(none, none, np.zeros(1, dtype=np.int64))
    same_batch(t.plan_batch([]), empty)
    # Requests without pages are requests too.
    pages = np.array([1, 2], dtype=np.int32), np.array([5, 6], dtype=np.int32)
    offsets = np.array([0, 0, 2, 2], dtype=np.int64)
    got = t.plan_batch_flat(*pages, offsets)
    same_batch(t.plan_batch([(none, none), pages, (none, none)]), got)
    assert got.n_requests == 3


def test_bad_flat_batches_name_the_values() -> None:
    model, rank = Model(layers=2, mla=True), Rank(capacity=16)
    t = kvplan.Template(rank_memory(model, rank, seed=1).layout, rank_memory(model, rank).layout)
    src = np.array([0, 1, 5, 7, 8], dtype=np.int64)
    dst = np.array([3, 4, 9, 12, 13], dtype=np.int64)
    offsets = np.array([0, 2, 3, 5], dtype=np.int64)
    assert t.plan_batch_flat(src, dst, offsets).n_requests == 3

    def refused(match: str, *args: object, **kwargs: object) -> kvplan.KvPlanError:
        with pytest.raises(kvplan.KvPlanError, match=match) as e:
            t.plan_batch_flat(*args, **kwargs)
        return e.value

    bad = [
        (np.array([1, 2, 3, 5]), r"flat batch: offsets\[0\] is 1; offsets start at 0"),
        (np.array([0, 3, 2, 5]), r"offsets\[2\] = 2 is less than offsets\[1\] = 3; offsets must "
                                 "not decrease"),
        (np.array([0, -1, 3, 5]), r"offsets\[1\] = -1 is negative"),
        (np.array([0, 2, 3, 4]), r"offsets\[3\] = 4 but src_pages has 5 values"),
        (np.array([0, 2, 3, 6]), r"offsets\[3\] = 6 but src_pages has 5 values"),
        (np.zeros(0, dtype=np.int64), r"offsets is empty"),
    ]
    for values, match in bad:
        assert refused(match, src, dst, values.astype(np.int64)).kind == "flat_batch"
    e = refused(r"offsets\[3\] = 5 but dst_pages has 4 values; .*offsets serve both sides when "
                "dst_offsets is not given", src, dst[:4], offsets)
    assert e.kind == "flat_batch"
    refused(r"dst_offsets\[3\] = 4 but dst_pages has 5 values", src, dst, offsets,
            dst_offsets=np.array([0, 2, 3, 4]))
    refused(r"dst_offsets\[2\] = 1 is less than dst_offsets\[1\] = 2", src, dst, offsets,
            dst_offsets=np.array([0, 2, 1, 5]))
    refused(r"offsets has 4 values but dst_offsets has 3", src, dst, offsets,
            dst_offsets=np.array([0, 2, 5]))
    refused(r"n_tokens has 2 values for 3 requests", src, dst, offsets,
            n_tokens=np.array([1, 2]))
    refused(r"n_tokens\[1\] = -2 is negative", src, dst, offsets, n_tokens=np.array([1, -2, 1]))

    # The requests' own errors name the request, as plan_batch's do.
    with pytest.raises(kvplan.IndexBoundsError,
                       match=r"request 1 of the batch: src index -5 at position 0 is negative"):
        t.plan_batch_flat(np.array([0, 1, -5, 7, 8]), dst, offsets)
    with pytest.raises(kvplan.IndexBoundsError,
                       match=r"request 2 of the batch: dst index 16 at position 1"):
        t.plan_batch_flat(src, np.array([3, 4, 9, 12, 16]), offsets)
    with pytest.raises(kvplan.IndexBoundsError, match="requests 0 and 2 .* dst page 4") as ov:
        t.plan_batch_flat(src, np.array([3, 4, 9, 12, 4]), offsets)
    assert ov.value.kind == "requests_overlap"
    with pytest.raises(kvplan.KvPlanError, match="request 0 of the batch: src has 2 indices"):
        t.plan_batch_flat(src, dst, offsets, dst_offsets=np.array([0, 1, 3, 5]))

    # Arrays of the wrong type, dtype or shape.
    with pytest.raises(TypeError, match="offsets must be a 1-D numpy array of dtype int64, got "
                                        "a 1-D numpy array of dtype int32; convert with"):
        t.plan_batch_flat(src, dst, offsets.astype(np.int32))
    with pytest.raises(TypeError, match="offsets must be a 1-D numpy array of dtype int64, got "
                                        "a 2-D numpy array of dtype int64$"):
        t.plan_batch_flat(src, dst, offsets.reshape(2, 2))
    with pytest.raises(TypeError, match="offsets must be a 1-D numpy array of dtype int64, got "
                                        "list"):
        t.plan_batch_flat(src, dst, [0, 2, 3, 5])
    with pytest.raises(TypeError, match="dst_offsets must be a 1-D numpy array of dtype int64"):
        t.plan_batch_flat(src, dst, offsets, dst_offsets=offsets.astype(np.uint64))
    with pytest.raises(TypeError, match="n_tokens must be a 1-D numpy array of dtype int64"):
        t.plan_batch_flat(src, dst, offsets, n_tokens=np.array([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match="src_pages must be a 1-D numpy array of dtype int32 or "
                                        "int64"):
        t.plan_batch_flat(src.astype(np.float64), dst, offsets)
    with pytest.raises(TypeError, match="dst_pages must be a 1-D numpy array"):
        t.plan_batch_flat(src, dst.reshape(1, 5), offsets)
    with pytest.raises(TypeError, match="offsets must be C-contiguous"):
        t.plan_batch_flat(src, dst, np.array([0, 9, 2, 9, 3, 9, 5, 9])[::2])
    with pytest.raises(TypeError, match="src_pages must be C-contiguous"):
        t.plan_batch_flat(np.repeat(src, 2)[::2], dst, offsets)


def test_a_flat_batch_takes_read_only_arrays() -> None:
    """Read-only arrays (a frozen page table) are read in place, as plan_batch reads them."""
    model, rank = Model(layers=2, mla=True), Rank(capacity=16)
    t = kvplan.Template(rank_memory(model, rank, seed=1).layout, rank_memory(model, rank).layout)
    src = np.array([0, 1], dtype=np.int32)
    dst = np.array([3, 4], dtype=np.int32)
    offsets = np.array([0, 2], dtype=np.int64)
    src.flags.writeable = False
    offsets.flags.writeable = False
    same_batch(t.plan_batch([(src, dst)]), t.plan_batch_flat(src, dst, offsets))
