"""vllm-ascend 0.23.0.post1: the hybrid Mooncake connector's pull pairs KV caches by layer.

``install(KVCacheRecvingThread)`` (the decode's receiving thread of
``vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_hybrid_connector``) replaces two methods
on the class; ``uninstall`` restores exactly what was there. docs/vllm.md has the full account.

* ``_transfer_kv_cache_all_groups(req_meta)``, the pull of one request from one prefill rank
  (hybrid models: Mamba or compressed-attention KV groups). vllm-ascend zips the decode's list
  of cache addresses with the prefill rank's list by position, so under prefill PP the second
  stage's layers are read into the decode's first layers and the decode's later layers get
  nothing; it also steps remote addresses by the decode's block stride. The replacement:

  - takes the prefill stage of the pull as vllm-ascend's own per-stage pull does
    (``offset // tp_num_need_pulls``) and that stage's layer range from the thread's
    ``pp_layer_indices`` (one more layer on the last stage with a speculative config, as
    vllm-ascend does for MTP);
  - attributes each decode cache address to the global layer ids of the layers whose tensors
    start there (and the layers sharing their KV cache tensor), from the thread's ``kv_caches``
    and ``kv_cache_config``; the stage's addresses are the decode's addresses of that range, in
    the decode's order: the prefill builds its list the same way from its own layers. The
    prefill publishes no layer names, so the match is checked against what it does publish:
    as many addresses as the range has (else ``PairingError``), each entry's block length
    equal to the decode's (else ``SizeMismatchError``), every block id below its side's block
    count (else ``IndexBoundsError``);
  - builds one ``kvplan.Template`` per KV group (prefill layout → decode layout, paired by
    layer id, remote entries stepped by the prefill's published block lengths), cached per
    peer and stage, and plans each group's block ids with it after vLLM's own rules
    (a group with no ids on either side is skipped; a non-Mamba group keeps the prefill's last
    ids when the decode has fewer);
  - reads the plan with ``engine.batch_transfer_sync_read`` as vllm-ascend does, and logs and
    raises as it does.

  A pull kvplan refuses raises the typed error before anything is read, so vllm-ascend logs it
  ("Failed to transfer KV cache for request ..."); it never reads into the wrong layer. Two
  cases are refused for that reason: head-sliced pulls (``tp_num_need_pulls > 1``: the hybrid
  path copies whole blocks from every rank of the slice, the last read wins), and Mamba models
  under prefill PP (vllm-ascend's ``start_load_kv`` then pulls from the first stage only, so
  the other stages' layers would never arrive).
* ``_get_remote_metadata(remote_host, remote_handshake_port)``: vllm-ascend's handshake, which
  keeps only the prefill's addresses and port; the replacement also keeps its block lengths and
  block count (:func:`remember_remote_metadata`), which the pull above needs.

Importing this module imports nothing from vllm-ascend or vLLM.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

import kvplan
from kvplan.compat._methods import MethodPatches

__all__ = ["install", "uninstall", "installed", "remember_remote_metadata", "pull_stage",
           "StagePeer", "REPLACED_METHODS"]

_THREAD_CLASS = "KVCacheRecvingThread"


def _ascend_module(cls: type) -> Any:
    """vllm-ascend's hybrid connector module (its helpers and imports), from the class MRO."""
    for klass in cls.__mro__:
        if klass.__name__ == _THREAD_CLASS:
            return sys.modules[klass.__module__]
    raise TypeError(f"{cls.__name__} is not vllm-ascend's {_THREAD_CLASS} (or a subclass)")


def _layer_index(layer_name: str) -> int:
    """The global layer id in a vLLM layer name: its one integer component, as vLLM's
    ``extract_layer_index`` reads it."""
    ints = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise kvplan.LayoutError(
            f"layer name {layer_name!r} has {len(ints)} integer components; expected exactly one "
            "(its global layer id)")
    return ints[0]


def remember_remote_metadata(thread: Any, remote_handshake_port: int, agent_meta: Any) -> None:
    """Keep what a prefill rank's handshake metadata says about its caches (block lengths and
    block count) next to the addresses vllm-ascend keeps; the patched pull reads them."""
    with thread.remote_metadata_lock:
        thread.kv_caches_base_addr[agent_meta.engine_id][remote_handshake_port] = \
            agent_meta.kv_caches_base_addr
        thread.remote_te_port[agent_meta.engine_id][remote_handshake_port] = \
            agent_meta.te_rpc_port
        store = thread.__dict__.setdefault("_kvplan_remote_caches", {})
        store[(agent_meta.engine_id, remote_handshake_port)] = (
            list(agent_meta.block_lens), int(agent_meta.num_blocks))


