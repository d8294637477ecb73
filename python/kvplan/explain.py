"""``kvplan explain``: what a plan will do for a model, a request size, a PP split, fragmentation.

For a preset (docs/design.md, Reference scenarios) or two layout JSON files (``Layout.to_dict``
format), it builds the template of every prefill PP stage against the decode peer (with the
pairing :func:`kvplan.select_pairing` picks for ``--backend``), plans one request and prints
entries paired, runs, blocks, bytes, a run-length histogram, bytes per layer and warnings.
``--plot FILE.png`` draws the histogram and bytes per layer (matplotlib, the ``plot`` extra,
imported only then).

Page lists: the prefill pages are ``0 .. pages-1`` (contiguous); the decode pages come from a
free list in which a fraction ``--fragmentation`` of the page boundaries is broken (0: one run;
1: every page its own run), chosen reproducibly from ``--seed``.

Peers without layer ids at prefill PP > 1 pair by legacy positional slicing, which needs the
layer each prefill stage starts at. It is derived from published ids; when it cannot be,
``explain`` refuses (as ``PairingChoice.template`` does) unless ``--prefill-start-layer`` gives
one value per stage: a wrong start would silently plan a stage onto another stage's layers.

``--layout cross-layer`` (presets only) builds every peer with one cross-layer KV pool
(``ModelPreset.layout(..., cross_layer=True)``: per page, the items of all the peer's KV layers
side by side; state per layer), explains that, and adds a table of blocks per request for the
per-layer and the cross-layer layout of the same model, request and split.

Exit status: 0 every stage is compatible, 1 a stage is not (its report is printed), 2 bad input
(one line on stderr naming the option or layout field and the value), 3 internal error (a bug:
the traceback is printed), so that 1 always means "incompatible".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

__all__ = ["Explanation", "StageResult", "add_arguments", "explain", "render", "run"]

Runner = Callable[[argparse.Namespace], int]

#: Blocks per engine call assumed for the "engine calls" figure (the engines' default bound).
DEFAULT_MAX_BLOCKS = 1024
#: Average block size below which per-block engine overhead dominates (warning threshold).
SMALL_BLOCK_BYTES = 16 << 10
#: Handing Mooncake Python lists costs ~20-100 ns per element, three lists (docs/design.md,
#: Performance model).
LIST_NS_PER_ELEMENT = (20, 100)
#: Exit statuses of ``kvplan explain``.
EXIT_OK, EXIT_INCOMPATIBLE, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
#: ``--layers`` bound: every layer becomes layout entries in memory, and no model comes close.
MAX_LAYERS = 1 << 16
#: ``--prefill-start-layer`` bound: far above any model, and within every integer the core takes.
MAX_START_LAYER = (1 << 31) - 1
_U64 = 1 << 64
_I64 = 1 << 63


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

    @property
    def ok(self) -> bool:
        return all(s.report is None or s.report.compatible for s in self.stages)

    @property
    def blocks(self) -> int:
        return sum(s.blocks + s.state_blocks for s in self.stages)

    @property
    def bytes(self) -> int:
        return sum(s.bytes + s.state_bytes for s in self.stages)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


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


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters so that an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


#: Layout dict fields holding unsigned 64-bit integers, one per entry (``Layout.to_dict``).
_U64_LISTS = ("data_ptrs", "data_lens", "item_lens")


def _check_layout_dict(data: Any, where: str) -> None:
    """Check a parsed layout JSON document field by field, so that a bad file gets one line
    naming the field, the entry and the value (the native loader reports some of these as bare
    integer-conversion errors)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object (Layout.to_dict), got "
                         f"{type(data).__name__} {_short(data)}")
    for name in _U64_LISTS:
        if name not in data:
            continue  # the native loader names missing keys
        value = data[name]
        if name == "item_lens" and not isinstance(value, list):
            # One item length for every entry is allowed.
            if type(value) is not int or not 0 <= value < _U64:
                raise ValueError(f"{where}: item_lens must be an integer in 0..2**64-1 or a "
                                 f"list of them, got {_short(value)}")
            continue
        if not isinstance(value, list):
            raise ValueError(f"{where}: {name} must be a list of integers in 0..2**64-1, got "
                             f"{_short(value)}")
        for k, v in enumerate(value):
            if type(v) is not int or not 0 <= v < _U64:
                raise ValueError(f"{where}: {name}[{k}] must be an integer in 0..2**64-1, got "
                                 f"{_short(v)}")
    ids = data.get("layer_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise ValueError(f"{where}: layer_ids must be a list of integers (or null), got "
                             f"{_short(ids)}")
        for k, v in enumerate(ids):
            if v is not None and (type(v) is not int or not -_I64 <= v < _I64):
                raise ValueError(f"{where}: layer_ids[{k}] must be a 64-bit integer or null, "
                                 f"got {_short(v)}")
    for name in ("roles", "kinds"):
        value = data.get(name)
        if value is None:
            continue  # null roles mean "not published"; the native loader names other gaps
        if not isinstance(value, list):
            raise ValueError(f"{where}: {name} must be a list of strings, got {_short(value)}")
        for k, v in enumerate(value):
            if not isinstance(v, str):
                raise ValueError(f"{where}: {name}[{k}] must be a string, got {_short(v)}")
    for name in ("version", "page_size", "num_model_layers", "pp_rank", "pp_size", "tp_rank",
                 "tp_size"):
        v = data.get(name)
        if v is None and (name not in data or name == "num_model_layers"):
            continue
        if type(v) is not int or not 0 <= v < _U64:
            raise ValueError(f"{where}: {name} must be a non-negative integer, got {_short(v)}")
    if "device" in data and not isinstance(data["device"], str):
        raise ValueError(f"{where}: device must be a string, got {_short(data['device'])}")


