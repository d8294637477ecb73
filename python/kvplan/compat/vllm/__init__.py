"""vLLM 0.33 integration: kvplan plans the Mooncake connector's per-request transfers.

(For vLLM's NIXL connector, ``install`` dispatches to :mod:`kvplan.compat.vllm.nixl`, which
replaces the per-request descriptor-id computation.)

``install(MooncakeConnectorWorker)`` replaces two methods on the class (``uninstall`` restores
exactly what was there); docs/vllm.md has the full account:

* ``_build_transfer_params(ready_reqs, agent_meta, local_regions, remote_regions)``: one
  ``kvplan.Template`` per KV group of a peer's aligned ``TransferRegion`` lists (cached per
  peer layout: vLLM hands the same prepared lists for a peer until it re-registers), built from
  each region's base address, block stride, block length and group, with the head-slice offsets
  and lengths vLLM's own ``_get_sender_transfer_plan`` gives for the TP ranks. Per request,
  vLLM's rules run as vLLM runs them (KV group count check, Mamba null blocks dropped, partial
  prefix trimmed to the remote's count, descending stretches read ascending as vLLM 0.34
  reads them, ``_logical_to_kernel_block_ids``); then the ready
  requests are planned together, one ``Template.plan_batch`` per group, instead of a run
  split and a Python list entry per block for every region of every request: a block that
  runs on from one request's blocks into the next request's on both sides is one block. It
  returns the three columns as uint64 arrays. vLLM's verdict stays per call (one status for
  all the ready requests it sends); a request kvplan refuses, or two requests writing one
  decode block, go to ``err_reqs`` and move nothing, and the others are planned without them.
* ``_send_blocks``: hands those arrays to the engine in batches of at most
  ``max_blocks_per_batch`` entries, with vLLM's stats and logging; the first non-zero status
  is returned. When ``self.engine`` is vLLM's real ``mooncake.engine.TransferEngine`` of the
  wheel kvplan's native hand-off was verified against, the columns go to Mooncake's native
  batch API as they are (through the worker's :class:`kvplan.engines.mooncake.Handoff`: no
  Python int per block, the GIL released), after a self-test transfer to the worker's own
  session at first use; otherwise (any other engine object, a failed self-test,
  ``KVPLAN_MOONCAKE_NATIVE=0``) each column becomes one list, sliced per batch, for
  ``batch_transfer_sync_write``. :func:`handoff` says which path a worker took and why.

What stays vLLM's: region preparation and alignment by layer name, the TP pairing of ranks
(which prefill rank sends to which decode rank), handshakes, the engine and every error path.
Differences: a request whose blocks kvplan refuses (a negative block id, or a local block past
its registered buffer: vLLM reads or writes outside the buffer) is put in ``err_reqs`` with the
typed error's message instead of being sent; a region whose head slice does not fit its block
(vLLM asserts) fails the requests it would serve the same way.

``KvplanMooncakeConnector`` is vLLM's ``MooncakeConnector`` (three-argument constructor,
``SupportsHMA``) whose worker plans with kvplan and which reports vLLM's Mooncake stats and
Prometheus series plus kvplan's planning time and blocks per request
(``kvplan.compat.vllm.metrics``), for
``--kv-transfer-config '{"kv_connector": "KvplanMooncakeConnector",
"kv_connector_module_path": "kvplan.compat.vllm", ...}'``: no monkeypatching.

Nothing of vLLM is imported when this package is imported; the connector class is built on
first access.

The package is split by job, each module depending only on those below it: :mod:`.connector`
(``KvplanMooncakeConnector``, ``register_plugin``; :mod:`.cpu_host` lets vLLM's worker start
without an accelerator), :mod:`.install` (install / uninstall), :mod:`.plan`
(``_build_transfer_params``) over :mod:`.templates` (templates per peer layout) and
:mod:`.columns`, :mod:`.submit` (``_send_blocks``, the Mooncake hand-off), :mod:`.nixl` (the
NIXL drop-in), and at the bottom :mod:`.forms` (the host forms kvplan requires) and
:mod:`.metrics` (the connector's stats and Prometheus series). :mod:`.ascend` is the
vllm-ascend drop-in, on its own.
"""

from __future__ import annotations

from typing import Any

from kvplan.compat.vllm import nixl
from kvplan.compat.vllm.columns import BlockColumn
from kvplan.compat.vllm.connector import CONNECTOR_NAME, _connector_class, register_plugin
from kvplan.compat.vllm.install import REPLACED_METHODS as REPLACED_METHODS
from kvplan.compat.vllm.install import install, installed, uninstall
from kvplan.compat.vllm.plan import plan_ready, plan_request
from kvplan.compat.vllm.submit import DEFAULT_MAX_BLOCKS_PER_BATCH, handoff
from kvplan.compat.vllm.templates import MAX_PEER_LAYOUTS

# Internals the benchmarks and tests reach through the package, as they did when it was one
# module (index_array: the core's block-id reader the drop-in plans with).
from kvplan._core import index_array as index_array
from kvplan.compat.vllm.columns import _column as _column
from kvplan.compat.vllm.submit import _lengths_list as _lengths_list
from kvplan.compat.vllm.submit import _native as _native
from kvplan.compat.vllm.templates import _templates as _templates

# KvplanMooncakeConnector is built on first access by the module's __getattr__ (it subclasses
# vLLM's connector, which is imported only then), so it has no module-level definition.
__all__ = ["install", "uninstall", "installed", "plan_request", "plan_ready",  # noqa: F822
           "DEFAULT_MAX_BLOCKS_PER_BATCH", "KvplanMooncakeConnector", "BlockColumn",
           "CONNECTOR_NAME", "MAX_PEER_LAYOUTS", "handoff", "register_plugin"]


def __getattr__(name: str) -> Any:
    if name == "KvplanMooncakeConnector":
        return _connector_class()
    if name == "KvplanMooncakeConnectorWorker":
        return _connector_class().Worker  # type: ignore[attr-defined]
    if name == "KvplanNixlConnector":
        return nixl.connector_class()
    if name == "KvplanNixlConnectorWorker":
        return nixl.connector_class().Worker  # type: ignore[attr-defined]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
