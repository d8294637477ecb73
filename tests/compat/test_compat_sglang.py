"""kvplan.compat.sglang against docs/semantics.md (Runs, Entry pairing, Errors) and its worked
examples W-runs-basic … W-positional.

Expected values and error texts are copied from docs/semantics.md (SGLang 0.5.23's results),
never produced by running kvplan. Besides values, the drop-in must match SGLang's *types*:
Python lists of Python ints, a list of tuples, and SGLang's exception classes and messages.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvplan.compat import sglang as sg
from kvplan.compat.sglang import build_transfer_entry_pairs as pairs
from kvplan.compat.sglang import group_concurrent_contiguous as gcc


def a(*xs: int, dtype=np.int32) -> np.ndarray:
    """docs/semantics.md's a(...): an int32 numpy array."""
    return np.array(xs, dtype=dtype)


def assert_plain_runs(result) -> None:
    """SGLang's return type: a 2-tuple of lists of lists of Python ints (not numpy)."""
    assert isinstance(result, tuple) and len(result) == 2
    src_runs, dst_runs = result
    assert type(src_runs) is list and type(dst_runs) is list
    assert len(src_runs) == len(dst_runs)
    for s, d in zip(src_runs, dst_runs):
        assert type(s) is list and type(d) is list and len(s) == len(d)
        assert all(type(x) is int for x in s + d)


def assert_plain_pairs(result) -> None:
    assert type(result) is list
    for p in result:
        assert type(p) is tuple and len(p) == 2 and all(type(x) is int for x in p)


# ---------------------------------------------------------------- group_concurrent_contiguous


def test_w_runs_basic():
    out = gcc(a(0, 1, 2, 5, 6, 9), a(10, 11, 12, 13, 14, 20))
    assert_plain_runs(out)
    assert out == ([[0, 1, 2], [5, 6], [9]], [[10, 11, 12], [13, 14], [20]])


def test_w_runs_break_duplicates():
    out = gcc(a(3, 3, 4), a(7, 8, 9))
    assert_plain_runs(out)
    assert out == ([[3], [3, 4]], [[7], [8, 9]])


def test_w_runs_break_descents():
    assert gcc(a(5, 4, 3), a(1, 2, 3)) == ([[5], [4], [3]], [[1], [2], [3]])


def test_w_runs_empty_both():
    out = gcc(a(), a())
    assert out == ([], []) and type(out[0]) is list and type(out[1]) is list


def test_w_runs_empty_one_side_is_no_runs():
    # SGLang 0.5.23 guards both sides (kvplan.group_contiguous itself raises here).
    assert gcc(a(1, 2), a()) == ([], [])
    assert gcc(a(), a(1, 2)) == ([], [])


def test_w_runs_empty_unequal_lengths_value_error_exact_message():
    with pytest.raises(ValueError) as err:
        gcc(a(1, 2, 3), a(4, 5))
    assert type(err.value) is ValueError  # SGLang's class, not a KvPlanError subclass
    assert str(err.value) == (
        "group_concurrent_contiguous requires equal-length src/dst index arrays, got 3 and 2"
    )


def test_plain_lists_raise_attribute_error():
    # SGLang reads .size, so plain Python lists raise AttributeError (docs/semantics.md, Runs).
    with pytest.raises(AttributeError):
        gcc([0, 1, 2], [5, 6, 7])
    with pytest.raises(AttributeError):
        gcc(a(0, 1), [5, 6])


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.dtype(">i4"), np.dtype(">i8")])
def test_any_integer_dtype(dtype):
    # SGLang takes two 1-D numpy arrays of any integer dtype: W-runs-basic in every one.
    out = gcc(a(0, 1, 2, 5, 6, 9, dtype=dtype), a(10, 11, 12, 13, 14, 20, dtype=dtype))
    assert_plain_runs(out)
    assert out == ([[0, 1, 2], [5, 6], [9]], [[10, 11, 12], [13, 14], [20]])


