"""Prefill and decode with different tokens per page: token plans against the byte oracle.

Every layout lives in a numpy byte arena (addresses are arena offsets plus a base).
:func:`kvplan.testing.oracle.reference_copy` copies each token of each entry pair (head by head)
from where its source page and slot hold it to where its destination page and slot hold it,
computed from the layouts alone; kvplan's plan is applied as memmoves to a copy of the same
destination arena. The two arenas must be equal byte for
byte, including every byte the request does not reach (past ``n_tokens`` in the last page, other
pages, other entries), and no destination byte may be written twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvplan
from kvplan import KvPlanError, Layout, SizeMismatchError
from kvplan.testing.oracle import Memory, apply_plan, reference_copy

PAGE_SIZES = [1, 2, 4, 16, 32, 64, 128]
HEAD_DIM, DTYPE = 2, 2
HEAD = HEAD_DIM * DTYPE
SRC_BASE, DST_BASE = 0x10_0000, 0x4000_0000
MAX_TOKENS = 300


@dataclass
class Side:
    layout: Layout
    arena: int
    page_size: int
    order: str  # "NHD" or "HND" (unpublished geometry plans as NHD)
    heads: int


def build(shape: str, base: int, page_size: int, pages: int, order: str | None, heads: int,
          layers: list[int], pad: int) -> Side:
    """Layouts of a few kinds: MHA K/V per layer, MLA, hybrid (MHA on some layers plus state
    entries), or a cross-layer pool; ``pad`` bytes after every item of per-layer buffers."""
    token = heads * HEAD
    item = page_size * token
    ctx: dict = dict(page_size=page_size)
    if order is not None:
        ctx.update(kv_heads=heads, head_dim=HEAD_DIM, dtype_size=DTYPE, memory_order=order)
    if shape == "pool":
        n = 2 * len(layers)
        stride = n * item
        layout = Layout.cross_layer(base, pages * stride, [layer for layer in layers for _ in (0, 1)],
                                    [item] * n, roles=["k", "v"] * len(layers), **ctx)
        return Side(layout, pages * stride, page_size, order or "NHD", heads)
    stride = item + pad
    length = pages * stride
    n = len(layers) if shape == "mla" else 2 * len(layers)
    ptrs = [base + i * length for i in range(n)]
    if shape == "mla":
        layout = Layout.mla(ptrs, [length] * n, item, layers, strides=stride, **ctx)
    else:
        h = len(layers)
        layout = Layout.mha(ptrs[:h], ptrs[h:], [length] * h, [length] * h, item, item, layers,
                            strides=stride, **ctx)
    arena = n * length
    if shape == "hybrid":
        # Two per-request state entries after the KV buffers (one slot of 24 bytes each).
        state = [base + arena, base + arena + 48]
        layout = layout.with_state("mamba_conv", state, [48, 48], 24, [100, 101])
        arena += 96
    return Side(layout, arena, page_size, order or "NHD", heads)


@st.composite
def requests(draw):
    ps, pd = draw(st.sampled_from(PAGE_SIZES)), draw(st.sampled_from(PAGE_SIZES))
    shape = draw(st.sampled_from(["mha", "mla", "hybrid", "pool", "pp"]))
    heads = 1 if shape == "mla" else draw(st.sampled_from([1, 2, 3]))
    orders = [None, "NHD", "HND"] if shape != "mla" else [None, "NHD"]
    src_order, dst_order = draw(st.sampled_from(orders)), draw(st.sampled_from(orders))
    n_tokens = draw(st.integers(0, MAX_TOKENS))
    src_need, dst_need = -(-n_tokens // ps), -(-n_tokens // pd)
    src_cap, dst_cap = src_need + draw(st.integers(0, 3)), dst_need + draw(st.integers(0, 3))
    src_cap, dst_cap = max(src_cap, 1), max(dst_cap, 1)
    # Fragmented page lists: a random permutation with a few runs kept in order.
    src_pages = draw(st.permutations(range(src_cap)))[:src_need]
    if draw(st.booleans()):
        src_pages = sorted(src_pages)
    dst_pages = draw(st.permutations(range(dst_cap)))[:dst_need]
    given = draw(st.booleans())
    # Without n_tokens the plan covers the full pages of the shorter side.
    if not given:
        n_tokens = min(len(src_pages) * ps, len(dst_pages) * pd)
    pads = draw(st.sampled_from([0, 0, 8])), draw(st.sampled_from([0, 0, 8]))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return dict(ps=ps, pd=pd, shape=shape, heads=heads, orders=(src_order, dst_order),
                caps=(src_cap, dst_cap), pages=(np.array(src_pages, dtype=dtype),
                                                np.array(dst_pages, dtype=dtype)),
                n_tokens=n_tokens, given=given, pads=pads)


def run(r: dict, **plan_kwargs) -> None:
    # PP: the prefill stage holds layers 1 and 2 of a 4-layer decode.
    src_layers = [1, 2] if r["shape"] == "pp" else [0, 1]
    dst_layers = [0, 1, 2, 3] if r["shape"] == "pp" else [0, 1]
    shape = "mha" if r["shape"] == "pp" else r["shape"]
    dst_shape = "mha" if shape == "pool" else shape  # pool to per-layer buffers
    src = build(shape, SRC_BASE, r["ps"], r["caps"][0], r["orders"][0], r["heads"], src_layers,
                r["pads"][0])
    dst = build(dst_shape, DST_BASE, r["pd"], r["caps"][1], r["orders"][1], r["heads"],
                dst_layers, r["pads"][1])
    template = kvplan.Template(src.layout, dst.layout)
    src_pages, dst_pages = r["pages"]
    n = r["n_tokens"] if r["given"] else None
    plan = template.plan(src_pages, dst_pages, n_tokens=n, **plan_kwargs)
    rng = np.random.default_rng(len(src_pages) * 131 + r["n_tokens"])
    source = rng.integers(0, 256, src.arena, dtype=np.uint8)
    before = rng.integers(0, 256, dst.arena, dtype=np.uint8)
    source_mem = Memory(source, SRC_BASE)
    want, got = Memory(before.copy(), DST_BASE), Memory(before.copy(), DST_BASE)
    reference_copy(src.layout, source_mem, dst.layout, want, src_pages, dst_pages,
                   n_tokens=r["n_tokens"])
    apply_plan(plan, source_mem, got, np.zeros(dst.arena, bool))
    got, want = got.data, want.data
    per_layer = 1 if shape == "mla" else 2
    assert plan.total_bytes == r["n_tokens"] * per_layer * len(src_layers) * r["heads"] * HEAD
    if not np.array_equal(got, want):
        at = int(np.flatnonzero(got != want)[0])
        raise AssertionError(f"first wrong destination byte at offset {at:#x}")
    # Per-pair ranges partition the plan.
    offsets = plan.pair_offsets
    assert offsets[0] == 0 and offsets[-1] == plan.n_blocks and (np.diff(offsets) >= 0).all()
    assert plan.group_offsets[-1] == plan.n_blocks


@settings(max_examples=400)
@given(requests())
@example(dict(ps=16, pd=64, shape="mha", heads=2, orders=("HND", "HND"), caps=(10, 3),
              pages=(np.arange(7, dtype=np.int32), np.array([2, 0], dtype=np.int32)),
              n_tokens=100, given=True, pads=(0, 0)))
def test_token_plans_equal_the_oracle(r):
    run(r)


def test_out_receives_the_same_plan():
    r = dict(ps=16, pd=64, shape="mha", heads=2, orders=("NHD", "NHD"), caps=(12, 4),
             pages=(np.array([5, 6, 7, 0, 1, 2, 3, 9, 10]), np.array([3, 1, 2])), n_tokens=130,
             given=True, pads=(0, 0))
    run(r)
    src = build("mha", SRC_BASE, 16, 12, "NHD", 2, [0, 1], 0)
    dst = build("mha", DST_BASE, 64, 4, "NHD", 2, [0, 1], 0)
    t = kvplan.Template(src.layout, dst.layout)
    pooled = t.plan(*r["pages"], n_tokens=130)
    out = np.zeros((3, pooled.n_blocks + 5), dtype=np.uint64)
    into = t.plan(*r["pages"], n_tokens=130, out=out)
    assert into.n_blocks == pooled.n_blocks
    assert np.array_equal(into.src_addrs, pooled.src_addrs)
    assert np.array_equal(into.lengths, pooled.lengths)
    with pytest.raises(KvPlanError, match="output buffer holds 1 blocks"):
        t.plan(*r["pages"], n_tokens=130, out=np.zeros((3, 1), dtype=np.uint64))


def test_sixteen_to_sixty_four_contiguous_nhd_is_one_block_per_entry_and_hnd_one_per_head():
    pages_src, pages_dst = np.arange(8), np.array([1, 2])
    for order, blocks in (("NHD", 4), ("HND", 4 * 2 * 8)):
        src = build("mha", SRC_BASE, 16, 8, order, 2, [0, 1], 0)
        dst = build("mha", DST_BASE, 64, 3, order, 2, [0, 1], 0)
        plan = kvplan.Template(src.layout, dst.layout).plan(pages_src, pages_dst)
        assert plan.n_blocks == blocks, order
        assert plan.total_bytes == 128 * 4 * 2 * HEAD


def test_state_entries_are_unaffected():
    src = build("hybrid", SRC_BASE, 16, 4, "HND", 2, [0, 1], 0)
    dst = build("hybrid", DST_BASE, 64, 2, "HND", 2, [0, 1], 0)
    t = kvplan.Template(src.layout, dst.layout)
    state = t.plan_state(1, 0)
    assert state.n_blocks == 2 and state.lengths.tolist() == [24, 24]


def test_inconsistent_items_are_refused_with_values():
    src = build("mha", SRC_BASE, 16, 4, None, 2, [0, 1], 0)
    # Decode page 64 with items sized for 32 tokens: 4 bytes per token against 8.
    bad = Layout.mha([DST_BASE, DST_BASE + 4096], [DST_BASE + 8192, DST_BASE + 12288],
                     [4096] * 2, [4096] * 2, 256, 256, [0, 1], page_size=64)
    with pytest.raises(SizeMismatchError, match="bytes per token differ for layer 0, role k: src "
                       "entry 0 has item_len 128 for page_size 16, dst entry 0 has item_len 256 "
                       "for page_size 64"):
        kvplan.Template(src.layout, bad)
    odd = Layout.mha([0], [4096], [4096], [4096], 100, 100, [0], page_size=64)
    one = Layout.mha([0], [4096], [4096], [4096], 8, 8, [0], page_size=1)
    with pytest.raises(SizeMismatchError, match="item_len 100 bytes is not a whole number of "
                       "tokens of page_size 64"):
        kvplan.Template(one, odd)
    # Head-major items must hold exactly heads x head_dim x dtype_size bytes per token.
    hnd = Layout.mha([0], [4096], [4096], [4096], 64 * 8, 64 * 8, [0], page_size=64,
                     kv_heads=4, head_dim=2, dtype_size=2, memory_order="HND")
    with pytest.raises(SizeMismatchError, match="8 bytes per token do not match the attention "
                       r"geometry \(4 heads per rank x 4 bytes per head\)"):
        kvplan.Template(one, hnd)
    # The compatibility report names the same problem.
    report = kvplan.compare(src.layout, bad)
    assert not report.compatible
    assert report.first_problem is not None and report.first_problem[0] == "SizeMismatchError"
    assert "bytes per token differ" in report.first_problem[1]


def test_request_errors_carry_values():
    src = build("mha", SRC_BASE, 16, 8, None, 2, [0, 1], 0)
    dst = build("mha", DST_BASE, 64, 2, None, 2, [0, 1], 0)
    t = kvplan.Template(src.layout, dst.layout)
    assert t.page_sizes == (16, 64)
    with pytest.raises(KvPlanError, match="n_tokens 70 needs 5 src pages of 16 tokens, but 4 "
                       "were given"):
        t.plan(np.arange(4), np.arange(2), n_tokens=70)
    with pytest.raises(kvplan.IndexBoundsError, match="dst index 2 at position 1"):
        t.plan(np.arange(5), np.array([0, 2]), n_tokens=65)
    # Pages past the last token are not read.
    assert t.plan(np.arange(5), np.array([0, 2]), n_tokens=64).total_bytes == 64 * 4 * 8
    with pytest.raises(KvPlanError, match="plans by token"):
        t.n_blocks_for(4)
    with pytest.raises(KvPlanError, match="fragments"):
        kvplan.Template(src.layout, dst.layout, fragments=[(0, 0, 8)])
    empty = t.plan(np.arange(4), np.arange(2), n_tokens=0)
    assert empty.n_blocks == 0 and empty.total_bytes == 0


def test_equal_page_sizes_with_n_tokens_leave_the_tail_untouched():
    r = dict(ps=16, pd=16, shape="mha", heads=2, orders=("HND", "HND"), caps=(6, 6),
             pages=(np.array([4, 1, 2]), np.array([0, 5, 3])), n_tokens=37, given=True,
             pads=(0, 8))
    run(r)


def test_compare_states_the_ratio_and_the_blocks_it_costs():
    from kvplan.presets import get_preset

    preset = get_preset("deepseek-v3")
    prefill = preset.layout(list(range(61)), page_size=16, capacity=4096)
    decode = preset.layout(list(range(61)), page_size=64, capacity=1024, base=1 << 46)
    report = kvplan.compare(prefill, decode, request_pages=2048)
    assert report.compatible
    assert any("ratio 1:4" in w for w in report.warnings)
    assert not any("strides differ" in w for w in report.warnings)
    text = "\n".join(report.blocks)
    assert "prefill:decode = 16:64 (1:4)" in text
    assert "32768 tokens (2048 prefill pages, 512 decode pages): 61 blocks with pages consecutive" \
        " on both sides, 124928 blocks with no two pages consecutive" in text
    t = kvplan.Template(prefill, decode)
    assert t.by_token and t.n_token_blocks(32768) == 61
    assert t.n_token_blocks(32768, fragmented=True) == 61 * 2048


def test_explain_takes_a_decode_page_size(capsys):
    from kvplan.cli import main

    code = main(["explain", "--preset", "qwen3-next", "--pages", "64", "--page-size", "16",
                 "--decode-page-size", "64", "--fragmentation", "0.5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "page_size 16 prefill, 64 decode" in out
    assert "64 pages × page_size 16 = 1,024 tokens" in out
    assert "runs over 16 decode pages" in out
    code = main(["explain", "--preset", "deepseek-v3", "--pages", "64", "--page-size", "64",
                 "--decode-page-size", "16"])
    assert code == 0
