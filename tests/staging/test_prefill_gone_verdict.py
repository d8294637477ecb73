"""A prefill that went away without closing its staging (its process ended, a test tore it
down): its connection to the decode's listener closes mid-stream. The decode's stream fails
``peer_gone``, saying the prefill went away (where it was, how far the stream got), and its
failure verdict names the decode pages of the rounds not scattered for vLLM's failed-load
path; it is not taken for the decode's own abort (``cancelled``, which reports no blocks)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvplan.compat.vllm import staging as vstaging
from kvplan.compat.vllm.staging import ChannelServer, WorkerStaging
from kvplan.failures import FailureVerdict
from kvplan.staging import StagingArena
from support.staging_rounds import mla_fragmented_case, rounds_for

NAME = "req-g@tp0"
PREFILL_AT = "10.1.2.3:45678"


class PrefillConnection:
    """The decode listener's connection from the prefill: what it sends back is kept."""

    peer = PREFILL_AT

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes, tag: bytes = b"") -> None:
        self.sent.append(data)


def test_a_prefill_gone_mid_stream_fails_it_peer_gone_with_the_unscattered_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, template, src, dst = mla_fragmented_case()
    src_arena, dst_arena = StagingArena(64 << 10, 2), StagingArena(64 << 10, 2)
    rounds = rounds_for(template, src, dst, src_arena.region, dst_arena.region, 2)
    # the plan of the decode's rounds stood in for (what is tested is the failure's path)
    monkeypatch.setattr(vstaging, "_decode_rounds", lambda staging, opening, worker: (
        template, rounds))
    monkeypatch.setattr(vstaging, "local_copy", lambda sources, targets: None)
    monkeypatch.setattr(vstaging, "kv_buffers", lambda worker: [])
    verdicts: list[FailureVerdict] = []
    monkeypatch.setattr(vstaging, "report_unwritten",
                        lambda worker, verdict: verdicts.append(verdict) or "blocks")
    state = WorkerStaging(config=SimpleNamespace(timeout_s=30.0),  # type: ignore[arg-type]
                          arena=dst_arena, rank=0)
    server = ChannelServer(state, None)
    try:
        conn = PrefillConnection()
        server._on_frame(conn, b"O", json.dumps(  # type: ignore[arg-type]
            {"stream": NAME, "writer": 0}).encode())
        receiver = state.stream(NAME)
        assert receiver is not None and receiver.granted and conn.sent  # the grant went out
        server._on_close(conn, None)  # type: ignore[arg-type]
    finally:
        server.close(join_s=5.0)
    assert receiver.failed and receiver.error is not None
    assert receiver.error.reason == "peer_gone" and receiver.error.round == 0
    said = (f"the prefill at {PREFILL_AT} went away (its staging channel closed) after 0 of "
            f"{len(rounds)} rounds")
    assert receiver.error.detail == said
    (verdict,) = verdicts
    assert verdict.request_id == NAME and verdict.reason == f"peer_gone: {said}"
    assert verdict.blocks == {0: tuple(sorted({int(p) for p in np.asarray(dst)}))}


def test_the_decode_s_own_abort_still_reports_no_blocks(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """vLLM's abort of the request on the decode (``cancelled``): its blocks may already be
    another request's, so no verdict is reported; only the prefill's going reports one."""
    _, _, template, src, dst = mla_fragmented_case()
    src_arena, dst_arena = StagingArena(64 << 10, 2), StagingArena(64 << 10, 2)
    rounds = rounds_for(template, src, dst, src_arena.region, dst_arena.region, 2)
    monkeypatch.setattr(vstaging, "_decode_rounds", lambda staging, opening, worker: (
        template, rounds))
    monkeypatch.setattr(vstaging, "local_copy", lambda sources, targets: None)
    monkeypatch.setattr(vstaging, "kv_buffers", lambda worker: [])
    verdicts: list[Any] = []
    monkeypatch.setattr(vstaging, "report_unwritten",
                        lambda worker, verdict: verdicts.append(verdict) or "blocks")
    state = WorkerStaging(config=SimpleNamespace(timeout_s=30.0),  # type: ignore[arg-type]
                          arena=dst_arena, rank=0)
    state.on_open(None, json.dumps({"stream": NAME, "writer": 0}).encode(), lambda data: None)
    receiver = state.stream(NAME)
    assert receiver is not None
    receiver.cancel("vLLM aborted the request")
    assert receiver.error is not None and receiver.error.reason == "cancelled"
    assert verdicts == []
