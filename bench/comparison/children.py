"""What the comparison runs in child processes (bench/compare_sglang.py started again with a
hidden option): ``perf`` profiles, and the peak memory of one very large plan."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
from harness import BENCH_DIR
from support import sglang_loader

from . import KVPLAN as kvplan
from .scenarios import Scenario, build, scenario
from .sides import KvplanSide, SGLangSide

#: The command line the children are started with (``--prof-child`` / ``--mem-child``).
ENTRY = os.path.join(BENCH_DIR, "compare_sglang.py")

# Profiles (perf, by shared object), so that RESULTS.md says where the time goes
PROFILES = {
    "call61": "kvplan `template.plan()` on the single 61-block request, 300k calls",
    "emit2m": "kvplan `template.plan(out=buf)` on `dsv3-p1-32k-f100` (2.0M blocks), 150 calls",
    "fresh2m": "kvplan `template.plan()` into fresh memory on `dsv3-p1-32k-f100`, 60 calls",
    "sglang2m": "SGLang plan on `dsv3-p1-32k-f100`, 2 calls",
}


def prof_child(kind: str) -> None:
    b = build(scenario("dsv3-single-61" if kind == "call61" else "dsv3-p1-32k-f100"))
    if kind == "sglang2m":
        side = SGLangSide(sglang_loader.load_sglang(), b)
        for _ in range(2):
            side.plan()
            side.reset()
        return
    k = KvplanSide(b)
    if kind == "call61":
        for _ in range(300_000):
            k.pooled()
    elif kind == "emit2m":
        for _ in range(150):
            k.out_()
    elif kind == "fresh2m":
        for _ in range(20):
            k.fresh_before()
            for _ in range(3):
                k.fresh()
            k.fresh_after()


def profile(kind: str) -> list[tuple[float, str]] | None:
    """perf record a child; return [(percent, 'dso' or 'dso: symbol')] for the top entries."""
    import shutil
    import tempfile

    if not shutil.which("perf"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        r = subprocess.run(["perf", "record", "-q", "-F", "1999", "-o", data, "--",
                            sys.executable, ENTRY, "--prof-child", kind],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return None
        out = []
        for sort in ("dso", "dso,sym"):
            rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children",
                                  "--sort", sort], capture_output=True, text=True).stdout
            lines = [x for x in rep.splitlines() if x.strip() and not x.startswith("#")
                     and "%" in x.split()[0]]
            for x in lines[: (6 if sort == "dso" else 8)]:
                parts = x.split()
                pct = float(parts[0].rstrip("%"))
                if sort == "dso":
                    out.append((pct, parts[1]))
                else:
                    sym = " ".join(parts[3:]) if len(parts) > 3 else "?"
                    out.append((pct, f"{parts[1]}: {sym}"))
        return out


# Peak memory of a 10M-block plan (child process, RSS high-water mark)
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def mem_child(n_blocks_target: int) -> None:
    sc = Scenario("mem", "DeepSeek-V3 MLA", "mla", 1, n_blocks_target // 61 + 1, 1.0)
    b = build(sc)
    src = kvplan.Layout.mla(b.src_ptrs, b.src_lens, b.item_lens)
    dst = kvplan.Layout.mla(b.dst_ptrs, b.dst_lens, b.dst_item_lens)
    t = kvplan.Template(src, dst, kvplan.Pairing.by_layer_id(allow_positional_fallback=True))
    small = t.plan(b.src_pages[:64], b.dst_pages[:64])  # load everything lazily touched
    del small
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    rss0, hwm0 = _status("VmRSS"), _status("VmHWM")
    t0 = time.perf_counter_ns()
    plan = t.plan(b.src_pages, b.dst_pages)
    dt = time.perf_counter_ns() - t0
    hwm1, rss1 = _status("VmHWM"), _status("VmRSS")
    n = int(plan.n_blocks)
    plan_bytes = n * 24 + int(np.asarray(plan.pair_offsets).nbytes)
    print(f"MEM n_blocks={n} plan_bytes={plan_bytes} rss0={rss0} hwm0={hwm0} hwm1={hwm1} "
          f"rss1={rss1} reset={int(reset)} plan_ns={dt}")


def measure_memory(n_blocks: int) -> dict | None:
    r = subprocess.run([sys.executable, ENTRY, "--mem-child", str(n_blocks)],
                       capture_output=True, text=True, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("MEM ")]
    if r.returncode != 0 or not line:
        print(r.stdout, r.stderr, file=sys.stderr)
        return None
    d = {k: int(v) for k, v in (kv.split("=") for kv in line[0].split()[1:])}
    d["peak_extra"] = d["hwm1"] - d["rss0"]
    d["ratio"] = d["peak_extra"] / d["plan_bytes"]
    return d
