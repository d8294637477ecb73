"""Per-request planning time: vLLM 0.33.0's MooncakeConnectorWorker._build_transfer_params vs
kvplan.compat.vllm's replacement, on the same worker, regions and requests.

Both run vLLM's real code from its wheel (tests/support/vllm_loader.py); the regions come from
vLLM's own _prepare_transfer_regions. Usage: .venv/bin/python bench/vllm_dropin.py [--quick]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from support.vllm_cases import make_worker, run_coroutine, xfer_meta  # noqa: E402
from support.vllm_loader import load_vllm  # noqa: E402

from kvplan.compat import vllm as compat  # noqa: E402


def scenario(v, cls, n_layers, n_blocks, fragmented_share, seed=0):
    """MLA, one packed buffer per layer (576 x 2 bytes x 16 tokens per block), TP 1 -> 1."""
    rng = random.Random(seed)
    kvi = v.kvi
    blk = 18432
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

    p_regs, p_bufs = reg(1 << 32)
    d_regs, d_bufs = reg(1 << 40)
    kw = dict(tp_rank=0, tp_size=1, use_mla=True, total_kv_heads=1, group_specs=[spec],
              layer_groups={n: 0 for n in names}, num_blocks=cap)
    prefill = make_worker(v, cls, regions=p_regs, buffers=p_bufs, **kw)
    decode = make_worker(v, v.MooncakeConnectorWorker, regions=d_regs, buffers=d_bufs, **kw)
    # local pages consecutive; a share of the decode pages breaks the run
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


def timeit(fn, repeat):
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples), out


def breakdown(v, w, meta, ready, lr, rr, t_total, repeat):
    """Where the patched method's time goes for one request: converting vLLM's two lists of
    block ids to int64 arrays, the core's plan, and the rest (vLLM's rules, the template
    lookup, the output columns)."""
    import numpy as np

    peer = compat._templates(w, meta, lr, rr, v.mc)
    template = peer.groups[0][2]
    local = ready[0][1].local_block_ids[0]
    remote = meta.req_blocks[ready[0][0]][1][0]
    t_ids, _ = timeit(lambda: (compat._ids(local), compat._ids(remote)), repeat)
    la, ra = compat._ids(local), compat._ids(remote)
    t_plan, _ = timeit(lambda: template.plan(la, ra), repeat)
    t_floor, _ = timeit(lambda: np.fromiter(local, np.int64, len(local)), repeat)
    print(f"    of which: block ids to arrays {t_ids * 1e6:.1f} us ({len(local)} + "
          f"{len(remote)} ids; one np.fromiter {t_floor * 1e6:.1f} us), Template.plan "
          f"{t_plan * 1e6:.1f} us, the rest {(t_total - t_ids - t_plan) * 1e6:.1f} us",
          flush=True)


def main():
    quick = "--quick" in sys.argv
    v = load_vllm()
    cls = type("KvplanWorker", (v.MooncakeConnectorWorker,), {})
    compat.install(cls)
    rows = []
    cases = [("61 x 512, contiguous", 61, 512, 0.0), ("61 x 512, 5 % fragmented", 61, 512, 0.05),
             ("61 x 512, 100 % fragmented", 61, 512, 1.0),
             ("188 x 2,048, 100 % fragmented", 188, 2048, 1.0)]
    for label, layers, blocks, frag in cases:
        w, meta, ready, lr, rr = scenario(v, cls, layers, blocks, frag)
        slow = 188 * 2048 <= layers * blocks and frag > 0.5
        n_ref = 1 if (quick or slow) else 5
        t_ref, ref = timeit(lambda: run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
            w, ready, meta, lr, rr)), n_ref)
        run_coroutine(cls._build_transfer_params(w, ready, meta, lr, rr))  # build the template
        t_new, new = timeit(lambda: run_coroutine(cls._build_transfer_params(
            w, ready, meta, lr, rr)), 20 if quick else 200)
        rows.append((label, len(ref[0]), len(new[0]), t_ref, t_new))
        print(f"{label:32s} vLLM {len(ref[0]):>7} desc {t_ref * 1e3:10.3f} ms | kvplan "
              f"{len(new[0]):>7} desc {t_new * 1e6:10.1f} us | x{t_ref / t_new:,.0f}", flush=True)
        if frag == 0.0:
            breakdown(v, w, meta, ready, lr, rr, t_new, 20 if quick else 2000)
    return rows


if __name__ == "__main__":
    main()
