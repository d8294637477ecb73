"""The decode's held check: asking the prefill to hold a request before vLLM's own read.

:func:`check_held` asks the prefill's listener whether it still holds the request with the
pages the read names, in every KV group; vLLM's read starts on the acknowledgement
(:class:`kvplan.compat.vllm.nixl_staging.handles.HeldRead`)."""

from __future__ import annotations

from typing import Any

from kvplan.compat.vllm.nixl_staging.handles import HeldRead, RefusedRead, _said_refused
from kvplan.compat.vllm.nixl_staging.names import (
    HOLD_GROUPS_KEY,
    HOLD_KEY,
    HOLD_ONE_GROUP,
    HOLD_VERSION,
    _opening_message,
    _read_names,
)
from kvplan.compat.vllm.nixl_staging.peers import peer_agreement
from kvplan.compat.vllm.nixl_staging.worker import _staging_log, worker_staging


#: The worker attribute holding the peers already said to take no held check.
UNCHECKED_ATTR = "_kvplan_unchecked_peers"


def check_held(worker: Any, read_spec: Any, dst_engine_id: str, request_id: str,
               remote_request_id: str, start: Any) -> bool | None:
    """The decode's ``_read_blocks`` before vLLM's own (direct) read of a prefill it
    negotiated staging with: the prefill's listener is asked whether it still holds
    ``remote_request_id`` with exactly the pages the read names (the staged stream's rule,
    :meth:`SendLeases.hold`), which pins it there until vLLM's notification frees it or a
    bounded time passes. ``start`` runs vLLM's own read (its ``_read_blocks`` with the same
    arguments). Nothing here waits for the answer: vLLM's step goes on.

    Every KV group the read names is checked: the question carries the prefill's pages per
    group and the prefill checks each against vLLM's block ids of that group for the request.

    None: nothing to ask (staging off here, no agreement with that prefill, a full
    prefix-cache hit, or, said once per peer, a prefill whose message offers no held check,
    a read of several KV groups from a prefill answering only the one-group form, or a
    region-mapped read, ``block_ids_by_region``, whose pages are per region, not per group):
    vLLM's read runs now, unchecked. True: the question is out and a
    :class:`HeldRead` waits in ``_recving_transfers``; vLLM's polling starts vLLM's read once
    the prefill acknowledged. False: the prefill's listener cannot be reached; a
    :class:`RefusedRead` with the verdict naming the read's blocks waits there for vLLM's
    failed-receive path and nothing is read."""
    from kvplan.failures import FailureVerdict
    from kvplan.staging.wire import WireError, decode

    state = worker_staging(worker)
    if state is None:
        return None
    peer = peer_agreement(worker, dst_engine_id, read_spec.remote_rank)
    if peer is None or not peer.outcome.staged or peer.message is None:
        return None  # no kvplan listener negotiated with that prefill: today's read
    names = _read_names(worker, read_spec, dst_engine_id, remote_request_id)
    session = names.session
    offered = peer.message.get(HOLD_KEY)
    if not isinstance(offered, int) or isinstance(offered, bool) or offered < HOLD_ONE_GROUP:
        _said_unchecked(worker, session, "offers no held check (an older kvplan)")
        return None
    if not any(len(g) for g in read_spec.local_block_ids):
        return None  # a full prefix-cache hit: vLLM reads nothing
    if read_spec.block_ids_by_region:
        _said_unchecked(worker, session, "is read region by region (block_ids_by_region: "
                        "pages per region, not per KV group)")
        return None
    form = HOLD_VERSION if peer.message.get(HOLD_GROUPS_KEY) == HOLD_VERSION or \
        offered >= HOLD_VERSION else HOLD_ONE_GROUP
    local_ids, remote_ids = names.trimmed()
    src_pages = [[int(p) for p in g] for g in remote_ids]
    if form == HOLD_ONE_GROUP and sum(1 for g in src_pages if g) != 1:
        _said_unchecked(worker, session, "answers the held check of one KV group only (an "
                        "older kvplan), and its reads name several")
        return None
    stream = f"hold:{names.stream}"
    blocks = {g: tuple(sorted({int(b) for b in ids})) for g, ids in enumerate(local_ids)
              if len(ids)}
    wait_s = float(state.config.timeout_s) + 1.0  # the prefill's own wait, and 1 s
    handle = HeldRead(worker, request_id, remote_request_id, session, stream, blocks, start,
                      wait_s)

    def on_message(data: bytes) -> None:  # the channel's reader thread
        try:
            handle.answered(decode(data))
        except WireError as exc:
            handle.answered(exc)

    channel = state.channel_to(session, peer.message)
    if channel is None:
        reason = (f"unreachable: the staging listener of {session} cannot be reached, and "
                  "a read of a prefill that negotiated staging is not made unchecked")
    else:
        handle.channel = channel
        state.router.open(stream, 0, on_message)
        try:
            channel.open(_opening_message(state, worker, stream=stream,
                                         request=remote_request_id, held_pages=src_pages,
                                         hold_form=form))
        except Exception as exc:
            state.router.close(stream)
            reason = f"unreachable: asking {session} failed ({type(exc).__name__}: {exc})"
        else:
            worker._recving_transfers[request_id].append(handle)
            return True
    verdict = FailureVerdict(request_id, blocks, reason)
    _said_refused(verdict, remote_request_id)
    worker._recving_transfers[request_id].append(RefusedRead(verdict))
    return False


def _said_unchecked(worker: Any, session: str, why: str) -> None:
    """Say once per prefill rank (``session``) that vLLM's direct reads of it run unchecked,
    and why."""
    said = worker.__dict__.setdefault(UNCHECKED_ATTR, set())
    if (session, why) not in said:
        said.add((session, why))
        _staging_log.warning("kvplan staging: %s %s: vLLM's direct reads of it run unchecked",
                             session, why)
