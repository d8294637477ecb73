"""Real NIXL transfers of one request: kvplan's run-merged descriptors vs one descriptor per page
per layer through NIXL's prepped path (what vLLM's NixlConnector sends), plus NIXL's own
throughput for one large block, all in the same run between two processes (UCX, DRAM to DRAM).

    .venv/bin/python bench/nixl_transfer.py [--tokens 32768] [--page-size 16] [--reps 3]

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


def _prefill(conn: Any, spec_d: dict[str, Any], path: str, size: int) -> None:
    import kvplan
    from kvplan import PlanBatch
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
    t.submit(PlanBatch(np.array([arena.base], np.uint64), np.array([dbase], np.uint64),
                       np.array([4096], np.uint64)), peer)
    conn.send({"prep_s": prep_s, "rows": prepped.n_local + prepped.n_remote})
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        kind, src_pages, dst_pages = msg
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
        elif kind == "large":
            n_bytes = int(src_pages)
            plan1 = PlanBatch(np.array([arena.base], np.uint64), np.array([dbase], np.uint64),
                              np.array([n_bytes], np.uint64))
            stats = t.submit(plan1, peer)
            out = {"build_s": 0.0, "transfer_s": stats.seconds, "blocks": 1, "bytes": n_bytes}
        conn.send(out)
    t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--fragmentation", type=float, nargs="+", default=[0.05, 1.0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

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
