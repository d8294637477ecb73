"""The model manifest a manager checks at start-up (docs/manifests.md, "Checked at start-up").

With ``KVPLAN_MANIFEST`` set (a preset key, ``key:layers`` or the path of a JSON manifest,
:func:`kvplan.presets.load_manifest`), every manager :func:`install` hooked checks, once SGLang
registered its KV memory (``register_buffer_to_engine``, which SGLang calls once in the
manager's ``__init__``), that its own layout holds the whole manifest on its PP stage's layers:
the layout the drop-ins plan with (:func:`kvplan.compat.sglang.layouts.layout_from_kv_args`:
its page entries by role and layer id, its Mamba state entries, its attention TP rank and size)
and the stage SGLang's ``KVArgs`` says (``prefill_start_layer`` to ``prefill_end_layer``, at PP
sizes above 1). The core's :func:`kvplan.check_manifest` decides. A refusal raises
:class:`kvplan.ManifestError` out of the manager's constructor, so the server does not start,
after one ERROR line naming the model, the components and this rank's coordinates.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvplan._core import Layout, ManifestError
from kvplan.compat.sglang.settings import MANIFEST_ENV
from kvplan.compat.sglang.wrapping import unwrap, wrap
from kvplan.manifests import ModelManifest, check_at_start_up
from kvplan.presets import load_manifest

__all__ = ["check_manager_manifest", "configured_manifest", "hook_manifest", "manager_layout",
           "manager_stage", "unhook_manifest"]

_log = logging.getLogger("kvplan.compat.sglang")
_HOOKED = "register_buffer_to_engine"


def configured_manifest() -> ModelManifest | None:
    """The manifest ``KVPLAN_MANIFEST`` names; None when it is unset or empty.

    Raises:
        ManifestError: A value :func:`kvplan.presets.load_manifest` refuses (logged once at
            ERROR, naming the variable and the value).
    """
    value = os.environ.get(MANIFEST_ENV, "").strip()
    if not value:
        return None
    try:
        return load_manifest(value)
    except ManifestError as err:
        _log.error("kvplan: %s=%r: %s", MANIFEST_ENV, value, err)
        raise


def manager_layout(manager: Any, num_layers: int | None = None) -> Layout:
    """The manager's own layout as the drop-ins build it from its ``kv_args`` (roles, layer
    ids, Mamba state entries, attention TP rank and size, PP rank and size).

    With ``num_layers`` (the model's), a pool that publishes no layer ids (SGLang's per-layer
    MHA and MLA pools) gets its entries' layers from the pool's first layer
    (``prefill_start_layer``; 0 on a manager of one PP stage, which holds every layer) and its
    draft entries from ``num_layers`` up (:func:`kvplan.compat.sglang.layouts.pool_layer_ids`);
    a manager of several stages without a first layer keeps none."""
    from kvplan.compat.sglang.layouts import layout_from_kv_args

    pp_size = int(getattr(manager, "pp_size", 1) or 1)
    start = getattr(manager.kv_args, "prefill_start_layer", None)
    if not isinstance(start, int):
        start = 0 if pp_size == 1 else None
    return layout_from_kv_args(
        manager.kv_args, is_mla_backend=bool(getattr(manager, "is_mla_backend", False)),
        pp_size=pp_size, attn_tp_size=int(getattr(manager, "attn_tp_size", 1) or 1),
        layer_ids_from=None if num_layers is None or start is None else (start, num_layers))


def manager_stage(manager: Any, layout: Layout) -> tuple[int, int] | None:
    """The global layers of the manager's PP stage as SGLang's ``KVArgs`` gives them
    (``prefill_start_layer`` up to ``prefill_end_layer``, exclusive, as SGLang's transfer code
    reads them); None at PP size 1 (the whole model), or when ``KVArgs`` does not say both (the
    core then refuses a layout of several stages: a stage's layers are not guessed)."""
    if layout.pp_size <= 1:
        return None
    start = getattr(manager.kv_args, "prefill_start_layer", None)
    end = getattr(manager.kv_args, "prefill_end_layer", None)
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    return start, end


def check_manager_manifest(manager: Any) -> bool:
    """Check the manager's layout against ``KVPLAN_MANIFEST``'s manifest; False when the
    variable is unset (nothing checked), True when the layout holds it.

    Raises:
        ManifestError: A bad ``KVPLAN_MANIFEST`` value, or a layout the core refuses (one
            ERROR line first, naming the model, every missing or mismatched component and this
            rank's TP and PP coordinates).
    """
    manifest = configured_manifest()
    if manifest is None:
        return False
    layout = manager_layout(manager, manifest.num_layers)
    check_at_start_up(layout, manifest, stage=manager_stage(manager, layout),
                      engine=f"SGLang {type(manager).__name__} ({MANIFEST_ENV})", log=_log)
    return True


def hook_manifest(manager_class: type) -> bool:
    """Wrap ``manager_class.register_buffer_to_engine`` so that :func:`check_manager_manifest`
    runs right after it (before anything kvplan starts on the manager); False when already
    wrapped or the class has no such method."""

    def make(original: Any) -> Any:
        def register_buffer_to_engine(self: Any) -> None:
            original(self)
            check_manager_manifest(self)

        return register_buffer_to_engine

    return wrap(manager_class, _HOOKED, "_kvplan_manifest", make)


def unhook_manifest(manager_class: type) -> None:
    """Restore what :func:`hook_manifest` wrapped (call after any wrapper put on top of it was
    taken off)."""
    unwrap(manager_class, _HOOKED, "_kvplan_manifest")
