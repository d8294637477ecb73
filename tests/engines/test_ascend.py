"""Ascend (memfabric) adapter, tested in three layers because no NPU is available here.

1. **Signatures.** ``tests/support/fixtures/memfabric_signatures.json`` records the pybind11 signatures
   of ``memfabric_hybrid.TransferEngine`` (1.3.0). When memfabric is installed, the installed
   package's docstrings are parsed and compared with the fixture (skipped, with the reason
   printed by ``-ra``, only when memfabric cannot be imported). Independently of memfabric,
   every call the adapter makes is bound against the fixture's signatures and its argument
   types are checked against the annotations.
2. **Real uninitialised engine** (in a subprocess, so nothing can take pytest down): the
   adapter's calls are accepted by the real binding (``-1``, no crash), wrongly typed arguments
   raise ``TypeError``, and ``initialize`` without an NPU becomes ``TransferError``.
3. **Copying stand-in** with the exact signatures: ``batch_transfer_sync_write`` validates like
   memfabric (whole batch first) and then ``ctypes.memmove``s, so a hybrid PP=2 -> PP=1 transfer
   can be checked byte for byte in one process.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from support.memfabric_standins import (
    ADAPTER_METHODS,
    FIXTURE,
    INVALID_PARAM,
    FixtureEngine,
    StandInMemfabric,
    fixture,
    plan_batch,
)

from kvplan.engines import AscendTransport, TransferError


# ---------------------------------------------------------------------------------------------
# Docstring parsing (pybind11: "name(self: T, a: A, b: B = default) -> R")
# ---------------------------------------------------------------------------------------------

def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside (), [], <> (pybind11 defaults look like ``<Enum.X: 1>``)."""
    parts: list[str] = []
    cur: list[str] = []
    depth = i = 0
    while i < len(text):
        ch = text[i]
        if ch in "([<":
            depth += 1
        elif ch in ")]>" and not (ch == ">" and i > 0 and text[i - 1] == "-"):
            depth -= 1
        if depth == 0 and text.startswith(sep, i):
            parts.append("".join(cur))
            cur, i = [], i + len(sep)
            continue
        cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_signature(doc: str) -> dict[str, Any]:
    """``{"params": [[name, type, default-or-null], ...], "returns": type}`` (``self`` dropped)."""
    first = doc.strip().splitlines()[0]
    m = re.match(r"^\w+\((.*)\)\s*->\s*(.+)$", first)
    if not m:
        raise ValueError(f"not a pybind11 signature: {first!r}")
    params = []
    for part in _split_top(m.group(1), ","):
        name, _, rest = part.partition(":")
        pieces = _split_top(rest, " = ")
        typ = pieces[0].strip()
        default = pieces[1].strip() if len(pieces) > 1 else None
        if name.strip() != "self":
            params.append([name.strip(), typ, default])
    return {"params": params, "returns": m.group(2).strip()}


def installed_signatures() -> dict[str, Any]:
    """Signatures of every public ``memfabric_hybrid.TransferEngine`` method, from docstrings."""
    import memfabric_hybrid
    from importlib.metadata import version

    engine = memfabric_hybrid.TransferEngine
    methods = {}
    for name in sorted(dir(engine)):
        attr = getattr(engine, name)
        if name.startswith("_") or not callable(attr) or isinstance(attr, type):
            continue
        methods[name] = parse_signature(attr.__doc__ or "")
    return {"package": "memfabric-hybrid", "version": version("memfabric-hybrid"),
            "class": "memfabric_hybrid.TransferEngine", "methods": methods}



# ---------------------------------------------------------------------------------------------
# Layer 1: signatures
# ---------------------------------------------------------------------------------------------

def test_parser_handles_pybind11_enum_defaults() -> None:
    doc = ("initialize(self: _pymf_transfer.TransferEngine, store_url: str, device_id: "
           "typing.SupportsInt, data_op_type: _pymf_transfer.TransDataOpType = "
           "<TransDataOpType.SDMA: 1>, nic: str = '') -> int\n\nmore text")
    assert parse_signature(doc) == {"params": [
        ["store_url", "str", None], ["device_id", "typing.SupportsInt", None],
        ["data_op_type", "_pymf_transfer.TransDataOpType", "<TransDataOpType.SDMA: 1>"],
        ["nic", "str", "''"]], "returns": "int"}


def test_installed_memfabric_matches_fixture() -> None:
    try:
        import memfabric_hybrid  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"memfabric-hybrid is not installed ({exc}); the fixture "
                    f"{FIXTURE.name} stands in as the contract. Install with "
                    f"`pip install memfabric-hybrid` (scripts/setup-env tries).")
    want, got = fixture(), installed_signatures()
    for name in ADAPTER_METHODS:
        assert name in got["methods"], f"installed memfabric {got['version']} lacks {name}"
        assert got["methods"][name] == want["methods"][name], (
            f"{name} changed between memfabric {want['version']} (fixture) and "
            f"{got['version']} (installed)")


