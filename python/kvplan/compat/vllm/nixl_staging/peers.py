"""The set-up with a peer: the prefill's advertised staging message, the decode's negotiation.

:func:`advertise_staging` puts the worker's staging message into its agent metadata;
:func:`negotiate_peer` negotiates with each prefill rank's and keeps the outcome
(:func:`peer_agreement`); :func:`vllm_lease_s` reads vLLM's KV lease."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvplan.compat.vllm.nixl_layout import remote_layout
from kvplan.compat.vllm.nixl_staging.names import (
    GROUPS_KEY,
    GROUPS_TP_KEY,
    GROUPS_TP_VERSION,
    GROUPS_VERSION,
    HOLD_GROUPS_KEY,
    HOLD_KEY,
    HOLD_ONE_GROUP,
    HOLD_VERSION,
    LEASE_KEY,
)
from kvplan.compat.vllm.nixl_staging.worker import worker_staging
from kvplan.staging import DirectFallback, Negotiated


#: The worker attribute holding the decode's outcome per prefill engine and rank.
PEERS_ATTR = "_kvplan_staging_peers"
#: vLLM's ``kv_transfer_config`` key of the prefill's KV lease, and its default (every release
#: kvplan's NIXL connector supports).
VLLM_LEASE_OPTION, VLLM_DEFAULT_LEASE_S = "kv_lease_duration", 30.0


def vllm_lease_s(vllm_config: Any) -> float | None:
    """The KV lease in seconds vLLM's NIXL worker keeps with ``vllm_config`` (its
    ``kv_connector_extra_config``'s ``kv_lease_duration``, default 30); None when it is not a
    finite number greater than 0 (the staging timeout applies then)."""
    import math

    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None)
    value = (extra if isinstance(extra, dict) else {}).get(VLLM_LEASE_OPTION,
                                                           VLLM_DEFAULT_LEASE_S)
    try:
        lease = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None
    return lease if lease is not None and math.isfinite(lease) and lease > 0 else None


@dataclass(frozen=True)
class NixlPeer:
    """What the decode knows about one prefill rank once its agent is added: the outcome of
    the negotiation, the name NIXL gave the prefill's agent (what a READ names), and the
    prefill's staging message (its channel address)."""

    outcome: Negotiated
    agent: str | bytes
    message: dict[str, Any] | None
    #: The prefill rank's KV regions (:func:`remote_layout`; None: no staged read).
    layout: Any = None


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
    message = state.capabilities()
    message[HOLD_KEY] = HOLD_ONE_GROUP  # this listener answers held checks: form 1, which
    message[HOLD_GROUPS_KEY] = HOLD_VERSION  # every decode knows, and form 2 beside it
    message[GROUPS_KEY] = GROUPS_VERSION  # staged reads of several KV groups
    message[GROUPS_TP_KEY] = GROUPS_TP_VERSION  # and of them between TP sizes
    if state.lease_s is not None:  # how long both sides wait for a round
        message[LEASE_KEY] = state.lease_s
    return add_to_agent_metadata(worker, META_KEY, message)


def negotiate_peer(worker: Any, metadata: Any, remote_rank: int, agent: str | bytes,
                   remote_tp_size: int = 1) -> Negotiated | None:
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
    layout = remote_layout(worker, metadata, remote_rank, remote_tp_size) \
        if outcome.staged else None
    peers[(engine, int(remote_rank))] = NixlPeer(
        outcome, agent, message if isinstance(message, dict) else None, layout)
    return outcome


def peer_agreement(worker: Any, engine: str, remote_rank: int) -> NixlPeer | None:
    """What :func:`negotiate_peer` kept for the prefill ``engine``'s rank ``remote_rank``
    (None: its agent was not added with staging on here)."""
    peers: dict[tuple[str, int], NixlPeer] = worker.__dict__.get(PEERS_ATTR) or {}
    return peers.get((str(engine), int(remote_rank)))
