"""Pages handed over in descending order on both sides (offload and eviction order) are one run:
one block per entry for ``[7, 6, 5] -> [3, 2, 1]``, not three, with the same bytes copied.

A plan is a set of copies: each plan is checked as a byte map against one block per page, and
block for block against the reference planner (``support.reference.plan_blocks``).
"""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan import Layout, Template

from support import reference as ref
from support.robustness_checks import ref_layout

ITEM = 16
CAP = 64


def _mla(base: int, layers: int = 3) -> Layout:
    ptrs = [base + k * CAP * ITEM * 2 for k in range(layers)]
    return Layout.mla(ptrs, [CAP * ITEM] * layers, ITEM, list(range(layers)))


SRC, DST = _mla(1 << 20), _mla(1 << 30)


def _byte_map(src, dst, lengths) -> list[tuple[int, int]]:
    return sorted((int(s) + k, int(d) + k) for s, d, n in zip(src, dst, lengths)
                  for k in range(int(n)))


def _page_by_page(template: Template, sp, dp) -> list[tuple[int, int]]:
    rs, rd = ref_layout(SRC), ref_layout(DST)
    pairs = ref.template_pairs(rs, rd)
    blocks = ref.plan_blocks(rs, rd, pairs, [sp[0]], [dp[0]])  # shape check only
    assert blocks.n_blocks == 3
    out = []
    for i, j in pairs:
        for s, d in zip(sp, dp):
            out.append((rs.ptrs[i] + int(s) * ITEM, rd.ptrs[j] + int(d) * ITEM, ITEM))
    return _byte_map(*zip(*out))


def test_a_run_descending_on_both_sides_is_one_block_per_entry():
    template = Template(SRC, DST)
    plan = template.plan(np.array([7, 6, 5]), np.array([3, 2, 1]))
    assert plan.n_blocks == 3 and plan.n_runs == 1
    assert plan.lengths.tolist() == [3 * ITEM] * 3
    assert plan.src_addrs[0] == (1 << 20) + 5 * ITEM and plan.dst_addrs[0] == (1 << 30) + 1 * ITEM
    # SGLang's helper keeps SGLang's rule: three runs.
    assert kvplan.group_contiguous(np.array([7, 6, 5]), np.array([3, 2, 1]))[2].tolist() == [1, 1, 1]


@pytest.mark.parametrize("seed", range(20))
def test_mixed_directions_equal_the_reference_and_copy_the_same_bytes(seed):
    rng = np.random.default_rng(seed)
    sp, dp = [int(rng.integers(20, 40))], [int(rng.integers(20, 40))]
    for _ in range(int(rng.integers(1, 30))):
        step = int(rng.choice([1, -1, 1, -1, 5]))
        sp.append(sp[-1] + step)
        dp.append(dp[-1] + (step if rng.random() > 0.15 else -step))
    sp_a, dp_a = np.array(sp) % CAP, np.array(dp) % CAP
    template = Template(SRC, DST)
    plan = template.plan(sp_a, dp_a)
    rs, rd = ref_layout(SRC), ref_layout(DST)
    want = ref.plan_blocks(rs, rd, ref.template_pairs(rs, rd), sp_a, dp_a)
    assert plan.as_lists() == (want.src, want.dst, want.lengths)
    assert plan.n_runs == want.n_runs <= len(ref.group_runs(sp_a, dp_a))
    assert _byte_map(*plan.as_lists()) == _page_by_page(template, sp_a, dp_a)


def test_per_page_pieces_keep_the_request_order_in_a_descending_run():
    # Fragments (one block per page) cannot coalesce; their blocks follow the request's pages.
    template = Template(SRC, DST, fragments=[[(0, 0, 8)]] * 3)
    plan = template.plan(np.array([7, 6, 5]), np.array([3, 2, 1]))
    assert plan.n_blocks == 9
    assert [(a - (1 << 20)) // ITEM for a in plan.src_addrs[:3].tolist()] == [7, 6, 5]
    assert _byte_map(*plan.as_lists()) == _byte_map(
        *zip(*[((1 << 20) + k * CAP * ITEM * 2 + s * ITEM, (1 << 30) + k * CAP * ITEM * 2 + d * ITEM, 8)
               for k in range(3) for s, d in zip([7, 6, 5], [3, 2, 1])]))


def test_transfer_stats_report_bytes_per_block():
    from kvplan.engines import TransferStats

    assert TransferStats("s", blocks=3, bytes=3 * 48, batches=1, seconds=0.0).bytes_per_block == 48
    assert TransferStats("s", blocks=0, bytes=0, batches=0, seconds=0.0).bytes_per_block == 0.0
