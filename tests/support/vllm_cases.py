"""Generated vLLM Mooncake deployments and requests, run through vLLM's real worker methods.

A case is one prefill TP rank sending to one decode TP rank (the pair vLLM's own
``TransferTopology.handshake_target_ranks`` chooses), with registered regions built the way
``register_kv_caches`` records them (per-layer packed buffers, or K/V halves per layer), vLLM's
``_prepare_transfer_regions`` aligning and coalescing them, and a batch of requests.
"""

from __future__ import annotations

import random
import sys
import types
from collections import OrderedDict
from typing import Any

from support.vllm_loader import VLLM


def run_coroutine(coro):
    """Drive a coroutine that never awaits (vLLM's ``_build_transfer_params``)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the coroutine awaited")


class RecordingEngine:
    def __init__(self, ret: int = 0):
        self.calls: list[tuple] = []
        self.ret = ret

    def batch_transfer_sync_write(self, session, src, dst, lengths):
        self.calls.append((session, list(src), list(dst), list(lengths)))
        return self.ret


class RecordingStats:
    def __init__(self):
        self.ok: list[dict] = []
        self.failed = 0

    def record_transfer(self, **kw):
        self.ok.append(kw)

    def record_failed_transfer(self):
        self.failed += 1


_STRICT: dict[type, type] = {}


def strict(cls: type) -> type:
    if cls not in _STRICT:
        def __getattr__(self, name):
            raise AttributeError(f"test worker has no attribute {name!r}")

        def __del__(self):  # vLLM's __del__ shuts down threads this object never started
            pass

        _STRICT[cls] = type(f"Strict{cls.__name__}", (cls,),
                            {"__getattr__": __getattr__, "__del__": __del__})
    return _STRICT[cls]


def make_worker(v: VLLM, cls: type, *, tp_rank: int, tp_size: int, use_mla: bool,
                total_kv_heads: int, group_specs: list, layer_groups: dict[str, int],
                regions: list[tuple], buffers: list[tuple[int, int]], pp_size: int = 1,
                kernel_ratio: int = 1, num_blocks: int = 64, engine=None):
    """A real ``cls`` instance (vLLM's worker or a subclass) built without ``__init__``.

    regions: (base, block_len, kv_block_len, layer_name, layer_index, group_index) per
    registered region, as ``register_kv_caches`` records them."""
    kvi = v.kvi
    groups = [kvi.KVCacheGroupSpec([n for n, g in layer_groups.items() if g == i], spec)
              for i, spec in enumerate(group_specs)]
    kv_cache_config = kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=groups)
    w = object.__new__(strict(cls))
    topo = v.TransferTopology(
        tp_rank=tp_rank, tp_size=tp_size, block_size=16, engine_id="e", is_mla=use_mla,
        is_mamba=kv_cache_config.has_mamba_layers, total_num_kv_heads=total_kv_heads,
        attn_backends=[])
    w.__dict__.update(
        tp_rank=tp_rank, tp_size=tp_size, use_mla=use_mla, pp_size=pp_size,
        kv_cache_config=kv_cache_config, transfer_topo=topo,
        _physical_blocks_per_logical_kv_block=kernel_ratio,
        engine=engine if engine is not None else RecordingEngine(), xfer_stats=RecordingStats(),
        kv_caches_base_addr=[r[0] for r in regions], block_len_per_layer=[r[1] for r in regions],
        kv_block_len_per_layer=[r[2] for r in regions],
        registered_layer_names=[r[3] for r in regions],
        registered_layer_indices=[r[4] for r in regions],
        registered_group_indices=[r[5] for r in regions],
        region_shared_groups=[(r[5],) for r in regions],
        region_row_offsets=[-1 for _ in regions],
        opaque_packed_storages=set(), seen_base_addresses=[b[0] for b in buffers],
        _prepared_transfer_regions={}, _layout_by_peer=OrderedDict(),
        _layer_specs={n: group_specs[g] for n, g in layer_groups.items()},
    )
    if v.version == "0.32.0":  # its register_kv_caches keeps the tensors, not the lengths
        w.device_kv_caches = {f"buffer{i}": HostTensor(p, n) for i, (p, n) in enumerate(buffers)}
    else:
        w._kv_data_lens = [b[1] for b in buffers]
    return w


def xfer_meta(peer, *, tp_rank, tp_size, pp_size, req_blocks):
    """The fields of ``MooncakeXferMetadata`` the sender reads (msgspec is not installed)."""
    return types.SimpleNamespace(
        remote_hostname="127.0.0.1", remote_port=4242, remote_tp_size=tp_size,
        remote_tp_rank=tp_rank, remote_pp_size=pp_size, req_blocks=req_blocks,
        kv_caches_base_addr=peer.kv_caches_base_addr, block_lens=peer.block_len_per_layer,
        kv_block_lens=peer.kv_block_len_per_layer,
        registered_layer_names=peer.registered_layer_names,
        registered_layer_indices=peer.registered_layer_indices,
        registered_group_indices=peer.registered_group_indices,
        registered_shared_group_ids=[list(g) for g in peer.region_shared_groups],
        registered_row_offsets=peer.region_row_offsets, layout_id=0)


def canonical(src, dst, lengths) -> list[tuple[int, int, int]]:
    """The destination byte map as maximal (dst, src, len) intervals; overlapping destination
    ranges are an AssertionError (both planners must never write a byte twice)."""
    items = sorted(zip((int(d) for d in dst), (int(s) for s in src), (int(n) for n in lengths)))
    out: list[list[int]] = []
    for d, s, n in items:
        if n == 0:
            continue
        if out:
            pd, ps, pn = out[-1]
            assert d >= pd + pn, f"destination bytes written twice at {d:#x}"
            if d == pd + pn and s == ps + pn:
                out[-1][2] += n
                continue
        out.append([d, s, n])
    return [tuple(x) for x in out]


class Case(types.SimpleNamespace):
    pass


def _ids(rng: random.Random, n: int, cap: int, fragmented: bool) -> list[int]:
    if n == 0:
        return []
    if not fragmented and n <= cap - 1:
        start = rng.randrange(1, cap - n + 1)
        return list(range(start, start + n))
    return rng.sample(range(1, cap), n)


def generate(v: VLLM, seed: int, cls: type | None = None) -> Case:
    """One deterministic case: prefill worker, request batch, expected validity."""
    rng = random.Random(seed)
    cls = cls or v.MooncakeConnectorWorker
    kvi = v.kvi
    kind = rng.choice(["mla", "mha", "hybrid"])
    n_layers = rng.randint(1, 5)
    kernel_ratio = rng.choice([1, 1, 2])
    num_blocks = 40
    cap = num_blocks * kernel_ratio
    total_heads = 1 if kind == "mla" else rng.choice([1, 2, 4, 8])
    p_tp = rng.choice([1, 2, 4])
    d_tp = rng.choice([1, 2, 4]) if kind == "mha" else p_tp
    p_rank = rng.randrange(p_tp)
    pp_stages = rng.choice([1, 1, 2]) if n_layers >= 2 else 1
    stage = rng.randrange(pp_stages)
    per_stage = -(-n_layers // pp_stages)
    stage_layers = list(range(stage * per_stage, min(n_layers, (stage + 1) * per_stage)))
    head_bytes = rng.choice([8, 16])
    packed = rng.random() < 0.5  # one buffer per layer, stride == block

    def heads_per(tp):
        return max(1, total_heads // tp)

    names = {i: f"model.layers.{i}.self_attn.attn" for i in range(n_layers)}
    mamba_layers = [i for i in range(n_layers) if kind == "hybrid" and i % 2 == 1]
    attn_spec = (kvi.MLAAttentionSpec if kind == "mla" else kvi.FullAttentionSpec)(
        block_size=16, num_kv_heads=heads_per(p_tp), head_size=head_bytes, dtype=None,
        state_content_bytes=head_bytes)
    group_specs = [attn_spec]
    if mamba_layers:
        group_specs.append(kvi.MambaSpec(block_size=16, shapes=((4,),), dtypes=(None,)))
    layer_groups = {names[i]: (1 if i in mamba_layers else 0) for i in range(n_layers)}

    def registration(tp, layers, base0):
        regs, bufs = [], []
        base = base0
        for i in layers:
            if i in mamba_layers:
                blk = 96
                regs.append((base, blk, blk, names[i], i, 1))
                bufs.append((base, num_blocks * blk))
                base += num_blocks * blk + (1 << 20)
                continue
            kv = 16 * heads_per(tp) * head_bytes // kernel_ratio if kind != "mla" else 64
            halves = 1 if kind == "mla" else 2
            stride = kv if packed else kv + rng.choice([0, 32])
            for _ in range(halves):
                regs.append((base, stride, kv, names[i], i, 0))
                bufs.append((base, cap * stride))
                base += cap * stride + (1 << 20)
        return regs, bufs

    p_regs, p_bufs = registration(p_tp, stage_layers, 0x10_0000)
    prefill = make_worker(v, cls, tp_rank=p_rank, tp_size=p_tp, use_mla=kind == "mla",
                          total_kv_heads=total_heads, group_specs=group_specs,
                          layer_groups={names[i]: layer_groups[names[i]] for i in stage_layers},
                          regions=p_regs, buffers=p_bufs, pp_size=pp_stages,
                          kernel_ratio=kernel_ratio, num_blocks=num_blocks)
    d_ranks = prefill.transfer_topo.handshake_target_ranks(d_tp)
    d_rank = rng.choice(d_ranks)
    d_regs, d_bufs = registration(d_tp, range(n_layers), 0x8000_0000)
    decode = make_worker(v, v.MooncakeConnectorWorker, tp_rank=d_rank, tp_size=d_tp,
                         use_mla=kind == "mla", total_kv_heads=total_heads,
                         group_specs=group_specs, layer_groups=layer_groups, regions=d_regs,
                         buffers=d_bufs, pp_size=1, kernel_ratio=kernel_ratio,
                         num_blocks=num_blocks)
    req_blocks, ready, invalid = {}, [], set()
    for r in range(rng.randint(1, 3)):
        local_groups, remote_groups = [], []
        for g in range(len(group_specs)):
            n_remote = rng.randint(0, 12)
            n_local = n_remote + (rng.randint(0, 3) if rng.random() < 0.3 else 0)
            frag = rng.random() < 0.5
            local = _ids(rng, n_local, num_blocks, frag)
            # each request owns its own decode blocks (13 ids apart), as vLLM's allocator gives
            window = rng.sample(range(1 + 13 * r, 14 + 13 * r), n_remote) if frag else \
                list(range(1 + 13 * r, 1 + 13 * r + n_remote))
            remote = window
            if g == 1 and remote and rng.random() < 0.4:  # Mamba null placeholders
                remote = [v.NULL_BLOCK_ID] + remote[1:]
                local = [v.NULL_BLOCK_ID] + local[1:]
            local_groups.append(local)
            remote_groups.append(remote)
        if rng.random() < 0.05 and local_groups[0] and remote_groups[0]:
            # past the registered buffer (vLLM reads outside it) or negative (before it)
            local_groups[0][-1] = rng.choice([num_blocks + 3, -2])
            invalid.add(f"req{r}")
        req_blocks[f"req{r}"] = (f"t{r}", remote_groups)
        ready.append((f"req{r}", types.SimpleNamespace(local_block_ids=local_groups)))
    meta = xfer_meta(decode, tp_rank=d_rank, tp_size=d_tp, pp_size=1, req_blocks=req_blocks)
    return Case(seed=seed, kind=kind, prefill=prefill, meta=meta, ready=ready, invalid=invalid,
                buffers=p_bufs, p_tp=p_tp, d_tp=d_tp, pp=pp_stages, kernel_ratio=kernel_ratio)


# --------------------------------------------------------------------------------------------
# Workers built the way vLLM's own unit tests build them
# --------------------------------------------------------------------------------------------
class FakeMooncakeWrapper:
    """The Mooncake engine stand-in vLLM's own connector tests use (every call succeeds)."""

    def __init__(self, *args, **kwargs):
        pass

    def initialize(self, local_hostname, metadata_server, protocol, device_name) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 12345

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths) -> int:
        return 0

    def batch_register_memory(self, buffer_addresses, capacities) -> int:
        return 0


