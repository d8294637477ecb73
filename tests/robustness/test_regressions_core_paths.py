"""Regression tests for the core's error paths and planners: incompatible layouts reported in
linear time, window pools checked at their own page size, ring plans costed by blocks, and the
typed errors of conversion and window-page arguments.

Deterministic, and nothing asserts a duration.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan import Layout, PairingError

# ------------------------------------------------------------ incompatible layouts, 100k entries

N = 100_000


def _with_indexers(layers: int, first_id: int) -> Layout:
    """``layers`` layers of a KV entry and an indexer entry each."""
    n = 2 * layers
    ids = np.repeat(np.arange(first_id, first_id + layers, dtype=np.int64), 2)
    return Layout(np.arange(1, n + 1).tolist(), [640] * n, [64] * n, layer_ids=ids.tolist(),
                  roles=["kv", "indexer"] * layers)


def test_pairing_error_between_100k_entry_layouts_with_sidecars() -> None:
    # Each sidecar's KV entry and each unpaired decode entry was found by a scan of every entry:
    # quadratic, about 40 s for Template and compare at this size (minutes with sidecars). The
    # first problem and the whole report are what they were.
    src = _with_indexers(N // 2, 0)
    dst = _with_indexers(N // 2, 10**9)
    with pytest.raises(PairingError, match=r"model layer 0 role kv \(src entry 0, occurrence 1\)"):
        kvplan.Template(src, dst)
    report = kvplan.compare(src, dst)
    assert not report.compatible
    assert len(report.unpaired) == N
    assert report.reasons[0].startswith(f"{N} source entries have no decode partner: ")


# ------------------------------------------------------------ window pools at their page size


def _two_layers(**windows: object) -> Layout:
    return Layout([1 << 30, 1 << 31], [32, 64], [8, 16], [0, 1], ["kv", "kv"], page_size=1,
                  **windows)  # type: ignore[arg-type]


def test_window_fits_at_the_pools_page_size_not_the_layouts() -> None:
    # Entry 1 holds 4 items: 4 pool pages of 2 tokens hold a 5-token window, 4 pages of the
    # layout's 1 token would not. The width check used to run before the pool's page size was set.
    pooled = _two_layers(windows=[None, 5], window_page_size=2)
    assert pooled.window_page_size == 2 and pooled.windows == [None, 5]
    assert pooled.entries()[1].page_size == 2 and pooled.entries()[1].in_window_pool
    assert _two_layers().with_windows([None, 5], window_page_size=2) == pooled
    assert Layout.from_bytes(pooled.to_bytes()) == pooled
    assert Layout.from_dict(pooled.to_dict()) == pooled
    assert pooled.with_state("mamba", [1 << 40], [64], 64, [9]).window_page_size == 2
    # A pool too narrow for the window, or no pool, is still refused.
    for pool in ({"window_page_size": 1}, {}):
        with pytest.raises(kvplan.LayoutError, match="window of 5 tokens is wider than the 4 tokens"):
            _two_layers(windows=[None, 5], **pool)
        with pytest.raises(kvplan.LayoutError, match="window of 5 tokens is wider than the 4 tokens"):
            _two_layers().with_windows([None, 5], **pool)


# ------------------------------------------------------------ ring plans costed by blocks


def _ring_side(rows: int, base: int) -> Layout:
    """One layer: a page entry and a packed ring of ``rows`` 16-byte rows for two slots."""
    layout = Layout([base], [64], 16, [0], ["kv"], page_size=1)
    layout = layout.with_state("ring", [base + (1 << 20)], [2 * rows * 16], 16, [0])
    return layout.with_rings([None, rows])


@pytest.mark.parametrize("log_rows", [26, 36, 44])
def test_a_one_block_ring_plan_of_huge_rings_is_planned_by_blocks(log_rows: int) -> None:
    # The planner walked every live position to find the runs (2**26 rows about a second,
    # 2**36 never answered); packed rings that never wrap are one block whatever their size.
    rows = 1 << log_rows
    t = kvplan.Template(_ring_side(rows, 1 << 46), _ring_side(rows, 1 << 47))
    plan = t.plan_ring(1, 0, rows)
    assert plan.n_blocks == 1 and plan.total_bytes == rows * 16
    assert plan.as_lists() == ([(1 << 46) + (1 << 20) + rows * 16], [(1 << 47) + (1 << 20)],
                               [rows * 16])
    # Rings of R and R + 1 rows after 3R + 5 positions: R live rows in three blocks, cut where
    # each ring wraps.
    t = kvplan.Template(_ring_side(rows, 1 << 46), _ring_side(rows + 1, 1 << 47))
    plan = t.plan_ring(0, 0, 3 * rows + 5)
    assert plan.lengths.tolist() == [(rows - 5) * 16, 3 * 16, 2 * 16]


# ------------------------------------------------------------ conversion templates


def _conversion_pair(dst_base: int = 1 << 30) -> tuple[Layout, Layout]:
    """A bf16 prefill layer into an fp8 decode layer with per-token scales (2-token pages)."""
    ctx = dict(page_size=2, kv_heads=2, head_dim=4)
    src = Layout([1 << 20], [4 * 32], [32], [0], ["k"], dtype_size=2,
                 **ctx).with_representations(["bf16"])  # type: ignore[arg-type]
    dst = Layout([dst_base, dst_base + (1 << 20)], [4 * 16, 4 * 8], [16, 8], [0, 0],
                 ["k", "k_scale"], dtype_size=1,
                 **ctx).with_representations(["fp8_e4m3:per_token", None])  # type: ignore[arg-type]
    return src, dst


STAGING = (1 << 40, 1 << 20)


@pytest.mark.parametrize("name", ["staging", "dst_staging"])
@pytest.mark.parametrize(("region", "shown"), [
    ((1 << 40,), r"got a tuple of 1 item\b"),
    ((1 << 40, 1 << 20, 7), r"got a tuple of 3 items\b"),
    ([1 << 40, 1 << 20], r"got list\b"),
    ((1 << 40, 2.5), r"its size is a float\b"),
])
def test_a_conversion_staging_region_of_the_wrong_shape_is_a_type_error(
        name: str, region: object, shown: str) -> None:
    # PyO3's tuple conversion raised a bare ValueError naming neither the argument nor the
    # shape; the other planners' regions raise this TypeError.
    t = kvplan.ConversionTemplate(*_conversion_pair())
    pages = (np.arange(2), np.arange(2))
    regions: dict[str, Any] = {"staging": STAGING, "dst_staging": STAGING, name: region}
    with pytest.raises(TypeError, match=rf"^{name} must be a tuple \(addr, size\) of two ints"
                                        rf".*{shown}"):
        t.plan(*pages, regions["staging"], dst_staging=regions["dst_staging"])
    with pytest.raises(OverflowError, match=rf"^{name}'s addr must be an int in 0..2\*\*64"):
        t.plan(*pages, **{"staging": STAGING, name: (-1, 1 << 20)})  # type: ignore[arg-type]
    # Well-formed regions (and dst_staging=None) plan as before.
    assert t.plan(*pages, STAGING, dst_staging=None).network_bytes > 0
    assert t.plan(*pages, STAGING, dst_staging=STAGING).network_bytes > 0


@pytest.mark.parametrize("dst_base", [1 << 63, (1 << 64) - (1 << 32)])
def test_conversion_decode_buffers_at_2_pow_63_and_above_plan_like_lower_ones(dst_base: int) -> None:
    # Conversion plans doubled every decode address, so decode buffers at 2**63 and above were
    # refused; now they plan exactly as the same buffers lower down, moved.
    low = kvplan.ConversionTemplate(*_conversion_pair()).plan(
        np.array([0, 3]), np.array([1, 2]), STAGING)
    high = kvplan.ConversionTemplate(*_conversion_pair(dst_base)).plan(
        np.array([0, 3]), np.array([1, 2]), STAGING)
    moved = dst_base - (1 << 30)
    (src_low, dst_low, len_low), (src_high, dst_high, len_high) = low.network, high.network
    assert dst_high.tolist() == [a + moved for a in dst_low.tolist()]
    assert high.scale_dst_addrs.tolist() == [a + moved for a in low.scale_dst_addrs.tolist()]
    assert (src_high.tolist(), len_high.tolist()) == (src_low.tolist(), len_low.tolist())
    assert [c.tolist() for c in high.gather] == [c.tolist() for c in low.gather]
    assert high.network_bytes == low.network_bytes > 0


# ------------------------------------------------------------ window pages without a pool


def test_window_pages_on_a_template_without_windows_are_refused() -> None:
    src = Layout([1 << 20, 1 << 21], [640, 640], 64, [0, 1], ["kv", "kv"], page_size=1)
    dst = Layout([1 << 30, 1 << 31], [640, 640], 64, [0, 1], ["kv", "kv"], page_size=1)
    t = kvplan.Template(src, dst)
    pages = (np.arange(3), np.arange(3))
    for window_pages, side in [((np.arange(2), None), "src"),
                               ((None, np.arange(2)), "dst"),
                               ((np.arange(2), np.arange(2)), "src")]:
        with pytest.raises(kvplan.KvPlanError,
                           match=rf"window pages were given for the {side} side, whose layout "
                                 r"has no window pool"):
            t.plan(*pages, window_pages=window_pages)
    # No window pages (None, or None for both sides) plans as before.
    expected = t.plan(*pages).as_lists()
    assert t.plan(*pages, window_pages=None).as_lists() == expected
    assert t.plan(*pages, window_pages=(None, None)).as_lists() == expected
