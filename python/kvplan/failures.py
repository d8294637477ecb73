"""Failure verdicts in the engines' shape: per request, the destination blocks a failed
transfer left unwritten, per KV-cache group (a page pool of kvplan's layout, or the group a
per-group template serves), and why.

A transfer engine reports failure per submitted batch (a range of a plan's blocks); the core
(``kvplan._core.failed_pages``) walks each failed block's destination bytes through the decode
layout to the pages they belong to, so a verdict names exactly the pages the failed blocks were
to write: not the whole request, and equal page ids of different groups stay apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvplan._core import failed_batch_pages, failed_pages

if TYPE_CHECKING:
    from kvplan._core import BatchPlan, Blocks, Request, Template

__all__ = ["FailureVerdict", "STATE_GROUP", "failed_ranges", "verdict_for_plan",
           "verdicts_for_batch", "merge_verdicts", "verdict_for_unscattered_rounds"]

#: The group key a verdict files a request's state slots under (state entries have no pool).
STATE_GROUP = -1


@dataclass(frozen=True)
class FailureVerdict:
    """One request's failed destination blocks, per KV-cache group.

    ``blocks`` maps a group id to the sorted, unique block (page) ids of that group the failed
    transfer was to write; the group :data:`STATE_GROUP` holds the request's state slots. A
    group with no failed block is absent."""

    request_id: str
    blocks: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    reason: str = ""

    @property
    def failed(self) -> bool:
        """Whether any block failed."""
        return any(self.blocks.values())

    def group(self, group: int) -> tuple[int, ...]:
        """The failed block ids of ``group`` (empty when none failed)."""
        return self.blocks.get(group, ())

    def __str__(self) -> str:
        # the groups in order, the state slots last
        order = sorted(self.blocks.items(), key=lambda item: (item[0] == STATE_GROUP, item[0]))
        groups = "; ".join(f"group {g}: blocks {list(ids)}" if g != STATE_GROUP
                           else f"state slots {list(ids)}" for g, ids in order)
        return f"request {self.request_id!r} failed ({self.reason or 'no reason given'}): " + (
            groups or "no blocks")


def failed_ranges(failed: Iterable[int | tuple[int, int] | slice]) -> list[tuple[int, int]]:
    """Failed block positions (ints), ``(start, stop)`` ranges or ``slice`` objects as the
    ``(start, stop)`` ranges the core takes (a slice with a step is refused)."""
    out: list[tuple[int, int]] = []
    for item in failed:
        if isinstance(item, slice):
            if item.step not in (None, 1) or item.start is None or item.stop is None:
                from kvplan._core import IndexBoundsError

                raise IndexBoundsError(f"failed blocks: a failed range must be a slice with a "
                                       f"start and a stop and no step, got {item}")
            out.append((int(item.start), int(item.stop)))
        elif isinstance(item, tuple):
            out.append((int(item[0]), int(item[1])))
        else:
            out.append((int(item), int(item) + 1))
    return out


def verdict_for_plan(request_id: str, template: Template, plan: Blocks,
                     failed: Iterable[int | tuple[int, int] | slice], *, reason: str = "",
                     groups: Mapping[int, int] | None = None) -> FailureVerdict:
    """The verdict for blocks ``failed`` of ``plan`` (planned by ``template`` for request
    ``request_id``): each failed block's destination pages, filed under their pool's KV-cache
    group (``groups`` maps a pool id to a group; default: the pool id is the group).

    Raises:
        IndexBoundsError: A failed range reversed or past the plan, or a block that lies in
            none of the decode layout's entries (a plan of another template).
    """
    pools, slots = failed_pages(template, plan.dst_addrs, plan.lengths, failed_ranges(failed))
    blocks: dict[int, tuple[int, ...]] = {}
    for pool, pages in pools.items():
        group = pool if groups is None else groups.get(pool, pool)
        blocks[group] = _union(blocks.get(group, ()), pages)
    if len(slots):
        blocks[STATE_GROUP] = tuple(int(s) for s in slots)
    return FailureVerdict(request_id, blocks, reason)


def verdicts_for_batch(request_ids: Sequence[str], batch: BatchPlan,
                       requests: Sequence[Request | tuple[object, ...]],
                       failed: Iterable[int | tuple[int, int] | slice], *, reason: str = "",
                       groups: Mapping[int, int] | None = None) -> list[FailureVerdict]:
    """One verdict per request of ``batch`` (planned from ``requests``, named ``request_ids``)
    that the failed blocks hold bytes of, in batch order: its own failed pages per group (the
    blocks of fused requests name each request the pages of its own lists).

    Raises:
        IndexBoundsError: As :func:`verdict_for_plan`, or ``requests`` of another count than
            the batch's.
    """
    if len(request_ids) != len(requests):
        from kvplan._core import IndexBoundsError

        raise IndexBoundsError(f"failed blocks: {len(request_ids)} request ids for "
                               f"{len(requests)} requests; name each request once")
    found = failed_batch_pages(batch, batch.dst_addrs, batch.lengths,
                               [_dst_pages(r) for r in requests], failed_ranges(failed))
    verdicts = []
    for r, pools, slots in found:
        blocks: dict[int, tuple[int, ...]] = {}
        for pool, pages in pools.items():
            group = pool if groups is None else groups.get(pool, pool)
            blocks[group] = _union(blocks.get(group, ()), pages)
        if len(slots):
            blocks[STATE_GROUP] = tuple(int(s) for s in slots)
        verdicts.append(FailureVerdict(request_ids[r], blocks, reason))
    return verdicts


def _dst_pages(request: Request | tuple[object, ...]) -> dict[int, np.ndarray] | int:
    """A batch request's destination pages per pool (or its destination slot), as planned."""
    if isinstance(request, tuple):
        return {0: np.asarray(request[1], dtype=np.int64)}
    if request.slot is not None:
        return int(request.slot[1])
    pages: dict[int, np.ndarray] = {}
    if request.dst is not None:
        pages[0] = np.asarray(request.dst, dtype=np.int64)
    for pool, (_, dst) in (request.pool_pages or {}).items():
        if dst is not None:
            pages[int(pool)] = np.asarray(dst, dtype=np.int64)
    window = request.window_pages
    if window is not None and window[1] is not None and 1 not in pages:
        pages[1] = np.asarray(window[1], dtype=np.int64)
    return pages


