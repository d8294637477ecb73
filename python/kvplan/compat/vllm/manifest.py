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
vLLM's layer specs, and nothing else. vLLM registers one region per layer (its
``register_kv_caches`` takes an attention block as one page of ``[heads, tokens, content]`` or
``[tokens, heads, content]`` cells, the content of an attention cell being the head's K then
its V, and a Mamba block as one page holding every state tensor of the layer), so:

* an ``MLAAttentionSpec`` region is the layer's latent: role ``kv``;
* a ``FullAttentionSpec`` or ``SlidingWindowSpec`` region holds the layer's K and V packed in
  each page: role ``kv``, and the manifest is checked as
  :meth:`kvplan.ModelManifest.packed` ``("kv", ("k", "v"))`` (a layer's K and V components
  merged into one of their summed bytes, its heads and window kept);
* a ``MambaSpec`` region (Mamba2, GDN as in Qwen3-Next, KDA as in Kimi-Linear and Kimi-K3) is
  one state slot per page holding every state of its layer: a ``state`` entry whose item is
  the bytes of the spec's state tensors (``spec.shapes`` by ``spec.dtypes``' item sizes, the
  page's padding past them not counted), named after the manifest's state components joined
  by ``+`` (``mamba_conv+mamba_temporal``), and the manifest is checked packed the same way:
  :meth:`kvplan.ModelManifest.packed` of every state component into that one entry per layer
  (the core merges; a state the page does not hold, or another size, is refused naming the
  components and both sizes);
* a spec's ``sliding_window`` is the region's window (a ``FullAttentionSpec`` records it when
  vLLM's hybrid allocator is off).

A Mamba region whose state bytes cannot be read (a dtype without an item size, no state
tensors) or do not fit in its registered block is refused naming the layer and why. Any other
region (an indexer or a compressed cache beside a latent, a sliding-window MLA row, a layer
split into several regions) cannot be named, and with ``kvplan_manifest`` set the worker
refuses to start, saying why, rather than report components that are there as missing. The
layout checked is the one kvplan plans the worker with
(``kvplan.compat.vllm.staging.worker_layout``, read by ``staging.manifest_layout``; for
``KvplanNixlConnector`` ``kvplan.compat.vllm.nixl.worker_layout``, read by
``nixl.manifest_layout``), given these roles, kinds, windows and, for NIXL (whose regions
publish their layer names only), the layer ids vLLM's ``extract_layer_index`` reads from the
names. A NIXL worker with Mamba state registers one region per KV cache tensor, which a
hybrid model shares among a layer of each KV group: its layout has one entry per layer behind
each region (``kvplan.compat.vllm.nixl_layout.state_layout``), described here as the Mooncake
worker's regions are (:func:`region_roles`, which the NIXL worker's layout identity uses too);
where the layers behind its regions cannot be read it has no layout
(``kvplan.compat.vllm.nixl.NO_STATE_LAYOUT``), and with the key set it refuses, saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kvplan
from kvplan._core import ManifestError
from kvplan.manifests import check_at_start_up

__all__ = ["LATENT_SPECS", "MANIFEST_ATTR", "OPTION", "PACKED_SPECS", "STATE_SPECS",
           "check_worker_manifest", "region_roles", "roles_layout", "state_bytes", "worker_stage"]

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
#: The layer specs whose region holds every state of a layer in each page (one ``state`` entry
#: of a manifest packed from its state components).
STATE_SPECS = ("MambaSpec",)
#: What a packed region holds: the manifest transformation the check applies.
PACKED_ROLE, PACKED_PARTS = "kv", ("k", "v")
#: The role :func:`roles_layout` gives a Mamba region; :func:`check_worker_manifest` renames it
#: after the manifest's state components (``mamba_conv+mamba_temporal``).
STATE_ROLE = "state"


