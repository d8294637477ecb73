"""The vLLM NIXL staged-read benchmark runs end to end on its tiniest case and reports every path.

The script is run as a program (a subprocess, as a user runs it), never imported: the 4-layer
256-token GQA request, one repeat, a 1 MiB arena. What is checked is the output's structure, the
descriptor counts and the byte checks, not any time: each path has one positive sample and a
positive fraction of the ceiling, kvplan's read was staged in several rounds of one network read
each, vLLM's took one descriptor per block and region, and every path's bytes were equal.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench/vllm_nixl_staged.py"


@pytest.mark.nixl
def test_quick_run_reports_every_path(tmp_path: Path) -> None:
    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("NIXL (nixl_cu12) is not installed")
    out_json, out_md = tmp_path / "rows.json", tmp_path / "vllm-nixl-staged.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--cases", "gqa-tiny", "--json",
         str(out_json), "--out", str(out_md)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out_json.read_text(encoding="utf-8"))
    assert data["repeats"] == 1 and data["arena_bytes"] == 1 << 20
    (row,) = data["rows"]
    assert row["case"] == "gqa-tiny"
    paths = {"vllm", "staged", "ceiling"}
    assert set(row["times"]) == paths == set(row["bytes_ok"])
    for path in paths:
        assert len(row["times"][path]) == 1 and row["times"][path][0] > 0, path
        assert row["fraction_median"][path] > 0 and row["fraction_min"][path] > 0, path
        assert row["bytes_ok"][path] is True, path
    assert row["fraction_median"]["ceiling"] == 1.0
    # 4 layers (K and V: 8 regions) x 16 blocks of 16 tokens x 8 heads x 256 bytes = 4 MiB,
    # through two 512 KiB round buffers: 8 rounds, one network read each
    assert row["request_bytes"] == 4 << 20
    assert row["rounds"] == 8
    assert row["descriptors"] == {"vllm": 8 * 16, "staged": 8, "ceiling": 1}
    assert row["scatter_blocks"] == 8 * 16  # every decode page apart (100 % fragmented)
    report = out_md.read_text(encoding="utf-8")
    assert "| request | MiB | ceiling (GB/s) | vLLM `_read_blocks` | kvplan staged |" in report
    assert "| GQA 8x128 bf16, 4 layers, block 16, 256 tokens" in report
    assert "bytes differ" not in report


@pytest.mark.nixl
def test_quick_tp_run_reports_every_path_per_rank(tmp_path: Path) -> None:
    """The tiny cases between TP sizes that differ: decode rank 0 of TP 2 reading its 4 of 8
    heads from prefill TP 1 (half of each prefill block), and decode TP 1 reading both prefill
    ranks of TP 2 (one read each); every path's bytes checked, the descriptor counts vLLM's
    (one per block and region per prefill rank read), kvplan's (one per round) and the
    ceiling's (one per prefill rank read)."""
    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("NIXL (nixl_cu12) is not installed")
    out_json = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--tp", "--json", str(out_json)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {row["case"]: row for row in json.loads(out_json.read_text("utf-8"))["rows"]}
    assert set(rows) == {"p1d2-tiny", "p2d1-tiny"}
    for row in rows.values():
        assert all(row["bytes_ok"][p] is True for p in ("vllm", "staged", "ceiling"))
        assert all(len(t) == 1 and t[0] > 0 for t in row["times"].values())
    # 8 regions x 16 blocks: rank 0's half of each block (2 MiB), one prefill rank read
    one = rows["p1d2-tiny"]
    assert one["request_bytes"] == 2 << 20
    assert one["descriptors"]["vllm"] == 8 * 16 and one["descriptors"]["ceiling"] == 1
    assert one["descriptors"]["staged"] == one["rounds"] < 8 * 16
    assert one["scatter_blocks"] == 8 * 16
    # both prefill ranks' halves of each decode block (4 MiB), two reads
    two = rows["p2d1-tiny"]
    assert two["request_bytes"] == 4 << 20
    assert two["descriptors"]["vllm"] == 2 * 8 * 16 and two["descriptors"]["ceiling"] == 2
    assert two["descriptors"]["staged"] == two["rounds"] < 2 * 8 * 16
    assert two["scatter_blocks"] == 2 * 8 * 16
