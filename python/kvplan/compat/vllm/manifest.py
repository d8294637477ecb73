"""The model manifest a vLLM worker checks at start-up (docs/manifests.md, "Checked at
start-up").

``KvplanMooncakeConnector`` takes ``kvplan_manifest`` in ``kv_connector_extra_config``: a preset
key, ``key:layers`` or the path of a JSON manifest (:func:`kvplan.presets.load_manifest`,
parsed with the connector's other kvplan options when it is built: a bad value refuses
there). Once vLLM's
``register_kv_caches`` recorded the worker's regions, :func:`check_worker_manifest` checks that
the worker's layout (``kvplan.compat.vllm.staging.worker_layout``: its regions by vLLM's layer
index, block bytes and TP and PP coordinates) holds the whole manifest on the layers of its PP
stage, the stage vLLM's model config gives (``get_layers_start_end_indices``). The core's
:func:`kvplan.check_manifest` decides.

A manifest names each entry's role, and vLLM's regions carry none: an MLA latent's region is
the one kind whose role vLLM's own spec says (an ``MLAAttentionSpec`` layer registers one
region, its latent: role ``kv``). A worker with any other region (K and V packed in one page,
Mamba pages holding every state of a layer, an indexer beside a latent on one layer) cannot be
checked, and with ``kvplan_manifest`` set it refuses to start, saying so, rather than report
components that are there as missing.
"""

from __future__ import annotations

import logging
from typing import Any

import kvplan
from kvplan._core import ManifestError
from kvplan.manifests import check_at_start_up

__all__ = ["MANIFEST_ATTR", "OPTION", "check_worker_manifest", "worker_manifest_layout",
           "worker_stage"]

#: The ``kv_connector_extra_config`` key naming the manifest.
OPTION = "kvplan_manifest"
#: The worker attribute holding the parsed manifest (set by the connector).
MANIFEST_ATTR = "_kvplan_manifest"

logger = logging.getLogger("vllm.kvplan.manifest")


def _is_latent(spec: Any) -> bool:
    return type(spec).__name__ == "MLAAttentionSpec"


def worker_manifest_layout(worker: Any, engine: str) -> kvplan.Layout:
    """The worker's layout with each region's role, as vLLM's layer specs say it: one
    ``MLAAttentionSpec`` region per layer is that layer's latent (``kv``).

    Raises:
        ManifestError: No registered regions, or a region whose role vLLM does not say (naming
            the layer, its spec and why), logged at ERROR first.
    """
    from kvplan.compat.vllm.staging import worker_layout

    d = worker.__dict__
    names = list(d.get("registered_layer_names") or ())
    specs = d.get("_layer_specs") or {}
    ids = list(d.get("registered_layer_indices") or ())
    why = ""
    seen: set[int] = set()
    for name, layer in zip(names, ids):
        spec = specs.get(name)
        if not _is_latent(spec):
            why = (f"vLLM registered layer {name!r} ({type(spec).__name__}) as a region "
                   f"whose entries' roles it does not say (K and V in one page, or a Mamba "
                   f"page holding every state of the layer)")
            break
        if layer in seen:
            why = f"vLLM registered several regions on layer {layer} ({name!r})"
            break
        seen.add(layer)
    layout = worker_layout(worker) if not why else None
    if layout is None and not why:
        why = "the worker has no registered regions"
    if layout is None:
        err = ManifestError(
            f"kvplan: {engine}: cannot check the manifest at start-up: {why}; kvplan checks a "
            f"manifest on vLLM where every registered region is one layer's MLA latent. Remove "
            f"{OPTION} to start without the check")
        logger.error("%s", err)
        raise err
    raw = layout.to_dict()
    raw["roles"] = ["kv"] * layout.n_entries
    return kvplan.Layout.from_dict(raw)


def worker_stage(worker: Any, layout: kvplan.Layout) -> tuple[int, int] | None:
    """The global layers of the worker's PP stage as vLLM's model config gives them
    (``model_config.get_layers_start_end_indices(parallel_config)``, the range vLLM builds the
    stage's model from); None at PP size 1, or when the config cannot say (the core then
    refuses a layout of several stages: a stage's layers are not guessed)."""
    if layout.pp_size <= 1:
        return None
    config = worker.__dict__.get("vllm_config")
    model_config = getattr(config, "model_config", None)
    get = getattr(model_config, "get_layers_start_end_indices", None)
    if get is None:
        return None
    start, end = get(getattr(config, "parallel_config", None))
    return int(start), int(end)


def check_worker_manifest(worker: Any, engine: str = "KvplanMooncakeConnector") -> bool:
    """Check the worker's layout against the manifest its connector was configured with
    (:data:`MANIFEST_ATTR`); False when none was (nothing checked), True when it holds.

    Raises:
        ManifestError: A layout the core refuses, or one this check cannot read (one ERROR
            line first, naming the model, the components and this rank's TP and PP
            coordinates).
    """
    manifest = worker.__dict__.get(MANIFEST_ATTR)
    if manifest is None:
        return False
    where = f"{engine} ({OPTION})"
    layout = worker_manifest_layout(worker, where)
    check_at_start_up(layout, manifest, stage=worker_stage(worker, layout), engine=where,
                      log=logger)
    return True
