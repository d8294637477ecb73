"""The address-free layout identity: ids that two processes compute alike, a golden id, the
encoding as docs/identity.md spells it (computed here independently, from the layout's public
accessors), the semantics' canonical forms and their typed errors."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import kvplan
from kvplan import Layout, LayoutError, ModelSemantics, layout_identity
from kvplan.identity import canonical_rope

SEMANTICS = ModelSemantics(model="org/model", revision="abc123",
                           rope={"type": "yarn", "factor": 1.0}, transfer="push")

#: Builds the same geometry at addresses that differ per process and per argument.
BUILD = textwrap.dedent("""
    import sys, kvplan
    def build(base, pages):
        item = 16 * 4 * 128 * 2
        mb = 1 << 24
        return kvplan.Layout.mha([base, base + mb], [base + 2 * mb, base + 3 * mb],
                                 [item * pages] * 2, [item * pages] * 2, item, item, [0, 1],
                                 page_size=16, tp_size=2, tp_rank=int(sys.argv[2]),
                                 num_model_layers=2, kv_heads=8, head_dim=128, dtype_size=2,
                                 memory_order="NHD")
    semantics = kvplan.ModelSemantics(model="org/model", revision="abc123",
                                      rope={"type": "yarn", "factor": 1.0}, transfer="push")
    identity = kvplan.layout_identity(build(id(object()) << 12, int(sys.argv[1])), semantics)
    print(identity.class_id, identity.layout_id)
