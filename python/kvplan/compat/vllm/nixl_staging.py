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
* :func:`check_held`: the decode's ``_read_blocks`` before vLLM's own read of a prefill it
  negotiated staging with: the prefill's listener is asked whether it still holds the request
  with those pages, in every KV group the read names (:func:`serve_hold`, the stream's rule),
  pinning it; a refusal, no answer
  or no listener fails the request (:class:`RefusedRead`, vLLM's failed-receive path) and
  nothing is read.
* :func:`stop_aborted_reads`: the decode's ``start_load_kv`` stops the staged read of a
  request vLLM finished during it (aborted, failed; kvplan's scheduler side sends them,
  :data:`ABORTED_META`) at the next round boundary (:meth:`StagedRead.abort`).
* :func:`serve_rounds`: the prefill's listener (started with its arena, its address in the
  staging message) answers an opening message: it negotiates with the decode's message, plans
  the same rounds with its own layout as the source and runs
  :func:`kvplan.staging.send_staged` in pull mode on a thread of its own.

Staged reads are taken only where both sides are simple enough to plan here: one KV group,
host-memory KV caches whose blocks lie back to back, the same block size, no DCP, no Mamba
state, no mixed memory types, and TP sizes that are equal or that vLLM slices heads between
(:func:`_tp_pair_staged`): then each (request, prefill rank) read vLLM makes is one staged
stream, its rounds planned by the core from both layouts' TP coordinates; every other read is
vLLM's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvplan.compat.vllm.nixl_layout import local_layout, remote_layout
from kvplan.staging import DirectFallback, Negotiated

__all__ = ["NixlPeer", "SendLeases", "StagedRead", "StagingAgent", "advertise_staging",
           "attach_sent_blocks", "check_held", "close_staging", "kv_buffers",
           "negotiate_peer", "RefusedRead",
           "note_finished", "peer_agreement", "record_sent_blocks", "send_leases",
           "serve_rounds", "staged_read", "start_staging", "stop_aborted_reads",
           "worker_staging"]

_staging_log = logging.getLogger("vllm.kvplan.staging")

#: What a staged read stopped on vLLM's abort says (its stream's ``cancelled`` detail).
ABORTED_DETAIL = "vLLM finished the request during its staged read"

#: The worker attribute holding the decode's outcome per prefill engine and rank.
PEERS_ATTR = "_kvplan_staging_peers"

#: The key of the prefill's staging message saying its listener answers a held check
#: (:func:`check_held`), and the key of a held check's opening message giving its form. A
#: prefill whose message lacks it (an older kvplan) is read directly as before, said once per
#: peer. Form 1 (:data:`HOLD_ONE_GROUP`) names the pages of one KV group (``src_pages``), form
#: 2 (:data:`HOLD_VERSION`) the pages of every KV group the read names (``group_pages``, one
#: list per group, in vLLM's group order). A prefill advertises form 1 under this key, which
#: every kvplan decode that knows the held check reads, and form 2 beside it under
#: :data:`HOLD_GROUPS_KEY`; it answers both. A prefill offering form 1 only is asked in that
#: form for a read of one group; a read of several groups from it runs unchecked, said once
#: per peer.
HOLD_KEY = "nixl_hold"
HOLD_VERSION = 2
#: The first held check's form (one KV group).
HOLD_ONE_GROUP = 1
#: The key of the prefill's staging message saying its listener also answers form 2.
HOLD_GROUPS_KEY = "nixl_hold_groups"
#: The worker attribute holding the peers already said to take no held check.
UNCHECKED_ATTR = "_kvplan_unchecked_peers"

#: The key of the prefill's staging message giving its KV lease in seconds (vLLM's
#: ``kv_lease_duration``: how long it keeps a finished request's blocks for a decode it hears
#: nothing from). Without ``kvplan_staging_timeout_s`` both sides of a staged read wait that
#: long for a round (:meth:`kvplan.staging.StagingConfig.patience`); a prefill whose message
#: lacks it (an older kvplan) is waited for as before.
LEASE_KEY = "lease_s"
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


def worker_staging(worker: Any) -> Any:
    """The worker's :class:`kvplan.compat.vllm.staging.WorkerStaging` (None: staging off)."""
    from kvplan.compat.vllm.staging import STAGING_ATTR

    return worker.__dict__.get(STAGING_ATTR)


def start_staging(worker: Any, options: dict[str, Any], lease_s: float | None = None) -> Any:
    """The NIXL worker's staging start-up (the connector's constructor): with a
    ``kvplan_staging`` key other than ``off``, the arena registered with the worker's NIXL
    agent (``nixl_wrapper``), the engine's costs (given, else for ``auto`` NIXL's measured on
    loopback) and the one start-up line; None and nothing allocated otherwise. ``lease_s``:
    the prefill's KV lease (:func:`vllm_lease_s`), which its staging message carries."""
    from kvplan.compat.vllm.staging import start_staging as start

    def setup(state: Any) -> None:
        state.name = str(worker.__dict__.get("engine_id") or "")
        # the prefill's listener: decodes open their staged reads there
        host = str(worker.__dict__.get("side_channel_host") or "127.0.0.1")
        state.lease_s = lease_s
        state.serve(worker, host, on_open=serve_rounds,
                    on_close=lambda streams: _decode_gone(worker, streams))

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
    message = state.capabilities()
    message[HOLD_KEY] = HOLD_ONE_GROUP  # this listener answers held checks: form 1, which
    message[HOLD_GROUPS_KEY] = HOLD_VERSION  # every decode knows, and form 2 beside it
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
        #: Set once :meth:`abort` stopped the read (vLLM finished the request during it).
        self.aborted = False
        self._stopping: threading.Thread | None = None
        #: The failure verdict (set once the stream failed, before vLLM sees ``ERR``): the
        #: blocks not written.
        self.verdict: Any = None
        self._verdict_lock = threading.Lock()
        self._judged = False
        self.started = time.monotonic()
        self.ended: float | None = None

    def state(self) -> str:
        """``PROC``, ``DONE`` or ``ERR``, as NIXL's ``check_xfer_state`` says them. vLLM's
        step polls this: it never waits for a round being read and scattered (``PROC``
        then, the next poll sees the round's outcome)."""
        # every open stream's timeout, ended streams closed; a busy one at the next check
        self._state.tick(block=False)
        if self._stopping is not None and self._stopping.is_alive():
            return "PROC"  # vLLM's abort: the round in progress ends first
        current = self.receiver.poll(block=False)
        if current == "loaded":
            if not self.notified:
                self.notified = True
                self.ended = time.monotonic()
                self._notify()
                self._said_done()
            return "DONE"
        if current == "failed":
            if self.aborted:  # stopped on vLLM's abort: nothing of it is in flight
                if not self.notified:
                    self.notified = True
                    self._notify()  # the prefill frees the request
                return "DONE"
            if self.receiver.error is not None:
                self.failed(self.receiver.error)
            return "ERR"
        return "PROC"

    def abort(self, detail: str = ABORTED_DETAIL) -> bool:
        """vLLM finished the request (aborted it, or freed it otherwise) while this read was
        in progress: stop the stream at the next round boundary, on a thread of its own so
        vLLM's step does not wait for it (a round being read and scattered now ends first; no
        later round is read or scattered), and tell the prefill the stream is cancelled (its
        send stops and its hold on the request ends). Until it stopped vLLM's polling sees
        ``PROC``; then ``DONE``, not its failed-receive path (nothing failed), once vLLM's
        notification went to the prefill, as vLLM's own read sends it when done, so the
        prefill frees the request. vLLM then frees the decode's blocks, which nothing of this
        read writes any more. Whether a stop was started (False: the read had already ended,
        or is stopping)."""
        if self.receiver.state != "receiving" or self._stopping is not None:
            return False
        self._stopping = threading.Thread(target=self._stop, args=(detail,), daemon=True,
                                          name=f"kvplan-staging-abort-{self.request}")
        self._stopping.start()
        return True

    def _stop(self, detail: str) -> None:
        self.receiver.cancel(detail)  # waits for a round's scatter in progress
        error = self.receiver.error
        if self.receiver.failed and error is not None and error.reason == "cancelled" \
                and error.detail == detail:
            self.ended = time.monotonic()
            self.aborted = True
            _staging_log.info(
                "kvplan staging: req %s finished by vLLM during its staged read from %s: "
                "stopped after %d of %d rounds", self.request, self.peer,
                self.receiver.scattered, len(self.rounds))
        # else it ended otherwise first (loaded, or failed): vLLM's polling sees that

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
        # an aborted read counts the rounds it read
        rounds = [self.rounds[k] for k in range(self.receiver.scattered)] if self.aborted \
            else list(self.rounds)
        total = sum(int(r.manifest.bytes) for r in rounds)
        return types.SimpleNamespace(xferDuration=(ended - self.started) * 1e6,
                                     postDuration=0.0, totalBytes=total,
                                     descCount=len(rounds))


class StagingAgent:
    """The decode worker's ``nixl_wrapper`` with staging on: vLLM's NIXL agent, but the
    handle calls vLLM makes while polling (``check_xfer_state``, ``get_xfer_telemetry``,
    ``release_xfer_handle``) answer for a :class:`StagedRead` themselves; everything else
    (and every NIXL handle) goes to the agent."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def check_xfer_state(self, handle: Any) -> Any:
        if isinstance(handle, (StagedRead, RefusedRead, HeldRead, AbortedRead)):
            return handle.state()
        return self.agent.check_xfer_state(handle)

    def get_xfer_telemetry(self, handle: Any) -> Any:
        if isinstance(handle, (StagedRead, RefusedRead, HeldRead, AbortedRead)):
            return handle.telemetry()
        return self.agent.get_xfer_telemetry(handle)

    def release_xfer_handle(self, handle: Any) -> Any:
        if isinstance(handle, HeldRead):  # vLLM's own read's NIXL handles, if it started
            return handle.release()
        if isinstance(handle, (StagedRead, RefusedRead, AbortedRead)):
            return None  # nothing of NIXL's to release: each round's read released its own
        return self.agent.release_xfer_handle(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)


def _agent(worker: Any) -> Any:
    wrapper = worker.nixl_wrapper
    return wrapper.agent if isinstance(wrapper, StagingAgent) else wrapper


@dataclass(frozen=True)
class _ReadNames:
    """What a staged read and a held check both derive from vLLM's read of one request and
    prefill rank: the prefill rank's session (its channel) and the stream's name, and
    (:meth:`trimmed`) the block ids left after vLLM's own prefix-cache trim."""

    worker: Any
    read_spec: Any
    engine: str
    session: str
    stream: str

    def trimmed(self) -> tuple[Any, Any]:
        """The decode's and the prefill's block ids per KV group after vLLM's trim of the
        decode's prefix-cache hit, as vLLM's own read trims them."""
        worker = self.worker
        info = worker.__dict__["transfer_topo"].get_engine_info(self.engine)
        local_ids, remote_ids = worker._apply_prefix_caching(
            decode_block_ids=self.read_spec.local_block_ids,
            prefill_block_ids=self.read_spec.remote_block_ids,
            decode_physical_per_logical=worker._physical_blocks_per_logical_kv_block,
            prefill_physical_per_logical=info.remote_physical_blocks_per_logical)
        return local_ids, remote_ids


def _read_names(worker: Any, read_spec: Any, dst_engine_id: str,
               remote_request_id: str) -> _ReadNames:
    """The :class:`_ReadNames` of vLLM's read of ``remote_request_id`` from the prefill
    ``dst_engine_id``'s rank ``read_spec.remote_rank``."""
    d = worker.__dict__
    stream = f"{remote_request_id}@{d.get('engine_id')}:tp{d.get('tp_rank', 0)}"
    engine_info = getattr(d.get("transfer_topo"), "get_engine_info", None)
    info = engine_info(dst_engine_id) if engine_info is not None else None
    if int(getattr(info, "remote_tp_size", 0) or 0) > int(d.get("world_size", 1) or 1):
        # this decode rank reads the request from several prefill ranks: a stream each
        stream += f"<tp{read_spec.remote_rank}"
    return _ReadNames(worker, read_spec, str(dst_engine_id),
                     f"{dst_engine_id}:tp{read_spec.remote_rank}", stream)


def _opening_message(state: Any, worker: Any, *, stream: str, request: str,
                    staged: Any = None, held_pages: list[list[int]] | None = None,
                    hold_form: int = HOLD_VERSION) -> bytes:
    """The decode's opening message on the prefill's listener, one form for both uses: the
    stream, this decode's name, rank and staging message and the prefill's request, then
    either a staged read's layouts and pages (``staged``,
    :func:`kvplan.compat.vllm.staging.open_message`) or a held check's :data:`HOLD_KEY` and
    the prefill pages vLLM's read names per KV group (``held_pages``; it opens no stream), in
    the check's form ``hold_form`` (:data:`HOLD_ONE_GROUP`: the one group's pages as
    ``src_pages``; else every group's as ``group_pages``)."""
    import json

    from kvplan.compat.vllm import staging as vstaging

    header: dict[str, Any] = {"stream": stream, "peer": state.name,
                              "rank": int(worker.__dict__.get("tp_rank", 0) or 0),
                              "capabilities": state.capabilities(), "request": request}
    if staged is not None:
        return vstaging.open_message(staged, **header)
    groups = [[int(p) for p in g] for g in held_pages or ()]
    pages: dict[str, Any] = {"src_pages": [p for g in groups for p in g]} \
        if hold_form == HOLD_ONE_GROUP else {"group_pages": groups}
    return json.dumps({**header, "writer": 0, HOLD_KEY: hold_form, **pages},
                      separators=(",", ":")).encode()


def staged_read(worker: Any, read_spec: Any, dst_engine_id: str, request_id: str,
                remote_request_id: str, expected_consumers: int) -> bool:
    """The decode's ``_read_blocks`` for one request and prefill rank, staged where it can
    be: staging on, the prefill agreed, its KV regions and this worker's have layouts, one KV
    group, TP sizes :func:`_tp_pair_staged` takes, no block-size ratio, DCP or mixed memory,
    and :func:`kvplan.staging.choose_path` says staged. Between TP sizes the core plans the
    head slice the two ranks share (the layouts carry their TP coordinates), and the rounds
    must move the bytes vLLM's read of this prefill rank moves (else not staged, said once).
    Then the rounds are read from the prefill's arena through NIXL, scattered into this
    worker's KV cache, and a :class:`StagedRead` waits in ``_recving_transfers``; True.
    False: vLLM's own read runs (nothing was sent)."""
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
            topo.block_size_ratio(info.remote_block_size) != 1:
        return False  # one group, one block size, no DCP: else vLLM's read
    layout = local_layout(worker)
    if layout is None:
        return False
    remote_tp = int(getattr(info, "remote_tp_size", 0) or 0)
    if not _tp_pair_staged(worker, dst_engine_id, remote_tp, peer.layout, layout):
        return False  # TP sizes whose head slices vLLM reads otherwise: said once
    # vLLM's own trim of the decode's prefix-cache hit, as its read does
    names = _read_names(worker, read_spec, dst_engine_id, remote_request_id)
    local_ids, remote_ids = names.trimmed()
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
    # the bytes vLLM's read of this prefill rank moves: the decode blocks' whole regions
    # (MLA: whole on every rank), or this rank's share of them where vLLM's own TP mapping
    # reads this decode rank's blocks from several prefill ranks
    mapping = (d.get("tp_mappings") or {}).get(dst_engine_id)
    reads = 1 if d.get("use_mla") else len(getattr(mapping, "all_source_ranks", ()) or (0,))
    want = len(dst) * sum(int(n) for n in d.get("block_len_per_layer") or ()) // reads
    planned = sum(int(r.manifest.bytes) for r in rounds)
    if planned != want:  # the core pairs other heads than vLLM's read: never staged
        _say_unstaged(worker, dst_engine_id, remote_tp,
                      f"the staged rounds move {planned} bytes of prefill rank "
                      f"{read_spec.remote_rank} where vLLM's read moves {want}")
        return False
    session, stream = names.session, names.stream
    channel = state.channel_to(session, peer.message)
    if channel is None:
        return False
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

    if _take_pending_abort(worker, request_id):
        # vLLM finished the request before its read started: nothing is read, the prefill
        # is notified as vLLM's read notifies it (it frees the request), vLLM sees it done
        _staging_log.info("kvplan staging: req %s finished by vLLM before its staged read "
                          "from %s started: nothing read", request_id, session)
        notify()
        worker._recving_transfers[request_id].append(AbortedRead())
        return True
    handle: StagedRead | None = None

    def failed(error: Any) -> None:
        if handle is not None and error.reason != "cancelled":
            handle.failed(error)

    # the prefill's lease, as its message gives it, unless a timeout was given here; a
    # prefill that is gone fails the read once its channel closes, not after this
    patience = state.config.patience(peer.message.get(LEASE_KEY))
    receiver = ReceiveStaged(
        stream, rounds, scatter, channel.send, writer=0, timeout_s=patience,
        on_failed=failed,
        fetch=NixlRoundReader(agent, remote_agent, timeout_s=patience,
                              gone=lambda: bool(getattr(channel, "closed", False))))
    # vLLM's own READ of these blocks: one descriptor per block and region pair
    handle = StagedRead(request_id, receiver, notify, template, rounds, state, peer=session,
                        direct_descriptors=int(template.n_pairs) * len(dst))
    staged = vstaging.StagedRequest(stream, template, (peer.layout, layout), src, dst,
                                    agreement, choice.why, rounds)
    state.router.open(stream, 0, receiver.on_message)
    vstaging.track_stream(channel, stream)
    try:
        channel.open(_opening_message(state, worker, stream=stream,
                                     request=remote_request_id, staged=staged))
    except Exception as exc:  # nothing was read: vLLM's own read takes the request
        state.router.close(stream)
        _staging_log.warning("req %s: opening the staged read failed (%s); not staged",
                             request_id, exc)
        return False
    state.receivers[stream] = receiver
    state.shares.admit(receiver)  # the grant: the prefill starts gathering
    worker._recving_transfers[request_id].append(handle)
    return True


class AbortedRead:
    """vLLM's handle of a staged read stopped before it started (vLLM finished the request
    first, :func:`stop_aborted_reads`): ``DONE`` at once, nothing read, no verdict."""

    verdict: Any = None

    def state(self) -> str:
        return "DONE"

    def telemetry(self) -> Any:
        import types

        return types.SimpleNamespace(xferDuration=0.0, postDuration=0.0, totalBytes=0,
                                     descCount=0)


#: The worker attribute holding the prefill engines whose TP pair was said unstaged.
UNSTAGED_TP_ATTR = "_kvplan_unstaged_tp"


def _say_unstaged(worker: Any, engine: str, remote_tp: int, why: str) -> None:
    """Say once per prefill engine that its reads are vLLM's own (INFO: a configuration, not a
    failure)."""
    said = worker.__dict__.setdefault(UNSTAGED_TP_ATTR, set())
    if engine in said:
        return
    said.add(engine)
    _staging_log.info(
        "kvplan staging: reads of engine %s (TP %d) by this decode (TP %d) are vLLM's own: %s",
        engine, remote_tp, int(worker.__dict__.get("world_size", 1) or 1), why)


def _tp_pair_staged(worker: Any, engine: str, remote_tp: int, remote: Any, local: Any) -> bool:
    """Whether a read between the prefill's TP size ``remote_tp`` and this decode's may be
    staged: the same size; or one dividing the other (as vLLM's NIXL connector requires)
    with MLA (every rank holds the whole latent, read from one prefill rank), or with whole
    KV heads per rank on both sides in blocks whose heads are outermost (``remote`` and
    ``local`` ``HND``, the layout vLLM slices heads in: a decode rank's heads are one range
    of the prefill rank's block, or the prefill rank's one range of the decode's). KV heads
    fewer than a TP size (vLLM then reads one rank of those that hold a head alike) stay
    vLLM's. A pair not staged is said once per prefill engine."""
    local_tp = int(worker.__dict__.get("world_size", 1) or 1)
    if remote_tp == local_tp:
        return True
    if remote_tp < 1 or max(remote_tp, local_tp) % min(remote_tp, local_tp):
        why = "neither TP size divides the other"
    elif worker.__dict__.get("use_mla"):
        return True
    elif not remote.kv_heads or remote.kv_heads != local.kv_heads:
        why = f"the KV heads differ ({remote.kv_heads} and {local.kv_heads})"
    elif remote.kv_heads % max(remote_tp, local_tp):
        why = (f"{remote.kv_heads} KV heads are not whole per rank at TP "
               f"{max(remote_tp, local_tp)}")
    elif remote.memory_order != "HND" or local.memory_order != "HND":
        why = (f"head slices need blocks with the heads outermost (LBHNC) on both sides, not "
               f"{remote.memory_order} and {local.memory_order}")
    else:
        return True
    _say_unstaged(worker, engine, remote_tp, why)
    return False


class RefusedRead:
    """vLLM's handle of a direct read kvplan did not start (:func:`check_held`): the prefill
    refused to hold the request, or could not be asked. vLLM's polling sees ``ERR`` at once
    and takes its failed-receive path; :attr:`verdict` names the blocks not written (every
    block the read was to write: none was)."""

    def __init__(self, verdict: Any) -> None:
        self.verdict = verdict

    def state(self) -> str:
        return "ERR"

    def telemetry(self) -> Any:
        import types

        return types.SimpleNamespace(xferDuration=0.0, postDuration=0.0, totalBytes=0,
                                     descCount=0)


def check_held(worker: Any, read_spec: Any, dst_engine_id: str, request_id: str,
               remote_request_id: str, start: Any) -> bool | None:
    """The decode's ``_read_blocks`` before vLLM's own (direct) read of a prefill it
    negotiated staging with: the prefill's listener is asked whether it still holds
    ``remote_request_id`` with exactly the pages the read names (the staged stream's rule,
    :meth:`SendLeases.hold`), which pins it there until vLLM's notification frees it or a
    bounded time passes. ``start`` runs vLLM's own read (its ``_read_blocks`` with the same
    arguments). Nothing here waits for the answer: vLLM's step goes on.

    Every KV group the read names is checked: the question carries the prefill's pages per
    group and the prefill checks each against vLLM's block ids of that group for the request.

    None: nothing to ask (staging off here, no agreement with that prefill, a full
    prefix-cache hit, or, said once per peer, a prefill whose message offers no held check,
    a read of several KV groups from a prefill answering only the one-group form, or a
    region-mapped read, ``block_ids_by_region``, whose pages are per region, not per group):
    vLLM's read runs now, unchecked. True: the question is out and a
    :class:`HeldRead` waits in ``_recving_transfers``; vLLM's polling starts vLLM's read once
    the prefill acknowledged. False: the prefill's listener cannot be reached; a
    :class:`RefusedRead` with the verdict naming the read's blocks waits there for vLLM's
    failed-receive path and nothing is read."""
    from kvplan.failures import FailureVerdict
    from kvplan.staging.wire import WireError, decode

    state = worker_staging(worker)
    if state is None:
        return None
    peer = peer_agreement(worker, dst_engine_id, read_spec.remote_rank)
    if peer is None or not peer.outcome.staged or peer.message is None:
        return None  # no kvplan listener negotiated with that prefill: today's read
    names = _read_names(worker, read_spec, dst_engine_id, remote_request_id)
    session = names.session
    offered = peer.message.get(HOLD_KEY)
    if not isinstance(offered, int) or isinstance(offered, bool) or offered < HOLD_ONE_GROUP:
        _said_unchecked(worker, session, "offers no held check (an older kvplan)")
        return None
    if not any(len(g) for g in read_spec.local_block_ids):
        return None  # a full prefix-cache hit: vLLM reads nothing
    if read_spec.block_ids_by_region:
        _said_unchecked(worker, session, "is read region by region (block_ids_by_region: "
                        "pages per region, not per KV group)")
        return None
    form = HOLD_VERSION if peer.message.get(HOLD_GROUPS_KEY) == HOLD_VERSION or \
        offered >= HOLD_VERSION else HOLD_ONE_GROUP
    local_ids, remote_ids = names.trimmed()
    src_pages = [[int(p) for p in g] for g in remote_ids]
    if form == HOLD_ONE_GROUP and sum(1 for g in src_pages if g) != 1:
        _said_unchecked(worker, session, "answers the held check of one KV group only (an "
                        "older kvplan), and its reads name several")
        return None
    stream = f"hold:{names.stream}"
    blocks = {g: tuple(sorted({int(b) for b in ids})) for g, ids in enumerate(local_ids)
              if len(ids)}
    wait_s = float(state.config.timeout_s) + 1.0  # the prefill's own wait, and 1 s
    handle = HeldRead(worker, request_id, remote_request_id, session, stream, blocks, start,
                      wait_s)

    def on_message(data: bytes) -> None:  # the channel's reader thread
        try:
            handle.answered(decode(data))
        except WireError as exc:
            handle.answered(exc)

    channel = state.channel_to(session, peer.message)
    if channel is None:
        reason = (f"unreachable: the staging listener of {session} cannot be reached, and "
                  "a read of a prefill that negotiated staging is not made unchecked")
    else:
        handle.channel = channel
        state.router.open(stream, 0, on_message)
        try:
            channel.open(_opening_message(state, worker, stream=stream,
                                         request=remote_request_id, held_pages=src_pages,
                                         hold_form=form))
        except Exception as exc:
            state.router.close(stream)
            reason = f"unreachable: asking {session} failed ({type(exc).__name__}: {exc})"
        else:
            worker._recving_transfers[request_id].append(handle)
            return True
    verdict = FailureVerdict(request_id, blocks, reason)
    _said_refused(verdict, remote_request_id)
    worker._recving_transfers[request_id].append(RefusedRead(verdict))
    return False


def _said_unchecked(worker: Any, session: str, why: str) -> None:
    """Say once per prefill rank (``session``) that vLLM's direct reads of it run unchecked,
    and why."""
    said = worker.__dict__.setdefault(UNCHECKED_ATTR, set())
    if (session, why) not in said:
        said.add((session, why))
        _staging_log.warning("kvplan staging: %s %s: vLLM's direct reads of it run unchecked",
                             session, why)


def _said_refused(verdict: Any, remote_request_id: str) -> None:
    # the staged read's verdict line (one form for both), then what was asked
    _staging_log.warning("kvplan staging: %s; vLLM's failed-receive path (the held check "
                         "before vLLM's read of prefill request %s: nothing read)", verdict,
                         remote_request_id)


class HeldRead:
    """vLLM's handle of a direct read waiting for the prefill's answer to its held check
    (:func:`check_held`), in ``_recving_transfers`` where vLLM's read's NIXL handle would be.
    vLLM's polling of it (``check_xfer_state`` through :class:`StagingAgent`, on vLLM's own
    thread, the one its reads start on) sees ``PROC`` while the answer is pending; on the
    prefill's acknowledgement that poll starts vLLM's own read (:attr:`start`) and from then on
    this handle answers for that read's NIXL handles (their state, telemetry and release);
    on a refusal, a bad answer, a closed channel or no answer within :attr:`wait_s` it says
    ``ERR`` with a :attr:`verdict` naming every block the read was to write (nothing was
    read), as :class:`RefusedRead` does. :attr:`clock` is the clock of that wait."""

    def __init__(self, worker: Any, request: str, remote_request: str, session: str,
                 stream: str, blocks: dict[int, tuple[int, ...]], start: Any,
                 wait_s: float) -> None:
        self.worker, self.request, self.remote_request = worker, request, remote_request
        self.session, self.stream, self.blocks = session, stream, blocks
        self.start, self.wait_s = start, wait_s
        self.clock: Any = time.monotonic
        self.asked = self.clock()
        #: The channel the question went on (its closing fails the check at once).
        self.channel: Any = None
        self._answer: list[Any] = []
        #: The prefill's answer, as this handle's polling took it: None while pending,
        #: ``"held"``, or ``"refused"``.
        self.outcome: str | None = None
        #: vLLM's read's NIXL handles once it started (None before).
        self.handles: list[Any] | None = None
        #: Whether vLLM's ``_read_blocks`` posted its read (False: vLLM routed the request to
        #: its failure reporting when posting it).
        self.posted: bool | None = None
        self.verdict: Any = None

    def answered(self, answer: Any) -> None:
        """The prefill's answer (a decoded message, or what failed to decode); the first
        counts. Called on the channel's reader thread."""
        self._answer.append(answer)

    def _agent(self) -> Any:
        return _agent(self.worker)

    def state(self) -> str:
        if self.outcome is None:
            self._judge()
        if self.outcome == "refused":
            return "ERR"
        if self.outcome is None:
            return "PROC"
        if self.handles is None:
            self._start()
        assert self.handles is not None
        if not self.posted and not self.handles:
            # vLLM's read failed to start: its start-up failure path counted the failed
            # transfer and reports the request failed; this handle ends without counting it
            # again (``DONE`` with no telemetry: vLLM records no transfer for it)
            return "DONE"
        states = [self._agent().check_xfer_state(h) for h in self.handles]
        if any(s not in ("DONE", "PROC") for s in states):
            return "ERR"
        if "PROC" in states:
            return "PROC"
        return "DONE" if self.posted else "ERR"

    def _judge(self) -> None:
        from kvplan.failures import FailureVerdict
        from kvplan.staging.wire import ACK, FAIL, Message

        got = self._answer[0] if self._answer else None
        if isinstance(got, Message) and got.kind == ACK:
            self.outcome = "held"
            self._close()
            return
        if isinstance(got, Message) and got.kind == FAIL:
            reason = f"peer_failed: {got.payload.decode(errors='replace')}"
        elif isinstance(got, Message):
            reason = f"bad_message: a {got.kind_name} message answered the held check"
        elif got is not None:
            reason = f"bad_message: the held check's answer could not be read ({got})"
        elif getattr(self.channel, "closed", False):
            reason = (f"unreachable: the staging channel to {self.session} closed before it "
                      "answered the held check")
        elif self.clock() - self.asked >= self.wait_s:
            reason = f"timeout: {self.session} did not answer the held check within " \
                     f"{self.wait_s:g} s"
        else:
            return
        self.outcome = "refused"
        self._close()
        self.verdict = FailureVerdict(self.request, self.blocks, reason)
        _said_refused(self.verdict, self.remote_request)

    def _close(self) -> None:
        state = worker_staging(self.worker)
        if state is not None:
            state.router.close(self.stream)

    def _start(self) -> None:
        """vLLM's own read, started on this (vLLM's polling) thread; the NIXL handles it
        lists for the request are taken here, not left beside this one."""
        import collections

        worker = self.worker
        mine = worker._recving_transfers
        worker._recving_transfers = collections.defaultdict(list)
        try:
            self.posted = bool(self.start())
        finally:
            started, worker._recving_transfers = worker._recving_transfers, mine
        self.handles = list(started.get(self.request) or ())
        for request, handles in started.items():  # nothing else is expected there
            if request != self.request:
                mine[request].extend(handles)

    def telemetry(self) -> Any:
        """vLLM's read's telemetry (its one NIXL handle's; summed over several); None when
        vLLM's read failed to start (vLLM records nothing for it)."""
        import types

        agent = self._agent()
        found = [agent.get_xfer_telemetry(h) for h in self.handles or ()]
        if not found and self.posted is False:
            return None
        if len(found) == 1:
            return found[0]
        return types.SimpleNamespace(
            xferDuration=sum(float(t.xferDuration) for t in found),
            postDuration=sum(float(t.postDuration) for t in found),
            totalBytes=sum(int(t.totalBytes) for t in found),
            descCount=sum(int(t.descCount) for t in found))

    def release(self) -> None:
        """Release vLLM's read's NIXL handles (vLLM releases this one when done or failed);
        a handle whose release raises stays, and the error goes to vLLM, which keeps this
        handle and tries again."""
        agent = self._agent()
        while self.handles:
            agent.release_xfer_handle(self.handles[0])
            self.handles.pop(0)
        if self.outcome is None:  # released before any answer (vLLM's shutdown)
            self.outcome = "refused"
            self._close()


def serve_hold(worker: Any, opening: dict[str, Any], reply: Any) -> str:
    """The prefill's answer to a decode's held check (:func:`check_held`), on a thread of its
    own: the request is held as a staged stream holds it (:meth:`SendLeases.hold`, the one
    rule: vLLM still holds it, and the pages of each KV group the check names are the tail of
    vLLM's blocks of that group of it; a check of the one-group form, an older decode's,
    names one group's pages) and stays
    pinned for the stream timeout, by which vLLM's notification after the decode's read has
    normally freed it; the decode is answered with an acknowledgement, or refused naming the
    reason (logged once)."""
    from kvplan.staging import StagingError
    from kvplan.staging.wire import ACK, encode

    state = worker_staging(worker)
    stream = str(opening["stream"])
    peer = str(opening.get("peer", "?"))
    request = opening.get("request")
    grouped = "group_pages" in opening
    pages = _page_lists(opening.get("group_pages")) if grouped else \
        _page_lists([opening.get("src_pages")])
    if not isinstance(request, str) or not request or pages is None:
        _staging_log.error("kvplan staging: cannot check %r for %s: no request or pages",
                           stream, peer)
        _refuse(reply, stream, "bad_message", "the held check names no request and pages")
        return stream
    leases = send_leases(worker)
    hold_s = float(state.config.timeout_s)

    # a thread per check: the hold may wait up to the stream timeout for vLLM's block ids of
    # the request (its next step records them), and the listener thread answers every
    # decode's opening message; the pin itself ends by its deadline (no timer thread)
    def check() -> None:
        try:
            if grouped:
                leases.hold(worker, request, [], stream=stream, timeout_s=hold_s,
                            pin_s=hold_s, group_pages=pages)
            else:
                leases.hold(worker, request, pages[0], stream=stream, timeout_s=hold_s,
                            pin_s=hold_s)
        except StagingError as exc:
            _staging_log.error("kvplan staging: refused %r to %s: request %s: %s", stream,
                               peer, request, exc.detail)
            _refuse(reply, stream, exc.reason, exc.detail)
            return
        try:
            reply(encode(ACK, stream, writer=0, round_index=0))
        except Exception as exc:  # the decode fails the read on its own timeout
            _staging_log.warning("kvplan staging: could not answer %r: %s", stream, exc)

    threading.Thread(target=check, name=f"kvplan-staging-hold-{stream}", daemon=True).start()
    return stream


def _page_lists(value: Any) -> list[list[int]] | None:
    """A held check's pages as lists of ints (None: not a list of lists of ints)."""
    if not isinstance(value, list) or not all(isinstance(g, list) for g in value) or \
            not all(isinstance(p, int) and not isinstance(p, bool) for g in value for p in g):
        return None
    return [[int(p) for p in g] for g in value]


# ---------------------------------------------------------------------------------------------
# The prefill: its listener serves the rounds a decode reads
# ---------------------------------------------------------------------------------------------

def serve_rounds(worker: Any, data: bytes, reply: Any) -> str:
    """The prefill's answer to a decode's opening message (its listener's ``on_open``):
    negotiate with the decode's staging message, plan the same rounds with this worker's own
    layout as the source, and run :func:`kvplan.staging.send_staged` in pull mode on a thread
    of its own: first the request is held (:meth:`SendLeases.hold`: vLLM still holds it, and
    the stream's prefill pages are vLLM's blocks of it), then each round gathered into this
    worker's arena and announced for the decode to read; it ends after the decode's last
    acknowledgement, and the hold with it. A request it cannot serve (a message it cannot
    plan from, a request vLLM no longer holds, pages that are not the request's) is refused
    with a failure message: the decode's read fails, vLLM's failed-receive path. vLLM frees
    the request's blocks on the decode's notification, which the decode sends after the last
    round's scatter, so after every gather; its lease cannot expire while the stream is held."""
    import threading

    import numpy as np

    import kvplan
    from kvplan.compat.vllm import staging as vstaging
    from kvplan.staging import AckQueue, StagingError, local_copy, send_staged

    state = worker_staging(worker)
    opening = vstaging._read_open(data)
    if HOLD_KEY in opening:  # a held check before the decode's direct read
        return serve_hold(worker, opening, reply)
    stream = str(opening["stream"])
    peer = str(opening.get("peer", "?"))
    try:
        request = opening.get("request")
        if not isinstance(request, str) or not request:
            raise StagingError.make(stream, 0, "bad_message",
                                    "the opening message names no request of this prefill")
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
        src_pages = [int(p) for p in opening["src_pages"]]
        rounds = template.plan_rounds(np.asarray(src_pages, np.int64),
                                      np.asarray(opening["dst_pages"], np.int64),
                                      src_arena=agreement.src_arena,
                                      dst_arena=agreement.dst_arena,
                                      buffers=agreement.buffers)
        gather = local_copy(kv_buffers(worker), [state.arena.array])
    except (kvplan.KvPlanError, StagingError, KeyError, TypeError, ValueError) as exc:
        _staging_log.error("kvplan staging: cannot serve %r to %s: %s", stream, peer, exc)
        _refuse(reply, stream, "bad_message", f"{type(exc).__name__}: {exc}")
        return stream
    leases = send_leases(worker)
    acks = AckQueue()
    state.router.open(stream, 0, acks.put)

    def send() -> None:
        held = False
        try:
            try:
                leases.hold(worker, request, src_pages, stream=stream,
                            timeout_s=state.config.timeout_s)
            except StagingError as exc:
                # logged once, naming the request; nothing was gathered
                _staging_log.error("kvplan staging: refused %r to %s: request %s: %s",
                                   stream, peer, request, exc.detail)
                _refuse(reply, stream, exc.reason, exc.detail)
                return
            held = True
            send_staged(rounds, None, peer, reply, request=stream, acks=acks, writer=0,
                        gather=gather, buffers=agreement.buffers, src_lock=state.arena.lock,
                        timeout_s=state.config.patience(state.lease_s), pull=True)
        except StagingError as exc:
            if exc.reason == "peer_failed" and exc.detail.startswith("cancelled: "):
                # the decode stopped it (vLLM there finished the request): not a failure here
                _staging_log.info("kvplan staging: %s cancelled %r: %s", peer, stream,
                                  exc.detail)
            else:
                _staging_log.warning("kvplan staging: serving %r to %s failed: %s", stream,
                                     peer, exc)
        finally:
            if held:  # the last round acknowledged, or the stream failed: once
                leases.release(request)
            leases.ended(stream)
            state.router.close(stream)

    thread = threading.Thread(target=send, name=f"kvplan-staging-serve-{stream}",
                              daemon=True)
    leases.started(stream, acks, thread)
    thread.start()
    return stream


def _decode_gone(worker: Any, streams: list[str]) -> None:
    """The prefill's listener lost a decode's connection (its ``on_close``): each of
    ``streams`` still being served stops now (after the gather in progress), as if the decode
    had failed it (``peer_failed``), and its hold on the request ends, instead of waiting out
    the staging timeout for an acknowledgement that cannot come."""
    from kvplan.staging.wire import FAIL, encode

    leases = send_leases(worker)
    with leases.lock:
        serving = [(s, leases.streams[s][0]) for s in streams if s in leases.streams]
    for stream, acks in serving:
        acks.put(encode(FAIL, stream, writer=0, round_index=0,
                        payload=b"peer_gone: the decode's staging channel closed"))


def _refuse(reply: Any, stream: str, reason: str, detail: str) -> None:
    """The prefill's failure message for a stream it does not serve (the decode fails it
    ``peer_failed``, naming ``reason``); a reply that cannot be sent is logged."""
    from kvplan.staging.wire import FAIL, encode

    try:
        reply(encode(FAIL, stream, writer=0, round_index=0,
                     payload=f"{reason}: {detail}".encode()[:4096]))
    except Exception as exc:
        _staging_log.warning("kvplan staging: could not refuse %r: %s", stream, exc)


# ---------------------------------------------------------------------------------------------
# The prefill's hold on the requests its streams gather from
# ---------------------------------------------------------------------------------------------
#: The worker attribute holding its :class:`SendLeases`.
LEASES_ATTR = "_kvplan_send_leases"
#: The attribute kvplan's scheduler side adds to vLLM's connector metadata: the block ids per
#: KV group vLLM gave each request of ``reqs_to_send`` (its ``remote_block_ids``).
SENT_BLOCKS_META = "kvplan_send_blocks"
#: The scheduler-side connector attribute holding the block ids of finished requests until
#: the next metadata carries them.
SENT_BLOCKS_ATTR = "_kvplan_sent_blocks"
#: The attribute kvplan's scheduler side adds to vLLM's connector metadata on the decode: the
#: requests vLLM finished other than by completing them (aborted, failed) whose KV was to be
#: received; a staged read of one still in progress stops (:func:`stop_aborted_reads`).
ABORTED_META = "kvplan_aborted_reads"
#: The scheduler-side connector attribute holding those requests until the next metadata.
ABORTED_ATTR = "_kvplan_aborted_reads"
#: The decode worker attribute holding those whose read had not started when they came
#: (request -> until when, :func:`stop_aborted_reads`).
PENDING_ABORTS_ATTR = "_kvplan_pending_aborts"
#: vLLM's request statuses of a request that completed (any other finished status ends it
#: early: an abort, an error).
COMPLETED_STATUSES = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED",
                                "FINISHED_REPETITION"})
