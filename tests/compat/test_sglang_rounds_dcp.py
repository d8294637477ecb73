"""Staged transfers in rounds through kvplan's ``send_kvcache_dcp`` (prefill DCP 1 -> one
decode DCP rank, SGLang's token deal), over real Mooncake TCP loopback: SGLang 0.5.23's real
``MooncakeKVManager`` class (``install`` applied), ``rounds.attach`` on both peers, the side
channel a queue with a listener thread per peer (``support.sglang_rounds``).

The reference is SGLang's own ``send_kvcache_dcp`` (its ``build_dcp_token_transfer_plan``) run
on the same call through the same engine: the staged rounds must land in the decode's pools
exactly the bytes it lands, and leave every other byte as it was.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from kvplan.compat.sglang import rounds
from kvplan.compat.sglang.registry import MOONCAKE_MANAGER, sglang_method
from kvplan.presets import fragmented_pages
from kvplan.staging import DirectFallback, StagingAgreement
from support.sglang_models import load_loader
from support.sglang_rounds import (
    Engine,
    Net,
    Peer,
    attach_staging,
    register_decode,
    sglang_installed,  # noqa: F401 (the fixture sg)
)

TARGETS, ROW, PAGE, TOKENS, CAP = 3, 576, 4, 1000, 320  # FP8 latent rows, 4-token pages


class DcpPair:
    """A prefill at DCP 1 and decode DCP rank ``rank`` of ``size``, each with ``TARGETS``
    target entries and ``drafts`` draft entries (the decode's draft pages hold ``PAGE * size``
    rows: SGLang does not deal draft rows)."""

    def __init__(self, sg: Any, size: int, rank: int, drafts: int) -> None:
        loader = load_loader()
        self.size, self.rank, self.n = size, rank, TARGETS + drafts
        self.pre = Peer(self.n, CAP * PAGE * ROW, seed=5)
        self.dec = Peer(self.n, CAP * PAGE * size * ROW, seed=6)
        self.engine = Engine(self.pre.transport)
        pre_args = types.SimpleNamespace(
            kv_data_ptrs=self.pre.ptrs, kv_data_lens=self.pre.lens,
            kv_item_lens=[PAGE * ROW] * self.n, kv_layer_ids=list(range(self.n)),
            num_draft_entries=drafts, page_size=PAGE, prefill_start_layer=0, engine_rank=0,
            mla_compression_ratios=None)
        dec_args = types.SimpleNamespace(
            kv_data_ptrs=self.dec.ptrs, kv_data_lens=self.dec.lens,
            kv_item_lens=[PAGE * ROW] * TARGETS + [PAGE * size * ROW] * drafts,
            kv_layer_ids=list(range(self.n)), prefill_start_layer=0, engine_rank=rank,
            mla_compression_ratios=None, num_draft_entries=drafts)
        self.pmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=pre_args,
                                          engine=self.engine, is_mla_backend=True)
        self.dmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=dec_args,
                                          is_mla_backend=True)
        self.net = Net([self.pre, self.dec])
        self.opened = 0

    def attach(self, decode_agrees: bool) -> tuple[Any, Any]:
        p = attach_staging(self.pmgr, self.pre, self.net)
        d = attach_staging(self.dmgr, self.dec, self.net)
        deliver = d.deliver

        def counting(data: bytes) -> None:
            self.opened += bytes(data[:len(rounds.OPEN_MAGIC)]) == rounds.OPEN_MAGIC
            deliver(data)

        self.dec.listener.handler = counting
        register_decode(p, d if decode_agrees else None, self.dec.session, self.rank)
        return p, d

    def pages(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """The chunk's prefill pages (shuffled) and the decode rank's pages after its prefix,
        ``offset // size`` pages for the chunk's offset first, fully fragmented."""
        rng = np.random.default_rng(self.size)
        src = rng.permutation(CAP)[:-(-TOKENS // PAGE)].astype(np.int32)
        # the rank's rows, and the draft rows on virtual pages of PAGE * size rows
        n_dst = offset // self.size + -(-TOKENS // (PAGE * self.size)) + 1
        dst = fragmented_pages(n_dst, 1.0, seed=self.size, shuffle_runs=True,
                               capacity=CAP).astype(np.int32)
        return src, dst

    def send(self, method: Any, src: np.ndarray, dst: np.ndarray, offset: int) -> int:
        return int(method(
            self.pmgr, self.dec.session, src, self.dec.ptrs, dst,
            dcp_token_item_lens=[ROW] * self.n, dst_dcp_size=self.size, dst_dcp_rank=self.rank,
            src_page_offset=offset, decode_prefix_len=PAGE * self.size if offset else 0,
            num_kv_tokens=TOKENS, executor=None, dst_layer_ids=list(range(self.n))))

    def sglangs(self, src: np.ndarray, dst: np.ndarray, offset: int) -> tuple[np.ndarray, int]:
        """The decode's pools after SGLang's own method (restored after), and the blocks its
        engine was handed."""
        before, blocks = self.dec.memory.copy(), self.engine.blocks
        original = sglang_method(self.pmgr, "send_kvcache_dcp", MOONCAKE_MANAGER)
        assert self.send(original, src, dst, offset) == 0
        landed, sent = self.dec.memory.copy(), self.engine.blocks - blocks
        self.dec.memory[:] = before
        return landed, sent

    def close(self) -> None:
        self.pre.close()
        self.dec.close()


@pytest.mark.parametrize("size,rank,drafts,offset", [(2, 1, 0, 0), (4, 3, 1, 4)])
def test_dcp_chunk_lands_sglangs_bytes_in_rounds(sg: Any, size: int, rank: int, drafts: int,
                                                 offset: int) -> None:
    pair = DcpPair(sg, size, rank, drafts)
    try:
        p, d = pair.attach(decode_agrees=True)
        assert isinstance(p.peers[pair.dec.session], StagingAgreement)
        src, dst = pair.pages(offset)
        before = pair.dec.memory.copy()
        expected, sglang_blocks = pair.sglangs(src, dst, offset)
        assert not np.array_equal(expected, before)  # SGLang wrote the rank's rows
        pair.engine.blocks = 0
        assert pair.send(type(pair.pmgr).send_kvcache_dcp, src, dst, offset) == 0
        kind, report = p.last[pair.dec.session]
        assert kind == "staged" and report.rounds >= 2, (kind, report)
        assert pair.opened == 1
        np.testing.assert_array_equal(pair.dec.memory, expected)
        assert not d.receivers  # the decode stream ended loaded
        print(f"dcp {size}: sglang {sglang_blocks} blocks, staged {pair.engine.blocks} in "
              f"{report.rounds} rounds")
        assert pair.engine.blocks == report.network_blocks < sglang_blocks
    finally:
        pair.close()


def test_dcp_decode_without_agreement_keeps_the_direct_path(sg: Any) -> None:
    pair = DcpPair(sg, 2, 0, 0)
    try:
        p, d = pair.attach(decode_agrees=False)
        assert isinstance(p.peers[pair.dec.session], DirectFallback)
        src, dst = pair.pages(0)
        expected, _ = pair.sglangs(src, dst, 0)
        pair.engine.blocks = 0
        assert pair.send(type(pair.pmgr).send_kvcache_dcp, src, dst, 0) == 0
        assert pair.dec.session not in p.last and pair.opened == 0 and not d.receivers
        np.testing.assert_array_equal(pair.dec.memory, expected)
        assert pair.engine.blocks > 0  # the direct plan's blocks, written by the engine
    finally:
        pair.close()
