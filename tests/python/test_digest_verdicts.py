"""The decode's checks give every request its own verdict, and verify delta plans.

``check_batch``: a request the decode cannot plan (pages out of range, a negative page, page
lists of unequal lengths, a malformed request) is refused on its own; every other request is
still checked. ``check_notification`` / ``Transport.check_landed``: a delta plan
(``plan(..., skip_tokens=K)``) verifies when the decode re-plans it with the same K, and fails
with any other K."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.engines._base import Transport
from kvplan.integrity import (
    IntegrityError,
    build_batch_manifests,
    build_manifest,
    check_batch,
    check_notification,
    pack_notification,
)
from kvplan.testing.oracle import Memory, apply_plan, array_pool

PAGES = 32
LAYERS = 2
ITEM = 64


def pool(array: np.ndarray) -> kvplan.Layout:
    return array_pool(array, LAYERS, ITEM)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.fixture
def landed() -> tuple[np.ndarray, np.ndarray, kvplan.Template, list[Any], list[Any]]:
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    t = kvplan.Template(pool(src), pool(dst))
    reqs = [(i64(1, 2), i64(10, 11)), (i64(5), i64(12)), (i64(20, 7), i64(2, 5)),
            (i64(0), i64(30))]
    batch = t.plan_batch(reqs, digests=True)
    apply_plan(batch, Memory.of(src), Memory.of(dst))
    sent = build_batch_manifests(batch, t, reqs, "src", [src])
    return src, dst, t, reqs, sent


BAD_REQUESTS = {
    "src page out of range": (i64(PAGES + 3), i64(12)),
    "dst page out of range": (i64(5), i64(PAGES)),
    "negative page": (i64(-1), i64(12)),
    "unequal lengths": (i64(5, 6), i64(12)),
    "float pages": (np.array([5.0]), i64(12)),
    "not a tuple": [i64(5), i64(12)],
    "four fields": (i64(5), i64(12), None, None),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_request_the_decode_cannot_plan_is_refused_alone(landed, case: str) -> None:  # type: ignore[no-untyped-def]
    src, dst, t, reqs, sent = landed
    asked = list(reqs)
    asked[1] = BAD_REQUESTS[case]
    verdict = check_batch(pack_notification(sent), src_layout=pool(src), dst_layout=pool(dst),
                          buffers=[dst], requests=asked, template=t)
    assert verdict.failed_requests == [1]
    assert verdict.verified_requests == [0, 2, 3]
    error = verdict.errors[1]
    assert isinstance(error, IntegrityError) and error.what == "request"
    assert error.requests == (1,)
    assert str(error).startswith("integrity check failed for ") and \
        "request 1: the decode cannot plan it: " in str(error)
    assert error.__cause__ is not None
    assert verdict.manifests[1] is None
    assert all(verdict.manifests[r] is not None for r in (0, 2, 3))


def test_several_bad_requests_each_get_their_verdict(landed) -> None:  # type: ignore[no-untyped-def]
    src, dst, t, reqs, sent = landed
    asked = [(i64(-4), i64(10, 11)), reqs[1], (i64(20, 7), i64(2)), reqs[3]]
    verdict = check_batch(sent, src_layout=pool(src), dst_layout=pool(dst), buffers=[dst],
                          requests=asked, template=t)
    assert verdict.failed_requests == [0, 2] and verdict.verified_requests == [1, 3]


def delta_case(k: int) -> tuple[np.ndarray, np.ndarray, dict[str, object],
                                kvplan.TransferPlan]:
    """A token request of 14 tokens over 4-token pages whose first ``k`` tokens the decode
    holds already: the delta plan applied, and the keywords its check takes."""
    rng = np.random.default_rng(100 + k)
    src = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    s_layout = kvplan.Layout.cross_layer(src.ctypes.data, src.nbytes, list(range(LAYERS)), ITEM,
                                         page_size=4)
    d_layout = kvplan.Layout.cross_layer(dst.ctypes.data, dst.nbytes, list(range(LAYERS)), ITEM,
                                         page_size=4)
    t = kvplan.Template(s_layout, d_layout)
    sp, dp, n = i64(3, 4, 5, 6), i64(1, 2, 7, 8), 14
    plan = t.plan(sp, dp, n_tokens=n, skip_tokens=k)
    apply_plan(plan, Memory.of(src), Memory.of(dst))
    kw: dict[str, object] = dict(src_layout=s_layout, dst_layout=d_layout, buffers=[dst],
                                 src_pages=sp, dst_pages=dp, n_tokens=n, template=t)
    return src, dst, kw, plan


@pytest.mark.parametrize("k", [1, 4, 9, 13])
def test_a_correct_delta_plan_verifies_and_a_wrong_skip_fails(k: int) -> None:
    src, _, kw, plan = delta_case(k)
    assert plan.skip_tokens == k
    manifest = build_manifest(plan, "src", [src], src_pages=kw["src_pages"],  # type: ignore[arg-type]
                              dst_pages=kw["dst_pages"])  # type: ignore[arg-type]
    payload = pack_notification([manifest])
    mine = check_notification(payload, skip_tokens=k, **kw)  # type: ignore[arg-type]
    assert mine[0].plan_digest == manifest.plan_digest
    for wrong in sorted({0, k - 1, k + 1} - {k}):
        with pytest.raises(IntegrityError) as e:
            check_notification(payload, skip_tokens=wrong, **kw)  # type: ignore[arg-type]
        assert e.value.what in ("plan", "blocks")


def test_check_landed_verifies_a_delta_plan() -> None:
    k = 6
    src, _, kw, plan = delta_case(k)
    manifest = build_manifest(plan, "src", [src], src_pages=kw["src_pages"],  # type: ignore[arg-type]
                              dst_pages=kw["dst_pages"])  # type: ignore[arg-type]
    # check_landed reads only the buffers given (no engine needed).
    decode = Transport()
    decode.check_landed([manifest], skip_tokens=k, **kw)  # type: ignore[arg-type]
    with pytest.raises(IntegrityError):
        decode.check_landed([manifest], **kw)  # type: ignore[arg-type]
