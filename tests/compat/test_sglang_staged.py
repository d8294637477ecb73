"""kvplan's ``send_kvcache_staged`` against SGLang 0.5.23's own (real code from the wheel), on
host memory.

SGLang's GPU gather and scatter kernels are replaced by recorders (``support.sglang_loader``);
``support.sglang_staging`` applies their byte-level semantics to the recorded calls, the
engine's blocks move bytes between numpy arrays, and the decode's pools are checked against the
ground truth: every decode head of every layer at the decode's pages. For every prefill rank a
decode rank asks (TP x PP writers), SGLang's method and kvplan's run on the same manager and
must hand the engine the same byte map with the same status; kvplan's own gather (executed with
``kvplan.copy_local``) must fill the prefill staging buffer exactly as SGLang's kernel does, and
the decode's scatter plans must write the decode pools exactly as SGLang's scatter kernel does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from kvplan._core import staging_replicas_write
from kvplan.compat.sglang.staged import staged_template
from support.sglang_models import engine_blocks, load_loader, load_sglang_or_fail
from support.sglang_staging import (
    SESSION,
    HostTensor,
    StagedWorld,
    asked,
    gather_semantics,
    range_map,
    run_gather,
    scatter_semantics,
    staging_buffer,
)

HEADS = (1, 2, 8, 16)
TPS = (1, 2, 4, 8)
CASES = [(h, p, d, pp) for h in HEADS for p in TPS for d in TPS for pp in (1, 2)]


@pytest.fixture(scope="module")
def sg() -> Any:
    sg = load_sglang_or_fail()
    load_loader().load_staging(sg)
    return sg


@pytest.fixture(autouse=True)
def _fresh_recorders(sg: Any) -> None:
    sg.gather_kernel.calls.clear()
    sg.scatter_kernel.calls.clear()


def sglang_round(sg: Any, world: StagedWorld, cls: type, r_p: int, stage: int) -> Any:
    """One prefill rank's ``send_kvcache_staged``: the recorded gather applied, the engine's
    blocks moved. Returns ``(status, blocks, manager)``."""
    mgr = world.manager(cls, stage, r_p)
    before = len(sg.gather_kernel.calls)
    rc = world.send(mgr)
    if len(sg.gather_kernel.calls) > before:
        call = sg.gather_kernel.calls[-1]
        assert call["staging_buffer"] is mgr.staging
        run_gather(call)
    blocks = engine_blocks(mgr.engine.calls)
    world.memory(mgr).apply(blocks)
    return rc, blocks, mgr


@pytest.mark.parametrize("heads,tp_p,tp_d,pp", CASES)
def test_sglang_staged_round_trip_on_host_memory(sg: Any, heads: int, tp_p: int, tp_d: int,
                                                 pp: int) -> None:
    """SGLang's own staged path, gather and scatter by their kernel semantics: the decode rank
    ends up with its heads (checks the loader, the semantics and the world together)."""
    for r_d in range(tp_d):
        world = StagedWorld(sg, heads=heads, tp_p=tp_p, tp_d=tp_d, r_d=r_d, pp=pp,
                            seed=heads * 100 + tp_p * 10 + tp_d)
        for stage in range(pp):
            for r_p in asked(tp_p, tp_d, r_d):
                rc, blocks, _ = sglang_round(sg, world, sg.MooncakeKVManager, r_p, stage)
                assert rc == 0 and blocks
        world.scatter()
        world.check_decode()


def test_staged_code_runs_from_the_wheel_without_stand_ins(sg: Any) -> None:
    visited = sg.verify_closure()
    for name in ("mooncake.conn.MooncakeKVManager.send_kvcache_staged",
                 "common.staging_buffer.compute_staging_layout",
                 "common.staging_buffer.compute_head_slice_params",
                 "common.staging_buffer.resolve_total_kv_heads",
                 "common.staging_buffer.StagingBuffer.fits",
                 "utils.build_transfer_entry_pairs"):
        assert f"sglang.srt.disaggregation.{name}" in visited
    import inspect

    assert str(inspect.signature(sg.gather_kernel)) == str(
        inspect.signature(sg.gather_kernel.real))
    with pytest.raises(TypeError):
        sg.gather_kernel(1, 2)  # does not bind to the real signature
    assert not sg.gather_kernel.calls
    np.testing.assert_equal(sg.compute_staging_layout(8, 2, 1, 8, 4, 16, 3),
                            (4, [4 * 1 * 16 * 3 * 2] * 4, 4 * 4 * 1 * 16 * 3 * 2))


# --------------------------------------------------------------------------------------------
# kvplan's drop-in against SGLang's method
# --------------------------------------------------------------------------------------------
@pytest.fixture
def installed(sg: Any) -> Any:
    cls = sg.MooncakeKVManager
    assert "send_kvcache_staged" in compat.install(cls)
    yield cls
    compat.uninstall(cls)


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return ("raise", type(exc).__name__, str(exc))


def both(sg: Any, world: StagedWorld, mgr: Any, **overrides: Any) -> tuple[Any, Any]:
    """SGLang's method, then kvplan's (installed), on the same manager: ``(outcome, blocks,
    gather calls)`` each, the gather applied to the staging buffer after each."""
    results = []
    for run in (lambda: sg.send_kvcache_staged(mgr, **world.call(mgr, **overrides)),
                lambda: world.send(mgr, **overrides)):
        mgr.engine.calls.clear()
        before = len(sg.gather_kernel.calls)
        rc = outcome(run)
        gathers = sg.gather_kernel.calls[before:]
        for call in gathers:
            run_gather(call)
        results.append((rc, engine_blocks(mgr.engine.calls), gathers))
    return results[0], results[1]


def staged_of(mgr: Any) -> Any:
    """The template kvplan's drop-in planned the last call with (its cache entry)."""
    cache = compat.template_cache(mgr)
    assert len(cache) == 1, "the call was not planned by kvplan"
    return cache._entries[(SESSION, "staged")][1]


