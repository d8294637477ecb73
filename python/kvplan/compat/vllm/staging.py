"""Staged transfers in kvplan's vLLM Mooncake drop-in (docs/staging.md, docs/vllm.md "Staged
transfers").

Each worker with staging on keeps a :class:`WorkerStaging`: its arena, registered with the
worker's Mooncake engine at start-up, the capabilities it advertises, the outcome of the
negotiation per peer rank, a :class:`kvplan.staging.Router` for the round protocol's messages
and, on the decode, one :class:`kvplan.staging.ArenaShares`.

The prefill's ``_build_transfer_params`` (kvplan's) asks :func:`staged_requests` which of the
ready requests go staged: those whose decode advertised a staging message
(``agent_meta.kvplan_staging``) that negotiates to an agreement and for which
:func:`kvplan.staging.choose_path` says staged. A request over several KV groups (a hybrid
model's) is one stream of one request of every group's pages
(:class:`kvplan.compat.vllm.grouped.GroupedRead`), to a decode whose message says it takes
them (:data:`GROUPS_KEY`); to any other it keeps the direct path, said once per peer. Each of them is sent by
:func:`send_request` instead of being part of the direct columns; a
:class:`kvplan.staging.StagingError` puts the request into vLLM's own ``err_reqs`` (the
decode's failed-receive path for that release). The decode opens the stream from the
prefill's opening message (:func:`open_message`, handled by :meth:`WorkerStaging.on_open`),
plans its own rounds from the template the prefill planned with and scatters each round into
its KV cache; the prefill's send returns only after the decode acknowledged the last round's
scatter, so vLLM's done message for the request comes after every byte is in place.

The messages go through a :class:`Channel` the worker holds per decode peer
(``WorkerStaging.channels``): kvplan's own TCP connection (:class:`ChannelServer` on the
decode, its address in the decode's staging message; :class:`TcpChannel` on the prefill). vLLM's
Mooncake side channel cannot carry them: both of its ends decode every frame as one of vLLM's
msgspec messages (the prefill's listener as a pull request, the decode's pull loop as a
response), so a round message would be an error there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

import kvplan
from kvplan.failures import FailureVerdict, verdict_for_unscattered_rounds
from kvplan.compat.vllm.grouped import (
    GROUP_PAGES_KEY,
    GROUP_REGIONS_KEY,
    GroupedRead,
    said_unstaged,
)
from kvplan.compat.vllm.semantics import (
    memory_order,
    regions_layout,
    worker_roles,
    worker_semantics,
)
from kvplan.identity import IDENTITY_KEY, ModelSemantics, PeerCheck
from kvplan.staging import (
    AckQueue,
    ArenaShares,
    Capabilities,
    ChannelError,
    DirectFallback,
    FallbackLog,
    FrameConnection,
    FrameListener,
    Framing,
    Negotiated,
    ReceiveStaged,
    Router,
    SendReport,
    StagingAgreement,
    StagingArena,
    StagingConfig,
    StagingError,
    choose_path,
    host_memory,
    host_views,
    local_copy,
    negotiate,
    send_staged,
)

__all__ = ["Channel", "ChannelServer", "StagedRequest", "TcpChannel", "WorkerStaging", "kv_buffers", "open_message",
           "report_unwritten", "send_request", "staged_requests", "start_staging",
           "track_stream", "manifest_layout", "worker_identity", "worker_roles",
           "worker_semantics"]

logger = logging.getLogger("kvplan.compat.vllm")

#: Worker attribute holding its :class:`WorkerStaging` (absent: staging off, vLLM's path).
STAGING_ATTR = "kvplan_staging"
#: The key of the staging message in the decode's pull metadata.
META_KEY = "kvplan_staging"
#: Negotiation outcomes kept (peer, rank, direction and message; the oldest dropped first).
MAX_AGREEMENTS = 1024
#: Ended decode streams kept for inspection (:meth:`WorkerStaging.stream`), and the streams
#: each connection opened kept for its end (:func:`keep_recent`).
KEEP_FINISHED = 1024
#: Seconds between the decode's periodic checks of its open streams.
TICK_S = 0.5
#: Where a worker says each peer's negotiated path (the connector's start-up line's logger).
NEGOTIATION_LOGGER = "vllm.kvplan.staging"
#: Largest opening message accepted (the template's two layouts and the request's pages).
MAX_OPEN_BYTES = 64 << 20
#: Seconds :meth:`WorkerStaging.close` waits for the staging threads to end.
CLOSE_JOIN_S = 5.0
#: The key of a Mooncake worker's staging message (:meth:`WorkerStaging.push_message`) saying
#: it takes a stream of several KV groups (an opening message naming each group's pages and
#: the groups of each region, :class:`kvplan.compat.vllm.grouped.GroupedRead`), and its
#: version. The prefill stages such a request only to a decode whose message gives it, and the
#: decode plans one only from a prefill whose opening message gives it; between any other pair
#: the request keeps the direct path (said once per peer). Requests of one group stage as before.
GROUPS_KEY = "staged_groups"
GROUPS_VERSION = 1
#: What the prefill's line says moves by vLLM's path to a decode without :data:`GROUPS_KEY`.
UNSTAGED_GROUPS = "transfers of several KV groups to"


#: What a listener does with an opening message: ``(worker, data, reply) -> stream name``.
Opener = Callable[[Any, bytes, Callable[[bytes], object]], str]


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
    #: Under vLLM's logger: ``kvplan.staging`` has no handler in a vLLM server, so the
    #: outcome said once per peer would reach no log.
    fallbacks: FallbackLog = field(
        default_factory=lambda: FallbackLog(logging.getLogger(NEGOTIATION_LOGGER)))
    costs: Any = None
    #: This worker's name in its opening messages (its Mooncake session).
    name: str = ""
    #: Decode peer session -> the channel to it (prefill side).
    channels: dict[str, Channel] = field(default_factory=dict)
    #: The prefill's channel back, by the peer name its opening message gives (decode side).
    replies: dict[str, Callable[[bytes], object]] = field(default_factory=dict)
    #: Streams opened on the decode and not yet ended, by stream name (listed by
    #: :meth:`list_stream`; read and changed under :attr:`streams_lock`).
    receivers: dict[str, ReceiveStaged] = field(default_factory=dict)
    #: The most recent ended streams (at most :data:`KEEP_FINISHED`), by stream name.
    finished: OrderedDict[str, ReceiveStaged] = field(default_factory=OrderedDict)
    _failed_at: dict[str, float] = field(default_factory=dict)
    #: Failed streams displaced from :attr:`receivers` by a stream listed under their name,
    #: with the time the check first saw them failed (None: not yet): still polled by
    #: :meth:`tick`, whose poll gives their arena share up, for twice their timeout.
    _retiring: list[tuple[ReceiveStaged, float | None]] = field(default_factory=list)
    #: Guards :attr:`receivers`, :attr:`finished` and the failure times: the periodic check,
    #: the threads opening streams and the channels' ends touch them. Nothing else is taken
    #: or called while it is held (no poll, no router call, no callback), so it orders after
    #: every other lock.
    streams_lock: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                         compare=False)
    _agreements: OrderedDict[tuple[str, int, bool, str], Negotiated] = field(
        default_factory=OrderedDict)
    #: This worker's layout identity and its verdicts on the peers' (None: none sent, none
    #: checked: today's behaviour).
    identity: PeerCheck | None = None
    #: The prefill's KV lease in seconds, as its engine keeps it (None: no lease known): with
    #: no staging timeout given, how long a staged read waits for a round
    #: (:meth:`kvplan.staging.StagingConfig.patience`).
    lease_s: float | None = None

    @classmethod
    def start(cls, worker: Any, config: StagingConfig, *, rank: int | None = None,
              engine: Any = None) -> WorkerStaging:
        """The arena of ``config`` registered with ``engine`` (the worker's Mooncake engine by
        default): :class:`kvplan.TransferError` when the engine refuses it."""
        arena = StagingArena.from_config(config)
        arena.register(engine if engine is not None else worker.engine)
        return cls(config, arena, int(worker.tp_rank if rank is None else rank))

    #: The decode's channel listener (:meth:`serve`), whose address its message carries.
    server: ChannelServer | None = None

    def capabilities(self) -> dict[str, Any]:
        """The message this worker adds to its handshake (with the decode's channel address
        once it serves one)."""
        message = Capabilities.local([self.arena.info(self.rank)]).to_dict()
        if self.server is not None:
            message["channel"] = self.server.address
        return message

    def push_message(self) -> dict[str, Any]:
        """The Mooncake connector's staging message (push mode): :meth:`capabilities` and
        :data:`GROUPS_KEY` (the NIXL connector adds its own keys to :meth:`capabilities`)."""
        return {**self.capabilities(), GROUPS_KEY: GROUPS_VERSION}

    def identity_message(self) -> dict[str, Any] | None:
        """This worker's layout identity as its handshake carries it (None while unknown)."""
        return None if self.identity is None else self.identity.message()

    def check_identity(self, peer: str, sent: Any, *, sending: bool) -> Any:
        """The verdict on ``peer``'s identity ``sent`` (None: it sent none), this worker being
        the prefill when ``sending``: :class:`kvplan.IncompatiblePeerError` when refused;
        None when either side has no identity (today's behaviour)."""
        if self.identity is None:
            return None
        return self.identity.check(peer, sent, local_role="prefill" if sending else "decode")

    def serve(self, worker: Any, host: str = "127.0.0.1", *,
              on_open: Opener | None = None,
              on_close: Callable[[list[str]], object] | None = None) -> ChannelServer:
        """Start the worker's channel listener (once): the decode's in push mode (opening
        messages go to :meth:`on_open`), the prefill's in pull mode (``on_open``: the NIXL
        connector's, which serves the rounds; ``on_close``: given the streams a connection
        opened once it ends, the peer gone)."""
        if self.server is None:
            self.server = ChannelServer(self, worker, host, on_open=on_open,
                                        on_close=on_close)
        return self.server

    def channel_to(self, session: str, remote: Any) -> Channel | None:
        """The prefill's channel to the decode at ``session``: the one kept, else a
        :class:`TcpChannel` to the address in the decode's message (None: it gave none, or
        the connection failed, which is logged)."""
        channel = self.channels.get(session)
        if channel is not None and not getattr(channel, "closed", False):
            return channel
        if channel is not None:  # the connection ended (the decode restarted): connect again
            self.channels.pop(session, None)
        address = remote.get("channel") if isinstance(remote, dict) else None
        if not isinstance(address, str):
            return None
        try:
            channel = TcpChannel(address, self.router, on_close=self._channel_closed)
        except (OSError, ValueError) as exc:
            logger.warning("kvplan staging: no channel to %s at %r (%s): direct path",
                           session, address, exc)
            return None
        self.channels[session] = channel
        return channel

    def _channel_closed(self, channel: TcpChannel) -> None:
        """The channel to a peer ended (it is gone, or restarted): each stream opened on it
        and still receiving fails at once (``peer_gone``), not after the staging timeout; each
        of this prefill's sends on it still open (:func:`send_request`, maybe waiting for the
        decode's grant, which has no timeout of its own) is handed a failure message, as the
        decode's, and ends."""
        from kvplan.staging.wire import FAIL, encode

        for name in channel.streams:
            receiver = self.open_stream(name)
            if receiver is not None:
                if receiver.state == "receiving":
                    receiver.peer_gone(f"the staging channel to the prefill at "
                                       f"{channel.address} closed")
            elif self.router.is_open(name, 0):
                self.router.deliver(encode(
                    FAIL, name, writer=0, round_index=0,
                    payload=f"peer_gone: the staging channel to the decode at "
                            f"{channel.address} closed".encode()[:4096]))

    def stream(self, name: str) -> ReceiveStaged | None:
        """The decode's stream of that name, open or recently ended."""
        with self.streams_lock:
            return self.receivers.get(name) or self.finished.get(name)

    def open_stream(self, name: str) -> ReceiveStaged | None:
        """The decode's open stream of that name (None: none is listed)."""
        with self.streams_lock:
            return self.receivers.get(name)

    def list_stream(self, name: str, receiver: ReceiveStaged) -> None:
        """List ``receiver`` as the open stream ``name`` (for :meth:`tick` to poll), in place
        of any stream listed under that name before: a read of a request again. The failure
        time kept for the name was the stream's before it, never this one's; a failed stream
        displaced so is still polled (:attr:`_retiring`), else the arena share it may still
        hold would never be given up (and a stream queued behind it never granted)."""
        with self.streams_lock:
            before = self.receivers.get(name)
            if before is not None and before is not receiver and before.state == "failed":
                self._retiring.append((before, self._failed_at.get(name)))
            self.receivers[name] = receiver
            self._failed_at.pop(name, None)

    def tick(self, now: float | None = None, *, block: bool = True) -> None:
        """The decode's periodic check (:class:`ChannelServer` runs it): each open stream's
        ``poll`` (a stream with no round for ``timeout_s`` fails; a failed stream whose prefill
        never confirmed it stopped gives its arena share up ``timeout_s`` later); ended
        streams leave :attr:`receivers` and their router stream is closed. With ``block``
        False a stream busy with a round is passed over until the next check."""
        now = time.monotonic() if now is None else now
        with self.streams_lock:
            streams = list(self.receivers.items())
            retiring, self._retiring = self._retiring, []
        kept = []
        for receiver, failed_at in retiring:  # displaced: polled for its share alone
            receiver.poll(block=block)
            failed_at = now if failed_at is None else failed_at
            if now - failed_at <= 2 * receiver.timeout_s:
                kept.append((receiver, failed_at))
        with self.streams_lock:
            self._retiring.extend(kept)
        for name, receiver in streams:
            state = receiver.poll(block=block)  # unlocked: it may wait for a round's scatter
            if state not in ("failed", "loaded"):
                continue
            with self.streams_lock:
                # the check and the end under one hold: a stream listed again under the name
                # meanwhile (vLLM reading a request again) is neither ended nor dropped
                if self.receivers.get(name) is not receiver:
                    continue
                if state == "failed":
                    failed_at = self._failed_at.setdefault(name, now)
                    if now - failed_at <= 2 * receiver.timeout_s:
                        continue  # its poll may still have to give the share up
                self._failed_at.pop(name, None)
                del self.receivers[name]
                self.finished[name] = receiver
                while len(self.finished) > KEEP_FINISHED:
                    self.finished.popitem(last=False)
            # by handler: a read that opens the name again routes it before it is listed
            self.router.close(name, handler=receiver.on_message)

    def close(self, join_s: float = CLOSE_JOIN_S) -> None:
        """Close the channels and the listener (waiting up to ``join_s`` seconds for their
        threads to end), cancel the decode's streams still receiving (nothing of them is
        reported loaded) and unregister the arena; a second call does nothing more."""
        with self.streams_lock:
            receivers = list(self.receivers.values())
        for receiver in receivers:
            if receiver.state == "receiving":
                receiver.cancel("the worker shut down")
        for channel in list(self.channels.values()):
            if isinstance(channel, TcpChannel):
                channel.close(join_s)
            elif callable(close := getattr(channel, "close", None)):
                close()
        self.channels.clear()
        if self.server is not None:
            self.server.close(join_s)
            self.server = None
        self.arena.unregister()

    def agreement(self, peer: str, remote: Any, *, sending: bool,
                  remote_rank: int) -> Negotiated:
        """:func:`kvplan.staging.negotiate` with ``peer``'s message (None: the peer sent
        none), once per peer, rank, direction and message: a peer restarted under the same
        name with another arena is negotiated again, never written at its old arena's
        address; each outcome logged once per peer."""
        key = (peer, remote_rank, sending, _message_key(remote))
        outcome = self._agreements.get(key)
        if outcome is None:
            if self.config.mode == "off":
                outcome = DirectFallback("staging is off here")
            else:
                outcome = negotiate(Capabilities.local([self.arena.info(self.rank)]),
                                    _as_message(remote), sending=sending,
                                    local_rank=self.rank, remote_rank=remote_rank)
            self._agreements[key] = outcome
            while len(self._agreements) > MAX_AGREEMENTS:
                self._agreements.popitem(last=False)
            self.fallbacks.note(peer, outcome)
        return outcome

    # ------------------------------------------------------------------ decode side
    def on_open(self, worker: Any, data: bytes, reply: Callable[[bytes], object]) -> str:
        """The prefill's opening message for one stream: plan the decode's own rounds from
        the template it names and open the stream on the router. A message this decode
        cannot plan from fails the stream: the prefill is told through ``reply``."""
        opening = _read_open(data)
        request: str = str(opening["stream"])
        writer = int(opening["writer"])
        try:
            template, rounds = _decode_rounds(self, opening, worker)
        except (kvplan.KvPlanError, StagingError, KeyError, TypeError, ValueError) as exc:
            # the prefill waits for the grant: a failure message ends its send at once
            from kvplan.staging.wire import FAIL, encode

            logger.error("kvplan staging: cannot plan %r from the prefill's message: %s",
                         request, exc)
            reply(encode(FAIL, request, writer=writer, round_index=0,
                         payload=f"bad_message: {type(exc).__name__}: {exc}".encode()[:4096]))
            return request
        def failed(error: StagingError) -> None:
            if error.reason == "cancelled":
                # vLLM aborted the request: its blocks may already be another request's
                return
            try:
                verdict = verdict_for_unscattered_rounds(
                    request, template, rounds, receiver.scattered,
                    reason=f"{error.reason}: {error.detail}")
                report_unwritten(worker, verdict)
            except kvplan.KvPlanError as exc:  # the request still fails as a whole
                logger.error("kvplan staging: no failure verdict for %r: %s", request, exc)

        receiver = ReceiveStaged(
            request, rounds, local_copy([self.arena.array], kv_buffers(worker)), reply,
            writer=writer, timeout_s=self.config.timeout_s, on_failed=failed)
        self.list_stream(request, receiver)
        self.router.open(request, writer, receiver.on_message)
        self.shares.admit(receiver)
        return request


