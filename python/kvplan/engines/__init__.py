"""Transfer-engine adapters: register a layout's buffers, submit a plan in bounded batches.

``import kvplan`` never imports this package, and importing this package never imports an
engine: ``mooncake`` and ``memfabric_hybrid`` are imported when a transport is constructed.

>>> from kvplan.engines import MooncakeTransport
>>> t = MooncakeTransport("127.0.0.1")            # initialize() must return 0 or this raises
>>> t.register(layout)                            # every buffer once, overlaps merged
>>> stats = t.submit(plan, peer.local_session_id())  # TransferStats(blocks, bytes, batches, seconds)
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
from kvplan.engines.mooncake import MooncakeTransport, PendingTransfer

__all__ = [
    "AscendTransport",
    "MooncakeTransport",
    "PendingTransfer",
    "PlanLike",
    "TransferError",
    "TransferStats",
    "Transport",
    "create_transport",
    "merge_regions",
    "plan_arrays",
]

_ENGINES = {"mooncake": MooncakeTransport, "ascend": AscendTransport,
            "memfabric": AscendTransport}


def create_transport(engine: str, **kwargs: Any) -> Transport:
    """Build a transport by engine name (``"mooncake"``, ``"ascend"``/``"memfabric"``)."""
    try:
        cls = _ENGINES[engine.lower()]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; choose from {sorted(_ENGINES)}") from None
    return cls(**kwargs)
