"""SGLang 0.5.23's manager send methods, original vs kvplan-patched: plan-only and per request.

    .venv/bin/python bench/sglang_dropin.py              # into bench/results/sglang-dropin-request.md
    .venv/bin/python bench/sglang_dropin.py --quick      # smoke run, into /tmp

Both run on real manager instances of the wheel's classes (tests/support/sglang_loader.py) with the
same inputs: the original class and a subclass with kvplan installed, side by side in one
process. The byte maps of the two are checked equal before timing (through an engine that
records its lists). Then, per ``send_kvcache`` request, four variants are sampled interleaved
(``harness.timing.interleaved``: rotating order, collector off; medians and min/min):

  sglang plan      SGLang's ``send_kvcache`` up to its list of ``(src, dst, length)`` tuples
                   (``_transfer_data`` replaced by a recorder)
  kvplan plan      kvplan's ``send_kvcache`` up to its plan (the engine submission,
                   ``send_engine_batches``, replaced by a stub that takes the plan)
  sglang request   SGLang's ``send_kvcache`` with its own ``_transfer_data`` (the tuples unzipped
                   into three lists) into an engine whose ``batch_transfer_sync`` takes the lists
                   and returns 0
  kvplan request   kvplan's ``send_kvcache`` into the same engine: each batch's columns become
                   the three lists that engine takes

Neither side's engine work is timed (the engine only takes the lists). With SGLang's real
Mooncake engine wrapper kvplan hands the columns to Mooncake natively instead; that path,
with the engine's submit, is measured in bench/mooncake_handoff.py. ``send_kvcache_slice`` and
``_send_mamba_state`` (small, fixed requests) are timed per request only, the two sides
interleaved the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from harness.machine import describe  # importing harness puts tests/ on sys.path: support.*
from harness.results import RESULTS_DIR, write_lines
from harness.timing import interleaved
from support import sglang_loader
from support.sglang_loader import BlockRecorder, InlineExecutor, RecordingEngine
from support.sglang_models import SESSION, Deployment, canonical, engine_blocks, request

import kvplan
from kvplan.compat import sglang as compat
from kvplan.compat.sglang import dropins


class ListEngine:
    """Takes the three lists of one ``batch_transfer_sync`` and succeeds."""

    def batch_transfer_sync(self, session_id, src_addrs, dst_addrs, lengths):
        return 0


def classes(sg: Any) -> tuple[type, type]:
    """(SGLang's own manager class, a subclass of it with kvplan installed)."""
    base = sg.MooncakeKVManager
    ours = type("KvplanMooncakeKVManager", (base,), {})
    compat.install(ours)
    return base, ours


_SUBMIT = dropins.send_engine_batches


def plan_only_on() -> None:
    """kvplan's ``send_kvcache`` stops at its plan: the engine submission takes the plan and
    returns 0 (undone by :func:`plan_only_off`)."""
    dropins.send_engine_batches = lambda manager, session, plan: 0 if plan.n_blocks >= 0 else -1


def plan_only_off() -> None:
    dropins.send_engine_batches = _SUBMIT


def kv_manager(sg: Any, cls: type, dep: Deployment, engine: Any, *,
               recorder: BlockRecorder | None = None) -> Any:
    hybrid_mla = dep.hybrid
    mgr = sg.manager_object(
        cls, kv_args=dep.kv_args(), engine=engine,
        is_mla_backend=not hybrid_mla, is_hybrid_mla_backend=hybrid_mla, pp_size=dep.pp_size,
        decode_kv_args_table={SESSION: dep.register_info()})
    if recorder is not None:
        mgr._transfer_data = recorder
    return mgr


def kv_variants(sg: Any, orig: type, ours: type, dep: Deployment, src: np.ndarray,
                dst: np.ndarray) -> tuple[dict[str, Any], int]:
    """The four variants of one ``send_kvcache`` request, after checking both sides move the
    same bytes; also the block count SGLang hands its engine."""
    dptrs, _, dids = dep.dst_lists()
    blocks = {}
    for cls in (orig, ours):
        rec = kv_manager(sg, cls, dep, RecordingEngine())
        assert rec.send_kvcache(SESSION, src, dptrs, dst, None, dst_layer_ids=dids) == 0
        blocks[cls] = engine_blocks(rec.engine.calls)
    assert canonical(blocks[orig]) == canonical(blocks[ours]) == dep.truth(src, dst)
    recorder = BlockRecorder()
    sg_plan = kv_manager(sg, orig, dep, RecordingEngine(), recorder=recorder)
    sg_req = kv_manager(sg, orig, dep, ListEngine())
    kv_plan = kv_manager(sg, ours, dep, ListEngine())
    kv_req = kv_manager(sg, ours, dep, ListEngine())

    def send(mgr: Any) -> Callable[[], int]:
        return lambda: mgr.send_kvcache(SESSION, src, dptrs, dst, None, dst_layer_ids=dids)

    nothing = lambda: None  # noqa: E731
    return {
        "sglang plan": (send(sg_plan), nothing, recorder.calls.clear),
        "kvplan plan": (send(kv_plan), plan_only_on, plan_only_off),
        "sglang request": (send(sg_req), nothing, nothing),
        "kvplan request": (send(kv_req), nothing, nothing),
    }, len(blocks[orig])


def mamba_variants(sg: Any, orig: type, ours: type, n_src: int, n_dst: int
                   ) -> tuple[dict[str, Any], int]:
    src_ptrs = [0x1_0000_0000 + (i << 24) for i in range(n_src)]
    dst_ptrs = [0x9_0000_0000 + (j << 24) for j in range(n_dst)]
    items = [2 * 1024 * 1024] * n_src
    ids = list(range(n_src))
    req = types.SimpleNamespace(mooncake_session_id=SESSION)

    def manager(cls: type, engine: Any) -> Any:
        return sg.manager_object(
            cls, engine=engine, pp_size=1,
            kv_args=types.SimpleNamespace(state_data_ptrs=[src_ptrs],
                                          state_data_lens=[[x * 8 for x in items]]))

    def send(mgr: Any) -> Callable[[], int]:
        return lambda: mgr._send_mamba_state(req, [3], src_ptrs, items, dst_ptrs, [5], ids,
                                             list(range(n_dst)), [2 * 1024 * 1024] * n_dst)

    return request_variants(orig, ours, manager, send)


def request_variants(orig: type, ours: type, manager: Callable[[type, Any], Any],
                     send: Callable[[Any], Callable[[], int]]) -> tuple[dict[str, Any], int]:
    """Per-request variants only (no plan-only split) of one call ``send(manager(cls,
    engine))``, after checking both classes hand their engine the same blocks; also SGLang's
    block count."""
    blocks = {}
    for cls in (orig, ours):
        rec = manager(cls, RecordingEngine())
        assert send(rec)() == 0
        blocks[cls] = engine_blocks(rec.engine.calls)
    assert canonical(blocks[orig]) == canonical(blocks[ours])
    nothing = lambda: None  # noqa: E731
    return {"sglang request": (send(manager(orig, ListEngine())), nothing, nothing),
            "kvplan request": (send(manager(ours, ListEngine())), nothing, nothing)
            }, len(blocks[orig])


SLICE = dict(layers=32, heads=8, head_bytes=256, page=16, pages=16)


def slice_variants(sg: Any, orig: type, ours: type, tp_p: int, r_p: int, tp_d: int, r_d: int
                   ) -> tuple[dict[str, Any], int]:
    """``send_kvcache_slice`` of one request: 32-layer MHA, 8 KV heads of 256 bytes (head dim
    128, bf16), page 16, 16 contiguous pages (256 tokens), NHD pools, layer ids published."""
    L, H, hb, page, n = (SLICE[k] for k in ("layers", "heads", "head_bytes", "page", "pages"))
    si, di = page * max(1, H // tp_p) * hb, page * max(1, H // tp_d) * hb
    cap = 64
    sptrs = [0x1_0000_0000 + e * si * cap for e in range(2 * L)]
    dptrs = [0x9_0000_0000 + e * di * cap for e in range(2 * L)]
    ids = list(range(L)) * 2
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=sptrs, kv_data_lens=[si * cap] * (2 * L), kv_item_lens=[si] * (2 * L),
        kv_layer_ids=ids, page_size=page, total_kv_head_num=H, kv_head_num=max(1, H // tp_p),
        engine_rank=r_p, prefill_start_layer=0)
    src = np.arange(3, 3 + n, dtype=np.int32)
    dst = np.arange(20, 20 + n, dtype=np.int32)
    ex = InlineExecutor()

    def manager(cls: type, engine: Any) -> Any:
        return sg.manager_object(cls, kv_args=kv_args, engine=engine, attn_tp_size=tp_p)

    def send(mgr: Any) -> Callable[[], int]:
        return lambda: mgr.send_kvcache_slice(SESSION, src, dptrs, dst, r_d, tp_d, di, ex,
                                              dst_layer_ids=ids)

    return request_variants(orig, ours, manager, send)


def fmt(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:,.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:,.1f} µs"
    return f"{ns:,.0f} ns"


def ratio(smp: dict[str, list[float]], kind: str) -> tuple[str, str, str]:
    """(SGLang median, kvplan median, "median / min" ratio) of a variant pair, or dashes."""
    a, b = f"sglang {kind}", f"kvplan {kind}"
    if a not in smp:
        return "—", "—", "—"
    ma, mb = statistics.median(smp[a]), statistics.median(smp[b])
    return fmt(ma), fmt(mb), f"{ma / mb:,.1f}× / {min(smp[a]) / min(smp[b]):,.1f}×"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run; writes to /tmp")
    ap.add_argument("--budget", type=float, default=10.0, help="seconds per request shape")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    budget = 1.0 if args.quick else args.budget
    load0 = os.getloadavg()[0]
    started = time.time()
    sg = sglang_loader.load_sglang()
    orig, ours = classes(sg)
    rng = np.random.default_rng(0)
    cases = {
        "61-layer MLA": Deployment("mla", 61, list(range(61)), 1, 0, publish_ids=False),
        "hybrid MLA, 12 of 48 layers KV (ids)": Deployment(
            "mla", 48, list(range(3, 48, 4)), 1, 0, hybrid=True),
    }
    shapes: list[tuple[str, str, int, Callable[[], tuple[dict[str, Any], int]]]] = []
    for name, dep in cases.items():
        for fragmented in (False, True):
            src, dst = request(rng, fragmented=fragmented, n=64 if fragmented else 48)
            shapes.append((name, "fragmented" if fragmented else "contiguous", len(src),
                           lambda dep=dep, src=src, dst=dst: kv_variants(sg, orig, ours, dep,
                                                                           src, dst)))
    shapes.append(("hybrid Mamba state, 36 linear layers (`_send_mamba_state`)", "one slot", 1,
                   lambda: mamba_variants(sg, orig, ours, 36, 36)))
    sglang_loader.load_head_slicing(sg)  # compute_head_slice_params, from the wheel
    for tp_p, r_p, tp_d, r_d in ((8, 5, 2, 1), (2, 1, 8, 5)):
        shapes.append((f"`send_kvcache_slice`, MHA TP {tp_p} → {tp_d} (rank {r_p} → {r_d})",
                       "contiguous", SLICE["pages"],
                       lambda a=(tp_p, r_p, tp_d, r_d): slice_variants(sg, orig, ours, *a)))
    rows = []
    for name, kind, pages, make in shapes:
        variants, blocks = make()
        smp = interleaved(variants, budget_s=budget, min_reps=5, max_reps=2000)
        rows.append((name, kind, pages, blocks, smp))
        print(f"{name} ({kind}, {blocks} blocks): plan {ratio(smp, 'plan')[2]}, request "
              f"{ratio(smp, 'request')[2]}", flush=True)
    cmd = "python bench/sglang_dropin.py" + (" --quick" if args.quick else "")
    lines = [
        f"# SGLang {sg.version} manager send methods: original vs kvplan-patched, per request",
        "",
        f"Command: `{cmd}` ({time.time() - started:.0f} s). The module docstring says what "
        "each variant runs. One process; the variants of a request sampled interleaved "
        "(rotating order, collector off), medians of the samples, and the ratio of SGLang's "
        "time to kvplan's of the medians and of the two minimums. Both sides' byte maps were "
        "checked equal first. Per request = plan + the hand-off in the form the engine takes "
        "(three lists per engine call, both sides); the engine's own work is in neither.",
        "",
        *describe(load0, kvplan.__version__, sglang_version=sg.version),
        "",
        "| request | pages | n pages | blocks | SGLang request | kvplan request | "
        "per-request ratio (median / min) | SGLang plan | kvplan plan | plan ratio "
        "(median / min) | samples |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, kind, pages, blocks, smp in rows:
        rq, pl = ratio(smp, "request"), ratio(smp, "plan")
        lines.append(f"| {name} | {kind} | {pages} | {blocks:,} | {rq[0]} | {rq[1]} | {rq[2]} | "
                     f"{pl[0]} | {pl[1]} | {pl[2]} | {min(len(x) for x in smp.values())} |")
    path = write_lines(args.out_dir or ("/tmp" if args.quick else RESULTS_DIR),
                       "sglang-dropin-request.md", lines)
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
