"""Window pools (``Layout.with_windows(..., window_page_size=)``): sliding-window layers kept in a
pool of their own, as engines keep them (a smaller pool, its own page indices per request and
its own tokens per page). A request gives each pooled side's window pages beside its pages; the
window layers are addressed through them at the pool's page size, the full layers through the
request's pages. Checked byte for byte against the oracle (which addresses a pool entry through
its side's window pages from the layout definition) for every mix of page sizes, pooled and
unpooled sides, TP slicing, memory orders and delta requests; and the rules: the window pages a
request must give, their dtype, too few of them, the pages before the window not read, the
pool on the wire and in the dict, and refusals with decode context parallelism."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.testing.ranks import Model, Rank, check_request, rank_memory


def window_list(rng: np.random.Generator, n_tokens: int, page_size: int, capacity: int,
                unread_before: int | None) -> np.ndarray:
    """A request's window pages: distinct pool pages in token order, positions before
    ``unread_before`` (the first page holding a live window token) set to -1."""
    needed = -(-n_tokens // page_size)
    pages = rng.permutation(capacity)[:needed].astype(np.int64)
    if unread_before is not None:
        pages[:unread_before] = -1
    return pages


@st.composite
def pooled_requests(draw: st.DrawFn) -> dict[str, object]:
    tp_p, tp_d = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    ps, pd = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    wps = draw(st.one_of(st.none(), st.integers(1, 6)))
    wpd = draw(st.one_of(st.none(), st.integers(1, 6)))
    if wps is None and wpd is None:
        wps = draw(st.integers(1, 6))
    orders = draw(st.sampled_from(["NHD", "HND"])), draw(st.sampled_from(["NHD", "HND"]))
    window = draw(st.integers(1, 20))
    n = draw(st.integers(0, 40))
    skip = draw(st.integers(0, n))
    return dict(tp=(tp_p, tp_d), kv_heads=kv_heads, pages=(ps, pd), window_pages=(wps, wpd),
                orders=orders, window=window, n=n, skip=skip, seed=draw(st.integers(0, 2**16)))


@settings(max_examples=600)
@given(pooled_requests())
def test_pooled_window_layers_move_byte_exact(case: dict[str, object]) -> None:
    tp_p, tp_d = case["tp"]  # type: ignore[misc]
    ps, pd = case["pages"]  # type: ignore[misc]
    wps, wpd = case["window_pages"]  # type: ignore[misc]
    o_p, o_d = case["orders"]  # type: ignore[misc]
    n, skip, window = int(case["n"]), int(case["skip"]), int(case["window"])  # type: ignore[call-overload]
    model = Model(layers=3, kv_heads=int(case["kv_heads"]), head_dim=2, dtype_size=2,  # type: ignore[call-overload]
                  window=window)
    rng = np.random.default_rng(int(case["seed"]))  # type: ignore[call-overload]
    capacity = 48
    prefill = Rank(0, tp_p, ps, o_p, capacity, window_page_size=wps, window_capacity=capacity)
    decode = Rank(0, tp_d, pd, o_d, capacity, window_page_size=wpd, window_capacity=capacity)
    src_pages = rng.permutation(capacity)[:-(-n // ps) or 0].astype(np.int64)
    dst_pages = rng.permutation(capacity)[:-(-n // pd) or 0].astype(np.int64)
    live = max(0, n - window)  # the first live window token
    # A whole request's pages before the window are never read; a delta's prefix copy reads
    # the window as it was when the decode cached it, so those stay real pages there.
    unread = (lambda size: live // size) if skip == 0 else (lambda size: None)
    lists = tuple(None if size is None else window_list(rng, n, size, capacity, unread(size))
                  for size in (wps, wpd))
    for r_d in range(tp_d):
        check_request(model, prefill, dataclasses.replace(decode, tp_rank=r_d), src_pages,
                      dst_pages, n_tokens=n, skip_tokens=skip, window_pages=lists)  # type: ignore[arg-type]


def gpt_oss_like(window_page_size: int | None, page_size: int = 4, capacity: int = 16,
                 window_capacity: int = 6) -> kvplan.Layout:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2, window=8)
    return rank_memory(model, Rank(0, 1, page_size, "NHD", capacity,
                                   window_page_size=window_page_size,
                                   window_capacity=window_capacity)).layout


def test_a_pool_has_its_own_page_size_and_entries_say_which_list_they_read() -> None:
    layout = gpt_oss_like(2)
    assert layout.window_page_size == 2
    entries = layout.entries()
    assert [(e.layer_id, e.role, e.window, e.page_size, e.in_window_pool) for e in entries] == [
        (0, "k", None, 4, False), (1, "k", 8, 2, True),
        (0, "v", None, 4, False), (1, "v", 8, 2, True)]
    assert [e.capacity for e in entries] == [16, 6, 16, 6]
    assert "page_size=2, in_window_pool=True" in repr(entries[1])


def test_one_plan_moves_full_layers_from_the_pages_and_windows_from_the_window_pages() -> None:
    src, dst = gpt_oss_like(2), gpt_oss_like(8)
    t = kvplan.Template(src, dst)
    token = 2 * 4 * 2  # bytes of one token of one layer's K (or V)
    pages = np.arange(5, dtype=np.int64)
    # 18 tokens: the window (tokens 10..17) at prefill window positions 5..8 (2 tokens each)
    # and at decode window positions 1 (tokens 8..15, slots 2.. of pool page 0) and 2 (16..17,
    # pool page 3).
    src_window = np.array([-1] * 5 + [0, 1, 2, 3], dtype=np.int64)
    dst_window = np.array([-1, 0, 3], dtype=np.int64)
    plan = t.plan(pages, pages, n_tokens=18, window_pages=(src_window, dst_window))
    assert plan.total_bytes == 2 * (18 + 8) * token
    blocks = list(zip(*plan.as_lists()))
    k1_src, k1_dst = src.entries()[1], dst.entries()[1]
    window_blocks = [b for b in blocks if k1_src.data_ptr <= b[0] < k1_src.data_ptr +
                     k1_src.data_len]
    # Prefill pool pages 0..3 are contiguous; decode pool page 0 then page 3: two blocks.
    assert window_blocks == [(k1_src.data_ptr, k1_dst.data_ptr + 2 * token, 6 * token),
                             (k1_src.data_ptr + 6 * token, k1_dst.data_ptr + 3 * 8 * token,
                              2 * token)]


def test_the_window_pages_a_request_must_give() -> None:
    pooled, plain = gpt_oss_like(2), gpt_oss_like(None)
    pages = np.arange(5, dtype=np.int64)
    window = np.arange(9, dtype=np.int64) % 6
    t = kvplan.Template(pooled, plain)
    with pytest.raises(kvplan.KvPlanError, match="window entries of the src side keep a pool of "
                       r"their own \(2 tokens per page\)") as e:
        t.plan(pages, pages, n_tokens=18)
    assert e.value.kind == "geometry"
    with pytest.raises(kvplan.KvPlanError, match="window pages were given for the dst side, "
                       "whose layout has no window pool"):
        t.plan(pages, pages, n_tokens=18, window_pages=(window, window))
    with pytest.raises(kvplan.KvPlanError, match="n_tokens 18 needs 9 src window pages of 2 "
                       "tokens, but 4 were given"):
        t.plan(pages, pages, n_tokens=18, window_pages=(window[:4], None))
    with pytest.raises(TypeError, match=r"window_pages\[0\] must have the dtype of the source "
                       r"pages \(int64\), got int32"):
        t.plan(pages, pages, n_tokens=18, window_pages=(window.astype(np.int32), None))
    with pytest.raises(TypeError, match="window_pages must be None or a tuple"):
        t.plan(pages, pages, n_tokens=18, window_pages=[window, None])  # type: ignore[arg-type]
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan(pages, pages, n_tokens=18, window_pages=(window + 6, None))  # past the pool
    with pytest.raises(kvplan.KvPlanError, match="overlaps window_pages"):
        out = np.zeros((3, 16), dtype=np.uint64)
        t.plan(pages, pages, n_tokens=18, window_pages=(out[0, :9].view(np.int64), None),
               out=out)
    assert t.plan(pages, pages, n_tokens=18, window_pages=(window, None)).total_bytes > 0


def test_the_pages_before_the_window_are_not_read_and_a_delta_reads_only_its_part() -> None:
    t = kvplan.Template(gpt_oss_like(2), gpt_oss_like(2))
    pages = np.arange(5, dtype=np.int64)
    window = np.array([-1] * 5 + [0, 1, 2, 3], dtype=np.int64)  # tokens 10..17 live
    assert t.plan(pages, pages, n_tokens=18, window_pages=(window, window)).total_bytes == \
        2 * (18 + 8) * 16
    # The decode holds 16 tokens: the window layer moves 16..17 only, from position 8.
    tail = np.array([-1] * 8 + [3], dtype=np.int64)
    delta = t.plan(pages, pages, n_tokens=18, skip_tokens=16, window_pages=(tail, tail))
    assert delta.total_bytes == 2 * (2 + 2) * 16
    with pytest.raises(kvplan.IndexBoundsError, match="-1"):
        t.plan(pages, pages, n_tokens=18, skip_tokens=15, window_pages=(tail, tail))


def test_window_pool_values_are_validated_where_the_layout_is_built() -> None:
    plain = gpt_oss_like(None)
    with pytest.raises(kvplan.LayoutError, match="page_size must be at least 1, got 0"):
        plain.with_windows(plain.windows, window_page_size=0)
    with pytest.raises(kvplan.LayoutError, match="a window pool needs window entries"):
        plain.with_windows([None] * len(plain), window_page_size=4)
    dealt = kvplan.Layout([1 << 20], [1 << 16], [64], [0], ["kv"], page_size=4, dcp_size=2,
                          dcp_rank=0)
    with pytest.raises(kvplan.LayoutError, match="decode context-parallel"):
        dealt.with_windows([8], window_page_size=4)
    # A pool of 3 pages of 2 tokens cannot hold an 8-token window; of 4 pages it can.
    with pytest.raises(kvplan.LayoutError, match=r"entry 1 \(layer 1, role k\): a sliding "
                       r"window of 8 tokens is wider than the 6 tokens its buffer holds \(3 "
                       r"pages of 2 tokens of the window pool\)"):
        gpt_oss_like(2, window_capacity=3)
    assert gpt_oss_like(2, window_capacity=4).window_page_size == 2


def test_a_pool_beside_decode_context_parallelism_is_refused_at_template_build() -> None:
    src = kvplan.Layout([1 << 20], [1 << 16], [64], [0], ["kv"], page_size=4,
                        windows=[8], window_page_size=4)
    dst = kvplan.Layout([1 << 30], [1 << 16], [64], [0], ["kv"], page_size=4, dcp_size=2,
                        dcp_rank=1, windows=[8])
    with pytest.raises(kvplan.KvPlanError, match="pool of their own on one side and tokens "
                       "dealt over decode context-parallel ranks"):
        kvplan.Template(src, dst)


def test_the_pool_travels_on_the_wire_and_in_the_dict() -> None:
    pooled, plain = gpt_oss_like(2), gpt_oss_like(None)
    back = kvplan.Layout.from_bytes(pooled.to_bytes())
    assert back == pooled and back.window_page_size == 2
    as_dict = json.loads(json.dumps(pooled.to_dict()))
    assert as_dict["window_page_size"] == 2
    assert kvplan.Layout.from_dict(as_dict) == pooled
    assert "window_page_size" not in plain.to_dict()
    assert kvplan.Layout.from_bytes(plain.to_bytes()).window_page_size is None
    # A pool is part of the layout: with and without one they are different layouts.
    same_lists = kvplan.Layout(pooled.data_ptrs, pooled.data_lens, pooled.item_lens,
                               pooled.layer_ids, pooled.roles, windows=pooled.windows,
                               page_size=4)
    assert same_lists != pooled and same_lists.to_bytes() != pooled.to_bytes()
    with pytest.raises(TypeError, match="window_page_size must be a positive int"):
        kvplan.Layout.from_dict({**as_dict, "window_page_size": "2"})


def test_planners_without_window_pages_refuse_a_pooled_request_naming_the_side() -> None:
    t = kvplan.Template(gpt_oss_like(2), gpt_oss_like(None))
    pages = np.arange(5, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="window entries of the src side keep a pool") \
            as e:
        t.plan_batch([(pages, pages, 18)])
    assert e.value.requests == (0,)
    with pytest.raises(kvplan.KvPlanError, match="window entries of the src side keep a pool"):
        t.plan_staged(pages, pages, src_staging=(1 << 40, 1 << 20),
                      dst_staging=(1 << 41, 1 << 20))


@pytest.mark.parametrize("sizes", [(2, 2), (2, 8), (8, 2), (3, None), (None, 5)])
def test_blocks_counted_without_pages_are_the_blocks_of_contiguous_and_fragmented_lists(
        sizes: tuple[int | None, int | None]) -> None:
    src = gpt_oss_like(sizes[0], page_size=4, capacity=64, window_capacity=64)
    dst = gpt_oss_like(sizes[1], page_size=2, capacity=64, window_capacity=64)
    t = kvplan.Template(src, dst)
    for n in (0, 1, 7, 8, 9, 17, 23):
        for fragmented in (False, True):
            step = 2 if fragmented else 1
            def lists(page_size: int, count: int) -> np.ndarray:
                return np.arange(0, step * -(-count // page_size), step, dtype=np.int64)
            window = tuple(None if size is None else lists(size, n) for size in sizes)
            plan = t.plan(lists(4, n), lists(2, n), n_tokens=n, window_pages=window)
            assert t.n_token_blocks(n, fragmented=fragmented) == len(plan), (n, fragmented)


def test_layer_slices_of_a_pooled_plan_hold_each_layers_blocks() -> None:
    model = Model(layers=6, kv_heads=2, head_dim=4, dtype_size=2, window=8)
    rank = Rank(0, 1, 4, "NHD", 16, window_page_size=2, window_capacity=16)
    src, dst = rank_memory(model, rank).layout, rank_memory(model, rank).layout
    groups = kvplan.LayerGroups.fixed(2)
    t = kvplan.Template(src, dst, layer_groups=groups)
    window = np.arange(10, dtype=np.int64)
    plan = t.plan(np.arange(5, dtype=np.int64), np.arange(5, dtype=np.int64), n_tokens=20,
                  window_pages=(window, window))
    layer_slices = t.layer_slices(groups)
    slices = layer_slices.of(plan)
    blocks = list(zip(*plan.as_lists()))
    entry_of = {e.data_ptr: e for e in src.entries()}
    seen = 0
    assert layer_slices.layers == [[0, 1], [2, 3], [4, 5]]
    for k, ranges in enumerate(slices.ranges):
        layers = set(layer_slices.layers[k])
        for start, stop in ranges:
            for s, _, _ in blocks[start:stop]:
                owner = max((p for p in entry_of if p <= s), key=int)
                assert entry_of[owner].layer_id in layers, (k, hex(s))
            seen += stop - start
    assert seen == len(blocks)
