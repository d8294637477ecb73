"""Block-scaled MXFP8 (``fp8_e4m3:mx``) in conversion plans: bf16 -> mx quantized on the
prefill and mx -> bf16 dequantized on the decode, bit-identical to the decode running the mx
rule itself (a float64 reference written from the rule, shared with no executor); the layout
rules of mx scale entries; refusals; same-representation mx pairs as byte copies."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from importlib import resources

import jsonschema
import numpy as np
import pytest

import kvplan
from kvplan.quant import E8M0_NAN, MX_BLOCK, decode_e8m0, dequantize_mx, quantize_mx
from kvplan.testing.oracle import Memory, apply_conversion, apply_plan

from support.convert_cases import (Deployment, _reference_values, decode, expected_decode,
                                   fill_twin, plain_decode, prefill, quantized_prefill,
                                   reference_quantize_mx)
from test_convert import REQUESTS, SEED, _staging, run_case, run_dequantizing_case

TPS = (1, 2, 4, 8)
RATIOS = ((1, 1), (2, 1), (1, 2), (4, 2))


def _mha(**kw: object) -> Deployment:
    base: dict[str, object] = dict(kv_heads=8, head_dim=32, scales="mx", capacity_p=6,
                                   capacity_d=6)
    base.update(kw)
    return Deployment(**base)  # type: ignore[arg-type]


def _mla(**kw: object) -> Deployment:
    # DeepSeek-like: a 576-wide latent (18 mx blocks) quantized, a bf16 rope part kept.
    base: dict[str, object] = dict(mla=True, latent=576, rope=64, scales="mx", capacity_p=4,
                                   capacity_d=4)
    base.update(kw)
    return Deployment(**base)  # type: ignore[arg-type]


def _cases(deps: list[Deployment], requests: int, seed: int, dequantize: bool = False) -> int:
    rng = np.random.default_rng(seed + SEED)
    for dep in deps:
        for _ in range(requests):
            if dequantize:
                run_dequantizing_case(dep, rng)
            else:
                run_case(dep, rng)
    return len(deps) * requests


def test_mha_bf16_to_mx_equals_the_decode_quantizing_itself() -> None:
    deps = [_mha(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d)
            for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(TPS, TPS, (1, 2), RATIOS)]
    assert _cases(deps, REQUESTS or 3, seed=21) >= 384


def test_mha_head_dim_16_where_every_rank_slice_is_whole_blocks() -> None:
    # 16-element heads: a rank's slice is whole 32-element blocks iff it holds an even number
    # of heads (TP 1, 2, 4 of 8 heads); TP 8 would give 16-element decode tokens.
    deps = [_mha(head_dim=16, tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d)
            for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product((1, 2, 4), (1, 2, 4), (1, 2),
                                                                  RATIOS)]
    assert _cases(deps, REQUESTS or 2, seed=22) >= 144


def test_mla_576_latent_to_mx_and_bf16_rope_equal_the_decode_quantizing_itself() -> None:
    deps = [_mla(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d)
            for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product((1, 2, 8), (1, 4), (1, 2),
                                                                  RATIOS)]
    assert _cases(deps, REQUESTS or 3, seed=23) >= 144


def test_mx_to_bf16_equals_the_decode_dequantizing_itself() -> None:
    # Heads re-sliced both ways: each decode rank gathers its heads' values and E8M0 blocks
    # from every prefill rank that holds some of them.
    deps = [_mha(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d)
            for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(TPS, TPS, (1, 2), RATIOS)]
    deps += [_mla(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d)
             for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product((1, 4), (1, 2), (1, 2),
                                                                   RATIOS)]
    assert _cases(deps, REQUESTS or 3, seed=24, dequantize=True) >= 192


def test_mx_network_bytes_are_about_0516_of_the_bf16_plans() -> None:
    rng = np.random.default_rng(25)
    for tp_p, tp_d in itertools.product(TPS, TPS):
        dep = _mha(head_dim=128, tp_p=tp_p, tp_d=tp_d, ps_p=4, ps_d=4, capacity_p=4,
                   capacity_d=4)
        network, bf16 = run_case(dep, rng)
        # 1 byte per value + 1 byte per 32 values, against 2 bytes per value.
        assert network * 64 == bf16 * 33, (dep, network / bf16)


def test_rows_say_e8m0_and_blocks_of_32() -> None:
    dep = _mha(tp_p=2, tp_d=1, ps_p=2, ps_d=4)
    real, _ = decode(dep, 0)
    src = prefill(dep, 1, 0, seed=3)
    staging = _staging([src])
    pages = np.arange(2, dtype=np.int64)
    plan = kvplan.ConversionTemplate(src.layout, real.layout).plan(
        pages, pages[:1], (staging.base, staging.data.size), n_tokens=4)
    assert plan.n_rows > 0
    assert {kvplan.SCALE_FORMATS[c] for c in plan.scale_formats.tolist()} == {"e8m0"}
    assert set(plan.group_elems.tolist()) == {MX_BLOCK}
    assert plan.scale_bytes * MX_BLOCK == plan.converted_bytes
    # The per-token layouts keep float32 scales.
    dep = Deployment(tp_p=1, tp_d=1, scales="per_token")
    real, _ = decode(dep, 0)
    src = prefill(dep, 0, 0, seed=3)
    staging = _staging([src])
    plan = kvplan.ConversionTemplate(src.layout, real.layout).plan(
        pages, pages, (staging.base, staging.data.size))
    assert {kvplan.SCALE_FORMATS[c] for c in plan.scale_formats.tolist()} == {"float32"}


# Special values --------------------------------------------------------------------------

def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values truncated to bf16 (they are chosen bf16-exact) and widened back."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def _special_blocks() -> np.ndarray:
    tiny = np.float32(2.0 ** -133)  # the smallest bf16 subnormal
    blocks = [
        np.zeros(32),                                        # all zero: scale byte 0
        np.concatenate([[-0.0], np.zeros(31)]),              # negative zero keeps its sign
        np.full(32, tiny) * np.arange(32),                   # bf16 subnormals: clamped exp
        np.concatenate([[3.0e38, -1.0], np.ones(30)]),       # near float32's top
        np.concatenate([[448.0, 449.0, 480.0, -464.0], np.ones(28) * 7.0]),  # saturating
        np.concatenate([[1.0, np.nan], np.ones(30)]),        # NaN
        np.concatenate([[-np.inf, 2.0], np.ones(30)]),       # infinity
        np.concatenate([[1.0, 1.0 + 2.0 ** -4, 1.0 + 3 * 2.0 ** -4], np.zeros(29)]),  # ties
        np.linspace(-1.0, 1.0, 32) * 2.0 ** 20,
        np.linspace(-1.0, 1.0, 32) * 2.0 ** -20,
    ]
    return _bf16(np.concatenate(blocks).astype(np.float32))


def test_special_values_follow_the_rule() -> None:
    x = _special_blocks()
    codes, scales = quantize_mx(x)
    want_codes, want_scales = reference_quantize_mx(x)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    assert scales[0] == 0 and scales[1] == 0 and codes[32] == 0x80
    assert scales[2] == 0  # shared exponent clamped at -127
    assert scales[5] == E8M0_NAN and scales[6] == E8M0_NAN
    assert codes[5 * 32 + 1] & 0x7F == 0x7F and codes[6 * 32] == 0xFF  # -inf: NaN, sign kept
    # Saturation: 449, 480 and -464 clamp to +-448 (code 0x7E), never NaN.
    assert codes[4 * 32:4 * 32 + 4].tolist() == [0x7E, 0x7E, 0x7E, 0xFE]
    # Random bf16 blocks over the whole exponent range match the reference too.
    rng = np.random.default_rng(26)
    r = (rng.standard_normal(32 * 400) * np.exp2(rng.integers(-130, 120, 32 * 400))).astype(
        np.float32)
    r = _bf16(r)
    assert all(np.array_equal(a, b) for a, b in zip(quantize_mx(r), reference_quantize_mx(r)))


def _reference_round(y: np.ndarray, out_dtype: str) -> np.ndarray:
    """float64 values rounded to bf16 or fp16 bits (nearest, ties to even, subnormals and
    overflow to infinity by IEEE), from the formats' definitions."""
    man, bias = (7, 127) if out_dtype == "bf16" else (10, 15)
    emin, emax = 1 - bias, bias
    out = np.zeros(y.size, dtype=np.uint16)
    for i, v in enumerate(y.tolist()):
        sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
        if math.isnan(v):
            out[i] = sign | (0x7FC0 if out_dtype == "bf16" else 0x7E00)
            continue
        a = abs(v)
        e = max(math.frexp(a)[1] - 1, emin) if 0 < a < math.inf else emin
        n = round(a / 2.0 ** (e - man)) if a < math.inf else 0  # half to even
        if n == 2 ** (man + 1):
            e, n = e + 1, 2 ** man
        if a == math.inf or e > emax:
            out[i] = sign | ((2 * bias + 1) << man)
        elif n < 2 ** man:  # subnormal (exponent field 0)
            out[i] = sign | n
        else:
            out[i] = sign | ((e + bias) << man) | (n - 2 ** man)
    return out.view(np.uint8)


