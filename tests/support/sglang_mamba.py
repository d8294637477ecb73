"""SGLang 0.5.23's real ``MambaPool`` state-entry publication, run on host stand-in tensors.

What a hybrid pool registers for PD transfer (``KVArgs.state_data_ptrs``, ``state_data_lens``,
``state_item_lens``, ``state_layer_ids``, ``state_dim_per_tensor``,
``state_slice_outer_counts``, ``state_conv_shard_groups`` of its ``StateType.MAMBA``
component) comes from ``MambaPool``'s methods in ``srt/mem_cache/memory_pool.py``:
``_iter_transfer_state_entries`` (the order: tensor-major over ``MambaPool.State``'s fields,
one entry per Mamba layer), ``get_contiguous_buf_infos``, ``get_state_dim_per_tensor``,
``get_state_layer_ids``, ``get_state_slice_outer_counts`` and ``get_state_conv_shard_groups``.
The module itself cannot be imported here (torch, CUDA kernels, the whole runtime), so
:func:`mamba_pool_class` takes those methods' source from the wheel (the installed or unpacked
copy, else the downloaded wheel file), compiles them unchanged into a class of their own, in a namespace that holds
only ``math`` (the one module they use: any other global they read would be a ``NameError``). :class:`HostTensor`
stands in for a torch tensor with the few members they use (``shape``, ``numel``, ``data_ptr``,
``nbytes``, indexing the first axis). SGLang's real ``append_state_component``
(``disaggregation/utils.py``) then puts the lists into ``KVArgs``. A KDA layer's state shapes
are SGLang's own ``KimiLinearStateShape.create`` (``srt/configs/mamba_utils.py``, with
``divide`` of ``srt/distributed/utils.py``), compiled the same way
(:func:`kimi_linear_state_shape`).
"""

from __future__ import annotations

import ast
import math
import os
import types
from typing import Any

from kvplan.presets import ModelPreset
from support.package_shells import download_wheel
from support.sglang_loader import SGLANG_VERSION, SGLang

MEMORY_POOL = "srt/mem_cache/memory_pool.py"
MAMBA_UTILS = "srt/configs/mamba_utils.py"
DIST_UTILS = "srt/distributed/utils.py"

#: The ``MambaPool`` members the PD registration runs (and nothing else of the class).
MEMBERS = ("_NON_TRANSFER_STATE_FIELDS", "_iter_transfer_state_entries",
           "get_contiguous_buf_infos", "get_state_dim_per_tensor", "get_state_layer_ids",
           "get_state_slice_outer_counts", "get_state_conv_shard_groups")


class HostTensor:
    """A contiguous host tensor's metadata: its shape, element size and address."""

    def __init__(self, shape: tuple[int, ...], itemsize: int, ptr: int) -> None:
        self.shape, self.itemsize, self.ptr = tuple(shape), itemsize, ptr

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.itemsize

    def data_ptr(self) -> int:
        return self.ptr

    def __getitem__(self, i: int) -> HostTensor:
        inner = HostTensor(self.shape[1:], self.itemsize, 0)
        return HostTensor(self.shape[1:], self.itemsize, self.ptr + i * inner.nbytes)


def _source(sg: SGLang, module: str = MEMORY_POOL) -> str:
    path = os.path.join(sg.root, module)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    import zipfile

    cache = os.path.dirname(os.path.dirname(sg.root))
    with zipfile.ZipFile(download_wheel("sglang", SGLANG_VERSION, cache)) as zf:
        return zf.read("sglang/" + module).decode("utf-8")


def _definitions(sg: SGLang, module: str, names: tuple[str, ...]) -> list[ast.stmt]:
    """The top-level definitions ``names`` of the wheel's ``module``, as SGLang wrote them."""
    tree = ast.parse(_source(sg, module))
    found = [n for n in tree.body
             if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names]
    assert sorted(n.name for n in found) == sorted(names), (module, names)
    return found


_KDA_SHAPE: type | None = None


