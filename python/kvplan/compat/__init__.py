"""Drop-in replacements for other serving engines' planning helpers, backed by kvplan's core.

Each submodule mirrors one engine's functions (names, signatures, return types and error
messages), so an engine can switch by changing an import:

* :mod:`kvplan.compat.sglang`: ``group_concurrent_contiguous`` and
  ``build_transfer_entry_pairs`` as in SGLang 0.5.23.
* :mod:`kvplan.compat.vllm`: vLLM's Mooncake and NIXL connector workers' planning methods,
  ``KvplanMooncakeConnector`` / ``KvplanNixlConnector``, and the vllm-ascend drop-in.

Nothing here is imported by ``import kvplan``.
"""

from __future__ import annotations

__all__: list[str] = []
