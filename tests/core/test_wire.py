"""Layouts on the wire: exact round trips, and every malformed input is a KvPlanError."""

from __future__ import annotations

import json
import random
import zlib

import pytest

import kvplan


def sample_layouts() -> list[kvplan.Layout]:
    hybrid = kvplan.Layout.hybrid_linear(
        [3, 7], [0x1000, 0x2000], [4096, 4096], 64, page_size=64, pp_rank=1, pp_size=2
    ).with_state("mamba_conv", [0x9000, 0xA000], [640, 640], 64, [1, 2])
    npu = kvplan.Layout.npu_groups(
        [3, 7], [1, 2, 3, 4, 5, 6], [64] * 6, 8, group_roles=["k", "v", "index_k"], device="npu"
    )
    mha = kvplan.Layout.mha([1, 2], [3, 4], [64, 64], [128, 128], 8, 16, [0, 1], num_model_layers=2)
    draft = mha.with_draft([5, 6], [64, 64], 8, draft_layer_ids=[0, 0], num_hidden_layers=2)
    raw = kvplan.Layout([2**64 - 1 - 4096], [4096], 0)  # elided entry at the top of the space
    empty = kvplan.Layout([], [], [])
    return [hybrid, npu, mha, draft, raw, empty]


@pytest.mark.parametrize("layout", sample_layouts(), ids=repr)
def test_bytes_and_dict_round_trip_exactly(layout: kvplan.Layout) -> None:
    assert kvplan.Layout.from_bytes(layout.to_bytes()) == layout
    as_json = json.loads(json.dumps(layout.to_dict()))
    again = kvplan.Layout.from_dict(as_json)
    assert again == layout
    assert again.layer_ids == layout.layer_ids and again.roles == layout.roles
    assert again.kinds == layout.kinds and again.pp_rank == layout.pp_rank


@pytest.mark.parametrize("layout", sample_layouts(), ids=repr)
def test_every_truncation_and_extension_is_rejected(layout: kvplan.Layout) -> None:
    data = layout.to_bytes()
    for cut in range(len(data)):
        with pytest.raises(kvplan.KvPlanError):
            kvplan.Layout.from_bytes(data[:cut])
    with pytest.raises(kvplan.KvPlanError):
        kvplan.Layout.from_bytes(data + b"\x00")


def test_every_single_byte_corruption_is_rejected() -> None:
    data = bytearray(sample_layouts()[0].to_bytes())
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            corrupted = bytearray(data)
            corrupted[i] ^= bit
            with pytest.raises(kvplan.KvPlanError):
                kvplan.Layout.from_bytes(bytes(corrupted))


def test_random_bytes_never_crash() -> None:
    rng = random.Random(1234)
    valid = sample_layouts()[0].to_bytes()
    for i in range(5000):
        if i % 3 == 0:
            data = rng.randbytes(rng.randrange(0, 400))
        elif i % 3 == 1:  # a valid header followed by garbage gets past the magic check
            data = valid[:12] + rng.randbytes(rng.randrange(0, 400))
        else:  # a valid message with random bytes overwritten
            buf = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            data = bytes(buf)
        if data == valid:
            continue
        with pytest.raises(kvplan.KvPlanError):
            kvplan.Layout.from_bytes(data)


def test_oversized_counts_and_unknown_versions_have_clear_messages() -> None:
    data = bytearray(sample_layouts()[1].to_bytes())
    with pytest.raises(kvplan.KvPlanError, match="unknown layout wire version 9"):
        kvplan.Layout.from_bytes(bytes(data[:4] + b"\x09\x00" + data[6:]))
    # A well-formed message (valid checksum) that announces 2**32 - 1 entries.
    body = bytes(data[:8]) + (2**32 - 1).to_bytes(4, "little") + bytes(data[12:-4])
    huge = body + zlib.crc32(body).to_bytes(4, "little")
    with pytest.raises(kvplan.KvPlanError, match="4294967295 entries exceeds the limit"):
        kvplan.Layout.from_bytes(huge)
    body = bytes(data[:8]) + (1000).to_bytes(4, "little") + bytes(data[12:-4])
    with pytest.raises(kvplan.KvPlanError, match="1000 entries announced but only"):
        kvplan.Layout.from_bytes(body + zlib.crc32(body).to_bytes(4, "little"))
    with pytest.raises(kvplan.KvPlanError, match="bad magic"):
        kvplan.Layout.from_bytes(b"JSON" + bytes(data[4:]))


