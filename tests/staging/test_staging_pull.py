"""The round protocol in pull mode (the decode reads each round out of the prefill arena, as
vLLM's NIXL connector reads): ``send_staged(..., pull=True)`` on the prefill gathers and says
each round is ready; ``ReceiveStaged(..., fetch=...)`` on the decode reads it, scatters it and
acknowledges it, which also frees the prefill's buffer. Checked: the decode's bytes equal the
direct plan's, the prefill never gathers into a buffer the decode has not read yet, no engine
is driven by the prefill, and a failed read fails the request once on both sides with nothing
loaded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvplan.exec.numpy import Memory, apply_plan
from kvplan.staging import ArenaShares, ReceiveStaged, Router, StagingArena, StagingError, \
    send_staged
from support.staging_rounds import copier, mla_fragmented_case, rounds_for

ARENA = 64 << 10


class PullSetup:
    def __init__(self, buffers: int = 2, *, fail_read: int | None = None,
                 fetch: Any = None) -> None:
        self.prefill, self.decode, self.template, self.src, self.dst = mla_fragmented_case()
        self.src_arena = StagingArena(ARENA, buffers)
        self.dst_arena = StagingArena(ARENA, buffers)
        self.buffers = buffers
        self.rounds = rounds_for(self.template, self.src, self.dst, self.src_arena.region,
                                 self.dst_arena.region, buffers)
        self.prefill_router, self.decode_router = Router(), Router()
        self.loaded: list[ReceiveStaged] = []
        self.failures: list[StagingError] = []
        self.reads: list[int] = []
        self.fail_read = fail_read
        self.events: list[tuple[str, int]] = []
        self.receiver = ReceiveStaged(
            "req-1", self.rounds, copier([self.dst_arena.array], [self.decode.memory]),
            self.prefill_router.deliver, on_loaded=self.loaded.append,
            on_failed=self.failures.append, timeout_s=5.0,
            fetch=self.read if fetch is None else lambda r: fetch[0](r))
        self.decode_router.open("req-1", 0, self.receiver.on_message)
        assert ArenaShares().admit(self.receiver)

    def read(self, r: Any) -> None:
        """The decode's read of round ``r``: its network plan, prefill arena -> decode
        arena."""
        k = int(r.index)
        if k == self.fail_read:
            raise OSError(f"read of round {k} failed")
        self.reads.append(k)
        src, dst = Memory.of(self.src_arena.array), Memory.of(self.dst_arena.array)
        for s, d, n in zip(*(np.asarray(c).tolist() for c in
                             (r.network.src_addrs, r.network.dst_addrs, r.network.lengths))):
            dst.at(d, n)[:] = src.at(s, n)

    def direct(self) -> np.ndarray:
        want = Memory(self.decode.memory.copy(), int(self.decode.memory.ctypes.data))
        apply_plan(self.template.plan(self.src, self.dst), Memory.of(self.prefill.memory), want)
        return want.data

    def send(self, **kw: Any) -> Any:
        return send_staged(self.rounds, None, "decode", self.decode_router.deliver,
                           request="req-1", acks=self.prefill_router,
                           gather=copier([self.prefill.memory], [self.src_arena.array]),
                           buffers=self.buffers, timeout_s=kw.pop("timeout_s", 5.0),
                           pull=True, events=self.events, **kw)


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_pulled_rounds_land_the_direct_plans_bytes(buffers: int) -> None:
    s = PullSetup(buffers)
    want = s.direct()
    report = s.send()
    assert report.rounds == len(s.rounds) > 10
    assert report.network_blocks == len(s.rounds)  # one read per round
    assert s.reads == list(range(len(s.rounds)))
    np.testing.assert_array_equal(s.decode.memory, want)
    assert s.loaded == [s.receiver] and s.failures == []


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_the_prefill_never_gathers_over_a_round_the_decode_has_not_read(buffers: int) -> None:
    s = PullSetup(buffers)
    s.send()
    at = {e: i for i, e in enumerate(s.events)}
    n = len(s.rounds)
    for k in range(n):
        assert at[("gather", k)] < at[("notify", k)] < at[("ack", k)]
        if k >= buffers:
            # round k reuses round k - buffers' prefill buffer: the decode read it first
            assert at[("ack", k - buffers)] < at[("gather", k)]


def test_a_failed_read_fails_the_request_once_on_both_sides() -> None:
    s = PullSetup(2, fail_read=3)
    with pytest.raises(StagingError) as info:
        s.send()
    assert info.value.reason == "peer_failed" and info.value.round == 3
    assert len(s.failures) == 1 and s.failures[0].reason == "engine_failed"
    assert s.failures[0].round == 3 and not s.receiver.loaded and s.loaded == []
    assert s.reads == [0, 1, 2]
    assert ("gather", 5) not in s.events  # nothing gathered past the unread buffers


def test_a_silent_decode_times_out_the_prefill_without_overwriting_its_buffer() -> None:
    s = PullSetup(1)
    s.decode_router.close("req-1")  # the decode never reads
    s.decode_router = Router()
    with pytest.raises(StagingError) as info:
        s.send(timeout_s=0.3)
    assert info.value.reason == "timeout"
    assert ("gather", 1) not in s.events


def test_the_prefill_gathers_and_announces_every_round_on_the_calling_thread() -> None:
    """Pull mode hands nothing to other threads: each gather and each round message runs on
    the thread that called ``send_staged`` (here the decode reads inline, so its reads and
    acknowledgements run there too), and the bytes still land."""
    import threading

    s = PullSetup(2)
    want = s.direct()
    gather = copier([s.prefill.memory], [s.src_arena.array])
    threads: set[str] = set()

    def gathering(plan: Any) -> None:
        threads.add(threading.current_thread().name)
        gather(plan)

    def announcing(data: bytes) -> None:
        threads.add(threading.current_thread().name)
        s.decode_router.deliver(data)

    report = send_staged(s.rounds, None, "decode", announcing, request="req-1",
                         acks=s.prefill_router, gather=gathering, buffers=2, timeout_s=5.0,
                         pull=True, events=s.events)
    assert threads == {threading.current_thread().name}
    assert report.rounds == len(s.rounds) > 10 and s.reads == list(range(len(s.rounds)))
    np.testing.assert_array_equal(s.decode.memory, want)


def test_a_failed_gather_stops_the_pulled_rounds_and_tells_the_decode_once() -> None:
    s = PullSetup(2)
    gather = copier([s.prefill.memory], [s.src_arena.array])
    gathered: list[int] = []

    def failing(plan: Any) -> None:
        if len(gathered) == 4:
            raise OSError("the KV memory went away")
        gathered.append(len(gathered))
        gather(plan)

    with pytest.raises(StagingError) as info:
        send_staged(s.rounds, None, "decode", s.decode_router.deliver, request="req-1",
                    acks=s.prefill_router, gather=failing, buffers=2, timeout_s=5.0,
                    pull=True, events=s.events)
    assert info.value.reason == "gather_failed" and info.value.round == 4
    assert "the KV memory went away" in info.value.detail
    assert ("notify", 4) not in s.events and s.reads == [0, 1, 2, 3]
    assert [(f.reason, f.round) for f in s.failures] == [("peer_failed", 4)]
    assert not s.receiver.loaded and s.receiver.scattered == 4


def test_a_pulled_request_of_no_rounds_is_sent_without_waiting_for_a_grant() -> None:
    from kvplan.staging import AckQueue

    sent: list[bytes] = []
    report = send_staged([], None, "decode", sent.append, request="req-0", acks=AckQueue(),
                         gather=lambda plan: None, buffers=2, timeout_s=5.0, pull=True)
    assert (report.rounds, report.bytes, report.network_blocks) == (0, 0, 0)
    assert sent == []


# ---------------------------------------------------------------------------------------------
# The decode's reads through real NIXL agents (UCX on loopback)
# ---------------------------------------------------------------------------------------------

def _agents() -> tuple[Any, Any]:
    from support.engine_peers import require_nixl

    require_nixl()
    import importlib

    api = importlib.import_module("nixl_cu12._api")
    make = [api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
            for name in ("pull-prefill", "pull-decode")]
    return make[0], make[1]


@pytest.mark.nixl
@pytest.mark.parametrize("buffers", [1, 2])
def test_rounds_read_through_real_nixl_agents_land_the_direct_plans_bytes(
        buffers: int) -> None:
    from kvplan.staging import NixlRoundReader

    prefill_agent, decode_agent = _agents()
    fetch: list[Any] = []
    s = PullSetup(buffers, fetch=fetch)
    s.src_arena.register(prefill_agent)
    s.dst_arena.register(decode_agent)
    try:
        # the prefill's metadata (its arena registered) is what the decode's agent loads
        name = decode_agent.add_remote_agent(prefill_agent.get_agent_metadata())
        reader = NixlRoundReader(decode_agent, name, timeout_s=20.0)
        fetch.append(reader)  # the reads go through NIXL, not the in-memory copy
        want = s.direct()
        report = s.send(timeout_s=20.0)
        assert report.rounds == reader.reads == len(s.rounds) > 10
        np.testing.assert_array_equal(s.decode.memory, want)
        assert s.loaded == [s.receiver] and s.failures == []
    finally:
        s.src_arena.unregister()
        s.dst_arena.unregister()


@pytest.mark.nixl
def test_a_read_from_an_agent_the_decode_does_not_know_fails_the_request() -> None:
    from kvplan.staging import NixlRoundReader

    prefill_agent, decode_agent = _agents()
    fetch: list[Any] = []
    s = PullSetup(2, fetch=fetch)
    s.src_arena.register(prefill_agent)
    s.dst_arena.register(decode_agent)
    try:
        fetch.append(NixlRoundReader(decode_agent, "nobody", timeout_s=5.0))
        with pytest.raises(StagingError) as info:
            s.send()
        assert info.value.reason == "peer_failed" and info.value.round == 0
        assert [f.reason for f in s.failures] == ["engine_failed"]
        assert "nobody" in s.failures[0].detail
        assert s.loaded == [] and not s.receiver.loaded and s.receiver.scattered == 0
    finally:
        s.src_arena.unregister()
        s.dst_arena.unregister()


class _Announced:
    """An ack queue saying when its send first waits for the decode's answer."""

    def __init__(self) -> None:
        import threading

        from kvplan.staging import AckQueue

        self.queue, self.waiting = AckQueue(), threading.Event()

    def put(self, data: bytes) -> None:
        self.queue.put(data)

    def get(self, timeout: float) -> bytes:
        self.waiting.set()
        return self.queue.get(timeout)