def worker_dependencies(v: VLLM, **extra):
    """What vLLM's ``patch_worker_dependencies`` patches in the connector module (the engine,
    IP, TP/PP ranks, the bootstrap server), plus the attention-backend lookups, which read
    model layers this loader does not build (the backends are then none, as in vLLM's
    tests without a model). A context manager; restores every global it replaced."""
    import contextlib

    patches = dict(
        TransferEngine=FakeMooncakeWrapper, get_ip=lambda: "127.0.0.1",
        get_tensor_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_world_size=lambda: 1,
        get_pp_group=lambda: types.SimpleNamespace(rank_in_group=0),
        should_launch_bootstrap_server=lambda config: False,
        get_current_attn_backends=lambda config, layer_names=None: [],
        get_current_attn_backends_and_specs=lambda config, kv_cache_config, backends: (
            backends, []),
        select_common_block_size=lambda block_size, backends, specs: block_size,
    )
    patches.update(extra)

    @contextlib.contextmanager
    def patched():
        mc = v.mc
        missing = object()
        saved = {name: mc.__dict__.get(name, missing) for name in patches}
        mc.__dict__.update(patches)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is missing:
                    del mc.__dict__[name]
                else:
                    mc.__dict__[name] = value

    return patched()


def vllm_config(kv_role: str, *, block_size: int = 16, use_mla: bool = False,
                total_kv_heads: int = 4, engine_id: str = "my-engine-id"):
    """The fields of vLLM's ``VllmConfig`` the connector and its worker read (vLLM's config
    classes import torch), with the values of vLLM's test ``create_vllm_config``."""
    extra: dict = {}
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_connector="MooncakeConnector", kv_role=kv_role, engine_id=engine_id,
            kv_connector_extra_config=extra, kv_connector_module_path=None,
            get_from_extra_config=lambda key, default=None: extra.get(key, default)),
        parallel_config=types.SimpleNamespace(
            data_parallel_index=0, data_parallel_rank_local=0, local_engines_only=False,
            pipeline_parallel_size=1),
        # read by vLLM 0.34's worker: the extensible KV cache (its default, off) and the
        # resolved layout (vLLM's default "NHD", i.e. LBNHC)
        cache_config=types.SimpleNamespace(
            block_size=block_size, enable_extensible_kv_cache=False,
            get_resolved_kv_cache_layout=lambda: sys.modules[
                "vllm.v1.kv_cache_layout"].KVCacheLayout["LBNHC"]),
        model_config=types.SimpleNamespace(use_mla=use_mla,
                                           get_total_num_kv_heads=lambda: total_kv_heads),
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    )


