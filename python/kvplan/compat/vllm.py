"""vLLM 0.33 integration: kvplan plans the Mooncake connector's per-request transfers.

``install(MooncakeConnectorWorker)`` replaces two methods on the class (``uninstall`` restores
exactly what was there); docs/vllm.md has the full account:

* ``_build_transfer_params(ready_reqs, agent_meta, local_regions, remote_regions)``: one
  ``kvplan.Template`` per KV group of a peer's aligned ``TransferRegion`` lists (cached per
  peer layout: vLLM hands the same prepared lists for a peer until it re-registers), built from
  each region's base address, block stride, block length and group, with the head-slice offsets
  and lengths vLLM's own ``_get_sender_transfer_plan`` gives for the TP ranks. Per request,
  vLLM's rules run as vLLM runs them (KV group count check, Mamba null blocks dropped, partial
  prefix trimmed to the remote's count, ``_logical_to_kernel_block_ids``); then one
  ``Template.plan`` per group instead of a run split and a Python list entry per block for
  every region. It returns the three columns as uint64 arrays.
* ``_send_blocks``: hands those arrays to ``engine.batch_transfer_sync_write`` in batches of at
  most ``max_blocks_per_batch`` entries (one list conversion per batch), with vLLM's stats and
  logging; the first non-zero status is returned.

What stays vLLM's: region preparation and alignment by layer name, the TP pairing of ranks
(which prefill rank sends to which decode rank), handshakes, the engine and every error path.
Differences: a request whose blocks kvplan refuses (a negative block id, or a local block past
its registered buffer: vLLM reads or writes outside the buffer) is put in ``err_reqs`` with the
typed error's message instead of being sent; a region whose head slice does not fit its block
(vLLM asserts) fails the requests it would serve the same way.

``KvplanMooncakeConnector`` is vLLM's ``MooncakeConnector`` (three-argument constructor,
``SupportsHMA``) whose worker plans with kvplan, for
``--kv-transfer-config '{"kv_connector": "KvplanMooncakeConnector",
"kv_connector_module_path": "kvplan.compat.vllm", ...}'``: no monkeypatching.

Nothing of vLLM is imported when this module is imported; the connector class is built on
first access.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import numpy as np

import kvplan
from kvplan.compat._methods import MethodPatches

# KvplanMooncakeConnector is built on first access by the module's __getattr__ (it subclasses
# vLLM's connector, which is imported only then), so it has no module-level definition.
__all__ = ["install", "uninstall", "installed", "plan_request",  # noqa: F822
           "DEFAULT_MAX_BLOCKS_PER_BATCH", "KvplanMooncakeConnector", "BlockColumn"]

logger = logging.getLogger(__name__)

#: Entries per ``batch_transfer_sync_write`` call (Mooncake's TCP transport refuses batches past
#: about 2,048 entries per peer; RDMA has no such cap).
DEFAULT_MAX_BLOCKS_PER_BATCH = 1024
# Remote buffers are not published by vLLM's handshake: bounded by the address space only.
_ADDRESS_SPACE = 2**64 - 1


class BlockColumn(np.ndarray):
    """A uint64 column of the plan. Truthy when non-empty, as vLLM's lists are (its caller
    tests ``if src_ptrs:``); iterating or ``sum()`` works as on a list."""

    def __bool__(self) -> bool:
        return self.size > 0


def _column(parts: list[np.ndarray]) -> BlockColumn:
    if not parts:
        arr = np.empty(0, dtype=np.uint64)
    elif len(parts) == 1:
        arr = parts[0]
    else:
        arr = np.concatenate(parts)
    return arr.view(BlockColumn)


class _PeerTemplates:
    """kvplan templates of one peer layout: one per region key (KV group, shared groups)."""

    __slots__ = ("local", "remote", "groups", "error")

    def __init__(self, worker: Any, vllm: Any, agent_meta: Any, local_regions: list[Any],
                 remote_regions: list[Any]) -> None:
        self.local = local_regions  # identity-checked cache key (vLLM reuses the lists)
        self.remote = remote_regions
        self.groups: list[tuple[int, tuple[int, ...], kvplan.Template]] = []
        self.error: kvplan.KvPlanError | None = None
        try:
            self._build(worker, agent_meta)
        except kvplan.KvPlanError as exc:
            self.error = exc

    def _build(self, worker: Any, agent_meta: Any) -> None:
        buffers = sorted(zip(worker.seen_base_addresses, worker._kv_data_lens))
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
            buf = next(((p, n) for p, n in buffers if p <= src_ptr < p + n), None)
            if buf is None:
                raise kvplan.LayoutError(
                    f"region {index} ({lr.layer_name}): local address {src_ptr:#x} lies in no "
                    f"registered KV buffer")
            dst_ptr = rr.base_addr + dst_off
            key = (lr.group_index, tuple(lr.shared_group_ids))
            by_key.setdefault(key, []).append(
                (src_ptr, buf[0] + buf[1] - src_ptr, lr.block_len,
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
               remote_regions: list[Any], vllm: Any) -> _PeerTemplates:
    cache = self.__dict__.setdefault("_kvplan_templates", {})
    key = (id(local_regions), id(remote_regions), agent_meta.remote_tp_rank,
           agent_meta.remote_tp_size)
    peer: _PeerTemplates | None = cache.get(key)
    if peer is None or peer.local is not local_regions or peer.remote is not remote_regions:
        peer = _PeerTemplates(self, vllm, agent_meta, local_regions, remote_regions)
        cache[key] = peer
    return peer


def plan_request(self: Any, peer: _PeerTemplates, local_by_group: list[list[int]],
                 remote_by_group: list[list[int]], vllm: Any) -> list[kvplan.TransferPlan]:
    """Plans of one request's (filtered, kernel-expanded) block ids; raises KvPlanError."""
    if peer.error is not None:
        raise peer.error
    plans = []
    block_ids_for_region = vllm._block_ids_for_region
    n_groups = len(local_by_group)
    for group, shared, template in peer.groups:
        if 0 <= group < n_groups and group < len(remote_by_group):
            # vLLM's _block_ids_for_region returns a copy of this group's list: the list
            # itself is the same ids, and it is read once, right here
            local = local_by_group[group]
            if not len(local):
                continue
            remote = remote_by_group[group]
        else:  # packed regions shared by several groups, or vLLM's missing-group assert
            local = block_ids_for_region(local_by_group, group, shared)
            if not local:
                continue
            remote = block_ids_for_region(remote_by_group, group, shared)
        plans.append(template.plan(_ids(local), _ids(remote)))
    return plans


