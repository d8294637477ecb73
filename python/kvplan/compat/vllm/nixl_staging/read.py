"""The decode's staged read: vLLM's read of one request and prefill rank as staged rounds.

:func:`staged_read` plans the rounds, opens the stream on the prefill's listener, and reads
each round out of the prefill's arena through NIXL into the KV cache; vLLM polls its
:class:`kvplan.compat.vllm.nixl_staging.handles.StagedRead`."""

from __future__ import annotations

from typing import Any

from kvplan.compat.vllm.grouped import GroupedRead, said_unstaged
from kvplan.compat.vllm.nixl_layout import local_layout
from kvplan.compat.vllm.nixl_staging.aborts import _take_pending_abort
from kvplan.compat.vllm.nixl_staging.handles import AbortedRead, StagedRead, _agent
from kvplan.compat.vllm.nixl_staging.groups import region_reads
from kvplan.compat.vllm.nixl_staging.names import (
    GROUPS_KEY,
    GROUPS_TP_KEY,
    GROUPS_TP_VERSION,
    GROUPS_VERSION,
    LEASE_KEY,
    _opening_message,
    _read_names,
)
from kvplan.compat.vllm.nixl_staging.peers import peer_agreement
from kvplan.compat.vllm.nixl_staging.tp import _say_unstaged, _tp_pair_staged
from kvplan.compat.vllm.nixl_staging.worker import _staging_log, kv_buffers, worker_staging