def _load_layout(path: str, option: str = "--prefill") -> Any:
    """A layout from a JSON file; every problem is a one-line ``ValueError`` naming the file."""
    from kvplan import KvPlanError, Layout

    where = f"{option} {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ValueError(f"{where}: cannot read: {err.strerror or err}") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError too
        raise ValueError(f"{where}: not a valid JSON file: {_one_line(err)}") from None
    _check_layout_dict(data, where)
    try:
        return Layout.from_dict(data)
    except (KvPlanError, TypeError, OverflowError, ValueError) as err:
        raise ValueError(f"{where}: {_one_line(err)}") from None


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


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
        raise ValueError(f"--max-blocks must be at least 1, got {_short(max_blocks)}")
    starts = _per_stage_starts(prefill_start_layer, len(prefills))
    choices = [kvplan.select_pairing(backend, src) for _, src in prefills]
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
            stages.append(StageResult(label, layer_text, choice.mode, 0, 0, 0, 0, 0, 0, 0, 0.0,
                                      report, list(report.reasons)))
            continue
        template = choice.template(src, decode, prefill_start_layer=start)
        for side, peer, idx in (("prefill", src, src_pages), ("decode", decode, dst_pages)):
            caps = _live_capacities(peer, "page")
            if caps and int(idx.max()) >= min(caps):
                raise kvplan.IndexBoundsError(
                    f"{side} pool holds {min(caps)} pages but the request needs page "
                    f"{int(idx.max())}: lower --pages or --fragmentation")
        template.plan(src_pages, dst_pages)  # warm the buffer pool (plan dropped at once): time steady state
        t0 = time.perf_counter()
        plan = template.plan(src_pages, dst_pages)
        plan_us = (time.perf_counter() - t0) * 1e6
        layer_of = _layer_keys(src, decode, choice.legacy_kind, start)
        per_pair_plan = plan
        if template.n_groups < sum(template.emitting):
            # A coalesced group's blocks span several layers and belong to its last pair; the
            # same request planned without coalescing gives every layer its own blocks.
            per_pair_plan = choice.template(src, decode, prefill_start_layer=start,
                                            coalesce=False).plan(src_pages, dst_pages)
        for (i, j), nbytes in zip(template.pairs.tolist(), _pair_bytes(per_pair_plan),
                                  strict=True):
            lid = layer_of(i, j)
            kv_per_layer[lid] = kv_per_layer.get(lid, 0) + nbytes
        state_blocks = state_bytes = 0
        if template.state_pairs.size:
            # One request slot per side: slot 0 on prefill to slot 1 on decode.
            state_plan = template.plan_state(0, 1 if _min_state_cap(decode) > 1 else 0)
            state_blocks, state_bytes = state_plan.n_blocks, state_plan.total_bytes
            # Elided state pairs (item_len 0) emit no block: the plan's pair offsets say which
            # blocks are whose.
            for (i, j), nbytes in zip(template.state_pairs.tolist(), _pair_bytes(state_plan),
                                      strict=True):
                lid = layer_of(i, j)
                state_per_layer[lid] = state_per_layer.get(lid, 0) + nbytes
        stages.append(StageResult(
            label, layer_text, choice.mode, len(template.pairs), len(template.state_pairs),
            plan.n_runs, plan.n_blocks, plan.total_bytes, state_blocks, state_bytes, plan_us,
            report, groups=template.n_groups, contiguous_blocks=_contiguous_blocks(template, pages)))

    expl = Explanation(title, description, pages, page_size, fragmentation, breaks, stages,
                       [int(x) for x in run_lengths], kv_per_layer, state_per_layer, warnings,
                       max_blocks, layout)
    expl.warnings = warnings + _plan_warnings(expl)
    return expl


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
                             f"got {_short(v)}")
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
        return int(template.n_token_blocks(pages * template.page_sizes[0]))
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
        if page_blocks == runs * contiguous:
            out.append(f"destination {what}: {runs}× more blocks than contiguous "
                       f"({runs:,} runs for {e.pages:,} pages; one block per run per "
                       f"{'coalesced group' if e.layout == 'cross-layer' else 'entry pair'})")
        else:
            out.append(f"destination {what}: {page_blocks / contiguous:.1f}× more blocks than "
                       f"contiguous ({runs:,} runs for {e.pages:,} pages)")
    page_bytes = sum(s.bytes for s in e.stages)
    if page_blocks and page_bytes / page_blocks < SMALL_BLOCK_BYTES:
        out.append(f"average block is {_bytes(page_bytes // page_blocks)}: per-block engine "
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


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit} ({int(n):,} B)"
    return f"{int(n):,} B"


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


