"""Real bytes between different page sizes, on every real engine, separate processes.

A small hybrid model (MLA KV on layers 3 and 7, Mamba-style state elsewhere), prefill PP 2 to
decode PP 1, with prefill pages of 16 tokens and decode pages of 64, and the reverse. The
expected decode arena is the byte oracle's (:mod:`kvplan.testing.oracle`, token by token from
the layouts alone): every planned token lands in its decode page and slot, state slots move
whole, and every other byte, including the rest of the last decode page past ``n_tokens``,
keeps its sentinel.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
from kvplan.testing import preset_peer
from support.engine_peers import Engine

TINY_HYBRID = ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                          (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))
TOKEN = TINY_HYBRID.kv_bytes_per_token


@pytest.mark.parametrize("prefill_page, decode_page, n_tokens", [(16, 64, 600), (64, 16, 600)])
def test_hybrid_pp2_between_page_sizes_is_byte_exact(engine: Engine, prefill_page: int,
                                                     decode_page: int, n_tokens: int) -> None:
    from support.engine_peers import assert_stages_landed

    decode = preset_peer(TINY_HYBRID, "decode", range(8), pages=64, page_size=decode_page)
    stages = [preset_peer(TINY_HYBRID, f"prefill{r}", range(4 * r, 4 * r + 4), pages=64,
                          page_size=prefill_page, pp_rank=r, pp_size=2) for r in range(2)]
    # 600 tokens: a partial last page on both sides; fragmented, shuffled decode pages.
    n_src, n_dst = -(-n_tokens // prefill_page), -(-n_tokens // decode_page)
    src_pages = np.arange(3, 3 + n_src, dtype=np.int64)
    dst_pages = fragmented_pages(n_dst, 1 / 3, seed=5, shuffle_runs=True, capacity=64)
    src_slot, dst_slot = 2, 1
    with engine.cluster(decode, stages) as c:
        dpeer = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        results = [c.peers[s.name].call("transfer", dpeer.layout_wire, c.sessions[s.name],
                                        src_pages, dst_pages, src_slot, dst_slot, None,
                                        s.name.encode(), n_tokens, timeout=60)
                   for s in stages]
        engine.wait_stages(c, stages)
        assert_stages_landed(c, decode, stages, before, src_pages, dst_pages, src_slot,
                             dst_slot, n_tokens=n_tokens)
        # The last decode page holds n_tokens % decode_page tokens; the rest kept its sentinel.
        last = dst_pages[-1]
        tail = n_tokens % decode_page
        kv = next(e for e in decode.entries if e.kind == "page")
        start = kv.offset + int(last) * kv.item_len + tail * TOKEN
        got = c.arenas["decode"].array[start:kv.offset + (int(last) + 1) * kv.item_len]
        assert tail and (got == before[start:start + len(got)]).all()
    state_bytes = 3 * sum(s.bytes_per_slot for s in TINY_HYBRID.state)
    assert [r["bytes"] for r in results] == [n_tokens * TOKEN + state_bytes] * 2
