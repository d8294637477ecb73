"""Conversion plans: representations on layouts, refusals, and bf16 -> fp8/int8 transfers whose
decode pool is bit-identical to the decode quantizing the same bf16 KV itself."""

from __future__ import annotations

import itertools
import json
import os
from importlib import resources

import jsonschema
import numpy as np
import pytest

import kvplan
from kvplan.quant import decode_fp8, encode_fp8, quantize_groups
from kvplan.testing.oracle import Memory, apply_conversion, reference_copy

from support.convert_cases import (Deployment, Peer, decode, dequantized_prefill, expected_decode,
                                   fill_twin, plain_decode, prefill, quantized_prefill,
                                   reference_encode)

TPS = (1, 2, 4, 8)
RATIOS = ((1, 1), (2, 1), (1, 2), (4, 2))
#: requests per deployment in the default run (scripts/fuzz raises it through the env)
REQUESTS = int(os.environ.get("KVPLAN_CONVERT_REQUESTS", "0")) or None
#: added to every seed (scripts/fuzz draws a fresh one; the default run is fixed)
SEED = int(os.environ.get("KVPLAN_CONVERT_SEED", "0"))


def _staging(sources: list[Peer]) -> Memory:
    size = sum(int(sum(e.data_len for e in s.layout.entries())) for s in sources) * 2 + 64
    arena = np.zeros(size, dtype=np.uint8)
    return Memory(arena, int(arena.ctypes.data))


