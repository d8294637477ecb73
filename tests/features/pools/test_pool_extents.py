"""Per-pool token ranges (``Request(pool_tokens={pool: (n_tokens, skip_tokens)})``): each
further pool of one template moves its own tokens, as vLLM sets each KV-cache group's block
count apart. A pooled request plans the bytes of the separate per-pool templates' plans, each
checked byte for byte against the oracle (``kvplan.testing.oracle.reference_copy``)."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.exec.numpy import Memory, apply_plan
from kvplan.testing.oracle import reference_copy

BASE = 0x10_0000
TOKEN = 4  # bytes per token of a request's-pages entry
ROW = 6  # bytes per row of an entry in a further pool
CAPACITY = 32
SRC_STAGING, DST_STAGING = 0x7000_0000, 0x7800_0000


class Side:
    """One side: two entries on the request's pages, then two per further pool ``(page size,
    tokens per row)``; the pooled layout, each pool's layout of its own (the same memory), and
    random bytes."""

    def __init__(self, page_size: int, pools: list[tuple[int, int]], seed: int) -> None:
        items = [page_size * TOKEN] * 2 + [p // r * ROW for p, r in pools for _ in range(2)]
        lens = [CAPACITY * item for item in items]
        ptrs = [BASE + sum(lens[:k]) for k in range(len(items))]

        def layout(ix: list[int]) -> kvplan.Layout:
            return kvplan.Layout([ptrs[i] for i in ix], [lens[i] for i in ix],
                                 [items[i] for i in ix], ix, ["kv"] * len(ix),
                                 page_size=page_size)

        self.pooled = layout(list(range(len(items))))
        self.parts = [layout([0, 1])]
        for k, (p, r) in enumerate(pools):
            self.pooled = self.pooled.with_pool([2 + 2 * k, 3 + 2 * k], p, tokens_per_row=r)
            self.parts.append(layout([2 + 2 * k, 3 + 2 * k]).with_pool([0, 1], p,
                                                                        tokens_per_row=r))
        rng = np.random.default_rng(seed)
        self.memory = Memory(rng.integers(0, 256, sum(lens), dtype=np.uint8), BASE)


def pages(rng: np.random.Generator, n_tokens: int, page_size: int) -> np.ndarray:
    return rng.permutation(CAPACITY)[:-(-n_tokens // page_size)].astype(np.int64)


EMPTY = np.zeros(0, dtype=np.int64)


def case(seed: int) -> tuple[Side, Side, kvplan.Request, list[tuple[int, int]],
                             dict[int, tuple[np.ndarray, np.ndarray]]]:
    """A pooled request over 1 to 3 further pools, each pool with its own range (some
    untouched: no tokens, empty pages), the request's pages their own."""
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([2, 4, 8]))
    n_pools = int(rng.integers(1, 4))
    pools = []
    for _ in range(n_pools):
        row = int(rng.choice([1, 2]))
        pools.append((row * int(rng.choice([1, 2, 4])), row))
    src, dst = Side(page_size, pools, seed), Side(page_size, pools, seed + 1)
    ranges = []
    for _ in range(n_pools + 1):
        n = int(rng.integers(0, CAPACITY + 1))
        ranges.append((n, int(rng.integers(0, n + 1)) if rng.random() < 0.5 else 0))
    lists = {}
    for k, (p, _) in enumerate(pools):
        n = ranges[k + 1][0]
        lists[k + 1] = (pages(rng, n, p), pages(rng, n, p)) if n else (EMPTY, EMPTY)
    n0, skip0 = ranges[0]
    sp, dp = (pages(rng, n0, page_size), pages(rng, n0, page_size)) if n0 else (EMPTY, EMPTY)
    request = kvplan.Request(sp, dp, pool_pages=lists, n_tokens=n0, skip_tokens=skip0,
                             pool_tokens={k: ranges[k] for k in range(1, n_pools + 1)})
    return src, dst, request, ranges, lists


@pytest.mark.parametrize("seed", range(40))
def test_a_pooled_request_with_per_pool_ranges_moves_the_per_pool_templates_bytes(
        seed: int) -> None:
    src, dst, request, ranges, lists = case(seed)
    plan = kvplan.Template(src.pooled, dst.pooled).plan(request)
    got, want, parts = dst.memory.copy(), dst.memory.copy(), dst.memory.copy()
    apply_plan(plan, src.memory, got)
    moved = 0
    part_bytes = 0
    for k, ((n, skip), s_part, d_part) in enumerate(zip(ranges, src.parts, dst.parts)):
        if k == 0:
            sp, dp, pool_pages = np.asarray(request.src), np.asarray(request.dst), None
        else:
            sp, dp, pool_pages = EMPTY, EMPTY, {1: lists[k]}
        moved += reference_copy(s_part, src.memory, d_part, want, sp, dp, n_tokens=n,
                                skip_tokens=skip, pool_pages=pool_pages)
        # The pool's own template, planned with the request's one range.
        part = kvplan.Template(s_part, d_part).plan(kvplan.Request(
            sp, dp, pool_pages=pool_pages, n_tokens=n, skip_tokens=skip))
        apply_plan(part, src.memory, parts)
        part_bytes += part.total_bytes
    assert plan.total_bytes == moved == part_bytes
    assert np.array_equal(got.data, want.data)
    assert np.array_equal(parts.data, want.data)


