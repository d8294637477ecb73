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

__all__ = ["Entry", "PeerSpec", "ModelPeers", "pack_entries", "preset_peer", "model_peers",
           "build_layout"]


@dataclass(frozen=True)
class Entry:
    """One buffer of a peer: ``capacity`` items of ``item_len`` bytes at ``offset`` in its arena."""

    layer_id: int
    role: str  # "kv", "k", "v", an NPU group such as "g0", or a state name such as "mamba_conv"
    kind: str  # "page" or "state"
    offset: int
    item_len: int
    capacity: int

    @property
    def nbytes(self) -> int:
        return self.item_len * self.capacity


@dataclass(frozen=True)
class PeerSpec:
    """A peer's buffers and how to describe them to kvplan.

    ``style`` picks the Layout constructor (see :func:`build_layout`): ``"mla"``, ``"mha"``
    (K entries, then V entries), ``"hybrid_mla"`` / ``"hybrid_mha"`` (``Layout.hybrid_linear``
    plus ``with_state``), ``"npu_groups"`` (``Layout.npu_groups`` plus ``with_state``; page
    entries group-major); ``"raw"`` registers the buffers without building a layout
    (engine-level tests).
    """

    name: str
    style: str
    entries: tuple[Entry, ...]
    num_model_layers: int
    pp_rank: int = 0
    pp_size: int = 1
    #: Tokens per page of the page entries (published in the layout's context).
    page_size: int = 1

    @property
    def size(self) -> int:
        """Bytes of the arena that holds every buffer."""
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["entries"] = [asdict(e) for e in self.entries]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerSpec:
        d = dict(d)
        d["entries"] = tuple(Entry(**e) for e in d["entries"])
        return cls(**d)


def pack_entries(entries: Sequence[tuple[int, str, str, int, int]], align: int = 4096
                 ) -> tuple[Entry, ...]:
    """Lay ``(layer, role, kind, item_len, capacity)`` buffers out back to back, page aligned."""
    out, offset = [], 0
    for layer, role, kind, item_len, capacity in entries:
        out.append(Entry(layer, role, kind, offset, item_len, capacity))
        offset += -(-item_len * capacity // align) * align
    return tuple(out)


def preset_peer(preset: ModelPreset, name: str, layers: Sequence[int], *, pages: int,
                page_size: int = 1, state_slots: int = 4, pp_rank: int = 0, pp_size: int = 1
                ) -> PeerSpec:
    """The buffers of a process holding ``layers`` of ``preset``: KV entries (per layer; for
    MHA all K entries, then all V entries), then one buffer per (state component, linear
    layer), with the preset's sizes."""
    item = preset.kv_bytes_per_token * page_size
    kv = preset.kv_layers(layers)
    if preset.attention == "mla":
        rows = [(i, "kv", "page", item, pages) for i in kv]
    else:
        rows = [(i, role, "page", item, pages) for role in ("k", "v") for i in kv]
    linear = preset.linear_layers(layers)
    for state in preset.state if linear else ():
        rows += [(i, state.name, "state", state.bytes_per_slot, state_slots) for i in linear]
    style = ("hybrid_" if preset.hybrid else "") + preset.attention
    return PeerSpec(name, style, pack_entries(rows), preset.num_layers, pp_rank, pp_size,
                    page_size)


@dataclass(frozen=True)
class ModelPeers:
    """A decode peer holding every layer and the prefill PP stages, each holding its own."""

    decode: PeerSpec
    prefill: list[PeerSpec]


def model_peers(preset: ModelPreset, *, pages: int, pp_size: int = 1, page_size: int = 1,
                state_slots: int = 4, prefill_pages: int | None = None,
                pp_split: Sequence[int] | None = None) -> ModelPeers:
    """Decode (PP=1) and prefill (PP=``pp_size``, split as :func:`kvplan.presets.split_layers`
    splits, the same split ``kvplan explain`` uses) peers of one model."""
    stages = split_layers(preset.num_layers, pp_size, pp_split)
    decode = preset_peer(preset, "decode", range(preset.num_layers), pages=pages,
                         page_size=page_size, state_slots=state_slots)
    prefill = [preset_peer(preset, f"prefill{r}", layers, pages=prefill_pages or pages,
                           page_size=page_size, state_slots=state_slots, pp_rank=r,
                           pp_size=len(stages))
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

    def columns(es: Sequence[Entry]) -> tuple[list[int], list[int], list[int]]:
        return [base + e.offset for e in es], [e.nbytes for e in es], [e.item_len for e in es]

    if not with_ids:
        return kvplan.Layout(*columns(ents), None, None, kinds=[e.kind for e in ents], **ctx)
    pages = [e for e in ents if e.kind == "page"]
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
    else:
        raise ValueError(f"unknown layout style {spec.style!r}")
    states: dict[str, list[Entry]] = {}
    for e in ents:
        if e.kind == "state":
            states.setdefault(e.role, []).append(e)
    for name, group in states.items():
        layout = layout.with_state(name, *columns(group), [e.layer_id for e in group])
    return layout
