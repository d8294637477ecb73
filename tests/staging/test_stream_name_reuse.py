"""A stream name opened again while the decode's periodic check ends the stream of that name
before it: the check ends only the stream it polled (its routing and its entry), never the
new one, whose messages (the prefill's refusal, say) must still reach it."""

from __future__ import annotations

from typing import Any

from kvplan.compat.vllm.staging import WorkerStaging
from kvplan.staging import Router
from kvplan.staging.wire import FAIL, encode

NAME = "req-p@decode-0:tp0"


class Stream:
    """A decode stream as the check sees it: ``poll`` says its state (and may run
    ``meanwhile`` first, what another thread did while the check held it); its messages are
    kept."""

    def __init__(self, state: str, meanwhile: Any = None) -> None:
        self.state, self.meanwhile, self.got = state, meanwhile, []
        self.timeout_s = 30.0

    def poll(self, block: bool = True) -> str:
        if self.meanwhile is not None:
            self.meanwhile()
        return self.state

    def on_message(self, data: bytes) -> None:
        self.got.append(data)


def staging() -> WorkerStaging:
    return WorkerStaging(config=None, arena=None, rank=0)  # type: ignore[arg-type]


def refusal() -> bytes:
    return encode(FAIL, NAME, writer=0, round_index=0, payload=b"pages_mismatch: reused")


def test_a_stream_routed_again_before_it_is_listed_keeps_its_routing() -> None:
    """The new read routes the name, then lists its stream: the check, between the two,
    ends the old stream but leaves the new one's routing."""
    state = staging()
    new = Stream("receiving")
    old = Stream("loaded", meanwhile=lambda: state.router.open(NAME, 0, new.on_message))
    state.router.open(NAME, 0, old.on_message)
    state.receivers[NAME] = old  # type: ignore[assignment]
    state.tick(now=0.0)
    assert state.finished[NAME] is old and NAME not in state.receivers
    assert state.router.deliver(refusal())
    assert len(new.got) == 1 and old.got == []


def test_a_stream_listed_again_is_not_ended_by_the_check_of_the_old_one() -> None:
    """The new read routed and listed its stream while the check polled the old one: the
    check ends neither its entry nor its routing."""
    state = staging()
    new = Stream("receiving")

    def reopened() -> None:
        state.router.open(NAME, 0, new.on_message)
        state.receivers[NAME] = new  # type: ignore[assignment]

    old = Stream("loaded", meanwhile=reopened)
    state.router.open(NAME, 0, old.on_message)
    state.receivers[NAME] = old  # type: ignore[assignment]
    state.tick(now=0.0)
    assert state.receivers[NAME] is new
    assert state.router.deliver(refusal())
    assert len(new.got) == 1 and old.got == []


def test_the_check_still_ends_the_routing_of_the_stream_it_polled() -> None:
    """Without a new stream of that name, the ended stream's stragglers are dropped."""
    state = staging()
    old = Stream("loaded")
    state.router.open(NAME, 0, old.on_message)
    state.receivers[NAME] = old  # type: ignore[assignment]
    state.tick(now=0.0)
    assert NAME not in state.receivers
    assert not state.router.deliver(refusal()) and old.got == []


def test_close_by_handler_leaves_another_handler() -> None:
    router = Router()
    first, second = Stream("loaded"), Stream("receiving")
    router.open(NAME, 0, second.on_message)
    router.close(NAME, handler=first.on_message)
    assert router.deliver(refusal()) and len(second.got) == 1
    router.close(NAME, handler=second.on_message)
    assert not router.deliver(refusal()) and len(second.got) == 1
