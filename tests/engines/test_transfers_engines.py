"""Plans moving real bytes between spawned processes on every real engine (the ``engine``
fixture: Mooncake over TCP on 127.0.0.1, NIXL over UCX): a hybrid model from two prefill PP
stages at once, MHA K and V of different widths with an explicit batch bound, and raw blocks
through the engine's async path. Every byte of the decode arena is checked against the byte
oracle (``support.engine_peers.expected_decode``) or, for raw blocks, against the blocks applied
as memmoves. What only one engine has (Mooncake's native hand-off and TCP batch limit, NIXL's
prepped descriptors) is tested in test_mooncake.py, test_mooncake_native.py and test_nixl.py.
"""

from __future__ import annotations

import numpy as np

from kvplan import BlockSlice
from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
from kvplan.testing import model_peers
from kvplan.testing.oracle import Memory, apply_plan
from support.engine_peers import Engine, raw_pair

#: A small Kimi-Linear-style hybrid: MLA on layers 3 and 7, two state components elsewhere.
TINY_HYBRID = ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                          (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))


def test_hybrid_kimi_linear_prefill_pp2_to_decode_pp1(engine: Engine) -> None:
    from support.engine_peers import assert_stages_landed

    peers = model_peers(TINY_HYBRID, pages=64, pp_size=2, state_slots=4)
    src_pages = np.arange(5, 5 + 40, dtype=np.int64)
    dst_pages = fragmented_pages(40, 1 / 3, seed=7, shuffle_runs=True, capacity=64)
    decode, stages = peers.decode, peers.prefill
    # Each stage holds only its own layers: KV for 3 (stage 0) / 7 (stage 1), state elsewhere.
    assert {e.layer_id for e in stages[0].entries} == {0, 1, 2, 3}
    assert {e.layer_id for e in stages[1].entries} == {4, 5, 6, 7}
    src_slot, dst_slot = 2, 1
    with engine.cluster(decode, stages) as c:
        dpeer = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        for spec in stages:
            # Each stage registered exactly its own buffers (one region per buffer here).
            assert len(c.peers[spec.name].regions) == len(spec.entries)
        for spec in stages:  # both stages in flight at once, as real PP stages are
            c.peers[spec.name].send("transfer", dpeer.layout_wire, c.sessions[spec.name],
                                    src_pages, dst_pages, src_slot, dst_slot, None,
                                    spec.name.encode())
        results = [c.peers[spec.name].result(60, "transfer") for spec in stages]
        engine.wait_stages(c, stages)  # NIXL: the decode sees each stage's completion
        assert_stages_landed(c, decode, stages, before, src_pages, dst_pages, src_slot, dst_slot)
        assert all(c.peers[s.name].call("live_handles") == 0 for s in stages)
    # One KV pair per stage, one state pair per (linear layer, state name) of the stage.
    assert [r["pairs"] for r in results] == [1, 1]
    assert [r["state_pairs"] for r in results] == [6, 6]
    kv_bytes = 40 * TINY_HYBRID.kv_bytes_per_token
    state_bytes = 3 * sum(s.bytes_per_slot for s in TINY_HYBRID.state)
    assert [r["bytes"] for r in results] == [kv_bytes + state_bytes] * 2
    assert all(r["blocks"] == r["runs"] + 6 for r in results)  # one block per run + states


def test_mha_k_then_v_with_different_item_lengths(engine: Engine) -> None:
    from support.engine_peers import assert_stages_landed, mha_k_v_case

    decode, prefill, src_pages, dst_pages = mha_k_v_case()
    with engine.cluster(decode, [prefill]) as c:
        before = c.arenas["decode"].array.copy()
        res = c.peers["prefill"].call("transfer", c.peers["decode"].layout_wire,
                                      c.sessions["prefill"], src_pages, dst_pages, None, None,
                                      7, prefill.name.encode(), timeout=60)
        engine.wait_stages(c, [prefill])
        assert_stages_landed(c, decode, [prefill], before, src_pages, dst_pages, None, None)
    assert res["pairs"] == 8 and res["bytes"] == 30 * 4 * (768 + 512)
    assert res["batches"] == -(-res["blocks"] // 7)  # the explicit bound was honoured


def test_async_submit_moves_bytes(engine: Engine) -> None:
    """64 blocks in reversed source order through the async path, 10 blocks per batch."""
    decode, prefill = raw_pair()
    n, item = 64, 4096
    src = np.arange(n, dtype=np.uint64)[::-1] * np.uint64(item)
    dst = np.arange(n, dtype=np.uint64) * np.uint64(item)
    with engine.cluster(decode, [prefill]) as c:
        d = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        stats = c.peers["prefill"].call("submit_async_raw", c.sessions["prefill"], src,
                                        np.uint64(d.base) + dst, np.full(n, item, np.uint64),
                                        10, prefill.name.encode(), timeout=60)
        engine.wait_stages(c, [prefill])
        want = Memory(before, 0)
        apply_plan(BlockSlice(src, dst, np.full(n, item, np.uint64)),
                   Memory(c.arenas["prefill"].array, 0), want)
        np.testing.assert_array_equal(c.arenas["decode"].array, want.data)
        assert c.peers["prefill"].call("live_handles") == 0
    assert stats["batches"] == 7
