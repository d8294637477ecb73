"""The model manifest a vLLM worker checks at start-up (docs/manifests.md, "Checked at
start-up").

``KvplanMooncakeConnector`` and ``KvplanNixlConnector`` take ``kvplan_manifest`` in
``kv_connector_extra_config``: a preset key, ``key:layers`` or the path of a JSON manifest
(:func:`kvplan.presets.load_manifest`, parsed with the connector's other kvplan options when it
is built: a bad value refuses there). Once vLLM's ``register_kv_caches`` recorded the worker's
regions, :func:`check_worker_manifest` checks that the worker's layout (its regions by layer
id, block bytes, KV heads and TP and PP coordinates) holds the whole manifest on the layers of
its PP stage, the stage vLLM's model config gives (``get_layers_start_end_indices``). The
core's :func:`kvplan.check_manifest` decides.

A manifest names each entry's role, and vLLM's regions carry none: the adapter names them from
vLLM's layer specs, and nothing else. vLLM registers one region per attention layer (its
``register_kv_caches`` takes a block as one page of ``[heads, tokens, content]`` or
``[tokens, heads, content]`` cells, the content of an attention cell being the head's K then
its V), so:

* an ``MLAAttentionSpec`` region is the layer's latent: role ``kv``;
* a ``FullAttentionSpec`` or ``SlidingWindowSpec`` region holds the layer's K and V packed in
  each page: role ``kv``, and the manifest is checked as
  :meth:`kvplan.ModelManifest.packed` ``("kv", ("k", "v"))`` (a layer's K and V components
  merged into one of their summed bytes, its heads and window kept);
* a spec's ``sliding_window`` is the region's window (a ``FullAttentionSpec`` records it when
  vLLM's hybrid allocator is off).

Any other region (a Mamba page holding every state of a layer, an indexer or a compressed cache
beside a latent, a sliding-window MLA row, a layer split into several regions) cannot be named,
and with ``kvplan_manifest`` set the worker refuses to start, saying why, rather than report
components that are there as missing. The layout checked is the one kvplan plans the worker
with (``kvplan.compat.vllm.staging.worker_layout``, read by ``staging.manifest_layout``; for
``KvplanNixlConnector`` ``kvplan.compat.vllm.nixl.worker_layout``, read by
``nixl.manifest_layout``), given these roles, windows and, for NIXL (whose regions publish
their layer names only), the layer ids vLLM's ``extract_layer_index`` reads from the names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kvplan
from kvplan._core import ManifestError
from kvplan.manifests import check_at_start_up

__all__ = ["LATENT_SPECS", "MANIFEST_ATTR", "OPTION", "PACKED_SPECS", "check_worker_manifest",
           "roles_layout", "worker_stage"]

#: The ``kv_connector_extra_config`` key naming the manifest.
OPTION = "kvplan_manifest"
#: The worker attribute holding the parsed manifest (set by the connector).
MANIFEST_ATTR = "_kvplan_manifest"

logger = logging.getLogger("vllm.kvplan.manifest")


#: The layer specs whose region is a layer's MLA latent (role ``kv``), by exact class name
#: (vLLM's subclasses of them hold other contents).
LATENT_SPECS = ("MLAAttentionSpec",)
#: The layer specs whose region holds a layer's K and V packed in each page (role ``kv`` of a
#: manifest packed from ``k`` and ``v``).
PACKED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")
#: What a packed region holds: the manifest transformation the check applies.
PACKED_ROLE, PACKED_PARTS = "kv", ("k", "v")


def roles_layout(layout: kvplan.Layout | None, names: Sequence[str], ids: Sequence[int],
                 specs: Mapping[str, Any], engine: str,
                 no_layout: str) -> tuple[kvplan.Layout, bool]:
    """``layout`` (one entry per registered region, in the order of ``names``: the regions'
    layer names, ``ids``: their layer ids) with each region's role and window as its layer's
    spec in ``specs`` says them, and whether a region packs K and V (the manifest is then
    checked packed, :data:`PACKED_ROLE` from :data:`PACKED_PARTS`).

    Raises:
        ManifestError: No layout (``no_layout`` says why), no registered regions, a region
            whose role vLLM does not say (naming the layer, its spec and why), or several
            regions on one layer; logged at ERROR first.
    """
    why = ""
    packed = False
    seen: set[int] = set()
    windows: list[int | None] = []
    for name, layer in zip(names, ids):
        spec = specs.get(name)
        kind = type(spec).__name__
        if kind in PACKED_SPECS:
            packed = True
        elif kind not in LATENT_SPECS:
            why = (f"vLLM registered layer {name!r} ({kind}) as a region whose entries' roles "
                   f"it does not say (kvplan names an MLA latent ({', '.join(LATENT_SPECS)}) "
                   f"and K and V packed in one page ({', '.join(PACKED_SPECS)}); a Mamba page "
                   f"holds every state of its layer)")
            break
        if layer in seen:
            why = (f"vLLM registered several regions on layer {layer} ({name!r}): a layer's "
                   f"page split into regions holds no whole component")
            break
        seen.add(layer)
        window = getattr(spec, "sliding_window", None)
        windows.append(None if window is None else int(window))
    if not why and not names:
        why = "the worker has no registered regions"
    if not why and len(ids) != len(names):
        why = f"{len(names)} registered regions with {len(ids)} layer ids"
    if not why and layout is None:
        why = no_layout
    if not why and layout is not None and layout.n_entries != len(names):
        why = (f"its layout has {layout.n_entries} entries for {len(names)} registered "
               f"regions")
    if why or layout is None:
        err = ManifestError(
            f"kvplan: {engine}: cannot check the manifest at start-up: {why}; kvplan checks a "
            f"manifest on vLLM where every registered region is one layer's MLA latent or its "
            f"K and V. Remove {OPTION} to start without the check")
        logger.error("%s", err)
        raise err
    raw = layout.to_dict()
    raw["roles"] = [PACKED_ROLE] * layout.n_entries
    raw["layer_ids"] = [int(i) for i in ids]
    out = kvplan.Layout.from_dict(raw)
    if any(w is not None for w in windows):
        out = out.with_windows(windows)
    return out, packed


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


def check_worker_manifest(worker: Any, engine: str,
                          read: Callable[[Any, str], tuple[kvplan.Layout, bool]]) -> bool:
    """Check the worker's layout against the manifest its connector was configured with
    (:data:`MANIFEST_ATTR`); False when none was (nothing checked), True when it holds. A
    worker whose regions pack K and V is checked against the manifest packed the same way
    (:meth:`kvplan.ModelManifest.packed`). ``read(worker, engine)`` gives the worker's layout
    and whether it packs K and V (:func:`roles_layout` of it):
    ``kvplan.compat.vllm.staging.manifest_layout`` for a Mooncake worker,
    ``kvplan.compat.vllm.nixl.manifest_layout`` for a NIXL one.

    Raises:
        ManifestError: A layout the core refuses, one this check cannot read, or a manifest
            whose K and V cannot be packed (one ERROR line first, naming the model, the
            components and this rank's TP and PP coordinates).
    """
    manifest = worker.__dict__.get(MANIFEST_ATTR)
    if manifest is None:
        return False
    where = f"{engine} ({OPTION})"
    layout, packed = read(worker, where)
    if packed:
        try:
            manifest = manifest.packed(PACKED_ROLE, PACKED_PARTS)
        except ManifestError as err:
            refusal = ManifestError(f"kvplan: {where}: vLLM keeps each attention layer's K and "
                                    f"V in one region, refusing to start: {err}")
            refusal.model = manifest.model
            logger.error("%s", refusal)
            raise refusal from err
    check_at_start_up(layout, manifest, stage=worker_stage(worker, layout), engine=where,
                      log=logger)
    return True
