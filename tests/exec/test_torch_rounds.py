"""Staged plans in rounds (``Template.plan_rounds``) run by kvplan.torch's executor.

The pools and both arenas are torch tensors (CPU, and CUDA where there is one); the decode pool
after the rounds must equal the layout oracle's (``reference_copy``), byte for byte, whether the
executor runs the ``StagedRounds`` whole or each round's gather, network and scatter one after
another (what an engine does, with a transfer engine for the network). Needs torch; without it
the file is skipped, and with ``KVPLAN_REQUIRE_TORCH=1`` a missing torch fails it.
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
from kvplan.testing.oracle import Memory, reference_copy  # noqa: E402
from kvplan.torch import TorchExecutor  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HEAD_DIM, DTYPE = 8, 2


class Tensors:
    def __init__(self, device: str) -> None:
        self.device = device
        self.named: dict[str, torch.Tensor] = {}

    def add(self, name: str, nbytes: int, seed: int | None) -> int:
        data = (np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
                if seed is not None else np.zeros(nbytes, np.uint8))
        self.named[name] = torch.from_numpy(data).to(self.device)
        return int(self.named[name].data_ptr())

    def memory(self, name: str) -> Memory:
        t = self.named[name]
        return Memory(t.cpu().numpy().copy(), int(t.data_ptr()))


def mha(t: Tensors, name: str, heads: int, page: int, pages: int, tp: tuple[int, int],
        kv_heads: int, seed: int | None) -> kvplan.Layout:
    layers = 2
    item = page * heads * HEAD_DIM * DTYPE
    entry = pages * item
    base = t.add(name, 2 * layers * entry, seed)
    k = [base + 2 * i * entry for i in range(layers)]
    return kvplan.Layout.mha(k, [p + entry for p in k], [entry] * layers, [entry] * layers,
                             item, item, list(range(layers)), page_size=page, tp_rank=tp[0],
                             tp_size=tp[1], kv_heads=kv_heads, head_dim=HEAD_DIM,
                             dtype_size=DTYPE, memory_order="NHD")


def request(kind: str, device: str) -> tuple[Tensors, kvplan.Layout, kvplan.Layout, np.ndarray,
                                             np.ndarray, int | None]:
    t = Tensors(device)
    rng = np.random.default_rng(7)
    if kind == "mla page 1":
        row, tokens, cap, layers = 72, 300, 340, 2
        entry = cap * row

        def mla(name: str, seed: int | None) -> kvplan.Layout:
            base = t.add(name, layers * entry, seed)
            return kvplan.Layout.mla([base + i * entry for i in range(layers)],
                                     [entry] * layers, row, list(range(layers)), page_size=1)

        src, dst = mla("prefill_pool", 1), mla("decode_pool", 2)
        return (t, src, dst, rng.permutation(cap)[:tokens].astype(np.int64),
                rng.permutation(cap)[:tokens].astype(np.int64), None)
    if kind == "gqa tp 4->2":
        src = mha(t, "prefill_pool", 2, 4, 40, (1, 4), 8, 1)
        dst = mha(t, "decode_pool", 4, 4, 40, (0, 2), 8, 2)
        return (t, src, dst, rng.permutation(40)[:33].astype(np.int64),
                rng.permutation(40)[:33].astype(np.int64), None)
    src = mha(t, "prefill_pool", 2, 4, 40, (0, 1), 2, 1)
    dst = mha(t, "decode_pool", 2, 16, 12, (0, 1), 2, 2)
    return (t, src, dst, rng.permutation(40)[:32].astype(np.int64),
            rng.permutation(12)[:8].astype(np.int64), 125)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "round-by-round"])
@pytest.mark.parametrize("kind", ["mla page 1", "gqa tp 4->2", "page 4->16"])
def test_rounds_on_tensors_equal_the_oracle(kind: str, whole: bool, device: str) -> None:
    t, src, dst, sp, dp, n_tokens = request(kind, device)
    template = kvplan.Template(src, dst)
    probe = template.plan_rounds(sp, dp, n_tokens=n_tokens, src_arena=(1 << 40, 1 << 30),
                                 dst_arena=(1 << 44, 1 << 30))
    senders, buffers = probe.sender[1], 3
    buffer = -(-probe.bytes // 5)  # about five rounds, the last one short
    src_arena = (t.add("prefill_arena", buffers * buffer, None), buffers * buffer)
    dst_arena = (t.add("decode_arena", buffers * buffer * senders, 9),
                 buffers * buffer * senders)
    rounds = template.plan_rounds(sp, dp, n_tokens=n_tokens, src_arena=src_arena,
                                  dst_arena=dst_arena, buffers=buffers)
    assert len(rounds) >= 5
    want = t.memory("decode_pool")
    reference_copy(src, t.memory("prefill_pool"), dst, want, sp, dp, n_tokens=n_tokens)
    executor = TorchExecutor(t.named)
    if whole:
        assert executor.run(rounds) == rounds.bytes
    else:
        for one in rounds:
            n = one.manifest.bytes
            assert executor.run(one.gather) == n
            assert executor.run(one.network) == n
            assert executor.run(one.scatter) == n
    got = t.named["decode_pool"].cpu().numpy()
    bad = np.flatnonzero(got != want.data)
    assert bad.size == 0, f"{bad.size} bytes differ from the oracle, the first at {bad[:1]}"


def test_a_round_whose_arena_is_not_registered_is_refused_before_copying() -> None:
    t, src, dst, sp, dp, n_tokens = request("gqa tp 4->2", "cpu")
    template = kvplan.Template(src, dst)
    arena = t.add("prefill_arena", 4096, None)
    rounds = template.plan_rounds(sp, dp, src_arena=(arena, 4096), dst_arena=(1 << 44, 8192))
    before = t.named["decode_pool"].clone()
    executor = TorchExecutor({k: v for k, v in t.named.items() if k != "prefill_arena"})
    with pytest.raises(kvplan.IndexBoundsError, match="dst"):
        executor.run(rounds[0].gather)
    with pytest.raises(kvplan.IndexBoundsError):
        executor.run(rounds)
    assert torch.equal(t.named["decode_pool"], before)
