"""Staged transfers in rounds for the SGLang Mooncake drop-in (``kvplan.staging`` wired in).

Nothing here runs unless a manager was given staging at start-up (:func:`attach`); with
``KVPLAN_STAGING=off`` :func:`attach` returns ``None`` and sets nothing, so every drop-in takes
its direct path exactly as before.

The pieces, per manager (``manager._kvplan_staging``, a :class:`SglangStaging`):

* start-up: the settings from SGLang's environment (``StagingConfig.from_env``), an arena
  registered with the engine the manager registered its KV memory with;
* registration: :meth:`SglangStaging.capabilities` is what the decode adds to the registration
  it sends the prefill (under the key ``kvplan_staging``); the prefill's
  :meth:`SglangStaging.on_registration` negotiates once per decode session and says a fallback
  once (``FallbackLog``);
* side channel: one callable ``send(peer, data)`` per side, and :meth:`SglangStaging.deliver`
  as the listener's handler. The messages are kvplan's own (an *open* message, then the round
  protocol's), carried on a kvplan-owned connection: SGLang's bootstrap socket parses its
  messages by position, so a message it does not know would be misread by a peer without
  kvplan;
* prefill: :func:`maybe_send` (called by the ``send_kvcache``, ``send_kvcache_slice`` and
  ``send_kvcache_dcp`` drop-ins) asks ``choose_path``; when staged it sends the decode an open
  message (the request's page ids and the prefill's geometry, no memory addresses), then
  ``send_staged`` through the manager's engine. It returns only after the decode acknowledged
  the last round's scatter, so SGLang's Success, sent after the drop-in returns 0, always
  follows the last byte in the decode's pool. A ``StagingError`` is logged with its reason and
  becomes status -1: SGLang's transfer worker fails the request (``conclude_failure``,
  ``KVPoll.Failed`` on both sides) as it does for a failed write;
* decode: the open message makes the decode plan the same rounds itself (its own pools, the
  prefill's geometry with stand-in addresses), check each round's manifest and scatter it
  into its pool (``ReceiveStaged`` admitted by ``ArenaShares``).

Supported geometries: MLA-style pools (one item per page per entry, paired by layer id or
position), MHA NHD between TP sizes (head-sliced, SGLang's slot order) and a prefill at DCP 1
sending one decode DCP rank its dealt tokens (``send_kvcache_dcp``), prefill PP 1; MLA-style
pools and MHA slices also from a stage of a prefill PP, and MHA slices with published layer
ids (:mod:`kvplan.compat.sglang.stages`: the open message names the decode entry each of the
stage's entries fills). Any other request
keeps the direct path. The KV pools are reached as host memory; device pools
need the torch executor's gather and scatter, which this drop-in does not call yet.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from kvplan._core import (KvPlanError, Layout, Pairing, Request, Template, TransferCost,
                          heads_per_rank)
from kvplan._errors import IncompatiblePeerError, TransferError
from kvplan.identity import (IDENTITY_KEY, ModelSemantics, PeerCheck, declarable_rope, hf_rope,
                             layout_identity, model_name_of)
from kvplan.compat.sglang import metrics
from kvplan.compat.sglang.layouts import published_ids, unbounded_lens
from kvplan.compat.sglang.model_config import config_kv_heads, config_rope
from kvplan.compat.sglang.stages import pp_stage, stage_slot_ids
from kvplan.compat.sglang.templates import as_index, dcp_template
from kvplan.compat.sglang.verdicts import staged_unwritten
from kvplan.compat.sglang.wrapping import unwrap, wrap
from kvplan.staging import (
    ArenaShares,
    Capabilities,
    FallbackLog,
    FrameConnection,
    FrameListener,
    Framing,
    Negotiated,
    ReceiveStaged,
    Router,
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
    startup_costs,
)

__all__ = ["OPEN_MAGIC", "REGISTRATION_FRAME", "REGISTRATION_TAG", "PeerIdentities",
           "SglangStaging", "check_registered", "identity_field", "identity_with_metric",
           "SocketChannel", "attach", "detach", "hook_register_info", "hook_start_up",
           "host_pools", "manager_identity", "manager_semantics", "maybe_send", "start_up",
           "staging_of", "unhook_register_info", "unhook_start_up"]

_log = logging.getLogger("kvplan.compat.sglang")

#: First bytes of kvplan's open message (the round protocol's own messages start ``KVS``).
OPEN_MAGIC = b"KVPLAN-OPEN\x00"
#: Registration key the decode's capabilities travel under.
REGISTRATION_KEY = "kvplan_staging"
#: First bytes of the frame the decode appends to SGLang's registration message.
REGISTRATION_TAG = b"kvplan-staging\x00"
#: SGLang 0.5.23's registration message has frames 0 to 19; kvplan's is the next one.
REGISTRATION_FRAME = 20
#: Stand-in addresses for the pools of the side a peer does not know: entry ``j`` at
#: ``base + (j << 40)``; they shape no manifest and no scatter.
_STANDIN_BASE = 1 << 44

Send = Callable[[str, bytes], object]


def _standins(n: int) -> tuple[list[int], list[int]]:
    ptrs = [_STANDIN_BASE + (j << 40) for j in range(n)]
    return ptrs, unbounded_lens(ptrs)


def host_pools(ptrs: Sequence[int], lens: Sequence[int]) -> bool:
    """Whether every pool lies in host memory this process may read and write
    (:func:`kvplan.staging.host_memory` of the pools); device pools (SGLang's GPU KV cache)
    and an unknown platform: False, and the request keeps the direct path."""
    return host_memory(zip(ptrs, lens))


def _template(geometry: dict[str, Any], prefill: tuple[list[int], list[int]] | None,
              decode: tuple[list[int], list[int], list[int]] | None) -> Template:
    """The template both sides plan a staged request with: ``prefill`` / ``decode`` are the
    side's own pools (``(ptrs, lens)``; the decode's with its item lengths), the other side's
    stand-ins. ``geometry`` is what the open message carries."""
    kind = geometry["kind"]
    if kind == "mla":
        items = [int(n) for n in geometry["items"]]
        src_ids, dst_ids = geometry.get("src_ids"), geometry.get("dst_ids")
        src_ptrs, src_lens = prefill if prefill is not None else _standins(len(items))
        n_dst = int(geometry["n_dst"])
        if decode is not None:
            dst_ptrs, dst_lens, dst_items = decode
        else:
            dst_ptrs, dst_lens = _standins(n_dst)
            dst_items = [int(n) for n in geometry["dst_items"]]
        stage = geometry.get("stage")
        by_slot = stage_slot_ids(stage, len(dst_ptrs))
        if by_slot is not None:  # a prefill PP stage: its entries' decode slots
            src_ids, dst_ids = by_slot
        pp_rank, pp_size = (int(stage["pp_rank"]), int(stage["pp_size"])) if stage else (0, 1)
        src = Layout(list(src_ptrs), list(src_lens), items, src_ids, pp_rank=pp_rank,
                     pp_size=pp_size)
        dst = Layout(list(dst_ptrs), list(dst_lens), list(dst_items), dst_ids)
        return Template(src, dst,
                        Pairing.by_layer_id(allow_positional_fallback=by_slot is None))
    if kind == "mha_slice":
        from kvplan.compat.sglang.staged import staged_template

        g = dict(geometry["template"])
        stage = geometry.get("stage")
        if stage:  # a prefill PP stage, or layer ids: its slots' decode slots, its share
            if decode is None:
                raise KvPlanError("kvplan staging: a head-sliced template paired by the "
                                  "prefill's stage needs the decode's pools")
            src_ids, dst_ids = stage_slot_ids(stage, len(decode[0])) or ([], [])
            g.update(prefill_pp_size=int(stage["pp_size"]), prefill_pp_rank=int(stage["pp_rank"]),
                     prefill_slot_ids=src_ids, decode_slot_ids=dst_ids)
        return staged_template(
            prefill_pools=None if prefill is None else (prefill[0], prefill[1]),
            decode_pools=None if decode is None else (decode[0], decode[1]),
            decode_item_len=None if decode is None else int(decode[2][0]), **g)
    if kind == "dcp":
        token_lens = [int(n) for n in geometry["token_lens"]]
        src_pools = prefill if prefill is not None else _standins(len(token_lens))
        dst_pools = (decode[0], decode[1]) if decode is not None else _standins(
            int(geometry["n_dst"]))
        return dcp_template(
            (list(src_pools[0]), list(src_pools[1])), (list(dst_pools[0]), list(dst_pools[1])),
            token_lens, int(geometry["page_size"]), int(geometry["num_draft"]),
            geometry.get("src_ids"), geometry.get("dst_ids"), int(geometry["dcp_size"]),
            int(geometry["dcp_rank"]), None if decode is None else list(decode[2]))
    raise KvPlanError(f"kvplan staging: unknown request geometry {kind!r}")


def _request(src_pages: Any, dst_pages: Any, n_tokens: int | None) -> Any:
    """The page pair as the template plans it: with the token count where one is given (a
    DCP chunk: the decode's page list is the rank's share of the tokens)."""
    if n_tokens is None:
        return (src_pages, dst_pages)
    return Request(src_pages, dst_pages, n_tokens=int(n_tokens))


def _plan_rounds(template: Template, request: Any, agreement: StagingAgreement) -> Any:
    """``template.plan_rounds`` of ``request`` (:func:`_request`) through the agreed arenas."""
    src_arena, dst_arena, buffers = agreement.src_arena, agreement.dst_arena, agreement.buffers
    if isinstance(request, Request):
        return template.plan_rounds(request, src_arena=src_arena, dst_arena=dst_arena,
                                    buffers=buffers)
    return template.plan_rounds(request[0], request[1], src_arena=src_arena,
                                dst_arena=dst_arena, buffers=buffers)


class SglangStaging:
    """One manager's staging: its settings, arena, router, negotiations and streams."""

    def __init__(self, manager: Any, config: StagingConfig, arena: StagingArena, rank: int,
                 send: Send, reply_to: str, costs: TransferCost | None) -> None:
        self.manager, self.config, self.arena, self.rank = manager, config, arena, rank
        self.send, self.reply_to, self.costs = send, reply_to, costs
        self.router = Router()
        self.shares = ArenaShares()
        self.fallbacks = FallbackLog(_log)
        self.peers: dict[str, Negotiated] = {}
        #: Decode streams by ``(request, writer)`` (kept until loaded or failed).
        self.receivers: dict[tuple[str, int], ReceiveStaged] = {}
        #: The last outcome per prefill-side request (path, rounds, network blocks).
        self.last: dict[str, Any] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._failed_at: dict[tuple[str, int], float] = {}
        self._host_kv: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}
        #: Decode session -> its listener (from its registration frame).
        self.endpoints: dict[str, str] = {}
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self.channel: SocketChannel | None = None
        #: This manager's layout identity and its verdicts on its peers' (docs/identity.md).
        self.identity = PeerCheck(lambda: identity_with_metric(manager), _log)
        #: Decode sessions whose identity was refused, with the error (transfers to them fail).
        self.refused: dict[str, IncompatiblePeerError] = {}

    # ---------------------------------------------------------------- registration
    def host_kv(self, ptrs: Sequence[int], lens: Sequence[int]) -> bool:
        """:func:`host_pools` of this manager's pools, asked once (they do not move)."""
        key = (tuple(ptrs), tuple(lens))
        known = self._host_kv.get(key)
        if known is None:
            known = self._host_kv[key] = host_pools(ptrs, lens)
            if not known:
                _log.info("kvplan: KV pools not in host memory: staged rounds stay off, the "
                          "direct path is used")
        return known

    def send_to(self, peer: str, data: bytes) -> None:
        """One message to ``peer`` (a decode session: the listener it registered, else the
        name itself)."""
        self.send(self.endpoints.get(peer, peer), data)

    def reachable(self, peer: str) -> bool:
        """Whether ``peer``'s listener still accepts a connection: asked while a send waits
        for the decode's grant (the decode may queue a stream for as long as the streams ahead
        of it take, so that wait has no timeout of its own), a decode process gone refuses it
        and the send fails ``peer_gone``. A peer whose endpoint is not ``host:port`` (an
        in-process channel) counts as there."""
        import socket

        from kvplan.staging.channel import ChannelError, parse_address

        try:
            address = parse_address(self.endpoints.get(peer, peer))
        except ChannelError:
            return True
        try:
            socket.create_connection(address, timeout=5.0).close()
        except OSError:
            return False
        return True

    def registration_frame(self) -> bytes:
        """The frame the decode appends to SGLang's registration message: its capabilities
        and where its listener is. SGLang 0.5.23's prefill reads frames 0 to 19 only, so a
        prefill without kvplan ignores it."""
        return REGISTRATION_TAG + json.dumps(
            {**self.capabilities(), "endpoint": self.reply_to, **identity_field(self)}).encode()

    def capabilities(self) -> dict[str, Any]:
        """What the decode adds to its registration (``{"kvplan_staging": ...}``)."""
        return {REGISTRATION_KEY: Capabilities.local([self.arena.info(self.rank)]).to_dict()}

    def on_registration(self, session: str, registration: dict[str, Any] | None,
                        peer_rank: int) -> Negotiated:
        """The prefill received a decode's registration (``None`` or without the key: a peer
        that does not run kvplan's staging): negotiate once, say a fallback once."""
        remote = (registration or {}).get(REGISTRATION_KEY)
        endpoint = (registration or {}).get("endpoint")
        if isinstance(endpoint, str) and endpoint:
            self.endpoints[session] = endpoint
        self.check_registration(session, registration)
        outcome = negotiate(Capabilities.local([self.arena.info(self.rank)]), remote,
                            sending=True, local_rank=self.rank, remote_rank=peer_rank)
        self.peers[session] = outcome
        self.fallbacks.note(session, outcome)
        return outcome

    def check_registration(self, session: str, registration: dict[str, Any] | None
                           ) -> IncompatiblePeerError | None:
        """The verdict on a decode's identity (in its registration frame; none: today's
        behaviour): the refusal kept in :attr:`refused` (and returned), else None."""
        registration = registration or {}
        if REGISTRATION_KEY not in registration and IDENTITY_KEY not in registration:
            self.refused.pop(session, None)  # no kvplan frame: the fallback line says so
            return None
        return check_registered(self, session, registration)

    # ---------------------------------------------------------------- side channel
    def deliver(self, data: bytes) -> None:
        """The side channel's handler: an open message opens a decode stream, anything else
        goes to the router."""
        if bytes(data[:len(OPEN_MAGIC)]) == OPEN_MAGIC:
            self._open(bytes(data[len(OPEN_MAGIC):]))
        else:
            self.router.deliver(bytes(data))

    def _open(self, body: bytes) -> None:
        try:
            msg = json.loads(body)
            request, writer, reply = str(msg["request"]), int(msg["writer"]), str(msg["reply"])
        except (ValueError, KeyError, TypeError) as exc:
            _log.error("kvplan: dropped a staging open message that does not parse: %s", exc)
            return

        def ack(data: bytes) -> None:
            self.send(reply, data)

        def on_failed(err: StagingError) -> None:
            _log.error("kvplan: staged request %s failed on the decode: %s", request, err)
            with self._lock:
                self._failed_at[(request, writer)] = time.monotonic()

        try:
            # the prefill's identity first: refused, no round is planned or granted
            self.identity.check(reply, msg.get(IDENTITY_KEY), local_role="decode")
            outcome = negotiate(Capabilities.local([self.arena.info(self.rank)]), msg["caps"],
                                sending=False, local_rank=self.rank,
                                remote_rank=int(msg["rank"]))
            if not isinstance(outcome, StagingAgreement):
                raise KvPlanError(f"no staging agreement with the prefill: {outcome.reason}")
            kv = self.manager.kv_args
            pools = [int(p) for p in kv.kv_data_ptrs]
            lens, items = [int(n) for n in kv.kv_data_lens], [int(n) for n in kv.kv_item_lens]
            if not self.host_kv(pools, lens):
                raise KvPlanError("the decode's KV pools are not host memory of this process "
                                  "(device pools need the torch executor's scatter)")
            template = _template(msg["geometry"], None, (pools, lens, items))
            rounds = _plan_rounds(template, _request(
                as_index(msg["src_pages"]), as_index(msg["dst_pages"]), msg.get("n_tokens")),
                outcome)
            scatter = local_copy([self.arena.array], host_views(zip(pools, lens)))
        except Exception as exc:  # refused here: the prefill is told, its request fails
            _log.error("kvplan: staged request %s refused by the decode: %s: %s", request,
                       type(exc).__name__, exc)
            from kvplan.staging.wire import FAIL, encode

            try:
                ack(encode(FAIL, request, writer=writer, round_index=0, n_rounds=0,
                           payload=f"bad_message: {type(exc).__name__}: {exc}"
                           .encode()[:4096]))
            except Exception as gone:  # the prefill's own timeout fails its side
                _log.error("kvplan: could not tell %s that %s was refused: %s", reply,
                           request, gone)
            return
        receiver = ReceiveStaged(request, cast(Sequence[Any], rounds), scatter, ack,
                                 writer=writer, timeout_s=self.config.timeout_s,
                                 on_loaded=lambda r: self._ended(request, writer),
                                 on_failed=on_failed)
        with self._lock:
            self.receivers[(request, writer)] = receiver
        self.router.open(request, writer, receiver.on_message)
        self.shares.admit(receiver)

    def _ended(self, request: str, writer: int) -> None:
        """A stream is done with: later messages of it are dropped."""
        with self._lock:
            self.receivers.pop((request, writer), None)
            self._failed_at.pop((request, writer), None)
        self.router.close(request, writer)

    def poll(self) -> None:
        """The decode's periodic check (the poller thread :func:`attach` starts): a stream
        without progress for ``timeout_s`` fails; a failed stream is dropped ``2 * timeout_s``
        after it failed (by then its arena share was given on, and its prefill stopped)."""
        now = time.monotonic()
        with self._lock:
            streams = list(self.receivers.items())
            stale = [key for key, at in self._failed_at.items()
                     if now - at > 2 * self.config.timeout_s]
        for _, r in streams:
            r.poll()
        for request, writer in stale:
            self._ended(request, writer)

    def start_poller(self) -> None:
        interval = min(1.0, self.config.timeout_s / 4)

        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    self.poll()
                except Exception:  # a poll must never end the poller
                    _log.exception("kvplan: staging poll failed")

        self._poller = threading.Thread(target=run, name="kvplan-staging-poll", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        if self.channel is not None:
            self.channel.close()

    # ---------------------------------------------------------------- prefill
    def next_request(self, session: str) -> str:
        kv = self.manager.kv_args
        # the PP stages of one TP rank send to the same decode session: the stage tells them
        # apart
        stage = int(getattr(kv, "pp_rank", 0) or 0)
        rank = f"{kv.engine_rank}.{stage}" if stage else f"{kv.engine_rank}"
        return f"{rank}:{session}:{next(self._ids)}"


class _Written:
    """A round already written: ``wait`` raises the engine's failure."""

    def __init__(self, status: int, peer: str, blocks: int) -> None:
        self.status, self.peer, self.blocks = status, peer, blocks

    def wait(self) -> None:
        if self.status != 0:
            err = TransferError(f"sglang: writing a staged round ({self.blocks} blocks) to "
                                f"{self.peer} returned status {self.status}")
            err.status, err.session = self.status, self.peer
            raise err


class _ManagerRounds:
    """Rounds written through the manager's own submission path (its engine, natively where
    the drop-in keeps a hand-off, in the ``max_blocks`` bound), on the round pipeline's
    network thread."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def submit_round(self, plan: Any, peer: str) -> _Written:
        from kvplan.compat.sglang.submit import send_engine_batches

        return _Written(int(send_engine_batches(self.manager, peer, plan)), peer,
                        int(plan.n_blocks))


#: The side channel's frames: the body's length before it, no tag (an open message starts with
#: :data:`OPEN_MAGIC`, the round protocol's own messages with ``KVS``), at most 256 MiB.
FRAMING = Framing(1 << 28)


class SocketChannel:
    """kvplan's side channel: a TCP listener of length-prefixed messages (each handed to
    ``handler`` in arrival order per connection) and cached connections to the peers'
    listeners (:class:`kvplan.staging.FrameListener`, :class:`kvplan.staging.FrameConnection`).
    Its endpoint (``host:port``) travels in the registration frame and the open message."""

    #: The largest message accepted (an open message holds a request's page ids).
    MAX_MESSAGE = FRAMING.max_frame

    def __init__(self, handler: Callable[[bytes], None], host: str = "127.0.0.1") -> None:
        self.handler = handler
        self._listener = FrameListener(host, FRAMING, self._on_frame,
                                       name="kvplan-staging-listen")
        self.endpoint = self._listener.address
        self._out: dict[str, FrameConnection] = {}
        self._lock = threading.Lock()

    def _on_frame(self, conn: FrameConnection, tag: bytes, data: bytes) -> None:
        self.handler(data)

    def send(self, endpoint: str, data: bytes) -> None:
        """One message to the listener at ``endpoint`` (``host:port``); raises
        :class:`kvplan.staging.ChannelError` (a ``ConnectionError``) when it cannot be reached
        or the message cannot be sent (the round protocol then fails the request
        ``peer_gone``)."""
        with self._lock:
            conn = self._out.get(endpoint)
            if conn is None or conn.closed:
                conn = FrameConnection.connect(endpoint, FRAMING, timeout_s=10)
                self._out[endpoint] = conn
        try:
            conn.send(data)
        finally:
            if conn.closed:  # the next message connects again
                with self._lock:
                    if self._out.get(endpoint) is conn:
                        del self._out[endpoint]

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for conn in self._out.values():
                conn.close()
            self._out.clear()


class Registration(Protocol):
    """What SGLang's registration carries for kvplan and what the prefill does with it:
    :class:`SglangStaging` (capabilities, listener and identity) or :class:`IdentityExchange`
    (the identity alone)."""

    refused: dict[str, IncompatiblePeerError]

    def registration_frame(self) -> bytes: ...

    def on_registration(self, session: str, registration: dict[str, Any] | None,
                        peer_rank: int) -> Any: ...


class IdentityExchange:
    """A manager's layout identity at SGLang's registration when staging is off: the decode's
    frame carries its identity alone (no staging capabilities, so a prefill with staging keeps
    the direct path with it), and the prefill checks it. Refused, the session goes into
    SGLang's ``state_layout_rejections`` as with staging (:func:`_hook_registration`)."""

    def __init__(self, manager: Any) -> None:
        self.identity = PeerCheck(lambda: identity_with_metric(manager), _log)
        self.refused: dict[str, IncompatiblePeerError] = {}

    def registration_frame(self) -> bytes:
        return REGISTRATION_TAG + json.dumps(identity_field(self)).encode()

    def on_registration(self, session: str, registration: dict[str, Any] | None,
                        peer_rank: int) -> None:
        # None: a decode without kvplan (no frame): its missing identity is said once.
        check_registered(self, session, registration)