#: Least seconds a held request's lease is extended by at each of vLLM's expiry checks.
MIN_EXTENSION_S = 1.0


class SendLeases:
    """What a prefill worker holds for its staged streams. vLLM's pull worker keeps a
    finished request's blocks until the decode's notification or the lease's expiry
    (``_reqs_to_send``: request -> expiry; ``_reqs_to_process``: requests of a batch not yet
    given one) and then reports them sent, which frees them for other requests. A stream
    gathers from them only while this worker holds the request: :meth:`hold` checks that
    vLLM still holds it and that the stream's prefill pages are vLLM's blocks of it, then
    pins it; :meth:`extend_pinned` (run by the worker's expiry check, under :attr:`lock`)
    pushes a pinned request's expiry forward, as vLLM's own lease heartbeat does, so the
    blocks are not freed while a round may still be gathered; :meth:`release` unpins it. A
    pin given a lifetime (``pin_s``: a held check's, which nothing releases but time) ends at
    its deadline, at the next of those checks after it (:meth:`expire`; no thread waits for
    it)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        #: Request -> vLLM's block ids per KV group (logical), recorded per step.
        self.blocks: dict[str, list[list[int]]] = {}
        #: Request -> streams holding it.
        self.pins: dict[str, int] = {}
        #: Request -> the deadlines (on :attr:`clock`) of its pins that end by time.
        self.deadlines: dict[str, list[float]] = {}
        #: The clock of those deadlines (seconds; tests drive it).
        self.clock: Any = time.monotonic
        #: Streams serving now -> (their ack queue, their thread).
        self.streams: dict[str, tuple[Any, threading.Thread]] = {}
        #: Set by :meth:`stop`: no stream is held any more.
        self.stopping = False

    # ------------------------------------------------------------------ vLLM's bookkeeping
    @staticmethod
    def held(worker: Any, request: str) -> bool:
        """Whether vLLM's worker still holds ``request``'s blocks (as its notification
        handling decides)."""
        d = worker.__dict__
        return request in (d.get("_reqs_to_send") or {}) or \
            request in (d.get("_reqs_to_process") or ())

    def record(self, worker: Any, sent: Any) -> None:
        """After vLLM's ``start_load_kv``: the block ids kvplan's scheduler side sent with
        ``reqs_to_send`` for the requests vLLM now holds; requests vLLM no longer holds are
        forgotten."""
        with self.lock:
            for request, groups in dict(sent or {}).items():
                if self.held(worker, request):
                    self.blocks[str(request)] = [[int(b) for b in g] for g in groups]
            for request in [r for r in self.blocks if not self.held(worker, r)]:
                del self.blocks[request]
            self.expire()
            self.lock.notify_all()

    def extend_pinned(self, worker: Any) -> None:
        """Push every pinned request's expiry at least :data:`MIN_EXTENSION_S` (or vLLM's
        lease extension, if longer) past now. Call with :attr:`lock` held, right before
        vLLM's expiry check. Pins past their deadline end first (:meth:`expire`)."""
        self.expire()
        leases = worker.__dict__.get("_reqs_to_send")
        if not self.pins or not isinstance(leases, dict):
            return
        now = time.perf_counter()
        extension = max(float(worker.__dict__.get("_lease_extension") or 0), MIN_EXTENSION_S)
        for request in self.pins:
            if request in leases:
                leases[request] = max(float(leases[request]), now + extension)

    # ------------------------------------------------------------------ streams
    def hold(self, worker: Any, request: str, src_pages: list[int], *, stream: str,
             timeout_s: float, pin_s: float | None = None,
             group_pages: list[list[int]] | None = None) -> None:
        """Pin ``request`` for one stream whose prefill pages are ``src_pages`` (vLLM's
        request of one KV group), or with ``group_pages`` the pages of each KV group, in
        vLLM's group order (with ``pin_s``, for that many seconds: then the pin ends by
        itself, :meth:`expire`). Raises :class:`kvplan.staging.StagingError`: ``not_held``
        when vLLM no longer holds the request (its lease expired, or it was freed or never
        finished here), or its block ids are not recorded within ``timeout_s``;
        ``pages_mismatch`` when ``src_pages`` are not the last pages of vLLM's blocks of it,
        or a group's ``group_pages`` not the last of vLLM's blocks of that group (in kernel
        blocks: vLLM trims the decode's prefix-cache hit off the front), or ``group_pages``
        names another number of groups than vLLM gave the request. The same block id in two
        groups is two blocks: each group's pages are checked against that group's alone."""
        from kvplan.staging import StagingError

        deadline = time.monotonic() + timeout_s
        with self.lock:
            self.expire()
            while True:
                if self.stopping:
                    raise StagingError.make(stream, None, "cancelled",
                                            "the prefill worker shut down")
                if not self.held(worker, request):
                    raise StagingError.make(
                        stream, None, "not_held",
                        f"this prefill no longer holds request {request!r} (its KV lease "
                        "expired, or its blocks were freed or never kept for a decode)")
                groups = self.blocks.get(request)
                if groups is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingError.make(
                        stream, None, "not_held",
                        f"vLLM gave this prefill no block ids for request {request!r} within "
                        f"{timeout_s:g} s")
                self.lock.wait(min(left, 0.05))
            ratio = int(worker.__dict__.get("_physical_blocks_per_logical_kv_block", 1) or 1)
            kernel = worker._logical_to_kernel_block_ids(groups, ratio) if ratio != 1 \
                else groups
            have = [[int(b) for b in g] for g in kernel]
            if group_pages is None:
                used = [g for g in have if g]
                wrong = len(used) != 1 or not _tail_of(list(src_pages), used[0])
                named: Any = list(src_pages)
            else:
                named = [list(g) for g in group_pages]
                wrong = len(named) != len(have) or \
                    not all(_tail_of(p, g) for p, g in zip(named, have))
            if wrong:
                raise StagingError.make(
                    stream, None, "pages_mismatch",
                    f"the stream reads prefill pages {named!r:.200} of request "
                    f"{request!r}, whose blocks here are {have!r:.200}")
            self.pins[request] = self.pins.get(request, 0) + 1
            if pin_s is not None:
                self.deadlines.setdefault(request, []).append(self.clock() + float(pin_s))

    def expire(self) -> list[str]:
        """End the pins whose deadline passed (one :meth:`release` each); the requests
        unpinned so. Runs where the pins are already looked at: vLLM's expiry check
        (:meth:`extend_pinned`), each step's :meth:`record`, and :meth:`hold`."""
        ended: list[str] = []
        with self.lock:
            if not self.deadlines:
                return ended
            now = self.clock()
            for request, ends in list(self.deadlines.items()):
                left = [t for t in ends if t > now]
                if left:
                    self.deadlines[request] = left
                else:
                    del self.deadlines[request]
                for _ in range(len(ends) - len(left)):
                    self.release(request)
                    ended.append(request)
        return ended

    def release(self, request: str) -> None:
        """Unpin ``request`` for one stream (vLLM's lease, the notification or expiry, frees
        it from here on)."""
        with self.lock:
            left = self.pins.get(request, 0) - 1
            if left > 0:
                self.pins[request] = left
            else:
                self.pins.pop(request, None)

    def started(self, stream: str, acks: Any, thread: threading.Thread) -> None:
        with self.lock:
            self.streams[stream] = (acks, thread)

    def ended(self, stream: str) -> None:
        with self.lock:
            self.streams.pop(stream, None)

    def stop(self, join_s: float) -> None:
        """End every stream serving now (each is told the decode gave up: its send stops
        after the gather in progress, it is refused to the decode and its hold released),
        waiting up to ``join_s`` seconds for their threads."""
        from kvplan.staging.channel import join_threads
        from kvplan.staging.wire import FAIL, encode

        with self.lock:
            self.stopping = True
            self.lock.notify_all()
            streams = list(self.streams.items())
        for stream, (acks, _) in streams:
            acks.put(encode(FAIL, stream, writer=0, round_index=0,
                            payload=b"cancelled: the prefill worker shut down"))
        join_threads([thread for _, (_, thread) in streams], join_s)


