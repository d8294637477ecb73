"""Templates and plans: the typed layer over the native planner."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvplan import _core

__all__ = ["PlanBatch", "Template", "TransferPlan"]

U64Array = npt.NDArray[np.uint64]


class PlanBatch(NamedTuple):
    """A slice of a plan's blocks (views, no copy), sized for one engine submission."""

    src_addrs: U64Array
    dst_addrs: U64Array
    lengths: U64Array

    def as_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The three columns as Python lists, the argument type engines convert fastest."""
        return self.src_addrs.tolist(), self.dst_addrs.tolist(), self.lengths.tolist()


class TransferPlan:
    """The `(src_addr, dst_addr, length)` blocks of one request, entry-pair major, run minor.

    The three uint64 arrays view one Rust buffer without a copy; it returns to kvplan's pool
    when the last of them dies, so they stay valid after the plan object is gone.
    """

    __slots__ = ("_emitting", "dst_addrs", "lengths", "n_runs", "src_addrs", "total_bytes")

    def __init__(
        self,
        src_addrs: U64Array,
        dst_addrs: U64Array,
        lengths: U64Array,
        n_runs: int,
        total_bytes: int,
        emitting: tuple[bool, ...],
    ) -> None:
        self.src_addrs = src_addrs
        self.dst_addrs = dst_addrs
        self.lengths = lengths
        self.n_runs = n_runs
        self.total_bytes = total_bytes
        self._emitting = emitting

    @property
    def n_blocks(self) -> int:
        return len(self.src_addrs)

    @property
    def n_pairs(self) -> int:
        """Entry pairs of the template (including elided pairs that emit nothing)."""
        return len(self._emitting)

    def __len__(self) -> int:
        return len(self.src_addrs)

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

    __slots__ = ("_emitting_cache",)

    def __init__(self, *args: object, **kwargs: object) -> None:
        # The native __new__ has validated everything; cache what every plan needs.
        self._emitting_cache: tuple[bool, ...] = tuple(self.emitting)

    @property
    def n_pairs(self) -> int:
        return len(self._emitting_cache)

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
                then views of its rows.

        Raises:
            IndexBoundsError: An index is negative or not below its buffer's capacity.
            KvPlanError: Unequal lengths, ``out`` too small, overflow.
            TypeError: Not a 1-D C-contiguous int32/int64 numpy array.
        """
        columns, n_runs, n_blocks, total_bytes = self._plan(src_pages, dst_pages, out)
        if columns is None:
            assert out is not None
            columns = (out[0, :n_blocks], out[1, :n_blocks], out[2, :n_blocks])
        return TransferPlan(*columns, n_runs, total_bytes, self._emitting_cache)

    def plan_state(self, src_slot: int, dst_slot: int) -> TransferPlan:
        """One block per paired state entry: ``(src_base + L*src_slot, dst_base + L*dst_slot, L)``.

        Raises:
            IndexBoundsError: A slot is negative or outside a paired state buffer.
        """
        src, dst, lengths = self._plan_state(src_slot, dst_slot)
        n = len(src)
        return TransferPlan(src, dst, lengths, 1 if n else 0, int(lengths.sum()), (True,) * n)
