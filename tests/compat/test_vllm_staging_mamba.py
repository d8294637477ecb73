"""Staged transfers of a hybrid model with Mamba-style state (Qwen3-Next's GDN, Kimi-Linear's
KDA: vLLM's ``MambaSpec``) through kvplan's vLLM Mooncake drop-in, with vLLM's real worker
classes and real Mooncake TCP loopback engines (``test_vllm_staging``'s).

A request of such a model names two KV groups: the attention layers' blocks and the state
layers' (a ``MambaSpec`` group, one state page per block in a pool whose block stride is the
hybrid allocator's padded page, all of it moved). vLLM's Mooncake sender moves a state group as it moves any
other group, with two differences of its own: it drops the null block (prefix caching's
placeholders) from both sides' lists before trimming, and it does not expand the state
group's blocks into kernel blocks. The oracle is vLLM's own unpatched
``_build_transfer_params`` of the same request: every byte of the decode's memory must match.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from support.vllm_cases import make_worker
from support.vllm_loader import ALL_TESTS, OTHER_RELEASES
import test_vllm_staging as staging_tests
from test_vllm_staging import (NUM_BLOCKS, SENTINEL, Engine, kvplan_send, pull_groups, start,
                               stats_for, vllm_oracle)

from kvplan.compat.vllm import metrics

pytestmark = pytest.mark.mooncake

BF16 = types.SimpleNamespace(itemsize=2, name="bfloat16")  # what MambaSpec reads of a dtype
FP32 = types.SimpleNamespace(itemsize=4, name="float32")

# test_vllm_staging's fixtures: vLLM's release, its installed worker class, two engines
v, patched, engines = staging_tests.v, staging_tests.patched, staging_tests.engines

#: A GDN-like state layer: a conv state (3 taps of 64 channels, bf16) and a recurrent state
#: (4 heads of 16 x 16, fp32): 4480 bytes, padded to the attention layer's page.
STATE_SHAPES = ((3, 64), (4, 16, 16))
STATE_DTYPES = (BF16, FP32)


@pytest.fixture
def dtype_size(v: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``get_dtype_size`` for the dtypes above, where ``MambaSpec.page_size_bytes``
    reads it (torch is not installed here)."""
    monkeypatch.setattr(v.kvi, "get_dtype_size", lambda dtype: dtype.itemsize)


