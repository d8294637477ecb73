"""kvplan's plans against the byte oracle published in kvplan.testing: every prefill rank of
a drawn deployment plans one request into one decode rank, the blocks are applied as memmoves
and the decode memory must equal the oracle's token-by-token, head-by-head copy, with no byte
written twice (TP sizes, page sizes, memory orders, cross-layer pools, replicated and sharded
state, partial last pages)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings

from kvplan.testing.oracle import Memory, reference_copy, sent_heads
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
