"""The round protocol in one process: ``send_staged`` on the prefill, ``ReceiveStaged`` on the
decode, messages through ``Router``s (synchronously, or through queues drained by listener
threads), the network through an in-process engine that copies the round's block at once.
Checked: the decode's bytes equal the direct plan's, flow control (round k is written into a
decode buffer only after round k - buffers was scattered out of it), and every failure failing
the request once, on both sides, with nothing loaded."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvplan import TransferError
from kvplan.exec.numpy import Memory, apply_plan
from kvplan.staging import (
    AckQueue,
    ArenaShares,
    ReceiveStaged,
    Router,
    StagingArena,
    StagingError,
    send_staged,
)
from kvplan.staging import wire
from support.staging_rounds import claiming, copier, mla_fragmented_case, rounds_for

ARENA = 64 << 10  # 32 KiB rounds: the 1.4 MB request takes 43 of them


class MemEngine:
    """Copies a round's network blocks when submitted (both arenas live here); ``fail_wait``
    makes the ``n``-th round's wait raise, ``check`` runs before each copy."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, *, fail_wait: int | None = None,
                 fail_submit: int | None = None,
                 check: Callable[[int], None] | None = None) -> None:
        self.src, self.dst = Memory.of(src), Memory.of(dst)
        self.fail_wait, self.fail_submit, self.check = fail_wait, fail_submit, check
        self.submitted = 0
        self.waited = 0

    def submit_round(self, plan: Any, peer: str) -> Any:
        k = self.submitted
        if k == self.fail_submit:
            raise TransferError(f"submit of round {k} refused")
        if self.check is not None:
            self.check(k)
        self.submitted += 1
        for s, d, n in zip(*(np.asarray(c).tolist() for c in
                             (plan.src_addrs, plan.dst_addrs, plan.lengths))):
            self.dst.at(d, n)[:] = self.src.at(s, n)
        engine = self

        class Handle:
            def wait(self) -> None:
                engine.waited += 1
                if k == engine.fail_wait:
                    raise TransferError(f"round {k}'s write failed (status -1)")

        return Handle()


class Setup:
    """The MLA fragmented request, both arenas, both routers, the decode's receiver."""

    def __init__(self, buffers: int = 2, *, decode_tokens: int | None = None) -> None:
        self.prefill, self.decode, self.template, self.src, self.dst = mla_fragmented_case()
        self.src_arena, self.dst_arena = StagingArena(ARENA, buffers), StagingArena(ARENA,
                                                                                    buffers)
        self.buffers = buffers
        self.rounds = rounds_for(self.template, self.src, self.dst, self.src_arena.region,
                                 self.dst_arena.region, buffers)
        self.decode_rounds = self.rounds if decode_tokens is None else rounds_for(
            self.template, self.src[:decode_tokens], self.dst[:decode_tokens],
            self.src_arena.region, self.dst_arena.region, buffers)
        self.prefill_router, self.decode_router = Router(), Router()
        self.loaded: list[ReceiveStaged] = []
        self.failures: list[StagingError] = []
        self.receiver = ReceiveStaged(
            "req-1", self.decode_rounds,
            copier([self.dst_arena.array], [self.decode.memory]),
            self.prefill_router.deliver, on_loaded=self.loaded.append,
            on_failed=self.failures.append, timeout_s=5.0)
        self.decode_router.open("req-1", 0, self.receiver.on_message)
        self.shares = ArenaShares()
        assert self.shares.admit(self.receiver)  # the grant waits in the prefill's router
        self.engine = MemEngine(self.src_arena.array, self.dst_arena.array)

    def direct(self) -> np.ndarray:
        want = Memory(self.decode.memory.copy(), int(self.decode.memory.ctypes.data))
        apply_plan(self.template.plan(self.src, self.dst), Memory.of(self.prefill.memory), want)
        return want.data

    def send(self, notify: Callable[[bytes], None] | None = None, **kw: Any) -> Any:
        return send_staged(self.rounds, kw.pop("engine", self.engine), "decode",
                           notify or self.decode_router.deliver, request="req-1",
                           acks=self.prefill_router,
                           gather=copier([self.prefill.memory], [self.src_arena.array]),
                           buffers=self.buffers, timeout_s=kw.pop("timeout_s", 5.0), **kw)


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_staged_rounds_land_the_direct_plans_bytes(buffers: int) -> None:
    s = Setup(buffers)
    want = s.direct()
    report = s.send()
    assert report.rounds == len(s.rounds) > 10
    assert report.bytes == int(s.template.plan(s.src, s.dst).lengths.sum())
    assert report.network_blocks == len(s.rounds)  # one block per round, 1,200 directly
    np.testing.assert_array_equal(s.decode.memory, want)
    assert s.loaded == [s.receiver] and s.failures == [] and s.receiver.loaded


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_flow_control_never_writes_a_buffer_the_decode_has_not_emptied(buffers: int) -> None:
    s = Setup(buffers)

    def check(k: int) -> None:
        # round k goes into decode buffer k % buffers: round k - buffers must be scattered
        assert s.receiver.scattered >= k - buffers + 1, (k, s.receiver.scattered)

    s.engine.check = check
    events: list[tuple[str, int]] = []
    s.send(events=events)
    at = {e: i for i, e in enumerate(events)}
    n = len(s.rounds)
    for k in range(n):
        assert at[("gather", k)] < at[("submit", k)] < at[("landed", k)] < at[("notify", k)]
        if k >= buffers:
            assert at[("ack", k - buffers)] < at[("submit", k)]
        if k + 1 < n and buffers == 1:
            # the single prefill buffer is gathered into only once the write read it
            assert at[("landed", k)] < at[("gather", k + 1)]
    assert events[-1] == ("ack", n - 1)
    assert s.engine.waited == s.engine.submitted == n


