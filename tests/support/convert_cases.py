"""Deployments for the conversion tests: a bf16 prefill rank, an fp8/int8 decode rank with
scale entries, and the "decode quantizes itself" reference.

The reference is written from the rule's definition (docs/api.md, "Conversion plans") and
shares no code with the executors: the bf16 KV the decode should hold is placed by the
byte-level oracle (:func:`kvplan.testing.oracle.reference_copy`) into a bf16 twin of the
decode's pool, then every token the request writes is quantized with a lookup-table encoder
(nearest of the format's 256 codes, ties to the even code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import kvplan
from kvplan.testing.oracle import Memory, rank_heads, reference_copy

SENTINEL = 0xA5
QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}


def _fp8_table(dtype: str) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The non-negative finite values of an FP8 format, ascending, and their codes."""
    exp_bits, man_bits, bias = (4, 3, 7) if dtype == "fp8_e4m3" else (5, 2, 15)
    values, codes = [], []
    for code in range(128):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if e == (1 << exp_bits) - 1 and (dtype == "fp8_e5m2" or m == (1 << man_bits) - 1):
            continue  # NaN / infinity codes
        if e == 0:
            value = m * 2.0 ** (1 - bias - man_bits)
        else:
            value = (1.0 + m / 2**man_bits) * 2.0 ** (e - bias)
        values.append(value)
        codes.append(code)
    order = np.argsort(values)
    return np.array(values)[order], np.array(codes)[order]


_TABLES = {d: _fp8_table(d) for d in ("fp8_e4m3", "fp8_e5m2")}


