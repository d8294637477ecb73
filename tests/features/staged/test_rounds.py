"""Staged plans in rounds on CPU memory: ``Template.plan_rounds`` through bounded arenas.

Every round runs through the NumPy executor (``kvplan.exec``) or ``kvplan.copy_local`` into a
decode memory that must equal the direct plan applied, byte for byte, over drawn cases: TP
{1,2,4,8}², head counts, NHD/HND, page ratios, MLA, sliding windows, state entries and DCP
decodes, with arenas from one byte per round buffer up to more than the request (one round).
No round touches staging memory outside its own round buffers (the executor refuses a block
outside the arena it was given, and each round's blocks are checked against its buffer). Where
``plan_staged`` refuses a request, ``plan_rounds`` refuses it the same way. The default run
draws a few hundred cases (deterministic under CI); ``KVPLAN_ROUNDS_EXAMPLES`` raises the count
(10⁴ or more for an open-ended search). Prefill PP runs in rust/kvplan-core/tests/rounds.rs.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.exec import stages, steps
from kvplan.exec.numpy import Memory, NumpyExecutor, apply_plan
from kvplan.testing.ranks import Model, Rank, rank_memory

EXAMPLES = int(os.environ.get("KVPLAN_ROUNDS_EXAMPLES", "300"))
HEAD_DIM = 4
BIG = 1 << 22


@dataclass(frozen=True)
class Case:
    heads: int
    tp_p: int
    tp_d: int
    r_p: int
    r_d: int
    order: str
    page_sizes: tuple[int, int]
    n_tokens: int
    window: int | None
    state: bool
    mla: bool
    buffer: str
    buffers: int
    copy_local: bool
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    mla = draw(st.booleans()) and draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 8, 16]))
    tp_p, tp_d = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    ps, pd = draw(st.sampled_from([(1, 1), (4, 4), (16, 16), (4, 16), (16, 4), (1, 8), (8, 1)]))
    return Case(
        heads, tp_p, tp_d, draw(st.integers(0, tp_p - 1)), draw(st.integers(0, tp_d - 1)),
        draw(st.sampled_from(["NHD", "HND"])), (ps, pd), draw(st.integers(1, 70)),
        draw(st.one_of(st.none(), st.integers(1, 40))), draw(st.booleans()), mla,
        draw(st.sampled_from(["byte", "small", "third", "half", "exact", "more"])),
        draw(st.sampled_from([1, 2, 2, 3])), draw(st.booleans()), draw(st.integers(0, 2**16)))


def pages(n_tokens: int, page_size: int, capacity: int, seed: int) -> np.ndarray:
    count = -(-n_tokens // page_size)
    return np.random.default_rng(seed).permutation(capacity)[:count].astype(np.int64)


def buffer_bytes(case: Case, total: int) -> int:
    rng = np.random.default_rng(case.seed)
    return max(1, {
        "byte": 1 if total <= 2048 else int(rng.integers(1, 64)),
        "small": int(rng.integers(1, 200)),
        "third": total // 3,
        "half": total // 2 + 1,
        "exact": total,
        "more": total + int(rng.integers(1, 1000)),
    }[case.buffer])


def run_rounds(rounds: kvplan.StagedRounds, src: Memory, dst: Memory, arenas: tuple[
        np.ndarray, np.ndarray], *, by_copy_local: bool) -> int:
    """Runs every round; checks each stays inside its round buffers. Returns bytes sent."""
    src_arena, dst_arena = arenas
    src_addr, dst_addr = int(src_arena.ctypes.data), int(dst_arena.ctypes.data)
    src_buffer = src_arena.size // rounds.buffers
    offset = 0
    for k, one in enumerate(rounds):
        m = one.manifest
        assert (m.index, m.n_rounds, m.buffer) == (k, len(rounds), k % rounds.buffers)
        assert m.offset == offset and 0 < m.bytes <= rounds.buffer_bytes
        assert kvplan.RoundManifest.from_bytes(m.to_bytes()) == m
        offset += m.bytes
        lo = src_addr + m.buffer * src_buffer
        gather = one.gather
        assert gather.total_bytes == m.bytes == int(gather.lengths.sum())
        assert int(gather.dst_addrs.min()) >= lo
        assert int((gather.dst_addrs + gather.lengths).max()) <= lo + rounds.buffer_bytes
        start, end = m.dst_bytes_range
        assert rounds.dst_share[0] <= start and end <= rounds.dst_share[1]
        scatter = one.scatter
        assert int(scatter.src_addrs.min()) >= dst_addr + start
        assert int((scatter.src_addrs + scatter.lengths).max()) <= dst_addr + end
        assert list(one.network.lengths) == [m.bytes]
        assert (int(one.network.src_addrs[0]), int(one.network.dst_addrs[0])) == (
            lo, dst_addr + start)
    assert offset == rounds.bytes
    if not by_copy_local:
        executor = NumpyExecutor(src, dst, src_staging=Memory.of(src_arena),
                                 dst_staging=Memory.of(dst_arena),
                                 written=np.zeros(dst.data.size, bool))
        return executor.run(rounds)
    moved = 0
    for one in rounds:
        assert kvplan.copy_local(one.gather, [src.data], [src_arena]) == one.manifest.bytes
        apply_plan(one.network, Memory.of(src_arena), Memory.of(dst_arena))
        moved += int(one.network.lengths.sum())
        assert kvplan.copy_local(one.scatter, [dst_arena], [dst.data]) == one.manifest.bytes
    return moved


def check_case(case: Case) -> None:
    model = Model(layers=2, kv_heads=case.heads, head_dim=HEAD_DIM, dtype_size=2, mla=case.mla,
                  state_bytes=48 if case.state else 0, window=case.window)
    ps, pd = case.page_sizes

    def capacity(page: int) -> int:
        return max(-(-case.n_tokens // page), -(-(case.window or 0) // page)) + 3

    # A prefill rank that sends to the decode rank (the drawn one picks among them).
    senders_of = kvplan.tp_peers(case.heads, case.tp_p, case.tp_d,
                                 decode_rank=case.r_d).receive_from
    r_p = senders_of[case.r_p % len(senders_of)] if senders_of else case.r_p
    src = rank_memory(model, Rank(r_p, case.tp_p, ps, case.order, capacity(ps)),
                      seed=case.seed)
    dst = rank_memory(model, Rank(case.r_d, case.tp_d, pd, case.order, capacity(pd)))
    sp = pages(case.n_tokens, ps, capacity(ps), case.seed)
    dp = pages(case.n_tokens, pd, capacity(pd), case.seed + 1)
    tokens = case.n_tokens if ps != pd else None
    template = kvplan.Template(src.layout, dst.layout)
    # one share per prefill rank sending the decode rank its heads (the elected holders)
    senders = len(senders_of)
    try:
        staged = template.plan_staged(sp, dp, n_tokens=tokens, src_staging=(1 << 40, BIG),
                                      dst_staging=(1 << 44, BIG))
    except kvplan.KvPlanError as refused:
        with pytest.raises(type(refused)) as e:
            template.plan_rounds(sp, dp, n_tokens=tokens, src_arena=(1 << 40, 2),
                                 dst_arena=(1 << 44, 2 * senders))
        assert e.value.kind == refused.kind, (e.value, refused)
        return
    want = dst.memory.copy()
    apply_plan(template.plan(sp, dp, n_tokens=tokens), src.memory, want)
    size = buffer_bytes(case, staged.src_staging_bytes)
    src_arena = np.zeros(size * case.buffers, np.uint8)
    dst_arena = np.zeros(size * case.buffers * senders, np.uint8)
    rounds = template.plan_rounds(
        sp, dp, n_tokens=tokens, buffers=case.buffers,
        src_arena=(int(src_arena.ctypes.data), src_arena.size),
        dst_arena=(int(dst_arena.ctypes.data), dst_arena.size))
    assert rounds.sender[1] == senders and rounds.buffer_bytes == size
    assert rounds.bytes == staged.src_staging_bytes
    assert rounds.direct_blocks == staged.direct_blocks
    assert len(rounds) >= -(-rounds.bytes // size)
    if case.buffer in ("exact", "more") and rounds.bytes:
        assert len(rounds) == 1
    got = dst.memory  # at its real addresses, for copy_local
    moved = run_rounds(rounds, src.memory, got, (src_arena, dst_arena),
                       by_copy_local=case.copy_local)
    assert moved == rounds.bytes
    bad = np.flatnonzero(got.data != want.data)
    assert bad.size == 0, f"{bad.size} bytes differ from the direct plan, the first at {bad[0]}"


@settings(max_examples=EXAMPLES, deadline=None)
@given(cases())
def test_rounds_equal_the_direct_plan(case: Case) -> None:
    check_case(case)


@pytest.mark.parametrize("case", [
    # TP 8 → 2 NHD, a buffer of one byte: every block split at byte boundaries.
    Case(8, 8, 2, 5, 1, "NHD", (4, 4), 9, None, False, False, "byte", 2, False, 1),
    # Page 16 → 4, window and state, one round.
    Case(2, 1, 2, 0, 1, "HND", (16, 4), 37, 5, True, False, "more", 2, True, 2),
    # MLA, page 1 → 8, three buffers.
    Case(1, 2, 1, 1, 0, "NHD", (1, 8), 61, None, True, True, "third", 3, False, 3),
    # Several writers and a window entry of another slot size: refused as plan_staged is.
    Case(8, 8, 2, 0, 0, "NHD", (4, 4), 12, 5, False, False, "half", 2, False, 4),
])
def test_rounds_named_cases(case: Case) -> None:
    check_case(case)


TOKEN = 6  # bytes of one token's MLA row per layer


def dcp_layout(page: int, capacity: int, dcp_rank: int | None, *, fill: int | None
               ) -> tuple[kvplan.Layout, Memory]:
    item = page * TOKEN
    kv = capacity * item
    arena = np.zeros(2 * kv, np.uint8)
    if fill is not None:
        arena[:] = np.random.default_rng(fill).integers(0, 256, arena.size, dtype=np.uint8)
    base = int(arena.ctypes.data)
    if dcp_rank is None:
        layout = kvplan.Layout([base, base + kv], [kv, kv], [item, item], [0, 1],
                               ["kv", "kv"], page_size=page)
    else:
        layout = kvplan.Layout([base, base + kv], [kv, kv], [item, item], [0, 1],
                               ["kv", "kv"], page_size=page, dcp_size=4, dcp_rank=dcp_rank,
                               dcp_interleave=2)
    return layout, Memory.of(arena)


@pytest.mark.parametrize("n_tokens", [1, 9, 40])
@pytest.mark.parametrize(("page", "size"), [(4, 6), (16, 20), (1, 1), (4, 4096)])
def test_rounds_into_dcp_decode_ranks(n_tokens: int, page: int, size: int) -> None:
    """A prefill at DCP 1 into each of 4 DCP decode ranks (tokens dealt 2 at a time)."""
    src_layout, src_mem = dcp_layout(page, 48, None, fill=n_tokens)
    for rank in range(4):
        dst_layout, dst_mem = dcp_layout(4, 16, rank, fill=None)
        template = kvplan.Template(src_layout, dst_layout)
        sp, dp = np.arange(-(-n_tokens // page)), np.arange(16)[::-1].copy()
        local = sum(1 for t in range(n_tokens) if (t // 2) % 4 == rank)
        dp = dp[:max(1, -(-local // 4))]
        want = dst_mem.copy()
        apply_plan(template.plan(sp, dp, n_tokens=n_tokens), src_mem, want)
        arenas = np.zeros(2 * size, np.uint8), np.zeros(2 * size, np.uint8)
        rounds = template.plan_rounds(
            sp, dp, n_tokens=n_tokens,
            src_arena=(int(arenas[0].ctypes.data), arenas[0].size),
            dst_arena=(int(arenas[1].ctypes.data), arenas[1].size))
        got = dst_mem
        assert run_rounds(rounds, src_mem, got, arenas, by_copy_local=rank % 2 == 0) == (
            rounds.bytes)
        assert np.array_equal(got.data, want.data), (rank, rounds)


def _template() -> tuple[kvplan.Template, np.ndarray, np.ndarray]:
    model = Model(layers=2, kv_heads=8, head_dim=HEAD_DIM, dtype_size=2)
    src = rank_memory(model, Rank(5, 8, 4, "NHD", 6), seed=1)
    dst = rank_memory(model, Rank(1, 2, 4, "NHD", 6))
    return kvplan.Template(src.layout, dst.layout), np.arange(4), np.arange(4)[::-1].copy()


def test_rounds_as_a_sequence_and_their_manifests() -> None:
    template, sp, dp = _template()
    rounds = template.plan_rounds(sp, dp, src_arena=(1 << 40, 128), dst_arena=(1 << 44, 512))
    # 4 writers share the decode arena: 4 × 2 buffers of 64 bytes; this rank is writer 1.
    assert (rounds.buffers, rounds.buffer_bytes, rounds.sender) == (2, 64, (1, 4))
    assert rounds.dst_share == (128, 256)
    assert len(rounds) == 8 and rounds.bytes == 512 and rounds.n_network_blocks == 8
    assert [r.index for r in rounds] == list(range(8))
    assert rounds[-1].index == 7 and rounds[-1].manifest.is_last
    assert rounds.manifests == [r.manifest for r in rounds]
    with pytest.raises(IndexError, match="round index 8 is out of range for 8 rounds"):
        rounds[8]
    m = rounds[3].manifest
    assert (m.index, m.n_rounds, m.buffer, m.offset, m.bytes, m.total_bytes) == (
        3, 8, 1, 192, 64, 512)
    assert m.dst_bytes_range == (192, 256) and m.sender == (1, 4)
    wire = m.to_bytes()
    assert len(wire) == 64 and wire[:4] == b"KVRM"
    assert kvplan.RoundManifest.from_bytes(wire) == m
    assert "StagedRounds(8 rounds" in repr(rounds) and "StagedRound(index=0" in repr(rounds[0])
    assert "RoundManifest(index=3" in repr(m)
    # The executor's stage list: the staged plan's three stages, round after round.
    assert stages(rounds) == stages(template.plan_staged(
        sp, dp, src_staging=(1 << 40, BIG), dst_staging=(1 << 44, BIG)))
    assert rounds.stages == kvplan._core.plan_stages("rounds")
    assert [part for _, part in steps(rounds)][:3] == [rounds[0].gather, rounds[0].network,
                                                       rounds[0].scatter]
    assert len(steps(rounds)) == 3 * len(rounds)


def test_a_manifest_that_is_no_round_is_refused() -> None:
    template, sp, dp = _template()
    wire = bytearray(template.plan_rounds(sp, dp, src_arena=(1 << 40, 128),
                                          dst_arena=(1 << 44, 512))[0].manifest.to_bytes())
    with pytest.raises(kvplan.KvPlanError, match="a round manifest is 64 bytes, got 63"):
        kvplan.RoundManifest.from_bytes(bytes(wire[:63]))
    bad = bytearray(wire)
    bad[:4] = b"XXXX"
    with pytest.raises(kvplan.KvPlanError, match="KVRM"):
        kvplan.RoundManifest.from_bytes(bytes(bad))
    bad = bytearray(wire)
    bad[8:12] = (8).to_bytes(4, "little")
    with pytest.raises(kvplan.KvPlanError, match="round index 8 is not below the request's 8"):
        kvplan.RoundManifest.from_bytes(bytes(bad))


def test_bad_arenas_say_what_is_wrong() -> None:
    template, sp, dp = _template()

    def plan(src: tuple[int, int], dst: tuple[int, int], buffers: int = 2) -> object:
        return template.plan_rounds(sp, dp, src_arena=src, dst_arena=dst, buffers=buffers)

    with pytest.raises(kvplan.KvPlanError, match="at least one round buffer per arena, got "
                       "buffers=0"):
        plan((1 << 40, 128), (1 << 44, 512), 0)
    with pytest.raises(kvplan.KvPlanError, match="prefill arena's 127 bytes do not split into 2 "
                       "equal round buffers"):
        plan((1 << 40, 127), (1 << 44, 512))
    with pytest.raises(kvplan.KvPlanError, match=r"decode arena's 500 bytes do not split into 4 "
                       r"sender share\(s\) × 2 equal round buffers; give a size that is a "
                       "multiple of 8"):
        plan((1 << 40, 128), (1 << 44, 500))
    with pytest.raises(kvplan.SizeMismatchError, match="prefill round buffer"):
        plan((1 << 40, 0), (1 << 44, 512))
    with pytest.raises(kvplan.KvPlanError, match="overflow"):
        plan((2**64 - 8, 128), (1 << 44, 512))
    with pytest.raises(TypeError, match="src_arena must be a tuple"):
        template.plan_rounds(sp, dp, src_arena=128, dst_arena=(1 << 44, 512))  # type: ignore[call-overload]
    with pytest.raises(OverflowError):
        plan((1 << 40, 128), (1 << 44, 512), -1)
    with pytest.raises(kvplan.UnsupportedError) as e:
        template.plan_rounds(kvplan.Request(sp, dp, n_tokens=16, skip_tokens=4),
                             src_arena=(1 << 40, 128), dst_arena=(1 << 44, 512))
    assert (e.value.planner, e.value.feature) == ("plan_rounds", "delta")
    # State slots travel in rounds: a slot request is planned as its direct plan is (on this
    # template, whose state this prefill rank does not send, no bytes and no round).
    slot = kvplan.Request(slot=(0, 1))
    rounds = template.plan_rounds(slot, src_arena=(1 << 40, 128), dst_arena=(1 << 44, 512))
    assert rounds.bytes == template.plan(slot).total_bytes
    assert len(rounds) == -(-rounds.bytes // rounds.buffer_bytes)


def test_capabilities_declare_plan_rounds_as_plan_staged() -> None:
    from kvplan import capabilities

    for feature in capabilities.features():
        assert capabilities.supports("plan_rounds", feature) == capabilities.supports(
            "plan_staged", feature), feature


def test_rounds_reuse_pooled_memory() -> None:
    """Planning rounds again once the previous ones died takes every buffer from the pool: a
    steady state allocates no fresh output memory (the small stages go back at once)."""
    template, sp, dp = _template()

    def plan() -> kvplan.StagedRounds:
        return template.plan_rounds(sp, dp, src_arena=(1 << 40, 128), dst_arena=(1 << 44, 512))

    rounds = plan()
    assert [(r.gather.n_blocks, r.scatter.n_blocks) for r in rounds] == [(1, 8)] * 8
    del rounds
    gc.collect()
    plan()
    gc.collect()
    _, _, _, misses0 = kvplan._core.pool_stats()
    for _ in range(3):
        plan()
        gc.collect()
    assert kvplan._core.pool_stats()[3] == misses0, "steady state must not allocate"
