"""``kvplan.engines.mooncake.Handoff``: the one object that hands block columns to a Mooncake
engine for the transport, the vLLM drop-in and the SGLang drop-in.

The real-engine tests run two Mooncake engines in this process, talking TCP over 127.0.0.1: the
sender's hand-off writes into a buffer registered on the receiver, and every byte of that
buffer is checked against the blocks applied with numpy. No test writes right after a peer
refused a batch (Mooncake's TCP lanes may fail that write on their own).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvplan import BlockSlice
from kvplan.engines import MooncakeTransport
from kvplan.engines.mooncake import Handoff

mooncake = pytest.mark.mooncake

SIZE = 1 << 20
SENTINEL = 0xA5


@pytest.fixture
def mooncake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from support.engine_peers import require_mooncake

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    monkeypatch.delenv("KVPLAN_MOONCAKE_NATIVE", raising=False)


class _Pair:
    """A sender and a receiver engine, each with one registered buffer."""

    def __init__(self) -> None:
        from mooncake.engine import TransferEngine

        self.src = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
        self.dst = np.full(SIZE, SENTINEL, np.uint8)
        self.engines: list[Any] = []
        for buf in (self.src, self.dst):
            engine = TransferEngine()
            assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
            self.engines.append(engine)
        self.sender, receiver = self.engines
        self.sender_session = f"127.0.0.1:{self.sender.get_rpc_port()}"
        self.receiver_session = f"127.0.0.1:{receiver.get_rpc_port()}"

    def blocks(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` blocks of 1..1,024 bytes from distinct source slots to shuffled destination
        slots, as addresses."""
        rng = np.random.default_rng(seed)
        slots = SIZE // 1024
        src = rng.permutation(slots)[:n].astype(np.uint64) * np.uint64(1024)
        dst = rng.permutation(slots)[:n].astype(np.uint64) * np.uint64(1024)
        lengths = rng.integers(1, 1025, n).astype(np.uint64)
        return (src + np.uint64(self.src.ctypes.data), dst + np.uint64(self.dst.ctypes.data),
                lengths)

    def expected(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        want = np.full(SIZE, SENTINEL, np.uint8)
        s0, d0 = self.src.ctypes.data, self.dst.ctypes.data
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
            want[d - d0:d - d0 + n] = self.src[s - s0:s - s0 + n]
        return want

    def close(self) -> None:
        for engine, buf in zip(self.engines, (self.src, self.dst)):
            engine.unregister_memory(buf.ctypes.data)


@pytest.fixture
def pair(mooncake_env: None) -> Any:
    p = _Pair()
    yield p
    p.close()


@mooncake
def test_native_and_list_paths_land_identical_bytes(pair: _Pair,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The same 300 blocks, in batches of at most 128, through the native API and (with
    ``KVPLAN_MOONCAKE_NATIVE=0``) through the binding's lists: the receiver's buffer is the
    same, byte for byte, and what numpy says it must be."""
    src, dst, lengths = pair.blocks(300, seed=17)
    want = pair.expected(src, dst, lengths)
    landed = {}
    for path in ("native", "lists"):
        if path == "lists":
            monkeypatch.setenv("KVPLAN_MOONCAKE_NATIVE", "0")
        pair.dst[:] = SENTINEL
        h = Handoff(pair.sender, pair.sender_session)
        assert h.write_batches(pair.receiver_session, src, dst, lengths, 128) == 0
        assert h.path == path
        assert h.reason == ("" if path == "native" else "disabled (KVPLAN_MOONCAKE_NATIVE=0)")
        assert (h.native() is not None) == (path == "native")
        landed[path] = pair.dst.copy()
    np.testing.assert_array_equal(landed["native"], want)
    np.testing.assert_array_equal(landed["lists"], landed["native"])


@mooncake
def test_a_failed_self_test_keeps_its_reason_and_falls_back_to_lists(
        pair: _Pair, caplog: pytest.LogCaptureFixture) -> None:
    """The native API binds (the engine is Mooncake's), but the self-test is sent through a
    session where nothing listens: it fails, the hand-off says why (once, in its log too), and
    the blocks go through the lists and land exactly."""
    log = logging.getLogger("kvplan.test.handoff")
    h = Handoff(pair.sender, "127.0.0.1:1", log=log)
    assert h.bind() and h.path == "native" and h.reason == ""  # provisional until the test
    src, dst, lengths = pair.blocks(40, seed=3)
    with caplog.at_level(logging.INFO, logger=log.name):
        assert h.write_batches(pair.receiver_session, src, dst, lengths, 16) == 0
        assert h.write(pair.receiver_session, src[:1], dst[:1], lengths[:1]) == 0
    assert h.native() is None and h.path == "lists"
    assert h.reason.startswith("self-test failed: RuntimeError: ") and "127.0.0.1:1" in h.reason
    lines = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert lines == [f"kvplan: Mooncake blocks go through the binding's lists: {h.reason}"]
    np.testing.assert_array_equal(pair.dst, pair.expected(src, dst, lengths))


@mooncake
def test_the_transport_shows_a_failed_self_test_and_still_moves_the_bytes(
        mooncake_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transport whose hand-off fails its self-test at the first write reports it through
    ``handoff`` / ``handoff_reason`` and writes that plan, sync and async, through the lists."""
    from kvplan.engines import mooncake as module

    monkeypatch.setattr(module, "_self_test",
                        lambda *args: "the bytes that landed differ from the bytes written")
    src_buf = np.random.default_rng(9).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst_buf = np.zeros(1 << 16, np.uint8)
    sender, receiver = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    try:
        assert sender.handoff == "native"  # bound; the self-test has not run yet
        sender.register_buffers([src_buf.ctypes.data], [src_buf.nbytes])
        receiver.register_buffers([dst_buf.ctypes.data], [dst_buf.nbytes])
        offsets = np.arange(0, 1 << 15, 512, dtype=np.uint64)
        lengths = np.full(len(offsets), 512, np.uint64)
        plan = BlockSlice(np.uint64(src_buf.ctypes.data) + offsets,
                         np.uint64(dst_buf.ctypes.data) + offsets[::-1].copy(), lengths)
        stats = sender.submit(plan, receiver.local_session_id(), 20)
        assert (stats.blocks, stats.batches) == (64, 4)
        assert (sender.handoff, sender.handoff_reason) == (
            "lists", "self-test failed: the bytes that landed differ from the bytes written")
        want = src_buf[:1 << 15].reshape(64, 512)[::-1].reshape(-1)
        np.testing.assert_array_equal(dst_buf[:1 << 15], want)
        dst_buf[:] = 0
        sender.submit_async(plan, receiver.local_session_id(), 20).wait()
        np.testing.assert_array_equal(dst_buf[:1 << 15], want)
    finally:
        sender.close()
        receiver.close()


class _Stand:
    """Mooncake's list method, recorded; not Mooncake's engine."""

    def __init__(self, status: Any = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.status = status

    def batch_transfer_sync_write(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.status


def test_a_stand_in_gets_the_lists_and_its_status_unchanged() -> None:
    engine = _Stand(status=7)
    h = Handoff(engine, "self:1")
    src = np.arange(5, dtype=np.uint64) * np.uint64(64)
    assert h.write_batches("peer:1", src, src, np.full(5, 64, np.uint64), 2) == 7
    assert len(engine.calls) == 1 and engine.calls[0][1] == [0, 64]  # stopped at the failure
    assert all(type(x) is int for x in engine.calls[0][1])
    assert h.path == "lists" and "_Stand, not Mooncake's" in h.reason
    with pytest.raises(ImportError, match="native Mooncake hand-off unavailable: engine is a"):
        Handoff(_Stand(), "self:1", native=True)
    assert Handoff(_Stand(), "self:1", native=False).reason == "disabled (native=False)"


def test_one_kept_per_owner_and_engine() -> None:
    """The hand-off kept on an owner is reused while the owner's engine is the same object and
    replaced when it changes; an owner without ``__dict__`` keeps nothing."""

    class Owner:
        pass

    owner, first, second = Owner(), _Stand(), _Stand()
    assert Handoff.kept(owner) is None
    h = Handoff.kept_on(owner, first, "self:1")
    assert Handoff.kept_on(owner, first, "self:2") is h and Handoff.kept(owner) is h
    replaced = Handoff.kept_on(owner, second, "self:1")
    assert replaced is not h and replaced.engine is second and Handoff.kept(owner) is replaced
    slotted = object()
    assert Handoff.kept_on(slotted, first, None) is not Handoff.kept_on(slotted, first, None)
    assert Handoff.kept(slotted) is None
