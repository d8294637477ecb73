"""Synthetic SGLang deployments for the drop-in tests and bench: a model's KV entries on a
decode peer (PP 1) and on one prefill PP stage, as SGLang 0.5.23 lays them out, plus the
ground truth of where each source byte belongs.

An entry is ``(role, layer)``: role ``kv`` (MLA), ``k``/``v`` (MHA), ``g0``.. (NPU groups),
``draft``/``draft_k``/``draft_v``/``draft_g0``.. for draft layers, whose layer is the id in
SGLang's band above the model (``num_layers + index``).
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SESSION = "decode-peer:1"
SRC_BASE, DST_BASE, STRIDE = 0x1_0000_0000, 0x9_0000_0000, 0x100000
SRC_PAGES, DST_PAGES = 64, 96


def load_loader() -> Any:
    """The SGLang loader module (``support.sglang_loader``)."""
    from . import sglang_loader

    return sglang_loader


def load_sglang_or_fail() -> Any:
    """SGLang's real code; under CI=true a failure to fetch or load it is a failure."""
    import pytest

    loader = load_loader()
    try:
        return loader.load_sglang()
    except Exception as exc:  # noqa: BLE001 - reported either way
        msg = f"SGLang {loader.SGLANG_VERSION} could not be loaded from its wheel: {exc!r}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg + " (fails under CI=true)")


@contextlib.contextmanager
def last_rank(value: bool) -> Iterator[None]:
    """The loader's runtime context says this rank is (or is not) the last PP rank, for the
    block; restored after it."""
    runtime = load_loader().RUNTIME
    old = runtime.parallel.pp_group.is_last_rank
    runtime.parallel.pp_group.is_last_rank = value
    try:
        yield
    finally:
        runtime.parallel.pp_group.is_last_rank = old