def _get_remote_metadata(self: Any, remote_host: str, remote_handshake_port: int) -> None:
    """vllm-ascend's handshake (same socket protocol), keeping the block lengths too."""
    mod = _ascend_module(type(self))
    peer = f"{remote_host}:{remote_handshake_port}"
    sock = None
    try:
        sock = self._get_remote_socket(remote_host, remote_handshake_port)
        mod.ensure_zmq_send(sock, self.encoder.encode((mod.GET_META_MSG, "")), peer)
        agent_meta = self.decoder.decode(mod.ensure_zmq_recv(sock, peer))
        if agent_meta.engine_id == self.local_engine_id:
            raise AssertionError(f"Conflict engine id {agent_meta.engine_id} with local engine "
                                 f"id {self.local_engine_id}.")
        remember_remote_metadata(self, remote_handshake_port, agent_meta)
    except Exception:
        if sock is not None:
            sock.close()
            sock = None
        raise
    finally:
        if sock is not None:
            self._return_remote_socket(sock, remote_host, remote_handshake_port)


def pull_stage(thread: Any, req_meta: dict[str, Any]) -> tuple[int, int, int]:
    """``(prefill PP rank, first layer, end layer)`` of one pull, by vllm-ascend's rules."""
    stage = req_meta["offset"] // req_meta["tp_num_need_pulls"]
    first, end = thread.pp_layer_indices[stage]
    if thread.vllm_config.speculative_config is not None and stage == thread._prefill_pp_size - 1:
        end += 1  # vllm-ascend moves the MTP layer's cache with the last stage
    return stage, first, end


def _local_entry_layers(thread: Any, local_addrs: list[int]) -> list[tuple[int, ...]]:
    """For each decode cache address, the sorted global layer ids it holds data of."""
    by_ptr: dict[int, set[str]] = {}
    for name, caches in thread.kv_caches.items():
        for tensor in caches if isinstance(caches, (list, tuple)) else (caches,):
            by_ptr.setdefault(int(tensor.data_ptr()), set()).add(name)
    sharing: dict[str, set[str]] = {}
    for kv_tensor in thread.kv_cache_config.kv_cache_tensors:
        for name in kv_tensor.shared_by:
            sharing.setdefault(name, set()).update(kv_tensor.shared_by)
    out = []
    for k, addr in enumerate(local_addrs):
        names = by_ptr.get(int(addr))
        if not names:
            raise kvplan.LayoutError(
                f"decode cache address {k} ({int(addr):#x}) is the start of no registered "
                "layer's KV cache tensor")
        held = set(names)
        for name in names:
            held |= sharing.get(name, set())
        out.append(tuple(sorted({_layer_index(n) for n in held})))
    return out


class StagePeer:
    """The templates of one (prefill rank, stage) peer: one per KV group, ``None`` for a group
    none of the stage's entries serves."""

    __slots__ = ("remote_addrs", "templates", "stage")

    def __init__(self, thread: Any, remote_addrs: list[int], local_addrs: list[int],
                 remote_block_lens: list[int], remote_num_blocks: int,
                 stage: tuple[int, int, int]) -> None:
        self.remote_addrs = remote_addrs  # identity-checked: a new handshake replaces the list
        self.stage = stage
        pp_rank, first, end = stage
        layers = _local_entry_layers(thread, local_addrs)
        chosen = []
        for k, ids in enumerate(layers):
            inside = [first <= i < end for i in ids]
            if all(inside):
                chosen.append(k)
            elif any(inside):
                raise kvplan.PairingError(
                    f"decode cache address {k} holds layers {list(ids)}, which prefill stage "
                    f"{pp_rank} (layers {first}..{end - 1}) holds only some of")
        if len(chosen) != len(remote_addrs) or len(remote_block_lens) != len(remote_addrs):
            raise kvplan.PairingError(
                f"prefill stage {pp_rank} (layers {first}..{end - 1}) publishes "
                f"{len(remote_addrs)} cache addresses and {len(remote_block_lens)} block "
                f"lengths; the decode holds {len(chosen)} cache addresses for those layers")
        local_blocks = int(thread.kv_cache_config.num_blocks)
        self.templates: list[kvplan.Template | None] = []
        for group in range(thread.hma_group_size):
            rows = [(j, k) for j, k in enumerate(chosen)
                    if not thread.addr_group_idx or group in thread.addr_group_idx[k]]
            if not rows:
                self.templates.append(None)
                continue
            layer_ids = [layers[k][0] for _, k in rows]
            r_lens = [int(remote_block_lens[j]) for j, _ in rows]
            l_lens = [int(thread.block_len_per_addr[k]) for _, k in rows]
            l_strides = [int(thread.block_stride_per_addr[k]) for _, k in rows]
            remote = kvplan.Layout(
                [int(remote_addrs[j]) for j, _ in rows],
                [n * remote_num_blocks for n in r_lens], r_lens, layer_ids, strides=r_lens)
            local = kvplan.Layout(
                [int(local_addrs[k]) for _, k in rows],
                [s * (local_blocks - 1) + n for s, n in zip(l_strides, l_lens)], l_lens,
                layer_ids, strides=l_strides)
            self.templates.append(kvplan.Template(remote, local, kvplan.Pairing.by_layer_id()))


