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
  the prefill's agent and the prefill's regions as a layout (:func:`peer_agreement`).
* :func:`staged_read`: the decode's ``_read_blocks`` (kvplan's worker's) for a request the
  advice stages. The decode plans the rounds (a template of the prefill's layout and its own,
  after vLLM's own prefix-cache trim), opens the stream on the prefill's listener (an opening
  message with its layout and both page lists, :func:`kvplan.compat.vllm.staging.open_message`)
  and grants it; each round the prefill announces is read out of the prefill's arena through
  NIXL (:class:`kvplan.staging.NixlRoundReader`), scattered into the KV cache and acknowledged.
  vLLM keeps a :class:`StagedRead` where it keeps NIXL handles and polls it through the
  worker's agent (:class:`StagingAgent`): ``PROC``, then ``DONE`` (after vLLM's notification to
  the prefill, sent by kvplan once the last round was scattered) or ``ERR`` (vLLM's
  failed-receive path; the handle's verdict names the blocks not written).
* :func:`serve_rounds`: the prefill's listener (started with its arena, its address in the
  staging message) answers an opening message: it negotiates with the decode's message, plans
  the same rounds with its own layout as the source and runs
  :func:`kvplan.staging.send_staged` in pull mode on a thread of its own.

Staged reads are taken only where both sides are simple enough to plan here: one KV group,
host-memory KV caches whose blocks lie back to back, the same block size and TP size, no DCP,
no Mamba state, no mixed memory types; every other read is vLLM's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvplan.compat.vllm.nixl_layout import local_layout, remote_layout
from kvplan.staging import DirectFallback, Negotiated

__all__ = ["NixlPeer", "StagedRead", "StagingAgent", "advertise_staging", "kv_buffers",
           "negotiate_peer", "peer_agreement", "serve_rounds", "staged_read", "start_staging",
           "worker_staging"]

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
    #: The prefill rank's KV regions (:func:`remote_layout`; None: no staged read).
    layout: Any = None


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
        # the prefill's listener: decodes open their staged reads there
        host = str(worker.__dict__.get("side_channel_host") or "127.0.0.1")
        state.serve(worker, host, on_open=serve_rounds)

    agent = worker.nixl_wrapper
    state = start(worker, options, engine=agent, cost_engine="nixl", setup=setup)
    if state is not None:  # staged reads answer vLLM's polling of their handles
        worker.nixl_wrapper = StagingAgent(agent)
    return state


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


# ---------------------------------------------------------------------------------------------
# The layouts, buffers and rounds both sides plan with
# ---------------------------------------------------------------------------------------------

def kv_buffers(worker: Any) -> list[Any]:
    """The worker's registered KV regions (each its blocks' extent: base, blocks times block
    stride) as uint8 arrays, for a round's gather or scatter, which checks every block
    against them."""
    import kvplan
    from kvplan.staging import host_views

    d = worker.__dict__
    try:
        bases = [int(p) for p in d["kv_caches_base_addr"][d["engine_id"]][int(d["tp_rank"])]]
    except (KeyError, TypeError) as exc:
        raise kvplan.LayoutError("kvplan staging: the NIXL worker registered no KV regions "
                                 f"({exc!r})") from exc
    strides = list(d.get("block_stride_per_layer") or d.get("block_len_per_layer") or ())
    counts = list(d.get("region_num_blocks") or ()) or [int(d.get("num_blocks", 0))] * len(bases)
    if len(strides) != len(bases) or len(counts) != len(bases):
        raise kvplan.LayoutError(
            f"kvplan staging: {len(bases)} KV regions but {len(strides)} block strides and "
            f"{len(counts)} block counts")
    return host_views(sorted((b, int(n) * int(s)) for b, n, s in zip(bases, counts, strides)))


# ---------------------------------------------------------------------------------------------
# The decode: a staged read presented to vLLM as a transfer handle
# ---------------------------------------------------------------------------------------------

