"""vLLM's Mooncake connector against kvplan.compat.vllm, per request as the engine pays it.

    .venv/bin/python bench/vllm_dropin.py            # full run, into bench/results/vllm-dropin.md
    .venv/bin/python bench/vllm_dropin.py --quick    # smoke run, writes to /tmp

vLLM's real ``MooncakeConnectorWorker`` from its wheel (``tests/support/vllm_loader.py``) on one
worker object, with vLLM's own ``_prepare_transfer_regions``; kvplan installed on a subclass of
it. Four variants per request, sampled interleaved in one process (rotating order, collector
off, ``harness.timing.interleaved``):

  vllm plan        vLLM's ``_build_transfer_params``
  kvplan plan      the installed ``_build_transfer_params`` (its peer's templates built once)
  vllm request     vLLM's ``_build_transfer_params`` + vLLM's ``_send_blocks``
  kvplan request   kvplan's ``_build_transfer_params`` + kvplan's ``_send_blocks``

``_send_blocks`` runs into an engine whose ``batch_transfer_sync_write`` takes the three lists
and returns 0: what every engine call is handed is built on both sides (vLLM's lists as they
are; kvplan's columns converted to lists in batches of 1,024), what the engine then does with
them is the engine's and is left out of both. Both byte maps are checked equal first. Reported:
median per request, and the ratio of vLLM's median to kvplan's and of the two minimums.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import types

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
# The real-engine section submits a whole request (31,232 blocks) before waiting on it: Mooncake
# TCP's per-peer queues must admit that many (its maximum is 65,535).
os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535")
os.environ.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "65535")

from harness.machine import describe  # noqa: E402  (also: tests/ on sys.path, support.*)
from harness.results import RESULTS_DIR, write_lines  # noqa: E402
from harness.timing import alternating, interleaved  # noqa: E402
from support.vllm_cases import (  # noqa: E402
    RecordingStats, canonical, make_worker, run_coroutine, xfer_meta)
from support.vllm_loader import load_vllm  # noqa: E402

import kvplan  # noqa: E402
from kvplan.compat import vllm as compat  # noqa: E402

CASES = [("61 × 512, contiguous", 61, 512, 0.0), ("61 × 512, 5 % fragmented", 61, 512, 0.05),
         ("61 × 512, fully fragmented", 61, 512, 1.0),
         ("188 × 2,048, fully fragmented", 188, 2048, 1.0)]


class ListEngine:
    """Takes the three lists of one ``batch_transfer_sync_write`` and succeeds."""

    def batch_transfer_sync_write(self, session, src, dst, lengths):
        return 0


def scenario(v, cls, n_layers, n_blocks, fragmented_share, seed=0, *, blk=18432,
             bases=(1 << 32, 1 << 40), engine=None):
    """MLA, one packed buffer per layer (576 x 2 bytes x 16 tokens per block), TP 1 -> 1; local
    pages consecutive, the given share of decode pages breaking the run. ``blk``, ``bases``
    and ``engine``: the block bytes, the two sides' first region and the prefill's engine
    (real memory and a real engine in the real-engine section)."""
    rng = random.Random(seed)
    kvi = v.kvi
    cap = 2 * n_blocks + 8
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    spec = kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=None)

    def reg(base0):
        regs, bufs = [], []
        for i, n in enumerate(names):
            base = base0 + i * (cap * blk + (1 << 20))
            regs.append((base, blk, blk, n, i, 0))
            bufs.append((base, cap * blk))
        return regs, bufs

    p_regs, p_bufs = reg(bases[0])
    d_regs, d_bufs = reg(bases[1])
    kw = dict(tp_rank=0, tp_size=1, use_mla=True, total_kv_heads=1, group_specs=[spec],
              layer_groups={n: 0 for n in names}, num_blocks=cap)
    prefill = make_worker(v, cls, regions=p_regs, buffers=p_bufs,
                          engine=engine if engine is not None else ListEngine(), **kw)
    decode = make_worker(v, v.MooncakeConnectorWorker, regions=d_regs, buffers=d_bufs, **kw)
    local = list(range(1, n_blocks + 1))
    remote, nxt = [], 1
    for _ in range(n_blocks):
        remote.append(nxt)
        nxt += 2 if rng.random() < fragmented_share else 1
    meta = xfer_meta(decode, tp_rank=0, tp_size=1, pp_size=1,
                     req_blocks={"r": ("t", [remote])})
    ready = [("r", types.SimpleNamespace(local_block_ids=[local]))]
    local_regions, remote_regions, err = prefill._prepare_transfer_regions(meta)
    assert err is None
    return prefill, meta, ready, local_regions, remote_regions


def variants(v, cls, w, meta, ready, lr, rr):
    W = v.MooncakeConnectorWorker
    session = f"{meta.remote_hostname}:{meta.remote_port}"

    def vllm_plan():
        return run_coroutine(W._build_transfer_params(w, ready, meta, lr, rr))

    def kvplan_plan():
        return run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))

    def vllm_request():
        s, d, n, _, _ = run_coroutine(W._build_transfer_params(w, ready, meta, lr, rr))
        return W._send_blocks(w, session, s, d, n)

    def kvplan_request():
        s, d, n, _, _ = run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))
        return cls._send_blocks(w, session, s, d, n)

    def reset_stats():  # each _send_blocks appends a record; keep memory flat
        w.xfer_stats = RecordingStats()

    nothing = lambda: None  # noqa: E731
    return {"vllm plan": (vllm_plan, nothing, nothing),
            "kvplan plan": (kvplan_plan, nothing, nothing),
            "vllm request": (vllm_request, nothing, reset_stats),
            "kvplan request": (kvplan_request, nothing, reset_stats)}


def breakdown(w, meta, ready, lr, rr, repeat):
    """Where kvplan's per-request time goes for a one-group request: the block ids into
    arrays, the core's plan, the template lookup and the columns."""
    peer = compat._templates(w, meta, lr, rr)
    template = peer.groups[0][2]
    local = ready[0][1].local_block_ids[0]
    remote = meta.req_blocks[ready[0][0]][1][0]
    la, ra = compat.index_array(local), compat.index_array(remote)
    plan = template.plan(la, ra)
    parts = {
        "block ids → int64 arrays (`index_array`, Rust, both lists)":
            lambda: (compat.index_array(local), compat.index_array(remote)),
        "`Template.plan`": lambda: template.plan(la, ra),
        "template lookup (`_templates`)": lambda: compat._templates(w, meta, lr, rr),
        "the three columns (`BlockColumn` views)": lambda: (
            plan.src_addrs.view(compat.BlockColumn), plan.dst_addrs.view(compat.BlockColumn),
            plan.lengths.view(compat.BlockColumn)),
    }
    samples = interleaved({k: (f, lambda: None, lambda: None) for k, f in parts.items()},
                          budget_s=2.0, min_reps=5, max_reps=200)
    return {k: statistics.median(s) for k, s in samples.items()}