def test_two_streams_of_one_prefill_to_one_decode_never_deadlock_on_the_arenas() -> None:
    """Two requests of one prefill to one decode: their claims on the decode arena overlap,
    so the decode grants them in the order it opened them (A, then B once A is loaded); the
    prefill serves one at a time through its arena. When B's send starts first, it must not
    hold the prefill arena while it waits for its grant: A (granted) would wait for the
    arena, B for A's end, until the timeout failed them. Both are served, A first, every
    byte where the direct plan puts it."""
    import threading

    prefill, decode, template, src, dst = mla_fragmented_case()
    src_arena, dst_arena = StagingArena(ARENA, 2), StagingArena(ARENA, 2)
    half = len(src) // 2
    pages = {"req-a": (src[:half], dst[:half]), "req-b": (src[half:], dst[half:])}
    prefill_router, decode_router = Router(), Router()
    shares = ArenaShares()
    scatter = copier([dst_arena.array], [decode.memory])

    def read(r: Any) -> None:  # the decode's read of a round: prefill arena -> decode arena
        s, d = Memory.of(src_arena.array), Memory.of(dst_arena.array)
        for a, b, n in zip(*(np.asarray(c).tolist() for c in
                             (r.network.src_addrs, r.network.dst_addrs, r.network.lengths))):
            d.at(b, n)[:] = s.at(a, n)

    rounds, receivers, acks = {}, {}, {}
    for name, (p, q) in pages.items():
        rounds[name] = rounds_for(template, p, q, src_arena.region, dst_arena.region, 2)
        receivers[name] = ReceiveStaged(name, rounds[name], scatter, prefill_router.deliver,
                                        timeout_s=30.0, fetch=read)
        acks[name] = _Announced()
        prefill_router.open(name, 0, acks[name].put)
        decode_router.open(name, 0, receivers[name].on_message)
    assert shares.admit(receivers["req-a"]) and not shares.admit(receivers["req-b"])
    want = Memory(decode.memory.copy(), int(decode.memory.ctypes.data))
    apply_plan(template.plan(src, dst), Memory.of(prefill.memory), want)
    reports: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    def send(name: str) -> None:
        try:
            reports[name] = send_staged(
                rounds[name], None, "decode", decode_router.deliver, request=name,
                acks=acks[name], gather=copier([prefill.memory], [src_arena.array]),
                buffers=2, timeout_s=2.0, src_lock=src_arena.lock, pull=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[name] = exc

    b = threading.Thread(target=send, args=("req-b",))
    b.start()
    assert acks["req-b"].waiting.wait(30.0)  # B waits for its grant
    a = threading.Thread(target=send, args=("req-a",))
    a.start()
    a.join(60.0)
    b.join(60.0)
    assert errors == {}
    assert set(reports) == {"req-a", "req-b"}
    assert all(r.loaded for r in receivers.values())
    np.testing.assert_array_equal(decode.memory, want.data)


def test_the_decode_is_loaded_only_once_its_last_acknowledgement_is_out() -> None:
    """The decode's last acknowledgement goes to the prefill before its poll or ``on_loaded``
    says the stream is loaded: an engine that saw it loaded may end the request, close the
    channel or shut down, and the prefill's send (holding its arena) still waits for that
    acknowledgement. Held here in the middle of its send, the poll does not say loaded."""
    import threading

    s = PullSetup(2)
    n = len(s.rounds)
    entered, release = threading.Event(), threading.Event()
    deliver = s.prefill_router.deliver

    def ack(data: bytes) -> None:
        from kvplan.staging.wire import ACK, decode

        m = decode(data)
        if m.kind == ACK and m.round == n - 1:
            entered.set()
            assert release.wait(30.0)
        deliver(data)

    s.receiver._ack = ack
    done: list[Any] = []
    sender = threading.Thread(target=lambda: done.append(s.send()))
    sender.start()
    try:
        assert entered.wait(30.0)
        assert s.receiver.poll(block=False) != "loaded"  # what an engine's poll sees
        assert s.loaded == []  # on_loaded not called
    finally:
        release.set()
        sender.join(30.0)
    assert s.receiver.poll() == "loaded" and s.loaded == [s.receiver]
    assert len(done) == 1 and done[0].rounds == n


@pytest.mark.parametrize("how", ["cancelled", "scatter_failed", "engine_failed"])
def test_a_pulled_stream_that_fails_passes_its_share_on_without_the_prefill(how: str) -> None:
    """In pull mode only the decode's own reads write its arena, each under the stream's
    lock: a stream that fails (vLLM's abort, a failed scatter) passes its share of the decode
    arena to the next stream at once, not once the prefill answers (its serving thread may be
    waiting for its hold or its arena) or ``timeout_s`` later. A failed read is the
    exception: the read given up on may still land, so the share waits as before."""
    s = PullSetup(2)
    scatter = copier([s.dst_arena.array], [s.decode.memory])
    told: list[bytes] = []

    def failing(plan: Any) -> None:
        raise OSError("the KV memory went away")

    def reading(r: Any) -> None:
        if how == "engine_failed":
            raise OSError("NIXL reported the read failed")

    first = ReceiveStaged("req-a", s.rounds, failing if how == "scatter_failed" else scatter,
                          told.append, timeout_s=30.0, fetch=reading)
    second = ReceiveStaged("req-b", s.rounds, scatter, told.append, timeout_s=30.0,
                           fetch=reading)
    shares = ArenaShares()
    assert shares.admit(first) and not shares.admit(second)
    if how == "cancelled":
        first.cancel("vLLM finished the request during its staged read")
    else:  # round 0 arrives and fails
        from kvplan.staging.wire import ROUND, encode

        r = s.rounds[0]
        first.on_message(encode(ROUND, "req-a", writer=0, round_index=0,
                                n_rounds=len(s.rounds), buffer=int(r.buffer),
                                payload=r.manifest.to_bytes()))
    assert first.failed and first.error is not None and first.error.reason == how
    assert second.granted == (how != "engine_failed")
    assert shares.holders() == [second if how != "engine_failed" else first]


def test_a_read_failed_by_the_prefills_going_fails_the_stream_peer_gone() -> None:
    """The read of a pulled round failed because the prefill went away (the reader's error
    has ``peer_gone`` set: its side channel had closed): the stream fails ``peer_gone``,
    naming the read's error, not ``engine_failed`` (this side's engine did not fail). The
    share still waits, as after any failed read: the read given up on may still land."""
    from kvplan import TransferError
    from kvplan.staging.wire import ROUND, encode

    s = PullSetup(2)
    scatter = copier([s.dst_arena.array], [s.decode.memory])

    def reading(r: Any) -> None:
        err = TransferError("nixl: reading a staged round (3 blocks, 768 bytes) from "
                            "prefill-0: the prefill's side channel closed during the read")
        err.peer_gone = True
        raise err

    first = ReceiveStaged("req-a", s.rounds, scatter, lambda data: None, timeout_s=30.0,
                          fetch=reading)
    second = ReceiveStaged("req-b", s.rounds, scatter, lambda data: None, timeout_s=30.0,
                           fetch=reading)
    shares = ArenaShares()
    assert shares.admit(first) and not shares.admit(second)
    r = s.rounds[0]
    first.on_message(encode(ROUND, "req-a", writer=0, round_index=0, n_rounds=len(s.rounds),
                            buffer=int(r.buffer), payload=r.manifest.to_bytes()))
    assert first.failed and first.error is not None
    assert first.error.reason == "peer_gone" and first.error.round == 0
    assert "from prefill-0: the prefill's side channel closed" in first.error.detail
    assert not second.granted and shares.holders() == [first]


class FailingAgent:
    """A NIXL agent whose one read ends in ``ERR``; the prefill's channel closes meanwhile
    where ``closing``."""

    def __init__(self, gone: list[bool], closing: bool) -> None:
        self.gone, self.closing = gone, closing

    def get_xfer_descs(self, rows: Any, mem_type: str) -> Any:
        return rows

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> str:
        return "handle"

    def transfer(self, handle: str) -> str:
        self.gone[0] = self.closing
        return "ERR"

    def release_xfer_handle(self, handle: str) -> None:
        pass


@pytest.mark.parametrize("closing", [True, False])
def test_a_failed_read_says_whether_the_prefill_went_away(closing: bool) -> None:
    """NIXL reports a read failed (``ERR``): where the prefill's side channel has closed by
    then, the error says the prefill went away and has ``peer_gone`` set; else it is the
    read's own failure."""
    from types import SimpleNamespace

    from kvplan import TransferError
    from kvplan.staging import NixlRoundReader

    gone = [False]
    reader = NixlRoundReader(FailingAgent(gone, closing), "prefill-0",
                             gone=lambda: gone[0])
    network = SimpleNamespace(src_addrs=[4096, 8192], dst_addrs=[0, 256],
                              lengths=[256, 256])
    with pytest.raises(TransferError) as failed:
        reader(SimpleNamespace(network=network))
    assert failed.value.peer_gone == closing and failed.value.session == "prefill-0"
    assert ("the prefill went away" in str(failed.value)) == closing
    assert "(2 blocks, 512 bytes) from prefill-0: NIXL reported the read failed (ERR)" in \
        str(failed.value)
