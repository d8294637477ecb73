"""Leases in batch plans: each request's digest in a batch is bound to its own lease by the
rule a plan alone uses (``TransferPlan.digest(lease=)``), and the decode's batch check refuses
a stale epoch, or an epoch that goes backwards, for exactly the request it concerns."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvplan
from kvplan import Lease, LeaseError, LeaseTable, StaleLeaseError
from kvplan.integrity import (
    IntegrityError,
    build_batch_manifests,
    check_batch,
    pack_notification,
)
from kvplan.testing.oracle import Memory, apply_plan, array_pool

PAGES = 32
LAYERS = 2
ITEM = 64


def pool(array: np.ndarray) -> kvplan.Layout:
    return array_pool(array, LAYERS, ITEM)


def batch_requests() -> list[tuple[np.ndarray, np.ndarray]]:
    """Six requests on disjoint decode pages; requests 1 and 5 continue the request before them
    on both sides, so the batch fuses them into segments with their neighbours."""
    pairs = [
        ([3, 4], [10, 11]),
        ([5], [12]),
        ([20, 7], [2, 5]),
        ([0], [30]),
        ([8, 9, 10], [20, 21, 22]),
        ([11], [23]),
    ]
    return [(np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)) for s, d in pairs]


@pytest.fixture
def setup() -> tuple[np.ndarray, np.ndarray, kvplan.Template, list[tuple[np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(21)
    src = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    return src, dst, kvplan.Template(pool(src), pool(dst)), batch_requests()


def test_each_request_digest_is_bound_to_its_own_lease_as_a_plan_alone(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, t, reqs = setup
    leases = [Lease(10 + r, f"req-{r}") if r != 4 else None for r in range(len(reqs))]
    batch = t.plan_batch(reqs, leases=leases)
    assert batch.n_segments == 4  # two fused pairs: digests are still those of each alone
    assert batch.request_leases == leases
    unleased = t.plan_batch(reqs, digests=True)
    assert unleased.request_leases is None
    for r, (s, d) in enumerate(reqs):
        alone = t.plan(s, d)
        assert int(batch.request_digests[r]) == alone.digest(lease=leases[r])
        assert int(unleased.request_digests[r]) == alone.digest()
    # The flat form binds the same digests.
    offsets = np.concatenate([[0], np.cumsum([len(s) for s, _ in reqs])]).astype(np.int64)
    flat = t.plan_batch_flat(
        np.concatenate([s for s, _ in reqs]),
        np.concatenate([d for _, d in reqs]),
        offsets,
        leases=leases,
    )
    assert flat.request_digests.tolist() == batch.request_digests.tolist()
    with pytest.raises(kvplan.KvPlanError, match="leases has 2 values for 6 requests"):
        t.plan_batch(reqs, leases=leases[:2])
    with pytest.raises(kvplan.KvPlanError, match="request 1: .*request id must be str or bytes"):
        t.plan_batch(reqs, leases=[None, SimpleNamespace(epoch=1, request=5), *leases[2:]])
    with pytest.raises(TypeError, match="leases must be a sequence"):
        t.plan_batch(reqs, leases=7)  # type: ignore[arg-type]


def test_a_stale_lease_is_refused_for_exactly_its_request(setup) -> None:  # type: ignore[no-untyped-def]
    src, dst, t, reqs = setup
    table = LeaseTable(PAGES)
    ids = [f"req-{r}" for r in range(len(reqs))]
    granted = [table.grant(ids[r], d) for r, (_, d) in enumerate(reqs)]
    # The prefill plans with the leases the decode sent it.
    batch = t.plan_batch(reqs, leases=granted)
    # Meanwhile the decode aborted request 2 and granted its pages to it again (a retry).
    table.abort(granted[2])
    table.settle(granted[2])
    regranted = table.grant(ids[2], reqs[2][1])
    assert regranted.epoch > granted[2].epoch
    apply_plan(batch, Memory.of(src), Memory.of(dst))
    sent = build_batch_manifests(batch, t, reqs, "src", [src])
    payload = pack_notification(sent, b"batch-1")
    kw = dict(src_layout=pool(src), dst_layout=pool(dst), buffers=[dst], requests=reqs, template=t)
    current = [table.live(i) for i in ids]
    verdict = check_batch(payload, leases=current, table=table, **kw)  # type: ignore[arg-type]
    assert verdict.failed_requests == [2]
    assert verdict.verified_requests == [0, 1, 3, 4, 5]
    error = verdict.errors[2]
    assert isinstance(error, StaleLeaseError) and error.requests == (2,)
    assert error.reason == "superseded"
    assert (error.lease, error.current) == (granted[2], regranted)
    assert f"request 'req-2' was planned for epoch {granted[2].epoch}" in str(error)
    assert f"held under epoch {regranted.epoch} now" in str(error)
    assert verdict.manifests[2] is None and all(
        verdict.manifests[r] is not None for r in verdict.verified_requests
    )
    # The table alone (no expected leases) refuses it too, naming both epochs.
    by_table = check_batch(sent, table=table, **kw)  # type: ignore[arg-type]
    assert by_table.failed_requests == [2]
    assert isinstance(by_table.errors[2], StaleLeaseError)
    assert f"holds epoch {regranted.epoch} now" in str(by_table.errors[2])


def test_an_epoch_going_backwards_and_other_faults_fail_only_their_request(setup) -> None:  # type: ignore[no-untyped-def]
    src, dst, t, reqs = setup
    leases = [Lease(5 + r, f"req-{r}") for r in range(len(reqs))]
    batch = t.plan_batch(reqs, leases=leases)
    apply_plan(batch, Memory.of(src), Memory.of(dst))
    sent = build_batch_manifests(batch, t, reqs, "src", [src])
    expected: list[Lease | None] = list(leases)
    expected[3] = Lease(leases[3].epoch - 2, "req-3")  # the decode's record went backwards
    expected[1] = Lease(leases[1].epoch, "req-other")  # another request's pages
    dst[reqs[5][1][0] * LAYERS * ITEM] ^= 0xFF  # one byte of request 5 never landed right
    verdict = check_batch(
        sent,
        src_layout=pool(src),
        dst_layout=pool(dst),
        buffers=[dst],
        requests=reqs,
        leases=expected,
        template=t,
    )
    assert verdict.failed_requests == [1, 3, 5]
    backwards = verdict.errors[3]
    assert type(backwards) is LeaseError
    assert "epoch goes backwards for request 'req-3'" in str(backwards)
    assert (
        f"epoch {leases[3].epoch}, newer than the decode's lease epoch "
        f"{leases[3].epoch - 2}" in str(backwards)
    )
    assert "leased to request 'req-other'" in str(verdict.errors[1])
    content = verdict.errors[5]
    assert isinstance(content, IntegrityError) and content.what == "content"
    # A manifest count that is not the batch's cannot be attributed: the whole batch is refused.
    with pytest.raises(IntegrityError, match="5 manifests for a batch of 6 requests"):
        check_batch(
            sent[:5],
            src_layout=pool(src),
            dst_layout=pool(dst),
            buffers=[dst],
            requests=reqs,
            template=t,
        )
    with pytest.raises(kvplan.KvPlanError, match="pass the requests the batch was planned from"):
        build_batch_manifests(batch, t, [reqs[1], reqs[0], *reqs[2:]], "src", [src])