def _ids(block_ids: Any) -> np.ndarray:
    """vLLM's block-id list as int64, in one pass (``np.fromiter`` with the count known is the
    cheapest conversion of a list of Python ints; arrays pass through)."""
    if isinstance(block_ids, np.ndarray):
        return block_ids.astype(np.int64, copy=False)
    return np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))


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
    null_block = vllm.NULL_BLOCK_ID
    mamba_spec = vllm.MambaSpec
    peer = _templates(self, agent_meta, local_regions, remote_regions, vllm)
    group_specs = self.kv_cache_config.transfer_groups
    src_parts: list[np.ndarray] = []
    dst_parts: list[np.ndarray] = []
    len_parts: list[np.ndarray] = []
    err_reqs: list[str] = []
    err_msg: str | None = None
    for d_req_id, send_meta in ready_reqs:
        _, remote_per_group = agent_meta.req_blocks[d_req_id]
        if not remote_per_group or all(len(g) == 0 for g in remote_per_group):
            continue
        if len(send_meta.local_block_ids) != len(remote_per_group):
            logger.error("req %s: KV group count mismatch: local=%d, remote=%d", d_req_id,
                         len(send_meta.local_block_ids), len(remote_per_group))
            err_reqs.append(d_req_id)
            err_msg = err_msg or "KV group count mismatch"
            continue
        local_by_group: list[list[int]] = []
        remote_by_group: list[list[int]] = []
        short = False
        for index, (local, remote) in enumerate(zip(send_meta.local_block_ids,
                                                    remote_per_group)):
            if isinstance(group_specs[index].kv_cache_spec, mamba_spec):
                local = [b for b in local if b != null_block]
                remote = [b for b in remote if b != null_block]
            if len(local) < len(remote):
                short = True
                break
            if len(local) > len(remote):  # partial prefix hit: the uncomputed tail only
                local = local[-len(remote):] if remote else []
            local_by_group.append(local)
            remote_by_group.append(remote)
        if short:
            err_reqs.append(d_req_id)
            err_msg = err_msg or "P num blocks less than D"
            continue
        if not any(local_by_group):
            continue
        local_by_group = self._logical_to_kernel_block_ids(local_by_group)
        remote_by_group = self._logical_to_kernel_block_ids(remote_by_group)
        try:
            plans = plan_request(self, peer, local_by_group, remote_by_group, vllm)
        except kvplan.KvPlanError as exc:
            logger.error("req %s: kvplan refused the transfer: %s: %s", d_req_id,
                         type(exc).__name__, exc)
            err_reqs.append(d_req_id)
            err_msg = err_msg or f"{type(exc).__name__}: {exc}"
            continue
        for p in plans:
            src_parts.append(p.src_addrs)
            dst_parts.append(p.dst_addrs)
            len_parts.append(p.lengths)
    return _column(src_parts), _column(dst_parts), _column(len_parts), err_reqs, err_msg


