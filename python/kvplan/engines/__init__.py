"""Transfer-engine adapters: register a layout's buffers, submit a plan in bounded batches.

``import kvplan`` never imports this package, and importing this package never imports an
engine: ``mooncake``, ``memfabric_hybrid`` and ``nixl_cu12`` are imported when a transport is
constructed.

Usage::

    from kvplan.engines import MooncakeTransport

    t = MooncakeTransport("127.0.0.1")      # raises TransferError unless initialize() returns 0
    t.register(layout)                      # every buffer once; overlaps merged, repeats skipped
    session = t.local_session_id()          # "127.0.0.1:PORT": what peers pass as peer_session
    stats = t.submit(plan, peer_session)  # TransferStats(blocks, bytes, batches, seconds, ...)
    pending = t.submit_async(plan, peer_session)   # Mooncake only; pending.wait() -> TransferStats

NIXL (:class:`NixlTransport`) adds agent metadata the caller ships to peers
(``t.metadata()`` -> peer's ``add_peer(bytes)``), completion notifications, and the prepped
path (``t.prep(...)``); see :mod:`kvplan.engines.nixl`.

The direct-or-staged advice needs each engine's cost, measured once: ``measure_cost(t,
peer, src_region=..., dst_region=...)`` through a caller's transport and peer, or
``measure_loopback("mooncake")`` with both ends in this process (:mod:`kvplan.engines.measure`).

Layer-wise streaming (:class:`StreamingSubmitter`, :mod:`kvplan.engines.streaming`) sends each
layer group's slice of a plan as soon as its layers are signalled ready, over any transport.

Failures raise :class:`kvplan.TransferError` with ``engine``, ``session``, ``batch``, ``blocks``,
``bytes`` and ``status`` set.
"""

from __future__ import annotations

from typing import Any

from kvplan.engines._base import (
    PlanLike,
    TransferError,
    TransferStats,
    Transport,
    merge_regions,
    plan_arrays,
)
from kvplan.engines.ascend import AscendTransport
from kvplan.engines.measure import measure_copy_bandwidth, measure_cost, measure_loopback
from kvplan.engines.mooncake import MooncakeTransport, PendingTransfer
from kvplan.engines.nixl import NixlPending, NixlTransport, PreppedPair
from kvplan.engines.streaming import (
    BatchStreamOutcome,
    StreamBatch,
    StreamCompleteness,
    StreamingSubmitter,
    StreamRequest,
    StreamStats,
    check_stream,
)

__all__ = [
    "AscendTransport",
    "BatchOutcome",
    "BatchStreamOutcome",
    "MooncakeTransport",
    "NixlPending",
    "NixlTransport",
    "PendingTransfer",
    "PlanLike",
    "PreppedPair",
    "StreamBatch",
    "StreamCompleteness",
    "StreamRequest",
    "StreamStats",
    "StreamingSubmitter",
    "TransferError",
    "TransferStats",
    "Transport",
    "check_stream",
    "create_transport",
    "measure_copy_bandwidth",
    "measure_cost",
    "measure_loopback",
    "merge_regions",
    "plan_arrays",
]

_ENGINES: dict[str, type[Transport]] = {"mooncake": MooncakeTransport,
                                        "ascend": AscendTransport,
                                        "memfabric": AscendTransport, "nixl": NixlTransport}


def create_transport(engine: str, **kwargs: Any) -> Transport:
    """Build a transport by engine name (``"mooncake"``, ``"ascend"``/``"memfabric"``, ``"nixl"``)."""
    try:
        cls = _ENGINES[engine.lower()]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; choose from {sorted(_ENGINES)}") from None
    return cls(**kwargs)
