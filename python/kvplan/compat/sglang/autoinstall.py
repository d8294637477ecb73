"""Installing kvplan into SGLang's managers without editing SGLang: an opt-in import hook.

SGLang starts its schedulers with multiprocessing *spawn*, so ``install(MooncakeKVManager)``
called in the launcher does not reach the processes that transfer KV caches. kvplan's wheel
ships ``kvplan-sglang-install.pth`` (wheel data installed into site-packages itself, from
``python/kvplan.data/purelib``), which Python runs at start-up in every process of the
environment; with ``KVPLAN_SGLANG_INSTALL=1`` in the environment (inherited by SGLang's
spawned processes) it calls :func:`arm`, which puts an import hook first on ``sys.meta_path``.
The hook imports nothing of SGLang: when SGLang itself imports
``sglang.srt.disaggregation.mooncake.conn`` (or ``.ascend.conn``), the module runs as usual and
then :func:`~kvplan.compat.sglang.install` is applied to its ``MooncakeKVManager`` (or
``AscendKVManager``) before any manager is built, with ``on_error="status"``: a request kvplan
refuses (a decode whose layout does not match) is logged with kvplan's reason and takes SGLang's
failure path for that request, instead of ending the prefill's transfer thread. Off by default:
unset, empty or ``0`` does nothing (and the ``.pth`` line does not even import kvplan).

A failure to install (a class missing, a method SGLang renamed) raises from SGLang's import, so
a server started with the opt-in never runs without kvplan by accident.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Mapping, Sequence

#: The environment variable that turns the hook on (any value but unset, empty or ``0``).
ENV_VAR = "KVPLAN_SGLANG_INSTALL"

#: SGLang's modules the hook waits for, and the manager class each defines.
TARGETS: dict[str, str] = {
    "sglang.srt.disaggregation.mooncake.conn": "MooncakeKVManager",
    "sglang.srt.disaggregation.ascend.conn": "AscendKVManager",
}

_log = logging.getLogger("kvplan.compat.sglang")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVPLAN_SGLANG_INSTALL`` asks for the hook (in ``environ``, default the process's)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip() not in ("", "0")


def install_into(module: types.ModuleType) -> tuple[str, ...]:
    """Apply :func:`~kvplan.compat.sglang.install` (``on_error="status"``) to the manager class
    ``module`` defines (``module`` is one of :data:`TARGETS`); returns the names of the methods
    installed on it."""
    from kvplan.compat.sglang.install import install, installed

    class_name = TARGETS[module.__name__]
    manager_class = getattr(module, class_name, None)
    if not isinstance(manager_class, type):
        raise ImportError(
            f"{ENV_VAR} is set but {module.__name__} defines no class {class_name}; "
            "this kvplan supports SGLang 0.5.23")
    install(manager_class, on_error="status")
    names = installed(manager_class)
    _log.info("kvplan installed into %s.%s (pid %d): %s", module.__name__, class_name,
              os.getpid(), ", ".join(names))
    return names


class _InstallingLoader(importlib.abc.Loader):
    """Runs SGLang's module with its own loader, then installs kvplan into its manager class."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        install_into(module)

    def __getattr__(self, name: str) -> object:
        # get_source, get_filename, is_package, ...: what tracebacks and inspect ask of the
        # module's loader are SGLang's loader's answers.
        return getattr(self._loader, name)


class SGLangInstallFinder(importlib.abc.MetaPathFinder):
    """The import hook :func:`arm` puts first on ``sys.meta_path``: for a module of
    :data:`TARGETS` it asks the finders after it for the spec and wraps that spec's loader;
    every other name it leaves alone (returns ``None``). A finder inserted before it that
    returns its own spec for a target hides the module from it (SGLang's modules are found
    by Python's path finder, the last one)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in TARGETS:
            return None
        # Only the finders after this one: two hooks of this kind (kvplan's and another
        # wrapper's) each asking every other finder would ask each other forever.
        later = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        for finder in later:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec  # nothing to run after: SGLang's module is not loaded from code
            spec.loader = _InstallingLoader(spec.loader)
            return spec
        return None


def arm() -> SGLangInstallFinder:
    """Put the hook first on ``sys.meta_path`` (once per process) and return it. When a target
    module is already imported, install into it now."""
    for finder in sys.meta_path:
        if isinstance(finder, SGLangInstallFinder):
            return finder
    finder = SGLangInstallFinder()
    sys.meta_path.insert(0, finder)
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None:
            install_into(module)
    return finder


def disarm() -> None:
    """Take the hook off ``sys.meta_path`` (classes already installed stay installed)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, SGLangInstallFinder)]


def arm_from_environment() -> SGLangInstallFinder | None:
    """:func:`arm` when :func:`enabled`; what the ``.pth`` file calls."""
    return arm() if enabled() else None
