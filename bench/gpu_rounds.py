"""Staged rounds (``Template.plan_rounds``) run by the torch executor on device tensors.

    .venv/bin/python bench/gpu_rounds.py --device cuda                 # a GPU, about 1-3 min
    .venv/bin/python bench/gpu_rounds.py --device cuda --json out.json # also the numbers as JSON
    .venv/bin/python bench/gpu_rounds.py --device cpu --quick          # smaller, on the CPU

Needs torch (and torch_npu for ``--device npu``). Three requests, each planned in rounds
through two bounded arenas (two round buffers each):

- MLA rows of 576 bf16 values, page size 1 on both sides, prefill and decode pages drawn at
  random (every token its own block: the gather reads one row per token and layer);
- GQA, 8 KV heads, prefill TP 8 -> decode TP 2, token-major (NHD) pages: the scatter writes
  one head slice per token (the decode arena holds the shares of the decode rank's four
  writers; this run fills the first writer's share);
- MHA at equal TP, prefill pages of 16 tokens -> decode pages of 64.

The prefill pool, the decode pool and both arenas are torch tensors on the device; the plans
address their ``data_ptr()`` memory. Per round: the executor runs the round's ``gather``
(prefill pool -> prefill round buffer), one device copy moves the round buffer into the decode
round buffer (the round's ``network`` block: what a transfer engine does between hosts, on one
device here), and the executor runs the round's ``scatter`` (decode round buffer -> decode
pool). The decode pool is then checked byte for byte against the CPU reference: the NumPy
executor (``kvplan.exec.numpy``) running the same rounds on host copies of the same bytes, and
the layout oracle (``kvplan.testing.oracle.reference_copy``), which reads no plan. It is
checked again after the timed repeats.

Timed per round (device synchronised before and after each call; medians over repeats): the
gather, the scatter, and a device-to-device copy of the same number of bytes between two
contiguous device buffers (the copy engine's ceiling for those bytes). GB/s are bytes per
median. The whole run keeps to a time budget (``--budget``, default 360 s): repeats stop early
when it runs short.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvplan
from kvplan.exec.numpy import Memory, NumpyExecutor
from kvplan.testing.oracle import reference_copy

try:
    import torch

    from harness.torch_pools import DevicePools, mha_layout
    from kvplan.torch import TorchExecutor
except ImportError as exc:  # pragma: no cover - a message for a run without torch
    raise SystemExit(f"gpu_rounds needs torch ({exc}): bash scripts/test-torch installs it") from exc

DTYPE = 2  # bf16 bytes
MLA_ROW = 576 * DTYPE


@dataclass
class Request:
    """One request's tensors, layouts, pages and rounds."""

    name: str
    tensors: dict[str, torch.Tensor]
    src_layout: kvplan.Layout
    dst_layout: kvplan.Layout
    src_pages: np.ndarray
    dst_pages: np.ndarray
    n_tokens: int | None
    rounds: kvplan.StagedRounds
    rows: list[dict[str, Any]] = field(default_factory=list)


def mla_request(device: str, quick: bool) -> tuple[DevicePools, kvplan.Layout, kvplan.Layout,
                                                         np.ndarray, np.ndarray, int | None]:
    layers, tokens = (4, 1024) if quick else (8, 8192)
    capacity = tokens + 64
    pools = DevicePools(device)
    entry = capacity * MLA_ROW

    def layout(name: str, seed: int | None) -> kvplan.Layout:
        base = pools.add(name, layers * entry, seed)
        return kvplan.Layout.mla([base + i * entry for i in range(layers)], [entry] * layers,
                                 MLA_ROW, list(range(layers)), page_size=1)

    src, dst = layout("prefill_pool", 11), layout("decode_pool", 12)
    rng = np.random.default_rng(13)
    sp = rng.permutation(capacity)[:tokens].astype(np.int64)
    dp = rng.permutation(capacity)[:tokens].astype(np.int64)
    return pools, src, dst, sp, dp, None


def gqa_request(device: str, quick: bool) -> tuple[DevicePools, kvplan.Layout, kvplan.Layout,
                                                         np.ndarray, np.ndarray, int | None]:
    layers, tokens, page = (4, 1024, 16) if quick else (16, 4096, 16)
    pages = tokens // page
    pools = DevicePools(device)
    src = mha_layout(pools, "prefill_pool", layers, 1, page, pages + 8, tp_rank=0, tp_size=8,
                     kv_heads=8, seed=21)
    dst = mha_layout(pools, "decode_pool", layers, 4, page, pages + 8, tp_rank=0, tp_size=2,
                     kv_heads=8, seed=22)
    rng = np.random.default_rng(23)
    sp = rng.permutation(pages + 8)[:pages].astype(np.int64)
    dp = rng.permutation(pages + 8)[:pages].astype(np.int64)
    return pools, src, dst, sp, dp, None