def exchange_identity(manager: Any) -> IdentityExchange:
    """Give ``manager`` the identity exchange of :class:`IdentityExchange` (the start-up hook
    does when staging is off)."""
    holder = IdentityExchange(manager)
    _hook_registration(manager, holder)
    manager.__dict__["_kvplan_identity_exchange"] = holder
    return holder


def _hook_registration(manager: Any, staging: Registration) -> None:
    """SGLang's registration, per manager instance: the decode appends
    ``staging.registration_frame()`` to ``build_receiver_registration_message``'s frames; the
    prefill's ``_publish_peer_registration`` hands what ``KVArgsRegisterInfo.from_zmq`` found
    in that frame to ``staging.on_registration`` (nothing from a decode without kvplan: the
    direct path, no identity) and fails every transfer to a session it refused."""
    cls = type(manager)
    build = getattr(cls, "build_receiver_registration_message", None)
    if build is not None:
        def build_with_staging() -> list[bytes]:
            frames = list(build(manager))
            if len(frames) == REGISTRATION_FRAME:
                frames.append(staging.registration_frame())
            return frames

        manager.__dict__["build_receiver_registration_message"] = build_with_staging
    publish = getattr(cls, "_publish_peer_registration", None)
    if publish is not None:
        def publish_with_staging(session: str, info: Any) -> Any:
            verdict = publish(manager, session, info)
            staging.on_registration(session, getattr(info, "kvplan_staging", None),
                                    int(getattr(info, "dst_tp_rank", 0)))
            refused = staging.refused.get(session)
            if refused is not None and verdict is None:
                # SGLang's own rejection of a peer: every transfer to this session concludes
                # as failed before it moves a byte, with this reason
                rejections = getattr(manager, "state_layout_rejections", None)
                if isinstance(rejections, dict):
                    lock = getattr(manager, "session_lock", None)
                    with lock if lock is not None else contextlib.nullcontext():
                        rejections[session] = str(refused)
                verdict = str(refused)
            return verdict

        manager.__dict__["_publish_peer_registration"] = publish_with_staging
    for klass in cls.__mro__:  # the module of SGLang's class, also under a subclass
        info_cls = getattr(sys.modules.get(klass.__module__), "KVArgsRegisterInfo", None)
        if isinstance(info_cls, type):
            hook_register_info(info_cls)
            break


