"""SGLang 0.5.23 integration: its two planning helpers, and its KV managers' planning methods.

**Managers.** ``install(MooncakeKVManager)`` (and/or ``install(AscendKVManager)``) at start-up
replaces these methods on the class, with SGLang 0.5.23's exact signatures and return values;
``uninstall(cls)`` restores exactly what was there (docs/sglang.md has the full account):

* ``_send_kvcache_generic`` for the KV pool (``state_type`` None): a ``kvplan.Template`` per
  decode peer (cached by ``mooncake_session_id``, rebuilt when the peer's registration changes)
  plans the request in one call; blocks go to ``self.engine.batch_transfer_sync`` in batches of
  at most ``max_blocks_per_batch`` (default 1,024), or one executor task per entry pair on the
  custom-memory-pool path. The first non-zero engine status is returned, as SGLang returns its
  one call's status. Page-indexed state components (``state_type`` SWA, DSA, ...), HiSparse
  device destinations (``dst_device_data_indices``), calls with ``dst_item_lens`` (SGLang's
  stride check and ``conclude_failure``) and compressed-MLA pools (``mla_compression_ratios``)
  are handed to SGLang's own method unchanged.
* ``send_kvcache``: SGLang's envelope check (``_validate_envelope_kv_layout``), then the above;
  HiSparse device destinations go to SGLang's own method.
* ``AscendKVManager.send_kvcache``: SGLang's dispatch kept: hybrid-linear MLA with PP > 1 pairs
  by layer id; otherwise PP > 1 slices positionally (NPU buffer groups per group, MHA K/V), and
  PP 1 pairs entry ``i`` with decode entry ``i``. HiSparse raises ``NotImplementedError`` as SGLang.
* ``_send_mamba_state``: state entries paired by layer id (positional fallback at PP 1), one
  block per pair from ``Template.plan_state``; SGLang's slot-size check kept.
* ``MooncakeKVManager.send_kvcache_slice`` (prefill and decode attention TP sizes differ, MHA):
  a head-sliced ``kvplan.Template`` (NHD items; total KV heads, heads per rank, head bytes,
  page size and both TP sizes and ranks as SGLang derives them) per decode peer, one block per
  token slot and entry pair with runs merged, submitted as above; SGLang's two ``-1`` statuses
  are kept. A prefill rank holding replicated heads is planned as kvplan's elected replica
  for that decode rank (same heads, same offsets), so every rank SGLang's decode asks sends.

Everything else (``send_kvcache_dcp``, ``send_kvcache_staged``, ``_send_mamba_state_slice``,
engine, sessions, bootstrap, state and aux sends, failure handling) stays SGLang's.

SGLang's seams are kept: each drop-in calls what SGLang's method calls on ``self`` at that
point (``_transfer_data`` with SGLang's block lists whenever it is not SGLang's own,
``_send_kvcache_generic`` with SGLang's keyword arguments, ``_await_transfer_futures``, a
replaced pointer-slicing helper through SGLang's own method) and reads only the attributes
SGLang's method reads there, so subclasses, wrappers and stand-in objects work as with SGLang.
The bounded engine batches above are the path taken when ``_transfer_data`` is SGLang's own.

Differences from SGLang's methods, each where SGLang moves wrong bytes, drops bytes, or fails
without naming the cause (the typed errors derive from ``kvplan.KvPlanError``, a ``ValueError``):

* Page index arrays of different lengths: SGLang sends nothing and returns 0 when exactly one
  side is empty (and raises ``ValueError`` otherwise); kvplan raises ``KvPlanError``. A negative
  prefill page, or one past the prefill buffer (``kv_data_lens``), is ``IndexBoundsError``
  (SGLang reads outside the buffer). The decode publishes no buffer lengths, so decode pages
  are bounded only by the address space.
* Decode item sizes: SGLang addresses the decode with the prefill's item length. When the
  decode's registration (``decode_kv_args_table[session].dst_kv_item_lens``) covers the entries,
  kvplan checks every pair and raises ``SizeMismatchError``; the Mamba slot check raises
  ``SizeMismatchError`` with SGLang's message instead of ``RuntimeError``.
* Pairing failures SGLang reports as ``RuntimeError`` (missing layer, one-sided ids, counts that
  do not fit) are ``PairingError``; an out-of-range positional slice, which SGLang turns into an
  ``IndexError`` or, with draft entries, into target layers written to the draft entry, is
  ``PairingError``.
* MHA peers without layer ids at PP > 1: SGLang guesses where the decode's V block starts from
  the entry counts (wrong for uneven splits and for a prefill stage with draft K/V, silently).
  kvplan needs the decode's KV layer count (``install(..., decode_kv_layers=N)`` or the instance
  attribute ``kvplan_decode_kv_layers``) and then slices correctly; without it, any stage whose
  entry count differs from the decode's raises ``PairingError``.
* NPU buffer groups: buffer counts that are not a whole multiple of ``kv_buf_groups`` raise
  ``LayoutError`` (SGLang divides with ``//`` and then fails with ``IndexError`` or ignores the
  extra buffer); a decode whose buffer count is not ``groups * (hidden_kv_layers +
  draft_kv_layers)`` raises ``LayoutError`` (SGLang's per-group offsets would be wrong).
* ``send_kvcache_slice``: a prefill rank that holds none of the decode rank's heads is a
  ``PairingError`` (SGLang writes its heads into the slots of other heads); a prefill item
  that is not ``page_size * heads_per_rank * head_bytes`` (SGLang's head size, from the
  decode's item), a decode item not divisible that way, or head and TP counts of which
  neither divides the other, are ``SizeMismatchError`` / ``LayoutError`` (SGLang truncates and
  reads or writes at wrong offsets); page lists of different lengths are ``KvPlanError`` and
  prefill pages past the buffer ``IndexBoundsError``, as for ``send_kvcache``.
* Engine calls: at most ``max_blocks_per_batch`` blocks per call (SGLang: one call per request,
  or per ``max_transfer_batch_indices`` pages); runs are maximal, so the block list may differ
  from SGLang's by merging, never in the bytes moved.

**Helpers.** Switch an engine by changing one import::

    # from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
    # from sglang.srt.disaggregation.utils import build_transfer_entry_pairs
    from kvplan.compat.sglang import build_transfer_entry_pairs, group_concurrent_contiguous

Both functions keep SGLang's signatures, return types (Python lists of Python ints; a list of
``(int, int)`` tuples), error types and messages, including SGLang's quirks that callers may
rely on: either side empty means "no runs", plain lists raise ``AttributeError``, layer ids are
tested for truthiness, extra decode entries are left unpaired, counts are compared with ``==``
(so ``3.0`` works wherever SGLang's code only compares it, and raises SGLang's ``TypeError``
where SGLang's ``range(n_src)`` does).

For every input not listed below, results and errors are identical to SGLang 0.5.23's. Run
boundaries are SGLang's ``np.diff(x) != 1`` in each array's own dtype, wrap-around included:
int32 ``[2**31-1, -2**31]`` and uint32 ``[2**32-1, 0]`` are one run, as numpy computes
``-2**31 - (2**31-1)`` and ``0 - (2**32-1)`` as 1 in those dtypes. The Rust core groups arrays
whose values are non-negative and below their dtype's maximum (where exact and wrap-around
differences agree); any other array is grouped with SGLang's own numpy expression.

The differences, all for inputs SGLang only handles by accident:

* ``group_concurrent_contiguous`` with an array that is not 1-D or whose dtype is not an integer
  dtype raises ``TypeError`` (kvplan's message) once both sides are non-empty and of equal size.
  SGLang instead groups float and object arrays by their differences (a run continues where
  the step is exactly 1), raises numpy's ``TypeError`` for bool arrays and numpy's
  ``ValueError`` for 0-d arrays, and for 2-D arrays returns rows split at positions computed
  from the last axis.
* ``group_concurrent_contiguous`` reads ndarray subclasses (e.g. ``np.ma.MaskedArray``) as plain
  arrays (``np.asarray``): a mask is ignored, and runs hold the underlying values. SGLang's
  result then follows the subclass's own ``np.diff`` and ``tolist`` (``None`` for masked values).
* ``build_transfer_entry_pairs`` compares layer ids that are ints (or have ``__index__``, like
  numpy integers) by integer value in the core; SGLang compares them through a dict. The two
  differ only for int subclasses that override ``__eq__`` or ``__hash__``. Other ids (floats,
  strings, tuples, ...) go through a dict here too, in SGLang's order.
* ``build_transfer_entry_pairs`` with counts too large to materialise: SGLang fails while
  building the list (``MemoryError``); kvplan fails before (``OverflowError`` past ``2**63``
  pairs, else ``MemoryError``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplan import _core
from kvplan.compat._sglang_manager import (
    DEFAULT_MAX_BLOCKS_PER_BATCH,
    REPLACED_METHODS,
    TemplateCache,
    install,
    installed,
    layout_from_kv_args,
    layout_from_register_info,
    template_cache,
    uninstall,
)

__all__ = [
    "DEFAULT_MAX_BLOCKS_PER_BATCH",
    "REPLACED_METHODS",
    "TemplateCache",
    "build_transfer_entry_pairs",
    "group_concurrent_contiguous",
    "install",
    "installed",
    "layout_from_kv_args",
    "layout_from_register_info",
    "template_cache",
    "uninstall",
]


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