def _bar(value: int, top: int, width: int = 32) -> str:
    if value <= 0 or top <= 0:
        return ""
    return "█" * max(1, round(width * value / top))


def render(e: Explanation) -> str:
    """The text ``kvplan explain`` prints."""
    from kvplan.report import format_ids

    lines = [f"kvplan explain: {e.title}"]
    if e.description:
        lines.append(f"  {e.description}")
    lines.append(f"request: {e.pages:,} pages × page_size {e.page_size} = "
                 f"{e.pages * e.page_size:,} tokens; decode fragmentation {e.fragmentation:.2f} "
                 f"({e.breaks:,} of {max(e.pages - 1, 0):,} page boundaries broken)")
    lines.append("")
    lines.append(f"{'prefill stage':<16} {'pairing':<10} {'entries paired':>15} {'runs':>7} "
                 f"{'blocks':>10} {'bytes':>16}  layers")
    for s in e.stages:
        if s.report is None or not s.report.compatible:
            lines.append(f"{s.label:<16} {s.pairing:<10} {'NOT COMPATIBLE':>15}  {s.layers}")
            continue
        paired = f"{s.page_pairs}" + (f" + {s.state_pairs} state" if s.state_pairs else "")
        lines.append(f"{s.label:<16} {s.pairing:<10} {paired:>15} {s.runs:>7,} "
                     f"{s.blocks + s.state_blocks:>10,} {s.bytes + s.state_bytes:>16,}  "
                     f"{s.layers}")
    good = [s for s in e.stages if s.report is not None and s.report.compatible]
    if len(e.stages) > 1:
        lines.append(f"{'total':<16} {'':<10} "
                     f"{sum(s.page_pairs + s.state_pairs for s in good):>15} "
                     f"{len(e.run_lengths):>7,} {e.blocks:>10,} {e.bytes:>16,}")
    if good:
        calls = sum(math.ceil((s.blocks + s.state_blocks) / e.max_blocks) for s in good)
        plan_us = sum(s.plan_us for s in good)
        lines.append(f"total bytes {_bytes(e.bytes)}; {calls:,} engine call(s) of at most "
                     f"{e.max_blocks:,} blocks; planned in {plan_us:,.0f} µs")

    lines.append("")
    lines.append(f"run lengths ({len(e.run_lengths):,} runs over {sum(e.run_lengths):,} "
                 f"{'pages' if sum(e.run_lengths) == e.pages else 'decode pages'}):")
    rows = histogram(e.run_lengths)
    top = max((r[1] for r in rows), default=0)
    lines.append(f"  {'length':>11}  {'runs':>7}  {'pages':>8}")
    for label, runs, pages in rows:
        if runs:  # empty buckets only in the plot
            lines.append(f"  {label:>11}  {runs:>7,}  {pages:>8,}  {_bar(runs, top)}")

    lines.append("")
    lines.append("bytes per layer (this request):")
    lines += _per_layer_lines("KV", e.kv_bytes_per_layer, format_ids)
    lines += _per_layer_lines("state", e.state_bytes_per_layer, format_ids)
    if not e.kv_bytes_per_layer and not e.state_bytes_per_layer:
        lines.append("  nothing planned")

    if e.per_layer is not None:
        lines.append("")
        lines += _layout_comparison(e.per_layer, e)
    for s in e.stages:
        if s.report is not None and not s.report.compatible:
            lines.append("")
            lines.append(f"{s.label}: compatibility report")
            lines += [f"  {x}" for x in str(s.report).splitlines()]
    lines.append("")
    if e.warnings:
        lines.append("warnings:")
        lines += [f"  - {w}" for w in e.warnings]
    else:
        lines.append("warnings: none")
    return "\n".join(lines)


