"""Reference models as layouts (one per prefill PP stage, one for the decode peer) and reference
requests (page lists with a chosen fragmentation).

Used by ``kvplan explain``, ``kvplan demo``, the tests and the benchmarks. Addresses are synthetic (never dereferenced):
what matters for planning is the entry structure, the item lengths and the capacities.

Sizes per token per layer (bf16 unless said otherwise):

* DeepSeek-V3: 61 layers, MLA latent 512 + 64 rope = 576 elements = 1152 bytes.
* Qwen3-235B-A22B: 94 layers, GQA 4 KV heads × 128 = 1024 bytes for K and again for V.
* Qwen3-Next-80B-A3B: 48 layers, full attention on every 4th (12 layers, GQA 2 heads × 256 =
  1024 bytes each for K and V); the other 36 are Gated DeltaNet layers with per-request state.
  From the model config (16 key heads, 32 value heads, head dim 128, conv kernel 4): conv
  state (2·16·128 + 32·128) channels × 3 steps × 2 bytes = 49,152 bytes; recurrent state
  32 × 128 × 128 × fp32 = 2,097,152 bytes.
* DeepSeek-V3.2: the DeepSeek-V3 latent plus, per layer, the sparse-attention indexer's key
  cache (128 × fp8 plus one fp32 scale = 132 bytes), its own buffer (role ``indexer``).
* GLM-5: 78 layers (``num_hidden_layers``), MLA with ``kv_lora_rank`` 512 and
  ``qk_rope_head_dim`` 64, so a 576 × bf16 = 1152-byte latent, and a DSA indexer of
  ``index_head_dim`` 128. Assumed: the indexer cache has DeepSeek-V3.2's format (132 bytes);
  the next-token-prediction layer (``num_nextn_predict_layers`` 1) is not modelled.
* DeepSeek-V4: vLLM's KV-cache spec for the model, as the public InferenceX kv-transfer suite
  transcribes it. 61 layers. Every cache row is vLLM's ``fp8_ds_mla`` record, 584 bytes: 448
  NoPE values in fp8, 64 RoPE values in bf16 (128 bytes) and 8 bytes of scales; a page is padded
  to a multiple of 576 bytes. Every layer keeps a sliding window of 128 tokens (role ``swa``,
  one row per token) and a compressed cache (role ``compressed``): 30 layers compress 4 tokens
  into a row and keep a 132-byte indexer entry per row beside it (role ``indexer``), the other
  31 compress 128 tokens into a row. Each role is its own buffer. Assumed (not in the
  transcription): which layers compress by 4 (the odd ones, 30 of 61; the even ones, 31, by
  128); the 128-token rows' pool page size (the layout's page size rounded up to a multiple of
  128 tokens, so one row per page at vLLM's 64-token blocks). The 128-token rows keep a pool of
  their own (``Layout.with_pool``, pool 1, ``tokens_per_row=128``): a request gives its pages
  as ``Request(..., pool_pages={1: (src, dst)})``, and a token plan moves a row once all its
  128 tokens are in the request (a partial last row waits). The 4-token rows and their indexer
  entries stay on the request's pages as 146 and 33 bytes per token (a partial row moves the
  bytes of its tokens, as before this preset had pools). What the preset does not carry:
  vLLM pages the window in 64-token blocks, here the window rows share the request's page
  size. The page padding is the entries' stride (a page of ``page_size`` tokens starts every
  padded size), not bytes moved.
* Kimi-Linear-style hybrid MLA: full attention (MLA, 1152 bytes) on every 4th layer, linear
  (KDA) layers with per-request state: conv state 3·32·128 channels × 3 steps × 2 bytes =
  73,728 bytes; recurrent state 32 × 128 × 128 × fp32 = 2,097,152 bytes. 48 layers by default
  (27 is the other published size: pass ``num_layers=27``). Its layouts hold the conv state as
  one tensor, as SGLang 0.5.23 and vLLM 0.32 to 0.34 do; its manifest declares the q, k and v
  conv states (24,576 bytes each) and their fusion into that tensor (``StateSpec.parts``), so a
  worker holding them as three tensors passes too.
* Kimi-K3: 93 layers, 24 MLA (1152 bytes per token, the Kimi-Linear latent) and 69 KDA layers,
  each with four state tensors: three short-convolution states (q, k and v: 32 heads × 128
  channels × 3 steps × bf16 = 24,576 bytes each) and the recurrent state (32 × 128 × 128 × fp32
  = 2,097,152 bytes). SGLang 0.5.23 and vLLM 0.32 to 0.34 keep the three conv states as one
  tensor (``[K - 1, q | k | v]``, 73,728 bytes): the manifest declares that presentation too
  (``ModelPreset.fusions``: ``mamba_conv`` for the three, ``mamba_temporal`` for the recurrent
  state, as kvplan's SGLang layouts name them), so either passes. Assumed (no public config gives them): the
  head geometry is Kimi-Linear's (32 heads of 128, conv kernel 4, the 512 + 64 latent), and the
  MLA layers are every 4th layer (ids 3, 7, …, 91) plus the last (92).

State sizes are for TP 1 and are meant to show proportions, not to size a deployment. A layout
built with ``tp_size > 1`` holds its rank's share: ``kv_heads / tp_size`` KV heads per K/V item
(at least one head; fewer heads than ranks replicate them), the MLA latent whole, and state
items divided by the TP size, each declaring the TP channel split its engine cuts it by
(``StateSpec``: the GDN conv state's q, k and v sub-blocks, the KDA conv states' 3 rows of
channels, the recurrent states' heads), so that a template between two TP sizes moves each
decode rank the channels it holds.
"""

