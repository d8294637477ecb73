"""Wrapping a method of an SGLang class with kvplan's code and taking the wrapper off again.

Each wrapper carries its marker attribute (``_kvplan_start_up``, ``_kvplan_manifest``,
``_kvplan_identity``) set to True and, as ``_kvplan_had``, what the class itself held under the
name before (None: the method was inherited). Wrappers stack: a later one wraps an earlier one,
and :func:`unwrap` takes one off only while it is the outermost (an install takes its wrappers
off in the reverse order it put them on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["is_wrapped", "unwrap", "wrap"]

_HAD = "_kvplan_had"


def is_wrapped(method: Any, marker: str) -> bool:
    """Whether ``method`` or a wrapper under it (down the ``_kvplan_had`` chain) carries
    ``marker``."""
    while method is not None:
        if getattr(method, marker, False):
            return True
        method = getattr(method, _HAD, None)
    return False


def wrap(cls: type, name: str, marker: str, make: Callable[[Any], Callable[..., Any]]) -> bool:
    """Set ``cls.<name>`` to ``make(current method)``, marked with ``marker``; False (nothing
    changed) when ``cls`` has no such method or a wrapper with ``marker`` is already on it."""
    current = cls.__dict__.get(name)
    if is_wrapped(current, marker):
        return False
    original = getattr(cls, name, None)
    if original is None:
        return False
    wrapper = make(original)
    setattr(wrapper, marker, True)
    setattr(wrapper, _HAD, current)
    wrapper.__name__ = wrapper.__qualname__ = name
    setattr(cls, name, wrapper)
    return True


def unwrap(cls: type, name: str, marker: str) -> None:
    """Restore what :func:`wrap` with ``marker`` replaced, when that wrapper is the outermost."""
    current = cls.__dict__.get(name)
    if current is None or not getattr(current, marker, False):
        return
    had = getattr(current, _HAD)
    if had is None:
        delattr(cls, name)
    else:
        setattr(cls, name, had)
