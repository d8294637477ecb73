"""Planning fixtures as plain data: layouts, a request, and the byte map a correct transfer
writes, for any engine's test suite (no GPU, no engine, no kvplan planner needed to read them).

Each :class:`PlanningFixture` is one of the planning classes engines share: MHA and MLA with
pipeline-parallel stages (layer ids), equal TP, TP head slices (prefill TP smaller or larger
than the decode's), decode context parallelism, staging (the same decode bytes as the direct
transfer) and hybrid models with state slots. It holds:

* ``sources`` / ``decode``: the layouts as :meth:`kvplan.Layout.to_dict` dicts (JSON-able;
  :meth:`PlanningFixture.layouts` rebuilds the :class:`kvplan.Layout` objects), one source per
  prefill rank or stage that writes the decode rank;
* the request: ``src_pages`` / ``dst_pages`` (page indices of each side; for a DCP decode its
  local pages), ``n_tokens`` where tokens are dealt, ``src_slot`` / ``dst_slot`` for state;
* ``expected``: the byte map, maximal ``(source, src_addr, dst_addr, length)`` segments sorted
  by destination address: byte ``dst_addr + k`` of the decode receives byte ``src_addr + k``
  of source ``source``, for ``k < length``; no other decode byte is written.

``expected`` is computed by :func:`kvplan.testing.oracle.reference_copy` (the byte-level oracle
of this package, which reads only the layouts' definitions), once per source, by tracing where
every source byte lands: :func:`oracle_byte_map` does that for any layouts and request.
:func:`byte_map_of_blocks` turns an engine's ``(src, dst, length)`` blocks into the same form,
so a test compares an engine's plan with a fixture by ``==``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplan import Layout
from kvplan.testing.oracle import Memory, reference_copy

__all__ = ["FIXTURE_CLASSES", "PlanningFixture", "byte_map_of_blocks", "fixtures",
           "merge_byte_maps", "oracle_byte_map"]

#: The fixture classes, in the order :func:`fixtures` returns them.
FIXTURE_CLASSES = ("mla-pp", "mha-pp", "equal-tp", "hetero-tp-split", "hetero-tp-merge", "dcp",
                   "staging", "hybrid-state")

Segment = tuple[int, int, int, int]  # (source, src_addr, dst_addr, length)


@dataclass(frozen=True)
class PlanningFixture:
    """One planning case as plain data (see the module docstring)."""

    name: str
    fixture_class: str
    description: str
    sources: tuple[dict[str, Any], ...]
    decode: dict[str, Any]
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    n_tokens: int | None = None
    src_slot: int | None = None
    dst_slot: int | None = None
    #: what an engine needs beyond the layouts (head counts, TP ranks, staging) as it names it
    context: dict[str, Any] = field(default_factory=dict)
    expected: tuple[Segment, ...] = ()

    def layouts(self) -> tuple[list[Layout], Layout]:
        """The source layouts and the decode layout."""
        return [Layout.from_dict(dict(s)) for s in self.sources], Layout.from_dict(
            dict(self.decode))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: lists for tuples."""
        d = dataclasses.asdict(self)
        for key in ("sources", "src_pages", "dst_pages", "expected"):
            d[key] = [list(x) if isinstance(x, tuple) else x for x in d[key]]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PlanningFixture:
        return PlanningFixture(
            name=d["name"], fixture_class=d["fixture_class"], description=d["description"],
            sources=tuple(d["sources"]), decode=d["decode"], src_pages=tuple(d["src_pages"]),
            dst_pages=tuple(d["dst_pages"]), n_tokens=d.get("n_tokens"),
            src_slot=d.get("src_slot"), dst_slot=d.get("dst_slot"),
            context=dict(d.get("context") or {}),
            expected=tuple((int(a), int(b), int(c), int(e)) for a, b, c, e in d["expected"]))


def _extent(layout: Layout) -> tuple[int, int]:
    lo = min(int(p) for p in layout.data_ptrs)
    hi = max(int(p) + int(n) for p, n in zip(layout.data_ptrs, layout.data_lens))
    return lo, hi


def _segments(pairs: Iterable[tuple[int, int, int, int]]) -> list[Segment]:
    """``(source, src, dst, length)`` pieces merged into maximal segments sorted by dst."""
    out: list[list[int]] = []
    for s_i, s, d, n in sorted(pairs, key=lambda p: (p[2], p[0])):
        if n <= 0:
            continue
        if out:
            ps_i, ps, pd, pn = out[-1]
            if pd + pn > d:
                raise AssertionError(f"decode byte {d:#x} written twice")
            if ps_i == s_i and pd + pn == d and ps + pn == s:
                out[-1][3] += n
                continue
        out.append([s_i, s, d, n])
    return [(a, b, c, e) for a, b, c, e in out]


