"""vllm-ascend 0.23.0.post1 integration: not implemented yet (docs/vllm.md, "Not done yet").

Importing this module imports nothing from vllm-ascend or vLLM.
"""

from __future__ import annotations

__all__: list[str] = []
