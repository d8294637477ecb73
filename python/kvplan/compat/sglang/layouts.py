"""The layout builders: a :class:`kvplan.Layout` from SGLang's ``KVArgs`` (the prefill) or
``KVArgsRegisterInfo`` (the decode), with roles, TP context and Mamba state entries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvplan import _core
from kvplan._core import Layout

_U64_MAX = (1 << 64) - 1


def unbounded_lens(ptrs: Sequence[int]) -> list[int]:
    """Buffer lengths for a peer whose lengths SGLang does not publish (the decode): as large as
    the address space allows, so only u64 overflow bounds an index there."""
    return [_U64_MAX - int(p) for p in ptrs]


def published_ids(ids: Sequence[int] | None) -> list[int] | None:
    """SGLang's truthiness: ``None`` and ``[]`` both mean "not published"."""
    return list(ids) if ids else None


def kv_roles(n: int, *, mla: bool, groups: int, num_draft: int,
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


def pool_layer_ids(roles: Sequence[str] | None, first: int,
                   first_draft: int) -> list[int] | None:
    """Global layer ids of a per-layer pool that publishes none (SGLang leaves ``kv_layer_ids``
    empty for every pool but its hybrid ones): its buffer ``i`` of a role holds layer
    ``first + i`` (the pool's ``start_layer``, as SGLang's own legacy PP slicing reads the
    entry lists), and its draft buffers, numbered apart, ``first_draft + i`` (SGLang's draft
    band starts at the model's layer count). None when the roles are not known."""
    if roles is None:
        return None
    seen: dict[str, int] = {}
    ids = []
    for role in roles:
        k = seen.get(role, 0)
        seen[role] = k + 1
        ids.append((first_draft if role.startswith("draft") else first) + k)
    return ids


def _tp_context(rank: Any, size: Any, what: str) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` as SGLang uses them: the rank modulo the attention TP size (with
    DP attention a global rank exceeds the size); an unset size (0 or None) is 1."""
    tp_size = int(size or 1)
    if tp_size < 1:
        raise _core.LayoutError(f"{what} must be positive, got {size}")
    return int(rank or 0) % tp_size, tp_size


def layout_from_kv_args(kv_args: Any, *, is_mla_backend: bool, pp_size: int = 1,
                        attn_tp_size: int | None = None, state: bool = True,
                        layer_ids_from: tuple[int, int] | None = None) -> Layout:
    """The prefill peer's :class:`kvplan.Layout` from SGLang's ``KVArgs``.

    Page entries are ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens`` with
    ``kv_layer_ids`` (``[]`` means "not published"), in SGLang's order; roles are derived where
    SGLang's attributes determine them (``kv``/``draft`` for MLA, ``k``/``v``/``draft_k``/
    ``draft_v`` for MHA, ``g0``.. and ``draft_g0``.. for NPU buffer groups, ``kv_buf_groups``);
    ``num_draft_entries`` counts the appended draft entries. With ``state``, every Mamba state
    component (``state_types`` entry ``"mamba"``) is appended as state entries with its
    ``state_layer_ids`` (unpublished ids: ``None``) and the roles of :func:`mamba_entry_roles`:
    ``mamba_conv`` and ``mamba_temporal`` per tensor where ``KVArgs`` tells them apart (its conv
    shard groups), else the positional ``mamba<i>``.

    Context: ``page_size``, ``pp_rank`` / ``pp_size``; and with ``attn_tp_size`` (the manager's
    ``attn_tp_size``: ``KVArgs`` does not carry it) ``tp_size = attn_tp_size`` and
    ``tp_rank = engine_rank % attn_tp_size``, the local rank SGLang's head slicing uses. Without
    it the layout has no TP context (rank 0 of 1).

    ``layer_ids_from`` (``(first layer, first draft id)``): when ``kv_layer_ids`` is not
    published, the page entries get :func:`pool_layer_ids` (what a check by layer id, such as a
    model manifest, needs; planning keeps SGLang's positional pairing without it).

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
    roles = kv_roles(len(ptrs), mla=is_mla_backend, groups=groups, num_draft=num_draft)
    tp_rank, tp_size = (0, 1) if attn_tp_size is None else _tp_context(
        getattr(kv_args, "engine_rank", 0), attn_tp_size, "attn_tp_size")
    layer_ids = published_ids(getattr(kv_args, "kv_layer_ids", None))
    if layer_ids is None and layer_ids_from is not None:
        layer_ids = pool_layer_ids(roles, *layer_ids_from)
    layout = Layout(
        ptrs, list(kv_args.kv_data_lens), list(kv_args.kv_item_lens), layer_ids, roles,
        page_size=int(getattr(kv_args, "page_size", 1) or 1),
        pp_rank=int(getattr(kv_args, "pp_rank", 0) or 0), pp_size=pp_size,
        tp_rank=tp_rank, tp_size=tp_size,
    )
    if state:
        layout = _with_mamba_state(layout, kv_args)
    return layout


#: The role of SGLang's Mamba state entries of one conv tensor (``MambaPool.State.conv``, a
#: pool with one conv tensor per layer; ``mamba_conv0``, ``mamba_conv1``, ... with several) and
#: of its recurrent tensor (``MambaPool.State.temporal``), the names the hybrid presets'
#: manifests use.
MAMBA_CONV, MAMBA_TEMPORAL = "mamba_conv", "mamba_temporal"


def _published(values: Any, n: int) -> list[Any] | None:
    """A per-entry list of ``n`` values, or None when SGLang left it empty or it is not one
    value per entry."""
    out = list(values or [])
    return out if len(out) == n else None


def _mamba_sweeps(layer_ids: Sequence[Any], dims: Sequence[Any] | None) -> tuple[int, int] | None:
    """``(layers, main)`` of one Mamba component's entries as SGLang 0.5.23's ``MambaPool``
    publishes them (``_iter_transfer_state_entries``: tensor-major, one entry per Mamba layer of
    ``mamba_layer_ids`` per state tensor, then the replicated entries of its slot siblings, whose
    ``state_dim_per_tensor`` is 0): ``main`` leading entries that repeat one sweep of ``layers``
    layer ids. None when the entries do not have that form (no layer ids, a sweep that does not
    repeat, a replicated entry before a sharded one)."""
    try:
        sizes = None if dims is None else [int(d) for d in dims]
        ids = [int(x) for x in layer_ids]
    except (TypeError, ValueError):  # not SGLang's integers: no roles (the core checks ids)
        return None
    main = len(ids)
    if sizes is not None:
        main = next((e for e, d in enumerate(sizes) if d == 0), main)
        if any(d != 0 for d in sizes[main:]):
            return None
    ids = ids[:main]
    layers = len(set(ids))
    if not layers or main % layers or ids != ids[:layers] * (main // layers):
        return None
    return layers, main


def mamba_tensor_roles(kv_args: Any, index: int) -> list[str] | None:
    """The role of each state tensor of SGLang's Mamba component ``index`` of ``kv_args`` (its
    ``KVArgs``), in SGLang's order: ``mamba_conv`` (``mamba_conv0``, ... with several conv
    tensors) for a tensor whose entries carry ``state_conv_shard_groups`` (SGLang's
    ``get_state_conv_shard_groups`` gives them to ``conv`` tensors only), then ``mamba_temporal``
    for the one tensor after them (``MambaPool.State``'s only other transferred field). None
    where ``KVArgs`` cannot tell: no layer ids, no conv shard groups (a pool whose conv state has
    no q/k/v sub-blocks publishes None for every tensor, so its conv tensors look like its
    temporal one), or entries of another form."""
    ids = _published(_at(kv_args, "state_layer_ids", index), len(_at(kv_args, "state_data_ptrs",
                                                                     index)))
    if ids is None:
        return None
    n = len(ids)
    groups = _published(_at(kv_args, "state_conv_shard_groups", index), n)
    sweeps = _mamba_sweeps(ids, _published(_at(kv_args, "state_dim_per_tensor", index), n))
    if groups is None or sweeps is None:
        return None
    layers, main = sweeps
    conv = []
    for t in range(main // layers):
        held = [bool(g) for g in groups[t * layers:(t + 1) * layers]]
        if any(held) != all(held):
            return None
        conv.append(held[0])
    convs = conv.index(False) if False in conv else len(conv)
    if convs == 0 or any(conv[convs:]) or len(conv) - convs > 1:
        return None
    names = [MAMBA_CONV] if convs == 1 else [f"{MAMBA_CONV}{c}" for c in range(convs)]
    return names + [MAMBA_TEMPORAL] * (len(conv) - convs)


def _at(kv_args: Any, name: str, index: int) -> list[Any]:
    values = list(getattr(kv_args, name, None) or [])
    return list(values[index] or []) if index < len(values) else []


def mamba_entry_roles(kv_args: Any, index: int,
                      tensor_roles: Sequence[str] | None = None) -> list[str]:
    """The role of each entry of SGLang's Mamba component ``index``: its tensor's role
    (``tensor_roles``, by default :func:`mamba_tensor_roles` of ``kv_args``; a decode, whose
    registration publishes no conv shard groups, takes the prefill's) for the entries of the
    tensor sweeps, and the positional ``mamba<index>`` for the replicated entries of SGLang's
    slot siblings (``state_dim_per_tensor`` 0: ``KVArgs`` does not say which sibling pool holds
    them) and for every entry of a component whose roles ``KVArgs`` cannot tell."""
    n = len(_at(kv_args, "state_data_ptrs", index))
    positional = [f"mamba{index}"] * n
    if tensor_roles is None:
        tensor_roles = mamba_tensor_roles(kv_args, index)
    ids = _published(_at(kv_args, "state_layer_ids", index), n)
    if tensor_roles is None or ids is None:
        return positional
    sweeps = _mamba_sweeps(ids, _published(_at(kv_args, "state_dim_per_tensor", index), n))
    if sweeps is None or sweeps[1] // sweeps[0] != len(tensor_roles):
        return positional
    layers, main = sweeps
    return [tensor_roles[e // layers] for e in range(main)] + positional[main:]


def _with_mamba_state(layout: Layout, kv_args: Any, roles_from: Any = None) -> Layout:
    """``layout`` plus every Mamba component of ``kv_args`` as state entries, with the roles of
    :func:`mamba_entry_roles` (the tensor roles of ``roles_from``'s component, by default
    ``kv_args``'s own)."""
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
            layer_ids = [int(x) for x in comp_ids if x is not None]
            roles = mamba_entry_roles(
                kv_args, i, None if roles_from is None else mamba_tensor_roles(roles_from, i))
            if len(layer_ids) != n or len(roles) != n:  # the core names the lists that differ
                layout = layout.with_state(f"mamba{i}", list(ptrs[i]), list(lens[i]),
                                           list(items[i]), layer_ids)
                continue
            start = 0
            while start < n:  # one with_state per run of entries of one role, in SGLang's order
                end = start + 1
                while end < n and roles[end] == roles[start]:
                    end += 1
                layout = layout.with_state(roles[start], list(ptrs[i][start:end]),
                                           list(lens[i][start:end]), list(items[i][start:end]),
                                           layer_ids[start:end])
                start = end
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
                              state_types: Sequence[Any] = (),
                              state_roles_from: Any = None) -> Layout:
    """The decode peer's :class:`kvplan.Layout` from SGLang's ``KVArgsRegisterInfo``.

    Page entries are ``dst_kv_ptrs`` with ``dst_kv_layer_ids`` and ``dst_kv_item_lens`` (the
    per-entry list SGLang 0.5.23 registers; an older peer's single ``dst_kv_item_len`` is used
    for every entry). The decode does not publish its buffer lengths, so every capacity is as
    large as the address space allows (index bounds are checked on the prefill side only).
    Roles as in :func:`layout_from_kv_args` where they are determined: for MHA the K/V split
    needs ``num_layers`` (target layers) unless ``num_draft_entries`` says how many entries are
    draft; otherwise roles are left out. ``state_types`` (the prefill's ``KVArgs.state_types``,
    parallel to ``dst_state_data_ptrs``) adds the Mamba components as state entries; their roles
    are the tensor roles of ``state_roles_from`` (the prefill's ``KVArgs``,
    :func:`mamba_tensor_roles`: the decode's registration publishes no conv shard groups), laid
    over the decode's own tensor sweeps (its ``dst_state_layer_ids`` and, where registered,
    ``dst_state_dim_per_tensor``); without it they are positional (``mamba<i>``). TP context:
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
    roles = kv_roles(len(ptrs), mla=is_mla_backend, groups=kv_buf_groups,
                      num_draft=num_draft_entries, num_layers=num_layers)
    tp_rank, tp_size = _tp_context(getattr(info, "dst_tp_rank", 0),
                                   getattr(info, "dst_attn_tp_size", 1), "dst_attn_tp_size")
    layout = Layout(ptrs, unbounded_lens(ptrs), items, published_ids(info.dst_kv_layer_ids), roles,
                    num_model_layers=num_layers, tp_rank=tp_rank, tp_size=tp_size)
    if state_types:
        state = _RegisterState(info, state_types)
        layout = _with_mamba_state(layout, state, state_roles_from)
    return layout


class _RegisterState:
    """A decode registration's state lists under ``KVArgs``'s attribute names."""

    def __init__(self, info: Any, state_types: Sequence[Any]) -> None:
        self.state_types = list(state_types)
        self.state_data_ptrs = list(info.dst_state_data_ptrs or [])
        self.state_data_lens = [unbounded_lens(p) for p in self.state_data_ptrs]
        self.state_item_lens = list(info.dst_state_item_lens or [])
        self.state_layer_ids = list(info.dst_state_layer_ids or [])
        self.state_dim_per_tensor = list(getattr(info, "dst_state_dim_per_tensor", None) or [])
