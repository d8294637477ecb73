"""kvplan.select_pairing: one test per row of the policy table (docs/cli.md, kvplan/policy.py).

Where a row's pairing can be checked end to end, the expected pairs are the worked examples of
docs/semantics.md (Ascend; Worked examples: W-positional, W-mla-pp-slice, W-mha-pp-slice,
W-mha-hybrid-stage1, W-ascend-hybrid-dispatch, W-ascend-pp1-flat, W-ascend-groups,
W-hybrid-pp-stage1), not kvplan output.
"""

from __future__ import annotations

import pytest

import kvplan
from kvplan import KvPlanError, Layout, Pairing, select_pairing
from kvplan.policy import layout_kind

FULL60 = list(range(3, 60, 4))  # 60-layer hybrid, full attention every 4th layer
STAGE1 = [31, 35, 39, 43, 47, 51, 55, 59]


def dst_ptr_pairs(template, dst):
    return [(i, dst.data_ptrs[j]) for i, j in template.pairs.tolist()]


# --------------------------------------------------------------------- layout kinds


def test_layout_kind_inference():
    assert layout_kind(Layout.mla([1, 2], [64, 64], 8)) == "mla"
    assert layout_kind(Layout.mla([1, 2], [64, 64], 8, layer_ids=[0, 1])) == "mla"
    assert layout_kind(Layout.mha([1], [2], [64], [64], 8, 8, layer_ids=[0])) == "mha"
    assert layout_kind(Layout.npu_groups([4, 5], [1, 2, 3, 4], [64] * 4, 8)) == "mla"
    assert layout_kind(Layout.hybrid_linear(STAGE1, list(range(8)), [64] * 8, 8)) == "hybrid_mla"
    assert layout_kind(Layout.hybrid_linear(STAGE1, list(range(16)), [64] * 16, 8, mla=False)) \
        == "hybrid_mha"
    # NPU hybrid: ids repeated once per buffer group (W-hybrid-ids: [3,7,3,7]).
    assert layout_kind(Layout.npu_groups([3, 7], [1, 2, 3, 4], [64] * 4, 8)) == "hybrid_mla"
    # A hybrid stage with one full-attention layer is recognised by its state entries.
    one = Layout.hybrid_linear([7], [1], [64], 8).with_state("mamba_conv", [9], [64], 16, [4])
    assert layout_kind(one) == "hybrid_mla"
    # Draft entries above the model do not make a dense model sparse.
    drafted = Layout.mla([1, 2], [64, 64], 8, layer_ids=[0, 1], num_model_layers=2).with_draft(
        [3], [64], 8, draft_layer_ids=[0], num_hidden_layers=2)
    assert layout_kind(drafted) == "mla"


def test_layout_kind_needs_roles():
    bare = Layout([1, 2], [64, 64], 8, layer_ids=[0, 1])
    with pytest.raises(KvPlanError, match="pass the layout kind as a string"):
        layout_kind(bare)


# --------------------------------------------------------------------- Ascend rows


def test_row_ascend_hybrid_mla_pp_uses_layer_ids():
    # W-ascend-hybrid-dispatch / TestAscendHybridPpDispatch: hybrid-MLA Ascend, pp_size 2,
    # src ids [31,35,31,35] (two NPU buffer groups), decode ids [3,7,31,35,3,7,31,35]
    # -> layer-id pairing.
    src = Layout.npu_groups([31, 35], [101, 102, 103, 104], [1100, 1200, 1300, 1400],
                            [11, 12, 13, 14], pp_rank=1, pp_size=2, device="npu")
    dst = Layout.npu_groups([3, 7, 31, 35], list(range(8)), [1400] * 8,
                            [11, 11, 11, 12, 13, 13, 13, 14], device="npu")
    choice = select_pairing("ascend", src, 2)
    assert (choice.mode, choice.rule, choice.layout_kind) == (
        "layer_id", "ascend-hybrid-mla-pp", "hybrid_mla")
    assert choice.pairing() == Pairing.by_layer_id()
    t = choice.template(src, dst)
    # FIFO by id: 31 -> decode 2, 35 -> 3, 31 (group 1) -> 6, 35 (group 1) -> 7.
    assert t.pairs.tolist() == [[0, 2], [1, 3], [2, 6], [3, 7]]


def test_row_ascend_hybrid_mla_pp_default_pp_from_layout():
    src = Layout.hybrid_linear(STAGE1, list(range(8)), [64] * 8, 8, pp_rank=1, pp_size=2)
    assert select_pairing("Ascend", src).mode == "layer_id"
    assert select_pairing("ascend", "hybrid_mla", 4).mode == "layer_id"


def test_row_ascend_hybrid_mla_pp1_is_legacy_flat():
    choice = select_pairing("ascend", "hybrid_mla", 1)
    assert (choice.mode, choice.rule) == ("positional", "ascend-pp1")
    assert choice.pairing() == Pairing.positional()


