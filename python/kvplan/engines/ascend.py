"""Ascend adapter over ``memfabric_hybrid.TransferEngine`` (``pip install memfabric-hybrid``).

The calls made here match the installed memfabric 1.3.0 bindings exactly (checked by
``tests/engines/test_ascend.py`` against the package's own pybind11 signatures)::

    initialize(store_url, session_id, role, device_id, data_op_type, ...)  -> int
    get_rpc_port()                                                          -> int
    batch_register_memory(buffer_addrs, capacities)                         -> int
    unregister_memory(buffer_addr)                                          -> int
    batch_transfer_sync_write(dest_session, buffers, peer_buffers, lengths, flags=0) -> int

Differences from Mooncake that this adapter hides: the session id is produced *before*
``initialize`` and passed into it, but memfabric 1.3.0's ``get_rpc_port()`` answers 0 until
``initialize`` has run (it logs "call initialize() first to get the real listening port"), so a
port of 0 is read again after a successful ``initialize`` (and, for an engine initialised
elsewhere, whenever the session id is asked for); there is a central config store
(``store_url``, default from ``ASCEND_MF_STORE_URL``); the role is ``"Prefill"`` or
``"Decode"``; a batch is validated as a whole before any copy (an empty batch or a zero length
fails it with -2000), and there is no practical batch cap, so a plan goes in one call unless a
bound is asked for.

``initialize`` needs an Ascend NPU and driver; on other machines it returns -1 and the adapter
raises. Tests pass ``engine=`` (a stand-in with the same signature) or ``initialize=False``.

There is no ``submit_async`` here: memfabric's asynchronous calls are ordered on an NPU stream
(``batch_transfer_async_write_submit(..., stream)``), which belongs to the caller's device code.
memfabric logs to stdout; ``ASCEND_MF_LOG_LEVEL=3`` (or ``memfabric_hybrid.set_log_level``)
quiets it.

Hand-off: memfabric 1.3.0's batch calls take ``Sequence[int]`` (pybind11 vectors converted element
by element, with no buffer-protocol path), so each batch is handed over as three ``.tolist()``
lists, the fastest form that binding converts. The wheel's C library does export a plain C batch
call taking address arrays (``smem_trans_batch_write`` in ``libmf_smem.so``), but the Python engine
exposes no handle to the transfer object behind it, and without an NPU nothing could be
self-tested on this machine, so kvplan does not call it.
"""

from __future__ import annotations

import os
from typing import Any

from kvplan.engines._base import Transport

__all__ = ["AscendTransport", "MEMFABRIC_STATUS_NAMES", "ROLES", "DATA_OP_TYPES"]

#: memfabric ``smem`` status codes (older source snapshot; hybm driver codes may also appear).
MEMFABRIC_STATUS_NAMES: dict[int, str] = {
    -1: "ERROR",
    -2000: "INVALID_PARAM",
    -2001: "MALLOC_FAILED",
    -2002: "NEW_OBJECT_FAILED",
    -2003: "NOT_STARTED",
    -2004: "TIMEOUT",
    -2005: "REPEAT_CALL",
    -2006: "DUPLICATED_OBJECT",
    -2007: "OBJECT_NOT_EXISTS",
    -2008: "NOT_INITIALIZED",
    -2009: "RESOURCE_IN_USE",
    -2010: "RECONNECT",
    -2011: "GET_OBJECT",
}

ROLES = ("Prefill", "Decode")
#: Names accepted for ``data_op_type`` (memfabric ``TransDataOpType`` members).
DATA_OP_TYPES = ("SDMA", "HOST_RDMA", "DEVICE_RDMA", "DEVICE_URMA", "DEVICE_UBOE")
#: memfabric refuses more entries than this in one ``batch_register_memory``.
MAX_REGISTER_ENTRIES = 1 << 20


def _default_engine() -> Any:
    from memfabric_hybrid import TransferEngine  # on demand, never by `import kvplan`

    return TransferEngine()