def start_staging(worker: Any, options: dict[str, Any], *, engine: Any, cost_engine: str,
                  setup: Callable[[WorkerStaging], object] | None = None
                  ) -> WorkerStaging | None:
    """One vLLM worker's staging start-up, for either connector: with a ``kvplan_staging`` key
    other than ``off``, the arena of :class:`kvplan.staging.StagingConfig` registered with
    ``engine`` (the worker's Mooncake engine when None; the NIXL connector's agent), the
    connector's own ``setup`` (listener, handshake hooks), the engine's costs
    (:func:`kvplan.staging.startup_costs`: ``kvplan_staging_costs`` as given, else for
    ``auto`` measured once on loopback with ``cost_engine``), one INFO line, and the
    :class:`WorkerStaging` kept on the worker and returned. Without the key, or with ``off``:
    None, nothing allocated. A failed start unregisters the arena
    and raises."""
    from kvplan.staging import startup_costs

    if options.get("kvplan_staging", "off") == "off":
        return None
    log = logging.getLogger(NEGOTIATION_LOGGER)
    config = StagingConfig.from_options(options)
    state = WorkerStaging.start(worker, config, engine=engine)
    try:
        if setup is not None:
            setup(state)
        state.costs, said = startup_costs(config, log, option="kvplan_staging_costs",
                                          engine=cost_engine)
    except BaseException:
        state.close()
        raise
    worker.__dict__[STAGING_ATTR] = state
    log.info(
        "kvplan staging (%s): %d MiB arena in %d buffers registered, channel %s; %s",
        config.mode, config.arena_mib, config.buffers,
        state.server.address if state.server is not None else "-", said)
    return state


