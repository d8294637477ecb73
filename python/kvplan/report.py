"""Handshake compatibility report: can this prefill layout send to that decode layout, and why not.

:func:`compare` is what a peer runs when the other side's layout arrives, before the first
request. It is built on the native ``check_pairs``, the same per-entry check ``Template`` runs,
and ``Template`` raises exactly the first problem it lists, so the verdict and the template
never disagree: ``compare(p, d).compatible`` is true exactly when ``Template(p, d)`` builds.

Everything else in the report (page size, device, TP, model-layer count, PP coverage) explains;
it does not change the verdict. Those differences are listed as *warnings* because the template
accepts them, and a verdict that rejected what the template accepts would be a second, diverging
source of truth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from kvplan import _core
from kvplan._core import Layout, Pairing
from kvplan._roles import MHA_ROLES

__all__ = ["CompatReport", "EntryCheck", "compare", "describe_deal", "format_ids"]

@dataclass(frozen=True)
class EntryCheck:
    """One prefill (source) entry: its decode partner, or why it has none.

    Attributes:
        kind: ``"page"`` or ``"state"``.
        src_index: Entry index in the prefill layout.
        dst_index: Paired entry index in the decode layout, or ``None``.
        layer_id: The source entry's global layer id (``None`` if not published).
        role: The source entry's role (``None`` if not published).
        src_item_len: Source bytes per page (or per state slot).
        dst_item_len: The partner's bytes per item, or ``None``.
        exception: What ``Template`` raises for this entry (a :class:`kvplan.KvPlanError`
            subclass instance), or ``None`` when the entry can be transferred.
    """

    kind: str
    src_index: int
    dst_index: int | None
    layer_id: int | None
    role: str | None
    src_item_len: int
    dst_item_len: int | None
    exception: _core.KvPlanError | None

    @property
    def problem(self) -> str | None:
        """Why this entry cannot be transferred (the exception's message), or ``None``."""
        return None if self.exception is None else str(self.exception)

    @property
    def error(self) -> str | None:
        """The exception's class name (e.g. ``"PairingError"``), or ``None``."""
        return None if self.exception is None else type(self.exception).__name__

    @property
    def ok(self) -> bool:
        return self.exception is None

    @property
    def unpaired(self) -> bool:
        return self.dst_index is None

    @property
    def size_mismatch(self) -> bool:
        """Paired items of different lengths (not a head-slicing problem between TP sizes,
        which the report words on its own)."""
        return (isinstance(self.exception, _core.SizeMismatchError)
                and self.exception.kind != "head_slicing")


@dataclass(frozen=True)
class CompatReport:
    """The result of :func:`compare`. ``str(report)`` is the human-readable text.

    Attributes:
        entries: One :class:`EntryCheck` per source entry (page entries first, then state).
        compatible: True exactly when ``Template`` accepts the pair.
        reasons: Why not compatible (empty when compatible), one summary line per kind of
            problem; the exact first problem is in :attr:`first_problem`.
        coverage: Which layers each side covers and which the decode lacks, in words.
        warnings: Differences the template accepts but a person should know about (page size,
            device, TP, model-layer count, decode layers no prefill entry writes).
        prefill: The prefill layout's one-line description.
        decode: The decode layout's one-line description.
        blocks: How many blocks a request of ``request_pages`` pages takes, contiguous and
            fully fragmented, with and without coalescing (empty when not compatible).
        dcp: Decode context parallelism in words, when either side deals tokens over DCP
            ranks: which tokens each side's rank holds, and what this rank pair moves (empty
            when neither side deals).
    """

    entries: tuple[EntryCheck, ...]
    compatible: bool
    reasons: tuple[str, ...]
    coverage: tuple[str, ...]
    warnings: tuple[str, ...]
    prefill: str
    decode: str
    blocks: tuple[str, ...] = ()
    dcp: tuple[str, ...] = ()

    @property
    def first_problem(self) -> tuple[str, str] | None:
        """``(exception class name, message)`` of what ``Template`` raises, or ``None``."""
        for e in self.entries:
            if e.exception is not None:
                return (type(e.exception).__name__, str(e.exception))
        return None

    @property
    def unpaired(self) -> tuple[EntryCheck, ...]:
        """Source entries with no decode partner."""
        return tuple(e for e in self.entries if e.unpaired)

    @property
    def size_mismatches(self) -> tuple[EntryCheck, ...]:
        """Paired entries whose item lengths differ."""
        return tuple(e for e in self.entries if e.size_mismatch)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """``(src entry, dst entry)`` of every paired source entry, in report order."""
        return tuple((e.src_index, e.dst_index) for e in self.entries if e.dst_index is not None)

    def raise_if_incompatible(self) -> None:
        """Raise what ``Template`` would raise for this pair (same class, same message)."""
        for e in self.entries:
            if e.exception is not None:
                raise type(e.exception)(*e.exception.args)

    def __bool__(self) -> bool:
        return self.compatible

    def __str__(self) -> str:
        lines = [f"prefill: {self.prefill}", f"decode:  {self.decode}"]
        if self.compatible:
            lines.append("verdict: compatible")
        else:
            lines.append("verdict: NOT compatible")
            lines += [f"  - {r}" for r in self.reasons]
            first = self.first_problem
            if first is not None:
                lines.append(f"  Template(...) raises {first[0]}: {first[1]}")
        if self.coverage:
            lines.append("coverage:")
            lines += [f"  {c}" for c in self.coverage]
        if self.warnings:
            lines.append("warnings:")
            lines += [f"  - {w}" for w in self.warnings]
        if self.dcp:
            lines.append("decode context parallel:")
            lines += [f"  {d}" for d in self.dcp]
        if self.blocks:
            lines.append("blocks per request:")
            lines += [f"  {b}" for b in self.blocks]
        lines.append("entries (source -> decode):")
        lines += [f"  {row}" for row in _entry_lines(self.entries)]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------


def compare(
    prefill_layout: Layout,
    decode_layout: Layout,
    pairing: Pairing | None = None,
    *,
    request_pages: int = 1024,
    replicas_send: bool = False,
    # Only so that a removed pairing keyword gets Template's TypeError saying what to write
    # instead; NoReturn keeps type checkers refusing every keyword that lands here.
    **removed_keywords: NoReturn,
) -> CompatReport:
    """Check a prefill layout against a decode layout before anything is transferred.

    Takes the same ``pairing`` argument as :class:`kvplan.Template` and runs the same per-entry
    checks, so ``report.compatible`` is true exactly when ``Template`` with these arguments
    builds, and ``report.raise_if_incompatible()`` raises what it would raise.

    Args:
        prefill_layout: The source (prefill PP stage) layout.
        decode_layout: The destination (decode) layout.
        pairing: A :class:`kvplan.Pairing` (default ``Pairing.by_layer_id()``). When it
            ignores the page entries' layer ids (positional and legacy modes), so does the
            report.
        replicas_send: As for ``Template``: every writer of a decode rank sends replicated
            heads, not only the elected holder.
        request_pages: The request size :attr:`CompatReport.blocks` counts blocks for. When
            either side deals tokens over DCP ranks, the request is ``request_pages`` pages of
            the prefill's page size of *global* tokens, and the blocks are this rank pair's.

    Returns:
        A :class:`CompatReport`; ``str()`` of it is a readable report.

    Raises:
        TypeError: ``pairing`` is not a :class:`kvplan.Pairing`, or a removed pairing keyword
            (``allow_positional_fallback``, ``prefill_start_layer``, ``legacy_kind``) was
            given; the message names the ``pairing=kvplan.Pairing...`` to write instead.
    """
    # Resolved once, here, so that the errors name compare and the templates built below get
    # the Pairing itself.
    resolved = Pairing._from_arguments("compare", pairing, removed_keywords)
    rows = _core.check_pairs(prefill_layout, decode_layout, resolved, replicas_send=replicas_send)
    hide = resolved.mode != "layer_id"
    src_seen, dst_seen = _visible(prefill_layout, hide), _visible(decode_layout, hide)
    dst_items = dst_seen.item_lens
    entries = tuple(
        EntryCheck(
            kind=kind,
            src_index=i,
            dst_index=j,
            layer_id=src_seen.layer_ids[i],
            role=src_seen.roles[i],
            src_item_len=src_seen.item_lens[i],
            dst_item_len=None if j is None else dst_items[j],
            exception=exception,
        )
        for kind, i, j, exception in rows
    )
    reasons = _reasons(entries, prefill_layout.page_size, decode_layout.page_size)
    blocks: list[str] = []
    options = {"pairing": resolved, "replicas_send": replicas_send}
    dealt = prefill_layout.dcp_size > 1 or decode_layout.dcp_size > 1
    dcp = _dcp_lines(prefill_layout, decode_layout) if dealt else []
    if not reasons:
        if dealt:
            blocks = _dcp_blocks(prefill_layout, decode_layout, request_pages, **options)
        else:
            blocks = _blocks(prefill_layout, decode_layout, request_pages, **options)
    return CompatReport(
        entries=entries,
        compatible=not reasons,
        reasons=tuple(reasons),
        coverage=tuple(_coverage(prefill_layout, decode_layout, entries, src_seen, dst_seen)),
        warnings=tuple(_warnings(prefill_layout, decode_layout, entries)
                       + _stride_warnings(prefill_layout, decode_layout, entries)),
        prefill=_describe(prefill_layout, src_seen),
        decode=_describe(decode_layout, dst_seen),
        blocks=tuple(blocks),
        dcp=tuple(dcp),
    )


@dataclass(frozen=True)
class _Seen:
    """A layout's entries as the pairing sees them, one list per field (no object per entry:
    a report on layouts of a few hundred thousand entries reads each side several times)."""

    kinds: list[str]
    layer_ids: list[int | None]
    roles: list[str | None]
    item_lens: list[int]

    @property
    def n_page(self) -> int:
        return self.kinds.count("page")

    def page_ids(self) -> list[int]:
        return [i for k, i in zip(self.kinds, self.layer_ids) if k == "page" and i is not None]

    def publishes_ids(self) -> bool:
        return any(i is not None for i in self.layer_ids)


def _visible(layout: Layout, hide_page_ids: bool) -> _Seen:
    """The layout's entries, without the page entries' layer ids when the pairing ignores them."""
    kinds = layout.kinds
    n = len(kinds)
    layer_ids: list[int | None] = list(layout.layer_ids or [None] * n)
    if hide_page_ids:
        layer_ids = [None if k == "page" else i for k, i in zip(kinds, layer_ids)]
    return _Seen(kinds, layer_ids, list(layout.roles or [None] * n), layout.item_lens)


def _stride_warnings(src: Layout, dst: Layout, entries: Sequence[EntryCheck]) -> list[str]:
    """Paired entries whose strides differ (e.g. per-layer buffers against a cross-layer pool)."""
    src_strides, dst_strides = src.strides, dst.strides
    # Items of different page sizes differ by design; strides differ when their ratio to the
    # item does (one side packed, the other not).
    differ = [(e, src_strides[e.src_index], dst_strides[e.dst_index]) for e in entries
              if e.dst_index is not None and e.src_item_len > 0 and e.dst_item_len is not None
              # Items of different sizes (heads re-sliced between TP sizes, or different page
              # sizes), each packed, are not a stride difference: the TP and page-size lines
              # say what they cost.
              and not (src_strides[e.src_index] == e.src_item_len
                       and dst_strides[e.dst_index] == e.dst_item_len)
              and src_strides[e.src_index] * e.dst_item_len
              != dst_strides[e.dst_index] * e.src_item_len]
    if not differ:
        return []
    labels = "; ".join(f"{_label(e)} {a} vs {b} bytes" for e, a, b in differ[:8])
    more = f"; … ({len(differ) - 8} more)" if len(differ) > 8 else ""
    return [f"strides differ for {_plural(len(differ), 'paired entry')} (prefill vs decode): "
            f"{labels}{more}; pages of those entries are not contiguous on both sides, so "
            "they move one block per page (or per coalesced group and page), not per run"]


def _blocks(src: Layout, dst: Layout, pages: int, **options: object) -> list[str]:
    """Block counts of a request of ``pages`` pages, coalesced and not."""
    if pages < 1:
        return []
    lines = []
    for coalesce in (True, False):
        template = _core.Template(src, dst, coalesce=coalesce, **options)  # type: ignore[arg-type]
        if template.by_token:  # the core's choice: different page sizes or memory orders
            return _token_blocks(template, src, dst, pages)
        contiguous, scattered = template.n_blocks_for(pages, 1), template.n_blocks_for(pages, pages)
        how = (f"coalesced ({_plural(template.n_groups, 'group')})" if coalesce
               else f"without coalescing ({_plural(template.n_groups, 'group')})")
        lines.append(f"{pages} pages {how}: {contiguous} blocks in one run, {scattered} blocks "
                     "with every page its own run")
    return lines


def describe_deal(layout: Layout) -> str:
    """Which of the request's global tokens ``t`` this layout's DCP rank holds, in words."""
    n, r, i = layout.dcp_size, layout.dcp_rank, layout.dcp_interleave
    if n == 1:
        return "not dealt: holds every token of the request"
    if i == 1:  # token round robin
        return (f"DCP rank {r} of {n} (interleave 1): holds tokens t with t % {n} == {r}, at "
                f"local token t // {n}")
    return (f"DCP rank {r} of {n} (interleave {i}): holds tokens t with (t // {i}) % {n} == {r}, "
            f"at local token (t // {i * n})·{i} + t % {i}")


def _dcp_lines(src: Layout, dst: Layout) -> list[str]:
    """Each side's deal, and who sends the tokens that are not dealt (draft, state)."""
    lines = [f"prefill {describe_deal(src)}", f"decode {describe_deal(dst)}"]
    if dst.dcp_size > 1:
        lines.append(f"build one template per decode DCP rank (0..{dst.dcp_size - 1}): each "
                     "receives the target KV of its own tokens only")
        lines.append(f"draft (MTP) and state entries are not dealt: every decode rank receives "
                     f"them whole, from prefill DCP rank (decode rank % {src.dcp_size})")
    return lines


def _dcp_blocks(src: Layout, dst: Layout, pages: int, **options: object) -> list[str]:
    """What this DCP rank pair moves for a request of ``pages`` prefill pages of global tokens,
    counted by the core (the template's own token-block count)."""
    if pages < 1:
        return []
    template = _core.Template(src, dst, **options)  # type: ignore[arg-type]
    tokens = pages * src.page_size
    if template.empty_reason is not None:
        return [f"{tokens} tokens: 0 blocks ({template.empty_reason})"]
    contiguous = template.n_token_blocks(tokens)
    scattered = template.n_token_blocks(tokens, fragmented=True)
    _, gather, network = template.packed_block_counts(tokens)
    _, gather_scattered, network_scattered = template.packed_block_counts(tokens, fragmented=True)
    return [f"{tokens} global tokens, prefill DCP rank {src.dcp_rank} -> decode DCP rank "
            f"{dst.dcp_rank}: {contiguous} blocks with pages consecutive on both sides, "
            f"{scattered} blocks with no two pages consecutive",
            f"packed (Template.plan_packed): {network} network blocks after {gather} gather "
            f"blocks into the pack buffer with pages consecutive on both sides, "
            f"{network_scattered} network blocks after {gather_scattered} gather blocks with no "
            "two pages consecutive"]


def _order(layout: Layout) -> str:
    return layout.memory_order or "NHD"


def _token_blocks(template: _core.Template, src: Layout, dst: Layout, pages: int) -> list[str]:
    """What token-exact planning costs: blocks of a request of ``pages`` prefill pages."""
    ps, pd = src.page_size, dst.page_size
    tokens = pages * ps
    g = math.gcd(ps, pd)
    contiguous = template.n_token_blocks(tokens)
    scattered = template.n_token_blocks(tokens, fragmented=True)
    per_pair = template.n_pairs - template.emitting.count(False)
    heads = ("; head-major (HND) items move one block per head per segment"
             if "HND" in (_order(src), _order(dst)) else "")
    lines = [
        f"page size ratio prefill:decode = {ps}:{pd} ({ps // g}:{pd // g}); token plans in units "
        f"of {g} token{'s' if g > 1 else ''}{heads}",
        f"{tokens} tokens ({pages} prefill pages, {-(-tokens // pd)} decode pages): {contiguous} "
        f"blocks with pages consecutive on both sides, {scattered} blocks with no two pages "
        f"consecutive",
    ]
    # At equal page sizes, consecutive pages are one block per pair and scattered pages one per
    # page of the larger page size: what the mismatch adds on top.
    same = per_pair * -(-tokens // max(ps, pd))
    lines.append(f"for comparison, packed per-layer buffers at one common page size of "
                 f"{max(ps, pd)}: {per_pair} blocks consecutive, {same} scattered")
    return lines


# ---------------------------------------------------------------------------------------------
# Wording
# ---------------------------------------------------------------------------------------------


def format_ids(ids: Iterable[int], limit: int = 10) -> str:
    """Layer ids in words: ``"31–59"``, ``"3–59 every 4th"``, ``"1, 4–6, 9"``.

    Sorted and de-duplicated; more than ``limit`` pieces are cut with a count of the rest.
    """
    values = sorted(set(ids))
    if not values:
        return "none"
    if len(values) >= 3:
        step = values[1] - values[0]
        if step > 1 and all(b - a == step for a, b in zip(values, values[1:])):
            return f"{values[0]}–{values[-1]} every {_ordinal(step)}"
    pieces: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        pieces.append(str(start) if start == prev else f"{start}–{prev}")
        if v is not None:
            start = prev = v
    if len(pieces) > limit:
        return ", ".join(pieces[:limit]) + f", … ({len(pieces) - limit} more)"
    return ", ".join(pieces)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _plural(n: int, word: str) -> str:
    """``"1 entry"``, ``"2 entries"``, ``"3 layer ids"``."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def describe_layout(layout: Layout, *, hide_page_ids: bool = False) -> str:
    """One line: entry counts, roles, PP/TP position, page size, device.

    ``hide_page_ids``: describe the layout as a pairing that ignores page ids sees it.
    """
    return _describe(layout, _visible(layout, hide_page_ids))


def _describe(layout: Layout, seen: _Seen) -> str:
    n_page = seen.n_page
    n_state = len(seen.kinds) - n_page
    counts = _plural(n_page, "page entry")
    if n_state:
        counts += f" + {_plural(n_state, 'state entry')}"
    roles = [str(r) for r in dict.fromkeys(seen.roles)] if layout.roles is not None else []
    role_text = f" ({', '.join(roles)})" if roles else ""
    ids = "layer ids" if seen.publishes_ids() else "no layer ids"
    model = "" if layout.num_model_layers is None else f", {layout.num_model_layers}-layer model"
    dcp = (f", DCP rank {layout.dcp_rank} of {layout.dcp_size} (interleave "
           f"{layout.dcp_interleave})" if layout.dcp_size > 1 else "")
    return (
        f"{counts}{role_text}, {ids}{model}, PP rank {layout.pp_rank} of {layout.pp_size}, "
        f"TP rank {layout.tp_rank} of {layout.tp_size}{dcp}, page_size {layout.page_size}, "
        f"device {layout.device}"
    )


def _label(e: EntryCheck) -> str:
    layer = "" if e.layer_id is None else f"layer {e.layer_id}"
    role = "" if e.role is None else e.role
    text = " ".join(x for x in (layer, role) if x)
    return text or f"entry {e.src_index}"


def _reasons(entries: Sequence[EntryCheck], src_page_size: int, dst_page_size: int) -> list[str]:
    """One line per kind of problem, in the order ``Template`` meets them."""
    missing = [e for e in entries if e.problem is not None and e.unpaired]
    sizes = [e for e in entries if e.problem is not None and e.size_mismatch]
    other = [e for e in entries if e.problem is not None and not e.unpaired and not e.size_mismatch]
    out: list[str] = []
    if missing:
        distinct = list(dict.fromkeys(e.problem for e in missing))
        if len(distinct) == 1 and len(missing) > 1:
            # One cause for every entry (e.g. one-sided ids, positional counts): say it once.
            out.append(f"{_plural(len(missing), 'source entry')} cannot be paired: "
                       f"{distinct[0]}")
        else:
            labels = ", ".join(_label(e) for e in missing[:8])
            more = f", … ({len(missing) - 8} more)" if len(missing) > 8 else ""
            out.append(f"{_plural(len(missing), 'source entry')} "
                       + f"{'has' if len(missing) == 1 else 'have'} no decode partner: "
                       + labels + more)
    if sizes:
        out.append(_size_reason(sizes, src_page_size, dst_page_size))
    out += list(dict.fromkeys(e.problem for e in other if e.problem is not None))
    return out


def _size_reason(sizes: Sequence[EntryCheck], src_ps: int, dst_ps: int) -> str:
    """The paired entries whose items do not match, in the terms of what differs: bytes per
    token when the page sizes differ, the refusal's own words when the items are of equal
    length (a token plan of an item that is no whole number of bytes per token), else the
    item sizes."""
    more = f"; … ({len(sizes) - 8} more)" if len(sizes) > 8 else ""
    some = f"{_plural(len(sizes), 'paired entry')} {'differs' if len(sizes) == 1 else 'differ'}"
    if src_ps != dst_ps and all(e.kind == "page" for e in sizes):
        labels = "; ".join(
            f"{_label(e)} {e.src_item_len:,} B / {src_ps} tokens = "
            f"{e.src_item_len / src_ps:,.6g} B vs {e.dst_item_len or 0:,} B / {dst_ps} tokens "
            f"= {(e.dst_item_len or 0) / dst_ps:,.6g} B" for e in sizes[:8])
        return (f"{some} in bytes per token (prefill page_size {src_ps}, decode page_size "
                f"{dst_ps}; paired items must hold the same bytes per token): {labels}{more}")
    if all(e.src_item_len == e.dst_item_len for e in sizes):
        return (f"{_plural(len(sizes), 'paired entry')} of equal item size on both sides "
                f"{'is' if len(sizes) == 1 else 'are'} refused: {sizes[0].problem}")
    labels = "; ".join(f"{_label(e)} {e.src_item_len} vs {e.dst_item_len} bytes"
                       for e in sizes[:8])
    return f"{some} in item size (prefill vs decode): {labels}{more}"


def _split_model_draft(ids: Iterable[int], n_model: int | None) -> tuple[list[int], list[int]]:
    ids = list(ids)
    if n_model is None:
        return ids, []
    return [i for i in ids if i < n_model], [i for i in ids if i >= n_model]


def _page_roles(layout: Layout) -> bool:
    """Whether the layout publishes a role for its page entries (all or none of them do)."""
    return any(e.role is not None for e in layout.entries("page"))


def _side(name: str, layout: Layout, verb: str, n_model: int | None, seen: _Seen) -> str:
    ids = seen.page_ids()
    n_page = seen.n_page
    model, draft = _split_model_draft(ids, n_model)
    who = (name if layout.pp_size == 1
           else f"{name} stage (PP rank {layout.pp_rank} of {layout.pp_size})")
    if not ids:
        return f"{who} publishes no layer ids ({_plural(n_page, 'page entry')})"
    text = (f"{who} {verb} layers {format_ids(model)}: "
            f"{_plural(len(set(model)), 'layer id')} in {_plural(n_page, 'page entry')}")
    if draft:
        text += f" plus draft band {format_ids(draft)}"
    return text


def _coverage(src: Layout, dst: Layout, entries: Sequence[EntryCheck], src_seen: _Seen,
              dst_seen: _Seen) -> list[str]:
    """``src_seen`` / ``dst_seen``: the entries as the pairing sees them (without the page
    entries' layer ids when it ignores them, and so does the report)."""
    n_model = src.num_model_layers if src.num_model_layers is not None else dst.num_model_layers
    out = [_side("prefill", src, "covers", n_model, src_seen),
           _side("decode", dst, "has", n_model, dst_seen)]
    page = [e for e in entries if e.kind == "page"]
    missing = [e.layer_id for e in page if e.unpaired and e.layer_id is not None]
    if missing:
        out.append(f"decode has no entry for layer{'s' if len(set(missing)) > 1 else ''} "
                   f"{format_ids(missing)}")
    if not src_seen.publishes_ids() or not dst_seen.publishes_ids():
        paired = [e for e in page if e.dst_index is not None]
        if paired:
            out.append(f"entries pair by position: prefill entries "
                       f"{format_ids(e.src_index for e in paired)} -> decode entries "
                       f"{format_ids(e.dst_index for e in paired if e.dst_index is not None)}")
            if _page_roles(src) and _page_roles(dst):
                out.append("positions count within each role: the k-th entry of a role pairs "
                           "with the k-th entry of that role, never with another role")
    else:
        # Decode layers this stage does not write: normal for a PP stage, a gap at PP=1.
        sent = {e.dst_index for e in page if e.dst_index is not None}
        unsent = [i for j, (k, i) in enumerate(zip(dst_seen.kinds, dst_seen.layer_ids))
                  if k == "page" and j not in sent and i is not None]
        unsent_model, unsent_draft = _split_model_draft(set(unsent), n_model)
        if unsent_model:
            tail = ("another PP stage sends them" if src.pp_size > 1
                    else "nothing will write them")
            out.append(f"decode layers {format_ids(unsent_model)} get nothing from this "
                       f"prefill: {tail}")
        if unsent_draft:
            out.append(f"decode draft band {format_ids(unsent_draft)} gets nothing from this "
                       "prefill")
    states = [e for e in entries if e.kind == "state"]
    if states:
        ok = sum(1 for e in states if e.ok)
        roles = ", ".join(dict.fromkeys(e.role or "state" for e in states))
        out.append(f"state: {ok} of {_plural(len(states), 'entry')} ({roles}) paired"
                   )
    return out


def _warnings(src: Layout, dst: Layout, entries: Sequence[EntryCheck]) -> list[str]:
    out: list[str] = []
    if src.page_size != dst.page_size:
        g = math.gcd(src.page_size, dst.page_size)
        out.append(f"page sizes differ (prefill {src.page_size}, decode {dst.page_size} tokens "
                   f"per page, ratio {src.page_size // g}:{dst.page_size // g}): plans are "
                   "token-exact (Template.plan(src_pages, dst_pages, n_tokens=...) takes each "
                   "side's pages in token order) and cost more blocks where pages are not "
                   "consecutive; see blocks")
    if _order(src) != _order(dst):
        out.append(f"memory orders differ (prefill {_order(src)}, decode {_order(dst)}): plans "
                   "are token-exact, one block per token per head")
    if src.device != dst.device:
        out.append(f"devices differ (prefill {src.device}, decode {dst.device}): the transfer "
                   "engine must reach both")
    out += _tp_lines(src, dst)
    if dst.pp_size not in (1, src.pp_size):
        out.append(f"decode PP size {dst.pp_size} is neither 1 nor the prefill's "
                   f"{src.pp_size} (SGLang supports only those)")
    if (src.num_model_layers is not None and dst.num_model_layers is not None
            and src.num_model_layers != dst.num_model_layers):
        out.append(f"model layer counts differ (prefill {src.num_model_layers}, decode "
                   f"{dst.num_model_layers}): the draft band's ids shift")
    elided = [e for e in entries if e.src_item_len == 0]
    if elided:
        out.append(f"{_plural(len(elided), 'source entry')} with item_len 0 (elided): "
                   "never transferred")
    return out


def _heads(n: int) -> str:
    return f"{n} head" if n == 1 else f"{n} heads"


def _tp_lines(src: Layout, dst: Layout) -> list[str]:
    """TP and head differences in words: who sends which heads to whom, and what this pair moves."""
    if src.kv_heads is None or dst.kv_heads is None:
        if src.tp_size == dst.tp_size:
            return []
        sharded = any(e.role in MHA_ROLES for e in src.entries())
        who = ("neither layout publishes its" if src.kv_heads is None and dst.kv_heads is None
               else "the prefill does not publish its" if src.kv_heads is None
               else "the decode does not publish its")
        return [
            f"TP sizes differ (prefill {src.tp_size}, decode {dst.tp_size}) and {who} "
            "attention geometry (kv_heads, head_dim, dtype_size, memory_order): kvplan copies "
            "whole items; "
            + ("K/V entries are head-sharded, so head-sliced transfers are needed: publish the "
               "geometry on both sides" if sharded
               else "correct only for replicated caches such as an MLA latent")
        ]
    if src.tp_size == dst.tp_size and src.tp_rank == dst.tp_rank:
        return []
    try:
        peers = _core.tp_peers(src.kv_heads, src.tp_size, dst.tp_size, decode_rank=dst.tp_rank)
    except _core.KvPlanError:
        return []  # the geometry check names the problem (see the verdict)
    hp, hd = src.heads_per_rank or 0, dst.heads_per_rank or 0
    line = (f"prefill TP {src.tp_size} × {_heads(hp)}, decode TP {dst.tp_size} × {_heads(hd)}: "
            f"{peers}")
    out = [line]
    reason = peers.reason(src.tp_rank)
    if reason is not None:
        out.append(f"this pair (prefill rank {src.tp_rank} -> decode rank {dst.tp_rank}) moves "
                   f"no KV: {reason}")
    else:
        got = peers.heads_with(src.tp_rank)
        start, stop = got if got is not None else (0, 0)
        moved = stop - start
        heads = f"head {start}" if moved == 1 else f"heads {start}–{stop - 1}"
        orders = (_order(src), _order(dst))
        by_token = _core.needs_tokens(src, dst)
        if moved == hp == hd:
            how = "whole tokens, token plan" if by_token else "whole items"
        elif by_token:
            how = ("token plan: one block per token and entry" if orders == ("NHD", "NHD")
                   else "token plan: one block per head per segment and entry"
                   if orders == ("HND", "HND")
                   else "token plan: one block per head per token and entry")
        elif src.memory_order == "HND":
            how = "HND: one block per page and entry"
        else:
            how = f"NHD: one block per token slot, {src.page_size} per page and entry"
        out.append(f"this pair (prefill rank {src.tp_rank} -> decode rank {dst.tp_rank}) moves "
                   f"{heads} ({how})")
    return out


def _entry_lines(entries: Sequence[EntryCheck]) -> list[str]:
    """Entries grouped: consecutive healthy entries stepping by one on both sides share a line."""
    groups: list[list[EntryCheck]] = []
    for e in entries:
        if groups:
            last = groups[-1][-1]
            if (e.problem is not None and e.problem == last.problem and e.kind == last.kind
                    and e.src_index == last.src_index + 1 and e.unpaired and last.unpaired):
                # One shared cause (one-sided ids, positional counts): one line, not n.
                groups[-1].append(e)
                continue
            if (e.ok and last.ok and e.kind == last.kind and e.role == last.role
                    and e.src_item_len == last.src_item_len
                    and e.src_index == last.src_index + 1
                    and e.dst_index is not None and last.dst_index is not None
                    and e.dst_index == last.dst_index + 1):
                groups[-1].append(e)
                continue
        groups.append([e])
    lines = []
    for g in groups:
        first, last = g[0], g[-1]
        src = str(first.src_index) if len(g) == 1 else f"{first.src_index}–{last.src_index}"
        ids = [e.layer_id for e in g if e.layer_id is not None]
        layers = ("layer " + str(ids[0]) if len(ids) == 1
                  else "layers " + format_ids(ids) if ids else "no ids")
        role = str(first.role)
        if first.dst_index is None:
            dst = "none"
        elif len(g) == 1:
            dst = str(first.dst_index)
        else:
            dst = f"{first.dst_index}–{last.dst_index}"
        status = "ok" if first.ok else f"{first.error}: {first.problem}"
        lines.append(f"{first.kind:<5} src {src:<9} {layers:<28} {role:<10} "
                     f"{first.src_item_len:>9} B -> dst {dst:<9} {status}")
    return lines
