"""vLLM's NIXL ``_compute_desc_ids`` vs the one ``kvplan.compat.vllm.install`` puts in its place.

Both run in one process on the same worker object (vLLM's real worker class from the wheel,
built with ``__new__`` and the attributes the method reads), interleaved: each repetition times
vLLM's method and the installed one back to back, alternating which goes first, so drift on a
shared machine hits both alike. Reported per case: the median and the minimum of each, the
ratio of medians and the ratio of minimums (vLLM / kvplan). Every case first checks that both
return the same array (dtype, shape, values).

Usage: .venv/bin/python bench/vllm_nixl_desc_ids.py [--quick] [--repeat N]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from support.vllm_loader import load_vllm_nixl  # noqa: E402

from kvplan.compat import vllm as compat  # noqa: E402


def worker(cls, **attrs):
    w = object.__new__(cls)
    w.__dict__.update(dict(_has_mamba=False, _conv_decomp=None, _transfer_layer_group_ids=(),
                           num_regions=0, block_len_per_layer=[], region_group_ids=[],
                           _uses_region_group_mapping=False) | attrs)
    return w


def cases(cls):
    rng = np.random.default_rng(7)
    n_blocks = 4096

    def frag(n, cap=n_blocks):
        return sorted(rng.choice(cap, n, replace=False).tolist())

    mla = dict(num_regions=61, block_len_per_layer=[1] * 61, region_group_ids=[0] * 61)
    # an HMA model (full attention + sliding window), 48 layers, K and V regions per layer
    hma_groups = [0, 1] * 48
    hma = dict(num_regions=96, block_len_per_layer=[1] * 96, region_group_ids=hma_groups,
               _uses_region_group_mapping=True)
    routed = dict(num_regions=61, block_len_per_layer=[1] * 61,
                  _transfer_layer_group_ids=tuple([0, 1] * 30 + [0]))
    yield ("61 MLA layers, 8 blocks (small request)", worker(cls, **mla),
           dict(block_ids=[list(range(1, 9))], dst_num_blocks=n_blocks, block_size_ratio=None,
                physical_blocks_per_logical=1))
    yield ("61 MLA layers, 512 blocks contiguous", worker(cls, **mla),
           dict(block_ids=[list(range(1, 513))], dst_num_blocks=n_blocks,
                block_size_ratio=None, physical_blocks_per_logical=1))
    yield ("61 MLA layers, 512 blocks fragmented, local ratio 2", worker(cls, **mla),
           dict(block_ids=[frag(512, 2 * n_blocks)], dst_num_blocks=n_blocks,
                block_size_ratio=2, physical_blocks_per_logical=1,
                region_num_blocks=[n_blocks] * 61))
    yield ("HMA 96 regions in 2 groups, 1,024 + 128 blocks", worker(cls, **hma),
           dict(block_ids=[frag(1024), frag(128)], dst_num_blocks=n_blocks,
                block_size_ratio=None, physical_blocks_per_logical=1))
    yield ("layer-routed 61 layers, 2 groups, 512 + 64 blocks", worker(cls, **routed),
           dict(block_ids=[frag(512), frag(64)], dst_num_blocks=n_blocks,
                block_size_ratio=None, physical_blocks_per_logical=1,
                region_num_blocks=[n_blocks] * 61))


def main() -> None:
    quick = "--quick" in sys.argv
    repeat = 30 if quick else 300
    if "--repeat" in sys.argv:
        repeat = int(sys.argv[sys.argv.index("--repeat") + 1])
    nixl = load_vllm_nixl()
    cls = nixl.NixlConnectorWorker
    vllm_fn = nixl.NixlBaseConnectorWorker.__dict__["_compute_desc_ids"]
    compat.install(cls)
    try:
        print(f"vLLM {nixl.version}, {repeat} interleaved repetitions per case (µs)")
        print("| case | ids | vLLM median | kvplan median | vLLM min | kvplan min "
              "| median ratio | min/min |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, w, kwargs in cases(cls):
            want = vllm_fn(w, **kwargs)
            got = w._compute_desc_ids(**kwargs)
            assert got.dtype == want.dtype and np.array_equal(got, want), label
            ours, theirs = [], []
            for i in range(repeat):
                pair = ((theirs, lambda: vllm_fn(w, **kwargs)),
                        (ours, lambda: w._compute_desc_ids(**kwargs)))
                for samples, fn in (pair if i % 2 == 0 else pair[::-1]):
                    t = time.perf_counter()
                    fn()
                    samples.append((time.perf_counter() - t) * 1e6)
            mv, mk = statistics.median(theirs), statistics.median(ours)
            nv, nk = min(theirs), min(ours)
            print(f"| {label} | {len(want):,} | {mv:.1f} | {mk:.1f} | {nv:.1f} | {nk:.1f} "
                  f"| {mv / mk:.1f}× | {nv / nk:.1f}× |")
    finally:
        compat.uninstall(cls)


if __name__ == "__main__":
    main()
