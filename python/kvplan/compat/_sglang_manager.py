"""kvplan-backed planning methods for SGLang 0.5.23's KV managers (see :mod:`kvplan.compat.sglang`).

Everything here works on SGLang's own objects (``KVArgs``, ``KVArgsRegisterInfo``, the manager
instance) through the attributes SGLang 0.5.23 defines; nothing imports SGLang.
"""

from __future__ import annotations

import concurrent.futures
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvplan import _core
from kvplan._core import Layout, Template, TransferPlan

__all__ = [
    "DEFAULT_MAX_BLOCKS_PER_BATCH",
    "REPLACED_METHODS",
    "TemplateCache",
    "install",
    "installed",
    "layout_from_kv_args",
    "layout_from_register_info",
    "template_cache",
    "uninstall",
]

#: Blocks per engine call. Mooncake's TCP transport admits about 1,024 queued entries per peer.
DEFAULT_MAX_BLOCKS_PER_BATCH = 1024

#: Methods :func:`install` replaces, per manager class name (a class inheriting from one of these
#: gets the set of its nearest listed base).
REPLACED_METHODS: dict[str, tuple[str, ...]] = {
    "MooncakeKVManager": ("_send_kvcache_generic", "send_kvcache", "_send_mamba_state",
                          "send_kvcache_slice"),
    "AscendKVManager": ("_send_kvcache_generic", "send_kvcache", "_send_mamba_state"),
}

_U64_MAX = (1 << 64) - 1


def _unbounded(ptrs: Sequence[int]) -> list[int]:
    """Buffer lengths for a peer whose lengths SGLang does not publish (the decode): as large as
    the address space allows, so only u64 overflow bounds an index there."""
    return [_U64_MAX - int(p) for p in ptrs]


def _ids(ids: Sequence[int] | None) -> list[int] | None:
    """SGLang's truthiness: ``None`` and ``[]`` both mean "not published"."""
    return list(ids) if ids else None


# ---------------------------------------------------------------------------------------------
# Layouts from SGLang's state
# ---------------------------------------------------------------------------------------------


def _kv_roles(n: int, *, mla: bool, groups: int, num_draft: int,
              num_layers: int | None = None) -> list[str] | None:
    """Roles of SGLang's KV entry list, or None when they cannot be derived exactly."""
    if groups > 1:
        if n % groups:
            return None
        per = n // groups
        if num_layers is not None:
            draft = per - num_layers
        else:
            draft = num_draft // groups if num_draft % groups == 0 else -1
        if draft < 0 or draft > per:
            return None
        roles = [f"g{g}" for g in range(groups) for _ in range(per - draft)]
        return roles + [f"draft_g{g}" for g in range(groups) for _ in range(draft)]
    if mla:
        if num_draft > n:
            return None
        return ["kv"] * (n - num_draft) + ["draft"] * num_draft
    if num_layers is None:
        if num_draft % 2 or (n - num_draft) % 2:
            return None
        layers, draft = (n - num_draft) // 2, num_draft // 2
    else:
        layers, draft = num_layers, n // 2 - num_layers
        if n % 2 or draft < 0:
            return None
    return ["k"] * layers + ["v"] * layers + ["draft_k"] * draft + ["draft_v"] * draft


