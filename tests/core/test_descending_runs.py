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


def _ascending_runs(src, dst, k=1) -> int:
    """Runs under the ascending rule with each index expanded into ``k`` consecutive ones."""
    if len(src) == 0:
        return 0
    s = (np.asarray(src, np.int64)[:, None] * k + np.arange(k)).reshape(-1)
    d = (np.asarray(dst, np.int64)[:, None] * k + np.arange(k)).reshape(-1)
    return 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))


def _vllm_034_order(src, dst):
    """vLLM 0.34's reordering, transcribed: each stretch of steps -1 on both sides, with the
    position before it, reversed in place."""
    s, d = list(src), list(dst)
    if len(s) < 2:
        return s, d
    down = (np.diff(np.asarray(src, np.int64)) == -1) & (np.diff(np.asarray(dst, np.int64)) == -1)
    for a, b in np.flatnonzero(np.diff(down, prepend=False, append=False)).reshape(-1, 2):
        s[a:b + 1], d[a:b + 1] = s[a:b + 1][::-1], d[a:b + 1][::-1]
    return s, d


def test_reverse_descending_runs_reads_descending_stretches_ascending():
    from kvplan._core import reverse_descending_runs

    s, d = reverse_descending_runs(np.array([3, 2, 1, 4, 5]), np.array([13, 12, 11, 14, 15]))
    assert (s.tolist(), d.tolist()) == ([1, 2, 3, 4, 5], [11, 12, 13, 14, 15])
    assert s.dtype == d.dtype == np.int64
    s, d = reverse_descending_runs(np.array([1, 0], np.int32), np.array([3, 2], np.int32))
    assert (s.tolist(), d.tolist(), s.dtype) == ([0, 1], [2, 3], np.int64)
    assert (_ascending_runs([1, 0], [3, 2], 4), _ascending_runs(s, d, 4)) == (2, 1)
    # nothing descends on both sides, or reordering would break more runs than it joins
    assert reverse_descending_runs(np.array([5, 4, 3]), np.array([1, 2, 3])) is None
    assert reverse_descending_runs(np.array([0, 1, 2]), np.array([4, 5, 6])) is None
    assert reverse_descending_runs(np.array([1, 2, 1, 2]), np.array([1, 2, 1, 2])) is None
    assert reverse_descending_runs(np.array([7]), np.array([7])) is None
    with pytest.raises(kvplan.KvPlanError, match="src has 2 indices but dst has 1"):
        reverse_descending_runs(np.array([1, 2]), np.array([1]))
    with pytest.raises(TypeError, match="int32 or int64"):
        reverse_descending_runs(np.array([1.0, 2.0]), np.array([1.0, 2.0]))


@pytest.mark.parametrize("seed", range(4))
def test_reordered_requests_are_never_more_runs_than_either_order(seed):
    """Expanded by 1, 2 or 4, a reordered request is never more ascending runs than the request
    as it is or as vLLM 0.34 reorders it, and it holds the same pairs."""
    from kvplan._core import reverse_descending_runs

    rng = np.random.default_rng(seed)
    for _ in range(400):
        n, span = int(rng.integers(1, 30)), int(rng.choice([6, 80]))
        steps = rng.choice([1, -1, -1, 1, 4, -3], size=n - 1)
        flips = np.where(rng.random(n - 1) < 0.1, -1, 1)
        src = (int(rng.integers(span)) + np.concatenate(([0], np.cumsum(steps)))) % span
        dst = (int(rng.integers(span)) + np.concatenate(([0], np.cumsum(steps * flips)))) % span
        got = reverse_descending_runs(src, dst)
        s, d = (src, dst) if got is None else got
        assert sorted(zip(s.tolist(), d.tolist())) == sorted(zip(src.tolist(), dst.tolist()))
        vs, vd = _vllm_034_order(src.tolist(), dst.tolist())
        for k in (1, 2, 4):
            assert _ascending_runs(s, d, k) <= min(_ascending_runs(src, dst, k),
                                                   _ascending_runs(vs, vd, k)), (src, dst)
