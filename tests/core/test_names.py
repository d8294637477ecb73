"""Names that say one thing: ``BlockSlice`` (old name ``PlanBatch``, kept as an alias for this
release), SGLang's planning helpers in ``kvplan.compat.sglang.planning_helpers``, and the slice
geometry of ``send_kvcache_slice`` as a small frozen dataclass."""

from __future__ import annotations

import dataclasses
import importlib
import types

import numpy as np
import pytest

import kvplan
from kvplan import _core
from kvplan.compat.sglang.templates import SliceGeometry, _slice_geometry

ITEM = 64


def test_block_slice_is_the_class_and_plan_batch_its_alias() -> None:
    assert kvplan.BlockSlice is _core.BlockSlice
    assert kvplan.PlanBatch is kvplan.BlockSlice
    assert _core.PlanBatch is _core.BlockSlice
    assert kvplan.BlockSlice.__name__ == "BlockSlice"
    assert "BlockSlice" in kvplan.__all__ and "PlanBatch" in kvplan.__all__


def test_batches_are_block_slices_and_hand_built_ones_unpack() -> None:
    ptrs = [1 << 20, 2 << 20]
    src = kvplan.Layout.mla(ptrs, [100 * ITEM] * 2, ITEM, layer_ids=[0, 1])
    dst = kvplan.Layout.mla([p << 10 for p in ptrs], [100 * ITEM] * 2, ITEM, layer_ids=[0, 1])
    plan = kvplan.Template(src, dst).plan(np.arange(0, 6, 2, dtype=np.int64),
                                          np.arange(6, dtype=np.int64)[::2].copy())
    batches = plan.batches(2)
    assert batches and all(type(b) is kvplan.BlockSlice for b in batches)
    assert repr(batches[0]).startswith("BlockSlice(n_blocks=")
    assert sum(len(b) for b in batches) == plan.n_blocks
    cols = (np.array([1, 2], np.uint64), np.array([3, 4], np.uint64), np.array([5, 6], np.uint64))
    s, d, n = kvplan.PlanBatch(*cols)  # the old name still builds one
    assert [s.tolist(), d.tolist(), n.tolist()] == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(kvplan.KvPlanError, match="equal lengths, got 2, 2 and 1"):
        kvplan.BlockSlice(cols[0], cols[1], cols[2][:1])


def test_sglang_planning_helpers_module() -> None:
    mod = importlib.import_module("kvplan.compat.sglang.planning_helpers")
    sglang = importlib.import_module("kvplan.compat.sglang")
    assert sglang.group_concurrent_contiguous is mod.group_concurrent_contiguous
    assert sglang.build_transfer_entry_pairs is mod.build_transfer_entry_pairs
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvplan.compat.sglang.helpers")


def test_slice_geometry_is_a_frozen_dataclass() -> None:
    kv_args = types.SimpleNamespace(page_size=16, total_kv_head_num=8, kv_head_num=4,
                                    engine_rank=5)
    manager = types.SimpleNamespace(kv_args=kv_args, attn_tp_size=2)
    # Decode TP 4 holds 2 heads per rank; its item is 16 tokens x 2 heads x 128 bytes.
    g = _slice_geometry(manager, dst_tp_rank=6, dst_attn_tp_size=4, dst_kv_item_len=16 * 2 * 128)
    assert g == SliceGeometry(heads=8, tp_p=2, r_p=1, tp_d=4, r_d=2, page=16, src_hpr=4,
                              dst_hpr=2, head_bytes=128)
    assert hash(g) == hash(dataclasses.replace(g))  # usable in the template cache key
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.page = 32  # type: ignore[misc]
    # Without total_kv_head_num, SGLang's fallback: kv_head_num x attn_tp_size.
    kv_args.total_kv_head_num = 0
    assert _slice_geometry(manager, 0, 4, 16 * 2 * 128).heads == 8
