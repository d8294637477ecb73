"""Staged rounds from a prefill PP 2 into a decode PP 1 through kvplan's SGLang Mooncake drop-in,
over real Mooncake TCP loopback: SGLang 0.5.23's real ``MooncakeKVManager`` class (built as the
other SGLang tests build it, ``install`` applied), each prefill stage its own manager holding
its own layers (SGLang's plain pools: no published layer ids, so SGLang slices the decode's
entries from ``prefill_start_layer``), every stage and TP writer sending into one decode arena
at once. What lands is compared byte for byte with SGLang's own direct path (its real
``send_kvcache`` / ``send_kvcache_slice`` with kvplan uninstalled) on the same requests.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from kvplan.compat.sglang import rounds
from kvplan.staging import StagingAgreement
from support.sglang_loader import InlineExecutor
from support.sglang_models import load_loader
from support.sglang_rounds import (
    CAP,
    ITEM,
    Engine,
    Net,
    Peer,
    assert_disjoint_shares,
    attach_staging,
    concurrently,
    head_sliced_stages_expected,
    opened_streams,
    register_decode,
    scattered_pages,
    sglang_installed,  # noqa: F401 (the fixture sg)
    sglangs_own,
)

PP, STAGE_LAYERS = 2, 2
LAYERS = PP * STAGE_LAYERS


# ------------------------------------------------------------------------------- MLA
def _mla_stage(sg: Any, stage: int, dec: Peer, seed: int) -> tuple[Peer, Any, Engine]:
    pre = Peer(STAGE_LAYERS, CAP * ITEM, seed)
    engine = Engine(pre.transport)
    kv = types.SimpleNamespace(
        kv_data_ptrs=pre.ptrs, kv_data_lens=pre.lens, kv_item_lens=[ITEM] * STAGE_LAYERS,
        kv_layer_ids=[], prefill_start_layer=stage * STAGE_LAYERS,
        prefill_end_layer=(stage + 1) * STAGE_LAYERS, pp_rank=stage, engine_rank=0,
        mla_compression_ratios=None, num_draft_entries=0)
    info = types.SimpleNamespace(dst_kv_ptrs=dec.ptrs, dst_kv_item_lens=[ITEM] * LAYERS,
                                 dst_kv_layer_ids=[])
    mgr = load_loader().manager_object(sg, sg.MooncakeKVManager, kv_args=kv, engine=engine,
                                       is_mla_backend=True, pp_size=PP,
                                       decode_kv_args_table={dec.session: info})
    return pre, mgr, engine


def _mla_decode(sg: Any, dec: Peer, entries: int = LAYERS) -> Any:
    kv = types.SimpleNamespace(
        kv_data_ptrs=dec.ptrs[:entries], kv_data_lens=dec.lens[:entries],
        kv_item_lens=[ITEM] * entries, kv_layer_ids=[], prefill_start_layer=0, engine_rank=0,
        mla_compression_ratios=None, num_draft_entries=0)
    return load_loader().manager_object(sg, sg.MooncakeKVManager, kv_args=kv,
                                        is_mla_backend=True)


def test_pp2_mla_stages_land_as_sglangs_own_path_each_in_its_own_share(sg: Any) -> None:
    dec = Peer(LAYERS, CAP * ITEM, None)
    stages = [_mla_stage(sg, s, dec, 40 + s) for s in range(PP)]
    try:
        net = Net([dec, *(pre for pre, _, _ in stages)])
        d = attach_staging(_mla_decode(sg, dec), dec, net)
        opened = opened_streams(d)
        staging = [attach_staging(mgr, pre, net) for pre, mgr, _ in stages]
        for p in staging:
            assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
        src, dst = scattered_pages(11, CAP, 300)

        def sender(mgr: Any) -> Any:
            return lambda: mgr.send_kvcache(dec.session, src, dec.ptrs, dst, InlineExecutor(),
                                            dst_layer_ids=[])

        assert concurrently([sender(mgr) for _, mgr, _ in stages]) == [0] * PP
        for p in staging:
            kind, report = p.last[dec.session]
            assert kind == "staged" and report.rounds >= 2, (kind, report)
        assert len(opened) == PP and all(r.loaded for r in opened)
        assert sorted(r.writer for r in opened) == list(range(PP))  # one share per stage
        assert_disjoint_shares(opened)
        staged = dec.memory.copy()
        # oracle: decode entry stage * STAGE_LAYERS + k holds the stage's entry k
        want = np.zeros_like(staged).reshape(LAYERS, CAP, ITEM)
        for s, (pre, _, _) in enumerate(stages):
            have = pre.memory.reshape(STAGE_LAYERS, CAP, ITEM)
            want[s * STAGE_LAYERS:(s + 1) * STAGE_LAYERS, dst.astype(np.int64)] = \
                have[:, src.astype(np.int64)]
        np.testing.assert_array_equal(staged, want.reshape(-1))
        # SGLang's own direct path of the same requests, into a cleared pool
        for _, mgr, _ in stages:
            rounds.detach(mgr)
        dec.memory[:] = 0
        assert sglangs_own(sg, [sender(mgr) for _, mgr, _ in stages]) == [0] * PP
        np.testing.assert_array_equal(dec.memory, staged)
    finally:
        for p in (dec, *(pre for pre, _, _ in stages)):
            p.close()


def test_stage_layers_the_decode_does_not_hold_are_refused_on_sglangs_failure_path(
        sg: Any) -> None:
    """The decode holds only the first stage's layers (its pools end there): stage 1's open
    message names decode entries 2 and 3, which the decode refuses; the prefill's send returns
    -1 (SGLang's transfer worker fails the request) and nothing is written."""
    dec = Peer(LAYERS, CAP * ITEM, None)
    pre, mgr, engine = _mla_stage(sg, 1, dec, 41)
    try:
        net = Net([dec, pre])
        d = attach_staging(_mla_decode(sg, dec, entries=STAGE_LAYERS), dec, net)
        p = attach_staging(mgr, pre, net)
        register_decode(p, d, dec.session)
        src, dst = scattered_pages(12, CAP, 300)
        before = dec.memory.copy()
        assert mgr.send_kvcache(dec.session, src, dec.ptrs, dst, InlineExecutor(),
                                dst_layer_ids=[]) == -1
        kind, err = p.last[dec.session]
        assert kind == "failed" and err.reason == "peer_failed", (kind, err)
        assert "PairingError" in err.detail, err.detail
        assert engine.blocks == 0  # nothing written
        np.testing.assert_array_equal(dec.memory, before)
        assert not d.receivers
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------------------- MHA slices
HEADS, TP_P, TP_D, PAGE, HEAD_BYTES, MHA_CAP, PAGES = 4, 2, 1, 4, 64, 96, 40


def _item(tp: int) -> int:
    return PAGE * (HEADS // tp) * HEAD_BYTES


def test_pp2_tp2_mha_slices_land_as_sglangs_own_path_each_writer_its_own_share(
        sg: Any) -> None:
    """Decode rank 0 of TP 1 (every head, every layer) filled by four prefill ranks at once:
    PP stages 0 and 1 (layers 0-1, 2-3) of TP ranks 0 and 1 (heads 0-1, 2-3). kvplan's direct
    path needs the decode's layer count to slice SGLang's MHA pools by stage (an uneven split
    and draft entries look alike): ``kvplan_decode_kv_layers``."""
    loader = load_loader()
    si, di = _item(TP_P), _item(TP_D)
    dec = Peer(2 * LAYERS, MHA_CAP * di, None)
    dkv = types.SimpleNamespace(kv_data_ptrs=dec.ptrs, kv_data_lens=dec.lens,
                                kv_item_lens=[di] * 2 * LAYERS, kv_layer_ids=[],
                                engine_rank=0)
    ranks = [(s, r) for s in range(PP) for r in range(TP_P)]
    pres = [Peer(2 * STAGE_LAYERS, MHA_CAP * si, 60 + i) for i in range(len(ranks))]
    try:
        net = Net([dec, *pres])
        d = attach_staging(loader.manager_object(sg, sg.MooncakeKVManager, kv_args=dkv,
                                                 attn_tp_size=TP_D), dec, net)
        opened = opened_streams(d)
        mgrs, staging = [], []
        for (s, r), pre in zip(ranks, pres):
            kv = types.SimpleNamespace(
                kv_data_ptrs=pre.ptrs, kv_data_lens=pre.lens,
                kv_item_lens=[si] * 2 * STAGE_LAYERS, kv_layer_ids=[], page_size=PAGE,
                total_kv_head_num=HEADS, kv_head_num=HEADS // TP_P, engine_rank=r,
                prefill_start_layer=s * STAGE_LAYERS, pp_rank=s)
            mgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv,
                                        attn_tp_size=TP_P, pp_size=PP,
                                        engine=Engine(pre.transport),
                                        kvplan_decode_kv_layers=LAYERS)
            p = attach_staging(mgr, pre, net)
            assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
            mgrs.append(mgr)
            staging.append(p)
        src, dst = scattered_pages(3, MHA_CAP, PAGES)

        def sender(mgr: Any) -> Any:
            return lambda: mgr.send_kvcache_slice(dec.session, src, dec.ptrs, dst, 0, TP_D, di,
                                                  InlineExecutor(), [])

        assert concurrently([sender(m) for m in mgrs]) == [0] * len(mgrs)
        assert all(p.last[dec.session][0] == "staged" for p in staging)
        assert len(opened) == len(ranks) and all(r.loaded for r in opened)
        assert_disjoint_shares(opened)
        staged = dec.memory.copy()
        want = head_sliced_stages_expected((2, LAYERS, MHA_CAP, PAGE, HEADS, HEAD_BYTES), ranks,
                                           pres, src, dst, STAGE_LAYERS)
        np.testing.assert_array_equal(staged.reshape(want.shape), want)
        for mgr in mgrs:
            rounds.detach(mgr)
        dec.memory[:] = 0
        assert sglangs_own(sg, [sender(m) for m in mgrs]) == [0] * len(mgrs)
        np.testing.assert_array_equal(dec.memory, staged)
    finally:
        for p in (dec, *pres):
            p.close()
