"""kvplan templates of a vLLM peer layout: one per KV group of the aligned region lists, kept
per worker for the very lists they were built from (vLLM hands the same lists for a peer until
it re-registers) and the registered-buffer table they were checked against.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import kvplan

# Remote buffers are not published by vLLM's handshake: bounded by the address space only.
_ADDRESS_SPACE = 2**64 - 1

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

    __slots__ = ("local", "remote", "sources", "sources_key", "groups", "layouts", "rows",
                 "error")

    def __init__(self, worker: Any, agent_meta: Any, local_regions: list[Any],
                 remote_regions: list[Any]) -> None:
        self.local = local_regions  # identity-checked cache key (vLLM reuses the lists)
        self.remote = remote_regions
        sources = _buffer_sources(worker)
        buffers = _buffer_table(sources)
        self.sources = sources  # held so that the ids in sources_key stay theirs
        self.sources_key = _sources_key(sources)
        self.groups: list[tuple[int, tuple[int, ...], kvplan.Template]] = []
        #: Per template, its (local, remote) layouts: a staged request tells the decode the
        #: template it planned with, and the decode plans its own rounds from them.
        self.layouts: list[tuple[kvplan.Layout, kvplan.Layout]] = []
        #: Per template, its regions' rows (source pointer, extent and stride, destination
        #: pointer, extent and stride, bytes a block) that its layouts hold, for :meth:`joined`.
        self.rows: list[list[tuple[int, ...]]] = []
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
            src, dst = _row_layouts(rows)
            self.groups.append((group, shared, kvplan.Template(
                src, dst, kvplan.Pairing.positional())))
            self.layouts.append((src, dst))
            self.rows.append(rows)

    def joined(self, templates: list[int]
               ) -> tuple[kvplan.Layout, kvplan.Layout, list[tuple[int, ...]], list[int]]:
        """The regions of ``templates`` (indices of :attr:`groups`) as one source and one
        destination layout, in that order; the templates read into each of those regions (its
        place in ``templates``: a staged request of several KV groups gives each template's
        regions a pool of their own); and each region's bytes a block."""
        rows = [row for t in templates for row in self.rows[t]]
        reads: list[tuple[int, ...]] = [(k,) for k, t in enumerate(templates)
                                        for _ in self.rows[t]]
        src, dst = _row_layouts(rows)
        return src, dst, reads, [int(row[6]) for row in rows]


def _row_layouts(rows: list[tuple[int, ...]]) -> tuple[kvplan.Layout, kvplan.Layout]:
    """The source and destination layouts of regions given as :attr:`_PeerTemplates.rows`."""
    cols = list(zip(*rows))
    return (kvplan.Layout(list(cols[0]), list(cols[1]), list(cols[6]), strides=list(cols[2])),
            kvplan.Layout(list(cols[3]), list(cols[4]), list(cols[6]), strides=list(cols[5])))


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
