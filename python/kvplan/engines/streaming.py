"""Layer-wise streaming: send each layer group of a request while prefill computes the next.

A serving engine plans a request once, opens it here, and signals each layer as its KV cache
is written (from its per-layer hook, on any thread, in any order). One submitter thread sends
a layer group's slice of the plan (block ranges the core computed: ``LayerSlices.of(plan)``)
as soon as every layer of the group is ready and the destination is known (with the group's
per-request state, which its layers' forward writes), then the seal (draft entries, entries
the caller marks, state of layers outside every group) once the forward is done. The caller never blocks; each request
ends with one verdict.

::

    groups = kvplan.LayerGroups.fixed(4)
    template = kvplan.Template(src, dst, layer_groups=groups)
    streamer = StreamingSubmitter(transport, template.layer_slices(groups))
    req = streamer.open("req-7", template.plan(sp, dp), peer_session,
                        state_plan=template.plan_state(ss, ds))
    streamer.ready(layer_id)                # per layer, every open request (or req.ready(...))
    streamer.ready(layer_id, event=ev)      # ev.synchronize() runs on the submitter's thread
    req.seal()                              # forward done: the rest, then the seal
    stats = req.wait(timeout=30.0)          # StreamStats, or TransferError naming the slice

Nothing here imports an engine package; any :class:`kvplan.engines.Transport` works (Mooncake,
NIXL: its completion notification goes with the request's last submission).

**Completeness at the decode.** The request's last submission carries its *final
notification*: the integrity notification (:func:`kvplan.integrity.pack_notification`, the same
channel digests use) holding the caller's completion message and a work record, the
expected-work manifest plus the slices the prefill sent. With NIXL each slice submission also
carries a slice receipt (``KVSR``, the indices of its slices, the message), which NIXL delivers
once those bytes have landed; the decode waits with ``NixlTransport.wait_stream``. Mooncake
has no notifications at the target: :attr:`StreamStats.notification` holds the final
notification for the caller's side channel, and :func:`check_stream` on the decode reads it.
Either way the decode gets a :class:`StreamCompleteness`: complete, a slice missing (named),
or still in flight.
"""

from __future__ import annotations

import builtins
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from kvplan._core import (
    BatchPlan,
    BatchSlices,
    KvPlanError,
    LayerSlices,
    BlockSlice,
    PlanSlices,
    TransferPlan,
    WorkManifest,
)
from kvplan._errors import TransferError
from kvplan.engines._base import RequestVerdicts
from kvplan.integrity import (
    Manifest,
    is_notification,
    pack_notification,
    read_notification,
    read_work,
)

__all__ = ["BatchStreamOutcome", "ReadyEvent", "StreamBatch", "StreamCompleteness",
           "StreamRequest", "StreamStats", "StreamingSubmitter", "check_stream", "slice_receipt"]

_RECEIPT_MAGIC = b"KVSR"
_RECEIPT = struct.Struct("<4sI")
_RECORD_MAGIC = b"KVSW"
_RECORD = struct.Struct("<4sHBBI")

#: Requests moving fewer bytes go out in one piece at seal time: per-slice messages of short
#: prompts cost more than the overlap gains.
DEFAULT_MIN_STREAM_BYTES = 1 << 20


class ReadyEvent(Protocol):
    """A device event (CUDA, NPU) recorded after the kernel that wrote a layer's cache."""

    def synchronize(self) -> Any: ...


@dataclass(frozen=True)
class StreamStats:
    """What one streamed request moved, and when."""

    request: str
    session: str
    blocks: int
    bytes: int
    #: Engine submissions (one per block range of each slice sent, plus the seal's).
    submissions: int
    #: Slices sent before the seal (0 for a request below the size threshold).
    slices: int
    #: Whether the request went out as slices (False: one piece at seal time).
    streamed: bool
    #: Open to the last byte's completion.
    seconds: float
    #: From the last ready signal (or the seal, whichever came later) to completion.
    tail_seconds: float
    #: Layers whose ready signal never came before the seal (a skipped per-layer hook), in
    #: ascending order; their slices went out with the seal (the forward had written them).
    unsignalled_layers: tuple[int, ...] = ()
    #: The slices (indices into ``LayerSlices.group_ids``) those layers held back.
    unsignalled_slices: tuple[int, ...] = ()
    #: The final notification (integrity notification with the work record); NIXL delivered
    #: it with the last submission, other engines leave it to the caller's side channel.
    notification: builtins.bytes = b""  # `bytes` here would name the field above


_Result = TypeVar("_Result")