class StagedRead:
    """vLLM's handle of one staged read (in ``_recving_transfers`` where a NIXL handle would
    be): its state, asked by vLLM's own ``_pop_done_transfers`` through the worker's agent
    (:class:`StagingAgent`), is ``PROC`` until the last round's scatter, then ``DONE`` once
    vLLM's notification went to the prefill (``notify``), or ``ERR`` once the stream failed
    (vLLM's failed-receive path then runs; :attr:`verdict` names the blocks not written)."""

    def __init__(self, request: str, receiver: Any, notify: Any, template: Any,
                 rounds: Any, state: Any, *, peer: str = "?",
                 direct_descriptors: int | None = None) -> None:
        self.request, self.receiver, self.template, self.rounds = request, receiver, \
            template, rounds
        self._notify, self._state = notify, state
        #: The prefill engine and rank read from (for the read's log line).
        self.peer = peer
        #: The descriptors vLLM's own READ of the same blocks would take: one per block and
        #: KV region (None: not known).
        self.direct_descriptors = direct_descriptors
        self.notified = False
        #: The failure verdict (set once the stream failed, before vLLM sees ``ERR``): the
        #: blocks not written.
        self.verdict: Any = None
        self._verdict_lock = threading.Lock()
        self._judged = False
        self.started = time.monotonic()
        self.ended: float | None = None

    def state(self) -> str:
        """``PROC``, ``DONE`` or ``ERR``, as NIXL's ``check_xfer_state`` says them."""
        self._state.tick()  # every open stream's timeout, ended streams closed
        current = self.receiver.poll()
        if current == "loaded":
            if not self.notified:
                self.notified = True
                self.ended = time.monotonic()
                self._notify()
                self._said_done()
            return "DONE"
        if current == "failed":
            if self.receiver.error is not None:
                self.failed(self.receiver.error)
            return "ERR"
        return "PROC"

    def _said_done(self) -> None:
        """One INFO line per staged read, once its last round is scattered: the rounds, the
        network reads they took (one per round) against the descriptors vLLM's own READ of
        the same blocks takes, the bytes and the seconds from the read's start."""
        ended = self.ended if self.ended is not None else time.monotonic()
        direct = "?" if self.direct_descriptors is None else str(self.direct_descriptors)
        _staging_log.info(
            "kvplan staging: req %s read staged from %s: %d rounds, %d network reads "
            "(vLLM's read: %s descriptors), %d bytes in %.3f s", self.request, self.peer,
            len(self.rounds), len(self.rounds), direct,
            sum(int(r.manifest.bytes) for r in self.rounds), ended - self.started)

    def failed(self, error: Any) -> None:
        """The stream's failure: its verdict (the decode blocks of the rounds not scattered),
        made and logged once (by the stream's failure callback or vLLM's poll, whichever
        comes first)."""
        from kvplan.failures import verdict_for_unscattered_rounds

        with self._verdict_lock:  # vLLM sees ERR only once the verdict exists
            if self._judged:
                return
            self._judged = True
            self.ended = time.monotonic()
            try:
                self.verdict = verdict_for_unscattered_rounds(
                    self.request, self.template, self.rounds, self.receiver.scattered,
                    reason=f"{error.reason}: {error.detail}")
            except Exception as exc:  # the request still fails as a whole
                _staging_log.error("kvplan staging: no failure verdict for %r: %s",
                                   self.request, exc)
                return
        _staging_log.warning("kvplan staging: %s; vLLM's failed-receive path", self.verdict)

    def telemetry(self) -> Any:
        """What vLLM's stats record of a finished read (NIXL's telemetry fields, in µs): the
        staged request's bytes and its network blocks (one read per round)."""
        import types

        ended = self.ended if self.ended is not None else time.monotonic()
        total = sum(int(r.manifest.bytes) for r in self.rounds)
        return types.SimpleNamespace(xferDuration=(ended - self.started) * 1e6,
                                     postDuration=0.0, totalBytes=total,
                                     descCount=len(self.rounds))


