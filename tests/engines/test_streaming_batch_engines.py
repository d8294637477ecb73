"""Layer-wise streaming of a batch plan over the real engines (Mooncake TCP, NIXL UCX; two
transports in this process on loopback): ``StreamingSubmitter.open_batch`` opens every request
of the batch at once, sends each ready layer slice in bounded engine calls covering all of them,
and reports per request. With a hole of unregistered decode pages in the middle of the pool, the
calls into it fail: exactly the requests those calls held fail, every other request lands byte
for byte and is done, and the decode's batch check verifies each of them from the final
notification."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.engines import StreamingSubmitter
from kvplan.engines.measure import loopback_transports
from kvplan.integrity import build_batch_manifests, check_batch, unpack_notification
from kvplan.testing.oracle import Memory, array_pool, reference_copy
from support.engine_peers import Engine

PAGES = 64
LAYERS = 6
ITEM = 128
MAX_BLOCKS = 5


def pool(array: np.ndarray) -> kvplan.Layout:
    """A cross-layer pool: page ``p`` holds every layer's item."""
    return array_pool(array, LAYERS, ITEM)


def batch_requests(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` requests of 1-3 pages on disjoint decode pages; every third continues the one
    before it on both sides (a fused segment) when the pages are free."""
    free = [int(p) for p in rng.permutation(PAGES)]
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for r in range(n):
        k = int(rng.integers(1, 4))
        if r % 3 == 2 and out:
            s0, d0 = int(out[-1][0][-1]) + 1, int(out[-1][1][-1]) + 1
            want = list(range(d0, d0 + k))
            if s0 + k <= PAGES and all(p in free for p in want):
                for p in want:
                    free.remove(p)
                out.append((np.arange(s0, s0 + k, dtype=np.int64), np.array(want, dtype=np.int64)))
                continue
        dst = sorted(free[:k])
        del free[:k]
        out.append(
            (
                rng.choice(PAGES, size=k, replace=False).astype(np.int64),
                np.array(dst, dtype=np.int64),
            )
        )
    return out


@pytest.mark.parametrize("hole", [False, True], ids=["all-land", "failed-call-mid-batch"])
def test_a_streamed_batch_reports_each_request(engine: Engine, hole: bool) -> None:
    rng = np.random.default_rng(31 + hole)
    src = rng.integers(1, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    groups = kvplan.LayerGroups.fixed(2)
    t = kvplan.Template(pool(src), pool(dst), layer_groups=groups)
    slices = t.layer_slices(groups)
    reqs = batch_requests(rng, 16)
    batch = t.plan_batch(reqs)
    assert batch.n_segments < batch.n_requests, "the draw fuses some requests"
    lo, hi = (PAGES // 2 - 3, PAGES // 2 + 3) if hole else (PAGES, PAGES)
    regions = [(a, b) for a, b in ((0, lo), (hi, PAGES)) if b > a]
    bad = {r for r, (_, d) in enumerate(reqs) if ((d >= lo) & (d < hi)).any()}
    assert bool(bad) == hole
    sender, receiver = loopback_transports(engine.name)
    try:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        receiver.register_buffers(
            [dst.ctypes.data + a * LAYERS * ITEM for a, _ in regions],
            [(b - a) * LAYERS * ITEM for a, b in regions],
        )
        peer = receiver.local_session_id()
        if engine.name == "nixl":
            peer = sender.add_peer(receiver.metadata())  # type: ignore[attr-defined]
        with StreamingSubmitter(
            sender, slices, min_stream_bytes=0, max_blocks_per_batch=MAX_BLOCKS, timeout=10.0
        ) as streamer:
            streamed = streamer.open_batch("batch-7", batch, peer)
            for layer in rng.permutation(LAYERS).tolist():
                streamed.ready(layer)
            streamed.seal(build_batch_manifests(batch, t, reqs, "src", [src]))
            outcome = streamed.wait(timeout=120)
        if engine.name == "nixl":
            prefill = sender.local_session_id()
            sent = receiver.wait_manifests(prefill, b"batch-7")  # type: ignore[attr-defined]
        else:  # Mooncake: the final notification goes through the caller's side channel
            sent = unpack_notification(outcome.notification)
    finally:
        sender.close()
        receiver.close()
    failed = set(outcome.failed_requests)
    # Every call into the hole failed, and each error names exactly the requests it held:
    # whole segments (a fused request never lands without its partners).
    assert bad <= failed
    assert failed == {r for e in outcome.errors for r in (e.requests or [])}
    segments = batch.request_segments
    for e in outcome.errors:
        held = set(e.requests or [])
        assert held == {r for r in range(batch.n_requests) if segments[r] in segments[list(held)]}
        assert e.slice is not None and (e.blocks or 0) <= MAX_BLOCKS
    if engine.name == "nixl":
        # NIXL refuses a call into unregistered memory: only calls holding a bad request fail.
        assert all(held & bad for held in (set(e.requests or []) for e in outcome.errors))
    # (Mooncake TCP: a call in flight beside a rejected one may time out as well; it then
    # fails whole, in its own error.)
    assert len(failed) < batch.n_requests, "requests sharing no call with a bad one land"
    # A slice per layer group went out before the seal, in bounded calls covering the batch.
    assert outcome.streamed and outcome.slices == slices.n_slices
    assert outcome.calls >= slices.n_slices
    assert outcome.done.tolist() == [r not in failed for r in range(batch.n_requests)]
    assert np.isnan(outcome.done_seconds[list(failed)]).all()
    assert (outcome.done_seconds[[r for r in range(batch.n_requests) if r not in failed]] > 0).all()
    if not hole:
        assert outcome.ok and (outcome.blocks, outcome.bytes) == (batch.n_blocks, batch.total_bytes)
    # Every request not failed landed byte for byte, and the decode verifies exactly those.
    want = Memory.of(dst).copy()
    for r, (s_pages, d_pages) in enumerate(reqs):
        if r not in failed:
            reference_copy(pool(src), Memory.of(src), pool(dst), want, s_pages, d_pages)
            for p in d_pages.tolist():
                span = slice(p * LAYERS * ITEM, (p + 1) * LAYERS * ITEM)
                assert np.array_equal(dst[span], want.data[span]), (r, p)
    verdict = check_batch(
        sent, src_layout=pool(src), dst_layout=pool(dst), buffers=[dst], requests=reqs, template=t
    )
    verified = set(verdict.verified_requests)
    assert set(range(batch.n_requests)) - failed <= verified
    assert not bad & verified, "a request whose pages are in the hole never verifies"
    if engine.name == "nixl":
        assert verified == set(range(batch.n_requests)) - failed
    # (Mooncake TCP: a call failed beside a rejected one may still have moved its bytes; its
    # requests are reported failed all the same, never counted as landed by the prefill.)