def build_connector(v: VLLM, connector_cls: type, kv_role: str, kv_cache_config, **config):
    """``connector_cls(vllm_config, KVConnectorRole.WORKER, kv_cache_config)``: vLLM's real
    constructor and worker ``__init__`` (call under :func:`worker_dependencies`)."""
    return connector_cls(vllm_config(kv_role, **config), v.KVConnectorRole.WORKER,
                         kv_cache_config)


def xfer_metadata(**fields):
    """``MooncakeXferMetadata(**fields)`` with its defaults (the class is a msgspec Struct and
    msgspec is not installed here, so its instances would hold no fields)."""
    defaults = dict(registered_layer_names=[], registered_layer_indices=[],
                    registered_group_indices=[], registered_shared_group_ids=[],
                    registered_row_offsets=[], remote_pp_size=1, layout_id=0)
    defaults.update(fields)
    return types.SimpleNamespace(**defaults)


class Recorded(types.SimpleNamespace):
    """A msgspec Struct's instance as a namespace of the fields it was built with."""


class HostStorage:
    def __init__(self, ptr: int, nbytes: int):
        self._ptr, self._nbytes = ptr, nbytes

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes


class HostTensor:
    """What kvplan reads of a registered KV-cache tensor (``untyped_storage()``'s address
    and size), for ``device_kv_caches`` of a worker that registered as vLLM 0.32 does."""

    def __init__(self, ptr: int, nbytes: int):
        self._storage = HostStorage(ptr, nbytes)

    def untyped_storage(self) -> HostStorage:
        return self._storage


class HostKVCache:
    """A registered cache as vLLM's ``register_kv_caches`` reads it: ``shape`` over
    ``size``-byte elements (bf16 unless told), row-major, its storage its own; indexing drops
    the outermost dimension as a tensor's does."""

    def __init__(self, ptr: int, shape: tuple[int, ...], size: int = 2) -> None:
        self.ptr, self.shape, self.ndim, self.size = ptr, shape, len(shape), size

    def untyped_storage(self) -> HostStorage:
        return HostStorage(self.ptr, self.nbytes)

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self, dim: int | None = None) -> Any:
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.insert(0, step)
            step *= n
        return tuple(strides) if dim is None else strides[dim]

    def element_size(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        n = self.size
        for dim in self.shape:
            n *= dim
        return n

    def __getitem__(self, index: int) -> HostKVCache:
        return HostKVCache(self.ptr + index * self.stride(0) * self.size, self.shape[1:],
                           self.size)

    def is_contiguous(self) -> bool:
        return True
