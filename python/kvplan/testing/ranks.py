"""One TP rank's KV cache in a numpy arena, and a whole request checked against the oracle.

:func:`rank_memory` builds what a serving engine's rank holds (per-layer KV buffers or one
cross-layer pool, its heads in NHD or HND order, optional state slots) and the
:class:`kvplan.Layout` it publishes; :func:`check_request` plans one request from every prefill
rank into one decode rank, applies the blocks and compares the decode memory byte for byte with
:func:`kvplan.testing.oracle.reference_copy`. :mod:`kvplan.testing.strategies` draws the
deployments (hypothesis); without hypothesis, build :class:`Model` and :class:`Rank` by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvplan
from kvplan.testing.memory import SENTINEL
from kvplan.testing.oracle import Memory, apply_plan, rank_heads, reference_copy

__all__ = ["Model", "Rank", "RankMemory", "check_request", "rank_memory"]


@dataclass(frozen=True)
class Model:
    """What every rank of a deployment shares."""

    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 4
    dtype_size: int = 2
    mla: bool = False
    #: bytes of one layer's whole state item (0: no state entries)
    state_bytes: int = 0
    #: state items split over TP ranks (``state_bytes / tp_size`` each) or replicated whole
    sharded_state: bool = True
    #: sliding window in tokens of the odd layers (full and window layers alternate, as in
    #: gpt-oss); None: every layer full attention
    window: int | None = None


@dataclass(frozen=True)
class Rank:
    """One rank's side of the deployment."""

    tp_rank: int = 0
    tp_size: int = 1
    page_size: int = 1
    memory_order: str = "NHD"
    capacity: int = 8
    cross_layer: bool = False
    state_slots: int = 2
    #: tokens per page of the window layers' own pool (None: they index the request's pages)
    window_page_size: int | None = None
    #: pages of each window-pool entry
    window_capacity: int = 8


@dataclass
class RankMemory:
    layout: kvplan.Layout
    memory: Memory


def rank_memory(model: Model, rank: Rank, *, seed: int | None = None) -> RankMemory:
    """The arena of one rank (random bytes with ``seed``, else :data:`SENTINEL`) and its layout."""
    heads = len(rank_heads(model.kv_heads, rank.tp_size, rank.tp_rank))
    item = rank.page_size * heads * model.head_dim * model.dtype_size
    planes = 1 if model.mla else 2
    ids = list(range(model.layers))
    state_item = (model.state_bytes // rank.tp_size if model.sharded_state
                  else model.state_bytes)
    pooled = rank.window_page_size is not None
    if pooled and (model.window is None or rank.cross_layer or model.mla):
        raise ValueError("a window pool is laid out for windowed MHA models with per-layer "
                         "buffers")
    windowed = [layer % 2 == 1 and model.window is not None for layer in ids]
    pool_item = (rank.window_page_size or 0) * heads * model.head_dim * model.dtype_size
    # Per (layer, plane): (offset in the arena, bytes, item bytes).
    buffers: list[tuple[int, int, int]] = []
    at = 0
    for plane in range(planes):
        for layer in ids:
            size, entry_item = ((rank.window_capacity * pool_item, pool_item)
                                if pooled and windowed[layer] else (rank.capacity * item, item))
            buffers.append((at, size, entry_item))
            at += size
    kv_bytes = at
    state_bytes = model.layers * rank.state_slots * state_item
    arena = np.full(kv_bytes + state_bytes + 64, SENTINEL, dtype=np.uint8)
    if seed is not None:
        data = np.random.default_rng(seed).integers(0, 255, arena.size, dtype=np.uint8)
        data[data == SENTINEL] = 0xFF
        arena[:] = data
    base = int(arena.ctypes.data)
    ctx: dict[str, Any] = dict(page_size=rank.page_size, tp_rank=rank.tp_rank,
                                  tp_size=rank.tp_size, kv_heads=model.kv_heads,
                                  head_dim=model.head_dim, dtype_size=model.dtype_size,
                                  memory_order=rank.memory_order)
    if pooled:
        layout = kvplan.Layout([base + off for off, _, _ in buffers], [n for _, n, _ in buffers],
                               [i for _, _, i in buffers], ids * planes,
                               [r for r in ("k", "v") for _ in ids], **ctx)
        layout = layout.with_windows([model.window if w else None for w in windowed] * planes,
                                     window_page_size=rank.window_page_size)
    elif rank.cross_layer:
        roles = ["kv"] * model.layers if model.mla else ["k", "v"] * model.layers
        pool_ids = ids if model.mla else [i for i in ids for _ in range(2)]
        layout = kvplan.Layout.cross_layer(base, kv_bytes, pool_ids, item, roles=roles, **ctx)
    else:
        entry = rank.capacity * item
        ptr = [[base + (layer * planes + plane) * entry for plane in range(planes)]
               for layer in ids]
        if model.mla:
            layout = kvplan.Layout.mla([p[0] for p in ptr], [entry] * model.layers, item,
                                       layer_ids=ids, **ctx)
        else:
            layout = kvplan.Layout.mha([p[0] for p in ptr], [p[1] for p in ptr],
                                       [entry] * model.layers, [entry] * model.layers, item,
                                       item, layer_ids=ids, **ctx)
    if model.window is not None and not pooled:
        layout = layout.with_windows([
            model.window if kind == "page" and layer is not None and layer % 2 else None
            for kind, layer in zip(layout.kinds, layout.layer_ids or [None] * len(layout))])
    if state_item:
        at = base + kv_bytes
        size = rank.state_slots * state_item
        layout = layout.with_state("mamba_temporal", [at + i * size for i in ids],
                                   [size] * model.layers, state_item, ids)
    return RankMemory(layout, Memory(arena, base))


