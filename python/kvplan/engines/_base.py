"""Engine-independent half of the transfer adapters: plan intake, batching, stats, errors.

An adapter subclass only says how to talk to one engine, by implementing hooks (initialise,
register a list of regions, write one batch: as Python lists, or as the uint64 array views
themselves). Everything that must be identical across engines lives here:

* ``register(layout)`` turns a layout into whole, non-overlapping regions and registers each one
  exactly once (Mooncake rejects overlapping or repeated registrations with ``-7``; memfabric
  aligns regions to 2 MiB, so neighbours are registered in one call).
* ``submit(plan, peer_session)`` cuts the plan into bounded batches of array *views*
  (:func:`write_batches`, the one batching loop) and hands each to the array hook; its default
  converts each batch to Python lists once (``.tolist()``; the bindings take lists about 3x
  faster than numpy arrays) for the list hook. No loop over blocks in Python.
* Async submissions (``_submit_async``) share the same loop; each engine's handle derives from
  :class:`PendingBase`, the one pending protocol (``done``, ``wait()``, ``stats``, context
  manager).
* A non-zero engine status, or an exception from the binding, becomes :class:`TransferError`
  naming the session, the batch index, its blocks and bytes, and the status.
* Integrity (:mod:`kvplan.integrity`): the prefill digests what it sends over its registered
  memory (:meth:`Transport.manifest`) and passes the request's manifests to the last
  ``submit(..., manifest=...)``; the packed notification comes back as
  :attr:`TransferStats.integrity` (NIXL has already delivered it with the completion
  notification; other engines leave it to the caller's side channel). The decode checks what
  landed in its registered memory with :meth:`Transport.check_landed`, which raises
  :class:`kvplan.IntegrityError` naming the template and the first pair that differs.

Nothing here imports an engine package.
"""

from __future__ import annotations

import builtins
import ctypes
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvplan._core import KvPlanError, BlockSlice
from kvplan._errors import TransferError  # the class `kvplan.TransferError` re-exports
from kvplan.integrity import Manifest, build_manifest, check_notification, pack_notification
from kvplan.leases import Lease, LeaseTable

if TYPE_CHECKING:
    from kvplan._core import BatchPlan, Layout, Template, TransferPlan

__all__ = [
    "BatchOutcome",
    "PendingBase",
    "PlanLike",
    "Transport",
    "TransferError",
    "TransferStats",
    "batch_calls",
    "integrity_notification",
    "plan_arrays",
    "merge_regions",
    "write_batches",
]


U64 = npt.NDArray[np.uint64]


class PlanLike(Protocol):
    """Anything with three equally long 1-D uint64 arrays: a :class:`kvplan.TransferPlan`,
    a ``BlockSlice``, or a hand-built object in tests."""

    @property
    def src_addrs(self) -> npt.ArrayLike: ...
    @property
    def dst_addrs(self) -> npt.ArrayLike: ...
    @property
    def lengths(self) -> npt.ArrayLike: ...


P = TypeVar("P", bound="PendingBase")
S = TypeVar("S")  # an engine status, returned as the engine gave it


