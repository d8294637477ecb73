"""Batch plans over the real engines (Mooncake TCP, NIXL UCX; two transports in this process
on loopback): ``Transport.submit_batch`` moves every request's bytes in bounded calls, and an
engine call that fails in the middle of a batch (its blocks reach decode memory that is not
registered) fails exactly the requests it held: every other request lands byte for byte. Over
NIXL only the calls into unregistered memory fail; over Mooncake TCP a call in flight beside a
rejected one may time out too under load, and then fails whole, named in its own error."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.engines.measure import loopback_transports
from kvplan.testing.oracle import Memory, array_pool, reference_copy
from support.engine_peers import Engine

PAGES = 64
LAYERS = 4
ITEM = 256


def pool(array: np.ndarray) -> kvplan.Layout:
    """A cross-layer pool: page ``p`` holds every layer's item."""
    return array_pool(array, LAYERS, ITEM)


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
    # Every call holding a request with a page in the unregistered half fails.
    want_failed: set[int] = set()
    for lo, hi in calls:
        held = set(batch.requests_in(lo, hi).tolist())
        if held & bad:
            want_failed |= held
    failed = set(outcome.failed_requests)
    assert want_failed <= failed
    # Each error names exactly the requests its own call held, and nothing else is failed.
    assert all(isinstance(e, kvplan.TransferError) and e.batch is not None
               for e in outcome.errors)
    for e in outcome.errors:
        assert set(e.requests or []) == set(batch.requests_in(*calls[e.batch]).tolist())
    assert {r for e in outcome.errors for r in (e.requests or [])} == failed
    if engine.name == "nixl":
        # NIXL refuses a call into unregistered memory when it is created: nothing else fails.
        assert failed == want_failed
    # (Mooncake TCP: a call in flight beside one the decode rejected can time out as well
    # under load; it then fails whole, in its own error, and its requests are not landed.)
    assert len(want_failed) < batch.n_requests, "some requests share no call with a bad one"
    # Every request that did not fail landed byte for byte.
    src_mem, want = Memory.of(src), Memory.of(dst).copy()
    for r, (s_pages, d_pages) in enumerate(batch_requests):
        if r not in failed:
            reference_copy(pool(src), src_mem, pool(dst), want, s_pages, d_pages)
    for r, (_, d_pages) in enumerate(batch_requests):
        if r in failed:
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


@pytest.mark.nixl
def test_failed_calls_in_batches_of_256_are_attributed_exactly_in_every_trial() -> None:
    """NIXL (its failed calls return at once): 256 requests per batch, a random hole of
    unregistered decode pages per trial; in every trial the failed requests are exactly those
    sharing a call with a request that writes into the hole, and every other request lands."""
    from support.engine_peers import require_nixl

    require_nixl()
    pages, item, n_requests = 640, 64, 256
    rng = np.random.default_rng(256)
    src = rng.integers(0, 256, pages * item, dtype=np.uint8)
    dst = np.zeros_like(src)

    def flat(array: np.ndarray) -> kvplan.Layout:
        return kvplan.Layout([int(array.ctypes.data)], [array.nbytes], item, [0], ["kv"])

    t = kvplan.Template(flat(src), flat(dst))
    for trial in range(12):
        dst[:] = 0
        order = rng.permutation(pages)
        batch_requests, at = [], 0
        for _ in range(n_requests):
            k = int(rng.integers(1, 3))
            d_pages = np.sort(order[at:at + k]).astype(np.int64)
            at += k
            batch_requests.append((rng.choice(pages, size=k, replace=False).astype(np.int64),
                                   d_pages))
        batch = t.plan_batch(batch_requests)
        lo = int(rng.integers(0, pages - 8))
        hole = set(range(lo, lo + int(rng.integers(1, 8))))
        regions = [(a, b) for a, b in ((0, lo), (max(hole) + 1, pages)) if b > a]
        cap = int(rng.integers(8, 64))
        # Fresh agents per trial: a peer's registrations are what its metadata said when added.
        sender, receiver = loopback_transports("nixl")
        try:
            sender.register_buffers([src.ctypes.data], [src.nbytes])
            receiver.register_buffers([dst.ctypes.data + a * item for a, _ in regions],
                                      [(b - a) * item for a, b in regions])
            peer = sender.add_peer(receiver.metadata())  # type: ignore[attr-defined]
            outcome = sender.submit_batch(batch, peer, max_blocks_per_batch=cap)
        finally:
            sender.close()
            receiver.close()
        bad = {r for r, (_, d) in enumerate(batch_requests) if hole & set(d.tolist())}
        want_failed: set[int] = set()
        for c_lo, c_hi in batch.call_ranges(cap).tolist():
            held = set(batch.requests_in(c_lo, c_hi).tolist())
            if held & bad:
                want_failed |= held
        assert bad and set(outcome.failed_requests) == want_failed, trial
        assert len(want_failed) < n_requests, trial
        for r, (s_pages, d_pages) in enumerate(batch_requests):
            if r in want_failed:
                continue
            for s, d in zip(s_pages.tolist(), d_pages.tolist()):
                assert np.array_equal(dst[d * item:(d + 1) * item],
                                      src[s * item:(s + 1) * item]), (trial, r)
