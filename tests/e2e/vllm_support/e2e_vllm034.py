"""Test support (not kvplan): vLLM 0.34.0's Mooncake and NIXL connector modules in a 0.32 engine.

vLLM 0.34.0 publishes no CPU build. Its connector packages
(``vllm.distributed.kv_transfer.kv_connector.v1.mooncake`` and ``...v1.nixl``, copied from the
``vllm==0.34.0`` wheel into ``$KVPLAN_E2E_VLLM034``) are served under vLLM's own module names
by an import finder installed before anything imports 0.32's, so kvplan's connectors, imported
afterwards, subclass 0.34's classes; everything else is the 0.32 engine.

0.34's modules import four names the 0.32 engine lacks. Each is added to its 0.32 module from
0.34's own source (the same text, executed in the 0.32 module's namespace), never rewritten:
``KVCacheAccess`` (``vllm.config.kv_transfer``; only 0.34's engine asks for it),
``iter_layer_specs`` (``vllm.v1.kv_cache_interface``) and ``check_compressed_kernel_split``
(``...kv_connector.utils``), ``check_nixl_version`` (``vllm.distributed.nixl_utils``). And its
Mooncake worker reads ``cache_config.enable_extensible_kv_cache``, a setting 0.34's engine adds
and settles to False on a CPU: the 0.32 ``CacheConfig`` class answers False.

Exports ``KvplanMooncakeConnector`` and ``KvplanNixlConnector`` (kvplan's classes, unmodified)
and, as the references for this overlay, vLLM 0.34.0's own ``NixlConnector`` and its
``MooncakeConnector`` as ``CpuHostMooncakeConnector`` (device index 0 on a CPU-only host).
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from pathlib import Path

_SOURCE = Path(os.environ["KVPLAN_E2E_VLLM034"])  # holds vllm/<same paths as the wheel>
_OVERLAID = ("vllm.distributed.kv_transfer.kv_connector.v1.mooncake",
             "vllm.distributed.kv_transfer.kv_connector.v1.nixl")
#: (0.32 module, 0.34 source file under vllm/, names it lacks), in the order 0.34 needs them.
GRAFTS = (
    ("vllm.config.kv_transfer", "config/kv_transfer.py", ("KVCacheAccess",)),
    ("vllm.v1.kv_cache_interface", "v1/kv_cache_interface.py", ("iter_layer_specs",)),
    ("vllm.distributed.kv_transfer.kv_connector.utils",
     "distributed/kv_transfer/kv_connector/utils.py", ("check_compressed_kernel_split",)),
    ("vllm.distributed.nixl_utils", "distributed/nixl_utils.py", ("check_nixl_version",)),
)


def _source_file(fullname: str) -> Path | None:
    if not any(fullname == p or fullname.startswith(p + ".") for p in _OVERLAID):
        return None
    rel = Path(*fullname.split(".")[1:])
    for candidate in (_SOURCE / "vllm" / rel / "__init__.py",
                      _SOURCE / "vllm" / rel.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


class _Vllm034Finder(importlib.abc.MetaPathFinder):
    """Serves the overlaid packages' modules from 0.34's files (a module 0.34 does not have
    falls through to 0.32's)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        found = _source_file(fullname)
        if found is None:
            return None
        spec = importlib.util.spec_from_file_location(
            fullname, found,
            submodule_search_locations=[str(found.parent)] if found.name == "__init__.py"
            else None)
        return spec


def _graft(module_name: str, rel: str, names: Sequence[str]) -> None:
    module = importlib.import_module(module_name)
    text = (_SOURCE / "vllm" / rel).read_text()
    tree = ast.parse(text)
    for name in names:
        if hasattr(module, name):
            continue
        nodes = [n for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
        if len(nodes) != 1:
            raise RuntimeError(f"vLLM 0.34.0's {rel} has {len(nodes)} definitions of {name}")
        segment = ast.get_source_segment(text, nodes[0])
        assert segment is not None
        # Annotations stay text (0.34's may name types the 0.32 module does not import).
        code = compile("from __future__ import annotations\nimport enum\n" + segment,
                       f"<vLLM 0.34.0 {rel}: {name}>", "exec")
        exec(code, module.__dict__)


def install() -> None:
    for package in _OVERLAID:
        present = sys.modules.get(package)
        if present is not None and not getattr(present, "__file__", "").startswith(
                str(_SOURCE)):
            raise RuntimeError(f"{package} was imported from vLLM 0.32 before the 0.34 overlay")
    if not any(isinstance(f, _Vllm034Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Vllm034Finder())
    for module_name, rel, names in GRAFTS:
        _graft(module_name, rel, names)
    # 0.34's Mooncake worker reads a cache setting 0.34 added (enable_extensible_kv_cache:
    # device virtual memory for the KV cache, which 0.34's engine turns on for CUDA and ROCm
    # only); the 0.32 engine's CacheConfig answers what 0.34's settles on a CPU.
    cache_config = importlib.import_module("vllm.config.cache").CacheConfig
    if not hasattr(cache_config, "enable_extensible_kv_cache"):
        cache_config.enable_extensible_kv_cache = False
    # 0.34's kv_connector.utils imports iter_layer_specs from kv_cache_interface.
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    if not hasattr(utils, "iter_layer_specs"):
        utils.iter_layer_specs = importlib.import_module(  # type: ignore[attr-defined]
            "vllm.v1.kv_cache_interface").iter_layer_specs
    # Read by the e2e's "connector loaded" case (vllm_e2e.OVERLAY_034_LINE).
    print(f"kvplan e2e: vLLM 0.34.0 connector modules from {_SOURCE} (pid {os.getpid()})",
          flush=True)


install()

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlConnector,
)

from e2e_cpu_host_mooncake import CpuHostMooncakeConnector  # noqa: E402  (0.34's class now)

from kvplan.compat.vllm import KvplanMooncakeConnector, KvplanNixlConnector  # noqa: E402

__all__ = ["CpuHostMooncakeConnector", "KvplanMooncakeConnector", "KvplanNixlConnector",
           "NixlConnector"]
