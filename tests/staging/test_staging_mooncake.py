"""Staged transfers over real Mooncake TCP loopback (two engines in this process): the prefill
gathers each round into its registered arena, the native hand-off writes it into the decode's
registered arena, the decode scatters it into its KV memory after checking the round's
manifest and acknowledges it; the decode plans its own rounds on a stand-in of the prefill's
memory (it does not know the prefill's addresses). The decode's memory must equal what the
direct plan writes through the same engines, and the byte oracle's, on a fragmented MLA page-1
request and a TP 8 -> 2 NHD request (four prefill ranks filling one decode arena at once)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvplan.exec.numpy import Memory, apply_plan
from kvplan.staging import (
    ArenaShares,
    Capabilities,
    ReceiveStaged,
    Router,
    StagingAgreement,
    StagingArena,
    StagingError,
    negotiate,
    send_staged,
)
from kvplan import Template
from support.staging_rounds import (
    copier,
    gqa_peer,
    mla_fragmented_case,
    mla_peer,
    rounds_for,
    tp8_to_tp2_case,
)

pytestmark = pytest.mark.mooncake

SENTINEL = 0xA5


class Pair:
    """A prefill and a decode Mooncake engine over TCP on 127.0.0.1. The prefill sends
    through a ``Handoff`` (native, or the binding's lists) or a ``MooncakeTransport``."""

    def __init__(self, sender: str = "native") -> None:
        from mooncake.engine import TransferEngine

        from kvplan.engines import MooncakeTransport
        from kvplan.engines.mooncake import Handoff

        self.kind = sender
        self.decode = TransferEngine()
        assert self.decode.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.decode_session = f"127.0.0.1:{self.decode.get_rpc_port()}"
        self.registered: list[tuple[Any, int]] = []
        self.transport: Any = None
        if sender == "transport":
            self.transport = MooncakeTransport("127.0.0.1")
            self.prefill: Any = self.transport
            self.sender: Any = self.transport
        else:
            self.prefill = TransferEngine()
            assert self.prefill.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            session = f"127.0.0.1:{self.prefill.get_rpc_port()}"
            self.sender = Handoff(self.prefill, session, native=sender == "native")

    def register(self, engine: Any, array: np.ndarray) -> None:
        if engine is self.transport:
            engine.register_buffers([array.ctypes.data], [array.nbytes])
            return
        assert engine.register_memory(array.ctypes.data, array.nbytes) == 0
        self.registered.append((engine, array.ctypes.data))

    def close(self) -> None:
        for engine, addr in self.registered:
            engine.unregister_memory(addr)
        if self.transport is not None:
            self.transport.close()


@pytest.fixture(params=["native"])
def pair(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Pair]:
    from support.engine_peers import require_mooncake

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    monkeypatch.delenv("KVPLAN_MOONCAKE_NATIVE", raising=False)
    p = Pair(request.param)
    yield p
    p.close()


def agree(src: StagingArena, dst: StagingArena) -> StagingAgreement:
    """What the two peers' handshake messages agree on (as each side computes it)."""
    mine, theirs = Capabilities.local([src.info()]), Capabilities.local([dst.info()])
    on_prefill = negotiate(mine, theirs.to_bytes(), sending=True)
    assert on_prefill == negotiate(theirs, mine.to_bytes(), sending=False)
    assert isinstance(on_prefill, StagingAgreement), on_prefill
    return on_prefill


def oracle(decode_memory: np.ndarray, writes: list[tuple[Any, np.ndarray]]) -> np.ndarray:
    want = Memory(np.full_like(decode_memory, SENTINEL), int(decode_memory.ctypes.data))
    for plan, src_memory in writes:
        apply_plan(plan, Memory.of(src_memory), want)
    return want.data


def direct_through_engine(pair: Pair, plan: Any) -> None:
    if pair.transport is not None:
        pair.transport.submit(plan, pair.decode_session)
        return
    assert pair.sender.write_batches(pair.decode_session, plan.src_addrs, plan.dst_addrs,
                                     plan.lengths, 1024) == 0


def staged_stream(pair: Pair, rounds: Any, agreement: StagingAgreement, request: str,
                  writer: int, prefill_memory: np.ndarray, src_arena: StagingArena,
                  dst_arena: StagingArena, decode_memory: np.ndarray,
                  routers: tuple[Router, Router], decode_rounds: Any
                  ) -> tuple[Any, ReceiveStaged]:
    """One stream: the prefill sends ``rounds``; the decode checks and scatters its own
    ``decode_rounds``, planned without the prefill's KV memory."""
    prefill_router, decode_router = routers
    receiver = ReceiveStaged(request, decode_rounds,
                             copier([dst_arena.array], [decode_memory]),
                             prefill_router.deliver, writer=writer, timeout_s=10.0)
    decode_router.open(request, writer, receiver.on_message)
    ArenaShares().admit(receiver)
    report = send_staged(rounds, pair.sender, pair.decode_session, decode_router.deliver,
                         request=request, acks=prefill_router, writer=writer,
                         gather=copier([prefill_memory], [src_arena.array]),
                         buffers=agreement.buffers, timeout_s=10.0)
    return report, receiver


@pytest.mark.parametrize("pair", ["native", "lists", "transport"], indirect=True)
def test_fragmented_mla_page1_staged_equals_direct(pair: Pair) -> None:
    prefill, decode, template, src, dst = mla_fragmented_case(tokens=300)
    decode.memory[:] = SENTINEL
    src_arena, dst_arena = StagingArena(64 << 10, 2), StagingArena(64 << 10, 2)
    for engine, array in ((pair.prefill, prefill.memory), (pair.decode, decode.memory)):
        pair.register(engine, array)
    src_arena.register(pair.prefill)
    dst_arena.register(pair.decode)
    try:
        agreement = agree(src_arena, dst_arena)
        direct = template.plan(src, dst)
        want = oracle(decode.memory, [(direct, prefill.memory)])
        direct_through_engine(pair, direct)
        np.testing.assert_array_equal(decode.memory, want)
        decode.memory[:] = SENTINEL
        rounds = rounds_for(template, src, dst, agreement.src_arena, agreement.dst_arena,
                            agreement.buffers)
        # the decode plans with a stand-in of the prefill's memory (same geometry)
        on_decode = rounds_for(Template(mla_peer(None).layout, decode.layout), src, dst,
                               agreement.src_arena, agreement.dst_arena, agreement.buffers)
        report, receiver = staged_stream(pair, rounds, agreement, "mla-1", 0, prefill.memory,
                                         src_arena, dst_arena, decode.memory,
                                         (Router(), Router()), on_decode)
    finally:
        src_arena.close()
        dst_arena.close()
    assert receiver.loaded and receiver.scattered == len(rounds) == report.rounds > 10
    assert report.bytes == int(direct.lengths.sum())
    assert len(direct.lengths) == 1200 and report.network_blocks <= 2 * report.rounds
    np.testing.assert_array_equal(decode.memory, want)
    if pair.transport is None:
        assert pair.sender.path == pair.kind, pair.sender.reason


def test_tp8_to_tp2_nhd_four_writers_into_one_decode_arena(pair: Pair) -> None:
    writers, decode, templates, src, dst = tp8_to_tp2_case(pages=10)
    decode.memory[:] = SENTINEL
    src_arenas = [StagingArena(32 << 10, 2) for _ in writers]
    dst_arena = StagingArena(64 << 10, 2)  # 16 KiB per writer, two 8 KiB round buffers each
    pair.register(pair.decode, decode.memory)
    for w, a in zip(writers, src_arenas):
        pair.register(pair.prefill, w.memory)
        a.register(pair.prefill)
    dst_arena.register(pair.decode)
    try:
        directs = [t.plan(src, dst) for t in templates]
        want = oracle(decode.memory, [(d, w.memory) for d, w in zip(directs, writers)])
        for d in directs:
            direct_through_engine(pair, d)
        np.testing.assert_array_equal(decode.memory, want)
        decode.memory[:] = SENTINEL
        routers = (Router(), Router())
        results: dict[int, Any] = {}

        def run(i: int) -> None:
            agreement = agree(src_arenas[i], dst_arena)
            rounds = rounds_for(templates[i], src, dst, agreement.src_arena,
                                agreement.dst_arena, agreement.buffers, sender=(i, 4))
            # the core places prefill rank i of TP 8 as sender i of 4 into decode rank 0
            writer = rounds.sender[0] if hasattr(rounds, "sender") else i
            assert writer == i
            stand_in = Template(gqa_peer(i, 8, None).layout, decode.layout)
            on_decode = rounds_for(stand_in, src, dst, agreement.src_arena,
                                   agreement.dst_arena, agreement.buffers, sender=(i, 4))
            try:
                results[i] = staged_stream(pair, rounds, agreement, "tp-1", writer,
                                           writers[i].memory, src_arenas[i], dst_arena,
                                           decode.memory, routers, on_decode)
            except StagingError as exc:  # pragma: no cover - reported below
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for a in src_arenas:
            a.close()
        dst_arena.close()
    for i in range(4):
        report, receiver = results[i]
        assert receiver.loaded and report.rounds == receiver.scattered > 1
        assert report.bytes == int(directs[i].lengths.sum())
        assert len(directs[i].lengths) == 10 * 16 * 2 * 4  # a block per token per entry
    np.testing.assert_array_equal(decode.memory, want)
    assert int(np.count_nonzero(decode.memory != SENTINEL)) > 0


def test_a_real_engine_failure_mid_way_fails_the_request_once(pair: Pair) -> None:
    """The decode's arena is unregistered after round 2 was scattered: Mooncake refuses round
    3's write (the decode's server rejects an address outside its registered memory). Both
    sides fail once naming round 3; the decode has rounds 0-2 and is not loaded. Nothing is
    written through these engines afterwards."""
    prefill, decode, template, src, dst = mla_fragmented_case(tokens=300)
    src_arena, dst_arena = StagingArena(64 << 10, 2), StagingArena(64 << 10, 2)
    for engine, array in ((pair.prefill, prefill.memory), (pair.decode, decode.memory)):
        pair.register(engine, array)
    src_arena.register(pair.prefill)
    dst_arena.register(pair.decode)
    agreement = agree(src_arena, dst_arena)
    rounds = rounds_for(template, src, dst, agreement.src_arena, agreement.dst_arena, 2)
    prefill_router, decode_router = Router(), Router()
    inner = copier([dst_arena.array], [decode.memory])
    scattered = []

    def scatter(plan: Any) -> None:
        inner(plan)
        scattered.append(plan)
        if len(scattered) == 3:
            dst_arena.unregister()

    failures: list[StagingError] = []
    loaded: list[ReceiveStaged] = []
    receiver = ReceiveStaged("broken", rounds, scatter, prefill_router.deliver,
                             on_failed=failures.append, on_loaded=loaded.append)
    decode_router.open("broken", 0, receiver.on_message)
    ArenaShares().admit(receiver)
    try:
        with pytest.raises(StagingError) as exc:
            send_staged(rounds, pair.sender, pair.decode_session, decode_router.deliver,
                        request="broken", acks=prefill_router,
                        gather=copier([prefill.memory], [src_arena.array]), timeout_s=10.0)
    finally:
        src_arena.close()
        dst_arena.close()
    assert exc.value.reason == "engine_failed" and exc.value.round == 3
    assert exc.value.request == "broken" and "mooncake" in exc.value.detail
    assert [(f.reason, f.round) for f in failures] == [("peer_failed", 3)]
    assert loaded == [] and not receiver.loaded and receiver.scattered == 3
