"""The layout file format's JSON Schema (shipped as ``kvplan/schemas/layout.schema.json``)
agrees with the loader: every layout kvplan writes validates, and documents the schema
refuses are refused by ``kvplan explain``'s loader too (one line, exit 2 for the CLI)."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema  # a test dependency: the schema is checked, never skipped
import pytest

import kvplan
from kvplan.explain import load_layout
from kvplan.presets import PRESETS, get_preset



def _schema() -> dict[str, Any]:
    text = resources.files("kvplan").joinpath("schemas/layout.schema.json").read_text()
    return json.loads(text)


def _validator() -> Any:
    schema = _schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _layouts() -> list[kvplan.Layout]:
    out = []
    for name in sorted(PRESETS):
        preset = get_preset(name, 8)
        out.append(preset.layout(range(8), page_size=16, capacity=32, base=1 << 20))
    out.append(kvplan.Layout.mla([1 << 20], [1152 * 64], 1152, page_size=1, dcp_size=2,
                                 dcp_rank=1))
    return out


@pytest.mark.parametrize("layout", _layouts(), ids=lambda la: f"{len(la)}-entries")
def test_every_written_layout_is_valid(layout: kvplan.Layout) -> None:
    doc = layout.to_dict()
    _validator().validate(doc)
    assert kvplan.Layout.from_dict(json.loads(json.dumps(doc))) == layout


def test_a_layout_with_state_channel_splits_is_valid() -> None:
    """``state_channels`` (a TP channel split per state entry, ``None`` elsewhere) is part of
    the written form: a split, a replicated split (0 channels) and a page entry's null."""
    layout = kvplan.Layout([1 << 20], [64], 16, [0], ["kv"], tp_size=2, tp_rank=1).with_state(
        "conv", [1 << 21], [96], [96], [1], channels=12, outer_rows=2,
        shard_groups=[[8, 8, 8]]).with_state("r", [1 << 22], [64], [64], [1], channels=0)
    doc = json.loads(json.dumps(layout.to_dict()))
    assert doc["state_channels"] == [None, [12, 2, [8, 8, 8]], [0, 1, []]]
    _validator().validate(doc)
    for bad in ([12, 0, []], [12, 1], [12, 1, [1, 1, 1, 1, 1]], ["12", 1, []]):
        doc["state_channels"][1] = bad
        assert list(_validator().iter_errors(doc)), bad


def _bad(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    cases = []
    for key in ("version", "data_ptrs", "data_lens", "item_lens", "layer_ids", "roles",
                "kinds"):
        d = copy.deepcopy(doc)
        del d[key]
        cases.append((f"no {key}", d))
    for key, value in [("version", 3), ("version", None), ("data_ptrs", None),
                       ("data_lens", [-1] * len(doc["data_lens"])),
                       ("item_lens", [2**64] * len(doc["item_lens"])),
                       ("kinds", ["slot"] * len(doc["data_ptrs"])),
                       ("memory_order", "XYZ"), ("device", None), ("pp_size", None),
                       ("unknown_field", 1), ("page_size", "16")]:
        d = copy.deepcopy(doc)
        d[key] = value
        cases.append((f"{key}={value!r}", d))
    return cases


_DOC = get_preset("kimi-linear", 8).layout(range(8), page_size=1, capacity=16,
                                           base=1 << 20).to_dict()


@pytest.mark.parametrize(("what", "doc"), _bad(_DOC), ids=[w for w, _ in _bad(_DOC)])
def test_what_the_schema_refuses_the_loader_refuses(what: str, doc: dict[str, Any],
                                                    tmp_path: Path) -> None:
    assert list(_validator().iter_errors(doc)), f"the schema accepts {what}"
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=str(path)):
        load_layout(str(path))


def test_kinds_may_be_null_and_optional_context_fields_absent(tmp_path: Path) -> None:
    doc = kvplan.Layout.mla([1 << 20], [1152 * 64], 1152).to_dict()
    doc["kinds"] = None
    for key in ("drafts", "strides", "page_size", "device", "dcp_size", "memory_order"):
        doc.pop(key, None)
    _validator().validate(doc)
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(doc))
    assert load_layout(str(path)).n_entries == 1
