"""Layer-wise streaming over real engines: a prefill process streams layer-group slices of its
requests to a decode process (Mooncake over TCP loopback, NIXL over UCX) while a "forward"
thread signals layers in random order; the decode's whole arena is then checked byte for byte
against the byte oracle (``support.engine_peers.expected_decode``).

Covers: random ready order and device-event signals (synchronised on the submitter's thread),
a request whose slices fail (only it fails, naming the slice), a ready signal for an unknown
layer and one after close (clear errors), and a decode killed mid-stream (a TransferError in
bounded time, no transfer handle left).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvplan import WorkManifest
from kvplan.presets import ModelPreset, StateSpec
from kvplan.testing import model_peers
from support.engine_peers import Engine

DENSE = ModelPreset("tiny-dense-8", "tiny dense MLA", 8, "mla", 1152)
HYBRID = ModelPreset("tiny-hybrid-16", "tiny hybrid MLA", 16, "mla", 1152, 4,
                     (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))
PAGES = 64


@pytest.fixture(autouse=True)
def _engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")


def _requests(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
    """``n`` requests on disjoint fragmented decode pages and slots."""
    rng = np.random.default_rng(seed)
    dst = rng.permutation(PAGES)
    out = []
    for k in range(n):
        src = rng.permutation(PAGES)[:20].astype(np.int64)
        out.append((src, dst[20 * k: 20 * (k + 1)].astype(np.int64), k, k + 1))
    return out


def _spec(name: str, session: str, req: tuple[np.ndarray, np.ndarray, int, int]) -> dict[str, Any]:
    src, dst, ss, ds = req
    return {"name": name, "session": session, "src_pages": src, "dst_pages": dst,
            "src_slot": ss, "dst_slot": ds}


def _check_bytes(c: Any, decode: Any, stage: Any, before: np.ndarray, reqs: list[Any]) -> None:
    from support.engine_peers import assert_decode_bytes, expected_decode

    writes = [(stage, c.arenas[stage.name].array, src, dst, ss, ds) for src, dst, ss, ds in reqs]
    assert_decode_bytes(c.arenas["decode"].array, expected_decode(decode, before, writes), decode)


@pytest.mark.parametrize("preset,group_size", [(DENSE, 3), (HYBRID, 8)])
def test_random_ready_order_streams_every_byte(engine: Engine, preset: ModelPreset,
                                               group_size: int) -> None:
    peers = model_peers(preset, pages=PAGES, state_slots=4)
    decode, stage = peers.decode, peers.prefill[0]
    reqs = _requests(2, seed=5)
    order = np.random.default_rng(11).permutation(preset.num_layers).tolist()
    with engine.cluster(decode, [stage]) as c:
        before = c.arenas["decode"].array.copy()
        session = c.sessions[stage.name]
        out = c.peers[stage.name].call(
            "stream", c.peers["decode"].layout_wire,
            [_spec(f"r{k}", session, r) for k, r in enumerate(reqs)], group_size, order, 1.0,
            timeout=90)
        if engine.notifies:  # each request's notification comes with its last submission
            for k in range(len(reqs)):
                assert c.peers["decode"].call("wait_notification", c.peers[stage.name].session,
                                              f"r{k}".encode(), 30.0, timeout=60)
        _check_bytes(c, decode, stage, before, reqs)
    # Events are synchronised on the submitter's thread, never the forward's.
    assert out["sync_threads"] == ["kvplan-streaming"]
    n_groups = len({layer // group_size for layer in range(preset.num_layers)})
    for k in range(len(reqs)):
        r = out["requests"][f"r{k}"]
        assert r["ok"] and r["streamed"], r
        assert r["slices"] == n_groups
        manifest = WorkManifest.from_bytes(r["manifest"])
        assert (manifest.total_blocks, manifest.total_bytes) == (r["blocks"], r["bytes"])
        assert sum(1 for _, blocks, _ in manifest.slices if blocks) == n_groups
        if preset.hybrid:  # the state slots travel with their layers' groups, not the seal
            assert manifest.seal == (0, 0)
    assert out["live_handles"] == 0


def test_a_failing_slice_fails_only_its_request_and_signals_are_checked(
        engine: Engine) -> None:
    peers = model_peers(DENSE, pages=PAGES)
    decode, stage = peers.decode, peers.prefill[0]
    good, bad = _requests(2, seed=7)
    bogus = engine.unreachable_session
    with engine.cluster(decode, [stage]) as c:
        before = c.arenas["decode"].array.copy()
        out = c.peers[stage.name].call(
            "stream", c.peers["decode"].layout_wire,
            [_spec("good", c.sessions[stage.name], good), _spec("bad", bogus, bad)], 4,
            [3, 1, 0, 2, 7, 5, 6, 4], 20.0, 0, (), 30.0, True, timeout=90)
        _check_bytes(c, decode, stage, before, [good])  # nothing of "bad" landed
    assert out["requests"]["good"]["ok"], out["requests"]["good"]
    failed = out["requests"]["bad"]
    assert not failed["ok"]
    assert failed["slice"] == 0 and failed["layers"] == [0, 1, 2, 3]
    assert "request 'bad': slice 0 (layer group 0, layers 0-3) failed" in failed["error"]
    assert out["unknown_layer"].startswith("KvPlanError: layer 10000 is not a layer")
    assert "after close()" in out["after_close"]
    assert out["live_handles"] == 0


def test_decode_killed_mid_stream_fails_in_bounded_time(engine: Engine) -> None:
    peers = model_peers(DENSE, pages=PAGES)
    decode, stage = peers.decode, peers.prefill[0]
    (req,) = _requests(1, seed=9)
    with engine.cluster(decode, [stage]) as c:
        prefill = c.peers[stage.name]
        prefill.send("stream", c.peers["decode"].layout_wire,
                     [_spec("r", c.sessions[stage.name], req)], 1, list(range(8)), 250.0, 0,
                     (), 8.0)
        time.sleep(0.9)  # a few layers streamed
        c.peers["decode"].kill()
        t0 = time.perf_counter()
        out = prefill.result(60, "stream")
        elapsed = time.perf_counter() - t0
        handles = prefill.call("live_handles")
    r = out["requests"]["r"]
    assert not r["ok"], r
    assert r["slice"] is not None and "failed" in r["error"], r
    assert elapsed < 30, elapsed
    assert out["live_handles"] == 0 and handles == 0


@pytest.mark.nixl
def test_the_decode_tells_a_withheld_slice_from_a_complete_or_slow_request() -> None:
    from support.engine_peers import cluster, require_nixl

    require_nixl()
    peers = model_peers(HYBRID, pages=PAGES, state_slots=4)
    decode, stage = peers.decode, peers.prefill[0]
    lost, whole, slow = _requests(3, seed=13)
    order = list(range(HYBRID.num_layers))
    with cluster(decode, [stage], engine="nixl") as c:
        prefill, dpeer = c.peers[stage.name], c.peers["decode"]
        session, sender = c.sessions[stage.name], prefill.session
        # Slice 1 of "lost" is dropped on the way; the prefill's verdict still says sent.
        # Only slice 1's blocks are dropped, whatever submission the streamer put them in.
        out = prefill.call("stream", dpeer.layout_wire, [_spec("lost", session, lost)], 4,
                           order, 20.0, 0, (), 30.0, False, 1, timeout=90)
        assert out["requests"]["lost"]["ok"]
        got = dpeer.call("wait_stream", sender, b"lost", 30.0, timeout=60)
        assert got["state"] == "missing" and got["missing"] == [1], got
        assert "missing slice 1 (layer group 1, " in got["detail"]
        assert got["arrived"] == [0, 2, 3]
        before = c.arenas["decode"].array.copy()
        prefill.call("stream", dpeer.layout_wire, [_spec("whole", session, whole)], 4, order,
                     0.0, 0, (), 30.0, timeout=90)
        got = dpeer.call("wait_stream", sender, b"whole", 30.0, timeout=60)
        assert got["state"] == "complete" and got["arrived"] == [0, 1, 2, 3], got
        _check_bytes(c, decode, stage, before, [whole])
        # A request still streaming (200 ms per layer): in flight, not missing.
        prefill.send("stream", dpeer.layout_wire, [_spec("slow", session, slow)], 4, order,
                     200.0, 0, (), 30.0)
        got = dpeer.call("wait_stream", sender, b"slow", 0.3, timeout=60)
        assert got["state"] == "in_flight" and got["missing"] == [], got
        prefill.result(90, "stream")
        got = dpeer.call("wait_stream", sender, b"slow", 30.0, timeout=60)
        assert got["state"] == "complete", got


@pytest.mark.mooncake
def test_mooncake_final_notification_goes_through_the_side_channel() -> None:
    from support.engine_peers import cluster, require_mooncake

    require_mooncake()
    peers = model_peers(HYBRID, pages=PAGES, state_slots=4)
    decode, stage = peers.decode, peers.prefill[0]
    (req,) = _requests(1, seed=17)
    with cluster(decode, [stage], engine="mooncake") as c:
        before = c.arenas["decode"].array.copy()
        prefill, dpeer = c.peers[stage.name], c.peers["decode"]
        out = prefill.call("stream", dpeer.layout_wire, [_spec("r", c.sessions[stage.name], req)],
                           4, list(range(HYBRID.num_layers)), 0.0, timeout=90)
        final = out["requests"]["r"]["notification"]
        assert dpeer.call("check_stream", None)["state"] == "in_flight"
        got = dpeer.call("check_stream", final)  # what the caller's side channel carried
        _check_bytes(c, decode, stage, before, [req])
    assert got["state"] == "complete" and got["arrived"] == [0, 1, 2, 3], got
