"""Indexer and scale entries belong to their layer's KV entry: the DeepSeek-V3.2 preset's
latent + indexer pages move together (two blocks per layer and run, byte-exact), and a sidecar
whose KV entry is missing, on its own side or on the other, is a PairingError at template build
(an incomplete transfer is refused, not planned)."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset
from kvplan.testing.oracle import Memory, apply_plan, reference_copy

PAGE = 64


def v32(layers: int = 4):
    return get_preset("deepseek-v3.2", layers)


def test_latent_and_indexer_move_in_two_blocks_per_layer_and_run() -> None:
    preset = v32()
    src = preset.layout(range(4), page_size=PAGE, capacity=64)
    dst = preset.layout(range(4), page_size=PAGE, capacity=64, base=DECODE_BASE)
    assert src.roles == ["kv", "indexer"] * 4
    t = kvplan.Template(src, dst)
    contiguous = t.plan(np.arange(16, dtype=np.int64), np.arange(20, 36, dtype=np.int64))
    assert len(contiguous) == 2 * 4  # one block per entry: latent and indexer of every layer
    assert contiguous.total_bytes == 16 * PAGE * (1152 + 132) * 4
    two_runs = t.plan(np.arange(16, dtype=np.int64),
                      np.r_[np.arange(8), np.arange(40, 48)].astype(np.int64))
    assert len(two_runs) == 2 * 2 * 4
    assert PREFILL_BASE < DECODE_BASE


def test_the_indexer_bytes_land_byte_exact() -> None:
    # Small items in real memory: 2 layers, latent 16 B and indexer 4 B per token, 4 tokens a page.
    rng = np.random.default_rng(2)
    items = [16 * 4, 4 * 4] * 2

    def layout(arena: np.ndarray) -> kvplan.Layout:
        sizes = [8 * item for item in items]
        base = int(arena.ctypes.data)
        ptrs = [base + sum(sizes[:k]) for k in range(4)]
        return kvplan.Layout(ptrs, sizes, items, [0, 0, 1, 1], ["kv", "indexer"] * 2,
                             page_size=4)

    src = rng.integers(0, 256, 8 * sum(items), dtype=np.uint8)
    dst = np.zeros_like(src)
    s_layout, d_layout = layout(src), layout(dst)
    t = kvplan.Template(s_layout, d_layout)
    sp, dp = np.array([3, 1, 2], dtype=np.int64), np.array([0, 5, 6], dtype=np.int64)
    want = Memory.of(dst).copy()
    moved = reference_copy(s_layout, Memory.of(src), d_layout, want, sp, dp)
    plan = t.plan(sp, dp)
    apply_plan(plan, Memory.of(src), Memory.of(dst))
    assert plan.total_bytes == moved == 3 * sum(items)
    assert np.array_equal(dst, want.data)


def layout(roles: list[str], ids: list[int], base: int = PREFILL_BASE) -> kvplan.Layout:
    n = len(roles)
    return kvplan.Layout([base + k * 4096 for k in range(n)], [4096] * n, [64] * n, ids, roles,
                         page_size=1)


@pytest.mark.parametrize("roles, ids, side, entry, why", [
    (["kv", "indexer"], [0, 1], "src", 1, "the src side has no KV entry of layer 1"),
    (["kv", "k_scale"], [0, 1], "src", 1, "the src side has no KV entry of layer 1"),
])
def test_a_sidecar_without_its_kv_entry_is_refused(roles: list[str], ids: list[int], side: str,
                                                  entry: int, why: str) -> None:
    src = layout(roles, ids)
    with pytest.raises(kvplan.PairingError, match=rf"{side} entry {entry} \(layer 1, role "
                                                  rf"{roles[1]}\) belongs to its layer's KV "
                                                  rf"entry, but {why}") as e:
        kvplan.Template(src, layout(roles, ids, DECODE_BASE))
    assert e.value.kind == "missing_partner"


def test_a_decode_sidecar_the_prefill_does_not_send_is_refused() -> None:
    src = layout(["kv", "kv"], [0, 1])
    dst = layout(["kv", "indexer", "kv", "indexer"], [0, 0, 1, 1], DECODE_BASE)
    with pytest.raises(kvplan.PairingError, match=r"dst entry 1 \(layer 0, role indexer\) .* "
                                                  r"the prefill sends layer 0 without a indexer "
                                                  r"entry"):
        kvplan.Template(src, dst)
    # A decode that holds more layers than this prefill stage sends is fine: layer 1's
    # indexer belongs to a layer this template does not move.
    kvplan.Template(layout(["kv", "indexer"], [0, 0]), dst)
    # The per-entry check rows carry the same problem, so a report never disagrees.
    problems = [p for _, _, _, p in kvplan._core.check_pairs(src, dst) if p is not None]
    assert len(problems) == 1 and isinstance(problems[0], kvplan.PairingError)
    assert "role indexer" in str(problems[0])


def test_the_preset_refuses_layouts_it_cannot_describe() -> None:
    with pytest.raises(kvplan.KvPlanError, match="per-layer buffers only"):
        v32().layout(range(2), page_size=PAGE, capacity=8, cross_layer=True)
    with pytest.raises(kvplan.KvPlanError, match="attention geometry"):
        v32().layout(range(2), page_size=PAGE, capacity=8, tp_size=2)


@pytest.mark.parametrize("runs", [1, 4])
def test_v32_contiguous_plan_has_the_block_count_its_layout_defines(runs: int) -> None:
    """Pages consecutive on both sides within each of ``runs`` runs: exactly one block per
    entry and run, so at most 2 per (layer, run): the latent and its indexer."""
    preset = get_preset("deepseek-v3.2")
    n = 512
    src = preset.layout(range(61), page_size=PAGE, capacity=n + 4 * runs)
    dst = preset.layout(range(61), page_size=PAGE, capacity=n + 4 * runs, base=DECODE_BASE)
    per_layer: dict[int, int] = {}
    for layer, role in zip(src.layer_ids, src.roles):
        assert role in ("kv", "indexer")
        per_layer[layer] = per_layer.get(layer, 0) + 1
    assert set(per_layer.values()) == {2} and len(per_layer) == 61
    # Decode pages: ``runs`` runs, each one page after a free page.
    dst_pages = np.concatenate([np.arange(n // runs) + r * (n // runs + 1)
                                for r in range(runs)]).astype(np.int64)
    plan = kvplan.Template(src, dst).plan(np.arange(n, dtype=np.int64), dst_pages)
    assert plan.n_runs == runs
    assert len(plan) == runs * sum(per_layer.values()) == runs * 122
    # Blocks per (layer, run), from the plan's own per-pair block ranges.
    offsets = plan.pair_offsets.tolist()
    blocks_of_layer: dict[int, int] = {}
    for k, (i, _) in enumerate(kvplan.Template(src, dst).pairs.tolist()):
        layer = src.layer_ids[i]
        blocks_of_layer[layer] = blocks_of_layer.get(layer, 0) + offsets[k + 1] - offsets[k]
    assert set(blocks_of_layer.values()) == {2 * runs}
    assert plan.total_bytes == n * PAGE * (1152 + 132) * 61
