"""Decode context parallelism with real bytes on every real engine, one process per rank. A
prefill that does not deal (DCP 1) writes one request to two decode DCP ranks (DCP 2), token
round robin and page-sized deals, with equal and different page sizes; each decode arena must
equal the byte oracle's (:mod:`kvplan.testing.oracle`: rank ``(t // I) % N`` holds global token
``t`` at local token ``(t // (I·N))·I + t % I``), with every byte outside the rank's tokens
untouched."""

from __future__ import annotations

import numpy as np
import pytest

from kvplan.testing import SENTINEL, PeerSpec, pack_entries
from kvplan.testing.oracle import dcp_local_token
from support.engine_peers import Engine

ROW = 96  # bytes of one MLA latent row per layer
LAYERS = 3
CAPACITY = 24  # pages per buffer on every peer
N_TOKENS = 37  # not a whole number of pages or deals


def spec(name: str, page_size: int, dcp: tuple[int, int, int] | None = None) -> PeerSpec:
    rows = [(layer, "kv", "page", page_size * ROW, CAPACITY) for layer in range(LAYERS)]
    ctx: tuple[tuple[str, int], ...] = (("page_size", page_size),)
    if dcp is not None:
        size, rank, interleave = dcp
        ctx += (("dcp_size", size), ("dcp_rank", rank), ("dcp_interleave", interleave))
    return PeerSpec(name, "mla", pack_entries(rows), LAYERS, page_size=page_size, context=ctx)


@pytest.mark.parametrize(("interleave", "src_page", "dst_page"),
                         [(1, 4, 4), (4, 4, 2), (2, 2, 4)])
def test_prefill_writes_each_decode_dcp_rank_its_own_tokens(
        engine: Engine, interleave: int, src_page: int, dst_page: int) -> None:
    from support.engine_peers import assert_decode_bytes, expected_decode

    size = 2
    prefill = spec("prefill", src_page)
    decode = [spec(f"decode{r}", dst_page, (size, r, interleave)) for r in range(size)]
    rng = np.random.default_rng(7)
    src_pages = rng.permutation(CAPACITY)[:-(-N_TOKENS // src_page)].astype(np.int64)
    held = {r: sum(1 for t in range(N_TOKENS)
                   if dcp_local_token(t, size, r, interleave) is not None)
            for r in range(size)}
    dst_pages = {r: rng.permutation(CAPACITY)[:-(-held[r] // dst_page)].astype(np.int64)
                 for r in range(size)}
    with engine.peer_group([prefill, *decode], {prefill.name}) as (arenas, procs):
        for d in decode:
            r = dict(d.context)["dcp_rank"]
            res = procs[prefill.name].call(
                "transfer", procs[d.name].layout_wire, procs[d.name].session, src_pages,
                dst_pages[r], None, None, None, b"", N_TOKENS, timeout=60)
            assert res["bytes"] == held[r] * ROW * LAYERS
        for d in decode:
            r = dict(d.context)["dcp_rank"]
            got = arenas[d.name].array
            want = expected_decode(d, np.full_like(got, SENTINEL),
                                   [(prefill, arenas[prefill.name].array, src_pages,
                                     dst_pages[r], None, None)], n_tokens=N_TOKENS)
            assert_decode_bytes(got, want, d)
            assert np.flatnonzero(got != SENTINEL).size == held[r] * ROW * LAYERS
