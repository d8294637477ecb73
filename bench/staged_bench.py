"""Direct vs staged transfers on loopback engines, and how often the advice picks the faster.

    .venv/bin/python bench/staged_bench.py                 # both engines, writes the results
    .venv/bin/python bench/staged_bench.py --engines nixl --quick
    .venv/bin/python bench/staged_bench.py --planning-only    # planning times only
    .venv/bin/python bench/staged_bench.py --rounds-pairs 200  # plan_rounds vs plan_staged

Both ends of every transfer live in this process, each engine with its own two transports
(Mooncake: TCP on 127.0.0.1; NIXL: two UCX agents), prefill memory in one registered host
arena, decode memory in another, each with a staging region after its pages.

- **direct**: ``Template.plan`` and one ``submit`` of its blocks;
- **staged**: ``Template.plan_staged``, ``kvplan.copy_local`` of the gather, ``submit`` of the
  network plan, ``kvplan.copy_local`` of the scatter (the decode computes the same staged plan
  from the same inputs; here one process holds both, so the plan is planned once).

Times are medians of a few repeats: the *transfer* time (what the advice models: submit, or
gather + submit + scatter) and, separately, the planning time. Every staged result is checked
byte for byte against the direct one.

1. Headline cases: prefill TP 8 -> decode TP 2 on NHD pages (the four prefill writers of decode
   rank 0, one after another), and an equal-TP request whose decode pages are all apart.
2. Planning time of ``plan``, ``plan_staged``, ``plan_rounds`` (64 MiB arenas per sender, two
   round buffers) and ``transfer_advice`` (one writer, no engine): a 32K-token request of an
   80-layer model at TP 8 -> 2 NHD and two small requests (``--planning-only`` prints just this
   table).
3. Sweep: tokens x geometry (TP and heads) x fragmentation, one writer per point. The cost is
   measured once per engine with ``kvplan.engines.measure_cost`` on the same transports; at
   each point ``Template.transfer_advice`` picks a path and the two measured transfer times
   say which was faster. Reported: the fraction of points where the advice picked the faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from harness.machine import describe
from harness.results import RESULTS_DIR, write_lines
from harness.timing import call_times_ns

import kvplan
from kvplan.engines.measure import loopback_transports, measure_cost
from kvplan.presets import fragmented_pages

HEAD_DIM, DTYPE, PAGE = 128, 2, 16
ARENA = 160 << 20  # bytes of each side's arena (pages of the largest case + staging)


@dataclasses.dataclass(frozen=True)
class Case:
    """One request between one decode rank and the prefill ranks that write to it."""

    name: str
    layers: int
    heads: int
    tp_p: int
    tp_d: int
    tokens: int
    fragmentation: float
    writers: int = 1  # prefill ranks of decode rank 0 to run (their heads)

    @property
    def pages(self) -> int:
        return -(-self.tokens // PAGE)

    @property
    def capacity(self) -> int:
        return 2 * self.pages + 2  # room for the fragmented destination's gaps

    def item(self, tp: int) -> int:
        return PAGE * max(1, self.heads // tp) * HEAD_DIM * DTYPE

    def label(self) -> str:
        return (f"TP {self.tp_p}->{self.tp_d}, {self.heads} heads, {self.layers} layers, "
                f"{self.tokens} tokens, fragmentation {self.fragmentation:g}")


def layout(case: Case, base: int, tp: int, rank: int) -> kvplan.Layout:
    item = case.item(tp)
    span = item * case.capacity
    ptrs = [base + e * span for e in range(2 * case.layers)]
    return kvplan.Layout.mha(ptrs[:case.layers], ptrs[case.layers:], [span] * case.layers,
                             [span] * case.layers, item, item,
                             layer_ids=list(range(case.layers)), page_size=PAGE, tp_rank=rank,
                             tp_size=tp, kv_heads=case.heads, head_dim=HEAD_DIM,
                             dtype_size=DTYPE, memory_order="NHD")


def span_bytes(case: Case, tp: int) -> int:
    return 2 * case.layers * case.item(tp) * case.capacity


class Rig:
    """One engine's two transports and two registered arenas."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.src = np.random.default_rng(1).integers(0, 256, ARENA, dtype=np.uint8)
        self.dst = np.zeros(ARENA, np.uint8)
        self.sender, self.receiver = loopback_transports(engine)
        self.sender.register_buffers([self.src.ctypes.data], [ARENA])
        self.receiver.register_buffers([self.dst.ctypes.data], [ARENA])
        self.peer = self.receiver.local_session_id()
        if engine == "nixl":
            self.peer = self.sender.add_peer(self.receiver.metadata())  # type: ignore[attr-defined]

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()

    def submit(self, plan: Any) -> None:
        self.sender.submit(plan, self.peer)


