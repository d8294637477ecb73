"""Manifest fusions: one model, two presentations of its state.

Kimi-K3's preset names a KDA layer's state as four tensors (q, k and v short-convolution
states and the recurrent state); SGLang (and vLLM 0.32 to 0.34) keep the three conv states as
one tensor. The preset declares that presentation as data (``ModelPreset.fusions``,
:class:`kvplan.manifests.Fusion`), and :func:`kvplan.check_manifest` checks a layout against the
presentation it holds: either passes, a mix of both or a fused entry of the wrong size is
refused, and a missing tensor is named with the fused entry that would have held it."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from kvplan import Layout, ManifestError, check_manifest
from kvplan.manifests import Fusion, ModelManifest
from kvplan.presets import PRESETS, ModelPreset, StateSpec

PAGE = 128
K3 = PRESETS["kimi-k3"]
#: Kimi-K3 as SGLang holds it: Kimi-Linear's state specs (one ``mamba_conv`` tensor over
#: q | k | v, 73,728 bytes, and ``mamba_temporal``), the same MLA layers. The conv spec without
#: its declared parts, so that a test may change its sub-blocks.
FUSED_CONV, RECURRENT = PRESETS["kimi-linear"].state
FUSED_CONV = dataclasses.replace(FUSED_CONV, parts=())
K3_FUSED = dataclasses.replace(K3, state=(FUSED_CONV, RECURRENT))


def _layout(p: ModelPreset, **kw: Any) -> Layout:
    return p.layout(range(p.num_layers), page_size=PAGE, capacity=4, **kw)


def _problems(err: pytest.ExceptionInfo[ManifestError]) -> list[tuple[str, str, list[int]]]:
    return [(kind, role, list(layers)) for kind, role, layers, _, _ in err.value.problems]


def test_kimi_k3_declares_the_fused_presentation() -> None:
    m = K3.manifest()
    assert m.fusions == (Fusion("mamba_conv", ("kda_conv_q", "kda_conv_k", "kda_conv_v")),
                         Fusion("mamba_temporal", ("kda_recurrent",)))
    assert FUSED_CONV.bytes_per_slot == sum(s.bytes_per_slot for s in K3.state[:3])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_both_presentations_pass_at_every_tp(tp: int) -> None:
    """The preset's own layout (three conv tensors) and the fused one (one conv tensor) both
    hold the manifest, every rank's share checked (without the fusions the fused one was
    refused: four components missing, two unexpected)."""
    manifest = K3.manifest()
    for rank in {0, tp - 1}:
        check_manifest(_layout(K3, tp_rank=rank, tp_size=tp), manifest)
        check_manifest(_layout(K3_FUSED, tp_rank=rank, tp_size=tp), manifest)
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(K3_FUSED), dataclasses.replace(manifest, fusions=()))
    linear = K3.linear_layers()
    assert sorted(_problems(err)) == sorted(
        [("missing", r, linear) for r in ("kda_conv_q", "kda_conv_k", "kda_conv_v",
                                          "kda_recurrent")]
        + [("unexpected", r, linear) for r in ("mamba_conv", "mamba_temporal")])


def test_a_layout_holding_both_presentations_is_refused() -> None:
    """The fused conv entry and a part beside it: the part is unexpected (its bytes would be
    moved twice, or into the wrong tensor)."""
    both = dataclasses.replace(K3, state=(FUSED_CONV, RECURRENT, K3.state[0]))
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(both), K3.manifest())
    assert _problems(err) == [("unexpected", "kda_conv_q", K3.linear_layers())]


def test_a_fused_entry_of_the_wrong_size_is_refused_naming_it() -> None:
    """A conv tensor over q | k only (two thirds of the bytes) is not the three parts."""
    short = dataclasses.replace(FUSED_CONV, bytes_per_slot=2 * 24_576, channels=2 * 4096,
                                shard_groups=(4096, 4096))
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(dataclasses.replace(K3, state=(short, RECURRENT))),
                       K3.manifest())
    (kind, role, layers, expected, got), = err.value.problems
    assert (kind, role, expected, got) == ("item_size", "mamba_conv", 73_728, 49_152)
    assert list(layers) == K3.linear_layers()


@pytest.mark.parametrize("state, missing, note", [
    ((FUSED_CONV,), ["kda_recurrent"], "kda_recurrent may also be held as 'mamba_temporal'"),
    ((RECURRENT,), ["kda_conv_q", "kda_conv_k", "kda_conv_v"],
     "kda_conv_q, kda_conv_k, kda_conv_v may also be held as one 'mamba_conv' entry per layer"),
])
def test_a_fused_layout_missing_a_tensor_is_refused_naming_it(
        state: tuple[StateSpec, ...], missing: list[str], note: str) -> None:
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(dataclasses.replace(K3, state=state)), K3.manifest())
    linear = K3.linear_layers()
    assert _problems(err) == [("missing", role, linear) for role in missing]
    assert f"missing state component \"{missing[0]}\" on layers 0-2, 4-6" in str(err.value)
    assert note + ", of which this layout has none" in str(err.value)
    assert err.value.model == "Kimi-K3" and err.value.kind == "manifest"


def test_fusions_round_trip_through_json_and_bad_ones_are_refused() -> None:
    m = K3.manifest()
    data = json.loads(m.to_json())
    assert data["fusions"] == [
        {"role": "mamba_conv", "parts": ["kda_conv_q", "kda_conv_k", "kda_conv_v"]},
        {"role": "mamba_temporal", "parts": ["kda_recurrent"]}]
    assert ModelManifest.from_dict(data) == m
    assert "fusions" not in PRESETS["deepseek-v3"].manifest().to_dict()
    for fusions, named in [({"role": "x"}, "fusions must be a list"),
                           ([{"role": "x"}], "fusions[0]: missing 'parts'"),
                           ([{"role": "x", "parts": "ab"}], "parts must be a list"),
                           ([{"role": "x", "parts": []}], "one or more distinct part roles"),
                           ([{"role": "x", "parts": ["x"]}], "other than it"),
                           ([{"role": "x", "parts": ["a", "a"]}], "distinct"),
                           ([{"role": "x", "parts": ["a"], "y": 1}], "unknown key 'y'")]:
        with pytest.raises(ManifestError, match=re.escape(named)):
            ModelManifest.from_dict({**data, "fusions": fusions}, where="m.json")


def test_a_fusion_whose_parts_cannot_merge_is_refused_when_taken() -> None:
    """Parts of another sharding cannot be one entry: a layout holding the fused role is
    refused naming the parts and the field, not checked against a guessed component."""
    m = K3.manifest()
    odd = dataclasses.replace(m, fusions=(Fusion("mamba_conv", ("kda_conv_q", "kv")),))
    with pytest.raises(ManifestError, match="cannot pack kda_conv_q, kv into one 'mamba_conv'"):
        check_manifest(_layout(K3_FUSED), odd)
    # Not taken (the layout holds no mamba_conv): the parts are checked as they are.
    check_manifest(_layout(K3), odd)


def test_packed_and_without_keep_the_fusions() -> None:
    m = K3.manifest()
    assert m.without("kv").fusions == m.fusions
    assert m.packed("kda_conv", ("kda_conv_q", "kda_conv_k")).fusions == m.fusions
    renamed = m.packed("mamba_temporal", ("kda_recurrent",))
    assert [c.role for c in renamed.components if c.kind == "state"] == \
        ["kda_conv_q", "kda_conv_k", "kda_conv_v", "mamba_temporal"]


# ------------------------------------------------------------ Kimi-Linear: one conv or three
KL = PRESETS["kimi-linear"]
#: Kimi-Linear as a worker with three short-convolution tensors holds it: Kimi-K3's q, k and v
#: conv specs (24,576 bytes each at TP 1, 3 rows of 4096 channels), and the recurrent state.
KL_THREE = dataclasses.replace(KL, state=(*K3.state[:3], RECURRENT))


def test_kimi_linear_declares_its_conv_state_as_three_parts_and_their_fusion() -> None:
    """SGLang 0.5.23 (``KimiLinearStateShape.create``) and vLLM 0.32 to 0.34
    (``MambaStateShapeCalculator.kda_state_shape``) both keep one ``[K - 1, q | k | v]`` conv
    tensor: the preset's layouts hold that one, and its manifest declares the three parts and
    their fusion as Kimi-K3's does."""
    m = KL.manifest()
    assert m.fusions == (Fusion("mamba_conv", ("kda_conv_q", "kda_conv_k", "kda_conv_v")),)
    state = [(c.role, c.bytes, c.sharding) for c in m.components if c.kind == "state"]
    assert state == [("kda_conv_q", 24_576, "split"), ("kda_conv_k", 24_576, "split"),
                     ("kda_conv_v", 24_576, "split"), ("mamba_temporal", 2_097_152, "split")]
    assert [s.bytes_per_slot for s in K3.state[:3]] == [24_576] * 3
    assert ModelManifest.from_json(m.to_json()) == m
    assert KL.with_layers(27).manifest().fusions == m.fusions


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kimi_linear_worker_with_three_conv_tensors_holds_its_manifest(tp: int) -> None:
    """A worker holding q, k and v conv states as three tensors passes the ``kimi-linear``
    manifest at every rank, as the preset's own one-tensor layout does (it was refused: the
    manifest named one ``mamba_conv`` component, missing, and the three were unexpected)."""
    manifest = KL.manifest()
    for rank in {0, tp - 1}:
        check_manifest(_layout(KL_THREE, tp_rank=rank, tp_size=tp), manifest)
        check_manifest(_layout(KL, tp_rank=rank, tp_size=tp), manifest)
    # Without the fusion the one-tensor layout is the three parts missing, its tensor unexpected.
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(KL), dataclasses.replace(manifest, fusions=()))
    linear = KL.linear_layers()
    assert _problems(err) == [("missing", r, linear) for r in
                              ("kda_conv_q", "kda_conv_k", "kda_conv_v")] + [
        ("unexpected", "mamba_conv", linear)]


