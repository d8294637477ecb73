"""kvplan.compare: the handshake compatibility report.

Pairings expected here are docs/semantics.md's worked examples; the central property is
that the report and Template never disagree (same verdict, same first error, same pairs).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan import (
    CompatReport,
    KvPlanError,
    Layout,
    Pairing,
    PairingError,
    SizeMismatchError,
    Template,
)
from kvplan.report import format_ids

FULL60 = list(range(3, 60, 4))
STAGE1 = [31, 35, 39, 43, 47, 51, 55, 59]
ITEM = 1152


def hybrid(ids, base, *, item=ITEM, cap=64, **ctx):
    n = len(ids)
    return Layout.hybrid_linear(ids, [base + i * (1 << 24) for i in range(n)], [cap * item] * n,
                                item, **ctx)


def stage1():
    return hybrid(STAGE1, 1 << 32, pp_rank=1, pp_size=2, num_model_layers=60)


def decode():
    return hybrid(FULL60, 1 << 40, num_model_layers=60)


def template_outcome(src, dst, *args, **kwargs):
    try:
        t = Template(src, dst, *args, **kwargs)
    except KvPlanError as e:
        return None, (type(e).__name__, str(e))
    return [tuple(p) for p in t.pairs.tolist()] + [tuple(p) for p in t.state_pairs.tolist()], None


# ------------------------------------------------------------------------ compatible


def test_hybrid_stage1_compatible_pairs_by_layer_id():
    # W-hybrid-pp-stage1, stage 1 of 60 layers: stage entry i -> decode 7+i.
    report = kvplan.compare(stage1(), decode())
    assert isinstance(report, CompatReport)
    assert report.compatible and bool(report)
    assert report.reasons == () and report.first_problem is None
    assert report.pairs == tuple((i, 7 + i) for i in range(8))
    assert [e.layer_id for e in report.entries] == STAGE1
    assert all(e.ok and e.src_item_len == e.dst_item_len == ITEM for e in report.entries)
    report.raise_if_incompatible()  # no-op
    text = str(report)
    assert "verdict: compatible" in text
    assert "prefill stage (PP rank 1 of 2) covers layers 31–59 every 4th" in text
    # Decode layers 3..27 belong to stage 0: not an error for a PP stage, but said.
    assert "decode layers 3–27 every 4th get nothing from this prefill: another PP stage" in text
    assert "src 0–7" in text and "dst 7–14" in text


def test_pp1_prefill_with_extra_decode_layers_is_flagged():
    src = hybrid(FULL60[:-1], 1 << 32, num_model_layers=60)
    report = kvplan.compare(src, decode())
    assert report.compatible  # Template accepts it (extra decode entries are legal) ...
    assert any("decode layers 59 get nothing from this prefill: nothing will write them" in c
               for c in report.coverage)  # ... but at PP 1 nobody else writes layer 59


# ------------------------------------------------------------------------ incompatible


def test_missing_layer_in_words():
    # A stage that covers 31–59 and sends draft layer 60; decode has no 60.
    src = stage1().with_draft([9 << 32], [64 * ITEM], ITEM, draft_layer_ids=[0],
                              num_hidden_layers=60)
    report = kvplan.compare(src, decode())
    assert not report.compatible
    assert [e.src_index for e in report.unpaired] == [8]
    assert report.unpaired[0].layer_id == 60
    assert "decode has no entry for layer 60" in report.coverage
    text = str(report)
    assert "verdict: NOT compatible" in text
    assert "covers layers 31–59 every 4th" in text and "plus draft band 60" in text
    assert "1 source entry has no decode partner: layer 60 draft" in text
    with pytest.raises(PairingError) as err:
        Template(src, decode())
    assert report.first_problem == ("PairingError", str(err.value))
    with pytest.raises(PairingError) as again:
        report.raise_if_incompatible()
    assert str(again.value) == str(err.value)


def test_item_size_mismatch_mamba_slot():
    # W-mamba-slot-mismatch: Mamba slot 16 bytes on prefill, 32 on decode -> refused before
    # any transfer.
    src = stage1().with_state("mamba_conv", [7 << 32], [16 * 8], 16, [30])
    dst = decode().with_state("mamba_conv", [8 << 32], [32 * 8], 32, [30])
    report = kvplan.compare(src, dst)
    assert not report.compatible
    [bad] = report.size_mismatches
    assert (bad.kind, bad.layer_id, bad.role, bad.src_item_len, bad.dst_item_len) == (
        "state", 30, "mamba_conv", 16, 32)
    assert bad.error == "SizeMismatchError"
    assert report.reasons == (
        "1 paired entry differs in item size (prefill vs decode): layer 30 mamba_conv 16 vs "
        "32 bytes",)
    with pytest.raises(SizeMismatchError) as err:
        Template(src, dst)
    assert report.first_problem == ("SizeMismatchError", str(err.value))
    assert "state: 0 of 1 entry (mamba_conv) paired" in report.coverage


def test_every_problem_listed_not_only_the_first():
    # Template stops at the first problem; the report lists all of them.
    src = hybrid([31, 35, 63], 1 << 32, pp_rank=1, pp_size=2)
    dst = Layout.hybrid_linear(FULL60, [1 << 40] * 15, [64 * ITEM] * 15,
                               [ITEM] * 7 + [2 * ITEM] + [ITEM] * 7)
    report = kvplan.compare(src, dst)
    assert [(e.layer_id, e.error) for e in report.entries] == [
        (31, "SizeMismatchError"), (35, None), (63, "PairingError")]
    assert report.reasons == (
        "1 source entry has no decode partner: layer 63 kv",
        "1 paired entry differs in item size (prefill vs decode): layer 31 kv 1152 vs 2304 bytes",
    )
    assert report.first_problem[0] == "SizeMismatchError"  # what Template meets first


def test_one_sided_ids_said_once():
    # W-positional, one-sided: ids on the prefill only, no fallback.
    src = Layout.mla([1, 2, 3], [640] * 3, 64, layer_ids=[0, 1, 2])
    dst = Layout.mla([4, 5, 6], [640] * 3, 64)
    report = kvplan.compare(src, dst)
    assert len(report.unpaired) == 3 and len(report.reasons) == 1
    assert report.reasons[0].startswith("3 source entries cannot be paired: Layer metadata must "
                                        "be provided by both PD peers or neither")
    assert report.coverage[1] == "decode publishes no layer ids (3 page entries)"
    # The same pair with positional fallback (SGLang at PP 1) is fine.
    ok = kvplan.compare(src, dst, Pairing.by_layer_id(allow_positional_fallback=True))
    assert ok.compatible and ok.pairs == ((0, 0), (1, 1), (2, 2))


def test_positional_counts():
    # W-positional: pairs([], [], 3, 5) -> "got src=3 dst=5 entries";
    # with fallback (0,0),(1,1),(2,2).
    src = Layout.mla([1, 2, 3], [640] * 3, 64)
    dst = Layout.mla([4, 5, 6, 7, 8], [640] * 5, 64)
    bad = kvplan.compare(src, dst)
    assert not bad.compatible and "got src=3 dst=5 entries" in bad.reasons[0]
    good = kvplan.compare(src, dst, Pairing.by_layer_id(allow_positional_fallback=True))
    assert good.pairs == ((0, 0), (1, 1), (2, 2))
    assert ("entries pair by position: prefill entries 0–2 -> decode entries 0–2"
            in good.coverage)


def test_legacy_slicing_pairing_passes_through():
    # W-mla-pp-slice: legacy MLA, start 2: src [1,2] -> dst entries 2, 3.
    src = Layout.mla([1, 2], [640, 640], 64, pp_rank=1, pp_size=2)
    dst = Layout.mla([10, 11, 12, 13, 14], [640] * 5, 64)
    sliced = Pairing.by_layer_id(prefill_start_layer=2, legacy_kind="mla")
    report = kvplan.compare(src, dst, sliced)
    assert report.compatible and report.pairs == ((0, 2), (1, 3))
    with pytest.raises(KvPlanError):
        Pairing.by_layer_id(prefill_start_layer=2, legacy_kind="gqa")


# ------------------------------------------------------------------------ context warnings


def test_context_differences_are_warnings():
    src = hybrid(STAGE1, 1 << 32, pp_rank=1, pp_size=2, num_model_layers=61, page_size=16,
                 device="npu", tp_size=2)
    dst = hybrid(FULL60, 1 << 40, num_model_layers=60, page_size=32, device="cuda", tp_size=4,
                 pp_size=4)
    report = kvplan.compare(src, dst)
    assert report.compatible == (template_outcome(src, dst)[1] is None)
    text = "\n".join(report.warnings)
    assert "page sizes differ (prefill 16, decode 32 tokens per page, ratio 1:2)" in text
    assert "devices differ (prefill npu, decode cuda)" in text
    assert "TP sizes differ (prefill 2, decode 4)" in text and "MLA latent" in text
    assert "decode PP size 4 is neither 1 nor the prefill's 2" in text
    assert "model layer counts differ (prefill 61, decode 60)" in text


def test_tp_difference_on_kv_heads_names_head_slicing():
    src = Layout.mha([1], [2], [640], [640], 64, 64, layer_ids=[0], tp_size=2)
    dst = Layout.mha([3], [4], [640], [640], 64, 64, layer_ids=[0], tp_size=4)
    assert any("head-sliced" in w for w in kvplan.compare(src, dst).warnings)


def test_compare_and_token_plans_agree_on_which_tp_pairs_move_kv():
    """MLA latent, TP 2 -> 2, 1 -> 64 tokens per page: compare() said prefill rank 0 -> decode
    rank 1 "moves no KV" while its token plan moved every byte of the latent (the elected sender
    rank 1 moved them too)."""
    def mla(page_size, rank, base):
        item, cap = 1152 * page_size, 128 // page_size + 1
        return Layout.mla([base, base + (1 << 24)], [cap * item] * 2, item, [0, 1],
                          page_size=page_size, tp_rank=rank, tp_size=2, kv_heads=1,
                          head_dim=576, dtype_size=2)
    src_pages, dst_pages = np.arange(128), np.array([1, 0])
    for r_p in (0, 1):
        src, dst = mla(1, r_p, 1 << 32), mla(64, 1, 1 << 40)
        report = kvplan.compare(src, dst)
        silent = [w for w in report.warnings + report.blocks if "moves no KV" in w]
        plan = Template(src, dst).plan(src_pages, dst_pages)
        counted = [b for b in report.blocks if "blocks with pages consecutive" in b]
        if r_p == 0:
            assert silent and "prefill rank 1 is elected" in silent[0]
            assert plan.total_bytes == 0 and len(plan) == 0
            assert counted and ": 0 blocks with pages consecutive on both sides" in counted[0]
        else:
            assert not silent
            assert plan.total_bytes == 128 * 1152 * 2
            assert counted and ": 2 blocks with pages consecutive on both sides" in counted[0]


# ------------------------------------------------------------------------ report == Template


ROLES = ["kv", "k", "v", "mamba_conv"]


@st.composite
def layout_pairs(draw):
    n_src = draw(st.integers(0, 6))
    n_dst = draw(st.integers(0, 8))
    ids_on = draw(st.sampled_from(["both", "src", "dst", "none"]))
    src_ids = draw(st.lists(st.integers(0, 5), min_size=n_src, max_size=n_src))
    dst_ids = draw(st.lists(st.integers(0, 5), min_size=n_dst, max_size=n_dst))
    src_roles = draw(st.lists(st.sampled_from(ROLES[:3]), min_size=n_src, max_size=n_src))
    dst_roles = draw(st.lists(st.sampled_from(ROLES[:3]), min_size=n_dst, max_size=n_dst))
    src_items = draw(st.lists(st.sampled_from([8, 16]), min_size=n_src, max_size=n_src))
    dst_items = draw(st.lists(st.sampled_from([8, 16]), min_size=n_dst, max_size=n_dst))
    src = Layout(list(range(1, n_src + 1)), [160] * n_src, src_items,
                 src_ids if ids_on in ("both", "src") else None, src_roles)
    dst = Layout(list(range(100, 100 + n_dst)), [160] * n_dst, dst_items,
                 dst_ids if ids_on in ("both", "dst") else None, dst_roles)
    if draw(st.booleans()) and ids_on == "both":
        sid = draw(st.integers(0, 5))
        src = src.with_state("mamba_conv", [900], [16 * 4], draw(st.sampled_from([16, 32])), [sid])
        dst = dst.with_state("mamba_conv", [901, 902], [32 * 4] * 2, [16, 32], [sid, (sid + 1) % 6])
    fallback = draw(st.booleans())
    return src, dst, fallback


@settings(max_examples=400, deadline=None)
@given(layout_pairs())
def test_report_and_template_never_disagree(case):
    src, dst, fallback = case
    pairing = Pairing.by_layer_id(allow_positional_fallback=fallback)
    pairs, error = template_outcome(src, dst, pairing)
    report = kvplan.compare(src, dst, pairing)
    assert report.compatible == (error is None)
    assert report.first_problem == error
    assert len(report.entries) == src.n_entries  # one row per source entry
    if error is None:
        assert sorted(report.pairs) == sorted(pairs)
        assert report.reasons == ()
    else:
        assert report.reasons
        with pytest.raises(KvPlanError) as raised:
            report.raise_if_incompatible()
        assert (type(raised.value).__name__, str(raised.value)) == error
    str(report)  # always printable


# ------------------------------------------------------------------------ wording helpers


@pytest.mark.parametrize("ids,text", [
    ([], "none"),
    ([60], "60"),
    ([31, 32, 33], "31–33"),
    ([59, 63], "59, 63"),
    ([3, 7, 11, 15], "3–15 every 4th"),
    ([5, 1, 4, 6, 9, 4], "1, 4–6, 9"),
    ([2, 4, 6], "2–6 every 2nd"),
    (list(range(0, 60, 2)) + [61], "0, 2, 4, 6, 8, 10, 12, 14, 16, 18, … (21 more)"),
])
def test_format_ids(ids, text):
    assert format_ids(ids) == text


def test_equal_items_refused_for_their_page_sizes_are_said_in_the_refusals_words():
    # Same bytes per item, different page sizes: the refusal is about bytes per token, and
    # "differ in item size: 32768 vs 32768" would say nothing.
    src = Layout([1 << 20], [1 << 16], [32768], [0], ["kv"], page_size=16)
    dst = Layout([1 << 24], [1 << 16], [32768], [0], ["kv"], page_size=32)
    report = kvplan.compare(src, dst)
    assert not report.compatible
    assert len(report.reasons) == 1
    reason = report.reasons[0]
    assert "item size" not in reason
    assert "bytes per token" in reason and "page_size 16" in reason and "page_size 32" in reason