def staged_read(worker: Any, read_spec: Any, dst_engine_id: str, request_id: str,
                remote_request_id: str, expected_consumers: int) -> bool:
    """The decode's ``_read_blocks`` for one request and prefill rank, staged where it can
    be: staging on, the prefill agreed, its KV regions and this worker's have layouts, TP
    sizes :func:`_tp_pair_staged` takes, a block-size ratio :func:`_ratio_pages` takes (the
    decode's blocks larger, each side's layout at its own block size), no DCP, Mamba state or
    mixed memory, and :func:`kvplan.staging.choose_path` says staged. A read of several KV groups
    (a hybrid model's) is one request of every group's pages (:func:`_grouped_read`). Between
    TP sizes the core plans the head slice the two ranks share (the layouts carry their TP
    coordinates), and the rounds must move the bytes vLLM's read of this prefill rank moves
    (else not staged, said once).
    Then the rounds are read from the prefill's arena through NIXL, scattered into this
    worker's KV cache, and a :class:`StagedRead` waits in ``_recving_transfers``; True.
    False: vLLM's own read runs (nothing was sent)."""
    import kvplan
    from kvplan.compat.vllm import staging as vstaging
    from kvplan.staging import (
        NixlRoundReader,
        ReceiveStaged,
        StagingAgreement,
        choose_path,
        local_copy,
    )

    state = worker_staging(worker)
    if state is None or not vstaging.host_kv(worker) or read_spec.block_ids_by_region:
        return False
    peer = peer_agreement(worker, dst_engine_id, read_spec.remote_rank)
    if peer is None or not peer.outcome.staged or peer.layout is None or peer.message is None:
        return False
    d = worker.__dict__
    topo = d.get("transfer_topo")
    info = topo.get_engine_info(dst_engine_id)
    local_ids, remote_ids = read_spec.local_block_ids, read_spec.remote_block_ids
    if d.get("_mixed_mem_types") or d.get("_has_mamba") or \
            not any(len(g) for g in local_ids) or int(d.get("dcp_size", 1) or 1) > 1 or \
            int(getattr(info, "remote_dcp_size", 1) or 1) > 1:
        return False  # no DCP, no Mamba: else vLLM's read
    # the decode's block size over the prefill's (vLLM's own: 1, or the decode's larger)
    ratio = int(topo.block_size_ratio(info.remote_block_size))
    layout = local_layout(worker)
    if layout is None:
        return False
    remote_tp = int(getattr(info, "remote_tp_size", 0) or 0)
    if not _tp_pair_staged(worker, dst_engine_id, remote_tp, peer.layout, layout):
        return False  # TP sizes whose head slices vLLM reads otherwise: said once
    # vLLM's own trim of the decode's prefix-cache hit, as its read does
    names = _read_names(worker, read_spec, dst_engine_id, remote_request_id)
    if ratio == 1:
        local_ids, remote_ids = names.trimmed()
    else:
        pages = _ratio_pages(worker, dst_engine_id, remote_tp, names, ratio, peer.layout, layout)
        if pages is None:
            return False  # a ratio whose read kvplan does not stage exactly: said once
        local_ids, remote_ids = pages
    agreement = peer.outcome
    if not isinstance(agreement, StagingAgreement):
        return False
    grouped = _grouped_read(worker, peer, dst_engine_id, names.session, remote_tp,
                            local_ids, remote_ids) if len(local_ids) != 1 else None
    if len(local_ids) != 1 and grouped is None:
        return False  # several KV groups kvplan does not stage: said once, vLLM's read
    request: Any
    if grouped is None:
        src_layout, dst_layout = peer.layout, layout
        src = kvplan._core.index_array(list(remote_ids[0]))
        dst = kvplan._core.index_array(list(local_ids[0]))
        request = kvplan.Request(src, dst)
    else:  # one request of every group's pages, its regions a pool each where they are
        page = GroupedRead.pool_page_size(peer.layout, layout)
        src_layout, dst_layout = grouped.layout(peer.layout, page), grouped.layout(layout, page)
        request = grouped.request(page)
        src, dst = request.src, request.dst
    template: Any = kvplan.Template(src_layout, dst_layout, kvplan.Pairing.positional())
    choice = choose_path(template, request, state.costs, agreement, mode=state.config.mode)
    if not choice.staged:
        return False
    try:
        arenas = dict(src_arena=agreement.src_arena, dst_arena=agreement.dst_arena,
                      buffers=agreement.buffers)
        rounds = template.plan_rounds(request, **arenas)
        scatter = local_copy([state.arena.array], kv_buffers(worker))
    except kvplan.KvPlanError as exc:
        if grouped is not None and exc.kind == "staging_slots":  # a configuration: said once
            said_unstaged(worker, names.session, (
                f"kvplan's staged rounds between prefill TP {remote_tp} and decode TP "
                f"{int(d.get('world_size', 1) or 1)} give every decode region one slot of the "
                f"same bytes, and these KV groups read different block counts into theirs"),
                log=_staging_log)
            return False
        _staging_log.warning("req %s: kvplan could not plan staged rounds (%s: %s); direct "
                             "path", request_id, type(exc).__name__, exc)
        return False
    # the bytes vLLM's read of this prefill rank moves: the decode blocks' whole regions
    # (MLA: whole on every rank; with a block-size ratio, a prefill block's share of them
    # per prefill block read), or this rank's share of them where vLLM's own TP mapping
    # reads this decode rank's blocks from several prefill ranks; of several KV groups, each
    # region's block bytes times the blocks of the groups vLLM reads into it
    mapping = (d.get("tp_mappings") or {}).get(dst_engine_id)
    reads = 1 if d.get("use_mla") else len(getattr(mapping, "all_source_ranks", ()) or (0,))
    block_lens = [int(n) for n in d.get("block_len_per_layer") or ()]
    want = (len(src) * sum(block_lens) // ratio if grouped is None
            else grouped.read_bytes(block_lens)) // reads
    planned = sum(int(r.manifest.bytes) for r in rounds)
    if planned != want:  # the core pairs other heads than vLLM's read: never staged
        _say_unstaged(worker, dst_engine_id, remote_tp,
                      f"the staged rounds move {planned} bytes of prefill rank "
                      f"{read_spec.remote_rank} where vLLM's read moves {want}")
        return False
    session, stream = names.session, names.stream
    channel = state.channel_to(session, peer.message)
    if channel is None:
        return False
    notif = f"{remote_request_id}:{expected_consumers}".encode()
    agent = _agent(worker)
    remote_agent: Any = peer.agent

    def notify() -> None:  # what NIXL's READ would have sent the prefill when it completed
        try:
            agent.send_notif(remote_agent, notif_msg=notif)
        except Exception as exc:
            _staging_log.warning("req %s: the notification to the prefill failed (%s): its "
                                 "blocks are freed when their lease expires", request_id, exc)
            stats = d.get("xfer_stats")
            if stats is not None and hasattr(stats, "record_failed_notification"):
                stats.record_failed_notification()

    if _take_pending_abort(worker, request_id):
        # vLLM finished the request before its read started: nothing is read, the prefill
        # is notified as vLLM's read notifies it (it frees the request), vLLM sees it done
        _staging_log.info("kvplan staging: req %s finished by vLLM before its staged read "
                          "from %s started: nothing read", request_id, session)
        notify()
        worker._recving_transfers[request_id].append(AbortedRead())
        return True
    handle: StagedRead | None = None

    def failed(error: Any) -> None:
        if handle is not None and error.reason != "cancelled":
            handle.failed(error)

    # the prefill's lease, as its message gives it, unless a timeout was given here; a
    # prefill that is gone fails the read once its channel closes, not after this
    patience = state.config.patience(peer.message.get(LEASE_KEY))
    receiver = ReceiveStaged(
        stream, rounds, scatter, channel.send, writer=0, timeout_s=patience,
        on_failed=failed,
        fetch=NixlRoundReader(agent, remote_agent, timeout_s=patience,
                              gone=lambda: bool(getattr(channel, "closed", False))))
    # vLLM's own READ of these blocks: one descriptor per block and region pair
    handle = StagedRead(request_id, receiver, notify, template, rounds, state, peer=session,
                        direct_descriptors=int(template.n_pairs) * len(src)
                        if grouped is None else grouped.blocks(),
                        regroup=None if grouped is None else grouped.regroup)
    staged = vstaging.StagedRequest(stream, template, (src_layout, dst_layout), src, dst,
                                    agreement, choice.why, rounds)
    state.router.open(stream, 0, receiver.on_message)
    vstaging.track_stream(channel, stream)
    try:
        channel.open(_opening_message(state, worker, stream=stream,
                                     request=remote_request_id, staged=staged,
                                     grouped=grouped))
    except Exception as exc:  # nothing was read: vLLM's own read takes the request
        state.router.close(stream)
        _staging_log.warning("req %s: opening the staged read failed (%s); not staged",
                             request_id, exc)
        return False
    state.list_stream(stream, receiver)
    state.shares.admit(receiver)  # the grant: the prefill starts gathering
    worker._recving_transfers[request_id].append(handle)
    return True


