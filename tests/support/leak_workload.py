"""The leak workload: many plan calls whose RSS must stay flat.

N iterations of a mixed workload over one shared template: pooled plans of varying size, plans
into a caller's ``out=`` buffer, ``plan_state``, rejected requests (IndexBoundsError /
TypeError: the error path builds messages and exceptions), plus every 100th iteration a
``group_contiguous`` call and a wire round trip. ``run(n)`` reports RSS (VmRSS from
/proc/self/status) after a warm-up and at the end. tests/robustness/test_leaks.py runs it with 100,000
calls; ``bench/leak_check.py`` with 1,000,000.
"""

from __future__ import annotations

import gc
import time

import numpy as np

import kvplan
from kvplan import IndexBoundsError, Layout, Template


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def make_workload():
    n_layers, cap, item = 8, 4096, 1152
    src = Layout.mla([(k + 1) << 32 for k in range(n_layers)], [cap * item] * n_layers, item,
                     layer_ids=list(range(n_layers))).with_state("mamba_conv", [1 << 50], [16 * 64], 16, [0])
    dst = Layout.mla([(k + 64) << 32 for k in range(n_layers)], [cap * item] * n_layers, item,
                     layer_ids=list(range(n_layers))).with_state("mamba_conv", [1 << 51], [16 * 64], 16, [0])
    template = Template(src, dst, check_dst_overlap=True)
    rng = np.random.default_rng(0)
    requests = []
    for r in range(64):
        n = int(rng.integers(1, 300))
        sp = rng.integers(0, cap, n).astype(np.int32 if r % 2 else np.int64)
        dp = rng.permutation(cap)[:n].astype(np.int64 if r % 3 else np.int32)
        requests.append((sp, dp))
    bad = (np.array([0, cap], np.int64), np.array([0, 1], np.int64))
    return src, template, requests, bad, n_layers


def run(n: int) -> dict[str, float]:
    """Runs n iterations; returns RSS (KiB) after warm-up and at the end, and timings."""
    src, template, requests, bad, n_layers = make_workload()
    out = np.empty((3, 300 * n_layers), np.uint64)
    wire = src.to_bytes()
    warmup = min(n // 10, 20_000)
    errors = 0

    def one(i: int) -> None:
        nonlocal errors
        sp, dp = requests[i % len(requests)]
        kind = i % 10
        if kind < 6:
            plan = template.plan(sp, dp)
            assert plan.n_blocks > 0
        elif kind == 6:
            template.plan(sp, dp, out=out)
        elif kind == 7:
            plan = template.plan_state(i % 64, 63 - i % 64)
            assert plan.n_blocks == 1
        elif kind == 8:
            try:
                template.plan(*bad)
            except IndexBoundsError:
                errors += 1
        else:
            try:
                template.plan(sp.astype(np.float64), dp)
            except TypeError:
                errors += 1
        if i % 100 == 0:
            kvplan.group_contiguous(sp, dp[: len(sp)])
            assert Layout.from_bytes(wire) == src

    for i in range(warmup):
        one(i)
    gc.collect()
    before = rss_kib()
    t0 = time.perf_counter()
    for i in range(warmup, n):
        one(i)
    elapsed = time.perf_counter() - t0
    gc.collect()
    after = rss_kib()
    return {
        "calls": n,
        "warmup": warmup,
        "rss_before_kib": before,
        "rss_after_kib": after,
        "growth_kib": after - before,
        "seconds": elapsed,
        "us_per_call": elapsed / max(n - warmup, 1) * 1e6,
        "errors_raised": errors,
        "pool": kvplan._core.pool_stats(),
    }
