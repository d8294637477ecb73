"""One round's network plan handed to a transfer engine without waiting, and waited on later:
the only engine calls the round protocol makes. :func:`round_engine` adapts the engines
kvplan's drop-ins hold."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvplan._errors import TransferError
from kvplan.engines.mooncake import MOONCAKE_STATUS_NAMES, TCP_BLOCKS_PER_PEER

__all__ = ["NetworkHandle", "NixlRoundReader", "RoundEngine", "round_engine"]

_log = logging.getLogger("kvplan.staging")


class NetworkHandle(Protocol):
    def wait(self) -> Any:
        """Block until every block landed; raise (``TransferError``) when one failed."""


class RoundEngine(Protocol):
    def submit_round(self, plan: Any, peer: str) -> NetworkHandle:
        """Start writing ``plan`` (uint64 ``src_addrs``/``dst_addrs``/``lengths``) to
        ``peer``; raise when the submit itself failed."""


def _columns(plan: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.ascontiguousarray(plan.src_addrs, np.uint64),
            np.ascontiguousarray(plan.dst_addrs, np.uint64),
            np.ascontiguousarray(plan.lengths, np.uint64))


def _error(peer: str, batch: int, lengths: np.ndarray, status: Any, what: str) -> TransferError:
    name = MOONCAKE_STATUS_NAMES.get(status, "") if isinstance(status, int) else ""
    err = TransferError(f"mooncake: {what} of batch {batch} ({lengths.size} blocks, "
                        f"{int(lengths.sum())} bytes) to {peer} returned {status!r}"
                        + (f" ({name})" if name else ""))
    err.engine, err.session, err.batch = "mooncake", peer, batch
    err.blocks, err.bytes = int(lengths.size), int(lengths.sum())
    err.status = status if isinstance(status, int) else None
    return err


class _HandoffBatches:
    """A round's batches submitted through a ``Handoff``; each waited on exactly once."""

    def __init__(self, handoff: Any, peer: str, plan: Any, bound: int) -> None:
        self._handoff, self._peer = handoff, peer
        self._ids: list[tuple[int, Any, np.ndarray]] = []
        self._waited = False
        src, dst, lengths = _columns(plan)
        try:
            for index, lo in enumerate(range(0, lengths.size, bound)):
                hi = lo + bound
                batch = handoff.submit(peer, src[lo:hi], dst[lo:hi], lengths[lo:hi])
                if isinstance(batch, int) and batch == 0:
                    raise _error(peer, index, lengths[lo:hi], -1, "submit")
                self._ids.append((index, batch, lengths[lo:hi]))
        except BaseException:
            self._wait_all()  # what was submitted is waited on before the error leaves
            raise

    def _wait_all(self) -> TransferError | None:
        first = None
        ids, self._ids = self._ids, []
        for index, batch, lengths in ids:
            cause: Exception | None = None
            try:
                status = self._handoff.wait(batch)
            except Exception as exc:  # the binding raised: that batch failed
                status, cause = None, exc
            if status != 0 and first is None:
                first = _error(self._peer, index, lengths, status, "write")
                first.__cause__ = cause
        return first

    def wait(self) -> None:
        if self._waited:
            return
        self._waited = True
        failed = self._wait_all()
        if failed is not None:
            raise failed


class _Adapter:
    def __init__(self, submit: Callable[[Any, str], NetworkHandle], name: str) -> None:
        self._submit, self.name = submit, name

    def submit_round(self, plan: Any, peer: str) -> NetworkHandle:
        return self._submit(plan, peer)

    def __repr__(self) -> str:
        return f"<round engine over {self.name}>"


