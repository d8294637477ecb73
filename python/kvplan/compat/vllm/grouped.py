"""Several KV groups in one staged stream, for both of kvplan's vLLM connectors: the one
request of every group's pages that both sides of a stream plan alike (:class:`GroupedRead`),
what an opening message carries of it, and the line saying such a transfer stays vLLM's.

A hybrid model's transfer (full attention and a sliding window, say) names one block list per
KV-cache group, each already trimmed by vLLM; each region is moved at the blocks of the
groups it holds layers of. :class:`GroupedRead` is that transfer as one
:class:`kvplan.Request`:

* one group per region: each group's regions are a pool of their own in both layouts
  (:meth:`kvplan.Layout.with_pool`) whose page is one token of one row, and the request gives
  each pool its group's pages and its own token range (``pool_tokens``: as many tokens as the
  group has blocks), so each page moves whole, page ``i`` to page ``i``, as vLLM pairs them
  (between TP sizes a page is a whole block's tokens instead, as the core slices a rank's
  heads out of whole blocks: :meth:`GroupedRead.pool_page_size`);
* every region at the same groups: one page list, the groups' lists one after the other.

The NIXL connector's decode names its regions' groups from vLLM's read
(:func:`kvplan.compat.vllm.nixl_staging.groups.region_reads`); the Mooncake connector's prefill
from its templates, one per region key (:func:`kvplan.compat.vllm.staging.staged_requests`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

#: The further pools a layout may keep (the core's pool ids 1 to 7).
MAX_POOLS = 7

#: The worker attribute holding the (peer, reason) pairs already said unstaged.
UNSTAGED_GROUPS_ATTR = "_kvplan_unstaged_groups"


@dataclass(frozen=True)
class GroupedRead:
    """One staged read of several KV groups: ``reads`` per region (the KV groups moved into
    it), each group's prefill and decode pages (``src``, ``dst``, vLLM's trimmed lists, in vLLM's group
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
        for region, read in enumerate(reads):
            if not read or any(not 0 <= g < len(dst) for g in read):
                return f"region {region} is read at KV groups {list(read)} of {len(dst)}"
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

    @staticmethod
    def pool_page_size(src: Any, dst: Any) -> int:
        """The tokens of a pool's page between the layouts ``src`` and ``dst``: one (each page
        one token of one row) where their TP sizes are equal; where they differ the blocks' own
        (``dst``'s page size: both sides' blocks hold as many tokens), as the core slices a
        rank's heads out of whole blocks of tokens. Both sides derive it from the two layouts,
        so a prefill plans the decode's pools."""
        return 1 if src.tp_size == dst.tp_size else int(dst.page_size)

    def layout(self, layout: Any, page_size: int = 1) -> Any:
        """``layout`` (one side's regions, in region order) with each group's regions in a pool
        of their own whose page is ``page_size`` tokens, a row each
        (:meth:`kvplan.Layout.with_pool`; :meth:`pool_page_size`), in group order; as it is
        where every region reads the same groups."""
        for _, regions in self.pools:
            layout = layout.with_pool(list(regions), page_size, tokens_per_row=1)
        return layout

    def request(self, page_size: int = 1) -> Any:
        """The read's :class:`kvplan.Request`: each pool its group's pages and a token range
        of its own, every token of its pages (``page_size`` per page, as :meth:`layout` gave
        the pools); or the groups' pages one after the other, as one page list."""
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
            pool_tokens={k + 1: (len(self.dst[g]) * page_size, 0)
                         for k, (g, _) in enumerate(self.pools)})

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


def said_unstaged(worker: Any, session: str, why: str, *, log: logging.Logger,
                  moves: str = "reads of several KV groups from") -> None:
    """Say once per peer rank (``session``) and reason that its transfers of several KV groups
    (``moves``: what they are, up to the peer's name) are vLLM's own, on ``log`` (the
    connector's staging log) at INFO: a configuration, not a failure."""
    said = worker.__dict__.setdefault(UNSTAGED_GROUPS_ATTR, set())
    if (session, why) in said:
        return
    said.add((session, why))
    log.info("kvplan staging: %s %s are vLLM's own: %s", moves, session, why)
