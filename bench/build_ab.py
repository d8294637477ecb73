"""This build's planner against another build of kvplan's extension, interleaved in one process.

    .venv/bin/python bench/build_ab.py --baseline PATH/_core.abi3.so [--budget 20] [--quick]

A refactor of the core must not slow planning. This loads the checkout's ``kvplan._core`` and a
second build of the same extension (``--baseline``, e.g. a wheel of an older commit unpacked:
``maturin build --release`` in a worktree of that commit, then ``unzip`` its
``kvplan/_core.abi3.so``) side by side under different module names, builds the same templates
through each one's own ``Layout`` / ``Template`` / ``Pairing`` classes, checks that both give
the same blocks, and samples every (workload, build) pair in turn with the order rotated per
repetition (``harness.timing.interleaved``), so that machine noise hits both builds alike.

Workloads: the direct plan of the scenarios of ``bench/comparison/scenarios.py`` (MLA page 1 and
page 64, MHA, a hybrid PP stage paired by layer id, fragmented and not), a fully fragmented
4K request cut into a batch of eight, and a staged plan (gather, network, scatter) of the whole
4K request. Each is called the way both builds accept (page arrays, not ``kvplan.Request``,
which older builds lack).

Reported per workload: median and min per call for each build and the ratio this / baseline of
medians and of minimums (below 1: this build is faster), with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from harness.machine import lscpu  # noqa: E402  (also: tests/ on sys.path)
from harness.timing import interleaved  # noqa: E402

from comparison.scenarios import build, scenario  # noqa: E402
from comparison.sides import kvplan_template  # noqa: E402

DIRECT = ("dsv3-p1-32k-f100", "dsv3-p1-32k-f5", "dsv3-p64-32k-f5", "qwen3-p1-32k-f100",
          "hybrid-pp2s1-p1-32k-f100", "dsv3-single-61")
QUICK = ("dsv3-p1-4k-f100", "dsv3-p64-4k-f5", "dsv3-single-61")


def load_build(path: str, package: str = "kvplan_baseline") -> types.ModuleType:
    """The extension at ``path`` as module ``<package>._core`` (the init symbol is named after
    the last component, ``_core``, so the parent is a bare package of another name)."""
    parent = types.ModuleType(package)
    parent.__path__ = [os.path.dirname(os.path.abspath(path))]
    sys.modules[package] = parent
    loader = importlib.machinery.ExtensionFileLoader(f"{package}._core", path)
    spec = importlib.util.spec_from_file_location(f"{package}._core", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def columns(plan: Any) -> np.ndarray:
    return np.stack([np.asarray(plan.src_addrs), np.asarray(plan.dst_addrs),
                     np.asarray(plan.lengths)])


def workloads(cores: dict[str, types.ModuleType], quick: bool
              ) -> dict[str, dict[str, Callable[[], Any]]]:
    """workload -> build -> a call planning it; every build's blocks checked equal first."""
    out: dict[str, dict[str, Callable[[], Any]]] = {}
    for key in QUICK if quick else DIRECT:
        b = build(scenario(key) if not quick or key == "dsv3-single-61" else _quick(key))
        calls = {}
        for name, core in cores.items():
            t = kvplan_template(core, b)
            calls[name] = (lambda t=t, b=b: t.plan(b.src_pages, b.dst_pages))
        _same(key, {n: columns(c()) for n, c in calls.items()})
        out[f"plan {key}"] = calls
    b = build(_quick("dsv3-p1-4k-f100"))
    step = len(b.src_pages) // 8  # eight requests, the 4K request's pages cut in eight
    batch = [(b.src_pages[i:i + step], b.dst_pages[i:i + step])
             for i in range(0, 8 * step, step)]
    calls = {}
    for name, core in cores.items():
        t = kvplan_template(core, b)
        calls[name] = (lambda t=t: t.plan_batch(batch))
    _same("batch", {n: columns(c()) for n, c in calls.items()})
    out["plan_batch dsv3-p1-4k-f100 as 8 requests"] = calls
    bytes_needed = len(b.src_pages) * sum(b.item_lens)
    staging = dict(src_staging=(1 << 50, bytes_needed), dst_staging=(1 << 51, bytes_needed))
    calls = {}
    for name, core in cores.items():
        t = kvplan_template(core, b)
        calls[name] = (lambda t=t: t.plan_staged(b.src_pages, b.dst_pages, **staging))
    _same("staged", {n: np.concatenate([columns(c().gather), columns(c().network),
                                         columns(c().scatter)], axis=1)
                     for n, c in calls.items()})
    out["plan_staged dsv3-p1-4k-f100"] = calls
    return out


def _quick(key: str) -> Any:
    from comparison.scenarios import scenarios
    return next(x for x in scenarios(True) if x.key == key)


def _same(what: str, cols: dict[str, np.ndarray]) -> None:
    first, *rest = cols.values()
    for other in rest:
        if first.shape != other.shape or not np.array_equal(first, other):
            raise SystemExit(f"{what}: the builds plan different blocks "
                             f"({first.shape} and {other.shape})")


def _nothing() -> None:
    """Nothing to do around a sample (planning needs no untimed set-up)."""


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f} us" if ns < 1e6 else f"{ns / 1e6:,.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="the other build's _core .so")
    ap.add_argument("--this", default="", help="a third build's _core .so in place of the "
                    "checkout's (to compare two builds of other commits)")
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per workload")
    ap.add_argument("--quick", action="store_true", help="4K requests only (a smoke run)")
    ap.add_argument("--only", default="", help="the workloads whose name contains this")
    args = ap.parse_args()
    if args.this:
        this = load_build(args.this, "kvplan_this")
    else:
        import kvplan._core as this
    cores = {"this": this, "baseline": load_build(args.baseline)}
    load = os.getloadavg()
    print(f"CPU: {lscpu().get('Model name', 'unknown CPU')}; load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"this: {this.__file__}\nbaseline: {args.baseline}")
    print("| workload | this median | baseline median | ratio of medians | ratio of mins |")
    print("| --- | ---: | ---: | ---: | ---: |")
    t0 = time.time()
    for name, calls in workloads(cores, args.quick).items():
        if args.only not in name:
            continue
        samples = interleaved({k: (fn, _nothing, _nothing) for k, fn in calls.items()},
                              budget_s=args.budget, min_reps=5, max_reps=100_000)
        med = {k: statistics.median(v) for k, v in samples.items()}
        low = {k: min(v) for k, v in samples.items()}
        print(f"| {name} | {_us(med['this'])} | {_us(med['baseline'])} | "
              f"{med['this'] / med['baseline']:.3f} | {low['this'] / low['baseline']:.3f} |",
              flush=True)
    end = os.getloadavg()
    print(f"load average at end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
