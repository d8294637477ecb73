"""kvplan's methods for SGLang 0.5.23's ``NixlKVManager`` (``disaggregation/nixl/conn.py``).

SGLang's NIXL manager plans three ways: per request on the non-prepared path of
``_send_kvcache_generic`` (one ``(addr, len, dev)`` descriptor per entry pair and page run,
handed to ``agent.get_xfer_descs`` / ``initialize_xfer``), once per peer on the prepared paths
(``_prep_equal_tp_dlist`` and ``_init_hetero_tp_prep_handle``: strided ``(addr, len, dev,
stride, count)`` rows, then per request only indices into them), and per state slot
(``_send_mamba_state``). kvplan
replaces the planning of each and keeps every call SGLang makes on ``self`` or its agent:

* ``_send_kvcache_generic`` (non-prepared path, the KV pool, DCP parts and flat state
  components): a cached :class:`kvplan.Template` per peer plans the request; its blocks become
  the two descriptor arrays SGLang hands to ``self.agent.get_xfer_descs`` (same memory kinds,
  same device ids), then ``initialize_xfer`` and ``self._post_xfer`` as in SGLang. One
  descriptor per block, and blocks are maximal runs, so never more descriptors than SGLang's.
  The prepared path (``make_prepped_xfer`` over slot indices), calls with ``dst_item_lens``
  (element elision, SGLang's stride check) and replaced slicers go to SGLang's own method.
* ``_prep_equal_tp_dlist``: the strided rows come from a :class:`kvplan.Layout` of the entries
  (one row per entry: base, transfer length, device, item stride, slots), then go to
  ``self._prep_xfer_dlist`` (SGLang's strided call with its per-block fallback).
* ``_init_hetero_tp_prep_handle``: the prepared head-slice lists of a peer whose attention TP
  differs, one strided row per entry pair from one page of the head-sliced template's plan;
  SGLang's ``send_kvcache_slice`` then indexes them per request as before.
* ``_send_mamba_state``: a state template per peer, one block per entry pair
  (``Template.plan_state``), entries with a zero length or a null pointer skipped as SGLang
  skips them; descriptors as above.

* ``_send_mamba_state_slice`` (attention TP sizes differ): the Mooncake drop-in's state
  template with TP channel splits, pairs with a zero length or a null pointer skipped as
  SGLang skips them; descriptors as above.

* ``send_kvcache_staged`` at prefill PP 1: the Mooncake drop-in's staged template; SGLang's
  gather kernel fills the staging buffer and the plan's network blocks are posted.

* ``_init_mixed_equal_tp_prep_handles`` and ``send_kvcache_mixed`` (entries of several memory
  kinds): per memory-kind segment one template (:func:`mixed_segment_template`); its
  ``Template.descriptor_runs`` are the two prepared lists (one strided row per entry) and its
  ``Template.prepped_indices`` the indices into them; SGLang's segment bookkeeping,
  ``make_prepped_xfer`` / ``self._post_xfer`` calls and errors.

* ``_prepare_state_xfer`` and ``_send_prepared_states`` (the prepared state plans): per
  prepared state component a template of its live entry pairs; the lists are its
  ``Template.descriptor_runs`` (one strided row per pair), the indices its
  ``Template.prepped_state_indices`` (:mod:`kvplan.compat.sglang.nixl_state`).

``send_kvcache`` and ``send_kvcache_dcp`` stay SGLang's: they only dispatch to
``self._send_kvcache_generic`` (so kvplan plans their requests). ``send_kvcache_slice`` stays
SGLang's: per request it only indexes the prepared head-slice lists kvplan built.

Differences from SGLang (typed ``kvplan.KvPlanError`` subclasses), each where SGLang reads or
writes outside the buffers, or pairs the wrong entries: docs/sglang.md lists them.

``install`` also wraps three manager methods so the peers check layout identities
(:func:`hook_identity`): the decode's ``build_receiver_registration_message`` appends the
Mooncake drop-in's identity frame after SGLang's 24 fields (SGLang's parse reads up to frame
23), the prefill's ``_add_remote_peer`` checks it with the Mooncake drop-in's check
(``rounds.check_registered``), and ``add_transfer_request`` fails a room bound for a refused
decode through SGLang's ``conclude_failure`` before it is queued.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvplan import _core
from kvplan._core import Layout, Pairing, Template, TransferPlan
from kvplan.compat.sglang.cache import template_cache
from kvplan.compat.sglang.layouts import published_ids, unbounded_lens
from kvplan.compat.sglang.metrics import observe, planned
from kvplan.compat.sglang.nixl_state import (  # noqa: F401 - installed from this module
    run_rows,
    _prepare_state_xfer,
    _send_prepared_states,
)
from kvplan.compat.sglang.registry import NIXL_MANAGER, sglang_global, sglang_method
from kvplan.compat.sglang.seams import mla_slicer, owns_mha_slicer
from kvplan.compat.sglang.templates import (
    _dst_item_lens,
    _ids_template,
    as_index,
    _mamba_slice_template,
    _page_arrays,
    _positional_template,
    _slice_geometry,
    _slice_template,
    _state_lens,
)
from kvplan.compat.sglang.wrapping import is_wrapped, unwrap, wrap

if TYPE_CHECKING:
    from kvplan.compat.sglang.rounds import IdentityExchange

#: The signatures (parameter text, as :func:`kvplan.compat._methods.signature_text` writes it)
#: of the NIXL manager's methods kvplan replaces, per SGLang release it was built for.
SUPPORTED_FORMS: dict[str, dict[str, str]] = {
    "_send_kvcache_generic": {
        "(self, peer_name, src_data_ptrs, dst_data_ptrs, item_lens, prefill_data_indices, "
        "dst_data_indices, dst_gpu_id, state_type=None, src_mem_kind='VRAM', "
        "dst_mem_kind='VRAM', force_flat=False, bypass_prepped=False, src_layer_ids=None, "
        "dst_layer_ids=None, dst_item_lens=None)": "SGLang 0.5.23",
    },
    "_send_mamba_state": {
        "(self, peer_name, prefill_state_indices, src_state_data_ptrs, src_state_item_lens, "
        "dst_state_data_ptrs, dst_state_indices, dst_gpu_id, src_layer_ids=None, "
        "dst_layer_ids=None)": "SGLang 0.5.23",
    },
    "_send_mamba_state_slice": {
        "(self, peer_name, prefill_state_indices, src_state_data_ptrs, src_state_item_lens, "
        "src_state_dim_per_tensor, dst_state_data_ptrs, dst_state_indices, "
        "dst_state_item_lens, dst_state_dim_per_tensor, dst_gpu_id, decode_tp_size, "
        "decode_tp_rank, src_state_conv_shard_groups=None, src_state_slice_outer_counts=None, "
        "src_layer_ids=None, dst_layer_ids=None)": "SGLang 0.5.23",
    },
    "send_kvcache_staged": {
        "(self, peer_name, prefill_kv_indices, dst_staging_ptr, dst_staging_size, dst_gpu_id, "
        "dst_tp_rank, dst_attn_tp_size, dst_kv_item_len, staging_buffer=None)": "SGLang 0.5.23",
    },
    "_prep_equal_tp_dlist": {
        "(self, peer_name, kv_ptrs, kv_item_lens, kv_data_lens, gpu_id, num_slots=None, "
        "mem_kind='VRAM', kv_xfer_lens=None)": "SGLang 0.5.23",
    },
    "_init_hetero_tp_prep_handle": {
        "(self, peer_name, decode_kv_args, src_mem_kind='VRAM', dst_mem_kind='VRAM')":
            "SGLang 0.5.23",
    },
    "_init_mixed_equal_tp_prep_handles": {
        "(self, peer_info, mem_segments)": "SGLang 0.5.23",
    },
    "send_kvcache_mixed": {
        "(self, peer_name, prefill_kv_indices, dst_kv_indices)": "SGLang 0.5.23",
    },
    "_prepare_state_xfer": {"(self, peer_info)": "SGLang 0.5.23"},
    "_send_prepared_states": {
        "(self, *, plan, prefill_state_indices, dst_state_indices)": "SGLang 0.5.23",
    },
}

#: What kvplan's replacements read in SGLang's module and on ``self``: the host's methods
#: must read them too (a release that renamed them is refused).
READS: dict[str, tuple[str, ...]] = {
    "_send_kvcache_generic": ("prep_handles", "get_xfer_descs", "initialize_xfer",
                              "_post_xfer", "_nixl_device_id", "is_mla_backend"),
    "_send_mamba_state": ("get_xfer_descs", "initialize_xfer", "_post_xfer"),
    "_send_mamba_state_slice": ("_send_mamba_state", "state_tp_size", "engine_rank",
                                "get_xfer_descs", "initialize_xfer", "_post_xfer"),
    "send_kvcache_staged": ("kv_buffer_tensors", "attn_tp_size", "get_xfer_descs",
                            "initialize_xfer", "_post_xfer", "engine_rank"),
    "_prep_equal_tp_dlist": ("_prep_xfer_dlist", "_pack_stride_descs", "_nixl_device_id"),
    "_init_hetero_tp_prep_handle": ("prep_handle_slice_src", "prep_handles_slice_dst",
                                    "_prep_xfer_dlist", "dst_kv_item_len", "decode_tp_rank"),
    "_init_mixed_equal_tp_prep_handles": ("prep_handles_segment_src", "_num_slots_src",
                                          "dst_num_slots", "dst_kv_item_lens", "dst_kv_ptrs",
                                          "src_mem_kind", "dst_mem_kind", "kv_xfer_segments",
                                          "_KVXferPreparedSegment"),
    "send_kvcache_mixed": ("decode_kv_args_table", "kv_xfer_segments", "_num_slots_src",
                           "dst_num_slots", "src_handle", "dst_handle", "make_prepped_xfer",
                           "_post_xfer"),
    "_prepare_state_xfer": ("_prepared_state_plans", "_state_layout_rejections",
                            "_prepared_state_components", "dst_dcp_size",
                            "requires_dcp_relayout", "dst_state_data_lens",
                            "_plan_prepared_state_component", "_build_prepared_state_plan"),
    "_send_prepared_states": ("components", "_nth", "state_types", "make_prepped_xfer",
                              "src_handle", "dst_handle", "_post_xfer"),
}


def _device_id(mem_kind: str, gpu_id: int) -> int:
    return int(sglang_global("_nixl_device_id", NIXL_MANAGER)(mem_kind, gpu_id))


def _descriptor_rows(addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64],
                     device: int) -> npt.NDArray[np.uint64]:
    """``(n, 3)`` uint64 ``(addr, len, dev_id)`` rows, the array SGLang hands the agent."""
    rows = np.empty((len(addrs), 3), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = lengths
    rows[:, 2] = device
    return rows


def _post(self: Any, peer_name: str, plan: TransferPlan, src_mem_kind: str, dst_mem_kind: str,
          dst_gpu_id: int, create_error: str, post_error: str) -> Any:
    """The plan's blocks as SGLang posts its descriptors: ``get_xfer_descs`` per side,
    ``initialize_xfer("WRITE", ...)``, ``self._post_xfer``; returns the transfer handle."""
    src_rows = _descriptor_rows(plan.src_addrs, plan.lengths,
                                _device_id(src_mem_kind, self.kv_args.gpu_id))
    dst_rows = _descriptor_rows(plan.dst_addrs, plan.lengths, _device_id(dst_mem_kind, dst_gpu_id))
    src_descs = self.agent.get_xfer_descs(src_rows, src_mem_kind)
    dst_descs = self.agent.get_xfer_descs(dst_rows, dst_mem_kind)
    handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer_name)
    if not handle:
        raise Exception(create_error)  # SGLang's exception, which its worker handles
    self._post_xfer(handle, post_error)
    return handle


def _uses_prepared_lists(self: Any, peer_name: str, src_data_ptrs: Any,
                         bypass_prepped: bool) -> bool:
    """SGLang's own test for its prepared path (read in its order)."""
    return (not bypass_prepped and src_data_ptrs is self.kv_args.kv_data_ptrs
            and "" in self.prep_handles and peer_name in self.prep_handles)


