"""What a decode's opening message names: the held-check and lease keys, a read's stream.

The staging message's keys of the held check (:data:`HOLD_KEY` and its forms) and of the
prefill's lease (:data:`LEASE_KEY`), a read's session and stream (:func:`_read_names`), and the
decode's opening message on the prefill's listener (:func:`_opening_message`), which a staged
read and a held check share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


#: The key of the prefill's staging message saying its listener answers a held check
#: (:func:`check_held`), and the key of a held check's opening message giving its form. A
#: prefill whose message lacks it (an older kvplan) is read directly as before, said once per
#: peer. Form 1 (:data:`HOLD_ONE_GROUP`) names the pages of one KV group (``src_pages``), form
#: 2 (:data:`HOLD_VERSION`) the pages of every KV group the read names (``group_pages``, one
#: list per group, in vLLM's group order). A prefill advertises form 1 under this key, which
#: every kvplan decode that knows the held check reads, and form 2 beside it under
#: :data:`HOLD_GROUPS_KEY`; it answers both. A prefill offering form 1 only is asked in that
#: form for a read of one group; a read of several groups from it runs unchecked, said once
#: per peer.
HOLD_KEY = "nixl_hold"
HOLD_VERSION = 2
#: The first held check's form (one KV group).
HOLD_ONE_GROUP = 1
#: The key of the prefill's staging message saying its listener also answers form 2.
HOLD_GROUPS_KEY = "nixl_hold_groups"
#: The key of the prefill's staging message saying its listener serves staged reads of several
#: KV groups (:class:`kvplan.compat.vllm.grouped.GroupedRead`: an opening message naming
#: each group's pages and the groups of each region, held per group), and its version. A
#: decode stages a read of several groups only from a prefill whose message gives this version;
#: from any other (an older kvplan, whose listener plans and holds one group's pages) such a
#: read is vLLM's own, said once per peer. Reads of one group open as before.
GROUPS_KEY = "nixl_staged_groups"
GROUPS_VERSION = 1
#: The key of the prefill's staging message saying its listener also serves those reads between
#: TP sizes that differ (the groups' pools of :meth:`GroupedRead.pool_page_size`), and its
#: version; from a prefill without it (an older kvplan, which would plan other pools and refuse
#: the stream) such a read is vLLM's own, said once per peer.
GROUPS_TP_KEY = "nixl_staged_groups_tp"
GROUPS_TP_VERSION = 1
#: The key of the prefill's staging message giving its KV lease in seconds (vLLM's
#: ``kv_lease_duration``: how long it keeps a finished request's blocks for a decode it hears
#: nothing from). Without ``kvplan_staging_timeout_s`` both sides of a staged read wait that
#: long for a round (:meth:`kvplan.staging.StagingConfig.patience`); a prefill whose message
#: lacks it (an older kvplan) is waited for as before.
LEASE_KEY = "lease_s"


@dataclass(frozen=True)
class _ReadNames:
    """What a staged read and a held check both derive from vLLM's read of one request and
    prefill rank: the prefill rank's session (its channel) and the stream's name, and
    (:meth:`trimmed`) the block ids left after vLLM's own prefix-cache trim."""

    worker: Any
    read_spec: Any
    engine: str
    session: str
    stream: str

    def trimmed(self) -> tuple[Any, Any]:
        """The decode's and the prefill's block ids per KV group after vLLM's trim of the
        decode's prefix-cache hit, as vLLM's own read trims them."""
        return self._trim(self.read_spec.local_block_ids, self.read_spec.remote_block_ids)

    def sub_blocks(self, ratio: int) -> tuple[Any, Any]:
        """Where the decode's blocks hold ``ratio`` times the prefill's tokens (vLLM's block
        size ratio): the block ids per KV group vLLM's read pairs one to one, the decode's
        as sub-blocks of the prefill's block size (block ``b``'s are ``b * ratio`` to
        ``b * ratio + ratio - 1``, in token order), then trimmed as :meth:`trimmed` trims.
        vLLM 0.34 pairs them before its ``_read_blocks`` (``_pair_blocks_by_last_token``),
        so the read's ids are paired already; 0.32 and 0.33's ``_read_blocks`` maps them
        first (``_map_block_ids_for_block_size_ratio``), as here."""
        local_ids, remote_ids = self.read_spec.local_block_ids, self.read_spec.remote_block_ids
        if ratio > 1 and not hasattr(self.worker, "_pair_blocks_by_last_token"):
            local_ids, remote_ids = self.worker._map_block_ids_for_block_size_ratio(
                local_ids, remote_ids, ratio)
        return self._trim(local_ids, remote_ids)

    def _trim(self, local_ids: Any, remote_ids: Any) -> tuple[Any, Any]:
        worker = self.worker
        info = worker.__dict__["transfer_topo"].get_engine_info(self.engine)
        local_ids, remote_ids = worker._apply_prefix_caching(
            decode_block_ids=local_ids, prefill_block_ids=remote_ids,
            decode_physical_per_logical=worker._physical_blocks_per_logical_kv_block,
            prefill_physical_per_logical=info.remote_physical_blocks_per_logical)
        return local_ids, remote_ids


