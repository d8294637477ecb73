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

Staged reads are taken only where both sides are simple enough to plan here: host-memory KV
caches whose blocks lie back to back, the same block size (or, for one KV group in blocks with
the tokens outermost, the decode's a multiple of the prefill's: each side's layout at its own
block size, :func:`kvplan.compat.vllm.nixl_staging.read._ratio_pages`), no DCP, no Mamba
state, no mixed memory types, and TP sizes that are equal or that vLLM slices heads between
(:func:`_tp_pair_staged`): then each (request, prefill rank) read vLLM makes is one staged
stream, its rounds planned by the core from both layouts' TP coordinates; every other read is
vLLM's. A read of several KV groups (a hybrid model's) is one stream of one request of every
group's pages (:class:`kvplan.compat.vllm.grouped.GroupedRead`), from a prefill whose staging
message serves it (:data:`GROUPS_KEY`); between differing TP sizes too where it also serves
:data:`GROUPS_TP_KEY` (the groups' pools then page whole blocks, the core slicing each
region's heads as vLLM does, whatever group the region holds).

The package, one module per job, each importing only modules above it in this list (no import
circle):

* ``worker``: the worker's staging state (:func:`worker_staging`), its KV regions as buffers
  (:func:`kv_buffers`) and the log every part writes to;
* ``names``: the staging message's held-check, KV-group and lease keys (:data:`HOLD_KEY`,
  :data:`GROUPS_KEY`, :data:`LEASE_KEY`, ...), a read's session and stream and the decode's
  opening message;
* ``groups``: the regions' KV groups of a read of several (:func:`region_reads`), and the
  prefill's check of them;
* ``scheduler``: the scheduler side's :func:`note_finished` and :func:`attach_sent_blocks`,
  and the connector-metadata keys they fill (:data:`SENT_BLOCKS_META`, :data:`ABORTED_META`);
* ``handles``: the handles vLLM polls (:class:`StagedRead`, :class:`AbortedRead`,
  :class:`RefusedRead`, :class:`HeldRead`) and :class:`StagingAgent`, which answers for them;
* ``peers``: :func:`advertise_staging`, :func:`negotiate_peer`, :func:`peer_agreement`,
  :func:`vllm_lease_s`;
* ``tp``: the TP-pair rules (:func:`_tp_pair_staged`, :func:`_say_unstaged`);
* ``leases``: the prefill's :class:`SendLeases`, :func:`send_leases`,
  :func:`record_sent_blocks`;
* ``aborts``: :func:`stop_aborted_reads` and the reads stopped before they started;
* ``read``: :func:`staged_read`;
* ``held``: :func:`check_held`;
* ``serve``: the prefill's listener, :func:`serve_rounds` and :func:`serve_hold`;
* ``lifecycle``: :func:`start_staging` and :func:`close_staging`.

This ``__init__`` re-exports what the connector (``kvplan.compat.vllm.nixl``), the tests and the
bench use; a test that replaces a name patches the module that owns it.
"""

from __future__ import annotations

from kvplan.compat.vllm.nixl_staging.aborts import PENDING_ABORTS_ATTR, stop_aborted_reads
from kvplan.compat.vllm.nixl_staging.handles import (
    AbortedRead,
    HeldRead,
    RefusedRead,
    StagedRead,
    StagingAgent,
)
from kvplan.compat.vllm.nixl_staging.held import check_held
from kvplan.compat.vllm.nixl_staging.leases import SendLeases, record_sent_blocks, send_leases
from kvplan.compat.vllm.nixl_staging.lifecycle import close_staging, start_staging
from kvplan.compat.vllm.nixl_staging.names import (
    GROUPS_KEY,
    GROUPS_VERSION,
    HOLD_GROUPS_KEY,
    HOLD_KEY,
    HOLD_ONE_GROUP,
    HOLD_VERSION,
    LEASE_KEY,
)
from kvplan.compat.vllm.nixl_staging.peers import (
    NixlPeer,
    advertise_staging,
    negotiate_peer,
    peer_agreement,
    vllm_lease_s,
)
from kvplan.compat.vllm.nixl_staging.read import staged_read
from kvplan.compat.vllm.nixl_staging.scheduler import (
    ABORTED_ATTR,
    ABORTED_META,
    SENT_BLOCKS_ATTR,
    SENT_BLOCKS_META,
    attach_sent_blocks,
    note_finished,
)
from kvplan.compat.vllm.nixl_staging.serve import serve_hold, serve_rounds
from kvplan.compat.vllm.nixl_staging.worker import _staging_log, kv_buffers, worker_staging

__all__ = ["ABORTED_ATTR", "ABORTED_META", "AbortedRead", "GROUPS_KEY", "GROUPS_VERSION",
           "HOLD_GROUPS_KEY", "HOLD_KEY",
           "HOLD_ONE_GROUP", "HOLD_VERSION", "HeldRead", "LEASE_KEY", "NixlPeer",
           "PENDING_ABORTS_ATTR", "RefusedRead", "SENT_BLOCKS_ATTR", "SENT_BLOCKS_META",
           "SendLeases", "StagedRead", "StagingAgent", "_staging_log", "advertise_staging",
           "attach_sent_blocks", "check_held", "close_staging", "kv_buffers", "negotiate_peer",
           "note_finished", "peer_agreement", "record_sent_blocks", "send_leases",
           "serve_hold", "serve_rounds", "staged_read", "start_staging", "stop_aborted_reads",
           "vllm_lease_s", "worker_staging"]
