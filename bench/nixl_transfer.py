"""Real NIXL transfers of one request: kvplan's run-merged descriptors vs one descriptor per page
per layer through NIXL's prepped path (what vLLM's NixlConnector sends), plus NIXL's own
throughput for one large block, all in the same run between two processes (UCX, DRAM to DRAM).

    .venv/bin/python bench/nixl_transfer.py [--tokens 32768] [--page-size 16] [--reps 3]
    .venv/bin/python bench/nixl_transfer.py --tokens 8192 --per-request 15   # nixl-request.md

``--per-request N``: instead of whole transfers, plan-only and per-request samples (plan +
the hand-off in the form NIXL takes, until its post returned), kvplan and the per-page peer
alternating in the prefill process; see ``_per_request``.

Model: DeepSeek-V3 (61 MLA layers, 1152 bytes per token per layer). Source pages contiguous,
destination pages fragmented (``kvplan.presets.fragmented_pages``: exactly round(f * (n - 1))
breaks, runs shuffled). Per scenario and path: descriptor building (plan path: ``Template.plan``
+ two ``(N, 3)`` row arrays + two ``get_xfer_descs``; prepped path: the two index arrays, with
the one-off ``prep_xfer_dlist`` reported separately) and the transfer itself (``submit``: create,
post, poll to DONE, release). Medians of ``--reps``. Layers 0 and 60 of the decode pool are
compared with the source after each path (all bytes of those two layers). NIXL's own limit:
one descriptor of one layer's request bytes (a descriptor must lie inside one registered
buffer, and each layer is its own buffer).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import time
from typing import Any

import numpy as np

from kvplan.presets import fragmented_pages, get_preset
from kvplan.testing import Arena, arena_dir, preset_peer


def _decode(conn: Any, spec_d: dict[str, Any], path: str, size: int) -> None:
    from kvplan.engines.nixl import NixlTransport
    from kvplan.testing import PeerSpec, build_layout

    spec = PeerSpec.from_dict(spec_d)
    arena = Arena(path, size, create=False)
    t = NixlTransport("bench-decode")
    layout = build_layout(spec, arena.base)
    t.register(layout)
    conn.send((t.metadata(), layout.to_bytes(), arena.base))
    conn.recv()  # stop
    t.close()


def _per_request(t: Any, peer: str, template: Any, prepped: Any, src_pages: Any,
                 dst_pages: Any, reps: int) -> dict[str, Any]:
    """Plan-only and per-request samples of one request shape, kvplan and the per-page peer
    alternating in this process (``harness.timing.alternating``: rotating order, collector
    off). A request is timed until NIXL's post (``transfer``) returned; it is then waited on
    to DONE and released, untimed, before the next sample."""
    from harness.timing import alternating

    from kvplan.engines.nixl import descriptor_rows

    agent = t._agent
    (local_mem, local_dev), (remote_mem, remote_dev) = t._mems(peer, 0)
    handles: list[Any] = []

    def kvplan_plan() -> None:
        template.plan(src_pages, dst_pages)

    def peer_plan() -> None:
        prepped.indices(src_pages, dst_pages)

    def kvplan_handle() -> None:
        plan = template.plan(src_pages, dst_pages)
        local = agent.get_xfer_descs(descriptor_rows(plan.src_addrs, plan.lengths, local_dev),
                                     local_mem)
        remote = agent.get_xfer_descs(descriptor_rows(plan.dst_addrs, plan.lengths,
                                                      remote_dev), remote_mem)
        handles.append(agent.initialize_xfer("WRITE", local, remote, peer, b""))

    def peer_handle() -> None:
        li, ri = prepped.indices(src_pages, dst_pages)
        handles.append(agent.make_prepped_xfer("WRITE", prepped._local, li, prepped._remote, ri,
                                               b""))

    def kvplan_request() -> None:
        kvplan_handle()
        assert agent.transfer(handles[-1]) != "ERR"

    def peer_request() -> None:
        peer_handle()
        assert agent.transfer(handles[-1]) != "ERR"

    def finish() -> None:
        while handles:
            handle = handles.pop()
            while (state := agent.check_xfer_state(handle)) != "DONE":
                assert state != "ERR", "a transfer failed"
            agent.release_xfer_handle(handle)

    def post_and_finish() -> None:
        for handle in handles:
            assert agent.transfer(handle) != "ERR"
        finish()

    nothing = lambda: None  # noqa: E731
    samples = alternating({
        "kvplan plan": (kvplan_plan, nothing, nothing),
        "peer plan": (peer_plan, nothing, nothing),
        "kvplan handle": (kvplan_handle, nothing, post_and_finish),
        "peer handle": (peer_handle, nothing, post_and_finish),
        "kvplan request": (kvplan_request, nothing, finish),
        "peer request": (peer_request, nothing, finish),
    }, reps=reps)
    plan = template.plan(src_pages, dst_pages)
    li, _ = prepped.indices(src_pages, dst_pages)
    return {"samples": samples, "kvplan_desc": int(plan.n_blocks), "peer_desc": len(li)}


def _prefill(conn: Any, spec_d: dict[str, Any], path: str, size: int) -> None:
    import kvplan
    from kvplan import BlockSlice
    from kvplan.engines.nixl import NixlTransport, descriptor_rows
    from kvplan.testing import PeerSpec, build_layout

    spec = PeerSpec.from_dict(spec_d)
    arena = Arena(path, size, create=False)
    t = NixlTransport("bench-prefill", timeout=600)
    layout = build_layout(spec, arena.base)
    t.register(layout)
    md, wire, dbase = conn.recv()
    peer = t.add_peer(md)
    dst_layout = kvplan.Layout.from_bytes(wire)
    template = kvplan.Template(layout, dst_layout)
    t0 = time.perf_counter()
    prepped = t.prep(layout, dst_layout, peer, template)
    prep_s = time.perf_counter() - t0
    # Warm-up: the first request to a peer sets up the UCX endpoint; keep that out of the timings.
    t.submit(BlockSlice(np.array([arena.base], np.uint64), np.array([dbase], np.uint64),
                       np.array([4096], np.uint64)), peer)
    conn.send({"prep_s": prep_s, "rows": prepped.n_local + prepped.n_remote})
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        kind, src_pages, dst_pages = msg[:3]
        out: dict[str, Any] = {}
        if kind == "plan":
            t0 = time.perf_counter()
            plan = template.plan(src_pages, dst_pages)
            t1 = time.perf_counter()
            local = t._agent.get_xfer_descs(
                descriptor_rows(plan.src_addrs, plan.lengths, 0), "DRAM")
            remote = t._agent.get_xfer_descs(
                descriptor_rows(plan.dst_addrs, plan.lengths, 0), "DRAM")
            t2 = time.perf_counter()
            del local, remote
            stats = t.submit(plan, peer)
            out = {"plan_s": t1 - t0, "desc_s": t2 - t1, "build_s": t2 - t0,
                   "transfer_s": stats.seconds, "blocks": stats.blocks, "bytes": stats.bytes}
        elif kind == "prepped":
            t0 = time.perf_counter()
            li, ri = prepped.indices(src_pages, dst_pages)
            t1 = time.perf_counter()
            stats = prepped.submit(li, ri)
            out = {"build_s": t1 - t0, "transfer_s": stats.seconds, "blocks": stats.blocks,
                   "bytes": stats.bytes}
        elif kind == "request":
            out = _per_request(t, peer, template, prepped, src_pages, dst_pages, msg[3])
        elif kind == "large":
            n_bytes = int(src_pages)
            plan1 = BlockSlice(np.array([arena.base], np.uint64), np.array([dbase], np.uint64),
                              np.array([n_bytes], np.uint64))
            stats = t.submit(plan1, peer)
            out = {"build_s": 0.0, "transfer_s": stats.seconds, "blocks": 1, "bytes": n_bytes}
        conn.send(out)
    t.close()


def _per_request_report(args: Any, sconn: Any, model: Any, n: int, item: int, cap: int,
                        src_pages: Any, prep: dict[str, Any], load0: float,
                        started: float) -> None:
    import kvplan
    from harness.machine import describe
    from harness.results import RESULTS_DIR, write_lines

    def fmt(ns: float) -> str:
        return f"{ns / 1e6:,.2f} ms" if ns >= 1e6 else f"{ns / 1e3:,.1f} µs"

    rows = []
    for f in args.fragmentation:
        dst_pages = fragmented_pages(n, f, seed=1, shuffle_runs=True, capacity=cap)
        sconn.send(("request", src_pages, dst_pages, args.per_request))
        if not sconn.poll(1800):
            raise SystemExit("prefill gave no answer for the per-request samples in 1800 s")
        out = sconn.recv()
        smp = out["samples"]
        med = {k: statistics.median(v) for k, v in smp.items()}
        low = {k: min(v) for k, v in smp.items()}
        rows.append((f, out, med, low))
        print(f"{f:.0%}: plan {med['peer plan'] / med['kvplan plan']:.1f}x, request "
              f"{med['peer request'] / med['kvplan request']:.1f}x", flush=True)
    cmd = ("python bench/nixl_transfer.py --tokens {} --page-size {} --per-request {}"
           .format(args.tokens, args.page_size, args.per_request))
    lines = [
        "# NIXL per request: kvplan's run-merged descriptors vs one descriptor per page per layer",
        "",
        f"Command: `{cmd}` ({time.time() - started:.0f} s). Two processes, one NIXL agent each "
        "(nixl-cu12, UCX, DRAM to DRAM on one host); all timing in the prefill process, the "
        "four variants alternating (rotating order, collector off), one call per sample; "
        "medians, and the ratio of the peer's time to kvplan's of the medians and of the two "
        "minimums.",
        "",
        *describe(load0, kvplan.__version__),
        "",
        f"Request: DeepSeek-V3, {model.num_layers} MLA layers, {args.tokens:,} tokens at page "
        f"size {args.page_size} ({n:,} pages of {item:,} B per layer); source pages contiguous, "
        "destination pages with the given share of breaks (`fragmented_pages`, runs shuffled). "
        f"The peer's descriptor tables were prepared once (`prep_xfer_dlist`, "
        f"{prep['rows']:,} rows for both sides, {prep['prep_s'] * 1e3:.0f} ms).",
        "",
        "- **kvplan plan**: `Template.plan`. **peer plan**: the two index arrays of one "
        "descriptor per page per layer (what vLLM's NixlConnector sends; computed here by "
        "`PreppedPair.indices`, vLLM's own `_compute_desc_ids` is timed in "
        "vllm-nixl-request.md).",
        "- **kvplan request**: the plan, two `(N, 3)` descriptor arrays straight from its "
        "columns (`descriptor_rows`, no Python object per block), two `get_xfer_descs`, "
        "`initialize_xfer` and `transfer` (the post) returning. **peer request**: the index "
        "arrays, `make_prepped_xfer` and `transfer` returning. Each request is then polled to "
        "DONE and released, untimed. **handle**: the same without the post (until the "
        "transfer handle exists; posted, waited on and released untimed): the hand-off "
        "alone, since on this host UCX copies DRAM to DRAM inside the post, so the post costs "
        "about what the bytes cost.",
        "",
        "| fragmentation | descriptors (kvplan / peer) | kvplan plan | peer plan | plan ratio "
        "(median / min) | kvplan handle | peer handle | handle ratio (median / min) | "
        "kvplan request | peer request | per-request ratio (median / min) | samples |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f, out, med, low in rows:
        lines.append(
            f"| {f:.0%} | {out['kvplan_desc']:,} / {out['peer_desc']:,} | "
            f"{fmt(med['kvplan plan'])} | {fmt(med['peer plan'])} | "
            f"{med['peer plan'] / med['kvplan plan']:,.1f}× / "
            f"{low['peer plan'] / low['kvplan plan']:,.1f}× | {fmt(med['kvplan handle'])} | "
            f"{fmt(med['peer handle'])} | "
            f"{med['peer handle'] / med['kvplan handle']:,.1f}× / "
            f"{low['peer handle'] / low['kvplan handle']:,.1f}× | {fmt(med['kvplan request'])} | "
            f"{fmt(med['peer request'])} | "
            f"{med['peer request'] / med['kvplan request']:,.1f}× / "
            f"{low['peer request'] / low['kvplan request']:,.1f}× | "
            f"{min(len(v) for v in out['samples'].values())} |")
    path = write_lines(RESULTS_DIR, "nixl-request.md", lines)
    print("\n".join(lines))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--fragmentation", type=float, nargs="+", default=[0.05, 1.0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--per-request", type=int, default=0, metavar="N",
                    help="instead of whole transfers: N alternating samples per variant of "
                    "plan-only and per-request (plan + hand-off until NIXL's post returned) "
                    "work, kvplan vs one descriptor per page per layer; writes "
                    "bench/results/nixl-request.md")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    started = time.time()

    model = get_preset("deepseek-v3")
    n = args.tokens // args.page_size
    cap = 2 * n  # room for every break (max_gap 1)
    dspec = preset_peer(model, "decode", range(model.num_layers), pages=cap,
                        page_size=args.page_size)
    sspec = preset_peer(model, "prefill", range(model.num_layers), pages=n,
                        page_size=args.page_size)
    work = arena_dir(dspec.size + sspec.size)
    ctx = mp.get_context("spawn")
    procs = []
    try:
        d_arena = Arena(os.path.join(work, "d"), dspec.size, create=True)
        s_arena = Arena(os.path.join(work, "s"), sspec.size, create=True)
        pattern = (np.arange(251 << 16) % 251).astype(np.uint8)  # period 251: no page repeats
        for lo in range(0, sspec.size, pattern.size):
            chunk = s_arena.array[lo:lo + pattern.size]
            chunk[:] = pattern[:chunk.size]
        dconn, c1 = ctx.Pipe()
        sconn, c2 = ctx.Pipe()
        procs = [ctx.Process(target=_decode, args=(c1, dspec.to_dict(), d_arena.path,
                                                   dspec.size)),
                 ctx.Process(target=_prefill, args=(c2, sspec.to_dict(), s_arena.path,
                                                    sspec.size))]
        for p in procs:
            p.start()
        sconn.send(dconn.recv())
        prep = sconn.recv()
        item = model.kv_bytes_per_token * args.page_size
        print(f"DeepSeek-V3, {model.num_layers} MLA layers, {args.tokens:,} tokens, page size "
              f"{args.page_size} ({n:,} pages, {item:,} B per page per layer), "
              f"{n * item * model.num_layers / 2**30:.2f} GiB per request; NIXL prepped lists: "
              f"{prep['rows']:,} descriptors, prep_xfer_dlist once {prep['prep_s'] * 1e3:.0f} ms")
        print("| fragmentation | path | descriptors | build (ms) | transfer (ms) | GB/s |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        src_pages = np.arange(n, dtype=np.int64)
        if args.per_request:
            _per_request_report(args, sconn, model, n, item, cap, src_pages, prep, load0,
                                started)
            args.fragmentation = []
        for f in args.fragmentation:
            dst_pages = fragmented_pages(n, f, seed=1, shuffle_runs=True, capacity=cap)
            for kind in ("plan", "prepped", "large"):
                runs = []
                for _ in range(args.reps):
                    d_arena.array[:item] = 0  # re-dirty so nothing is skipped
                    sconn.send((kind, n * item if kind == "large" else src_pages, dst_pages))
                    if not sconn.poll(900):
                        raise SystemExit(f"prefill gave no answer for {kind} in 900 s")
                    runs.append(sconn.recv())
                if kind != "large":
                    for e_s, e_d in ((sspec.entries[0], dspec.entries[0]),
                                     (sspec.entries[-1], dspec.entries[-1])):
                        got = d_arena.view(e_d)[dst_pages]
                        want = s_arena.view(e_s)[src_pages]
                        assert np.array_equal(got, want), f"wrong bytes after {kind}"
                tr = statistics.median(r["transfer_s"] for r in runs)
                build = statistics.median(r["build_s"] for r in runs)
                name = {"plan": "kvplan run-merged (initialize_xfer)",
                        "prepped": "one per page per layer (make_prepped_xfer)",
                        "large": f"one large block ({n * item / 2**20:.1f} MiB: one layer)"
                        }[kind]
                extra = ""
                if kind == "plan":
                    plan_ms = statistics.median(r["plan_s"] for r in runs) * 1e3
                    desc_ms = statistics.median(r["desc_s"] for r in runs) * 1e3
                    extra = f" (plan {plan_ms:.2f} + rows/get_xfer_descs {desc_ms:.2f})"
                print(f"| {f:.0%} | {name} | {runs[0]['blocks']:,} | {build * 1e3:.2f}{extra} | "
                      f"{tr * 1e3:.1f} | {runs[0]['bytes'] / tr / 1e9:.2f} |", flush=True)
        sconn.send(("stop",))
        dconn.send("stop")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
