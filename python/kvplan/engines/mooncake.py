"""Mooncake Transfer Engine adapter (``pip install mooncake-transfer-engine-non-cuda``).

Every call that can crash the process inside Mooncake is made impossible here:

* No engine method runs before ``initialize`` returned 0: the constructor raises otherwise, and
  a closed adapter refuses every call.
* ``batch_register_memory`` only ever receives two lists built from the same region list.
* Overlapping or repeated registrations (``-7``) are avoided by the base class.
* Async batch ids never leave this module: each is wrapped in an object that is waited on
  exactly once, and ``0`` (a failed submit) is never passed to ``get_batch_transfer_status``.

Hand-off (:class:`Handoff`, also used by the vLLM and SGLang drop-ins): with the verified
Mooncake wheel the plan's uint64 columns go straight into the native engine's batch API
(``kvplan._core.MooncakeNative``: one request array filled in Rust, the GIL released for the
whole submit and wait) instead of three Python lists per batch. It is used only after a
self-test transfer at first use moved known bytes exactly; otherwise (another version, a
stand-in engine, ``KVPLAN_MOONCAKE_NATIVE=0`` or ``native=False``) batches go through the Python
binding's lists. :attr:`MooncakeTransport.handoff` says which path is in use.

Facts behind the defaults (measured on 0.3.13.post1, TCP): more than about 2,048 entries per peer
in flight fail with only part of the data landed, so batches default to 1,024 blocks and at most
1,024 blocks are in flight per peer; each entry costs ~30 µs on top of ~2 GB/s streaming.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from importlib import metadata
from typing import Any, cast

import numpy as np

from kvplan._core import KvPlanError
from kvplan.engines._base import (
    C,
    U64,
    Manifests,
    PendingBase,
    PlanLike,
    TransferError,
    TransferStats,
    Transport,
    integrity_notification,
    write_batches,
)

__all__ = ["Handoff", "MooncakeTransport", "PendingTransfer", "MOONCAKE_STATUS_NAMES",
           "NATIVE_DISTRIBUTION"]

#: The wheel whose native batch API kvplan's request layout was verified against (only its
#: CPU build; the version is checked by ``kvplan._core.MooncakeNative``).
NATIVE_DISTRIBUTION = "mooncake-transfer-engine-non-cuda"

#: Mooncake ``include/error.h`` codes. Transfer calls collapse most failures into -1.
MOONCAKE_STATUS_NAMES: dict[int, str] = {
    -1: "INVALID_ARGUMENT or transfer failed; reason in the engine log",
    -2: "TOO_MANY_REQUESTS",
    -3: "ADDRESS_NOT_REGISTERED",
    -4: "BATCH_BUSY",
    -6: "DEVICE_NOT_FOUND",
    -7: "ADDRESS_OVERLAPPED",
    -101: "DNS",
    -102: "SOCKET (peer unreachable)",
    -103: "MALFORMED_JSON",
    -104: "REJECT_HANDSHAKE",
}

#: Per-peer admission limit of Mooncake's TCP transport (queued entries; pending doubles it).
TCP_BLOCKS_PER_PEER = 1024


def _transfer_timeout_s() -> float:
    # Mooncake's binding waits MC_TRANSFER_TIMEOUT seconds (at least 5, default 30) plus 1 ns per
    # byte; the native wait allows the same.
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    try:
        return float(max(5, int(raw))) if raw else 30.0
    except ValueError:
        return 30.0


def _native_wanted(native: bool | None) -> bool:
    if native is not None:
        return native
    return os.environ.get("KVPLAN_MOONCAKE_NATIVE", "1") not in ("0", "false", "no", "off")


def _tcp_cap() -> int:
    # A deployment that raised the engine's queue may raise our cap with it.
    raw = os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER")
    try:
        return max(1, int(raw)) if raw else TCP_BLOCKS_PER_PEER
    except ValueError:
        return TCP_BLOCKS_PER_PEER


def _bind_native(engine: Any, self_test_session: str | None) -> tuple[Any, str]:
    """``(kvplan._core.MooncakeNative, "")`` for an initialised ``mooncake.engine.TransferEngine``
    of the verified wheel, else ``(None, why not)``. Nothing is transferred (see
    :func:`_self_test`)."""
    if engine is None:
        return None, "no engine"
    module = type(engine).__module__
    if module != "mooncake.engine":
        return None, f"engine is a {module}.{type(engine).__name__}, not Mooncake's"
    if not self_test_session:
        return None, "no session of the engine's own to run the self-test through"
    try:
        version = metadata.version(NATIVE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None, f"{NATIVE_DISTRIBUTION} is not installed (another build is)"
    import mooncake.engine

    from kvplan._core import MooncakeNative

    try:
        return MooncakeNative(engine, mooncake.engine.__file__, version), ""
    except Exception as exc:  # wrong version, missing symbol, unsupported platform
        return None, str(exc)


def _self_test(engine: Any, native: Any, session: str, timeout_s: float) -> str:
    """Write three blocks of distinct sources, offsets and lengths through ``native`` into a
    fresh buffer registered on ``engine`` and addressed through its own ``session``; ``""`` when
    exactly the expected bytes landed, else what went wrong. A request layout that did not
    match the engine's would move the wrong bytes (or none) and fail here, never elsewhere."""
    buf = np.zeros(8192, np.uint8)
    buf[:4096] = np.arange(4096, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    base = buf.ctypes.data
    status = int(engine.register_memory(base, buf.nbytes))
    if status != 0:
        return f"register_memory returned {status}"
    try:
        src = np.array([base + 8, base + 1000, base + 3000], np.uint64)
        dst = np.array([base + 4096 + 2048, base + 4096 + 16, base + 4096 + 3500], np.uint64)
        lengths = np.array([100, 333, 7], np.uint64)
        try:
            native.write(session, src, dst, lengths, min(timeout_s, 10.0))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        want = np.zeros(4096, np.uint8)
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
            want[d - base - 4096:d - base - 4096 + n] = buf[s - base:s - base + n]
        if not np.array_equal(buf[4096:], want):
            return "the bytes that landed differ from the bytes written"
        return ""
    finally:
        engine.unregister_memory(base)


def _as_list(column: U64 | list[int]) -> list[int]:
    return column if isinstance(column, list) else column.tolist()


#: ``write_lists(session, src, dst, lengths) -> status``: one batch through a list-taking API.
ListWrite = Callable[[str, list[int], list[int], list[int]], Any]


class Handoff:
    """How block columns reach one Mooncake engine: the native batch API
    (``kvplan._core.MooncakeNative``: one request array filled in Rust, the GIL released for the
    submit and the wait) once it is bound and its self-test moved known bytes exactly, else a
    list-taking call (the binding's ``batch_transfer_sync_write`` unless ``write_lists`` says
    otherwise), with the reason kept in :attr:`reason`.

    The same object serves :class:`MooncakeTransport`, the vLLM drop-in (kept on the worker,
    one per engine object) and the SGLang drop-in (kept on SGLang's engine wrapper), so the
    three decide, self-test, time out and report failures alike.

    Args:
        engine: an initialised ``mooncake.engine.TransferEngine``; any other object (or
            ``None``) gets the list path.
        self_test_session: the engine's own session (``"host:rpc_port"``), through which the
            self-test writes; ``None``: no self-test can run, so the list path.
        native: ``None`` (default): native unless ``KVPLAN_MOONCAKE_NATIVE=0``; ``False``: always
            the list path; ``True``: bind now and raise ``ImportError`` when that fails.
        write_lists: the list path's call, ``write_lists(session, src, dst, lengths)``
            returning the engine's status (returned unchanged); default the engine's
            ``batch_transfer_sync_write``.
        log: a logger told once, at the first write of columns, which path is in use and why.

    Raises:
        ImportError: ``native=True`` and the native API cannot be bound to ``engine``.
    """

    def __init__(self, engine: Any, self_test_session: str | None, *,
                 native: bool | None = None, write_lists: ListWrite | None = None,
                 log: logging.Logger | None = None) -> None:
        self.engine: Any = engine
        self.self_test_session = self_test_session
        self._timeout_s: float | None = None
        #: ``"native"`` or ``"lists"``: how columns reach the engine (``"native"`` is provisional
        #: until the self-test ran at the first write).
        self.path = "lists"
        #: Why the native path is not in use (``""`` when it is, or before it was tried).
        self.reason = ""
        self._write_lists = write_lists if write_lists is not None else self._engine_lists
        self._log = log
        self._lock = threading.Lock()
        self._native: Any = None
        self._bound = False  # binding was tried
        self._settled = False  # the self-test ran (or there is nothing to test)
        if not _native_wanted(native):
            self.reason = ("disabled (native=False)" if native is False
                           else "disabled (KVPLAN_MOONCAKE_NATIVE=0)")
            self._bound = True
        elif native and not self.bind():
            raise ImportError(f"native Mooncake hand-off unavailable: {self.reason}")

    @property
    def timeout_s(self) -> float:
        """Seconds a native batch is waited on: what Mooncake's binding allows its own
        (``MC_TRANSFER_TIMEOUT``, at least 5, default 30), read at first use."""
        if self._timeout_s is None:
            self._timeout_s = _transfer_timeout_s()
        return self._timeout_s

    # ------------------------------------------------------------------ keeping one per owner
    #: The attribute an owner (a vLLM worker, SGLang's engine wrapper) keeps its hand-off in.
    KEPT_ATTR = "_kvplan_mooncake_handoff"
    _kept_lock = threading.Lock()

    @classmethod
    def kept_on(cls, owner: Any, engine: Any, self_test_session: str | None, *,
                write_lists: ListWrite | None = None,
                log: logging.Logger | None = None) -> Handoff:
        """The hand-off ``owner`` keeps for ``engine``, made on first use (and again when the
        owner's engine object changed), so the native API is bound and self-tested once per
        engine. An owner without a ``__dict__`` gets a fresh one each time."""
        attrs = getattr(owner, "__dict__", None)
        if attrs is None:
            return cls(engine, self_test_session, write_lists=write_lists, log=log)
        kept = attrs.get(cls.KEPT_ATTR)
        if kept is not None and kept.engine is engine:
            return kept  # type: ignore[no-any-return]
        with cls._kept_lock:
            kept = attrs.get(cls.KEPT_ATTR)
            if kept is None or kept.engine is not engine:
                kept = attrs[cls.KEPT_ATTR] = cls(engine, self_test_session,
                                                  write_lists=write_lists, log=log)
        return kept  # type: ignore[no-any-return]

    @classmethod
    def kept(cls, owner: Any) -> Handoff | None:
        """The hand-off ``owner`` keeps (:meth:`kept_on`), or None before its first use."""
        kept: Handoff | None = getattr(owner, "__dict__", {}).get(cls.KEPT_ATTR)
        return kept

    # ------------------------------------------------------------------ choosing the path
    def bind(self) -> bool:
        """Bind the native batch API now (nothing is transferred; the self-test still runs at
        the first write); False, with :attr:`reason` set, when the list path is taken."""
        with self._lock:
            self._bind_once()
        return self._native is not None

    def _bind_once(self) -> None:
        if self._bound:
            return
        self._bound = True
        native, reason = _bind_native(self.engine, self.self_test_session)
        if native is None:
            self.reason = reason
        else:
            self._native, self.path = native, "native"

    def native(self) -> Any:
        """The native batch API once bound and self-tested (both at the first call), or None:
        the list path is in use and :attr:`reason` says why."""
        if self._settled:
            return self._native
        with self._lock:
            if not self._settled:
                self._bind_once()
                if self._native is not None:
                    failed = _self_test(self.engine, self._native, cast(str,
                                        self.self_test_session), self.timeout_s)
                    if failed:
                        self._native, self.path = None, "lists"
                        self.reason = f"self-test failed: {failed}"
                self._settled = True
                if self._log is not None:
                    if self._native is None:
                        self._log.info("kvplan: Mooncake blocks go through the binding's "
                                       "lists: %s", self.reason)
                    else:
                        self._log.info("kvplan: Mooncake blocks go to the native batch API")
        return self._native

    # ------------------------------------------------------------------ writing
    def _engine_lists(self, session: str, src: list[int], dst: list[int],
                      lengths: list[int]) -> Any:
        return self.engine.batch_transfer_sync_write(session, src, dst, lengths)

    def write(self, session: str, src: U64 | list[int], dst: U64 | list[int],
              lengths: U64 | list[int]) -> int:
        """One engine call for one batch, as Mooncake's binding reports it: through the native
        API (uint64 arrays only) 0, or -1 when the batch failed, was refused or timed out (the
        reason is in the engine log); through the lists, the list call's status unchanged.
        Python lists always take the list path."""
        native = self.native() if isinstance(src, np.ndarray) else None
        if native is None:
            return cast(int, self._write_lists(session, _as_list(src), _as_list(dst),
                                               _as_list(lengths)))
        try:
            native.write(session, src, dst, lengths, self.timeout_s)
        except (RuntimeError, TimeoutError):
            return -1
        return 0

    def write_batches(self, session: str, src: C, dst: C, lengths: C, bound: int | None, *,
                      call_empty: bool = False) -> int:
        """:meth:`write` per batch of at most ``bound`` blocks
        (:func:`kvplan.engines._base.write_batches`: views, in order, stopping at the first
        non-zero status, which is returned unchanged; 0 when all were written)."""
        def write(index: int, s: C, d: C, n: C) -> int:
            return self.write(session, s, d, n)

        return write_batches(src, dst, lengths, bound, write, call_empty=call_empty)[1]

    def submit(self, session: str, src: U64, dst: U64, lengths: U64) -> Any:
        """One batch submitted without waiting: a native batch, or the binding's batch id; ``0``
        when the submit failed (never to be waited on)."""
        native = self.native()
        if native is not None:
            try:
                return native.submit(session, src, dst, lengths)
            except RuntimeError:  # refused, as the binding's 0
                return 0
        return int(self.engine.batch_transfer_async_write(session, src.tolist(), dst.tolist(),
                                                          lengths.tolist()))

    def wait(self, batch: Any) -> int:
        """Wait on what :meth:`submit` returned (exactly once): 0, or the failed batch's status
        (-1 for a native batch that failed or timed out)."""
        if not isinstance(batch, int):  # a native batch
            try:
                batch.wait(self.timeout_s)
            except (RuntimeError, TimeoutError):
                return -1
            return 0
        return int(self.engine.get_batch_transfer_status([batch]))

    def close(self) -> None:
        """Drop the native API (before the engine it points into goes) and the engine."""
        with self._lock:
            self._native, self._bound, self._settled = None, True, True
            self.engine = None


class MooncakeTransport(Transport):
    """Writes plans with ``mooncake.engine.TransferEngine`` (P2P handshake, no metadata server).

    Args:
        hostname: local address peers connect to (``"127.0.0.1"`` for loopback).
        protocol: ``"tcp"`` (default) or ``"rdma"``. Without an HCA, ``"rdma"`` silently falls
            back to TCP inside Mooncake, so the TCP batch bounds are kept for both.
        device_name: RDMA device list, ``""`` for TCP.
        metadata_server: ``"P2PHANDSHAKE"`` (no server) or an etcd/http URL.
        max_blocks_per_batch: blocks per engine call (default 1,024).
        max_blocks_in_flight: blocks in flight per peer across threads and async batches
            (default 1,024, or ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` when set).
        engine: a fresh, *uninitialised* engine object with Mooncake's signatures to use instead
            of ``mooncake.engine.TransferEngine()`` (tests pass a recording stand-in).
        native: use the native batch API. ``None`` (default): when available and not disabled
            with ``KVPLAN_MOONCAKE_NATIVE=0``; ``False``: always the list path; ``True``: raise
            ``ImportError`` when it cannot be bound. Only a real
            ``mooncake.engine.TransferEngine`` of the verified wheel qualifies; a failed
            self-test at the first write falls back to lists (:attr:`handoff_reason` says why).

    Raises:
        ImportError: the ``mooncake`` package is not installed.
        TransferError: ``initialize`` returned non-zero (the engine is then never touched again).
    """

    engine_name = "mooncake"
    # Mooncake's batch status call blocks until the batch ends: a wait cannot be bounded.
    wait_takes_timeout = False
    default_max_blocks_per_batch = TCP_BLOCKS_PER_PEER
    status_names = MOONCAKE_STATUS_NAMES

    def __init__(self, hostname: str = "127.0.0.1", *, protocol: str = "tcp",
                 device_name: str = "", metadata_server: str = "P2PHANDSHAKE",
                 max_blocks_per_batch: int | None = None,
                 max_blocks_in_flight: int | None = None, engine: Any = None,
                 native: bool | None = None) -> None:
        cap = max_blocks_in_flight if max_blocks_in_flight is not None else _tcp_cap()
        super().__init__(max_blocks_per_batch=max_blocks_per_batch, max_blocks_in_flight=cap)
        self._closed = True  # until initialize succeeds, nothing may call into the engine
        self._async_lock = threading.Lock()
        self._async_fifo: dict[str, deque[_BatchId]] = {}
        if engine is None:
            from mooncake.engine import TransferEngine  # on demand, never by `import kvplan`

            engine = TransferEngine()
        self.hostname = hostname
        self.protocol = protocol
        self._engine: Any = engine
        status = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if status != 0:
            self._engine = None  # any further call on an uninitialised engine is a SIGSEGV
            raise self._error(
                f"initialize({hostname!r}, {metadata_server!r}, {protocol!r}, {device_name!r}) "
                f"failed", peer=None, status=status,
            )
        self._session = f"{hostname}:{self._engine.get_rpc_port()}"
        try:
            self._handoff = Handoff(self._engine, self._session, native=native,
                                    write_lists=self._engine_write)
        except ImportError:
            self._engine = None  # nothing was registered: the adapter stays closed
            raise
        self._handoff.bind()  # the self-test runs at the first write
        self._closed = False

    # ------------------------------------------------------------------ native hand-off
    @property
    def handoff(self) -> str:
        """``"native"`` or ``"lists"``: how batches reach the engine (``"native"`` is settled by
        the self-test at the first write)."""
        return self._handoff.path

    @property
    def handoff_reason(self) -> str:
        """Why the native path is not in use (empty when it is, or before the first write)."""
        return self._handoff.reason

    def _native_ready(self) -> Any:
        """The native API once its self-test passed (run at the first call), else None (the
        benchmarks time it directly)."""
        return self._handoff.native()

    # ------------------------------------------------------------------ engine hooks
    def _engine_session_id(self) -> str:
        return self._session

    def _engine_register(self, ptrs: list[int], lens: list[int], device: str) -> int:
        if len(ptrs) != len(lens):  # Mooncake does not check and crashes
            raise ValueError(f"{len(ptrs)} region addresses but {len(lens)} lengths")
        if len(ptrs) == 1:
            return int(self._engine.register_memory(ptrs[0], lens[0]))
        return int(self._engine.batch_register_memory(ptrs, lens))

    def _engine_unregister(self, ptrs: list[int]) -> int:
        return int(self._engine.batch_unregister_memory(ptrs))

    def _engine_write_arrays(self, peer: str, src: U64, dst: U64, lengths: U64) -> int:
        return self._handoff.write(peer, src, dst, lengths)

    def _engine_write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        return int(self._engine.batch_transfer_sync_write(peer, src, dst, lengths))

    def _engine_write_async(self, peer: str, src: U64, dst: U64, lengths: U64) -> Any:
        """Submit one batch asynchronously: a native batch, or the binding's batch id (0: the
        submit failed)."""
        return self._handoff.submit(peer, src, dst, lengths)

    def _describe_failure(self, peer: str, status: int) -> str:
        # Deliberately no automatic send_probe here: against a hung (stopped) peer the probe
        # blocks for about 60 s, far longer than the transfer timeout. Callers who want to tell a
        # dead peer from a rejected write call probe() themselves.
        return ("the engine log on stderr has the reason: a dead or hung peer, a destination "
                "outside the peer's registered memory, or a full queue; blocks of this batch may "
                "have partly landed")

    # ------------------------------------------------------------------ public API
    def probe(self, peer_session: str) -> int:
        """``0`` when ``peer_session`` answers, ``-102`` when nothing listens there.

        Fast (< 1 ms) for live and dead peers, but it can block for about a minute when the peer
        process is alive yet not scheduled (stopped, swapping): never call it on a hot path.
        """
        self._check_open()
        return int(self._engine.send_probe(peer_session))

    def submit_async(self, plan: PlanLike, peer_session: str,
                     max_blocks_per_batch: int | None = None, *, check_sources: bool = True,
                     manifest: Manifests | None = None) -> PendingTransfer:
        """Write ``plan`` with Mooncake's async batches; return once every batch is submitted.

        At most ``max_blocks_in_flight`` blocks are in flight per peer: when the budget is full,
        the oldest outstanding async batch towards that peer (of any handle) is waited on first,
        so plans larger than the budget block here until their tail fits. Call
        :meth:`PendingTransfer.wait` (or use the handle as a context manager); until then the
        buffers are in use. ``manifest``: as in :meth:`submit`; the packed notification is in
        the stats :meth:`PendingTransfer.wait` returns, to send once every byte landed.

        Raises:
            TransferError: a submit failed; the batches already submitted were waited on first.
        """
        return self._submit_async(plan, peer_session, max_blocks_per_batch, check_sources,
                                  lambda lengths: PendingTransfer(self, peer_session, lengths),
                                  integrity_notification(manifest))

    def close(self) -> None:
        """Wait on every outstanding async batch, unregister memory, drop the engine."""
        if not self._closed:
            for peer in list(self._async_fifo):
                while self._retire_oldest(peer):
                    pass
            super().close()
            self._handoff.close()  # the native API before the engine it points into
            self._engine = None

    # ------------------------------------------------------------------ async bookkeeping
    def _acquire_budget(self, peer: str, n: int) -> None:
        # Budget held by our own async batches is freed by waiting on the oldest one; budget
        # held by sync calls in other threads comes back when those calls return.
        while not self._in_flight.acquire(peer, n, blocking=False):
            if not self._retire_oldest(peer):
                self._in_flight.acquire(peer, n)
                return

    def _retire_oldest(self, peer: str) -> bool:
        """Wait on the oldest outstanding async batch towards ``peer``; False if there is none."""
        with self._async_lock:
            queue = self._async_fifo.get(peer)
            if not queue:
                return False
            bid = queue.popleft()
            if not queue:
                del self._async_fifo[peer]
        try:
            status = bid.wait(self._handoff)
        except Exception as exc:  # the binding raised: report it as that batch's failure
            status = None
            bid.owner._done(bid, status, exc)
        else:
            bid.owner._done(bid, status, None)
        finally:
            self._in_flight.release(peer, bid.hi - bid.lo)
        return True

    def _enqueue(self, peer: str, bid: _BatchId) -> None:
        """Queue a submitted async batch for retirement, oldest first per peer."""
        with self._async_lock:
            self._async_fifo.setdefault(peer, deque()).append(bid)


class _BatchId:
    """One Mooncake async batch (the binding's id, or a native batch), waited on at most once
    (a second wait on a binding id is a SIGSEGV)."""

    __slots__ = ("value", "index", "lo", "hi", "owner", "_lock")

    def __init__(self, value: Any, index: int, lo: int, hi: int, owner: PendingTransfer) -> None:
        if isinstance(value, int) and value == 0:  # "submit failed"; waiting on it crashes
            raise ValueError("batch id 0 is a failed submit, not a batch")
        self.value: Any = value
        self.index, self.lo, self.hi, self.owner = index, lo, hi, owner
        self._lock = threading.Lock()

    def wait(self, handoff: Handoff) -> int:
        with self._lock:
            value, self.value = self.value, None
        if value is None:
            raise RuntimeError("batch id already waited on")
        return handoff.wait(value)


class PendingTransfer(PendingBase):
    """Handle of an async Mooncake submission; :meth:`wait` returns :class:`TransferStats`."""

    def __init__(self, transport: MooncakeTransport, peer: str, lengths: U64) -> None:
        super().__init__(peer, lengths)
        self._transport = transport
        self._outstanding = 0
        self._cond = threading.Condition()

    @property
    def done(self) -> bool:
        """True once every submitted batch was waited on."""
        with self._cond:
            return self._outstanding == 0

    def _post_batch(self, index: int, lo: int, hi: int, src: U64, dst: U64, lengths: U64, *,
                    last: bool) -> None:
        t, peer = self._transport, self._peer
        value = t._call_batch(peer, index, src, dst, lengths, t._engine_write_async,
                              hold_budget=True)
        if isinstance(value, int) and value == 0:  # a failed submit: never to be waited on
            t._in_flight.release(peer, hi - lo)
            raise t._batch_error(peer, index, lengths, status=-1, cause=None)
        self._outstanding += 1
        t._enqueue(peer, _BatchId(value, index, lo, hi, self))

    def _done(self, bid: _BatchId, status: int | None, exc: BaseException | None) -> None:
        with self._cond:
            self._outstanding -= 1
            if (status != 0 or exc is not None) and self._error is None:
                t = self._transport
                self._error = t._batch_error(self._peer, bid.index, self._lengths[bid.lo:bid.hi],
                                             status=status, cause=exc)
            self._cond.notify_all()

    def _abort(self, exc: BaseException) -> None:
        """A submit failed: wait on what this handle already submitted, keep the first error."""
        if not isinstance(exc, TransferError):
            return
        try:
            self.wait()
        except TransferError:
            pass
        with self._cond:
            self._error = exc

    def wait(self, timeout: float | None = None) -> TransferStats:
        """Block until every batch of this submission finished.

        ``timeout`` must be ``None``: Mooncake's batch status call blocks until the batch ends.

        Raises:
            TransferError: the first failed batch (all batches were still waited on, each once).
            KvPlanError: a ``timeout`` was given.
        """
        if timeout is not None:
            raise KvPlanError(f"mooncake: wait() takes no timeout (got {timeout!r}): Mooncake's "
                              f"batch status call blocks until the batch ends")
        t = self._transport
        while True:
            with self._cond:
                if self._outstanding == 0:
                    break
            # Ids are waited in submission order per peer, so older batches of other handles
            # may be retired on their behalf on the way; their handles record the outcome.
            if not t._retire_oldest(self._peer):
                with self._cond:  # another thread is waiting on our last id right now
                    self._cond.wait_for(lambda: self._outstanding == 0, timeout=1.0)
        if self._error is not None:
            raise self._error
        return self._succeeded()
