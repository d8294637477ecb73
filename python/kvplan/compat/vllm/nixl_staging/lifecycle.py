"""The worker's staging start-up (arena, listener, agent) and its shutdown.

:func:`start_staging` in the connector's constructor, :func:`close_staging` in its
``shutdown``."""

from __future__ import annotations

from typing import Any

from kvplan.compat.vllm.nixl_staging.handles import StagingAgent
from kvplan.compat.vllm.nixl_staging.leases import LEASES_ATTR
from kvplan.compat.vllm.nixl_staging.serve import _decode_gone, serve_rounds


def start_staging(worker: Any, options: dict[str, Any], lease_s: float | None = None) -> Any:
    """The NIXL worker's staging start-up (the connector's constructor): with a
    ``kvplan_staging`` key other than ``off``, the arena registered with the worker's NIXL
    agent (``nixl_wrapper``), the engine's costs (given, else for ``auto`` NIXL's measured on
    loopback) and the one start-up line; None and nothing allocated otherwise. ``lease_s``:
    the prefill's KV lease (:func:`vllm_lease_s`), which its staging message carries."""
    from kvplan.compat.vllm.staging import start_staging as start

    def setup(state: Any) -> None:
        state.name = str(worker.__dict__.get("engine_id") or "")
        # the prefill's listener: decodes open their staged reads there
        host = str(worker.__dict__.get("side_channel_host") or "127.0.0.1")
        state.lease_s = lease_s
        state.serve(worker, host, on_open=serve_rounds,
                    on_close=lambda streams: _decode_gone(worker, streams))

    agent = worker.nixl_wrapper
    state = start(worker, options, engine=agent, cost_engine="nixl", setup=setup)
    if state is not None:  # staged reads answer vLLM's polling of their handles
        worker.nixl_wrapper = StagingAgent(agent)
    return state


def close_staging(worker: Any) -> bool:
    """The worker's ``shutdown``, after vLLM's: its staged streams ended, its channels and
    listener closed and their threads waited for, its arena unregistered; once (False: staging
    was off, or already closed)."""
    from kvplan.compat.vllm.staging import CLOSE_JOIN_S, STAGING_ATTR

    state = worker.__dict__.pop(STAGING_ATTR, None)
    if state is None:
        return False
    leases = worker.__dict__.get(LEASES_ATTR)
    try:
        if leases is not None:
            leases.stop(CLOSE_JOIN_S)
    finally:
        state.close(CLOSE_JOIN_S)
    return True