class AscendTransport(Transport):
    """Writes plans with memfabric's ``batch_transfer_sync_write``.

    Args:
        role: ``"Prefill"`` (sender) or ``"Decode"`` (receiver).
        hostname: this host's address; the session id is ``f"{hostname}:{get_rpc_port()}"``
            unless ``session_id`` is given. A port of 0 (memfabric's answer before
            ``initialize``) is read again once the engine is initialised.
        device_id: NPU id.
        store_url: memfabric config store (``"tcp://ip:port"``); default ``ASCEND_MF_STORE_URL``.
        data_op_type: a ``TransDataOpType`` name (``"SDMA"``, ``"DEVICE_RDMA"``, ...) or member;
            default ``ASCEND_MF_TRANSFER_PROTOCOL`` upper-cased, else ``"SDMA"``.
        engine: an engine object to use instead of a new ``memfabric_hybrid.TransferEngine``
            (tests pass a stand-in with the same signature).
        initialize: call ``engine.initialize`` now (default). ``False`` leaves the engine as it
            is, for engines initialised elsewhere or for argument checks on an idle engine.
        max_blocks_per_batch: blocks per call; default ``None`` (whole plan at once).

    ``local_session_id()`` raises ``TransferError`` while the engine still reports port 0
    (not initialised) and no ``session_id`` was given.

    Raises:
        ImportError: memfabric_hybrid is not installed and no ``engine`` was given.
        ValueError: unknown ``role`` or ``data_op_type``.
        TransferError: ``initialize`` returned non-zero.
    """

    engine_name = "memfabric"
    default_max_blocks_per_batch = None
    status_names = MEMFABRIC_STATUS_NAMES

    def __init__(self, role: str = "Prefill", *, hostname: str = "127.0.0.1", device_id: int = 0,
                 store_url: str | None = None, data_op_type: Any = None,
                 session_id: str | None = None, engine: Any = None, initialize: bool = True,
                 max_blocks_per_batch: int | None = None) -> None:
        super().__init__(max_blocks_per_batch=max_blocks_per_batch)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self._engine: Any = engine if engine is not None else _default_engine()
        self._hostname = hostname
        # initialize takes the session id, so one is built first; memfabric 1.3.0 answers port 0
        # until initialize has run, and _refresh_session replaces it once the engine has a port.
        self._port = 0 if session_id else int(self._engine.get_rpc_port())
        self._session = session_id or f"{hostname}:{self._port}"
        self._explicit_session = bool(session_id)
        if initialize:
            url = store_url if store_url is not None else os.environ.get("ASCEND_MF_STORE_URL")
            if not url:
                raise ValueError("store_url is required (or set ASCEND_MF_STORE_URL)")
            op = self._op_type(data_op_type)
            status = int(self._engine.initialize(url, self._session, role, int(device_id), op))
            if status != 0:
                self._closed = True
                raise self._error(
                    f"initialize({url!r}, {self._session!r}, {role!r}, {device_id}, {op!r}) "
                    f"failed (an Ascend NPU and driver are required)", peer=None, status=status,
                )
            self._refresh_session()

    def _refresh_session(self) -> None:
        """Replace a ``host:0`` session id once the engine reports its real port."""
        if self._explicit_session or self._port != 0:
            return
        port = int(self._engine.get_rpc_port())
        if port != 0:
            self._port = port
            self._session = f"{self._hostname}:{port}"

    def _op_type(self, value: Any) -> Any:
        if value is None:
            value = os.environ.get("ASCEND_MF_TRANSFER_PROTOCOL", "sdma")
        if not isinstance(value, str):
            return value  # already an enum member (or the stand-in's int)
        name = value.upper()
        if name not in DATA_OP_TYPES:
            raise ValueError(f"data_op_type must be one of {DATA_OP_TYPES}, got {value!r}")
        enum = getattr(type(self._engine), "TransDataOpType", None)
        if enum is None:
            try:
                import memfabric_hybrid

                enum = memfabric_hybrid.TransDataOpType
            except (ImportError, AttributeError):
                enum = None
        if enum is None:  # a stand-in without the enum: pass the documented integer value
            return {"SDMA": 1, "HOST_RDMA": 2, "DEVICE_RDMA": 8, "DEVICE_URMA": 64,
                    "DEVICE_UBOE": 128}[name]
        return getattr(enum, name)

    # ------------------------------------------------------------------ engine hooks
    def _engine_session_id(self) -> str:
        # With initialize=False the engine may have been initialised since construction.
        self._refresh_session()
        if not self._explicit_session and self._port == 0:
            # "host:0" reaches nobody: a peer writing to it would fail far from the cause.
            raise self._error(
                f"get_rpc_port() is 0, so there is no session id for {self._hostname!r} yet: "
                f"initialize the engine first, or pass session_id=", peer=None, status=None)
        return self._session

    def _engine_register(self, ptrs: list[int], lens: list[int], device: str) -> int:
        if len(ptrs) != len(lens):
            raise ValueError(f"{len(ptrs)} region addresses but {len(lens)} lengths")
        # One call for neighbouring regions (memfabric aligns to 2 MiB); chunk only past its cap.
        for lo in range(0, len(ptrs), MAX_REGISTER_ENTRIES):
            hi = lo + MAX_REGISTER_ENTRIES
            status = int(self._engine.batch_register_memory(ptrs[lo:hi], lens[lo:hi]))
            if status != 0:
                return status
        return 0

    def _engine_unregister(self, ptrs: list[int]) -> int:
        status = 0
        for p in ptrs:  # memfabric has no batch unregister; regions are few (one per pool)
            status = int(self._engine.unregister_memory(p)) or status
        return status

    def _engine_write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        # Positional, flags=0, exactly as SGLang's Ascend path calls it.
        return int(self._engine.batch_transfer_sync_write(peer, src, dst, lengths, 0))

    def close(self) -> None:
        """Unregister memory and un-initialise the engine (a no-op on an idle engine)."""
        if not self._closed:
            super().close()
            try:
                self._engine.unInitialize()
            except Exception:  # teardown; stand-ins may not have it
                pass