class MambaSide:
    """One worker of a hybrid model: an attention layer (KV group 0, blocks of
    ``kernel_ratio`` kernel blocks) and a state layer (a ``MambaSpec`` group 1, its page
    padded to the attention layer's), recorded as vLLM's ``register_kv_caches`` records them:
    the state region's block stride and bytes a block the padded page (vLLM moves the whole
    page). Apart, each layer has memory of its own (the attention layer K and V regions);
    ``shared``, both layers lie in one tensor as vLLM's hybrid allocator gives them (one
    block pool, each group its own block ids in it), the attention layer one region of whole
    pages."""

    def __init__(self, v: Any, cls: type, engine: Engine, *, seed: int | None,
                 kernel_ratio: int = 1, shared: bool = False) -> None:
        kvi = v.kvi
        head_bytes = 256
        block = 16
        attn = kvi.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=head_bytes,
                                     dtype=None, state_content_bytes=head_bytes)
        page = 2 * block * head_bytes  # the attention layer's page: K and V of a block
        mamba = kvi.MambaSpec(block_size=block, shapes=STATE_SHAPES, dtypes=STATE_DTYPES,
                              page_size_padded=page)
        assert int(mamba.real_page_size_bytes) < int(mamba.page_size_bytes) == page
        names = ["model.layers.0.self_attn.attn", "model.layers.1.linear_attn"]
        if shared:
            kv = page // kernel_ratio  # one kernel block of the whole page
            sizes = [NUM_BLOCKS * page]
        else:
            kv = block * head_bytes // kernel_ratio  # one kernel block of K (or V)
            sizes = [NUM_BLOCKS * page // 2, NUM_BLOCKS * page // 2, NUM_BLOCKS * page]
        self.memory = (np.random.default_rng(seed).integers(0, 256, sum(sizes), dtype=np.uint8)
                       if seed is not None else np.full(sum(sizes), SENTINEL, np.uint8))
        engine.register(self.memory)
        base = int(self.memory.ctypes.data)
        starts = [base + sum(sizes[:k]) for k in range(len(sizes))]
        attn_regions = [(a, kv, kv, names[0], 0, 0) for a in starts[:max(1, len(sizes) - 1)]]
        regions = attn_regions + [(starts[-1], page, page, names[1], 1, 1)]
        self.state_region = (starts[-1] - base, page)
        self.worker = make_worker(
            v, cls, tp_rank=0, tp_size=1, use_mla=False, total_kv_heads=1,
            group_specs=[attn, mamba], layer_groups={names[0]: 0, names[1]: 1},
            regions=regions, buffers=[(s, n) for s, n in zip(starts, sizes)],
            num_blocks=NUM_BLOCKS, kernel_ratio=kernel_ratio, engine=engine.engine)
        self.worker.__dict__.update(hostname="127.0.0.1", rpc_port=engine.port)


def mamba_pair(v: Any, patched: Any, engines: Any, seed: int, **shape: Any
               ) -> tuple[MambaSide, MambaSide]:
    p_engine, d_engine = engines
    return (MambaSide(v, patched, p_engine, seed=seed, **shape),
            MambaSide(v, v.MooncakeConnectorWorker, d_engine, seed=None, **shape))


def mamba_ids(v: Any, seed: int) -> list[tuple[list[int], list[int]]]:
    """A request's (prefill, decode) blocks per group: 24 attention blocks, fragmented, below
    block 100; the state group's lists (blocks from 100 on: one block pool may hold both) with prefix caching's null placeholders before their state blocks
    (vLLM drops them on both sides), the prefill's one block longer (a cached prefix: vLLM
    moves the decode's count of the prefill's last blocks)."""
    rng = np.random.default_rng(seed)
    attn_local = (rng.permutation(99)[:24] + 1).tolist()
    attn_remote = rng.permutation(np.arange(1, 100, 2))[:24].tolist()
    null = int(v.mc.NULL_BLOCK_ID)
    state_local = [null, null, 141, 107]
    state_remote = [null, null, null, 130]
    return [(attn_local, attn_remote), (state_local, state_remote)]


@pytest.mark.usefixtures("dtype_size")
@pytest.mark.parametrize("kernel_ratio", [1, 2], ids=["blocks", "kernel-blocks"])
@pytest.mark.parametrize("shared", [False, True], ids=["apart", "one-pool"])
def test_a_request_with_mamba_state_lands_staged_byte_exact(v: Any, patched: Any, engines: Any,
                                                            kernel_ratio: int, shared: bool
                                                            ) -> None:
    """A request of an attention group and a ``MambaSpec`` group to a decode that takes
    several groups: one staged stream moving the attention blocks (expanded into kernel blocks
    where a block holds several) and the state blocks vLLM moves (no null placeholder, the
    prefill's last ones, each a whole padded page); the decode's memory then
    equals, byte for byte, what vLLM's own direct path writes."""
    p_engine, d_engine = engines
    prefill, decode = mamba_pair(v, patched, engines, seed=31, kernel_ratio=kernel_ratio,
                                 shared=shared)
    start(prefill, p_engine)
    d_staging = start(decode, d_engine)
    d_staging.serve(decode.worker)
    prefill.worker.xfer_stats = stats_for(v)
    meta, ready = pull_groups(decode, d_staging.push_message(), {"req-m": mamba_ids(v, 31)})
    want, direct_blocks = vllm_oracle(v, prefill, decode, meta, ready)
    offset, page = prefill.state_region
    sent = [b for b in range(100, NUM_BLOCKS)
            if not np.all(want[offset + b * page:offset + (b + 1) * page] == SENTINEL)]
    assert sent == [130]  # vLLM moves the state block the decode named, and only it
    src, _, _, err_reqs, err_msg = kvplan_send(prefill, meta, ready)
    assert err_reqs == [] and err_msg is None
    assert len(src) == 0 and direct_blocks > 0  # staged, not vLLM's columns
    receiver = d_staging.stream("req-m@tp0")
    assert receiver is not None and receiver.loaded
    assert receiver.scattered == receiver.n_rounds
    np.testing.assert_array_equal(decode.memory, want)
    assert prefill.worker.xfer_stats.data[metrics.STAGED_ROUNDS_KEY] == [receiver.n_rounds]


#: The tests run again under vLLM 0.34.0 and 0.32.0's CPU build, whose Mooncake senders and
#: region records are their own.
RERUN_UNDER_RELEASES = dict.fromkeys(OTHER_RELEASES, ALL_TESTS)
