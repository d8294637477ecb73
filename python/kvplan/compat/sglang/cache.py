"""The template cache: templates per decode peer, stored on the manager instance and rebuilt
when the inputs they were built from change."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class TemplateCache:
    """Templates per decode peer (SGLang's ``mooncake_session_id``), rebuilt when the inputs
    they were built from change (a peer that re-registers gets new templates on first use).

    Keys are ``(session, path)``; each entry keeps the inputs it was built from and is reused
    only when they compare equal. Thread-safe: SGLang runs several transfer workers.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[tuple[Any, ...], Any]] = {}
        self._lock = threading.Lock()

    def get(self, session: str, path: str, inputs: tuple[Any, ...],
            build: Callable[[], Any]) -> Any:
        key = (session, path)
        hit = self._entries.get(key)
        if hit is not None and hit[0] == inputs:
            return hit[1]
        value = build()
        frozen = tuple(list(x) if isinstance(x, list) else x for x in inputs)
        with self._lock:
            self._entries[key] = (frozen, value)
        return value

    def drop(self, session: str) -> None:
        """Forget every template of one decode peer."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == session]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def sessions(self) -> set[str]:
        return {k[0] for k in self._entries}


def template_cache(manager: Any) -> TemplateCache:
    """The manager's :class:`TemplateCache` (created on first use, stored on the instance).

    An object without an instance ``__dict__`` (``__slots__``) gets a fresh, unstored cache, so
    its templates are rebuilt per call: SGLang's methods accept such objects, so kvplan's do.
    """
    attrs = getattr(manager, "__dict__", None)
    if attrs is None:
        return TemplateCache()
    cache = attrs.get("_kvplan_templates")
    if cache is None:  # setdefault: two transfer workers may get here at once
        cache = attrs.setdefault("_kvplan_templates", TemplateCache())
    if not isinstance(cache, TemplateCache):
        raise TypeError(f"_kvplan_templates on {type(manager).__name__} is a "
                        f"{type(cache).__name__}, not kvplan's TemplateCache")
    return cache
