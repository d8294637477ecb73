"""kvplan's ``MooncakeKVManager.send_kvcache_staged``: prefill attention TP != decode TP on MHA
pools, moved through staging buffers (SGLang's GPU kernel gathers the sent heads into the
prefill's staging buffer, a few network blocks move it into the decode's staging region, the
decode's kernel scatters it into its pages). kvplan plans the staged transfer
(:meth:`kvplan.Template.plan_staged`) from a head-sliced template cached per decode peer, and
its network blocks go to the engine."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, cast

from kvplan import _core
from kvplan._core import Layout, Pairing, Template
from kvplan.compat.sglang.cache import template_cache
from kvplan.compat.sglang.layouts import published_ids, unbounded_lens
from kvplan.compat.sglang.metrics import planned
from kvplan.compat.sglang.registry import MOONCAKE_MANAGER, sglang_global, sglang_method
from kvplan.compat.sglang.submit import block_tuples, send_engine_batches, engine_status
from kvplan.compat.sglang.seams import owns_transfer_data
from kvplan.compat.sglang.templates import elected_replica, as_index

#: SGLang's module holding the staging layout and the gather / scatter kernels; imported when
#: a call needs it, as SGLang's method imports it.
STAGING_MODULE = "sglang.srt.disaggregation.common.staging_buffer"

#: Address of the first decode pool entry in the prefill's template, whose scatter half is never
#: run (the prefill knows only the decode's staging region): entry ``j`` sits ``j << 40``
#: bytes above it, with no length limit. The decode plans with its own pools
#: (:func:`staged_template` with ``decode_pools``).
_PLACEHOLDER_BASE = 1 << 44


def _staging() -> Any:
    return importlib.import_module(STAGING_MODULE)


def _pool_ptrs(tensors: Sequence[Any]) -> list[int]:
    return [int(t.data_ptr()) for t in tensors]


def _pool_lens(tensors: Sequence[Any]) -> list[int]:
    return [int(t.nbytes) for t in tensors]


def _placeholders(n: int) -> tuple[list[int], list[int]]:
    """Pool pointers and lengths for the side whose pools a peer does not know."""
    ptrs = [_PLACEHOLDER_BASE + (j << 40) for j in range(n)]
    return ptrs, unbounded_lens(ptrs)


def staged_template(*, kv_heads: int, prefill_tp: int, prefill_rank: int, decode_tp: int,
                    decode_rank: int, page_size: int, head_dim: int, dtype_size: int,
                    num_layers: int, decode_slots: int | None = None,
                    prefill_pp_size: int = 1, prefill_pp_rank: int = 0,
                    prefill_slot_ids: Sequence[int] | None = None,
                    decode_slot_ids: Sequence[int] | None = None,
                    prefill_pools: tuple[Sequence[int], Sequence[int]] | None = None,
                    decode_pools: tuple[Sequence[int], Sequence[int]] | None = None,
                    prefill_item_lens: Sequence[int] | None = None,
                    decode_item_len: int | None = None) -> Template:
    """The head-sliced template SGLang's staged transfer plans with, for either peer.

    Both sides are MHA pools in SGLang's staging slot order (every K layer, then every V
    layer), NHD, ``page_size`` tokens per page, ``kv_heads`` KV heads of ``head_dim`` elements
    of ``dtype_size`` bytes, split over each side's TP as SGLang splits them (``max(1, heads //
    tp)`` per rank). Prefill PP 1 without slot ids pairs slot ``i`` with decode slot ``i``
    (``num_layers`` layers on both sides); prefill PP > 1, or both sides' slot ids given, pairs
    by the slots' layer ids (``prefill_slot_ids``, ``decode_slot_ids``), occurrences in order,
    as SGLang's ``build_transfer_entry_pairs``;
    ``prefill_pp_rank`` is the stage's rank, which gives it its own share of the decode's arena
    in staged rounds (the stages write one decode arena at once).

    ``prefill_pools`` / ``decode_pools`` are ``(pointers, byte lengths)`` of the slots' pool
    tensors; a side given as None gets placeholder pools, so only the plans that do not touch
    that side are meaningful: the prefill (which knows only the decode's staging region) uses
    ``gather`` and ``network``, the decode ``network`` and ``scatter``. ``prefill_item_lens``
    (per slot) and ``decode_item_len`` are the bytes of one page of a slot's pool; by default
    this geometry on each side's heads (SGLang's assumption); the template refuses item lengths
    that do not match it. When several writers of one decode region hold replicas of the same
    heads (the core's ``staging_replicas_write``), every writer fills its own share: the template is the
    writer's own rank's, built with ``replicas_send=True``. Otherwise a prefill rank holding
    replicated heads is the region's only writer and is planned as the replica kvplan elects
    for the decode rank (same heads at the same offsets).

    Raises:
        PairingError: The prefill rank holds none of the decode rank's heads (or is not one of
            its writers), or a prefill slot has no decode slot of its layer id.
        SizeMismatchError: Item lengths that do not match the geometry.
    """
    heads, tp_p, tp_d = int(kv_heads), int(prefill_tp), int(decode_tp)
    every_writer = _core.staging_replicas_write(heads, tp_p, tp_d)
    r_p = int(prefill_rank) % tp_p
    if not every_writer:
        # A replica plans as the elected holder of its heads: same bytes, and (one writer per
        # region here) the same share.
        r_p = elected_replica(r_p, int(decode_rank) % tp_d, heads, tp_p, tp_d)
    # SGLang splits heads as kvplan's core does (``max(1, heads // tp)``): the core's answer.
    src_hpr, dst_hpr = _core.heads_per_rank(heads, tp_p), _core.heads_per_rank(heads, tp_d)
    head_bytes = int(head_dim) * int(dtype_size)
    n_src = 2 * int(num_layers)
    by_id = int(prefill_pp_size) > 1 or (prefill_slot_ids is not None
                                         and decode_slot_ids is not None)
    src_ids = list(prefill_slot_ids) if by_id and prefill_slot_ids is not None else None
    dst_ids = list(decode_slot_ids) if by_id and decode_slot_ids is not None else None
    n_dst = len(dst_ids) if dst_ids is not None else int(decode_slots or n_src)
    src_ptrs, src_lens = (list(map(int, prefill_pools[0])), list(map(int, prefill_pools[1]))) \
        if prefill_pools is not None else _placeholders(n_src)
    dst_ptrs, dst_lens = (list(map(int, decode_pools[0])), list(map(int, decode_pools[1]))) \
        if decode_pools is not None else _placeholders(n_dst)
    geometry: dict[str, Any] = dict(page_size=int(page_size), kv_heads=heads,
                                    head_dim=int(head_dim), dtype_size=int(dtype_size),
                                    memory_order="NHD")
    src_items: int | list[int] = (list(map(int, prefill_item_lens))
                                  if prefill_item_lens is not None
                                  else int(page_size) * src_hpr * head_bytes)
    src = Layout(src_ptrs, src_lens, src_items, src_ids,
                 tp_rank=r_p, tp_size=tp_p, heads_per_rank=src_hpr,
                 pp_rank=int(prefill_pp_rank), pp_size=int(prefill_pp_size), **geometry)
    dst_item = int(decode_item_len) if decode_item_len is not None else (
        int(page_size) * dst_hpr * head_bytes)
    dst = Layout(dst_ptrs, dst_lens, dst_item, dst_ids, tp_rank=int(decode_rank) % tp_d,
                 tp_size=tp_d, heads_per_rank=dst_hpr, **geometry)
    template = Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=not by_id),
                        replicas_send=every_writer)
    if template.empty_reason is not None:
        raise _core.PairingError(
            f"send_kvcache_staged: prefill rank {prefill_rank} of TP {tp_p} has no KV heads for "
            f"decode rank {decode_rank} of TP {tp_d}: {template.empty_reason} (SGLang would "
            "write this rank's heads into the decode's staging slots of other heads)")
    return template


def _manager_template(manager: Any, session: str, k_buffers: Sequence[Any],
                      v_buffers: Sequence[Any], page: int, heads: int, dst_tp_rank: int,
                      dst_tp: int, dst_item: int, slot_ids: tuple[Any, Any] | None) -> Template:
    """The prefill's :func:`staged_template` for one call, cached per decode peer."""
    pools = (*k_buffers, *v_buffers)
    ptrs, lens = _pool_ptrs(pools), _pool_lens(pools)
    first = k_buffers[0]
    geometry: dict[str, Any] = dict(
        kv_heads=heads, prefill_tp=int(manager.attn_tp_size),
        prefill_rank=int(manager.kv_args.engine_rank), decode_tp=int(dst_tp),
        decode_rank=int(dst_tp_rank), page_size=int(page), head_dim=int(first.shape[-1]),
        dtype_size=int(first.element_size()), num_layers=len(k_buffers),
        prefill_pp_size=int(manager.pp_size), decode_item_len=int(dst_item))
    src_ids, dst_ids = slot_ids if slot_ids is not None else (None, None)
    # each pool's own page bytes: a head count other than SGLang's split is the template's
    # geometry error (SGLang's kernel would gather other heads' bytes)
    items = [int(page) * int(t.shape[1]) * int(t.shape[-1]) * int(t.element_size())
             for t in pools]
    inputs = ("staged", ptrs, lens, items, tuple(sorted(geometry.items())), src_ids, dst_ids)

    def build() -> Template:
        return staged_template(prefill_pools=(ptrs, lens), prefill_item_lens=items,
                               prefill_slot_ids=src_ids, decode_slot_ids=dst_ids, **geometry)

    return cast(Template, template_cache(manager).get(session, "staged", inputs, build))