def _tp_context(rank: Any, size: Any, what: str) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` as SGLang uses them: the rank modulo the attention TP size (with
    DP attention a global rank exceeds the size); an unset size (0 or None) is 1."""
    tp_size = int(size or 1)
    if tp_size < 1:
        raise _core.LayoutError(f"{what} must be positive, got {size}")
    return int(rank or 0) % tp_size, tp_size


def layout_from_kv_args(kv_args: Any, *, is_mla_backend: bool, pp_size: int = 1,
                        attn_tp_size: int | None = None, state: bool = True) -> Layout:
    """The prefill peer's :class:`kvplan.Layout` from SGLang's ``KVArgs``.

    Page entries are ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens`` with
    ``kv_layer_ids`` (``[]`` means "not published"), in SGLang's order; roles are derived where
    SGLang's attributes determine them (``kv``/``draft`` for MLA, ``k``/``v``/``draft_k``/
    ``draft_v`` for MHA, ``g0``.. and ``draft_g0``.. for NPU buffer groups, ``kv_buf_groups``);
    ``num_draft_entries`` counts the appended draft entries. With ``state``, every Mamba state
    component (``state_types`` entry ``"mamba"``) is appended as state entries with role
    ``mamba<i>`` and its ``state_layer_ids`` (unpublished ids: ``None``).

    Context: ``page_size``, ``pp_rank`` / ``pp_size``; and with ``attn_tp_size`` (the manager's
    ``attn_tp_size``: ``KVArgs`` does not carry it) ``tp_size = attn_tp_size`` and
    ``tp_rank = engine_rank % attn_tp_size``, the local rank SGLang's head slicing uses. Without
    it the layout has no TP context (rank 0 of 1).

    Raises:
        LayoutError: The lists disagree in length, NPU groups are not a whole multiple of the
            entries (SGLang's ``len(ptrs) // kv_buf_groups`` would truncate), or
            ``attn_tp_size`` is not positive.
    """
    ptrs = list(kv_args.kv_data_ptrs)
    groups = int(getattr(kv_args, "kv_buf_groups", 1) or 1)
    if groups > 1 and len(ptrs) % groups:
        raise _core.LayoutError(
            f"{len(ptrs)} KV buffers are not a whole multiple of kv_buf_groups={groups}: "
            "refusing to truncate (SGLang divides with //)")
    num_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    if groups > 1:
        num_draft = groups * int(getattr(kv_args, "draft_kv_layers", 0) or 0)
    roles = _kv_roles(len(ptrs), mla=is_mla_backend, groups=groups, num_draft=num_draft)
    tp_rank, tp_size = (0, 1) if attn_tp_size is None else _tp_context(
        getattr(kv_args, "engine_rank", 0), attn_tp_size, "attn_tp_size")
    layout = Layout(
        ptrs, list(kv_args.kv_data_lens), list(kv_args.kv_item_lens),
        _ids(getattr(kv_args, "kv_layer_ids", None)), roles,
        page_size=int(getattr(kv_args, "page_size", 1) or 1),
        pp_rank=int(getattr(kv_args, "pp_rank", 0) or 0), pp_size=pp_size,
        tp_rank=tp_rank, tp_size=tp_size,
    )
    if state:
        layout = _with_mamba_state(layout, kv_args)
    return layout


def _with_mamba_state(layout: Layout, kv_args: Any) -> Layout:
    """``layout`` plus every Mamba component of ``kv_args`` as state entries."""
    types = list(getattr(kv_args, "state_types", None) or [])
    ptrs = list(getattr(kv_args, "state_data_ptrs", None) or [])
    lens = list(getattr(kv_args, "state_data_lens", None) or [])
    items = list(getattr(kv_args, "state_item_lens", None) or [])
    ids = list(getattr(kv_args, "state_layer_ids", None) or [])
    for i, st in enumerate(types):
        if str(getattr(st, "value", st)) != "mamba" or i >= len(ptrs):
            continue
        comp_ids = ids[i] if i < len(ids) and ids[i] else [None] * len(ptrs[i])
        n = len(ptrs[i])
        if all(x is not None for x in comp_ids):
            layer_ids: list[int] = [int(x) for x in comp_ids if x is not None]
            layout = layout.with_state(f"mamba{i}", list(ptrs[i]), list(lens[i]), list(items[i]),
                                       layer_ids)
            continue
        # Components without layer ids: with_state needs ids, so extend the entry lists.
        layout = Layout(
            layout.data_ptrs + list(ptrs[i]),
            layout.data_lens + list(lens[i]),
            layout.item_lens + list(items[i]),
            _merge_opt(layout.layer_ids, layout.n_entries, list(comp_ids)),
            _merge_opt(layout.roles, layout.n_entries, [f"mamba{i}"] * n, fill="kv"),
            kinds=list(layout.kinds) + ["state"] * n,
            drafts=layout.drafts + [False] * n,
            strides=layout.strides + list(items[i]),
            page_size=layout.page_size, device=layout.device,
            num_model_layers=layout.num_model_layers, pp_rank=layout.pp_rank,
            pp_size=layout.pp_size, tp_rank=layout.tp_rank, tp_size=layout.tp_size,
        )
    return layout


def _merge_opt(existing: Any, n_existing: int, extra: list[Any], fill: Any = None) -> Any:
    if existing is None and all(x is None for x in extra):
        return None
    head = list(existing) if existing is not None else [fill] * n_existing
    return head + extra


def layout_from_register_info(info: Any, *, is_mla_backend: bool, kv_buf_groups: int = 1,
                              num_draft_entries: int = 0, num_layers: int | None = None,
                              state_types: Sequence[Any] = ()) -> Layout:
    """The decode peer's :class:`kvplan.Layout` from SGLang's ``KVArgsRegisterInfo``.

    Page entries are ``dst_kv_ptrs`` with ``dst_kv_layer_ids`` and ``dst_kv_item_lens`` (the
    per-entry list SGLang 0.5.23 registers; an older peer's single ``dst_kv_item_len`` is used
    for every entry). The decode does not publish its buffer lengths, so every capacity is as
    large as the address space allows (index bounds are checked on the prefill side only).
    Roles as in :func:`layout_from_kv_args` where they are determined: for MHA the K/V split
    needs ``num_layers`` (target layers) unless ``num_draft_entries`` says how many entries are
    draft; otherwise roles are left out. ``state_types`` (the prefill's ``KVArgs.state_types``,
    parallel to ``dst_state_data_ptrs``) adds the Mamba components as state entries. TP context:
    ``tp_size = dst_attn_tp_size`` and ``tp_rank = dst_tp_rank % dst_attn_tp_size`` (with DP
    attention the decode publishes its global TP rank; SGLang uses it modulo the size).

    Raises:
        LayoutError: Lists disagree in length (e.g. item lengths not one per entry), or
            ``dst_attn_tp_size`` is negative.
    """
    ptrs = list(info.dst_kv_ptrs)
    items = list(getattr(info, "dst_kv_item_lens", None) or [])
    if not items:
        items = [int(info.dst_kv_item_len)] * len(ptrs)
    roles = _kv_roles(len(ptrs), mla=is_mla_backend, groups=kv_buf_groups,
                      num_draft=num_draft_entries, num_layers=num_layers)
    tp_rank, tp_size = _tp_context(getattr(info, "dst_tp_rank", 0),
                                   getattr(info, "dst_attn_tp_size", 1), "dst_attn_tp_size")
    layout = Layout(ptrs, _unbounded(ptrs), items, _ids(info.dst_kv_layer_ids), roles,
                    num_model_layers=num_layers, tp_rank=tp_rank, tp_size=tp_size)
    if state_types:
        state = _RegisterState(info, state_types)
        layout = _with_mamba_state(layout, state)
    return layout


class _RegisterState:
    """A decode registration's state lists under ``KVArgs``'s attribute names."""

    def __init__(self, info: Any, state_types: Sequence[Any]) -> None:
        self.state_types = list(state_types)
        self.state_data_ptrs = list(info.dst_state_data_ptrs or [])
        self.state_data_lens = [_unbounded(p) for p in self.state_data_ptrs]
        self.state_item_lens = list(info.dst_state_item_lens or [])
        self.state_layer_ids = list(info.dst_state_layer_ids or [])


# ---------------------------------------------------------------------------------------------
# Template cache, per decode peer
# ---------------------------------------------------------------------------------------------


class TemplateCache:
    """Templates per decode peer (SGLang's ``mooncake_session_id``), rebuilt when the inputs
    they were built from change (a peer that re-registers gets new templates on first use).

    Keys are ``(session, path)``; each entry keeps the inputs it was built from and is reused
    only when they compare equal. Thread-safe: SGLang runs several transfer workers.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[tuple[Any, ...], Any]] = {}
        self._lock = threading.Lock()

    def get(self, session: str, path: str, inputs: tuple[Any, ...],
            build: Callable[[], Any]) -> Any:
        key = (session, path)
        hit = self._entries.get(key)
        if hit is not None and hit[0] == inputs:
            return hit[1]
        value = build()
        frozen = tuple(list(x) if isinstance(x, list) else x for x in inputs)
        with self._lock:
            self._entries[key] = (frozen, value)
        return value

    def drop(self, session: str) -> None:
        """Forget every template of one decode peer."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == session]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def sessions(self) -> set[str]:
        return {k[0] for k in self._entries}


def template_cache(manager: Any) -> TemplateCache:
    """The manager's :class:`TemplateCache` (created on first use, stored on the instance).

    An object without an instance ``__dict__`` (``__slots__``) gets a fresh, unstored cache, so
    its templates are rebuilt per call: SGLang's methods accept such objects, so kvplan's do.
    """
    attrs = getattr(manager, "__dict__", None)
    if attrs is None:
        return TemplateCache()
    cache = attrs.get("_kvplan_templates")
    if cache is None:  # setdefault: two transfer workers may get here at once
        cache = attrs.setdefault("_kvplan_templates", TemplateCache())
    if not isinstance(cache, TemplateCache):
        raise TypeError(f"_kvplan_templates on {type(manager).__name__} is a "
                        f"{type(cache).__name__}, not kvplan's TemplateCache")
    return cache


def _instance_setting(manager: Any, name: str) -> Any:
    """A kvplan setting stored on the instance itself (``None`` when absent), without asking
    the object's ``__getattr__``."""
    attrs = getattr(manager, "__dict__", None)
    return None if attrs is None else attrs.get(name)


# ---------------------------------------------------------------------------------------------
# SGLang's seams: the methods its send paths call on ``self``
# ---------------------------------------------------------------------------------------------

#: Methods SGLang's replaced send paths call on ``self`` and kvplan's fast path stands in for.
#: When a manager resolves one of them to anything but SGLang's own function (a subclass
#: override, an instance attribute, a tracing wrapper, a test's recorder), kvplan calls it as
#: SGLang would: blocks go through ``_transfer_data`` and ``_await_transfer_futures``, and a
#: replaced pointer-slicing method hands the call to SGLang's own send method.
SEAMS = ("_transfer_data", "_await_transfer_futures", "get_mla_kv_ptrs_with_pp",
         "_mla_kv_entry_span_with_pp", "get_mha_kv_ptrs_with_pp")

_MOONCAKE, _ASCEND = "MooncakeKVManager", "AscendKVManager"
# SGLang's manager classes by name, as found in the MRO of the classes passed to install()
_SGLANG_CLASSES: dict[str, type] = {}
# SGLang's manager class name -> the globals of the module that defines it
_SGLANG_GLOBALS: dict[str, dict[str, Any]] = {}
# seam name -> {SGLang's function: name of the SGLang class that defines it}
_SGLANG_IMPLS: dict[str, dict[Any, str]] = {name: {} for name in SEAMS}


def _function(value: Any) -> Any:
    """The plain function behind a bound method, staticmethod or classmethod."""
    if isinstance(value, (types.MethodType, staticmethod, classmethod)):
        return value.__func__
    return value


def _class_attr(cls: type, name: str) -> tuple[type, Any] | None:
    """``(defining class, raw value)`` of ``name`` in ``cls``'s MRO, without descriptors."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass, klass.__dict__[name]
    return None


def _register_sglang_classes(cls: type) -> None:
    """Remember SGLang's manager classes in ``cls``'s MRO and their seam functions."""
    for klass in cls.__mro__:
        if klass.__name__ not in (_MOONCAKE, _ASCEND) or klass.__name__ in _SGLANG_CLASSES:
            continue
        _SGLANG_CLASSES[klass.__name__] = klass
        _SGLANG_GLOBALS[klass.__name__] = _function(
            _resolve_original(klass, "send_kvcache")).__globals__
        for name in SEAMS:
            found = _class_attr(klass, name)
            if found is not None:
                _SGLANG_IMPLS[name][_function(found[1])] = found[0].__name__


def _sglang_impl(manager: Any, name: str) -> str | None:
    """The SGLang class whose own ``name`` ``manager`` resolves to (instance attribute first,
    as Python looks it up), or None when it resolves to anything else or nothing."""
    attrs = getattr(manager, "__dict__", None)
    if attrs is not None and name in attrs:
        value = attrs[name]
    else:  # the class's attribute as Python resolves it (a function, for a plain method)
        value = getattr(type(manager), name, None)
    try:
        return _SGLANG_IMPLS[name].get(_function(value))
    except TypeError:  # an unhashable callable is not SGLang's
        return None


def _own_transfer_data(manager: Any) -> bool:
    return _sglang_impl(manager, "_transfer_data") is not None


def _mla_slicer(manager: Any) -> str | None:
    """Which of SGLang's ``get_mla_kv_ptrs_with_pp`` the manager uses: ``"common"`` (with the
    common ``_mla_kv_entry_span_with_pp``), ``"ascend"`` (NPU buffer groups), or None for
    anything else (kvplan then hands the call to SGLang's own method)."""
    impl = _sglang_impl(manager, "get_mla_kv_ptrs_with_pp")
    if impl == _ASCEND:
        return "ascend"
    if impl is not None and _sglang_impl(manager, "_mla_kv_entry_span_with_pp") is not None:
        return "common"
    return None


def _own_mha_slicer(manager: Any) -> bool:
    return _sglang_impl(manager, "get_mha_kv_ptrs_with_pp") is not None


def _sglang_method(manager: Any, name: str, kind: str) -> Any:
    """SGLang's own ``name`` for ``manager``: the original kvplan replaced on the nearest
    installed class in its MRO, else (an object of another class, called unbound, e.g. a test's
    recorder) the one of SGLang's ``kind`` class."""
    for klass in type(manager).__mro__:
        original = _ORIGINALS.get((klass, name))
        if original is not None:
            return original
    base = _SGLANG_CLASSES.get(kind)
    if base is None:
        raise RuntimeError(f"kvplan's {name} runs only after install({kind}) (or a subclass)")
    return _resolve_original(base, name)


def _sglang_global(name: str, kind: str = _MOONCAKE) -> Any:
    """A global of the SGLang module that defines the ``kind`` class (e.g. ``get_memory``,
    ``logger``), read when needed, as SGLang's methods read it."""
    return _SGLANG_GLOBALS[kind][name]


def _status(value: Any) -> int:
    """An engine or seam status, returned unchanged as SGLang returns it."""
    return cast(int, value)


# ---------------------------------------------------------------------------------------------
# Planning: SGLang's call -> Template
# ---------------------------------------------------------------------------------------------


def _kv_args_lens(kv_args: Any, ptrs: Sequence[int]) -> list[int]:
    """Source buffer lengths when ``ptrs`` are the manager's own KV buffers, else unbounded."""
    own = getattr(kv_args, "kv_data_ptrs", None)
    lens = getattr(kv_args, "kv_data_lens", None)
    if own is not None and lens is not None and list(own) == list(ptrs):
        return list(lens)
    return _unbounded(ptrs)


def _registered_item_lens(manager: Any, session: str, dst_ptrs: Sequence[int]) -> list[int] | None:
    """The decode's per-entry item lengths, when its registration for ``session`` covers
    exactly ``dst_ptrs``."""
    table = getattr(manager, "decode_kv_args_table", None) or {}
    info = table.get(session)
    if info is None:
        return None
    items = list(getattr(info, "dst_kv_item_lens", None) or [])
    if len(items) != len(dst_ptrs) or list(info.dst_kv_ptrs) != list(dst_ptrs):
        return None
    return items


def _dst_item_lens(pairs: Any, src_items: Sequence[int], n_dst: int,
                   known: list[int] | None) -> list[int]:
    """Decode item lengths: the registered ones, else the source's for each paired entry (the
    stride SGLang assumes) and 0 (never emitted) for unpaired ones."""
    if known is not None:
        return known
    items = [0] * n_dst
    for i, j in pairs.tolist():
        items[j] = int(src_items[i])
    return items


def _decode_kv_layers(manager: Any) -> int | None:
    value = _instance_setting(manager, "kvplan_decode_kv_layers")
    if value is None:
        value = getattr(type(manager), "_kvplan_decode_kv_layers", None)
    return None if value is None else int(value)


def _legacy_mha(manager: Any, src_ptrs: list[int], dst_ptrs: list[int], items: list[int],
                src_lens: list[int], known: list[int] | None) -> Template:
    """SGLang's ``get_mha_kv_ptrs_with_pp`` (K block then V block), strict."""
    start = int(manager.kv_args.prefill_start_layer)
    n_src, n_dst = len(src_ptrs), len(dst_ptrs)
    decode_layers = _decode_kv_layers(manager)
    if n_src % 2 == 0 and n_dst % 2 == 0 and n_src == n_dst:
        decode_layers = n_dst // 2  # equal halves: K with K, V with V, whatever the count says
    pairs = _core.legacy_pp_pairs("mha", n_src, n_dst, start, decode_num_layers=decode_layers)
    src = Layout(src_ptrs, src_lens, items)
    dst = Layout(dst_ptrs, _unbounded(dst_ptrs), _dst_item_lens(pairs, items, n_dst, known),
                 num_model_layers=decode_layers)
    return Template(src, dst, prefill_start_layer=start, legacy_kind="mha")


def _ascend_groups(kv_args: Any) -> tuple[int, int, int]:
    """``kv_buf_groups``, ``hidden_kv_layers``, ``draft_kv_layers`` with SGLang's defaults."""
    return (int(getattr(kv_args, "kv_buf_groups", 1) or 1),
            int(getattr(kv_args, "hidden_kv_layers", 0) or 0),
            int(getattr(kv_args, "draft_kv_layers", 0) or 0))


def _legacy_mla_inputs(manager: Any, slicer: str, n_src: int, n_dst: int) -> tuple[Any, ...]:
    """What SGLang's ``get_mla_kv_ptrs_with_pp`` reads for these entry counts, read as it
    reads them (the start layer and PP rank only when the counts differ)."""
    kv_args = manager.kv_args
    if slicer == "ascend":
        groups, hidden, draft = _ascend_groups(kv_args)
        if n_src // groups == n_dst // groups:
            return (slicer, groups)
        return (slicer, groups, hidden, draft, int(kv_args.prefill_start_layer),
                _is_last_rank(manager) and draft > 0)
    if n_src == n_dst:
        return (slicer,)
    return (slicer, int(getattr(kv_args, "num_draft_entries", 0) or 0),
            int(kv_args.prefill_start_layer))


def _legacy_mla(src_ptrs: list[int], dst_ptrs: list[int], items: list[int], src_lens: list[int],
                known: list[int] | None, how: tuple[Any, ...]) -> Template:
    """SGLang's ``get_mla_kv_ptrs_with_pp``, the common one or the Ascend NPU-group one, from
    what :func:`_legacy_mla_inputs` read."""
    n_src, n_dst = len(src_ptrs), len(dst_ptrs)
    if how[0] == "ascend":
        groups = how[1]
        for side, n in (("prefill", n_src), ("decode", n_dst)):
            if n % groups:
                raise _core.LayoutError(
                    f"{side} registered {n} KV buffers, not a whole multiple of "
                    f"kv_buf_groups={groups}: refusing to truncate (SGLang divides with //)")
        if len(how) == 2:  # as many layers per group on both sides: entry i to entry i
            src = Layout(src_ptrs, src_lens, items)
            pairs = _core.pair_entries(None, None, n_src, n_dst, True)
            dst = Layout(dst_ptrs, _unbounded(dst_ptrs),
                         _dst_item_lens(pairs, items, n_dst, known))
            return Template(src, dst, allow_positional_fallback=True)
        _, _, hidden, draft_layers, start, sends_draft = how
        src_draft = draft_layers if sends_draft else 0
        if n_dst != groups * (hidden + draft_layers):
            raise _core.LayoutError(
                f"decode registered {n_dst} KV buffers; {groups} groups of hidden_kv_layers="
                f"{hidden} plus draft_kv_layers={draft_layers} make "
                f"{groups * (hidden + draft_layers)}: SGLang would slice the wrong buffers")
        src_roles = _kv_roles(n_src, mla=True, groups=groups, num_draft=groups * src_draft)
        dst_roles = _kv_roles(n_dst, mla=True, groups=groups, num_draft=groups * draft_layers)
        if src_roles is None or dst_roles is None:
            raise _core.LayoutError(
                f"prefill has {n_src} KV buffers in {groups} groups with {src_draft} draft "
                "layers per group: the buffers do not split into those groups")
        src = Layout(src_ptrs, src_lens, items, roles=src_roles)
        pairs = _partners(src, Layout(dst_ptrs, _unbounded(dst_ptrs), 0, roles=dst_roles), start)
        dst = Layout(dst_ptrs, _unbounded(dst_ptrs), _dst_item_lens(pairs, items, n_dst, known),
                     roles=dst_roles)
        return Template(src, dst, prefill_start_layer=start, legacy_kind="mla")
    num_draft, start = (how[1], how[2]) if len(how) == 3 else (0, 0)
    pairs = _core.legacy_pp_pairs("mla", n_src, n_dst, start, num_draft_entries=num_draft)
    roles = _kv_roles(n_src, mla=True, groups=1, num_draft=num_draft)
    src = Layout(src_ptrs, src_lens, items, roles=roles)
    dst = Layout(dst_ptrs, _unbounded(dst_ptrs), _dst_item_lens(pairs, items, n_dst, known))
    return Template(src, dst, prefill_start_layer=start, legacy_kind="mla")


def _is_last_rank(manager: Any) -> bool:
    """SGLang's ``get_parallel().pp_group.is_last_rank``, from the module of the Ascend
    ``get_mla_kv_ptrs_with_pp`` that reads it."""
    return bool(_sglang_global("get_parallel", _ASCEND)().pp_group.is_last_rank)


def _partners(src: Layout, dst_probe: Layout, start: int) -> npt.NDArray[np.int64]:
    """``(n, 2)`` (prefill entry, decode entry) pairs exactly as the template built below pairs
    them (the core's per-role legacy slicing), from a decode layout whose item lengths are not
    known yet: used only to derive those lengths. Entries without a partner are left out; the
    template reports them."""
    rows = _core.check_pairs(src, dst_probe, prefill_start_layer=start, legacy_kind="mla")
    out = [(i, j) for _, i, j, _ in rows if j is not None]
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _ids_template(manager: Any, session: str, path: str, src_ptrs: list[int],
                  dst_ptrs: list[int], items: list[int], src_ids: list[int] | None,
                  dst_ids: list[int] | None, fallback: bool) -> Template:
    """Pairing by layer id (positional fallback when SGLang allows it), cached per peer."""
    kv_args = getattr(manager, "kv_args", None)
    known = _registered_item_lens(manager, session, dst_ptrs)
    inputs = ("ids", src_ptrs, dst_ptrs, items, src_ids, dst_ids, fallback, known)

    def build() -> Template:
        pairs = _core.pair_entries(src_ids, dst_ids, len(src_ptrs), len(dst_ptrs), fallback)
        src = Layout(src_ptrs, _kv_args_lens(kv_args, src_ptrs), items, src_ids)
        dst = Layout(dst_ptrs, _unbounded(dst_ptrs),
                     _dst_item_lens(pairs, items, len(dst_ptrs), known), dst_ids)
        return Template(src, dst, allow_positional_fallback=fallback)

    return cast(Template, template_cache(manager).get(session, path, inputs, build))


def _positional_template(manager: Any, session: str, path: str, src_ptrs: list[int],
                         dst_ptrs: list[int], items: list[int], slicer: str) -> Template:
    """SGLang's positional slicing (``slicer``: ``"common"`` / ``"ascend"`` MLA, ``"mha"``, or
    ``"flat"`` for entry ``i`` to entry ``i``), cached per peer."""
    kv_args = manager.kv_args
    known = _registered_item_lens(manager, session, dst_ptrs)
    how: tuple[Any, ...]
    if slicer == "mha":
        how = (slicer, int(kv_args.prefill_start_layer), _decode_kv_layers(manager))
    elif slicer == "flat":
        how = (slicer,)
    else:
        how = _legacy_mla_inputs(manager, slicer, len(src_ptrs), len(dst_ptrs))
    inputs = (how, src_ptrs, dst_ptrs, items, known)

    def build() -> Template:
        src_lens = _kv_args_lens(kv_args, src_ptrs)
        if slicer == "mha":
            return _legacy_mha(manager, src_ptrs, dst_ptrs, items, src_lens, known)
        if slicer == "flat":
            pairs = _core.pair_entries(None, None, len(src_ptrs), len(dst_ptrs), True)
            dst = Layout(dst_ptrs, _unbounded(dst_ptrs),
                         _dst_item_lens(pairs, items, len(dst_ptrs), known))
            return Template(Layout(src_ptrs, src_lens, items), dst,
                            allow_positional_fallback=True)
        return _legacy_mla(src_ptrs, dst_ptrs, items, src_lens, known, how)

    return cast(Template, template_cache(manager).get(session, path, inputs, build))


def _as_index(arr: Any) -> npt.NDArray[Any]:
    a = np.asarray(arr)
    if a.dtype in (np.int32, np.int64) and a.dtype.isnative and a.flags.c_contiguous \
            and a.flags.aligned:
        return a
    if a.dtype.kind not in "iu":
        raise TypeError(f"page indices must be integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _page_arrays(src_pages: Any, dst_pages: Any) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    src, dst = _as_index(src_pages), _as_index(dst_pages)
    if src.shape != dst.shape:
        # SGLang: ValueError for different non-zero sizes, and no runs at all (nothing sent,
        # status 0) when exactly one side is empty.
        raise _core.KvPlanError(
            f"prefill and decode page index arrays differ in length ({src.size} and "
            f"{dst.size}); SGLang drops every page when one side is empty")
    return src, dst


# ---------------------------------------------------------------------------------------------
# Submission: kvplan's bounded engine batches, or SGLang's seams
# ---------------------------------------------------------------------------------------------


def _max_blocks(manager: Any) -> int:
    value = _instance_setting(manager, "kvplan_max_blocks_per_batch")
    if value is None:
        value = getattr(type(manager), "_kvplan_max_blocks_per_batch",
                        DEFAULT_MAX_BLOCKS_PER_BATCH)
    return int(value)


def _blocks(plan: TransferPlan, which: slice = slice(None)) -> list[tuple[int, int, int]]:
    """Blocks as SGLang hands them to ``_transfer_data``: ``(src, dst, length)`` tuples."""
    return list(zip(plan.src_addrs[which].tolist(), plan.dst_addrs[which].tolist(),
                    plan.lengths[which].tolist()))


def _engine_batches(manager: Any, session: str, plan: TransferPlan) -> int:
    """The fast path: the plan's arrays to ``manager.engine`` in bounded batches (what SGLang's
    own ``_transfer_data`` does with its one list); the first non-zero status is returned and
    later batches are not submitted."""
    if plan.n_blocks == 0:
        return 0
    engine = manager.engine
    for batch in plan.batches(_max_blocks(manager)):
        src, dst, lengths = batch.as_lists()
        status = engine.batch_transfer_sync(session, src, dst, lengths)
        if status != 0:
            return _status(status)
    return 0


def _send_all(manager: Any, session: str, plan: TransferPlan) -> int:
    """All blocks of one call: the fast path when ``_transfer_data`` is SGLang's own, else one
    ``_transfer_data(session, blocks)`` call, as SGLang makes it."""
    if _own_transfer_data(manager):
        return _engine_batches(manager, session, plan)
    return _status(manager._transfer_data(session, _blocks(plan)))


def _send_index_windows(manager: Any, session: str, template: Template,
                        src: npt.NDArray[Any], dst: npt.NDArray[Any]) -> int:
    """``_send_kvcache_generic``'s submission through a replaced ``_transfer_data``: one call,
    or, with ``max_transfer_batch_indices``, one call per window of that many page positions,
    each window planned on its own (SGLang's runs break at window edges too)."""
    window = manager.max_transfer_batch_indices
    if window <= 0 or src.size <= window:
        return _status(manager._transfer_data(session, _blocks(template.plan(src, dst))))
    for start in range(0, src.size, window):
        part = template.plan(src[start:start + window], dst[start:start + window])
        status = manager._transfer_data(session, _blocks(part))
        if status != 0:
            return _status(status)
    return 0


def _send_per_pair(manager: Any, session: str, plan: TransferPlan, executor: Any, *,
                   through_transfer_data: bool, await_with_manager: bool) -> int:
    """One executor task per entry pair (SGLang: one per layer). Each task hands its blocks to
    ``_transfer_data`` when that is the call's seam and it is not SGLang's own, else straight
    to the engine. Awaited with the manager's ``_await_transfer_futures`` where SGLang does,
    else SGLang's Ascend loop (first non-zero status, the rest cancelled)."""
    seam = through_transfer_data and not _own_transfer_data(manager)

    def one(pair: int) -> int:
        which = plan.pair_blocks(pair)
        if seam:
            return _status(manager._transfer_data(session, _blocks(plan, which)))
        src = plan.src_addrs[which].tolist()
        if not src:
            return 0
        return _status(manager.engine.batch_transfer_sync(
            session, src, plan.dst_addrs[which].tolist(), plan.lengths[which].tolist()))

    futures = [executor.submit(one, p) for p in range(plan.n_pairs)]
    if await_with_manager:
        return _status(manager._await_transfer_futures(futures))
    for future in concurrent.futures.as_completed(futures):
        status = future.result()
        if status != 0:
            for f in futures:
                f.cancel()
            return _status(status)
    return 0


# ---------------------------------------------------------------------------------------------
# The drop-in methods
# ---------------------------------------------------------------------------------------------


def _send_kvcache_generic(
    self: Any,
    mooncake_session_id: str,
    src_data_ptrs: list[int],
    dst_data_ptrs: list[int],
    item_lens: list[int],
    prefill_data_indices: Any,
    dst_data_indices: Any,
    executor: Any,
    state_type: Any = None,
    force_flat: bool = False,
    src_layer_ids: list[int] | None = None,
    dst_layer_ids: list[int] | None = None,
    dst_device_data_indices: Any = None,
    dst_device_data_ptrs: set[int] | None = None,
    dst_item_lens: list[int] | None = None,
    bootstrap_room: int | None = None,
) -> int:
    """kvplan's ``MooncakeKVManager._send_kvcache_generic`` (SGLang 0.5.23 signature)."""

    def sglangs() -> int:
        original = _sglang_method(self, "_send_kvcache_generic", _MOONCAKE)
        return _status(original(
            self, mooncake_session_id, src_data_ptrs, dst_data_ptrs, item_lens,
            prefill_data_indices, dst_data_indices, executor, state_type, force_flat,
            src_layer_ids, dst_layer_ids, dst_device_data_indices, dst_device_data_ptrs,
            dst_item_lens, bootstrap_room))

    if state_type is not None or dst_device_data_indices is not None or dst_item_lens is not None:
        return sglangs()
    src_ptrs, dst_ptrs, items = list(src_data_ptrs), list(dst_data_ptrs), list(item_lens)
    src_ids, dst_ids = _ids(src_layer_ids), _ids(dst_layer_ids)
    session = mooncake_session_id
    # SGLang's branch, reading what it reads in its order.
    if self.is_mla_backend or self.is_hybrid_mla_backend or force_flat or src_ids or dst_ids:
        if src_ids or dst_ids:
            template = _ids_template(self, session, "kv", src_ptrs, dst_ptrs, items, src_ids,
                                     dst_ids, self.pp_size == 1)
        else:
            slicer = _mla_slicer(self)
            if slicer is None or (len(src_ptrs) != len(dst_ptrs) and getattr(
                    self.kv_args, "mla_compression_ratios", None)):
                return sglangs()  # a replaced slicer, or compressed MLA: SGLang's own path
            template = _positional_template(self, session, "kv", src_ptrs, dst_ptrs, items,
                                            slicer)
    else:
        if not _own_mha_slicer(self):
            return sglangs()
        template = _positional_template(self, session, "kv", src_ptrs, dst_ptrs, items, "mha")
    src, dst = _page_arrays(prefill_data_indices, dst_data_indices)
    if self.enable_custom_mem_pool and getattr(self, "custom_mem_pool_type",
                                               None) != "INTRA_NODE_NVLINK":
        return _send_per_pair(self, session, template.plan(src, dst), executor,
                              through_transfer_data=True, await_with_manager=True)
    if _own_transfer_data(self):
        return _engine_batches(self, session, template.plan(src, dst))
    return _send_index_windows(self, session, template, src, dst)


def _slice_geometry(manager: Any, dst_tp_rank: int, dst_attn_tp_size: int,
                    dst_kv_item_len: int) -> dict[str, int]:
    """The attention geometry SGLang's ``send_kvcache_slice`` derives from the manager: total KV
    heads (``total_kv_head_num``, else ``kv_head_num * attn_tp_size``), both TP sizes and ranks
    (modulo their sizes), the page size, and the bytes of one head of one token, which SGLang
    takes from the decode's item (``dst_kv_item_len // page_size // dst_heads_per_rank``)."""
    kv_args = manager.kv_args
    page = int(kv_args.page_size)
    heads = int(getattr(kv_args, "total_kv_head_num", 0) or 0)
    if heads <= 0:
        heads = int(kv_args.kv_head_num) * int(manager.attn_tp_size)
    tp_d = int(dst_attn_tp_size)
    dst_hpr = max(1, heads // tp_d)
    tp_p = int(manager.attn_tp_size)
    return dict(heads=heads, tp_p=tp_p, r_p=int(kv_args.engine_rank) % tp_p, tp_d=tp_d,
                r_d=int(dst_tp_rank) % tp_d, page=page, src_hpr=max(1, heads // tp_p),
                dst_hpr=dst_hpr, head_bytes=int(dst_kv_item_len) // page // dst_hpr)


def _slice_template(manager: Any, session: str, dst_ptrs: list[int], dst_item: int,
                    dst_ids: list[int] | None, g: dict[str, int]) -> Template:
    """The head-sliced template of one ``send_kvcache_slice`` call (cached per decode peer).

    Both layouts are NHD (token-major items, SGLang's MHA pools) with ``kv_heads``,
    ``heads_per_rank``, ``head_dim`` = bytes per head and ``dtype_size`` = 1 (SGLang knows only
    their product), the prefill's page size on both sides (the decode publishes none) and both
    TP ranks. A prefill rank holding replicated heads is planned as the replica kvplan elects
    for this decode rank (``r_p`` with ``r_p % R == r_d % R`` in the same group of ``R``
    holders): it holds the same heads at the same offsets, so the bytes are this rank's own,
    and every prefill rank SGLang's decode asks for its heads sends them, as in SGLang.
    """
    kv_args = manager.kv_args
    src_ptrs, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_item_lens)
    src_ids = _ids(kv_args.kv_layer_ids)
    by_id = bool(src_ids or dst_ids)
    # SGLang reads the PP size only to pair by id, the start layer only to slice positionally.
    pp_fallback = manager.pp_size == 1 if by_id else None
    start = None if by_id else int(kv_args.prefill_start_layer)
    src_lens = _kv_args_lens(kv_args, src_ptrs)
    inputs: tuple[Any, ...] = (
        src_ptrs, dst_ptrs, items, dst_item, src_ids, dst_ids, pp_fallback, start,
        tuple(sorted(g.items())), _decode_kv_layers(manager), src_lens)

    def build() -> Template:
        heads, tp_p, tp_d, r_d = g["heads"], g["tp_p"], g["tp_d"], g["r_d"]
        replicas = max(1, tp_p // heads)
        r_p = g["r_p"]
        if replicas > 1:
            r_p = r_p // replicas * replicas + r_d % replicas
        geometry: dict[str, Any] = dict(page_size=g["page"], kv_heads=heads,
                                        head_dim=g["head_bytes"], dtype_size=1,
                                        memory_order="NHD")
        n_src, n_dst = len(src_ptrs), len(dst_ptrs)
        if by_id:
            src = Layout(src_ptrs, src_lens, items, src_ids, tp_rank=r_p, tp_size=tp_p,
                         heads_per_rank=g["src_hpr"], **geometry)
            dst = Layout(dst_ptrs, _unbounded(dst_ptrs), [dst_item] * n_dst, dst_ids,
                         tp_rank=r_d, tp_size=tp_d, heads_per_rank=g["dst_hpr"], **geometry)
            template = Template(src, dst, allow_positional_fallback=bool(pp_fallback))
        else:
            decode_layers = _decode_kv_layers(manager)
            if n_src % 2 == 0 and n_dst % 2 == 0 and n_src == n_dst:
                decode_layers = n_dst // 2
            src = Layout(src_ptrs, src_lens, items, tp_rank=r_p, tp_size=tp_p,
                         heads_per_rank=g["src_hpr"], **geometry)
            dst = Layout(dst_ptrs, _unbounded(dst_ptrs), [dst_item] * n_dst,
                         num_model_layers=decode_layers, tp_rank=r_d, tp_size=tp_d,
                         heads_per_rank=g["dst_hpr"], **geometry)
            template = Template(src, dst, prefill_start_layer=start, legacy_kind="mha")
        if template.empty_reason is not None:
            raise _core.PairingError(
                f"send_kvcache_slice: prefill rank {g['r_p']} of TP {tp_p} has no KV heads for "
                f"decode rank {r_d} of TP {tp_d}: {template.empty_reason} (SGLang would write "
                "this rank's heads into the decode's slots of other heads)")
        return template

    return cast(Template, template_cache(manager).get(session, "slice", inputs, build))


def send_kvcache_slice(
    self: Any,
    mooncake_session_id: str,
    prefill_kv_indices: Any,
    dst_kv_ptrs: list[int],
    dst_kv_indices: Any,
    dst_tp_rank: int,
    dst_attn_tp_size: int,
    dst_kv_item_len: int,
    executor: Any,
    dst_layer_ids: list[int] | None = None,
) -> int:
    """kvplan's ``MooncakeKVManager.send_kvcache_slice`` (SGLang 0.5.23 signature).

    Prefill and decode attention TP sizes differ (MHA): the KV heads this prefill rank and
    decode rank ``dst_tp_rank`` have in common move as one block per token slot and entry pair
    (maximal runs merged), planned by a head-sliced :class:`kvplan.Template` cached per decode
    peer and submitted through ``self.engine`` in bounded batches (per entry pair through the
    executor and ``self._await_transfer_futures`` when that method is not SGLang's own). SGLang's
    two failure statuses are kept (``-1`` with SGLang's log message): KV entries of different
    item lengths when layer ids are published, and a head slice larger than the decode's token
    slot.

    Differences from SGLang's method (which submits one executor task per layer pair and
    derives every offset from the decode's item length):

    * A prefill item length that is not ``page_size * heads_per_rank * head_bytes`` (the head
      size SGLang derives from the decode's item), a decode item length not divisible that way,
      or head and TP counts of which neither divides the other: ``SizeMismatchError`` (SGLang
      truncates and reads or writes at wrong offsets).
    * A prefill rank that holds none of the decode rank's heads: ``PairingError`` (SGLang writes
      this rank's heads into the decode's slots for other heads).
    * Page index arrays of different lengths: ``KvPlanError``; prefill pages outside
      ``kv_data_lens``: ``IndexBoundsError`` (SGLang reads outside the buffer).
    """
    g = _slice_geometry(self, dst_tp_rank, dst_attn_tp_size, dst_kv_item_len)
    dst_ids = _ids(dst_layer_ids)
    if not (_ids(self.kv_args.kv_layer_ids) or dst_ids) and not _own_mha_slicer(self):
        original = _sglang_method(self, "send_kvcache_slice", _MOONCAKE)
        return _status(original(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                                dst_kv_indices, dst_tp_rank, dst_attn_tp_size,
                                dst_kv_item_len, executor, dst_layer_ids))
    logger = _sglang_global("logger")
    items = list(self.kv_args.kv_item_lens)
    if (_ids(self.kv_args.kv_layer_ids) or dst_ids) and any(n != items[0] for n in items):
        logger.error(
            f"[{mooncake_session_id}] head-sliced transfer assumes one item "
            f"length for every KV entry, got {set(items)}")
        return -1
    num_heads = g["src_hpr"] if g["tp_p"] > g["tp_d"] else g["dst_hpr"]
    slot = int(dst_kv_item_len) // g["page"]
    if num_heads * g["head_bytes"] > slot:
        logger.error(
            f"[{mooncake_session_id}] slice size ({num_heads * g['head_bytes']}) exceeds "
            f"target token slot size ({slot})")
        return -1
    template = _slice_template(self, mooncake_session_id, list(dst_kv_ptrs),
                               int(dst_kv_item_len), dst_ids, g)
    plan = template.plan(*_page_arrays(prefill_kv_indices, dst_kv_indices))
    # SGLang's slice hands each layer pair to the engine itself (no ``_transfer_data``) and
    # awaits the executor's tasks with ``_await_transfer_futures``.
    if _sglang_impl(self, "_await_transfer_futures") is None:
        return _send_per_pair(self, mooncake_session_id, plan, executor,
                              through_transfer_data=False, await_with_manager=True)
    return _engine_batches(self, mooncake_session_id, plan)


def send_kvcache(
    self: Any,
    mooncake_session_id: str,
    prefill_kv_indices: Any,
    dst_kv_ptrs: list[int],
    dst_kv_indices: Any,
    executor: Any,
    dst_layer_ids: list[int] | None = None,
    dst_device_kv_indices: Any = None,
    dst_kv_item_len: int | None = None,
    dst_attn_tp_size: int | None = None,
) -> int:
    """kvplan's ``MooncakeKVManager.send_kvcache`` (SGLang 0.5.23 signature): SGLang's envelope
    check, then ``self._send_kvcache_generic`` with SGLang's keyword arguments."""
    if dst_device_kv_indices is not None:  # HiSparse device destinations: SGLang's own path
        original = _sglang_method(self, "send_kvcache", _MOONCAKE)
        return _status(original(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                                dst_kv_indices, executor, dst_layer_ids, dst_device_kv_indices,
                                dst_kv_item_len, dst_attn_tp_size))
    self._validate_envelope_kv_layout(dst_kv_ptrs, dst_kv_item_len, dst_attn_tp_size)
    get_memory = _sglang_global("get_memory")
    return _status(self._send_kvcache_generic(
        mooncake_session_id=mooncake_session_id,
        src_data_ptrs=self.kv_args.kv_data_ptrs,
        dst_data_ptrs=dst_kv_ptrs,
        item_lens=self.kv_args.kv_item_lens,
        prefill_data_indices=prefill_kv_indices,
        dst_data_indices=dst_kv_indices,
        executor=executor,
        force_flat=get_memory().enable_unified_memory,
        src_layer_ids=self.kv_args.kv_layer_ids,
        dst_layer_ids=dst_layer_ids,
        dst_device_data_indices=None,
        dst_device_data_ptrs=None,
    ))


def ascend_send_kvcache(
    self: Any,
    mooncake_session_id: str,
    prefill_kv_indices: Any,
    dst_kv_ptrs: list[int],
    dst_kv_indices: Any,
    executor: Any,
    dst_layer_ids: list[int] | None = None,
    dst_device_kv_indices: Any = None,
    dst_kv_item_len: int | None = None,
    dst_attn_tp_size: int | None = None,
) -> int:
    """kvplan's ``AscendKVManager.send_kvcache`` (SGLang 0.5.23 signature and dispatch)."""
    if dst_device_kv_indices is not None:
        raise NotImplementedError(
            "Ascend PD transfer does not support HiSparse destination device KV indices")
    self._validate_envelope_kv_layout(dst_kv_ptrs, dst_kv_item_len, dst_attn_tp_size)
    if self.is_hybrid_mla_backend and self.pp_size > 1:
        return _status(self._send_kvcache_generic(
            mooncake_session_id=mooncake_session_id,
            src_data_ptrs=self.kv_args.kv_data_ptrs,
            dst_data_ptrs=dst_kv_ptrs,
            item_lens=self.kv_args.kv_item_lens,
            prefill_data_indices=prefill_kv_indices,
            dst_data_indices=dst_kv_indices,
            executor=executor,
            src_layer_ids=self.kv_args.kv_layer_ids,
            dst_layer_ids=dst_layer_ids,
        ))
    kv_args = self.kv_args
    src_ptrs, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_item_lens)
    dst_ptrs = list(dst_kv_ptrs)
    slicer: str | None = "flat"
    if self.pp_size > 1:
        if self.is_mla_backend:
            slicer = _mla_slicer(self)
            if getattr(kv_args, "mla_compression_ratios", None):
                slicer = None  # compressed MLA: SGLang's own slicing
        else:
            slicer = "mha" if _own_mha_slicer(self) else None
    if slicer is None:
        original = _sglang_method(self, "send_kvcache", _ASCEND)
        return _status(original(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                                dst_kv_indices, executor, dst_layer_ids, dst_device_kv_indices,
                                dst_kv_item_len, dst_attn_tp_size))
    template = _positional_template(self, mooncake_session_id, f"ascend-{slicer}", src_ptrs,
                                    dst_ptrs, items, slicer)
    plan = template.plan(*_page_arrays(prefill_kv_indices, dst_kv_indices))
    if self.enable_custom_mem_pool:
        return _send_per_pair(self, mooncake_session_id, plan, executor,
                              through_transfer_data=True, await_with_manager=False)
    return _send_all(self, mooncake_session_id, plan)


def _send_mamba_state(
    self: Any,
    req: Any,
    prefill_mamba_index: list[Any],
    src_state_data_ptrs: list[int],
    src_state_item_lens: list[int],
    dst_state_data_ptrs: list[int],
    dst_mamba_index: list[Any],
    src_layer_ids: list[int] | None = None,
    dst_layer_ids: list[int] | None = None,
    dst_state_item_lens: list[int] | None = None,
) -> int:
    """kvplan's ``MooncakeKVManager._send_mamba_state`` (SGLang 0.5.23 signature)."""
    assert len(prefill_mamba_index) == 1, "Mamba should have single state index"
    src_ptrs, dst_ptrs = list(src_state_data_ptrs), list(dst_state_data_ptrs)
    items = list(src_state_item_lens)
    known = list(dst_state_item_lens) if dst_state_item_lens else None
    fallback = self.pp_size == 1
    src_lens = _state_lens(getattr(self, "kv_args", None), src_ptrs)
    inputs = (src_ptrs, dst_ptrs, items, _ids(src_layer_ids), _ids(dst_layer_ids), known,
              fallback, src_lens)

    def build() -> Template:
        pairs = _core.pair_entries(_ids(src_layer_ids), _ids(dst_layer_ids), len(src_ptrs),
                                   len(dst_ptrs), fallback)
        if known is not None:
            for i, j in pairs.tolist():
                if items[i] != known[j]:
                    raise _core.SizeMismatchError(
                        "Prefill/Decode Mamba slot size mismatch "
                        f"(src={items[i]}, dst={known[j]}). "
                        "Configure matching persistent state layouts on both peers.")
        dst_items = _dst_item_lens(pairs, items, len(dst_ptrs), known)
        src = Layout(src_ptrs, src_lens, items, _ids(src_layer_ids),
                     kinds=["state"] * len(src_ptrs))
        dst = Layout(dst_ptrs, _unbounded(dst_ptrs), dst_items, _ids(dst_layer_ids),
                     kinds=["state"] * len(dst_ptrs))
        return Template(src, dst, allow_positional_fallback=fallback)

    session = req.mooncake_session_id
    template = cast(Template, template_cache(self).get(session, "mamba", inputs, build))
    plan = template.plan_state(int(prefill_mamba_index[0]), int(dst_mamba_index[0]))
    return _send_all(self, session, plan)


def _state_lens(kv_args: Any, ptrs: list[int]) -> list[int]:
    """Source slot-buffer lengths when ``ptrs`` is one of the manager's state components."""
    for comp_ptrs, comp_lens in zip(getattr(kv_args, "state_data_ptrs", None) or [],
                                    getattr(kv_args, "state_data_lens", None) or []):
        if list(comp_ptrs) == ptrs:
            return list(comp_lens)
    return _unbounded(ptrs)


# ---------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------

_MISSING = object()
# (class, method name) -> what the class's own __dict__ held before install (or _MISSING)
_SAVED: dict[tuple[type, str], Any] = {}
# (class, method name) -> SGLang's function that the class resolved before install
_ORIGINALS: dict[tuple[type, str], Any] = {}


def _dropin(fn: Callable[..., int]) -> Callable[..., int]:
    setattr(fn, "_kvplan_dropin", True)
    return fn


_DROPINS: dict[str, Callable[..., int]] = {
    "_send_kvcache_generic": _dropin(_send_kvcache_generic),
    "send_kvcache": _dropin(send_kvcache),
    "_send_mamba_state": _dropin(_send_mamba_state),
    "send_kvcache_slice": _dropin(send_kvcache_slice),
}
_ASCEND_DROPINS = dict(_DROPINS, send_kvcache=_dropin(ascend_send_kvcache))


def _resolve_original(cls: type, name: str) -> Any:
    """SGLang's function ``cls`` resolves ``name`` to, looking through kvplan's drop-ins."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            value = klass.__dict__[name]
            if getattr(value, "_kvplan_dropin", False):
                return _ORIGINALS[(klass, name)]
            return value
    raise AttributeError(f"{cls.__name__} has no method {name!r}")


def _original_for(cls: type, name: str) -> Any:
    """SGLang's own implementation of ``name`` for instances of ``cls`` (installed or not)."""
    for klass in cls.__mro__:
        if (klass, name) in _ORIGINALS:
            return _ORIGINALS[(klass, name)]
    return _resolve_original(cls, name)


def _manager_kind(cls: type) -> str:
    names = [k.__name__ for k in cls.__mro__]
    for kind in (_ASCEND, _MOONCAKE):
        if kind in names:
            return kind
    raise TypeError(
        f"{cls.__name__} is not an SGLang MooncakeKVManager or AscendKVManager (subclass)")


def install(manager_class: type, *, max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH,
            decode_kv_layers: int | None = None) -> tuple[str, ...]:
    """Replace ``manager_class``'s planning methods with kvplan's (see the module docstring).

    Args:
        manager_class: SGLang 0.5.23's ``MooncakeKVManager`` or ``AscendKVManager`` (or a
            subclass). Installing twice is a no-op for the methods already replaced.
        max_blocks_per_batch: Blocks per ``engine.batch_transfer_sync`` call.
        decode_kv_layers: The decode's target KV layer count (dense KV layers, without draft),
            needed only by MHA peers that publish no layer ids when the prefill's entry count
            differs from the decode's (PP > 1); SGLang guesses it from the counts, kvplan does
            not. An instance attribute ``kvplan_decode_kv_layers`` overrides it.

    Returns:
        The names of the methods replaced.
    """
    if max_blocks_per_batch <= 0:
        raise ValueError(f"max_blocks_per_batch must be positive, got {max_blocks_per_batch}")
    kind = _manager_kind(manager_class)
    _register_sglang_classes(manager_class)
    dropins = _ASCEND_DROPINS if kind == "AscendKVManager" else _DROPINS
    replaced = []
    for name in REPLACED_METHODS[kind]:
        key = (manager_class, name)
        if key in _SAVED:
            continue
        _ORIGINALS[key] = _resolve_original(manager_class, name)
        _SAVED[key] = manager_class.__dict__.get(name, _MISSING)
        setattr(manager_class, name, dropins[name])
        replaced.append(name)
    setattr(manager_class, "_kvplan_max_blocks_per_batch", max_blocks_per_batch)
    setattr(manager_class, "_kvplan_decode_kv_layers", decode_kv_layers)
    return tuple(replaced)


def uninstall(manager_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``manager_class``; returns the names."""
    restored = []
    for (klass, name) in list(_SAVED):
        if klass is not manager_class:
            continue
        saved = _SAVED.pop((klass, name))
        _ORIGINALS.pop((klass, name), None)
        if saved is _MISSING:
            delattr(klass, name)
        else:
            setattr(klass, name, saved)
        restored.append(name)
    for attr in ("_kvplan_max_blocks_per_batch", "_kvplan_decode_kv_layers"):
        if attr in manager_class.__dict__:
            delattr(manager_class, attr)
    return tuple(restored)


def installed(manager_class: type) -> tuple[str, ...]:
    """Names of the methods currently replaced on ``manager_class`` itself."""
    return tuple(name for (klass, name) in _SAVED if klass is manager_class)
