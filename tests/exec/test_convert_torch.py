"""Conversion plans run by ``kvplan.torch.TorchExecutor`` give the NumPy reference's bits.

Needs torch (the ``kvplan[torch]`` extra: ``bash scripts/test-torch`` installs it and runs this
file); without torch it is skipped. With ``KVPLAN_REQUIRE_TORCH=1`` a missing torch fails it.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

if os.environ.get("KVPLAN_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (the kvplan[torch] extra; scripts/test-torch)"
    )

import kvplan  # noqa: E402
from kvplan.quant import QMAX, encode_fp8  # noqa: E402
from kvplan.testing.oracle import Memory, apply_conversion  # noqa: E402
from kvplan.torch import TorchExecutor  # noqa: E402

from support.convert_cases import (Deployment, decode, plain_decode, prefill,  # noqa: E402
                                   quantized_prefill)

TPS = (1, 2, 4, 8)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_torch_fp8_casts_equal_the_numpy_encoder(dtype: str) -> None:
    rng = np.random.default_rng(7)
    qmax = QMAX[dtype]
    x = (rng.standard_normal(200_000) * np.exp2(rng.integers(-24, 12, 200_000))).astype(
        np.float32)
    x = np.clip(x, -qmax, qmax)
    # Every representable value and every midpoint between neighbours (the ties).
    fp8 = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.float8_e5m2
    every = torch.arange(256, dtype=torch.uint8).view(fp8).to(torch.float32).numpy()
    finite = np.sort(every[np.isfinite(every)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    x = np.concatenate([x, finite, mids, [0.0, -0.0]]).astype(np.float32)
    ours = encode_fp8(x, dtype)
    theirs = torch.from_numpy(x).to(fp8).view(torch.uint8).numpy()
    assert np.array_equal(ours, theirs), np.flatnonzero(ours != theirs)[:5]


def _run_both(dep: Deployment, rng: np.random.Generator,
              prefill_bits: np.ndarray | None = None) -> None:
    """One request through both executors; ``prefill_bits`` (bf16 bytes), when given, replace
    every prefill's KV."""
    d_rank = int(rng.integers(0, dep.tp_d))
    n_tokens = int(rng.integers(1, min(dep.capacity_p * dep.ps_p, dep.capacity_d * dep.ps_d, 16) + 1))
    src_pages = rng.choice(dep.capacity_p, -(-n_tokens // dep.ps_p), replace=False)
    dst_pages = rng.choice(dep.capacity_d, -(-n_tokens // dep.ps_d), replace=False)
    ranks = range(1) if dep.mla else range(dep.tp_p)
    sources = [prefill(dep, r, s, seed=int(rng.integers(1 << 30)))
               for r in ranks for s in range(dep.pp)]
    if prefill_bits is not None:
        for src in sources:
            kv = int(sum(e.data_len for e in src.layout.entries()))
            src.arena[:kv] = np.resize(prefill_bits, kv)
    real, _ = decode(dep, d_rank)
    by_numpy = real.arena.copy()
    numpy_mem = Memory(by_numpy, real.memory.base)
    for src in sources:
        template = kvplan.ConversionTemplate(src.layout, real.layout)
        size = int(sum(e.data_len for e in src.layout.entries())) * 2 + 64
        staging = torch.zeros(size, dtype=torch.uint8)
        plan = template.plan(src_pages, dst_pages, (staging.data_ptr(), size), n_tokens=n_tokens)
        np_staging = np.zeros(size, dtype=np.uint8)
        # The NumPy run on copies at the same addresses: the staging tensor's bytes and the
        # decode arena's copy, both seen at their real addresses through Memory.
        apply_conversion(plan, src.memory, Memory(np_staging, staging.data_ptr()),
                         numpy_mem)
        executor = TorchExecutor({"prefill": torch.from_numpy(src.arena),
                                  "staging": staging,
                                  "decode": torch.from_numpy(real.arena)})
        assert executor.run_conversion(plan) == plan.network_bytes
        assert np.array_equal(staging.numpy(), np_staging)
    bad = np.flatnonzero(real.arena != by_numpy)
    assert bad.size == 0, f"{dep}: {bad.size} bytes differ, the first at {bad[0]}"


def test_torch_and_numpy_executors_give_the_same_decode_pool() -> None:
    rng = np.random.default_rng(8)
    deps = []
    for tp_p, tp_d, pp in itertools.product(TPS, TPS, (1, 2)):
        for out_dtype in ("fp8_e4m3", "fp8_e5m2", "int8"):
            deps.append(Deployment(tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=2, ps_d=1,
                                   out_dtype=out_dtype, scales="per_token_head"))
        deps.append(Deployment(mla=True, tp_p=tp_p, tp_d=tp_d, pp=pp, ps_p=1, ps_d=2))
    for dep in deps:
        for _ in range(3):
            _run_both(dep, rng)


def _dequantize_both(dep: Deployment, rng: np.random.Generator, special: bool = False) -> None:
    """One request dequantized by both executors; ``special``: every quantized code and scale
    byte drawn from all 256 (NaN codes, NaN and extreme scales included)."""
    d_rank = int(rng.integers(0, dep.tp_d))
    n_tokens = int(rng.integers(1, min(dep.capacity_p * dep.ps_p, dep.capacity_d * dep.ps_d,
                                       12) + 1))
    src_pages = rng.choice(dep.capacity_p, -(-n_tokens // dep.ps_p), replace=False)
    dst_pages = rng.choice(dep.capacity_d, -(-n_tokens // dep.ps_d), replace=False)
    real, _ = plain_decode(dep, d_rank)
    by_numpy = real.arena.copy()
    ranks = range(1) if dep.mla else range(dep.tp_p)
    for r, s in itertools.product(ranks, range(dep.pp)):
        src = quantized_prefill(dep, r, s, seed=int(rng.integers(1 << 30)))
        if special:
            src.arena[:] = rng.integers(0, 256, src.arena.size, dtype=np.uint8)
        size = int(sum(e.data_len for e in src.layout.entries())) * 2 + 64
        staging = torch.zeros(size, dtype=torch.uint8)
        dst_staging = torch.zeros(size, dtype=torch.uint8)
        plan = kvplan.ConversionTemplate(src.layout, real.layout).plan(
            src_pages, dst_pages, (staging.data_ptr(), size),
            dst_staging=(dst_staging.data_ptr(), size), n_tokens=n_tokens)
        np_staging, np_dst_staging = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
        apply_conversion(plan, src.memory, Memory(np_staging, staging.data_ptr()),
                         Memory(by_numpy, real.memory.base), None,
                         Memory(np_dst_staging, dst_staging.data_ptr()))
        executor = TorchExecutor({"prefill": torch.from_numpy(src.arena),
                                  "staging": staging, "dst_staging": dst_staging,
                                  "decode": torch.from_numpy(real.arena)})
        assert executor.run_conversion(plan) == plan.network_bytes
    bad = np.flatnonzero(real.arena != by_numpy)
    assert bad.size == 0, f"{dep}: {bad.size} bytes differ, the first at {bad[0]}"


def test_torch_dequantizes_as_the_numpy_reference() -> None:
    rng = np.random.default_rng(11)
    deps = [Deployment(tp_p=tp, tp_d=tp, pp=pp, ps_p=2, ps_d=1, out_dtype=dtype,
                       scales="per_token_head")
            for tp, pp, dtype in itertools.product(TPS, (1, 2),
                                                   ("fp8_e4m3", "fp8_e5m2", "int8"))]
    deps += [Deployment(mla=True, tp_p=tp_p, tp_d=tp_d, ps_p=1, ps_d=2)
             for tp_p, tp_d in itertools.product(TPS, TPS)]
    for dep in deps:
        for _ in range(3):
            _dequantize_both(dep, rng)


def _mx_deployments() -> list[Deployment]:
    deps = [Deployment(kv_heads=8, head_dim=32, scales="mx", tp_p=tp_p, tp_d=tp_d, pp=pp,
                       ps_p=2, ps_d=1, capacity_p=6, capacity_d=6)
            for tp_p, tp_d, pp in itertools.product(TPS, TPS, (1, 2))]
    deps += [Deployment(mla=True, latent=576, rope=64, scales="mx", tp_p=tp_p, tp_d=tp_d,
                        ps_p=1, ps_d=2, capacity_p=4, capacity_d=4)
             for tp_p, tp_d in itertools.product((1, 4), (1, 2))]
    return deps


def test_torch_mx_quantizes_as_the_numpy_reference() -> None:
    rng = np.random.default_rng(12)
    for dep in _mx_deployments():
        for _ in range(2):
            _run_both(dep, rng)


def test_torch_mx_special_values_as_the_numpy_reference() -> None:
    # Every bf16 bit pattern (zeros, subnormals, the largest values, infinities, NaNs of both
    # signs), shuffled so that blocks mix them, plus blocks of one magnitude.
    rng = np.random.default_rng(13)
    every = np.arange(1 << 16, dtype=np.uint16)
    rng.shuffle(every)
    tiny = np.arange(64, dtype=np.uint16)  # zero and subnormals only
    bits = np.concatenate([tiny, every]).view(np.uint8)
    dep = Deployment(kv_heads=8, head_dim=32, scales="mx", tp_p=2, tp_d=1, ps_p=2, ps_d=1,
                     capacity_p=6, capacity_d=12)
    for _ in range(4):
        _run_both(dep, rng, prefill_bits=np.roll(bits, int(rng.integers(0, bits.size))))


def test_torch_mx_dequantizes_as_the_numpy_reference() -> None:
    rng = np.random.default_rng(14)
    deps = [d for d in _mx_deployments() if d.mla or d.tp_p == d.tp_d]
    for dep in deps:
        for special in (False, True):
            _dequantize_both(dep, rng, special)
