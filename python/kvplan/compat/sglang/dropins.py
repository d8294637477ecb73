"""The drop-in methods with SGLang 0.5.23's signatures: Mooncake's ``_send_kvcache_generic``
and ``send_kvcache``, Ascend's ``send_kvcache``, ``send_kvcache_slice``, ``_send_mamba_state``
and ``_send_mamba_state_slice``. Each keeps SGLang's dispatch, plans with a cached template
and submits; anything kvplan does not plan goes to SGLang's own method."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvplan._core import Template

from kvplan.compat.sglang.layouts import published_ids
from kvplan.compat.sglang.metrics import planned
from kvplan.compat.sglang.rounds import maybe_send, staging_of
from kvplan.compat.sglang.registry import (
    ASCEND_MANAGER,
    MOONCAKE_MANAGER,
    sglang_global,
    sglang_impl,
    sglang_method,
)
from kvplan.compat.sglang.seams import mla_slicer, owns_mha_slicer, owns_transfer_data
from kvplan.compat.sglang.submit import (
    send_batch_calls,
    send_engine_batches,
    send_all,
    _send_index_windows,
    _send_per_pair,
    engine_status,
)
from kvplan.compat.sglang.verdicts import FailedBlocks
from kvplan.compat.sglang.templates import (
    _generic_template,
    _mamba_slice_template,
    _mamba_template,
    _page_arrays,
    _positional_template,
    _slice_geometry,
    _slice_template,
    _state_template,
)


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
        original = sglang_method(self, "_send_kvcache_generic", MOONCAKE_MANAGER)
        return engine_status(original(
            self, mooncake_session_id, src_data_ptrs, dst_data_ptrs, item_lens,
            prefill_data_indices, dst_data_indices, executor, state_type, force_flat,
            src_layer_ids, dst_layer_ids, dst_device_data_indices, dst_device_data_ptrs,
            dst_item_lens, bootstrap_room))

    if dst_device_data_indices is not None or (state_type is None and dst_item_lens is not None):
        return sglangs()
    session = mooncake_session_id
    if state_type is not None:
        src_ids, dst_ids = published_ids(src_layer_ids), published_ids(dst_layer_ids)
        if not (src_ids or dst_ids):
            return sglangs()  # SGLang's positional slicing of a state component
        failure = _state_stride_failure(self, session, src_data_ptrs, dst_data_ptrs,
                                        item_lens, dst_item_lens, state_type, force_flat,
                                        src_layer_ids, dst_layer_ids, bootstrap_room)
        if failure is not None:
            return failure
        dsa = state_type == sglang_global("StateType").DSA
        template: Template | None = _state_template(
            self, session, state_type, dsa, list(src_data_ptrs), list(dst_data_ptrs),
            list(item_lens), src_ids, dst_ids, None if dst_item_lens is None
            else list(dst_item_lens))
    else:
        template = _generic_template(self, session, src_data_ptrs, dst_data_ptrs, item_lens,
                                     src_layer_ids, dst_layer_ids, force_flat)
    if template is None:
        return sglangs()
    src, dst = _page_arrays(prefill_data_indices, dst_data_indices)
    if self.enable_custom_mem_pool and getattr(self, "custom_mem_pool_type",
                                               None) != "INTRA_NODE_NVLINK":
        plan = planned(lambda: template.plan(src, dst))
        return _send_per_pair(self, session, plan, executor, through_transfer_data=True,
                              await_with_manager=True,
                              failed=FailedBlocks(self, session, template, plan, bootstrap_room))
    if owns_transfer_data(self):
        plan = planned(lambda: template.plan(src, dst))
        return send_engine_batches(self, session, plan,
                                   FailedBlocks(self, session, template, plan, bootstrap_room))
    return _send_index_windows(self, session, template, src, dst)


def _state_stride_failure(self: Any, session: str, src_data_ptrs: list[int],
                          dst_data_ptrs: list[int], item_lens: list[int],
                          dst_item_lens: list[int] | None, state_type: Any, force_flat: bool,
                          src_layer_ids: list[int] | None, dst_layer_ids: list[int] | None,
                          bootstrap_room: int | None) -> int | None:
    """SGLang's own stride check of a state component, with its failure path: a decode entry
    whose item length differs from its prefill partner's (SGLang addresses the decode with the
    prefill's item length) fails the request (``conclude_failure``, status -1). Checked once
    per decode session, as SGLang checks it; ``None`` when the transfer may go on."""
    if dst_item_lens is None or session in self.state_strides_validated:
        return None
    mismatch = self._state_stride_mismatch(
        src_data_ptrs=src_data_ptrs, dst_data_ptrs=dst_data_ptrs, item_lens=item_lens,
        dst_item_lens=dst_item_lens, state_type=state_type, force_flat=force_flat,
        src_layer_ids=src_layer_ids, dst_layer_ids=dst_layer_ids)
    if mismatch is None:
        return None
    if bootstrap_room is None:
        raise ValueError(f"{mismatch} (and no bootstrap_room to fail the request with)")
    sglang_global("logger").error(mismatch)
    self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=mismatch)
    return -1


def send_kvcache_batch(
    self: Any,
    mooncake_session_id: str,
    requests: Sequence[tuple[Any, Any]],
    dst_kv_ptrs: list[int],
    executor: Any,
    dst_layer_ids: list[int] | None = None,
) -> list[int]:
    """Several KV requests to one decode peer session at once: ``requests`` holds each one's
    ``(prefill_kv_indices, dst_kv_indices)``, as ``send_kvcache`` takes them one by one. One
    :meth:`kvplan.Template.plan_batch` (the template ``send_kvcache`` plans each with) is
    submitted to ``self.engine`` in bounded calls (``BatchPlan.call_ranges``: whole requests
    packed, at most the ``max_blocks`` setting per call); returns one status per request, as
    ``send_kvcache`` would for it: 0, or the status of a failed call holding its blocks. A
    failed call fails only the requests it held; the other calls are still made.

    SGLang 0.5.23's transfer worker takes one request (one room) at a time from its queue,
    so nothing in SGLang calls this: it is the seam for a caller holding several requests for
    one peer (a worker that drains its queue). Where kvplan would not plan the request itself
    (SGLang's own method, a replaced ``_transfer_data``, a custom memory pool, unified memory,
    HiSparse, state), each request goes through ``self.send_kvcache`` one by one instead."""
    get_memory = sglang_global("get_memory")
    force_flat = get_memory().enable_unified_memory
    template = (None if force_flat or not owns_transfer_data(self) or (
        self.enable_custom_mem_pool and getattr(self, "custom_mem_pool_type", None)
        != "INTRA_NODE_NVLINK")
        else _generic_template(self, mooncake_session_id, self.kv_args.kv_data_ptrs,
                               dst_kv_ptrs, self.kv_args.kv_item_lens,
                               self.kv_args.kv_layer_ids, dst_layer_ids, False))
    if template is None:
        return [engine_status(self.send_kvcache(mooncake_session_id, p, dst_kv_ptrs, d,
                                                executor, dst_layer_ids))
                for p, d in requests]
    self._validate_envelope_kv_layout(dst_kv_ptrs, None, None)
    pairs = [_page_arrays(p, d) for p, d in requests]
    batch = planned(lambda: template.plan_batch(pairs))
    return send_batch_calls(self, mooncake_session_id, batch)


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
    dst_ids = published_ids(dst_layer_ids)
    if not (published_ids(self.kv_args.kv_layer_ids) or dst_ids) and not owns_mha_slicer(self):
        original = sglang_method(self, "send_kvcache_slice", MOONCAKE_MANAGER)
        return engine_status(original(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                                dst_kv_indices, dst_tp_rank, dst_attn_tp_size,
                                dst_kv_item_len, executor, dst_layer_ids))
    logger = sglang_global("logger")
    items = list(self.kv_args.kv_item_lens)
    if (published_ids(self.kv_args.kv_layer_ids) or dst_ids) and any(n != items[0] for n in items):
        logger.error(
            f"[{mooncake_session_id}] head-sliced transfer assumes one item "
            f"length for every KV entry, got {set(items)}")
        return -1
    num_heads = g.src_hpr if g.tp_p > g.tp_d else g.dst_hpr
    slot = int(dst_kv_item_len) // g.page
    if num_heads * g.head_bytes > slot:
        logger.error(
            f"[{mooncake_session_id}] slice size ({num_heads * g.head_bytes}) exceeds "
            f"target token slot size ({slot})")
        return -1
    # with layer ids (either side) the open message carries the decode entry each of this
    # rank's entries fills (the direct template's pairs: ``stages.pp_stage``)
    if staging_of(self) is not None and len(items) % 2 == 0:
        staged = maybe_send(
            self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices,
            kind="mha_slice", dst_layer_ids=dst_layer_ids, dst_item=int(dst_kv_item_len),
            slice_geometry=dict(
                kv_heads=g.heads, prefill_tp=g.tp_p, prefill_rank=g.r_p, decode_tp=g.tp_d,
                decode_rank=g.r_d, page_size=g.page, head_dim=g.head_bytes, dtype_size=1,
                num_layers=len(items) // 2, prefill_item_lens=items))
        if staged is not None:
            return staged
    template = _slice_template(self, mooncake_session_id, list(dst_kv_ptrs),
                               int(dst_kv_item_len), dst_ids, g)
    plan = planned(lambda: template.plan(*_page_arrays(prefill_kv_indices, dst_kv_indices)))
    # SGLang's slice hands each layer pair to the engine itself (no ``_transfer_data``) and
    # awaits the executor's tasks with ``_await_transfer_futures``.
    failed = FailedBlocks(self, mooncake_session_id, template, plan)
    if sglang_impl(self, "_await_transfer_futures") is None:
        return _send_per_pair(self, mooncake_session_id, plan, executor,
                              through_transfer_data=False, await_with_manager=True,
                              failed=failed)
    return send_engine_batches(self, mooncake_session_id, plan, failed)


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
        original = sglang_method(self, "send_kvcache", MOONCAKE_MANAGER)
        return engine_status(original(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                                dst_kv_indices, executor, dst_layer_ids, dst_device_kv_indices,
                                dst_kv_item_len, dst_attn_tp_size))
    self._validate_envelope_kv_layout(dst_kv_ptrs, dst_kv_item_len, dst_attn_tp_size)
    get_memory = sglang_global("get_memory")
    # SGLang sends MLA, and MHA at equal attention TP, through this one generic path (one
    # item per page per entry, entries paired by layer id or position): both stage alike.
    if staging_of(self) is not None and not get_memory().enable_unified_memory:
        staged = maybe_send(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                            dst_kv_indices, kind="mla", dst_layer_ids=dst_layer_ids)
        if staged is not None:
            return staged
    return _generic_over_kv_buffers(
        self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor,
        dst_layer_ids, force_flat=get_memory().enable_unified_memory,
        dst_device_data_indices=None, dst_device_data_ptrs=None)


def _generic_over_kv_buffers(
    self: Any,
    mooncake_session_id: str,
    prefill_kv_indices: Any,
    dst_kv_ptrs: list[int],
    dst_kv_indices: Any,
    executor: Any,
    dst_layer_ids: list[int] | None,
    **manager_kwargs: Any,
) -> int:
    """``self._send_kvcache_generic`` over this manager's KV buffers, with the keyword arguments
    SGLang's ``send_kvcache`` passes; ``manager_kwargs`` are those only one manager passes."""
    return engine_status(self._send_kvcache_generic(
        mooncake_session_id=mooncake_session_id,
        src_data_ptrs=self.kv_args.kv_data_ptrs,
        dst_data_ptrs=dst_kv_ptrs,
        item_lens=self.kv_args.kv_item_lens,
        prefill_data_indices=prefill_kv_indices,
        dst_data_indices=dst_kv_indices,
        executor=executor,
        src_layer_ids=self.kv_args.kv_layer_ids,
        dst_layer_ids=dst_layer_ids,
        **manager_kwargs,
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
        return _generic_over_kv_buffers(self, mooncake_session_id, prefill_kv_indices,
                                        dst_kv_ptrs, dst_kv_indices, executor, dst_layer_ids)
    kv_args = self.kv_args
    src_ptrs, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_item_lens)
    dst_ptrs = list(dst_kv_ptrs)
    slicer: str | None = "flat"
    if self.pp_size > 1:
        if self.is_mla_backend:
            slicer = mla_slicer(self)
            if getattr(kv_args, "mla_compression_ratios", None):
                slicer = None  # compressed MLA: SGLang's own slicing
        else:
            slicer = "mha" if owns_mha_slicer(self) else None
    if slicer is None:
        original = sglang_method(self, "send_kvcache", ASCEND_MANAGER)
        return engine_status(original(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                                dst_kv_indices, executor, dst_layer_ids, dst_device_kv_indices,
                                dst_kv_item_len, dst_attn_tp_size))
    template = _positional_template(self, mooncake_session_id, f"ascend-{slicer}", src_ptrs,
                                    dst_ptrs, items, slicer)
    plan = planned(lambda: template.plan(*_page_arrays(prefill_kv_indices, dst_kv_indices)))
    failed = FailedBlocks(self, mooncake_session_id, template, plan)
    if self.enable_custom_mem_pool:
        return _send_per_pair(self, mooncake_session_id, plan, executor,
                              through_transfer_data=True, await_with_manager=False,
                              failed=failed)
    return send_all(self, mooncake_session_id, plan, failed)


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
    session, template = _mamba_template(self, req, src_state_data_ptrs, src_state_item_lens,
                                        dst_state_data_ptrs, src_layer_ids, dst_layer_ids,
                                        dst_state_item_lens)
    plan = planned(lambda: template.plan_state(int(prefill_mamba_index[0]),
                                               int(dst_mamba_index[0])))
    return send_all(self, session, plan,
                    FailedBlocks(self, session, template, plan, getattr(req, "room", None)))


def _send_mamba_state_slice(
    self: Any,
    req: Any,
    prefill_mamba_index: list[Any],
    src_state_data_ptrs: list[int],
    src_state_item_lens: list[int],
    src_state_dim_per_tensor: list[int],
    dst_state_data_ptrs: list[int],
    dst_mamba_index: list[Any],
    dst_state_item_lens: list[int],
    dst_state_dim_per_tensor: list[int],
    dst_tp_rank: int,
    dst_attn_tp_size: int,
    src_state_conv_shard_groups: list[Any] | None = None,
    src_state_slice_outer_counts: list[int] | None = None,
    src_layer_ids: list[int] | None = None,
    dst_layer_ids: list[int] | None = None,
) -> int:
    """kvplan's ``MooncakeKVManager._send_mamba_state_slice`` (SGLang 0.5.23 signature): the
    state slot of each pair re-sliced between the two attention TP sizes by kvplan's state
    template (TP channel splits), one ``_transfer_data`` call's worth of blocks; without
    per-tensor dims on either side, ``self._send_mamba_state`` as SGLang calls it."""
    assert len(prefill_mamba_index) == 1, "Mamba should have single state index"
    if not src_state_dim_per_tensor or not dst_state_dim_per_tensor:
        return int(self._send_mamba_state(
            req, prefill_mamba_index, src_state_data_ptrs, src_state_item_lens,
            dst_state_data_ptrs, dst_mamba_index, src_layer_ids, dst_layer_ids,
            dst_state_item_lens))
    tp = (int(self.state_tp_size), int(self.kv_args.engine_rank) % int(self.state_tp_size),
          int(dst_attn_tp_size), int(dst_tp_rank) % int(dst_attn_tp_size))
    session = req.mooncake_session_id
    template = _mamba_slice_template(
        self, session, src_state_data_ptrs, src_state_item_lens, src_state_dim_per_tensor,
        dst_state_data_ptrs, dst_state_item_lens, dst_state_dim_per_tensor, tp,
        src_state_conv_shard_groups, src_state_slice_outer_counts, src_layer_ids, dst_layer_ids)
    plan = planned(lambda: template.plan_state(int(prefill_mamba_index[0]),
                                               int(dst_mamba_index[0])))
    return send_all(self, session, plan,
                    FailedBlocks(self, session, template, plan, getattr(req, "room", None)))
