"""Batches of token requests, pooled requests and requests with per-pool ranges merge blocks
across consecutive requests as page requests do: a batch copies exactly the bytes of its
requests (``kvplan.testing.oracle.reference_copy``, each pool through its own template), holds
as many blocks as the per-pool single-pool templates' page batches of the same requests (the
per-group path), never more, and a block range names exactly the requests with bytes in it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

import kvplan
from kvplan.exec.numpy import Memory, apply_plan
from kvplan.testing.oracle import reference_copy
from support.recording_transport import RecordingTransport

BASE = 0x10_0000
PAGE = 4  # tokens per page, in every pool
TOKEN = 8  # bytes per token of an entry
CAPACITY = 64  # pages per entry
ITEM = PAGE * TOKEN
Pages = npt.NDArray[np.int64]
Held = Callable[[npt.NDArray[np.uint64], npt.NDArray[np.uint64]], list[int]]


class Side:
    """Four entries: 0 and 1 on the request's pages, 2 and 3 in pool 1; the pooled layout, each
    pool's entries as a layout of their own (the same memory), and random bytes."""

    def __init__(self, seed: int) -> None:
        ptrs = [BASE + k * CAPACITY * ITEM for k in range(4)]

        def layout(ix: list[int]) -> kvplan.Layout:
            return kvplan.Layout([ptrs[i] for i in ix], [CAPACITY * ITEM] * len(ix),
                                 [ITEM] * len(ix), ix, ["kv"] * len(ix), page_size=PAGE)

        self.pooled = layout([0, 1, 2, 3]).with_pool([2, 3], PAGE)
        self.parts = [layout([0, 1]), layout([2, 3])]
        rng = np.random.default_rng(seed)
        self.memory = Memory(rng.integers(1, 256, 4 * CAPACITY * ITEM, dtype=np.uint8), BASE)


def chained(rng: np.random.Generator, counts: list[int]) -> list[tuple[Pages, Pages]]:
    """One pool's pages of each request (``counts[r]`` pages): ascending, about half the
    requests continuing the one before on both sides; destinations disjoint."""
    s_at, d_at = 0, 0
    out = []
    for k in counts:
        if rng.random() < 0.5:
            s_at += int(rng.integers(1, 4))
            d_at += int(rng.integers(1, 4))
        s, d = [], []
        for _ in range(k):
            s.append(s_at)
            d.append(d_at)
            s_at += 1 + int(rng.random() < 0.25)
            d_at += 1 + int(rng.random() < 0.25)
        out.append((np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)))
    assert s_at < CAPACITY and d_at < CAPACITY
    return out


def batch_case(seed: int) -> tuple[list[kvplan.Request], list[list[tuple[Pages, Pages]]]]:
    """Requests over both pools: each pool with its own range (even seeds) or one range for
    both (as many pages in each); whole pages move."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    counts = [int(rng.integers(0, 4)) for _ in range(n)]
    own = seed % 2 == 0
    pools = [chained(rng, counts), chained(rng, [int(rng.integers(0, 4)) for _ in range(n)]
                                           if own else counts)]
    requests = []
    for (s0, d0), (s1, d1) in zip(*pools, strict=True):
        ranges = {1: (len(s1) * PAGE, 0)} if own else None
        requests.append(kvplan.Request(s0, d0, pool_pages={1: (s1, d1)}, n_tokens=len(s0) * PAGE,
                                       pool_tokens=ranges))
    return requests, pools


def owners(plans: list[kvplan.TransferPlan]) -> Held:
    """A function of a block range's ``(dst, lengths)`` giving the requests with a destination
    byte in it, from each request's own plan."""
    spans = sorted((a, a + n, r) for r, plan in enumerate(plans)
                   for a, n in zip(plan.dst_addrs.tolist(), plan.lengths.tolist(), strict=True))
    assert all(b <= a for (_, b, _), (a, _, _) in zip(spans, spans[1:])), "disjoint requests"

    def held(dst: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]) -> list[int]:
        found = {r for a, n in zip(dst.tolist(), lengths.tolist(), strict=True)
                 for lo, hi, r in spans if lo < a + n and a < hi}
        return sorted(found)

    return held


@pytest.mark.parametrize("seed", range(24))
def test_a_pooled_batch_copies_its_requests_bytes_in_the_per_group_block_count(seed: int) -> None:
    src, dst = Side(seed), Side(seed + 100)
    template = kvplan.Template(src.pooled, dst.pooled)
    requests, pools = batch_case(seed)
    batch = template.plan_batch(requests)
    got, want = dst.memory.copy(), dst.memory.copy()
    apply_plan(batch, src.memory, got)
    moved = 0
    for g, (s_part, d_part) in enumerate(zip(src.parts, dst.parts, strict=True)):
        for s, d in pools[g]:
            moved += reference_copy(s_part, src.memory, d_part, want, s, d, n_tokens=len(s) * PAGE)
    assert batch.total_bytes == moved
    assert np.array_equal(got.data, want.data)
    per_group = sum(kvplan.Template(s_part, d_part).plan_batch(pools[g]).n_blocks
                    for g, (s_part, d_part) in enumerate(zip(src.parts, dst.parts, strict=True)))
    alone = [template.plan(r) for r in requests]
    assert batch.n_blocks == per_group <= sum(p.n_blocks for p in alone)


