"""The quantization rule of conversion plans, and a NumPy codec written from the formats.

A conversion plan's convert rows (``ConversionTemplate.plan``) are executed by this rule, on CPU
by :func:`kvplan.exec.numpy.apply_conversion` and on tensors by
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

The ``mx`` rule (``fp8_e4m3:mx``, MXFP8 of OCP Microscaling v1.0; rows whose
``scale_formats`` code is 1, ``"e8m0"``): per block of :data:`MX_BLOCK` (32) consecutive
elements of a token,

- the values are widened exactly to float32 and ``amax = max(|x|)`` over the block;
- the shared exponent is ``floor(log2(amax)) - 8`` (8: the largest exponent of E4M3), clamped to
  ``[-127, 127]``; a block whose ``amax`` is 0 gets ``-127``;
- the scale is ``X = 2**shared_exp``, stored as one E8M0 byte ``shared_exp + 127`` (so an
  all-zero block has scale byte ``0x00``);
- each value is ``q = x / X``, an exact power-of-two scaling (``x * 2**-shared_exp`` in float32:
  nothing that matters to the rounding below is rounded), clamped to ``[-448, 448]`` and rounded
  to the nearest E4M3 value, ties to even;
- a block holding a NaN or an infinity gets the NaN scale byte ``0xFF`` and every one of its
  values becomes NaN (code ``0x7F``, each value's sign kept): E4M3 has no infinity, and MX
  decodes every value of a NaN-scaled block as NaN anyway.

Dequantizing ``mx`` (into ``bf16``/``fp16``, on the decode): each value is decoded exactly to
float32 and multiplied by ``2**(e - 127)`` of its block's scale byte ``e`` (a float32
multiplication by a power of two, exact unless the product leaves float32's range, where it is
infinite as in the output format), then rounded to the output format, nearest with ties to
even (beyond the format's largest finite value: infinity, IEEE); a scale byte ``0xFF`` gives NaN
for the whole block. Every NaN output is the format's quiet NaN (``0x7FC0`` for bf16, ``0x7E00``
for fp16) with the sign bit of the value's E4M3 code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["E4M3_EMAX", "E8M0_NAN", "MX_BLOCK", "QMAX", "QUIET_NAN", "decode_e8m0",
           "decode_fp8", "dequantize_groups", "dequantize_mx", "encode_fp8", "from_float32",
           "quantize_groups", "quantize_mx", "to_float32"]

#: Largest finite magnitude of each quantized dtype: the ``QMAX`` of the rule.
QMAX: dict[str, float] = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}

#: Elements per ``mx`` block (one E8M0 scale each).
MX_BLOCK = 32

#: The E8M0 scale byte that stands for NaN.
E8M0_NAN = 0xFF

#: The largest exponent of a finite E4M3 value (448 = 1.75 * 2**8): the ``8`` of the ``mx`` rule.
E4M3_EMAX = 8

#: The quiet NaN of each output format (sign bit clear).
QUIET_NAN: dict[str, int] = {"bf16": 0x7FC0, "fp16": 0x7E00}

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
    quiet = (bits >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(QUIET_NAN["bf16"])
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


def decode_e8m0(scales: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """E8M0 scale bytes as float32 values ``2**(e - 127)`` (exact: ``2**-127`` is a float32
    subnormal); ``0xFF`` as NaN."""
    e = scales.astype(np.int32)
    bits = np.where(e == 0, np.uint32(0x00400000), e.astype(np.uint32) << np.uint32(23))
    values: npt.NDArray[np.float32] = bits.astype(np.uint32).view(np.float32)
    return np.where(e == E8M0_NAN, np.float32(np.nan), values).astype(np.float32)


def quantize_mx(x: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """The ``mx`` rule on ``x`` (float32, a whole number of blocks of :data:`MX_BLOCK`): the
    E4M3 codes (one per element) and one E8M0 scale byte per block."""
    blocks = x.reshape(-1, MX_BLOCK)
    with np.errstate(invalid="ignore"):
        amax = np.abs(blocks).max(axis=1)
    special = ~np.isfinite(amax)
    # floor(log2(amax)) exactly: amax = m * 2**k with m in [0.5, 1).
    _, k = np.frexp(np.where(special | (amax == 0), np.float32(1.0), amax))
    shared = np.where(amax == 0, -127, np.clip(k.astype(np.int64) - 1 - E4M3_EMAX, -127, 127))
    q = np.ldexp(np.where(special[:, None], np.float32(0.0), blocks),
                 (-shared[:, None]).astype(np.int32)).astype(np.float32)
    q = np.clip(q, -QMAX["fp8_e4m3"], QMAX["fp8_e4m3"]).astype(np.float32)
    codes = encode_fp8(q, "fp8_e4m3")
    nan_codes = (np.signbit(blocks).astype(np.uint8) << np.uint8(7)) | np.uint8(0x7F)
    codes = np.where(special[:, None], nan_codes, codes.reshape(blocks.shape)).astype(np.uint8)
    scale_bytes = np.where(special, E8M0_NAN, shared + 127).astype(np.uint8)
    return codes.reshape(-1), scale_bytes


def dequantize_mx(raw: npt.NDArray[np.uint8], scales: npt.NDArray[np.uint8], group: int,
                  out_dtype: str) -> npt.NDArray[np.uint8]:
    """E4M3 codes with one E8M0 scale byte per ``group`` elements (:data:`MX_BLOCK`, or fewer
    for a row inside one block) as ``out_dtype`` bytes. A NaN (a NaN code, or a NaN scale) is
    the format's quiet NaN with the sign of the value's code, so every executor writes the same
    bits whatever sign its NaN arithmetic produces."""
    values = decode_fp8(raw, "fp8_e4m3").reshape(-1, group)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (values * decode_e8m0(scales)[:, None]).astype(np.float32).reshape(-1)
        out = from_float32(y, out_dtype).view(np.uint16)
    nan = np.isnan(y)
    sign = (raw.astype(np.uint16) & np.uint16(0x80)) << np.uint16(8)
    bits = np.where(nan, sign | np.uint16(QUIET_NAN[out_dtype]), out).astype(np.uint16)
    result: npt.NDArray[np.uint8] = bits.view(np.uint8)
    return result