def hook_register_info(info_cls: type, frame_index: int = REGISTRATION_FRAME) -> None:
    """``info_cls.from_zmq`` keeps SGLang's parse and adds ``kvplan_staging`` (the decoded
    registration frame, at ``frame_index`` of the message: after the last frame SGLang's
    parse reads) to what it returns when the message has kvplan's frame; installed once per
    class."""
    current = info_cls.__dict__.get("from_zmq")
    if current is None or getattr(current, "_kvplan_original", None) is not None:
        return
    original = current.__func__ if isinstance(current, classmethod) else current

    def from_zmq(cls: type, msg: list[bytes]) -> Any:
        info = original(cls, msg)
        frame = msg[frame_index] if len(msg) > frame_index else b""
        if bytes(frame[:len(REGISTRATION_TAG)]) == REGISTRATION_TAG:
            try:
                info.kvplan_staging = json.loads(bytes(frame[len(REGISTRATION_TAG):]))
            except ValueError as exc:
                _log.error("kvplan: a decode's staging registration does not parse (%s): "
                           "direct path", exc)
        return info

    wrapped: Any = classmethod(from_zmq)
    from_zmq._kvplan_original = current  # type: ignore[attr-defined]
    setattr(info_cls, "from_zmq", wrapped)


def unhook_register_info(info_cls: type) -> None:
    """Restore ``info_cls.from_zmq`` as SGLang defined it."""
    current = info_cls.__dict__.get("from_zmq")
    fn = current.__func__ if isinstance(current, classmethod) else current
    original = getattr(fn, "_kvplan_original", None)
    if original is not None:
        setattr(info_cls, "from_zmq", original)


