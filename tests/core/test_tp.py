"""Prefill TP != decode TP through the bindings: tp_peers, head-sliced templates on real bytes
(numpy arenas, blocks applied as memmoves and checked against kvplan.testing's oracle), empty templates and why, compare() wording, presets.
The full matrix (TP {1,2,4,8}², H {1,2,8,16}, NHD/HND, MHA/MLA, PP 1/2) runs in the core's
byte-level simulation (rust/kvplan-core/tests/tp.rs)."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.presets import ModelPreset, get_preset
from kvplan.testing.ranks import Model, Rank, check_request, rank_memory

TOKENS, HEAD_DIM, LAYERS = 4, 2, 3
PAGES = 5
SRC_PAGES = np.array([0, 1, 3], dtype=np.int64)
DST_PAGES = np.array([4, 2, 0], dtype=np.int64)
STATE_SLOTS, SHARDED = 2, 64  # state slots per rank; bytes of the whole sharded state item


def model(heads: int, *, mla: bool = False, state: bool = False) -> Model:
    return Model(layers=LAYERS, kv_heads=heads, head_dim=HEAD_DIM, dtype_size=2, mla=mla,
                 state_bytes=SHARDED if state else 0)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [(8, 8, 2), (8, 2, 8), (2, 4, 1), (2, 1, 4),
                                                      (1, 2, 4), (16, 4, 4)])
def test_head_sliced_bytes(order: str, heads: int, tp_p: int, tp_d: int) -> None:
    for r_d in range(tp_d):
        peers = kvplan.tp_peers(heads, tp_p, tp_d, decode_rank=r_d)
        templates = check_request(model(heads), Rank(0, tp_p, TOKENS, order, PAGES),
                                  Rank(r_d, tp_d, TOKENS, order, PAGES), SRC_PAGES, DST_PAGES)
        for r_p, t in templates.items():
            mine = kvplan.tp_peers(heads, tp_p, tp_d, prefill_rank=r_p)
            if r_p not in peers.receive_from:
                assert len(t.plan(SRC_PAGES, DST_PAGES)) == 0 and t.empty_reason is not None
                assert t.empty_reason == peers.reason(r_p)
                continue
            assert t.empty_reason is None and r_d in mine.send_to


@pytest.mark.parametrize("heads", [1, 2, 8, 16])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_heads_per_rank_is_the_split_tp_peers_and_layouts_use(heads: int, tp: int) -> None:
    """``_core.heads_per_rank`` (what Python sizes a rank's items with) is the width of the
    heads ``tp_peers`` gives every rank and the ``heads_per_rank`` a layout defaults to."""
    per = kvplan._core.heads_per_rank(heads, tp)
    assert per == max(1, heads // tp)
    for r in range(tp):
        start, stop = kvplan.tp_peers(heads, tp, 1, prefill_rank=r).heads
        assert stop - start == per
    layout = kvplan.Layout([0x1000], [4096], 64, kv_heads=heads, head_dim=1, dtype_size=1,
                           tp_size=tp)
    assert layout.heads_per_rank == per


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


# ---------------------------------------------------------------------------------------------
# Token plans (different page sizes or memory orders, or n_tokens) re-slice heads as page plans do
# ---------------------------------------------------------------------------------------------

def layout(heads: int, tp_rank: int, tp_size: int, page_size: int, order: str,
           capacity: int) -> kvplan.Layout:
    return rank_memory(model(heads), Rank(tp_rank, tp_size, page_size, order, capacity)).layout


def gather(heads: int, tp_p: int, tp_d: int, r_d: int, *, page_sizes: tuple[int, int],
           orders: tuple[str, str], n_tokens: int, given: bool, mla: bool = False,
           state: bool = False) -> dict[int, kvplan.Template]:
    """Plans every prefill rank into decode rank r_d (and state slot 0 -> 1) and checks the
    decode rank's memory byte for byte against kvplan.testing's oracle, with no byte written
    twice; a rank outside the decode rank's receive list must plan no KV and say why. Returns
    the templates of the ranks tp_peers(decode_rank=r_d).peers names."""
    (ps, pd), (op, od) = page_sizes, orders
    src_pages = np.array([p for p in range(-(-n_tokens // ps) + 3) if p != 1][:-(-n_tokens // ps)])
    dst_pages = np.arange(-(-n_tokens // pd))[::-1].copy()
    templates = check_request(model(heads, mla=mla, state=state),
                              Rank(0, tp_p, ps, op, len(src_pages) + 3, state_slots=STATE_SLOTS),
                              Rank(r_d, tp_d, pd, od, len(dst_pages) + 2, state_slots=STATE_SLOTS),
                              src_pages, dst_pages, n_tokens=n_tokens if given else None)
    peers = kvplan.tp_peers(heads, tp_p, tp_d, decode_rank=r_d)
    for r_p, t in templates.items():
        if r_p not in peers.receive_from:
            assert len(t.plan(src_pages, dst_pages, n_tokens=n_tokens if given else None)) == 0
            if r_p in peers.peers:
                assert t.empty_reason == peers.reason(r_p)
    return {r_p: t for r_p, t in templates.items() if r_p in peers.peers}


def test_equal_tp_different_ranks_move_no_heads_in_token_plans() -> None:
    """kv_heads 8, TP 2 -> 2: prefill rank 0 holds heads 0-3, decode rank 1 heads 4-7. Token plans
    (16 -> 64 tokens per page, or 16 -> 16 with n_tokens) used to copy heads 0-3 into the slots
    of heads 4-7 (4,096 bytes at 16 -> 64) with no empty_reason."""
    for page_sizes, given in (((16, 64), False), ((16, 16), True)):
        for r_d in (0, 1):
            t = gather(8, 2, 2, r_d, page_sizes=page_sizes, orders=("NHD", "NHD"), n_tokens=64,
                       given=given)
            assert set(t) == {r_d}  # the peer lists of equal TP sizes hold the same rank only
        t = kvplan.Template(layout(8, 0, 2, page_sizes[0], "NHD", 6),
                            layout(8, 1, 2, page_sizes[1], "NHD", 6))
        assert t.empty_reason == ("prefill rank 0 holds heads 0–3 and decode rank 1 holds heads "
                                  "4–7: no head in common")
        pages = np.arange(64 // page_sizes[0]), np.arange(64 // page_sizes[1])
        assert len(t.plan(*pages, n_tokens=64 if given else None)) == 0


def test_mla_sharded_state_token_plan_has_one_sender_per_decode_rank() -> None:
    """MLA with a TP-sharded state entry, TP 2 -> 2, pages 1 -> 64, templates for every rank of
    tp_peers(decode_rank=r).peers: every KV byte used to be written twice and decode rank 0's
    state shard overwritten with rank 1's."""
    for r_d in (0, 1):
        templates = gather(1, 2, 2, r_d, page_sizes=(1, 64), orders=("NHD", "NHD"), n_tokens=128,
                           given=False, mla=True, state=True)
        assert sorted(templates) == [0, 1]
        other = templates[1 - r_d]
        assert other.empty_reason is not None and "elected" in other.empty_reason


@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [(8, 8, 2), (8, 2, 8), (2, 4, 1), (1, 2, 4),
                                                      (16, 4, 4)])
