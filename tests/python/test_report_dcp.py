"""kvplan.compare between decode-context-parallel layouts: the deal of each side in words, and
the blocks this rank pair costs.

The deal wording is checked by evaluating it: the rule the report states must select exactly the
tokens the layout definition gives the rank (rank ``(t // I) % N``, local token
``(t // (I·N))·I + t % I``), and every block count must equal the blocks of a real plan.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvplan
from kvplan import Layout, Template

ROW = 64  # bytes per token per layer
LAYERS = [0, 1, 2]
CAP = 64


def mla(page: int, base: int, **dcp: int) -> Layout:
    item = page * ROW
    return Layout.mla([base + k * (1 << 24) for k in range(len(LAYERS))], [CAP * item] * len(LAYERS),
                      item, LAYERS, page_size=page, **dcp)


def owner(t: int, n: int, i: int) -> int:
    return (t // i) % n


def local(t: int, n: int, i: int) -> int:
    return (t // (i * n)) * i + t % i


def stated_rule(text: str) -> tuple[str, str]:
    """The (ownership condition, local token expression) a report line states, as Python."""
    m = re.search(r"holds tokens t with (.+?), at local token (.+)$", text)
    assert m, text
    return m.group(1), m.group(2).replace("·", "*")


@pytest.mark.parametrize(("n", "i", "page"), [(2, 1, 4), (4, 1, 1), (2, 4, 4), (4, 2, 4),
                                              (8, 8, 4)])
def test_the_stated_deal_selects_exactly_the_ranks_tokens(n: int, i: int, page: int) -> None:
    src = mla(page, 1 << 32)
    for r in range(n):
        dst = mla(page, 1 << 40, dcp_size=n, dcp_rank=r, dcp_interleave=i)
        report = kvplan.compare(src, dst, request_pages=4)
        assert report.compatible
        line = next(x for x in report.dcp if x.startswith("decode "))
        assert f"DCP rank {r} of {n} (interleave {i})" in line
        cond, where = stated_rule(line)
        held = [t for t in range(200) if eval(cond, {"t": t})]  # noqa: S307 - our own text
        assert held == [t for t in range(200) if owner(t, n, i) == r]
        assert [eval(where, {"t": t}) for t in held] == [local(t, n, i) for t in held]  # noqa: S307
        assert report.dcp[0] == "prefill not dealt: holds every token of the request"
        assert "decode context parallel:" in str(report)
        assert f"DCP rank {r} of {n}" in report.decode


def blocks_line(report: kvplan.CompatReport) -> tuple[int, int, int]:
    m = re.search(r"(\d+) global tokens.*: (\d+) blocks with pages consecutive on both sides, "
                  r"(\d+) blocks with no two pages consecutive", report.blocks[0])
    assert m, report.blocks
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.mark.parametrize(("n", "i", "ps", "pd"), [(2, 1, 4, 4), (2, 4, 4, 4), (4, 2, 2, 4),
                                                  (2, 8, 4, 8)])
def test_the_pair_blocks_are_the_blocks_of_its_plan(n: int, i: int, ps: int, pd: int) -> None:
    pages = 8
    tokens = pages * ps
    src = mla(ps, 1 << 32)
    for r in range(n):
        dst = mla(pd, 1 << 40, dcp_size=n, dcp_rank=r, dcp_interleave=i)
        report = kvplan.compare(src, dst, request_pages=pages)
        got_tokens, contiguous, scattered = blocks_line(report)
        assert got_tokens == tokens
        template = Template(src, dst)
        src_pages = np.arange(pages, dtype=np.int64)
        dst_pages = np.arange(-(-tokens // pd), dtype=np.int64)
        assert contiguous == template.plan(src_pages, dst_pages, n_tokens=tokens).n_blocks
        # No two pages consecutive on either side: every other page.
        plan = template.plan(src_pages * 2, dst_pages * 2, n_tokens=tokens)
        assert scattered == plan.n_blocks
        held = sum(1 for t in range(tokens) if owner(t, n, i) == r)
        assert plan.total_bytes == held * ROW * len(LAYERS)


def test_whole_page_deals_cost_one_block_per_deal_and_layer() -> None:
    # 32 tokens in pages of 4, dealt a page at a time over 2 ranks: rank 1 holds tokens 4-7,
    # 12-15, 20-23, 28-31, four deals that are not adjacent in the prefill's consecutive pages.
    report = kvplan.compare(mla(4, 1 << 32), mla(4, 1 << 40, dcp_size=2, dcp_rank=1,
                                                  dcp_interleave=4), request_pages=8)
    assert blocks_line(report) == (32, 4 * len(LAYERS), 4 * len(LAYERS))


def test_a_rank_pair_sharing_no_token_costs_nothing_and_says_why() -> None:
    src = mla(4, 1 << 32, dcp_size=2, dcp_rank=0)
    dst = mla(4, 1 << 40, dcp_size=2, dcp_rank=1)
    report = kvplan.compare(src, dst, request_pages=8)
    assert report.compatible
    assert report.blocks[0].startswith("32 tokens: 0 blocks (")
    assert "hold no token in common" in report.blocks[0]
    assert report.dcp[0].startswith("prefill DCP rank 0 of 2 (interleave 1): holds tokens t with "
                                    "t % 2 == 0")


def test_layouts_that_do_not_deal_get_no_dcp_lines() -> None:
    report = kvplan.compare(mla(4, 1 << 32), mla(4, 1 << 40), request_pages=8)
    assert report.dcp == ()
    assert "decode context parallel" not in str(report)
    assert "DCP" not in report.decode


def packed_line(report: kvplan.CompatReport) -> tuple[int, int, int, int]:
    """(network, gather) with pages consecutive, then with no two pages consecutive."""
    m = re.search(r"packed \(Template.plan_packed\): (\d+) network blocks after (\d+) gather "
                  r"blocks into the pack buffer with pages consecutive on both sides, (\d+) "
                  r"network blocks after (\d+) gather blocks with no two pages consecutive",
                  report.blocks[1])
    assert m, report.blocks
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))


def runs_of(ts: list[int]) -> int:
    return sum(1 for k, t in enumerate(ts) if k == 0 or ts[k - 1] != t - 1)


@pytest.mark.parametrize(("n", "i", "ps", "pd"), [(2, 1, 4, 4), (4, 1, 4, 4), (2, 4, 4, 4),
                                                  (4, 2, 2, 4), (2, 8, 4, 8)])
def test_the_packed_cost_is_the_cost_of_plan_packed(n: int, i: int, ps: int, pd: int) -> None:
    """Network and gather blocks through a pack buffer: what plan_packed plans on the same page
    lists, and what the layout definition gives (one network block per layer and destination
    page run; one gather block per layer and run of the rank's tokens adjacent in the source)."""
    pages = 8
    tokens = pages * ps
    src = mla(ps, 1 << 32)
    for r in range(n):
        dst = mla(pd, 1 << 40, dcp_size=n, dcp_rank=r, dcp_interleave=i)
        report = kvplan.compare(src, dst, request_pages=pages)
        network, gather, network_s, gather_s = packed_line(report)
        template = Template(src, dst)
        held = [t for t in range(tokens) if owner(t, n, i) == r]
        dst_count = -(-len(held) // pd)
        src_pages = np.arange(pages, dtype=np.int64)
        dst_pages = np.arange(dst_count, dtype=np.int64)
        for scale, (net, gat) in ((1, (network, gather)), (2, (network_s, gather_s))):
            direct = template.plan(src_pages * scale, dst_pages * scale, n_tokens=tokens)
            g, w = template.plan_packed(src_pages * scale, dst_pages * scale, n_tokens=tokens,
                                        pack=(1 << 48, direct.total_bytes))
            assert (net, gat) == (w.n_blocks, g.n_blocks)
        layers = len(LAYERS)
        assert network == layers  # the rank's tokens fill consecutive decode pages in order
        assert network_s == layers * dst_count  # every decode page its own run
        assert gather == layers * runs_of(held)
        # with no two source pages consecutive, a run also ends at every source page edge
        cut = [t for t in held if t % ps == 0 or t - 1 not in held]
        assert gather_s == layers * len(cut)
