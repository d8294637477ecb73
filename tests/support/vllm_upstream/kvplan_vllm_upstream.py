"""pytest plugin for vLLM's own connector unit tests run as written (scripts/test-vllm-upstream).

Loaded with ``-p kvplan_vllm_upstream`` into a run of vLLM's sdist tests; this folder is put on
``PYTHONPATH`` alone, so nothing else of kvplan's test tree can shadow a module vLLM's tests import.
``KVPLAN_VLLM_UPSTREAM`` says which run this is:

* ``kvplan``: before any test is collected, kvplan's drop-ins are installed into vLLM's own worker
  classes (``MooncakeConnectorWorker``; ``NixlBaseConnectorWorker``, so the pull, push and every
  other NIXL worker resolve to kvplan's ``_compute_desc_ids``). A refusal
  (``kvplan.IncompatibleHostError``) or an install that replaces nothing stops the run before
  any test runs. At the end of the session the drop-ins must still be in place.
* ``alone``: vLLM's classes must hold none of kvplan's methods, at the start and at the end.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest

MODE_VARIABLE = "KVPLAN_VLLM_UPSTREAM"
_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
#: The classes kvplan replaces methods of, and the methods it must replace in each.
TARGETS = ((_MOONCAKE, "MooncakeConnectorWorker", ("_build_transfer_params", "_send_blocks")),
           (_NIXL, "NixlBaseConnectorWorker", ("_compute_desc_ids",)))


def _classes() -> list[tuple[type, tuple[str, ...]]]:
    return [(getattr(importlib.import_module(module), name), methods)
            for module, name, methods in TARGETS]


def _kvplan_methods(cls: type, methods: tuple[str, ...]) -> list[str]:
    """The methods of ``methods`` that ``cls`` resolves to a function of kvplan's."""
    found = []
    for name in methods:
        owner = getattr(getattr(cls, name, None), "__module__", "") or ""
        if owner.split(".")[0] == "kvplan":
            found.append(f"{cls.__name__}.{name} -> {owner}")
    return found


def _mode() -> str:
    mode = os.environ.get(MODE_VARIABLE, "")
    if mode not in ("alone", "kvplan"):
        raise pytest.UsageError(f"{MODE_VARIABLE}={mode!r}: set it to 'alone' or 'kvplan'")
    return mode


def _check(when: str) -> None:
    mode = _mode()
    for cls, methods in _classes():
        ours = _kvplan_methods(cls, methods)
        if mode == "alone" and ours:
            raise pytest.UsageError(f"vLLM-alone run, {when}: kvplan's methods are installed: "
                                    f"{ours}")
        if mode == "kvplan" and len(ours) != len(methods):
            raise pytest.UsageError(f"kvplan run, {when}: {cls.__name__} resolves only {ours} "
                                    f"to kvplan's of {list(methods)}")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: Any) -> None:
    if _mode() == "kvplan":
        from kvplan.compat import vllm as compat  # the checkout's kvplan (PYTHONPATH)

        for cls, methods in _classes():
            # IncompatibleHostError propagates: the run stops, naming class, method and host
            replaced = compat.install(cls)
            if tuple(sorted(replaced)) != tuple(sorted(methods)):
                raise pytest.UsageError(f"kvplan's install({cls.__name__}) replaced "
                                        f"{list(replaced)}, expected {list(methods)}")
    _check("before the tests")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _check("after the tests")


def pytest_report_header(config: Any) -> str:
    import vllm

    return f"{MODE_VARIABLE}={_mode()}: vLLM {vllm.__version__} from {vllm.__file__}"