@pytest.mark.parametrize(("page_sizes", "orders"), [((16, 64), ("NHD", "HND")),
                                                    ((64, 16), ("HND", "NHD")),
                                                    ((16, 16), ("NHD", "HND")),
                                                    ((4, 4), ("HND", "HND"))])
def test_head_slicing_with_token_plans_is_byte_exact(heads: int, tp_p: int, tp_d: int,
                                                     page_sizes: tuple[int, int],
                                                     orders: tuple[str, str]) -> None:
    """Re-slicing heads between TP sizes together with re-paging tokens (different page sizes
    or memory orders, or n_tokens with a partial last page) used to be refused; it is planned
    byte-exact, state included."""
    for r_d in range(tp_d):
        for n_tokens, given in ((64, False), (20, True)):
            gather(heads, tp_p, tp_d, r_d, page_sizes=page_sizes, orders=orders,
                   n_tokens=n_tokens, given=given, state=True)


def test_head_sliced_template_plans_n_tokens_with_a_partial_last_page() -> None:
    """TP 8 -> 2 at equal page sizes: plan(..., n_tokens=20) used to raise "fragments ... build
    the template without fragments" on a pair that moves heads (the caller gave none), and
    "bytes per token differ" on a pair with no head in common, instead of the empty plan;
    n_token_blocks(20) likewise."""
    for order in ("NHD", "HND"):
        templates = gather(8, 8, 2, 1, page_sizes=(16, 16), orders=(order, order), n_tokens=20,
                           given=True)
        moving = templates[5]
        # NHD: head 5 is one of four heads of a decode token, one block per token and entry;
        # HND: one block per page segment and entry (20 tokens in two pages of 16).
        per_entry = 20 if order == "NHD" else 2
        assert moving.n_token_blocks(20) == per_entry * 2 * LAYERS
        idle = kvplan.Template(layout(8, 0, 8, 16, order, 4), layout(8, 1, 2, 16, order, 4))
        assert idle.empty_reason is not None and "no head in common" in idle.empty_reason
        assert len(idle.plan(np.arange(2), np.arange(2), n_tokens=20)) == 0
        assert idle.n_token_blocks(20) == 0


