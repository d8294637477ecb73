"""Batch plans over the real engines (Mooncake TCP, NIXL UCX; two transports in this process
on loopback): ``Transport.submit_batch`` moves every request's bytes in bounded calls, and an
engine call that fails in the middle of a batch (its blocks reach decode memory that is not
registered) fails exactly the requests it held: every other request lands byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.engines.measure import loopback_transports
from kvplan.testing.oracle import Memory, reference_copy
from support.engine_peers import Engine

PAGES = 64
LAYERS = 4
ITEM = 256


def pool(array: np.ndarray) -> kvplan.Layout:
    """A cross-layer pool: page ``p`` holds every layer's item, bytes ``p × stride ..``."""
    return kvplan.Layout.cross_layer(int(array.ctypes.data), array.nbytes, list(range(LAYERS)),
                                     ITEM)


def requests(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` requests of 1–3 pages with disjoint decode pages over the whole pool."""
    dst_free = rng.permutation(PAGES)
    out, at = [], 0
    for _ in range(n):
        k = int(rng.integers(1, 4))
        dst = np.sort(dst_free[at:at + k]).astype(np.int64)
        at += k
        src = rng.choice(PAGES, size=k, replace=False).astype(np.int64)
        out.append((src, dst))
    return out


@pytest.mark.parametrize("case", range(2))
def test_a_failed_call_fails_exactly_the_requests_it_held(engine: Engine, case: int) -> None:
    rng = np.random.default_rng(case)
    src = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    t = kvplan.Template(pool(src), pool(dst))
    batch_requests = requests(rng, 14)
    batch = t.plan_batch(batch_requests)
    sender, receiver = loopback_transports(engine.name)
    try:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        # The decode registers only its first half of pages: calls into the other half fail.
        half = PAGES // 2
        receiver.register_buffers([dst.ctypes.data], [half * LAYERS * ITEM])
        peer = receiver.local_session_id()
        if engine.name == "nixl":
            peer = sender.add_peer(receiver.metadata())  # type: ignore[attr-defined]
        outcome = sender.submit_batch(batch, peer, max_blocks_per_batch=3)
    finally:
        sender.close()
        receiver.close()
    calls = batch.call_ranges(3).tolist()
    bad = {r for r, (_, d) in enumerate(batch_requests) if d.max() >= half}
    assert bad, "the draw reaches the unregistered half"
    # A call fails exactly when it holds a request with a page in the unregistered half.
    want_failed: set[int] = set()
    for lo, hi in calls:
        held = set(batch.requests_in(lo, hi).tolist())
        if held & bad:
            want_failed |= held
    assert set(outcome.failed_requests) == want_failed
    assert {r for e in outcome.errors for r in (e.requests or [])} == want_failed
    assert all(isinstance(e, kvplan.TransferError) and e.batch is not None
               for e in outcome.errors)
    assert len(want_failed) < batch.n_requests, "some requests share no call with a bad one"
    # Every request that did not fail landed byte for byte.
    src_mem, want = Memory.of(src), Memory.of(dst).copy()
    for r, (s_pages, d_pages) in enumerate(batch_requests):
        if r not in want_failed:
            reference_copy(pool(src), src_mem, pool(dst), want, s_pages, d_pages)
    for r, (_, d_pages) in enumerate(batch_requests):
        if r in want_failed:
            continue
        for p in d_pages.tolist():
            span = slice(p * LAYERS * ITEM, (p + 1) * LAYERS * ITEM)
            assert np.array_equal(dst[span], want.data[span]), (r, p)


def test_a_batch_lands_every_request(engine: Engine) -> None:
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    t = kvplan.Template(pool(src), pool(dst))
    batch_requests = requests(rng, 20)
    batch = t.plan_batch(batch_requests)
    sender, receiver = loopback_transports(engine.name)
    try:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        receiver.register_buffers([dst.ctypes.data], [dst.nbytes])
        peer = receiver.local_session_id()
        if engine.name == "nixl":
            peer = sender.add_peer(receiver.metadata())  # type: ignore[attr-defined]
        outcome = sender.submit_batch(batch, peer, max_blocks_per_batch=4)
    finally:
        sender.close()
        receiver.close()
    assert outcome.ok and outcome.failed_requests == [] and outcome.errors == ()
    assert (outcome.blocks, outcome.bytes) == (batch.n_blocks, batch.total_bytes)
    assert outcome.calls == len(batch.call_ranges(4))
    want = Memory.of(dst).copy()
    want.data[:] = 0
    for s_pages, d_pages in batch_requests:
        reference_copy(pool(src), Memory.of(src), pool(dst), want, s_pages, d_pages)
    assert np.array_equal(dst, want.data)
