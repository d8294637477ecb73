"""Memory that several processes share: arenas backed by a mapped file, and the byte patterns
the byte-exact checks rely on."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile

import numpy as np

from kvplan.testing.specs import Entry

__all__ = ["SENTINEL", "Arena", "arena_dir", "fill_source"]

#: Byte a destination arena is filled with before a transfer; sources never contain it, so an
#: unwritten destination byte can never pass for a written one.
SENTINEL = 0xA5


class Arena:
    """A zero-initialised byte buffer backed by a file that several processes map shared.

    The parent creates it (``create=True``); peer processes attach by path. Use
    :func:`arena_dir` for the directory: ``/dev/shm`` when it has room, else the temp directory.
    """

    def __init__(self, path: str, size: int, *, create: bool) -> None:
        self.path = path
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(size, 1))
            self._mmap = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=size)

    @property
    def base(self) -> int:
        """Address of byte 0 in this process."""
        return int(self.array.ctypes.data)

    def view(self, entry: Entry) -> np.ndarray:
        """``(capacity, item_len)`` uint8 view of one buffer: row ``i`` is item ``i``, the
        ``item_len`` bytes at ``entry.offset + i * entry.stride`` (a strided view for entries
        of a cross-layer pool; no copy either way)."""
        flat = self.array[entry.offset: entry.offset + entry.nbytes]
        if not entry.strided:
            return flat.reshape(entry.capacity, entry.item_len)
        return np.lib.stride_tricks.as_strided(
            flat, shape=(entry.capacity, entry.item_len), strides=(entry.stride, 1))

    def close(self) -> None:
        self.array = np.zeros(0, dtype=np.uint8)  # drop the export before closing the map
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive somewhere; the OS unmaps at exit
            pass


def arena_dir(total_bytes: int) -> str:
    """A fresh directory for arenas, in ``/dev/shm`` when it has room for ``total_bytes``."""
    root = "/dev/shm"
    try:
        if shutil.disk_usage(root).free < total_bytes * 1.25 + (64 << 20):
            root = tempfile.gettempdir()
    except OSError:
        root = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="kvplan-", dir=root)


def fill_source(arena: Arena, seed: int) -> None:
    """Random bytes that never equal :data:`SENTINEL`."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 255, size=arena.size, dtype=np.uint8)
    data[data == SENTINEL] = 0xFF
    arena.array[:] = data
