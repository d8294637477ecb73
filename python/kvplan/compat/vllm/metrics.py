"""Metrics of kvplan's vLLM connector: vLLM's Mooncake series under vLLM's names, plus kvplan's.

vLLM collects a connector's metrics in two steps. Each worker records into a
``KVConnectorStats`` object (the Mooncake worker's ``xfer_stats``); the scheduler ships its
``data`` dict (one list per key) to the front end, which rebuilds a stats object with the
connector class's ``build_kv_connector_stats(data)`` for the periodic log line (``reduce()``)
and hands the dict to the ``KVConnectorPromMetrics`` that the connector class's
``build_prom_metrics`` returned, for ``/metrics``.

kvplan's connector keeps vLLM's Mooncake series unchanged and adds two per-request columns,
filled by kvplan's ``_build_transfer_params`` around each request's plan:

* ``kvplan_plan_time``: seconds spent planning the request (Prometheus
  ``kvplan:plan_time_seconds``, a histogram);
* ``kvplan_blocks_per_request``: the blocks of the request's plan, one transfer entry each
  (``kvplan:blocks_per_request``).

:func:`stats_class` derives the stats class from the ``MooncakeKVConnectorStats`` of the vLLM
module in use; :func:`prom_metrics_class` derives the Prometheus class from vLLM's
``MooncakePromMetrics`` where that module has one (vLLM 0.33), and otherwise (vLLM 0.32) from
the generic ``KVConnectorPromMetrics``, registering vLLM's six Mooncake series itself under
0.33's names and bucket edges. Nothing here imports vLLM: the classes are derived from the
modules the connector class hands in.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

from kvplan.compat.plan_series import (
    BLOCKS_BUCKETS,
    BLOCKS_HELP,
    BLOCKS_METRIC,
    PLAN_TIME_BUCKETS,
    PLAN_TIME_HELP,
    PLAN_TIME_METRIC,
)

__all__ = ["LayoutInfoGauge", "LayoutStats", "nixl_prom_metrics_class", "nixl_stats_class",
           "BLOCKS_KEY", "BLOCKS_METRIC", "KVPLAN_KEYS", "LAYOUT_INFO_KEY", "LAYOUT_INFO_METRIC",
           "PLAN_TIME_KEY", "PLAN_TIME_METRIC", "STAGED_BLOCKS_KEY", "STAGED_ROUNDS_KEY",
           "PlanStats", "prom_metrics_class", "stats_class"]

#: The stats columns kvplan adds (one entry per planned request, aligned).
PLAN_TIME_KEY = "kvplan_plan_time"
BLOCKS_KEY = "kvplan_blocks_per_request"
#: Per request sent staged (docs/vllm.md, "Staged transfers"): its network blocks and rounds.
STAGED_BLOCKS_KEY = "kvplan_staged_network_blocks"
STAGED_ROUNDS_KEY = "kvplan_staged_rounds"
STAGED_BLOCKS_METRIC = "kvplan:staged_network_blocks_per_request"
STAGED_ROUNDS_METRIC = "kvplan:staged_rounds_per_request"
KVPLAN_KEYS = (PLAN_TIME_KEY, BLOCKS_KEY, STAGED_BLOCKS_KEY, STAGED_ROUNDS_KEY)
#: The worker's layout identity, ``[class_id, layout_id, role]`` per role, recorded once when
#: its KV cache is known (shipped with the next stats; the front end's gauge keeps it).
LAYOUT_INFO_KEY = "kvplan_layout_info"
#: An info metric (value 1) a router matches prefills to decodes on (docs/identity.md).
LAYOUT_INFO_METRIC = "kvplan:layout_info"
LAYOUT_INFO_HELP = ("kvplan's layout identity of a KV-cache worker (value 1): peers of equal "
                    "class_id can be paired; layout_id names one rank's exact layout.")
LAYOUT_INFO_LABELS = ("class_id", "layout_id", "role")

# vLLM's Mooncake series, for a vLLM module that does not register them (0.32): the names and
# bucket edges of vLLM 0.33's, so that dashboards read both releases alike.
_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES_BUCKETS = tuple(float(2 ** (11 + 2 * i)) for i in range(12))  # 2 KiB .. 8 GiB
_DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)
_VLLM_HISTOGRAMS = (
    ("transfer_duration", "vllm:mooncake_xfer_time_seconds",
     "Histogram of transfer duration for Mooncake KV Cache transfers.", _XFER_TIME_BUCKETS),
    ("bytes_transferred", "vllm:mooncake_bytes_transferred",
     "Histogram of bytes transferred per Mooncake KV Cache transfer.", _BYTES_BUCKETS),
    ("num_descriptors", "vllm:mooncake_num_descriptors",
     "Histogram of number of descriptors per Mooncake KV Cache transfer.",
     _DESCRIPTOR_BUCKETS),
)
_VLLM_COUNTERS = (
    ("num_failed_transfers", "vllm:mooncake_num_failed_transfers",
     "Number of failed Mooncake KV Cache transfers."),
    ("num_failed_recvs", "vllm:mooncake_num_failed_recvs",
     "Number of failed Mooncake KV Cache receives."),
    ("num_kv_expired_reqs", "vllm:mooncake_num_kv_expired_reqs",
     "Number of requests that had their KV expire (tracked on the prefill instance)."),
)
_KVPLAN_HISTOGRAMS = (
    (PLAN_TIME_KEY, PLAN_TIME_METRIC, PLAN_TIME_HELP, PLAN_TIME_BUCKETS),
    (BLOCKS_KEY, BLOCKS_METRIC, BLOCKS_HELP, BLOCKS_BUCKETS),
    (STAGED_BLOCKS_KEY, STAGED_BLOCKS_METRIC,
     "Network blocks of each request kvplan sent in staged rounds.", BLOCKS_BUCKETS),
    (STAGED_ROUNDS_KEY, STAGED_ROUNDS_METRIC,
     "Rounds of each request kvplan sent staged.", BLOCKS_BUCKETS),
)


class LayoutStats:
    """The ``kvplan:layout_info`` column of a connector's stats (both kvplan connectors)."""

    data: dict[str, list[Any]]

    def record_layout(self, class_id: str, layout_id: str, roles: tuple[str, ...]) -> None:
        """The worker's layout identity, once per role (``kvplan:layout_info``)."""
        lock = getattr(self, "_lock", None)
        with lock if lock is not None else contextlib.nullcontext():
            self.data.setdefault(LAYOUT_INFO_KEY, []).extend(
                [class_id, layout_id, role] for role in roles)