def test_adapter_calls_bind_to_the_memfabric_signatures() -> None:
    eng = FixtureEngine()
    t = AscendTransport("Prefill", hostname="10.0.0.1", engine=eng, device_id=3,
                        store_url="tcp://10.0.0.9:29555")
    assert t.local_session_id() == "10.0.0.1:30001"
    buf = np.zeros(1 << 16, np.uint8)
    base = buf.ctypes.data
    t.register_buffers([base, base + 4096], [4096, 8192])
    plan = plan_batch([base, base + 4096], [0x5000, 0x9000], [4096, 4096])
    stats = t.submit(plan, "10.0.0.2:30002")
    t.close()
    names = [n for n, _ in eng.calls]
    assert names == ["get_rpc_port", "initialize", "batch_register_memory",
                     "batch_transfer_sync_write", "unregister_memory", "unregister_memory",
                     "unInitialize"]
    init = eng.calls[1][1]
    assert (init["store_url"], init["session_id"], init["role"], init["device_id"]) == (
        "tcp://10.0.0.9:29555", "10.0.0.1:30001", "Prefill", 3)
    write = eng.calls[3][1]
    assert write == {"dest_session": "10.0.0.2:30002", "buffers": [base, base + 4096],
                     "peer_buffers": [0x5000, 0x9000], "lengths": [4096, 4096], "flags": 0}
    assert stats.blocks == 2 and stats.bytes == 8192 and stats.batches == 1


def test_memfabric_status_becomes_transfer_error() -> None:
    eng = FixtureEngine({"batch_transfer_sync_write": -2000})
    t = AscendTransport("Prefill", engine=eng, store_url="tcp://x:1")
    buf = np.zeros(4096, np.uint8)
    t.register_buffers([buf.ctypes.data], [4096])
    with pytest.raises(TransferError, match=r"status -2000 \(INVALID_PARAM\)") as info:
        t.submit(plan_batch([buf.ctypes.data], [0x1000], [4096]), "peer:9")
    assert (info.value.session, info.value.batch, info.value.blocks, info.value.bytes) == (
        "peer:9", 0, 1, 4096)


def test_initialize_failure_and_bad_arguments() -> None:
    with pytest.raises(TransferError, match="initialize"):
        AscendTransport("Decode", engine=FixtureEngine({"initialize": -1}), store_url="tcp://x:1")
    with pytest.raises(ValueError, match="role"):
        AscendTransport("prefill", engine=FixtureEngine(), store_url="tcp://x:1")
    with pytest.raises(ValueError, match="store_url"):
        os.environ.pop("ASCEND_MF_STORE_URL", None)
        AscendTransport("Decode", engine=FixtureEngine())


# ---------------------------------------------------------------------------------------------
# Layer 2: the real, uninitialised memfabric engine (subprocess)
# ---------------------------------------------------------------------------------------------

REAL_ENGINE_SCRIPT = textwrap.dedent("""
    import json, time
    import numpy as np
    import memfabric_hybrid as mf
    from kvplan.engines import AscendTransport, TransferError

    class P:
        def __init__(self, s, d, n):
            self.src_addrs, self.dst_addrs, self.lengths = (np.array(x, dtype=np.uint64)
                                                            for x in (s, d, n))

    out = {}
    buf = np.zeros(1 << 16, np.uint8)
    base = buf.ctypes.data
    t = AscendTransport("Prefill", engine=mf.TransferEngine(), initialize=False,
                        session_id="127.0.0.1:30001")
    try:
        out["registered"] = t.register_buffers([base, base + 8192], [4096, 4096])
    except TransferError as e:
        out["registered"] = ("error", e.status)
        t._regions = [(base, base + (1 << 16))]  # keep going: the write call is what matters
    t0 = time.perf_counter()
    try:
        t.submit(P([base, base + 8192], [0x10000, 0x20000], [4096, 4096]), "127.0.0.1:30002")
        out["submit"] = "ok"
    except TransferError as e:
        out["submit"] = {"status": e.status, "batch": e.batch, "blocks": e.blocks,
                         "bytes": e.bytes, "session": e.session, "message": str(e)}
    out["submit_seconds"] = time.perf_counter() - t0
    eng = mf.TransferEngine()
    for label, args in {"float": ([1.5], [0], [1]), "negative": ([-1], [0], [1]),
                        "too_big": ([2**64], [0], [1])}.items():
        try:
            eng.batch_transfer_sync_write("127.0.0.1:30002", *args)
            out[label] = "accepted"
        except TypeError:
            out[label] = "TypeError"
    out["numpy_args"] = eng.batch_transfer_sync_write(
        "127.0.0.1:30002", np.array([base], np.uint64), np.array([0x10000], np.uint64),
        np.array([16], np.uint64))
    try:
        AscendTransport("Prefill", engine=mf.TransferEngine(), store_url="tcp://127.0.0.1:29555",
                        session_id="127.0.0.1:30003")
        out["initialize"] = "ok"
    except TransferError as e:
        out["initialize"] = {"status": e.status, "message": str(e)}
    print("RESULT:" + json.dumps(out), flush=True)
""")