def test_strided_views():
    src = a(0, 99, 1, 99, 2, 99, 5, 99, dtype=np.int64)[::2]
    dst = a(10, 0, 11, 0, 12, 0, 13, 0, dtype=np.int64)[::2]
    assert gcc(src, dst) == ([[0, 1, 2], [5]], [[10, 11, 12], [13]])


def test_negative_values_grouped_like_sglang():
    # SGLang never rejects values; runs depend only on the +1 steps.
    assert gcc(a(-2, -1, 0, 4), a(7, 8, 9, 10)) == ([[-2, -1, 0], [4]], [[7, 8, 9], [10]])


def test_uint64_above_int64_range():
    top = 2**64 - 3
    src = np.array([top, top + 1, top + 2], dtype=np.uint64)
    dst = np.array([0, 1, 3], dtype=np.uint64)
    out = gcc(src, dst)
    assert_plain_runs(out)
    assert out == ([[top, top + 1], [top + 2]], [[0, 1], [3]])


def test_single_element():
    assert gcc(a(7), a(3)) == ([[7]], [[3]])


def test_fully_fragmented():
    src = np.arange(0, 2000, 2, dtype=np.int32)
    dst = np.arange(1000, dtype=np.int32)
    s, d = gcc(src, dst)
    assert s == [[x] for x in range(0, 2000, 2)]
    assert d == [[x] for x in range(1000)]


def test_non_integer_arrays_rejected():
    # Deliberate difference (documented): SGLang would group floats by float differences.
    with pytest.raises(TypeError):
        gcc(np.array([0.0, 1.0]), np.array([2.0, 3.0]))
    with pytest.raises(TypeError):
        gcc(np.zeros((2, 2), dtype=np.int32), np.zeros((2, 2), dtype=np.int32))


# ---------------------------------------------------------------- build_transfer_entry_pairs


def test_w_kv_fifo_pairing():
    out = pairs([3, 7, 3, 7], [3, 7, 11, 3, 7, 11], 4, 6)
    assert_plain_pairs(out)
    assert out == [(0, 0), (1, 1), (2, 3), (3, 4)]


def test_w_unique_draft_ids_pp_stages():
    dst = [0, 1, 2, 3, 4, 5, 1000000]
    assert pairs([0, 1, 2, 3], dst, 4, 7) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert pairs([4, 5, 1000000], dst, 3, 7) == [(0, 4), (1, 5), (2, 6)]


def test_w_positional():
    out = pairs([], [], 3, 5, True)
    assert_plain_pairs(out)
    assert out == [(0, 0), (1, 1), (2, 2)]
    assert pairs([1], [], 1, 3, True) == [(0, 0)]  # one-sided ids + fallback: positional
    assert pairs([9], [], 0, 0) == []  # n_src == 0 first: no other check


def test_w_positional_none_means_not_published():
    assert pairs(None, None, 2, 2) == [(0, 0), (1, 1)]
    assert pairs(None, [4], 1, 1, True) == [(0, 0)]


def _raises_runtime(message: str, *args) -> None:
    with pytest.raises(RuntimeError) as err:
        pairs(*args)
    assert type(err.value) is RuntimeError
    assert str(err.value) == message


def test_w_positional_one_sided_metadata():
    _raises_runtime("Layer metadata must be provided by both PD peers or neither", [1], [], 1, 1)
    _raises_runtime("Layer metadata must be provided by both PD peers or neither",
                    None, [1, 2], 2, 2)


def test_w_positional_metadata_length():
    _raises_runtime(
        "Layer metadata length must match transfer entries: "
        "src metadata=2 entries=3, dst metadata=3 entries=3",
        [1, 2], [1, 2, 3], 3, 3)


def test_w_positional_missing_layer():
    _raises_runtime("Decode peer is missing a transfer entry for model layer 9",
                    [1, 9], [1, 2, 3], 2, 3)


