"""Failure verdicts into vLLM's own failed-load path (both connectors' decode workers):
:func:`report_load_failure` feeds a :class:`kvplan.failures.FailureVerdict` to the worker's
queues in the shape its release's scheduler takes. ``kvplan.compat.vllm.nixl`` exports these
names too.

Its callers are the staged paths, where the decode scatters each round itself and so knows
which rounds never landed (:func:`kvplan.compat.vllm.staging.report_unwritten`, the NIXL
staged read). There is no batch-level entry: on vLLM's direct paths no decode worker learns
which batch of a plan failed. Mooncake's prefill writes a whole call's blocks (several
requests' plans concatenated) in batches that stop at the first failure, and the decode hears
only the request ids of the failed call (``err_reqs``), for which vLLM's own
``_handle_failed_recv`` reports every block; NIXL's decode reads a request per handle, one
status for all of it. A verdict naming one batch's blocks would also leave out the batches
never submitted after it."""

from __future__ import annotations

import logging
from typing import Any

from kvplan.failures import FailureVerdict

__all__ = ["kv_cache_group_count", "report_load_failure"]

# the NIXL connector's logger, where these lines have always been said
logger = logging.getLogger("vllm.kvplan.nixl")


def kv_cache_group_count(worker: Any) -> int:
    """The KV-cache groups of the worker's ``kv_cache_config`` (1 when it has none)."""
    config = getattr(worker, "kv_cache_config", None)
    groups = getattr(config, "kv_cache_groups", None)
    return len(groups) if groups else 1


def report_load_failure(worker: Any, verdict: FailureVerdict) -> str:
    """Feed ``verdict`` (a decode request's failed blocks, per KV-cache group) to the worker's
    own failed-load path, in the shape its release's scheduler takes, and say which:

    * ``"blocks"``: one KV-cache group. The failed block ids go into the worker's
      ``_invalid_block_ids`` queue, which ``get_block_ids_with_load_errors()`` drains for the
      scheduler's ``kv_load_failure_policy`` (``recompute`` truncates the request at its first
      invalid block, ``fail`` fails it). Only the failed blocks are named, not the request's.
    * ``"request"``: several groups. vLLM 0.32 and 0.34 schedulers refuse block-level errors
      there (block ids are per group, a flat set cannot name a group's block), so the request
      goes into ``_failed_recv_reqs``, the failed-receive path both releases' NIXL and 0.34's
      Mooncake workers drain into ``failed_recving``. The verdict's groups and blocks are
      logged.
    * ``"none"``: no block failed; nothing is reported.

    A worker without those queues (another connector or release) is an
    :class:`kvplan.IncompatibleHostError` naming the attribute.
    """
    if not verdict.failed:
        return "none"
    several = kv_cache_group_count(worker) > 1
    name = "_failed_recv_reqs" if several else "_invalid_block_ids"
    queue = worker.__dict__.get(name)
    if queue is None or not hasattr(queue, "put"):
        from kvplan._errors import IncompatibleHostError

        raise IncompatibleHostError(
            f"{type(worker).__name__} has no {name} queue: its release's failed-load path is "
            f"not the one kvplan feeds (vLLM 0.32-0.34 NIXL, 0.34 Mooncake)")
    if several:
        queue.put(verdict.request_id)
        logger.warning("kvplan: %s; reported as a failed request (several KV-cache groups)",
                       verdict)
        return "request"
    queue.put(set(verdict.group(0)))
    logger.warning("kvplan: %s; reported as invalid blocks", verdict)
    return "blocks"
