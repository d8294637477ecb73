"""Leases: which allocation of the decode's pages a writer was planned for.

A decode that aborts a request and gives its pages to the next one can be overwritten by the
aborted request's writer if that writer is still in flight: the late bytes land in the new
request's pages and nothing notices. A lease makes that visible. When the decode allocates
pages for a request it grants a :class:`Lease`: the request id and an **epoch**, a number its
:class:`LeaseTable` hands out once and only ever increases. The prefill plans with the lease
(``plan.digest(lease=...)`` and the manifest carry it), so every manifest and completion names
the allocation it was planned for, and the decode's table answers three questions:

- :meth:`LeaseTable.check`: is this manifest or completion for the allocation that holds the
  pages now? If not, :class:`StaleLeaseError` says why (aborted, released, superseded) and
  which current leases hold pages the stale writer was planned to write (``overwritten``:
  those requests' bytes can no longer be trusted).
- :meth:`LeaseTable.fence`: may a write for an older epoch of these pages still land? An
  aborted lease stays *unsettled* until its writer is known to have finished (its completion or
  failure arrived, or the transport confirmed nothing is in flight); :meth:`LeaseTable.grant`
  refuses pages an unsettled lease covers unless the caller forces the reuse, which is then
  remembered, so the late writer's completion names the request it overwrote.
- :meth:`LeaseTable.grant` with an explicit ``epoch`` refuses one that does not increase.

A :class:`LeaseTable` is safe to share between threads: a decode grants on its scheduler thread
while transfer threads check, release, abort and settle. Every method runs under one lock, so
each is atomic with respect to the others (a grant never sees an abort half done: pages freed
but not yet fenced). Every argument is validated before any state changes: a refused call
leaves the table as it was.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvplan._core import KvPlanError

__all__ = ["Lease", "LeaseError", "LeaseTable", "StaleLeaseError", "UnknownLeaseError",
           "check_epoch"]

_Pages = npt.NDArray[np.int32] | npt.NDArray[np.int64] | npt.ArrayLike

#: Epochs are encoded as u64 (:meth:`Lease.to_bytes`, the leased plan digest).
EPOCH_MAX = (1 << 64) - 1
#: Request ids are encoded with a u16 length.
REQUEST_MAX_BYTES = 0xFFFF


def _check_epoch_value(epoch: object, what: str = "epoch") -> int:
    # bool is an int subclass, and numpy integers or floats would be accepted by comparisons
    # and rejected only later by the u64 encoding: refused here, at the call, by type.
    if type(epoch) is not int:
        raise LeaseError(f"{what} must be a Python int, got {type(epoch).__name__} {epoch!r}")
    if not 0 <= epoch <= EPOCH_MAX:
        raise LeaseError(f"{what} must be in 0..2**64-1 (it is encoded as u64), got {epoch}")
    return epoch


def _request_bytes(request: object) -> bytes:
    """The request id's encoded bytes, or :class:`LeaseError` naming why it cannot be one."""
    if isinstance(request, str):
        try:
            raw = request.encode("utf-8")
        except UnicodeEncodeError as error:
            raise LeaseError(f"request id {request!r} is not valid UTF-8 text (a lone surrogate "
                             f"at index {error.start}); pass bytes for a binary id") from None
    elif isinstance(request, bytes):
        raw = request
    else:
        raise LeaseError(f"a lease's request id must be str or bytes, got "
                         f"{type(request).__name__} {request!r}")
    if len(raw) > REQUEST_MAX_BYTES:
        raise LeaseError(f"a lease's request id is at most 65,535 bytes, got {len(raw)}")
    return raw


