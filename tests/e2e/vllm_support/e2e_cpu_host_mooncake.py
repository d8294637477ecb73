"""Test support (not kvplan): vLLM's own MooncakeConnector on a host without an accelerator.

vLLM's ``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()``
for the device it binds its sender threads to; on a CPU-only host that raises ("Found no NVIDIA
driver"), although the connector's data path (Mooncake TCP between host buffers) needs no
device. ``CpuHostMooncakeConnector`` is vLLM's class unchanged except that, while vLLM's
constructor runs, the device index answers 0 (the CPU platform's ``set_device`` ignores it).
The end-to-end run uses it as the reference that proves the harness.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
)


@contextlib.contextmanager
def device_index_zero_without_accelerator() -> Iterator[None]:
    if torch.accelerator.is_available():
        yield
        return
    original = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.current_device_index = original  # type: ignore[assignment]


class CpuHostMooncakeConnector(MooncakeConnector):
    """vLLM's MooncakeConnector, constructed with device index 0 on a CPU-only host."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        with device_index_zero_without_accelerator():
            super().__init__(vllm_config, role, kv_cache_config)