def nixl_generic_template(self: Any, peer_name: str, src_data_ptrs: Sequence[int],
                          dst_data_ptrs: Sequence[int], item_lens: Sequence[int],
                          force_flat: bool, src_layer_ids: Sequence[int] | None,
                          dst_layer_ids: Sequence[int] | None) -> Template | None:
    """The cached template of a non-prepared ``_send_kvcache_generic`` call: the manager's
    own KV buffers pair by the layer ids both peers registered (:func:`_registered_ids`);
    otherwise SGLang's NIXL branch: MLA or flat entries pair by the call's layer ids when
    either side gives them (positional fallback at PP 1), else by SGLang's MLA PP slicing;
    MHA entries by SGLang's K-block / V-block PP slicing (strict: kvplan needs the decode's
    KV layer count where the entry counts differ).
    ``None`` where SGLang's own method runs (a replaced slicer, compressed MLA)."""
    src_ptrs = [int(p) for p in src_data_ptrs]
    dst_ptrs = [int(p) for p in dst_data_ptrs]
    items = [int(n) for n in item_lens]
    # SGLang's own slicer (not a subclass's or a wrapper's) is what registered ids stand in for
    own_slicer = mla_slicer(self) is not None if self.is_mla_backend else owns_mha_slicer(self)
    registered = None if force_flat or not own_slicer else _registered_ids(
        self, peer_name, src_ptrs, dst_ptrs)
    if registered is not None:
        return _ids_template(self, peer_name, "nixl:registered-ids", src_ptrs, dst_ptrs, items,
                             registered[0], registered[1], self.pp_size == 1)
    if self.is_mla_backend or force_flat:
        src_ids, dst_ids = published_ids(src_layer_ids), published_ids(dst_layer_ids)
        if src_ids or dst_ids:
            return _ids_template(self, peer_name, "nixl:ids", src_ptrs, dst_ptrs, items,
                                 src_ids, dst_ids, self.pp_size == 1)
        slicer = mla_slicer(self)
        if slicer is None or (len(src_ptrs) != len(dst_ptrs) and getattr(
                self.kv_args, "mla_compression_ratios", None)):
            return None
        return _positional_template(self, peer_name, "nixl:kv", src_ptrs, dst_ptrs, items,
                                    slicer)
    if not owns_mha_slicer(self):
        return None
    return _positional_template(self, peer_name, "nixl:kv", src_ptrs, dst_ptrs, items, "mha")


