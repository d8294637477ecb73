"""A prefill and a decode worker of ``KvplanNixlConnector`` built over vLLM's real NIXL worker
classes (``support.vllm_nixl``), each with its KV cache in host memory registered with its own
real NIXL agent (UCX on loopback), handshaken: what the staged-read tests and the NIXL staged
benchmark drive, one request at a time, through the decode's ``_read_blocks`` (vLLM's own or
kvplan's) and vLLM's own ``_pop_done_transfers``.

:class:`TpPair` is the same between prefill and decode TP sizes that differ (every rank its own
worker, agent and KV cache; each decode rank's reads, one per prefill rank vLLM's TP mapping
names): what the TP staged-read tests and the benchmark's ``--tp`` cases drive.

The geometry (:class:`support.vllm_nixl.Geometry`) and the request's pages are arguments;
the defaults are the tests' (3 layers, 8 blocks of 16 tokens, a five-page prefill request the
decode has the first page of cached).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import queue
import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from support.vllm_nixl import (
    COMPAT_HASH,
    MSGSPEC,
    TESTS,
    Geometry,
    handshake,
    serve,
    vllm_config,
    worker,
)

from kvplan.compat.vllm import nixl_staging

__all__ = ["BLOCK_BYTES", "DECODE_PAGES", "ENGINE", "PREFILL_PAGES", "READ_STAGING", "REGIONS",
           "STAGING", "Pair", "TpPair", "build", "close", "load_agents", "nixl_agent"]

STAGING = {"kvplan_staging": "always", "kvplan_staging_arena_mib": 1,
           "kvplan_staging_buffers": 2}
#: Bytes of one KV block per region in the tests' geometry (one layer's K or V).
BLOCK_BYTES = TESTS.block_bytes()
REGIONS = TESTS.regions
#: The prefill's pages of one request and the decode's (fragmented, and the decode has the
#: first prefill page cached: vLLM's prefix-cache trim leaves the last four).
PREFILL_PAGES = [6, 5, 2, 7, 1]
DECODE_PAGES = [3, 6, 0, 4]
#: The read tests' staging: 32 round buffers of 32 KiB, so the request's 96 KiB take 3 rounds.
READ_STAGING = dict(STAGING, kvplan_staging_buffers=32)


def nixl_agent(name: str) -> Any:
    """A real NIXL agent (UCX) as vLLM makes its agents: telemetry on (its polling records each
    read's)."""
    from support.engine_peers import require_nixl

    require_nixl()
    api = importlib.import_module("nixl_cu12._api")
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], capture_telemetry=True))


