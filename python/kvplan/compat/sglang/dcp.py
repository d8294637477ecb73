"""kvplan's ``MooncakeKVManager.send_kvcache_dcp``: a prefill at DCP 1 sends one chunk of a
request to one decode DCP rank (SGLang's token round robin), planned by a DCP
:class:`kvplan.Template` cached per decode peer and rank."""

from __future__ import annotations

import importlib
from typing import Any, cast

import numpy as np

from kvplan import _core
from kvplan._core import SizeMismatchError, Template, TransferPlan
from kvplan.compat.sglang.cache import template_cache
from kvplan.compat.sglang.layouts import published_ids, unbounded_lens
from kvplan.compat.sglang.metrics import planned
from kvplan.compat.sglang.registry import MOONCAKE_MANAGER, sglang_method
from kvplan.compat.sglang.rounds import maybe_send, staging_of
from kvplan.compat.sglang.seams import mla_slicer, owns_transfer_data
from kvplan.compat.sglang.submit import send_all, engine_status
from kvplan.compat.sglang.templates import as_index, dcp_template, kv_args_lens

#: SGLang's module holding ``try_pack_dcp_src`` and its gather kernel.
DCP_PACK_MODULE = "sglang.srt.disaggregation.common.dcp_pack"


def _dcp_template(manager: Any, session: str, dst_ptrs: list[int], token_lens: list[int],
                  dst_ids: list[int] | None, dcp_size: int, dcp_rank: int) -> Template:
    """:func:`dcp_template` of the manager's pools to one decode rank's, cached per peer and
    rank."""
    kv_args = manager.kv_args
    src_ptrs = list(kv_args.kv_data_ptrs)
    src_ids = published_ids(kv_args.kv_layer_ids)
    page = int(kv_args.page_size)
    num_draft = int(kv_args.num_draft_entries)
    inputs = ("dcp", src_ptrs, src_ids, page, num_draft, token_lens, dst_ptrs, dst_ids,
              dcp_size, dcp_rank)

    def build() -> Template:
        return dcp_template((src_ptrs, kv_args_lens(kv_args, src_ptrs)),
                            (dst_ptrs, unbounded_lens(dst_ptrs)), token_lens, page, num_draft,
                            src_ids, dst_ids, dcp_size, dcp_rank)

    return cast(Template, template_cache(manager).get(session, "dcp", inputs, build))


def _pack_with_sglangs_kernel(template: Template, src: Any, dst: Any, n_tokens: int,
                              pack_buffer: Any) -> TransferPlan | None:
    """Gather the rank's target rows into ``pack_buffer`` with SGLang's own kernel (through
    ``try_pack_dcp_src``, as SGLang's method calls it) and return kvplan's network plan out of
    the buffer; ``None`` when SGLang's method must run instead: the buffer is too small (SGLang
    then sends per token) or kvplan's gather is not what the kernel does.

    The kernel gathers one row-index array for every entry, row ``r`` of an entry from
    ``ptr + r * width``, entries back to back from the start of the buffer. kvplan's gather
    fits it when every copy is a target copy (lane 0) of whole rows (``row_stride == len``),
    its pages are rows back to back (``page_stride == rows_per_page * row_stride``) and the
    copies' pack addresses are where the kernel puts each entry; the packed pointers SGLang
    returns are checked against kvplan's before kvplan's network plan is used."""
    try:
        rows, network = planned(lambda: template.plan_row_gather(
            src, dst, pack=(int(pack_buffer.get_ptr()), int(pack_buffer.get_size())),
            n_tokens=n_tokens), network=lambda answer: answer[1])
    except SizeMismatchError:
        return None
    copies = rows.copies.astype(np.int64)
    if network.n_blocks == 0:
        return network
    lane, base, page_stride, row_stride, per_page, width, pack_addr = copies.T
    target = rows.rows[0].astype(np.int64)
    n = int(target.size)
    kernel_addrs = int(pack_buffer.get_ptr()) + np.concatenate(([0], np.cumsum(n * width)[:-1]))
    if (n == 0 or lane.any() or (row_stride != width).any()
            or (page_stride != per_page * row_stride).any()
            or (pack_addr != kernel_addrs).any()):
        return None
    # imported when a call needs it, as SGLang's method imports it
    try_pack_dcp_src = importlib.import_module(DCP_PACK_MODULE).try_pack_dcp_src
    packed = try_pack_dcp_src(pack_buffer=pack_buffer, kv_data_ptrs=[int(b) for b in base],
                              src_token_indices=target,
                              token_item_lens=[int(w) for w in width])
    if packed is None or [int(p) for p in packed[0]] != [int(a) for a in pack_addr]:
        return None
    return network


