"""kvplan side by side with SGLang 0.5.23's own planner: the parts of bench/compare_sglang.py.

- ``scenarios``: the requests (model, page size, tokens, fragmentation) and their buffers.
- ``sides``: the same request on SGLang's real manager and on a cached ``kvplan.Template``.
- ``measure``: the interleaved timing of every scenario and the extra costs of the same run.
- ``children``: what runs in a child process (``perf`` profiles, peak memory).
- ``report``, ``analysis``, ``text``: RESULTS.md (tables, targets, the prose that explains them).
- ``chart``: chart.png.

``KVPLAN`` is the kvplan package, or None when it cannot be imported (``KVPLAN_ERR`` says why):
the comparison then runs SGLang's side only.
"""

from __future__ import annotations

from types import ModuleType

KVPLAN: ModuleType | None
try:
    import kvplan as KVPLAN

    if not hasattr(KVPLAN, "Template"):
        raise ImportError(f"kvplan at {list(getattr(KVPLAN, '__path__', []))} has no Template yet")
    KVPLAN_ERR = None
except Exception as e:  # pragma: no cover - before the core lands
    KVPLAN = None
    KVPLAN_ERR = f"{type(e).__name__}: {e}"
