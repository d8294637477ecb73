"""kvplan's two per-request series, one definition for every engine that exports them.

* ``kvplan:plan_time_seconds``: seconds kvplan spent planning one request's transfer;
* ``kvplan:blocks_per_request``: the blocks (transfer entries) of that plan.

vLLM's connector exports them through vLLM's connector stats (``compat.vllm.metrics``);
SGLang's drop-ins through SGLang's multi-process Prometheus directory
(``compat.sglang.metrics``). Both use these names, help texts and bucket edges, so one
dashboard reads either engine.
"""

from __future__ import annotations

__all__ = ["BLOCKS_BUCKETS", "BLOCKS_HELP", "BLOCKS_METRIC", "PLAN_TIME_BUCKETS",
           "PLAN_TIME_HELP", "PLAN_TIME_METRIC"]

PLAN_TIME_METRIC = "kvplan:plan_time_seconds"
BLOCKS_METRIC = "kvplan:blocks_per_request"

PLAN_TIME_HELP = "Seconds kvplan spent planning one request's KV-cache transfer."
BLOCKS_HELP = "Blocks (transfer entries) in kvplan's plan of one request."

# A plan takes microseconds (a few contiguous runs) to a few hundred milliseconds (hundreds of
# thousands of fragmented blocks).
PLAN_TIME_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                     0.05, 0.1, 0.25, 0.5, 1.0)
# One block (one contiguous run per region) to about a million (every block of every region
# on its own).
BLOCKS_BUCKETS = tuple(float(4**i) for i in range(11))
