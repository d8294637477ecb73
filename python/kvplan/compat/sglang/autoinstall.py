"""Installing kvplan into SGLang's managers without editing SGLang: an opt-in import hook.

SGLang starts its schedulers with multiprocessing *spawn*, so ``install(MooncakeKVManager)``
called in the launcher does not reach the processes that transfer KV caches. kvplan's wheel
ships ``kvplan-sglang-install.pth`` (wheel data installed into site-packages itself, from
``python/kvplan.data/purelib``), which Python runs at start-up in every process of the
environment; with ``KVPLAN_SGLANG_INSTALL=1`` in the environment (inherited by SGLang's
spawned processes) it calls :func:`arm`, which puts an import hook first on ``sys.meta_path``.
The hook imports nothing of SGLang: when SGLang itself imports
``sglang.srt.disaggregation.mooncake.conn`` (or ``.ascend.conn``, ``.nixl.conn``), the module
runs as usual and then :func:`~kvplan.compat.sglang.install` is applied to its
``MooncakeKVManager`` (or ``AscendKVManager``, ``NixlKVManager``) before any manager is built, with ``on_error="status"``: a request kvplan
refuses (a decode whose layout does not match) is logged with kvplan's reason and takes SGLang's
failure path for that request, instead of ending the prefill's transfer thread.

The variable is read strictly: ``1``, ``true``, ``yes`` or ``on`` turn the hook on; unset,
empty, ``0``, ``false``, ``no`` or ``off`` leave it off (and the ``.pth`` line then does not
even import kvplan); case and surrounding spaces are ignored. Any other value is an error.

A server started with the opt-in never runs without kvplan by accident: a failure to install (a
class missing, a method SGLang renamed) raises from SGLang's import; and when the hook cannot be
armed at start-up (kvplan itself fails to import, or the variable holds an unknown value) the
``.pth`` line says why on stderr and puts a finder first on ``sys.meta_path`` that tries again
when SGLang imports a module of :data:`TARGETS` and, failing again, makes that import raise
``ImportError`` with the reason. Processes that never import SGLang's transfer modules (pip,
tools) keep working.
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

from kvplan._core import KvPlanError

#: The environment variable that turns the hook on.
ENV_VAR = "KVPLAN_SGLANG_INSTALL"
#: Its values, compared after ``strip().lower()``; anything else is refused.
ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("", "0", "false", "no", "off")

#: SGLang's modules the hook waits for, and the manager class each defines.
TARGETS: dict[str, str] = {
    "sglang.srt.disaggregation.mooncake.conn": "MooncakeKVManager",
    "sglang.srt.disaggregation.ascend.conn": "AscendKVManager",
    "sglang.srt.disaggregation.nixl.conn": "NixlKVManager",
}

_log = logging.getLogger("kvplan.compat.sglang")


class HookSettingError(KvPlanError):
    """``KVPLAN_SGLANG_INSTALL`` holds a value that is neither on nor off; ``value`` is it."""

    kind = "sglang_hook_setting"
    value: str = ""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVPLAN_SGLANG_INSTALL`` asks for the hook (in ``environ``, default the
    process's): True for :data:`ON_VALUES`, False for :data:`OFF_VALUES` or unset.

    Raises:
        HookSettingError: any other value (a typo must not silently turn the hook on or off).
    """
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    word = value.strip().lower()
    if word in ON_VALUES:
        return True
    if word in OFF_VALUES:
        return False
    error = HookSettingError(f"{ENV_VAR}={value!r} is neither on ({', '.join(ON_VALUES)}) nor "
                             f"off (unset, empty, {', '.join(v for v in OFF_VALUES if v)})")
    error.value = value
    raise error


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
    """:func:`arm` when :func:`enabled`; what the ``.pth`` file calls.

    Raises:
        HookSettingError: as :func:`enabled`.
    """
    return arm() if enabled() else None


# What the ``.pth`` line runs when the variable is not an off value. It must work when kvplan
# itself cannot be imported, so it uses the standard library only and names the targets itself.
# At start-up kvplan may not be importable yet although it is installed: site-packages' .pth
# files run in name order, and an editable install's path line (kvplan.pth) sorts after this
# one. So a failed start-up arming leaves a finder that arms the hook when SGLang imports one of
# its transfer modules, and makes that import raise ImportError, naming why, if it still fails.
_BOOT = f"""\
import os, sys
value = os.environ.get({ENV_VAR!r}, "")
targets = {tuple(TARGETS)!r}


def arm():
    from kvplan.compat.sglang.autoinstall import arm_from_environment
    return arm_from_environment()


class KvplanSGLangHookPending:
    warned = False

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in targets:
            return None
        me = (sys.meta_path.index(KvplanSGLangHookPending)
              if KvplanSGLangHookPending in sys.meta_path else len(sys.meta_path))
        if any(type(f).__name__ == "SGLangInstallFinder" for f in sys.meta_path[:me]):
            return None  # armed since: the hook before this finder handles the module
        try:
            hook = arm()
        except Exception as error:
            raise ImportError(
                f"{ENV_VAR}={{value!r}} asks for kvplan in SGLang's transfer managers, but "
                f"kvplan's hook could not be armed ({{type(error).__name__}}: {{error}}); fix "
                f"kvplan's installation or the value, or unset {ENV_VAR} to run SGLang "
                f"without kvplan") from error
        return None if hook is None else hook.find_spec(name, path, target)


try:
    arm()
except Exception as error:
    # site-packages may be processed twice (a venv's lib64 link): one pending finder, one warning.
    pending = next((f for f in sys.meta_path
                    if getattr(f, "__name__", "") == "KvplanSGLangHookPending"), None)
    if pending is None:
        pending = KvplanSGLangHookPending
        sys.meta_path.insert(0, pending)
    if not (isinstance(error, ImportError) and error.name == "kvplan") and not pending.warned:
        pending.warned = True
        sys.stderr.write(f"kvplan: {ENV_VAR}={{value!r}} is set but kvplan's SGLang hook "
                         f"could not be armed at start-up ({{type(error).__name__}}: "
                         f"{{error}}); importing SGLang's transfer modules will raise "
                         f"ImportError unless it can be armed then\\n")
"""


def pth_text() -> str:
    """The text of ``kvplan-sglang-install.pth`` (python/kvplan.data/purelib holds it; a test
    checks the two agree). Its one code line costs a dictionary lookup while the variable is
    unset or off; otherwise it runs :data:`_BOOT` (arm the hook, or make SGLang's transfer
    modules refuse to import, naming why it could not be armed)."""
    return (f"# kvplan's opt-in SGLang hook ({ENV_VAR}); written by "
            f"kvplan.compat.sglang.autoinstall.pth_text()\n"
            f"import os; os.environ.get({ENV_VAR!r}, '').strip().lower() not in "
            f"{OFF_VALUES!r} and exec({_BOOT!r}, {{'__name__': 'kvplan_sglang_install'}})\n")