def _layout_comparison(per_layer: Explanation, cross: Explanation) -> list[str]:
    """Blocks per request of the same request under both layouts, per stage and in total."""
    lines = ["blocks per request, per-layer vs cross-layer KV layout (same model, pages, "
             "split; state blocks are the same in both):",
             f"  {'prefill stage':<16} {'per-layer':>12} {'cross-layer':>12} {'ratio':>9} "
             f"{'groups':>7} {'state':>7}"]

    def row(label: str, a: int, b: int, groups: str, state: int) -> str:
        ratio = f"{a / b:,.1f}×" if b else "–"
        return f"  {label:<16} {a:>12,} {b:>12,} {ratio:>9} {groups:>7} {state:>7,}"

    pairs = list(zip(per_layer.stages, cross.stages, strict=True))
    for a, b in pairs:
        if b.report is None or not b.report.compatible or a.report is None \
                or not a.report.compatible:
            lines.append(f"  {b.label:<16} {'NOT COMPATIBLE':>12}")
            continue
        lines.append(row(b.label, a.blocks, b.blocks, f"{b.groups:,}", b.state_blocks))
    if len(pairs) > 1:
        lines.append(row("total", sum(a.blocks for a, _ in pairs),
                         sum(b.blocks for _, b in pairs), "",
                         sum(b.state_blocks for _, b in pairs)))
    lines.append("  (KV page blocks; a cross-layer group is the run of a stage's layers that "
                 "sit side by side on both sides: one block per run when it is a whole pool "
                 "page on both sides, else one per page)")
    if any(b.blocks > a.blocks for a, b in pairs):
        lines.append("  cross-layer moves more blocks here: a stage's pool page is only part of "
                     "the decode's, so each page is its own block, while per-layer buffers "
                     "move one block per run per layer")
    return lines