def send_kvcache_dcp(
    self: Any,
    mooncake_session_id: str,
    prefill_kv_indices: Any,
    dst_kv_ptrs: list[int],
    dst_kv_indices: Any,
    *,
    dcp_token_item_lens: list[int],
    dst_dcp_size: int,
    dst_dcp_rank: int,
    src_page_offset: int,
    decode_prefix_len: int,
    num_kv_tokens: int,
    executor: Any,
    dst_layer_ids: list[int],
    pack_buffer: Any = None,
    dst_kv_item_lens: list[int] | None = None,
    dst_tp_rank: int = 0,
    dst_attn_tp_size: int | None = None,
) -> int:
    """kvplan's ``MooncakeKVManager.send_kvcache_dcp`` (SGLang 0.5.23 signature).

    The chunk is ``num_kv_tokens`` tokens starting ``src_page_offset`` pages after the
    decode's ``decode_prefix_len`` cached tokens; the decode rank's page list
    ``dst_kv_indices`` starts after that prefix. Target rows of the tokens the rank owns and
    every draft row move in maximal runs, in one ``_transfer_data`` call's worth of blocks (the
    engine in bounded batches when ``_transfer_data`` is SGLang's own).

    With a ``pack_buffer``, kvplan plans the rank's source rows and the network out of the
    buffer (``Template.plan_row_gather``), SGLang's own ``try_pack_dcp_src`` gathers those rows
    with its kernel (``copy_mla_rows_into_pack``: kvplan never gathers on the GPU), and kvplan's
    network blocks go to ``_transfer_data``; only when kvplan's gather is the kernel's (see
    :func:`_pack_with_sglangs_kernel`).

    With staging in rounds agreed with the decode (``kvplan.compat.sglang.rounds``), the
    rank's rows go through the two arenas in rounds instead (``rounds.maybe_send``: the open
    message carries the DCP deal and the token count, the decode plans the same rounds with
    its own pools), whether or not a pack buffer was given.

    SGLang's own method runs for what kvplan does not plan: a pack buffer with draft entries
    (kvplan packs the draft rows after the target rows, SGLang sends them from the pool: the
    layouts differ), a pack buffer too small for the rank's rows (SGLang then sends per
    token, byte for byte as without kvplan), a custom memory pool, draft rows that are head-sliced (decode draft widths different from the source's),
    a chunk whose start is not a whole decode virtual page (``src_page_offset`` not a multiple
    of ``dst_dcp_size``), positional PP slicing (no layer ids and different entry counts, or a
    replaced ``get_mla_kv_ptrs_with_pp``), and SGLang's own input errors (no token count,
    destination lengths that do not match its buffers, a misaligned decode prefix).

    Differences from SGLang (which indexes arrays and writes where they point):

    * A prefill entry without a decode partner by layer id: ``PairingError`` (SGLang drops it
      from the destination list and pairs every later entry with the wrong decode buffer).
    * Fewer decode pages than the rank's tokens need, or more tokens than the prefill pages
      hold: ``KvPlanError`` (SGLang: numpy ``IndexError``); prefill pages outside
      ``kv_data_lens``: ``IndexBoundsError``.
    """
    args = (self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices)
    kwargs = dict(dcp_token_item_lens=dcp_token_item_lens, dst_dcp_size=dst_dcp_size,
                  dst_dcp_rank=dst_dcp_rank, src_page_offset=src_page_offset,
                  decode_prefix_len=decode_prefix_len, num_kv_tokens=num_kv_tokens,
                  executor=executor, dst_layer_ids=dst_layer_ids, pack_buffer=pack_buffer,
                  dst_kv_item_lens=dst_kv_item_lens, dst_tp_rank=dst_tp_rank,
                  dst_attn_tp_size=dst_attn_tp_size)

    def sglangs() -> int:
        original = sglang_method(self, "send_kvcache_dcp", MOONCAKE_MANAGER)
        return engine_status(original(*args, **kwargs))

    kv_args = self.kv_args
    page = int(kv_args.page_size)
    size, rank = int(dst_dcp_size), int(dst_dcp_rank)
    if (num_kv_tokens is None or self.enable_custom_mem_pool
            or (pack_buffer is not None and int(kv_args.num_draft_entries))
            or (dst_kv_item_lens and len(dst_kv_item_lens) != len(dst_kv_ptrs))
            or decode_prefix_len % (page * size) or src_page_offset % size):
        return sglangs()
    src_ids, dst_ids = published_ids(kv_args.kv_layer_ids), published_ids(dst_layer_ids)
    n_src, num_draft = len(kv_args.kv_data_ptrs), int(kv_args.num_draft_entries)
    if not (src_ids or dst_ids) and (len(dst_kv_ptrs) != n_src or mla_slicer(self) is None):
        return sglangs()
    token_lens = [int(w) for w in dcp_token_item_lens]
    if num_draft and dst_kv_item_lens:
        # SGLang reads the decode draft widths by source position (after pairing)
        if src_ids or dst_ids:
            dst_at = [int(j) for _, j in _core.pair_entries(
                src_ids, dst_ids, n_src, len(dst_kv_ptrs), False).tolist()]
        else:
            dst_at = list(range(n_src))
        for entry in range(n_src - num_draft, n_src):
            if entry >= len(dst_at) or dst_kv_item_lens[dst_at[entry]] != (
                    token_lens[entry] * page * size):
                return sglangs()  # head-sliced or invalid draft widths: SGLang decides
    # each side's pages in token order: the lists differ in length (tokens are dealt)
    src, dst = as_index(prefill_kv_indices), as_index(dst_kv_indices)
    # The chunk starts a whole number of decode virtual pages after the prefix: drop them.
    dst = np.ascontiguousarray(dst[src_page_offset // size:])
    if staging_of(self) is not None:
        staged = maybe_send(self, mooncake_session_id, src, dst_kv_ptrs, dst, kind="dcp",
                            dst_layer_ids=dst_layer_ids, n_tokens=int(num_kv_tokens),
                            dcp_geometry=dict(token_lens=token_lens, page_size=page,
                                              num_draft=num_draft, dcp_size=size,
                                              dcp_rank=rank))
        if staged is not None:
            return staged
    template = _dcp_template(self, mooncake_session_id, list(dst_kv_ptrs), token_lens, dst_ids,
                             size, rank)
    if pack_buffer is not None:
        packed = _pack_with_sglangs_kernel(template, src, dst, int(num_kv_tokens), pack_buffer)
        if packed is None:
            return sglangs()  # too small a buffer, or a layout the kernel cannot gather
        plan = packed
    else:
        plan = planned(lambda: template.plan(src, dst, n_tokens=int(num_kv_tokens)))
    if plan.n_blocks == 0 and owns_transfer_data(self):
        return 0  # SGLang's own _transfer_data would hand the engine nothing
    return send_all(self, mooncake_session_id, plan)  # an override sees even an empty list
