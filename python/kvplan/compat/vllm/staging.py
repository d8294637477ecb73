"""Staged transfers in kvplan's vLLM Mooncake drop-in (docs/staging.md, docs/vllm.md "Staged
transfers").

Each worker with staging on keeps a :class:`WorkerStaging`: its arena, registered with the
worker's Mooncake engine at start-up, the capabilities it advertises, the outcome of the
negotiation per peer rank, a :class:`kvplan.staging.Router` for the round protocol's messages
and, on the decode, one :class:`kvplan.staging.ArenaShares`.

The prefill's ``_build_transfer_params`` (kvplan's) asks :func:`staged_requests` which of the
ready requests go staged: those whose decode advertised a staging message
(``agent_meta.kvplan_staging``) that negotiates to an agreement, whose blocks use one KV group,
and for which :func:`kvplan.staging.choose_path` says staged. Each of them is sent by
:func:`send_request` instead of being part of the direct columns; a
:class:`kvplan.staging.StagingError` puts the request into vLLM's own ``err_reqs`` (the
decode's failed-receive path for that release). The decode opens the stream from the
prefill's opening message (:func:`open_message`, handled by :meth:`WorkerStaging.on_open`),
plans its own rounds from the template the prefill planned with and scatters each round into
its KV cache; the prefill's send returns only after the decode acknowledged the last round's
scatter, so vLLM's done message for the request comes after every byte is in place.

The messages go through a :class:`Channel` the worker holds per decode peer
(``WorkerStaging.channels``): vLLM's Mooncake side channel decodes every frame as its own
msgspec message on both ends, so it cannot carry the round protocol's frames.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import kvplan
from kvplan.staging import (
    ArenaShares,
    Capabilities,
    DirectFallback,
    FallbackLog,
    Negotiated,
    ReceiveStaged,
    Router,
    SendReport,
    StagingAgreement,
    StagingArena,
    StagingConfig,
    StagingError,
    choose_path,
    local_copy,
    negotiate,
    send_staged,
)

__all__ = ["Channel", "StagedRequest", "WorkerStaging", "kv_buffers", "open_message",
           "send_request", "staged_requests"]

logger = logging.getLogger("kvplan.compat.vllm")

#: Worker attribute holding its :class:`WorkerStaging` (absent: staging off, vLLM's path).
STAGING_ATTR = "kvplan_staging"
#: The key of the staging message in the decode's pull metadata.
META_KEY = "kvplan_staging"
#: Largest opening message accepted (the template's two layouts and the request's pages).
MAX_OPEN_BYTES = 64 << 20


class Channel(Protocol):
    """A worker's messages to one peer: round-protocol frames and the opening message."""

    def send(self, data: bytes) -> object: ...

    def open(self, data: bytes) -> object: ...