def _per_layer_lines(what: str, per_layer: dict[int, int],
                     format_ids: Callable[..., str]) -> list[str]:
    """One line per distinct byte count (layers with equal bytes share a line)."""
    by_value: dict[int, list[int]] = {}
    for layer, n in sorted(per_layer.items()):
        by_value.setdefault(n, []).append(layer)
    return [f"  {what:<5} {_bytes(n):>28} each: layers {format_ids(layers)} "
            f"({len(layers)} layer{'s' if len(layers) != 1 else ''})"
            for n, layers in sorted(by_value.items(), key=lambda kv: kv[1][0])]


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------


def plot(e: Explanation, path: str) -> None:
    """Draw the run-length histogram and bytes per layer into ``path`` (PNG).

    Raises:
        ImportError: matplotlib is missing (``pip install 'kvplan[plot]'``).
    """
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "--plot needs matplotlib: pip install 'kvplan[plot]'") from err
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_runs, ax_layers) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = histogram(e.run_lengths)
    ax_runs.bar([r[0] for r in rows], [r[1] for r in rows], color="#4c72b0")
    ax_runs.set_xlabel("run length (pages)")
    ax_runs.set_ylabel("runs")
    ax_runs.set_title(f"run lengths: {len(e.run_lengths):,} runs over {e.pages:,} pages")
    ax_runs.tick_params(axis="x", labelrotation=45)

    layers = sorted(set(e.kv_bytes_per_layer) | set(e.state_bytes_per_layer))
    kv = [e.kv_bytes_per_layer.get(i, 0) / (1 << 20) for i in layers]
    state = [e.state_bytes_per_layer.get(i, 0) / (1 << 20) for i in layers]
    ax_layers.bar(layers, kv, color="#4c72b0", label="KV pages")
    if any(state):
        ax_layers.bar(layers, state, bottom=kv, color="#dd8452", label="per-request state")
        ax_layers.legend(loc="upper left", bbox_to_anchor=(0, -0.18), ncol=2, frameon=False)
    # Headroom so the tallest bars are not cut by the frame.
    ax_layers.set_ylim(0, max(k + s for k, s in zip(kv, state, strict=True)) * 1.1 or 1)
    ax_layers.set_xlabel("layer id")
    ax_layers.set_ylabel("MiB")
    ax_layers.set_title(f"bytes per layer (total {e.bytes / (1 << 20):,.1f} MiB)")
    fig.suptitle(e.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _int_arg(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high`` (the error names the bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also digit strings past Python's conversion limit
            raise argparse.ArgumentTypeError(f"expected an integer, got {_short(text)}") from None
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {_short(text)}") from None
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _int_list_arg(low: int, high: int, example: str) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each in ``low..high``."""
    def parse(text: str) -> list[int]:
        parts = text.split(",")
        try:
            values = [int(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers like {example}, got {_short(text)}") from None
        bad = [v for v in values if not low <= v <= high]
        if bad:
            raise argparse.ArgumentTypeError(
                f"every value must be in {low}..{high}, got {bad[0]} in {_short(text)}")
        return values

    return parse


def _one_line_error(parser: argparse.ArgumentParser) -> Callable[[str], NoReturn]:
    """argparse's ``error`` as one line on stderr and exit 2 (no usage block)."""
    def error(message: str) -> NoReturn:
        sys.stderr.write(f"{parser.prog}: {_one_line(ValueError(message), 500)} "
                         f"(see --help)\n")
        raise SystemExit(EXIT_USAGE)

    return error


EPILOG = f"""\
exit status: {EXIT_OK} every stage is compatible; {EXIT_INCOMPATIBLE} a stage is not (its report
  is printed); {EXIT_USAGE} bad input: an option, a layout file or a field in it (one line on
  stderr names it and the value); {EXIT_INTERNAL} internal error (a bug in kvplan: the traceback
  is printed).

Peers without layer ids at prefill PP > 1 pair by legacy positional slicing, which needs the
layer each prefill stage starts at. It is derived from published layer ids; when a stage or the
decode layout publishes none, explain refuses (exit {EXIT_USAGE}) unless --prefill-start-layer gives
it, one value per stage.
"""


def add_arguments(parser: argparse.ArgumentParser) -> Runner:
    """Fill the ``explain`` sub-parser; returns the runner (the ``cli.SUBCOMMANDS`` contract)."""
    from kvplan.presets import PRESETS

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the epilog's lines
    setattr(parser, "error", _one_line_error(parser))  # an instance attribute, not a subclass
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS),
                     help="reference model (docs/design.md, Reference scenarios)")
    src.add_argument("--prefill", action="append", metavar="FILE.json",
                     help="prefill layout JSON (Layout.to_dict); repeat once per PP stage")
    parser.add_argument("--decode", metavar="FILE.json",
                        help="decode layout JSON (required with --prefill, refused with --preset)")
    parser.add_argument("--pages", type=_int_arg(1), default=512,
                        help="pages the request moves, at least 1 (default 512)")
    parser.add_argument("--page-size", type=_int_arg(1), default=None,
                        help="tokens per page for presets, at least 1 (default 1, SGLang's "
                             "default); layout files carry their own")
    parser.add_argument("--decode-page-size", type=_int_arg(1), default=None,
                        help="tokens per decode page for presets, when it differs from the "
                             "prefill's --page-size (plans are then token-exact; default: the "
                             "same as --page-size)")
    parser.add_argument("--pp", type=_int_arg(1), default=None,
                        help="prefill PP stages for presets (default 1)")
    parser.add_argument("--pp-split", metavar="N,N,...", type=_int_list_arg(1, MAX_LAYERS, "20,28"),
                        help="layers per prefill stage for presets (default: even split)")
    parser.add_argument("--stage", type=_int_arg(0), default=None,
                        help="explain only this prefill stage, counted from 0 (default: all)")
    parser.add_argument("--layout", choices=("per-layer", "cross-layer"), default=None,
                        help="KV memory of the preset's peers: per-layer (one buffer per layer "
                             "and K/V, default) or cross-layer (one pool per peer holding every "
                             "KV layer of a page side by side, vLLM's cross-layer layout; state "
                             "stays per layer). cross-layer also prints blocks per request for "
                             "both layouts")
    parser.add_argument("--layers", type=_int_arg(1, MAX_LAYERS), default=None,
                        help="override the preset's layer count (e.g. 27 for kimi-linear; "
                             f"at most {MAX_LAYERS:,})")
    parser.add_argument("--fragmentation", type=_fraction_arg, default=0.0,
                        help="fraction of decode page boundaries that break a run: 0 = one "
                             "contiguous run, 1 = every page its own run (default 0)")
    parser.add_argument("--seed", type=_int_arg(0), default=0,
                        help="seed for where the breaks fall, at least 0 (default 0)")
    parser.add_argument("--backend", default="mooncake",
                        help="pairing policy backend for select_pairing (default mooncake; "
                             "'ascend' applies Ascend's pairing rules, as "
                             "kvplan.select_pairing documents them)")
    parser.add_argument("--prefill-start-layer", metavar="N[,N,...]",
                        type=_int_list_arg(0, MAX_START_LAYER, "0,31"), default=None,
                        help="first layer of each prefill stage, for legacy slicing of peers "
                             "without layer ids: one value per prefill stage in stage order "
                             "(or a single value when one stage is explained); default: derived "
                             "from the layer ids, refused when there are none")
    parser.add_argument("--max-blocks", type=_int_arg(1), default=DEFAULT_MAX_BLOCKS,
                        help=f"blocks per engine call, at least 1 (default {DEFAULT_MAX_BLOCKS})")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the run-length histogram and bytes per layer "
                             "(needs matplotlib: the 'plot' extra)")
    parser.add_argument("--write-layouts", metavar="DIR",
                        help="also write the layouts as JSON (prefill-stageK.json, decode.json)")
    return run