def _registered_ids(self: Any, peer_name: str, src_ptrs: list[int], dst_ptrs: list[int]
                    ) -> tuple[list[int], list[int]] | None:
    """The layer ids both peers registered for exactly these KV buffers (the prefill's
    ``kv_args.kv_layer_ids``, the decode's ``dst_kv_layer_ids``), else None. SGLang's NIXL KV
    path slices positionally even when both publish them, and guesses the decode's V block
    from the entry counts; kvplan pairs by the ids whenever both sides give them."""
    src_ids = list(getattr(self.kv_args, "kv_layer_ids", None) or [])
    if len(src_ids) != len(src_ptrs) or list(self.kv_args.kv_data_ptrs) != src_ptrs:
        return None
    info = (getattr(self, "decode_kv_args_table", None) or {}).get(peer_name)
    dst_ids = list(getattr(info, "dst_kv_layer_ids", None) or [])
    if len(dst_ids) != len(dst_ptrs) or list(getattr(info, "dst_kv_ptrs", [])) != dst_ptrs:
        return None
    return [int(i) for i in src_ids], [int(i) for i in dst_ids]


def _send_kvcache_generic(
    self: Any,
    peer_name: str,
    src_data_ptrs: list[int],
    dst_data_ptrs: list[int],
    item_lens: list[int],
    prefill_data_indices: Any,
    dst_data_indices: Any,
    dst_gpu_id: int,
    state_type: Any = None,
    src_mem_kind: str = "VRAM",
    dst_mem_kind: str = "VRAM",
    force_flat: bool = False,
    bypass_prepped: bool = False,
    src_layer_ids: list[int] | None = None,
    dst_layer_ids: list[int] | None = None,
    dst_item_lens: list[int] | None = None,
) -> Any:
    """kvplan's ``NixlKVManager._send_kvcache_generic`` (SGLang 0.5.23 signature): returns the
    transfer handle, or None when there is nothing to transfer, as SGLang's."""

    def sglangs() -> Any:
        original = sglang_method(self, "_send_kvcache_generic", NIXL_MANAGER)
        return original(self, peer_name, src_data_ptrs, dst_data_ptrs, item_lens,
                        prefill_data_indices, dst_data_indices, dst_gpu_id, state_type,
                        src_mem_kind, dst_mem_kind, force_flat, bypass_prepped, src_layer_ids,
                        dst_layer_ids, dst_item_lens)

    if _uses_prepared_lists(self, peer_name, src_data_ptrs, bypass_prepped) \
            or dst_item_lens is not None:
        return sglangs()
    template = nixl_generic_template(self, peer_name, src_data_ptrs, dst_data_ptrs, item_lens,
                                     force_flat, src_layer_ids, dst_layer_ids)
    if template is None:
        return sglangs()
    src, dst = _page_arrays(prefill_data_indices, dst_data_indices)
    _bound_registered_sources(self, src_data_ptrs, item_lens, src)
    plan = planned(lambda: template.plan(src, dst))
    if template.n_pairs == 0:
        return None  # SGLang: no entry pairs, no transfer
    return _post(self, peer_name, plan, src_mem_kind, dst_mem_kind, dst_gpu_id,
                 "KVSender failed to create transfer", "KVSender failed to post transfer")


def _bound_registered_sources(self: Any, src_data_ptrs: Sequence[int],
                              item_lens: Sequence[int], src: npt.NDArray[Any]) -> None:
    """Source rows past a registered KV buffer are refused also when the call's source list
    is only part of the manager's buffers (``send_kvcache_dcp`` hands its target and draft
    parts separately, in token rows): a source pointer that is one of ``kv_args``'s buffers
    is bounded by that buffer's length over the call's item length
    (:class:`kvplan.IndexBoundsError`, where SGLang would read past the buffer)."""
    if src.size == 0:
        return
    own = getattr(self.kv_args, "kv_data_ptrs", None) or []
    lens = getattr(self.kv_args, "kv_data_lens", None) or []
    where = {int(p): k for k, p in enumerate(own) if k < len(lens)}
    lo, hi = int(src.min()), int(src.max())
    for i, (ptr, item) in enumerate(zip(src_data_ptrs, item_lens)):
        k = where.get(int(ptr))
        if k is None or int(item) <= 0:
            continue
        rows = int(lens[k]) // int(item)
        if lo < 0 or hi >= rows:
            raise _core.IndexBoundsError(
                f"source entry {i} (buffer {k} of the prefill, {int(lens[k])} bytes) holds "
                f"{rows} items of {int(item)} bytes; the request reads item "
                f"{lo if lo < 0 else hi}")


