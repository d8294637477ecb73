"""Several KV groups in one staged read: which groups' blocks vLLM reads into each region, and
the one request of all of them that both sides plan alike.

A hybrid model's read (full attention and a sliding window, say) names one block list per
KV-cache group, each already trimmed by vLLM (its prefix-cache trim, and a sliding window's
own trim of its group): vLLM reads region ``r`` at the blocks of the groups it holds layers
of. Where each group's layers lie in regions of their own (vLLM maps regions to groups) that
is one group per region; where every region is shared by the groups (vLLM's hybrid
allocator, layers of several groups in one tensor) the groups' blocks are one index space and
each region is read at all of them. :func:`region_reads` says which, per region;
:class:`GroupedRead` is the read's one :class:`kvplan.Request`:

* one group per region: each group's regions are a pool of their own in both layouts
  (:meth:`kvplan.Layout.with_pool`) whose page is one token of one row, and the request gives
  each pool its group's pages and its own token range (``pool_tokens``: as many tokens as the
  group has blocks), so each page moves whole, page ``i`` to page ``i``, as vLLM's read pairs
  them;
* every region at the same groups: one page list, the groups' lists one after the other.

Other reads (a region of some groups only beside regions of one, a group with blocks but no
region, or with regions but no blocks left after the trims) stay vLLM's read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: vLLM's region group of a region shared by several KV groups.
SHARED_REGION = -1
#: The further pools a layout may keep (the core's pool ids 1 to 7).
MAX_POOLS = 7

#: The worker attribute holding the (session, reason) pairs already said unstaged.
UNSTAGED_GROUPS_ATTR = "_kvplan_unstaged_groups"


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


@dataclass(frozen=True)
class GroupedRead:
    """One staged read of several KV groups: ``reads`` per region (:func:`region_reads`), each
    group's prefill and decode pages (``src``, ``dst``, vLLM's trimmed lists, in vLLM's group
    order); built by :meth:`of`. ``pools``: per further pool, its group and its regions; none
    where every region reads the same groups."""

    reads: tuple[tuple[int, ...], ...]
    src: tuple[tuple[int, ...], ...]
    dst: tuple[tuple[int, ...], ...]
    pools: tuple[tuple[int, tuple[int, ...]], ...]

    @classmethod
    def of(cls, reads: Any, src: Any, dst: Any) -> GroupedRead | str:
        """The read of ``src`` / ``dst`` (pages per group) with ``reads`` per region, or why
        kvplan does not stage it."""
        reads = tuple(tuple(int(g) for g in r) for r in reads)
        src = tuple(tuple(int(p) for p in g) for g in src)
        dst = tuple(tuple(int(p) for p in g) for g in dst)
        if len(src) != len(dst):
            return f"{len(src)} prefill and {len(dst)} decode KV groups"
        for g, (s, t) in enumerate(zip(src, dst)):
            if len(s) != len(t):
                return f"KV group {g} reads {len(s)} prefill blocks into {len(t)}"
        if len(set(reads)) == 1:  # every region at the same groups: one page list
            return cls(reads, src, dst, ())
        if any(len(r) != 1 for r in reads):
            return "regions of several KV groups beside regions of one"
        pools: list[tuple[int, tuple[int, ...]]] = []
        for g, pages in enumerate(dst):
            regions = tuple(r for r, read in enumerate(reads) if read == (g,))
            if not regions:
                if pages:
                    return f"KV group {g} has blocks to read but no region"
                continue
            if not pages:
                return f"KV group {g} has no blocks left to read"
            pools.append((g, regions))
        if len(pools) > MAX_POOLS:
            return f"{len(pools)} KV groups of their own regions, more than {MAX_POOLS}"
        return cls(reads, src, dst, tuple(pools))

    def layout(self, layout: Any) -> Any:
        """``layout`` (one side's regions, in region order) with each group's regions in a pool
        of their own whose page is one token of one row (:meth:`kvplan.Layout.with_pool`), in
        group order; as it is where every region reads the same groups."""
        for _, regions in self.pools:
            layout = layout.with_pool(list(regions), 1, tokens_per_row=1)
        return layout

    def request(self) -> Any:
        """The read's :class:`kvplan.Request`: each pool its group's pages and a token range
        of its own, one token per page; or the groups' pages one after the other, as one page
        list."""
        import kvplan

        index = kvplan._core.index_array
        if not self.pools:
            groups = self.reads[0] if self.reads else ()
            return kvplan.Request(index([p for g in groups for p in self.src[g]]),
                                  index([p for g in groups for p in self.dst[g]]))
        empty = index([])
        return kvplan.Request(
            empty, empty, n_tokens=0,
            pool_pages={k + 1: (index(list(self.src[g])), index(list(self.dst[g])))
                        for k, (g, _) in enumerate(self.pools)},
            pool_tokens={k + 1: (len(self.dst[g]), 0) for k, (g, _) in enumerate(self.pools)})

    def regroup(self, verdict: Any) -> Any:
        """``verdict`` (a :class:`kvplan.failures.FailureVerdict` of the read's template, its
        pages filed by pool) with its pages filed under vLLM's KV groups: a pool's under its
        group, or, of one page list, each page under the first group whose decode pages hold
        it."""
        from kvplan.failures import FailureVerdict

        blocks: dict[int, set[int]] = {}
        for pool, pages in verdict.blocks.items():
            for page in pages:
                if self.pools and 1 <= pool <= len(self.pools):
                    group = self.pools[pool - 1][0]
                elif not self.pools and pool == 0:
                    group = next((g for g in (self.reads[0] if self.reads else ())
                                  if page in self.dst[g]), pool)
                else:
                    group = pool
                blocks.setdefault(group, set()).add(int(page))
        return FailureVerdict(verdict.request_id,
                              {g: tuple(sorted(p)) for g, p in sorted(blocks.items())},
                              verdict.reason)

    def blocks(self) -> int:
        """vLLM's descriptors of the read: one per block and region reading it."""
        return sum(len(self.dst[g]) for read in self.reads for g in read)

    def read_bytes(self, block_lens: Any) -> int:
        """The bytes vLLM's read moves: each region's block bytes times the blocks of the
        groups read into it."""
        return sum(int(n) * sum(len(self.dst[g]) for g in read)
                   for n, read in zip(block_lens, self.reads))

    def message(self) -> dict[str, Any]:
        """What the opening message carries of it (:data:`GROUP_PAGES_KEY`,
        :data:`GROUP_REGIONS_KEY`)."""
        return {GROUP_PAGES_KEY: [[list(s), list(t)] for s, t in zip(self.src, self.dst)],
                GROUP_REGIONS_KEY: [list(r) for r in self.reads]}

    @classmethod
    def from_message(cls, opening: dict[str, Any]) -> GroupedRead | str:
        """The read an opening message names (:meth:`message`), or why it names none."""
        pages, reads = opening.get(GROUP_PAGES_KEY), opening.get(GROUP_REGIONS_KEY)
        if not _int_lists(reads) or not isinstance(pages, list) or \
                not all(isinstance(g, list) and len(g) == 2 and _int_lists(g) for g in pages):
            return "the opening message's KV groups are not lists of pages and regions"
        return cls.of(reads, [g[0] for g in pages], [g[1] for g in pages])


def _int_lists(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(g, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in g)
        for g in value)


#: The opening message's keys of a staged read of several KV groups: each group's prefill and
#: decode pages (``[[src, dst], ...]`` in vLLM's group order), and the groups read into each
#: region (a list per region).
GROUP_PAGES_KEY = "staged_groups"
GROUP_REGIONS_KEY = "region_groups"


def said_unstaged(worker: Any, session: str, why: str) -> None:
    """Say once per prefill rank (``session``) and reason that its reads of several KV groups
    are vLLM's own (INFO: a configuration, not a failure)."""
    from kvplan.compat.vllm.nixl_staging.worker import _staging_log

    said = worker.__dict__.setdefault(UNSTAGED_GROUPS_ATTR, set())
    if (session, why) in said:
        return
    said.add((session, why))
    _staging_log.info("kvplan staging: reads of several KV groups from %s are vLLM's own: %s",
                      session, why)