def _tail_of(pages: list[int], blocks: list[int]) -> bool:
    """Whether ``pages`` are the last of ``blocks`` (vLLM's trim of a decode's prefix-cache
    hit takes blocks off the front)."""
    return len(pages) <= len(blocks) and blocks[len(blocks) - len(pages):] == pages


def send_leases(worker: Any) -> SendLeases:
    """The worker's :class:`SendLeases` (made once)."""
    leases = worker.__dict__.get(LEASES_ATTR)
    if not isinstance(leases, SendLeases):
        leases = worker.__dict__.setdefault(LEASES_ATTR, SendLeases())
    assert isinstance(leases, SendLeases)
    return leases


def record_sent_blocks(worker: Any, metadata: Any) -> None:
    """The worker's ``start_load_kv``, after vLLM's: keep the block ids of the requests vLLM
    now holds for decodes (:meth:`SendLeases.record`); nothing with staging off."""
    if worker_staging(worker) is not None:
        send_leases(worker).record(worker, getattr(metadata, SENT_BLOCKS_META, None))


def note_finished(connector: Any, request: Any, outcome: Any) -> None:
    """The scheduler side's ``request_finished``, after vLLM's: a request whose blocks vLLM
    keeps for a decode (``outcome`` ``(True, params)``) has its ``remote_block_ids`` kept
    until the next connector metadata carries them to the workers. On the decode, a request
    whose KV was to be received (vLLM's ``update_state_after_alloc`` marked its
    ``kv_transfer_params`` ``_remote_blocks_processed``) and that finished other than by
    completing (aborted, failed) is kept too, for :func:`stop_aborted_reads`."""
    params = getattr(request, "kv_transfer_params", None)
    status = getattr(request, "status", None)
    status = getattr(status, "name", status)
    if isinstance(params, dict) and params.get("_remote_blocks_processed") and \
            not params.get("do_remote_decode") and str(status) not in COMPLETED_STATUSES:
        connector.__dict__.setdefault(ABORTED_ATTR, set()).add(str(request.request_id))
    try:
        delay, params = outcome
    except (TypeError, ValueError):
        return
    blocks = params.get("remote_block_ids") if delay and isinstance(params, dict) else None
    if blocks:
        connector.__dict__.setdefault(SENT_BLOCKS_ATTR, {})[str(request.request_id)] = [
            [int(b) for b in g] for g in blocks]