def test_geometry_mismatch_is_a_size_mismatch_error_naming_values() -> None:
    """The geometry refusals hold whatever the page sizes and memory orders: they used to be
    skipped when page sizes differed (bf16 elements planned as bytes)."""
    def mha(page_size: int, **geometry: int | str) -> kvplan.Layout:
        g: dict[str, int | str] = dict(kv_heads=8, heads_per_rank=4, head_dim=HEAD_DIM,
                                       dtype_size=2, memory_order="NHD", tp_size=2)
        g.update(geometry)
        item = page_size * int(g["heads_per_rank"]) * HEAD_DIM * 2
        return kvplan.Layout.mha([0x1000], [0x9000_0000], [item * 8], [item * 8], item, item, [0],
                                 page_size=page_size, **g)  # type: ignore[arg-type]
    src = mha(16)
    wrong = [
        (dict(head_dim=2 * HEAD_DIM, dtype_size=1), "head dims differ"),
        (dict(heads_per_rank=2), "decode publishes heads_per_rank 2 but kv_heads 8 over TP size 2 "
                                 "gives 4 per rank"),
        (dict(kv_heads=16, heads_per_rank=8), r"model KV head counts \(kv_heads\) differ "
                                              r"\(prefill 8, decode 16\)"),
    ]
    for page_size in (16, 64):
        for order in ("NHD", "HND"):
            for geometry, message in wrong:
                dst = mha(page_size, memory_order=order, **geometry)  # type: ignore[arg-type]
                with pytest.raises(kvplan.SizeMismatchError, match=message):
                    kvplan.Template(src, dst)
                report = kvplan.compare(src, dst)
                assert not report.compatible
                assert report.first_problem is not None
                assert report.first_problem[0] == "SizeMismatchError"


def test_compare_says_who_sends_what() -> None:
    m = ModelPreset("llama-70b", "Llama-70B-like", 8, "mha", 2048, kv_heads=8, head_dim=128)
    d = m.layout(range(8), page_size=64, capacity=8, tp_rank=1, tp_size=2, base=1 << 44)
    text = str(kvplan.compare(m.layout(range(8), page_size=64, capacity=8, tp_rank=5, tp_size=8),
                              d))
    assert ("prefill TP 8 × 1 head, decode TP 2 × 4 heads: decode rank 1 of TP 2 (heads 4–7) "
            "gathers heads 4–7 from prefill ranks 4–7") in text
    assert "moves head 5 (NHD: one block per token slot, 64 per page and entry)" in text
    # A token plan (decode pages of 16 tokens, head-major) moves the same head, token by token.
    d16 = m.layout(range(8), page_size=16, capacity=32, tp_rank=1, tp_size=2, base=1 << 44,
                   memory_order="HND")
    text = str(kvplan.compare(m.layout(range(8), page_size=64, capacity=8, tp_rank=5, tp_size=8),
                              d16))
    assert "moves head 5 (token plan: one block per head per token and entry)" in text
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
    # Sharded state still moves: prefill rank 3's quarter of every state item, the GDN conv
    # state as its q, k and v sub-blocks (2048, 2048, 4096 channels of 6 bytes, each split over
    # TP on its own) into their places in the decode's whole row, the recurrent state as one
    # quarter of its heads.
    state = t.plan_state(0, 1)
    assert len(state) == 36 * 4 and state.total_bytes == (49_152 + 2_097_152) // 4 * 36
    conv_s = next(e for e in p.entries("state") if e.role == "mamba_conv")
    conv_d = next(e for e in d.entries("state") if e.role == "mamba_conv")
    src, dst, lens = state.as_lists()
    got = sorted((s - conv_s.data_ptr, t - conv_d.data_ptr - conv_d.stride, n)
                 for s, t, n in zip(src, dst, lens) if conv_s.data_ptr <= s < conv_s.data_ptr +
                 conv_s.data_len)
    assert got == [(0, 1536 * 6, 512 * 6), (512 * 6, (2048 + 1536) * 6, 512 * 6),
                   (1024 * 6, (4096 + 3072) * 6, 1024 * 6)]
    ds = get_preset("deepseek-v3")
    a = ds.layout(range(61), page_size=64, capacity=2, tp_rank=1, tp_size=8)
    b = ds.layout(range(61), page_size=64, capacity=2, tp_rank=1, tp_size=2, base=1 << 44)
    assert kvplan.Template(a, b).n_blocks_for(2) == 61  # the whole latent, one block per layer