""")


def _layout(base: int, pages: int, tp_rank: int = 0, memory_order: str = "NHD") -> Layout:
    item = 16 * 4 * 128 * 2
    mb = 1 << 24
    return Layout.mha([base, base + mb], [base + 2 * mb, base + 3 * mb], [item * pages] * 2,
                      [item * pages] * 2, item, item, [0, 1], page_size=16, tp_size=2,
                      tp_rank=tp_rank, num_model_layers=2, kv_heads=8, head_dim=128,
                      dtype_size=2, memory_order=memory_order)


def _other_process(pages: int, tp_rank: int) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", BUILD, str(pages), str(tp_rank)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    return out[0], out[1]


def test_two_processes_with_different_addresses_compute_the_same_ids() -> None:
    here = layout_identity(_layout(1 << 32, 64), SEMANTICS)
    class_id, layout_id = _other_process(100, 0)
    assert (here.class_id, here.layout_id) == (class_id, layout_id)
    # Another TP rank: the same class, another exact layout.
    rank1_class, rank1_layout = _other_process(64, 1)
    assert rank1_class == here.class_id and rank1_layout != here.layout_id


def test_golden_ids_pin_the_encoding() -> None:
    identity = layout_identity(_layout(1 << 32, 64), SEMANTICS)
    # The same layout and semantics as the core's golden test (rust/kvplan-core/tests/identity.rs).
    assert identity.class_id == "kvc1-wrkgjwcvqz5simecp4bsapd3c6x43ftot6jhcsmdgymtmmuuozma"
    assert identity.layout_id == "kvl1-2zy23qc5vzcwrxfyksrv4k2vaddq7ucs3tfhgrs2ty2cfbi2hkaa"
    assert len(identity.class_id) <= 64 and identity.class_id.isprintable()


# --- The encoding of docs/identity.md, written again from the document --------------------------

def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _opt(value: int | None) -> bytes:
    return _uvarint(0 if value is None else value + 1)


def _text(value: str) -> bytes:
    raw = value.encode()
    return _uvarint(len(raw)) + raw


def _b32(digest: bytes) -> str:
    return base64.b32encode(digest).decode().lower().rstrip("=")


def reference_ids(layout: Layout, s: ModelSemantics) -> tuple[bytes, str, str]:
    out = bytearray(b"KVID\x01")
    out += _uvarint(layout.page_size) + _opt(layout.num_model_layers)
    out += _uvarint(layout.tp_size) + _uvarint(layout.pp_size)
    out += _uvarint(layout.dcp_size) + _uvarint(layout.dcp_interleave)
    if layout.kv_heads is None:
        out += b"\x00"
    else:
        assert layout.heads_per_rank is not None and layout.head_dim is not None
        assert layout.dtype_size is not None
        out += b"\x01" + _uvarint(layout.kv_heads) + _uvarint(layout.heads_per_rank)
        out += _uvarint(layout.head_dim) + _uvarint(layout.dtype_size)
        out += b"\x00" if layout.memory_order == "NHD" else b"\x01"
    out += _uvarint(len(layout.pools))
    for _, page_size, tokens_per_row in layout.pools:
        out += _uvarint(page_size) + _uvarint(tokens_per_row)
    n = len(layout)
    layer_ids = layout.layer_ids or [None] * n
    roles = layout.roles or [None] * n
    shapes: list[bytes] = []
    indices = []
    for i in range(n):
        if layout.kinds[i] == "page":
            pool = layout.entry_pools[i]
            assert pool is not None
            shape = b"\x00" + _uvarint(pool) + _opt(layout.windows[i])
        elif layout.state_channels[i] is None:
            shape = b"\x01" + _opt(layout.rings[i])
        else:  # a state entry with a TP channel split
            channels, outer_rows, groups = layout.state_channels[i]
            shape = b"\x02" + _opt(layout.rings[i]) + _uvarint(channels) + _uvarint(outer_rows)
            shape += _uvarint(len(groups)) + b"".join(_uvarint(g) for g in groups)
        representation = layout.representations[i]
        shape += _text(roles[i] or "") + bytes([layout.drafts[i]]) + _uvarint(layout.item_lens[i])
        shape += _uvarint(layout.strides[i])
        shape += b"\x00" if representation is None else _text(representation)
        if shape not in shapes:
            shapes.append(shape)
        indices.append(shapes.index(shape))
    out += _uvarint(len(shapes)) + b"".join(shapes) + _uvarint(n)
    for index, layer in zip(indices, layer_ids):
        out += _uvarint(index)
        out += b"\x00" if layer is None else _uvarint(((layer << 1) ^ (layer >> 63)) + 1)
    out += _text(s.model) + _text(s.revision) + _text(canonical_rope(s.rope))
    drafts = sorted(set(s.drafts))
    out += _uvarint(len(drafts)) + b"".join(_text(d) for d in drafts)
    out += bytes([s.transfer == "pull", s.cross_layer])
    class_digest = hashlib.sha256(bytes(out)).digest()
    ranks = _uvarint(layout.tp_rank) + _uvarint(layout.pp_rank) + _uvarint(layout.dcp_rank)
    layout_digest = hashlib.sha256(class_digest + ranks).digest()
    return bytes(out), "kvc1-" + _b32(class_digest), "kvl1-" + _b32(layout_digest)


def _layouts() -> list[tuple[str, Layout]]:
    from kvplan.presets import PRESETS
    from kvplan.testing.fixtures import fixtures
    out = [(f.name, layout) for f in fixtures() for layout in f.layouts()[0]]
    for name, preset in PRESETS.items():
        layers = range(preset.num_layers // 2)
        out.append((name, preset.layout(layers, page_size=16, capacity=8, pp_size=2)))
        try:
            out.append((f"{name} cross-layer HND", preset.layout(
                layers, page_size=16, capacity=8, cross_layer=preset.attention != "mla",
                memory_order="HND", tp_size=2, tp_rank=1)))
        except kvplan.KvPlanError:
            pass  # multi-component presets publish no attention geometry
    base = _layout(1 << 32, 8)
    out.append(("windows+rings+draft", base.with_windows([None, 64, None, 64])
                .with_state("mamba_conv", [1 << 44], [4096], 512, [1]).with_rings([None] * 4 + [4])
                .with_draft([1 << 45], [1 << 20], 32768, draft_layer_ids=[2],
                            num_hidden_layers=2)))
    out.append(("negative layer id", Layout([1 << 20], [4096], 512, [-3], ["kv"], page_size=4)))
    out.append(("unpublished", Layout([1 << 20, 1 << 21], [4096, 4096], 512)))
    return out


@pytest.mark.parametrize("semantics", [
    SEMANTICS,
    ModelSemantics(),
    ModelSemantics(model="m", drafts=("b", "a", "b"), transfer="pull", cross_layer=True,
                   rope='{"factor":2}'),
])
def test_the_documented_encoding_gives_the_core_s_ids(semantics: ModelSemantics) -> None:
    layouts = _layouts()
    assert len(layouts) >= 12
    for name, layout in layouts:
        encoding, class_id, layout_id = reference_ids(layout, semantics)
        identity = layout_identity(layout, semantics)
        assert identity.class_encoding() == encoding, name
        assert (identity.class_id, identity.layout_id) == (class_id, layout_id), name


def test_fields_outside_the_identity_do_not_change_it_and_fields_inside_do() -> None:
    a = layout_identity(_layout(1 << 32, 64), SEMANTICS)
    assert a == layout_identity(_layout(1 << 40, 7), SEMANTICS)
    changed = [
        layout_identity(_layout(1 << 32, 64, memory_order="HND"), SEMANTICS),
        layout_identity(_layout(1 << 32, 64), dataclasses.replace(SEMANTICS, revision="def")),
        layout_identity(_layout(1 << 32, 64).with_representations(["bf16"] * 4), SEMANTICS),
    ]
    assert len({a.class_id, *(c.class_id for c in changed)}) == 4


def test_rope_mappings_are_written_canonically() -> None:
    assert canonical_rope({"type": "yarn", "factor": 1.0}) == '{"factor":1,"type":"yarn"}'
    assert canonical_rope({"factor": 1, "type": "yarn"}) == canonical_rope(
        {"type": "yarn", "factor": 1.0})
    assert canonical_rope({"f": 0.25, "l": [1.0, 2.5], "ok": True, "n": None}) == \
        '{"f":0.25,"l":[1,2.5],"n":null,"ok":true}'
    assert canonical_rope(None) == "" and canonical_rope("rope=yarn") == "rope=yarn"
    assert layout_identity(_layout(1, 8), SEMANTICS).rope == '{"factor":1,"type":"yarn"}'


@pytest.mark.parametrize("kwargs,match", [
    (dict(transfer="pish"), r'transfer mode "pish"; expected "push" or "pull"'),
    (dict(model=3), r"model is 3 of type int; expected str"),
    (dict(revision=None), r"revision is None of type NoneType"),
    (dict(drafts="eagle"), r"drafts is 'eagle'; expected a sequence of str"),
    (dict(cross_layer=1), r"cross_layer is 1 of type int; expected bool"),
    (dict(rope={"factor": float("nan")}), r"RoPE configuration rope\['factor'\] is nan"),
    (dict(rope={1: 2}), r"has key 1 of type int; expected str keys"),
    (dict(rope=2.0), r"RoPE configuration is 2.0 of type float"),
    (dict(rope={"f": object()}), r"rope\['f'\] is <object object"),
])
def test_bad_semantics_raise_a_layout_error_naming_the_value(kwargs: dict[str, Any],
                                                            match: str) -> None:
    with pytest.raises(LayoutError, match=match) as err:
        layout_identity(_layout(1, 8), ModelSemantics(**kwargs))
    assert isinstance(err.value, kvplan.KvPlanError)


def test_semantics_must_be_model_semantics() -> None:
    with pytest.raises(LayoutError, match="expected a kvplan.ModelSemantics, got dict"):
        layout_identity(_layout(1, 8), {"model": "m"})  # type: ignore[arg-type]
