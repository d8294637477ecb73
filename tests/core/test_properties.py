"""Hypothesis differential tests: kvplan vs tests/support/reference.py (a naive oracle written from
docs/semantics.md)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import kvplan
from kvplan import (
    IndexBoundsError,
    KvPlanError,
    Layout,
    Pairing,
    PairingError,
    SizeMismatchError,
    Template,
)

from support import reference as ref

FAST = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MEDIUM = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DTYPES = st.sampled_from([np.int32, np.int64])


# ------------------------------------------------------------------------------ strategies


@st.composite
def page_list(draw, n: int, cap: int) -> list[int]:
    """n page indices in [0, cap): concatenated runs of random length (fragmented free list)."""
    out: list[int] = []
    while len(out) < n:
        start = draw(st.integers(0, cap - 1))
        length = draw(st.integers(1, max(1, min(cap - start, n - len(out), 40))))
        out.extend(range(start, start + length))
        if draw(st.integers(0, 9)) == 0 and len(out) < n:  # occasional duplicate / descent
            out.append(draw(st.integers(0, cap - 1)))
    return out[:n]


@st.composite
def page_pair(draw, cap_src: int, cap_dst: int, max_n: int = 120):
    n = draw(st.integers(0, max_n))
    src = draw(page_list(n, cap_src)) if n else []
    dst = draw(page_list(n, cap_dst)) if n else []
    sd, dd = draw(DTYPES), draw(DTYPES)
    return src, dst, np.array(src, dtype=sd), np.array(dst, dtype=dd)


def index_arrays():
    return st.integers(0, 200).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 30), min_size=n, max_size=n),
            st.lists(st.integers(0, 30), min_size=n, max_size=n),
            DTYPES,
            DTYPES,
        )
    )


ITEM = st.sampled_from([1, 2, 8, 64, 100, 576, 1152, 4096, 65536])


def addresses(draw, sizes: list[int]) -> list[int]:
    """Non-overlapping base addresses with random gaps, sometimes high in the 64-bit space."""
    base = draw(st.sampled_from([0, 4096, 1 << 32, 1 << 47, (1 << 63) + 12345]))
    out = []
    cur = base
    for s in sizes:
        cur += draw(st.integers(0, 3)) * 4096
        out.append(cur)
        cur += s
    return out


def lens_for(draw, items: list[int], cap: int) -> list[int]:
    """data_len = cap * item + slack (< item, so floor division still gives cap)."""
    return [cap * it + draw(st.integers(0, max(0, it - 1))) for it in items]


def to_ref(layout_args: dict) -> ref.RefLayout:
    return ref.RefLayout(**layout_args)


KINDS = ["mla", "mha", "hybrid_mla", "hybrid_mha", "npu", "raw", "positional"]
PER_KIND = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def layout_pair(draw, kind=None):
    """(kind, src Layout, dst Layout, src RefLayout, dst RefLayout, cap_src, cap_dst, fallback)."""
    if kind is None:
        kind = draw(st.sampled_from(KINDS))
    cap_src = draw(st.integers(1, 300))
    cap_dst = draw(st.integers(1, 300))
    n_layers = draw(st.integers(1, 8))
    if kind in ("hybrid_mla", "hybrid_mha", "npu"):
        full = sorted(draw(st.sets(st.integers(0, 80), min_size=n_layers, max_size=n_layers)))
    else:
        full = list(range(n_layers))
    a_ = draw(st.integers(0, n_layers - 1))
    b_ = draw(st.integers(a_ + 1, n_layers))
    stage = full[a_:b_]
    m = len(stage)
    fallback = False

    if kind in ("mla", "hybrid_mla"):
        items_d = [draw(ITEM) for _ in full]
        items_s = [items_d[full.index(x)] for x in stage]
        dl, sl = lens_for(draw, items_d, cap_dst), lens_for(draw, items_s, cap_src)
        dp, sp = addresses(draw, dl), addresses(draw, sl)
        if kind == "mla":
            dst = Layout.mla(dp, dl, items_d, layer_ids=full)
            src = Layout.mla(sp, sl, items_s, layer_ids=stage)
        else:
            dst = Layout.hybrid_linear(full, dp, dl, items_d)
            src = Layout.hybrid_linear(stage, sp, sl, items_s)
        rd = ref.RefLayout(dp, dl, items_d, list(full), ["kv"] * len(full))
        rs = ref.RefLayout(sp, sl, items_s, list(stage), ["kv"] * m)
    elif kind in ("mha", "hybrid_mha"):
        k_items = [draw(ITEM) for _ in full]
        v_items = [draw(ITEM) for _ in full]
        items_d = k_items + v_items
        idx = [full.index(x) for x in stage]
        items_s = [k_items[i] for i in idx] + [v_items[i] for i in idx]
        dl, sl = lens_for(draw, items_d, cap_dst), lens_for(draw, items_s, cap_src)
        dp, sp = addresses(draw, dl), addresses(draw, sl)
        n, mm = len(full), m
        if kind == "mha":
            dst = Layout.mha(dp[:n], dp[n:], dl[:n], dl[n:], k_items, v_items, layer_ids=full)
            src = Layout.mha(
                sp[:mm], sp[mm:], sl[:mm], sl[mm:], items_s[:mm], items_s[mm:], layer_ids=stage
            )
        else:
            dst = Layout.hybrid_linear(full, dp, dl, items_d, mla=False)
            src = Layout.hybrid_linear(stage, sp, sl, items_s, mla=False)
        rd = ref.RefLayout(dp, dl, items_d, full * 2, ["k"] * n + ["v"] * n)
        rs = ref.RefLayout(sp, sl, items_s, stage * 2, ["k"] * mm + ["v"] * mm)
    elif kind == "npu":
        G = draw(st.integers(1, 3))
        n = len(full)
        items_d = [draw(ITEM) for _ in range(G * n)]
        idx = [full.index(x) for x in stage]
        items_s = [items_d[g * n + i] for g in range(G) for i in idx]
        dl, sl = lens_for(draw, items_d, cap_dst), lens_for(draw, items_s, cap_src)
        dp, sp = addresses(draw, dl), addresses(draw, sl)
        dst = Layout.npu_groups(full, dp, dl, items_d)
        src = Layout.npu_groups(stage, sp, sl, items_s)
        roles_d = [f"g{g}" for g in range(G) for _ in range(n)]
        roles_s = [f"g{g}" for g in range(G) for _ in range(m)]
        rd = ref.RefLayout(dp, dl, items_d, full * G, roles_d)
        rs = ref.RefLayout(sp, sl, items_s, stage * G, roles_s)
    elif kind == "raw":
        # Arbitrary entry lists: repeated (id, role) keys, decode order shuffled, extra entries.
        keys = draw(
            st.lists(
                st.tuples(st.integers(0, 5), st.sampled_from(["k", "v", "kv"])),
                min_size=1,
                max_size=12,
            )
        )
        key_item = {k: draw(ITEM) for k in set(keys)}
        dst_keys = draw(st.permutations(keys))
        extra = draw(st.lists(st.tuples(st.integers(0, 9), st.sampled_from(["k", "v"])), max_size=3))
        for k in extra:
            key_item.setdefault(k, draw(ITEM))
        n_src = draw(st.integers(1, len(keys)))
        src_keys = draw(st.permutations(keys))[:n_src]
        # A decode entry of a layer the prefill sends, of a role the prefill has none of for
        # that layer, would be left unwritten: the core refuses it (missing_partner), so the
        # drawn decodes hold more layers or further occurrences of sent roles, not that.
        sent = {layer for layer, _ in src_keys}
        dst_keys = [k for k in list(dst_keys) + extra if k[0] not in sent or k in src_keys]
        items_d = [key_item[k] for k in dst_keys]
        items_s = [key_item[k] for k in src_keys]
        dl, sl = lens_for(draw, items_d, cap_dst), lens_for(draw, items_s, cap_src)
        dp, sp = addresses(draw, dl), addresses(draw, sl)
        d_ids, d_roles = [k[0] for k in dst_keys], [k[1] for k in dst_keys]
        s_ids, s_roles = [k[0] for k in src_keys], [k[1] for k in src_keys]
        dst = Layout(dp, dl, items_d, layer_ids=d_ids, roles=d_roles)
        src = Layout(sp, sl, items_s, layer_ids=s_ids, roles=s_roles)
        rd = ref.RefLayout(dp, dl, items_d, d_ids, d_roles)
        rs = ref.RefLayout(sp, sl, items_s, s_ids, s_roles)
    else:  # positional: no ids on either side; fallback allows extra decode entries
        fallback = draw(st.booleans())
        n_dst = n_layers + (draw(st.integers(0, 3)) if fallback else 0)
        items_s = [draw(ITEM) for _ in range(n_layers)]
        items_d = items_s + [draw(ITEM) for _ in range(n_dst - n_layers)]
        dl, sl = lens_for(draw, items_d, cap_dst), lens_for(draw, items_s, cap_src)
        dp, sp = addresses(draw, dl), addresses(draw, sl)
        dst = Layout(dp, dl, items_d)
        src = Layout(sp, sl, items_s)
        rd = ref.RefLayout(dp, dl, items_d)
        rs = ref.RefLayout(sp, sl, items_s)
    return kind, src, dst, rs, rd, cap_src, cap_dst, fallback


def as_lists(plan):
    return (
        [int(x) for x in plan.src_addrs],
        [int(x) for x in plan.dst_addrs],
        [int(x) for x in plan.lengths],
    )


# ------------------------------------------------------------------------------ oracle sanity
# The oracle itself reproduces docs/semantics.md's worked examples (so differential tests mean
# something).


def test_reference_reproduces_worked_examples():
    assert ref.runs_as_lists(ref.group_runs([0, 1, 2, 5, 6, 9], [10, 11, 12, 13, 14, 20])) == (
        [[0, 1, 2], [5, 6], [9]],
        [[10, 11, 12], [13, 14], [20]],
    )
    assert ref.runs_as_lists(ref.group_runs([3, 3, 4], [7, 8, 9])) == ([[3], [3, 4]], [[7], [8, 9]])
    assert ref.group_runs([1, 2], []) == []
    assert ref.pair_entries([3, 7, 3, 7], [3, 7, 11, 3, 7, 11], 4, 6) == [
        (0, 0), (1, 1), (2, 3), (3, 4)
    ]
    assert ref.pair_entries([], [], 3, 5, True) == [(0, 0), (1, 1), (2, 2)]
    assert ref.pair_entries([9], [], 0, 0) == []
    for args in [([1], [], 1, 1), ([1, 9], [1, 2, 3], 2, 3), ([3, 3, 3], [3, 3], 3, 2), ([], [], 3, 5)]:
        with pytest.raises(ref.RefError):
            ref.pair_entries(*args)
    # W-mla-flat-plan
    s = ref.RefLayout([1000, 2000], [1000, 1000], [64, 64])
    d = ref.RefLayout([5000, 6000], [1000, 1000], [64, 64])
    p = ref.plan_blocks(s, d, ref.template_pairs(s, d), [0, 1, 2, 7], [10, 11, 12, 3])
    assert (p.src, p.dst, p.lengths) == (
        [1000, 1448, 2000, 2448], [5640, 5192, 6640, 6192], [192, 64, 192, 64]
    )
    # W-mha-pp-slice, uneven split: correct slices
    prs = ref.legacy_pp_pairs("mha", 16, 30, 7, decode_num_layers=15)
    assert [j for _, j in prs[8:]] == list(range(22, 30))
    # W-mla-pp-slice with draft
    assert ref.legacy_pp_pairs("mla", 3, 6, 2, num_draft_entries=1) == [(0, 2), (1, 3), (2, 5)]


# ------------------------------------------------------------------------------ group_contiguous


@FAST
@given(index_arrays())
def test_group_contiguous_matches_reference(args):
    src, dst, sd, dd = args
    s, d, n = kvplan.group_contiguous(np.array(src, dtype=sd), np.array(dst, dtype=dd))
    for arr in (s, d, n):
        assert arr.dtype == np.int64 and arr.ndim == 1
    got = list(zip(s.tolist(), d.tolist(), n.tolist()))
    assert got == ref.group_runs(src, dst)


@FAST
@given(st.data())
def test_group_contiguous_fragmented_pages(data):
    src, dst, sa, da = data.draw(page_pair(1 << 20, 1 << 20, max_n=400))
    s, d, n = kvplan.group_contiguous(sa, da)
    expected = ref.group_runs(src, dst)
    assert list(zip(s.tolist(), d.tolist(), n.tolist())) == expected
    # runs tile the input exactly
    assert int(n.sum()) == len(src)


@FAST
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50),
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50),
    DTYPES,
)
def test_group_contiguous_unequal_lengths_raise(src, dst, dt):
    assume(len(src) != len(dst))
    with pytest.raises(KvPlanError):
        kvplan.group_contiguous(np.array(src, dtype=dt), np.array(dst, dtype=dt))


@FAST
@given(st.integers(1, 60), st.data(), DTYPES)
def test_group_contiguous_negative_raise(n, data, dt):
    src = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    pos = data.draw(st.integers(0, n - 1))
    side = data.draw(st.sampled_from(["src", "dst"]))
    (src if side == "src" else dst)[pos] = -data.draw(st.integers(1, 2**31 - 1))
    with pytest.raises(KvPlanError):
        kvplan.group_contiguous(np.array(src, dtype=dt), np.array(dst, dtype=dt))


# ------------------------------------------------------------------------------ pair_entries


@st.composite
def id_lists(draw):
    dst = draw(st.lists(st.integers(0, 6), max_size=10))
    mode = draw(st.sampled_from(["sub", "random", "empty_src", "empty_dst", "none"]))
    if mode == "sub":  # a sub-multiset in random order (a PP stage, possibly K/V duplicates)
        src = draw(st.permutations(dst))[: draw(st.integers(0, len(dst)))]
    elif mode == "random":
        src = draw(st.lists(st.integers(0, 8), max_size=10))
    elif mode == "empty_src":
        src = []
    elif mode == "empty_dst":
        src, dst = draw(st.lists(st.integers(0, 6), max_size=6)), []
    else:
        src, dst = None, None
    n_src = len(src or []) + (draw(st.sampled_from([0, 0, 0, 1, -1])) if src else 0)
    n_dst = len(dst or []) + (draw(st.sampled_from([0, 0, 0, 1, -1])) if dst else 0)
    if not src:
        n_src = draw(st.integers(0, 6))
    if not dst:
        n_dst = draw(st.integers(0, 6))
    n_src, n_dst = max(n_src, 0), max(n_dst, 0)
    roles = None
    if src and dst and len(src) == n_src and len(dst) == n_dst and draw(st.booleans()):
        roles = (
            draw(st.lists(st.sampled_from(["k", "v"]), min_size=n_src, max_size=n_src)),
            draw(st.lists(st.sampled_from(["k", "v"]), min_size=n_dst, max_size=n_dst)),
        )
    as_np = draw(st.booleans())
    fallback = draw(st.booleans())
    return src, dst, n_src, n_dst, fallback, roles, as_np


@settings(max_examples=400, deadline=None)
@given(id_lists())
def test_pair_entries_matches_reference(args):
    src, dst, n_src, n_dst, fallback, roles, as_np = args
    kw = {}
    if roles is not None:
        kw = {"src_roles": roles[0], "dst_roles": roles[1]}
    try:
        expected = ref.pair_entries(src, dst, n_src, n_dst, fallback, *(roles or (None, None)))
    except ref.RefError as e:
        assert e.kind == "pairing"
        expected = None
    conv = (lambda x: None if x is None else np.array(x, dtype=np.int64)) if as_np else (lambda x: x)
    if expected is None:
        with pytest.raises(PairingError):
            kvplan.pair_entries(conv(src), conv(dst), n_src, n_dst, fallback, **kw)
    else:
        got = kvplan.pair_entries(conv(src), conv(dst), n_src, n_dst, fallback, **kw)
        assert got.dtype == np.int64
        assert got.shape == (len(expected), 2)
        assert [tuple(r) for r in got.tolist()] == expected


# ------------------------------------------------------------------------------ Template.plan


def check_plan_against_reference(plan, expected: ref.RefPlan, rs, rd, n_pages):
    assert as_lists(plan) == (expected.src, expected.dst, expected.lengths)
    assert plan.n_blocks == expected.n_blocks == len(plan)
    assert plan.total_bytes == expected.total_bytes
    assert plan.pair_offsets.dtype == np.int64
    assert plan.pair_offsets.tolist() == expected.pair_offsets
    assert plan.n_pairs == len(expected.pairs)
    assert plan.n_runs == expected.n_runs
    # byte conservation: every pair moves n_pages items of its item length
    assert sum(expected.lengths) == n_pages * sum(rs.items[i] for i, _ in expected.pairs)
    assert int(plan.lengths.sum(dtype=np.uint64)) == n_pages * sum(rs.items[i] for i, _ in expected.pairs)
    # every block lies inside its entry's buffer
    src_a, dst_a, ln = as_lists(plan)
    for p, (i, j) in enumerate(expected.pairs):
        for b in range(expected.pair_offsets[p], expected.pair_offsets[p + 1]):
            assert rs.ptrs[i] <= src_a[b] and src_a[b] + ln[b] <= rs.ptrs[i] + rs.lens[i]
            assert rd.ptrs[j] <= dst_a[b] and dst_a[b] + ln[b] <= rd.ptrs[j] + rd.lens[j]


@pytest.mark.parametrize("layout_kind", KINDS)
@PER_KIND
@given(data=st.data())
def test_plan_matches_reference(layout_kind, data):
    lp = data.draw(layout_pair(layout_kind))
    kind, src, dst, rs, rd, cap_src, cap_dst, fallback = lp
    pairs = ref.template_pairs(rs, rd, allow_positional_fallback=fallback)
    t = Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=fallback))
    assert t.pairs.dtype == np.int64
    assert [tuple(r) for r in t.pairs.tolist()] == pairs
    assert t.n_pairs == len(pairs)
    assert src.capacities == [cap_src] * rs.n
    assert dst.capacities == [cap_dst] * rd.n
    sp, dp, sa, da = data.draw(page_pair(cap_src, cap_dst))
    expected = ref.plan_blocks(rs, rd, pairs, sp, dp)
    event(f"runs {'0' if expected.n_runs == 0 else '1' if expected.n_runs == 1 else '2-9' if expected.n_runs < 10 else '10+'}")
    plan = t.plan(sa, da)
    check_plan_against_reference(plan, expected, rs, rd, len(sp))
    # second oracle: page by page, then merge adjacent blocks of one pair; compared as byte
    # maps (block order within a run is not part of the contract: a run that descends on both
    # sides is one block from its lowest page)
    merged = ref.plan_page_by_page(rs, rd, pairs, sp, dp)
    assert _byte_map(list(zip(*as_lists(plan)))) == _byte_map(merged)


def _byte_map(blocks):
    """``(src, dst, len)`` blocks as the copy they describe: how often each source byte is
    copied to each destination byte (pages may repeat and raw buffers may overlap, so it is a
    multiset, independent of how the blocks are cut and ordered). A block copies the bytes
    ``(a + k, b + k)``: on the diagonal ``b - a``, the source interval ``[a, a + n)``. Per
    diagonal the map is the coverage count of those intervals, as maximal segments of one
    count, computed by a sweep over interval ends (not byte by byte: blocks are megabytes)."""
    from collections import Counter, defaultdict

    ends: defaultdict[int, Counter] = defaultdict(Counter)
    for a, b, n in blocks:
        if n:
            ends[b - a][a] += 1
            ends[b - a][a + n] -= 1
    out = {}
    for diagonal, delta in ends.items():
        segments: list[list[int]] = []
        level = 0
        prev = None
        for x in sorted(delta):
            if level and prev is not None and x > prev:
                if segments and segments[-1][1] == prev and segments[-1][2] == level:
                    segments[-1][1] = x
                else:
                    segments.append([prev, x, level])
            level += delta[x]
            prev = x
        if segments:
            out[diagonal] = [tuple(seg) for seg in segments]
    return out


def test_byte_map_is_the_copy_not_the_cut():
    # one copy cut two ways, and in another order, is the same map
    assert _byte_map([(0, 100, 10)]) == _byte_map([(5, 105, 5), (0, 100, 5)])
    # a repeated byte counts twice; a different destination is a different map
    assert _byte_map([(0, 100, 4), (2, 102, 4)]) == _byte_map([(0, 100, 2), (2, 102, 2),
                                                               (2, 102, 2), (4, 104, 2)])
    assert _byte_map([(0, 100, 4)]) != _byte_map([(0, 101, 4)])
    assert _byte_map([(0, 100, 4)]) != _byte_map([(0, 100, 4), (0, 100, 4)])
    assert _byte_map([(0, 100, 0)]) == _byte_map([])


@MEDIUM
@given(layout_pair(), st.data())
def test_plan_out_of_range_index_raises(lp, data):
    kind, src, dst, rs, rd, cap_src, cap_dst, fallback = lp
    t = Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=fallback))
    assume(t.n_pairs > 0)
    sp, dp, sa, da = data.draw(page_pair(cap_src, cap_dst, max_n=40))
    assume(len(sp) > 0)
    pos = data.draw(st.integers(0, len(sp) - 1))
    side = data.draw(st.sampled_from(["src", "dst"]))
    cap = cap_src if side == "src" else cap_dst
    bad = data.draw(st.one_of(st.integers(cap, cap + 1000), st.integers(-1000, -1)))
    (sa if side == "src" else da)[pos] = bad
    with pytest.raises(IndexBoundsError):
        t.plan(sa, da)


@st.composite
def faulty_raw_pair(draw):
    """Raw layouts with exactly one fault: a missing decode entry or one wrong decode item length."""
    keys = draw(
        st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["k", "v"])), min_size=1, max_size=10)
    )
    key_item = {k: draw(ITEM) for k in set(keys)}
    dst_keys = list(draw(st.permutations(keys)))
    src_keys = list(draw(st.permutations(keys)))
    items_d = [key_item[k] for k in dst_keys]
    fault = draw(st.sampled_from(["missing", "size"]))
    victim = draw(st.integers(0, len(dst_keys) - 1))
    if fault == "missing":
        del dst_keys[victim]
        del items_d[victim]
    else:
        items_d[victim] = items_d[victim] + draw(st.integers(1, 64))
    items_s = [key_item[k] for k in src_keys]
    dl, sl = [it * 4 for it in items_d], [it * 4 for it in items_s]
    dp, sp = addresses(draw, dl), addresses(draw, sl)
    rd = ref.RefLayout(dp, dl, items_d, [k[0] for k in dst_keys], [k[1] for k in dst_keys])
    rs = ref.RefLayout(sp, sl, items_s, [k[0] for k in src_keys], [k[1] for k in src_keys])
    return fault, rs, rd, (src_keys, dst_keys, victim)


@FAST
@given(faulty_raw_pair())
def test_template_validation_errors_match_reference(args):
    fault, rs, rd, info = args
    with pytest.raises(ref.RefError) as ei:
        ref.template_pairs(rs, rd)
    assert ei.value.kind == {"missing": "pairing", "size": "size"}[fault]
    src = Layout(rs.ptrs, rs.lens, rs.items, layer_ids=rs.ids, roles=rs.roles)
    if fault == "missing" and len(rd.ptrs) == 0:
        dst = Layout([], [], [], layer_ids=[], roles=[])
    else:
        dst = Layout(rd.ptrs, rd.lens, rd.items, layer_ids=rd.ids, roles=rd.roles)
    exc = PairingError if fault == "missing" else SizeMismatchError
    with pytest.raises(exc) as e2:
        Template(src, dst)
    if fault == "size":
        src_keys, dst_keys, victim = info
        msg = str(e2.value)
        assert str(rd.items[victim]) in msg, msg
        assert str(dst_keys[victim][0]) in msg, msg


# ------------------------------------------------------------------------------ plan_state


@st.composite
def state_layouts(draw):
    names = ["mamba_conv", "mamba_temporal"]
    layers = sorted(draw(st.sets(st.integers(0, 40), min_size=1, max_size=6)))
    a_ = draw(st.integers(0, len(layers) - 1))
    b_ = draw(st.integers(a_ + 1, len(layers)))
    stage = layers[a_:b_]
    item = {(x, nm): draw(ITEM) for x in layers for nm in names}
    cap_s, cap_d = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    dkeys = [(x, nm) for nm in names for x in layers]
    skeys = [(x, nm) for nm in names for x in stage]
    ditems = [item[k] for k in dkeys]
    sitems = [item[k] for k in skeys]
    dl, sl = lens_for(draw, ditems, cap_d), lens_for(draw, sitems, cap_s)
    dp, sp = addresses(draw, dl), addresses(draw, sl)
    # one page entry (MLA) per layer too, so the layouts look like a hybrid model
    page_item = 1152
    src = Layout.mla(
        addresses(draw, [page_item * 4] * len(stage)), [page_item * 4] * len(stage), page_item,
        layer_ids=stage,
    )
    dst = Layout.mla(
        addresses(draw, [page_item * 4] * len(layers)), [page_item * 4] * len(layers), page_item,
        layer_ids=layers,
    )
    n = len(stage)
    for k, nm in enumerate(names):
        src = src.with_state(nm, sp[k * n:(k + 1) * n], sl[k * n:(k + 1) * n], sitems[k * n:(k + 1) * n], stage)
    N = len(layers)
    for k, nm in enumerate(names):
        dst = dst.with_state(nm, dp[k * N:(k + 1) * N], dl[k * N:(k + 1) * N], ditems[k * N:(k + 1) * N], layers)
    # reference layouts: page entries first (offsets), then state entries
    rs = ref.RefLayout(
        [0] * n + sp, [0] * n + sl, [1] * n + sitems, stage + [k[0] for k in skeys],
        ["kv"] * n + [k[1] for k in skeys], ["page"] * n + ["state"] * len(skeys),
    )
    rd = ref.RefLayout(
        [0] * N + dp, [0] * N + dl, [1] * N + ditems, layers + [k[0] for k in dkeys],
        ["kv"] * N + [k[1] for k in dkeys], ["page"] * N + ["state"] * len(dkeys),
    )
    return src, dst, rs, rd, cap_s, cap_d


@FAST
@given(state_layouts(), st.data())
def test_plan_state_matches_reference(sl, data):
    src, dst, rs, rd, cap_s, cap_d = sl
    t = Template(src, dst)
    state_pairs = ref.template_pairs(rs, rd, kind="state")
    assert [tuple(r) for r in t.state_pairs.tolist()] == state_pairs
    s_slot = data.draw(st.integers(0, cap_s - 1))
    d_slot = data.draw(st.integers(0, cap_d - 1))
    expected = ref.plan_state_blocks(rs, rd, state_pairs, s_slot, d_slot)
    plan = t.plan_state(s_slot, d_slot)
    assert as_lists(plan) == (expected.src, expected.dst, expected.lengths)
    assert plan.n_blocks == len(state_pairs)
    assert plan.total_bytes == sum(rs.items[i] for i, _ in state_pairs)
    with pytest.raises(IndexBoundsError):
        t.plan_state(cap_s, d_slot)
    with pytest.raises(IndexBoundsError):
        t.plan_state(s_slot, cap_d)


# ------------------------------------------------------------------------------ legacy slicing


@FAST
@given(
    st.sampled_from(["mla", "mha"]),
    st.integers(0, 12),
    st.integers(0, 30),
    st.integers(0, 12),
    st.integers(0, 2),
    st.one_of(st.none(), st.integers(0, 15)),
)
def test_legacy_pp_pairs_correct_or_error(kind, n_src, n_dst, start, nd, layers):
    kw: dict = {}
    if kind == "mla":
        kw["num_draft_entries"] = nd
    else:
        kw["decode_num_layers"] = layers
    if n_src == 0:
        # empty stage: no pairs (kvplan core) or PairingError (docs/api.md); never a crash
        try:
            got = kvplan.legacy_pp_pairs(kind, n_src, n_dst, start, **kw)
        except PairingError:
            return
        assert got.shape == (0, 2)
        return
    try:
        expected = ref.legacy_pp_pairs(kind, n_src, n_dst, start, **kw)
    except ref.RefError:
        expected = None
    if expected is None:
        with pytest.raises(PairingError):
            kvplan.legacy_pp_pairs(kind, n_src, n_dst, start, **kw)
    else:
        got = kvplan.legacy_pp_pairs(kind, n_src, n_dst, start, **kw)
        assert [tuple(r) for r in got.tolist()] == expected
