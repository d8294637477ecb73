"""A naive byte-level oracle for KV-cache transfers, written from the layout definitions.

:func:`reference_copy` moves, token by token and head by head, the bytes a correct transfer
from one source rank moves into a destination's memory. It reads only what the two
:class:`kvplan.Layout` objects publish (entries, strides, page size, TP rank and size, attention
geometry) and the rules of docs/api.md, never a plan: compare its result with the memory a
plan's blocks produced (:func:`apply_plan`) and every byte is checked, whatever blocks the
planner chose. It is slow on purpose (one numpy slice per token and head), so it is easy to
check by reading.

The rules it implements:

- entries pair by ``(layer_id, role)`` among entries of the same kind (page or state) when both
  layouts publish layer ids, else by position among entries of the same role; elided entries
  (``item_len`` 0) move nothing;
- item ``i`` of an entry is at ``data_ptr + i * stride``; token ``t`` of the request is slot
  ``t % P`` of page ``pages[t // P]`` on each side with its own page size ``P``; ``n_tokens``
  defaults to the full pages of the shorter list;
- a token-major (NHD) item holds ``[slot][head][head bytes]``, a head-major (HND) item
  ``[head][slot][head bytes]``; a layout without attention geometry holds whole tokens of
  ``item_len / page_size`` bytes;
- heads of rank ``r`` of ``tp`` with ``H`` KV heads: ``r*H/tp .. (r+1)*H/tp`` when ``H >= tp``,
  else the one head ``r // (tp/H)``; a prefill rank writes a decode rank the heads both hold if
  it is their elected holder (``r_p % R == r_d % R`` with ``R = max(1, tp_p // H)``);
- state items (one slot per request) of equal length are replicated and written by prefill rank
  ``r_d * tp_p // tp_d`` only; items whose lengths are in the TP ratio are sharded along their
  leading bytes and each pair moves the overlap of the two ranks' byte ranges.

Not modelled: caller-given ``fragments=``, legacy positional PP slicing and NPU buffer groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplan import Layout, LayoutEntry

__all__ = ["Memory", "apply_plan", "expected_memory", "rank_heads", "reference_copy",
           "sent_heads"]


@dataclass(frozen=True)
class Memory:
    """Bytes at addresses: ``data[i]`` is the byte at address ``base + i``."""

    data: npt.NDArray[np.uint8]
    base: int

    @classmethod
    def of(cls, array: npt.NDArray[Any]) -> Memory:
        """The memory of a C-contiguous numpy array, at the address it really has (for layouts
        built on ``array.ctypes.data``)."""
        if not array.flags.c_contiguous:
            raise ValueError("Memory.of needs a C-contiguous array")
        return cls(array.reshape(-1).view(np.uint8), int(array.ctypes.data))

    def at(self, addr: int, n: int) -> npt.NDArray[np.uint8]:
        """The ``n`` bytes at ``addr`` (a view); outside this memory is an ``IndexError``."""
        off = addr - self.base
        if off < 0 or n < 0 or off + n > self.data.size:
            raise IndexError(f"bytes {addr:#x}..{addr + n:#x} are outside memory "
                             f"{self.base:#x}..{self.base + self.data.size:#x}")
        return self.data[off:off + n]

    def copy(self) -> Memory:
        return Memory(self.data.copy(), self.base)


def rank_heads(kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The model KV heads rank ``tp_rank`` of ``tp_size`` holds (written out here, not asked
    of the core: the oracle is the independent reference the core is checked against)."""
    if kv_heads >= tp_size:
        per = kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp_size // kv_heads)
    return range(head, head + 1)


