"""``Transport.submit_batch(..., timeout=)`` on an engine that cannot bound a wait (Mooncake,
whose batch status call blocks until the batch ends; an engine without ``submit_async``) is
refused with a typed error before any call is posted, never after every call went out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.engines.measure import loopback_transports
from kvplan.testing.oracle import array_pool
from support.engine_peers import require_mooncake
from support.recording_transport import RecordingTransport

PAGES, LAYERS, ITEM = 16, 2, 64


def batch_of(src: np.ndarray, dst: np.ndarray) -> kvplan.BatchPlan:
    t = kvplan.Template(array_pool(src, LAYERS, ITEM), array_pool(dst, LAYERS, ITEM))
    reqs = [(np.array([k], dtype=np.int64), np.array([k + 4], dtype=np.int64))
            for k in (0, 2)]
    return t.plan_batch(reqs)


@pytest.mark.parametrize("timeout", [5, 0.5])
def test_mooncake_refuses_a_batch_timeout_before_posting_anything(timeout: float) -> None:
    require_mooncake()
    src = np.arange(PAGES * LAYERS * ITEM, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros_like(src)
    batch = batch_of(src, dst)
    sender, receiver = loopback_transports("mooncake")
    posted: list[Any] = []
    try:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        receiver.register_buffers([dst.ctypes.data], [dst.nbytes])
        real = sender.submit_async  # type: ignore[attr-defined]

        def counting(*args: Any, **kwargs: Any) -> Any:
            posted.append(args)
            return real(*args, **kwargs)

        sender.submit_async = counting  # type: ignore[attr-defined]
        with pytest.raises(kvplan.KvPlanError, match=r"mooncake: submit_batch cannot honour "
                                                     r"timeout=.*nothing was posted"):
            sender.submit_batch(batch, receiver.local_session_id(), timeout=timeout)
        assert posted == []
        # Without a timeout the same batch goes out and lands.
        outcome = sender.submit_batch(batch, receiver.local_session_id())
        assert outcome.ok and len(posted) == outcome.calls
    finally:
        sender.close()
        receiver.close()
    assert dst.any()


@pytest.mark.parametrize("timeout", [5, 1e-3])
def test_an_engine_without_async_handles_refuses_a_timeout_before_writing(timeout: float) -> None:
    src = np.zeros(PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    t = RecordingTransport()
    with pytest.raises(kvplan.KvPlanError, match="recording: submit_batch cannot honour timeout=.*"
                                                 "writes each call synchronously"):
        t.submit_batch(batch_of(src, dst), "peer", check_sources=False, timeout=timeout)
    assert t.writes == 0


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, "5"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout: object) -> None:
    src = np.zeros(PAGES * LAYERS * ITEM, dtype=np.uint8)
    t = RecordingTransport()
    with pytest.raises(kvplan.KvPlanError, match="timeout must be a positive finite number"):
        t.submit_batch(batch_of(src, src.copy()), "peer", check_sources=False,
                       timeout=timeout)  # type: ignore[arg-type]
    assert t.writes == 0
