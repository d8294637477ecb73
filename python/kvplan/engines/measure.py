"""Measure what moving bytes costs on an engine, once, for :func:`kvplan.advise` and
:meth:`kvplan.Template.transfer_advice`.

The advice compares two estimates built from three numbers (a :class:`kvplan.TransferCost`):

* ``per_block_s``: what one more engine block costs on top of its bytes (submission,
  per-request bookkeeping, a round trip per batch spread over its blocks);
* ``network_bytes_per_s``: the engine's streaming bandwidth for large blocks;
* ``copy_bytes_per_s``: the bandwidth of the local copies a staged transfer adds (its gather
  on the prefill and its scatter on the decode).

:func:`measure_cost` measures the first two through a transport and a peer the caller set up
(the same transport and batch bounds the transfers will use), the third with
:func:`measure_copy_bandwidth`. :func:`measure_loopback` builds both ends in this process on
127.0.0.1 (Mooncake TCP) or UCX (NIXL) and measures there. Each figure is the median of a
few repeats of fixed-size transfers, after one untimed warm-up.

The engine part solves the model ``seconds = blocks × per_block_s + bytes /
network_bytes_per_s`` from two transfers: many small blocks, and a few large ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvplan._core import Layout, BlockSlice, Template, TransferCost, copy_local
from kvplan.engines._base import Transport

__all__ = ["loopback_bytes", "loopback_transports", "measure_copy_bandwidth", "measure_cost",
           "measure_loopback", "solve_block_model"]

#: Bytes of one small block (a token of a few heads in an NHD page: the blocks direct plans
#: of head-sliced requests are made of).
SMALL_BLOCK = 512
#: Small blocks per timed transfer.
SMALL_BLOCKS = 2048
#: Bytes of one large block, and how many a timed transfer moves.
LARGE_BLOCK = 8 << 20
LARGE_BLOCKS = 4
#: Timed repeats of each transfer (the median is used).
REPEATS = 5


def loopback_bytes(small_blocks: int = SMALL_BLOCKS, small_block: int = SMALL_BLOCK,
                   large_blocks: int = LARGE_BLOCKS, large_block: int = LARGE_BLOCK) -> int:
    """Bytes each side's region needs for :func:`measure_cost` with these sizes."""
    # Small blocks sit two block lengths apart, so no two of them touch on either side.
    return max(small_blocks * 2 * small_block, large_blocks * large_block)


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: connections, first-touch page faults, engine-side caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check_region(name: str, region: tuple[int, int], need: int) -> tuple[int, int]:
    addr, size = (int(v) for v in region)
    if addr <= 0 or size < need:
        raise ValueError(f"{name} must be (addr, size) of at least {need} bytes of registered "
                         f"memory, got ({addr:#x}, {size})")
    return addr, size


def measure_copy_bandwidth(nbytes: int = 32 << 20, *, block: int = 64 << 10,
                           repeats: int = REPEATS) -> float:
    """Local copy bandwidth in bytes per second: ``nbytes`` between two host buffers in
    blocks of ``block`` bytes (no two adjacent on the destination, so none merge), executed
    by :func:`kvplan.copy_local` as gathers and scatters are; the median of ``repeats``."""
    if nbytes <= 0 or block <= 0 or nbytes % block:
        raise ValueError(f"nbytes ({nbytes}) must be a positive multiple of block ({block})")
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    n = nbytes // block

    def one_entry(buf: np.ndarray) -> Layout:
        return Layout([buf.ctypes.data], [nbytes], block, [0])

    pages = np.arange(n, dtype=np.int64)
    plan = Template(one_entry(src), one_entry(dst)).plan(pages, pages[::-1].copy())
    seconds = _median_seconds(lambda: copy_local(plan, [src], [dst]), repeats)
    return nbytes / max(seconds, 1e-9)