def attach(manager: Any, *, engine: Any, send: Send | None = None,
           reply_to: str | None = None, rank: int | None = None,
           config: StagingConfig | None = None, costs: TransferCost | None = None,
           host: str = "127.0.0.1") -> SglangStaging | None:
    """The start-up hook: give ``manager`` staging (``manager._kvplan_staging``).

    ``config`` defaults to ``StagingConfig.from_env()`` (``KVPLAN_STAGING``, ...); with mode
    ``off`` nothing is allocated, nothing set, and ``None`` is returned. ``engine`` is what the
    manager registered its KV memory with (a kvplan transport, Mooncake ``TransferEngine`` or
    ``Handoff``): the arena is registered with it. The side channel is a
    :class:`SocketChannel` listening on ``host`` unless ``send(peer, data)`` and ``reply_to``
    (this side's listener, as the peer's ``send`` names it) are given. ``costs``: the engine's
    :class:`kvplan.TransferCost` (measured: ``kvplan.engines.measure_cost``; default
    ``config.costs``, ``KVPLAN_STAGING_COSTS``), which ``auto`` needs to prefer staging;
    without it ``auto`` keeps the direct path. SGLang's registration
    carries the decode's capabilities (:func:`_hook_registration`, on this instance).
    :func:`start_up` passes the costs :func:`kvplan.staging.startup_costs` settled.

    Raises:
        ConfigError: a bad ``KVPLAN_STAGING*`` value, naming the variable.
        TransferError: the engine refused to register the arena.
        KvPlanError: only one of ``send`` and ``reply_to`` given.
    """
    config = StagingConfig.from_env() if config is None else config
    if not config.enabled:
        return None
    if (send is None) != (reply_to is None):
        raise KvPlanError("kvplan staging: attach takes both send and reply_to, or neither "
                          f"(send={send!r}, reply_to={reply_to!r})")
    arena = StagingArena.from_config(config)
    arena.register(engine)
    rank = int(manager.kv_args.engine_rank) if rank is None else int(rank)
    costs = config.costs if costs is None else costs
    channel: SocketChannel | None = None
    if send is None:
        holder: list[SglangStaging] = []
        channel = SocketChannel(lambda data: holder[0].deliver(data), host)
        send, reply_to = channel.send, channel.endpoint
    assert reply_to is not None
    staging = SglangStaging(manager, config, arena, rank, send, reply_to, costs)
    if channel is not None:
        holder.append(staging)
        staging.channel = channel
    staging.start_poller()
    _hook_registration(manager, staging)
    manager.__dict__["_kvplan_staging"] = staging
    return staging