class SubmitEngine:
    """vLLM's ``_send_blocks`` call into a real Mooncake engine, up to the engine's async submit
    returning: its ``batch_transfer_sync_write`` is the binding's ``batch_transfer_async_write``
    on the same three lists; the batch is waited on afterwards, untimed (:meth:`wait`)."""

    def __init__(self, engine):
        self.engine = engine
        self.ids = []

    def batch_transfer_sync_write(self, session, src, dst, lengths):
        bid = self.engine.batch_transfer_async_write(session, src, dst, lengths)
        assert bid != 0, "submit refused"
        self.ids.append(bid)
        return 0

    def wait(self):
        ids, self.ids = self.ids, []
        if ids:
            assert self.engine.get_batch_transfer_status(ids) == 0, "a vLLM batch failed"


REAL_BLK = 64  # bytes per block in the real-engine section: neither side's cost depends on it


def real_engine(v, cls, reps):
    """61 x 512 fully fragmented, both sides into a real Mooncake engine (TCP, 127.0.0.1, two
    engines in this process), timed from the start of ``_build_transfer_params`` until the
    engine's async submit of the whole request has returned; each request is waited on after
    its sample, untimed. Alternating order, collector off (``harness.timing.alternating``).

      vllm submit      vLLM's ``_build_transfer_params`` + vLLM's ``_send_blocks`` (one
                       ``batch_transfer_async_write`` of the three lists)
      kvplan submit    kvplan's ``_build_transfer_params`` + the native hand-off as kvplan's
                       ``_send_blocks`` makes it (``MooncakeNative.submit`` per batch of 1,024
                       column views), every batch submitted before any is waited on
      vllm lists only  the binding's ``batch_transfer_async_write`` on vLLM's lists, prebuilt
      native only      ``MooncakeNative.submit`` per batch of the plan's columns, prebuilt

    The last two are each side's engine part alone (what the engine does with its input up to
    the submit returning)."""
    import numpy as np

    from kvplan.engines import MooncakeTransport

    n_layers, n_blocks = 61, 512
    cap = 2 * n_blocks + 8
    size = n_layers * (cap * REAL_BLK + (1 << 20)) + (1 << 21)
    arenas = [np.zeros(size, np.uint8) for _ in range(2)]
    arenas[0][:] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    bases = [a.ctypes.data for a in arenas]
    sender, receiver = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    sender.register_buffers([bases[0]], [size])
    receiver.register_buffers([bases[1]], [size])
    session = receiver.local_session_id()
    engine = sender._engine
    submit_engine = SubmitEngine(engine)
    w, meta, ready, lr, rr = scenario(v, cls, n_layers, n_blocks, 1.0, blk=REAL_BLK,
                                      bases=tuple(bases), engine=submit_engine)
    w.hostname, w.rpc_port = "127.0.0.1", engine.get_rpc_port()
    W = v.MooncakeConnectorWorker
    batch = compat.DEFAULT_MAX_BLOCKS_PER_BATCH
    # kvplan's own choice for this worker (its engine object is the submit shim, so ask with
    # the real engine in place)
    w.engine = engine
    native = compat._native(w)
    w.engine = submit_engine
    if native is None:
        sender.close()
        receiver.close()
        return None, compat.handoff(w)[1]
    ref = run_coroutine(W._build_transfer_params(w, ready, meta, lr, rr))
    got = run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))
    assert canonical(*got[:3]) == canonical(*ref[:3])
    n_desc = len(ref[0])
    pending = []

    def vllm_submit():
        s, d, n, _, _ = run_coroutine(W._build_transfer_params(w, ready, meta, lr, rr))
        return W._send_blocks(w, session, s, d, n)

    def kvplan_submit():
        s, d, n, _, _ = run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))
        for lo in range(0, len(s), batch):
            hi = lo + batch
            pending.append(native.submit(session, s[lo:hi], d[lo:hi], n[lo:hi]))

    lists = [list(c) for c in ref[:3]]
    cols = got[:3]

    def vllm_lists_only():
        submit_engine.batch_transfer_sync_write(session, *lists)

    def native_only():
        s, d, n = cols
        for lo in range(0, len(s), batch):
            hi = lo + batch
            pending.append(native.submit(session, s[lo:hi], d[lo:hi], n[lo:hi]))

    def wait_native():
        while pending:
            pending.pop().wait(60.0)

    def wait_vllm():
        submit_engine.wait()
        w.xfer_stats = RecordingStats()

    nothing = lambda: None  # noqa: E731
    # the bytes of kvplan's submit land where vLLM's plan says
    arenas[1][:] = 0
    kvplan_submit()
    wait_native()
    src0, dst0 = bases
    for sa, da, n in zip(*ref[:3]):
        assert np.array_equal(arenas[1][da - dst0:da - dst0 + n], arenas[0][sa - src0:sa - src0 + n])
    samples = alternating({
        "vllm submit": (vllm_submit, nothing, wait_vllm),
        "kvplan submit": (kvplan_submit, nothing, wait_native),
        "vllm lists only": (vllm_lists_only, nothing, wait_vllm),
        "native only": (native_only, nothing, wait_native),
    }, reps=reps)
    sender.close()
    receiver.close()
    return (n_desc, samples), ""


