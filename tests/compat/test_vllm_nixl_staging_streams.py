"""Several staged reads of one prefill at once in ``KvplanNixlConnector`` (pull mode): the
decode grants its arena to streams whose rounds land in the same bytes one at a time, in the
order it opened them, and the prefill serves one stream at a time through its own arena. The
two must not wait on each other: a stream the prefill serves first but the decode grants
second would hold the prefill's arena while waiting for its grant, and the stream granted
first would wait for that arena, both until the staging timeout.

The workers are ``support.vllm_nixl_pair``'s: vLLM's real ``NixlPullConnectorWorker`` under
kvplan's, real NIXL agents (UCX on loopback).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_nixl import (  # noqa: E402
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
)
from support.vllm_nixl_pair import READ_STAGING, Pair, load_agents  # noqa: E402

import kvplan.staging  # noqa: E402
from kvplan.compat.vllm.nixl_staging import StagedRead  # noqa: E402
from kvplan.compat.vllm.nixl_staging.leases import SendLeases  # noqa: E402
from kvplan.staging import AckQueue  # noqa: E402

#: Short enough that the deadlock this guards against fails the test in seconds.
TIMEOUT_S = 3.0


class _Queues:
    """The prefill's ack queues in the order its streams were opened; each says when its
    send first waits for the decode's answer."""

    def __init__(self) -> None:
        self.made: list[Any] = []
        #: Set once the second stream's queue is made.
        self.second = threading.Event()
        queues = self

        class Announced(AckQueue):
            def __init__(self) -> None:
                super().__init__()
                self.waiting = threading.Event()
                queues.made.append(self)
                if len(queues.made) == 2:
                    queues.second.set()

            def get(self, timeout: float) -> bytes:
                self.waiting.set()
                return super().get(timeout)

        self.cls = Announced


@pytest.mark.nixl
def test_a_second_read_served_first_by_the_prefill_does_not_deadlock_the_first(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode reads ``req-pa`` then ``req-pb`` from one prefill (the same decode blocks:
    their rounds land in the same bytes of the decode arena, so the decode grants ``req-pb``
    only once ``req-pa`` is loaded). The prefill's hold on ``req-pa`` is held back until
    ``req-pb``'s send waits for its grant, so the prefill reaches ``req-pb`` first. Both
    reads complete, well before the staging timeout would end them, with vLLM's bytes."""
    queues = _Queues()
    monkeypatch.setattr(kvplan.staging, "AckQueue", queues.cls)
    hold = SendLeases.hold

    def held_back(self: SendLeases, *args: Any, **kwargs: Any) -> None:
        if str(kwargs.get("stream", "")).startswith("req-pa@"):
            # req-pb's stream was opened second: its send waits for the decode's grant
            assert queues.second.wait(30.0) and queues.made[1].waiting.wait(30.0)
        hold(self, *args, **kwargs)

    monkeypatch.setattr(SendLeases, "hold", held_back)
    load_agents(connector, nixl, monkeypatch)
    staging = dict(READ_STAGING, kvplan_staging_timeout_s=TIMEOUT_S)
    pair = Pair(connector, nixl, monkeypatch, staging=staging)
    try:
        pair.read(vllm_only=True)
        assert pair.poll() == ({"req-d"}, set())
        want = pair.d_mem.copy()
        assert want.any()
        pair.d_mem[:] = 0
        for remote in ("req-pa", "req-pb"):
            pair.keep(request=remote)
        reads = [pair.read(request=f"req-d{x}", remote_request=f"req-p{x}")[0]
                 for x in "ab"]
        assert all(isinstance(h, StagedRead) for h in reads)
        done: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 60.0
        while len(done | failed) < 2 and time.monotonic() < deadline:
            d, f = pair.decode._pop_done_transfers(pair.decode._recving_transfers)
            done |= d
            failed |= f
            time.sleep(0.005)
        assert (done, failed) == ({"req-da", "req-db"}, set()), \
            [h.receiver.error for h in reads]
        np.testing.assert_array_equal(pair.d_mem, want)
    finally:
        pair.close()


@pytest.mark.nixl
def test_a_decode_that_ends_once_vllm_saw_its_read_done_ends_no_stream_of_the_prefill(
        nixl: Any, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's polling sees a staged read done only once the decode's last acknowledgement
    went to the prefill: held in the middle of its send, the read is PROC. So a decode that
    ends right after vLLM saw the read done (shuts down, its channel to the prefill closes)
    closes the channel after that acknowledgement, and the prefill's stream ends served, not
    failed (``peer_gone: the decode's staging channel closed``)."""
    from support.log_records import records

    from kvplan.compat.vllm import staging as vstaging
    from kvplan.compat.vllm.nixl_staging.leases import send_leases
    from kvplan.compat.vllm.nixl_staging.lifecycle import close_staging
    from kvplan.staging.wire import ACK, decode

    entered, release = threading.Event(), threading.Event()
    send = vstaging.TcpChannel.send

    def held_last_ack(self: Any, data: bytes) -> None:
        m = decode(data)
        if m.kind == ACK and m.round == m.n_rounds - 1:
            entered.set()
            assert release.wait(30.0)
        send(self, data)

    monkeypatch.setattr(vstaging.TcpChannel, "send", held_last_ack)
    load_agents(connector, nixl, monkeypatch)
    pair = Pair(connector, nixl, monkeypatch)
    decode_closed = False
    try:
        with records("vllm.kvplan.staging") as said:
            (handle,) = pair.read()
            assert isinstance(handle, StagedRead)
            assert entered.wait(30.0)  # the last round is scattered, its ack on its way
            serving = list(send_leases(pair.prefill).streams.values())
            assert len(serving) == 1
            first = pair.decode._pop_done_transfers(pair.decode._recving_transfers)
            if first[0]:  # vLLM saw the read done: the decode may end now
                decode_closed = close_staging(pair.decode)
            release.set()
            if not first[0]:
                assert pair.poll() == ({"req-d"}, set())
            decode_closed = decode_closed or close_staging(pair.decode)
            serving[0][1].join(30.0)
            assert not serving[0][1].is_alive()
        failed = [r.getMessage() for r in said if "failed" in r.getMessage()]
        assert failed == []
        assert first == (set(), set())  # PROC while the last ack was held
        assert send_leases(pair.prefill).streams == {}
    finally:
        release.set()
        pair.close()
