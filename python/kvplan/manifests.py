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

Engines do not all cut a layer's state into the same tensors (SGLang keeps a KDA layer's q, k
and v short-convolution states as one tensor, others keep three). A manifest declares such
alternatives as data (:class:`Fusion`: these parts may be held as one entry of this role), and
:func:`check_manifest` checks a layout against the presentation it holds
(:meth:`ModelManifest.as_held_by`), never a union of both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvplan._core import Layout, ManifestError
from kvplan._core import check_manifest as _check_manifest

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
        fusions: Parts an engine may hold as one entry per layer (:class:`Fusion`); a layout
            is checked against the presentation it holds (:meth:`as_held_by`).
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
        :attr:`fusions` are kept.

        Raises:
            ManifestError: A layer that holds some parts but not all, parts that differ in
                anything but their bytes, or a layer that already has a component of
                ``role`` of the same kind, naming the model, the roles, the layers and the
                fields that differ. (The core's :func:`check_manifest` still decides whether
                a layout holds the result.)
        """
        names = tuple(parts)
        if not names or len(set(names)) != len(names) or role in names:
            raise ManifestError(f"manifest of {self.model}: packed({role!r}, {names!r}) needs "
                                f"one or more distinct part roles other than {role!r}")
        by_part = {p: [c for c in self.components if c.role == p] for p in names}
        if not any(by_part.values()):
            return self
        shape = ("kind", "tokens_per_row", "sharding", "kv_heads", "window", "ring")
        where: dict[int, list[ManifestComponent]] = {}
        for p in names:
            for c in by_part[p]:
                for layer in c.layers:
                    where.setdefault(layer, []).append(c)
        problems: dict[str, list[int]] = {}  # why -> layers
        groups: dict[tuple[int, ...], list[int]] = {}  # component ids per part -> layers
        for layer in sorted(where):
            held = where[layer]
            roles = [c.role for c in held]
            if sorted(roles) != sorted(names):
                problems.setdefault(f"hold {', '.join(sorted(roles))}, not one each of "
                                    f"{', '.join(names)}", []).append(layer)
                continue
            first = held[0]
            differ = [f"{f} ({', '.join(f'{c.role} {getattr(c, f)!r}' for c in held)})"
                      for f in shape if any(getattr(c, f) != getattr(first, f) for c in held)]
            if differ:
                problems.setdefault(f"the parts differ in {', '.join(differ)}", []).append(
                    layer)
                continue
            key = tuple(id(next(c for c in held if c.role == p)) for p in names)
            groups.setdefault(key, []).append(layer)
        taken = {(layer, c.kind) for c in self.components if c.role == role
                 for layer in c.layers}
        clash = sorted({layer for layer in where if (layer, where[layer][0].kind) in taken})
        if clash:
            problems[f"already have a {role!r} component"] = clash
        if problems:
            raise ManifestError(
                f"manifest of {self.model}: cannot pack {', '.join(names)} into one {role!r} "
                f"entry per layer: " + "; ".join(f"layers {_layers_text(layers)} {why}"
                                                 for why, layers in problems.items()))
        ids = {id(c): c for p in names for c in by_part[p]}
        merged: dict[int, list[ManifestComponent]] = {}  # first part's component id -> merged
        for key, layers in groups.items():
            parts_of = [ids[i] for i in key]
            first = parts_of[0]
            merged.setdefault(key[0], []).append(ManifestComponent(
                role, first.kind, tuple(layers), sum(c.bytes for c in parts_of),
                first.tokens_per_row, first.sharding, first.kv_heads, first.window, first.ring))
        out: list[ManifestComponent] = []
        for c in self.components:
            if c.role not in names:
                out.append(c)
            else:
                out.extend(merged.get(id(c), ()))
        return ModelManifest(self.model, self.num_layers, tuple(out), self.fusions)

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

    def as_held_by(self, layout: Layout) -> tuple[ModelManifest, tuple[Fusion, ...]]:
        """The manifest in the presentation ``layout`` holds, and the fusions it does not hold.

        Each fusion, in order, is taken (:meth:`packed`) when the layout publishes an entry of
        the fusion's role, of the parts' kind, on a layer that holds the parts; otherwise the
        parts stay as they are and the fusion is returned among those not held (a refusal then
        says that the fused entry would have done too). The result has no fusions left.

        Raises:
            ManifestError: A fusion whose parts cannot merge (:meth:`packed`'s refusal).
        """
        held = {(role, kind, layer) for role, kind, layer
                in zip(layout.roles or (), layout.kinds, layout.layer_ids or ())
                if role is not None and layer is not None}
        manifest = ModelManifest(self.model, self.num_layers, self.components)
        skipped: list[Fusion] = []
        for fusion in self.fusions:
            parts = [c for c in manifest.components if c.role in fusion.parts]
            if any((fusion.role, c.kind, layer) in held for c in parts for layer in c.layers):
                manifest = manifest.packed(fusion.role, fusion.parts)
            elif parts:
                skipped.append(fusion)
        return manifest, tuple(skipped)


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

    The manifest's fusions are resolved first (:meth:`ModelManifest.as_held_by`): a layout
    holding a fusion's entry is checked against the fused component, one without it against
    the parts, and a refusal of missing parts adds which fused entry would have held them.

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
    manifest, not_held = manifest.as_held_by(layout)
    try:
        _check_manifest(
            layout, model=manifest.model, num_layers=manifest.num_layers,
            components=[(c.role, c.kind, list(c.layers), c.bytes, c.tokens_per_row, c.sharding,
                         c.kv_heads, c.window, c.ring) for c in manifest.components],
            stage=span)
    except ManifestError as err:
        problems = getattr(err, "problems", ())
        missing = {p[1] for p in problems if p[0] == "missing"}
        notes = [(f"{', '.join(f.parts)} may also be held as one {f.role!r} entry per layer"
                  if len(f.parts) > 1 else f"{f.parts[0]} may also be held as {f.role!r}")
                 + ", of which this layout has none"
                 for f in not_held if missing & set(f.parts)]
        if not notes:
            raise
        refusal = ManifestError(f"{err} ({'; '.join(notes)})")
        refusal.model = getattr(err, "model", manifest.model)
        refusal.problems = problems
        refusal.kind = getattr(err, "kind", "manifest")
        raise refusal from err


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


def _layers_text(layers: Sequence[int]) -> str:
    """Layer ids as ranges (``0-3, 7``)."""
    runs: list[list[int]] = []
    for layer in sorted(set(layers)):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _span_text(stage: range | tuple[int, int]) -> str:
    start, stop = (stage.start, stage.stop) if isinstance(stage, range) else stage
    return f"{start}-{int(stop) - 1}"
