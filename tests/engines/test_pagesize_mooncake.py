"""Real bytes between different page sizes: Mooncake over TCP loopback, separate processes.

A small hybrid model (MLA KV on layers 3 and 7, Mamba-style state elsewhere), prefill PP 2 to
decode PP 1, with prefill pages of 16 tokens and decode pages of 64, and the reverse. The
expected decode arena is built here token by token with plain numpy (sharing no code with
kvplan's planning): every planned token lands in its decode page and slot, state slots move
whole, and every other byte, including the rest of the last decode page past ``n_tokens``,
keeps its sentinel.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
from kvplan.testing import PeerSpec, preset_peer

TINY_HYBRID = ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                          (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))
TOKEN = TINY_HYBRID.kv_bytes_per_token


@pytest.fixture
def mooncake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from support.engine_peers import require_mooncake

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")


def expected_tokens(decode: PeerSpec, before: np.ndarray, writes, n_tokens: int) -> np.ndarray:
    """``writes``: per source ``(spec, bytes, src_pages, dst_pages, src_slot, dst_slot)``."""
    expected = before.copy()
    dst_of = {(e.layer_id, e.role): e for e in decode.entries}
    for spec, src_bytes, src_pages, dst_pages, src_slot, dst_slot in writes:
        ps, pd = spec.page_size, decode.page_size
        for s in spec.entries:
            d = dst_of[(s.layer_id, s.role)]
            if s.kind == "state":
                a, b = s.offset + src_slot * s.item_len, d.offset + dst_slot * d.item_len
                expected[b:b + d.item_len] = src_bytes[a:a + s.item_len]
                continue
            for t in range(n_tokens):  # one copy per token: slow but obviously right
                a = s.offset + int(src_pages[t // ps]) * s.item_len + (t % ps) * TOKEN
                b = d.offset + int(dst_pages[t // pd]) * d.item_len + (t % pd) * TOKEN
                expected[b:b + TOKEN] = src_bytes[a:a + TOKEN]
    return expected


@pytest.mark.mooncake
@pytest.mark.parametrize("prefill_page, decode_page, n_tokens", [(16, 64, 600), (64, 16, 600)])
def test_hybrid_pp2_between_page_sizes_is_byte_exact(mooncake_env: None, prefill_page: int,
                                                     decode_page: int, n_tokens: int) -> None:
    from support.engine_peers import assert_decode_bytes, cluster

    decode = preset_peer(TINY_HYBRID, "decode", range(8), pages=64, page_size=decode_page)
    stages = [preset_peer(TINY_HYBRID, f"prefill{r}", range(4 * r, 4 * r + 4), pages=64,
                          page_size=prefill_page, pp_rank=r, pp_size=2) for r in range(2)]
    # 600 tokens: a partial last page on both sides; fragmented, shuffled decode pages.
    n_src, n_dst = -(-n_tokens // prefill_page), -(-n_tokens // decode_page)
    src_pages = np.arange(3, 3 + n_src, dtype=np.int64)
    dst_pages = fragmented_pages(n_dst, 1 / 3, seed=5, shuffle_runs=True, capacity=64)
    src_slot, dst_slot = 2, 1
    with cluster(decode, stages) as c:
        dpeer = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        results = [c.peers[s.name].call("transfer", dpeer.layout_wire, dpeer.session,
                                        src_pages, dst_pages, src_slot, dst_slot, None, b"",
                                        n_tokens, timeout=60)
                   for s in stages]
        writes = [(s, c.arenas[s.name].array, src_pages, dst_pages, src_slot, dst_slot)
                  for s in stages]
        expected = expected_tokens(decode, before, writes, n_tokens)
        assert_decode_bytes(c.arenas["decode"].array, expected, decode)
        # The last decode page holds n_tokens % decode_page tokens; the rest kept its sentinel.
        last = dst_pages[-1]
        tail = n_tokens % decode_page
        kv = next(e for e in decode.entries if e.kind == "page")
        start = kv.offset + int(last) * kv.item_len + tail * TOKEN
        got = c.arenas["decode"].array[start:kv.offset + (int(last) + 1) * kv.item_len]
        assert tail and (got == before[start:start + len(got)]).all()
    state_bytes = 3 * sum(s.bytes_per_slot for s in TINY_HYBRID.state)
    assert [r["bytes"] for r in results] == [n_tokens * TOKEN + state_bytes] * 2