def test_w_positional_missing_occurrence():
    _raises_runtime("Decode peer is missing a transfer entry for model layer 3",
                    [3, 3, 3], [3, 3], 3, 2)


def test_w_positional_pp_heterogeneous():
    _raises_runtime(
        "PP-heterogeneous transfer requires layer ids on both peers; got src=3 dst=5 entries",
        [], [], 3, 5)
    _raises_runtime(
        "PP-heterogeneous transfer requires layer ids on both peers; got src=5 dst=3 entries",
        [], [], 5, 3, True)


def test_fallback_has_no_effect_when_both_publish_ids():
    # With ids on both sides, allow_positional_fallback has no effect (docs/semantics.md,
    # Entry pairing).
    _raises_runtime("Decode peer is missing a transfer entry for model layer 9",
                    [9], [1, 2], 1, 2, True)
    assert pairs([2], [1, 2], 1, 2, True) == [(0, 1)]


def test_w_mha_hybrid_stage1_ids():
    # W-mha-hybrid-stage1's pairing: src [7,11,7,11] onto dst [3,7,11,3,7,11].
    assert pairs([7, 11, 7, 11], [3, 7, 11, 3, 7, 11], 4, 6) == [(0, 1), (1, 2), (2, 4), (3, 5)]


def test_draft_band_pairs_across_pipeline_stages():
    # W-draft-band-pp (SGLang's TestDraftBandPairsAcrossPipelineStages).
    stage = [31, 35, 39, 43, 47, 51, 55, 59]
    full = list(range(3, 60, 4))
    out = pairs(stage * 2 + [60, 60], full * 2 + [60, 60], 18, 32)
    expected = ([(i, 7 + i) for i in range(8)] + [(8 + i, 22 + i) for i in range(8)]
                + [(16, 30), (17, 31)])
    assert out == expected


def test_ids_are_any_hashable_like_sglang():
    # SGLang keys a dict by the ids: equal-and-same-hash values are the same layer.
    assert pairs([3.0, "x"], ["x", 3], 2, 2) == [(0, 1), (1, 0)]
    big = 2**70
    assert pairs([big], [1, big], 1, 2) == [(0, 1)]
    assert pairs((np.int64(5),), [5], 1, 1) == [(0, 0)]


def test_missing_layer_message_spells_the_callers_id():
    _raises_runtime("Decode peer is missing a transfer entry for model layer draft",
                    ["draft"], ["kv"], 1, 1)


def test_numpy_id_arrays_fail_truthiness_like_sglang():
    # SGLang tests ids with bool(); a numpy array of several ids raises ValueError there.
    with pytest.raises(ValueError, match=re.escape("truth value of an array")):
        pairs(np.array([1, 2]), [1, 2], 2, 2)


def test_module_exports():
    assert sg.__all__ == [
        "DEFAULT_MAX_BLOCKS_PER_BATCH", "REFUSED_STATUS", "REPLACED_METHODS", "TemplateCache",
        "build_transfer_entry_pairs", "group_concurrent_contiguous", "install", "installed",
        "layout_from_kv_args", "layout_from_register_info", "send_kvcache_batch",
        "staged_template", "template_cache", "uninstall",
    ]


def test_signatures_match_sglang():
    import inspect

    # SGLang's parameter names and the one default, so keyword call sites keep working.
    g = inspect.signature(gcc)
    assert list(g.parameters) == ["src_indices", "dst_indices"]
    p = inspect.signature(pairs)
    assert list(p.parameters) == [
        "src_layer_ids", "dst_layer_ids", "n_src", "n_dst", "allow_positional_fallback"]
    assert p.parameters["allow_positional_fallback"].default is False
    assert pairs(src_layer_ids=[], dst_layer_ids=[], n_src=2, n_dst=3,
                 allow_positional_fallback=True) == [(0, 0), (1, 1)]
    assert gcc(src_indices=a(1, 2), dst_indices=a(5, 6)) == ([[1, 2]], [[5, 6]])