def gather_staged(manager: Any, session: str, prefill_kv_indices: Any, staging_buffer: Any,
                  dst_staging: tuple[int, int], dst_tp_rank: int, dst_attn_tp_size: int,
                  dst_kv_item_len: int, slot_ids: tuple[Any, Any] | None,
                  logger: Any) -> Any | None:
    """The staged plan of ``manager``'s pools to one decode peer's staging area
    (``dst_staging``: address, size), with SGLang's gather kernel run into ``staging_buffer``
    as SGLang calls it; ``None`` when either staging area is too small (logged on ``logger``
    as SGLang logs it). Refused: a gather that wrote another byte count than the plan sends
    (``SizeMismatchError``), and what :func:`_manager_template` refuses. Both managers' staged
    sends (Mooncake's and NIXL's) start here."""
    staging = _staging()
    tensors = manager.kv_buffer_tensors
    k_buffers, v_buffers = tensors["k_buffers"], tensors["v_buffers"]
    page = tensors["page_size"]
    heads = int(staging.resolve_total_kv_heads(manager.kv_args, manager.attn_tp_size))
    tp_p, tp_d = int(manager.attn_tp_size), int(dst_attn_tp_size)
    template = _manager_template(manager, session, k_buffers, v_buffers, page, heads,
                                 dst_tp_rank, tp_d, dst_kv_item_len, slot_ids)
    src = as_index(prefill_kv_indices)
    try:
        # the decode's pages do not shape the network plan: the prefill's list stands in
        staged = planned(lambda: template.plan_staged(
            src, src, src_staging=(int(staging_buffer.get_ptr()), int(staging_buffer.get_size())),
            dst_staging=(int(dst_staging[0]), int(dst_staging[1]))),
            network=lambda plan: plan.network)
    except _core.SizeMismatchError as exc:
        if exc.kind != "staging_too_small":
            raise
        logger.warning(f"Staging too small, falling back: {exc}")
        return None
    src_head_start, num_heads, _, _ = staging.compute_head_slice_params(
        tp_p, tp_d, int(manager.kv_args.engine_rank) % tp_p, dst_tp_rank, heads)
    written = staging.gather_all_layers_to_staging(
        k_buffers, v_buffers, prefill_kv_indices, staging_buffer, src_head_start, num_heads, page)
    if written is not None and int(written) != staged.src_staging_bytes:
        # the kernel's layout and kvplan's disagree: sending would move the wrong bytes
        raise _core.SizeMismatchError(
            f"send_kvcache_staged: SGLang's gather kernel wrote {written} bytes into the "
            f"staging buffer, kvplan's staged plan sends {staged.src_staging_bytes}")
    return staged