def _read_names(worker: Any, read_spec: Any, dst_engine_id: str,
               remote_request_id: str) -> _ReadNames:
    """The :class:`_ReadNames` of vLLM's read of ``remote_request_id`` from the prefill
    ``dst_engine_id``'s rank ``read_spec.remote_rank``."""
    d = worker.__dict__
    stream = f"{remote_request_id}@{d.get('engine_id')}:tp{d.get('tp_rank', 0)}"
    engine_info = getattr(d.get("transfer_topo"), "get_engine_info", None)
    info = engine_info(dst_engine_id) if engine_info is not None else None
    if int(getattr(info, "remote_tp_size", 0) or 0) > int(d.get("world_size", 1) or 1):
        # this decode rank reads the request from several prefill ranks: a stream each
        stream += f"<tp{read_spec.remote_rank}"
    return _ReadNames(worker, read_spec, str(dst_engine_id),
                     f"{dst_engine_id}:tp{read_spec.remote_rank}", stream)


def _opening_message(state: Any, worker: Any, *, stream: str, request: str,
                    staged: Any = None, held_pages: list[list[int]] | None = None,
                    hold_form: int = HOLD_VERSION, grouped: Any = None) -> bytes:
    """The decode's opening message on the prefill's listener, one form for both uses: the
    stream, this decode's name, rank and staging message and the prefill's request, then
    either a staged read's layouts and pages (``staged``,
    :func:`kvplan.compat.vllm.staging.open_message`) or a held check's :data:`HOLD_KEY` and
    the prefill pages vLLM's read names per KV group (``held_pages``; it opens no stream), in
    the check's form ``hold_form`` (:data:`HOLD_ONE_GROUP`: the one group's pages as
    ``src_pages``; else every group's as ``group_pages``). A staged read of several KV groups
    (``grouped``, a :class:`kvplan.compat.vllm.grouped.GroupedRead`) adds each
    group's pages and the groups of each region (:meth:`GroupedRead.message`)."""
    import json

    from kvplan.compat.vllm import staging as vstaging

    header: dict[str, Any] = {"stream": stream, "peer": state.name,
                              "rank": int(worker.__dict__.get("tp_rank", 0) or 0),
                              "capabilities": state.capabilities(), "request": request}
    if staged is not None:
        return vstaging.open_message(staged, **header,
                                     extra=None if grouped is None else grouped.message())
    groups = [[int(p) for p in g] for g in held_pages or ()]
    pages: dict[str, Any] = {"src_pages": [p for g in groups for p in g]} \
        if hold_form == HOLD_ONE_GROUP else {"group_pages": groups}
    return json.dumps({**header, "writer": 0, HOLD_KEY: hold_form, **pages},
                      separators=(",", ":")).encode()