def reference_encode(q: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.uint8]:
    """Nearest code of the format, ties to the even code (``q`` inside ``[-QMAX, QMAX]``)."""
    if dtype == "int8":
        return np.rint(q.astype(np.float64)).astype(np.int8).view(np.uint8)
    values, codes = _TABLES[dtype]
    a = np.abs(q.astype(np.float64))
    hi = np.clip(np.searchsorted(values, a), 0, len(values) - 1)
    lo = np.clip(hi - 1, 0, len(values) - 1)
    d_lo, d_hi = a - values[lo], values[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    code = np.where(pick_hi, codes[hi], codes[lo])
    return (code | (np.signbit(q).astype(np.int64) << 7)).astype(np.uint8)


MX_BLOCK = 32


def reference_quantize_mx(x: npt.NDArray[np.float32]
                          ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Blocks (rows of 32 of ``x``): the decode's own MXFP8 quantizer in float64, from the
    rule's statement: shared exponent floor(log2(amax)) - 8 clamped to [-127, 127] (-127 for an
    all-zero block), values x / 2**shared clamped to +-448 and encoded by the lookup table; a
    block holding NaN or an infinity gets scale byte 0xFF and NaN codes (0x7F, sign kept)."""
    blocks = x.reshape(-1, MX_BLOCK).astype(np.float64)
    codes = np.zeros(blocks.shape, dtype=np.uint8)
    scales = np.zeros(blocks.shape[0], dtype=np.uint8)
    for i, block in enumerate(blocks):
        if not np.isfinite(block).all():
            scales[i] = 0xFF
            codes[i] = 0x7F | (np.signbit(block).astype(np.uint8) << 7)
            continue
        amax = float(np.abs(block).max())
        shared = -127 if amax == 0 else min(127, max(-127, int(np.floor(np.log2(amax))) - 8))
        q = np.clip(block / 2.0 ** shared, -448.0, 448.0)
        codes[i] = reference_encode(q, "fp8_e4m3")
        scales[i] = shared + 127
    return codes.reshape(-1), scales


def reference_quantize(x: npt.NDArray[np.float32], dtype: str
                       ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Groups (rows of ``x``): the decode's own quantizer, scale = amax / QMAX per row (1.0 for
    an all-zero row), values x / scale clamped and encoded."""
    amax = np.max(np.abs(x), axis=1)
    scale = np.where(amax == 0, np.float32(1.0),
                     amax / np.float32(QMAX[dtype])).astype(np.float32)
    q = np.clip(x / scale[:, None], -QMAX[dtype], QMAX[dtype]).astype(np.float32)
    return reference_encode(q, dtype), scale


@dataclass(frozen=True)
class Deployment:
    """One prefill deployment and one decode rank."""

    layers: int = 2
    kv_heads: int = 8
    head_dim: int = 4
    mla: bool = False
    latent: int = 16
    rope: int = 4
    tp_p: int = 1
    tp_d: int = 1
    pp: int = 1
    ps_p: int = 1
    ps_d: int = 1
    capacity_p: int = 12
    capacity_d: int = 12
    out_dtype: str = "fp8_e4m3"
    scales: str = "per_token"


@dataclass
class Peer:
    layout: kvplan.Layout
    memory: Memory
    arena: npt.NDArray[np.uint8]


def _heads(dep: Deployment, tp_rank: int, tp_size: int) -> int:
    return 1 if dep.mla else len(rank_heads(dep.kv_heads, tp_size, tp_rank))


def scale_groups(dep: Deployment, heads: int, elems: int) -> int:
    """Scales per token of an entry of ``elems`` elements per token."""
    if dep.scales == "mx":
        return elems // MX_BLOCK
    return heads if dep.scales == "per_token_head" and not dep.mla else 1


def scale_size(dep: Deployment) -> int:
    """Bytes of one scale: E8M0 for mx, float32 otherwise."""
    return 1 if dep.scales == "mx" else 4


def _entries(dep: Deployment, heads: int, page_size: int) -> list[tuple[str, int]]:
    """(role, elements per token) of one layer's KV entries."""
    if dep.mla:
        return [("kv", dep.latent), ("rope", dep.rope)]
    return [("k", heads * dep.head_dim), ("v", heads * dep.head_dim)]


def _context(dep: Deployment, page_size: int, tp_rank: int, tp_size: int, dtype_size: int,
             pp_rank: int = 0, pp_size: int = 1) -> dict[str, Any]:
    ctx: dict[str, Any] = dict(page_size=page_size, tp_rank=tp_rank, tp_size=tp_size,
                               pp_rank=pp_rank, pp_size=pp_size)
    if not dep.mla:
        ctx.update(kv_heads=dep.kv_heads, head_dim=dep.head_dim, dtype_size=dtype_size)
    return ctx


def _build(entries: list[tuple[str, int, int, str | None]], capacity: int,
           ctx: dict[str, Any], fill: npt.NDArray[np.uint8] | None) -> Peer:
    """(role, layer, item bytes, representation) per entry, one buffer each in one arena."""
    sizes = [capacity * item for _, _, item, _ in entries]
    arena = np.full(sum(sizes) + 64, SENTINEL, dtype=np.uint8)
    if fill is not None:
        arena[:fill.size] = fill
    base = int(arena.ctypes.data)
    ptrs = list(np.cumsum([0, *sizes[:-1]]) + base)
    layout = kvplan.Layout([int(p) for p in ptrs], sizes, [e[2] for e in entries],
                           [e[1] for e in entries], [e[0] for e in entries], **ctx)
    if any(e[3] is not None for e in entries):
        layout = layout.with_representations([e[3] for e in entries])
    return Peer(layout, Memory(arena, base), arena)


def bf16_values(rng: np.random.Generator, n: int) -> npt.NDArray[np.uint8]:
    """``n`` bf16 values as bytes: finite, spread over magnitudes, some all-zero stretches."""
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-12, 12, n))).astype(np.float32)
    x[rng.random(n) < 0.02] = 0.0
    if n >= 64 and rng.random() < 0.5:
        start = int(rng.integers(0, n - 32))
        x[start:start + 32] = 0.0
    bits = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return bits.view(np.uint8)