@dataclass
class WorkerStaging:
    """One worker's staging state (see the module docstring)."""

    config: StagingConfig
    arena: StagingArena
    rank: int
    router: Router = field(default_factory=Router)
    shares: ArenaShares = field(default_factory=ArenaShares)
    fallbacks: FallbackLog = field(default_factory=FallbackLog)
    costs: Any = None
    #: This worker's name in its opening messages (its Mooncake session).
    name: str = ""
    #: Decode peer session -> the channel to it (prefill side).
    channels: dict[str, Channel] = field(default_factory=dict)
    #: The prefill's channel back, by the peer name its opening message gives (decode side).
    replies: dict[str, Callable[[bytes], object]] = field(default_factory=dict)
    #: Streams opened on the decode, by request id.
    receivers: dict[str, ReceiveStaged] = field(default_factory=dict)
    _agreements: dict[tuple[str, int, bool], Negotiated] = field(default_factory=dict)

    @classmethod
    def start(cls, worker: Any, config: StagingConfig, *, rank: int | None = None,
              engine: Any = None) -> WorkerStaging:
        """The arena of ``config`` registered with ``engine`` (the worker's Mooncake engine by
        default): :class:`kvplan.TransferError` when the engine refuses it."""
        arena = StagingArena.from_config(config)
        arena.register(engine if engine is not None else worker.engine)
        return cls(config, arena, int(worker.tp_rank if rank is None else rank))

    def capabilities(self) -> dict[str, Any]:
        """The message this worker adds to its handshake."""
        return Capabilities.local([self.arena.info(self.rank)]).to_dict()

    def agreement(self, peer: str, remote: Any, *, sending: bool,
                  remote_rank: int) -> Negotiated:
        """:func:`kvplan.staging.negotiate` with ``peer``'s message (None: the peer sent
        none), once per peer, rank and direction; each outcome logged once per peer."""
        key = (peer, remote_rank, sending)
        outcome = self._agreements.get(key)
        if outcome is None:
            if self.config.mode == "off":
                outcome = DirectFallback("staging is off here")
            else:
                outcome = negotiate(Capabilities.local([self.arena.info(self.rank)]),
                                    _as_message(remote), sending=sending,
                                    local_rank=self.rank, remote_rank=remote_rank)
            self._agreements[key] = outcome
            self.fallbacks.note(peer, outcome)
        return outcome

    # ------------------------------------------------------------------ decode side
    def on_open(self, worker: Any, data: bytes, reply: Callable[[bytes], object]) -> None:
        """The prefill's opening message for one stream: plan the decode's own rounds from
        the template it names and open the stream on the router. A message this decode
        cannot plan from fails the stream: the prefill is told through ``reply``."""
        opening = _read_open(data)
        request, writer = opening["stream"], int(opening["writer"])
        try:
            rounds = _decode_rounds(self, opening)
        except (kvplan.KvPlanError, StagingError, KeyError, TypeError, ValueError) as exc:
            # the prefill waits for the grant: a failure message ends its send at once
            from kvplan.staging.wire import FAIL, encode

            logger.error("kvplan staging: cannot plan %r from the prefill's message: %s",
                         request, exc)
            reply(encode(FAIL, request, writer=writer, round_index=0,
                         payload=f"bad_message: {type(exc).__name__}: {exc}".encode()[:4096]))
            return
        receiver = ReceiveStaged(
            request, rounds, local_copy([self.arena.array], kv_buffers(worker)), reply,
            writer=writer, timeout_s=self.config.timeout_s)
        self.receivers[request] = receiver
        self.router.open(request, writer, receiver.on_message)
        self.shares.admit(receiver)


def _as_message(remote: Any) -> Any:
    return remote if remote is None or isinstance(remote, (bytes, Capabilities)) else \
        json.dumps(remote).encode() if isinstance(remote, dict) else remote


def kv_buffers(worker: Any) -> list[np.ndarray]:
    """The worker's registered KV buffers (host memory) as uint8 arrays over their bytes, for
    a round's gather or scatter (which checks every block against them)."""
    from kvplan.compat.vllm.templates import _buffer_sources, _buffer_table

    table = _buffer_table(_buffer_sources(worker))
    if not table:
        raise kvplan.LayoutError(
            "kvplan staging: the worker registered no KV buffers whose lengths are known; "
            "staged rounds gather and scatter only within registered host buffers")
    return [np.ctypeslib.as_array((ctypes.c_uint8 * int(n)).from_address(int(p)))
            for p, n in table]


@dataclass(frozen=True)
class StagedRequest:
    """One ready request the prefill sends staged."""

    request: str
    template: Any
    layouts: tuple[Any, Any]
    src_pages: np.ndarray
    dst_pages: np.ndarray
    agreement: StagingAgreement
    why: str


def staged_requests(worker: Any, agent_meta: Any, peer: Any,
                    ids_by_request: dict[str, list[tuple[Any, Any] | None]]
                    ) -> dict[str, StagedRequest]:
    """The requests (by id) of ``ids_by_request`` (each request's ids per template of
    ``peer``) that go staged to ``agent_meta``'s decode; every other request keeps vLLM's
    direct path."""
    staging: WorkerStaging | None = worker.__dict__.get(STAGING_ATTR)
    if staging is None or peer.error is not None:
        return {}
    session = f"{agent_meta.remote_hostname}:{agent_meta.remote_port}"
    remote = getattr(agent_meta, META_KEY, None)
    outcome = staging.agreement(session, remote, sending=True,
                                remote_rank=int(agent_meta.remote_tp_rank))
    if not isinstance(outcome, StagingAgreement) or session not in staging.channels:
        return {}
    out = {}
    for request, per_group in ids_by_request.items():
        used = [(g, ids) for g, ids in enumerate(per_group) if ids is not None]
        if len(used) != 1:  # a request over several KV groups: one stream per group is not
            continue        # planned here, so it keeps the direct path
        g, (local, remote_ids) = used[0]
        template = peer.groups[g][2]
        src = kvplan._core.index_array(local)
        dst = kvplan._core.index_array(remote_ids)
        choice = choose_path(template, (src, dst), staging.costs, outcome,
                             mode=staging.config.mode)
        if choice.staged:
            out[request] = StagedRequest(request, template, peer.layouts[g], src, dst,
                                         outcome, choice.why)
    return out


