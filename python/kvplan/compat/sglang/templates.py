"""SGLang's call -> a cached :class:`kvplan.Template`: pairing by layer id, SGLang's positional
PP slicing (MHA, MLA, Ascend NPU groups), head-sliced MHA, the DCP token deal and Mamba state,
each reading only what SGLang's method reads; and the page index arrays of a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvplan import _core
from kvplan._core import Layout, Pairing, Template
from kvplan.compat.sglang.cache import template_cache
from kvplan.compat.sglang.layouts import published_ids, kv_roles, unbounded_lens
from kvplan.compat.sglang.registry import ASCEND_MANAGER, sglang_global
from kvplan.compat.sglang.seams import mla_slicer, owns_mha_slicer
from kvplan.compat.sglang.settings import setting_decode_kv_layers


def kv_args_lens(kv_args: Any, ptrs: Sequence[int]) -> list[int]:
    """Source buffer lengths when ``ptrs`` are the manager's own KV buffers or one of its state
    components' buffers, else unbounded."""
    own = getattr(kv_args, "kv_data_ptrs", None)
    lens = getattr(kv_args, "kv_data_lens", None)
    if own is not None and lens is not None and list(own) == list(ptrs):
        return list(lens)
    components = getattr(kv_args, "state_data_ptrs", None) or []
    component_lens = getattr(kv_args, "state_data_lens", None) or []
    for own, lens in zip(components, component_lens):
        if list(own) == list(ptrs) and len(lens) == len(ptrs):
            return list(lens)
    return unbounded_lens(ptrs)


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


def _legacy_mha(manager: Any, src_ptrs: list[int], dst_ptrs: list[int], items: list[int],
                src_lens: list[int], known: list[int] | None) -> Template:
    """SGLang's ``get_mha_kv_ptrs_with_pp`` (K block then V block), strict."""
    start = int(manager.kv_args.prefill_start_layer)
    n_src, n_dst = len(src_ptrs), len(dst_ptrs)
    decode_layers = setting_decode_kv_layers(manager)
    if n_src % 2 == 0 and n_dst % 2 == 0 and n_src == n_dst:
        decode_layers = n_dst // 2  # equal halves: K with K, V with V, whatever the count says
    pairs = _core.legacy_pp_pairs("mha", n_src, n_dst, start, decode_num_layers=decode_layers)
    src = Layout(src_ptrs, src_lens, items)
    dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs), _dst_item_lens(pairs, items, n_dst, known),
                 num_model_layers=decode_layers)
    return Template(src, dst, Pairing.by_layer_id(prefill_start_layer=start, legacy_kind="mha"))


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
            dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs),
                         _dst_item_lens(pairs, items, n_dst, known))
            return Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=True))
        _, _, hidden, draft_layers, start, sends_draft = how
        src_draft = draft_layers if sends_draft else 0
        if n_dst != groups * (hidden + draft_layers):
            raise _core.LayoutError(
                f"decode registered {n_dst} KV buffers; {groups} groups of hidden_kv_layers="
                f"{hidden} plus draft_kv_layers={draft_layers} make "
                f"{groups * (hidden + draft_layers)}: SGLang would slice the wrong buffers")
        src_roles = kv_roles(n_src, mla=True, groups=groups, num_draft=groups * src_draft)
        dst_roles = kv_roles(n_dst, mla=True, groups=groups, num_draft=groups * draft_layers)
        if src_roles is None or dst_roles is None:
            raise _core.LayoutError(
                f"prefill has {n_src} KV buffers in {groups} groups with {src_draft} draft "
                "layers per group: the buffers do not split into those groups")
        src = Layout(src_ptrs, src_lens, items, roles=src_roles)
        pairs = _partners(src, Layout(dst_ptrs, unbounded_lens(dst_ptrs), 0, roles=dst_roles), start)
        dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs), _dst_item_lens(pairs, items, n_dst, known),
                     roles=dst_roles)
        return Template(src, dst, Pairing.by_layer_id(prefill_start_layer=start, legacy_kind="mla"))
    num_draft, start = (how[1], how[2]) if len(how) == 3 else (0, 0)
    pairs = _core.legacy_pp_pairs("mla", n_src, n_dst, start, num_draft_entries=num_draft)
    roles = kv_roles(n_src, mla=True, groups=1, num_draft=num_draft)
    src = Layout(src_ptrs, src_lens, items, roles=roles)
    dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs), _dst_item_lens(pairs, items, n_dst, known))
    return Template(src, dst, Pairing.by_layer_id(prefill_start_layer=start, legacy_kind="mla"))


