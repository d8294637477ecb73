"""vLLM's real scheduler side of the NIXL connector, without torch or a GPU: the release's
``nixl/connector.py`` (``NixlPullConnector``), ``nixl/base_scheduler.py`` and
``nixl/pull_scheduler.py`` (``NixlPullConnectorScheduler``), with the real ``Request``
(``v1/request.py``), ``SchedulerOutput`` (``v1/core/sched/output.py``), ``KVCacheBlocks`` and
``KVCacheBlock`` (``v1/core/kv_cache_manager.py``, ``v1/core/kv_cache_utils.py``) they take,
loaded by ``support.vllm_loader``'s machinery (every other module a stand-in), and
``connector_class()`` built over that ``NixlPullConnector`` (fixture ``scheduler_side``).

Import the fixtures into a test module with
``from support.vllm_nixl_scheduler import scheduler_release, scheduler_side  # noqa: F401``.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from support.vllm_loader import REAL_PACKAGES, THIRD_PARTY_STANDINS, load_vllm_nixl
from support.vllm_nixl import BLOCK

from kvplan.compat.vllm import nixl as vllm_nixl

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl."
#: The modules run from the wheel (in this order), on top of ``load_vllm_nixl``'s.
SCHEDULER_MODULES = (
    "vllm.utils",  # length_from_prompt_token_ids_or_embeds (Request's constructor)
    _NIXL + "metadata", _NIXL + "stats", _NIXL + "utils",
    "vllm.v1.core.sched.output",
    "vllm.v1.structured_output.request",
    # vLLM 0.34's Request keeps its token ids in a TokenBuffer (as_list from collection_utils)
    "vllm.utils.collection_utils", "vllm.v1.token_buffer",
    "vllm.v1.request",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_manager",
    _NIXL + "base_scheduler", _NIXL + "pull_scheduler", _NIXL + "push_scheduler",
    _NIXL + "connector",
)
#: Package ``__init__`` files run for real (``vllm/utils/__init__.py``: plain functions).
_PACKAGES = REAL_PACKAGES + ("vllm.utils",)
#: Third-party packages these modules import that the test environment lacks.
_STANDINS = THIRD_PARTY_STANDINS + ("uvloop",)


@pytest.fixture(scope="module", name="sched")
def scheduler_release() -> Iterator[Any]:
    """The release's scheduler-side NIXL modules (:data:`SCHEDULER_MODULES`), the modules
    they replace in ``sys.modules`` put back afterwards."""
    from support.package_shells import import_real

    n = load_vllm_nixl()
    # the release's own (0.32 and 0.33 have no token_buffer.py)
    names = tuple(m for m in SCHEDULER_MODULES if os.path.exists(
        os.path.join(n.vllm.root, *m.split(".")[1:]) + ".py") or m == "vllm.utils")
    before = {name: sys.modules.pop(name, None) for name in names}
    try:
        mods = import_real(n.vllm.root, "vllm", names, real_packages=_PACKAGES,
                           standins=_STANDINS)
        request = mods["vllm.v1.request"]
        yield types.SimpleNamespace(
            version=n.version, nixl=n, modules=mods,
            NixlPullConnector=mods[_NIXL + "connector"].NixlPullConnector,
            NixlPullConnectorScheduler=mods[_NIXL + "pull_scheduler"]
            .NixlPullConnectorScheduler,
            Request=request.Request, RequestStatus=request.RequestStatus,
            SchedulerOutput=mods["vllm.v1.core.sched.output"].SchedulerOutput,
            KVCacheBlocks=mods["vllm.v1.core.kv_cache_manager"].KVCacheBlocks,
            KVCacheBlock=mods["vllm.v1.core.kv_cache_utils"].KVCacheBlock,
            metadata=mods[_NIXL + "metadata"], stats=mods[_NIXL + "stats"])
    finally:
        for name, module in before.items():
            if module is not None:
                sys.modules[name] = module
            else:
                sys.modules.pop(name, None)


@pytest.fixture(name="scheduler_side")
def scheduler_connector(sched: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``connector_class()`` built over the release's real ``NixlPullConnector`` (and its
    ``NixlPullConnectorWorker``); the worker class uninstalled afterwards."""
    package = types.ModuleType(vllm_nixl._VLLM_NIXL)
    package.NixlPullConnectorWorker = sched.nixl.NixlPullConnectorWorker  # type: ignore[attr-defined]
    package.NixlPullConnector = sched.NixlPullConnector  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_nixl._VLLM_NIXL, package)
    monkeypatch.setitem(sys.modules, _NIXL + "stats", sched.stats)
    monkeypatch.setattr(vllm_nixl, "_CONNECTOR", None)
    cls = vllm_nixl.connector_class()
    try:
        yield cls
    finally:
        vllm_nixl.uninstall(cls.Worker)


class KVTransferConfig(types.SimpleNamespace):
    """The fields of vLLM's ``KVTransferConfig`` the connector and its scheduler read."""

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @property
    def is_kv_producer(self) -> bool:
        return bool(self.kv_role in ("kv_producer", "kv_both"))


def scheduler_config(sched: Any, role: str, extra: dict[str, Any] | None = None) -> Any:
    """A ``VllmConfig`` as the scheduler side reads it (TP 1, no PP, DCP or PCP, blocks of
    :data:`support.vllm_nixl.BLOCK` tokens) for ``role`` (``kv_producer`` / ``kv_consumer``)
    with ``kv_connector_extra_config`` ``extra``, and its ``KVCacheConfig``: one full-attention
    KV group."""
    kvi = sched.nixl.vllm.kvi
    spec = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=16,
                                 dtype="float16")
    group = kvi.KVCacheGroupSpec(layer_names=["layers.0.attn"], kv_cache_spec=spec)
    kv_cache_config = kvi.KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                        kv_cache_groups=[group])
    config = types.SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_role=role, engine_id=f"{role}-engine", kv_buffer_device="cuda",
            kv_connector="KvplanNixlConnector",
            kv_connector_extra_config=dict(extra or {})),
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1,
            prefill_context_parallel_size=1, pipeline_parallel_size=1,
            data_parallel_index=0, data_parallel_rank=0),
        cache_config=types.SimpleNamespace(block_size=BLOCK),
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        model_config=types.SimpleNamespace(use_mla=False, max_model_len=4096),
        num_prefill_lookahead_tokens=1)
    return config, kv_cache_config