def _nixl_state_template(self: Any, peer_name: str, src_ptrs: list[int], items: list[int],
                         dst_ptrs: list[int], src_ids: list[int] | None,
                         dst_ids: list[int] | None) -> Template:
    """State entries paired as SGLang's NIXL ``_send_mamba_state`` pairs them (by layer id,
    positional at PP 1); a pair with a zero length or a null pointer on either side moves
    nothing, as SGLang skips it. Cached per peer."""
    fallback = self.pp_size == 1
    src_lens = _state_lens(getattr(self, "kv_args", None), src_ptrs)
    inputs = (src_ptrs, dst_ptrs, items, src_ids, dst_ids, fallback, src_lens)

    def build() -> Template:
        pairs = _core.pair_entries(src_ids, dst_ids, len(src_ptrs), len(dst_ptrs), fallback)
        moving = list(items)
        for i, j in pairs.tolist():
            if src_ptrs[i] == 0 or dst_ptrs[j] == 0:
                moving[i] = 0
        # a skipped entry's null base still needs an address the layout accepts; it is
        # never read (its item length is 0)
        src_base = [p if p or moving[i] else 1 for i, p in enumerate(src_ptrs)]
        dst_moving = _dst_item_lens(pairs, moving, len(dst_ptrs), None)
        dst_base = [p if p or dst_moving[j] else 1 for j, p in enumerate(dst_ptrs)]
        limit = (1 << 64) - 1
        src = Layout(src_base, [min(n, limit - b) for n, b in zip(src_lens, src_base)], moving,
                     src_ids,
                     kinds=["state"] * len(src_ptrs))
        dst = Layout(dst_base, unbounded_lens(dst_base), dst_moving, dst_ids,
                     kinds=["state"] * len(dst_ptrs))
        return Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=fallback))

    return cast(Template, template_cache(self).get(peer_name, "nixl:mamba", inputs, build))


def _send_mamba_state(
    self: Any,
    peer_name: str,
    prefill_state_indices: list[int],
    src_state_data_ptrs: list[int],
    src_state_item_lens: list[int],
    dst_state_data_ptrs: list[int],
    dst_state_indices: list[int],
    dst_gpu_id: int,
    src_layer_ids: list[int] | None = None,
    dst_layer_ids: list[int] | None = None,
) -> Any:
    """kvplan's ``NixlKVManager._send_mamba_state`` (SGLang 0.5.23 signature)."""
    assert len(prefill_state_indices) == 1, "Mamba should have single state index"
    assert len(dst_state_indices) == len(prefill_state_indices), (
        "State indices count mismatch between Prefill and Decode")
    template = _nixl_state_template(
        self, peer_name, [int(p) for p in src_state_data_ptrs],
        [int(n) for n in src_state_item_lens], [int(p) for p in dst_state_data_ptrs],
        published_ids(src_layer_ids), published_ids(dst_layer_ids))
    plan = planned(lambda: template.plan_state(int(prefill_state_indices[0]),
                                               int(dst_state_indices[0])))
    return _post(self, peer_name, plan, "VRAM", "VRAM", dst_gpu_id,
                 "Failed to create Mamba state transfer", "Failed to post Mamba state transfer")


def _send_mamba_state_slice(
    self: Any,
    peer_name: str,
    prefill_state_indices: list[int],
    src_state_data_ptrs: list[int],
    src_state_item_lens: list[int],
    src_state_dim_per_tensor: list[int],
    dst_state_data_ptrs: list[int],
    dst_state_indices: list[int],
    dst_state_item_lens: list[int],
    dst_state_dim_per_tensor: list[int],
    dst_gpu_id: int,
    decode_tp_size: int,
    decode_tp_rank: int,
    src_state_conv_shard_groups: list[Any] | None = None,
    src_state_slice_outer_counts: list[int] | None = None,
    src_layer_ids: list[int] | None = None,
    dst_layer_ids: list[int] | None = None,
) -> Any:
    """kvplan's ``NixlKVManager._send_mamba_state_slice`` (SGLang 0.5.23 signature): the
    Mooncake drop-in's state template with TP channel splits (cached per peer), pairs with a
    zero source length or a null pointer skipped as SGLang skips them; descriptors as for
    ``_send_mamba_state``. Without per-tensor dims on either side, ``self._send_mamba_state``
    as SGLang calls it."""
    assert len(prefill_state_indices) == 1, "Mamba should have single state index"
    if not src_state_dim_per_tensor or not dst_state_dim_per_tensor:
        return self._send_mamba_state(
            peer_name, prefill_state_indices, src_state_data_ptrs, src_state_item_lens,
            dst_state_data_ptrs, dst_state_indices, dst_gpu_id, src_layer_ids=src_layer_ids,
            dst_layer_ids=dst_layer_ids)
    tp = (int(self.state_tp_size), int(self.kv_args.engine_rank) % int(self.state_tp_size),
          int(decode_tp_size), int(decode_tp_rank) % int(decode_tp_size))
    template = _mamba_slice_template(
        self, peer_name, src_state_data_ptrs, src_state_item_lens, src_state_dim_per_tensor,
        dst_state_data_ptrs, dst_state_item_lens, dst_state_dim_per_tensor, tp,
        src_state_conv_shard_groups, src_state_slice_outer_counts, src_layer_ids, dst_layer_ids,
        skip_empty=True)
    plan = planned(lambda: template.plan_state(int(prefill_state_indices[0]),
                                               int(dst_state_indices[0])))
    return _post(self, peer_name, plan, "VRAM", "VRAM", dst_gpu_id,
                 "Failed to create Mamba state slice transfer",
                 "Failed to post Mamba state slice transfer")


