"""The scheduler side: what it carries to the workers in vLLM's connector metadata.

:func:`note_finished` keeps the block ids of requests vLLM keeps for a decode, and on the
decode the requests vLLM finished early (aborted, failed); :func:`attach_sent_blocks` puts them
in the next metadata (:data:`SENT_BLOCKS_META`, :data:`ABORTED_META`)."""

from __future__ import annotations

from typing import Any


#: The attribute kvplan's scheduler side adds to vLLM's connector metadata: the block ids per
#: KV group vLLM gave each request of ``reqs_to_send`` (its ``remote_block_ids``).
SENT_BLOCKS_META = "kvplan_send_blocks"
#: The scheduler-side connector attribute holding the block ids of finished requests until
#: the next metadata carries them.
SENT_BLOCKS_ATTR = "_kvplan_sent_blocks"
#: The attribute kvplan's scheduler side adds to vLLM's connector metadata on the decode: the
#: requests vLLM finished other than by completing them (aborted, failed) whose KV was to be
#: received; a staged read of one still in progress stops (:func:`stop_aborted_reads`).
ABORTED_META = "kvplan_aborted_reads"
#: The scheduler-side connector attribute holding those requests until the next metadata.
ABORTED_ATTR = "_kvplan_aborted_reads"
#: vLLM's request statuses of a request that completed (any other finished status ends it
#: early: an abort, an error).
COMPLETED_STATUSES = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED",
                                "FINISHED_REPETITION"})


def note_finished(connector: Any, request: Any, outcome: Any) -> None:
    """The scheduler side's ``request_finished``, after vLLM's: a request whose blocks vLLM
    keeps for a decode (``outcome`` ``(True, params)``) has its ``remote_block_ids`` kept
    until the next connector metadata carries them to the workers. On the decode, a request
    whose KV was to be received (vLLM's ``update_state_after_alloc`` marked its
    ``kv_transfer_params`` ``_remote_blocks_processed``) and that finished other than by
    completing (aborted, failed) is kept too, for :func:`stop_aborted_reads`."""
    params = getattr(request, "kv_transfer_params", None)
    status = getattr(request, "status", None)
    status = getattr(status, "name", status)
    if isinstance(params, dict) and params.get("_remote_blocks_processed") and \
            not params.get("do_remote_decode") and str(status) not in COMPLETED_STATUSES:
        connector.__dict__.setdefault(ABORTED_ATTR, set()).add(str(request.request_id))
    try:
        delay, params = outcome
    except (TypeError, ValueError):
        return
    blocks = params.get("remote_block_ids") if delay and isinstance(params, dict) else None
    if blocks:
        connector.__dict__.setdefault(SENT_BLOCKS_ATTR, {})[str(request.request_id)] = [
            [int(b) for b in g] for g in blocks]


def attach_sent_blocks(connector: Any, metadata: Any) -> Any:
    """The scheduler side's ``build_connector_meta``, after vLLM's: the kept block ids of the
    requests in its ``reqs_to_send`` go with it (:data:`SENT_BLOCKS_META`), and the decode's
    requests finished early since the last metadata (:data:`ABORTED_META`, sorted)."""
    kept: dict[str, list[list[int]]] = connector.__dict__.get(SENT_BLOCKS_ATTR) or {}
    sending = getattr(metadata, "reqs_to_send", None) or {}
    setattr(metadata, SENT_BLOCKS_META,
            {r: kept.pop(r) for r in list(sending) if r in kept})
    aborted: set[str] = connector.__dict__.pop(ABORTED_ATTR, None) or set()
    setattr(metadata, ABORTED_META, sorted(aborted))
    return metadata
