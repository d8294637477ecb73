"""What a request costs up to a real Mooncake engine's submit: plan, hand-off, the engine's submit.

    .venv/bin/python bench/mooncake_handoff.py             # full run, into bench/results/
    .venv/bin/python bench/mooncake_handoff.py --quick     # smoke run (4k pages), to /tmp

The request is SGLang's DeepSeek-V3 MLA case with the most blocks: 61 layers, 32,768 pages of
one token, every destination page its own run (1,998,848 blocks; ``dsv3-p1-32k-f100`` of
``compare_sglang.py``), on real host memory (64-byte items, so both arenas fit in RAM; neither the
planners nor the engine's per-block submit depend on the item size). Two real Mooncake engines in
this process talk over TCP on 127.0.0.1: one registers the source arena, the other the
destination arena.

Part 1, planning, interleaved (``harness.timing.interleaved``: rotating order, collector off):
SGLang 0.5.23's real ``_send_kvcache_generic`` planning only (its ``_transfer_data`` replaced by
a recorder), and with its real ``_transfer_data`` (the tuples unzipped into three lists), against
``template.plan()`` and ``template.plan().as_lists()``. The blocks are checked identical first.

Part 2, the hand-off and the engine's submit of one batch of 1,024 blocks (Mooncake TCP's
per-peer admission bound), alternating (``harness.timing.alternating``; each submit waited on,
untimed, before the next):

  lists       kvplan's list path: three ``.tolist()`` + ``batch_transfer_async_write``
  prebuilt    ``batch_transfer_async_write`` on lists built untimed (the engine's own cost of
              taking lists: what a peer that already holds lists pays, e.g. SGLang after its
              ``_transfer_data``)
  native      ``MooncakeNative.submit``: the plan's columns into one request array in Rust and
              Mooncake's ``submitTransfer`` (GIL released)

Per request (per block, then for the 2M-block request): plan + 1/1,024 of a batch's submit.
A whole 2M-block request cannot be submitted at once on TCP (about 2,048 blocks per peer may be
in flight), so the batch figure is measured on batches and scaled; the transfer itself (about
30 µs per block on loopback TCP) is the engine's and is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402
from harness import machine  # noqa: E402  (also: tests/ on sys.path)
from harness.results import RESULTS_DIR, write_lines  # noqa: E402
from harness.timing import alternating, interleaved  # noqa: E402
from support import sglang_loader  # noqa: E402

import kvplan  # noqa: E402
from comparison.scenarios import build, scenario  # noqa: E402
from comparison.sides import KvplanSide, SGLangSide, identical  # noqa: E402
from kvplan.engines import MooncakeTransport  # noqa: E402

BATCH = 1024
ITEM = 64


def _arena(n_entries: int, cap: int) -> tuple[np.ndarray, list[int], list[int]]:
    """One zeroed host arena holding ``n_entries`` buffers of ``cap`` items of ITEM bytes, each
    2 MiB-aligned; (arena, pointers, lengths)."""
    step = (cap * ITEM + (1 << 21) - 1) // (1 << 21) * (1 << 21)
    arena = np.zeros(n_entries * step + (1 << 21), np.uint8)
    base = (arena.ctypes.data + (1 << 21) - 1) // (1 << 21) * (1 << 21)
    return arena, [base + k * step for k in range(n_entries)], [cap * ITEM] * n_entries


def _ms(ns: float) -> str:
    return f"{ns / 1e6:,.2f} ms" if ns >= 1e6 else f"{ns / 1e3:,.1f} µs"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4k pages, few samples; writes to /tmp")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--batches", type=int, default=150, help="submits per variant")
    ap.add_argument("--plan-budget", type=float, default=60.0, help="seconds for part 1")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    t_start = time.time()
    sc = dataclasses.replace(scenario("dsv3-p1-32k-f100"), bytes_per_token=ITEM)
    if args.quick:
        sc = dataclasses.replace(sc, tokens=4096)
        args.batches, args.plan_budget = 20, 5.0
    b = build(sc)
    src_cap, dst_cap = int(b.src_pages.max()) + 1, int(b.dst_pages.max()) + 1
    src_arena, src_ptrs, src_lens = _arena(sc.layers, src_cap)
    dst_arena, dst_ptrs, dst_lens = _arena(sc.layers, dst_cap)
    src_arena[:] = np.random.default_rng(1).integers(0, 256, src_arena.size, dtype=np.uint8)
    b = dataclasses.replace(b, src_ptrs=src_ptrs, dst_ptrs=dst_ptrs, src_lens=src_lens,
                            dst_lens=dst_lens)

    sg = sglang_loader.load_sglang()
    sgl, kvp = SGLangSide(sg, b), KvplanSide(b)
    identical(sgl.result_lists(), kvp.result())
    sgl.reset()
    blocks = kvp.n_blocks
    print(f"{blocks:,} blocks, identical on both planners; part 1 (planning)...", flush=True)
    nothing = lambda: None  # noqa: E731
    plan_samples = interleaved({
        "sglang plan": (sgl.plan, nothing, sgl.reset),
        "sglang plan + lists": (sgl.handoff, nothing, sgl.reset),
        "kvplan plan": (kvp.pooled, nothing, nothing),
        "kvplan plan + as_lists": (kvp.handoff, nothing, kvp.reset),
    }, budget_s=args.plan_budget, min_reps=3, max_reps=40)
    sgl.reset()

    print("part 2 (hand-off + engine submit, real Mooncake over TCP loopback)...", flush=True)
    sender = MooncakeTransport("127.0.0.1")
    receiver = MooncakeTransport("127.0.0.1")
    sender.register_buffers(src_ptrs, src_lens)
    receiver.register_buffers(dst_ptrs, dst_lens)
    peer = receiver.local_session_id()
    native = sender._native_ready()
    if native is None:
        sys.exit(f"native hand-off unavailable: {sender.handoff_reason}")
    engine = sender._engine
    plan = kvp.template.plan(kvp.s, kvp.d)
    src, dst, lengths = plan.src_addrs, plan.dst_addrs, plan.lengths
    rng = np.random.default_rng(7)
    starts = (rng.integers(0, blocks // BATCH, args.batches) * BATCH).tolist()
    state: dict[str, object] = {}
    picks = {"lists": iter(starts), "prebuilt": iter(starts), "native": iter(starts)}

    def pick(name: str) -> slice:
        lo = next(picks[name])
        return slice(lo, lo + BATCH)

    def lists_before() -> None:
        state["w"] = pick("lists")

    def lists_fn() -> None:
        w = state["w"]
        state["id"] = engine.batch_transfer_async_write(peer, src[w].tolist(), dst[w].tolist(),
                                                        lengths[w].tolist())

    def prebuilt_before() -> None:
        w = pick("prebuilt")
        state["l"] = (src[w].tolist(), dst[w].tolist(), lengths[w].tolist())

    def prebuilt_fn() -> None:
        s, d, n = state["l"]  # type: ignore[misc]
        state["id"] = engine.batch_transfer_async_write(peer, s, d, n)

    def wait_id() -> None:
        bid = state.pop("id")
        assert bid != 0, "submit refused"
        assert engine.get_batch_transfer_status([bid]) == 0, "batch failed"

    def native_before() -> None:
        w = pick("native")
        state["c"] = (src[w], dst[w], lengths[w])

    def native_fn() -> None:
        s, d, n = state["c"]  # type: ignore[misc]
        state["batch"] = native.submit(peer, s, d, n)

    def native_wait() -> None:
        state.pop("batch").wait(30.0)  # type: ignore[attr-defined]

    # The hand-off alone, without the engine: what the list path builds per batch.
    w0 = slice(0, BATCH)
    handoff_only = interleaved({
        "tolist x3 (list path hand-off)": (
            lambda: (src[w0].tolist(), dst[w0].tolist(), lengths[w0].tolist()), nothing,
            nothing),
        "column views (native hand-off)": (lambda: (src[w0], dst[w0], lengths[w0]), nothing,
                                           nothing),
    }, budget_s=3.0, min_reps=20, max_reps=200)
    sub = alternating({
        "lists": (lists_fn, lists_before, wait_id),
        "prebuilt": (prebuilt_fn, prebuilt_before, wait_id),
        "native": (native_fn, native_before, native_wait),
    }, reps=args.batches)
    # Every block of every sampled batch landed: check the last batch's bytes.
    w = slice(starts[-1], starts[-1] + BATCH)
    for s_addr, d_addr, n in zip(src[w][:64].tolist(), dst[w][:64].tolist(),
                                 lengths[w][:64].tolist()):
        s_off = s_addr - src_arena.ctypes.data
        d_off = d_addr - dst_arena.ctypes.data
        assert np.array_equal(src_arena[s_off:s_off + n], dst_arena[d_off:d_off + n])
    sender.close()
    receiver.close()

    every = {**plan_samples, **sub, **handoff_only}
    med = {k: statistics.median(v) for k, v in every.items()}
    low = {k: min(v) for k, v in every.items()}
    n_samples = {k: len(v) for k, v in every.items()}
    per_block = {k: med[k] / BATCH for k in sub}
    req = {
        "kvplan, native": med["kvplan plan"] / blocks + per_block["native"],
        "kvplan, lists (the list path)": med["kvplan plan"] / blocks + per_block["lists"],
        "SGLang (its lists, then the engine)": med["sglang plan + lists"] / blocks
        + per_block["prebuilt"],
    }
    req_min = {
        "kvplan, native": low["kvplan plan"] / blocks + low["native"] / BATCH,
        "kvplan, lists (the list path)": low["kvplan plan"] / blocks + low["lists"] / BATCH,
        "SGLang (its lists, then the engine)": low["sglang plan + lists"] / blocks
        + low["prebuilt"] / BATCH,
    }
    ratio_plan = med["sglang plan"] / med["kvplan plan"]
    ratio_plan_min = low["sglang plan"] / low["kvplan plan"]
    speedup = req["kvplan, lists (the list path)"] / req["kvplan, native"]
    cmd = "python " + " ".join(sys.argv)
    lines = [
        "# Per request into a real Mooncake engine: plan, hand-off, submit",
        "",
        f"Command: `{cmd}` ({time.time() - t_start:.0f} s). Script: `bench/mooncake_handoff.py` "
        "(its docstring says what each variant does).",
        "",
        *machine.describe(load0, kvplan.__version__, sglang_version=sg.version),
        f"- Mooncake {sender.handoff} hand-off, `mooncake-transfer-engine-non-cuda` "
        f"{kvplan._core.MooncakeNative.VERIFIED_VERSION}, TCP on 127.0.0.1, two engines in "
        "this process",
        "",
        f"Request: {sc.layers} layers × {sc.n_pages:,} pages of 1 token, every destination page "
        f"its own run: **{blocks:,} blocks** (items of {ITEM} bytes on real host memory).",
        "",
        "## Per request (plan + hand-off + the engine's submit), per block",
        "",
        "| path | ns per block (medians) | for the whole request | ns per block (mins) |",
        "| --- | --- | --- | --- |",
    ]
    for k, v in req.items():
        lines.append(f"| {k} | {v:,.1f} | {_ms(v * blocks)} | {req_min[k]:,.1f} |")
    tolist_ns = per_block["lists"] - per_block["prebuilt"]
    convert_ns = per_block["prebuilt"] - per_block["native"]
    lines += [
        "",
        f"- native vs the list path: **{speedup:.1f}×** less per block "
        f"(target ≥ 10×: **{'met' if speedup >= 10 else 'missed'}**).",
        f"- where the list path's extra time goes, per block (medians): `.tolist()` ×3 "
        f"{tolist_ns:,.1f} ns, the binding's list conversion and request building "
        f"{convert_ns:,.1f} ns; what is left in the native figure "
        f"({per_block['native']:,.1f} ns) is Mooncake's own `submitTransfer` (kvplan fills the "
        "request array at about 1 ns per block).",
        f"- kvplan native vs SGLang: {req['SGLang (its lists, then the engine)'] / req['kvplan, native']:.1f}× "
        "per request.",
        f"- the hand-off alone, per block (no engine call, medians): the list path's three "
        f"`.tolist()` {med['tolist x3 (list path hand-off)'] / BATCH:,.1f} ns, the native path's "
        f"column views {med['column views (native hand-off)'] / BATCH:,.2f} ns.",
        "",
        "## Part 1: planning (medians; min in brackets)",
        "",
        "| variant | samples | median | min |",
        "| --- | --- | --- | --- |",
    ]
    for k in plan_samples:
        lines.append(f"| {k} | {n_samples[k]} | {_ms(med[k])} | {_ms(low[k])} |")
    lines += [
        "",
        f"- plan-only ratio, SGLang / kvplan: **{ratio_plan:.0f}×** median, "
        f"{ratio_plan_min:.0f}× min/min (target ≥ 300×: "
        f"**{'met' if min(ratio_plan, ratio_plan_min) >= 300 else 'missed'}** in this run).",
        f"- with the lists each side builds: "
        f"{med['sglang plan + lists'] / med['kvplan plan + as_lists']:.1f}×.",
        "",
        f"## Part 2: one batch of {BATCH:,} blocks into the engine (medians; min in brackets)",
        "",
        "| variant | samples | median per batch | min | ns per block (median) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k in sub:
        lines.append(f"| {k} | {n_samples[k]} | {_ms(med[k])} | {_ms(low[k])} | "
                     f"{per_block[k]:,.1f} |")
    out_dir = args.out_dir or ("/tmp/kvplan-bench-quick" if args.quick else RESULTS_DIR)
    path = write_lines(out_dir, "mooncake-handoff.md", lines)
    print("\n".join(lines))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
