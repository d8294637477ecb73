"""What the torch benchmarks (``gpu_rounds``, ``torch_exec_bench``) set up alike: named byte
tensors on one device, filled from fixed seeds, and the MHA layout over one of them.

Imports torch: a benchmark imports this module where it imports torch, so that a run without
torch ends with that benchmark's own message.
"""

from __future__ import annotations

import numpy as np
import torch

import kvplan
from kvplan.testing.oracle import Memory

__all__ = ["DevicePools", "mha_layout"]


class DevicePools:
    """Named byte tensors on one device, filled from fixed seeds (the same bytes on any
    device)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, nbytes: int, seed: int | None) -> int:
        """A tensor of ``nbytes`` random bytes from ``seed`` (``None``: zeros); its address."""
        data = (
            np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
            if seed is not None
            else np.zeros(nbytes, np.uint8)
        )
        self.tensors[name] = torch.from_numpy(data).to(self.device)
        return int(self.tensors[name].data_ptr())

    def memory(self, name: str) -> Memory:
        """A CPU tensor as the NumPy reference's memory (no copy)."""
        return Memory(self.tensors[name].numpy(), int(self.tensors[name].data_ptr()))

    def snapshot(self, name: str) -> np.ndarray:
        """A host copy of a tensor's bytes."""
        return self.tensors[name].cpu().numpy().copy()


def mha_layout(pools: DevicePools, name: str, layers: int, heads: int, page: int, pages: int,
               *, tp_rank: int, tp_size: int, kv_heads: int, seed: int | None,
               head_dim: int = 128, dtype_size: int = 2) -> kvplan.Layout:
    """Per-layer K and V of one rank, token-major (NHD) pages of ``page`` tokens, in one
    tensor: layer ``l``'s K block then its V block, ``pages`` pages each."""
    item = page * heads * head_dim * dtype_size
    entry = pages * item
    base = pools.add(name, 2 * layers * entry, seed)
    k = [base + 2 * layer * entry for layer in range(layers)]
    v = [p + entry for p in k]
    return kvplan.Layout.mha(k, v, [entry] * layers, [entry] * layers, item, item,
                             list(range(layers)), page_size=page, tp_rank=tp_rank,
                             tp_size=tp_size, kv_heads=kv_heads, head_dim=head_dim,
                             dtype_size=dtype_size, memory_order="NHD")
