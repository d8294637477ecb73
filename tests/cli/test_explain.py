"""kvplan explain, presets and the plot.

Expected numbers come from docs/design.md, Reference scenarios (layers, bytes per token per
layer) and arithmetic on them (blocks = entry pairs × runs; bytes = entries × pages × page_size
× bytes per token), and from the state sizes documented in kvplan/presets.py (model config
arithmetic), not from running kvplan.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import kvplan
from kvplan import cli, explain
from kvplan.presets import PRESETS, StateSpec, get_preset, split_layers


def run_cli(capsys, *argv):
    rc = cli.main(["explain", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def stage_row(out: str, label: str) -> list[str]:
    for line in out.splitlines():
        if line.startswith(label) and "entries paired" not in line:  # not the header
            return line.split()
    raise AssertionError(f"no row {label!r} in\n{out}")


# ------------------------------------------------------------------------ presets


def test_presets_match_design_table():
    assert set(PRESETS) == {"deepseek-v3", "deepseek-v3.2", "deepseek-v4", "glm-5",
                            "gpt-oss-120b", "qwen3-235b", "qwen3-next", "kimi-linear",
                            "kimi-k3"}
    oss = get_preset("gpt-oss-120b")
    assert (oss.num_layers, oss.attention, oss.kv_bytes_per_token, oss.sliding_window) == \
        (36, "mha", 1024, 128)
    assert [oss.window_of(i) for i in range(4)] == [128, None, 128, None]
    ds = get_preset("DeepSeek-V3")
    assert (ds.num_layers, ds.attention, ds.kv_bytes_per_token) == (61, "mla", 1152)
    qw = get_preset("qwen3-235b")
    assert (qw.num_layers, qw.attention, qw.kv_bytes_per_token) == (94, "mha", 1024)
    nx = get_preset("qwen3-next")
    assert (nx.num_layers, nx.attention, nx.kv_bytes_per_token) == (48, "mha", 1024)
    assert nx.kv_layers() == list(range(3, 48, 4)) and len(nx.linear_layers()) == 36
    km = get_preset("kimi-linear")
    assert (km.num_layers, km.attention, km.kv_bytes_per_token) == (48, "mla", 1152)
    assert km.kv_layers() == list(range(3, 48, 4))
    assert get_preset("kimi-linear", 27).kv_layers() == [3, 7, 11, 15, 19, 23]
    with pytest.raises(kvplan.KvPlanError, match="unknown preset"):
        get_preset("llama")


def test_preset_layouts():
    ds = get_preset("deepseek-v3")
    lay = ds.layout(range(31, 61), page_size=16, capacity=100, pp_rank=1, pp_size=2)
    assert lay.n_entries == 30 and lay.layer_ids == list(range(31, 61))
    assert set(lay.item_lens) == {1152 * 16} and set(lay.capacities) == {100}
    assert (lay.pp_rank, lay.pp_size, lay.page_size, lay.num_model_layers) == (1, 2, 16, 61)
    qw = get_preset("qwen3-235b").layout(range(94), page_size=1, capacity=8)
    assert qw.n_entries == 188 and qw.roles == ["k"] * 94 + ["v"] * 94
    nx = get_preset("qwen3-next").layout(range(24, 48), page_size=1, capacity=8)
    # 6 full-attention layers (27..47 every 4th) × K/V, 18 linear layers × (conv, temporal).
    assert nx.kinds.count("page") == 12 and nx.kinds.count("state") == 36
    assert nx.layer_ids[:6] == [27, 31, 35, 39, 43, 47]
    assert sorted(set(nx.item_lens)) == [1024, 49_152, 2_097_152]


def test_split_layers():
    assert split_layers(61, 2) == [range(0, 31), range(31, 61)]
    assert split_layers(48, 1) == [range(0, 48)]
    assert split_layers(48, 2, [20, 28]) == [range(0, 20), range(20, 48)]
    with pytest.raises(kvplan.KvPlanError):
        split_layers(48, 2, [20, 20])


# ------------------------------------------------------------------------ fragmentation


@pytest.mark.parametrize("frag,runs", [(0.0, 1), (1.0, 512), (0.5, 257)])
def test_decode_pages_break_count(frag, runs):
    dst, breaks = explain.decode_pages(512, frag, seed=3)
    assert breaks == runs - 1
    src = np.arange(512, dtype=np.int64)
    assert len(kvplan.group_contiguous(src, dst)[2]) == runs
    assert len(set(dst.tolist())) == 512  # a free list never hands out a page twice


def test_histogram_buckets():
    assert explain.histogram([1, 1, 2, 3, 4, 8, 9]) == [
        ("1", 2, 2), ("2–3", 2, 5), ("4–7", 1, 4), ("8–15", 2, 17)]


# ------------------------------------------------------------------------ CLI output


def test_deepseek_fully_fragmented(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "512",
                         "--fragmentation", "1")
    assert rc == 0
    # 61 MLA entries × 512 runs; 61 × 512 pages × 1152 bytes.
    row = stage_row(out, "prefill")
    assert row[1:6] == ["layer_id", "61", "512", f"{61 * 512:,}", f"{61 * 512 * 1152:,}"]
    assert "destination fully fragmented: 512× more blocks than contiguous" in out
    assert f"{512 * 1152:,} B) each: layers 0–60 (61 layers)" in out
    assert "engine calls of at most 1,024 blocks" in out


def test_deepseek_contiguous_pp2(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "deepseek-v3", "--pp", "2", "--pages", "100",
                         "--page-size", "64")
    assert rc == 0
    item = 1152 * 64
    assert stage_row(out, "stage 0/2")[2:7] == ["layer_id", "31", "1", "31", f"{31 * 100 * item:,}"]
    assert stage_row(out, "stage 1/2")[2:7] == ["layer_id", "30", "1", "30", f"{30 * 100 * item:,}"]
    assert "fragmented" not in out
    assert "layers 0–30 | 31–60" in out


def test_qwen3_235b_kv_per_layer(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "qwen3-235b", "--pages", "64", "--page-size", "16")
    assert rc == 0
    # K and V per layer: 2 × 64 pages × 16 tokens × 1024 bytes.
    assert f"({2 * 64 * 16 * 1024:,} B) each: layers 0–93 (94 layers)" in out
    assert stage_row(out, "prefill")[1:5] == ["layer_id", "188", "1", "188"]


def test_kimi_linear_hybrid_pp2(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "kimi-linear", "--pp", "2", "--pages", "32",
                         "--page-size", "16")
    assert rc == 0
    # Stage 1 holds layers 24-47: MLA on 27..47 every 4th (6), state on 18 KDA layers × 2.
    row = stage_row(out, "stage 1/2")
    assert row[2:6] == ["layer_id", "6", "+", "36"]
    assert f"({32 * 16 * 1152:,} B) each: layers 3–47 every 4th (12 layers)" in out
    assert f"({73_728 + 2_097_152:,} B) each: layers 0–2, 4–6" in out


def test_qwen3_next_ascend_legacy_with_state_ids(capsys):
    # Ascend + hybrid MHA + PP 2 -> legacy KV slicing (SGLang's Ascend dispatch); state pairs by id.
    rc, out, _ = run_cli(capsys, "--preset", "qwen3-next", "--pp-split", "20,28", "--stage", "1",
                         "--backend", "ascend", "--pages", "8")
    assert rc == 0, out
    row = stage_row(out, "stage 1/2")
    # Layers 20-47: full attention on 23..47 every 4th = 7 layers × K/V; 21 linear × 2 states.
    assert row[2:6] == ["legacy", "14", "+", "42"]
    assert f"({2 * 8 * 1024:,} B) each: layers 23–47 every 4th (7 layers)" in out
    assert f"({49_152 + 2_097_152:,} B) each" in out


def _state_peer(base: int) -> kvplan.Layout:
    """One MLA page entry (layer 0) and state entries for layers 0 (elided, item_len 0) and 1."""
    layout = kvplan.Layout([base], [64 * 1152], 1152, [0], ["kv"], page_size=1)
    return layout.with_state("conv", [base + (1 << 24), base + (2 << 24)], [64, 64], [0, 16],
                             [0, 1])


def test_state_bytes_are_booked_to_their_own_layer_when_a_state_pair_is_elided():
    # The elided layer-0 state pair emits no block; layer 1's 16-byte block is its own.
    src, dst = _state_peer(0x10_0000_0000), _state_peer(0x90_0000_0000)
    e = explain.explain([("prefill", src)], dst, title="t", pages=4)
    assert e.state_bytes_per_layer == {0: 0, 1: 16}
    assert e.kv_bytes_per_layer == {0: 4 * 1152}
    text = explain.render(e)
    assert "16 B each: layers 1 (1 layer)" in text
    assert "0 B each: layers 0 (1 layer)" in text


def test_json_layouts_round_trip(capsys, tmp_path):
    rc, first, _ = run_cli(capsys, "--preset", "deepseek-v3", "--pp", "2", "--pages", "64",
                           "--fragmentation", "0.25", "--write-layouts", str(tmp_path))
    assert rc == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["decode.json", "prefill-stage0.json", "prefill-stage1.json"]
    assert json.loads((tmp_path / "decode.json").read_text())["layer_ids"] == list(range(61))
    rc, again, _ = run_cli(capsys, "--prefill", str(tmp_path / "prefill-stage0.json"),
                           "--prefill", str(tmp_path / "prefill-stage1.json"),
                           "--decode", str(tmp_path / "decode.json"), "--pages", "64",
                           "--fragmentation", "0.25")
    assert rc == 0
    for label in ("stage 0/2", "stage 1/2"):
        assert stage_row(again, label)[:7] == stage_row(first, label)[:7]


def test_incompatible_layouts_exit_1_with_report(capsys, tmp_path):
    ds = get_preset("deepseek-v3")
    (tmp_path / "p.json").write_text(json.dumps(
        ds.layout(range(31, 61), page_size=1, capacity=64, pp_rank=1, pp_size=2).to_dict()))
    (tmp_path / "d.json").write_text(json.dumps(
        ds.layout(range(60), page_size=1, capacity=64).to_dict()))  # decode lacks layer 60
    rc, out, _ = run_cli(capsys, "--prefill", str(tmp_path / "p.json"),
                         "--decode", str(tmp_path / "d.json"), "--pages", "16")
    assert rc == 1
    assert "NOT COMPATIBLE" in out and "decode has no entry for layer 60" in out


def test_bad_input_exit_2(capsys):
    rc, _, err = run_cli(capsys, "--preset", "deepseek-v3", "--fragmentation", "2")
    assert rc == 2 and "--fragmentation" in err
    rc, _, err = run_cli(capsys, "--preset", "deepseek-v3", "--pp", "2", "--stage", "5")
    assert rc == 2 and "--stage" in err


# ------------------------------------------------------------------------ plot


def test_plot_writes_png(capsys, tmp_path):
    import matplotlib  # noqa: F401  (the 'plot' extra is part of the test extra: never skipped)

    path = tmp_path / "explain.png"
    rc, out, _ = run_cli(capsys, "--preset", "kimi-linear", "--pp", "2", "--pages", "256",
                         "--fragmentation", "0.3", "--plot", str(path))
    assert rc == 0 and f"plot written to {path}" in out
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_import_kvplan_does_not_import_matplotlib_or_engines():
    code = ("import sys, kvplan, kvplan.cli; kvplan.cli.build_parser(); "
            "bad = [m for m in sys.modules if m.startswith(('matplotlib', 'kvplan.engines', "
            "'mooncake', 'memfabric'))]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------ --layout cross-layer


def comparison_row(out: str, label: str) -> list[str]:
    block = out.split("blocks per request, per-layer vs cross-layer")[1]
    for line in block.splitlines()[2:]:
        if line.strip().startswith(label):
            return line.split()
    raise AssertionError(f"no comparison row {label!r} in\n{out}")


def test_cross_layer_deepseek_fully_fragmented(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "512",
                         "--fragmentation", "1", "--layout", "cross-layer")
    assert rc == 0
    # One pool on both sides holding all 61 layers: the group is the whole page on both sides,
    # one block per run (512 runs); the same bytes as 61 per-layer entries.
    assert "cross-layer KV pools (state per layer)" in out
    row = stage_row(out, "prefill")
    assert row[1:6] == ["layer_id", "61", "512", "512", f"{61 * 512 * 1152:,}"]
    assert comparison_row(out, "prefill")[1:5] == [f"{61 * 512:,}", "512", "61.0×", "1"]
    # Bytes per layer are counted per layer even though the plan's blocks span all of them.
    assert f"{512 * 1152:,} B) each: layers 0–60 (61 layers)" in out
    assert ("destination fully fragmented: 512× more blocks than contiguous (512 runs for 512 "
            "pages; one block per run per coalesced group)") in out


def test_cross_layer_kimi_linear_pp2_compares_both_layouts(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "kimi-linear", "--pp", "2", "--pages", "64",
                         "--page-size", "16", "--fragmentation", "1", "--layout", "cross-layer")
    assert rc == 0
    # Each stage: 6 MLA layers in its pool, 18 KDA layers x 2 state components. Its pool page
    # is half of the decode's: one block per page (64), against 6 x 64 per-layer blocks.
    assert stage_row(out, "stage 0/2")[2:9] == ["layer_id", "6", "+", "36", "state", "64",
                                               f"{64 + 36}"]
    assert comparison_row(out, "stage 0/2")[2:7] == [f"{6 * 64}", "64", "6.0×", "1", "36"]
    assert comparison_row(out, "total")[1:4] == [f"{12 * 64}", "128", "6.0×"]
    assert "strides differ for 6 paired entries" in out


def test_cross_layer_pp2_low_fragmentation_says_when_it_costs_more(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "kimi-linear", "--pp", "2", "--pages", "64",
                         "--page-size", "16", "--layout", "cross-layer")
    assert rc == 0
    # Contiguous: per-layer 6 blocks per stage; cross-layer one per page, 64.
    assert comparison_row(out, "stage 1/2")[2:5] == ["6", "64", "0.1×"]
    assert "cross-layer moves more blocks here" in out


def test_layout_is_for_presets_only(capsys, tmp_path):
    path = tmp_path / "l.json"
    path.write_text(json.dumps(get_preset("deepseek-v3").layout(range(2), page_size=1,
                                                                capacity=8).to_dict()))
    rc, out, err = run_cli(capsys, "--prefill", str(path), "--decode", str(path), "--layout",
                           "cross-layer")
    assert rc == 2 and out == ""
    assert "--layout only apply to --preset" in err
    rc, _, err = run_cli(capsys, "--preset", "deepseek-v3", "--layout", "pooled")
    assert rc == 2 and "--layout" in err


def test_explain_names_window_ring_and_sidecar_entries() -> None:
    from kvplan.explain.analysis import entry_kinds

    oss = get_preset("gpt-oss-120b").layout(range(36), page_size=16, capacity=8)
    assert entry_kinds(oss) == [("window 128", list(range(0, 36, 2)),
                                 "a request's last 128 tokens")]
    ds = get_preset("deepseek-v3.2").layout(range(4), page_size=1, capacity=8)
    assert entry_kinds(ds) == [("sidecar indexer", [0, 1, 2, 3],
                                "with its layer's KV entry, every token")]
    assert entry_kinds(get_preset("deepseek-v3").layout(range(4), page_size=1, capacity=8)) == []
    # Ring rows and a TP channel split exclude each other: the ring-state model's entries are
    # qwen3-next's without the split.
    nx = get_preset("qwen3-next")
    plain = dataclasses.replace(nx, state=tuple(StateSpec(s.name, s.bytes_per_slot)
                                                for s in nx.state))
    ringed = plain.layout(range(8), page_size=1, capacity=8, state_slots=4)
    ringed = ringed.with_rings([2 if k == "state" else None for k in ringed.kinds])
    (name, layers, what), = [k for k in entry_kinds(ringed) if k[0].startswith("ring")]
    assert (name, layers) == ("ring 2", [0, 1, 2, 4, 5, 6]) and "plan_ring" in what


# ------------------------------------------------------------------------ coalescing blockers

_OWN_BUFFER = "its own buffer: its item does not follow the previous entry's on the prefill side"
_STRIDE = "its page stride differs from the previous entry's on the prefill side"


def _coalescing_section(out: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index("coalescing (what keeps page pairs from emitting their blocks together):")
    end = next((k for k in range(start + 1, len(lines)) if not lines[k].strip()), len(lines))
    return [" ".join(line.split()) for line in lines[start + 1:end]]


@pytest.mark.parametrize(("preset", "want"), [
    # 36 layers: the 18 even ones are 128-token windows (K and V each), every entry its own
    # buffer; the first pair (layer 0's K, a window entry) has nothing before it.
    ("gpt-oss-120b", ["window 128 36 pairs, 0 joined with the pair before",
                      f"35 apart: {_OWN_BUFFER}",
                      "KV k 18 pairs, 0 joined with the pair before", f"18 apart: {_OWN_BUFFER}",
                      "KV v 18 pairs, 0 joined with the pair before", f"18 apart: {_OWN_BUFFER}"]),
    # 61 layers, latent (1152 B per token) and indexer (132 B) alternate: each stride differs
    # from its neighbour's.
    ("deepseek-v3.2", ["KV kv 61 pairs, 0 joined with the pair before", f"60 apart: {_STRIDE}",
                       "sidecar indexer 61 pairs, 0 joined with the pair before",
                       f"61 apart: {_STRIDE}"]),
    # MHA: 94 K buffers then 94 V buffers, all of one stride, none following another.
    ("qwen3-235b", ["KV k 94 pairs, 0 joined with the pair before", f"93 apart: {_OWN_BUFFER}",
                    "KV v 94 pairs, 0 joined with the pair before", f"94 apart: {_OWN_BUFFER}"]),
])
def test_explain_names_what_keeps_entries_from_coalescing(capsys, preset: str,
                                                          want: list[str]) -> None:
    rc, out, _ = run_cli(capsys, "--preset", preset, "--page-size", "16", "--pages", "64")
    assert rc == 0
    assert _coalescing_section(out) == want


def test_explain_coalescing_of_pools_and_window_pools(capsys) -> None:
    rc, out, _ = run_cli(capsys, "--preset", "deepseek-v3", "--pages", "8", "--layout",
                         "cross-layer")
    assert rc == 0
    assert _coalescing_section(out) == ["KV kv 61 pairs, 60 joined with the pair before"]
    rc, out, _ = run_cli(capsys, "--preset", "gpt-oss-120b", "--layers", "4", "--page-size",
                         "16", "--pages", "8", "--layout", "cross-layer")
    assert rc == 0
    section = _coalescing_section(out)
    assert section[0] == "window 128 4 pairs, 0 joined with the pair before"
    assert section[1].startswith("3 apart: its items follow the previous entry's, but the "
                                 "template plans by token")
    assert section[2] == ("4 emit a block per page, not per run: a page stride longer than the "
                          "item")


def test_explain_rows_come_from_the_core() -> None:
    from kvplan.explain.analysis import coalescing_rows

    p = get_preset("deepseek-v3.2", 2)
    src = p.layout(range(2), page_size=4, capacity=8)
    dst = p.layout(range(2), page_size=4, capacity=8, base=kvplan.presets.DECODE_BASE)
    t = kvplan.Template(src, dst)
    assert [k for k, _, _ in t.coalescing] == ["first", "strides", "strides", "strides"]
    rows = coalescing_rows(t, dst)
    assert [(r.kind, r.pairs, r.joined, r.per_page) for r in rows] == \
        [("KV kv", 2, 0, 0), ("sidecar indexer", 2, 0, 0)]
    assert rows[0].blockers == [(_STRIDE, 1)] and rows[1].blockers == [(_STRIDE, 2)]


@pytest.mark.parametrize("preset", ["deepseek-v4", "glm-5"])
def test_explain_runs_the_new_presets(capsys, preset: str) -> None:
    rc, out, err = run_cli(capsys, "--preset", preset, "--page-size", "64", "--pages", "16")
    assert rc == 0, err
    p = get_preset(preset)
    assert f"kvplan explain: {p.name}" in out and p.description in out
    entries = p.layout(range(p.num_layers), page_size=64, capacity=16)
    kinds = dict((name, layers) for name, layers, _ in explain.analysis.entry_kinds(entries))
    assert kinds["sidecar indexer"] == (list(range(1, 61, 2)) if preset == "deepseek-v4"
                                        else list(range(78)))
    if preset == "deepseek-v4":
        assert kinds["window 128"] == list(range(61))
    # Bytes: every token of the full layers' components, the window layers' last 128 tokens.
    tokens = 16 * 64
    if preset == "glm-5":
        want = 78 * tokens * (1152 + 132)
    else:
        # vLLM's geometry: every layer's window (128 tokens of 584 B fp8_ds_mla rows), on 30
        # layers a 584 B row per 4 tokens plus a 132 B indexer entry per row, and on the other
        # 31 a 584 B row per 128 tokens.
        want = 61 * 128 * 584 + 30 * tokens // 4 * (584 + 132) + 31 * tokens // 128 * 584
    e = explain.explain([("prefill", entries)],
                        p.layout(range(p.num_layers), page_size=64, capacity=16,
                                 base=kvplan.presets.DECODE_BASE),
                        title=p.name, pages=16)
    assert e.bytes == want and e.ok


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "deepseek-v4", "glm-5"])
def test_explain_refuses_a_pool_for_multi_component_presets(capsys, preset: str) -> None:
    rc, out, err = run_cli(capsys, "--preset", preset, "--layout", "cross-layer", "--pages", "8")
    assert rc == 2 and out == ""
    assert f"--layout cross-layer: preset {preset!r} keeps each layer in" in err
    assert "per-layer only" in err and "address space" not in err
