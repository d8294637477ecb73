"""Block plans executed with batched tensor operations on the tensors that back the addresses."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import numpy.typing as npt
import torch

from kvplan import (DTYPES, SCALE_FORMATS, ConversionPlan, IndexBoundsError, KvPlanError,
                    LayoutError, RowGather)
from kvplan.exec import BlockColumns, Plan, Stage, row_gather_blocks, steps
from kvplan.quant import E4M3_EMAX, E8M0_NAN, MX_BLOCK, QMAX, QUIET_NAN

__all__ = ["BlockColumns", "TorchExecutor"]  # BlockColumns: kvplan.exec's, named here too

_U64 = npt.NDArray[np.uint64]
_I64 = npt.NDArray[np.int64]

#: Integer dtypes by element size: rows are moved as the widest integer elements their width and
#: alignment allow (fewer elements per row for the same bytes), never as floats (bit-exact).
_ELEMENT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class _Region:
    """One registered tensor: the address range it backs and its bytes as a flat uint8 view."""

    name: str
    base: int
    nbytes: int
    flat: torch.Tensor
    #: largest power of two, at most 8, that divides the view's byte offset in its storage and
    #: its address: the widest element a row view of it may use
    align: int

    @property
    def end(self) -> int:
        return self.base + self.nbytes

    def describe(self) -> str:
        return (
            f"{self.name} at [{self.base:#x}, {self.end:#x}) ({self.nbytes} bytes, "
            f"{self.flat.device})"
        )

    def rows(self, granule: int, element: int) -> torch.Tensor:
        """The region as ``[nbytes // granule, granule // element]`` rows of ``element``-byte
        integers (the bytes past the last whole row hold no block)."""
        n_rows = self.nbytes // granule
        view = self.flat[: n_rows * granule]
        if element > 1:
            view = view.view(_ELEMENT_DTYPES[element])
        return view.view(n_rows, granule // element)


def _pow2_bits(p: torch.Tensor) -> torch.Tensor:
    """The float32 bits (int32) of ``2**p`` for integers ``p`` in ``[-127, 127]``: the biased
    exponent in place, or the subnormal ``2**-127`` (bit 22). View as float32 to use."""
    p = p.to(torch.int32)
    return torch.where(p == -127, torch.full_like(p, 0x00400000), (p + 127) << 23)


def _error(cls: type[KvPlanError], kind: str, message: str) -> KvPlanError:
    err = cls(message)
    err.kind = kind
    return err


def _column(plan: BlockColumns, name: str) -> _U64:
    column = np.asarray(getattr(plan, name))
    if column.dtype != np.uint64 or column.ndim != 1:
        raise TypeError(
            f"plan.{name} must be a 1-D uint64 array, got {column.dtype} of shape {column.shape}"
        )
    return column


def _is_run(starts: _I64, counts: _I64) -> bool:
    """Whether the blocks' rows follow one another in block order: one slice of rows."""
    return bool(np.array_equal(starts[1:], starts[:-1] + counts[:-1]))


def _row_index(starts: _I64, counts: _I64, total: int, device: torch.device) -> torch.Tensor:
    """Every row of every block, block after block: ``starts[k] .. starts[k] + counts[k]``,
    built on ``device`` from the per-block arrays (no per-row array crosses from the host)."""
    first = torch.from_numpy(starts).to(device)
    width = int(counts[0])
    if np.all(counts == width):  # equal blocks (the common case): one broadcast add
        if width == 1:
            return first
        return (first[:, None] + torch.arange(width, device=device)).reshape(-1)
    # Row j of the request is (start of its block) + (j - rows before its block).
    shift = torch.from_numpy(starts - (np.cumsum(counts) - counts)).to(device)
    repeats = torch.from_numpy(counts).to(device)
    return torch.repeat_interleave(shift, repeats, output_size=total) + torch.arange(
        total, device=device
    )


#: Up to this many rows, rows that do not follow one another are read and written as slices;
#: beyond it, as one indexed copy over their bytes.
_SLICED_ROWS = 4096


def _read_rows(flat: torch.Tensor, starts: _I64, counts: _I64) -> torch.Tensor:
    """The bytes of rows ``starts[k] .. starts[k] + counts[k]`` of ``flat``, row after row."""
    total = int(counts.sum())
    if _is_run(starts, counts):
        return flat[int(starts[0]):int(starts[0]) + total]
    if starts.size <= _SLICED_ROWS:
        return torch.cat([flat[a:a + c] for a, c in zip(starts.tolist(), counts.tolist())])
    return flat[_row_index(starts, counts, total, flat.device)]


def _write_rows(flat: torch.Tensor, starts: _I64, counts: _I64, values: torch.Tensor) -> None:
    """Writes ``values`` into rows ``starts[k] .. starts[k] + counts[k]`` of ``flat``."""
    total = int(counts.sum())
    if _is_run(starts, counts):
        flat[int(starts[0]):int(starts[0]) + total].copy_(values)
    elif starts.size <= _SLICED_ROWS:
        at = 0
        for a, c in zip(starts.tolist(), counts.tolist()):
            flat[a:a + c].copy_(values[at:at + c])
            at += c
    else:
        flat.index_copy_(0, _row_index(starts, counts, total, flat.device), values)


class TorchExecutor:
    """Runs block plans on the torch tensors that back their addresses.

    ``tensors`` are the tensors of this process whose memory the plans address: a sequence
    (named ``tensors[i]`` in messages) or a mapping from names to tensors. Each backs the
    address range ``[t.data_ptr(), t.data_ptr() + nbytes)`` and must be contiguous (else
    :class:`kvplan.LayoutError` naming it, its shape and strides: register the tensor a
    strided view was taken from); two tensors sharing a byte are refused (``KvPlanError``,
    ``kind == "buffer_overlap"``). Source and destination addresses are looked up in the same
    tensors, so one executor runs a gather (KV cache -> staging buffer) and a scatter alike.

    A plan is checked whole before anything is copied: every block must lie inside one
    registered tensor on each side (:class:`kvplan.IndexBoundsError` naming the block, its
    address range and the tensor it straddles or runs past, or the nearest one), and with
    ``check_overlap`` (the default) no two blocks may write the same byte and no block may read
    a byte that a block writes (``KvPlanError``, ``kind == "block_overlap"``, naming both
    blocks): the copies then run in any order with the result of running the blocks one after
    another, which is what lets them run batched. ``check_overlap=False`` skips that check (it
    sorts the blocks: most of the executor's host time for large unordered plans); the result
    of a plan that overlaps is then undefined.

    One executor serves one thread at a time: it keeps host scratch rows between calls.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        check_overlap: bool = True,
    ) -> None:
        if isinstance(tensors, Mapping):
            named = [(str(name), t) for name, t in tensors.items()]
        else:
            named = [(f"tensors[{i}]", t) for i, t in enumerate(tensors)]
        regions = []
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} is a {type(t).__name__}, not a torch.Tensor")
            if t.layout != torch.strided:
                raise TypeError(
                    f"{name} is a {t.layout} tensor; only strided tensors have addressable memory"
                )
            if not t.is_contiguous():
                raise _error(
                    LayoutError,
                    "tensor_layout",
                    f"{name} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) is "
                    "not contiguous, so its bytes are not one address range: register "
                    "the contiguous tensor it is a view of",
                )
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue  # backs no address
            flat = t.detach().reshape(-1).view(torch.uint8)
            base = int(t.data_ptr())
            regions.append(
                _Region(name, base, nbytes, flat, math.gcd(int(flat.storage_offset()), base, 8))
            )
        regions.sort(key=lambda r: r.base)
        for before, after in zip(regions, regions[1:]):
            if after.base < before.end:
                raise _error(
                    KvPlanError,
                    "buffer_overlap",
                    f"{before.describe()} overlaps {after.describe()}: every address "
                    "must belong to one registered tensor",
                )
        self._regions = regions
        self._bases = np.array([r.base for r in regions], dtype=np.uint64)
        self._ends = np.array([r.end for r in regions], dtype=np.uint64)
        self._check_overlap = check_overlap
        # Host scratch rows for a tensor pair whose blocks are ordered on neither side, reused
        # across calls: a fresh CPU allocation costs its first-touch page faults on every call
        # (about as much as the copy). Accelerator temporaries come from torch's caching
        # allocator instead, which also keeps them ordered on their stream.
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @property
    def tensors(self) -> list[tuple[str, int, int]]:
        """``(name, address, bytes)`` of every registered tensor, by address (empty tensors
        back no address and are left out)."""
        return [(r.name, r.base, r.nbytes) for r in self._regions]

    def run(self, plan: Plan) -> int:
        """Runs every stage of ``plan`` (:func:`kvplan.exec.stages`), each memory it touches
        looked up in the registered tensors, and returns the bytes its ``network`` stage moved.
        A one-stage plan (a staged or pack plan's gather or scatter, a batch, any plan whose
        both sides are registered here) is its blocks: the bytes copied. A multi-stage plan
        (``StagedPlan``, ``plan_packed``'s or ``plan_row_gather``'s pair, ``ConversionPlan``)
        runs whole here only when this process holds both sides' memory (a single-process test
        or benchmark); a deployment runs its own side's stages and hands the network stage to a
        transfer engine. Each stage is checked whole before it copies.

        Raises:
            IndexBoundsError: A block does not lie inside one registered tensor on a side.
            KvPlanError: Blocks overlap (``kind == "block_overlap"``, with ``check_overlap``).
            TypeError: The plan's columns are not 1-D uint64 arrays of one length; ``plan`` is
                not a plan.
        """
        moved = 0
        for stage, work in steps(plan):
            done = self._run_stage(stage, work)
            if stage.kind == "network":
                moved += done
        return moved

    def _run_stage(self, stage: Stage, work: Any) -> int:
        if stage.kind == "convert":
            return self.run_conversion_rows(work)
        if stage.kind == "rows":
            return self.run_row_gather(work)
        if isinstance(work, tuple):  # a conversion plan's columns
            return self._run(*(np.asarray(c, dtype=np.uint64) for c in work))
        return self._run_blocks(work)

    def _run_blocks(self, plan: BlockColumns) -> int:
        src, dst, lengths = (_column(plan, name) for name in ("src_addrs", "dst_addrs", "lengths"))
        if not src.size == dst.size == lengths.size:
            raise TypeError(
                f"plan columns differ in length: {src.size} src_addrs, {dst.size} "
                f"dst_addrs, {lengths.size} lengths"
            )
        return self._run(src, dst, lengths)

    def run_row_gather(self, rows: RowGather) -> int:
        """Fills the pack buffer as ``Template.plan_row_gather``'s rows say (what a gather
        kernel does with ``rows.rows`` and ``rows.copies``): copy ``c``'s ``k``-th row ``r`` of
        its lane moves ``len`` bytes from ``src_base + (r // rows_per_page) * page_stride +
        (r % rows_per_page) * row_stride`` to ``pack_addr + k * len``. Vectorised over the rows
        of each copy (one copy per entry: a loop over layers, not over rows,
        :func:`kvplan.exec.row_gather_blocks`), then run as one plan; returns the bytes copied
        (``rows.pack_bytes``). Raises what :meth:`run` raises."""
        return self._run(*row_gather_blocks(rows))

    def run_conversion(self, plan: ConversionPlan) -> int:
        """Runs a conversion plan (``ConversionTemplate.plan``) as :meth:`run` does: its stages
        in the order :func:`kvplan.exec.stages` gives (gather, convert rows by the rule of
        :mod:`kvplan.quant`, bit-identical to :func:`kvplan.exec.numpy.apply_conversion`,
        network and scatter; the network before the rows when the decode converts), every
        address looked up in the registered tensors (prefill KV, staging region, decode KV
        and scale entries, when this process holds them all: a single-process test or
        benchmark; a real deployment runs the gather and rows here and hands the network to
        a transfer engine, see :meth:`run_conversion_rows`). Returns the bytes the network
        moved. Raises what :meth:`run` raises."""
        if not isinstance(plan, ConversionPlan):
            raise TypeError(f"run_conversion runs a ConversionPlan, not a {type(plan).__name__}")
        return self.run(plan)

    def run_conversion_rows(self, plan: ConversionPlan) -> int:
        """Runs only the convert rows of a conversion plan (after its gather, before its
        network): one batched quantization per (input dtype, output dtype, scale format, group
        size) of the rows, on the staging tensor. Returns the number of rows."""
        n_rows = int(plan.n_elems.size)
        if n_rows == 0:
            return 0
        n = plan.n_elems.astype(np.int64)
        group = plan.group_elems.astype(np.int64)
        key = ((plan.in_dtypes.astype(np.int64) * 256 + plan.out_dtypes.astype(np.int64)) * 256
               + plan.scale_formats.astype(np.int64)) * 1_000_003 + group
        for k in np.unique(key).tolist():
            rows = np.flatnonzero(key == k)
            if SCALE_FORMATS[int(plan.scale_formats[rows[0]])] == "e8m0":
                self._convert_mx_rows(plan, rows, n[rows], int(group[rows[0]]))
            else:
                self._convert_rows(plan, rows, n[rows], int(group[rows[0]]))
        return n_rows

    def _locate_rows(self, plan: ConversionPlan, rows: _I64,
                     lengths: tuple[_I64, _I64, _I64]) -> list[tuple[Any, _I64]]:
        """The tensor and offsets of the rows' inputs, outputs and scales (``lengths``: the
        bytes of each per row), each kind in one registered tensor."""
        located = []
        for addrs, length in zip((plan.in_addrs[rows], plan.out_addrs[rows],
                                  plan.scale_addrs[rows]), lengths):
            region, offset = self._locate(np.asarray(addrs, dtype=np.uint64),
                                          length.astype(np.uint64), "src")
            if region.min() != region.max():
                raise _error(KvPlanError, "conversion_rows",
                             "the convert rows of one dtype pair lie in several tensors; "
                             "register each staging region as one tensor")
            located.append((self._regions[int(region[0])], offset.astype(np.int64)))
        return located

    def _convert_rows(self, plan: ConversionPlan, rows: _I64, n: _I64, group: int) -> None:
        in_dtype = DTYPES[int(plan.in_dtypes[rows[0]])]
        out_dtype = DTYPES[int(plan.out_dtypes[rows[0]])]
        if in_dtype in QMAX:
            self._dequantize_rows(plan, rows, n, group, in_dtype, out_dtype)
            return
        in_size = 2  # bf16 and fp16, the input dtypes
        n_groups = n // group
        (src_r, in_off), (out_r, out_off), (scale_r, scale_off) = self._locate_rows(
            plan, rows, (n * in_size, n, n_groups * 4))
        raw = _read_rows(src_r.flat, in_off, n * in_size)
        torch_in = torch.bfloat16 if in_dtype == "bf16" else torch.float16
        x = raw.view(torch_in).to(torch.float32).reshape(-1, group)
        qmax = QMAX[out_dtype]
        amax = x.abs().amax(dim=1)
        # A tensor divisor: a true IEEE division, as NumPy does (never x * (1 / qmax)).
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, qmax))
        q = (x / scale[:, None]).clamp(-qmax, qmax)
        if out_dtype == "int8":
            codes = torch.round(q).to(torch.int8).view(torch.uint8)
        else:
            fp8 = torch.float8_e4m3fn if out_dtype == "fp8_e4m3" else torch.float8_e5m2
            codes = q.to(fp8).view(torch.uint8)
        _write_rows(out_r.flat, out_off, n, codes.reshape(-1))
        _write_rows(scale_r.flat, scale_off, n_groups * 4,
                    scale.contiguous().view(torch.uint8).to(scale_r.flat.device))

    def _convert_mx_rows(self, plan: ConversionPlan, rows: _I64, n: _I64, group: int) -> None:
        """Rows with E8M0 block scales (``mx``), by the rule of :mod:`kvplan.quant`: power-of-two
        scales built from their exponent bits (never ``pow``), so every product is one exact
        float32 multiplication, as in NumPy."""
        in_dtype = DTYPES[int(plan.in_dtypes[rows[0]])]
        out_dtype = DTYPES[int(plan.out_dtypes[rows[0]])]
        n_groups = n // group
        if in_dtype in QMAX:
            (in_r, in_off), (out_r, out_off), (scale_r, scale_off) = self._locate_rows(
                plan, rows, (n, n * 2, n_groups))
            codes = _read_rows(in_r.flat, in_off, n)
            values = codes.view(torch.float8_e4m3fn).to(torch.float32).reshape(-1, group)
            e = _read_rows(scale_r.flat, scale_off, n_groups).to(values.device).to(torch.int32)
            scale = torch.where(e == E8M0_NAN, torch.full_like(e, 0x7FC00000),
                                _pow2_bits(e - 127)).view(torch.float32)
            y = (values * scale[:, None]).reshape(-1)
            out = y.to(torch.bfloat16 if out_dtype == "bf16" else torch.float16).view(torch.int16)
            # NaN: the format's quiet NaN with the sign of the code (whatever sign or payload
            # this build's conversion gives a NaN).
            sign = (codes.to(torch.int32) & 0x80) << 8
            nan_bits = (sign | QUIET_NAN[out_dtype]).to(torch.int32)
            nan_bits = torch.where(nan_bits >= 0x8000, nan_bits - 0x10000, nan_bits)
            out = torch.where(torch.isnan(y), nan_bits.to(torch.int16).to(out.device), out)
            _write_rows(out_r.flat, out_off, n * 2,
                        out.contiguous().view(torch.uint8).to(out_r.flat.device))
            return
        (src_r, in_off), (out_r, out_off), (scale_r, scale_off) = self._locate_rows(
            plan, rows, (n * 2, n, n_groups))
        raw = _read_rows(src_r.flat, in_off, n * 2)
        torch_in = torch.bfloat16 if in_dtype == "bf16" else torch.float16
        x = raw.view(torch_in).to(torch.float32).reshape(-1, MX_BLOCK)
        amax = x.abs().amax(dim=1)
        special = ~torch.isfinite(amax)
        one = torch.ones_like(amax)
        _, k = torch.frexp(torch.where(special | (amax == 0), one, amax))
        shared = (k.to(torch.int32) - 1 - E4M3_EMAX).clamp(-127, 127)
        shared = torch.where(amax == 0, torch.full_like(shared, -127), shared)
        safe = torch.where(special[:, None], torch.zeros_like(x), x)
        q = (safe * _pow2_bits(-shared).view(torch.float32)[:, None]).clamp(-448.0, 448.0)
        codes = q.to(torch.float8_e4m3fn).view(torch.uint8)
        nan_codes = (torch.signbit(x).to(torch.uint8) << 7) | 0x7F
        codes = torch.where(special[:, None], nan_codes, codes)
        scale_bytes = torch.where(special, torch.full_like(shared, E8M0_NAN), shared + 127)
        _write_rows(out_r.flat, out_off, n, codes.reshape(-1).to(out_r.flat.device))
        _write_rows(scale_r.flat, scale_off, n_groups,
                    scale_bytes.to(torch.uint8).to(scale_r.flat.device))

    def _dequantize_rows(self, plan: ConversionPlan, rows: _I64, n: _I64, group: int,
                         in_dtype: str, out_dtype: str) -> None:
        """Decode-side rows: quantized values times their scales, rounded to bf16/fp16."""
        n_groups = n // group
        (in_r, in_off), (out_r, out_off), (scale_r, scale_off) = self._locate_rows(
            plan, rows, (n, n * 2, n_groups * 4))
        codes = _read_rows(in_r.flat, in_off, n)
        if in_dtype == "int8":
            values = codes.view(torch.int8).to(torch.float32)
        else:
            fp8 = torch.float8_e4m3fn if in_dtype == "fp8_e4m3" else torch.float8_e5m2
            values = codes.view(fp8).to(torch.float32)
        scales = _read_rows(scale_r.flat, scale_off, n_groups * 4).view(torch.float32)
        y = (values.reshape(-1, group) * scales.to(values.device)[:, None]).reshape(-1)
        out = y.to(torch.bfloat16 if out_dtype == "bf16" else torch.float16)
        _write_rows(out_r.flat, out_off, n * 2, out.view(torch.uint8).to(out_r.flat.device))

    def _run(self, src: _U64, dst: _U64, lengths: _U64) -> int:
        total_bytes = int(lengths.sum(dtype=np.uint64))
        if total_bytes == 0:
            return 0
        src_region, src_offset = self._locate(src, lengths, "src")
        dst_region, dst_offset = self._locate(dst, lengths, "dst")
        if self._check_overlap:
            self._check_disjoint(src, dst, lengths)
        # One batched copy per (source tensor, destination tensor) pair: a loop over tensor
        # pairs (layers), never over blocks. The stable sort keeps plan order inside a pair, in
        # which a gather's destination and a scatter's source are back to back.
        pair_key = src_region * len(self._regions) + dst_region
        groups: list[Union[slice, _I64]]
        if pair_key.min() == pair_key.max():
            groups = [slice(None)]
        else:
            order = np.argsort(pair_key, kind="stable")
            sorted_key = pair_key[order]
            cuts = np.flatnonzero(sorted_key[1:] != sorted_key[:-1]) + 1
            groups = list(np.split(order, cuts))
        for group in groups:
            first = 0 if isinstance(group, slice) else int(group[0])
            self._copy_pair(
                self._regions[int(src_region[first])],
                self._regions[int(dst_region[first])],
                src_offset[group],
                dst_offset[group],
                lengths[group],
            )
        return total_bytes

    def _locate(self, addrs: _U64, lengths: _U64, side: str) -> tuple[_I64, _U64]:
        """For every block, the registered tensor holding it and its byte offset there."""
        if not self._regions:
            raise self._outside(side, 0, int(addrs[0]), int(lengths[0]))
        at = np.searchsorted(self._bases, addrs, side="right").astype(np.int64) - 1
        region = np.maximum(at, 0)
        ends = addrs + lengths
        inside = (at >= 0) & (ends >= addrs) & (ends <= self._ends[region])
        if not inside.all():
            block = int(np.argmin(inside))
            raise self._outside(side, block, int(addrs[block]), int(lengths[block]))
        return region, addrs - self._bases[region]

    def _holder(self, addr: int) -> _Region | None:
        for r in self._regions:
            if r.base <= addr < r.end:
                return r
        return None

    def _outside(self, side: str, block: int, addr: int, length: int) -> KvPlanError:
        end = addr + length
        start_in, last_in = self._holder(addr), self._holder(end - 1)
        if start_in is not None and last_in is not None and last_in is not start_in:
            why = f"straddles {start_in.describe()} and {last_in.describe()}"
        elif start_in is not None:
            why = f"runs {end - start_in.end} bytes past the end of {start_in.describe()}"
        elif self._regions:
            nearest = min(self._regions, key=lambda r: max(r.base - end, addr - r.end, 0))
            why = f"lies outside every registered tensor; nearest is {nearest.describe()}"
        else:
            why = "lies outside every registered tensor; none is registered"
        return _error(
            IndexBoundsError,
            "index_bounds",
            f"{side} of block {block}, {length} bytes at [{addr:#x}, {end:#x}), "
            f"{why}; every block must lie inside one registered tensor",
        )

    @staticmethod
    def _check_disjoint(src: _U64, dst: _U64, lengths: _U64) -> None:
        moving = np.flatnonzero(lengths != 0)
        order = moving[np.argsort(dst[moving], kind="stable")]
        starts, ends = dst[order], dst[order] + lengths[order]
        clash = np.flatnonzero(starts[1:] < ends[:-1])
        if clash.size:
            a, b = sorted((int(order[clash[0]]), int(order[clash[0] + 1])))
            raise _error(
                KvPlanError,
                "block_overlap",
                f"blocks {a} and {b} both write bytes from {int(dst[b]):#x} "
                f"(block {a}: {int(lengths[a])} bytes at {int(dst[a]):#x}, block {b}: "
                f"{int(lengths[b])} bytes at {int(dst[b]):#x}); the executor copies "
                "blocks in no set order, so their result would be undefined",
            )
        # The destinations are disjoint and sorted, so their ends ascend too: a read meets a
        # write iff the last write starting before the read's end ends after its start.
        last = np.searchsorted(starts, src[moving] + lengths[moving], side="left") - 1
        meets = (last >= 0) & (ends[np.maximum(last, 0)] > src[moving])
        if meets.any():
            k = int(np.argmax(meets))
            reader, writer = int(moving[k]), int(order[last[k]])
            raise _error(
                KvPlanError,
                "block_overlap",
                f"block {reader} reads {int(lengths[reader])} bytes at "
                f"{int(src[reader]):#x} that block {writer} writes "
                f"({int(lengths[writer])} bytes at {int(dst[writer]):#x}); the executor "
                "copies blocks in no set order, so the bytes read would be undefined",
            )

    def _copy_pair(
        self, src: _Region, dst: _Region, src_offset: _U64, dst_offset: _U64, lengths: _U64
    ) -> None:
        """Copies blocks from one registered tensor to another with at most two batched ops."""
        if not lengths.any():
            return  # zero-length blocks only: no granule, nothing to copy
        # The blocks are moved as rows of one width so that one index_select / index_copy_
        # pair moves them all. The granule is the largest width that divides every offset and
        # every length on both sides: each block is then a whole number of rows starting on a
        # row boundary in both tensors, and the rows are as few as they can be. Both the index
        # arrays and the per-row work of the two operations grow with the row count, so a
        # plan of whole pages moves page-sized rows and a per-token plan token-sized ones,
        # never single bytes unless some block starts or ends at an odd byte.
        granule = math.gcd(
            int(np.gcd.reduce(src_offset)),
            int(np.gcd.reduce(dst_offset)),
            int(np.gcd.reduce(lengths)),
        )
        element = math.gcd(granule, src.align, dst.align)
        src_rows, dst_rows = src.rows(granule, element), dst.rows(granule, element)
        g = np.uint64(granule)
        src_start = (src_offset // g).astype(np.int64)
        dst_start = (dst_offset // g).astype(np.int64)
        counts = (lengths // g).astype(np.int64)
        total = int(counts.sum())
        single = counts.size == 1
        src_run = single or _is_run(src_start, counts)
        dst_run = single or _is_run(dst_start, counts)
        s0, d0 = int(src_start[0]), int(dst_start[0])
        if src_run and dst_run:
            dst_rows[d0 : d0 + total].copy_(src_rows[s0 : s0 + total])
            return
        same_device = src_rows.device == dst_rows.device
        if dst_run:  # a gather: select straight into the destination's rows
            src_index = _row_index(src_start, counts, total, src_rows.device)
            if same_device:
                torch.index_select(src_rows, 0, src_index, out=dst_rows[d0 : d0 + total])
            else:
                dst_rows[d0 : d0 + total].copy_(src_rows.index_select(0, src_index))
            return
        dst_index = _row_index(dst_start, counts, total, dst_rows.device)
        if src_run:  # a scatter: copy straight from the source's rows
            dst_rows.index_copy_(0, dst_index, src_rows[s0 : s0 + total].to(dst_rows.device))
            return
        src_index = _row_index(src_start, counts, total, src_rows.device)
        if src_rows.device.type == "cpu":
            moved = self._scratch_rows(total, src_rows.shape[1], src_rows.dtype)
            torch.index_select(src_rows, 0, src_index, out=moved)
        else:
            moved = src_rows.index_select(0, src_index)
        dst_rows.index_copy_(0, dst_index, moved.to(dst_rows.device))

    def _scratch_rows(self, n_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n_rows * width * dtype.itemsize
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype).view(n_rows, width)
