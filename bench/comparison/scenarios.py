"""The compared requests and the buffers they address (fake device addresses, never
dereferenced)."""

from __future__ import annotations

import dataclasses

import numpy as np

BASE = 0x7F00_0000_0000


@dataclasses.dataclass
class Scenario:
    key: str
    model: str
    kind: str  # "mla" | "mha" | "hybrid"
    page_size: int
    tokens: int
    frag: float
    layers: int = 61
    bytes_per_token: int = 1152  # per entry (per K or per V for MHA)
    # hybrid PP stage
    src_ids: list | None = None
    dst_ids: list | None = None
    pp_size: int = 1
    pp_rank: int = 0
    start_layer: int = 0
    note: str = ""

    @property
    def n_pages(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def item_len(self) -> int:
        return self.bytes_per_token * self.page_size


def hybrid_ids(n_layers=48, every=4, pp_size=2, pp_rank=1):
    full = [i for i in range(n_layers) if i % every == every - 1]
    per = n_layers // pp_size
    lo, hi = pp_rank * per, (pp_rank + 1) * per
    stage = [i for i in full if lo <= i < hi]
    start_dense = sum(1 for i in full if i < lo)  # SGLang's dense prefill_start_layer
    return stage, full, start_dense


def scenarios(quick: bool) -> list[Scenario]:
    out = []
    toks = [4096, 32768, 131072] if not quick else [4096, 32768]
    for ps in (1, 64):
        for t in toks:
            for f in (0.0, 0.05, 1.0):
                out.append(Scenario(f"dsv3-p{ps}-{t // 1024}k-f{int(f * 100)}", "DeepSeek-V3 MLA",
                                    "mla", ps, t, f))
    for t, f in ((32768, 0.0), (32768, 0.05), (32768, 1.0)) if not quick else ((4096, 0.05),):
        out.append(Scenario(f"qwen3-p1-{t // 1024}k-f{int(f * 100)}", "Qwen3-235B MHA", "mha", 1,
                            t, f, layers=94, bytes_per_token=1024))
    stage, full, start = hybrid_ids()
    for f in (0.05, 1.0):
        out.append(Scenario(f"hybrid-pp2s1-p1-32k-f{int(f * 100)}",
                            "hybrid 48L (full attn every 4th), PP=2 stage 1, K/V by layer id",
                            "hybrid", 1, 32768, f, layers=len(stage), bytes_per_token=1024,
                            src_ids=stage, dst_ids=full, pp_size=2, pp_rank=1,
                            start_layer=start))
    out.append(Scenario("dsv3-single-61", "DeepSeek-V3 MLA, one contiguous request (1k tokens, "
                        "page 64 = 16 pages -> 61 blocks)", "mla", 64, 1024, 0.0,
                        note="call overhead"))
    return out


def make_pages(n: int, frag: float, seed: int):
    """src: contiguous; dst: strictly increasing, with exactly round(frag*(n-1)) positions where
    contiguity breaks (a forward gap of 1..8 pages), chosen by a seeded RNG."""
    src = np.arange(3, 3 + n, dtype=np.int64)
    from kvplan.presets import fragmented_pages

    dst = fragmented_pages(n, frag, seed=seed, start=5, max_gap=8)
    return src.astype(np.int32), dst.astype(np.int32)


@dataclasses.dataclass
class Built:
    sc: Scenario
    src_pages: np.ndarray
    dst_pages: np.ndarray
    src_ptrs: list
    dst_ptrs: list
    src_lens: list  # data_lens
    dst_lens: list
    item_lens: list  # per source entry
    dst_item_lens: list
    src_ids: list | None
    dst_ids: list | None


def _ptrs(n_entries, cap, item_lens, base):
    ptrs, lens = [], []
    addr = base
    for k in range(n_entries):
        size = cap * item_lens[k]
        ptrs.append(addr)
        lens.append(size)
        addr += (size + (1 << 21) - 1) // (1 << 21) * (1 << 21) + (1 << 21)
    return ptrs, lens


def build(sc: Scenario, seed: int = 1234) -> Built:
    src_pages, dst_pages = make_pages(sc.n_pages, sc.frag, seed)
    src_cap = int(src_pages.max()) + 1
    dst_cap = int(dst_pages.max()) + 1
    L = sc.item_len
    if sc.kind == "mla":
        n_src = n_dst = sc.layers
        src_ids = dst_ids = None
    elif sc.kind == "mha":
        n_src = n_dst = 2 * sc.layers
        src_ids = dst_ids = None
    else:  # hybrid: K entries then V entries, ids repeated (K block then V block)
        n_src, n_dst = 2 * len(sc.src_ids), 2 * len(sc.dst_ids)
        src_ids = list(sc.src_ids) * 2
        dst_ids = list(sc.dst_ids) * 2
    src_item = [L] * n_src
    dst_item = [L] * n_dst
    src_ptrs, src_lens = _ptrs(n_src, src_cap, src_item, BASE)
    dst_ptrs, dst_lens = _ptrs(n_dst, dst_cap, dst_item, BASE + (1 << 44))
    return Built(sc, src_pages, dst_pages, src_ptrs, dst_ptrs, src_lens, dst_lens, src_item,
                 dst_item, src_ids, dst_ids)


def scenario(key: str) -> Scenario:
    """The full run's scenario called ``key``."""
    return next(x for x in scenarios(False) if x.key == key)
