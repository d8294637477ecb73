"""vLLM NIXL connector: kvplan's core computes the per-request NIXL descriptor ids.

``kvplan.compat.vllm.install(NixlConnectorWorker)`` (or any subclass of vLLM's
``NixlBaseConnectorWorker``: the pull and push workers) lands here. It replaces one method,
``_compute_desc_ids``, which vLLM calls twice per transfer (remote and local side) before
``make_prepped_xfer``, in one of the two forms kvplan knows (:data:`SUPPORTED_FORMS`):

* vLLM 0.32 / 0.33: ``(block_ids, dst_num_blocks, block_size_ratio,
  physical_blocks_per_logical, region_num_blocks=None, region_group_ids=None,
  uses_region_group_mapping=None)``;
* vLLM 0.34: ``(block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
  pairs, region_num_blocks=None, ssm_regions=None)``, ``pairs`` being the handshake's
  ``(regions, keys)``.

The replacement for the host's form hands vLLM's arguments and the worker attributes vLLM's
method reads to ``kvplan._core.nixl_desc_ids`` unchanged; the core resolves the defaults,
checks every block id against its region and returns the same int64 ids vLLM's method returns
(layer routing, flat, region-group-mapped and paired layouts, block-size ratios).
``uninstall`` restores exactly what was there. A host whose method has any other signature, or
no longer reads the worker attributes the replacement reads, is refused at install time with
:class:`kvplan.IncompatibleHostError` and nothing is replaced. docs/vllm.md has the account.

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
from kvplan.compat.vllm import forms
from kvplan.compat._methods import MethodPatches, require_method
from kvplan.failures import FailureVerdict, verdict_for_plan

__all__ = ["install", "uninstall", "installed", "REPLACED_METHODS", "is_nixl_worker",
           "connector_class", "CONNECTOR_NAME", "SUPPORTED_FORMS", "host_form",
           "report_load_failure", "report_failed_batch", "kv_cache_group_count"]

# A child of vLLM's "vllm" logger: inside a vLLM process its INFO lines go through vLLM's own
# handler, as the connector's do; elsewhere it is a plain logger.
logger = logging.getLogger("vllm.kvplan.nixl")

_BASE = "NixlBaseConnectorWorker"
_NAME = "_compute_desc_ids"


def is_nixl_worker(cls: type) -> bool:
    """Whether ``cls`` is vLLM's ``NixlBaseConnectorWorker`` or a subclass of it."""
    return any(k.__name__ == _BASE for k in cls.__mro__)


def _worker_ids(self: Any, block_ids: Any, read_worker: Any, **arguments: Any) -> Any:
    """The core's ids for an attention-only worker, or None when vLLM's own method must run.

    ``read_worker`` reads the worker attributes the host's form needs; a partly built worker
    (an attribute missing) declines, so vLLM's method fails (or not) its own way.
    """
    try:
        if self._has_mamba:
            return None
        worker = read_worker(self)
    except AttributeError:
        return None
    ids = nixl_desc_ids(block_ids, **worker, **arguments)
    if ids is not None and not _first_call_logged:
        _log_first_call(len(ids))
    return ids


def _region_group_worker(self: Any) -> dict[str, Any]:
    return {"layer_groups": self._transfer_layer_group_ids, "num_regions": self.num_regions,
            "num_layers": len(self.block_len_per_layer),
            "worker_region_groups": self.region_group_ids,
            "worker_grouped": self._uses_region_group_mapping}


def _paired_worker(self: Any) -> dict[str, Any]:
    return {"layer_groups": (), "num_regions": self.num_regions,
            "num_layers": len(self.block_len_per_layer), "worker_region_groups": (),
            "worker_grouped": False}


def _compute_desc_ids(self: Any, block_ids: Any, dst_num_blocks: int,
                      block_size_ratio: float | None, physical_blocks_per_logical: int,
                      region_num_blocks: list[int] | None = None,
                      region_group_ids: list[int] | None = None,
                      uses_region_group_mapping: bool | None = None) -> Any:
    """vLLM 0.32 / 0.33's form: layer routing, flat or region-group-mapped ids."""
    ids = _worker_ids(self, block_ids, _region_group_worker, num_blocks=dst_num_blocks,
                      block_size_ratio=block_size_ratio, region_num_blocks=region_num_blocks,
                      region_groups=region_group_ids, grouped=uses_region_group_mapping)
    if ids is not None:
        return ids
    return _vllm_method(self.__class__)(
        self, block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
        region_num_blocks, region_group_ids, uses_region_group_mapping)


