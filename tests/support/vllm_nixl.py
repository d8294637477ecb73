"""vLLM's real NIXL connector workers driven without torch or a NIXL handshake socket: the
release's worker classes and real ``nixl/metadata.py`` / ``nixl/stats.py`` (fixture ``nixl``),
``connector_class()`` built over them with a msgspec stand-in and a handshake socket answering
with the prefill's payload (fixture ``connector``), and workers as vLLM's
``register_kv_caches`` leaves them (:func:`worker`, :func:`serve`, :func:`handshake`).

Import the fixtures into a test module with
``from support.vllm_nixl import connector, nixl  # noqa: F401``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import load_vllm_nixl  # noqa: E402

from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402

ROPE_1 = {"rope_type": "yarn", "factor": 1.0}
ROPE_2 = {"rope_type": "yarn", "factor": 2.0}
BLOCK, HEADS, HEAD_BYTES, LAYERS, BLOCKS = 16, 4, 64, 3, 8
COMPAT_HASH = "same-config"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A worker's KV cache as vLLM registers it: ``blocks`` blocks of ``block`` tokens per
    region; attention other than MLA has a K and a V region per layer, each token ``heads``
    heads of ``head_bytes`` bytes; MLA one region per layer, each token ``head_bytes`` bytes
    (its latent row; ``heads`` is 1)."""

    block: int = BLOCK
    heads: int = HEADS
    head_bytes: int = HEAD_BYTES
    layers: int = LAYERS
    blocks: int = BLOCKS
    mla: bool = False

    @property
    def regions(self) -> int:
        return self.layers if self.mla else 2 * self.layers

    def block_bytes(self, tp_size: int = 1) -> int:
        """One block's bytes in one region (a rank's heads at TP ``tp_size``)."""
        return self.block * max(1, self.heads // tp_size) * self.head_bytes


#: The tests' geometry: 3 layers of 4 heads of 64 bytes, blocks of 16 tokens, 8 blocks.
TESTS = Geometry()


def _builtins(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _builtins(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_builtins(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _builtins(v) for k, v in obj.items()}
    return obj


class _Decoder:
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def decode(self, data: bytes) -> Any:
        fields = pickle.loads(data)
        known = {f.name for f in dataclasses.fields(self.cls)}
        return self.cls(**{k: v for k, v in fields.items() if k in known})


class _Error(Exception):
    pass


#: msgspec's calls vLLM's handshake and kvplan make: a dataclass goes out as a map, a typed
#: decoder skips a map's unknown keys (msgspec's rule for dataclasses).
MSGSPEC = types.SimpleNamespace(
    DecodeError=_Error, ValidationError=_Error,
    msgpack=types.SimpleNamespace(
        encode=lambda obj: pickle.dumps(_builtins(obj)),
        decode=lambda data, type=None: (pickle.loads(data) if type is None
                                        else _Decoder(type).decode(data)),
        Decoder=_Decoder, Encoder=lambda: types.SimpleNamespace(
            encode=lambda obj: pickle.dumps(_builtins(obj)))))


_METADATA = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata"
_STATS = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats"


@contextmanager
def release_modules() -> Iterator[Any]:
    """The release's NIXL workers, and its real ``nixl/metadata.py`` and ``nixl/stats.py``
    (the loader gives the worker module stand-ins for them): the handshake's two dataclasses,
    vLLM's NIXL stats and Prometheus classes (the fixture ``nixl``; a benchmark uses it
    directly)."""
    from support.vllm_loader import _import_real

    n = load_vllm_nixl()
    before = {name: sys.modules.pop(name, None) for name in (_METADATA, _STATS)}
    real = _import_real(n.vllm.root, "vllm", (_METADATA, _STATS))
    n.metadata, n.stats = real[_METADATA], real[_STATS]
    try:
        yield n
    finally:
        for name, module in before.items():
            if module is not None:
                sys.modules[name] = module


@pytest.fixture(scope="module", name="nixl")
def nixl_release() -> Iterator[Any]:
    with release_modules() as n:
        yield n


@pytest.fixture(name="connector")
def nixl_connector(nixl: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``connector_class()`` built over the loaded release, with the msgspec stand-in and a
    socket that answers with :attr:`served` (the prefill's payload)."""
    with installed_connector(nixl, monkeypatch) as c:
        yield c


@contextmanager
def installed_connector(nixl: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The fixture ``connector``'s body, for a caller holding its own ``monkeypatch`` (a
    benchmark): the patches are ``monkeypatch``'s to undo, the worker class uninstalled on
    exit."""
    bw = nixl.base_worker
    served: list[bytes] = []
    # a PP prefill's stages, by PP rank: what its listener serves for (GET_META_MSG, pp, tp)
    served_stages: dict[int, bytes] = {}

    class Socket:
        asked_pp = 0

        def setsockopt(self, *args: Any) -> None:
            pass

        def send(self, msg: bytes) -> None:
            self.asked_pp = int(pickle.loads(msg)[1])

        def recv_multipart(self) -> list[bytes]:
            return [served_stages.get(self.asked_pp, served[-1] if served else b""),
                    pickle.dumps(0.0)]

    @contextmanager
    def zmq_ctx(*args: Any) -> Iterator[Socket]:
        yield Socket()

    monkeypatch.setattr(bw, "msgspec", MSGSPEC)
    for name in ("NixlAgentMetadata", "NixlHandshakePayload", "GET_META_MSG"):
        if hasattr(nixl.metadata, name):  # the worker module's names from metadata.py
            monkeypatch.setattr(bw, name, getattr(nixl.metadata, name))
    monkeypatch.setattr(bw, "zmq_ctx", zmq_ctx)
    package = types.ModuleType(vllm_nixl._VLLM_NIXL)
    package.NixlPullConnectorWorker = nixl.NixlPullConnectorWorker  # type: ignore[attr-defined]
    package.NixlPullConnector = type("NixlPullConnector", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_nixl._VLLM_NIXL, package)
    monkeypatch.setitem(sys.modules, _STATS, nixl.stats)
    monkeypatch.setattr(vllm_nixl, "_CONNECTOR", None)
    added: list[Any] = []
    monkeypatch.setattr(nixl.NixlPullConnectorWorker, "add_remote_agent",
                        lambda self, meta, *a, **k: added.append(meta) or "agent-0")
    cls = vllm_nixl.connector_class()
    try:
        yield types.SimpleNamespace(Worker=cls.Worker, Connector=cls, served=served,
                                    served_stages=served_stages, added=added, bw=bw)
    finally:
        vllm_nixl.uninstall(cls.Worker)


def vllm_config(role: str, *, model: str = "org/model", revision: str = "abc123",
                rope: Any = ROPE_1, draft: str | None = None, cross: bool = False,
                heads: int = HEADS) -> Any:
    model_config = types.SimpleNamespace(
        model=model, revision=revision, get_total_num_kv_heads=lambda: heads,
        hf_text_config=types.SimpleNamespace(rope_scaling=dict(rope), rope_theta=10000.0))
    return types.SimpleNamespace(
        model_config=model_config,
        speculative_config=types.SimpleNamespace(model=draft) if draft else None,
        kv_transfer_config=types.SimpleNamespace(
            kv_role=role, kv_connector_extra_config={"enable_cross_layers_blocks": cross}))


def worker(c: Any, nixl: Any, engine: str, config: Any, *, base: int,
           tp_rank: int = 0, tp_size: int = 1, geometry: Geometry = TESTS,
           layers: list[int] | None = None, pp_size: int = 1) -> Any:
    """A worker as vLLM's ``register_kv_caches`` leaves it (K and V regions per layer; one
    region per layer for MLA), its regions back to back from ``base``; with ``layers`` (the
    global layer ids it holds, as many as the geometry's), each region's ``region_names``
    entry, the name of the layer vLLM registered it for, and ``pp_size``."""
    w = object.__new__(c.Worker)
    g = geometry
    block = g.block_bytes(tp_size)
    ptrs = [base + r * block * g.blocks for r in range(g.regions)]
    w.__dict__.update(
        engine_id=engine, tp_rank=tp_rank, world_size=tp_size, block_size=g.block,
        num_blocks=g.blocks, kv_caches_base_addr={engine: {tp_rank: ptrs}},
        block_len_per_layer=[block] * len(ptrs), use_mla=g.mla, _has_mamba=False,
        pp_size=1, dcp_size=1, pcp_size=1, _physical_blocks_per_logical_kv_block=1,
        vllm_config=config,
        model_config=config.model_config, compat_hash=COMPAT_HASH, enforce_compat_hash=True,
        use_host_buffer=True, _is_csa_linear=False, xfer_handshake_metadata=None,
        transfer_topo=types.SimpleNamespace(handshake_target_ranks=lambda *a: [0]))
    w.pp_size = pp_size
    if layers is not None:
        assert len(layers) == g.layers, (layers, g.layers)
        per_layer = g.regions // g.layers
        w.region_names = [f"model.layers.{layer}.self_attn.attn"
                          for layer in layers for _ in range(per_layer)]
    return w


def serve(c: Any, nixl: Any, prefill: Any, *, kvplan_prefill: bool = True,
          region_group_ids: list[int] | None = None) -> None:
    """The prefill's ``register_kv_caches`` (vLLM's part: the payload it builds, with its NIXL
    agent's metadata where it has an agent, and ``region_group_ids``, its regions' KV groups,
    where given) and what its handshake listener serves."""
    bw = nixl.base_worker
    agent = prefill.__dict__.get("nixl_wrapper")
    groups = {} if region_group_ids is None else {"region_group_ids": list(region_group_ids)}
    meta = bw.NixlAgentMetadata(**groups,
        engine_id=prefill.engine_id,
        agent_metadata=b"nixl-agent" if agent is None else agent.get_agent_metadata(),
        kv_caches_base_addr=prefill.kv_caches_base_addr[prefill.engine_id][0],
        device_id=0, num_blocks=prefill.num_blocks, block_lens=prefill.block_len_per_layer,
        block_strides=prefill.block_len_per_layer, kv_cache_layout="NHD",
        block_size=prefill.block_size,
        ssm_sizes=(0, 0), attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1)

    def register(self: Any, kv_caches: Any) -> None:
        self.xfer_handshake_metadata = bw.NixlHandshakePayload(
            compatibility_hash=COMPAT_HASH, agent_metadata_bytes=MSGSPEC.msgpack.encode(meta))

    if kvplan_prefill:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(nixl.NixlPullConnectorWorker, "register_kv_caches", register)
            prefill.register_kv_caches({})
    else:  # vLLM's own worker: no identity in its metadata
        register(prefill, {})
    c.served.append(MSGSPEC.msgpack.encode(prefill.xfer_handshake_metadata))


def handshake(decode: Any, prefill: Any) -> Any:
    return decode._nixl_handshake("127.0.0.1", 5600, 1, prefill.engine_id)
