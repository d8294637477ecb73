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
