"""Planning one fully fragmented 1,998,848-block request (README's figure): SGLang 0.5.23's
planner against kvplan, time and peak memory.

    .venv-bench/bin/python bench/planning_2m.py [--rounds 15]

Scenario ``dsv3-p1-32k-f100`` of bench/compare_sglang.py (DeepSeek-V3, 61 MLA layers, 32,768
pages of one token, every destination page its own run): the same inputs go to SGLang's real
``_send_kvcache_generic`` with a recorder in place of the engine call ("sglang plan": its list
of (src, dst, len) tuples) and to a cached ``kvplan.Template`` (``template.plan``, plan dropped
each time: "kvplan pooled"), after checking that both emit the identical blocks. Each round
times SGLang once and kvplan several times, alternating which goes first; the report gives
median and min/min ratios and the spread over rounds, with the CPU and the load average.

Peak memory: each side plans the request once in a fresh child process, and the child reports
how far its peak resident set (``VmHWM``, reset just before the call) grew over the request
(what the machine pays, Rust allocations included) and the peak of Python allocations
(``tracemalloc``: SGLang's tuples and lists; kvplan's columns are allocated in Rust and show in
the resident set only).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from harness.machine import lscpu  # noqa: E402  (also: tests/ on sys.path, support.*)
from harness.timing import gc_off  # noqa: E402
from support import sglang_loader  # noqa: E402

from comparison.scenarios import build, scenario  # noqa: E402
from comparison.sides import KvplanSide, SGLangSide, identical  # noqa: E402

KEY = "dsv3-p1-32k-f100"


def _sides() -> tuple[SGLangSide, KvplanSide, int]:
    sg = sglang_loader.load_sglang()
    b = build(scenario(KEY))
    sgs, kvs = SGLangSide(sg, b), KvplanSide(b)
    lists = sgs.result_lists()
    identical(lists, kvs.result())
    n = len(lists[0])
    del lists
    sgs.reset()
    gc.collect()
    return sgs, kvs, n


def _time(fn) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return float(time.perf_counter_ns() - t0)


def measure(rounds: int, kv_per_round: int) -> dict:
    sgs, kvs, n = _sides()
    kvs.pooled()  # warm the pool
    sg_ns, kv_ns, kv_min = [], [], []
    with gc_off():
        for r in range(rounds):
            kv_round = []
            if r % 2:
                kv_round = [_time(kvs.pooled) for _ in range(kv_per_round)]
            sg_ns.append(_time(sgs.plan))
            sgs.reset()
            if not r % 2:
                kv_round = [_time(kvs.pooled) for _ in range(kv_per_round)]
            kv_ns += kv_round
            kv_min.append(min(kv_round))
            gc.collect()
    per_round = [s / k for s, k in zip(sg_ns, kv_min)]
    return dict(blocks=n, sg=sg_ns, kv=kv_ns, per_round=per_round)


def mem_child(side: str, traced: bool) -> None:
    """In a fresh process: plan the request once on ``side`` only (the other side never runs
    here, so the peak resident set before the call is this side's set-up alone); print the
    growth of the peak resident set over the request, or with ``traced`` tracemalloc's peak
    (tracing costs memory of its own, so the two are measured in separate processes)."""
    b = build(scenario(KEY))
    if side == "sglang":
        sgs = SGLangSide(sglang_loader.load_sglang(), b)
        run = sgs.plan
    else:
        import kvplan

        ctx = dict(page_size=b.sc.page_size)
        template = kvplan.Template(
            kvplan.Layout.mla(b.src_ptrs, b.src_lens, b.item_lens, **ctx),
            kvplan.Layout.mla(b.dst_ptrs, b.dst_lens, b.dst_item_lens, **ctx),
            kvplan.Pairing.by_layer_id(allow_positional_fallback=True))

        def run() -> None:
            plan = template.plan(b.src_pages, b.dst_pages)
            assert plan.n_blocks == 1_998_848

    gc.collect()
    if traced:
        tracemalloc.start()
        run()
        print(f"MEM {tracemalloc.get_traced_memory()[1]}")
        return
    # Building the inputs peaks above what is resident at the call, so the lifetime peak
    # (ru_maxrss) can hide the request's growth: reset the peak (Linux clear_refs 5) first.
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    base = _status_kib("VmRSS")
    run()
    print(f"MEM {(_status_kib('VmHWM') - base) * 1024}")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith(field + ":"))
    return int(line.split()[1])


def memory(side: str) -> tuple[int, int]:
    """(peak resident set growth, tracemalloc peak) of planning the request on ``side``."""
    out = []
    for traced in (False, True):
        res = subprocess.run([sys.executable, __file__, "--mem-child", side]
                             + (["--traced"] if traced else []), capture_output=True,
                             text=True, timeout=900, check=True)
        out.append(int(next(x for x in res.stdout.splitlines()
                            if x.startswith("MEM ")).split()[1]))
    return out[0], out[1]


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--kv-per-round", type=int, default=20)
    ap.add_argument("--mem-child", choices=("sglang", "kvplan"), default=None)
    ap.add_argument("--traced", action="store_true")
    args = ap.parse_args()
    if args.mem_child:
        mem_child(args.mem_child, args.traced)
        return
    load = os.getloadavg()
    cpu = lscpu().get("Model name", "unknown CPU")
    t0 = time.time()
    m = measure(args.rounds, args.kv_per_round)
    sg_med, kv_med = statistics.median(m["sg"]), statistics.median(m["kv"])
    sg_min, kv_min = min(m["sg"]), min(m["kv"])
    pr = sorted(m["per_round"])
    print(f"request: {KEY}, {m['blocks']:,} blocks; CPU: {cpu}; "
          f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"sglang plan: median {_ms(sg_med)}, min {_ms(sg_min)}, max {_ms(max(m['sg']))} "
          f"({len(m['sg'])} samples)")
    print(f"kvplan plan: median {_ms(kv_med)}, min {_ms(kv_min)}, max {_ms(max(m['kv']))} "
          f"({len(m['kv'])} samples)")
    print(f"ratio: {sg_med / kv_med:.0f}x median, {sg_min / kv_min:.0f}x min/min; per round "
          f"(sglang / that round's fastest kvplan) {pr[0]:.0f}x to {pr[-1]:.0f}x")
    for side in ("kvplan", "sglang"):
        rss, py = memory(side)
        print(f"peak memory, {side}: resident set +{rss / 1e6:.0f} MB over the request, Python "
              f"allocations (tracemalloc) {py / 1e6:.1f} MB")
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
