"""SGLang 0.5.23's two planning helpers, ``group_concurrent_contiguous`` and
``build_transfer_entry_pairs``, with SGLang's signatures, results, errors and quirks, computed by
kvplan's core (the package docstring lists the few documented differences)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplan import _core

__all__ = ["build_transfer_entry_pairs", "group_concurrent_contiguous"]


# ---------------------------------------------------------------------------------------------
# group_concurrent_contiguous
# ---------------------------------------------------------------------------------------------


def _core_indices(arr: Any, side: str) -> npt.NDArray[Any]:
    """``arr`` as a 1-D integer ndarray (no copy when it already is one the core takes)."""
    out: npt.NDArray[Any] = np.asarray(arr)
    if out.ndim != 1 or out.dtype.kind not in "iu":
        raise TypeError(
            f"{side}_indices must be a 1-D integer numpy array, got a {out.ndim}-D array of "
            f"dtype {out.dtype}"
        )
    return out


def _for_core(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The array in a form the core accepts without copying: native int32/int64, C-contiguous.

    Other integer dtypes (int8/16, uint*, big-endian) and strided views are converted once.
    """
    if arr.dtype.isnative and arr.dtype in (np.int32, np.int64) and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(arr, dtype=np.int64)


def _core_takes(arr: npt.NDArray[Any]) -> bool:
    """True when the core's exact integer steps are SGLang's wrap-around ``np.diff`` steps.

    In an integer dtype, ``np.diff`` yields 1 for a step that is not +1 only from the dtype's
    largest value to its smallest (``b - a`` wraps to 1 exactly then), so an array that does not
    hold its dtype's maximum has the same run boundaries both ways. Negative values go to
    SGLang's expression as well, because the core refuses them as page indices.
    """
    return not arr.size or int(arr.max()) < min(int(np.iinfo(arr.dtype).max), 2**63 - 1)