def run_case(dep: Deployment, rng: np.random.Generator) -> tuple[int, int]:
    """One request from every prefill rank and stage into one decode rank; asserts the decode
    pool equals the reference. Returns (network bytes, bytes of the same request in bf16)."""
    d_rank = int(rng.integers(0, dep.tp_d))
    real, twin = decode(dep, d_rank)
    max_tokens = min(dep.capacity_p * dep.ps_p, dep.capacity_d * dep.ps_d, 16)
    n_tokens = int(rng.integers(1, max_tokens + 1))
    src_pages = rng.choice(dep.capacity_p, -(-n_tokens // dep.ps_p), replace=False)
    dst_pages = rng.choice(dep.capacity_d, -(-n_tokens // dep.ps_d), replace=False)
    ranks = range(1) if dep.mla else range(dep.tp_p)
    sources = [prefill(dep, r, s, seed=int(rng.integers(1 << 30)))
               for r in ranks for s in range(dep.pp)]
    written = np.zeros(real.arena.size, dtype=bool)
    network = bf16 = 0
    for src in sources:
        template = kvplan.ConversionTemplate(src.layout, real.layout)
        staging = _staging([src])
        plan = template.plan(src_pages, dst_pages, (staging.base, staging.data.size),
                             n_tokens=n_tokens)
        assert plan.staging_bytes == plan.gathered_bytes + plan.converted_bytes + plan.scale_bytes
        apply_conversion(plan, src.memory, staging, real.memory, written)
        network += plan.network_bytes
        bf16 += kvplan.Template(src.layout, twin.layout).plan(
            src_pages, dst_pages, n_tokens=n_tokens).total_bytes
    fill_twin(dep, sources, twin, src_pages, dst_pages, n_tokens)
    want = expected_decode(dep, d_rank, real, twin, dst_pages, n_tokens)
    bad = np.flatnonzero(real.arena != want)
    assert bad.size == 0, f"{dep}: {bad.size} wrong decode bytes, the first at {bad[0]}"
    return network, bf16


def _mha_deployments() -> list[Deployment]:
    out = []
    for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(TPS, TPS, (1, 2), RATIOS):
        for scales in ("per_token", "per_token_head"):
            if scales == "per_token" and tp_p > tp_d:
                continue  # refused: test_per_token_across_prefill_ranks_is_refused
            out.append(Deployment(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d,
                                  scales=scales))
    return out


def _mla_deployments() -> list[Deployment]:
    return [Deployment(mla=True, tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d)
            for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(TPS, TPS, (1, 2), RATIOS)]


def _cases(deployments: list[Deployment], requests: int, seed: int) -> int:
    rng = np.random.default_rng(seed + SEED)
    for dep in deployments:
        for _ in range(requests):
            run_case(dep, rng)
    return len(deployments) * requests


def test_mha_bf16_to_fp8_equals_the_decode_quantizing_itself() -> None:
    # 192 deployments x 20 requests; with the MLA and dtype tests: > 10^4 cases.
    assert _cases(_mha_deployments(), REQUESTS or 20, seed=1) >= 3840


def test_mla_fp8_latent_and_bf16_rope_equal_the_decode_quantizing_itself() -> None:
    assert _cases(_mla_deployments(), REQUESTS or 40, seed=2) >= 5120


@pytest.mark.parametrize("out_dtype", ["fp8_e5m2", "int8"])
def test_other_quantized_dtypes(out_dtype: str) -> None:
    deps = [Deployment(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d, out_dtype=out_dtype,
                       scales="per_token_head")
            for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(TPS, TPS, (1, 2), RATIOS)]
    assert _cases(deps, REQUESTS or 6, seed=3) >= 768


def test_network_bytes_are_at_most_051_of_the_bf16_plans() -> None:
    rng = np.random.default_rng(4)
    for tp_p, tp_d in itertools.product(TPS, TPS):
        # Llama-3-8B-like: 8 KV heads of 128; per_token_head scales add 4 bytes per 128 values.
        dep = Deployment(kv_heads=8, head_dim=128, tp_p=tp_p, tp_d=tp_d, ps_p=4, ps_d=4,
                         scales="per_token" if tp_p <= tp_d and tp_d <= 2 else "per_token_head",
                         capacity_p=4, capacity_d=4)
        network, bf16 = run_case(dep, rng)
        limit = 0.51 if dep.scales == "per_token" else 0.5157
        assert network <= limit * bf16, (dep, network / bf16)


def test_per_token_across_prefill_ranks_is_refused() -> None:
    dep = Deployment(tp_p=4, tp_d=2, scales="per_token")
    real, _ = decode(dep, 0)
    src = prefill(dep, 0, 0, seed=1)
    with pytest.raises(kvplan.PairingError, match="per_token_head") as err:
        kvplan.ConversionTemplate(src.layout, real.layout)
    assert err.value.kind == "conversion"
    assert "bf16" in str(err.value) and "fp8_e4m3:per_token" in str(err.value)


def _pair(src_repr: str, dst_repr: str, dst_dtype_size: int = 1,
          scale_groups: int = 1) -> tuple[kvplan.Layout, kvplan.Layout]:
    ctx = dict(page_size=2, kv_heads=2, head_dim=4)
    if src_repr.startswith("fp8"):
        src = kvplan.Layout([1 << 20, 1 << 21], [64, 32], [16, 8], [0, 0], ["k", "k_scale"],
                            dtype_size=1, **ctx).with_representations([src_repr, None])
    else:
        src = kvplan.Layout([1 << 20], [2 * 2 * 8 * 2], [2 * 8 * 2], [0], ["k"], dtype_size=2,
                            **ctx).with_representations([src_repr])
    item = 2 * 8 * dst_dtype_size
    dst = kvplan.Layout([1 << 30, 1 << 31], [2 * item, 2 * 2 * scale_groups * 4],
                        [item, 2 * scale_groups * 4], [0, 0], ["k", "k_scale"],
                        dtype_size=dst_dtype_size, **ctx).with_representations([dst_repr, None])
    return src, dst


@pytest.mark.parametrize("src_repr,dst_repr,dst_size,why", [
    ("fp8_e4m3:per_token", "int8:per_token", 1, "re-quantizing"),
    ("fp8_e4m3:per_token", "fp8_e5m2:per_token", 1, "re-quantizing"),
    ("bf16", "fp16", 2, "rounds or clips"),
    ("bf16", "fp8_e4m3", 1, "without scales"),
    ("bf16", "fp8_e4m3:per_tensor", 1, "calibrated"),
])
def test_unconvertible_pairs_are_refused_naming_both(src_repr: str, dst_repr: str,
                                                     dst_size: int, why: str) -> None:
    src, dst = _pair(src_repr, dst_repr, dst_size)
    with pytest.raises(kvplan.PairingError, match=why) as err:
        kvplan.ConversionTemplate(src, dst)
    assert err.value.kind == "conversion"
    assert src_repr in str(err.value) and dst_repr in str(err.value)


def test_a_byte_copy_template_refuses_different_representations() -> None:
    ctx = dict(page_size=2)
    two = ([1 << 20, 1 << 21], [64, 16], [32, 8], [0, 0], ["k", "k_scale"])
    src = kvplan.Layout(*two, **ctx).with_representations(["fp8_e4m3:per_token", None])
    dst = kvplan.Layout(*([1 << 30, 1 << 31], *two[1:]), **ctx).with_representations(
        ["int8:per_token", None])
    with pytest.raises(kvplan.PairingError, match="ConversionTemplate") as err:
        kvplan.Template(src, dst)
    assert err.value.kind == "conversion"


@pytest.mark.parametrize("reprs,match", [
    (["fp8_e4m3:per_token"], "dtype_size is 2"),
    (["bf16:per_token"], "carry no scales"),
    (["fp9"], "unknown representation"),
])
def test_representations_that_contradict_the_layout_are_layout_errors(reprs: list[str],
                                                                      match: str) -> None:
    layout = kvplan.Layout([1 << 20], [64], [32], [0], ["k"], page_size=2, kv_heads=2,
                           head_dim=4, dtype_size=2)
    with pytest.raises(kvplan.LayoutError, match=match) as err:
        layout.with_representations(reprs)
    assert "entry 0" in str(err.value)


def test_a_scale_entry_of_the_wrong_size_is_a_layout_error() -> None:
    with pytest.raises(kvplan.LayoutError, match=r"k_scale\) has item_len 12"):
        kvplan.Layout([1 << 20, 1 << 21], [64, 24], [16, 12], [0, 0], ["k", "k_scale"],
                      page_size=2, kv_heads=2, head_dim=4, dtype_size=1
                      ).with_representations(["fp8_e4m3:per_token", None])


def test_representations_round_trip_wire_and_dict_and_are_absent_by_default() -> None:
    plain = kvplan.Layout([1 << 20, 1 << 21], [64, 16], [16, 8], [0, 0], ["k", "k_scale"],
                          page_size=2, kv_heads=2, head_dim=4, dtype_size=1)
    repr_layout = plain.with_representations(["fp8_e4m3:per_token", None])
    assert repr_layout.representations == ["fp8_e4m3:per_token", None]
    assert plain.representations == [None, None]
    assert "representations" not in plain.to_dict()
    assert repr_layout.to_dict()["representations"] == ["fp8_e4m3:per_token", None]
    assert kvplan.Layout.from_dict(repr_layout.to_dict()) == repr_layout
    assert kvplan.Layout.from_bytes(repr_layout.to_bytes()) == repr_layout
    # No representation: the wire bytes of a layout that never heard of them.
    assert plain.with_representations([None, None]).to_bytes() == plain.to_bytes()
    assert len(repr_layout.to_bytes()) == len(plain.to_bytes()) + 12
    schema = json.loads(resources.files("kvplan").joinpath("schemas/layout.schema.json")
                        .read_text())
    jsonschema.validate(repr_layout.to_dict(), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**repr_layout.to_dict(), "representations": ["fp9", None]}, schema)


def test_codec_matches_the_lookup_table_encoder() -> None:
    rng = np.random.default_rng(5)
    for dtype, qmax in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        x = (rng.standard_normal(20000) * np.exp2(rng.integers(-20, 10, 20000))).astype(
            np.float32)
        x = np.clip(x, -qmax, qmax)
        every = decode_fp8(np.arange(256, dtype=np.uint8), dtype)
        finite = every[np.isfinite(every)]
        mids = ((finite[:-1].astype(np.float64) + np.sort(finite)[1:]) / 2).astype(np.float32)
        x = np.concatenate([x, finite, mids[np.abs(mids) <= qmax], [0.0, -0.0]]).astype(
            np.float32)
        assert np.array_equal(encode_fp8(x, dtype), reference_encode(x, dtype))
        # Decoding the codes of representable values gives them back.
        assert np.array_equal(decode_fp8(encode_fp8(finite, dtype), dtype), finite)
    q, scales = quantize_groups(np.zeros(8, dtype=np.float32), 4, "fp8_e4m3")
    assert q.tolist() == [0] * 8 and scales.tolist() == [1.0, 1.0]


def test_content_digests_verify_a_converting_transfer_end_to_end() -> None:
    dep = Deployment(tp_p=2, tp_d=4, ps_p=2, ps_d=1, scales="per_token")
    rng = np.random.default_rng(9)
    real, twin = decode(dep, 1)
    n_tokens = 10
    src_pages = rng.choice(dep.capacity_p, 5, replace=False)
    dst_pages = rng.choice(dep.capacity_d, 10, replace=False)
    sources = [prefill(dep, r, 0, seed=r + 1) for r in range(dep.tp_p)]
    plans = []
    for src in sources:
        staging = _staging([src])
        plan = kvplan.ConversionTemplate(src.layout, real.layout).plan(
            src_pages, dst_pages, (staging.base, staging.data.size), n_tokens=n_tokens)
        apply_conversion(plan, src.memory, staging, real.memory)
        plans.append((plan, staging))
    fill_twin(dep, sources, twin, src_pages, dst_pages, n_tokens)
    want = expected_decode(dep, 1, real, twin, dst_pages, n_tokens)
    landed = real.arena.copy()
    for plan, staging in plans:
        if plan.network_bytes == 0:
            continue
        sent = plan.content_digest("src", [staging.data])
        # What the prefill digests is what the decode's own quantizer would hold (the
        # reference's bytes, put at the decode's addresses)...
        real.arena[:] = want
        assert plan.content_digest("dst", [real.arena]) == sent
        # ... and what landed.
        real.arena[:] = landed
        assert plan.content_digest("dst", [real.arena]) == sent
    # One flipped scale bit in the decode is caught.
    plan = next(p for p, _ in plans if p.n_rows)
    at = int(plan.scale_dst_addrs[0]) - real.memory.base
    before = plan.content_digest("dst", [real.arena])
    real.arena[at] ^= 1
    assert plan.content_digest("dst", [real.arena]) != before


def run_dequantizing_case(dep: Deployment, rng: np.random.Generator) -> None:
    """fp8/int8 prefill with scales -> bf16 decode, dequantized on the decode: the decode pool
    equals every prefill rank dequantized with its own scales and copied byte for byte."""
    d_rank = int(rng.integers(0, dep.tp_d))
    real, _ = plain_decode(dep, d_rank)
    want, _ = plain_decode(dep, d_rank)
    max_tokens = min(dep.capacity_p * dep.ps_p, dep.capacity_d * dep.ps_d, 16)
    n_tokens = int(rng.integers(1, max_tokens + 1))
    src_pages = rng.choice(dep.capacity_p, -(-n_tokens // dep.ps_p), replace=False)
    dst_pages = rng.choice(dep.capacity_d, -(-n_tokens // dep.ps_d), replace=False)
    ranks = range(1) if dep.mla else range(dep.tp_p)
    sources = [quantized_prefill(dep, r, s, seed=int(rng.integers(1 << 30)))
               for r in ranks for s in range(dep.pp)]
    written = np.zeros(real.arena.size, dtype=bool)
    for src in sources:
        template = kvplan.ConversionTemplate(src.layout, real.layout)
        assert template.convert_on == "decode"
        staging, dst_staging = _staging([src]), _staging([src])
        plan = template.plan(src_pages, dst_pages, (staging.base, staging.data.size),
                             dst_staging=(dst_staging.base, dst_staging.data.size),
                             n_tokens=n_tokens)
        assert plan.convert_on == "decode" and plan.n_blocks[1] <= 1
        apply_conversion(plan, src.memory, staging, real.memory, written, dst_staging)
        bf16 = dequantized_prefill(dep, src)
        reference_copy(bf16.layout, bf16.memory, want.layout, want.memory, src_pages, dst_pages,
                       n_tokens=n_tokens)
    bad = np.flatnonzero(real.arena != want.arena)
    assert bad.size == 0, f"{dep}: {bad.size} wrong decode bytes, the first at {bad[0]}"


def test_fp8_and_int8_to_bf16_equal_the_decode_dequantizing_itself() -> None:
    deps = [Deployment(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d, out_dtype=dtype,
                       scales=scales)
            for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(TPS, TPS, (1, 2), RATIOS)
            for dtype in ("fp8_e4m3", "fp8_e5m2", "int8")
            for scales in ("per_token", "per_token_head")]
    deps += [Deployment(mla=True, tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=ps_p, ps_d=ps_d)
             for tp_p, tp_d, pp, (ps_p, ps_d) in itertools.product(TPS, TPS, (1, 2), RATIOS)]
    rng = np.random.default_rng(10 + SEED)
    for dep in deps:
        for _ in range(REQUESTS or 3):
            run_dequantizing_case(dep, rng)
