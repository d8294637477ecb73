"""Layout identities checked at the drop-ins' handshakes (docs/identity.md, "At the handshake")
and exported as ``kvplan:layout_info``.

vLLM: vLLM's real ``MooncakeConnectorWorker`` with kvplan installed and real Mooncake TCP
loopback engines (as tests/compat/test_vllm_staging.py builds them). Each worker's identity is
computed from its own registered regions and the config attributes vLLM's worker has
(``block_size``, ``model_config``, ``vllm_config``); the decode's identity reaches the prefill
in its pull request, as kvplan's decoder reads it. The prefill's real ``_build_transfer_params``
refuses every request to an incompatible decode through vLLM's failed-request path; the decode
refuses an incompatible prefill's opening message.

SGLang: SGLang 0.5.23's real ``MooncakeKVManager`` with kvplan installed and staging attached
on both peers over Mooncake loopback (as tests/compat/test_sglang_rounds.py builds them). The
decode's identity travels in its registration frame, read by the prefill's hooked
``_publish_peer_registration`` (SGLang's own method underneath), which rejects the session
SGLang's way: every transfer to it concludes failed before a byte moves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import queue
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

import kvplan  # noqa: E402
from kvplan import IncompatiblePeerError, Layout, ModelSemantics, layout_identity  # noqa: E402
from kvplan.identity import (  # noqa: E402
    IDENTITY_KEY,
    PeerCheck,
    identity_from_message,
    identity_message,
)
from support.log_records import records  # noqa: E402

ROPE_1 = {"rope_type": "yarn", "factor": 1.0}
ROPE_2 = {"rope_type": "yarn", "factor": 2.0}
SEMANTICS = ModelSemantics(model="org/model", revision="abc123", rope=ROPE_1, transfer="push")




def _mha(base: int, memory_order: str = "NHD") -> Layout:
    item = 16 * 8 * 128 * 2
    mb = 1 << 24
    return Layout.mha([base, base + mb], [base + 2 * mb, base + 3 * mb], [64 * item] * 2,
                      [64 * item] * 2, item, item, [0, 1], page_size=16, kv_heads=8,
                      head_dim=128, dtype_size=2, memory_order=memory_order,
                      num_model_layers=2)


# ------------------------------------------------------------------------- the wire form
def test_identity_message_round_trips_through_json() -> None:
    mine = layout_identity(_mha(1 << 32), SEMANTICS)
    message = json.loads(json.dumps(identity_message(mine)))
    back = identity_from_message(message)
    assert back is not None
    assert (back.class_id, back.layout_id) == (mine.class_id, mine.layout_id)
    assert identity_from_message({**message, "version": 99}) is None  # another kvplan


def test_identity_message_whose_ids_are_not_its_fields_is_refused() -> None:
    message = identity_message(layout_identity(_mha(1 << 32), SEMANTICS))
    other = layout_identity(_mha(1 << 32), dataclasses.replace(SEMANTICS, revision="x"))
    message["class_id"] = other.class_id
    with pytest.raises(IncompatiblePeerError, match=other.class_id) as info:
        identity_from_message(message, peer="peer d0")
    assert info.value.refused_by == "identity" and info.value.peer == "peer d0"
    with pytest.raises(IncompatiblePeerError, match="does not parse"):
        identity_from_message({"version": 1, "class_id": "kvc1-x"})


def test_peer_check_conversion_refused_unless_the_path_converts() -> None:
    nhd = layout_identity(_mha(1 << 32), SEMANTICS)
    hnd = identity_message(layout_identity(_mha(1 << 40, "HND"), SEMANTICS))
    log = logging.getLogger("kvplan.test.identity")
    with records("kvplan.test.identity") as said:
        with pytest.raises(IncompatiblePeerError, match="HND") as info:
            PeerCheck(nhd, log).check("d0", hnd, local_role="prefill")
        verdict = PeerCheck(nhd, log, converts=True).check("d0", hnd, local_role="prefill")
    assert info.value.refused_by == "conversion"
    assert verdict is not None and verdict.kind == "plannable_with_conversion"
    assert [r.levelno for r in said] == [logging.ERROR, logging.WARNING]


# ------------------------------------------------------------------------------- vLLM
NUM_BLOCKS = 64
LAYERS = 2
SENTINEL = 0xA5
NEGOTIATION_LOGGER = "vllm.kvplan.staging"


@pytest.fixture(scope="module")
def v() -> Any:
    from support.vllm_loader import load_vllm

    return load_vllm()


@pytest.fixture(scope="module")
def patched(v: Any) -> Any:
    from kvplan.compat import vllm as compat

    cls = type("IdentityWorker", (v.MooncakeConnectorWorker,), {})
    compat.install(cls)
    yield cls
    compat.uninstall(cls)


class Engine:
    """One Mooncake TCP engine on 127.0.0.1 and the memory registered with it."""

    def __init__(self) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.port = int(self.engine.get_rpc_port())
        self.session = f"127.0.0.1:{self.port}"
        self.registered: list[np.ndarray] = []
        self.stagings: list[Any] = []

    def register(self, array: np.ndarray) -> None:
        assert self.engine.register_memory(array.ctypes.data, array.nbytes) == 0
        self.registered.append(array)

    def close(self) -> None:
        for staging in self.stagings:
            staging.close()
        for array in self.registered:
            self.engine.unregister_memory(array.ctypes.data)


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Any:
    from support.engine_peers import require_mooncake

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    monkeypatch.delenv("KVPLAN_MOONCAKE_NATIVE", raising=False)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    prefill, decode = Engine(), Engine()
    yield prefill, decode
    prefill.close()
    decode.close()


def vllm_config(role: str, *, revision: str = "abc123", rope: Any = ROPE_1) -> Any:
    """The attributes of vLLM's ``VllmConfig`` the identity reads (vLLM 0.32's names)."""
    model_config = types.SimpleNamespace(
        model="org/model", revision=revision, get_total_num_kv_heads=lambda: 2,
        hf_text_config=types.SimpleNamespace(rope_scaling=dict(rope), rope_theta=10000.0))
    return types.SimpleNamespace(
        model_config=model_config, speculative_config=None,
        kv_transfer_config=types.SimpleNamespace(kv_role=role, kv_connector_extra_config={}))


class Side:
    """One MHA worker (two heads; K and V regions per layer) in one registered array."""

    def __init__(self, v: Any, cls: type, engine: Engine, config: Any, seed: int | None,
                 *, tp_rank: int = 0, tp_size: int = 1) -> None:
        from support.vllm_cases import make_worker

        total_heads, head_bytes = 2, 64
        heads = max(1, total_heads // tp_size)
        self.kv = 16 * heads * head_bytes
        self.region_bytes = NUM_BLOCKS * self.kv
        n_regions = 2 * LAYERS
        self.memory = (np.random.default_rng(seed).integers(0, 256, n_regions *
                                                             self.region_bytes, dtype=np.uint8)
                       if seed is not None else
                       np.full(n_regions * self.region_bytes, SENTINEL, np.uint8))
        engine.register(self.memory)
        base = int(self.memory.ctypes.data)
        spec = v.kvi.FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head_bytes,
                                       dtype=None, state_content_bytes=head_bytes)
        names = {i: f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)}
        regions, buffers = [], []
        for r in range(n_regions):
            addr = base + r * self.region_bytes
            regions.append((addr, self.kv, self.kv, names[r // 2], r // 2, 0))
            buffers.append((addr, self.region_bytes))
        self.worker = make_worker(
            v, cls, tp_rank=tp_rank, tp_size=tp_size, use_mla=False,
            total_kv_heads=total_heads,
            group_specs=[spec], layer_groups={names[i]: 0 for i in range(LAYERS)},
            regions=regions, buffers=buffers, num_blocks=NUM_BLOCKS, engine=engine.engine)
        # what vLLM's worker __init__ sets from its config
        self.worker.__dict__.update(hostname="127.0.0.1", rpc_port=engine.port, block_size=16,
                                    vllm_config=config, model_config=config.model_config)


def start(side: Side, engine: Engine) -> Any:
    from kvplan.compat.vllm import connector
    from kvplan.compat.vllm import staging as vstaging
    from kvplan.staging import StagingConfig

    config = StagingConfig.from_options({"kvplan_staging": "always",
                                         "kvplan_staging_arena_mib": 1,
                                         "kvplan_staging_timeout_s": 30})
    staging = vstaging.WorkerStaging.start(side.worker, config, engine=engine.engine)
    engine.stagings.append(staging)
    staging.name = engine.session
    # as the connector's start-up sets it
    staging.identity = PeerCheck(connector.identity_source(side.worker),
                                 logging.getLogger(NEGOTIATION_LOGGER))
    side.worker.__dict__[vstaging.STAGING_ATTR] = staging
    return staging


class Loopback:
    """The prefill's channel to the decode's staging in this process."""

    def __init__(self, prefill: Any, decode: Any, decode_worker: Any) -> None:
        self.prefill, self.decode, self.decode_worker = prefill, decode, decode_worker

    def send(self, data: bytes) -> None:
        self.decode.router.deliver(data)

    def open(self, data: bytes) -> None:
        self.decode.on_open(self.decode_worker, data, self.prefill.router.deliver)


def pull(prefill: Side, decode: Side, d_staging: Any, requests: dict[str, Any], *,
         identity: bool = True) -> tuple[Any, list[Any]]:
    """The decode's pull request as kvplan's decoder gives it to the prefill."""
    from support.vllm_cases import xfer_meta

    req_blocks = {r: (f"t-{r}", [remote]) for r, (_, remote) in requests.items()}
    meta = xfer_meta(decode.worker, tp_rank=0, tp_size=1, pp_size=1, req_blocks=req_blocks)
    meta.remote_port = decode.worker.rpc_port
    meta.kvplan_staging = d_staging.capabilities()
    setattr(meta, IDENTITY_KEY, d_staging.identity_message() if identity else None)
    ready = [(r, types.SimpleNamespace(local_block_ids=[local]))
             for r, (local, _) in requests.items()]
    return meta, ready


def kvplan_send(v: Any, prefill: Side, meta: Any, ready: list[Any]) -> Any:
    from support.vllm_cases import run_coroutine

    w = prefill.worker
    local, remote, err = w._prepare_transfer_regions(meta)
    assert err is None, err
    return run_coroutine(type(w)._build_transfer_params(w, ready, meta, local, remote))


def vllm_oracle(v: Any, prefill: Side, decode: Side, meta: Any, ready: list[Any]) -> np.ndarray:
    """The decode memory after vLLM's own (unpatched) plan of ``ready``."""
    from support.vllm_cases import run_coroutine

    w = prefill.worker
    local, remote, err = w._prepare_transfer_regions(meta)
    assert err is None, err
    src, dst, lengths, err_reqs, _ = run_coroutine(
        v.MooncakeConnectorWorker._build_transfer_params(w, ready, meta, local, remote))
    assert not err_reqs
    want = decode.memory.copy()
    base = int(decode.memory.ctypes.data)
    for s, d, n in zip(src, dst, lengths):
        want[d - base:d - base + n] = np.frombuffer((ctypes.c_uint8 * n).from_address(s),
                                                    np.uint8)
    return want


