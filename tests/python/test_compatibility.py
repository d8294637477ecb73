"""Compatibility verdicts: each mismatch that passes a geometry check refused with both values
named, and no false refusal on a sweep of pairs the planner can plan (TP, page sizes, memory
orders, cross-layer pools, PP stages, DCP, conversions): the verdict agrees with whether
``Template`` (or ``ConversionTemplate``) builds, and a plannable TP/page-size pair plans a
request byte for byte."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings

import kvplan
from kvplan import KvPlanError, Layout, ModelSemantics, compatibility, layout_identity
from kvplan.presets import PRESETS
from kvplan.testing.fixtures import fixtures
from kvplan.testing.ranks import check_request, rank_memory
from kvplan.testing.specs import build_layout, model_peers
from kvplan.testing.strategies import Request, requests

from support.convert_cases import Deployment, decode, prefill

SEMANTICS = ModelSemantics(model="org/model", revision="abc123",
                           rope={"type": "yarn", "factor": 1}, transfer="push")


def _mha(base: int, *, memory_order: str = "NHD", draft: bool = False,
         cross_layer: bool = False) -> Layout:
    """Two MHA layers of 16-token pages; optionally a draft layer, or one cross-layer pool."""
    item = 16 * 8 * 128 * 2
    ctx = dict(page_size=16, kv_heads=8, head_dim=128, dtype_size=2, memory_order=memory_order,
               num_model_layers=2)
    if cross_layer:
        return Layout.cross_layer(base, 64 * 4 * item, [0, 0, 1, 1], [item] * 4,
                                  roles=["k", "v", "k", "v"], **ctx)
    mb = 1 << 24
    layout = Layout.mha([base, base + mb], [base + 2 * mb, base + 3 * mb], [64 * item] * 2,
                        [64 * item] * 2, item, item, [0, 1], **ctx)
    if draft:
        layout = layout.with_draft([base + 4 * mb], [64 * item], item, draft_layer_ids=[2],
                                   num_hidden_layers=2)
    return layout


def _with(**changes: object) -> ModelSemantics:
    return dataclasses.replace(SEMANTICS, **changes)  # type: ignore[arg-type]


#: The mismatches: (name, prefill identity, decode identity, the two values the reason names).
REPLAYS = [
    ("RoPE factor 1 -> 2",
     layout_identity(_mha(1 << 32), SEMANTICS),
     layout_identity(_mha(1 << 40), _with(rope={"type": "yarn", "factor": 2.0})),
     ('"factor\\":1', '"factor\\":2')),
    ("two revisions, identical geometry",
     layout_identity(_mha(1 << 32), SEMANTICS),
     layout_identity(_mha(1 << 40), _with(revision="def456")),
     ('"abc123"', '"def456"')),
    ("push vs pull",
     layout_identity(_mha(1 << 32), SEMANTICS),
     layout_identity(_mha(1 << 40), _with(transfer="pull")),
     ("push", "pull")),
    ("a draft model on one side only",
     layout_identity(_mha(1 << 32), SEMANTICS),
     layout_identity(_mha(1 << 40, draft=True), _with(drafts=["org/eagle"])),
     ("[]", '["org/eagle"]')),
    ("a draft model on the prefill only",
     layout_identity(_mha(1 << 32, draft=True), _with(drafts=["org/eagle"])),
     layout_identity(_mha(1 << 40), SEMANTICS),
     ('["org/eagle"]', "[]")),
    ("a cross-layer flag on one side only",
     layout_identity(_mha(1 << 32), SEMANTICS),
     layout_identity(_mha(1 << 40), _with(cross_layer=True)),
     ("false", "true")),
    ("a cross-layer flag and pool on one side only",
     layout_identity(_mha(1 << 32, cross_layer=True), _with(cross_layer=True)),
     layout_identity(_mha(1 << 40), SEMANTICS),
     ("true", "false")),
    ("model ids differ",
     layout_identity(_mha(1 << 32), SEMANTICS),
     layout_identity(_mha(1 << 40), _with(model="org/other")),
     ('"org/model"', '"org/other"')),
]


@pytest.mark.parametrize("name,ours,theirs,values", REPLAYS, ids=[r[0] for r in REPLAYS])
def test_each_mismatch_is_refused_naming_both_values(
        name: str, ours: kvplan.LayoutIdentity, theirs: kvplan.LayoutIdentity,
        values: tuple[str, str]) -> None:
    verdict = compatibility(ours, theirs)
    assert verdict.kind == "refused" and not verdict and not verdict.plannable, name
    assert verdict.refused_by == "semantics"
    assert ours.class_id != theirs.class_id
    prefill_value, decode_value = values
    reason = verdict.reason
    assert prefill_value in reason and decode_value in reason, reason
    assert reason.index(prefill_value) < reason.index(decode_value), reason


def test_memory_order_swapped_with_identical_sizes() -> None:
    nhd, hnd = _mha(1 << 32), _mha(1 << 40, memory_order="HND")
    assert nhd.item_lens == hnd.item_lens
    a, b = layout_identity(nhd, SEMANTICS), layout_identity(hnd, SEMANTICS)
    # An offload store keyed by the identity never reads NHD-written blocks as HND.
    assert a.class_id != b.class_id and a.layout_id != b.layout_id
    # Between a prefill and a decode, the template re-lays pages token by token.
    verdict = compatibility(a, b)
    assert verdict.kind == "plannable_with_conversion", verdict.reason
    assert "NHD" in verdict.reason and "HND" in verdict.reason
    request = kvplan.Request(np.array([0, 1]), np.array([5, 6]))
    assert kvplan.Template(nhd, hnd).plan(request).n_blocks > 0  # the gate plans it


def test_a_geometry_refusal_comes_from_the_template_and_names_both_sizes() -> None:
    small = Layout.mla([1 << 20], [1 << 16], 576, [0], page_size=1)
    large = Layout.mla([1 << 30], [1 << 16], 1152, [0], page_size=1)
    verdict = compatibility(layout_identity(small, SEMANTICS), layout_identity(large, SEMANTICS))
    with pytest.raises(KvPlanError) as err:
        kvplan.Template(small, large)
    assert verdict.kind == "refused" and verdict.refused_by == err.value.kind
    assert str(err.value) in verdict.reason and "576" in verdict.reason
    assert "1152" in verdict.reason


def _gate(src: Layout, dst: Layout) -> str:
    """What the planner's constructors say: "direct", "conversion" or "refused"."""
    try:
        kvplan.Template(src, dst)
        return "direct"
    except KvPlanError:
        pass
    try:
        return "conversion" if kvplan.ConversionTemplate(src, dst).converts else "refused"
    except KvPlanError:
        return "refused"