@dataclass(frozen=True, order=True)
class Lease:
    """The decode's grant of pages to a request: ``request`` (the engine's request id, ``str``
    or ``bytes``) and ``epoch`` (unique per grant, increasing)."""

    epoch: int
    request: str | bytes

    def __post_init__(self) -> None:
        # Refused here rather than when encoded: an int request id would otherwise encode as
        # that many NUL bytes, and a lone surrogate would fail only on the decode side.
        _check_epoch_value(self.epoch, "a lease's epoch")
        _request_bytes(self.request)

    def to_bytes(self) -> bytes:
        """Little-endian: epoch u64, request id length u16, a kind byte (0 ``str`` as UTF-8,
        1 ``bytes``), the request id's bytes."""
        raw = _request_bytes(self.request)
        kind = 0 if isinstance(self.request, str) else 1
        return (self.epoch.to_bytes(8, "little") + len(raw).to_bytes(2, "little")
                + bytes([kind]) + raw)

    @classmethod
    def read(cls, data: bytes, at: int = 0) -> tuple[Lease, int]:
        """Decodes :meth:`to_bytes` at ``at``: ``(lease, offset after it)``."""
        if at + 11 > len(data):
            raise KvPlanError(f"lease truncated: {len(data) - at} bytes, at least 11 expected")
        epoch = int.from_bytes(data[at:at + 8], "little")
        n = int.from_bytes(data[at + 8:at + 10], "little")
        kind = data[at + 10]
        raw = data[at + 11:at + 11 + n]
        if len(raw) != n or kind not in (0, 1):
            raise KvPlanError(f"lease malformed: request id of {n} bytes (kind {kind}), "
                              f"{len(raw)} present")
        request: str | bytes
        if kind == 0:
            try:
                request = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise KvPlanError(f"lease malformed: its text request id ({n} bytes) is not "
                                  f"UTF-8 (byte {error.start}: {raw[error.start:error.start + 1]!r})"
                                  ) from None
        else:
            request = bytes(raw)
        return cls(epoch=epoch, request=request), at + 11 + n


class LeaseError(KvPlanError):
    """A lease operation the table refuses: pages held by another lease, an epoch that does
    not increase, an epoch this table never granted, a request id that holds a lease already."""

    kind = "lease"


class StaleLeaseError(LeaseError):
    """A manifest or completion for an allocation that no longer holds its pages.

    ``lease`` is the stale one; ``reason`` is ``"aborted"``, ``"released"``, ``"unknown"`` (a
    request id that does not match the epoch's grant) or ``"superseded"`` (the request holds a
    newer lease: its pages were granted again); ``current`` is the request's lease now, when it
    holds one (its epoch is the newer of the two the message names); ``overwritten`` lists the
    current leases holding pages the stale lease covered, granted while its writer was
    unsettled: the bytes of those requests may have been overwritten."""

    kind = "stale_lease"
    lease: Lease | None = None
    current: Lease | None = None
    reason: str = ""
    overwritten: tuple[Lease, ...] = ()


class UnknownLeaseError(LeaseError):
    """A lease whose epoch this table never granted (above its last epoch, zero, or an epoch an
    explicit ``epoch=`` skipped): not a stale allocation but one that never existed here, such
    as a lease of another decode or a corrupted one. ``lease`` is the lease named."""

    kind = "unknown_lease"
    lease: Lease | None = None


_State = Literal["live", "aborted", "settled", "released"]


@dataclass
class _Grant:
    lease: Lease
    pages: npt.NDArray[np.int64]
    state: _State = "live"
    # Leases granted over these pages while this one was aborted and unsettled.
    reused_by: list[Lease] = field(default_factory=list)


