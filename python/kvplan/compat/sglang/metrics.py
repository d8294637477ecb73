"""kvplan's per-call series in a SGLang server's ``/metrics``.

With ``--enable-metrics`` SGLang exports Prometheus metrics in multi-process mode: its
launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before it spawns the schedulers, every process's
``prometheus_client`` writes its samples into that directory, and the HTTP server's
``/metrics`` merges them. kvplan's drop-ins run in the scheduler processes, so two histograms
created there (the names, help texts and buckets of ``compat.plan_series``, as kvplan's vLLM
connector exports them) appear in the server's ``/metrics`` next to SGLang's own:

* ``kvplan:plan_time_seconds``: kvplan's planning time for one transfer call of SGLang's
  transfer worker (a request's KV pages, a chunk of them under chunked prefill, or its state
  slot), the hand-off to the engine not included;
* ``kvplan:blocks_per_request``: the blocks of that call's plan, one engine descriptor each.

Without SGLang's metrics (no ``PROMETHEUS_MULTIPROC_DIR``) or without ``prometheus_client``
nothing is recorded and nothing is registered.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, TypeVar

from kvplan.compat.plan_series import (
    BLOCKS_BUCKETS,
    BLOCKS_HELP,
    BLOCKS_METRIC,
    PLAN_TIME_BUCKETS,
    PLAN_TIME_HELP,
    PLAN_TIME_METRIC,
)

__all__ = ["LAYOUT_INFO_METRIC", "layout_info", "note_layout", "observe", "observe_rounds",
           "planned", "staged_totals"]

#: An info metric (value 1) a router matches prefills to decodes on (docs/identity.md): one
#: series per manager's layout, labelled ``class_id``, ``layout_id``, ``role`` and ``engine``.
LAYOUT_INFO_METRIC = "kvplan:layout_info"
LAYOUT_INFO_HELP = ("kvplan's layout identity of a KV-cache worker (value 1): peers of equal "
                    "class_id can be paired; layout_id names one rank's exact layout.")
LAYOUT_INFO_LABELS = ("class_id", "layout_id", "role", "engine")
ENGINE = "sglang"

#: Staged transfers in rounds (``kvplan.compat.sglang.rounds``): per staged request, the
#: network blocks it took and its rounds.
STAGED_BLOCKS_METRIC = "kvplan:staged_network_blocks_per_request"
STAGED_BLOCKS_HELP = "Network blocks (engine descriptors) of one staged request, all rounds."
STAGED_ROUNDS_METRIC = "kvplan:staged_rounds_per_request"
STAGED_ROUNDS_HELP = "Rounds of one staged request through the bounded staging arenas."
STAGED_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)

P = TypeVar("P")

_lock = threading.Lock()
# None: not looked at yet; False: SGLang's metrics are off here; else the two histograms.
_series: Any = None
_staged_series: Any = None
# This process's staged requests, network blocks and rounds (read by ``staged_totals``).
_staged = [0, 0, 0]
# None: not looked at yet; False: SGLang's metrics are off here; else the gauge.
_layout_gauge: Any = None
# This process's layout identities, as labelled in ``kvplan:layout_info``.
_layouts: list[dict[str, str]] = []


def _histograms() -> Any:
    global _series
    if _series is None:
        with _lock:
            if _series is None:
                _series = _create() or False
    return _series or None


def _create() -> tuple[Any, Any] | None:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None  # SGLang runs without --enable-metrics: nobody reads a series
    try:
        from prometheus_client import Histogram
    except ImportError:
        return None
    return (Histogram(PLAN_TIME_METRIC, PLAN_TIME_HELP, buckets=PLAN_TIME_BUCKETS),
            Histogram(BLOCKS_METRIC, BLOCKS_HELP, buckets=BLOCKS_BUCKETS))


def observe(plan_seconds: float, n_blocks: int) -> None:
    """One transfer call's planning time and block count, when SGLang exports metrics."""
    series = _histograms()
    if series is not None:
        series[0].observe(plan_seconds)
        series[1].observe(n_blocks)


def planned(make_plan: Callable[[], P], network: Callable[[P], Any] = lambda plan: plan) -> P:
    """``make_plan()``'s answer, its time and its network plan's ``n_blocks`` (the plan
    itself, or what ``network`` picks out of a staged plan or a row gather) observed as one
    transfer call."""
    started = time.perf_counter()
    answer = make_plan()
    observe(time.perf_counter() - started, int(network(answer).n_blocks))
    return answer


def _staged_histograms() -> Any:
    global _staged_series
    if _staged_series is None:
        with _lock:
            if _staged_series is None:
                _staged_series = _create_staged() or False
    return _staged_series or None


def _create_staged() -> tuple[Any, Any] | None:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        from prometheus_client import Histogram
    except ImportError:
        return None
    return (Histogram(STAGED_BLOCKS_METRIC, STAGED_BLOCKS_HELP, buckets=STAGED_BUCKETS),
            Histogram(STAGED_ROUNDS_METRIC, STAGED_ROUNDS_HELP, buckets=STAGED_BUCKETS))


def observe_rounds(network_blocks: int, rounds: int) -> None:
    """One staged request's network blocks and rounds: counted in this process
    (:func:`staged_totals`) and, when SGLang exports metrics, in its two histograms."""
    with _lock:
        _staged[0] += 1
        _staged[1] += int(network_blocks)
        _staged[2] += int(rounds)
    series = _staged_histograms()
    if series is not None:
        series[0].observe(network_blocks)
        series[1].observe(rounds)


def staged_totals() -> dict[str, int]:
    """This process's staged requests, their network blocks and rounds, so far."""
    with _lock:
        return {"requests": _staged[0], "network_blocks": _staged[1], "rounds": _staged[2]}


def _gauge() -> Any:
    global _layout_gauge
    if _layout_gauge is None:
        with _lock:
            if _layout_gauge is None:
                _layout_gauge = _create_gauge() or False
    return _layout_gauge or None


def _create_gauge() -> Any:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        from prometheus_client import Gauge
    except ImportError:
        return None
    # "max" merges the scheduler processes' files without a pid label: one series per layout
    return Gauge(LAYOUT_INFO_METRIC, LAYOUT_INFO_HELP, labelnames=LAYOUT_INFO_LABELS,
                 multiprocess_mode="max")


def note_layout(class_id: str, layout_id: str, role: str) -> None:
    """A manager's layout identity: kept in this process (:func:`layout_info`) and, when
    SGLang exports metrics, ``kvplan:layout_info`` with these labels set to 1."""
    labels = {"class_id": class_id, "layout_id": layout_id, "role": role, "engine": ENGINE}
    with _lock:
        if labels in _layouts:
            return
        _layouts.append(labels)
    gauge = _gauge()
    if gauge is not None:
        gauge.labels(**labels).set(1)


def layout_info() -> list[dict[str, str]]:
    """This process's ``kvplan:layout_info`` label sets, in the order they were noted."""
    with _lock:
        return [dict(labels) for labels in _layouts]