REQUESTS = {"req-a": (list(range(1, 21)), list(range(30, 50)))}


def _pair(v: Any, patched: Any, engines: Any, decode_config: Any,
          monkeypatch: pytest.MonkeyPatch, decode_order: str | None = None
          ) -> tuple[Side, Side, Any, Any]:
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, vllm_config("kv_producer"), seed=3)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, decode_config, seed=None)
    p_staging, d_staging = start(prefill, p_engine), start(decode, d_engine)
    assert p_staging.identity.local is not None  # computed now, as at the first handshake
    if decode_order is not None:  # the decode's vLLM runs with another KV cache layout
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", decode_order)
    assert d_staging.identity.local is not None
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    p_staging.channels[d_engine.session] = Loopback(p_staging, d_staging, decode.worker)
    return prefill, decode, p_staging, d_staging


@pytest.mark.mooncake
@pytest.mark.parametrize("case, decode_kw, order, values", [
    ("memory order swapped", {}, "HND", ("NHD", "HND")),
    ("RoPE factor 1 -> 2", {"rope": ROPE_2}, None, ('"factor\\":1', '"factor\\":2')),
    ("two revisions", {"revision": "def456"}, None, ('"abc123"', '"def456"')),
])
def test_vllm_prefill_refuses_an_incompatible_decode(
        v: Any, patched: Any, engines: Any, monkeypatch: pytest.MonkeyPatch, case: str,
        decode_kw: dict[str, Any], order: str | None, values: tuple[str, str]) -> None:
    prefill, decode, p_staging, d_staging = _pair(
        v, patched, engines, vllm_config("kv_consumer", **decode_kw), monkeypatch, order)
    p_class = p_staging.identity.local.class_id
    d_class = d_staging.identity.local.class_id
    assert p_class != d_class
    meta, ready = pull(prefill, decode, d_staging, REQUESTS)
    with records(NEGOTIATION_LOGGER) as said:
        for _ in range(2):
            src, _, _, err_reqs, err_msg = kvplan_send(v, prefill, meta, ready)
            assert err_reqs == ["req-a"] and len(src) == 0
            assert "IncompatiblePeerError" in err_msg
            assert p_class in err_msg and d_class in err_msg
            for value in values:
                assert value in err_msg, (value, err_msg)
    refusals = [r for r in said if r.levelno == logging.ERROR
                and r.getMessage().startswith("kvplan refuses transfers with peer")]
    assert len(refusals) == 1, [r.getMessage() for r in said]  # once, loudly
    assert np.all(decode.memory == SENTINEL)  # not a byte moved
    assert d_staging.stream("req-a@tp0") is None  # no stream was opened