def _compute_paired_desc_ids(self: Any, block_ids: Any, dst_num_blocks: int,
                             block_size_ratio: float | None, physical_blocks_per_logical: int,
                             pairs: Any, region_num_blocks: list[int] | None = None,
                             ssm_regions: Any = None) -> Any:
    """vLLM 0.34's form: the handshake's region pairs ``(regions, keys)`` name which region
    reads which block list."""
    ids = _worker_ids(self, block_ids, _paired_worker, num_blocks=dst_num_blocks,
                      block_size_ratio=block_size_ratio, region_num_blocks=region_num_blocks,
                      region_groups=None, grouped=None, pairs=pairs)
    if ids is not None:
        return ids
    return _vllm_method(self.__class__)(
        self, block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
        pairs, region_num_blocks, ssm_regions)


_first_call_logged = False


def _log_first_call(n_ids: int) -> None:
    """Once per process, so a server's log shows kvplan computing the ids (the e2e reads it)."""
    global _first_call_logged
    _first_call_logged = True
    logger.info("kvplan computes vLLM's NIXL descriptor ids (first request: %d ids)", n_ids)


#: vLLM's ``_compute_desc_ids`` signatures kvplan replaces, with the releases each was
#: checked against (byte for byte, tests/compat/test_vllm_nixl.py), and kvplan's replacement.
FORM_BY_REGION_GROUP = ("(self, block_ids, dst_num_blocks, block_size_ratio, "
                        "physical_blocks_per_logical, region_num_blocks=None, "
                        "region_group_ids=None, uses_region_group_mapping=None)")
FORM_BY_PAIRS = ("(self, block_ids, dst_num_blocks, block_size_ratio, "
                 "physical_blocks_per_logical, pairs, region_num_blocks=None, ssm_regions=None)")
SUPPORTED_FORMS = {FORM_BY_REGION_GROUP: "vLLM 0.32.0, 0.33.0", FORM_BY_PAIRS: "vLLM 0.34.0"}
# The worker attributes each replacement reads: vLLM's method of that form must read them too,
# or the release keeps the signature but not the attributes (and every call would decline).
_READS = {
    FORM_BY_REGION_GROUP: ("_has_mamba", "_transfer_layer_group_ids", "num_regions",
                           "block_len_per_layer", "region_group_ids",
                           "_uses_region_group_mapping"),
    FORM_BY_PAIRS: ("_has_mamba", "num_regions", "block_len_per_layer"),
}
_PATCHES_BY_FORM = {FORM_BY_REGION_GROUP: MethodPatches({_NAME: _compute_desc_ids}),
                    FORM_BY_PAIRS: MethodPatches({_NAME: _compute_paired_desc_ids})}
_REPLACEMENTS = {id(patches.replacements[_NAME]): patches
                 for patches in _PATCHES_BY_FORM.values()}
REPLACED_METHODS = (_NAME,)

_VLLM: dict[type, Any] = {}


def _host_method(cls: type) -> Any:
    """The ``_compute_desc_ids`` that ``cls`` resolves to without kvplan's: down its MRO, a
    class's own method, or, for a class kvplan patched, the one it held before (vLLM's, or a
    subclass's override); ``None`` when there is none."""
    for klass in cls.__mro__:
        candidate = klass.__dict__.get(_NAME)
        patches = _REPLACEMENTS.get(id(candidate))
        if patches is not None:
            candidate = patches.replaced(klass, _NAME)
        if candidate is not None:
            return candidate
    return None


def _vllm_method(cls: type) -> Any:
    method = _VLLM.get(cls)
    if method is None:
        method = _host_method(cls)
        if method is None:
            raise TypeError(f"{cls.__name__} has no {_NAME} of vLLM's")
        _VLLM[cls] = method
    return method


def host_form(worker_class: type) -> str:
    """The form of ``worker_class``'s ``_compute_desc_ids`` among :data:`SUPPORTED_FORMS`;
    :class:`kvplan.IncompatibleHostError` (naming the class, the method, the host's vLLM
    version, the signature seen and the supported ones) for any other."""
    if not is_nixl_worker(worker_class):
        raise TypeError(f"{worker_class.__name__} is not vLLM's {_BASE} (or a subclass)")
    return require_method(worker_class, _NAME, SUPPORTED_FORMS, "vLLM", reads=_READS,
                          resolved=_host_method(worker_class))