class PlanStats(LayoutStats):
    """What kvplan adds to vLLM's ``MooncakeKVConnectorStats`` (mixed in by
    :func:`stats_class`); kvplan's planner records only into a stats object of this type."""

    _lock: Any

    def record_plan(self, seconds: float, blocks: int) -> None:
        """One planned request: its planning time and the blocks of its plan."""
        with self._lock:
            data = self.data
            data[PLAN_TIME_KEY].append(seconds)
            data[BLOCKS_KEY].append(blocks)

    def record_staged(self, network_blocks: int, rounds: int) -> None:
        """One request sent staged: the network blocks of all its rounds, and its rounds."""
        with self._lock:
            data = self.data
            data.setdefault(STAGED_BLOCKS_KEY, []).append(network_blocks)
            data.setdefault(STAGED_ROUNDS_KEY, []).append(rounds)


_STATS: dict[type, type] = {}


def stats_class(base: type) -> type:
    """The stats class of kvplan's connector: ``base`` (a vLLM module's
    ``MooncakeKVConnectorStats``) with kvplan's two columns, one class per base.

    Every stats object has all keys, whatever dict it was built from; ``clone_and_reset``
    returns this class; ``is_empty`` is false while a plan is recorded; ``aggregate`` extends
    every column of the other object; ``reduce`` adds ``Avg kvplan plan time (ms)`` and
    ``Avg kvplan blocks per request`` (0 when nothing was planned). Instances pickle by the
    base class's module and name, so a worker's object unpickles in another process."""
    cls = _STATS.get(base)
    if cls is not None:
        return cls

    class KvplanMooncakeKVConnectorStats(PlanStats, base):  # type: ignore[misc]
        def __post_init__(self) -> None:
            super().__post_init__()  # vLLM's: the lock, and reset() when data is empty
            data = self.data
            for key in KVPLAN_KEYS:
                data.setdefault(key, [])

        def reset(self) -> None:
            super().reset()
            for key in KVPLAN_KEYS:
                self.data[key] = []

        def clone_and_reset(self) -> Any:
            with self._lock:
                snapshot = {key: list(values) for key, values in self.data.items()}
                self.reset()
            return type(self)(data=snapshot)

        def is_empty(self) -> bool:
            return (bool(super().is_empty()) and not self.data[PLAN_TIME_KEY]
                    and not self.data[STAGED_ROUNDS_KEY]
                    and not self.data.get(LAYOUT_INFO_KEY))

        def aggregate(self, other: Any) -> Any:
            if not other.is_empty():
                for key, values in other.data.items():
                    self.data.setdefault(key, []).extend(values)
            return self

        def reduce(self) -> dict[str, int | float]:
            out: dict[str, int | float] = super().reduce()
            times = self.data[PLAN_TIME_KEY]
            n = len(times)
            out["Avg kvplan plan time (ms)"] = round(sum(times) / n * 1e3, 3) if n else 0
            out["Avg kvplan blocks per request"] = (
                round(sum(self.data[BLOCKS_KEY]) / n, 1) if n else 0)
            staged = self.data[STAGED_ROUNDS_KEY]
            if staged:  # the line stays as it was where nothing went staged
                out["Avg kvplan staged network blocks per request"] = round(
                    sum(self.data[STAGED_BLOCKS_KEY]) / len(staged), 1)
                out["Avg kvplan staged rounds per request"] = round(
                    sum(staged) / len(staged), 1)
            return out

        def __reduce__(self) -> tuple[Any, ...]:
            return (_rebuild_stats, (base.__module__, base.__qualname__, self.data))

    KvplanMooncakeKVConnectorStats.__module__ = __name__
    KvplanMooncakeKVConnectorStats.__qualname__ = "KvplanMooncakeKVConnectorStats"
    _STATS[base] = KvplanMooncakeKVConnectorStats
    return KvplanMooncakeKVConnectorStats