def decode_pools(world: StagedWorld) -> tuple[list[int], list[int]]:
    pools = (*world.decode["k"], *world.decode["v"])
    return [t.data_ptr() for t in pools], [t.nbytes for t in pools]


def copy_of(tensors: list[HostTensor]) -> list[HostTensor]:
    return [HostTensor(t.array.copy()) for t in tensors]


@pytest.mark.parametrize("heads,tp_p,tp_d,pp", CASES)
def test_staged_moves_the_same_bytes_as_sglang(sg: Any, installed: Any, heads: int, tp_p: int,
                                               tp_d: int, pp: int) -> None:
    check_case(sg, installed, heads, tp_p, tp_d, pp)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("heads,tp_p,tp_d,pp", [(8, 8, 2, 1), (8, 2, 8, 2), (16, 4, 4, 1),
                                                (2, 1, 4, 2), (8, 4, 4, 2), (16, 8, 1, 2)])
def test_page_sizes_and_page_runs(sg: Any, installed: Any, heads: int, tp_p: int, tp_d: int,
                                  pp: int, page: int, contiguous: bool) -> None:
    """Runs of consecutive pages on both sides (blocks merge) and other page sizes: the same
    staging layout as SGLang's."""
    src, dst = ((4, 5, 6, 7), (9, 10, 11, 12)) if contiguous else ((6, 1, 2, 15), (0, 8, 9, 3))
    check_case(sg, installed, heads, tp_p, tp_d, pp, page=page, src_pages=src, dst_pages=dst)


