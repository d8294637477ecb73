"""Real bytes: SGLang 0.5.23's MooncakeKVManager, patched with kvplan.compat.sglang.install,
drives the real Mooncake engine over TCP loopback into a decode process.

The prefill side runs in its own spawned process (an engine crash costs a child, not pytest):
it maps its arena, registers it with a Mooncake engine, builds a real ``MooncakeKVManager``
instance of the wheel's class (the loader's stand-ins for everything but the planning methods
and the engine), installs kvplan, and calls ``send_kvcache`` and ``_send_mamba_state`` for each
prefill PP stage of a small hybrid model (MLA on two layers, two Mamba state components on the
others). The decode is a :class:`kvplan.testing.PeerProcess`. Every decode byte is then checked
against an oracle that shares no code with kvplan's pairing.

The manager's ``engine`` is either a recording wrapper that forwards SGLang's lists to the
engine, or SGLang's own ``MooncakeTransferEngine`` from the wheel around the real Mooncake engine:
then kvplan hands each batch to Mooncake natively (the plan's columns, no Python lists), or,
with ``KVPLAN_MOONCAKE_NATIVE=0``, through that wrapper's ``batch_transfer_sync`` lists.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import types
from typing import Any

import numpy as np
import pytest

from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
from kvplan.testing import SENTINEL, Arena, PeerProcess, PeerSpec, arena_dir, fill_source

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_HYBRID = ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                          (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))
STATE_ROLES = ("mamba_conv", "mamba_temporal")


def _prefill_main(conn: Any, spec_dict: dict[str, Any], arena_path: str, size: int,
                  decode: dict[str, Any], src_pages: list[int], dst_pages: list[int],
                  src_slot: int, dst_slot: int, wrapper: str) -> None:
    try:
        os.environ.update({"MC_TRANSFER_TIMEOUT": "5", "MC_LOG_LEVEL": "ERROR"})
        if wrapper == "sglang-lists":
            os.environ["KVPLAN_MOONCAKE_NATIVE"] = "0"
        sys.path.insert(0, TESTS_DIR)
        from support.sglang_models import load_loader

        from kvplan.compat import sglang as compat
        from kvplan.engines import MooncakeTransport

        sg = load_loader().load_sglang()
        spec = PeerSpec.from_dict(spec_dict)
        arena = Arena(arena_path, size, create=False)
        transport = MooncakeTransport("127.0.0.1")
        transport.register_buffers([arena.base + e.offset for e in spec.entries],
                                   [e.nbytes for e in spec.entries])

        class Engine:  # what SGLang's MooncakeTransferEngine.batch_transfer_sync does
            calls = 0

            def batch_transfer_sync(self, session: str, src: list[int], dst: list[int],
                                    lengths: list[int]) -> int:
                Engine.calls += 1
                return transport._engine_write(session, src, dst, lengths)

        engine: Any = Engine()
        if wrapper != "recording":  # SGLang's own wrapper around the real Mooncake engine
            engine = object.__new__(load_loader().load_engine_wrapper(sg))
            engine.engine = transport._engine
            engine.hostname = "127.0.0.1"
            engine.session_id = transport.local_session_id()

        pages = [e for e in spec.entries if e.kind == "page"]
        states = {r: [e for e in spec.entries if e.role == r] for r in STATE_ROLES}
        d_pages = [e for e in decode["entries"] if e[2] == "page"]
        kv_args = types.SimpleNamespace(
            kv_data_ptrs=[arena.base + e.offset for e in pages],
            kv_data_lens=[e.nbytes for e in pages], kv_item_lens=[e.item_len for e in pages],
            kv_layer_ids=[e.layer_id for e in pages], prefill_start_layer=0,
            mla_compression_ratios=None, num_draft_entries=0,
            state_data_ptrs=[[arena.base + e.offset for e in states[r]] for r in STATE_ROLES],
            state_data_lens=[[e.nbytes for e in states[r]] for r in STATE_ROLES])
        dst_ptrs = [decode["base"] + e[3] for e in d_pages]
        info = types.SimpleNamespace(dst_kv_ptrs=dst_ptrs, dst_kv_item_lens=[e[4] for e in d_pages],
                                     dst_kv_layer_ids=[e[0] for e in d_pages])
        compat.install(sg.MooncakeKVManager)
        mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=kv_args, engine=engine,
                                is_hybrid_mla_backend=True, pp_size=spec.pp_size,
                                decode_kv_args_table={decode["session"]: info})
        rc = mgr.send_kvcache(decode["session"], np.asarray(src_pages, np.int32), dst_ptrs,
                              np.asarray(dst_pages, np.int32), None,
                              dst_layer_ids=[e[0] for e in d_pages])
        req = types.SimpleNamespace(mooncake_session_id=decode["session"])
        for i, r in enumerate(STATE_ROLES):
            d_state = [e for e in decode["entries"] if e[1] == r]
            rc = rc or mgr._send_mamba_state(
                req, [src_slot], kv_args.state_data_ptrs[i], [e.item_len for e in states[r]],
                [decode["base"] + e[3] for e in d_state], [dst_slot],
                [e.layer_id for e in states[r]], [e[0] for e in d_state],
                [e[4] for e in d_state])
        from kvplan.engines.mooncake import Handoff

        kept = Handoff.kept(engine)
        path = (kept.path, kept.reason) if kept is not None else ("", "")
        transport.close()
        conn.send(("ok", rc, Engine.calls, path))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send(("fail", f"{exc!r}\n{traceback.format_exc()}"))


@pytest.mark.parametrize("wrapper", ["recording", "sglang", "sglang-lists"])
def test_patched_manager_moves_real_bytes_over_mooncake_loopback(wrapper: str) -> None:
    from support.engine_peers import assert_decode_bytes, expected_decode, require_mooncake
    from support.sglang_models import load_sglang_or_fail

    from kvplan.testing import model_peers

    require_mooncake()
    load_sglang_or_fail()  # fetch the wheel here, so a failure is reported by this test
    peers = model_peers(TINY_HYBRID, pages=64, pp_size=2, state_slots=4)
    src_pages = np.arange(5, 45, dtype=np.int64)
    dst_pages = fragmented_pages(40, 1 / 3, seed=7, shuffle_runs=True, capacity=64)
    src_slot, dst_slot = 2, 1
    specs = [peers.decode, *peers.prefill]
    workdir = arena_dir(sum(s.size for s in specs))
    arenas = {s.name: Arena(os.path.join(workdir, s.name), s.size, create=True) for s in specs}
    dpeer = None
    try:
        arenas["decode"].array[:] = SENTINEL
        for i, s in enumerate(peers.prefill):
            fill_source(arenas[s.name], 11 + i)
        before = arenas["decode"].array.copy()
        dpeer = PeerProcess(peers.decode, arenas["decode"])
        decode = {"session": dpeer.session, "base": dpeer.base,
                  "entries": [(e.layer_id, e.role, e.kind, e.offset, e.item_len)
                              for e in peers.decode.entries]}
        ctx = mp.get_context("spawn")
        for s in peers.prefill:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_prefill_main, args=(
                child, s.to_dict(), arenas[s.name].path, s.size, decode, src_pages.tolist(),
                dst_pages.tolist(), src_slot, dst_slot, wrapper), daemon=True)
            proc.start()
            child.close()
            if not parent.poll(120):
                proc.kill()
                pytest.fail(f"prefill {s.name} did not answer in 120 s")
            res = parent.recv()
            proc.join(30)
            assert res[0] == "ok", res[1]
            assert res[1] == 0
            if wrapper == "recording":
                assert res[2] >= 3  # KV batches plus one call per state component
            # SGLang's own wrapper: kvplan hands Mooncake the plan's columns natively, unless
            # disabled; a wrapper whose batch_transfer_sync is not SGLang's always gets lists
            # (and keeps no hand-off).
            assert res[3] == {"sglang": ("native", ""), "recording": ("", ""),
                              "sglang-lists": ("lists", "disabled (KVPLAN_MOONCAKE_NATIVE=0)"),
                              }[wrapper]
        writes = [(s, arenas[s.name].array, src_pages, dst_pages, src_slot, dst_slot)
                  for s in peers.prefill]
        expected = expected_decode(peers.decode, before, writes)
        assert_decode_bytes(arenas["decode"].array, expected, peers.decode)
        assert not np.array_equal(expected, before)
    finally:
        if dpeer is not None:
            dpeer.stop()
        for a in arenas.values():
            a.close()
        shutil.rmtree(workdir, ignore_errors=True)