def send_kvcache_staged(
    self: Any,
    peer_name: str,
    prefill_kv_indices: Any,
    dst_staging_ptr: int,
    dst_staging_size: int,
    dst_gpu_id: int,
    dst_tp_rank: int,
    dst_attn_tp_size: int,
    dst_kv_item_len: int,
    staging_buffer: Any = None,
) -> Any:
    """kvplan's ``NixlKVManager.send_kvcache_staged`` (SGLang 0.5.23 signature): the Mooncake
    drop-in's staged plan (:func:`kvplan.compat.sglang.staged.staged_template`, cached per
    decode peer) over this manager's pools; SGLang's gather kernel fills ``staging_buffer`` as
    SGLang calls it, and the plan's network blocks (one at PP 1) are posted as SGLang posts its
    one descriptor. SGLang's ``None`` fall-backs are kept (no pool tensors or staging buffer,
    either staging area too small); prefill PP > 1 goes to SGLang's own method (the staged
    plan places a stage's layers by slot layer ids, which this signature does not carry). Refusals as the Mooncake
    drop-in's: pages outside the pools (``IndexBoundsError``), a pool or decode item geometry
    other than SGLang's head split (``SizeMismatchError``), a prefill rank holding none of the
    decode rank's heads (``PairingError``), a gather that wrote another byte count than the
    plan sends (``SizeMismatchError``)."""
    from kvplan.compat.sglang import staged as mooncake_staged

    if self.kv_buffer_tensors is None or staging_buffer is None:
        return None
    if self.pp_size > 1:
        original = sglang_method(self, "send_kvcache_staged", NIXL_MANAGER)
        return original(self, peer_name, prefill_kv_indices, dst_staging_ptr, dst_staging_size,
                        dst_gpu_id, dst_tp_rank, dst_attn_tp_size, dst_kv_item_len,
                        staging_buffer=staging_buffer)
    staged = mooncake_staged.gather_staged(
        self, peer_name, prefill_kv_indices, staging_buffer, (dst_staging_ptr, dst_staging_size),
        dst_tp_rank, dst_attn_tp_size, dst_kv_item_len, None,
        sglang_global("logger", NIXL_MANAGER))
    if staged is None:
        return None
    network = staged.network
    src_rows = _descriptor_rows(network.src_addrs, network.lengths, int(self.kv_args.gpu_id))
    dst_rows = _descriptor_rows(network.dst_addrs, network.lengths, int(dst_gpu_id))
    src_descs = self.agent.get_xfer_descs(src_rows, "VRAM")
    dst_descs = self.agent.get_xfer_descs(dst_rows, "VRAM")
    handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer_name)
    if not handle:
        raise RuntimeError(
            f"[Staging] Failed to create NIXL bulk transfer "
            f"(src=0x{staging_buffer.get_ptr():x}, "
            f"dst=0x{dst_staging_ptr + staged.dst_staging_range[0]:x}, "
            f"size={staged.src_staging_bytes})")
    self._post_xfer(handle, "[Staging] NIXL bulk transfer failed to post")
    return handle


def strided_rows(kv_ptrs: Sequence[int], kv_item_lens: Sequence[int],
                 kv_data_lens: Sequence[int], device_id: int, num_slots: int | None,
                 kv_xfer_lens: Sequence[int]) -> npt.NDArray[np.uint64]:
    """The ``(n, 5)`` strided descriptor rows of a prepared list, one per entry: ``(base,
    transfer length, device, item stride, slots)``, from a :class:`kvplan.Layout` of the
    entries (which refuses a zero item length, a null base or a buffer past the address
    space). Refused: lists of different lengths (:class:`kvplan.LayoutError`), a transfer
    length above its stride (:class:`kvplan.SizeMismatchError`), and an explicit slot count
    past an entry's registered buffer (:class:`kvplan.IndexBoundsError`: the decode's slots
    would be addressed past what it registered)."""
    counts = {"ptrs": len(kv_ptrs), "item_lens": len(kv_item_lens),
              "data_lens": len(kv_data_lens), "xfer_lens": len(kv_xfer_lens)}
    if len(set(counts.values())) != 1:
        raise _core.LayoutError(f"prepared descriptor list geometry differs in length: {counts}")
    layout = Layout([int(p) for p in kv_ptrs], [int(n) for n in kv_data_lens],
                    [int(n) for n in kv_item_lens])
    rows = np.empty((layout.n_entries, 5), dtype=np.uint64)
    for i, (xfer, item, data) in enumerate(zip(kv_xfer_lens, kv_item_lens, kv_data_lens)):
        if int(xfer) > int(item):
            raise _core.SizeMismatchError(
                f"entry {i}: prepared transfer length {int(xfer)} exceeds its item stride "
                f"{int(item)}")
        slots = int(data) // int(item)
        if num_slots is not None:
            if int(num_slots) > slots or int(num_slots) < 0:
                raise _core.IndexBoundsError(
                    f"entry {i}: {int(num_slots)} prepared slots of {int(item)} bytes pass its "
                    f"registered {int(data)} bytes ({slots} slots)")
            slots = int(num_slots)
        rows[i] = (int(kv_ptrs[i]), int(xfer), device_id, int(item), slots)
    return rows


def _prep_equal_tp_dlist(
    self: Any,
    peer_name: str,
    kv_ptrs: list[int],
    kv_item_lens: list[int],
    kv_data_lens: list[int],
    gpu_id: int,
    num_slots: int | None = None,
    mem_kind: str = "VRAM",
    kv_xfer_lens: list[int] | None = None,
) -> Any:
    """kvplan's ``NixlKVManager._prep_equal_tp_dlist`` (SGLang 0.5.23 signature): the strided
    rows of :func:`strided_rows` handed to ``self._prep_xfer_dlist``, as SGLang hands its."""
    rows = strided_rows(kv_ptrs, kv_item_lens, kv_data_lens, _device_id(mem_kind, gpu_id),
                        num_slots, kv_item_lens if kv_xfer_lens is None else kv_xfer_lens)
    return self._prep_xfer_dlist(peer_name, rows, mem_kind)


#: NIXL's prepared transfers take int32 descriptor indices (SGLang hands it int32 arrays).
_INT32_MAX = (1 << 31) - 1


def mixed_segment_template(self: Any, peer_name: str, info: Any, seg: Any) -> Template:
    """The template of one memory-kind segment of a peer's mixed prepared lists (cached per
    peer and segment), which defines both the lists (:func:`_init_mixed_equal_tp_prep_handles`
    prepares its ``Template.descriptor_runs``) and the indices into them
    (:func:`send_kvcache_mixed`, ``Template.prepped_indices``): the prefill's entries
    ``seg.start .. seg.end`` with ``self._num_slots_src`` slots of their item length; the
    decode's with ``seg.dst_num_slots`` slots of its item length as the stride, each moving the
    prefill's item length (SGLang's lists for the segment). Entries pair positionally (the
    lists are sliced alike), each pair one piece (``coalesce=False``: one prepared row per
    entry)."""
    lo, hi = int(seg.start), int(seg.end)
    src_ptrs = [int(p) for p in self.kv_args.kv_data_ptrs[lo:hi]]
    items = [int(n) for n in self.kv_args.kv_item_lens[lo:hi]]
    dst_ptrs = [int(p) for p in info.dst_kv_ptrs[lo:hi]]
    dst_items = [int(n) for n in info.dst_kv_item_lens[lo:hi]]
    src_slots, dst_slots = int(self._num_slots_src), int(seg.dst_num_slots)
    inputs = (src_ptrs, items, src_slots, dst_ptrs, dst_items, dst_slots)

    def build() -> Template:
        src = Layout(src_ptrs, [n * src_slots for n in items], items)
        dst = Layout(dst_ptrs, [n * dst_slots for n in dst_items], items, strides=dst_items)
        return Template(src, dst, Pairing.positional(), coalesce=False)

    return cast(Template, template_cache(self).get(peer_name, f"nixl:mixed:{lo}:{hi}", inputs,
                                                   build))