def check_case(sg: Any, installed: Any, heads: int, tp_p: int, tp_d: int, pp: int,
               **world_kw: Any) -> None:
    """Every decode rank and every writer it asks: identical byte maps, statuses and kernel
    calls; kvplan's gather and the decode's scatter plans against SGLang's kernels; the
    decode's heads against the ground truth."""
    for r_d in range(tp_d):
        world = StagedWorld(sg, heads=heads, tp_p=tp_p, tp_d=tp_d, r_d=r_d, pp=pp,
                            seed=heads * 100 + tp_p * 10 + tp_d + r_d, **world_kw)
        writers = []
        for stage in range(pp):
            for r_p in asked(tp_p, tp_d, r_d):
                where = f"H={heads} TP {tp_p}->{tp_d} PP {pp} stage {stage} rank {r_p}->{r_d}"
                mgr = world.manager(installed, stage, r_p)
                (rc_s, blocks_s, gather_s), (rc_k, blocks_k, gather_k) = both(sg, world, mgr)
                assert rc_s == rc_k == ("ok", 0), (where, rc_s, rc_k)
                assert range_map(blocks_k) == range_map(blocks_s), where
                assert len(gather_s) == len(gather_k) == 1, where
                assert gather_k[0].keys() == gather_s[0].keys()
                for name, value in gather_s[0].items():  # the kernel is called as SGLang calls it
                    assert gather_k[0][name] is value or np.array_equal(
                        gather_k[0][name], value), (where, name)
                # planned by kvplan, replicated writers included
                assert len(blocks_k) <= (1 if pp == 1 else 2), (where, blocks_k)
                check_gather(mgr, gather_s[0], world, where)
                writers.append((stage, r_p))
                world.memory(mgr).apply(blocks_k)
        expected = {kind: copy_of(world.decode[kind]) for kind in "kv"}
        scatter_semantics(world.region_view(), expected["k"], expected["v"], world.dst_pages,
                          world.page, tp_p, tp_d, r_d, heads, sg.compute_head_slice_params)
        assert writers, "no writer planned"
        for stage, r_p in writers:  # kvplan's decode-side scatter of every writer's share
            scatter(world, stage, r_p)
        for kind in "kv":
            for got, want in zip(world.decode[kind], expected[kind]):
                assert np.array_equal(got.array, want.array), (kind, r_d)
        world.check_decode()


def check_gather(mgr: Any, call: dict[str, Any], world: StagedWorld, where: str) -> None:
    """kvplan's gather plan of the call, executed on the host pools, writes what SGLang's
    kernel writes into the staging buffer (and nothing past it)."""
    template = staged_of(mgr)
    buf = mgr.staging
    staged = template.plan_staged(world.src_pages, world.src_pages,
                                  src_staging=(buf.get_ptr(), buf.get_size()),
                                  dst_staging=(world.region_ptr, world.region))
    want = gather_semantics(call)
    assert staged.src_staging_bytes == want.size, where
    buf.buffer[:] = 0x5A
    pools = [t.array for t in (*mgr.kv_buffer_tensors["k_buffers"],
                               *mgr.kv_buffer_tensors["v_buffers"])]
    kvplan.copy_local(staged.gather, pools, [buf.buffer])
    assert np.array_equal(buf.buffer[:want.size], want), where
    assert (buf.buffer[want.size:] == 0x5A).all(), where
    buf.buffer[:want.size] = want


def scatter(world: StagedWorld, stage: int, r_p: int) -> None:
    """The decode's side of writer ``(stage, r_p)``: its own staged plan (decode pools, the
    writer's geometry) scattered from the region into the decode pools with copy_local."""
    lids = world.stage_layers(stage) * 2
    template = staged_template(
        kv_heads=world.heads, prefill_tp=world.tp_p, prefill_rank=r_p, decode_tp=world.tp_d,
        decode_rank=world.r_d, page_size=world.page, head_dim=world.head_dim, dtype_size=2,
        num_layers=len(lids) // 2, prefill_pp_size=world.pp, prefill_slot_ids=lids,
        decode_slot_ids=world.dst_layer_ids(), decode_pools=decode_pools(world))
    staged = template.plan_staged(world.src_pages, world.dst_pages,
                                  src_staging=(1 << 50, 1 << 40),
                                  dst_staging=(world.region_ptr, world.region))
    kvplan.copy_local(staged.scatter, [world.region_view()],
                      [t.array for t in (*world.decode["k"], *world.decode["v"])])