def test_real_uninitialised_engine_accepts_the_adapter_calls() -> None:
    try:
        import memfabric_hybrid  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"memfabric-hybrid is not installed ({exc}); cannot exercise the real "
                    f"binding. Install with `pip install memfabric-hybrid`.")
    env = {**os.environ, "ASCEND_MF_LOG_LEVEL": "3"}
    res = subprocess.run([sys.executable, "-c", REAL_ENGINE_SCRIPT], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT:"))
    out = json.loads(line[len("RESULT:"):])
    # The binding took the adapter's lists and answered with a status (no TypeError, no crash).
    sub = out["submit"]
    assert sub != "ok" and sub["status"] == -1
    assert (sub["session"], sub["batch"], sub["blocks"], sub["bytes"]) == (
        "127.0.0.1:30002", 0, 2, 8192)
    assert out["submit_seconds"] < 10
    assert out["float"] == out["negative"] == out["too_big"] == "TypeError"
    assert out["numpy_args"] == -1  # arrays are accepted too (the adapter passes lists)
    assert out["initialize"]["status"] != 0 and "initialize" in out["initialize"]["message"]


# ---------------------------------------------------------------------------------------------
# Layer 3: a copying stand-in with the exact signatures
# ---------------------------------------------------------------------------------------------

def test_stand_in_signatures_match_the_fixture() -> None:
    want = fixture()["methods"]
    for name in ADAPTER_METHODS + ("register_memory",):
        got = inspect.signature(getattr(StandInMemfabric, name))
        params = [p for p in got.parameters.values() if p.name != "self"]
        assert [p.name for p in params] == [p[0] for p in want[name]["params"]], name
        for p, (_, _, default) in zip(params, want[name]["params"]):
            assert (p.default is inspect.Parameter.empty) == (default is None), (name, p.name)


def test_stand_in_hybrid_prefill_pp2_to_decode_pp1_bytes() -> None:
    """The hybrid scenario through the Ascend adapter, every byte checked."""
    import kvplan
    from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
    from kvplan.testing import SENTINEL, build_layout, model_peers
    from support.engine_peers import assert_decode_bytes, expected_decode

    tiny = ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                       (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))
    peers = model_peers(tiny, pages=32, pp_size=2, state_slots=3)
    decode, stages = peers.decode, peers.prefill
    network: dict[str, StandInMemfabric] = {}
    rng = np.random.default_rng(11)
    d_mem = np.full(decode.size, SENTINEL, np.uint8)
    d_t = AscendTransport("Decode", engine=StandInMemfabric(network), store_url="tcp://s:1")
    d_layout = build_layout(decode, d_mem.ctypes.data)
    assert d_t.register(d_layout) == len(decode.entries)
    src_pages = np.arange(2, 22, dtype=np.int64)
    dst_pages = fragmented_pages(20, 1 / 3, seed=11, shuffle_runs=True, capacity=32)
    before = d_mem.copy()
    writes = []
    mems = []
    for spec in stages:
        mem = rng.integers(0, 255, spec.size, dtype=np.uint8)
        mems.append(mem)
        t = AscendTransport("Prefill", engine=StandInMemfabric(network), store_url="tcp://s:1")
        s_layout = build_layout(spec, mem.ctypes.data)
        t.register(s_layout)
        tpl = kvplan.Template(s_layout, d_layout)
        stats_kv = t.submit(tpl.plan(src_pages, dst_pages), d_t.local_session_id())
        stats_st = t.submit(tpl.plan_state(1, 2), d_t.local_session_id())
        assert stats_kv.batches == 1 and stats_st.blocks == 6  # one call; 3 layers x 2 states
        writes.append((spec, mem, src_pages, dst_pages, 1, 2))
    assert_decode_bytes(d_mem, expected_decode(decode, before, writes), decode)


