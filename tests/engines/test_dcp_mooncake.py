"""Decode context parallelism with real bytes: Mooncake over TCP on 127.0.0.1, one process per
rank. A prefill that does not deal (DCP 1) writes one request to two decode DCP ranks (DCP 2),
token round robin and page-sized deals, with equal and different page sizes; each decode
arena must equal a per-token reference built from the layout definitions alone (rank
``(t // I) % N`` holds global token ``t`` at local token ``(t // (I·N))·I + t % I``), with every
byte outside the rank's tokens untouched."""

from __future__ import annotations

import numpy as np
import pytest

from kvplan.testing import SENTINEL, PeerSpec, pack_entries

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


def owner(t: int, size: int, interleave: int) -> int:
    return (t // interleave) % size


def local(t: int, size: int, interleave: int) -> int:
    return (t // (interleave * size)) * interleave + t % interleave


def row_at(entry_offset: int, pages: np.ndarray, page_size: int, token: int) -> int:
    """Arena offset of ``token``'s row in an entry whose page list is ``pages``."""
    page = int(pages[token // page_size])
    return entry_offset + (page * page_size + token % page_size) * ROW


@pytest.mark.mooncake
@pytest.mark.parametrize(("interleave", "src_page", "dst_page"),
                         [(1, 4, 4), (4, 4, 2), (2, 2, 4)])
def test_prefill_writes_each_decode_dcp_rank_its_own_tokens(
        interleave: int, src_page: int, dst_page: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.engine_peers import peer_group, require_mooncake

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    size = 2
    prefill = spec("prefill", src_page)
    decode = [spec(f"decode{r}", dst_page, (size, r, interleave)) for r in range(size)]
    rng = np.random.default_rng(7)
    src_pages = rng.permutation(CAPACITY)[:-(-N_TOKENS // src_page)].astype(np.int64)
    held = {r: [t for t in range(N_TOKENS) if owner(t, size, interleave) == r]
            for r in range(size)}
    dst_pages = {r: rng.permutation(CAPACITY)[:-(-len(held[r]) // dst_page)].astype(np.int64)
                 for r in range(size)}
    with peer_group([prefill, *decode], {prefill.name}) as (arenas, procs):
        for d in decode:
            r = dict(d.context)["dcp_rank"]
            res = procs[prefill.name].call(
                "transfer", procs[d.name].layout_wire, procs[d.name].session, src_pages,
                dst_pages[r], None, None, None, b"", N_TOKENS, timeout=60)
            assert res["bytes"] == len(held[r]) * ROW * LAYERS
        source = arenas[prefill.name].array
        for d in decode:
            r = dict(d.context)["dcp_rank"]
            want = np.full_like(arenas[d.name].array, SENTINEL)
            for s_entry, d_entry in zip(prefill.entries, d.entries, strict=True):
                for t in held[r]:  # one row per token: slow, but obviously right
                    a = row_at(s_entry.offset, src_pages, src_page, t)
                    b = row_at(d_entry.offset, dst_pages[r], dst_page, local(t, size, interleave))
                    want[b:b + ROW] = source[a:a + ROW]
            got = arenas[d.name].array
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, f"{d.name}: {bad.size} wrong bytes, first at {bad[0]}"
            assert np.flatnonzero(got != SENTINEL).size == len(held[r]) * ROW * LAYERS