class _Verdict(Generic[_Result]):
    """The verdict of what a submitter streams (a request, a batch): set once by the
    submitter's thread (a result, or the failure), awaited by the caller."""

    request: str

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: TransferError | None = None
        self._result: _Result | None = None

    @property
    def done(self) -> bool:
        """True once the verdict is in (success, failure or cancel); never blocks."""
        return self._done.is_set()

    def _await(self, timeout: float | None, what: str) -> _Result:
        """The result, or the failure raised; ``what`` names the streamed thing."""
        if not self._done.wait(timeout):
            err = TransferError(f"streaming: {what} {self.request!r} not complete after "
                                f"{timeout} s")
            err.state = "timeout"
            raise err
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # ------------------------------------------------------------------ submitter side
    def _fail(self, err: TransferError) -> None:
        if not self._done.is_set():
            self._error = err
            self._done.set()


class StreamRequest(_Verdict[StreamStats]):
    """One request being streamed: its slices, their state, and its verdict."""

    def __init__(self, owner: StreamingSubmitter, request: str, plan: TransferPlan,
                 cut: PlanSlices, slices: LayerSlices, peer: str | None,
                 state: tuple[TransferPlan, PlanSlices] | None, notif: bytes,
                 streamed: bool) -> None:
        super().__init__()
        self.request = request
        self._owner = owner
        self._plan = plan
        self._cut = cut
        self._slices = slices
        self._peer = peer
        self._state = state
        self._notif = notif
        self.streamed = streamed
        layers = slices.layers
        # The core's answers, read once per request (each getter converts a whole list).
        self._ranges = cut.ranges
        self._state_ranges = state[1].ranges if state is not None else [[] for _ in cut.ranges]
        self._columns = {id(p): (p.src_addrs, p.dst_addrs, p.lengths)
                         for p in (plan, *((state[0],) if state is not None else ()))}
        # Per slice, the layers still awaited; slices with blocks (page or state) only.
        self._waiting: dict[int, set[int]] = {
            k: set(layers[k])
            for k, (ranges, more) in enumerate(zip(self._ranges, self._state_ranges))
            if ranges or more}
        self._ready_slices: list[int] = []  # all layers ready, not yet sent
        self._sent: set[int] = set()
        self._confirmed: list[int] = []  # slices whose every submission succeeded
        self._sealed = False
        self._unsignalled: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._t_open = time.perf_counter()
        self._t_last_signal = self._t_open
        self._blocks = self._bytes = self._submissions = 0
        self._cancelled = False

    # ------------------------------------------------------------------ caller side
    @property
    def manifest(self) -> WorkManifest:
        """The expected work of this request (slices, blocks, bytes, seal with state)."""
        state = self._state[1] if self._state is not None else None
        return self._cut.manifest(self._owner._request_number(self.request), state)

    def ready(self, layer: int, event: ReadyEvent | None = None) -> None:
        """Layer ``layer`` of this request is written (see :meth:`StreamingSubmitter.ready`)."""
        self._owner._signal(layer, event, self)

    def set_peer(self, peer_session: str) -> None:
        """The destination is known now (slices ready before it wait for it)."""
        self._owner._post(("peer", self, peer_session))

    def seal(self) -> None:
        """The forward is done: send every slice not sent yet, then the seal."""
        self._owner._post(("seal", self, time.perf_counter()))

    def cancel(self) -> None:
        """Send nothing more for this request; its verdict becomes a cancel
        (:class:`TransferError` with ``state="cancelled"``). Slices already handed to the engine
        may still land."""
        self._owner._post(("cancel", self))

    def wait(self, timeout: float | None = None) -> StreamStats:
        """Block until the verdict; return :class:`StreamStats` or raise the failure.

        Raises:
            TransferError: a slice failed (``slice``, ``group`` and ``layers`` name it), the
                request was cancelled, the submitter closed first, or ``timeout`` passed.
        """
        return self._await(timeout, "request")


@dataclass(frozen=True)
class BatchStreamOutcome(RequestVerdicts):
    """What one streamed batch did, request by request.

    ``failed[r]`` is True exactly when an engine call holding blocks of request ``r`` failed;
    ``done[r]`` when every block of request ``r`` landed (every call holding its blocks, slices
    and seal, succeeded). ``errors``: one :class:`TransferError` per failed call, with
    ``requests`` (the batch's request indices the call held), ``slice`` (the slice indices it
    sent, or ``"seal"``) and ``layers``. A request whose call failed is left out of every later
    call, so it never takes other requests down with it."""

    name: str
    session: str
    blocks: int
    bytes: int
    #: Engine calls made (slices and seal).
    calls: int
    #: Slices sent before the seal.
    slices: int
    streamed: bool
    seconds: float
    failed: np.ndarray
    done: np.ndarray
    errors: tuple[TransferError, ...]
    #: Per request, seconds from open to the moment its last block landed (NaN if it failed).
    done_seconds: np.ndarray
    unsignalled_layers: tuple[int, ...] = ()
    unsignalled_slices: tuple[int, ...] = ()
    #: The final notification (the caller's message and the seal's manifests); NIXL delivered
    #: it once every call had completed, other engines leave it to the caller's side channel.
    notification: builtins.bytes = b""


