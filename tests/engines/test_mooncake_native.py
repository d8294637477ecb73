"""Mooncake's native batch hand-off (``kvplan._core.MooncakeNative``) and its fallback.

The real-engine tests move bytes between spawned processes over TCP on 127.0.0.1 (as in
``test_mooncake.py``) and check every byte of the decode arena, once through the native request
array and once through the Python binding's lists (``KVPLAN_MOONCAKE_NATIVE=0``). The
in-process tests drive the binding class directly against a real, initialised engine; they fail,
never skip, when Mooncake is missing.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from kvplan import BlockSlice
from kvplan.engines import MooncakeTransport
from kvplan.testing.oracle import Memory, apply_plan

from support.engine_peers import raw_pair

mooncake = pytest.mark.mooncake


@pytest.fixture
def mooncake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from support.engine_peers import require_mooncake

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")


class _Stand:
    """Anything with Mooncake's method names that is not Mooncake's engine."""

    def initialize(self, *args: str) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 15000


def test_a_stand_in_engine_uses_the_list_path_and_says_why() -> None:
    t = MooncakeTransport("127.0.0.1", engine=_Stand())
    assert t.handoff == "lists"
    assert "not Mooncake's" in t.handoff_reason


def test_native_true_refuses_a_stand_in() -> None:
    with pytest.raises(ImportError, match="native Mooncake hand-off unavailable"):
        MooncakeTransport("127.0.0.1", engine=_Stand(), native=True)


def test_native_false_and_the_environment_switch_select_lists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert MooncakeTransport("127.0.0.1", engine=_Stand(), native=False).handoff == "lists"
    monkeypatch.setenv("KVPLAN_MOONCAKE_NATIVE", "0")
    t = MooncakeTransport("127.0.0.1", engine=_Stand())
    assert t.handoff == "lists" and "disabled" in t.handoff_reason


def _blocks(n: int, size: int, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """``n`` blocks of 1..``size`` bytes from distinct source slots to shuffled destination
    slots (offsets into arenas of ``capacity`` slots of ``size`` bytes)."""
    rng = np.random.default_rng(seed)
    src_slots = rng.permutation(capacity)[:n].astype(np.uint64)
    dst_slots = rng.permutation(capacity)[:n].astype(np.uint64)
    lengths = rng.integers(1, size + 1, n).astype(np.uint64)
    return src_slots * np.uint64(size), dst_slots * np.uint64(size), lengths


@mooncake
@pytest.mark.parametrize("path", ["native", "lists"])
@pytest.mark.parametrize("mode", ["submit_raw", "submit_async_raw"])
def test_blocks_land_byte_exact_through_each_handoff(mooncake_env: None, path: str, mode: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """2,500 blocks of random lengths (three batches, over Mooncake's per-call TCP limit) land
    exactly, through the native request array or through the binding's lists; bytes outside
    them keep the sentinel."""
    from support.engine_peers import cluster

    if path == "lists":
        monkeypatch.setenv("KVPLAN_MOONCAKE_NATIVE", "0")
    decode, prefill = raw_pair(pages=4096, item=256)
    src, dst, lengths = _blocks(2500, 256, 4096, seed=11)
    with cluster(decode, [prefill]) as c:
        d = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        stats = c.peers["prefill"].call(mode, d.session, src, np.uint64(d.base) + dst, lengths,
                                        timeout=120)
        handoff, reason = c.peers["prefill"].call("handoff", timeout=10)
        # The blocks as memmoves between the arenas (offsets as addresses).
        want = Memory(before, 0)
        apply_plan(BlockSlice(src, dst, lengths), Memory(c.arenas["prefill"].array, 0), want)
        np.testing.assert_array_equal(c.arenas["decode"].array, want.data)
    assert (handoff, reason if path == "native" else "") == (path, "")
    if path == "lists":
        assert "disabled" in reason
    assert stats["blocks"] == 2500 and stats["batches"] == 3
    assert stats["bytes"] == int(lengths.sum())


@mooncake
def test_native_failure_is_a_transfer_error_and_the_engine_recovers(mooncake_env: None) -> None:
    """A destination outside the peer's registered memory fails the native batch with status
    -1; nothing lands, and the next good native write works."""
    from kvplan.engines import TransferError
    from support.engine_peers import cluster

    decode, prefill = raw_pair()
    with cluster(decode, [prefill]) as c:
        d, p = c.peers["decode"], c.peers["prefill"]
        before = c.arenas["decode"].array.copy()
        outside = d.base + decode.size + (1 << 20)
        with pytest.raises(TransferError) as info:
            p.call("submit_async_raw", d.session, [0, 4096], [outside, outside + 4096],
                   [4096, 4096], timeout=30)
        assert info.value.status == -1 and info.value.blocks == 2
        np.testing.assert_array_equal(c.arenas["decode"].array, before)
        p.call("submit_raw", d.session, [4096], [d.base + 8192], [4096], timeout=30)
        assert p.call("handoff", timeout=10)[0] == "native"
        np.testing.assert_array_equal(c.arenas["decode"].array[8192:12288],
                                      c.arenas["prefill"].array[4096:8192])


# ---------------------------------------------------------------------------------------------
# The binding class against a real engine in this process
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def engine(mooncake_env: None) -> Any:
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e


def _native(engine: Any, version: str | None = None) -> Any:
    import mooncake.engine

    from kvplan._core import MooncakeNative

    return MooncakeNative(engine, mooncake.engine.__file__,
                          version or MooncakeNative.VERIFIED_VERSION)


@mooncake
def test_native_refuses_an_unverified_version(engine: Any) -> None:
    with pytest.raises(ImportError, match="verified against 0.3.13.post1, not 0.3.12"):
        _native(engine, "0.3.12")


@mooncake
def test_native_write_to_own_segment_and_batch_waited_once(engine: Any) -> None:
    buf = np.zeros(1 << 16, np.uint8)
    buf[:32768] = np.random.default_rng(3).integers(0, 256, 32768, dtype=np.uint8)
    base = buf.ctypes.data
    assert engine.register_memory(base, buf.nbytes) == 0
    try:
        native = _native(engine)
        session = f"127.0.0.1:{engine.get_rpc_port()}"
        src = np.uint64(base) + np.arange(0, 32768, 1024, dtype=np.uint64)[::-1].copy()
        dst = np.uint64(base + 32768) + np.arange(0, 32768, 1024, dtype=np.uint64)
        lengths = np.full(32, 1024, np.uint64)
        batch = native.submit(session, src, dst, lengths)
        assert len(batch) == 32
        batch.wait(10.0)
        assert len(batch) == 0
        with pytest.raises(RuntimeError, match="already waited"):
            batch.wait(10.0)
        want = buf[:32768].reshape(32, 1024)[::-1].reshape(-1)
        np.testing.assert_array_equal(buf[32768:], want)
        with pytest.raises(ValueError, match="2 sources, 1 destinations and 1 lengths"):
            native.write(session, src[:2], dst[:1], lengths[:1], 5.0)
        with pytest.raises(ValueError, match="C-contiguous"):
            native.write(session, src[::2], dst[::2], lengths[::2], 5.0)
        with pytest.raises(ValueError, match="timeout_s"):
            native.write(session, src, dst, lengths, -1.0)
    finally:
        engine.unregister_memory(base)


@mooncake
def test_transport_self_test_passes_and_selects_native(mooncake_env: None) -> None:
    t = MooncakeTransport("127.0.0.1")
    try:
        assert t.handoff == "native"
        assert t._native_ready() is not None  # runs the self-test transfer
        assert (t.handoff, t.handoff_reason) == ("native", "")
    finally:
        t.close()
    assert os.environ.get("KVPLAN_MOONCAKE_NATIVE") is None
