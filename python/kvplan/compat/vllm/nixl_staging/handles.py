"""The handles vLLM polls for kvplan's reads, and the agent that answers vLLM's polling.

Each waits in ``_recving_transfers`` where vLLM's NIXL handle would be: :class:`StagedRead` (a
staged read), :class:`AbortedRead` (one stopped before it started), :class:`RefusedRead` (a
direct read the held check refused) and :class:`HeldRead` (a direct read waiting for the held
check, then vLLM's own read); :class:`StagingAgent` answers vLLM's handle calls for them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvplan.compat.vllm.nixl_staging.worker import _staging_log, worker_staging


#: What a staged read stopped on vLLM's abort says (its stream's ``cancelled`` detail).
ABORTED_DETAIL = "vLLM finished the request during its staged read"


class StagedRead:
    """vLLM's handle of one staged read (in ``_recving_transfers`` where a NIXL handle would
    be): its state, asked by vLLM's own ``_pop_done_transfers`` through the worker's agent
    (:class:`StagingAgent`), is ``PROC`` until the last round's scatter, then ``DONE`` once
    vLLM's notification went to the prefill (``notify``), or ``ERR`` once the stream failed
    (vLLM's failed-receive path then runs; :attr:`verdict` names the blocks not written)."""

    def __init__(self, request: str, receiver: Any, notify: Any, template: Any,
                 rounds: Any, state: Any, *, peer: str = "?",
                 direct_descriptors: int | None = None, regroup: Any = None) -> None:
        self.request, self.receiver, self.template, self.rounds = request, receiver, \
            template, rounds
        self._notify, self._state = notify, state
        #: The prefill engine and rank read from (for the read's log line).
        self.peer = peer
        #: The descriptors vLLM's own READ of the same blocks would take: one per block and
        #: KV region (None: not known).
        self.direct_descriptors = direct_descriptors
        #: Files a verdict's pages under vLLM's KV groups where the template's pools are not
        #: them (a read of several groups: :meth:`GroupedRead.regroup`); None: pool = group.
        self.regroup = regroup
        self.notified = False
        #: Set once :meth:`abort` stopped the read (vLLM finished the request during it).
        self.aborted = False
        self._stopping: threading.Thread | None = None
        #: The failure verdict (set once the stream failed, before vLLM sees ``ERR``): the
        #: blocks not written.
        self.verdict: Any = None
        self._verdict_lock = threading.Lock()
        self._judged = False
        self.started = time.monotonic()
        self.ended: float | None = None

    def state(self) -> str:
        """``PROC``, ``DONE`` or ``ERR``, as NIXL's ``check_xfer_state`` says them. vLLM's
        step polls this: it never waits for a round being read and scattered (``PROC``
        then, the next poll sees the round's outcome)."""
        # every open stream's timeout, ended streams closed; a busy one at the next check
        self._state.tick(block=False)
        if self._stopping is not None and self._stopping.is_alive():
            return "PROC"  # vLLM's abort: the round in progress ends first
        current = self.receiver.poll(block=False)
        if current == "loaded":
            if not self.notified:
                self.notified = True
                self.ended = time.monotonic()
                self._notify()
                self._said_done()
            return "DONE"
        if current == "failed":
            if self.aborted:  # stopped on vLLM's abort: nothing of it is in flight
                if not self.notified:
                    self.notified = True
                    self._notify()  # the prefill frees the request
                return "DONE"
            if self.receiver.error is not None:
                self.failed(self.receiver.error)
            return "ERR"
        return "PROC"

    def abort(self, detail: str = ABORTED_DETAIL) -> bool:
        """vLLM finished the request (aborted it, or freed it otherwise) while this read was
        in progress: stop the stream at the next round boundary, on a thread of its own so
        vLLM's step does not wait for it (a round being read and scattered now ends first; no
        later round is read or scattered), and tell the prefill the stream is cancelled (its
        send stops and its hold on the request ends). Until it stopped vLLM's polling sees
        ``PROC``; then ``DONE``, not its failed-receive path (nothing failed), once vLLM's
        notification went to the prefill, as vLLM's own read sends it when done, so the
        prefill frees the request. vLLM then frees the decode's blocks, which nothing of this
        read writes any more. Whether a stop was started (False: the read had already ended,
        or is stopping)."""
        if self.receiver.state != "receiving" or self._stopping is not None:
            return False
        self._stopping = threading.Thread(target=self._stop, args=(detail,), daemon=True,
                                          name=f"kvplan-staging-abort-{self.request}")
        self._stopping.start()
        return True

    def _stop(self, detail: str) -> None:
        self.receiver.cancel(detail)  # waits for a round's scatter in progress
        error = self.receiver.error
        if self.receiver.failed and error is not None and error.reason == "cancelled" \
                and error.detail == detail:
            self.ended = time.monotonic()
            self.aborted = True
            _staging_log.info(
                "kvplan staging: req %s finished by vLLM during its staged read from %s: "
                "stopped after %d of %d rounds", self.request, self.peer,
                self.receiver.scattered, len(self.rounds))
        # else it ended otherwise first (loaded, or failed): vLLM's polling sees that

    def _said_done(self) -> None:
        """One INFO line per staged read, once its last round is scattered: the rounds, the
        network reads they took (one per round) against the descriptors vLLM's own READ of
        the same blocks takes, the bytes and the seconds from the read's start."""
        ended = self.ended if self.ended is not None else time.monotonic()
        direct = "?" if self.direct_descriptors is None else str(self.direct_descriptors)
        _staging_log.info(
            "kvplan staging: req %s read staged from %s: %d rounds, %d network reads "
            "(vLLM's read: %s descriptors), %d bytes in %.3f s", self.request, self.peer,
            len(self.rounds), len(self.rounds), direct,
            sum(int(r.manifest.bytes) for r in self.rounds), ended - self.started)

    def failed(self, error: Any) -> None:
        """The stream's failure: its verdict (the decode blocks of the rounds not scattered),
        made and logged once (by the stream's failure callback or vLLM's poll, whichever
        comes first)."""
        from kvplan.failures import verdict_for_unscattered_rounds

        with self._verdict_lock:  # vLLM sees ERR only once the verdict exists
            if self._judged:
                return
            self._judged = True
            self.ended = time.monotonic()
            try:
                self.verdict = verdict_for_unscattered_rounds(
                    self.request, self.template, self.rounds, self.receiver.scattered,
                    reason=f"{error.reason}: {error.detail}")
                if self.regroup is not None:
                    self.verdict = self.regroup(self.verdict)
            except Exception as exc:  # the request still fails as a whole
                _staging_log.error("kvplan staging: no failure verdict for %r: %s",
                                   self.request, exc)
                return
        _staging_log.warning("kvplan staging: %s; vLLM's failed-receive path", self.verdict)

    def telemetry(self) -> Any:
        """What vLLM's stats record of a finished read (NIXL's telemetry fields, in µs): the
        staged request's bytes and its network blocks (one read per round)."""
        import types

        ended = self.ended if self.ended is not None else time.monotonic()
        # an aborted read counts the rounds it read
        rounds = [self.rounds[k] for k in range(self.receiver.scattered)] if self.aborted \
            else list(self.rounds)
        total = sum(int(r.manifest.bytes) for r in rounds)
        return types.SimpleNamespace(xferDuration=(ended - self.started) * 1e6,
                                     postDuration=0.0, totalBytes=total,
                                     descCount=len(rounds))


def _no_transfer_telemetry() -> Any:
    """NIXL telemetry for a handle that moved nothing (vLLM reads it when the handle is done)."""
    import types

    return types.SimpleNamespace(xferDuration=0.0, postDuration=0.0, totalBytes=0, descCount=0)


class AbortedRead:
    """vLLM's handle of a staged read stopped before it started (vLLM finished the request
    first, :func:`stop_aborted_reads`): ``DONE`` at once, nothing read, no verdict."""

    verdict: Any = None

    def state(self) -> str:
        return "DONE"

    def telemetry(self) -> Any:
        return _no_transfer_telemetry()


class RefusedRead:
    """vLLM's handle of a direct read kvplan did not start (:func:`check_held`): the prefill
    refused to hold the request, or could not be asked. vLLM's polling sees ``ERR`` at once
    and takes its failed-receive path; :attr:`verdict` names the blocks not written (every
    block the read was to write: none was)."""

    def __init__(self, verdict: Any) -> None:
        self.verdict = verdict

    def state(self) -> str:
        return "ERR"

    def telemetry(self) -> Any:
        return _no_transfer_telemetry()


class HeldRead:
    """vLLM's handle of a direct read waiting for the prefill's answer to its held check
    (:func:`check_held`), in ``_recving_transfers`` where vLLM's read's NIXL handle would be.
    vLLM's polling of it (``check_xfer_state`` through :class:`StagingAgent`, on vLLM's own
    thread, the one its reads start on) sees ``PROC`` while the answer is pending; on the
    prefill's acknowledgement that poll starts vLLM's own read (:attr:`start`) and from then on
    this handle answers for that read's NIXL handles (their state, telemetry and release),
    noted as the worker's agent made them (:meth:`StagingAgent.recording`), vLLM's
    ``_recving_transfers`` left as it was;
    on a refusal, a bad answer, a closed channel or no answer within :attr:`wait_s` it says
    ``ERR`` with a :attr:`verdict` naming every block the read was to write (nothing was
    read), as :class:`RefusedRead` does. :attr:`clock` is the clock of that wait."""

    def __init__(self, worker: Any, request: str, remote_request: str, session: str,
                 stream: str, blocks: dict[int, tuple[int, ...]], start: Any,
                 wait_s: float) -> None:
        self.worker, self.request, self.remote_request = worker, request, remote_request
        self.session, self.stream, self.blocks = session, stream, blocks
        self.start, self.wait_s = start, wait_s
        self.clock: Any = time.monotonic
        self.asked = self.clock()
        #: The channel the question went on (its closing fails the check at once).
        self.channel: Any = None
        self._answer: list[Any] = []
        #: The prefill's answer, as this handle's polling took it: None while pending,
        #: ``"held"``, or ``"refused"``.
        self.outcome: str | None = None
        #: vLLM's read's NIXL handles once it started (None before): every handle its
        #: ``_read_blocks`` made and did not release itself, each released once by
        #: :meth:`release`.
        self.handles: list[Any] | None = None
        #: Those of :attr:`handles` whose transfer vLLM posted (or tried to): the ones polled.
        self.in_flight: list[Any] = []
        #: Whether vLLM's ``_read_blocks`` posted its read (False: vLLM routed the request to
        #: its failure reporting when posting it, or it raised).
        self.posted: bool | None = None
        #: What vLLM's ``_read_blocks`` raised, if it did (its READs in flight are polled to
        #: their end, then the request takes vLLM's failed-receive path).
        self.start_error: Exception | None = None
        self.verdict: Any = None

    def answered(self, answer: Any) -> None:
        """The prefill's answer (a decoded message, or what failed to decode); the first
        counts. Called on the channel's reader thread."""
        self._answer.append(answer)

    def _agent(self) -> Any:
        return _agent(self.worker)

    def state(self) -> str:
        if self.outcome is None:
            self._judge()
        if self.outcome == "refused":
            return "ERR"
        if self.outcome is None:
            return "PROC"
        if self.handles is None:
            self._start()
        if self.start_error is None and not self.posted and not self.in_flight:
            # vLLM's read failed to start: its start-up failure path counted the failed
            # transfer and reports the request failed; this handle ends without counting it
            # again (``DONE`` with no telemetry: vLLM records no transfer for it; a handle it
            # kept is released with this one)
            return "DONE"
        # a READ posted before vLLM's read raised is polled to its end like the others:
        # vLLM frees the request's blocks only once this handle is no longer PROC
        states = [self._agent().check_xfer_state(h) for h in self.in_flight]
        if any(s not in ("DONE", "PROC") for s in states):
            return "ERR"
        if "PROC" in states:
            return "PROC"
        return "DONE" if self.posted else "ERR"

    def _judge(self) -> None:
        from kvplan.failures import FailureVerdict
        from kvplan.staging.wire import ACK, FAIL, Message

        got = self._answer[0] if self._answer else None
        if isinstance(got, Message) and got.kind == ACK:
            self.outcome = "held"
            self._close()
            return
        if isinstance(got, Message) and got.kind == FAIL:
            reason = f"peer_failed: {got.payload.decode(errors='replace')}"
        elif isinstance(got, Message):
            reason = f"bad_message: a {got.kind_name} message answered the held check"
        elif got is not None:
            reason = f"bad_message: the held check's answer could not be read ({got})"
        elif getattr(self.channel, "closed", False):
            reason = (f"unreachable: the staging channel to {self.session} closed before it "
                      "answered the held check")
        elif self.clock() - self.asked >= self.wait_s:
            reason = f"timeout: {self.session} did not answer the held check within " \
                     f"{self.wait_s:g} s"
        else:
            return
        self.outcome = "refused"
        self._close()
        self.verdict = FailureVerdict(self.request, self.blocks, reason)
        _said_refused(self.verdict, self.remote_request)

    def _close(self) -> None:
        state = worker_staging(self.worker)
        if state is not None:
            state.router.close(self.stream)

    def _start(self) -> None:
        """vLLM's own read, started on this (vLLM's polling) thread. The NIXL handles it
        makes are noted by the worker's agent as they are made (:meth:`StagingAgent.recording`)
        and become this handle's, even where vLLM's ``_read_blocks`` raised after making them;
        vLLM's ``_recving_transfers`` stays the same dict throughout, its entry for the request
        as it was (what vLLM's read listed there is this handle's: polled and released through
        it, once)."""
        worker = self.worker
        agent = worker.nixl_wrapper
        if not isinstance(agent, StagingAgent):
            raise TypeError(f"the held read of {self.request!r} starts vLLM's read through "
                            f"kvplan's StagingAgent, not {type(agent).__name__}")
        transfers = worker._recving_transfers
        listed = self.request in transfers  # without adding the key to vLLM's defaultdict
        error: Exception | None = None
        with agent.recording() as record:
            try:
                self.posted = bool(self.start())
            except Exception as exc:  # its READs in flight stay polled (state), then ERR
                self.posted, error = False, exc
            finally:
                self.handles, self.in_flight = list(record.made), list(record.posted)
                _take_back(transfers, self.request, self.handles, listed)
        if error is not None:
            self._start_failed(error)

    def _start_failed(self, error: Exception) -> None:
        """vLLM's ``_read_blocks`` raised after the prefill held the request (its own
        failure reporting did not run): the request fails with a verdict naming every block
        the read was to write (a READ it posted may have written some, none is known
        loaded), once the READs it posted ended."""
        from kvplan.failures import FailureVerdict

        self.start_error = error
        self.verdict = FailureVerdict(
            self.request, self.blocks,
            f"engine_failed: vLLM's read after the held check raised "
            f"({type(error).__name__}: {error})")
        _staging_log.warning(
            "kvplan staging: %s; vLLM's failed-receive path once its %d READs in flight "
            "ended (prefill request %s)", self.verdict, len(self.in_flight),
            self.remote_request, exc_info=error)

    def telemetry(self) -> Any:
        """vLLM's read's telemetry (its one NIXL handle's; summed over several); None when
        vLLM's read failed to start (vLLM records nothing for it)."""
        import types

        agent = self._agent()
        found = [agent.get_xfer_telemetry(h) for h in self.in_flight]
        if not found and self.posted is False:
            return None
        if len(found) == 1:
            return found[0]
        return types.SimpleNamespace(
            xferDuration=sum(float(t.xferDuration) for t in found),
            postDuration=sum(float(t.postDuration) for t in found),
            totalBytes=sum(int(t.totalBytes) for t in found),
            descCount=sum(int(t.descCount) for t in found))

    def release(self) -> None:
        """Release vLLM's read's NIXL handles (vLLM releases this one when done or failed);
        a handle whose release raises stays, and the error goes to vLLM, which keeps this
        handle and tries again."""
        agent = self._agent()
        while self.handles:
            handle = self.handles[0]
            agent.release_xfer_handle(handle)
            self.handles.pop(0)
            self.in_flight = [h for h in self.in_flight if h is not handle]
        if self.outcome is None:  # released before any answer (vLLM's shutdown)
            self.outcome = "refused"
            self._close()


def _take_back(transfers: Any, request: str, handles: list[Any], listed: bool) -> None:
    """vLLM's ``_recving_transfers`` entry for ``request`` as it was before vLLM's read
    started: the ``handles`` vLLM's read listed there are the held read's now. Changed in
    place: vLLM's polling may be iterating that very list (the held read's poll started the
    read), and what vLLM's read appended lies past the held read's position in it. An entry
    vLLM's read added (``listed`` False) goes again once empty."""
    entry = transfers.get(request)
    if entry is None:
        return
    kept = [h for h in entry if not _holds(handles, h)]
    if len(kept) != len(entry):
        entry[:] = kept
    if not listed and not entry:
        del transfers[request]


def _holds(handles: list[Any], handle: Any) -> bool:
    # by identity: NIXL's handles compare so; a stand-in's may be equal ints
    return any(h is handle for h in handles)


class ReadRecord:
    """The NIXL transfer handles vLLM's read makes on one thread while a :class:`HeldRead`
    starts it (:meth:`StagingAgent.recording`): :attr:`made` (less those vLLM released
    itself during the start) and :attr:`posted`, those of them whose transfer it posted or
    tried to (a post that raised may still be in flight)."""

    def __init__(self) -> None:
        self.made: list[Any] = []
        self.posted: list[Any] = []

    def note_made(self, handle: Any) -> None:
        self.made.append(handle)

    def note_posted(self, handle: Any) -> None:
        if _holds(self.made, handle) and not _holds(self.posted, handle):
            self.posted.append(handle)

    def note_released(self, handle: Any) -> None:
        self.made = [h for h in self.made if h is not handle]
        self.posted = [h for h in self.posted if h is not handle]


def _said_refused(verdict: Any, remote_request_id: str) -> None:
    # the staged read's verdict line (one form for both), then what was asked
    _staging_log.warning("kvplan staging: %s; vLLM's failed-receive path (the held check "
                         "before vLLM's read of prefill request %s: nothing read)", verdict,
                         remote_request_id)


class StagingAgent:
    """The decode worker's ``nixl_wrapper`` with staging on: vLLM's NIXL agent, but the
    handle calls vLLM makes while polling (``check_xfer_state``, ``get_xfer_telemetry``,
    ``release_xfer_handle``) answer for a :class:`StagedRead` themselves; everything else
    (and every NIXL handle) goes to the agent. While a :class:`HeldRead` starts vLLM's read
    (:meth:`recording`, on that thread) the transfer handles the agent makes, posts and
    releases for it are noted."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self._thread = threading.local()

    @contextlib.contextmanager
    def recording(self) -> Iterator[ReadRecord]:
        """Note, until the block ends, the transfer handles made on this thread
        (``make_prepped_xfer``, ``initialize_xfer``), the posts (``transfer``) and the
        releases of them; another thread's (a handshake's, a staged read's) are not."""
        outer = getattr(self._thread, "record", None)
        record = self._thread.record = ReadRecord()
        try:
            yield record
        finally:
            self._thread.record = outer

    def _record(self) -> ReadRecord | None:
        record: ReadRecord | None = getattr(self._thread, "record", None)
        return record

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.agent.make_prepped_xfer(*args, **kwargs)
        record = self._record()
        if record is not None:
            record.note_made(handle)
        return handle

    def initialize_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.agent.initialize_xfer(*args, **kwargs)
        record = self._record()
        if record is not None:
            record.note_made(handle)
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        record = self._record()
        if record is not None:  # noted first: a post that raises may be in flight
            record.note_posted(handle)
        return self.agent.transfer(handle, *args, **kwargs)

    def check_xfer_state(self, handle: Any) -> Any:
        if isinstance(handle, (StagedRead, RefusedRead, HeldRead, AbortedRead)):
            return handle.state()
        return self.agent.check_xfer_state(handle)

    def get_xfer_telemetry(self, handle: Any) -> Any:
        if isinstance(handle, (StagedRead, RefusedRead, HeldRead, AbortedRead)):
            return handle.telemetry()
        return self.agent.get_xfer_telemetry(handle)

    def release_xfer_handle(self, handle: Any) -> Any:
        if isinstance(handle, HeldRead):  # vLLM's own read's NIXL handles, if it started
            return handle.release()
        if isinstance(handle, (StagedRead, RefusedRead, AbortedRead)):
            return None  # nothing of NIXL's to release: each round's read released its own
        out = self.agent.release_xfer_handle(handle)
        record = self._record()
        if record is not None:  # released by vLLM's read itself: not the held read's
            record.note_released(handle)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)


def _agent(worker: Any) -> Any:
    wrapper = worker.nixl_wrapper
    return wrapper.agent if isinstance(wrapper, StagingAgent) else wrapper
