"""vLLM's own Mooncake connector unit tests, re-expressed against the loaded vLLM worker.

The tests of vLLM's ``tests/v1/kv_connector/unit/test_mooncake_connector.py``,
``..._hma.py`` and ``..._hybrid_mamba.py`` that exercise the methods kvplan replaces
(``_build_transfer_params`` directly, or through ``send_kv_to_decode`` into ``_send_blocks``),
with their workers built exactly as those tests build them: ``MooncakeConnectorWorker.__new__``
with a handful of attributes and no ``register_kv_caches``, or vLLM's real ``MooncakeConnector``
constructor with the dependencies vLLM's ``patch_worker_dependencies`` patches. Their
assertions are vLLM's (``src_ptrs == [...]`` against lists included).

They run against vLLM 0.33.0 here and against 0.34.0 and 0.32.0's CPU build in child
processes (``test_other_release``). Each runs three ways and must pass all three: vLLM alone, after
``kvplan.compat.vllm.install(MooncakeConnectorWorker)`` (vLLM's own class patched, then
restored exactly), and with kvplan's ``KvplanMooncakeConnector`` / its worker class.

What cannot run here is left out: tests that register real torch tensors (torch is not
installed; ``register_kv_caches`` itself is vLLM's and not replaced), and the scheduler,
bootstrap-server and region-alignment tests, which never reach a replaced method.
"""

from __future__ import annotations

import asyncio
import os
import types
from unittest.mock import AsyncMock, MagicMock, patch

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_cases import (  # noqa: E402
    Recorded, build_connector, worker_dependencies, xfer_metadata)
from support.vllm_loader import OTHER_RELEASES, load_vllm, ALL_TESTS  # noqa: E402

from kvplan.compat import vllm as compat  # noqa: E402

MODES = ("vllm", "install", "connector")


@pytest.fixture(scope="module")
def v():
    return load_vllm()


@pytest.fixture(params=MODES)
def mode(request, v):
    """Which planner runs: vLLM's, kvplan installed on vLLM's class, or kvplan's connector."""
    W = v.MooncakeConnectorWorker
    before = dict(W.__dict__)
    if request.param == "install":
        compat.install(W)
    yield request.param
    if request.param == "install":
        assert compat.uninstall(W) == compat.REPLACED_METHODS
    assert dict(W.__dict__) == before


def worker_class(v, mode):
    return compat.KvplanMooncakeConnectorWorker if mode == "connector" else \
        v.MooncakeConnectorWorker


def connector_class(v, mode):
    return compat.KvplanMooncakeConnector if mode == "connector" else v.MooncakeConnector


def dependencies(v):
    # MooncakeXferResponse is a msgspec Struct, and msgspec is not installed: record its fields
    return worker_dependencies(v, MooncakeXferResponse=Recorded)


def plain_codec(worker):
    """The worker's msgspec encoder and decoder as identities (msgspec is not installed)."""
    worker._encoder = types.SimpleNamespace(encode=lambda obj: obj)
    worker._xfer_resp_decoder = types.SimpleNamespace(decode=lambda obj: obj)


def region(v, name, index, base, block_len, kv_block_len=None, group_index=0):
    return v.TransferRegion(layer_name=name, layer_index=index, base_addr=base,
                            block_len=block_len, kv_block_len=kv_block_len or block_len,
                            group_index=group_index)


def send_meta(v, p_req_id, transfer_id, local_block_ids):
    return v.mc.SendBlockMeta(p_req_id=p_req_id, transfer_id=transfer_id,
                              local_block_ids=local_block_ids, ready=asyncio.Event())


def producer_worker(v, mode, block_len, kv_block_len, *, layer):
    """A producer worker as upstream's tests set one up: one registered layer (``layer``) whose
    cache starts at 0x1000."""
    connector = build_connector(v, connector_class(v, mode), "kv_producer",
                                test_kv_cache_config(v))
    worker = connector.connector_worker
    plain_codec(worker)
    worker.kv_caches_base_addr = [0x1000]
    worker.block_len_per_layer = [block_len]
    worker.kv_block_len_per_layer = [kv_block_len]
    worker.registered_layer_names = [f"model.layers.{layer}.self_attn"]
    worker.registered_layer_indices = [layer]
    return worker


def test_kv_cache_config(v):
    kvi = v.kvi
    return kvi.KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(
            ["model.layers.0.self_attn", "model.layers.1.self_attn",
             "model.layers.0.mla_attn", "model.layers.1.eagle_attn"],
            kvi.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=None))])


