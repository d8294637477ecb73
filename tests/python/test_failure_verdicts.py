"""Failure verdicts under injected faults: over real layouts (MLA, GQA, hetero TP in both memory
orders, DeepSeek-V4's further pool and windows, gpt-oss windows, hybrid models' state, a
cross-layer pool, and a vLLM deployment of three KV-cache groups whose page ids coincide), a
plan's blocks fail as a transfer engine reports them (a random subset of blocks, failed
submitted batches, a dropped completion, a peer that dies mid-transfer), and the verdict must
name exactly the pages the failed blocks were to write, per group.

The reference walks each failed block's destination bytes against every item of every entry of
the decode layout as ``Layout.entries()`` defines it (``data_ptr + p * stride``, ``item_len``
bytes, the entry's pool from ``entry_pools``), without the core's verdict function. The seed
is fixed, so every run (and CI) sees the same trials.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import kvplan
from kvplan.failures import (
    STATE_GROUP,
    FailureVerdict,
    failed_ranges,
    verdict_for_plan,
    verdicts_for_batch,
)
from kvplan.presets import DECODE_BASE, get_preset, pool_pages_for

SEED = 20261206
TRIALS = 10_000
CAPACITY = 32
PAGE = 16


@dataclass
class Deployment:
    name: str
    template: kvplan.Template
    src: kvplan.Layout
    dst: kvplan.Layout
    entries: np.ndarray  # per decode entry: data_ptr, data_len, item_len, stride, capacity, group


def _entries(layout: kvplan.Layout) -> np.ndarray:
    """The decode's entries as the layout defines them; a state entry's group is STATE_GROUP."""
    pools = layout.entry_pools
    rows = []
    for e, pool in zip(layout.entries(), pools):
        if e.item_len == 0:
            continue
        group = STATE_GROUP if e.kind == "state" else pool
        rows.append((e.data_ptr, e.data_len, e.item_len, e.stride, e.capacity, group))
    return np.array(rows, dtype=np.int64).reshape(-1, 6)


def _preset(key: str, **kw: object) -> tuple[kvplan.Layout, kvplan.Layout]:
    p = get_preset(key, 4)
    src_kw = {k[4:]: v for k, v in kw.items() if k.startswith("src_")}
    dst_kw = {k[4:]: v for k, v in kw.items() if k.startswith("dst_")}
    common = {k: v for k, v in kw.items() if not k.startswith(("src_", "dst_"))}
    src = p.layout(range(4), page_size=PAGE, capacity=CAPACITY, **common, **src_kw)  # type: ignore[arg-type]
    dst = p.layout(range(4), page_size=PAGE, capacity=CAPACITY, base=DECODE_BASE,
                   **common, **dst_kw)  # type: ignore[arg-type]
    return src, dst


def _vllm_groups(base: int) -> kvplan.Layout:
    """A vLLM deployment of three KV-cache groups (full attention, sliding window, a third
    group of another page size), each its own page index space: the same block id names a
    different block in each group."""
    items = [PAGE * 8] * 2 + [PAGE * 8] * 2 + [2 * PAGE * 4] * 2
    lens = [CAPACITY * i for i in items]
    ptrs = [base + sum(lens[:k]) for k in range(len(items))]
    layout = kvplan.Layout(ptrs, lens, items, list(range(6)), ["kv"] * 6, page_size=PAGE)
    return layout.with_pool([2, 3], PAGE).with_pool([4, 5], 2 * PAGE)


def deployments() -> list[Deployment]:
    pairs: list[tuple[str, kvplan.Layout, kvplan.Layout]] = [
        ("mla", *_preset("deepseek-v3")),
        ("gqa", *_preset("qwen3-235b")),
        ("mla-cross-layer", *_preset("deepseek-v3", cross_layer=True)),
        ("gqa-hetero-tp-nhd", *_preset("qwen3-235b", memory_order="NHD", dst_tp_size=2,
                                       dst_tp_rank=1)),
        ("gqa-hetero-tp-hnd", *_preset("qwen3-235b", memory_order="HND", dst_tp_size=2,
                                       dst_tp_rank=0)),
        ("deepseek-v4-pools", *_preset("deepseek-v4")),
        ("gpt-oss-windows", *_preset("gpt-oss-120b")),
        ("qwen3-next-state", *_preset("qwen3-next")),
        ("kimi-linear-state", *_preset("kimi-linear")),
        ("vllm-three-groups", _vllm_groups(0x10_0000), _vllm_groups(DECODE_BASE)),
    ]
    return [Deployment(name, kvplan.Template(src, dst), src, dst, _entries(dst))
            for name, src, dst in pairs]


def reference(entries: np.ndarray, dst_addrs: np.ndarray, lengths: np.ndarray,
              failed: np.ndarray) -> dict[int, tuple[int, ...]]:
    """Per group, every page (slot) of an entry whose item bytes overlap a failed block's."""
    out: dict[int, set[int]] = {}
    base, size, item, stride, cap, group = entries.T
    for b in failed:
        lo, hi = int(dst_addrs[b]), int(dst_addrs[b]) + int(lengths[b])
        near = np.nonzero((base < hi) & (lo < base + size))[0]
        for e in near:
            first = max(0, (lo - int(base[e])) // int(stride[e]))
            last = min(int(cap[e]) - 1, (hi - 1 - int(base[e])) // int(stride[e]))
            for p in range(first, last + 1):
                start = int(base[e]) + p * int(stride[e])
                if start < hi and lo < start + int(item[e]):
                    out.setdefault(int(group[e]), set()).add(p)
    return {g: tuple(sorted(pages)) for g, pages in out.items()}


# Faults as a transfer engine reports them: block positions of a plan of ``n`` blocks, as the
# failed ranges handed to the verdict.
Fault = Callable[[np.random.Generator, int], list[tuple[int, int]]]


def random_blocks(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    picked = np.flatnonzero(rng.random(n) < rng.uniform(0.05, 0.6))
    return [(int(b), int(b) + 1) for b in picked]


def failed_batches(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    cap = int(rng.integers(1, max(2, n // 2) + 1))
    starts = range(0, n, cap)
    return [(s, min(n, s + cap)) for s in starts if rng.random() < 0.4]


def dropped_completion(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    cap = int(rng.integers(1, n + 1))
    s = int(rng.integers(0, -(-n // cap))) * cap
    return [(s, min(n, s + cap))]


def peer_dies(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    return [(int(rng.integers(0, n)), n)]


FAULTS: list[Fault] = [random_blocks, failed_batches, dropped_completion, peer_dies]


def _request(d: Deployment, rng: np.random.Generator) -> tuple[kvplan.TransferPlan, set[int]]:
    """A random request's plan: a page request, or (on a layout with state) now and then a
    state slot request; and the decode's own pages (or slots) it may name."""
    if STATE_GROUP in d.entries[:, 5] and rng.random() < 0.25:
        slot_src, slot_dst = (int(x) for x in rng.integers(0, 8, 2))
        return d.template.plan_state(slot_src, slot_dst), {slot_dst}
    n_pages = int(rng.integers(1, 12))
    src = rng.permutation(CAPACITY)[:n_pages].astype(np.int64)
    dst = rng.permutation(CAPACITY)[:n_pages].astype(np.int64)
    pools = pool_pages_for(d.src, d.dst, src, dst)
    if d.name == "vllm-three-groups":
        n_big = -(-n_pages // 2)
        pools = {1: (rng.permutation(CAPACITY)[:n_pages].astype(np.int64),
                     rng.permutation(CAPACITY)[:n_pages].astype(np.int64)),
                 2: (rng.permutation(CAPACITY)[:n_big].astype(np.int64),
                     rng.permutation(CAPACITY)[:n_big].astype(np.int64))}
    request = kvplan.Request(src, dst, pool_pages=pools or None)
    own = {int(p) for p in dst} | {int(p) for _, (_, d_) in pools.items()
                                   if d_ is not None for p in d_}
    return d.template.plan(request), own


def test_verdicts_name_exactly_the_failed_pages_per_group() -> None:
    rng = np.random.default_rng(SEED)
    deps = deployments()
    trials = exact = 0
    groups_seen: set[tuple[str, int]] = set()
    while trials < TRIALS:
        d = deps[trials % len(deps)]
        plan, own = _request(d, rng)
        n = plan.n_blocks
        if n == 0:
            continue
        fault = FAULTS[int(rng.integers(0, len(FAULTS)))]
        ranges = fault(rng, n)
        blocks = np.unique(np.concatenate([np.arange(a, b) for a, b in ranges] or
                                          [np.zeros(0, np.int64)])).astype(np.int64)
        verdict = verdict_for_plan(f"req-{trials}", d.template, plan, ranges, reason=fault.__name__)
        want = reference(d.entries, plan.dst_addrs, plan.lengths, blocks)
        assert dict(verdict.blocks) == want, (d.name, fault.__name__, ranges)
        # A verdict names none of the decode's pages the request does not own.
        assert all(p in own for ids in verdict.blocks.values() for p in ids), d.name
        assert verdict.failed == (len(blocks) > 0)
        groups_seen.update((d.name, g) for g in verdict.blocks)
        trials += 1
        exact += 1
    assert exact == trials >= TRIALS
    # Every group of the multi-group deployments was named by some trial.
    assert {("vllm-three-groups", g) for g in (0, 1, 2)} <= groups_seen
    assert ("deepseek-v4-pools", 1) in groups_seen
    assert ("qwen3-next-state", STATE_GROUP) in groups_seen


def test_equal_block_ids_in_different_groups_stay_apart() -> None:
    d = next(x for x in deployments() if x.name == "vllm-three-groups")
    same = np.array([3, 4], np.int64)
    request = kvplan.Request(same, same, pool_pages={1: (same, same), 2: (same[:1], same[:1])})
    plan = d.template.plan(request)
    everything = verdict_for_plan("r", d.template, plan, [(0, plan.n_blocks)])
    assert dict(everything.blocks) == {0: (3, 4), 1: (3, 4), 2: (3,)}
    # One block of group 1 only: groups 0 and 2 are not named.
    g1 = d.entries[d.entries[:, 5] == 1]
    one = next(b for b in range(plan.n_blocks)
               if any(r[0] <= plan.dst_addrs[b] < r[0] + r[1] for r in g1))
    verdict = verdict_for_plan("r", d.template, plan, [one], reason="dropped")
    assert set(verdict.blocks) == {1}
    assert "group 1" in str(verdict) and "'r'" in str(verdict) and "dropped" in str(verdict)


@pytest.mark.parametrize("failed, message", [
    ([(3, 1)], "[3, 1)"),
    ([(0, 10_000)], "10000"),
    ([(-1, 2)], "-1"),
])
def test_bad_failed_ranges_are_index_bounds_errors(failed: list[tuple[int, int]],
                                                   message: str) -> None:
    d = deployments()[0]
    plan = d.template.plan(kvplan.Request(np.arange(3), np.arange(3)))
    with pytest.raises(kvplan.IndexBoundsError, match="failed blocks") as info:
        verdict_for_plan("r", d.template, plan, failed)
    assert message in str(info.value)


def test_a_plan_of_another_template_is_refused() -> None:
    d = deployments()[0]
    plan = d.template.plan(kvplan.Request(np.arange(3), np.arange(3)))
    backwards = kvplan.Template(d.dst, d.src)  # its decode is the prefill's memory
    with pytest.raises(kvplan.IndexBoundsError, match="lies in no item"):
        verdict_for_plan("r", backwards, plan, [0])


def test_failed_ranges_reads_positions_ranges_and_slices() -> None:
    assert failed_ranges([2, (4, 6), slice(8, 9)]) == [(2, 3), (4, 6), (8, 9)]
    with pytest.raises(kvplan.IndexBoundsError, match="no step"):
        failed_ranges([slice(0, 4, 2)])


def test_verdict_value() -> None:
    v = FailureVerdict("r", {0: (1, 2), STATE_GROUP: (5,)}, "peer died")
    assert v.failed and v.group(0) == (1, 2) and v.group(3) == ()
    assert str(v) == "request 'r' failed (peer died): group 0: blocks [1, 2]; state slots [5]"
    assert not FailureVerdict("r").failed


@pytest.mark.parametrize("name", ["gqa", "mla-cross-layer", "vllm-three-groups"])
def test_batch_verdicts_name_each_request_its_own_pages(name: str) -> None:
    """Batches of requests (consecutive ones continuing each other on both sides, so that
    they fuse into shared blocks) with failed batches: each request is named with exactly the
    failed pages of its own lists, and together they are every failed page."""
    d = next(x for x in deployments() if x.name == name)
    rng = np.random.default_rng(SEED + 1)
    fused = 0
    for trial in range(300):
        free = rng.permutation(CAPACITY - 8)
        requests: list[kvplan.Request] = []
        at = 0
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(1, 4))
            if requests and rng.random() < 0.5 and int(requests[-1].dst[-1]) + n < CAPACITY:
                s0, d0 = int(requests[-1].src[-1]) + 1, int(requests[-1].dst[-1]) + 1
                src = np.arange(s0, s0 + n, dtype=np.int64)
                dst = np.arange(d0, d0 + n, dtype=np.int64)
            else:
                src = np.sort(rng.choice(CAPACITY, n, replace=False)).astype(np.int64)
                dst = np.sort(free[at:at + n]).astype(np.int64)
            at += n
            own = {int(p) for r in requests for p in r.dst}
            if own & {int(p) for p in dst} or dst.max() >= CAPACITY or src.max() >= CAPACITY:
                continue
            requests.append(kvplan.Request(src, dst))
        if name == "vllm-three-groups":  # each group's pages of its own, the same ids
            halves = [-(-len(r.dst) // 2) for r in requests]
            requests = [kvplan.Request(r.src, r.dst, pool_pages={
                1: (r.src, r.dst),
                2: (np.arange(h, dtype=np.int64), np.arange(2 * k, 2 * k + h, dtype=np.int64))})
                for k, (r, h) in enumerate(zip(requests, halves))]
        batch = d.template.plan_batch(requests)
        fused += batch.n_requests - batch.n_segments
        ranges = failed_batches(rng, batch.n_blocks) if batch.n_blocks else []
        blocks = np.array(sorted({b for a, e in ranges for b in range(a, e)}), np.int64)
        ids = [f"r{trial}-{k}" for k in range(len(requests))]
        verdicts = verdicts_for_batch(ids, batch, requests, ranges, reason="batch failed")
        want = reference(d.entries, batch.dst_addrs, batch.lengths, blocks)
        united: dict[int, set[int]] = {}
        for v in verdicts:
            k = ids.index(v.request_id)
            r = requests[k]
            lists = {0: r.dst, **{p: dst for p, (_, dst) in (r.pool_pages or {}).items()}}
            for g, pages in v.blocks.items():
                assert set(pages) <= {int(p) for p in lists[g]}, (name, k, g)
                assert not united.setdefault(g, set()) & set(pages)
                united[g] |= set(pages)
        assert {g: tuple(sorted(p)) for g, p in united.items()} == want, (name, ranges)
    if name != "vllm-three-groups":
        assert fused > 50, fused


@pytest.mark.parametrize("rows", [(4, 4), (4, 6), (8, 3)])
def test_ring_rows_name_their_request_slot(rows: tuple[int, int]) -> None:
    """A ring-state entry holds ``rows`` rows per request slot: a failed ring-row block names
    the slot those rows belong to, never the row's own index (which is another request's
    slot), alone and as the tail of a hybrid request's pages."""
    row, page = 12, 16
    layers, slots, pages = 2, 3, 8

    def side(ring_rows: int, at: int) -> kvplan.Layout:
        kv = [at + i * pages * page for i in range(layers)]
        layout = kvplan.Layout(kv, [pages * page] * layers, [page] * layers, list(range(layers)),
                               ["kv"] * layers, page_size=1)
        ring_at = at + (1 << 20)
        layout = layout.with_state("ring", [ring_at + i * (1 << 16) for i in range(layers)],
                                   [slots * ring_rows * row] * layers, row, list(range(layers)))
        return layout.with_rings([None] * layers + [ring_rows] * layers)

    t = kvplan.Template(side(rows[0], 1 << 30), side(rows[1], 1 << 34))
    dst_slot = slots - 1
    for request in (kvplan.Request(slot=(0, dst_slot), n_tokens=5),
                    kvplan.Request(np.array([0, 1]), np.array([3, 4]), slot=(1, dst_slot),
                                   n_tokens=2)):
        plan = t.plan(request)
        for k in range(plan.n_blocks):
            verdict = verdict_for_plan("r", t, plan, [k], reason="dropped")
            state = verdict.group(STATE_GROUP)
            assert state in ((), (dst_slot,)), (rows, k, verdict)
            assert state or verdict.group(0), (rows, k, verdict)
