"""kvplan.testing.fixtures: the shared planning fixtures are plain data, their byte maps are the
byte-level oracle's, and kvplan's own planner writes exactly them."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvplan
from kvplan.testing.fixtures import (
    FIXTURE_CLASSES,
    PlanningFixture,
    byte_map_of_blocks,
    fixtures,
    merge_byte_maps,
    oracle_byte_map,
)

FIXTURES = fixtures()


def test_every_class_has_a_fixture_and_names_are_unique() -> None:
    assert [f.fixture_class for f in FIXTURES] == [
        c for c in FIXTURE_CLASSES for f in FIXTURES if f.fixture_class == c]
    assert {f.fixture_class for f in FIXTURES} == set(FIXTURE_CLASSES)
    assert len({f.name for f in FIXTURES}) == len(FIXTURES)


@pytest.mark.parametrize("fx", FIXTURES, ids=lambda f: f.name)
def test_a_fixture_is_json_data_and_round_trips(fx: PlanningFixture) -> None:
    text = json.dumps(fx.to_dict())
    back = PlanningFixture.from_dict(json.loads(text))
    assert back == fx
    srcs, dst = back.layouts()
    assert [s.fingerprint() for s in srcs] == [s.fingerprint() for s in fx.layouts()[0]]
    assert dst.fingerprint() == fx.layouts()[1].fingerprint()
    assert fx.expected and all(n > 0 for *_, n in fx.expected)


def _kvplan_map(fx: PlanningFixture) -> tuple[tuple[int, int, int, int], ...]:
    srcs, dst = fx.layouts()
    maps = []
    for i, src in enumerate(srcs):
        t = kvplan.Template(src, dst)
        s, d = np.asarray(fx.src_pages, np.int64), np.asarray(fx.dst_pages, np.int64)
        plan = t.plan(s, d, n_tokens=fx.n_tokens) if fx.n_tokens else t.plan(s, d)
        blocks = list(zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(),
                          plan.lengths.tolist()))
        if fx.src_slot is not None and fx.dst_slot is not None:
            st = t.plan_state(fx.src_slot, fx.dst_slot)
            blocks += list(zip(st.src_addrs.tolist(), st.dst_addrs.tolist(),
                               st.lengths.tolist()))
        maps.append(byte_map_of_blocks(blocks, i))
    return merge_byte_maps(*maps)


@pytest.mark.parametrize("fx", FIXTURES, ids=lambda f: f.name)
def test_kvplan_writes_each_fixtures_byte_map(fx: PlanningFixture) -> None:
    assert _kvplan_map(fx) == fx.expected


def test_the_staged_fixture_has_the_direct_transfers_bytes() -> None:
    by_name = {f.name: f for f in FIXTURES}
    assert by_name["staging-split"].expected == by_name["hetero-tp-split"].expected
    assert by_name["staging-split"].context["staged"] is True


def test_the_byte_map_traces_every_written_byte() -> None:
    # two 8-byte items, pages 0 -> 1: the map says exactly that, byte for byte
    src = kvplan.Layout([0x1000], [32], 8, [0])
    dst = kvplan.Layout([0x8000], [32], 8, [0])
    assert oracle_byte_map([src], dst, [0, 3], [1, 0]) == ((0, 0x1018, 0x8000, 8),
                                                          (0, 0x1000, 0x8008, 8))
    # a plan that drops one page, or writes it elsewhere, is not the fixture's map
    assert byte_map_of_blocks([(0x1018, 0x8000, 8)]) != oracle_byte_map(
        [src], dst, [0, 3], [1, 0])
    with pytest.raises(AssertionError, match="written twice"):
        merge_byte_maps(byte_map_of_blocks([(0x1000, 0x8000, 8)]),
                        byte_map_of_blocks([(0x1000, 0x8004, 8)], 1))
