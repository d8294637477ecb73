"""A stream name opened again while the decode's periodic check ends the stream of that name
before it: the check ends only the stream it polled (its routing and its entry), never the
new one, whose messages (the prefill's refusal, say) must still reach it."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvplan.compat.vllm import staging as vstaging
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


# ------------------------------------------------------------------ the decode's own opener
# The tests below open the new stream as the decode does (``WorkerStaging.on_open``, with the
# planning of its rounds stood in for: what is tested is the listing, not the plan).

class Shares:
    def admit(self, receiver: Any) -> bool:
        return True


def opening(name: str = NAME) -> bytes:
    return json.dumps({"stream": name, "writer": 0}).encode()


@pytest.fixture
def decode(monkeypatch: pytest.MonkeyPatch) -> WorkerStaging:
    monkeypatch.setattr(vstaging, "_decode_rounds", lambda staging, opening, worker: (
        None, [SimpleNamespace(scatter=())]))
    monkeypatch.setattr(vstaging, "local_copy", lambda sources, targets: None)
    monkeypatch.setattr(vstaging, "kv_buffers", lambda worker: [])
    state = staging()
    state.config = SimpleNamespace(timeout_s=30.0)  # type: ignore[assignment]
    state.shares = Shares()  # type: ignore[assignment]
    state.arena = SimpleNamespace(array=None)  # type: ignore[assignment]
    return state


class RemovedMeanwhile(dict[str, Any]):
    """The decode's open streams, where ``meanwhile`` runs (once) as the check starts
    removing the ended stream: what another thread did between the check's look at the
    name and its removal of it."""

    def __init__(self, meanwhile: Any) -> None:
        super().__init__()
        self.meanwhile = meanwhile

    def _removing(self) -> None:
        meanwhile, self.meanwhile = self.meanwhile, None
        if meanwhile is not None:
            meanwhile()

    def pop(self, *args: Any) -> Any:
        self._removing()
        return super().pop(*args)

    def __delitem__(self, key: str) -> None:
        self._removing()
        super().__delitem__(key)


def test_a_stream_opened_as_the_check_removes_the_old_one_stays_listed(
        decode: WorkerStaging) -> None:
    """The decode's opener lists the name's new stream in another thread while the check
    removes the ended stream of that name: the new stream stays listed (polled, found by
    name), whichever comes first. The opener's thread is given a moment to run inside the
    window; where the window is closed it waits for the check instead, and the outcome is
    the same whether or not it got to run."""
    replies: list[bytes] = []
    opener = threading.Thread(target=decode.on_open, args=(None, opening(), replies.append))

    def reopened() -> None:
        opener.start()
        opener.join(timeout=0.5)

    old = Stream("loaded")
    decode.receivers = RemovedMeanwhile(reopened)
    decode.router.open(NAME, 0, old.on_message)
    decode.receivers[NAME] = old  # type: ignore[assignment]
    decode.tick(now=0.0)
    opener.join()
    new = decode.receivers.get(NAME)
    assert new is not None and new is not old and new.state == "receiving"
    assert decode.stream(NAME) is new and decode.finished[NAME] is old
    assert decode.router.deliver(refusal()) and new.state == "failed" and old.got == []


def test_a_stream_opened_again_under_a_failed_name_keeps_its_own_patience(
        decode: WorkerStaging) -> None:
    """A failed stream is kept for twice its timeout after the check first saw it failed
    (its poll may still give its arena share up). A stream opened under that name since
    counts from its own failure, not the old one's: the check does not end it at once."""
    old = Stream("failed")
    decode.router.open(NAME, 0, old.on_message)
    decode.receivers[NAME] = old  # type: ignore[assignment]
    decode.tick(now=0.0)  # the old stream failed: kept for now
    assert decode.receivers[NAME] is old
    decode.on_open(None, opening(), lambda data: None)
    new = decode.receivers[NAME]
    assert decode.router.deliver(refusal()) and new.state == "failed"
    decode.tick(now=100.0)  # the new one failed now: kept for its own 60 s
    assert decode.receivers.get(NAME) is new
    decode.tick(now=161.0)
    assert NAME not in decode.receivers and decode.finished[NAME] is new


def test_a_failed_stream_displaced_by_a_new_one_still_gives_its_share_up(
        decode: WorkerStaging, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed stream may hold its share of the decode arena until its poll gives it up
    (``timeout_s`` after it failed: a write of it may still be landing). The name opened
    again meanwhile lists a new stream in its place, queued behind that share: the check
    still polls the old stream, which gives the share up, and the new one is granted."""
    from functools import partial

    from kvplan.staging import ArenaShares, ReceiveStaged
    from support.staging_rounds import claiming

    clock = [0.0]
    monkeypatch.setattr(vstaging, "ReceiveStaged", partial(ReceiveStaged, clock=lambda: clock[0]))
    monkeypatch.setattr(vstaging, "_decode_rounds", lambda staging, opening, worker: (
        None, claiming(2, (0, 100))))
    decode.shares = ArenaShares()
    decode.on_open(None, opening(), lambda data: None)
    old = decode.receivers[NAME]
    assert old.granted
    old.cancel("vLLM aborted the request")  # granted: its share stays a timeout longer
    decode.on_open(None, opening(), lambda data: None)  # read again
    new = decode.receivers[NAME]
    assert new is not old and not new.granted and decode.shares.holders() == [old]
    clock[0] = 31.0  # the old stream's timeout since its failure
    decode.tick(now=31.0)
    assert new.granted and decode.shares.holders() == [new]
    assert decode.receivers[NAME] is new
