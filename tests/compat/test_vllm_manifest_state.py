"""A hybrid model's state checked against its manifest at a vLLM worker's start-up
(docs/manifests.md, "Checked at start-up"; docs/vllm.md).

vLLM keeps a Mamba-style layer (Mamba2, GDN as in Qwen3-Next, KDA as in Kimi-Linear and
Kimi-K3) as one ``MambaSpec`` page per block holding every state tensor of the layer. Here
``KvplanMooncakeConnector`` is built by vLLM's real constructor with ``kvplan_manifest`` set and
a KV cache config of two groups (the attention layers', the state layers'), and its worker's
``register_kv_caches`` is vLLM's real method run on host tensors; the state layers' specs are
vLLM's ``MambaSpec`` from the wheel, their shapes computed by vLLM's own
``MambaStateShapeCalculator`` (its source executed alone) for the preset's model config, and the
attention block size raised and the state page padded to it as vLLM's hybrid allocator does.

* a worker holding the attention and state regions starts with the preset's manifest (the
  manifest checked with every state component packed into one entry per layer); it was refused
  before (a ``MambaSpec`` region had no role);
* a worker whose state pool was never registered is refused naming the missing components;
* a state of another size (Qwen3-Next's recurrent state at vLLM's default dtype, the model's
  bf16, against the preset's fp32) is refused naming the layers and both sizes;
* a state block too small for its spec's states is refused naming the layer.

The cases run again under vLLM 0.34.0 and 0.32.0's CPU build (``MambaSpec`` and the shape
helpers used are the same there but for 0.34's ``state_alignment``, 1 by default) in the child
per release of tests/compat/test_other_releases.py.
"""

from __future__ import annotations

import __future__
import ast
import functools
import logging
import os
import sys
import types
from typing import Any

import pytest

from kvplan import ManifestError
from kvplan.presets import PRESETS
from support.log_records import records
from support.vllm_loader import ALL_TESTS, OTHER_RELEASES

BLOCKS = 8
BF16 = types.SimpleNamespace(itemsize=2, name="bfloat16")  # what the specs read of a dtype
FP32 = types.SimpleNamespace(itemsize=4, name="float32")


@pytest.fixture(scope="module")
def v() -> Any:
    from support.vllm_loader import load_vllm

    return load_vllm()


