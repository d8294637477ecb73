"""What each planner supports is declared in the core (``kvplan._core.planner_support``): a
feature a planner does not support is a ``kvplan.UnsupportedError`` naming both (a
``KvPlanError``, so callers catching that keep working), and the "what works with what" text in
docs/limitations.md and README.md is the one generated from the declaration.

Every (planner, feature) pair is checked in the core (rust/kvplan-core/tests/capabilities.rs);
here the pairs Python reaches, the mapping to the exception and the docs' copies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvplan
from kvplan import capabilities
from kvplan.testing.ranks import Model, Rank, rank_memory

ROOT = Path(__file__).resolve().parents[2]
PLANNERS = ["plan", "plan_batch", "plan_packed", "plan_row_gather", "plan_staged",
            "plan_rounds", "descriptor_table"]
FEATURES = ["delta", "state_slot", "window", "token_plan", "ring", "pool_range",
            "pages_with_state", "sliced_state"]


def _template(window: int | None = None, dst_page_size: int = 4) -> kvplan.Template:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2, window=window)
    src = rank_memory(model, Rank(0, 1, 4, "NHD", 16), seed=1)
    dst = rank_memory(model, Rank(0, 1, dst_page_size, "NHD", 16))
    return kvplan.Template(src.layout, dst.layout)


def test_the_declaration_lists_every_planner_and_feature_in_order() -> None:
    table = capabilities.support()
    assert list(table) == PLANNERS
    for planner, row in table.items():
        assert list(row) == FEATURES, planner
    assert list(capabilities.features()) == FEATURES
    # The direct plan plans every feature; the others' refusals are the declared ones.
    assert all(table["plan"].values())
    refused = {p: [f for f, ok in row.items() if not ok] for p, row in table.items()}
    assert refused == {
        "plan": [], "plan_batch": ["ring"],
        "plan_packed": ["ring", "pages_with_state", "sliced_state"],
        "plan_row_gather": ["delta", "state_slot", "window", "ring", "pool_range",
                            "pages_with_state", "sliced_state"],
        "plan_staged": ["delta"], "plan_rounds": ["delta"],
        "descriptor_table": ["delta", "window", "token_plan", "ring", "pool_range",
                             "pages_with_state", "sliced_state"],
    }
    assert capabilities.supports("plan_staged", "window")
    assert not capabilities.supports("plan_staged", "delta")
    with pytest.raises(KeyError, match="unknown planner 'plan_sideways'; planners: plan, "):
        capabilities.supports("plan_sideways", "delta")
    with pytest.raises(KeyError, match="unknown feature 'teleport'; features: delta, "):
        capabilities.supports("plan", "teleport")


def test_unsupported_error_is_a_kvplan_error_exported_from_kvplan() -> None:
    assert issubclass(kvplan.UnsupportedError, kvplan.KvPlanError)
    assert issubclass(kvplan.UnsupportedError, ValueError)
    assert "UnsupportedError" in kvplan.__all__


def test_a_row_gather_of_a_window_template_names_the_planner_and_the_feature() -> None:
    t = _template(window=8)
    pages = np.arange(4, dtype=np.int64)
    with pytest.raises(kvplan.UnsupportedError) as caught:
        t.plan_row_gather(pages, pages, pack=(1 << 40, 1 << 20))
    err = caught.value
    assert (err.planner, err.feature, err.kind) == ("plan_row_gather", "window", "unsupported")
    assert str(err).startswith("plan_row_gather does not support window: a row gather moves "
                               "every token of a request; this template has sliding-window "
                               "entries (8 tokens)")
    # The same request plans directly; the same row gather plans without the window.
    assert t.plan(pages, pages).n_blocks > 0
    rows, network = _template().plan_row_gather(pages, pages, pack=(1 << 40, 1 << 20),
                                                n_tokens=16)
    assert network.n_blocks > 0


@pytest.mark.parametrize("window", [None, 8])
def test_descriptor_tables_of_a_token_template_name_the_feature(window: int | None) -> None:
    # Different page sizes make a token template; a window template is one too, and is named
    # as the window.
    t = _template(window=window, dst_page_size=8 if window is None else 4)
    feature = "token_plan" if window is None else "window"
    for call in (lambda: t.descriptor_table("src"),
                 lambda: t.prepped_indices(np.arange(2), np.arange(2))):
        with pytest.raises(kvplan.UnsupportedError) as caught:
            call()
        assert (caught.value.planner, caught.value.feature) == ("descriptor_table", feature)
    if window is None:
        assert "prefill pages hold 4 tokens and decode pages 8" in str(caught.value)


def test_descriptor_tables_of_a_page_template_plan() -> None:
    t = _template()
    addrs, lens = t.descriptor_table("src")
    assert len(addrs) == len(lens) > 0
    src_idx, dst_idx = t.prepped_indices(np.arange(2), np.arange(2))
    assert len(src_idx) == len(dst_idx) > 0


def test_the_docs_tables_are_the_generated_ones() -> None:
    stale = []
    for path, markers, body in capabilities._targets(ROOT):
        text = path.read_text()
        if capabilities.replace_between(text, markers, body) != text:
            stale.append(str(path.relative_to(ROOT)))
    assert not stale, (f"{', '.join(stale)} differ from the planners' declaration; regenerate "
                       "with: python -m kvplan.capabilities --write")


def test_the_generator_checks_and_rewrites(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for name, markers in (("docs/limitations.md", capabilities.TABLE_MARKERS),
                          ("README.md", capabilities.README_MARKERS)):
        (tmp_path / name).write_text(f"intro\n{markers[0]}\nold\n{markers[1]}\nrest\n")
    assert capabilities.main(["--check", "--root", str(tmp_path)]) == 1
    assert capabilities.main(["--write", "--root", str(tmp_path)]) == 0
    assert capabilities.main(["--check", "--root", str(tmp_path)]) == 0
    text = (tmp_path / "docs/limitations.md").read_text()
    assert text.startswith("intro\n") and text.endswith("rest\n")
    assert "| `plan_staged` | ✗ | ✓ | ✓ | ✓ |" in text
    with pytest.raises(ValueError, match="marker '<!-- end works with -->' not found"):
        capabilities.replace_between("x\n" + capabilities.README_MARKERS[0],
                                     capabilities.README_MARKERS, "y")
