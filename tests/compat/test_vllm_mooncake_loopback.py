"""Real bytes through vLLM 0.33's Mooncake sender with kvplan installed.

Two processes over Mooncake's TCP transport on 127.0.0.1: a decode peer (kvplan's testing peer,
its arena registered, sentinel-filled) and a prefill process (``support.vllm_send_peer``)
running vLLM's worker code from the wheel with ``kvplan.compat.vllm`` installed, so the batch is
planned by the patched ``_build_transfer_params`` and written by the patched ``_send_blocks``
in several batches: through Mooncake's native batch API (the engine is vLLM's real
``mooncake.engine.TransferEngine``), and with ``KVPLAN_MOONCAKE_NATIVE=0`` through the
binding's ``batch_transfer_sync_write`` lists. The oracle is vLLM's own
unpatched plan of the same batch applied to the decode's bytes before the transfer with numpy:
every byte of the decode arena must match it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil

import numpy as np
import pytest

from kvplan.testing import SENTINEL, Arena, PeerProcess, PeerSpec, arena_dir, fill_source
from kvplan.testing.peers import ENGINE_ENV
from kvplan.testing.specs import Entry
from support.engine_peers import require_mooncake
from support.vllm_send_peer import arena_bytes, prefill_main


def _reply(conn, proc, timeout=120.0):
    if not conn.poll(timeout):
        raise AssertionError(f"prefill process gave no answer (alive: {proc.is_alive()})")
    kind, payload = conn.recv()
    assert kind == "ok", payload
    return payload


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "lists"])
@pytest.mark.parametrize("deployment,batch,mix", [("mla", 64, "default"),
                                                  ("mha_tp2_to_tp1", 100, "default"),
                                                  ("mla", 64, "mixed")])
def test_patched_send_path_moves_vllms_bytes(deployment, batch, mix, native):
    require_mooncake()
    size = arena_bytes(deployment)
    workdir = arena_dir(2 * size)
    decode_arena = Arena(os.path.join(workdir, "decode"), size, create=True)
    prefill_arena = Arena(os.path.join(workdir, "prefill"), size, create=True)
    decode_arena.array[:] = SENTINEL
    fill_source(prefill_arena, 11)
    spec = PeerSpec("decode", "raw", (Entry(0, "kv", "page", 0, size, 1),), 1)
    decode = PeerProcess(spec, decode_arena, engine="mooncake")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, daemon=True,
                       args=(child, prefill_arena.path, size,
                             {**ENGINE_ENV, "KVPLAN_MOONCAKE_NATIVE": native}, deployment,
                             batch, mix))
    try:
        proc.start()
        child.close()
        p0 = _reply(conn, proc)  # the prefill arena's address in the prefill process
        before = decode_arena.array.copy()
        conn.send((decode.session, decode.base))
        out = _reply(conn, proc)
        assert out["status"] == 0
        # the engine is vLLM's real Mooncake engine: the native hand-off is taken unless it
        # is turned off, and then the list path says why
        if native == "1":
            assert tuple(out["handoff"]) == ("native", "")
        else:
            assert tuple(out["handoff"]) == ("lists", "disabled (KVPLAN_MOONCAKE_NATIVE=0)")
        src, dst, lengths = (np.array(c, dtype=np.int64) for c in out["ref"])
        if mix == "mixed":
            # the shape that a hand-off deciding "all lengths equal" from the first and last
            # length alone would send with one length for every block
            sent = out["lengths"]
            assert len(sent) >= 64 and sent[0] == sent[-1] and len(set(sent)) > 1, sent
        assert out["descriptors"] <= len(src) and len(src) > 0
        # several engine calls of at most `batch` entries, one stats record of the whole send
        assert out["failed"] == 0 and len(out["stats"]) == 1
        assert out["stats"][0]["num_descs"] == out["descriptors"] > batch
        assert out["stats"][0]["total_bytes"] == int(lengths.sum())
        # oracle: vLLM's own plan of the batch, applied with numpy
        prefill_bytes = prefill_arena.array
        expected = before.copy()
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
            expected[d - decode.base:d - decode.base + n] = prefill_bytes[s - p0:s - p0 + n]
        got = decode_arena.array
        bad = np.flatnonzero(got != expected)
        assert bad.size == 0, f"{bad.size} wrong bytes, first at offset {int(bad[0])}"
        assert np.count_nonzero(got != SENTINEL) > 0.9 * int(lengths.sum())
        conn.send("done")
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        decode.stop()
        decode_arena.close()
        prefill_arena.close()
        shutil.rmtree(workdir, ignore_errors=True)

