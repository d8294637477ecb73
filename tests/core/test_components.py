"""Multi-component layers: one layer's cache in several page entries with their own item
lengths, dtypes and strides (DeepSeek-V4's fp8 NoPE part and bf16 RoPE part of the latent, each
its own buffer), paired by (layer id, role). Checked byte for byte against the oracle for
scattered pages, padded strides, different page sizes, delta requests and TP ranks that hold
the latent whole (with and without published geometry); and the rules: a component one side
lacks is a PairingError naming the layer and the role, components of different item lengths
are a SizeMismatchError, so is head slicing a component whose item is not what the geometry
implies, and only components side by side in one page stride coalesce into one block."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.presets import DECODE_BASE, get_preset
from kvplan.testing.oracle import Memory, apply_plan, reference_copy

#: Bytes per token of each component: fp8 NoPE (with its scales) and bf16 RoPE, scaled down.
NOPE, ROPE = 12, 4
LAYERS = 3


class Peer:
    """One peer's components of ``LAYERS`` layers in a numpy arena: per layer a ``nope`` and a
    ``rope`` entry, each its own buffer of ``capacity`` pages whose stride is the item plus
    ``pad`` bytes (or, ``interleaved``, both components side by side in one page stride)."""

    def __init__(self, page_size: int, capacity: int, *, pad: int = 0, seed: int | None = None,
                 interleaved: bool = False, roles: tuple[str, ...] = ("nope", "rope"),
                 **context: object) -> None:
        widths = {"nope": NOPE, "rope": ROPE}
        items = [widths[r] * page_size for _ in range(LAYERS) for r in roles]
        if interleaved:
            stride = sum(widths[r] * page_size for r in roles)
            strides = [stride] * len(items)
            size = LAYERS * capacity * stride
        else:
            strides = [item + pad for item in items]
            size = capacity * sum(strides)
        self.arena = np.zeros(size + 64, np.uint8)
        if seed is not None:
            self.arena[:] = np.random.default_rng(seed).integers(0, 256, self.arena.size,
                                                                 dtype=np.uint8)
        base = int(self.arena.ctypes.data)
        if interleaved:
            per_layer = capacity * strides[0]
            offsets = [layer * per_layer + sum(items[layer * len(roles):k])
                       for layer in range(LAYERS)
                       for k in range(layer * len(roles), (layer + 1) * len(roles))]
        else:
            offsets = [capacity * sum(strides[:k]) for k in range(len(items))]
        lens = [capacity * s - (s - i) for s, i in zip(strides, items)]
        self.layout = kvplan.Layout([base + o for o in offsets], lens, items,
                                    [layer for layer in range(LAYERS) for _ in roles],
                                    list(roles) * LAYERS, strides=strides, page_size=page_size,
                                    **context)
        self.memory = Memory.of(self.arena)


def check(src: Peer, dst: Peer, src_pages: np.ndarray, dst_pages: np.ndarray, *,
          n_tokens: int | None = None, skip: int = 0) -> kvplan.Plan:
    """Plans and applies the request; the decode must equal the oracle's copy (with ``skip``
    K: the decode held the first K tokens, and the delta moves exactly the rest)."""
    if skip:
        reference_copy(src.layout, src.memory, dst.layout, dst.memory, src_pages, dst_pages,
                       n_tokens=skip)
    want = dst.memory.copy()
    moved = reference_copy(src.layout, src.memory, dst.layout, want, src_pages, dst_pages,
                           n_tokens=n_tokens)
    plan = kvplan.Template(src.layout, dst.layout).plan(src_pages, dst_pages, n_tokens=n_tokens,
                                                        skip_tokens=skip)
    written = np.zeros(dst.arena.size, bool)
    apply_plan(plan, src.memory, dst.memory, written)
    if not skip:
        assert plan.total_bytes == moved
    bad = np.flatnonzero(dst.arena != want.data)
    assert bad.size == 0, f"{bad.size} wrong decode bytes, the first at offset {bad[0]}"
    return plan


def test_nope_and_rope_buffers_move_byte_exact_in_two_blocks_per_layer_and_run() -> None:
    src, dst = Peer(4, 8, seed=1), Peer(4, 10, pad=8)
    assert src.layout.roles == ["nope", "rope"] * LAYERS
    assert src.layout.item_lens[:2] == [4 * NOPE, 4 * ROPE]
    assert dst.layout.strides[:2] == [4 * NOPE + 8, 4 * ROPE + 8]
    src_pages, dst_pages = np.array([3, 4, 5, 0], np.int64), np.array([1, 2, 3, 7], np.int64)
    plan = check(src, Peer(4, 10), src_pages, dst_pages)
    # Two runs (3-5 -> 1-3, 0 -> 7); per run one block per component of every layer.
    assert len(plan) == 2 * 2 * LAYERS
    assert plan.total_bytes == 4 * 4 * (NOPE + ROPE) * LAYERS
    # Padded decode pages (stride > item) are not contiguous: one block per page per entry.
    assert len(check(src, dst, src_pages, dst_pages)) == 4 * 2 * LAYERS


@settings(max_examples=60)
@given(st.data())
def test_components_between_page_sizes_and_deltas_match_the_oracle(data: st.DataObject) -> None:
    src_page = data.draw(st.sampled_from([1, 2, 4, 8]))
    ratio = data.draw(st.sampled_from([1, 2, 4]))
    dst_page = src_page * ratio if data.draw(st.booleans()) else max(1, src_page // ratio)
    n = data.draw(st.integers(1, 40))
    skip = data.draw(st.integers(0, n))
    src_count, dst_count = -(-n // src_page), -(-n // dst_page)
    src = Peer(src_page, src_count + 2, pad=data.draw(st.sampled_from([0, 4])), seed=3)
    dst = Peer(dst_page, dst_count + 2, pad=data.draw(st.sampled_from([0, 8])))
    perm = data.draw(st.permutations(range(src_count + 2)))
    dst_perm = data.draw(st.permutations(range(dst_count + 2)))
    src_pages = np.array(perm[:src_count], np.int64)
    dst_pages = np.array(dst_perm[:dst_count], np.int64)
    check(src, dst, src_pages, dst_pages, n_tokens=n, skip=skip)


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2), (1, 8)])
def test_tp_ranks_hold_the_components_whole(src_tp: int, dst_tp: int) -> None:
    """The latent's components are not split over heads: every decode rank gets them whole
    from the prefill rank it pairs with."""
    pages = np.array([2, 0, 1], np.int64)
    for d in range(dst_tp):
        dst = Peer(2, 4, tp_size=dst_tp, tp_rank=d)
        src = Peer(2, 4, seed=d % src_tp + 1, tp_size=src_tp, tp_rank=d % src_tp)
        assert check(src, dst, pages, pages).total_bytes == 3 * 2 * (NOPE + ROPE) * LAYERS


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_component_one_side_lacks_is_a_pairing_error_naming_layer_and_role(side: str) -> None:
    both, nope_only = Peer(2, 4), Peer(2, 4, roles=("nope",))
    src, dst = (nope_only, both) if side == "prefill" else (both, nope_only)
    if side == "decode":
        match = r"Decode peer is missing a transfer entry for model layer 0 role rope"
    else:
        match = (r"dst entry 1 \(layer 0, role rope\) .* the prefill sends layer 0 without a "
                 r"rope entry")
    with pytest.raises(kvplan.PairingError, match=match):
        kvplan.Template(src.layout, dst.layout)
    rows = [p for _, _, _, p in kvplan._core.check_pairs(src.layout, dst.layout)
            if p is not None]
    assert rows and all(isinstance(p, kvplan.PairingError) for p in rows)


def test_components_of_different_item_lengths_are_a_size_mismatch() -> None:
    src = Peer(2, 4)
    # The decode's roles swapped: its nope entry has the RoPE part's item length.
    dst = Peer(2, 4, roles=("rope", "nope"))
    layout = kvplan.Layout(dst.layout.data_ptrs, dst.layout.data_lens, dst.layout.item_lens,
                           dst.layout.layer_ids, ["nope", "rope"] * LAYERS, page_size=2)
    with pytest.raises(kvplan.SizeMismatchError, match="layer 0 role nope: src entry 0 has "
                                                      f"item_len {2 * NOPE} bytes, dst entry 0 "
                                                      f"has {2 * ROPE} bytes"):
        kvplan.Template(src.layout, layout)


def test_components_side_by_side_in_one_stride_coalesce_into_one_block() -> None:
    src, dst = Peer(2, 6, seed=4, interleaved=True), Peer(2, 6, interleaved=True)
    assert src.layout.strides[0] == 2 * (NOPE + ROPE)
    plan = check(src, dst, np.arange(4, dtype=np.int64), np.arange(1, 5, dtype=np.int64))
    assert len(plan) == LAYERS  # NoPE + RoPE of a layer: one block per run
    separate = check(Peer(2, 6, seed=4), Peer(2, 6), np.arange(4, dtype=np.int64),
                     np.arange(1, 5, dtype=np.int64))
    assert len(separate) == 2 * LAYERS


def test_deepseek_v4_preset_pairs_every_component_by_layer_and_role() -> None:
    preset = get_preset("deepseek-v4", 4)
    src = preset.layout(range(4), page_size=64, capacity=16)
    dst = preset.layout(range(4), page_size=64, capacity=16, base=DECODE_BASE)
    # vLLM's geometry: every layer a 128-token window of fp8_ds_mla rows (448 fp8 NoPE + 64
    # bf16 RoPE + 8 scale bytes = 584 B per token); odd layers also a compressed cache (a
    # 584 B row per 4 tokens) and a 132 B indexer entry per row; even layers a compressed
    # cache of a 584 B row per 128 tokens, in pool 1 of 128-token pages (one row each). Pages
    # padded to 576 B.
    assert src.roles == ["swa", "compressed", "swa", "compressed", "indexer"] * 2
    assert src.windows == [128, None, 128, None, None] * 2
    assert src.entry_pools == [0, 1, 0, 0, 0] * 2
    assert src.pools == [(0, 64, 1), (1, 128, 128)]
    assert src.item_lens[:5] == [64 * 584, 584, 64 * 584, 16 * 584, 16 * 132]
    assert src.strides[:5] == [65 * 576, 2 * 576, 65 * 576, 17 * 576, 16 * 132]
    t = kvplan.Template(src, dst)
    pages = np.arange(8, dtype=np.int64)
    pool = np.arange(4, dtype=np.int64)  # 512 tokens: four 128-token rows, one per pool page
    plan = t.plan(kvplan.Request(pages, pages, n_tokens=8 * 64, pool_pages={1: (pool, pool)}))
    window = 4 * 128 * 584  # every layer's last 128 tokens
    compressed = 2 * 8 * 16 * (584 + 132)  # the two odd layers, every row of the request
    rows = 2 * 4 * 584  # the two even layers, every complete 128-token row
    assert plan.total_bytes == window + compressed + rows
    # 500 tokens: the last row (tokens 384..511) is not complete, so it waits.
    plan = t.plan(kvplan.Request(pages, pages, n_tokens=500, pool_pages={1: (pool, pool)}))
    assert plan.total_bytes == 4 * 128 * 584 + 2 * 500 * (146 + 33) + 2 * 3 * 584
    # A decode without the indexer buffers cannot take the prefill's components.
    no_indexer = kvplan.Layout(*(getattr(dst, f) for f in ("data_ptrs", "data_lens",
                                                          "item_lens")),
                               dst.layer_ids,
                               [r if r != "indexer" else "indexer_v2" for r in dst.roles],
                               strides=dst.strides, windows=dst.windows, page_size=64,
                               ).with_pool([k for k, p in enumerate(dst.entry_pools) if p == 1],
                                           128, tokens_per_row=128)
    with pytest.raises(kvplan.PairingError, match=r"indexer"):
        kvplan.Template(src, no_indexer)
    with pytest.raises(kvplan.KvPlanError, match=r"one row per 4 tokens, so the page size "
                       r"must be a multiple of 4, got 2"):
        preset.layout(range(4), page_size=2, capacity=16)


def test_published_geometry_moves_replicated_latent_components_whole() -> None:
    """An MLA latent (one KV head) is replicated over TP: with the geometry published, the
    components go whole, byte-exact, from the TP-1 prefill to every decode rank of TP 2."""
    geometry = {"kv_heads": 1, "head_dim": NOPE // 2, "dtype_size": 2, "memory_order": "NHD"}
    pages = np.array([1, 0, 2], np.int64)
    for d in range(2):
        dst = Peer(2, 4, tp_size=2, tp_rank=d, **geometry)
        src = Peer(2, 4, seed=5, tp_size=1, tp_rank=0, **geometry)
        assert check(src, dst, pages, pages).total_bytes == 3 * 2 * (NOPE + ROPE) * LAYERS


def test_head_slicing_a_component_of_another_shape_is_a_size_mismatch() -> None:
    """Heads sliced between TP sizes: every component's item must be what the geometry
    implies, so a second component of another shape is refused, not cut at wrong offsets."""
    def layout(base: int, tp: int) -> kvplan.Layout:
        heads = 4 // tp
        return kvplan.Layout([base, base + (1 << 20)], [4096, 4096], [heads * 2 * 2 * 2, 16],
                             [0, 0], ["k", "k_rope"], page_size=2, tp_size=tp, tp_rank=0,
                             kv_heads=4, head_dim=2, dtype_size=2, memory_order="NHD")
    with pytest.raises(kvplan.SizeMismatchError, match=r"layer 0, role k_rope .* needs prefill "
                                                       r"items of .* = 32 bytes, this entry "
                                                       r"has 16") as e:
        kvplan.Template(layout(1 << 32, 1), layout(1 << 40, 2))
    assert e.value.kind == "head_slicing"
