"""Cross-layer pools moving real bytes: kvplan.testing's strided entries, then two-process
transfers on every real engine (the ``engine`` fixture) with the decode pool checked byte by
byte.

A cross-layer pool holds every KV layer of a page side by side (``Layout.cross_layer``); the
peers' state entries stay per layer. The expected decode is the byte oracle's
(``support.engine_peers.expected_decode``); :func:`kvplan.testing.first_wrong_byte` is checked
against it too. The engine tests fail, never skip, when an engine is missing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
from kvplan.testing import (
    SENTINEL,
    Arena,
    Entry,
    PeerSpec,
    build_layout,
    cross_layer_entries,
    fill_source,
    first_wrong_byte,
    model_peers,
    preset_peer,
)
from support.engine_peers import Engine

#: A small Kimi-Linear-style hybrid: MLA on layers 3, 7, 11, 15; two state components
#: elsewhere. PP=2 puts two KV layers in each prefill stage's pool, four in the decode's.
HYBRID_MLA = ModelPreset("tiny-hybrid-16", "tiny hybrid MLA", 16, "mla", 1152, 4,
                         (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))
#: The same with MHA K and V per layer (a Qwen3-Next-like pool: k, v of each layer in turn).
HYBRID_MHA = ModelPreset("tiny-hybrid-mha", "tiny hybrid MHA", 8, "mha", 512, 4,
                         (StateSpec("mamba_conv", 2048),))

PAGES, N_REQ = 64, 40
SRC_SLOT, DST_SLOT = 2, 1


def _request() -> tuple[np.ndarray, np.ndarray]:
    src_pages = np.arange(5, 5 + N_REQ, dtype=np.int64)
    dst_pages = fragmented_pages(N_REQ, 1 / 3, seed=7, shuffle_runs=True, capacity=PAGES)
    return src_pages, dst_pages


# ---------------------------------------------------------------------------------------------
# kvplan.testing: strided entries (no engine)
# ---------------------------------------------------------------------------------------------


def test_entry_stride_defaults_to_item_len_and_round_trips() -> None:
    e = Entry(3, "kv", "page", 0, 100, 4)
    assert e.stride == 100 and not e.strided and e.nbytes == 400
    s = Entry(3, "kv", "page", 100, 100, 4, 300)
    assert s.strided and s.nbytes == 3 * 300 + 100
    assert Entry(3, "kv", "page", 0, 100, 4, 100) == e
    with pytest.raises(ValueError, match="below item_len"):
        Entry(3, "kv", "page", 0, 100, 4, 99)
    spec = PeerSpec("p", "cross_layer", (e, s), 8)
    assert PeerSpec.from_dict(spec.to_dict()) == spec


def test_cross_layer_spec_matches_the_preset_layout() -> None:
    """The testing spec and ``ModelPreset.layout(cross_layer=True)`` describe the same pool."""
    for preset in (HYBRID_MLA, HYBRID_MHA):
        spec = preset_peer(preset, "p", range(preset.num_layers), pages=PAGES, cross_layer=True)
        ours = build_layout(spec, 0x1000_0000)
        theirs = preset.layout(range(preset.num_layers), page_size=1, capacity=PAGES,
                               state_slots=4, base=0x1000_0000, cross_layer=True)
        for a, b in zip(ours.entries("page"), theirs.entries("page"), strict=True):
            assert (a.layer_id, a.role, a.item_len, a.stride, a.capacity,
                    a.data_ptr) == (b.layer_id, b.role, b.item_len, b.stride, b.capacity,
                                    b.data_ptr)
        assert [(e.layer_id, e.role, e.item_len) for e in ours.entries("state")] == \
            [(e.layer_id, e.role, e.item_len) for e in theirs.entries("state")]
        pool = [e for e in spec.entries if e.kind == "page"]
        page = sum(e.item_len for e in pool)
        assert all(e.stride == page for e in pool)
        # State buffers come after the pool, never inside it.
        assert min(e.offset for e in spec.entries if e.kind == "state") >= page * PAGES
        assert _wire_round_trips(ours)


def _wire_round_trips(layout: Any) -> bool:
    back = kvplan.Layout.from_bytes(layout.to_bytes())
    return back.strides == layout.strides and back.layer_ids == layout.layer_ids


def test_build_layout_refuses_a_pool_that_is_not_side_by_side() -> None:
    pool = list(cross_layer_entries([(0, "kv", 64), (1, "kv", 64)], 8))
    pool[1] = Entry(1, "kv", "page", pool[1].offset + 8, 64, 8, 128)  # a gap
    with pytest.raises(ValueError, match="side by side"):
        build_layout(PeerSpec("p", "cross_layer", tuple(pool), 2), 0x1000)
    with pytest.raises(ValueError, match="cross_layer style"):
        build_layout(PeerSpec("p", "mla", tuple(pool), 2), 0x1000)


def test_arena_view_is_strided_and_first_wrong_byte_reads_at_strides(tmp_path: Any) -> None:
    """A local copy from a cross-layer pool into another with a different stride, done with
    numpy; first_wrong_byte accepts it and names a byte changed in a page's gap-free pool."""
    pool_src = cross_layer_entries([(0, "kv", 48), (1, "kv", 48)], 16)  # stride 96
    pool_dst = cross_layer_entries([(0, "kv", 48), (1, "kv", 48), (2, "kv", 48)], 16)
    src = PeerSpec("s", "cross_layer", pool_src, 3)
    dst = PeerSpec("d", "cross_layer", pool_dst, 3)
    a_src = Arena(str(tmp_path / "s"), src.size, create=True)
    a_dst = Arena(str(tmp_path / "d"), dst.size, create=True)
    try:
        fill_source(a_src, 5)
        a_dst.array[:] = SENTINEL
        v = a_src.view(pool_src[1])
        assert v.shape == (16, 48) and v.strides == (96, 1)
        np.testing.assert_array_equal(v[3], a_src.array[3 * 96 + 48: 4 * 96])
        src_pages = np.array([0, 1, 2, 9], np.int64)
        dst_pages = np.array([15, 4, 5, 0], np.int64)
        for s_e, d_e in zip(pool_src, pool_dst):
            a_dst.view(d_e)[dst_pages] = a_src.view(s_e)[src_pages]
        writes = [(a_src, src, src_pages, dst_pages, None, None)]
        assert first_wrong_byte(a_dst, dst, writes) is None
        # Layer 2 (not in the source) must stay sentinel: change one of its bytes.
        a_dst.array[5 * 144 + 96 + 7] ^= 0xFF
        msg = first_wrong_byte(a_dst, dst, writes)
        assert msg is not None and "layer 2 kv item 5 byte 7" in msg
        assert f"arena offset {5 * 144 + 96 + 7}" in msg and "not planned" in msg
        a_dst.array[5 * 144 + 96 + 7] = SENTINEL
        a_dst.array[4 * 144 + 48 + 1] ^= 0xFF  # layer 1, destination page 4 (planned)
        msg = first_wrong_byte(a_dst, dst, writes)
        assert msg is not None and "layer 1 kv item 4 byte 1" in msg
    finally:
        a_src.close()
        a_dst.close()


