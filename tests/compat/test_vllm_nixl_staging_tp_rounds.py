"""How many rounds a staged read of ``KvplanNixlConnector`` between TP sizes takes: decode TP 1
reading prefill TP 2, each prefill rank's stream moving its heads' half of every decode block,
with heads whose half-blocks do not tile a round buffer (6 KV heads: 3 per prefill rank, 3 KiB
per half-block, 16 KiB round buffers). The rounds are the fewest the buffer allows, and the
decode's KV cache is byte for byte vLLM's own read of the same request (vLLM's descriptor lists
for the pair, real NIXL agents on loopback). The two prefill ranks' streams, each writer 0 on
the wire, land in their own senders' halves of the decode arena: both are granted at once. An
MLA read of the same TP sizes reads one prefill rank only, which then has the whole decode
arena: 32 KiB round buffers, not 16 KiB."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_nixl import (  # noqa: E402
    Geometry,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import DECODE_PAGES, TpPair, load_agents  # noqa: E402

from kvplan.compat.vllm import nixl_staging  # noqa: E402
from kvplan.compat.vllm.staging import STAGING_ATTR  # noqa: E402
from kvplan.staging import ReceiveStaged  # noqa: E402
from kvplan.staging.receiver import arena_claim, claims_overlap  # noqa: E402

#: 8 layers of 6 KV heads of 64 bytes: each prefill rank of two holds 3 heads, 3 KiB of every
#: 16-token decode block, so a 16 KiB round buffer holds 5 1/3 half-blocks.
SIXTHS = Geometry(heads=6, layers=8)
#: MLA, 8 layers of a 512-byte latent row: 8 KiB of every 16-token block per layer, 256 KiB for
#: the request's 4 decode blocks.
LATENT = Geometry(heads=1, mla=True, layers=8, head_bytes=512)
#: The read staging's round buffer: a 1 MiB arena in 32 buffers.
ROUND_BUFFER = 32 << 10


@pytest.mark.nixl
def test_a_tp_2_to_1_staged_read_takes_the_fewest_rounds_its_buffer_allows(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prefill rank's stream takes ``ceil(bytes / round buffer)`` rounds, every round but
    its last a full buffer (rounds cut only where half-blocks end would take 13 where 12
    suffice), and the two streams land vLLM's own bytes."""
    load_agents(connector, nixl, monkeypatch)
    pair = TpPair(connector, nixl, monkeypatch, prefill_tp=2, decode_tp=1, geometry=SIXTHS)
    try:
        assert [list(p.all_source_ranks) for p in pair.plans] == [[0, 1]]
        pair.read(0, vllm_only=True)
        assert pair.poll(0) == ({"req-d"}, set())
        want = pair.d_mem[0].copy()
        assert want.any()
        for r in (0, 1):  # vLLM's read notified each prefill rank once
            assert len(pair.notifications(r, 1)) == 1
        pair.d_mem[0][:] = 0
        handles = pair.read(0)
        assert len(handles) == 2
        assert all(isinstance(h, nixl_staging.StagedRead) for h in handles), handles
        assert pair.poll(0) == ({"req-d"}, set())
        assert bytes(pair.d_mem[0]) == bytes(want)
        for h in handles:
            rounds = h.rounds
            manifests = [r.manifest for r in rounds]
            assert sum(m.bytes for m in manifests) == rounds.bytes
            assert len(rounds) == math.ceil(rounds.bytes / rounds.buffer_bytes)
            assert all(m.bytes == rounds.buffer_bytes for m in manifests[:-1])
            # half-blocks of 3 KiB do not tile the buffer
            assert rounds.buffer_bytes % SIXTHS.block_bytes(2) != 0
        assert [len(h.rounds) for h in handles] == [12, 12]
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_tp_2_to_1_staged_reads_of_both_prefill_ranks_are_granted_at_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both prefill ranks' streams name writer 0, but their rounds land in the two senders'
    disjoint halves of the decode arena: the decode grants both as soon as both reads are
    posted, before either has a round scattered (no stream waits for the other's last
    round), and the two land vLLM's own bytes."""
    load_agents(connector, nixl, monkeypatch)
    pair = TpPair(connector, nixl, monkeypatch, prefill_tp=2, decode_tp=1)
    gate = threading.Event()
    on_message = ReceiveStaged.on_message

    def held(self: ReceiveStaged, data: Any) -> None:  # the decode handles no round yet
        gate.wait(30)
        on_message(self, data)

    try:
        pair.read(0, vllm_only=True)
        assert pair.poll(0) == ({"req-d"}, set())
        want = pair.d_mem[0].copy()
        assert want.any()
        for r in (0, 1):
            assert len(pair.notifications(r, 1)) == 1
        pair.d_mem[0][:] = 0
        monkeypatch.setattr(ReceiveStaged, "on_message", held)
        handles = pair.read(0)
        assert len(handles) == 2
        assert all(isinstance(h, nixl_staging.StagedRead) for h in handles), handles
        receivers = [h.receiver for h in handles]
        assert [r.writer for r in receivers] == [0, 0]
        assert [h.rounds.sender for h in handles] == [(0, 2), (1, 2)]
        claims = [arena_claim(h.rounds) for h in handles]
        assert all(claims) and not claims_overlap(*claims)
        shares = pair.decode[0].__dict__[STAGING_ATTR].shares
        assert [r.granted for r in receivers] == [True, True]
        assert shares.holders() == receivers and shares.queued() == []
        assert [r.scattered for r in receivers] == [0, 0]
        gate.set()
        assert pair.poll(0) == ({"req-d"}, set())
        assert bytes(pair.d_mem[0]) == bytes(want)
        assert all(r.loaded for r in receivers) and shares.holders() == []
    finally:
        gate.set()
        pair.close()


@pytest.mark.nixl
def test_an_mla_tp_2_to_1_staged_read_has_the_whole_decode_arena(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM reads an MLA decode's blocks from one prefill rank of two (the latent is whole on
    each): that rank is the decode rank's only sender, so its rounds use the arena's whole
    32 KiB round buffers: 8 rounds for the request's 256 KiB, where a share for each prefill
    rank (staging protocol 2, the other rank sending nothing) gave it 16 KiB and 16 rounds. The
    decode's KV cache is vLLM's own read's."""
    load_agents(connector, nixl, monkeypatch)
    pair = TpPair(connector, nixl, monkeypatch, prefill_tp=2, decode_tp=1, geometry=LATENT)
    try:
        assert [list(p.all_source_ranks) for p in pair.plans] == [[0]]
        pair.read(0, vllm_only=True)
        assert pair.poll(0) == ({"req-d"}, set())
        want = pair.d_mem[0].copy()
        assert want.any()
        pair.d_mem[0][:] = 0
        handles = pair.read(0)
        assert len(handles) == 1 and isinstance(handles[0], nixl_staging.StagedRead), handles
        assert pair.poll(0) == ({"req-d"}, set())
        assert bytes(pair.d_mem[0]) == bytes(want)
        rounds = handles[0].rounds
        assert rounds.bytes == len(DECODE_PAGES) * LATENT.regions * LATENT.block_bytes() == (
            256 << 10)
        assert rounds.sender == (0, 1)
        assert rounds.buffer_bytes == ROUND_BUFFER
        assert len(rounds) == 8
        assert all(r.manifest.bytes == ROUND_BUFFER for r in rounds)
    finally:
        pair.close()
