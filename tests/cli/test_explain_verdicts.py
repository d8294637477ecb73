"""``kvplan explain`` says what is wrong with wrong input, in words that match the input:
bytes per token when page sizes differ, a conversion (not head slicing) when element sizes
differ, roles that differ only in letter case, and decode buffers that alias. Also
``explain --json`` (the same explanation as one JSON object) and ``python -m kvplan``.

Layouts are built from presets and edited the way a hand-written layout file would be wrong;
expected values come from the edits (sizes, roles, addresses), not from running explain.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvplan import cli
from kvplan.presets import get_preset

DS4 = get_preset("deepseek-v3").with_layers(4)  # MLA: one "kv" entry per layer, 1152 B/token
QWEN2 = get_preset("qwen3-235b").with_layers(2)  # MHA: "k" and "v" entries, 1024 B/token each


def write(path: Path, layout: Any, **edits: Any) -> str:
    data = layout.to_dict()
    data.update(edits)
    path.write_text(json.dumps(data))
    return str(path)


def explain_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["explain", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def mla(page_size: int) -> Any:
    return DS4.layout(range(4), page_size=page_size, capacity=64)


def mha() -> Any:
    return QWEN2.layout(range(2), page_size=1, capacity=64)


def test_page_size_mismatch_reads_bytes_per_token_not_equal_item_sizes(capsys, tmp_path) -> None:
    prefill = write(tmp_path / "p.json", mla(16))
    # Same item length (16 tokens x 1152 B) on a decode that claims 32 tokens per page.
    decode = write(tmp_path / "d.json", mla(16), page_size=32)
    rc, out, err = explain_cli(capsys, "--prefill", prefill, "--decode", decode, "--pages", "8")
    assert rc == 1, err
    assert "differ in item size" not in out, out
    assert "18432 vs 18432" not in out
    assert ("4 paired entries differ in bytes per token (prefill page_size 16, decode page_size "
            "32; paired items must hold the same bytes per token): layer 0 kv 18,432 B / 16 "
            "tokens = 1,152 B vs 18,432 B / 32 tokens = 576 B") in out, out


def test_fp8_decode_is_called_a_conversion_and_points_to_conversion_plans(capsys,
                                                                          tmp_path) -> None:
    geometry = dict(kv_heads=4, head_dim=128)
    prefill = write(tmp_path / "p.json", mha(), dtype_size=2, **geometry)
    base = mha().to_dict()
    decode = write(tmp_path / "d.json", mha(), dtype_size=1, **geometry,
                   item_lens=[n // 2 for n in base["item_lens"]],
                   strides=[n // 2 for n in base["strides"]])
    rc, out, err = explain_cli(capsys, "--prefill", prefill, "--decode", decode, "--pages", "8")
    assert rc == 1, err
    line = next(x for x in out.splitlines() if x.startswith("  explain: "))
    assert "element sizes differ: the prefill keeps 2-byte elements (bf16 or fp16), the decode " \
           "1-byte ones (fp8 or int8)" in line, line
    assert "not a head-slicing problem" in line and "kvplan.ConversionTemplate" in line
    assert "converts on the prefill" in line
    # The same reading is among the warnings, before the core's own line.
    warn = out[out.index("\nwarnings:"):]
    assert warn.index("element sizes differ") < warn.index("head slicing")


def test_half_size_decode_items_mention_conversion_plans(capsys, tmp_path) -> None:
    prefill = write(tmp_path / "p.json", mla(1))
    decode = write(tmp_path / "d.json", mla(1),
                   item_lens=[576] * 4, strides=[576] * 4)
    rc, out, err = explain_cli(capsys, "--prefill", prefill, "--decode", decode, "--pages", "8")
    assert rc == 1, err
    assert "the decode's items are half the prefill's, as a 1-byte (fp8, int8) cache of " \
           "2-byte (bf16) KV would be" in out, out
    assert "kvplan.ConversionTemplate" in out


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_upper_case_roles_are_named_as_a_spelling_not_missing_layers(capsys, tmp_path,
                                                                     side: str) -> None:
    upper = [r.upper() for r in mha().to_dict()["roles"]]
    files = {"prefill": write(tmp_path / "p.json", mha()),
             "decode": write(tmp_path / "d.json", mha())}
    files[side] = write(tmp_path / f"{side}-upper.json", mha(), roles=upper)
    rc, out, err = explain_cli(capsys, "--prefill", files["prefill"], "--decode",
                               files["decode"], "--pages", "8")
    assert rc == 1, err
    pairs = "'k' vs 'K', 'v' vs 'V'" if side == "decode" else "'K' vs 'k', 'V' vs 'v'"
    assert (f"roles differ only in letter case (prefill vs decode: {pairs}): roles are "
            f"compared exactly") in out, out


def test_roles_that_really_differ_get_no_case_reading(capsys, tmp_path) -> None:
    prefill = write(tmp_path / "p.json", mha())
    decode = write(tmp_path / "d.json", mha(), roles=["key", "key", "value", "value"])
    rc, out, _ = explain_cli(capsys, "--prefill", prefill, "--decode", decode, "--pages", "8")
    assert rc == 1
    assert "letter case" not in out


@pytest.mark.parametrize("shift", [0, 4096])
def test_aliased_decode_buffers_are_warned_about(capsys, tmp_path, shift: int) -> None:
    prefill = write(tmp_path / "p.json", mla(16))
    ptrs = mla(16).to_dict()["data_ptrs"]
    ptrs[1] = ptrs[0] + shift  # layer 1's buffer starts inside (or at) layer 0's
    decode = write(tmp_path / "d.json", mla(16), data_ptrs=ptrs)
    rc, out, err = explain_cli(capsys, "--prefill", prefill, "--decode", decode, "--pages", "8")
    assert rc == 0, err  # the template accepts it: the warning is the only sign
    assert "warnings: none" not in out
    assert (f"aliased decode memory: 1 of 4 blocks write decode bytes that another block of "
            f"this request also writes (decode entry 0 (layer 0 kv, from prefill) and decode "
            f"entry 1 (layer 1 kv, from prefill) overlap at {ptrs[1]:#x})") in out, out


@pytest.mark.parametrize("argv", [
    ("--preset", "deepseek-v3", "--pp", "4", "--fragmentation", "0.5"),
    ("--preset", "kimi-linear", "--pp", "2", "--layout", "cross-layer"),
    ("--preset", "qwen3-next", "--pp", "2", "--backend", "ascend"),
    ("--preset", "gpt-oss-120b", "--page-size", "16", "--fragmentation", "1"),
    ("--preset", "deepseek-v4", "--page-size", "64", "--pp", "2"),
])
def test_presets_have_no_aliased_decode_memory(capsys, argv: tuple[str, ...]) -> None:
    rc, out, err = explain_cli(capsys, *argv, "--pages", "256")
    assert rc == 0, err
    assert "aliased" not in out


def test_json_is_the_text_explanation_as_an_object(capsys) -> None:
    argv = ("--preset", "kimi-linear", "--pp", "2", "--pages", "64", "--fragmentation", "0.25")
    rc_text, text, _ = explain_cli(capsys, *argv)
    rc, out, err = explain_cli(capsys, *argv, "--json")
    assert rc == rc_text == 0, err
    data = json.loads(out)
    assert data["ok"] is True and data["title"] == "Kimi-Linear-style hybrid MLA"
    assert [s["label"] for s in data["stages"]] == ["stage 0/2", "stage 1/2"]
    assert f"per request: {data['blocks']:,} blocks" in text
    assert sum(s["blocks"] + s["state_blocks"] for s in data["stages"]) == data["blocks"]
    assert sum(b["pages"] for b in data["run_length_histogram"]) == data["run_pages"] == 64
    for w in data["warnings"]:
        assert f"  - {w}" in text
    assert {row["layer"] for row in data["kv_bytes_per_layer"]} == set(range(3, 48, 4))


def test_json_of_a_refused_stage_has_its_report_and_explains_reading(capsys, tmp_path) -> None:
    prefill = write(tmp_path / "p.json", mla(16))
    decode = write(tmp_path / "d.json", mla(16), page_size=32)
    rc, out, _ = explain_cli(capsys, "--prefill", prefill, "--decode", decode, "--pages", "8",
                             "--json")
    assert rc == 1
    (stage,) = json.loads(out)["stages"]
    assert stage["compatible"] is False
    report = stage["report"]
    assert report["compatible"] is False
    assert report["first_problem"]["error"] == "SizeMismatchError"
    assert report["reasons"][0].startswith("4 paired entries differ in bytes per token")


def test_json_with_decode_dcp(capsys) -> None:
    rc, out, err = explain_cli(capsys, "--preset", "deepseek-v3", "--decode-dcp", "2",
                               "--page-size", "4", "--pages", "16", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["dcp_size"] == 2 and [t["rank"] for t in data["rank_costs"]] == [0, 1]
    assert all(row["compatible"] for row in data["rows"])


def test_json_keeps_usage_errors_on_stderr(capsys) -> None:
    rc, out, err = explain_cli(capsys, "--preset", "deepseek-v3", "--stage", "9", "--json")
    assert rc == 2 and out == "" and err.startswith("kvplan explain: --stage"), err


def test_python_dash_m_kvplan_runs_the_console_script() -> None:
    res = subprocess.run([sys.executable, "-m", "kvplan", "explain", "--preset", "deepseek-v3",
                          "--pages", "8", "--json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ok"] is True
    res = subprocess.run([sys.executable, "-m", "kvplan", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("usage: kvplan "), res.stdout


def test_equal_items_refused_for_a_token_plan_get_the_refusals_words(capsys, tmp_path) -> None:
    # A window entry makes the plan token-exact; an 18,440-byte item of 16 tokens is no whole
    # number of bytes per token, on both sides alike.
    layout = mla(16)
    items = [18440] * 4
    prefill = write(tmp_path / "p.json", layout, item_lens=items, strides=items)
    decode = write(tmp_path / "d.json", layout, item_lens=items, strides=items)
    for path in (prefill, decode):
        data = json.loads(Path(path).read_text())
        data["windows"] = [32, None, None, None]
        Path(path).write_text(json.dumps(data))
    rc, out, err = explain_cli(capsys, "--prefill", prefill, "--decode", decode, "--pages", "4")
    assert rc == 1, err
    assert "18440 vs 18440" not in out, out
    assert "paired entries of equal item size on both sides are refused: " in out, out
    assert "not a whole number of tokens" in out
