"""docs/development.md's feature index cannot rot: every path it names exists, every section it
links is a heading of the linked file (and every quoted paragraph title a bold paragraph of it),
every row names at least one test, and every test file under ``tests/features/`` is in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
INDEX_HEADING = "## Feature index"
COLUMNS = ["Feature", "Code", "Rust tests", "Python tests", "Docs"]


def index_rows() -> list[list[str]]:
    """The table under the index heading, header and separator left out, as cells."""
    lines = (DOCS / "development.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(INDEX_HEADING)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert rows, f"no table under {INDEX_HEADING!r} in docs/development.md"
    assert rows[0] == COLUMNS, rows[0]
    assert set(rows[1]) == {"---"}, rows[1]
    return rows[2:]


def paths_in(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation (backticks, parentheses,
    dots, symbols) dropped, spaces turned into hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(doc: Path) -> set[str]:
    """Anchors of the markdown headings of ``doc``, fenced code left out."""
    anchors, fenced = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            anchors.add(github_anchor(line.lstrip("#")))
    return anchors


ROWS = index_rows()


def test_the_index_has_a_row_per_feature_and_five_cells_each() -> None:
    assert len(ROWS) >= 20
    for row in ROWS:
        assert len(row) == len(COLUMNS), row
    features = [row[0] for row in ROWS]
    assert len(set(features)) == len(features), "a feature listed twice"


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_every_path_in_a_row_exists(row: list[str]) -> None:
    missing = [p for cell in row[1:4] for p in paths_in(cell) if not (REPO / p).exists()]
    assert not missing, f"{row[0]}: named in docs/development.md but not in the repo: {missing}"


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_every_row_names_its_code_and_a_test(row: list[str]) -> None:
    code, rust, python = (paths_in(cell) for cell in row[1:4])
    assert code, f"{row[0]}: no code named"
    assert rust or python, f"{row[0]}: no test named"
    for path in rust:
        assert path.startswith("rust/") and "/tests/" in path and path.endswith(".rs"), path
    for path in python:
        assert path.startswith("tests/") and Path(path).name.startswith("test_"), path


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_every_linked_section_is_a_heading_of_its_file(row: list[str]) -> None:
    links = re.findall(r"\]\(([^)#]+)#([^)]+)\)", row[4])
    assert links, f"{row[0]}: no section linked"
    for name, anchor in links:
        doc = DOCS / name
        assert doc.is_file(), f"{row[0]}: docs/{name} does not exist"
        assert anchor in headings(doc), f"{row[0]}: docs/{name} has no heading #{anchor}"
        text = doc.read_text(encoding="utf-8")
        for title in re.findall(r"“([^”]+)”", row[4]):
            assert f"**{title}" in text, f"{row[0]}: docs/{name} has no paragraph **{title}"


def test_every_feature_test_file_is_in_the_index() -> None:
    named = {p for row in ROWS for p in paths_in(row[3])}
    on_disk = {p.relative_to(REPO).as_posix()
               for p in (REPO / "tests" / "features").rglob("test_*.py")}
    assert on_disk, "tests/features holds no tests"
    assert not on_disk - named, f"not in docs/development.md's feature index: {sorted(on_disk - named)}"


def test_the_anchor_rule_matches_known_headings() -> None:
    # Guards the checker itself: anchors as GitHub renders them for headings with code,
    # parentheses and symbols.
    assert github_anchor("Prefill TP ≠ decode TP") == "prefill-tp--decode-tp"
    assert github_anchor("Requests (`kvplan.Request`)") == "requests-kvplanrequest"
    assert github_anchor("Entry pairing: `build_transfer_entry_pairs`") == \
        "entry-pairing-build_transfer_entry_pairs"