def test_listener_threads_and_queues_carry_the_messages() -> None:
    """The side channel as the engines have it: each side's listener thread takes messages
    off a queue and routes them; the bytes still equal the direct plan's."""
    s = Setup(2)
    want = s.direct()
    to_decode: queue.Queue[bytes | None] = queue.Queue()
    to_prefill: queue.Queue[bytes | None] = queue.Queue()
    s.receiver._ack = to_prefill.put  # the decode answers through its queue

    def listen(q: queue.Queue[bytes | None], router: Router) -> None:
        while (data := q.get()) is not None:
            router.deliver(data)

    threads = [threading.Thread(target=listen, args=(to_decode, s.decode_router)),
               threading.Thread(target=listen, args=(to_prefill, s.prefill_router))]
    for t in threads:
        t.start()
    try:
        s.send(notify=to_decode.put)
        s.receiver.wait(5.0)
    finally:
        to_decode.put(None)
        to_prefill.put(None)
        for t in threads:
            t.join()
    np.testing.assert_array_equal(s.decode.memory, want)
    assert s.receiver.loaded and len(s.loaded) == 1


def _assert_failed_once(s: Setup, exc: pytest.ExceptionInfo[StagingError], round_index: int,
                        prefill_reason: str, decode_reason: str,
                        scattered: int | None = None) -> None:
    assert exc.value.request == "req-1" and exc.value.round == round_index
    assert exc.value.reason == prefill_reason
    assert f"round {round_index}" in str(exc.value) and "req-1" in str(exc.value)
    assert len(s.failures) == 1 and s.failures[0].reason == decode_reason
    assert s.failures[0].round == round_index and s.failures[0].request == "req-1"
    assert s.loaded == [] and not s.receiver.loaded and s.receiver.failed
    assert s.receiver.scattered == (round_index if scattered is None else scattered)


def test_a_tampered_manifest_fails_the_request_once_on_both_sides() -> None:
    s = Setup(2)

    def notify(data: bytes) -> None:
        m = wire.decode(data)
        if m.kind == wire.ROUND and m.round == 3:
            payload = bytearray(m.payload)
            payload[-1] ^= 0xFF
            data = wire.encode(m.kind, m.request, writer=m.writer, round_index=m.round,
                               n_rounds=m.n_rounds, buffer=m.buffer, payload=bytes(payload))
        s.decode_router.deliver(data)

    with pytest.raises(StagingError) as exc:
        s.send(notify=notify)
    _assert_failed_once(s, exc, 3, "peer_failed", "manifest_mismatch")
    assert "manifest_mismatch" in exc.value.detail
    assert s.shares.holders() == []  # the prefill said it stopped: the share is free
    # a straggler after the failure changes nothing
    s.receiver.on_message(wire.encode(wire.ROUND, "req-1", round_index=4,
                                      n_rounds=len(s.rounds), buffer=0))
    assert len(s.failures) == 1


def test_a_decode_that_planned_another_request_refuses_round_0() -> None:
    s = Setup(2, decode_tokens=250)  # the decode planned fewer tokens than the prefill sends
    before = s.decode.memory.copy()
    with pytest.raises(StagingError) as exc:
        s.send()
    assert exc.value.reason == "peer_failed"
    assert len(s.failures) == 1 and s.failures[0].reason == "manifest_mismatch"
    assert s.receiver.scattered == 0 and not s.receiver.loaded
    np.testing.assert_array_equal(s.decode.memory, before)  # nothing scattered