test_kv_cache_config.__test__ = False  # a helper (vLLM's _make_test_kv_cache_config)


def hma_kv_cache_config(v, block_size=16, sw_size=128):
    """vLLM's test ``make_kv_cache_config(block_size, swa_enabled=True)``: full attention
    and sliding window groups."""
    kvi = v.kvi
    return kvi.KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(["layer0", "layer1"], kvi.FullAttentionSpec(
            block_size=block_size, num_kv_heads=4, head_size=16, dtype=None)),
        kvi.KVCacheGroupSpec(["layer2", "layer3"], kvi.SlidingWindowSpec(
            block_size=block_size, num_kv_heads=4, head_size=16, dtype=None,
            sliding_window=sw_size)),
    ])


def hybrid_gdn_kv_cache_config(v, block_size=16):
    kvi = v.kvi
    return kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(["model.layers.0.self_attn"], kvi.FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=None)),
        kvi.KVCacheGroupSpec(["model.layers.1.linear_attn"], kvi.MambaSpec(
            block_size=block_size, shapes=((6, 3), (1, 2, 2)), dtypes=(None, None))),
    ])


# --------------------------------------------------------------------------------------------
# test_mooncake_connector.py
# --------------------------------------------------------------------------------------------
def test_build_transfer_params_separates_prefill_pp_layers(v, mode):
    """Each producer PP stage sends only its registered layer shard (a worker made with
    ``__new__``: nothing registered)."""
    W = worker_class(v, mode)
    worker = W.__new__(W)
    worker.async_zmq_ctx = MagicMock()
    worker.is_kv_consumer = True
    worker.is_kv_producer = True
    worker.tp_rank = 0
    worker.tp_size = 1
    worker.kv_cache_config = test_kv_cache_config(v)
    worker._physical_blocks_per_logical_kv_block = 1
    # vLLM 0.33's _get_sender_transfer_plan also reads use_mla and the topology's head count
    # (vLLM's later test sets only the first topology field, for a later worker)
    worker.use_mla = False
    worker.transfer_topo = types.SimpleNamespace(local_replicates_kv_cache=False,
                                                 total_num_kv_heads=4)

    block_len = 256
    remote_regions = [region(v, f"model.layers.{i}.self_attn", i, base, block_len)
                      for i, base in [(0, 0xA000), (1, 0xB000), (2, 0xC000), (3, 0xD000)]]
    producer_pp_regions = {
        0: [region(v, "model.layers.0.self_attn", 0, 0x1000, block_len),
            region(v, "model.layers.1.self_attn", 1, 0x2000, block_len)],
        1: [region(v, "model.layers.2.self_attn", 2, 0x3000, block_len),
            region(v, "model.layers.3.self_attn", 3, 0x4000, block_len)],
    }
    expected = {
        0: ([0x1000 + 10 * block_len, 0x2000 + 10 * block_len],
            [0xA000 + 20 * block_len, 0xB000 + 20 * block_len]),
        1: ([0x3000 + 10 * block_len, 0x4000 + 10 * block_len],
            [0xC000 + 20 * block_len, 0xD000 + 20 * block_len]),
    }
    meta = send_meta(v, "p-req-pp", "xfer-pp-split", [[10, 11]])
    xfer_meta = xfer_metadata(
        remote_hostname="consumer-host", remote_port=54321, remote_tp_size=1,
        remote_tp_rank=0, req_blocks={"d-req-pp": ("xfer-pp-split", [[20, 21]])},
        kv_caches_base_addr=[r.base_addr for r in remote_regions],
        block_lens=[r.block_len for r in remote_regions],
        kv_block_lens=[r.kv_block_len for r in remote_regions],
        registered_layer_names=[r.layer_name for r in remote_regions],
        registered_layer_indices=[r.layer_index for r in remote_regions])

    for pp_rank, local_regions in producer_pp_regions.items():
        aligned_local, aligned_remote, err = v.mc._align_transfer_regions(
            local_regions, remote_regions)
        assert err is None
        src_ptrs, dst_ptrs, lengths, err_reqs, err_msg = asyncio.run(
            worker._build_transfer_params(
                ready_reqs=[("d-req-pp", meta)], agent_meta=xfer_meta,
                local_regions=aligned_local, remote_regions=aligned_remote))
        assert err_reqs == []
        assert err_msg is None
        assert src_ptrs == expected[pp_rank][0]
        assert dst_ptrs == expected[pp_rank][1]
        assert lengths == [2 * block_len, 2 * block_len]