REPLICATED = [(h, p, d, pp) for h, p, d, pp in CASES if staging_replicas_write(h, p, d)]


@pytest.mark.parametrize("heads,tp_p,tp_d,pp", REPLICATED)
def test_replicated_prefill_heads_fill_every_writer_share(sg: Any, installed: Any, heads: int,
                                                          tp_p: int, tp_d: int, pp: int) -> None:
    """KV heads replicated over several writers of one decode region (e.g. 2 heads at prefill
    TP 8 -> decode TP 2: four writers, two replicas of each head), and the decode scatters
    every share. kvplan plans every writer (its own rank, ``replicas_send``): the writers' shares
    tile the region exactly once (one replica elected to send would leave the others' shares
    stale), each from the writer's own staging buffer, and the decode ends up with its heads."""
    for r_d in range(tp_d):
        world = StagedWorld(sg, heads=heads, tp_p=tp_p, tp_d=tp_d, r_d=r_d, pp=pp,
                            seed=7 + r_d)
        written = np.zeros(world.region, dtype=np.int64)
        for stage in range(pp):
            for r_p in asked(tp_p, tp_d, r_d):
                mgr = world.manager(installed, stage, r_p)
                (rc_s, blocks_s, _), (rc_k, blocks_k, _) = both(sg, world, mgr)
                assert rc_s == rc_k == ("ok", 0) and range_map(blocks_k) == range_map(blocks_s)
                assert staged_of(mgr).empty_reason is None  # kvplan planned this writer
                staging = mgr.staging.get_ptr()
                for src, dst, n in blocks_k:
                    assert staging <= src and src + n <= staging + mgr.staging.get_size()
                    written[dst - world.region_ptr:dst - world.region_ptr + n] += 1
                world.memory(mgr).apply(blocks_k)
        assert (written == 1).all()
        world.scatter()
        world.check_decode()


def test_staged_template_plans_each_replicated_writer_as_itself() -> None:
    """The drop-in's template for a replicated writer is its own rank's, every writer sending
    (ranks 1 and 3 are not the replicas kvplan elects for decode rank 0): four writers, four
    disjoint shares of the decode region."""
    geometry = dict(kv_heads=2, prefill_tp=8, decode_tp=2, page_size=2, head_dim=4,
                    dtype_size=2, num_layers=2)
    pages = np.array([1, 0], np.int32)
    sizes = set()
    for r_p in range(4):  # decode rank 0's writers
        template = staged_template(prefill_rank=r_p, decode_rank=0, **geometry)
        assert template.empty_reason is None
        staged = template.plan_staged(pages, pages, src_staging=(1 << 50, 1 << 30),
                                      dst_staging=(1 << 52, 1 << 30))
        assert staged.writer == (r_p, 4)
        sizes.add(staged.dst_staging_range)
    assert len(sizes) == 4  # four shares, one per writer


def test_fall_backs_are_sglangs(sg: Any, installed: Any) -> None:
    """-1, nothing gathered, nothing sent: no staging tensors, no staging buffer, a prefill
    staging buffer one byte short, a decode region one byte short."""
    world = StagedWorld(sg, heads=8, tp_p=4, tp_d=2, r_d=1, pp=2)
    mgr = world.manager(installed, 1, 2)
    short = staging_buffer(sg, mgr.staging.get_size() - 1)
    for kw in (dict(staging_buffer=short), dict(staging_buffer=None),
               dict(dst_staging_size=world.region - 1)):
        (rc_s, blocks_s, g_s), (rc_k, blocks_k, g_k) = both(sg, world, mgr, **kw)
        assert rc_s == rc_k == ("ok", -1), (kw, rc_s, rc_k)
        assert blocks_s == blocks_k == [] and g_s == g_k == []
    (rc_s, _, _), (rc_k, _, _) = both(sg, world, mgr)
    assert rc_s == rc_k == ("ok", 0)  # the same manager with room enough sends
    ok = mgr
    ok.kv_buffer_tensors = None
    (rc_s, _, _), (rc_k, _, _) = both(sg, world, ok)
    assert rc_s == rc_k == ("ok", -1)