def start_up(manager: Any) -> SglangStaging | None:
    """The start-up hook's body, once SGLang registered the manager's KV memory: with
    ``KVPLAN_STAGING`` set to ``auto`` or ``always``, :func:`attach` with the Mooncake engine
    inside SGLang's wrapper (``manager.engine.engine``), the manager's ``local_ip`` for the
    side channel and the engine's costs (:func:`kvplan.staging.startup_costs`:
    ``KVPLAN_STAGING_COSTS`` as given, else for ``auto`` measured once on Mooncake TCP
    loopback; a failed measurement is a warning and ``auto`` keeps the direct path). One log
    line says the settings and which costs are used. Unset, empty or ``off``: no staging,
    and the manager still exchanges and checks layout identities (:func:`exchange_identity`).

    Raises:
        ConfigError: a bad ``KVPLAN_STAGING*`` value (the server does not start half
            configured).
        TransferError: the engine refused to register the arena.
    """
    config = (StagingConfig.from_env() if os.environ.get("KVPLAN_STAGING", "").strip()
              else None)
    if config is None or not config.enabled:
        exchange_identity(manager)
        return None
    engine = getattr(manager.engine, "engine", None) or manager.engine
    host = str(getattr(manager, "local_ip", "") or "127.0.0.1")
    costs, said = startup_costs(config, _log, option="KVPLAN_STAGING_COSTS")
    staging = attach(manager, engine=engine, host=host, config=config, costs=costs)
    if staging is not None:
        _log.info("kvplan staging (%s) on rank %d: %d MiB arena in %d buffers registered, "
                  "channel %s; %s", config.mode, staging.rank, config.arena_mib,
                  config.buffers, staging.reply_to, said)
    return staging