def test_send_kv_to_decode_aligns_consumer_regions_by_layer_metadata(v, mode):
    """The producer sends its PP layer shard to the matching consumer layer address."""
    with patch.dict(os.environ, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="5"), dependencies(v):
        block_len = 4096
        kv_half = block_len // 2
        worker = producer_worker(v, mode, block_len, kv_half, layer=1)

        class InlineSenderLoop:
            async def run_in_executor(self, executor, func, *args):
                return func(*args)

        origin_sender_loop = worker.sender_loop
        worker.sender_loop = InlineSenderLoop()
        meta = send_meta(v, "p-req-layer-align", "xfer-layer-align", [[10]])
        worker.reqs_need_send["xfer-layer-align"] = meta
        meta.ready.set()
        xfer_meta = xfer_metadata(
            remote_hostname="consumer-host", remote_port=54321, remote_tp_size=1,
            remote_tp_rank=0, req_blocks={"d-req-layer-align": ("xfer-layer-align", [[20]])},
            kv_caches_base_addr=[0xA000, 0xB000], block_lens=[block_len, block_len],
            kv_block_lens=[kv_half, kv_half],
            registered_layer_names=["model.layers.0.self_attn", "model.layers.1.self_attn"],
            registered_layer_indices=[0, 1])
        sock = AsyncMock()
        identity = b"consumer-layer-align"
        with patch.object(worker, "_send_blocks", return_value=0) as mock_send_blocks:
            asyncio.run(worker.send_kv_to_decode(identity, sock, xfer_meta))

        # vLLM 0.33 sends the first kv_block_len bytes of each block (later vLLMs, whose
        # version of this test expects two descriptors, also split K and V halves)
        src_ptrs, dst_ptrs, lengths = mock_send_blocks.call_args[0][1:]
        assert src_ptrs == [0x1000 + 10 * block_len]
        assert dst_ptrs == [0xB000 + 20 * block_len]
        assert lengths == [kv_half]
        sent_identity, sent_payload = sock.send_multipart.call_args[0][0]
        assert sent_identity == identity
        response = worker._xfer_resp_decoder.decode(sent_payload)
        assert response.status == v.mc.MooncakeXferResponseStatus.FINISH
        assert response.ok_reqs == ["d-req-layer-align"]
        worker.sender_loop = origin_sender_loop
        worker.shutdown()


