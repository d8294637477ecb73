"""Failure verdicts of the Mooncake drop-in: when a planned call's engine batches fail, which
destination pages of which pool were left unwritten.

SGLang's send methods return 0 or -1 and its transfer worker then fails the room with its own
reason ("Failed to send kv chunk of <room> to <addr>"), naming no page. A :class:`FailedBlocks`
collects the failed block ranges of one call's plan (a failed batch and the batches after it
that were never submitted, or the entry pairs that did not finish); :meth:`FailedBlocks.report`
turns them into a :class:`kvplan.failures.FailureVerdict` with
:func:`kvplan.failures.verdict_for_plan` over the template and plan the call made, logs it as
one ERROR line on SGLang's Mooncake logger and keeps it on the manager
(:func:`failure_verdicts`). SGLang's status and flow are unchanged.

The room is named where the call is told it (state sends: ``req.room``; the state path of
``_send_kvcache_generic``: ``bootstrap_room``); SGLang's ``send_kvcache`` and
``send_kvcache_slice`` are not, so their verdicts name the decode session and the room as
``?``: SGLang's own failure line for that session follows on the same transfer worker thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvplan._core import Template
from kvplan.failures import FailureVerdict, verdict_for_plan, verdict_for_unscattered_rounds
from kvplan.compat.sglang.registry import sglang_global

__all__ = ["FailedBlocks", "RecordedFailure", "failure_verdicts", "staged_unwritten",
           "KEEP_VERDICTS"]

#: How many verdicts a manager keeps (the oldest goes first).
KEEP_VERDICTS = 256

#: The manager attribute the kept verdicts live in.
_KEPT_ATTR = "_kvplan_failure_verdicts"
_kept_lock = threading.Lock()


@dataclass(frozen=True)
class RecordedFailure:
    """One failed call's verdict as the manager keeps it: the decode session, the room (None
    where the call was not told it) and the verdict (``request_id`` is the room, or ``"?"``)."""

    session: str
    room: int | None
    verdict: FailureVerdict


def failure_verdicts(manager: Any) -> list[RecordedFailure]:
    """The verdicts ``manager`` keeps, oldest first (at most :data:`KEEP_VERDICTS`)."""
    kept = getattr(manager, "__dict__", {}).get(_KEPT_ATTR)
    with _kept_lock:
        return list(kept.values()) if kept is not None else []


def staged_unwritten(manager: Any, session: str, template: Template, rounds: Any,
                     scattered: int, *, reason: str) -> FailureVerdict | None:
    """The verdict of a staged request to ``session`` that failed after the decode
    acknowledged scattering ``scattered`` of its ``rounds`` (planned by ``template``): every
    decode page the scatter plans of the later rounds were to write, per pool; kept on the
    manager (room ``None``). None when no verdict could be made (the caller logs the failure
    either way)."""
    try:
        verdict = verdict_for_unscattered_rounds("?", template, rounds, scattered,
                                                 reason=reason)
    except Exception:  # noqa: BLE001 - the status stays SGLang's either way
        return None
    _keep(manager, RecordedFailure(session, None, verdict))
    return verdict


def _keep(manager: Any, record: RecordedFailure) -> None:
    attrs = getattr(manager, "__dict__", None)
    if attrs is None:
        return
    with _kept_lock:
        kept = attrs.get(_KEPT_ATTR)
        if kept is None:
            kept = attrs[_KEPT_ATTR] = OrderedDict()
        key = (record.session, record.room)
        kept.pop(key, None)
        kept[key] = record
        while len(kept) > KEEP_VERDICTS:
            kept.popitem(last=False)


class FailedBlocks:
    """The failed block ranges of one planned call (``plan`` of ``template``, to decode
    ``session``), reported at most once."""

    def __init__(self, manager: Any, session: str, template: Template, plan: Any,
                 room: int | None = None) -> None:
        self.manager, self.session, self.template, self.plan = manager, session, template, plan
        self.room = room
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []
        self._why: list[str] = []
        self._reported = False

    def batch_failed(self, index: int, lo: int, hi: int, status: int) -> None:
        """Engine batch ``index`` (blocks ``lo..hi`` of the plan) returned ``status``; the
        batches after it are not submitted, so blocks ``lo..`` end are unwritten."""
        n = int(self.plan.n_blocks)
        why = f"Mooncake batch {index} (blocks {lo}..{hi} of {n}) returned {status}"
        if hi < n:
            why += f"; blocks {hi}..{n} not submitted"
        self.failed(lo, n, why)

    def failed(self, lo: int, hi: int, why: str) -> None:
        """Blocks ``lo..hi`` of the plan were not (all) written, because ``why``."""
        with self._lock:
            self._ranges.append((lo, hi))
            self._why.append(why)

    def report(self) -> FailureVerdict | None:
        """The verdict over the collected ranges, logged (one ERROR line) and kept on the
        manager; None when nothing failed, when already reported, or when no verdict could be
        made (that is logged instead: a report never changes SGLang's flow)."""
        with self._lock:
            if self._reported or not self._ranges:
                return None
            self._reported = True
            ranges, why = list(self._ranges), "; ".join(self._why)
        logger = sglang_global("logger")
        request = "?" if self.room is None else str(self.room)
        try:
            verdict = verdict_for_plan(request, self.template, self.plan, ranges,
                                       reason=f"decode session {self.session}: {why}")
        except Exception as exc:  # noqa: BLE001 - the status stays SGLang's either way
            logger.error(f"kvplan: no failure verdict for room {request} to decode session "
                         f"{self.session} ({why}): {type(exc).__name__}: {exc}")
            return None
        logger.error(f"kvplan: transfer to decode session {self.session} failed; "
                     f"unwritten destination pages: {verdict}")
        _keep(self.manager, RecordedFailure(self.session, self.room, verdict))
        return verdict