def test_replicas_send_makes_every_writer_send_its_copy() -> None:
    """2 KV heads, prefill TP 8 -> decode TP 2: decode rank 0's writers are prefill ranks 0-3,
    all holding head 0. By default only the elected holder (rank 0) plans bytes; with
    ``replicas_send=True`` every writer moves its own copy to the same place, a holder of the
    head that writes another decode rank plans nothing and says why, and compare() agrees with
    the template on which pairs build."""
    m = ModelPreset("two-heads", "two KV heads", 2, "mha", 2048, kv_heads=2, head_dim=8)

    def rank(r: int, tp: int, base: int, page_size: int = 4) -> kvplan.Layout:
        return m.layout(range(2), page_size=page_size, capacity=6, tp_rank=r, tp_size=tp,
                        base=base)

    pages = np.array([3, 0, 5]), np.array([1, 4, 2])
    dst = rank(0, 2, 1 << 44)
    elected = [kvplan.Template(rank(r, 8, 1 << 40), dst) for r in range(4)]
    assert [t.empty_reason is None for t in elected] == [True, False, False, False]
    assert "prefill rank 0 is elected" in (elected[1].empty_reason or "")
    want = elected[0].plan(*pages)
    for r in range(4):
        t = kvplan.Template(rank(r, 8, 1 << 40), dst, replicas_send=True)
        assert t.empty_reason is None
        got = t.plan(*pages)
        assert np.array_equal(got.dst_addrs, want.dst_addrs), r
        assert np.array_equal(got.lengths, want.lengths), r
    # Decode TP 4 replicates heads too: prefill ranks 0-3 hold head 0 for decode ranks 0 and 1;
    # decode rank 1's writers are prefill ranks 2 and 3.
    d1 = rank(1, 4, 1 << 44)
    for r in range(4):
        t = kvplan.Template(rank(r, 8, 1 << 40), d1, replicas_send=True)
        assert (t.empty_reason is None) == (r in (2, 3)), (r, t.empty_reason)
        if r < 2:
            assert "its 2 writers, prefill ranks 2–3" in (t.empty_reason or "")
    # Item lengths are checked for every pair that moves heads: a decode item padded to twice
    # the geometry's bytes fails the writers that send, and compare() says so too.
    geometry = dict(page_size=4, kv_heads=2, head_dim=8, dtype_size=2, memory_order="NHD")

    def flat(r: int, tp: int, item: int, base: int) -> kvplan.Layout:
        return kvplan.Layout([base, base + (1 << 20)], [item * 6] * 2, item, tp_rank=r,
                             tp_size=tp, heads_per_rank=max(1, 2 // tp), **geometry)

    padded = flat(0, 2, 2 * 4 * 16, 1 << 44)
    for replicas_send in (False, True):
        built = []
        for r in range(4):
            src = flat(r, 8, 4 * 16, 1 << 40)
            report = kvplan.compare(src, padded, replicas_send=replicas_send)
            try:
                kvplan.Template(src, padded, replicas_send=replicas_send)
                built.append(True)
            except kvplan.SizeMismatchError:
                built.append(False)
            assert report.compatible == built[-1], (r, replicas_send)
        assert built == ([False, True, True, True] if not replicas_send else [False] * 4)
