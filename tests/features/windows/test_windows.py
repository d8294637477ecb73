"""Sliding-window entries (``Layout.with_windows``): a window entry holds only a request's last
W tokens live, so a transfer moves only those, and a delta request only those the decode lacks.
Checked against the byte oracle (which writes a window entry's last W tokens from the layout
definitions) for page-size ratios, TP slicing, memory orders, cross-layer pools, hybrid state and
delta requests; and the rules: a window pairs only with the same window, one window size per
template, planners that move every token refuse window templates, the window is on the wire."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.testing.ranks import Model, Rank, check_request, rank_memory
from kvplan.testing.strategies import Request, requests


@st.composite
def window_requests(draw: st.DrawFn) -> tuple[Request, int, int]:
    case = draw(requests())
    n = case.n_tokens
    if n is None:
        n = min(len(case.src_pages) * case.prefill.page_size,
                len(case.dst_pages) * case.decode.page_size)
    model = dataclasses.replace(case.model, layers=max(2, case.model.layers))
    # At most the tokens each side's buffers hold (a wider window is a layout error), still
    # often wider than the request.
    held = min(case.prefill.capacity * case.prefill.page_size,
               case.decode.capacity * case.decode.page_size)
    return dataclasses.replace(case, model=model), draw(st.integers(1, min(30, held))), \
        draw(st.integers(0, n))


@settings(max_examples=1000)
@given(window_requests())
def test_window_layers_move_their_last_tokens_byte_exact(drawn: tuple[Request, int, int]) -> None:
    case, window, skip = drawn
    model = dataclasses.replace(case.model, window=window)
    check_request(model, case.prefill, case.decode, case.src_pages, case.dst_pages,
                  n_tokens=case.n_tokens)
    check_request(model, case.prefill, case.decode, case.src_pages, case.dst_pages,
                  n_tokens=case.n_tokens, skip_tokens=skip)


def test_window_layers_with_hybrid_state_and_cross_layer_pools() -> None:
    model = Model(layers=4, kv_heads=4, head_dim=2, dtype_size=2, state_bytes=32, window=5)
    pages = np.array([3, 0, 2, 1], dtype=np.int64)
    for cross in (False, True):
        for skip in (0, 3, 9, 13, 14):
            check_request(model, Rank(0, 2, 4, capacity=6, cross_layer=cross),
                          Rank(1, 4, 4, capacity=6, cross_layer=not cross), pages, pages,
                          n_tokens=14, skip_tokens=skip)


def pair(window: int | None = 8, page_size: int = 4) -> tuple[kvplan.Template, Model]:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2, window=window)
    src = rank_memory(model, Rank(0, 1, page_size, "NHD", 16), seed=1)
    dst = rank_memory(model, Rank(0, 1, page_size, "NHD", 16))
    return kvplan.Template(src.layout, dst.layout), model


def test_a_window_layer_moves_only_its_window_and_a_delta_only_what_the_decode_lacks() -> None:
    t, _ = pair(window=8)
    full, _ = pair(window=None)
    pages = np.arange(16, dtype=np.int64)
    token = full.plan(pages, pages, n_tokens=60).total_bytes // 60 // 2  # one layer's token
    assert t.plan(pages, pages, n_tokens=60).total_bytes == (60 + 8) * token
    # Tokens 56..60: the full layer moves 4, the window layer (52..60) the same 4.
    assert t.plan(pages, pages, n_tokens=60, skip_tokens=56).total_bytes == (4 + 4) * token
    # The decode holds 40: the full layer moves 20, the window layer its whole window (8).
    assert t.plan(pages, pages, n_tokens=60, skip_tokens=40).total_bytes == (20 + 8) * token


def test_pages_before_the_window_are_not_read_on_a_window_layer() -> None:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2, window=8)
    layout = rank_memory(model, Rank(0, 1, 4, "NHD", 16)).layout
    # Only the window layer (layer 1): the pages of tokens before its window are never read.
    window_only = kvplan.Layout(layout.data_ptrs[2:], layout.data_lens[2:], layout.item_lens[2:],
                                [1, 1], ["k", "v"], windows=[8, 8], page_size=4)
    t = kvplan.Template(window_only, window_only)
    pages = np.array([-1, -1, -1, 2, 3], dtype=np.int64)  # tokens 0..11 hold no live token
    assert t.plan(pages, pages, n_tokens=20).total_bytes == 2 * 8 * 16
    wider = window_only.with_windows([12, 12])  # tokens 8..19: position 2 is read
    with pytest.raises(kvplan.IndexBoundsError, match="-1"):
        kvplan.Template(wider, wider).plan(pages, pages, n_tokens=20)


def test_a_request_shorter_than_the_window_moves_whole() -> None:
    t, _ = pair(window=50)
    full, _ = pair(window=None)
    pages = np.arange(4, dtype=np.int64)
    assert t.plan(pages, pages, n_tokens=13).total_bytes == \
        full.plan(pages, pages, n_tokens=13).total_bytes


def test_a_window_paired_with_a_full_entry_is_a_pairing_error_naming_both() -> None:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2)
    src = rank_memory(model, Rank(0, 1, 4, "NHD", 8)).layout
    dst = rank_memory(dataclasses.replace(model, window=16), Rank(0, 1, 4, "NHD", 8)).layout
    with pytest.raises(kvplan.PairingError, match=r"prefill entry 1 \(layer 1, role k\) has no "
                       r"window \(full attention\) but its decode partner, entry 1, has a "
                       r"sliding window of 16 tokens") as e:
        kvplan.Template(src, dst)
    assert e.value.kind == "window"
    other = rank_memory(dataclasses.replace(model, window=32), Rank(0, 1, 4, "NHD", 8)).layout
    with pytest.raises(kvplan.PairingError, match="sliding window of 32 tokens but .* 16 tokens"):
        kvplan.Template(other, dst)


def test_two_window_sizes_in_one_template_are_refused() -> None:
    model = Model(layers=4, kv_heads=2, head_dim=4, dtype_size=2)
    layout = rank_memory(model, Rank(0, 1, 4, "NHD", 8)).layout
    two = layout.with_windows([None, None, 8, 8, None, None, 16, 16])
    with pytest.raises(kvplan.KvPlanError, match="sliding windows of 8 and 16 tokens; a "
                       "template plans one window size"):
        kvplan.Template(two, two)


def test_window_values_are_validated_where_the_layout_is_built() -> None:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2, state_bytes=8)
    layout = rank_memory(model, Rank(0, 1, 4, "NHD", 8)).layout
    n = len(layout)
    with pytest.raises(kvplan.LayoutError, match="must hold at least 1 token, got 0"):
        layout.with_windows([0] + [None] * (n - 1))
    state = layout.kinds.index("state")
    with pytest.raises(kvplan.LayoutError, match="a state entry"):
        layout.with_windows([8 if i == state else None for i in range(n)])
    with pytest.raises(kvplan.LayoutError, match="windows"):
        layout.with_windows([8])
    with pytest.raises(TypeError, match="windows must be None or a sequence"):
        layout.with_windows(["8"] * n)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"got \[-1,"):
        layout.with_windows([-1] * n)


def test_a_window_wider_than_its_buffer_is_a_layout_error_naming_the_values() -> None:
    # 16 pages of 4 tokens: a 64-token window fits, 65 tokens (say, a window in other units
    # than tokens) never slides within the buffer's context.
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2)
    layout = rank_memory(model, Rank(0, 1, 4, "NHD", 16)).layout
    n = len(layout)
    assert layout.with_windows([64] * n).windows == [64] * n
    with pytest.raises(kvplan.LayoutError, match=r"entry 0 \(layer 0, role k\): a sliding "
                       r"window of 65 tokens is wider than the 64 tokens its buffer holds "
                       r"\(16 pages of 4 tokens\)"):
        layout.with_windows([65] + [None] * (n - 1))
    with pytest.raises(kvplan.LayoutError, match="wider than the 64 tokens"):
        kvplan.Layout([1 << 20], [16 * 64], [64], [0], ["kv"], page_size=4, windows=[65])


def test_the_window_travels_on_the_wire_and_in_the_dict() -> None:
    t, model = pair(window=8)
    layout = rank_memory(model, Rank(0, 1, 4, "NHD", 16)).layout
    assert layout.windows == [None, 8, None, 8]  # K of layers 0, 1, then V of layers 0, 1
    assert [e.window for e in layout.entries()] == [None, 8, None, 8]
    assert "window=8" in repr(layout.entries()[1])
    back = kvplan.Layout.from_bytes(layout.to_bytes())
    assert back == layout and back.windows == layout.windows
    as_json = json.loads(json.dumps(layout.to_dict()))
    assert kvplan.Layout.from_dict(as_json) == layout
    full = rank_memory(dataclasses.replace(model, window=None), Rank(0, 1, 4, "NHD", 16)).layout
    assert "windows" not in full.to_dict()  # a layout without windows reads as before
    assert kvplan.Layout.from_bytes(full.to_bytes()).windows == [None] * 4
    # Layouts that differ only in a window are different layouts (and digest differently).
    assert full != layout and full.to_bytes() != layout.to_bytes()


def test_row_gathers_that_move_every_token_refuse_a_window_template() -> None:
    t, _ = pair(window=8)
    pages = np.arange(4, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="a row gather moves every token of a request; "
                       "this template has sliding-window entries"):
        t.plan_row_gather(pages, pages, pack=(1 << 40, 1 << 20))


def test_a_batch_of_window_requests_moves_what_each_moves_alone() -> None:
    t, _ = pair(window=6)
    src = [np.array([0, 1, 2], dtype=np.int64), np.array([5, 6, 7], dtype=np.int64)]
    dst = [np.array([3, 4, 5], dtype=np.int64), np.array([8, 9, 10], dtype=np.int64)]
    counts = [11, 9]
    batch = t.plan_batch([(s, d, n) for s, d, n in zip(src, dst, counts)])
    alone = [t.plan(s, d, n_tokens=n) for s, d, n in zip(src, dst, counts)]
    assert batch.total_bytes == sum(p.total_bytes for p in alone)
    def bytes_of(plan: object) -> set[tuple[int, int]]:  # (src byte, dst byte) pairs moved
        return {(s + k, d + k) for s, d, n in zip(*plan.as_lists()) for k in range(n)}
    assert bytes_of(batch) == set().union(*(bytes_of(p) for p in alone))


def test_gpt_oss_32k_moves_full_layers_and_the_windows_only() -> None:
    preset = kvplan.presets.get_preset("gpt-oss-120b")
    n, page = 32 * 1024, 16
    layers = range(preset.num_layers)
    src = preset.layout(layers, page_size=page, capacity=n // page + 8)
    dst = preset.layout(layers, page_size=page, capacity=n // page + 8,
                        base=kvplan.presets.DECODE_BASE)
    assert src.windows.count(128) == 36  # K and V of the 18 even layers
    whole = kvplan.Template(src.with_windows([None] * len(src)),
                            dst.with_windows([None] * len(dst)))
    t = kvplan.Template(src, dst)
    pages = np.arange(n // page, dtype=np.int64)
    token = 2 * preset.kv_bytes_per_token  # K and V of one layer
    floor = 18 * n * token + 18 * 128 * token  # full layers whole + the window of the others
    plan = t.plan(pages, pages, n_tokens=n)
    assert floor <= plan.total_bytes <= 1.02 * floor
    assert plan.total_bytes == floor  # the window starts on a page edge: exactly the floor
    ratio = plan.total_bytes / whole.plan(pages, pages, n_tokens=n).total_bytes
    assert 0.50 < ratio < 0.51
    # Contiguous pages: one block per (entry, run) on both kinds of layer.
    assert len(plan) == len(src)
    # The digest covers the windows: the same pages planned whole digest differently.
    assert plan.digest() != whole.plan(pages, pages, n_tokens=n).digest()
