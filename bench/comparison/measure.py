"""The measurements of one run: every scenario timed with all variants interleaved, and the
costs that explain kvplan's numbers (call overhead, store bandwidth, emission per block)."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import numpy as np
from harness.timing import call_times_ns, gc_off, interleaved, loop_ns

from . import KVPLAN as kvplan
from .scenarios import build, scenario, scenarios
from .sides import KvplanSide, SGLangSide, identical
from .text import fmt_ns


def measure_scenarios(sg, quick: bool) -> list[dict]:
    """One row per scenario: blocks, repetitions and the median ns per call of every variant,
    after checking that both planners emit the identical blocks."""
    rows = []
    for sc in scenarios(quick):
        b = build(sc)
        sgs = SGLangSide(sg, b)
        t0 = time.time()
        sg_lists = sgs.result_lists()
        n_blocks = len(sg_lists[0])
        one_call = time.time() - t0
        nop = lambda: None  # noqa: E731
        variants = {"sglang plan": (sgs.plan, nop, sgs.reset),
                    "sglang handoff": (sgs.handoff, nop, sgs.reset)}
        kv_ok = False
        if kvplan is not None:
            kvs = KvplanSide(b)
            identical(sg_lists, kvs.result())
            kv_ok = True
            variants.update({"kvplan fresh": (kvs.fresh, kvs.fresh_before, kvs.fresh_after),
                             "kvplan pooled": (kvs.pooled, nop, kvs.reset),
                             "kvplan out=": (kvs.out_, nop, kvs.reset),
                             "kvplan handoff": (kvs.handoff, nop, kvs.reset)})
        del sg_lists
        sgs.reset()
        gc.collect()
        # Budget: large SGLang calls take seconds; few repetitions there, many for small ones.
        budget = 3.0 if quick else (12.0 if one_call > 0.5 else 6.0)
        min_reps = 3 if one_call > 0.5 else 7
        samples = interleaved(variants, budget, min_reps=min_reps, max_reps=301)
        med = {k: statistics.median(v) for k, v in samples.items()}
        row = dict(sc=sc, n_blocks=n_blocks, n_runs=n_blocks // max(1, len(b.src_ptrs)),
                   reps=len(samples["sglang plan"]),
                   kv_samples=len(samples.get("kvplan pooled", [])), med=med, identical=kv_ok)
        rows.append(row)
        print(f"{sc.key:28s} blocks={n_blocks:>10,d} reps={row['reps']:>3d} "
              + " ".join(f"{k}={fmt_ns(v)}" for k, v in med.items()), flush=True)
        del sgs, samples
        if kvplan is not None:
            del kvs
        gc.collect()
    return rows


def overhead_breakdown() -> dict:
    """Per-call costs on the single 61-block request (16 contiguous pages), cached template."""
    sc = scenario("dsv3-single-61")
    k = KvplanSide(build(sc))
    t, s, d, out = k.template, k.s, k.d, k.out
    s64, d64 = s.astype(np.int64), d.astype(np.int64)
    one_pair = KvplanSide(build(dataclasses.replace(sc, layers=1)))
    t1, out1 = one_pair.template, one_pair.out
    fns = {
        "template.plan(src, dst) (native: a TransferPlan viewing a pooled buffer)":
            lambda: t.plan(s, d),
        "template.plan(src, dst, out=buf) (views of the caller's rows)":
            lambda: t.plan(s, d, out=out),
        "template.plan(src64, dst64, out=buf) (int64 pages: int32 is tried first)":
            lambda: t.plan(s64, d64, out=out),
        "template.plan(src64, dst64, out=buf) on a 1-layer template (fixed cost of a call)":
            lambda: t1.plan(s64, d64, out=out1),
        "kvplan._core.pool_stats() (trivial native call returning a 4-tuple: PyO3 floor)":
            kvplan._core.pool_stats,
        "kvplan.group_contiguous(src, dst) (runs only, 3 new int64 arrays)":
            lambda: kvplan.group_contiguous(s, d),
        "np.empty((3, 61), np.uint64) (reference: one NumPy allocation)":
            lambda: np.empty((3, 61), np.uint64),
        "empty Python lambda call (timing-loop floor)": lambda: None,
    }
    # Interleaved like the main measurement: every call in turn, 11 rounds, median per call.
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with gc_off():
        for _ in range(11):
            for name, fn in fns.items():
                samples[name].extend(loop_ns(fn, 3000, 1))
    r = {k: statistics.median(v) for k, v in samples.items()}
    return r


def store_floor(n_blocks: int) -> float:
    """ns per block to merely write 24 B per block into a warm buffer of the same size
    (numpy ``fill``): the machine's store-bandwidth floor for a plan of n_blocks."""
    a = np.empty((3, n_blocks), np.uint64)
    a.fill(0)
    return statistics.median(call_times_ns(lambda: a.fill(1), 7)) / n_blocks


def emission_estimate(rows) -> dict | None:
    """Per-block cost of block emission alone, through Python: out= time of a fully fragmented
    scenario minus out= time of the contiguous scenario with the same page count (which pays the
    same index scan and almost no emission), divided by the extra blocks."""
    by = {r["sc"].key: r for r in rows}
    best = None
    for r in rows:
        sc = r["sc"]
        if sc.kind != "mla" or sc.frag != 1.0:
            continue
        twin = by.get(sc.key.replace("-f100", "-f0"))
        if not twin:
            continue
        extra = r["n_blocks"] - twin["n_blocks"]
        if extra <= 0:
            continue
        ns = (r["med"]["kvplan out="] - twin["med"]["kvplan out="]) / extra
        if best is None or r["n_blocks"] > best["n_blocks"]:
            best = dict(key=sc.key, twin=twin["sc"].key, n_blocks=r["n_blocks"], ns=ns,
                        scan_ns_per_page=twin["med"]["kvplan out="] / sc.n_pages)
    return best


def floors(rows) -> dict:
    """The store-bandwidth floor at the largest plan of the run, and at the first mid-sized
    one (50k-150k blocks) if there is one."""
    big = max(rows, key=lambda r: r["n_blocks"])
    floor = {"n_blocks": big["n_blocks"], "ns": store_floor(big["n_blocks"])}
    mid = [r for r in rows if 50_000 <= r["n_blocks"] <= 150_000]
    if mid:
        floor["mid_n_blocks"] = mid[0]["n_blocks"]
        floor["mid_ns"] = store_floor(mid[0]["n_blocks"])
    return floor
