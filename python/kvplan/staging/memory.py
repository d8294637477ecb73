"""Whether KV buffers are host memory a round's gather or scatter may copy through, and host
arrays over them: a round's local copy (``kvplan.copy_local``) reads and writes the KV buffers
at their addresses, so a buffer on a device keeps the direct path (a host copy through a device
address would crash the process)."""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["host_memory", "host_views"]

#: Where Linux lists a process's mappings.
MAPS = "/proc/self/maps"


def _rw_ranges() -> list[tuple[int, int]]:
    """This process's readable and writable mappings, adjacent ones merged, in address
    order."""
    merged: list[tuple[int, int]] = []
    with open(MAPS) as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("rw"):
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            if merged and merged[-1][1] == lo:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
    return merged


def host_memory(regions: Iterable[tuple[int, int]] = (), *,
                tensors: Iterable[Any] = ()) -> bool:
    """Whether KV buffers are host memory this process may read and write, judged from what
    the engine hands over:

    * ``tensors`` (vLLM's registered KV caches): each one's ``device.type`` is ``"cpu"``; an
      object without a ``device`` (a NumPy array) counts as host;
    * ``regions`` (SGLang's pool addresses, as ``(address, nbytes)``): each lies inside one of
      this process's readable and writable mappings (Linux ``/proc/self/maps``).

    False for a device tensor, a region outside the mappings, or mappings that cannot be read
    (another platform): the caller then keeps the direct path."""
    for tensor in tensors:
        device = getattr(tensor, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            return False
    spans = [(int(p), int(n)) for p, n in regions]
    if not spans:
        return True
    try:
        ranges = _rw_ranges()
    except OSError:
        return False
    starts = [lo for lo, _ in ranges]
    for p, n in spans:
        i = bisect.bisect_right(starts, p) - 1
        if i < 0 or p + n > ranges[i][1]:
            return False
    return True


def host_views(regions: Iterable[tuple[int, int]]) -> list[np.ndarray]:
    """``uint8`` arrays over host-memory ``(address, nbytes)`` regions, no copy (what
    :func:`kvplan.staging.local_copy` borrows for a gather or scatter). Only for regions
    :func:`host_memory` accepts."""
    return [np.ctypeslib.as_array((ctypes.c_uint8 * int(n)).from_address(int(p)))
            for p, n in regions]
