"""vLLM 0.33 integration: kvplan plans the Mooncake connector's per-request transfers.

(For vLLM's NIXL connector, ``install`` dispatches to :mod:`kvplan.compat.vllm_nixl`, which
replaces the per-request descriptor-id computation.)

``install(MooncakeConnectorWorker)`` replaces two methods on the class (``uninstall`` restores
exactly what was there); docs/vllm.md has the full account:

* ``_build_transfer_params(ready_reqs, agent_meta, local_regions, remote_regions)``: one
  ``kvplan.Template`` per KV group of a peer's aligned ``TransferRegion`` lists (cached per
  peer layout: vLLM hands the same prepared lists for a peer until it re-registers), built from
  each region's base address, block stride, block length and group, with the head-slice offsets
  and lengths vLLM's own ``_get_sender_transfer_plan`` gives for the TP ranks. Per request,
  vLLM's rules run as vLLM runs them (KV group count check, Mamba null blocks dropped, partial
  prefix trimmed to the remote's count, descending stretches read ascending as vLLM 0.34
  reads them, ``_logical_to_kernel_block_ids``); then the ready
  requests are planned together, one ``Template.plan_batch`` per group, instead of a run
  split and a Python list entry per block for every region of every request: a block that
  runs on from one request's blocks into the next request's on both sides is one block. It
  returns the three columns as uint64 arrays. vLLM's verdict stays per call (one status for
  all the ready requests it sends); a request kvplan refuses, or two requests writing one
  decode block, go to ``err_reqs`` and move nothing, and the others are planned without them.
* ``_send_blocks``: hands those arrays to the engine in batches of at most
  ``max_blocks_per_batch`` entries, with vLLM's stats and logging; the first non-zero status
  is returned. When ``self.engine`` is vLLM's real ``mooncake.engine.TransferEngine`` of the
  wheel kvplan's native hand-off was verified against, the columns go to Mooncake's native
  batch API as they are (through the worker's :class:`kvplan.engines.mooncake.Handoff`: no
  Python int per block, the GIL released), after a self-test transfer to the worker's own
  session at first use; otherwise (any other engine object, a failed self-test,
  ``KVPLAN_MOONCAKE_NATIVE=0``) each column becomes one list, sliced per batch, for
  ``batch_transfer_sync_write``. :func:`handoff` says which path a worker took and why.

What stays vLLM's: region preparation and alignment by layer name, the TP pairing of ranks
(which prefill rank sends to which decode rank), handshakes, the engine and every error path.
Differences: a request whose blocks kvplan refuses (a negative block id, or a local block past
its registered buffer: vLLM reads or writes outside the buffer) is put in ``err_reqs`` with the
typed error's message instead of being sent; a region whose head slice does not fit its block
(vLLM asserts) fails the requests it would serve the same way.

``KvplanMooncakeConnector`` is vLLM's ``MooncakeConnector`` (three-argument constructor,
``SupportsHMA``) whose worker plans with kvplan and which reports vLLM's Mooncake stats and
Prometheus series plus kvplan's planning time and blocks per request
(``kvplan.compat.vllm_metrics``), for
``--kv-transfer-config '{"kv_connector": "KvplanMooncakeConnector",
"kv_connector_module_path": "kvplan.compat.vllm", ...}'``: no monkeypatching.

Nothing of vLLM is imported when this module is imported; the connector class is built on
first access.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from collections import OrderedDict
from typing import Any

import numpy as np

import kvplan
from kvplan._core import index_array, reverse_descending_runs
from kvplan.compat import vllm_nixl
from kvplan.compat.vllm import forms as vllm_forms
from kvplan.compat.vllm import metrics as vllm_metrics
from kvplan.compat._methods import MethodPatches
from kvplan.engines.mooncake import Handoff

# KvplanMooncakeConnector is built on first access by the module's __getattr__ (it subclasses
# vLLM's connector, which is imported only then), so it has no module-level definition.
__all__ = ["install", "uninstall", "installed", "plan_request", "plan_ready",  # noqa: F822
           "DEFAULT_MAX_BLOCKS_PER_BATCH", "KvplanMooncakeConnector", "BlockColumn",
           "CONNECTOR_NAME", "MAX_PEER_LAYOUTS", "handoff", "register_plugin"]

logger = logging.getLogger(__name__)

#: Entries per ``batch_transfer_sync_write`` call (Mooncake's TCP transport refuses batches past
#: about 2,048 entries per peer; RDMA has no such cap).
DEFAULT_MAX_BLOCKS_PER_BATCH = 1024
# Remote buffers are not published by vLLM's handshake: bounded by the address space only.
_ADDRESS_SPACE = 2**64 - 1


class BlockColumn(np.ndarray):
    """A uint64 column of the plan, compared and tested for truth as vLLM's ``list[int]`` is.

    Truthy when non-empty (vLLM's caller tests ``if src_ptrs:``); ``==`` / ``!=`` with a list
    or tuple is one plain bool with list semantics (a numpy array would compare elementwise
    and be truthy whenever it is non-empty, so ``assert src_ptrs == [...]`` would pass on a
    wrong answer); with anything else it is numpy's comparison. Iterating, ``len`` and
    ``sum()`` work as on a list.

    Only a one-dimensional column has the list truth value. Every numpy operation on a column
    (comparisons, reductions such as ``.all()``, arithmetic, ``np.concatenate``) answers with
    plain numpy values, never another ``BlockColumn``: a derived array or 0-d result keeps
    numpy's own truth value (a 0-d ``False`` is false; a many-element mask refuses ``bool``),
    so ``bool((column == x).all())`` means what it says."""

    __hash__ = None

    def __bool__(self) -> bool:
        if self.ndim != 1:
            raise TypeError(f"the truth value of a {self.ndim}-d BlockColumn is not defined "
                            "(only a 1-d column is a list)")
        return self.size > 0

    def __eq__(self, other: object) -> Any:
        if isinstance(other, (list, tuple)):
            return self.tolist() == other
        return self.view(np.ndarray) == _plain(other)

    def __ne__(self, other: object) -> Any:
        if isinstance(other, (list, tuple)):
            return self.tolist() != other
        return self.view(np.ndarray) != _plain(other)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any,
                        **kwargs: Any) -> Any:
        # Computed on plain arrays, so no result (elementwise, reduced or 0-d) is a column.
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(_plain(o) for o in outs)
        return getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return func(*_plain_args(args), **{k: _plain_args(v) if isinstance(v, (list, tuple))
                                           else _plain(v) for k, v in kwargs.items()})


def _plain(value: Any) -> Any:
    """``value`` with a :class:`BlockColumn` seen as the plain ndarray it views."""
    return value.view(np.ndarray) if isinstance(value, BlockColumn) else value


def _plain_args(values: Any) -> Any:
    """Positional numpy-function arguments with every column, also inside a list or tuple of
    arrays (``np.concatenate([a, b])``), seen as plain arrays."""
    return type(values)(_plain_args(v) if isinstance(v, (list, tuple)) else _plain(v)
                        for v in values)


_EMPTY = np.empty(0, dtype=np.uint64)


def _column(parts: list[np.ndarray]) -> BlockColumn:
    if not parts:
        arr = _EMPTY
    elif len(parts) == 1:
        arr = parts[0]
    else:
        arr = np.concatenate(parts)
    return arr.view(BlockColumn)


#: Peer layouts whose templates a worker keeps (least recently used evicted first). vLLM keeps
#: up to 1,024 peer layouts; a template costs more than vLLM's region lists, and a layout that
#: was evicted costs one template build when it returns.
MAX_PEER_LAYOUTS = 64


def _buffer_sources(worker: Any) -> tuple[Any, ...]:
    """The objects the worker's registered-buffer table is read from (see
    :func:`_buffer_table`).

    vLLM 0.33's ``register_kv_caches`` keeps the bases (``seen_base_addresses``) and lengths
    (``_kv_data_lens``); 0.32 keeps only the bases and the registered tensors
    (``device_kv_caches``), whose storages give the lengths. A worker that never registered
    (built by its constructor, or by ``__new__`` as vLLM's own tests build it) has none."""
    seen = getattr(worker, "seen_base_addresses", None)
    if not seen:
        return (seen,)
    lens = getattr(worker, "_kv_data_lens", None)
    if lens is not None and len(lens) == len(seen):
        return (seen, lens)
    return (seen, getattr(worker, "device_kv_caches", None))


def _buffer_table(sources: tuple[Any, ...]) -> list[tuple[int, int]] | None:
    """Sorted ``(base, length)`` of the registered KV buffers, or ``None`` when they are not
    known (nothing registered, or lengths that cannot be derived): local regions are then
    bounded by the address space only, which is all vLLM's method checks."""
    seen = sources[0]
    if not seen:
        return None
    lens = sources[1]
    if isinstance(lens, list):
        return sorted(zip(seen, lens))
    sizes: dict[int, int] = {}
    for cache in (lens or {}).values():  # vLLM 0.32: the registered tensors' storages
        storage = cache.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    if sizes and all(base in sizes for base in seen):
        return sorted((base, sizes[base]) for base in seen)
    return None


def _sources_key(sources: tuple[Any, ...]) -> tuple[int, ...]:
    """Identity and length of each object the buffer table was read from: vLLM's
    ``register_kv_caches`` assigns new lists, so a registration changes the key."""
    if len(sources) == 1:
        return (id(sources[0]),)
    seen, lens = sources
    return (id(seen), len(seen), id(lens), -1 if lens is None else len(lens))


class _PeerTemplates:
    """kvplan templates of one peer layout: one per region key (KV group, shared groups)."""

    __slots__ = ("local", "remote", "sources", "sources_key", "groups", "error")

    def __init__(self, worker: Any, agent_meta: Any, local_regions: list[Any],
                 remote_regions: list[Any]) -> None:
        self.local = local_regions  # identity-checked cache key (vLLM reuses the lists)
        self.remote = remote_regions
        sources = _buffer_sources(worker)
        buffers = _buffer_table(sources)
        self.sources = sources  # held so that the ids in sources_key stay theirs
        self.sources_key = _sources_key(sources)
        self.groups: list[tuple[int, tuple[int, ...], kvplan.Template]] = []
        self.error: kvplan.KvPlanError | None = None
        try:
            self._build(worker, agent_meta, buffers)
        except kvplan.KvPlanError as exc:
            self.error = exc

    def _build(self, worker: Any, agent_meta: Any,
               buffers: list[tuple[int, int]] | None) -> None:
        by_key: dict[tuple[int, tuple[int, ...]], list[tuple[int, ...]]] = {}
        for index, (lr, rr) in enumerate(zip(self.local, self.remote)):
            if lr.group_index != rr.group_index:
                raise kvplan.PairingError(
                    f"aligned region {index} ({lr.layer_name}): local group {lr.group_index} "
                    f"!= remote group {rr.group_index}")
            send, src_off, dst_off, length = worker._get_sender_transfer_plan(
                local_kv_block_len=lr.kv_block_len, remote_kv_block_len=rr.kv_block_len,
                remote_tp_rank=agent_meta.remote_tp_rank,
                remote_tp_size=agent_meta.remote_tp_size)
            if not send:
                continue
            if src_off + length > lr.kv_block_len or dst_off + length > rr.kv_block_len:
                raise kvplan.SizeMismatchError(
                    f"region {index} ({lr.layer_name}): head slice at src offset {src_off} / "
                    f"dst offset {dst_off} of {length} bytes exceeds the local block of "
                    f"{lr.kv_block_len} or the remote block of {rr.kv_block_len} bytes")
            src_ptr = lr.base_addr + src_off
            if buffers is None:
                src_extent = _ADDRESS_SPACE - src_ptr
            else:
                buf = next(((p, n) for p, n in buffers if p <= src_ptr < p + n), None)
                if buf is None:
                    raise kvplan.LayoutError(
                        f"region {index} ({lr.layer_name}): local address {src_ptr:#x} lies "
                        f"in no registered KV buffer")
                src_extent = buf[0] + buf[1] - src_ptr
            dst_ptr = rr.base_addr + dst_off
            key = (lr.group_index, tuple(lr.shared_group_ids))
            by_key.setdefault(key, []).append(
                (src_ptr, src_extent, lr.block_len,
                 dst_ptr, _ADDRESS_SPACE - dst_ptr, rr.block_len, length))
        for (group, shared), rows in by_key.items():
            cols = list(zip(*rows))
            src = kvplan.Layout(list(cols[0]), list(cols[1]), list(cols[6]),
                                strides=list(cols[2]))
            dst = kvplan.Layout(list(cols[3]), list(cols[4]), list(cols[6]),
                                strides=list(cols[5]))
            self.groups.append((group, shared, kvplan.Template(
                src, dst, kvplan.Pairing.positional())))


def _templates(self: Any, agent_meta: Any, local_regions: list[Any],
               remote_regions: list[Any], vllm: Any = None) -> _PeerTemplates:
    """The peer layout's templates, from the worker's bounded cache. An entry is reused only
    for the very region lists it was built from and the buffer table it was checked against:
    after ``register_kv_caches`` every layout is checked again, so a refusal made before the
    registration is never served after it."""
    cache: OrderedDict[tuple[int, ...], _PeerTemplates] | None = \
        self.__dict__.get("_kvplan_templates")
    if cache is None:
        cache = self.__dict__["_kvplan_templates"] = OrderedDict()
    key = (id(local_regions), id(remote_regions), agent_meta.remote_tp_rank,
           agent_meta.remote_tp_size)
    peer = cache.get(key)
    if (peer is not None and peer.local is local_regions and peer.remote is remote_regions
            and peer.sources_key == _sources_key(_buffer_sources(self))):
        if len(cache) > 1:
            cache.move_to_end(key)
        return peer
    peer = _PeerTemplates(self, agent_meta, local_regions, remote_regions)
    cache[key] = peer
    cache.move_to_end(key)
    while len(cache) > MAX_PEER_LAYOUTS:
        cache.popitem(last=False)
    return peer


def _group_ids(peer: _PeerTemplates, local_by_group: list[Any], remote_by_group: list[Any],
               vllm: Any) -> list[tuple[Any, Any] | None]:
    """Per template of ``peer``, the (local, remote) block ids one request moves through it,
    or None when it moves none there; vLLM's rules for groups and shared regions."""
    out: list[tuple[Any, Any] | None] = []
    n_groups = len(local_by_group)
    for group, shared, _ in peer.groups:
        if 0 <= group < n_groups and group < len(remote_by_group):
            # vLLM's _block_ids_for_region returns a copy of this group's list: the list
            # itself is the same ids, and it is read once, right here
            local = local_by_group[group]
            remote = remote_by_group[group]
        else:  # packed regions shared by several groups, or vLLM's missing-group assert
            local = vllm._block_ids_for_region(local_by_group, group, shared)
            remote = vllm._block_ids_for_region(remote_by_group, group, shared) if local else []
        out.append((local, remote) if len(local) else None)
    return out


def plan_request(self: Any, peer: _PeerTemplates, local_by_group: list[Any],
                 remote_by_group: list[Any], vllm: Any) -> list[kvplan.TransferPlan]:
    """Plans of one request's (filtered, kernel-expanded) block ids; raises KvPlanError."""
    if peer.error is not None:
        raise peer.error
    return [template.plan(index_array(ids[0]), index_array(ids[1]))
            for (_, _, template), ids in zip(peer.groups,
                                             _group_ids(peer, local_by_group, remote_by_group,
                                                        vllm))
            if ids is not None]


#: One template's batch plan and the ready requests it holds, by index, in the batch's order.
_GroupBatch = tuple[kvplan.BatchPlan, list[int]]


def plan_ready(peer: _PeerTemplates, requests: list[list[tuple[Any, Any] | None]]
               ) -> tuple[list[_GroupBatch], dict[int, kvplan.KvPlanError]]:
    """One batch plan per template of ``peer`` for the ready requests (each request's ids per
    template, from :func:`_group_ids`) with the requests it holds, and the requests kvplan
    refused, by index, with the error. A refused request moves nothing, in any group: the
    batches are planned again without it (the core names the request, or the two requests
    writing one block).

    A batch holds its requests by their first destination block, then their first source
    block, whatever order they came in: vLLM hands over the requests that became ready
    together in the order of a set of tasks, which changes from run to run, and a request
    joins the one before it only when its blocks continue that one's. The same requests are
    then always the same blocks."""
    refused: dict[int, kvplan.KvPlanError] = {}
    if peer.error is not None:
        return [], {r: peer.error for r in range(len(requests))}
    while True:
        batches = _plan_groups(peer, requests, refused)
        if isinstance(batches, list):
            return batches, refused


def _plan_groups(peer: _PeerTemplates, requests: list[list[tuple[Any, Any] | None]],
                 refused: dict[int, kvplan.KvPlanError]) -> list[_GroupBatch] | None:
    """The batches of the requests not in ``refused`` (see :func:`plan_ready`); on a refusal,
    records the requests it names in ``refused`` and returns None."""
    batches = []
    for g, (_, _, template) in enumerate(peer.groups):
        members = [(r, ids) for r, per_group in enumerate(requests)
                   if (ids := per_group[g]) is not None and r not in refused]
        if not members:
            continue
        order = list(range(len(members)))
        try:
            arrays = [(index_array(local), index_array(remote)) for _, (local, remote) in members]
            order.sort(key=lambda i: _first_blocks(arrays[i]))
            batches.append((template.plan_batch([arrays[i] for i in order]),
                            [members[i][0] for i in order]))
        except kvplan.KvPlanError as exc:
            for i in exc.requests or range(len(members)):
                refused[members[order[i]][0]] = exc
            return None
    return batches


def _first_blocks(ids: tuple[np.ndarray, np.ndarray]) -> tuple[int, int]:
    """A request's place in its batch: its first destination block, then its first source
    block (requests that write one destination block are refused, so two requests kept are
    never tied on the first)."""
    local, remote = ids
    return (int(remote[0]) if len(remote) else -1, int(local[0]) if len(local) else -1)


def _ascending_blocks(local_by_group: list[Any], remote_by_group: list[Any]) -> None:
    """Each group's block pairs, in place, with every stretch that descends on both sides
    read ascending (:func:`kvplan._core.reverse_descending_runs`: the same pairs, so the same
    bytes), before vLLM expands each block into its kernel blocks. A descending stretch would
    expand into kernel runs that step down from block to block, one descriptor per block per
    region; reordered it is one run. vLLM 0.34 reorders its own requests at this point; the
    core's rule keeps an order only where it leaves no more runs than either order, so the
    plan is never more blocks than vLLM's, of 0.34 or of earlier releases.

    The groups it reads become the int64 arrays it read (vLLM's expansion takes arrays as it
    takes lists, and returns them as they are when a block is one kernel block), so the ids are
    unboxed once per request. A group kvplan cannot read as block ids is left as it is:
    planning it refuses the request."""
    for g, (local, remote) in enumerate(zip(local_by_group, remote_by_group)):
        if len(local) < 2 or len(local) != len(remote):
            continue
        try:
            arrays = (index_array(local), index_array(remote))
            reordered = reverse_descending_runs(*arrays)
        except kvplan.KvPlanError:
            continue
        local_by_group[g], remote_by_group[g] = reordered or arrays


def _ids(block_ids: Any) -> np.ndarray:
    """vLLM's block-id list (or an array) as int64, unboxed in Rust in one pass."""
    if isinstance(block_ids, np.ndarray):
        return block_ids.astype(np.int64, copy=False)
    return index_array(block_ids)


_MODULES: dict[type, Any] = {}


def _vllm_module(cls: type) -> Any:
    """vLLM's connector module (its helpers and constants), from the worker class's MRO."""
    mod = _MODULES.get(cls)
    if mod is not None:
        return mod
    for klass in cls.__mro__:
        if klass.__name__ == "MooncakeConnectorWorker":
            mod = _MODULES[cls] = sys.modules[klass.__module__]
            return mod
    raise TypeError(f"{cls.__name__} is not vLLM's MooncakeConnectorWorker (or a subclass)")


async def _build_transfer_params(
    self: Any, ready_reqs: list[Any], agent_meta: Any, local_regions: list[Any],
    remote_regions: list[Any],
) -> tuple[BlockColumn, BlockColumn, BlockColumn, list[str], str | None]:
    vllm = _vllm_module(type(self))
    # kvplan's per-request columns, only in the stats class of kvplan's connector: a worker
    # class given to install() keeps recording exactly vLLM's stats.
    stats = getattr(self, "xfer_stats", None)
    record_plan = stats.record_plan if isinstance(stats, vllm_metrics.PlanStats) else None
    # Templates are looked up only once a request needs them: vLLM's method reads no region
    # (and nothing register_kv_caches sets) for a request it rejects or skips first.
    peer: _PeerTemplates | None = None
    src_parts: list[np.ndarray] = []
    dst_parts: list[np.ndarray] = []
    len_parts: list[np.ndarray] = []
    err_reqs: list[str] = []
    err_msg: str | None = None
    ready_ids: list[str] = []
    ready_groups: list[list[tuple[Any, Any] | None]] = []
    req_blocks = agent_meta.req_blocks
    for d_req_id, send_meta in ready_reqs:
        _, remote_per_group = req_blocks[d_req_id]
        if not remote_per_group or not any(map(len, remote_per_group)):
            continue
        local_per_group = send_meta.local_block_ids
        if len(local_per_group) != len(remote_per_group):
            logger.error("req %s: KV group count mismatch: local=%d, remote=%d", d_req_id,
                         len(local_per_group), len(remote_per_group))
            err_reqs.append(d_req_id)
            err_msg = err_msg or "KV group count mismatch"
            continue
        group_specs = self.kv_cache_config.transfer_groups
        local_by_group: list[Any] = []
        remote_by_group: list[Any] = []
        short = False
        for index, (local, remote) in enumerate(zip(local_per_group, remote_per_group)):
            if isinstance(group_specs[index].kv_cache_spec, vllm.MambaSpec):
                null_block = vllm.NULL_BLOCK_ID
                local = [b for b in local if b != null_block]
                remote = [b for b in remote if b != null_block]
            n_local = len(local)
            n_remote = len(remote)
            if n_local < n_remote:
                short = True
                break
            if n_local > n_remote:  # partial prefix hit: the uncomputed tail only
                local = local[-n_remote:] if n_remote else []
            local_by_group.append(local)
            remote_by_group.append(remote)
        if short:
            err_reqs.append(d_req_id)
            err_msg = err_msg or "P num blocks less than D"
            continue
        if not any(map(len, local_by_group)):
            continue
        _ascending_blocks(local_by_group, remote_by_group)
        local_by_group = self._logical_to_kernel_block_ids(local_by_group)
        remote_by_group = self._logical_to_kernel_block_ids(remote_by_group)
        if peer is None:
            peer = _templates(self, agent_meta, local_regions, remote_regions)
        ready_ids.append(d_req_id)
        ready_groups.append([] if peer.error is not None else
                            _group_ids(peer, local_by_group, remote_by_group, vllm))
    if peer is None or not ready_ids:
        return _column([]), _column([]), _column([]), err_reqs, err_msg
    # The ready requests to this peer as one batch plan per KV group: blocks that run on
    # from one request into the next on both sides become one block.
    started = time.perf_counter()
    batches, refused = plan_ready(peer, ready_groups)
    seconds = time.perf_counter() - started
    for r, exc in refused.items():
        logger.error("req %s: kvplan refused the transfer: %s: %s", ready_ids[r],
                     type(exc).__name__, exc)
        err_reqs.append(ready_ids[r])
        err_msg = err_msg or f"{type(exc).__name__}: {exc}"
    if record_plan is not None:
        # Per request: its share of the batch's planning time, and its blocks as planned
        # alone (the batch may merge blocks across requests).
        blocks = [0] * len(ready_ids)
        for batch, members in batches:
            for r, n in zip(members, batch.request_n_blocks.tolist()):
                blocks[r] += n
        planned = [r for r in range(len(ready_ids)) if r not in refused]
        for r in planned:
            record_plan(seconds / len(planned), blocks[r])
    for batch, _ in batches:
        src_parts.append(batch.src_addrs)
        dst_parts.append(batch.dst_addrs)
        len_parts.append(batch.lengths)
    return _column(src_parts), _column(dst_parts), _column(len_parts), err_reqs, err_msg


def _send_blocks(self: Any, remote_session: str, src_ptrs: Any, dst_ptrs: Any,
                 lengths: Any) -> int:
    cap = getattr(self, "kvplan_max_blocks_per_batch", DEFAULT_MAX_BLOCKS_PER_BATCH)
    arrays = all(isinstance(c, np.ndarray) for c in (src_ptrs, dst_ptrs, lengths))
    handoff = _handoff(self)
    native = arrays and handoff.native() is not None  # bound and self-tested at first use
    start = time.perf_counter()
    if native:
        # The plan's uint64 columns go to the native engine as they are (one request array
        # per batch filled in Rust, GIL released for the submit and the wait; batches are
        # views, not copies): no Python int per block. An empty plan is no call.
        n = len(src_ptrs)
        total = int(lengths.sum())
        ret = handoff.write_batches(remote_session,
                                    np.ascontiguousarray(src_ptrs, dtype=np.uint64),
                                    np.ascontiguousarray(dst_ptrs, dtype=np.uint64),
                                    np.ascontiguousarray(lengths, dtype=np.uint64), cap)
        self.__dict__[_HANDOFF_ATTR] = "native"
    else:
        # Mooncake's binding takes Python lists of ints (a numpy array would be read element
        # by element as numpy scalars, slower still): each column is converted once, in C,
        # and a batch is a slice of those lists. Empty lists are still one call, as vLLM's
        # ``_send_blocks`` makes it.
        src = _as_list(src_ptrs)
        dst = _as_list(dst_ptrs)
        lens, total = _lengths_list(lengths)
        n = len(src)
        ret = int(handoff.write_batches(remote_session, src, dst, lens, cap, call_empty=True))
        self.__dict__[_HANDOFF_ATTR] = "lists"
    duration = time.perf_counter() - start
    if ret == 0:
        self.xfer_stats.record_transfer(duration_s=duration, total_bytes=total, num_descs=n)
        logger.debug("Sending to %s done, took %s", remote_session, duration)
    else:
        self.xfer_stats.record_failed_transfer()
        logger.warning("Sending to %s failed (ret=%s) after %s (%d descriptors, %d bytes)",
                       remote_session, ret, duration, n, total)
    return ret


#: Worker attribute: the path the last ``_send_blocks`` took (``"native"`` / ``"lists"``).
_HANDOFF_ATTR = "kvplan_handoff"
# A child of vLLM's "vllm" logger: in a vLLM process the once-per-engine hand-off line goes
# through vLLM's own handler (the live e2e reads it); elsewhere it is a plain logger.
_handoff_log = logging.getLogger("vllm.kvplan.mooncake")


def _handoff(worker: Any) -> Handoff:
    """The Mooncake hand-off the worker keeps for ``worker.engine`` (one per engine object):
    native once bound and self-tested, else ``batch_transfer_sync_write``'s lists. Only vLLM's
    real engine (``mooncake.engine.TransferEngine`` of the verified wheel) qualifies, and only
    when the worker knows its own session (``hostname`` and ``rpc_port``, as vLLM's
    ``__init__`` sets them) for the self-test; ``KVPLAN_MOONCAKE_NATIVE=0`` turns it off."""
    attrs = worker.__dict__
    host, port = attrs.get("hostname"), attrs.get("rpc_port")
    return Handoff.kept_on(worker, getattr(worker, "engine", None),
                           f"{host}:{port}" if host and port else None, log=_handoff_log)


def _native(worker: Any) -> Any:
    """The worker's native Mooncake API once self-tested, or None (the benchmarks time it
    directly)."""
    return _handoff(worker).native()


def handoff(worker: Any) -> tuple[str, str]:
    """``(path, why)`` of ``worker``'s Mooncake hand-off: the path its last ``_send_blocks``
    took (``"native"``, ``"lists"``, or ``""`` before the first), and why the native path is not
    in use (``""`` when it is or was not tried yet)."""
    kept = Handoff.kept(worker)
    return worker.__dict__.get(_HANDOFF_ATTR, ""), kept.reason if kept is not None else ""


def _as_list(column: Any) -> list[int]:
    """A column as the ``list[int]`` Mooncake's binding takes (vLLM's own lists pass as is)."""
    if isinstance(column, list):
        return column
    if isinstance(column, np.ndarray):
        return column.tolist()  # type: ignore[no-any-return]
    return [int(x) for x in column]


#: From this many blocks on, a lengths column is checked for one repeated value first.
_REPEAT_CHECK_MIN = 64


def _lengths_list(lengths: Any) -> tuple[list[int], int]:
    """The lengths as a ``list[int]`` and their sum. A column of one repeated value (a
    fragmented request: every block is one page) becomes one int referenced ``n`` times
    instead of ``n`` ints built one by one."""
    if isinstance(lengths, np.ndarray) and len(lengths) >= _REPEAT_CHECK_MIN:
        plain = lengths.view(np.ndarray)
        first = int(plain[0])
        if int(plain[-1]) == first and int(np.count_nonzero(plain != first)) == 0:
            return [first] * len(plain), first * len(plain)
    out = _as_list(lengths)
    return out, sum(out)


# ---------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------
_PATCHES = MethodPatches({"_build_transfer_params": _build_transfer_params,
                          "_send_blocks": _send_blocks})
REPLACED_METHODS = tuple(_PATCHES.replacements)
_CAP = "kvplan_max_blocks_per_batch"
_MISSING = object()
_SAVED_CAPS: dict[type, Any] = {}


def install(worker_class: type, *,
            max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH) -> tuple[str, ...]:
    """Replace planning methods of a vLLM connector worker class; returns the names replaced
    (none when already installed).

    * ``MooncakeConnectorWorker`` (or a subclass): ``_build_transfer_params`` and
      ``_send_blocks``; ``max_blocks_per_batch`` caps one ``batch_transfer_sync_write``.
    * ``NixlBaseConnectorWorker`` (``NixlConnectorWorker``, the pull and push workers, or a
      subclass): ``_compute_desc_ids`` (:mod:`kvplan.compat.vllm_nixl`); NIXL takes a whole
      request at once, so ``max_blocks_per_batch`` must be left at its default.

    A host whose methods (or the vLLM helpers kvplan's replacements call) are not in a form
    kvplan was built for is refused with :class:`kvplan.IncompatibleHostError` (the class,
    the method, the host's vLLM version, the signature seen and the supported ones; see
    :mod:`kvplan.compat.vllm_forms`) and nothing is replaced.
    """
    if max_blocks_per_batch <= 0:
        raise ValueError(f"max_blocks_per_batch must be positive, got {max_blocks_per_batch}")
    if vllm_nixl.is_nixl_worker(worker_class):
        if max_blocks_per_batch != DEFAULT_MAX_BLOCKS_PER_BATCH:
            raise ValueError(f"max_blocks_per_batch={max_blocks_per_batch}: the NIXL drop-in "
                             "sends no batches (it replaces the descriptor-id computation)")
        return vllm_nixl.install(worker_class)
    if not any(k.__name__ == "MooncakeConnectorWorker" for k in worker_class.__mro__):
        raise TypeError(f"{worker_class.__name__} is not vLLM's MooncakeConnectorWorker "
                        "or NixlBaseConnectorWorker (or a subclass)")
    # a host method of a form kvplan was not built for: IncompatibleHostError, nothing replaced
    vllm_forms.check_mooncake(worker_class, _PATCHES.original)
    replaced = _PATCHES.install(worker_class)
    if replaced:  # what the class itself held, put back by uninstall
        _SAVED_CAPS[worker_class] = worker_class.__dict__.get(_CAP, _MISSING)
    setattr(worker_class, _CAP, max_blocks_per_batch)
    return replaced


def uninstall(worker_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``worker_class``."""
    if vllm_nixl.is_nixl_worker(worker_class):
        return vllm_nixl.uninstall(worker_class)
    restored = _PATCHES.uninstall(worker_class)
    if worker_class in _SAVED_CAPS:
        saved = _SAVED_CAPS.pop(worker_class)
        if saved is _MISSING:
            delattr(worker_class, _CAP)
        else:
            setattr(worker_class, _CAP, saved)
    return restored


def installed(worker_class: type) -> tuple[str, ...]:
    """The method names :func:`install` replaced on ``worker_class`` (empty when none)."""
    if vllm_nixl.is_nixl_worker(worker_class):
        return vllm_nixl.installed(worker_class)
    return _PATCHES.installed(worker_class)


# ---------------------------------------------------------------------------------------------
# The connector class for vLLM's factory (built on first access: vLLM is imported then)
# ---------------------------------------------------------------------------------------------
_CONNECTOR: type | None = None
_VLLM_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
_MODULE_TORCH_LOCK = threading.Lock()


class _AcceleratorFree:
    """``torch.accelerator`` for a host without an accelerator: ``current_device_index()``
    answers 0 instead of raising; everything else is torch's."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def current_device_index(self) -> int:
        # vLLM's worker only hands this index to current_platform.set_device, which is a
        # no-op on the CPU platform; 0 is what a one-device host reports.
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


class _TorchWithoutAccelerator:
    """The ``torch`` module as vLLM's connector module sees it while its worker is built on a
    host without an accelerator (every attribute but ``accelerator`` is torch's own)."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.accelerator = _AcceleratorFree(torch.accelerator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _has_accelerator(torch: Any) -> bool:
    try:
        return bool(torch.accelerator.is_available())
    except Exception:  # a torch without the accelerator API, or one that cannot tell
        return False


@contextlib.contextmanager
def _worker_device_on_cpu(module: Any) -> Iterator[None]:
    """While vLLM's ``MooncakeConnectorWorker.__init__`` runs on a host with no accelerator,
    its module's ``torch`` answers ``accelerator.current_device_index()`` with 0 (vLLM asks
    for it unconditionally and torch raises there); vLLM's code is not edited and the module
    gets its own ``torch`` back afterwards. With an accelerator nothing is changed."""
    torch = getattr(module, "torch", None)
    if torch is None or _has_accelerator(torch):
        yield
        return
    with _MODULE_TORCH_LOCK:
        module.torch = _TorchWithoutAccelerator(torch)
        try:
            yield
        finally:
            module.torch = torch


def _connector_class() -> type:
    global _CONNECTOR
    if _CONNECTOR is None:
        import importlib

        mc = importlib.import_module(_VLLM_MOONCAKE)

        base_worker = mc.MooncakeConnectorWorker
        stats_cls = vllm_metrics.stats_class(mc.MooncakeKVConnectorStats)
        prom_cls = vllm_metrics.prom_metrics_class(mc)

        class KvplanMooncakeConnectorWorker(base_worker):  # type: ignore[misc,valid-type]
            """vLLM's Mooncake worker planning its transfers with kvplan."""

        install(KvplanMooncakeConnectorWorker)

        class KvplanMooncakeConnector(mc.MooncakeConnector):  # type: ignore[misc,name-defined]
            """vLLM's ``MooncakeConnector`` (``SupportsHMA``) whose worker plans with kvplan;
            it also starts on a host without an accelerator (vLLM's own worker does not)."""

            def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
                # kvplan's options first: an unknown one refuses before anything starts
                options = vllm_forms.kvplan_options(vllm_config, CONNECTOR_NAME)
                with _worker_device_on_cpu(mc):
                    super().__init__(vllm_config, role, kv_cache_config)
                if self.connector_worker is not None:
                    # vLLM's constructor names its worker class directly; the subclass adds
                    # no state, so the built worker takes the planning subclass as is.
                    self.connector_worker.__class__ = KvplanMooncakeConnectorWorker
                    if _CAP in options:
                        setattr(self.connector_worker, _CAP, options[_CAP])
                    # vLLM's series plus kvplan's per-request plan columns
                    self.connector_worker.xfer_stats = stats_cls()

            @classmethod
            def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
                return stats_cls(data=data or {})

            @classmethod
            def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                                   labelnames: list[str],
                                   per_engine_labelvalues: dict[int, list[object]]) -> Any:
                return prom_cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        KvplanMooncakeConnector.__module__ = __name__
        KvplanMooncakeConnectorWorker.__module__ = __name__
        KvplanMooncakeConnector.Worker = KvplanMooncakeConnectorWorker
        KvplanMooncakeConnector.Stats = stats_cls
        KvplanMooncakeConnector.PromMetrics = prom_cls
        _CONNECTOR = KvplanMooncakeConnector
    return _CONNECTOR