def kimi_linear_state_shape(sg: SGLang, tp: int, *, num_heads: int = 32, head_dim: int = 128,
                            conv_kernel_size: int = 4) -> Any:
    """SGLang's own ``KimiLinearStateShape.create`` for a KDA layer of ``num_heads`` heads of
    ``head_dim`` at attention TP ``tp`` (what ``configs/kimi_linear.py``'s
    ``mamba2_cache_params`` asks for): its ``conv`` shapes, ``temporal`` shape,
    ``conv_shard_groups`` and ``conv_slice_axis``. The class and ``divide`` (with
    ``ensure_divisibility``) are compiled unchanged from the wheel, in a namespace holding only
    ``dataclass``, ``List`` and ``Optional``."""
    global _KDA_SHAPE
    if _KDA_SHAPE is None:
        import dataclasses
        import typing

        body = [*_definitions(sg, DIST_UTILS, ("ensure_divisibility", "divide")),
                *_definitions(sg, MAMBA_UTILS, ("KimiLinearStateShape",))]
        module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
        namespace: dict[str, Any] = {"dataclass": dataclasses.dataclass, "List": typing.List,
                                     "Optional": typing.Optional,
                                     "__name__": "sglang_mamba_utils",
                                     "__builtins__": __builtins__}
        # dont_inherit: this file's ``from __future__ import annotations`` is not the wheel's
        exec(compile(module, os.path.join(sg.root, MAMBA_UTILS), "exec", dont_inherit=True),
             namespace)
        _KDA_SHAPE = namespace["KimiLinearStateShape"]
    return _KDA_SHAPE.create(tp_world_size=tp, num_heads=num_heads,  # type: ignore[attr-defined]
                             head_dim=head_dim, conv_kernel_size=conv_kernel_size)


_CLASS: type | None = None


def mamba_pool_class(sg: SGLang) -> type:
    """A class holding :data:`MEMBERS` exactly as SGLang's ``MambaPool`` defines them."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    tree = ast.parse(_source(sg))
    pool = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MambaPool")
    body: list[ast.stmt] = []
    found = set()
    for node in pool.body:
        name = None
        if isinstance(node, ast.FunctionDef):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        if name in MEMBERS:
            body.append(node)
            found.add(name)
    assert found == set(MEMBERS), set(MEMBERS) - found
    cls_node = ast.ClassDef(name="MambaPoolTransfer", bases=[], keywords=[], body=body,
                            decorator_list=[])
    module = ast.fix_missing_locations(ast.Module(body=[cls_node], type_ignores=[]))
    namespace: dict[str, Any] = {"math": math, "__name__": "sglang_mamba_pool",
                                 "__builtins__": __builtins__}
    exec(compile(module, os.path.join(sg.root, MEMORY_POOL), "exec"), namespace)
    cls = namespace["MambaPoolTransfer"]
    _CLASS = cls
    return cls


def mamba_pool(sg: SGLang, *, layer_ids: list[int], conv: list[tuple[int, ...]],
               temporal: tuple[int, ...], slots: int, conv_itemsize: int = 2,
               temporal_itemsize: int = 4, conv_shard_groups: list[int] | None = None,
               conv_slice_axis: int = 0, base: int = 1 << 40) -> Any:
    """A ``MambaPool`` as SGLang 0.5.23 allocates one (``conv``: the per-slot shapes of its
    conv tensors, ``temporal``: its recurrent state's; ``[layers, slots + 1, ...]`` each, one
    buffer after another from ``base``), with SGLang's transfer methods."""
    cls = mamba_pool_class(sg)
    at = base
    tensors = []
    for shape, itemsize in [*((c, conv_itemsize) for c in conv),
                            (temporal, temporal_itemsize)]:
        t = HostTensor((len(layer_ids), slots + 1, *shape), itemsize, at)
        at += t.nbytes
        tensors.append(t)
    pool = cls.__new__(cls)
    pool.mamba_cache = types.SimpleNamespace(conv=tensors[:-1], temporal=tensors[-1])
    pool.mamba_layer_ids = list(layer_ids)
    pool.conv_shard_groups = conv_shard_groups
    pool.conv_slice_axis = conv_slice_axis
    pool._slot_siblings = ()
    return pool


