"""Content digest of a realistic request vs one memcpy of the same bytes, same machine, same
run: DeepSeek-V3 (61 MLA layers, 1,152 bytes per token per layer), page size 64, a 4,096-token
request on fragmented pages. The digest reads the plan's blocks in place (kvplan's
TransferPlan.content_digest); the memcpy is one numpy copy of the same number of bytes into a
warm buffer. Medians of REPEATS runs each, interleaved.

    .venv/bin/python bench/digest_bench.py
"""

from __future__ import annotations

import platform
import statistics
import time

import numpy as np

import kvplan
from kvplan.presets import fragmented_pages

LAYERS, TOKEN_BYTES, PAGE, TOKENS, CAPACITY, REPEATS = 61, 1152, 64, 4096, 96, 7


def main() -> None:
    item = TOKEN_BYTES * PAGE
    entry = CAPACITY * item
    src = np.random.default_rng(0).integers(0, 256, LAYERS * entry, dtype=np.uint8)
    ptrs = [src.ctypes.data + layer * entry for layer in range(LAYERS)]
    layout = kvplan.Layout.mla(ptrs, [entry] * LAYERS, item, layer_ids=list(range(LAYERS)),
                               page_size=PAGE)
    n = TOKENS // PAGE
    # Half the pages start a new run (fragmentation 0.5), as a decode free list hands them out.
    pages = np.asarray(fragmented_pages(n, 0.5, seed=1, capacity=CAPACITY), dtype=np.int64)
    assert pages.max() < CAPACITY
    plan = kvplan.Template(layout, layout).plan(pages, pages)
    nbytes = plan.total_bytes
    a = np.empty(nbytes, np.uint8)
    flat = src[:nbytes]
    a[:] = flat  # warm the destination
    plan.content_digest("src", [src])  # warm the source pages
    digest_s, copy_s = [], []
    for _ in range(REPEATS):
        t = time.perf_counter()
        plan.content_digest("src", [src])
        digest_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(a, flat)
        copy_s.append(time.perf_counter() - t)
    d, c = statistics.median(digest_s), statistics.median(copy_s)
    gb = nbytes / 1e9
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python "
          f"{platform.python_version()}")
    print(f"request: {LAYERS} layers x {n} pages of {item} B, {plan.n_blocks} blocks, "
          f"{nbytes / 2**20:.1f} MiB moved")
    print(f"content digest: median {d * 1e3:.2f} ms ({gb / d:.2f} GB/s)")
    print(f"memcpy (numpy copyto into a warm buffer): median {c * 1e3:.2f} ms ({gb / c:.2f} GB/s)")
    print(f"digest / memcpy: {d / c:.2f} ({'meets' if d <= c else 'misses'} the target digest <= memcpy)")


if __name__ == "__main__":
    main()
