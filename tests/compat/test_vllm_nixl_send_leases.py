"""The prefill's hold on a request a staged stream or a held check names
(:meth:`SendLeases.hold`): it waits for vLLM's block ids of the request only where they may
still come, and refuses at once (``not_held``) where they will not.

vLLM's worker keeps a request for a decode in ``_reqs_to_process`` while its batch runs and in
``_reqs_to_send`` from the step whose metadata starts its lease; kvplan's scheduler side sends
the request's block ids with that same metadata, and :meth:`SendLeases.record` reads them
right after vLLM's ``start_load_kv``. The worker here is a stand-in with those two fields; the
lease's lock stands in for the wait, running a step (or refusing to be waited on) instead of
sleeping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvplan.compat.vllm.nixl_staging.leases import SendLeases
from kvplan.staging import StagingError

REQUEST = "req-p"
BLOCKS = [[4, 7, 9]]


class Waits(threading.Condition):
    """The lease's lock: each wait runs ``step`` (what vLLM's next step did meanwhile), or
    fails the test where ``step`` is None (the hold was to answer without waiting)."""

    def __init__(self, step: Callable[[], None] | None) -> None:
        super().__init__()
        self.step, self.waits = step, 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.step is None:
            raise AssertionError(f"the hold waited (for up to {timeout} s)")
        self.step()
        return True


def prefill(*, sending: tuple[str, ...] = (), batch: tuple[str, ...] = ()) -> Any:
    return SimpleNamespace(_reqs_to_send={r: 1e9 for r in sending},
                           _reqs_to_process=set(batch) | set(sending))


def leases_waiting(step: Callable[[], None] | None) -> SendLeases:
    leases = SendLeases()
    leases.lock = Waits(step)
    return leases


def test_a_request_whose_lease_started_without_block_ids_is_refused_at_once() -> None:
    """vLLM holds the request for a decode, but the step that started its lease carried no
    block ids of it (they come with that step only): refused without waiting out the
    timeout, naming the request."""
    worker = prefill(sending=(REQUEST,))
    leases = leases_waiting(None)
    leases.record(worker, {})
    with pytest.raises(StagingError) as refused:
        leases.hold(worker, REQUEST, [7, 9], stream="s", timeout_s=30.0)
    assert refused.value.reason == "not_held" and refused.value.request == "s"
    assert "'req-p'" in refused.value.detail and "will not come" in refused.value.detail
    assert leases.lock.waits == 0 and not leases.pins  # type: ignore[attr-defined]


def test_a_request_still_in_its_batch_is_waited_for_and_held() -> None:
    """The request's batch has not finished here (vLLM keeps it only in
    ``_reqs_to_process``): its ids may still come, so the hold waits, and the step that
    starts its lease brings them."""
    worker = prefill(batch=(REQUEST,))
    leases_box: list[SendLeases] = []

    def lease_started() -> None:  # vLLM's start_load_kv, then kvplan's record
        worker._reqs_to_send[REQUEST] = 1e9
        leases_box[0].record(worker, {REQUEST: BLOCKS})

    leases = leases_waiting(lease_started)
    leases_box.append(leases)
    leases.record(worker, {})  # a step before its batch finished: nothing of it
    leases.hold(worker, REQUEST, [7, 9], stream="s", timeout_s=30.0)
    assert leases.pins == {REQUEST: 1} and leases.lock.waits == 1  # type: ignore[attr-defined]


def test_a_lease_started_before_its_ids_are_read_is_waited_for() -> None:
    """vLLM's ``start_load_kv`` started the lease and kvplan's record of that step has not
    run yet: the ids are on their way (the hold does not refuse it for the step before)."""
    worker = prefill(batch=(REQUEST,))
    leases_box: list[SendLeases] = []
    leases = leases_waiting(lambda: leases_box[0].record(worker, {REQUEST: BLOCKS}))
    leases_box.append(leases)
    leases.record(worker, {})
    worker._reqs_to_send[REQUEST] = 1e9  # vLLM's half of the step, kvplan's to come
    leases.hold(worker, REQUEST, [4, 7, 9], stream="s", timeout_s=30.0)
    assert leases.pins == {REQUEST: 1}


def test_the_refusal_is_forgotten_once_vllm_lets_the_request_go() -> None:
    worker = prefill(sending=(REQUEST,))
    leases = leases_waiting(None)
    leases.record(worker, {})
    assert leases.unrecorded == {REQUEST}
    del worker._reqs_to_send[REQUEST]
    worker._reqs_to_process.clear()
    leases.record(worker, {})
    assert leases.unrecorded == set()
    with pytest.raises(StagingError, match="no longer holds request 'req-p'"):
        leases.hold(worker, REQUEST, [7, 9], stream="s", timeout_s=30.0)