class LeaseTable:
    """The decode's record of which lease holds each of its ``n_pages`` pages.

    Finished grants (released or settled) are remembered for the last ``history`` of them, so a
    duplicate or late completion says why it is stale; an older one is still refused, as an
    epoch with no record.

    Safe to share between threads: every method holds the table's lock for its whole run (a
    reentrant lock; the methods may be called from a lease check inside another's callback)."""

    def __init__(self, n_pages: int, *, history: int = 1 << 16) -> None:
        if type(n_pages) is not int or n_pages <= 0:
            raise LeaseError(f"n_pages must be a positive int, got {n_pages!r}")
        if type(history) is not int or history < 0:
            raise LeaseError(f"history must be a non-negative int, got {history!r}")
        self._lock = threading.RLock()
        self._history: deque[int] = deque()
        self._history_cap = history
        self.n_pages = n_pages
        # The epoch of the live lease holding each page (0: free); u64, the range of epochs.
        self._holder = np.zeros(n_pages, dtype=np.uint64)
        self._grants: dict[int, _Grant] = {}
        self._live: dict[str | bytes, int] = {}  # request id -> epoch of its live lease
        self._unsettled: dict[int, _Grant] = {}  # aborted leases whose writer may still land
        # Epochs an explicit ``epoch=`` jumped over, as ascending ``(first, last)`` ranges: they
        # were never granted. Bounded like the history; below ``_gaps_floor`` a missing epoch
        # is reported as forgotten, since whether it was skipped is no longer known.
        self._gaps: list[tuple[int, int]] = []
        self._gaps_floor = 0
        self.last_epoch = 0

    def _pages(self, pages: _Pages) -> npt.NDArray[np.int64]:
        array = np.asarray(pages)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise LeaseError(f"pages must be a 1-D integer array, got {array.ndim}-D "
                             f"{array.dtype}")
        if array.dtype == np.uint64 and len(array) and int(array.max()) >= self.n_pages:
            i = int(np.argmax(array >= self.n_pages))
            raise LeaseError(f"page {int(array[i])} (index {i}) outside this table's "
                             f"{self.n_pages} pages")
        array = array.astype(np.int64, copy=True)
        bad = (array < 0) | (array >= self.n_pages)
        if bad.any():
            i = int(np.argmax(bad))
            raise LeaseError(f"page {int(array[i])} (index {i}) outside this table's "
                             f"{self.n_pages} pages")
        if len(np.unique(array)) != len(array):
            raise LeaseError("pages repeat within one grant")
        return array

    def fence(self, pages: _Pages) -> tuple[Lease, ...]:
        """The aborted, unsettled leases whose writes may still land on any of ``pages``
        (oldest first). Empty: no write planned for an older epoch of these pages is in
        flight as far as this table knows, and they may be reused."""
        array = self._pages(pages)
        with self._lock:
            return self._fence(array)

    def _fence(self, array: npt.NDArray[np.int64]) -> tuple[Lease, ...]:
        return tuple(g.lease for e, g in sorted(self._unsettled.items())
                     if np.isin(g.pages, array).any())

    def grant(self, request: str | bytes, pages: _Pages, *, epoch: int | None = None,
              force: bool = False) -> Lease:
        """Allocates ``pages`` to ``request`` and returns its lease (epoch: the next one, or
        ``epoch`` when given, which must exceed every epoch granted so far).

        Raises :class:`LeaseError` when a page is held by a live lease, when an unsettled
        aborted lease covers a page (unless ``force``: the reuse is then remembered and the
        late writer's completion names this lease as overwritten), when ``request`` holds a
        live lease already, or when ``epoch`` does not increase; and, before looking at the
        table, for a request id that is not ``str`` (valid UTF-8) or ``bytes`` of at most
        65,535 bytes, an ``epoch`` that is not a Python ``int`` in ``1..2**64-1``, and pages
        that are not distinct in-range integers. A refused grant changes nothing."""
        _request_bytes(request)
        if epoch is not None:
            _check_epoch_value(epoch)
        if type(force) is not bool:
            raise LeaseError(f"force must be a bool, got {type(force).__name__} {force!r}")
        array = self._pages(pages)
        with self._lock:
            if request in self._live:
                raise LeaseError(f"request {request!r} holds lease epoch "
                                 f"{self._live[request]} already: release or abort it first")
            held = self._holder[array] != 0
            if held.any():
                i = int(np.argmax(held))
                owner = self._grants[int(self._holder[array[i]])].lease
                raise LeaseError(f"page {int(array[i])} is held by request {owner.request!r} "
                                 f"(epoch {owner.epoch}); release or abort that lease first")
            pending = self._fence(array)
            if pending and not force:
                names = ", ".join(f"{p.request!r} (epoch {p.epoch})" for p in pending)
                raise LeaseError(f"writes for aborted leases may still land on these pages: "
                                 f"{names}; settle them once their writers finished, or pass "
                                 f"force=True to reuse the pages anyway")
            if epoch is None:
                if self.last_epoch >= EPOCH_MAX:
                    raise LeaseError(f"this table granted epoch {self.last_epoch}, the largest "
                                     f"a lease encodes: no next epoch")
                epoch = self.last_epoch + 1
            elif epoch <= self.last_epoch:
                raise LeaseError(f"epoch {epoch} does not increase: this table granted epoch "
                                 f"{self.last_epoch} already (an epoch that goes backwards)")
            lease = Lease(epoch=epoch, request=request)
            if epoch > self.last_epoch + 1:
                self._skipped(self.last_epoch + 1, epoch - 1)
            self.last_epoch = epoch
            self._grants[epoch] = _Grant(lease, array)
            self._holder[array] = epoch
            self._live[request] = epoch
            for old in pending:
                self._grants[old.epoch].reused_by.append(lease)
            return lease

    def _skipped(self, first: int, last: int) -> None:
        self._gaps.append((first, last))
        cap = max(self._history_cap, 1)
        if len(self._gaps) > 2 * cap:
            dropped = len(self._gaps) - cap
            self._gaps_floor = self._gaps[dropped - 1][1]
            del self._gaps[:dropped]

    def _never_granted(self, epoch: int) -> bool:
        if epoch <= 0 or epoch > self.last_epoch:
            return True
        if epoch <= self._gaps_floor:
            return False
        at = bisect.bisect_right(self._gaps, (epoch, EPOCH_MAX + 1)) - 1
        return at >= 0 and self._gaps[at][0] <= epoch <= self._gaps[at][1]

    def _grant_of(self, lease: Lease) -> _Grant:
        grant = self._grants.get(lease.epoch)
        if grant is None and self._never_granted(lease.epoch):
            unknown = UnknownLeaseError(f"epoch {lease.epoch} (request {lease.request!r}) was "
                                        f"never granted: this table's last epoch is "
                                        f"{self.last_epoch}")
            unknown.lease = lease
            raise unknown
        if grant is None or grant.lease.request != lease.request:
            owner = ("a request whose grant finished and is no longer remembered"
                     if grant is None else repr(grant.lease.request))
            error = StaleLeaseError(f"lease epoch {lease.epoch} names request "
                                    f"{lease.request!r}, but that epoch was granted to {owner}")
            error.lease, error.reason = lease, "unknown"
            raise error
        return grant

    @staticmethod
    def _lease_arg(lease: object) -> Lease:
        if not isinstance(lease, Lease):
            raise LeaseError(f"expected a kvplan.leases.Lease, got {type(lease).__name__} "
                             f"{lease!r}")
        return lease

    def check(self, lease: Lease) -> None:
        """Checks that a manifest or completion planned for ``lease`` is for the allocation that
        holds its pages now; raises :class:`StaleLeaseError` (naming the leases it may have
        overwritten) when it is not, :class:`UnknownLeaseError` for an epoch never granted."""
        lease = self._lease_arg(lease)
        with self._lock:
            self._check(lease)

    def _check(self, lease: Lease) -> _Grant:
        grant = self._grant_of(lease)
        if grant.state == "live":
            return grant
        overwritten = tuple(grant.reused_by)
        named = ("; pages it was planned to write are held now by "
                 + ", ".join(f"{o.request!r} (epoch {o.epoch})" for o in overwritten)
                 + ", whose bytes may be overwritten") if overwritten else ""
        current = self._live_lease(lease.request)
        now = (f"; the request holds epoch {current.epoch} now"
               if current is not None and current.epoch != lease.epoch else "")
        error = StaleLeaseError(f"stale lease: request {lease.request!r} epoch {lease.epoch} "
                                f"was {grant.state if grant.state != 'settled' else 'aborted'}"
                                f"{now}{named}")
        error.lease = lease
        error.current = current
        error.reason = "released" if grant.state == "released" else "aborted"
        error.overwritten = overwritten
        raise error

    def release(self, lease: Lease) -> None:
        """The request completed (its manifests verified): frees its pages. Raises as
        :meth:`check` for a lease that is not live."""
        lease = self._lease_arg(lease)
        with self._lock:
            grant = self._check(lease)
            grant.state = "released"
            self._holder[grant.pages] = 0
            del self._live[lease.request]
            self._finished(lease.epoch)

    def _finished(self, epoch: int) -> None:
        self._history.append(epoch)
        while len(self._history) > self._history_cap:
            self._grants.pop(self._history.popleft(), None)

    def abort(self, lease: Lease) -> None:
        """The request was aborted: its pages are free to allocate once the lease is settled
        (:meth:`settle`); until then :meth:`fence` names it for them."""
        lease = self._lease_arg(lease)
        with self._lock:
            grant = self._check(lease)
            grant.state = "aborted"
            self._holder[grant.pages] = 0
            del self._live[lease.request]
            self._unsettled[lease.epoch] = grant

    def settle(self, lease: Lease) -> tuple[Lease, ...]:
        """The writer of aborted ``lease`` has finished: no write for it can land any more.
        Returns the leases granted over its pages while it was unsettled (their bytes may have
        been overwritten: verify or recompute them)."""
        lease = self._lease_arg(lease)
        with self._lock:
            grant = self._grant_of(lease)
            if grant.state not in ("aborted", "settled"):
                raise LeaseError(f"lease {lease.request!r} epoch {lease.epoch} is "
                                 f"{grant.state}, not aborted: only an aborted lease is settled")
            if grant.state == "aborted":
                grant.state = "settled"
                self._unsettled.pop(lease.epoch, None)
                self._finished(lease.epoch)
            return tuple(grant.reused_by)

    def live(self, request: str | bytes) -> Lease | None:
        """The live lease of ``request`` (its pages' current allocation), or None."""
        _request_bytes(request)
        with self._lock:
            return self._live_lease(request)

    def _live_lease(self, request: str | bytes) -> Lease | None:
        epoch = self._live.get(request)
        return self._grants[epoch].lease if epoch is not None else None

    def holder(self, page: int) -> Lease | None:
        """The live lease holding ``page``, or None."""
        index = int(self._pages([page])[0])
        with self._lock:
            epoch = int(self._holder[index])
            return self._grants[epoch].lease if epoch else None


