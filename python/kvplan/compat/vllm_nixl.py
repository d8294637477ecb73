"""vLLM NIXL connector: kvplan's core computes the per-request NIXL descriptor ids.

``kvplan.compat.vllm.install(NixlConnectorWorker)`` (or any subclass of vLLM's
``NixlBaseConnectorWorker``: the pull and push workers) lands here. It replaces one method,
``_compute_desc_ids(block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
region_num_blocks=None, region_group_ids=None, uses_region_group_mapping=None)``, which vLLM
calls twice per transfer (remote and local side) before ``make_prepped_xfer``. The replacement
hands vLLM's arguments and the worker attributes vLLM's method reads to
``kvplan._core.nixl_desc_ids`` unchanged; the core resolves the defaults, checks every block id
against its region and returns the same int64 ids vLLM's method returns (layer routing, flat
and region-group-mapped layouts, block-size ratios). ``uninstall`` restores exactly what was
there. docs/vllm.md has the account.

It declines, running vLLM's own method, when the model has Mamba state (another descriptor
layout, not in the core) or an argument is of a kind the core does not model (block ids that
are not ints, counts that are not Python ints). What it refuses that vLLM's method does not: a
block id outside its region (vLLM would return the id of another region's descriptor), a
negative one or one past int32 (:class:`kvplan.IndexBoundsError`, with the group, position, id
and region); counts and regions that do not fit together, where vLLM asserts
(:class:`kvplan.LayoutError`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from kvplan._core import nixl_desc_ids
from kvplan.compat._methods import MethodPatches

__all__ = ["install", "uninstall", "installed", "REPLACED_METHODS", "is_nixl_worker",
           "connector_class", "CONNECTOR_NAME"]

# A child of vLLM's "vllm" logger: inside a vLLM process its INFO lines go through vLLM's own
# handler, as the connector's do; elsewhere it is a plain logger.
logger = logging.getLogger("vllm.kvplan.nixl")

_BASE = "NixlBaseConnectorWorker"
_NAME = "_compute_desc_ids"


def is_nixl_worker(cls: type) -> bool:
    """Whether ``cls`` is vLLM's ``NixlBaseConnectorWorker`` or a subclass of it."""
    return any(k.__name__ == _BASE for k in cls.__mro__)


def _compute_desc_ids(self: Any, block_ids: Any, dst_num_blocks: int,
                      block_size_ratio: float | None, physical_blocks_per_logical: int,
                      region_num_blocks: list[int] | None = None,
                      region_group_ids: list[int] | None = None,
                      uses_region_group_mapping: bool | None = None) -> Any:
    try:
        attention_only = not self._has_mamba
        if attention_only:
            worker = (self._transfer_layer_group_ids, self.num_regions,
                      len(self.block_len_per_layer), self.region_group_ids,
                      self._uses_region_group_mapping)
    except AttributeError:  # a partly built worker: vLLM's method fails (or not) its own way
        attention_only = False
    if attention_only:
        layer_groups, num_regions, num_layers, worker_groups, worker_grouped = worker
        ids = nixl_desc_ids(
            block_ids, num_blocks=dst_num_blocks, block_size_ratio=block_size_ratio,
            region_num_blocks=region_num_blocks, layer_groups=layer_groups,
            num_regions=num_regions, num_layers=num_layers, region_groups=region_group_ids,
            worker_region_groups=worker_groups, grouped=uses_region_group_mapping,
            worker_grouped=worker_grouped)
        if ids is not None:
            if not _first_call_logged:
                _log_first_call(len(ids))
            return ids
    return _vllm_method(self.__class__)(
        self, block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
        region_num_blocks, region_group_ids, uses_region_group_mapping)


_first_call_logged = False


def _log_first_call(n_ids: int) -> None:
    """Once per process, so a server's log shows kvplan computing the ids (the e2e reads it)."""
    global _first_call_logged
    _first_call_logged = True
    logger.info("kvplan computes vLLM's NIXL descriptor ids (first request: %d ids)", n_ids)


_VLLM: dict[type, Any] = {}


def _vllm_method(cls: type) -> Any:
    """The ``_compute_desc_ids`` that ``cls`` resolves to without kvplan's: down its MRO, a
    class's own method, or, for a class kvplan patched, the one it held before (vLLM's, or a
    subclass's override)."""
    method = _VLLM.get(cls)
    if method is None:
        for klass in cls.__mro__:
            candidate = klass.__dict__.get(_NAME)
            if candidate is _compute_desc_ids:
                candidate = _PATCHES.replaced(klass, _NAME)
            if candidate is not None:
                method = _VLLM[cls] = candidate
                break
        else:
            raise TypeError(f"{cls.__name__} has no {_NAME} of vLLM's")
    return method


_PATCHES = MethodPatches({_NAME: _compute_desc_ids})
REPLACED_METHODS = tuple(_PATCHES.replacements)


def install(worker_class: type) -> tuple[str, ...]:
    """Replace ``worker_class``'s ``_compute_desc_ids``; returns the names replaced (none when
    already installed)."""
    if not is_nixl_worker(worker_class):
        raise TypeError(f"{worker_class.__name__} is not vLLM's {_BASE} (or a subclass)")
    _vllm_method(worker_class)  # fails now, not per request, on a class without vLLM's method
    _VLLM.clear()  # every class resolves afresh after a change
    return _PATCHES.install(worker_class)


def uninstall(worker_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``worker_class``."""
    _VLLM.clear()
    return _PATCHES.uninstall(worker_class)


def installed(worker_class: type) -> tuple[str, ...]:
    return _PATCHES.installed(worker_class)


# ---------------------------------------------------------------------------------------------
# The connector class for vLLM's factory (built on first access: vLLM is imported then)
# ---------------------------------------------------------------------------------------------
#: The name vLLM's ``--kv-transfer-config`` uses for kvplan's NIXL connector.
CONNECTOR_NAME = "KvplanNixlConnector"
_VLLM_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_CONNECTOR: type | None = None


def connector_class() -> type:
    """``KvplanNixlConnector``: vLLM's pull-mode ``NixlConnector`` whose worker computes the
    descriptor ids with kvplan. Everything else (handshake, registration, reads,
    notifications, failure handling) is vLLM's."""
    global _CONNECTOR
    if _CONNECTOR is None:
        nixl = importlib.import_module(_VLLM_NIXL)

        class KvplanNixlConnectorWorker(nixl.NixlPullConnectorWorker):  # type: ignore[misc,name-defined]
            """vLLM's NIXL pull worker with kvplan's descriptor ids."""

        install(KvplanNixlConnectorWorker)

        class KvplanNixlConnector(nixl.NixlPullConnector):  # type: ignore[misc,name-defined]
            """vLLM's ``NixlConnector`` (pull mode) whose worker takes its descriptor ids from
            kvplan's core."""

            def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
                super().__init__(vllm_config, role, kv_cache_config)
                if self.connector_worker is not None:
                    # vLLM's constructor names its worker class; the subclass adds no state.
                    self.connector_worker.__class__ = KvplanNixlConnectorWorker

        KvplanNixlConnector.__module__ = "kvplan.compat.vllm"
        KvplanNixlConnectorWorker.__module__ = "kvplan.compat.vllm"
        KvplanNixlConnector.Worker = KvplanNixlConnectorWorker
        _CONNECTOR = KvplanNixlConnector
    return _CONNECTOR
