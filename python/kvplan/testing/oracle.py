"""A naive byte-level oracle for KV-cache transfers, written from the layout definitions.

:func:`reference_copy` moves, token by token and head by head, the bytes a correct transfer
from one source rank moves into a destination's memory. It reads only what the two
:class:`kvplan.Layout` objects publish (entries, strides, page size, TP rank and size, DCP deal,
attention geometry), the caller's ``fragments=`` and the rules of docs/api.md, never a plan:
compare its result with the memory a plan's blocks produced (an executor of
:mod:`kvplan.exec`: :func:`~kvplan.exec.numpy.apply_plan`, or
:func:`~kvplan.exec.numpy.apply_staged` for a staged plan's gather, network and scatter, both
named here too) and every byte is checked, whatever blocks the planner chose. It is slow on purpose (one numpy slice per token and head),
so it is easy to check by reading.

The rules it implements:

- entries pair by ``(layer_id, role)`` among entries of the same kind (page or state) when both
  layouts publish layer ids, else by position among entries of the same role; elided entries
  (``item_len`` 0) move nothing;
- item ``i`` of an entry is at ``data_ptr + i * stride``; local token ``l`` of a side is slot
  ``l % P`` of page ``pages[l // P]`` with that side's page size ``P``; ``n_tokens`` defaults to
  the full pages of the shorter list (and is required when either side deals tokens);
- decode context parallelism: a side with ``dcp_size N > 1``, ``dcp_rank r`` and
  ``dcp_interleave I`` holds global token ``t`` iff ``(t // I) % N == r``, as local token
  ``(t // (I·N))·I + t % I``; a pair moves the tokens both sides hold. Draft entries are not
  dealt: their items hold virtual pages of ``P·N`` tokens (every token of the request), and a
  draft pair moves every token iff the source's DCP rank is ``decode DCP rank % source
  dcp_size``, the same prefill DCP rank that alone writes the decode's state slots;
- a token-major (NHD) item holds ``[slot][head][head bytes]``, a head-major (HND) item
  ``[head][slot][head bytes]``; a layout without attention geometry holds whole tokens of
  ``item_len / page_size`` bytes (paired with one that publishes it: that side's heads,
  token-major); a page request (no ``n_tokens``, equal page sizes and memory
  orders, no DCP) between items that hold the same heads moves whole items;
- heads of rank ``r`` of ``tp`` with ``H`` KV heads: ``r*H/tp .. (r+1)*H/tp`` when ``H >= tp``,
  else the one head ``r // (tp/H)``; a prefill rank writes a decode rank the heads both hold if
  it is their elected holder (``r_p % R == r_d % R`` with ``R = max(1, tp_p // H)``);
- ``fragments`` (as ``Template(fragments=)``: one list of ``(src_off, dst_off, len)`` for every
  page pair, or one list or ``None`` per page pair in source entry order) copy item bytes
  ``src_off + k`` to ``dst_off + k``; a byte moves iff the rules above move it and a fragment
  reads it, and it lands at each such fragment's destination offset in the token's destination
  page (a combination the planner refuses, such as a fragment that sends a token to another
  slot in a token plan, has no defined result here either);
- state items (one slot per request) of equal length are replicated and written by prefill rank
  ``r_d * tp_p // tp_d`` only; items whose lengths are in the TP ratio are sharded along their
  leading bytes and each pair moves the overlap of the two ranks' byte ranges;
- a state entry with a TP channel split (``Layout.state_channels``: ``(c, rows, groups)``) holds
  ``rows`` rows of ``c`` channels of ``item_len / (rows·c)`` bytes; the model's channels are cut
  into the sub-blocks ``groups`` (none: one sub-block of ``c·tp`` channels), rank ``r`` of ``tp``
  holds channels ``r·G/tp .. (r+1)·G/tp`` of a sub-block of ``G``, and a row lists the rank's
  channels sub-block after sub-block. A pair moves, in every row, each model channel both ranks
  hold from its place in the prefill row to its place in the decode row. ``c`` 0 is a replicated
  slot, written whole by prefill rank ``r_d * tp_p // tp_d`` only.

A staged plan (``Template.plan_staged``) writes the same decode bytes as the direct plan: the
oracle's answer for it is :func:`reference_copy`'s, and
:func:`~kvplan.exec.numpy.apply_staged` runs its three plans. Not modelled: legacy positional PP slicing, NPU buffer groups and ``replicas_send=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import numpy.typing as npt

from kvplan import Layout, LayoutEntry

# The executors live in kvplan.exec.numpy; they are named here too, beside the oracle their
# results are compared with. The oracle itself shares no code with them but the memory model.
from kvplan.exec.numpy import Memory, apply_conversion, apply_plan, apply_staged

__all__ = ["Fragments", "Memory", "apply_conversion", "apply_plan", "apply_staged", "array_pool", "dcp_local_token",
           "expected_memory", "rank_heads", "reference_copy", "reference_ring_copy",
           "sent_heads", "split_channels"]

Fragment = tuple[int, int, int]
#: What ``Template(fragments=)`` takes: one list for every page pair, or one list (or None)
#: per page pair.
Fragments = Union[Sequence[Fragment], Sequence[Union[Sequence[Fragment], None]]]


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


def dcp_local_token(t: int, size: int, rank: int, interleave: int) -> int | None:
    """Where DCP rank ``rank`` of ``size`` holds global token ``t`` (its local token), or None
    when another rank holds it."""
    if (t // interleave) % size != rank:
        return None
    return (t // (interleave * size)) * interleave + t % interleave


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


def _is_fragment(x: object) -> bool:
    return (isinstance(x, (tuple, list)) and len(x) == 3
            and all(isinstance(v, (int, np.integer)) for v in x))


#: One pair's fragments as byte pairs: ``(source item offsets, destination item offsets)``
#: (two fragments may read the same source byte).
_ByteMap = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


def _fragment_maps(fragments: Fragments | None, pairs: list[tuple[LayoutEntry, LayoutEntry]]
                   ) -> list[_ByteMap | None]:
    """Per page pair: the item bytes its fragments move, or None for the whole item."""
    if fragments is None:
        return [None] * len(pairs)
    if all(_is_fragment(f) for f in fragments):
        lists: list[Sequence[Fragment] | None] = [
            fragments if s.item_len and d.item_len else None  # type: ignore[misc]
            for s, d in pairs]
    else:
        lists = list(fragments)  # type: ignore[arg-type]
        if len(lists) != len(pairs):
            raise ValueError(f"{len(lists)} per-pair fragment lists for {len(pairs)} page pairs")
    maps: list[_ByteMap | None] = []
    for (s, d), frags in zip(pairs, lists):
        if frags is None:
            maps.append(None)
            continue
        src_offs, dst_offs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for src_off, dst_off, n in frags:
            if n <= 0 or src_off + n > s.item_len or dst_off + n > d.item_len:
                raise ValueError(f"fragment {(src_off, dst_off, n)} is not inside items of "
                                 f"{s.item_len} and {d.item_len} bytes")
            src_offs.append(np.arange(src_off, src_off + n))
            dst_offs.append(np.arange(dst_off, dst_off + n))
        maps.append((np.concatenate(src_offs), np.concatenate(dst_offs)))
    return maps


class _Side:
    """Where one side keeps a head of a token inside one of its items."""

    def __init__(self, layout: Layout, entry: LayoutEntry, geometry: bool) -> None:
        dealt = layout.dcp_size > 1 and not entry.is_draft
        self.dcp = (layout.dcp_size, layout.dcp_rank, layout.dcp_interleave) if dealt else None
        # A draft item on a dealing side holds a virtual page of every token of the request; a
        # window pool's entry has its pool's page size.
        self.page_size = entry.page_size * (layout.dcp_size if entry.is_draft else 1)
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

    def local(self, t: int) -> int | None:
        """This side's local token for global token ``t`` (None: another DCP rank holds it)."""
        return t if self.dcp is None else dcp_local_token(t, *self.dcp)

    def offset(self, slot: int, head: int) -> int:
        h = head - self.first
        if self.head_major:
            return (h * self.page_size + slot) * self.head_bytes
        return (slot * self.heads + h) * self.head_bytes


