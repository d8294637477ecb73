"""NIXL's vocabulary: descriptor rows built from kvplan's columns, memory types of a layout's
device, and the names of NIXL's status codes."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["NIXL_STATUS_NAMES", "U64", "descriptor_rows", "memory_of"]

U64 = npt.NDArray[np.uint64]

#: NIXL's ``nixl_status_t`` values (the Python binding raises exceptions whose text is the name).
NIXL_STATUS_NAMES: dict[int, str] = {
    -1: "NIXL_ERR_NOT_POSTED",
    -2: "NIXL_ERR_INVALID_PARAM",
    -3: "NIXL_ERR_BACKEND",
    -4: "NIXL_ERR_NOT_FOUND",
    -5: "NIXL_ERR_MISMATCH",
    -6: "NIXL_ERR_NOT_ALLOWED",
    -7: "NIXL_ERR_REPOST_ACTIVE",
    -8: "NIXL_ERR_UNKNOWN",
    -9: "NIXL_ERR_NOT_SUPPORTED",
}
_STATUS_OF = {name: code for code, name in NIXL_STATUS_NAMES.items()}


def memory_of(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a layout's ``device`` string.

    ``"cpu"`` (or ``""``, ``"dram"``) -> ``("DRAM", 0)``; ``"cuda"``/``"gpu"`` -> ``("VRAM", 0)``;
    ``"cuda:N"``/``"gpu:N"`` -> ``("VRAM", N)``.

    Raises:
        ValueError: any other device (NIXL has no NPU memory type).
    """
    name, _, index = device.strip().lower().partition(":")
    if name in ("", "cpu", "dram") and not index:
        return "DRAM", 0
    if name in ("cuda", "gpu", "vram"):
        if not index:
            return "VRAM", 0
        if index.isdigit():
            return "VRAM", int(index)
    raise ValueError(f"device {device!r} has no NIXL memory type; use 'cpu' or 'cuda:N'")


def descriptor_rows(addrs: npt.ArrayLike, lengths: npt.ArrayLike, dev_id: int) -> U64:
    """An ``(N, 3)`` C-contiguous uint64 array of ``(addr, len, dev_id)`` rows, NIXL's
    descriptor-list form (``get_xfer_descs(rows, mem_type)`` takes it as is).

    Three vectorised column writes into one ``np.empty``: a few ns per row, no per-block
    Python object. NIXL rejects non-contiguous arrays, so a transposed view of the plan's
    ``(3, M)`` buffer cannot be passed instead.
    """
    a = np.asarray(addrs, dtype=np.uint64)
    n = np.asarray(lengths, dtype=np.uint64)
    rows = np.empty((len(a), 3), dtype=np.uint64)
    rows[:, 0] = a
    rows[:, 1] = n
    rows[:, 2] = dev_id
    return rows


def _nixl_status(exc: BaseException) -> tuple[int | None, str]:
    """(status code or None, NIXL name) of an exception raised by the binding."""
    text = str(exc).strip()
    name = text.split()[0] if text.startswith("NIXL_") else type(exc).__name__
    return _STATUS_OF.get(name), name
