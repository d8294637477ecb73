"""The prepped path: the template's prepped descriptor tables registered once per peer pair
(``prep_xfer_dlist``), requests sent as the core's index arrays (``make_prepped_xfer``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvplan._core import Template
from kvplan.engines._base import Manifests, TransferStats, integrity_notification
from kvplan.engines.nixl.descriptors import U64
from kvplan.engines.nixl.owner import TransportHandle
from kvplan.engines.nixl.pending import NixlPending

__all__ = ["PreppedPair"]


def _index_array(values: npt.ArrayLike) -> npt.NDArray[Any]:
    """A 1-D int32/int64 array for the core (integer lists and other signed widths widened;
    anything else passed on for the core's TypeError)."""
    arr = np.asarray(values)
    if arr.dtype.kind == "i" and arr.dtype not in (np.int32, np.int64):
        arr = arr.astype(np.int64)
    return np.ascontiguousarray(arr.ravel())


class PreppedPair:
    """Prepped descriptor lists of one (local layout, remote layout, peer): requests travel as
    index arrays into the template's prepped tables (what vLLM's NixlConnector sends).

    Attributes:
        n_local, n_remote: descriptors in the local (source) and remote (destination) list.
    """

    def __init__(self, transport: TransportHandle, peer: str, template: Template, local: Any,
                 remote: Any, src_lens: U64, dst_lens: U64) -> None:
        self.transport, self.peer, self.template = transport, peer, template
        self._local, self._remote = local, remote
        self._src_lens, self._dst_lens = src_lens, dst_lens
        self.n_local, self.n_remote = len(src_lens), len(dst_lens)
        self._released = False

    def indices(self, src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike
                ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``(local, remote)`` int32 index arrays of a page request (``Template.prepped_indices``:
        piece major, page minor; empty when the template moves no page bytes).

        Raises:
            IndexBoundsError: a negative page, or one outside some paired entry's capacity
                (the checks of ``Template.plan``).
            KvPlanError: unequal lengths.
        """
        local, remote = self.template.prepped_indices(_index_array(src_pages),
                                                      _index_array(dst_pages))
        return local.astype(np.int32), remote.astype(np.int32)  # tables hold < 2**31 rows

    def state_indices(self, src_slot: int, dst_slot: int
                      ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """Index arrays moving state slot ``src_slot`` to ``dst_slot`` for every state pair
        that moves bytes (``Template.prepped_state_indices``)."""
        local, remote = self.template.prepped_state_indices(src_slot, dst_slot)
        return local.astype(np.int32), remote.astype(np.int32)

    def submit(self, local: npt.ArrayLike, remote: npt.ArrayLike, *, notif: bytes = b"",
               timeout: float | None = None, manifest: Manifests | None = None
               ) -> TransferStats:
        """One ``make_prepped_xfer`` request from :meth:`indices` (or :meth:`state_indices`)
        arrays; waits, releases the handle on every path. Empty arrays move nothing and still
        deliver ``notif`` (a bare notification). ``manifest``: as in
        :meth:`NixlTransport.submit` (digest the same request's ``Template.plan`` to build it).

        Raises:
            TransferError: as :meth:`NixlTransport.submit`; the transport is closed; the lists
                were released (:meth:`release`).
            IndexBoundsError: an index outside its list.
            SizeMismatchError: paired descriptors of different lengths (indices that did not
                come from one request of this pair).
        """
        t = self.transport
        t._check_open()
        if self._released:
            raise t._error(f"prepped lists towards peer {self.peer!r} released "
                           f"(PreppedPair.release()); prepare new ones with prep()",
                           peer=self.peer, status=None)
        li = np.ascontiguousarray(np.asarray(local).ravel(), dtype=np.int32)
        ri = np.ascontiguousarray(np.asarray(remote).ravel(), dtype=np.int32)
        if len(li) != len(ri):
            raise ValueError(f"{len(li)} local but {len(ri)} remote indices")
        lengths = self._lengths(li, ri)
        pending = NixlPending(t, self.peer, lengths)
        pending._integrity = integrity_notification(manifest, notif)
        notif = pending._integrity or notif
        if len(li) == 0:
            if notif:
                t._notify(self.peer, notif)
            return pending.wait(timeout)
        try:
            handle = t._agent.make_prepped_xfer("WRITE", self._local, li, self._remote, ri,
                                                notif)
        except Exception as exc:
            raise t._request_error(self.peer, 0, lengths, "make_prepped_xfer", exc) from exc
        with t._lock:
            t._live.add(handle)
        pending._n_batches += 1
        pending._add(0, 0, len(li), handle, deferred=False)
        pending._post_ready()
        return pending.wait(timeout)

    def _lengths(self, li: npt.NDArray[np.int32], ri: npt.NDArray[np.int32]) -> U64:
        """Bytes of each descriptor pair, after checking both indices lie in their lists."""
        from kvplan import IndexBoundsError, SizeMismatchError

        for name, idx, n in (("local", li, self.n_local), ("remote", ri, self.n_remote)):
            bad = np.flatnonzero((idx < 0) | (idx >= n))
            if bad.size:
                k = int(bad[0])
                raise IndexBoundsError(f"{name} index {int(idx[k])} at position {k} is outside "
                                       f"0..{n} (the prepped {name} list)")
        lengths = self._src_lens[li]
        differ = np.flatnonzero(lengths != self._dst_lens[ri])
        if differ.size:
            k = int(differ[0])
            raise SizeMismatchError(
                f"position {k}: local descriptor {int(li[k])} has {int(lengths[k])} bytes but "
                f"remote descriptor {int(ri[k])} has {int(self._dst_lens[ri[k]])}; pass index "
                f"arrays from one indices() or state_indices() call")
        return lengths

    def release(self) -> None:
        """Release both prepped lists (also done by the transport's ``close``); later
        :meth:`submit` calls raise :class:`TransferError`."""
        self._released = True
        for h in (self._local, self._remote):
            if h is not None and h in self.transport._dlists:
                self.transport._dlists.discard(h)
                h.release()
