"""A staging arena: page-aligned host memory split into round buffers, registered once with
the transfer engine at start-up and kept for the life of the worker."""

from __future__ import annotations

import mmap
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplan._errors import ConfigError, TransferError
from kvplan.staging.config import MAX_BUFFERS, StagingConfig
from kvplan.staging.negotiation import ArenaInfo

__all__ = ["PAGE", "StagingArena"]

#: Alignment of the arena and of every round buffer in it.
PAGE = mmap.PAGESIZE


def _registration_error(engine: str, addr: int, size: int, status: Any) -> TransferError:
    err = TransferError(f"{engine}: registering the staging arena ({addr:#x}, {size} bytes) "
                        f"failed with status {status!r}")
    err.engine, err.status, err.bytes = engine, status if isinstance(status, int) else None, size
    return err


class StagingArena:
    """``size`` bytes of page-aligned host memory (NumPy-backed) split into ``buffers`` round
    buffers of :attr:`buffer_bytes` each; round ``k`` uses buffer ``k % buffers`` at offset
    ``(k % buffers) * buffer_bytes``, as ``Template.plan_rounds`` places it.

    ``size`` is rounded down to a whole number of page-aligned buffers (a MiB size with a
    power-of-two buffer count is kept exactly).

    Raises:
        ConfigError: ``buffers`` outside 1..64, or ``size`` too small for one page per buffer.
    """

    def __init__(self, size: int, buffers: int = 2) -> None:
        if isinstance(buffers, bool) or not isinstance(buffers, int) \
                or not 1 <= buffers <= MAX_BUFFERS:
            err = ConfigError(f"staging arena: buffers={buffers!r}: an integer from 1 to "
                              f"{MAX_BUFFERS} is required")
            err.option, err.value = "buffers", buffers
            raise err
        if isinstance(size, bool) or not isinstance(size, int) or size < buffers * PAGE:
            err = ConfigError(f"staging arena: size={size!r}: at least {buffers * PAGE} bytes "
                              f"(one {PAGE}-byte page per buffer, {buffers} buffers) is "
                              "required")
            err.option, err.value = "size", size
            raise err
        self.buffers = buffers
        self.buffer_bytes = size // buffers // PAGE * PAGE
        self.size = self.buffer_bytes * buffers
        self._raw = np.zeros(self.size + PAGE, np.uint8)
        start = -self._raw.ctypes.data % PAGE
        #: The arena's bytes, in place (``copy_local`` takes it as a buffer).
        self.array: npt.NDArray[np.uint8] = self._raw[start:start + self.size]
        self.addr = int(self.array.ctypes.data)
        self._lock = threading.Lock()
        #: Held by a prefill for a whole staged send (``send_staged(src_lock=...)``): one
        #: request at a time through this arena's buffers.
        self.lock = threading.Lock()
        self._engine: Any = None
        self._deregister: Any = None
        #: How the arena was registered (``"mooncake"``, ``"nixl"``, ``"transport"``), or ``""``.
        self.registered_with = ""

    @classmethod
    def from_config(cls, config: StagingConfig) -> StagingArena:
        return cls(config.arena_bytes, config.buffers)

    @property
    def region(self) -> tuple[int, int]:
        """``(addr, size)``: what ``plan_rounds`` takes as this side's arena."""
        return self.addr, self.size

    @property
    def registered(self) -> bool:
        return bool(self.registered_with)

    def info(self, rank: int = 0) -> ArenaInfo:
        """This arena as the handshake's :class:`kvplan.staging.ArenaInfo` for ``rank``."""
        return ArenaInfo(rank, self.addr, self.size, self.buffers, self.registered)

    def buffer(self, index: int) -> npt.NDArray[np.uint8]:
        """Round buffer ``index % buffers`` as a view."""
        k = index % self.buffers
        return self.array[k * self.buffer_bytes:(k + 1) * self.buffer_bytes]

    # ------------------------------------------------------------------ registration
    def register(self, engine: Any) -> str:
        """Register the arena with ``engine`` once, returning how: a kvplan transport
        (``register_buffers``), Mooncake's ``TransferEngine`` (``register_memory``), a
        ``kvplan.engines.mooncake.Handoff`` (its engine) or a NIXL agent (``register_memory``
        of DRAM descriptors). A second call with the same engine does nothing.

        Raises:
            TransferError: the engine refused the registration (status named).
            ConfigError: the arena is registered with another engine already, or ``engine`` is
                none of the above.
        """
        with self._lock:
            if self._engine is not None:
                if self._engine is engine:
                    return self.registered_with
                err = ConfigError("staging arena: already registered with "
                                  f"{self.registered_with} engine {self._engine!r}; one arena "
                                  "per engine")
                err.option, err.value = "engine", engine
                raise err
            how, undo = self._register(engine)
            self._engine, self._deregister, self.registered_with = engine, undo, how
            return how

    def _register(self, engine: Any) -> tuple[str, Any]:
        addr, size = self.addr, self.size
        if hasattr(engine, "register_buffers"):  # a kvplan transport: it unregisters on close
            engine.register_buffers([addr], [size])
            return "transport", None
        from kvplan.engines.mooncake import Handoff

        if isinstance(engine, Handoff) and engine.engine is not None:
            engine = engine.engine
        if hasattr(engine, "get_rpc_port") and hasattr(engine, "register_memory"):
            status = engine.register_memory(addr, size)
            if status != 0:
                raise _registration_error("mooncake", addr, size, status)
            return "mooncake", lambda: engine.unregister_memory(addr)
        if hasattr(engine, "deregister_memory") and hasattr(engine, "register_memory"):
            try:
                descs = engine.register_memory([(addr, size, 0, "")], "DRAM")
            except Exception as exc:
                raise _registration_error("nixl", addr, size, str(exc)) from exc
            return "nixl", lambda: engine.deregister_memory(descs)
        err = ConfigError(f"staging arena: cannot register with {type(engine).__name__}: not a "
                          "kvplan transport, a Mooncake TransferEngine or Handoff, or a NIXL "
                          "agent")
        err.option, err.value = "engine", engine
        raise err

    def unregister(self) -> None:
        """Undo :meth:`register` (a transport's own close unregisters what it registered)."""
        with self._lock:
            undo, self._deregister, self._engine = self._deregister, None, None
            self.registered_with = ""
        if undo is not None:
            undo()

    def close(self) -> None:
        self.unregister()

    def __enter__(self) -> StagingArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"registered with {self.registered_with}" if self.registered else "unregistered"
        return (f"StagingArena(addr={self.addr:#x}, size={self.size}, buffers={self.buffers}, "
                f"{state})")
