"""``kvplan explain --json``: the explanation ``render`` prints, as one JSON object.

Every figure of the text is here under a name (the run-length histogram as its buckets, not the
request's runs one by one); a refused stage carries its compatibility report (reasons, coverage,
warnings, the first problem ``Template`` raises) with explain's own reading of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvplan.explain.analysis import DcpExplanation, Explanation, StageResult, histogram

__all__ = ["dcp_json", "explanation_json"]


def _report_json(report: Any) -> dict[str, Any] | None:
    if report is None:
        return None
    first = report.first_problem
    return {
        "compatible": bool(report.compatible),
        "reasons": list(report.reasons),
        "coverage": list(report.coverage),
        "warnings": list(report.warnings),
        "prefill": report.prefill,
        "decode": report.decode,
        "first_problem": None if first is None else {"error": first[0], "message": first[1]},
    }


def _stage_json(s: StageResult) -> dict[str, Any]:
    return {
        "label": s.label,
        "layers": s.layers,
        "pairing": s.pairing,
        "compatible": s.report is not None and bool(s.report.compatible),
        "page_pairs": s.page_pairs,
        "state_pairs": s.state_pairs,
        "runs": s.runs,
        "blocks": s.blocks,
        "bytes": s.bytes,
        "state_blocks": s.state_blocks,
        "state_bytes": s.state_bytes,
        "groups": s.groups,
        "contiguous_blocks": s.contiguous_blocks,
        "plan_us": s.plan_us,
        "problems": list(s.problems),
        "diagnosis": list(s.diagnosis.lines),
        "coalescing": [
            {"kind": row.kind, "pairs": row.pairs, "joined": row.joined,
             "blockers": [{"why": why, "pairs": n} for why, n in row.blockers],
             "per_page": row.per_page}
            for row in s.coalescing],
        "report": _report_json(s.report),
    }


def _per_layer(table: dict[int, int]) -> list[dict[str, int]]:
    return [{"layer": layer, "bytes": n} for layer, n in sorted(table.items())]


def explanation_json(e: Explanation) -> dict[str, Any]:
    """The JSON object of ``kvplan explain --json`` for ``e``."""
    return {
        "title": e.title,
        "description": e.description,
        "ok": e.ok,
        "pages": e.pages,
        "page_size": e.page_size,
        "fragmentation": e.fragmentation,
        "breaks": e.breaks,
        "layout": e.layout,
        "max_blocks": e.max_blocks,
        "blocks": e.blocks,
        "bytes": e.bytes,
        "runs": len(e.run_lengths),
        "run_pages": sum(e.run_lengths),
        "run_length_histogram": [{"length": label, "runs": runs, "pages": pages}
                                 for label, runs, pages in histogram(e.run_lengths) if runs],
        "stages": [_stage_json(s) for s in e.stages],
        "kv_bytes_per_layer": _per_layer(e.kv_bytes_per_layer),
        "state_bytes_per_layer": _per_layer(e.state_bytes_per_layer),
        "entry_kinds": [{"kind": name, "layers": list(layers), "moves": what}
                        for name, layers, what in e.entry_kinds],
        "warnings": list(e.warnings),
        "per_layer": None if e.per_layer is None else explanation_json(e.per_layer),
    }


def dcp_json(e: DcpExplanation) -> dict[str, Any]:
    """The JSON object of ``kvplan explain --decode-dcp N --json`` for ``e``."""
    rows = []
    for r in e.rows:
        row = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "report"}
        row["compatible"] = r.report is not None and bool(r.report.compatible)
        row["report"] = _report_json(r.report)
        rows.append(row)
    return {
        "title": e.title,
        "description": e.description,
        "ok": e.ok,
        "pages": e.pages,
        "page_size": e.page_size,
        "decode_page_size": e.decode_page_size,
        "tokens": e.tokens,
        "dcp_size": e.dcp_size,
        "interleave": e.interleave,
        "max_blocks": e.max_blocks,
        "rows": rows,
        "rank_costs": [dataclasses.asdict(t) for t in e.rank_costs()],
        "warnings": list(e.warnings),
    }
