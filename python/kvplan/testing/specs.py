"""Peer buffers described in plain data: what each process allocates, and the kvplan
:class:`~kvplan.Layout` it publishes for them.

A :class:`PeerSpec` is picklable (it crosses into spawned peer processes as a dict) and holds
offsets, not addresses: the same spec describes a peer's arena in every process that maps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvplan.presets import ModelPreset, split_layers

__all__ = ["Entry", "PeerSpec", "ModelPeers", "pack_entries", "cross_layer_entries",
           "preset_peer", "model_peers", "build_layout"]


@dataclass(frozen=True)
class Entry:
    """One buffer of a peer: ``capacity`` items of ``item_len`` bytes, item ``i`` at
    ``offset + i * stride`` in its arena.

    ``stride`` defaults to ``item_len`` (a packed buffer). A larger stride describes an entry
    of a cross-layer pool, whose items sit side by side with other entries' items in every
    page (``Layout.cross_layer``); ``stride`` is then the pool's page size in bytes.
    """

    layer_id: int
    role: str  # "kv", "k", "v", an NPU group such as "g0", or a state name such as "mamba_conv"
    kind: str  # "page" or "state"
    offset: int
    item_len: int
    capacity: int
    stride: int = None  # type: ignore[assignment]  # None -> item_len (set in __post_init__)

    def __post_init__(self) -> None:
        if self.stride is None:
            object.__setattr__(self, "stride", self.item_len)
        elif self.stride < self.item_len:
            raise ValueError(f"stride {self.stride} is below item_len {self.item_len} "
                             f"(layer {self.layer_id} {self.role})")

    @property
    def nbytes(self) -> int:
        """Bytes from the first item's start to the last item's end (the entry's span)."""
        if self.capacity == 0:
            return 0
        return (self.capacity - 1) * self.stride + self.item_len

    @property
    def strided(self) -> bool:
        """True when items are not packed back to back (``stride > item_len``)."""
        return self.stride != self.item_len


@dataclass(frozen=True)
class PeerSpec:
    """A peer's buffers and how to describe them to kvplan.

    ``style`` picks the Layout constructor (see :func:`build_layout`): ``"mla"``, ``"mha"``
    (K entries, then V entries), ``"hybrid_mla"`` / ``"hybrid_mha"`` (``Layout.hybrid_linear``
    plus ``with_state``), ``"npu_groups"`` (``Layout.npu_groups`` plus ``with_state``; page
    entries group-major), ``"cross_layer"`` (``Layout.cross_layer`` over one pool holding
    every page entry side by side, plus ``with_state``); ``"raw"`` registers the buffers
    without building a layout (engine-level tests).

    ``context``: further layout-context keywords as ``(name, value)`` pairs, e.g. the TP
    position and attention geometry (``tp_rank``, ``tp_size``, ``kv_heads``, ``head_dim``,
    ``dtype_size``, ``memory_order``, ``page_size``) of a head-sharded peer.
    """

    name: str
    style: str
    entries: tuple[Entry, ...]
    num_model_layers: int
    pp_rank: int = 0
    pp_size: int = 1
    #: Tokens per page of the page entries (published in the layout's context).
    page_size: int = 1
    #: Further layout-context keywords as (name, value) pairs (they win over page_size).
    context: tuple[tuple[str, Any], ...] = ()
    #: Bytes of a staging region after the buffers (registered with the engine, not part of
    #: the layout): where staged transfers gather into (prefill) or land before the scatter
    #: (decode). 0: none.
    staging: int = 0

    @property
    def buffers_end(self) -> int:
        """Arena offset just past the last buffer."""
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    @property
    def staging_offset(self) -> int:
        """Arena offset of the staging region: the buffers' end, rounded up to 4 KiB."""
        return -(-self.buffers_end // 4096) * 4096

    @property
    def size(self) -> int:
        """Bytes of the arena that holds every buffer (and the staging region)."""
        if self.staging:
            return self.staging_offset + self.staging
        return self.buffers_end

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["entries"] = [asdict(e) for e in self.entries]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerSpec:
        d = dict(d)
        d["entries"] = tuple(Entry(**e) for e in d["entries"])
        d["context"] = tuple((str(k), v) for k, v in d.get("context", ()))
        return cls(**d)


def pack_entries(entries: Sequence[tuple[int, str, str, int, int]], align: int = 4096, *,
                 start: int = 0) -> tuple[Entry, ...]:
    """Lay ``(layer, role, kind, item_len, capacity)`` buffers out back to back, page aligned,
    from arena offset ``start`` (rounded up to ``align``)."""
    out, offset = [], -(-start // align) * align
    for layer, role, kind, item_len, capacity in entries:
        out.append(Entry(layer, role, kind, offset, item_len, capacity))
        offset += -(-item_len * capacity // align) * align
    return tuple(out)


def cross_layer_entries(entries: Sequence[tuple[int, str, int]], capacity: int, *,
                        offset: int = 0) -> tuple[Entry, ...]:
    """One cross-layer pool at ``offset``: ``capacity`` pages, each holding the items of
    ``(layer, role, item_len)`` side by side in that order (``[page][entry 0][entry 1]...``,
    the layout ``Layout.cross_layer`` describes). Every entry's stride is the page size."""
    page = sum(item for _, _, item in entries)
    out, at = [], offset
    for layer, role, item in entries:
        out.append(Entry(layer, role, "page", at, item, capacity, page))
        at += item
    return tuple(out)


def preset_peer(preset: ModelPreset, name: str, layers: Sequence[int], *, pages: int,
                page_size: int = 1, state_slots: int = 4, pp_rank: int = 0, pp_size: int = 1,
                cross_layer: bool = False) -> PeerSpec:
    """The buffers of a process holding ``layers`` of ``preset``: KV entries (per layer; for
    MHA all K entries, then all V entries), then one buffer per (state component, linear
    layer), with the preset's sizes.

    ``cross_layer=True``: the KV entries share one pool instead, page-major with the items of
    every KV layer of a page side by side (for MHA K then V of each layer), as
    ``ModelPreset.layout(..., cross_layer=True)`` lays them out; state buffers stay per layer,
    after the pool.
    """
    item = preset.kv_bytes_per_token * page_size
    kv = preset.kv_layers(layers)
    linear = preset.linear_layers(layers)
    states = [(i, state.name, "state", state.bytes_per_slot, state_slots)
              for state in (preset.state if linear else ()) for i in linear]
    if cross_layer:
        roles = ("kv",) if preset.attention == "mla" else ("k", "v")
        pool = cross_layer_entries([(i, r, item) for i in kv for r in roles], pages)
        end = max((e.offset + e.nbytes for e in pool), default=0)
        return PeerSpec(name, "cross_layer", pool + pack_entries(states, start=end),
                        preset.num_layers, pp_rank, pp_size, page_size)
    if preset.attention == "mla":
        rows = [(i, "kv", "page", item, pages) for i in kv]
    else:
        rows = [(i, role, "page", item, pages) for role in ("k", "v") for i in kv]
    style = ("hybrid_" if preset.hybrid else "") + preset.attention
    return PeerSpec(name, style, pack_entries(rows + states), preset.num_layers, pp_rank,
                    pp_size, page_size)


@dataclass(frozen=True)
class ModelPeers:
    """A decode peer holding every layer and the prefill PP stages, each holding its own."""

    decode: PeerSpec
    prefill: list[PeerSpec]


def model_peers(preset: ModelPreset, *, pages: int, pp_size: int = 1, page_size: int = 1,
                state_slots: int = 4, prefill_pages: int | None = None,
                pp_split: Sequence[int] | None = None, cross_layer: bool = False,
                decode_cross_layer: bool | None = None) -> ModelPeers:
    """Decode (PP=1) and prefill (PP=``pp_size``, split as :func:`kvplan.presets.split_layers`
    splits, the same split ``kvplan explain`` uses) peers of one model.

    ``cross_layer``: every peer keeps its KV in one cross-layer pool (see :func:`preset_peer`);
    ``decode_cross_layer`` overrides it for the decode peer alone (mixed layouts).
    """
    stages = split_layers(preset.num_layers, pp_size, pp_split)
    dcross = cross_layer if decode_cross_layer is None else decode_cross_layer
    decode = preset_peer(preset, "decode", range(preset.num_layers), pages=pages,
                         page_size=page_size, state_slots=state_slots, cross_layer=dcross)
    prefill = [preset_peer(preset, f"prefill{r}", layers, pages=prefill_pages or pages,
                           page_size=page_size, state_slots=state_slots, pp_rank=r,
                           pp_size=len(stages), cross_layer=cross_layer)
               for r, layers in enumerate(stages)]
    return ModelPeers(decode, prefill)


def build_layout(spec: PeerSpec, base: int, *, with_ids: bool = True) -> Any:
    """The :class:`kvplan.Layout` of ``spec`` with its arena at address ``base``.

    ``with_ids=False`` builds the same buffers without layer ids or roles, as a legacy peer
    would publish them (to show what positional pairing would do).
    """
    import kvplan

    ents = spec.entries
    ctx: dict[str, Any] = dict(num_model_layers=spec.num_model_layers, pp_rank=spec.pp_rank,
                               pp_size=spec.pp_size, page_size=spec.page_size)
    ctx.update(spec.context)

    def columns(es: Sequence[Entry]) -> tuple[list[int], list[int], list[int]]:
        return [base + e.offset for e in es], [e.nbytes for e in es], [e.item_len for e in es]

    if not with_ids:
        strides = [e.stride for e in ents] if any(e.strided for e in ents) else None
        return kvplan.Layout(*columns(ents), None, None, kinds=[e.kind for e in ents],
                             strides=strides, **ctx)
    pages = [e for e in ents if e.kind == "page"]
    if spec.style != "cross_layer" and any(e.strided for e in ents):
        raise ValueError(f"{spec.style} entries must be packed (stride == item_len); strided "
                         f"entries need the cross_layer style")
    if spec.style in ("mha", "hybrid_mha"):
        ks = [e for e in pages if e.role == "k"]
        vs = [e for e in pages if e.role == "v"]
        if pages != ks + vs:
            raise ValueError(f"{spec.style} entries must be all K entries, then all V entries")
    if spec.style == "mha":
        (k_ptrs, k_lens, k_items), (v_ptrs, v_lens, v_items) = columns(ks), columns(vs)
        layout = kvplan.Layout.mha(k_ptrs, v_ptrs, k_lens, v_lens, k_items, v_items,
                                   layer_ids=[e.layer_id for e in ks], **ctx)
    elif spec.style == "mla":
        layout = kvplan.Layout.mla(*columns(pages), layer_ids=[e.layer_id for e in pages], **ctx)
    elif spec.style == "npu_groups":
        # Ascend pools: G buffer groups per layer, group-major, each layer id once per group.
        groups = list(dict.fromkeys(e.role for e in pages))
        ids = [e.layer_id for e in pages if e.role == groups[0]]
        if [e.role for e in pages] != [g for g in groups for _ in ids]:
            raise ValueError("npu_groups entries must be group-major")
        layout = kvplan.Layout.npu_groups(ids, *columns(pages), group_roles=groups, **ctx)
    elif spec.style in ("hybrid_mla", "hybrid_mha"):
        full = list(dict.fromkeys(e.layer_id for e in pages))
        layout = kvplan.Layout.hybrid_linear(full, *columns(pages),
                                             mla=spec.style == "hybrid_mla", **ctx)
    elif spec.style == "cross_layer":
        layout = _cross_layer_layout(kvplan, pages, base, ctx)
    else:
        raise ValueError(f"unknown layout style {spec.style!r}")
    states: dict[str, list[Entry]] = {}
    for e in ents:
        if e.kind == "state":
            states.setdefault(e.role, []).append(e)
    for name, group in states.items():
        layout = layout.with_state(name, *columns(group), [e.layer_id for e in group])
    return layout


def _cross_layer_layout(kvplan: Any, pages: Sequence[Entry], base: int,
                        ctx: dict[str, Any]) -> Any:
    """``Layout.cross_layer`` for page entries that form one pool (checked, not assumed)."""
    if not pages:
        raise ValueError("a cross_layer spec needs page entries")
    page = sum(e.item_len for e in pages)
    at = pages[0].offset
    for e in pages:
        if e.offset != at or e.stride != page or e.capacity != pages[0].capacity:
            raise ValueError(
                f"cross_layer page entries must sit side by side in one pool (each at the "
                f"previous one's end, stride = {page}, equal capacities); layer {e.layer_id} "
                f"{e.role} is at offset {e.offset} with stride {e.stride} and capacity "
                f"{e.capacity}")
        at += e.item_len
    return kvplan.Layout.cross_layer(base + pages[0].offset, page * pages[0].capacity,
                                     [e.layer_id for e in pages], [e.item_len for e in pages],
                                     roles=[e.role for e in pages], **ctx)