class StreamBatch(_Verdict[BatchStreamOutcome]):
    """A batch plan being streamed: every request of the batch opened at once; each ready
    slice goes out in bounded engine calls covering all of them, and each request gets its
    own verdict (:class:`BatchStreamOutcome`)."""

    def __init__(self, owner: StreamingSubmitter, name: str, batch: BatchPlan,
                 cut: BatchSlices, slices: LayerSlices, peer: str | None, notif: bytes,
                 streamed: bool) -> None:
        super().__init__()
        self.request = name  # what the submitter's messages name
        self._owner = owner
        self._batch = batch
        self._cut = cut
        self._slices = slices
        self._peer = peer
        self._notif = notif
        self.streamed = streamed
        self._columns = (batch.src_addrs, batch.dst_addrs, batch.lengths)
        self._request_segments = batch.request_segments
        segment_requests = batch.segment_requests.tolist()
        # Per segment, what must land before its requests are done (slice indices, -1 the seal).
        self._pending: list[set[int]] = []
        with_blocks: set[int] = set()
        for s in range(cut.n_segments):
            ks, seal = cut.segment_parts(s)
            with_blocks.update(ks)
            self._pending.append(set(ks) | ({-1} if seal else set()))
        self._segment_requests = segment_requests
        layers = slices.layers
        self._waiting: dict[int, set[int]] = {k: set(layers[k]) for k in sorted(with_blocks)}
        self._ready_slices: list[int] = []
        self._sent: set[int] = set()
        self._sealed = False
        self._manifests: list[Manifest] = []
        self._unsignalled: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._t_open = time.perf_counter()
        self._t_last_signal = self._t_open
        n = batch.n_requests
        self._failed_segments = [False] * cut.n_segments
        self._failed = np.zeros(n, dtype=bool)
        self._done_mask = np.zeros(n, dtype=bool)
        self._done_seconds = np.full(n, np.nan)
        self._errors: list[TransferError] = []
        self._blocks = self._bytes = self._calls = 0
        for s, pending in enumerate(self._pending):
            if not pending:  # a segment that moves nothing is done at once
                self._segment_done(s)

    # ------------------------------------------------------------------ caller side
    def request_done(self, request: int) -> bool:
        """Whether every block of batch request ``request`` has landed (never blocks)."""
        return bool(self._done_mask[request])

    def ready(self, layer: int, event: ReadyEvent | None = None) -> None:
        """Layer ``layer`` is written for every request of this batch."""
        self._owner._signal(layer, event, self)

    def set_peer(self, peer_session: str) -> None:
        """The destination is known now."""
        self._owner._post(("peer", self, peer_session))

    def seal(self, manifests: Sequence[Manifest] = ()) -> None:
        """The forward is done: send every slice not sent yet, then the seal. ``manifests``
        (:func:`kvplan.integrity.build_batch_manifests` over the sources, now written) go
        with the final notification."""
        self._manifests = list(manifests)
        self._owner._post(("seal", self, time.perf_counter()))

    def cancel(self) -> None:
        """Send nothing more; the verdict becomes a cancel (``state="cancelled"``)."""
        self._owner._post(("cancel", self))

    def wait(self, timeout: float | None = None) -> BatchStreamOutcome:
        """Block until every call was made; return the per-request outcome (failed calls are
        in it, not raised).

        Raises:
            TransferError: the batch was cancelled, its seal came before layers were signalled
                with ``require_signals``, the submitter closed first, or ``timeout`` passed.
        """
        return self._await(timeout, "batch")

    # ------------------------------------------------------------------ submitter side
    def _segment_done(self, s: int) -> None:
        first, end = self._segment_requests[s], self._segment_requests[s + 1]
        self._done_mask[first:end] = True
        self._done_seconds[first:end] = time.perf_counter() - self._t_open

    def _fail_call(self, index: int, part: list[int] | None, requests: np.ndarray,
                   cause: TransferError) -> None:
        held = [int(r) for r in requests]
        name = "the seal" if part is None else "; ".join(_slice_name(self, k) for k in part)
        err = TransferError(f"streaming: batch {self.request!r}: call {index} of {name} "
                            f"(requests {_ids(held)}) failed: {cause}")
        for field in ("engine", "session", "blocks", "bytes", "status", "agent", "state"):
            setattr(err, field, getattr(cause, field, None))
        err.batch = index
        err.requests = held
        err.request = self.request
        err.slice = "seal" if part is None else part[0]
        err.slices = None if part is None else list(part)
        err.layers = [] if part is None else [layer for k in part
                                              for layer in self._slices.layers[k]]
        self._errors.append(err)
        self._failed[held] = True
        for s in set(self._request_segments[held].tolist()):
            self._failed_segments[s] = True
            first, end = self._segment_requests[s], self._segment_requests[s + 1]
            self._failed[first:end] = True

    def _landed(self, part: list[int] | None) -> None:
        """Every call of ``part`` was waited on: segments not failed have it."""
        keys = [-1] if part is None else part
        for s, pending in enumerate(self._pending):
            if self._failed_segments[s] or not pending:
                continue
            pending.difference_update(keys)
            if not pending:
                self._segment_done(s)


