"""Per-call cost of small plans: a 61-layer DeepSeek-V3-like MLA request of 64 contiguous pages
(one run, 61 blocks), pooled and with ``out=``, and ``plan_state`` with 2 state pairs.

    .venv/bin/python bench/plan_overhead.py [--repeat 15] [--number 20000]

Prints the median and min over ``repeat`` timings of ``number`` calls each (one process, so the
numbers are comparable only within one run).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from harness.timing import loop_ns

import kvplan
from kvplan.presets import get_preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--number", type=int, default=20000)
    args = ap.parse_args()
    preset = get_preset("deepseek-v3")
    src = preset.layout(range(61), page_size=1, capacity=4096)
    dst = preset.layout(range(61), page_size=1, capacity=4096, base=0x9000_0000_0000)
    template = kvplan.Template(src, dst)
    sp = np.arange(100, 164, dtype=np.int32)
    dp = np.arange(900, 964, dtype=np.int32)
    out = np.empty((3, 61), dtype=np.uint64)
    plan = template.plan(sp, dp)
    assert plan.n_blocks == 61 and plan.n_runs == 1
    cases = {
        "plan (pooled)": lambda: template.plan(sp, dp),
        "plan (out=)": lambda: template.plan(sp, dp, out=out),
    }
    print(f"kvplan {kvplan.__version__}: 61-layer MLA, 64 contiguous pages -> 61 blocks; "
          f"median/min of {args.repeat} x {args.number} calls")
    for name, fn in cases.items():
        times = [t / 1e3 for t in loop_ns(fn, args.number, args.repeat)]
        print(f"  {name:14s} median {statistics.median(times):.3f} us   min {min(times):.3f} us")


if __name__ == "__main__":
    main()
