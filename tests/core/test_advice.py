"""The direct-or-staged advice: ``kvplan.TransferCost`` (validated), ``kvplan.advise`` (the
core's model over counts)."""

from __future__ import annotations

import math
import pickle

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