@dataclasses.dataclass
class Writer:
    template: kvplan.Template
    src_staging: tuple[int, int]
    src_view: np.ndarray
    staging_view: np.ndarray


def writers(rig: Rig, case: Case) -> tuple[list[Writer], tuple[int, int], np.ndarray,
                                           np.ndarray]:
    """The case's writers (prefill ranks 0.. of decode rank 0, each with its own part of the
    prefill arena and staging region) and the decode's staging region and views."""
    src_base, dst_base = rig.src.ctypes.data, rig.dst.ctypes.data
    d_span = span_bytes(case, case.tp_d)
    dst_layout = layout(case, dst_base, case.tp_d, 0)
    p_span = span_bytes(case, case.tp_p)
    per_writer = (ARENA // max(1, case.writers)) // 4096 * 4096
    staging_off = -(-p_span // 4096) * 4096
    if staging_off + p_span > per_writer or 2 * d_span + 4096 > ARENA:
        raise ValueError(f"{case.label()} does not fit the {ARENA >> 20} MiB arenas")
    out = []
    for w in range(case.writers):
        at = w * per_writer
        src_layout = layout(case, src_base + at, case.tp_p, w)
        out.append(Writer(kvplan.Template(src_layout, dst_layout),
                          (src_base + at + staging_off, p_span),
                          rig.src[at:at + p_span], rig.src[at + staging_off:
                                                          at + staging_off + p_span]))
    d_staging_off = -(-d_span // 4096) * 4096
    dst_staging = (dst_base + d_staging_off, d_span)
    return (out, dst_staging, rig.dst[:d_span],
            rig.dst[d_staging_off:d_staging_off + d_span])


def request(case: Case) -> tuple[np.ndarray, np.ndarray]:
    src = np.arange(case.pages, dtype=np.int64)
    dst = fragmented_pages(case.pages, case.fragmentation, seed=7, shuffle_runs=True,
                           capacity=case.capacity)
    return src, dst


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up (the harness's timer)."""
    return statistics.median(call_times_ns(fn, repeats, warmup=1)) / 1e9


def interleaved_medians_s(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Median seconds of each of ``fns``, called in turn ``repeats`` times after one warm-up
    round (each call's result dropped before the next)."""
    times: list[list[int]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            times[k].extend(call_times_ns(fn, 1, warmup=0))
    return [statistics.median(t) / 1e9 for t in times]


@dataclasses.dataclass
class Result:
    case: Case
    direct_blocks: int
    staged_blocks: int
    copy_blocks: int
    bytes: int
    direct_s: float
    staged_s: float
    direct_plan_s: float
    staged_plan_s: float
    advice: Any = None


def run_case(rig: Rig, case: Case, repeats: int, cost: kvplan.TransferCost | None = None
             ) -> Result:
    ws, dst_staging, dst_view, dst_staging_view = writers(rig, case)
    src_pages, dst_pages = request(case)
    direct = [w.template.plan(src_pages, dst_pages) for w in ws]
    staged = [w.template.plan_staged(src_pages, dst_pages, src_staging=w.src_staging,
                                     dst_staging=dst_staging) for w in ws]

    def run_direct() -> None:
        for plan in direct:
            rig.submit(plan)

    def run_staged() -> None:
        for w, s in zip(ws, staged):
            kvplan.copy_local(s.gather, [w.src_view], [w.staging_view])
            rig.submit(s.network)
        for s in staged:  # the decode scatters once the network plans have landed
            kvplan.copy_local(s.scatter, [dst_staging_view], [dst_view])

    rig.dst[:] = 0
    run_direct()
    want = dst_view.copy()
    rig.dst[:] = 0
    run_staged()
    assert np.array_equal(dst_view, want), f"{case.label()}: staged bytes differ from direct"
    result = Result(
        case, sum(p.n_blocks for p in direct), sum(s.network.n_blocks for s in staged),
        sum(s.gather.n_blocks + s.scatter.n_blocks for s in staged),
        sum(int(p.total_bytes) for p in direct),
        median_s(run_direct, repeats), median_s(run_staged, repeats),
        median_s(lambda: [w.template.plan(src_pages, dst_pages) for w in ws], repeats),
        median_s(lambda: [w.template.plan_staged(src_pages, dst_pages, src_staging=w.src_staging,
                                                 dst_staging=dst_staging) for w in ws],
                 repeats))
    if cost is not None:
        assert case.writers == 1, "the advice is per writer"
        result.advice = ws[0].template.transfer_advice(src_pages, dst_pages, cost)
    return result


HEADLINE = [
    Case("TP 8->2 NHD", layers=8, heads=8, tp_p=8, tp_d=2, tokens=1024, fragmentation=0.5,
         writers=4),
    Case("fragmented equal TP", layers=4, heads=8, tp_p=1, tp_d=1, tokens=2048,
         fragmentation=1.0),
]


# Planning only (no memory behind the addresses): the 32K-token request of an 80-layer model
# at TP 8 -> 2 on NHD pages (one writer: one block per token per entry), and two small ones.
PLANNING = [
    Case("32K x 80 layers TP 8->2 NHD", layers=80, heads=8, tp_p=8, tp_d=2, tokens=32768,
         fragmentation=0.0),
    Case("small TP 8->2 NHD", layers=8, heads=8, tp_p=8, tp_d=2, tokens=1024,
         fragmentation=0.5),
    Case("small fragmented equal TP", layers=4, heads=8, tp_p=1, tp_d=1, tokens=2048,
         fragmentation=1.0),
]
PLANNING_REPEATS = 9
ROUND_ARENA = 64 << 20  # bytes of plan_rounds' arena per sender (two round buffers)


def planning_rows(repeats: int) -> list[str]:
    """Median planning time of ``plan``, ``plan_staged``, ``plan_rounds`` and
    ``transfer_advice`` for one writer (prefill rank 0 -> decode rank 0) of each planning case; every plan dies before the
    next call, so pooled output memory is reused as in a serving loop."""
    rows = ["| case | direct blocks | gather / network / scatter blocks | plan (ms) | "
            "plan_staged (ms) | staged / direct | rounds | plan_rounds (ms) | rounds / staged | "
            "transfer_advice (ms) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    cost = kvplan.TransferCost(per_block_s=30e-6, network_bytes_per_s=1e9, copy_bytes_per_s=4e9)
    for case in PLANNING:
        span = lambda tp: 1 << max(40, span_bytes(case, tp).bit_length() + 1)  # noqa: E731
        template = kvplan.Template(layout(case, 1 << 44, case.tp_p, 0),
                                   layout(case, 1 << 46, case.tp_d, 0))
        src_pages, dst_pages = request(case)
        regions = {"src_staging": (1 << 50, span(case.tp_p)),
                   "dst_staging": (1 << 52, span(case.tp_d))}
        staged = template.plan_staged(src_pages, dst_pages, **regions)
        counts = (staged.direct_blocks, staged.gather.n_blocks, staged.network.n_blocks,
                  staged.scatter.n_blocks)
        del staged
        direct_s = median_s(lambda: template.plan(src_pages, dst_pages), repeats)
        staged_s = median_s(lambda: template.plan_staged(src_pages, dst_pages, **regions),
                            repeats)
        senders = case.tp_p // case.tp_d if case.tp_p > case.tp_d else 1
        arenas = {"src_arena": (1 << 54, ROUND_ARENA),
                  "dst_arena": (1 << 56, ROUND_ARENA * senders)}
        n_rounds = len(template.plan_rounds(src_pages, dst_pages, **arenas))
        # Interleaved with plan_staged (one call of each in turn), so that load from other
        # processes shifts both alike: the ratio is of these two medians.
        rounds_s, staged_again_s = interleaved_medians_s(
            [lambda: template.plan_rounds(src_pages, dst_pages, **arenas),
             lambda: template.plan_staged(src_pages, dst_pages, **regions)], repeats)
        advice_s = median_s(lambda: template.transfer_advice(src_pages, dst_pages, cost),
                            repeats)
        rows.append(f"| {case.name}: {case.label()} | {counts[0]:,} | {counts[1]:,} / "
                    f"{counts[2]:,} / {counts[3]:,} | {direct_s * 1e3:.3f} | {staged_s * 1e3:.3f} | "
                    f"{staged_s / direct_s:.1f} | {n_rounds:,} | {rounds_s * 1e3:.3f} | "
                    f"{rounds_s / staged_again_s:.2f} | {advice_s * 1e3:.3f} |")
        print(rows[-1], flush=True)
    return rows


def rounds_rows(pairs: int) -> list[str]:
    """``plan_rounds`` against ``plan_staged`` for one writer of each planning case, called in
    turn ``pairs`` times in this process after one warm-up call of each (each result dropped
    before the next call): medians and minima of both, and the ratios of the medians and of
    the minima (the minima are the least shifted by load from other processes)."""
    rows = ["| case | rounds | pairs | plan_staged median (ms) | plan_rounds median (ms) | "
            "median ratio | plan_staged min (ms) | plan_rounds min (ms) | min / min ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for case in PLANNING:
        span = lambda tp: 1 << max(40, span_bytes(case, tp).bit_length() + 1)  # noqa: E731
        template = kvplan.Template(layout(case, 1 << 44, case.tp_p, 0),
                                   layout(case, 1 << 46, case.tp_d, 0))
        src_pages, dst_pages = request(case)
        regions = {"src_staging": (1 << 50, span(case.tp_p)),
                   "dst_staging": (1 << 52, span(case.tp_d))}
        senders = case.tp_p // case.tp_d if case.tp_p > case.tp_d else 1
        arenas = {"src_arena": (1 << 54, ROUND_ARENA),
                  "dst_arena": (1 << 56, ROUND_ARENA * senders)}
        n_rounds = len(template.plan_rounds(src_pages, dst_pages, **arenas))
        fns: list[Callable[[], Any]] = [
            lambda: template.plan_staged(src_pages, dst_pages, **regions),
            lambda: template.plan_rounds(src_pages, dst_pages, **arenas)]
        times: list[list[int]] = [[], []]
        for fn in fns:
            fn()
        for _ in range(pairs):
            for k, fn in enumerate(fns):
                times[k].extend(call_times_ns(fn, 1, warmup=0))
        (staged_med, rounds_med), (staged_min, rounds_min) = (
            [statistics.median(t) / 1e6 for t in times], [min(t) / 1e6 for t in times])
        rows.append(f"| {case.name}: {case.label()} | {n_rounds:,} | {pairs} | "
                    f"{staged_med:.3f} | {rounds_med:.3f} | {rounds_med / staged_med:.2f} | "
                    f"{staged_min:.3f} | {rounds_min:.3f} | {rounds_min / staged_min:.2f} |")
        print(rows[-1], flush=True)
    return rows


def sweep_cases(quick: bool) -> list[Case]:
    geometries = [(8, 2), (2, 1), (1, 1)]
    tokens = [64, 1024] if quick else [64, 256, 1024]
    frags = [0.0, 1.0] if quick else [0.0, 0.5, 1.0]
    return [Case("sweep", layers=4, heads=8, tp_p=p, tp_d=d, tokens=t, fragmentation=f)
            for p, d in geometries for t in tokens for f in frags]


def ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="mooncake,nixl")
    ap.add_argument("--quick", action="store_true", help="fewer points and repeats, no file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--planning-only", action="store_true",
                    help="only print the planning-time table (no engines, no file)")
    ap.add_argument("--rounds-pairs", type=int, default=0, metavar="N",
                    help="only print plan_rounds against plan_staged, N interleaved pairs per "
                         "case (no engines, no file)")
    args = ap.parse_args()
    if args.rounds_pairs:
        print(f"load average {os.getloadavg()[0]:.1f}, kvplan {kvplan.__version__}")
        rounds_rows(args.rounds_pairs)
        return
    if args.planning_only:
        planning_rows(PLANNING_REPEATS)
        return
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    repeats = 1 if args.quick else args.repeats
    load = os.getloadavg()[0]
    lines = ["# Staged transfers: direct vs staged on loopback, and the advice", "",
             "Command: `.venv/bin/python bench/staged_bench.py`"
             + (" " + " ".join(f"--engines {args.engines}".split()) if args.engines
                != "mooncake,nixl" else ""), ""]
    lines += describe(load, kvplan.__version__) + [""]
    lines += [
        "Both ends in one process per engine (Mooncake TCP on 127.0.0.1, NIXL UCX between two "
        "agents), host memory. *Transfer* is what the advice models: `submit` of the direct "
        "plan, or `copy_local` of the gather + `submit` of the network plan + `copy_local` of "
        "the scatter. Planning is timed separately. Head dim 128, bf16, page 16 tokens, NHD. "
        f"Medians of {repeats} repeats after a warm-up; every staged result equals the direct "
        "one byte for byte.", ""]
    headline_rows = ["| engine | case | direct blocks | staged network blocks | copy blocks | "
                     "MiB | direct transfer (ms) | staged transfer (ms) | staged / direct | "
                     "direct plan (ms) | staged plan (ms) |",
                     "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    sweep_rows = ["| engine | point | direct blocks | staged blocks | direct (ms) | staged (ms) "
                  "| faster | advice | est. direct (ms) | est. staged (ms) | right |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    planning = planning_rows(PLANNING_REPEATS)
    costs, scores = [], []
    for engine in args.engines.split(","):
        rig = Rig(engine)
        try:
            for case in HEADLINE:
                r = run_case(rig, case, repeats)
                headline_rows.append(
                    f"| {engine} | {case.name}: {case.label()}"
                    f"{f', {case.writers} writers' if case.writers > 1 else ''} | "
                    f"{r.direct_blocks:,} | {r.staged_blocks:,} | {r.copy_blocks:,} | "
                    f"{r.bytes / 2**20:.1f} | {ms(r.direct_s)} | {ms(r.staged_s)} | "
                    f"{r.staged_s / r.direct_s:.2f} | {ms(r.direct_plan_s)} | "
                    f"{ms(r.staged_plan_s)} |")
                print(headline_rows[-1], flush=True)
            # Measured once per engine, on the transports the sweep uses (the arenas are
            # large enough for the measurement's regions).
            cost = measure_cost(rig.sender, rig.peer, src_region=(rig.src.ctypes.data, ARENA),
                                dst_region=(rig.dst.ctypes.data, ARENA))
            costs.append(f"- {engine}: `{cost!r}`")
            print(costs[-1], flush=True)
            right = 0
            cases = sweep_cases(args.quick)
            for case in cases:
                r = run_case(rig, case, repeats, cost)
                faster = "staged" if r.staged_s < r.direct_s else "direct"
                ok = r.advice.choice == faster
                right += ok
                sweep_rows.append(
                    f"| {engine} | TP {case.tp_p}->{case.tp_d}, {case.tokens} tok, frag "
                    f"{case.fragmentation:g} | {r.direct_blocks:,} | {r.staged_blocks:,} | "
                    f"{ms(r.direct_s)} | {ms(r.staged_s)} | {faster} | {r.advice.choice} | "
                    f"{ms(r.advice.direct_s)} | {ms(r.advice.staged_s)} | "
                    f"{'yes' if ok else '**no**'} |")
                print(sweep_rows[-1], flush=True)
            scores.append((engine, right, len(cases)))
        finally:
            rig.close()
    total_right = sum(r for _, r, _ in scores)
    total = sum(n for _, _, n in scores)
    lines += ["## Headline cases", ""] + headline_rows + [""]
    lines += ["## Planning time", "",
              "One writer (prefill rank 0 -> decode rank 0), addresses without memory behind "
              f"them (planning only); medians of {PLANNING_REPEATS} calls after a warm-up, each "
              "plan dropped before the next call (pooled output memory is reused, as in a "
              "serving loop). `transfer_advice` is a made-up cost's advice (the counts are what "
              "it computes).", ""] + planning + [""]
    lines += ["## Advice sweep", "",
              "Tokens {64, 256, 1024} x (TP 8->2, TP 2->1, TP 1->1; 8 KV heads, 4 layers) x "
              "fragmentation {0, 0.5, 1} of the decode pages, one writer per point. The cost "
              "measured once per engine by `kvplan.engines.measure_cost` on the same transports:",
              ""] + costs + [""] + sweep_rows + [""]
    verdict = total_right / total if total else 0.0
    lines += ["## Result", ""] + [f"- {e}: the advice picked the faster measured path at "
                                  f"{r} of {n} points ({r / n:.0%})" for e, r, n in scores]
    lines += [f"- overall: {total_right} of {total} ({verdict:.0%}); target >= 90 %: "
              f"{'met' if verdict >= 0.9 else '**missed**'}", ""]
    print("\n".join(lines[-len(scores) - 2:]))
    if not args.quick:
        path = write_lines(args.out, "staged-results.md", lines)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