def measure_cost(transport: Transport, peer_session: str, *, src_region: tuple[int, int],
                 dst_region: tuple[int, int], copy_bytes_per_s: float | None = None,
                 small_blocks: int = SMALL_BLOCKS, small_block: int = SMALL_BLOCK,
                 large_blocks: int = LARGE_BLOCKS, large_block: int = LARGE_BLOCK,
                 repeats: int = REPEATS, submit_kwargs: dict[str, Any] | None = None
                 ) -> TransferCost:
    """Measure ``transport``'s cost of writing to ``peer_session``.

    Args:
        transport: an open transport of the engine to measure, ``src_region`` registered.
        peer_session: the peer to write to (a NIXL peer already added).
        src_region, dst_region: ``(addr, size)`` of registered memory here and at the peer,
            each at least :func:`loopback_bytes` bytes; ``dst_region`` is overwritten.
        copy_bytes_per_s: the local copy bandwidth if already known (default: measured with
            :func:`measure_copy_bandwidth`).
        small_blocks, small_block, large_blocks, large_block: the two timed transfers.
        repeats: timed repeats of each (medians are used).
        submit_kwargs: extra keywords for ``transport.submit``.

    Returns:
        The measured :class:`kvplan.TransferCost`.

    Raises:
        ValueError: a region is missing or too small, or a size is not positive.
        TransferError: the engine failed a transfer.
    """
    if min(small_blocks, small_block, large_blocks, large_block, repeats) <= 0:
        raise ValueError("block counts, block sizes and repeats must be positive")
    need = loopback_bytes(small_blocks, small_block, large_blocks, large_block)
    src_addr, _ = _check_region("src_region", src_region, need)
    dst_addr, _ = _check_region("dst_region", dst_region, need)
    kwargs = submit_kwargs or {}

    def blocks(n: int, length: int, step: int) -> BlockSlice:
        offsets = np.arange(n, dtype=np.uint64) * np.uint64(step)
        return BlockSlice(offsets + np.uint64(src_addr), offsets + np.uint64(dst_addr),
                         np.full(n, length, np.uint64))

    small = blocks(small_blocks, small_block, 2 * small_block)
    large = blocks(large_blocks, large_block, large_block)
    t_small = _median_seconds(lambda: transport.submit(small, peer_session, **kwargs), repeats)
    t_large = _median_seconds(lambda: transport.submit(large, peer_session, **kwargs), repeats)
    per_block_s, bytes_per_s = solve_block_model(
        (small_blocks, small_blocks * small_block, t_small),
        (large_blocks, large_blocks * large_block, t_large))
    if copy_bytes_per_s is None:
        copy_bytes_per_s = measure_copy_bandwidth(repeats=repeats)
    return TransferCost(per_block_s=per_block_s, network_bytes_per_s=bytes_per_s,
                        copy_bytes_per_s=copy_bytes_per_s)


def solve_block_model(small: tuple[int, int, float], large: tuple[int, int, float]
                      ) -> tuple[float, float]:
    """``(per_block_s, bytes_per_s)`` from two timed transfers ``(blocks, bytes, seconds)``
    of ``seconds = blocks × per_block_s + bytes / bytes_per_s``.

    Timing noise can make the exact solution non-positive (the small transfer's bytes are a
    rounding error of the large one's); then the large transfer gives the bandwidth alone and
    the small one's remaining time the per-block cost, never below a nanosecond."""
    (n_s, b_s, t_s), (n_l, b_l, t_l) = small, large
    det = n_s * b_l - n_l * b_s
    if det != 0:
        per_block = (t_s * b_l - t_l * b_s) / det
        inverse_bw = (n_s * t_l - n_l * t_s) / det
        if per_block > 0 and inverse_bw > 0:
            return per_block, 1.0 / inverse_bw
    bytes_per_s = b_l / max(t_l, 1e-9)
    per_block = max((t_s - b_s / bytes_per_s) / n_s, 1e-9)
    return per_block, bytes_per_s


def measure_loopback(engine: str = "mooncake", *, repeats: int = REPEATS,
                     copy_bytes_per_s: float | None = None, small_blocks: int = SMALL_BLOCKS,
                     small_block: int = SMALL_BLOCK, large_blocks: int = LARGE_BLOCKS,
                     large_block: int = LARGE_BLOCK) -> TransferCost:
    """:func:`measure_cost` between two transports of ``engine`` (``"mooncake"``: TCP on
    127.0.0.1; ``"nixl"``: UCX) in this process, each with its own host buffer; both are
    closed before returning. The other arguments are :func:`measure_cost`'s.

    Raises:
        ValueError: an unknown engine.
        ImportError: the engine's package is missing.
        TransferError: the engine failed to start or to transfer.
    """
    need = loopback_bytes(small_blocks, small_block, large_blocks, large_block)
    src = np.random.default_rng(1).integers(0, 256, need, dtype=np.uint8)
    dst = np.zeros(need, np.uint8)
    sender, receiver = loopback_transports(engine)
    try:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        receiver.register_buffers([dst.ctypes.data], [dst.nbytes])
        peer = receiver.local_session_id()
        if engine == "nixl":
            peer = sender.add_peer(receiver.metadata())  # type: ignore[attr-defined]
        return measure_cost(sender, peer, src_region=(src.ctypes.data, src.nbytes),
                            dst_region=(dst.ctypes.data, dst.nbytes),
                            copy_bytes_per_s=copy_bytes_per_s, repeats=repeats,
                            small_blocks=small_blocks, small_block=small_block,
                            large_blocks=large_blocks, large_block=large_block)
    finally:
        sender.close()
        receiver.close()


def loopback_transports(engine: str) -> tuple[Transport, Transport]:
    """Two open transports of ``engine`` in this process (``"mooncake"``: TCP on 127.0.0.1;
    ``"nixl"``: UCX agents): a sender and a receiver, nothing registered yet. The caller
    closes both."""
    if engine == "mooncake":
        from kvplan.engines.mooncake import MooncakeTransport

        first = MooncakeTransport("127.0.0.1")
        try:
            return first, MooncakeTransport("127.0.0.1")
        except BaseException:
            first.close()
            raise
    if engine == "nixl":
        from kvplan.engines.nixl import NixlTransport

        first_nixl = NixlTransport()
        try:
            return first_nixl, NixlTransport()
        except BaseException:
            first_nixl.close()
            raise
    raise ValueError(f"unknown engine {engine!r}; choose from ['mooncake', 'nixl']")
