"""Prefill TP != decode TP through the bindings: tp_peers, head-sliced templates on real bytes
(numpy arenas, blocks applied as memmoves), empty templates and why, compare() wording, presets.
The full matrix (TP {1,2,4,8}², H {1,2,8,16}, NHD/HND, MHA/MLA, PP 1/2) runs in the core's
byte-level simulation (rust/kvplan-core/tests/tp.rs)."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.presets import ModelPreset, get_preset

TOKENS, HEAD_DIM, LAYERS = 4, 2, 3
PAGES = 5
SRC_PAGES = np.array([0, 1, 3], dtype=np.int64)
DST_PAGES = np.array([4, 2, 0], dtype=np.int64)


def global_kv(heads: int) -> np.ndarray:
    """[layer][K/V][request page][token][head][dim] as uint16 (bf16-sized elements)."""
    n = LAYERS * 2 * len(SRC_PAGES) * TOKENS * heads * HEAD_DIM
    return (np.arange(n, dtype=np.uint32) * 2654435761 % 65521).astype(np.uint16).reshape(
        LAYERS, 2, len(SRC_PAGES), TOKENS, heads, HEAD_DIM)


def rank_pool(kv: np.ndarray | None, heads: tuple[int, int], pages: np.ndarray, order: str,
              n_heads: int) -> np.ndarray:
    """[layer][K/V][pool page] items of this rank's heads, in its memory order."""
    pool = np.full((LAYERS, 2, PAGES, TOKENS * n_heads * HEAD_DIM), 0xEEEE, dtype=np.uint16)
    if kv is not None:
        part = kv[:, :, :, :, heads[0]:heads[1], :]
        if order == "HND":
            part = part.transpose(0, 1, 2, 4, 3, 5)
        pool[:, :, pages, :] = part.reshape(LAYERS, 2, len(pages), -1)
    return pool


def layout(pool: np.ndarray, order: str, kv_heads: int, tp_rank: int, tp_size: int
           ) -> kvplan.Layout:
    base = pool.ctypes.data
    entry = pool.shape[2] * pool.shape[3] * 2
    item = pool.shape[3] * 2
    k = [base + (layer * 2) * entry for layer in range(LAYERS)]
    v = [base + (layer * 2 + 1) * entry for layer in range(LAYERS)]
    return kvplan.Layout.mha(k, v, [entry] * LAYERS, [entry] * LAYERS, item, item,
                             layer_ids=list(range(LAYERS)),
                             page_size=TOKENS, tp_rank=tp_rank, tp_size=tp_size,
                             kv_heads=kv_heads, head_dim=HEAD_DIM, dtype_size=2,
                             memory_order=order)


def apply(plan: kvplan.TransferPlan, src: np.ndarray, dst: np.ndarray, seen: np.ndarray) -> None:
    s_base, d_base = src.ctypes.data, dst.ctypes.data
    s_bytes, d_bytes = src.view(np.uint8).reshape(-1), dst.view(np.uint8).reshape(-1)
    for s, d, n in zip(*plan.as_lists()):
        s, d = s - s_base, d - d_base
        assert not seen[d:d + n].any(), "a destination byte written twice"
        seen[d:d + n] = True
        d_bytes[d:d + n] = s_bytes[s:s + n]


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [(8, 8, 2), (8, 2, 8), (2, 4, 1), (2, 1, 4),
                                                      (1, 2, 4), (16, 4, 4)])