def _is_last_rank(manager: Any) -> bool:
    """SGLang's ``get_parallel().pp_group.is_last_rank``, from the module of the Ascend
    ``get_mla_kv_ptrs_with_pp`` that reads it."""
    return bool(sglang_global("get_parallel", ASCEND_MANAGER)().pp_group.is_last_rank)


def _partners(src: Layout, dst_probe: Layout, start: int) -> npt.NDArray[np.int64]:
    """``(n, 2)`` (prefill entry, decode entry) pairs exactly as the template built below pairs
    them (the core's per-role legacy slicing), from a decode layout whose item lengths are not
    known yet: used only to derive those lengths. Entries without a partner are left out; the
    template reports them."""
    rows = _core.check_pairs(
        src, dst_probe, Pairing.by_layer_id(prefill_start_layer=start, legacy_kind="mla"))
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
        src = Layout(src_ptrs, kv_args_lens(kv_args, src_ptrs), items, src_ids)
        dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs),
                     _dst_item_lens(pairs, items, len(dst_ptrs), known), dst_ids)
        return Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=fallback))

    return cast(Template, template_cache(manager).get(session, path, inputs, build))


def _state_template(manager: Any, session: str, state_type: Any, dst_elision: bool,
                    src_ptrs: list[int], dst_ptrs: list[int], items: list[int],
                    src_ids: list[int] | None, dst_ids: list[int] | None,
                    dst_items: list[int] | None) -> Template:
    """A page-indexed state component's template (SWA KV, DSA index-K, ...), pairing by layer
    id as SGLang's flat layout does. An entry elided on either side moves nothing: a source
    item of 0, and with ``dst_elision`` (SGLang allows it for DSA) a decode item of 0, whose
    pair kvplan then plans as elided (its source item 0) rather than as a size mismatch."""
    fallback = manager.pp_size == 1
    moving = list(items)
    if dst_elision and dst_items is not None:
        pairs = _core.pair_entries(src_ids, dst_ids, len(src_ptrs), len(dst_ptrs), fallback)
        for i, j in pairs.tolist():
            if j < len(dst_items) and dst_items[j] == 0:
                moving[i] = 0
    return _ids_template(manager, session, f"state:{state_type}", src_ptrs, dst_ptrs, moving,
                         src_ids, dst_ids, fallback)


def _positional_template(manager: Any, session: str, path: str, src_ptrs: list[int],
                         dst_ptrs: list[int], items: list[int], slicer: str) -> Template:
    """SGLang's positional slicing (``slicer``: ``"common"`` / ``"ascend"`` MLA, ``"mha"``, or
    ``"flat"`` for entry ``i`` to entry ``i``), cached per peer."""
    kv_args = manager.kv_args
    known = _registered_item_lens(manager, session, dst_ptrs)
    how: tuple[Any, ...]
    if slicer == "mha":
        how = (slicer, int(kv_args.prefill_start_layer), setting_decode_kv_layers(manager))
    elif slicer == "flat":
        how = (slicer,)
    else:
        how = _legacy_mla_inputs(manager, slicer, len(src_ptrs), len(dst_ptrs))
    inputs = (how, src_ptrs, dst_ptrs, items, known)

    def build() -> Template:
        src_lens = kv_args_lens(kv_args, src_ptrs)
        if slicer == "mha":
            return _legacy_mha(manager, src_ptrs, dst_ptrs, items, src_lens, known)
        if slicer == "flat":
            pairs = _core.pair_entries(None, None, len(src_ptrs), len(dst_ptrs), True)
            dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs),
                         _dst_item_lens(pairs, items, len(dst_ptrs), known))
            return Template(Layout(src_ptrs, src_lens, items), dst,
                            Pairing.by_layer_id(allow_positional_fallback=True))
        return _legacy_mla(src_ptrs, dst_ptrs, items, src_lens, known, how)

    return cast(Template, template_cache(manager).get(session, path, inputs, build))