def _copy(src_mem: Memory, s_at: int, dst_mem: Memory, d_at: int, n: int,
          fragment_map: _ByteMap | None, s_item: int, d_item: int, d_item_len: int) -> int:
    """Copies ``n`` bytes at ``s_at`` to ``d_at``, or with a fragment map the ones its
    fragments read to where they send them (item offsets of items at ``s_item``, ``d_item``)."""
    if fragment_map is None:
        dst_mem.at(d_at, n)[:] = src_mem.at(s_at, n)
        return n
    src_offs, dst_offs = fragment_map
    lo = s_at - s_item
    keep = (src_offs >= lo) & (src_offs < lo + n)
    dst_mem.at(d_item, d_item_len)[dst_offs[keep]] = src_mem.at(s_at, n)[src_offs[keep] - lo]
    return int(keep.sum())


_Pages = Sequence[int] | npt.NDArray[Any]


def reference_copy(src: Layout, src_mem: Memory, dst: Layout, dst_mem: Memory,
                   src_pages: Sequence[int] | npt.NDArray[Any],
                   dst_pages: Sequence[int] | npt.NDArray[Any], *, n_tokens: int | None = None,
                   src_slot: int | None = None, dst_slot: int | None = None,
                   fragments: Fragments | None = None, skip_tokens: int = 0,
                   window_pages: tuple[_Pages | None, _Pages | None] = (None, None),
                   pool_pages: Mapping[int, tuple[_Pages | None, _Pages | None]] | None = None,
                   ) -> int:
    """Writes into ``dst_mem`` what a correct transfer of one request from ``src`` (prefill
    rank or stage) to ``dst`` writes: its pages, and with both slots given its state slot.
    ``fragments`` is what the template was built with; ``skip_tokens``: the decode holds the
    request's first K tokens already and only tokens K.. are written (state slots still
    whole). A sliding-window entry (``LayoutEntry.window`` W) holds only the request's last W
    tokens live, so only those are written (from K on); an entry in its side's window pool
    (``LayoutEntry.in_window_pool``) is addressed through that side's ``window_pages`` at its
    pool's page size. An entry in a further pool (``Layout.entry_pools``, ``Layout.pools``:
    pool id, page size P in tokens, R tokens per row) is addressed through that side's
    ``pool_pages[pool]`` (``window_pages`` is pool 1's): its item holds P / R rows of
    ``item_len / (P / R)`` bytes, row ``r`` holds tokens ``r·R .. r·R + R − 1`` and is written
    once all of them are in the request (rows ``first // R .. n_tokens // R``, ``first`` the
    entry's first moved token). Returns the number of bytes written.
    Call it once per source to build the expected destination of a whole request (for DCP:
    once per (source, decode rank) pair, each decode rank's page list its local tokens')."""
    s_pages, d_pages = [int(p) for p in src_pages], [int(p) for p in dst_pages]
    lists = {1: window_pages, **(pool_pages or {})}
    side_lists: list[dict[int, list[int]]] = [{}, {}]
    for pool, sides in lists.items():
        for side, given in enumerate(sides):
            side_lists[side][pool] = [] if given is None else [int(p) for p in given]
    ps, pd = src.page_size, dst.page_size
    dealt = src.dcp_size > 1 or dst.dcp_size > 1
    windowed = any(w is not None for w in (*src.windows, *dst.windows)) or any(
        p not in (0, None) for p in (*src.entry_pools, *dst.entry_pools))
    page_request = n_tokens is None and not skip_tokens and ps == pd and not dealt and \
        not windowed and (src.memory_order or "NHD") == (dst.memory_order or "NHD")
    if n_tokens is None:
        if dealt:
            raise ValueError("a transfer between DCP layouts needs n_tokens (global tokens)")
        n_tokens = min(len(s_pages) * ps, len(d_pages) * pd)
    src_geometry, dst_geometry = _has_geometry(src), _has_geometry(dst)
    if src_geometry and dst_geometry:
        heads = sent_heads(int(src.kv_heads or 0), (src.tp_rank, src.tp_size),
                           (dst.tp_rank, dst.tp_size))
    else:
        heads = range(1)
    # Draft tokens and state slots reach a decode DCP rank from one prefill DCP rank.
    from_draft_writer = src.dcp_rank == dst.dcp_rank % src.dcp_size
    moved = 0
    pairs = _pairs(src, dst, "page")
    for (s, d), fragment_map in zip(pairs, _fragment_maps(fragments, pairs)):
        if s.item_len == 0 or d.item_len == 0:
            continue
        if (s.is_draft or d.is_draft) and not from_draft_writer:
            continue
        a, b = _Side(src, s, src_geometry), _Side(dst, d, dst_geometry)
        pair_heads = heads
        if src_geometry != dst_geometry:
            # Only one side publishes heads (no head slicing): the other holds the same heads
            # token-major, a token's bytes head after head.
            known, other = (a, b) if src_geometry else (b, a)
            other.first, other.heads, other.head_bytes = known.first, known.heads, \
                known.head_bytes
            pair_heads = range(known.first, known.first + known.heads)
        if a.head_bytes != b.head_bytes:
            raise ValueError(f"layer {s.layer_id} {s.role}: {a.head_bytes} bytes per head or "
                             f"token on the source, {b.head_bytes} on the destination")
        whole = range(a.first, a.first + a.heads)
        if page_request and s.item_len == d.item_len and \
                whole == range(b.first, b.first + b.heads) == pair_heads:
            for sp, dp in zip(s_pages, d_pages):  # whole items, page by page
                s_item, d_item = s.data_ptr + sp * s.stride, d.data_ptr + dp * d.stride
                moved += _copy(src_mem, s_item, dst_mem, d_item, s.item_len, fragment_map,
                               s_item, d_item, d.item_len)
            continue
        first = skip_tokens if s.window is None else max(skip_tokens, n_tokens - s.window)
        rows = _rows_of(src, s), _rows_of(dst, d)
        if rows != (None, None):
            moved += _copy_rows(src_mem, dst_mem, (s, d), rows, side_lists, (first, n_tokens))
            continue
        for t in range(first, n_tokens):
            ls, ld = a.local(t), b.local(t)
            if ls is None or ld is None:
                continue
            s_list = side_lists[0].get(_pool_of(src, s), []) if s.in_window_pool else s_pages
            d_list = side_lists[1].get(_pool_of(dst, d), []) if d.in_window_pool else d_pages
            s_item = s.data_ptr + s_list[ls // a.page_size] * s.stride
            d_item = d.data_ptr + d_list[ld // b.page_size] * d.stride
            for h in pair_heads:
                moved += _copy(src_mem, s_item + a.offset(ls % a.page_size, h), dst_mem,
                               d_item + b.offset(ld % b.page_size, h), a.head_bytes,
                               fragment_map, s_item, d_item, d.item_len)
    if src_slot is None or dst_slot is None or not from_draft_writer:
        return moved
    for s, d in _pairs(src, dst, "state"):
        if s.ring is None:  # ring-state entries move by position (reference_ring_copy)
            moved += _copy_state_item(src, src_mem, dst, dst_mem, s, d, src_slot, dst_slot)
    return moved


def _pool_of(layout: Layout, entry: LayoutEntry) -> int:
    return int(layout.entry_pools[entry.index] or 0)


def _rows_of(layout: Layout, entry: LayoutEntry) -> tuple[int, int, int] | None:
    """``(pool, rows per page, tokens per row)`` of an entry in a further pool that is no
    window pool (``None``: its tokens are addressed as the request's or window pages')."""
    pool = _pool_of(layout, entry)
    if pool == 0 or entry.in_window_pool:
        return None
    page_size, per_row = next((p[1], p[2]) for p in layout.pools if p[0] == pool)
    return pool, page_size // per_row, per_row


def _copy_rows(src_mem: Memory, dst_mem: Memory, pair: tuple[LayoutEntry, LayoutEntry],
               rows: tuple[tuple[int, int, int] | None, tuple[int, int, int] | None],
               side_lists: list[dict[int, list[int]]], span: tuple[int, int]) -> int:
    """Writes the complete rows of a pair of entries in further pools (see reference_copy)."""
    (s, d), (a, b) = pair, rows
    if a is None or b is None or a[2] != b[2]:
        raise ValueError(f"layer {s.layer_id} {s.role}: rows on one side only, or of "
                         f"different tokens per row ({a}, {b})")
    row_bytes = s.item_len // a[1]
    if d.item_len // b[1] != row_bytes:
        raise ValueError(f"layer {s.layer_id} {s.role}: {row_bytes} bytes per row on the "
                         f"source, {d.item_len // b[1]} on the destination")
    first, n = span
    moved = 0
    for r in range(first // a[2], n // a[2]):
        s_page = side_lists[0][a[0]][r // a[1]]
        d_page = side_lists[1][b[0]][r // b[1]]
        s_at = s.data_ptr + s_page * s.stride + (r % a[1]) * row_bytes
        d_at = d.data_ptr + d_page * d.stride + (r % b[1]) * row_bytes
        dst_mem.at(d_at, row_bytes)[:] = src_mem.at(s_at, row_bytes)
        moved += row_bytes
    return moved


def _copy_state_item(src: Layout, src_mem: Memory, dst: Layout, dst_mem: Memory,
                     s: LayoutEntry, d: LayoutEntry, src_item: int, dst_item: int) -> int:
    """Copies item ``src_item`` of state entry ``s`` to item ``dst_item`` of ``d`` as the TP
    rule for state says: replicated items by one writer per decode rank, sharded items along
    their leading bytes, items with a TP channel split channel by channel. Returns the bytes
    written."""
    (r_p, tp_p), (r_d, tp_d) = (src.tp_rank, src.tp_size), (dst.tp_rank, dst.tp_size)
    ls, ld = s.item_len, d.item_len
    if ls == 0 or ld == 0:
        return 0
    s_item, d_item = s.data_ptr + src_item * s.stride, d.data_ptr + dst_item * d.stride
    s_split, d_split = src.state_channels[s.index], dst.state_channels[d.index]
    if s_split is not None or d_split is not None:
        return _copy_split_state(src, src_mem, dst, dst_mem, (s, d), (s_split, d_split),
                                 (s_item, d_item))
    if ls == ld:  # replicated: one writer per decode rank
        if r_p == r_d * tp_p // tp_d:
            dst_mem.at(d_item, ld)[:] = src_mem.at(s_item, ls)
            return ls
        return 0
    if ls * tp_p == ld * tp_d:  # sharded along the leading bytes
        lo, hi = max(r_p * ls, r_d * ld), min((r_p + 1) * ls, (r_d + 1) * ld)
        if lo < hi:
            dst_mem.at(d_item + lo - r_d * ld, hi - lo)[:] = \
                src_mem.at(s_item + lo - r_p * ls, hi - lo)
            return hi - lo
        return 0
    raise ValueError(f"state layer {s.layer_id} {s.role}: item lengths {ls} and {ld} "
                     f"are neither equal nor in the TP ratio {tp_p}:{tp_d}")


_Split = tuple[int, int, list[int]]


def split_channels(split: _Split, tp_size: int, tp_rank: int) -> list[int]:
    """The model channels rank ``tp_rank`` of ``tp_size`` holds in one row of a state slot
    with TP channel split ``split = (channels per rank, rows, sub-blocks)``, in the order the
    row keeps them: its share ``r·G/tp .. (r+1)·G/tp`` of each sub-block of ``G`` channels,
    sub-block after sub-block (written out here, not asked of the core)."""
    channels, _, groups = split
    blocks = list(groups) or [channels * tp_size]
    held: list[int] = []
    start = 0
    for size in blocks:
        share = size // tp_size
        held.extend(range(start + tp_rank * share, start + (tp_rank + 1) * share))
        start += size
    return held


def _copy_split_state(src: Layout, src_mem: Memory, dst: Layout, dst_mem: Memory,
                      pair: tuple[LayoutEntry, LayoutEntry],
                      splits: tuple[_Split | None, _Split | None],
                      items: tuple[int, int]) -> int:
    """Copies one slot of a state pair with a TP channel split (see the module's rules): each
    model channel both ranks hold, row by row, in runs of channels consecutive on both sides."""
    (s, d), (a, b), (s_item, d_item) = pair, splits, items
    (r_p, tp_p), (r_d, tp_d) = (src.tp_rank, src.tp_size), (dst.tp_rank, dst.tp_size)
    where = f"state layer {s.layer_id} {s.role}"
    if a is None or b is None:
        raise ValueError(f"{where}: a channel split on one side only ({a}, {b})")
    if a[0] == 0 or b[0] == 0:  # replicated: the whole slot, from one writer
        if a[0] != b[0] or s.item_len != d.item_len:
            raise ValueError(f"{where}: replicated against sharded or items of different "
                             f"length ({a}, {s.item_len}; {b}, {d.item_len})")
        if r_p != r_d * tp_p // tp_d:
            return 0
        dst_mem.at(d_item, d.item_len)[:] = src_mem.at(s_item, s.item_len)
        return s.item_len
    rows = a[1]
    s_channels, d_channels = split_channels(a, tp_p, r_p), split_channels(b, tp_d, r_d)
    s_all, d_all = a[0] * tp_p, b[0] * tp_d
    s_width, d_width = s.item_len // (rows * a[0]), d.item_len // (b[1] * b[0])
    if (rows, s_all, list(a[2]) or [s_all], s_width) != \
            (b[1], d_all, list(b[2]) or [d_all], d_width):
        raise ValueError(f"{where}: the two sides describe different channels ({a}, tp "
                         f"{tp_p}, {s_width} bytes each; {b}, tp {tp_d}, {d_width} bytes each)")
    s_at = {c: i for i, c in enumerate(s_channels)}
    runs: list[list[int]] = []  # [source index, destination index, channels]
    for j, c in enumerate(d_channels):
        i = s_at.get(c)
        if i is None:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
            runs[-1][2] += 1
        else:
            runs.append([i, j, 1])
    moved = 0
    for row in range(rows):
        for i, j, n in runs:
            dst_mem.at(d_item + (row * b[0] + j) * s_width, n * s_width)[:] = \
                src_mem.at(s_item + (row * a[0] + i) * s_width, n * s_width)
            moved += n * s_width
    return moved


def reference_ring_copy(src: Layout, src_mem: Memory, dst: Layout, dst_mem: Memory,
                        src_slot: int, dst_slot: int, n_positions: int) -> int:
    """Writes into ``dst_mem`` what a correct transfer of a request's ring state writes: for
    every paired ring-state entry (``LayoutEntry.ring``: R rows per request slot, position
    ``p`` in row ``slot * R + p % R``), the positions both rings hold after ``n_positions``
    positions, ``n - min(R_p, R_d, n) .. n``, each from its prefill row to its decode row.
    Returns the bytes written."""
    moved = 0
    if src.dcp_rank != dst.dcp_rank % src.dcp_size:
        return 0  # state reaches a decode DCP rank from one prefill DCP rank
    for s, d in _pairs(src, dst, "state"):
        if s.ring is None or d.ring is None:
            continue
        live = min(s.ring, d.ring, n_positions)
        for p in range(n_positions - live, n_positions):
            moved += _copy_state_item(src, src_mem, dst, dst_mem, s, d,
                                      src_slot * s.ring + p % s.ring,
                                      dst_slot * d.ring + p % d.ring)
    return moved


def expected_memory(dst: Layout, dst_mem: Memory,
                    sources: Sequence[tuple[Layout, Memory]],
                    src_pages: Sequence[int] | npt.NDArray[Any],
                    dst_pages: Sequence[int] | npt.NDArray[Any], *, n_tokens: int | None = None,
                    src_slot: int | None = None, dst_slot: int | None = None,
                    fragments: Fragments | None = None) -> Memory:
    """A copy of ``dst_mem`` after every source wrote the request (:func:`reference_copy`)."""
    want = dst_mem.copy()
    for layout, mem in sources:
        reference_copy(layout, mem, dst, want, src_pages, dst_pages, n_tokens=n_tokens,
                       src_slot=src_slot, dst_slot=dst_slot, fragments=fragments)
    return want


def array_pool(array: npt.NDArray[Any], layers: int, item_len: int) -> Layout:
    """A cross-layer pool over a C-contiguous array at its real address: page ``p`` holds the
    ``item_len``-byte items of layers ``0 .. layers - 1`` side by side (``Layout.cross_layer``)."""
    return Layout.cross_layer(int(array.ctypes.data), array.nbytes, list(range(layers)),
                              item_len)
