"""``kvplan.engines.measure``: the per-engine cost the direct-or-staged advice needs, measured
on loopback through kvplan's own transports (real Mooncake over TCP, real NIXL over UCX, both
ends in this process). No timing thresholds: the values must be real measurements (finite,
positive, from transfers that moved the bytes), not particular speeds."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvplan
from kvplan.engines.measure import (
    loopback_bytes,
    measure_copy_bandwidth,
    measure_cost,
    measure_loopback,
    solve_block_model,
)
from support.engine_peers import Engine

SMALL = {"small_blocks": 256, "small_block": 512, "large_blocks": 2, "large_block": 1 << 20}


def _sane(cost: kvplan.TransferCost) -> None:
    for value in (cost.per_block_s, cost.network_bytes_per_s, cost.copy_bytes_per_s):
        assert math.isfinite(value) and value > 0
    # Loose physical bounds, not timing targets: a block costs less than a second, and a
    # loopback stream and a memcpy move more than a kilobyte per second.
    assert cost.per_block_s < 1.0
    assert cost.network_bytes_per_s > 1e3 and cost.copy_bytes_per_s > 1e3


def test_the_block_model_is_solved_exactly() -> None:
    # 40 µs per block, 2 GB/s: both transfers built from those numbers give them back.
    def seconds(blocks: int, nbytes: int) -> float:
        return blocks * 40e-6 + nbytes / 2e9

    small, large = (2048, 2048 * 512), (4, 4 * (8 << 20))
    per_block, bw = solve_block_model((*small, seconds(*small)), (*large, seconds(*large)))
    assert per_block == pytest.approx(40e-6, rel=1e-9)
    assert bw == pytest.approx(2e9, rel=1e-9)


def test_a_noisy_measurement_still_gives_positive_costs() -> None:
    # The large transfer slower per byte than the small one claims: the exact solution has a
    # negative per-block cost; the fallback keeps both values positive.
    per_block, bw = solve_block_model((1000, 512_000, 1e-4), (4, 32 << 20, 0.5))
    assert bw == pytest.approx((32 << 20) / 0.5)
    assert per_block == 1e-9


def test_copy_bandwidth_is_measured() -> None:
    assert measure_copy_bandwidth(4 << 20, block=64 << 10, repeats=2) > 1e3
    with pytest.raises(ValueError, match="multiple of block"):
        measure_copy_bandwidth(1000, block=64)


def test_loopback_measurement_on_a_real_engine(engine: Engine) -> None:
    _sane(measure_loopback(engine.name, repeats=2, **SMALL))


@pytest.mark.nixl
def test_measure_cost_moves_the_bytes_it_times() -> None:
    """Through a caller's own transports: the destination holds the source's bytes afterwards
    (the timed transfers were real writes), and a region too small is refused up front."""
    from support.engine_peers import require_nixl

    require_nixl()
    from kvplan.engines.nixl import NixlTransport

    need = loopback_bytes(**SMALL)
    src = np.random.default_rng(7).integers(0, 256, need, dtype=np.uint8)
    dst = np.zeros(need, np.uint8)
    with NixlTransport() as sender, NixlTransport() as receiver:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        receiver.register_buffers([dst.ctypes.data], [dst.nbytes])
        peer = sender.add_peer(receiver.metadata())
        with pytest.raises(ValueError, match=f"at least {need} bytes"):
            measure_cost(sender, peer, src_region=(src.ctypes.data, need - 1),
                         dst_region=(dst.ctypes.data, need), **SMALL)
        cost = measure_cost(sender, peer, src_region=(src.ctypes.data, src.nbytes),
                            dst_region=(dst.ctypes.data, dst.nbytes), copy_bytes_per_s=5e9,
                            repeats=2, **SMALL)
    _sane(cost)
    assert cost.copy_bytes_per_s == 5e9
    large = SMALL["large_blocks"] * SMALL["large_block"]
    assert np.array_equal(dst[:large], src[:large])