def check_request(model: Model, prefill: Rank, decode: Rank, src_pages: np.ndarray,
                  dst_pages: np.ndarray, *, n_tokens: int | None = None,
                  slots: tuple[int, int] | None = (0, 1),
                  skip_tokens: int = 0,
                  window_pages: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
                  ) -> dict[int, kvplan.Template]:
    """Plans the request from every prefill rank (``prefill`` with each ``tp_rank``) into
    ``decode``, applies the blocks (and the state slots ``slots``) and asserts: the decode
    memory equals the oracle's, no destination byte is written twice, and a template that
    plans nothing says why (``empty_reason``). Returns the templates by prefill rank.

    ``skip_tokens`` K: a delta request. The decode starts out holding the oracle's first K
    tokens (as a prefix cache would), the plan moves tokens K.. only (its bytes are the
    oracle's for tokens K..), and what the decode holds after it must equal the oracle's whole
    request. ``window_pages``: each side's window pages, for a side whose window layers keep a
    pool of their own (``Rank.window_page_size``)."""
    dst = rank_memory(model, decode)
    written = np.zeros(dst.memory.data.size, dtype=bool)
    sources = [rank_memory(model, dataclasses.replace(prefill, tp_rank=r_p), seed=r_p + 1)
               for r_p in range(prefill.tp_size)]
    if skip_tokens:
        # The prefix the decode holds already (of a window entry: the window as it was then).
        for src in sources:
            reference_copy(src.layout, src.memory, dst.layout, dst.memory, src_pages,
                           dst_pages, n_tokens=skip_tokens, window_pages=window_pages)
    want = dst.memory.copy()
    templates = {}
    for r_p, src in enumerate(sources):
        t = kvplan.Template(src.layout, dst.layout)
        templates[r_p] = t
        plan = t.plan(src_pages, dst_pages, n_tokens=n_tokens, skip_tokens=skip_tokens,
                      window_pages=window_pages)
        kv = reference_copy(src.layout, src.memory, dst.layout, want, src_pages, dst_pages,
                            n_tokens=n_tokens, window_pages=window_pages)
        if skip_tokens:
            # What the delta itself must move.
            kv = reference_copy(src.layout, src.memory, dst.layout, want.copy(), src_pages,
                                dst_pages, n_tokens=n_tokens, skip_tokens=skip_tokens,
                                window_pages=window_pages)
        assert plan.total_bytes == kv, (r_p, plan.total_bytes, kv)
        assert plan.skip_tokens == skip_tokens
        # An empty plan says why, unless the delta left nothing to move.
        assert (len(plan) == 0) == (t.empty_reason is not None or kv == 0), (r_p, t.empty_reason)
        apply_plan(plan, src.memory, dst.memory, written)
        if slots is not None and model.state_bytes:
            apply_plan(t.plan_state(*slots), src.memory, dst.memory, written)
            reference_copy(src.layout, src.memory, dst.layout, want, [], [], n_tokens=0,
                           src_slot=slots[0], dst_slot=slots[1])
    bad = np.flatnonzero(dst.memory.data != want.data)
    assert bad.size == 0, f"{bad.size} wrong decode bytes, the first at offset {bad[0]}"
    return templates
