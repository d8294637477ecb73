"""The KV regions of vLLM NIXL workers as :class:`kvplan.Layout` objects: a worker's own
(:func:`worker_layout`, what its layout identity and manifest check describe, and the side of a
staged read it plans for itself) and a prefill rank's as its agent metadata describes it
(:func:`remote_layout`, the other side of the decode's staged read)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["local_layout", "region_groups", "region_layer_ids", "region_layers", "remote_layout",
           "state_layout", "worker_layout", "worker_order"]


def worker_order(worker: Any) -> str | None:
    """The memory order of this NIXL worker's blocks
    (:func:`kvplan.compat.vllm.semantics.memory_order`): that of the layout its handshake
    names, vLLM's ``kv_cache_layout`` (the layout vLLM resolved for the process) or, with a
    host buffer, the buffer's (vLLM may lay it out heads-outermost over a token-major device
    cache), as vLLM sends it; from the worker's ``vllm_config`` where it keeps neither."""
    from kvplan.compat.vllm.semantics import memory_order

    d = worker.__dict__
    name = d.get("host_buffer_kv_cache_layout") if d.get("use_host_buffer") else None
    return memory_order(d.get("vllm_config"), name or d.get("kv_cache_layout"))


def worker_layout(worker: Any, layer_id: Any = None, pp_rank: int | None = None) -> Any:
    """The NIXL worker's registered regions as a :class:`kvplan.Layout`
    (:func:`kvplan.compat.vllm.semantics.regions_layout`: each region's block bytes, the
    block size and TP coordinates, the heads where whole); None before ``register_kv_caches``,
    for a model with Mamba state, and at DCP or PCP sizes above 1 (vLLM pairs those ranks
    region by region in ways a layout without their coordinates would refuse).
    With ``layer_id`` (vLLM's ``extract_layer_index``), each region's global layer id, read
    from the layer vLLM registered it for (``region_names``): a PP stage's layout (PP size
    above 1) has them and the stage's ``pp_rank``, or is None, since without them the stage's
    regions would be compared with the first layers of a peer's.
    The heads in the memory order :func:`worker_order` says: the layout identity, the
    manifest check and the staged reads all describe the blocks in the one order."""
    from kvplan.compat.vllm.semantics import regions_layout

    d = worker.__dict__
    if d.get("_has_mamba") or any(int(d.get(size, 1) or 1) != 1
                                  for size in ("dcp_size", "pcp_size")):
        return None
    pp_size = int(d.get("pp_size", 1) or 1)
    tp_rank = int(d.get("tp_rank", 0) or 0)
    try:
        ptrs = [int(p) for p in d["kv_caches_base_addr"][d["engine_id"]][tp_rank]]
    except (KeyError, TypeError):
        return None
    ids = region_layer_ids(worker, layer_id) if layer_id is not None else None
    if pp_size != 1 and (ids is None or len(ids) != len(ptrs) or pp_rank is None):
        return None
    items = [int(n) for n in d.get("block_len_per_layer") or ()]
    blocks = int(d.get("num_blocks", 0) or 0) * int(
        d.get("_physical_blocks_per_logical_kv_block", 1) or 1) or 1
    context: dict[str, Any] = dict(page_size=int(d.get("block_size", 1) or 1), tp_rank=tp_rank,
                                   tp_size=int(d.get("world_size", 1) or 1))
    if pp_size != 1:
        context.update(pp_rank=int(pp_rank or 0), pp_size=pp_size)
    return regions_layout(ptrs, items, ids, blocks=blocks, context=context,
                          use_mla=bool(d.get("use_mla")), model_config=d.get("model_config"),
                          order=worker_order(worker))


def region_layer_ids(worker: Any, layer_id: Any) -> list[int] | None:
    """Each registered region's global layer id, ``layer_id`` (vLLM's
    ``extract_layer_index``) of the layer vLLM registered it for (its ``region_names``, one
    name per region); None where vLLM recorded no name per region or a name has no id."""
    d = worker.__dict__
    names = [str(n) for n in d.get("region_names") or ()]
    if not names or len(names) != len(d.get("block_len_per_layer") or ()):
        return None
    try:
        return [int(layer_id(name)) for name in names]
    except (AssertionError, ValueError, TypeError):
        return None