def _int32_indices(indices: npt.NDArray[np.int64], side: str) -> npt.NDArray[np.int32]:
    if indices.size and int(indices.max()) > _INT32_MAX:
        raise _core.IndexBoundsError(
            f"{side} prepared index {int(indices.max())} exceeds NIXL's int32 indices "
            f"(at most {_INT32_MAX})")
    return indices.astype(np.int32)


def _kvplan_prep(self: Any) -> bool:
    """Whether the manager's ``_prep_equal_tp_dlist`` is kvplan's (not a subclass's or an
    instance's replacement, whose lists kvplan has not seen)."""
    attrs = getattr(self, "__dict__", None) or {}
    prep = getattr(type(self), "_prep_equal_tp_dlist", None)
    return "_prep_equal_tp_dlist" not in attrs and bool(getattr(prep, "_kvplan_dropin", False))


def _mixed_lists_are_kvplans(self: Any) -> bool:
    """Whether the manager's segment lists are the ones :func:`mixed_segment_template`
    describes: prepared by kvplan's ``_init_mixed_equal_tp_prep_handles`` (or SGLang's over
    kvplan's ``_prep_equal_tp_dlist``, whose rows are the same); a subclass's or an
    instance's replacement of either builds lists kvplan has not seen, and SGLang's own method
    indexes them."""
    attrs = getattr(self, "__dict__", None) or {}
    if "_init_mixed_equal_tp_prep_handles" in attrs or not _kvplan_prep(self):
        return False
    init = getattr(type(self), "_init_mixed_equal_tp_prep_handles", None)
    own_init = sglang_method(self, "_init_mixed_equal_tp_prep_handles", NIXL_MANAGER)
    return bool(getattr(init, "_kvplan_dropin", False)) or init is own_init


def _init_mixed_equal_tp_prep_handles(self: Any, peer_info: Any, mem_segments: Any) -> None:
    """kvplan's ``NixlKVManager._init_mixed_equal_tp_prep_handles`` (SGLang 0.5.23 signature):
    per memory-kind segment, the two prepared lists are :func:`mixed_segment_template`'s
    ``Template.descriptor_runs`` as NIXL's strided rows ``(base, len, device, stride, slots)``
    (the device of the segment's memory kind), so the lists and the indices
    :func:`send_kvcache_mixed` takes from the same template's ``prepped_indices`` are one
    definition. SGLang's bookkeeping is kept: the decode's slot count (its ``dst_num_slots``,
    else ``self._num_slots_src``), the prefill's list prepared once per segment and memory kind
    for every peer (``prep_handles_segment_src``), the decode's per peer, both through
    ``self._prep_xfer_dlist`` (SGLang's strided call with its per-block fallback), and
    ``peer_info.kv_xfer_segments``. A replaced ``_prep_equal_tp_dlist`` (a subclass's, an
    instance's): SGLang's own method builds the lists through it.

    Raises:
        IndexBoundsError: ``self._num_slots_src`` slots pass a prefill entry's registered
            buffer (SGLang would prepare descriptors past it).
        LayoutError: A decode stride below the prefill's item length (SGLang's
            ``ValueError``), or an entry the core refuses (a null base, a zero item).
    """
    if not _kvplan_prep(self):
        original = sglang_method(self, "_init_mixed_equal_tp_prep_handles", NIXL_MANAGER)
        original(self, peer_info, mem_segments)
        return
    prepared_segment = sglang_global("_KVXferPreparedSegment", NIXL_MANAGER)
    src_slots = int(self._num_slots_src)
    prepared = []
    for seg in mem_segments:
        lo, hi = int(seg.start), int(seg.end)
        for i in range(lo, hi):
            item, data = int(self.kv_args.kv_item_lens[i]), int(self.kv_args.kv_data_lens[i])
            if item > 0 and src_slots > data // item:
                raise _core.IndexBoundsError(
                    f"entry {i}: {src_slots} prepared slots of {item} bytes pass its "
                    f"registered {data} bytes ({data // item} slots)")
        dst_num_slots = (peer_info.dst_num_slots if peer_info.dst_num_slots is not None
                         else self._num_slots_src)
        template = mixed_segment_template(self, peer_info.agent_name, peer_info, _Segment(
            lo, hi, int(dst_num_slots)))
        src_key = (seg.start, seg.end, seg.src_mem_kind)
        src_handle = self.prep_handles_segment_src.get(src_key)
        if src_handle is None:
            rows = run_rows(template.descriptor_runs("src"),
                            _device_id(seg.src_mem_kind, self.kv_args.gpu_id))
            src_handle = self._prep_xfer_dlist("", np.asarray(rows, dtype=np.uint64),
                                               seg.src_mem_kind)
            self.prep_handles_segment_src[src_key] = src_handle
        rows = run_rows(template.descriptor_runs("dst"),
                        _device_id(seg.dst_mem_kind, peer_info.gpu_id))
        dst_handle = self._prep_xfer_dlist(peer_info.agent_name,
                                           np.asarray(rows, dtype=np.uint64), seg.dst_mem_kind)
        prepared.append(prepared_segment(start=seg.start, end=seg.end, src_handle=src_handle,
                                         dst_handle=dst_handle, dst_num_slots=dst_num_slots))
    peer_info.kv_xfer_segments = prepared


class _Segment:
    """A segment's entries and the decode's slot count, as :func:`mixed_segment_template`
    reads them from SGLang's prepared segment."""

    def __init__(self, start: int, end: int, dst_num_slots: int) -> None:
        self.start, self.end, self.dst_num_slots = start, end, dst_num_slots