@pytest.fixture
def dtype_size(v: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``get_dtype_size`` (``torch.tensor([], dtype=d).element_size()``) for the dtypes
    above, where ``MambaSpec.page_size_bytes`` reads it (torch is not installed here)."""
    monkeypatch.setattr(v.kvi, "get_dtype_size", lambda dtype: dtype.itemsize)


def wheel_source(v: Any, relative: str, name: str, **names: Any) -> Any:
    """One module-level function or class of the wheel, its source executed alone with
    ``names`` as its globals (annotations left unevaluated)."""
    path = os.path.join(v.root, relative)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    node = next(n for n in tree.body
                if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    code = compile(ast.Module([node], []), path, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, names)  # noqa: S102
    return names[name]


def shape_calculator(v: Any) -> Any:
    """vLLM's ``MambaStateShapeCalculator``, its conv states in vLLM's default layout (``SD``,
    ``VLLM_SSM_CONV_STATE_LAYOUT`` unset: ``(state_len, dim)``)."""
    mamba_utils = os.path.join("model_executor", "layers", "mamba", "mamba_utils.py")
    divide = wheel_source(v, os.path.join("distributed", "utils.py"), "divide",
                          ensure_divisibility=wheel_source(
                              v, os.path.join("distributed", "utils.py"),
                              "ensure_divisibility"))
    layout = wheel_source(v, mamba_utils, "get_conv_state_layout", functools=functools,
                          envs=sys.modules["vllm.envs"],
                          logger=logging.getLogger("vllm.test"))
    dim_first = wheel_source(v, mamba_utils, "is_conv_state_dim_first",
                             get_conv_state_layout=getattr(layout, "__wrapped__", layout))
    return wheel_source(v, mamba_utils, "MambaStateShapeCalculator", divide=divide,
                        is_conv_state_dim_first=dim_first)


def model_states(v: Any, key: str, tp: int, *, ssm_dtype: Any = None
                 ) -> tuple[tuple[tuple[int, ...], ...], tuple[Any, ...]]:
    """A state layer's shapes, by vLLM's calculator for the preset's model config at TP
    ``tp``, and its dtypes (vLLM's ``MambaStateDtypeCalculator`` for a bf16 model: the conv
    state in the model's dtype; GDN's recurrent state in ``mamba_ssm_cache_dtype`` (by default
    the conv state's), KDA's fp32 by default)."""
    calc = shape_calculator(v)
    if key == "qwen3-next":  # Qwen3-Next-80B-A3B's linear attention (GDN)
        shapes = calc.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4)
        return shapes, (BF16, ssm_dtype or BF16)
    # Kimi-Linear / Kimi-K3's KDA: 32 heads of 128, a 4-tap short convolution
    shapes = calc.kda_state_shape(tp, num_heads=32, head_dim=128, conv_kernel_size=4)
    return shapes, (BF16, ssm_dtype or FP32)


def hybrid_worker(v: Any, key: str, *, tp: tuple[int, int] = (0, 1), layers: int = 4,
                  states: bool = True, ssm_dtype: Any = None) -> tuple[Any, dict[str, Any]]:
    """A kvplan Mooncake connector for preset ``key`` on ``layers`` layers (the preset's
    attention layers an attention group, its linear layers a ``MambaSpec`` group) at TP rank
    ``tp[0]`` of ``tp[1]``, and the caches its ``register_kv_caches`` gets (none for the state
    layers where ``states`` is False: the state pool never registered). vLLM's hybrid
    allocator's page: the attention block size raised to a multiple of 16 tokens whose page
    holds the state, the state page padded to it."""
    from support.vllm_cases import HostKVCache, vllm_config, worker_dependencies

    from kvplan.compat import vllm as compat

    kvi = v.kvi
    preset = PRESETS[key].with_layers(layers)
    mla = preset.attention == "mla"
    linear = set(preset.linear_layers())
    shapes, dtypes = model_states(v, key, tp[1], ssm_dtype=ssm_dtype)
    state = sum(_count(s) * d.itemsize for s, d in zip(shapes, dtypes))
    heads = 1 if mla else max(1, 2 // tp[1])  # Qwen3-Next: 2 KV heads of 256
    per_token = 1152 if mla else heads * 2 * 256 * 2
    block = -(-state // (per_token * 16)) * 16
    page = block * per_token
    attn_names = [f"model.layers.{i}.self_attn.attn" for i in range(layers) if i not in linear]
    state_names = [f"model.layers.{i}.linear_attn" for i in sorted(linear)]
    if mla:
        attn = kvi.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576,
                                    dtype=None, state_content_bytes=1152)
    else:
        attn = kvi.FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=256,
                                     dtype=None, state_content_bytes=2 * 256 * 2)
    mamba = kvi.MambaSpec(block_size=block, shapes=tuple(shapes), dtypes=dtypes,
                          page_size_padded=page)
    kv_config = kvi.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(attn_names, attn), kvi.KVCacheGroupSpec(state_names, mamba)])
    base = vllm_config("kv_consumer", block_size=block, use_mla=mla, total_kv_heads=2)
    base.kv_transfer_config.kv_connector_extra_config["kvplan_manifest"] = f"{key}:{layers}"
    with worker_dependencies(v, get_tensor_model_parallel_rank=lambda: tp[0],
                             get_tensor_model_parallel_world_size=lambda: tp[1]):
        connector = compat.KvplanMooncakeConnector(base, v.KVConnectorRole.WORKER, kv_config)
    caches: dict[str, Any] = {}
    for k, name in enumerate(attn_names):
        cells = (BLOCKS, block, 576) if mla else (BLOCKS, block, heads, 2 * 256)
        caches[name] = HostKVCache((1 << 36) * (k + 1), cells)
    if states:
        for k, name in enumerate(state_names):  # one raw page per block: every state in it
            caches[name] = HostKVCache((1 << 44) + (1 << 36) * k, (BLOCKS, page), size=1)
    return connector, caches


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def register(v: Any, connector: Any, caches: dict[str, Any], tp: tuple[int, int] = (0, 1)
             ) -> None:
    """vLLM's ``register_kv_caches`` with vLLM's own ``extract_layer_index`` and
    ``is_non_overlapping_and_dense``."""
    from support.vllm_cases import worker_dependencies

    extract = wheel_source(v, os.path.join("model_executor", "models", "utils.py"),
                           "extract_layer_index")
    dense = wheel_source(v, os.path.join("utils", "torch_utils.py"),
                         "is_non_overlapping_and_dense")
    with worker_dependencies(v, extract_layer_index=extract, is_non_overlapping_and_dense=dense,
                             get_tensor_model_parallel_rank=lambda: tp[0],
                             get_tensor_model_parallel_world_size=lambda: tp[1]):
        connector.register_kv_caches(caches)


@pytest.mark.usefixtures("dtype_size")
@pytest.mark.parametrize("key, tp", [("qwen3-next", (0, 1)), ("qwen3-next", (1, 2)),
                                     ("kimi-linear", (0, 1)), ("kimi-linear", (1, 2)),
                                     ("kimi-k3", (0, 1))],
                         ids=["qwen3-next-tp1", "qwen3-next-tp2-rank1", "kimi-linear-tp1",
                              "kimi-linear-tp2-rank1", "kimi-k3-tp1"])
def test_hybrid_worker_holding_its_state_starts_with_the_preset(
        v: Any, key: str, tp: tuple[int, int]) -> None:
    """Attention and state regions as vLLM registers them pass the preset's manifest: each
    state page is one entry of every state component of its layer, packed (Qwen3-Next at
    ``--mamba-ssm-cache-dtype float32``, the preset's recurrent dtype; KDA's recurrent state
    is fp32 by default). Before, the worker refused to start (a ``MambaSpec`` region had no
    role)."""
    connector, caches = hybrid_worker(v, key, tp=tp, ssm_dtype=FP32)
    with records("vllm.kvplan.manifest") as said:
        register(v, connector, caches, tp)
    worker = connector.connector_worker
    assert sorted(worker.registered_layer_indices) == [0, 1, 2, 3]  # vLLM's own method ran
    pages = [(worker._layer_specs[n], n_bytes) for n, n_bytes in zip(
        worker.registered_layer_names, worker.kv_block_len_per_layer) if "linear_attn" in n]
    assert len(pages) == 3 and all(  # the page padded past the states, as vLLM pads it
        n_bytes == spec.page_size_bytes > spec.real_page_size_bytes for spec, n_bytes in pages)
    held = [r.getMessage() for r in said if "holds every component" in r.getMessage()]
    assert len(held) == 1 and PRESETS[key].manifest().model in held[0], held
    assert f"TP rank {tp[0]} of {tp[1]}" in held[0]
    worker.shutdown()


@pytest.mark.usefixtures("dtype_size")
@pytest.mark.parametrize("key, missing", [
    ("qwen3-next", ["mamba_conv", "mamba_temporal"]),
    ("kimi-k3", ["kda_conv_q", "kda_conv_k", "kda_conv_v", "kda_recurrent"]),
])
def test_hybrid_worker_without_its_state_pool_refuses_naming_the_components(
        v: Any, key: str, missing: list[str]) -> None:
    """The state pool never registered: only the attention regions. The worker refuses to
    start naming each missing state component on the linear layers, once at ERROR."""
    connector, caches = hybrid_worker(v, key, states=False, ssm_dtype=FP32)
    with records("vllm.kvplan.manifest") as said, pytest.raises(ManifestError) as err:
        register(v, connector, caches)
    assert [p[:3] for p in err.value.problems] == [
        ("missing", role, [0, 1, 2]) for role in missing], err.value.problems
    message = str(err.value)
    for role in missing:
        assert f'missing state component "{role}" on layers 0-2' in message, message
    assert [r.getMessage() for r in said if r.levelno == logging.ERROR] == [message]
    connector.connector_worker.shutdown()


@pytest.mark.usefixtures("dtype_size")
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)], ids=["tp1", "tp2-rank1"])
def test_state_of_another_size_refuses_naming_both_sizes(v: Any, tp: tuple[int, int]) -> None:
    """Qwen3-Next served at vLLM's default ``mamba_ssm_cache_dtype`` (``auto``: the recurrent
    state in the model's bf16) against the preset's fp32 state: the packed state entry is an
    ``item_size`` problem naming the components, the layers and both sizes."""
    connector, caches = hybrid_worker(v, "qwen3-next", tp=tp)
    with pytest.raises(ManifestError) as err:
        register(v, connector, caches, tp)
    expected = (49152 + 2097152) // tp[1]
    got = (49152 + 2097152 // 2) // tp[1]
    assert [p[:5] for p in err.value.problems] == [
        ("item_size", "mamba_conv+mamba_temporal", [0, 1, 2], expected, got)], \
        err.value.problems
    message = str(err.value)
    assert "mamba_conv+mamba_temporal" in message and "0-2" in message
    assert str(expected) in message and str(got) in message, message
    connector.connector_worker.shutdown()


@pytest.mark.usefixtures("dtype_size")
def test_state_block_smaller_than_its_states_refuses_naming_the_layer(v: Any) -> None:
    """A registered state block shorter than its spec's states cannot hold them (vLLM's
    Mooncake worker refuses such a page itself; the check does not rely on it): refused naming
    the layer and both sizes, not checked as if it held them."""
    from kvplan.compat.vllm.manifest import check_worker_manifest
    from kvplan.compat.vllm.staging import manifest_layout

    from kvplan.presets import load_manifest

    connector, caches = hybrid_worker(v, "kimi-linear")
    worker = connector.connector_worker
    worker.__dict__["_kvplan_manifest"] = None  # registered without the check
    register(v, connector, caches)
    worker.__dict__["_kvplan_manifest"] = load_manifest("kimi-linear:4")
    state = 73728 + 2097152
    worker.block_len_per_layer = [state - 4096 if "linear_attn" in name else n for name, n in
                                  zip(worker.registered_layer_names, worker.block_len_per_layer)]
    with pytest.raises(ManifestError) as err:
        check_worker_manifest(worker, "KvplanMooncakeConnector", manifest_layout)
    message = str(err.value)
    assert "'model.layers.0.linear_attn' (MambaSpec)" in message, message
    assert f"{state - 4096} B blocks" in message and f"needing {state} B" in message
    assert "Remove kvplan_manifest" in message
    worker.shutdown()


@pytest.mark.usefixtures("dtype_size")
def test_nixl_worker_with_state_whose_region_layers_are_unread_refuses_saying_why(
        v: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's NIXL worker registers one region per shared KV cache tensor, not one per layer:
    where kvplan cannot read the layers behind each region (here no ``region_members`` and no
    registered caches), it builds no layout, and with the key set the NIXL worker refuses,
    saying so."""
    from kvplan.compat.vllm.manifest import MANIFEST_ATTR, check_worker_manifest
    from kvplan.compat.vllm.nixl import NO_STATE_LAYOUT, manifest_layout
    from kvplan.presets import load_manifest

    shapes, dtypes = model_states(v, "kimi-linear", 1)
    names = ["model.layers.0.linear_attn", "model.layers.3.self_attn.attn"]
    mamba = v.kvi.MambaSpec(block_size=16, shapes=tuple(shapes), dtypes=dtypes)
    mla = v.kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=None)
    worker = types.SimpleNamespace()
    worker.__dict__.update(
        engine_id="decode", tp_rank=0, world_size=1, block_size=16, num_blocks=BLOCKS,
        kv_caches_base_addr={"decode": {0: [1 << 36]}}, block_len_per_layer=[1 << 22],
        region_names=names[:1], use_mla=True, _has_mamba=True, pp_size=1, dcp_size=1,
        pcp_size=1, _layer_specs={names[0]: mamba, names[1]: mla},
        **{MANIFEST_ATTR: load_manifest("kimi-linear:4")})
    extract = wheel_source(v, os.path.join("model_executor", "models", "utils.py"),
                           "extract_layer_index")
    monkeypatch.setattr(sys.modules["vllm.model_executor.models.utils"],
                        "extract_layer_index", extract, raising=False)
    with pytest.raises(ManifestError) as err:
        check_worker_manifest(worker, "KvplanNixlConnector", manifest_layout)
    message = str(err.value)
    assert NO_STATE_LAYOUT in message, message
    assert "Remove kvplan_manifest" in message


