"""kvplan.Pairing: construction, repr/equality, each mode against the pairing it must equal,
the removed spellings (a bool, the pairing keywords) refused with the Pairing to write, and
Layout.entries() / draft-ness as entry fields."""

from __future__ import annotations

import re
import struct
import warnings
import zlib

import pytest

import kvplan
from kvplan import KvPlanError, Layout, Pairing, Template, compare, select_pairing
from kvplan._core import check_pairs


def test_constructors_attributes_and_defaults():
    p = Pairing.by_layer_id()
    assert (p.mode, p.allow_positional_fallback, p.prefill_start_layer, p.legacy_kind) == (
        "layer_id", False, None, None)
    p = Pairing.by_layer_id(True, prefill_start_layer=3, legacy_kind="mha")
    assert (p.mode, p.allow_positional_fallback, p.prefill_start_layer, p.legacy_kind) == (
        "layer_id", True, 3, "mha")
    p = Pairing.positional()
    assert (p.mode, p.allow_positional_fallback, p.prefill_start_layer, p.legacy_kind) == (
        "positional", True, None, None)
    p = Pairing.legacy("mla", prefill_start_layer=2)
    assert (p.mode, p.allow_positional_fallback, p.prefill_start_layer, p.legacy_kind) == (
        "legacy", False, 2, "mla")
    assert Pairing.legacy(prefill_start_layer=0).legacy_kind is None
    with pytest.raises(KvPlanError, match="legacy kind"):
        Pairing.legacy("gqa", prefill_start_layer=0)
    with pytest.raises(TypeError):
        Pairing.legacy("mla")  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        p.mode = "positional"  # type: ignore[misc]


@pytest.mark.parametrize("p", [
    Pairing.by_layer_id(),
    Pairing.by_layer_id(True),
    Pairing.by_layer_id(prefill_start_layer=2, legacy_kind="mla"),
    Pairing.positional(),
    Pairing.legacy(prefill_start_layer=4),
    Pairing.legacy("mha", prefill_start_layer=1),
])
def test_repr_round_trips_and_values_compare_equal(p):
    again = eval(repr(p), {"Pairing": Pairing})
    assert again == p and hash(again) == hash(p)
    assert repr(again) == repr(p)


def test_equality():
    assert Pairing.by_layer_id() == Pairing.by_layer_id(False)
    assert Pairing.by_layer_id() != Pairing.by_layer_id(True)
    assert Pairing.by_layer_id(True) != Pairing.positional()
    assert Pairing.legacy("mla", prefill_start_layer=2) != Pairing.legacy(prefill_start_layer=2)
    assert Pairing.positional() != "positional"
    assert repr(Pairing.legacy("mla", prefill_start_layer=2)) == (
        "Pairing.legacy('mla', prefill_start_layer=2)")


def _pp_stage():
    """A PP stage (layers 2-3 of 6, ids published) and its decode, MLA with a draft layer."""
    src = Layout.mla([102, 103], [640] * 2, 64, [2, 3], num_model_layers=6).with_draft(
        [900], [640], 64, draft_layer_ids=[0], num_hidden_layers=6)
    dst = Layout.mla([100 + i for i in range(6)], [640] * 6, 64, list(range(6)),
                     num_model_layers=6).with_draft(
        [800], [640], 64, draft_layer_ids=[0], num_hidden_layers=6)
    return src, dst


def test_by_layer_id_pairs_by_layer_id_and_falls_back_when_asked():
    src, dst = _pp_stage()
    for pairing in [None, Pairing.by_layer_id(), Pairing.by_layer_id(True)]:
        assert Template(src, dst, pairing).pairs.tolist() == [[0, 2], [1, 3], [2, 6]]
    # peers without ids: positional fallback and legacy slicing
    a = Layout([1, 2], [640] * 2, 64, roles=["kv", "kv"])
    b = Layout([5, 6, 7], [640] * 3, 64, roles=["kv", "kv", "kv"])
    assert Template(a, b, Pairing.by_layer_id(True)).pairs.tolist() == [[0, 0], [1, 1]]
    sliced = Pairing.by_layer_id(prefill_start_layer=1, legacy_kind="mla")
    assert Template(a, b, pairing=sliced).pairs.tolist() == [[0, 1], [1, 2]]


def _no_ids():
    """A pair without layer ids, where each removed spelling meant a different pairing."""
    return (Layout([1, 2], [640] * 2, 64, roles=["kv", "kv"]),
            Layout([5, 6, 7], [640] * 3, 64, roles=["kv", "kv", "kv"]))