def round_engine(engine: Any, *, max_blocks_per_batch: int | None = None) -> RoundEngine:
    """A :class:`RoundEngine` over what a drop-in holds: a kvplan transport
    (``submit_async``), a ``kvplan.engines.mooncake.Handoff`` (the vLLM and SGLang Mooncake
    drop-ins keep one per engine), Mooncake's ``TransferEngine`` (through a list-path
    ``Handoff``), or anything with ``submit_round`` already. ``max_blocks_per_batch``: blocks per
    Mooncake call (default 1,024, Mooncake TCP's per-peer queue).

    Raises:
        TypeError: ``engine`` is none of these.
    """
    if hasattr(engine, "submit_round"):
        return engine  # type: ignore[no-any-return]
    bound = max_blocks_per_batch or TCP_BLOCKS_PER_PEER
    if hasattr(engine, "submit_async"):
        return _Adapter(lambda plan, peer: engine.submit_async(plan, peer), type(engine).__name__)
    from kvplan.engines.mooncake import Handoff

    if not isinstance(engine, Handoff) and hasattr(engine, "batch_transfer_async_write"):
        engine = Handoff(engine, None)
    if isinstance(engine, Handoff):
        handoff = engine
        return _Adapter(lambda plan, peer: _HandoffBatches(handoff, peer, plan, bound),
                        "Handoff")
    raise TypeError(f"round_engine: {type(engine).__name__} is not a kvplan transport, a "
                    "Mooncake Handoff or TransferEngine, nor has submit_round")


class NixlRoundReader:
    """The decode's read of one pulled round through a NIXL agent (the ``fetch`` of a
    :class:`kvplan.staging.ReceiveStaged` in pull mode): the round's network plan, its
    sources in the prefill's arena (registered with the prefill's agent, named
    ``remote_agent`` here) and its destinations in the decode's arena (registered with
    ``agent``), as one ``READ`` posted and waited on; the handle is always released.

    Raises (from a call):
        TransferError: NIXL refused the read, reported it failed, or it did not complete
            within ``timeout_s`` (naming the peer, the round's blocks and bytes, and the
            state NIXL gave), or ``gone()`` turned true while it was in progress (the
            prefill's side channel closed: the peer is gone, its read is not waited for).
            Where the channel had closed by the time the read failed, however it failed, the
            error says so and has ``peer_gone`` set (the stream then fails ``peer_gone``).
    """

    def __init__(self, agent: Any, remote_agent: str, *, mem_type: str = "DRAM",
                 device: int = 0, timeout_s: float = 30.0, poll_s: float = 0.0002,
                 gone: Callable[[], bool] | None = None) -> None:
        self.agent, self.remote_agent = agent, remote_agent
        self.gone = gone
        self.mem_type, self.device = mem_type, device
        self.timeout_s, self.poll_s = timeout_s, poll_s
        #: Reads posted (one per round).
        self.reads = 0

    def _error(self, lengths: np.ndarray, what: str) -> TransferError:
        gone = self.gone is not None and bool(self.gone())
        if gone and "side channel closed" not in what:
            what += "; the prefill's side channel has closed (the prefill went away)"
        err = TransferError(f"nixl: reading a staged round ({lengths.size} blocks, "
                            f"{int(lengths.sum())} bytes) from {self.remote_agent}: {what}")
        err.engine, err.session, err.peer_gone = "nixl", self.remote_agent, gone
        err.blocks, err.bytes = int(lengths.size), int(lengths.sum())
        return err

    def __call__(self, round_: Any) -> None:
        import time

        from kvplan.engines.nixl.descriptors import descriptor_rows

        src, dst, lengths = _columns(round_.network)
        if not lengths.size:
            return
        agent = self.agent
        try:
            local = agent.get_xfer_descs(descriptor_rows(dst, lengths, self.device),
                                         self.mem_type)
            remote = agent.get_xfer_descs(descriptor_rows(src, lengths, self.device),
                                          self.mem_type)
            handle = agent.initialize_xfer("READ", local, remote, self.remote_agent)
        except Exception as exc:
            raise self._error(lengths, f"initialize_xfer raised {exc!r}") from exc
        try:
            self.reads += 1
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state != "DONE":
                if state == "ERR":
                    raise self._error(lengths, "NIXL reported the read failed (ERR)")
                if time.monotonic() > deadline:
                    raise self._error(lengths, f"not done within {self.timeout_s:g} s "
                                      f"(state {state!r})")
                if self.gone is not None and self.gone():
                    raise self._error(lengths, "the prefill's side channel closed during "
                                      f"the read (state {state!r})")
                time.sleep(self.poll_s)
                state = agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception as exc:
            raise self._error(lengths, f"the read raised {exc!r}") from exc
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception as exc:  # NIXL could not cancel it: the error above says why
                _log.warning("kvplan staging: releasing a read handle to %s failed: %s",
                             self.remote_agent, exc)