def _message_key(remote: Any) -> str:
    if isinstance(remote, dict):
        try:
            return json.dumps(remote, sort_keys=True, default=repr)
        except (TypeError, ValueError):
            return repr(remote)
    return repr(remote)


def _as_message(remote: Any) -> Any:
    return remote if remote is None or isinstance(remote, (bytes, Capabilities)) else \
        json.dumps(remote).encode() if isinstance(remote, dict) else remote


def track_stream(channel: Channel, stream: str) -> None:
    """``stream`` is about to be opened on ``channel``: should the connection end before the
    stream does, the stream fails at once (``peer_gone``, :meth:`WorkerStaging.serve`'s
    channels do this; another channel is not followed)."""
    if isinstance(channel, TcpChannel):
        channel.track(stream)


def host_kv(worker: Any) -> bool:
    """Whether the worker's registered KV caches are host memory (the rounds' gather and
    scatter run on host memory here; a device cache keeps vLLM's direct path). A worker
    whose tensors are not recorded (built without ``register_kv_caches``) counts as host."""
    caches = getattr(worker, "device_kv_caches", None)
    return not isinstance(caches, dict) or host_memory(tensors=caches.values())


def kv_buffers(worker: Any) -> list[np.ndarray]:
    """The worker's registered KV buffers (host memory) as uint8 arrays over their bytes, for
    a round's gather or scatter (which checks every block against them)."""
    from kvplan.compat.vllm.templates import _buffer_sources, _buffer_table

    table = _buffer_table(_buffer_sources(worker))
    if not table:
        raise kvplan.LayoutError(
            "kvplan staging: the worker registered no KV buffers whose lengths are known; "
            "staged rounds gather and scatter only within registered host buffers")
    return host_views(table)


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
    rounds: Any = None
    #: Set for a request to a decode whose layout identity was refused: its send raises
    #: this, so the request takes vLLM's failed-request path and no byte moves.
    refused: kvplan.KvPlanError | None = None
    #: A request over several KV groups: its groups' pages and the groups of each region of
    #: ``layouts`` (which hold no pools: both sides add them, :meth:`GroupedRead.layout`).
    grouped: GroupedRead | None = None

    @classmethod
    def refusal(cls, request: str, error: kvplan.KvPlanError) -> StagedRequest:
        empty = np.zeros(0, np.int64)
        return cls(request, None, (None, None), empty, empty,
                   cast(StagingAgreement, None), "refused", refused=error)


