"""A stream's patience starts at its grant. The decode queues a stream whose claim on its arena
overlaps one granted or queued before it (``ArenaShares``), and never times it out for waiting
its turn: after the grant it fails only after ``timeout_s`` without progress. The prefill's
wait for the grant matches: it has no timeout of its own and ends on the grant or on a failure
message (the decode's, or the one its channel puts in when the decode's channel closes).
Deterministic: the decode runs on a fake clock, the prefill's waits on an answer queue that
says at once whether a bounded wait would have run out."""

from __future__ import annotations

import queue
import threading
import types
from typing import Any

import numpy as np
import pytest

from kvplan.staging import AckQueue, ArenaShares, ReceiveStaged, StagingError, send_staged
from kvplan.staging import wire


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rounds(n: int, start: int, end: int) -> list[Any]:
    """``n`` stand-in rounds of two buffers, each landing in the decode arena's
    ``[start, end)``."""
    out = []
    for k in range(n):
        manifest = types.SimpleNamespace(dst_bytes_range=(start, end),
                                         to_bytes=lambda k=k: f"manifest-{k}".encode())
        out.append(types.SimpleNamespace(index=k, buffer=k % 2, manifest=manifest,
                                         scatter=None, gather=None,
                                         network=types.SimpleNamespace(
                                             lengths=np.zeros(0, np.int64))))
    return out


def stream(name: str, clock: Clock, told: list[bytes], *, timeout_s: float,
           n: int = 2) -> ReceiveStaged:
    return ReceiveStaged(name, rounds(n, 0, 100), lambda plan: None, told.append,
                         timeout_s=timeout_s, clock=clock)


def round_message(r: ReceiveStaged, k: int) -> bytes:
    return wire.encode(wire.ROUND, r.request, writer=r.writer, round_index=k,
                       n_rounds=r.n_rounds, buffer=k % 2,
                       payload=r.rounds[k].manifest.to_bytes())


def stopped(r: ReceiveStaged) -> None:
    """The prefill says it stopped (its failure message): the stream ends, its claim is free."""
    r.on_message(wire.encode(wire.FAIL, r.request, writer=r.writer, round_index=0,
                             n_rounds=r.n_rounds, payload=b"peer_failed: stopped"))


def kinds(told: list[bytes], request: str) -> list[str]:
    return [m.kind_name for m in map(wire.decode, told) if m.request == request]


def test_a_queued_stream_is_not_timed_out_for_waiting_its_turn() -> None:
    clock, told = Clock(), []
    shares = ArenaShares()
    first = stream("first", clock, told, timeout_s=1000.0)  # a long read, making progress
    second = stream("second", clock, told, timeout_s=5.0)  # the same bytes: queued behind it
    assert shares.admit(first) and not shares.admit(second)
    assert second.queued and not first.queued
    clock.now = 100.0  # far past the queued stream's timeout
    assert second.poll() == "receiving" and not second.granted
    assert kinds(told, "second") == []  # the prefill was told nothing
    first.on_message(round_message(first, 0))
    clock.now = 200.0
    assert second.poll() == "receiving"
    first.on_message(round_message(first, 1))  # the first is loaded: the second's turn
    assert first.loaded and second.granted and not second.queued
    assert kinds(told, "second") == ["grant"]
    # its patience counts from its grant (at 200): 5 s without progress, not its 200 s queued
    clock.now = 204.0
    assert second.poll() == "receiving"
    second.on_message(round_message(second, 0))  # progress at 204
    clock.now = 209.0
    assert second.poll() == "receiving"
    clock.now = 209.5
    assert second.poll() == "failed"
    assert second.error is not None and second.error.reason == "timeout"
    assert kinds(told, "second") == ["grant", "ack", "fail"]


def test_a_queued_stream_still_fails_when_cancelled_or_its_prefill_stops() -> None:
    clock, told = Clock(), []
    shares = ArenaShares()
    first = stream("first", clock, told, timeout_s=5.0)
    cancelled = stream("cancelled", clock, told, timeout_s=5.0)
    stopping = stream("stopping", clock, told, timeout_s=5.0)
    assert shares.admit(first)
    assert not shares.admit(cancelled) and not shares.admit(stopping)
    cancelled.cancel()
    assert cancelled.error is not None and cancelled.error.reason == "cancelled"
    assert kinds(told, "cancelled") == ["fail"]  # the prefill waiting for its grant is told
    stopped(stopping)
    assert stopping.error is not None and stopping.error.reason == "peer_failed"
    assert shares.queued() == [] and not cancelled.granted and not stopping.granted


