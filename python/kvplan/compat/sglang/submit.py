"""Submission of a plan: through the engine base's batching loop
(:func:`kvplan.engines._base.write_batches`) to ``manager.engine`` when ``_transfer_data`` is
SGLang's own, else through SGLang's seams (``_transfer_data``, executor tasks per entry pair,
``_await_transfer_futures``) exactly as SGLang calls them.

Engine calls go through a :class:`kvplan.engines.mooncake.Handoff`. When ``manager.engine`` is
SGLang's own ``MooncakeTransferEngine`` (its ``batch_transfer_sync`` not replaced) over a
Mooncake engine the native hand-off supports, the wrapper keeps one, and each batch goes to that
engine as the plan's uint64 columns (one request array filled in Rust, GIL released) instead of
three Python lists; the status is what SGLang's ``batch_transfer_sync`` would return (0, or -1
on any failure). Otherwise the lists go to ``manager.engine.batch_transfer_sync``."""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any, cast

import numpy.typing as npt

from kvplan._core import BatchPlan, BlockSlice, Template, TransferPlan
from kvplan.compat.sglang.metrics import observe, planned
from kvplan.compat.sglang.seams import owns_transfer_data
from kvplan.compat.sglang.settings import setting_max_blocks
from kvplan.engines._base import U64, batch_calls, write_batches
from kvplan.engines.mooncake import Handoff

if TYPE_CHECKING:
    from kvplan.compat.sglang.verdicts import FailedBlocks


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


def _sglang_mooncake_engine(engine: Any) -> bool:
    """``engine`` is SGLang's ``MooncakeTransferEngine`` with its own ``batch_transfer_sync``."""
    attrs = getattr(engine, "__dict__", None)
    if attrs is None or "batch_transfer_sync" in attrs:
        return False
    fn = getattr(type(engine), "batch_transfer_sync", None)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == _SGLANG_ENGINE


def _handoff(engine: Any) -> Handoff:
    """How blocks reach SGLang's engine wrapper ``engine``: its own wrapper keeps one hand-off
    (native once bound and self-tested through the wrapper's session, else its
    ``batch_transfer_sync`` lists); any other wrapper gets its ``batch_transfer_sync`` lists."""
    def write_lists(session: str, src: list[int], dst: list[int], lengths: list[int]) -> Any:
        return engine.batch_transfer_sync(session, src, dst, lengths)

    if _sglang_mooncake_engine(engine):
        return Handoff.kept_on(engine, engine.engine, engine.get_session_id(),
                               write_lists=write_lists)
    return Handoff(engine, None, native=False, write_lists=write_lists)


def send_engine_batches(manager: Any, session: str, plan: TransferPlan | BlockSlice,
                        failed: FailedBlocks | None = None) -> int:
    """The fast path: the plan's arrays to ``manager.engine`` in bounded batches (what SGLang's
    own ``_transfer_data`` does with its one list), through the engine base's batching loop;
    the first non-zero status is returned and later batches are not submitted. A failed batch
    is reported to ``failed`` (its blocks and the unsubmitted ones after it)."""
    if plan.n_blocks == 0:
        return 0
    handoff = _handoff(manager.engine)
    start = 0  # the plan position of the next batch

    def write(index: int, s: U64, d: U64, n: U64) -> int:
        nonlocal start
        lo, start = start, start + len(s)
        status = handoff.write(session, s, d, n)
        if status != 0 and failed is not None:
            failed.batch_failed(index, lo, start, status)
        return status

    status = write_batches(plan.src_addrs, plan.dst_addrs, plan.lengths,
                           setting_max_blocks(manager), write)[1]
    if status != 0 and failed is not None:
        failed.report()
    return engine_status(status)


def send_batch_calls(manager: Any, session: str, batch: BatchPlan) -> list[int]:
    """A batch plan to ``manager.engine`` in bounded calls (``batch.call_ranges`` over the
    ``max_blocks`` setting: whole requests packed while they fit), each call as
    :func:`send_engine_batches` makes one; returns per request 0, or the first non-zero status
    of a call holding its blocks. Every call is made, whatever the others returned."""
    statuses = [0] * batch.n_requests
    if batch.n_blocks == 0:
        return statuses
    for lo, hi, view in batch_calls(batch, setting_max_blocks(manager)):
        status = send_engine_batches(manager, session, view)
        if status != 0:
            for r in batch.requests_in(lo, hi).tolist():
                statuses[r] = statuses[r] or status
    return statuses


def send_all(manager: Any, session: str, plan: TransferPlan,
             failed: FailedBlocks | None = None) -> int:
    """All blocks of one call: the fast path when ``_transfer_data`` is SGLang's own, else one
    ``_transfer_data(session, blocks)`` call, as SGLang makes it (a non-zero status reports
    every block of the call to ``failed``)."""
    if owns_transfer_data(manager):
        return send_engine_batches(manager, session, plan, failed)
    status = manager._transfer_data(session, block_tuples(plan))
    if status != 0 and failed is not None:
        failed.failed(0, plan.n_blocks, f"_transfer_data returned {status}")
        failed.report()
    return engine_status(status)


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
                   through_transfer_data: bool, await_with_manager: bool,
                   failed: FailedBlocks | None = None) -> int:
    """One executor task per entry pair (SGLang: one per layer). Each task hands its blocks to
    ``_transfer_data`` when that is the call's seam and it is not SGLang's own, else straight
    to the engine. Awaited with the manager's ``_await_transfer_futures`` where SGLang does,
    else SGLang's Ascend loop (first non-zero status, the rest cancelled)."""
    seam = through_transfer_data and not owns_transfer_data(manager)
    handoff = None if seam else _handoff(manager.engine)
    if handoff is not None:
        handoff.native()  # bound and self-tested here, not in the first task

    written: set[int] = set()  # the pairs whose blocks all went through

    def send(pair: int) -> int:
        which = plan.pair_blocks(pair)
        if handoff is None:
            return engine_status(manager._transfer_data(session, block_tuples(plan, which)))
        src = plan.src_addrs[which]
        if len(src) == 0:
            return 0
        return engine_status(handoff.write(session, src, plan.dst_addrs[which],
                                           plan.lengths[which]))

    def one(pair: int) -> int:
        status = send(pair)
        if status == 0:
            written.add(pair)
        return status

    def report(status: int) -> int:
        # every pair that did not finish with 0: failed, cancelled, or still unknown
        if status != 0 and failed is not None:
            for pair in range(plan.n_pairs):
                which = plan.pair_blocks(pair)
                if pair not in written and which.stop > which.start:
                    failed.failed(which.start, which.stop,
                                  f"entry pair {pair} not written (call status {status})")
            failed.report()
        return engine_status(status)

    futures = [executor.submit(one, p) for p in range(plan.n_pairs)]
    if await_with_manager:
        return report(engine_status(manager._await_transfer_futures(futures)))
    for future in concurrent.futures.as_completed(futures):
        status = future.result()
        if status != 0:
            for f in futures:
                f.cancel()
            return report(status)
    return 0