def blocks(plan: kvplan.TransferPlan) -> list[tuple[int, int, int]]:
    return sorted(zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist()))


@pytest.mark.parametrize("seed", range(10))
def test_a_range_equal_to_the_requests_plans_as_the_request_without_one(seed: int) -> None:
    src, dst, request, _, lists = case(seed)
    n, skip = request.n_tokens or 0, request.skip_tokens
    template = kvplan.Template(src.pooled, dst.pooled)
    same = {k: (n, skip) for k in lists}
    sized = {}
    for pool_id, page_size, _ in src.pooled.pools[1:]:
        rng = np.random.default_rng(seed + pool_id)
        sized[pool_id] = (pages(rng, max(n, 1), page_size), pages(rng, max(n, 1), page_size))
    sp, dp = np.asarray(request.src), np.asarray(request.dst)
    plain = template.plan(kvplan.Request(sp, dp, pool_pages=sized, n_tokens=n,
                                         skip_tokens=skip))
    ranged = template.plan(kvplan.Request(sp, dp, pool_pages=sized, n_tokens=n,
                                          skip_tokens=skip, pool_tokens=same))
    assert np.array_equal(plain.src_addrs, ranged.src_addrs)
    assert np.array_equal(plain.dst_addrs, ranged.dst_addrs)
    assert np.array_equal(plain.lengths, ranged.lengths)


def test_a_vllm_attention_and_state_group_move_their_own_block_counts() -> None:
    """Group 0 (the request's pages) moves 3 one-token blocks, group 1 (pool 1) one: as the
    per-group templates do, not one range for both."""
    def layout(base: int) -> kvplan.Layout:
        ptrs = [base + i * 0x10000 for i in range(4)]
        return kvplan.Layout(ptrs, [0x10000] * 4, [64] * 4, strides=[64] * 4)

    def group(base: int, ix: list[int]) -> kvplan.Layout:
        ptrs = [base + i * 0x10000 for i in ix]
        return kvplan.Layout(ptrs, [0x10000] * 2, [64] * 2, strides=[64] * 2)

    def i(*x: int) -> np.ndarray:
        return np.array(x, dtype=np.int64)

    pooled = kvplan.Template(layout(0x100000).with_pool([2, 3], 1),
                             layout(0x900000).with_pool([2, 3], 1), kvplan.Pairing.positional())
    groups = [kvplan.Template(group(0x100000, ix), group(0x900000, ix),
                              kvplan.Pairing.positional()) for ix in ([0, 1], [2, 3])]
    plan = pooled.plan(kvplan.Request(i(1, 2, 3), i(4, 5, 6), pool_pages={1: (i(7), i(8))},
                                      n_tokens=3, pool_tokens={1: (1, 0)}))
    want = blocks(groups[0].plan(i(1, 2, 3), i(4, 5, 6))) + blocks(groups[1].plan(i(7), i(8)))
    assert blocks(plan) == sorted(want)
    assert plan.total_bytes == 512


def test_a_layout_with_every_entry_in_further_pools_needs_no_request_pages() -> None:
    src, dst = Side(4, [(2, 1)], 0), Side(4, [(2, 1)], 1)
    s_part, d_part = src.parts[1], dst.parts[1]
    lists = {1: (np.array([3, 5], dtype=np.int64), np.array([6, 1], dtype=np.int64))}
    template = kvplan.Template(s_part, d_part)
    want = dst.memory.copy()
    moved = reference_copy(s_part, src.memory, d_part, want, EMPTY, EMPTY, n_tokens=3,
                           pool_pages=lists)
    for request in (kvplan.Request(EMPTY, EMPTY, pool_pages=lists, n_tokens=3),
                    kvplan.Request(EMPTY, EMPTY, pool_pages=lists, pool_tokens={1: (3, 0)})):
        plan = template.plan(request)
        got = dst.memory.copy()
        apply_plan(plan, src.memory, got)
        assert plan.total_bytes == moved == 3 * 2 * ROW
        assert np.array_equal(got.data, want.data)


def test_a_pool_the_request_does_not_touch_moves_nothing() -> None:
    src, dst = Side(4, [(4, 1), (2, 2)], 3), Side(4, [(4, 1), (2, 2)], 4)
    p = np.arange(2, dtype=np.int64)
    template = kvplan.Template(src.pooled, dst.pooled)
    plan = template.plan(kvplan.Request(p, p + 2, n_tokens=8, pool_pages={
        1: (EMPTY, EMPTY), 2: (p, p + 4)}, pool_tokens={1: (0, 0), 2: (4, 0)}))
    want = dst.memory.copy()
    moved = reference_copy(src.parts[0], src.memory, dst.parts[0], want, p, p + 2, n_tokens=8)
    moved += reference_copy(src.parts[2], src.memory, dst.parts[2], want, EMPTY, EMPTY,
                            n_tokens=4, pool_pages={1: (p, p + 4)})
    got = dst.memory.copy()
    apply_plan(plan, src.memory, got)
    assert plan.total_bytes == moved == 8 * 2 * TOKEN + 2 * 2 * ROW
    assert np.array_equal(got.data, want.data)


