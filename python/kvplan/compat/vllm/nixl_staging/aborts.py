"""The decode's stop of staged reads of requests vLLM finished early (aborted, failed).

:func:`stop_aborted_reads` stops a read in progress at the next round boundary, and keeps a
request whose read has not started yet (:func:`_take_pending_abort`: that read reads nothing)."""

from __future__ import annotations

import time
from typing import Any

from kvplan.compat.vllm.nixl_staging.handles import StagedRead
from kvplan.compat.vllm.nixl_staging.scheduler import ABORTED_META
from kvplan.compat.vllm.nixl_staging.worker import worker_staging


#: The decode worker attribute holding those whose read had not started when they came
#: (request -> until when, :func:`stop_aborted_reads`).
PENDING_ABORTS_ATTR = "_kvplan_pending_aborts"


def stop_aborted_reads(worker: Any, metadata: Any) -> list[str]:
    """The decode worker's ``start_load_kv``, after vLLM's: each request of the metadata's
    :data:`ABORTED_META` with a staged read still in progress has its stop started
    (:meth:`StagedRead.abort`); the requests whose stop started. vLLM itself tells its worker
    nothing of such a request: its scheduler keeps the request's blocks until the worker
    reports the read done, and its own READ runs to the end. A request whose read has not
    started yet (its handshake still running, or queued in vLLM's ``_ready_requests``) is
    kept here (:data:`PENDING_ABORTS_ATTR`) until its read starts, which then reads nothing
    (:func:`staged_read`), or for at most the staging timeout. Nothing with staging off."""
    state = worker_staging(worker)
    if state is None:
        return []
    transfers = worker.__dict__.get("_recving_transfers") or {}
    pending: dict[str, float] = worker.__dict__.setdefault(PENDING_ABORTS_ATTR, {})
    now = time.monotonic()
    for request in getattr(metadata, ABORTED_META, None) or ():
        pending.setdefault(str(request), now + float(state.config.timeout_s))
    stopped: list[str] = []
    for request, deadline in list(pending.items()):
        handles = list(transfers.get(request) or ())
        if handles or deadline <= now:  # its read started (or the wait is over): once
            del pending[request]
        for handle in handles:
            if isinstance(handle, StagedRead) and handle.abort():
                stopped.append(request)
    return stopped


def _take_pending_abort(worker: Any, request: str) -> bool:
    """Whether vLLM finished ``request`` before its read started (:func:`stop_aborted_reads`
    kept it, and its wait is not over); it is no longer kept."""
    pending: dict[str, float] = worker.__dict__.get(PENDING_ABORTS_ATTR) or {}
    deadline = pending.pop(str(request), None)
    return deadline is not None and deadline > time.monotonic()