def _grouped_read(worker: Any, peer: Any, engine: str, session: str, remote_tp: int,
                  local_ids: Any, remote_ids: Any) -> GroupedRead | None:
    """The staged read of several KV groups vLLM's read of ``session`` names (each group's
    trimmed block lists), or None where it stays vLLM's, said once per prefill rank and
    reason: a prefill whose staging message does not serve several groups (an older kvplan:
    its listener would plan and hold one group's pages), or not between TP sizes that differ
    (:data:`GROUPS_TP_KEY`), or groups and regions :func:`region_reads` and
    :meth:`GroupedRead.of` do not take. Between TP sizes each region is sliced alike whatever
    group it holds, as vLLM builds its descriptors per region from its TP mapping: the
    groups' pools page whole blocks (:meth:`GroupedRead.pool_page_size`), the core slicing
    the heads as for one group."""
    why: str | None = None
    grouped: GroupedRead | str = ""
    if peer.message.get(GROUPS_KEY) != GROUPS_VERSION:
        why = "the prefill stages one KV group only (an older kvplan)"
    elif remote_tp != int(worker.__dict__.get("world_size", 1) or 1) and \
            peer.message.get(GROUPS_TP_KEY) != GROUPS_TP_VERSION:
        why = "the prefill stages them at equal TP sizes only (an older kvplan)"
    else:
        reads = region_reads(worker, engine, len(local_ids))
        grouped = reads if isinstance(reads, str) else GroupedRead.of(reads, remote_ids,
                                                                      local_ids)
        why = grouped if isinstance(grouped, str) else None
    if why is not None or isinstance(grouped, str):
        said_unstaged(worker, session, str(why), log=_staging_log)
        return None
    return grouped


def _ratio_pages(worker: Any, engine: str, remote_tp: int, names: Any, ratio: int,
                 remote: Any, local: Any) -> tuple[list[list[int]], list[list[int]]] | None:
    """The pages of a staged read whose decode blocks hold ``ratio`` times the prefill's
    tokens: the prefill's blocks vLLM's read names (:meth:`_ReadNames.sub_blocks`) and the
    decode blocks they fill, in token order, each side's layout at its own block size (the
    core plans the read token by token). vLLM's read copies each prefill block whole into
    one sub-block of a decode block, in order, so those are the bytes it lands where a block
    holds its tokens outermost (``NHD``, or MLA's latent rows); with the heads outermost its
    read lands the prefill blocks' own order, which vLLM reorders after the read. None (said
    once for the engine, vLLM's read) where the staged read would land other bytes: heads
    outermost on either side, several KV groups, a prefill whose kernel blocks are smaller
    than its blocks (vLLM 0.34 may leave off the last of them), or a read that starts within a
    decode block."""
    d = worker.__dict__
    info = d["transfer_topo"].get_engine_info(engine)
    why: str
    if len(names.read_spec.local_block_ids) != 1:
        why = f"a block-size ratio of {ratio} with several KV groups"
    elif int(getattr(info, "remote_physical_blocks_per_logical", 1) or 1) != 1:
        why = (f"a block-size ratio of {ratio} with the prefill's kernel blocks smaller than "
               f"its blocks")
    elif not d.get("use_mla") and {remote.memory_order, local.memory_order} != {"NHD"}:
        why = (f"a block-size ratio of {ratio} needs blocks with the tokens outermost (NHD) "
               f"on both sides, not {remote.memory_order} and {local.memory_order}")
    else:
        local_ids, remote_ids = names.sub_blocks(ratio)
        subs = [int(s) for s in local_ids[0]]
        # whole decode blocks from their first sub-block, the last one's tail left out
        if all(s % ratio == 0 if i % ratio == 0 else s == subs[i - 1] + 1
               for i, s in enumerate(subs)):
            return [[s // ratio for s in subs[::ratio]]], [[int(b) for b in remote_ids[0]]]
        why = f"a block-size ratio of {ratio} whose read starts within a decode block"
    _say_unstaged(worker, engine, remote_tp, why)
    return None
