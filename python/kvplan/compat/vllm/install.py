"""``install`` / ``uninstall`` / ``installed`` on a vLLM connector worker class: the Mooncake
worker's two methods (:mod:`.plan`, :mod:`.submit`) after the host check of :mod:`.forms`, or
the NIXL worker's descriptor ids (:mod:`.nixl`).
"""

from __future__ import annotations

from typing import Any

from kvplan.compat._methods import MethodPatches
from kvplan.compat.vllm import forms, nixl
from kvplan.compat.vllm.plan import _build_transfer_params
from kvplan.compat.vllm.submit import DEFAULT_MAX_BLOCKS_PER_BATCH, _send_blocks

_PATCHES = MethodPatches({"_build_transfer_params": _build_transfer_params,
                          "_send_blocks": _send_blocks})
REPLACED_METHODS = tuple(_PATCHES.replacements)
_CAP = "kvplan_max_blocks_per_batch"
_MISSING = object()
_SAVED_CAPS: dict[type, Any] = {}


def install(worker_class: type, *,
            max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH) -> tuple[str, ...]:
    """Replace planning methods of a vLLM connector worker class; returns the names replaced
    (none when already installed).

    * ``MooncakeConnectorWorker`` (or a subclass): ``_build_transfer_params`` and
      ``_send_blocks``; ``max_blocks_per_batch`` caps one ``batch_transfer_sync_write``.
    * ``NixlBaseConnectorWorker`` (``NixlConnectorWorker``, the pull and push workers, or a
      subclass): ``_compute_desc_ids`` (:mod:`kvplan.compat.vllm.nixl`); NIXL takes a whole
      request at once, so ``max_blocks_per_batch`` must be left at its default.

    A host whose methods (or the vLLM helpers kvplan's replacements call) are not in a form
    kvplan was built for is refused with :class:`kvplan.IncompatibleHostError` (the class,
    the method, the host's vLLM version, the signature seen and the supported ones; see
    :mod:`kvplan.compat.vllm.forms`) and nothing is replaced.
    """
    if max_blocks_per_batch <= 0:
        raise ValueError(f"max_blocks_per_batch must be positive, got {max_blocks_per_batch}")
    if nixl.is_nixl_worker(worker_class):
        if max_blocks_per_batch != DEFAULT_MAX_BLOCKS_PER_BATCH:
            raise ValueError(f"max_blocks_per_batch={max_blocks_per_batch}: the NIXL drop-in "
                             "sends no batches (it replaces the descriptor-id computation)")
        return nixl.install(worker_class)
    if not any(k.__name__ == "MooncakeConnectorWorker" for k in worker_class.__mro__):
        raise TypeError(f"{worker_class.__name__} is not vLLM's MooncakeConnectorWorker "
                        "or NixlBaseConnectorWorker (or a subclass)")
    # a host method of a form kvplan was not built for: IncompatibleHostError, nothing replaced
    forms.check_mooncake(worker_class, _PATCHES.original)
    replaced = _PATCHES.install(worker_class)
    if replaced:  # what the class itself held, put back by uninstall
        _SAVED_CAPS[worker_class] = worker_class.__dict__.get(_CAP, _MISSING)
    setattr(worker_class, _CAP, max_blocks_per_batch)
    return replaced


def uninstall(worker_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``worker_class``."""
    if nixl.is_nixl_worker(worker_class):
        return nixl.uninstall(worker_class)
    restored = _PATCHES.uninstall(worker_class)
    if worker_class in _SAVED_CAPS:
        saved = _SAVED_CAPS.pop(worker_class)
        if saved is _MISSING:
            delattr(worker_class, _CAP)
        else:
            setattr(worker_class, _CAP, saved)
    return restored


def installed(worker_class: type) -> tuple[str, ...]:
    """The method names :func:`install` replaced on ``worker_class`` (empty when none)."""
    if nixl.is_nixl_worker(worker_class):
        return nixl.installed(worker_class)
    return _PATCHES.installed(worker_class)