# ---------------------------------------------------------------------------------------------
# KvplanNixlConnector: vLLM's NIXL worker registers one region per shared KV cache tensor
# ---------------------------------------------------------------------------------------------
#: Qwen3-Next / Kimi-Linear on 8 layers: attention at 3 and 7, state layers elsewhere; vLLM's
#: hybrid allocator shares each KV cache tensor among one layer of every KV group.
NIXL_ATTENTION, NIXL_STATES = (3, 7), (0, 1, 2, 4, 5, 6)
#: Which state layers share each tensor with attention layers 3 and 7 (the KV groups of
#: vLLM's hybrid allocator, one layer of each per tensor): the usual groups, and groups
#: that put other layers behind each region.
SHARED = ((0, 1, 2), (4, 5, 6))
SHARED_OTHERWISE = ((4, 5, 6), (0, 1, 2))


class DeviceKVCache:
    """A cache on a device, as vLLM's NIXL ``register_kv_caches`` reads it (a
    :class:`support.vllm_cases.HostKVCache` with a CUDA device)."""

    def __new__(cls, ptr: int, shape: tuple[int, ...], size: int = 2) -> Any:
        from support.vllm_cases import HostKVCache

        cache = HostKVCache(ptr, shape, size)
        cache.device = types.SimpleNamespace(type="cuda")  # type: ignore[attr-defined]
        cache.get_device = lambda: 0  # type: ignore[attr-defined]
        return cache