def open_message(staged: StagedRequest, *, stream: str, peer: str, rank: int,
                 capabilities: dict[str, Any], writer: int = 0) -> bytes:
    """The prefill's opening message for one stream: its name, rank and staging message (the
    decode negotiates with it as the prefill did with the decode's), the template's two
    layouts and the request's pages, from which the decode plans the same rounds."""
    src_layout, dst_layout = staged.layouts
    return json.dumps({"stream": stream, "writer": writer, "peer": peer, "rank": rank,
                       "capabilities": capabilities,
                       "src_layout": src_layout.to_dict(), "dst_layout": dst_layout.to_dict(),
                       "src_pages": staged.src_pages.tolist(),
                       "dst_pages": staged.dst_pages.tolist()},
                      separators=(",", ":")).encode()


def _read_open(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_OPEN_BYTES:
        raise kvplan.ConfigError(f"kvplan staging: an opening message of {len(data)} bytes "
                                 f"exceeds {MAX_OPEN_BYTES}")
    opening = json.loads(data)
    if not isinstance(opening, dict) or not isinstance(opening.get("stream"), str):
        raise kvplan.ConfigError("kvplan staging: the opening message names no stream")
    return opening


def _decode_rounds(staging: WorkerStaging, opening: dict[str, Any]) -> Any:
    template = kvplan.Template(kvplan.Layout.from_dict(opening["src_layout"]),
                               kvplan.Layout.from_dict(opening["dst_layout"]),
                               kvplan.Pairing.positional())
    src = np.asarray(opening["src_pages"], np.int64)
    dst = np.asarray(opening["dst_pages"], np.int64)
    agreement = staging.agreement(str(opening["peer"]), opening["capabilities"],
                                  sending=False, remote_rank=int(opening["rank"]))
    if not isinstance(agreement, StagingAgreement):
        raise StagingError.make(opening["stream"], 0, "bad_message",
                                f"no staging agreement with {opening['peer']}: "
                                f"{agreement.reason}", writer=int(opening["writer"]))
    return template.plan_rounds(src, dst, src_arena=agreement.src_arena,
                                dst_arena=staging.arena.region, buffers=agreement.buffers)


def send_request(worker: Any, staged: StagedRequest, session: str, *,
                 engine: Any) -> SendReport:
    """Send one request staged to the decode at ``session``: the opening message, then
    :func:`kvplan.staging.send_staged` through ``engine`` (a round engine over the worker's
    Mooncake hand-off). Raises :class:`kvplan.staging.StagingError`."""
    staging: WorkerStaging = worker.__dict__[STAGING_ATTR]
    channel = staging.channels[session]
    stream = f"{staged.request}@tp{worker.tp_rank}"
    rounds = staged.template.plan_rounds(staged.src_pages, staged.dst_pages,
                                         src_arena=staged.agreement.src_arena,
                                         dst_arena=staged.agreement.dst_arena,
                                         buffers=staged.agreement.buffers)
    try:
        channel.open(open_message(staged, stream=stream, peer=staging.name or session,
                                  rank=staging.rank, capabilities=staging.capabilities()))
    except Exception as exc:
        raise StagingError.make(stream, 0, "peer_gone",
                                f"opening the stream failed: {type(exc).__name__}: {exc}"
                                ) from exc
    return send_staged(rounds, engine, session, channel.send, request=stream,
                       acks=staging.router, writer=0,
                       gather=local_copy(kv_buffers(worker), [staging.arena.array]),
                       buffers=staged.agreement.buffers, src_lock=staging.arena.lock,
                       timeout_s=staging.config.timeout_s)