def staged_requests(worker: Any, agent_meta: Any, peer: Any,
                    ids_by_request: dict[str, list[tuple[Any, Any] | None]]
                    ) -> dict[str, StagedRequest]:
    """The requests (by id) of ``ids_by_request`` (each request's ids per template of
    ``peer``) that go staged to ``agent_meta``'s decode; every other request keeps vLLM's
    direct path."""
    staging: WorkerStaging | None = worker.__dict__.get(STAGING_ATTR)
    if staging is None:
        return {}
    session = f"{agent_meta.remote_hostname}:{agent_meta.remote_port}"
    remote = getattr(agent_meta, META_KEY, None)
    sent = getattr(agent_meta, IDENTITY_KEY, None)
    if remote is not None or sent is not None:  # else not kvplan: the fallback line says so
        try:  # before any byte moves, on either path: a refused decode gets none of them
            staging.check_identity(session, sent, sending=True)
        except kvplan.IncompatiblePeerError as exc:
            return {request: StagedRequest.refusal(request, exc) for request in ids_by_request}
    if peer.error is not None or not host_kv(worker):
        return {}
    outcome = staging.agreement(session, remote, sending=True,
                                remote_rank=int(agent_meta.remote_tp_rank))
    if not isinstance(outcome, StagingAgreement) or \
            staging.channel_to(session, remote) is None:
        return {}
    out = {}
    arenas: dict[str, Any] = dict(src_arena=outcome.src_arena, dst_arena=outcome.dst_arena,
                                  buffers=outcome.buffers)
    for request, per_group in ids_by_request.items():
        used = [(g, ids) for g, ids in enumerate(per_group) if ids is not None]
        grouped: GroupedRead | None = None
        if len(used) == 1:
            g, (local, remote_ids) = used[0]
            template = peer.groups[g][2]
            layouts = peer.layouts[g]
            src = kvplan._core.index_array(local)
            dst = kvplan._core.index_array(remote_ids)
            pages: Any = kvplan.Request(src, dst)
        elif used:  # several KV groups (templates): one request of every group's pages
            joined = _grouped_request(worker, peer, used, remote, session)
            if joined is None:
                continue
            grouped, layouts, block_bytes = joined
            template = kvplan.Template(grouped.layout(layouts[0]), grouped.layout(layouts[1]),
                                       kvplan.Pairing.positional())
            pages = grouped.request()
            src, dst = pages.src, pages.dst
        else:
            continue
        choice = choose_path(template, pages, staging.costs, outcome,
                             mode=staging.config.mode)
        if not choice.staged:
            continue
        try:  # planned here, before anything is sent: a request kvplan cannot stage stays direct
            rounds = template.plan_rounds(pages, **arenas)
        except kvplan.KvPlanError as exc:
            logger.warning("req %s: kvplan could not plan staged rounds (%s: %s); direct path",
                           request, type(exc).__name__, exc)
            continue
        if grouped is not None and (planned := sum(int(r.manifest.bytes) for r in rounds)) \
                != (want := grouped.read_bytes(block_bytes)):
            # the core moves other bytes than vLLM's blocks of each group: never staged
            _groups_unstaged(worker, session, f"the staged rounds move {planned} bytes "
                             f"where vLLM's transfer moves {want}")
            continue
        out[request] = StagedRequest(request, template, layouts, src, dst, outcome,
                                     choice.why, rounds, grouped=grouped)
    return out