# ---------------------------------------------------------------------------------------------
# Real bytes
# ---------------------------------------------------------------------------------------------


def _run(decode: PeerSpec, stages: list[PeerSpec], engine: Engine) -> list[dict[str, Any]]:
    """Every stage writes one request (pages and one state slot) to the decode peer at once;
    the whole decode arena is then checked against the oracle and against
    ``first_wrong_byte``."""
    from support.engine_peers import assert_stages_landed

    src_pages, dst_pages = _request()
    with engine.cluster(decode, stages) as c:
        dpeer = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        for spec in stages:  # both stages in flight at once, as real PP stages are
            c.peers[spec.name].send("transfer", dpeer.layout_wire, c.sessions[spec.name],
                                    src_pages, dst_pages, SRC_SLOT, DST_SLOT, None,
                                    spec.name.encode())
        results = [c.peers[spec.name].result(60, "transfer") for spec in stages]
        engine.wait_stages(c, stages)
        assert_stages_landed(c, decode, stages, before, src_pages, dst_pages, SRC_SLOT, DST_SLOT)
        assert first_wrong_byte(c.arenas["decode"], decode,
                                [(c.arenas[s.name], s, src_pages, dst_pages, SRC_SLOT,
                                  DST_SLOT) for s in stages]) is None
    return results


