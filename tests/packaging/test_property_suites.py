"""`scripts/property-suites N`: the byte-level property suites at N cases each. The suites it
names exist, every Rust one reads its case count from the environment, and the Python ones draw
exactly N examples, their own ``max_examples`` notwithstanding (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "property-suites"
RUST_TESTS = ROOT / "rust" / "kvplan-core" / "tests"
# A test with its own @settings(max_examples=300).
ORACLE_TEST = "tests/core/test_oracle.py::test_plans_move_what_the_oracle_moves"


def _listed(name: str) -> list[str]:
    text = SCRIPT.read_text()
    body = re.search(rf"^{name}=\(([^)]*)\)", text, re.MULTILINE)
    assert body, f"scripts/property-suites lists no {name}"
    return body.group(1).split()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPLAN_", "PROPTEST_"))}
    return {**env, **extra}


def test_the_rust_suites_it_names_read_their_case_count():
    for name in _listed("rust_tests"):
        text = (RUST_TESTS / f"{name}.rs").read_text()
        assert "property_config(" in text or "KVPLAN_ROUNDS_EXAMPLES" in text, name


def test_the_python_tests_it_names_exist_and_use_hypothesis():
    tests = _listed("python_tests")
    assert tests
    for node in tests:
        path, _, function = node.partition("::")
        text = (ROOT / path).read_text()
        assert "@given" in text, node
        if function:
            assert re.search(rf"^def {function}\(", text, re.MULTILINE), node


def test_python_tests_draw_the_examples_asked_for():
    result = subprocess.run(["bash", str(SCRIPT), "3", "python", ORACLE_TEST],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=_env(PATH=os.environ.get("PATH", "")))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "3 passing, 0 failing" in out
    assert "Stopped because settings.max_examples=3" in out
    assert "1 passed" in out


def test_a_bad_count_is_refused_naming_it():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                             ORACLE_TEST], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=_env(KVPLAN_HYPOTHESIS_EXAMPLES="many"))
    assert result.returncode != 0
    assert "KVPLAN_HYPOTHESIS_EXAMPLES must be a whole number above 0, got 'many'" in (
        result.stdout + result.stderr)
    for args in ([], ["0"], ["ten", "rust"], ["5", "tokens"]):
        result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                                timeout=60, cwd=ROOT)
        assert result.returncode == 2, (args, result.stdout + result.stderr)
        assert "scripts/property-suites" in result.stderr or "usage" in result.stderr, args
