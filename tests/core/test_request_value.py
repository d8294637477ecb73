"""``kvplan.Request``: one request as a value, accepted by every planner method in place of its
page arrays. The Request form plans exactly what the loose form plans (columns equal) for page,
token, delta, window-pool, state-slot and batch requests; a feature a planner does not plan is
the core's ``UnsupportedError`` naming both; the constructor checks what needs no template; and
the Request holds the caller's arrays, not copies."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan import Request
from kvplan.testing.ranks import Model, Rank, rank_memory

SEED = 20260


def _template(page_sizes: tuple[int, int] = (4, 4), window: int | None = None,
              orders: tuple[str, str] = ("NHD", "NHD")) -> kvplan.Template:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2, window=window)
    src = rank_memory(model, Rank(0, 1, page_sizes[0], orders[0], 32), seed=1)
    dst = rank_memory(model, Rank(0, 1, page_sizes[1], orders[1], 32))
    return kvplan.Template(src.layout, dst.layout)


def _pooled(window_page_size: int | None, page_size: int = 4) -> kvplan.Layout:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2, window=8)
    return rank_memory(model, Rank(0, 1, page_size, "NHD", 16, window_page_size=window_page_size,
                                   window_capacity=6)).layout


def _state_template() -> kvplan.Template:
    src = kvplan.Layout.mla([500], [640], 64, layer_ids=[7]).with_state(
        "mamba_conv", [10000], [100], [16], [7])
    dst = kvplan.Layout.mla([600], [640], 64, layer_ids=[7]).with_state(
        "mamba_conv", [20000], [160], [16], [7])
    return kvplan.Template(src, dst)


def _cols(plan: kvplan.TransferPlan) -> tuple[list[int], list[int], list[int]]:
    return plan.as_lists()


def _pages(rng: np.random.Generator, n: int, dtype: type = np.int64) -> np.ndarray:
    return rng.permutation(32)[:n].astype(dtype)


# ------------------------------------------------------------------- the same plan, either form


@pytest.mark.parametrize("dtypes", [(np.int64, np.int64), (np.int32, np.int64),
                                    (np.int32, np.int32)])
def test_plan_of_a_request_equals_the_loose_form(dtypes: tuple[type, type]) -> None:
    rng = np.random.default_rng(SEED)
    t = _template()
    for _ in range(20):
        n = int(rng.integers(0, 9))
        src, dst = _pages(rng, n, dtypes[0]), _pages(rng, n, dtypes[1])
        assert _cols(t.plan(Request(src, dst))) == _cols(t.plan(src, dst))
        n_tokens = int(rng.integers(0, 4 * n + 1))
        skip = int(rng.integers(0, n_tokens + 1))
        # a token plan
        assert (_cols(t.plan(Request(src, dst, n_tokens=n_tokens)))
                == _cols(t.plan(src, dst, n_tokens=n_tokens)))
        # a delta plan
        req = Request(src, dst, n_tokens=n_tokens, skip_tokens=skip)
        loose = t.plan(src, dst, n_tokens=n_tokens, skip_tokens=skip)
        assert _cols(t.plan(req)) == _cols(loose)
        assert t.plan(req).digest() == loose.digest()


def test_token_plan_between_page_sizes_equals_the_loose_form() -> None:
    rng = np.random.default_rng(SEED + 1)
    t = _template((4, 2), orders=("NHD", "HND"))
    for _ in range(10):
        n_tokens = int(rng.integers(1, 17))
        src, dst = _pages(rng, -(-n_tokens // 4)), _pages(rng, -(-n_tokens // 2))
        skip = int(rng.integers(0, n_tokens + 1))
        assert (_cols(t.plan(Request(src, dst, n_tokens=n_tokens, skip_tokens=skip)))
                == _cols(t.plan(src, dst, n_tokens=n_tokens, skip_tokens=skip)))
        assert _cols(t.plan(Request(src, dst))) == _cols(t.plan(src, dst))


def test_window_pool_request_equals_the_loose_form() -> None:
    t = kvplan.Template(_pooled(2), _pooled(8))
    pages = np.arange(5, dtype=np.int64)
    src_window = np.array([-1] * 5 + [0, 1, 2, 3], dtype=np.int64)
    dst_window = np.array([-1, 0, 3], dtype=np.int64)
    window = (src_window, dst_window)
    loose = t.plan(pages, pages, n_tokens=18, window_pages=window)
    req = Request(pages, pages, n_tokens=18, window_pages=window)
    assert _cols(t.plan(req)) == _cols(loose)
    assert loose.n_blocks > 0
    # The same request with the decode holding its first 12 tokens.
    delta = Request(pages, pages, n_tokens=18, skip_tokens=12, window_pages=window)
    assert _cols(t.plan(delta)) == _cols(
        t.plan(pages, pages, n_tokens=18, skip_tokens=12, window_pages=window))
    # A window pool side missing its pages is the core's error, as in the loose form.
    with pytest.raises(kvplan.KvPlanError, match="keep a pool of their own"):
        t.plan(Request(pages, pages, n_tokens=18))


def test_state_slot_request_equals_plan_state() -> None:
    t = _state_template()
    req = Request(slot=(5, 9))
    expected = ([10000 + 5 * 16], [20000 + 9 * 16], [16])
    assert _cols(t.plan_state(5, 9)) == expected
    assert _cols(t.plan_state(req)) == expected
    assert _cols(t.plan(req)) == expected
    src_idx, dst_idx = t.prepped_state_indices(req)
    old_src, old_dst = t.prepped_state_indices(5, 9)
    assert src_idx.tolist() == old_src.tolist() and dst_idx.tolist() == old_dst.tolist()
    # The slot's bounds are the core's, either form.
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan(Request(slot=(6, 0)))


def test_batch_of_requests_equals_batch_of_tuples() -> None:
    rng = np.random.default_rng(SEED + 2)
    t = _template()
    perm = rng.permutation(32)
    tuples, requests = [], []
    for r in range(4):
        src = perm[4 * r:4 * r + 3].astype(np.int64)
        dst = (31 - perm[4 * r:4 * r + 3]).astype(np.int64)
        n_tokens = None if r % 2 else int(rng.integers(1, 13))
        tuples.append((src, dst, n_tokens))
        requests.append(Request(src, dst, n_tokens=n_tokens))
    by_tuple = t.plan_batch(tuples, digests=True)
    by_value = t.plan_batch(requests, digests=True)
    assert by_value.as_lists() == by_tuple.as_lists()
    assert np.array_equal(by_value.request_digests, by_tuple.request_digests)
    mixed = t.plan_batch([requests[0], tuples[1], requests[2], tuples[3]])
    assert mixed.as_lists() == by_tuple.as_lists()


def test_batch_carries_delta_and_slot_requests() -> None:
    rng = np.random.default_rng(SEED + 3)
    t = _template()
    src, dst = _pages(rng, 3), _pages(rng, 3)
    delta = Request(src, dst, n_tokens=10, skip_tokens=5)
    batch = t.plan_batch([delta])
    assert batch.total_bytes == t.plan(delta).total_bytes
    assert batch.total_bytes == t.plan(src, dst, n_tokens=10, skip_tokens=5).total_bytes
    s = _state_template()
    slot_batch = s.plan_batch([Request(slot=(5, 9))])
    assert slot_batch.as_lists() == _cols(s.plan_state(5, 9))


def test_packed_row_gather_staged_advice_and_prepped_take_a_request() -> None:
    rng = np.random.default_rng(SEED + 4)
    t = _template()
    src, dst = _pages(rng, 4), _pages(rng, 4)
    req, tokens = Request(src, dst), Request(src, dst, n_tokens=13)
    pack = (1 << 40, 1 << 20)
    for a, b in zip(t.plan_packed(req, pack=pack), t.plan_packed(src, dst, pack=pack)):
        assert _cols(a) == _cols(b)
    rows, network = t.plan_row_gather(tokens, pack=pack)
    old_rows, old_network = t.plan_row_gather(src, dst, pack=pack, n_tokens=13)
    assert _cols(network) == _cols(old_network)
    assert [r.tolist() for r in rows.rows] == [r.tolist() for r in old_rows.rows]
    assert rows.copies.tolist() == old_rows.copies.tolist()
    regions = (1 << 40, 1 << 20), (1 << 41, 1 << 20)
    staged = t.plan_staged(tokens, src_staging=regions[0], dst_staging=regions[1])
    old_staged = t.plan_staged(src, dst, n_tokens=13, src_staging=regions[0],
                               dst_staging=regions[1])
    for part in ("gather", "network", "scatter"):
        assert _cols(getattr(staged, part)) == _cols(getattr(old_staged, part))
    cost = kvplan.TransferCost(per_block_s=1e-6, network_bytes_per_s=1e10, copy_bytes_per_s=1e11)
    assert repr(t.transfer_advice(req, cost)) == repr(t.transfer_advice(src, dst, cost))
    assert repr(t.transfer_advice(req, cost=cost)) == repr(t.transfer_advice(src, dst, cost))
    new_idx, old_idx = t.prepped_indices(req), t.prepped_indices(src, dst)
    assert [a.tolist() for a in new_idx] == [a.tolist() for a in old_idx]


def test_conversion_plan_takes_a_request() -> None:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2)
    src = rank_memory(model, Rank(0, 1, 4, "NHD", 16), seed=1).layout
    dst = rank_memory(model, Rank(0, 1, 4, "NHD", 16)).layout
    conv = kvplan.ConversionTemplate(src, dst)
    pages = np.arange(3, dtype=np.int64)
    staging = (1 << 40, 1 << 20)
    new = conv.plan(Request(pages, pages[::-1].copy(), n_tokens=10), staging)
    old = conv.plan(pages, pages[::-1].copy(), staging, n_tokens=10)
    for part in ("gather", "network", "scatter"):
        for a, b in zip(getattr(new, part), getattr(old, part)):
            assert np.array_equal(a, b), part
    assert new.network_bytes == old.network_bytes > 0


def test_out_buffer_with_a_request() -> None:
    t = _template()
    src, dst = np.arange(3, dtype=np.int64), np.arange(3, 6, dtype=np.int64)
    out = np.zeros((3, 64), dtype=np.uint64)
    plan = t.plan(Request(src, dst), out=out)
    assert np.shares_memory(plan.src_addrs, out)
    assert _cols(plan) == _cols(t.plan(src, dst))


# --------------------------------------------------------------- refusals are the core's


@pytest.mark.parametrize(("call", "planner", "feature"), [
    (lambda t, r: t.plan_staged(r, src_staging=(1 << 40, 1 << 20),
                                dst_staging=(1 << 41, 1 << 20)), "plan_staged", "delta"),
    (lambda t, r: t.plan_row_gather(r, pack=(1 << 40, 1 << 20)), "plan_row_gather", "delta"),
    (lambda t, r: t.prepped_indices(r), "descriptor_table", "delta"),
])
def test_a_delta_request_to_a_planner_without_deltas_is_unsupported(
        call: Callable[[kvplan.Template, Request], object], planner: str, feature: str) -> None:
    t = _template()
    req = Request(np.arange(3), np.arange(3), n_tokens=10, skip_tokens=4)
    with pytest.raises(kvplan.UnsupportedError) as e:
        call(t, req)
    assert (e.value.planner, e.value.feature) == (planner, feature)
    assert f"{planner} does not support {feature}" in str(e.value)
    assert "4 tokens" in str(e.value)


# plan_staged and plan_rounds take slot requests (staged as more ranges of the direct plan;
# tests/features/rings/test_hybrid_requests.py); they still refuse delta requests (above).
@pytest.mark.parametrize(("call", "planner"), [
    (lambda t, r: t.plan_row_gather(r, pack=(1 << 40, 1 << 20)), "plan_row_gather"),
])
def test_a_slot_request_to_a_page_only_planner_is_unsupported(
        call: Callable[[kvplan.Template, Request], object], planner: str) -> None:
    with pytest.raises(kvplan.UnsupportedError) as e:
        call(_state_template(), Request(slot=(1, 2)))
    assert (e.value.planner, e.value.feature) == (planner, "state_slot")


def test_the_request_carries_the_token_range_alone() -> None:
    t = _template()
    src = dst = np.arange(3, dtype=np.int64)
    req = Request(src, dst)
    cases: list[tuple[dict[str, Any], str]] = [({"n_tokens": 3}, "n_tokens"), ({"skip_tokens": 1}, "skip_tokens"),
                         ({"window_pages": (src, None)}, "window_pages")]
    for kwargs, name in cases:
        with pytest.raises(TypeError, match=f"plan\\(request\\) takes {name} from the Request"):
            t.plan(req, **kwargs)
    with pytest.raises(TypeError, match="takes dst_pages from the Request"):
        t.plan(req, dst)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="needs dst_pages with src_pages"):
        t.plan(src)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="plan_state plans a state slot; this Request holds page"):
        _state_template().plan_state(req)


# ------------------------------------------------------------------- constructor checks


def test_constructor_refuses_bad_values_naming_them() -> None:
    a = np.arange(3, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="skip_tokens must be a non-negative int.*-1"):
        Request(a, a, skip_tokens=-1)
    with pytest.raises(kvplan.KvPlanError, match="n_tokens must be a non-negative int.*-5"):
        Request(a, a, n_tokens=-5)
    with pytest.raises(kvplan.KvPlanError, match="skip_tokens 9 is past the request's 4 tokens"):
        Request(a, a, n_tokens=4, skip_tokens=9)
    with pytest.raises(TypeError, match="skip_tokens must be a non-negative int, got float"):
        Request(a, a, skip_tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Request.src must be a 1-D numpy array of dtype int32 "
                       "or int64.*float64"):
        Request(a.astype(np.float64), a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Request.dst must be C-contiguous"):
        Request(a, np.arange(6, dtype=np.int64)[::2])
    with pytest.raises(TypeError, match="got src pages but no dst pages"):
        Request(a)
    # Pages and a slot together are one hybrid request (tests/features/rings/
    # test_hybrid_requests.py plans them); the value keeps both.
    both = Request(a, a, slot=(1, 2))
    assert both.slot == (1, 2) and both.src is a and "slot=(1, 2)" in repr(both)
    with pytest.raises(TypeError, match="needs page arrays"):
        Request()
    with pytest.raises(TypeError, match=r"window_pages\[0\] must have the dtype of the source "
                       "pages \\(int64\\), got int32"):
        Request(a, a, window_pages=(a.astype(np.int32), None))
    with pytest.raises(TypeError, match="window_pages for a state slot"):
        Request(slot=(1, 2), window_pages=(a, None))
    with pytest.raises(kvplan.IndexBoundsError, match=r"slot\[1\] must be non-negative, got -3"):
        Request(slot=(1, -3))
    with pytest.raises(TypeError, match="slot must be a tuple \\(src_slot, dst_slot\\)"):
        Request(slot=(1, 2, 3))  # type: ignore[arg-type]
    # Unequal lengths are a template's question (token requests differ in length legitimately).
    assert Request(a, a[:2]).dst is not None


def test_request_holds_the_callers_arrays_without_copying() -> None:
    src = np.arange(4, dtype=np.int32)
    dst = np.arange(4, 8, dtype=np.int64)
    window = (np.arange(2, dtype=np.int32), None)
    before = sys.getrefcount(src)
    req = Request(src, dst, window_pages=window)
    assert sys.getrefcount(src) == before + 1  # one reference held, no copy made
    assert req.src is src and req.dst is dst and req.window_pages is window
    # Planned from the caller's memory as it is at planning time.
    t = _template()
    src[0] = 9
    assert _cols(t.plan(Request(src, dst))) == _cols(t.plan(src, dst))
    assert _cols(t.plan(req.__class__(src, dst))) == _cols(t.plan(np.array(src), dst))
    del req
    assert sys.getrefcount(src) == before


def test_request_fields_and_repr() -> None:
    a = np.arange(3, dtype=np.int64)
    req = Request(a, a.astype(np.int32), n_tokens=10, skip_tokens=3)
    assert (req.n_tokens, req.skip_tokens, req.slot, req.window_pages) == (10, 3, None, None)
    assert repr(req) == "Request(src=int64[3], dst=int32[3], n_tokens=10, skip_tokens=3)"
    slot = Request(slot=(4, 5))
    assert (slot.src, slot.dst, slot.slot, slot.skip_tokens) == (None, None, (4, 5), 0)
    assert repr(slot) == "Request(slot=(4, 5))"
    pooled = Request(a, a, window_pages=(None, a))
    assert repr(pooled) == "Request(src=int64[3], dst=int64[3], window_pages=(None, int64[3]))"
    assert kvplan.Request is kvplan._core.Request and "Request" in kvplan.__all__


# ------------------------------------------------------------------- plan_ring and n_blocks_for


def _ring_template() -> kvplan.Template:
    """One MLA layer and one ring-state entry: 2 rows per slot on the prefill, 4 on the
    decode, 3 slots each, 16-byte rows."""
    src = kvplan.Layout.mla([500], [640], 64, layer_ids=[7]).with_state(
        "ring", [10000], [3 * 2 * 16], [16], [7]).with_rings([None, 2])
    dst = kvplan.Layout.mla([600], [640], 64, layer_ids=[7]).with_state(
        "ring", [20000], [3 * 4 * 16], [16], [7]).with_rings([None, 4])
    return kvplan.Template(src, dst)


def test_plan_ring_of_a_request_equals_the_loose_form() -> None:
    t = _ring_template()
    for s, d in [(0, 0), (1, 2), (2, 1)]:
        for n in (0, 1, 2, 3, 5, 11):
            loose = _cols(t.plan_ring(s, d, n))
            req = Request(slot=(s, d), n_tokens=n)
            assert _cols(t.plan_ring(req)) == loose
            # The only state entries are rings: plan(request) plans the same rows.
            assert _cols(t.plan(req)) == loose
            assert sum(loose[2]) == 16 * min(2, n)
    # The slot's bounds are the core's, either form.
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan_ring(Request(slot=(0, 3), n_tokens=5))
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan_ring(0, 3, 5)


def test_plan_ring_refuses_what_a_request_cannot_carry_to_it() -> None:
    t = _ring_template()
    pages = np.arange(2, dtype=np.int64)
    with pytest.raises(TypeError, match="plan_ring plans a state slot; this Request holds page"):
        t.plan_ring(Request(pages, pages))
    with pytest.raises(TypeError, match=r"needs the positions processed.*n_tokens=n_positions"):
        t.plan_ring(Request(slot=(0, 0)))
    with pytest.raises(TypeError, match="takes the positions from the Request's n_tokens"):
        t.plan_ring(Request(slot=(0, 0), n_tokens=3), None, 3)
    with pytest.raises(TypeError, match="takes the slots from the Request"):
        t.plan_ring(Request(slot=(0, 0), n_tokens=3), 1)  # type: ignore[call-overload]
    with pytest.raises(kvplan.KvPlanError, match="plan_ring plans whole requests.*first 2 tokens") as e:
        t.plan_ring(Request(slot=(0, 0), n_tokens=3, skip_tokens=2))
    assert e.value.kind == "geometry"
    with pytest.raises(TypeError, match="needs n_positions with src_slot and dst_slot"):
        t.plan_ring(0, 0)  # type: ignore[call-overload]
    with pytest.raises(OverflowError, match="n_positions must be an int in 0..2\\*\\*64, got -1"):
        t.plan_ring(0, 0, -1)
    with pytest.raises(TypeError, match="n_positions must be an int, got str"):
        t.plan_ring(0, 0, "3")  # type: ignore[call-overload]


def test_n_blocks_for_a_request_equals_its_plan() -> None:
    rng = np.random.default_rng(SEED + 9)
    t = _template()
    for _ in range(20):
        n = int(rng.integers(0, 9))
        src, dst = _pages(rng, n), _pages(rng, n)
        req = Request(src, dst)
        plan = t.plan(req)
        assert t.n_blocks_for(req) == plan.n_blocks
        # The loose count of the same shape (runs contiguous on both sides).
        assert t.n_blocks_for(n, plan.n_runs) == plan.n_blocks or n == 0
    src, dst = _pages(rng, 6), _pages(rng, 6)
    for req in [Request(src, dst, n_tokens=21), Request(src, dst, n_tokens=21, skip_tokens=7)]:
        assert t.n_blocks_for(req) == t.plan(req).n_blocks
    between = _template(page_sizes=(4, 8))
    req = Request(_pages(rng, 6), _pages(rng, 3), n_tokens=22)
    assert between.n_blocks_for(req) == between.plan(req).n_blocks
    pooled = kvplan.Template(_pooled(2), _pooled(2))
    pages, window = np.arange(4, dtype=np.int64), np.array([-1] * 3 + [0, 1, 2, 3], dtype=np.int64)
    req = Request(pages, pages, window_pages=(window, window), n_tokens=14)
    assert pooled.n_blocks_for(req) == pooled.plan(req).n_blocks > 0
    for slot_template, slot_req in [(_state_template(), Request(slot=(5, 9))),
                                    (_ring_template(), Request(slot=(1, 2), n_tokens=5))]:
        assert slot_template.n_blocks_for(slot_req) == slot_template.plan(slot_req).n_blocks > 0


def test_n_blocks_for_a_request_raises_as_plan() -> None:
    t = _template()
    bad = Request(np.array([99], dtype=np.int64), np.array([0], dtype=np.int64))
    with pytest.raises(kvplan.IndexBoundsError) as counted:
        t.n_blocks_for(bad)
    with pytest.raises(kvplan.IndexBoundsError) as planned:
        t.plan(bad)
    assert str(counted.value) == str(planned.value)
    with pytest.raises(TypeError, match=r"counts the Request's own runs; give no n_runs \(got 2\)"):
        t.n_blocks_for(Request(np.arange(2), np.arange(2)), 2)  # type: ignore[call-overload]
    assert t.n_blocks_for(4) == t.n_blocks_for(4, 1)
