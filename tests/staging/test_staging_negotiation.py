"""The handshake's staging message and ``negotiate``: the matrix of what two peers can say,
and the fallback said once per peer."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from kvplan import KvPlanError
from kvplan.staging import (
    PROTOCOL_VERSION,
    ArenaInfo,
    Capabilities,
    DirectFallback,
    FallbackLog,
    StagingAgreement,
    negotiate,
)

MiB = 1 << 20


def caps(*arenas: ArenaInfo, protocol: int = PROTOCOL_VERSION,
         version: str = "0.1.0") -> Capabilities:
    return Capabilities(version, protocol, tuple(arenas))


def arena(rank: int = 0, addr: int = 0x10000000, size: int = 64 * MiB, buffers: int = 2,
          registered: bool = True) -> ArenaInfo:
    return ArenaInfo(rank, addr, size, buffers, registered)


PREFILL = caps(arena(0, 0x1000000))
DECODE = caps(arena(0, 0x7000000), arena(1, 0x9000000, 32 * MiB))


def test_two_kvplan_peers_agree_alike_on_both_sides() -> None:
    on_prefill = negotiate(PREFILL, DECODE.to_bytes(), sending=True, remote_rank=1)
    on_decode = negotiate(DECODE, PREFILL.to_dict(), sending=False, local_rank=1)
    assert isinstance(on_prefill, StagingAgreement) and on_prefill == on_decode
    assert on_prefill.src_arena == (0x1000000, 64 * MiB)
    assert on_prefill.dst_arena == (0x9000000, 32 * MiB)
    assert on_prefill.buffers == 2 and on_prefill.round_bytes == 16 * MiB
    assert on_prefill.staged


@pytest.mark.parametrize("local, remote, kw, says", [
    (None, DECODE, {}, "staging is off on this peer"),
    (PREFILL, None, {}, "no kvplan staging capabilities"),
    (PREFILL, b"\xff not json", {}, "malformed"),
    (PREFILL, {"protocol": PROTOCOL_VERSION}, {}, "malformed"),
    (PREFILL, {"protocol": PROTOCOL_VERSION, "kvplan": "0.1.0", "arenas": [{"rank": -1}]}, {},
     "malformed"),
    (PREFILL, caps(arena(), protocol=PROTOCOL_VERSION + 1, version="9.0"), {},
     f"staging protocol {PROTOCOL_VERSION + 1} (kvplan 9.0) on the peer"),
    # a peer of protocol 2 shares the decode arena among every staging writer: it would cut
    # an elected MLA sender's rounds for half the arena
    (PREFILL, {"kvplan": "0.1.0", "protocol": 2, "arenas": [arena().to_dict()]}, {},
     "staging protocol 2 (kvplan 0.1.0) on the peer, 3 (kvplan"),
    (PREFILL, DECODE, {}, "the peer has no staging arena for its only arena (arenas of ranks "
     "[0, 1])"),
    (PREFILL, DECODE, {"remote_rank": 5}, "the peer has no staging arena for rank 5's arena"),
    (caps(), DECODE, {"remote_rank": 0}, "this peer has no staging arena"),
    (PREFILL, caps(arena(registered=False)), {}, "the peer's staging arena of rank 0 is not "
     "registered"),
    (caps(arena(registered=False)), caps(arena()), {}, "this peer's staging arena of rank 0 is "
     "not registered"),
    (PREFILL, caps(arena(addr=0)), {}, "is empty"),
    (PREFILL, caps(arena(buffers=3)), {}, "round buffers differ: 2 here, 3 on the peer"),
])
def test_the_direct_path_and_why(local: Any, remote: Any, kw: dict[str, Any],
                                 says: str) -> None:
    outcome = negotiate(local, remote, **kw)
    assert isinstance(outcome, DirectFallback) and not outcome.staged
    assert says in outcome.reason, outcome.reason


def test_another_kvplan_version_of_the_same_protocol_agrees() -> None:
    outcome = negotiate(PREFILL, caps(arena(), version="0.2.0"))
    assert isinstance(outcome, StagingAgreement) and outcome.peer_version == "0.2.0"


def test_the_message_round_trips_and_stays_small() -> None:
    local = Capabilities.local([arena(r, 0x1000 * (r + 1)) for r in range(8)])
    data = local.to_bytes()
    assert Capabilities.from_bytes(data) == local and len(data) < 1024
    assert json.loads(data)["protocol"] == PROTOCOL_VERSION
    with pytest.raises(KvPlanError, match="more than 4096"):
        Capabilities("0", 1, tuple(arena(r) for r in range(200))).to_bytes()
    with pytest.raises(KvPlanError) as exc:
        Capabilities.from_bytes(b"[1, 2]")
    assert exc.value.kind == "staging" and "an object is required" in str(exc.value)


def test_a_fallback_is_logged_once_per_peer(caplog: pytest.LogCaptureFixture) -> None:
    log = FallbackLog(logging.getLogger("kvplan.staging.test"))
    caplog.set_level(logging.INFO, "kvplan.staging.test")
    no = negotiate(PREFILL, None)
    assert isinstance(no, DirectFallback)
    assert log.note("decode:1", no) and not log.note("decode:1", no)
    assert not log.note("decode:1", negotiate(PREFILL, None))  # the next request, same reason
    assert log.note("decode:2", no)
    assert log.note("decode:1", negotiate(PREFILL, caps(arena())))  # staging now
    said = [r.getMessage() for r in caplog.records]
    assert said.count("kvplan: direct transfers with peer decode:1: " + no.reason) == 1
    assert len(said) == 3 and "staged transfers with peer decode:1" in said[2]
