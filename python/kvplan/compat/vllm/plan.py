"""The replacement for ``MooncakeConnectorWorker._build_transfer_params``: vLLM's per-request
rules as vLLM runs them, then the ready requests planned together, one batch plan per template
of the peer's layout (:mod:`.templates`), returned as :mod:`.columns`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import numpy as np

import kvplan
from kvplan._core import index_array, reverse_descending_runs
from kvplan.compat.vllm import metrics
from kvplan.compat.vllm import staging as _staging
from kvplan.compat.vllm.columns import BlockColumn, _column
from kvplan.compat.vllm.templates import _PeerTemplates, _templates

# The package's logger: the drop-in's lines keep the name they were always logged under.
logger = logging.getLogger("kvplan.compat.vllm")


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


async def _send_staged(self: Any, agent_meta: Any,
                       staged: dict[str, _staging.StagedRequest]) -> dict[str, str]:
    """Send each staged request in turn off the event loop (the send waits for the decode's
    acknowledgements); returns the failed ones with their message."""
    import asyncio
    import functools

    from kvplan.compat.vllm.submit import DEFAULT_MAX_BLOCKS_PER_BATCH, _handoff
    from kvplan.staging import StagingError, round_engine

    session = f"{agent_meta.remote_hostname}:{agent_meta.remote_port}"
    engine = round_engine(_handoff(self), max_blocks_per_batch=getattr(
        self, "kvplan_max_blocks_per_batch", DEFAULT_MAX_BLOCKS_PER_BATCH))
    stats = getattr(self, "xfer_stats", None)
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # driven without a loop (vLLM's unit tests step the coroutine)
        loop = None
    failed: dict[str, str] = {}
    for d_req_id, request in staged.items():
        try:
            if loop is None:
                report = _staging.send_request(self, request, session, engine=engine)
            else:
                report = await loop.run_in_executor(
                    None, functools.partial(_staging.send_request, self, request, session,
                                            engine=engine))
        except Exception as exc:
            # any failure is this request's, through vLLM's failed-request path: raised out of
            # _build_transfer_params it would fail every request of the pull and skip vLLM's
            # bookkeeping of the requests in flight
            if isinstance(exc, StagingError):
                logger.error("req %s: kvplan's staged transfer failed: %s", d_req_id, exc)
            else:
                logger.exception("req %s: kvplan's staged transfer raised", d_req_id)
            if stats is not None:
                stats.record_failed_transfer()
            failed[d_req_id] = f"kvplan staged transfer failed: {type(exc).__name__}: {exc}"
            continue
        if stats is not None:
            stats.record_transfer(duration_s=report.seconds, total_bytes=report.bytes,
                                  num_descs=report.network_blocks)
        if isinstance(stats, metrics.PlanStats):
            stats.record_staged(report.network_blocks, report.rounds)
    return failed


async def _build_transfer_params(
    self: Any, ready_reqs: list[Any], agent_meta: Any, local_regions: list[Any],
    remote_regions: list[Any],
) -> tuple[BlockColumn, BlockColumn, BlockColumn, list[str], str | None]:
    vllm = _vllm_module(type(self))
    # kvplan's per-request columns, only in the stats class of kvplan's connector: a worker
    # class given to install() keeps recording exactly vLLM's stats.
    stats = getattr(self, "xfer_stats", None)
    record_plan = stats.record_plan if isinstance(stats, metrics.PlanStats) else None
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
    if peer is not None and ready_ids and _staging.STAGING_ATTR in self.__dict__:
        # requests the decode takes staged leave the direct columns; a failed one is vLLM's
        # failed request, as a failed write is
        staged = _staging.staged_requests(self, agent_meta, peer,
                                          dict(zip(ready_ids, ready_groups)))
        if staged:
            failed = await _send_staged(self, agent_meta, staged)
            for d_req_id, message in failed.items():
                err_reqs.append(d_req_id)
                err_msg = err_msg or message
            keep = [r for r, d_req_id in enumerate(ready_ids) if d_req_id not in staged]
            ready_ids = [ready_ids[r] for r in keep]
            ready_groups = [ready_groups[r] for r in keep]
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
