"""The prefill's leases: its hold on the requests its staged streams gather from.

:class:`SendLeases` (one per worker, :func:`send_leases`) pins a request vLLM still holds
with the pages a stream or a held check names, and extends its lease while pinned;
:func:`record_sent_blocks` records the block ids vLLM gave the requests each step."""

from __future__ import annotations

import threading
import time
from typing import Any

from kvplan.compat.vllm.nixl_staging.scheduler import SENT_BLOCKS_META
from kvplan.compat.vllm.nixl_staging.worker import worker_staging


#: The worker attribute holding its :class:`SendLeases`.
LEASES_ATTR = "_kvplan_send_leases"
#: Least seconds a held request's lease is extended by at each of vLLM's expiry checks.
MIN_EXTENSION_S = 1.0


class SendLeases:
    """What a prefill worker holds for its staged streams. vLLM's pull worker keeps a
    finished request's blocks until the decode's notification or the lease's expiry
    (``_reqs_to_send``: request -> expiry; ``_reqs_to_process``: requests of a batch not yet
    given one) and then reports them sent, which frees them for other requests. A stream
    gathers from them only while this worker holds the request: :meth:`hold` checks that
    vLLM still holds it and that the stream's prefill pages are vLLM's blocks of it, then
    pins it; :meth:`extend_pinned` (run by the worker's expiry check, under :attr:`lock`)
    pushes a pinned request's expiry forward, as vLLM's own lease heartbeat does, so the
    blocks are not freed while a round may still be gathered; :meth:`release` unpins it. A
    pin given a lifetime (``pin_s``: a held check's, which nothing releases but time) ends at
    its deadline, at the next of those checks after it (:meth:`expire`; no thread waits for
    it)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        #: Request -> vLLM's block ids per KV group (logical), recorded per step.
        self.blocks: dict[str, list[list[int]]] = {}
        #: Requests vLLM holds for a decode (in its ``_reqs_to_send``) that a :meth:`record`
        #: found no block ids for. The ids of a request come with the very metadata whose
        #: ``reqs_to_send`` starts its lease there, the one that record reads: for these they
        #: never come, and :meth:`hold` refuses them at once.
        self.unrecorded: set[str] = set()
        #: Request -> streams holding it.
        self.pins: dict[str, int] = {}
        #: Request -> the deadlines (on :attr:`clock`) of its pins that end by time.
        self.deadlines: dict[str, list[float]] = {}
        #: The clock of those deadlines (seconds; tests drive it).
        self.clock: Any = time.monotonic
        #: Streams serving now -> (their ack queue, their thread).
        self.streams: dict[str, tuple[Any, threading.Thread]] = {}
        #: Set by :meth:`stop`: no stream is held any more.
        self.stopping = False

    # ------------------------------------------------------------------ vLLM's bookkeeping
    @staticmethod
    def held(worker: Any, request: str) -> bool:
        """Whether vLLM's worker still holds ``request``'s blocks (as its notification
        handling decides)."""
        d = worker.__dict__
        return request in (d.get("_reqs_to_send") or {}) or \
            request in (d.get("_reqs_to_process") or ())

    def record(self, worker: Any, sent: Any) -> None:
        """After vLLM's ``start_load_kv``: the block ids kvplan's scheduler side sent with
        ``reqs_to_send`` for the requests vLLM now holds; requests vLLM no longer holds are
        forgotten."""
        with self.lock:
            for request, groups in dict(sent or {}).items():
                if self.held(worker, request):
                    self.blocks[str(request)] = [[int(b) for b in g] for g in groups]
            for request in [r for r in self.blocks if not self.held(worker, r)]:
                del self.blocks[request]
            sending = {str(r) for r in worker.__dict__.get("_reqs_to_send") or {}}
            self.unrecorded = sending - self.blocks.keys()
            self.expire()
            self.lock.notify_all()

    def extend_pinned(self, worker: Any) -> None:
        """Push every pinned request's expiry at least :data:`MIN_EXTENSION_S` (or vLLM's
        lease extension, if longer) past now. Call with :attr:`lock` held, right before
        vLLM's expiry check. Pins past their deadline end first (:meth:`expire`)."""
        self.expire()
        leases = worker.__dict__.get("_reqs_to_send")
        if not self.pins or not isinstance(leases, dict):
            return
        now = time.perf_counter()
        extension = max(float(worker.__dict__.get("_lease_extension") or 0), MIN_EXTENSION_S)
        for request in self.pins:
            if request in leases:
                leases[request] = max(float(leases[request]), now + extension)

    # ------------------------------------------------------------------ streams
    def hold(self, worker: Any, request: str, src_pages: list[int], *, stream: str,
             timeout_s: float, pin_s: float | None = None,
             group_pages: list[list[int]] | None = None) -> None:
        """Pin ``request`` for one stream whose prefill pages are ``src_pages`` (vLLM's
        request of one KV group), or with ``group_pages`` the pages of each KV group, in
        vLLM's group order (with ``pin_s``, for that many seconds: then the pin ends by
        itself, :meth:`expire`). Raises :class:`kvplan.staging.StagingError`: ``not_held``
        when vLLM no longer holds the request (its lease expired, or it was freed or never
        finished here), or its block ids are not recorded within ``timeout_s`` (at once where
        they will not come: its lease started with a step that carried none, :attr:`unrecorded`;
        a request vLLM holds only in a batch not yet finished is waited for);
        ``pages_mismatch`` when ``src_pages`` are not the last pages of vLLM's blocks of it,
        or a group's ``group_pages`` not the last of vLLM's blocks of that group (in kernel
        blocks: vLLM trims the decode's prefix-cache hit off the front), or ``group_pages``
        names another number of groups than vLLM gave the request. The same block id in two
        groups is two blocks: each group's pages are checked against that group's alone."""
        from kvplan.staging import StagingError

        deadline = time.monotonic() + timeout_s
        with self.lock:
            self.expire()
            while True:
                if self.stopping:
                    raise StagingError.make(stream, None, "cancelled",
                                            "the prefill worker shut down")
                if not self.held(worker, request):
                    raise StagingError.make(
                        stream, None, "not_held",
                        f"this prefill no longer holds request {request!r} (its KV lease "
                        "expired, or its blocks were freed or never kept for a decode)")
                groups = self.blocks.get(request)
                if groups is not None:
                    break
                if request in self.unrecorded:
                    raise StagingError.make(
                        stream, None, "not_held",
                        f"vLLM holds request {request!r} for a decode, but the step that "
                        "started its lease here gave no block ids of it (kvplan's scheduler "
                        "side sent none): they will not come")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingError.make(
                        stream, None, "not_held",
                        f"vLLM gave this prefill no block ids for request {request!r} within "
                        f"{timeout_s:g} s")
                self.lock.wait(min(left, 0.05))
            ratio = int(worker.__dict__.get("_physical_blocks_per_logical_kv_block", 1) or 1)
            kernel = worker._logical_to_kernel_block_ids(groups, ratio) if ratio != 1 \
                else groups
            have = [[int(b) for b in g] for g in kernel]
            if group_pages is None:
                used = [g for g in have if g]
                wrong = len(used) != 1 or not _tail_of(list(src_pages), used[0])
                named: Any = list(src_pages)
            else:
                named = [list(g) for g in group_pages]
                wrong = len(named) != len(have) or \
                    not all(_tail_of(p, g) for p, g in zip(named, have))
            if wrong:
                raise StagingError.make(
                    stream, None, "pages_mismatch",
                    f"the stream reads prefill pages {named!r:.200} of request "
                    f"{request!r}, whose blocks here are {have!r:.200}")
            self.pins[request] = self.pins.get(request, 0) + 1
            if pin_s is not None:
                self.deadlines.setdefault(request, []).append(self.clock() + float(pin_s))

    def expire(self) -> list[str]:
        """End the pins whose deadline passed (one :meth:`release` each); the requests
        unpinned so. Runs where the pins are already looked at: vLLM's expiry check
        (:meth:`extend_pinned`), each step's :meth:`record`, and :meth:`hold`."""
        ended: list[str] = []
        with self.lock:
            if not self.deadlines:
                return ended
            now = self.clock()
            for request, ends in list(self.deadlines.items()):
                left = [t for t in ends if t > now]
                if left:
                    self.deadlines[request] = left
                else:
                    del self.deadlines[request]
                for _ in range(len(ends) - len(left)):
                    self.release(request)
                    ended.append(request)
        return ended

    def release(self, request: str) -> None:
        """Unpin ``request`` for one stream (vLLM's lease, the notification or expiry, frees
        it from here on)."""
        with self.lock:
            left = self.pins.get(request, 0) - 1
            if left > 0:
                self.pins[request] = left
            else:
                self.pins.pop(request, None)

    def started(self, stream: str, acks: Any, thread: threading.Thread) -> None:
        with self.lock:
            self.streams[stream] = (acks, thread)

    def ended(self, stream: str) -> None:
        with self.lock:
            self.streams.pop(stream, None)

    def stop(self, join_s: float) -> None:
        """End every stream serving now (each is told the decode gave up: its send stops
        after the gather in progress, it is refused to the decode and its hold released),
        waiting up to ``join_s`` seconds for their threads."""
        from kvplan.staging.channel import join_threads
        from kvplan.staging.wire import FAIL, encode

        with self.lock:
            self.stopping = True
            self.lock.notify_all()
            streams = list(self.streams.items())
        for stream, (acks, _) in streams:
            acks.put(encode(FAIL, stream, writer=0, round_index=0,
                            payload=b"cancelled: the prefill worker shut down"))
        join_threads([thread for _, (_, thread) in streams], join_s)


def _tail_of(pages: list[int], blocks: list[int]) -> bool:
    """Whether ``pages`` are the last of ``blocks`` (vLLM's trim of a decode's prefix-cache
    hit takes blocks off the front)."""
    return len(pages) <= len(blocks) and blocks[len(blocks) - len(pages):] == pages


def send_leases(worker: Any) -> SendLeases:
    """The worker's :class:`SendLeases` (made once)."""
    leases = worker.__dict__.get(LEASES_ATTR)
    if not isinstance(leases, SendLeases):
        leases = worker.__dict__.setdefault(LEASES_ATTR, SendLeases())
    assert isinstance(leases, SendLeases)
    return leases


def record_sent_blocks(worker: Any, metadata: Any) -> None:
    """The worker's ``start_load_kv``, after vLLM's: keep the block ids of the requests vLLM
    now holds for decodes (:meth:`SendLeases.record`); nothing with staging off."""
    if worker_staging(worker) is not None:
        send_leases(worker).record(worker, getattr(metadata, SENT_BLOCKS_META, None))