def _generic_template(self: Any, session: str, src_data_ptrs: list[int],
                      dst_data_ptrs: list[int], item_lens: list[int],
                      src_layer_ids: list[int] | None, dst_layer_ids: list[int] | None,
                      force_flat: bool) -> Template | None:
    """The cached template ``_send_kvcache_generic`` plans a KV request with, following
    SGLang's branch (reading what it reads in its order); ``None`` where SGLang's own method
    runs (a replaced slicer, compressed MLA)."""
    src_ptrs, dst_ptrs, items = list(src_data_ptrs), list(dst_data_ptrs), list(item_lens)
    src_ids, dst_ids = published_ids(src_layer_ids), published_ids(dst_layer_ids)
    if self.is_mla_backend or self.is_hybrid_mla_backend or force_flat or src_ids or dst_ids:
        if src_ids or dst_ids:
            return _ids_template(self, session, "kv", src_ptrs, dst_ptrs, items, src_ids,
                                 dst_ids, self.pp_size == 1)
        slicer = mla_slicer(self)
        if slicer is None or (len(src_ptrs) != len(dst_ptrs) and getattr(
                self.kv_args, "mla_compression_ratios", None)):
            return None
        return _positional_template(self, session, "kv", src_ptrs, dst_ptrs, items, slicer)
    if not owns_mha_slicer(self):
        return None
    return _positional_template(self, session, "kv", src_ptrs, dst_ptrs, items, "mha")


