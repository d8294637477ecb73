"""``kvplan explain``: what a plan will do for a model, a request size, a PP split, fragmentation.

For a preset (design.md §7) or two layout JSON files (``Layout.to_dict`` format), it builds the
template of every prefill PP stage against the decode peer (with the pairing
:func:`kvplan.select_pairing` picks for ``--backend``), plans one request and prints entries
paired, runs, blocks, bytes, a run-length histogram, bytes per layer and warnings.
``--plot FILE.png`` draws the histogram and bytes per layer (matplotlib, the ``plot`` extra,
imported only then).

Page lists: the prefill pages are ``0 .. pages-1`` (contiguous); the decode pages come from a
free list in which a fraction ``--fragmentation`` of the page boundaries is broken (0: one run;
1: every page its own run), chosen reproducibly from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Explanation", "StageResult", "add_arguments", "explain", "render", "run"]

Runner = Callable[[argparse.Namespace], int]

#: Blocks per engine call assumed for the "engine calls" figure (the engines' default bound).
DEFAULT_MAX_BLOCKS = 1024
#: Average block size below which per-block engine overhead dominates (warning threshold).
SMALL_BLOCK_BYTES = 16 << 10
#: design.md §6: handing Mooncake Python lists costs ~20-100 ns per element (three lists).
LIST_NS_PER_ELEMENT = (20, 100)


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
    ``breaks + 1`` runs against a contiguous prefill list.
    """
    import numpy as np

    if pages < 1:
        raise ValueError(f"--pages must be at least 1, got {pages}")
    if not 0.0 <= fragmentation <= 1.0:
        raise ValueError(f"--fragmentation must be in [0, 1], got {fragmentation}")
    breaks = round(fragmentation * (pages - 1))
    steps = np.ones(pages, dtype=np.int64)
    steps[0] = 0
    if breaks:
        rng = np.random.default_rng(seed)
        at = rng.choice(np.arange(1, pages), size=breaks, replace=False)
        steps[at] = 2
    return np.cumsum(steps), breaks


def _stage_start(decode: Any, stage: Any) -> int:
    """The dense offset of a stage's first layer among the decode's page layers (legacy start)."""
    stage_ids = [i for i, k in zip(stage.layer_ids or [], stage.kinds) if k == "page"]
    if not stage_ids or decode.layer_ids is None:
        return 0
    first = min(stage_ids)
    return len({i for i, k in zip(decode.layer_ids, decode.kinds)
                if k == "page" and i is not None and i < first})


