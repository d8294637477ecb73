"""kvplan.torch on CPU tensors, checked byte for byte against the NumPy reference.

Every plan the executor runs is also run by ``kvplan.testing.oracle.apply_plan`` (memmoves,
block by block) or checked against ``reference_copy`` (the oracle written from the layout
rules): random block plans over tensors of several dtypes, direct plans with TP head slicing
and page-size ratios executed between two local pools, staged plans (gather, network and
scatter all through the executor, several writers into one decode region), pack plans and row
gathers of DCP ranks, cross-layer pools and batch plans. ``layout_from_tensors`` is checked
against the named ``Layout`` constructors for vLLM, SGLang and cross-layer tensors, and through
a request planned between such layouts. Bad input (non-contiguous tensors, blocks outside or
across tensors, overlapping blocks) raises kvplan's typed errors and copies nothing.

Needs torch (the ``kvplan[torch]`` extra): ``bash scripts/test-torch`` installs it and runs this
file; without torch it is skipped. With ``KVPLAN_REQUIRE_TORCH=1`` a missing torch fails it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("KVPLAN_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip(
        "torch",
        reason="kvplan.torch needs PyTorch, not installed here (pip install "
        "'kvplan[torch]', or run bash scripts/test-torch)",
    )

import kvplan  # noqa: E402
from kvplan.testing.oracle import Memory, apply_plan, apply_staged, reference_copy  # noqa: E402
from kvplan.testing.ranks import Model, Rank, rank_memory  # noqa: E402
from kvplan.torch import TorchExecutor, layout_from_tensors  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tensor_of(memory: Memory) -> torch.Tensor:
    """The numpy memory as a CPU tensor over the same bytes (same addresses)."""
    return torch.from_numpy(memory.data)


def memory_of(arena: torch.Tensor) -> Memory:
    """A contiguous CPU uint8 tensor as oracle memory (a view: same bytes, same address)."""
    return Memory(arena.numpy(), int(arena.data_ptr()))


class Arena:
    """One uint8 CPU tensor carved into typed tensors (contiguous views with gaps between
    them), so that one oracle ``Memory`` covers every tensor the executor is given."""

    DTYPES = [torch.float16, torch.float32, torch.int8, torch.bfloat16, torch.int64]

    def __init__(self, rng: np.random.Generator, n_tensors: int, *, gap: int = 64) -> None:
        sizes = [int(rng.integers(1, 9)) * 4096 for _ in range(n_tensors)]
        self.bytes = torch.from_numpy(
            rng.integers(0, 256, sum(sizes) + gap * (n_tensors + 1), dtype=np.uint8)
        )
        self.tensors, self.spans = [], []
        at = gap
        for i, size in enumerate(sizes):
            dtype = self.DTYPES[i % len(self.DTYPES)]
            view = self.bytes[at : at + size].view(dtype)
            self.tensors.append(view.view(4, -1) if i % 2 else view)
            self.spans.append((int(self.bytes.data_ptr()) + at, size))
            at += size + gap

    def memory(self) -> Memory:
        return memory_of(self.bytes)


def random_blocks(
    rng: np.random.Generator,
    arena: Arena,
    unit: int,
    n_blocks: int,
    src_tensors: list[int],
    dst_tensors: list[int],
) -> kvplan.BlockSlice:
    """``n_blocks`` blocks of whole ``unit``s: destinations disjoint (cut from the destination
    tensors and shuffled), sources anywhere in the source tensors (they may overlap)."""
    cuts = []
    for i in dst_tensors:
        base, size = arena.spans[i]
        edges = np.unique(rng.integers(0, size // unit, 2 * n_blocks)) * unit
        edges = np.concatenate([edges, [size]])
        cuts += [(base + int(a), int(b - a)) for a, b in zip(edges[:-1], edges[1:])]
    chosen = [cuts[int(k)] for k in rng.permutation(len(cuts))[:n_blocks]]
    src, dst, lengths = [], [], []
    for addr, length in chosen:
        base, size = arena.spans[src_tensors[int(rng.integers(len(src_tensors)))]]
        length = min(length, size)
        src.append(base + int(rng.integers(0, (size - length) // unit + 1)) * unit)
        dst.append(addr)
        lengths.append(length)
    return kvplan.BlockSlice(
        np.array(src, np.uint64), np.array(dst, np.uint64), np.array(lengths, np.uint64)
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("unit", [1, 2, 16, 256])
def test_random_block_plans_match_memmoves(seed: int, unit: int) -> None:
    rng = np.random.default_rng(seed * 100 + unit)
    arena = Arena(rng, 6)
    # Sources in tensors 0-2, destinations in 3-5, and with seed % 2 a part of both inside
    # one tensor (its first half read, its second half written is not expressible here, so
    # tensor 2 is read and written by disjoint blocks through its own destinations).
    src_tensors, dst_tensors = [0, 1, 2], [3, 4, 5]
    plan = random_blocks(rng, arena, unit, int(rng.integers(1, 200)), src_tensors, dst_tensors)
    want = arena.memory().copy()
    apply_plan(plan, want, want)
    moved = TorchExecutor(arena.tensors).run(plan)
    assert moved == int(plan.lengths.sum())
    np.testing.assert_array_equal(arena.bytes.numpy(), want.data)


def test_blocks_inside_one_tensor_and_a_named_registry() -> None:
    """Source and destination blocks inside one tensor (disjoint bytes), tensors given by
    name; equal-length blocks and blocks of mixed lengths."""
    rng = np.random.default_rng(7)
    t = torch.from_numpy(rng.integers(0, 256, 8192, dtype=np.uint8))
    base = int(t.data_ptr())
    for lengths in ([64] * 20, list(rng.integers(1, 5, 20) * 32)):
        src = base + np.arange(20, dtype=np.uint64) * 128
        dst = base + 4096 + rng.permutation(20).astype(np.uint64) * 128
        plan = kvplan.BlockSlice(
            src.astype(np.uint64), dst.astype(np.uint64), np.array(lengths, np.uint64)
        )
        want = memory_of(t).copy()
        apply_plan(plan, want, want)
        assert TorchExecutor({"kv": t}).run(plan) == sum(int(x) for x in lengths)
        np.testing.assert_array_equal(t.numpy(), want.data)


def run_direct(
    model: Model,
    prefill: Rank,
    decode: Rank,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    n_tokens: int | None,
) -> None:
    """Every prefill rank's direct plan into one decode rank through the executor, against
    apply_plan and the oracle."""
    dst = rank_memory(model, decode)
    by_numpy, want = dst.memory.copy(), dst.memory.copy()
    for r_p in range(prefill.tp_size):
        rank = Rank(
            r_p,
            prefill.tp_size,
            prefill.page_size,
            prefill.memory_order,
            prefill.capacity,
            prefill.cross_layer,
        )
        src = rank_memory(model, rank, seed=r_p + 1)
        plan = kvplan.Template(src.layout, dst.layout).plan(src_pages, dst_pages, n_tokens=n_tokens)
        executor = TorchExecutor([tensor_of(src.memory), tensor_of(dst.memory)])
        assert executor.run(plan) == plan.total_bytes
        apply_plan(plan, src.memory, by_numpy)
        reference_copy(
            src.layout, src.memory, dst.layout, want, src_pages, dst_pages, n_tokens=n_tokens
        )
    np.testing.assert_array_equal(by_numpy.data, want.data)
    np.testing.assert_array_equal(dst.memory.data, want.data)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [(8, 8, 2), (8, 2, 8), (2, 4, 1), (4, 2, 2)])
def test_tp_head_slicing_plans(order: str, heads: int, tp_p: int, tp_d: int) -> None:
    model = Model(layers=3, kv_heads=heads, head_dim=8, dtype_size=2)
    rng = np.random.default_rng(heads * 100 + tp_p * 10 + tp_d)
    src_pages = rng.permutation(10)[:6].astype(np.int64)
    dst_pages = rng.permutation(10)[:6].astype(np.int64)
    for r_d in range(tp_d):
        run_direct(
            model,
            Rank(0, tp_p, 4, order, 10),
            Rank(r_d, tp_d, 4, order, 10),
            src_pages,
            dst_pages,
            None,
        )


@pytest.mark.parametrize(
    ("page_sizes", "n_tokens"), [((16, 4), 45), ((4, 16), 45), ((1, 8), 21), ((6, 4), 30)]
)
@pytest.mark.parametrize("orders", [("NHD", "NHD"), ("NHD", "HND")])
def test_page_size_ratio_plans(
    page_sizes: tuple[int, int], n_tokens: int, orders: tuple[str, str]
) -> None:
    ps, pd = page_sizes
    model = Model(layers=2, kv_heads=4, head_dim=4, dtype_size=2)
    rng = np.random.default_rng(ps * 10 + pd)
    src_pages = rng.permutation(-(-n_tokens // ps) + 3)[: -(-n_tokens // ps)].astype(np.int64)
    dst_pages = rng.permutation(-(-n_tokens // pd) + 3)[: -(-n_tokens // pd)].astype(np.int64)
    run_direct(
        model,
        Rank(0, 2, ps, orders[0], src_pages.size + 3),
        Rank(0, 1, pd, orders[1], dst_pages.size + 3),
        src_pages,
        dst_pages,
        n_tokens,
    )


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("sides", [(True, False), (False, True), (True, True)])
def test_cross_layer_pools(mla: bool, sides: tuple[bool, bool]) -> None:
    model = Model(layers=4, kv_heads=2, head_dim=8, dtype_size=2, mla=mla)
    src_pages = np.array([3, 4, 5, 0, 7], np.int64)
    dst_pages = np.array([1, 2, 6, 7, 0], np.int64)
    run_direct(
        model,
        Rank(0, 1, 4, "NHD", 8, sides[0]),
        Rank(0, 1, 4, "NHD", 8, sides[1]),
        src_pages,
        dst_pages,
        None,
    )


def test_batch_plans() -> None:
    model = Model(layers=2, kv_heads=2, head_dim=8, dtype_size=2)
    src = rank_memory(model, Rank(capacity=16, page_size=2), seed=3)
    dst = rank_memory(model, Rank(capacity=16, page_size=2))
    template = kvplan.Template(src.layout, dst.layout)
    requests = [
        (np.array([0, 1, 2]), np.array([5, 6, 7])),
        (np.array([9, 3]), np.array([0, 12])),
        (np.array([4]), np.array([8])),
    ]
    batch = template.plan_batch(requests)
    want = dst.memory.copy()
    apply_plan(batch, src.memory, want)
    executor = TorchExecutor([tensor_of(src.memory), tensor_of(dst.memory)])
    assert executor.run(batch) == batch.total_bytes
    np.testing.assert_array_equal(dst.memory.data, want.data)


def staged_pages(n_tokens: int, page_size: int, *, reverse: bool) -> np.ndarray:
    count = -(-n_tokens // page_size)
    if reverse:
        return np.arange(count, dtype=np.int64)[::-1].copy()
    return np.array([p for p in range(count + 1) if p != 1][:count], dtype=np.int64)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [(8, 8, 2), (8, 2, 8), (2, 4, 1), (4, 1, 1)])
@pytest.mark.parametrize(("page_sizes", "n_tokens"), [((4, 4), 12), ((16, 4), 21)])
def test_staged_plans(
    order: str, heads: int, tp_p: int, tp_d: int, page_sizes: tuple[int, int], n_tokens: int
) -> None:
    """Every writer of a decode rank: gather, network and scatter through executors (the
    prefill's over its pool and staging buffer, the decode's over its staging region and
    pool), one decode staging region shared by the writers; against apply_staged and the
    oracle."""
    ps, pd = page_sizes
    model = Model(layers=2, kv_heads=heads, head_dim=4, dtype_size=2)
    src_pages = staged_pages(n_tokens, ps, reverse=False)
    dst_pages = staged_pages(n_tokens, pd, reverse=True)
    tokens = n_tokens if ps != pd else None
    for r_d in range(tp_d):
        dst = rank_memory(model, Rank(r_d, tp_d, pd, order, len(dst_pages) + 2))
        want, by_numpy = dst.memory.copy(), dst.memory.copy()
        decode_staging = torch.zeros(1 << 16, dtype=torch.uint8)
        numpy_staging = memory_of(decode_staging).copy()
        scatters = []
        for r_p in range(tp_p):
            src = rank_memory(model, Rank(r_p, tp_p, ps, order, len(src_pages) + 2), seed=r_p + 1)
            template = kvplan.Template(src.layout, dst.layout)
            prefill_staging = torch.zeros(1 << 16, dtype=torch.uint8)
            staged = template.plan_staged(
                src_pages,
                dst_pages,
                n_tokens=tokens,
                src_staging=(int(prefill_staging.data_ptr()), prefill_staging.numel()),
                dst_staging=(int(decode_staging.data_ptr()), decode_staging.numel()),
            )
            prefill = TorchExecutor({"pool": tensor_of(src.memory), "staging": prefill_staging})
            assert prefill.run(staged.gather) == staged.src_staging_bytes
            # The network half, here a local copy between the two staging regions.
            TorchExecutor([prefill_staging, decode_staging]).run(staged.network)
            scatters.append(staged.scatter)
            apply_staged(
                staged, src.memory, memory_of(prefill_staging).copy(), numpy_staging, by_numpy
            )
            reference_copy(
                src.layout, src.memory, dst.layout, want, src_pages, dst_pages, n_tokens=tokens
            )
        decode = TorchExecutor({"staging": decode_staging, "pool": tensor_of(dst.memory)})
        for scatter in scatters:
            assert decode.run(scatter) == scatter.total_bytes
        np.testing.assert_array_equal(by_numpy.data, want.data)
        np.testing.assert_array_equal(dst.memory.data, want.data)


class DcpPool:
    """One side's KV pool as one torch tensor per entry (MLA: per layer; MHA: K and V)."""

    ROW = 16  # bytes of one token's row in one entry
    LAYERS = [0, 1, 2]

    def __init__(
        self, page: int, capacity: int, mha: bool, rng: np.random.Generator | None, **dcp: int
    ) -> None:
        n = len(self.LAYERS)
        item = page * self.ROW
        self.tensors = [
            torch.zeros(capacity, page, self.ROW // 2, dtype=torch.float16)
            for _ in range(2 * n if mha else n)
        ]
        if rng is not None:
            for t in self.tensors:
                t.view(torch.uint8).copy_(
                    torch.from_numpy(rng.integers(0, 256, t.numel() * 2, dtype=np.uint8)).view(
                        t.shape[0], page, -1
                    )
                )
        ptrs = [int(t.data_ptr()) for t in self.tensors]
        lens = [t.numel() * 2 for t in self.tensors]
        context = {"page_size": page, **dcp}
        if mha:
            self.layout = kvplan.Layout.mha(
                ptrs[:n], ptrs[n:], lens[:n], lens[n:], item, item, self.LAYERS, **context
            )
        else:
            self.layout = kvplan.Layout.mla(ptrs, lens, item, self.LAYERS, **context)

    def snapshot(self) -> list[np.ndarray]:
        return [t.view(torch.uint8).numpy().copy() for t in self.tensors]


def numpy_apply(plan: kvplan.Blocks, regions: list[np.ndarray]) -> None:
    """apply_plan over several numpy buffers: one ``Memory`` per buffer, found by address."""
    memories = [Memory(r.reshape(-1).view(np.uint8), int(r.ctypes.data)) for r in regions]

    def at(addr: int, n: int) -> np.ndarray:
        for m in memories:
            if m.base <= addr and addr + n <= m.base + m.data.size:
                return m.at(addr, n)
        raise AssertionError(f"block {addr:#x}+{n} outside every buffer")

    for s, d, n in zip(*plan.as_lists()):
        at(d, n)[:] = at(s, n)


@pytest.mark.parametrize("mha", [False, True])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("deal", ["token", "page"])
def test_pack_plans_and_row_gathers(mha: bool, ranks: int, deal: str) -> None:
    """A prefill at DCP 1 sends to each decode DCP rank through a pack buffer: plan_packed's
    gather and plan_row_gather's rows, both run by the executor, fill the pack buffer alike,
    and the network half out of it writes what the direct plan writes."""
    page, n_tokens = 4, 45
    interleave = 1 if deal == "token" else page
    rng = np.random.default_rng(ranks * 10 + mha)
    count = -(-n_tokens // page)
    src_pages = rng.permutation(count + 2)[:count].astype(np.int64)
    src = DcpPool(page, count + 2, mha, rng)
    for rank in range(ranks):
        share = sum(1 for t in range(n_tokens) if (t // interleave) % ranks == rank)
        pages = -(-share // page)
        dst_pages = np.array([k + (k >= pages // 2) for k in range(pages)], np.int64)
        dst = DcpPool(
            page, pages + 2, mha, None, dcp_size=ranks, dcp_rank=rank, dcp_interleave=interleave
        )
        template = kvplan.Template(src.layout, dst.layout)
        direct = template.plan(src_pages, dst_pages, n_tokens=n_tokens)
        numpy_apply(direct, [t.view(torch.uint8).numpy() for t in src.tensors + dst.tensors])
        want = dst.snapshot()
        assert any(w.any() for w in want)
        for t in dst.tensors:
            t.zero_()
        pack = torch.zeros(direct.total_bytes + 64, dtype=torch.uint8)
        region = (int(pack.data_ptr()), pack.numel())
        gather, network = template.plan_packed(src_pages, dst_pages, n_tokens=n_tokens, pack=region)
        prefill = TorchExecutor(src.tensors + [pack])
        assert prefill.run(gather) == direct.total_bytes
        packed = pack.numpy().copy()
        assert not packed[direct.total_bytes :].any()
        pack.zero_()
        rows, row_network = template.plan_row_gather(
            src_pages, dst_pages, n_tokens=n_tokens, pack=region
        )
        assert prefill.run_row_gather(rows) == rows.pack_bytes == direct.total_bytes
        np.testing.assert_array_equal(pack.numpy(), packed)
        assert row_network.as_lists() == network.as_lists()
        TorchExecutor([pack] + dst.tensors).run(network)
        for got, expected in zip(dst.snapshot(), want):
            np.testing.assert_array_equal(got, expected)


# ---- layout_from_tensors ----------------------------------------------------------------


def test_vllm_per_layer_tensors_are_layout_mha() -> None:
    layers, blocks, block_size, heads, head_dim = 3, 6, 16, 2, 8
    caches = [
        torch.zeros(2, blocks, block_size, heads, head_dim, dtype=torch.bfloat16)
        for _ in range(layers)
    ]
    layout = layout_from_tensors(
        caches, "kv page token head dim", layer_ids=[4, 5, 6], tp_rank=1, tp_size=2, kv_heads=4
    )
    item = block_size * heads * head_dim * 2
    want = kvplan.Layout.mha(
        [int(c[0].data_ptr()) for c in caches],
        [int(c[1].data_ptr()) for c in caches],
        [blocks * item] * layers,
        [blocks * item] * layers,
        item,
        item,
        [4, 5, 6],
        page_size=block_size,
        tp_rank=1,
        tp_size=2,
        kv_heads=4,
        heads_per_rank=2,
        head_dim=head_dim,
        dtype_size=2,
        memory_order="NHD",
    )
    assert layout.to_dict() == want.to_dict()
    assert layout.capacities == [blocks] * (2 * layers)


def test_block_major_hnd_and_mla_tensors() -> None:
    blocks, block_size, heads, head_dim = 5, 4, 2, 8
    # vLLM's [num_blocks, 2, ...] with head-major pages: K and V of a page side by side.
    cache = torch.zeros(blocks, 2, heads, block_size, head_dim, dtype=torch.float16)
    layout = layout_from_tensors([cache], "page kv head token dim", kv_heads=2)
    item = heads * block_size * head_dim * 2
    assert layout.roles == ["k", "v"]
    assert layout.strides == [2 * item, 2 * item]
    assert layout.item_lens == [item, item]
    assert layout.data_ptrs == [int(cache.data_ptr()), int(cache.data_ptr()) + item]
    assert layout.capacities == [blocks, blocks]
    assert (layout.memory_order, layout.heads_per_rank, layout.head_dim) == ("HND", 2, 8)
    # MLA: one latent per token, no head dimension.
    latents = [torch.zeros(blocks, block_size, 576, dtype=torch.bfloat16) for _ in range(2)]
    mla = layout_from_tensors(latents, "page token latent", layer_ids=[0, 1], kv_heads=1)
    want = kvplan.Layout.mla(
        [int(t.data_ptr()) for t in latents],
        [t.numel() * 2 for t in latents],
        block_size * 576 * 2,
        [0, 1],
        page_size=block_size,
        kv_heads=1,
        heads_per_rank=1,
        head_dim=576,
        dtype_size=2,
        memory_order="NHD",
    )
    assert mla.to_dict() == want.to_dict()


def test_sglang_token_buffers_are_layout_mha() -> None:
    page, tokens, heads, head_dim = 4, 4 * 9 + 4, 2, 8
    k = [torch.zeros(tokens, heads, head_dim, dtype=torch.float16) for _ in range(2)]
    v = [torch.zeros(tokens, heads, head_dim, dtype=torch.float16) for _ in range(2)]
    layout = layout_from_tensors(k, "token head dim", v_tensors=v, page_size=page, layer_ids=[0, 1])
    item = page * heads * head_dim * 2
    want = kvplan.Layout.mha(
        [int(t.data_ptr()) for t in k],
        [int(t.data_ptr()) for t in v],
        [t.numel() * 2 for t in k],
        [t.numel() * 2 for t in v],
        item,
        item,
        [0, 1],
        page_size=page,
    )
    assert layout.to_dict() == want.to_dict()
    assert layout.capacities == [tokens // page] * 4


def test_cross_layer_pool_is_layout_cross_layer() -> None:
    blocks, layers, block_size, heads, head_dim = 6, 3, 4, 2, 8
    pool = torch.zeros(blocks, layers, 2, block_size, heads, head_dim, dtype=torch.float16)
    layout = layout_from_tensors(pool, "page layer kv token head dim", layer_ids=[0, 1, 2])
    item = block_size * heads * head_dim * 2
    want = kvplan.Layout.cross_layer(
        int(pool.data_ptr()),
        pool.numel() * 2,
        [0, 0, 1, 1, 2, 2],
        item,
        roles=["k", "v"] * layers,
        page_size=block_size,
    )
    for field in ("data_ptrs", "item_lens", "strides", "capacities", "layer_ids", "roles"):
        assert getattr(layout, field) == getattr(want, field), field


def test_padded_pages_keep_their_stride() -> None:
    """A page padded past its items (as hybrid models pad attention pages): the stride is the
    tensor's, the item the bytes of one page of tokens."""
    raw = torch.zeros(6, 2 * 4 * 2 * 8 + 64, dtype=torch.float16)
    cache = raw[:, : 2 * 4 * 2 * 8].view(6, 2, 4, 2, 8)
    layout = layout_from_tensors([cache], "page kv token head dim")
    assert layout.strides == [raw.stride(0) * 2] * 2
    assert layout.item_lens == [4 * 2 * 8 * 2] * 2
    assert layout.capacities == [6, 6]


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_between_tensor_layouts(device: str) -> None:
    """vLLM-shaped prefill tensors at TP 2 -> SGLang-shaped decode buffers at TP 1 with other
    page sizes: the plan between the two read layouts, run by the executor, writes what the
    oracle writes."""
    kv_heads, head_dim, layers = 4, 8, 2
    gen = torch.Generator().manual_seed(11)
    pre = [
        torch.randint(-1000, 1000, (2, 8, 16, 2, head_dim), generator=gen).to(torch.float16)
        for _ in range(layers)
    ]
    k = [torch.zeros(4 * 30, 4, head_dim, dtype=torch.float16) for _ in range(layers)]
    v = [torch.zeros(4 * 30, 4, head_dim, dtype=torch.float16) for _ in range(layers)]
    pre = [t.to(device) for t in pre]
    k, v = [t.to(device) for t in k], [t.to(device) for t in v]
    ids = list(range(layers))
    src = layout_from_tensors(
        pre, "kv page token head dim", layer_ids=ids, tp_rank=1, tp_size=2, kv_heads=kv_heads
    )
    dst = layout_from_tensors(
        k, "token head dim", v_tensors=v, page_size=4, layer_ids=ids, kv_heads=kv_heads
    )
    assert src.device == str(pre[0].device) and dst.device == str(k[0].device)
    src_pages, dst_pages, n_tokens = np.array([5, 2, 7]), np.arange(12)[::-1].copy(), 43
    plan = kvplan.Template(src, dst).plan(src_pages, dst_pages, n_tokens=n_tokens)
    assert TorchExecutor(pre + k + v).run(plan) == plan.total_bytes
    # The oracle over host copies laid out at the same addresses.
    src_host = [t.cpu().view(torch.uint8).numpy() for t in pre]
    dst_host = [t.cpu().view(torch.uint8).numpy() for t in k + v]
    want = [np.zeros_like(a) for a in dst_host]
    src_arena, src_base = _arena(src_host, [int(t.data_ptr()) for t in pre])
    dst_arena, dst_base = _arena(want, [int(t.data_ptr()) for t in k + v])
    reference_copy(
        src,
        Memory(src_arena, src_base),
        dst,
        dst_mem := Memory(dst_arena, dst_base),
        src_pages,
        dst_pages,
        n_tokens=n_tokens,
    )
    got_arena, _ = _arena(dst_host, [int(t.data_ptr()) for t in k + v])
    assert got_arena.any()
    np.testing.assert_array_equal(got_arena, dst_mem.data)


def _arena(parts: list[np.ndarray], addrs: list[int]) -> tuple[np.ndarray, int]:
    """The buffers placed at their addresses in one array (zeros in between)."""
    base = min(addrs)
    out = np.zeros(max(a + p.nbytes for a, p in zip(addrs, parts)) - base, np.uint8)
    for a, p in zip(addrs, parts):
        out[a - base : a - base + p.nbytes] = p.reshape(-1).view(np.uint8)
    return out, base


# ---- refusals ----------------------------------------------------------------------------


def test_non_contiguous_tensors_are_refused_by_name() -> None:
    cache = torch.zeros(2, 6, 4, 2, 8, dtype=torch.float16)
    bad = cache.permute(0, 1, 3, 2, 4)  # heads outside tokens in the strides, not in dims
    with pytest.raises(
        kvplan.LayoutError,
        match=r"tensors\[1\] \(shape \(2, 6, 2, 4, 8\), "
        r"strides \(384, 64, 8, 16, 1\)\) is not contiguous the way a layout "
        r"needs: dimension 'token' has stride 16, 8 expected",
    ) as err:
        layout_from_tensors([cache, bad], "kv page head token dim")
    assert err.value.kind == "tensor_layout"
    with pytest.raises(kvplan.LayoutError, match=r"layer_7 \(shape \(2, 6, 2, 4, 8\)"):
        layout_from_tensors([bad], "kv page head token dim", names=["layer_7"])
    with pytest.raises(
        kvplan.LayoutError,
        match=r"tensors\[0\] \(shape \(6, 2, 4, 2, 8\), "
        r"strides .*\) is not contiguous, so its bytes are not one address",
    ):
        TorchExecutor([cache.transpose(0, 1)])
    # K and V planes overlapping (a zero stride), a 'kv' dimension that is not 2, no pages.
    with pytest.raises(kvplan.LayoutError, match=r"dimension 'kv' steps 0 bytes"):
        layout_from_tensors([cache[:1].expand(2, -1, -1, -1, -1)], "kv page token head dim")
    with pytest.raises(kvplan.LayoutError, match=r"'kv' dimension has size 6, not 2"):
        layout_from_tensors([cache], "page kv token head dim")
    with pytest.raises(kvplan.LayoutError, match="neither a 'page' nor a 'token'"):
        layout_from_tensors([cache], "a b c d e")
    with pytest.raises(kvplan.LayoutError, match=r"has 5 dimensions, dims names 4"):
        layout_from_tensors([cache], "kv page token head")
    with pytest.raises(kvplan.LayoutError, match="give page_size"):
        layout_from_tensors([cache[0, 0]], "token head dim")
    with pytest.raises(
        kvplan.LayoutError,
        match=r"page_size=8 was given, but its 'token' "
        "dimension holds 4",
    ):
        layout_from_tensors([cache], "kv page token head dim", page_size=8)
    with pytest.raises(kvplan.LayoutError, match=r"head_dim=4 was given, but the tensors hold 8"):
        layout_from_tensors([cache], "kv page token head dim", kv_heads=2, head_dim=4)
    with pytest.raises(kvplan.LayoutError, match="2 layer ids for 1 layers"):
        layout_from_tensors([cache], "kv page token head dim", layer_ids=[0, 1])
    with pytest.raises(TypeError, match="reads strides from the tensors"):
        layout_from_tensors([cache], "kv page token head dim", strides=4)


def arena_and_plan(n: int = 2) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A byte arena holding ``n`` adjacent 256-byte tensors and one more after a gap."""
    arena = torch.arange(1024, dtype=torch.int64).to(torch.uint8)
    parts = [arena[i * 256 : (i + 1) * 256] for i in range(n)] + [arena[768:1024]]
    return arena, parts


def blocks(src: list[int], dst: list[int], lengths: list[int]) -> kvplan.BlockSlice:
    return kvplan.BlockSlice(
        np.array(src, np.uint64), np.array(dst, np.uint64), np.array(lengths, np.uint64)
    )


def test_blocks_outside_or_across_tensors_are_refused_and_copy_nothing() -> None:
    arena, parts = arena_and_plan()
    base = int(arena.data_ptr())
    executor = TorchExecutor({"k0": parts[0], "k1": parts[1], "staging": parts[2]})
    before = arena.clone()
    ok = (base, base + 768, 16)
    cases = [
        # straddles the two adjacent tensors
        (
            (base + 250, base + 768, 16),
            r"src of block 1, 16 bytes at \[.*\), straddles k0 at "
            r"\[.*\) \(256 bytes, cpu\) and k1 at",
        ),
        # runs past the end of the last tensor
        (
            (base, base + 1020, 16),
            r"dst of block 1, 16 bytes at .*, runs 12 bytes past the end "
            r"of staging",
        ),
        # in the gap between tensors
        (
            (base + 600, base + 768, 16),
            r"src of block 1, .* lies outside every registered "
            r"tensor; nearest is k1",
        ),
    ]
    for bad, message in cases:
        plan = blocks([ok[0], bad[0]], [ok[1] + 64, bad[1]], [ok[2], bad[2]])
        with pytest.raises(kvplan.IndexBoundsError, match=message) as err:
            executor.run(plan)
        assert err.value.kind == "index_bounds"
        assert torch.equal(arena, before), "a refused plan copied bytes"


def test_overlapping_blocks_and_tensors_are_refused() -> None:
    arena, parts = arena_and_plan()
    base = int(arena.data_ptr())
    executor = TorchExecutor(parts)
    before = arena.clone()
    with pytest.raises(kvplan.KvPlanError, match=r"blocks 0 and 2 both write bytes") as err:
        executor.run(
            blocks([base, base + 64, base + 128], [base + 768, base + 900, base + 770], [8, 8, 8])
        )
    assert err.value.kind == "block_overlap"
    with pytest.raises(
        kvplan.KvPlanError,
        match=r"block 1 reads 8 bytes at .* that block 0 "
        r"writes",
    ) as err:
        executor.run(blocks([base, base + 772], [base + 768, base + 800], [8, 8]))
    assert err.value.kind == "block_overlap"
    assert torch.equal(arena, before)
    # Without the check the same disjoint plan runs; overlapping tensors are refused.
    plan = blocks([base, base + 256], [base + 768, base + 800], [32, 32])
    assert TorchExecutor(parts, check_overlap=False).run(plan) == 64
    assert torch.equal(arena[768:800], before[:32]) and torch.equal(arena[800:832], before[256:288])
    with pytest.raises(
        kvplan.KvPlanError, match=r"tensors\[0\] at .* overlaps tensors\[1\]"
    ) as err:
        TorchExecutor([arena[:512], arena[256:]])
    assert err.value.kind == "buffer_overlap"


def test_plan_columns_must_be_uint64() -> None:
    class Columns:
        src_addrs = np.zeros(2, np.int64)
        dst_addrs = np.zeros(2, np.uint64)
        lengths = np.zeros(2, np.uint64)

    with pytest.raises(TypeError, match="plan.src_addrs must be a 1-D uint64 array, got int64"):
        TorchExecutor([torch.zeros(4)]).run(Columns())
    assert TorchExecutor([torch.zeros(4)]).run(blocks([], [], [])) == 0


def test_empty_registries_and_zero_length_blocks() -> None:
    arena, parts = arena_and_plan()
    base = int(arena.data_ptr())
    with pytest.raises(kvplan.IndexBoundsError, match="none is registered"):
        TorchExecutor([]).run(blocks([base], [base + 768], [8]))
    before = arena.clone()
    # Zero-length blocks move nothing, alone or beside a real one.
    assert TorchExecutor(parts).run(blocks([base], [base + 768], [0])) == 0
    assert TorchExecutor(parts).run(blocks([base, base + 8], [base + 768, base + 780], [0, 4])) == 4
    assert torch.equal(arena[780:784], before[8:12])
    assert torch.equal(arena[:780], before[:780]) and torch.equal(arena[784:], before[784:])