@pytest.mark.parametrize("where", ["wait", "submit"])
def test_an_engine_failure_fails_the_request_once_with_nothing_in_flight(where: str) -> None:
    s = Setup(2)
    s.engine = MemEngine(s.src_arena.array, s.dst_arena.array,
                         **{f"fail_{where}": 2})  # type: ignore[arg-type]
    with pytest.raises(StagingError) as exc:
        s.send()
    _assert_failed_once(s, exc, 2, "engine_failed", "peer_failed")
    assert "TransferError" in exc.value.detail
    assert s.engine.waited == s.engine.submitted  # every submitted write was waited on


def test_a_failing_gather_fails_the_request_once() -> None:
    s = Setup(2)
    inner = copier([s.prefill.memory], [s.src_arena.array])
    calls = []

    def gather(plan: Any) -> None:
        calls.append(1)
        if len(calls) == 5:
            raise MemoryError("no memory for the copy")
        inner(plan)

    with pytest.raises(StagingError) as exc:
        send_staged(s.rounds, s.engine, "decode", s.decode_router.deliver, request="req-1",
                    acks=s.prefill_router, gather=gather, buffers=2, timeout_s=5.0)
    # round 3's write may have been in flight when round 4's gather failed: it ended first,
    # and the decode scattered what was announced before the failure message
    assert exc.value.reason == "gather_failed" and exc.value.round == 4
    assert len(s.failures) == 1 and s.failures[0].reason == "peer_failed"
    assert s.failures[0].round == 4 and not s.receiver.loaded
    assert s.receiver.scattered in (3, 4)
    assert s.engine.waited == s.engine.submitted == s.receiver.scattered


def test_a_decode_scatter_failure_fails_once_and_stops_the_prefill() -> None:
    s = Setup(2)
    inner = s.receiver._scatter
    count = []

    def scatter(plan: Any) -> None:
        count.append(1)
        if len(count) == 7:
            raise OSError("scatter target unmapped")
        inner(plan)

    s.receiver._scatter = scatter
    with pytest.raises(StagingError) as exc:
        s.send()
    _assert_failed_once(s, exc, 6, "peer_failed", "scatter_failed")
    assert "OSError" in exc.value.detail


def test_an_unreachable_decode_is_peer_gone() -> None:
    s = Setup(2)
    sent: list[bytes] = []

    def notify(data: bytes) -> None:
        if len(sent) == 2:
            raise ConnectionError("side channel closed")
        sent.append(data)
        s.decode_router.deliver(data)

    with pytest.raises(StagingError) as exc:
        s.send(notify=notify)
    assert exc.value.reason == "peer_gone" and exc.value.round == 2
    assert s.engine.waited == s.engine.submitted


def test_no_ack_times_out_on_the_prefill() -> None:
    s = Setup(2)
    with pytest.raises(StagingError) as exc:
        s.send(notify=lambda data: None, timeout_s=0.2)
    assert exc.value.reason == "timeout" and exc.value.round == 0
    assert s.engine.waited == s.engine.submitted == 2  # rounds 0 and 1 fit the two buffers


def test_a_silent_prefill_times_out_on_the_decode_once() -> None:
    s = Setup(2)
    now = [100.0]
    r = ReceiveStaged("req-2", s.rounds, lambda plan: None, lambda data: None,
                      timeout_s=10.0, clock=lambda: now[0], on_failed=s.failures.append)
    assert r.poll() == "receiving"
    now[0] += 10.5
    assert r.poll() == "failed" and r.poll() == "failed"
    assert len(s.failures) == 1 and s.failures[0].reason == "timeout"
    assert s.failures[0].round == 0
    with pytest.raises(StagingError):
        r.wait(0.1)


def test_out_of_order_and_foreign_messages_fail_the_stream() -> None:
    s = Setup(2)
    m = wire.encode(wire.ROUND, "req-1", round_index=1, n_rounds=len(s.rounds), buffer=1,
                    payload=s.rounds[1].manifest.to_bytes())
    s.receiver.on_message(m)
    assert s.failures[0].reason == "out_of_order" and "round 1 arrived" in str(s.failures[0])
    s2 = Setup(2)
    s2.receiver.on_message(b"garbage")
    assert s2.failures[0].reason == "bad_message"
    s3 = Setup(2)
    s3.receiver.on_message(wire.encode(wire.ROUND, "req-1", round_index=0,
                                       n_rounds=len(s3.rounds), buffer=1,
                                       payload=s3.rounds[0].manifest.to_bytes()))
    assert s3.failures[0].reason == "out_of_order" and "buffer 1" in str(s3.failures[0])


