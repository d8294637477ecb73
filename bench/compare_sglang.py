"""kvplan side by side with SGLang 0.5.23's own planner.

    .venv-bench/bin/python bench/compare_sglang.py            # full run, into bench/results/
    .venv-bench/bin/python bench/compare_sglang.py --quick    # smoke run, writes to /tmp

For every scenario the same inputs go to SGLang's real ``MooncakeKVManager._send_kvcache_generic``
(loaded by ``support.sglang_loader``) and to a cached ``kvplan.Template``; the blocks must be
identical (same triples, same order) before anything is timed. Timings are interleaved (SGLang
and every kvplan variant in turn, rotating order, same process) and reported as medians.

Variants
  sglang plan      _send_kvcache_generic with a recorder in place of _transfer_data: runs,
                   pairing and the list of (src, dst, len) tuples SGLang builds.
  sglang handoff   the same call with SGLang's real _transfer_data: the tuples are unzipped into
                   the three Python lists handed to batch_transfer_sync (recording engine).
  kvplan fresh     template.plan() into freshly allocated memory (pool drained untimed first).
  kvplan pooled    template.plan() in a loop that drops each plan (buffer reused from the pool).
  kvplan out=      template.plan(..., out=buf) into one warm caller buffer.
  kvplan handoff   template.plan() + plan.as_lists() + the same recording engine call.

The parts live in ``bench/comparison/`` (scenarios, the two sides, measurement, child
processes, the report and its prose, the chart); the timing loops and the machine description
in ``bench/harness/``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time

# OpenBLAS starts spinning helper threads at import; on a 2-core machine they steal cycles from
# both planners. Neither planner uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from harness.results import RESULTS_DIR  # noqa: E402  (also: tests/ on sys.path, support.*)
from support import sglang_loader  # noqa: E402

from comparison import KVPLAN, KVPLAN_ERR  # noqa: E402
from comparison.chart import chart  # noqa: E402
from comparison.children import PROFILES, mem_child, measure_memory, prof_child, profile  # noqa: E402
from comparison.measure import floors, measure_scenarios, overhead_breakdown  # noqa: E402
from comparison.report import write_results  # noqa: E402

#: Where the last run's measurements are kept for ``--rerender``.
LAST_RUN = os.path.join("/tmp", "kvplan-bench-last.pkl")


def rerender(path: str, out_dir: str | None) -> None:
    """Development aid: re-render a run's report from its pickled measurements."""
    with open(path, "rb") as f:
        d = pickle.load(f)
    out_dir = out_dir or "/tmp/kvplan-bench-rerender"
    os.makedirs(out_dir, exist_ok=True)
    write_results(out_dir, d["rows"], d["mem"], d["ovh"], d["floor"], d["profs"],
                  d["elapsed"], d["cmd"], sglang_loader.load_sglang(), d["load0"])
    chart(out_dir, d["rows"])
    print(f"re-rendered into {out_dir}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small smoke run; writes to /tmp")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--mem-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mem-blocks", type=int, default=10_000_000)
    ap.add_argument("--prof-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-profile", action="store_true", help="skip the perf profiles")
    ap.add_argument("--rerender", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mem_child is not None:
        mem_child(args.mem_child)
        return
    if args.prof_child is not None:
        prof_child(args.prof_child)
        return
    if args.rerender:
        rerender(args.rerender, args.out_dir)
        return
    out_dir = args.out_dir or ("/tmp/kvplan-bench-quick" if args.quick else RESULTS_DIR)
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()
    load0 = os.getloadavg()[0]

    sg = sglang_loader.load_sglang()
    closure = sg.verify_closure()
    examples = sglang_loader.check_worked_examples(sg)
    print(f"SGLang {sg.version}: {len(closure)} planning functions, no stand-in reachable; "
          f"examples {', '.join(examples)} reproduced", flush=True)
    if KVPLAN is None:
        print(f"kvplan not importable ({KVPLAN_ERR}): SGLang-only run", flush=True)

    rows = measure_scenarios(sg, args.quick)
    mem = measure_memory(args.mem_blocks) if (KVPLAN is not None and not args.quick) else None
    ovh = overhead_breakdown() if KVPLAN is not None else None
    profs = {}
    if KVPLAN is not None and not args.quick and not args.no_profile:
        for kind in PROFILES:
            profs[kind] = profile(kind)
            print(f"profiled {kind}", flush=True)
    floor = floors(rows)
    elapsed = time.time() - t_start
    cmd = "python bench/compare_sglang.py" + (" --quick" if args.quick else "")
    with open(LAST_RUN, "wb") as f:
        pickle.dump(dict(rows=rows, mem=mem, ovh=ovh, floor=floor, profs=profs, elapsed=elapsed,
                         cmd=cmd, load0=load0, load1=os.getloadavg()[0]), f)
    write_results(out_dir, rows, mem, ovh, floor, profs, elapsed, cmd, sg, load0)
    chart(out_dir, rows)
    print(f"wrote {out_dir}/RESULTS.md and chart.png in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
