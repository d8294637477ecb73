"""Layer-wise slices of one plan (``Template.layer_slices``, ``LayerSlices.of``, ``WorkManifest``).

The property: a request's slices plus its seal are the monolithic plan, block for block and
byte for byte (every block in exactly one slice, in plan order), each slice's blocks belong to
entries of its layer group (page and per-request state entries alike: a layer's forward writes
both) and the seal's to entries no group covers, and the manifest counts exactly what the
slices move. Drawn over dense, hybrid (state) and draft layouts, prefill PP
{1, 2, 4}, TP slicing, page-size ratios and cross-layer pools.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan import KvPlanError, LayerGroups, Layout, WorkManifest, Template
from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset, split_layers

PAGES = 24


def _owner_key(entries, groups: LayerGroups, addr: int, seal: set[int], seal_roles: set[str]):
    """The slice key (group id, or ``"seal"``) of the source entry whose item holds ``addr``."""
    for e in entries:
        if e.item_len == 0 or addr < e.data_ptr:
            continue
        page, offset = divmod(addr - e.data_ptr, e.stride)
        if page < e.capacity and offset < e.item_len:
            if (e.is_draft or e.layer_id is None or e.layer_id in seal
                    or (e.role or "") in seal_roles):
                return "seal"
            group = groups.group_of(e.layer_id)
            return "seal" if group is None else group
    raise AssertionError(f"byte {addr:#x} is in no source entry")


def _check(template: Template, src: Layout, groups: LayerGroups, plan: kvplan.TransferPlan,
           seal: set[int], seal_roles: set[str]) -> kvplan.PlanSlices:
    slices = template.layer_slices(groups)
    cut = slices.of(plan)
    n = plan.n_blocks
    owned = [(a, b, gid) for ranges, gid in zip(cut.ranges, slices.group_ids) for a, b in ranges]
    owned += [(a, b, "seal") for a, b in cut.seal_ranges]
    owned.sort()
    # The ranges tile the plan: their concatenation is the monolithic plan.
    assert [a for a, _, _ in owned] == [0, *(b for _, b, _ in owned[:-1])][: len(owned)]
    assert (owned[-1][1] if owned else 0) == n
    cols = (plan.src_addrs, plan.dst_addrs, plan.lengths)
    joined = [np.concatenate([c[a:b] for a, b, _ in owned]) if owned else c[:0] for c in cols]
    for whole, parts in zip(cols, joined):
        np.testing.assert_array_equal(whole, parts)
    entries = src.entries()
    for a, b, key in owned:
        for src_addr, length in zip(plan.src_addrs[a:b].tolist(), plan.lengths[a:b].tolist()):
            for addr in (src_addr, src_addr + length - 1):
                got = _owner_key(entries, groups, addr, seal, seal_roles)
                assert got == key, (a, b, addr, got, key)
    # Work per slice is what its ranges move.
    for ranges, (gid, blocks, nbytes), want in zip(cut.ranges, cut.work, slices.group_ids):
        assert gid == want
        assert blocks == sum(b - a for a, b in ranges)
        assert nbytes == sum(int(plan.lengths[a:b].sum()) for a, b in ranges)
    assert cut.seal_work == (sum(b - a for a, b in cut.seal_ranges),
                             sum(int(plan.lengths[a:b].sum()) for a, b in cut.seal_ranges))
    return cut


def _with_draft(layout: Layout, preset, base: int, item: int) -> Layout:
    return layout.with_draft([base], [item * PAGES], item, draft_layer_ids=[0],
                             num_hidden_layers=preset.num_layers)


def _groups(kind: str, size: int, n_layers: int, seal: list[int], roles: list[str]) -> LayerGroups:
    if kind == "every":
        return LayerGroups.every_layer(seal_layers=seal, seal_roles=roles)
    if kind == "fixed":
        return LayerGroups.fixed(size, seal_layers=seal, seal_roles=roles)
    sets = [list(range(k, min(k + size, n_layers))) for k in range(0, n_layers, size)][::-1]
    return LayerGroups.sets(sets + [[]], seal_layers=seal, seal_roles=roles)


@settings(max_examples=150)
@given(
    key=st.sampled_from(["deepseek-v3", "qwen3-235b", "kimi-linear", "qwen3-next"]),
    layers=st.integers(4, 9),
    pp=st.sampled_from([1, 2, 4]),
    stage=st.integers(0, 3),
    tp=st.sampled_from([(1, 0, 1, 0), (2, 1, 1, 0), (1, 0, 2, 1), (4, 2, 2, 1)]),
    pages=st.sampled_from([(1, 1), (2, 2), (2, 4), (4, 2)]),
    cross_layer=st.booleans(),
    draft=st.booleans(),
    grouping=st.sampled_from(["every", "fixed", "sets"]),
    size=st.integers(1, 5),
    mark=st.booleans(),
    n_tokens=st.none() | st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_slices_and_seal_are_the_monolithic_plan(key, layers, pp, stage, tp, pages, cross_layer,
                                                 draft, grouping, size, mark, n_tokens, seed):
    preset = get_preset(key, layers)
    if preset.attention == "mla":
        tp = (1, 0, 1, 0)  # an MLA latent is replicated: no head slicing to draw
    ranges = split_layers(layers, min(pp, layers))
    held = ranges[stage % len(ranges)]
    (tp_p, rank_p, tp_d, rank_d), (ps_p, ps_d) = tp, pages
    order = "NHD" if preset.attention == "mha" else None  # publish heads for TP slicing
    src = preset.layout(held, page_size=ps_p, capacity=PAGES, state_slots=4,
                        base=PREFILL_BASE, pp_rank=stage % len(ranges), pp_size=len(ranges),
                        cross_layer=cross_layer, tp_rank=rank_p, tp_size=tp_p, memory_order=order)
    dst = preset.layout(range(layers), page_size=ps_d, capacity=PAGES, state_slots=4,
                        base=DECODE_BASE, cross_layer=cross_layer, tp_rank=rank_d, tp_size=tp_d,
                        memory_order=order)
    if draft and preset.attention == "mla" and tp == (1, 0, 1, 0):
        item = preset.kv_bytes_per_token * ps_p
        src = _with_draft(src, preset, PREFILL_BASE + (1 << 40), item)
        dst = _with_draft(dst, preset, DECODE_BASE + (1 << 40),
                          preset.kv_bytes_per_token * ps_d)
    seal = [held[0]] if mark else []
    groups = _groups(grouping, size, layers, seal, [])
    template = Template(src, dst, layer_groups=groups)
    resliced = template.plan_state(1, 2)
    if resliced.n_blocks > resliced.n_pairs:
        # A state slot cut into several byte slices (qwen3-next's GDN conv state, its q, k and
        # v sub-blocks, between TP sizes): layer slices refuse the template, naming the plan to
        # use, rather than cut the slot wrongly.
        with pytest.raises(kvplan.KvPlanError, match="several byte slices"):
            template.layer_slices(groups)
        assert preset.key == "qwen3-next" and tp_p != tp_d
        return
    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(PAGES)[: PAGES // 2].astype(np.int64)
    dst_pages = rng.permutation(PAGES)[: PAGES // 2].astype(np.int64)
    if rng.random() < 0.5:
        src_pages.sort()
        dst_pages.sort()
    by_token = template.by_token or n_tokens is not None
    if by_token:
        cap = min(len(src_pages) * ps_p, len(dst_pages) * ps_d)
        plan = template.plan(src_pages, dst_pages, n_tokens=None if n_tokens is None else min(n_tokens, cap))
    else:
        plan = template.plan(src_pages, dst_pages)
    cut = _check(template, src, groups, plan, set(seal), set())
    state = template.plan_state(1, 2)
    # The state plan's slices tile it too, each block with its layer's group.
    state_cut = _check(template, src, groups, state, set(seal), set())
    if preset.state and not mark:
        # Every held layer is in some group: a state entry reaches the seal only when marked.
        assert state_cut.seal_work == (0, 0)
    manifest = cut.manifest(seed, state_cut)
    for (gid, blocks, nbytes), page, more in zip(manifest.slices, cut.work, state_cut.work):
        assert (gid, blocks, nbytes) == (page[0], page[1] + more[1], page[2] + more[2])
    assert manifest.total_blocks == plan.n_blocks + state.n_blocks
    assert manifest.total_bytes == plan.total_bytes + state.total_bytes
    assert WorkManifest.from_bytes(manifest.to_bytes()) == manifest
    assert manifest.prefill == (stage % len(ranges), len(ranges), rank_p, tp_p)


def test_coalesced_pool_slices_need_the_groups_at_build_time():
    preset = get_preset("deepseek-v3", 8)
    src = preset.layout(range(8), page_size=1, capacity=PAGES, base=PREFILL_BASE, cross_layer=True)
    dst = preset.layout(range(8), page_size=1, capacity=PAGES, base=DECODE_BASE, cross_layer=True)
    groups = LayerGroups.fixed(4)
    with pytest.raises(KvPlanError, match="coalesced into one block per run.*layer_groups"):
        Template(src, dst).layer_slices(groups)
    template = Template(src, dst, layer_groups=groups)
    plan = template.plan(np.arange(6), np.arange(6) + 3)
    cut = _check(template, src, groups, plan, set(), set())
    # One strided piece per group: each page of a group is one block of its 4 layers' items.
    assert [w[1] for w in cut.work] == [6, 6]
    assert set(plan.lengths.tolist()) == {4 * preset.kv_bytes_per_token}


def test_unknown_layers_plans_of_other_templates_and_bad_wire_are_refused():
    preset = get_preset("deepseek-v3", 8)
    stage = preset.layout(range(4, 8), page_size=1, capacity=PAGES, base=PREFILL_BASE,
                          pp_rank=1, pp_size=2)
    dst = preset.layout(range(8), page_size=1, capacity=PAGES, base=DECODE_BASE)
    template = Template(stage, dst)
    slices = template.layer_slices(LayerGroups.fixed(3))
    assert slices.layers == [[], [4, 5], [6, 7]]
    assert slices.slice_of_layer(7) == 2
    assert slices.slice_of_layer(0) is None  # stage 0's layer: nothing to wait for here
    with pytest.raises(KvPlanError, match="layer 8 is not a layer"):
        slices.slice_of_layer(8)
    other = Template(stage, dst)
    with pytest.raises(KvPlanError, match="another template"):
        slices.of(other.plan(np.arange(2), np.arange(2)))
    with pytest.raises(KvPlanError, match="layer groups 0 and 1"):
        LayerGroups.sets([[1, 2], [2]])
    with pytest.raises(KvPlanError, match="at least 1"):
        LayerGroups.fixed(0)
    data = slices.of(template.plan(np.arange(2), np.arange(2))).manifest(5).to_bytes()
    with pytest.raises(KvPlanError, match="CRC-32"):
        WorkManifest.from_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(KvPlanError, match="not a manifest"):
        WorkManifest.from_bytes(b"KVPL" + data[4:])


def test_a_model_layer_in_no_caller_set_completes_nothing_on_every_stage():
    # Per-layer hooks fire for every layer: a caller that streams only some layers' groups
    # signals the others too, and the answer must not depend on which PP stage is asked.
    preset = get_preset("deepseek-v3", 8)
    dst = preset.layout(range(8), page_size=1, capacity=PAGES, base=DECODE_BASE)
    groups = LayerGroups.sets([[4, 5]])
    for stage in (range(4), range(4, 8)):
        src = preset.layout(stage, page_size=1, capacity=PAGES, base=PREFILL_BASE,
                            pp_rank=stage[0] // 4, pp_size=2)
        slices = Template(src, dst, layer_groups=groups).layer_slices(groups)
        for layer in (0, 3, 6, 7):
            assert slices.slice_of_layer(layer) is None
        assert slices.slice_of_layer(5) == (0 if stage[0] == 4 else None)
        for bad in (-1, 8, 1 << 40):
            with pytest.raises(KvPlanError, match=f"layer {bad} is not a layer of this model"):
                slices.slice_of_layer(bad)


def _dcp_mla(n_layers: int, page: int, capacity: int, dcp: tuple[int, int, int], base: int,
             pp: tuple[int, int] = (0, 1), tp: tuple[int, int] = (0, 1),
             layers: range | None = None) -> Layout:
    size, rank, interleave = dcp
    ids = list(layers if layers is not None else range(n_layers))
    item = page * 8  # 8 bytes per token per layer
    ptrs = [base + k * capacity * item * 2 for k in range(len(ids))]
    return Layout.mla(ptrs, [capacity * item] * len(ids), item, ids, page_size=page,
                      dcp_size=size, dcp_rank=rank, dcp_interleave=interleave,
                      pp_rank=pp[0], pp_size=pp[1], tp_rank=tp[0], tp_size=tp[1])


def test_slice_work_under_decode_context_parallelism_counts_what_the_rank_receives():
    # The example from review: prefill DCP 1 -> decode DCP 2 rank 1, 8 tokens, 2 MLA layers.
    src = _dcp_mla(2, 4, 8, (1, 0, 1), PREFILL_BASE)
    dst = _dcp_mla(2, 4, 8, (2, 1, 1), DECODE_BASE)
    groups = LayerGroups.every_layer()
    template = Template(src, dst, layer_groups=groups)
    plan = template.plan(np.arange(2), np.arange(1), n_tokens=8)
    cut = template.layer_slices(groups).of(plan)
    assert cut.work == [(0, 4, 32), (1, 4, 32)]
    assert cut.manifest(0).total_bytes == plan.total_bytes == 64


def _work_of_ranges(ranges, lengths) -> tuple[int, int]:
    return (sum(b - a for a, b in ranges), sum(int(lengths[a:b].sum()) for a, b in ranges))


@pytest.mark.parametrize("src_dcp", [(1, 1), (2, 1), (4, 2), (2, 4)])
@pytest.mark.parametrize("dst_dcp", [(1, 1), (2, 1), (4, 1), (8, 2), (2, 8)])
@pytest.mark.parametrize(("pages", "pp", "tp"), [((4, 4), 1, 1), ((2, 8), 2, 2), ((8, 2), 2, 1),
                                                 ((16, 16), 1, 2)])
def test_slice_work_equals_the_plans_blocks_and_bytes_for_every_dcp_rank_pair(src_dcp, dst_dcp,
                                                                              pages, pp, tp):
    n_layers, n_tokens = 4, 53
    groups = LayerGroups.fixed(2)
    for stage in range(pp):
        layers = range(stage * n_layers // pp, (stage + 1) * n_layers // pp)
        for s_rank in range(src_dcp[0]):
            src = _dcp_mla(n_layers, pages[0], 64, (src_dcp[0], s_rank, src_dcp[1]), PREFILL_BASE,
                           pp=(stage, pp), layers=layers)
            for d_rank in range(dst_dcp[0]):
                for tp_rank in range(tp):
                    dst = _dcp_mla(n_layers, pages[1], 64, (dst_dcp[0], d_rank, dst_dcp[1]),
                                   DECODE_BASE, tp=(tp_rank, tp))
                    template = Template(src, dst, layer_groups=groups)
                    plan = template.plan(np.arange(60)[::-1].copy(), np.arange(60) * 2 % 64,
                                         n_tokens=n_tokens)
                    cut = template.layer_slices(groups).of(plan)
                    for (_, blocks, nbytes), ranges in zip(cut.work, cut.ranges):
                        assert (blocks, nbytes) == _work_of_ranges(ranges, plan.lengths)
                    assert cut.seal_work == _work_of_ranges(cut.seal_ranges, plan.lengths)
                    assert cut.manifest(0).total_bytes == plan.total_bytes
                    assert cut.manifest(0).total_blocks == plan.n_blocks
