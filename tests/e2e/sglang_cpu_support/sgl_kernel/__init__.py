"""TEST SUPPORT FOR THE HOST ENGINE, not kvplan: a stand-in for SGLang's ``sgl_kernel`` on a CPU.

SGLang 0.5.23's CPU path imports CPU ops from ``sgl_kernel`` at module import time; the
package index has no ``sgl_kernel`` build for CPUs. The two ops a dense model's prefill and
decode call are given here in plain PyTorch/NumPy with the kernels' semantics, and the ops a
Qwen3-Next model adds: ``torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu`` (its gated RMSNorm,
reached through the ``sitecustomize`` route) here, and the gated-delta-net ops of its
linear-attention layers in the ``mamba`` submodule (see its docstring); every other name imports (so
SGLang's modules load) but raises when called, so a code path that needs a real kernel fails
loudly instead of computing something else.

Only the end-to-end test puts this directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from . import mamba  # noqa: F401  registers the torch.ops.sgl_kernel GDN ops SGLang looks up

STANDIN = True


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + n_i]``,
    with ``o_i`` the sum of the earlier requests' lengths (the Triton kernel's semantics)."""
    del pool_len  # the row length of req_to_token, which indexing already knows
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                               end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every buffer ``i`` (base address ``data_ptrs[i]``, ``strides[i]`` bytes per slot),
    copy slot ``src_loc[j]`` to slot ``tgt_loc[j]`` for every ``j`` (sources read first)."""
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    if src.size == 0:
        return
    rows = int(max(src.max(), tgt.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(base)
        slots = np.frombuffer(raw, dtype=np.uint8).reshape(rows, stride)
        slots[tgt] = slots[src]


_NORM_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
_NORM_LIB.define("fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) "
                 "-> Tensor")


def _fused_rmsnorm_gated_cpu(input: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                             eps: float) -> torch.Tensor:
    """Qwen3-Next's gated RMSNorm over the last dimension of ``[rows, hidden]``:
    ``rmsnorm(input) * weight * silu(gate)``, in float32, returned in ``input``'s dtype (what
    SGLang's CPU branch of ``FusedRMSNormGated`` expects from the kernel)."""
    x = input.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight.float() * x * torch.nn.functional.silu(gate.float())).to(input.dtype)


_NORM_LIB.impl("fused_rmsnorm_gated_cpu", _fused_rmsnorm_gated_cpu, "CPU")


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not available in the end-to-end test's CPU stand-in "
            "(only assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu, "
            "fused_rmsnorm_gated_cpu and the GDN ops of sgl_kernel.mamba are)")

    missing.__name__ = name
    return missing
