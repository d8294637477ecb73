"""TEST SUPPORT FOR THE HOST ENGINE, not kvplan: runs SGLang 0.5.23 on a CPU without a GPU.

SGLang spawns its schedulers, so each change is made in every process that imports the SGLang
module concerned: this ``sitecustomize`` (on ``PYTHONPATH`` only in the end-to-end test) adds an
import hook that adjusts a module right after it has run. It imports nothing of SGLang itself.
Three GPU assumptions on SGLang's CPU path are steered to code SGLang already has:

* ``sglang.srt.disaggregation.mooncake.conn``: SGLang's prefill takes a pinned-memory and
  CUDA-event branch (``_send_kv_chunk``) whenever the KV sender class sets
  ``supports_host_tensor_indices``, as Mooncake's does; without an NVIDIA driver that branch
  dies. With the attribute False, SGLang's own CPU-side branch computes the page indices.
* ``sglang.kernels.ops.attention.fla.fused_norm_gate`` (Qwen3-Next's gated RMSNorm after the
  linear attention): ``FusedRMSNormGated.forward`` calls a Triton kernel unless the module flag
  ``_use_cpu`` is set, which SGLang sets only on CPUs with AMX; set here, the CPU branch calls
  ``torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu`` (the ``sgl_kernel`` stand-in has it).
* ``torch.get_device_module()`` with no device: the package index's torch 2.14.1 is a CUDA
  build, whose answer is ``torch.cuda`` even without a GPU, and Qwen3-Next's
  ``Qwen3GatedDeltaNet.__init__`` asks it for ``current_device()``, which then initialises
  CUDA and raises. A CPU build of torch answers ``torch.cpu``; so does this, when CUDA is not
  available (installed when SGLang's Qwen3-Next model module is imported).
* ``sglang.srt.disaggregation.nixl.conn``: SGLang's ``NixlKVManager`` names its KV pool, state
  buffers and transfer descriptors with the NIXL memory kind ``"VRAM"`` (its own ``DRAM`` kind
  is only for a host-resident pool). NIXL's UCX backend refuses a ``VRAM`` region that UCX sees
  as host memory ("VRAM memory is detected as host by UCX ... VRAM registration cannot
  proceed"), and on a CPU every pool is host memory. When CUDA is not available, the NIXL
  agent's methods that take a memory kind get ``"DRAM"`` for ``"VRAM"``: the kind that
  describes where the bytes are, for every caller (SGLang's manager and kvplan's alike).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType


def _host_tensor_indices_off(module: ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _gated_rmsnorm_cpu_branch(module: ModuleType) -> None:
    module._use_cpu = True


def _cpu_device_module(module: ModuleType) -> None:
    import torch

    original = torch.get_device_module
    if getattr(original, "_kvplan_e2e_cpu", False):
        return

    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return original(device)

    get_device_module._kvplan_e2e_cpu = True  # type: ignore[attr-defined]
    torch.get_device_module = get_device_module


def _nixl_host_memory_kind(module: ModuleType) -> None:
    import torch

    if torch.cuda.is_available():
        return
    try:
        from nixl._api import nixl_agent
    except ImportError:  # NIXL not installed: SGLang raises its own error when it is asked for
        return
    if getattr(nixl_agent, "_kvplan_e2e_dram", False):
        return

    def host_kind(method, position):
        def call(self, *args, **kwargs):
            if kwargs.get("mem_type") == "VRAM":
                kwargs["mem_type"] = "DRAM"
            elif len(args) > position and args[position] == "VRAM":
                args = (*args[:position], "DRAM", *args[position + 1:])
            return method(self, *args, **kwargs)

        call.__name__ = method.__name__
        call.__doc__ = method.__doc__
        return call

    # (method, index of mem_type among the positional arguments after self)
    for name, position in (("register_memory", 1), ("query_memory", 2),
                           ("get_reg_descs", 1), ("get_xfer_descs", 1),
                           ("prep_xfer_dlist", 2)):
        setattr(nixl_agent, name, host_kind(getattr(nixl_agent, name), position))
    nixl_agent._kvplan_e2e_dram = True


_AFTER_IMPORT: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.disaggregation.nixl.conn": _nixl_host_memory_kind,
    "sglang.srt.disaggregation.mooncake.conn": _host_tensor_indices_off,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _gated_rmsnorm_cpu_branch,
    "sglang.srt.models.qwen3_next": _cpu_device_module,
}


class _AfterExec(importlib.abc.Loader):
    def __init__(self, loader, fix: Callable[[ModuleType], None]):
        self._loader = loader
        self._fix = fix

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._fix(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _HostEngineCpuFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        fix = _AFTER_IMPORT.get(fullname)
        if fix is None:
            return None
        # Only the finders after this one (kvplan's hook asks only those after it too).
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            if not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExec(spec.loader, fix)
                return spec
        return None


sys.meta_path.insert(0, _HostEngineCpuFinder())
