"""A round's gather (KV memory into the prefill arena) or scatter (the decode arena into KV
memory) on host memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvplan._core import TransferPlan, copy_local

__all__ = ["local_copy"]


def local_copy(src_buffers: Sequence[Any], dst_buffers: Sequence[Any], *,
               threads: int | None = None) -> Callable[[TransferPlan], int]:
    """``plan -> kvplan.copy_local(plan, src_buffers, dst_buffers, threads=threads)``: what
    ``send_staged(gather=...)`` (KV buffers into ``[arena.array]``) and
    ``ReceiveStaged(scatter=...)`` (``[arena.array]`` into the KV buffers) take. The buffers are
    borrowed at each call; every block is checked against them first (``IndexBoundsError``
    naming it, nothing copied)."""
    src, dst = list(src_buffers), list(dst_buffers)

    def run(plan: TransferPlan) -> int:
        return copy_local(plan, src, dst, threads=threads)

    return run
