"""Leaks: 100k mixed plan calls (pooled, out=, plan_state, error paths, wire) keep RSS
flat. The 1M-call figure comes from `bench/leak_check.py`, same workload
(support/leak_workload.py; see docs/robustness.md)."""

from __future__ import annotations

import mmap

import numpy as np
from support import leak_workload

MAX_GROWTH_KIB = 8 * 1024


def test_rss_probe_sees_growth():
    # negative control: the probe must notice memory that is really kept
    # (a fresh anonymous mapping: heap memory freed by earlier tests could be reused unseen)
    before = leak_workload.rss_kib()
    kept = mmap.mmap(-1, 32 << 20)
    np.frombuffer(kept, dtype=np.uint8)[::4096] = 1  # touch every page
    after = leak_workload.rss_kib()
    assert after - before >= 24 * 1024, (before, after)
    kept.close()


def test_100k_plan_calls_keep_rss_stable():
    r = leak_workload.run(100_000)
    print(f"\nRSS {r['rss_before_kib']} KiB -> {r['rss_after_kib']} KiB over {r['calls'] - r['warmup']} calls")
    assert r["errors_raised"] == 20_000
    assert r["growth_kib"] <= MAX_GROWTH_KIB, r
