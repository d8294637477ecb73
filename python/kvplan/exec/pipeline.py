"""Runs a request's rounds (``Template.plan_rounds``) double-buffered.

Each round has three steps: ``gather`` (prefill memory into the prefill round buffer),
``network`` (that buffer into the decode round buffer of the same number, through an engine)
and ``scatter`` (the decode round buffer into the decode's pages). Run one after another, a
round's local copies and its network transfer never overlap; :func:`run_rounds` runs the three
kinds of step on three threads instead, so round ``k``'s network transfer overlaps round
``k - 1``'s scatter and round ``k + 1``'s gather. A round buffer is reused only once it is free:

- a gather into a buffer starts once the network transfer of the last round that used the
  buffer has completed (the engine no longer reads it);
- a network transfer into a decode buffer starts once the scatter of the last round that used
  the buffer has finished (nothing still reads it), and after its own round's gather;
- a scatter starts once its own round's network transfer has completed.

Gathers, network transfers and scatters each run in round order, one at a time. The local copies
default to :func:`kvplan.copy_local` over host buffers (the GIL is released while they run, so
the three threads really overlap); ``gather`` and ``scatter`` replace them (a torch executor, a
recording wrapper). ``submit(network_plan)`` starts a round's network transfer and returns a
handle; ``wait(handle)`` blocks until it completed and raises on failure.

A failure in any step stops the pipeline: no new step starts, every step in flight (a copy, a
submitted transfer) is waited on, and :class:`RoundFailed` (a :class:`kvplan.TransferError`)
names the round and the step, with the original exception as its cause.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

from kvplan import KvPlanError, TransferError, TransferPlan, copy_local

__all__ = ["RoundFailed", "RoundLike", "RoundTiming", "RoundsReport", "Step", "run_rounds"]

#: The steps of one round, in order.
Step = Literal["gather", "network", "scatter"]

#: Engine details a failed transfer carries, copied onto the pipeline's error.
_ENGINE_FIELDS = ("engine", "session", "batch", "blocks", "bytes", "status", "agent", "state")


class RoundLike(Protocol):
    """One round: ``kvplan.StagedRound`` or anything with its five attributes."""

    @property
    def index(self) -> int: ...
    @property
    def buffer(self) -> int: ...
    @property
    def gather(self) -> TransferPlan: ...
    @property
    def network(self) -> TransferPlan: ...
    @property
    def scatter(self) -> TransferPlan: ...


class RoundFailed(TransferError):
    """A step of a round failed; the pipeline stopped after every step in flight ended.

    ``round`` is the failed round's position in the rounds given (``round_index`` its
    ``index``), ``step`` the step that failed, ``n_rounds`` how many rounds there were and
    ``completed`` how many rounds had been scattered. The engine details of a failed transfer
    (``engine``, ``session``, ``status``, ...) are copied from the cause when it had them.
    """

    round: int
    round_index: int
    step: Step
    n_rounds: int
    completed: int


@dataclasses.dataclass(frozen=True)
class RoundTiming:
    """When each step of one round ran: ``(start, end)`` seconds since the pipeline began."""

    index: int
    buffer: int
    bytes: int
    gather: tuple[float, float]
    network: tuple[float, float]
    scatter: tuple[float, float]

    @property
    def gather_s(self) -> float:
        return self.gather[1] - self.gather[0]

    @property
    def network_s(self) -> float:
        return self.network[1] - self.network[0]

    @property
    def scatter_s(self) -> float:
        return self.scatter[1] - self.scatter[0]


@dataclasses.dataclass(frozen=True)
class RoundsReport:
    """What :func:`run_rounds` did: per-round timings, the bytes sent and the elapsed time.

    ``serial_s`` is the sum of every step's time: what running the steps one after another
    would have taken; ``elapsed_s`` below it is the overlap won."""

    rounds: list[RoundTiming]
    bytes: int
    elapsed_s: float

    @property
    def serial_s(self) -> float:
        return sum(r.gather_s + r.network_s + r.scatter_s for r in self.rounds)


_Copy = Callable[[TransferPlan], object]


def _default_copy(what: Step, src: Sequence[Any] | None, dst: Sequence[Any] | None,
                  names: tuple[str, str], threads: int | None) -> _Copy:
    missing = [name for name, value in zip(names, (src, dst)) if value is None]
    if missing:
        raise KvPlanError(f"run_rounds: without a {what} callable, give {' and '.join(missing)} "
                          f"(the host buffers kvplan.copy_local copies between)")
    assert src is not None and dst is not None

    def run(plan: TransferPlan) -> object:
        return copy_local(plan, src, dst, threads=threads)

    return run


def run_rounds(rounds: Iterable[RoundLike], *, submit: Callable[[TransferPlan], Any],
               wait: Callable[[Any], object], gather: _Copy | None = None,
               scatter: _Copy | None = None, src_buffers: Sequence[Any] | None = None,
               src_arena: Any = None, dst_arena: Any = None,
               dst_buffers: Sequence[Any] | None = None,
               threads: int | None = None) -> RoundsReport:
    """Run ``rounds`` with round ``k``'s network transfer overlapping round ``k - 1``'s scatter
    and round ``k + 1``'s gather (the module's docstring has the ordering rules).

    Args:
        rounds: ``Template.plan_rounds``'s ``StagedRounds`` (or a list of its rounds).
        submit: starts a network plan's transfer; returns a handle for ``wait``.
        wait: blocks until the handle's transfer completed; raises on failure.
        gather, scatter: run a local plan; default :func:`kvplan.copy_local` from
            ``src_buffers`` into ``src_arena`` and from ``dst_arena`` into ``dst_buffers``.
        src_buffers, dst_buffers: the prefill's and the decode's memory (buffer objects).
        src_arena, dst_arena: the prefill's and the decode's arena (one buffer object each).
        threads: ``copy_local``'s thread count for the default copies.

    Raises:
        RoundFailed: A step failed (the cause is the step's exception); nothing else was started
            after it, and every step in flight was waited on first.
        KvPlanError: A default copy lacks its buffers.
    """
    do_gather = gather or _default_copy(
        "gather", src_buffers, None if src_arena is None else [src_arena],
        ("src_buffers", "src_arena"), threads)
    do_scatter = scatter or _default_copy(
        "scatter", None if dst_arena is None else [dst_arena], dst_buffers,
        ("dst_arena", "dst_buffers"), threads)
    order: list[RoundLike] = list(rounds)
    n = len(order)
    # The last earlier round using the same buffer (-1: none): its network must have read the
    # prefill buffer before this round's gather writes it, and its scatter must have read the
    # decode buffer before this round's network writes it.
    previous: list[int] = []
    last_of: dict[int, int] = {}
    for k, r in enumerate(order):
        previous.append(last_of.get(r.buffer, -1))
        last_of[r.buffer] = k
    done = {"gather": -1, "network": -1, "scatter": -1}  # last round through each step
    spans: dict[Step, list[tuple[float, float]]] = {
        "gather": [(0.0, 0.0)] * n, "network": [(0.0, 0.0)] * n, "scatter": [(0.0, 0.0)] * n}
    failure: list[tuple[int, Step, BaseException]] = []
    cond = threading.Condition()
    start = time.perf_counter()

    def ready(kind: Step, k: int) -> bool:
        if kind == "gather":
            return done["network"] >= previous[k]
        if kind == "network":
            return done["gather"] >= k and done["scatter"] >= previous[k]
        return done["network"] >= k

    def run(kind: Step, r: RoundLike) -> None:
        if kind == "gather":
            do_gather(r.gather)
        elif kind == "network":
            # The handle is always waited on, so a transfer never outlives the pipeline.
            wait(submit(r.network))
        else:
            do_scatter(r.scatter)

    def lane(kind: Step) -> None:
        """Every round's ``kind`` step in order, each once it is ready; stops at a failure."""
        for k, r in enumerate(order):
            with cond:
                cond.wait_for(lambda: bool(failure) or ready(kind, k))
                if failure:
                    return
            t0 = time.perf_counter() - start
            try:
                run(kind, r)
            except BaseException as exc:
                with cond:
                    failure.append((k, kind, exc))
                    cond.notify_all()
                if not isinstance(exc, Exception):
                    raise  # an interrupt is not a failed round
                return
            spans[kind][k] = (t0, time.perf_counter() - start)
            with cond:
                done[kind] = k
                cond.notify_all()

    workers = [threading.Thread(target=lane, args=(kind,), name=f"kvplan-rounds-{kind}",
                                daemon=True) for kind in ("gather", "scatter")]
    for w in workers:
        w.start()
    try:
        lane("network")
    except BaseException as exc:  # an interrupt: stop the other lanes before it propagates
        with cond:
            failure.append((max(done["network"] + 1, 0), "network", exc))
            cond.notify_all()
        raise
    finally:
        for w in workers:
            w.join()
    if failure:
        first, step, cause = min(failure, key=lambda f: f[0])
        raise _failed(order, first, step, cause, done["scatter"] + 1) from cause
    timings = [RoundTiming(r.index, r.buffer, int(r.network.total_bytes), spans["gather"][k],
                           spans["network"][k], spans["scatter"][k])
               for k, r in enumerate(order)]
    return RoundsReport(timings, sum(t.bytes for t in timings), time.perf_counter() - start)


def _failed(rounds: list[RoundLike], k: int, kind: Step, exc: BaseException,
            completed: int) -> RoundFailed:
    index = rounds[k].index
    err = RoundFailed(f"round {index} ({k + 1} of {len(rounds)}): {kind} failed: "
                      f"{type(exc).__name__}: {exc}; the pipeline stopped after the steps in "
                      f"flight ended ({completed} rounds scattered)")
    err.round, err.round_index, err.step = k, index, kind
    err.n_rounds, err.completed = len(rounds), completed
    for name in _ENGINE_FIELDS:
        value = getattr(exc, name, None)
        if value is not None:
            setattr(err, name, value)
    return err
