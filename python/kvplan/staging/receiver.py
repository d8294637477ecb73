"""The decode's half of the round protocol: :class:`ReceiveStaged`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from kvplan.staging.errors import StagingError
from kvplan.staging.wire import (
    ACK,
    FAIL,
    GRANT,
    ROUND,
    Message,
    WireError,
    check_stream,
    decode,
    encode,
)

__all__ = ["ArenaShares", "Claim", "ReceiveStaged", "arena_claim", "claims_overlap",
           "manifest_difference"]

_log = logging.getLogger("kvplan.staging")

#: RoundManifest fields compared (and named) when two manifests differ, those present.
_MANIFEST_FIELDS = ("index", "n_rounds", "buffer", "sender", "offset", "bytes", "total_bytes",
                    "n_network_blocks", "dst_bytes_range")

State = Literal["receiving", "loaded", "failed"]


def manifest_difference(expected: Any, got: bytes) -> str:
    """What differs between the manifest the decode planned and the bytes the prefill sent:
    the named fields that differ when the bytes parse, else their lengths."""
    try:
        theirs = type(expected).from_bytes(got)
    except Exception as exc:
        return (f"the prefill's manifest ({len(got)} bytes) does not parse ({exc}); the "
                f"decode's is {len(expected.to_bytes())} bytes")
    diffs = []
    for name in _MANIFEST_FIELDS:
        if hasattr(expected, name):
            mine, other = getattr(expected, name), getattr(theirs, name, None)
            if mine != other:
                diffs.append(f"{name} {other!r} from the prefill, {mine!r} planned here")
    return "; ".join(diffs) or "the manifests' bytes differ"


class ReceiveStaged:
    """One staged request stream arriving at the decode.

    The prefill writes nothing before the stream is granted the bytes of the decode arena its
    rounds land in: :meth:`ArenaShares.admit` grants it when no other stream's claim overlaps
    them (or :meth:`grant` where the stream owns its part of the arena for good). Feed every
    message of the stream to :meth:`on_message` (the :class:`Router` does). Round
    ``k``'s message must come next, name the round count and buffer the decode planned and
    carry the very manifest the decode's own round ``k`` has; then ``scatter(round.scatter)``
    copies the round from the decode arena into the KV memory, and ``ack`` tells the prefill
    the buffer is free. After the last round's scatter the stream is loaded, and its
    acknowledgement is sent before :meth:`poll`, :meth:`wait` or ``on_loaded`` (called once)
    says so. Any failure (a mismatch, an unexpected message, the scatter raising, the
    prefill's failure message, :meth:`cancel`, no progress for ``timeout_s`` seen by
    :meth:`poll` or :meth:`wait`) fails the stream once: ``on_failed(StagingError)`` is called,
    the prefill is told (unless it failed first), later messages are ignored and the request
    is never loaded.

    Its patience (``timeout_s`` without progress) starts at its grant, not at its creation:
    a stream queued in :class:`ArenaShares` for its turn never times out for waiting (the
    prefill writes nothing before the grant, so there is no progress to miss). It still fails
    at once when cancelled, when its prefill fails it or its channel ends. The wait is bounded
    all the same: a stream waits only for streams granted or queued before it, each of them
    fails after ``timeout_s`` without progress once granted (its rounds are finite) and gives
    its share up when its prefill confirms it stopped or ``timeout_s`` after it failed, so the
    queue ahead of it drains in bounded time. A stream never admitted counts from its
    creation.

    Args:
        request: the request id the stream is named by.
        rounds: the decode's own plan of the request's rounds (``Template.plan_rounds`` with
            the agreement's arenas; its scatter halves point into this process's memory).
        scatter: runs one round's scatter plan (e.g. ``kvplan.copy_local`` from the arena into
            the KV memory).
        ack: sends one message to the prefill's stream (the side channel).
        writer: the prefill writer this stream comes from.
        timeout_s: seconds without progress before :meth:`poll` / :meth:`wait` fail it.
        clock: monotonic seconds (tests pass a fake).
        fetch: pull mode (the prefill's ``send_staged(..., pull=True)``): reads one round
            (its ``network`` plan, out of the prefill arena into the decode arena) before its
            scatter; raising fails the stream with ``engine_failed``. The ack then also tells
            the prefill its buffer was read.
    """

    def __init__(self, request: str, rounds: Sequence[Any], scatter: Callable[[Any], Any],
                 ack: Callable[[bytes], object], *, writer: int = 0, timeout_s: float = 30.0,
                 on_loaded: Callable[[ReceiveStaged], None] | None = None,
                 on_failed: Callable[[StagingError], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 fetch: Callable[[Any], Any] | None = None) -> None:
        check_stream(request, writer)
        self._fetch = fetch
        self.request, self.rounds, self.writer = request, rounds, writer
        self._scatter, self._ack = scatter, ack
        self._on_loaded, self._on_failed = on_loaded, on_failed
        self.timeout_s, self._clock = timeout_s, clock
        self.n_rounds = len(rounds)
        #: Rounds scattered so far (all of them once loaded).
        self.scattered = 0
        self.state: State = "receiving"
        self.error: StagingError | None = None
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._last_progress = clock()
        self._tail: list[Callable[[], None]] = []
        self._finish_hooks: list[Callable[[], None]] = []
        self._failed_at = 0.0
        #: Whether the prefill was told it may write (:meth:`grant`).
        self.granted = False
        #: Whether it waits in :class:`ArenaShares`' queue for its grant (no timeout then).
        self.queued = False
        if self.n_rounds == 0:
            self.state = "loaded"

    @property
    def loaded(self) -> bool:
        return self.state == "loaded"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    # ------------------------------------------------------------------ messages
    def on_message(self, data: bytes | Message) -> None:
        """Handle one message of this stream (in the caller's thread; the scatter runs here)."""
        with self._lock:
            if self.state != "receiving":
                # a straggler after the end changes nothing for the request, but the
                # prefill's failure message says none of its writes is in flight any more
                if self._finish_hooks and self._is_own_fail(data):
                    self._finished()
            else:
                try:
                    m = data if isinstance(data, Message) else decode(data)
                except WireError as exc:
                    self._fail(self.scattered, "bad_message", str(exc))
                else:
                    self._handle(m)
            tail, self._tail = self._tail, []
        for call in tail:  # callbacks and the failure message, outside the lock
            call()

    def _is_own_fail(self, data: bytes | Message) -> bool:
        try:
            m = data if isinstance(data, Message) else decode(data)
        except WireError:
            return False
        return m.kind == FAIL and m.request == self.request and m.writer == self.writer

    def grant(self) -> None:
        """Tell the prefill the bytes of the decode arena its rounds land in are its own: it
        may write round 0. A stream that already ended sends nothing."""
        with self._lock:
            if self.state != "receiving" or self.granted:
                return
            self.granted, self.queued = True, False
            # its patience starts now: the wait for the share is not the prefill's
            self._last_progress = self._clock()
            self._done.notify_all()  # a :meth:`wait` waiting its turn counts from now
            msg = encode(GRANT, self.request, writer=self.writer, n_rounds=self.n_rounds)
        try:
            self._ack(msg)
        except Exception as exc:
            with self._lock:
                self.granted = False  # the prefill never heard it: nothing of it can land
            self._fail_now(0, "peer_gone", f"granting the arena share failed: "
                           f"{type(exc).__name__}: {exc}", tell_peer=False)

    def _queue(self) -> None:
        """:class:`ArenaShares` queued it: no timeout until its grant."""
        with self._lock:
            if self.state == "receiving" and not self.granted:
                self.queued = True

    def _on_finish(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the stream is loaded or failed (now, if it already is)."""
        with self._lock:
            if self.state == "receiving":
                self._finish_hooks.append(hook)
                return
        hook()

    def _finished(self) -> None:
        """The stream just ended (the lock is held): its hooks run after the lock is
        released."""
        self._tail.extend(self._finish_hooks)
        self._finish_hooks = []

    def _handle(self, m: Message) -> None:
        k = self.scattered
        if m.request != self.request or m.writer != self.writer:
            self._fail(k, "bad_message", f"a message for {m.request!r} writer {m.writer} reached "
                       f"the stream of {self.request!r} writer {self.writer}")
            return
        if m.kind == FAIL:
            self._fail(m.round, "peer_failed",
                       m.payload.decode(errors="replace") or "the prefill failed",
                       tell_peer=False)
            return
        if m.kind != ROUND:
            self._fail(k, "bad_message", f"a {m.kind_name} message reached the decode")
            return
        if not self.granted:
            self._fail(k, "out_of_order", f"round {m.round} arrived before the stream was "
                       "granted its arena share")
            return
        if m.round != k:
            self._fail(k, "out_of_order", f"round {m.round} arrived, round {k} was next")
            return
        if m.n_rounds != self.n_rounds:
            self._fail(k, "manifest_mismatch", f"the prefill sends {m.n_rounds} rounds, "
                       f"{self.n_rounds} planned here")
            return
        r = self.rounds[k]
        if m.buffer != int(r.buffer):
            self._fail(k, "out_of_order", f"round {k} was written into buffer {m.buffer}, "
                       f"planned into buffer {r.buffer}")
            return
        manifest = r.manifest
        if bytes(m.payload) != manifest.to_bytes():
            self._fail(k, "manifest_mismatch", manifest_difference(manifest, m.payload))
            return
        if self._fetch is not None:
            try:
                self._fetch(r)
            except Exception as exc:
                # a read failed by the prefill's going (its error says so) fails the stream
                # peer_gone: the prefill went away, this side's engine did not fail
                gone = bool(getattr(exc, "peer_gone", False))
                self._fail(k, "peer_gone" if gone else "engine_failed",
                           f"reading round {k}: {type(exc).__name__}: {exc}", read_failed=True)
                return
        try:
            self._scatter(r.scatter)
        except Exception as exc:
            self._fail(k, "scatter_failed", f"{type(exc).__name__}: {exc}")
            return
        self.scattered = k + 1
        self._last_progress = self._clock()
        ack = encode(ACK, self.request, writer=self.writer, round_index=k,
                     n_rounds=self.n_rounds, buffer=m.buffer)
        if self.scattered == self.n_rounds:
            self.state = "loaded"
            self._done.notify_all()
            self._finished()
            if self._on_loaded is not None:
                on_loaded = self._on_loaded
                self._tail.append(lambda: on_loaded(self))
            # the last acknowledgement goes out before the lock is released, so before
            # :meth:`poll` or :meth:`wait` (or ``on_loaded``) says the stream is loaded: the
            # engine may then end the request, notify the prefill, close the channel or shut
            # down, and the prefill's send still waits for it (holding its arena)
            self._send_ack(k, ack)
            return
        self._tail.insert(0, lambda: self._send_ack(k, ack))

    def _send_ack(self, k: int, ack: bytes) -> None:
        """Send round ``k``'s acknowledgement: the last round's with the lock held (before
        :meth:`poll` can say the stream is loaded), every other one after the lock is
        released."""
        try:
            self._ack(ack)
        except Exception as exc:
            if k == self.n_rounds - 1:
                # every byte is in place; the prefill's own timeout ends its side
                _log.warning("kvplan: request %r is loaded but its last ack did not reach the "
                             "prefill: %s", self.request, exc)
                return
            with self._lock:
                if self.state == "receiving":
                    self._fail(k, "peer_gone", f"acknowledging round {k} failed: "
                               f"{type(exc).__name__}: {exc}", tell_peer=False)
                tail, self._tail = self._tail, []
            for call in tail:
                call()

    def _fail(self, round_index: int | None, reason: str, detail: str, *,
              tell_peer: bool = True, read_failed: bool = False) -> None:
        """Fail the stream (the lock is held); the callback and the message to the prefill
        run after the lock is released. ``read_failed``: a read of this side's (pull mode)
        failed, and may still land."""
        if self.state != "receiving":
            return
        self.state = "failed"
        err = StagingError.make(self.request, round_index, reason, detail, writer=self.writer)
        self.error = err
        self._failed_at = self._clock()
        self._done.notify_all()
        if reason in ("peer_failed", "timeout") or not self.granted or \
                (self._fetch is not None and not read_failed):
            # the prefill stopped (its failure message comes after its last write ended), or
            # never wrote, or said nothing for the whole timeout; or pull mode, where only
            # this side's reads write the decode arena, each under the lock, so none is in
            # flight now unless one failed (a read given up on may still land)
            self._finished()
        # else the share stays this stream's until the prefill's failure message or the
        # timeout (poll): a write of it may still be landing in the decode arena
        if tell_peer:
            msg = encode(FAIL, self.request, writer=self.writer, round_index=round_index,
                         n_rounds=self.n_rounds, payload=f"{reason}: {detail}".encode()[:4096])

            def tell() -> None:
                try:
                    self._ack(msg)
                except Exception as exc:
                    _log.debug("kvplan: could not tell the prefill that %r failed: %s",
                               self.request, exc)
            self._tail.append(tell)
        if self._on_failed is not None:
            on_failed = self._on_failed
            self._tail.append(lambda: on_failed(err))

    # ------------------------------------------------------------------ ending it otherwise
    def cancel(self, detail: str = "the engine aborted the request") -> None:
        """Fail the stream with reason ``cancelled`` (the engine's abort)."""
        self._fail_now(self.scattered, "cancelled", detail)

    def peer_gone(self, detail: str) -> None:
        """Fail the stream with reason ``peer_gone`` (the prefill's side channel ended: none
        of its messages will come; it is not told). In pull mode (``fetch``) only this side's
        own reads, each under the stream's lock, write the decode arena: the share is free
        once this returns, not a timeout later."""
        with self._lock:
            receiving = self.state == "receiving"
            self._fail(self.scattered, "peer_gone", detail, tell_peer=False)
            if receiving and self._fetch is not None:
                self._finished()
            tail, self._tail = self._tail, []
        for call in tail:
            call()

    def poll(self, *, block: bool = True) -> State:
        """The stream's state, failing it with reason ``timeout`` when no round arrived for
        ``timeout_s`` since its grant or its last round (never while it is queued for its grant,
        see the class); a failed stream whose
        prefill never confirmed it stopped gives its arena share up ``timeout_s`` after it
        failed. With ``block`` False it does not wait while a message is being handled (a
        round read and scattered): ``receiving`` then, checked again at the next poll."""
        if not self._lock.acquire(blocking=block):
            return "receiving"
        try:
            late = self.state == "receiving" and not self.queued and \
                self._clock() - self._last_progress > self.timeout_s
            if self.state == "failed" and self._finish_hooks and \
                    self._clock() - self._failed_at > self.timeout_s:
                self._finished()
            tail, self._tail = self._tail, []
        finally:
            self._lock.release()
        for call in tail:
            call()
        if late:
            self._fail_now(self.scattered, "timeout", f"no round for {self.timeout_s:g} s "
                           f"after round {self.scattered - 1} of {self.n_rounds}")
        return self.state

    def _fail_now(self, round_index: int, reason: str, detail: str, *,
                  tell_peer: bool = True) -> None:
        with self._lock:
            self._fail(round_index, reason, detail, tell_peer=tell_peer)
            tail, self._tail = self._tail, []
        for call in tail:
            call()

    def wait(self, timeout: float | None = None) -> None:
        """Block until loaded (return) or failed (raise its :class:`StagingError`); fail it
        with reason ``timeout`` when no round arrives for ``timeout_s`` (or ``timeout``, when
        given) since its grant or its last round; while it is queued for its grant it waits
        without a timeout (see the class)."""
        limit = self.timeout_s if timeout is None else timeout
        while True:
            with self._lock:
                if self.state == "receiving" and self.queued:
                    self._done.wait()  # its grant or its end notifies
                    continue
                if self.state == "receiving":
                    self._done.wait(timeout=max(0.0, self._last_progress + limit
                                                - self._clock()))
                state = self.state
                late = state == "receiving" and not self.queued and \
                    self._clock() - self._last_progress >= limit
            if late:
                self._fail_now(self.scattered, "timeout", f"no round for {limit:g} s after "
                               f"round {self.scattered - 1} of {self.n_rounds}")
                continue
            if state == "loaded":
                return
            if state == "failed":
                assert self.error is not None
                raise self.error


#: A stream's claim on the decode arena: sorted, disjoint ``[start, end)`` byte ranges.
Claim = tuple[tuple[int, int], ...]


def arena_claim(rounds: Sequence[Any]) -> Claim:
    """The bytes of the decode arena a stream's rounds land in: the union of their manifests'
    ``dst_bytes_range``, as sorted, disjoint ``[start, end)`` ranges (none for no rounds).

    The union, not ``[first start, last end)``: a request of fewer rounds than buffers, or a
    sender whose share lies between another's buffers, leaves bytes of the hull unwritten,
    and those stay free for another stream."""
    manifests = getattr(rounds, "manifests", None)
    if manifests is None:
        manifests = [r.manifest for r in rounds]
    spans = sorted((int(a), int(b)) for a, b in (m.dst_bytes_range for m in manifests) if b > a)
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return tuple(out)


def claims_overlap(x: Claim, y: Claim) -> bool:
    """Whether two claims share a byte."""
    i = j = 0
    while i < len(x) and j < len(y):
        if x[i][0] < y[j][1] and y[j][0] < x[i][1]:
            return True
        if x[i][1] <= y[j][1]:
            i += 1
        else:
            j += 1
    return False


class ArenaShares:
    """Streams write the decode arena at once only where their bytes do not overlap.

    A stream's claim (its share of the arena) is the bytes of the decode arena its rounds
    land in (:func:`arena_claim`: its manifests' ``dst_bytes_range``), whatever writer index
    the wire names: the prefill ranks of one TP pair each write their own sender's share (each
    as writer 0 in vLLM's NIXL reads), prefills of other TP sizes cut the arena into other
    shares, two prefill servers of one TP size have the same ones. :meth:`admit` grants a
    stream at once when its claim overlaps no granted stream's and no queued stream's, else
    queues it. When a granted stream ends (loaded, or failed and its prefill stopped writing,
    see :meth:`ReceiveStaged.poll`) or a queued one ends, the queue is walked in admission
    order: a stream still receiving is granted when its claim overlaps neither a granted
    stream's nor that of a stream queued before it and still waiting. So no two granted
    streams' claims ever overlap, and a stream waits only for streams granted or queued
    before it (none starves)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Granted streams and their claims, in grant order.
        self._held: dict[ReceiveStaged, Claim] = {}
        #: Streams waiting for their grant, in admission order.
        self._queued: list[tuple[ReceiveStaged, Claim]] = []

    def admit(self, receiver: ReceiveStaged) -> bool:
        """Grant ``receiver`` now (True) or once no earlier stream's claim overlaps its own
        (False)."""
        claim = arena_claim(receiver.rounds)
        with self._lock:
            ahead = list(self._held.values()) + [c for r, c in self._queued
                                                 if r.state == "receiving"]
            now = not any(claims_overlap(claim, c) for c in ahead)
            if now:
                self._held[receiver] = claim
            else:
                self._queued.append((receiver, claim))
                receiver._queue()  # its patience waits for its grant
        receiver._on_finish(lambda: self._release(receiver))
        if now:
            receiver.grant()
        return now

    def holders(self) -> list[ReceiveStaged]:
        """The granted streams that still hold their claim, in grant order."""
        with self._lock:
            return list(self._held)

    def queued(self) -> list[ReceiveStaged]:
        """The streams waiting for their grant, in admission order."""
        with self._lock:
            return [r for r, _ in self._queued]

    def _release(self, receiver: ReceiveStaged) -> None:
        with self._lock:
            if self._held.pop(receiver, None) is None:
                at = next((i for i, (r, _) in enumerate(self._queued) if r is receiver), None)
                if at is None:
                    return
                del self._queued[at]  # ended while waiting: never granted
            blocked = list(self._held.values())
            waiting, grants = [], []
            for r, claim in self._queued:
                if r.state != "receiving":
                    continue  # ended while waiting: its own hook finds it gone
                if not any(claims_overlap(claim, c) for c in blocked):
                    self._held[r] = claim
                    grants.append(r)
                else:
                    waiting.append((r, claim))
                blocked.append(claim)
            self._queued = waiting
        for r in grants:  # a grant that fails ends r, whose own hook passes its claim on
            r.grant()
