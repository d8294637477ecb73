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
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvplan._core import KvPlanError, Layout, LayoutError, LayoutIdentity, Pairing, Verdict
from kvplan._core import compatibility as _compatibility
from kvplan._core import layout_identity as _layout_identity
from kvplan._errors import IncompatiblePeerError

__all__ = [
    "IDENTITY_KEY",
    "LayoutIdentity",
    "ModelSemantics",
    "PeerCheck",
    "Verdict",
    "canonical_rope",
    "compatibility",
    "declarable_rope",
    "hf_rope",
    "identity_from_message",
    "identity_message",
    "layout_identity",
    "model_name_of",
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


# ---------------------------------------------------------------------------------------------
# At the handshake: the identity a peer sends, and the verdict on it
# ---------------------------------------------------------------------------------------------

#: The key a drop-in's handshake message carries its identity under.
IDENTITY_KEY = "kvplan_identity"
#: The version of :func:`identity_message`'s form (a peer's message of another version is not
#: understood: today's behaviour, said once).
IDENTITY_MESSAGE_VERSION = 1


def identity_message(identity: LayoutIdentity) -> dict[str, Any]:
    """What a drop-in's handshake carries: the two ids, the layout (``Layout.to_dict``, from
    which the peer computes the verdict with its planner) and the semantics in their canonical
    form. JSON- and msgpack-safe."""
    return {"version": IDENTITY_MESSAGE_VERSION, "class_id": identity.class_id,
            "layout_id": identity.layout_id, "layout": identity.layout.to_dict(),
            "semantics": {"model": identity.model, "revision": identity.revision,
                          "rope": identity.rope, "drafts": list(identity.drafts),
                          "transfer": identity.transfer, "cross_layer": identity.cross_layer}}


def identity_from_message(message: object, *, peer: str = "the peer") -> LayoutIdentity | None:
    """The peer's identity from :func:`identity_message`'s form; ``None`` for a message of
    another version (a kvplan this one does not understand).

    Raises:
        IncompatiblePeerError: The message does not parse, or its ids are not what its layout
            and semantics give (``refused_by == "identity"``), naming the peer and the values.
    """
    def refuse(why: str, peer_class: str = "") -> IncompatiblePeerError:
        err = IncompatiblePeerError(f"kvplan: {peer}'s layout identity is refused: {why}")
        err.peer, err.peer_class_id, err.refused_by, err.reason = peer, peer_class, \
            "identity", why
        return err

    if not isinstance(message, Mapping):
        raise refuse(f"expected a mapping, got {type(message).__name__}")
    if message.get("version") != IDENTITY_MESSAGE_VERSION:
        return None
    try:
        declared_class, declared_layout = str(message["class_id"]), str(message["layout_id"])
        sem = message["semantics"]
        layout = Layout.from_dict(dict(message["layout"]))
        semantics = ModelSemantics(model=sem["model"], revision=sem["revision"],
                                   rope=sem["rope"], drafts=tuple(sem["drafts"]),
                                   transfer=sem["transfer"], cross_layer=sem["cross_layer"])
        identity = layout_identity(layout, semantics)
    except IncompatiblePeerError:
        raise
    except (KeyError, TypeError, ValueError, KvPlanError) as exc:
        raise refuse(f"it does not parse ({type(exc).__name__}: {exc})",
                     str(message.get("class_id", ""))) from exc
    if identity.class_id != declared_class or identity.layout_id != declared_layout:
        raise refuse(f"it declares class id {declared_class} and layout id {declared_layout}, "
                     f"but its layout and semantics give {identity.class_id} and "
                     f"{identity.layout_id}", declared_class)
    return identity


def declarable_rope(rope: RopeConfig) -> RopeConfig:
    """``rope`` where :func:`canonical_rope` can write it, else None (left undeclared): an
    engine's config may hold a value JSON cannot carry, and that must not drop the other
    semantics a drop-in declares beside it."""
    try:
        canonical_rope(rope)
    except LayoutError:
        return None
    return rope


def model_name_of(model: str) -> str:
    """A model given as a local path, named by its last path part (``/models/Llama-3-8B/`` →
    ``Llama-3-8B``); a hub id (``org/name``) or a name as it is. Two peers keep one model's
    weights at whatever local path each host has, so the path itself would refuse them."""
    import os.path

    if model.startswith(("/", "./", "../", "~")) or os.path.isdir(model):
        return os.path.basename(os.path.normpath(os.path.expanduser(model))) or model
    return model


def hf_rope(config: object) -> Mapping[str, object] | None:
    """A Hugging Face model config's RoPE configuration, as the engines read it:
    ``rope_parameters`` (transformers 5) or else ``rope_scaling``, with ``rope_theta`` added
    when the config has it and the mapping does not; ``None`` when it declares none."""
    rope: Any = None
    for name in ("rope_parameters", "rope_scaling"):
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if isinstance(value, Mapping) and value:
            rope = dict(value)
            break
    theta = config.get("rope_theta") if isinstance(config, Mapping) else getattr(
        config, "rope_theta", None)
    if isinstance(theta, (int, float)) and not isinstance(theta, bool):
        rope = dict(rope or {})
        rope.setdefault("rope_theta", theta)
    return rope  # type: ignore[no-any-return]


Role = Literal["prefill", "decode"]


class PeerCheck:
    """One drop-in's verdicts on its peers' identities, each said once per peer and identity.

    ``local`` is this side's identity (or a callable giving it once the engine's KV cache is
    known: ``None`` until then, and no check is made). :meth:`check` takes what a peer sent
    under :data:`IDENTITY_KEY` and:

    * refuses (raises :class:`kvplan.IncompatiblePeerError`, logged once at ERROR) a
      ``refused`` verdict, and a ``plannable_with_conversion`` one unless ``converts`` (the
      drop-ins' transfer paths copy pages as they are: a conversion they do not make would
      hand the decode bytes laid out for the other side);
    * returns a plannable verdict (a conversion logged once);
    * returns ``None`` for a peer that sent no identity (an older kvplan, or the engine
      without kvplan): today's behaviour, said once per peer.
    """

    def __init__(self, local: LayoutIdentity | Callable[[], LayoutIdentity | None] | None,
                 logger: logging.Logger, *, converts: bool = False) -> None:
        self._local = local
        self._log = logger
        self.converts = converts
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, str, str], Verdict | IncompatiblePeerError | None] = {}
        self._said: set[tuple[str, str]] = set()

    @property
    def local(self) -> LayoutIdentity | None:
        """This side's identity (``None``: not known yet, or the engine gave none)."""
        local = self._local
        if local is None or isinstance(local, LayoutIdentity):
            return local
        value = local()
        if value is not None:
            self._local = value
        return value

    def message(self) -> dict[str, Any] | None:
        """This side's :func:`identity_message`, or ``None`` while it has none."""
        local = self.local
        return None if local is None else identity_message(local)

    def check(self, peer: str, sent: object, *, local_role: Role) -> Verdict | None:
        """The verdict on ``peer`` (which sent ``sent``: ``None`` when it sent nothing) with
        this side as ``local_role``; see the class docstring."""
        local = self.local
        key = (peer, local_role, f"{local.layout_id if local is not None else ''}:"
                                 f"{_sent_key(sent)}")
        with self._lock:
            if key in self._outcomes:
                outcome = self._outcomes[key]
                if isinstance(outcome, IncompatiblePeerError):
                    raise outcome
                return outcome
        outcome = self._decide(peer, sent, local, local_role)
        with self._lock:
            self._outcomes[key] = outcome
            while len(self._outcomes) > 1024:
                self._outcomes.pop(next(iter(self._outcomes)))
        if isinstance(outcome, IncompatiblePeerError):
            raise outcome
        return outcome

    def _say(self, peer: str, what: str, level: int, msg: str, *args: object) -> None:
        with self._lock:
            if (peer, what) in self._said:
                return
            self._said.add((peer, what))
        self._log.log(level, msg, *args)

    def _decide(self, peer: str, sent: object, local: LayoutIdentity | None,
                local_role: Role) -> Verdict | IncompatiblePeerError | None:
        if sent is None:
            self._say(peer, "none", logging.INFO,
                      "kvplan: peer %s sent no layout identity (an older kvplan, or the engine "
                      "without kvplan): no compatibility check, transfers as before", peer)
            return None
        try:
            remote = identity_from_message(sent, peer=f"peer {peer}")
        except IncompatiblePeerError as err:
            err.local_class_id = local.class_id if local is not None else ""
            err.local_role = local_role
            self._say(peer, f"bad:{err.peer_class_id}", logging.ERROR, "%s", err)
            return err
        if remote is None:
            self._say(peer, "version", logging.INFO,
                      "kvplan: peer %s sent a layout identity of another version (%r): no "
                      "compatibility check, transfers as before", peer,
                      sent.get("version") if isinstance(sent, Mapping) else None)
            return None
        if local is None:
            self._say(peer, "no-local", logging.INFO,
                      "kvplan: this side has no layout identity yet: no compatibility check "
                      "with peer %s (%s)", peer, remote.class_id)
            return None
        prefill, decode = (local, remote) if local_role == "prefill" else (remote, local)
        verdict = compatibility(prefill, decode)
        where = (f"prefill {prefill.class_id} ({'here' if local_role == 'prefill' else peer})"
                 f" -> decode {decode.class_id} "
                 f"({'here' if local_role == 'decode' else peer})")
        if verdict.kind == "plannable":
            self._say(peer, f"ok:{remote.layout_id}", logging.INFO,
                      "kvplan: layout identities compatible: %s", where)
            return verdict
        if verdict.kind == "plannable_with_conversion" and self.converts:
            self._say(peer, f"conv:{remote.layout_id}", logging.WARNING,
                      "kvplan: layout identities compatible with a conversion: %s: %s", where,
                      verdict.reason)
            return verdict
        if verdict.kind == "plannable_with_conversion":
            refused_by = "conversion"
            reason = (f"{verdict.reason}; this drop-in's transfer path copies pages as they "
                      f"are and does not make that conversion")
        else:
            refused_by, reason = str(verdict.refused_by or "refused"), verdict.reason
        refusal = IncompatiblePeerError(f"kvplan refuses transfers with peer {peer}: {where}: "
                                        f"{reason}")
        refusal.peer, refusal.local_class_id = peer, local.class_id
        refusal.peer_class_id, refusal.local_role = remote.class_id, local_role
        refusal.refused_by, refusal.reason = refused_by, reason
        self._say(peer, f"refused:{remote.layout_id}", logging.ERROR, "%s", refusal)
        return refusal


def _sent_key(sent: object) -> str:
    if isinstance(sent, Mapping):
        return f"{sent.get('version')}:{sent.get('class_id')}:{sent.get('layout_id')}"
    return repr(sent)[:256]