def _grouped_request(worker: Any, peer: Any, used: list[tuple[int, tuple[Any, Any]]],
                     remote: Any, session: str
                     ) -> tuple[GroupedRead, tuple[Any, Any], list[int]] | None:
    """The staged request of several KV groups ``used`` names (per template of ``peer`` that
    moves blocks, its prefill and decode block ids): its :class:`GroupedRead` (each template's
    regions read at its own pages), the templates' regions joined as one source and one
    destination layout, and each region's bytes a block; or None where it keeps the direct
    path, said once per decode and reason: a decode whose message does not take several KV
    groups (:data:`GROUPS_KEY`: an older kvplan plans one group a stream), or groups
    :meth:`GroupedRead.of` does not take."""
    why: str | None = None
    if not isinstance(remote, dict) or remote.get(GROUPS_KEY) != GROUPS_VERSION:
        why = "the decode takes one KV group a stream only (an older kvplan)"
    else:
        src_layout, dst_layout, reads, block_bytes = peer.joined([g for g, _ in used])
        grouped = GroupedRead.of(reads, [ids[0] for _, ids in used],
                                 [ids[1] for _, ids in used])
        if not isinstance(grouped, str):
            return grouped, (src_layout, dst_layout), block_bytes
        why = grouped
    _groups_unstaged(worker, session, why)
    return None


def _groups_unstaged(worker: Any, session: str, why: str) -> None:
    """Say once per decode and reason that a request of several KV groups to it keeps the
    direct path (:func:`kvplan.compat.vllm.grouped.said_unstaged`, on the negotiation's log)."""
    said_unstaged(worker, session, why, moves=UNSTAGED_GROUPS,
                  log=logging.getLogger(NEGOTIATION_LOGGER))


