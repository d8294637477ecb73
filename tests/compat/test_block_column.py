"""The Mooncake drop-in's plan columns (``BlockColumn``) cannot lie about truth or equality.

A column is a numpy array that vLLM's caller treats as a ``list[int]``: truthy when non-empty,
``==`` a list compared as a list. Anything *derived* from it (a comparison mask, a reduction,
arithmetic, a concatenation) must be plain numpy, whose truth value is the value's own: a
derived 0-d ``False`` that reads as true sent a batch of mixed lengths with the first length
for every block.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplan.compat.vllm import BlockColumn, _column, _lengths_list


def _mixed(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths, first == last, not all equal."""
    lengths = rng.choice(np.array([576, 1152, 4096], dtype=np.uint64), size=n)
    lengths[0] = lengths[-1] = 576
    lengths[n // 2] = 1152
    return lengths


@pytest.mark.parametrize("n", [2, 63, 64, 65, 1000, 4096])
def test_lengths_list_keeps_every_length(n):
    rng = np.random.default_rng(n)
    plain = _mixed(n, rng)
    for column in (_column([plain]), plain):
        lengths, total = _lengths_list(column)
        assert lengths == plain.tolist()
        assert total == int(plain.sum())


@pytest.mark.parametrize("n", [64, 1000])
def test_lengths_list_repeated_value(n):
    column = _column([np.full(n, 576, dtype=np.uint64)])
    lengths, total = _lengths_list(column)
    assert lengths == [576] * n and total == 576 * n


def test_column_list_semantics():
    column = _column([np.array([1, 2, 3], dtype=np.uint64)])
    assert isinstance(column, BlockColumn)
    assert bool(column) and not bool(_column([]))
    assert column == [1, 2, 3] and not column == [1, 2, 4]
    assert column != [1, 2, 4] and not column != [1, 2, 3]
    assert list(column) == [1, 2, 3] and len(column) == 3 and sum(column) == 6
    assert isinstance(column[1:], BlockColumn) and column[1:] == [2, 3]


def test_a_column_of_another_rank_has_no_truth_value():
    with pytest.raises(TypeError, match="2-d BlockColumn"):
        bool(_column([np.arange(4, dtype=np.uint64)]).reshape(2, 2))


# What kvplan's own code (and a caller) may ask of a column: each answer must be the plain
# array's answer, of a plain type.
_QUESTIONS = {
    "eq_all": lambda c, x: (c == x).all(),
    "ne_any": lambda c, x: (c != x).any(),
    "np_all_eq": lambda c, x: np.all(c == x),
    "np_any_gt": lambda c, x: np.any(c > x),
    "all": lambda c, x: c.all(),
    "any_sub": lambda c, x: (c - x).any(),
    "array_equal": lambda c, x: np.array_equal(c, np.full(len(c), x, dtype=np.uint64)),
    "min_eq": lambda c, x: c.min() == x,
    "max_eq": lambda c, x: c.max() == x,
    "count_nonzero": lambda c, x: np.count_nonzero(c != x) == 0,
    "isin_all": lambda c, x: np.isin(c, [x]).all(),
    "unique_one": lambda c, x: np.unique(c).size == 1,
    "concat_all": lambda c, x: (np.concatenate([c, c]) == x).all(),
    "sum_eq": lambda c, x: c.sum() == x * len(c),
}


@pytest.mark.parametrize("question", sorted(_QUESTIONS))
def test_derived_values_are_plain_and_tell_the_truth(question):
    ask = _QUESTIONS[question]
    rng = np.random.default_rng(20261205)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        if trial % 3 == 0:
            plain = np.full(n, 576, dtype=np.uint64)
        elif trial % 3 == 1:
            plain = _mixed(max(n, 3), rng)
        else:
            plain = rng.integers(0, 3, size=n).astype(np.uint64)
        column = _column([plain])
        x = int(plain[0])
        got, want = ask(column, x), ask(plain, x)
        assert not isinstance(got, BlockColumn), type(got)
        assert bool(got) == bool(want), (question, plain.tolist())