def hook_start_up(manager_class: type) -> bool:
    """Wrap ``manager_class.register_buffer_to_engine`` (SGLang calls it once in the
    manager's ``__init__``, after its KV memory is known) so that :func:`start_up` runs after
    it; False when already wrapped or the class has no such method."""

    def make(original: Any) -> Callable[..., None]:
        def register_buffer_to_engine(self: Any) -> None:
            original(self)
            if staging_of(self) is None:
                start_up(self)

        return register_buffer_to_engine

    return wrap(manager_class, "register_buffer_to_engine", "_kvplan_start_up", make)


def unhook_start_up(manager_class: type) -> None:
    """Restore what :func:`hook_start_up` wrapped."""
    unwrap(manager_class, "register_buffer_to_engine", "_kvplan_start_up")


def detach(manager: Any) -> None:
    """Take staging off ``manager`` (its poller stops; the direct path from now on). The
    arena stays alive as long as the engine that registered it may write into it."""
    staging = manager.__dict__.pop("_kvplan_staging", None)
    for name in ("build_receiver_registration_message", "_publish_peer_registration"):
        manager.__dict__.pop(name, None)
    if staging is not None:
        staging.stop()


def staging_of(manager: Any) -> SglangStaging | None:
    attrs = getattr(manager, "__dict__", None)
    return None if attrs is None else attrs.get("_kvplan_staging")


def _mla_geometry(manager: Any, dst_ptrs: Sequence[int], dst_layer_ids: Any,
                  dst_items: Sequence[int]) -> dict[str, Any]:
    kv = manager.kv_args
    return {"kind": "mla", "items": [int(n) for n in kv.kv_item_lens],
            "src_ids": published_ids(kv.kv_layer_ids), "dst_ids": published_ids(dst_layer_ids),
            "n_dst": len(dst_ptrs), "dst_items": [int(n) for n in dst_items]}