def nixl_hybrid_worker(v: Any, nixl: Any, c: Any, monkeypatch: pytest.MonkeyPatch,
                       engine: str, role: str, *, key: str = "qwen3-next",
                       shared: tuple[tuple[int, ...], ...] = SHARED, ssm_dtype: Any = FP32,
                       manifest: str | None = None) -> Any:
    """A ``KvplanNixlConnector`` worker of preset ``key`` on 8 layers after vLLM's own
    ``register_kv_caches`` (kvplan's part after it: the manifest check where ``manifest`` is
    set, the identity in the handshake metadata): one KV cache tensor per attention layer,
    shared with the state layers ``shared`` names for it, the state page padded to the
    attention page as vLLM's hybrid allocator pads it. The worker's vLLM attributes are those
    vLLM's ``__init__`` sets for such a model."""
    from support.vllm_nixl import vllm_config as nixl_config
    from support.vllm_nixl import worker as nixl_worker

    from kvplan.compat.vllm.manifest import MANIFEST_ATTR
    from kvplan.presets import load_manifest

    bw, kvi = nixl.base_worker, v.kvi
    mla = key != "qwen3-next"
    shapes, dtypes = model_states(v, key, 1, ssm_dtype=ssm_dtype)
    state = sum(_count(s) * d.itemsize for s, d in zip(shapes, dtypes))
    per_token = 1152 if mla else 2 * 2 * 256 * 2  # Qwen3-Next: 2 KV heads of 256, bf16
    block = -(-state // (per_token * 16)) * 16
    page = block * per_token
    if mla:
        attn = kvi.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576,
                                    dtype=BF16)
    else:
        attn = kvi.FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=256,
                                     dtype=BF16)
    mamba = kvi.MambaSpec(block_size=block, shapes=tuple(shapes), dtypes=dtypes,
                          page_size_padded=page)
    attn_names = [f"model.layers.{i}.self_attn.attn" for i in NIXL_ATTENTION]
    state_of = {i: f"model.layers.{i}.linear_attn" for i in NIXL_STATES}
    groups = [kvi.KVCacheGroupSpec(attn_names, attn)] + [
        kvi.KVCacheGroupSpec([state_of[layers[g]] for layers in shared], mamba)
        for g in range(len(shared[0]))]
    kv_config = kvi.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    config = nixl_config(role, model="Qwen/Qwen3-Next-80B-A3B-Instruct", heads=2)
    w = nixl_worker(c, nixl, engine, config, base=0)
    monkeypatch.setattr(bw, "compute_nixl_compatibility_hash", lambda *a, **k: "same-config")
    monkeypatch.setattr(type(w), "register_local_xfer_handler",
                        lambda self, block_size: (None, None), raising=False)
    agent = types.SimpleNamespace(get_reg_descs=lambda ranges, mem: ranges,
                                  register_memory=lambda descs, backends=None: None,
                                  get_agent_metadata=lambda: b"nixl-agent")
    w.__dict__.update(
        kv_caches_base_addr={engine: {}}, block_len_per_layer=[], block_stride_per_layer=[],
        region_group_ids=[], region_names=[], region_num_blocks=[], _region_is_mla=[],
        region_members=[], _layer_specs={**dict.fromkeys(attn_names, attn),
                                         **dict.fromkeys(state_of.values(), mamba)},
        _has_mamba=True, use_mla=mla, _has_packed_cache=False, use_host_buffer=False,
        host_xfer_buffers={}, kv_cache_config=kv_config, block_size=block,
        _logical_num_blocks=BLOCKS, _mamba_ssm_size=(0, 0), attn_backends=[],
        backend_name="FLASH_ATTN", transfer_tp_rank=0, transfer_tp_size=1,
        kv_buffer_device="cuda", nixl_memory_type="VRAM", nixl_backends=["UCX"],
        nixl_wrapper=agent, _registered_descs=[], dst_num_blocks={}, dst_region_num_blocks={},
        dst_region_group_ids={}, dst_uses_region_group_mapping={}, dst_region_mem_types={},
        kv_cache_layout="HND", host_buffer_kv_cache_layout="HND", device_id=0,
        _head_sharded_draft_kv_heads=None, src_xfer_handles_by_block_size={},
        _transfer_layer_region_indices=(), _transfer_layer_names=(),
        _transfer_layer_group_ids=(), _regions_by_layer={}, _packed_member_layouts={},
        **{MANIFEST_ATTR: load_manifest(manifest) if manifest else None})
    caches: dict[str, Any] = {}
    for t, (attention, layers) in enumerate(zip(NIXL_ATTENTION, shared)):
        ptr = (1 << 40) * (t + 1)  # the tensor's layers all start at its base
        cells = (BLOCKS, block, 576) if mla else (BLOCKS, block, 2, 2 * 256)
        caches[f"model.layers.{attention}.self_attn.attn"] = DeviceKVCache(ptr, cells)
        for layer in layers:  # one raw page per block: every state in it
            caches[state_of[layer]] = DeviceKVCache(ptr, (BLOCKS, page), size=1)
    w.register_kv_caches(caches)
    return w


