"""vLLM's Mooncake worker built on a host without an accelerator: its module's ``torch``
answers ``accelerator.current_device_index()`` with 0 while the worker is constructed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_MODULE_TORCH_LOCK = threading.Lock()


class _AcceleratorFree:
    """``torch.accelerator`` for a host without an accelerator: ``current_device_index()``
    answers 0 instead of raising; everything else is torch's."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def current_device_index(self) -> int:
        # vLLM's worker only hands this index to current_platform.set_device, which is a
        # no-op on the CPU platform; 0 is what a one-device host reports.
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


class _TorchWithoutAccelerator:
    """The ``torch`` module as vLLM's connector module sees it while its worker is built on a
    host without an accelerator (every attribute but ``accelerator`` is torch's own)."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.accelerator = _AcceleratorFree(torch.accelerator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _has_accelerator(torch: Any) -> bool:
    try:
        return bool(torch.accelerator.is_available())
    except Exception:  # a torch without the accelerator API, or one that cannot tell
        return False


@contextlib.contextmanager
def _worker_device_on_cpu(module: Any) -> Iterator[None]:
    """While vLLM's ``MooncakeConnectorWorker.__init__`` runs on a host with no accelerator,
    its module's ``torch`` answers ``accelerator.current_device_index()`` with 0 (vLLM asks
    for it unconditionally and torch raises there); vLLM's code is not edited and the module
    gets its own ``torch`` back afterwards. With an accelerator nothing is changed."""
    torch = getattr(module, "torch", None)
    if torch is None or _has_accelerator(torch):
        yield
        return
    with _MODULE_TORCH_LOCK:
        module.torch = _TorchWithoutAccelerator(torch)
        try:
            yield
        finally:
            module.torch = torch
