"""Test support (not kvplan): kvplan's Mooncake connector, with one log line per staged request.

``KvplanMooncakeConnector`` here is kvplan's class itself (``kvplan.compat.vllm``), unchanged.
Importing this module (vLLM's connector factory does, in every process that builds the
connector) wraps ``kvplan.compat.vllm.staging.send_request`` so that, after each staged send,
the worker logs the request's numbers beside what kvplan's direct path would have written for
the very same pages:

    kvplan e2e staged: req=<stream> direct_blocks=<n> rounds=<r> network_blocks=<m>
        bytes=<b> seconds=<s>

``direct_blocks`` is the length of ``template.plan(src_pages, dst_pages)``, the direct plan of
the request alone: one Mooncake descriptor per plan block on kvplan's direct path (vLLM's own
path writes one per block and layer, never fewer). The wrapper only observes: the send, its
result and its exceptions are kvplan's. The end-to-end run (``tests/e2e/vllm_e2e.py``, the
"staged" set) compares the two counts per request; the staged benchmark reads the seconds.
"""

from __future__ import annotations

import logging
from typing import Any

from kvplan.compat.vllm import KvplanMooncakeConnector
from kvplan.compat.vllm import staging as _staging

__all__ = ["KvplanMooncakeConnector"]

# Under vLLM's logger, whose handler writes the server's log.
_log = logging.getLogger("vllm.kvplan.e2e")
LINE = "kvplan e2e staged:"


def _direct_blocks(staged: Any) -> int:
    return len(staged.template.plan(staged.src_pages, staged.dst_pages))


def _observed(send: Any) -> Any:
    def send_request(worker: Any, staged: Any, session: str, **kwargs: Any) -> Any:
        report = send(worker, staged, session, **kwargs)
        try:
            direct = _direct_blocks(staged)
        except Exception as exc:  # the observation must never fail the request
            _log.warning("%s req=%s direct plan failed: %s: %s", LINE, report.request,
                         type(exc).__name__, exc)
            return report
        _log.info("%s req=%s direct_blocks=%d rounds=%d network_blocks=%d bytes=%d "
                  "seconds=%.6f", LINE, report.request, direct, report.rounds,
                  report.network_blocks, report.bytes, report.seconds)
        return report

    send_request.__wrapped__ = send  # type: ignore[attr-defined]
    return send_request


if not hasattr(_staging.send_request, "__wrapped__"):
    _staging.send_request = _observed(_staging.send_request)
