"""The vLLM drop-in plans a peer layout of several KV groups with one pooled template (each
group a pool of its own): the same bytes as vLLM's own method, never more descriptors than the
per-group templates, and the per-group path where one pooled batch could hold more."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import kvplan

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_cases import canonical, generate, run_coroutine  # noqa: E402
from support.vllm_loader import load_vllm  # noqa: E402


@pytest.fixture(scope="module")
def v():
    return load_vllm()


@pytest.fixture(scope="module")
def patched(v):
    from kvplan.compat import vllm as compat

    cls = type("PooledWorker", (v.MooncakeConnectorWorker,), {})
    compat.install(cls)
    yield cls
    compat.uninstall(cls)


def _chain(case, rng: random.Random, same_order: bool) -> None:
    """Each group's blocks of the case's requests rewritten to run on from one request into
    the next about half the time (on both sides), in one request order for every group or in
    an order of each group's own; a request may take no block of a group."""
    names = [name for name, _ in case.ready]
    order = list(range(len(names)))
    for g in range(len(case.ready[0][1].local_block_ids)):
        if g == 0 or not same_order:
            order = order[:]
            rng.shuffle(order)
        s_at, d_at = 1 + rng.randrange(3), 1 + rng.randrange(3)
        for i in order:
            n = rng.randint(0, 8)
            if rng.random() < 0.5:
                s_at += rng.randint(1, 2)
                d_at += rng.randint(1, 2)
            case.ready[i][1].local_block_ids[g] = list(range(s_at, s_at + n))
            case.meta.req_blocks[names[i]][1][g] = list(range(d_at, d_at + n))
            s_at, d_at = s_at + n, d_at + n
    case.invalid = set()


def _columns(cls, case, local, remote, *, pooled: bool, monkeypatch):
    """The drop-in's columns for the case, planned with the pooled template or (``pooled``
    false) with the per-group templates only."""
    from kvplan.compat.vllm import templates

    w = case.prefill
    w.__dict__.pop("_kvplan_templates", None)
    with monkeypatch.context() as m:
        if not pooled:
            m.setattr(templates._PeerTemplates, "_build_pooled", lambda self, by_key: None)
        out = run_coroutine(cls._build_transfer_params(w, case.ready, case.meta, local, remote))
    w.__dict__.pop("_kvplan_templates", None)
    return out


def _multi_group_cases(v, cls, n: int, same_order: bool):
    rng = random.Random(11 if same_order else 12)
    for seed in range(n):
        case = generate(v, seed, cls)
        if len(case.ready) < 2 or len(case.ready[0][1].local_block_ids) < 2:
            continue
        _chain(case, rng, same_order)
        yield case


@pytest.mark.parametrize("same_order", [True, False], ids=["one-order", "orders-apart"])
def test_pooled_plan_is_vllms_bytes_in_no_more_descriptors(v, patched, monkeypatch, same_order):
    """Generated hybrid deployments (attention and Mamba groups; TP, PP, MHA halves, strided
    and head-sliced regions, kernel blocks) with requests whose blocks run on from one another
    group by group: the pooled path plans them (one batch over every group), its bytes are
    vLLM's own, and it is never more descriptors than the per-group path."""
    from kvplan.compat.vllm import plan as vllm_plan
    from kvplan.compat.vllm.templates import _templates

    used = {"pooled": 0, "per_group": 0}
    checked = original = vllm_plan._pooled_keeps_merges

    def counting(order, arrays, firsts):
        keeps = checked(order, arrays, firsts)
        used["pooled" if keeps else "per_group"] += 1
        return keeps

    monkeypatch.setattr(vllm_plan, "_pooled_keeps_merges", counting)
    totals = {"pooled": 0, "per_group": 0, "vllm": 0, "cases": 0}
    for case in _multi_group_cases(v, patched, 1200, same_order):
        w = case.prefill
        local, remote, err = w._prepare_transfer_regions(case.meta)
        assert err is None, case.seed
        if _templates(w, case.meta, local, remote).pooled is None:
            continue  # a pipeline stage holding layers of one group only
        ref = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
            w, case.ready, case.meta, local, remote))
        pooled = _columns(patched, case, local, remote, pooled=True, monkeypatch=monkeypatch)
        per_group = _columns(patched, case, local, remote, pooled=False,
                             monkeypatch=monkeypatch)
        assert pooled[3:] == per_group[3:] == ([], None), case.seed
        assert canonical(*pooled[:3]) == canonical(*ref[:3]) == canonical(*per_group[:3]), \
            case.seed
        assert len(pooled[0]) <= len(per_group[0]) <= len(ref[0]), case.seed
        totals["pooled"] += len(pooled[0])
        totals["per_group"] += len(per_group[0])
        totals["vllm"] += len(ref[0])
        totals["cases"] += 1
    monkeypatch.setattr(vllm_plan, "_pooled_keeps_merges", original)
    assert totals["cases"] > 150, totals
    assert totals["pooled"] <= totals["per_group"] < totals["vllm"], totals
    # most batches take the pooled path; the ones that could hold more blocks do not
    assert used["pooled"] > used["per_group"] > 0 if same_order else used["per_group"] > 0, used
    assert used["pooled"] > 100, used