def test_stand_in_npu_groups_hybrid_pp2_pairs_by_layer_id() -> None:
    """The case SGLang's fix for Ascend hybrid-linear models under prefill PP (pair by layer id)
    is for: Ascend pools with two buffer groups per full-attention layer (each layer id published
    once per group), hybrid-linear state, prefill PP=2 -> decode PP=1."""
    import kvplan
    from kvplan.presets import fragmented_pages
    from kvplan.testing import SENTINEL, PeerSpec, build_layout, pack_entries
    from support.engine_peers import assert_decode_bytes, expected_decode

    full, linear, pages = (3, 7), (0, 1, 2, 4, 5, 6), 24
    groups = (("g0", 1024), ("g1", 128))  # e.g. MLA nope / rope parts on NPU

    def spec(name: str, layers: range, rank: int, size: int) -> PeerSpec:
        rows = [(i, g, "page", n, pages) for g, n in groups for i in full if i in layers]
        rows += [(i, "mamba_conv", "state", 2048, 2) for i in linear if i in layers]
        return PeerSpec(name, "npu_groups", pack_entries(rows), 8, rank, size)

    decode = spec("decode", range(8), 0, 1)
    stages = [spec("prefill0", range(0, 4), 0, 2), spec("prefill1", range(4, 8), 1, 2)]
    network: dict[str, StandInMemfabric] = {}
    d_mem = np.full(decode.size, SENTINEL, np.uint8)
    d_t = AscendTransport("Decode", engine=StandInMemfabric(network), store_url="tcp://s:1")
    d_layout = build_layout(decode, d_mem.ctypes.data)
    d_t.register(d_layout)
    rng = np.random.default_rng(5)
    src_pages = np.arange(0, 16, dtype=np.int64)
    dst_pages = fragmented_pages(16, 0.5, seed=5, shuffle_runs=True, capacity=pages)
    before, writes = d_mem.copy(), []
    keep = []
    for st in stages:
        mem = rng.integers(0, 255, st.size, dtype=np.uint8)
        keep.append(mem)
        t = AscendTransport("Prefill", engine=StandInMemfabric(network), store_url="tcp://s:1")
        layout = build_layout(st, mem.ctypes.data)
        t.register(layout)
        tpl = kvplan.Template(layout, d_layout)
        assert len(tpl.pairs) == 2  # one full-attention layer x two groups per stage
        t.submit(tpl.plan(src_pages, dst_pages), d_t.local_session_id())
        t.submit(tpl.plan_state(0, 1), d_t.local_session_id())
        writes.append((st, mem, src_pages, dst_pages, 0, 1))
    assert_decode_bytes(d_mem, expected_decode(decode, before, writes), decode)


def test_stand_in_rejects_destination_outside_peer_memory() -> None:
    network: dict[str, StandInMemfabric] = {}
    src = np.arange(8192, dtype=np.uint8)
    dst = np.zeros(4096, np.uint8)
    d_t = AscendTransport("Decode", engine=StandInMemfabric(network), store_url="tcp://s:1")
    d_t.register_buffers([dst.ctypes.data], [4096])
    p_t = AscendTransport("Prefill", engine=StandInMemfabric(network), store_url="tcp://s:1")
    p_t.register_buffers([src.ctypes.data], [8192])
    good = dst.ctypes.data
    plan = plan_batch([src.ctypes.data, src.ctypes.data + 4096], [good, good + 4096], [16, 16])
    with pytest.raises(TransferError, match="INVALID_PARAM") as info:
        p_t.submit(plan, d_t.local_session_id())
    assert info.value.blocks == 2 and info.value.status == INVALID_PARAM
    assert not dst.any()  # memfabric validates the whole batch first: nothing landed
    # Bounded batches: the good first block lands, the second batch fails on its own.
    with pytest.raises(TransferError, match="batch 1"):
        p_t.submit(plan, d_t.local_session_id(), max_blocks_per_batch=1)
    np.testing.assert_array_equal(dst[:16], src[:16])


def test_empty_plan_is_not_sent_to_memfabric() -> None:
    # memfabric answers an empty batch with -2000; the adapter must not make that call.
    network: dict[str, StandInMemfabric] = {}
    t = AscendTransport("Prefill", engine=StandInMemfabric(network), store_url="tcp://s:1")
    stats = t.submit(plan_batch([], [], []), "nobody:1")
    assert stats.batches == 0 and t._engine.writes == 0


def write_fixture() -> None:
    """Regenerate the fixture from the installed memfabric (run after a deliberate upgrade)."""
    sigs = installed_signatures()
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in sigs.items()
                     if k != "methods"] + [' "methods": {']
    methods = sigs["methods"]
    for i, (name, sig) in enumerate(methods.items()):
        params = ",\n".join(f"   {json.dumps(p)}" for p in sig["params"])
        body = f"[\n{params}\n  ]" if params else "[]"
        comma = "," if i < len(methods) - 1 else ""
        lines.append(f'  {json.dumps(name)}: {{"returns": {json.dumps(sig["returns"])}, '
                     f'"params": {body}}}{comma}')
    lines += [" }", "}"]
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == sigs
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(text)
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-fixture"]:
        write_fixture()
    else:
        print("usage: python tests/engines/test_ascend.py --write-fixture")