def test_cancel_fails_once_and_tells_the_prefill() -> None:
    s = Setup(2)
    told = AckQueue()
    s.receiver._ack = told.put
    s.receiver.cancel()
    s.receiver.cancel()
    assert len(s.failures) == 1 and s.failures[0].reason == "cancelled"
    m = wire.decode(told.get(1.0))
    assert m.kind == wire.FAIL and m.request == "req-1" and b"cancelled" in m.payload


def test_an_empty_request_is_loaded_at_once() -> None:
    r = ReceiveStaged("empty", [], lambda plan: None, lambda data: None)
    assert r.loaded
    r.wait(0.1)


def test_the_prefill_writes_nothing_before_the_grant() -> None:
    s = Setup(2)
    s.shares = ArenaShares()
    s.receiver = ReceiveStaged("req-9", s.rounds, lambda plan: None, s.prefill_router.deliver,
                               on_failed=s.failures.append)
    s.decode_router.open("req-9", 0, s.receiver.on_message)
    with pytest.raises(StagingError) as exc:
        send_staged(s.rounds, s.engine, "decode", s.decode_router.deliver, request="req-9",
                    acks=s.prefill_router, gather=lambda plan: None, timeout_s=0.2,
                    grant_timeout_s=0.2)
    assert exc.value.reason == "timeout" and "grant of its arena share" in str(exc.value)
    assert s.engine.submitted == 0
    # the decode was told, once
    assert [f.reason for f in s.failures] == ["peer_failed"]
    # a round before the grant is refused by the decode
    r = ReceiveStaged("req-10", s.rounds, lambda plan: None, lambda data: None,
                      on_failed=s.failures.append)
    r.on_message(wire.encode(wire.ROUND, "req-10", round_index=0, n_rounds=len(s.rounds),
                             buffer=0, payload=s.rounds[0].manifest.to_bytes()))
    assert s.failures[-1].reason == "out_of_order" and "before" in str(s.failures[-1])
    assert r.scattered == 0


def test_two_streams_of_one_share_take_turns() -> None:
    """Two prefill instances with the same writer index send to one decode arena share at
    once: the second is granted only when the first is loaded, and both land exactly."""
    a, b = Setup(2), Setup(2)
    b.dst_arena = a.dst_arena  # one decode arena, one share (writer 0)
    b.rounds = rounds_for(b.template, b.src, b.dst, b.src_arena.region, a.dst_arena.region, 2)
    b.engine = MemEngine(b.src_arena.array, a.dst_arena.array)
    shares = ArenaShares()
    decode_router = Router()
    decode_memory = [a.decode.memory, b.decode.memory]
    order: list[str] = []
    receivers = []
    for name, s, mem in (("a", a, decode_memory[0]), ("b", b, decode_memory[1])):
        r = ReceiveStaged(name, s.rounds, copier([a.dst_arena.array], [mem]),
                          s.prefill_router.deliver,
                          on_loaded=lambda r: order.append(f"{r.request} loaded"))
        decode_router.open(name, 0, r.on_message)
        receivers.append(r)
    assert shares.admit(receivers[0]) and not shares.admit(receivers[1])
    assert shares.holders() == [receivers[0]] and not receivers[1].granted
    wants = [a.direct(), b.direct()]
    errors: list[BaseException] = []

    def send(name: str, s: Setup) -> None:
        try:
            send_staged(s.rounds, s.engine, "decode", decode_router.deliver, request=name,
                        acks=s.prefill_router,
                        gather=copier([s.prefill.memory], [s.src_arena.array]), timeout_s=5.0)
            order.append(f"{name} sent")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=("b", b)),
               threading.Thread(target=send, args=("a", a))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert order.index("a loaded") < order.index("b loaded")
    assert b.engine.submitted == len(b.rounds) and shares.holders() == []
    np.testing.assert_array_equal(decode_memory[0], wants[0])
    np.testing.assert_array_equal(decode_memory[1], wants[1])


def test_the_router_keeps_early_messages_and_drops_late_ones() -> None:
    router = Router(max_early=3)
    got: list[bytes] = []
    early = [wire.encode(wire.ACK, "r", round_index=k) for k in range(2)]
    for m in early:
        assert not router.deliver(m)
    router.open("r", 0, got.append)
    assert got == early
    assert router.deliver(wire.encode(wire.ACK, "r", round_index=2)) and len(got) == 3
    router.close("r")
    assert not router.deliver(wire.encode(wire.ACK, "r", round_index=3))
    assert router.dropped == 1 and len(got) == 3
    for k in range(5):  # over the bound: the oldest streams' messages go first
        router.deliver(wire.encode(wire.ACK, f"x{k}", round_index=0))
    assert router.dropped == 3
    assert not router.deliver(b"not a staging message") and router.dropped == 4