class StreamingSubmitter:
    """Streams requests' layer-group slices through ``transport`` from one thread of its own.

    Args:
        transport: a :class:`kvplan.engines.Transport` (Mooncake, NIXL, ...).
        slices: the default ``LayerSlices`` (``template.layer_slices(groups)``) requests are cut
            with and ready signals are checked against.
        min_stream_bytes: requests moving fewer bytes (plan plus state) ignore ready signals
            and go out in one piece at seal time.
        require_signals: a streamed request some of whose layers were never signalled ready
            before its seal fails with ``TransferError(state="unsignalled")`` naming the slices
            and layers, sending nothing more. By default such slices go out with the seal (the
            forward has written them) and the verdict lists them
            (:attr:`StreamStats.unsignalled_layers`).
        max_blocks_per_batch: passed to ``transport.submit``.
        timeout: per-submission timeout for engines that take one (NIXL).
    """

    def __init__(self, transport: Any, slices: LayerSlices, *,
                 min_stream_bytes: int = DEFAULT_MIN_STREAM_BYTES,
                 max_blocks_per_batch: int | None = None, timeout: float | None = None,
                 require_signals: bool = False) -> None:
        self._transport = transport
        self._slices = slices
        self.min_stream_bytes = min_stream_bytes
        self.require_signals = require_signals
        self._max_blocks = max_blocks_per_batch
        self._timeout = timeout
        self._nixl = getattr(transport, "engine_name", "") == "nixl"
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._open: list[StreamRequest | StreamBatch] = []
        self._numbers: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvplan-streaming", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    def open(self, request: str, plan: TransferPlan, peer_session: str | None, *,
             state_plan: TransferPlan | None = None, notif: bytes = b"",
             slices: LayerSlices | None = None) -> StreamRequest:
        """Start streaming one planned request (``peer_session`` may be ``None`` until
        :meth:`StreamRequest.set_peer`). Cutting the plan is the core's (``slices.of``).

        Raises:
            KvPlanError: the plan (or state plan) is not of the slices' template.
            TransferError: the submitter is closed.
        """
        self._check_open("open")
        slices = self._slices if slices is None else slices
        cut = slices.of(plan)
        state = (state_plan, slices.of(state_plan)) if state_plan is not None else None
        total = plan.total_bytes + (state_plan.total_bytes if state_plan is not None else 0)
        # The completion message names the request in its receipts and final notification.
        req = StreamRequest(self, request, plan, cut, slices, peer_session, state,
                            notif or request.encode(),
                            streamed=total >= self.min_stream_bytes)
        with self._lock:
            self._numbers.setdefault(request, len(self._numbers))
        self._post(("open", req))
        return req

    def open_batch(self, name: str, batch: BatchPlan, peer_session: str | None, *,
                   notif: bytes = b"", slices: LayerSlices | None = None) -> StreamBatch:
        """Start streaming a batch plan (``Template.plan_batch``): every request of it at
        once. Each ready slice goes out in engine calls of at most ``max_blocks_per_batch``
        blocks covering every request (whole segments packed while they fit: the core's
        ``BatchSlices.calls``), and a failed call fails exactly the requests it held. State
        plans are not part of a batch: stream them with :meth:`open`.

        Raises:
            KvPlanError: the batch is not of the slices' template.
            TransferError: the submitter is closed.
        """
        self._check_open("open_batch")
        slices = self._slices if slices is None else slices
        cut = slices.of_batch(batch)
        req = StreamBatch(self, name, batch, cut, slices, peer_session, notif or name.encode(),
                          streamed=batch.total_bytes >= self.min_stream_bytes)
        self._post(("open", req))
        return req

    def ready(self, layer: int, event: ReadyEvent | None = None) -> None:
        """Layer ``layer`` (global id) is written for every open request. Never blocks: the
        signal is queued; ``event.synchronize()`` (a device event recorded after the layer's
        write) runs on the submitter's thread before the layer counts as ready.

        Raises:
            KvPlanError: a layer id the model's layer groups do not have.
            TransferError: the submitter is closed.
        """
        self._signal(layer, event, None)

    def close(self, timeout: float = 30.0) -> None:
        """Stop: requests without a verdict fail (``state="closed"``); the thread is joined."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(("close",))
        self._thread.join(timeout)

    def __enter__(self) -> StreamingSubmitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _request_number(self, request: str) -> int:
        with self._lock:
            return self._numbers.get(request, 0)

    def _check_open(self, what: str) -> None:
        if self._closed:
            err = TransferError(f"streaming: {what} after close(): the submitter is closed")
            err.state = "closed"
            raise err

    def _signal(self, layer: int, event: ReadyEvent | None,
                req: StreamRequest | StreamBatch | None) -> None:
        self._check_open(f"ready({layer})")
        slices = self._slices if req is None else req._slices
        slices.slice_of_layer(layer)  # raises KvPlanError for a layer the model has not
        self._queue.put(("ready", layer, event, req, time.perf_counter()))

    def _post(self, item: tuple[Any, ...]) -> None:
        self._check_open(item[0])
        self._queue.put(item)

    def _run(self) -> None:
        stop = False
        while not stop:
            # Everything queued meanwhile (signals that came while a submission was in the
            # engine) is handled before anything is sent, so the groups it completed go out
            # in one submission: the submitter never falls more than one submission behind.
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._dirty: list[StreamRequest | StreamBatch] = []
            kind = ""
            try:
                for item in items:
                    kind = item[0]
                    if kind == "close":
                        stop = True
                        break
                    self._handle(item)
                kind = "send"
                for req in self._dirty:
                    self._pump(req)
            except BaseException as exc:  # never let the thread die with requests open
                err = TransferError(f"streaming: internal error handling {kind}: {exc!r}")
                for req in list(self._open):
                    req._fail(err)
                self._open.clear()
        closed = TransferError("streaming: the submitter was closed before the request "
                               "completed")
        closed.state = "closed"
        for req in self._open:
            req._fail(closed)
        self._open.clear()

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "open":
            self._open.append(item[1])
            return
        if kind == "ready":
            _, layer, event, target, t = item
            reqs = [target] if target is not None else list(self._open)
            if event is not None:
                try:
                    event.synchronize()
                except Exception as exc:
                    err = TransferError(f"streaming: ready event of layer {layer} failed: "
                                        f"{exc!r}")
                    err.layer = layer
                    for req in reqs:
                        self._finish(req, err)
                    return
            for req in reqs:
                if req.done or req._sealed:
                    continue
                req._t_last_signal = max(req._t_last_signal, t)
                if not req.streamed:
                    continue
                k = req._slices.slice_of_layer(layer)
                waiting = req._waiting.get(k) if k is not None else None
                if k is not None and waiting is not None and layer in waiting:
                    waiting.discard(layer)
                    if not waiting:
                        req._ready_slices.append(k)
                self._mark(req)
            return
        req = item[1]
        if req.done:
            return
        if kind == "peer":
            req._peer = item[2]
            self._mark(req)
        elif kind == "cancel":
            err = TransferError(f"streaming: request {req.request!r} cancelled")
            err.state = "cancelled"
            self._finish(req, err)
        elif kind == "seal":
            req._sealed = True
            req._t_last_signal = max(req._t_last_signal, item[2])
            # The forward is done: every layer is written, whether or not its hook fired; a
            # layer whose hook did not fire is reported (a skipped hook is a bug upstream).
            held = sorted(k for k, waiting in req._waiting.items() if waiting)
            if held and req.streamed:
                layers = tuple(sorted(layer for k in held for layer in req._waiting[k]))
                req._unsignalled = (layers, tuple(held))
                if self.require_signals:
                    names = "; ".join(_slice_name(req, k) for k in held)
                    err = TransferError(
                        f"streaming: request {req.request!r} sealed before layers "
                        f"{_ids(list(layers))} were signalled ready ({names}); nothing more sent")
                    err.state = "unsignalled"
                    err.request = req.request
                    err.slice = held[0]
                    err.layers = list(layers)
                    self._finish(req, err)
                    return
            req._ready_slices.extend(k for k in req._waiting if k not in req._sent
                                     and k not in req._ready_slices)
            self._mark(req)

    def _mark(self, req: StreamRequest | StreamBatch) -> None:
        """``req`` may have something to send once the queued items are handled."""
        if req not in self._dirty:
            self._dirty.append(req)

    def _pump(self, req: StreamRequest | StreamBatch) -> None:
        """Send what is ready; finish the request after its seal."""
        if req._peer is None or req.done:
            return
        if isinstance(req, StreamBatch):
            self._pump_batch(req)
            return
        try:
            if req.streamed:
                if req._ready_slices:
                    # Every ready slice in one submission (per plan), in slice order.
                    ks = sorted(req._ready_slices)
                    req._ready_slices.clear()
                    req._sent.update(ks)
                    parts: list[tuple[TransferPlan, Sequence[tuple[int, int]]]] = [
                        (req._plan, _touching([r for k in ks for r in req._ranges[k]]))]
                    if req._state is not None:
                        parts.append((req._state[0], _touching(
                            [r for k in ks for r in req._state_ranges[k]])))
                    parts = [(p, r) for p, r in parts if r]
                    for i, (plan, ranges) in enumerate(parts):
                        receipt = (slice_receipt(ks, req._notif)
                                   if i == len(parts) - 1 else b"")
                        self._send(req, ranges, plan, what=("slice", ks), notif=receipt)
                    req._confirmed.extend(ks)
            if not req._sealed:
                return
            pieces: list[tuple[TransferPlan, Sequence[tuple[int, int]]]]
            if req.streamed:
                pieces = [(req._plan, req._cut.seal_ranges)]
            else:
                pieces = [(req._plan, [(0, req._plan.n_blocks)] if req._plan.n_blocks else [])]
            if req._state is not None:
                state_plan, state_cut = req._state
                pieces.append((state_plan, state_cut.seal_ranges if req.streamed
                               else [(0, state_plan.n_blocks)] if state_plan.n_blocks else []))
            nonempty = [(p, r) for p, r in pieces if r]
            final = pack_notification([], req._notif, work=_work_record(req))
            for i, (plan, ranges) in enumerate(nonempty):
                self._send(req, ranges, plan, what=("seal", None),
                           notif=final if i == len(nonempty) - 1 else b"")
            if not nonempty and self._nixl:
                self._send(req, [], req._plan, what=("seal", None), notif=final)
        except TransferError as err:
            self._finish(req, err)
            return
        now = time.perf_counter()
        req._result = StreamStats(req.request, req._peer, req._blocks, req._bytes,
                                 req._submissions, len(req._sent), req.streamed,
                                 now - req._t_open, now - req._t_last_signal,
                                 *req._unsignalled, final)
        self._finish(req, None)

    def _pump_batch(self, b: StreamBatch) -> None:
        """Send a batch's ready slices, then (after its seal) the seal and its verdict."""
        if b._ready_slices:
            ks = sorted(b._ready_slices)
            b._ready_slices.clear()
            b._sent.update(ks)
            self._send_batch_part(b, ks)
        if not b._sealed:
            return
        self._send_batch_part(b, None)
        final = pack_notification(b._manifests, b._notif)
        if self._nixl:
            # A bare notification once every call completed, so it never overtakes data.
            assert b._peer is not None
            src, dst, lengths = b._columns
            try:
                self._transport.submit(BlockSlice(src[:0], dst[:0], lengths[:0]), b._peer,
                                       notif=final, timeout=self._timeout)
            except TransferError as exc:
                err = TransferError(f"streaming: batch {b.request!r}: its final notification "
                                    f"failed: {exc}")
                err.state, err.request = getattr(exc, "state", None), b.request
                self._finish(b, err)
                return
        now = time.perf_counter()
        b._result = BatchStreamOutcome(
            b.request, b._peer or "", b._blocks, b._bytes, b._calls, len(b._sent), b.streamed,
            now - b._t_open, b._failed.copy(), b._done_mask.copy(), tuple(b._errors),
            b._done_seconds.copy(), *b._unsignalled, final)
        self._finish(b, None)

    def _send_batch_part(self, b: StreamBatch, part: list[int] | None) -> None:
        """Slices ``part`` (or the seal) of every segment not failed yet: every call posted
        (asynchronously where the engine can), then each waited on; a failed call fails the
        requests it held."""
        assert b._peer is not None
        skip = b._failed_segments
        calls = (b._cut.seal_calls(max_blocks=self._max_blocks, skip_segments=skip)
                 if part is None else
                 b._cut.calls(part, max_blocks=self._max_blocks, skip_segments=skip))
        src, dst, lengths = b._columns
        post = getattr(self._transport, "submit_async", None)
        waiting: list[tuple[int, np.ndarray, Any]] = []
        for index, (ranges, requests) in enumerate(calls):
            pieces = ranges.tolist()
            if len(pieces) == 1:
                ((lo, hi),) = pieces
                view = BlockSlice(src[lo:hi], dst[lo:hi], lengths[lo:hi])
            else:
                view = BlockSlice(*(np.concatenate([c[lo:hi] for lo, hi in pieces])
                                   for c in (src, dst, lengths)))
            b._calls += 1
            try:
                if post is not None:
                    waiting.append((index, requests, post(view, b._peer, len(view))))
                else:
                    self._count(b, self._transport.submit(view, b._peer, len(view)))
            except TransferError as exc:
                b._fail_call(index, part, requests, exc)
        for index, requests, handle in waiting:
            try:
                # Mooncake's handle takes no timeout (its status call blocks until the end).
                stats = (handle.wait() if self._timeout is None or not self._nixl
                         else handle.wait(self._timeout))
            except TransferError as exc:
                b._fail_call(index, part, requests, exc)
            else:
                self._count(b, stats)
        b._landed(part)

    @staticmethod
    def _count(b: StreamBatch, stats: Any) -> None:
        b._blocks += stats.blocks
        b._bytes += stats.bytes

    def _send(self, req: StreamRequest, ranges: Sequence[tuple[int, int]], plan: TransferPlan,
              *, what: tuple[str, list[int] | None], notif: bytes) -> None:
        """Submit ``ranges`` of ``plan`` in one submission (a view for one range, the ranges'
        blocks gathered for several); with NIXL ``notif`` rides it."""
        assert req._peer is not None
        src, dst, lengths = req._columns[id(plan)]
        if len(ranges) == 1:
            ((a, b),) = ranges
            views = [BlockSlice(src[a:b], dst[a:b], lengths[a:b])]
        elif ranges:
            views = [BlockSlice(*(np.concatenate([c[a:b] for a, b in ranges])
                                 for c in (src, dst, lengths)))]
        else:  # a bare notification (NIXL) for a request that moves nothing
            views = [BlockSlice(src[:0], dst[:0], lengths[:0])]
        for i, view in enumerate(views):
            kw: dict[str, Any] = {}
            if self._nixl:
                kw = {"notif": notif if i == len(views) - 1 else b"",
                      "timeout": self._timeout}
            try:
                stats = self._transport.submit(view, req._peer, self._max_blocks, **kw)
            except TransferError as exc:
                raise _slice_error(req, what, exc) from exc
            req._blocks += stats.blocks
            req._bytes += stats.bytes
            req._submissions += 1

    def _finish(self, req: StreamRequest | StreamBatch, err: TransferError | None) -> None:
        if err is not None:
            req._fail(err)
        else:
            req._done.set()
        if req in self._open:
            self._open.remove(req)


