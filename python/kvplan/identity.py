"""Address-free identity of a layout and compatibility verdicts (docs/identity.md).

``layout_identity(layout, ModelSemantics(...))`` gives a :class:`LayoutIdentity`: its
``class_id`` (the same on every TP, PP and DCP rank of a deployment: what a router matches peers
on and ``kvplan:layout_info`` exports) and its ``layout_id`` (one rank's exact layout: what an
offload store keys blocks by). Both are computed by the core from a canonical encoding that
holds no address, buffer length or device, so two processes, restarts or machines that read the
same bytes the same way compute the same ids.

``compatibility(prefill, decode)`` gives a :class:`Verdict` (``plannable``,
``plannable_with_conversion`` or ``refused``, with the reason naming both values) before any
byte moves. The core decides it: semantics must be equal, and the geometry is asked of the
planner's own template gate.

This module only converts the caller's semantics: the RoPE configuration as canonical JSON text
(the one place of that rule) and the types of the other fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvplan._core import Layout, LayoutError, LayoutIdentity, Pairing, Verdict
from kvplan._core import compatibility as _compatibility
from kvplan._core import layout_identity as _layout_identity

__all__ = [
    "LayoutIdentity",
    "ModelSemantics",
    "Verdict",
    "canonical_rope",
    "compatibility",
    "layout_identity",
]

RopeConfig = str | Mapping[str, object] | None


def _canonical_value(value: object, where: str) -> object:
    """``value`` with integral floats as integers (``1.0`` and ``1`` name one factor), refusing
    what JSON cannot carry exactly."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LayoutError(f"model semantics: RoPE configuration {where} is {value!r}; "
                              f"expected a finite number")
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise LayoutError(f"model semantics: RoPE configuration {where} has key "
                                  f"{key!r} of type {type(key).__name__}; expected str keys")
            out[key] = _canonical_value(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise LayoutError(f"model semantics: RoPE configuration {where} is {value!r} of type "
                      f"{type(value).__name__}; expected str, int, float, bool, None, a list "
                      f"or a mapping")


def canonical_rope(rope: RopeConfig) -> str:
    """The RoPE configuration as the identity's canonical text.

    ``None`` is ``""`` (not declared); a ``str`` is taken as it is; a mapping (such as a Hugging
    Face config's ``rope_scaling``) is JSON with keys sorted, no spaces, ASCII escapes, and every
    integral float written as an integer, so ``{"factor": 1.0}`` and ``{"factor": 1}`` agree.

    Raises:
        LayoutError: A value JSON cannot carry exactly (NaN, infinity, a non-str key, an object).
    """
    if rope is None:
        return ""
    if isinstance(rope, str):
        return rope
    if not isinstance(rope, Mapping):
        raise LayoutError(f"model semantics: RoPE configuration is {rope!r} of type "
                          f"{type(rope).__name__}; expected a str, a mapping or None")
    return json.dumps(_canonical_value(rope, "rope"), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False)


@dataclass(frozen=True)
class ModelSemantics:
    """What a layout's geometry does not say about the values its cache holds.

    Every field is part of both ids, and a compatibility verdict refuses any difference. An
    empty string means "not declared" (and differs from a declared value).

    Attributes:
        model: Model id (``"meta-llama/Llama-3.1-8B"``).
        revision: Model revision (a commit hash or tag).
        rope: RoPE configuration: a str, or a mapping written as canonical JSON
            (:func:`canonical_rope`).
        drafts: Draft models of speculative decoding (order and repeats do not matter).
        transfer: ``"push"`` (the prefill writes) or ``"pull"`` (the decode reads).
        cross_layer: Whether the engine keeps cross-layer KV blocks.
    """

    model: str = ""
    revision: str = ""
    rope: RopeConfig = None
    drafts: Sequence[str] = field(default=())
    transfer: Literal["push", "pull"] = "push"
    cross_layer: bool = False
    #: ``rope`` as the identity's canonical text, written once.
    rope_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "revision"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise LayoutError(f"model semantics: {name} is {value!r} of type "
                                  f"{type(value).__name__}; expected str")
        if isinstance(self.drafts, str) or not isinstance(self.drafts, Sequence) or not all(
                isinstance(d, str) for d in self.drafts):
            raise LayoutError(f"model semantics: drafts is {self.drafts!r}; expected a "
                              f"sequence of str (draft model ids)")
        if not isinstance(self.transfer, str):
            raise LayoutError(f"model semantics: transfer is {self.transfer!r} of type "
                              f"{type(self.transfer).__name__}; expected \"push\" or \"pull\"")
        if not isinstance(self.cross_layer, bool):
            raise LayoutError(f"model semantics: cross_layer is {self.cross_layer!r} of type "
                              f"{type(self.cross_layer).__name__}; expected bool")
        object.__setattr__(self, "rope_text", canonical_rope(self.rope))


def layout_identity(layout: Layout, semantics: ModelSemantics | None = None) -> LayoutIdentity:
    """The identity of ``layout`` serving a model with ``semantics`` (default: none declared).

    Raises:
        LayoutError: Bad semantics (naming the field and its value), such as an unknown
            transfer mode.
    """
    if semantics is None:
        semantics = ModelSemantics()
    if not isinstance(semantics, ModelSemantics):
        raise LayoutError(f"model semantics: expected a kvplan.ModelSemantics, got "
                          f"{type(semantics).__name__}")
    return _layout_identity(layout, model=semantics.model, revision=semantics.revision,
                            rope=semantics.rope_text, drafts=list(semantics.drafts),
                            transfer=semantics.transfer, cross_layer=semantics.cross_layer)


def compatibility(prefill: LayoutIdentity, decode: LayoutIdentity,
                  pairing: Pairing | None = None, *, replicas_send: bool = False) -> Verdict:
    """The verdict on ``prefill`` sending its KV cache to ``decode``, planned with ``pairing``
    (default by layer id): ``plannable``, ``plannable_with_conversion`` or ``refused``, with
    ``reason`` naming both values. Plannable exactly when ``Template`` (or, for representations
    that differ, ``ConversionTemplate``) builds for the two layouts and the semantics agree."""
    return _compatibility(prefill, decode, pairing, replicas_send=replicas_send)