def test_kimi_linear_worker_with_two_of_three_conv_tensors_is_refused_naming_the_third() -> None:
    two = dataclasses.replace(KL, state=(K3.state[0], K3.state[2], RECURRENT))
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(two, tp_size=2), KL.manifest())
    assert _problems(err) == [("missing", "kda_conv_k", KL.linear_layers())]
    assert ("kda_conv_q, kda_conv_k, kda_conv_v may also be held as one 'mamba_conv' entry per "
            "layer, of which this layout has none") in str(err.value)
    assert err.value.model == KL.name and err.value.kind == "manifest"


def test_kimi_linear_worker_holding_the_conv_tensor_and_a_part_is_refused_naming_both() -> None:
    """The one conv tensor and the q part beside it: the part is unexpected, and the refusal
    says the layout holds both forms (its bytes would be moved twice, or into the wrong
    tensor)."""
    both = dataclasses.replace(KL, state=(*KL.state, K3.state[0]))
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(both), KL.manifest())
    assert _problems(err) == [("unexpected", "kda_conv_q", KL.linear_layers())]
    assert ("this layout holds kda_conv_q beside the one 'mamba_conv' entry that holds "
            "kda_conv_q, kda_conv_k, kda_conv_v: a layout holds either the one entry or its "
            "parts, never both") in str(err.value)


def test_state_parts_need_one_sub_block_each() -> None:
    with pytest.raises(ManifestError, match=r"parts \['a', 'b'\] need one sub-block each"):
        StateSpec("conv", 100, channels=10, shard_groups=(10,), parts=("a", "b"))


def test_packed_is_the_cores_merge() -> None:
    """``ModelManifest.packed`` converts what the core merges (the rule a fusion is taken by):
    components it does not change are the manifest's own objects."""
    m = K3.manifest()
    packed = m.packed("mamba_conv", ("kda_conv_q", "kda_conv_k", "kda_conv_v"))
    assert packed.components[0] is m.components[0]
    (conv,) = [c for c in packed.components if c.role == "mamba_conv"]
    assert (conv.bytes, conv.layers, conv.sharding) == (73_728, tuple(K3.linear_layers()),
                                                        "split")
    with pytest.raises(ManifestError, match="needs one or more distinct part roles"):
        m.packed("kv", ("k", "k"))