def install(worker_class: type) -> tuple[str, ...]:
    """Replace ``worker_class``'s ``_compute_desc_ids`` with kvplan's for the host's form;
    returns the names replaced (none when already installed). A host method of another form
    is refused (:func:`host_form`) and nothing is replaced."""
    form = host_form(worker_class)
    _VLLM.clear()  # every class resolves afresh after a change
    return _PATCHES_BY_FORM[form].install(worker_class)


def uninstall(worker_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``worker_class``."""
    _VLLM.clear()
    restored: tuple[str, ...] = ()
    for patches in _PATCHES_BY_FORM.values():
        restored += patches.uninstall(worker_class)
    return restored


def installed(worker_class: type) -> tuple[str, ...]:
    names: tuple[str, ...] = ()
    for patches in _PATCHES_BY_FORM.values():
        names += patches.installed(worker_class)
    return names


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
                # kvplan's options first: an unknown one refuses before anything starts
                forms.kvplan_options(vllm_config, CONNECTOR_NAME)
                super().__init__(vllm_config, role, kv_cache_config)
                if self.connector_worker is not None:
                    # vLLM's constructor names its worker class; the subclass adds no state.
                    self.connector_worker.__class__ = KvplanNixlConnectorWorker

        KvplanNixlConnector.__module__ = "kvplan.compat.vllm"
        KvplanNixlConnectorWorker.__module__ = "kvplan.compat.vllm"
        KvplanNixlConnector.Worker = KvplanNixlConnectorWorker
        _CONNECTOR = KvplanNixlConnector
    return _CONNECTOR


# ---------------------------------------------------------------------------------------------
# Failure verdicts into vLLM's own failed-load path
# ---------------------------------------------------------------------------------------------
def kv_cache_group_count(worker: Any) -> int:
    """The KV-cache groups of the worker's ``kv_cache_config`` (1 when it has none)."""
    config = getattr(worker, "kv_cache_config", None)
    groups = getattr(config, "kv_cache_groups", None)
    return len(groups) if groups else 1


def report_load_failure(worker: Any, verdict: FailureVerdict) -> str:
    """Feed ``verdict`` (a decode request's failed blocks, per KV-cache group) to the worker's
    own failed-load path, in the shape its release's scheduler takes, and say which:

    * ``"blocks"``: one KV-cache group. The failed block ids go into the worker's
      ``_invalid_block_ids`` queue, which ``get_block_ids_with_load_errors()`` drains for the
      scheduler's ``kv_load_failure_policy`` (``recompute`` truncates the request at its first
      invalid block, ``fail`` fails it). Only the failed blocks are named, not the request's.
    * ``"request"``: several groups. vLLM 0.32 and 0.34 schedulers refuse block-level errors
      there (block ids are per group, a flat set cannot name a group's block), so the request
      goes into ``_failed_recv_reqs``, the failed-receive path both releases' NIXL and 0.34's
      Mooncake workers drain into ``failed_recving``. The verdict's groups and blocks are
      logged.
    * ``"none"``: no block failed; nothing is reported.

    A worker without those queues (another connector or release) is an
    :class:`kvplan.IncompatibleHostError` naming the attribute.
    """
    if not verdict.failed:
        return "none"
    several = kv_cache_group_count(worker) > 1
    name = "_failed_recv_reqs" if several else "_invalid_block_ids"
    queue = worker.__dict__.get(name)
    if queue is None or not hasattr(queue, "put"):
        from kvplan._errors import IncompatibleHostError

        raise IncompatibleHostError(
            f"{type(worker).__name__} has no {name} queue: its release's failed-load path is "
            f"not the one kvplan feeds (vLLM 0.32-0.34 NIXL, 0.34 Mooncake)")
    if several:
        queue.put(verdict.request_id)
        logger.warning("kvplan: %s; reported as a failed request (several KV-cache groups)",
                       verdict)
        return "request"
    queue.put(set(verdict.group(0)))
    logger.warning("kvplan: %s; reported as invalid blocks", verdict)
    return "blocks"


def report_failed_batch(worker: Any, request_id: str, template: Any, plan: Any,
                        failed: Any, *, reason: str,
                        groups: dict[int, int] | None = None) -> FailureVerdict:
    """A transfer engine's failed submission of ``plan`` (blocks ``failed``: positions or
    ``(start, stop)`` ranges) for decode request ``request_id``: the verdict
    (:func:`kvplan.failures.verdict_for_plan`), fed to the worker by
    :func:`report_load_failure`, and returned."""
    verdict = verdict_for_plan(request_id, template, plan, failed, reason=reason, groups=groups)
    report_load_failure(worker, verdict)
    return verdict
