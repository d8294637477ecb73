"""The prefill's half of the round protocol: :func:`send_staged`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvplan.staging.errors import StagingError
from kvplan.staging.network import NetworkHandle, RoundEngine, round_engine
from kvplan.staging.router import Router
from kvplan.staging.wire import ACK, FAIL, GRANT, ROUND, WireError, check_stream, decode, encode

__all__ = ["AckQueue", "SendReport", "send_staged"]

_log = logging.getLogger("kvplan.staging")

Notify = Callable[[bytes], object]


@dataclass(frozen=True)
class SendReport:
    """What a staged send moved: rounds, bytes and network blocks over all rounds, seconds
    from the first gather to the last ack."""

    request: str
    rounds: int
    bytes: int
    network_blocks: int
    seconds: float


class AckQueue:
    """The decode's answers to one staged send (what the side channel delivered for its
    stream): :meth:`put` from the listener thread, read by :func:`send_staged`."""

    def __init__(self) -> None:
        self._q: queue.Queue[bytes] = queue.Queue()

    def put(self, data: bytes) -> None:
        self._q.put(bytes(data))

    def get(self, timeout: float | None) -> bytes:
        """The next answer, waiting at most ``timeout`` seconds (``None``: until one comes);
        raises ``queue.Empty``."""
        return self._q.get(timeout=None if timeout is None else max(timeout, 0.0))


def _count(plan: Any) -> tuple[int, int]:
    lengths = plan.lengths
    return int(lengths.sum()) if len(lengths) else 0, int(len(lengths))


class _Ready:
    """Pull mode's network step: nothing to wait on (the decode reads the round)."""

    def wait(self) -> None:
        return None