def send_kvcache_mixed(
    self: Any,
    peer_name: str,
    prefill_kv_indices: Any,
    dst_kv_indices: Any,
) -> list[Any]:
    """kvplan's ``NixlKVManager.send_kvcache_mixed`` (SGLang 0.5.23 signature): per memory-kind
    segment of the peer's prepared lists, the indices are ``Template.prepped_indices`` of
    :func:`mixed_segment_template` (piece major, page minor: SGLang's entry-major ``entry *
    slots + page``), every segment's computed before any is posted; then, as SGLang, one
    ``make_prepped_xfer("WRITE", ...)`` and ``self._post_xfer`` per segment, returning the
    handles. A negative page or one past either list's slots, and page lists of different
    lengths, are refused (:class:`kvplan.IndexBoundsError`, :class:`kvplan.KvPlanError`)
    where SGLang would index another entry's slots or hand NIXL unequal lists. Lists built by
    a replaced ``_prep_equal_tp_dlist`` or ``_init_mixed_equal_tp_prep_handles`` (a subclass's,
    an instance's) are indexed by SGLang's own method."""
    if not _mixed_lists_are_kvplans(self):
        original = sglang_method(self, "send_kvcache_mixed", NIXL_MANAGER)
        return cast(list[Any], original(self, peer_name, prefill_kv_indices, dst_kv_indices))
    info = self.decode_kv_args_table[peer_name]
    segments = info.kv_xfer_segments
    assert segments is not None  # SGLang's own check
    if not segments:
        raise RuntimeError(f"Missing NIXL mixed KV transfer plan for {peer_name}")
    src_pages, dst_pages = as_index(prefill_kv_indices), as_index(dst_kv_indices)
    started = time.perf_counter()
    requests = []
    for seg in segments:
        template = mixed_segment_template(self, peer_name, info, seg)
        src64, dst64 = template.prepped_indices(src_pages, dst_pages)
        requests.append((seg, _int32_indices(src64, "source"),
                         _int32_indices(dst64, "destination")))
    observe(time.perf_counter() - started, sum(len(r[1]) for r in requests))
    handles = []
    for seg, src_idx, dst_idx in requests:
        xfer_handle = self.agent.make_prepped_xfer("WRITE", seg.src_handle, src_idx,
                                                   seg.dst_handle, dst_idx)
        if not xfer_handle:
            raise Exception("KVSender failed to create mixed prepped transfer")
        self._post_xfer(xfer_handle, "KVSender failed to post mixed prepped transfer")
        handles.append(xfer_handle)
    return handles


