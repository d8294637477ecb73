"""A failed engine call inside a segment of fused requests blames exactly the requests with bytes
in that call: ``BatchPlan.requests_in`` against an independent definition (a request has bytes
in a call when one of the call's blocks overlaps a destination byte range of the request's own
plan), over templates with per-run pieces, per-page pieces and both; and ``submit_batch``'s
outcome against the same definition when one call fails."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

import kvplan
from support.recording_transport import RecordingTransport

PAGES = 512
ITEM = 64
SRC_BASE, DST_BASE = 1 << 32, 1 << 36


def layout(base: int, strides: list[int]) -> kvplan.Layout:
    n = len(strides)
    return kvplan.Layout([base + (k << 24) for k in range(n)], [PAGES * s for s in strides],
                         [ITEM] * n, list(range(n)), ["kv"] * n, strides=strides)


TEMPLATES = {
    "per-run": [ITEM, ITEM, ITEM],
    "per-page": [2 * ITEM, 3 * ITEM],
    "mixed": [ITEM, 2 * ITEM, ITEM, 4 * ITEM],
}


def template(kind: str) -> kvplan.Template:
    return kvplan.Template(layout(SRC_BASE, TEMPLATES[kind]), layout(DST_BASE, TEMPLATES[kind]))


def chained_requests(rng: np.random.Generator, n: int) -> list[tuple[npt.NDArray[np.int64],
                                                                     npt.NDArray[np.int64]]]:
    """``n`` requests, most continuing the previous one on both sides (so they fuse), each of a
    few runs; destination pages never repeat."""
    src_at, dst_at = 0, 0
    out = []
    for _ in range(n):
        if rng.random() < 0.2:  # a gap: a new segment starts
            src_at += int(rng.integers(1, 4))
            dst_at += int(rng.integers(1, 4))
        s, d = [], []
        for run in range(int(rng.integers(1, 4))):
            if run:
                src_at += int(rng.integers(1, 3))
                dst_at += int(rng.integers(1, 3))
            for _ in range(int(rng.integers(1, 4))):
                s.append(src_at)
                d.append(dst_at)
                src_at += 1
                dst_at += 1
        # The next request starts right after this one's last pair (the fusing step).
        out.append((np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)))
    assert src_at < PAGES and dst_at < PAGES
    return out


Held = Callable[[npt.NDArray[np.uint64], npt.NDArray[np.uint64]], set[int]]


def owners_oracle(t: kvplan.Template,
                  requests: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]) -> Held:
    """A function of ``(dst, lengths)`` block arrays giving the set of requests with a
    destination byte in them, from each request's own plan."""
    spans = []
    for r, (s, d) in enumerate(requests):
        plan = t.plan(s, d)
        _, dst, lengths = plan.as_lists()
        spans += [(a, a + n, r) for a, n in zip(dst, lengths, strict=True) if n]
    spans.sort()
    starts = np.array([a for a, _, _ in spans], dtype=np.uint64)
    ends = np.array([b for _, b, _ in spans], dtype=np.uint64)
    owner = np.array([r for _, _, r in spans], dtype=np.int64)
    assert (starts[1:] >= ends[:-1]).all(), "requests write disjoint bytes"

    def held(dst: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]) -> set[int]:
        found: set[int] = set()
        for a, n in zip(dst.tolist(), lengths.tolist(), strict=True):
            lo = int(np.searchsorted(ends, a, side="right"))
            hi = int(np.searchsorted(starts, a + n, side="left"))
            found.update(owner[lo:hi].tolist())
        return found

    return held


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_requests_in_names_exactly_the_requests_with_bytes_in_the_blocks(kind: str) -> None:
    rng = np.random.default_rng(sorted(TEMPLATES).index(kind) + 3)
    t = template(kind)
    checked = fused_calls = 0
    for _ in range(12):
        reqs = chained_requests(rng, int(rng.integers(2, 12)))
        batch = t.plan_batch(reqs)
        assert batch.n_segments < batch.n_requests  # some requests fused
        held = owners_oracle(t, reqs)
        dst, lengths = batch.dst_addrs, batch.lengths
        for bound in (1, 2, 3, 5, 8):
            for lo, hi in batch.call_ranges(bound).tolist():
                want = sorted(held(dst[lo:hi], lengths[lo:hi]))
                got = batch.requests_in(lo, hi).tolist()
                assert got == want, (kind, bound, lo, hi, got, want)
                checked += 1
                segments = set(batch.request_segments[want].tolist()) if want else set()
                fused_calls += any(
                    np.diff(batch.segment_requests)[s] > 1 for s in segments)
        # Any block range, not only call ranges.
        for _ in range(20):
            lo = int(rng.integers(0, batch.n_blocks))
            hi = int(rng.integers(lo + 1, batch.n_blocks + 1))
            assert batch.requests_in(lo, hi).tolist() == sorted(held(dst[lo:hi], lengths[lo:hi]))
    assert checked > 100 and fused_calls > 20


def test_submit_batch_fails_exactly_the_requests_with_bytes_in_the_failed_call() -> None:
    rng = np.random.default_rng(17)
    t = template("mixed")
    for _ in range(10):
        reqs = chained_requests(rng, 8)
        batch = t.plan_batch(reqs)
        held = owners_oracle(t, reqs)
        dst, lengths = batch.dst_addrs, batch.lengths
        calls = batch.call_ranges(3).tolist()
        lo, hi = calls[int(rng.integers(0, len(calls)))]
        outcome = RecordingTransport(fail_at=lo).submit_batch(batch, "peer", max_blocks_per_batch=3,
                                               check_sources=False)
        assert outcome.failed_requests == sorted(held(dst[lo:hi], lengths[lo:hi]))