def verdict_for_unscattered_rounds(request_id: str, template: Template, rounds: Any,
                                   scattered: int, *, reason: str = "") -> FailureVerdict:
    """The failed blocks of a staged request (``rounds``, from ``template.plan_rounds``) that
    ended after its first ``scattered`` rounds were scattered: every decode page the scatter
    plans of ``rounds[scattered:]`` were to write (their bytes may never have landed), per
    group; the rounds already scattered are not named."""
    verdicts = [verdict_for_plan(request_id, template, r.scatter, [(0, len(r.scatter))],
                                 reason=reason)
                for r in list(rounds)[scattered:] if len(r.scatter)]
    merged = merge_verdicts(verdicts)
    return merged[0] if merged else FailureVerdict(request_id, {}, reason)


def merge_verdicts(verdicts: Sequence[FailureVerdict]) -> list[FailureVerdict]:
    """One verdict per request (in first-seen order): the groups' blocks of every verdict of
    that request united, their reasons joined."""
    merged: dict[str, FailureVerdict] = {}
    for v in verdicts:
        seen = merged.get(v.request_id)
        if seen is None:
            merged[v.request_id] = v
            continue
        blocks = dict(seen.blocks)
        for group, ids in v.blocks.items():
            blocks[group] = _union(blocks.get(group, ()), ids)
        reasons = seen.reason if v.reason in ("", seen.reason) else f"{seen.reason}; {v.reason}"
        merged[v.request_id] = FailureVerdict(v.request_id, blocks, reasons)
    return list(merged.values())


def _union(a: Iterable[int], b: Iterable[int] | np.ndarray) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in a} | {int(x) for x in b}))
