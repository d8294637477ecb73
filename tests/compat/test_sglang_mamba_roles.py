"""SGLang hybrid layouts name their Mamba state entries by what they hold.

SGLang 0.5.23's ``MambaPool`` publishes one ``StateType.MAMBA`` component: per state tensor
(its conv tensor, then its recurrent ``temporal`` tensor) one entry per Mamba layer, the conv
entries carrying the conv shard groups. kvplan's layout builder named every entry of component
``i`` ``mamba<i>``, so the hybrid presets' manifests (``mamba_conv``, ``mamba_temporal``) could
never match an SGLang layout: ``KVPLAN_MANIFEST=qwen3-next`` refused every SGLang worker at
start-up. Here the state lists are what SGLang's own ``MambaPool`` methods publish
(``support.sglang_mamba``: the wheel's code on host stand-in tensors) and SGLang's own
``append_state_component`` puts into ``KVArgs``; the page entries are what SGLang's
``HybridLinearKVPool`` registers (one buffer per full-attention layer; MHA: K then V, layer ids
twice).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest

import kvplan
from kvplan import ManifestError
from kvplan.compat.sglang.layouts import (
    layout_from_kv_args,
    layout_from_register_info,
    mamba_entry_roles,
    mamba_tensor_roles,
)
from kvplan.manifests import check_manifest
from kvplan.presets import get_preset
from support.sglang_mamba import hybrid_kv_args, kimi_linear_state_shape


@pytest.fixture(scope="module")
def sg() -> Any:
    from support.sglang_models import load_sglang_or_fail

    return load_sglang_or_fail()


CASES = [("qwen3-next", 1), ("qwen3-next", 2), ("kimi-linear", 1), ("kimi-linear", 2)]


@pytest.mark.parametrize("key, tp", CASES)
def test_sglang_hybrid_layout_holds_its_presets_manifest(sg: Any, key: str, tp: int) -> None:
    """Every rank's layout passes the preset's manifest: its conv entries are ``mamba_conv``,
    its recurrent ones ``mamba_temporal``, each on the linear layers (refused as missing
    ``mamba0``'s components while the entries were named by position)."""
    preset = get_preset(key)
    for rank in range(tp):
        kv = hybrid_kv_args(sg, preset, tp, rank)
        assert mamba_tensor_roles(kv, 0) == ["mamba_conv", "mamba_temporal"]
        layout = layout_from_kv_args(kv, is_mla_backend=preset.attention == "mla",
                                     attn_tp_size=tp)
        linear = preset.linear_layers()
        state = [(r, i) for r, i, k in zip(layout.roles, layout.layer_ids, layout.kinds)
                 if k == "state"]
        assert state == [("mamba_conv", i) for i in linear] + [("mamba_temporal", i)
                                                              for i in linear]
        check_manifest(layout, preset.manifest())


@pytest.mark.parametrize("key, tp", CASES)
def test_sglang_hybrid_layout_without_its_recurrent_state_names_it_missing(
        sg: Any, key: str, tp: int) -> None:
    """A pool whose recurrent tensors are gone (SGLang publishes no entry for an empty tensor)
    is refused naming ``mamba_temporal`` and the linear layers, and nothing else."""
    preset = get_preset(key)
    kv = hybrid_kv_args(sg, preset, tp, tp - 1, temporal=False)
    assert mamba_tensor_roles(kv, 0) == ["mamba_conv"]
    layout = layout_from_kv_args(kv, is_mla_backend=preset.attention == "mla", attn_tp_size=tp)
    with pytest.raises(ManifestError) as err:
        check_manifest(layout, preset.manifest())
    linear = preset.linear_layers()
    assert [p[:3] for p in err.value.problems] == [("missing", "mamba_temporal", linear)]
    assert "missing state component \"mamba_temporal\" on layers 0-2, 4-6" in str(err.value)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sglang_kda_worker_holds_the_kimi_k3_manifest(sg: Any, tp: int) -> None:
    """SGLang keeps a KDA layer's q, k and v conv states as one tensor (its own
    ``KimiLinearStateShape.create``: ``[K - 1, (q + k + v) / tp]``, shard groups q | k | v)
    beside the recurrent one; the ``kimi-k3`` preset names four tensors. Its manifest declares
    SGLang's presentation (``mamba_conv`` for the three conv states, ``mamba_temporal`` for the
    recurrent one), so every rank of an SGLang Kimi-K3 worker passes; without those fusions it
    was refused: the four components missing, both of SGLang's unexpected."""
    shape = kimi_linear_state_shape(sg, tp)
    assert [tuple(c) for c in shape.conv] == [(3, 3 * 4096 // tp)]
    assert list(shape.conv_shard_groups) == [4096] * 3 and shape.conv_slice_axis == 1
    preset = get_preset("kimi-k3")
    manifest = preset.manifest()
    linear = preset.linear_layers()
    for rank in range(tp):
        kv = hybrid_kv_args(sg, preset, tp, rank)
        layout = layout_from_kv_args(kv, is_mla_backend=True, attn_tp_size=tp)
        state = [(r, i) for r, i, k in zip(layout.roles, layout.layer_ids, layout.kinds)
                 if k == "state"]
        assert state == [("mamba_conv", i) for i in linear] + [("mamba_temporal", i)
                                                              for i in linear]
        check_manifest(layout, manifest)
    with pytest.raises(ManifestError) as err:
        check_manifest(layout, dataclasses.replace(manifest, fusions=()))
    assert {(p[0], p[1]) for p in err.value.problems} == {
        ("missing", "kda_conv_q"), ("missing", "kda_conv_k"), ("missing", "kda_conv_v"),
        ("missing", "kda_recurrent"), ("unexpected", "mamba_conv"),
        ("unexpected", "mamba_temporal")}


@pytest.mark.parametrize("drop, missing, unexpected, fused", [
    ("temporal", ["kda_recurrent"], [], "kda_recurrent may also be held as 'mamba_temporal'"),
    ("conv", ["kda_conv_q", "kda_conv_k", "kda_conv_v", "kda_recurrent"], ["mamba0"],
     "kda_conv_q, kda_conv_k, kda_conv_v may also be held as one 'mamba_conv' entry per layer")])
def test_sglang_kda_worker_missing_a_tensor_is_refused_naming_it(
        sg: Any, drop: str, missing: list[str], unexpected: list[str], fused: str) -> None:
    """An SGLang Kimi-K3 pool without one of its two tensors (SGLang publishes no entry for an
    empty one) is refused naming the manifest's components that tensor holds, on the KDA
    layers, and the fused entry that would have held them. Without its conv tensor the pool
    publishes no conv shard groups, so nothing tells the remaining tensor is the recurrent
    one: it keeps the positional ``mamba0`` (unexpected) and ``kda_recurrent`` is missing too,
    never guessed."""
    preset = get_preset("kimi-k3")
    kv = hybrid_kv_args(sg, preset, 2, 1, **{drop: False})
    layout = layout_from_kv_args(kv, is_mla_backend=True, attn_tp_size=2)
    with pytest.raises(ManifestError) as err:
        check_manifest(layout, preset.manifest())
    linear = preset.linear_layers()
    assert [p[:3] for p in err.value.problems] == \
        [("missing", role, linear) for role in missing] + \
        [("unexpected", role, linear) for role in unexpected]
    message = str(err.value)
    assert f"missing state component \"{missing[0]}\" on layers 0-2, 4-6" in message
    assert f"{fused}, of which this layout has none" in message
    assert err.value.kind == "manifest" and err.value.model == "Kimi-K3"


def test_sglang_pool_without_conv_shard_groups_keeps_positional_names(sg: Any) -> None:
    """Without conv shard groups SGLang publishes nothing that tells a conv tensor from the
    recurrent one (both get None): the entries keep the positional ``mamba0``, and the preset's
    manifest is refused naming both of its state components (not a guessed role)."""
    preset = get_preset("qwen3-next")
    kv = hybrid_kv_args(sg, preset, 1, 0, groups=False)
    assert mamba_tensor_roles(kv, 0) is None
    assert set(mamba_entry_roles(kv, 0)) == {"mamba0"}
    layout = layout_from_kv_args(kv, is_mla_backend=False, attn_tp_size=1)
    with pytest.raises(ManifestError) as err:
        check_manifest(layout, preset.manifest())
    kinds = {(p[0], p[1]) for p in err.value.problems}
    assert {("missing", "mamba_conv"), ("missing", "mamba_temporal")} <= kinds


def test_replicated_sibling_entries_keep_their_positional_name() -> None:
    """Entries SGLang marks replicated (``state_dim_per_tensor`` 0: a ShortConv or N-gram slot
    sibling after the pool's tensors) cannot be told apart by ``KVArgs``: ``mamba<i>``."""
    kv = types.SimpleNamespace(
        state_data_ptrs=[[1, 2, 3, 4, 5]], state_layer_ids=[[0, 2, 0, 2, 9]],
        state_dim_per_tensor=[[8, 8, 4, 4, 0]],
        state_conv_shard_groups=[[[4, 4], [4, 4], None, None, None]])
    assert mamba_tensor_roles(kv, 0) == ["mamba_conv", "mamba_temporal"]
    assert mamba_entry_roles(kv, 0) == ["mamba_conv", "mamba_conv", "mamba_temporal",
                                        "mamba_temporal", "mamba0"]
    kv.state_dim_per_tensor = [[8, 0, 4, 4, 0]]  # a replicated entry inside a sweep
    assert mamba_tensor_roles(kv, 0) is None


def test_decode_layout_takes_the_prefills_tensor_roles(sg: Any) -> None:
    """A decode's registration publishes no conv shard groups: ``layout_from_register_info``
    lays the prefill's tensor roles over the decode's own sweeps, so a prefill PP stage pairs
    its conv entries with the decode's conv entries and its recurrent ones with the decode's
    recurrent ones, layer by layer; without the prefill's roles the roles differ and the
    template is refused (never a conv slot written into a recurrent one)."""
    preset = get_preset("qwen3-next", 8)
    prefill = hybrid_kv_args(sg, preset, 1, 0, layers=range(4, 8))
    decode = hybrid_kv_args(sg, preset, 1, 0)
    prefill.page_size = 1  # the decode's registration says no page size (pages of 1)
    info = types.SimpleNamespace(
        dst_kv_ptrs=decode.kv_data_ptrs, dst_kv_item_lens=decode.kv_item_lens,
        dst_kv_layer_ids=decode.kv_layer_ids, dst_tp_rank=0, dst_attn_tp_size=1,
        dst_state_data_ptrs=[[p + (1 << 44) for p in decode.state_data_ptrs[0]]],
        dst_state_item_lens=decode.state_item_lens,
        dst_state_layer_ids=decode.state_layer_ids,
        dst_state_dim_per_tensor=decode.state_dim_per_tensor)
    src = layout_from_kv_args(prefill, is_mla_backend=False, pp_size=2)
    dst = layout_from_register_info(info, is_mla_backend=False, num_layers=2,
                                    state_types=prefill.state_types, state_roles_from=prefill)
    assert [r for r, k in zip(dst.roles, dst.kinds) if k == "state"] == \
        ["mamba_conv"] * 6 + ["mamba_temporal"] * 6
    t = kvplan.Template(src, dst)
    pairs = [(src.roles[i], src.layer_ids[i], dst.roles[j], dst.layer_ids[j])
             for i, j in t.state_pairs.tolist()]
    assert pairs == [(r, i, r, i) for r in ("mamba_conv", "mamba_temporal") for i in (4, 5, 6)]
    positional = layout_from_register_info(info, is_mla_backend=False, num_layers=2,
                                           state_types=prefill.state_types)
    assert {r for r, k in zip(positional.roles, positional.kinds) if k == "state"} == {"mamba0"}
    with pytest.raises(kvplan.KvPlanError, match="mamba_conv"):
        kvplan.Template(src, positional)
