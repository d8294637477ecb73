"""The text ``kvplan explain`` prints for an :class:`~kvplan.explain.analysis.Explanation`."""

from __future__ import annotations

import math
from collections.abc import Callable

from kvplan.explain.analysis import DcpExplanation, Explanation, histogram
from kvplan.explain.diagnose import StageDiagnosis
from kvplan.explain.words import format_bytes
from kvplan.report import CompatReport

__all__ = ["render", "render_dcp"]


def _bar(value: int, top: int, width: int = 32) -> str:
    if value <= 0 or top <= 0:
        return ""
    return "█" * max(1, round(width * value / top))


def _coalescing_lines(e: Explanation) -> list[str]:
    """Per stage and decode entry kind: its page pairs, how many emit with the pair before
    them, and what keeps the others apart (the core's per-pair coalescing)."""
    stages = [s for s in e.stages if s.coalescing]
    if not stages:
        return []
    lines = ["", "coalescing (what keeps page pairs from emitting their blocks together):"]
    for s in stages:
        if len(stages) > 1:
            lines.append(f"  {s.label}:")
        for row in s.coalescing:
            lines.append(f"  {row.kind:<18} {row.pairs:>5} pairs, {row.joined:>5} joined with "
                         f"the pair before")
            for why, n in row.blockers:
                lines.append(f"    {n:>5} apart: {why}")
            if row.per_page:
                lines.append(f"    {row.per_page:>5} emit a block per page, not per run: a page "
                             f"stride longer than the item")
    return lines


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
        lines.append(f"total bytes {format_bytes(e.bytes)}; {calls:,} engine call(s) of at most "
                     f"{e.max_blocks:,} blocks; planned in {plan_us:,.0f} µs")
        per_block = e.bytes / e.blocks if e.blocks else 0.0
        lines.append(f"per request: {e.blocks:,} blocks, {format_bytes(per_block)} per block "
                     f"on average (an engine pays its per-descriptor cost {e.blocks:,} times)")

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
    if e.entry_kinds:
        lines.append("")
        lines.append("entries that are not plain KV pages (decode layout):")
        for name, layers, what in e.entry_kinds:
            lines.append(f"  {name:<16} layers {format_ids(layers)} ({len(layers)}): {what}")

    lines += _coalescing_lines(e)

    if e.per_layer is not None:
        lines.append("")
        lines += _layout_comparison(e.per_layer, e)
    lines += _reports_and_warnings([(s.label, s.report) for s in e.stages], e.warnings,
                                   [s.diagnosis for s in e.stages])
    return "\n".join(lines)


def _reports_and_warnings(reports: list[tuple[str, CompatReport | None]],
                          warnings: list[str],
                          diagnoses: list[StageDiagnosis] | None = None) -> list[str]:
    """The compatibility report of every incompatible (label, report), after explain's own
    reading of it (``diagnoses``, one per report: its lines first), then the warnings."""
    lines: list[str] = []
    for k, (label, report) in enumerate(reports):
        if report is not None and not report.compatible:
            diagnosis = diagnoses[k] if diagnoses is not None else StageDiagnosis()
            lines.append("")
            lines.append(f"{label}: compatibility report")
            lines += [f"  explain: {x}" for x in diagnosis.lines]
            lines += [f"  {x}" for x in str(report).splitlines()]
    lines.append("")
    if warnings:
        lines.append("warnings:")
        lines += [f"  - {w}" for w in warnings]
    else:
        lines.append("warnings: none")
    return lines


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
    return [f"  {what:<5} {format_bytes(n):>28} each: layers {format_ids(layers)} "
            f"({len(layers)} layer{'s' if len(layers) != 1 else ''})"
            for n, layers in sorted(by_value.items(), key=lambda kv: kv[1][0])]


def render_dcp(e: DcpExplanation) -> str:
    """The text ``kvplan explain --decode-dcp N`` prints: which tokens each decode DCP rank
    holds, and what each rank's plan costs."""
    lines = [f"kvplan explain: {e.title}"]
    if e.description:
        lines.append(f"  {e.description}")
    sizes = (f"page_size {e.page_size}" if e.page_size == e.decode_page_size
             else f"page_size {e.page_size} prefill, {e.decode_page_size} decode")
    lines.append(f"request: {e.tokens:,} global tokens ({e.pages:,} prefill pages, {sizes}), "
                 f"dealt over decode DCP {e.dcp_size} (interleave {e.interleave})")
    lines.append("")
    lines.append("which tokens each decode rank holds:")
    seen: set[int] = set()
    for r in e.rows:
        if r.rank not in seen:
            seen.add(r.rank)
            lines.append(f"  rank {r.rank}: {r.deal}")
    lines.append("")
    lines.append(f"{'decode rank':<12} {'prefill stage':<16} {'blocks':>10} {'scattered':>10} "
                 f"{'packed':>8} {'scattered':>10} {'gather':>10} {'state':>6} {'bytes':>16}")
    for r in e.rows:
        if r.report is None or not r.report.compatible:
            lines.append(f"{'rank ' + str(r.rank):<12} {r.stage:<16} {'NOT COMPATIBLE':>10}")
            continue
        lines.append(f"{'rank ' + str(r.rank):<12} {r.stage:<16} {r.blocks:>10,} "
                     f"{r.scattered_blocks:>10,} {r.packed_network_blocks:>8,} "
                     f"{r.packed_scattered_network_blocks:>10,} {r.packed_gather_blocks:>10,} "
                     f"{r.state_blocks:>6,} {r.bytes + r.state_bytes:>16,}")
        if r.empty_reason is not None:
            lines.append(f"  moves no KV: {r.empty_reason}")
    lines.append("  (blocks: direct plan, pages consecutive on both sides; scattered: no two "
                 "pages consecutive; packed: network blocks through a pack buffer "
                 "(Template.plan_packed), after the gather blocks that fill it locally; state "
                 "blocks, never packed, are counted in the totals)")
    lines.append("")
    lines.append("per decode rank, every stage:")
    for t in e.rank_costs():
        calls = math.ceil(t.blocks / e.max_blocks)
        lines.append(f"  rank {t.rank}: {t.blocks:,} blocks ({t.scattered_blocks:,} scattered), "
                     f"{format_bytes(t.bytes)}, {calls:,} engine call(s) of at most "
                     f"{e.max_blocks:,} blocks")
        lines.append(f"    packed: {t.network_blocks:,} network blocks "
                     f"({t.scattered_network_blocks:,} scattered) after {t.gather_blocks:,} "
                     f"gather blocks ({t.scattered_gather_blocks:,} scattered)")
    lines += _reports_and_warnings([(f"rank {r.rank}, {r.stage}", r.report) for r in e.rows],
                                   e.warnings)
    return "\n".join(lines)