def _sglang_run_lengths(src: npt.NDArray[Any], dst: npt.NDArray[Any]) -> list[int]:
    """Run lengths from SGLang's own expression, in each array's dtype (wrap-around included)."""
    brk = np.where((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    lengths: npt.NDArray[np.int64] = np.diff(np.concatenate(([0], brk, [src.size])))
    return [int(n) for n in lengths]


def group_concurrent_contiguous(
    src_indices: npt.NDArray[np.int32], dst_indices: npt.NDArray[np.int32]
) -> tuple[list[list[int]], list[list[int]]]:
    """Split paired page indices into maximal runs contiguous on both sides (SGLang semantics).

    A run continues while both ``src_indices`` and ``dst_indices`` step by exactly +1; any other
    step on either side (gap, repeat, descent) starts a new run. Runs keep input order.

    Args:
        src_indices: 1-D numpy integer array of prefill page indices.
        dst_indices: 1-D numpy integer array of decode page indices, same length.

    Returns:
        ``(src_runs, dst_runs)``: two lists of equal length whose element ``r`` is run ``r`` as
        a Python list of Python ints (the original values). ``([], [])`` when either side is
        empty.

    Raises:
        AttributeError: An argument has no ``.size`` (e.g. a plain list), as in SGLang.
        ValueError: Both sides are non-empty and their sizes differ (SGLang's message).
        TypeError: An argument is not a 1-D integer array (kvplan is stricter than SGLang).
    """
    # SGLang's order of checks, kept exactly: `.size` of src first (a plain list raises
    # AttributeError here), dst's only if src is non-empty, then the length check.
    if src_indices.size == 0 or dst_indices.size == 0:
        return [], []
    if src_indices.size != dst_indices.size:
        raise ValueError(
            "group_concurrent_contiguous requires equal-length src/dst index arrays, "
            f"got {src_indices.size} and {dst_indices.size}"
        )
    src = _core_indices(src_indices, "src")
    dst = _core_indices(dst_indices, "dst")
    lengths: Any
    if _core_takes(src) and _core_takes(dst):
        try:
            _, _, lengths = _core.group_contiguous(_for_core(src), _for_core(dst))
        except _core.KvPlanError:
            # Negative indices: the core refuses them as pages; SGLang just groups them.
            lengths = _sglang_run_lengths(src, dst)
    else:
        lengths = _sglang_run_lengths(src, dst)
    # Slice the original values (one .tolist() per side) so every element is the caller's own
    # value as a Python int, whatever the dtype.
    ends = np.cumsum(lengths).tolist()
    starts = [0, *ends[:-1]]
    src_list = src.tolist()
    dst_list = dst.tolist()
    return (
        [src_list[a:b] for a, b in zip(starts, ends)],
        [dst_list[a:b] for a, b in zip(starts, ends)],
    )


# ---------------------------------------------------------------------------------------------
# build_transfer_entry_pairs
# ---------------------------------------------------------------------------------------------


def _dense_codes(
    src_ids: Sequence[Hashable], dst_ids: Sequence[Hashable]
) -> tuple[list[int], list[int]]:
    """Renumber arbitrary hashable ids to small ints with Python's own equality.

    SGLang keys a dict by the ids, so anything hashable works and ``3 == 3.0 == True``; the core
    takes 64-bit ints. Mapping through one dict keeps SGLang's notion of "same id" exactly, and
    the order keeps its errors: every decode id is hashed first (SGLang builds its dict from
    them), then the prefill ids in order, where a missing id is reported before a later
    unhashable one.
    """
    codes: dict[Hashable, int] = {}
    dst = [codes.setdefault(x, len(codes)) for x in dst_ids]
    src = []
    for k, x in enumerate(src_ids):
        try:
            src.append(codes.setdefault(x, len(codes)))
        except TypeError:
            missing = _first_missing(src_ids[:k], dst_ids)
            if missing is not _NONE_MISSING:
                raise _missing_error(missing) from None
            raise
    return src, dst


_NONE_MISSING = object()


def _first_missing(src_ids: Sequence[Hashable], dst_ids: Sequence[Hashable]) -> Any:
    """The first source id whose occurrence has no decode counterpart, else ``_NONE_MISSING``."""
    remaining = Counter(dst_ids)
    for lid in src_ids:
        if remaining[lid] <= 0:
            return lid
        remaining[lid] -= 1
    return _NONE_MISSING


def _missing_error(lid: Any) -> RuntimeError:
    return RuntimeError(f"Decode peer is missing a transfer entry for model layer {lid}")


def build_transfer_entry_pairs(
    src_layer_ids: list[int],
    dst_layer_ids: list[int],
    n_src: int,
    n_dst: int,
    allow_positional_fallback: bool = False,
) -> list[tuple[int, int]]:
    """Pair prefill transfer entries with decode entries by global layer id (SGLang semantics).

    Source entry ``i`` with id ``x`` pairs with the first unused decode entry carrying ``x``
    (repeated ids pair occurrence by occurrence); extra decode entries stay unpaired. Without
    ids on both sides pairing is positional, and only allowed for equal counts unless
    ``allow_positional_fallback`` (SGLang passes ``pp_size == 1``), which also turns one-sided
    ids into positional pairing.

    Args:
        src_layer_ids: Prefill ids, one per entry; empty or ``None`` means "not published".
        dst_layer_ids: Decode ids, one per entry; empty or ``None`` means "not published".
        n_src: Prefill entry count.
        n_dst: Decode entry count.
        allow_positional_fallback: Permit positional pairing when ids are missing.

    Returns:
        One ``(src_entry_index, dst_entry_index)`` tuple of Python ints per source entry, in
        source order (``[]`` when ``n_src == 0``).

    Raises:
        RuntimeError: With SGLang's exact messages: ids on one side only; an id list's length
            differs from its entry count; a source id (occurrence) missing on decode; positional
            pairing with counts that do not fit.
    """
    if n_src == 0:
        return []
    # SGLang tests truthiness: None and [] both mean "not published", and a numpy array raises
    # here exactly as it does there. Evaluated once, in SGLang's order.
    src_has, dst_has = bool(src_layer_ids), bool(dst_layer_ids)
    if src_has != dst_has:
        if not allow_positional_fallback:
            raise RuntimeError("Layer metadata must be provided by both PD peers or neither")
        src_has = dst_has = False
    if src_has:
        if len(src_layer_ids) != n_src or len(dst_layer_ids) != n_dst:
            raise RuntimeError(
                "Layer metadata length must match transfer entries: "
                f"src metadata={len(src_layer_ids)} entries={n_src}, "
                f"dst metadata={len(dst_layer_ids)} entries={n_dst}"
            )
        # The counts only had to compare equal to the lengths (SGLang never uses them past
        # that check, so 3.0 works there); the core takes the lengths themselves.
        n_src_ids, n_dst_ids = len(src_layer_ids), len(dst_layer_ids)
        try:
            try:
                pairs = _core.pair_entries(src_layer_ids, dst_layer_ids, n_src_ids, n_dst_ids,
                                           False)
            except (TypeError, OverflowError):
                # Non-int or out-of-i64 ids (SGLang accepts any hashable): renumber and retry.
                src_codes, dst_codes = _dense_codes(src_layer_ids, dst_layer_ids)
                pairs = _core.pair_entries(src_codes, dst_codes, n_src_ids, n_dst_ids, False)
        except _core.PairingError:
            # The only failure left in this branch is a source id (occurrence) decode lacks.
            # SGLang's message names it exactly as the caller spelled it; kvplan's adds detail.
            raise _missing_error(_first_missing(src_layer_ids, dst_layer_ids)) from None
    else:
        if n_dst < n_src or (n_src != n_dst and not allow_positional_fallback):
            raise RuntimeError(
                "PP-heterogeneous transfer requires layer ids on "
                f"both peers; got src={n_src} dst={n_dst} entries"
            )
        # SGLang returns [(i, i) for i in range(n_src)]: range's own TypeError for a float
        # count, nothing for a negative one, any __index__ object accepted.
        count = len(range(n_src))
        if count == 0:
            return []
        pairs = _core.pair_entries(None, None, count, count, True)
    return [(i, j) for i, j in pairs.tolist()]