def _send_blocks(self: Any, remote_session: str, src_ptrs: Any, dst_ptrs: Any,
                 lengths: Any) -> int:
    cap = getattr(self, "kvplan_max_blocks_per_batch", DEFAULT_MAX_BLOCKS_PER_BATCH)
    src = np.asarray(src_ptrs, dtype=np.uint64)
    dst = np.asarray(dst_ptrs, dtype=np.uint64)
    lens = np.asarray(lengths, dtype=np.uint64)
    start = time.perf_counter()
    ret = 0
    for lo in range(0, len(src), cap):
        hi = lo + cap
        ret = self.engine.batch_transfer_sync_write(
            remote_session, src[lo:hi].tolist(), dst[lo:hi].tolist(), lens[lo:hi].tolist())
        if ret != 0:
            break
    duration = time.perf_counter() - start
    total = int(lens.sum())
    if ret == 0:
        self.xfer_stats.record_transfer(duration_s=duration, total_bytes=total,
                                        num_descs=len(src))
        logger.debug("Sending to %s done, took %s", remote_session, duration)
    else:
        self.xfer_stats.record_failed_transfer()
        logger.warning("Sending to %s failed (ret=%s) after %s (%d descriptors, %d bytes)",
                       remote_session, ret, duration, len(src), total)
    return ret


# ---------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------
_PATCHES = MethodPatches({"_build_transfer_params": _build_transfer_params,
                          "_send_blocks": _send_blocks})
REPLACED_METHODS = tuple(_PATCHES.replacements)


def install(worker_class: type, *,
            max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH) -> tuple[str, ...]:
    """Replace ``worker_class``'s ``_build_transfer_params`` and ``_send_blocks`` (vLLM's
    ``MooncakeConnectorWorker`` or a subclass); returns the names replaced (none when already
    installed)."""
    if max_blocks_per_batch <= 0:
        raise ValueError(f"max_blocks_per_batch must be positive, got {max_blocks_per_batch}")
    if not any(k.__name__ == "MooncakeConnectorWorker" for k in worker_class.__mro__):
        raise TypeError(f"{worker_class.__name__} is not vLLM's MooncakeConnectorWorker "
                        "(or a subclass)")
    replaced = _PATCHES.install(worker_class)
    setattr(worker_class, "kvplan_max_blocks_per_batch", max_blocks_per_batch)
    return replaced


def uninstall(worker_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``worker_class``."""
    restored = _PATCHES.uninstall(worker_class)
    if "kvplan_max_blocks_per_batch" in worker_class.__dict__:
        delattr(worker_class, "kvplan_max_blocks_per_batch")
    return restored


def installed(worker_class: type) -> tuple[str, ...]:
    return _PATCHES.installed(worker_class)


# ---------------------------------------------------------------------------------------------
# The connector class for vLLM's factory (built on first access: vLLM is imported then)
# ---------------------------------------------------------------------------------------------
_CONNECTOR: type | None = None
_VLLM_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _connector_class() -> type:
    global _CONNECTOR
    if _CONNECTOR is None:
        import importlib

        mc = importlib.import_module(_VLLM_MOONCAKE)

        base_worker = mc.MooncakeConnectorWorker

        class KvplanMooncakeConnectorWorker(base_worker):  # type: ignore[misc,valid-type]
            """vLLM's Mooncake worker planning its transfers with kvplan."""

        install(KvplanMooncakeConnectorWorker)

        class KvplanMooncakeConnector(mc.MooncakeConnector):  # type: ignore[misc,name-defined]
            """vLLM's ``MooncakeConnector`` (``SupportsHMA``) whose worker plans with kvplan."""

            def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
                super().__init__(vllm_config, role, kv_cache_config)
                if self.connector_worker is not None:
                    # vLLM's constructor names its worker class directly; the subclass adds
                    # no state, so the built worker takes the planning subclass as is.
                    self.connector_worker.__class__ = KvplanMooncakeConnectorWorker

        KvplanMooncakeConnector.__module__ = __name__
        KvplanMooncakeConnectorWorker.__module__ = __name__
        KvplanMooncakeConnector.Worker = KvplanMooncakeConnectorWorker
        _CONNECTOR = KvplanMooncakeConnector
    return _CONNECTOR


def __getattr__(name: str) -> Any:
    if name == "KvplanMooncakeConnector":
        return _connector_class()
    if name == "KvplanMooncakeConnectorWorker":
        return _connector_class().Worker  # type: ignore[attr-defined]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
