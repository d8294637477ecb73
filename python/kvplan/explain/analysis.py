"""The library side of ``kvplan explain``: plan one request per prefill stage and collect what
it does (:class:`Explanation`), with the warnings a person should read."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplan.explain.diagnose import (
    DecodeWrites,
    StageDiagnosis,
    aliased_decode_writes,
    diagnose_stage,
)
from kvplan.explain.words import format_bytes, short

__all__ = ["DEFAULT_MAX_BLOCKS", "CoalescingRow", "LIST_NS_PER_ELEMENT", "MAX_START_LAYER", "SMALL_BLOCK_BYTES",
           "Explanation", "StageResult", "decode_pages", "explain", "histogram"]

#: Blocks per engine call assumed for the "engine calls" figure (the engines' default bound).
DEFAULT_MAX_BLOCKS = 1024
#: Average block size below which per-block engine overhead dominates (warning threshold).
SMALL_BLOCK_BYTES = 16 << 10
#: Handing Mooncake Python lists costs ~20-100 ns per element, three lists (docs/design.md,
#: Performance model).
LIST_NS_PER_ELEMENT = (20, 100)
#: ``--prefill-start-layer`` bound: far above any model, and within every integer the core takes.
MAX_START_LAYER = (1 << 31) - 1


@dataclass
class CoalescingRow:
    """The page pairs of one decode entry kind in one template, and what keeps their blocks
    from coalescing with the pair before each (the core's ``Template.coalescing``)."""

    kind: str
    pairs: int
    #: Pairs that emit together with the pair before them.
    joined: int
    #: ``(why, pairs)``: each reason a pair emits apart, with how many pairs it holds back.
    blockers: list[tuple[str, int]]
    #: Pairs whose blocks end at every page (a page stride longer than the item).
    per_page: int


@dataclass
class StageResult:
    """One prefill PP stage planned against the decode peer."""

    label: str
    layers: str
    pairing: str
    page_pairs: int
    state_pairs: int
    runs: int
    blocks: int
    bytes: int
    state_blocks: int
    state_bytes: int
    plan_us: float
    report: Any
    problems: list[str] = field(default_factory=list)
    groups: int = 0  # emission groups of the template (= emitting page pairs unless coalesced)
    contiguous_blocks: int = 0  # page blocks of the same request with one run
    #: Per decode entry kind, what keeps its pairs' blocks apart (:func:`coalescing_rows`).
    coalescing: list[CoalescingRow] = field(default_factory=list)
    #: explain's reading of a refused stage, beside its compatibility report
    #: (:func:`kvplan.explain.diagnose.diagnose_stage`).
    diagnosis: StageDiagnosis = field(default_factory=StageDiagnosis)


@dataclass
class Explanation:
    """Everything ``render`` prints and ``--plot`` draws."""

    title: str
    description: str
    pages: int
    page_size: int
    fragmentation: float
    breaks: int
    stages: list[StageResult]
    run_lengths: list[int]
    kv_bytes_per_layer: dict[int, int]
    state_bytes_per_layer: dict[int, int]
    warnings: list[str]
    max_blocks: int
    layout: str = "per-layer"
    #: With ``--layout cross-layer``: the per-layer explanation of the same scenario.
    per_layer: Explanation | None = None
    #: The decode's entries that do not move every token of every page: per kind (sliding
    #: window, ring state, sidecar), its layers and what moves of it.
    entry_kinds: list[tuple[str, list[int], str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.report is None or s.report.compatible for s in self.stages)

    @property
    def blocks(self) -> int:
        return sum(s.blocks + s.state_blocks for s in self.stages)

    @property
    def bytes(self) -> int:
        return sum(s.bytes + s.state_bytes for s in self.stages)


def decode_pages(pages: int, fragmentation: float, seed: int) -> tuple[Any, int]:
    """Decode page indices: ``pages`` values, ``round(fragmentation * (pages - 1))`` breaks.

    A break skips one free page, so the list needs ``pages + breaks`` slots and has exactly
    ``breaks + 1`` runs against a contiguous prefill list (:func:`kvplan.presets.fragmented_pages`
    with the option names of ``kvplan explain`` in its errors).
    """
    if pages < 1:
        raise ValueError(f"--pages must be at least 1, got {pages}")
    if not 0.0 <= fragmentation <= 1.0:
        raise ValueError(f"--fragmentation must be in [0, 1], got {fragmentation}")
    if seed < 0:  # numpy's own message would not name the option
        raise ValueError(f"--seed must be at least 0, got {seed}")
    from kvplan.presets import fragmented_pages

    breaks = round(fragmentation * (pages - 1))
    return fragmented_pages(pages, fragmentation, seed=seed), breaks


def _stage_start(decode: Any, stage: Any) -> int | None:
    """The dense offset of a stage's first layer among the decode's page layers (legacy start).

    ``None`` when it cannot be derived: the stage's page entries or the decode's publish no
    layer ids. Guessing 0 there would plan every later stage onto the decode's first layers.
    """
    stage_ids = [e.layer_id for e in stage.entries("page") if e.layer_id is not None]
    if not stage_ids or decode.layer_ids is None:
        return None
    decode_ids = {e.layer_id for e in decode.entries("page") if e.layer_id is not None}
    if not decode_ids:
        return None
    first = min(stage_ids)
    return len({i for i in decode_ids if i < first})


def entry_kinds(layout: Any) -> list[tuple[str, list[int], str]]:
    """The entries of ``layout`` that do not move like a full KV page, grouped by kind: sliding
    windows (per window size), ring state (per ring size) and sidecars (indexer, scales), each
    with its layers and what a plan moves of it."""
    kinds: dict[tuple[str, str], list[int]] = {}
    for entry in layout.entries():
        layer = -1 if entry.layer_id is None else entry.layer_id
        if entry.window is not None:
            key = (f"window {entry.window}", f"a request's last {entry.window} tokens")
        elif entry.ring is not None:
            key = (f"ring {entry.ring}", f"the positions both rings hold, row by row "
                                         f"(plan_ring; {entry.ring} rows per slot here)")
        elif entry.sidecar:
            key = (f"sidecar {entry.role}", "with its layer's KV entry, every token")
        else:
            continue
        kinds.setdefault(key, []).append(layer)
    return [(name, sorted(set(layers)), what) for (name, what), layers in kinds.items()]


#: What keeps a pair apart, in words, by the core's coalescing kind (``first`` and ``joined``
#: keep nothing apart; the side is filled in for the last three).
_BLOCKER_WORDS = {
    "elided": "moves nothing (item length 0 or no heads to move)",
    "by_token": "its items follow the previous entry's, but the template plans by token "
                "(window entries, page sizes, memory orders or DCP differ) and a token plan "
                "emits every entry's blocks apart",
    "fragments": "moves parts of its items (TP head slicing of head-major items, or given "
                 "fragments)",
    "options": "kept apart by the template's options (coalescing off or a layer-group edge)",
    "apart": "its own buffer: its item does not follow the previous entry's on the {side} side",
    "strides": "its page stride differs from the previous entry's on the {side} side",
    "beyond_stride": "joined, the items would outgrow one page stride on the {side} side",
}


def entry_kind_label(layout: Any, entry: int) -> str:
    """The kind of page entry ``entry`` of ``layout`` in explain's words: ``window W``,
    ``sidecar ROLE`` or ``KV ROLE``."""
    e = layout.entries()[entry]
    if e.window is not None:
        return f"window {e.window}"
    if e.sidecar:
        return f"sidecar {e.role}"
    return "KV" if e.role is None else f"KV {e.role}"


def coalescing_rows(template: Any, decode: Any) -> list[CoalescingRow]:
    """Per decode entry kind, the template's page pairs and what keeps their blocks apart, from
    the core's per-pair coalescing (``Template.coalescing``); nothing here re-derives the rule."""
    rows: dict[str, CoalescingRow] = {}
    for (_, j), (kind, side, per_page) in zip(template.pairs.tolist(), template.coalescing,
                                              strict=True):
        label = entry_kind_label(decode, j)
        row = rows.setdefault(label, CoalescingRow(label, 0, 0, [], 0))
        row.pairs += 1
        row.per_page += per_page
        if kind == "joined":
            row.joined += 1
        elif kind != "first":
            why = _BLOCKER_WORDS[kind].format(side="prefill" if side == "src" else "decode")
            for k, (text, n) in enumerate(row.blockers):
                if text == why:
                    row.blockers[k] = (text, n + 1)
                    break
            else:
                row.blockers.append((why, 1))
    return list(rows.values())


def explain(
    prefills: Sequence[tuple[str, Any]],
    decode: Any,
    *,
    title: str,
    description: str = "",
    pages: int = 512,
    fragmentation: float = 0.0,
    seed: int = 0,
    backend: str = "mooncake",
    prefill_start_layer: int | Sequence[int | None] | None = None,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
    layout: str = "per-layer",
) -> Explanation:
    """Plan one request of ``pages`` pages from every prefill stage to ``decode``.

    Args:
        prefills: ``(label, layout)`` per prefill PP stage.
        decode: The decode layout.
        title: Heading (model name or file names).
        description: One line under the heading.
        pages: Pages the request moves.
        fragmentation: Fraction of decode page boundaries that break a run (0..1).
        seed: Seed for where the breaks fall.
        backend: Backend for :func:`kvplan.select_pairing`.
        prefill_start_layer: The first layer of each prefill stage, for legacy (id-less)
            pairing: one value (or ``None``: derive it) per stage, or a single int when there
            is one stage. Default: derived from the published layer ids.
        max_blocks: Blocks per engine call, for the engine-call count.
        layout: ``"per-layer"`` or ``"cross-layer"``: how the layouts keep their KV (only
            changes the wording of the warnings; the layouts themselves say it).

    Raises:
        ValueError: A bad argument, or a stage that pairs by legacy slicing whose start layer
            is neither given nor derivable from layer ids (the message names the stage).
        IndexBoundsError: A pool too small for the request.
    """
    import numpy as np

    import kvplan

    if type(max_blocks) is not int or max_blocks < 1:
        raise ValueError(f"--max-blocks must be at least 1, got {short(max_blocks)}")
    starts = _per_stage_starts(prefill_start_layer, len(prefills))
    choices = [kvplan.select_pairing(backend, src) for _, src in prefills]
    # A start layer only positions legacy slicing: say so when one is given for a stage that
    # pairs by layer id or positionally, instead of ignoring it.
    unused_starts = [label for (label, _), choice, start in zip(prefills, choices, starts)
                     if start is not None and choice.mode != "legacy"]
    missing, why = [], set()
    for k, ((label, src), choice) in enumerate(zip(prefills, choices)):
        if choice.mode == "legacy" and starts[k] is None:
            starts[k] = _stage_start(decode, src)
            if starts[k] is None:
                missing.append(label)
                stage_ids = any(e.layer_id is not None for e in src.entries("page"))
                why.add("the decode layout publishes no layer ids" if stage_ids
                        else "the stage publishes no layer ids")
    if missing:
        # The library refuses legacy slicing without a start layer; so does explain, rather
        # than plan every stage from layer 0 onto the decode's first layers.
        raise ValueError(
            f"legacy positional slicing needs the layer each prefill stage starts at, and it "
            f"cannot be derived for {', '.join(missing)} ({'; '.join(sorted(why))}): pass "
            f"--prefill-start-layer "
            f"{','.join(f'S{k}' for k in range(len(prefills)))} (one value per stage, "
            f"in stage order)")

    _check_request_fits(pages, fragmentation)
    src_pages = np.arange(pages, dtype=np.int64)
    page_size = decode.page_size
    # Different page sizes: ``pages`` prefill pages are a number of tokens, and the decode holds
    # them in its own (fewer or more) pages; plans are token-exact (Template.plan, n_tokens).
    src_size = prefills[0][1].page_size if prefills else page_size
    dst_count = -(-pages * src_size // page_size) if src_size != page_size else pages
    dst_pages, breaks = decode_pages(dst_count, fragmentation, seed)
    _, _, run_lengths = kvplan.group_contiguous(np.arange(dst_count, dtype=np.int64), dst_pages)
    page_size = src_size
    kv_per_layer: dict[int, int] = {}
    state_per_layer: dict[int, int] = {}
    stages: list[StageResult] = []
    warnings: list[str] = []
    writes: list[DecodeWrites] = []  # every stage's decode blocks, checked for aliasing
    if unused_starts:
        modes = sorted({c.mode.replace("_", " ") for c in choices if c.mode != "legacy"})
        warnings.append(f"--prefill-start-layer has no effect on {', '.join(unused_starts)}: "
                        f"{'that stage pairs' if len(unused_starts) == 1 else 'they pair'} by "
                        f"{' / '.join(modes)}, not by legacy slicing")

    for (label, src), choice, start in zip(prefills, choices, starts):
        layer_text = _layers_text(src, start if choice.mode == "legacy" else None)
        try:
            report = choice.compare(src, decode, prefill_start_layer=start)
        except kvplan.KvPlanError as e:
            stages.append(StageResult(label, layer_text, choice.mode, 0, 0, 0, 0, 0, 0, 0, 0.0,
                                      None, [str(e)]))
            continue
        for w in report.warnings:
            if w not in warnings:
                warnings.append(w)
        if not report.compatible:
            diagnosis = diagnose_stage(src, decode, report)
            problems = diagnosis.lines + list(report.reasons)
            stages.append(StageResult(label, layer_text, choice.mode, 0, 0, 0, 0, 0, 0, 0, 0.0,
                                      report, problems, diagnosis=diagnosis))
            continue
        template = choice.template(src, decode, prefill_start_layer=start)
        _check_blocks_fit(template, pages, len(run_lengths), fragmentation)
        for side, peer, idx in (("prefill", src, src_pages), ("decode", decode, dst_pages)):
            caps = _live_capacities(peer, "page")
            if caps and int(idx.max()) >= min(caps):
                raise kvplan.IndexBoundsError(
                    f"{side} pool holds {min(caps)} pages but the request needs page "
                    f"{int(idx.max())}: lower --pages or --fragmentation")
        # A layout with further pools (a compressed cache's rows) indexes them by their own
        # pages: consecutive ones, as many as the request's tokens fill.
        from kvplan.presets import pool_pages_for

        request = kvplan.Request(src_pages, dst_pages,
                                 pool_pages=pool_pages_for(src, decode, src_pages, dst_pages))
        template.plan(request)  # warm the buffer pool (plan dropped at once): time steady state
        t0 = time.perf_counter()
        plan = template.plan(request)
        plan_us = (time.perf_counter() - t0) * 1e6
        layer_of = _layer_keys(src, decode, choice.legacy_kind, start)
        per_pair_plan = plan
        if template.n_groups < sum(template.emitting):
            # A coalesced group's blocks span several layers and belong to its last pair; the
            # same request planned without coalescing gives every layer its own blocks.
            per_pair_plan = choice.template(src, decode, prefill_start_layer=start,
                                            coalesce=False).plan(request)
        for (i, j), nbytes in zip(template.pairs.tolist(), _pair_bytes(per_pair_plan),
                                  strict=True):
            lid = layer_of(i, j)
            kv_per_layer[lid] = kv_per_layer.get(lid, 0) + nbytes
        writes.append(DecodeWrites(label, per_pair_plan, [j for _, j in template.pairs.tolist()]))
        state_blocks = state_bytes = 0
        if template.state_pairs.size:
            # One request slot per side: slot 0 on prefill to slot 1 on decode.
            state_plan = template.plan_state(0, 1 if _min_state_cap(decode) > 1 else 0)
            state_blocks, state_bytes = state_plan.n_blocks, state_plan.total_bytes
            writes.append(DecodeWrites(label, state_plan,
                                       [j for _, j in template.state_pairs.tolist()]))
            # Elided state pairs (item_len 0) emit no block: the plan's pair offsets say which
            # blocks are whose.
            for (i, j), nbytes in zip(template.state_pairs.tolist(), _pair_bytes(state_plan),
                                      strict=True):
                lid = layer_of(i, j)
                state_per_layer[lid] = state_per_layer.get(lid, 0) + nbytes
        stages.append(StageResult(
            label, layer_text, choice.mode, len(template.pairs), len(template.state_pairs),
            plan.n_runs, plan.n_blocks, plan.total_bytes, state_blocks, state_bytes, plan_us,
            report, groups=template.n_groups, contiguous_blocks=_contiguous_blocks(template, pages),
            coalescing=coalescing_rows(template, decode)))

    expl = Explanation(title, description, pages, page_size, fragmentation, breaks, stages,
                       [int(x) for x in run_lengths], kv_per_layer, state_per_layer, warnings,
                       max_blocks, layout)
    expl.entry_kinds = entry_kinds(decode)
    expl.warnings = warnings + _plan_warnings(expl)
    aliased = aliased_decode_writes(writes, decode)
    if aliased is not None:
        expl.warnings.insert(0, aliased)
    return expl


#: Bytes ``explain`` holds per page of the request: the prefill and decode index arrays, the
#: run grouping's three columns and the fragmenter's scratch (int64 each).
_BYTES_PER_PAGE = 8 * 8
#: Bytes per block: the plan's three u64 columns, held twice (the plan and, for coalesced
#: groups, the same request planned per layer).
_BYTES_PER_BLOCK = 2 * 3 * 8


def _check_request_fits(pages: int, fragmentation: float) -> None:
    """Refuse up front a request whose index arrays cannot fit in memory, with the estimate,
    instead of growing until the kernel kills the process (its blocks are checked per stage,
    once the core can count them: :func:`_check_blocks_fit`)."""
    _refuse_if_too_big(pages, fragmentation, _BYTES_PER_PAGE * pages, "")


def _check_blocks_fit(template: Any, pages: int, runs: int, fragmentation: float) -> None:
    """Refuse, before planning, a stage whose blocks cannot fit in memory; the blocks are the
    core's count for the request's shape (a token plan: with no two pages consecutive when the
    request is fragmented, the most it can cost)."""
    if template.by_token:
        blocks = int(template.n_token_blocks(_request_tokens(template, pages),
                                             fragmented=runs > 1))
    else:
        blocks = int(template.n_blocks_for(pages, runs))
    _refuse_if_too_big(pages, fragmentation, _BYTES_PER_PAGE * pages + _BYTES_PER_BLOCK * blocks,
                       f" and {blocks:,} blocks")


def _refuse_if_too_big(pages: int, fragmentation: float, need: int, blocks: str) -> None:
    from kvplan._cli_args import available_memory

    free = available_memory()
    if free is not None and need > free // 2:
        raise ValueError(
            f"--pages {pages:,} at --fragmentation {fragmentation:g} needs about "
            f"{need / 2**30:,.1f} GiB for the request's index arrays{blocks}, more than half of "
            f"the {free / 2**30:,.1f} GiB this process can still use: lower --pages or "
            f"--fragmentation")


def _request_tokens(template: Any, pages: int) -> int:
    """Tokens of a request of ``pages`` full prefill pages (what a token plan is counted in)."""
    return pages * int(template.page_sizes[0])


def _pair_bytes(plan: Any) -> list[int]:
    """Bytes of each entry pair's blocks, from the plan's own pair offsets."""
    lengths, offsets = plan.lengths, plan.pair_offsets.tolist()
    return [int(lengths[a:b].sum()) for a, b in zip(offsets, offsets[1:])]


def _per_stage_starts(value: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    """``prefill_start_layer`` as one entry per stage (``None``: derive from the layer ids)."""
    if value is None:
        return [None] * n
    if isinstance(value, int):
        if n != 1:
            raise ValueError(f"--prefill-start-layer: one value for {n} prefill stages; give "
                             f"one per stage (comma-separated), as stages start at different "
                             f"layers")
        values: list[int | None] = [value]
    else:
        values = list(value)
        if len(values) != n:
            raise ValueError(f"--prefill-start-layer: {len(values)} value(s) for {n} prefill "
                             f"stages; give one per stage")
    for v in values:
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_START_LAYER):
            raise ValueError(f"--prefill-start-layer must be in 0..{MAX_START_LAYER}, "
                             f"got {short(v)}")
    return values


def _layer_keys(src: Any, decode: Any, legacy_kind: str | None,
                start: int | None) -> Callable[[int, int], int]:
    """The layer a ``(src entry, dst entry)`` pair moves, for the bytes-per-layer table.

    The prefill's layer id when it publishes one, else the decode's; for peers without ids, the
    decode entry's position among the decode entries of its kind and role, which is the dense
    layer index legacy slicing and positional pairing work with (for MHA without roles, K and V
    halves share indices).
    """
    src_ids, dst_ids = src.layer_ids, decode.layer_ids
    position: list[int] = []
    seen: dict[tuple[str, str | None], int] = {}
    for e in decode.entries():
        key = (e.kind, e.role)
        position.append(seen.get(key, 0))
        seen[key] = position[-1] + 1
    half = seen.get(("page", None), 0) // 2 if legacy_kind == "mha" and not decode.roles else 0

    def layer_of(i: int, j: int) -> int:
        if src_ids is not None and src_ids[i] is not None:
            return int(src_ids[i])
        if dst_ids is not None and dst_ids[j] is not None:
            return int(dst_ids[j])
        pos = position[j]
        if half and decode.kinds[j] == "page":
            pos %= half
        return pos

    return layer_of


def _live_capacities(layout: Any, kind: str) -> list[int]:
    """Capacities of the ``kind`` entries that move bytes (elided entries, item_len 0, are
    never indexed, so their capacity bounds nothing)."""
    return [e.capacity for e in layout.entries(kind) if e.item_len > 0]


def _min_state_cap(layout: Any) -> int:
    caps = _live_capacities(layout, "state")
    return min(caps) if caps else 0


def _layers_text(layout: Any, start: int | None = None) -> str:
    from kvplan.report import format_ids

    ids = layout.layer_ids
    if ids is None:
        first = f", first layer {start}" if start is not None else ""
        return f"{layout.n_entries} entries, no layer ids{first}"
    n_model = layout.num_model_layers
    page = [e.layer_id for e in layout.entries("page") if e.layer_id is not None]
    state = [e.layer_id for e in layout.entries("state") if e.layer_id is not None]
    every = sorted(set(page) | set(state))
    model = [i for i in every if n_model is None or i < n_model]
    text = f"layers {format_ids(model)}" if model else "no layers"
    if state:
        text += f" (KV on {format_ids(page)})"
    return text


def _contiguous_blocks(template: Any, pages: int) -> int:
    """Page blocks of the same request in one run (pages consecutive on both sides)."""
    if template.by_token:  # different page sizes: count by the request's tokens
        return int(template.n_token_blocks(_request_tokens(template, pages)))
    return int(template.n_blocks_for(pages, 1))


def _plan_warnings(e: Explanation) -> list[str]:
    out: list[str] = []
    runs = len(e.run_lengths)
    page_blocks = sum(s.blocks for s in e.stages)
    contiguous = sum(s.contiguous_blocks for s in e.stages)
    if runs > 1 and sum(e.run_lengths) != e.pages:
        # Token plans (page sizes differ): the runs are the decode's pages, not the request's.
        out.append(f"destination fragmented: {runs:,} runs over {sum(e.run_lengths):,} decode "
                   f"pages; a token plan ends a block at every page edge that is not "
                   f"consecutive on both sides")
    elif runs > 1 and page_blocks > contiguous:
        what = "fully fragmented" if runs == e.pages else "fragmented"
        # Both counts are the core's; their ratio only picks the wording (every block a whole
        # run, or some pieces per page).
        if page_blocks == runs * contiguous:
            out.append(f"destination {what}: {runs}× more blocks than contiguous "
                       f"({runs:,} runs for {e.pages:,} pages; one block per run per "
                       f"{'coalesced group' if e.layout == 'cross-layer' else 'entry pair'})")
        else:
            out.append(f"destination {what}: {page_blocks / contiguous:.1f}× more blocks than "
                       f"contiguous ({runs:,} runs for {e.pages:,} pages)")
    page_bytes = sum(s.bytes for s in e.stages)
    if page_blocks and page_bytes / page_blocks < SMALL_BLOCK_BYTES:
        out.append(f"average block is {format_bytes(page_bytes // page_blocks)}: per-block engine "
                   "overhead dominates (larger pages or less fragmentation help)")
    for s in e.stages:
        total = s.blocks + s.state_blocks
        if total > e.max_blocks:
            out.append(f"{s.label}: {total:,} blocks need {math.ceil(total / e.max_blocks):,} "
                       f"engine calls of at most {e.max_blocks:,} blocks")
    lo, hi = (e.blocks * 3 * ns / 1e6 for ns in LIST_NS_PER_ELEMENT)
    if lo >= 1.0:
        out.append(f"handing {e.blocks:,} blocks to Mooncake as Python lists costs about "
                   f"{lo:.0f}–{hi:.0f} ms (20–100 ns per list element, 3 elements per block)")
    for s in e.stages:
        out += [f"{s.label}: {p}" for p in s.problems]
    return out


def histogram(run_lengths: Sequence[int]) -> list[tuple[str, int, int]]:
    """Power-of-two buckets: ``(label, runs, pages)`` for 1, 2–3, 4–7, … up to the longest."""
    if not run_lengths:
        return []
    top = max(run_lengths).bit_length()
    rows = []
    for b in range(top):
        lo, hi = 1 << b, (1 << (b + 1)) - 1
        inside = [n for n in run_lengths if lo <= n <= hi]
        rows.append((str(lo) if lo == hi else f"{lo}–{hi}", len(inside), sum(inside)))
    return rows


@dataclass
class DcpRankResult:
    """One prefill stage planned against one decode DCP rank (``--decode-dcp``)."""

    stage: str
    rank: int
    #: Which global tokens the decode rank holds, in words (:func:`kvplan.report.describe_deal`).
    deal: str
    #: Blocks of the request's plan, pages consecutive on both sides (the plan's own count).
    blocks: int
    #: Blocks of the same request with no two pages consecutive (the core's token-block count).
    scattered_blocks: int
    bytes: int
    state_blocks: int
    state_bytes: int
    #: Why this pair moves no KV (the template's own reason), or ``None``.
    empty_reason: str | None
    report: Any
    #: Through a pack buffer (``Template.plan_packed``), pages consecutive on both sides: the
    #: network blocks out of the pack buffer and the local gather blocks into it (the core's
    #: ``packed_block_counts``; state is not packed).
    packed_network_blocks: int = 0
    packed_gather_blocks: int = 0
    #: The same with no two pages consecutive.
    packed_scattered_network_blocks: int = 0
    packed_scattered_gather_blocks: int = 0


@dataclass
class DcpExplanation:
    """What ``kvplan explain --decode-dcp N`` prints: every prefill stage against every decode
    DCP rank, for one request of global tokens."""

    title: str
    description: str
    pages: int
    page_size: int
    decode_page_size: int
    dcp_size: int
    interleave: int
    rows: list[DcpRankResult]
    warnings: list[str]
    max_blocks: int

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def ok(self) -> bool:
        return all(r.report is not None and r.report.compatible for r in self.rows)

    def rank_totals(self) -> list[tuple[int, int, int, int]]:
        """``(rank, blocks, scattered blocks, bytes)`` per decode rank, over every stage, state
        included."""
        return [(t.rank, t.blocks, t.scattered_blocks, t.bytes) for t in self.rank_costs()]

    def rank_costs(self) -> list[DcpRankCost]:
        """What each decode rank costs over every stage, directly and through a pack buffer
        (state blocks, never packed, counted in both)."""
        out: dict[int, DcpRankCost] = {}
        for r in self.rows:
            t = out.setdefault(r.rank, DcpRankCost(r.rank))
            t.blocks += r.blocks + r.state_blocks
            t.scattered_blocks += r.scattered_blocks + r.state_blocks
            t.bytes += r.bytes + r.state_bytes
            t.network_blocks += r.packed_network_blocks + r.state_blocks
            t.scattered_network_blocks += r.packed_scattered_network_blocks + r.state_blocks
            t.gather_blocks += r.packed_gather_blocks
            t.scattered_gather_blocks += r.packed_scattered_gather_blocks
        return [out[rank] for rank in sorted(out)]


@dataclass
class DcpRankCost:
    """One decode rank's cost over every prefill stage (:meth:`DcpExplanation.rank_costs`)."""

    rank: int
    #: Direct plan blocks (every one a network descriptor), pages consecutive / scattered.
    blocks: int = 0
    scattered_blocks: int = 0
    bytes: int = 0
    #: Through a pack buffer: network blocks and local gather blocks, consecutive / scattered.
    network_blocks: int = 0
    scattered_network_blocks: int = 0
    gather_blocks: int = 0
    scattered_gather_blocks: int = 0


def explain_dcp(
    prefills: Sequence[tuple[str, Any]],
    decodes: Sequence[Any],
    *,
    title: str,
    description: str = "",
    pages: int = 512,
    backend: str = "mooncake",
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> DcpExplanation:
    """Plan one request of ``pages`` prefill pages of global tokens from every prefill stage to
    every decode DCP rank (``decodes``: the decode layout of each rank, in rank order).

    Every count comes from the core: the plan's blocks and bytes, the template's token-block
    count for scattered pages and its reason when a rank pair moves nothing. Each side's page
    list is consecutive and long enough for every token of the request (a rank uses the first
    pages it needs).

    Raises:
        ValueError: ``decodes`` is empty or ``max_blocks`` is below 1.
    """
    import numpy as np

    import kvplan
    from kvplan.report import describe_deal

    if type(max_blocks) is not int or max_blocks < 1:
        raise ValueError(f"--max-blocks must be at least 1, got {short(max_blocks)}")
    if not decodes:
        raise ValueError("explain_dcp needs the decode layout of at least one DCP rank")
    if pages < 1:
        raise ValueError(f"--pages must be at least 1, got {pages}")
    page_size = prefills[0][1].page_size if prefills else decodes[0].page_size
    decode_size = decodes[0].page_size
    tokens = pages * page_size
    src_pages = np.arange(-(-tokens // page_size), dtype=np.int64)
    dst_pages = np.arange(-(-tokens // decode_size), dtype=np.int64)
    rows: list[DcpRankResult] = []
    warnings: list[str] = []
    for decode in decodes:
        deal = describe_deal(decode)
        for label, src in prefills:
            choice = kvplan.select_pairing(backend, src)
            report = choice.compare(src, decode)
            for w in report.warnings:
                if w not in warnings:
                    warnings.append(w)
            if not report.compatible:
                rows.append(DcpRankResult(label, decode.dcp_rank, deal, 0, 0, 0, 0, 0, None,
                                          report))
                continue
            template = choice.template(src, decode)
            plan = template.plan(src_pages, dst_pages, n_tokens=tokens)
            scattered = template.n_token_blocks(tokens, fragmented=True)
            state_blocks = state_bytes = 0
            if template.state_pairs.size:
                state_plan = template.plan_state(0, 0)
                state_blocks, state_bytes = state_plan.n_blocks, state_plan.total_bytes
            _, gather, network = template.packed_block_counts(tokens)
            _, gather_s, network_s = template.packed_block_counts(tokens, fragmented=True)
            rows.append(DcpRankResult(label, decode.dcp_rank, deal, plan.n_blocks, scattered,
                                      plan.total_bytes, state_blocks, state_bytes,
                                      template.empty_reason, report, network, gather,
                                      network_s, gather_s))
    return DcpExplanation(title, description, pages, page_size, decode_size,
                          decodes[0].dcp_size, decodes[0].dcp_interleave, rows, warnings,
                          max_blocks)
