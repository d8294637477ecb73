"""kvplan's two series in a SGLang server's ``/metrics`` (``compat.sglang.metrics``).

SGLang exports Prometheus metrics in multi-process mode: each process writes its samples into
``PROMETHEUS_MULTIPROC_DIR`` and the HTTP server merges them. The recording runs in a child
process with that directory set, as a SGLang scheduler does, and the samples are read back
with ``prometheus_client``'s multi-process collector, as SGLang's ``/metrics`` reads them.
The drop-ins are run on SGLang's real manager class from the wheel: each transfer call
observes its plan once, with the blocks the engine was handed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvplan.compat import sglang as compat
from kvplan.compat.plan_series import BLOCKS_METRIC, PLAN_TIME_METRIC
from kvplan.compat.sglang import metrics
from support.sglang_models import SESSION, Deployment, engine_blocks, load_sglang_or_fail

prometheus_client = pytest.importorskip("prometheus_client")


def _record_in_child(env_dir: str | None, calls: list[tuple[float, int]]) -> str:
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if env_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = env_dir
    code = textwrap.dedent(f"""
        import prometheus_client
        from kvplan.compat.sglang import metrics
        for seconds, blocks in {calls!r}:
            metrics.observe(seconds, blocks)
        names = {{m.name for m in prometheus_client.REGISTRY.collect()}}
        print(sorted(n for n in names if n.startswith("kvplan")))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    return out.strip()


def _samples(directory: Path) -> dict[str, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {s.name: s.value for m in registry.collect() for s in m.samples
            if not s.labels or set(s.labels) == {"le"} and s.labels["le"] == "+Inf"}


def test_with_sglangs_metrics_on_both_series_reach_the_merged_metrics(tmp_path: Path) -> None:
    registered = _record_in_child(str(tmp_path), [(0.0002, 7), (0.0004, 61)])
    assert registered == str(sorted([BLOCKS_METRIC, PLAN_TIME_METRIC]))
    got = _samples(tmp_path)
    assert got[BLOCKS_METRIC + "_count"] == 2
    assert got[BLOCKS_METRIC + "_sum"] == 68
    assert got[PLAN_TIME_METRIC + "_count"] == 2
    assert got[PLAN_TIME_METRIC + "_sum"] == pytest.approx(0.0006)


def test_without_sglangs_metrics_nothing_is_registered() -> None:
    assert _record_in_child(None, [(0.0002, 7)]) == "[]"


@pytest.fixture(scope="module")
def sg() -> Any:
    return load_sglang_or_fail()


def test_each_transfer_call_observes_its_plan_once_with_the_engines_blocks(
        sg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[float, int]] = []
    monkeypatch.setattr(metrics, "observe", lambda s, n: seen.append((s, n)))
    dep = Deployment("mla", 4, list(range(4)), 1, 0)
    dptrs, _, dids = dep.dst_lists()
    compat.install(sg.MooncakeKVManager)
    try:
        for src in ([0, 1, 2, 3], [0, 2, 4, 6]):
            mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=dep.kv_args(),
                                    is_mla_backend=True, is_hybrid_mla_backend=False,
                                    pp_size=1,
                                    decode_kv_args_table={SESSION: dep.register_info()})
            pages = np.array(src, np.int32)
            assert mgr.send_kvcache(SESSION, pages, dptrs, pages, None,
                                    dst_layer_ids=dids) == 0
            blocks = len(engine_blocks(mgr.engine.calls))
            assert seen[-1][1] == blocks and seen[-1][0] >= 0
    finally:
        compat.uninstall(sg.MooncakeKVManager)
    # One observation per call: 4 layers in one run, then 4 layers x 4 single pages.
    assert [n for _, n in seen] == [4, 16]
