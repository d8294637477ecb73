"""Run a few leaf modules of a large package from its unpacked distribution, without its
``__init__`` files and without the dependencies it does not need: the machinery the SGLang and
vLLM loaders (``support.sglang_loader``, ``support.vllm_loader``) share.

* :func:`import_real` registers the packages above the chosen leaf modules as empty *shells*
  (``__path__`` into the unpacked tree, ``__init__`` not executed), then imports the leaves under
  their real dotted names through a :class:`Finder` on ``sys.meta_path``.
* Every other module of the package, and each listed third-party package that is not
  installed, gets a permissive *stand-in* module (:class:`StubModule`): any attribute is a
  stand-in class, and a stand-in called with one function or class returns it (a decorator).
  Stand-ins only satisfy module-level statements.
* :func:`walk_globals` proves that none of them is reachable from the code that runs: it walks
  every global the given functions load, transitively through the package's module-level
  functions they reach, and raises if one resolves to a stand-in.
* :func:`unpack_once`, :func:`download_wheel` and :func:`dist_version` keep a downloaded
  distribution unpacked in a cache directory, published atomically once complete.
"""

from __future__ import annotations

import abc
import dis
import glob
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterable, Iterator

STUBBED: list[str] = []  # names of the modules that got a stand-in, in import order


