"""The direct-or-staged advice: ``kvplan.TransferCost`` (validated), ``kvplan.advise`` (the
core's model over counts)."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import kvplan

FIELDS = ("per_block_s", "network_bytes_per_s", "copy_bytes_per_s")


def cost(per_block_s: float = 30e-6, network: float = 2e9, copy: float = 10e9
         ) -> kvplan.TransferCost:
    return kvplan.TransferCost(per_block_s=per_block_s, network_bytes_per_s=network,
                               copy_bytes_per_s=copy)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("bad", [0.0, -1e-6, math.nan, math.inf, -math.inf])
def test_cost_values_must_be_finite_and_positive(field: str, bad: float) -> None:
    values = {"per_block_s": 1e-6, "network_bytes_per_s": 1e9, "copy_bytes_per_s": 1e10}
    values[field] = bad
    with pytest.raises(kvplan.KvPlanError, match=f"transfer cost {field} must be a finite "
                                                  f"number greater than 0, got ") as err:
        kvplan.TransferCost(**values)
    assert err.value.kind == "cost"
    got = str(err.value).rsplit("got ", 1)[1]
    assert float(got) == bad or (math.isnan(bad) and got == "NaN")


def test_cost_is_keyword_only_and_reads_back() -> None:
    with pytest.raises(TypeError):
        kvplan.TransferCost(1e-6, 1e9, 1e10)  # type: ignore[misc]
    c = cost(1e-6, 1e9, 1e10)
    assert (c.per_block_s, c.network_bytes_per_s, c.copy_bytes_per_s) == (1e-6, 1e9, 1e10)
    assert c == cost(1e-6, 1e9, 1e10) and c != cost(2e-6, 1e9, 1e10)
    assert "per_block_s=1e-6" in repr(c)


def test_cost_pickles() -> None:
    c = cost(3.5e-5, 1.9e9, 8.25e9)
    again = pickle.loads(pickle.dumps(c))
    assert isinstance(again, kvplan.TransferCost) and again == c


def test_advise_follows_the_model() -> None:
    c = cost(30e-6, 2e9, 10e9)
    a = kvplan.advise(10_000, 4, 4_000_000, 4_000_000, 4_000_000, c)
    network = 4e6 / 2e9
    assert a.direct_s == pytest.approx(10_000 * 30e-6 + network, rel=1e-12)
    assert a.staged_s == pytest.approx(2 * 4e6 / 10e9 + 4 * 30e-6 + network, rel=1e-12)
    assert a.choice == "staged"
    assert (a.direct_blocks, a.staged_blocks, a.bytes, a.copy_bytes) == (
        10_000, 4, 4_000_000, 8_000_000)
    assert "choice='staged'" in repr(a)


def test_advise_flips_where_saved_blocks_pay_for_the_copies() -> None:
    # 2 MB of copies at 1 GB/s cost 2 ms = 2,000 blocks at 1 µs: direct up to break-even.
    c = cost(1e-6, 1e9, 1e9)
    assert kvplan.advise(2_000, 1, 10**6, 10**6, 10**6, c).choice == "direct"
    assert kvplan.advise(2_002, 1, 10**6, 10**6, 10**6, c).choice == "staged"
    # Same blocks either way: staging only adds copies.
    assert kvplan.advise(8, 8, 10**6, 10**6, 10**6, c).choice == "direct"


def test_a_tie_goes_to_direct() -> None:
    # Powers of two make both sums exact: 3 x 0.25 s == 0.25 + 0.25 + 0.25.
    a = kvplan.advise(3, 1, 0, 1, 1, cost(0.25, 1.0, 4.0))
    assert a.direct_s == a.staged_s and a.choice == "direct"


# ---------------------------------------------------------------------------------------------
# Template.transfer_advice: the rule over a request's own counts
# ---------------------------------------------------------------------------------------------

HEADS, HEAD_DIM, DTYPE, PAGE, LAYERS, CAP = 8, 64, 2, 4, 3, 32


def mha(base: int, tp: int, rank: int, order: str = "NHD") -> kvplan.Layout:
    item = PAGE * max(1, HEADS // tp) * HEAD_DIM * DTYPE
    ptrs = [base + e * item * CAP for e in range(2 * LAYERS)]
    return kvplan.Layout.mha(ptrs[:LAYERS], ptrs[LAYERS:], [item * CAP] * LAYERS,
                             [item * CAP] * LAYERS, item, item, layer_ids=list(range(LAYERS)),
                             page_size=PAGE, tp_rank=rank, tp_size=tp, kv_heads=HEADS,
                             head_dim=HEAD_DIM, dtype_size=DTYPE, memory_order=order)


def staged_counts(template: kvplan.Template, src: np.ndarray, dst: np.ndarray
                  ) -> tuple[int, int, int, int]:
    """(direct blocks, staged network blocks, bytes, copy bytes) from real plans."""
    direct = template.plan(src, dst)
    staged = template.plan_staged(src, dst, src_staging=(1 << 44, 1 << 30),
                                  dst_staging=(1 << 45, 1 << 30))
    return (direct.n_blocks, staged.network.n_blocks, direct.total_bytes,
            staged.gather.total_bytes + staged.scatter.total_bytes)


@pytest.mark.parametrize(("tp_p", "r_p", "tp_d"), [(8, 3, 2), (2, 1, 2), (1, 0, 4), (4, 2, 1)])
def test_transfer_advice_counts_are_the_plans_counts(tp_p: int, r_p: int, tp_d: int) -> None:
    template = kvplan.Template(mha(1 << 32, tp_p, r_p), mha(1 << 36, tp_d, 0))
    src = np.array([5, 6, 7, 1, 20, 21], np.int64)
    dst = np.array([0, 2, 4, 9, 10, 30], np.int64)
    direct_blocks, network_blocks, nbytes, copy_bytes = staged_counts(template, src, dst)
    a = template.transfer_advice(src, dst, cost())
    assert (a.direct_blocks, a.staged_blocks, a.bytes, a.copy_bytes) == (
        direct_blocks, network_blocks, nbytes, copy_bytes)
    same = kvplan.advise(direct_blocks, network_blocks, nbytes, copy_bytes // 2,
                         copy_bytes // 2, cost())
    assert (a.choice, a.direct_s, a.staged_s) == (same.choice, same.direct_s, same.staged_s)


def test_transfer_advice_follows_the_cost() -> None:
    # TP 8 -> 2 on NHD pages: one direct block per token per entry, a few staged ones.
    template = kvplan.Template(mha(1 << 32, 8, 0), mha(1 << 36, 2, 0))
    src, dst = np.arange(8, dtype=np.int64), np.arange(0, 16, 2, dtype=np.int64)
    tcp = template.transfer_advice(src, dst, cost(30e-6, 2e9, 10e9))
    assert tcp.direct_blocks == 8 * PAGE * 2 * LAYERS and tcp.staged_blocks < 4
    assert tcp.choice == "staged"
    # Blocks almost free, copies slow: direct.
    assert template.transfer_advice(src, dst, cost(1e-12, 2e9, 1e6)).choice == "direct"
    # One buffer, contiguous pages: one block either way, so staging only adds copies.
    one = kvplan.Template(kvplan.Layout([1 << 32], [4096 * CAP], 4096, [0]),
                          kvplan.Layout([1 << 36], [4096 * CAP], 4096, [0]))
    pages = np.arange(8, dtype=np.int64)
    a = one.transfer_advice(pages, pages, cost(30e-6, 2e9, 10e9))
    assert (a.choice, a.direct_blocks, a.staged_blocks) == ("direct", 1, 1)
    assert a.staged_s > a.direct_s


def test_transfer_advice_validates_the_request_as_plan_does() -> None:
    template = kvplan.Template(mha(1 << 32, 8, 0), mha(1 << 36, 2, 0))
    bad = np.array([0, CAP], np.int64)
    ok = np.array([0, 1], np.int64)
    with pytest.raises(kvplan.IndexBoundsError) as planned:
        template.plan(ok, bad)
    with pytest.raises(kvplan.IndexBoundsError) as advised:
        template.transfer_advice(ok, bad, cost())
    assert str(advised.value) == str(planned.value)
    with pytest.raises(TypeError):
        template.transfer_advice(ok, ok, "fast")  # type: ignore[arg-type]


def test_transfer_advice_token_requests() -> None:
    # Different page sizes plan by token; n_tokens cuts the request.
    src_l, dst_l = mha(1 << 32, 1, 0), mha(1 << 36, 1, 0)
    template = kvplan.Template(src_l, dst_l)
    pages = np.arange(4, dtype=np.int64)
    a = template.transfer_advice(pages, pages, cost(), n_tokens=10)
    assert a.bytes == template.plan(pages, pages, n_tokens=10).total_bytes
