"""Per-request descriptor work in vLLM 0.33's NIXL connector vs kvplan's run-merged lists.

Which of vLLM's NIXL per-request steps would kvplan be worth replacing? vLLM prepares both
sides' descriptor tables once per peer (``prep_xfer_dlist``) and sends a request as two index
arrays (``_compute_desc_ids``, vLLM's real function from the wheel) to ``make_prepped_xfer``.
kvplan's alternative is a plan with one descriptor per run contiguous on both sides, handed to
``initialize_xfer`` (``get_xfer_descs`` on both sides). This script times, on two real NIXL
agents (UCX) in one process, DRAM to DRAM, for 61 MLA layers x 512 blocks:

* vLLM's ``_compute_desc_ids`` for both sides;
* ``make_prepped_xfer`` with those ids (vLLM's path), handle released;
* ``Template.plan`` + rows + ``get_xfer_descs`` x 2 + ``initialize_xfer`` (kvplan's path);
* the WRITE of each handle to completion (post and poll), on small blocks so descriptor
  handling, not bandwidth, dominates.

Usage: .venv/bin/python bench/vllm_nixl_request.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

import kvplan  # noqa: E402
from kvplan.engines.nixl.descriptors import descriptor_rows  # noqa: E402
from support import vllm_loader  # noqa: E402

_BW = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
LAYERS = 61
BLOCKS = 512
CAP = 2 * BLOCKS + 8
BLK = 256  # bytes per block: small, so the descriptor count is what is timed


def median_us(fn, repeat):
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def vllm_worker():
    """vLLM's NIXL base worker (wheel code) with the attributes ``_compute_desc_ids`` reads for
    an attention-only model: one region per layer, one KV group."""
    v = vllm_loader.load_vllm()
    mods = vllm_loader._import_real(v.root, "vllm", (_BW,))
    cls = mods[_BW].NixlBaseConnectorWorker
    w = object.__new__(cls)
    w.__dict__.update(_has_mamba=False, _conv_decomp=None, _transfer_layer_group_ids=[],
                      num_regions=LAYERS, block_len_per_layer=[BLK] * LAYERS,
                      region_group_ids=[0] * LAYERS, _uses_region_group_mapping=False)
    return w


def agent(name):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def main():
    quick = "--quick" in sys.argv
    repeat = 5 if quick else 30
    w = vllm_worker()
    src_mem = np.random.default_rng(1).integers(0, 256, LAYERS * CAP * BLK, dtype=np.uint8)
    dst_mem = np.zeros_like(src_mem)
    p, d = agent("kvplan-bench-p"), agent("kvplan-bench-d")
    p.register_memory([(src_mem.ctypes.data, src_mem.nbytes, 0, "")], "DRAM")
    d.register_memory([(dst_mem.ctypes.data, dst_mem.nbytes, 0, "")], "DRAM")
    peer = p.add_remote_agent(d.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    bases_p = [src_mem.ctypes.data + i * CAP * BLK for i in range(LAYERS)]
    bases_d = [dst_mem.ctypes.data + i * CAP * BLK for i in range(LAYERS)]

    def table(bases):  # vLLM's prepped list: region-major, one row per block
        addrs = (np.asarray(bases, dtype=np.uint64)[:, None]
                 + np.arange(CAP, dtype=np.uint64)[None, :] * BLK).ravel()
        return descriptor_rows(addrs, np.full(len(addrs), BLK, np.uint64), 0)

    t0 = time.perf_counter()
    local_h = p.prep_xfer_dlist("NIXL_INIT_AGENT", table(bases_p), "DRAM")
    remote_h = p.prep_xfer_dlist(peer, table(bases_d), "DRAM")
    prep_ms = (time.perf_counter() - t0) * 1e3
    src_l = kvplan.Layout(bases_p, [CAP * BLK] * LAYERS, BLK, list(range(LAYERS)))
    dst_l = kvplan.Layout(bases_d, [CAP * BLK] * LAYERS, BLK, list(range(LAYERS)))
    template = kvplan.Template(src_l, dst_l)

    def run(handle):
        assert p.transfer(handle) in ("PROC", "DONE")
        while (state := p.check_xfer_state(handle)) == "PROC":
            pass
        assert state == "DONE", state
        p.release_xfer_handle(handle)

    print(f"61 MLA layers x {BLOCKS} blocks of {BLK} B, two NIXL agents (UCX) in one process; "
          f"prep_xfer_dlist of {LAYERS * CAP:,} descriptors per side once: {prep_ms:.1f} ms")
    print("| request | path | descriptors | ids / plan (us) | handle (us) | write (us) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(2)
    for label, fragmented in (("contiguous", False), ("100 % fragmented", True)):
        local_ids = list(range(1, BLOCKS + 1))
        remote_ids = (sorted(rng.choice(np.arange(1, CAP, 2), BLOCKS, replace=False).tolist())
                      if fragmented else list(range(1, BLOCKS + 1)))
        meta_ids = (local_ids, remote_ids)
        t_ids = median_us(lambda: [w._compute_desc_ids([ids], CAP, None, 1)
                                   for ids in meta_ids], repeat)
        li, ri = (w._compute_desc_ids([ids], CAP, None, 1) for ids in meta_ids)
        t_handle = median_us(lambda: p.release_xfer_handle(p.make_prepped_xfer(
            "WRITE", local_h, li, remote_h, ri, b"")), repeat)
        t_write = median_us(lambda: run(p.make_prepped_xfer("WRITE", local_h, li, remote_h,
                                                            ri, b"")), repeat)
        print(f"| {label} | vLLM: `_compute_desc_ids` + `make_prepped_xfer` | {len(li):,} | "
              f"{t_ids:.1f} | {t_handle:.1f} | {t_write:.1f} |")
        la, ra = np.asarray(local_ids, np.int64), np.asarray(remote_ids, np.int64)
        t_plan = median_us(lambda: template.plan(la, ra), repeat)
        plan = template.plan(la, ra)

        def handle():
            local = p.get_xfer_descs(descriptor_rows(plan.src_addrs, plan.lengths, 0), "DRAM")
            remote = p.get_xfer_descs(descriptor_rows(plan.dst_addrs, plan.lengths, 0), "DRAM")
            return p.initialize_xfer("WRITE", local, remote, peer, b"")

        t_handle = median_us(lambda: p.release_xfer_handle(handle()), repeat)
        t_write = median_us(lambda: run(handle()), repeat)
        print(f"| {label} | kvplan: `Template.plan` + `initialize_xfer` | {len(plan):,} | "
              f"{t_plan:.1f} | {t_handle:.1f} | {t_write:.1f} |")
        # the bytes of the last write: every block id pair moved
        exp = np.zeros_like(dst_mem)
        for i in range(LAYERS):
            s = src_mem[i * CAP * BLK:(i + 1) * CAP * BLK].reshape(CAP, BLK)
            e = exp[i * CAP * BLK:(i + 1) * CAP * BLK].reshape(CAP, BLK)
            e[ra] = s[la]
        assert np.array_equal(dst_mem, exp), "bytes differ"  # both paths wrote the same map
        dst_mem[:] = 0
    local_h.release() if hasattr(local_h, "release") else p.release_dlist_handle(local_h)
    remote_h.release() if hasattr(remote_h, "release") else p.release_dlist_handle(remote_h)
    return types.SimpleNamespace()


if __name__ == "__main__":
    main()
