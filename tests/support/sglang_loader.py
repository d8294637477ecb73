"""Load SGLang 0.5.23's real KV-transfer planning functions, as lightly as honestly possible.

Usage (the bench venv, where SGLang is installed with ``--no-deps``; or any interpreter, where
``load_sglang()`` falls back to the wheel that ``fetch_wheel()`` downloads with
``pip download --no-deps sglang==0.5.23`` and caches under ``.venv/sglang-wheel``)::

    from support.sglang_loader import load_sglang     # tests/ on sys.path (see support/__init__)
    sg = load_sglang()
    sg.group_concurrent_contiguous(src, dst)          # disaggregation/common/utils.py
    sg.build_transfer_entry_pairs(...)                # disaggregation/utils.py
    mgr = sg.make_manager(is_mla_backend=True, pp_size=1, prefill_start_layer=0)
    rc = mgr.send(src_ptrs, dst_ptrs, item_lens, src_pages, dst_pages)   # _send_kvcache_generic
    mgr.engine.calls                                  # [(session, src_addrs, dst_addrs, lengths)]

How it loads (nothing of SGLang is re-typed here; every function that runs is the wheel's code):

* The six wheel files that hold the planning code and its direct collaborators are executed
  from the installed wheel under their real dotted names: ``disaggregation/base/conn.py``
  (``StateType``), ``disaggregation/common/utils.py`` (``group_concurrent_contiguous``),
  ``disaggregation/utils.py`` (``build_transfer_entry_pairs``, ``is_elided_entry``),
  ``disaggregation/common/conn.py`` (``CommonKVManager.get_mla_kv_ptrs_with_pp`` /
  ``get_mha_kv_ptrs_with_pp`` / ``_mla_kv_entry_span_with_pp``) and
  ``disaggregation/mooncake/conn.py`` (``_uses_flat_entry_layout``,
  ``MooncakeKVManager._send_kvcache_generic``, ``MooncakeKVManager._transfer_data``,
  ``send_kvcache``, ``_send_mamba_state``) and ``disaggregation/ascend/conn.py``
  (``AscendKVManager.send_kvcache`` and its NPU-group ``get_mla_kv_ptrs_with_pp``).
* Package ``__init__`` files are *not* executed (``sglang/__init__.py`` alone imports
  transformers, torch and the whole runtime); the packages are registered as empty shells whose
  ``__path__`` points into the wheel, so the leaf modules above import by their real names.
* Every other import those five files make at module level -- third-party packages that are
  not installed (torch, zmq, msgspec, requests, aiohttp, prometheus_client, ...) and the rest of
  SGLang (server_args, environ, runtime_context, observability/trace, staging, ...) -- gets a
  permissive *stand-in* module. Stand-ins only satisfy module-level statements (imports, base
  classes, decorators, metric objects). ``verify_closure()`` proves that none of them is reachable
  from the code that runs in the benchmark: it walks every global name the planning functions
  (and the functions they call, transitively) load, and fails if one resolves to a stand-in.
  The shells, stand-ins, finder and that walk are ``support.package_shells``'s, shared with
  ``support.vllm_loader``.
* ``MooncakeKVManager`` is never instantiated (its ``__init__`` starts threads, sockets and a
  transfer engine). Methods run unbound with a ``types.SimpleNamespace`` as ``self`` carrying
  exactly the attributes ``_send_kvcache_generic`` reads, the real helper methods bound onto it,
  and a recording engine whose ``batch_transfer_sync`` stores its three lists and returns 0.
  A missing attribute would raise ``AttributeError``, so the namespace cannot silently stand in
  for behaviour the method needs.
* ``manager_object(cls, kv_args=..., **attrs)`` instead builds a real instance of a manager
  class without running ``__init__`` (attribute look-up made strict), so methods resolve through
  the class and ``kvplan.compat.sglang.install(cls)`` takes effect on it.
* ``load_staging(sg)`` adds the staged path: ``MooncakeKVManager.send_kvcache_staged`` (already
  in ``mooncake/conn.py``) and, from ``disaggregation/common/staging_buffer.py`` (executed from
  the wheel like the slice path's ``compute_head_slice_params``; its torch/triton imports get
  stand-ins), the real ``compute_staging_layout``, ``compute_head_slice_params``,
  ``resolve_total_kv_heads`` and ``StagingBuffer``'s ``get_ptr`` / ``get_size`` / ``fits``.
  The two GPU kernels, ``gather_all_layers_to_staging`` and ``scatter_staging_to_kv``, cannot
  run here (torch tensors on a GPU): they are *replaced* in the loaded module by
  :class:`KernelRecorder`s that keep the real signature and record each call's bound
  arguments (``support.sglang_staging`` applies SGLang's kernel semantics to a recorded call on
  host memory). ``send_kvcache_staged`` imports them from the module when called, so it reaches
  the recorders; ``verify_closure()`` then also walks the staged method and the layout
  functions.
* The three runtime-context accessors the send paths read (``get_memory``, ``get_parallel``,
  ``get_spec``) are replaced in the loaded modules by :data:`RUNTIME`'s explicit values (a plain
  GPU deployment: no unified memory, last PP rank); tests change them there.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import cast

from support.package_shells import (
    STUBBED,
    Finder,
    dist_version,
    download_wheel,
    finding,
    import_real,
    is_stub,
    unpack_once,
    walk_globals,
)

SGLANG_VERSION = "0.5.23"

#: SGLang's Mooncake engine wrapper (``load_engine_wrapper``), relative to the package.
ENGINE_WRAPPER_FILE = "srt/distributed/device_communicators/mooncake_transfer_engine.py"

# Modules executed from the wheel, in dependency order.
REAL_MODULES = (
    "sglang.srt.disaggregation.base",  # __init__ only re-exports base.conn
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.disaggregation.common.utils",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.disaggregation.ascend.conn",
)

REAL_PACKAGES = ("sglang.srt.disaggregation.base",)

# Third-party packages those files import at module level that are not installed in the bench
# venv. Only these get stand-ins; any other missing import fails loudly.
THIRD_PARTY_STANDINS = ("torch", "zmq", "msgspec", "requests", "aiohttp", "prometheus_client")


class SGLang(types.SimpleNamespace):
    """The loaded functions plus a factory for stand-in managers."""


_LOADED: SGLang | None = None

# Where the test suite keeps the downloaded wheel and the files it needs from it (ignored by git:
# .venv is). KVPLAN_SGLANG_CACHE overrides it.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CACHE = os.path.join(_REPO, ".venv", "sglang-wheel")
# The wheel members the loader executes (and the metadata that names the version).
_WHEEL_PREFIXES = ("sglang/srt/disaggregation/", "sglang/" + ENGINE_WRAPPER_FILE)


def fetch_wheel(cache_dir: str | None = None) -> str:
    """Download SGLang's wheel once (``pip download --no-deps``) and unpack the disaggregation
    package; return the unpacked ``sglang`` directory. Cached: a second call only checks files.

    Only PyPI is contacted (pip's index). Raises ``RuntimeError`` naming the pip failure.
    """
    import zipfile

    cache = cache_dir or os.environ.get("KVPLAN_SGLANG_CACHE") or DEFAULT_CACHE

    def unpack(tmp: str) -> None:
        with zipfile.ZipFile(download_wheel("sglang", SGLANG_VERSION, cache)) as zf:
            members = [n for n in zf.namelist()
                       if n.startswith(_WHEEL_PREFIXES)
                       or n == f"sglang-{SGLANG_VERSION}.dist-info/METADATA"]
            zf.extractall(tmp, members=members)

    return unpack_once(cache, f"sglang-{SGLANG_VERSION}", "sglang", unpack)


def _unpacked_version(root: str) -> str:
    return dist_version(os.path.join(os.path.dirname(root),
                                     f"sglang-{SGLANG_VERSION}.dist-info", "METADATA"))


def load_sglang(root: str | None = None) -> SGLang:
    """Load the planning modules from ``root`` (an ``sglang`` package directory, e.g. the one
    :func:`fetch_wheel` returns); by default from an installed ``sglang`` if there is one, else
    from the cached wheel (downloaded on first use)."""
    global _LOADED
    if _LOADED is not None:
        if root is not None and os.path.abspath(root) != os.path.abspath(_LOADED.root):
            raise ImportError(f"sglang already loaded from {_LOADED.root}, not {root}")
        return _LOADED
    if root is None:
        spec = importlib.util.find_spec("sglang")  # locates an install; does not execute __init__
        if spec is not None and spec.submodule_search_locations:
            root = list(spec.submodule_search_locations)[0]
            from importlib.metadata import version

            got = version("sglang")
        else:
            root = fetch_wheel()
            got = _unpacked_version(root)
    else:
        got = _unpacked_version(root)
    if got != SGLANG_VERSION:
        raise ImportError(f"expected sglang=={SGLANG_VERSION}, found {got} at {root}")

    mods = import_real(root, "sglang", REAL_MODULES, real_packages=REAL_PACKAGES,
                       standins=THIRD_PARTY_STANDINS)

    cu = mods["sglang.srt.disaggregation.common.utils"]
    du = mods["sglang.srt.disaggregation.utils"]
    cc = mods["sglang.srt.disaggregation.common.conn"]
    mc = mods["sglang.srt.disaggregation.mooncake.conn"]
    M = mc.MooncakeKVManager

    sg = SGLang(
        version=got,
        root=root,
        modules=mods,
        stubbed=sorted(set(STUBBED)),
        group_concurrent_contiguous=cu.group_concurrent_contiguous,
        build_transfer_entry_pairs=du.build_transfer_entry_pairs,
        send_kvcache_generic=M._send_kvcache_generic,
        transfer_data=M._transfer_data,
        get_mla_kv_ptrs_with_pp=M.get_mla_kv_ptrs_with_pp,
        get_mha_kv_ptrs_with_pp=M.get_mha_kv_ptrs_with_pp,
        mla_kv_entry_span_with_pp=M._mla_kv_entry_span_with_pp,
        StateType=mods["sglang.srt.disaggregation.base.conn"].StateType,
        MooncakeKVManager=M,
        CommonKVManager=cc.CommonKVManager,
        AscendKVManager=mods["sglang.srt.disaggregation.ascend.conn"].AscendKVManager,
    )
    # The helpers must be the common implementations (Mooncake does not override them).
    assert M.get_mla_kv_ptrs_with_pp is cc.CommonKVManager.get_mla_kv_ptrs_with_pp
    assert M.get_mha_kv_ptrs_with_pp is cc.CommonKVManager.get_mha_kv_ptrs_with_pp
    sg.make_manager = lambda **kw: make_manager(sg, **kw)
    sg.manager_object = lambda cls, **kw: manager_object(sg, cls, **kw)
    _install_runtime(sg)
    sg.verify_closure = lambda: verify_closure(sg)
    _LOADED = sg
    return sg


# --------------------------------------------------------------------------------------------
# Head slicing (prefill TP != decode TP)
# --------------------------------------------------------------------------------------------
STAGING_BUFFER = "sglang.srt.disaggregation.common.staging_buffer"


def load_head_slicing(sg: SGLang) -> None:
    """Execute ``disaggregation/common/staging_buffer.py`` (``compute_head_slice_params``, which
    ``send_kvcache_slice`` imports when called) from the wheel, with the loader's stand-ins for
    its GPU-only imports (torch, triton, kernels), and check the function is the wheel's."""
    if STAGING_BUFFER in sys.modules and not is_stub(sys.modules[STAGING_BUFFER]):
        return
    finder = Finder({"sglang": sg.root}, REAL_MODULES, real_packages=REAL_PACKAGES,
                    standins=(*THIRD_PARTY_STANDINS, "triton"))
    with finding(finder):
        path = os.path.join(sg.root, "srt", "disaggregation", "common", "staging_buffer.py")
        spec = importlib.util.spec_from_file_location(STAGING_BUFFER, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[STAGING_BUFFER] = mod
        spec.loader.exec_module(mod)
    fn = mod.compute_head_slice_params
    assert fn.__code__.co_filename == path, fn.__code__.co_filename
    # Everything it calls is a builtin (max): no stand-in is reachable from it.
    assert set(fn.__code__.co_names) <= {"max"}, fn.__code__.co_names


ENGINE_WRAPPER = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"


def load_engine_wrapper(sg: SGLang) -> type:
    """Execute ``distributed/device_communicators/mooncake_transfer_engine.py`` from the wheel
    and return its ``MooncakeTransferEngine`` (SGLang's wrapper around a Mooncake engine, which
    a manager's ``self.engine`` is). Its module-level imports of the rest of SGLang get
    stand-ins; ``batch_transfer_sync``, the method kvplan's fast path stands in for, only calls
    ``self.engine.batch_transfer_sync_write`` and ``logger.debug`` (checked here)."""
    if ENGINE_WRAPPER not in sys.modules or is_stub(sys.modules[ENGINE_WRAPPER]):
        path = os.path.join(sg.root, ENGINE_WRAPPER_FILE)
        if not os.path.exists(path):  # a wheel cache unpacked before this file was wanted
            import zipfile

            cache = os.path.dirname(os.path.dirname(sg.root))
            with zipfile.ZipFile(download_wheel("sglang", SGLANG_VERSION, cache)) as zf:
                data = zf.read("sglang/" + ENGINE_WRAPPER_FILE)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finder = Finder({"sglang": sg.root}, REAL_MODULES, real_packages=REAL_PACKAGES,
                        standins=THIRD_PARTY_STANDINS)
        with finding(finder):
            spec = importlib.util.spec_from_file_location(ENGINE_WRAPPER, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[ENGINE_WRAPPER] = mod
            spec.loader.exec_module(mod)
    cls = sys.modules[ENGINE_WRAPPER].MooncakeTransferEngine
    fn = cls.batch_transfer_sync
    assert fn.__code__.co_filename.startswith(sg.root), fn.__code__.co_filename
    assert set(fn.__code__.co_names) <= {"engine", "batch_transfer_sync_write", "Exception",
                                         "hasattr", "RuntimeError", "logger", "debug"}, \
        fn.__code__.co_names
    return cast(type, cls)


DCP_PACK = "sglang.srt.disaggregation.common.dcp_pack"


def load_dcp_pack(sg: SGLang) -> types.ModuleType:
    """Execute ``disaggregation/common/dcp_pack.py`` (``try_pack_dcp_src``, which
    ``send_kvcache_dcp`` imports when it is handed a pack buffer) from the wheel.

    Its gather is a Triton kernel on a CUDA device (``copy_mla_rows_into_pack``, with torch
    tensors and device streams); none of that exists here, so the loaded module's kernel is
    replaced by :func:`host_copy_mla_rows_into_pack` (the kernel's byte semantics on
    :class:`HostMemory`), ``torch.as_tensor`` by a NumPy int64 array and
    ``device_stream_context`` by a no-op context. What runs for real is SGLang's Python around
    the kernel: the size check, the call it makes, the per-layer pack pointers and the packed row
    indices ``send_kvcache_dcp`` then groups into network blocks. The pack buffer is a
    :class:`HostPackBuffer`."""
    if DCP_PACK in sys.modules and not is_stub(sys.modules[DCP_PACK]):
        return sys.modules[DCP_PACK]
    load_head_slicing(sg)  # staging_buffer (StagingBuffer, only an annotation here) is real
    finder = Finder({"sglang": sg.root}, REAL_MODULES, real_packages=REAL_PACKAGES,
                    standins=(*THIRD_PARTY_STANDINS, "triton"))
    with finding(finder):
        path = os.path.join(sg.root, "srt", "disaggregation", "common", "dcp_pack.py")
        spec = importlib.util.spec_from_file_location(DCP_PACK, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[DCP_PACK] = mod
        spec.loader.exec_module(mod)
    assert mod.try_pack_dcp_src.__code__.co_filename == path
    assert is_stub(mod.copy_mla_rows_into_pack)  # the GPU kernel: replaced on host memory
    import contextlib

    import numpy as np

    mod.copy_mla_rows_into_pack = host_copy_mla_rows_into_pack
    mod.torch = types.SimpleNamespace(
        int64=np.int64, as_tensor=lambda a, device=None, dtype=None: np.asarray(a, np.int64))
    mod.device_stream_context = lambda stream: contextlib.nullcontext()
    return mod


class HostMemory:
    """Byte regions at fake addresses (NumPy uint8 arrays): what the host kernel reads and
    writes, and what a test applies network blocks to."""

    def __init__(self) -> None:
        import numpy as np

        self._np = np
        self.regions: dict[int, object] = {}

    def add(self, base: int, data) -> None:
        self.regions[base] = data

    def view(self, addr: int, length: int):
        for base, data in self.regions.items():
            if base <= addr and addr + length <= base + data.size:
                return data[addr - base:addr - base + length]
        raise IndexError(f"[{addr:#x}, {addr + length:#x}) is in no host region")

    def apply(self, blocks) -> None:
        """Copy every ``(src, dst, length)`` block, as an engine would."""
        for src, dst, length in blocks:
            self.view(int(dst), int(length))[:] = self.view(int(src), int(length))


class _HostPack:
    """The pack "tensor" ``buffer.narrow`` gives: a byte range of host memory."""

    def __init__(self, memory: HostMemory | None, addr: int, length: int):
        self.device, self.memory, self.addr, self.length = "host", memory, addr, length


def host_copy_mla_rows_into_pack(kv_data_ptrs, row_indices, pack, token_item_lens,
                                 src_token_item_lens=None) -> None:
    """SGLang's ``copy_mla_rows_into_pack`` on host memory, byte for byte: for layer ``l`` with
    copy width ``w_l`` and source stride ``s_l`` (``src_token_item_lens``, default ``w_l``),
    pack row ``k`` of layer ``l`` (at ``sum(n * w_j for j < l) + k * w_l`` in ``pack``) gets the
    ``w_l`` bytes at ``kv_data_ptrs[l] + row_indices[k] * s_l``; same argument checks."""
    if src_token_item_lens is None:
        src_token_item_lens = token_item_lens
    if not (len(kv_data_ptrs) == len(token_item_lens) == len(src_token_item_lens)):
        raise ValueError("KV pointers, copy widths, and source strides length mismatch")
    if pack.memory is None:  # a pack buffer without host memory (the benchmark's): no bytes
        return
    n = len(row_indices)
    offset = 0
    for ptr, width, stride in zip(kv_data_ptrs, token_item_lens, src_token_item_lens):
        width = int(width)
        if width <= 0:
            raise ValueError(f"MLA token item length must be positive, got {width}")
        assert offset + n * width <= pack.length, "kernel writes past its pack slice"
        for k, row in enumerate(row_indices):
            pack.memory.view(pack.addr + offset + k * width, width)[:] = pack.memory.view(
                int(ptr) + int(row) * int(stride), width)
        offset += n * width


class _HostStream:
    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostPackBuffer:
    """The part of SGLang's ``StagingBuffer`` that ``try_pack_dcp_src`` reads (``fits``,
    ``get_size``, ``get_ptr``, ``buffer.narrow``, the gather and producer streams), for a pack
    region at address ``ptr`` of ``size`` bytes. Held in ``memory`` when one is given, so the
    host kernel gathers real bytes that can be checked; without, no kernel writes it (the
    benchmark times planning only)."""

    def __init__(self, ptr: int, size: int, memory: HostMemory | None = None):
        import numpy as np

        self.ptr, self.size, self.memory = ptr, size, memory
        if memory is not None:
            memory.add(ptr, np.zeros(size, dtype=np.uint8))
        self.buffer = types.SimpleNamespace(
            narrow=lambda dim, start, length: _HostPack(self.memory, ptr + start, length))
        self._stream = _HostStream()

    def fits(self, end: int) -> bool:
        return end <= self.size

    def get_size(self) -> int:
        return self.size

    def get_ptr(self) -> int:
        return self.ptr

    def get_gather_stream(self) -> _HostStream:
        return self._stream

    def producer_stream(self) -> _HostStream:
        return self._stream


# --------------------------------------------------------------------------------------------
# Staged transfers (send_kvcache_staged)
# --------------------------------------------------------------------------------------------
STAGING_KERNELS = ("gather_all_layers_to_staging", "scatter_staging_to_kv")


class KernelRecorder:
    """Stands in for one of SGLang's GPU staging kernels: same signature (``inspect.signature``
    gives the real one, and a call that does not bind to it raises ``TypeError`` as the real
    function would), records each call's arguments by name, moves no byte. ``gather`` returns
    what the real gather returns (the bytes it writes: every K layer then every V layer of the
    sent heads), ``scatter`` returns None like the real one."""

    def __init__(self, real):
        import functools
        import inspect

        functools.update_wrapper(self, real)
        self.real = real
        self.signature = inspect.signature(real)
        self.calls: list[dict] = []

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        self.calls.append(call)
        if self.__name__ == "gather_all_layers_to_staging":
            k = call["k_buffers"]
            tokens = len(call["page_indices_np"]) * call["page_size"]
            return (tokens * call["num_heads"] * k[0].shape[-1] * k[0].element_size()
                    * len(k) * 2)
        return None


def load_staging(sg: SGLang) -> None:
    """Add SGLang's staged path to ``sg`` (see the module docstring): ``sg.send_kvcache_staged``,
    ``sg.compute_staging_layout``, ``sg.compute_head_slice_params``,
    ``sg.resolve_total_kv_heads``, ``sg.StagingBuffer`` and the kernel recorders
    ``sg.gather_kernel`` / ``sg.scatter_kernel``. Idempotent."""
    if getattr(sg, "send_kvcache_staged", None) is not None:
        return
    load_head_slicing(sg)
    mod = sys.modules[STAGING_BUFFER]
    path = os.path.join(sg.root, "srt", "disaggregation", "common", "staging_buffer.py")
    recorders = {}
    for name in STAGING_KERNELS:
        real = getattr(mod, name)
        assert real.__code__.co_filename == path, real.__code__.co_filename
        recorders[name] = KernelRecorder(real)
        setattr(mod, name, recorders[name])
    for name in ("compute_staging_layout", "compute_head_slice_params",
                 "resolve_total_kv_heads"):
        fn = getattr(mod, name)
        assert fn.__code__.co_filename == path, (name, fn.__code__.co_filename)
    staged = sg.MooncakeKVManager.send_kvcache_staged
    assert staged.__code__.co_filename.endswith(
        os.path.join("disaggregation", "mooncake", "conn.py")), staged.__code__.co_filename
    sg.staging_module = mod
    sg.send_kvcache_staged = staged
    sg.compute_staging_layout = mod.compute_staging_layout
    sg.compute_head_slice_params = mod.compute_head_slice_params
    sg.resolve_total_kv_heads = mod.resolve_total_kv_heads
    sg.StagingBuffer = mod.StagingBuffer
    sg.gather_kernel = recorders["gather_all_layers_to_staging"]
    sg.scatter_kernel = recorders["scatter_staging_to_kv"]
    sg.staging_roots = [
        staged, mod.compute_staging_layout, mod.compute_head_slice_params,
        mod.resolve_total_kv_heads, mod.StagingBuffer.get_ptr, mod.StagingBuffer.get_size,
        mod.StagingBuffer.fits,
    ]


# --------------------------------------------------------------------------------------------
# Stand-in manager
# --------------------------------------------------------------------------------------------
class RecordingEngine:
    """Stands in for MooncakeTransferEngine: records each batch_transfer_sync call, returns 0."""

    def __init__(self):
        self.calls = []

    def batch_transfer_sync(self, session_id, src_addrs, dst_addrs, lengths):
        self.calls.append((session_id, src_addrs, dst_addrs, lengths))
        return 0


class InlineExecutor:
    """Stands in for the thread pool ``send_kvcache_slice`` is handed: runs each submitted call
    at once and returns its already finished future (timings then exclude thread hand-off)."""

    def submit(self, fn, *args):
        import concurrent.futures

        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(fn(*args))
        return f


class BlockRecorder:
    """Replaces ``_transfer_data`` to capture SGLang's plan itself (the list of
    ``(src, dst, length)`` tuples) without the zip into Mooncake's three lists."""

    def __init__(self):
        self.calls = []

    def __call__(self, session_id, transfer_blocks):
        self.calls.append(transfer_blocks)
        return 0


def make_manager(
    sg: SGLang,
    *,
    is_mla_backend: bool,
    pp_size: int = 1,
    prefill_start_layer: int = 0,
    is_hybrid_mla_backend: bool = False,
    handoff: bool = True,
    max_transfer_batch_indices: int = 0,
    num_draft_entries: int | None = None,
) -> types.SimpleNamespace:
    """A ``self`` for the unbound manager methods.

    handoff=True binds SGLang's real ``_transfer_data`` (zip into three lists, then the recording
    engine). handoff=False binds a ``BlockRecorder`` instead, so a call measures planning only.
    """
    kv_args = types.SimpleNamespace(prefill_start_layer=prefill_start_layer)
    if num_draft_entries is not None:
        kv_args.num_draft_entries = num_draft_entries
    self = types.SimpleNamespace(
        engine=RecordingEngine(),
        is_mla_backend=is_mla_backend,
        is_hybrid_mla_backend=is_hybrid_mla_backend,
        pp_size=pp_size,
        enable_custom_mem_pool=False,
        max_transfer_batch_indices=max_transfer_batch_indices,
        kv_args=kv_args,
        state_strides_validated=set(),
    )
    self.get_mla_kv_ptrs_with_pp = types.MethodType(sg.get_mla_kv_ptrs_with_pp, self)
    self.get_mha_kv_ptrs_with_pp = types.MethodType(sg.get_mha_kv_ptrs_with_pp, self)
    self._mla_kv_entry_span_with_pp = types.MethodType(sg.mla_kv_entry_span_with_pp, self)
    if handoff:
        self._transfer_data = types.MethodType(sg.transfer_data, self)
    else:
        self.blocks = BlockRecorder()
        self._transfer_data = self.blocks

    def send(src_ptrs, dst_ptrs, item_lens, src_pages, dst_pages, *, src_layer_ids=None,
             dst_layer_ids=None, session="bench", **kw):
        return sg.send_kvcache_generic(
            self, session, src_ptrs, dst_ptrs, item_lens, src_pages, dst_pages, None,
            src_layer_ids=src_layer_ids, dst_layer_ids=dst_layer_ids, **kw,
        )

    self.send = send
    return self


class RuntimeContext:
    """Explicit stand-ins for the three runtime-context accessors the manager methods read
    (``get_memory()``, ``get_parallel()``, ``get_spec()``), installed as the module globals of
    the loaded ``mooncake.conn`` / ``ascend.conn``. Their defaults are a plain GPU deployment:
    no unified memory, this rank is the last PP rank, no speculative algorithm."""

    def __init__(self) -> None:
        self.memory = types.SimpleNamespace(enable_unified_memory=False)
        self.parallel = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True))
        self.spec = types.SimpleNamespace(speculative_algorithm=None)


RUNTIME = RuntimeContext()


def _install_runtime(sg: SGLang) -> None:
    for name in ("sglang.srt.disaggregation.mooncake.conn", "sglang.srt.disaggregation.ascend.conn",
                 "sglang.srt.disaggregation.common.conn"):
        g = sg.modules[name].__dict__
        if "get_memory" in g:
            g["get_memory"] = lambda: RUNTIME.memory
        if "get_parallel" in g:
            g["get_parallel"] = lambda: RUNTIME.parallel
        if "get_spec" in g:
            g["get_spec"] = lambda: RUNTIME.spec


_STRICT: dict[type, type] = {}


def _strict_class(cls: type) -> type:
    """``cls`` with attribute look-up that fails for a missing attribute. The real classes
    inherit a stand-in mixin (``StagingManagerMixin``) whose ``__getattr__`` would answer any
    name; the subclass defines nothing else, so every method still resolves to ``cls``'s."""
    if cls not in _STRICT:
        def __getattr__(self, name):
            raise AttributeError(f"stand-in manager has no attribute {name!r}")

        _STRICT[cls] = type(f"Strict{cls.__name__}", (cls,), {"__getattr__": __getattr__})
    return _STRICT[cls]


def manager_object(sg: SGLang, cls: type, *, kv_args: types.SimpleNamespace,
                   engine=None, **attrs):
    """An instance of ``cls`` (SGLang's real manager class) built without ``__init__``: the
    methods resolve through the class (so ``install(cls)`` / ``uninstall(cls)`` take effect),
    ``self`` carries exactly the attributes given plus the bookkeeping the send paths read, and
    a missing attribute raises ``AttributeError``."""
    obj = object.__new__(_strict_class(cls))
    defaults = dict(
        engine=engine if engine is not None else RecordingEngine(),
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        pp_size=1,
        enable_custom_mem_pool=False,
        custom_mem_pool_type=None,
        max_transfer_batch_indices=0,
        state_strides_validated=set(),
        decode_kv_args_table={},
        enable_deferred_decode_kv_release=False,
        attn_tp_size=1,
        state_tp_size=1,
    )
    defaults.update(attrs)
    obj.__dict__.update(defaults)
    obj.kv_args = kv_args
    return obj


# --------------------------------------------------------------------------------------------
# Proof that no stand-in is reachable from the code that runs
# --------------------------------------------------------------------------------------------
def verify_closure(sg: SGLang) -> list[str]:
    """Walk every global the planning code loads, transitively through the module-level
    functions it reaches; raise if any resolves to a stand-in. Returns the names visited."""
    roots = [
        sg.group_concurrent_contiguous,
        sg.build_transfer_entry_pairs,
        sg.send_kvcache_generic,
        sg.transfer_data,
        sg.get_mla_kv_ptrs_with_pp,
        sg.get_mha_kv_ptrs_with_pp,
        sg.mla_kv_entry_span_with_pp,
        # the manager methods kvplan.compat.sglang replaces, and what they call on self
        sg.MooncakeKVManager.send_kvcache,
        sg.MooncakeKVManager.send_kvcache_dcp,  # and build_dcp_token_transfer_plan
        sg.MooncakeKVManager._send_mamba_state,
        sg.MooncakeKVManager._send_mamba_state_slice,  # and compute_mamba_state_slice_*
        sg.MooncakeKVManager._validate_envelope_kv_layout,
        sg.MooncakeKVManager._await_transfer_futures,
        sg.AscendKVManager.send_kvcache,
        sg.AscendKVManager.get_mla_kv_ptrs_with_pp,
        # the staged path, once load_staging() ran (its kernels are recorders, not stand-ins)
        *getattr(sg, "staging_roots", ()),
    ]
    return walk_globals(roots, ("sglang.",))


# --------------------------------------------------------------------------------------------
# Worked examples of docs/semantics.md, reproduced by the loaded code
# --------------------------------------------------------------------------------------------
def check_worked_examples(sg: SGLang) -> list[str]:
    """W-runs-basic, W-kv-fifo, W-mla-flat-plan, W-mha-halves-plan, W-mha-hybrid-stage1.

    Raises AssertionError on any difference; returns the names checked."""
    import numpy as np

    def a(*v):
        return np.array(v, dtype=np.int32)

    # W-runs-basic - runs
    got = sg.group_concurrent_contiguous(a(0, 1, 2, 5, 6, 9), a(10, 11, 12, 13, 14, 20))
    assert got == ([[0, 1, 2], [5, 6], [9]], [[10, 11, 12], [13, 14], [20]]), got
    # W-kv-fifo - K/V FIFO pairing
    got = sg.build_transfer_entry_pairs([3, 7, 3, 7], [3, 7, 11, 3, 7, 11], 4, 6)
    assert got == [(0, 0), (1, 1), (2, 3), (3, 4)], got
    # W-mla-flat-plan - generic MLA flat, pp 1
    m = sg.make_manager(is_mla_backend=True, pp_size=1)
    rc = m.send([1000, 2000], [5000, 6000], [64, 64], a(0, 1, 2, 7), a(10, 11, 12, 3))
    assert rc == 0 and m.engine.calls == [
        ("bench", [1000, 1448, 2000, 2448], [5640, 5192, 6640, 6192], [192, 64, 192, 64])
    ], m.engine.calls
    # W-mha-halves-plan - generic MHA K/V halves
    m = sg.make_manager(is_mla_backend=False, pp_size=1)
    rc = m.send([100, 200, 300, 400], [1100, 1200, 1300, 1400], [8, 8, 16, 16], a(1, 2), a(5, 6))
    assert rc == 0 and m.engine.calls == [
        ("bench", [108, 208, 316, 416], [1140, 1240, 1380, 1480], [16, 16, 32, 32])
    ], m.engine.calls
    # W-mha-hybrid-stage1 - layer-id path on an MHA (hybrid) backend, PP stage 1
    m = sg.make_manager(is_mla_backend=False, pp_size=2, prefill_start_layer=1)
    rc = m.send([10, 11, 20, 21], [100, 101, 102, 200, 201, 202], [4, 4, 4, 4], a(0, 1), a(5, 6),
                src_layer_ids=[7, 11, 7, 11], dst_layer_ids=[3, 7, 11, 3, 7, 11])
    assert rc == 0 and m.engine.calls == [
        ("bench", [10, 11, 20, 21], [121, 122, 221, 222], [8, 8, 8, 8])
    ], m.engine.calls
    # plan-only recorder gives the same blocks as tuples
    m = sg.make_manager(is_mla_backend=True, pp_size=1, handoff=False)
    m.send([1000, 2000], [5000, 6000], [64, 64], a(0, 1, 2, 7), a(10, 11, 12, 3))
    assert m.blocks.calls == [[(1000, 5640, 192), (1448, 5192, 64), (2000, 6640, 192),
                               (2448, 6192, 64)]], m.blocks.calls
    return ["W-runs-basic", "W-kv-fifo", "W-mla-flat-plan", "W-mha-halves-plan",
            "W-mha-hybrid-stage1"]


if __name__ == "__main__":
    sg = load_sglang()
    load_staging(sg)
    print(f"sglang {sg.version} from {sg.root}")
    print("executed from the wheel:", ", ".join(REAL_MODULES))
    print("stand-in modules:", ", ".join(sg.stubbed))
    print("planning closure (no stand-in reachable):")
    for name in sorted(sg.verify_closure()):
        print("   ", name)
    print("worked examples reproduced:", ", ".join(check_worked_examples(sg)))
