"""Staged transfers in kvplan's vLLM NIXL connector (pull mode; docs/staging.md "Pull mode",
docs/vllm.md "Staged transfers").

vLLM's NIXL connector pulls: the decode READs the prefill's blocks through its NIXL agent, then
notifies the prefill, which frees them. With ``kvplan_staging`` on, each worker keeps the same
:class:`kvplan.compat.vllm.staging.WorkerStaging` the Mooncake connector keeps
(:func:`kvplan.compat.vllm.connector.start_staging`), its arena registered with the worker's
NIXL agent in the connector's constructor: before ``register_kv_caches`` takes the agent's
metadata, so the metadata a decode loads already covers the prefill's arena and a READ of it
needs nothing more from the prefill.

* :func:`advertise_staging`: the worker's staging message goes into the agent metadata its
  handshake serves (``agent_metadata_bytes``, a msgpack map), under
  :data:`kvplan.compat.vllm.staging.META_KEY`, next to the layout identity; a decode without
  kvplan decodes the map with vLLM's ``NixlAgentMetadata``, which skips the key.
* :func:`negotiate_peer`: the decode's ``add_remote_agent`` negotiates with the prefill's
  message once per prefill engine and rank (:meth:`WorkerStaging.agreement`: the agreement or
  the direct path's reason said once per peer) and keeps the outcome with the name NIXL gave
  the prefill's agent (:func:`peer_agreement`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvplan.staging import DirectFallback, Negotiated

__all__ = ["NixlPeer", "advertise_staging", "negotiate_peer", "peer_agreement",
           "start_staging", "worker_staging"]

_staging_log = logging.getLogger("vllm.kvplan.staging")

#: The worker attribute holding the decode's outcome per prefill engine and rank.
PEERS_ATTR = "_kvplan_staging_peers"


@dataclass(frozen=True)
class NixlPeer:
    """What the decode knows about one prefill rank once its agent is added: the outcome of
    the negotiation, the name NIXL gave the prefill's agent (what a READ names), and the
    prefill's staging message (its channel address)."""

    outcome: Negotiated
    agent: str | bytes
    message: dict[str, Any] | None


def worker_staging(worker: Any) -> Any:
    """The worker's :class:`kvplan.compat.vllm.staging.WorkerStaging` (None: staging off)."""
    from kvplan.compat.vllm.staging import STAGING_ATTR

    return worker.__dict__.get(STAGING_ATTR)


def start_staging(worker: Any, options: dict[str, Any]) -> Any:
    """The NIXL worker's staging start-up (the connector's constructor): with a
    ``kvplan_staging`` key other than ``off``, the arena registered with the worker's NIXL
    agent (``nixl_wrapper``), the engine's costs (given, else for ``auto`` NIXL's measured on
    loopback) and the one start-up line; None and nothing allocated otherwise."""
    from kvplan.compat.vllm.staging import start_staging as start

    def setup(state: Any) -> None:
        state.name = str(worker.__dict__.get("engine_id") or "")

    return start(worker, options, engine=worker.nixl_wrapper, cost_engine="nixl", setup=setup)


def advertise_staging(worker: Any) -> bool:
    """Add the worker's staging message to the agent metadata its handshake serves (after
    vLLM's ``register_kv_caches`` built it); whether it did: not with staging off, not before
    the metadata exists, and not for a worker whose KV cache is not host memory (the rounds'
    gather and scatter run on host memory here: its peers keep the direct path)."""
    from kvplan.compat.vllm.nixl_metadata import add_to_agent_metadata
    from kvplan.compat.vllm.staging import META_KEY, host_kv

    state = worker_staging(worker)
    if state is None or not host_kv(worker):
        return False
    return add_to_agent_metadata(worker, META_KEY, state.capabilities())


def negotiate_peer(worker: Any, metadata: Any, remote_rank: int,
                   agent: str | bytes) -> Negotiated | None:
    """The decode's negotiation with the prefill whose agent metadata is ``metadata`` (its
    rank ``remote_rank``, its agent added under the name ``agent``): the outcome, kept for
    :func:`peer_agreement` and said once per peer; None with staging off here."""
    from kvplan.compat.vllm.staging import META_KEY, host_kv

    state = worker_staging(worker)
    if state is None:
        return None
    engine = str(getattr(metadata, "engine_id", "?"))
    message = getattr(metadata, META_KEY, None)
    peer = f"engine {engine}"
    outcome: Negotiated
    if not host_kv(worker):
        outcome = DirectFallback("this decode's KV cache is not host memory")
        state.fallbacks.note(peer, outcome)
    else:
        outcome = state.agreement(peer, message, sending=False, remote_rank=remote_rank)
    peers = worker.__dict__.setdefault(PEERS_ATTR, {})
    peers[(engine, int(remote_rank))] = NixlPeer(
        outcome, agent, message if isinstance(message, dict) else None)
    return outcome


def peer_agreement(worker: Any, engine: str, remote_rank: int) -> NixlPeer | None:
    """What :func:`negotiate_peer` kept for the prefill ``engine``'s rank ``remote_rank``
    (None: its agent was not added with staging on here)."""
    peers: dict[tuple[str, int], NixlPeer] = worker.__dict__.get(PEERS_ATTR) or {}
    return peers.get((str(engine), int(remote_rank)))