def oracle_byte_map(sources: Sequence[Layout], decode: Layout, src_pages: Sequence[int],
                    dst_pages: Sequence[int], *, n_tokens: int | None = None,
                    src_slot: int | None = None, dst_slot: int | None = None
                    ) -> tuple[Segment, ...]:
    """Where :func:`~kvplan.testing.oracle.reference_copy` sends each source's bytes: the
    fixture form of its answer. Each source byte is traced by copying its offset, one byte of
    it per pass, plus a pass that marks the bytes written."""
    d_lo, d_hi = _extent(decode)
    pieces: list[tuple[int, int, int, int]] = []
    for index, src in enumerate(sources):
        s_lo, s_hi = _extent(src)
        offsets = np.arange(s_hi - s_lo, dtype=np.uint64)
        planes = max(1, (int(s_hi - s_lo).bit_length() + 7) // 8)
        got: list[np.ndarray] = []
        for plane in range(planes + 1):
            data = (np.ones(offsets.size, np.uint8) if plane == planes else
                    ((offsets >> np.uint64(8 * plane)) & np.uint64(0xFF)).astype(np.uint8))
            dst_mem = Memory(np.zeros(d_hi - d_lo, np.uint8), d_lo)
            reference_copy(src, Memory(data, s_lo), decode, dst_mem, list(src_pages),
                           list(dst_pages), n_tokens=n_tokens, src_slot=src_slot,
                           dst_slot=dst_slot)
            got.append(dst_mem.data)
        written = np.flatnonzero(got[planes] == 1)
        where = np.zeros(written.size, dtype=np.uint64)
        for plane in range(planes):
            where |= got[plane][written].astype(np.uint64) << np.uint64(8 * plane)
        pieces.extend((index, s_lo + int(s), d_lo + int(d), 1)
                      for d, s in zip(written.tolist(), where.tolist()))
    return tuple(_segments(pieces))


def byte_map_of_blocks(blocks: Iterable[tuple[int, int, int]], source: int = 0
                       ) -> tuple[Segment, ...]:
    """``(src, dst, length)`` blocks of one source (an engine's descriptors or a
    :class:`kvplan.TransferPlan`'s rows) in the fixture's form, to compare with
    ``expected`` (with :func:`merge_byte_maps` for several sources)."""
    return tuple(_segments((source, int(s), int(d), int(n)) for s, d, n in blocks))


def merge_byte_maps(*maps: Iterable[Segment]) -> tuple[Segment, ...]:
    """Several sources' byte maps as one (a decode byte written twice is an error)."""
    return tuple(_segments(seg for m in maps for seg in m))


# ---------------------------------------------------------------------------------------------
# The fixtures
# ---------------------------------------------------------------------------------------------
_SRC, _DST, _STRIDE = 0x1000_0000, 0x9000_0000, 0x10_0000


def _ptrs(base: int, n: int) -> list[int]:
    return [base + i * _STRIDE for i in range(n)]


def _mha(base: int, layers: Sequence[int], *, pages: int, tp_rank: int = 0, tp_size: int = 1,
         kv_heads: int = 4, head_dim: int = 8, dtype_size: int = 2, page_size: int = 2,
         **ctx: Any) -> Layout:
    heads = max(1, kv_heads // tp_size)
    item = page_size * heads * head_dim * dtype_size
    n = len(layers)
    ptrs = _ptrs(base, 2 * n)
    return Layout.mha(ptrs[:n], ptrs[n:], [pages * item] * n, [pages * item] * n, item, item,
                      layer_ids=list(layers), page_size=page_size, tp_rank=tp_rank,
                      tp_size=tp_size, kv_heads=kv_heads, head_dim=head_dim,
                      dtype_size=dtype_size, memory_order="NHD", **ctx)


def _mla(base: int, layers: Sequence[int], *, pages: int, item: int = 96, page_size: int = 2,
         **ctx: Any) -> Layout:
    n = len(layers)
    return Layout.mla(_ptrs(base, n), [pages * item] * n, item, layer_ids=list(layers),
                      page_size=page_size, **ctx)


def _fixture(name: str, cls: str, description: str, sources: Sequence[Layout], decode: Layout,
             src_pages: Sequence[int], dst_pages: Sequence[int], **kw: Any) -> PlanningFixture:
    request = {k: kw[k] for k in ("n_tokens", "src_slot", "dst_slot") if k in kw}
    expected = oracle_byte_map(sources, decode, src_pages, dst_pages, **request)
    return PlanningFixture(name, cls, description, tuple(s.to_dict() for s in sources),
                           decode.to_dict(), tuple(int(p) for p in src_pages),
                           tuple(int(p) for p in dst_pages), expected=expected, **kw)


def fixtures() -> list[PlanningFixture]:
    """Every fixture, one or more per class of :data:`FIXTURE_CLASSES`, in that order."""
    src_pages, dst_pages = [3, 4, 5, 9, 10], [12, 13, 2, 7, 8]
    out = [
        _fixture("mla-pp-stage1", "mla-pp",
                 "MLA, 4 layers, prefill PP stage 1 of 2 (layers 2, 3) into a PP-1 decode; "
                 "entries pair by layer id", [_mla(_SRC, [2, 3], pages=16)],
                 _mla(_DST, [0, 1, 2, 3], pages=16), src_pages, dst_pages,
                 context={"pp_size": 2, "pp_rank": 1, "prefill_start_layer": 2}),
        _fixture("mha-pp-stage0", "mha-pp",
                 "MHA (K and V per layer), 3 layers, prefill PP stage 0 of 2 (layers 0, 1) "
                 "into a PP-1 decode", [_mha(_SRC, [0, 1], pages=16)],
                 _mha(_DST, [0, 1, 2], pages=16), src_pages, dst_pages,
                 context={"pp_size": 2, "pp_rank": 0, "prefill_start_layer": 0}),
        _fixture("equal-tp-rank1", "equal-tp",
                 "MHA, 4 KV heads, TP 2 on both sides, rank 1 to rank 1 (heads 2, 3), "
                 "page size 4", [_mha(_SRC, [0, 1], pages=16, tp_rank=1, tp_size=2,
                                      page_size=4)],
                 _mha(_DST, [0, 1], pages=16, tp_rank=1, tp_size=2, page_size=4), src_pages,
                 dst_pages, context={"tp_size": 2, "tp_rank": 1}),
        _fixture("hetero-tp-split", "hetero-tp-split",
                 "MHA, 4 KV heads, prefill TP 1 into decode TP 2 rank 1: the prefill sends "
                 "heads 2, 3 of every token, a slice of its items",
                 [_mha(_SRC, [0, 1], pages=16)],
                 _mha(_DST, [0, 1], pages=16, tp_rank=1, tp_size=2), src_pages, dst_pages,
                 context={"prefill_tp": 1, "decode_tp": 2, "decode_tp_rank": 1}),
        _fixture("hetero-tp-merge", "hetero-tp-merge",
                 "MHA, 4 KV heads, prefill TP 2 into decode TP 1: each prefill rank writes "
                 "its two heads into every decode token",
                 [_mha(_SRC, [0, 1], pages=16, tp_rank=r, tp_size=2) for r in (0, 1)],
                 _mha(_DST, [0, 1], pages=16), src_pages, dst_pages,
                 context={"prefill_tp": 2, "decode_tp": 1, "decode_tp_rank": 0}),
        _fixture("dcp-rank1", "dcp",
                 "MLA, 2 layers, page size 1; the decode deals tokens over DCP 2 (interleave "
                 "1) and this is DCP rank 1: it receives the odd tokens of a 10-token request",
                 [_mla(_SRC, [0, 1], pages=32, page_size=1)],
                 _mla(_DST, [0, 1], pages=32, page_size=1, dcp_size=2, dcp_rank=1),
                 list(range(4, 14)), [20, 3, 7, 11, 12], n_tokens=10,
                 context={"dcp_size": 2, "dcp_rank": 1}),
        _fixture("staging-split", "staging",
                 "the hetero-tp-split request moved through staging buffers (gather, one "
                 "network write, scatter): the decode's bytes are the direct transfer's",
                 [_mha(_SRC, [0, 1], pages=16)],
                 _mha(_DST, [0, 1], pages=16, tp_rank=1, tp_size=2), src_pages, dst_pages,
                 context={"prefill_tp": 1, "decode_tp": 2, "decode_tp_rank": 1,
                          "staged": True}),
    ]
    hybrid_src = _mla(_SRC, [0, 2], pages=16).with_state(
        "mamba", [_SRC + 8 * _STRIDE, _SRC + 9 * _STRIDE], [4 * 640] * 2, 640, [1, 3])
    hybrid_dst = _mla(_DST, [0, 2], pages=16).with_state(
        "mamba", [_DST + 8 * _STRIDE, _DST + 9 * _STRIDE], [4 * 640] * 2, 640, [1, 3])
    out.append(_fixture(
        "hybrid-state", "hybrid-state",
        "hybrid MLA + Mamba: full-attention layers 0, 2 page by page, Mamba layers 1, 3 one "
        "640-byte state slot each (slot 2 to slot 1)", [hybrid_src], hybrid_dst, src_pages,
        dst_pages, src_slot=2, dst_slot=1, context={}))
    return out
