"""The plan's three columns as vLLM's caller reads them: :class:`BlockColumn`.

``_build_transfer_params`` returns uint64 arrays where vLLM's returns ``list[int]``; a column
answers truth and ``==`` as that list does, and every numpy operation on it answers with plain
numpy values.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class BlockColumn(np.ndarray):
    """A uint64 column of the plan, compared and tested for truth as vLLM's ``list[int]`` is.

    Truthy when non-empty (vLLM's caller tests ``if src_ptrs:``); ``==`` / ``!=`` with a list
    or tuple is one plain bool with list semantics (a numpy array would compare elementwise
    and be truthy whenever it is non-empty, so ``assert src_ptrs == [...]`` would pass on a
    wrong answer); with anything else it is numpy's comparison. Iterating, ``len`` and
    ``sum()`` work as on a list.

    Only a one-dimensional column has the list truth value. Every numpy operation on a column
    (comparisons, reductions such as ``.all()``, arithmetic, ``np.concatenate``) answers with
    plain numpy values, never another ``BlockColumn``: a derived array or 0-d result keeps
    numpy's own truth value (a 0-d ``False`` is false; a many-element mask refuses ``bool``),
    so ``bool((column == x).all())`` means what it says."""

    __hash__ = None

    def __bool__(self) -> bool:
        if self.ndim != 1:
            raise TypeError(f"the truth value of a {self.ndim}-d BlockColumn is not defined "
                            "(only a 1-d column is a list)")
        return self.size > 0

    def __eq__(self, other: object) -> Any:
        if isinstance(other, (list, tuple)):
            return self.tolist() == other
        return self.view(np.ndarray) == _plain(other)

    def __ne__(self, other: object) -> Any:
        if isinstance(other, (list, tuple)):
            return self.tolist() != other
        return self.view(np.ndarray) != _plain(other)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any,
                        **kwargs: Any) -> Any:
        # Computed on plain arrays, so no result (elementwise, reduced or 0-d) is a column.
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(_plain(o) for o in outs)
        return getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return func(*_plain_args(args), **{k: _plain_args(v) if isinstance(v, (list, tuple))
                                           else _plain(v) for k, v in kwargs.items()})


def _plain(value: Any) -> Any:
    """``value`` with a :class:`BlockColumn` seen as the plain ndarray it views."""
    return value.view(np.ndarray) if isinstance(value, BlockColumn) else value


def _plain_args(values: Any) -> Any:
    """Positional numpy-function arguments with every column, also inside a list or tuple of
    arrays (``np.concatenate([a, b])``), seen as plain arrays."""
    return type(values)(_plain_args(v) if isinstance(v, (list, tuple)) else _plain(v)
                        for v in values)


_EMPTY = np.empty(0, dtype=np.uint64)


def _column(parts: list[np.ndarray]) -> BlockColumn:
    if not parts:
        arr = _EMPTY
    elif len(parts) == 1:
        arr = parts[0]
    else:
        arr = np.concatenate(parts)
    return arr.view(BlockColumn)
