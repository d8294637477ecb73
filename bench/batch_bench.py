"""256 concurrent requests to one peer: one batch plan and one batch submission, against one
plan and one submission per request.

    .venv/bin/python bench/batch_bench.py                  # full run, writes bench/results/
    .venv/bin/python bench/batch_bench.py --quick          # smoke run (fewer samples), to /tmp
    .venv/bin/python bench/batch_bench.py --planning-only  # part 1 only (no Mooncake)

Requests: DeepSeek-V3 shape (``kvplan.presets`` 'deepseek-v3': 61 MLA layers, one buffer per
layer), page size 64, 256 requests of 1,024 tokens (16 pages each) in pools of 8,192 pages per
layer on each side. Two allocations:

- **scattered**: each request's pages contiguous on both sides, the requests at random 16-page
  slots of the pools (prefill and decode shuffled independently, seed 3), as a page allocator
  leaves them: every request is a segment of its own (61 blocks);
- **back to back**: request ``r`` takes the 16 pages after request ``r - 1`` on both sides, so
  every request touches the next and the batch is one segment.

Part 1, planning (synthetic addresses, real 1,152 B per token per layer), interleaved in one
process (``harness.timing.interleaved``: rotating order, collector off):
``template.plan_batch(requests)`` and ``template.plan_batch_flat(src, dst, offsets)`` (the same
requests given flat: every request's pages concatenated per side, ``offsets`` the 257 int64
CSR offsets, built once before timing) against ``[template.plan(s, d) for s, d in requests]``
(the 256 plans kept until the end, as an engine holding them until sent), with int32 and int64
pages; "flat, concatenated per call" also times building the flat arrays from the 256 tuples
(``np.concatenate``) in every call, what a caller holding per-request arrays pays.
Extra rows split the batch call's cost: the same 256 requests on a one-layer template (one block
per request: the cost per request that does not depend on the layers) and a batch of one
request (the cost per call). Before timing, the batch's blocks are checked against the
one-by-one plans: identical block for block when no request merges; for back to back, the
one-by-one blocks coalesced (touching neighbours joined) equal the batch's. The flat batch's
columns and per-request arrays are checked byte for byte against ``plan_batch``'s.

Part 2, Mooncake over TCP on 127.0.0.1 (two real engines in this process,
``kvplan.engines.measure.loopback_transports``), on real host memory. The 256 × 1,024 tokens ×
61 layers × 1,152 B (18.4 GB per side) do not fit this machine, so the bytes per token are
scaled down (``--bytes-per-token``) while the blocks stay the same: 61 layers, 16 pages per
request, 256 requests. Per repetition each variant moves the same requests (planning included
in its time), alternating with rotating order (``harness.timing.alternating``):

- **submit_batch**: ``sender.submit_batch(template.plan_batch(requests), peer)`` (the batch's
  ``call_ranges(1024)`` posted async, then waited on);
- **one by one, async**: ``sender.submit_async(template.plan(s, d), peer)`` for every request,
  then every handle waited on (what an engine serving many requests does);
- **one by one, sync**: ``sender.submit(template.plan(s, d), peer)`` for every request.

Before each variant the decode arena is zeroed (untimed); after it, every destination page of
every request is compared with its source page on every layer, and the rest of the decode
arena must still be zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402
from harness import machine  # noqa: E402
from harness.results import RESULTS_DIR, write_lines  # noqa: E402
from harness.timing import alternating, interleaved  # noqa: E402

import kvplan  # noqa: E402
from kvplan.engines.measure import loopback_transports, solve_block_model  # noqa: E402
from kvplan.presets import DECODE_BASE, PREFILL_BASE, ModelPreset, get_preset  # noqa: E402

N_REQUESTS = 256
PAGES = 16  # pages per request: 1,024 tokens at page size 64
PAGE_SIZE = 64
CAPACITY = 8192  # pages per pool, twice what the batch needs
TCP_CALL = 1024  # Mooncake TCP's bound per engine call (MooncakeTransport's default)
ALIGN = 2 << 20
PLAN_TARGET_NS = 50_000
SUBMIT_TARGET = 3.0

Requests = list[tuple[np.ndarray, np.ndarray]]


def allocations(dtype: type = np.int32) -> dict[str, Requests]:
    """The two allocations of the module docstring, pages of ``dtype``."""
    rng = np.random.default_rng(3)
    slots = CAPACITY // PAGES
    src_slots = rng.permutation(slots)[:N_REQUESTS]
    dst_slots = rng.permutation(slots)[:N_REQUESTS]

    def pages(first: int) -> np.ndarray:
        return np.arange(first, first + PAGES, dtype=dtype)

    scattered = [(pages(int(s) * PAGES), pages(int(d) * PAGES))
                 for s, d in zip(src_slots, dst_slots)]
    # Back to back, away from the pools' first pages (nothing special about page 0).
    src0, dst0 = 100, 1700
    back = [(pages(src0 + r * PAGES), pages(dst0 + r * PAGES)) for r in range(N_REQUESTS)]
    return {"scattered": scattered, "back to back": back}


def layout(model: ModelPreset, base: int) -> kvplan.Layout:
    return model.layout(range(model.num_layers), page_size=PAGE_SIZE, capacity=CAPACITY,
                        base=base)


def template(model: ModelPreset, src_base: int, dst_base: int) -> kvplan.Template:
    return kvplan.Template(layout(model, src_base), layout(model, dst_base))


def columns(plan: Any) -> np.ndarray:
    return np.stack([plan.src_addrs, plan.dst_addrs, plan.lengths])


def coalesced(blocks: np.ndarray) -> np.ndarray:
    """Blocks sorted by source address with every block that continues the previous one on
    both sides joined to it."""
    s, d, n = blocks[:, np.argsort(blocks[0], kind="stable")]
    joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    ends = np.concatenate([starts[1:], [len(s)]])
    total = np.add.reduceat(n, starts)
    assert np.all(s[ends - 1] + n[ends - 1] == s[starts] + total)
    return np.stack([s[starts], d[starts], total])


def flat(reqs: Requests) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_pages, dst_pages, offsets)`` of ``reqs`` for ``plan_batch_flat``: every
    request's pages concatenated per side and the ``n + 1`` int64 offsets (equal page counts
    per side, so one set of offsets serves both)."""
    lengths = [len(s) for s, _ in reqs]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return (np.concatenate([s for s, _ in reqs]), np.concatenate([d for _, d in reqs]),
            offsets)