class PendingBase(ABC):
    """The one pending protocol: the handle every engine's ``submit_async`` returns.

    * :attr:`done`: True once every batch finished (successfully or not); never blocks.
    * :meth:`wait`: block until every batch finished; returns :class:`TransferStats` (the same
      object on every later call) or raises the first failure as :class:`TransferError`.
    * :attr:`stats`: the :class:`TransferStats` once :meth:`wait` succeeded, else ``None``.
    * As a context manager it waits on exit; a transfer error is raised unless the block is
      already leaving with another exception.

    The submission side (called by :meth:`Transport._submit_async`, which owns the batch loop):
    :meth:`_post_batch` once per bounded batch, :meth:`_abort` when posting raised, and
    :meth:`_submitted` once every batch was posted.
    """

    def __init__(self, peer: str, lengths: U64) -> None:
        self._t0 = time.perf_counter()
        self._peer = peer
        self._lengths = lengths
        self._n_batches = 0  # counted by the submission loop, one per posted batch
        self._error: TransferError | None = None
        self._stats: TransferStats | None = None
        self._integrity = b""  # the packed manifests of ``manifest=``, for the stats

    @property
    @abstractmethod
    def done(self) -> bool:
        """True once every batch finished (successfully or not); never blocks."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> TransferStats:
        """Block until every batch finished; raise :class:`TransferError` for a failure."""

    @property
    def stats(self) -> TransferStats | None:
        """What the submission moved, once :meth:`wait` returned; ``None`` before or on failure."""
        return self._stats

    @abstractmethod
    def _post_batch(self, index: int, lo: int, hi: int, src: U64, dst: U64, lengths: U64, *,
                    last: bool) -> None:
        """Hand batch ``index`` (blocks ``lo:hi`` of the submission, as array views) to the
        engine; ``last`` marks the final batch. Raises :class:`TransferError` on failure."""

    def _abort(self, exc: BaseException) -> None:
        """Posting a batch raised ``exc`` (re-raised afterwards): clean up what was posted."""

    def _submitted(self) -> None:
        """Every batch was handed to the engine (none for an empty plan)."""

    def _succeeded(self) -> TransferStats:
        """Record (once) and return the stats of a submission whose every batch landed."""
        if self._stats is None:
            lengths = self._lengths
            self._stats = TransferStats(self._peer, len(lengths),
                                        int(lengths.sum(dtype=np.uint64)), self._n_batches,
                                        time.perf_counter() - self._t0, self._integrity)
        return self._stats

    def __enter__(self: P) -> P:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.wait()
        except TransferError:
            if exc_type is None:
                raise


@dataclass(frozen=True)
class TransferStats:
    """What one ``submit`` moved: blocks, bytes, engine calls and wall time.

    ``integrity``: with ``submit(..., manifest=...)``, the integrity notification for the
    decode (:func:`kvplan.integrity.pack_notification` of the manifests); NIXL delivered it
    as the completion notification, other engines leave it to the caller's side channel
    (send it once ``submit`` returned: every byte has landed then). Empty otherwise.
    """

    session: str
    blocks: int
    bytes: int
    batches: int
    seconds: float
    integrity: builtins.bytes = b""  # `bytes` here would name the field above

    @property
    def throughput(self) -> float:
        """Bytes per second (0.0 for an empty or instantaneous transfer)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_block(self) -> float:
        """Mean bytes per block (descriptor) of this submission (0.0 when it moved no block):
        what an engine's per-descriptor cost is spread over."""
        return self.bytes / self.blocks if self.blocks > 0 else 0.0


class RequestVerdicts:
    """Per-request verdicts of a batch outcome: ``failed[r]`` (a call holding blocks of request
    ``r`` failed) and one error per failed call."""

    failed: npt.NDArray[np.bool_]
    errors: tuple[TransferError, ...]

    @property
    def ok(self) -> bool:
        """True when every request landed."""
        return not self.errors

    @property
    def failed_requests(self) -> list[int]:
        """Indices of the requests a failed call held, ascending."""
        return [int(r) for r in np.flatnonzero(self.failed)]


@dataclass(frozen=True)
class BatchOutcome(RequestVerdicts):
    """What one ``submit_batch`` did, request by request.

    ``failed[r]`` is True exactly when an engine call that held blocks of request ``r``
    failed (a request's blocks all landed when it is False). ``errors`` holds one
    :class:`TransferError` per failed call, each with ``requests`` (the request indices that
    call held, :meth:`kvplan.BatchPlan.requests_in`) and ``batch`` (the call's index in
    ``BatchPlan.call_ranges``). The other calls were submitted and waited on all the same.
    """

    session: str
    blocks: int
    bytes: int
    calls: int
    seconds: float
    failed: npt.NDArray[np.bool_]
    errors: tuple[TransferError, ...]


def _as_u64(name: str, values: npt.ArrayLike) -> U64:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise TypeError(f"plan.{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint64:
        return arr
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"plan.{name} must hold integers, got dtype {arr.dtype}")
    # Signed input: a negative value would make the binding raise mid-plan; refuse it up front.
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"plan.{name} holds a negative value ({int(arr.min())})")
    return arr.astype(np.uint64)


def plan_arrays(plan: PlanLike) -> tuple[U64, U64, U64]:
    """Return ``(src_addrs, dst_addrs, lengths)`` as 1-D uint64 arrays (no copy when already so).

    Raises:
        TypeError: an array is not 1-D or not integer.
        ValueError: the three arrays differ in length or hold negative values.
    """
    src = _as_u64("src_addrs", plan.src_addrs)
    dst = _as_u64("dst_addrs", plan.dst_addrs)
    lengths = _as_u64("lengths", plan.lengths)
    if not (len(src) == len(dst) == len(lengths)):
        raise ValueError(
            f"plan arrays differ in length: src_addrs={len(src)} dst_addrs={len(dst)} "
            f"lengths={len(lengths)}"
        )
    return src, dst, lengths


