"""Test support (not kvplan): vLLM 0.33.0's Mooncake connector module inside a vLLM 0.32 engine.

vLLM 0.33.0 publishes no CPU build, so its ``mooncake_connector.py`` and the ``stats.py`` it
imports (copied from the ``vllm==0.33.0`` wheel into ``$KVPLAN_E2E_VLLM033_MOONCAKE``) are
executed under vLLM's own module names before anything imports 0.32's, and kvplan's connector,
imported afterwards, subclasses 0.33's classes. Everything else is the 0.32 engine.
``KvplanMooncakeConnector`` here is kvplan's class itself (``kvplan.compat.vllm``), unmodified;
``CpuHostMooncakeConnector`` is vLLM 0.33.0's own connector (the reference for this overlay).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake"
_MARK = "__vllm_033_from_wheel__"


def _load(name: str, path: Path) -> None:
    full = f"{_PACKAGE}.{name}"
    present = sys.modules.get(full)
    if present is not None:
        if getattr(present, _MARK, False):
            return
        raise RuntimeError(f"{full} was imported from vLLM 0.32 before the 0.33 overlay")
    spec = importlib.util.spec_from_file_location(full, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    setattr(module, _MARK, True)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    setattr(importlib.import_module(_PACKAGE), name, module)


_SOURCE = Path(os.environ["KVPLAN_E2E_VLLM033_MOONCAKE"])
importlib.import_module(_PACKAGE)
_load("stats", _SOURCE / "stats.py")
_load("mooncake_connector", _SOURCE / "mooncake_connector.py")

from e2e_cpu_host_mooncake import CpuHostMooncakeConnector  # noqa: E402  (0.33's class now)

from kvplan.compat.vllm import KvplanMooncakeConnector  # noqa: E402

__all__ = ["KvplanMooncakeConnector", "CpuHostMooncakeConnector"]
