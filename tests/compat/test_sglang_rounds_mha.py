"""Staged rounds for MHA pools at equal attention TP through ``send_kvcache`` (what SGLang
calls for a Llama-like model whose prefill and decode have the same TP): the same generic
entry list as MLA (K entries then V entries, one item per page, no published layer ids), so
the drop-in stages it, and the prefill logs each staged request's rounds and network blocks
beside its direct plan's blocks. Real Mooncake TCP loopback, as ``test_sglang_rounds``."""

from __future__ import annotations

import logging
import types
from typing import Any

import numpy as np
import pytest

from kvplan.presets import fragmented_pages
from kvplan.staging import StagingAgreement
from support.sglang_loader import InlineExecutor
from support.sglang_models import load_loader
from support.sglang_rounds import Engine, Net, Peer, attach_staging, register_decode
from support.sglang_rounds import sglang_installed  # noqa: F401 (the fixture sg)

LAYERS, ITEM, CAP, TOKENS = 4, 512, 640, 300
ENTRIES = 2 * LAYERS  # K of every layer, then V of every layer


def _mha_pair(sg: Any) -> tuple[Peer, Peer, Any, Any, Engine]:
    loader = load_loader()
    pre, dec = Peer(ENTRIES, CAP * ITEM, 5), Peer(ENTRIES, CAP * ITEM, None)
    engine = Engine(pre.transport)

    def kv_args(p: Peer) -> Any:
        # a plain MHA pool publishes no layer ids (SGLang's build_kv_layer_ids returns [])
        return types.SimpleNamespace(
            kv_data_ptrs=p.ptrs, kv_data_lens=p.lens, kv_item_lens=[ITEM] * ENTRIES,
            kv_layer_ids=[], prefill_start_layer=0, engine_rank=0,
            mla_compression_ratios=None, num_draft_entries=0)

    info = types.SimpleNamespace(dst_kv_ptrs=dec.ptrs, dst_kv_item_lens=[ITEM] * ENTRIES,
                                 dst_kv_layer_ids=[])
    pmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv_args(pre), engine=engine,
                                 is_mla_backend=False, decode_kv_args_table={dec.session: info})
    dmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv_args(dec),
                                 is_mla_backend=False)
    return pre, dec, pmgr, dmgr, engine


def test_equal_tp_mha_request_goes_staged_byte_exact_and_is_logged(
        sg: Any, caplog: pytest.LogCaptureFixture) -> None:
    pre, dec, pmgr, dmgr, engine = _mha_pair(sg)
    try:
        net = Net([pre, dec])
        p, d = attach_staging(pmgr, pre, net), attach_staging(dmgr, dec, net)
        assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
        src = np.arange(TOKENS, dtype=np.int32)
        dst = fragmented_pages(TOKENS, 1.0, seed=3, shuffle_runs=True,
                               capacity=CAP).astype(np.int32)
        before = dec.memory.copy()
        with caplog.at_level(logging.INFO, logger="kvplan.compat.sglang"):
            assert int(pmgr.send_kvcache(dec.session, src, dec.ptrs, dst, InlineExecutor())) == 0
        kind, report = p.last[dec.session]
        assert kind == "staged" and report.rounds >= 2  # 1.2 MB through 512 KiB buffers
        want = before.reshape(ENTRIES, CAP, ITEM).copy()
        want[:, dst.astype(np.int64)] = pre.memory.reshape(ENTRIES, CAP, ITEM)[:, src]
        np.testing.assert_array_equal(dec.memory, want.reshape(-1))
        lines = [r.getMessage() for r in caplog.records if "staged request" in r.getMessage()]
        assert len(lines) == 1, lines
        direct = ENTRIES * TOKENS  # every page its own run on the decode
        assert (f"{TOKENS} pages in {report.rounds} rounds, {report.network_blocks} network "
                f"blocks (direct plan: {direct} blocks)") in lines[0]
        assert engine.blocks == report.network_blocks and direct >= 10 * engine.blocks
        assert not d.receivers
    finally:
        pre.close()
        dec.close()