def build(c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, engine: str, role: str,
          extra: dict[str, Any] | None, *, base: int, agent: Any = None,
          geometry: Geometry = TESTS, tp_rank: int = 0, tp_size: int = 1) -> Any:
    """A worker made by ``KvplanNixlConnector``'s constructor (vLLM's part: the worker with
    its NIXL agent, as vLLM's constructor leaves it), TP rank ``tp_rank`` of ``tp_size``."""
    config = vllm_config(role, heads=geometry.heads)
    config.kv_transfer_config.kv_connector_extra_config.update(extra or {})
    w = worker(c, nixl, engine, config, base=base, geometry=geometry, tp_rank=tp_rank,
               tp_size=tp_size)
    w.__class__ = nixl.NixlPullConnectorWorker  # vLLM's constructor names its own class
    w.__dict__.update(nixl_wrapper=agent if agent is not None else nixl_agent(engine),
                      device_kv_caches={})
    vllm_base = c.Connector.__mro__[1]

    def vllm_init(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self.connector_worker = w

    monkeypatch.setattr(vllm_base, "__init__", vllm_init, raising=False)
    c.Connector(config, role, None)
    assert type(w) is c.Worker
    return w


def close(*workers: Any) -> None:
    """Each worker's staging closed as the connector's ``shutdown`` closes it
    (``close_staging``: the streams a prefill serves stopped as its shutdown first, then its
    channels and listener), once."""
    from kvplan.compat.vllm.nixl_staging.lifecycle import close_staging

    for w in workers:
        close_staging(w)


def load_agents(c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's ``add_remote_agent`` below kvplan's loads the prefill's agent metadata
    into its NIXL agent (vLLM's own then prepares its KV descriptors, not needed here)."""
    monkeypatch.setattr(nixl.NixlPullConnectorWorker, "add_remote_agent",
                        lambda self, meta, *a, **k: self.nixl_wrapper.add_remote_agent(
                            meta.agent_metadata))


def keep_for_decode(nixl: Any, prefill: Any, request: str, groups: list[list[int]],
                    lease_s: float) -> None:
    """vLLM's scheduler keeps ``request``'s blocks on ``prefill`` for a decode: the request in
    the batch, then in ``reqs_to_send`` with its lease's expiry, with the block ids kvplan's
    scheduler side adds (vLLM's ``remote_block_ids``, a list per KV group), run through vLLM's
    own ``start_load_kv`` of kvplan's worker."""
    meta = nixl.metadata.NixlConnectorMetadata()
    meta.reqs_in_batch = {request}
    now = time.perf_counter()
    meta.scheduler_clock = now
    meta.reqs_to_send = {request: now + lease_s}
    scheduler = types.SimpleNamespace()
    nixl_staging.note_finished(scheduler, types.SimpleNamespace(request_id=request), (
        True, {"remote_block_ids": groups}))
    nixl_staging.attach_sent_blocks(scheduler, meta)
    prefill.start_load_kv(meta)
    assert request in prefill._reqs_to_send


def random_bytes(size: int, seed: int) -> np.ndarray:
    """``size`` random bytes, drawn in 64 MiB pieces (no second array of the full size)."""
    out = np.empty(size, np.uint8)
    rng = np.random.default_rng(seed)
    for lo in range(0, size, 64 << 20):
        piece = out[lo:lo + (64 << 20)]
        piece[:] = rng.integers(0, 256, piece.size, dtype=np.uint8)
    return out


class Pair:
    """A prefill and a decode worker of ``KvplanNixlConnector`` with staging on, each with its
    KV cache in host memory registered with its own NIXL agent, handshaken. ``geometry`` is
    both sides' KV cache, ``prefill_pages`` / ``decode_pages`` the request's blocks (vLLM's
    ``remote_block_ids`` / ``local_block_ids``), ``staging`` the connector options of a side
    given no ``*_extra``. Several KV groups (a hybrid model's): ``region_groups`` names each
    region's group (vLLM's ``region_group_ids``: each group's layers in regions of their own,
    or -1 for a region shared by every group, as vLLM's hybrid allocator shares a tensor
    between layers of several groups; the prefill's metadata names them too),
    ``prefill_groups`` / ``decode_groups`` the request's blocks per group."""

    def __init__(self, c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch,
                 prefill_extra: dict[str, Any] | None = None,
                 decode_extra: dict[str, Any] | None = None, *,
                 geometry: Geometry = TESTS, prefill_pages: Sequence[int] = PREFILL_PAGES,
                 decode_pages: Sequence[int] = DECODE_PAGES,
                 staging: dict[str, Any] | None = None,
                 region_groups: Sequence[int] | None = None,
                 prefill_groups: Sequence[Sequence[int]] | None = None,
                 decode_groups: Sequence[Sequence[int]] | None = None) -> None:
        staging = READ_STAGING if staging is None else staging
        self.nixl, self.geometry = nixl, geometry
        self.prefill_groups = [list(g) for g in prefill_groups or [prefill_pages]]
        self.decode_groups = [list(g) for g in decode_groups or [decode_pages]]
        self.prefill_pages, self.decode_pages = self.prefill_groups[0], self.decode_groups[0]
        self.region_groups = list(region_groups or [0] * geometry.regions)
        assert len(self.region_groups) == geometry.regions
        assert len(self.prefill_groups) == len(self.decode_groups)
        assert {g for g in self.region_groups if g >= 0} <= set(range(len(self.decode_groups)))
        size = geometry.regions * geometry.blocks * geometry.block_bytes()
        self.p_mem = random_bytes(size, 7)
        self.d_mem = np.zeros(size, np.uint8)
        self.prefill = build(c, nixl, monkeypatch, "prefill-0", "kv_producer",
                             staging if prefill_extra is None else prefill_extra,
                             base=self.p_mem.ctypes.data, geometry=geometry)
        self.decode = build(c, nixl, monkeypatch, "decode-0", "kv_consumer",
                            staging if decode_extra is None else decode_extra,
                            base=self.d_mem.ctypes.data, geometry=geometry)
        for w, mem in ((self.prefill, self.p_mem), (self.decode, self.d_mem)):
            self._vllm_state(w)
            w.nixl_wrapper.register_memory([(mem.ctypes.data, mem.nbytes, 0, "")], "DRAM")
        serve(c, nixl, self.prefill, region_group_ids=self.region_groups)
        handshake(self.decode, self.prefill)
        peer = nixl_staging.peer_agreement(self.decode, "prefill-0", 0)
        assert peer is not None
        self.agent_name = peer.agent
        self.decode._remote_agents = {"prefill-0": {(0, 0): peer.agent}}
        self.keep()

    def keep(self, lease_s: float = 30.0, blocks: Sequence[Any] | None = None,
             request: str = "req-p") -> None:
        """The prefill finished ``request`` for a decode: what vLLM's scheduler sends its
        worker (the request in the batch, then in ``reqs_to_send`` with its lease's expiry),
        with the block ids kvplan's scheduler side adds (vLLM's ``remote_block_ids``: the
        pair's prefill blocks, or ``blocks``, one group's or a list per group), run through
        vLLM's own ``start_load_kv`` of kvplan's worker."""
        groups = self.prefill_groups if blocks is None else \
            [list(g) for g in blocks] if blocks and isinstance(blocks[0], list) else [list(blocks)]
        keep_for_decode(self.nixl, self.prefill, request, groups, lease_s)

    def _vllm_state(self, w: Any) -> None:
        """What vLLM's ``register_kv_caches`` and ``add_remote_agent`` leave that its read
        and its polling use (the pair's KV groups, homogeneous TP, block size ratio 1)."""
        g = self.geometry
        regions, blocks = g.regions, g.blocks
        groups, mapped = self.region_groups, len(set(self.region_groups)) > 1
        ids = list(range(len(getattr(self, "decode_groups", None) or [[]])))
        # vLLM 0.34's pairs: region k with region k at each group it holds layers of (every
        # group, for a shared region)
        pairs = [(r, g) for r, own in enumerate(groups) for g in (ids if own < 0 else [own])]
        info = types.SimpleNamespace(remote_block_size=g.block, remote_dcp_size=1,
                                     remote_physical_blocks_per_logical=1, remote_tp_size=1)
        w.__dict__.update(
            transfer_topo=types.SimpleNamespace(get_engine_info=lambda engine: info,
                                                block_size_ratio=lambda size: 1,
                                                handshake_target_ranks=lambda *a: [0]),
            kv_cache_config=types.SimpleNamespace(transfer_groups=ids, kv_cache_groups=ids),
            _mixed_mem_types=False, device_id=0, num_regions=regions,
            block_stride_per_layer=[g.block_bytes()] * regions,
            region_num_blocks=[blocks] * regions, region_group_ids=list(groups),
            _uses_region_group_mapping=mapped, _transfer_layer_group_ids=(),
            _transfer_layer_region_indices=[], region_mem_types=["DRAM"] * regions,
            dst_num_blocks={"prefill-0": blocks, "decode-0": blocks},
            dst_region_num_blocks={}, dst_region_group_ids={"prefill-0": list(groups)},
            dst_uses_region_group_mapping={"prefill-0": mapped},
            _recving_transfers=collections.defaultdict(list), _recving_metadata={},
            _failed_remote_engines=set(), _recv_failures=set(),
            # what vLLM's pull worker keeps of the requests it holds for decodes
            _reqs_to_send={}, _reqs_to_process=set(), _ready_requests=queue.Queue(),
            pcp_rank=0, pcp_dcp_sharded=False, _replicated_pcp_done_sending=set(),
            consumer_notification_counts_by_req=collections.defaultdict(int),
            expected_consumer_notifications_by_req={}, _lease_extension=20,
            # vLLM 0.34's region pairs of the prefill (region k reads region k, at its group's
            # blocks)
            _dst_pairs={"prefill-0": types.SimpleNamespace(
                remote=[r for r, _ in pairs], local=[r for r, _ in pairs],
                group=[g for _, g in pairs], remote_ssm_regions=None)})

    def prep(self) -> tuple[Any, Any]:
        """The decode agent's prepped descriptor lists of both sides' KV blocks, as vLLM's
        ``_build_fa_local`` builds them (vLLM prepares them once per peer, at the handshake);
        release them with :meth:`release`."""
        d, agent = self.decode, self.decode.nixl_wrapper
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", d._build_fa_local(d.kv_caches_base_addr["decode-0"][0], 1),
            mem_type="DRAM")
        remote = agent.prep_xfer_dlist(
            self.agent_name, self.prefill._build_fa_local(
                self.prefill.kv_caches_base_addr["prefill-0"][0], 1), mem_type="DRAM")
        return local, remote

    def release(self, prepped: tuple[Any, Any]) -> None:
        for handle in prepped:
            self.decode.nixl_wrapper.release_dlist_handle(handle)

    def read(self, *, vllm_only: bool = False, forget_prefill: bool = False,
             prepped: tuple[Any, Any] | None = None, request: str = "req-d",
             remote_request: str = "req-p", posted: bool = True) -> Any:
        """The decode's ``_read_blocks`` for the request: kvplan's worker's (staged where the
        advice stages), or with ``vllm_only`` vLLM's own, on vLLM's own class (its own
        descriptor ids and ``make_prepped_xfer`` READ of prepped descriptor lists vLLM's
        ``_build_fa_local`` builds on each side: ``prepped`` from :meth:`prep`, else prepared
        here). ``forget_prefill``: the decode's agent drops the prefill's metadata once the
        lists are prepared, so every read of it fails. ``posted``: what ``_read_blocks`` is
        to return (False: the request was routed to vLLM's failure reporting)."""
        tp = self.nixl.modules["vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping"]
        d, agent = self.decode, self.decode.nixl_wrapper
        local, remote = self.prep() if prepped is None else prepped
        if forget_prefill:
            agent.remove_remote_agent(self.agent_name)
        spec = tp.ReadSpec(remote_rank=0, local_block_ids=[list(g) for g in self.decode_groups],
                           remote_block_ids=[list(g) for g in self.prefill_groups])
        kwargs = dict(read_spec=spec, dst_engine_id="prefill-0", request_id=request,
                      remote_request_id=remote_request, local_xfer_side_handle=local,
                      local_dram_handle=None, remote_xfer_side_handle=remote,
                      expected_consumers=1, awaiting_kvs=True)
        if vllm_only:
            cls = d.__class__
            d.__class__ = self.nixl.NixlPullConnectorWorker
            try:
                assert d._read_blocks(**kwargs) is True
            finally:
                d.__class__ = cls
        else:
            assert d._read_blocks(**kwargs) is posted
        return d._recving_transfers[request]

    def poll(self, timeout_s: float = 30.0, interval_s: float = 0.005
             ) -> tuple[set[str], set[str]]:
        """vLLM's own ``_pop_done_transfers`` until the request is done or failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            done, failed = self.decode._pop_done_transfers(self.decode._recving_transfers)
            if done or failed or time.monotonic() > deadline:
                return done, failed
            time.sleep(interval_s)

    def notifications(self, timeout_s: float = 20.0) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            notifs = self.prefill.nixl_wrapper.get_new_notifs()
            if notifs:
                return [n for ns in notifs.values() for n in ns]
            time.sleep(0.005)
        return []

    def close(self) -> None:
        close(self.prefill, self.decode)


#: The prefill's engine id in :class:`Pair` and :class:`TpPair`.
ENGINE = "prefill-0"
_TP = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping"


class TpPair:
    """A prefill of ``prefill_tp`` ranks and a decode of ``decode_tp`` ranks of
    ``KvplanNixlConnector`` with staging on (``staging``: the connector options, both sides),
    every rank its own KV cache in host memory registered with its own NIXL agent, each decode
    rank handshaken with the prefill ranks vLLM's TP mapping (``compute_tp_mapping``) names for
    it; both sides name the layout ``layout`` (vLLM's block-contiguous ``LBHNC``: heads
    outermost, so a rank's heads are one range of a block). ``prefill_pages`` /
    ``decode_pages`` are the request's blocks (vLLM's ``remote_block_ids`` /
    ``local_block_ids``); ``heads``: the decode's model names other KV heads. Several KV groups
    (a hybrid model's), as in :class:`Pair`: ``region_groups`` names each region's group (on
    every rank, and in the prefill's metadata), ``prefill_groups`` / ``decode_groups`` the
    request's blocks per group. The request is kept on every prefill rank (:meth:`keep`)
    unless ``keep`` is False."""

    def __init__(self, c: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, *,
                 prefill_tp: int, decode_tp: int, geometry: Geometry = TESTS,
                 layout: str = "LBHNC", heads: int | None = None,
                 prefill_pages: Sequence[int] = PREFILL_PAGES,
                 decode_pages: Sequence[int] = DECODE_PAGES,
                 staging: dict[str, Any] | None = None, keep: bool = True,
                 region_groups: Sequence[int] | None = None,
                 prefill_groups: Sequence[Sequence[int]] | None = None,
                 decode_groups: Sequence[Sequence[int]] | None = None) -> None:
        self.c, self.nixl, self.g = c, nixl, geometry
        self.staging = READ_STAGING if staging is None else staging
        self.prefill_groups = [list(g) for g in prefill_groups or [prefill_pages]]
        self.decode_groups = [list(g) for g in decode_groups or [decode_pages]]
        self.prefill_pages, self.decode_pages = self.prefill_groups[0], self.decode_groups[0]
        self.region_groups = list(region_groups or [0] * geometry.regions)
        assert len(self.region_groups) == geometry.regions
        assert len(self.prefill_groups) == len(self.decode_groups)
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
        #: the prefill ranks each decode rank reads, as vLLM's TP mapping names them
        self.sources = [list(p.all_source_ranks) for p in self.plans]
        if keep:
            self.keep()

    def _size(self, tp: int) -> int:
        return self.g.regions * self.g.blocks * self.g.block_bytes(tp)

    def _worker(self, monkeypatch: pytest.MonkeyPatch, engine: str, role: str, rank: int,
                size: int, mem: np.ndarray, layout: str, heads: int | None = None) -> Any:
        g = self.g
        w = build(self.c, self.nixl, monkeypatch, engine, role, self.staging,
                  base=mem.ctypes.data, agent=nixl_agent(f"{engine}-tp{rank}"), geometry=g,
                  tp_rank=rank, tp_size=size)
        Pair._vllm_state(types.SimpleNamespace(  # type: ignore[arg-type]
            geometry=g, region_groups=self.region_groups, decode_groups=self.decode_groups), w)
        if heads is not None:  # this side's model names other KV heads
            w.model_config = types.SimpleNamespace(**dict(
                vars(w.model_config), get_total_num_kv_heads=lambda: heads))
        info = types.SimpleNamespace(remote_block_size=g.block, remote_dcp_size=1,
                                     remote_physical_blocks_per_logical=1,
                                     remote_tp_size=self.prefill_tp)
        w.__dict__.update(
            kv_cache_layout=layout, block_stride_per_layer=[g.block_bytes(size)] * g.regions,
            _group_spec_types=(self.tp.AttentionSpec,) * len(self.decode_groups),
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
        groups = {"region_group_ids": list(self.region_groups)} \
            if len(self.decode_groups) > 1 else {}
        meta = bw.NixlAgentMetadata(
            **groups, engine_id=ENGINE, agent_metadata=prefill.nixl_wrapper.get_agent_metadata(),
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

    def keep(self, request: str = "req-p", lease_s: float = 30.0) -> None:
        """vLLM's scheduler keeps the request's blocks on every prefill rank for the decode
        (with the block ids kvplan's scheduler side adds), through vLLM's ``start_load_kv``."""
        for w in self.prefill:
            keep_for_decode(self.nixl, w, request, [list(g) for g in self.prefill_groups],
                            lease_s)

    def prep(self, d: int) -> list[tuple[Any, Any]]:
        """Decode rank ``d``'s prepped (local, remote) descriptor lists per prefill rank it
        reads, as vLLM's ``add_remote_agent`` builds them (``_build_fa_local``,
        ``_build_local_splits_from_plan`` where a decode rank reads several prefill ranks'
        heads, ``_build_fa_remote``); released by :meth:`close`."""
        decode, plan, g = self.decode[d], self.plans[d], self.g
        agent = getattr(decode.nixl_wrapper, "agent", decode.nixl_wrapper)
        local_all = decode._build_fa_local(decode.kv_caches_base_addr["decode-0"][d], 1)
        split = self.prefill_tp > self.decode_tp and not g.mla
        locals_ = list(decode._build_local_splits_from_plan(
            plan, local_all, g.regions * g.blocks, 1)) if split else None
        out = []
        for i, r in enumerate(plan.all_source_ranks):
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", np.asarray(locals_[i]) if locals_ is not None else local_all,
                mem_type="DRAM")
            remote = agent.prep_xfer_dlist(
                decode._remote_agents[ENGINE][(0, r)],
                decode._build_fa_remote(plan, self.prefill[r]._served_meta, 1), mem_type="DRAM")
            self.prepped.append((decode, local, remote))
            out.append((local, remote))
        return out

    def read(self, d: int, *, vllm_only: bool = False, request: str = "req-d",
             remote_request: str = "req-p", prepped: list[tuple[Any, Any]] | None = None
             ) -> list[Any]:
        """Decode rank ``d``'s reads of the request, one ``_read_blocks`` per prefill rank
        vLLM's TP mapping names (vLLM's ``_read_blocks_for_req`` loop): kvplan's worker's, or
        with ``vllm_only`` vLLM's own, with the lists ``prepped`` (from :meth:`prep`; else
        prepared here); its handles."""
        decode, plan = self.decode[d], self.plans[d]
        for (local, remote), r in zip(self.prep(d) if prepped is None else prepped,
                                      plan.all_source_ranks):
            spec = self.tp.ReadSpec(remote_rank=r,
                                    local_block_ids=[list(g) for g in self.decode_groups],
                                    remote_block_ids=[list(g) for g in self.prefill_groups])
            kwargs = dict(read_spec=spec, dst_engine_id=ENGINE, request_id=request,
                          remote_request_id=remote_request, local_xfer_side_handle=local,
                          local_dram_handle=None, remote_xfer_side_handle=remote,
                          expected_consumers=plan.local_consumers, awaiting_kvs=True)
            cls = decode.__class__
            if vllm_only:
                decode.__class__ = self.nixl.NixlPullConnectorWorker
            try:
                posted = decode._read_blocks(**kwargs)
            finally:
                decode.__class__ = cls
            assert posted is True, f"decode rank {d}'s read of prefill rank {r} was not posted"
        return list(decode._recving_transfers[request])

    def poll(self, d: int, timeout_s: float = 30.0, interval_s: float = 0.005
             ) -> tuple[set[str], set[str]]:
        """vLLM's own ``_pop_done_transfers`` of decode rank ``d`` until a request is done or
        failed."""
        decode = self.decode[d]
        deadline = time.monotonic() + timeout_s
        while True:
            done, failed = decode._pop_done_transfers(decode._recving_transfers)
            if done or failed or time.monotonic() > deadline:
                return done, failed
            time.sleep(interval_s)

    def notifications(self, r: int, want: int, timeout_s: float = 20.0) -> list[bytes]:
        """Prefill rank ``r``'s notifications, once ``want`` came (or the time ran out)."""
        got: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            notifs = self.prefill[r].nixl_wrapper.get_new_notifs()
            got += [n for ns in notifs.values() for n in ns]
            time.sleep(0.005)
        return got

    def close(self) -> None:
        """The prepped lists released, every rank's staging closed and its KV cache
        deregistered from its agent."""
        for decode, local, remote in self.prepped:
            agent = getattr(decode.nixl_wrapper, "agent", decode.nixl_wrapper)
            agent.release_dlist_handle(local)
            agent.release_dlist_handle(remote)
        self.prepped.clear()
        close(*self.prefill, *self.decode)
        for w, mem in [*zip(self.prefill, self.p_mem), *zip(self.decode, self.d_mem)]:
            agent = getattr(w.nixl_wrapper, "agent", w.nixl_wrapper)
            with contextlib.suppress(Exception):  # an agent already gone holds nothing
                agent.deregister_memory(agent.get_reg_descs(
                    [(mem.ctypes.data, mem.nbytes, 0, "")], "DRAM"))