def check_same_flat(t: kvplan.Template, reqs: Requests) -> None:
    """``plan_batch_flat`` of ``reqs`` given flat is ``plan_batch``'s plan, byte for byte."""
    a, b = t.plan_batch(reqs), t.plan_batch_flat(*flat(reqs))
    for name in ("src_addrs", "dst_addrs", "lengths", "segment_offsets", "segment_requests",
                 "request_bytes", "request_n_blocks"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


def check_same_blocks(t: kvplan.Template, reqs: Requests) -> tuple[kvplan.BatchPlan, int]:
    """The batch plan of ``reqs`` after checking it moves exactly the one-by-one plans' bytes;
    (the batch plan, blocks of the one-by-one plans)."""
    batch = t.plan_batch(reqs)
    one = np.concatenate([columns(t.plan(s, d)) for s, d in reqs], axis=1)
    mine = columns(batch)
    if batch.n_segments == len(reqs):
        assert np.array_equal(mine, one), "batch blocks differ from the one-by-one plans"
    else:
        assert np.array_equal(coalesced(mine), coalesced(one)), "batch moves other bytes"
    assert batch.total_bytes == int(one[2].sum()) == int(batch.request_bytes.sum())
    assert np.array_equal(batch.request_n_blocks, [t.plan(s, d).n_blocks for s, d in reqs])
    return batch, one.shape[1]


# --------------------------------------------------------------------------- part 1: planning
def part1(budget_s: float, min_sample_ns: float) -> dict[str, Any]:
    model = get_preset("deepseek-v3")
    t = template(model, PREFILL_BASE, DECODE_BASE)
    one_layer = model.with_layers(1)
    t1 = template(one_layer, PREFILL_BASE, DECODE_BASE)
    allocs = allocations(np.int32)
    allocs64 = allocations(np.int64)
    info: dict[str, dict[str, Any]] = {}
    variants: dict[str, Any] = {}
    nothing = lambda: None  # noqa: E731
    for name, reqs in allocs.items():
        batch, one_blocks = check_same_blocks(t, reqs)
        r64 = allocs64[name]
        check_same_blocks(t, r64)
        check_same_flat(t, reqs)
        check_same_flat(t, r64)
        f32, f64 = flat(reqs), flat(r64)
        info[name] = {"blocks": batch.n_blocks, "segments": batch.n_segments,
                      "one_blocks": one_blocks, "calls": len(batch.call_ranges(TCP_CALL)),
                      "bytes": batch.total_bytes}

        def batch_fn(reqs: Requests = reqs) -> Any:
            return t.plan_batch(reqs)

        def one_fn(reqs: Requests = reqs) -> Any:
            return [t.plan(s, d) for s, d in reqs]

        def batch64_fn(reqs: Requests = r64) -> Any:
            return t.plan_batch(reqs)

        def one64_fn(reqs: Requests = r64) -> Any:
            return [t.plan(s, d) for s, d in reqs]

        def flat_fn(f: Any = f32) -> Any:
            return t.plan_batch_flat(*f)

        def flat64_fn(f: Any = f64) -> Any:
            return t.plan_batch_flat(*f)

        def concat_fn(reqs: Requests = reqs) -> Any:
            return t.plan_batch_flat(*flat(reqs))

        variants[f"{name}|plan_batch"] = (batch_fn, nothing, nothing)
        variants[f"{name}|one by one"] = (one_fn, nothing, nothing)
        variants[f"{name}|plan_batch, int64"] = (batch64_fn, nothing, nothing)
        variants[f"{name}|one by one, int64"] = (one64_fn, nothing, nothing)
        variants[f"{name}|plan_batch_flat"] = (flat_fn, nothing, nothing)
        variants[f"{name}|plan_batch_flat, int64"] = (flat64_fn, nothing, nothing)
        variants[f"{name}|flat, concatenated per call"] = (concat_fn, nothing, nothing)
    scattered = allocs["scattered"]
    assert t1.plan_batch(scattered).n_blocks == N_REQUESTS
    variants["split|plan_batch, 1-layer template"] = (lambda: t1.plan_batch(scattered), nothing,
                                                      nothing)
    flat1 = flat(scattered)
    variants["split|plan_batch_flat, 1-layer template"] = (lambda: t1.plan_batch_flat(*flat1),
                                                           nothing, nothing)
    variants["split|one by one, 1-layer template"] = (
        lambda: [t1.plan(s, d) for s, d in scattered], nothing, nothing)
    first = scattered[:1]
    variants["split|plan_batch of 1 request"] = (lambda: t.plan_batch(first), nothing, nothing)
    s0, d0 = first[0]
    variants["split|template.plan of 1 request"] = (lambda: t.plan(s0, d0), nothing, nothing)
    flat_first = flat(first)
    variants["split|plan_batch_flat of 1 request"] = (lambda: t.plan_batch_flat(*flat_first),
                                                      nothing, nothing)
    samples = interleaved(variants, budget_s=budget_s, min_reps=5, max_reps=400,
                          min_sample_ns=min_sample_ns)
    return {"info": info, "samples": samples}


# --------------------------------------------------------------------------- profile
PROFILE_CALLS = 20_000


def prof_child() -> None:
    t = template(get_preset("deepseek-v3"), PREFILL_BASE, DECODE_BASE)
    reqs = allocations(np.int32)["scattered"]
    for _ in range(PROFILE_CALLS):
        t.plan_batch(reqs)


def profile() -> list[tuple[float, str]] | None:
    """``perf record`` of a child planning the scattered batch; the top shared objects and
    symbols, or None without perf."""
    if not shutil.which("perf"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        r = subprocess.run(["perf", "record", "-q", "-F", "1999", "-o", data, "--",
                            sys.executable, os.path.abspath(__file__), "--prof-child"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return None
        out = []
        for sort, top in (("dso", 5), ("dso,sym", 6)):
            rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children",
                                  "--sort", sort], capture_output=True, text=True).stdout
            rows = [x.split() for x in rep.splitlines()
                    if x.strip() and not x.startswith("#") and "%" in x.split()[0]]
            for parts in rows[:top]:
                pct = float(parts[0].rstrip("%"))
                label = parts[1] if sort == "dso" else f"{' '.join(parts[3:])} ({parts[1]})"
                out.append((pct, label))
        return out


# --------------------------------------------------------------------------- part 2: Mooncake
@dataclasses.dataclass
class Arena:
    """One side's host memory: the layout's buffers from a 2 MiB-aligned base, and a view of
    them as ``(layers, pages, item bytes)``."""

    raw: np.ndarray
    base: int
    pages: np.ndarray

    @classmethod
    def make(cls, model: ModelPreset, fill: bool) -> Arena:
        item = model.kv_bytes_per_token * PAGE_SIZE
        span = -(-CAPACITY * item // ALIGN) * ALIGN  # the preset's buffer stride
        layers = model.num_layers
        raw = np.zeros(layers * span + ALIGN, np.uint8)
        base = -(-raw.ctypes.data // ALIGN) * ALIGN
        off = base - raw.ctypes.data
        view = raw[off:off + layers * span].reshape(layers, span)[:, :CAPACITY * item]
        pages = view.reshape(layers, CAPACITY, item)
        if fill:
            rng = np.random.default_rng(1)
            for layer in range(layers):
                pages[layer] = rng.integers(0, 256, pages[layer].shape, dtype=np.uint8)
        return cls(raw, base, pages)


def landed(src: Arena, dst: Arena, reqs: Requests) -> bool:
    """Every request's destination pages hold its source pages on every layer, and nothing
    else of the decode arena was written."""
    sp = np.concatenate([s for s, _ in reqs])
    dp = np.concatenate([d for _, d in reqs])
    written = 0
    for layer in range(src.pages.shape[0]):
        got = dst.pages[layer][dp]
        if not np.array_equal(got, src.pages[layer][sp]):
            return False
        written += int(np.count_nonzero(got))
    return written == int(np.count_nonzero(dst.raw))


def part2(bytes_per_token: int, reps: int) -> dict[str, Any]:
    model = dataclasses.replace(get_preset("deepseek-v3"), kv_bytes_per_token=bytes_per_token)
    src, dst = Arena.make(model, fill=True), Arena.make(model, fill=False)
    t = template(model, src.base, dst.base)
    sender, receiver = loopback_transports("mooncake")
    try:
        sender.register(layout(model, src.base))
        receiver.register(layout(model, dst.base))
        peer = receiver.local_session_id()
        out: dict[str, Any] = {"scenarios": {}, "handoff": getattr(sender, "handoff", "?")}
        for name, reqs in allocations(np.int32).items():
            batch, one_blocks = check_same_blocks(t, reqs)
            state: dict[str, Any] = {}
            bad: list[str] = []

            def zero() -> None:
                dst.raw.fill(0)

            def check(variant: str, reqs: Requests = reqs) -> Callable[[], None]:
                def after() -> None:
                    outcome = state.pop("outcome", None)
                    if outcome is not None and not outcome.ok:
                        bad.append(f"{variant}: requests {outcome.failed_requests} failed")
                    if not landed(src, dst, reqs):
                        bad.append(f"{variant}: decode bytes differ")
                return after

            def run_batch(reqs: Requests = reqs) -> None:
                state["outcome"] = sender.submit_batch(t.plan_batch(reqs), peer)

            def run_async(reqs: Requests = reqs) -> None:
                handles = [sender.submit_async(t.plan(s, d), peer) for s, d in reqs]
                for h in handles:
                    h.wait()

            def run_sync(reqs: Requests = reqs) -> None:
                for s, d in reqs:
                    sender.submit(t.plan(s, d), peer)

            zero()
            assert not landed(src, dst, reqs), "the byte check passes on an empty decode"
            variants = {
                "submit_batch": (run_batch, zero, check("submit_batch")),
                "one by one, async": (run_async, zero, check("one by one, async")),
                "one by one, sync": (run_sync, zero, check("one by one, sync")),
            }
            alternating(variants, reps=1)  # warm-up: connections, first touches, pools
            samples = alternating(variants, reps=reps)
            out["scenarios"][name] = {
                "samples": samples, "bad": bad, "blocks": batch.n_blocks,
                "segments": batch.n_segments, "one_blocks": one_blocks,
                "calls": len(batch.call_ranges(TCP_CALL)), "bytes": batch.total_bytes,
                "checked": len(variants) * (reps + 1),
            }
        return out
    finally:
        sender.close()
        receiver.close()


# --------------------------------------------------------------------------- report
def fmt(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:,.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:,.1f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:,.1f} µs"
    return f"{ns:,.0f} ns"


def best_one(m: dict[str, float]) -> str:
    """The faster (lower median) of the two one-by-one variants: the honest reference."""
    return min(("one by one, async", "one by one, sync"), key=m.__getitem__)


def met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report(args: argparse.Namespace, load0: float, seconds: float, p1: dict[str, Any],
           prof: list[tuple[float, str]] | None, p2: dict[int, dict[str, Any]]) -> list[str]:
    s = p1["samples"]
    med = {k: statistics.median(v) for k, v in s.items()}
    low = {k: min(v) for k, v in s.items()}
    info = p1["info"]
    real = get_preset("deepseek-v3")
    per_req_real = PAGES * PAGE_SIZE * real.kv_bytes_per_token * real.num_layers
    L = [
        "# 256 requests to one peer: batch plan and batch submit vs one per request",
        "",
        f"Command: `{args.command}` ({seconds:.0f} s; `nice -n 19`, environment "
        "`MC_TRANSFER_TIMEOUT=5 MC_LOG_LEVEL=ERROR`). Script: `bench/batch_bench.py` (its "
        "docstring says what each variant does).",
        "",
        *machine.describe(load0, kvplan.__version__),
        "- no GPU: host memory only; Mooncake `mooncake-transfer-engine-non-cuda` "
        f"{kvplan._core.MooncakeNative.VERIFIED_VERSION} ({next(iter(p2.values()))['handoff']}"
        " hand-off) over TCP on 127.0.0.1, both engines in this process"
        if p2 else "- no GPU: host memory only",
        "",
        f"Requests: {N_REQUESTS} × 1,024 tokens, DeepSeek-V3 shape ({real.num_layers} MLA "
        f"layers, one buffer per layer), page size {PAGE_SIZE} → {PAGES} pages per request, "
        f"pools of {CAPACITY:,} pages per layer on each side. **scattered**: each request's "
        "pages contiguous, requests at random 16-page slots (prefill and decode shuffled "
        "independently); **back to back**: each request's pages right after the previous "
        "request's on both sides.",
        "",
        "## Targets",
        "",
        "| target | measured | status |",
        "| --- | --- | --- |",
    ]
    for call in ("plan_batch", "plan_batch_flat"):
        for name in info:
            key = f"{name}|{call}"
            b = med[key]
            L.append(f"| planning, {name}: one `{call}` of {N_REQUESTS} requests ≤ 50 µs "
                     f"(≈0.2 µs per request) | {fmt(b)} median, {fmt(low[key])} "
                     f"min ({b / N_REQUESTS / 1e3:.2f} µs per request) | "
                     f"{met(b <= PLAN_TARGET_NS)} ({b / PLAN_TARGET_NS:.2f}× the limit) |")
    for bpt, r in p2.items():
        for name, sc in r["scenarios"].items():
            m = {k: statistics.median(v) for k, v in sc["samples"].items()}
            ref = best_one(m)
            ratio = m[ref] / m["submit_batch"]
            L.append(f"| Mooncake TCP, {name}, {bpt} B per token: `submit_batch` request "
                     f"throughput ≥ {SUBMIT_TARGET:g}× the faster one-by-one variant | "
                     f"{ratio:.2f}× ({N_REQUESTS / m['submit_batch'] * 1e9:,.0f} vs "
                     f"{N_REQUESTS / m[ref] * 1e9:,.0f} requests/s, against {ref[12:]}) | "
                     f"{met(ratio >= SUBMIT_TARGET)} |")
    L += [
        "",
        "## Part 1: planning (synthetic addresses, 1,152 B per token per layer)",
        "",
        "Interleaved in one process; per call, medians (min in brackets). \"one by one\" is "
        f"`[template.plan(s, d) for s, d in requests]`, the {N_REQUESTS} plans kept until the "
        "list goes. int32 pages unless marked. Same requests, same bytes on both sides "
        "(checked before timing).",
        "",
        "| allocation | segments | blocks (batch) | blocks (one by one) | engine calls of ≤ 1,024 "
        "blocks (batch / one by one) | `plan_batch` | one by one | ratio | ratio min/min | "
        "`plan_batch`, int64 pages | one by one, int64 pages | ratio int64 |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, i in info.items():
        b, o = f"{name}|plan_batch", f"{name}|one by one"
        b64, o64 = f"{name}|plan_batch, int64", f"{name}|one by one, int64"
        L.append(f"| {name} | {i['segments']:,} | {i['blocks']:,} | {i['one_blocks']:,} | "
                 f"{i['calls']} / {N_REQUESTS} | {fmt(med[b])} ({fmt(low[b])}) | "
                 f"{fmt(med[o])} ({fmt(low[o])}) | {med[o] / med[b]:.2f}× | "
                 f"{low[o] / low[b]:.2f}× | {fmt(med[b64])} ({fmt(low[b64])}) | "
                 f"{fmt(med[o64])} ({fmt(low[o64])}) | {med[o64] / med[b64]:.2f}× |")
    L += [
        "",
        "The same requests given flat (`plan_batch_flat(src, dst, offsets)`, the arrays built "
        "once before timing; its plan checked byte for byte against `plan_batch`'s), and built "
        "from the tuples in every call:",
        "",
        "| allocation | `plan_batch_flat` | vs `plan_batch` | vs one by one | "
        "`plan_batch_flat`, int64 pages | vs `plan_batch`, int64 | flat, concatenated per "
        "call (int32) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in info:
        f, f64, c = (f"{name}|plan_batch_flat", f"{name}|plan_batch_flat, int64",
                     f"{name}|flat, concatenated per call")
        b, o, b64 = f"{name}|plan_batch", f"{name}|one by one", f"{name}|plan_batch, int64"
        L.append(f"| {name} | {fmt(med[f])} ({fmt(low[f])}) | {med[b] / med[f]:.2f}× "
                 f"faster | {med[o] / med[f]:.2f}× faster | {fmt(med[f64])} ({fmt(low[f64])}) "
                 f"| {med[b64] / med[f64]:.2f}× faster | {fmt(med[c])} ({fmt(low[c])}) |")
    n_samples = {k: len(v) for k, v in s.items()}
    L += [
        "",
        f"Samples per variant: {min(n_samples.values())}–{max(n_samples.values())} (each the "
        "mean of a calibrated loop).",
        "",
        "Where a batch call's time goes (scattered requests, same run):",
        "",
        "| call | median | min | per request |",
        "| --- | ---: | ---: | ---: |",
    ]
    rows = [("`plan_batch`, 256 requests, 61 layers (15,616 blocks)", "scattered|plan_batch",
             N_REQUESTS),
            ("`plan_batch`, same 256 requests on a 1-layer template (256 blocks)",
             "split|plan_batch, 1-layer template", N_REQUESTS),
            ("one by one, same on the 1-layer template", "split|one by one, 1-layer template",
             N_REQUESTS),
            ("`plan_batch_flat`, 256 requests, 61 layers (15,616 blocks)",
             "scattered|plan_batch_flat", N_REQUESTS),
            ("`plan_batch_flat`, same on the 1-layer template (256 blocks)",
             "split|plan_batch_flat, 1-layer template", N_REQUESTS),
            ("`plan_batch` of 1 request (61 blocks)", "split|plan_batch of 1 request", 1),
            ("`plan_batch_flat` of 1 request (61 blocks)", "split|plan_batch_flat of 1 request",
             1),
            ("`template.plan` of 1 request (61 blocks)", "split|template.plan of 1 request", 1)]
    for label, key, n in rows:
        L.append(f"| {label} | {fmt(med[key])} | {fmt(low[key])} | {fmt(med[key] / n)} |")
    sc_b = med["scattered|plan_batch"]
    # The split from the mins: the least disturbed by other work on the 2 shared cores.
    one_layer = low["split|plan_batch, 1-layer template"]
    extra_blocks = info["scattered"]["blocks"] - N_REQUESTS
    per_block = (low["scattered|plan_batch"] - one_layer) / extra_blocks
    bb_b = med["back to back|plan_batch"]
    flat_1l = low["split|plan_batch_flat, 1-layer template"]
    flat_per_block = (low["scattered|plan_batch_flat"] - flat_1l) / extra_blocks
    L += [
        "",
        f"- Split (from the mins, which other work on the machine disturbs least): per "
        f"request, independent of the layers, {one_layer / N_REQUESTS / 1e3:.2f} µs "
        f"(1-layer template, one block each); per block on top {per_block:.1f} ns "
        f"({fmt(low['scattered|plan_batch'] - one_layer)} for the {extra_blocks:,} further "
        "blocks of 61 layers). "
        f"Back to back (one segment, {info['back to back']['blocks']} blocks) costs "
        f"{fmt(bb_b)}, {bb_b / N_REQUESTS / 1e3:.2f} µs per request.",
        f"- Flat (`plan_batch_flat`, from the mins): per request, independent of the layers, "
        f"{flat_1l / N_REQUESTS / 1e3:.2f} µs (1-layer template); per block on top "
        f"{flat_per_block:.1f} ns. A batch of one request costs "
        f"{fmt(low['split|plan_batch_flat of 1 request'])} flat and "
        f"{fmt(low['split|plan_batch of 1 request'])} as a tuple (min).",
        f"- Against one by one: {med['scattered|one by one'] / sc_b:.2f}× (scattered) and "
        f"{med['back to back|one by one'] / bb_b:.2f}× (back to back) in medians; a "
        f"`template.plan` call costs {fmt(med['split|template.plan of 1 request'])} on its own "
        f"and {fmt(med['scattered|one by one'] / N_REQUESTS)} per request in the loop.",
    ]
    if prof:
        dsos = [f"{label} {pct:.0f} %" for pct, label in prof if "(" not in label]
        syms = [f"{label} {pct:.1f} %" for pct, label in prof if "(" in label]
        L += [
            f"- Profile (`perf record`, {PROFILE_CALLS:,} scattered `plan_batch` calls in a "
            f"child process; share of samples by shared object): {', '.join(dsos)}. Top "
            f"symbols (the extension is stripped, so its own show as addresses): "
            f"{', '.join(syms)}.",
        ]
    for bpt, r in p2.items():
        item = PAGE_SIZE * bpt
        per_req = PAGES * item * real.num_layers
        L += [
            "",
            f"## Part 2: Mooncake TCP loopback, {bpt} B per token per layer",
            "",
            f"Real bytes scaled down {real.kv_bytes_per_token / bpt:g}× (a page is {item:,} B "
            f"per layer instead of {PAGE_SIZE * real.kv_bytes_per_token:,} B; a request moves "
            f"{per_req / 1e6:,.2f} MB instead of {per_req_real / 1e6:,.1f} MB); the blocks are "
            f"those of the real shape. {args.reps} repetitions of each variant after one "
            "untimed warm-up, alternating; times per batch of 256 requests, planning included.",
            "",
            "| allocation | variant | blocks | engine calls | bytes | samples | median | min | "
            "requests/s (median) | vs submit_batch (median) | min/min |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, sc in r["scenarios"].items():
            m = {k: statistics.median(v) for k, v in sc["samples"].items()}
            lo = {k: min(v) for k, v in sc["samples"].items()}
            for k in sc["samples"]:
                blocks = sc["blocks"] if k == "submit_batch" else sc["one_blocks"]
                calls = sc["calls"] if k == "submit_batch" else N_REQUESTS
                L.append(f"| {name} | {k} | {blocks:,} | {calls} | {sc['bytes'] / 1e6:,.0f} MB "
                         f"| {len(sc['samples'][k])} | {fmt(m[k])} | {fmt(lo[k])} | "
                         f"{N_REQUESTS / m[k] * 1e9:,.0f} | "
                         f"{m[k] / m['submit_batch']:.2f}× | "
                         f"{lo[k] / lo['submit_batch']:.2f}× |")
        L.append("")
        for name, sc in r["scenarios"].items():
            verdict = ("every run's decode bytes identical to the source pages, nothing else "
                       "written" if not sc["bad"] else "FAILED: " + "; ".join(sc["bad"]))
            L.append(f"- {name}: {sc['checked']} runs checked byte for byte (all variants, "
                     f"warm-up included): {verdict}.")
        sc_s, sc_b2 = r["scenarios"]["scattered"], r["scenarios"]["back to back"]
        m_s = {k: statistics.median(v) for k, v in sc_s["samples"].items()}
        m_b = {k: statistics.median(v) for k, v in sc_b2["samples"].items()}
        ref_s = best_one(m_s)
        saved = (m_s[ref_s] - m_s["submit_batch"]) / N_REQUESTS
        # Same bytes, blocks 15,616 vs 61: the engine's per-block cost and its bandwidth.
        c, bw = solve_block_model(
            (sc_s["one_blocks"], sc_s["bytes"], m_s["one by one, async"] * 1e-9),
            (sc_b2["blocks"], sc_b2["bytes"], m_b["submit_batch"] * 1e-9))
        r["model"] = (c, bw)
        L += [
            f"- scattered: `submit_batch` saves {fmt(saved)} per request over one by one "
            f"({ref_s[12:]}, the faster), against {fmt(m_s[ref_s] / N_REQUESTS)} per request "
            "in all." if saved > 0 else
            f"- scattered: `submit_batch` is {fmt(-saved)} per request slower than one by one "
            f"({ref_s[12:]}, the faster), against {fmt(m_s[ref_s] / N_REQUESTS)} per request "
            "in all.",
            f"- From the same run (one by one async, scattered: {sc_s['one_blocks']:,} blocks; "
            f"`submit_batch`, back to back: {sc_b2['blocks']} blocks; same bytes): the engine "
            f"costs ≈{c * 1e6:.1f} µs per block and moves ≈{bw / 1e9:.2f} GB/s "
            "(`kvplan.engines.measure.solve_block_model` on the two medians).",
        ]
    # The planning paragraph needs part 1 only; one paragraph per part 2 size follows it.
    L += ["", "## What the numbers say", ""]
    L += why(info, med, low, p2, prof, per_req_real, one_layer, per_block)
    return L


def share(prof: list[tuple[float, str]] | None, name: str) -> float | None:
    """The profile's share of samples in the shared object whose name starts with ``name``."""
    hits = [pct for pct, label in prof or [] if "(" not in label and label.startswith(name)]
    return hits[0] if hits else None


def why(info: dict[str, Any], med: dict[str, float], low: dict[str, float],
        p2: dict[int, dict[str, Any]],
        prof: list[tuple[float, str]] | None, per_req_real: int, one_layer: float,
        per_block: float) -> list[str]:
    sc_b = med["scattered|plan_batch"]
    one_1l = low["split|one by one, 1-layer template"]
    emission = per_block * info["scattered"]["blocks"]
    core, libc = share(prof, "_core"), share(prof, "libc")
    profiled = (f" In the profile {core:.0f} % of the samples are in the extension and "
                f"{libc:.0f} % in libc (`malloc`/`free` at the top of its symbols)."
                if core is not None and libc is not None else "")
    sc_f, bb_f = med["scattered|plan_batch_flat"], med["back to back|plan_batch_flat"]
    flat_1l = low["split|plan_batch_flat, 1-layer template"]
    lines = [
        f"**Planning ≤ 50 µs.** `plan_batch` (a tuple of two arrays per request): scattered "
        f"{fmt(sc_b)} ({sc_b / PLAN_TARGET_NS:.1f}× the limit, {met(sc_b <= PLAN_TARGET_NS)}), "
        f"back to back {fmt(med['back to back|plan_batch'])} "
        f"({met(med['back to back|plan_batch'] <= PLAN_TARGET_NS)}). `plan_batch_flat` (the "
        f"same requests as two page arrays and one offsets array): scattered {fmt(sc_f)} "
        f"({sc_f / PLAN_TARGET_NS:.2f}× the limit, {met(sc_f <= PLAN_TARGET_NS)}), back to "
        f"back {fmt(bb_f)} ({bb_f / PLAN_TARGET_NS:.2f}× the limit, "
        f"{met(bb_f <= PLAN_TARGET_NS)}). Per request `plan_batch` reads a Python tuple and "
        "extracts two numpy arrays (type, dtype and contiguity checks and a rust-numpy borrow "
        "each; `borrow_requests` in `rust/kvplan-py/src/batch.rs`); `plan_batch_flat` reads "
        "three arrays per call whatever the number of requests and cuts the requests from "
        "them in Rust, so what it spends per request is the core's: `Template::prepare` "
        "(validation and the run scan into a `PlanSummary`), the batch's overlap and "
        "touching checks, and emitting the request's runs. On the 1-layer template (one block "
        f"per request) that is {flat_1l / N_REQUESTS / 1e3:.2f} µs per request flat against "
        f"{one_layer / N_REQUESTS / 1e3:.2f} µs as tuples (mins); the 61 layers add "
        f"{per_block:.1f} ns per block ({fmt(emission)} for the scattered batch's "
        f"{info['scattered']['blocks']:,} blocks).{profiled} Against 256 `template.plan` calls "
        f"`plan_batch` saves {(one_1l - one_layer) / N_REQUESTS / 1e3:.2f} µs per request on "
        "the 1-layer template (mins) (the Python loop, a call and a plan object each).",
        "",
    ]
    for bpt, r in p2.items():
        c, bw = r["model"]
        sc = r["scenarios"]
        ms = {k: statistics.median(v) for k, v in sc["scattered"]["samples"].items()}
        mb = {k: statistics.median(v) for k, v in sc["back to back"]["samples"].items()}
        ref_s, ref_b = best_one(ms), best_one(mb)
        rs = ms[ref_s] / ms["submit_batch"]
        rb = mb[ref_b] / mb["submit_batch"]
        lb = {k: min(v) for k, v in sc["back to back"]["samples"].items()}
        rb_min = lb[ref_b] / lb["submit_batch"]
        blocks_one = sc["scattered"]["one_blocks"]
        blocks_bb = sc["back to back"]["blocks"]
        saved = (ms[ref_s] - ms["submit_batch"]) * 1e-9  # seconds per batch
        x = N_REQUESTS * per_req_real
        real_one = blocks_one * c + x / bw
        est_b = real_one / (blocks_bb * c + x / bw)
        est_s = (real_one + saved) / real_one
        plan_saved = (med["scattered|one by one"] - sc_b) / N_REQUESTS
        saves = (f"What the batch saves is {N_REQUESTS - sc['scattered']['calls']} engine "
                 f"calls with their waits, {fmt(saved * 1e9 / N_REQUESTS)} per request in medians "
                 f"(planning: {fmt(plan_saved)} of that)." if saved > 0 else
                 "In medians the batch saved nothing here (the spread between repetitions is "
                 "larger than the difference).")
        lines += [
            f"**Submit, {bpt} B per token** (against the faster one-by-one variant). "
            f"Scattered: {rs:.2f}× ({met(rs >= SUBMIT_TARGET)}). The batch cannot merge anything there: every "
            f"request keeps its 61 blocks, and Mooncake TCP spends ≈{c * 1e6:.0f} µs on each "
            f"block, ≈{fmt(blocks_one * c * 1e9 / N_REQUESTS)} per request. {saves} "
            f"Back to back: {rb:.1f}× ({met(rb >= SUBMIT_TARGET)}; min/min {rb_min:.1f}×). The "
            f"batch merges the 256 requests into {blocks_bb} blocks instead of "
            f"{blocks_one:,}, so the engine's per-block cost goes and the bytes are what is "
            "left; the price is that all 256 requests ride in one engine call, and if it "
            "fails, all of them fail. Estimate at the real 1,152 B per token "
            f"({x / 1e9:.1f} GB per batch; not measured: the same two-term model with this "
            f"run's ≈{c * 1e6:.0f} µs per block and {bw / 1e9:.2f} GB/s): back to back "
            f"≈{est_b:.2f}× and scattered ≈{est_s:.2f}×, because at that bandwidth the bytes "
            "dominate either way.",
            "",
        ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="few samples, one small size, no profile; writes to /tmp")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--plan-budget", type=float, default=30.0, help="seconds for part 1")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per Mooncake variant")
    ap.add_argument("--bytes-per-token", default="4,36",
                    help="comma-separated bytes per token per layer for part 2 (real: 1152)")
    ap.add_argument("--planning-only", "--no-transfer", dest="no_transfer", action="store_true",
                    help="part 1 only (planning; no Mooncake)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--prof-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prof_child:
        prof_child()
        return
    args.command = "python " + " ".join(["bench/batch_bench.py", *sys.argv[1:]])
    if args.quick:
        args.plan_budget, args.reps, args.no_profile = 3.0, 2, True
        if "--bytes-per-token" not in sys.argv:
            args.bytes_per_token = "4"
    load0 = os.getloadavg()[0]
    t0 = time.time()
    print("part 1 (planning)...", flush=True)
    p1 = part1(args.plan_budget, min_sample_ns=1e6 if args.quick else 2e6)
    prof = None if args.no_profile else profile()
    p2: dict[int, dict[str, Any]] = {}
    if not args.no_transfer:
        for bpt in (int(v) for v in args.bytes_per_token.split(",") if v.strip()):
            print(f"part 2 (Mooncake TCP loopback, {bpt} B per token)...", flush=True)
            p2[bpt] = part2(bpt, args.reps)
    lines = report(args, load0, time.time() - t0, p1, prof, p2)
    out_dir = args.out_dir or ("/tmp/kvplan-bench-quick" if args.quick else RESULTS_DIR)
    path = write_lines(out_dir, "batch-results.md", lines)
    print("\n".join(lines))
    print(f"\nwritten to {path}")
    bad = [b for r in p2.values() for sc in r["scenarios"].values() for b in sc["bad"]]
    if bad:
        sys.exit("decode bytes wrong: " + "; ".join(bad))


if __name__ == "__main__":
    main()