class StagingAgent:
    """The decode worker's ``nixl_wrapper`` with staging on: vLLM's NIXL agent, but the
    handle calls vLLM makes while polling (``check_xfer_state``, ``get_xfer_telemetry``,
    ``release_xfer_handle``) answer for a :class:`StagedRead` themselves; everything else
    (and every NIXL handle) goes to the agent."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def check_xfer_state(self, handle: Any) -> Any:
        if isinstance(handle, StagedRead):
            return handle.state()
        return self.agent.check_xfer_state(handle)

    def get_xfer_telemetry(self, handle: Any) -> Any:
        if isinstance(handle, StagedRead):
            return handle.telemetry()
        return self.agent.get_xfer_telemetry(handle)

    def release_xfer_handle(self, handle: Any) -> Any:
        if isinstance(handle, StagedRead):
            return None  # nothing of NIXL's to release: each round's read released its own
        return self.agent.release_xfer_handle(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)


def _agent(worker: Any) -> Any:
    wrapper = worker.nixl_wrapper
    return wrapper.agent if isinstance(wrapper, StagingAgent) else wrapper


def staged_read(worker: Any, read_spec: Any, dst_engine_id: str, request_id: str,
                remote_request_id: str, expected_consumers: int) -> bool:
    """The decode's ``_read_blocks`` for one request and prefill rank, staged where it can
    be: staging on, the prefill agreed, its KV regions and this worker's have layouts, one KV
    group, the same TP size, no block-size ratio, DCP or mixed memory, and :func:`kvplan.staging.choose_path`
    says staged. Then the rounds are read from the prefill's arena through NIXL, scattered
    into this worker's KV cache, and a :class:`StagedRead` waits in ``_recving_transfers``;
    True. False: vLLM's own read runs (nothing was sent)."""
    import kvplan
    from kvplan.compat.vllm import staging as vstaging
    from kvplan.staging import (
        NixlRoundReader,
        ReceiveStaged,
        StagingAgreement,
        choose_path,
        local_copy,
    )

    state = worker_staging(worker)
    if state is None or not vstaging.host_kv(worker) or read_spec.block_ids_by_region:
        return False
    peer = peer_agreement(worker, dst_engine_id, read_spec.remote_rank)
    if peer is None or not peer.outcome.staged or peer.layout is None or peer.message is None:
        return False
    d = worker.__dict__
    topo = d.get("transfer_topo")
    info = topo.get_engine_info(dst_engine_id)
    local_ids, remote_ids = read_spec.local_block_ids, read_spec.remote_block_ids
    if d.get("_mixed_mem_types") or d.get("_has_mamba") or len(local_ids) != 1 or \
            not any(len(g) for g in local_ids) or int(d.get("dcp_size", 1) or 1) > 1 or \
            int(getattr(info, "remote_dcp_size", 1) or 1) > 1 or \
            topo.block_size_ratio(info.remote_block_size) != 1 or \
            int(getattr(info, "remote_tp_size", 0) or 0) != int(d.get("world_size", 1) or 1):
        return False  # one group, one block size, one TP size, no DCP: else vLLM's read
    layout = local_layout(worker)
    if layout is None:
        return False
    # vLLM's own trim of the decode's prefix-cache hit, as its read does
    local_ids, remote_ids = worker._apply_prefix_caching(
        decode_block_ids=local_ids, prefill_block_ids=remote_ids,
        decode_physical_per_logical=worker._physical_blocks_per_logical_kv_block,
        prefill_physical_per_logical=info.remote_physical_blocks_per_logical)
    agreement = peer.outcome
    if not isinstance(agreement, StagingAgreement):
        return False
    template: Any = kvplan.Template(peer.layout, layout, kvplan.Pairing.positional())
    src = kvplan._core.index_array(list(remote_ids[0]))
    dst = kvplan._core.index_array(list(local_ids[0]))
    choice = choose_path(template, (src, dst), state.costs, agreement, mode=state.config.mode)
    if not choice.staged:
        return False
    try:
        rounds = template.plan_rounds(src, dst, src_arena=agreement.src_arena,
                                      dst_arena=agreement.dst_arena, buffers=agreement.buffers)
        scatter = local_copy([state.arena.array], kv_buffers(worker))
    except kvplan.KvPlanError as exc:
        _staging_log.warning("req %s: kvplan could not plan staged rounds (%s: %s); direct "
                             "path", request_id, type(exc).__name__, exc)
        return False
    session = f"{dst_engine_id}:tp{read_spec.remote_rank}"
    channel = state.channel_to(session, peer.message)
    if channel is None:
        return False
    stream = f"{remote_request_id}@{d.get('engine_id')}:tp{d.get('tp_rank', 0)}"
    notif = f"{remote_request_id}:{expected_consumers}".encode()
    agent = _agent(worker)
    remote_agent: Any = peer.agent

    def notify() -> None:  # what NIXL's READ would have sent the prefill when it completed
        try:
            agent.send_notif(remote_agent, notif_msg=notif)
        except Exception as exc:
            _staging_log.warning("req %s: the notification to the prefill failed (%s): its "
                                 "blocks are freed when their lease expires", request_id, exc)
            stats = d.get("xfer_stats")
            if stats is not None and hasattr(stats, "record_failed_notification"):
                stats.record_failed_notification()

    handle: StagedRead | None = None

    def failed(error: Any) -> None:
        if handle is not None and error.reason != "cancelled":
            handle.failed(error)

    receiver = ReceiveStaged(
        stream, rounds, scatter, channel.send, writer=0, timeout_s=state.config.timeout_s,
        on_failed=failed,
        fetch=NixlRoundReader(agent, remote_agent, timeout_s=state.config.timeout_s))
    # vLLM's own READ of these blocks: one descriptor per block and region pair
    handle = StagedRead(request_id, receiver, notify, template, rounds, state, peer=session,
                        direct_descriptors=int(template.n_pairs) * len(dst))
    staged = vstaging.StagedRequest(stream, template, (peer.layout, layout), src, dst,
                                    agreement, choice.why, rounds)
    state.router.open(stream, 0, receiver.on_message)
    try:
        channel.open(vstaging.open_message(staged, stream=stream, peer=state.name,
                                           rank=int(d.get("tp_rank", 0) or 0),
                                           capabilities=state.capabilities()))
    except Exception as exc:  # nothing was read: vLLM's own read takes the request
        state.router.close(stream)
        _staging_log.warning("req %s: opening the staged read failed (%s); direct path",
                             request_id, exc)
        return False
    state.receivers[stream] = receiver
    state.shares.admit(receiver)  # the grant: the prefill starts gathering
    worker._recving_transfers[request_id].append(handle)
    return True


