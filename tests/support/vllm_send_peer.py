"""A prefill process running vLLM 0.33's Mooncake sender with kvplan installed, over a real
Mooncake ``TransferEngine`` (TCP on 127.0.0.1).

:func:`prefill_main` is the spawn target: it owns the engine and registers its arena, then for
one deployment (``deployment()``) builds vLLM's worker (wheel code, ``object.__new__`` as the
differential tests do) with its regions in the arena and the decode's regions at the decode
process's addresses, lets vLLM's own ``_prepare_transfer_regions`` align them, plans the batch
with the patched ``_build_transfer_params`` and sends it with the patched ``_send_blocks``
(Mooncake's native batch API, or ``engine.batch_transfer_sync_write`` with
``KVPLAN_MOONCAKE_NATIVE=0``). It answers with the send status and,
for the parent's byte oracle, vLLM's unpatched plan of the same batch.
"""

from __future__ import annotations

import os
import types
from typing import Any

# (name, kind, layers, prefill tp, prefill rank, decode tp, kv heads, head bytes, blocks)
DEPLOYMENTS = {
    "mla": ("mla", 6, 1, 0, 1, 1, 576, 96),
    "mha_tp2_to_tp1": ("mha", 4, 2, 1, 1, 4, 64, 64),
}
TOKENS_PER_BLOCK = 16
ALIGN = 4096


def registration(kind: str, layers: int, heads: int, head_bytes: int, blocks: int,
                 base: int) -> tuple[list[tuple], list[tuple[int, int]], int]:
    """Regions (as vLLM's ``register_kv_caches`` records them) and buffers of one side packed
    from ``base``; returns them and the bytes used."""
    regions, buffers = [], []
    off = 0
    for layer in range(layers):
        name = f"model.layers.{layer}.self_attn.attn"
        block = head_bytes if kind == "mla" else TOKENS_PER_BLOCK * heads * head_bytes
        for _ in range(1 if kind == "mla" else 2):  # MHA: K buffer then V buffer
            regions.append((base + off, block, block, name, layer, 0))
            buffers.append((base + off, blocks * block))
            off += -(-blocks * block // ALIGN) * ALIGN
    return regions, buffers, off


def arena_bytes(name: str) -> int:
    kind, layers, p_tp, _, d_tp, heads, head_bytes, blocks = DEPLOYMENTS[name]
    p = registration(kind, layers, max(1, heads // p_tp), head_bytes, blocks, 0)[2]
    d = registration(kind, layers, max(1, heads // d_tp), head_bytes, blocks, 0)[2]
    return max(p, d)


def requests(blocks: int, mix: str = "default") -> tuple[dict, list]:
    """A batch: a contiguous request, a fragmented one, and a partial prefix hit; their decode
    blocks are disjoint, as a decode allocates them (two requests writing one decode block are
    refused by kvplan's batch plan).

    ``mix="mixed"``: two fragmented requests around a contiguous one, so that the planned
    lengths column starts and ends with one-block runs and holds longer runs between (a
    column whose first and last lengths are equal but not all are)."""
    import random

    rng = random.Random(5)
    if mix == "mixed":
        # the batch is ordered by first decode block: fragmented requests below and above
        # the contiguous one
        local = rng.sample(range(1, blocks - 30), 32)
        shapes = [("frag_a", local[:16], rng.sample(range(1, 20), 16)),
                  ("contig", list(range(blocks - 30, blocks - 6)), list(range(20, 44))),
                  ("frag_b", local[16:], rng.sample(range(44, 64), 16))]
    else:
        shapes = [("contig", list(range(3, 3 + 24)), list(range(40, 64))),
                  ("frag", rng.sample(range(1, blocks), 20), rng.sample(range(9, 40), 20)),
                  ("prefix", list(range(blocks - 14, blocks - 2)), list(range(1, 9)))]  # local longer: tail sent
    req_blocks, ready = {}, []
    for name, local, remote in shapes:
        req_blocks[name] = (f"t-{name}", [remote])
        ready.append((name, types.SimpleNamespace(local_block_ids=[local])))
    return req_blocks, ready


def prefill_main(conn: Any, arena_path: str, size: int, env: dict[str, str],
                 deployment: str, max_blocks_per_batch: int, mix: str = "default") -> None:
    os.environ.update(env)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    try:
        from kvplan.compat import vllm as compat
        from kvplan.engines import MooncakeTransport
        from kvplan.testing import Arena
        from support.vllm_cases import make_worker, run_coroutine, xfer_meta
        from support.vllm_loader import load_vllm

        arena = Arena(arena_path, size, create=False)
        transport = MooncakeTransport("127.0.0.1")
        transport.register_buffers([arena.base], [size])
        conn.send(("ok", arena.base))
        decode_session, decode_base = conn.recv()

        v = load_vllm()
        cls = type("LoopbackWorker", (v.MooncakeConnectorWorker,), {})
        compat.install(cls, max_blocks_per_batch=max_blocks_per_batch)
        kind, layers, p_tp, p_rank, d_tp, heads, head_bytes, blocks = DEPLOYMENTS[deployment]
        spec_cls = v.kvi.MLAAttentionSpec if kind == "mla" else v.kvi.FullAttentionSpec
        names = {f"model.layers.{i}.self_attn.attn": 0 for i in range(layers)}

        def worker(wcls, tp, rank, base, engine=None):
            regions, buffers, _ = registration(kind, layers, max(1, heads // tp), head_bytes,
                                               blocks, base)
            spec = spec_cls(block_size=TOKENS_PER_BLOCK, num_kv_heads=max(1, heads // tp),
                            head_size=head_bytes, dtype=None, state_content_bytes=head_bytes)
            return make_worker(v, wcls, tp_rank=rank, tp_size=tp, use_mla=kind == "mla",
                               total_kv_heads=heads, group_specs=[spec], layer_groups=names,
                               regions=regions, buffers=buffers, num_blocks=blocks,
                               engine=engine)

        prefill = worker(cls, p_tp, p_rank, arena.base, transport._engine)
        # as vLLM's __init__ records them after initialize: the worker's own session
        prefill.hostname = "127.0.0.1"
        prefill.rpc_port = transport._engine.get_rpc_port()
        d_rank = prefill.transfer_topo.handshake_target_ranks(d_tp)[0]
        decode = worker(v.MooncakeConnectorWorker, d_tp, d_rank, decode_base)
        req_blocks, ready = requests(blocks, mix)
        meta = xfer_meta(decode, tp_rank=d_rank, tp_size=d_tp, pp_size=1, req_blocks=req_blocks)
        local, remote, err = prefill._prepare_transfer_regions(meta)
        assert err is None, err
        ref = run_coroutine(v.MooncakeConnectorWorker._build_transfer_params(
            prefill, ready, meta, local, remote))
        src, dst, lengths, err_reqs, _ = run_coroutine(
            cls._build_transfer_params(prefill, ready, meta, local, remote))
        assert not err_reqs and not ref[3], (err_reqs, ref[3])
        status = prefill._send_blocks(decode_session, src, dst, lengths)
        conn.send(("ok", {"status": status, "descriptors": len(src),
                          "lengths": [int(n) for n in lengths],
                          "ref": [[int(x) for x in col] for col in ref[:3]],
                          "stats": prefill.xfer_stats.ok, "failed": prefill.xfer_stats.failed,
                          "handoff": compat.handoff(prefill)}))
        conn.recv()  # keep the engine up until the parent has read the decode's bytes
        transport.close()
    except BaseException as exc:  # report instead of dying silently
        import traceback

        conn.send(("fail", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
