"""``kvplan explain``'s own reading of a stage, where the compatibility report's lines alone
would mislead a person: what is really wrong with a refused pair, and decode memory that two
blocks of the request write.

* Element sizes differ (a 1-byte fp8 or int8 decode cache of 2-byte bf16 KV): the core refuses
  the pair as a head-slicing problem; explain says a byte copy cannot convert and points to
  conversion plans (:class:`kvplan.ConversionTemplate`).
* Roles that differ only in letter case: the report reads them as layers the decode lacks.
* Decode buffers that alias: the plan is accepted, but two blocks write the same decode bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StageDiagnosis", "aliased_decode_writes", "diagnose_stage"]

#: What an element size usually is, for the conversion diagnosis.
_DTYPE_NAMES = {1: "fp8 or int8", 2: "bf16 or fp16", 4: "fp32"}
#: Where conversion plans are documented.
_CONVERSION_DOCS = "docs/api.md, Conversion plans"


@dataclass
class StageDiagnosis:
    """What explain adds to a refused stage's compatibility report."""

    #: explain's own lines, printed before the report's.
    lines: list[str] = field(default_factory=list)


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"1 {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def _label(layer_id: int | None, role: str | None, index: int) -> str:
    text = " ".join(x for x in ("" if layer_id is None else f"layer {layer_id}", role or "") if x)
    return text or f"entry {index}"


def _conversion_line(src_dtype: int, dst_dtype: int) -> str:
    src_name = _DTYPE_NAMES.get(src_dtype, f"{src_dtype}-byte")
    dst_name = _DTYPE_NAMES.get(dst_dtype, f"{dst_dtype}-byte")
    side = "prefill" if dst_dtype < src_dtype else "decode"
    return (f"element sizes differ: the prefill keeps {src_dtype}-byte elements ({src_name}), "
            f"the decode {dst_dtype}-byte ones ({dst_name}). This is a conversion, not a "
            f"head-slicing problem: a plan copies bytes and cannot convert them. Publish each "
            f"side's KV representation (Layout.with_representations, e.g. bf16 and "
            f"fp8_e4m3:per_token) and plan with kvplan.ConversionTemplate, which converts on "
            f"the {side} ({_CONVERSION_DOCS})")


def diagnose_stage(src: Any, decode: Any, report: Any) -> StageDiagnosis:
    """explain's reading of stage ``src`` against ``decode`` whose ``report`` (a
    :class:`kvplan.report.CompatReport`) says not compatible."""
    out = StageDiagnosis()
    src_dtype, dst_dtype = src.dtype_size, decode.dtype_size
    if src_dtype is not None and dst_dtype is not None and src_dtype != dst_dtype:
        out.lines.append(_conversion_line(src_dtype, dst_dtype))
    # (What differs between paired items of other sizes, bytes per token across page sizes
    # or the refusal's own words for equal items, is the report's own reason line.)
    sizes = [e for e in report.entries if e.exception is not None and e.size_mismatch
             and e.src_item_len != e.dst_item_len]
    if sizes and decode.page_size == src.page_size and not out.lines \
            and all(e.dst_item_len for e in sizes):
        decode_half = all(e.src_item_len == (e.dst_item_len or 0) << 1 for e in sizes)
        prefill_half = all(e.src_item_len << 1 == e.dst_item_len for e in sizes)
        if decode_half or prefill_half:
            half = "the decode's items are half the prefill's" if decode_half \
                else "the prefill's items are half the decode's"
            out.lines.append(
                f"{half}, as a 1-byte (fp8, int8) cache of 2-byte (bf16) KV would be: if so, a "
                f"plan copies bytes and cannot convert them; publish each side's KV "
                f"representation (Layout.with_representations) and plan with "
                f"kvplan.ConversionTemplate ({_CONVERSION_DOCS})")
    case_only = _case_only_roles(report, decode)
    if case_only:
        pairs = ", ".join(f"{a!r} vs {b!r}" for a, b in case_only)
        out.lines.append(
            f"roles differ only in letter case (prefill vs decode: {pairs}): roles are "
            f"compared exactly, so these entries find no partner although the decode holds "
            f"their layers; kvplan's own layouts spell roles in lower case (k, v, kv, ...): "
            f"publish the same spelling on both sides")
    return out


def _case_only_roles(report: Any, decode: Any) -> list[tuple[str, str]]:
    """``(prefill role, decode role)`` for every unpaired prefill entry whose layer the decode
    holds under a role that differs only in letter case."""
    held: dict[tuple[int | None, str], set[str]] = {}
    for e in decode.entries():
        if e.role is not None:
            held.setdefault((e.layer_id, e.role.casefold()), set()).add(e.role)
    found: dict[tuple[str, str], None] = {}
    for e in report.entries:
        if not e.unpaired or e.role is None:
            continue
        for role in sorted(held.get((e.layer_id, e.role.casefold()), ())):
            if role != e.role:
                found[(e.role, role)] = None
    return list(found)


@dataclass
class DecodeWrites:
    """One plan's decode writes, for :func:`aliased_decode_writes`: the stage, the plan (a
    ``TransferPlan``: ``dst_addrs``, ``lengths``, ``pair_offsets``) and the decode entry of each
    of its pairs."""

    stage: str
    plan: Any
    dst_entries: Sequence[int]


def aliased_decode_writes(writes: Sequence[DecodeWrites], decode: Any) -> str | None:
    """A warning when two blocks of the request write overlapping decode bytes (decode buffers
    that alias: the last write wins, and a layer's KV is lost), naming the first two entries
    and how many blocks overlap; ``None`` when no decode byte is written twice."""
    import numpy as np

    starts, ends, owners = [], [], []
    for k, w in enumerate(writes):
        dst = np.asarray(w.plan.dst_addrs, dtype=np.uint64)
        lengths = np.asarray(w.plan.lengths, dtype=np.uint64)
        if dst.size == 0:
            continue
        offsets = np.asarray(w.plan.pair_offsets, dtype=np.int64)
        pair = np.searchsorted(offsets, np.arange(dst.size), side="right") - 1
        entries = np.asarray(w.dst_entries, dtype=np.int64)[pair]
        live = lengths > 0
        starts.append(dst[live])
        ends.append(dst[live] + lengths[live])
        owners.append(np.stack([np.full(int(live.sum()), k), entries[live]], axis=1))
    if not starts:
        return None
    start, end = np.concatenate(starts), np.concatenate(ends)
    owner = np.concatenate(owners)
    order = np.argsort(start, kind="stable")
    start, end, owner = start[order], end[order], owner[order]
    reach = np.maximum.accumulate(end)
    overlapping = start[1:] < reach[:-1]
    count = int(overlapping.sum())
    if count == 0:
        return None
    later = int(np.argmax(overlapping)) + 1
    earlier = int(np.argmax(end[:later] == reach[later - 1]))

    def name(row: Any) -> str:
        stage, j = writes[int(row[0])].stage, int(row[1])
        e = decode.entries()[j]
        return f"decode entry {j} ({_label(e.layer_id, e.role, j)}, from {stage})"

    return (f"aliased decode memory: {count:,} of {start.size:,} blocks write decode bytes "
            f"that another block of this request also writes ({name(owner[earlier])} and "
            f"{name(owner[later])} overlap at {int(start[later]):#x}); the last write wins, "
            f"so KV is lost: the decode layout's buffers (data_ptrs, data_lens, strides) must "
            f"not overlap")