def maybe_send(manager: Any, session: str, prefill_kv_indices: Any, dst_kv_ptrs: Sequence[int],
               dst_kv_indices: Any, *, kind: str, dst_layer_ids: Any = None,
               slice_geometry: dict[str, Any] | None = None,
               dst_item: int | None = None, dcp_geometry: dict[str, Any] | None = None,
               n_tokens: int | None = None) -> int | None:
    """The prefill's staged path for one call, or ``None`` for the direct path (no staging on
    this manager, no agreement with ``session``, a geometry it does not stage, or
    ``choose_path`` says direct). ``kind="dcp"`` (``send_kvcache_dcp``) takes
    ``dcp_geometry`` (the rows' ``token_lens``, ``page_size``, ``num_draft``, ``dcp_size``,
    ``dcp_rank``) and the chunk's ``n_tokens``: the open message carries both, so the decode
    plans the rank's share of the tokens as the prefill does. Returns 0 once the decode
    scattered every round, -1 when a ``StagingError`` failed the request (logged with its
    reason; SGLang's transfer worker then fails the request)."""
    staging = staging_of(manager)
    if staging is None:
        return None
    refused = staging.refused.get(session)
    if refused is not None:  # said once when the decode registered; the request fails
        return -1
    agreement = staging.peers.get(session)
    if not isinstance(agreement, StagingAgreement):
        return None
    stage = pp_stage(manager, session, kind, dst_kv_ptrs, dst_layer_ids, slice_geometry,
                     dst_item)
    if stage is None:
        return None
    kv = manager.kv_args
    src_ptrs, src_lens = [int(p) for p in kv.kv_data_ptrs], [int(n) for n in kv.kv_data_lens]
    dst_ptrs = [int(p) for p in dst_kv_ptrs]
    decode_side: tuple[list[int], list[int], list[int]] | None
    if kind == "mla":
        info = getattr(manager, "decode_kv_args_table", {}).get(session)
        dst_items = list(getattr(info, "dst_kv_item_lens", None) or kv.kv_item_lens)
        if len(dst_items) != len(dst_ptrs):
            return None
        geometry = _mla_geometry(manager, dst_ptrs, dst_layer_ids, dst_items)
        decode_side = (dst_ptrs, unbounded_lens(dst_ptrs), [int(n) for n in dst_items])
    elif kind == "mha_slice" and slice_geometry is not None and dst_item is not None:
        geometry = {"kind": kind, "template": dict(slice_geometry)}
        decode_side = (dst_ptrs, unbounded_lens(dst_ptrs), [int(dst_item)] * len(dst_ptrs))
    elif kind == "dcp" and dcp_geometry is not None and n_tokens is not None:
        geometry = {"kind": kind, "src_ids": published_ids(kv.kv_layer_ids),
                    "dst_ids": published_ids(dst_layer_ids), "n_dst": len(dst_ptrs),
                    **dcp_geometry}
        decode_side = None  # the prefill's rows size the decode's pages (stand-ins)
    else:
        return None
    if stage:
        geometry["stage"] = stage
    if not staging.host_kv(src_ptrs, src_lens):
        return None
    src_pages, dst_pages = as_index(prefill_kv_indices), as_index(dst_kv_indices)
    template = _template(geometry, (src_ptrs, src_lens), decode_side)
    planned_request = _request(src_pages, dst_pages, n_tokens)
    choice = choose_path(template, planned_request, staging.costs, agreement,
                         mode=staging.config.mode)
    if not choice.staged:
        staging.last[session] = ("direct", choice.why)
        return None
    request = staging.next_request(session)
    rounds = _plan_rounds(template, planned_request, agreement)
    writer = int(rounds.sender[0])
    open_msg = OPEN_MAGIC + json.dumps({
        "request": request, "writer": writer, "reply": staging.reply_to,
        "rank": staging.rank, "geometry": geometry, **identity_field(staging),
        "caps": Capabilities.local([staging.arena.info(staging.rank)]).to_dict(),
        "src_pages": src_pages.tolist(), "dst_pages": dst_pages.tolist(),
        **({} if n_tokens is None else {"n_tokens": int(n_tokens)})}).encode()
    engine = _ManagerRounds(manager)
    events: list[tuple[str, int]] = []
    try:
        staging.send_to(session, open_msg)
        report = send_staged(
            cast(Sequence[Any], rounds), engine, session,
            lambda data: staging.send_to(session, data), request=request,
            acks=staging.router, gather=local_copy(host_views(zip(src_ptrs, src_lens)),
                                                   [staging.arena.array]),
            writer=writer, buffers=agreement.buffers, timeout_s=staging.config.timeout_s,
            src_lock=staging.arena.lock, events=events,
            peer_alive=lambda: staging.reachable(session))
    except StagingError as exc:
        # the rounds the decode acknowledged scattering are in its pool; the rest may not be
        scattered = sum(1 for event, _ in events if event == "ack")
        verdict = staged_unwritten(manager, session, template, rounds, scattered,
                                   reason=f"staged {exc.reason} in round {exc.round}")
        pages = (f"; {scattered} rounds scattered, unwritten destination pages: {verdict}"
                 if verdict is not None else "")
        _log.error("kvplan: staged transfer to %s failed (%s, round %s): %s (status -1: SGLang "
                   "fails this request)%s", session, exc.reason, exc.round, exc, pages)
        staging.last[session] = ("failed", exc)
        return -1
    except Exception as exc:  # the open message could not be sent: nothing was written
        _log.error("kvplan: staged transfer to %s could not start: %s: %s (status -1)",
                   session, type(exc).__name__, exc)
        staging.last[session] = ("failed", exc)
        return -1
    metrics.observe_rounds(report.network_blocks, report.rounds)
    staging.last[session] = ("staged", report)
    # the direct plan's count beside the staged one: what staging saved this request, counted
    # by the core's validation (nothing planned)
    if _log.isEnabledFor(logging.INFO):  # the count walks the request: only when it is said
        direct = (choice.advice.direct_blocks if choice.advice is not None else
                  template.n_blocks_for(Request(src_pages, dst_pages, n_tokens=n_tokens)))
        _log.info("kvplan: staged request %s to %s: %d pages in %d rounds, %d network blocks "
                  "(direct plan: %d blocks); why: %s", request, session, len(src_pages),
                  report.rounds, report.network_blocks, direct, choice.why)
    return 0


# ---------------------------------------------------------------------------------------------
# The manager's layout identity (docs/identity.md, "At the handshake")
# ---------------------------------------------------------------------------------------------

#: SGLang's Mooncake transfer: the prefill writes into the decode's pools.
MOONCAKE_TRANSFER = "push"


class PeerIdentities(Protocol):
    """A manager's identity check and the decode sessions it refused (:class:`SglangStaging`,
    and :class:`IdentityExchange`, which the NIXL drop-in uses too)."""

    identity: PeerCheck
    refused: dict[str, IncompatiblePeerError]


def identity_field(holder: PeerIdentities) -> dict[str, Any]:
    """What a registration or open message adds: this side's identity message under
    :data:`kvplan.identity.IDENTITY_KEY` (nothing while it has none)."""
    message = holder.identity.message()
    return {} if message is None else {IDENTITY_KEY: message}


def check_registered(holder: PeerIdentities, session: str,
                     registration: dict[str, Any] | None) -> IncompatiblePeerError | None:
    """The prefill's verdict on the decode at ``session`` from its registration frame
    (``None`` or without the key: it sent no identity, said once): the refusal kept in
    ``holder.refused`` (and returned), else None."""
    sent = (registration or {}).get(IDENTITY_KEY)
    try:
        holder.identity.check(session, sent, local_role="prefill")
    except IncompatiblePeerError as err:
        holder.refused[session] = err
        return err
    holder.refused.pop(session, None)
    return None


