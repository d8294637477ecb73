"""Staged rounds from a prefill PP 2 into a decode PP 1 through kvplan's SGLang Mooncake drop-in,
over real Mooncake TCP loopback: SGLang 0.5.23's real ``MooncakeKVManager`` class (built as the
other SGLang tests build it, ``install`` applied), each prefill stage its own manager holding
its own layers (SGLang's plain pools: no published layer ids, so SGLang slices the decode's
entries from ``prefill_start_layer``), every stage and TP writer sending into one decode arena
at once. What lands is compared byte for byte with SGLang's own direct path (its real
``send_kvcache`` / ``send_kvcache_slice`` with kvplan uninstalled) on the same requests.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import numpy as np

from kvplan.compat import sglang as compat
from kvplan.compat.sglang import rounds
from kvplan.presets import fragmented_pages
from kvplan.staging import StagingAgreement
from kvplan.staging.receiver import arena_claim, claims_overlap
from support.sglang_loader import InlineExecutor
from support.sglang_models import load_loader
from support.sglang_rounds import (
    CAP,
    ITEM,
    Engine,
    Net,
    Peer,
    attach_staging,
    register_decode,
    sglang_installed,  # noqa: F401 (the fixture sg)
)

PP, STAGE_LAYERS = 2, 2
LAYERS = PP * STAGE_LAYERS


def _pages(seed: int, cap: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(seed).permutation(cap)[:n].astype(np.int32)
    dst = fragmented_pages(n, 1.0, seed=seed, shuffle_runs=True, capacity=cap).astype(np.int32)
    return src, dst


def _opened(decode: Any) -> list[Any]:
    """Every decode stream the open messages start (a spy on the decode's ``_open``)."""
    opened: list[Any] = []
    real_open = decode._open

    def spy(body: bytes) -> None:
        known = set(decode.receivers)
        real_open(body)
        opened.extend(r for k, r in list(decode.receivers.items()) if k not in known)

    decode._open = spy
    return opened


def _concurrently(sends: list[Any]) -> list[int]:
    """Every send on its own thread, all started together (as SGLang's PP stages run)."""
    codes: list[int] = [-99] * len(sends)
    start = threading.Barrier(len(sends))

    def run(i: int) -> None:
        start.wait()
        codes[i] = int(sends[i]())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return codes


def _sglangs_own(sg: Any, sends: list[Any]) -> list[int]:
    """The sends through SGLang's own methods (kvplan uninstalled from the class), one by
    one; kvplan is installed again after."""
    compat.uninstall(sg.MooncakeKVManager)
    try:
        return [int(send()) for send in sends]
    finally:
        compat.install(sg.MooncakeKVManager)


def _assert_disjoint_shares(streams: list[Any]) -> None:
    claims = [arena_claim(r.rounds) for r in streams]
    for a in range(len(claims)):
        for b in range(a + 1, len(claims)):
            assert not claims_overlap(claims[a], claims[b]), (a, b, claims[a], claims[b])


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
        opened = _opened(d)
        staging = [attach_staging(mgr, pre, net) for pre, mgr, _ in stages]
        for p in staging:
            assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
        src, dst = _pages(11, CAP, 300)

        def sender(mgr: Any) -> Any:
            return lambda: mgr.send_kvcache(dec.session, src, dec.ptrs, dst, InlineExecutor(),
                                            dst_layer_ids=[])

        assert _concurrently([sender(mgr) for _, mgr, _ in stages]) == [0] * PP
        for p in staging:
            kind, report = p.last[dec.session]
            assert kind == "staged" and report.rounds >= 2, (kind, report)
        assert len(opened) == PP and all(r.loaded for r in opened)
        assert sorted(r.writer for r in opened) == list(range(PP))  # one share per stage
        _assert_disjoint_shares(opened)
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
        assert _sglangs_own(sg, [sender(mgr) for _, mgr, _ in stages]) == [0] * PP
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
        src, dst = _pages(12, CAP, 300)
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
        opened = _opened(d)
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
        src, dst = _pages(3, MHA_CAP, PAGES)

        def sender(mgr: Any) -> Any:
            return lambda: mgr.send_kvcache_slice(dec.session, src, dec.ptrs, dst, 0, TP_D, di,
                                                  InlineExecutor(), [])

        assert _concurrently([sender(m) for m in mgrs]) == [0] * len(mgrs)
        assert all(p.last[dec.session][0] == "staged" for p in staging)
        assert len(opened) == len(ranks) and all(r.loaded for r in opened)
        _assert_disjoint_shares(opened)
        staged = dec.memory.copy()
        # oracle: decode K slot l (V slot LAYERS + l), heads of rank r, from stage l // 2's
        # K (V) slot l % 2 of TP rank r, NHD items
        got = staged.reshape(2, LAYERS, MHA_CAP, PAGE, HEADS, HEAD_BYTES)
        want = np.zeros_like(got)
        per = HEADS // TP_P
        for (s, r), pre in zip(ranks, pres):
            have = pre.memory.reshape(2, STAGE_LAYERS, MHA_CAP, PAGE, per, HEAD_BYTES)
            layers = slice(s * STAGE_LAYERS, (s + 1) * STAGE_LAYERS)
            want[:, layers, dst.astype(np.int64), :, r * per:(r + 1) * per] = \
                have[:, :, src.astype(np.int64)]
        np.testing.assert_array_equal(got, want)
        for mgr in mgrs:
            rounds.detach(mgr)
        dec.memory[:] = 0
        assert _sglangs_own(sg, [sender(m) for m in mgrs]) == [0] * len(mgrs)
        np.testing.assert_array_equal(dec.memory, staged)
    finally:
        for p in (dec, *pres):
            p.close()
