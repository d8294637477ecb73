"""The prefill's half of the round protocol: :func:`send_staged`."""

from __future__ import annotations

import logging
import queue
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

    def get(self, timeout: float) -> bytes:
        return self._q.get(timeout=max(timeout, 0.0))


def _count(plan: Any) -> tuple[int, int]:
    lengths = plan.lengths
    return int(lengths.sum()) if len(lengths) else 0, int(len(lengths))


class _Send:
    def __init__(self, rounds: Sequence[Any], engine: RoundEngine, peer: str, notify: Notify,
                 request: str, writer: int, acks: AckQueue, gather: Callable[[Any], Any],
                 buffers: int, timeout_s: float, grant: bool) -> None:
        self.rounds, self.engine, self.peer, self.notify = rounds, engine, peer, notify
        self.request, self.writer, self.acks, self.gather = request, writer, acks, gather
        self.buffers, self.timeout_s = buffers, timeout_s
        self.granted = not grant
        self.n = len(rounds)
        self.acked = -1
        #: ``(event, round)`` in the order they happened (the flow-control tests read it).
        self.events: list[tuple[str, int]] = []

    def fail(self, round_index: int | None, reason: str, detail: str, *,
             tell_peer: bool = True) -> StagingError:
        err = StagingError.make(self.request, round_index, reason, detail, writer=self.writer)
        if tell_peer:
            try:
                self.notify(encode(FAIL, self.request, writer=self.writer,
                                   round_index=round_index, n_rounds=self.n,
                                   payload=f"{reason}: {detail}".encode()[:4096]))
            except Exception as exc:  # the peer may be gone: its own timeout fails it
                _log.debug("kvplan: could not tell %s that %r failed: %s", self.peer,
                           self.request, exc)
        return err

    def wait_ack(self, index: int) -> None:
        """Block until the decode acknowledged scattering round ``index`` (``-1``: until it
        granted this stream its share of the decode arena)."""
        deadline = time.monotonic() + self.timeout_s
        while self.acked < index or not self.granted:
            what = "the grant of its arena share" if not self.granted else \
                f"acknowledgement of round {index}"
            try:
                data = self.acks.get(deadline - time.monotonic())
            except queue.Empty:
                raise self.fail(max(index, 0), "timeout", f"no {what} from {self.peer} within "
                                f"{self.timeout_s:g} s") from None
            try:
                m = decode(data)
            except WireError as exc:
                raise self.fail(self.acked + 1, "bad_message", str(exc)) from None
            if m.kind == FAIL:
                raise self.fail(m.round, "peer_failed",
                                m.payload.decode(errors="replace") or "the decode failed",
                                tell_peer=False)
            if m.kind == GRANT and not self.granted and m.request == self.request \
                    and m.writer == self.writer:
                self.granted = True
                self.events.append(("grant", -1))
                continue
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
                            f"{type(exc).__name__}: {exc}", tell_peer=False) from exc
        self.events.append(("notify", index))

    def run(self) -> tuple[int, int]:
        total_bytes = total_blocks = 0
        pending: tuple[int, NetworkHandle] | None = None
        try:
            for k, r in enumerate(self.rounds):
                if int(r.index) != k or not 0 <= int(r.buffer) < self.buffers \
                        or int(r.buffer) != k % self.buffers:
                    raise self.fail(k, "out_of_order", f"round {k} of the plan has index "
                                    f"{r.index} and buffer {r.buffer} ({self.buffers} buffers)")
                if pending is not None and self.buffers == 1:
                    # the only prefill buffer is still being read by round k-1's write
                    done, pending = pending, None  # waited once, whatever finish raises
                    self.finish(*done)
                try:
                    self.gather(r.gather)
                except StagingError:
                    raise
                except Exception as exc:
                    raise self.fail(k, "gather_failed", f"{type(exc).__name__}: {exc}") from exc
                self.events.append(("gather", k))
                if pending is not None:
                    done, pending = pending, None
                    self.finish(*done)
                if k >= self.buffers or not self.granted:
                    # the decode emptied buffer k % buffers (round 0: the share is ours)
                    self.wait_ack(k - self.buffers)
                nbytes, blocks = _count(r.network)
                total_bytes, total_blocks = total_bytes + nbytes, total_blocks + blocks
                try:
                    pending = (k, self.engine.submit_round(r.network, self.peer))
                except Exception as exc:
                    raise self.fail(k, "engine_failed",
                                    f"{type(exc).__name__}: {exc}") from exc
                self.events.append(("submit", k))
            if pending is not None:
                done, pending = pending, None
                self.finish(*done)
            if self.n:
                self.wait_ack(self.n - 1)
        finally:
            if pending is not None:  # an error left a write in flight: its buffer is in use
                try:
                    pending[1].wait()
                except Exception:
                    pass
        return total_bytes, total_blocks


def send_staged(rounds: Sequence[Any], engine: Any, peer: str, notify: Notify, *,
                request: str, acks: AckQueue | Router, gather: Callable[[Any], Any],
                writer: int = 0, buffers: int | None = None, timeout_s: float = 30.0,
                max_blocks_per_batch: int | None = None, grant: bool = True,
                src_lock: Any = None,
                events: list[tuple[str, int]] | None = None) -> SendReport:
    """Send one request's rounds (``Template.plan_rounds``'s ``StagedRounds``) to ``peer``.

    Per round ``k``: ``gather(round.gather)`` copies the request's bytes into the prefill
    arena's buffer ``k % buffers`` (while round ``k-1``'s network write is in flight); round
    ``k``'s network plan is submitted only after the decode acknowledged scattering round
    ``k - buffers`` out of the same decode buffer (flow control), and round 0 only after the
    decode granted this stream its share of the decode arena (one stream per share at a time,
    :class:`kvplan.staging.ArenaShares`); once the write landed,
    ``notify`` carries a round message (``kvplan.staging.wire``) with the round's
    ``RoundManifest``. Returns after the decode acknowledged the last round: every byte is in
    the decode's KV memory.

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
        timeout_s: seconds to wait for the grant or any one acknowledgement.
        grant: wait for the decode's grant before the first write (``False`` only where this
            stream owns its decode share for good).
        src_lock: a lock held for the whole send (the prefill arena's
            :attr:`kvplan.staging.StagingArena.lock`): one request at a time per prefill arena.
        events: when given, the ``(event, round)`` sequence is appended to it (``gather``,
            ``grant``, ``submit``, ``landed``, ``notify``, ``ack``).

    Raises:
        StagingError: the first failure, once, naming the request, round and reason
            (``engine_failed``, ``gather_failed``, ``peer_failed``, ``peer_gone``, ``timeout``,
            ``out_of_order``, ``bad_message``); the decode is told (a failure message) unless it
            is the one that failed or cannot be reached. No write is left in flight.
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
    send = _Send(rounds, round_engine(engine, max_blocks_per_batch=max_blocks_per_batch), peer,
                 notify, request, writer, inbox, gather, n_buffers, timeout_s, grant)
    t0 = time.perf_counter()
    if src_lock is not None:
        src_lock.acquire()
    try:
        nbytes, blocks = send.run()
    finally:
        if src_lock is not None:
            src_lock.release()
        if isinstance(acks, Router):
            acks.close(request, writer)
        if events is not None:
            events.extend(send.events)
    return SendReport(request, send.n, nbytes, blocks, time.perf_counter() - t0)
