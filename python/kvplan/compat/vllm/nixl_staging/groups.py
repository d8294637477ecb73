"""Several KV groups in one staged NIXL read: which groups' blocks vLLM reads into each region
of the decode (:func:`region_reads`), and the prefill's check of the groups a decode's opening
message names (:func:`check_region_reads`).

Where each group's layers lie in regions of their own (vLLM maps regions to groups) a region
is read at one group; where every region is shared by the groups (vLLM's hybrid allocator,
layers of several groups in one tensor) the groups' blocks are one index space and each region
is read at all of them. The read itself is one
:class:`kvplan.compat.vllm.grouped.GroupedRead`. Other reads (a region of some groups only
beside regions of one, a group with blocks but no region, or with regions but no blocks left
after the trims) stay vLLM's read."""

from __future__ import annotations

from typing import Any

#: vLLM's region group of a region shared by several KV groups.
SHARED_REGION = -1


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values or ()]


def region_reads(worker: Any, engine: str, n_groups: int
                 ) -> tuple[tuple[int, ...], ...] | str:
    """Per region of the decode ``worker`` (in region order, which is the prefill's: vLLM
    pairs them in order), the KV groups whose blocks vLLM's read of the prefill ``engine``
    reads into it; a string saying why not where vLLM's read is not one kvplan models: layer
    routing (``_transfer_layer_group_ids``), region pairs that are not region ``k`` with
    region ``k`` (vLLM 0.34's ``_dst_pairs``), the two sides' region groups differing, or a
    region whose own group is not the one it is read at."""
    d = worker.__dict__
    if d.get("_transfer_layer_group_ids"):
        return "vLLM routes its blocks by layer name"
    n = int(d.get("num_regions") or len(d.get("block_len_per_layer") or ()))
    own = _ints(d.get("region_group_ids"))
    remote = _ints((d.get("dst_region_group_ids") or {}).get(engine)) or own
    if len(own) != n or remote != own:
        return (f"the prefill's regions are in KV groups {remote!r:.100} and this decode's in "
                f"{own!r:.100}")
    every = tuple(range(n_groups))
    pairs = (d.get("_dst_pairs") or {}).get(engine)
    if pairs is not None:  # vLLM 0.34: pair k reads remote[k] into local[k] at group[k]
        local, group = _ints(pairs.local), _ints(pairs.group)
        if _ints(pairs.remote) != local or set(local) != set(range(n)):
            return "vLLM pairs other regions than region k with region k"
        groups: list[set[int]] = [set() for _ in range(n)]
        for region, g in zip(local, group):
            groups[region].add(g)
        reads = tuple(tuple(sorted(g)) for g in groups)
    else:  # vLLM 0.32 / 0.33: a region reads its group where mapped, else every group
        mapped = d.get("_uses_region_group_mapping")
        mapped = len(set(own)) > 1 if mapped is None else bool(mapped)
        if not mapped and any(g != SHARED_REGION for g in own) and n_groups > 1:
            return "vLLM reads every KV group into regions of one group"
        reads = tuple(every if g == SHARED_REGION or not mapped else (g,) for g in own)
    why = _misread_region(own, reads, n_groups, "")
    return reads if why is None else why


def check_region_reads(worker: Any, reads: Any, n_groups: int) -> str | None:
    """The prefill's check of the region reads a decode's opening message names against its
    own regions' KV groups (vLLM's ``region_group_ids``): a region of one group must be read
    at that group alone, a shared one at any of the read's groups; why not, or None."""
    own = _ints(worker.__dict__.get("region_group_ids"))
    if len(reads) != len(own):
        return f"the read names {len(reads)} regions, this prefill has {len(own)}"
    return _misread_region(own, reads, n_groups, " here")


def _misread_region(own: Any, reads: Any, n_groups: int, where: str) -> str | None:
    """The one rule both sides check: a region of one KV group (``own``, vLLM's region
    groups) is read at that group alone, a shared one at any groups below ``n_groups``;
    which region breaks it (``where`` names the side in the message), or None."""
    for region, (g, read) in enumerate(zip(own, reads)):
        if g != SHARED_REGION and tuple(read) != (g,) or \
                any(not 0 <= x < n_groups for x in read):
            return f"region {region} of KV group {g}{where} is read at groups {list(read)}"
    return None
