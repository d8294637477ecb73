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

    def original(self, cls: type, name: str) -> Any:
        """What ``cls.name`` resolves to without this integration's replacements (down the
        MRO, a patched class's saved method stands for it); ``None`` when nothing does."""
        mine = self.replacements.get(name)
        for klass in cls.__mro__:
            candidate = klass.__dict__.get(name)
            if candidate is not None and candidate is mine:
                candidate = self.replaced(klass, name)
            if candidate is not None:
                return candidate
        return None


# ---------------------------------------------------------------------------------------------
# What a drop-in requires of the host's methods before it replaces any
# ---------------------------------------------------------------------------------------------
def signature_text(function: Any) -> str:
    """``function``'s parameters as written (names, kinds, defaults; no annotations), with
    ``async`` in front of a coroutine function: the form two releases share or do not."""
    import inspect

    try:
        sig = inspect.signature(function)
    except (TypeError, ValueError):
        return f"<{type(function).__name__} without a signature>"
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    return ("async " if inspect.iscoroutinefunction(function) else "") + text


def host_version(module_name: str) -> str:
    """The version of the distribution whose top-level package holds ``module_name``: its
    ``<package>._version.__version__``, else the installed distribution's metadata, else
    ``"unknown"``."""
    import importlib
    import importlib.metadata
    import sys

    top = module_name.split(".", 1)[0]
    try:
        module = sys.modules.get(f"{top}._version") or importlib.import_module(f"{top}._version")
        version = getattr(module, "__version__", None)
        if isinstance(version, str):
            return version
    except Exception:  # a package without that module: ask the installed metadata
        pass
    for dist in (top, top.replace("_", "-"), f"{top}-cpu"):
        try:
            return importlib.metadata.version(dist)
        except Exception:
            continue
    return "unknown"


def names_read(function: Any) -> set[str]:
    """The global and attribute names ``function``'s code loads, nested code included."""
    import types

    code = getattr(function, "__code__", None)
    stack = [code] if code is not None else []
    names: set[str] = set()
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return names


def refuse(cls: type, owner: str, method: str, seen: str, supported: Mapping[str, str],
           engine: str, why: str = "") -> Exception:
    """The :class:`kvplan.IncompatibleHostError` for ``owner.method`` of ``cls``'s host."""
    from kvplan._errors import IncompatibleHostError

    # the engine's version from the first class down the MRO that belongs to a versioned
    # package (a subclass may live in the application's own module)
    version = "unknown"
    for klass in cls.__mro__:
        if klass.__module__ not in ("builtins", "__main__"):
            version = host_version(klass.__module__)
            if version != "unknown":
                break
    known = "; ".join(f"{form} ({releases})" for form, releases in supported.items())
    where = cls.__name__ if owner == cls.__name__ else f"{cls.__name__} (from {owner})"
    message = (f"{engine} {version}: {where}.{method} is {seen}, not a form kvplan was built "
               f"for{': ' + why if why else ''}; kvplan supports {known}. Nothing was replaced "
               f"(the host runs as without kvplan).")
    err = IncompatibleHostError(message)
    err.cls, err.method, err.host_version = cls.__name__, method, version
    err.seen, err.supported = seen, tuple(supported)
    return err


def require_method(cls: type, method: str, supported: Mapping[str, str], engine: str, *,
                   reads: Mapping[str, tuple[str, ...]] | None = None,
                   resolved: Any = None) -> str:
    """The form of ``cls.method`` among ``supported`` (signature text -> releases), or raise
    :class:`kvplan.IncompatibleHostError`. ``reads`` maps a form to the names its
    replacement reads from the worker: the host's method must read them too (the attributes
    still exist in that release). ``resolved``: the host function to check, when the class
    attribute is already kvplan's replacement."""
    function = resolved
    owner = cls.__name__
    if function is None:
        for klass in cls.__mro__:
            if method in klass.__dict__:
                function, owner = klass.__dict__[method], klass.__name__
                break
    else:
        # the class that defines it: the part of the qualified name before the method's
        parts = getattr(function, "__qualname__", "").split(".")
        owner = parts[-2] if len(parts) >= 2 else owner
    if function is None:
        raise refuse(cls, owner, method, "missing", supported, engine)
    seen = signature_text(function)
    if seen not in supported:
        raise refuse(cls, owner, method, seen, supported, engine)
    wanted = (reads or {}).get(seen, ())
    names = names_read(function)
    lacking = [name for name in wanted if name not in names]
    if lacking:
        raise refuse(cls, owner, method, seen, supported, engine,
                     why=f"it no longer reads {', '.join(lacking)}, which kvplan's "
                         "replacement reads")
    return seen
