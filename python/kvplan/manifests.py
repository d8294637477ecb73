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
a preset's layouts and its manifest cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvplan._core import Layout, ManifestError
from kvplan._core import check_manifest as _check_manifest

__all__ = ["ManifestComponent", "ManifestError", "ModelManifest", "Sharding", "check_manifest"]

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


@dataclass(frozen=True)
class ModelManifest:
    """Every component a model has.

    Attributes:
        model: The model's name (messages name it).
        num_layers: Layers of the whole model (a layout publishing another
            ``num_model_layers`` is refused).
        components: Its components.
    """

    model: str
    num_layers: int
    components: tuple[ManifestComponent, ...] = field(default_factory=tuple)

    def roles(self) -> list[str]:
        """The components' roles, each once, in manifest order."""
        return list(dict.fromkeys(c.role for c in self.components))

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
        return ModelManifest(self.model, self.num_layers, tuple(out))


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
    _check_manifest(
        layout, model=manifest.model, num_layers=manifest.num_layers,
        components=[(c.role, c.kind, list(c.layers), c.bytes, c.tokens_per_row, c.sharding,
                     c.kv_heads, c.window, c.ring) for c in manifest.components],
        stage=span)
