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
the two sides), which side runs it and which memories it reads and writes. Both executors run a
plan by that list, so the order is written once:

- :class:`kvplan.exec.numpy.NumpyExecutor` on :class:`~kvplan.exec.numpy.Memory` (NumPy bytes
  at addresses), one per role;
- :class:`kvplan.torch.TorchExecutor` on the torch tensors that back every address
  (:mod:`kvplan.exec.torch` names it beside the NumPy one).

Both satisfy :class:`Executor`. Importing this package imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Protocol, Union, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvplan import ConversionPlan, RowGather, StagedPlan, StagedRounds

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


_DIRECT = (Stage("network", None, None, "src", "dst"),)
_GATHER = Stage("copy", "src", "gather", "src", "src_staging")
_STAGED = (_GATHER, Stage("network", None, "network", "src_staging", "dst_staging"),
           Stage("copy", "dst", "scatter", "dst_staging", "dst"))
_PACKED = (_GATHER, Stage("network", None, "network", "src_staging", "dst"))
_ROW_GATHER = (Stage("rows", "src", "rows", "src", "src_staging"),
               Stage("network", None, "network", "src_staging", "dst"))
# A prefill-side conversion's scatter is empty (the network writes the decode's pages); it is
# listed so that every part of the plan is run, reading and writing the decode's memory.
_CONVERT_ON_PREFILL = (_GATHER, Stage("convert", "src", None, "src_staging", "src_staging"),
                       Stage("network", None, "network", "src_staging", "dst"),
                       Stage("copy", "dst", "scatter", "dst", "dst"))
_CONVERT_ON_DECODE = (_GATHER, Stage("network", None, "network", "src_staging", "dst_staging"),
                      Stage("convert", "dst", None, "dst_staging", "dst"),
                      Stage("copy", "dst", "scatter", "dst_staging", "dst"))


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
    if isinstance(plan, (StagedPlan, StagedRounds)):
        return _STAGED
    if isinstance(plan, ConversionPlan):
        return _CONVERT_ON_DECODE if plan.convert_on == "decode" else _CONVERT_ON_PREFILL
    if isinstance(plan, tuple) and len(plan) == 2 and _has_columns(plan[1]):
        if isinstance(plan[0], RowGather):
            return _ROW_GATHER
        if _has_columns(plan[0]):
            return _PACKED
    elif _has_columns(plan):
        return _DIRECT
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