def send_kvcache_staged(
    self: Any,
    mooncake_session_id: str,
    prefill_kv_indices: Any,
    dst_staging_ptr: int,
    dst_staging_size: int,
    dst_tp_rank: int,
    dst_attn_tp_size: int,
    dst_kv_item_len: int,
    dst_layer_ids: list[int],
    staging_buffer: Any = None,
    dst_slot_layer_ids: list[int] | None = None,
) -> int:
    """kvplan's ``MooncakeKVManager.send_kvcache_staged`` (SGLang 0.5.23 signature).

    SGLang's GPU kernel (``gather_all_layers_to_staging``) gathers the heads this prefill rank
    sends into ``staging_buffer``, called as SGLang calls it; kvplan plans where they go: the
    network blocks from the prefill's staging buffer into this writer's share of the decode's
    staging region (SGLang's ``compute_staging_layout``: writer ``rank % (tp_p / tp_d)``, all K
    layers then all V layers, decode slots by layer id under prefill PP), merged where
    contiguous (one block at PP 1, at most two per writer under PP), handed to
    ``self._transfer_data`` (to ``self.engine`` in bounded batches when that is SGLang's own).
    A non-zero status raises SGLang's ``RuntimeError``.

    SGLang's fall-backs are kept (``-1``): no ``kv_buffer_tensors`` or no staging buffer, a
    prefill staging buffer or decode staging region too small (logged with kvplan's account of
    the sizes). When the prefill's heads are replicated over several writers of one decode
    region (attention TP larger than the decode's and than the KV head count), every writer
    fills its own share from its own copy, as in SGLang (the template's ``replicas_send``).
    SGLang's own method runs for prefill PP without slot layer ids (SGLang's pairing error).

    Differences from SGLang's method (whose kernels read and write where the indices point):

    * A negative prefill page, or one past the pool tensors: ``IndexBoundsError`` before the
      kernel runs (SGLang's kernel reads outside the pool).
    * Pool tensors whose head count is not SGLang's split of the KV heads, or a decode item
      length (``dst_kv_item_len``) that is not ``page_size`` x the decode's heads x the
      prefill's head bytes: ``SizeMismatchError`` (SGLang gathers other heads' bytes, or the
      decode scatters at other offsets than the prefill staged).
    * A prefill rank holding none of the decode rank's heads: ``PairingError``; a decode peer
      without one of the prefill's layers: ``PairingError`` (SGLang: ``RuntimeError``).
    * The gather kernel returning another byte count than kvplan's plan sends (its layout and
      kvplan's disagree): ``SizeMismatchError``, nothing sent (SGLang ignores the count).
    """
    args = (self, mooncake_session_id, prefill_kv_indices, dst_staging_ptr, dst_staging_size,
            dst_tp_rank, dst_attn_tp_size, dst_kv_item_len, dst_layer_ids)

    def sglangs() -> int:
        original = sglang_method(self, "send_kvcache_staged", MOONCAKE_MANAGER)
        return engine_status(original(*args, staging_buffer=staging_buffer,
                                dst_slot_layer_ids=dst_slot_layer_ids))

    if self.kv_buffer_tensors is None or staging_buffer is None:
        return -1
    tensors = self.kv_buffer_tensors
    slot_ids = None
    if self.pp_size > 1:
        src_ids = published_ids(tensors.get("slot_layer_ids") or self.kv_args.kv_layer_ids)
        dst_ids = published_ids(dst_slot_layer_ids or dst_layer_ids)
        if src_ids is None or dst_ids is None or len(src_ids) != 2 * len(tensors["k_buffers"]):
            return sglangs()  # SGLang's pairing error
        slot_ids = (src_ids, dst_ids)
    staged = gather_staged(self, mooncake_session_id, prefill_kv_indices, staging_buffer,
                           (dst_staging_ptr, dst_staging_size), dst_tp_rank, dst_attn_tp_size,
                           dst_kv_item_len, slot_ids, sglang_global("logger"))
    if staged is None:
        return -1
    if owns_transfer_data(self):
        ret = send_engine_batches(self, mooncake_session_id, staged.network)
    else:
        ret = engine_status(self._transfer_data(mooncake_session_id, block_tuples(staged.network)))
    if ret != 0:
        raise RuntimeError(
            f"[Staging] Bulk RDMA transfer failed with ret={ret}. "
            f"src_ptr=0x{staging_buffer.get_ptr():x}, "
            f"dst_ptr=0x{dst_staging_ptr + staged.dst_staging_range[0]:x}, "
            f"size={staged.src_staging_bytes}. "
            f"The decode staging buffer may not be properly registered.")
    return ret
