"""Submission of a plan: through the engine base's batching loop
(:func:`kvplan.engines._base.write_batches`) to ``manager.engine`` when ``_transfer_data`` is
SGLang's own, else through SGLang's seams (``_transfer_data``, executor tasks per entry pair,
``_await_transfer_futures``) exactly as SGLang calls them.

When ``manager.engine`` is SGLang's own ``MooncakeTransferEngine`` (its ``batch_transfer_sync``
not replaced) over a Mooncake engine the native hand-off supports, each batch goes to that
engine as the plan's uint64 columns (:func:`kvplan.engines.mooncake.native_write`: one request
array filled in Rust, GIL released) instead of three Python lists; the status is what SGLang's
``batch_transfer_sync`` would return (0, or -1 on any failure)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, cast

import numpy.typing as npt

from kvplan._core import BatchPlan, PlanBatch, Template, TransferPlan
from kvplan.compat.sglang.metrics import observe, planned
from kvplan.compat.sglang.seams import owns_transfer_data
from kvplan.compat.sglang.settings import setting_max_blocks
from kvplan.engines._base import U64, write_batches


def engine_status(value: Any) -> int:
    """An engine or seam status, returned unchanged as SGLang returns it."""
    return cast(int, value)


def block_tuples(plan: TransferPlan, which: slice = slice(None)) -> list[tuple[int, int, int]]:
    """Blocks as SGLang hands them to ``_transfer_data``: ``(src, dst, length)`` tuples."""
    return list(zip(plan.src_addrs[which].tolist(), plan.dst_addrs[which].tolist(),
                    plan.lengths[which].tolist()))


#: SGLang's Mooncake engine wrapper, whose ``batch_transfer_sync`` is one
#: ``self.engine.batch_transfer_sync_write`` call returning -1 on any exception.
_SGLANG_ENGINE = ("sglang.srt.distributed.device_communicators.mooncake_transfer_engine",
                  "MooncakeTransferEngine.batch_transfer_sync")
#: Where the native hand-off of an SGLang engine wrapper is kept (False: not available).
_NATIVE_ATTR = "_kvplan_mooncake_native"
_native_lock = threading.Lock()


def _sglang_mooncake_engine(engine: Any) -> bool:
    """``engine`` is SGLang's ``MooncakeTransferEngine`` with its own ``batch_transfer_sync``."""
    attrs = getattr(engine, "__dict__", None)
    if attrs is None or "batch_transfer_sync" in attrs:
        return False
    fn = getattr(type(engine), "batch_transfer_sync", None)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == _SGLANG_ENGINE


def _native(engine: Any) -> Any:
    """The native hand-off for SGLang's engine wrapper ``engine`` (bound and self-tested once,
    then kept on the wrapper), or None: the lists then go through ``batch_transfer_sync``."""
    attrs = getattr(engine, "__dict__", None)
    if attrs is None:
        return None
    cached = attrs.get(_NATIVE_ATTR)
    if cached is not None:
        return cached or None
    if not _sglang_mooncake_engine(engine):
        return None
    with _native_lock:
        cached = attrs.get(_NATIVE_ATTR)
        if cached is None:
            from kvplan.engines.mooncake import native_handoff

            native, _ = native_handoff(engine.engine, engine.get_session_id())
            cached = native if native is not None else False
            attrs[_NATIVE_ATTR] = cached
    return cached or None


def send_engine_batches(manager: Any, session: str, plan: TransferPlan | PlanBatch) -> int:
    """The fast path: the plan's arrays to ``manager.engine`` in bounded batches (what SGLang's
    own ``_transfer_data`` does with its one list), through the engine base's batching loop;
    the first non-zero status is returned and later batches are not submitted."""
    if plan.n_blocks == 0:
        return 0
    engine = manager.engine
    native = _native(engine)
    if native is not None:
        from kvplan.engines.mooncake import _transfer_timeout_s, native_write

        timeout_s = _transfer_timeout_s()

        def write(index: int, src: U64, dst: U64, lengths: U64) -> Any:
            return native_write(native, session, src, dst, lengths, timeout_s)
    else:
        def write(index: int, src: U64, dst: U64, lengths: U64) -> Any:
            return engine.batch_transfer_sync(session, src.tolist(), dst.tolist(),
                                              lengths.tolist())

    _, status = write_batches(plan.src_addrs, plan.dst_addrs, plan.lengths, setting_max_blocks(manager),
                              write)
    return engine_status(status)