def region_layers(worker: Any) -> list[list[str]] | None:
    """The layers behind each of the NIXL worker's registered regions, in region order: vLLM's
    own ``region_members`` where its ``register_kv_caches`` recorded them for every region
    (vLLM 0.34; 0.33 only for push workers without Mamba), else the layers of the caches it
    registered (its ``host_xfer_buffers`` with a host buffer, else ``device_kv_caches``), each
    in the region whose first block holds the layer's first byte: vLLM 0.32 / 0.33 register
    one region per distinct base address (the layer's own view, or the whole row holding it),
    so the layers of a hybrid model sharing one KV cache tensor (an attention layer and state
    layers) share its region. Layers without a spec are skipped, as vLLM skips them. None
    where a layer lies in no region or several, a region holds none, or the worker has not
    registered its caches."""
    d = worker.__dict__
    bases = _region_bases(worker)
    lens = [int(n) for n in d.get("block_len_per_layer") or ()]
    if not bases or len(lens) != len(bases):
        return None
    members = d.get("region_members")
    if members and len(members) == len(bases):
        return [[str(n) for n in names] for names in members]
    caches = d.get("host_xfer_buffers") if d.get("use_host_buffer") else d.get(
        "device_kv_caches")
    specs = d.get("_layer_specs") or {}
    if not caches:
        return None
    out: list[list[str]] = [[] for _ in bases]
    for name, cache in caches.items():
        if specs.get(name) is None:
            continue
        try:
            ptr = int(cache.data_ptr())
        except (AttributeError, TypeError, ValueError):
            return None
        holding = [r for r, (base, n) in enumerate(zip(bases, lens)) if 0 <= ptr - base < n]
        if len(holding) != 1:
            return None
        out[holding[0]].append(str(name))
    if not all(out):
        return None
    return [sorted(names, key=_natural) for names in out]


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Layer names in model order (``layers.10`` after ``layers.2``), as vLLM registers them."""
    return tuple((0, int(part)) if part.isdigit() else (1, part)
                 for part in re.split(r"(\d+)", name))


def _region_bases(worker: Any) -> list[int]:
    d = worker.__dict__
    try:
        return [int(p) for p in d["kv_caches_base_addr"][d["engine_id"]][int(
            d.get("tp_rank", 0) or 0)]]
    except (KeyError, TypeError, ValueError):
        return []


def state_layout(worker: Any, layer_id: Any) -> tuple[Any, list[str], list[int]]:
    """The NIXL worker of a model with Mamba state as a :class:`kvplan.Layout` of one entry per
    layer behind each region (:func:`region_layers`), in region order: each at its region's
    base, of its region's block bytes and stride, the layer's id ``layer_id(name)``, with the
    block size, TP coordinates and the heads as :func:`worker_layout` builds them; and the
    entries' layer names and ids. Roles, kinds and a state entry's bytes are then the layers'
    specs' (``kvplan.compat.vllm.manifest.region_roles``). The layout is None before
    ``register_kv_caches``, where the layers behind a region cannot be read, and at PP, DCP or
    PCP sizes above 1 (as :func:`worker_layout`)."""
    from kvplan.compat.vllm.semantics import regions_layout

    d = worker.__dict__
    members = region_layers(worker)
    if members is None or any(int(d.get(size, 1) or 1) != 1
                              for size in ("pp_size", "dcp_size", "pcp_size")):
        return None, [], []
    bases = _region_bases(worker)
    lens = [int(n) for n in d.get("block_len_per_layer") or ()]
    strides = [int(n) for n in d.get("block_stride_per_layer") or lens]
    names = [name for layers in members for name in layers]
    ids = [int(layer_id(name)) for name in names]
    ptrs = [bases[r] for r, layers in enumerate(members) for _ in layers]
    items = [lens[r] for r, layers in enumerate(members) for _ in layers]
    tp_rank = int(d.get("tp_rank", 0) or 0)
    blocks = int(d.get("num_blocks", 0) or 0) * int(
        d.get("_physical_blocks_per_logical_kv_block", 1) or 1) or 1
    context: dict[str, Any] = dict(page_size=int(d.get("block_size", 1) or 1), tp_rank=tp_rank,
                                   tp_size=int(d.get("world_size", 1) or 1))
    layout = regions_layout(ptrs, items, ids, blocks=blocks, context=context,
                            use_mla=bool(d.get("use_mla")), model_config=d.get("model_config"),
                            order=worker_order(worker))
    if layout is not None and len(strides) == len(lens):
        raw = layout.to_dict()
        region_strides = [strides[r] for r, layers in enumerate(members) for _ in layers]
        raw["strides"] = region_strides
        raw["data_lens"] = [n * blocks for n in region_strides]
        layout = type(layout).from_dict(raw)
    return layout, names, ids


def region_groups(raw: Any) -> list[tuple[tuple[int, str], ...]]:
    """The entries of a :func:`state_layout` (as ``Layout.to_dict()`` gives it: an identity
    message's ``layout``) region by region: each region's ``(layer id, role)`` pairs, sorted,
    the entries of one region being the consecutive ones at its base address."""
    groups: list[tuple[tuple[int, str], ...]] = []
    last: Any = object()
    for ptr, layer, role in zip(raw.get("data_ptrs") or (), raw.get("layer_ids") or (),
                                raw.get("roles") or ()):
        entry = (int(layer), str(role))
        if groups and ptr == last:
            groups[-1] = tuple(sorted(groups[-1] + (entry,)))
        else:
            groups.append((entry,))
        last = ptr
    return groups


def _strides_whole(lens: Any, strides: Any) -> bool:
    """Whether each region's blocks lie back to back (a block's stride is its length): the
    layouts below describe no padding between blocks."""
    lens, strides = list(lens or ()), list(strides or ())
    return bool(lens) and (not strides or [int(n) for n in lens] == [int(n) for n in strides])


def remote_layout(worker: Any, metadata: Any, remote_rank: int,
                  remote_tp_size: int) -> Any:
    """The prefill rank's KV regions as a :class:`kvplan.Layout`, from the agent metadata its
    handshake served (its regions' bases and block lengths, blocks, block size), the decode's
    model for the heads (:func:`kvplan.compat.vllm.semantics.regions_layout`, as
    :func:`worker_layout` builds the decode's own), in the memory order of the layout its
    metadata names (:func:`kvplan.compat.vllm.semantics.layout_order`: the peer's own vLLM
    decided it, nothing of this process says it); None where kvplan builds none (heads not
    whole, padded blocks, regions of several block counts, a layout kvplan does not
    describe). Regions of several KV groups are one layout here; a staged read of several
    groups puts each group's regions in a pool of their own per request
    (:class:`kvplan.compat.vllm.grouped.GroupedRead`)."""
    from kvplan.compat.vllm.semantics import layout_order, regions_layout

    try:
        ptrs = [int(p) for p in metadata.kv_caches_base_addr]
        lens = [int(n) for n in metadata.block_lens]
        blocks = int(metadata.num_blocks) * int(
            getattr(metadata, "physical_blocks_per_logical_kv_block", 1) or 1)
        page = int(metadata.block_size)
    except (AttributeError, TypeError, ValueError):
        return None
    counts = set(getattr(metadata, "region_num_blocks", None) or ())
    if not _strides_whole(lens, getattr(metadata, "block_strides", None)) or len(counts) > 1:
        return None  # padded blocks or regions of several sizes: direct path
    if counts:
        blocks = int(counts.pop())
    d = worker.__dict__
    return regions_layout(ptrs, lens, None, blocks=blocks,
                          context=dict(page_size=page, tp_rank=int(remote_rank),
                                       tp_size=int(remote_tp_size)),
                          use_mla=bool(d.get("use_mla")), model_config=d.get("model_config"),
                          order=layout_order(getattr(metadata, "kv_cache_layout", None)))


def local_layout(worker: Any) -> Any:
    """This worker's :func:`worker_layout` where its blocks lie back to back (None
    otherwise: no staging), in the memory order of the layout its handshake names
    (:func:`worker_order`): the side of a staged read this worker plans for itself."""
    d = worker.__dict__
    if not _strides_whole(d.get("block_len_per_layer"), d.get("block_stride_per_layer")):
        return None
    return worker_layout(worker)
