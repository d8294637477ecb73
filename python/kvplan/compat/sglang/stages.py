"""The prefill PP stage a staged SGLang request travels with (:func:`kvplan.compat.sglang.rounds.
maybe_send`).

Under prefill PP each stage holds its own layers and sends them to a decode that holds every
layer. The decode plans the stage's rounds itself, so the open message says which decode
entry ("slot") each of the stage's entries fills: the pairs of the template the direct path
plans this call with (the core's answer to SGLang's pairing: by layer id, or SGLang's
positional slicing from ``prefill_start_layer``), with the stage's PP rank and size, which give
the stage its own share of the decode's arena (the core's staged rounds: one share per sender
and PP stage). Both sides then pair each prefill entry ``i`` with the decode entry
``dst_slots[i]`` by layer id: a decode without that entry refuses the request (the core's
``PairingError``), which fails it on the prefill through SGLang's failure path. A head slice
with published layer ids carries the same map at prefill PP 1 (SGLang pairs it by layer id)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvplan._core import KvPlanError, Template


def pp_stage(manager: Any, session: str, kind: str, dst_ptrs: Sequence[int], dst_layer_ids: Any,
             slice_geometry: dict[str, Any] | None, dst_item: int | None
             ) -> dict[str, Any] | None:
    """What the open message carries of ``manager``'s PP stage: ``{"pp_rank", "pp_size",
    "dst_slots"}``, or ``{}`` (no stage) at prefill PP 1 where the staged template pairs entry
    ``i`` with decode entry ``i`` as the direct one does. A head slice with published layer ids
    (either side) at PP 1 carries the mapping too, as the stage of rank 0 of 1: SGLang pairs
    its entries by layer id, which need not be by position. None where this call keeps the
    direct path (no PP rank on the manager, no direct template, or a prefill entry that the
    direct template does not pair with exactly one decode entry of its own)."""
    pp_size = int(manager.pp_size)
    kv = manager.kv_args
    if pp_size == 1:
        from kvplan.compat.sglang.layouts import published_ids

        if kind != "mha_slice" or not (published_ids(kv.kv_layer_ids)
                                       or published_ids(dst_layer_ids)):
            return {}
        pp_rank: Any = 0
    else:
        pp_rank = getattr(kv, "pp_rank", None)
        if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
            return None
    try:
        direct = _direct_template(manager, session, kind, list(dst_ptrs), dst_layer_ids,
                                  slice_geometry, dst_item)
    except KvPlanError:
        return None  # the direct path refuses it as it does today
    if direct is None:
        return None
    n_src = len(kv.kv_data_ptrs)
    slots = [-1] * n_src
    for i, j in direct.pairs.tolist():
        if slots[i] != -1:
            return None
        slots[i] = int(j)
    if -1 in slots or len(set(slots)) != n_src:
        return None
    return {"pp_rank": pp_rank, "pp_size": pp_size, "dst_slots": slots}


def _direct_template(manager: Any, session: str, kind: str, dst_ptrs: list[int],
                     dst_layer_ids: Any, slice_geometry: dict[str, Any] | None,
                     dst_item: int | None) -> Template | None:
    """The (cached) template the drop-in's direct path plans this call with."""
    kv = manager.kv_args
    if kind == "mla":
        from kvplan.compat.sglang.templates import _generic_template

        return _generic_template(manager, session, list(kv.kv_data_ptrs), dst_ptrs,
                                 list(kv.kv_item_lens), kv.kv_layer_ids, dst_layer_ids, False)
    if kind == "mha_slice" and slice_geometry is not None and dst_item is not None:
        from kvplan.compat.sglang.layouts import published_ids
        from kvplan.compat.sglang.templates import _slice_geometry, _slice_template

        g = _slice_geometry(manager, int(slice_geometry["decode_rank"]),
                            int(slice_geometry["decode_tp"]), int(dst_item))
        return _slice_template(manager, session, dst_ptrs, int(dst_item),
                               published_ids(dst_layer_ids), g)
    return None


def stage_slot_ids(stage: dict[str, Any] | None, n_dst: int
                   ) -> tuple[list[int], list[int]] | None:
    """The layer ids both sides pair a staged request by when it carries a stage: the decode
    slot of each prefill entry, and each decode entry's own index (``n_dst`` entries); None
    without a stage."""
    if not stage:
        return None
    return [int(j) for j in stage["dst_slots"]], list(range(int(n_dst)))
