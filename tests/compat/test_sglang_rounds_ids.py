"""Staged rounds of MHA head slices (``send_kvcache_slice``, prefill TP 2 into decode TP 1) with
published layer ids, through kvplan's SGLang Mooncake drop-in over real Mooncake TCP loopback:
SGLang 0.5.23's real ``MooncakeKVManager`` class (``install`` applied), at prefill PP 1 and at
PP 2. SGLang pairs such entries by layer id, so the open message carries the decode entry each
prefill entry fills (``kvplan.compat.sglang.stages.pp_stage``). What lands is compared byte for
byte with SGLang's own ``send_kvcache_slice`` (kvplan uninstalled) on the same requests.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from kvplan.compat.sglang import rounds
from kvplan.staging import StagingAgreement
from support.sglang_loader import InlineExecutor
from support.sglang_models import load_loader
from support.sglang_rounds import (
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

HEADS, TP_P, TP_D, PAGE, HEAD_BYTES, CAP, PAGES, LAYERS = 4, 2, 1, 4, 64, 96, 40, 4
SRC_ITEM, DST_ITEM = PAGE * (HEADS // TP_P) * HEAD_BYTES, PAGE * HEADS * HEAD_BYTES
#: SGLang's MHA entries: every K layer, then every V layer, each entry its layer's id
DECODE_IDS = [*range(LAYERS), *range(LAYERS)]


def _decode(sg: Any, dec: Peer, ids: list[int], entries: int = 2 * LAYERS) -> Any:
    kv = types.SimpleNamespace(kv_data_ptrs=dec.ptrs[:entries], kv_data_lens=dec.lens[:entries],
                               kv_item_lens=[DST_ITEM] * entries, kv_layer_ids=ids[:entries],
                               engine_rank=0)
    return load_loader().manager_object(sg, sg.MooncakeKVManager, kv_args=kv,
                                        attn_tp_size=TP_D)


def _prefill(sg: Any, pre: Peer, pp: int, stage: int, rank: int) -> Any:
    per_stage = LAYERS // pp
    layers = list(range(stage * per_stage, (stage + 1) * per_stage))
    kv = types.SimpleNamespace(
        kv_data_ptrs=pre.ptrs, kv_data_lens=pre.lens, kv_item_lens=[SRC_ITEM] * 2 * per_stage,
        kv_layer_ids=[*layers, *layers], page_size=PAGE, total_kv_head_num=HEADS,
        kv_head_num=HEADS // TP_P, engine_rank=rank, prefill_start_layer=layers[0],
        pp_rank=stage)
    return load_loader().manager_object(sg, sg.MooncakeKVManager, kv_args=kv,
                                        attn_tp_size=TP_P, pp_size=pp,
                                        engine=Engine(pre.transport))


def _sender(mgr: Any, dec: Peer, src: np.ndarray, dst: np.ndarray, ids: list[int]) -> Any:
    return lambda: mgr.send_kvcache_slice(dec.session, src, dec.ptrs, dst, 0, TP_D, DST_ITEM,
                                          InlineExecutor(), ids)


@pytest.mark.parametrize(("pp", "decode_ids"), [(1, DECODE_IDS), (1, []), (2, DECODE_IDS)],
                         ids=["pp1-both-publish", "pp1-prefill-publishes", "pp2-both-publish"])
def test_tp2_mha_slices_with_layer_ids_stage_as_sglangs_own_path(
        sg: Any, pp: int, decode_ids: list[int]) -> None:
    """Decode rank 0 of TP 1 (every head, every layer) filled by every (PP stage, TP rank) of
    the prefill at once, the prefill publishing layer ids, the decode too or (at PP 1, where
    SGLang then pairs by position) not."""
    per_stage = LAYERS // pp
    dec = Peer(2 * LAYERS, CAP * DST_ITEM, None)
    ranks = [(s, r) for s in range(pp) for r in range(TP_P)]
    pres = [Peer(2 * per_stage, CAP * SRC_ITEM, 70 + i) for i in range(len(ranks))]
    try:
        net = Net([dec, *pres])
        d = attach_staging(_decode(sg, dec, decode_ids), dec, net)
        opened = opened_streams(d)
        mgrs = [_prefill(sg, pre, pp, s, r) for (s, r), pre in zip(ranks, pres)]
        staging = [attach_staging(m, pre, net) for m, pre in zip(mgrs, pres)]
        for p in staging:
            assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
        src, dst = scattered_pages(5 + pp, CAP, PAGES)
        assert concurrently([_sender(m, dec, src, dst, decode_ids) for m in mgrs]) == [0] * len(mgrs)
        for p in staging:
            kind, report = p.last[dec.session]
            assert kind == "staged", (kind, report)
        assert len(opened) == len(ranks) and all(r.loaded for r in opened)
        assert_disjoint_shares(opened)
        staged = dec.memory.copy()
        want = head_sliced_stages_expected((2, LAYERS, CAP, PAGE, HEADS, HEAD_BYTES), ranks,
                                           pres, src, dst, per_stage)
        np.testing.assert_array_equal(staged.reshape(want.shape), want)
        for mgr in mgrs:
            rounds.detach(mgr)
        dec.memory[:] = 0
        assert sglangs_own(sg, [_sender(m, dec, src, dst, decode_ids) for m in mgrs]) == [0] * len(mgrs)
        np.testing.assert_array_equal(dec.memory, staged)
    finally:
        for p in (dec, *pres):
            p.close()


def test_a_decode_missing_a_layer_refuses_on_sglangs_failure_path(sg: Any) -> None:
    """The decode's pools end before the V entries of layers 2 and 3 that the open message
    names: the decode refuses (``PairingError``), the prefill's send returns -1 (SGLang's
    transfer worker fails the request) and nothing is written."""
    dec = Peer(2 * LAYERS, CAP * DST_ITEM, None)
    pre = Peer(2 * LAYERS, CAP * SRC_ITEM, 80)
    try:
        net = Net([dec, pre])
        d = attach_staging(_decode(sg, dec, DECODE_IDS, entries=2 * LAYERS - 2), dec, net)
        mgr = _prefill(sg, pre, 1, 0, 0)
        p = attach_staging(mgr, pre, net)
        register_decode(p, d, dec.session)
        src, dst = scattered_pages(9, CAP, PAGES)
        before = dec.memory.copy()
        assert _sender(mgr, dec, src, dst, DECODE_IDS)() == -1
        kind, err = p.last[dec.session]
        assert kind == "failed" and err.reason == "peer_failed", (kind, err)
        assert "PairingError" in err.detail, err.detail
        assert mgr.engine.blocks == 0  # nothing written
        np.testing.assert_array_equal(dec.memory, before)
        assert not d.receivers
    finally:
        pre.close()
        dec.close()