def test_stream_names_a_message_cannot_carry_are_refused_before_anything_moves() -> None:
    s = Setup(2)
    with pytest.raises(wire.WireError, match="writer 70000"):
        s.send(writer=70000)
    with pytest.raises(wire.WireError, match="request id"):
        ReceiveStaged("x" * 70000, s.rounds, lambda plan: None, lambda data: None)
    assert s.engine.submitted == 0


def test_a_failed_stream_keeps_its_share_until_the_prefill_stopped() -> None:
    """The decode fails a stream on its own: a write of it may still be landing, so the
    share passes on only at the prefill's failure message (sent once its writes ended) or
    ``timeout_s`` after the failure."""
    now = [0.0]
    for ending in ("prefill says stopped", "timeout"):
        shares = ArenaShares()
        told: list[bytes] = []
        first, second = (ReceiveStaged(name, claiming(3, (0, 100)), lambda plan: None,
                                       told.append,
                                       timeout_s=10.0, clock=lambda: now[0])
                         for name in ("one", "two"))
        assert shares.admit(first) and not shares.admit(second)
        first.on_message(b"not a message")  # the decode fails the stream itself
        assert first.failed and wire.decode(told[-1]).kind == wire.FAIL
        assert shares.holders() == [first] and not second.granted
        if ending == "timeout":
            now[0] += 5.0
            first.poll()
            assert shares.holders() == [first]
            now[0] += 5.5
            first.poll()
        else:
            first.on_message(wire.encode(wire.FAIL, "one", round_index=0, n_rounds=3,
                                         payload=b"peer_failed: stopped"))
        assert shares.holders() == [second] and second.granted
        assert wire.decode(told[-1]).kind == wire.GRANT and wire.decode(told[-1]).request == "two"
        assert first.error is not None and first.error.reason == "bad_message"


def test_a_mismatch_names_the_manifest_fields_that_differ() -> None:
    from kvplan.staging.receiver import manifest_difference

    s = Setup(2)
    shorter = rounds_for(s.template, s.src[:250], s.dst[:250], s.src_arena.region,
                         s.dst_arena.region, 2)
    said = manifest_difference(shorter[0].manifest, s.rounds[0].manifest.to_bytes())
    assert "n_rounds" in said and f"{len(s.rounds)!r} from the prefill" in said
    assert "does not parse" in manifest_difference(s.rounds[0].manifest, b"\x00" * 7)


def test_round_engine_refuses_what_it_cannot_drive() -> None:
    from kvplan.staging import round_engine

    with pytest.raises(TypeError, match="object is not a kvplan transport"):
        round_engine(object())
    engine = MemEngine(np.zeros(8, np.uint8), np.zeros(8, np.uint8))
    assert round_engine(engine) is engine


def test_a_grant_that_cannot_be_sent_passes_the_share_on_at_once() -> None:
    shares = ArenaShares()
    told: list[bytes] = []

    def broken(data: bytes) -> None:
        raise ConnectionError("prefill gone")

    first = ReceiveStaged("one", claiming(1, (0, 100)), lambda plan: None, broken)
    second = ReceiveStaged("two", claiming(1, (0, 100)), lambda plan: None, told.append)
    assert shares.admit(second) and shares.holders() == [second]
    assert not shares.admit(first)
    # the holder's prefill stopped: the share goes to the queued stream, whose grant fails
    second.on_message(wire.encode(wire.FAIL, "two", round_index=0, n_rounds=1,
                                  payload=b"gather_failed: stopped"))
    assert first.failed and first.error is not None and first.error.reason == "peer_gone"
    assert not first.granted and shares.holders() == []


def test_local_copy_runs_a_core_round() -> None:
    from kvplan import TransferPlan
    from kvplan.staging import local_copy

    s = Setup(2)
    r = s.rounds[0]
    if not isinstance(r.gather, TransferPlan):
        pytest.skip("Template.plan_rounds is not in this build")
    copied = local_copy([s.prefill.memory], [s.src_arena.array])(r.gather)
    assert copied == r.manifest.bytes
    want = np.zeros(r.manifest.bytes, np.uint8)
    for src, dst, n in zip(*r.gather.as_lists()):
        off = src - s.prefill.memory.ctypes.data
        at = dst - s.src_arena.addr
        want[at:at + n] = s.prefill.memory[off:off + n]
    np.testing.assert_array_equal(s.src_arena.array[:r.manifest.bytes], want)
