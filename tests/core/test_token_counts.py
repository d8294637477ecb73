"""``Template.n_token_blocks`` counts a token request's blocks without allocating per token.

Checked against the plan of the same request over real model page lists (``0, 1, 2, …`` or,
fragmented, ``0, 2, 4, …``) for small token counts, over page-size ratios, memory orders and
decode-context-parallel deals, and answered exactly for 2**31 and 2**40 tokens (closed forms for
those templates), with the peak RSS of a fresh process that does only that staying small.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvplan import Layout, Template

TOKEN = 8


def _mla(page: int, capacity: int, base: int, dcp: tuple[int, int, int] = (1, 0, 1),
         layers: int = 2) -> Layout:
    size, rank, interleave = dcp
    item = page * TOKEN
    ptrs = [base + k * capacity * item * 2 for k in range(layers)]
    return Layout.mla(ptrs, [capacity * item] * layers, item, list(range(layers)), page_size=page,
                      dcp_size=size, dcp_rank=rank, dcp_interleave=interleave)


CASES = [
    ((16, (1, 0, 1)), (64, (1, 0, 1))),
    ((64, (1, 0, 1)), (16, (1, 0, 1))),
    ((6, (1, 0, 1)), (4, (1, 0, 1))),
    ((16, (1, 0, 1)), (16, (2, 1, 1))),
    ((16, (1, 0, 1)), (4, (4, 3, 2))),
    ((8, (2, 0, 8)), (16, (4, 1, 1))),
    ((1, (1, 0, 1)), (4, (8, 5, 4))),
]


@pytest.mark.parametrize(("src_side", "dst_side"), CASES)
@pytest.mark.parametrize("fragmented", [False, True])
def test_counts_equal_the_plan_over_model_pages(src_side, dst_side, fragmented):
    capacity = 2 * 2000 + 2
    src = _mla(src_side[0], capacity, 1 << 32, src_side[1])
    dst = _mla(dst_side[0], capacity, 1 << 44, dst_side[1])
    template = Template(src, dst)
    step = 2 if fragmented else 1
    pages = np.arange(2000, dtype=np.int64) * step
    for n in [0, 1, 5, 63, 64, 65, 200, 513, 1000, 1999]:
        want = template.plan(pages, pages, n_tokens=n).n_blocks
        assert template.n_token_blocks(n, fragmented=fragmented) == want, n


@pytest.mark.parametrize("n", [1 << 31, 1 << 40, (1 << 40) + 37])
def test_counts_of_huge_token_counts_are_exact_and_allocate_nothing_per_token(n):
    # Prefill pages of 16 tokens to decode pages of 64, MLA token-major, 2 layers: consecutive
    # pages are one block per layer; fragmented, a block per prefill page per layer (every 16
    # tokens a source edge breaks the block), the partial last page included.
    template = Template(_mla(16, 4, 1 << 32), _mla(64, 4, 1 << 44))
    assert template.n_token_blocks(n) == 2
    assert template.n_token_blocks(n, fragmented=True) == 2 * -(-n // 16)
    # Decode DCP 2 rank 1 from DCP 1, interleave 1: every token of the rank is its own block
    # (source rows strided), 2 layers.
    dealt = Template(_mla(16, 4, 1 << 32), _mla(16, 4, 1 << 44, (2, 1, 1)))
    assert dealt.n_token_blocks(n) == 2 * (n // 2)


def test_huge_token_counts_keep_a_fresh_process_small():
    # The pytest process's own peak RSS holds whatever earlier tests allocated, so the memory
    # claim is checked in a child that imports kvplan and counts the largest request only.
    child = textwrap.dedent("""
        import resource
        from kvplan import Layout, Template
    """) + f"TOKEN = {TOKEN}\n" + inspect.getsource(_mla) + textwrap.dedent("""
        template = Template(_mla(16, 4, 1 << 32), _mla(64, 4, 1 << 44))
        dealt = Template(_mla(16, 4, 1 << 32), _mla(16, 4, 1 << 44, (2, 1, 1)))
        n = (1 << 40) + 37
        assert template.n_token_blocks(n, fragmented=True) == 2 * -(-n // 16)
        assert dealt.n_token_blocks(n) == 2 * (n // 2)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True).stdout
    peak_mib = float(out.split()[-1])
    assert peak_mib < 1024, peak_mib
