"""SGLang's Ascend dispatch as an explicit policy: which pairing a backend uses for a layout.

SGLang's fix for Ascend hybrid-linear (Kimi-style) models keeps Ascend's legacy positional PP
slicing for every layout except one: hybrid-linear MLA with prefill PP > 1, which it moves to
pairing by global layer id, because positional slicing picks the wrong decode entries for later
PP stages there (docs/semantics.md, Ascend). kvplan's own default is simpler: pair by layer id
whenever the peers publish ids, on every backend. :func:`select_pairing` returns which rule a
given (backend, layout, PP size) gets, so an engine that must keep Ascend's legacy behaviour
for the other layouts can do so explicitly, in one tested place.

=========  =============================  ===========  ========================================
backend    prefill layout                 prefill PP   pairing
=========  =============================  ===========  ========================================
ascend     hybrid-linear MLA              > 1          ``layer_id`` (SGLang's Ascend hybrid fix)
ascend     hybrid-linear MLA              1            ``positional`` (legacy flat)
ascend     MLA / NPU buffer groups        > 1          ``legacy`` slicing, kind ``mla``
ascend     MHA (incl. hybrid MHA)         > 1          ``legacy`` slicing, kind ``mha``
ascend     MLA or MHA                     1            ``positional`` (legacy flat)
other      publishes layer ids            any          ``layer_id`` (kvplan's default)
other      no layer ids                   1            ``positional``
other      no layer ids                   > 1          ``legacy`` slicing (strict)
=========  =============================  ===========  ========================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvplan import _core
from kvplan._core import Layout, Pairing
from kvplan._roles import MHA_ROLES
from kvplan.report import CompatReport, compare

__all__ = ["LAYOUT_KINDS", "PairingChoice", "layout_kind", "select_pairing"]

PairingMode = Literal["layer_id", "positional", "legacy"]

#: Layout kinds :func:`select_pairing` distinguishes (a string may be passed instead of a Layout).
LAYOUT_KINDS = ("mla", "mha", "hybrid_mla", "hybrid_mha")


@dataclass(frozen=True)
class PairingChoice:
    """What :func:`select_pairing` decided, and how to build a ``Template`` that follows it:
    :meth:`pairing` is the :class:`kvplan.Pairing` to pass as ``pairing=``.

    Attributes:
        mode: ``"layer_id"`` (pair by global layer id and role), ``"positional"`` (entry ``i``
            to entry ``i``, counted within each role when both peers publish roles; extra
            decode entries ignored) or ``"legacy"`` (positional PP
            slicing from ``prefill_start_layer``, strict).
        backend: The backend name, lower-cased.
        layout_kind: ``"mla"``, ``"mha"``, ``"hybrid_mla"`` or ``"hybrid_mha"``; ``None`` when
            the decision did not need it.
        pp_size: The prefill PP size the decision was made for.
        legacy_kind: ``"mla"`` / ``"mha"`` for ``legacy`` mode, else ``None``.
        rule: The policy table row that applied (``"ascend-hybrid-mla-pp"``, ...).
        reason: One sentence saying why.
    """

    mode: PairingMode
    backend: str
    layout_kind: str | None
    pp_size: int
    legacy_kind: str | None
    rule: str
    reason: str

    @property
    def uses_layer_ids(self) -> bool:
        return self.mode == "layer_id"

    def pairing(self, prefill_start_layer: int | None = None) -> Pairing:
        """The :class:`kvplan.Pairing` that implements this choice.

        ``layer_id`` mode is ``Pairing.by_layer_id()``, ``positional`` mode
        ``Pairing.positional()`` and ``legacy`` mode ``Pairing.legacy(legacy_kind,
        prefill_start_layer=...)``. Positional and legacy modes ignore the page entries'
        published layer ids (that is what the legacy KV path does); state entries keep pairing
        by id (SGLang pairs state components by id whenever they are published, whichever path
        the KV pages take). Legacy slicing is per role when both peers publish roles (k/v, NPU
        buffer groups, draft), which is Ascend's per-group slicing.

        Args:
            prefill_start_layer: The first layer this prefill stage owns; required by
                ``legacy`` mode (the positional slice starts there), ignored otherwise.

        Raises:
            KvPlanError: ``legacy`` mode without ``prefill_start_layer``.
        """
        if self.mode == "layer_id":
            return Pairing.by_layer_id()
        if self.mode == "positional":
            return Pairing.positional()
        if prefill_start_layer is None:
            raise _core.KvPlanError(
                f"rule {self.rule!r} pairs by legacy positional PP slicing: pass "
                "prefill_start_layer (the first layer this prefill stage owns)"
            )
        return Pairing.legacy(self.legacy_kind, prefill_start_layer=prefill_start_layer)

    def template(
        self,
        prefill_layout: Layout,
        decode_layout: Layout,
        *,
        prefill_start_layer: int | None = None,
        check_dst_overlap: bool = False,
        coalesce: bool = True,
    ) -> _core.Template:
        """A ``kvplan.Template`` that pairs the way this choice says (see :meth:`pairing`);
        ``check_dst_overlap`` and ``coalesce`` are ``Template``'s.

        Raises:
            KvPlanError: As :meth:`pairing`.
            PairingError, SizeMismatchError: As ``Template`` raises them.
        """
        return _core.Template(prefill_layout, decode_layout, self.pairing(prefill_start_layer),
                              check_dst_overlap=check_dst_overlap, coalesce=coalesce)

    def compare(
        self,
        prefill_layout: Layout,
        decode_layout: Layout,
        *,
        prefill_start_layer: int | None = None,
    ) -> CompatReport:
        """``kvplan.compare`` under this choice: the report for what :meth:`template` builds."""
        return compare(prefill_layout, decode_layout, self.pairing(prefill_start_layer))


def layout_kind(layout: Layout) -> str:
    """Classify a layout as ``mla``, ``mha``, ``hybrid_mla`` or ``hybrid_mha``.

    Attention kind from the page entries' roles: ``k``/``v`` is MHA; ``kv`` and NPU buffer
    groups (``g0``, ``g1``, ...) are MLA. Hybrid-linear (only some layers carry KV): the
    layout publishes layer ids and either carries per-request state entries (linear-attention
    state) or its model-layer ids skip layers (full attention every n-th layer).

    Raises:
        KvPlanError: The layout has no roles, so MLA and MHA cannot be told apart; pass the
            kind as a string instead.
    """
    if layout.roles is None:
        raise _core.KvPlanError(
            "cannot tell MLA from MHA: the layout has no roles; pass the layout kind as a "
            f"string, one of {', '.join(LAYOUT_KINDS)}"
        )
    model_pages = [e for e in layout.entries("page") if not e.is_draft]
    page_roles = {e.role for e in model_pages}
    attention = "mha" if page_roles & MHA_ROLES else "mla"
    if layout.layer_ids is None:
        return attention
    n_model = layout.num_model_layers
    model_ids = sorted({
        e.layer_id for e in model_pages
        if e.layer_id is not None and (n_model is None or e.layer_id < n_model)
    })
    has_state = bool(layout.entries("state"))
    sparse = any(b - a != 1 for a, b in zip(model_ids, model_ids[1:]))
    return f"hybrid_{attention}" if has_state or sparse else attention


def select_pairing(backend: str, layout: Layout | str, pp_size: int | None = None) -> PairingChoice:
    """Pick the pairing rule for a prefill peer: SGLang's Ascend dispatch, kvplan elsewhere.

    Args:
        backend: Transfer backend of the prefill peer: ``"ascend"`` gets SGLang's Ascend dispatch;
            any other name (``"mooncake"``, ``"nixl"``, ...) gets kvplan's default.
        layout: The prefill layout (its kind is inferred with :func:`layout_kind`), or a kind
            string from :data:`LAYOUT_KINDS`. A string says nothing about published ids:
            ``"hybrid_*"`` kinds publish them (SGLang's hybrid pools do), ``"mla"``/``"mha"`` not.
        pp_size: Prefill pipeline-parallel size; default: the layout's ``pp_size``.

    Returns:
        A :class:`PairingChoice`; ``.pairing(prefill_start_layer=...)`` is the matching
        :class:`kvplan.Pairing`, ``.template(prefill, decode, prefill_start_layer=...)`` builds
        the ``Template`` with it.

    Raises:
        KvPlanError: Unknown layout kind, ``pp_size < 1``, or a kind that cannot be inferred
            when the decision needs it.
    """
    backend_name = backend.strip().lower()
    if pp_size is None:
        if isinstance(layout, str):
            raise _core.KvPlanError("pp_size is required when the layout is given as a kind")
        pp_size = layout.pp_size
    if pp_size < 1:
        raise _core.KvPlanError(f"pp_size must be at least 1, got {pp_size}")

    if isinstance(layout, str):
        kind: str | None = layout.strip().lower()
        if kind not in LAYOUT_KINDS:
            raise _core.KvPlanError(
                f"unknown layout kind {layout!r}; expected one of {', '.join(LAYOUT_KINDS)}")
        publishes_ids = kind.startswith("hybrid_")
    else:
        publishes_ids = layout.layer_ids is not None
        kind = None

    def kind_of() -> str:
        assert not isinstance(layout, str) or kind is not None
        return kind if kind is not None else layout_kind(layout)  # type: ignore[arg-type]

    def choice(mode: PairingMode, k: str | None, legacy: str | None, rule: str,
               reason: str) -> PairingChoice:
        return PairingChoice(mode, backend_name, k, pp_size, legacy, rule, reason)

    if backend_name == "ascend":
        k = kind_of()
        if k == "hybrid_mla" and pp_size > 1:
            return choice("layer_id", k, None, "ascend-hybrid-mla-pp",
                          "Ascend hybrid-linear MLA with prefill PP > 1: positional slicing "
                          "picks the wrong decode entries for later stages, so pair by global "
                          "layer id (SGLang's fix for Ascend hybrid-linear models)")
        if pp_size == 1:
            return choice("positional", k, None, "ascend-pp1",
                          "Ascend with prefill PP = 1: legacy flat positional pairing (entry i "
                          "to entry i; extra decode entries ignored)")
        legacy = "mha" if k.endswith("mha") else "mla"
        return choice("legacy", k, legacy, f"ascend-{legacy}-pp",
                      f"Ascend {k.replace('_', '-')} with prefill PP > 1: legacy positional PP "
                      f"slicing ({legacy.upper()}), checked strictly by kvplan")
    if publishes_ids:
        return choice("layer_id", kind, None, "default-ids",
                      "the peers publish layer ids: pair by global layer id and role "
                      "(kvplan's default on every backend)")
    if pp_size == 1:
        return choice("positional", kind, None, "default-no-ids-pp1",
                      "no layer ids at prefill PP = 1: positional pairing")
    k = kind_of()
    legacy = "mha" if k.endswith("mha") else "mla"
    return choice("legacy", k, legacy, "default-no-ids-pp",
                  f"no layer ids with prefill PP > 1: legacy positional PP slicing "
                  f"({legacy.upper()}), checked strictly by kvplan")