def as_index(arr: Any) -> npt.NDArray[Any]:
    a = np.asarray(arr)
    if a.dtype in (np.int32, np.int64) and a.dtype.isnative and a.flags.c_contiguous \
            and a.flags.aligned:
        return a
    if a.dtype.kind not in "iu":
        raise TypeError(f"page indices must be integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _page_arrays(src_pages: Any, dst_pages: Any) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    src, dst = as_index(src_pages), as_index(dst_pages)
    if src.shape != dst.shape:
        # SGLang: ValueError for different non-zero sizes, and no runs at all (nothing sent,
        # status 0) when exactly one side is empty.
        raise _core.KvPlanError(
            f"prefill and decode page index arrays differ in length ({src.size} and "
            f"{dst.size}); SGLang drops every page when one side is empty")
    return src, dst


@dataclass(frozen=True)
class SliceGeometry:
    """The attention geometry of one ``send_kvcache_slice`` call (hashable: part of the
    template cache key)."""

    heads: int  # total KV heads
    tp_p: int  # prefill attention TP size
    r_p: int  # prefill TP rank (modulo ``tp_p``)
    tp_d: int  # decode attention TP size
    r_d: int  # decode TP rank (modulo ``tp_d``)
    page: int  # page size in tokens
    src_hpr: int  # KV heads per prefill rank
    dst_hpr: int  # KV heads per decode rank
    head_bytes: int  # bytes of one head of one token


def _slice_geometry(manager: Any, dst_tp_rank: int, dst_attn_tp_size: int,
                    dst_kv_item_len: int) -> SliceGeometry:
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
    # SGLang's split of heads over ranks is kvplan's core's (``max(1, heads // tp)``).
    dst_hpr = _core.heads_per_rank(heads, tp_d)
    tp_p = int(manager.attn_tp_size)
    return SliceGeometry(heads=heads, tp_p=tp_p, r_p=int(kv_args.engine_rank) % tp_p, tp_d=tp_d,
                         r_d=int(dst_tp_rank) % tp_d, page=page,
                         src_hpr=_core.heads_per_rank(heads, tp_p),
                         dst_hpr=dst_hpr, head_bytes=int(dst_kv_item_len) // page // dst_hpr)


def elected_replica(r_p: int, r_d: int, heads: int, tp_p: int, tp_d: int) -> int:
    """The prefill rank kvplan's head model elects to send decode rank ``r_d`` the heads that
    prefill rank ``r_p`` holds (``r_p`` itself unless its heads are replicated): the core's
    election (``tp_peers``), of the decode rank's senders the one holding ``r_p``'s heads. A
    replica holds the same heads at the same offsets, so planning as the elected one moves
    ``r_p``'s own bytes: SGLang's decode asks one holder, whichever it is, and every asked rank
    sends."""
    if tp_p <= heads:
        return r_p  # one holder per head: nothing to elect
    mine = _core.tp_peers(heads, tp_p, tp_d, prefill_rank=r_p).heads
    for sender in _core.tp_peers(heads, tp_p, tp_d, decode_rank=r_d).receive_from:
        if _core.tp_peers(heads, tp_p, tp_d, prefill_rank=sender).heads == mine:
            return sender
    return r_p  # the decode rank holds none of these heads: the template says so


def _slice_template(manager: Any, session: str, dst_ptrs: list[int], dst_item: int,
                    dst_ids: list[int] | None, g: SliceGeometry) -> Template:
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
    src_ids = published_ids(kv_args.kv_layer_ids)
    by_id = bool(src_ids or dst_ids)
    # SGLang reads the PP size only to pair by id, the start layer only to slice positionally.
    pp_fallback = manager.pp_size == 1 if by_id else None
    start = None if by_id else int(kv_args.prefill_start_layer)
    src_lens = kv_args_lens(kv_args, src_ptrs)
    inputs: tuple[Any, ...] = (
        src_ptrs, dst_ptrs, items, dst_item, src_ids, dst_ids, pp_fallback, start,
        g, setting_decode_kv_layers(manager), src_lens)

    def build() -> Template:
        heads, tp_p, tp_d, r_d = g.heads, g.tp_p, g.tp_d, g.r_d
        r_p = elected_replica(g.r_p, r_d, heads, tp_p, tp_d)
        geometry: dict[str, Any] = dict(page_size=g.page, kv_heads=heads,
                                        head_dim=g.head_bytes, dtype_size=1,
                                        memory_order="NHD")
        n_src, n_dst = len(src_ptrs), len(dst_ptrs)
        if by_id:
            src = Layout(src_ptrs, src_lens, items, src_ids, tp_rank=r_p, tp_size=tp_p,
                         heads_per_rank=g.src_hpr, **geometry)
            dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs), [dst_item] * n_dst, dst_ids,
                         tp_rank=r_d, tp_size=tp_d, heads_per_rank=g.dst_hpr, **geometry)
            template = Template(
                src, dst, Pairing.by_layer_id(allow_positional_fallback=bool(pp_fallback)))
        else:
            decode_layers = setting_decode_kv_layers(manager)
            if n_src % 2 == 0 and n_dst % 2 == 0 and n_src == n_dst:
                decode_layers = n_dst // 2
            src = Layout(src_ptrs, src_lens, items, tp_rank=r_p, tp_size=tp_p,
                         heads_per_rank=g.src_hpr, **geometry)
            dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs), [dst_item] * n_dst,
                         num_model_layers=decode_layers, tp_rank=r_d, tp_size=tp_d,
                         heads_per_rank=g.dst_hpr, **geometry)
            template = Template(
                src, dst, Pairing.by_layer_id(prefill_start_layer=start, legacy_kind="mha"))
        if template.empty_reason is not None:
            raise _core.PairingError(
                f"send_kvcache_slice: prefill rank {g.r_p} of TP {tp_p} has no KV heads for "
                f"decode rank {r_d} of TP {tp_d}: {template.empty_reason} (SGLang would write "
                "this rank's heads into the decode's slots of other heads)")
        return template

    return cast(Template, template_cache(manager).get(session, "slice", inputs, build))


def _state_lens(kv_args: Any, ptrs: list[int]) -> list[int]:
    """Source slot-buffer lengths when ``ptrs`` is one of the manager's state components."""
    for comp_ptrs, comp_lens in zip(getattr(kv_args, "state_data_ptrs", None) or [],
                                    getattr(kv_args, "state_data_lens", None) or []):
        if list(comp_ptrs) == ptrs:
            return list(comp_lens)
    return unbounded_lens(ptrs)


