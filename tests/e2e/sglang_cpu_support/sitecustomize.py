"""TEST SUPPORT FOR THE HOST ENGINE, not kvplan: runs SGLang 0.5.23's prefill on a CPU.

SGLang's prefill takes a pinned-memory and CUDA-event branch (``_send_kv_chunk``) whenever the
KV sender class sets ``supports_host_tensor_indices``, as Mooncake's does; on a machine without
an NVIDIA driver that branch dies. With the attribute False, SGLang's own CPU-side branch
computes the page indices. SGLang spawns its schedulers, so the change is made in every process
that imports SGLang's Mooncake module: this ``sitecustomize`` (on ``PYTHONPATH`` only in the
end-to-end test) adds an import hook that sets the attribute right after the module has run.
It imports nothing of SGLang itself.
"""

from __future__ import annotations

import importlib.abc
import sys

_TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _AfterExec(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.MooncakeKVSender.supports_host_tensor_indices = False

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _HostEngineCpuFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        # Only the finders after this one (kvplan's hook asks only those after it too).
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            if not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExec(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _HostEngineCpuFinder())
