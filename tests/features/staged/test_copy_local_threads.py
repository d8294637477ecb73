"""``kvplan.copy_local(..., threads=)``: the copy on several threads writes what one thread
writes, byte for byte, and equals the blocks copied one by one in numpy; a refused plan copies
nothing whatever the thread count; a thread count below one is refused by name. Random plans
with overlapping destinations run in rust/kvplan-core/tests/copy_threads.rs."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.presets import fragmented_pages

LAYERS, ITEM, TOKENS = 8, 576, 1024  # MLA page 1: 8192 blocks of 576 bytes (4.5 MiB)


def _scatter() -> tuple[kvplan.TransferPlan, np.ndarray, np.ndarray]:
    """An MLA page-1 scatter into decode pages all apart, its staging source and the pool."""
    capacity = 2 * TOKENS + 2
    span = capacity * ITEM
    pool = np.zeros(LAYERS * span, np.uint8)
    staging = np.random.default_rng(5).integers(0, 256, TOKENS * LAYERS * ITEM, dtype=np.uint8)

    def layout(base: int) -> kvplan.Layout:
        return kvplan.Layout.mla([base + i * span for i in range(LAYERS)], [span] * LAYERS, ITEM,
                                 layer_ids=list(range(LAYERS)), page_size=1)

    template = kvplan.Template(layout(1 << 40), layout(pool.ctypes.data))
    apart = fragmented_pages(TOKENS, 1.0, seed=7, shuffle_runs=True, capacity=capacity)
    plan = template.plan_staged(np.arange(TOKENS), apart, src_staging=(1 << 44, staging.size),
                                dst_staging=(staging.ctypes.data, staging.size))
    assert len(plan.scatter) == TOKENS * LAYERS
    return plan.scatter, staging, pool


def _one_by_one(plan: kvplan.TransferPlan, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.array(dst, copy=True)
    s0, d0 = src.ctypes.data, dst.ctypes.data
    for s, d, n in zip(*plan.as_lists()):
        out[d - d0:d - d0 + n] = src[s - s0:s - s0 + n]
    return out


@pytest.mark.parametrize("threads", [None, 1, 2, 3, 4, 16])
def test_every_thread_count_writes_the_same_bytes(threads: int | None) -> None:
    plan, staging, pool = _scatter()
    want = _one_by_one(plan, staging, pool)
    assert kvplan.copy_local(plan, [staging], [pool], threads=threads) == plan.total_bytes
    assert np.array_equal(pool, want)


def test_a_refused_plan_copies_nothing_on_several_threads() -> None:
    plan, staging, pool = _scatter()
    # The source one byte short: the block reading the staging's last byte is refused.
    with pytest.raises(kvplan.IndexBoundsError, match=r"src block \d+ .* 1 buffers given"):
        kvplan.copy_local(plan, [staging[:-1]], [pool], threads=4)
    assert not pool.any(), "nothing may be copied when a block does not fit"


def test_a_thread_count_below_one_is_refused() -> None:
    plan, staging, pool = _scatter()
    with pytest.raises(kvplan.KvPlanError, match=r"threads must be at least 1 .* got 0"):
        kvplan.copy_local(plan, [staging], [pool], threads=0)
    with pytest.raises(OverflowError):
        kvplan.copy_local(plan, [staging], [pool], threads=-1)
    with pytest.raises(TypeError):
        kvplan.copy_local(plan, [staging], [pool], threads="2")  # type: ignore[arg-type]
    assert not pool.any()
