"""The attention geometry a layout publishes (heads, head size, memory order): what a receiver
must know to slice heads between different TP sizes."""

from __future__ import annotations

import pytest

import kvplan
from kvplan import KvPlanError, Layout


def mha(**ctx):
    return Layout.mha([4096], [1 << 30], [1 << 20], [1 << 20], 8192, 8192, layer_ids=[0],
                      page_size=16, **ctx)


def test_published_geometry_round_trips_through_wire_and_dict():
    layout = mha(tp_size=4, tp_rank=1, kv_heads=8, head_dim=128, dtype_size=2,
                 memory_order="hnd")
    assert (layout.kv_heads, layout.heads_per_rank, layout.head_dim, layout.dtype_size,
            layout.memory_order) == (8, 2, 128, 2, "HND")
    assert Layout.from_bytes(layout.to_bytes()) == layout
    assert Layout.from_dict(layout.to_dict()) == layout
    assert layout != mha(tp_size=4, tp_rank=1, kv_heads=8, head_dim=128, dtype_size=2)


def test_heads_per_rank_defaults_to_the_usual_split_and_replicates_below_one():
    assert mha(tp_size=2, kv_heads=8, head_dim=128, dtype_size=2).heads_per_rank == 4
    assert mha(tp_size=8, kv_heads=2, head_dim=128, dtype_size=2).heads_per_rank == 1
    assert mha(tp_size=8, kv_heads=2, head_dim=128, dtype_size=2).memory_order == "NHD"


def test_unpublished_geometry_is_none_and_old_bytes_still_decode():
    layout = mha()
    assert (layout.kv_heads, layout.heads_per_rank, layout.head_dim, layout.dtype_size,
            layout.memory_order) == (None,) * 5
    assert Layout.from_bytes(layout.to_bytes()) == layout


def test_partial_or_inconsistent_geometry_is_refused():
    with pytest.raises(TypeError, match="kv_heads, head_dim and dtype_size together"):
        mha(kv_heads=8)
    with pytest.raises(TypeError, match="memory_order"):
        mha(kv_heads=8, head_dim=128, dtype_size=2, memory_order=3)
    with pytest.raises(KvPlanError, match="unknown memory order 'NCHW'|unknown memory order \"NCHW\""):
        mha(kv_heads=8, head_dim=128, dtype_size=2, memory_order="NCHW")
    with pytest.raises(kvplan.LayoutError, match="heads_per_rank 16 exceeds kv_heads 8"):
        mha(kv_heads=8, heads_per_rank=16, head_dim=128, dtype_size=2)
    with pytest.raises(kvplan.LayoutError, match="head_dim must be at least 1"):
        mha(kv_heads=8, head_dim=0, dtype_size=2)
