"""Submission of a plan: through the engine base's batching loop
(:func:`kvplan.engines._base.write_batches`) to ``manager.engine`` when ``_transfer_data`` is
SGLang's own, else through SGLang's seams (``_transfer_data``, executor tasks per entry pair,
``_await_transfer_futures``) exactly as SGLang calls them."""

from __future__ import annotations

import concurrent.futures
from typing import Any, cast

import numpy.typing as npt

from kvplan._core import Template, TransferPlan
from kvplan.compat.sglang.seams import _own_transfer_data
from kvplan.compat.sglang.settings import _max_blocks
from kvplan.engines._base import U64, write_batches


def _status(value: Any) -> int:
    """An engine or seam status, returned unchanged as SGLang returns it."""
    return cast(int, value)


def _blocks(plan: TransferPlan, which: slice = slice(None)) -> list[tuple[int, int, int]]:
    """Blocks as SGLang hands them to ``_transfer_data``: ``(src, dst, length)`` tuples."""
    return list(zip(plan.src_addrs[which].tolist(), plan.dst_addrs[which].tolist(),
                    plan.lengths[which].tolist()))


def _engine_batches(manager: Any, session: str, plan: TransferPlan) -> int:
    """The fast path: the plan's arrays to ``manager.engine`` in bounded batches (what SGLang's
    own ``_transfer_data`` does with its one list), through the engine base's batching loop;
    the first non-zero status is returned and later batches are not submitted."""
    if plan.n_blocks == 0:
        return 0
    engine = manager.engine

    def write(index: int, src: U64, dst: U64, lengths: U64) -> Any:
        return engine.batch_transfer_sync(session, src.tolist(), dst.tolist(), lengths.tolist())

    _, status = write_batches(plan.src_addrs, plan.dst_addrs, plan.lengths, _max_blocks(manager),
                              write)
    return _status(status)


def _send_all(manager: Any, session: str, plan: TransferPlan) -> int:
    """All blocks of one call: the fast path when ``_transfer_data`` is SGLang's own, else one
    ``_transfer_data(session, blocks)`` call, as SGLang makes it."""
    if _own_transfer_data(manager):
        return _engine_batches(manager, session, plan)
    return _status(manager._transfer_data(session, _blocks(plan)))


def _send_index_windows(manager: Any, session: str, template: Template,
                        src: npt.NDArray[Any], dst: npt.NDArray[Any]) -> int:
    """``_send_kvcache_generic``'s submission through a replaced ``_transfer_data``: one call,
    or, with ``max_transfer_batch_indices``, one call per window of that many page positions,
    each window planned on its own (SGLang's runs break at window edges too)."""
    window = manager.max_transfer_batch_indices
    if window <= 0 or src.size <= window:
        return _status(manager._transfer_data(session, _blocks(template.plan(src, dst))))
    for start in range(0, src.size, window):
        part = template.plan(src[start:start + window], dst[start:start + window])
        status = manager._transfer_data(session, _blocks(part))
        if status != 0:
            return _status(status)
    return 0


def _send_per_pair(manager: Any, session: str, plan: TransferPlan, executor: Any, *,
                   through_transfer_data: bool, await_with_manager: bool) -> int:
    """One executor task per entry pair (SGLang: one per layer). Each task hands its blocks to
    ``_transfer_data`` when that is the call's seam and it is not SGLang's own, else straight
    to the engine. Awaited with the manager's ``_await_transfer_futures`` where SGLang does,
    else SGLang's Ascend loop (first non-zero status, the rest cancelled)."""
    seam = through_transfer_data and not _own_transfer_data(manager)

    def one(pair: int) -> int:
        which = plan.pair_blocks(pair)
        if seam:
            return _status(manager._transfer_data(session, _blocks(plan, which)))
        src = plan.src_addrs[which].tolist()
        if not src:
            return 0
        return _status(manager.engine.batch_transfer_sync(
            session, src, plan.dst_addrs[which].tolist(), plan.lengths[which].tolist()))

    futures = [executor.submit(one, p) for p in range(plan.n_pairs)]
    if await_with_manager:
        return _status(manager._await_transfer_futures(futures))
    for future in concurrent.futures.as_completed(futures):
        status = future.result()
        if status != 0:
            for f in futures:
                f.cancel()
            return _status(status)
    return 0
