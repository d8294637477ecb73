"""Leases: the decode's table (grant, abort, fence, settle, release), leased plan digests and
manifests on the wire, the verifier refusing a stale writer, and the late-writer replay."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvplan
from kvplan import Lease, LeaseError, LeaseTable, StaleLeaseError
from kvplan.integrity import IntegrityError, Manifest, build_manifest, check_notification
from kvplan.testing.faults import replay_late_writers
from kvplan.testing.oracle import array_pool

PAGES = 16
LAYERS = 2
ITEM = 32


def pool(array: np.ndarray) -> kvplan.Layout:
    """A cross-layer pool: page ``p`` holds every layer's item."""
    return array_pool(array, LAYERS, ITEM)


def pages(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_epochs_increase_and_pages_are_held_by_one_live_lease() -> None:
    table = LeaseTable(PAGES)
    a = table.grant("a", pages(0, 1))
    b = table.grant("b", pages(2))
    assert (a.epoch, b.epoch) == (1, 2)
    assert table.holder(1) == a and table.holder(2) == b and table.holder(3) is None
    with pytest.raises(LeaseError, match=r"page 1 is held by request 'a' \(epoch 1\)"):
        table.grant("c", pages(3, 1))
    with pytest.raises(LeaseError, match="request 'a' holds lease epoch 1 already"):
        table.grant("a", pages(5))
    with pytest.raises(LeaseError, match="epoch 2 does not increase.*goes backwards"):
        table.grant("c", pages(5), epoch=2)
    assert table.grant("c", pages(5), epoch=10).epoch == 10
    assert table.grant("d", pages(6)).epoch == 11
    table.release(a)
    assert table.holder(0) is None and table.grant("e", pages(0, 1)).epoch == 12


@pytest.mark.parametrize("bad, message", [
    (pages(16), r"page 16 \(index 0\) outside this table's 16 pages"),
    (pages(3, -1), r"page -1 \(index 1\) outside"),
    (pages(2, 2), "pages repeat"),
    (np.zeros((2, 2), dtype=np.int64), "1-D integer array"),
    (np.zeros(2), "1-D integer array, got 1-D float64"),
])
def test_bad_pages_are_named(bad: np.ndarray, message: str) -> None:
    with pytest.raises(LeaseError, match=message):
        LeaseTable(PAGES).grant("a", bad)


def test_abort_fences_the_pages_until_the_writer_settles() -> None:
    table = LeaseTable(PAGES)
    a = table.grant("a", pages(0, 1, 2))
    table.abort(a)
    assert table.fence(pages(2, 9)) == (a,)
    assert table.fence(pages(9)) == ()
    with pytest.raises(LeaseError, match=r"writes for aborted leases may still land.*'a' \(epoch"
                                         r" 1\).*force=True"):
        table.grant("b", pages(2))
    # The aborted writer's completion is refused, and names nobody it overwrote.
    with pytest.raises(StaleLeaseError, match="stale lease: request 'a' epoch 1 was aborted") as e:
        table.check(a)
    assert e.value.reason == "aborted" and e.value.overwritten == () and e.value.lease == a
    assert table.settle(a) == ()
    assert table.fence(pages(0, 1, 2)) == ()
    table.grant("b", pages(2))


def test_a_forced_reuse_is_named_by_the_late_writers_completion() -> None:
    table = LeaseTable(PAGES)
    a = table.grant("a", pages(0, 1))
    table.abort(a)
    b = table.grant("b", pages(1, 5), force=True)
    c = table.grant("c", pages(7), force=True)  # no page of a: not a reuse of a's pages
    with pytest.raises(StaleLeaseError, match=r"held now by 'b' \(epoch 2\).*may be overwritten"):
        table.check(a)
    try:
        table.check(a)
    except StaleLeaseError as error:
        assert error.overwritten == (b,) and error.kind == "stale_lease"
    assert table.settle(a) == (b,)
    table.check(b)
    table.check(c)


def test_unknown_released_and_mismatched_leases_are_refused() -> None:
    table = LeaseTable(PAGES, history=1)
    a = table.grant("a", pages(0))
    with pytest.raises(LeaseError, match="epoch 5 .* was never granted: this table's last epoch "
                                         "is 1"):
        table.check(Lease(epoch=5, request="a"))
    with pytest.raises(StaleLeaseError, match="epoch 1 names request 'x', but that epoch was "
                                              "granted to 'a'"):
        table.check(Lease(epoch=1, request="x"))
    table.release(a)
    with pytest.raises(StaleLeaseError, match="was released") as e:
        table.check(a)
    assert e.value.reason == "released"
    with pytest.raises(LeaseError, match="is released, not aborted"):
        table.settle(a)
    b = table.grant("b", pages(0))
    table.release(b)  # history=1: a's record is forgotten, and still refused
    with pytest.raises(StaleLeaseError, match="no longer remembered") as e:
        table.check(a)
    assert e.value.reason == "unknown"


def test_leased_digest_binds_the_plan_to_one_allocation() -> None:
    src, dst = np.arange(PAGES * LAYERS * ITEM, dtype=np.uint8), np.zeros(PAGES * LAYERS * ITEM,
                                                                          dtype=np.uint8)
    plan = kvplan.Template(pool(src), pool(dst)).plan(pages(0, 1), pages(3, 4))
    a1, a2, b1 = Lease(1, "a"), Lease(2, "a"), Lease(1, "b")
    digests = {plan.digest(), plan.digest(lease=a1), plan.digest(lease=a2), plan.digest(lease=b1),
               plan.digest(lease=Lease(1, b"a"))}
    assert len(digests) == 4  # str and bytes ids with the same bytes are one id to the digest
    assert plan.digest(lease=a1) == kvplan._core.leased_plan_digest(plan.digest(), 1, "a")
    # The native digest reads any object with the two attributes; Lease itself refuses these
    # at construction (tests/python/test_lease_validation.py).
    with pytest.raises(kvplan.KvPlanError, match="request id must be str or bytes, got int"):
        plan.digest(lease=SimpleNamespace(epoch=1, request=7))
    with pytest.raises(kvplan.KvPlanError, match=r"epoch must be an int in \[0, 2\*\*64\), got -1"):
        plan.digest(lease=SimpleNamespace(epoch=-1, request="a"))


def test_manifest_carries_the_lease_on_the_wire_and_old_manifests_still_read() -> None:
    src = np.arange(PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    plan = kvplan.Template(pool(src), pool(dst)).plan(pages(0, 1), pages(3, 4))
    for lease in (Lease(7, "req-7"), Lease(8, b"\x00\xffraw"), None):
        m = build_manifest(plan, "src", [src], src_pages=pages(0, 1), dst_pages=pages(3, 4),
                           lease=lease)
        data = m.to_bytes()
        assert int.from_bytes(data[4:6], "little") == (1 if lease is None else 2)
        assert Manifest.from_bytes(data) == m
        for cut in (1, 3, 11):
            if lease is not None:
                with pytest.raises(kvplan.KvPlanError, match="lease|manifest"):
                    Manifest.from_bytes(data[:-cut])
    with pytest.raises(kvplan.KvPlanError, match="version 2 with flags 0x1"):
        Manifest.from_bytes(data[:6] + b"\x02\x00" + data[8:])


def test_the_verifier_refuses_a_writer_for_another_allocation() -> None:
    src = np.random.default_rng(0).integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    s_layout, d_layout = pool(src), pool(dst)
    t = kvplan.Template(s_layout, d_layout)
    table = LeaseTable(PAGES)
    a = table.grant("a", pages(3, 4))
    plan = t.plan(pages(0, 1), pages(3, 4))
    sent = build_manifest(plan, "src", [src], src_pages=pages(0, 1), dst_pages=pages(3, 4), lease=a)
    kvplan.testing.apply_plan(plan, kvplan.testing.Memory.of(src), kvplan.testing.Memory.of(dst))
    kw = dict(src_layout=s_layout, dst_layout=d_layout, buffers=[dst], src_pages=pages(0, 1),
              dst_pages=pages(3, 4), template=t)
    check_notification([sent], lease=a, leases=table, **kw)  # type: ignore[arg-type]
    table.abort(a)
    b = table.grant("b", pages(3, 4), force=True)
    # A's manifest presented for B's allocation: the lease differs, before any byte is read.
    with pytest.raises(IntegrityError, match="planned for lease request 'a' epoch 1, the "
                                             "decode's pages are held by request 'b' epoch 2") as e:
        check_notification([sent], lease=b, **kw)  # type: ignore[arg-type]
    assert e.value.what == "lease"
    with pytest.raises(StaleLeaseError, match="held now by 'b'"):
        check_notification([sent], lease=b, leases=table, **kw)  # type: ignore[arg-type]
    unleased = build_manifest(plan, "src", [src], src_pages=pages(0, 1), dst_pages=pages(3, 4))
    with pytest.raises(IntegrityError, match="carries no lease"):
        check_notification([unleased], lease=b, leases=table, **kw)  # type: ignore[arg-type]


def test_every_late_writer_is_detected_and_no_clean_abort_is_flagged() -> None:
    counts = replay_late_writers(10_000, seed=11)
    assert counts.trials == 10_000 and counts.late + counts.clean == counts.trials
    assert counts.late > 4_000 and counts.clean > 4_000
    assert counts.detected == counts.late
    assert counts.fenced == counts.late
    assert counts.false_alarms == 0
    # The replay does reach the cases that matter: B overwritten after it was checked, and
    # B's own check failing because A's bytes landed between B's write and B's check.
    assert 0 < counts.caught_before_use < counts.corrupted + counts.caught_before_use
    assert counts.corrupted > 0
