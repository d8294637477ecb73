"""The hybrid presets' state entries (``kvplan.presets``: qwen3-next's Gated DeltaNet,
Kimi-Linear's and Kimi-K3's KDA) declare the TP channel split their engines cut them by, and a
slot request between any two TP sizes moves what the byte oracle says."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.presets import DECODE_BASE, PREFILL_BASE, ModelPreset, StateSpec, get_preset
from kvplan.testing.oracle import Memory, apply_plan, reference_copy

TPS = (1, 2, 4, 8)


@pytest.mark.parametrize("key", ["qwen3-next", "kimi-linear", "kimi-k3"])
def test_hybrid_presets_move_each_decode_rank_the_channels_it_holds(key: str) -> None:
    """The hybrid presets' state entries declare the split their engines cut them by (the GDN
    conv state's q|k|v sub-blocks, the KDA conv states' 3 rows, the recurrent states' heads):
    between every TP pair of {1, 2, 4, 8}² a slot request writes each decode rank what the
    oracle says, every byte of its slot exactly once."""
    preset = get_preset(key, 4)
    slots = 2

    def rank(tp: int, r: int, base: int, fill: bool) -> tuple[kvplan.Layout, Memory]:
        layout = preset.layout(range(4), page_size=1, capacity=1, state_slots=slots, base=base,
                               tp_rank=r, tp_size=tp, memory_order="NHD")
        state = layout.entries("state")
        lo = min(e.data_ptr for e in state)
        size = max(e.data_ptr + e.data_len for e in state) - lo
        data = np.random.default_rng(tp * 8 + r).integers(0, 256, size, dtype=np.uint8) \
            if fill else np.zeros(size, np.uint8)
        return layout, Memory(data, lo)

    prefill = {tp: [rank(tp, r, PREFILL_BASE, True) for r in range(tp)] for tp in TPS}
    # As the engines cut them (model channels at TP 1, rows, sub-blocks): SGLang's GDN conv
    # state [channels, K - 1] over cat(q, k, v), its KDA conv state [K - 1, q | k | v], vLLM's
    # three KDA conv states [K - 1, channels], and 32 heads of recurrent state.
    recurrent = (32, 1, [])
    declared = {"qwen3-next": {"mamba_conv": (8192, 1, [2048, 2048, 4096]),
                               "mamba_temporal": recurrent},
                "kimi-linear": {"mamba_conv": (3 * 4096, 3, [4096] * 3),
                                "mamba_temporal": recurrent},
                "kimi-k3": {"kda_conv_q": (4096, 3, []), "kda_conv_k": (4096, 3, []),
                            "kda_conv_v": (4096, 3, []), "kda_recurrent": recurrent}}[key]
    for tp in TPS:
        layout = prefill[tp][0][0]
        got = {e.role: layout.state_channels[e.index] for e in layout.entries("state")}
        assert got == {role: (c // tp, rows, groups)
                       for role, (c, rows, groups) in declared.items()}, tp
    for tp_p, tp_d in [(a, b) for a in TPS for b in TPS]:
        for r_d in range(tp_d):
            dst, mem = rank(tp_d, r_d, DECODE_BASE, False)
            got, want = mem.copy(), mem.copy()
            written = np.zeros(got.data.size, dtype=bool)
            for src, src_mem in prefill[tp_p]:
                plan = kvplan.Template(src, dst).plan(kvplan.Request(slot=(1, 0)))
                apply_plan(plan, src_mem, got, written)
                assert plan.total_bytes == reference_copy(src, src_mem, dst, want, [], [],
                                                          src_slot=1, dst_slot=0)
            assert np.array_equal(got.data, want.data), (key, tp_p, tp_d, r_d)
            for e in dst.entries("state"):
                lo = e.data_ptr - mem.base
                assert written[lo:lo + e.item_len].all(), (key, tp_p, tp_d, r_d, e.role)


def test_a_tp_size_that_does_not_split_a_state_evenly_is_refused_naming_it() -> None:
    """qwen3-next's recurrent state has 32 heads: TP 64 cannot split it (before the split was
    declared, the slot was silently cut into 64 leading-byte shares)."""
    with pytest.raises(kvplan.LayoutError, match=r"mamba_temporal.*\[32\].*tp_size 64"):
        get_preset("qwen3-next").layout(range(48), page_size=1, capacity=1, tp_size=64)


def test_a_replicated_state_spec_is_whole_on_every_rank_and_replicated_in_the_manifest() -> None:
    model = ModelPreset("rep", "replicated state", 4, "mha", 64, 2,
                        (StateSpec("s", 64, channels=0),), kv_heads=2, head_dim=16)
    for tp in (1, 2, 4):
        layout = model.layout(range(4), page_size=1, capacity=2, tp_size=tp)
        entry = layout.entries("state")[0]
        assert (entry.item_len, layout.state_channels[entry.index]) == (64, (0, 1, []))
        kvplan.check_manifest(layout, model.manifest())
    assert model.manifest().components[-1].sharding == "replicated"