def prefill(dep: Deployment, tp_rank: int, pp_rank: int, seed: int) -> Peer:
    heads = _heads(dep, tp_rank, dep.tp_p)
    per_stage = dep.layers // dep.pp
    layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    entries = [(role, layer, dep.ps_p * elems * 2, "bf16")
               for layer in layers for role, elems in _entries(dep, heads, dep.ps_p)]
    rng = np.random.default_rng(seed)
    total = sum(dep.capacity_p * e[2] for e in entries)
    ctx = _context(dep, dep.ps_p, tp_rank, dep.tp_p, 2, pp_rank, dep.pp)
    return _build(entries, dep.capacity_p, ctx, bf16_values(rng, total // 2))


def decode(dep: Deployment, tp_rank: int) -> tuple[Peer, Peer]:
    """The decode rank (converted KV + scale entries) and its bf16 twin (the same pool in
    bf16, no scale entries): what the decode would hold before quantizing."""
    heads = _heads(dep, tp_rank, dep.tp_d)
    real: list[tuple[str, int, int, str | None]] = []
    twin: list[tuple[str, int, int, str | None]] = []
    for layer in range(dep.layers):
        for role, elems in _entries(dep, heads, dep.ps_d):
            if role == "rope":
                real.append((role, layer, dep.ps_d * elems * 2, "bf16"))
            else:
                real.append((role, layer, dep.ps_d * elems, f"{dep.out_dtype}:{dep.scales}"))
            twin.append((role, layer, dep.ps_d * elems * 2, None))
        for role, elems in _entries(dep, heads, dep.ps_d):
            if role != "rope":
                real.append((f"{role}_scale", layer,
                             dep.ps_d * scale_groups(dep, heads, elems) * scale_size(dep), None))
    return (_build(real, dep.capacity_d, _context(dep, dep.ps_d, tp_rank, dep.tp_d, 1), None),
            _build(twin, dep.capacity_d, _context(dep, dep.ps_d, tp_rank, dep.tp_d, 2), None))


def expected_decode(dep: Deployment, tp_rank: int, real: Peer, twin: Peer,
                    dst_pages: npt.NDArray[np.int64], n_tokens: int) -> npt.NDArray[np.uint8]:
    """What the decode's arena holds after quantizing the twin's tokens 0..n_tokens itself."""
    want = real.arena.copy()
    heads = _heads(dep, tp_rank, dep.tp_d)
    by_key = {(e.layer_id, e.role): e for e in real.layout.entries()}
    tokens = np.arange(n_tokens)
    pages, slots = dst_pages[tokens // dep.ps_d].astype(np.int64), tokens % dep.ps_d
    for t_entry in twin.layout.entries():
        entry = by_key[(t_entry.layer_id, t_entry.role)]
        token_elems = t_entry.item_len // dep.ps_d // 2
        t_at = (t_entry.data_ptr - twin.memory.base + pages * t_entry.item_len
                + slots * token_elems * 2)
        raw = twin.arena[t_at[:, None] + np.arange(token_elems * 2)]
        if entry.role == "rope":
            r_at = entry.data_ptr - real.memory.base + pages * entry.item_len + \
                slots * token_elems * 2
            want[r_at[:, None] + np.arange(token_elems * 2)] = raw
            continue
        x = (raw.reshape(-1).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        groups = scale_groups(dep, heads, token_elems)
        per_token = groups * scale_size(dep)
        if dep.scales == "mx":
            q, s_bytes = reference_quantize_mx(x)
        else:
            q, s = reference_quantize(x.reshape(n_tokens * groups, -1), dep.out_dtype)
            s_bytes = s.astype("<f4").view(np.uint8)
        r_at = entry.data_ptr - real.memory.base + pages * entry.item_len + slots * token_elems
        want[r_at[:, None] + np.arange(token_elems)] = q.reshape(n_tokens, token_elems)
        scale = by_key[(t_entry.layer_id, f"{entry.role}_scale")]
        s_at = scale.data_ptr - real.memory.base + pages * scale.item_len + slots * per_token
        want[s_at[:, None] + np.arange(per_token)] = s_bytes.reshape(n_tokens, per_token)
    return want


def fill_twin(dep: Deployment, sources: list[Peer], twin: Peer,
              src_pages: npt.NDArray[np.int64], dst_pages: npt.NDArray[np.int64],
              n_tokens: int) -> None:
    for src in sources:
        reference_copy(src.layout, src.memory, twin.layout, twin.memory, src_pages, dst_pages,
                       n_tokens=n_tokens)


def _quantized_entries(dep: Deployment, heads: int, page_size: int, layers: range,
                       ) -> list[tuple[str, int, int, str | None]]:
    """An fp8/int8 rank's entries: KV (rope kept bf16) and their scale entries."""
    out: list[tuple[str, int, int, str | None]] = []
    for layer in layers:
        for role, elems in _entries(dep, heads, page_size):
            if role == "rope":
                out.append((role, layer, page_size * elems * 2, "bf16"))
            else:
                out.append((role, layer, page_size * elems, f"{dep.out_dtype}:{dep.scales}"))
        for role, elems in _entries(dep, heads, page_size):
            if role != "rope":
                out.append((f"{role}_scale", layer,
                            page_size * scale_groups(dep, heads, elems) * scale_size(dep), None))
    return out


def _quantized_fill(dep: Deployment, entries: list[tuple[str, int, int, str | None]],
                    capacity: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    parts = []
    for role, _, item, _ in entries:
        n = capacity * item
        if role.endswith("_scale") and dep.scales == "mx":
            parts.append(rng.integers(127 - 12, 127 + 6, n, dtype=np.uint8))
        elif role.endswith("_scale"):
            scales = np.exp2(rng.uniform(-12, 6, n // 4)).astype(np.float32)
            parts.append(scales.view(np.uint8))
        elif role == "rope":
            parts.append(bf16_values(rng, n // 2))
        else:
            codes = rng.integers(0, 256, n, dtype=np.uint8)
            if dep.out_dtype == "fp8_e4m3":
                codes[(codes & 0x7F) == 0x7F] = 0
            elif dep.out_dtype == "fp8_e5m2":
                codes[(codes & 0x7C) == 0x7C] = 0
            parts.append(codes)
    return np.concatenate(parts)


def quantized_prefill(dep: Deployment, tp_rank: int, pp_rank: int, seed: int) -> Peer:
    heads = _heads(dep, tp_rank, dep.tp_p)
    per_stage = dep.layers // dep.pp
    entries = _quantized_entries(dep, heads, dep.ps_p,
                                 range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    fill = _quantized_fill(dep, entries, dep.capacity_p, np.random.default_rng(seed))
    ctx = _context(dep, dep.ps_p, tp_rank, dep.tp_p, 1, pp_rank, dep.pp)
    return _build(entries, dep.capacity_p, ctx, fill)


def plain_decode(dep: Deployment, tp_rank: int) -> tuple[Peer, Peer]:
    """A bf16 decode rank and its quantized twin (what it would hold before dequantizing)."""
    heads = _heads(dep, tp_rank, dep.tp_d)
    real = [(role, layer, dep.ps_d * elems * 2, "bf16") for layer in range(dep.layers)
            for role, elems in _entries(dep, heads, dep.ps_d)]
    twin = _quantized_entries(dep, heads, dep.ps_d, range(dep.layers))
    return (_build(real, dep.capacity_d, _context(dep, dep.ps_d, tp_rank, dep.tp_d, 2), None),
            _build(twin, dep.capacity_d, _context(dep, dep.ps_d, tp_rank, dep.tp_d, 1), None))


def _reference_values(codes: npt.NDArray[np.uint8], dtype: str) -> npt.NDArray[np.float64]:
    if dtype == "int8":
        return codes.view(np.int8).astype(np.float64)
    values, table_codes = _TABLES[dtype]
    lookup = np.zeros(256)
    lookup[table_codes] = values
    lookup[table_codes | 0x80] = -values
    return lookup[codes]


def _reference_bf16(y: npt.NDArray[np.float64]) -> npt.NDArray[np.uint8]:
    """Nearest bf16 (8 significant bits), ties to even, through frexp: not the bit trick."""
    m, e = np.frexp(y)
    rounded = np.ldexp(np.rint(m * 256.0) / 256.0, e)
    return (rounded.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(
        np.uint16).view(np.uint8)


def dequantized_prefill(dep: Deployment, src: Peer) -> Peer:
    """The quantized prefill rank ``src`` as the bf16 rank it stands for: each value decoded
    exactly and multiplied by its own scale (float32 scales: one float32 multiplication; E8M0:
    ``2**(e - 127)``, exact in float64), rounded to bf16 nearest-even; kept bf16 entries as
    they are; no scale entries. Copying it to the decode byte for byte (the oracle's
    ``reference_copy``) is what a decode dequantizing the prefill's KV itself holds, whatever
    the two sides' head slices."""
    by_key = {(e.layer_id, e.role): e for e in src.layout.entries()}
    heads = _heads(dep, src.layout.tp_rank, dep.tp_p)
    n_tokens = dep.capacity_p * dep.ps_p
    entries: list[tuple[str, int, int, str | None]] = []
    fills = []
    for layer in sorted({e.layer_id for e in src.layout.entries()}):
        for role, elems in _entries(dep, heads, dep.ps_p):
            e = by_key[(layer, role)]
            start = e.data_ptr - src.memory.base
            raw = src.arena[start:start + e.item_len * dep.capacity_p]
            entries.append((role, layer, dep.ps_p * elems * 2, None))
            if role == "rope":
                fills.append(raw.copy())
                continue
            scale = by_key[(layer, f"{role}_scale")]
            s_start = scale.data_ptr - src.memory.base
            raw_scales = src.arena[s_start:s_start + scale.item_len * dep.capacity_p]
            groups = scale_groups(dep, heads, elems)
            values = _reference_values(raw, dep.out_dtype).reshape(n_tokens, groups, -1)
            if dep.scales == "mx":
                # The fill has no NaN scale byte.
                y = values * np.exp2(raw_scales.astype(np.float64) - 127).reshape(
                    n_tokens, groups, 1)
            else:
                scales = raw_scales.view("<f4").reshape(n_tokens, groups, 1)
                y = (values.astype(np.float32) * scales).astype(np.float64)
            fills.append(_reference_bf16(y.reshape(-1)))
    ctx = _context(dep, dep.ps_p, src.layout.tp_rank, dep.tp_p, 2, src.layout.pp_rank, dep.pp)
    return _build(entries, dep.capacity_p, ctx, np.concatenate(fills))


