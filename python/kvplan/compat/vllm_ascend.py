"""vllm-ascend 0.23 integration (placeholder module; see docs/vllm.md)."""

from __future__ import annotations
