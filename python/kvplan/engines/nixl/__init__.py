"""NIXL adapter (``pip install --no-deps nixl-cu12``; the wheel bundles UCX).

NIXL is the transfer library under vLLM's NixlConnector, NVIDIA Dynamo and SGLang's ``nixl``
backend. One :class:`NixlTransport` owns one NIXL agent:

* **Metadata exchange** is the caller's: :meth:`NixlTransport.metadata` returns the agent's
  metadata as bytes, the caller ships them over its own channel (bootstrap socket, pipe, ...),
  and the peer calls :meth:`NixlTransport.add_peer` with them. The peer's name is then what
  ``submit`` takes as ``peer_session``.
* **Descriptors** go to NIXL as ``(N, 3)`` uint64 arrays of ``(addr, len, dev_id)`` rows,
  built from the plan's columns with vectorised numpy (:func:`descriptor_rows`); no Python
  object is built per block. Memory type and device id come from the layout's ``device``
  (``"cpu"`` -> ``DRAM``/0, ``"cuda:N"`` -> ``VRAM``/N).
* **Completion** is signalled to the receiver with a notification: ``submit(..., notif=b"...")``;
  the receiver calls :meth:`NixlTransport.wait_notification`.
* **Handles**: every transfer handle is released on every path (success, ``ERR``, exception,
  timeout). A handle NIXL refuses to release (a transfer it cannot cancel) is retried at
  :meth:`NixlTransport.close`; :attr:`NixlTransport.live_handles` counts what is still held.
* **The prepped path** (vLLM's): :meth:`NixlTransport.prep` hands the template's prepped
  descriptor tables (``Template.descriptor_table``: the plan's address model, one descriptor
  per page of every emission piece and per slot of every state pair) to ``prep_xfer_dlist``
  once per peer pair, and :meth:`PreppedPair.submit` sends a request as the two index arrays
  the core computes (``Template.prepped_indices``) with ``make_prepped_xfer``. No address is
  computed here.

Facts behind the defaults (nixl-cu12 1.5.1, UCX 1.23, DRAM to DRAM between two processes on
one host): ``transfer()`` may finish the whole transfer before it returns; a peer that dies
mid-transfer turns into ``nixlRemoteDisconnectError`` within well under a second; a descriptor
outside registered memory or an unknown peer is refused by ``initialize_xfer`` before anything
moves (``NIXL_ERR_NOT_FOUND``).

The package is split by job: :mod:`.transport` (the agent, registration, peers, notifications,
plan submission, teardown), :mod:`.pending` (posted requests and their completion),
:mod:`.prepped` (the prepped descriptor lists) and :mod:`.descriptors` (NIXL's descriptor
rows, memory types and status names).
"""

from kvplan.engines.nixl.descriptors import NIXL_STATUS_NAMES, descriptor_rows, memory_of
from kvplan.engines.nixl.pending import NixlPending
from kvplan.engines.nixl.prepped import PreppedPair
from kvplan.engines.nixl.transport import DEFAULT_TIMEOUT, NixlTransport

__all__ = ["NixlTransport", "NixlPending", "PreppedPair", "descriptor_rows", "memory_of",
           "NIXL_STATUS_NAMES", "DEFAULT_TIMEOUT"]