# Each removed spelling (positional bool or pairing keywords), the Pairing it stood for, and
# the TypeError (after "<function>(): ") that says what to write instead.
REMOVED_SPELLINGS = [
    ((True,), {}, Pairing.by_layer_id(allow_positional_fallback=True),
     "a bool pairing (True) was removed: pass "
     "pairing=kvplan.Pairing.by_layer_id(allow_positional_fallback=True)"),
    ((False,), {}, Pairing.by_layer_id(),
     "a bool pairing (False) was removed: pass pairing=kvplan.Pairing.by_layer_id() "
     "(the default: leave it out)"),
    ((), {"allow_positional_fallback": True}, Pairing.by_layer_id(allow_positional_fallback=True),
     "allow_positional_fallback= was removed: pass "
     "pairing=kvplan.Pairing.by_layer_id(allow_positional_fallback=True)"),
    ((), {"allow_positional_fallback": False}, Pairing.by_layer_id(),
     "allow_positional_fallback= was removed: pass pairing=kvplan.Pairing.by_layer_id() "
     "(the default: leave it out)"),
    ((), {"prefill_start_layer": 1, "legacy_kind": "mla"},
     Pairing.by_layer_id(prefill_start_layer=1, legacy_kind="mla"),
     "prefill_start_layer=, legacy_kind= were removed: pass "
     "pairing=kvplan.Pairing.by_layer_id(prefill_start_layer=1, legacy_kind='mla')"),
    ((True,), {"prefill_start_layer": 0},
     Pairing.by_layer_id(True, prefill_start_layer=0),
     "a bool pairing (True), prefill_start_layer= were removed: pass "
     "pairing=kvplan.Pairing.by_layer_id(allow_positional_fallback=True, prefill_start_layer=0)"),
    ((), {"legacy_kind": "mha"}, Pairing.by_layer_id(legacy_kind="mha"),
     "legacy_kind= was removed: pass "
     "pairing=kvplan.Pairing.by_layer_id(legacy_kind='mha')"),
]

# Every call that takes Template's pairing argument, by the name its errors give.
PAIRING_CALLS = {"Template": Template, "ConversionTemplate": kvplan.ConversionTemplate,
                 "check_pairs": check_pairs, "compare": compare}


def _hint(message: str) -> str:
    """The ``kvplan.Pairing...`` expression a removed-spelling TypeError says to pass."""
    found = re.search(r"pass pairing=(kvplan\.Pairing\.\w+\([^)]*\))", message)
    assert found, message
    return found.group(1)


@pytest.mark.parametrize("args, kwargs, pairing, message", REMOVED_SPELLINGS)
def test_removed_spellings_are_type_errors_naming_the_pairing_to_pass(args, kwargs, pairing,
                                                                      message):
    a, b = _no_ids()
    for name, call in PAIRING_CALLS.items():
        with pytest.raises(TypeError) as raised:
            call(a, b, *args, **kwargs)
        assert str(raised.value) == f"{name}(): {message}"
        # The hint is a working spelling of what the removed one meant.
        assert eval(_hint(message), {"kvplan": kvplan}) == pairing


def test_the_pairing_value_does_not_warn():
    src, dst = _pp_stage()
    a, b = _no_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for pairing in [Pairing.by_layer_id(), Pairing.by_layer_id(True), Pairing.positional(),
                        Pairing.legacy("mla", prefill_start_layer=2)]:
            Template(src, dst, pairing)
            Template(src, dst, pairing=pairing)
            check_pairs(src, dst, pairing)
            compare(src, dst, pairing=pairing)
        Template(src, dst)
        compare(src, dst)
        check_pairs(a, b, Pairing.by_layer_id(prefill_start_layer=1, legacy_kind="mla"))
        choice = select_pairing("ascend", "mla", 2)
        choice.template(a, b, prefill_start_layer=1)
        choice.compare(a, b, prefill_start_layer=1)


def test_removed_spellings_raise_even_when_warnings_are_ignored():
    a, b = _no_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match="allow_positional_fallback= was removed"):
            Template(a, b, allow_positional_fallback=True)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match=r"a bool pairing \(True\) was removed"):
            compare(a, b, True)  # type: ignore[arg-type]


