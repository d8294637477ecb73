"""kvplan explain --decode-dcp N: which tokens each decode DCP rank holds, and the blocks each
rank's plan costs.

Expected numbers come from the layout definition (rank ``(t // I) % N`` holds token ``t``) and
the preset's bytes per token per layer, not from running kvplan: a token that is not adjacent,
in the prefill's pages, to the previous token the rank holds starts a new block in every layer.
"""

from __future__ import annotations

import re

from kvplan import cli
from kvplan.presets import get_preset


def run_cli(capsys, *argv):
    rc = cli.main(["explain", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


NUM = r"\s+([\d,]+)"


def table_rows(out: str) -> dict[int, list[int]]:
    """``rank -> [blocks, scattered, packed, packed scattered, gather, state, bytes]`` of the
    per-stage table (one stage)."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"rank (\d+)\s+\S+" + NUM * 7 + "$", line)
        if m:
            rows[int(m.group(1))] = [int(g.replace(",", "")) for g in m.groups()[1:]]
    return rows


def rank_rows(out: str) -> dict[int, list[int]]:
    """``rank -> [blocks, scattered, state, bytes]`` of the per-stage table (one stage)."""
    return {r: [v[0], v[1], v[5], v[6]] for r, v in table_rows(out).items()}


def held(tokens: int, n: int, i: int, r: int) -> list[int]:
    return [t for t in range(tokens) if (t // i) % n == r]


def runs(ts: list[int]) -> int:
    """Maximal runs of consecutive tokens: with pages consecutive on both sides, one block per
    run and layer."""
    return sum(1 for k, t in enumerate(ts) if k == 0 or ts[k - 1] != t - 1)


def test_token_round_robin_says_which_tokens_and_costs_a_block_per_token(capsys):
    ds = get_preset("deepseek-v3")
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "8", "--page-size", "4",
                           "--decode-dcp", "2")
    assert rc == 0, err
    assert "request: 32 global tokens (8 prefill pages, page_size 4), dealt over decode DCP 2 " \
           "(interleave 1)" in out
    assert "rank 0: DCP rank 0 of 2 (interleave 1): holds tokens t with t % 2 == 0" in out
    assert "rank 1: DCP rank 1 of 2 (interleave 1): holds tokens t with t % 2 == 1" in out
    rows = rank_rows(out)
    assert sorted(rows) == [0, 1]
    for r, (blocks, scattered, state, nbytes) in rows.items():
        ts = held(32, 2, 1, r)
        assert blocks == scattered == runs(ts) * ds.num_layers == 16 * 61
        assert state == 0
        assert nbytes == len(ts) * ds.kv_bytes_per_token * ds.num_layers


def test_page_interleave_costs_one_block_per_deal_and_layer(capsys):
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "16", "--page-size",
                           "4", "--decode-dcp", "4", "--dcp-interleave", "4")
    assert rc == 0, err
    assert "holds tokens t with (t // 4) % 4 == 3, at local token (t // 16)·4 + t % 4" in out
    rows = rank_rows(out)
    assert sorted(rows) == [0, 1, 2, 3]
    for r, (blocks, scattered, _, nbytes) in rows.items():
        ts = held(64, 4, 4, r)
        assert blocks == scattered == runs(ts) * 61 == 4 * 61
        assert nbytes == len(ts) * 1152 * 61
    assert "rank 3: 244 blocks (244 scattered)" in out


def test_hybrid_state_goes_whole_to_every_rank(capsys):
    km = get_preset("kimi-linear")
    rc, out, err = run_cli(capsys, "--preset", "kimi-linear", "--pages", "8", "--decode-dcp",
                           "4", "--dcp-interleave", "2")
    assert rc == 0, err
    rows = rank_rows(out)
    kv = len(km.kv_layers())
    state_slots = sum(1 for _ in km.state) * len(km.linear_layers())
    state_bytes = sum(s.bytes_per_slot for s in km.state) * len(km.linear_layers())
    for r, (blocks, scattered, state, nbytes) in rows.items():
        ts = held(8, 4, 2, r)  # two consecutive tokens each, page_size 1
        assert blocks == runs(ts) * kv == kv
        assert scattered == len(ts) * kv
        assert state == state_slots
        assert nbytes == len(ts) * km.kv_bytes_per_token * kv + state_bytes


def test_options_the_dcp_explanation_does_not_take_are_refused(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--decode-dcp", "2",
                           "--fragmentation", "0.5")
    assert rc == 2 and out == ""
    assert "--decode-dcp" in err and "--fragmentation" in err
    rc, _, err = run_cli(capsys, "--preset", "deepseek-v3", "--dcp-interleave", "4",
                         "--layout", "cross-layer")
    assert rc == 2 and "--layout" in err


def test_an_interleave_that_does_not_divide_the_page_is_a_usage_error(capsys):
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--page-size", "4",
                           "--decode-dcp", "2", "--dcp-interleave", "3")
    assert rc == 2 and out == ""
    assert "--decode-dcp 2 --dcp-interleave 3" in err and "3" in err


def test_packed_columns_are_one_network_block_per_layer_and_decode_page_run(capsys):
    """Through a pack buffer the network moves one block per layer and run of decode pages
    (consecutive pages: one run; scattered: one per page), after one gather block per layer and
    run of the rank's tokens adjacent in the prefill's pages (token round robin: every token)."""
    ds = get_preset("deepseek-v3")
    layers = ds.num_layers
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "8", "--page-size", "4",
                           "--decode-dcp", "2")
    assert rc == 0, err
    rows = table_rows(out)
    assert sorted(rows) == [0, 1]
    for r, (blocks, _, packed, packed_scattered, gather, _, _) in rows.items():
        ts = held(32, 2, 1, r)  # 16 tokens: 4 decode pages of 4
        assert packed == layers
        assert packed_scattered == layers * 4
        assert gather == runs(ts) * layers == blocks
        assert (f"rank {r}: {blocks:,} blocks ({blocks:,} scattered)") in out
        assert (f"    packed: {layers} network blocks ({layers * 4} scattered) after "
                f"{gather:,} gather blocks ({gather:,} scattered)") in out
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "16", "--page-size",
                           "4", "--decode-dcp", "4", "--dcp-interleave", "4")
    assert rc == 0, err
    for r, (blocks, scattered, packed, packed_scattered, gather, _, _) in table_rows(out).items():
        assert blocks == scattered == gather == 4 * layers  # four whole-page deals, not adjacent
        assert packed == layers and packed_scattered == 4 * layers