def _two_group_peer(v, patched):
    """A generated hybrid deployment's worker, metadata and pooled peer templates."""
    from kvplan.compat.vllm.templates import _templates

    for seed in range(200):
        case = generate(v, seed, patched)
        if case.kind == "hybrid" and len(case.prefill.kv_cache_config.kv_cache_groups) == 2:
            w = case.prefill
            local, remote, _ = w._prepare_transfer_regions(case.meta)
            peer = _templates(w, case.meta, local, remote)
            if peer.pooled is not None and len(peer.groups) == 2:
                return peer
    raise AssertionError("no two-group deployment among the generated cases")


def _ids(*blocks):
    return np.array(blocks, dtype=np.int64)


def test_one_pooled_batch_over_both_groups(v, patched):
    """Two requests over both groups, running on from one another in each: one batch plan of
    the pooled template holds both groups' blocks, merged across the requests."""
    from kvplan.compat.vllm.plan import plan_ready

    peer = _two_group_peer(v, patched)
    requests = [[(_ids(1, 2), _ids(5, 6)), (_ids(10,), _ids(20,))],
                [(_ids(3, 4), _ids(7, 8)), (_ids(11,), _ids(21,))]]
    batches, refused = plan_ready(peer, requests)
    assert refused == {}
    assert len(batches) == 1 and batches[0][1] == [0, 1]
    per_group = [template.plan_batch([(ids[g][0], ids[g][1]) for ids in requests])
                 for g, (_, _, template) in enumerate(peer.groups)]
    assert batches[0][0].n_blocks == sum(b.n_blocks for b in per_group)
    assert batches[0][0].total_bytes == sum(b.total_bytes for b in per_group)
    assert batches[0][0].n_segments == 1  # the two requests share their boundary blocks


def test_a_request_without_blocks_between_two_that_run_on_keeps_the_per_group_path(
        v, patched):
    """Requests 0 and 2 run on from one another in group 1, and request 1 (between them by
    its group-0 blocks) moves nothing there: the per-group batch of group 1 merges 0 and 2,
    one pooled batch could not, so the per-group path plans the batch."""
    from kvplan.compat.vllm.plan import plan_ready

    peer = _two_group_peer(v, patched)
    requests = [[(_ids(1,), _ids(5,)), (_ids(10,), _ids(20,))],
                [(_ids(3,), _ids(7,)), None],
                [(_ids(30,), _ids(9,)), (_ids(11,), _ids(21,))]]
    batches, refused = plan_ready(peer, requests)
    assert refused == {}
    assert [members for _, members in batches] == [[0, 1, 2], [0, 2]]
    # group 1's two requests are one block per region
    assert batches[1][0].n_segments == 1


def test_a_descending_stretch_keeps_the_per_group_path(v, patched):
    """A group template moves blocks descending on both sides as one run; a pooled request
    would move them one block each, so such a batch is planned per group."""
    from kvplan.compat.vllm.plan import _first_blocks, _pooled_keeps_merges, plan_ready

    def keeps(arrays):
        return _pooled_keeps_merges(list(range(len(arrays))), arrays,
                                    [tuple(map(_first_blocks, pairs)) for pairs in arrays])

    down = [[(_ids(4, 3, 2), _ids(9, 8, 7)), (_ids(10,), _ids(20,))]]
    assert not keeps(down)
    # a step down from one request into the next is no stretch of either
    apart = [[(_ids(1, 9), _ids(3, 9)), (_ids(10,), _ids(20,))],
             [(_ids(8, 21), _ids(8, 20)), (_ids(12,), _ids(22,))]]
    assert keeps(apart)
    peer = _two_group_peer(v, patched)
    batches, refused = plan_ready(peer, down)
    assert refused == {} and len(batches) == 2
    up = [[(_ids(2, 3, 4), _ids(7, 8, 9)), (_ids(10,), _ids(20,))]]
    assert keeps(up)
    assert len(plan_ready(peer, up)[0]) == 1


def test_pooled_request_of_unequal_block_counts_is_refused_naming_the_group(v, patched):
    """A token range would read the leading blocks of the longer list: the pooled path
    refuses the request with a KvPlanError naming the group and both counts, as the group's
    template refuses it, and still plans the other request."""
    from kvplan.compat.vllm.plan import plan_ready

    peer = _two_group_peer(v, patched)
    group = peer.groups[1][0]
    requests = [[(_ids(1,), _ids(5,)), (_ids(10, 11), _ids(20,))],
                [(_ids(3,), _ids(7,)), (_ids(12,), _ids(22,))]]
    batches, refused = plan_ready(peer, requests)
    assert set(refused) == {0}
    assert type(refused[0]) is kvplan.KvPlanError
    assert f"KV group {group}: src has 2 indices but dst has 1" in str(refused[0])
    assert [members for _, members in batches] == [[1]]