def test_a_bad_value_in_a_removed_keyword_is_refused_as_removed():
    a, b = _no_ids()
    with pytest.raises(TypeError) as raised:
        Template(a, b, prefill_start_layer=1, legacy_kind="gqa")  # type: ignore[call-arg]
    assert str(raised.value) == (
        "Template(): prefill_start_layer=, legacy_kind= were removed: pass "
        "pairing=kvplan.Pairing.by_layer_id(prefill_start_layer=1, legacy_kind='gqa')")
    # The value written as given, so the hint itself says what is wrong with it.
    with pytest.raises(KvPlanError, match='legacy kind must be "mla" or "mha", got "gqa"'):
        eval(_hint(str(raised.value)), {"kvplan": kvplan})
    with pytest.raises(TypeError, match=r"legacy_kind='gqa'\)"):
        compare(a, b, prefill_start_layer=1, legacy_kind="gqa")
    with pytest.raises(TypeError, match=r"pairing must be a kvplan.Pairing, got 1 of type int"):
        Template(a, b, 1)  # type: ignore[arg-type]


def _strip_page_ids(layout: Layout) -> Layout:
    """The layout without page-entry layer ids, built from its lists (what pairing that ignores
    page ids must be equivalent to)."""
    ids = [e.layer_id if e.kind == "state" else None for e in layout.entries()]
    return Layout(layout.data_ptrs, layout.data_lens, layout.item_lens,
                  ids if any(i is not None for i in ids) else None, layout.roles,
                  kinds=layout.kinds, drafts=layout.drafts, page_size=layout.page_size,
                  num_model_layers=layout.num_model_layers, pp_rank=layout.pp_rank,
                  pp_size=layout.pp_size)


def test_positional_and_legacy_ignore_page_ids_but_not_state_ids():
    src, dst = _pp_stage()
    src = src.with_state("mamba", [5000], [160], 16, [3])
    dst = dst.with_state("mamba", [6000, 7000], [160, 160], 16, [1, 3])
    # positional: fallback on layouts without page ids gives the same pairs
    t = Template(src, dst, Pairing.positional())
    old = Template(_strip_page_ids(src), _strip_page_ids(dst), Pairing.by_layer_id(True))
    assert t.pairs.tolist() == old.pairs.tolist() == [[0, 0], [1, 1], [2, 6]]
    assert t.state_pairs.tolist() == old.state_pairs.tolist() == [[3, 8]]
    # legacy: the same, from the stage's first layer
    t = Template(src, dst, Pairing.legacy("mla", prefill_start_layer=2))
    old = Template(_strip_page_ids(src), _strip_page_ids(dst),
                   Pairing.by_layer_id(prefill_start_layer=2, legacy_kind="mla"))
    assert t.pairs.tolist() == old.pairs.tolist() == [[0, 2], [1, 3], [2, 6]]
    assert t.state_pairs.tolist() == old.state_pairs.tolist() == [[3, 8]]
    # the report follows the pairing
    report = compare(src, dst, Pairing.legacy("mla", prefill_start_layer=2))
    assert report.compatible and report.pairs == ((0, 2), (1, 3), (2, 6), (3, 8))
    assert not compare(src, dst, pairing=Pairing.legacy(prefill_start_layer=5)).compatible


def test_select_pairing_returns_the_pairing():
    src, dst = _pp_stage()
    choice = select_pairing("ascend", "mla", 2)
    assert choice.pairing(2) == Pairing.legacy("mla", prefill_start_layer=2)
    with pytest.raises(KvPlanError, match="prefill_start_layer"):
        choice.pairing()
    assert select_pairing("mooncake", src).pairing() == Pairing.by_layer_id()
    assert select_pairing("ascend", "mla", 1).pairing(7) == Pairing.positional()
    assert (choice.template(src, dst, prefill_start_layer=2).pairs.tolist()
            == Template(src, dst, choice.pairing(2)).pairs.tolist())