def _slice_error(req: StreamRequest, what: tuple[str, list[int] | None],
                 cause: TransferError) -> TransferError:
    kind, ks = what
    if kind == "slice" and ks:
        k = ks[0]
        group = req._slices.group_ids[k]
        layers = [layer for j in ks for layer in req._slices.layers[j]]
        name = "; ".join(_slice_name(req, j) for j in ks)
    else:
        k, group, layers, name = None, None, [], "the seal"
    err = TransferError(f"streaming: request {req.request!r}: {name} failed: {cause}")
    for field in ("engine", "session", "batch", "blocks", "bytes", "status", "agent", "state"):
        setattr(err, field, getattr(cause, field, None))
    err.request = req.request
    err.slice = k if kind == "slice" else "seal"
    err.group = group
    err.layers = layers
    return err


def _slice_name(req: StreamRequest | StreamBatch, k: int) -> str:
    return (f"slice {k} (layer group {req._slices.group_ids[k]}, layers "
            f"{_ids(req._slices.layers[k])})")


def _ids(ids: Sequence[int]) -> str:
    if not ids:
        return "none"
    arr = np.asarray(ids)
    breaks = np.flatnonzero(np.diff(arr) != 1)
    starts = [int(arr[0]), *(int(arr[b + 1]) for b in breaks)]
    stops = [*(int(arr[b]) for b in breaks), int(arr[-1])]
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in zip(starts, stops))