def test_head_sliced_bytes(order: str, heads: int, tp_p: int, tp_d: int) -> None:
    kv = global_kv(heads)
    for r_d in range(tp_d):
        peers = kvplan.tp_peers(heads, tp_p, tp_d, decode_rank=r_d)
        hd = max(1, heads // tp_d)
        dst = rank_pool(None, peers.heads, DST_PAGES, order, hd)
        want = rank_pool(kv, peers.heads, DST_PAGES, order, hd)
        seen = np.zeros(dst.nbytes, dtype=bool)
        d_layout = layout(dst, order, heads, r_d, tp_d)
        for r_p in range(tp_p):
            mine = kvplan.tp_peers(heads, tp_p, tp_d, prefill_rank=r_p)
            src = rank_pool(kv, mine.heads, SRC_PAGES, order, max(1, heads // tp_p))
            t = kvplan.Template(layout(src, order, heads, r_p, tp_p), d_layout)
            plan = t.plan(SRC_PAGES, DST_PAGES)
            if r_p not in peers.receive_from:
                assert len(plan) == 0 and t.empty_reason is not None
                assert t.empty_reason == peers.reason(r_p)
                continue
            assert t.empty_reason is None and r_d in mine.send_to
            apply(plan, src, dst, seen)
        np.testing.assert_array_equal(dst, want)


def test_tp_peers_words_and_election() -> None:
    p = kvplan.tp_peers(8, 8, 2, decode_rank=1)
    assert (p.side, p.rank, p.heads, p.peers, p.receive_from) == ("decode", 1, (4, 8),
                                                                  [4, 5, 6, 7], [4, 5, 6, 7])
    assert str(p) == ("decode rank 1 of TP 2 (heads 4–7) gathers heads 4–7 from prefill "
                      "ranks 4–7")
    assert p.heads_with(5) == (5, 6) and p.heads_with(0) is None
    q = kvplan.tp_peers(8, 2, 8, prefill_rank=1)
    assert q.send_to == [4, 5, 6, 7] and q.is_sender and q.receive_from == []
    # MLA (one replicated latent): each decode rank has exactly one sender, rotating.
    senders = [kvplan.tp_peers(1, 8, 2, decode_rank=r).receive_from for r in range(2)]
    assert senders == [[0], [1]]
    assert [kvplan.tp_peers(1, 2, 4, decode_rank=r).receive_from for r in range(4)] == [
        [0], [1], [0], [1]]
    lone = kvplan.tp_peers(1, 8, 2, prefill_rank=3)
    assert not lone.is_sender and lone.peers == [0, 1]
    assert "prefill rank 1 is elected" in (lone.reason(1) or "")
    with pytest.raises(kvplan.KvPlanError, match="neither divides the other"):
        kvplan.tp_peers(3, 2, 1, decode_rank=0)
    with pytest.raises(kvplan.KvPlanError, match="decode rank 2 is outside TP size 2"):
        kvplan.tp_peers(8, 8, 2, decode_rank=2)
    with pytest.raises(TypeError):
        kvplan.tp_peers(8, 8, 2)


def test_geometry_mismatch_is_a_size_mismatch_error_naming_values() -> None:
    src = rank_pool(None, (0, 4), SRC_PAGES, "NHD", 4)
    dst = rank_pool(None, (0, 2), DST_PAGES, "NHD", 2)
    # Different memory orders are planned token by token, which does not re-slice heads too:
    # the error names both splits, page sizes and orders.
    want = (r"prefill TP 2 x 4 heads \(4 tokens per page, NHD\) and decode TP 4 x 2 heads "
            r"\(4 tokens per page, HND\)")
    with pytest.raises(kvplan.SizeMismatchError, match=want):
        kvplan.Template(layout(src, "NHD", 8, 0, 2), layout(dst, "HND", 8, 0, 4))
    report = kvplan.compare(layout(src, "NHD", 8, 0, 2), layout(dst, "HND", 8, 0, 4))
    assert not report.compatible and "not supported yet" in " ".join(report.reasons)


def test_compare_says_who_sends_what() -> None:
    m = ModelPreset("llama-70b", "Llama-70B-like", 8, "mha", 2048, kv_heads=8, head_dim=128)
    d = m.layout(range(8), page_size=64, capacity=8, tp_rank=1, tp_size=2, base=1 << 44)
    text = str(kvplan.compare(m.layout(range(8), page_size=64, capacity=8, tp_rank=5, tp_size=8),
                              d))
    assert ("prefill TP 8 × 1 head, decode TP 2 × 4 heads: decode rank 1 of TP 2 (heads 4–7) "
            "gathers heads 4–7 from prefill ranks 4–7") in text
    assert "moves head 5 (NHD: one block per token slot, 64 per page and entry)" in text
    assert "strides differ" not in text
    other = kvplan.compare(m.layout(range(8), page_size=64, capacity=8, tp_rank=0, tp_size=8), d)
    assert other.compatible
    assert any("moves no KV: prefill rank 0 holds head 0 and decode rank 1 holds heads 4–7"
               in w for w in other.warnings)


def test_presets_publish_geometry_for_tp() -> None:
    q = get_preset("qwen3-next")
    p = q.layout(q.layers if hasattr(q, "layers") else range(q.num_layers), page_size=16,
                 capacity=4, tp_rank=3, tp_size=4)
    assert (p.kv_heads, p.heads_per_rank, p.head_dim, p.memory_order) == (2, 1, 256, "NHD")
    d = q.layout(range(q.num_layers), page_size=16, capacity=4, tp_size=1, base=1 << 44,
                 memory_order="NHD")
    t = kvplan.Template(p, d)
    # Rank 3 of 4 holds head 1 (replicated on ranks 2, 3); decode rank 0 takes it from rank 2.
    assert t.empty_reason is not None and "prefill rank 2 is elected" in t.empty_reason
    # Sharded state still moves: prefill rank 3's quarter of every state item.
    state = t.plan_state(0, 1)
    assert len(state) == 36 * 2 and state.total_bytes == (49_152 + 2_097_152) // 4 * 36
    ds = get_preset("deepseek-v3")
    a = ds.layout(range(61), page_size=64, capacity=2, tp_rank=1, tp_size=8)
    b = ds.layout(range(61), page_size=64, capacity=2, tp_rank=1, tp_size=2, base=1 << 44)
    assert kvplan.Template(a, b).n_blocks_for(2) == 61  # the whole latent, one block per layer