def fmt(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smoke run; writes to /tmp")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--real-reps", type=int, default=30,
                    help="samples per variant in the real-engine section")
    args = ap.parse_args()
    out_dir = args.out_dir or ("/tmp" if args.quick else RESULTS_DIR)
    load_start = os.getloadavg()[0]
    v = load_vllm()
    cls = type("KvplanWorker", (v.MooncakeConnectorWorker,), {})
    compat.install(cls)
    rows = []
    parts = None
    started = time.time()
    for label, layers, blocks, frag in CASES[:2] if args.quick else CASES:
        w, meta, ready, lr, rr = scenario(v, cls, layers, blocks, frag)
        ref = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
            w, ready, meta, lr, rr))
        got = run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))
        assert canonical(*got[:3]) == canonical(*ref[:3]), label
        assert len(got[0]) == len(ref[0]) and not got[3] and not ref[3], label
        heavy = layers * blocks * (1 + frag) > 100_000
        samples = interleaved(variants(v, cls, w, meta, ready, lr, rr),
                              budget_s=(4 if args.quick else (60 if heavy else 20)),
                              min_reps=3, max_reps=400)
        med = {k: statistics.median(s) for k, s in samples.items()}
        low = {k: min(s) for k, s in samples.items()}
        n = {k: len(s) for k, s in samples.items()}
        rows.append((label, len(ref[0]), med, low, n))
        print(f"{label:32s} {len(ref[0]):>7} desc | plan vLLM {fmt(med['vllm plan'])} kvplan "
              f"{fmt(med['kvplan plan'])} x{med['vllm plan'] / med['kvplan plan']:,.0f} | "
              f"request vLLM {fmt(med['vllm request'])} kvplan {fmt(med['kvplan request'])} "
              f"x{med['vllm request'] / med['kvplan request']:,.0f}", flush=True)
        if frag == 0.0 and parts is None:
            parts = breakdown(w, meta, ready, lr, rr, 2000)
            for k, t in parts.items():
                print(f"    {k}: {fmt(t)}", flush=True)
    print("real engine: 61 x 512 fully fragmented into Mooncake (TCP loopback)...", flush=True)
    real, real_why = real_engine(v, cls, 5 if args.quick else args.real_reps)
    fully_frag_plan = next((m["kvplan plan"] for label, _, m, _, _ in rows
                            if label == "61 × 512, fully fragmented"), float("nan"))
    elapsed = time.time() - started
    load_end = os.getloadavg()[0]
    cmd = "python bench/vllm_dropin.py" + (" --quick" if args.quick else "")
    lines = [
        f"# vLLM {v.version} Mooncake connector: vLLM's methods vs kvplan.compat.vllm, per request",
        "",
        f"`{cmd}` ({elapsed:.0f} s). The module docstring says what each variant runs. One "
        "process, the four variants sampled interleaved (rotating order, collector off); "
        "medians of the samples, and ratios of vLLM's time to kvplan's: of the medians and of "
        "the two minimums. MLA, one packed buffer per layer, 18,432-byte blocks, TP 1 → 1; the "
        "byte maps are checked equal before timing.",
        "",
        *describe(load_start, kvplan.__version__),
        "",
        "| request | descriptors | vLLM plan | kvplan plan | plan ratio (median / min) "
        "| vLLM + `_send_blocks` | kvplan + `_send_blocks` | per-request ratio (median / min) "
        "| samples |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, ndesc, med, low, n in rows:
        lines.append(
            f"| {label} | {ndesc:,} | {fmt(med['vllm plan'])} | {fmt(med['kvplan plan'])} | "
            f"{med['vllm plan'] / med['kvplan plan']:,.0f}× / "
            f"{low['vllm plan'] / low['kvplan plan']:,.0f}× | {fmt(med['vllm request'])} | "
            f"{fmt(med['kvplan request'])} | "
            f"{med['vllm request'] / med['kvplan request']:,.0f}× / "
            f"{low['vllm request'] / low['kvplan request']:,.0f}× | "
            f"{min(n['vllm plan'], n['vllm request'])} / "
            f"{min(n['kvplan plan'], n['kvplan request'])} |")
    if parts:
        lines += ["", "Where kvplan's plan time goes, 61 × 512 contiguous (medians, interleaved):",
                  "", "| part | time |", "| --- | ---: |"]
        lines += [f"| {k} | {fmt(t)} |" for k, t in parts.items()]
    lines += ["", "## Into a real Mooncake engine, up to its async submit returning", ""]
    if real is None:
        lines.append(f"Not run: the native hand-off is unavailable ({real_why}).")
    else:
        n_desc, smp = real
        med = {k: statistics.median(x) for k, x in smp.items()}
        low = {k: min(x) for k, x in smp.items()}
        lines += [
            f"61 × 512 fully fragmented ({n_desc:,} descriptors of {REAL_BLK} bytes on real "
            "host memory), two Mooncake engines in this process over TCP on 127.0.0.1 "
            "(`mooncake-transfer-engine-non-cuda` "
            f"{kvplan._core.MooncakeNative.VERIFIED_VERSION}, per-peer queues raised to 65,535 "
            "so a whole request is admitted at once). Timed from the start of "
            "`_build_transfer_params` until the engine's async submit of the whole request "
            "returned; each request waited on after its sample, untimed; "
            f"{min(len(x) for x in smp.values())} samples per variant, alternating order "
            "(`real_engine` in the script says what each variant runs). The bytes of one "
            "kvplan submit were checked against vLLM's plan first.",
            "",
            "| variant | median | min | per descriptor (median) |",
            "| --- | ---: | ---: | ---: |",
        ]
        for k in smp:
            lines.append(f"| {k} | {fmt(med[k])} | {fmt(low[k])} | {med[k] / n_desc:,.0f} ns |")
        lines += [
            "",
            f"- per request, plan + submit, vLLM / kvplan: "
            f"**{med['vllm submit'] / med['kvplan submit']:,.1f}×** median, "
            f"{low['vllm submit'] / low['kvplan submit']:,.1f}× min/min.",
            f"- each side's engine part alone (medians): the binding's submit of vLLM's lists "
            f"{fmt(med['vllm lists only'])}, the native submit of kvplan's columns "
            f"{fmt(med['native only'])}. kvplan's own part, its `_build_transfer_params` "
            f"({fmt(fully_frag_plan)} in the table above), is "
            f"{fully_frag_plan / med['kvplan submit']:.2%} of its per-request time: the rest "
            "is Mooncake's `submitTransfer`. Under load the submit's time swings by several "
            "times between samples (the engine wakes its I/O thread for every block), so the "
            "medians of these four variants are not additive.",
        ]
    frag = next((r for r in rows if r[0] == "61 × 512, fully fragmented"), None)
    if frag is not None and real is not None:
        fm = frag[2]
        list_ratio = fm["vllm request"] / fm["kvplan request"]
        real_ratio = med["vllm submit"] / med["kvplan submit"]
        verdict = "met" if min(list_ratio, real_ratio) >= 300 else "missed"
        lines += [
            "",
            "## Target: `_build_transfer_params` + `_send_blocks`, fully fragmented, ≥ 300× "
            "vLLM's pair",
            "",
            f"**{verdict.capitalize()}** in this run: {list_ratio:,.0f}× on the list path "
            f"(an engine that only takes the lists) and {real_ratio:,.1f}× into the real "
            "engine, until its submit returned. On the list path kvplan must build a Python int "
            "for every source and destination address; vLLM builds those while planning. Into "
            "vLLM's real Mooncake engine the native hand-off builds none. What is left is "
            "Mooncake's own `submitTransfer`, at least 0.4 µs per descriptor on TCP and several "
            "µs under load (bench/results/mooncake-handoff.md has the profile). kvplan's plan is "
            "tens of µs of that, so the engine's submit sets the ratio, not the plan.",
        ]
    lines += ["", f"Load average (1 min) at the end of the whole run: {load_end:.2f}."]
    path = write_lines(out_dir, "vllm-dropin.md", lines)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
