"""``StagingArena``: page-aligned host memory split into round buffers, registered once with
the transfer engine (stand-ins for the refusals, the real Mooncake engine for the rest)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvplan import ConfigError, TransferError
from kvplan.staging import PAGE, StagingArena, StagingConfig

MiB = 1 << 20


def test_page_aligned_buffers_of_the_configured_size() -> None:
    a = StagingArena.from_config(StagingConfig(arena_mib=2, buffers=4))
    assert a.addr % PAGE == 0 and a.size == 2 * MiB and a.buffers == 4
    assert a.buffer_bytes == MiB // 2 and a.region == (a.addr, 2 * MiB)
    assert a.array.nbytes == a.size and a.array.flags.writeable
    for k in range(6):
        view = a.buffer(k)
        assert view.ctypes.data == a.addr + (k % 4) * a.buffer_bytes
        assert view.ctypes.data % PAGE == 0 and view.nbytes == a.buffer_bytes
    odd = StagingArena(10 * PAGE + 5, 3)  # rounded down to whole page-aligned buffers
    assert odd.buffer_bytes == 3 * PAGE and odd.size == 9 * PAGE
    assert not odd.registered and "unregistered" in repr(odd)


@pytest.mark.parametrize("size, buffers, option", [
    (MiB, 0, "buffers"), (MiB, 65, "buffers"), (MiB, True, "buffers"),
    (PAGE, 2, "size"), (-1, 1, "size"), (1.5 * MiB, 2, "size"),
])
def test_bad_sizes_are_config_errors(size: Any, buffers: Any, option: str) -> None:
    with pytest.raises(ConfigError) as exc:
        StagingArena(size, buffers)
    assert exc.value.option == option and option in str(exc.value)


class StandInMooncake:
    """Mooncake's registration calls, with a chosen status."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.calls: list[tuple[str, int, int]] = []

    def get_rpc_port(self) -> int:
        return 15000

    def register_memory(self, addr: int, size: int) -> int:
        self.calls.append(("register", addr, size))
        return self.status

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister", addr, 0))
        return 0


class StandInNixlAgent:
    """The two calls of ``nixl_agent`` an arena makes."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def register_memory(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> Any:
        self.calls.append(("register", descs, mem_type))
        return ("descs", descs[0][0])

    def deregister_memory(self, descs: Any) -> None:
        self.calls.append(("deregister", descs))


def test_registration_with_each_engine_kind_once() -> None:
    a = StagingArena(MiB, 2)
    mc = StandInMooncake()
    assert a.register(mc) == "mooncake" and a.register(mc) == "mooncake"
    assert mc.calls == [("register", a.addr, MiB)] and a.registered
    with pytest.raises(ConfigError, match="already registered with mooncake"):
        a.register(StandInMooncake())
    a.close()
    assert mc.calls[-1] == ("unregister", a.addr, 0) and not a.registered
    agent = StandInNixlAgent()
    assert a.register(agent) == "nixl"
    assert agent.calls == [("register", [(a.addr, MiB, 0, "")], "DRAM")]
    a.unregister()
    assert agent.calls[-1] == ("deregister", ("descs", a.addr))


def test_a_refused_registration_is_a_transfer_error_naming_the_status() -> None:
    a = StagingArena(MiB, 2)
    with pytest.raises(TransferError) as exc:
        a.register(StandInMooncake(status=-7))
    assert exc.value.status == -7 and exc.value.engine == "mooncake"
    assert f"{a.addr:#x}" in str(exc.value) and not a.registered
    with pytest.raises(ConfigError, match="cannot register with object"):
        a.register(object())


@pytest.mark.mooncake
def test_registered_with_real_mooncake_receives_a_write(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A real engine registers the arena (directly, through a ``Handoff`` and through a
    ``MooncakeTransport``); a second engine writes into it and the bytes land."""
    from support.engine_peers import require_mooncake

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    from mooncake.engine import TransferEngine

    from kvplan.engines import MooncakeTransport
    from kvplan.engines.mooncake import Handoff

    engines = []
    for _ in range(2):
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        engines.append(e)
    sender, receiver = engines
    src = np.random.default_rng(3).integers(0, 256, 3 * PAGE, dtype=np.uint8)
    assert sender.register_memory(src.ctypes.data, src.nbytes) == 0
    arena = StagingArena(MiB, 2)
    via_handoff = StagingArena(MiB, 2)
    try:
        assert arena.register(receiver) == "mooncake"
        assert via_handoff.register(Handoff(receiver, None, native=False)) == "mooncake"
        session = f"127.0.0.1:{receiver.get_rpc_port()}"
        dst = arena.addr + arena.buffer_bytes + 100
        assert sender.batch_transfer_sync_write(session, [src.ctypes.data], [dst],
                                                [src.nbytes]) == 0
        np.testing.assert_array_equal(arena.buffer(1)[100:100 + src.nbytes], src)
    finally:
        arena.close()
        via_handoff.close()
        sender.unregister_memory(src.ctypes.data)
    transport = MooncakeTransport("127.0.0.1", native=False)
    with StagingArena(MiB, 2) as owned:
        assert owned.register(transport) == "transport"
        assert transport.registered_regions == [owned.region]
    transport.close()