def test_row_ascend_pp1_flat():
    # W-ascend-pp1-flat: Ascend PP 1, MLA entries [1000,2000,3000] items [10,20,30]
    # -> [7000,8000,9000].
    src = Layout.mla([1000, 2000, 3000], [1000] * 3, [10, 20, 30], device="npu")
    dst = Layout.mla([7000, 8000, 9000], [1000] * 3, [10, 20, 30], device="npu")
    choice = select_pairing("ascend", src, 1)
    assert (choice.mode, choice.rule, choice.layout_kind) == ("positional", "ascend-pp1", "mla")
    import numpy as np

    plan = choice.template(src, dst).plan(np.array([1, 2, 5], np.int32),
                                          np.array([4, 5, 9], np.int32))
    assert plan.as_lists() == (
        [1010, 1050, 2020, 2100, 3030, 3150],
        [7040, 7090, 8080, 8180, 9120, 9270],
        [20, 10, 40, 20, 60, 30],
    )


def test_row_ascend_pp1_ignores_ids_like_the_legacy_path():
    # At PP 1 the Ascend legacy path pairs flat by position even if ids exist
    # (docs/semantics.md, Ascend).
    src = Layout.hybrid_linear([3, 7], [10, 20], [640, 640], 64)
    dst = Layout.hybrid_linear([3, 7, 11], [30, 40, 50], [640] * 3, 64)
    t = select_pairing("ascend", src, 1).template(src, dst)
    assert t.pairs.tolist() == [[0, 0], [1, 1]]


def test_row_ascend_mla_pp_legacy_slice():
    # W-mla-pp-slice: start 2, src [1,2] -> dst [10..14] slices to [12, 13].
    src = Layout.mla([1, 2], [640, 640], 64, pp_rank=1, pp_size=2, device="npu")
    dst = Layout.mla([10, 11, 12, 13, 14], [640] * 5, 64, device="npu")
    choice = select_pairing("ascend", src, 2)
    assert (choice.mode, choice.rule, choice.legacy_kind) == ("legacy", "ascend-mla-pp", "mla")
    assert choice.pairing(2) == Pairing.legacy("mla", prefill_start_layer=2)
    t = choice.template(src, dst, prefill_start_layer=2)
    assert [dst.data_ptrs[j] for _, j in t.pairs.tolist()] == [12, 13]


def test_row_ascend_mla_pp_needs_start_layer():
    choice = select_pairing("ascend", "mla", 2)
    with pytest.raises(KvPlanError, match="prefill_start_layer"):
        choice.pairing()
    with pytest.raises(KvPlanError, match="prefill_start_layer"):
        choice.template(Layout.mla([1], [64], 64), Layout.mla([2], [64], 64))


def test_the_choice_has_no_shorthand_keywords():
    # The pairing keywords it returned were removed from Template and compare; pairing() is
    # the one spelling of a choice.
    assert not hasattr(select_pairing("ascend", "mla", 2), "template_kwargs")


def test_row_ascend_npu_groups_pp_slices_per_group():
    # W-ascend-groups: 2 buffer groups, 4 target + 1 draft layer on decode, stage from layer 2.
    # Ascend slices per group: a flat slice would pair group 1 with group 0 of other layers.
    dst = Layout([100, 101, 102, 103, 200, 201, 202, 203, 300, 400], [640] * 10, 64,
                 roles=["g0"] * 4 + ["g1"] * 4 + ["draft_g0", "draft_g1"])
    src = Layout([102, 103, 202, 203, 300, 400], [640] * 6, 64,
                 roles=["g0", "g0", "g1", "g1", "draft_g0", "draft_g1"], pp_rank=1, pp_size=2)
    choice = select_pairing("ascend", src, 2)
    assert (choice.mode, choice.legacy_kind) == ("legacy", "mla")
    t = choice.template(src, dst, prefill_start_layer=2)
    assert [dst.data_ptrs[j] for _, j in t.pairs.tolist()] == [102, 103, 202, 203, 300, 400]
    # Non-last rank without draft entries: [K2, K3, V2, V3].
    t = choice.template(Layout([102, 103, 202, 203], [640] * 4, 64,
                               roles=["g0", "g0", "g1", "g1"]), dst, prefill_start_layer=2)
    assert [dst.data_ptrs[j] for _, j in t.pairs.tolist()] == [102, 103, 202, 203]
    with pytest.raises(kvplan.PairingError, match="role \"g0\" from layer 3"):
        choice.template(src, dst, prefill_start_layer=3)


@pytest.mark.parametrize("kind", ["mha", "hybrid_mha"])
def test_row_ascend_mha_pp_legacy_slice(kind):
    assert select_pairing("ascend", kind, 2).legacy_kind == "mha"
    # W-mha-pp-slice: start 2, src [102,103,202,203], dst K 100..103 V 200..203
    # -> K [102,103] V [202,203].
    src = Layout.mha([102, 103], [202, 203], [640] * 2, [640] * 2, 64, 64, pp_rank=1, pp_size=2)
    dst = Layout.mha([100, 101, 102, 103], [200, 201, 202, 203], [640] * 4, [640] * 4, 64, 64)
    choice = select_pairing("ascend", src, 2)
    assert (choice.mode, choice.rule, choice.layout_kind) == ("legacy", "ascend-mha-pp", "mha")
    t = choice.template(src, dst, prefill_start_layer=2)
    assert [dst.data_ptrs[j] for _, j in t.pairs.tolist()] == [102, 103, 202, 203]


