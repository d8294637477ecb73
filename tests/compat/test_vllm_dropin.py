"""kvplan under vLLM 0.33.0's Mooncake connector, against vLLM's real (unpatched) methods."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest

import kvplan

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_cases import (  # noqa: E402
    RecordingEngine, canonical, generate, make_worker, run_coroutine)
from support.vllm_loader import load_vllm  # noqa: E402

N_CASES = 2400


@pytest.fixture(scope="module")
def v():
    return load_vllm()


@pytest.fixture(scope="module")
def patched(v):
    from kvplan.compat import vllm as compat

    cls = type("PatchedWorker", (v.MooncakeConnectorWorker,), {})
    compat.install(cls)
    yield cls
    compat.uninstall(cls)


def test_loader_runs_the_wheels_code_and_reaches_no_stand_in(v):
    assert v.version == "0.33.0"
    W = v.MooncakeConnectorWorker
    assert W._build_transfer_params.__code__.co_filename.startswith(v.root)
    visited = v.verify_closure()
    assert any(name.endswith("_build_transfer_params") for name in visited)
    assert v.NULL_BLOCK_ID == 0


def test_import_kvplan_and_compat_import_no_vllm():
    code = ("import sys, kvplan, kvplan.compat.vllm, kvplan.compat.vllm_ascend;"
            "print([m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_ascend')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import sys, kvplan; print('kvplan.compat.vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_install_uninstall_restores_exactly(v):
    from kvplan.compat import vllm as compat

    cls = type("W", (v.MooncakeConnectorWorker,), {})
    before = dict(cls.__dict__)
    assert compat.install(cls) == ("_build_transfer_params", "_send_blocks")
    assert compat.install(cls) == ()
    assert cls._build_transfer_params is not v.MooncakeConnectorWorker._build_transfer_params
    assert compat.uninstall(cls) == ("_build_transfer_params", "_send_blocks")
    assert dict(cls.__dict__) == before
    assert cls._build_transfer_params is v.MooncakeConnectorWorker._build_transfer_params
    with pytest.raises(TypeError):
        compat.install(int)


def _in_buffers(addrs, lengths, buffers):
    for a, n in zip(addrs, lengths):
        if not any(p <= a and a + n <= p + m for p, m in buffers):
            return False
    return True


def test_differential_against_vllm(v, patched):
    """Destination byte maps identical wherever vLLM's sources lie in the registered buffers;
    where they do not (vLLM would send bytes from outside them) kvplan fails the request with
    a typed error and vLLM's plan provably reads outside the buffers."""
    counts = dict(same=0, refused=0, blocks=0)
    kinds = set()
    for seed in range(N_CASES):
        case = generate(v, seed, patched)
        kinds.add((case.kind, case.p_tp != case.d_tp, case.pp > 1, case.kernel_ratio > 1))
        w = case.prefill
        local, remote, err = w._prepare_transfer_regions(case.meta)
        assert err is None, (seed, err)
        # requests with a bad block id that vLLM plans from outside the registered buffers
        oob = set()
        for req in case.invalid:
            bad = [r for r in case.ready if r[0] == req]
            s, _, n, _, _ = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
                w, bad, case.meta, local, remote))
            if len(s) and not _in_buffers(s, n, case.buffers):
                oob.add(req)
        counts["refused"] += len(oob)
        ref_src, ref_dst, ref_len, ref_err, ref_msg = run_coroutine(
            v.MooncakeConnectorWorker._build_transfer_params(
                w, [r for r in case.ready if r[0] not in oob], case.meta, local, remote))
        got_src, got_dst, got_len, got_err, got_msg = run_coroutine(
            patched._build_transfer_params(w, case.ready, case.meta, local, remote))
        assert isinstance(got_src, np.ndarray) and got_src.dtype == np.uint64
        assert set(got_err) == set(ref_err) | oob, seed
        assert canonical(got_src, got_dst, got_len) == canonical(ref_src, ref_dst, ref_len), seed
        assert _in_buffers(ref_src, ref_len, case.buffers), seed
        counts["blocks"] += len(got_src)
        assert len(got_src) <= len(ref_src)
        assert not oob or "IndexBoundsError" in got_msg, seed
        assert canonical(got_src, got_dst, got_len) == canonical(ref_src, ref_dst, ref_len), seed
        assert _in_buffers(ref_src, ref_len, case.buffers), seed
        counts["blocks"] += len(got_src)
        assert len(got_src) <= len(ref_src)
        counts["same"] += 1
    assert counts["same"] == N_CASES and counts["refused"] > 50, counts
    assert len(kinds) >= 12, kinds


