"""Executors: one description of a plan's stages, and one interface that runs them.

A plan is one stage (``TransferPlan``, ``BatchPlan``, ``BlockSlice``: blocks from one memory
into another) or several, run in a fixed order between up to four memories, named by role the
same way in every executor:

- ``src``: the prefill's KV memory; ``dst``: the decode's KV memory;
- ``src_staging``: a prefill staging region (``plan_staged``'s ``src_staging``, ``plan_rounds``'s
  ``src_arena``, the pack buffer of ``plan_packed`` and ``plan_row_gather``, a conversion plan's
  staging region);
- ``dst_staging``: the decode's staging region (``plan_staged``, ``plan_rounds``'s ``dst_arena``,
  a decode-side conversion).

:func:`stages` lists, for each kind of plan, its stages in order: what each does (``copy``
blocks in one process, ``rows`` of a row gather, ``convert`` rows, ``network`` blocks between
the two sides), which side runs it and which memories it reads and writes. The list is the
core's (``StagedPlan.stages``, ``StagedRounds.stages``, ``ConversionPlan.stages``, and
``kvplan._core.plan_stages`` for a plan that reaches Python as one stage or as a pair), so the
order is written once, in the core; both executors run a plan by that list:

- :class:`kvplan.exec.numpy.NumpyExecutor` on :class:`~kvplan.exec.numpy.Memory` (NumPy bytes
  at addresses), one per role;
- :class:`kvplan.torch.TorchExecutor` on the torch tensors that back every address
  (:mod:`kvplan.exec.torch` names it beside the NumPy one).

Both satisfy :class:`Executor`. Importing this package imports no torch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, Union, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvplan import ConversionPlan, RowGather, StagedPlan, StagedRounds
from kvplan._core import plan_stages

if TYPE_CHECKING:
    from kvplan._core import _StageNames

__all__ = ["BlockColumns", "Executor", "Plan", "Stage", "Role", "row_gather_blocks", "stages",
           "steps"]

_U64 = npt.NDArray[np.uint64]

#: A memory a stage reads or writes.
Role = Literal["src", "src_staging", "dst_staging", "dst"]


class BlockColumns(Protocol):
    """A one-stage plan: three equally long 1-D uint64 columns, block ``k`` copying
    ``lengths[k]`` bytes from ``src_addrs[k]`` to ``dst_addrs[k]`` (``kvplan.TransferPlan``,
    ``BlockSlice``, ``BatchPlan``)."""

    @property
    def src_addrs(self) -> _U64: ...
    @property
    def dst_addrs(self) -> _U64: ...
    @property
    def lengths(self) -> _U64: ...


#: What an executor runs: a one-stage plan, ``Template.plan_staged``'s ``StagedPlan``,
#: ``Template.plan_rounds``'s ``StagedRounds``, ``plan_packed``'s ``(gather, network)``,
#: ``plan_row_gather``'s ``(rows, network)`` or ``ConversionTemplate.plan``'s ``ConversionPlan``.
Plan = Union[BlockColumns, StagedPlan, StagedRounds, ConversionPlan,
             tuple[BlockColumns, BlockColumns], tuple[RowGather, BlockColumns]]


class Stage(NamedTuple):
    """One stage of a plan."""

    #: ``"copy"`` (blocks inside one process), ``"rows"`` (a row gather's rows into the pack
    #: buffer), ``"convert"`` (a conversion plan's convert rows) or ``"network"`` (blocks from
    #: the prefill to the decode; a one-stage plan's blocks, whichever memories they join)
    kind: Literal["copy", "rows", "convert", "network"]
    #: the side whose process runs it (``None``: the transfer engine, for ``network``)
    side: Literal["src", "dst"] | None
    #: the plan's attribute holding the stage's work (``None``: the plan itself)
    part: Literal["gather", "network", "scatter", "rows"] | None
    reads: Role
    writes: Role


@functools.lru_cache(maxsize=None)
def _described(names: tuple[_StageNames, ...]) -> tuple[Stage, ...]:
    return tuple(Stage(*one) for one in names)


def _form(name: str) -> tuple[Stage, ...]:
    return _described(plan_stages(name))


def _has_columns(x: object) -> bool:
    return all(hasattr(x, name) for name in ("src_addrs", "dst_addrs", "lengths"))


def stages(plan: Plan) -> tuple[Stage, ...]:
    """The stages of ``plan``, in the order they run.

    For ``Template.plan_staged``'s plan, ``[(s.kind, s.side) for s in stages(staged)]`` is
    ``[("copy", "src"), ("network", None), ("copy", "dst")]``. ``Template.plan_rounds``'s
    rounds have the same three stages, which run for each round in turn (:func:`steps` lists
    them round after round).

    Raises:
        TypeError: ``plan`` is none of the plans in :data:`Plan` (the message names its type).
    """
    if isinstance(plan, (StagedPlan, StagedRounds, ConversionPlan)):
        return _described(plan.stages)
    if isinstance(plan, tuple) and len(plan) == 2 and _has_columns(plan[1]):
        if isinstance(plan[0], RowGather):
            return _form("row_gather")
        if _has_columns(plan[0]):
            return _form("packed")
    elif _has_columns(plan):
        return _form("direct")
    raise TypeError(
        f"a {type(plan).__name__} is not a plan an executor runs: expected a TransferPlan, "
        "BatchPlan or BlockSlice, a StagedPlan or StagedRounds, plan_packed's (gather, network), "
        "plan_row_gather's (rows, network) or a ConversionPlan"
    )


def steps(plan: Plan) -> list[tuple[Stage, Any]]:
    """:func:`stages` with each stage's work: a plan with block columns (``copy`` and
    ``network``; a conversion plan's are ``(src_addrs, dst_addrs, lengths)`` tuples), the
    ``RowGather`` (``rows``) or the ``ConversionPlan`` (``convert``); a ``StagedRounds``'
    stages round after round, each with that round's part."""
    found = stages(plan)
    if isinstance(plan, StagedRounds):
        return [(stage, getattr(one, stage.part or "")) for one in plan for stage in found]
    if isinstance(plan, tuple):  # plan_packed's and plan_row_gather's pairs
        halves = {"gather": plan[0], "rows": plan[0], "network": plan[1]}
        return [(stage, halves[stage.part or ""]) for stage in found]
    return [(stage, plan if stage.part is None else getattr(plan, stage.part))
            for stage in found]


