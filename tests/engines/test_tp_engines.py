"""Prefill TP != decode TP with real bytes on every real engine, one process per rank. Prefill
TP=2 (two processes, one KV head each) -> decode TP=1 (both heads), and prefill TP=1 -> decode
TP=2 (two decode processes), in NHD and HND; every decode byte is checked against the byte
oracle (:mod:`kvplan.testing.oracle`: each rank's heads from the published geometry), and bytes
outside the request stay untouched."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.presets import fragmented_pages
from kvplan.testing import SENTINEL, PeerSpec, build_layout, pack_entries
from support.engine_peers import Engine

HEADS, HEAD_DIM, DTYPE, TOKENS, LAYERS, PAGES = 2, 64, 2, 4, 3, 24
HEAD_BYTES = HEAD_DIM * DTYPE


def spec(name: str, tp_rank: int, tp_size: int, order: str) -> PeerSpec:
    per = max(1, HEADS // tp_size)
    item = TOKENS * per * HEAD_BYTES
    rows = [(layer, role, "page", item, PAGES) for role in ("k", "v") for layer in range(LAYERS)]
    ctx = (("page_size", TOKENS), ("tp_rank", tp_rank), ("tp_size", tp_size),
           ("kv_heads", HEADS), ("head_dim", HEAD_DIM), ("dtype_size", DTYPE),
           ("memory_order", order))
    return PeerSpec(name, "mha", pack_entries(rows), LAYERS, context=ctx)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)])
def test_tp_mismatch_moves_exact_bytes(engine: Engine, order: str, tp_p: int,
                                       tp_d: int) -> None:
    from support.engine_peers import assert_decode_bytes, expected_decode

    prefill = [spec(f"prefill{r}", r, tp_p, order) for r in range(tp_p)]
    decode = [spec(f"decode{r}", r, tp_d, order) for r in range(tp_d)]
    src_pages = np.array([3, 4, 5, 9, 0, 17, 18], dtype=np.int64)
    dst_pages = fragmented_pages(len(src_pages), 0.5, seed=5, shuffle_runs=True, capacity=PAGES)
    with engine.peer_group(prefill + decode, {s.name for s in prefill}) as (arenas, procs):
        before = {d.name: arenas[d.name].array.copy() for d in decode}
        for d in decode:
            r_d = dict(d.context)["tp_rank"]
            peers = kvplan.tp_peers(HEADS, tp_p, tp_d, decode_rank=r_d)
            for r_p in peers.peers:
                res = procs[f"prefill{r_p}"].call(
                    "transfer", procs[d.name].layout_wire, procs[d.name].session,
                    src_pages, dst_pages, None, None, None, timeout=60)
                # One head of TOKENS tokens per page and entry pair moves.
                assert res["bytes"] == len(src_pages) * 2 * LAYERS * TOKENS * HEAD_BYTES
                per_page = 1 if order == "HND" else TOKENS
                assert res["blocks"] == len(src_pages) * 2 * LAYERS * per_page
        for d in decode:
            writes = [(p, arenas[p.name].array, src_pages, dst_pages, None, None)
                      for p in prefill]
            got = arenas[d.name].array
            assert_decode_bytes(got, expected_decode(d, before[d.name], writes), d)
            # Every page of the request landed, nothing else was touched.
            start, stop = kvplan.tp_peers(HEADS, tp_p, tp_d,
                                          decode_rank=dict(d.context)["tp_rank"]).heads
            touched = np.flatnonzero(got != SENTINEL).size
            assert touched == len(src_pages) * 2 * LAYERS * TOKENS * (stop - start) * HEAD_BYTES


def test_peer_spec_carries_the_geometry_across_processes() -> None:
    s = spec("prefill0", 1, 2, "HND")
    again = PeerSpec.from_dict(s.to_dict())
    assert again == s
    layout = build_layout(again, 1 << 40)
    assert (layout.tp_rank, layout.tp_size, layout.kv_heads, layout.heads_per_rank,
            layout.memory_order, layout.page_size) == (1, 2, 2, 1, "HND", TOKENS)
