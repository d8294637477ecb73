"""Model manifests: every preset's own layouts hold their manifest at PP 1..4 and TP 1..8, and a
layout missing any one component (a state pool, an indexer, the window entries, one layer), with
a wrong item size, or of another model is refused naming exactly that (ManifestError)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

import kvplan
from kvplan import Layout, ManifestError, ModelManifest, Template, check_manifest
from kvplan.presets import PRESETS, ModelPreset, split_layers

PAGE = 128  # a multiple of every preset's row (DeepSeek-V4: 4 and 128 tokens)


def _layout(p: ModelPreset, layers: range | list[int], **kw: Any) -> Layout:
    return p.layout(layers, page_size=PAGE, capacity=4, **kw)


def _drop(layout: Layout, keep: Callable[[int, str, str], bool]) -> Layout:
    """``layout`` without the entries ``keep(layer, role, kind)`` refuses (as an engine that
    never registered them would publish it)."""
    d: dict[str, Any] = layout.to_dict()
    n = len(d["item_lens"])
    kept = [i for i in range(n) if keep(d["layer_ids"][i], d["roles"][i], d["kinds"][i])]
    for key, value in list(d.items()):
        if isinstance(value, list) and len(value) == n and key != "pools":
            d[key] = [value[i] for i in kept]
    if d.get("pools"):
        where = {old: new for new, old in enumerate(kept)}
        pools = [[size, rows, [where[i] for i in entries if i in where]]
                 for size, rows, entries in d["pools"]]
        d["pools"] = [pool for pool in pools if pool[2]]
    return Layout.from_dict(d)


def _problems(err: pytest.ExceptionInfo[ManifestError]) -> list[tuple[str, str, list[int]]]:
    return [(kind, role, list(layers)) for kind, role, layers, _, _ in err.value.problems]


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_every_preset_layout_holds_its_manifest(key: str) -> None:
    p = PRESETS[key]
    manifest = p.manifest()
    multi = bool(p.layer_components())
    for pp in range(1, 5):
        for tp in (1, 2, 4, 8):
            for s, stage in enumerate(split_layers(p.num_layers, pp)):
                for rank in {0, tp - 1}:
                    kw: dict[str, Any] = {"pp_rank": s, "pp_size": pp, "tp_rank": rank,
                                          "tp_size": tp}
                    if multi and tp > 1:
                        # Multi-component presets build TP 1 layouts only (the preset says so).
                        with pytest.raises(kvplan.KvPlanError):
                            _layout(p, stage, **kw)
                        continue
                    check_manifest(_layout(p, stage, **kw), manifest, stage=stage)
    if not multi:
        check_manifest(_layout(p, range(p.num_layers), cross_layer=True), manifest)


def test_kimi_k3_declares_24_mla_and_69_kda_layers_with_4_states() -> None:
    m = PRESETS["kimi-k3"].manifest()
    by_role = {c.role: c for c in m.components}
    assert len(by_role["kv"].layers) == 24 and by_role["kv"].kind == "page"
    states = [c for c in m.components if c.kind == "state"]
    assert [c.role for c in states] == ["kda_conv_q", "kda_conv_k", "kda_conv_v",
                                        "kda_recurrent"]
    assert all(len(c.layers) == 69 for c in states)
    assert sorted(by_role["kv"].layers + states[0].layers) == list(range(93))


def test_state_pool_never_registered_is_refused_though_pairing_passes() -> None:
    """The deployment that carried only the MLA half: both peers lack the state pool, so the
    template pairs every entry; the manifest names the four missing state tensors."""
    p = PRESETS["kimi-k3"]
    half = dataclasses.replace(p, state=())
    src = _layout(half, range(93))
    dst = half.layout(range(93), page_size=PAGE, capacity=4, base=0x9000_0000_0000)
    Template(src, dst)  # pairing alone sees nothing wrong
    with pytest.raises(ManifestError) as err:
        check_manifest(src, p.manifest())
    linear = p.linear_layers()
    assert _problems(err) == [("missing", role, linear) for role in
                              ("kda_conv_q", "kda_conv_k", "kda_conv_v", "kda_recurrent")]
    assert err.value.model == "Kimi-K3" and err.value.kind == "manifest"
    assert isinstance(err.value, kvplan.LayoutError)
    assert 'missing state component "kda_conv_q" on layers 0-2, 4-6' in str(err.value)


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_dropping_any_one_component_is_refused_naming_it(key: str) -> None:
    p = PRESETS[key]
    full = _layout(p, range(p.num_layers))
    manifest = p.manifest()
    # Each entry the layout holds: a fusion's entry (Kimi-Linear's one conv state over its q, k
    # and v parts) stands for its parts, and dropping it leaves each part missing.
    fused = {f.role: f.parts for f in manifest.fusions if f.role in (full.roles or ())}
    held = manifest
    for role, parts in fused.items():
        held = held.packed(role, parts)
    for c in held.components:
        window = c.window

        def keep(layer: int, role: str, kind: str, c: Any = c, window: Any = window) -> bool:
            return not (role == c.role and kind == c.kind and layer in c.layers)

        with pytest.raises(ManifestError) as err:
            check_manifest(_drop(full, keep), manifest)
        assert _problems(err) == [("missing", r, sorted(c.layers))
                                  for r in fused.get(c.role, (c.role,))], (key, c, window)


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_one_missing_layer_is_refused_naming_it(key: str) -> None:
    p = PRESETS[key]
    manifest = p.manifest()
    layer = p.kv_layers()[len(p.kv_layers()) // 2]
    with pytest.raises(ManifestError) as err:
        check_manifest(_drop(_layout(p, range(p.num_layers)),
                             lambda i, role, kind: i != layer), manifest)
    holding = sorted({c.role for c in manifest.components if layer in c.layers})
    assert sorted(role for kind, role, layers in _problems(err)) == holding
    assert all(kind == "missing" and layers == [layer] for kind, _, layers in _problems(err))


def test_gpt_oss_window_entries_dropped_or_unwindowed_are_refused() -> None:
    p = PRESETS["gpt-oss-120b"]
    manifest, full = p.manifest(), _layout(p, range(36))
    with pytest.raises(ManifestError) as err:
        check_manifest(_drop(full, lambda i, role, kind: i % 2 == 1), manifest)
    assert _problems(err) == [("missing", "k", list(range(0, 36, 2))),
                              ("missing", "v", list(range(0, 36, 2)))]
    assert "on layers 0-34 step 2" in str(err.value)
    # Every layer full attention: the window layers would move every token's bytes.
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(dataclasses.replace(p, sliding_window=0), range(36)), manifest)
    assert {(kind, role) for kind, role, _ in _problems(err)} == {("window", "k"), ("window", "v")}
    assert "window none, the manifest gives 128" in str(err.value)


def test_glm5_indexer_missing_is_refused() -> None:
    p = PRESETS["glm-5"]
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(dataclasses.replace(p, indexer_bytes_per_token=0), range(78)),
                       p.manifest())
    assert _problems(err) == [("missing", "indexer", list(range(78)))]


def test_wrong_item_size_is_refused_naming_both_values() -> None:
    p = PRESETS["kimi-k3"]
    small = dataclasses.replace(p, state=(*p.state[:3], kvplan.presets.StateSpec(
        "kda_recurrent", 1_048_576)))
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(small, range(93)), p.manifest())
    (kind, role, layers, expected, got), = err.value.problems
    assert (kind, role, expected, got) == ("item_size", "kda_recurrent", 2_097_152, 1_048_576)
    assert list(layers) == p.linear_layers()
    assert "item_len 1048576 bytes, the manifest gives 2097152" in str(err.value)


def test_tp_shares_are_checked() -> None:
    """A TP 4 rank of gpt-oss holds 2 of 8 heads; a layout claiming TP 4 but holding all heads
    is refused with the per-rank size."""
    p = PRESETS["gpt-oss-120b"]
    d: dict[str, Any] = _layout(p, range(36)).to_dict()
    d["tp_size"], d["tp_rank"] = 4, 1
    with pytest.raises(ManifestError) as err:
        check_manifest(Layout.from_dict(d), p.manifest())
    sizes = {(role, expected, got) for kind, role, _, expected, got in err.value.problems}
    assert sizes == {("k", 2 * 64 * 2 * PAGE, 8 * 64 * 2 * PAGE),
                     ("v", 2 * 64 * 2 * PAGE, 8 * 64 * 2 * PAGE)}
    assert "2 of 8 heads at TP 4" in str(err.value)


@pytest.mark.parametrize(("layout_key", "manifest_key"), [
    ("kimi-linear", "kimi-k3"), ("deepseek-v3", "deepseek-v3.2"), ("qwen3-next", "kimi-linear"),
    ("deepseek-v3.2", "glm-5")])
def test_manifest_of_another_model_is_refused(layout_key: str, manifest_key: str) -> None:
    lp, mp = PRESETS[layout_key], PRESETS[manifest_key]
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(lp, range(lp.num_layers)), mp.manifest())
    assert err.value.model == mp.name
    kinds = {kind for kind, *_ in err.value.problems}
    assert kinds & {"missing", "unexpected", "model_layers"}


def test_pp_stage_needs_its_range_and_is_checked_within_it() -> None:
    p = PRESETS["kimi-k3"]
    stages = split_layers(93, 3)
    layout = _layout(p, stages[1], pp_rank=1, pp_size=3)
    with pytest.raises(ManifestError) as err:
        check_manifest(layout, p.manifest())
    assert _problems(err) == [("stage_range", "", [])]
    check_manifest(layout, p.manifest(), stage=(stages[1].start, stages[1].stop))
    # The stage's last layer missing: a range inferred from the entries would not see it.
    last = stages[1][-1]
    with pytest.raises(ManifestError) as err:
        check_manifest(_drop(layout, lambda i, role, kind: i != last), p.manifest(),
                       stage=stages[1])
    assert all(layers == [last] for _, _, layers in _problems(err))


def test_manifest_without_helper_and_malformed_manifests() -> None:
    p = PRESETS["glm-5"]
    m = p.manifest().without("indexer", [5])
    with pytest.raises(ManifestError) as err:
        check_manifest(_layout(p, range(78)), m)
    assert _problems(err) == [("unexpected", "indexer", [5])]
    bad = ModelManifest("x", 2, (kvplan.ManifestComponent("kv", "page", (0, 5), 0),))
    with pytest.raises(ManifestError, match="bytes must be at least 1.*outside the model"):
        check_manifest(_layout(p, range(78)), bad)
    with pytest.raises(ManifestError, match="kind must be"):
        kvplan.ManifestComponent("kv", "slot", (0,), 1)  # type: ignore[arg-type]
    with pytest.raises(ManifestError, match="expected a kvplan.ModelManifest"):
        check_manifest(_layout(p, range(78)), "glm-5")  # type: ignore[arg-type]
