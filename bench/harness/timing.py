"""Timing loops, all in nanoseconds per call (``time.perf_counter_ns``).

- :func:`call_times_ns`: each call timed on its own (calls long enough to time singly).
- :func:`loop_ns`: loops of many calls, one per-call figure per loop (calls too short to time
  singly), with the collector off as ``timeit`` does.
- :func:`interleaved`: several variants sampled in turn in one process, each calibrated so a
  sample lasts long enough, so that machine noise hits every variant alike.
- :func:`alternating`: the same rotation with one timed call per sample and untimed work
  around each (an engine submit followed by its wait).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

NS = 1e-9


@contextmanager
def gc_off() -> Iterator[None]:
    """The cyclic collector off for the block, restored to what it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def per_call_ns(fn: Callable[[], Any], inner: int) -> float:
    """Mean ns per call over ``inner`` back-to-back calls."""
    t0 = time.perf_counter_ns()
    for _ in range(inner):
        fn()
    return (time.perf_counter_ns() - t0) / inner


def call_times_ns(fn: Callable[[], Any], repeat: int, warmup: int = 0) -> list[float]:
    """ns of each of ``repeat`` calls, after ``warmup`` untimed ones. What a call returns is
    released after its time is taken (a plan going back to the pool is not part of the call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        result = fn()
        times.append(float(time.perf_counter_ns() - t0))
        del result
    return times


def loop_ns(fn: Callable[[], Any], number: int, repeat: int) -> list[float]:
    """Per-call ns of each of ``repeat`` loops of ``number`` calls, collector off."""
    with gc_off():
        return [per_call_ns(fn, number) for _ in range(repeat)]


Variant = tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]


def calibrate(fn: Callable[[], Any], before: Callable[[], Any], after: Callable[[], Any],
              min_sample_ns: float) -> tuple[int, float]:
    """Inner-loop count so that one sample lasts >= min_sample_ns. Calls taking >= 20 ms are
    not repeated here (at 8M blocks one SGLang call takes >10 s): they run once, as warm-up."""
    before()
    t = per_call_ns(fn, 1)
    after()
    if t >= 20e6:
        return 1, t
    before()
    t = per_call_ns(fn, 1)
    after()
    inner = max(1, int(min_sample_ns // max(t, 1.0)))
    if inner > 1:
        before()
        t = per_call_ns(fn, inner)
        after()
    return inner, t


def interleaved(variants: dict[str, Variant], budget_s: float, min_reps: int, max_reps: int,
                min_sample_ns: float = 200_000) -> dict[str, list[float]]:
    """variants: name -> (fn, before, after); before/after run untimed around each sample.
    Interleaved: each repetition samples every variant in an order rotated per repetition.
    A variant much cheaper than the slowest one takes up to 20 consecutive samples per
    repetition (so a fast variant gets enough samples even when the slowest allows only 3
    repetitions). Returns name -> list of per-call ns."""
    cal = {k: calibrate(*v, min_sample_ns) for k, v in variants.items()}
    per_sample = {k: inner * t for k, (inner, t) in cal.items()}
    slowest = max(per_sample.values())
    burst = {k: int(max(1, min(20, 0.25 * slowest // max(v, 1.0)))) for k, v in per_sample.items()}
    per_rep = sum(per_sample[k] * burst[k] for k in cal) * NS
    reps = int(max(min_reps, min(max_reps, budget_s // max(per_rep, 1e-9))))
    names = list(variants)
    samples: dict[str, list[float]] = {k: [] for k in names}
    with gc_off():
        for r in range(reps):
            order = names[r % len(names):] + names[: r % len(names)]
            for k in order:
                fn, before, after = variants[k]
                for _ in range(burst[k]):
                    before()
                    samples[k].append(per_call_ns(fn, cal[k][0]))
                    after()
    return samples


def alternating(variants: dict[str, Variant], reps: int) -> dict[str, list[float]]:
    """One timed call per sample, every variant in turn with the order rotated per repetition,
    collector off: for calls that must not run back to back (an engine submit that has to be
    waited on, untimed in ``after``, before the next one). Returns name -> ns of each call."""
    names = list(variants)
    samples: dict[str, list[float]] = {k: [] for k in names}
    with gc_off():
        for r in range(reps):
            for k in names[r % len(names):] + names[: r % len(names)]:
                fn, before, after = variants[k]
                before()
                t0 = time.perf_counter_ns()
                fn()
                samples[k].append(float(time.perf_counter_ns() - t0))
                after()
    return samples


def median_min_us(samples: list[float]) -> str:
    """Per-call nanosecond samples as ``median µs (min µs)``, the form the result tables use."""
    import statistics

    return f"{statistics.median(samples) / 1e3:,.1f} µs ({min(samples) / 1e3:,.1f} µs)"
