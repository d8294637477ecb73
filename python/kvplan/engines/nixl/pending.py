"""Posted NIXL requests of one submission and their completion."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from kvplan.engines._base import PendingBase, TransferError, TransferStats
from kvplan.engines.nixl.descriptors import U64
from kvplan.engines.nixl.owner import TransportHandle

__all__ = ["NixlPending"]


class NixlPending(PendingBase):
    """Posted NIXL requests of one submission. :meth:`wait` returns :class:`TransferStats`
    and releases every handle, whatever the outcome."""

    def __init__(self, transport: TransportHandle, peer: str, lengths: U64) -> None:
        self._t = transport
        self._peer = peer
        self._lengths = lengths
        self._t0 = time.perf_counter()
        # [index, lo, hi, handle, posted]; the deferred last request is posted after the rest.
        self._reqs: list[list[Any]] = []
        self._deferred: list[Any] | None = None
        self._count = 0
        self._error: TransferError | None = None
        self._stats: TransferStats | None = None
        self._lock = threading.Lock()

    def _add(self, index: int, lo: int, hi: int, handle: Any, *, deferred: bool) -> None:
        req = [index, lo, hi, handle, False]
        self._count += 1
        if deferred:
            self._deferred = req
        else:
            self._reqs.append(req)

    def _post(self, req: list[Any]) -> None:
        index, lo, hi, handle, _ = req
        t = self._t
        try:
            state = t._agent.transfer(handle)
        except Exception as exc:
            raise t._request_error(self._peer, index, self._lengths[lo:hi], "transfer", exc
                                   ) from exc
        req[4] = True
        if state == "ERR":
            raise t._request_error(self._peer, index, self._lengths[lo:hi], "ERR", None,
                                   extra="posting failed")

    def _post_ready(self) -> None:
        try:
            for req in self._reqs:
                self._post(req)
        except TransferError as err:
            self._release_all()
            self._error = err
            raise

    def _release_all(self) -> None:
        for req in self._reqs + ([self._deferred] if self._deferred else []):
            if req[3] is not None:
                self._t._release(req[3])
                req[3] = None

    def _poll(self, deadline: float | None) -> bool:
        """Check every posted request once; True when all (and the deferred one) are DONE."""
        t = self._t
        if t._closing:
            raise self._closed_error()
        for req in self._reqs:
            index, lo, hi, handle, _ = req
            if handle is None:
                continue
            try:
                state = t._agent.check_xfer_state(handle)
            except Exception as exc:
                raise t._request_error(self._peer, index, self._lengths[lo:hi], "check", exc
                                       ) from exc
            if state == "DONE":
                t._release(handle)
                req[3] = None
            elif state != "PROC":
                raise t._request_error(self._peer, index, self._lengths[lo:hi], state, None,
                                       extra="the peer may have died or refused the write")
        if any(r[3] is not None for r in self._reqs):
            if deadline is not None and time.monotonic() > deadline:
                raise self._timeout()
            return False
        if self._deferred is not None:  # every other request landed: now the notification
            self._reqs, self._deferred = [self._deferred], None
            self._post(self._reqs[0])
            return self._poll(deadline)
        return True

    def _closed_error(self) -> TransferError:
        """The transport was closed while requests were in flight: close() released their
        handles (cancelling what NIXL could), so they can no longer be checked."""
        unfinished = [r for r in self._reqs if r[3] is not None]
        if self._deferred is not None:
            unfinished.append(self._deferred)
        index, lo, hi = unfinished[0][:3] if unfinished else (0, 0, len(self._lengths))
        for req in unfinished:
            req[3] = None  # released by close(), never again here
        return self._t._request_error(
            self._peer, index, self._lengths[lo:hi], "transport closed", None,
            extra=f"NixlTransport.close() ran before {len(unfinished)} of {self._count} "
                  f"requests completed and released their handles; blocks may have partly "
                  f"landed and the notification, if any, was not sent")

    def _timeout(self) -> TransferError:
        req = next(r for r in self._reqs if r[3] is not None)
        index, lo, hi = req[0], req[1], req[2]
        return self._t._request_error(
            self._peer, index, self._lengths[lo:hi], "PROC (timed out)", None,
            extra="NIXL was asked to cancel it; blocks may have partly landed")

    @property
    def done(self) -> bool:
        """True once every request finished (successfully or not); never blocks."""
        with self._lock:
            if self._stats is not None or self._error is not None:
                return True
            try:
                return self._poll(None)
            except TransferError as err:
                self._error = err
                self._release_all()
                return True

    def wait(self, timeout: float | None = None) -> TransferStats:
        """Block until every request is ``DONE``; release every handle.

        Raises:
            TransferError: a request failed or ``timeout`` (default: the transport's) passed;
                all handles were released (or queued for :meth:`NixlTransport.close`) first.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._stats is not None:
                return self._stats
            limit = self._t.timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            delay = 0.0
            try:
                while not self._poll(deadline):
                    time.sleep(delay)
                    delay = min(1e-5 if delay == 0 else delay * 2, 1e-3)
            except TransferError as err:
                self._error = err
                self._release_all()
                raise
            lengths = self._lengths
            self._stats = TransferStats(self._peer, len(lengths),
                                        int(lengths.sum(dtype=np.uint64)), self._count,
                                        time.perf_counter() - self._t0)
            return self._stats