def _stage_peer(self: Any, engine_id: str, port: int, stage: tuple[int, int, int],
                remote_addrs: list[int], local_addrs: list[int]) -> StagePeer:
    cache = self.__dict__.setdefault("_kvplan_stage_peers", {})
    peer: StagePeer | None = cache.get((engine_id, port))
    if peer is None or peer.remote_addrs is not remote_addrs or peer.stage != stage:
        block_lens, num_blocks = self._kvplan_remote_caches[(engine_id, port)]
        peer = StagePeer(self, remote_addrs, local_addrs, block_lens, num_blocks, stage)
        cache[(engine_id, port)] = peer
    return peer


def _transfer_kv_cache_all_groups(self: Any, req_meta: dict[str, Any]) -> None:
    mod = _ascend_module(type(self))
    remote_request_id = req_meta["remote_request_id"]
    remote_block_ids = req_meta["remote_block_ids"]
    local_block_ids = req_meta["local_block_ids"]
    engine_id = req_meta["remote_engine_id"]
    remote_host = req_meta["remote_host"]
    port = req_meta["remote_handshake_port"]
    if sum(len(ids) for ids in local_block_ids) == 0:
        return  # full prefix hit: nothing to read, vllm-ascend's caller notifies the prefill
    if req_meta["tp_num_need_pulls"] > 1:
        raise kvplan.PairingError(
            f"request {remote_request_id}: a hybrid pull from {req_meta['tp_num_need_pulls']} "
            "prefill ranks per decode rank would copy whole blocks from each of them (the last "
            "read wins); head-sliced hybrid pulls are not planned")
    if self.has_mamba and self._prefill_pp_size > 1:
        raise kvplan.PairingError(
            f"request {remote_request_id}: with Mamba groups vllm-ascend pulls from prefill PP "
            f"stage 0 only, so the layers of stages 1..{self._prefill_pp_size - 1} would never "
            "be transferred")
    stage = pull_stage(self, req_meta)
    with self.remote_metadata_lock:
        known = (engine_id in self.kv_caches_base_addr
                 and port in self.kv_caches_base_addr[engine_id]
                 and (engine_id, port) in self.__dict__.get("_kvplan_remote_caches", {}))
    if not known:
        self._get_remote_metadata(remote_host, port)
    with self.remote_metadata_lock:
        remote_addrs = self.kv_caches_base_addr[engine_id][port]
        local_addrs = self.kv_caches_base_addr[self.local_engine_id][self.local_handshake_port]
        remote_transfer_port = self.remote_te_port[engine_id][port]
    session_id = f"{remote_host}:{remote_transfer_port}"
    peer = _stage_peer(self, engine_id, port, stage, remote_addrs, local_addrs)

    req_start_time = time.perf_counter()
    local_parts: list[np.ndarray] = []
    remote_parts: list[np.ndarray] = []
    len_parts: list[np.ndarray] = []
    for group, template in enumerate(peer.templates):
        remote = remote_block_ids[group]
        local = local_block_ids[group]
        if not remote or not local or template is None:
            continue
        if not isinstance(self.kv_cache_specs[group], mod.MambaSpec) and len(local) < len(remote):
            remote = remote[-len(local):]
        plan = template.plan(np.asarray(remote, dtype=np.int64),
                             np.asarray(local, dtype=np.int64))
        remote_parts.append(plan.src_addrs)
        local_parts.append(plan.dst_addrs)
        len_parts.append(plan.lengths)

    def column(parts: list[np.ndarray]) -> list[int]:
        return np.concatenate(parts).tolist() if parts else []

    ret = self.engine.batch_transfer_sync_read(
        session_id, column(local_parts), column(remote_parts), column(len_parts))
    if ret < 0:
        mod.logger.error("Mooncake transfer failed for request. remote_request_id=%s, ret=%d. ",
                         remote_request_id, ret)
        raise RuntimeError(f"Mooncake transfer failed, ret: {ret}")
    elapsed_ms = (time.perf_counter() - req_start_time) * 1000
    mod.logger.info(
        "KV cache transfer for request %s took %.2f ms (prefill PP stage %d, layers %d..%d, "
        "kvplan). local_device_id %s remote_session_id %s", remote_request_id, elapsed_ms,
        stage[0], stage[1], stage[2] - 1, self.tp_rank, session_id)


_PATCHES = MethodPatches({"_transfer_kv_cache_all_groups": _transfer_kv_cache_all_groups,
                          "_get_remote_metadata": _get_remote_metadata})
REPLACED_METHODS = tuple(_PATCHES.replacements)


def install(recving_thread_class: type) -> tuple[str, ...]:
    """Replace ``recving_thread_class``'s pull and handshake methods (vllm-ascend's
    ``KVCacheRecvingThread`` of the hybrid Mooncake connector, or a subclass); returns the
    names replaced (none when already installed)."""
    _ascend_module(recving_thread_class)
    return _PATCHES.install(recving_thread_class)


def uninstall(recving_thread_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``recving_thread_class``."""
    return _PATCHES.uninstall(recving_thread_class)


def installed(recving_thread_class: type) -> tuple[str, ...]:
    return _PATCHES.installed(recving_thread_class)
