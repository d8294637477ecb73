"""``Template.coalescing``: per page pair, whether it emits its blocks with the pair before it
and, if not, what keeps it apart (the core's coalescing rule asked of the template's own
groups), and whether its blocks end at every page. Each kind is checked on a layout built to
show it, against the blocks the plan really emits."""

from __future__ import annotations

import numpy as np

import kvplan
from kvplan.presets import DECODE_BASE, get_preset
from kvplan.testing.ranks import Model, Rank, rank_memory

PAGES = np.arange(4, dtype=np.int64)


def kinds(t: kvplan.Template) -> list[tuple[str, str | None, bool]]:
    assert len(t.coalescing) == len(t.pairs)
    return t.coalescing


def test_a_cross_layer_pool_joins_every_pair_into_one_block_per_run() -> None:
    p = get_preset("deepseek-v3", 4)
    src = p.layout(range(4), page_size=4, capacity=8, cross_layer=True)
    t = kvplan.Template(src, p.layout(range(4), page_size=4, capacity=8, cross_layer=True,
                                      base=DECODE_BASE))
    assert kinds(t) == [("first", None, False)] + [("joined", None, False)] * 3
    assert len(t.plan(PAGES, PAGES)) == 1
    off = kvplan.Template(src, p.layout(range(4), page_size=4, capacity=8, cross_layer=True,
                                        base=DECODE_BASE), coalesce=False)
    assert [k for k, _, _ in kinds(off)] == ["first"] + ["options"] * 3
    # Each pair alone: a cross-layer item is a quarter of the page stride, one block per page.
    assert [pp for _, _, pp in kinds(off)] == [True] * 4
    assert len(off.plan(PAGES, PAGES)) == 4 * 4


def test_per_layer_buffers_are_apart_and_the_indexer_has_its_own_stride() -> None:
    p = get_preset("deepseek-v3", 3)
    t = kvplan.Template(p.layout(range(3), page_size=4, capacity=8),
                        p.layout(range(3), page_size=4, capacity=8, base=DECODE_BASE))
    assert kinds(t) == [("first", None, False)] + [("apart", "src", False)] * 2
    v32 = get_preset("deepseek-v3.2", 2)
    t = kvplan.Template(v32.layout(range(2), page_size=4, capacity=8),
                        v32.layout(range(2), page_size=4, capacity=8, base=DECODE_BASE))
    # latent, indexer, latent, indexer: every neighbour has another page stride.
    assert kinds(t) == [("first", None, False)] + [("strides", "src", False)] * 3
    assert len(t.plan(PAGES, PAGES)) == 4


def test_window_entries_in_a_pool_are_kept_apart_by_the_token_plan() -> None:
    p = get_preset("gpt-oss-120b", 2)
    # 32 pages of 4 tokens: the buffers hold one 128-token window
    src = p.layout(range(2), page_size=4, capacity=32, cross_layer=True)
    t = kvplan.Template(src, p.layout(range(2), page_size=4, capacity=32, cross_layer=True,
                                      base=DECODE_BASE))
    assert t.by_token and t.n_groups == 1  # the page rule would join them
    assert kinds(t) == [("first", None, True)] + [("by_token", None, True)] * 3
    assert len(t.plan(PAGES, PAGES, n_tokens=16)) == 4 * 4  # per entry and page
    full = [None] * len(src)
    whole = kvplan.Template(src.with_windows(full),
                            p.layout(range(2), page_size=4, capacity=32, cross_layer=True,
                                     base=DECODE_BASE).with_windows(full))
    assert [k for k, _, _ in kinds(whole)] == ["first"] + ["joined"] * 3
    assert len(whole.plan(PAGES, PAGES)) == 1


def test_head_slicing_of_head_major_items_keeps_fragments_apart() -> None:
    model = Model(layers=2, kv_heads=4, head_dim=2, dtype_size=2)
    src = rank_memory(model, Rank(0, 1, 4, "HND", 8, cross_layer=True)).layout
    dst = rank_memory(model, Rank(0, 2, 4, "HND", 8, cross_layer=True)).layout
    t = kvplan.Template(src, dst)
    assert [k for k, _, _ in kinds(t)][1:] == ["fragments"] * 3


def test_a_pair_that_moves_nothing_is_elided() -> None:
    b = 1 << 32
    layout = kvplan.Layout([b, b + 4096], [4096, 4096], [64, 0], [0, 1], ["kv", "kv"])
    t = kvplan.Template(layout, layout.with_windows([None, None]))
    assert kinds(t) == [("first", None, False), ("elided", None, False)]


def test_a_group_that_would_outgrow_the_page_stride_stops() -> None:
    b = 1 << 32
    # Entry 1 starts right where entry 0's item ends, but entry 0's stride is its item: joined,
    # the two would reach into the next page.
    layout = kvplan.Layout([b, b + 64], [64 * 8, 64 * 8], [64, 64], [0, 1], ["kv", "kv"])
    t = kvplan.Template(layout, kvplan.Layout([b << 1, (b << 1) + 64], [64 * 8, 64 * 8],
                                              [64, 64], [0, 1], ["kv", "kv"]))
    assert kinds(t) == [("first", None, False), ("beyond_stride", "src", False)]