def test_failed_transfer_raises_sglangs_error(sg: Any, installed: Any) -> None:
    class Failing:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def batch_transfer_sync(self, *a: Any) -> int:
            self.calls.append(a)
            return -5

    world = StagedWorld(sg, heads=8, tp_p=8, tp_d=2, r_d=1)
    mgr = world.manager(installed, 0, 6, engine=Failing())
    (rc_s, _, _), (rc_k, _, _) = both(sg, world, mgr)
    assert rc_s == rc_k and rc_s[:2] == ("raise", "RuntimeError"), (rc_s, rc_k)


def test_pp_without_slot_layer_ids_is_sglangs_error(sg: Any, installed: Any) -> None:
    world = StagedWorld(sg, heads=8, tp_p=2, tp_d=4, r_d=3, pp=2, ids=False)
    mgr = world.manager(installed, 0, 1)
    (rc_s, _, _), (rc_k, _, _) = both(sg, world, mgr, dst_layer_ids=[])
    assert rc_s == rc_k and rc_s[:2] == ("raise", "RuntimeError"), (rc_s, rc_k)


@pytest.mark.parametrize("page", [-1, 16], ids=["negative", "past-the-pool"])
def test_pages_outside_the_pool_are_typed_errors(sg: Any, installed: Any, page: int) -> None:
    """SGLang's kernel reads outside the pool (or, for a negative index, another token);
    kvplan refuses before the kernel runs."""
    world = StagedWorld(sg, heads=8, tp_p=4, tp_d=2, r_d=0, src_pages=(1, page))
    mgr = world.manager(installed, 0, 1)
    sg.gather_kernel.calls.clear()
    with pytest.raises(kvplan.IndexBoundsError):
        world.send(mgr)
    assert sg.gather_kernel.calls == [] and mgr.engine.calls == []


def test_geometry_sglang_would_misread_is_a_typed_error(sg: Any, installed: Any) -> None:
    """A decode item that is not page x decode heads x the prefill's head bytes (the decode
    would scatter at other offsets than the prefill staged), and pool tensors holding another
    head count than SGLang's split (its kernel would gather other heads' bytes)."""
    world = StagedWorld(sg, heads=8, tp_p=4, tp_d=2, r_d=0)
    mgr = world.manager(installed, 0, 1)
    with pytest.raises(kvplan.SizeMismatchError):
        world.send(mgr, dst_kv_item_len=world.dst_item_len() * 2)
    mgr = world.manager(installed, 0, 1)
    k = mgr.kv_buffer_tensors["k_buffers"]
    k[0] = HostTensor(np.zeros((k[0].shape[0], 3, k[0].shape[2]), np.uint16))
    with pytest.raises(kvplan.SizeMismatchError):
        world.send(mgr)
    assert sg.gather_kernel.calls == [] and mgr.engine.calls == []


def test_subclass_overriding_transfer_data_sees_the_blocks(sg: Any) -> None:
    """SGLang hands its block list to ``self._transfer_data`` once per call; so does kvplan."""
    def _transfer_data(self: Any, session: str, blocks: Any) -> int:
        self.seen.append(list(blocks))
        return 0

    cls = type("TracingManager", (sg.MooncakeKVManager,), {"_transfer_data": _transfer_data})
    compat.install(cls)
    try:
        for pp in (1, 2):
            world = StagedWorld(sg, heads=16, tp_p=8, tp_d=4, r_d=2, pp=pp)
            mgr = world.manager(cls, pp - 1, 5, seen=[])
            (rc_s, _, _), (rc_k, _, _) = both(sg, world, mgr)
            assert rc_s == rc_k == ("ok", 0)
            assert len(mgr.seen) == 2 and mgr.seen[0]
            assert range_map(mgr.seen[1]) == range_map(mgr.seen[0])
            assert mgr.engine.calls == []
            assert staged_of(mgr) is not None
    finally:
        compat.uninstall(cls)