def _state_bytes(stage: PeerSpec) -> int:
    return sum(e.item_len for e in stage.entries if e.kind == "state")


def test_cross_layer_hybrid_prefill_pp2_to_decode_pp1(engine: Engine) -> None:
    peers = model_peers(HYBRID_MLA, pages=PAGES, pp_size=2, state_slots=4, cross_layer=True)
    decode, stages = peers.decode, peers.prefill
    assert decode.style == "cross_layer" and all(s.style == "cross_layer" for s in stages)
    assert [[e.layer_id for e in s.entries if e.kind == "page"] for s in stages] == \
        [[3, 7], [11, 15]]
    results = _run(decode, stages, engine)
    item = HYBRID_MLA.kv_bytes_per_token
    for r, stage in zip(results, stages):
        # Two KV layers per stage; six linear layers x two state components.
        assert r["pairs"] == 2 and r["state_pairs"] == 12
        # The stage's two layers are adjacent on both sides: one group. It is the whole page
        # of the prefill pool (stride 2 items) but half of the decode's (4 items): one block
        # per page, 2 items long, plus one per state pair.
        assert r["groups"] == 1
        assert r["blocks"] == N_REQ + 12
        assert r["bytes"] == N_REQ * 2 * item + _state_bytes(stage)


def test_cross_layer_prefill_to_per_layer_decode(engine: Engine) -> None:
    """Mixed layouts: strides differ per pair (pool page vs one item), so nothing coalesces
    and every page pair is one block per page; pairing by (layer id, role) is unchanged."""
    peers = model_peers(HYBRID_MLA, pages=PAGES, pp_size=2, state_slots=4, cross_layer=True,
                        decode_cross_layer=False)
    decode, stages = peers.decode, peers.prefill
    assert decode.style == "hybrid_mla"
    results = _run(decode, stages, engine)
    item = HYBRID_MLA.kv_bytes_per_token
    for r, stage in zip(results, stages):
        assert r["pairs"] == 2 and r["groups"] == 2
        assert r["blocks"] == 2 * N_REQ + 12
        assert r["bytes"] == N_REQ * 2 * item + _state_bytes(stage)


def test_cross_layer_mha_pp1_whole_page_is_one_block_per_run(engine: Engine) -> None:
    """PP=1 with the same pool on both sides: the group (every K and V of a page) is the whole
    page on both sides, so a run of contiguous pages is one block."""
    peers = model_peers(HYBRID_MHA, pages=PAGES, pp_size=1, state_slots=4, cross_layer=True)
    decode, (stage,) = peers.decode, peers.prefill
    assert [e.role for e in decode.entries if e.kind == "page"] == ["k", "v", "k", "v"]
    (r,) = _run(decode, [stage], engine)
    # Layers 3 and 7 hold KV (k and v each); six linear layers x one state component.
    assert r["pairs"] == 4 and r["groups"] == 1 and r["state_pairs"] == 6
    assert r["blocks"] == r["runs"] + 6 < N_REQ
    assert r["bytes"] == N_REQ * 4 * HYBRID_MHA.kv_bytes_per_token + _state_bytes(stage)


@pytest.mark.slow
@pytest.mark.mooncake
def test_kvplan_demo_cross_layer_verifies_every_byte() -> None:
    """``kvplan demo --layout cross-layer`` end to end over Mooncake (smaller than default)."""
    import re
    import subprocess
    import sys

    from support.engine_peers import require_mooncake

    require_mooncake()
    res = subprocess.run([sys.executable, "-m", "kvplan.cli", "demo", "--layout", "cross-layer",
                          "--layers", "16", "--pages", "1024"], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout
    assert "cross-layer KV" in out and "layout:         cross-layer pools" in out
    # 4 MLA layers (3, 7, 11, 15): the decode page holds 4 items, each stage's 2.
    assert f"decode page {4 * 1152:,} B, prefill stage pages {2 * 1152:,}, {2 * 1152:,} B" in out
    assert "entries paired: 4 KV + 24 state" in out
    # 768 pages per stage, one block per page per stage (2 groups), + 24 state blocks.
    assert re.search(r"^blocks: +1,560 = 4 KV pairs coalesced into 2 group\(s\) x 768 pages",
                     out, re.M), out
    assert re.search(r"^verified: \d+ bytes OK", out, re.M), out
