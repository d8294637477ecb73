"""Rounds for the staging protocol tests: ``Template.plan_rounds`` where the binding has it,
else :func:`reference_rounds`, a plain cut of a direct plan into rounds laid out as the core
lays them out (each sender's share of the decode arena, round ``k`` in buffer ``k % buffers``,
one network block per round), and the copies that run a round's gather or scatter."""

from __future__ import annotations

import builtins
import struct
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplan import TransferPlan, copy_local
from kvplan.exec.numpy import Memory, apply_plan

_U64 = np.uint64


@dataclass(frozen=True)
class Columns:
    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    lengths: np.ndarray

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    def as_lists(self) -> tuple[list[int], list[int], list[int]]:
        return self.src_addrs.tolist(), self.dst_addrs.tolist(), self.lengths.tolist()


@dataclass(frozen=True)
class RefManifest:
    index: int
    n_rounds: int
    buffer: int
    bytes: int
    n_network_blocks: int
    dst_offset: int

    _WIRE = struct.Struct("<IIIIQQ")

    @property
    def dst_bytes_range(self) -> tuple[int, int]:
        return self.dst_offset, self.dst_offset + self.bytes

    def to_bytes(self) -> builtins.bytes:
        return self._WIRE.pack(self.index, self.n_rounds, self.buffer, self.n_network_blocks,
                               self.bytes, self.dst_offset)

    @classmethod
    def from_bytes(cls, data: builtins.bytes) -> RefManifest:
        index, n, buffer, blocks, nbytes, off = cls._WIRE.unpack(bytes(data))
        return cls(index, n, buffer, nbytes, blocks, off)


@dataclass(frozen=True)
class RefRound:
    index: int
    buffer: int
    gather: Columns
    network: Columns
    scatter: Columns
    manifest: RefManifest


class RefRounds(list):  # type: ignore[type-arg]
    buffers: int = 2
    buffer_bytes: int = 0

    @property
    def bytes(self) -> int:
        return sum(r.manifest.bytes for r in self)


def reference_rounds(direct: Any, src_arena: tuple[int, int], dst_arena: tuple[int, int],
                     buffers: int = 2, sender: tuple[int, int] = (0, 1)) -> RefRounds:
    """``direct``'s blocks cut into rounds: the request's bytes in plan order, at most one
    round buffer each (``min(src size / buffers, decode share / buffers)``)."""
    src = np.asarray(direct.src_addrs, _U64).astype(np.int64)
    dst = np.asarray(direct.dst_addrs, _U64).astype(np.int64)
    lengths = np.asarray(direct.lengths, _U64).astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1]) if lengths.size else 0
    i, senders = sender
    share = dst_arena[1] // senders
    src_buf, dst_buf = src_arena[1] // buffers, share // buffers
    cap = min(src_buf, dst_buf)
    out = RefRounds()
    out.buffers, out.buffer_bytes = buffers, cap
    n = -(-total // cap) if total else 0
    for k in range(n):
        lo, hi = k * cap, min(total, (k + 1) * cap)
        a, b = int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(starts, hi, "left"))
        cs, ce = np.maximum(starts[a:b], lo), np.minimum(ends[a:b], hi)
        into = cs - starts[a:b]
        sb = src_arena[0] + (k % buffers) * src_buf
        db_off = i * share + (k % buffers) * dst_buf
        db = dst_arena[0] + db_off
        ln = (ce - cs).astype(_U64)
        gather = Columns((src[a:b] + into).astype(_U64), (sb + cs - lo).astype(_U64), ln)
        scatter = Columns((db + cs - lo).astype(_U64), (dst[a:b] + into).astype(_U64), ln)
        network = Columns(np.array([sb], _U64), np.array([db], _U64), np.array([hi - lo], _U64))
        manifest = RefManifest(k, n, k % buffers, hi - lo, 1, db_off)
        out.append(RefRound(k, k % buffers, gather, network, scatter, manifest))
    return out


def claiming(n: int, *ranges: tuple[int, int]) -> list[Any]:
    """``n`` stand-in rounds whose manifests land in the decode arena's ``ranges`` (round
    ``k`` in ``ranges[k % len(ranges)]``): what ``ArenaShares`` reads of a stream's rounds."""
    return [types.SimpleNamespace(index=k, manifest=types.SimpleNamespace(
        dst_bytes_range=ranges[k % len(ranges)])) for k in range(n)]


def has_plan_rounds() -> bool:
    from kvplan import Template

    return hasattr(Template, "plan_rounds")


def rounds_for(template: Any, src_pages: np.ndarray, dst_pages: np.ndarray,
               src_arena: tuple[int, int], dst_arena: tuple[int, int], buffers: int = 2,
               sender: tuple[int, int] = (0, 1)) -> Any:
    """The core's rounds where the binding has them, else :func:`reference_rounds` of the
    direct plan (``sender`` is the core's own for its rounds)."""
    if has_plan_rounds():
        return template.plan_rounds(src_pages, dst_pages, src_arena=src_arena,
                                    dst_arena=dst_arena, buffers=buffers)
    return reference_rounds(template.plan(src_pages, dst_pages), src_arena, dst_arena,
                            buffers, sender)


