"""The quantization rule of conversion plans, and a NumPy codec written from the formats.

A conversion plan's convert rows (``ConversionTemplate.plan``) are executed by this rule, on CPU
by :func:`kvplan.testing.oracle.apply_conversion` and on tensors by
``kvplan.torch.TorchExecutor.run_conversion``; both give the same bits. Per scale group (the
``group_elems`` consecutive elements of a row: a token's heads for ``per_token``, one head of a
token for ``per_token_head``):

- the values are widened exactly to float32 (bf16 and fp16 are subsets of float32);
- ``amax = max(|x|)`` over the group; ``scale = amax / QMAX`` in float32 (one IEEE division),
  where ``QMAX`` is 448 for ``fp8_e4m3``, 57344 for ``fp8_e5m2`` and 127 for ``int8``; a group
  whose ``amax`` is 0 gets ``scale = 1.0``;
- each value is ``q = x / scale`` (one float32 division), clamped to ``[-QMAX, QMAX]``, then
  rounded to the nearest representable value of the format, ties to even (for int8: to the
  nearest integer, ties to even);
- the scale is stored as float32, little-endian, in the decode's scale entry.

Dequantizing (quantized values with per-token scales into ``bf16``/``fp16``, run by the decode):
each value is decoded exactly to float32, multiplied by its group's float32 scale (one IEEE
multiplication) and rounded to the output format, nearest with ties to even (NaN as the
format's quiet NaN, ``0x7FC0`` for bf16, sign kept).

NaN values stay NaN (e4m3 code ``0x7F``, e5m2 ``0x7F``, sign kept; a group holding a NaN has a
NaN ``amax``, so all its values and its scale are NaN); an infinite value makes its group's
scale infinite. int8 has no NaN: NaN is not defined for int8 groups (keep KV finite).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["QMAX", "decode_fp8", "dequantize_groups", "encode_fp8", "from_float32",
           "quantize_groups", "to_float32"]

#: Largest finite magnitude of each quantized dtype: the ``QMAX`` of the rule.
QMAX: dict[str, float] = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}

#: (exponent bits, mantissa bits, bias) of the FP8 formats (OCP FP8: E4M3 as float8_e4m3fn).
_FP8 = {"fp8_e4m3": (4, 3, 7), "fp8_e5m2": (5, 2, 15)}


def to_float32(raw: npt.NDArray[np.uint8], dtype: str) -> npt.NDArray[np.float32]:
    """Little-endian ``bf16`` or ``fp16`` bytes as float32 values (exact)."""
    if dtype == "bf16":
        bits: npt.NDArray[np.uint32] = raw.view(np.uint16).astype(np.uint32) << np.uint32(16)
        values: npt.NDArray[np.float32] = bits.view(np.float32)
        return values
    if dtype == "fp16":
        return raw.view(np.float16).astype(np.float32)
    raise ValueError(f"{dtype!r} is not an input dtype of conversion plans (bf16, fp16)")


def encode_fp8(x: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.uint8]:
    """float32 values already inside ``[-QMAX, QMAX]`` (or NaN) as FP8 codes: round to nearest,
    ties to even, from the format's definition (normal values ``(1 + m / 2**M) * 2**(e - bias)``,
    subnormals ``m / 2**M * 2**(1 - bias)``)."""
    exp_bits, man_bits, bias = _FP8[dtype]
    a = np.abs(x.astype(np.float64))
    nan = np.isnan(a)
    a = np.where(nan, 0.0, a)
    step_sub = 2.0 ** (1 - bias - man_bits)
    min_normal = 2.0 ** (1 - bias)
    _, k = np.frexp(np.where(a > 0, a, 1.0))
    e = np.maximum(k.astype(np.int64) - 1, 1 - bias)
    # Quantum of a's binade (the subnormal step below the smallest normal); a / quantum is an
    # exact float64 (a power-of-two scaling), rounded half to even by np.rint.
    quantum = np.where(a < min_normal, step_sub, np.ldexp(1.0, (e - man_bits).astype(np.int32)))
    n = np.rint(a / quantum).astype(np.int64)
    sub = a < min_normal
    # Subnormal: the code is the count of steps (a count of 2**M is the smallest normal).
    # Normal: n in [2**M, 2**(M+1)]; 2**(M+1) carries into the next binade.
    carry = ~sub & (n == 1 << (man_bits + 1))
    e = np.where(carry, e + 1, e)
    n = np.where(carry, 1 << man_bits, n)
    code = np.where(sub, n, ((e + bias) << man_bits) | (n - (1 << man_bits)))
    nan_code = (1 << (exp_bits + man_bits)) - 1  # 0x7F: e4m3fn's NaN, one of e5m2's NaNs
    code = np.where(nan, nan_code, code)
    sign = np.signbit(x).astype(np.int64) << 7
    out: npt.NDArray[np.uint8] = (code | sign).astype(np.uint8)
    return out


def decode_fp8(codes: npt.NDArray[np.uint8], dtype: str) -> npt.NDArray[np.float32]:
    """FP8 codes as float32 values (exact; NaN codes as NaN, e5m2 infinities as infinities)."""
    exp_bits, man_bits, bias = _FP8[dtype]
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> man_bits) & ((1 << exp_bits) - 1)
    m = c & ((1 << man_bits) - 1)
    value = np.where(e == 0, m * 2.0 ** (1 - bias - man_bits),
                     (1 + m / 2.0**man_bits) * np.ldexp(1.0, (e - bias).astype(np.int32)))
    top = e == (1 << exp_bits) - 1
    if dtype == "fp8_e4m3":
        value = np.where(top & (m == (1 << man_bits) - 1), np.nan, value)
    else:
        value = np.where(top, np.where(m == 0, np.inf, np.nan), value)
    return (sign * value).astype(np.float32)


def quantize_groups(x: npt.NDArray[np.float32], group: int,
                    dtype: str) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """The rule on ``x`` (float32, a whole number of groups of ``group`` elements): the
    quantized bytes (one per element) and one float32 scale per group."""
    qmax = np.float32(QMAX[dtype])
    groups = x.reshape(-1, group)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(groups).max(axis=1)
        scale = np.where(amax == 0, np.float32(1.0), amax / qmax).astype(np.float32)
        q = np.clip(groups / scale[:, None], -qmax, qmax).astype(np.float32)
    if dtype == "int8":
        out: Any = np.rint(q).astype(np.int8).view(np.uint8)
    else:
        out = encode_fp8(q, dtype)
    return out.reshape(-1), scale


def from_float32(x: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.uint8]:
    """float32 values as little-endian ``bf16`` or ``fp16`` bytes, nearest, ties to even."""
    if dtype == "fp16":
        out16: npt.NDArray[np.uint8] = x.astype(np.float16).view(np.uint8)
        return out16
    if dtype != "bf16":
        raise ValueError(f"{dtype!r} is not an output dtype of dequantization (bf16, fp16)")
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> \
        np.uint32(16)
    nan = np.isnan(x)
    quiet = (bits >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0)
    out: npt.NDArray[np.uint8] = np.where(nan, quiet, rounded).astype(np.uint16).view(np.uint8)
    return out


def dequantize_groups(raw: npt.NDArray[np.uint8], scales: npt.NDArray[np.float32], group: int,
                      in_dtype: str, out_dtype: str) -> npt.NDArray[np.uint8]:
    """Quantized bytes (one per element, ``group`` elements per scale) as ``out_dtype`` bytes."""
    if in_dtype == "int8":
        values = raw.view(np.int8).astype(np.float32)
    else:
        values = decode_fp8(raw, in_dtype)
    y = (values.reshape(-1, group) * scales[:, None]).astype(np.float32).reshape(-1)
    return from_float32(y, out_dtype)
