"""kvplan under vllm-ascend 0.23.0.post1's hybrid Mooncake connector, against its real pull.

The decode's ``KVCacheRecvingThread._transfer_kv_cache_all_groups`` (vllm-ascend's code from its
sdist) runs on generated hybrid models: KV cache tensors each shared by one layer of every KV
group, the decode at PP 1 and the prefill at PP 1, 2 or 4, one pull per prefill stage as
vllm-ascend's ``start_load_kv`` issues them. A recording engine performs the reads on byte
arenas, so each run ends in a destination byte map, compared with a per-layer ground truth:
every layer's pages read from the prefill stage that holds that layer, nothing else touched.
"""

from __future__ import annotations

import os
import random
import threading
import types

import numpy as np
import pytest

import kvplan

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import load_vllm_ascend  # noqa: E402

# One worker runs the file: its module fixture fetches and loads vllm-ascend's sdist, which a
# second worker given some of the tests paid again (52 s of set-up on each in a full run).
pytestmark = pytest.mark.xdist_group("vllm-ascend")

N_CASES = 240
ENGINE_ID = "prefill-engine"
BASE_PORT = 30000


@pytest.fixture(scope="module")
def a():
    return load_vllm_ascend()


@pytest.fixture(scope="module")
def patched(a):
    from kvplan.compat.vllm import ascend as compat

    cls = type("PatchedRecvingThread", (a.KVCacheRecvingThread,), {})
    assert compat.install(cls) == ("_transfer_kv_cache_all_groups", "_get_remote_metadata")
    yield cls
    compat.uninstall(cls)


class Tensor:
    """What the pull reads of a cache tensor: its address."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class Arena:
    """One side's memory: a byte array at a virtual base address."""

    def __init__(self, base: int, size: int, rng: np.random.Generator) -> None:
        self.base = base
        self.mem = rng.integers(0, 256, size, dtype=np.uint8)

    def view(self, addr: int, n: int) -> np.ndarray:
        lo = addr - self.base
        if lo < 0 or lo + n > len(self.mem):
            raise AssertionError(f"[{addr:#x}, +{n}) outside the arena at {self.base:#x}")
        return self.mem[lo:lo + n]


class ReadingEngine:
    """``batch_transfer_sync_read`` as Mooncake does it: local <- remote, per session."""

    def __init__(self, local: Arena, remotes: dict[str, Arena]) -> None:
        self.local = local
        self.remotes = remotes
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []

    def batch_transfer_sync_read(self, session, local_addrs, remote_addrs, lengths):
        self.calls.append((session, list(local_addrs), list(remote_addrs), list(lengths)))
        remote = self.remotes[session]
        for lo, ro, n in zip(local_addrs, remote_addrs, lengths):
            self.local.view(lo, n)[:] = remote.view(ro, n)
        return 0


class Case(types.SimpleNamespace):
    pass


def _spec(cls):
    return object.__new__(cls)


