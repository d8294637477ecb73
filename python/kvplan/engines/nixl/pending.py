"""Posted NIXL requests of one submission and their completion."""

from __future__ import annotations

import threading
import time
from typing import Any

from kvplan.engines._base import PendingBase, TransferError, TransferStats
from kvplan.engines.nixl.descriptors import U64
from kvplan.engines.nixl.owner import Memory, TransportHandle

__all__ = ["NixlPending"]


class NixlPending(PendingBase):
    """Posted NIXL requests of one submission. :meth:`wait` returns :class:`TransferStats`
    and releases every handle, whatever the outcome."""

    def __init__(self, transport: TransportHandle, peer: str, lengths: U64, *,
                 notif: bytes = b"", mems: tuple[Memory, Memory] | None = None) -> None:
        super().__init__(peer, lengths)
        self._t = transport
        self._notif = notif
        self._mems = mems  # (local, remote) memory of the plan's requests
        # [index, lo, hi, handle, posted]; the deferred last request is posted after the rest.
        self._reqs: list[list[Any]] = []
        self._deferred: list[Any] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ submission side
    def _post_batch(self, index: int, lo: int, hi: int, src: U64, dst: U64, lengths: U64, *,
                    last: bool) -> None:
        """One request per batch; the notification travels with the last one, which waits
        until the others completed when there are several (it never overtakes data)."""
        assert self._mems is not None, "a plan submission names its memories"
        local_mem, remote_mem = self._mems
        handle = self._t._make(self._peer, index, lengths, local_mem, remote_mem, src, dst,
                               self._notif if last else b"")
        self._add(index, lo, hi, handle, deferred=last and index > 0)

    def _abort(self, exc: BaseException) -> None:
        self._release_all()

    def _submitted(self) -> None:
        if self._n_batches == 0 and self._notif:
            # No request moves a byte: a bare notification says the submission is complete.
            self._t._notify(self._peer, self._notif)
        self._post_ready()

    def _add(self, index: int, lo: int, hi: int, handle: Any, *, deferred: bool) -> None:
        req = [index, lo, hi, handle, False]
        if deferred:
            self._deferred = req
        else:
            self._reqs.append(req)

    def _call(self, method: str, handle: Any) -> Any:
        """``agent.<method>(handle)`` under the transport's lock, so ``close()`` (which takes
        the lock to start releasing handles) never releases this handle, or drops the agent,
        while NIXL is using it; a transport already closing raises the closed error."""
        t = self._t
        with t._lock:
            if not t._closing:
                return getattr(t._agent, method)(handle)
        raise self._closed_error()

    def _post(self, req: list[Any]) -> None:
        index, lo, hi, handle, _ = req
        t = self._t
        try:
            state = self._call("transfer", handle)
        except TransferError:
            raise
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
                state = self._call("check_xfer_state", handle)
            except TransferError:
                raise
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
            extra=f"NixlTransport.close() ran before {len(unfinished)} of {self._n_batches} "
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
            return self._succeeded()