class _Send:
    def __init__(self, rounds: Sequence[Any], engine: RoundEngine, peer: str, notify: Notify,
                 request: str, writer: int, acks: AckQueue, gather: Callable[[Any], Any],
                 buffers: int, timeout_s: float, grant: bool, pull: bool = False,
                 grant_timeout_s: float | None = None,
                 peer_alive: Callable[[], bool] | None = None) -> None:
        self.rounds, self.engine, self.peer, self.notify = rounds, engine, peer, notify
        self.pull = pull
        self.request, self.writer, self.acks, self.gather = request, writer, acks, gather
        self.buffers, self.timeout_s = buffers, timeout_s
        self.grant_timeout_s, self.peer_alive = grant_timeout_s, peer_alive
        self.granted = not grant
        self._first: StagingError | None = None  # the failure the decode is to be told
        self._told_lock = threading.Lock()
        self.n = len(rounds)
        self.acked = -1
        #: ``(event, round)`` in the order they happened (the flow-control tests read it).
        self.events: list[tuple[str, int]] = []

    def fail(self, round_index: int | None, reason: str, detail: str) -> StagingError:
        """The error for a failure; the first one is also what the decode is told by
        :meth:`tell`, once no write of this stream is in flight any more."""
        err = StagingError.make(self.request, round_index, reason, detail, writer=self.writer)
        with self._told_lock:
            if self._first is None:
                self._first = err
        return err

    def wait_read(self, index: int, previous: int) -> None:
        """Pull mode: block until the decode acknowledged round ``previous`` (the last earlier
        round in the same prefill buffer), which it read out of that buffer before
        acknowledging it, so gathering round ``index`` there overwrites nothing unread."""
        if previous < 0:
            return
        deadline = time.monotonic() + self.timeout_s
        while self.acked < previous:
            try:
                data = self.acks.get(deadline - time.monotonic())
            except queue.Empty:
                raise self.fail(index, "timeout", f"{self.peer} did not read round "
                                f"{previous} out of buffer {self.rounds[index].buffer} "
                                f"within {self.timeout_s:g} s") from None
            self._answer(data)

    def tell(self) -> None:
        """Send the decode the first failure (once): after it, nothing of this stream lands
        in the decode arena, so the decode may give its share to another stream."""
        with self._told_lock:
            err, self._first = self._first, None
        if err is None:
            return
        try:
            self.notify(encode(FAIL, self.request, writer=self.writer, round_index=err.round,
                               n_rounds=self.n,
                               payload=f"{err.reason}: {err.detail}".encode()[:4096]))
        except Exception as exc:  # the peer may be gone: its own timeout ends its side
            _log.debug("kvplan: could not tell %s that %r failed: %s", self.peer,
                       self.request, exc)

    def wait_grant(self) -> None:
        """Block until the decode granted this stream its share of the decode arena. The
        decode queues a stream whose claim overlaps one granted or queued before it, for as
        long as those take (each bounded by its own timeout), and never times it out for
        waiting: so neither does this wait (``timeout_s`` is the patience for progress once
        granted). It ends on the grant, on the decode's failure message (it cancelled or
        failed the stream) or on one the engine's channel puts in when the decode's channel
        closes; with ``peer_alive``, every ``timeout_s`` without an answer it asks whether the
        decode is still there (``peer_gone`` when not); ``grant_timeout_s``, when given,
        bounds it all the same."""
        limit = self.grant_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        while not self.granted:
            step: float | None = None if self.peer_alive is None else self.timeout_s
            if deadline is not None:
                left = deadline - time.monotonic()
                step = left if step is None else min(step, left)
            try:
                data = self.acks.get(step)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise self.fail(0, "timeout", f"no grant of its arena share from "
                                    f"{self.peer} within {limit:g} s") from None
                if self.peer_alive is not None and not self.peer_alive():
                    raise self.fail(0, "peer_gone", f"{self.peer} is gone while this stream "
                                    "waited for the grant of its arena share") from None
                continue
            self._answer(data)

    def wait_ack(self, index: int) -> None:
        """Block until the decode acknowledged scattering round ``index`` (the stream is
        granted: :meth:`wait_grant`)."""
        deadline = time.monotonic() + self.timeout_s
        while self.acked < index:
            try:
                data = self.acks.get(deadline - time.monotonic())
            except queue.Empty:
                raise self.fail(max(index, 0), "timeout", f"no acknowledgement of round {index} "
                                f"from {self.peer} within {self.timeout_s:g} s") from None
            self._answer(data)

    def _answer(self, data: bytes) -> None:
        """One answer of the decode: its grant, or the acknowledgement of the next round;
        anything else fails the send (raised)."""
        try:
            m = decode(data)
        except WireError as exc:
            raise self.fail(self.acked + 1, "bad_message", str(exc)) from None
        if m.kind == FAIL:
            raise self.fail(m.round, "peer_failed",
                            m.payload.decode(errors="replace") or "the decode failed")
        if m.kind == GRANT and not self.granted and m.request == self.request \
                and m.writer == self.writer:
            self.granted = True
            self.events.append(("grant", -1))
            return
        if not self.granted or m.kind != ACK or m.request != self.request \
                or m.writer != self.writer or m.round != self.acked + 1:
            raise self.fail(self.acked + 1, "out_of_order",
                            f"expected the ack of round {self.acked + 1}, got a "
                            f"{m.kind_name} of round {m.round} for {m.request!r} writer "
                            f"{m.writer}")
        self.acked = m.round
        self.events.append(("ack", m.round))

    def finish(self, index: int, handle: NetworkHandle) -> None:
        """Wait on round ``index``'s network write, then tell the decode it landed."""
        try:
            handle.wait()
        except Exception as exc:
            raise self.fail(index, "engine_failed", f"{type(exc).__name__}: {exc}") from exc
        self.events.append(("landed", index))
        r = self.rounds[index]
        try:
            self.notify(encode(ROUND, self.request, writer=self.writer, round_index=index,
                               n_rounds=self.n, buffer=int(r.buffer),
                               payload=r.manifest.to_bytes()))
        except Exception as exc:
            raise self.fail(index, "peer_gone", f"notifying {self.peer} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
        self.events.append(("notify", index))

    def run(self, src_lock: Any = None) -> tuple[int, int]:
        """The rounds (:meth:`_run`), ``src_lock`` held while they run. The decode's grant is
        awaited before ``src_lock`` is taken: a stream holding the prefill arena never waits on
        the decode's arena. Else two streams of one prefill to one decode deadlock until the
        timeout: the decode grants its share (overlapping claims in admission order) to the
        first one opened, whose send waits for the prefill arena, which the second one holds
        while it waits for the grant the decode gives it only after the first one ended."""
        try:
            self._check_plan()
            if self.n and not self.granted:
                self.wait_grant()
            if src_lock is None:
                return self._run()
            with src_lock:
                return self._run()
        except StagingError:
            self.tell()  # every write of the stream has ended: the decode may reuse its share
            raise

    def _check_plan(self) -> None:
        for k, r in enumerate(self.rounds):
            if int(r.index) != k or int(r.buffer) != k % self.buffers:
                raise self.fail(k, "out_of_order", f"round {k} of the plan has index "
                                f"{r.index} and buffer {r.buffer} ({self.buffers} buffers)")

    def _run(self) -> tuple[int, int]:
        """The rounds, granted and checked to be in order: pushed (:meth:`_run_pushed`) or
        pulled (:meth:`_run_pull`); the bytes and network blocks of all of them."""
        if self.pull:
            self._run_pull()
        else:
            self._run_pushed()
        totals = [_count(r.network) for r in self.rounds]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    def _previous(self) -> list[int]:
        """Per round, the last earlier round in the same buffer (-1: none)."""
        previous: list[int] = []
        last_of: dict[int, int] = {}
        for k, r in enumerate(self.rounds):
            previous.append(last_of.get(int(r.buffer), -1))
            last_of[int(r.buffer)] = k
        return previous

    def _gather(self, k: int) -> None:
        """Round ``k``'s gather into its prefill buffer; a failure is ``gather_failed``."""
        try:
            self.gather(self.rounds[k].gather)
        except StagingError:
            raise
        except Exception as exc:
            raise self.fail(k, "gather_failed", f"{type(exc).__name__}: {exc}") from exc
        self.events.append(("gather", k))

    def _run_pull(self) -> None:
        """Pull mode, every step on the calling thread (the decode reads each round itself;
        each step here is short, and a hand-off between threads would cost more than it
        overlaps). Round ``k`` is gathered into its prefill buffer once the decode
        acknowledged the last earlier round in that buffer, which it read out of the prefill
        buffer and scattered out of its own buffer of the same number before acknowledging
        it; then it is announced (the stream was granted its arena share before the prefill
        arena was taken, :meth:`run`). The next round's gather overlaps the decode's read of
        this one. Returns after the decode acknowledged the last round."""
        previous = self._previous()
        for k in range(self.n):
            self.wait_read(k, previous[k])
            self._gather(k)
            self.events.append(("submit", k))
            self.finish(k, _Ready())
        if self.n:
            self.wait_ack(self.n - 1)

    def _run_pushed(self) -> None:
        """Push mode: the rounds through :func:`kvplan.exec.pipeline.run_rounds`: gathers on
        one thread, the network writes (each followed by its round message) on another, and
        the decode's acknowledgements awaited in place of the scatters (which the decode
        runs), so the pipeline's rule that a decode buffer is written only after the last
        round in it was scattered is the flow control."""
        from kvplan.exec.pipeline import RoundFailed, run_rounds

        # rounds through each lane (a lane runs its steps in round order, one at a time)
        gathered, sent, acked = [0], [0], [0]

        def gather(plan: Any) -> None:
            self._gather(gathered[0])
            gathered[0] += 1

        def submit(plan: Any) -> tuple[int, NetworkHandle]:
            k = sent[0]
            try:
                handle = self.engine.submit_round(plan, self.peer)
            except Exception as exc:
                raise self.fail(k, "engine_failed", f"{type(exc).__name__}: {exc}") from exc
            self.events.append(("submit", k))
            return k, handle

        def wait(pending: tuple[int, NetworkHandle]) -> None:
            self.finish(*pending)
            sent[0] += 1

        def ack(plan: Any) -> None:
            self.wait_ack(acked[0])
            acked[0] += 1

        try:
            run_rounds(self.rounds, submit=submit, wait=wait, gather=gather, scatter=ack)
        except RoundFailed as exc:
            cause = exc.__cause__
            if isinstance(cause, StagingError):
                raise cause from cause.__cause__
            reason = {"gather": "gather_failed", "network": "engine_failed"}.get(
                exc.step, "peer_failed")
            raise self.fail(exc.round, reason, f"{type(cause).__name__}: {cause}") from cause


def send_staged(rounds: Sequence[Any], engine: Any, peer: str, notify: Notify, *,
                request: str, acks: AckQueue | Router, gather: Callable[[Any], Any],
                writer: int = 0, buffers: int | None = None, timeout_s: float = 30.0,
                max_blocks_per_batch: int | None = None, grant: bool = True,
                src_lock: Any = None,
                events: list[tuple[str, int]] | None = None,
                pull: bool = False, grant_timeout_s: float | None = None,
                peer_alive: Callable[[], bool] | None = None) -> SendReport:
    """Send one request's rounds (``Template.plan_rounds``'s ``StagedRounds``) to ``peer``.

    Pushed rounds run through :func:`kvplan.exec.pipeline.run_rounds` (gathers, writes and
    the decode's acknowledgements on their own threads); pulled rounds on the calling thread
    (see ``pull``). Per round ``k``: ``gather(round.gather)``
    copies the request's bytes into the prefill arena's buffer ``k % buffers`` (overlapping
    round ``k-1``'s network write where ``buffers`` > 1); round
    ``k``'s network plan is submitted only after the decode acknowledged scattering round
    ``k - buffers`` out of the same decode buffer (flow control), and nothing is gathered
    before the decode granted this stream its share of the decode arena (the bytes its
    rounds land in, which no other granted stream's overlap:
    :class:`kvplan.staging.ArenaShares`); once the write landed, ``notify`` carries a round
    message (``kvplan.staging.wire``) with the round's ``RoundManifest``. Returns after the
    decode acknowledged the last round: every byte is in the decode's KV memory.

    Args:
        rounds: the request's rounds, planned with both peers' arenas of the agreement.
        engine: what :func:`kvplan.staging.round_engine` adapts (a kvplan transport, a Mooncake
            ``Handoff`` or ``TransferEngine``, or an object with ``submit_round``).
        peer: the decode's session (the engine's peer name).
        notify: sends one message to the decode's stream (the engine's side channel).
        request: the request id both sides name the stream by.
        acks: where the decode's answers for this stream arrive: an :class:`AckQueue`, or the
            prefill's :class:`Router` (the stream is opened and closed here).
        gather: runs a round's gather plan (e.g. ``kvplan.copy_local`` from the KV memory into
            the arena).
        writer: this prefill's writer index in the decode arena (hetero TP: one stream each).
        buffers: round buffers of the agreement (default: the rounds' own ``buffers``).
        timeout_s: seconds to wait for any one acknowledgement once granted.
        grant: wait for the decode's grant before the first write (``False`` only where this
            stream owns its decode share for good). The wait has no timeout of its own (the
            decode queues a stream behind others for as long as they take, each bounded by
            its timeout, and never times a queued stream out): it ends on the grant or on a
            failure message, the decode's (it cancelled or failed the stream) or one the
            engine's channel puts into ``acks`` when the decode's channel closes.
        grant_timeout_s: a bound on that wait all the same (``None``: none); a send that gives
            up fails ``timeout`` and tells the decode, whose queued stream then fails
            ``peer_failed``.
        peer_alive: for an engine whose channel does not say when the decode's end closed:
            asked every ``timeout_s`` of that wait without an answer whether the decode is
            still there (e.g. its listener accepts a connection); False fails the send
            ``peer_gone``.
        src_lock: a lock held for the whole send once the decode granted it (the prefill
            arena's :attr:`kvplan.staging.StagingArena.lock`): one request at a time per
            prefill arena, and no stream holds it while it waits for the decode's grant (two
            streams of one prefill to one decode would deadlock until the timeout).
        events: when given, the ``(event, round)`` sequence is appended to it (``gather``,
            ``grant``, ``submit``, ``landed``, ``notify``, ``ack``).
        pull: the decode reads each round out of the prefill arena (an engine whose transfers
            the receiver starts, as vLLM's NIXL connector has): ``engine`` is not used, round
            ``k``'s message says its bytes are gathered into prefill buffer
            ``round.buffer`` (the round's network plan names where), and round ``k``'s gather
            into that buffer waits until the decode acknowledged the last earlier round in it
            (which it read before scattering). Every step runs on the calling thread, one
            after another: each round's gather overlaps the decode's read and scatter of the
            round before, and no step waits on a hand-off between threads. The decode's
            :class:`ReceiveStaged` is given the read as its ``fetch``.

    Raises:
        StagingError: the first failure, once, naming the request, round and reason
            (``engine_failed``, ``gather_failed``, ``peer_failed``, ``peer_gone``, ``timeout``,
            ``out_of_order``, ``bad_message``). The decode is sent one failure message after
            every write of the stream ended (also when the decode failed first: then it says
            the prefill stopped, and the decode may give the share to another stream).
        WireError: a request id or writer index a message cannot carry (nothing sent).
    """
    check_stream(request, writer)
    n_buffers = int(buffers if buffers is not None else getattr(rounds, "buffers", 0) or
                    (max((int(r.buffer) for r in rounds), default=0) + 1))
    inbox: AckQueue
    if isinstance(acks, Router):
        inbox = AckQueue()
        acks.open(request, writer, inbox.put)
    else:
        inbox = acks
    adapted: Any = None if pull else round_engine(engine,
                                                  max_blocks_per_batch=max_blocks_per_batch)
    send = _Send(rounds, adapted, peer, notify, request, writer, inbox, gather, n_buffers,
                 timeout_s, grant, pull, grant_timeout_s, peer_alive)
    t0 = time.perf_counter()
    try:
        nbytes, blocks = send.run(src_lock)
    finally:
        if isinstance(acks, Router):
            acks.close(request, writer)
        if events is not None:
            events.extend(send.events)
    return SendReport(request, send.n, nbytes, blocks, time.perf_counter() - t0)