def _override_rope(server_args: Any) -> Any:
    raw = getattr(server_args, "json_model_override_args", None)
    try:
        overrides = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        return None
    return hf_rope(overrides) if isinstance(overrides, dict) else None


def _kv_heads(manager: Any) -> tuple[int, int] | None:
    """The manager's ``(total KV heads, KV heads per rank)``: SGLang's ``kv_args`` where it set
    them (a prefill always does; a decode only with its own hetero-TP staging on), else the
    model's ``config.json`` (:mod:`kvplan.compat.sglang.model_config`: its directory, or the
    Hugging Face cache's snapshot of a hub id) with the core's per-rank rule for its attention TP
    size."""
    kv_args = manager.kv_args
    heads, per_rank = (getattr(kv_args, "total_kv_head_num", None),
                       getattr(kv_args, "kv_head_num", None))
    if isinstance(heads, int) and isinstance(per_rank, int) and heads >= 1 and per_rank >= 1:
        return heads, per_rank
    server_args = getattr(manager, "server_args", None)
    total = config_kv_heads(str(getattr(server_args, "model_path", "") or ""),
                            str(getattr(server_args, "revision", "") or ""))
    if total is None:
        return None
    return total, heads_per_rank(total, int(getattr(manager, "attn_tp_size", 1) or 1))


def manager_semantics(server_args: Any, transfer: str = MOONCAKE_TRANSFER) -> ModelSemantics:
    """The model semantics SGLang's ``server_args`` say: ``served_model_name`` (else
    ``model_path``), ``revision``, ``speculative_draft_model_path`` by its last path part, and
    the RoPE configuration of ``json_model_override_args`` (else of the model's
    ``config.json``: its directory's, or the Hugging Face cache's snapshot of a hub id). A field
    the arguments do not have is left undeclared. The name, not the path, as :func:`kvplan.compat.vllm.staging.
    worker_semantics` says why."""
    model_path = str(getattr(server_args, "model_path", "") or "")
    model = model_name_of(str(getattr(server_args, "served_model_name", "") or model_path))
    revision = str(getattr(server_args, "revision", "") or "")
    draft = getattr(server_args, "speculative_draft_model_path", None)
    drafts = (model_name_of(draft),) if isinstance(draft, str) and draft else ()
    rope = declarable_rope(_override_rope(server_args) or config_rope(model_path, revision))
    return ModelSemantics(model=model, revision=revision, rope=rope, drafts=drafts,
                          transfer=transfer)  # type: ignore[arg-type]


def _with_heads(layout: Layout, kv_args: Any, kv_heads: tuple[int, int] | None
                ) -> Layout | None:
    """``layout`` with SGLang's MHA geometry (NHD pages of ``kv_heads`` = (total, per rank)
    heads, each head's bytes as one element, as the staged template counts them), or None
    where the heads are unknown or do not divide the items."""
    if kv_heads is None:
        return None
    heads, per_rank = kv_heads
    page = layout.page_size
    raw = layout.to_dict()
    kinds = cast(list[str], raw["kinds"])
    items = {int(n) for n, kind in zip(kv_args.kv_item_lens, kinds) if kind == "page"}
    if len(items) != 1 or next(iter(items)) % (page * per_rank):
        return None
    raw.update(kv_heads=heads, heads_per_rank=per_rank,
               head_dim=next(iter(items)) // (page * per_rank), dtype_size=1,
               memory_order="NHD")
    try:
        return Layout.from_dict(raw)
    except KvPlanError:
        return None


def manager_identity(manager: Any, semantics: ModelSemantics | None = None) -> Any:
    """The manager's :class:`kvplan.LayoutIdentity`: its registered pools
    (``layouts.layout_from_kv_args`` with its attention TP and PP; for MHA pools, the heads
    of :func:`_kv_heads`) with ``semantics``, by default :func:`manager_semantics` of its
    ``server_args``. None where the arguments do not say the page size, or (MHA) the heads:
    a layout without them could refuse a pair SGLang plans (another TP size), so nothing is
    checked."""
    from kvplan.compat.sglang.layouts import layout_from_kv_args

    kv_args = manager.kv_args
    if not isinstance(getattr(kv_args, "page_size", None), int):
        return None
    mla = bool(getattr(manager, "is_mla_backend", False))
    layout = layout_from_kv_args(
        kv_args, is_mla_backend=mla, pp_size=int(getattr(manager, "pp_size", 1) or 1),
        attn_tp_size=int(getattr(manager, "attn_tp_size", 1) or 1))
    if not mla:
        with_heads = _with_heads(layout, kv_args, _kv_heads(manager))
        if with_heads is None:
            return None
        layout = with_heads
    if semantics is None:
        semantics = manager_semantics(getattr(manager, "server_args", None))
    return layout_identity(layout, semantics)


def _manager_role(manager: Any) -> str:
    mode = getattr(manager, "disaggregation_mode", None)
    name = str(getattr(mode, "value", mode) or "").lower()
    return "decode" if "decode" in name else "prefill"


def identity_with_metric(manager: Any) -> Any:
    """The manager's identity, once (a manager whose arguments kvplan cannot read has none:
    said once, its peers check nothing), with ``kvplan:layout_info`` set."""
    attrs = manager.__dict__
    if "_kvplan_identity" in attrs:
        return attrs["_kvplan_identity"]
    try:
        identity = manager_identity(manager)
    except Exception as exc:  # defensive: a manager of another shape
        _log.warning("kvplan: no layout identity for this manager (%s: %s): its peers check "
                     "no compatibility", type(exc).__name__, exc)
        identity = None
    attrs["_kvplan_identity"] = identity
    if identity is not None:
        metrics.note_layout(identity.class_id, identity.layout_id, _manager_role(manager))
    return identity
