"""``kvplan.compat.vllm`` is a package split by job; every import path it had as modules works.

vLLM loads ``kvplan.compat.vllm`` by name (``kv_connector_module_path``, the plugin's
registrations and the ``vllm.general_plugins`` entry point), users import the documented
modules ``kvplan.compat.vllm_nixl``, ``vllm_metrics``, ``vllm_ascend`` and ``vllm_forms``; read
here without vLLM.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What ``kvplan.compat.vllm`` exported as one module, unchanged by the split.
PACKAGE_ALL = ["install", "uninstall", "installed", "plan_request", "plan_ready",
               "DEFAULT_MAX_BLOCKS_PER_BATCH", "KvplanMooncakeConnector", "BlockColumn",
               "CONNECTOR_NAME", "MAX_PEER_LAYOUTS", "handoff", "register_plugin"]
#: Names beside ``__all__`` that the benchmarks and tests reach through the package.
PACKAGE_INTERNALS = ["REPLACED_METHODS", "index_array", "_column", "_lengths_list", "_native",
                     "_templates"]
ALIASES = {"kvplan.compat.vllm_nixl": "kvplan.compat.vllm.nixl",
           "kvplan.compat.vllm_metrics": "kvplan.compat.vllm.metrics",
           "kvplan.compat.vllm_ascend": "kvplan.compat.vllm.ascend",
           "kvplan.compat.vllm_forms": "kvplan.compat.vllm.forms"}


def test_package_exports_what_the_module_exported():
    vllm = importlib.import_module("kvplan.compat.vllm")
    assert vllm.__all__ == PACKAGE_ALL
    for name in PACKAGE_ALL + PACKAGE_INTERNALS:
        if not name.startswith("Kvplan"):  # the connector classes need vLLM (built on access)
            assert getattr(vllm, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        vllm.no_such_name  # noqa: B018


@pytest.mark.parametrize("old, new", sorted(ALIASES.items()))
def test_old_module_path_is_the_new_module(old, new):
    alias, module = importlib.import_module(old), importlib.import_module(new)
    assert alias.__all__ == module.__all__
    assert alias.__all__, old
    for name in module.__all__:
        assert getattr(alias, name) is getattr(module, name), (old, name)


def test_vllm_loads_the_package_by_its_path():
    connector = importlib.import_module("kvplan.compat.vllm.connector")
    assert connector._MODULE_PATH == "kvplan.compat.vllm"
    pyproject = (ROOT / "pyproject.toml").read_text()
    block = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\n([^\[]*)', pyproject)
    assert block is not None
    target = re.search(r'=\s*"([\w.]+):(\w+)"', block.group(1))
    assert target is not None
    assert target.groups() == ("kvplan.compat.vllm", "register_plugin")
    assert callable(getattr(importlib.import_module(target.group(1)), target.group(2)))