def check_epoch(sent: Lease, expected: Lease) -> None:
    """Checks that a manifest planned for lease ``sent`` is for ``expected``, the decode's lease
    on the same request's pages (the batch verification path runs this per request).

    Raises :class:`StaleLeaseError` (``reason="superseded"``, ``lease`` the sent one,
    ``current`` the expected one) naming the request and both epochs when ``sent`` is an
    older epoch of the request, and :class:`LeaseError` when it names another request or a
    newer epoch than the decode's own lease: an epoch that goes backwards for a request (a
    decode record older than an epoch it already granted)."""
    if sent.request != expected.request:
        raise LeaseError(f"the manifest's lease names request {sent.request!r} (epoch "
                         f"{sent.epoch}), but these pages are leased to request "
                         f"{expected.request!r} (epoch {expected.epoch})")
    if sent.epoch < expected.epoch:
        error = StaleLeaseError(f"stale lease: request {sent.request!r} was planned for "
                                f"epoch {sent.epoch}, but its pages are held under epoch "
                                f"{expected.epoch} now (the request's pages were granted "
                                f"again since)")
        error.lease, error.current, error.reason = sent, expected, "superseded"
        raise error
    if sent.epoch > expected.epoch:
        raise LeaseError(f"epoch goes backwards for request {sent.request!r}: the prefill "
                         f"planned for epoch {sent.epoch}, newer than the decode's lease "
                         f"epoch {expected.epoch} for its pages (the decode's record is "
                         f"older than an epoch it granted)")
