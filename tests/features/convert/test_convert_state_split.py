"""Conversion templates on a hybrid model whose state entries carry a TP channel split
(``Layout.with_state(channels=, outer_rows=, shard_groups=)``) between prefill and decode of
different TP sizes: the KV pages convert bf16 -> fp8 with scales, the state slots move as
channel slices, byte for byte.

Every rank is one arena: KV entries (bf16 on the prefill; fp8 plus scale entries on the decode)
then its state slots (a GDN-like conv state of three sub-blocks q|k|v over several rows, a
temporal state of one sub-block, a replicated state of 0 channels). The decode's expected bytes
are built without the planner: its KV by the decode quantizing the oracle's bf16 copy itself
(``support.convert_cases.expected_decode``), its state slots by the oracle's channel-split copy
(:func:`kvplan.testing.oracle.reference_copy` into a bf16 twin of the decode holding the same
state entries)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

import kvplan
from kvplan.testing.oracle import Memory, apply_conversion, apply_plan, reference_copy

from support.convert_cases import SENTINEL, Deployment, Peer, bf16_values, expected_decode

SLOTS = 3
KV_HEADS, HEAD_DIM = 8, 4


@dataclass(frozen=True)
class State:
    """One state tensor of the model: model channels (0: replicated), sub-blocks, rows, bytes
    per channel (a replicated slot's bytes when ``total`` is 0)."""

    role: str
    layer: int
    total: int
    groups: tuple[int, ...]
    rows: int
    width: int

    def channels(self, tp: int) -> int:
        return self.total // tp

    def item_len(self, tp: int) -> int:
        return self.width if self.total == 0 else self.rows * self.channels(tp) * self.width


STATES = (
    State("conv", 10, 32, (8, 8, 16), 3, 2),  # q | k | v, the value block larger, 3 rows
    State("temporal", 11, 16, (), 1, 8),
    State("replicated", 12, 0, (), 1, 24),
)


@dataclass
class Rank:
    """One rank's arena and layouts: ``layout`` (KV, scales when quantized, states),
    ``kv_layout`` (its KV entries only) and ``state_layout`` (its state entries only, no
    attention geometry), all over the same arena; ``states`` holds each state buffer's
    (offset in the arena, bytes)."""

    layout: kvplan.Layout
    kv_layout: kvplan.Layout
    state_layout: kvplan.Layout
    memory: Memory
    arena: npt.NDArray[np.uint8]
    states: list[tuple[int, int]]

    def peer(self, kv_only: bool = False) -> Peer:
        return Peer(self.kv_layout if kv_only else self.layout, self.memory, self.arena)


def _rank(dep: Deployment, tp: int, rank: int, *, side: str, kind: str,
          seed: int | None = None) -> Rank:
    """``side``: "prefill" or "decode" (its page size and capacity); ``kind``: "bf16" (bf16
    KV, published), "quantized" (fp8 KV and scale entries) or "twin" (bf16 KV, no
    representation published). ``seed``: random bytes (bf16 values in bf16 KV), else SENTINEL
    bytes."""
    heads = KV_HEADS // tp
    ps = dep.ps_p if side == "prefill" else dep.ps_d
    capacity = dep.capacity_p if side == "prefill" else dep.capacity_d
    elems = heads * HEAD_DIM
    kv: list[tuple[str, int, int, str | None]] = []
    for layer in range(dep.layers):
        for role in ("k", "v"):
            if kind == "quantized":
                kv.append((role, layer, ps * elems, f"{dep.out_dtype}:{dep.scales}"))
            else:
                kv.append((role, layer, ps * elems * 2, "bf16" if kind == "bf16" else None))
        if kind == "quantized":
            groups = heads if dep.scales == "per_token_head" else 1
            kv += [(f"{role}_scale", layer, ps * groups * 4, None) for role in ("k", "v")]
    kv_sizes = [capacity * item for _, _, item, _ in kv]
    state_sizes = [SLOTS * s.item_len(tp) for s in STATES]
    arena = np.full(sum(kv_sizes) + sum(state_sizes) + 64, SENTINEL, dtype=np.uint8)
    if seed is not None:
        rng = np.random.default_rng(seed)
        kv_bytes = sum(kv_sizes)
        arena[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
        if kind != "quantized":
            arena[:kv_bytes] = bf16_values(rng, kv_bytes // 2)
    base = int(arena.ctypes.data)
    ptrs = [base + int(o) for o in np.cumsum([0, *kv_sizes[:-1]])]
    ctx = dict(page_size=ps, tp_rank=rank, tp_size=tp, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
               dtype_size=1 if kind == "quantized" else 2)
    kv_layout = kvplan.Layout(ptrs, kv_sizes, [e[2] for e in kv], [e[1] for e in kv],
                              [e[0] for e in kv], **ctx)
    if kind != "twin":
        kv_layout = kv_layout.with_representations([e[3] for e in kv])
    layout, at, states = kv_layout, sum(kv_sizes), []
    state_layout = kvplan.Layout([], [], [], tp_size=tp, tp_rank=rank)
    for s, size in zip(STATES, state_sizes):
        layout, state_layout = (
            side_layout.with_state(s.role, [base + at], [size], [s.item_len(tp)], [s.layer],
                                   channels=s.channels(tp), outer_rows=s.rows,
                                   shard_groups=[list(s.groups) or None])
            for side_layout in (layout, state_layout))
        states.append((at, size))
        at += size
    return Rank(layout, kv_layout, state_layout, Memory(arena, base), arena, states)


def _staging(size: int) -> Memory:
    arena = np.zeros(size + 64, dtype=np.uint8)
    return Memory(arena, int(arena.ctypes.data))


@dataclass(frozen=True)
class Case:
    tp_p: int
    tp_d: int
    scales: str
    ps_p: int
    ps_d: int
    n_tokens: int
    slots: tuple[int, int]
    seed: int


CASES = [
    Case(1, 2, "per_token", 2, 2, 7, (1, 2), 11),
    Case(1, 2, "per_token_head", 1, 2, 5, (0, 0), 12),
    Case(2, 1, "per_token_head", 2, 2, 8, (2, 1), 13),
    Case(2, 1, "per_token_head", 2, 1, 3, (1, 0), 14),
    Case(2, 4, "per_token_head", 2, 2, 6, (0, 2), 15),
    Case(4, 2, "per_token_head", 1, 1, 4, (2, 2), 16),
    Case(2, 2, "per_token", 2, 2, 5, (1, 1), 17),
]


def _pages(case: Case, dep: Deployment) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    rng = np.random.default_rng(case.seed)
    return (rng.choice(dep.capacity_p, -(-case.n_tokens // dep.ps_p), replace=False),
            rng.choice(dep.capacity_d, -(-case.n_tokens // dep.ps_d), replace=False))


def _deployment(case: Case) -> Deployment:
    return Deployment(tp_p=case.tp_p, tp_d=case.tp_d, ps_p=case.ps_p, ps_d=case.ps_d,
                      scales=case.scales, capacity_p=6, capacity_d=6)


def _sources(case: Case, dep: Deployment) -> list[Rank]:
    return [_rank(dep, case.tp_p, r, side="prefill", kind="bf16", seed=case.seed * 31 + r)
            for r in range(case.tp_p)]


def _twin(case: Case, dep: Deployment, sources: list[Rank], r_d: int) -> Rank:
    """Decode rank ``r_d``'s bf16 twin holding what the oracle writes (the bf16 KV and the
    channel-split state slot from every prefill rank); asserts the plain byte-copy
    ``Template`` between each prefill rank and the twin writes the same bytes, each at most
    once, its plan the size of the oracle's copy."""
    src_pages, dst_pages = _pages(case, dep)
    s_slot, d_slot = case.slots
    twin = _rank(dep, case.tp_d, r_d, side="decode", kind="twin")
    plain = twin.memory.copy()
    plain_written = np.zeros(plain.data.size, dtype=bool)
    for src in sources:
        moved = reference_copy(src.layout, src.memory, twin.layout, twin.memory, src_pages,
                               dst_pages, n_tokens=case.n_tokens, src_slot=s_slot,
                               dst_slot=d_slot)
        direct = kvplan.Template(src.layout, twin.layout).plan(
            kvplan.Request(src_pages, dst_pages, slot=case.slots, n_tokens=case.n_tokens))
        assert direct.total_bytes == moved, (case, src.layout.tp_rank, r_d)
        apply_plan(direct, src.memory, plain, plain_written)
    assert np.array_equal(plain.data, twin.arena), (case, r_d, "plain Template")
    return twin


def _check(case: Case) -> None:
    """Every decode rank: pages through ``ConversionTemplate.plan`` (page lists) and the slot
    through ``ConversionTemplate.plan(Request(slot=...))``, from every prefill rank, each
    decode byte written at most once; the decode equals the reference (KV quantized from the
    twin's bf16 copy, state slots as the twin's)."""
    dep = _deployment(case)
    src_pages, dst_pages = _pages(case, dep)
    d_slot = case.slots[1]
    sources = _sources(case, dep)
    for r_d in range(case.tp_d):
        real = _rank(dep, case.tp_d, r_d, side="decode", kind="quantized")
        written = np.zeros(real.arena.size, dtype=bool)
        for src in sources:
            where = (case, src.layout.tp_rank, r_d)
            template = kvplan.ConversionTemplate(src.layout, real.layout)
            assert template.converts and template.convert_on == "prefill", where
            staging = _staging(2 * src.arena.size)
            pages = template.plan(src_pages, dst_pages, (staging.base, staging.data.size),
                                  n_tokens=case.n_tokens)
            apply_conversion(pages, src.memory, staging, real.memory, written)
            slot = template.plan(kvplan.Request(slot=case.slots),
                                 staging=(staging.base, staging.data.size))
            assert slot.converted_bytes == 0 and slot.scale_bytes == 0, where
            apply_conversion(slot, src.memory, staging, real.memory, written)
        twin = _twin(case, dep, sources, r_d)
        want = expected_decode(dep, r_d, real.peer(), twin.peer(kv_only=True), dst_pages,
                               case.n_tokens)
        for (at, size), (t_at, t_size) in zip(real.states, twin.states):
            assert size == t_size
            want[at:at + size] = twin.arena[t_at:t_at + size]
        bad = np.flatnonzero(real.arena != want)
        assert bad.size == 0, f"{case} decode rank {r_d}: {bad.size} wrong bytes from {bad[0]}"
        # Every byte of the decode's slot is written, by exactly one prefill rank.
        for at, size in real.states:
            item = size // SLOTS
            assert written[at + d_slot * item:at + (d_slot + 1) * item].all(), (case, r_d)


def _ids(case: Case) -> str:
    return f"tp{case.tp_p}to{case.tp_d}-{case.scales}-ps{case.ps_p}x{case.ps_d}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_plain_template_writes_the_oracles_split_state_and_kv(case: Case) -> None:
    """The byte-copy half: prefill -> the decode's bf16 twin, pages and slot in one request,
    equals the oracle at every decode rank."""
    dep = _deployment(case)
    sources = _sources(case, dep)
    for r_d in range(case.tp_d):
        _twin(case, dep, sources, r_d)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_converted_pages_and_split_state_slots_equal_the_reference(case: Case) -> None:
    _check(case)


def test_a_hybrid_request_is_refused_naming_the_slot_and_the_feature() -> None:
    """Pages and a slot in one request: the conversion plan refuses it (typed, declared as
    ``pages_with_state``) rather than moving one part; the parts plan apart (above)."""
    dep = Deployment(tp_p=1, tp_d=2, ps_p=2, ps_d=2, capacity_p=6, capacity_d=6)
    src = _rank(dep, 1, 0, side="prefill", kind="bf16", seed=1)
    real = _rank(dep, 2, 1, side="decode", kind="quantized")
    template = kvplan.ConversionTemplate(src.layout, real.layout)
    pages = np.array([0, 1], dtype=np.int64)
    staging = _staging(2 * src.arena.size)
    with pytest.raises(kvplan.UnsupportedError, match=r"state slot \(1, 2\)") as err:
        template.plan(kvplan.Request(pages, pages, slot=(1, 2)),
                      staging=(staging.base, staging.data.size))
    assert err.value.feature == "pages_with_state"


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (2, 2)])
def test_a_dequantizing_template_moves_the_split_state_slot_exactly(tp_p: int,
                                                                    tp_d: int) -> None:
    """The other direction: fp8 KV with per_token_head scales on the prefill, bf16 on the
    decode (the decode dequantizes), the same split state entries on both. A slot request
    through the conversion plan writes the decode's state slot as the oracle's channel-split
    copy does (the state-only layouts over the same memory), and nothing else of the decode."""
    dep = Deployment(tp_p=tp_p, tp_d=tp_d, ps_p=2, ps_d=2, scales="per_token_head",
                     capacity_p=4, capacity_d=4)
    slots = (2, 1)
    sources = [_rank(dep, tp_p, r, side="prefill", kind="quantized", seed=40 + r)
               for r in range(tp_p)]
    for r_d in range(tp_d):
        real = _rank(dep, tp_d, r_d, side="decode", kind="bf16")
        want = real.memory.copy()
        written = np.zeros(real.arena.size, dtype=bool)
        for src in sources:
            template = kvplan.ConversionTemplate(src.layout, real.layout)
            assert template.convert_on == "decode"
            staging, dst_staging = _staging(src.arena.size), _staging(src.arena.size)
            plan = template.plan(kvplan.Request(slot=slots),
                                 staging=(staging.base, staging.data.size),
                                 dst_staging=(dst_staging.base, dst_staging.data.size))
            apply_conversion(plan, src.memory, staging, real.memory, written, dst_staging)
            reference_copy(src.state_layout, src.memory, real.state_layout, want, [], [],
                           src_slot=slots[0], dst_slot=slots[1])
        bad = np.flatnonzero(real.arena != want.data)
        assert bad.size == 0, (tp_p, tp_d, r_d, bad.size, bad[0])


def test_a_split_on_one_side_only_is_refused_as_the_byte_copy_template_refuses() -> None:
    """A prefill that publishes its state entries without a split (same bytes, same buffers)
    and a decode that declares one: the byte-copy template refuses the pair (which channels the
    prefill's slot holds is unknown), and so must the conversion template."""
    dep = Deployment(tp_p=1, tp_d=2, ps_p=2, ps_d=2, capacity_p=4, capacity_d=4)
    src = _rank(dep, 1, 0, side="prefill", kind="bf16", seed=3)
    unsplit = src.kv_layout
    for s, (at, size) in zip(STATES, src.states):
        unsplit = unsplit.with_state(s.role, [src.memory.base + at], [size], [s.item_len(1)],
                                     [s.layer])
    twin = _rank(dep, 2, 1, side="decode", kind="twin")
    with pytest.raises(kvplan.SizeMismatchError, match="presence"):
        kvplan.Template(unsplit, twin.layout)
    real = _rank(dep, 2, 1, side="decode", kind="quantized")
    with pytest.raises(kvplan.SizeMismatchError, match="presence"):
        kvplan.ConversionTemplate(unsplit, real.layout)
