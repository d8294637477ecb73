"""README.md's claims: it stays a short front door, its example runs and prints what the README
says it prints, every measured number in it is one recorded under bench/results/, and every
relative link resolves. Read statically, except the example, which runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RESULTS_TEXT = "\n".join(p.read_text() for p in sorted((ROOT / "bench/results").glob("*.md")))

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
# A measured number: a value with a unit, or the first value of a range ("302–1,860×").
MEASURED = re.compile(r"(?<![\w.,])(\d[\d,]*(?:\.\d+)?)(?:–(\d[\d,]*(?:\.\d+)?))?\s?(ms|µs|ns|×)")
# A block or descriptor count, written with thousands separators.
COUNT = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\d,])")


def _fences(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(README) if tag == lang]


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README.md has no section {title!r}"
    return match.group(1)


def _prose() -> str:
    """The README without its code blocks (the example's output is checked by running it)."""
    return FENCE.sub("", README)


def _recorded(text: str) -> bool:
    """Whether ``text`` occurs in bench/results/ as a whole number (not inside a longer one)."""
    return re.search(rf"(?<![\d.,]){re.escape(text)}(?![\d,]|\.\d)", RESULTS_TEXT) is not None


def test_readme_is_short():
    assert len(README.splitlines()) <= 150


def test_quickstart_is_the_two_scripts():
    commands = [line.split("#")[0].strip() for body in FENCE.findall(_section("Quickstart"))
                for line in body[1].splitlines() if line.strip()]
    assert commands == ["bash scripts/demo", "bash scripts/test"]


def test_example_runs_and_prints_what_the_readme_says():
    (example,) = _fences("python")
    assert len(example.splitlines()) <= 10
    (expected,) = _fences("text")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "python"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # -W error: the documented example uses no deprecated spelling.
    run = subprocess.run([sys.executable, "-W", "error", "-c", example], capture_output=True,
                         text=True, env=env, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected


def test_every_measured_number_is_recorded_in_bench_results():
    prose = _prose()
    numbers = [f"{value}{unit}" if unit == "×" else f"{value} {unit}"
               for first, last, unit in MEASURED.findall(prose) for value in (first, last) if value]
    numbers += COUNT.findall(prose)
    assert len(numbers) > 20, numbers  # the patterns still find the performance section
    missing = sorted({n for n in numbers if not _recorded(n)})
    assert not missing, f"README numbers not recorded under bench/results/: {missing}"


def test_feature_table_has_six_rows_each_linking_its_docs_page():
    rows = [line for line in _section("Features").splitlines() if line.startswith("| ")][2:]
    assert len(rows) == 6, rows
    for row in rows:
        links = re.findall(r"\]\(([^)]+)\)", row.split(" | ")[-1])
        assert len(links) == 1 and links[0].startswith("docs/"), row


def test_chart_is_embedded_and_every_relative_link_resolves():
    assert "](bench/results/chart.png)" in README
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    relative = [t for t in targets if not re.match(r"\w+://", t)]
    assert relative
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert not missing, missing