def append_mamba_state(sg: SGLang, kv_args: Any, pool: Any) -> None:
    """What SGLang's ``kv_args`` builder does for a ``HybridLinearKVPool``'s Mamba state
    (``disaggregation/utils.py``): one ``StateType.MAMBA`` component, by SGLang's own
    ``append_state_component``."""
    du = sg.modules["sglang.srt.disaggregation.utils"]
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens",
                 "state_dim_per_tensor", "state_conv_shard_groups", "state_slice_outer_counts",
                 "state_layer_ids"):
        if not isinstance(getattr(kv_args, name, None), list):
            setattr(kv_args, name, [])
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    du.append_state_component(
        kv_args, sg.StateType.MAMBA, ptrs, lens, items, pool.get_state_dim_per_tensor(),
        pool.get_state_conv_shard_groups(), pool.get_state_slice_outer_counts(),
        pool.get_state_layer_ids())


PAGE, SLOTS = 16, 8


def state_pool(sg: SGLang, key: str, tp: int, layers: list[int], *, temporal: bool = True,
               conv: bool = True, groups: bool = True) -> Any:
    """The Mamba pool SGLang allocates for ``key`` at attention TP ``tp`` on ``layers``.

    Shapes as SGLang's configs give them (``configs/qwen3_next.py`` ``mamba2_cache_params``,
    ``configs/mamba_utils.py`` ``Mamba2StateShape.create`` / ``KimiLinearStateShape.create``):
    Qwen3-Next's Gated DeltaNet conv state ``[conv_dim / tp, K - 1]`` over
    ``cat(q, k, v)`` (16 key heads and 32 value heads of 128: 2048 + 2048 + 4096 channels),
    bf16 with ``K = 4``, the recurrent state ``[32 / tp, 128, 128]`` fp32; any other key is a
    KDA model (Kimi-Linear, Kimi-K3) of 32 heads of 128 and ``K = 4``, its shapes, conv shard
    groups and sliced axis from SGLang's own ``KimiLinearStateShape.create``
    (:func:`kimi_linear_state_shape`: one conv tensor ``[K - 1, (q + k + v) / tp]``).
    ``temporal=False`` / ``conv=False``: an empty recurrent / conv tensor (SGLang publishes no
    entry for it); ``groups=False``: a pool without conv shard groups."""
    if key == "qwen3-next":
        convs, axis, shard = [(8192 // tp, 3)], 0, [2048, 2048, 4096]
        recurrent = (32 // tp, 128, 128)
    else:
        shape = kimi_linear_state_shape(sg, tp)
        convs, axis = [tuple(c) for c in shape.conv], shape.conv_slice_axis
        shard, recurrent = list(shape.conv_shard_groups), tuple(shape.temporal)
    if not temporal:
        recurrent = (0, *recurrent[1:])
    if not conv:
        convs = [(0, *c[1:]) for c in convs]
    return mamba_pool(sg, layer_ids=layers, conv=convs, temporal=recurrent, slots=SLOTS,
                      conv_shard_groups=shard if groups else None, conv_slice_axis=axis)


def hybrid_kv_args(sg: SGLang, preset: ModelPreset, tp: int, rank: int,
                   layers: range | None = None, **state: bool) -> Any:
    """One TP rank's ``KVArgs`` of ``preset`` on SGLang's hybrid pool (the stage ``layers``,
    default every layer)."""
    stage = set(layers if layers is not None else range(preset.num_layers))
    full = [i for i in preset.kv_layers() if i in stage]
    linear = [i for i in preset.linear_layers() if i in stage]
    mla = preset.attention == "mla"
    per_token = preset.kv_bytes_per_token if mla else preset.kv_bytes_per_token // tp
    entries = len(full) if mla else 2 * len(full)
    kv = sg.modules["sglang.srt.disaggregation.base.conn"].KVArgs()
    kv.engine_rank, kv.page_size, kv.pp_rank = rank, PAGE, 0
    kv.kv_data_ptrs = [(1 << 32) * (e + 1) for e in range(entries)]
    kv.kv_data_lens = [64 * PAGE * per_token] * entries
    kv.kv_item_lens = [PAGE * per_token] * entries
    kv.kv_layer_ids = full if mla else full * 2
    append_mamba_state(sg, kv, state_pool(sg, preset.key, tp, linear, **state))
    return kv
