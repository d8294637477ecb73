"""What every part reads off a vLLM NIXL worker: its staging state, KV buffers, the log.

:func:`worker_staging` (the worker's :class:`kvplan.compat.vllm.staging.WorkerStaging`, None
with staging off), :func:`kv_buffers` (its registered KV regions as arrays, for a round's
gather or scatter) and ``_staging_log``, the log every part of the staged reads writes to."""

from __future__ import annotations

import logging
from typing import Any


_staging_log = logging.getLogger("vllm.kvplan.staging")


def worker_staging(worker: Any) -> Any:
    """The worker's :class:`kvplan.compat.vllm.staging.WorkerStaging` (None: staging off)."""
    from kvplan.compat.vllm.staging import STAGING_ATTR

    return worker.__dict__.get(STAGING_ATTR)


def kv_buffers(worker: Any) -> list[Any]:
    """The worker's registered KV regions (each its blocks' extent: base, blocks times block
    stride) as uint8 arrays, for a round's gather or scatter, which checks every block
    against them."""
    import kvplan
    from kvplan.staging import host_views

    d = worker.__dict__
    try:
        bases = [int(p) for p in d["kv_caches_base_addr"][d["engine_id"]][int(d["tp_rank"])]]
    except (KeyError, TypeError) as exc:
        raise kvplan.LayoutError("kvplan staging: the NIXL worker registered no KV regions "
                                 f"({exc!r})") from exc
    strides = list(d.get("block_stride_per_layer") or d.get("block_len_per_layer") or ())
    counts = list(d.get("region_num_blocks") or ()) or [int(d.get("num_blocks", 0))] * len(bases)
    if len(strides) != len(bases) or len(counts) != len(bases):
        raise kvplan.LayoutError(
            f"kvplan staging: {len(bases)} KV regions but {len(strides)} block strides and "
            f"{len(counts)} block counts")
    return host_views(sorted((b, int(n) * int(s)) for b, n, s in zip(bases, counts, strides)))
