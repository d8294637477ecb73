"""The comparer behind scripts/test-vllm-upstream: outcomes test id by test id, the expected
differences (each with its reason, checked for staleness) and the recorded passing ids."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

COMPARER = Path(__file__).resolve().parents[1] / "support" / "vllm_upstream" / "compare_outcomes.py"
CLASS = "tests.v1.kv_connector.unit.test_x"


def junit(path: Path, cases: dict[str, str]) -> Path:
    """A JUnit report: test name -> "passed", "skipped" or "failed TYPE"."""
    rows = []
    for name, outcome in cases.items():
        body = ""
        if outcome == "skipped":
            body = '<skipped message="skip"/>'
        elif outcome.startswith("failed"):
            body = f'<failure message="{outcome.split()[1]}: boom">E {outcome.split()[1]}: boom</failure>'
        rows.append(f'<testcase classname="{CLASS}" name="{name}">{body}</testcase>')
    path.write_text(f'<testsuites><testsuite>{"".join(rows)}</testsuite></testsuites>')
    return path


def compare(tmp_path: Path, alone: dict[str, str], kvplan: dict[str, str],
            expected: str | None = None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(COMPARER), str(junit(tmp_path / "a.xml", alone)),
            str(junit(tmp_path / "k.xml", kvplan))]
    if expected is not None:
        (tmp_path / "e.txt").write_text(expected)
        args.append(str(tmp_path / "e.txt"))
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def test_equal_outcomes_pass_and_a_same_type_failure_is_equal(tmp_path: Path) -> None:
    both = {"t1": "passed", "t2": "failed ValueError", "t3": "skipped"}
    assert compare(tmp_path, both, both).returncode == 0


def test_a_test_that_fails_only_with_kvplan_is_named(tmp_path: Path) -> None:
    res = compare(tmp_path, {"t1": "passed", "t2": "passed"},
                  {"t1": "passed", "t2": "failed AssertionError"})
    assert res.returncode == 1
    assert f"{CLASS}::t2: passed -> failed AssertionError" in res.stdout


def test_another_exception_type_is_a_difference(tmp_path: Path) -> None:
    res = compare(tmp_path, {"t1": "failed ValueError"}, {"t1": "failed TypeError"})
    assert res.returncode == 1 and "failed ValueError -> failed TypeError" in res.stdout


def test_an_expected_difference_is_accepted_with_its_reason_and_only_as_listed(
        tmp_path: Path) -> None:
    listed = f"# why\n{CLASS}::t2\tpatches a private helper\n"
    ok = compare(tmp_path, {"t1": "passed", "t2": "passed"},
                 {"t1": "passed", "t2": "failed AssertionError"}, listed)
    assert ok.returncode == 0 and "patches a private helper" in ok.stdout
    # no longer differing: the entry is stale
    stale = compare(tmp_path, {"t2": "passed"}, {"t2": "passed"}, listed)
    assert stale.returncode == 1 and "stale" in stale.stdout
    # an unlisted difference still fails beside a listed one
    other = compare(tmp_path, {"t1": "passed", "t2": "passed"},
                    {"t1": "failed KeyError", "t2": "failed AssertionError"}, listed)
    assert other.returncode == 1 and f"{CLASS}::t1: passed -> failed KeyError" in other.stdout


def test_passing_ids_are_pytest_node_ids(tmp_path: Path) -> None:
    report = junit(tmp_path / "a.xml", {"t1[a b-1]": "passed", "t2": "failed ValueError",
                                        "t3": "skipped"})
    res = subprocess.run([sys.executable, str(COMPARER), "--passing-ids", str(report)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert res.stdout.splitlines() == ["tests/v1/kv_connector/unit/test_x.py::t1[a b-1]"]


def test_the_recorded_passing_ids_are_node_ids_of_the_seven_files() -> None:
    listed = (COMPARER.parent / "passing-alone-0.34.0.txt").read_text().splitlines()
    assert len(listed) == len(set(listed)) > 0
    files = {line.split("::")[0] for line in listed}
    assert all(f.startswith("tests/v1/kv_connector/unit/test_") and f.endswith(".py")
               for f in files), files
