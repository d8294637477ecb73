"""Decode context parallelism in the layout context: keywords, validation, dict and wire."""

from __future__ import annotations

import json

import pytest

import kvplan


def _mla(**context: object) -> kvplan.Layout:
    return kvplan.Layout.mla([0x1000, 0x9000], [0x4000] * 2, 64 * 16, [0, 1], page_size=16,
                             **context)


def test_dcp_keywords_are_read_back_and_default_to_no_dealing() -> None:
    plain = _mla()
    assert (plain.dcp_size, plain.dcp_rank, plain.dcp_interleave) == (1, 0, 1)
    layout = _mla(dcp_size=8, dcp_rank=5, dcp_interleave=16)
    assert (layout.dcp_size, layout.dcp_rank, layout.dcp_interleave) == (8, 5, 16)
    assert "dcp=5/8 (interleave 16)" in repr(layout)
    assert "dcp" not in repr(plain)


def test_dcp_context_round_trips_through_dict_json_and_bytes() -> None:
    layout = _mla(dcp_size=4, dcp_rank=3, dcp_interleave=1)
    doc = json.loads(json.dumps(layout.to_dict()))
    assert (doc["dcp_size"], doc["dcp_rank"], doc["dcp_interleave"]) == (4, 3, 1)
    assert kvplan.Layout.from_dict(doc) == layout
    assert kvplan.Layout.from_bytes(layout.to_bytes()) == layout
    # A DCP layout and the same layout without DCP are different layouts on the wire too.
    assert layout.to_bytes() != _mla().to_bytes()
    assert kvplan.Layout.from_bytes(_mla().to_bytes()) == _mla()


@pytest.mark.parametrize(("context", "message"), [
    ({"dcp_size": 4, "dcp_rank": 4}, "dcp_rank 4 must be below dcp_size 4"),
    ({"dcp_size": 0}, "dcp_size must be at least 1"),
    ({"dcp_size": 2, "dcp_interleave": 0}, "dcp_interleave must be at least 1"),
    ({"dcp_size": 2, "dcp_interleave": 6},
     "dcp_interleave 6 and page_size 16: one must divide the other"),
])
def test_bad_dcp_contexts_are_layout_errors(context: dict[str, int], message: str) -> None:
    with pytest.raises(kvplan.LayoutError, match=message):
        _mla(**context)


def test_a_dict_with_a_bad_dcp_rank_is_refused() -> None:
    doc = _mla(dcp_size=2, dcp_rank=1).to_dict()
    doc["dcp_rank"] = 2
    with pytest.raises(kvplan.LayoutError, match="dcp_rank 2 must be below dcp_size 2"):
        kvplan.Layout.from_dict(doc)