def _check_options(args: argparse.Namespace) -> None:
    """Refuse options the chosen input ignores (a silently ignored option is a wrong answer)."""
    if args.preset:
        if args.decode:
            raise ValueError("--decode is for layout files (with --prefill); a preset builds "
                             "its own decode layout")
        if args.pp is not None and args.pp_split is not None and args.pp != len(args.pp_split):
            raise ValueError(f"--pp {args.pp} disagrees with --pp-split {_pp_text(args)} "
                             f"({len(args.pp_split)} stages)")
        return
    given = [opt for opt, value in (("--page-size", args.page_size),
                                    ("--decode-page-size", args.decode_page_size),
                                    ("--pp", args.pp), ("--pp-split", args.pp_split),
                                    ("--layers", args.layers),
                                    ("--layout", getattr(args, "layout", None)))
             if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} only apply to --preset; layout files carry their "
                         f"own page size, PP split, layers and memory layout")
    if not args.decode:
        raise ValueError("--prefill needs --decode FILE.json")


def _pp_text(args: argparse.Namespace) -> str:
    return ",".join(map(str, args.pp_split))


def _scenario(args: argparse.Namespace, cross_layer: bool = False
              ) -> tuple[str, str, list[tuple[str, Any]], Any]:
    """(title, description, prefill stages, decode) from the command line; for presets with
    ``cross_layer``, every peer's KV in one cross-layer pool."""
    from kvplan import KvPlanError
    from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset, split_layers

    _check_options(args)
    if args.preset:
        preset = get_preset(args.preset, args.layers)
        counts = args.pp_split
        pp = len(counts) if counts else (args.pp or 1)
        page_size = args.page_size or 1
        try:
            splits = split_layers(preset.num_layers, pp, counts)
        except KvPlanError as err:
            option = f"--pp-split {_pp_text(args)}" if counts else f"--pp {pp}"
            raise ValueError(f"{option}: {err}") from None
        # Pools large enough for the request (with its fragmentation gaps) on both sides.
        capacity = args.pages + round(args.fragmentation * (args.pages - 1))
        try:
            stages = [
                (f"stage {k}/{pp}" if pp > 1 else "prefill",
                 preset.layout(list(r), page_size=page_size, capacity=capacity,
                               base=PREFILL_BASE + k * (1 << 40), pp_rank=k, pp_size=pp,
                               cross_layer=cross_layer))
                for k, r in enumerate(splits)
            ]
            decode_size = args.decode_page_size or page_size
            decode_capacity = capacity
            if decode_size != page_size:
                # The request's tokens in decode pages, plus the fragmentation gaps.
                needed = -(-args.pages * page_size // decode_size)
                decode_capacity = needed + round(args.fragmentation * (needed - 1))
            decode = preset.layout(list(range(preset.num_layers)), page_size=decode_size,
                                   capacity=decode_capacity, base=DECODE_BASE,
                                   cross_layer=cross_layer)
        except (KvPlanError, OverflowError) as err:
            # Page size x pages sizes the synthetic pools; past 2**64 bytes of address space
            # the layout cannot be built.
            raise ValueError(
                f"--page-size {page_size} with --pages {args.pages}: {preset.name}'s KV pools "
                f"({capacity:,} pages × {preset.kv_bytes_per_token * page_size:,} B per page) "
                f"do not fit in a 64-bit address space ({_one_line(err)})") from None
        split_text = " | ".join(f"{r.start}–{r.stop - 1}" for r in splits)
        sizes = (f"page_size {page_size}" if decode.page_size == page_size
                 else f"page_size {page_size} prefill, {decode.page_size} decode")
        desc = (f"{preset.description}; prefill PP {pp} (layers {split_text}), decode PP 1, "
                f"{sizes}"
                + ("; cross-layer KV pools (state per layer)" if cross_layer else ""))
        title = f"{preset.name}" + (f" ({preset.num_layers} layers)" if args.layers else "")
        return title, desc, stages, decode
    stages = []
    for k, path in enumerate(args.prefill):
        layout = _load_layout(path, "--prefill")
        stages.append((f"stage {layout.pp_rank}/{layout.pp_size}" if layout.pp_size > 1
                       else f"prefill {k}" if len(args.prefill) > 1 else "prefill", layout))
    decode = _load_layout(args.decode, "--decode")
    title = f"{', '.join(os.path.basename(p) for p in args.prefill)} -> " \
            f"{os.path.basename(args.decode)}"
    return title, "layouts from JSON files", stages, decode


def _starts_for(args: argparse.Namespace, n_stages: int) -> list[int | None] | None:
    """``--prefill-start-layer`` for the stages explained (after ``--stage``)."""
    values = args.prefill_start_layer
    if values is None:
        return None
    if len(values) == 1 and (n_stages == 1 or args.stage is not None):
        return [values[0]]
    if len(values) != n_stages:
        raise ValueError(f"--prefill-start-layer: {len(values)} value(s) for {n_stages} "
                         f"prefill stages; give one per stage, in stage order")
    return list(values) if args.stage is None else [values[args.stage]]


def _write_layouts(directory: str, stages: list[tuple[str, Any]], decode: Any) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        for _, layout in stages:
            name = f"prefill-stage{layout.pp_rank}.json" if layout.pp_size > 1 else "prefill.json"
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                json.dump(layout.to_dict(), f, indent=1)
        with open(os.path.join(directory, "decode.json"), "w", encoding="utf-8") as f:
            json.dump(decode.to_dict(), f, indent=1)
    except OSError as err:
        raise ValueError(f"--write-layouts {directory}: {err.strerror or err}"
                         + (f": {err.filename}" if err.filename else "")) from None


def run(args: argparse.Namespace) -> int:
    """Run ``kvplan explain``: exit 0 if every stage is compatible, 1 if not, 2 on bad input,
    3 on an internal error (so that 1 never stands for a crash)."""
    try:
        return _run(args)
    except BrokenPipeError:
        raise  # the reader went away: the console script stops quietly
    except (ValueError, OSError) as err:  # KvPlanError is a ValueError
        print(f"kvplan explain: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        print("kvplan explain: out of memory for this request: lower --pages (or "
              "--fragmentation, which multiplies the blocks)", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # a bug, not bad input: show it, but never as exit 1 ("incompatible")
        traceback.print_exc()
        print("kvplan explain: internal error (the traceback above is a bug in kvplan)",
              file=sys.stderr)
        return EXIT_INTERNAL


def _run(args: argparse.Namespace) -> int:
    cross = getattr(args, "layout", None) == "cross-layer"
    title, desc, stages, decode = _scenario(args, cross_layer=cross)
    n_all = len(stages)
    if args.stage is not None:
        if not 0 <= args.stage < n_all:
            raise ValueError(f"--stage must be in 0..{n_all - 1}, got {args.stage}")
        stages = [stages[args.stage]]
    starts = _starts_for(args, n_all)
    if args.write_layouts:
        _write_layouts(args.write_layouts, stages, decode)
    e = explain(stages, decode, title=title, description=desc, pages=args.pages,
                fragmentation=args.fragmentation, seed=args.seed, backend=args.backend,
                prefill_start_layer=starts, max_blocks=args.max_blocks,
                layout="cross-layer" if cross else "per-layer")
    if cross:
        # The same scenario with per-layer buffers, for the blocks-per-request comparison.
        _, _, flat_stages, flat_decode = _scenario(args)
        if args.stage is not None:
            flat_stages = [flat_stages[args.stage]]
        e.per_layer = explain(flat_stages, flat_decode, title=title, description=desc,
                              pages=args.pages, fragmentation=args.fragmentation,
                              seed=args.seed, backend=args.backend, prefill_start_layer=starts,
                              max_blocks=args.max_blocks)
    if args.plot:
        # Before printing: a plot that cannot be written is bad input, reported on its own.
        try:
            plot(e, args.plot)
        except ImportError as err:
            raise ValueError(str(err)) from None
        except (OSError, ValueError) as err:  # unwritable path, unknown image format
            raise ValueError(f"--plot {args.plot}: {_one_line(err)}") from None
    print(render(e))
    if args.plot:
        print(f"plot written to {args.plot}")
    return EXIT_OK if e.ok else EXIT_INCOMPATIBLE