@dataclass
class Deployment:
    kind: str  # "mla" | "mha" | "npu"
    num_layers: int
    kv_layers: list[int]  # model layers that carry KV (all, or every n-th for hybrid)
    pp_size: int
    stage: int
    hybrid: bool = False
    draft_layers: int = 0
    groups: int = 1
    publish_ids: bool = True
    splits: list[int] | None = None  # KV layers per stage (uneven splits); default even-ish
    item_seed: int = 0
    src_entries: list[tuple[str, int]] = field(default_factory=list)
    dst_entries: list[tuple[str, int]] = field(default_factory=list)
    items: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.kv_layers)
        splits = self.splits or [n // self.pp_size + (1 if s < n % self.pp_size else 0)
                                 for s in range(self.pp_size)]
        assert sum(splits) == n
        self.start = sum(splits[: self.stage])
        stage_layers = self.kv_layers[self.start: self.start + splits[self.stage]]
        last = self.stage == self.pp_size - 1
        band = [self.num_layers + d for d in range(self.draft_layers)]
        self.dst_entries = self._entries(self.kv_layers, band)
        self.src_entries = self._entries(stage_layers, band if last else [])
        self.stage_draft = self.draft_layers if last else 0
        rng = np.random.default_rng(self.item_seed)
        for e in set(self.dst_entries):
            self.items[e] = int(rng.choice([32, 48, 64, 96]))
        if self.kind == "mha":  # K and V of one layer: SGLang's MHA pools use one size
            for role, layer in list(self.items):
                if role in ("v", "draft_v"):
                    self.items[(role, layer)] = self.items[(role.replace("v", "k"), layer)]

    def _entries(self, layers: list[int], band: list[int]) -> list[tuple[str, int]]:
        if self.kind == "mla":
            return [("kv", x) for x in layers] + [("draft", x) for x in band]
        if self.kind == "mha":
            return ([("k", x) for x in layers] + [("v", x) for x in layers]
                    + [("draft_k", x) for x in band] + [("draft_v", x) for x in band])
        return ([(f"g{g}", x) for g in range(self.groups) for x in layers]
                + [(f"draft_g{g}", x) for g in range(self.groups) for x in band])

    # SGLang's lists
    def src_lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        ptrs = [SRC_BASE + i * STRIDE for i in range(len(self.src_entries))]
        items = [self.items[e] for e in self.src_entries]
        lens = [SRC_PAGES * it for it in items]
        ids = [layer for _, layer in self.src_entries] if self.publish_ids else []
        return ptrs, lens, items, ids

    def dst_lists(self) -> tuple[list[int], list[int], list[int]]:
        ptrs = [DST_BASE + i * STRIDE for i in range(len(self.dst_entries))]
        items = [self.items[e] for e in self.dst_entries]
        ids = [layer for _, layer in self.dst_entries] if self.publish_ids else []
        return ptrs, items, ids

    def kv_args(self) -> types.SimpleNamespace:
        ptrs, lens, items, ids = self.src_lists()
        ns = types.SimpleNamespace(
            kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items, kv_layer_ids=ids,
            prefill_start_layer=self.start, prefill_end_layer=None, mla_compression_ratios=None,
            num_draft_entries=(self.stage_draft * (2 if self.kind == "mha" else 1)
                               if self.kind != "npu" else 0),
            page_size=1, engine_rank=0, pp_rank=self.stage,
            state_types=[], state_data_ptrs=[], state_data_lens=[], state_item_lens=[],
            state_layer_ids=[],
        )
        if self.kind == "npu":
            ns.kv_buf_groups = self.groups
            ns.hidden_kv_layers = len(self.kv_layers)
            ns.draft_kv_layers = self.draft_layers
        return ns

    def register_info(self) -> types.SimpleNamespace:
        ptrs, items, ids = self.dst_lists()
        return types.SimpleNamespace(
            dst_kv_ptrs=ptrs, dst_kv_item_lens=items, dst_kv_item_len=items[0], dst_kv_layer_ids=ids,
            dst_state_data_ptrs=[], dst_state_item_lens=[], dst_state_layer_ids=[],
            dst_tp_rank=0, dst_attn_tp_size=1)

    def truth(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> list[tuple[int, int, int]]:
        """Every block that moves each source entry's pages onto the decode entry of the same
        role and layer."""
        sptrs = self.src_lists()[0]
        dptrs = self.dst_lists()[0]
        where = {e: j for j, e in enumerate(self.dst_entries)}
        blocks = []
        for i, e in enumerate(self.src_entries):
            j = where[e]
            L = self.items[e]
            for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
                blocks.append((sptrs[i] + s * L, dptrs[j] + d * L, L))
        return canonical(blocks)


def canonical(blocks: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The destination byte map as maximal ``(src, dst, length)`` segments sorted by
    destination: two block lists move the same bytes iff their canonical forms are equal.
    Raises AssertionError if two blocks write the same destination byte."""
    out: list[list[int]] = []
    for s, d, n in sorted(((s, d, n) for s, d, n in blocks if n), key=lambda b: b[1]):
        if out:
            ps, pd, pn = out[-1]
            assert pd + pn <= d, f"destination bytes written twice at {d:#x}"
            if pd + pn == d and ps + pn == s:
                out[-1][2] += n
                continue
        out.append([s, d, n])
    return [(s, d, n) for s, d, n in out]


def engine_blocks(calls: list[tuple[Any, ...]]) -> list[tuple[int, int, int]]:
    blocks = []
    for _session, src, dst, lengths in calls:
        blocks.extend(zip(src, dst, lengths))
    return blocks


def request(rng: np.random.Generator, *, fragmented: bool, n: int | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    n = int(n if n is not None else rng.integers(1, 33))
    if fragmented:
        src = rng.choice(SRC_PAGES, size=n, replace=False)
        dst = rng.choice(DST_PAGES, size=n, replace=False)
    else:
        s0 = int(rng.integers(0, SRC_PAGES - n + 1))
        d0 = int(rng.integers(0, DST_PAGES - n + 1))
        src, dst = np.arange(s0, s0 + n), np.arange(d0, d0 + n)
    return src.astype(np.int32), dst.astype(np.int32)