#: The name vLLM's ``--kv-transfer-config`` uses for kvplan's connector once the plugin ran.
CONNECTOR_NAME = "KvplanMooncakeConnector"
_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


def register_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (declared in kvplan's package metadata):
    registers ``KvplanMooncakeConnector`` and ``KvplanNixlConnector`` with vLLM's
    ``KVConnectorFactory``, so ``"kv_connector": "KvplanMooncakeConnector"`` (or the NIXL one)
    needs no ``kv_connector_module_path``.

    vLLM runs general plugins in every process it starts, possibly several times: a name that
    is already registered is left as it is. The factory imports this module and builds the
    class only when a connector of that name is created."""
    import importlib

    factory = importlib.import_module(_FACTORY).KVConnectorFactory
    for name in (CONNECTOR_NAME, vllm_nixl.CONNECTOR_NAME):
        if name not in factory._registry:
            factory.register_connector(name, __name__, name)


def __getattr__(name: str) -> Any:
    if name == "KvplanMooncakeConnector":
        return _connector_class()
    if name == "KvplanMooncakeConnectorWorker":
        return _connector_class().Worker  # type: ignore[attr-defined]
    if name == "KvplanNixlConnector":
        return vllm_nixl.connector_class()
    if name == "KvplanNixlConnectorWorker":
        return vllm_nixl.connector_class().Worker  # type: ignore[attr-defined]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
