"""Pools of their own (``Layout.with_pool``): each one page index space with its own page size,
as vLLM keeps one block table per KV-cache group, and rows of several tokens (a compressed
cache) that move once complete. Checked byte for byte against the oracle
(``kvplan.testing.oracle.reference_copy``), which addresses each entry from the layout
definition alone."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.exec import Plan
from kvplan.exec.numpy import Memory, apply_plan, run
from kvplan.presets import DECODE_BASE, get_preset
from kvplan.testing.oracle import reference_copy

BASE = 0x10_0000
TOKEN = 4  # bytes per token of a request's-pages entry
ROW = 6  # bytes per row of an entry in a further pool


def side(page_size: int, pools: list[tuple[int, int]], capacity: int, seed: int,
         ) -> tuple[kvplan.Layout, Memory]:
    """One side: two entries on the request's pages (``page_size`` tokens per page), then two
    per further pool ``(page size, tokens per row)``, each pool added with ``with_pool``; the
    memory holds random bytes."""
    items = [page_size * TOKEN] * 2 + [p // r * ROW for p, r in pools for _ in range(2)]
    lens = [capacity * item for item in items]
    ptrs = [BASE + sum(lens[:k]) for k in range(len(items))]
    layout = kvplan.Layout(ptrs, lens, items, list(range(len(items))), ["kv"] * len(items),
                           page_size=page_size)
    for k, (p, r) in enumerate(pools):
        layout = layout.with_pool([2 + 2 * k, 3 + 2 * k], p, tokens_per_row=r)
    rng = np.random.default_rng(seed)
    return layout, Memory(rng.integers(0, 256, sum(lens), dtype=np.uint8), BASE)


def pages(rng: np.random.Generator, n_tokens: int, page_size: int, capacity: int) -> np.ndarray:
    return rng.permutation(capacity)[:-(-n_tokens // page_size)].astype(np.int64)


def check(src_pools: list[tuple[int, int]], dst_pools: list[tuple[int, int]],
          page_sizes: tuple[int, int], n: int, skip: int, seed: int) -> kvplan.TransferPlan:
    capacity = 64
    src, src_mem = side(page_sizes[0], src_pools, capacity, seed)
    dst, dst_mem = side(page_sizes[1], dst_pools, capacity, seed + 1)
    rng = np.random.default_rng(seed)
    lists = {k + 1: (pages(rng, n, a[0], capacity), pages(rng, n, b[0], capacity))
             for k, (a, b) in enumerate(zip(src_pools, dst_pools))}
    sp, dp = pages(rng, n, page_sizes[0], capacity), pages(rng, n, page_sizes[1], capacity)
    request = kvplan.Request(sp, dp, pool_pages=lists, n_tokens=n, skip_tokens=skip)
    plan = kvplan.Template(src, dst).plan(request)
    got, want = dst_mem.copy(), dst_mem.copy()
    written = np.zeros(got.data.size, dtype=bool)
    apply_plan(plan, src_mem, got, written)
    moved = reference_copy(src, src_mem, dst, want, sp, dp, n_tokens=n, skip_tokens=skip,
                           pool_pages=lists)
    assert plan.total_bytes == moved
    assert np.array_equal(got.data, want.data)
    return plan


@st.composite
def pooled(draw: st.DrawFn) -> dict[str, object]:
    n_pools = draw(st.integers(1, 3))
    rows = [draw(st.sampled_from([1, 2, 4, 8])) for _ in range(n_pools)]
    sizes = [tuple(r * draw(st.integers(1, 4)) for _ in range(2)) for r in rows]
    n = draw(st.integers(0, 60))
    # Per pool, a token range of its own (``pool_tokens``) or none (the request's).
    ranges = [draw(st.none() | st.integers(0, 60).flatmap(
        lambda m: st.tuples(st.just(m), st.integers(0, m)))) for _ in range(n_pools)]
    return dict(src=[(s[0], r) for s, r in zip(sizes, rows)],
                dst=[(s[1], r) for s, r in zip(sizes, rows)],
                pages=(draw(st.integers(1, 6)), draw(st.integers(1, 6))), n=n,
                skip=draw(st.integers(0, n)), seed=draw(st.integers(0, 2**16)), ranges=ranges)


@settings(max_examples=300, deadline=None)
@given(pooled())
def test_n_pools_with_their_own_page_sizes_and_rows_move_byte_exact(case: dict[str, object],
                                                                   ) -> None:
    check(case["src"], case["dst"], case["pages"], case["n"], case["skip"],  # type: ignore[arg-type]
          case["seed"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "skip", "rows"), [
    (3, 0, []),          # no row complete yet
    (4, 0, [0]),
    (9, 0, [0, 1]),      # the partial last row (token 8) waits
    (9, 3, [0, 1]),      # a delta from inside row 0 moves row 0: the request before did not
    (9, 4, [1]),
    (12, 8, [2]),
    (12, 9, [2]),
])
def test_a_row_moves_once_its_last_token_is_in_the_request(n: int, skip: int,
                                                           rows: list[int]) -> None:
    plan = check([(8, 4)], [(8, 4)], (4, 4), n, skip, seed=3)
    # Two row entries: their bytes are the complete rows' bytes, each entry's rows once.
    token_entries = 2 * (n - skip) * TOKEN
    assert plan.total_bytes - token_entries == 2 * len(rows) * ROW


def test_the_pool_pages_a_request_must_give_and_may_not_give() -> None:
    src, _ = side(4, [(8, 4)], 16, 0)
    dst, _ = side(4, [(8, 4)], 16, 1)
    t = kvplan.Template(src, dst)
    p = np.arange(3, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="keeps pool 1 .8 tokens per page, 4 per row.: "
                       "the request must give that side's pages of pool 1"):
        t.plan(kvplan.Request(p, p, n_tokens=8))
    with pytest.raises(kvplan.KvPlanError, match="pool 2 were given for the src side, whose "
                       "layout keeps no pool 2"):
        t.plan(kvplan.Request(p, p, n_tokens=8, pool_pages={1: (p, p), 2: (p, p)}))
    with pytest.raises(kvplan.KvPlanError, match="not a further pool id"):
        kvplan.Request(p, p, pool_pages={0: (p, p)})
    with pytest.raises(TypeError, match="both as window_pages and in pool_pages"):
        kvplan.Request(p, p, window_pages=(p, p), pool_pages={1: (p, p)})
    six = np.arange(6, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="n_tokens 24 needs 3 src pool 1 pages of 8 "
                       "tokens, but 1 were given"):
        t.plan(kvplan.Request(six, six, n_tokens=24, pool_pages={1: (p[:1], p)}))


def test_pool_values_are_refused_where_the_layout_is_built() -> None:
    layout, _ = side(4, [], 16, 0)
    with pytest.raises(kvplan.LayoutError, match="page_size must be a multiple of its "
                       "tokens_per_row .* got page_size 6, tokens_per_row 4"):
        layout.with_pool([0], 6, tokens_per_row=4)
    with pytest.raises(kvplan.LayoutError, match="at least 1"):
        layout.with_pool([0], 0)
    with pytest.raises(kvplan.LayoutError, match="entry 7 is out of range"):
        layout.with_pool([7], 4)
    pooled = layout.with_pool(["kv"], 8, tokens_per_row=2)
    assert pooled.pools == [(0, 4, 1), (1, 8, 2)]
    assert pooled.entry_pools == [1, 1]
    with pytest.raises(kvplan.LayoutError, match="already in a pool of its own"):
        pooled.with_pool([0], 8)
    with pytest.raises(kvplan.LayoutError, match='no page entry .* has role "x"'):
        layout.with_pool(["x"], 8)
    with pytest.raises(TypeError, match="entry indices or of role names"):
        layout.with_pool("kv", 8)


def test_rows_of_different_sizes_on_the_two_sides_are_refused_naming_both() -> None:
    src, _ = side(4, [(8, 4)], 16, 0)
    dst, _ = side(4, [(8, 2)], 16, 1)
    p = np.arange(3, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="a row holds 4 tokens on the prefill side "
                       "and 2 on the decode side"):
        kvplan.Template(src, dst).plan(kvplan.Request(p, p, n_tokens=8,
                                                      pool_pages={1: (p, p)}))


def test_a_layout_with_a_further_pool_travels_on_the_wire() -> None:
    layout, _ = side(4, [(8, 4)], 16, 0)
    back = kvplan.Layout.from_bytes(layout.to_bytes())
    assert back == layout and back.pools == [(0, 4, 1), (1, 8, 4)]


def test_a_row_gather_refuses_a_template_with_a_pool_of_its_own() -> None:
    src, _ = side(4, [(8, 4)], 16, 0)
    dst, _ = side(4, [(8, 4)], 16, 1)
    p, q = np.arange(4, dtype=np.int64), np.arange(2, dtype=np.int64)
    request = kvplan.Request(p, p, n_tokens=16, pool_pages={1: (q, q)})
    with pytest.raises(kvplan.KvPlanError, match="row gather gathers the rows of the request's "
                       "pages; this template has entries in a pool of their own .prefill pool "
                       "1, decode pool 1."):
        kvplan.Template(src, dst).plan_row_gather(request, pack=(1 << 44, 1 << 20))


def test_the_dict_form_carries_the_pools() -> None:
    layout, _ = side(4, [(8, 4), (16, 2)], 16, 0)
    back = kvplan.Layout.from_dict(layout.to_dict())
    assert back == layout
    assert back.pools == [(0, 4, 1), (1, 8, 4), (2, 16, 2)]
    assert back.entry_pools == [0, 0, 1, 1, 2, 2]


def test_the_deepseek_v4_preset_plans_end_to_end_byte_exact() -> None:
    """Every component of DeepSeek-V4 (four layers), 300 tokens then a delta to 520: windows,
    4-token rows on the request's pages and 128-token rows in their own pool, each planned
    once and checked against the oracle."""
    preset = get_preset("deepseek-v4", 4)
    src = preset.layout(range(4), page_size=64, capacity=12)
    dst = preset.layout(range(4), page_size=64, capacity=12, base=DECODE_BASE)
    t = kvplan.Template(src, dst)
    rng = np.random.default_rng(7)
    span = [(min(e.data_ptr for e in lay.entries()),
             max(e.data_ptr + e.data_len for e in lay.entries())) for lay in (src, dst)]
    src_mem = Memory(rng.integers(0, 256, span[0][1] - span[0][0], dtype=np.uint8), span[0][0])
    dst_mem = Memory(np.zeros(span[1][1] - span[1][0], dtype=np.uint8), span[1][0])
    sp, dp = rng.permutation(12)[:9].astype(np.int64), rng.permutation(12)[:9].astype(np.int64)
    pool = {1: (rng.permutation(12)[:5].astype(np.int64), rng.permutation(12)[:5].astype(np.int64))}
    for n, skip in ((300, 0), (520, 300)):
        plan = t.plan(kvplan.Request(sp, dp, n_tokens=n, skip_tokens=skip, pool_pages=pool))
        got, want = dst_mem.copy(), dst_mem.copy()
        apply_plan(plan, src_mem, got)
        moved = reference_copy(src, src_mem, dst, want, sp, dp, n_tokens=n, skip_tokens=skip,
                               pool_pages=pool)
        assert plan.total_bytes == moved
        assert np.array_equal(got.data, want.data)
        dst_mem = got
    # The delta moved the 128-token rows 2 and 3 (complete at 520; row 2 waited at 300).
    rows = [b for b in zip(*plan.as_lists()) if b[2] == 584]
    assert len(rows) == 2 * 2


SRC_STAGING, DST_STAGING = 0x4000_0000, 0x8000_0000


@settings(max_examples=60, deadline=None)
@given(pooled())
def test_staged_packed_and_round_plans_of_a_pooled_request_land_as_the_direct_plan(
        case: dict[str, object]) -> None:
    """The multi-stage planners derive from the direct plan, pools, rows and each pool's own
    token range included: each leaves the decode memory exactly as the direct plan does
    (deltas of the request's pages are not staged; a pool's range may start past 0)."""
    src_pools = cast("list[tuple[int, int]]", case["src"])
    dst_pools = cast("list[tuple[int, int]]", case["dst"])
    page_sizes = cast("tuple[int, int]", case["pages"])
    ranges = cast("list[tuple[int, int] | None]", case["ranges"])
    n, seed = cast(int, case["n"]), cast(int, case["seed"])
    capacity = 64
    src, src_mem = side(page_sizes[0], src_pools, capacity, seed)
    dst, dst_mem = side(page_sizes[1], dst_pools, capacity, seed + 1)
    rng = np.random.default_rng(seed)
    own = {k + 1: r for k, r in enumerate(ranges) if r is not None}
    lists = {k + 1: (pages(rng, own.get(k + 1, (n, 0))[0], a[0], capacity),
                     pages(rng, own.get(k + 1, (n, 0))[0], b[0], capacity))
             for k, (a, b) in enumerate(zip(src_pools, dst_pools))}
    sp = pages(rng, n, page_sizes[0], capacity)
    dp = pages(rng, n, page_sizes[1], capacity)
    request = kvplan.Request(sp, dp, pool_pages=lists, n_tokens=n, pool_tokens=own or None)
    template = kvplan.Template(src, dst)
    direct = template.plan(request)
    want = dst_mem.copy()
    apply_plan(direct, src_mem, want)
    size = max(direct.total_bytes, 1)

    def staging(base: int, n_bytes: int) -> Memory:
        return Memory(np.zeros(n_bytes, dtype=np.uint8), base)

    plans: dict[str, tuple[Plan, int]] = {
        "staged": (template.plan_staged(request, src_staging=(SRC_STAGING, size),
                                        dst_staging=(DST_STAGING, size)), size),
        "packed": (template.plan_packed(request, pack=(SRC_STAGING, size)), size),
        "rounds": (template.plan_rounds(request, src_arena=(SRC_STAGING, 64),
                                        dst_arena=(DST_STAGING, 64)), 64),
    }
    for name, (plan, n_bytes) in plans.items():
        got = dst_mem.copy()
        run(plan, src_mem, got, src_staging=staging(SRC_STAGING, n_bytes),
            dst_staging=staging(DST_STAGING, n_bytes))
        assert np.array_equal(got.data, want.data), name