def test_from_dict_rejects_bad_documents() -> None:
    good = sample_layouts()[0].to_dict()
    with pytest.raises(kvplan.KvPlanError, match="version"):
        kvplan.Layout.from_dict({k: v for k, v in good.items() if k != "version"})
    with pytest.raises(kvplan.KvPlanError, match="unknown layout dict version 7"):
        kvplan.Layout.from_dict({**good, "version": 7})
    with pytest.raises(kvplan.KvPlanError, match="data_lens"):
        kvplan.Layout.from_dict({k: v for k, v in good.items() if k != "data_lens"})
    with pytest.raises(TypeError, match='unexpected keyword argument "colour"'):
        kvplan.Layout.from_dict({**good, "colour": "blue"})
    with pytest.raises(kvplan.LayoutError):
        kvplan.Layout.from_dict({**good, "item_lens": [64]})


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("version", "2", "field version must be an int in 0..2**16, got '2'"),
    ("data_ptrs", None, "field data_ptrs must be a list, each entry an int in 0..2**64, got None"),
    ("data_ptrs", [1, "0x10"], "field data_ptrs[1] must be an int in 0..2**64, got '0x10'"),
    ("data_lens", [True], "field data_lens[0] must be an int in 0..2**64, got True"),
    ("item_lens", [2**64], f"field item_lens[0] must be an int in 0..2**64, got {2**64}"),
    ("layer_ids", [2**63], f"field layer_ids[0] must be a 64-bit int or null, got {2**63}"),
    ("roles", [5], "field roles[0] must be a str or null, got 5"),
    ("kinds", "page", "field kinds must be a list, each entry a str, got 'page'"),
    ("drafts", [1], "field drafts[0] must be a bool, got 1"),
    ("page_size", True, "page_size must be an int in 0..2**64, got True"),
    ("pp_rank", "a" * 1000, "pp_rank must be an int in 0..2**32, got 'aaaa"),
])
def test_from_dict_names_the_bad_field_entry_and_value(field: str, value: object,
                                                       needle: str) -> None:
    """The bindings convert a layout document field by field: a bad value is one TypeError
    naming the field, the entry and the value (cut when long), whatever reads the document."""
    good = sample_layouts()[0].to_dict()
    n = len(good["data_ptrs"])
    if isinstance(value, list) and len(value) < n and field not in ("data_ptrs",):
        value = value + good[field][len(value):]
    with pytest.raises(TypeError) as info:
        kvplan.Layout.from_dict({**good, field: value})
    assert needle in str(info.value)
    assert len(str(info.value)) < 200


def test_a_repeated_attention_geometry_extension_is_refused() -> None:
    """Two 0x8001 extensions in the context used to decode (the last won) and re-encode to
    different bytes; a tag appears at most once per extension list."""
    layout = kvplan.Layout.mha([0x1000], [0x9000], [4096], [4096], 64, 64, [0], page_size=4,
                               tp_size=2, kv_heads=8, head_dim=2, dtype_size=2,
                               memory_order="NHD")
    body = layout.to_bytes()[:-4]
    at = body.index(b"\x01\x80\x11\x00")  # tag 0x8001, 17-byte payload
    count = int.from_bytes(body[at - 2:at], "little")
    assert count == 1
    other = kvplan.Layout.mha([0x1000], [0x9000], [4096], [4096], 64, 64, [0], page_size=4,
                              tp_size=2, kv_heads=16, head_dim=2, dtype_size=2,
                              memory_order="HND").to_bytes()
    ext = other[other.index(b"\x01\x80\x11\x00"):][:4 + 17]
    doubled = body[:at - 2] + (2).to_bytes(2, "little") + body[at:at + 21] + ext + body[at + 21:]
    with pytest.raises(kvplan.KvPlanError, match="extension 0x8001 twice"):
        kvplan.Layout.from_bytes(doubled + zlib.crc32(doubled).to_bytes(4, "little"))