def test_the_stream_ahead_is_bounded_by_its_own_timeout() -> None:
    """The queue drains: the granted stream that makes no progress times out, and once its
    prefill confirms it stopped the queued one is granted, its patience counting from then."""
    clock, told = Clock(), []
    shares = ArenaShares()
    first = stream("first", clock, told, timeout_s=5.0)
    second = stream("second", clock, told, timeout_s=5.0)
    assert shares.admit(first) and not shares.admit(second)
    clock.now = 6.0
    assert second.poll() == "receiving" and first.poll() == "failed"
    assert first.error is not None and first.error.reason == "timeout"
    stopped(first)  # the prefill's answer: no write of it is in flight
    assert second.granted
    clock.now = 11.0
    assert second.poll() == "receiving"
    clock.now = 11.5
    assert second.poll() == "failed"


def test_wait_on_a_queued_stream_waits_for_its_grant() -> None:
    """``wait`` on a stream queued longer than its timeout blocks until its turn (it was
    failed ``timeout`` at once), then counts its patience from the grant."""
    clock, told = Clock(), []
    shares = ArenaShares()
    first = stream("first", clock, told, timeout_s=1000.0)
    second = stream("second", clock, told, timeout_s=5.0)
    assert shares.admit(first) and not shares.admit(second)
    clock.now = 100.0
    outcome: list[BaseException | None] = []

    def waiter() -> None:
        try:
            second.wait()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    # until the waiter blocks in the stream's condition (or it ended)
    while second.state == "receiving" and not second._done._waiters:  # type: ignore[attr-defined]
        threading.Event().wait(0.001)
    first.on_message(round_message(first, 0))
    first.on_message(round_message(first, 1))
    assert second.granted or second.failed
    second.on_message(round_message(second, 0))
    second.on_message(round_message(second, 1))
    thread.join(timeout=30.0)
    assert not thread.is_alive()
    assert outcome == [None] and second.loaded


class AnswersLater(AckQueue):
    """The prefill's answer queue, deterministic: a bounded wait with no answer queued runs
    out at once (as if the decode kept the stream queued past it); an unbounded one makes the
    decode answer (``answer``) and then returns the first answer."""

    def __init__(self, answer: Any) -> None:
        super().__init__()
        self.answer = answer
        self.unbounded_waits = 0

    def get(self, timeout: float | None) -> bytes:
        try:
            return super().get(0.0)
        except queue.Empty:
            if timeout is not None:
                raise
        self.unbounded_waits += 1
        self.answer(self)
        return super().get(0.0)


def pulled(acks: AckQueue, sent: list[bytes], *, n: int = 2,
           grant_timeout_s: float | None = None) -> Any:
    return send_staged(rounds(n, 0, 100), None, "decode", sent.append, request="req",
                       acks=acks, gather=lambda plan: None, buffers=2, timeout_s=0.01,
                       pull=True, grant_timeout_s=grant_timeout_s)


def test_the_prefill_waits_for_the_grant_as_long_as_the_decode_queues_it() -> None:
    def grant_then_ack(q: AckQueue) -> None:
        q.put(wire.encode(wire.GRANT, "req", n_rounds=2))
        for k in range(2):
            q.put(wire.encode(wire.ACK, "req", round_index=k, n_rounds=2, buffer=k))

    acks, sent = AnswersLater(grant_then_ack), []
    report = pulled(acks, sent)
    assert report.rounds == 2 and acks.unbounded_waits == 1
    assert [m.kind_name for m in map(wire.decode, sent)] == ["round", "round"]


@pytest.mark.parametrize("payload", [b"cancelled: the engine aborted the request",
                                     b"peer_gone: the decode's staging channel closed"])
def test_the_prefills_grant_wait_ends_on_a_failure_message(payload: bytes) -> None:
    """The decode cancelling its queued stream, or the channel's end (the engine's channel
    puts a failure message in): the send fails ``peer_failed`` having written nothing."""
    def fail(q: AckQueue) -> None:
        q.put(wire.encode(wire.FAIL, "req", n_rounds=2, payload=payload))

    acks, sent = AnswersLater(fail), []
    with pytest.raises(StagingError) as exc:
        pulled(acks, sent)
    assert exc.value.reason == "peer_failed" and payload.decode() in exc.value.detail
    assert [m.kind_name for m in map(wire.decode, sent)] == ["fail"]  # the decode is told