def state_bytes(spec: Any) -> int:
    """The bytes of the state tensors a ``MambaSpec`` page holds: each of ``spec.shapes``' element
    count times the item size of its dtype in ``spec.dtypes`` (``torch.dtype.itemsize``), summed
    (what ``MambaSpec.real_page_size_bytes`` counts, with neither the page's padding past the
    states, ``page_size_padded``, nor a state's alignment).

    Raises:
        ValueError: No state tensors, shapes and dtypes of other lengths, a dimension that is
            not a non-negative integer, or a dtype without a positive integer item size,
            naming it.
    """
    shapes = tuple(getattr(spec, "shapes", None) or ())
    dtypes = tuple(getattr(spec, "dtypes", None) or ())
    if not shapes or len(shapes) != len(dtypes):
        raise ValueError(f"its spec has {len(shapes)} state shapes and {len(dtypes)} dtypes")
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        size = getattr(dtype, "itemsize", None)
        if type(size) is not int or size <= 0:
            raise ValueError(f"its state dtype {dtype!r} has no item size kvplan can read")
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise ValueError(f"its state shape {shape!r} is not a tuple of sizes")
            count *= dim
        total += count * size
    return total


def region_roles(layout: kvplan.Layout | None, names: Sequence[str], ids: Sequence[int],
                 specs: Mapping[str, Any], no_layout: str
                 ) -> tuple[kvplan.Layout, frozenset[str]]:
    """``layout`` (one entry per registered region, in the order of ``names``: the regions'
    layer names, ``ids``: their layer ids) with each region's role, kind, item and window as
    its layer's spec in ``specs`` says them, and the packed roles it holds: :data:`PACKED_ROLE`
    where a region packs K and V (the manifest is then checked packed from
    :data:`PACKED_PARTS`), :data:`STATE_ROLE` where a region holds a layer's states (a
    ``state`` entry of :func:`state_bytes`, the registered block its stride). What both the
    manifest check (:func:`roles_layout`) and a NIXL worker's layout identity
    (``kvplan.compat.vllm.nixl.worker_identity``) describe a worker's regions by.

    Raises:
        ValueError: Saying why the regions cannot be described: no layout (``no_layout``), no
            registered regions, a region whose role vLLM does not say (naming the layer, its
            spec and why), a Mamba region whose states cannot be counted or do not fit its
            block (naming the layer, the sizes and why), or several regions on one layer.
    """
    why = ""
    packs: set[str] = set()
    seen: set[int] = set()
    windows: list[int | None] = []
    states: dict[int, int] = {}
    for k, (name, layer) in enumerate(zip(names, ids)):
        spec = specs.get(name)
        kind = type(spec).__name__
        if kind in PACKED_SPECS:
            packs.add(PACKED_ROLE)
        elif kind in STATE_SPECS:
            try:
                states[k] = state_bytes(spec)
            except ValueError as exc:
                why = (f"vLLM registered layer {name!r} ({kind}) as a page of states whose "
                       f"bytes kvplan cannot count: {exc}")
                break
            packs.add(STATE_ROLE)
        elif kind not in LATENT_SPECS:
            why = (f"vLLM registered layer {name!r} ({kind}) as a region whose entries' roles "
                   f"it does not say (kvplan names an MLA latent ({', '.join(LATENT_SPECS)}), "
                   f"K and V packed in one page ({', '.join(PACKED_SPECS)}) and every state "
                   f"of a layer in one page ({', '.join(STATE_SPECS)}))")
            break
        if layer in seen:
            why = (f"vLLM registered several regions on layer {layer} ({name!r}): a layer's "
                   f"page split into regions holds no whole component")
            break
        seen.add(layer)
        window = getattr(spec, "sliding_window", None)
        windows.append(None if window is None or kind in STATE_SPECS else int(window))
    if not why and not names:
        why = "the worker has no registered regions"
    if not why and len(ids) != len(names):
        why = f"{len(names)} registered regions with {len(ids)} layer ids"
    if not why and layout is None:
        why = no_layout
    if not why and layout is not None and layout.n_entries != len(names):
        why = (f"its layout has {layout.n_entries} entries for {len(names)} registered "
               f"regions")
    raw: dict[str, Any] = layout.to_dict() if layout is not None else {}
    if not why:
        for k, nbytes in states.items():
            block = int(raw["strides"][k])
            if nbytes > block:
                why = (f"vLLM registered layer {names[k]!r} ({type(specs.get(names[k])).__name__})"
                       f" with {block} B blocks, its spec's states needing {nbytes} B: the "
                       f"page does not hold them")
                break
    if why or layout is None:
        raise ValueError(why or no_layout)
    raw["roles"] = [STATE_ROLE if k in states else PACKED_ROLE for k in range(len(names))]
    raw["kinds"] = ["state" if k in states else "page" for k in range(len(names))]
    raw["item_lens"] = [states.get(k, int(n)) for k, n in enumerate(raw["item_lens"])]
    raw["layer_ids"] = [int(i) for i in ids]
    out = kvplan.Layout.from_dict(raw)
    if any(w is not None for w in windows):
        out = out.with_windows(windows)
    return out, frozenset(packs)