@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_dequantizing_special_scales_and_codes(out_dtype: str) -> None:
    rng = np.random.default_rng(27)
    codes = rng.integers(0, 256, 32 * 64, dtype=np.uint8)
    scales = np.concatenate([[0, 1, 127, 254, 255, 100, 150, 143], rng.integers(0, 255, 56)]
                            ).astype(np.uint8)
    got = dequantize_mx(codes, scales, MX_BLOCK, out_dtype)
    values = _reference_values(codes, "fp8_e4m3")
    values[(codes & 0x7F) == 0x7F] = np.nan
    y = values.reshape(-1, 32) * np.exp2(scales.astype(np.float64) - 127)[:, None]
    y[scales == 255] = np.nan
    want = _reference_round(y.reshape(-1), out_dtype)
    nan = np.isnan(y.reshape(-1))
    got16, want16 = got.view(np.uint16), want.view(np.uint16)
    assert nan.any() and np.array_equal(got16[~nan], want16[~nan])
    # NaN: the format's quiet NaN with the sign of the code.
    quiet = 0x7FC0 if out_dtype == "bf16" else 0x7E00
    signs = (codes[nan].astype(np.uint16) & 0x80) << 8
    assert np.array_equal(got16[nan], signs | quiet)
    assert np.isnan(decode_e8m0(np.array([255], dtype=np.uint8)))[0]
    assert decode_e8m0(np.array([0, 127, 254], dtype=np.uint8)).tolist() == [
        2.0 ** -127, 1.0, 2.0 ** 127]