def send_batch_calls(manager: Any, session: str, batch: BatchPlan) -> list[int]:
    """A batch plan to ``manager.engine`` in bounded calls (``batch.call_ranges`` over the
    ``max_blocks`` setting: whole requests packed while they fit), each call as
    :func:`send_engine_batches` makes one; returns per request 0, or the first non-zero status
    of a call holding its blocks. Every call is made, whatever the others returned."""
    statuses = [0] * batch.n_requests
    if batch.n_blocks == 0:
        return statuses
    bound = setting_max_blocks(manager)
    calls = batch.call_ranges(bound if bound is not None else batch.n_blocks).tolist()
    for lo, hi in calls:
        view = PlanBatch(batch.src_addrs[lo:hi], batch.dst_addrs[lo:hi], batch.lengths[lo:hi])
        status = send_engine_batches(manager, session, view)
        if status != 0:
            for r in batch.requests_in(lo, hi).tolist():
                statuses[r] = statuses[r] or status
    return statuses


def send_all(manager: Any, session: str, plan: TransferPlan) -> int:
    """All blocks of one call: the fast path when ``_transfer_data`` is SGLang's own, else one
    ``_transfer_data(session, blocks)`` call, as SGLang makes it."""
    if owns_transfer_data(manager):
        return send_engine_batches(manager, session, plan)
    return engine_status(manager._transfer_data(session, block_tuples(plan)))


def _send_index_windows(manager: Any, session: str, template: Template,
                        src: npt.NDArray[Any], dst: npt.NDArray[Any]) -> int:
    """``_send_kvcache_generic``'s submission through a replaced ``_transfer_data``: one call,
    or, with ``max_transfer_batch_indices``, one call per window of that many page positions,
    each window planned on its own (SGLang's runs break at window edges too)."""
    window = manager.max_transfer_batch_indices
    if window <= 0 or src.size <= window:
        return engine_status(manager._transfer_data(session,
                                              block_tuples(planned(lambda: template.plan(src, dst)))))
    plan_s, n_blocks = 0.0, 0
    try:
        for start in range(0, src.size, window):
            started = time.perf_counter()
            part = template.plan(src[start:start + window], dst[start:start + window])
            plan_s += time.perf_counter() - started
            n_blocks += part.n_blocks
            status = manager._transfer_data(session, block_tuples(part))
            if status != 0:
                return engine_status(status)
        return 0
    finally:
        observe(plan_s, n_blocks)  # the call's windows as one call


def _send_per_pair(manager: Any, session: str, plan: TransferPlan, executor: Any, *,
                   through_transfer_data: bool, await_with_manager: bool) -> int:
    """One executor task per entry pair (SGLang: one per layer). Each task hands its blocks to
    ``_transfer_data`` when that is the call's seam and it is not SGLang's own, else straight
    to the engine. Awaited with the manager's ``_await_transfer_futures`` where SGLang does,
    else SGLang's Ascend loop (first non-zero status, the rest cancelled)."""
    seam = through_transfer_data and not owns_transfer_data(manager)
    native = None if seam else _native(manager.engine)
    timeout_s = 0.0
    if native is not None:
        from kvplan.engines.mooncake import _transfer_timeout_s, native_write

        timeout_s = _transfer_timeout_s()

    def one(pair: int) -> int:
        which = plan.pair_blocks(pair)
        if seam:
            return engine_status(manager._transfer_data(session, block_tuples(plan, which)))
        if native is not None:
            src_addrs = plan.src_addrs[which]
            if len(src_addrs) == 0:
                return 0
            return native_write(native, session, src_addrs, plan.dst_addrs[which],
                                plan.lengths[which], timeout_s)
        src = plan.src_addrs[which].tolist()
        if not src:
            return 0
        return engine_status(manager.engine.batch_transfer_sync(
            session, src, plan.dst_addrs[which].tolist(), plan.lengths[which].tolist()))

    futures = [executor.submit(one, p) for p in range(plan.n_pairs)]
    if await_with_manager:
        return engine_status(manager._await_transfer_futures(futures))
    for future in concurrent.futures.as_completed(futures):
        status = future.result()
        if status != 0:
            for f in futures:
                f.cancel()
            return engine_status(status)
    return 0