def test_typed_error_names_the_block(v, patched):
    for seed in range(N_CASES):
        case = generate(v, seed, patched)
        if case.invalid:
            break
    w = case.prefill
    local, remote, _ = w._prepare_transfer_regions(case.meta)
    from kvplan.compat import vllm as compat

    peer = compat._templates(w, case.meta, local, remote, v.mc)
    req = next(r for r in case.ready if r[0] in case.invalid)
    lg = [list(g) for g in req[1].local_block_ids]
    rg = [list(g) for g in case.meta.req_blocks[req[0]][1]]
    lg = [g[-len(r):] if len(g) > len(r) and r else g for g, r in zip(lg, rg)]
    with pytest.raises(kvplan.IndexBoundsError):
        compat.plan_request(w, peer, w._logical_to_kernel_block_ids(lg),
                            w._logical_to_kernel_block_ids(rg), v.mc)


def test_templates_cached_per_peer_layout(v, patched):
    case = generate(v, 7, patched)
    w = case.prefill
    local, remote, _ = w._prepare_transfer_regions(case.meta)
    from kvplan.compat import vllm as compat

    a = compat._templates(w, case.meta, local, remote, v.mc)
    assert compat._templates(w, case.meta, local, remote, v.mc) is a
    assert compat._templates(w, case.meta, list(local), remote, v.mc) is not a


def test_send_blocks_batches_arrays_and_records_stats(v, patched):
    engine = RecordingEngine()
    w = make_worker(v, patched, tp_rank=0, tp_size=1, use_mla=True, total_kv_heads=1,
                    group_specs=[v.kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1,
                                                        head_size=8, dtype=None)],
                    layer_groups={"model.layers.0.attn": 0},
                    regions=[(0x1000, 64, 64, "model.layers.0.attn", 0, 0)],
                    buffers=[(0x1000, 64 * 4096)], engine=engine)
    w.kvplan_max_blocks_per_batch = 3
    src = np.arange(7, dtype=np.uint64) * 128 + 0x1000
    rc = patched._send_blocks(w, "peer:1", src, src + 0x100000, np.full(7, 64, np.uint64))
    assert rc == 0
    assert [len(c[1]) for c in engine.calls] == [3, 3, 1]
    assert all(type(x) is int for c in engine.calls for x in c[1])
    assert w.xfer_stats.ok[0]["total_bytes"] == 7 * 64 and w.xfer_stats.ok[0]["num_descs"] == 7
    engine.ret = -1
    engine.calls.clear()
    assert patched._send_blocks(w, "peer:1", src, src, np.full(7, 64, np.uint64)) == -1
    assert len(engine.calls) == 1 and w.xfer_stats.failed == 1


def test_connector_through_vllms_factory(v):
    """vLLM's own KVConnectorFactory loads the class by module path and name, checks the
    three-argument constructor and HMA support, and constructs it."""
    cfg = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_connector="KvplanMooncakeConnector", kv_connector_module_path="kvplan.compat.vllm",
            engine_id="e0", kv_role="kv_producer", kv_connector_extra_config={}),
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False))
    cls = v.KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    assert cls.__name__ == "KvplanMooncakeConnector"
    assert issubclass(cls, v.MooncakeConnector) and issubclass(cls, v.SupportsHMA)
    assert v.KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    from kvplan.compat import vllm as compat

    assert compat.installed(cls.Worker) == ("_build_transfer_params", "_send_blocks")
    assert "_build_transfer_params" not in v.MooncakeConnectorWorker.__dict__ or \
        v.MooncakeConnectorWorker._build_transfer_params.__module__.startswith("vllm.")