def test_special_values_through_a_plan_equal_the_decode_quantizing_itself() -> None:
    dep = _mha(tp_p=1, tp_d=2, ps_p=2, ps_d=1, capacity_p=4, capacity_d=8)
    real, twin = decode(dep, 1)
    src = prefill(dep, 0, 0, seed=5)
    special = _special_blocks()
    bits = (special.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.uint8)
    kv = int(sum(e.data_len for e in src.layout.entries()))
    src.arena[:kv] = np.resize(bits, kv)
    src_pages, dst_pages = np.array([3, 0, 2], dtype=np.int64), np.arange(6, dtype=np.int64)
    staging = _staging([src])
    plan = kvplan.ConversionTemplate(src.layout, real.layout).plan(
        src_pages, dst_pages, (staging.base, staging.data.size), n_tokens=6)
    apply_conversion(plan, src.memory, staging, real.memory)
    fill_twin(dep, [src], twin, src_pages, dst_pages, 6)
    want = expected_decode(dep, 1, real, twin, dst_pages, 6)
    assert np.array_equal(real.arena, want)


# Same representation: byte copies --------------------------------------------------------

def test_mx_to_mx_plans_as_byte_copies_including_the_scale_entries() -> None:
    dep = _mha(tp_p=2, tp_d=2, ps_p=2, ps_d=2)
    src = quantized_prefill(dep, 1, 0, seed=8)
    _, dst = plain_decode(dep, 1)  # the decode's mx twin: mx KV and E8M0 scale entries
    template = kvplan.ConversionTemplate(src.layout, dst.layout)
    assert not template.converts
    pages_s, pages_d = np.array([4, 1, 2], dtype=np.int64), np.array([0, 5, 3], dtype=np.int64)
    staging = _staging([src])
    plan = template.plan(pages_s, pages_d, (staging.base, staging.data.size))
    direct = kvplan.Template(src.layout, dst.layout).plan(pages_s, pages_d)
    assert plan.n_rows == 0 and plan.network_bytes == direct.total_bytes
    scale_entries = [e for e in dst.layout.entries() if str(e.role).endswith("_scale")]
    assert scale_entries
    want = dst.arena.copy()
    apply_plan(direct, src.memory, Memory(want, dst.memory.base))
    apply_conversion(plan, src.memory, staging, dst.memory)
    assert np.array_equal(dst.arena, want)
    for e in scale_entries:  # every page's scales arrived
        at = e.data_ptr - dst.memory.base
        for s_page, d_page in zip(pages_s, pages_d):
            s_e = next(x for x in src.layout.entries()
                       if (x.layer_id, x.role) == (e.layer_id, e.role))
            s_at = s_e.data_ptr - src.memory.base + int(s_page) * s_e.item_len
            d_at = at + int(d_page) * e.item_len
            assert np.array_equal(dst.arena[d_at:d_at + e.item_len],
                                  src.arena[s_at:s_at + s_e.item_len])


# Layout rules and refusals ---------------------------------------------------------------

