"""Exceptions defined in Python (the planning errors come from the native module)."""

from __future__ import annotations

from kvplan._core import KvPlanError

__all__ = ["ConfigError", "IncompatibleHostError", "IncompatiblePeerError", "TransferError"]


class IncompatibleHostError(KvPlanError):
    """An engine integration refused to install: the host engine's class does not have a
    method (or a helper kvplan's replacement calls) in a form kvplan was built for.

    ``cls`` names the class, ``method`` the method, ``host_version`` the engine's version
    (``"unknown"`` when it publishes none), ``seen`` what the host has (its signature, or
    ``"missing"``) and ``supported`` the forms kvplan knows, each with the releases it was
    checked against. Nothing was replaced: the engine runs exactly as without kvplan, and the
    message says so.
    """

    kind = "incompatible_host"
    cls: str = ""
    method: str = ""
    host_version: str = ""
    seen: str = ""
    supported: tuple[str, ...] = ()


class IncompatiblePeerError(KvPlanError):
    """A peer's layout identity, received at the handshake, is refused by the compatibility
    verdict (docs/identity.md, "At the handshake"): no byte is moved to or from that peer.

    ``peer`` names the peer (its session or address), ``local_class_id`` and
    ``peer_class_id`` the two class ids, ``local_role`` this side's role (``"prefill"`` or
    ``"decode"``), ``refused_by`` what refused (``"semantics"``, a planner error's kind,
    ``"conversion"`` for a conversion the drop-in's path does not make, or ``"identity"``
    for an identity that does not parse or whose ids are not what its fields give) and
    ``reason`` the verdict's words naming both values.
    """

    kind = "incompatible_peer"
    peer: str = ""
    local_class_id: str = ""
    peer_class_id: str = ""
    local_role: str = ""
    refused_by: str = ""
    reason: str = ""


class TransferError(RuntimeError):
    """A transfer engine returned a non-zero status or raised.

    Adapters in :mod:`kvplan.engines` set ``engine``, ``session``, ``batch``, ``blocks``,
    ``bytes`` and ``status`` on the instance and name them in the message; the NIXL adapter
    also sets ``agent`` (its own agent name) and ``state`` (the request's last state, e.g.
    ``"ERR"``, ``"PROC (timed out)"`` or ``"initialize_xfer: NIXL_ERR_NOT_FOUND"``). After a failure,
    some blocks of the batch may have landed and others may still be in flight: do not reuse
    the buffers until the session is torn down or the peer is known dead.

    The streaming submitter (:mod:`kvplan.engines.streaming`) also sets ``request``, ``slice``
    (the slice index, or ``"seal"``), ``group`` and ``layers`` of the slice that failed, and
    ``layer`` when a layer's ready event failed. ``Transport.submit_batch`` sets ``requests``,
    the indices of the batch's requests whose blocks the failed call held; so does a streamed
    batch's failed call, with ``slices`` (every slice index the call sent, ``None`` for the
    seal). ``peer_gone`` is set where the peer was seen gone when the failure was raised (its
    side channel had closed): the failure is the peer's going, not this side's engine.
    """

    engine: str | None = None
    session: str | None = None
    batch: int | None = None
    blocks: int | None = None
    bytes: int | None = None
    status: int | None = None
    agent: str | None = None
    state: str | None = None
    request: str | None = None
    slice: int | str | None = None
    group: int | None = None
    layers: list[int] | None = None
    layer: int | None = None
    requests: list[int] | None = None
    slices: list[int] | None = None
    peer_gone: bool = False


class ConfigError(KvPlanError):
    """A kvplan option the host engine's configuration passes is unknown or has a bad value
    (for vLLM: a ``kv_connector_extra_config`` key beginning with ``kvplan``). ``option``
    names it, ``value`` is what was given and ``known`` lists the options this connector
    takes. Raised before the connector starts anything."""

    kind = "config"
    option: str = ""
    value: object = None
    known: tuple[str, ...] = ()