def test_a_grant_timeout_bounds_the_prefills_wait_when_given() -> None:
    acks, sent = AnswersLater(lambda q: None), []
    with pytest.raises(StagingError) as exc:
        pulled(acks, sent, grant_timeout_s=3.0)
    assert exc.value.reason == "timeout" and "grant of its arena share" in exc.value.detail
    assert acks.unbounded_waits == 0
    assert [m.kind_name for m in map(wire.decode, sent)] == ["fail"]


def test_decode_and_prefill_agree_a_stream_queued_past_both_timeouts_is_read() -> None:
    """Both sides: the prefill's send of the queued stream waits through the decode's queue
    (longer than either side's timeout) and its rounds load once the decode grants it."""
    clock, to_prefill = Clock(), AnswersLater(lambda q: None)
    shares, told = ArenaShares(), []
    first = stream("first", clock, told, timeout_s=1000.0)
    second = ReceiveStaged("req", rounds(2, 0, 100), lambda plan: None, to_prefill.put,
                           timeout_s=5.0, clock=clock)
    assert shares.admit(first) and not shares.admit(second)

    def decode_turns(q: AckQueue) -> None:  # the prefill blocks: the queue ahead drains
        clock.now = 500.0
        assert second.poll() == "receiving"
        first.on_message(round_message(first, 0))
        first.on_message(round_message(first, 1))

    to_prefill.answer = decode_turns

    def to_decode(data: bytes) -> None:  # the decode acks each round as it lands
        second.on_message(data)

    report = send_staged(second.rounds, None, "decode", to_decode, request="req",
                         acks=to_prefill, gather=lambda plan: None, buffers=2, timeout_s=5.0,
                         pull=True)
    assert report.rounds == 2 and second.loaded


def test_the_prefills_grant_wait_asks_whether_the_decode_is_still_there() -> None:
    """An engine whose channel does not say when the decode's end closed gives ``peer_alive``:
    asked at each ``timeout_s`` of the wait without an answer, the wait goes on while the
    decode is there and fails ``peer_gone`` once it is not."""
    asked: list[bool] = []
    answers = iter([True, True, False])

    def alive() -> bool:
        asked.append(True)
        return next(answers)

    acks, sent = AnswersLater(lambda q: None), []
    with pytest.raises(StagingError) as exc:
        send_staged(rounds(2, 0, 100), None, "decode", sent.append, request="req", acks=acks,
                    gather=lambda plan: None, buffers=2, timeout_s=0.01, pull=True,
                    peer_alive=alive)
    assert exc.value.reason == "peer_gone" and len(asked) == 3
    assert acks.unbounded_waits == 0
    assert [m.kind_name for m in map(wire.decode, sent)] == ["fail"]


def test_sglangs_prefill_asks_whether_the_decodes_listener_is_there() -> None:
    """SGLang's channel does not see the decode go: its sends ask the decode's listener."""
    import socket

    from kvplan.compat.sglang.rounds import SglangStaging

    listener = socket.create_server(("127.0.0.1", 0))
    staging: Any = types.SimpleNamespace(
        endpoints={"decode": f"127.0.0.1:{listener.getsockname()[1]}"})
    assert SglangStaging.reachable(staging, "decode")
    listener.close()
    assert not SglangStaging.reachable(staging, "decode")
    assert SglangStaging.reachable(staging, "in-process")  # not an address: counts as there


def test_vllms_push_channel_ending_ends_the_prefills_open_sends() -> None:
    """vLLM's push-mode channel to a decode closing hands each send still open on it a
    failure message (it may be waiting for the grant), and nothing to one already closed."""
    from kvplan.compat.vllm.staging import WorkerStaging
    from kvplan.staging import Router

    router, waiting = Router(), AckQueue()
    router.open("r1@tp0", 0, waiting.put)
    router.open("r2@tp0", 0, lambda data: pytest.fail("a closed send was handed a message"))
    router.close("r2@tp0", 0)
    staging: Any = types.SimpleNamespace(open_stream=lambda name: None, router=router)
    channel: Any = types.SimpleNamespace(streams=["r2@tp0", "r1@tp0"], address="decode:1")
    WorkerStaging._channel_closed(staging, channel)
    m = wire.decode(waiting.get(0.0))
    assert m.kind == wire.FAIL and m.request == "r1@tp0" and m.payload.startswith(b"peer_gone")
    with pytest.raises(queue.Empty):
        waiting.get(0.0)
