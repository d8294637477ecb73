"""The NumPy executor: plans run as memmoves on :class:`Memory` (NumPy bytes at addresses).

Slow and plain (one slice per block), on CPU memory: what the byte-level oracle of
:mod:`kvplan.testing.oracle` is compared with, and the reference the torch executor is measured
against. :func:`run` (or :class:`NumpyExecutor`) runs any plan by :func:`kvplan.exec.stages`,
each memory passed by its role; :func:`apply_plan`, :func:`apply_staged` and
:func:`apply_conversion` are the same for one kind of plan, with positional memories.

Conversion rows follow the rule of :mod:`kvplan.quant` (a row's ``scale_formats`` code picks
it: float32 scales for ``per_token`` / ``per_token_head``, E8M0 block scales for ``mx``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplan import DTYPES, SCALE_FORMATS, KvPlanError
from kvplan.exec import Plan, Role, Stage, row_gather_blocks, steps
from kvplan.quant import dequantize_groups, dequantize_mx, quantize_groups, quantize_mx, to_float32

__all__ = ["Memory", "NumpyExecutor", "apply_conversion", "apply_plan", "apply_staged", "run"]

_Written = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Memory:
    """Bytes at addresses: ``data[i]`` is the byte at address ``base + i``."""

    data: npt.NDArray[np.uint8]
    base: int

    @classmethod
    def of(cls, array: npt.NDArray[Any]) -> Memory:
        """The memory of a C-contiguous numpy array, at the address it really has (for layouts
        built on ``array.ctypes.data``)."""
        if not array.flags.c_contiguous:
            raise ValueError("Memory.of needs a C-contiguous array")
        return cls(array.reshape(-1).view(np.uint8), int(array.ctypes.data))

    def at(self, addr: int, n: int) -> npt.NDArray[np.uint8]:
        """The ``n`` bytes at ``addr`` (a view); outside this memory is an ``IndexError``."""
        off = addr - self.base
        if off < 0 or n < 0 or off + n > self.data.size:
            raise IndexError(f"bytes {addr:#x}..{addr + n:#x} are outside memory "
                             f"{self.base:#x}..{self.base + self.data.size:#x}")
        return self.data[off:off + n]

    def copy(self) -> Memory:
        return Memory(self.data.copy(), self.base)


def _mark(written: _Written | None, mem: Memory, addr: int, n: int) -> None:
    """Flags ``n`` destination bytes at ``addr`` written; a byte written twice is an
    ``AssertionError``."""
    if written is None:
        return
    off = addr - mem.base
    assert not written[off:off + n].any(), f"destination byte written twice in {addr:#x}+{n}"
    written[off:off + n] = True


def apply_plan(plan: Any, src_mem: Memory, dst_mem: Memory,
               written: _Written | None = None) -> None:
    """Applies a plan's blocks (anything with ``as_lists()``: ``TransferPlan``, ``BlockSlice``)
    as memmoves. A block outside either memory is an ``IndexError``; with ``written`` (one
    flag per destination byte) a destination byte written twice is an ``AssertionError``."""
    for s, d, n in zip(*plan.as_lists()):
        source, target = src_mem.at(s, n), dst_mem.at(d, n)
        _mark(written, dst_mem, d, n)
        target[:] = source


def _apply_blocks(blocks: tuple[Any, Any, Any], src_mem: Memory, dst_mem: Memory,
                  written: _Written | None = None) -> None:
    """Applies ``(src_addrs, dst_addrs, lengths)`` columns as memmoves (as :func:`apply_plan`)."""
    for s, d, n in zip(*(np.asarray(column).tolist() for column in blocks)):
        target = dst_mem.at(d, n)
        _mark(written, dst_mem, d, n)
        target[:] = src_mem.at(s, n)


def _convert(plan: Any, reads: Memory, writes: Memory, written: _Written | None) -> None:
    """A conversion plan's convert rows. On the prefill (quantizing): inputs in ``reads``, the
    values and scales written into ``writes`` (both the prefill staging region). On the decode
    (dequantizing): values and scales in ``reads`` (the decode staging region), the output into
    ``writes`` (the decode's memory, flagged in ``written``)."""
    rows = zip(plan.in_addrs.tolist(), plan.out_addrs.tolist(), plan.n_elems.tolist(),
               plan.in_dtypes.tolist(), plan.out_dtypes.tolist(), plan.group_elems.tolist(),
               plan.scale_addrs.tolist(),
               [SCALE_FORMATS[code] == "e8m0" for code in plan.scale_formats.tolist()])
    if plan.convert_on == "decode":
        for in_addr, out_addr, n, in_code, out_code, group, scale_addr, mx in rows:
            codes = reads.at(in_addr, n)
            if mx:
                out = dequantize_mx(codes, reads.at(scale_addr, n // group), group,
                                    DTYPES[out_code])
            else:
                scales = reads.at(scale_addr, n // group * 4).view("<f4")
                out = dequantize_groups(codes, scales, group, DTYPES[in_code], DTYPES[out_code])
            if written is not None:
                off = out_addr - writes.base
                assert not written[off:off + out.size].any(), f"written twice at {out_addr:#x}"
                written[off:off + out.size] = True
            writes.at(out_addr, out.size)[:] = out
        return
    for in_addr, out_addr, n, in_code, out_code, group, scale_addr, mx in rows:
        size = 2  # bf16 and fp16, the input dtypes
        x = to_float32(reads.at(in_addr, n * size), DTYPES[in_code])
        if mx:
            values, scale_bytes = quantize_mx(x)
        else:
            values, scales = quantize_groups(x, group, DTYPES[out_code])
            scale_bytes = scales.astype("<f4").view(np.uint8)
        writes.at(out_addr, n)[:] = values
        writes.at(scale_addr, scale_bytes.size)[:] = scale_bytes


def _stage_bytes(work: Any) -> int:
    if hasattr(work, "lengths"):
        return int(np.asarray(work.lengths).sum(dtype=np.uint64))
    return int(np.asarray(work[2]).sum(dtype=np.uint64))


def _run_stage(stage: Stage, work: Any, reads: Memory, writes: Memory,
               written: _Written | None) -> None:
    if stage.kind == "convert":
        _convert(work, reads, writes, written)
    elif stage.kind == "rows":
        _apply_blocks(row_gather_blocks(work), reads, writes, written)
    elif hasattr(work, "as_lists"):
        apply_plan(work, reads, writes, written)
    else:
        _apply_blocks(work, reads, writes, written)


def run(plan: Plan, src: Memory, dst: Memory, *, src_staging: Memory | None = None,
        dst_staging: Memory | None = None, written: _Written | None = None) -> int:
    """Runs every stage of ``plan`` (:func:`kvplan.exec.stages`) as memmoves between the
    memories of the roles they read and write, and returns the bytes its ``network`` stage
    moved. ``written`` (one flag per byte of ``dst``) flags every byte a stage writes into
    ``dst``: one written twice is an ``AssertionError``. A block outside its memory is an
    ``IndexError``.

    Raises:
        KvPlanError: A stage reads or writes a staging region that was not given (naming the
            stage and the keyword to pass).
        TypeError: ``plan`` is not a plan (:func:`kvplan.exec.stages`).
    """
    memories: dict[Role, Memory | None] = {"src": src, "src_staging": src_staging,
                                           "dst_staging": dst_staging, "dst": dst}
    found = steps(plan)
    for stage, _ in found:
        for role in (stage.reads, stage.writes):
            if memories[role] is None:
                raise KvPlanError(
                    f"the {stage.kind} stage ({stage.part or 'the plan'}) of this "
                    f"{type(plan).__name__ if not isinstance(plan, tuple) else 'plan pair'} "
                    f"{'reads' if role == stage.reads else 'writes'} {role}: give {role}="
                )
    moved = 0
    for stage, work in found:
        reads, writes = memories[stage.reads], memories[stage.writes]
        assert reads is not None and writes is not None  # checked above
        _run_stage(stage, work, reads, writes, written if stage.writes == "dst" else None)
        if stage.kind == "network":
            moved += _stage_bytes(work)
    return moved


class NumpyExecutor:
    """:func:`run` on memories given once (a :class:`kvplan.exec.Executor`)."""

    def __init__(self, src: Memory, dst: Memory, *, src_staging: Memory | None = None,
                 dst_staging: Memory | None = None, written: _Written | None = None) -> None:
        self.src, self.dst = src, dst
        self.src_staging, self.dst_staging = src_staging, dst_staging
        self.written = written

    def run(self, plan: Plan) -> int:
        """Runs every stage of ``plan``; returns the bytes its network stage moved."""
        return run(plan, self.src, self.dst, src_staging=self.src_staging,
                   dst_staging=self.dst_staging, written=self.written)


def apply_staged(staged: Any, src_mem: Memory, src_staging: Memory, dst_staging: Memory,
                 dst_mem: Memory, written: _Written | None = None) -> None:
    """Runs one writer's staged plan (``Template.plan_staged``) as memmoves: ``gather`` from
    the prefill's memory into its staging region, ``network`` into the decode's staging region,
    ``scatter`` into the decode's memory (``written`` as for :func:`apply_plan`, on the decode
    memory). A writer's scatter reads only its own share of the decode region, so writers
    sharing one region can each be applied in turn; the decode memory must then equal the
    oracle's for the direct transfer."""
    run(staged, src_mem, dst_mem, src_staging=src_staging, dst_staging=dst_staging,
        written=written)


def apply_conversion(plan: Any, src_mem: Memory, src_staging: Memory | None = None,
                     dst_mem: Memory | None = None, written: _Written | None = None,
                     dst_staging: Memory | None = None, *,
                     staging: Memory | None = None) -> None:
    """Runs a conversion plan (``ConversionTemplate.plan``) on CPU memory. Converting on the
    prefill (``plan.convert_on == "prefill"``): ``gather`` from the prefill's memory into
    ``src_staging``, every convert row (values into the converted area, scales into the scale
    area), ``network`` from the staging region into the decode's memory (``written`` as for
    :func:`apply_plan`). Converting on the decode: ``gather`` into ``src_staging``, ``network``
    into ``dst_staging`` (the decode's staging region), every convert row from there into the
    decode's memory, ``scatter`` (the pairs kept as they are) from there too.

    ``staging=`` is the old name of ``src_staging`` (a ``DeprecationWarning``).
    """
    if staging is not None:
        if src_staging is not None:
            raise TypeError("apply_conversion got both src_staging and its old name staging")
        warnings.warn("apply_conversion(staging=) is deprecated: pass src_staging=",
                      DeprecationWarning, stacklevel=2)
        src_staging = staging
    if src_staging is None or dst_mem is None:
        raise TypeError("apply_conversion needs src_staging and dst_mem")
    if plan.convert_on == "decode" and dst_staging is None:
        raise KvPlanError("this plan converts on the decode: give dst_staging")
    run(plan, src_mem, dst_mem, src_staging=src_staging, dst_staging=dst_staging,
        written=written)