@pytest.fixture
def layer_index(v: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own ``extract_layer_index``, where kvplan's NIXL connector reads it."""
    extract = wheel_source(v, os.path.join("model_executor", "models", "utils.py"),
                           "extract_layer_index")
    monkeypatch.setattr(sys.modules["vllm.model_executor.models.utils"],
                        "extract_layer_index", extract, raising=False)


@pytest.fixture
def nixl_pair(v: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's NIXL workers of the release (``support.vllm_nixl``) and kvplan's connector over
    them."""
    from support.vllm_nixl import installed_connector, release_modules

    with release_modules() as nixl, installed_connector(nixl, monkeypatch) as c:
        yield nixl, c


@pytest.mark.usefixtures("dtype_size", "layer_index")
@pytest.mark.parametrize("key", ["qwen3-next", "kimi-linear"])
def test_nixl_hybrid_worker_starts_with_the_preset(v: Any, nixl_pair: Any, key: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's NIXL ``register_kv_caches`` registers one region per shared tensor (an
    attention layer and three state layers behind each); kvplan reads the layers behind each
    region and checks the preset's manifest on them as the Mooncake connector does (each
    state page one packed entry of every state component). Before, the worker refused to
    start (kvplan built no layout of a NIXL worker with Mamba state)."""
    from kvplan.compat.vllm import nixl_layout

    nixl, c = nixl_pair
    with records("vllm.kvplan.manifest") as said:
        w = nixl_hybrid_worker(v, nixl, c, monkeypatch, "prefill-0", "kv_producer", key=key,
                               manifest=f"{key}:8")
    assert len(w.region_names) == 2  # vLLM's own registration: one region per tensor
    members = nixl_layout.region_layers(w)  # vLLM 0.34's region_members; 0.32/0.33 read
    assert members is not None and [sorted(names) for names in members] == [
        [f"model.layers.{i}.linear_attn" for i in (0, 1, 2)] + [
            "model.layers.3.self_attn.attn"],
        [f"model.layers.{i}.linear_attn" for i in (4, 5, 6)] + [
            "model.layers.7.self_attn.attn"]]
    held = [r.getMessage() for r in said if "holds every component" in r.getMessage()]
    assert len(held) == 1 and PRESETS[key].manifest().model in held[0], held


@pytest.mark.usefixtures("dtype_size", "layer_index")
def test_nixl_hybrid_state_of_another_size_refuses_the_manifest(
        v: Any, nixl_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-Next's recurrent state at the model's bf16 against the preset's fp32, on NIXL:
    the packed state entry is refused naming the components, the layers and both sizes."""
    nixl, c = nixl_pair
    with pytest.raises(ManifestError) as err:
        nixl_hybrid_worker(v, nixl, c, monkeypatch, "prefill-0", "kv_producer",
                           ssm_dtype=BF16, manifest="qwen3-next:8")
    assert [p[:5] for p in err.value.problems] == [
        ("item_size", "mamba_conv+mamba_temporal", list(NIXL_STATES), 49152 + 2097152,
         49152 + 2097152 // 2)], err.value.problems


def hybrid_handshake(v: Any, nixl: Any, c: Any, monkeypatch: pytest.MonkeyPatch,
                     **decode: Any) -> Any:
    """A hybrid prefill and decode through vLLM's registration and handshake (``decode``
    changes the decode's model); the decode's ``_nixl_handshake`` outcome."""
    from support.vllm_nixl import MSGSPEC, handshake

    prefill = nixl_hybrid_worker(v, nixl, c, monkeypatch, "prefill-0", "kv_producer")
    c.served.append(MSGSPEC.msgpack.encode(prefill.xfer_handshake_metadata))
    d = nixl_hybrid_worker(v, nixl, c, monkeypatch, "decode-0", "kv_consumer", **decode)
    return handshake(d, prefill)


@pytest.mark.usefixtures("dtype_size", "layer_index")
def test_nixl_matching_hybrid_prefill_and_decode_pass(v: Any, nixl_pair: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal hybrid workers: the prefill's identity (an attention ``kv`` page and three
    ``state`` entries of the spec's state bytes behind each region) is plannable for the
    decode, and vLLM adds the prefill's agent."""
    from kvplan.identity import IDENTITY_KEY

    nixl, c = nixl_pair
    hybrid_handshake(v, nixl, c, monkeypatch)
    assert len(c.added) == 1
    sent = getattr(c.added[0], IDENTITY_KEY)
    assert sent is not None, "the hybrid prefill sent no identity"
    raw = sent["layout"]
    assert sorted(zip(raw["layer_ids"], raw["roles"])) == sorted(
        [(i, "kv") for i in NIXL_ATTENTION] + [(i, "state") for i in NIXL_STATES])
    assert {n for n, r in zip(raw["item_lens"], raw["roles"]) if r == "state"} == {
        49152 + 2097152}


@pytest.mark.usefixtures("dtype_size", "layer_index")
def test_nixl_hybrid_state_of_another_size_is_refused_at_the_handshake(
        v: Any, nixl_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode whose recurrent state is bf16 against the prefill's fp32: the verdict refuses
    (``head_slicing``: a state neither equal nor in the TP ratio) naming the layer, the role and both sizes, before the prefill's agent
    is added (vLLM fails the handshake)."""
    from kvplan import IncompatiblePeerError

    nixl, c = nixl_pair
    with records("vllm.kvplan.nixl") as said, pytest.raises(IncompatiblePeerError) as err:
        hybrid_handshake(v, nixl, c, monkeypatch, ssm_dtype=BF16)
    assert c.added == []
    assert err.value.refused_by == "head_slicing", err.value.reason
    reason = err.value.reason
    assert "layer 0, role state" in reason and str(49152 + 2097152) in reason, reason
    assert str(49152 + 2097152 // 2) in reason, reason
    assert [r.getMessage() for r in said if r.levelno == logging.ERROR] == [str(err.value)]


@pytest.mark.usefixtures("dtype_size", "layer_index")
def test_nixl_other_layers_behind_a_region(v: Any, nixl_pair: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's state layers share the other attention layer's tensor (4-6 with layer 3,
    0-2 with layer 7). vLLM 0.32 / 0.33 read the prefill's region ``i`` into the decode's
    region ``i``: refused (``region_layers``) naming region 0 and both sides' layers, before
    the agent is added. vLLM 0.34 pairs regions by the layers both hold: plannable."""
    from kvplan import IncompatiblePeerError

    nixl, c = nixl_pair
    if hasattr(nixl.NixlPullConnectorWorker, "_pair_regions"):  # vLLM 0.34
        hybrid_handshake(v, nixl, c, monkeypatch, shared=SHARED_OTHERWISE)
        assert len(c.added) == 1
        return
    with pytest.raises(IncompatiblePeerError) as err:
        hybrid_handshake(v, nixl, c, monkeypatch, shared=SHARED_OTHERWISE)
    assert c.added == []
    assert err.value.refused_by == "region_layers"
    reason = err.value.reason
    prefill = [(i, "state") for i in (0, 1, 2)] + [(3, "kv")]
    decode = [(3, "kv")] + [(i, "state") for i in (4, 5, 6)]
    assert "region 0" in reason and str(prefill) in reason and str(decode) in reason, reason


#: The whole file again with vLLM 0.34.0's and 0.32.0 CPU's connector and spec classes.
RERUN_UNDER_RELEASES = dict.fromkeys(OTHER_RELEASES, ALL_TESTS)