# --------------------------------------------------------------------- every other backend


@pytest.mark.parametrize("backend", ["mooncake", "nixl", "Mooncake "])
@pytest.mark.parametrize("pp", [1, 2])
def test_row_default_ids_pair_by_layer_id(backend, pp):
    # W-mha-hybrid-stage1: src ids [7,11,7,11] (MHA hybrid stage 1) onto dst [3,7,11,3,7,11].
    src = Layout.hybrid_linear([7, 11], [10, 11, 20, 21], [64] * 4, 4, mla=False,
                               pp_rank=pp - 1, pp_size=pp)
    dst = Layout.hybrid_linear([3, 7, 11], [100, 101, 102, 200, 201, 202], [64] * 6, 4,
                               mla=False)
    choice = select_pairing(backend, src, pp)
    assert (choice.mode, choice.rule) == ("layer_id", "default-ids")
    assert choice.backend == backend.strip().lower()
    t = choice.template(src, dst)
    assert dst_ptr_pairs(t, dst) == [(0, 101), (1, 102), (2, 201), (3, 202)]


def test_row_default_ids_dense_mla_hybrid_pp_stage1():
    # W-hybrid-pp-stage1 / TestHybridSendUsesLayerIdPairing stage 1:
    # stage entry i -> decode entry 7 + i.
    src = Layout.hybrid_linear(STAGE1, list(range(1000, 1008)), [64] * 8, 8, pp_rank=1, pp_size=2)
    dst = Layout.hybrid_linear(FULL60, list(range(2000, 2015)), [64] * 15, 8)
    t = select_pairing("mooncake", src).template(src, dst)
    assert t.pairs.tolist() == [[i, 7 + i] for i in range(8)]


def test_row_default_no_ids_pp1_positional():
    # W-positional: pairs([], [], 3, 5, fallback=True) -> [(0,0),(1,1),(2,2)].
    src = Layout.mla([1, 2, 3], [640] * 3, 64)
    dst = Layout.mla([10, 11, 12, 13, 14], [640] * 5, 64)
    choice = select_pairing("mooncake", src, 1)
    assert (choice.mode, choice.rule) == ("positional", "default-no-ids-pp1")
    assert choice.template(src, dst).pairs.tolist() == [[0, 0], [1, 1], [2, 2]]


def test_row_default_no_ids_pp_legacy_slice():
    # W-mla-pp-slice on a non-Ascend backend: no ids, PP 2 -> strict legacy slicing.
    src = Layout.mla([1, 2], [640, 640], 64, pp_rank=1, pp_size=2)
    dst = Layout.mla([10, 11, 12, 13, 14], [640] * 5, 64)
    choice = select_pairing("mooncake", src)
    assert (choice.mode, choice.rule, choice.legacy_kind) == ("legacy", "default-no-ids-pp", "mla")
    t = choice.template(src, dst, prefill_start_layer=2)
    assert [dst.data_ptrs[j] for _, j in t.pairs.tolist()] == [12, 13]


def test_kind_strings_and_errors():
    assert select_pairing("mooncake", "hybrid_mha", 2).mode == "layer_id"
    assert select_pairing("mooncake", "mha", 2).legacy_kind == "mha"
    with pytest.raises(KvPlanError, match="unknown layout kind"):
        select_pairing("ascend", "dense", 2)
    with pytest.raises(KvPlanError, match="pp_size"):
        select_pairing("ascend", "mla")
    with pytest.raises(KvPlanError, match="pp_size"):
        select_pairing("ascend", "mla", 0)


def test_exported_from_kvplan():
    assert kvplan.select_pairing is select_pairing
    assert "select_pairing" in kvplan.__all__ and "PairingChoice" in kvplan.__all__


def test_legacy_kv_keeps_state_ids():
    # SGLang pairs state components by id whenever published, whatever path the KV takes:
    # Ascend hybrid MHA at PP 2 slices K/V positionally but pairs Mamba state by layer id.
    src = Layout.hybrid_linear([7], [1, 2], [640, 640], 64, mla=False, pp_rank=1, pp_size=2)
    src = src.with_state("mamba_conv", [3], [160], 16, [5])
    dst = Layout.hybrid_linear([3, 7], [10, 11, 12, 13], [640] * 4, 64, mla=False)
    dst = dst.with_state("mamba_conv", [14, 15], [160, 160], 16, [4, 5])
    choice = select_pairing("ascend", src)
    assert (choice.mode, choice.legacy_kind) == ("legacy", "mha")
    t = choice.template(src, dst, prefill_start_layer=1)
    # K7 -> decode entry 1, V7 -> decode entry 3 (legacy MHA slice), state layer 5 -> entry 5.
    assert t.pairs.tolist() == [[0, 1], [1, 3]]
    assert t.state_pairs.tolist() == [[2, 5]]
    assert choice.compare(src, dst, prefill_start_layer=1).compatible
