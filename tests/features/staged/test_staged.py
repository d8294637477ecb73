"""Staged plans on CPU memory: ``Template.plan_staged`` split into gather → network → scatter.

The gather and the scatter run through ``kvplan.copy_local`` on numpy buffers (the prefill's
arena into a staging buffer, a decode staging buffer into the decode's arena), the network
half with numpy (what an engine does); the decode arena must equal what the direct plan
writes and what kvplan.testing's oracle writes, byte for byte. Several prefill ranks (writers)
fill one decode staging region. ``copy_local``'s refusals (a block outside its buffers, a
read-only or overlapping destination) are checked with their messages. The full matrix (TP
{1,2,4,8}², heads, NHD/HND, PP, page sizes, state) runs in rust/kvplan-core/tests/staged.rs.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kvplan
from kvplan.testing.oracle import Memory, apply_plan, reference_copy
from kvplan.testing.ranks import Model, Rank, rank_memory

LAYERS, HEAD_DIM = 2, 4


def model(heads: int, window: int | None = None) -> Model:
    return Model(layers=LAYERS, kv_heads=heads, head_dim=HEAD_DIM, dtype_size=2, window=window)


def pages(n_tokens: int, page_size: int, *, reverse: bool) -> np.ndarray:
    count = -(-n_tokens // page_size)
    if reverse:
        return np.arange(count, dtype=np.int64)[::-1].copy()
    return np.array([p for p in range(count + 1) if p != 1][:count], dtype=np.int64)


def staged_request(heads: int, tp_p: int, tp_d: int, r_d: int, *, order: str,
                   page_sizes: tuple[int, int], n_tokens: int, window: int | None = None) -> int:
    """Plans every writer of decode rank ``r_d`` directly and staged through one shared decode
    staging region, runs both on real memory and compares them and the oracle. Returns the
    number of writers that sent bytes."""
    ps, pd = page_sizes
    src_pages, dst_pages = pages(n_tokens, ps, reverse=False), pages(n_tokens, pd, reverse=True)
    tokens = n_tokens if ps != pd else None

    def room(page_list: np.ndarray, size: int) -> int:
        # the request's pages and two more, and at least one window (a wider one is refused)
        return max(len(page_list) + 2, -(-(window or 0) // size))

    dst = rank_memory(model(heads, window), Rank(r_d, tp_d, pd, order, room(dst_pages, pd)))
    want = dst.memory.copy()
    direct_out = dst.memory.copy()
    sources = [rank_memory(model(heads, window), Rank(r_p, tp_p, ps, order, room(src_pages, ps)),
                           seed=r_p + 1) for r_p in range(tp_p)]
    staged = []
    for src in sources:
        template = kvplan.Template(src.layout, dst.layout)
        apply_plan(template.plan(src_pages, dst_pages, n_tokens=tokens), src.memory, direct_out)
        reference_copy(src.layout, src.memory, dst.layout, want, src_pages, dst_pages,
                       n_tokens=tokens)
        staged.append((src, template))
    # Every writer's decode share lies in one region; its size is the same for every writer.
    region_bytes = 1 << 20
    decode_staging = np.zeros(region_bytes, np.uint8)
    prefill_staging = [np.zeros(region_bytes, np.uint8) for _ in sources]
    plans = []
    for (src, template), staging in zip(staged, prefill_staging):
        plan = template.plan_staged(
            src_pages, dst_pages, n_tokens=tokens,
            src_staging=(staging.ctypes.data, staging.size),
            dst_staging=(decode_staging.ctypes.data, decode_staging.size))
        plans.append(plan)
        direct = template.plan(src_pages, dst_pages, n_tokens=tokens)
        assert plan.direct_blocks == len(direct)
        assert plan.src_staging_bytes == direct.total_bytes == plan.gather.total_bytes
        assert kvplan.copy_local(plan.gather, [src.memory.data], [staging]) == direct.total_bytes
        apply_plan(plan.network, Memory.of(staging), Memory.of(decode_staging))
    # The decode runs every writer's scatter once the network is done.
    for plan in plans:
        kvplan.copy_local(plan.scatter, [decode_staging], [dst.memory.data])
    assert np.array_equal(direct_out.data, want.data), "direct plan differs from the oracle"
    bad = np.flatnonzero(dst.memory.data != want.data)
    assert bad.size == 0, f"{bad.size} staged bytes differ, the first at offset {bad[0]}"
    return sum(1 for p in plans if p.src_staging_bytes > 0)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [(8, 8, 2), (8, 2, 8), (2, 4, 1), (16, 4, 4),
                                                      (1, 2, 4), (2, 1, 2)])
@pytest.mark.parametrize(("page_sizes", "n_tokens"), [((4, 4), 12), ((16, 4), 21), ((1, 8), 13)])
def test_staged_equals_direct_and_oracle(order: str, heads: int, tp_p: int, tp_d: int,
                                         page_sizes: tuple[int, int], n_tokens: int) -> None:
    for r_d in range(tp_d):
        staged_request(heads, tp_p, tp_d, r_d, order=order, page_sizes=page_sizes,
                       n_tokens=n_tokens)


def test_writers_share_one_decode_region() -> None:
    """TP 8 → 2, 8 heads: four prefill ranks write decode rank 1's region side by side, one
    network block each."""
    assert staged_request(8, 8, 2, 1, order="NHD", page_sizes=(4, 4), n_tokens=16) == 4
    src = rank_memory(model(8), Rank(6, 8, 4, "NHD", 6), seed=1)
    dst = rank_memory(model(8), Rank(1, 2, 4, "NHD", 6))
    template = kvplan.Template(src.layout, dst.layout)
    plan = template.plan_staged(np.arange(4), np.arange(4)[::-1].copy(),
                                src_staging=(1 << 40, 1 << 20), dst_staging=(1 << 44, 1 << 20))
    share = LAYERS * 2 * 16 * HEAD_DIM * 2  # K and V of 2 layers, 16 tokens, 1 head
    assert plan.writer == (2, 4)
    assert plan.dst_staging_range == (2 * share, 3 * share)
    assert plan.dst_staging_bytes == 4 * share
    assert len(plan.network) == 1
    assert plan.network.src_addrs[0] == 1 << 40 and plan.network.dst_addrs[0] == (1 << 44) + 2 * share
    assert plan.direct_blocks == LAYERS * 2 * 16  # one block per token per entry
    assert "StagedPlan(" in repr(plan)


def _template() -> tuple[kvplan.Template, np.ndarray, np.ndarray]:
    src = rank_memory(model(8), Rank(0, 2, 4, "NHD", 6), seed=3)
    dst = rank_memory(model(8), Rank(1, 4, 4, "NHD", 6))
    return kvplan.Template(src.layout, dst.layout), src.memory.data, dst.memory.data


def test_staging_regions_too_small_say_what_they_need() -> None:
    template, _, _ = _template()
    src_pages, dst_pages = np.arange(3), np.array([5, 4, 3])
    ok = template.plan_staged(src_pages, dst_pages, src_staging=(1 << 40, 1 << 20),
                              dst_staging=(1 << 44, 1 << 20))
    need = ok.src_staging_bytes
    exact = template.plan_staged(src_pages, dst_pages, src_staging=(1 << 40, need),
                                 dst_staging=(1 << 44, ok.dst_staging_bytes))
    assert exact.src_staging_bytes == need
    with pytest.raises(kvplan.SizeMismatchError,
                       match=rf"prefill staging region of {need - 1} bytes is too small: .* "
                             rf"needs {need} bytes") as err:
        template.plan_staged(src_pages, dst_pages, src_staging=(1 << 40, need - 1),
                             dst_staging=(1 << 44, 1 << 20))
    assert err.value.kind == "staging_too_small"
    with pytest.raises(kvplan.SizeMismatchError, match=r"decode staging region .* too small"):
        template.plan_staged(src_pages, dst_pages, src_staging=(1 << 40, need),
                             dst_staging=(1 << 44, ok.dst_staging_bytes - 1))


def _gather() -> tuple[kvplan.StagedPlan, np.ndarray, np.ndarray]:
    """A staged plan of a head-sliced request, the prefill arena and the staging buffer its
    gather writes."""
    template, src, _ = _template()
    staging = np.zeros(1 << 16, np.uint8)
    plan = template.plan_staged(np.arange(3), np.array([5, 4, 3]),
                                src_staging=(staging.ctypes.data, staging.size),
                                dst_staging=(1 << 44, 1 << 20))
    return plan, src, staging


def test_copy_local_takes_memoryviews_and_bytearrays() -> None:
    template, src, _ = _template()
    staging = bytearray(1 << 16)
    addr = np.frombuffer(staging, np.uint8).ctypes.data
    plan = template.plan_staged(np.arange(3), np.array([5, 4, 3]),
                                src_staging=(addr, len(staging)), dst_staging=(1 << 44, 1 << 20))
    assert kvplan.copy_local(plan.gather, [memoryview(src)], [staging]) == plan.src_staging_bytes
    view = Memory.of(src)
    for s, d, n in zip(*plan.gather.as_lists()):
        assert bytes(staging[d - addr:d - addr + n]) == view.at(s, n).tobytes()


def test_copy_local_refuses_a_block_outside_its_buffers() -> None:
    plan, src, staging = _gather()
    short = staging[:plan.src_staging_bytes - 1]
    last = len(plan.gather) - 1
    with pytest.raises(kvplan.IndexBoundsError,
                       match=rf"dst block {last} at \[0x[0-9a-f]+, \+\d+ bytes\) does not lie "
                             r"inside one of the 1 buffers given for that side \(nearest is "
                             r"buffer 0"):
        kvplan.copy_local(plan.gather, [src], [short])
    assert not staging.any(), "nothing may be copied when a block does not fit"
    with pytest.raises(kvplan.IndexBoundsError, match=r"src block 0 .* 1 buffers given"):
        kvplan.copy_local(plan.gather, [src[:16]], [staging])
    assert not staging.any()


def test_copy_local_refuses_read_only_destinations() -> None:
    plan, src, staging = _gather()
    staging.setflags(write=False)
    with pytest.raises(kvplan.KvPlanError, match=r"dst_buffers\[0\] is read-only"):
        kvplan.copy_local(plan.gather, [src], [staging])
    with pytest.raises(kvplan.KvPlanError, match=r"dst_buffers\[0\] is read-only"):
        kvplan.copy_local(plan.gather, [src], [bytes(16)])


def test_copy_local_refuses_overlapping_memory() -> None:
    plan, src, staging = _gather()
    with pytest.raises(kvplan.KvPlanError,
                       match=r"source buffer 0 at \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlaps "
                             r"destination buffer 0") as err:
        kvplan.copy_local(plan.gather, [src], [src[8:]])
    assert err.value.kind == "buffer_overlap"
    with pytest.raises(kvplan.KvPlanError,
                       match=r"destination buffer 0 .* overlaps destination buffer 1"):
        kvplan.copy_local(plan.gather, [src], [staging, staging[100:200]])
    with pytest.raises(kvplan.KvPlanError, match=r"overlaps the plan's column 2"):
        kvplan.copy_local(plan.gather, [src], [plan.gather.lengths.view(np.uint8)])
    assert not staging.any()
    # Sources may overlap each other: they are only read.
    n = kvplan.copy_local(plan.gather, [src, src[: src.size // 2]], [staging])
    assert n == plan.src_staging_bytes and staging.any()


def test_staged_plans_reuse_pooled_output_memory() -> None:
    """A staged plan's gather and scatter live in two pooled buffers, like a direct plan's
    columns: once the plans of one request die, planning it again allocates nothing fresh
    (a large request otherwise spends most of its planning time faulting in new memory)."""
    template, _, _ = _template()
    src_pages, dst_pages = np.arange(3), np.array([5, 4, 3])
    regions = {"src_staging": (1 << 40, 1 << 20), "dst_staging": (1 << 44, 1 << 20)}
    want = template.plan_staged(src_pages, dst_pages, **regions)
    lists = [p.as_lists() for p in (want.gather, want.network, want.scatter)]
    del want
    gc.collect()
    _, _, hits0, misses0 = kvplan._core.pool_stats()
    for _ in range(3):
        plan = template.plan_staged(src_pages, dst_pages, **regions)
        assert [p.as_lists() for p in (plan.gather, plan.network, plan.scatter)] == lists
        assert plan.gather.n_blocks == plan.direct_blocks > plan.network.n_blocks == 1
        del plan
        gc.collect()
    _, _, hits1, misses1 = kvplan._core.pool_stats()
    assert misses1 == misses0, "steady state must not allocate fresh output memory"
    assert hits1 == hits0 + 2 * 3  # gather and scatter, per plan


def test_a_small_staged_part_does_not_hold_a_large_buffer() -> None:
    """Between TP 8 and TP 2 on NHD pages the gather merges to one block per entry while the
    scatter keeps one block per token: the gather is copied out of its pooled buffer (which
    goes back to the pool at once), the scatter stays a view of its own."""
    src = rank_memory(model(8), Rank(0, 8, 4, "NHD", 6), seed=3)
    dst = rank_memory(model(8), Rank(0, 2, 4, "NHD", 6))
    template = kvplan.Template(src.layout, dst.layout)
    plan = template.plan_staged(np.arange(3), np.array([5, 4, 3]),
                                src_staging=(1 << 40, 1 << 20), dst_staging=(1 << 44, 1 << 20))
    assert plan.gather.n_blocks * 4 < plan.direct_blocks == plan.scatter.n_blocks
    for column in (plan.gather.src_addrs, plan.gather.dst_addrs, plan.gather.lengths):
        assert column.base is None and column.flags.owndata
    for column in (plan.scatter.src_addrs, plan.scatter.dst_addrs, plan.scatter.lengths):
        assert column.base is not None


@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [(2, 1, 1), (8, 2, 8), (1, 2, 4), (8, 8, 2),
                                                      (2, 4, 1)])
@pytest.mark.parametrize(("page_sizes", "n_tokens"), [((4, 4), 12), ((16, 4), 21), ((1, 8), 13)])
@pytest.mark.parametrize("window", [1, 5, 100])
def test_staged_window_plans_stage_only_the_window(heads: int, tp_p: int, tp_d: int,
                                                   page_sizes: tuple[int, int], n_tokens: int,
                                                   window: int) -> None:
    """A window layer's staged bytes are its direct plan's (the window only), where the decode
    region is packed back to back (one writer per decode rank, prefill PP 1); with several
    writers SGLang's staging layout gives every entry one slot size, so a full and a window
    entry moving different bytes are refused naming both pairs."""
    for r_d in range(tp_d):
        try:
            staged_request(heads, tp_p, tp_d, r_d, order="NHD", page_sizes=page_sizes,
                           n_tokens=n_tokens, window=window)
        except kvplan.KvPlanError as e:
            assert e.kind == "staging_slots", e
            assert tp_p > tp_d and window < n_tokens, (tp_p, tp_d, window)


def test_several_writers_refuse_window_and_full_entries_of_different_slot_sizes() -> None:
    with pytest.raises(kvplan.KvPlanError, match="staged decode slots need equal bytes per "
                       "attention entry pair: page pair 0 moves 96 bytes per entry, page pair 1 "
                       "moves 40") as e:
        staged_request(8, 8, 2, 0, order="NHD", page_sizes=(4, 4), n_tokens=12, window=5)
    assert e.value.kind == "staging_slots"