# ---------------------------------------------------------------------------------------------
# The prefill: its listener serves the rounds a decode reads
# ---------------------------------------------------------------------------------------------

def serve_rounds(worker: Any, data: bytes, reply: Any) -> str:
    """The prefill's answer to a decode's opening message (its listener's ``on_open``):
    negotiate with the decode's staging message, plan the same rounds with this worker's own
    layout as the source, and run :func:`kvplan.staging.send_staged` in pull mode on a thread
    of its own: each round gathered into this worker's arena, then announced for the decode
    to read; it ends after the decode's last acknowledgement. A request it cannot serve is
    refused at once with a failure message (the decode's read fails, vLLM's failed-receive
    path). vLLM frees the request's blocks on the decode's notification, which the decode
    sends after the last round's scatter: after every gather here."""
    import threading

    import numpy as np

    import kvplan
    from kvplan.compat.vllm import staging as vstaging
    from kvplan.staging import AckQueue, StagingError, local_copy, send_staged
    from kvplan.staging.wire import FAIL, encode

    state = worker_staging(worker)
    opening = vstaging._read_open(data)
    stream = str(opening["stream"])
    peer = str(opening.get("peer", "?"))
    try:
        agreement = state.agreement(peer, opening["capabilities"], sending=True,
                                    remote_rank=int(opening["rank"]))
        if not agreement.staged:
            raise StagingError.make(stream, 0, "bad_message",
                                    f"no staging agreement with {peer}: {agreement.reason}")
        layout = local_layout(worker)
        if layout is None or not vstaging.host_kv(worker):
            raise StagingError.make(stream, 0, "bad_message",
                                    "this prefill's KV regions take no staged rounds")
        template: Any = kvplan.Template(layout,
                                        kvplan.Layout.from_dict(opening["dst_layout"]),
                                        kvplan.Pairing.positional())
        rounds = template.plan_rounds(np.asarray(opening["src_pages"], np.int64),
                                      np.asarray(opening["dst_pages"], np.int64),
                                      src_arena=agreement.src_arena,
                                      dst_arena=agreement.dst_arena,
                                      buffers=agreement.buffers)
        gather = local_copy(kv_buffers(worker), [state.arena.array])
    except (kvplan.KvPlanError, StagingError, KeyError, TypeError, ValueError) as exc:
        _staging_log.error("kvplan staging: cannot serve %r to %s: %s", stream, peer, exc)
        reply(encode(FAIL, stream, writer=0, round_index=0,
                     payload=f"bad_message: {type(exc).__name__}: {exc}".encode()[:4096]))
        return stream
    acks = AckQueue()
    state.router.open(stream, 0, acks.put)

    def send() -> None:
        try:
            send_staged(rounds, None, peer, reply, request=stream, acks=acks, writer=0,
                        gather=gather, buffers=agreement.buffers, src_lock=state.arena.lock,
                        timeout_s=state.config.timeout_s, pull=True)
        except StagingError as exc:
            _staging_log.warning("kvplan staging: serving %r to %s failed: %s", stream,
                                 peer, exc)
        finally:
            state.router.close(stream)

    threading.Thread(target=send, name=f"kvplan-staging-serve-{stream}", daemon=True).start()
    return stream