def _load_layout(path: str) -> Any:
    from kvplan import Layout

    with open(path, encoding="utf-8") as f:
        return Layout.from_dict(json.load(f))


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
    prefill_start_layer: int | None = None,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
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
        prefill_start_layer: For legacy (id-less) pairing; default derived from the ids.
        max_blocks: Blocks per engine call, for the engine-call count.
    """
    import numpy as np

    import kvplan

    dst_pages, breaks = decode_pages(pages, fragmentation, seed)
    src_pages = np.arange(pages, dtype=np.int64)
    _, _, run_lengths = kvplan.group_contiguous(src_pages, dst_pages)
    page_size = decode.page_size
    kv_per_layer: dict[int, int] = {}
    state_per_layer: dict[int, int] = {}
    stages: list[StageResult] = []
    warnings: list[str] = []

    for label, src in prefills:
        layer_text = _layers_text(src)
        choice = kvplan.select_pairing(backend, src)
        start = prefill_start_layer
        if choice.mode == "legacy" and start is None:
            start = _stage_start(decode, src)
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
        for side, layout, idx in (("prefill", src, src_pages), ("decode", decode, dst_pages)):
            caps = [c for c, k in zip(layout.capacities, layout.kinds) if k == "page"]
            if caps and int(idx.max()) >= min(caps):
                raise kvplan.IndexBoundsError(
                    f"{side} pool holds {min(caps)} pages but the request needs page "
                    f"{int(idx.max())}: lower --pages or --fragmentation")
        template.plan(src_pages, dst_pages)  # warm the buffer pool (plan dropped at once): time steady state
        t0 = time.perf_counter()
        plan = template.plan(src_pages, dst_pages)
        plan_us = (time.perf_counter() - t0) * 1e6
        src_ids = src.layer_ids
        lengths = plan.lengths
        offsets = plan.pair_offsets
        for p, (i, _) in enumerate(template.pairs.tolist()):
            lid = src_ids[i] if src_ids is not None else i
            nbytes = int(lengths[offsets[p]:offsets[p + 1]].sum())
            kv_per_layer[lid] = kv_per_layer.get(lid, 0) + nbytes
        state_blocks = state_bytes = 0
        if template.state_pairs.size:
            # One request slot per side: slot 0 on prefill to slot 1 on decode.
            state_plan = template.plan_state(0, 1 if _min_state_cap(decode) > 1 else 0)
            state_blocks, state_bytes = state_plan.n_blocks, state_plan.total_bytes
            for (i, _), n in zip(template.state_pairs.tolist(), state_plan.lengths.tolist()):
                lid = src_ids[i] if src_ids is not None else i
                state_per_layer[lid] = state_per_layer.get(lid, 0) + int(n)
        stages.append(StageResult(
            label, layer_text, choice.mode, len(template.pairs), len(template.state_pairs),
            plan.n_runs, plan.n_blocks, plan.total_bytes, state_blocks, state_bytes, plan_us,
            report))

    expl = Explanation(title, description, pages, page_size, fragmentation, breaks, stages,
                       [int(x) for x in run_lengths], kv_per_layer, state_per_layer, warnings,
                       max_blocks)
    expl.warnings = warnings + _plan_warnings(expl)
    return expl


def _min_state_cap(layout: Any) -> int:
    caps = [c for c, k in zip(layout.capacities, layout.kinds) if k == "state"]
    return min(caps) if caps else 0


def _layers_text(layout: Any) -> str:
    from kvplan.report import format_ids

    ids = layout.layer_ids
    if ids is None:
        return f"{layout.n_entries} entries, no layer ids"
    n_model = layout.num_model_layers
    page = [i for i, k in zip(ids, layout.kinds) if k == "page" and i is not None]
    state = [i for i, k in zip(ids, layout.kinds) if k == "state" and i is not None]
    every = sorted(set(page) | set(state))
    model = [i for i in every if n_model is None or i < n_model]
    text = f"layers {format_ids(model)}" if model else "no layers"
    if state:
        text += f" (KV on {format_ids(page)})"
    return text


def _plan_warnings(e: Explanation) -> list[str]:
    out: list[str] = []
    runs = len(e.run_lengths)
    if runs > 1:
        what = "fully fragmented" if runs == e.pages else "fragmented"
        out.append(f"destination {what}: {runs}× more blocks than contiguous "
                   f"({runs:,} runs for {e.pages:,} pages; one block per run per entry pair)")
    page_blocks = sum(s.blocks for s in e.stages)
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
                   f"{lo:.0f}–{hi:.0f} ms (design.md §6: 20–100 ns per list element)")
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
    lines.append(f"run lengths ({len(e.run_lengths):,} runs over {e.pages:,} pages):")
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


def add_arguments(parser: argparse.ArgumentParser) -> Runner:
    """Fill the ``explain`` sub-parser; returns the runner (the ``cli.SUBCOMMANDS`` contract)."""
    from kvplan.presets import PRESETS

    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS),
                     help="reference model (design.md §7)")
    src.add_argument("--prefill", action="append", metavar="FILE.json",
                     help="prefill layout JSON (Layout.to_dict); repeat once per PP stage")
    parser.add_argument("--decode", metavar="FILE.json",
                        help="decode layout JSON (required with --prefill)")
    parser.add_argument("--pages", type=int, default=512,
                        help="pages the request moves (default 512)")
    parser.add_argument("--page-size", type=int, default=1,
                        help="tokens per page for presets (default 1, SGLang's default)")
    parser.add_argument("--pp", type=int, default=1, help="prefill PP stages (default 1)")
    parser.add_argument("--pp-split", metavar="N,N,...",
                        help="layers per prefill stage (default: even split)")
    parser.add_argument("--stage", type=int, default=None,
                        help="explain only this prefill stage (default: all)")
    parser.add_argument("--layers", type=int, default=None,
                        help="override the preset's layer count (e.g. 27 for kimi-linear)")
    parser.add_argument("--fragmentation", type=float, default=0.0,
                        help="fraction of decode page boundaries that break a run: 0 = one "
                             "contiguous run, 1 = every page its own run (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed for where the breaks fall")
    parser.add_argument("--backend", default="mooncake",
                        help="pairing policy backend for select_pairing (default mooncake; "
                             "'ascend' applies the seed's dispatch)")
    parser.add_argument("--prefill-start-layer", type=int, default=None,
                        help="first layer of the prefill stage, for legacy peers without ids")
    parser.add_argument("--max-blocks", type=int, default=DEFAULT_MAX_BLOCKS,
                        help=f"blocks per engine call (default {DEFAULT_MAX_BLOCKS})")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the run-length histogram and bytes per layer "
                             "(needs matplotlib: the 'plot' extra)")
    parser.add_argument("--write-layouts", metavar="DIR",
                        help="also write the layouts as JSON (prefill-stageK.json, decode.json)")
    return run


def _scenario(args: argparse.Namespace) -> tuple[str, str, list[tuple[str, Any]], Any]:
    """(title, description, prefill stages, decode) from the command line."""
    from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset, split_layers

    if args.preset:
        preset = get_preset(args.preset, args.layers)
        counts = ([int(x) for x in args.pp_split.split(",")] if args.pp_split else None)
        pp = len(counts) if counts else args.pp
        splits = split_layers(preset.num_layers, pp, counts)
        # Pools large enough for the request (with its fragmentation gaps) on both sides.
        capacity = args.pages + round(args.fragmentation * (args.pages - 1))
        stages = [
            (f"stage {k}/{pp}" if pp > 1 else "prefill",
             preset.layout(list(r), page_size=args.page_size, capacity=capacity,
                           base=PREFILL_BASE + k * (1 << 40), pp_rank=k, pp_size=pp))
            for k, r in enumerate(splits)
        ]
        decode = preset.layout(list(range(preset.num_layers)), page_size=args.page_size,
                               capacity=capacity, base=DECODE_BASE)
        split_text = " | ".join(f"{r.start}–{r.stop - 1}" for r in splits)
        desc = (f"{preset.description}; prefill PP {pp} (layers {split_text}), decode PP 1, "
                f"page_size {args.page_size}")
        title = f"{preset.name}" + (f" ({preset.num_layers} layers)" if args.layers else "")
        return title, desc, stages, decode
    if not args.decode:
        raise ValueError("--prefill needs --decode FILE.json")
    stages = []
    for k, path in enumerate(args.prefill):
        layout = _load_layout(path)
        stages.append((f"stage {layout.pp_rank}/{layout.pp_size}" if layout.pp_size > 1
                       else f"prefill {k}" if len(args.prefill) > 1 else "prefill", layout))
    decode = _load_layout(args.decode)
    title = f"{', '.join(os.path.basename(p) for p in args.prefill)} -> " \
            f"{os.path.basename(args.decode)}"
    return title, "layouts from JSON files", stages, decode


def run(args: argparse.Namespace) -> int:
    """Run ``kvplan explain``: exit 0 if every stage is compatible, 1 if not, 2 on bad input."""
    import sys

    try:
        title, desc, stages, decode = _scenario(args)
        if args.stage is not None:
            if not 0 <= args.stage < len(stages):
                raise ValueError(f"--stage must be in 0..{len(stages) - 1}, got {args.stage}")
            stages = [stages[args.stage]]
        if args.write_layouts:
            os.makedirs(args.write_layouts, exist_ok=True)
            for k, (_, layout) in enumerate(stages):
                with open(os.path.join(args.write_layouts, f"prefill-stage{layout.pp_rank}.json"
                                       if layout.pp_size > 1 else "prefill.json"), "w",
                          encoding="utf-8") as f:
                    json.dump(layout.to_dict(), f, indent=1)
            with open(os.path.join(args.write_layouts, "decode.json"), "w",
                      encoding="utf-8") as f:
                json.dump(decode.to_dict(), f, indent=1)
        e = explain(stages, decode, title=title, description=desc, pages=args.pages,
                    fragmentation=args.fragmentation, seed=args.seed, backend=args.backend,
                    prefill_start_layer=args.prefill_start_layer, max_blocks=args.max_blocks)
    except (ValueError, OSError) as err:  # KvPlanError is a ValueError
        print(f"kvplan explain: {err}", file=sys.stderr)
        return 2
    print(render(e))
    if args.plot:
        try:
            plot(e, args.plot)
        except ImportError as err:
            print(f"kvplan explain: {err}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0 if e.ok else 1
