"""Leak check: many plan calls with stable RSS.

Runs N iterations (default 1,000,000) of the mixed workload of ``support.leak_workload`` (pooled
plans of varying size, ``out=``, ``plan_state``, rejected requests, ``group_contiguous`` and wire
round trips) and prints RSS (VmRSS from /proc/self/status) after a warm-up and at the end.

    .venv/bin/python bench/leak_check.py            # 1M calls
    .venv/bin/python bench/leak_check.py -n 100000  # quicker

Exit status 1 when RSS grew by more than --max-growth-mb (default 16) after warm-up.
tests/robustness/test_leaks.py runs the same workload with a smaller count.
"""

from __future__ import annotations

import argparse
import sys

import harness  # noqa: F401  (puts tests/ on sys.path for support.*)
from support.leak_workload import rss_kib, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=1_000_000, help="plan calls (default 1,000,000)")
    parser.add_argument("--max-growth-mb", type=float, default=16.0)
    args = parser.parse_args()
    print(f"RSS at start: {rss_kib() / 1024:.1f} MiB")
    r = run(args.n)
    print(f"calls: {r['calls']:,} (warm-up {r['warmup']:,}); errors raised on purpose: {r['errors_raised']:,}")
    print(f"RSS after warm-up: {r['rss_before_kib'] / 1024:.1f} MiB")
    print(f"RSS at end:        {r['rss_after_kib'] / 1024:.1f} MiB")
    print(f"growth:            {r['growth_kib'] / 1024:+.2f} MiB over {r['calls'] - r['warmup']:,} calls "
          f"({r['seconds']:.1f} s, {r['us_per_call']:.2f} us/call)")
    print(f"pool (buffers, bytes, hits, misses): {r['pool']}")
    ok = r["growth_kib"] <= args.max_growth_mb * 1024
    print("OK: RSS stable" if ok else f"FAIL: RSS grew more than {args.max_growth_mb} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
