"""Regression tests for the core's error paths and planners: incompatible layouts reported in
linear time, window pools checked at their own page size, ring plans costed by blocks, and the
typed errors of conversion and window-page arguments.

Deterministic, and nothing asserts a duration.
"""

from __future__ import annotations

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


def test_pairing_error_between_100k_entry_layouts_with_sidecars():
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


def test_window_fits_at_the_pools_page_size_not_the_layouts():
    # Entry 1 holds 4 items: 4 pool pages of 2 tokens hold a 5-token window, 4 pages of the
    # layout's 1 token would not. The width check used to run before the pool's page size was set.
    pooled = _two_layers(windows=[None, 5], window_page_size=2)
    assert pooled.window_page_size == 2 and pooled.windows == [None, 5]
    assert pooled.entries()[1].page_size == 2 and pooled.entries()[1].in_window_pool
    assert _two_layers().with_windows([None, 5], window_page_size=2) == pooled
    assert Layout.from_bytes(pooled.to_bytes()) == pooled
    assert pooled.with_state("mamba", [1 << 40], [64], 64, [9]).window_page_size == 2
    # A pool too narrow for the window, or no pool, is still refused.
    for pool in ({"window_page_size": 1}, {}):
        with pytest.raises(kvplan.LayoutError, match="window of 5 tokens is wider than the 4 tokens"):
            _two_layers(windows=[None, 5], **pool)
        with pytest.raises(kvplan.LayoutError, match="window of 5 tokens is wider than the 4 tokens"):
            _two_layers().with_windows([None, 5], **pool)  # type: ignore[arg-type]


# ------------------------------------------------------------ ring plans costed by blocks


def _ring_side(rows: int, base: int) -> Layout:
    """One layer: a page entry and a packed ring of ``rows`` 16-byte rows for two slots."""
    layout = Layout([base], [64], 16, [0], ["kv"], page_size=1)
    layout = layout.with_state("ring", [base + (1 << 20)], [2 * rows * 16], 16, [0])
    return layout.with_rings([None, rows])


@pytest.mark.parametrize("log_rows", [26, 36, 44])
def test_a_one_block_ring_plan_of_huge_rings_is_planned_by_blocks(log_rows: int):
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