def _agrees(src: Layout, dst: Layout, counts: dict[str, int]) -> None:
    verdict = compatibility(layout_identity(src, SEMANTICS), layout_identity(dst, SEMANTICS))
    gate = _gate(src, dst)
    counts[gate] = counts.get(gate, 0) + 1
    assert verdict.plannable == (gate != "refused"), (gate, verdict)
    if gate == "conversion":
        assert verdict.kind == "plannable_with_conversion"
    if gate == "direct":
        relaid = src.memory_order is not None and dst.memory_order is not None and \
            src.memory_order != dst.memory_order
        assert verdict.kind == ("plannable_with_conversion" if relaid else "plannable"), verdict


def test_no_false_refusal_on_the_planning_fixtures_pp_dcp_and_conversions() -> None:
    counts: dict[str, int] = {}
    for fixture in fixtures():  # PP stages, equal and different TP, DCP, staging, state
        sources, dst = fixture.layouts()
        for src in sources:
            _agrees(src, dst, counts)
    for key, pp_size, page_size, cross in itertools.product(
            ("deepseek-v3", "qwen3-next", "kimi-linear", "gpt-oss-120b"), (1, 2, 4), (1, 16),
            (False, True)):
        preset = PRESETS[key]
        if cross and (preset.attention == "mla" or preset.components):
            continue
        peers = model_peers(preset, pages=4, pp_size=pp_size, page_size=page_size,
                            cross_layer=cross, decode_cross_layer=False)
        dst = build_layout(peers.decode, 1 << 44)
        for r, stage in enumerate(peers.prefill):
            _agrees(build_layout(stage, (r + 1) << 40), dst, counts)
    for dcp_size in (2, 4):  # a PP=1 prefill into every rank of a DCP decode
        preset = PRESETS["deepseek-v3"]
        src = preset.layout(range(4), page_size=16, capacity=8)
        for rank in range(dcp_size):
            dst = preset.layout(range(4), page_size=16, capacity=8, dcp_size=dcp_size,
                                dcp_rank=rank, base=1 << 44)
            _agrees(src, dst, counts)
    for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(
            (1, 2, 4), (1, 2, 4), (1, 2), ((1, 1), (2, 1), (1, 2))):
        dep = Deployment(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d,
                         scales="per_token_head")
        real, _ = decode(dep, 0)
        for r_p in range(tp_p):
            _agrees(prefill(dep, r_p, 0, seed=r_p).layout, real.layout, counts)
    assert counts.get("refused", 0) == 0, counts
    assert counts["direct"] >= 90 and counts["conversion"] >= 100, counts


@settings(max_examples=120)
@given(requests())
def test_no_false_refusal_on_drawn_tp_page_size_memory_order_pairs(case: Request) -> None:
    dst = rank_memory(case.model, case.decode)
    counts: dict[str, int] = {}
    for r_p in range(case.prefill.tp_size):
        src = rank_memory(case.model, dataclasses.replace(case.prefill, tp_rank=r_p))
        _agrees(src.layout, dst.layout, counts)
    if "refused" not in counts:
        # Plannable: every prefill rank's plan writes the oracle's bytes.
        check_request(case.model, case.prefill, case.decode, case.src_pages, case.dst_pages,
                      n_tokens=case.n_tokens)


def test_the_pairing_the_pair_is_planned_with_is_the_one_asked() -> None:
    stage = Layout([1 << 20, 1 << 21], [4096] * 2, 512)
    whole = Layout([1 << 30, 1 << 31, 1 << 32], [4096] * 3, 512)
    a, b = layout_identity(stage, SEMANTICS), layout_identity(whole, SEMANTICS)
    refused = compatibility(a, b)
    assert refused.kind == "refused" and "layer ids" in refused.reason
    legacy = kvplan.Pairing.legacy("mla", prefill_start_layer=1)
    assert compatibility(a, b, legacy).kind == "plannable"
    kvplan.Template(stage, whole, legacy)