def attach_sent_blocks(connector: Any, metadata: Any) -> Any:
    """The scheduler side's ``build_connector_meta``, after vLLM's: the kept block ids of the
    requests in its ``reqs_to_send`` go with it (:data:`SENT_BLOCKS_META`), and the decode's
    requests finished early since the last metadata (:data:`ABORTED_META`, sorted)."""
    kept: dict[str, list[list[int]]] = connector.__dict__.get(SENT_BLOCKS_ATTR) or {}
    sending = getattr(metadata, "reqs_to_send", None) or {}
    setattr(metadata, SENT_BLOCKS_META,
            {r: kept.pop(r) for r in list(sending) if r in kept})
    aborted: set[str] = connector.__dict__.pop(ABORTED_ATTR, None) or set()
    setattr(metadata, ABORTED_META, sorted(aborted))
    return metadata


def stop_aborted_reads(worker: Any, metadata: Any) -> list[str]:
    """The decode worker's ``start_load_kv``, after vLLM's: each request of the metadata's
    :data:`ABORTED_META` with a staged read still in progress has its stop started
    (:meth:`StagedRead.abort`); the requests whose stop started. vLLM itself tells its worker
    nothing of such a request: its scheduler keeps the request's blocks until the worker
    reports the read done, and its own READ runs to the end. A request whose read has not
    started yet (its handshake still running, or queued in vLLM's ``_ready_requests``) is
    kept here (:data:`PENDING_ABORTS_ATTR`) until its read starts, which then reads nothing
    (:func:`staged_read`), or for at most the staging timeout. Nothing with staging off."""
    state = worker_staging(worker)
    if state is None:
        return []
    transfers = worker.__dict__.get("_recving_transfers") or {}
    pending: dict[str, float] = worker.__dict__.setdefault(PENDING_ABORTS_ATTR, {})
    now = time.monotonic()
    for request in getattr(metadata, ABORTED_META, None) or ():
        pending.setdefault(str(request), now + float(state.config.timeout_s))
    stopped: list[str] = []
    for request, deadline in list(pending.items()):
        handles = list(transfers.get(request) or ())
        if handles or deadline <= now:  # its read started (or the wait is over): once
            del pending[request]
        for handle in handles:
            if isinstance(handle, StagedRead) and handle.abort():
                stopped.append(request)
    return stopped


def _take_pending_abort(worker: Any, request: str) -> bool:
    """Whether vLLM finished ``request`` before its read started (:func:`stop_aborted_reads`
    kept it, and its wait is not over); it is no longer kept."""
    pending: dict[str, float] = worker.__dict__.get(PENDING_ABORTS_ATTR) or {}
    deadline = pending.pop(str(request), None)
    return deadline is not None and deadline > time.monotonic()


def close_staging(worker: Any) -> bool:
    """The worker's ``shutdown``, after vLLM's: its staged streams ended, its channels and
    listener closed and their threads waited for, its arena unregistered; once (False: staging
    was off, or already closed)."""
    from kvplan.compat.vllm.staging import CLOSE_JOIN_S, STAGING_ATTR

    state = worker.__dict__.pop(STAGING_ATTR, None)
    if state is None:
        return False
    leases = worker.__dict__.get(LEASES_ATTR)
    try:
        if leases is not None:
            leases.stop(CLOSE_JOIN_S)
    finally:
        state.close(CLOSE_JOIN_S)
    return True
