"""Local plan steps on torch tensors: a block executor and layouts read from KV cache tensors.

``import kvplan`` never imports this package; ``import kvplan.torch`` imports torch (the
``kvplan[torch]`` extra) and raises ``ImportError`` saying so when it is missing.

- :class:`TorchExecutor` runs a block plan (a ``TransferPlan``, ``BlockSlice`` or ``BatchPlan``:
  the gather or scatter of ``Template.plan_staged``, the gather of ``Template.plan_packed``, or
  any plan whose both sides are memory of this process) and the row gather of
  ``Template.plan_row_gather`` on the tensors that back the plan's addresses; given a
  multi-stage plan, every stage in the order :func:`kvplan.exec.stages` gives (it is a
  :class:`kvplan.exec.Executor`, as the NumPy executor of :mod:`kvplan.exec.numpy` is). The engine hands
  it those tensors (its KV cache tensors, its staging or pack buffers); each block is
  translated to (tensor, byte offset) and the copies run as a few batched tensor operations
  (``index_select`` / ``index_copy_`` over byte rows), no custom kernel and no Python loop per
  block.
- :func:`layout_from_tensors` builds a :class:`kvplan.Layout` from an engine's KV cache tensors
  (vLLM's per-layer ``[2, num_blocks, block_size, heads, head_dim]``, SGLang's per-layer K and V
  token buffers, cross-layer ``[num_blocks, layers, ...]`` pools), with every address, size and
  stride read from the tensors.

**Devices.** Only standard tensor operations are used (``view``, ``index_select``,
``index_copy_``, ``copy_``, ``repeat_interleave``), so the executor works the same on CPU,
CUDA and Ascend NPU tensors (``torch_npu`` implements the same operations for ``npu`` tensors)
and never moves data through the host: the index arrays are built on the tensors' device and
every copy between two tensors of one device stays on it. On an accelerator the copies are
enqueued on the current stream, asynchronously like any tensor operation: synchronise (or
record an event) before handing the written memory to a transfer engine. A block between
tensors of two devices is copied through the source device's rows and ``Tensor.to``.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (imported here so a missing torch fails at once)
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "kvplan.torch needs PyTorch, which is not installed: pip install 'kvplan[torch]' "
        "(or any torch >= 2.1)"
    ) from exc

from kvplan.torch._executor import BlockColumns, TorchExecutor
from kvplan.torch._layout import layout_from_tensors

__all__ = ["BlockColumns", "TorchExecutor", "layout_from_tensors"]