def generate(a, seed: int, pp_size: int, mamba: bool) -> Case:
    """A hybrid model whose KV cache tensors do not straddle prefill stages (each tensor is
    shared by one layer of every group), the decode's and each stage's caches, and one
    request's block ids per group."""
    rng = random.Random(seed)
    n_groups = rng.choice([2, 3])
    tensors_per_stage = rng.choice([1, 2, 3])
    n_tensors = tensors_per_stage * pp_size
    num_layers = n_tensors * n_groups
    page = rng.choice([64, 128, 96])
    num_blocks = rng.choice([24, 40])
    # tensor t is shared by layers t*G .. t*G+G-1 (shuffled between groups inside the tensor)
    shared = []
    for t in range(n_tensors):
        layers = list(range(t * n_groups, (t + 1) * n_groups))
        rng.shuffle(layers)
        shared.append(layers)  # shared[t][g] = the layer of group g in tensor t
    specs = [_spec(a.MooncakeSpec if (mamba and g == 0) else a.hybrid.FullAttentionSpec)
             for g in range(n_groups)]
    halves = 2 if mamba else 1  # Mamba: conv and ssm views; compressed attention: one entry
    part = page // halves

    def side(base: int, tensor_ids: list[int], rng_np) -> types.SimpleNamespace:
        arena = Arena(base, len(tensor_ids) * page * num_blocks + 4096, rng_np)
        addrs, block_lens, groups, kv_caches, kv_tensors = [], [], [], {}, []
        for i, t in enumerate(tensor_ids):
            t_base = base + 4096 + i * page * num_blocks
            views = [t_base + h * part * num_blocks for h in range(halves)]
            for g, layer in enumerate(shared[t]):
                kv_caches[f"model.layers.{layer}.attn"] = tuple(Tensor(p) for p in views)
            kv_tensors.append(types.SimpleNamespace(
                shared_by=[f"model.layers.{layer}.attn" for layer in shared[t]]))
            for p in views:
                addrs.append(p)
                block_lens.append(part)
                groups.append(list(range(n_groups)))
        return types.SimpleNamespace(arena=arena, addrs=addrs, block_lens=block_lens,
                                     groups=[] if mamba else groups, kv_caches=kv_caches,
                                     kv_tensors=kv_tensors)

    rng_np = np.random.default_rng(seed)
    decode = side(0x10_0000_0000, list(range(n_tensors)), rng_np)
    stages = [side(0x20_0000_0000 + s * 0x1_0000_0000,
                   list(range(s * tensors_per_stage, (s + 1) * tensors_per_stage)), rng_np)
              for s in range(pp_size)]
    # one block pool shared by every group: ids distinct across groups on each side
    d_pool = rng.sample(range(num_blocks), num_blocks)
    p_pool = rng.sample(range(num_blocks), num_blocks)
    local_ids, remote_ids = [], []
    for g in range(n_groups):
        n = rng.randint(0, num_blocks // n_groups)
        if isinstance(specs[g], a.MooncakeSpec):
            n = min(n, 1)  # one state block
        run = rng.random() < 0.5
        d = sorted(d_pool[:n]) if run else d_pool[:n]
        p = sorted(p_pool[:n]) if run else p_pool[:n]
        del d_pool[:n], p_pool[:n]
        if n and not isinstance(specs[g], a.MooncakeSpec) and rng.random() < 0.3:
            d = d[rng.randint(0, n - 1):]  # partial prefix hit: the decode reads the tail
        local_ids.append(list(d))
        remote_ids.append(list(p))
    partition = ",".join([str(tensors_per_stage * n_groups)] * pp_size)
    return Case(seed=seed, pp_size=pp_size, mamba=mamba, n_groups=n_groups, page=page,
                num_blocks=num_blocks, num_layers=num_layers, shared=shared, specs=specs,
                decode=decode, stages=stages, local_ids=local_ids, remote_ids=remote_ids,
                partition=partition, tensors_per_stage=tensors_per_stage)


def make_thread(a, cls, case: Case):
    t = object.__new__(cls)
    hy = a.hybrid
    d = case.decode
    t.tp_rank = 0
    t.tp_size = 1
    t._prefill_pp_size = case.pp_size
    t.local_engine_id = "decode-engine"
    t.local_handshake_port = 40000
    t.kv_caches = d.kv_caches
    t.kv_caches_base_addr = hy.SizedDict()
    t.kv_caches_base_addr[t.local_engine_id][t.local_handshake_port] = d.addrs
    t.block_len_per_addr = d.block_lens
    t.block_stride_per_addr = list(d.block_lens)
    t.addr_group_idx = d.groups
    t.hma_group_size = case.n_groups
    t.remote_te_port = hy.SizedDict()
    t.remote_metadata_lock = threading.Lock()
    t.use_hybrid = True
    t.has_mamba = case.mamba
    t.kv_cache_specs = case.specs
    t.kv_cache_config = types.SimpleNamespace(kv_cache_tensors=d.kv_tensors,
                                              num_blocks=case.num_blocks)
    t.vllm_config = types.SimpleNamespace(speculative_config=None)
    t.pp_layer_indices = {
        s: hy.get_prefill_pp_indices(case.num_layers, s, case.pp_size, case.partition)
        for s in range(case.pp_size)}
    remotes = {}
    for s, stage in enumerate(case.stages):
        port = BASE_PORT + s  # the stage's rank (tp 0 + s * prefill tp 1) above the base port
        meta = types.SimpleNamespace(engine_id=ENGINE_ID, te_rpc_port=50000 + s,
                                     kv_caches_base_addr=stage.addrs, block_lens=stage.block_lens,
                                     num_blocks=case.num_blocks)
        # what vllm-ascend's handshake keeps (the patched one also keeps the block lengths)
        from kvplan.compat.vllm.ascend import remember_remote_metadata

        remember_remote_metadata(t, port, meta)
        remotes[f"127.0.0.1:{50000 + s}"] = stage.arena
    t.engine = ReadingEngine(d.arena, remotes)
    return t


def pull_all_stages(thread, case: Case) -> None:
    """The pulls vllm-ascend's start_load_kv queues for one request (non-Mamba hybrid: one per
    prefill stage; Mamba: one, from stage 0), run one after the other."""
    n_pulls = 1 if case.mamba else case.pp_size
    for i in range(n_pulls):
        thread._transfer_kv_cache_all_groups({
            "request_id": "req", "remote_request_id": "req-remote",
            "local_block_ids": case.local_ids, "remote_block_ids": case.remote_ids,
            "remote_engine_id": ENGINE_ID, "remote_host": "127.0.0.1",
            "remote_handshake_port": BASE_PORT + i, "offset": i, "tp_num_need_pulls": 1,
            "remote_port_send_num": {}, "all_task_done": i == n_pulls - 1})


def expected_decode(case: Case) -> np.ndarray:
    """The per-layer ground truth: page ``d`` of layer L in the decode's tensor holding L gets
    page ``p`` of layer L in the prefill stage's tensor holding L, for every (p, d) of L's
    group (the prefill's last ids when the decode has fewer, for attention groups)."""
    d = case.decode
    out = d.arena.mem.copy()
    page_part = case.page // (2 if case.mamba else 1)
    for g in range(case.n_groups):
        local, remote = case.local_ids[g], case.remote_ids[g]
        if not local or not remote:
            continue
        if not isinstance(case.specs[g], load_vllm_ascend().MooncakeSpec) and len(local) < len(remote):
            remote = remote[-len(local):]
        for t in range(len(case.shared)):
            s, t_in_stage = divmod(t, case.tensors_per_stage)
            stage = case.stages[s]
            halves = 2 if case.mamba else 1
            for h in range(halves):
                d_base = d.addrs[t * halves + h]
                p_base = stage.addrs[t_in_stage * halves + h]
                for lo, ro in zip(local, remote):
                    dst = d_base + lo * page_part - d.arena.base
                    out[dst:dst + page_part] = stage.arena.view(p_base + ro * page_part,
                                                                page_part)
    return out


def _cases(a, pp_sizes, mamba):
    seeds = range(N_CASES // 4)
    return [generate(a, 1000 * pp + seed, pp, mamba) for pp in pp_sizes for seed in seeds]


def test_ascend_loader_runs_the_sdists_pull_and_reaches_no_stand_in(a):
    fn = a.KVCacheRecvingThread._transfer_kv_cache_all_groups
    assert fn.__code__.co_filename.startswith(a.root)
    assert a.version == "0.23.0.post1"
    a.verify_closure()


def test_install_uninstall_restores_exactly(a):
    from kvplan.compat.vllm import ascend as compat

    cls = type("T", (a.KVCacheRecvingThread,), {})
    before = dict(cls.__dict__)
    assert compat.install(cls) == compat.REPLACED_METHODS
    assert compat.install(cls) == ()
    assert compat.installed(cls) == compat.REPLACED_METHODS
    assert compat.uninstall(cls) == compat.REPLACED_METHODS
    assert dict(cls.__dict__) == before
    assert cls._transfer_kv_cache_all_groups is a.KVCacheRecvingThread._transfer_kv_cache_all_groups
    with pytest.raises(TypeError):
        compat.install(int)


def test_prefill_pp_pairs_by_layer_and_unpatched_pairs_by_position(a, patched):
    """PP 2 and 4: the patched pull matches the per-layer ground truth byte for byte; vllm-ascend's
    own pull writes a later stage's layers over the decode's first layers."""
    n_wrong = 0
    n_cases = 0
    for case in _cases(a, (2, 4), mamba=False):
        if not any(case.local_ids):
            continue
        n_cases += 1
        want = expected_decode(case)
        fixed = make_thread(a, patched, case)
        pull_all_stages(fixed, case)
        assert np.array_equal(case.decode.arena.mem, want), case.seed
        case = generate(a, case.seed, case.pp_size, False)  # fresh arenas
        original = make_thread(a, a.KVCacheRecvingThread, case)
        pull_all_stages(original, case)
        n_wrong += not np.array_equal(case.decode.arena.mem, want)
    assert n_cases >= 100
    assert n_wrong == n_cases  # every request with blocks gets wrong bytes without the fix


def test_four_layers_prefill_pp2_stage1_lands_in_layers_0_1(a, patched):
    """Four layers, two groups, prefill PP 2: unpatched, stage 1's layers 2-3 land in the
    decode's layers 0-1 and layers 2-3 keep their old bytes; patched, each layer is right."""
    for seed in range(200):
        case = generate(a, seed, 2, False)
        if case.num_layers == 4 and all(case.local_ids):
            break
    else:
        pytest.fail("no four-layer case")

    def layer_pages(case, mem, layer):
        t = next(i for i, ls in enumerate(case.shared) if layer in ls)
        g = case.shared[t].index(layer)
        base = case.decode.addrs[t] - case.decode.arena.base
        return [bytes(mem[base + b * case.page: base + (b + 1) * case.page])
                for b in case.local_ids[g]]

    want = expected_decode(case)
    before = case.decode.arena.mem.copy()
    original = make_thread(a, a.KVCacheRecvingThread, case)
    pull_all_stages(original, case)
    got = case.decode.arena.mem
    for layer in (2, 3):  # never written: still the bytes the decode had
        assert layer_pages(case, got, layer) == layer_pages(case, before, layer)
        assert layer_pages(case, got, layer) != layer_pages(case, want, layer)
    for layer in (0, 1):  # overwritten by stage 1's layers 2-3
        other = case.shared[1][case.shared[0].index(layer)]
        assert layer_pages(case, got, layer) == layer_pages(case, want, other)

    case = generate(a, case.seed, 2, False)
    fixed = make_thread(a, patched, case)
    pull_all_stages(fixed, case)
    for layer in range(4):
        assert layer_pages(case, case.decode.arena.mem, layer) == layer_pages(case, want, layer)


@pytest.mark.parametrize("mamba", [False, True])
def test_pp1_identical_to_vllm_ascend(a, patched, mamba):
    """PP 1: the same reads, in the same order, as vllm-ascend's pull, and the ground truth."""
    n = 0
    for case in _cases(a, (1,), mamba):
        want = expected_decode(case)
        fixed = make_thread(a, patched, case)
        pull_all_stages(fixed, case)
        assert np.array_equal(case.decode.arena.mem, want), case.seed
        fresh = generate(a, case.seed, 1, mamba)
        original = make_thread(a, a.KVCacheRecvingThread, fresh)
        pull_all_stages(original, fresh)
        assert np.array_equal(fresh.decode.arena.mem, want), case.seed
        mine = [(s, list(map(int, lo)), list(map(int, ro)), list(map(int, n_)))
                for s, lo, ro, n_ in fixed.engine.calls]
        assert mine == original.engine.calls, case.seed
        n += 1
    assert n == N_CASES // 4


def test_refusals_are_typed_and_read_nothing(a, patched):
    case = generate(a, 7, 2, True)  # Mamba under prefill PP: only stage 0 would be pulled
    case.local_ids[0] = case.local_ids[0] or [0]
    case.remote_ids[0] = case.remote_ids[0] or [1]
    t = make_thread(a, patched, case)
    with pytest.raises(kvplan.PairingError, match="stage 0 only"):
        pull_all_stages(t, case)
    assert t.engine.calls == []

    case = generate(a, 8, 2, False)
    t = make_thread(a, patched, case)
    # the prefill stage publishes another block length than the decode's for its layers
    meta = types.SimpleNamespace(engine_id=ENGINE_ID, te_rpc_port=50001,
                                 kv_caches_base_addr=case.stages[1].addrs,
                                 block_lens=[n * 2 for n in case.stages[1].block_lens],
                                 num_blocks=case.num_blocks)
    from kvplan.compat.vllm.ascend import remember_remote_metadata

    remember_remote_metadata(t, BASE_PORT + 1, meta)
    case.local_ids[0], case.remote_ids[0] = [0, 1], [2, 3]
    req = {"remote_request_id": "r", "local_block_ids": case.local_ids,
           "remote_block_ids": case.remote_ids, "remote_engine_id": ENGINE_ID,
           "remote_host": "127.0.0.1", "remote_handshake_port": BASE_PORT + 1, "offset": 1,
           "tp_num_need_pulls": 1}
    with pytest.raises(kvplan.SizeMismatchError):
        t._transfer_kv_cache_all_groups(req)
    # a stage that publishes fewer addresses than the decode holds for its layers
    meta.block_lens = case.stages[1].block_lens[:-1]
    meta.kv_caches_base_addr = case.stages[1].addrs[:-1]
    remember_remote_metadata(t, BASE_PORT + 1, meta)
    with pytest.raises(kvplan.PairingError, match="publishes"):
        t._transfer_kv_cache_all_groups(req)
    # a block id past the prefill's block count
    remember_remote_metadata(t, BASE_PORT + 1, types.SimpleNamespace(
        engine_id=ENGINE_ID, te_rpc_port=50001, kv_caches_base_addr=case.stages[1].addrs,
        block_lens=case.stages[1].block_lens, num_blocks=case.num_blocks))
    req["remote_block_ids"] = [[case.num_blocks, 3]] + case.remote_ids[1:]
    with pytest.raises(kvplan.IndexBoundsError):
        t._transfer_kv_cache_all_groups(req)
    # a stage boundary inside a decode tensor: no decode address is that stage's alone
    split = case.tensors_per_stage * case.n_groups - 1
    t._kvplan_stage_peers = {}
    t.pp_layer_indices = {0: (0, split), 1: (split, case.num_layers)}
    req["remote_block_ids"] = case.remote_ids
    with pytest.raises(kvplan.PairingError, match="holds only some of"):
        t._transfer_kv_cache_all_groups(req)
    req["tp_num_need_pulls"] = 2
    with pytest.raises(kvplan.PairingError, match="whole blocks"):
        t._transfer_kv_cache_all_groups(req)
    assert t.engine.calls == []