def _mamba_template(manager: Any, req: Any, src_state_data_ptrs: Sequence[int],
                    src_state_item_lens: Sequence[int], dst_state_data_ptrs: Sequence[int],
                    src_layer_ids: Sequence[int] | None, dst_layer_ids: Sequence[int] | None,
                    dst_state_item_lens: Sequence[int] | None) -> tuple[str, Template]:
    """``(decode session, state template)`` of one ``_send_mamba_state`` call (cached per
    decode peer): state entries paired by layer id (positional at PP 1), SGLang's slot-size
    check kept. The session is read from ``req`` after the manager, as before."""
    src_ptrs, dst_ptrs = list(src_state_data_ptrs), list(dst_state_data_ptrs)
    items = list(src_state_item_lens)
    known = list(dst_state_item_lens) if dst_state_item_lens else None
    fallback = manager.pp_size == 1
    src_lens = _state_lens(getattr(manager, "kv_args", None), src_ptrs)
    inputs = (src_ptrs, dst_ptrs, items, published_ids(src_layer_ids), published_ids(dst_layer_ids), known,
              fallback, src_lens)

    def build() -> Template:
        pairs = _core.pair_entries(published_ids(src_layer_ids), published_ids(dst_layer_ids), len(src_ptrs),
                                   len(dst_ptrs), fallback)
        if known is not None:
            for i, j in pairs.tolist():
                if items[i] != known[j]:
                    raise _core.SizeMismatchError(
                        "Prefill/Decode Mamba slot size mismatch "
                        f"(src={items[i]}, dst={known[j]}). "
                        "Configure matching persistent state layouts on both peers.")
        dst_items = _dst_item_lens(pairs, items, len(dst_ptrs), known)
        src = Layout(src_ptrs, src_lens, items, published_ids(src_layer_ids),
                     kinds=["state"] * len(src_ptrs))
        dst = Layout(dst_ptrs, unbounded_lens(dst_ptrs), dst_items, published_ids(dst_layer_ids),
                     kinds=["state"] * len(dst_ptrs))
        return Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=fallback))

    session = req.mooncake_session_id
    return session, cast(Template, template_cache(manager).get(session, "mamba", inputs, build))


