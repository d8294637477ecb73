"""Regressions from adversarial review: ``kvplan explain`` input handling and legacy start
layers, the Ascend adapter's session id, and ``kvplan.compat.sglang``'s documented differences.

Expected values come from arithmetic on the layouts built here and from SGLang's own expressions
(``np.diff`` in the array's dtype), not from running kvplan.
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.memfabric_standins import (
    ADAPTER_METHODS,
    FixtureEngine,
    StandInMemfabric,
    fixture,
    plan_batch,
)

from kvplan import cli, explain
from kvplan.engines import AscendTransport, TransferError
from kvplan.presets import get_preset


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["explain", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_usage_error(rc: int, out: str, err: str, *needles: str) -> None:
    """Exit 2, nothing on stdout, exactly one line on stderr naming the option and value."""
    assert rc == 2, (rc, out, err)
    assert out == "", out
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvplan explain: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ------------------------------------------------------------------------ layout files

DS8 = get_preset("deepseek-v3").with_layers(8)  # 8 MLA layers: small, every entry 1152 B/token


def write_layout(path: Path, layout: Any, *, ids: bool = True, **edits: Any) -> Path:
    data = layout.to_dict()
    if not ids:
        data["layer_ids"] = None
    data.update(edits)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def idless(tmp_path: Path) -> dict[str, str]:
    """A PP 2 split of 8 MLA layers (0-3 | 4-7) and a decode peer, none publishing layer ids."""
    files = {
        "p0": write_layout(tmp_path / "p0.json", DS8.layout(range(0, 4), page_size=1, capacity=64,
                                                            pp_rank=0, pp_size=2), ids=False),
        "p1": write_layout(tmp_path / "p1.json", DS8.layout(range(4, 8), page_size=1, capacity=64,
                                                            pp_rank=1, pp_size=2), ids=False),
        "d": write_layout(tmp_path / "d.json", DS8.layout(range(8), page_size=1, capacity=64),
                          ids=False),
    }
    return {k: str(v) for k, v in files.items()}


# ------------------------------------------------------------------------ id-less stage files


def test_idless_stages_are_refused_not_planned_from_layer_0(capsys, idless) -> None:
    # Before: exit 0, and stage 1 wrote decode layers 0-3 (the same ones as stage 0).
    rc, out, err = run_cli(capsys, "--prefill", idless["p0"], "--prefill", idless["p1"],
                           "--decode", idless["d"], "--pages", "4")
    assert_usage_error(rc, out, err, "--prefill-start-layer", "stage 0/2", "stage 1/2",
                       "the stage publishes no layer ids")


def test_idless_stages_with_start_layers_plan_their_own_layers(capsys, idless) -> None:
    rc, out, err = run_cli(capsys, "--prefill", idless["p0"], "--prefill", idless["p1"],
                           "--decode", idless["d"], "--pages", "4",
                           "--prefill-start-layer", "0,4")
    assert rc == 0, err
    assert "no layer ids, first layer 4" in out
    # Each of the 8 decode layers gets 4 pages × 1152 B exactly once (stage 1 -> 4..7).
    assert f"({4 * 1152:,} B) each: layers 0–7 (8 layers)" in out


def test_idless_explain_library_call_pairs_stage_1_onto_decode_layers_4_to_7(idless) -> None:
    p0, p1, d = (explain._load_layout(idless[k]) for k in ("p0", "p1", "d"))
    e = explain.explain([("s0", p0), ("s1", p1)], d, title="t", pages=4,
                        prefill_start_layer=[0, 4])
    assert e.ok and e.kv_bytes_per_layer == {i: 4 * 1152 for i in range(8)}
    with pytest.raises(ValueError, match="--prefill-start-layer"):
        explain.explain([("s0", p0), ("s1", p1)], d, title="t", pages=4)
    with pytest.raises(ValueError, match="one per stage"):
        explain.explain([("s0", p0), ("s1", p1)], d, title="t", pages=4, prefill_start_layer=4)


def test_single_stage_takes_a_single_start_layer(capsys, idless) -> None:
    args = ("--prefill", idless["p0"], "--prefill", idless["p1"], "--decode", idless["d"],
            "--pages", "4", "--stage", "1")
    rc, out, err = run_cli(capsys, *args, "--prefill-start-layer", "4")
    assert rc == 0 and "first layer 4" in out, err
    rc, out, err = run_cli(capsys, *args, "--prefill-start-layer", "0,4")  # indexed by --stage
    assert rc == 0 and "first layer 4" in out, err
    rc, out, err = run_cli(capsys, *args[:-2], "--prefill-start-layer", "0,4,8")
    assert_usage_error(rc, out, err, "--prefill-start-layer", "3 value(s) for 2")


def test_decode_without_ids_cannot_give_a_start_layer(capsys, tmp_path) -> None:
    # Ascend slices hybrid MHA by position at PP 2; the stages publish ids, the decode does not.
    rc, _, _ = run_cli(capsys, "--preset", "qwen3-next", "--pp", "2", "--pages", "8",
                       "--write-layouts", str(tmp_path))
    assert rc == 0
    decode = json.loads((tmp_path / "decode.json").read_text())
    decode["layer_ids"] = None
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    rc, out, err = run_cli(capsys, "--prefill", str(tmp_path / "prefill-stage1.json"),
                           "--decode", str(tmp_path / "decode.json"), "--backend", "ascend",
                           "--pages", "8")
    assert_usage_error(rc, out, err, "the decode layout publishes no layer ids", "stage 1/2")


def test_start_layer_from_ids_still_derived(capsys) -> None:
    # Presets publish ids: nothing to pass, as before.
    rc, out, err = run_cli(capsys, "--preset", "qwen3-next", "--pp", "2", "--pages", "8",
                           "--backend", "ascend")
    assert rc == 0, err


# ------------------------------------------------------------------------ bad options


BAD_OPTIONS = [
    (["--max-blocks", "0"], ["--max-blocks", "0"]),           # was ZeroDivisionError, exit 1
    (["--max-blocks", "-3"], ["--max-blocks", "-3"]),         # was exit 0, "-20 engine calls"
    (["--page-size", str(10**15)], ["--page-size", str(10**15), "64-bit"]),  # was OverflowError
    (["--page-size", "10**15"], ["--page-size", "'10**15'"]),
    (["--page-size", "0"], ["--page-size", "0"]),
    (["--pages", "0"], ["--pages", "0"]),
    (["--pages", "x"], ["--pages", "'x'"]),
    (["--pp", "0"], ["--pp", "0"]),
    (["--pp", "62"], ["--pp 62", "61"]),
    (["--pp-split", "a,b"], ["--pp-split", "'a,b'"]),
    (["--pp-split", "30,30"], ["--pp-split 30,30", "61"]),
    (["--pp-split", "30,31", "--pp", "3"], ["--pp 3", "--pp-split 30,31"]),
    (["--layers", "0"], ["--layers", "0"]),
    (["--layers", str(10**9)], ["--layers", str(10**9)]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--fragmentation", "nan"], ["--fragmentation", "nan"]),
    (["--fragmentation", "2"], ["--fragmentation", "2"]),
    (["--stage", "-1"], ["--stage", "-1"]),
    (["--stage", "1"], ["--stage", "1"]),
    (["--prefill-start-layer", "-1"], ["--prefill-start-layer", "-1"]),
    (["--prefill-start-layer", str(2**70)], ["--prefill-start-layer", str(2**70)]),
    (["--prefill-start-layer", "0,x"], ["--prefill-start-layer", "'0,x'"]),
    (["--decode", "d.json"], ["--decode"]),                   # was silently ignored
    (["--bogus"], ["--bogus"]),
    (["--plot", "/nonexistent-dir/x.png"], ["--plot", "/nonexistent-dir/x.png"]),
    (["--plot", "explain.not-an-image-format"], ["--plot", "not-an-image-format"]),
]


@pytest.mark.parametrize("argv,needles", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_is_one_line_exit_2(capsys, argv, needles) -> None:
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "8", *argv)
    assert_usage_error(rc, out, err, *needles)


def test_preset_only_options_are_refused_with_layout_files(capsys, idless) -> None:
    for option, value in (("--page-size", "16"), ("--pp", "2"), ("--pp-split", "2,2"),
                          ("--layers", "8")):
        rc, out, err = run_cli(capsys, "--prefill", idless["p0"], "--decode", idless["d"],
                               option, value)
        assert_usage_error(rc, out, err, option, "--preset")
    rc, out, err = run_cli(capsys, "--prefill", idless["p0"])
    assert_usage_error(rc, out, err, "--decode")


def test_write_layouts_onto_a_file_is_one_line(capsys, tmp_path) -> None:
    target = tmp_path / "a-file"
    target.write_text("")
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "8",
                           "--write-layouts", str(target))
    assert_usage_error(rc, out, err, "--write-layouts", str(target))


# ------------------------------------------------------------------------ bad layout files


def _base_layout() -> dict[str, Any]:
    return DS8.layout(range(4), page_size=1, capacity=64).to_dict()


def _edit(field: str, value: Any, index: int | None = None) -> dict[str, Any]:
    data = copy.deepcopy(_base_layout())
    if index is None:
        data[field] = value
    else:
        data[field][index] = value
    return data


BAD_LAYOUTS: list[tuple[str, Any, list[str]]] = [
    ("negative pointer", _edit("data_ptrs", -1, 0), ["data_ptrs[0]", "-1"]),
    ("2**70 pointer", _edit("data_ptrs", 2**70, 0), ["data_ptrs[0]", str(2**70)]),
    ("float length", _edit("data_lens", 4096.0, 1), ["data_lens[1]", "4096.0"]),
    ("bool length", _edit("data_lens", True, 2), ["data_lens[2]", "True"]),
    ("item_lens string", _edit("item_lens", "x"), ["item_lens", "'x'"]),
    ("item_lens element", _edit("item_lens", "1", 3), ["item_lens[3]", "'1'"]),
    ("pp_rank string", _edit("pp_rank", "a"), ["pp_rank", "'a'"]),
    ("pp_rank 2**40", _edit("pp_rank", 2**40), ["pp_rank", str(2**40)]),
    ("pp_rank past pp_size", _edit("pp_rank", 5), ["pp_rank", "5"]),
    ("page_size null", _edit("page_size", None), ["page_size", "None"]),
    ("layer id 2**70", _edit("layer_ids", 2**70, 0), ["layer_ids[0]", str(2**70)]),
    ("layer_ids string", _edit("layer_ids", "abc"), ["layer_ids", "'abc'"]),
    ("role int", _edit("roles", 5, 0), ["roles[0]", "5"]),
    ("unknown kind", _edit("kinds", "foo", 0), ["foo"]),
    ("device int", _edit("device", 5), ["device", "5"]),
    ("unknown key", _edit("bogus", 1), ["bogus"]),
    ("huge string", _edit("pp_rank", "a" * 100_000), ["pp_rank", "'aaaa"]),
    ("not an object", [1, 2], ["JSON object", "list"]),
]


@pytest.mark.parametrize("data,needles", [(d, n) for _, d, n in BAD_LAYOUTS],
                         ids=[label for label, _, _ in BAD_LAYOUTS])
@pytest.mark.parametrize("side", ["--prefill", "--decode"])
def test_bad_layout_field_is_one_line_exit_2(capsys, tmp_path, side, data, needles) -> None:
    good = write_layout(tmp_path / "good.json", DS8.layout(range(4), page_size=1, capacity=64))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    files = {"--prefill": good, "--decode": good, side: bad}
    rc, out, err = run_cli(capsys, "--prefill", str(files["--prefill"]),
                           "--decode", str(files["--decode"]), "--pages", "4")
    assert_usage_error(rc, out, err, f"{side} {bad}", *needles)
    assert len(err) < 600  # a 100 kB value is cut, not echoed


@pytest.mark.parametrize("content,needle", [
    (b"{not json", "not a valid JSON file"),
    (b"[" * 100_000 + b"]" * 100_000, "not a valid JSON file"),  # RecursionError
    (b"\xff\xfe\x00garbage", "not a valid JSON file"),
    (b'{"version": NaN}', "version must be an int in 0..2**16, got nan"),
    (b'{"version": 1, "page_size": NaN}', 'no "data_ptrs" key'),  # the first field missing
])
def test_unreadable_layout_file_is_one_line_exit_2(capsys, tmp_path, content, needle) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    rc, out, err = run_cli(capsys, "--prefill", str(bad), "--decode", str(bad))
    assert_usage_error(rc, out, err, f"--prefill {bad}", needle)
    rc, out, err = run_cli(capsys, "--prefill", str(tmp_path / "missing.json"),
                           "--decode", str(bad))
    assert_usage_error(rc, out, err, "missing.json", "cannot read")


def test_explain_library_call_refuses_bad_max_blocks() -> None:
    d = DS8.layout(range(8), page_size=1, capacity=64)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="--max-blocks"):
            explain.explain([("p", d)], d, title="t", pages=4, max_blocks=bad)


def test_explain_library_call_refuses_negative_seed() -> None:
    with pytest.raises(ValueError, match="--seed must be at least 0, got -1"):
        explain.decode_pages(8, 0.5, seed=-1)


def test_elided_entries_do_not_bound_the_request(capsys, tmp_path) -> None:
    # item_len 0 entries are never indexed; their zero capacity used to refuse every request.
    layout = get_preset("qwen3-next").with_layers(8).layout(range(8), page_size=1, capacity=16)
    path = write_layout(tmp_path / "elided.json", layout,
                        item_lens=[0] * layout.n_entries)
    rc, out, err = run_cli(capsys, "--prefill", str(path), "--decode", str(path), "--pages", "8")
    assert rc == 0, err
    assert "total bytes 0 B" in out


def test_internal_error_is_exit_3_never_1(capsys, monkeypatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(explain.command, "explain", broken)  # the name the runner calls
    rc, out, err = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "8")
    assert rc == 3 and "Traceback" in err and "RuntimeError: boom" in err
    assert "internal error" in err.splitlines()[-1]


def test_console_script_exit_status_and_help() -> None:
    res = subprocess.run([sys.executable, "-m", "kvplan.cli", "explain", "--preset",
                          "deepseek-v3", "--max-blocks", "0"], capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "kvplan explain: argument --max-blocks: must be at least 1, got 0 (see --help)"]
    res = subprocess.run([sys.executable, "-m", "kvplan.cli", "explain", "--help"],
                         capture_output=True, text=True)
    assert res.returncode == 0
    assert "exit status: 0 every stage is compatible; 1 a stage is not" in res.stdout
    assert "--prefill-start-layer gives" in res.stdout
    assert "the seed" not in res.stdout and "seed's" not in res.stdout


# ------------------------------------------------------------------------ Ascend session id



class PortAfterInitialize(StandInMemfabric):
    """memfabric-hybrid 1.3.0 as its log describes it: ``get_rpc_port()`` is 0 until
    ``initialize`` has run, which picks the listening port and registers the engine under
    ``host:port`` (the port in the session id it was given is not used)."""

    def __init__(self, network: dict[str, StandInMemfabric]) -> None:
        super().__init__(network)
        self.initialized = False

    def initialize(self, store_url: str, session_id: str, role: str, device_id: int,
                   data_op_type: Any = StandInMemfabric.TransDataOpType.SDMA,
                   store_server_role: str = "Decode", nic: str = "") -> int:
        if role not in ("Prefill", "Decode"):
            return -1
        self.initialized = True
        self.session = f"{session_id.rpartition(':')[0]}:{self._port}"
        self.network[self.session] = self
        return 0

    def get_rpc_port(self) -> int:
        return self._port if self.initialized else 0


def test_port_after_initialize_stand_in_matches_the_memfabric_signatures() -> None:
    import inspect

    want = fixture()["methods"]
    for name in ADAPTER_METHODS:
        got = [p for p in inspect.signature(getattr(PortAfterInitialize, name)).parameters.values()
               if p.name != "self"]
        assert [p.name for p in got] == [p[0] for p in want[name]["params"]], name
        for p, (_, _, default) in zip(got, want[name]["params"]):
            assert (p.default is inspect.Parameter.empty) == (default is None), (name, p.name)


def test_session_id_reads_the_port_again_after_initialize() -> None:
    network: dict[str, StandInMemfabric] = {}
    d_eng = PortAfterInitialize(network)
    d_t = AscendTransport("Decode", hostname="10.0.0.7", engine=d_eng, store_url="tcp://s:1")
    # Before: "10.0.0.7:0", which no peer can reach.
    assert d_t.local_session_id() == f"10.0.0.7:{d_eng._port}" and d_eng._port != 0
    dst = np.zeros(4096, np.uint8)
    d_t.register_buffers([dst.ctypes.data], [4096])
    src = np.arange(4096, dtype=np.uint8)
    p_t = AscendTransport("Prefill", hostname="10.0.0.8", engine=PortAfterInitialize(network),
                          store_url="tcp://s:1")
    p_t.register_buffers([src.ctypes.data], [4096])
    p_t.submit(plan_batch([src.ctypes.data], [dst.ctypes.data], [4096]), d_t.local_session_id())
    assert (dst == src).all()


def test_session_id_of_an_engine_initialised_elsewhere() -> None:
    eng = PortAfterInitialize({})
    t = AscendTransport("Decode", hostname="h", engine=eng, initialize=False)
    with pytest.raises(TransferError, match="get_rpc_port"):
        t.local_session_id()  # port 0: there is no id to hand out yet
    assert eng.initialize("tcp://s:1", "h:0", "Decode", 0) == 0
    assert t.local_session_id() == f"h:{eng._port}"
    explicit = AscendTransport("Decode", engine=PortAfterInitialize({}), initialize=False,
                               session_id="h:1234")
    assert explicit.local_session_id() == "h:1234"


def test_port_known_before_initialize_is_read_once() -> None:
    # An engine that reports the port up front (older builds): no extra call, id unchanged.
    eng = FixtureEngine()
    t = AscendTransport("Prefill", hostname="h", engine=eng, store_url="tcp://s:1")
    assert t.local_session_id() == "h:30001"
    assert [n for n, _ in eng.calls].count("get_rpc_port") == 1


# ------------------------------------------------------------------------ compat.sglang


def sglang_runs(src: np.ndarray, dst: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """SGLang 0.5.23's grouping expression, verbatim (np.diff in each array's own dtype)."""
    brk = np.where((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    return ([g.tolist() for g in np.split(src, brk)], [g.tolist() for g in np.split(dst, brk)])


WRAP_CASES = [
    # numpy computes -2**31 - (2**31-1) as 1 in int32, and 0 - (2**32-1) as 1 in uint32.
    ("int32 max->min", [2**31 - 1, -(2**31)], np.int32, [[2**31 - 1, -(2**31)]]),
    ("uint32 max->0", [2**32 - 1, 0], np.uint32, [[2**32 - 1, 0]]),
    ("uint8 max->0", [255, 0, 1], np.uint8, [[255, 0, 1]]),
    ("int64 max->min", [2**63 - 1, -(2**63)], np.int64, [[2**63 - 1, -(2**63)]]),
    ("uint64 max->0", [2**64 - 1, 0], np.uint64, [[2**64 - 1, 0]]),
    ("big-endian uint32", [2**32 - 1, 0], np.dtype(">u4"), [[2**32 - 1, 0]]),
    # Differences that wrap to something other than 1 break the run, as in exact arithmetic
    # (this one used to raise IndexBoundsError).
    ("int64 min->max-1", [-(2**63), 2**63 - 2], np.int64, [[-(2**63)], [2**63 - 2]]),
    ("int32 min->max", [-(2**31), 2**31 - 1], np.int32, [[-(2**31)], [2**31 - 1]]),
]


@pytest.mark.parametrize("values,dtype,runs", [c[1:] for c in WRAP_CASES],
                         ids=[c[0] for c in WRAP_CASES])
def test_group_concurrent_contiguous_wraps_like_numpy(values, dtype, runs) -> None:
    from kvplan.compat.sglang import group_concurrent_contiguous

    src = np.array(values, dtype=dtype)
    dst = np.arange(10, 10 + len(values), dtype=np.int64)  # contiguous: src decides
    got = group_concurrent_contiguous(src, dst)
    assert got == sglang_runs(src, dst)
    assert got[0] == runs
    # Either side may wrap.
    assert group_concurrent_contiguous(dst, src) == sglang_runs(dst, src)


def test_group_concurrent_contiguous_matches_sglang_on_extreme_values() -> None:
    # Every small array over each integer dtype's extreme values, against SGLang's expression.
    from kvplan.compat.sglang import group_concurrent_contiguous

    for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                  np.uint64):
        info = np.iinfo(dtype)
        special = [int(info.min), int(info.min) + 1, int(info.max) - 1, int(info.max), 0, 1]
        for n in (2, 3):
            for combo in itertools.product(special, repeat=n):
                src = np.array(combo, dtype=dtype)
                dst = np.array(combo[::-1], dtype=dtype)
                for a, b in ((src, dst), (src, np.arange(n, dtype=dtype))):
                    assert group_concurrent_contiguous(a, b) == sglang_runs(a, b), (dtype, a, b)


def test_build_transfer_entry_pairs_float_counts_as_sglang() -> None:
    from kvplan.compat.sglang import build_transfer_entry_pairs

    # Layer-id path: SGLang only compares the counts with the id-list lengths.
    assert build_transfer_entry_pairs([1, 2, 3], [3, 2, 1], 3.0, 3.0) == [(0, 2), (1, 1), (2, 0)]
    assert build_transfer_entry_pairs([5], [5, 6], np.int64(1), 2.0) == [(0, 0)]
    with pytest.raises(RuntimeError, match=r"src metadata=3 entries=2\.5"):
        build_transfer_entry_pairs([1, 2, 3], [1, 2, 3], 2.5, 3)
    # Positional path: SGLang's range(n_src) accepts __index__ objects and raises for floats.
    assert build_transfer_entry_pairs(None, None, np.int64(2), 3.0, True) == [(0, 0), (1, 1)]
    assert build_transfer_entry_pairs(None, None, True, 1) == [(0, 0)]
    for n_src in (3.0, -1.0):
        with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
            build_transfer_entry_pairs(None, None, n_src, 3.0, True)
    assert build_transfer_entry_pairs(None, None, -1, -1) == []  # range(-1) is empty
    assert build_transfer_entry_pairs(None, None, 0.0, 5.0) == []  # n_src == 0 first


def test_build_transfer_entry_pairs_error_order_as_sglang() -> None:
    from kvplan.compat.sglang import build_transfer_entry_pairs

    # SGLang hashes every decode id first, then walks the prefill ids in order: a missing id
    # is reported before a later unhashable one, and an unhashable decode id before anything.
    with pytest.raises(RuntimeError, match="missing a transfer entry for model layer 99"):
        build_transfer_entry_pairs([99, [1]], [0, 1], 2, 2)
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        build_transfer_entry_pairs([0, [1]], [0, 1], 2, 2)
    with pytest.raises(TypeError, match="unhashable type: 'set'"):
        build_transfer_entry_pairs([[0], 1], [{0}, 1], 2, 2)


# Each documented difference, pinned (the module docstring lists them).


@pytest.mark.parametrize("bad", [
    np.array([1.0, 2.0]),                  # SGLang groups floats by their differences
    np.array([True, False]),               # SGLang: numpy's TypeError for bool subtraction
    np.array([1, 2], dtype=object),        # SGLang groups Python ints without wrap-around
    np.array([[1, 2], [3, 4]]),            # SGLang splits rows at last-axis positions
], ids=["float", "bool", "object", "2-D"])
def test_documented_difference_non_integer_or_not_1d_is_type_error(bad) -> None:
    from kvplan.compat.sglang import group_concurrent_contiguous

    other = np.arange(bad.size, dtype=np.int64).reshape(bad.shape)
    with pytest.raises(TypeError, match="1-D integer numpy array"):
        group_concurrent_contiguous(bad, other)


def test_documented_difference_zero_d_is_type_error() -> None:
    from kvplan.compat.sglang import group_concurrent_contiguous

    with pytest.raises(TypeError, match="1-D integer numpy array"):  # SGLang: ValueError
        group_concurrent_contiguous(np.array(5), np.array(6))


def test_documented_difference_masked_array_is_read_as_plain_data() -> None:
    from kvplan.compat.sglang import group_concurrent_contiguous

    src = np.ma.array([1, 2, 3], mask=[False, True, False])
    assert group_concurrent_contiguous(src, np.array([7, 8, 9])) == ([[1, 2, 3]], [[7, 8, 9]])


def test_documented_difference_int_subclass_ids_compare_by_value() -> None:
    from kvplan.compat.sglang import build_transfer_entry_pairs

    class Opaque(int):  # equal to nothing (not even itself) in a dict, like SGLang keys it
        def __eq__(self, other: object) -> bool:
            return False

        def __hash__(self) -> int:
            return id(self)

    # SGLang raises "missing a transfer entry" here; the core compares integer values.
    assert build_transfer_entry_pairs([Opaque(4)], [Opaque(4)], 1, 1) == [(0, 0)]


def test_documented_difference_unmaterialisable_counts_fail_up_front() -> None:
    from kvplan.compat.sglang import build_transfer_entry_pairs

    with pytest.raises(OverflowError):  # SGLang: MemoryError while building the list
        build_transfer_entry_pairs(None, None, 2**63, 2**63, True)


def test_output_cut_short_by_the_reader_is_quiet() -> None:
    # `kvplan explain ... | head`: the reader closes the pipe early; no traceback, no
    # "bad input" message, the shell's usual status for SIGPIPE.
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvplan.cli", "explain", "--preset",
                             "deepseek-v3", "--pages", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "Broken pipe" not in err
