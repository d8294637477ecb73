"""The registry at the bottom of the package: SGLang's manager classes and their functions as
:func:`install` found them (the originals kvplan's drop-ins replaced, the seam functions, the
globals of SGLang's modules), and the look-ups of SGLang's own method for a manager. Imports
nothing from the package, so every other module can depend on it."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

MOONCAKE_MANAGER, ASCEND_MANAGER = "MooncakeKVManager", "AscendKVManager"
NIXL_MANAGER = "NixlKVManager"


#: Methods :func:`install` replaces, per manager class name (a class inheriting from one of these
#: gets the set of its nearest listed base).
REPLACED_METHODS: dict[str, tuple[str, ...]] = {
    "MooncakeKVManager": ("_send_kvcache_generic", "send_kvcache", "_send_mamba_state",
                          "_send_mamba_state_slice", "send_kvcache_slice", "send_kvcache_dcp",
                          "send_kvcache_staged"),
    "AscendKVManager": ("_send_kvcache_generic", "send_kvcache", "_send_mamba_state"),
    "NixlKVManager": ("_send_kvcache_generic", "_send_mamba_state", "_send_mamba_state_slice",
                      "send_kvcache_staged",
                      "_prep_equal_tp_dlist", "_init_hetero_tp_prep_handle",
                      "_init_mixed_equal_tp_prep_handles", "send_kvcache_mixed",
                      "_prepare_state_xfer", "_send_prepared_states"),
}


#: Methods SGLang's replaced send paths call on ``self`` and kvplan's fast path stands in for.
#: When a manager resolves one of them to anything but SGLang's own function (a subclass
#: override, an instance attribute, a tracing wrapper, a test's recorder), kvplan calls it as
#: SGLang would: blocks go through ``_transfer_data`` and ``_await_transfer_futures``, and a
#: replaced pointer-slicing method hands the call to SGLang's own send method.
SEAMS = ("_transfer_data", "_await_transfer_futures", "get_mla_kv_ptrs_with_pp",
         "_mla_kv_entry_span_with_pp", "get_mha_kv_ptrs_with_pp")


# SGLang's manager classes by name, as found in the MRO of the classes passed to install()
_SGLANG_CLASSES: dict[str, type] = {}


# SGLang's manager class name -> the globals of the module that defines it
_SGLANG_GLOBALS: dict[str, dict[str, Any]] = {}


# seam name -> {SGLang's function: name of the SGLang class that defines it}
_SGLANG_IMPLS: dict[str, dict[Any, str]] = {name: {} for name in SEAMS}


# (class, method name) -> SGLang's function that the class resolved before install
_ORIGINALS: dict[tuple[type, str], Any] = {}


def _function(value: Any) -> Any:
    """The plain function behind a bound method, staticmethod or classmethod."""
    if isinstance(value, (types.MethodType, staticmethod, classmethod)):
        return value.__func__
    return value


def _class_attr(cls: type, name: str) -> tuple[type, Any] | None:
    """``(defining class, raw value)`` of ``name`` in ``cls``'s MRO, without descriptors."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass, klass.__dict__[name]
    return None


def _register_sglang_classes(cls: type) -> None:
    """Remember SGLang's manager classes in ``cls``'s MRO and their seam functions."""
    for klass in cls.__mro__:
        if klass.__name__ not in (MOONCAKE_MANAGER, ASCEND_MANAGER, NIXL_MANAGER) \
                or klass.__name__ in _SGLANG_CLASSES:
            continue
        _SGLANG_CLASSES[klass.__name__] = klass
        _SGLANG_GLOBALS[klass.__name__] = _function(
            _resolve_original(klass, "send_kvcache")).__globals__
        for name in SEAMS:
            found = _class_attr(klass, name)
            if found is not None:
                _SGLANG_IMPLS[name][_function(found[1])] = found[0].__name__


def sglang_impl(manager: Any, name: str) -> str | None:
    """The SGLang class whose own ``name`` ``manager`` resolves to (instance attribute first,
    as Python looks it up), or None when it resolves to anything else or nothing."""
    attrs = getattr(manager, "__dict__", None)
    if attrs is not None and name in attrs:
        value = attrs[name]
    else:  # the class's attribute as Python resolves it (a function, for a plain method)
        value = getattr(type(manager), name, None)
    try:
        return _SGLANG_IMPLS[name].get(_function(value))
    except TypeError:  # an unhashable callable is not SGLang's
        return None


def sglang_method(manager: Any, name: str, kind: str) -> Any:
    """SGLang's own ``name`` for ``manager``: the original kvplan replaced on the nearest
    installed class in its MRO, else (an object of another class, called unbound, e.g. a test's
    recorder) the one of SGLang's ``kind`` class."""
    for klass in type(manager).__mro__:
        original = _ORIGINALS.get((klass, name))
        if original is not None:
            return original
    base = _SGLANG_CLASSES.get(kind)
    if base is None:
        raise RuntimeError(f"kvplan's {name} runs only after install({kind}) (or a subclass)")
    return _resolve_original(base, name)


def sglang_global(name: str, kind: str = MOONCAKE_MANAGER) -> Any:
    """A global of the SGLang module that defines the ``kind`` class (e.g. ``get_memory``,
    ``logger``), read when needed, as SGLang's methods read it."""
    return _SGLANG_GLOBALS[kind][name]


def _dropin(fn: Callable[..., int]) -> Callable[..., int]:
    setattr(fn, "_kvplan_dropin", True)
    return fn


def _resolve_original(cls: type, name: str) -> Any:
    """SGLang's function ``cls`` resolves ``name`` to, looking through kvplan's drop-ins."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            value = klass.__dict__[name]
            if getattr(value, "_kvplan_dropin", False):
                return _ORIGINALS[(klass, name)]
            return value
    raise AttributeError(f"{cls.__name__} has no method {name!r}")


def _original_for(cls: type, name: str) -> Any:
    """SGLang's own implementation of ``name`` for instances of ``cls`` (installed or not)."""
    for klass in cls.__mro__:
        if (klass, name) in _ORIGINALS:
            return _ORIGINALS[(klass, name)]
    return _resolve_original(cls, name)


def _manager_kind(cls: type) -> str:
    names = [k.__name__ for k in cls.__mro__]
    for kind in (ASCEND_MANAGER, MOONCAKE_MANAGER, NIXL_MANAGER):
        if kind in names:
            return kind
    raise TypeError(
        f"{cls.__name__} is not an SGLang MooncakeKVManager, AscendKVManager or NixlKVManager "
        "(subclass)")