def sent_heads(kv_heads: int, prefill: tuple[int, int], decode: tuple[int, int]) -> range:
    """The heads prefill rank ``prefill = (rank, tp)`` writes into decode rank ``decode``."""
    (r_p, tp_p), (r_d, tp_d) = prefill, decode
    replicas = max(1, tp_p // kv_heads)
    if r_p % replicas != r_d % replicas:
        return range(0)
    a, b = rank_heads(kv_heads, tp_p, r_p), rank_heads(kv_heads, tp_d, r_d)
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


def _has_geometry(layout: Layout) -> bool:
    return layout.kv_heads is not None and layout.head_dim is not None and \
        layout.dtype_size is not None


def _pairs(src: Layout, dst: Layout, kind: str) -> list[tuple[LayoutEntry, LayoutEntry]]:
    s_entries, d_entries = src.entries(kind), dst.entries(kind)
    by_id = all(e.layer_id is not None for e in s_entries + d_entries)
    queues: dict[object, list[LayoutEntry]] = {}
    for i, e in enumerate(d_entries):
        key: object = (e.layer_id, e.role) if by_id else (e.role, sum(
            1 for f in d_entries[:i] if f.role == e.role))
        queues.setdefault(key, []).append(e)
    pairs = []
    for i, e in enumerate(s_entries):
        key = (e.layer_id, e.role) if by_id else (e.role, sum(
            1 for f in s_entries[:i] if f.role == e.role))
        if not queues.get(key):
            raise ValueError(f"the destination has no {kind} entry for {key}")
        pairs.append((e, queues[key].pop(0)))
    return pairs


class _Side:
    """Where one side keeps a head of a token slot inside one of its items."""

    def __init__(self, layout: Layout, entry: LayoutEntry, geometry: bool) -> None:
        self.page_size = layout.page_size
        if geometry:
            kv_heads, tp = int(layout.kv_heads or 0), layout.tp_size
            self.first = rank_heads(kv_heads, tp, layout.tp_rank).start
            # The oracle derives the head split on its own, from the published geometry: it is
            # the independent reference the core's plans are checked against.
            self.heads = int(layout.heads_per_rank or max(1, kv_heads // tp))
            self.head_bytes = int(layout.head_dim or 0) * int(layout.dtype_size or 0)
            self.head_major = layout.memory_order == "HND"
        else:  # one "head": the whole token
            self.first, self.heads, self.head_major = 0, 1, False
            self.head_bytes = entry.item_len // self.page_size

    def offset(self, slot: int, head: int) -> int:
        h = head - self.first
        if self.head_major:
            return (h * self.page_size + slot) * self.head_bytes
        return (slot * self.heads + h) * self.head_bytes


def reference_copy(src: Layout, src_mem: Memory, dst: Layout, dst_mem: Memory,
                   src_pages: Sequence[int] | npt.NDArray[Any],
                   dst_pages: Sequence[int] | npt.NDArray[Any], *, n_tokens: int | None = None,
                   src_slot: int | None = None, dst_slot: int | None = None) -> int:
    """Writes into ``dst_mem`` what a correct transfer of one request from ``src`` (prefill
    rank or stage) to ``dst`` writes: its pages, and with both slots given its state slot.
    Returns the number of bytes written. Call it once per source to build the expected
    destination of a whole request."""
    s_pages, d_pages = [int(p) for p in src_pages], [int(p) for p in dst_pages]
    ps, pd = src.page_size, dst.page_size
    if n_tokens is None:
        n_tokens = min(len(s_pages) * ps, len(d_pages) * pd)
    geometry = _has_geometry(src) and _has_geometry(dst)
    if geometry:
        heads = sent_heads(int(src.kv_heads or 0), (src.tp_rank, src.tp_size),
                           (dst.tp_rank, dst.tp_size))
    else:
        heads = range(1)
    moved = 0
    for s, d in _pairs(src, dst, "page"):
        if s.item_len == 0 or d.item_len == 0:
            continue
        a, b = _Side(src, s, geometry), _Side(dst, d, geometry)
        if a.head_bytes != b.head_bytes:
            raise ValueError(f"layer {s.layer_id} {s.role}: {a.head_bytes} bytes per head or "
                             f"token on the source, {b.head_bytes} on the destination")
        for t in range(n_tokens):
            s_item = s.data_ptr + s_pages[t // ps] * s.stride
            d_item = d.data_ptr + d_pages[t // pd] * d.stride
            for h in heads:
                dst_mem.at(d_item + b.offset(t % pd, h), b.head_bytes)[:] = \
                    src_mem.at(s_item + a.offset(t % ps, h), a.head_bytes)
                moved += a.head_bytes
    if src_slot is None or dst_slot is None:
        return moved
    (r_p, tp_p), (r_d, tp_d) = (src.tp_rank, src.tp_size), (dst.tp_rank, dst.tp_size)
    for s, d in _pairs(src, dst, "state"):
        ls, ld = s.item_len, d.item_len
        if ls == 0 or ld == 0:
            continue
        s_item, d_item = s.data_ptr + src_slot * s.stride, d.data_ptr + dst_slot * d.stride
        if ls == ld:  # replicated: one writer per decode rank
            if r_p == r_d * tp_p // tp_d:
                dst_mem.at(d_item, ld)[:] = src_mem.at(s_item, ls)
                moved += ls
        elif ls * tp_p == ld * tp_d:  # sharded along the leading bytes
            lo, hi = max(r_p * ls, r_d * ld), min((r_p + 1) * ls, (r_d + 1) * ld)
            if lo < hi:
                dst_mem.at(d_item + lo - r_d * ld, hi - lo)[:] = \
                    src_mem.at(s_item + lo - r_p * ls, hi - lo)
                moved += hi - lo
        else:
            raise ValueError(f"state layer {s.layer_id} {s.role}: item lengths {ls} and {ld} "
                             f"are neither equal nor in the TP ratio {tp_p}:{tp_d}")
    return moved


def expected_memory(dst: Layout, dst_mem: Memory,
                    sources: Sequence[tuple[Layout, Memory]],
                    src_pages: Sequence[int] | npt.NDArray[Any],
                    dst_pages: Sequence[int] | npt.NDArray[Any], *, n_tokens: int | None = None,
                    src_slot: int | None = None, dst_slot: int | None = None) -> Memory:
    """A copy of ``dst_mem`` after every source wrote the request (:func:`reference_copy`)."""
    want = dst_mem.copy()
    for layout, mem in sources:
        reference_copy(layout, mem, dst, want, src_pages, dst_pages, n_tokens=n_tokens,
                       src_slot=src_slot, dst_slot=dst_slot)
    return want


def apply_plan(plan: Any, src_mem: Memory, dst_mem: Memory,
               written: npt.NDArray[np.bool_] | None = None) -> None:
    """Applies a plan's blocks (anything with ``as_lists()``: ``TransferPlan``, ``PlanBatch``)
    as memmoves. A block outside either memory is an ``IndexError``; with ``written`` (one
    flag per destination byte) a destination byte written twice is an ``AssertionError``."""
    for s, d, n in zip(*plan.as_lists()):
        source, target = src_mem.at(s, n), dst_mem.at(d, n)
        if written is not None:
            off = d - dst_mem.base
            assert not written[off:off + n].any(), f"destination byte written twice in {d:#x}+{n}"
            written[off:off + n] = True
        target[:] = source
