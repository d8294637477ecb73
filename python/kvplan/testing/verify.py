"""Byte-exact verification of a destination arena after transfers, one buffer at a time (memory
lean: never a copy of the whole arena)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvplan.testing.memory import SENTINEL, Arena
from kvplan.testing.specs import Entry, PeerSpec

__all__ = ["expected_moves", "first_wrong_byte"]

#: Per source peer: (its arena, its spec, src_pages, dst_pages, src_slot, dst_slot).
Writes = Sequence[tuple[Arena, PeerSpec, np.ndarray, np.ndarray, "int | None", "int | None"]]


def expected_moves(src: PeerSpec, dst: PeerSpec) -> list[tuple[Entry, Entry]]:
    """Which source buffer lands in which destination buffer, by (layer id, role): the ground
    truth, written independently of kvplan's pairing."""
    by_key = {(e.layer_id, e.role): e for e in dst.entries}
    return [(e, by_key[(e.layer_id, e.role)]) for e in src.entries]


def first_wrong_byte(decode: Arena, dst_spec: PeerSpec, writes: Writes) -> str | None:
    """``None`` if the destination arena holds exactly the expected bytes (planned items equal
    their source, every other byte still :data:`SENTINEL`), else a description of the first
    wrong byte naming layer, role, item and byte.

    Items are read through :meth:`Arena.view`, so strided entries (cross-layer pools) on
    either side are compared item by item at their strides; source and destination strides
    may differ (a cross-layer prefill writing a per-layer decode)."""
    written: dict[Entry, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for arena, spec, src_pages, dst_pages, src_slot, dst_slot in writes:
        for s, d in expected_moves(spec, dst_spec):
            if s.kind == "page":
                idx_s, idx_d = np.asarray(src_pages), np.asarray(dst_pages)
            elif src_slot is not None:
                idx_s, idx_d = np.array([src_slot]), np.array([dst_slot])
            else:
                continue
            written.setdefault(d, []).append((arena.view(s), idx_s, idx_d))
    for d in dst_spec.entries:
        got = decode.view(d)
        mask = np.zeros(d.capacity, dtype=bool)
        for src_view, idx_s, idx_d in written.get(d, []):
            mask[idx_d] = True
            bad = got[idx_d] != src_view[idx_s]
            if bad.any():
                row, col = np.unravel_index(int(np.argmax(bad)), bad.shape)
                item = int(idx_d[row])
                return (f"decode layer {d.layer_id} {d.role} item {item} byte {col} "
                        f"(arena offset {d.offset + item * d.stride + col}): "
                        f"got {int(got[item, col]):#04x}, expected "
                        f"{int(src_view[idx_s[row], col]):#04x}")
        untouched = got[~mask]
        bad = untouched != SENTINEL
        if bad.any():
            row, col = np.unravel_index(int(np.argmax(bad)), bad.shape)
            item = int(np.flatnonzero(~mask)[row])
            return (f"decode layer {d.layer_id} {d.role} item {item} byte {col} "
                    f"(arena offset {d.offset + item * d.stride + col}) was not planned but "
                    f"changed: got {int(got[item, col]):#04x}, sentinel {SENTINEL:#04x}")
    return None