def test_kv_producer(v, mode):
    """A producer worker serving a consumer's pull: pointers are base + block * block_len,
    a consumer needing fewer blocks gets the tail, more blocks is an error, an unready request
    times out, and an engine error fails the request."""
    with patch.dict(os.environ, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="5"), dependencies(v):
        block_len = 4096
        kv_half = block_len // 2
        worker = producer_worker(v, mode, block_len, kv_half, layer=0)
        loop = asyncio.new_event_loop()
        origin_sender_loop = worker.sender_loop
        worker.sender_loop = loop

        transfer_id = "xfer-req-1"
        meta = send_meta(v, "p-req-1", transfer_id, [[10, 11]])
        worker.reqs_need_send[transfer_id] = meta
        meta.ready.set()
        xfer_meta = xfer_metadata(
            remote_hostname="consumer-host", remote_port=54321, remote_tp_size=1,
            remote_tp_rank=0, req_blocks={"d-req-1": (transfer_id, [[20, 21]])},
            kv_caches_base_addr=[0x2000], block_lens=[block_len], kv_block_lens=[kv_half],
            registered_layer_names=["model.layers.0.self_attn"], registered_layer_indices=[0])
        sock = AsyncMock()
        identity = b"consumer-id"

        def expected_split_transfers(src_base, dst_base, src_blocks, dst_blocks):
            # vLLM 0.33: the first kv_block_len bytes of each block, one descriptor per
            # block (later vLLMs, whose version of this test has a K and a V loop here, also
            # split the halves)
            src_ptrs, dst_ptrs, lengths = [], [], []
            for sb, db in zip(src_blocks, dst_blocks):
                src_ptrs.append(src_base + sb * block_len)
                dst_ptrs.append(dst_base + db * block_len)
                lengths.append(kv_half)
            return src_ptrs, dst_ptrs, lengths

        def response():
            _, payload = sock.send_multipart.call_args[0][0]
            return worker._xfer_resp_decoder.decode(payload)

        def again(blocks):
            sock.send_multipart.reset_mock()
            worker.reqs_need_send[transfer_id] = meta
            meta.sent = 0
            meta.ready.set()
            xfer_meta.req_blocks["d-req-1"] = (transfer_id, blocks)

        with patch.object(worker, "_send_blocks", return_value=0) as mock_send_blocks:
            loop.run_until_complete(worker.send_kv_to_decode(identity, sock, xfer_meta))
            src, dst, lens = expected_split_transfers(0x1000, 0x2000, [10, 11], [20, 21])
            mock_send_blocks.assert_called_once_with("consumer-host:54321", src, dst, lens)
            sock.send_multipart.assert_called_once()
            assert response().status == v.mc.MooncakeXferResponseStatus.FINISH
            assert response().ok_reqs == ["d-req-1"]
            assert transfer_id not in worker.reqs_need_send
            assert "p-req-1" in worker.finished_sending_reqs

            # the consumer needs 1 block (fewer than the producer holds): 11 to 20
            mock_send_blocks.reset_mock()
            again([[20]])
            loop.run_until_complete(worker.send_kv_to_decode(identity, sock, xfer_meta))
            src, dst, lens = expected_split_transfers(0x1000, 0x2000, [11], [20])
            mock_send_blocks.assert_called_once_with("consumer-host:54321", src, dst, lens)

            # the consumer needs 3 blocks (more than the producer holds): an error
            mock_send_blocks.reset_mock()
            again([[20, 21, 22]])
            loop.run_until_complete(worker.send_kv_to_decode(identity, sock, xfer_meta))
            mock_send_blocks.assert_not_called()
            assert response().err_msg == "P num blocks less than D"
            assert response().err_reqs == ["d-req-1"]

            # not ready before the abort timeout (0 s here, so the test never waits)
            mock_send_blocks.reset_mock()
            again([[20, 21]])
            meta.ready.clear()
            with patch.dict(os.environ, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="0"):
                loop.run_until_complete(worker.send_kv_to_decode(identity, sock, xfer_meta))
            mock_send_blocks.assert_not_called()
            assert response().err_msg == "Timeout waiting for P side ready."
            assert response().err_reqs == ["d-req-1"]

        with patch.object(worker, "_send_blocks", return_value=123) as mock_send_blocks:
            again([[20, 21]])
            loop.run_until_complete(worker.send_kv_to_decode(identity, sock, xfer_meta))
            mock_send_blocks.assert_called_once()
            assert response().err_msg == "Mooncake transfer engine returned 123"
            assert response().err_reqs == ["d-req-1"]

        worker.sender_loop = origin_sender_loop
        loop.close()
        worker.shutdown()


def test_send_blocks_records_transfer_with_fake_engine(v, mode):
    """The pull end to end with vLLM's fake engine: ``_send_blocks`` (vLLM's or kvplan's)
    hands the engine lists of ints and records one transfer."""
    with patch.dict(os.environ, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="5"), dependencies(v):
        worker = producer_worker(v, mode, 4096, 4096, layer=0)
        calls = []
        worker.engine.batch_transfer_sync_write = lambda *args: calls.append(args) or 0
        worker.xfer_stats = MagicMock()
        meta = send_meta(v, "p", "t", [[10, 11, 13]])
        worker.reqs_need_send["t"] = meta
        meta.ready.set()

        class InlineSenderLoop:
            async def run_in_executor(self, executor, func, *args):
                return func(*args)

        origin_sender_loop = worker.sender_loop
        worker.sender_loop = InlineSenderLoop()
        xfer_meta = xfer_metadata(
            remote_hostname="h", remote_port=1, remote_tp_size=1, remote_tp_rank=0,
            req_blocks={"d": ("t", [[20, 21, 30]])}, kv_caches_base_addr=[0x80000],
            block_lens=[4096], kv_block_lens=[4096],
            registered_layer_names=["model.layers.0.self_attn"], registered_layer_indices=[0])
        asyncio.run(worker.send_kv_to_decode(b"id", AsyncMock(), xfer_meta))
        assert calls == [("h:1", [0x1000 + 10 * 4096, 0x1000 + 13 * 4096],
                          [0x80000 + 20 * 4096, 0x80000 + 30 * 4096], [2 * 4096, 4096])]
        assert all(type(x) is int for call in calls for column in call[1:] for x in column)
        worker.xfer_stats.record_transfer.assert_called_once()
        assert worker.xfer_stats.record_transfer.call_args.kwargs["total_bytes"] == 3 * 4096
        assert worker.xfer_stats.record_transfer.call_args.kwargs["num_descs"] == 2
        worker.sender_loop = origin_sender_loop
        worker.shutdown()


