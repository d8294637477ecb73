"""Strided entries, fragments, cross-layer pools and coalescing, checked against byte arrays.

Every layout lives in a small numpy arena (addresses are arena offsets plus a base), so a plan can
be applied as memmoves and compared with :mod:`kvplan.testing.oracle` given the same fragments.
The comparison is on bytes (which source byte each destination byte receives), never on block
lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.presets import get_preset
from kvplan.testing.oracle import Memory, apply_plan, reference_copy

SRC_BASE = 0x10_0000
DST_BASE = 0x90_0000
V1_BYTES = bytes.fromhex(
    # Layout.mha([0x1000, 0x2000], [0x3000, 0x4000], [64, 64], [128, 128], 8, 16, [0, 1],
    # num_model_layers=2, page_size=16, pp_rank=1, pp_size=2, device="cuda")
    # .with_state("mamba_conv", [0x9000], [640], 64, [5]).to_bytes(), written by the v1 format.
    "4b56504c010000000500000010000000000000000200000000000000010000000200000000000000010000000400"
    "637564610010000000000000400000000000000008000000000000000001000000000000000001006b002000000000"
    "0000400000000000000008000000000000000001010000000000000001006b00300000000000008000000000000000"
    "10000000000000000001000000000000000001007600400000000000008000000000000000100000000000000000010"
    "100000000000000010076009000000000000080020000000000004000000000000000010105000000000000000a006d"
    "616d62615f636f6e76e0a5c503"
)


# ------------------------------------------------------------------------------ layouts


@dataclass
class Side:
    """One peer: its layout and where each entry lives in the arena."""

    layout: kvplan.Layout
    arena: int  # bytes


@st.composite
def side(draw, items: list[int], ids: list[int], base: int) -> Side:
    """A layout of ``len(items)`` entries in one of three shapes: packed per-layer buffers,
    strided per-layer buffers, or one pool holding every entry's item of a page (with optional
    gaps between items and padding at the end of each page)."""
    n = len(items)
    cap = draw(st.integers(1, 6))
    shape = draw(st.sampled_from(["packed", "strided", "pool", "pool"]))
    ptrs, lens, strides = [], [], []
    at = 0
    if shape == "pool":
        gaps = [draw(st.sampled_from([0, 0, 0, 8])) for _ in range(n)]
        offsets = []
        for gap, item in zip(gaps, items):
            at += gap
            offsets.append(at)
            at += item
        stride = at + draw(st.sampled_from([0, 0, 8]))
        if stride == 0:
            stride = 8
        pool = cap * stride + draw(st.integers(0, stride - 1))
        ptrs = [base + o for o in offsets]
        lens = [pool - o for o in offsets]
        strides = [stride] * n
        arena = pool
    else:
        for item in items:
            at += draw(st.sampled_from([0, 0, 8, 24]))
            stride = item if shape == "packed" else item + draw(st.integers(0, 3)) * 8
            length = max(0, (cap - 1) * stride + item) + draw(st.integers(0, max(stride - 1, 0)))
            ptrs.append(base + at)
            lens.append(length)
            strides.append(stride)
            at += length
        arena = at
    layout = kvplan.Layout(ptrs, lens, items, ids, ["kv"] * n, strides=strides)
    return Side(layout, max(arena, 1))


@st.composite
def fragments_for(draw, item: int) -> list[tuple[int, int, int]] | None:
    """None (the whole item) or 1-3 fragments inside the item, disjoint on the destination."""
    if item == 0 or draw(st.booleans()):
        return None
    k = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, item), min_size=2 * k, max_size=2 * k)))
    out = []
    for j in range(k):
        lo, hi = cuts[2 * j], cuts[2 * j + 1]
        if hi == lo:
            continue
        length = hi - lo
        src_off = draw(st.integers(0, item - length))
        out.append((src_off, lo, length))
    if not out:
        return None
    return draw(st.permutations(out))


@dataclass
class Case:
    src: Side
    dst: Side
    fragments: list[list[tuple[int, int, int]] | None] | None
    src_pages: np.ndarray
    dst_pages: np.ndarray


@st.composite
def cases(draw, with_fragments: bool = True) -> Case:
    n = draw(st.integers(1, 5))
    items = [draw(st.sampled_from([0, 8, 8, 16, 24, 40])) for _ in range(n)]
    ids = list(range(n))
    src = draw(side(items, ids, SRC_BASE))
    # The decode lists its entries in another order (pairs still go by layer id).
    order = draw(st.permutations(range(n)))
    dst = draw(side([items[i] for i in order], list(order), DST_BASE))
    fragments = None
    if with_fragments and draw(st.booleans()):
        fragments = [draw(fragments_for(item)) for item in items]
    emitting = [i for i in range(n) if items[i] > 0]

    def limit(s: Side) -> int:
        caps = s.layout.capacities
        return min((caps[j] for j in range(n) if s.layout.item_lens[j] > 0), default=0)

    cs, cd = limit(src), limit(dst)
    if not emitting or cs == 0 or cd == 0:
        pages = 0
    else:
        pages = draw(st.integers(1, min(cd, 8))) if draw(st.integers(0, 9)) else 0
    dst_pages = draw(st.permutations(range(cd)))[:pages] if pages else []
    if pages and draw(st.booleans()):
        dst_pages = sorted(dst_pages)  # long runs
    src_pages = [draw(st.integers(0, cs - 1)) for _ in range(pages)]
    if pages and draw(st.booleans()):
        start = draw(st.integers(0, cs - 1))
        src_pages = [(start + i) % cs for i in range(pages)]
    return Case(src, dst, fragments, np.array(src_pages, dtype=np.int64),
                np.array(dst_pages, dtype=np.int64))


# ------------------------------------------------------------------------------ oracle


def _source_planes(arena: int) -> list[np.ndarray]:
    """Source arenas whose bytes name their own offset (low byte, high byte) and one of ones:
    a destination equal to the oracle's on all three received every byte from the same source
    offset, and exactly the bytes the oracle writes (destinations start at zero)."""
    assert arena < 1 << 16
    offsets = np.arange(arena)
    return [(offsets & 0xFF).astype(np.uint8), (offsets >> 8).astype(np.uint8),
            np.ones(arena, np.uint8)]


def assert_plan_is_the_oracles(case: Case, plan: kvplan.TransferPlan) -> None:
    """The plan's blocks, applied as memmoves, give every destination byte the source byte
    :func:`kvplan.testing.oracle.reference_copy` gives it, writing none twice."""
    for plane in _source_planes(case.src.arena):
        source = Memory(plane, SRC_BASE)
        want = Memory(np.zeros(case.dst.arena, np.uint8), DST_BASE)
        got = want.copy()
        moved = reference_copy(case.src.layout, source, case.dst.layout, want, case.src_pages,
                               case.dst_pages, fragments=case.fragments)
        apply_plan(plan, source, got, np.zeros(case.dst.arena, bool))
        np.testing.assert_array_equal(got.data, want.data)
        assert plan.total_bytes == moved


def template(case: Case, **kw) -> kvplan.Template:
    return kvplan.Template(case.src.layout, case.dst.layout, check_dst_overlap=True,
                           fragments=case.fragments, **kw)


# ------------------------------------------------------------------------------ properties


@settings(max_examples=300)
@given(cases())
def test_plan_bytes_equal_the_oracles(case: Case) -> None:
    for coalesce in (True, False):
        plan = template(case, coalesce=coalesce).plan(case.src_pages, case.dst_pages)
        assert_plan_is_the_oracles(case, plan)
        assert plan.n_blocks == len(plan.lengths)


@settings(max_examples=300)
@given(cases())
def test_coalesced_plans_need_no_more_blocks_for_the_same_bytes(case: Case) -> None:
    merged = template(case).plan(case.src_pages, case.dst_pages)
    apart = template(case, coalesce=False).plan(case.src_pages, case.dst_pages)
    assert_plan_is_the_oracles(case, merged)
    assert merged.n_blocks <= apart.n_blocks
    assert merged.total_bytes == apart.total_bytes


@settings(max_examples=300)
@given(cases())
def test_every_block_lies_inside_its_buffers(case: Case) -> None:
    src, dst = case.src.layout, case.dst.layout
    t = template(case, coalesce=False)
    plan = t.plan(case.src_pages, case.dst_pages)
    offsets = plan.pair_offsets
    pairs = t.pairs
    sa, da, ln = (c.astype(object) for c in (plan.src_addrs, plan.dst_addrs, plan.lengths))
    for p, (i, j) in enumerate(pairs.tolist()):
        for k in range(offsets[p], offsets[p + 1]):
            assert src.data_ptrs[i] <= sa[k] and sa[k] + ln[k] <= src.data_ptrs[i] + src.data_lens[i]
            assert dst.data_ptrs[j] <= da[k] and da[k] + ln[k] <= dst.data_ptrs[j] + dst.data_lens[j]
    # Coalesced: each group's blocks lie inside the union of its pairs' buffers.
    t = template(case)
    plan = t.plan(case.src_pages, case.dst_pages)
    groups, offsets = t.pair_groups.tolist(), plan.group_offsets
    for g in range(plan.n_groups):
        members = [pairs[p] for p in range(len(groups)) if groups[p] == g]
        for k in range(offsets[g], offsets[g + 1]):
            for addr, col, lay in ((sa, 0, src), (da, 1, dst)):
                a = int(plan.src_addrs[k] if col == 0 else plan.dst_addrs[k])
                end = a + int(plan.lengths[k])
                lo = min(lay.data_ptrs[m[col]] for m in members)
                hi = max(lay.data_ptrs[m[col]] + lay.data_lens[m[col]] for m in members)
                assert lo <= a and end <= hi


@settings(max_examples=200)
@given(cases(with_fragments=False))
def test_offsets_partition_the_blocks(case: Case) -> None:
    t = template(case)
    plan = t.plan(case.src_pages, case.dst_pages)
    assert plan.pair_offsets[-1] == plan.n_blocks == plan.group_offsets[-1]
    assert np.all(np.diff(plan.pair_offsets) >= 0) and np.all(np.diff(plan.group_offsets) >= 0)
    groups = plan.pair_groups.tolist()
    for g in range(plan.n_groups):
        # A group's blocks belong to its last pair.
        last = max(p for p, x in enumerate(groups) if x == g)
        assert plan.pair_blocks(last) == plan.group_blocks(g)
    assert t.n_blocks_for(len(case.src_pages), plan.n_runs) == plan.n_blocks or not len(
        case.src_pages)


# ------------------------------------------------------------------------------ examples


def test_strides_default_to_item_lengths_and_set_capacity() -> None:
    packed = kvplan.Layout.mla([0x1000], [100], 16)
    assert packed.strides == [16] and packed.capacities == [6]
    strided = kvplan.Layout.mla([0x1000], [100], 16, strides=40)
    # Items at 0, 40, 80 (+16 = 96 <= 100); a fourth would end at 136.
    assert strided.strides == [40] and strided.capacities == [3]
    assert kvplan.Layout([0x1000], [8], 16, strides=[32]).capacities == [0]
    assert kvplan.Layout([0x1000], [100], 0, strides=[0]).capacities == [0]
    with pytest.raises(kvplan.LayoutError, match="entry 0 .*stride 8 is smaller than its item_len 16"):
        kvplan.Layout.mla([0x1000], [100], 16, strides=8)
    with pytest.raises(kvplan.LayoutError, match="strides has 2 values but data_ptrs has 1"):
        kvplan.Layout([0x1000], [100], 16, strides=[16, 16])
    with pytest.raises(TypeError, match="strides must be"):
        kvplan.Layout([0x1000], [100], 16, strides="16")  # type: ignore[arg-type]
    appended = strided.with_state("conv", [0x9000], [64], 32, [3], strides=[48])
    assert appended.strides == [40, 48] and appended.capacities == [3, 1]
    assert strided.with_state("conv", [0x9000], [64], 32, [3]).strides == [40, 32]


def test_cross_layer_pool_addresses() -> None:
    pool = kvplan.Layout.cross_layer(0x10000, 10 * 96 + 50, [0, 0, 1, 1], [16, 32, 16, 32],
                                     roles=["k", "v", "k", "v"], page_size=16)
    assert pool.data_ptrs == [0x10000, 0x10010, 0x10030, 0x10040]
    assert pool.strides == [96] * 4 and pool.capacities == [10] * 4
    assert pool.roles == ["k", "v", "k", "v"] and pool.page_size == 16
    per_layer = kvplan.Layout.mha([0x1000, 0x2000], [0x3000, 0x4000], [160, 160], [320, 320], 16, 32, [0, 1],
                                  page_size=16)
    t = kvplan.Template(per_layer, pool)
    plan = t.plan(np.array([0, 1]), np.array([4, 5]))
    # K of layer 0, page 4 of the pool: pool + 4 * 96.
    assert plan.dst_addrs[0] == 0x10000 + 4 * 96 and plan.lengths[0] == 16
    assert t.n_groups == 4 and plan.n_blocks == 8  # strides differ: one block per page
    back = kvplan.Template(pool, pool)
    plan = back.plan(np.array([0, 1, 2]), np.array([4, 5, 6]))
    assert back.n_groups == 1 and plan.n_blocks == 1  # one pool, one run: one block
    assert (plan.src_addrs[0], plan.dst_addrs[0], plan.lengths[0]) == (0x10000, 0x10000 + 384, 288)
    with pytest.raises(kvplan.LayoutError, match="roles has 1 values"):
        kvplan.Layout.cross_layer(0, 96, [0, 1], 48, roles=["k"])


def test_coalescing_needs_both_sides_adjacent() -> None:
    # Source pool [a b c], decode pool [a c b]: a+? never touch b on the decode side.
    src = kvplan.Layout.cross_layer(0x1000, 480, [0, 1, 2], [8, 16, 24])
    dst = kvplan.Layout([0x9000, 0x9000 + 32, 0x9000 + 8], [480, 448, 472], [8, 16, 24],
                        [0, 1, 2], strides=48)
    t = kvplan.Template(src, dst)
    assert t.n_groups == 3
    # Decode [a b] adjacent but c elsewhere: one group of a+b, c alone.
    dst = kvplan.Layout([0x9000, 0x9008, 0xA000], [480, 472, 480], [8, 16, 24], [0, 1, 2],
                        strides=[48, 48, 48])
    t = kvplan.Template(src, dst)
    assert t.n_groups == 2 and t.pair_groups.tolist() == [0, 0, 1]
    plan = t.plan(np.array([1, 2]), np.array([3, 4]))
    # Group (a, b): 24 bytes per page, stride 48 on both sides: one block per page.
    assert plan.lengths.tolist() == [24, 24, 24, 24]
    assert plan.pair_offsets.tolist() == [0, 0, 2, 4]
    assert plan.group_offsets.tolist() == [0, 2, 4] and plan.pair_blocks(0) == slice(0, 0, 1)
    assert kvplan.Template(src, dst, coalesce=False).n_groups == 3


def test_packed_per_layer_buffers_never_coalesce() -> None:
    # Buffers of one item each, back to back: adjacent, but a group would be wider than the
    # stride, so today's plan is kept.
    a = kvplan.Layout.mla([0x1000, 0x1010], [16, 16], 16, [0, 1])
    b = kvplan.Layout.mla([0x2000, 0x2010], [16, 16], 16, [0, 1])
    t = kvplan.Template(a, b)
    assert t.n_groups == 2
    plan = t.plan(np.array([0]), np.array([0]))
    assert plan.lengths.tolist() == [16, 16]


def test_fragments_option_and_errors() -> None:
    src = kvplan.Layout.mla([0x1000, 0x2000], [4096, 4096], 512, [0, 1])
    dst = kvplan.Layout.mla([0x9000, 0xA000], [4096, 4096], 512, [0, 1])
    t = kvplan.Template(src, dst, fragments=[(128, 0, 256)])
    plan = t.plan(np.array([2, 3]), np.array([0, 1]))
    # Not the whole item: one block per (page, fragment).
    assert plan.src_addrs.tolist() == [0x1000 + 2 * 512 + 128, 0x1000 + 3 * 512 + 128,
                                       0x2000 + 2 * 512 + 128, 0x2000 + 3 * 512 + 128]
    assert plan.dst_addrs.tolist() == [0x9000, 0x9000 + 512, 0xA000, 0xA000 + 512]
    assert plan.lengths.tolist() == [256] * 4 and plan.total_bytes == 1024
    # The whole item given explicitly is the default path (one block per run).
    t = kvplan.Template(src, dst, fragments=[(0, 0, 512)])
    assert t.plan(np.array([2, 3]), np.array([0, 1])).n_blocks == 2
    # Per pair: None keeps the whole item.
    t = kvplan.Template(src, dst, fragments=[None, [(0, 256, 256), (256, 0, 256)]])
    assert t.plan(np.array([2, 3]), np.array([0, 1])).n_blocks == 1 + 4
    with pytest.raises(kvplan.KvPlanError, match=r"fragment 0 .*len 300.* not inside the item of 512"):
        kvplan.Template(src, dst, fragments=[(256, 0, 300)])
    with pytest.raises(kvplan.KvPlanError, match="fragments 0 and 1 overlap on the destination"):
        kvplan.Template(src, dst, fragments=[(0, 0, 64), (64, 32, 64)])
    with pytest.raises(kvplan.KvPlanError, match="is empty"):
        kvplan.Template(src, dst, fragments=[(0, 0, 0)])
    with pytest.raises(kvplan.KvPlanError, match="1 per-pair lists but the template has 2"):
        kvplan.Template(src, dst, fragments=[[(0, 0, 8)]])
    with pytest.raises(TypeError, match="fragments must be"):
        kvplan.Template(src, dst, fragments="all")  # type: ignore[arg-type]


def test_preset_cross_layer_layouts() -> None:
    for key in ("deepseek-v3", "qwen3-next"):
        preset = get_preset(key)
        layers = range(preset.num_layers)
        per_layer = preset.layout(layers, page_size=1, capacity=64)
        pool = preset.layout(layers, page_size=1, capacity=64, cross_layer=True,
                             base=0x9000_0000_0000)
        assert pool.capacities[0] == 64 and len(set(pool.strides[:2])) == 1
        t = kvplan.Template(pool, pool)
        assert t.n_groups == 1 and t.n_blocks_for(64, 4) == 4
        mixed = kvplan.Template(per_layer, pool)
        assert mixed.n_blocks_for(64, 4) == 64 * mixed.n_groups
        plan = t.plan(np.arange(8), np.arange(8, 16))
        assert plan.n_blocks == 1 and plan.total_bytes == 8 * t.bytes_per_page


def test_report_names_strides_and_counts_blocks() -> None:
    preset = get_preset("deepseek-v3")
    per_layer = preset.layout(range(61), page_size=1, capacity=64)
    pool = preset.layout(range(61), page_size=1, capacity=64, cross_layer=True)
    text = str(kvplan.compare(per_layer, pool, request_pages=100))
    assert "strides differ for 61 paired entries" in text and "1152 vs 70272 bytes" in text
    assert "100 pages coalesced (61 groups): 6100 blocks in one run" in text
    text = str(kvplan.compare(pool, pool, request_pages=100))
    assert "strides differ" not in text
    assert "100 pages coalesced (1 group): 1 blocks in one run, 100 blocks" in text
    assert "100 pages without coalescing (61 groups): 6100 blocks in one run, 6100 blocks" in text


# ------------------------------------------------------------------------------ wire


def test_v1_bytes_still_decode() -> None:
    layout = kvplan.Layout.from_bytes(V1_BYTES)
    expected = kvplan.Layout.mha(
        [0x1000, 0x2000], [0x3000, 0x4000], [64, 64], [128, 128], 8, 16, [0, 1],
        num_model_layers=2, page_size=16, pp_rank=1, pp_size=2, device="cuda",
    ).with_state("mamba_conv", [0x9000], [640], 64, [5])
    assert layout == expected and layout.strides == layout.item_lens
    assert layout.to_bytes()[4:6] == b"\x02\x00"  # re-encoded as v2
    v1_dict = {k: v for k, v in expected.to_dict().items() if k != "strides"}
    assert kvplan.Layout.from_dict({**v1_dict, "version": 1}) == expected


def test_v2_carries_strides_and_refuses_unknown_required_extensions() -> None:
    import zlib

    pool = kvplan.Layout.cross_layer(0x1000, 960, [0, 1], [16, 32])
    again = kvplan.Layout.from_bytes(pool.to_bytes())
    assert again == pool and again.strides == [48, 48]
    assert kvplan.Layout.from_dict(pool.to_dict()) == pool
    data = pool.to_bytes()
    # The context's extension list sits right after the device string ("cpu").
    at = data.index(b"cpu") + 3
    assert data[at:at + 2] == b"\x00\x00"

    def with_ext(tag: int) -> bytes:
        body = (data[:at] + (1).to_bytes(2, "little") + tag.to_bytes(2, "little")
                + (2).to_bytes(2, "little") + b"HN" + data[at + 2:-4])
        return body + zlib.crc32(body).to_bytes(4, "little")

    assert kvplan.Layout.from_bytes(with_ext(0x0001)) == pool  # unknown optional: skipped
    # 0x8001 is the attention geometry now (known, and 2 bytes are malformed for it); an
    # unknown must-understand tag is refused by number.
    with pytest.raises(kvplan.KvPlanError, match="extension 0x80ff"):
        kvplan.Layout.from_bytes(with_ext(0x80FF))
    with pytest.raises(kvplan.KvPlanError, match="attention geometry of 2 bytes"):
        kvplan.Layout.from_bytes(with_ext(0x8001))
