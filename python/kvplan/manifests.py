"""Model manifests: every component a model has, checked against one peer's layout
(docs/manifests.md).

A :class:`ModelManifest` is plain data: per component its role, whether its entries are page or
state entries, the global layers that hold it, its item bytes at TP 1 (per token, per row of a
compressed cache, or per state slot), how TP shards it, and its window or ring.
:func:`check_manifest` asks the core (``rules::manifest``) whether a layout holds all of it on
the layers of its PP stage, at its TP coordinates, and nothing else; otherwise it raises
:class:`ManifestError` naming the model and, per problem, the component, its layers and both
values. Pairing cannot see a component that both peers leave out; a manifest can.

Presets derive their manifests from their own component specs (``ModelPreset.manifest()``), so
a preset's layouts and its manifest cannot drift apart. A manifest is also plain JSON
(:meth:`ModelManifest.to_dict` / :meth:`ModelManifest.from_dict`, docs/manifests.md has the
schema), and :func:`kvplan.presets.load_manifest` reads what an engine's configuration names
(a preset key or a JSON file); the engines' drop-ins check it once per worker at start-up
(:func:`check_at_start_up`).

Engines do not all cut a layer's state into the same tensors (SGLang and vLLM keep a KDA
layer's q, k and v short-convolution states as one tensor, others keep three). A manifest
declares such alternatives as data (:class:`Fusion`: these parts may be held as one entry of
this role), and the core's check decides which form a layout holds and checks it against that
form, never a union of both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from kvplan._core import Layout, ManifestError
from kvplan._core import check_manifest as _check_manifest
from kvplan._core import pack_manifest as _pack_manifest

__all__ = ["Fusion", "ManifestComponent", "ManifestError", "ModelManifest", "Sharding",
           "check_at_start_up", "check_manifest"]

#: How TP splits a component's items (:attr:`ManifestComponent.sharding`).
Sharding = Literal["replicated", "heads", "split"]


@dataclass(frozen=True)
class ManifestComponent:
    """One component of a model: the entries of one role on a set of global layers.

    Attributes:
        role: The role its entries publish (``kv``, ``k``, ``v``, ``indexer``, ``swa``,
            ``compressed``, a state name such as ``kda_conv_q``).
        kind: ``"page"`` (indexed by a pool's pages) or ``"state"`` (by a request's slot).
        layers: Global layer ids that hold it.
        bytes: Bytes at TP 1 of one row (a token's, or ``tokens_per_row`` tokens' for a
            compressed cache) of a page entry, or of one slot of a state entry.
        tokens_per_row: Tokens one row holds (page entries); a page of ``P`` tokens holds
            ``P / tokens_per_row`` rows (``P``: the page size of the entry's pool).
        sharding: How TP splits its items: ``"replicated"`` (every rank holds them whole: an
            MLA latent, an indexer), ``"heads"`` (``kv_heads`` heads, a rank holds
            ``max(1, kv_heads // tp_size)``: K and V) or ``"split"`` (``bytes // tp_size``
            per rank: a linear-attention state).
        kv_heads: The model's KV heads (``sharding="heads"`` only).
        window: Sliding window of its page entries in tokens (``None``: full attention).
        ring: Rows per slot of its ring-state entries (``None``: whole slots).
    """

    role: str
    kind: Literal["page", "state"]
    layers: tuple[int, ...]
    bytes: int
    tokens_per_row: int = 1
    sharding: Sharding = "replicated"
    kv_heads: int = 1
    window: int | None = None
    ring: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("page", "state"):
            raise ManifestError(f"manifest component {self.role!r}: kind must be \"page\" or "
                                f"\"state\", got {self.kind!r}")
        if self.sharding not in ("replicated", "heads", "split"):
            raise ManifestError(f"manifest component {self.role!r}: sharding must be "
                                f"\"replicated\", \"heads\" or \"split\", got {self.sharding!r}")
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-safe (``layers`` a list; ``window`` and ``ring`` may be None)."""
        return {"role": self.role, "kind": self.kind, "layers": list(self.layers),
                "bytes": self.bytes, "tokens_per_row": self.tokens_per_row,
                "sharding": self.sharding, "kv_heads": self.kv_heads, "window": self.window,
                "ring": self.ring}

    @classmethod
    def from_dict(cls, data: object, *, where: str = "manifest component") -> ManifestComponent:
        """The component :meth:`to_dict` wrote; ``role``, ``kind``, ``layers`` and ``bytes``
        are required, the other fields default as the constructor's do.

        Raises:
            ManifestError: Not a mapping, a missing or unknown key, or a value of the wrong
                type, naming ``where``, the key and the value.
        """
        fields = _fields(data, where, required=_COMPONENT_REQUIRED, optional=_COMPONENT_OPTIONAL)
        role = _typed(fields, "role", str, where)
        outer, where = where, f"{where} {role!r}"
        layers = fields["layers"]
        if not isinstance(layers, list) or not all(_is_int(i) for i in layers):
            raise ManifestError(f"{where}: layers must be a list of integers (global layer "
                                f"ids), got {layers!r}")
        kwargs: dict[str, Any] = {"role": role, "kind": _typed(fields, "kind", str, where),
                                  "layers": tuple(layers),
                                  "bytes": _typed(fields, "bytes", int, where)}
        for name in ("tokens_per_row", "kv_heads"):
            if name in fields:
                kwargs[name] = _typed(fields, name, int, where)
        if "sharding" in fields:
            kwargs["sharding"] = _typed(fields, "sharding", str, where)
        for name in ("window", "ring"):
            if fields.get(name) is not None:
                kwargs[name] = _typed(fields, name, int, where)
        try:
            return cls(**kwargs)
        except ManifestError as err:
            raise ManifestError(f"{outer}: {err}") from err


@dataclass(frozen=True)
class Fusion:
    """Components an engine may hold as one entry per layer instead of one entry each.

    On every layer holding the components ``parts``, an engine may publish one entry of role
    ``role`` whose item is the parts' items together (:meth:`ModelManifest.packed`: bytes the
    parts' sum, everything else equal). With one part it is that component under another name.
    SGLang keeps a KDA layer's q, k and v short-convolution states as one ``mamba_conv`` tensor
    and its recurrent state as ``mamba_temporal``; a manifest that names the parts as another
    engine keeps them declares ``Fusion("mamba_conv", ("kda_conv_q", "kda_conv_k",
    "kda_conv_v"))`` and ``Fusion("mamba_temporal", ("kda_recurrent",))``.

    Attributes:
        role: The role of the one entry.
        parts: The roles of the components it holds, each once, ``role`` not among them.
    """

    role: str
    parts: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        if not isinstance(self.role, str) or not self.role or not self.parts \
                or not all(isinstance(p, str) and p for p in self.parts) \
                or len(set(self.parts)) != len(self.parts) or self.role in self.parts:
            raise ManifestError(f"manifest fusion {self.role!r} of {self.parts!r}: needs a role "
                                f"and one or more distinct part roles other than it")

    def to_dict(self) -> dict[str, Any]:
        """``{"role": ..., "parts": [...]}``."""
        return {"role": self.role, "parts": list(self.parts)}

    @classmethod
    def from_dict(cls, data: object, *, where: str = "manifest fusion") -> Fusion:
        """The fusion :meth:`to_dict` wrote.

        Raises:
            ManifestError: Not a mapping, a missing or unknown key, or a value of the wrong
                type, naming ``where``, the key and the value.
        """
        fields = _fields(data, where, required=("role", "parts"), optional=())
        role = _typed(fields, "role", str, where)
        parts = fields["parts"]
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            raise ManifestError(f"{where} {role!r}: parts must be a list of strings (roles), "
                                f"got {parts!r:.200}")
        try:
            return cls(role, tuple(parts))
        except ManifestError as err:
            raise ManifestError(f"{where}: {err}") from err


@dataclass(frozen=True)
class ModelManifest:
    """Every component a model has.

    Attributes:
        model: The model's name (messages name it).
        num_layers: Layers of the whole model (a layout publishing another
            ``num_model_layers`` is refused).
        components: Its components.
        fusions: Parts an engine may hold as one entry per layer (:class:`Fusion`); the
            core's :func:`check_manifest` checks a layout against the form it holds.
    """

    model: str
    num_layers: int
    components: tuple[ManifestComponent, ...] = field(default_factory=tuple)
    fusions: tuple[Fusion, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fusions", tuple(self.fusions))

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain data (docs/manifests.md, "The JSON form"); ``fusions`` only
        where it has some."""
        out: dict[str, Any] = {"model": self.model, "num_layers": self.num_layers,
                               "components": [c.to_dict() for c in self.components]}
        if self.fusions:
            out["fusions"] = [f.to_dict() for f in self.fusions]
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: object, *, where: str = "manifest") -> ModelManifest:
        """The manifest :meth:`to_dict` wrote: ``model`` (str), ``num_layers`` (int),
        ``components`` (a list of :meth:`ManifestComponent.from_dict` mappings) and optionally
        ``fusions`` (a list of :meth:`Fusion.from_dict` mappings), no other key.

        Raises:
            ManifestError: A missing or unknown key or a value of the wrong type, naming
                ``where``, the key (a component by its position and role) and the value.
        """
        fields = _fields(data, where, required=("model", "num_layers", "components"),
                         optional=("fusions",))
        model = _typed(fields, "model", str, where)
        num_layers = _typed(fields, "num_layers", int, where)
        components = fields["components"]
        if not isinstance(components, list):
            raise ManifestError(f"{where}: components must be a list, got "
                                f"{type(components).__name__} {components!r:.200}")
        fusions = fields.get("fusions", [])
        if not isinstance(fusions, list):
            raise ManifestError(f"{where}: fusions must be a list, got "
                                f"{type(fusions).__name__} {fusions!r:.200}")
        return cls(model, num_layers, tuple(
            ManifestComponent.from_dict(c, where=f"{where}: components[{i}]")
            for i, c in enumerate(components)),
            tuple(Fusion.from_dict(f, where=f"{where}: fusions[{i}]")
                  for i, f in enumerate(fusions)))

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "manifest") -> ModelManifest:
        """:meth:`from_dict` of JSON text.

        Raises:
            ManifestError: Text that is not JSON (naming ``where``, the line and column), or
                what :meth:`from_dict` refuses.
        """
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{where}: not JSON: {exc}") from exc
        return cls.from_dict(data, where=where)

    def roles(self) -> list[str]:
        """The components' roles, each once, in manifest order."""
        return list(dict.fromkeys(c.role for c in self.components))

    def packed(self, role: str, parts: Sequence[str]) -> ModelManifest:
        """The manifest as seen by an engine that keeps the components ``parts`` of a layer in
        one entry of role ``role``: vLLM packs an attention layer's K and V in one region
        (each page holds, per token and head, the head's K then its V), so its workers are
        checked against ``manifest.packed("kv", ("k", "v"))``.

        On each layer that holds the parts, their components merge into one of role ``role``
        whose ``bytes`` are the parts' sum; everything else (kind, rows, sharding, KV heads,
        window, ring) must be the same for every part and is kept, so a sliding-window layer's
        K and V become a packed entry with that window. Layers are grouped as the parts'
        components group them; components of other roles are kept as they are, in order (the
        merged ones where the first part's component was). A manifest without the parts is
        returned unchanged. One part renames its components (``role`` for it). The manifest's
        :attr:`fusions` are kept. The core merges (``ModelManifest::packed``, the rule the
        check uses to take a :class:`Fusion`); this method converts.

        Raises:
            ManifestError: Parts that are not one or more distinct roles other than ``role``,
                a layer that holds some parts but not all, parts that differ in anything but
                their bytes, or a layer that already has a component of ``role`` of the same
                kind, naming the model, the roles, the layers and the fields that differ.
        """
        out = _pack_manifest(model=self.model, num_layers=self.num_layers,
                             components=self._component_tuples(), role=role, parts=list(parts))
        return ModelManifest(self.model, self.num_layers, tuple(
            self.components[c] if isinstance(c, int) else _from_core(c) for c in out),
            self.fusions)

    def _component_tuples(self) -> list[tuple[str, str, list[int], int, int, str, int,
                                              int | None, int | None]]:
        """The components as the core's bindings take them."""
        return [(c.role, c.kind, list(c.layers), c.bytes, c.tokens_per_row, c.sharding,
                 c.kv_heads, c.window, c.ring) for c in self.components]

    def without(self, role: str, layers: Sequence[int] | None = None) -> ModelManifest:
        """The manifest with component ``role`` removed (on ``layers`` only, when given)."""
        drop = None if layers is None else set(layers)
        out = []
        for c in self.components:
            if c.role != role:
                out.append(c)
            elif drop is not None and (kept := tuple(i for i in c.layers if i not in drop)):
                out.append(ManifestComponent(c.role, c.kind, kept, c.bytes, c.tokens_per_row,
                                             c.sharding, c.kv_heads, c.window, c.ring))
        return ModelManifest(self.model, self.num_layers, tuple(out), self.fusions)


def check_manifest(layout: Layout, manifest: ModelManifest, *,
                   stage: range | tuple[int, int] | None = None) -> None:
    """Check that ``layout`` holds every component of ``manifest`` on the layers of its stage,
    with the item sizes the manifest gives at the layout's TP coordinates, and nothing else
    (draft entries are not checked).

    Args:
        layout: One peer's layout (one TP rank of one PP stage).
        manifest: The model's manifest.
        stage: The global layers the layout's PP stage holds (a ``range`` with step 1 or
            ``(start, end)``); required when the layout's ``pp_size`` is above 1, since a
            stage's layers cannot be told from its entries (a missing first or last layer
            would look like a shorter stage). ``None``: the whole model.

    The core decides, per fusion in order, which form the layout holds: a layout holding an
    entry of a fusion's role on a layer of its parts is checked against the fused component
    (:meth:`ModelManifest.packed`), a part held beside it being unexpected; one without it is
    checked against the parts, and a refusal of missing parts adds which fused entry would have
    held them.

    Raises:
        ManifestError: Every problem at once, in ``problems`` as ``(kind, role, layers,
            expected, got)``: ``missing`` components, ``item_size``, ``window`` and ``ring``
            mismatches, ``unexpected`` entries no component declares, ``model_layers`` (the
            layout's model has another layer count), ``outside_stage``, ``stage_range`` (a PP
            stage without ``stage``), ``no_layer_ids`` and ``malformed`` manifests. The
            message names the model, each component, its layers (as ranges) and both values.
    """
    if not isinstance(manifest, ModelManifest):
        raise ManifestError(f"check_manifest: expected a kvplan.ModelManifest, got "
                            f"{type(manifest).__name__}")
    span: tuple[int, int] | None
    if stage is None:
        span = None
    elif isinstance(stage, range):
        if stage.step != 1:
            raise ManifestError(f"check_manifest: stage must be a range of step 1, got {stage!r}")
        span = (stage.start, stage.stop)
    else:
        span = (int(stage[0]), int(stage[1]))
    _check_manifest(layout, model=manifest.model, num_layers=manifest.num_layers,
                    components=manifest._component_tuples(),
                    fusions=[(f.role, list(f.parts)) for f in manifest.fusions], stage=span)


def _from_core(c: tuple[str, str, list[int], int, int, str, int, int | None, int | None]
               ) -> ManifestComponent:
    """A component the core merged (its kind and sharding are the core's names)."""
    role, kind, layers, size, rows, sharding, kv_heads, window, ring = c
    return ManifestComponent(role, cast(Literal["page", "state"], kind), tuple(layers), size,
                             rows, cast(Sharding, sharding), kv_heads, window, ring)


_COMPONENT_REQUIRED = ("role", "kind", "layers", "bytes")
_COMPONENT_OPTIONAL = ("tokens_per_row", "sharding", "kv_heads", "window", "ring")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fields(data: object, where: str, *, required: Sequence[str],
            optional: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ManifestError(f"{where}: expected a JSON object (mapping), got "
                            f"{type(data).__name__} {data!r:.200}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ManifestError(f"{where}: missing {', '.join(repr(k) for k in missing)} (required: "
                            f"{', '.join(required)})")
    unknown = [k for k in data if k not in required and k not in optional]
    if unknown:
        raise ManifestError(f"{where}: unknown key {', '.join(repr(k) for k in unknown)} "
                            f"(known: {', '.join((*required, *optional))})")
    return data


def _typed(fields: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = fields[name]
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise ManifestError(f"{where}: {name} must be {'an integer' if kind is int else 'a string'}"
                            f", got {type(value).__name__} {value!r:.200}")
    return value


def check_at_start_up(layout: Layout, manifest: ModelManifest, *,
                      stage: range | tuple[int, int] | None, engine: str,
                      log: logging.Logger) -> None:
    """A drop-in's start-up check of its own layout (one TP rank of one PP stage) against the
    manifest its configuration names: :func:`check_manifest`, one INFO line when it holds, else
    one ERROR line and :class:`ManifestError`, both naming the model, ``engine`` (the drop-in
    and its setting), this rank's TP and PP coordinates and, where the layout has them, its KV
    heads (the rank's and the model's). The core decides; nothing here.

    Raises:
        ManifestError: The core's refusal, its message prefixed with the engine and the
            coordinates (``model`` and ``problems`` as the core gave them).
    """
    where = (f"TP rank {layout.tp_rank} of {layout.tp_size}, PP rank {layout.pp_rank} of "
             f"{layout.pp_size}" + ("" if stage is None else
                                     f", stage layers {_span_text(stage)}")
             + ("" if layout.kv_heads is None else
                f", {layout.heads_per_rank} of {layout.kv_heads} KV heads"))
    try:
        check_manifest(layout, manifest, stage=stage)
    except ManifestError as err:
        refusal = ManifestError(f"kvplan: {engine}: this worker ({where}) does not hold the "
                                f"manifest of {manifest.model}, refusing to start: {err}")
        refusal.model = getattr(err, "model", manifest.model)
        refusal.problems = getattr(err, "problems", ())
        refusal.kind = getattr(err, "kind", "manifest")
        log.error("%s", refusal)
        raise refusal from err
    log.info("kvplan: %s: this worker (%s) holds every component of the manifest of %s",
             engine, where, manifest.model)


def _span_text(stage: range | tuple[int, int]) -> str:
    start, stop = (stage.start, stage.stop) if isinstance(stage, range) else stage
    return f"{start}-{int(stop) - 1}"