# --------------------------------------------------------------------------------------------
# test_mooncake_connector_hma.py
# --------------------------------------------------------------------------------------------
def hma_call(v, mode, local_block_ids, remote_block_ids):
    block_len = 4096
    with patch.dict(os.environ, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="5"), dependencies(v):
        connector = build_connector(v, connector_class(v, mode), "kv_producer",
                                    hma_kv_cache_config(v))
        worker = connector.connector_worker
        meta = send_meta(v, "p", "xfer", local_block_ids)
        xfer_meta = xfer_metadata(
            remote_hostname="consumer-host", remote_port=54321, remote_tp_size=1,
            remote_tp_rank=0, req_blocks={"d": ("xfer", remote_block_ids)},
            kv_caches_base_addr=[0x2000], block_lens=[block_len], kv_block_lens=[block_len])
        local_regions = [region(v, "model.layers.0.self_attn", 0, 0x1000, block_len)]
        remote_regions = [region(v, "model.layers.0.self_attn", 0, 0x2000, block_len)]
        out = asyncio.run(worker._build_transfer_params(
            [("d", meta)], xfer_meta, local_regions, remote_regions))
        worker.shutdown()
    return out


def test_build_transfer_params_multi_group_trimming(v, mode):
    """Per-group blocks are trimmed to the consumer's count when the producer has more."""
    src_ptrs, dst_ptrs, lengths, err_reqs, err_msg = hma_call(
        v, mode, [[10, 11, 12, 13], [20, 21, 22]], [[30, 31], [40, 41]])
    assert err_reqs == []
    assert err_msg is None
    assert len(src_ptrs) > 0
    assert len(dst_ptrs) == len(src_ptrs)
    assert len(lengths) == len(src_ptrs)


def test_build_transfer_params_group_count_mismatch(v, mode):
    """A request whose group counts differ is reported, with no transfers built."""
    src_ptrs, dst_ptrs, lengths, err_reqs, err_msg = hma_call(
        v, mode, [[10, 11], [20, 21]], [[30, 31]])
    assert err_reqs == ["d"]
    assert err_msg == "KV group count mismatch"
    assert src_ptrs == []
    assert dst_ptrs == []
    assert lengths == []


# --------------------------------------------------------------------------------------------
# test_mooncake_connector_hybrid_mamba.py
# --------------------------------------------------------------------------------------------
def test_hybrid_gdn_transfer_params_preserve_group_identity(v, mode):
    """FA and GDN (Mamba) groups keep their own block ids; null blocks are skipped."""
    block_len = 0x100
    null = v.NULL_BLOCK_ID
    with patch.dict(os.environ, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="5"), dependencies(v):
        connector = build_connector(v, connector_class(v, mode), "kv_producer",
                                    hybrid_gdn_kv_cache_config(v))
        worker = connector.connector_worker
        xfer_meta = xfer_metadata(
            remote_hostname="consumer-host", remote_port=54321, remote_tp_size=1,
            remote_tp_rank=0,
            req_blocks={"d-hybrid-gdn": ("xfer-hybrid-gdn", [[30, 31], [null, 7]])},
            kv_caches_base_addr=[], block_lens=[], kv_block_lens=[])
        local_regions = [
            region(v, "model.layers.1.linear_attn", 1, 0x5000, block_len, group_index=1),
            region(v, "model.layers.0.self_attn", 0, 0x1000, block_len, group_index=0)]
        remote_regions = [
            region(v, "model.layers.1.linear_attn", 1, 0x6000, block_len, group_index=1),
            region(v, "model.layers.0.self_attn", 0, 0x2000, block_len, group_index=0)]
        meta = send_meta(v, "p-hybrid-gdn", "xfer-hybrid-gdn", [[10, 11], [null, 4]])
        src_ptrs, dst_ptrs, lengths, err_reqs, err_msg = asyncio.run(
            worker._build_transfer_params([("d-hybrid-gdn", meta)], xfer_meta,
                                          local_regions, remote_regions))
        assert err_reqs == []
        assert err_msg is None
        assert src_ptrs == [0x5000 + 4 * block_len, 0x1000 + 10 * block_len]
        assert dst_ptrs == [0x6000 + 7 * block_len, 0x2000 + 30 * block_len]
        assert lengths == [block_len, 2 * block_len]
        worker.shutdown()


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = dict.fromkeys(OTHER_RELEASES, ALL_TESTS)
