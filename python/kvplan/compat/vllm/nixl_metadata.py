"""The agent metadata vLLM's NIXL handshake serves (``xfer_handshake_metadata``), with kvplan's
messages added to it: the layout identity (``kvplan.compat.vllm.nixl``) and the staging
message (``kvplan.compat.vllm.nixl_staging``)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["add_to_agent_metadata"]

_BASE = "NixlBaseConnectorWorker"


def _msgspec(worker: Any) -> Any:
    for klass in type(worker).__mro__:
        if klass.__name__ == _BASE:
            return sys.modules[klass.__module__].msgspec
    raise TypeError(f"{type(worker).__name__} is not vLLM's {_BASE} (or a subclass)")


def add_to_agent_metadata(worker: Any, key: str, message: Any) -> bool:
    """Add ``message`` under ``key`` to the agent metadata the worker's handshake serves
    (``xfer_handshake_metadata.agent_metadata_bytes``, a msgpack map); whether it did (not
    before the KV cache is registered). A decode without kvplan decodes the map as vLLM's
    ``NixlAgentMetadata``, which skips the keys it does not know; the compatibility hash
    covers the configuration, not these bytes."""
    payload = worker.__dict__.get("xfer_handshake_metadata")
    if payload is None:
        return False
    msgspec = _msgspec(worker)
    fields = msgspec.msgpack.decode(payload.agent_metadata_bytes)
    if not isinstance(fields, dict):
        return False
    fields[key] = message
    payload.agent_metadata_bytes = msgspec.msgpack.encode(fields)
    return True