def _layout(repr_: str | None, *, head_dim: int = 32, dtype_size: int = 1,
            scale_item: int | None = None, base: int = 1 << 20) -> kvplan.Layout:
    page, heads = 2, 2
    item = page * heads * head_dim * dtype_size
    scale = page * (heads * head_dim // 32) if scale_item is None else scale_item
    layout = kvplan.Layout([base, base + (1 << 16)], [4 * item, 4 * scale], [item, scale],
                           [0, 0], ["k", "k_scale"], page_size=page, kv_heads=heads,
                           head_dim=head_dim, dtype_size=dtype_size)
    return layout.with_representations([repr_, None]) if repr_ else layout


@pytest.mark.parametrize("repr_,kw,match", [
    ("bf16:mx", dict(dtype_size=2), "carry no scales"),
    ("fp8_e5m2:mx", {}, "fp8_e4m3 only.*fp8_e5m2"),
    ("int8:mx", {}, "fp8_e4m3 only.*int8"),
    ("fp8_e4m3:mx", dict(head_dim=8, scale_item=2), "holds 16 elements.*multiple of 32"),
    ("fp8_e4m3:mx", dict(scale_item=8), r"k_scale\) has item_len 8.*page_size 2 × 2 .*1 byte"),
])
def test_mx_layout_errors_name_the_entry_and_values(repr_: str, kw: dict[str, int],
                                                    match: str) -> None:
    with pytest.raises(kvplan.LayoutError, match=match) as err:
        _layout(repr_, **kw)
    assert "entry 0" in str(err.value)


def test_mx_round_trips_wire_dict_and_schema() -> None:
    layout = _layout("fp8_e4m3:mx")
    assert layout.representations == ["fp8_e4m3:mx", None]
    assert kvplan.Layout.from_dict(layout.to_dict()) == layout
    assert kvplan.Layout.from_bytes(layout.to_bytes()) == layout
    schema = json.loads(resources.files("kvplan").joinpath("schemas/layout.schema.json")
                        .read_text())
    jsonschema.validate(layout.to_dict(), schema)
    # The existing layouts' codes are unchanged: mx is appended (scale layout code 4).
    assert layout.to_bytes().count(bytes([2, 4, 0, 0, 0, 0, 0, 0])) == 1
    per_token = _layout("fp8_e4m3:per_token", scale_item=8)
    assert per_token.to_bytes().count(bytes([2, 2, 0, 0, 0, 0, 0, 0])) == 1


@pytest.mark.parametrize("src_repr,dst_repr", [
    ("fp8_e4m3:mx", "fp8_e4m3:per_token"),
    ("fp8_e4m3:per_token", "fp8_e4m3:mx"),
    ("fp8_e4m3:mx", "fp8_e4m3:per_token_head"),
    ("fp8_e4m3:per_token_head", "fp8_e4m3:mx"),
])
def test_mx_and_per_token_requantizing_is_refused_naming_both(src_repr: str,
                                                             dst_repr: str) -> None:
    def sized(r: str, base: int) -> kvplan.Layout:
        scale = {"mx": 4, "per_token": 8, "per_token_head": 16}[r.split(":")[1]]
        return _layout(r, scale_item=scale, base=base)
    with pytest.raises(kvplan.PairingError, match="re-quantizing") as err:
        kvplan.ConversionTemplate(sized(src_repr, 1 << 20), sized(dst_repr, 1 << 30))
    assert err.value.kind == "conversion"
    assert src_repr in str(err.value) and dst_repr in str(err.value)


@pytest.mark.parametrize("dequantize", [False, True])
def test_mx_across_a_head_split_of_partial_blocks_is_refused(dequantize: bool) -> None:
    # 16-element heads; one side's rank holds one head: each rank's slice of a token is half a
    # block, so one shared scale would span two ranks.
    if dequantize:
        dep = _mha(head_dim=16, tp_p=2, tp_d=8)
        src = quantized_prefill(dep, 0, 0, seed=1)
        # The bf16 decode alone (its mx twin would hold 16-element tokens, a LayoutError).
        dst, _ = plain_decode(dataclasses.replace(dep, scales="per_token"), 0)
    else:
        dep = _mha(head_dim=16, tp_p=8, tp_d=2)
        src = prefill(dep, 0, 0, seed=1)
        dst, _ = decode(dep, 0)
    with pytest.raises(kvplan.PairingError, match="16 elements, not whole mx blocks") as err:
        kvplan.ConversionTemplate(src.layout, dst.layout)
    assert err.value.kind == "conversion"
    assert "bf16" in str(err.value) and "fp8_e4m3:mx" in str(err.value)