def open_message(staged: StagedRequest, *, stream: str, peer: str, rank: int,
                 capabilities: dict[str, Any], writer: int = 0,
                 identity: dict[str, Any] | None = None, request: str | None = None,
                 extra: dict[str, Any] | None = None) -> bytes:
    """The prefill's opening message for one stream: its name, rank and staging message (the
    decode negotiates with it as the prefill did with the decode's), the template's two
    layouts and the request's pages, from which the decode plans the same rounds. In pull
    mode the decode opens the stream, and ``request`` names the prefill's request id (the
    prefill serves only a request it still holds); ``extra``: further keys of the message."""
    src_layout, dst_layout = staged.layouts
    extra = dict(extra or {})
    if staged.grouped is not None:
        extra.update(staged.grouped.message())
    if identity is not None:
        extra[IDENTITY_KEY] = identity
    if request is not None:
        extra["request"] = request
    return json.dumps({"stream": stream, "writer": writer, "peer": peer, "rank": rank,
                       "capabilities": capabilities, **extra,
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


def report_unwritten(worker: Any, verdict: FailureVerdict) -> str:
    """Feed a failed stream's ``verdict`` to the decode worker's failed-load path where it
    can take blocks (one KV-cache group and the release's ``_invalid_block_ids`` queue, which
    vLLM 0.32 and 0.34 Mooncake workers have): :func:`kvplan.compat.vllm.load_failures.report_load_failure`,
    which logs it once. Elsewhere the verdict is only logged: the request still fails as a whole
    through the prefill's ``err_reqs``. Returns ``"blocks"``, ``"logged"`` or ``"none"``."""
    from kvplan.compat.vllm.load_failures import kv_cache_group_count, report_load_failure

    if not verdict.failed:
        return "none"
    queue = worker.__dict__.get("_invalid_block_ids")
    if kv_cache_group_count(worker) == 1 and len(verdict.blocks) == 1 \
            and hasattr(queue, "put"):
        # the worker's one group is the only pool the decode layout's pages belong to
        (blocks,) = verdict.blocks.values()
        report_load_failure(worker, FailureVerdict(verdict.request_id, {0: blocks},
                                                   verdict.reason))
        return "blocks"
    logger.warning("kvplan staging: %s; the request fails as a whole (vLLM's failed-receive "
                   "path)", verdict)
    return "logged"


def _decode_rounds(staging: WorkerStaging, opening: dict[str, Any],
                   worker: Any) -> tuple[Any, Any]:
    if not host_kv(worker):
        raise kvplan.LayoutError("the decode's KV cache is not host memory: staged rounds "
                                 "scatter only into host memory here")
    src_layout = kvplan.Layout.from_dict(opening["src_layout"])
    dst_layout = kvplan.Layout.from_dict(opening["dst_layout"])
    grouped = _opened_groups(opening, src_layout, dst_layout)
    if grouped is not None:  # each group's regions a pool of their own, as the prefill's
        src_layout, dst_layout = grouped.layout(src_layout), grouped.layout(dst_layout)
    template = kvplan.Template(src_layout, dst_layout, kvplan.Pairing.positional())
    src = np.asarray(opening["src_pages"], np.int64)
    dst = np.asarray(opening["dst_pages"], np.int64)
    # the prefill's identity, before its rounds are planned or any is granted: refused, the
    # stream fails and the prefill's request with it
    staging.check_identity(str(opening["peer"]), opening.get(IDENTITY_KEY), sending=False)
    agreement = staging.agreement(str(opening["peer"]), opening["capabilities"],
                                  sending=False, remote_rank=int(opening["rank"]))
    if not isinstance(agreement, StagingAgreement):
        raise StagingError.make(opening["stream"], 0, "bad_message",
                                f"no staging agreement with {opening['peer']}: "
                                f"{agreement.reason}", writer=int(opening["writer"]))
    arenas: dict[str, Any] = dict(src_arena=agreement.src_arena,
                                  dst_arena=staging.arena.region, buffers=agreement.buffers)
    request = kvplan.Request(src, dst) if grouped is None else grouped.request()
    return template, template.plan_rounds(request, **arenas)


def _opened_groups(opening: dict[str, Any], src_layout: kvplan.Layout,
                   dst_layout: kvplan.Layout) -> GroupedRead | None:
    """The request of several KV groups an opening message names (None: one page list, as
    before), checked before anything is planned: the prefill gives :data:`GROUPS_KEY`, each
    group's pages pair up and each region is read at groups the message has
    (:meth:`GroupedRead.from_message`), and the message names the groups of every region of
    both layouts. Raises
    :class:`kvplan.staging.StagingError` (``bad_message``) naming what does not hold."""
    if GROUP_PAGES_KEY not in opening and GROUP_REGIONS_KEY not in opening:
        return None
    stream, writer = str(opening["stream"]), int(opening["writer"])
    capabilities = opening.get("capabilities")
    why: str | None = None
    grouped: GroupedRead | str = ""
    if not isinstance(capabilities, dict) or capabilities.get(GROUPS_KEY) != GROUPS_VERSION:
        why = (f"the prefill names several KV groups without {GROUPS_KEY}={GROUPS_VERSION} in "
               f"its staging message")
    else:
        grouped = GroupedRead.from_message(opening)
        if isinstance(grouped, str):
            why = grouped
        elif len(grouped.reads) != len(src_layout) or len(grouped.reads) != len(dst_layout):
            why = (f"the message names the KV groups of {len(grouped.reads)} regions; its "
                   f"layouts have {len(src_layout)} and {len(dst_layout)}")
    if why is not None or isinstance(grouped, str):
        raise StagingError.make(stream, 0, "bad_message", str(why), writer=writer)
    return grouped


def send_request(worker: Any, staged: StagedRequest, session: str, *,
                 engine: Any) -> SendReport:
    """Send one request staged to the decode at ``session``: the opening message, then
    :func:`kvplan.staging.send_staged` through ``engine`` (a round engine over the worker's
    Mooncake hand-off). Raises :class:`kvplan.staging.StagingError`."""
    if staged.refused is not None:
        raise staged.refused
    staging: WorkerStaging = worker.__dict__[STAGING_ATTR]
    channel = staging.channels[session]
    # one stream per prefill rank: hetero TP and PP stages send one request from several
    stream = f"{staged.request}@tp{worker.tp_rank}" + (
        f"pp{pp}" if (pp := int(getattr(worker, "pp_rank", 0) or 0)) else "")
    rounds = staged.rounds if staged.rounds is not None else staged.template.plan_rounds(
        staged.src_pages, staged.dst_pages, src_arena=staged.agreement.src_arena,
        dst_arena=staged.agreement.dst_arena, buffers=staged.agreement.buffers)
    try:
        gather = local_copy(kv_buffers(worker), [staging.arena.array])
    except kvplan.KvPlanError as exc:
        raise StagingError.make(stream, 0, "gather_failed", f"{type(exc).__name__}: {exc}"
                                ) from exc
    # the stream is routed before the decode hears of it: its grant may come back at once, and
    # a stream name used before (a request pulled again) would otherwise drop it as a
    # straggler of the closed stream
    acks = AckQueue()
    staging.router.open(stream, 0, acks.put)
    # should the channel end before the send does, the send fails at once (it may be waiting
    # for the decode's grant, which has no timeout of its own)
    track_stream(channel, stream)
    try:
        try:
            channel.open(open_message(staged, stream=stream, peer=staging.name or session,
                                      rank=staging.rank, capabilities=staging.push_message(),
                                      identity=staging.identity_message()))
        except Exception as exc:
            raise StagingError.make(stream, 0, "peer_gone",
                                    f"opening the stream failed: {type(exc).__name__}: {exc}"
                                    ) from exc
        return send_staged(rounds, engine, session, channel.send, request=stream, acks=acks,
                           writer=0, gather=gather, buffers=staged.agreement.buffers,
                           src_lock=staging.arena.lock, timeout_s=staging.config.timeout_s)
    finally:
        staging.router.close(stream)


# ---------------------------------------------------------------------------------------------
# kvplan's channel between a prefill worker and a decode worker
# ---------------------------------------------------------------------------------------------

_OPEN, _MESSAGE = b"O", b"M"
#: The connector's frames: a tag byte (an opening message or a round protocol message)
#: before each frame's length, at most :data:`MAX_OPEN_BYTES` a frame.
FRAMING = Framing(MAX_OPEN_BYTES, tags=_OPEN + _MESSAGE)


def keep_recent(names: list[str], name: str) -> None:
    """Append ``name`` to the streams a connection opened, keeping the most recent
    :data:`KEEP_FINISHED`: a connection lives as long as its peer, so the list must not grow
    with every request it ever carried (far fewer streams than that are open at once)."""
    names.append(name)
    del names[:-KEEP_FINISHED]


class TcpChannel:
    """The prefill's connection to one decode's :class:`ChannelServer`: frames out, the
    decode's messages into ``router``. Raises :class:`kvplan.staging.ChannelError` when the
    decode cannot be reached (and from :meth:`send` / :meth:`open` once the connection
    ended)."""

    def __init__(self, address: str, router: Router, *, timeout_s: float = 5.0,
                 on_close: Callable[[TcpChannel], object] | None = None) -> None:
        self.address = address
        self._router = router
        #: The streams opened on this connection (:meth:`track`); given to ``on_close`` once
        #: the connection ended.
        self.streams: list[str] = []
        self._on_close = on_close
        self._conn = FrameConnection.connect(address, FRAMING, timeout_s=timeout_s,
                                             on_frame=self._on_frame,
                                             on_close=self._closed)

    def _closed(self, error: Any) -> None:
        if self._on_close is not None:
            self._on_close(self)

    def _on_frame(self, tag: bytes, data: bytes) -> None:
        if tag == _MESSAGE:
            self._router.deliver(data)

    @property
    def closed(self) -> bool:
        """Set once the connection ended; the worker then connects again for the next
        request."""
        return self._conn.closed

    def send(self, data: bytes) -> None:
        self._conn.send(data, _MESSAGE)

    def track(self, stream: str) -> None:
        """``stream`` is opened on this connection: given to ``on_close`` should the
        connection end (the most recent :data:`KEEP_FINISHED` are kept)."""
        keep_recent(self.streams, stream)

    def open(self, data: bytes) -> None:
        self._conn.send(data, _OPEN)

    def close(self, join_s: float = 0.0) -> None:
        self._conn.close(join_s)


class ChannelServer:
    """A worker's listener: each peer connection's opening messages go to ``on_open``
    (default :meth:`WorkerStaging.on_open`, the push-mode decode's; the replies go back on that
    connection), its round protocol messages to the worker's router. Opening messages are
    handled and rounds scattered on the connection's own thread."""

    def __init__(self, staging: WorkerStaging, worker: Any, host: str = "127.0.0.1", *,
                 on_open: Opener | None = None,
                 on_close: Callable[[list[str]], object] | None = None) -> None:
        self._staging, self._worker = staging, worker
        self._open: Opener = on_open if on_open is not None else staging.on_open
        self._peer_gone = on_close
        #: The streams each peer connection opened, the most recent :data:`KEEP_FINISHED`
        #: (failed ``peer_gone``, or ended by ``on_close``, if it ends before them).
        self._opened: dict[FrameConnection, list[str]] = {}
        self._listener = FrameListener(host, FRAMING, self._on_frame, self._on_close)
        self.address = self._listener.address
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="kvplan-staging-tick",
                                        daemon=True)
        self._ticker.start()

    def threads(self) -> list[threading.Thread]:
        """The listener's threads: its periodic check, its accepting thread and each open
        connection's reader."""
        return [self._ticker, *self._listener.threads()]

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self._staging.tick()
            except Exception:  # the next tick tries again; the streams fail on their own
                logger.exception("kvplan staging: the decode's periodic check failed")

    def _on_frame(self, conn: FrameConnection, tag: bytes, data: bytes) -> None:
        if tag != _OPEN:
            self._staging.router.deliver(data)
            return

        def reply(data: bytes) -> None:
            conn.send(data, _MESSAGE)

        try:
            name = self._open(self._worker, data, reply)
        except (kvplan.KvPlanError, ValueError) as exc:
            logger.error("kvplan staging: refused an opening message: %s", exc)
            return
        keep_recent(self._opened.setdefault(conn, []), name)

    def _on_close(self, conn: FrameConnection, error: ChannelError | None) -> None:
        # the prefill is gone: what it had not finished will not arrive
        names = self._opened.pop(conn, [])
        for name in names:
            receiver = self._staging.open_stream(name)
            if receiver is not None and receiver.state == "receiving":
                # the prefill went away (not an abort here): the stream fails peer_gone and
                # its verdict names the rounds not scattered
                receiver.peer_gone(
                    f"the prefill at {conn.peer} went away (its staging channel closed"
                    f"{f': {error}' if error is not None else ''}) after "
                    f"{receiver.scattered} of {receiver.n_rounds} rounds")
        if self._peer_gone is not None and names:
            try:  # the pull-mode prefill: the decode is gone, its streams end now
                self._peer_gone(names)
            except Exception:
                logger.exception("kvplan staging: ending the streams of a closed channel "
                                 "failed")

    def close(self, join_s: float = 0.0) -> None:
        """Stop the periodic check and the listener (its connections closed); with
        ``join_s``, wait up to that long for their threads to end."""
        from kvplan.staging.channel import join_threads

        self._stop.set()
        self._listener.close(join_s)
        if join_s > 0:
            join_threads([self._ticker], join_s)


# ---------------------------------------------------------------------------------------------
# The decode's staging message in vLLM's pull request
# ---------------------------------------------------------------------------------------------

#: The vLLM worker attributes the handshake hooks replace on a worker instance, as every
#: supported release sets them in ``MooncakeConnectorWorker.__init__``: the decode's pull
#: request goes out through ``_encoder.encode(metadata)``, the prefill reads it with
#: ``_xfer_meta_decoder.decode(bytes)``.
HANDSHAKE_ATTRS = {"_encoder": "encode", "_xfer_meta_decoder": "decode"}
#: What the hooks read from vLLM's connector module.
HANDSHAKE_MODULE_NAMES = ("msgspec", "MooncakeXferMetadata")


class AdvertisingEncoder:
    """The decode worker's encoder: vLLM's pull request (``MooncakeXferMetadata``) goes out
    with the worker's staging message under :data:`META_KEY`; everything else, and the pull
    request's own fields, exactly as vLLM's encoder writes them; and the worker's layout
    identity under :data:`kvplan.identity.IDENTITY_KEY` (also from a decode whose KV cache
    cannot take staged rounds: the prefill checks it on the direct path too). A prefill that
    is not kvplan decodes the request with vLLM's decoder, which skips the keys it does not
    know."""

    def __init__(self, inner: Any, metadata_cls: type, msgspec: Any,
                 message: Callable[[], dict[str, Any] | None],
                 identity: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self._inner, self._cls, self._msgspec, self._message = inner, metadata_cls, msgspec, \
            message
        self._identity = identity

    def encode(self, obj: Any) -> Any:
        pull = isinstance(obj, self._cls)
        message = self._message() if pull else None
        identity = self._identity() if pull else None
        if message is None and identity is None:  # nothing to advertise: vLLM's bytes
            return self._inner.encode(obj)
        fields = self._msgspec.to_builtins(obj)
        if message is not None:
            fields[META_KEY] = message
        if identity is not None:
            fields[IDENTITY_KEY] = identity
        return self._inner.encode(fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def metadata_decoder(metadata_cls: type, msgspec: Any) -> Any:
    """The prefill worker's decoder of pull requests: vLLM's ``MooncakeXferMetadata`` with
    two more optional fields, the decode's staging message and its layout identity (None
    from a decode that sent none)."""
    subclass = msgspec.defstruct(
        "KvplanXferMetadata", [(META_KEY, dict[str, Any] | None, None),
                               (IDENTITY_KEY, dict[str, Any] | None, None)],
        bases=(metadata_cls,), omit_defaults=True)
    return msgspec.msgpack.Decoder(subclass)


def hook_handshake(worker: Any, staging: WorkerStaging, module: Any) -> None:
    """Install the handshake hooks on ``worker`` (both: a worker of ``kv_both`` sends and
    receives). :class:`kvplan.IncompatibleHostError` when the worker or vLLM's module is not
    in the form the hooks were built for; nothing is replaced then."""
    from kvplan.compat._methods import refuse

    releases = "vLLM 0.32.0, 0.33.0, 0.34.0"
    for name in HANDSHAKE_MODULE_NAMES:
        if not hasattr(module, name):
            raise refuse(type(worker), module.__name__, name, "missing",
                         {"a module attribute": releases}, "vLLM")
    msgspec = module.msgspec
    for attr in ("to_builtins", "defstruct", "msgpack"):
        if not hasattr(msgspec, attr):
            raise refuse(type(worker), "msgspec", attr, "missing",
                         {"msgspec's function": releases}, "vLLM")
    for attr, method in HANDSHAKE_ATTRS.items():
        if not callable(getattr(worker.__dict__.get(attr), method, None)):
            raise refuse(type(worker), type(worker).__name__, attr,
                         type(worker.__dict__.get(attr)).__name__,
                         {f"an instance attribute with {method}()": releases}, "vLLM")
    cls = module.MooncakeXferMetadata
    decoder = metadata_decoder(cls, msgspec)
    # a decode whose KV cache is not host memory cannot scatter the rounds: it advertises
    # nothing, and its prefills keep the direct path
    worker._encoder = AdvertisingEncoder(
        worker.__dict__["_encoder"], cls, msgspec,
        lambda: staging.push_message() if host_kv(worker) else None, staging.identity_message)
    worker._xfer_meta_decoder = decoder


# ---------------------------------------------------------------------------------------------
# The worker's layout identity (docs/identity.md, "At the handshake")
# ---------------------------------------------------------------------------------------------

def worker_layout(worker: Any) -> kvplan.Layout | None:
    """The worker's registered KV regions as a :class:`kvplan.Layout`
    (:func:`kvplan.compat.vllm.semantics.regions_layout` of its regions: each one's layer
    index and block bytes; the page size, TP and PP coordinates; the heads where they are
    whole, in the memory order of the KV cache layout vLLM resolved,
    :func:`kvplan.compat.vllm.semantics.memory_order`); None before ``register_kv_caches``,
    and None where the regions do not hold whole heads or vLLM's layout is one kvplan does not
    describe (a layout without the heads could refuse a TP pair vLLM plans, so nothing is
    checked)."""
    d = worker.__dict__
    ptrs = [int(p) for p in d.get("kv_caches_base_addr") or ()]
    items = [int(n) for n in d.get("block_len_per_layer") or ()]
    ids = [int(i) for i in d.get("registered_layer_indices") or ()]
    kv_config = d.get("kv_cache_config")
    blocks = int(getattr(kv_config, "num_blocks", 0) or 0) * int(
        d.get("_physical_blocks_per_logical_kv_block", 1) or 1) or 1
    context: dict[str, Any] = dict(
        page_size=int(d.get("block_size", 1) or 1), tp_rank=int(d.get("tp_rank", 0) or 0),
        tp_size=int(d.get("tp_size", 1) or 1), pp_rank=int(d.get("pp_rank", 0) or 0),
        pp_size=int(d.get("pp_size", 1) or 1))
    return regions_layout(ptrs, items, ids, blocks=blocks, context=context,
                          use_mla=bool(d.get("use_mla")), model_config=d.get("model_config"),
                          order=memory_order(d.get("vllm_config")))


def manifest_layout(worker: Any, engine: str) -> tuple[kvplan.Layout, frozenset[str]]:
    """The Mooncake worker's :func:`worker_layout` for its ``kvplan_manifest`` check
    (``manifest.roles_layout`` of its registered layer names, indices and specs: each region's
    role, kind, item and window, and the packed roles it holds: K and V, a Mamba layer's
    states).

    Raises:
        ManifestError: What ``manifest.roles_layout`` refuses, naming why.
    """
    from kvplan.compat.vllm.manifest import roles_layout

    d = worker.__dict__
    names = [str(n) for n in d.get("registered_layer_names") or ()]
    ids = [int(i) for i in d.get("registered_layer_indices") or ()]
    layout = worker_layout(worker) if names else None
    return roles_layout(layout, names, ids, d.get("_layer_specs") or {}, engine,
                        "its regions do not hold whole KV heads alike, or vLLM resolved a KV "
                        "cache layout kvplan does not describe (kvplan builds no layout of it)")


def worker_identity(worker: Any, semantics: ModelSemantics | None = None) -> Any:
    """The worker's :class:`kvplan.LayoutIdentity` (its :func:`worker_layout` with
    ``semantics``, by default :func:`worker_semantics` of its ``vllm_config``); None before
    its KV cache is registered."""
    layout = worker_layout(worker)
    if layout is None:
        return None
    if semantics is None:
        semantics = worker_semantics(worker.__dict__.get("vllm_config"))
    return kvplan.layout_identity(layout, semantics)
