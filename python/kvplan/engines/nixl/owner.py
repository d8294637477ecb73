"""What a pending submission and a prepped pair need from the transport that made them.

A structural type, so that :mod:`.pending` and :mod:`.prepped` sit below :mod:`.transport` in the
import graph (the transport creates them; they only call back through this interface).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from kvplan.engines._base import TransferError
from kvplan.engines.nixl.descriptors import U64

__all__ = ["Memory", "TransportHandle"]

#: NIXL memory type and device id (``("DRAM", 0)``, ``("VRAM", 1)``).
Memory = tuple[str, int]


class TransportHandle(Protocol):
    """The transport's agent, its lock-guarded handle sets, and its error builders."""

    timeout: float
    _agent: Any
    _closing: bool
    _lock: threading.Lock
    _live: set[Any]
    _dlists: set[Any]

    def _check_open(self) -> None: ...

    def _release(self, handle: Any) -> bool: ...

    def _notify(self, peer: str, notif: bytes) -> None: ...

    def _make(self, peer: str, index: int, lengths: U64, local_mem: Memory, remote_mem: Memory,
              src: U64, dst: U64, notif: bytes) -> Any: ...

    def _error(self, msg: str, *, peer: str | None, status: int | None, batch: int | None = None,
               blocks: int | None = None, n_bytes: int | None = None) -> TransferError: ...

    def _request_error(self, peer: str, index: int, lengths: U64, state: str,
                       cause: BaseException | None, *, extra: str = "") -> TransferError: ...