def roles_layout(layout: kvplan.Layout | None, names: Sequence[str], ids: Sequence[int],
                 specs: Mapping[str, Any], engine: str,
                 no_layout: str) -> tuple[kvplan.Layout, frozenset[str]]:
    """:func:`region_roles` of the worker's regions, for its manifest check.

    Raises:
        ManifestError: What :func:`region_roles` cannot describe, saying why and that
            removing :data:`OPTION` starts the worker without the check; logged at ERROR
            first.
    """
    try:
        return region_roles(layout, names, ids, specs, no_layout)
    except ValueError as exc:
        err = ManifestError(
            f"kvplan: {engine}: cannot check the manifest at start-up: {exc}; kvplan checks a "
            f"manifest on vLLM where every registered region is one layer's MLA latent, its "
            f"K and V, or its states. Remove {OPTION} to start without the check")
        logger.error("%s", err)
        raise err from None


def _state_parts(manifest: kvplan.ModelManifest) -> tuple[str, ...]:
    """The roles of the manifest's state components, in order (each once)."""
    return tuple(dict.fromkeys(c.role for c in manifest.components if c.kind == "state"))


def _renamed(layout: kvplan.Layout, old: str, new: str) -> kvplan.Layout:
    raw: dict[str, Any] = layout.to_dict()
    raw["roles"] = [new if r == old else r for r in raw["roles"]]
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


def check_worker_manifest(worker: Any, engine: str,
                          read: Callable[[Any, str], tuple[kvplan.Layout, frozenset[str]]]
                          ) -> bool:
    """Check the worker's layout against the manifest its connector was configured with
    (:data:`MANIFEST_ATTR`); False when none was (nothing checked), True when it holds. A
    worker whose regions pack K and V is checked against the manifest packed the same way
    (:meth:`kvplan.ModelManifest.packed`); one whose regions hold a layer's states against the
    manifest with every state component packed into one entry per layer, the entry named
    after them (``mamba_conv+mamba_temporal``: what a refusal names). ``read(worker, engine)``
    gives the worker's layout and the packed roles it holds (:func:`roles_layout` of it):
    ``kvplan.compat.vllm.staging.manifest_layout`` for a Mooncake worker,
    ``kvplan.compat.vllm.nixl.manifest_layout`` for a NIXL one.

    Raises:
        ManifestError: A layout the core refuses, one this check cannot read, or a manifest
            whose K and V, or whose states, cannot be packed (one ERROR line first, naming the
            model, the components and this rank's TP and PP coordinates).
    """
    manifest = worker.__dict__.get(MANIFEST_ATTR)
    if manifest is None:
        return False
    where = f"{engine} ({OPTION})"
    layout, packs = read(worker, where)
    packings: list[tuple[str, tuple[str, ...], str]] = []
    if PACKED_ROLE in packs:
        packings.append((PACKED_ROLE, PACKED_PARTS, "each attention layer's K and V"))
    if STATE_ROLE in packs:
        parts = _state_parts(manifest)
        if parts:
            role = "+".join(parts)
            layout = _renamed(layout, STATE_ROLE, role)
            packings.append((role, parts, "each Mamba layer's states"))
    for role, parts, what in packings:
        try:
            manifest = manifest.packed(role, parts)
        except ManifestError as err:
            refusal = ManifestError(f"kvplan: {where}: vLLM keeps {what} in one region, "
                                    f"refusing to start: {err}")
            refusal.model = manifest.model
            logger.error("%s", refusal)
            raise refusal from err
    check_at_start_up(layout, manifest, stage=worker_stage(worker, layout), engine=where,
                      log=logger)
    return True