#: What a ``manifest=`` argument may be: one plan's manifest, or every plan's of a request (the
#: page plan's first, then the state plan's), as :func:`kvplan.integrity.check_notification`
#: expects them.
Manifests = Manifest | Sequence[Manifest]


def integrity_notification(manifest: Manifests | None, message: bytes = b"") -> bytes:
    """The packed integrity notification of ``manifest`` carrying the caller's completion
    ``message``; empty when there is no manifest."""
    if manifest is None:
        return b""
    manifests = [manifest] if isinstance(manifest, Manifest) else list(manifest)
    return pack_notification(manifests, message)


def _host_device(device: str) -> bool:
    """Whether ``device`` names host memory (what the digests can read in place)."""
    name, _, index = device.strip().lower().partition(":")
    return name in ("", "cpu", "dram") and not index


def merge_regions(ptrs: Sequence[int] | npt.ArrayLike, lens: Sequence[int] | npt.ArrayLike
                  ) -> list[tuple[int, int]]:
    """Union of ``[ptr, ptr + len)`` buffers as sorted, non-overlapping ``(start, length)`` pairs.

    Zero-length buffers (elided entries) are dropped. Overlapping or repeated buffers are merged
    (a layout may list the same pool twice, e.g. K and V views of one allocation). Buffers that
    merely touch stay separate: engines accept neighbours, and keeping them apart keeps each
    registration equal to one real allocation.
    """
    starts = np.asarray(ptrs, dtype=np.uint64).ravel()
    sizes = np.asarray(lens, dtype=np.uint64).ravel()
    if starts.shape != sizes.shape:
        raise ValueError(f"{starts.size} buffer pointers but {sizes.size} lengths")
    keep = sizes > 0
    starts, sizes = starts[keep], sizes[keep]
    order = np.argsort(starts, kind="stable")
    merged: list[list[int]] = []
    # One pass over buffers (tens to hundreds per layout), not over blocks.
    for s, n in zip(starts[order].tolist(), sizes[order].tolist()):
        end = s + n
        if merged and s < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([s, end])
    return [(s, e - s) for s, e in merged]


class _InFlight:
    """Caps the blocks in flight per peer across threads and async batches.

    Mooncake TCP admits about 1,024 queued plus 1,024 pending entries per peer; beyond that a
    call fails with only part of the data landed. A batch larger than the cap is still allowed
    when nothing else is in flight (the caller chose that batch size explicitly).
    """

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._cond = threading.Condition()
        self._used: dict[str, int] = {}

    def acquire(self, peer: str, n: int, *, blocking: bool = True) -> bool:
        if self.cap is None:
            return True
        with self._cond:
            while True:
                used = self._used.get(peer, 0)
                if used == 0 or used + n <= self.cap:
                    self._used[peer] = used + n
                    return True
                if not blocking:
                    return False
                self._cond.wait()

    def release(self, peer: str, n: int) -> None:
        if self.cap is None:
            return
        with self._cond:
            left = self._used.get(peer, 0) - n
            if left > 0:
                self._used[peer] = left
            else:
                self._used.pop(peer, None)
            self._cond.notify_all()