@pytest.mark.mooncake
def test_vllm_equal_identities_proceed(v: Any, patched: Any, engines: Any,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode, p_staging, d_staging = _pair(
        v, patched, engines, vllm_config("kv_consumer"), monkeypatch)
    assert p_staging.identity.local.class_id == d_staging.identity.local.class_id
    meta, ready = pull(prefill, decode, d_staging, REQUESTS)
    want = vllm_oracle(v, prefill, decode, meta, ready)
    with records(NEGOTIATION_LOGGER) as said:
        src, _, _, err_reqs, err_msg = kvplan_send(v, prefill, meta, ready)
    assert err_reqs == [] and err_msg is None and len(src) == 0  # sent staged
    assert d_staging.stream("req-a@tp0").loaded
    np.testing.assert_array_equal(decode.memory, want)
    assert not [r for r in said if r.levelno >= logging.WARNING]
    # the decode checked the prefill's identity from the opening message: compatible
    assert any("layout identities compatible" in r.getMessage() for r in said)


@pytest.mark.mooncake
def test_vllm_decode_without_an_identity_keeps_todays_path_said_once(
        v: Any, patched: Any, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode, p_staging, d_staging = _pair(
        v, patched, engines, vllm_config("kv_consumer", revision="def456"), monkeypatch)
    d_staging.identity = None  # an older kvplan decode: it neither sends nor checks one
    meta, ready = pull(prefill, decode, d_staging, REQUESTS, identity=False)
    want = vllm_oracle(v, prefill, decode, meta, ready)
    with records(NEGOTIATION_LOGGER) as said:
        for _ in range(2):
            decode.memory[:] = SENTINEL
            _, _, _, err_reqs, _ = kvplan_send(v, prefill, meta, ready)
            assert err_reqs == []
            np.testing.assert_array_equal(decode.memory, want)
    none = [r.getMessage() for r in said if "sent no layout identity" in r.getMessage()]
    assert len(none) == 1, [r.getMessage() for r in said]
    assert decode.worker.rpc_port and str(decode.worker.rpc_port) in none[0]


@pytest.mark.mooncake
def test_vllm_decode_refuses_an_incompatible_prefills_stream(
        v: Any, patched: Any, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode did not send its identity (so the prefill's check passes, as with an
    older kvplan decode), but it checks the prefill's: refused, the stream fails before a
    round is granted, and the prefill's request takes vLLM's failed-request path."""
    prefill, decode, p_staging, d_staging = _pair(
        v, patched, engines, vllm_config("kv_consumer", rope=ROPE_2), monkeypatch)
    meta, ready = pull(prefill, decode, d_staging, REQUESTS, identity=False)
    with records(NEGOTIATION_LOGGER) as said:
        _, _, _, err_reqs, err_msg = kvplan_send(v, prefill, meta, ready)
    assert err_reqs == ["req-a"]
    assert "IncompatiblePeerError" in err_msg and "bad_message" in err_msg
    assert np.all(decode.memory == SENTINEL)
    refusals = [r.getMessage() for r in said if r.levelno == logging.ERROR
                and r.getMessage().startswith("kvplan refuses transfers with peer")]
    assert len(refusals) == 1 and "(here)" in refusals[0]
    assert p_staging.identity.local.class_id in refusals[0]


@pytest.mark.mooncake
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2)])
def test_vllm_identities_of_tp_pairs_vllm_plans_are_not_refused(
        v: Any, patched: Any, engines: Any, p_tp: int, d_tp: int) -> None:
    """Workers of other TP sizes have other classes, and every rank pair is plannable: the
    identity publishes the heads, so a TP pair is never refused for want of them."""
    p_engine, d_engine = engines
    decodes = [Side(v, v.MooncakeConnectorWorker, d_engine, vllm_config("kv_consumer"),
                    seed=None, tp_rank=r, tp_size=d_tp) for r in range(d_tp)]
    prefills = [Side(v, patched, p_engine, vllm_config("kv_producer"), seed=r, tp_rank=r,
                     tp_size=p_tp) for r in range(p_tp)]
    from kvplan.compat.vllm import staging as vstaging

    d_ids = [vstaging.worker_identity(d.worker) for d in decodes]
    p_ids = [vstaging.worker_identity(p.worker) for p in prefills]
    assert len({i.class_id for i in d_ids}) == 1 and len({i.class_id for i in p_ids}) == 1
    assert (p_ids[0].class_id == d_ids[0].class_id) == (p_tp == d_tp)
    for p_id in p_ids:
        for d_id in d_ids:
            verdict = kvplan.compatibility(p_id, d_id)
            assert verdict.kind == "plannable", verdict.reason


def test_vllm_pull_request_carries_the_identity_without_staging() -> None:
    """A decode whose KV cache cannot take staged rounds advertises no staging message, and
    still sends its identity: the prefill checks it on the direct path."""
    from kvplan.compat.vllm import staging as vstaging

    class Metadata:
        pass

    sent: list[Any] = []
    inner = types.SimpleNamespace(encode=lambda obj: sent.append(obj) or b"x")
    msgspec = types.SimpleNamespace(to_builtins=lambda obj: {"vllm": "fields"})
    mine = identity_message(layout_identity(_mha(1 << 32), SEMANTICS))
    encoder = vstaging.AdvertisingEncoder(inner, Metadata, msgspec, lambda: None, lambda: mine)
    encoder.encode(Metadata())
    encoder.encode("a response")
    assert sent == [{"vllm": "fields", IDENTITY_KEY: mine}, "a response"]


# ------------------------------------------------------------------------------ metrics
def test_vllm_layout_info_metric(v: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker records its identity once its KV cache is known (the connector's identity
    source); the stats ship it; the front end's Prometheus class sets the gauge."""
    import functools

    import prometheus_client

    from kvplan.compat import vllm as compat
    from kvplan.compat.vllm import connector
    from kvplan.compat.vllm import metrics as vmetrics

    cls = compat.KvplanMooncakeConnector
    worker = types.SimpleNamespace(xfer_stats=cls.build_kv_connector_stats())
    mine = layout_identity(_mha(1 << 32), SEMANTICS)
    worker.__dict__["vllm_config"] = vllm_config("kv_both")
    stats_module = types.SimpleNamespace(worker_identity=lambda w: mine,
                                         worker_roles=connector.staging_module().worker_roles)
    source = connector.identity_source(worker)
    monkeypatch.setattr(connector, "staging_module", lambda: stats_module)
    assert source() is mine
    stats = worker.xfer_stats
    assert not stats.is_empty()  # shipped to the front end with the next stats
    shipped = stats.clone_and_reset().data
    assert shipped[vmetrics.LAYOUT_INFO_KEY] == [[mine.class_id, mine.layout_id, "prefill"],
                                                 [mine.class_id, mine.layout_id, "decode"]]
    registry = prometheus_client.CollectorRegistry()
    types_ = {prometheus_client.Gauge: functools.partial(prometheus_client.Gauge,
                                                         registry=registry),
              prometheus_client.Counter: functools.partial(prometheus_client.Counter,
                                                           registry=registry),
              prometheus_client.Histogram: functools.partial(prometheus_client.Histogram,
                                                             registry=registry)}
    config = types.SimpleNamespace(kv_transfer_config=None)
    prom = cls.build_prom_metrics(config, types_, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(shipped, 0)
    for role in ("prefill", "decode"):
        assert registry.get_sample_value(vmetrics.LAYOUT_INFO_METRIC, {
            "model_name": "m", "engine": "0", "class_id": mine.class_id,
            "layout_id": mine.layout_id, "role": role}) == 1.0


def test_sglang_layout_info_metric_in_the_merged_metrics(tmp_path: Path) -> None:
    """In a scheduler process with SGLang's metrics on, as tests/compat/test_sglang_metrics.py
    records them, read back with the multi-process collector SGLang's ``/metrics`` uses."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    code = textwrap.dedent("""
        from kvplan.compat.sglang import metrics
        metrics.note_layout("kvc1-a", "kvl1-a0", "prefill")
        metrics.note_layout("kvc1-a", "kvl1-a0", "prefill")  # noted once
        print(metrics.layout_info())
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == str([{"class_id": "kvc1-a", "layout_id": "kvl1-a0",
                                "role": "prefill", "engine": "sglang"}])
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    samples = [s for m in registry.collect() for s in m.samples
               if s.name == "kvplan:layout_info"]
    assert [(s.labels, s.value) for s in samples] == [
        ({"class_id": "kvc1-a", "layout_id": "kvl1-a0", "role": "prefill",
          "engine": "sglang"}, 1.0)]


# ------------------------------------------------------------------------------ SGLang
@pytest.fixture(scope="module")
def sg() -> Any:
    from support.engine_peers import require_mooncake
    from support.sglang_models import load_loader, load_sglang_or_fail

    from kvplan.compat import sglang as compat

    require_mooncake()
    sg = load_sglang_or_fail()
    load_loader().load_head_slicing(sg)
    compat.install(sg.MooncakeKVManager)
    yield sg
    compat.uninstall(sg.MooncakeKVManager)


class Listener:
    def __init__(self) -> None:
        self.q: queue.Queue[bytes | None] = queue.Queue()
        self.handler: Callable[[bytes], None] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (data := self.q.get()) is not None:
            assert self.handler is not None
            self.handler(data)

    def stop(self) -> None:
        self.q.put(None)
        self.thread.join(10)


class SgPeer:
    """One rank: its MLA pools in one host array registered with its own Mooncake engine."""

    def __init__(self, n: int, entry_bytes: int, seed: int | None) -> None:
        from kvplan.engines import MooncakeTransport

        self.memory = (np.random.default_rng(seed).integers(0, 256, n * entry_bytes,
                                                            dtype=np.uint8)
                       if seed is not None else np.zeros(n * entry_bytes, np.uint8))
        base = int(self.memory.ctypes.data)
        self.ptrs = [base + e * entry_bytes for e in range(n)]
        self.lens = [entry_bytes] * n
        self.transport = MooncakeTransport("127.0.0.1")
        self.transport.register_buffers([base], [self.memory.nbytes])
        self.session = self.transport.local_session_id()
        self.listener = Listener()

    def close(self) -> None:
        self.listener.stop()
        self.transport.close()


class SgEngine:
    """What SGLang's ``MooncakeTransferEngine.batch_transfer_sync`` does."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport

    def batch_transfer_sync(self, session: str, src: list[int], dst: list[int],
                            lengths: list[int]) -> int:
        return int(self.transport._engine_write(session, src, dst, lengths))


SG_LAYERS, SG_ITEM, SG_CAP, SG_TOKENS = 4, 1152, 256, 100


def server_args(*, revision: str = "abc123", rope: Any = ROPE_1) -> Any:
    """The attributes of SGLang's ``ServerArgs`` the identity reads (0.5.23's names)."""
    return types.SimpleNamespace(model_path="org/model", revision=revision,
                                 speculative_draft_model_path=None,
                                 json_model_override_args=json.dumps({"rope_scaling": rope}))


@contextmanager
def sg_pair(sg: Any, decode_args: Any) -> Iterator[tuple[Any, ...]]:
    from support.sglang_models import load_loader

    from kvplan.compat.sglang import rounds
    from kvplan.staging import StagingConfig

    loader = load_loader()
    pre, dec = SgPeer(SG_LAYERS, SG_CAP * SG_ITEM, 11), SgPeer(SG_LAYERS, SG_CAP * SG_ITEM, None)
    peers = {pre.session: pre, dec.session: dec}

    def kv_args(p: SgPeer) -> Any:
        return types.SimpleNamespace(
            kv_data_ptrs=p.ptrs, kv_data_lens=p.lens, kv_item_lens=[SG_ITEM] * SG_LAYERS,
            kv_layer_ids=list(range(SG_LAYERS)), prefill_start_layer=0, engine_rank=0,
            mla_compression_ratios=None, num_draft_entries=0, page_size=1, aux_data_ptrs=[],
            state_types=[], state_data_ptrs=[], state_item_lens=[], state_layer_ids=[])

    info = types.SimpleNamespace(dst_kv_ptrs=dec.ptrs, dst_kv_item_lens=[SG_ITEM] * SG_LAYERS,
                                 dst_kv_layer_ids=list(range(SG_LAYERS)))
    pmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv_args(pre),
                                 engine=SgEngine(pre.transport), is_mla_backend=True, server_args=server_args(),
                                 decode_kv_args_table={dec.session: info},
                                 state_layout_rejections={}, session_lock=threading.Lock(),
                                 failed_sessions=set(), session_failures={},
                                 failed_session_probes={})
    dmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv_args(dec),
                                 is_mla_backend=True, server_args=decode_args)
    config = StagingConfig(mode="always", arena_mib=1, buffers=2, timeout_s=5.0)

    def send(peer: str, data: bytes) -> None:
        peers[peer].listener.q.put(bytes(data))

    stagings = []
    try:
        for mgr, peer in ((pmgr, pre), (dmgr, dec)):
            staging = rounds.attach(mgr, engine=peer.transport, send=send,
                                    reply_to=peer.session, config=config)
            peer.listener.handler = staging.deliver
            stagings.append(staging)
        yield pre, dec, pmgr, dmgr, stagings[0], stagings[1]
    finally:
        for staging in stagings:
            staging.stop()
        pre.close()
        dec.close()


def _registration(sg: Any, pmgr: Any, d: Any, session: str) -> Any:
    """The decode's registration frame through the prefill's hooked registration: the frame
    as ``KVArgsRegisterInfo.from_zmq`` reads it, then ``_publish_peer_registration``."""
    from kvplan.compat.sglang import rounds

    frame = d.registration_frame()
    assert frame.startswith(rounds.REGISTRATION_TAG)
    info = types.SimpleNamespace(kvplan_staging=json.loads(frame[len(rounds.REGISTRATION_TAG):]),
                                 dst_tp_rank=0, dst_aux_ptrs=[], dst_attn_tp_size=1)
    return pmgr._publish_peer_registration(session, info)


def _send(pmgr: Any, dec: SgPeer) -> int:
    from support.sglang_loader import InlineExecutor

    src = np.arange(SG_TOKENS, dtype=np.int32)
    dst = np.arange(SG_TOKENS, 2 * SG_TOKENS, dtype=np.int32)
    return int(pmgr.send_kvcache(dec.session, src, dec.ptrs, dst, InlineExecutor(),
                                 dst_layer_ids=list(range(SG_LAYERS))))


@pytest.mark.mooncake
@pytest.mark.parametrize("case, decode_kw, values", [
    ("RoPE factor 1 -> 2", {"rope": ROPE_2}, ('"factor\\":1', '"factor\\":2')),
    ("two revisions", {"revision": "def456"}, ('"abc123"', '"def456"')),
])
def test_sglang_prefill_rejects_an_incompatible_decode_at_registration(
        sg: Any, case: str, decode_kw: dict[str, Any], values: tuple[str, str]) -> None:
    with sg_pair(sg, server_args(**decode_kw)) as (pre, dec, pmgr, dmgr, p, d):
        with records("kvplan.compat.sglang") as said:
            for _ in range(2):  # SGLang re-registers a restarted decode: checked again
                verdict = _registration(sg, pmgr, d, dec.session)
        reason = pmgr.state_layout_rejections[dec.session]
        assert verdict == reason  # SGLang logs it and fails every transfer to the session
        assert "IncompatiblePeerError" not in reason and reason.startswith("kvplan refuses")
        assert p.identity.local.class_id in reason and d.identity.local.class_id in reason
        for value in values:
            assert value in reason, (value, reason)
        err = p.refused[dec.session]
        assert isinstance(err, IncompatiblePeerError) and isinstance(err, kvplan.KvPlanError)
        assert err.refused_by == "semantics" and err.local_role == "prefill"
        assert [r.levelno for r in said if "refuses" in r.getMessage()] == [logging.ERROR]
        assert _send(pmgr, dec) == -1  # a transfer reaching the drop-in fails too
        assert not dec.memory.any()  # not a byte moved


@pytest.mark.mooncake
def test_sglang_equal_identities_proceed_and_missing_one_is_said_once(sg: Any) -> None:
    with sg_pair(sg, server_args()) as (pre, dec, pmgr, dmgr, p, d):
        assert p.identity.local.class_id == d.identity.local.class_id
        assert _registration(sg, pmgr, d, dec.session) is None
        assert dec.session not in pmgr.state_layout_rejections
        assert _send(pmgr, dec) == 0
        assert p.last[dec.session][0] == "staged"
        want = pre.memory.reshape(SG_LAYERS, SG_CAP, SG_ITEM)[:, :SG_TOKENS]
        have = dec.memory.reshape(SG_LAYERS, SG_CAP, SG_ITEM)[:, SG_TOKENS:2 * SG_TOKENS]
        np.testing.assert_array_equal(have, want)
    with sg_pair(sg, server_args(revision="def456")) as (pre, dec, pmgr, dmgr, p, d):
        frame = d.registration_frame()
        from kvplan.compat.sglang import rounds

        older = json.loads(frame[len(rounds.REGISTRATION_TAG):])
        older.pop(IDENTITY_KEY)  # an older kvplan decode
        info = types.SimpleNamespace(kvplan_staging=older, dst_tp_rank=0, dst_aux_ptrs=[],
                                     dst_attn_tp_size=1)
        with records("kvplan.compat.sglang") as said:
            for _ in range(2):
                assert pmgr._publish_peer_registration(dec.session, info) is None
        none = [r for r in said if "sent no layout identity" in r.getMessage()]
        assert len(none) == 1, [r.getMessage() for r in said]
        d.identity = PeerCheck(None, logging.getLogger("kvplan.compat.sglang"))
        assert _send(pmgr, dec) == 0  # today's behaviour


@pytest.mark.parametrize("decode_kw", [{}, {"revision": "def456"}, {"rope": ROPE_2}])
def test_sglang_identity_is_exchanged_without_staging(sg: Any, decode_kw: dict[str, Any]
                                                      ) -> None:
    """With staging off (the start-up hook's ``exchange_identity``), the decode's registration
    frame carries its identity alone and the prefill's ``_publish_peer_registration`` checks
    it: an incompatible decode goes into SGLang's ``state_layout_rejections`` (SGLang fails
    every transfer to it), an equal one proceeds, and a decode without kvplan is said once."""
    from support.sglang_models import load_loader

    from kvplan.compat.sglang import rounds

    loader = load_loader()

    def manager(args: Any, **extra: Any) -> Any:
        kv = types.SimpleNamespace(
            kv_data_ptrs=[(1 << 32) * (e + 1) for e in range(SG_LAYERS)],
            kv_data_lens=[SG_CAP * SG_ITEM] * SG_LAYERS, kv_item_lens=[SG_ITEM] * SG_LAYERS,
            kv_layer_ids=list(range(SG_LAYERS)), prefill_start_layer=0, engine_rank=0,
            mla_compression_ratios=None, num_draft_entries=0, page_size=1, aux_data_ptrs=[],
            state_types=[], state_data_ptrs=[], state_item_lens=[], state_layer_ids=[])
        return loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv,
                                     is_mla_backend=True, server_args=args, **extra)

    session = "127.0.0.1:17000"
    info_table = {session: types.SimpleNamespace(
        dst_kv_ptrs=[0] * SG_LAYERS, dst_kv_item_lens=[SG_ITEM] * SG_LAYERS,
        dst_kv_layer_ids=list(range(SG_LAYERS)))}
    pmgr = manager(server_args(), decode_kv_args_table=info_table, state_layout_rejections={},
                   session_lock=threading.Lock(), failed_sessions=set(), session_failures={},
                   failed_session_probes={})
    p = rounds.exchange_identity(pmgr)
    d = rounds.exchange_identity(manager(server_args(**decode_kw)))
    frame = json.loads(d.registration_frame()[len(rounds.REGISTRATION_TAG):])
    assert set(frame) == {IDENTITY_KEY}  # no staging capabilities: a staged prefill goes direct
    verdict = _registration(sg, pmgr, d, session)
    if not decode_kw:
        assert verdict is None and session not in pmgr.state_layout_rejections
        assert p.identity.local.class_id == d.identity.local.class_id
    else:
        reason = pmgr.state_layout_rejections[session]
        assert verdict == reason and reason.startswith("kvplan refuses transfers with peer")
        assert p.identity.local.class_id in reason and d.identity.local.class_id in reason
        assert isinstance(p.refused[session], IncompatiblePeerError)
    # A decode without kvplan (no frame): today's path, its missing identity said once.
    plain = types.SimpleNamespace(dst_tp_rank=0, dst_aux_ptrs=[], dst_attn_tp_size=1)
    with records("kvplan.compat.sglang") as said:
        for _ in range(2):
            assert pmgr._publish_peer_registration("127.0.0.1:17001", plain) is None
    assert len([r for r in said if "sent no layout identity" in r.getMessage()]) == 1


@pytest.mark.mooncake
def test_sglang_decode_refuses_an_incompatible_prefills_open_message(sg: Any) -> None:
    with sg_pair(sg, server_args(revision="def456")) as (pre, dec, pmgr, dmgr, p, d):
        from kvplan.compat.sglang import rounds

        frame = json.loads(d.registration_frame()[len(rounds.REGISTRATION_TAG):])
        frame.pop(IDENTITY_KEY)  # the prefill sees no identity: it sends as before
        info = types.SimpleNamespace(kvplan_staging=frame, dst_tp_rank=0, dst_aux_ptrs=[],
                                     dst_attn_tp_size=1)
        assert pmgr._publish_peer_registration(dec.session, info) is None
        with records("kvplan.compat.sglang") as said:
            assert _send(pmgr, dec) == -1
        kind, err = p.last[dec.session]
        assert kind == "failed" and "IncompatiblePeerError" in str(err)
        refusals = [r.getMessage() for r in said if r.levelno == logging.ERROR
                    and r.getMessage().startswith("kvplan refuses transfers with peer")]
        assert len(refusals) == 1 and "(here)" in refusals[0]
        assert not dec.memory.any()


@pytest.mark.mooncake
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_sglang_identities_of_mha_tp_pairs_are_not_refused(sg: Any, p_tp: int,
                                                           d_tp: int) -> None:
    """MHA managers of other attention TP sizes (head-sliced by SGLang): the identity
    publishes SGLang's heads, so every rank pair is plannable; without the heads a manager
    has no identity rather than one that would refuse such a pair."""
    from support.sglang_models import load_loader

    from kvplan.compat.sglang import rounds

    loader = load_loader()
    heads, head_bytes, page, layers = 4, 128, 16, 3

    def manager(rank: int, tp: int, **drop: Any) -> Any:
        per_rank = max(1, heads // tp)
        item = page * per_rank * head_bytes
        fields = dict(kv_data_ptrs=[(1 << 32) * (e + 1) for e in range(2 * layers)],
                      kv_data_lens=[64 * item] * (2 * layers),
                      kv_item_lens=[item] * (2 * layers), kv_layer_ids=[], engine_rank=rank,
                      page_size=page, kv_head_num=per_rank, total_kv_head_num=heads)
        for name in drop:
            fields.pop(name)
        return loader.manager_object(sg, sg.MooncakeKVManager,
                                     kv_args=types.SimpleNamespace(**fields),
                                     attn_tp_size=tp, server_args=server_args())

    p_ids = [rounds.manager_identity(manager(r, p_tp)) for r in range(p_tp)]
    d_ids = [rounds.manager_identity(manager(r, d_tp)) for r in range(d_tp)]
    assert len({i.class_id for i in p_ids}) == 1 and len({i.class_id for i in d_ids}) == 1
    for p_id in p_ids:
        for d_id in d_ids:
            verdict = kvplan.compatibility(p_id, d_id)
            assert verdict.kind == "plannable", verdict.reason
    assert rounds.manager_identity(manager(0, p_tp, kv_head_num=None)) is None
    assert rounds.manager_identity(manager(0, p_tp, page_size=None)) is None


@pytest.mark.mooncake
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_a_sglang_decode_without_heads_in_kv_args_reads_them_from_its_model(
        sg: Any, tmp_path: Any, p_tp: int, d_tp: int) -> None:
    """SGLang's decode sets ``kv_head_num`` / ``total_kv_head_num`` only with its own
    hetero-TP staging on, so an MHA decode without it had no identity and nothing was checked.
    It now takes the model's KV heads from its local ``config.json`` and the core's per-rank
    rule: the same identity as a decode given the heads, plannable with every prefill rank; a
    config that names other heads is refused."""
    from support.sglang_models import load_loader

    from kvplan.compat.sglang import rounds

    loader = load_loader()
    heads, head_bytes, page, layers = 4, 128, 16, 3

    def model_dir(name: str, kv_heads: int) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(
            {"num_attention_heads": 8, "num_key_value_heads": kv_heads}))
        return str(path)

    def manager(rank: int, tp: int, model_path: str, *, with_heads: bool) -> Any:
        per_rank = max(1, heads // tp)
        item = page * per_rank * head_bytes
        fields = dict(kv_data_ptrs=[(1 << 32) * (e + 1) for e in range(2 * layers)],
                      kv_data_lens=[64 * item] * (2 * layers),
                      kv_item_lens=[item] * (2 * layers), kv_layer_ids=[], engine_rank=rank,
                      page_size=page)
        if with_heads:
            fields.update(kv_head_num=per_rank, total_kv_head_num=heads)
        args = server_args()
        args.model_path, args.served_model_name = model_path, "org/model"
        return loader.manager_object(sg, sg.MooncakeKVManager,
                                     kv_args=types.SimpleNamespace(**fields),
                                     attn_tp_size=tp, server_args=args)

    local = model_dir("local", heads)
    for r in range(d_tp):
        read = rounds.manager_identity(manager(r, d_tp, local, with_heads=False))
        given = rounds.manager_identity(manager(r, d_tp, local, with_heads=True))
        assert read is not None and read.layout_id == given.layout_id
        for q in range(p_tp):
            prefill = rounds.manager_identity(manager(q, p_tp, "org/model", with_heads=True))
            verdict = kvplan.compatibility(prefill, read)
            assert verdict.kind == "plannable", verdict.reason
    other = rounds.manager_identity(manager(0, d_tp, model_dir("other", 2 * heads),
                                            with_heads=False))
    prefill = rounds.manager_identity(manager(0, p_tp, "org/model", with_heads=True))
    assert other is not None and kvplan.compatibility(prefill, other).kind == "refused"

    # A hub id: the snapshot SGLang downloaded into the Hugging Face cache (no network).
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--model"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "abc123").write_text(commit)  # server_args' revision, a tag
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(
        {"num_attention_heads": 8, "num_key_value_heads": heads}))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_CACHE", str(cache))
        for r in range(d_tp):
            hub = rounds.manager_identity(manager(r, d_tp, "org/model", with_heads=False))
            given = rounds.manager_identity(manager(r, d_tp, "org/model", with_heads=True))
            assert hub is not None and hub.layout_id == given.layout_id
        assert rounds.manager_identity(manager(0, d_tp, "org/absent", with_heads=False)) is None
        pinned = manager(0, d_tp, "org/model", with_heads=False)
        pinned.server_args.revision = commit  # a commit: its snapshot, no ref read
        assert rounds.manager_identity(pinned) is not None
        pinned.server_args.revision = "v2"  # a revision the cache does not hold
        assert rounds.manager_identity(pinned) is None


def test_one_model_at_two_local_paths_is_one_model() -> None:
    """Two hosts keep one model's weights at their own local paths: the peers name it by the
    served name (vLLM's ``served_model_name``, SGLang's ``served_model_name``), else by the
    path's last part, so the paths alone never refuse a pair; another served name does."""
    from kvplan.compat.sglang.rounds import manager_semantics
    from kvplan.compat.vllm.staging import worker_semantics
    from kvplan.identity import model_name_of

    assert model_name_of("/models/Llama-3-8B/") == "Llama-3-8B"
    assert model_name_of("/mnt/cache/Llama-3-8B") == "Llama-3-8B"
    assert model_name_of("meta-llama/Llama-3-8B") == "meta-llama/Llama-3-8B"

    def vllm_at(path: str, served: Any) -> Any:
        config = vllm_config("kv_producer")
        config.model_config.model = path
        config.model_config.served_model_name = served
        return worker_semantics(config)

    assert vllm_at("/a/weights", "tiny").model == vllm_at("/b/other", ["tiny"]).model == "tiny"
    assert vllm_at("/a/Llama-3-8B", None).model == vllm_at("/b/Llama-3-8B/", None).model
    assert vllm_at("/a/weights", "tiny").model != vllm_at("/a/weights", "small").model

    def sglang_at(path: str, served: str | None) -> Any:
        args = server_args()
        args.model_path, args.served_model_name = path, served
        args.speculative_draft_model_path = path + "-draft"
        return manager_semantics(args)

    one, two = sglang_at("/a/Qwen3-8B", None), sglang_at("/b/Qwen3-8B", None)
    assert (one.model, one.drafts) == (two.model, two.drafts) == ("Qwen3-8B", ("Qwen3-8B-draft",))
    assert sglang_at("/a/x", "tiny").model == "tiny"


def test_a_rope_json_cannot_carry_leaves_only_the_rope_undeclared() -> None:
    """A RoPE value canonical JSON cannot write (NaN) is left undeclared; the draft, the
    cross-layer flag and the rest of the semantics are still declared (a draft on one side
    only must still be refused)."""
    from kvplan.compat.sglang.rounds import manager_semantics
    from kvplan.compat.vllm.staging import worker_semantics
    from kvplan.identity import declarable_rope

    bad = {"rope_type": "linear", "factor": float("nan")}
    assert declarable_rope(bad) is None and declarable_rope(dict(ROPE_1)) == dict(ROPE_1)
    config = vllm_config("kv_producer", rope=bad)
    config.speculative_config = types.SimpleNamespace(model="/models/draft-1b")
    config.kv_transfer_config.kv_connector_extra_config = {"enable_cross_layers_blocks": True}
    semantics = worker_semantics(config)
    assert (semantics.rope, semantics.drafts, semantics.cross_layer, semantics.revision) == (
        None, ("draft-1b",), True, "abc123")
    args = server_args(rope=bad)
    args.speculative_draft_model_path = "/models/draft-1b"
    sg = manager_semantics(args)
    assert (sg.rope, sg.drafts, sg.model) == (None, ("draft-1b",), "org/model")