from __future__ import annotations

import dataclasses
import os

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvplan._core import KvPlanError, Layout, LayoutError, ManifestError, heads_per_rank
from kvplan.manifests import Fusion, ManifestComponent, ModelManifest, Sharding

__all__ = ["PRESETS", "ComponentSpec", "ModelPreset", "StateSpec", "fragmented_pages", "get_preset",
           "load_manifest", "pool_pages_for", "split_layers"]

PREFILL_BASE = 0x1000_0000_0000
DECODE_BASE = 0x9000_0000_0000
_ALIGN = 2 << 20  # entry buffers start on 2 MiB boundaries, as pools registered for RDMA do


@dataclass(frozen=True)
class StateSpec:
    """One per-request state component of a linear-attention layer (one slot per request).

    With ``channels`` the slot declares its TP channel split (``Layout.with_state(channels=,
    outer_rows=, shard_groups=)``), as the engine cuts it: ``outer_rows`` rows of the model's
    ``channels`` channels (at TP 1), cut into the sub-blocks ``shard_groups`` (empty: one
    sub-block), each split evenly over the TP ranks; ``channels`` 0 is a slot replicated on every
    rank. Without it (``None``) the slot is sharded along its leading bytes."""

    name: str
    bytes_per_slot: int
    #: Model channels at TP 1 (0: replicated; ``None``: no declared split).
    channels: int | None = None
    #: Rows before the channel axis (a ``[K - 1, channels]`` conv state: ``K - 1``).
    outer_rows: int = 1
    #: The model's sub-blocks of channels at TP 1, in row order (empty: one sub-block).
    shard_groups: tuple[int, ...] = ()
    #: The components the slot holds, one per sub-block in row order (empty: it is one
    #: component). The manifest declares each (its sub-block's share of the bytes) and a
    #: :class:`kvplan.manifests.Fusion` of them into this entry, so a layout holding this one
    #: entry and one holding the parts as entries of their own both hold it.
    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.parts and (len(self.parts) != len(self.shard_groups) or not self.channels
                           or sum(self.shard_groups) != self.channels):
            raise ManifestError(
                f"state {self.name}: parts {list(self.parts)} need one sub-block each "
                f"(shard_groups {list(self.shard_groups)} summing to channels {self.channels})")

    def components(self) -> list[tuple[str, int]]:
        """``(role, bytes per slot at TP 1)`` of each component the manifest declares for it:
        its parts (each its sub-block's share of the slot), else itself."""
        if not self.parts:
            return [(self.name, self.bytes_per_slot)]
        channels = self.channels or 1  # at least the sub-blocks' sum (__post_init__)
        return [(part, self.bytes_per_slot * group // channels)
                for part, group in zip(self.parts, self.shard_groups)]

    def item_len(self, tp_size: int) -> int:
        """One rank's slot bytes at ``tp_size``: the whole slot when replicated, else its
        share (``bytes_per_slot / tp_size``)."""
        return self.bytes_per_slot if self.channels == 0 else self.bytes_per_slot // tp_size

    def split(self, tp_size: int) -> tuple[int, int, list[int] | None] | None:
        """``(channels per rank, outer rows, shard groups)`` at ``tp_size`` for
        ``Layout.with_state`` (``None``: no declared split).

        Raises:
            LayoutError: Channels or a sub-block that ``tp_size`` does not divide evenly.
        """
        if self.channels is None:
            return None
        if self.channels == 0:
            return 0, 1, None
        blocks = self.shard_groups or (self.channels,)
        if any(b % tp_size for b in blocks):
            raise LayoutError(
                f"state {self.name}: sub-blocks of {list(blocks)} channels do not split evenly "
                f"over tp_size {tp_size}")
        return self.channels // tp_size, self.outer_rows, list(self.shard_groups) or None


@dataclass(frozen=True)
class ComponentSpec:
    """One page entry of every KV layer when a layer keeps its cache in several buffers (e.g. an
    fp8 NoPE part and a bf16 RoPE part of an MLA latent, an indexer), each its own buffer with
    its own item length; the entries pair by (layer id, role)."""

    role: str
    #: Bytes of one row: one token's, or ``tokens_per_row`` tokens' for a compressed cache.
    bytes_per_token: int
    #: Whether the sliding-window layers hold this component too (else only full layers do).
    on_window_layers: bool = True
    #: Tokens one row holds (a compressed cache: several tokens per row); a page holds
    #: ``page_size / tokens_per_row`` rows, so the page size must be a multiple of it.
    tokens_per_row: int = 1
    #: A page's stride: its bytes rounded up to a multiple of this (vLLM pads ``fp8_ds_mla``
    #: pages to multiples of 576 bytes); the padding is not moved.
    page_align: int = 1
    #: The component's own sliding window in tokens on every layer that holds it (``None``:
    #: the model's rule, :meth:`ModelPreset.window_of`).
    window: int | None = None
    #: Which layers hold it: ``"all"``, ``"odd"`` or ``"even"`` layer ids.
    layers: Literal["all", "odd", "even"] = "all"
    #: Whether its buffers keep a pool of their own (``Layout.with_pool``), whose pages hold
    #: :meth:`pool_page_size` tokens, so that a row of many tokens never spans pages and a
    #: token plan moves whole rows only (a row once all its tokens are in the request). A
    #: request gives that pool's pages (``Request(pool_pages={1: (src, dst)})``).
    own_pool: bool = False

    def pool_page_size(self, page_size: int) -> int:
        """Tokens per page of its own pool: the layout's page size rounded up to a multiple of
        ``tokens_per_row`` (assumed: the engine sizes that group's blocks so; one row per page
        when the page size is at most a row's tokens)."""
        return -(-page_size // self.tokens_per_row) * self.tokens_per_row

    def item_len(self, page_size: int, preset: str) -> int:
        """Bytes of one page of this component at ``page_size`` tokens per page (its rows)."""
        if self.own_pool:
            page_size = self.pool_page_size(page_size)
        if page_size % self.tokens_per_row:
            raise KvPlanError(
                f"preset {preset!r}: its {self.role!r} buffers hold one row per "
                f"{self.tokens_per_row} tokens, so the page size must be a multiple of "
                f"{self.tokens_per_row}, got {page_size}")
        return page_size // self.tokens_per_row * self.bytes_per_token

    def stride(self, page_size: int, preset: str) -> int:
        """Bytes from one page to the next: :meth:`item_len` padded to :attr:`page_align`."""
        return -(-self.item_len(page_size, preset) // self.page_align) * self.page_align

    def held_by(self, layer: int) -> bool:
        """Whether layer ``layer`` holds this component (by :attr:`layers`)."""
        return self.layers == "all" or (layer % 2 == 1) == (self.layers == "odd")


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV-cache geometry.

    Attributes:
        key: Command-line name (``deepseek-v3``, ...).
        name: Display name.
        num_layers: Model layers.
        attention: ``"mla"`` (one latent entry per layer) or ``"mha"`` (K and V entries).
        kv_bytes_per_token: Bytes per token per layer per entry (per K or per V for MHA).
        full_attention_every: ``None`` for dense models; ``n`` when full attention (the only
            layers with paged KV) sits on every n-th layer (ids ``n-1, 2n-1, …``).
        state: Per-request state components of each linear-attention layer.
        description: One line for reports.
        kv_heads: KV heads of the model (1 for an MLA latent).
        head_dim: Elements per head (the latent width for MLA); ``kv_bytes_per_token`` is
            ``kv_heads * head_dim * dtype_size``.
        dtype_size: Bytes per element.
        indexer_bytes_per_token: Bytes per token of each KV layer's sparse-attention indexer
            cache (its own page entry per layer, role ``indexer``, beside the latent; 0: none).
        sliding_window: Tokens of the sliding window of the even layers (0, 2, 4, …), which
            alternate with full-attention odd layers as in gpt-oss (0: every layer full). Their
            entries are window entries (``Layout.with_windows``): only a request's last
            ``sliding_window`` tokens move.
        components: Per KV layer, one page entry per component, each its own buffer (MLA
            only; empty: one latent entry, plus an ``indexer`` entry when
            ``indexer_bytes_per_token`` is set). ``kv_bytes_per_token`` is then the sum over
            the components a full-attention layer holds.
        full_attention_layers: The full-attention layers by id, for a hybrid model whose
            pattern is not every n-th layer (empty: ``full_attention_every`` decides).
        fusions: How another engine may hold some of its components (one entry per layer
            for several, or one under another name), carried into its manifest
            (:class:`kvplan.manifests.Fusion`); its own layouts hold the parts.
    """

    key: str
    name: str
    num_layers: int
    attention: Literal["mla", "mha"]
    kv_bytes_per_token: int
    full_attention_every: int | None = None
    state: tuple[StateSpec, ...] = field(default_factory=tuple)
    description: str = ""
    kv_heads: int = 1
    head_dim: int = 0
    dtype_size: int = 2
    indexer_bytes_per_token: int = 0
    sliding_window: int = 0
    components: tuple[ComponentSpec, ...] = field(default_factory=tuple)
    full_attention_layers: tuple[int, ...] = ()
    fusions: tuple[Fusion, ...] = ()

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens (``None``: full attention)."""
        return self.sliding_window if self.sliding_window and layer % 2 == 0 else None

    @property
    def hybrid(self) -> bool:
        return self.full_attention_every is not None or bool(self.full_attention_layers)

    def kv_layers(self, layers: Sequence[int] | None = None) -> list[int]:
        """Layers with paged KV (all for dense models), optionally restricted to ``layers``."""
        every = self.full_attention_every
        pool = range(self.num_layers) if layers is None else layers
        if self.full_attention_layers:
            full = set(self.full_attention_layers)
            return [i for i in pool if i in full]
        return [i for i in pool if every is None or i % every == every - 1]

    def linear_layers(self, layers: Sequence[int] | None = None) -> list[int]:
        """Layers with per-request state (none for dense models)."""
        if not self.hybrid:
            return []
        kv = set(self.kv_layers(layers))
        pool = range(self.num_layers) if layers is None else layers
        return [i for i in pool if i not in kv]

    def with_layers(self, num_layers: int) -> ModelPreset:
        """The same geometry with another layer count (e.g. the 27-layer Kimi-Linear)."""
        if num_layers < 1:
            raise KvPlanError(f"num_layers must be at least 1, got {num_layers}")
        return dataclasses.replace(self, num_layers=num_layers)

    def heads_per_rank(self, tp_size: int) -> int:
        """KV heads each rank holds at TP size ``tp_size`` (the core's split,
        :func:`kvplan._core.heads_per_rank`: ``max(1, kv_heads // tp_size)``)."""
        return heads_per_rank(self.kv_heads, tp_size)

    def geometry(self, tp_size: int = 1, memory_order: str = "NHD") -> dict[str, Any]:
        """The attention-geometry keywords of a layout at TP size ``tp_size`` (``kv_heads``,
        ``heads_per_rank``, ``head_dim``, ``dtype_size``, ``memory_order``).

        Raises:
            KvPlanError: The preset does not give its head dim.
        """
        if self.head_dim < 1:
            raise KvPlanError(f"preset {self.key!r} gives no head geometry (head_dim)")
        return {"kv_heads": self.kv_heads, "heads_per_rank": self.heads_per_rank(tp_size),
                "head_dim": self.head_dim, "dtype_size": self.dtype_size,
                "memory_order": memory_order}

    def layout(
        self,
        layers: Sequence[int],
        *,
        page_size: int,
        capacity: int,
        state_slots: int = 8,
        base: int = PREFILL_BASE,
        pp_rank: int = 0,
        pp_size: int = 1,
        device: str = "cpu",
        cross_layer: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        memory_order: str | None = None,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
    ) -> Layout:
        """The layout of a peer that holds ``layers``, publishing global layer ids.

        Args:
            layers: Model layers this peer holds (a PP stage's range, or all of them).
            page_size: Tokens per page; an entry's item is ``kv_bytes_per_token * page_size``.
            capacity: Pages per KV buffer.
            state_slots: Request slots per state buffer (hybrid models).
            base: Address of the first buffer (synthetic).
            pp_rank: This peer's PP rank.
            pp_size: This peer's PP size.
            device: Device kind recorded in the layout.
            cross_layer: One pool holding every KV layer of a page side by side
                (``Layout.cross_layer``: per page, each layer's item, K then V for MHA) instead
                of one buffer per layer (and per K/V); state entries stay per layer.
            tp_rank, tp_size: This peer's TP position. With ``tp_size > 1`` the items hold this
                rank's heads (see the module docstring).
            memory_order: ``"NHD"`` or ``"HND"``. The layout publishes its attention geometry
                (:meth:`geometry`) when this is given or ``tp_size > 1`` (default order NHD),
                so that templates between different TP sizes re-slice heads.
            dcp_size, dcp_rank, dcp_interleave: This peer's decode-context-parallel position
                (the ``Layout`` keywords of the same names; default: tokens not dealt).
        """
        if page_size < 1 or capacity < 1:
            raise KvPlanError("page_size and capacity must be at least 1")
        heads = self.heads_per_rank(tp_size) if self.attention == "mha" else 1
        item = self.kv_bytes_per_token // max(1, self.kv_heads if self.attention == "mha" else 1)
        item *= heads * page_size
        tp: dict[str, Any] = {"tp_rank": tp_rank, "tp_size": tp_size}
        if dcp_size != 1 or dcp_rank != 0 or dcp_interleave != 1:
            tp.update(dcp_size=dcp_size, dcp_rank=dcp_rank, dcp_interleave=dcp_interleave)
        if memory_order is not None or tp_size > 1:
            tp.update(self.geometry(tp_size, memory_order or "NHD"))
        kv = self.kv_layers(layers)
        n_buf = len(kv) * (2 if self.attention == "mha" else 1)
        if self.layer_components():
            return self._component_layout(kv, page_size, capacity, base, device, pp_rank,
                                          pp_size, tp, cross_layer)
        if cross_layer:
            return self._add_state(
                self._windowed(self._cross_layer_pool(kv, item, capacity, base, page_size,
                                                      device, pp_rank, pp_size, tp)),
                layers, state_slots, base + _align(capacity * item * n_buf), tp_size)
        span = _align(capacity * item)
        ptrs = [base + i * span for i in range(n_buf)]
        lens = [capacity * item] * n_buf
        ctx: dict[str, Any] = {"page_size": page_size, "device": device, "num_model_layers": self.num_layers,
               "pp_rank": pp_rank, "pp_size": pp_size, **tp}
        if self.hybrid:
            layout = Layout.hybrid_linear(kv, ptrs, lens, item, mla=self.attention == "mla", **ctx)
        elif self.attention == "mla":
            layout = Layout.mla(ptrs, lens, item, layer_ids=kv, **ctx)
        else:
            half = len(kv)
            layout = Layout.mha(ptrs[:half], ptrs[half:], lens[:half], lens[half:], item, item,
                                layer_ids=kv, **ctx)
        return self._add_state(self._windowed(layout), layers, state_slots,
                               base + n_buf * span, tp_size)

    def _windowed(self, layout: Layout) -> Layout:
        """``layout`` with the sliding-window layers' entries marked (unchanged without)."""
        if not self.sliding_window:
            return layout
        ids = layout.layer_ids or [None] * len(layout)
        return layout.with_windows([None if i is None else self.window_of(i) for i in ids])

    def layer_components(self) -> tuple[ComponentSpec, ...]:
        """The page entries of each KV layer when a layer has more than one (``components``,
        or the latent and its ``indexer``); empty for one entry per layer (or K and V)."""
        if self.components:
            return self.components
        if self.indexer_bytes_per_token:
            return (ComponentSpec("kv", self.kv_bytes_per_token),
                    ComponentSpec("indexer", self.indexer_bytes_per_token, False))
        return ()

    def _component_layout(self, kv: list[int], page_size: int, capacity: int, base: int,
                          device: str, pp_rank: int, pp_size: int, tp: dict[str, Any],
                          cross_layer: bool) -> Layout:
        """Per KV layer one entry per component (a window layer only those held on window
        layers), each its own buffer, a component's pages ``bytes_per_token × page_size``."""
        if self.attention != "mla" or self.hybrid or cross_layer:
            raise KvPlanError(f"preset {self.key!r}: multi-component layers (indexer, NoPE/RoPE "
                              f"parts) are laid out for dense MLA models with per-layer "
                              f"buffers only")
        if "kv_heads" in tp:
            raise KvPlanError(f"preset {self.key!r}: a layout publishing attention geometry "
                              f"(tp_size > 1 or memory_order) describes one item shape per "
                              f"side, and the components' items differ")
        entries = [(layer, c) for layer in kv for c in self.layer_components()
                   if c.held_by(layer) and (c.on_window_layers or self.window_of(layer) is None)]
        # The components that keep a pool of their own (one pool per component).
        pooled = [c for c in self.layer_components() if c.own_pool and
                  any(e[1] == c for e in entries)]
        items = [c.item_len(page_size, self.key) for _, c in entries]
        strides = [c.stride(page_size, self.key) for _, c in entries]
        spans = [_align(capacity * size) for size in strides]
        ptrs = [base + sum(spans[:k]) for k in range(len(items))]
        layout = Layout(ptrs, [capacity * size for size in strides], items,
                        [layer for layer, _ in entries], [c.role for _, c in entries],
                        strides=strides if strides != items else None,
                        page_size=page_size, device=device, num_model_layers=self.num_layers,
                        pp_rank=pp_rank, pp_size=pp_size, **tp)
        windows = [c.window if c.window is not None else self.window_of(layer)
                   for layer, c in entries]
        if any(w is not None for w in windows):
            layout = layout.with_windows(windows)
        for c in pooled:
            layout = layout.with_pool([k for k, (_, e) in enumerate(entries) if e == c],
                                      c.pool_page_size(page_size),
                                      tokens_per_row=c.tokens_per_row)
        return layout

    def _cross_layer_pool(self, kv: list[int], item: int, capacity: int, base: int,
                          page_size: int, device: str, pp_rank: int, pp_size: int,
                          tp: dict[str, Any]) -> Layout:
        mha = self.attention == "mha"
        ids = [i for i in kv for _ in range(2 if mha else 1)]
        roles = ["k", "v"] * len(kv) if mha else None
        return Layout.cross_layer(base, capacity * item * len(ids), ids, item, roles=roles,
                                  page_size=page_size, device=device,
                                  num_model_layers=self.num_layers, pp_rank=pp_rank,
                                  pp_size=pp_size, **tp)

    def manifest(self) -> ModelManifest:
        """Every component of the model, derived from the specs its layouts are built from (so
        the two cannot drift): per KV layer its latent (``kv``, replicated over TP), its K and
        V (sharded by heads) or its components (replicated), split by window where window and
        full layers differ, and per linear layer its state tensors (split over TP; a state
        holding ``parts`` as those parts, with a fusion of them into the state's entry, before
        the preset's own :attr:`fusions`)."""
        kv = self.kv_layers()
        page: list[tuple[str, int, int, Sharding, int | None, list[int]]] = []
        if self.layer_components():
            for c in self.layer_components():
                for layer in kv:
                    if c.held_by(layer) and (c.on_window_layers or self.window_of(layer) is None):
                        window = c.window if c.window is not None else self.window_of(layer)
                        page.append((c.role, c.bytes_per_token, c.tokens_per_row, "replicated",
                                     window, [layer]))
        else:
            mha = self.attention == "mha"
            sharding: Sharding = "heads" if mha else "replicated"
            for role in ("k", "v") if mha else ("kv",):
                for layer in kv:
                    page.append((role, self.kv_bytes_per_token, 1, sharding,
                                 self.window_of(layer), [layer]))
        # One component per (role, row, window): a role's window layers and full layers apart.
        merged: dict[tuple[str, int, int, Sharding, int | None], list[int]] = {}
        for role, size, rows, sharding, window, layers in page:
            merged.setdefault((role, size, rows, sharding, window), []).extend(layers)
        components = [
            ManifestComponent(role, "page", tuple(layers), size, rows, sharding,
                              self.kv_heads if sharding == "heads" else 1, window)
            for (role, size, rows, sharding, window), layers in merged.items()]
        linear = tuple(self.linear_layers())
        states = self.state if linear else ()
        components += [ManifestComponent(role, "state", linear, size,
                                         sharding="replicated" if spec.channels == 0 else "split")
                       for spec in states for role, size in spec.components()]
        fusions = [Fusion(spec.name, spec.parts) for spec in states if spec.parts]
        return ModelManifest(self.name, self.num_layers, tuple(components),
                             (*fusions, *self.fusions) if linear else ())

    def _add_state(self, layout: Layout, layers: Sequence[int], state_slots: int,
                   address: int, tp_size: int = 1) -> Layout:
        linear = self.linear_layers(layers)
        for spec in self.state if linear else ():
            # The rank's share: along the declared channel split, else the leading bytes.
            slot = spec.item_len(tp_size)
            span = _align(state_slots * slot)
            split = spec.split(tp_size)
            extra: dict[str, Any] = {} if split is None else {
                "channels": split[0], "outer_rows": split[1],
                "shard_groups": [split[2]] * len(linear)}
            layout = layout.with_state(
                spec.name,
                [address + i * span for i in range(len(linear))],
                [state_slots * slot] * len(linear),
                slot,
                linear,
                **extra,
            )
            address += len(linear) * span
        return layout


def pool_pages_for(src: Layout, dst: Layout, src_pages: Sequence[int] | np.ndarray,
                   dst_pages: Sequence[int] | np.ndarray) -> dict[int, tuple[np.ndarray | None,
                                                              np.ndarray | None]]:
    """Each further pool's pages of a request over ``src_pages`` and ``dst_pages`` (its tokens:
    the full pages of the shorter side), for ``Request(pool_pages=...)``: consecutive pages
    ``0, 1, …`` of that pool on each side that keeps it (``None`` on a side that does not);
    empty for layouts with no further pool."""
    n = min(len(src_pages) * src.page_size, len(dst_pages) * dst.page_size)
    sizes = [{pool: size for pool, size, _ in layout.pools if pool} for layout in (src, dst)]
    return {pool: tuple(  # type: ignore[misc]
                None if pool not in side else np.arange(-(-n // side[pool]), dtype=np.int64)
                for side in sizes)
            for pool in sorted({*sizes[0], *sizes[1]})}


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def split_layers(num_layers: int, pp_size: int, counts: Sequence[int] | None = None) -> list[range]:
    """Layer ranges of the prefill PP stages.

    Args:
        num_layers: Model layers.
        pp_size: Number of stages (ignored when ``counts`` is given).
        counts: Explicit layers per stage (must sum to ``num_layers``).

    Returns:
        One ``range`` per stage. Without ``counts`` the split is even and the remainder goes
        one layer each to the first stages.

    Raises:
        KvPlanError: Counts that do not sum to the layer count, or a stage without layers.
    """
    if counts is None:
        if pp_size < 1 or pp_size > num_layers:
            raise KvPlanError(f"pp_size must be in 1..{num_layers}, got {pp_size}")
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if s < extra else 0) for s in range(pp_size)]
    if any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise KvPlanError(
            f"PP split {list(counts)} must be positive layer counts summing to {num_layers}")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


#: The recurrent state of 32 value heads (128 × 128 fp32 each), split over TP by heads.
_RECURRENT = StateSpec("mamba_temporal", 32 * 128 * 128 * 4, channels=32)
#: Qwen3-Next's Gated DeltaNet state as SGLang keeps it: the conv state ``[channels, K - 1]``
#: over ``cat([q, k, v])`` (2048, 2048 and 4096 channels of 3 bf16 steps), each sub-block
#: head-sharded over TP on its own, and the recurrent state.
_GDN = (StateSpec("mamba_conv", 49_152, channels=8192, shard_groups=(2048, 2048, 4096)),
        _RECURRENT)
#: Kimi-Linear's KDA state as SGLang (0.5.23, ``KimiLinearStateShape``) and vLLM (0.32 to 0.34,
#: ``kda_state_shape``) keep it: one conv state ``[K - 1, channels]`` (3 rows of the q, k and v
#: sub-blocks, 4096 bf16 channels each, each sharded over TP on its own), and the recurrent
#: state. The conv state holds the q, k and v short-convolution states (``parts``): the manifest
#: declares them as Kimi-K3's are, with this entry as their fusion, so a worker holding them as
#: three tensors passes too.
_KDA = (StateSpec("mamba_conv", 73_728, channels=3 * 4096, outer_rows=3,
                  shard_groups=(4096, 4096, 4096),
                  parts=("kda_conv_q", "kda_conv_k", "kda_conv_v")), _RECURRENT)
#: Kimi-K3's KDA state as a KDA layer with three separate short convolutions keeps it: one
#: conv state each for q, k and v (``[K - 1, channels]``: 3 rows of 32 heads × 128 bf16
#: channels) and the recurrent state (fp32), every one sharded over TP by heads.
_KDA_CONV = 32 * 128 * 3 * 2
_KDA4 = (*(StateSpec(f"kda_conv_{x}", _KDA_CONV, channels=32 * 128, outer_rows=3)
           for x in "qkv"),
         StateSpec("kda_recurrent", 32 * 128 * 128 * 4, channels=32))
#: Kimi-K3's KDA state as SGLang (0.5.23) and vLLM (0.32 to 0.34) keep it: the three conv states
#: as one ``[K - 1, q | k | v]`` tensor (``mamba_conv``, 73,728 bytes at TP 1) and the recurrent
#: state as ``mamba_temporal``, the names kvplan's SGLang layouts give them.
_KDA4_FUSED = (Fusion("mamba_conv", ("kda_conv_q", "kda_conv_k", "kda_conv_v")),
               Fusion("mamba_temporal", ("kda_recurrent",)))
#: Kimi-K3's MLA layers (assumed, see the module docstring): every 4th layer and the last.
_K3_MLA = (*range(3, 93, 4), 92)

#: DeepSeek-V4's per-layer components (see the module docstring): vLLM's ``fp8_ds_mla`` row
#: (448 fp8 NoPE + 64 bf16 RoPE + 8 scale bytes), pages padded to multiples of 576 bytes.
_V4_ROW, _V4_PAGE_ALIGN, _V4_WINDOW = 448 + 64 * 2 + 8, 576, 128
_V4 = (ComponentSpec("swa", _V4_ROW, page_align=_V4_PAGE_ALIGN, window=_V4_WINDOW),
       ComponentSpec("compressed", _V4_ROW, tokens_per_row=4, page_align=_V4_PAGE_ALIGN,
                     layers="odd"),
       ComponentSpec("indexer", 132, tokens_per_row=4, layers="odd"),
       ComponentSpec("compressed", _V4_ROW, tokens_per_row=128, page_align=_V4_PAGE_ALIGN,
                     layers="even", own_pool=True))

PRESETS: dict[str, ModelPreset] = {
    p.key: p
    for p in (
        ModelPreset("deepseek-v3", "DeepSeek-V3", 61, "mla", 1152,
                    description="61 layers, MLA latent 576 × bf16 = 1152 B per token per layer",
                    kv_heads=1, head_dim=576),
        ModelPreset("deepseek-v3.2", "DeepSeek-V3.2", 61, "mla", 1152,
                    description="61 layers, MLA latent 576 × bf16 = 1152 B per token per layer, "
                                "and the sparse-attention indexer's key cache beside it (128 × "
                                "fp8 plus one fp32 scale = 132 B per token per layer)",
                    kv_heads=1, head_dim=576, indexer_bytes_per_token=132),
        ModelPreset("glm-5", "GLM-5", 78, "mla", 1152,
                    description="78 layers, MLA latent (512 + 64 rope) × bf16 = 1152 B per "
                                "token per layer, and the DSA indexer's key cache beside it "
                                "(assumed DeepSeek-V3.2's format: 128 × fp8 plus one fp32 scale "
                                "= 132 B per token per layer); the MTP layer is not modelled",
                    kv_heads=1, head_dim=576, indexer_bytes_per_token=132),
        ModelPreset("deepseek-v4", "DeepSeek-V4", 61, "mla",
                    _V4_ROW + _V4_ROW // 4 + 132 // 4,
                    description="vLLM's KV-cache spec (as the InferenceX kv-transfer suite "
                                "transcribes it): 61 layers of fp8_ds_mla rows (448 fp8 NoPE + "
                                "64 bf16 RoPE + 8 scale bytes = 584 B), pages padded to "
                                "multiples of 576 B; every layer a 128-token sliding window "
                                "(swa) and a compressed cache: 30 layers (odd, assumed) a row "
                                "per 4 tokens plus a 132 B indexer entry per row (page size a "
                                "multiple of 4); the other 31 a row per 128 tokens, in a pool "
                                "of their own (pool 1, pages a multiple of 128 tokens, "
                                "assumed), whole rows moved",
                    kv_heads=1, components=_V4),
        ModelPreset("gpt-oss-120b", "gpt-oss-120b", 36, "mha", 1024,
                    description="36 layers alternating sliding-window (128 tokens, even layers) "
                                "and full attention, GQA 8 KV heads × 64 × bf16 = 1024 B per "
                                "token for K and for V", kv_heads=8, head_dim=64,
                    sliding_window=128),
        ModelPreset("qwen3-235b", "Qwen3-235B-A22B", 94, "mha", 1024,
                    description="94 layers, GQA 4 KV heads × 128 × bf16 = 1024 B per token for "
                                "K and for V", kv_heads=4, head_dim=128),
        ModelPreset("qwen3-next", "Qwen3-Next-80B-A3B", 48, "mha", 1024, 4, _GDN,
                    description="48 layers: 12 full attention (GQA 2 × 256, 1024 B per token "
                                "for K and V) + 36 Gated DeltaNet (conv + recurrent state)",
                    kv_heads=2, head_dim=256),
        ModelPreset("kimi-linear", "Kimi-Linear-style hybrid MLA", 48, "mla", 1152, 4, _KDA,
                    description="full attention (MLA, 1152 B per token) on every 4th layer, "
                                "KDA layers with conv + recurrent state", kv_heads=1,
                    head_dim=576),
        ModelPreset("kimi-k3", "Kimi-K3", 93, "mla", 1152, state=_KDA4,
                    description="93 layers: 24 MLA (1152 B per token; every 4th layer and the "
                                "last, assumed) + 69 KDA layers with 4 state tensors each (q, k "
                                "and v conv state, 24,576 B each, and the 2 MiB fp32 recurrent "
                                "state; Kimi-Linear's head geometry, assumed)",
                    kv_heads=1, head_dim=576, full_attention_layers=_K3_MLA,
                    fusions=_KDA4_FUSED),
    )
}


def get_preset(key: str, num_layers: int | None = None) -> ModelPreset:
    """A preset by key (case-insensitive), optionally with another layer count.

    Raises:
        KvPlanError: Unknown key (the message lists the known ones).
    """
    preset = PRESETS.get(key.strip().lower())
    if preset is None:
        raise KvPlanError(f"unknown preset {key!r}; known: {', '.join(PRESETS)}")
    return preset if num_layers is None else preset.with_layers(num_layers)


def load_manifest(spec: str) -> ModelManifest:
    """The manifest an engine's configuration names (vLLM's ``kvplan_manifest``, SGLang's
    ``KVPLAN_MANIFEST``).

    ``spec`` is a preset key of :data:`kvplan.presets.PRESETS` (``deepseek-v3``), a key with
    the model's layer count (``kimi-linear:27``, :func:`kvplan.presets.get_preset`), or the path
    of a JSON file holding :meth:`ModelManifest.to_dict`'s form. A value that names an existing
    file, ends in ``.json`` or holds a path separator is a path.

    Raises:
        ManifestError: An empty value, an unknown preset (the message lists the known ones), a
            layer count that is not a positive integer, a file that cannot be read or is not
            JSON, or JSON of the wrong form, each naming the value.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ManifestError(f"manifest {spec!r}: expected a preset key (one of "
                            f"{', '.join(PRESETS)}, optionally key:num_layers) or the path of a "
                            f"JSON manifest")
    text = spec.strip()
    if os.path.isfile(text) or text.endswith(".json") or os.sep in text or "/" in text:
        try:
            with open(text, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise ManifestError(f"manifest file {text!r} cannot be read: "
                                f"{exc.strerror or exc}") from exc
        return ModelManifest.from_json(raw, where=f"manifest file {text!r}")
    key, sep, count = text.partition(":")
    layers: int | None = None
    if sep:
        if not (count.strip().isascii() and count.strip().isdigit()) or int(count) <= 0:
            raise ManifestError(f"manifest {text!r}: the layer count after ':' must be a "
                                f"positive integer, got {count!r}")
        layers = int(count)
    if key.strip().lower() not in PRESETS:
        raise ManifestError(f"manifest {text!r}: unknown preset {key!r} (known: "
                            f"{', '.join(PRESETS)}; or the path of a JSON manifest)")
    try:
        return get_preset(key, layers).manifest()
    except ManifestError:
        raise
    except KvPlanError as exc:
        raise ManifestError(f"manifest {text!r}: {exc}") from exc


def fragmented_pages(n: int, fragmentation: float, *, seed: int = 0, start: int = 0,
                     max_gap: int = 1, shuffle_runs: bool = False,
                     capacity: int | None = None) -> np.ndarray:
    """A request's page indices as a free list hands them out: ``n`` distinct pages made of runs.

    Against a contiguous list the result has exactly ``round(fragmentation * (n - 1))`` breaks
    (so that many + 1 runs, unless ``shuffle_runs`` happens to put two runs back to back). A
    break skips 1..``max_gap`` free pages (drawn uniformly); the first page is ``start``.
    ``shuffle_runs`` puts the runs in random order, as a free list after some churn does.

    Args:
        n: Pages in the request.
        fragmentation: 0 (one run) .. 1 (a break after every page).
        seed: Seed of the random breaks, gaps and order (same seed, same pages).
        start: The first page index.
        max_gap: Largest number of pages a break skips.
        shuffle_runs: Randomise the order of the runs.
        capacity: If given, every index must be below it.

    Returns:
        int64 array of ``n`` page indices.

    Raises:
        ValueError: ``n`` < 0, ``fragmentation`` outside [0, 1], ``max_gap`` < 1, or the pages do
            not fit ``capacity``.
    """
    if n < 0:
        raise ValueError(f"the number of pages must be non-negative, got {n}")
    if not 0.0 <= fragmentation <= 1.0:
        raise ValueError(f"fragmentation must be in [0, 1], got {fragmentation}")
    if max_gap < 1:
        raise ValueError(f"max_gap must be at least 1, got {max_gap}")
    rng = np.random.default_rng(seed)
    steps = np.ones(n, dtype=np.int64)
    if n:
        steps[0] = start
    breaks = round(fragmentation * (n - 1)) if n else 0
    if breaks:
        at = rng.choice(np.arange(1, n), size=breaks, replace=False)
        steps[at] += 1 if max_gap == 1 else rng.integers(1, max_gap + 1, size=breaks)
    pages = np.cumsum(steps)
    if shuffle_runs and breaks:
        runs = np.split(pages, np.sort(at))
        pages = np.concatenate([runs[i] for i in rng.permutation(len(runs))])
    if capacity is not None and n and int(pages.max()) >= capacity:
        raise ValueError(f"{n} pages with fragmentation {fragmentation} (max gap {max_gap}) from "
                         f"page {start} need indices up to {int(pages.max())}, beyond capacity "
                         f"{capacity}")
    return pages