def _mamba_slice_template(manager: Any, session: str, src_state_data_ptrs: Sequence[int],
                          src_state_item_lens: Sequence[int], src_dims: Sequence[int],
                          dst_state_data_ptrs: Sequence[int], dst_state_item_lens: Sequence[int],
                          dst_dims: Sequence[int], tp: tuple[int, int, int, int],
                          conv_shard_groups: Sequence[Any] | None,
                          outer_counts: Sequence[int] | None,
                          src_layer_ids: Sequence[int] | None,
                          dst_layer_ids: Sequence[int] | None, *,
                          skip_empty: bool = False) -> Template:
    """The state template of one ``_send_mamba_state_slice`` call (cached per decode peer,
    ``session``): the state pairs SGLang pairs (by layer id, positional at PP 1), each a state
    entry with its TP channel split on both sides (``Layout.with_state(channels=...)``: the
    per-rank dims both peers published, the source's outer row count and shard groups, which
    describe the model and so both sides), at ``tp = (prefill TP, prefill rank, decode TP,
    decode rank)``. With ``skip_empty`` (NIXL's method) a pair with a zero source length or a
    null pointer on either side moves nothing, as SGLang skips it. The core checks the two
    splits and plans the byte slices."""
    src_ptrs, dst_ptrs = [int(p) for p in src_state_data_ptrs], [int(p) for p in dst_state_data_ptrs]
    fallback = manager.pp_size == 1
    groups = [None if g is None else [int(x) for x in g] for g in (conv_shard_groups or [])]
    outers = [int(x) for x in (outer_counts or [])]
    inputs = (src_ptrs, dst_ptrs, list(src_state_item_lens), list(dst_state_item_lens),
              list(src_dims), list(dst_dims), tp, groups, outers, published_ids(src_layer_ids),
              published_ids(dst_layer_ids), fallback, skip_empty)

    def build() -> Template:
        pairs = [(i, j) for i, j in _core.pair_entries(
            published_ids(src_layer_ids), published_ids(dst_layer_ids), len(src_ptrs),
            len(dst_ptrs), fallback).tolist()
                 if not skip_empty or (int(src_state_item_lens[i]) and src_ptrs[i] and dst_ptrs[j])]
        src_lens = _state_lens(getattr(manager, "kv_args", None), src_ptrs)
        src_tp, src_rank, dst_tp, dst_rank = tp
        # One state entry per pair on each side, pair k with pair k.
        keys = list(range(len(pairs)))
        split_groups = [groups[i] if i < len(groups) else None for i, _ in pairs]
        rows = [outers[i] if i < len(outers) else 1 for i, _ in pairs]
        src = Layout([], [], [], tp_size=src_tp, tp_rank=src_rank).with_state(
            "mamba", [src_ptrs[i] for i, _ in pairs], [src_lens[i] for i, _ in pairs],
            [int(src_state_item_lens[i]) for i, _ in pairs], keys,
            channels=[int(src_dims[i]) for i, _ in pairs], outer_rows=rows,
            shard_groups=split_groups)
        dst = Layout([], [], [], tp_size=dst_tp, tp_rank=dst_rank).with_state(
            "mamba", [dst_ptrs[j] for _, j in pairs], unbounded_lens([dst_ptrs[j] for _, j in pairs]),
            [int(dst_state_item_lens[j]) for _, j in pairs], keys,
            channels=[int(dst_dims[j]) for _, j in pairs], outer_rows=rows,
            shard_groups=split_groups)
        return Template(src, dst, Pairing.by_layer_id())

    return cast(Template, template_cache(manager).get(session, "mamba-slice", inputs, build))


def dcp_template(src: tuple[list[int], list[int]], dst: tuple[list[int], list[int]],
                 token_lens: list[int], page: int, num_draft: int, src_ids: list[int] | None,
                 dst_ids: list[int] | None, dcp_size: int, dcp_rank: int,
                 dst_items: list[int] | None = None) -> Template:
    """Prefill (DCP 1) pools ``src`` -> decode DCP rank ``dcp_rank`` of ``dcp_size`` pools
    ``dst`` (each ``(pointers, byte lengths)``). Rows are ``token_lens[i]`` bytes; target pages
    hold ``page`` rows, draft pages (the last ``num_draft`` prefill entries, not dealt)
    ``page * dcp_size`` rows, as SGLang addresses them. ``dst_items``: the decode's own page
    bytes per entry (a decode planning its staged rounds with its pools); by default what the
    prefill's rows make of them."""
    src_ptrs, src_lens = src
    dst_ptrs, dst_lens = dst
    n_src, n_dst = len(src_ptrs), len(dst_ptrs)
    src_drafts = [i >= n_src - num_draft for i in range(n_src)]
    pairs = _core.pair_entries(src_ids, dst_ids, n_src, n_dst, False)
    dst_drafts = [False] * n_dst
    items = [0] * n_dst
    for i, j in pairs.tolist():
        dst_drafts[j] = src_drafts[i]
        items[j] = token_lens[i] * page * (dcp_size if src_drafts[i] else 1)
    for j in range(n_dst):  # unpaired decode entries: never written, sized as a target
        if items[j] == 0:
            items[j] = token_lens[0] * page
    src_layout = Layout(list(src_ptrs), list(src_lens), [w * page for w in token_lens[:n_src]],
                        src_ids, drafts=src_drafts, page_size=page)
    dst_layout = Layout(list(dst_ptrs), list(dst_lens),
                        list(dst_items) if dst_items is not None else items, dst_ids,
                        drafts=dst_drafts, page_size=page, dcp_size=dcp_size, dcp_rank=dcp_rank)
    return Template(src_layout, dst_layout, Pairing.by_layer_id())
