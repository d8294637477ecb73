"""Templates and plans: the typed layer over the native planner."""

from __future__ import annotations

from collections.abc import Iterator
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvplan import _core

__all__ = ["PlanBatch", "Template", "TransferPlan"]

U64Array = npt.NDArray[np.uint64]

# Building a plan is on every request's path: tuple.__new__ is a C call, a Python __init__ is not.
_new_tuple = tuple.__new__


class PlanBatch(NamedTuple):
    """A slice of a plan's blocks (views, no copy), sized for one engine submission."""

    src_addrs: U64Array
    dst_addrs: U64Array
    lengths: U64Array

    def as_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The three columns as Python lists, the argument type engines convert fastest."""
        return self.src_addrs.tolist(), self.dst_addrs.tolist(), self.lengths.tolist()


class TransferPlan(tuple):  # type: ignore[type-arg]
    """The `(src_addr, dst_addr, length)` blocks of one request, entry-pair major, run minor.

    The three uint64 arrays view one Rust buffer without a copy; it returns to kvplan's pool
    when the last of them dies, so they stay valid after the plan object is gone.

    A tuple underneath (``src_addrs, dst_addrs, lengths, n_runs, total_bytes, emitting``)
    because the native planner builds it in one step; use the named attributes.
    """

    __slots__ = ()

    src_addrs: U64Array = property(itemgetter(0))  # type: ignore[assignment]
    dst_addrs: U64Array = property(itemgetter(1))  # type: ignore[assignment]
    lengths: U64Array = property(itemgetter(2))  # type: ignore[assignment]
    n_runs: int = property(itemgetter(3))  # type: ignore[assignment]
    total_bytes: int = property(itemgetter(4))  # type: ignore[assignment]
    _emitting: tuple[bool, ...] = property(itemgetter(5))  # type: ignore[assignment]

    @property
    def n_blocks(self) -> int:
        return len(self.src_addrs)

    @property
    def n_pairs(self) -> int:
        """Entry pairs of the template (including elided pairs that emit nothing)."""
        return len(self._emitting)

    def __len__(self) -> int:
        return len(self[0])

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    @property
    def pair_offsets(self) -> npt.NDArray[np.int64]:
        """`n_pairs + 1` block offsets: pair p's blocks are `pair_offsets[p]:pair_offsets[p+1]`."""
        per_pair = np.asarray(self._emitting, dtype=np.int64) * self.n_runs
        return np.concatenate(([0], np.cumsum(per_pair))).astype(np.int64)

    def pair_blocks(self, pair: int) -> slice:
        """The block range of entry pair `pair` (layer-wise submission needs no re-sorting)."""
        offsets = self.pair_offsets
        return slice(int(offsets[pair]), int(offsets[pair + 1]))

    def batches(self, max_blocks: int) -> Iterator[PlanBatch]:
        """Consecutive views of at most `max_blocks` blocks each (nothing for an empty plan)."""
        if max_blocks <= 0:
            raise _core.KvPlanError(f"max_blocks must be positive, got {max_blocks}")
        for start in range(0, self.n_blocks, max_blocks):
            stop = start + max_blocks
            yield PlanBatch(self.src_addrs[start:stop], self.dst_addrs[start:stop], self.lengths[start:stop])

    def as_lists(self) -> tuple[list[int], list[int], list[int]]:
        """All blocks as three Python lists (one `.tolist()` each, no Python loop per block)."""
        return self.src_addrs.tolist(), self.dst_addrs.tolist(), self.lengths.tolist()

    def __repr__(self) -> str:
        return (
            f"TransferPlan(n_blocks={self.n_blocks}, n_runs={self.n_runs}, n_pairs={self.n_pairs}, "
            f"total_bytes={self.total_bytes})"
        )


class Template(_core.Template):
    """A validated peer pair (prefill layout → decode layout), built once, planned per request.

    Args:
        src_layout: The prefill peer's layout.
        dst_layout: The decode peer's layout.
        allow_positional_fallback: Pair positionally when ids are missing on one side or both
            (SGLang allows this only at prefill PP = 1).
        prefill_start_layer: For legacy peers without ids and with different entry counts: the
            first layer this prefill stage owns (enables strict PP slicing).
        legacy_kind: ``"mla"`` or ``"mha"`` for such legacy peers (inferred from roles if given).
        check_dst_overlap: Reject requests that would write a destination item twice.

    Raises:
        PairingError: A source entry has no partner, ids are one-sided, counts do not fit.
        SizeMismatchError: Paired entries have different item lengths (names layer, role, sizes).
    """

    __slots__ = ()

    @property
    def n_pairs(self) -> int:
        return len(self.emitting)

    def plan(
        self,
        src_pages: npt.NDArray[np.int32] | npt.NDArray[np.int64],
        dst_pages: npt.NDArray[np.int32] | npt.NDArray[np.int64],
        *,
        out: U64Array | None = None,
    ) -> TransferPlan:
        """Plan the blocks that copy page ``src_pages[i]`` to ``dst_pages[i]`` for every pair.

        Args:
            src_pages: 1-D int32 or int64 page indices in the prefill pool (not copied).
            dst_pages: Same length, page indices in the decode pool.
            out: Optional C-contiguous ``(3, M)`` uint64 buffer to reuse; the plan's arrays are
                then 1-D plain ``ndarray`` views of its rows (also for subclasses such as
                ``np.matrix``). It must not overlap the index arrays in memory.

        Raises:
            IndexBoundsError: An index is negative or not below its buffer's capacity.
            KvPlanError: Unequal lengths, ``out`` too small or overlapping an input, overflow.
            TypeError: Not a 1-D C-contiguous, aligned int32/int64 numpy array.
            MemoryError: The plan's output cannot be allocated.
        """
        raw = self._plan(src_pages, dst_pages, out)
        if out is not None:  # the native call wrote into `out` and returned the block count
            n = raw[0]
            if type(out) is not np.ndarray:
                # A subclass may index differently (np.matrix rows stay 2-D): slice a plain
                # ndarray view of the same memory so the columns are 1-D.
                out = out.view(np.ndarray)
            raw = (out[0, :n], out[1, :n], out[2, :n], *raw[3:])
        return _new_tuple(TransferPlan, raw)

    def plan_state(self, src_slot: int, dst_slot: int) -> TransferPlan:
        """One block per paired state entry: ``(src_base + L*src_slot, dst_base + L*dst_slot, L)``.

        Raises:
            IndexBoundsError: A slot is negative or outside a paired state buffer.
        """
        src, dst, lengths = self._plan_state(src_slot, dst_slot)
        n = len(src)
        return _new_tuple(TransferPlan, (src, dst, lengths, 1 if n else 0, int(lengths.sum()), (True,) * n))