def _vllm_class(module: str, qualname: str) -> Any:
    """vLLM's class of that module and qualified name (a pickled stats object's base)."""
    base: Any = importlib.import_module(module)
    for part in qualname.split("."):
        base = getattr(base, part)
    return base


def _rebuild_stats(module: str, qualname: str, data: dict[str, list[Any]]) -> Any:
    """Unpickles a stats object: the class derived from vLLM's stats class of that name."""
    return stats_class(_vllm_class(module, qualname))(data=data)


def _per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]]) -> dict[int, Any]:
    return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}


def _drop_kvplan_collectors() -> None:
    """Unregister kvplan's collectors from prometheus_client's default registry, as vLLM does
    for its own ``vllm:`` ones before it builds its metrics again (the same names would be
    refused as duplicates)."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    for collector in list(getattr(REGISTRY, "_collector_to_names", {})):
        if str(getattr(collector, "_name", "")).startswith("kvplan:"):
            REGISTRY.unregister(collector)


_PROM: dict[tuple[type, bool], type] = {}


def prom_metrics_class(connector_module: Any) -> type:
    """The Prometheus class of kvplan's connector for vLLM's Mooncake connector module
    ``connector_module``: vLLM's ``MooncakePromMetrics`` plus kvplan's two histograms where
    the module has it; where it has not, the generic ``KVConnectorPromMetrics`` with vLLM's
    six Mooncake series (0.33's names and buckets) and kvplan's two histograms."""
    vllm_prom = getattr(connector_module, "MooncakePromMetrics", None)
    if vllm_prom is not None:
        base, vllm_observes = vllm_prom, True
    else:
        metrics = sys.modules[connector_module.KVConnectorStats.__module__]
        base, vllm_observes = metrics.KVConnectorPromMetrics, False
    cls = _PROM.get((base, vllm_observes))
    if cls is not None:
        return cls

    class KvplanMooncakePromMetrics(base):  # type: ignore[misc,valid-type]
        """Prometheus series of kvplan's Mooncake connector (observes the stats dict)."""

        def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                     labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            _drop_kvplan_collectors()
            histograms = _KVPLAN_HISTOGRAMS if vllm_observes else (
                _VLLM_HISTOGRAMS + _KVPLAN_HISTOGRAMS)
            self._kvplan_histograms = [
                (key, _per_engine(self._histogram_cls(
                    name=name, documentation=doc, buckets=buckets, labelnames=labelnames),
                    per_engine_labelvalues))
                for key, name, doc, buckets in histograms]
            self._kvplan_counters = [] if vllm_observes else [
                (key, _per_engine(self._counter_cls(
                    name=name, documentation=doc, labelnames=labelnames),
                    per_engine_labelvalues))
                for key, name, doc in _VLLM_COUNTERS]
            self._kvplan_layout_info = LayoutInfoGauge(self, labelnames,
                                                       per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            if vllm_observes:
                super().observe(transfer_stats_data, engine_idx)
            for key, per_engine in self._kvplan_histograms:
                child = per_engine[engine_idx]
                for value in transfer_stats_data.get(key, ()):
                    child.observe(value)
            for key, per_engine in self._kvplan_counters:
                events = sum(transfer_stats_data.get(key, ()))  # each failure is one 1
                if events:
                    per_engine[engine_idx].inc(events)
            self._kvplan_layout_info.observe(transfer_stats_data, engine_idx)

    KvplanMooncakePromMetrics.__module__ = __name__
    KvplanMooncakePromMetrics.__qualname__ = "KvplanMooncakePromMetrics"
    _PROM[(base, vllm_observes)] = KvplanMooncakePromMetrics
    return KvplanMooncakePromMetrics


class LayoutInfoGauge:
    """The ``kvplan:layout_info`` gauge of a connector's Prometheus class (vLLM's label names
    and values per engine, then ``class_id``, ``layout_id``, ``role``), set from the stats
    dict's :data:`LAYOUT_INFO_KEY` entries."""

    def __init__(self, prom: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        self._engine_labels = dict(per_engine_labelvalues)
        self._gauge = prom._gauge_cls(
            name=LAYOUT_INFO_METRIC, documentation=LAYOUT_INFO_HELP,
            labelnames=[*labelnames, *LAYOUT_INFO_LABELS], multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int) -> None:
        for entry in transfer_stats_data.get(LAYOUT_INFO_KEY, ()):
            class_id, layout_id, role = (str(x) for x in entry)
            self._gauge.labels(*self._engine_labels.get(engine_idx, ()), class_id, layout_id,
                               role).set(1)


_NIXL_STATS: dict[type, type] = {}


def nixl_stats_class(base: type) -> type:
    """The stats class of kvplan's NIXL connector: ``base`` (a vLLM module's
    ``NixlKVConnectorStats``) with the ``kvplan:layout_info`` column. ``is_empty`` is false
    while an identity is recorded; ``aggregate`` extends every column of the other object
    (vLLM's asserts that this object has each one); instances pickle by the base class's module
    and name, as :func:`stats_class`'s do."""
    cls = _NIXL_STATS.get(base)
    if cls is not None:
        return cls

    class KvplanNixlKVConnectorStats(LayoutStats, base):  # type: ignore[misc]
        def reset(self) -> None:
            super().reset()
            self.data[LAYOUT_INFO_KEY] = []

        def is_empty(self) -> bool:
            return bool(super().is_empty()) and not self.data.get(LAYOUT_INFO_KEY)

        def aggregate(self, other: Any) -> Any:
            if not other.is_empty():
                for key, values in other.data.items():
                    self.data.setdefault(key, []).extend(values)
            return self

        def __reduce__(self) -> tuple[Any, ...]:
            return (_rebuild_nixl_stats, (base.__module__, base.__qualname__, self.data))

    KvplanNixlKVConnectorStats.__module__ = __name__
    KvplanNixlKVConnectorStats.__qualname__ = "KvplanNixlKVConnectorStats"
    _NIXL_STATS[base] = KvplanNixlKVConnectorStats
    return KvplanNixlKVConnectorStats


def _rebuild_nixl_stats(module: str, qualname: str, data: dict[str, list[Any]]) -> Any:
    """Unpickles a NIXL stats object, as :func:`_rebuild_stats` does."""
    return nixl_stats_class(_vllm_class(module, qualname))(data=data)


_NIXL_PROM: dict[type, type] = {}


def nixl_prom_metrics_class(base: type) -> type:
    """The Prometheus class of kvplan's NIXL connector: ``base`` (vLLM's ``NixlPromMetrics``)
    with the ``kvplan:layout_info`` gauge."""
    cls = _NIXL_PROM.get(base)
    if cls is not None:
        return cls

    class KvplanNixlPromMetrics(base):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                     labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            _drop_kvplan_collectors()
            self._kvplan_layout_info = LayoutInfoGauge(self, labelnames,
                                                       per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            super().observe(transfer_stats_data, engine_idx)
            self._kvplan_layout_info.observe(transfer_stats_data, engine_idx)

    KvplanNixlPromMetrics.__module__ = __name__
    KvplanNixlPromMetrics.__qualname__ = "KvplanNixlPromMetrics"
    _NIXL_PROM[base] = KvplanNixlPromMetrics
    return KvplanNixlPromMetrics