def row_gather_blocks(rows: RowGather) -> tuple[_U64, _U64, _U64]:
    """A row gather's copies as block columns ``(src_addrs, dst_addrs, lengths)``, copy after
    copy, row after row: copy ``c``'s ``k``-th row ``r`` of its lane moves ``len`` bytes from
    ``src_base + (r // rows_per_page) * page_stride + (r % rows_per_page) * row_stride`` to
    ``pack_addr + k * len``. Vectorised over the rows of each copy (a loop over copies, one per
    entry, never over rows)."""
    src_parts, dst_parts, len_parts = [], [], []
    lanes = rows.rows
    for lane, src_base, page_stride, row_stride, per_page, length, pack_addr in \
            rows.copies.tolist():
        lane_rows = lanes[lane]
        src_parts.append(
            np.uint64(src_base)
            + lane_rows // np.uint64(per_page) * np.uint64(page_stride)
            + lane_rows % np.uint64(per_page) * np.uint64(row_stride)
        )
        dst_parts.append(
            np.uint64(pack_addr) + np.arange(lane_rows.size, dtype=np.uint64) * np.uint64(length)
        )
        len_parts.append(np.full(lane_rows.size, length, dtype=np.uint64))
    if not src_parts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty.copy(), empty.copy()
    return np.concatenate(src_parts), np.concatenate(dst_parts), np.concatenate(len_parts)


@runtime_checkable
class Executor(Protocol):
    """What runs a plan on memory the executor was given when it was made: every stage of
    :func:`stages` in order; returns the bytes its ``network`` stage moved (a one-stage plan:
    its bytes)."""

    def run(self, plan: Plan) -> int: ...