def test_pairing_and_a_removed_keyword_together_are_a_type_error():
    src, dst = _pp_stage()
    p = Pairing.by_layer_id()
    for kw in ({"allow_positional_fallback": False}, {"prefill_start_layer": 0},
               {"legacy_kind": "mla"}):
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"Template\\(\\): {name}= was removed"):
            Template(src, dst, p, **kw)
        with pytest.raises(TypeError, match=f"compare\\(\\): {name}= was removed"):
            compare(src, dst, pairing=p, **kw)
        with pytest.raises(TypeError, match=f"check_pairs\\(\\): {name}= was removed"):
            check_pairs(src, dst, p, **kw)
    with pytest.raises(TypeError, match=r"a bool pairing \(True\), allow_positional_fallback= "
                       r"were removed: pass pairing=kvplan.Pairing.by_layer_id\("
                       r"allow_positional_fallback=True\)"):
        Template(src, dst, True, allow_positional_fallback=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kvplan.Pairing"):
        Template(src, dst, "positional")  # type: ignore[arg-type]


def test_other_unknown_keywords_are_type_errors_as_python_words_them():
    src, dst = _pp_stage()
    for name, call in PAIRING_CALLS.items():
        with pytest.raises(TypeError, match=f"^{name}\\(\\) got an unexpected keyword "
                           "argument 'allow_fallback'$"):
            call(src, dst, allow_fallback=True)


def test_entries_are_read_only_records():
    lay = Layout.mha([1, 2], [3, 4], [64] * 2, [128] * 2, 8, 16, [0, 1]).with_draft(
        [5, 6], [64, 64], 8, draft_layer_ids=[0, 0], num_hidden_layers=2,
        roles=["k", "v"]).with_state("conv", [9], [32], 16, [1])
    entries = lay.entries()
    assert [e.index for e in entries] == list(range(7))
    assert [e.role for e in entries] == ["k", "k", "v", "v", "draft_k", "draft_v", "conv"]
    assert [e.is_draft for e in entries] == [False] * 4 + [True, True, False]
    assert [e.index for e in lay.entries("state")] == [6]
    e = entries[2]
    assert (e.kind, e.layer_id, e.data_ptr, e.data_len, e.item_len, e.capacity) == (
        "page", 0, 3, 128, 16, 8)
    assert "role='v'" in repr(e)
    with pytest.raises(AttributeError):
        e.role = "k"  # type: ignore[misc]
    with pytest.raises(KvPlanError, match="unknown entry kind"):
        lay.entries("pages")


def test_not_published_is_none():
    lay = Layout([1, 2], [64, 64], 8, kinds=["page", "state"], roles=[None, "conv"],
                 layer_ids=[None, 4])
    assert lay.roles == [None, "conv"] and lay.layer_ids == [None, 4]
    assert [(e.layer_id, e.role) for e in lay.entries()] == [(None, None), (4, "conv")]
    assert Layout([1, 2], [64, 64], 8, kinds=["page", "state"], roles=["", "conv"]) == Layout(
        [1, 2], [64, 64], 8, kinds=["page", "state"], roles=[None, "conv"])


def test_draft_is_a_field_and_travels_on_the_wire():
    # A layout without roles: only the draft field says which entries are drafts.
    base = Layout([1], [64], 8, [0], num_model_layers=1)
    lay = base.with_draft([2], [64], 8, draft_layer_ids=[0], num_hidden_layers=1)
    assert lay.drafts == [False, True] and lay.roles is None
    assert Layout.from_bytes(lay.to_bytes()) == lay
    assert Layout.from_dict(lay.to_dict()) == lay
    # Raw lists: draft-ness follows the role unless given.
    assert Layout([1, 2], [64] * 2, 8, roles=["kv", "draft"]).drafts == [False, True]
    assert Layout([1, 2], [64] * 2, 8, roles=["kv", "draft"], drafts=[False, False]).drafts == [
        False, False]


def test_version_1_bytes_and_dicts_still_decode():
    lay = Layout.mla([8], [64], 8, [0]).with_draft([100], [64], 8, draft_layer_ids=[0],
                                                    num_hidden_layers=1)
    v2 = lay.to_bytes()
    assert v2[4:6] == (2).to_bytes(2, "little")
    # The same layout in version 1 (no strides, entry flags or extensions), written the way
    # earlier builds wrote it: draft-ness comes back from the roles.
    body = b"KVPL" + struct.pack("<HHI", 1, 0, lay.n_entries)
    body += struct.pack("<QQIIII", lay.page_size, 2**64 - 1, 0, 1, 0, 1)
    body += struct.pack("<H", 3) + b"cpu"
    for e in lay.entries():
        role = (e.role or "").encode()
        body += struct.pack("<QQQBBqH", e.data_ptr, e.data_len, e.item_len, 0, 1, e.layer_id,
                            len(role)) + role
    v1 = body + zlib.crc32(body).to_bytes(4, "little")
    assert Layout.from_bytes(v1) == lay
    d = lay.to_dict()
    assert d["version"] == 2
    del d["drafts"]
    d["version"] = 1
    assert Layout.from_dict(d) == lay
    assert kvplan.Layout.from_dict(d).drafts == [False, True]
