"""Staged transfers with real engines, one process per rank: the prefill gathers into its
staging region with ``kvplan.copy_local``, the engine (Mooncake over TCP on 127.0.0.1, NIXL
over UCX) moves the staged network plan into the decode's staging region, and the decode
scatters from there with ``kvplan.copy_local``. Every decode byte must equal the byte oracle's
(:mod:`kvplan.testing.oracle`) and what the direct plan of the same request writes through the
same engine.

Cases: prefill TP 8 -> decode TP 2 on NHD pages (four prefill ranks write one decode staging
region, each at its writer offset), and an equal-TP request whose decode pages are all
apart (one direct block per page per entry)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvplan.presets import fragmented_pages
from kvplan.testing import SENTINEL, PeerSpec, pack_entries
from support.engine_peers import Engine

HEADS, HEAD_DIM, DTYPE, TOKENS, LAYERS, PAGES = 8, 32, 2, 4, 2, 16
HEAD_BYTES = HEAD_DIM * DTYPE

def spec(name: str, tp_rank: int, tp_size: int) -> PeerSpec:
    """An MHA NHD peer holding ``HEADS / tp_size`` heads, with a staging region as large as
    its buffers (enough for any request of its pages)."""
    per = max(1, HEADS // tp_size)
    item = TOKENS * per * HEAD_BYTES
    rows = [(layer, role, "page", item, PAGES) for role in ("k", "v") for layer in range(LAYERS)]
    entries = pack_entries(rows)
    ctx = (("page_size", TOKENS), ("tp_rank", tp_rank), ("tp_size", tp_size),
           ("kv_heads", HEADS), ("head_dim", HEAD_DIM), ("dtype_size", DTYPE),
           ("memory_order", "NHD"))
    end = max(e.offset + e.nbytes for e in entries)
    return PeerSpec(name, "mha", entries, LAYERS, context=ctx, staging=end)


def _direct_then_staged(c: Any, decode: PeerSpec, writers: list[PeerSpec],
                        src_pages: np.ndarray, dst_pages: np.ndarray, engine: Engine
                        ) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """The decode's buffers after the direct plans of every writer, and after the staged
    transfers of the same request (the arena reset to the sentinel in between); the writers'
    staged results."""
    dec = c.peers[decode.name]
    arena = c.arenas[decode.name].array
    for w in writers:
        res = c.peers[w.name].call("transfer", dec.layout_wire, c.sessions[w.name], src_pages,
                                   dst_pages, None, None, None, timeout=120)
        assert res["bytes"] > 0
    direct = arena[:decode.buffers_end].copy()
    arena[:] = SENTINEL
    results = []
    for w in writers:
        tag = f"staged-{w.name}".encode()
        res = c.peers[w.name].call("transfer_staged", dec.layout_wire, c.sessions[w.name],
                                   dec.staging, src_pages, dst_pages, None, tag, timeout=120)
        peer = c.peers[w.name].session if engine.notifies else None
        scattered = dec.call("scatter_staged", c.peers[w.name].layout_wire,
                             c.peers[w.name].staging, src_pages, dst_pages, None, peer, tag,
                             timeout=120)
        assert tuple(scattered["writer"]) == tuple(res["writer"])
        results.append(res)
    return direct, arena[:decode.buffers_end].copy(), results


def test_tp8_to_tp2_nhd_staged_equals_direct(engine: Engine) -> None:
    """Decode rank 0 of TP 2 holds heads 0-3, sent by prefill ranks 0-3 of TP 8 (one head
    each): four writers fill one decode staging region at their writer offsets, each with a
    few network blocks where its direct plan has one per token per entry."""
    from support.engine_peers import assert_decode_bytes, expected_decode

    decode = spec("decode", 0, 2)
    writers = [spec(f"prefill{r}", r, 8) for r in range(4)]
    src_pages = np.array([3, 4, 5, 9, 0, 12], dtype=np.int64)
    dst_pages = fragmented_pages(len(src_pages), 0.5, seed=5, shuffle_runs=True,
                                 capacity=PAGES)
    with engine.cluster(decode, writers, seed=3) as c:
        before = c.arenas[decode.name].array[:decode.buffers_end].copy()
        writes = [(w, c.arenas[w.name].array.copy(), src_pages, dst_pages, None, None)
                  for w in writers]
        direct, staged, results = _direct_then_staged(c, decode, writers, src_pages,
                                                      dst_pages, engine)
    want = expected_decode(decode, before, writes)
    assert_decode_bytes(direct, want, decode)
    assert_decode_bytes(staged, want, decode)
    # The request's bytes landed (four heads of every token of every entry), nothing else.
    moved = len(src_pages) * 2 * LAYERS * TOKENS * 4 * HEAD_BYTES
    assert int(np.count_nonzero(direct != SENTINEL)) == moved
    assert sorted(tuple(r["writer"]) for r in results) == [(w, 4) for w in range(4)]
    ranges = sorted(tuple(r["dst_staging_range"]) for r in results)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), ranges  # disjoint shares
    for r in results:
        # One block per token per entry pair directly; the staged network plan a handful.
        assert r["direct_blocks"] == len(src_pages) * TOKENS * 2 * LAYERS
        assert 1 <= r["blocks"] <= 2 * 2 * LAYERS
        assert r["bytes"] == moved // 4


def test_fragmented_equal_tp_staged_equals_direct(engine: Engine) -> None:
    """Equal TP, decode pages all apart: one direct block per page per entry, one staged
    network block, the oracle's bytes both ways."""
    from support.engine_peers import assert_decode_bytes, expected_decode

    decode, prefill = spec("decode", 0, 1), spec("prefill", 0, 1)
    src_pages = np.arange(2, 9, dtype=np.int64)
    dst_pages = fragmented_pages(len(src_pages), 1.0, seed=9, shuffle_runs=True,
                                 capacity=PAGES)
    with engine.cluster(decode, [prefill], seed=4) as c:
        before = c.arenas[decode.name].array[:decode.buffers_end].copy()
        src_bytes = c.arenas[prefill.name].array.copy()
        direct, staged, (res,) = _direct_then_staged(c, decode, [prefill], src_pages,
                                                     dst_pages, engine)
    want = expected_decode(decode, before, [(prefill, src_bytes, src_pages, dst_pages, None,
                                             None)])
    assert_decode_bytes(direct, want, decode)
    assert_decode_bytes(staged, want, decode)
    assert res["direct_blocks"] == len(src_pages) * 2 * LAYERS
    assert res["blocks"] == 1 and tuple(res["writer"]) == (0, 1)