def test_pool_token_ranges_are_refused_naming_pool_side_and_counts() -> None:
    src, dst = Side(4, [(4, 1)], 0), Side(4, [(4, 1)], 1)
    template = kvplan.Template(src.pooled, dst.pooled)
    p = np.arange(2, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="pool_tokens pool id 0 is not a further pool"):
        kvplan.Request(p, p, pool_tokens={0: (4, 0)})
    with pytest.raises(kvplan.KvPlanError, match=r"pool_tokens\[1\]: skip_tokens 5 is past its "
                       "4 tokens"):
        kvplan.Request(p, p, pool_tokens={1: (4, 5)})
    with pytest.raises(TypeError, match=r"pool_tokens\[1\] must be a tuple"):
        kvplan.Request(p, p, pool_tokens={1: 4})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="pool_tokens must be a dict"):
        kvplan.Request(p, p, pool_tokens=[(4, 0)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pool_tokens for a state slot"):
        kvplan.Request(slot=(0, 1), pool_tokens={1: (4, 0)})
    with pytest.raises(kvplan.KvPlanError, match="n_tokens 12 needs 3 dst pool 1 pages of 4 "
                       "tokens, but 2 were given"):
        template.plan(kvplan.Request(p, p, n_tokens=8, pool_pages={1: (p.repeat(2)[:3], p)},
                                     pool_tokens={1: (12, 0)}))
    with pytest.raises(kvplan.KvPlanError, match="neither side's layout keeps a pool 2") as e:
        template.plan(kvplan.Request(p, p, n_tokens=8, pool_pages={1: (p, p)},
                                     pool_tokens={2: (4, 0)}))
    assert e.value.kind == "geometry"
    plain = kvplan.Template(src.parts[0], dst.parts[0])
    with pytest.raises(kvplan.KvPlanError, match="neither side's layout keeps a pool 1"):
        plain.plan(kvplan.Request(p, p, pool_tokens={1: (4, 0)}))
    request = kvplan.Request(p, p, n_tokens=8, pool_pages={1: (p, p)}, pool_tokens={1: (4, 0)})
    # Staged, packed and round plans take a pool's own range (tests/features/pools/test_pools.py
    # lands them byte for byte); a row gather, which walks one token range, refuses it.
    with pytest.raises(kvplan.UnsupportedError, match="own .pool_tokens.: plan it with "
                       "Template::plan") as u:
        template.plan_row_gather(request, pack=(SRC_STAGING, 4096))
    assert (u.value.planner, u.value.feature) == ("plan_row_gather", "pool_range")


def test_the_request_value_carries_its_pool_ranges() -> None:
    p = np.arange(2, dtype=np.int64)
    request = kvplan.Request(p, p, pool_pages={2: (p, p)}, pool_tokens={2: (3, 1)})
    assert request.pool_tokens == {2: (3, 1)}
    assert "pool_tokens={2: (3, 1)}" in repr(request)
    assert kvplan.Request(p, p).pool_tokens is None


def byte_pairs(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """Every (source byte, destination byte) a plan copies: equal however blocks merge."""
    return sorted((int(s) + i, int(d) + i) for s, d, n in zip(src, dst, lengths)
                  for i in range(int(n)))


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_of_requests_with_pool_ranges_copies_each_requests_bytes(seed: int) -> None:
    src, dst = Side(4, [(4, 1), (2, 2)], seed), Side(4, [(4, 1), (2, 2)], seed + 1)
    template = kvplan.Template(src.pooled, dst.pooled)
    rng = np.random.default_rng(seed)
    order = [rng.permutation(CAPACITY).astype(np.int64) for _ in range(6)]
    requests = []
    for r in range(2):
        n0, n1, n2 = (int(x) for x in rng.integers(1, 9, 3))
        take = [o[r * 8:r * 8 + 8] for o in order]
        requests.append(kvplan.Request(
            take[0][:-(-n0 // 4)], take[1][:-(-n0 // 4)], n_tokens=n0,
            pool_pages={1: (take[2][:-(-n1 // 4)], take[3][:-(-n1 // 4)]),
                        2: (take[4][:-(-n2 // 2)], take[5][:-(-n2 // 2)])},
            pool_tokens={1: (n1, 0), 2: (n2, int(rng.integers(0, n2 + 1)))}))
    batch = template.plan_batch(requests)
    alone = [template.plan(r) for r in requests]
    assert batch.total_bytes == sum(p.total_bytes for p in alone)
    want = sorted(pair for p in alone for pair in byte_pairs(p.src_addrs, p.dst_addrs,
                                                               p.lengths))
    assert byte_pairs(batch.src_addrs, batch.dst_addrs, batch.lengths) == want