def slice_receipt(slices: Sequence[int], message: bytes) -> bytes:
    """The NIXL notification that says ``slices`` of the request whose completion message is
    ``message`` have landed: magic ``KVSR``, the count (u32) and slice indices (u32 each),
    the message."""
    return (_RECEIPT.pack(_RECEIPT_MAGIC, len(slices)) + struct.pack(f"<{len(slices)}I", *slices)
            + bytes(message))


def read_receipt(data: bytes) -> tuple[list[int], bytes] | None:
    """``(slices, message)`` of a :func:`slice_receipt`; ``None`` for any other
    notification."""
    data = bytes(data)
    if len(data) < _RECEIPT.size or data[:4] != _RECEIPT_MAGIC:
        return None
    n = _RECEIPT.unpack_from(data)[1]
    at = _RECEIPT.size + 4 * n
    if at > len(data):
        return None
    return list(struct.unpack_from(f"<{n}I", data, _RECEIPT.size)), data[at:]


def _touching(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (ascending) with ranges that touch merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _work_record(req: StreamRequest) -> bytes:
    """Magic ``KVSW``, version u16 (1), streamed u8, reserved u8, the count u32 and indices
    (u32 each) of the slices sent before the seal, then the request's
    :meth:`WorkManifest.to_bytes`."""
    sent = req._confirmed
    return (_RECORD.pack(_RECORD_MAGIC, 1, int(req.streamed), 0, len(sent))
            + struct.pack(f"<{len(sent)}I", *sent) + req.manifest.to_bytes())


def _read_record(data: bytes) -> tuple[bool, list[int], WorkManifest]:
    if len(data) < _RECORD.size or data[:4] != _RECORD_MAGIC:
        raise KvPlanError(f"not a streaming work record ({len(data)} bytes)")
    _, version, streamed, _, n = _RECORD.unpack_from(data)
    if version != 1:
        raise KvPlanError(f"streaming work record version {version}; this build reads 1")
    at = _RECORD.size + 4 * n
    if at > len(data):
        raise KvPlanError(f"streaming work record lists {n} slices but is {len(data)} bytes")
    sent = list(struct.unpack_from(f"<{n}I", data, _RECORD.size))
    return bool(streamed), sent, WorkManifest.from_bytes(data[at:])


@dataclass(frozen=True)
class StreamCompleteness:
    """What the decode knows about one streamed request from one prefill peer."""

    #: ``"complete"``, ``"missing"`` (the final notification arrived, a slice did not) or
    #: ``"in_flight"`` (the final notification has not arrived yet).
    state: str
    #: The expected-work manifest (``None`` while in flight).
    manifest: WorkManifest | None
    #: Slices (indices into the manifest's ``slices``) expected and not arrived.
    missing: tuple[int, ...]
    #: Slices the decode holds evidence for.
    arrived: tuple[int, ...]
    #: One line for a log: what is missing (slice, layer group, blocks, bytes) or in flight.
    detail: str

    @property
    def complete(self) -> bool:
        return self.state == "complete"


def check_stream(final: bytes | None, arrived: Sequence[int] | None = None,
                 message: bytes | None = None) -> StreamCompleteness:
    """The decode's completeness check of one streamed request from one prefill peer.

    ``final``: the request's final notification (NIXL delivered it; with Mooncake the prefill
    sent :attr:`StreamStats.notification` through the caller's side channel), or ``None`` if it
    has not arrived. ``arrived``: the slices the decode saw receipts for (NIXL's
    :func:`slice_receipt` notifications); ``None`` takes the slices the prefill reports sent
    (engines without notifications at the target, whose writes return once applied).

    Raises:
        KvPlanError: ``final`` is not a final notification (or not of ``message``).
    """
    seen = tuple(sorted(set(arrived))) if arrived is not None else ()
    if final is None:
        return StreamCompleteness("in_flight", None, (), seen,
                                  f"final notification not arrived; slices seen {list(seen)}")
    final = bytes(final)
    if not is_notification(final):
        raise KvPlanError(f"not a final notification ({len(final)} bytes)")
    got, _ = read_notification(final)
    if message is not None and got != message:
        raise KvPlanError(f"final notification of {got!r}, expected {message!r}")
    work = read_work(final)
    if not work:
        raise KvPlanError("the notification carries no work record (not a streamed request)")
    streamed, sent, manifest = _read_record(work)
    expected = [k for k, (_, blocks, _) in enumerate(manifest.slices) if blocks]
    if not streamed:  # one piece with the final notification: it arrived, so did every slice
        have = set(expected)
    else:
        have = set(seen) if arrived is not None else set(sent)
    missing = tuple(k for k in expected if k not in have)
    if not missing:
        return StreamCompleteness("complete", manifest, (), tuple(sorted(have)),
                                  f"request {manifest.request}: complete "
                                  f"({manifest.total_blocks} blocks, {manifest.total_bytes} "
                                  f"bytes)")
    names = "; ".join(f"slice {k} (layer group {manifest.slices[k][0]}, "
                      f"{manifest.slices[k][1]} blocks, {manifest.slices[k][2]} bytes)"
                      for k in missing)
    return StreamCompleteness("missing", manifest, missing, tuple(sorted(have)),
                              f"request {manifest.request}: missing {names}")