@pytest.mark.parametrize("seed", range(12))
def test_a_pooled_batch_names_exactly_the_requests_with_bytes_in_a_call(seed: int) -> None:
    src, dst = Side(seed), Side(seed + 100)
    template = kvplan.Template(src.pooled, dst.pooled)
    requests, _ = batch_case(seed + 1000)
    batch = template.plan_batch(requests)
    held = owners([template.plan(r) for r in requests])
    dst_addrs, lengths = batch.dst_addrs, batch.lengths
    rng = np.random.default_rng(seed)
    ranges = [(b, b + 1) for b in range(batch.n_blocks)]
    for bound in (1, 2, 3, 5):
        ranges += batch.call_ranges(bound).tolist()
    for _ in range(10):
        lo = int(rng.integers(0, batch.n_blocks))
        ranges.append((lo, int(rng.integers(lo + 1, batch.n_blocks + 1))))
    for lo, hi in ranges:
        assert batch.requests_in(lo, hi).tolist() == held(dst_addrs[lo:hi], lengths[lo:hi])
    calls = batch.call_ranges(2).tolist()
    lo, hi = calls[int(rng.integers(0, len(calls)))]
    outcome = RecordingTransport(fail_at=lo).submit_batch(batch, "peer", max_blocks_per_batch=2,
                                                          check_sources=False)
    assert outcome.failed_requests == held(dst_addrs[lo:hi], lengths[lo:hi])


def test_pooled_batches_merge_across_requests() -> None:
    """Over the seeds, requests fuse: the merging is exercised, not only allowed."""
    fused = 0
    for seed in range(24):
        requests, _ = batch_case(seed)
        batch = kvplan.Template(Side(0).pooled, Side(1).pooled).plan_batch(requests)
        fused += batch.n_requests - batch.n_segments
    assert fused > 20


def i(*x: int) -> Pages:
    return np.array(x, dtype=np.int64)


def one_token_layout(base: int, entries: list[int]) -> kvplan.Layout:
    ptrs = [base + k * 0x10000 for k in entries]
    return kvplan.Layout(ptrs, [0x10000] * len(entries), [64] * len(entries),
                         strides=[64] * len(entries))


def test_one_page_token_requests_that_continue_each_other_share_their_blocks() -> None:
    """Pages of one token: two requests moving one page each, the second right after the first
    on both sides, are one block per entry, as the same pages given as arrays."""
    t = kvplan.Template(one_token_layout(0x100000, [0, 1]), one_token_layout(0x900000, [0, 1]),
                        kvplan.Pairing.positional())
    arrays = t.plan_batch([(i(0), i(10)), (i(1), i(11))])
    tokens = t.plan_batch([kvplan.Request(i(0), i(10), n_tokens=1),
                           kvplan.Request(i(1), i(11), n_tokens=1)])
    assert arrays.n_blocks == tokens.n_blocks == 2
    assert tokens.lengths.tolist() == [128, 128]
    assert tokens.requests_in(0, 1).tolist() == [0, 1]


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_each_pool_merges_where_its_own_pages_continue(order: tuple[int, int]) -> None:
    """Pool 0 continues in one request order, pool 1 in the other: the pooled batch holds what
    the per-group batches of the same order hold."""
    layouts = [one_token_layout(b, [0, 1, 2, 3]).with_pool([2, 3], 1)
               for b in (0x100000, 0x900000)]
    pooled = kvplan.Template(layouts[0], layouts[1], kvplan.Pairing.positional())
    groups = [kvplan.Template(one_token_layout(0x100000, ix), one_token_layout(0x900000, ix),
                              kvplan.Pairing.positional()) for ix in ([0, 1], [2, 3])]
    lists = [((i(0), i(10)), (i(5), i(16))), ((i(1), i(11)), (i(4), i(15)))]
    lists = [lists[k] for k in order]
    batch = pooled.plan_batch([kvplan.Request(*own, pool_pages={1: pool}, n_tokens=1)
                               for own, pool in lists])
    per_group = sum(groups[g].plan_batch([pair[g] for pair in lists]).n_blocks for g in range(2))
    assert batch.n_blocks == per_group == 6


def test_two_requests_writing_one_page_of_a_further_pool_are_refused_naming_both() -> None:
    layouts = [one_token_layout(b, [0, 1, 2, 3]).with_pool([2, 3], 1)
               for b in (0x100000, 0x900000)]
    pooled = kvplan.Template(layouts[0], layouts[1], kvplan.Pairing.positional())
    with pytest.raises(kvplan.KvPlanError, match="requests 0 and 1 of the batch both write dst "
                       "pool 1 page 16") as refused:
        pooled.plan_batch([kvplan.Request(i(0), i(10), pool_pages={1: (i(5), i(16))}),
                           kvplan.Request(i(1), i(11), pool_pages={1: (i(6), i(16))})])
    assert tuple(refused.value.requests) == (0, 1)
