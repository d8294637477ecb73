"""``kvplan.copy_local`` on small-block scatters and gathers, against a plain memcpy and numpy.

    .venv/bin/python bench/copy_local_bench.py            # writes bench/results/copy-local.md
    .venv/bin/python bench/copy_local_bench.py --quick    # fewer repeats, prints only
    .venv/bin/python bench/copy_local_bench.py --label before --quick   # any build of kvplan

Cases (the small-block local halves of a staged plan, planned by ``Template.plan_staged``):

- **MLA page 1 scatter**: 61 layers, 576-byte rows, 4096 tokens, decode pages 100 % apart
  (249,856 blocks from the decode staging region into the decode's KV pool);
- **MLA page 1 gather**: the same request seen from a prefill whose pages are 100 % apart;
- **GQA TP 8 -> 2 NHD scatter**: 8 KV heads x 128 bf16, 32 layers, page 16, 4096 tokens, one
  prefill writer's head slice of 256 bytes per token (262,144 blocks).

Variants, sampled in turn in one process so that machine noise hits each alike:

- ``threads=1``: one thread (the copier as it ran before it could use several);
- ``threads=None``: the default (``min(available cores, 4)``, one for a small plan);
- ``numpy rows``: ``dst_rows[dst_idx] = src_rows[src_idx]`` over the blocks as fixed-size rows
  (the fancy-index copy a Python executor would do; indices precomputed, not timed);
- ``memcpy``: one contiguous copy of the same bytes (``np.copyto``), the ceiling.

Reported per variant: median and minimum ms and GB/s of the copied bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from harness.machine import describe
from harness.results import RESULTS_DIR, write_lines

import kvplan
from kvplan.presets import fragmented_pages


@dataclasses.dataclass
class Case:
    name: str
    plan: kvplan.TransferPlan
    src: np.ndarray
    dst: np.ndarray

    @property
    def bytes(self) -> int:
        return int(self.plan.total_bytes)


def _mla(gather: bool, tokens: int = 4096, layers: int = 61, item: int = 576) -> Case:
    capacity = 2 * tokens + 2
    span = capacity * item
    arena = np.random.default_rng(1).integers(0, 256, layers * span, dtype=np.uint8)
    other = np.zeros(layers * span, np.uint8)
    staging = np.zeros(tokens * layers * item, np.uint8)

    def layout(buf: np.ndarray) -> kvplan.Layout:
        base = buf.ctypes.data
        return kvplan.Layout.mla([base + i * span for i in range(layers)], [span] * layers,
                                 item, layer_ids=list(range(layers)), page_size=1)

    apart = fragmented_pages(tokens, 1.0, seed=7, shuffle_runs=True, capacity=capacity)
    together = np.arange(tokens, dtype=np.int64)
    if gather:
        template = kvplan.Template(layout(arena), layout(other))
        plan = template.plan_staged(apart, together,
                                    src_staging=(staging.ctypes.data, staging.size),
                                    dst_staging=(1 << 44, staging.size))
        return Case("MLA page 1 gather, 100 % apart", plan.gather, arena, staging)
    staging[:] = np.random.default_rng(2).integers(0, 256, staging.size, dtype=np.uint8)
    template = kvplan.Template(layout(other), layout(arena))
    plan = template.plan_staged(together, apart, src_staging=(1 << 44, staging.size),
                                dst_staging=(staging.ctypes.data, staging.size))
    return Case("MLA page 1 scatter, 100 % apart", plan.scatter, staging, arena)


def _gqa(tokens: int = 4096, layers: int = 32, heads: int = 8, page: int = 16) -> Case:
    head_dim, dtype = 128, 2
    pages = -(-tokens // page)
    capacity = 2 * pages + 2

    def layout(buf: np.ndarray, tp: int) -> kvplan.Layout:
        item = page * max(1, heads // tp) * head_dim * dtype
        span = item * capacity
        base = buf.ctypes.data
        ptrs = [base + e * span for e in range(2 * layers)]
        return kvplan.Layout.mha(ptrs[:layers], ptrs[layers:], [span] * layers,
                                 [span] * layers, item, item, layer_ids=list(range(layers)),
                                 page_size=page, tp_rank=0, tp_size=tp, kv_heads=heads,
                                 head_dim=head_dim, dtype_size=dtype, memory_order="NHD")

    d_bytes = 2 * layers * capacity * page * (heads // 2) * head_dim * dtype
    p_bytes = 2 * layers * capacity * page * (heads // 8) * head_dim * dtype
    decode = np.zeros(d_bytes, np.uint8)
    prefill = np.zeros(p_bytes, np.uint8)
    # the decode staging region holds the shares of all 4 writers of decode rank 0
    staging_bytes = 4 * 2 * layers * pages * page * head_dim * dtype
    staging = np.random.default_rng(3).integers(0, 256, staging_bytes, dtype=np.uint8)
    template = kvplan.Template(layout(prefill, 8), layout(decode, 2))
    dst_pages = fragmented_pages(pages, 1.0, seed=7, shuffle_runs=True, capacity=capacity)
    plan = template.plan_staged(np.arange(pages), dst_pages,
                                src_staging=(1 << 44, staging_bytes),
                                dst_staging=(staging.ctypes.data, staging_bytes))
    return Case("GQA TP 8 -> 2 NHD scatter, 256-byte slices", plan.scatter, staging, decode)


def _numpy_rows(case: Case) -> Callable[[], None] | None:
    """The blocks as rows of one size, or None when they are not (no numpy peer then)."""
    lengths = case.plan.lengths
    size = int(lengths[0])
    s_off = case.plan.src_addrs - np.uint64(case.src.ctypes.data)
    d_off = case.plan.dst_addrs - np.uint64(case.dst.ctypes.data)
    if (lengths != size).any() or (s_off % size).any() or (d_off % size).any():
        return None
    src_rows = case.src[:case.src.size // size * size].reshape(-1, size)
    dst_rows = case.dst[:case.dst.size // size * size].reshape(-1, size)
    s_idx, d_idx = (s_off // size).astype(np.intp), (d_off // size).astype(np.intp)

    def run() -> None:
        dst_rows[d_idx] = src_rows[s_idx]

    return run


def variants(case: Case) -> dict[str, Callable[[], object]]:
    takes_threads = "threads" in (inspect.signature(kvplan.copy_local).parameters
                                  if _has_signature() else {})
    out: dict[str, Callable[[], object]] = {}
    if takes_threads:
        out["threads=1"] = lambda: kvplan.copy_local(case.plan, [case.src], [case.dst],
                                                     threads=1)
        out["threads=None"] = lambda: kvplan.copy_local(case.plan, [case.src], [case.dst])
    else:
        out["copy_local"] = lambda: kvplan.copy_local(case.plan, [case.src], [case.dst])
    rows = _numpy_rows(case)
    if rows is not None:
        out["numpy rows"] = rows
    flat_src = case.src[:case.bytes]
    flat_dst = np.empty_like(flat_src)
    out["memcpy"] = lambda: np.copyto(flat_dst, flat_src)
    return out


def _has_signature() -> bool:
    try:
        inspect.signature(kvplan.copy_local)
    except (TypeError, ValueError):
        return False
    return True


def measure(case: Case, repeats: int) -> dict[str, list[float]]:
    runs = variants(case)
    for fn in runs.values():  # warm-up: page in every buffer once
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats, print only")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--label", default="", help="a name for this build in the output")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    repeats = 5 if args.quick else args.repeats
    lines = [f"### copy_local {args.label}".rstrip(), "",
             f"cores available to this process: {len(os.sched_getaffinity(0))}; "
             f"{repeats} interleaved repeats", "",
             "| case | blocks | MiB | variant | median ms | median GB/s | min ms | max GB/s |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for case in (_mla(False), _mla(True), _gqa()):
        times = measure(case, repeats)
        for name, ts in times.items():
            med, low = statistics.median(ts), min(ts)
            lines.append(f"| {case.name} | {len(case.plan)} | {case.bytes / 2**20:.0f} | {name} "
                         f"| {med * 1e3:.1f} | {case.bytes / med / 1e9:.2f} | {low * 1e3:.1f} "
                         f"| {case.bytes / low / 1e9:.2f} |")
    print("\n".join(lines))
    if not args.quick:
        head = ["# kvplan.copy_local: small-block copies", "", *describe(load, kvplan.__version__),
                ""]
        print("wrote", write_lines(RESULTS_DIR, "copy-local.md", head + lines))


if __name__ == "__main__":
    main()
