"""Replacing methods on an engine's class and restoring exactly what was there.

The vLLM, vllm-ascend and SGLang integrations share this: ``install`` swaps functions into a class's
``__dict__`` and remembers what the class itself held (or that it held nothing and inherited
the method), ``uninstall`` puts that back, so a subclass patched and restored is byte for byte
the class it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_MISSING = object()


class MethodPatches:
    """The methods one integration replaces, and what each patched class held before."""

    def __init__(self, replacements: Mapping[str, Any]) -> None:
        self.replacements = dict(replacements)
        self._saved: dict[tuple[type, str], Any] = {}

    def install(self, cls: type) -> tuple[str, ...]:
        """Replace the methods on ``cls``; returns the names replaced (none when installed)."""
        replaced = []
        for name, function in self.replacements.items():
            key = (cls, name)
            if key in self._saved:
                continue
            self._saved[key] = cls.__dict__.get(name, _MISSING)
            setattr(cls, name, function)
            replaced.append(name)
        return tuple(replaced)

    def uninstall(self, cls: type) -> tuple[str, ...]:
        """Restore exactly what :meth:`install` replaced on ``cls``; returns the names."""
        restored = []
        for klass, name in list(self._saved):
            if klass is not cls:
                continue
            saved = self._saved.pop((klass, name))
            if saved is _MISSING:
                delattr(klass, name)
            else:
                setattr(klass, name, saved)
            restored.append(name)
        return tuple(restored)

    def replaced(self, cls: type, name: str) -> Any:
        """What ``cls`` itself held under ``name`` before :meth:`install` replaced it; ``None``
        when it held nothing (it inherited the method) or was not patched."""
        saved = self._saved.get((cls, name))
        return None if saved is _MISSING else saved

    def installed(self, cls: type) -> tuple[str, ...]:
        return tuple(name for klass, name in self._saved if klass is cls)