def _token_pieces(plan: TransferPlan, which: slice, page: int) -> tuple[list[int], list[int], int]:
    """One page's blocks of one entry pair as per-token pieces: (source addresses, destination
    addresses, bytes per token), tokens in order; refused when the page's bytes are not
    ``page`` equal pieces."""
    src, dst = plan.src_addrs[which].tolist(), plan.dst_addrs[which].tolist()
    lengths = plan.lengths[which].tolist()
    total = sum(lengths)
    if page <= 0 or total % page:
        raise _core.SizeMismatchError(
            f"a page of {total} sent bytes does not split into {page} token slices")
    piece = total // page
    s_out: list[int] = []
    d_out: list[int] = []
    for s, d, n in sorted(zip(src, dst, lengths), key=lambda b: b[1]):
        if n % piece:
            raise _core.SizeMismatchError(
                f"a block of {n} bytes is not whole token slices of {piece} bytes")
        s_out.extend(s + k * piece for k in range(n // piece))
        d_out.extend(d + k * piece for k in range(n // piece))
    return s_out, d_out, piece


def _uniform_stride(addrs: list[int], fallback: int, what: str) -> int:
    steps = {b - a for a, b in zip(addrs, addrs[1:])}
    if len(steps) > 1:
        raise _core.LayoutError(f"{what}: token slices are not evenly spaced ({sorted(steps)})")
    return steps.pop() if steps else fallback


def _init_hetero_tp_prep_handle(
    self: Any,
    peer_name: str,
    decode_kv_args: Any,
    src_mem_kind: str = "VRAM",
    dst_mem_kind: str = "VRAM",
) -> None:
    """kvplan's ``NixlKVManager._init_hetero_tp_prep_handle`` (SGLang 0.5.23 signature): the
    prepared head-slice lists of a decode peer whose attention TP differs, from kvplan's
    head-sliced template (the one ``send_kvcache_slice``'s Mooncake drop-in plans with).

    One page of the template's plan gives, per entry pair, where this rank's slice of each
    token sits on both sides; the lists are one strided row per entry pair: the decode's
    ``(entry + slice offset, slice bytes, device, decode token bytes, decode slots × page)``
    and the prefill's ``(entry, slice bytes, device, slice bytes, slots × page × groups)``, the
    prefill's tokens cut into ``groups`` slices of which this decode rank reads slice
    ``head_group_idx`` (SGLang's ``expand_page_indices_for_slice`` indexes them). The manager's
    ``prep_handle_slice_src`` (built once, shared by the peers of one decode TP size) and
    ``prep_handles_slice_dst[peer_name]`` are set as SGLang sets them."""
    g = _slice_geometry(self, int(decode_kv_args.decode_tp_rank),
                        int(decode_kv_args.decode_tp_size), int(decode_kv_args.dst_kv_item_len))
    dst_ptrs = [int(p) for p in decode_kv_args.dst_kv_ptrs]
    template = _slice_template(self, peer_name, dst_ptrs, int(decode_kv_args.dst_kv_item_len),
                               published_ids(getattr(decode_kv_args, "dst_kv_layer_ids", None)),
                               g)
    zero = np.zeros(1, dtype=np.int64)
    plan = template.plan(zero, zero)
    kv_args = self.kv_args
    src_ptrs = [int(p) for p in kv_args.kv_data_ptrs]
    src_items = [int(n) for n in kv_args.kv_item_lens]
    pairs = sorted(zip(template.pairs.tolist(), range(plan.n_pairs)), key=lambda x: x[0][0])
    src_rows: list[tuple[int, int, int, int, int]] = []
    dst_rows: list[tuple[int, int, int, int, int]] = []
    num_slots = min((int(n) // i for n, i in zip(kv_args.kv_data_lens, src_items) if i),
                    default=0)
    num_slots_dst = (int(decode_kv_args.dst_num_slots)
                     if getattr(decode_kv_args, "dst_num_slots", None) is not None else num_slots)
    src_dev = _device_id(src_mem_kind, kv_args.gpu_id)
    dst_dev = _device_id(dst_mem_kind, decode_kv_args.gpu_id)
    groups = group_idx = None
    for (i, j), p in pairs:
        s_addrs, d_addrs, piece = _token_pieces(plan, plan.pair_blocks(p), g.page)
        s_stride = _uniform_stride(s_addrs, src_items[i] // g.page, "prefill")
        d_stride = _uniform_stride(d_addrs, int(decode_kv_args.dst_kv_item_len) // g.page,
                                   "decode")
        offset = s_addrs[0] - src_ptrs[i]
        if s_stride % piece or offset % piece or s_stride * g.page != src_items[i]:
            raise _core.SizeMismatchError(
                f"prefill entry {i}: token slices of {piece} bytes at offset {offset} do not "
                f"tile its {src_items[i]}-byte item of {g.page} tokens")
        if groups is None:
            groups, group_idx = s_stride // piece, offset // piece
        elif (groups, group_idx) != (s_stride // piece, offset // piece):
            raise _core.LayoutError("entries slice their tokens differently: one prepared "
                                    "list cannot index them alike")
        src_rows.append((src_ptrs[i], piece, src_dev, piece, num_slots * g.page * groups))
        dst_rows.append((d_addrs[0], piece, dst_dev, d_stride, num_slots_dst * g.page))
    if groups is None or group_idx is None:
        raise _core.PairingError(f"no KV entry pairs with decode peer {peer_name}")
    if self.prep_handle_slice_src is None:
        handle = self._prep_xfer_dlist("", np.array(src_rows, dtype=np.uint64).reshape(-1, 5),
                                       src_mem_kind)
        self.prep_handle_slice_src = (handle, groups, len(src_rows), num_slots)
    dst_handle = self._prep_xfer_dlist(
        peer_name, np.array(dst_rows, dtype=np.uint64).reshape(-1, 5), dst_mem_kind)
    self.prep_handles_slice_dst[peer_name] = (dst_handle, num_slots_dst, group_idx)


# ---------------------------------------------------------------------------------------------
# Layout identity at SGLang's NIXL registration (docs/sglang.md, "Layout identity with NIXL")
# ---------------------------------------------------------------------------------------------
#: SGLang's NIXL transfer: the prefill writes into the decode's pools.
NIXL_TRANSFER = "push"
#: Where kvplan's frame sits in the decode's registration message as the prefill's
#: ``KVArgsRegisterInfo.from_zmq`` receives it (SGLang's guard frame stripped): SGLang 0.5.23
#: reads frames 0 to 23, so a prefill without kvplan ignores it.
NIXL_REGISTRATION_FRAME = 24
#: The manager methods the identity hooks wrap, per instance of the class.
IDENTITY_HOOKS = ("build_receiver_registration_message", "_add_remote_peer",
                  "add_transfer_request")
_IDENTITY_ATTR = "_kvplan_nixl_identity"


def nixl_identity(manager: Any) -> IdentityExchange:
    """The manager's identity check and the decode agents it refused, made once: the Mooncake
    drop-in's :class:`kvplan.compat.sglang.rounds.IdentityExchange` (its identity from
    ``rounds.identity_with_metric``, which also sets ``kvplan:layout_info``)."""
    from kvplan.compat.sglang.rounds import IdentityExchange

    holder = manager.__dict__.get(_IDENTITY_ATTR)
    if holder is None:
        holder = manager.__dict__[_IDENTITY_ATTR] = IdentityExchange(manager)
    return cast(IdentityExchange, holder)


def _registration_message(original: Any) -> Any:
    def build_receiver_registration_message(self: Any) -> Any:
        import json

        from kvplan.compat.sglang.rounds import REGISTRATION_TAG, identity_field

        frames = list(original(self))
        field = identity_field(nixl_identity(self))
        # the guard frame, then SGLang's 24: kvplan's goes right after them, or not at all
        if field and len(frames) == NIXL_REGISTRATION_FRAME + 1:
            frames.append(REGISTRATION_TAG + json.dumps(field).encode())
        return frames

    return build_receiver_registration_message


def _add_remote_peer(original: Any) -> Any:
    def add_remote_peer(self: Any, decode_kv_args: Any) -> Any:
        from kvplan.compat.sglang.rounds import check_registered

        out = original(self, decode_kv_args)
        check_registered(nixl_identity(self), str(decode_kv_args.agent_name),
                         getattr(decode_kv_args, "kvplan_staging", None))
        return out

    return add_remote_peer


def _add_transfer_request(original: Any) -> Any:
    def add_transfer_request(self: Any, bootstrap_room: int, *args: Any, **kwargs: Any) -> Any:
        refusal = refused_room(self, bootstrap_room)
        if refusal is not None:
            # SGLang's own failure path: the reason recorded, the room Failed, the decode told
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=refusal)
            return None
        return original(self, bootstrap_room, *args, **kwargs)

    return add_transfer_request


_HOOK_MAKERS = {"build_receiver_registration_message": _registration_message,
                "_add_remote_peer": _add_remote_peer,
                "add_transfer_request": _add_transfer_request}


def refused_room(manager: Any, bootstrap_room: int) -> str | None:
    """The refusal (its message) of a decode agent the room's transfer goes to, else None."""
    refused = nixl_identity(manager).refused
    if not refused:
        return None
    infos = (getattr(manager, "transfer_infos", None) or {}).get(bootstrap_room) or {}
    for agent in infos:
        err = refused.get(agent)
        if err is not None:
            return str(err)
    return None


def hook_identity(manager_class: type) -> bool:
    """Wrap ``manager_class``'s :data:`IDENTITY_HOOKS` so its managers exchange and check
    layout identities (the decode's registration carries its identity in a frame SGLang does
    not read; the prefill checks it when it registers the decode; every transfer to a refused
    decode fails through SGLang's ``conclude_failure`` before it is queued), and
    ``KVArgsRegisterInfo.from_zmq`` of its module reads that frame. False when already
    hooked. :class:`kvplan.IncompatibleHostError` when a method is missing (nothing wrapped)."""
    import sys

    from kvplan._errors import IncompatibleHostError
    from kvplan.compat.sglang.rounds import hook_register_info

    if is_wrapped(manager_class.__dict__.get(IDENTITY_HOOKS[0]), "_kvplan_identity"):
        return False
    missing = [n for n in (*IDENTITY_HOOKS, "conclude_failure")
               if not callable(getattr(manager_class, n, None))]
    if missing:
        raise IncompatibleHostError(
            f"{manager_class.__name__} has no {', '.join(missing)}: kvplan's layout identity "
            f"check at SGLang's NIXL registration was built for SGLang 0.5.23")
    for name in IDENTITY_HOOKS:
        wrap(manager_class, name, "_kvplan_identity", _HOOK_MAKERS[name])
    for klass in manager_class.__mro__:  # the module of SGLang's class, also under a subclass
        info_cls = getattr(sys.modules.get(klass.__module__), "KVArgsRegisterInfo", None)
        if isinstance(info_cls, type):
            hook_register_info(info_cls, NIXL_REGISTRATION_FRAME)
            break
    return True


def unhook_identity(manager_class: type) -> None:
    """Restore what :func:`hook_identity` wrapped on ``manager_class``."""
    for name in IDENTITY_HOOKS:
        unwrap(manager_class, name, "_kvplan_identity")
