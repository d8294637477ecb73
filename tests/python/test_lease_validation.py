"""Leases refuse bad epochs, request ids and pages at the call, before any state changes: a
refused grant leaves the table exactly as it was, and a lease that cannot be encoded cannot be
built. An epoch the table never granted is its own error, never a stale lease."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvplan import KvPlanError, Lease, LeaseError, LeaseTable, StaleLeaseError
from kvplan.integrity import Manifest
from kvplan.leases import UnknownLeaseError

PAGES = 8


def pages(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def snapshot(table: LeaseTable) -> tuple[object, ...]:
    return (table.last_epoch, tuple(table.holder(p) for p in range(PAGES)),
            table.live("a"), table.live("b"))


def test_an_epoch_beyond_int64_is_granted_and_the_u64_end_refused_without_state_change() -> None:
    table = LeaseTable(PAGES)
    big = table.grant("a", pages(0), epoch=2**63)
    assert big.epoch == 2**63 and table.holder(0) == big
    assert Lease.read(big.to_bytes())[0] == big
    top = table.grant("b", pages(1), epoch=2**64 - 1)
    assert table.holder(1) == top
    before = snapshot(table)
    with pytest.raises(LeaseError, match=r"granted epoch 18446744073709551615, the largest"):
        table.grant("c", pages(2))
    with pytest.raises(LeaseError, match=r"epoch must be in 0\.\.2\*\*64-1 .*got 18446744073709551616"):
        table.grant("c", pages(2), epoch=2**64)
    assert snapshot(table) == before
    table.release(big)  # the table still works
    assert table.holder(0) is None


@pytest.mark.parametrize("epoch", [np.int64(5), np.uint64(5), 5.0, True, "5", -1])
def test_epochs_that_are_not_python_ints_in_range_are_refused_at_the_call(epoch: object) -> None:
    table = LeaseTable(PAGES)
    table.grant("a", pages(0))
    before = snapshot(table)
    with pytest.raises(LeaseError, match="epoch must be"):
        table.grant("b", pages(1), epoch=epoch)  # type: ignore[arg-type]
    assert snapshot(table) == before
    assert table.grant("b", pages(1)).epoch == 2


@pytest.mark.parametrize("request_id", [None, 42, 4.5, ["a"], bytearray(b"a"), "\ud800x",
                                        "x" * 65536])
def test_request_ids_that_cannot_be_encoded_are_refused_at_the_call(request_id: object) -> None:
    table = LeaseTable(PAGES)
    before = snapshot(table)
    with pytest.raises(LeaseError, match="request id"):
        table.grant(request_id, pages(0))  # type: ignore[arg-type]
    with pytest.raises(LeaseError, match="request id"):
        Lease(1, request_id)  # type: ignore[arg-type]
    assert snapshot(table) == before
    assert table.grant("a", pages(0)).epoch == 1


def test_a_lease_with_an_int_request_id_is_never_encoded_as_nul_bytes() -> None:
    with pytest.raises(LeaseError, match="request id must be str or bytes, got int 42"):
        Lease(1, 42)  # type: ignore[arg-type]
    with pytest.raises(LeaseError, match="epoch must be a Python int"):
        Lease(1.0, "a")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [pages(0, 0), pages(-1), pages(PAGES),
                                 np.array([1.0]), np.array([[1]]),
                                 np.array([2**63], dtype=np.uint64)])
def test_bad_pages_are_refused_without_state_change(bad: np.ndarray) -> None:
    table = LeaseTable(PAGES)
    table.grant("a", pages(0))
    before = snapshot(table)
    with pytest.raises(LeaseError):
        table.grant("b", bad)
    assert snapshot(table) == before


def test_force_must_be_a_bool() -> None:
    table = LeaseTable(PAGES)
    with pytest.raises(LeaseError, match="force must be a bool"):
        table.grant("a", pages(0), force="no")  # type: ignore[arg-type]
    assert table.last_epoch == 0


def test_a_never_granted_epoch_is_its_own_error_not_a_stale_lease() -> None:
    table = LeaseTable(PAGES, history=4)
    a = table.grant("a", pages(0))  # epoch 1
    b = table.grant("b", pages(1), epoch=10)  # 2..9 skipped
    for epoch in (0, 5, 9, 11):
        with pytest.raises(UnknownLeaseError, match=f"epoch {epoch} .*was never granted") as e:
            table.check(Lease(epoch, "a"))
        assert not isinstance(e.value, StaleLeaseError) and e.value.kind == "unknown_lease"
        assert e.value.lease == Lease(epoch, "a")
        with pytest.raises(UnknownLeaseError):
            table.settle(Lease(epoch, "a"))
    # A granted epoch whose request differs is still a stale (unknown-request) lease.
    with pytest.raises(StaleLeaseError) as stale:
        table.check(Lease(10, "a"))
    assert stale.value.reason == "unknown"
    table.release(a)
    table.release(b)


def test_a_lease_argument_must_be_a_lease() -> None:
    table = LeaseTable(PAGES)
    with pytest.raises(LeaseError, match="expected a kvplan.leases.Lease, got tuple"):
        table.check((1, "a"))  # type: ignore[arg-type]


def manifest_bytes_with_text_id(raw: bytes) -> bytes:
    lease = Lease(3, "abc")
    data = Manifest(1, 2, 3, 4, 1, 1, 64, 5, 6, (7,), lease=lease).to_bytes()
    # Swap the UTF-8 id for raw bytes of the same length: what a peer with another encoder sends.
    head = data[: len(data) - 3 - 11]
    return head + struct.pack("<QHB", 3, len(raw), 0) + raw


@pytest.mark.parametrize("raw", [b"\xff\xfe\xfd", b"a\xc3", b"\xed\xa0\x80"])
def test_a_manifest_whose_text_lease_id_is_not_utf8_raises_a_typed_error(raw: bytes) -> None:
    data = manifest_bytes_with_text_id(raw)
    with pytest.raises(KvPlanError, match="lease malformed: its text request id .* is not UTF-8"):
        Manifest.from_bytes(data)


def test_a_binary_lease_id_round_trips_through_a_manifest() -> None:
    lease = Lease(3, b"\xff\xfe\x00")
    data = Manifest(1, 2, 3, 4, 1, 1, 64, 5, 6, (7,), lease=lease).to_bytes()
    assert Manifest.from_bytes(data).lease == lease
