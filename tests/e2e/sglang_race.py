"""A race inside SGLang 0.5.23's Mooncake manager, told apart from kvplan's failures.

The prefill's transfer thread (``MooncakeKVManager.transfer_worker`` in
``sglang/srt/disaggregation/mooncake/conn.py``) ends a room with a check-then-read:
``room not in self.request_status or self.check_status(room) == ...``. The scheduler thread
can drop the room in between; ``check_status`` (``sglang/srt/disaggregation/common/conn.py``,
``return self.request_status[bootstrap_room]``) then raises ``KeyError`` and the thread dies
with ``RuntimeError: Transfer thread failed because of <room>. Prefill instance with
bootstrap_port=<port> is dead.`` From then on that prefill completes no transfer: every request
of the group waits out its timeout. Nothing of kvplan's is on that path.

:func:`transfer_thread_race` recognises exactly that death in a server's log, frame by frame;
:func:`run_group` runs a group of cases and, when the group failed and one of its logs shows
that death, records the first run as an environment failure and runs the group once more (the
second run counts). Any other failure stays a failure. :func:`wait_watching` lets a request
give up as soon as its prefill's log shows the death, instead of waiting out its timeout.

Standard library only, like ``e2e_harness``.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_harness import Results

#: What the thread's last exception says; also a cheap test before parsing a log.
DEAD_SAID = "Transfer thread failed because of"
_DEAD = re.compile(r"Transfer thread failed because of (?P<room>-?\d+)\. Prefill instance with "
                   r"bootstrap_port=\d+ is dead\.")
_HEADER = re.compile(r"^Exception in thread .+:$")
_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line \d+, in (?P<func>\S+)$')
_EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*"
                        r"(?:Error|Exception|Exit|Interrupt|Iteration|Warning)): (?P<msg>.*)$")
_DURING = "During handling of the above exception, another exception occurred:"
_CAUSE = "The above exception was the direct cause of the following exception:"

_MOONCAKE = "/sglang/srt/disaggregation/mooncake/conn.py"
_COMMON = "/sglang/srt/disaggregation/common/conn.py"
_THREADING = "/threading.py"
_READ = "return self.request_status[bootstrap_room]"


@dataclass
class _Frame:
    path: str
    func: str
    line: str  # "N: <the File line>"
    source: str = ""  # the first source line printed under it, stripped
    source_line: str = ""  # "N: <that source line>"


@dataclass
class _Traceback:
    frames: list[_Frame] = field(default_factory=list)
    exc_type: str = ""
    exc_msg: str = ""
    exc_line: str = ""


@dataclass
class _Chain:
    """One uncaught exception of a thread: the header, then tracebacks joined by
    "During handling ..." lines. ``expect`` is what may come next."""

    header: str
    tracebacks: list[_Traceback] = field(default_factory=list)
    joins: list[str] = field(default_factory=list)
    expect: str = "traceback"  # "traceback" | "body" | "after-exception"


def _is_race(chain: _Chain) -> list[str]:
    """The evidence when ``chain`` is the transfer thread dying from ``check_status``'s
    KeyError, and nothing else: every frame is SGLang's transfer worker, its ``check_status``
    or the thread's start in ``threading.py``; no other code (kvplan's included) is on it."""
    if len(chain.tracebacks) != 2 or chain.joins != [_DURING]:
        return []
    first, last = chain.tracebacks
    if [(f.path.endswith(_MOONCAKE), f.func) for f in first.frames] != [
            (True, "transfer_worker"), (False, "check_status")]:
        return []
    read = first.frames[1]
    if not read.path.endswith(_COMMON) or read.source != _READ:
        return []
    if first.exc_type != "KeyError" or not re.fullmatch(r"-?\d+", first.exc_msg):
        return []
    if not last.frames or not last.frames[-1].path.endswith(_MOONCAKE) or \
            last.frames[-1].func != "transfer_worker":
        return []
    if not all(f.path.endswith(_THREADING) for f in last.frames[:-1]):
        return []
    dead = _DEAD.fullmatch(last.exc_msg)
    if last.exc_type != "RuntimeError" or dead is None or dead["room"] != first.exc_msg:
        return []
    return [chain.header, read.line, read.source_line, first.exc_line, last.exc_line]


def transfer_thread_race(text: str) -> list[str]:
    """The evidence lines (``"N: <line>"``, N the line's number in ``text``) when the log
    ``text`` shows SGLang's Mooncake transfer thread dying from the ``KeyError`` its
    ``check_status`` raised for a room the scheduler had already dropped; ``[]`` otherwise.

    Lines the other processes and threads of the server logged in the middle of the traceback
    are skipped. Any other death of the thread (another exception, another frame, kvplan's
    code on the traceback) gives ``[]``."""
    if DEAD_SAID not in text:
        return []
    chain: _Chain | None = None
    for n, raw in enumerate(text.split("\n"), 1):  # numbered as an editor shows them
        line = raw.rstrip()
        if _HEADER.match(line):
            chain = _Chain(header=f"{n}: {line}")
            continue
        if chain is None:
            continue
        tb = chain.tracebacks[-1] if chain.tracebacks else None
        frame = _FRAME.match(line)
        exc = _EXCEPTION.match(line)
        if line == "Traceback (most recent call last):":
            if chain.expect != "traceback":
                chain = None
                continue
            chain.tracebacks.append(_Traceback())
            chain.expect = "body"
        elif frame:
            if chain.expect != "body" or tb is None:
                chain = None
                continue
            tb.frames.append(_Frame(frame["path"], frame["func"], f"{n}: {line.strip()}"))
        elif raw.startswith("    "):  # a frame's source line, or the carets under it
            if chain.expect == "body" and tb is not None and tb.frames and \
                    not tb.frames[-1].source:
                tb.frames[-1].source = line.strip()
                tb.frames[-1].source_line = f"{n}: {line.strip()}"
        elif line in (_DURING, _CAUSE):
            if chain.expect != "after-exception":
                chain = None
                continue
            chain.joins.append(line)
            chain.expect = "traceback"
        elif exc:
            if chain.expect != "body" or tb is None:
                chain = None
                continue
            tb.exc_type, tb.exc_msg, tb.exc_line = exc["type"], exc["msg"], f"{n}: {line}"
            chain.expect = "after-exception"
            found = _is_race(chain)
            if found:
                return found
        # Anything else (a blank line, another process's log line) leaves the chain as it is.
    return []


def race_in_logs(paths: Iterable[Path]) -> str:
    """``"<log> line N: <the RuntimeError line>"`` for the first of ``paths`` whose log shows
    the transfer thread's race (:func:`transfer_thread_race`); ``""`` when none does."""
    for path in paths:
        try:
            text = path.read_bytes().decode(errors="replace")  # "\r" stays inside its line
        except OSError:
            continue
        found = transfer_thread_race(text)
        if found:
            n, line = found[-1].split(": ", 1)
            return f"{path} line {n}: {line.strip()}"
    return ""


class TransferThreadDied(RuntimeError):
    """A request given up because its prefill's transfer thread died of SGLang's race: no
    transfer of that prefill completes any more."""


def wait_watching(futures: Sequence[concurrent.futures.Future[Any]], logs: Sequence[Path],
                  poll_s: float = 2.0) -> None:
    """Wait until every one of ``futures`` is done; while one is not, look at ``logs`` every
    ``poll_s`` seconds and raise :class:`TransferThreadDied` (naming the log and the line) as
    soon as one shows the transfer thread's race. The futures are left running."""
    while True:
        _, pending = concurrent.futures.wait(futures, timeout=poll_s)
        if not pending:
            return
        evidence = race_in_logs(logs)
        if evidence:
            raise TransferThreadDied(
                f"SGLang's transfer thread died (its check_status KeyError race), so this "
                f"prefill completes no transfer any more: {evidence}; the request was given up")


def run_group(results: Results, label: str, run: Callable[[Results, bool], None],
              logs: Callable[[], Sequence[Path]], *, environment: bool = False,
              retry_any_failure: bool = False) -> bool:
    """Run one group of cases: ``run(part, retry)`` starts the group's servers, records its
    cases into ``part`` and stops the servers (``retry`` is True on the second run, which must
    use new servers); ``logs()`` gives the server logs of the run just made.

    When the first run failed (a case, or ``run`` raised) and one of its logs shows SGLang's
    transfer-thread race, the first run is recorded as an environment failure naming the log
    and the line, and the group runs once more; that second run counts, whatever its logs say.
    ``retry_any_failure`` (a set of the engine's own manager) reruns after any failure. A
    failure without either stays a failure, and an exception from ``run`` is raised again
    once its run's cases are counted. ``environment`` marks the group's cases as the
    environment's. Returns whether the group ran twice."""
    attempt = results.part(environment=environment)
    raised: Exception | None = None
    try:
        run(attempt, False)
    except Exception as exc:  # a server or a step outside the cases; decided below
        raised = exc
    evidence = race_in_logs(logs()) if attempt.failed or raised is not None else ""
    if evidence or (retry_any_failure and attempt.failed and raised is None):
        cause = ""
        if evidence:
            cause = (f"SGLang's own Mooncake transfer thread died of its check_status KeyError "
                     f"race ({evidence})")
            if raised is not None:
                attempt.record(f"{label}: the group's run", False,
                               f"{type(raised).__name__}: "
                               f"{(str(raised).strip().splitlines() or [''])[0][:300]}")
        results.note_retry(label, attempt, cause)
        attempt = results.part(environment=environment, suffix=" [retry]")
        try:
            run(attempt, True)
        finally:
            results.absorb(attempt)
        return True
    results.absorb(attempt)
    if raised is not None:
        raise raised
    return False