def page_ratio_request(device: str, quick: bool) -> tuple[
        DevicePools, kvplan.Layout, kvplan.Layout, np.ndarray, np.ndarray, int | None]:
    layers, tokens, heads = (4, 1024, 2) if quick else (16, 4096, 4)
    pools = DevicePools(device)
    src = mha_layout(pools, "prefill_pool", layers, heads, 16, tokens // 16 + 8, tp_rank=0,
                     tp_size=1, kv_heads=heads, seed=31)
    dst = mha_layout(pools, "decode_pool", layers, heads, 64, tokens // 64 + 4, tp_rank=0,
                     tp_size=1, kv_heads=heads, seed=32)
    rng = np.random.default_rng(33)
    sp = rng.permutation(tokens // 16 + 8)[: tokens // 16].astype(np.int64)
    dp = rng.permutation(tokens // 64 + 4)[: tokens // 64].astype(np.int64)
    return pools, src, dst, sp, dp, tokens


BUILDERS = {
    "MLA page 1, fragmented pages": mla_request,
    "GQA TP 8->2 NHD": gqa_request,
    "MHA page 16->64": page_ratio_request,
}


def build(name: str, device: str, quick: bool, target_rounds: int) -> Request:
    pools, src, dst, sp, dp, n_tokens = BUILDERS[name](device, quick)
    template = kvplan.Template(src, dst)
    # Size the arenas from the request so it takes about ``target_rounds`` rounds.
    probe = template.plan_rounds(sp, dp, n_tokens=n_tokens, src_arena=(1 << 40, 1 << 40),
                                 dst_arena=(1 << 44, 1 << 40))
    senders = probe.sender[1]
    buffer = max(4096, -(-probe.bytes // target_rounds))
    buffer = -(-buffer // 4096) * 4096
    src_arena = (pools.add("prefill_arena", 2 * buffer, None), 2 * buffer)
    dst_arena = (pools.add("decode_arena", 2 * buffer * senders, None), 2 * buffer * senders)
    rounds = template.plan_rounds(sp, dp, n_tokens=n_tokens, src_arena=src_arena,
                                  dst_arena=dst_arena, buffers=2)
    return Request(name, pools.tensors, src, dst, sp, dp, n_tokens, rounds)


def host_memory(req: Request, name: str) -> Memory:
    t = req.tensors[name]
    return Memory(t.cpu().numpy().copy(), int(t.data_ptr()))


def references(req: Request, initial: dict[str, Memory]) -> tuple[np.ndarray, np.ndarray]:
    """The decode pool after the NumPy executor ran the same rounds, and after the oracle."""
    src, dst = initial["prefill_pool"], initial["decode_pool"].copy()
    NumpyExecutor(src, dst, src_staging=initial["prefill_arena"].copy(),
                  dst_staging=initial["decode_arena"].copy()).run(req.rounds)
    oracle = initial["decode_pool"].copy()
    reference_copy(req.src_layout, src, req.dst_layout, oracle, req.src_pages, req.dst_pages,
                   n_tokens=req.n_tokens)
    return dst.data, oracle.data


def check(req: Request, numpy_ref: np.ndarray, oracle: np.ndarray, when: str) -> None:
    got = req.tensors["decode_pool"].cpu().numpy()
    for what, want in (("the NumPy executor", numpy_ref), ("the oracle", oracle)):
        bad = np.flatnonzero(got != want)
        if bad.size:
            raise SystemExit(f"{req.name} ({when}): decode pool differs from {what} in "
                             f"{bad.size} bytes, the first at offset {bad[0]}")


def network_copy(req: Request, one: kvplan.StagedRound) -> Callable[[], Any]:
    """The round's one network block as a device copy between the two arena tensors."""
    src_t, dst_t = req.tensors["prefill_arena"], req.tensors["decode_arena"]
    (s,), (d,), (n,) = (np.asarray(c).tolist() for c in (one.network.src_addrs,
                                                        one.network.dst_addrs,
                                                        one.network.lengths))
    a, b = s - int(src_t.data_ptr()), d - int(dst_t.data_ptr())
    src_view, dst_view = src_t[a:a + n], dst_t[b:b + n]
    return lambda: dst_view.copy_(src_view)


def run_all(executor: TorchExecutor, req: Request) -> None:
    for one in req.rounds:
        executor.run(one.gather)
        network_copy(req, one)()
        executor.run(one.scatter)


def timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter_ns()
    fn()
    sync()
    return (time.perf_counter_ns() - t0) / 1e6


def bench(req: Request, executor: TorchExecutor, sync: Callable[[], None], device: str,
          deadline: float, max_reps: int) -> None:
    nbytes_max = req.rounds.buffer_bytes
    scratch_a = torch.empty(nbytes_max, dtype=torch.uint8, device=device)
    scratch_b = torch.empty(nbytes_max, dtype=torch.uint8, device=device)
    n_rounds = len(req.rounds)
    for k, one in enumerate(req.rounds):
        n = one.manifest.bytes
        net = network_copy(req, one)
        a, b = scratch_a[:n], scratch_b[:n]
        gather_ms: list[float] = []
        scatter_ms: list[float] = []
        copy_ms: list[float] = []
        # Each repeat runs the round in order (gather, network, scatter), so the round buffer
        # holds this round's bytes whenever the scatter reads it.
        round_deadline = time.monotonic() + (deadline - time.monotonic()) / (n_rounds - k)
        for _ in range(2):  # untimed: first-call allocations and kernel loads
            executor.run(one.gather)
            net()
            executor.run(one.scatter)
            b.copy_(a)
        for rep in range(max_reps):
            gather_ms.append(timed(lambda: executor.run(one.gather), sync))
            net()
            scatter_ms.append(timed(lambda: executor.run(one.scatter), sync))
            copy_ms.append(timed(lambda: b.copy_(a), sync))
            if rep >= 2 and time.monotonic() > round_deadline:
                break
        g, s, c = (statistics.median(x) for x in (gather_ms, scatter_ms, copy_ms))
        req.rows.append({
            "round": k, "bytes": n, "gather_blocks": int(one.gather.n_blocks),
            "scatter_blocks": int(one.scatter.n_blocks), "repeats": len(gather_ms),
            "gather_ms": g, "scatter_ms": s, "d2d_copy_ms": c,
            "gather_gbps": n / g / 1e6, "scatter_gbps": n / s / 1e6, "d2d_gbps": n / c / 1e6,
        })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu", "npu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="smaller requests, fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run (default 360, 120 with --quick)")
    args = parser.parse_args()
    start = time.monotonic()
    budget = args.budget if args.budget is not None else (120.0 if args.quick else 360.0)
    budget = min(budget, 450.0)  # the run stays well under 8 minutes whatever is asked
    deadline = start + budget
    if args.device == "npu":
        importlib.import_module("torch_npu")  # registers the npu device
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if args.device == "cpu":
        # One thread: a CPU run is a check of the script, and torch's intra-op threads on a
        # shared machine mostly wait on one another.
        torch.set_num_threads(1)
    else:
        module = getattr(torch, args.device)
        if not module.is_available():
            raise SystemExit(f"--device {args.device}: torch reports no {args.device} device")
        sync = module.synchronize
    device_name = (torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    print(f"# torch {torch.__version__} on {device_name}; kvplan {kvplan.__version__}",
          flush=True)
    target_rounds, max_reps = (4, 20) if args.quick else (8, 200)
    results = []
    names = list(BUILDERS)
    for i, name in enumerate(names):
        req = build(name, args.device, args.quick, target_rounds)
        initial = {k: host_memory(req, k) for k in req.tensors}
        numpy_ref, oracle = references(req, initial)
        executor = TorchExecutor(req.tensors)
        run_all(executor, req)
        sync()
        check(req, numpy_ref, oracle, "after one pass")
        case_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(names) - i)
        bench(req, executor, sync, args.device, case_deadline, max_reps)
        check(req, numpy_ref, oracle, "after the timed repeats")
        r = req.rounds
        print(f"\n## {name}: {r.bytes / 2**20:.2f} MiB in {len(r)} rounds of at most "
              f"{r.buffer_bytes / 2**20:.2f} MiB (staged plan: {r.staged_network_blocks} network "
              f"blocks, {r.direct_blocks} direct blocks); decode pool equal to the NumPy "
              "executor's and the oracle's, byte for byte", flush=True)
        print("| round | MiB | gather blocks | scatter blocks | reps | gather ms | GB/s "
              "| scatter ms | GB/s | d2d copy ms | GB/s |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in req.rows:
            print(f"| {row['round']} | {row['bytes'] / 2**20:.2f} | {row['gather_blocks']:,} "
                  f"| {row['scatter_blocks']:,} | {row['repeats']} | {row['gather_ms']:.3f} "
                  f"| {row['gather_gbps']:.1f} | {row['scatter_ms']:.3f} "
                  f"| {row['scatter_gbps']:.1f} | {row['d2d_copy_ms']:.3f} "
                  f"| {row['d2d_gbps']:.1f} |", flush=True)
        results.append({"request": name, "bytes": r.bytes, "rounds": len(r),
                        "buffer_bytes": r.buffer_bytes, "checked": True, "per_round": req.rows})
        del executor, req, initial
    elapsed = time.monotonic() - start
    print(f"\nall decode pools checked; {elapsed:.1f} s (budget {budget:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "device_name": device_name,
                       "torch": torch.__version__, "kvplan": kvplan.__version__,
                       "quick": args.quick, "elapsed_s": elapsed, "requests": results}, f,
                      indent=1)
        print("wrote", os.path.abspath(args.json))


if __name__ == "__main__":
    main()