def copier(src_buffers: Sequence[np.ndarray], dst_buffers: Sequence[np.ndarray]
           ) -> Callable[[Any], None]:
    """A round's gather or scatter: ``kvplan.copy_local`` for the core's plans, memmoves for
    reference columns."""
    mems_src = [Memory.of(b) for b in src_buffers]
    mems_dst = [Memory.of(b) for b in dst_buffers]

    def holding(mems: list[Memory], addr: int) -> Memory:
        return next(m for m in mems if m.base <= addr < m.base + m.data.size)

    def run(plan: Any) -> None:
        if isinstance(plan, TransferPlan):
            copy_local(plan, src_buffers, dst_buffers)
            return
        for s, d, n in zip(*plan.as_lists()):
            holding(mems_dst, d).at(d, n)[:] = holding(mems_src, s).at(s, n)

    return run


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------

@dataclass
class Peer:
    """One rank's KV memory: a single array holding every entry's buffer back to back."""

    memory: np.ndarray
    layout: Any


def _pools(n: int, nbytes: int, seed: int | None) -> tuple[np.ndarray, list[int], list[int]]:
    memory = (np.random.default_rng(seed).integers(0, 256, n * nbytes, dtype=np.uint8)
              if seed is not None else np.full(n * nbytes, 0xA5, np.uint8))
    base = int(memory.ctypes.data)
    return memory, [base + j * nbytes for j in range(n)], [nbytes] * n


#: MLA page 1: one 576-element bf16 latent per token per layer.
MLA_LAYERS, MLA_ITEM, MLA_CAPACITY = 4, 1152, 640


def mla_peer(seed: int | None) -> Peer:
    memory, ptrs, lens = _pools(MLA_LAYERS, MLA_CAPACITY * MLA_ITEM, seed)
    from kvplan import Layout

    return Peer(memory, Layout.mla(ptrs, lens, MLA_ITEM, list(range(MLA_LAYERS)), page_size=1))


def mla_fragmented_case(tokens: int = 300, seed: int = 11) -> tuple[Peer, Peer, Any, np.ndarray,
                                                                      np.ndarray]:
    """``(prefill, decode, template, src_pages, dst_pages)``: MLA page 1, the decode's pages
    all apart (one direct block per token per layer)."""
    from kvplan import Template
    from kvplan.presets import fragmented_pages

    prefill, decode = mla_peer(seed), mla_peer(None)
    src = np.random.default_rng(seed).permutation(MLA_CAPACITY)[:tokens].astype(np.int64)
    dst = fragmented_pages(tokens, 1.0, seed=seed, shuffle_runs=True, capacity=MLA_CAPACITY)
    return prefill, decode, Template(prefill.layout, decode.layout), src, dst


#: GQA NHD: 8 KV heads of 32 bf16 elements, 16 tokens a page.
GQA_HEADS, GQA_HEAD_DIM, GQA_DTYPE, GQA_PAGE, GQA_LAYERS, GQA_CAPACITY = 8, 32, 2, 16, 4, 32


def gqa_peer(tp_rank: int, tp_size: int, seed: int | None) -> Peer:
    from kvplan import Layout

    per = max(1, GQA_HEADS // tp_size)
    item = GQA_PAGE * per * GQA_HEAD_DIM * GQA_DTYPE
    memory, ptrs, lens = _pools(2 * GQA_LAYERS, GQA_CAPACITY * item, seed)
    layout = Layout.mha(ptrs[:GQA_LAYERS], ptrs[GQA_LAYERS:], lens[:GQA_LAYERS],
                        lens[GQA_LAYERS:], item, item, list(range(GQA_LAYERS)),
                        page_size=GQA_PAGE, tp_rank=tp_rank, tp_size=tp_size,
                        kv_heads=GQA_HEADS, heads_per_rank=per, head_dim=GQA_HEAD_DIM,
                        dtype_size=GQA_DTYPE, memory_order="NHD")
    return Peer(memory, layout)


def tp8_to_tp2_case(pages: int = 10, seed: int = 5) -> tuple[list[Peer], Peer, list[Any],
                                                             np.ndarray, np.ndarray]:
    """``(writers, decode, templates, src_pages, dst_pages)``: decode rank 0 of TP 2 (heads
    0-3) filled by prefill ranks 0-3 of TP 8, one head each; decode pages fragmented."""
    from kvplan import Template
    from kvplan.presets import fragmented_pages

    decode = gqa_peer(0, 2, None)
    writers = [gqa_peer(r, 8, seed + r) for r in range(4)]
    src = np.random.default_rng(seed).permutation(GQA_CAPACITY)[:pages].astype(np.int64)
    dst = fragmented_pages(pages, 1.0, seed=seed, shuffle_runs=True, capacity=GQA_CAPACITY)
    return writers, decode, [Template(w.layout, decode.layout) for w in writers], src, dst


__all__ = ["Columns", "RefManifest", "RefRound", "RefRounds", "apply_plan", "copier",
           "claiming", "gqa_peer", "has_plan_rounds", "mla_fragmented_case", "mla_peer", "reference_rounds",
           "rounds_for", "tp8_to_tp2_case", "Peer"]
