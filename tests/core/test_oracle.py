"""kvplan's plans against the byte oracle published in kvplan.testing: every prefill rank of
a drawn deployment plans one request into one decode rank, the blocks are applied as memmoves
and the decode memory must equal the oracle's token-by-token, head-by-head copy, with no byte
written twice (TP sizes, page sizes, memory orders, cross-layer pools, replicated and sharded
state, partial last pages, caller-given fragments, staged plans). DCP deals are checked against
the oracle in test_dcp_plans.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings

import kvplan
from kvplan.testing.oracle import Memory, apply_plan, apply_staged, reference_copy, sent_heads
from kvplan.testing.ranks import Model, Rank, check_request, rank_memory
from kvplan.testing.strategies import Request, requests


@settings(max_examples=300)
@given(requests())
def test_plans_move_what_the_oracle_moves(case: Request) -> None:
    check_request(case.model, case.prefill, case.decode, case.src_pages, case.dst_pages,
                  n_tokens=case.n_tokens)


@settings(max_examples=100)
@given(requests(cross_layer=True))
def test_cross_layer_pools_move_what_the_oracle_moves(case: Request) -> None:
    check_request(case.model, case.prefill, case.decode, case.src_pages, case.dst_pages,
                  n_tokens=case.n_tokens)


def test_election_gives_every_decode_head_one_sender() -> None:
    for heads in (1, 2, 8):
        for tp_p in (1, 2, 4, 8):
            for tp_d in (1, 2, 4, 8):
                if heads % tp_p and tp_p % heads or heads % tp_d and tp_d % heads:
                    continue
                for r_d in range(tp_d):
                    got = sorted(h for r_p in range(tp_p)
                                 for h in sent_heads(heads, (r_p, tp_p), (r_d, tp_d)))
                    d = range(r_d * heads // tp_d, max(r_d * heads // tp_d + 1,
                                                       (r_d + 1) * heads // tp_d))
                    assert got == list(d), (heads, tp_p, tp_d, r_d)


def test_the_oracle_notices_a_wrong_byte() -> None:
    """Negative control: one flipped byte of a source head that moves breaks the comparison."""
    model = Model(layers=1, kv_heads=2, head_dim=2, dtype_size=1, state_bytes=16)
    src = rank_memory(model, Rank(0, 1, 2, "NHD", 4), seed=3)
    dst = rank_memory(model, Rank(1, 2, 2, "HND", 4))
    pages = np.array([2, 0]), np.array([1, 3])
    want = dst.memory.copy()
    n = reference_copy(src.layout, src.memory, dst.layout, want, *pages, src_slot=0, dst_slot=1)
    # Decode rank 1 of 2 holds head 1: K and V, 2 pages x 2 tokens x 2 bytes; 8 state bytes.
    assert n == 2 * 2 * 2 * 2 + 8
    again = dst.memory.copy()
    src.memory.data[:] ^= 0  # unchanged source: same answer
    reference_copy(src.layout, src.memory, dst.layout, again, *pages, src_slot=0, dst_slot=1)
    assert (again.data == want.data).all()
    k = src.layout.entries("page")[0]
    # token 1 (slot 1 of source page 2), head 1, byte 0 (NHD: [slot][head][byte])
    Memory.at(src.memory, k.data_ptr + 2 * k.stride + (1 * 2 + 1) * 2, 1)[:] ^= 0xFF
    third = dst.memory.copy()
    reference_copy(src.layout, src.memory, dst.layout, third, *pages, src_slot=0, dst_slot=1)
    assert int((third.data != want.data).sum()) == 1


def test_oracle_and_ranks_import_without_hypothesis() -> None:
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import kvplan.testing, kvplan.testing.oracle, kvplan.testing.ranks\n"
            "try:\n    import kvplan.testing.strategies\nexcept ImportError as e:\n"
            "    print('needs hypothesis' if 'hypothesis' in str(e) else e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "needs hypothesis"


@pytest.mark.parametrize("cross_layer", [False, True])
def test_check_request_fails_on_a_wrong_plan(cross_layer: bool, monkeypatch) -> None:
    """Negative control for check_request: a plan that writes one block to the wrong page."""
    import kvplan

    real = kvplan.Template.plan

    def shifted(self, src_pages, dst_pages, **kw):  # type: ignore[no-untyped-def]
        return real(self, src_pages, np.roll(np.asarray(dst_pages), 1), **kw)

    monkeypatch.setattr(kvplan.Template, "plan", shifted)
    with pytest.raises(AssertionError, match="wrong decode bytes"):
        check_request(Model(), Rank(0, 1, 2, cross_layer=cross_layer),
                      Rank(0, 1, 2, cross_layer=cross_layer), np.array([0, 1]),
                      np.array([3, 5]), slots=None)


FRAGMENT_MODEL = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2)  # 16-byte NHD tokens


def _fragment_request(prefill: Rank, decode: Rank, fragments: object,
                      n_tokens: int | None = None) -> int:
    """Plans ``[1, 3] -> [0, 5]`` with ``fragments``, applies it and compares with the oracle
    given the same fragments; returns the bytes moved."""
    src = rank_memory(FRAGMENT_MODEL, prefill, seed=1)
    dst = rank_memory(FRAGMENT_MODEL, decode)
    plan = kvplan.Template(src.layout, dst.layout, fragments=fragments).plan(
        np.array([1, 3]), np.array([0, 5]), n_tokens=n_tokens)
    want = dst.memory.copy()
    moved = reference_copy(src.layout, src.memory, dst.layout, want, [1, 3], [0, 5],
                           n_tokens=n_tokens, fragments=fragments)  # type: ignore[arg-type]
    apply_plan(plan, src.memory, dst.memory, np.zeros(dst.memory.data.size, bool))
    assert plan.total_bytes == moved
    bad = np.flatnonzero(dst.memory.data != want.data)
    assert bad.size == 0, f"{bad.size} wrong decode bytes, the first at offset {bad[0]}"
    return moved


NHD4, HND4 = Rank(0, 1, 4, "NHD", 6), Rank(0, 1, 4, "HND", 6)


@pytest.mark.parametrize(("prefill", "decode", "fragments", "n_tokens", "moved"), [
    # A page plan: fragments may move bytes between token slots (2 pages x 4 entries x 24 B).
    (NHD4, NHD4, [(0, 32, 16), (40, 0, 8)], None, 2 * 4 * 24),
    # Per pair: None keeps the whole 64-byte item.
    (NHD4, NHD4, [None, [(0, 0, 8)], [(8, 8, 56)], None], None, 2 * (64 + 8 + 56 + 64)),
    # A token plan (6 tokens, a partial last page): head 1 of every token.
    (NHD4, NHD4, [(16 * s + 8, 16 * s + 8, 8) for s in range(4)], 6, 6 * 4 * 8),
    # Token-major to head-major at one page size: the same bytes at the other order's offsets.
    (NHD4, HND4, [(16 * s + 8, (4 + s) * 8, 8) for s in range(4)], 6, 6 * 4 * 8),
    # Head slicing (TP 1 -> decode rank 1 of 2): fragments agreeing with it on head 1.
    (HND4, Rank(1, 2, 4, "HND", 6), [(32, 0, 32)], None, 2 * 4 * 32),
    (NHD4, Rank(1, 2, 4, "NHD", 6), [(16 * s + 8, 8 * s, 8) for s in range(4)], None,
     2 * 4 * 32),
])
def test_fragments_move_what_the_oracle_moves(prefill: Rank, decode: Rank, fragments: object,
                                              n_tokens: int | None, moved: int) -> None:
    assert _fragment_request(prefill, decode, fragments, n_tokens) == moved


def test_the_oracle_honours_fragments() -> None:
    """Negative control: the same request without the fragments writes other bytes."""
    src = rank_memory(FRAGMENT_MODEL, NHD4, seed=1)
    dst = rank_memory(FRAGMENT_MODEL, NHD4)
    with_fragments, whole = dst.memory.copy(), dst.memory.copy()
    reference_copy(src.layout, src.memory, dst.layout, with_fragments, [1], [0],
                   fragments=[(0, 32, 16)])
    reference_copy(src.layout, src.memory, dst.layout, whole, [1], [0])
    k = dst.layout.entries("page")[0]
    got = with_fragments.at(k.data_ptr, 64)
    assert (got[32:48] == src.memory.at(src.layout.entries("page")[0].data_ptr + k.stride, 16)).all()
    assert (got[:32] == dst.memory.at(k.data_ptr, 32)).all()  # not covered: untouched
    assert int((with_fragments.data != whole.data).sum()) > 0


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("tp_p", "tp_d", "page_sizes"), [(2, 1, (4, 4)), (1, 2, (4, 2)),
                                                         (4, 2, (2, 4))])
def test_staged_plans_write_what_the_oracle_writes(order: str, tp_p: int, tp_d: int,
                                                   page_sizes: tuple[int, int]) -> None:
    """Every writer's gather, network and scatter (apply_staged) into one decode region: the
    decode memory is the oracle's for the direct transfer."""
    model = Model(layers=2, kv_heads=4, head_dim=4, dtype_size=2)
    ps, pd = page_sizes
    n_tokens = 11
    src_pages = np.array([4, 0, 2, 5, 1, 3][:-(-n_tokens // ps)])
    dst_pages = np.array([5, 1, 3, 0, 2, 4][:-(-n_tokens // pd)])
    for r_d in range(tp_d):
        dst = rank_memory(model, Rank(r_d, tp_d, pd, order, 6))
        want = dst.memory.copy()
        written = np.zeros(dst.memory.data.size, bool)
        decode_staging = Memory.of(np.zeros(1 << 16, np.uint8))
        for r_p in range(tp_p):
            src = rank_memory(model, Rank(r_p, tp_p, ps, order, 6), seed=r_p + 1)
            prefill_staging = Memory.of(np.zeros(1 << 16, np.uint8))
            staged = kvplan.Template(src.layout, dst.layout).plan_staged(
                src_pages, dst_pages, n_tokens=n_tokens,
                src_staging=(prefill_staging.base, prefill_staging.data.size),
                dst_staging=(decode_staging.base, decode_staging.data.size))
            apply_staged(staged, src.memory, prefill_staging, decode_staging, dst.memory,
                         written)
            reference_copy(src.layout, src.memory, dst.layout, want, src_pages, dst_pages,
                           n_tokens=n_tokens)
        bad = np.flatnonzero(dst.memory.data != want.data)
        assert bad.size == 0, f"rank {r_d}: {bad.size} wrong bytes, the first at {bad[0]}"
        assert written.sum() == n_tokens * 2 * 2 * (4 // tp_d) * 8  # K, V; 2 layers; its heads
