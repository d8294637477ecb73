"""The replacement for ``MooncakeConnectorWorker._send_blocks``: the plan's columns to the
engine in bounded batches, natively through the worker's
:class:`kvplan.engines.mooncake.Handoff` or as the lists ``batch_transfer_sync_write`` takes,
with vLLM's stats and logging; :func:`handoff` says which path a worker took and why.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from kvplan.engines.mooncake import Handoff

# The package's logger: the drop-in's lines keep the name they were always logged under.
logger = logging.getLogger("kvplan.compat.vllm")

#: Entries per ``batch_transfer_sync_write`` call (Mooncake's TCP transport refuses batches past
#: about 2,048 entries per peer; RDMA has no such cap).
DEFAULT_MAX_BLOCKS_PER_BATCH = 1024


def _send_blocks(self: Any, remote_session: str, src_ptrs: Any, dst_ptrs: Any,
                 lengths: Any) -> int:
    cap = getattr(self, "kvplan_max_blocks_per_batch", DEFAULT_MAX_BLOCKS_PER_BATCH)
    arrays = all(isinstance(c, np.ndarray) for c in (src_ptrs, dst_ptrs, lengths))
    handoff = _handoff(self)
    native = arrays and handoff.native() is not None  # bound and self-tested at first use
    start = time.perf_counter()
    if native:
        # The plan's uint64 columns go to the native engine as they are (one request array
        # per batch filled in Rust, GIL released for the submit and the wait; batches are
        # views, not copies): no Python int per block. An empty plan is no call.
        n = len(src_ptrs)
        total = int(lengths.sum())
        ret = handoff.write_batches(remote_session,
                                    np.ascontiguousarray(src_ptrs, dtype=np.uint64),
                                    np.ascontiguousarray(dst_ptrs, dtype=np.uint64),
                                    np.ascontiguousarray(lengths, dtype=np.uint64), cap)
        self.__dict__[_HANDOFF_ATTR] = "native"
    else:
        # Mooncake's binding takes Python lists of ints (a numpy array would be read element
        # by element as numpy scalars, slower still): each column is converted once, in C,
        # and a batch is a slice of those lists. Empty lists are still one call, as vLLM's
        # ``_send_blocks`` makes it.
        src = _as_list(src_ptrs)
        dst = _as_list(dst_ptrs)
        lens, total = _lengths_list(lengths)
        n = len(src)
        ret = int(handoff.write_batches(remote_session, src, dst, lens, cap, call_empty=True))
        self.__dict__[_HANDOFF_ATTR] = "lists"
    duration = time.perf_counter() - start
    if ret == 0:
        self.xfer_stats.record_transfer(duration_s=duration, total_bytes=total, num_descs=n)
        logger.debug("Sending to %s done, took %s", remote_session, duration)
    else:
        self.xfer_stats.record_failed_transfer()
        logger.warning("Sending to %s failed (ret=%s) after %s (%d descriptors, %d bytes)",
                       remote_session, ret, duration, n, total)
    return ret


#: Worker attribute: the path the last ``_send_blocks`` took (``"native"`` / ``"lists"``).
_HANDOFF_ATTR = "kvplan_handoff"
# A child of vLLM's "vllm" logger: in a vLLM process the once-per-engine hand-off line goes
# through vLLM's own handler (the live e2e reads it); elsewhere it is a plain logger.
_handoff_log = logging.getLogger("vllm.kvplan.mooncake")


def _handoff(worker: Any) -> Handoff:
    """The Mooncake hand-off the worker keeps for ``worker.engine`` (one per engine object):
    native once bound and self-tested, else ``batch_transfer_sync_write``'s lists. Only vLLM's
    real engine (``mooncake.engine.TransferEngine`` of the verified wheel) qualifies, and only
    when the worker knows its own session (``hostname`` and ``rpc_port``, as vLLM's
    ``__init__`` sets them) for the self-test; ``KVPLAN_MOONCAKE_NATIVE=0`` turns it off."""
    attrs = worker.__dict__
    host, port = attrs.get("hostname"), attrs.get("rpc_port")
    return Handoff.kept_on(worker, getattr(worker, "engine", None),
                           f"{host}:{port}" if host and port else None, log=_handoff_log)


def _native(worker: Any) -> Any:
    """The worker's native Mooncake API once self-tested, or None (the benchmarks time it
    directly)."""
    return _handoff(worker).native()


def handoff(worker: Any) -> tuple[str, str]:
    """``(path, why)`` of ``worker``'s Mooncake hand-off: the path its last ``_send_blocks``
    took (``"native"``, ``"lists"``, or ``""`` before the first), and why the native path is not
    in use (``""`` when it is or was not tried yet)."""
    kept = Handoff.kept(worker)
    return worker.__dict__.get(_HANDOFF_ATTR, ""), kept.reason if kept is not None else ""


def _as_list(column: Any) -> list[int]:
    """A column as the ``list[int]`` Mooncake's binding takes (vLLM's own lists pass as is)."""
    if isinstance(column, list):
        return column
    if isinstance(column, np.ndarray):
        return column.tolist()  # type: ignore[no-any-return]
    return [int(x) for x in column]


#: From this many blocks on, a lengths column is checked for one repeated value first.
_REPEAT_CHECK_MIN = 64


def _lengths_list(lengths: Any) -> tuple[list[int], int]:
    """The lengths as a ``list[int]`` and their sum. A column of one repeated value (a
    fragmented request: every block is one page) becomes one int referenced ``n`` times
    instead of ``n`` ints built one by one."""
    if isinstance(lengths, np.ndarray) and len(lengths) >= _REPEAT_CHECK_MIN:
        plain = lengths.view(np.ndarray)
        first = int(plain[0])
        if int(plain[-1]) == first and int(np.count_nonzero(plain != first)) == 0:
            return [first] * len(plain), first * len(plain)
    out = _as_list(lengths)
    return out, sum(out)
