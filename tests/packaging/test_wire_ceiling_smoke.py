"""The wire-ceiling benchmark runs end to end on its tiniest case and reports every path.

The script is run as a program (a subprocess, as a user runs it), never imported: on one loopback
engine, one repeat, the 4-layer 256-token MLA request. What is checked is the output's structure
and the byte checks, not any time: every path that ran has one sample, a positive fraction of
the ceiling and equal bytes; a path that did not run says why.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench/wire_ceiling.py"
ENGINES = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine"}  # the faster to start first


def available_engine() -> str | None:
    for name, module in ENGINES.items():
        try:
            if importlib.util.find_spec(module) is not None:
                return name
        except ModuleNotFoundError:  # a missing parent package
            continue
    return None


def test_quick_run_reports_every_path(tmp_path: Path) -> None:
    engine = available_engine()
    if engine is None:
        pytest.skip(f"no transfer engine installed (needs one of {sorted(ENGINES.values())})")
    out_json, out_md = tmp_path / "rows.json", tmp_path / "wire-ceiling.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--cases", "mla-tiny", "--engines", engine,
         "--json", str(out_json), "--out", str(out_md)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out_json.read_text(encoding="utf-8"))
    assert data["repeats"] == 1 and data["engines"] == [engine]
    (row,) = data["rows"]
    assert (row["engine"], row["case"]) == (engine, "mla-tiny")
    ran = set(row["times"])
    assert {"ceiling", "direct", "staged"} <= ran <= {"ceiling", "host", "direct", "staged",
                                                      "rounds"}
    for path in ("host", "rounds"):
        assert (path in ran) != (path in row["notes"]), (path, row["notes"])
    for path in ran:
        assert len(row["times"][path]) == 1 and row["times"][path][0] > 0, path
        assert row["fraction_median"][path] > 0 and row["fraction_min"][path] > 0, path
        assert row["bytes_ok"][path] is True, path
    assert row["fraction_median"]["ceiling"] == 1.0
    # 4 layers x 256 tokens x 1,152 bytes; the direct plan has one block per token per layer
    # (every decode page apart), the staged network plan one block
    assert row["request_bytes"] == 4 * 256 * 1152
    assert row["descriptors"]["ceiling"] == 1 and row["descriptors"]["staged"] == 1
    assert row["descriptors"]["direct"] == 4 * 256
    assert set(row["steps"]) == {"plan", "gather", "network", "scatter"}
    if "rounds" in ran:  # 1.1 MiB through a 1 MiB arena of two round buffers
        assert row["arena_bytes"] == 1 << 20 and row["rounds"] >= 3
        assert set(row["round_steps"]) == {"elapsed", "serial", "gather", "network", "scatter"}
    else:
        assert row["notes"]["rounds"] == "n/a (not built yet)"
    report = out_md.read_text(encoding="utf-8")
    assert "| engine | request | MiB | ceiling (GB/s) | host path | kvplan direct |" in report
    assert f"| {engine} | MLA 4 layers, page 1, 256 tokens" in report
    assert "**bytes differ**" not in report