# --------------------------------------------------------------------------------------------
# Permissive stand-ins
# --------------------------------------------------------------------------------------------
class _StubMeta(abc.ABCMeta):
    """Metaclass of stand-in classes: any attribute is another stand-in; calling a pure stand-in
    with a single function/class returns it unchanged (decorator pass-through)."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        if cls.__dict__.get("_kvplan_stub", False):
            if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type)):
                return args[0]
        return super().__call__(*args, **kwargs)

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())


class _StubBase(metaclass=_StubMeta):
    _kvplan_stub = True

    def __init_subclass__(cls, **kwargs):  # e.g. class X(msgspec.Struct, frozen=True)
        super().__init_subclass__()

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{type(self).__qualname__}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type)):
            return args[0]
        return _StubBase()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stub_class(qualname: str) -> type:
    cls = _StubMeta(qualname.rsplit(".", 1)[-1], (_StubBase,), {"_kvplan_stub": True})
    cls.__qualname__ = qualname
    cls.__module__ = "kvplan_bench_stub"
    return cls


def is_stub(obj) -> bool:
    if isinstance(obj, StubModule) or isinstance(obj, _StubBase):
        return True
    return (isinstance(obj, type) and issubclass(obj, _StubBase)
            and obj.__dict__.get("_kvplan_stub", False))


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = StubModule(spec.name)
        mod.__path__ = []  # a package, so `import torch.distributed` works
        return mod

    def exec_module(self, module):
        STUBBED.append(module.__name__)


def _stub_spec(fullname: str) -> importlib.machinery.ModuleSpec:
    return importlib.machinery.ModuleSpec(fullname, StubLoader(), is_package=True)


# --------------------------------------------------------------------------------------------
# Package shells and the finder
# --------------------------------------------------------------------------------------------
class Finder(importlib.abc.MetaPathFinder):
    """Resolves the modules of the packages in ``roots`` (top package name -> its unpacked
    directory): ``real_modules`` from their files (a name also in ``real_packages`` as a package,
    its ``__init__`` executed), any other one of their modules to a stand-in; a top-level name in
    ``standins`` to a stand-in unless it is really installed. Everything else (stdlib, numpy,
    ...) is left to the normal import system."""

    def __init__(self, roots: dict[str, str], real_modules: Iterable[str], *,
                 real_packages: Iterable[str] = (), standins: Iterable[str] = ()):
        self.roots = dict(roots)
        self.real_modules = frozenset(real_modules)
        self.real_packages = frozenset(real_packages) & self.real_modules
        self.standins = frozenset(standins)

    def find_spec(self, fullname, path=None, target=None):
        top, *rel = fullname.split(".")
        if top in self.roots:
            if fullname in self.real_packages:
                pkg_dir = os.path.join(self.roots[top], *rel)
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(pkg_dir, "__init__.py"),
                    submodule_search_locations=[pkg_dir])
            if fullname in self.real_modules:
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(self.roots[top], *rel) + ".py")
            if fullname in sys.modules:
                return None
            return _stub_spec(fullname)
        if top in self.standins:
            if top in sys.modules and not isinstance(sys.modules[top], StubModule):
                return None
            if top not in sys.modules and importlib.machinery.PathFinder.find_spec(top) is not None:
                return None  # really installed: use the real package
            return _stub_spec(fullname)
        return None


def package_shells(root: str, modules: Iterable[str], real_packages: Iterable[str] = ()) -> None:
    """Register the packages above ``modules`` (all under the package unpacked at ``root``) as
    empty modules whose ``__path__`` points into ``root``, without running their ``__init__``
    files; ``real_packages`` are left to the finder, which executes their ``__init__``."""
    shells = set()
    for name in modules:
        parts = name.split(".")
        for i in range(1, len(parts)):
            shells.add(".".join(parts[:i]))
    shells -= set(real_packages)
    for name in sorted(shells, key=lambda s: s.count(".")):
        if name in sys.modules:
            continue
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, *name.split(".")[1:])]
        mod.__package__ = name
        mod.__file__ = None
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:  # a real package parent sets it when imported
            setattr(sys.modules[parent], child, mod)


class finding:
    """``with finding(finder):`` -- ``finder`` first on ``sys.meta_path`` for the block."""

    def __init__(self, finder: Finder):
        self.finder = finder

    def __enter__(self) -> Finder:
        sys.meta_path.insert(0, self.finder)
        return self.finder

    def __exit__(self, *exc) -> None:
        sys.meta_path.remove(self.finder)


def import_real(root: str, top: str, modules: tuple[str, ...], *,
                real_packages: Iterable[str] = (),
                standins: Iterable[str] = ()) -> dict[str, types.ModuleType]:
    """Import ``modules`` (in order) from the package ``top`` unpacked at ``root``, through
    package shells and a :class:`Finder`; check each one is a real file under ``root``."""
    real_packages = tuple(real_packages)
    package_shells(root, modules, real_packages)
    with finding(Finder({top: root}, modules, real_packages=real_packages, standins=standins)):
        mods = {name: importlib.import_module(name) for name in modules}
    for name, mod in mods.items():
        assert not isinstance(mod, StubModule), name
        assert mod.__file__ and mod.__file__.startswith(root), (name, mod.__file__)
    return mods


# --------------------------------------------------------------------------------------------
# Proof that no stand-in is reachable from the code that runs
# --------------------------------------------------------------------------------------------
def _global_loads(code: types.CodeType) -> Iterator[str]:
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield ins.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_loads(const)


def _is_builtin(name: str) -> bool:
    if isinstance(__builtins__, dict):
        return name in __builtins__
    return hasattr(__builtins__, name)


def walk_globals(roots: list, prefixes: tuple[str, ...]) -> list[str]:
    """Walk every global ``roots`` load, transitively through the module-level functions of
    modules named with ``prefixes`` they reach; raise if any resolves to a stand-in or is
    undefined. Returns the qualified names of the functions visited."""
    seen: set[int] = set()
    visited: list[str] = []
    bad: list[str] = []
    todo = list(roots)
    while todo:
        fn = todo.pop()
        fn = getattr(fn, "__func__", fn)
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        visited.append(f"{fn.__module__}.{fn.__qualname__}")
        g = fn.__globals__
        for name in _global_loads(fn.__code__):
            if name in g:
                obj = g[name]
            elif _is_builtin(name):
                continue
            else:
                bad.append(f"{fn.__qualname__}: global {name!r} is undefined")
                continue
            if is_stub(obj):
                bad.append(f"{fn.__qualname__}: global {name!r} is a stand-in")
            elif isinstance(obj, types.FunctionType) and obj.__module__.startswith(prefixes):
                todo.append(obj)
    if bad:
        raise AssertionError("stand-ins reachable from the planning code:\n" + "\n".join(bad))
    return visited


# --------------------------------------------------------------------------------------------
# The downloaded distributions, unpacked once in a cache directory
# --------------------------------------------------------------------------------------------
def pip_download(args: list[str], cache: str, env: dict | None = None) -> None:
    """``pip download --no-deps ARGS`` into ``cache``; raises ``RuntimeError`` naming the failure.

    pip writes into a private directory and each finished file is renamed into ``cache``, so a
    concurrent reader (another test worker) never sees a partly written archive."""
    import shutil
    import tempfile

    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".download-", dir=cache)
    try:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--no-deps", *args, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(cache, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def download_wheel(dist: str, version: str, cache: str) -> str:
    """The path of ``dist``'s wheel in ``cache``, downloaded with pip the first time (one
    process at a time: the others wait for it and reuse its file)."""
    import fcntl

    pattern = os.path.join(cache, f"{dist}-{version}-*.whl")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, f".download-{dist}-{version}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not glob.glob(pattern):
            pip_download([f"{dist}=={version}"], cache)
    wheels = glob.glob(pattern)
    if not wheels:
        raise RuntimeError(f"pip download {dist}=={version} left no wheel in {cache}")
    return wheels[0]


def unpack_once(cache: str, name: str, package: str, unpack: Callable[[str], None]) -> str:
    """``<cache>/<name>/<package>``, filled the first time by ``unpack(tmp_dir)`` in a private
    directory that is renamed into place once complete."""
    import fcntl

    unpacked = os.path.join(cache, name)
    if os.path.exists(os.path.join(unpacked, ".complete")):
        return os.path.join(unpacked, package)
    os.makedirs(cache, exist_ok=True)
    # One process at a time fetches and unpacks (test workers start together); the others
    # wait on the lock and then find the finished copy.
    with open(os.path.join(cache, f".unpack-{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(unpacked, ".complete")):
            return os.path.join(unpacked, package)
        tmp = unpacked + f".tmp{os.getpid()}"
        unpack(tmp)
        open(os.path.join(tmp, ".complete"), "w").close()
        try:
            os.rename(tmp, unpacked)
        except OSError:  # a copy from before the lock existed is already in place
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(unpacked, package)


def dist_version(meta: str) -> str:
    """The ``Version:`` of a METADATA / PKG-INFO file; ``"unknown"`` if there is none."""
    if not os.path.exists(meta):
        return "unknown"
    with open(meta, encoding="utf-8") as f:
        for line in f:
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"