class Transport:
    """Base class of the engine adapters. Subclasses implement the ``_engine_*`` hooks:

    * ``_engine_session_id``, ``_engine_register`` / ``_engine_unregister`` (lists of regions);
    * ``_engine_write`` (one batch as Python lists), or ``_engine_write_arrays`` (one batch as
      uint64 array views; the default converts once and calls ``_engine_write``);
    * optionally ``_engine_memory`` (refuse a device, before anything is registered),
      ``_error_origin`` (how the engine's errors name their origin) and ``_describe_failure``.

    An engine with asynchronous submission returns a :class:`PendingBase` subclass from a
    ``submit_async`` that calls :meth:`_submit_async` (the one async batch loop).

    Class attributes a subclass sets:
        engine_name: shown in errors (``"mooncake"``, ``"memfabric"``).
        default_max_blocks_per_batch: batch bound used when ``submit`` is not given one
            (``None`` = whole plan in one call).
        status_names: engine status code -> symbolic name, for error messages.
        wait_takes_timeout: whether the handles of ``submit_async`` honour ``wait(timeout)``
            (``submit_batch`` refuses a ``timeout`` up front where they do not).
    """

    engine_name = "engine"
    default_max_blocks_per_batch: int | None = None
    status_names: dict[int, str] = {}
    wait_takes_timeout = True

    def __init__(self, *, max_blocks_per_batch: int | None = None,
                 max_blocks_in_flight: int | None = None) -> None:
        if max_blocks_per_batch is not None and max_blocks_per_batch <= 0:
            raise ValueError(f"max_blocks_per_batch must be positive, got {max_blocks_per_batch}")
        self.max_blocks_per_batch = (max_blocks_per_batch if max_blocks_per_batch is not None
                                     else self.default_max_blocks_per_batch)
        self._in_flight = _InFlight(max_blocks_in_flight)
        # Sorted, non-overlapping (start, end) of every region registered through this adapter.
        self._regions: list[tuple[int, int]] = []
        self._region_devices: dict[int, str] = {}  # region start -> device it was registered as
        self._reg_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ engine hooks
    def _engine_memory(self, device: str) -> None:
        """Refuse ``device`` (raise) before any of its buffers is registered; default: accept."""

    def _engine_register(self, ptrs: list[int], lens: list[int], device: str) -> int:
        """Register the regions (``device`` memory, already accepted by ``_engine_memory``)."""
        raise NotImplementedError

    def _engine_unregister(self, ptrs: list[int]) -> int:
        raise NotImplementedError

    def _engine_write_arrays(self, peer: str, src: U64, dst: U64, lengths: U64) -> int:
        """Write one bounded batch, given as uint64 array views; returns the engine status.

        The default converts the columns to Python lists once (the bindings want lists, and
        ``.tolist()`` is the fast path) and calls the list hook :meth:`_engine_write`.
        """
        return self._engine_write(peer, src.tolist(), dst.tolist(), lengths.tolist())

    def _engine_write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        """Write one bounded batch, given as Python lists; returns the engine status."""
        raise NotImplementedError

    def _engine_session_id(self) -> str:
        raise NotImplementedError

    def _describe_failure(self, peer: str, status: int) -> str:
        """Extra context for an error message (e.g. a reachability probe). Never raises."""
        return ""

    def _error_origin(self, msg: str) -> tuple[str, dict[str, Any]]:
        """``msg`` as this engine's errors word it, and the extra attributes they carry."""
        return msg, {}

    # ------------------------------------------------------------------ public API
    def local_session_id(self) -> str:
        """The id peers pass as ``peer_session`` to write into this process (``"host:port"``)."""
        self._check_open()
        return self._engine_session_id()

    @property
    def registered_regions(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every region this adapter registered, sorted by address."""
        return [(s, e - s) for s, e in self._regions]

    def register(self, layout: Layout) -> int:
        """Register every buffer of ``layout`` with the engine, each region exactly once.

        ``layout`` is a :class:`kvplan.Layout` (anything with ``data_ptrs`` and ``data_lens``;
        ``device`` is read when present, else ``"cpu"``). Overlapping or repeated buffers are
        merged, buffers already inside a registered region are skipped, so calling it again for
        a layout sharing pools with an earlier one is safe.

        Returns:
            The number of new regions handed to the engine (0 if nothing was new).

        Raises:
            TransferError: the engine refused the registration, or a buffer partly overlaps a
                region registered earlier (engines reject overlaps; re-register whole pools).
        """
        return self.register_buffers(list(layout.data_ptrs), list(layout.data_lens),
                                     getattr(layout, "device", "cpu"))

    def register_buffers(self, ptrs: Sequence[int], lens: Sequence[int],
                         device: str = "cpu") -> int:
        """Register raw ``(ptr, len)`` buffers of ``device`` memory; same rules as
        :meth:`register`."""
        self._engine_memory(device)
        self._check_open()
        with self._reg_lock:
            fresh: list[tuple[int, int]] = []
            for start, length in merge_regions(ptrs, lens):
                end = start + length
                host = self._find_region(start, end)
                if host == "inside":
                    continue  # already covered by one earlier registration
                if host == "partial":
                    raise self._error(
                        f"cannot register [{start:#x}, {end:#x}): it partly overlaps a region "
                        f"registered earlier ({self.engine_name} rejects overlapping regions)",
                        peer=None, status=None,
                    )
                fresh.append((start, length))
            if not fresh:
                return 0
            addrs = [s for s, _ in fresh]
            sizes = [n for _, n in fresh]
            # Equal lengths by construction; Mooncake segfaults on unequal lists, so say it.
            assert len(addrs) == len(sizes)
            try:
                status = self._engine_register(addrs, sizes, device)
            except TransferError:
                raise
            except Exception as exc:
                raise self._error(f"register of {len(addrs)} regions raised {exc!r}",
                                  peer=None, status=None) from exc
            if status != 0:
                raise self._error(
                    f"register of {len(addrs)} regions ({sum(sizes)} bytes) failed",
                    peer=None, status=status,
                )
            self._regions = sorted(self._regions + [(s, s + n) for s, n in fresh])
            self._region_devices.update((s, device) for s, _ in fresh)
            return len(fresh)

    def unregister_all(self) -> None:
        """Unregister every region this adapter registered (best effort, never raises)."""
        with self._reg_lock:
            if self._regions and not self._closed:
                try:
                    self._engine_unregister([s for s, _ in self._regions])
                except Exception:  # teardown path: the engine may already be gone
                    pass
            self._regions = []
            self._region_devices = {}

    def check_sources(self, plan: PlanLike) -> None:
        """Raise :class:`TransferError` unless every source range lies inside one registered region.

        TCP engines do not check sources and would send whatever memory the address points at.
        Vectorised: one ``searchsorted`` over the region starts.
        """
        src, _, lengths = plan_arrays(plan)
        if len(src) == 0:
            return
        if not self._regions:
            raise self._error("no local memory registered; call register(layout) first",
                              peer=None, status=None)
        starts = np.array([s for s, _ in self._regions], dtype=np.uint64)
        ends = np.array([e for _, e in self._regions], dtype=np.uint64)
        idx = np.searchsorted(starts, src, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        end = src + lengths
        ok &= (end >= src) & (end <= ends[safe])  # end >= src: no u64 wrap-around
        if not bool(ok.all()):
            bad = int(np.flatnonzero(~ok)[0])
            raise self._error(
                f"block {bad}: source [{int(src[bad]):#x}, +{int(lengths[bad])}) is not inside "
                f"a registered region",
                peer=None, status=None,
            )

    def submit(self, plan: PlanLike, peer_session: str,
               max_blocks_per_batch: int | None = None, *, check_sources: bool = True,
               manifest: Manifests | None = None) -> TransferStats:
        """Write every block of ``plan`` to ``peer_session``, batch by batch, synchronously.

        Args:
            plan: a :class:`kvplan.TransferPlan` or any object with uint64 ``src_addrs``,
                ``dst_addrs`` and ``lengths``.
            peer_session: the peer's ``local_session_id()``.
            max_blocks_per_batch: blocks per engine call; default is the adapter's bound
                (1,024 for Mooncake TCP).
            check_sources: verify that every source range is locally registered first.
            manifest: the request's integrity manifests (:meth:`manifest`), given with its
                last plan: packed into :attr:`TransferStats.integrity` for the caller's side
                channel to the decode.

        Returns:
            :class:`TransferStats` for the whole plan.

        Raises:
            TransferError: an engine call returned non-zero or raised. Earlier batches have
                landed; blocks of the failed batch may have partly landed or still be in
                flight, so the destination must not be reused until the peer is torn down.
        """
        self._check_open()
        src, dst, lengths = self._prepare(plan, check_sources)
        bound = self._batch_bound(max_blocks_per_batch)
        t0 = time.perf_counter()

        def write(index: int, s: U64, d: U64, n: U64) -> int:
            self._write_batch(peer_session, index, s, d, n)  # raises on a non-zero status
            return 0

        n_batches, _ = write_batches(src, dst, lengths, bound, write)
        seconds = time.perf_counter() - t0
        return TransferStats(peer_session, len(src), int(lengths.sum(dtype=np.uint64)),
                             n_batches, seconds, integrity_notification(manifest))

    def submit_batch(self, batch: BatchPlan, peer_session: str,
                     max_blocks_per_batch: int | None = None, *, check_sources: bool = True,
                     timeout: float | None = None) -> BatchOutcome:
        """Write a batch plan (:meth:`kvplan.Template.plan_batch`) to ``peer_session`` in
        bounded engine calls and report which requests failed.

        The calls are ``batch.call_ranges(bound)`` (whole segments packed, so a failed call
        holds as few requests as the sizes allow); every call is posted, then waited on, and a
        failed call marks exactly the requests it held as failed: the others are not affected.
        Engines with ``submit_async`` have every call in flight at once (within the per-peer
        budget); the others write them one after the other. ``timeout``: seconds each call is
        waited on, for engines whose handle takes one (NIXL); default the adapter's.

        Raises:
            KvPlanError: ``timeout`` is not a positive finite number of seconds, or this engine
                cannot bound a wait (Mooncake, whose status call blocks until the batch ends;
                an engine without ``submit_async``): refused before any call is posted.
            TransferError: only for what no call owns (the transport is closed, a source is
                not registered with ``check_sources``); engine failures are in the outcome.
        """
        post = getattr(self, "submit_async", None)
        if timeout is not None:
            self._check_batch_timeout(timeout, asynchronous=post is not None)
        self._check_open()
        src, dst, lengths = plan_arrays(batch)
        if check_sources:
            self.check_sources(batch)
        calls = batch_calls(batch, self._batch_bound(max_blocks_per_batch))
        t0 = time.perf_counter()
        failed = np.zeros(batch.n_requests, dtype=bool)
        errors: list[TransferError] = []

        def fail(index: int, lo: int, hi: int, err: TransferError) -> None:
            held = batch.requests_in(lo, hi)
            failed[held] = True
            err.requests = held.tolist()
            err.batch = index
            errors.append(err)

        pending: list[tuple[int, int, int, Any]] = []
        for index, (lo, hi, view) in enumerate(calls):
            try:
                if post is not None:
                    pending.append((index, lo, hi, post(view, peer_session, hi - lo,
                                                        check_sources=False)))
                else:
                    self.submit(view, peer_session, hi - lo, check_sources=False)
            except TransferError as err:
                fail(index, lo, hi, err)
        for index, lo, hi, handle in pending:
            try:
                # Mooncake's handle takes no timeout (its status call blocks until the end).
                handle.wait() if timeout is None else handle.wait(timeout)
            except TransferError as err:
                fail(index, lo, hi, err)
        errors.sort(key=lambda e: e.batch or 0)
        return BatchOutcome(peer_session, len(src), int(lengths.sum(dtype=np.uint64)),
                            len(calls), time.perf_counter() - t0, failed, tuple(errors))

    def _check_batch_timeout(self, timeout: object, *, asynchronous: bool) -> None:
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or timeout <= 0):
            raise KvPlanError(f"timeout must be a positive finite number of seconds, got "
                              f"{type(timeout).__name__} {timeout!r}")
        if not asynchronous or not self.wait_takes_timeout:
            how = ("its batch status call blocks until the batch ends"
                   if asynchronous else "it writes each call synchronously")
            raise KvPlanError(f"{self.engine_name}: submit_batch cannot honour timeout="
                              f"{timeout!r}: {how}; nothing was posted. Pass timeout=None "
                              f"(this engine's own transfer timeout applies)")

    def _submit_async(self, plan: PlanLike, peer_session: str,
                      max_blocks_per_batch: int | None, check_sources: bool,
                      open_pending: Callable[[U64], P], integrity: bytes = b"") -> P:
        """The async batch loop behind every engine's ``submit_async``: the plan's bounded
        batches posted, in order, into the handle ``open_pending(lengths)`` returns (called once
        the plan was accepted). When posting raises, the handle cleans up (``_abort``) and the
        error propagates; once all are posted the handle is told (``_submitted``).
        ``integrity`` (packed manifests) ends up in the handle's stats."""
        self._check_open()
        src, dst, lengths = self._prepare(plan, check_sources)
        bound = self._batch_bound(max_blocks_per_batch)
        pending = open_pending(lengths)
        pending._integrity = integrity
        batches = list(_batch_bounds(len(src), bound))
        last = len(batches) - 1
        try:
            for index, (lo, hi) in enumerate(batches):
                pending._n_batches += 1
                pending._post_batch(index, lo, hi, src[lo:hi], dst[lo:hi], lengths[lo:hi],
                                    last=index == last)
        except BaseException as exc:
            pending._abort(exc)
            raise
        pending._submitted()
        return pending

    # ------------------------------------------------------------------ integrity
    def registered_buffers(self) -> list[npt.NDArray[np.uint8]]:
        """Every region this adapter registered, as a uint8 array viewing it in place (no
        copy): the memory the integrity digests read. The views are valid while the regions
        stay registered.

        Raises:
            TransferError: a region is device memory (``cuda:0``, an NPU), which the host
                cannot read in place: pass host ``buffers=`` to :meth:`manifest` or
                :meth:`check_landed` instead.
        """
        self._check_open()
        with self._reg_lock:
            regions = list(self._regions)
            devices = dict(self._region_devices)
        views = []
        for start, end in regions:
            device = devices.get(start, "cpu")
            if not _host_device(device):
                raise self._error(
                    f"region [{start:#x}, {end:#x}) is {device} memory, which the host cannot "
                    f"digest in place; pass host buffers (buffers=...) holding its bytes",
                    peer=None, status=None)
            raw = (ctypes.c_uint8 * (end - start)).from_address(start)
            views.append(np.ctypeslib.as_array(raw))
        return views

    def manifest(self, plan: TransferPlan, *, src_pages: Any, dst_pages: Any,
                 buffers: Sequence[Any] | None = None, lease: Lease | None = None) -> Manifest:
        """The prefill's integrity manifest of ``plan``: its plan digest and the digests of the
        bytes it sends, read from this adapter's registered memory (or ``buffers``).

        ``src_pages`` and ``dst_pages`` are the page arrays the plan was made from (for a
        state plan, the two slots). Pass every plan's manifest of a request to the last
        :meth:`submit` as ``manifest=[...]`` (the page plan's first). ``lease``: the decode's
        lease on the destination pages (:mod:`kvplan.leases`), carried and digested.

        Raises:
            IndexBoundsError: a block lies outside every registered region.
            TransferError: see :meth:`registered_buffers`.
        """
        held = self.registered_buffers() if buffers is None else buffers
        return build_manifest(plan, "src", held, src_pages=src_pages, dst_pages=dst_pages,
                              lease=lease)

    def check_landed(self, received: bytes | Sequence[Manifest], *, src_layout: Layout,
                     dst_layout: Layout, src_pages: Any, dst_pages: Any,
                     src_slot: int | None = None, dst_slot: int | None = None,
                     n_tokens: int | None = None, template: Template | None = None,
                     buffers: Sequence[Any] | None = None, lease: Lease | None = None,
                     leases: LeaseTable | None = None, skip_tokens: int = 0) -> list[Manifest]:
        """The decode-side check of one prefill's request: re-plans it between ``src_layout``
        (as the handshake carried it) and ``dst_layout`` (this side's), digests what landed in
        this adapter's registered memory (or ``buffers``) and compares with ``received`` (the
        prefill's integrity notification, or its manifests). Returns the decode's manifests.
        ``lease``, ``leases`` and ``skip_tokens`` (K of a delta plan, ``plan(...,
        skip_tokens=K)``): as :func:`kvplan.integrity.check_notification`.

        Raises:
            kvplan.IntegrityError: the two sides disagree; ``what``, ``template`` and, for
                content, ``pair``, ``layer`` and ``role`` name the first difference.
            TransferError: see :meth:`registered_buffers`.
        """
        held = self.registered_buffers() if buffers is None else buffers
        return check_notification(received, src_layout=src_layout, dst_layout=dst_layout,
                                  buffers=held, src_pages=src_pages, dst_pages=dst_pages,
                                  src_slot=src_slot, dst_slot=dst_slot, n_tokens=n_tokens,
                                  template=template, lease=lease, leases=leases,
                                  skip_tokens=skip_tokens)

    def close(self) -> None:
        """Unregister memory and release the engine. Further calls raise."""
        if not self._closed:
            self.unregister_all()
            self._closed = True

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise self._error("transport is closed", peer=None, status=None)

    def _find_region(self, start: int, end: int) -> str:
        """``"inside"`` one registered region, ``"partial"`` overlap, or ``"none"``."""
        for s, e in self._regions:
            if s <= start and end <= e:
                return "inside"
            if start < e and s < end:
                return "partial"
        return "none"

    def _prepare(self, plan: PlanLike, check_sources: bool) -> tuple[U64, U64, U64]:
        src, dst, lengths = plan_arrays(plan)
        # Zero-length blocks move nothing; memfabric rejects a whole batch holding one.
        if len(lengths) and not bool(lengths.all()):
            keep = lengths != 0
            src, dst, lengths = src[keep], dst[keep], lengths[keep]
        if check_sources:
            self.check_sources(BlockSlice(src, dst, lengths))
        return src, dst, lengths

    def _batch_bound(self, max_blocks_per_batch: int | None) -> int | None:
        bound = (max_blocks_per_batch if max_blocks_per_batch is not None
                 else self.max_blocks_per_batch)
        if bound is not None and bound <= 0:
            raise ValueError(f"max_blocks_per_batch must be positive, got {bound}")
        return bound

    def _call_batch(self, peer: str, index: int, src: U64, dst: U64, lengths: U64,
                    call: Callable[[str, U64, U64, U64], int], *, hold_budget: bool) -> int:
        """One engine call for one batch (array views); returns what ``call`` returned.

        Reserves the batch's blocks in the per-peer in-flight budget and turns an engine
        exception into a :class:`TransferError` naming the batch. The budget is released when
        the call returns, unless ``hold_budget`` (async batches keep it until waited on).
        """
        n = len(src)
        self._acquire_budget(peer, n)
        try:
            result = call(peer, src, dst, lengths)
        except Exception as exc:
            self._in_flight.release(peer, n)
            raise self._batch_error(peer, index, lengths, status=None, cause=exc) from exc
        if not hold_budget:
            self._in_flight.release(peer, n)
        return result

    def _write_batch(self, peer: str, index: int, src: U64, dst: U64, lengths: U64) -> None:
        status = self._call_batch(peer, index, src, dst, lengths, self._engine_write_arrays,
                                  hold_budget=False)
        if status != 0:
            raise self._batch_error(peer, index, lengths, status=status, cause=None)

    def _acquire_budget(self, peer: str, n: int) -> None:
        """Reserve ``n`` in-flight blocks towards ``peer`` (blocks until they fit)."""
        self._in_flight.acquire(peer, n)

    def _status_text(self, status: int | None) -> str:
        if status is None:
            return "no status"
        name = self.status_names.get(status)
        return f"status {status} ({name})" if name else f"status {status}"

    def _batch_error(self, peer: str, index: int, lengths: U64, *, status: int | None,
                     cause: BaseException | None) -> TransferError:
        n_bytes = int(lengths.sum(dtype=np.uint64))
        what = f"raised {cause!r}" if cause is not None else "failed"
        extra = self._describe_failure(peer, status) if status is not None else ""
        msg = (f"batch {index} ({len(lengths)} blocks, {n_bytes} bytes) to session {peer!r} "
               f"{what}")
        if extra:
            msg += f"; {extra}"
        return self._error(msg, peer=peer, status=status, batch=index, blocks=len(lengths),
                           n_bytes=n_bytes)

    def _error(self, msg: str, *, peer: str | None, status: int | None, batch: int | None = None,
               blocks: int | None = None, n_bytes: int | None = None) -> TransferError:
        msg, attrs = self._error_origin(msg)
        full = f"{self.engine_name}: {msg}"
        if status is not None:
            full += f" [{self._status_text(status)}]"
        err = TransferError(full)
        # Structured fields for callers that react programmatically (retry, blacklist, ...).
        err.engine = self.engine_name
        err.session = peer
        err.batch = batch
        err.blocks = blocks
        err.bytes = n_bytes
        err.status = status
        for name, value in attrs.items():
            setattr(err, name, value)
        return err


#: What :func:`write_batches` cuts: uint64 array views, or Python lists (vLLM's list path
#: converts each column once and slices the lists).
C = TypeVar("C", U64, list[int])


def write_batches(src: C, dst: C, lengths: C, bound: int | None,
                  write: Callable[[int, C, C, C], S], *,
                  call_empty: bool = False) -> tuple[int, S | int]:
    """The one batching loop: ``write(index, src, dst, lengths)`` for each batch of at most
    ``bound`` blocks (slices: views of arrays, no copy), in order, stopping at the first
    non-zero status: later batches are not written.

    An empty plan is no call, unless ``call_empty`` (one call with the empty columns, as
    vLLM's ``_send_blocks`` hands its engine whatever it was given).

    Returns ``(batches handed to write, status)``: the status is 0 when every batch was
    written, else the failed batch's (the last one handed over), unchanged.
    """
    n = len(src)
    if n == 0 and not call_empty:
        return 0, 0  # empty engine calls are skipped
    if bound is None or n <= bound:  # one batch (the common case): the columns as they are
        status = write(0, src, dst, lengths)
        return 1, (status if status != 0 else 0)
    count = 0
    for index, (lo, hi) in enumerate(_batch_bounds(n, bound)):
        count += 1
        status = write(index, src[lo:hi], dst[lo:hi], lengths[lo:hi])
        if status != 0:
            return count, status
    return count, 0


def batch_calls(batch: BatchPlan, bound: int | None) -> list[tuple[int, int, BlockSlice]]:
    """The bounded engine calls of a batch plan, ``(lo, hi, blocks)`` each:
    ``batch.call_ranges(bound)`` (whole requests packed while they fit, so a failed call holds
    as few requests as the sizes allow; one call for everything when ``bound`` is None), the
    blocks as views of the batch's uint64 columns. ``batch.requests_in(lo, hi)`` names the
    requests a call holds."""
    src, dst, lengths = plan_arrays(batch)
    n = len(src)
    ranges = batch.call_ranges(bound if bound is not None else max(n, 1)).tolist()
    return [(lo, hi, BlockSlice(src[lo:hi], dst[lo:hi], lengths[lo:hi])) for lo, hi in ranges]


def _batch_bounds(n: int, bound: int | None) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of each batch; nothing for an empty plan (empty engine calls are skipped)."""
    if n == 0:
        return
    step = n if bound is None else bound
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)