def test_template_is_cached_per_decode_peer(sg: Any, installed: Any) -> None:
    world = StagedWorld(sg, heads=8, tp_p=2, tp_d=8, r_d=5)
    mgr = world.manager(installed, 0, 1)
    assert world.send(mgr) == 0
    first = staged_of(mgr)
    assert world.send(mgr, prefill_kv_indices=np.array([4, 5], np.int32)) == 0
    assert staged_of(mgr) is first
    assert world.send(mgr, dst_tp_rank=4) == 0  # another decode rank: rebuilt
    assert staged_of(mgr) is not first


def test_install_uninstall_restore_send_kvcache_staged_exactly(sg: Any) -> None:
    cls = sg.MooncakeKVManager
    before = dict(vars(cls))
    assert "send_kvcache_staged" in compat.install(cls)
    assert cls.__dict__["send_kvcache_staged"] is not before["send_kvcache_staged"]
    assert "send_kvcache_staged" in compat.uninstall(cls)
    assert dict(vars(cls)) == before


def test_signature_is_sglangs(sg: Any) -> None:
    import inspect

    from kvplan.compat.sglang.staged import send_kvcache_staged

    ours, theirs = inspect.signature(send_kvcache_staged), inspect.signature(
        sg.send_kvcache_staged)
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [
        p.default for p in theirs.parameters.values()]


def test_decode_without_a_prefill_layer_is_a_pairing_error(sg: Any, installed: Any) -> None:
    """Prefill PP stage 1 (layers 2, 3) and a decode that publishes layers 0-2 only: SGLang
    raises ``RuntimeError`` after nothing moved; kvplan names the pairing failure."""
    world = StagedWorld(sg, heads=8, tp_p=4, tp_d=2, r_d=0, pp=2)
    mgr = world.manager(installed, 1, 0)
    ids = [0, 1, 2] * 2
    (rc_s, blocks_s, _), _ = both(sg, world, mgr, dst_layer_ids=ids, dst_slot_layer_ids=ids)
    assert rc_s[:2] == ("raise", "RuntimeError") and blocks_s == []
    sg.gather_kernel.calls.clear()
    with pytest.raises(kvplan.PairingError):
        world.send(mgr, dst_layer_ids=ids, dst_slot_layer_ids=ids)
    assert sg.gather_kernel.calls == [] and mgr.engine.calls == []


@pytest.mark.parametrize("pp", [1, 2])
def test_empty_request_moves_nothing_with_sglangs_status(sg: Any, installed: Any,
                                                         pp: int) -> None:
    """No pages: SGLang gathers nothing and hands the engine zero-length blocks; kvplan calls
    the kernel the same way and moves no byte either."""
    world = StagedWorld(sg, heads=8, tp_p=4, tp_d=2, r_d=0, pp=pp)
    mgr = world.manager(installed, 0, 1)
    (rc_s, blocks_s, g_s), (rc_k, blocks_k, g_k) = both(
        sg, world, mgr, prefill_kv_indices=np.zeros(0, np.int32))
    assert rc_s == rc_k == ("ok", 0)
    assert range_map(blocks_s) == range_map(blocks_k) == []
    assert len(g_s) == len(g_k) == 1


def test_a_kernel_that_writes_another_byte_count_stops_the_send(sg: Any, installed: Any,
                                                                monkeypatch: Any) -> None:
    """The gather kernel reports the bytes it wrote; when they are not what kvplan's network
    plan sends, nothing is sent (the decode would receive other bytes than it expects)."""
    world = StagedWorld(sg, heads=8, tp_p=4, tp_d=2, r_d=0)
    mgr = world.manager(installed, 0, 1)
    real = sg.gather_kernel
    monkeypatch.setattr(sg.staging_module, "gather_all_layers_to_staging",
                        lambda *a, **k: real(*a, **k) - 1)
    with pytest.raises(kvplan.SizeMismatchError, match="gather kernel wrote"):
        world.send(mgr)
    assert mgr.engine.calls == []
