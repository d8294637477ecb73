"""NIXL adapter: in-process checks with real NIXL agents (and a stand-in agent for the paths a
real transfer cannot be forced into), then real two-process transfers over UCX.

Every test here needs ``nixl_cu12`` and fails, never skips, when it cannot be imported
(scripts/setup-env installs it with ``pip install --no-deps nixl-cu12``).
"""

from __future__ import annotations

import threading

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan import BlockSlice, TransferError
from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
from kvplan.testing.oracle import reference_copy
from kvplan.testing.ranks import Model, Rank, rank_memory

from support.engine_peers import raw_pair

pytestmark = pytest.mark.nixl


@pytest.fixture(autouse=True)
def _nixl() -> None:
    from support.engine_peers import require_nixl

    require_nixl()


def _nixl_mod() -> Any:
    from kvplan.engines import nixl

    return nixl


# ---------------------------------------------------------------------------------------------
# In-process: pure helpers
# ---------------------------------------------------------------------------------------------


def test_import_kvplan_and_engines_import_no_nixl() -> None:
    code = ("import sys, kvplan, kvplan.testing; a = [m for m in sys.modules if "
            "m.startswith(('nixl', 'kvplan.engines'))]; import kvplan.engines; "
            "b = [m for m in sys.modules if m.startswith('nixl')]; print(a, b); "
            "sys.exit(1 if a or b else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_memory_type_and_device_id_come_from_the_layout_device() -> None:
    memory_of = _nixl_mod().memory_of
    assert memory_of("cpu") == ("DRAM", 0)
    assert memory_of("cuda") == ("VRAM", 0)
    assert memory_of("cuda:3") == ("VRAM", 3)
    for bad in ("npu:0", "cuda:x", "cpu:1"):
        with pytest.raises(ValueError, match="no NIXL memory type"):
            memory_of(bad)


def test_descriptor_rows_are_c_contiguous_n_by_3() -> None:
    rows = _nixl_mod().descriptor_rows(np.array([10, 20], np.uint64), np.array([1, 2]), 5)
    assert rows.flags.c_contiguous and rows.dtype == np.uint64
    assert rows.tolist() == [[10, 1, 5], [20, 2, 5]]


def test_prepped_tables_come_from_the_core_with_strides() -> None:
    """The prepped lists are the template's descriptor tables: descriptor j*pages + k is page k
    of piece j, at the entry's stride (a cross-layer pool), an elided entry contributes none,
    and a request's indices point at those descriptors."""
    items = [64, 0, 32]
    pool = kvplan.Layout.cross_layer(0x10000, 4 * 96, [0, 1, 2], items)  # stride 96, 4 pages
    per_layer = kvplan.Layout.mla([0x1000, 0x9000, 0x20000], [256, 0, 96], items,
                                  layer_ids=[0, 1, 2])  # 4 and 3 pages
    t = kvplan.Template(pool, per_layer)
    addrs, lens = t.descriptor_table("src")
    assert addrs.dtype == np.uint64 and lens.dtype == np.uint64
    assert addrs.tolist() == [0x10000 + k * 96 for k in range(4)] + \
        [0x10000 + 64 + k * 96 for k in range(4)]
    assert lens.tolist() == [64] * 4 + [32] * 4
    addrs, lens = t.descriptor_table("dst")  # 3 pages: the smallest paired capacity here
    assert addrs.tolist() == [0x1000, 0x1040, 0x1080, 0x20000, 0x20020, 0x20040]
    s, d = t.prepped_indices(np.array([2, 0]), np.array([1, 2]))
    assert s.tolist() == [2, 0, 6, 4] and d.tolist() == [1, 2, 4, 5]
    with pytest.raises(kvplan.IndexBoundsError, match="dst index 3 at position 1"):
        t.prepped_indices(np.array([0, 1]), np.array([0, 3]))
    with pytest.raises(kvplan.KvPlanError, match='side must be "src"'):
        t.descriptor_table("local")


def test_descriptor_runs_are_the_table_unexpanded() -> None:
    """``descriptor_runs`` is the prepped table as strided rows (base, len, stride, count), one
    per piece and per moving state pair: expanded in order it is ``descriptor_table``; a state
    pool of 2**40 slots is one row, which its table could not be."""
    items = [64, 0, 32]
    pool = kvplan.Layout.cross_layer(0x10000, 4 * 96, [0, 1, 2], items)
    per_layer = kvplan.Layout.mla([0x1000, 0x9000, 0x20000], [256, 0, 96], items,
                                  layer_ids=[0, 1, 2])
    state = [0x100_0000, 0x200_0000]
    t = kvplan.Template(pool.with_state("mamba", state, [48 * 9, 48 * 5], 48, [0, 1]),
                        per_layer.with_state("mamba", [0x300_0000, 0x400_0000],
                                             [48 * 7, 48 * 11], 48, [0, 1]))
    for side in ("src", "dst"):
        runs = t.descriptor_runs(side)
        assert runs.dtype == np.uint64 and runs.shape == (4, 4)
        addrs, lens = t.descriptor_table(side)
        expanded = [(b + k * st, n) for b, n, st, c in runs.tolist() for k in range(c)]
        assert expanded == list(zip(addrs.tolist(), lens.tolist()))
    # the state rows: the smallest paired slot count on each side (5 and 7)
    assert t.descriptor_runs("src")[2:].tolist() == [[s, 48, 48, 5] for s in state]
    assert t.descriptor_runs("dst")[2:, 3].tolist() == [7, 7]
    big = kvplan.Layout([1 << 50], [48 << 40], 48, [0], kinds=["state"])
    huge = kvplan.Template(big, kvplan.Layout([1 << 52], [48 << 40], 48, [0], kinds=["state"]))
    assert huge.descriptor_runs("dst").tolist() == [[1 << 52, 48, 48, 1 << 40]]
    with pytest.raises(kvplan.KvPlanError, match='side must be "src"'):
        t.descriptor_runs("local")


# ---------------------------------------------------------------------------------------------
# In-process: two real agents (metadata still exchanged as bytes)
# ---------------------------------------------------------------------------------------------


class Pair:
    """Two agents in this process, ``a`` writing into ``b``'s buffer."""

    def __init__(self, size: int = 1 << 20) -> None:
        NixlTransport = _nixl_mod().NixlTransport
        rng = np.random.default_rng(11)
        self.src = rng.integers(0, 255, size, dtype=np.uint8)
        self.dst = np.zeros(size, np.uint8)
        self.a, self.b = NixlTransport("unit-a", timeout=20), NixlTransport("unit-b", timeout=20)
        self.a.register_buffers([self.src.ctypes.data], [size])
        self.b.register_buffers([self.dst.ctypes.data], [size])
        self.peer = self.a.add_peer(self.b.metadata())

    def plan(self, src_off: np.ndarray, dst_off: np.ndarray, length: int) -> BlockSlice:
        n = len(src_off)
        return BlockSlice(np.uint64(self.src.ctypes.data) + src_off.astype(np.uint64),
                         np.uint64(self.dst.ctypes.data) + dst_off.astype(np.uint64),
                         np.full(n, length, np.uint64))

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def pair() -> Any:
    p = Pair()
    yield p
    p.close()


def test_submit_in_batches_lands_bytes_and_notifies(pair: Pair) -> None:
    assert pair.peer == "unit-b" and pair.a.peers == ["unit-b"]
    src_off = np.arange(20, dtype=np.int64) * 4096
    dst_off = src_off[::-1].copy()
    stats = pair.a.submit(pair.plan(src_off, dst_off, 4096), pair.peer, max_blocks_per_batch=6,
                          notif=b"req-1")
    assert (stats.blocks, stats.bytes, stats.batches) == (20, 20 * 4096, 4)
    pair.b.wait_notification("unit-a", b"req-1", timeout=20)
    got = pair.dst[:20 * 4096].reshape(20, 4096)
    np.testing.assert_array_equal(got, pair.src[:20 * 4096].reshape(20, 4096)[::-1])
    assert pair.a.live_handles == 0


def test_async_submit_and_wait(pair: Pair) -> None:
    off = np.arange(8, dtype=np.int64) * 1000
    pending = pair.a.submit_async(pair.plan(off, off + 7, 1000), pair.peer, 3, notif=b"x")
    stats = pending.wait()
    assert stats.batches == 3 and pending.done and pending.wait() is stats
    np.testing.assert_array_equal(pair.dst[7:8007], pair.src[:8000])
    assert pair.a.live_handles == 0


def test_unknown_peer_is_a_transfer_error(pair: Pair) -> None:
    with pytest.raises(TransferError, match="unknown peer 'nobody'") as info:
        pair.a.submit(pair.plan(np.array([0]), np.array([0]), 64), "nobody")
    assert info.value.engine == "nixl" and info.value.agent == "unit-a"
    assert pair.a.live_handles == 0


def test_descriptors_outside_registered_memory_are_refused_before_anything_moves(
        pair: Pair) -> None:
    size = pair.dst.size
    with pytest.raises(TransferError) as info:
        pair.a.submit(pair.plan(np.array([0, 4096]), np.array([0, size]), 4096), pair.peer)
    err = info.value
    assert (err.session, err.blocks, err.bytes, err.agent) == ("unit-b", 2, 8192, "unit-a")
    assert err.state == "initialize_xfer: NIXL_ERR_NOT_FOUND" and err.status == -4
    assert "outside the memory registered" in str(err)
    # Local side: kvplan's own check first, NIXL's when that check is switched off.
    with pytest.raises(TransferError, match="not inside a registered region"):
        pair.a.submit(pair.plan(np.array([size]), np.array([0]), 64), pair.peer)
    with pytest.raises(TransferError, match="NIXL_ERR_NOT_FOUND"):
        pair.a.submit(pair.plan(np.array([size]), np.array([0]), 64), pair.peer,
                      check_sources=False)
    assert not pair.dst.any() and pair.a.live_handles == 0


def test_closed_transport_refuses_calls(pair: Pair) -> None:
    pair.a.close()
    with pytest.raises(TransferError, match="closed"):
        pair.a.submit(pair.plan(np.array([0]), np.array([0]), 64), pair.peer)
    with pytest.raises(TransferError, match="closed"):
        pair.a.metadata()


def test_prepped_indices_move_the_same_bytes_as_the_plan() -> None:
    """The prepped path (one descriptor per page per layer) and the run-merged plan write the
    same bytes; checked against a plain numpy copy."""
    NixlTransport = _nixl_mod().NixlTransport
    layers, pages, item = 3, 32, 256
    src = np.random.default_rng(2).integers(0, 255, layers * pages * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    ptrs = [src.ctypes.data + i * pages * item for i in range(layers)]
    dptrs = [dst.ctypes.data + i * pages * item for i in range(layers)]
    s_layout = kvplan.Layout.mla(ptrs, [pages * item] * layers, item, layer_ids=[0, 1, 2])
    d_layout = kvplan.Layout.mla(dptrs, [pages * item] * layers, item, layer_ids=[0, 1, 2])
    a, b = NixlTransport("prep-a"), NixlTransport("prep-b")
    try:
        a.register(s_layout)
        b.register(d_layout)
        peer = a.add_peer(b.metadata())
        prepped = a.prep(s_layout, d_layout, peer)
        sp = np.array([0, 1, 2, 9, 10], np.int64)
        dp = np.array([5, 6, 7, 30, 1], np.int64)
        local, remote = prepped.indices(sp, dp)
        assert local.dtype == np.int32 and len(local) == layers * len(sp)
        assert local[:5].tolist() == sp.tolist() and remote[5:10].tolist() == (dp + 32).tolist()
        stats = prepped.submit(local, remote, notif=b"p")
        assert (stats.blocks, stats.bytes) == (15, 15 * item)
        b.wait_notification("prep-a", b"p", 20)
        want = np.zeros_like(dst).reshape(layers, pages, item)
        want[:, dp] = src.reshape(layers, pages, item)[:, sp]
        np.testing.assert_array_equal(dst.reshape(layers, pages, item), want)
        with pytest.raises(ValueError, match="outside 0..32"):
            prepped.indices(np.array([32]), np.array([0]))
        assert a.live_handles == 0
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def _agents(name: str, src_layout: Any, dst_layout: Any) -> Iterator[tuple[Any, Any, str]]:
    """Two real agents in this process: ``a`` holds ``src_layout`` and writes into ``b``'s
    ``dst_layout``; yields ``(a, b, peer)``."""
    NixlTransport = _nixl_mod().NixlTransport
    a, b = NixlTransport(f"{name}-a", timeout=20), NixlTransport(f"{name}-b", timeout=20)
    try:
        a.register(src_layout)
        b.register(dst_layout)
        yield a, b, a.add_peer(b.metadata())
    finally:
        a.close()
        b.close()


def _prepped_request(a: Any, b: Any, peer: str, src_layout: Any, dst_layout: Any,
                     src_pages: np.ndarray, dst_pages: np.ndarray, notif: bytes) -> Any:
    """One request through the prepped path; the receiver must see ``notif``."""
    prepped = a.prep(src_layout, dst_layout, peer)
    local, remote = prepped.indices(src_pages, dst_pages)
    stats = prepped.submit(local, remote, notif=notif)
    b.wait_notification(a.name, notif, timeout=10)
    assert a.live_handles == 0
    return stats


def test_prepped_cross_layer_pool_to_per_layer_decode_honours_strides() -> None:
    """Source items sit at the pool's stride (the page), not at item_len; every byte of the
    per-layer decode is checked against a plain numpy copy."""
    items, pages = [96, 160, 64], 12
    stride = sum(items)
    offsets = np.cumsum([0, *items[:-1]])
    pool = np.random.default_rng(5).integers(0, 255, pages * stride, dtype=np.uint8)
    decode = [np.zeros(pages * item, np.uint8) for item in items]
    src_layout = kvplan.Layout.cross_layer(pool.ctypes.data, pool.nbytes, [0, 1, 2], items)
    dst_layout = kvplan.Layout.mla([d.ctypes.data for d in decode], [d.nbytes for d in decode],
                                   items, layer_ids=[0, 1, 2])
    sp, dp = np.array([3, 4, 5, 11, 0]), np.array([7, 1, 2, 3, 10])
    with _agents("pool", src_layout, dst_layout) as (a, b, peer):
        stats = _prepped_request(a, b, peer, src_layout, dst_layout, sp, dp, b"pool")
        assert stats.bytes == len(sp) * stride
        by_page = pool.reshape(pages, stride)
        for layer, (item, off) in enumerate(zip(items, offsets)):
            want = np.zeros((pages, item), np.uint8)
            want[dp] = by_page[sp, off:off + item]
            np.testing.assert_array_equal(decode[layer].reshape(pages, item), want)


TP_SRC_PAGES = np.array([0, 1, 3], dtype=np.int64)
TP_DST_PAGES = np.array([4, 2, 0], dtype=np.int64)


def _tp_ranks(heads: int, orders: tuple[str, str], tp_p: int, r_p: int, tp_d: int, r_d: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any, Any]:
    """Prefill rank ``r_p`` and decode rank ``r_d`` (3 layers, 4-token pages of 5, 2-element
    heads) in numpy arenas: ``(src, dst, want, src_layout, dst_layout)``, ``want`` being the
    decode arena once the request has landed (kvplan.testing's oracle)."""
    model = Model(layers=3, kv_heads=heads, head_dim=2, dtype_size=2)
    src = rank_memory(model, Rank(r_p, tp_p, 4, orders[0], 5), seed=r_p + 1)
    dst = rank_memory(model, Rank(r_d, tp_d, 4, orders[1], 5))
    want = dst.memory.copy()
    reference_copy(src.layout, src.memory, dst.layout, want, TP_SRC_PAGES, TP_DST_PAGES)
    return src.memory.data, dst.memory.data, want.data, src.layout, dst.layout


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_prepped_tp8_rank5_to_tp2_rank1_moves_only_the_shared_head(order: str) -> None:
    """Prefill rank 5 of 8 holds head 5; decode rank 1 of 2 holds heads 4..7: the prepped
    lists carry the head fragment at each side's offset (items of different lengths)."""
    assert 5 in kvplan.tp_peers(8, 8, 2, decode_rank=1).receive_from
    src, dst, want, s_layout, d_layout = _tp_ranks(8, (order, order), 8, 5, 2, 1)
    assert not np.array_equal(dst, want)
    with _agents("tp82", s_layout, d_layout) as (a, b, peer):
        stats = _prepped_request(a, b, peer, s_layout, d_layout, TP_SRC_PAGES, TP_DST_PAGES, b"tp")
        assert stats.bytes == kvplan.Template(s_layout, d_layout).bytes_per_page * len(TP_SRC_PAGES)
        np.testing.assert_array_equal(dst, want)


def test_prepped_tp2_rank0_to_rank1_moves_nothing_and_still_notifies() -> None:
    """No head in common (the template says why): the prepped tables hold no page descriptor,
    nothing moves, and the decode still receives the completion notification."""
    src, dst, want, s_layout, d_layout = _tp_ranks(8, ("HND", "HND"), 2, 0, 2, 1)
    assert np.array_equal(dst, want)  # the oracle moves nothing either
    assert kvplan.Template(s_layout, d_layout).empty_reason
    before = dst.copy()
    with _agents("tp22", s_layout, d_layout) as (a, b, peer):
        stats = _prepped_request(a, b, peer, s_layout, d_layout, TP_SRC_PAGES, TP_DST_PAGES, b"none")
        assert (stats.blocks, stats.bytes) == (0, 0)
        np.testing.assert_array_equal(dst, before)


def test_prepped_path_refuses_nhd_to_hnd_and_names_the_plan_path() -> None:
    """Equal page sizes, different memory orders: a page's tokens are re-ordered, which no
    whole-page descriptor expresses. prep() refuses before NIXL sees anything; the plan path
    it names moves the bytes right."""
    src, dst, want, s_layout, d_layout = _tp_ranks(2, ("NHD", "HND"), 1, 0, 1, 0)
    with _agents("order", s_layout, d_layout) as (a, b, peer):
        with pytest.raises(kvplan.KvPlanError, match=r"memory orders.*Template\.plan.*"
                           r"submit\(plan\)") as info:
            a.prep(s_layout, d_layout, peer)
        assert not isinstance(info.value, TransferError)
        a.submit(kvplan.Template(s_layout, d_layout).plan(TP_SRC_PAGES, TP_DST_PAGES), peer)
        np.testing.assert_array_equal(dst, want)


def test_an_empty_plan_still_delivers_its_notification(pair: Pair) -> None:
    """A plan of no blocks (e.g. a decode rank sharing no head with this prefill rank) still
    tells the receiver the request is complete, synchronously and asynchronously."""
    empty = BlockSlice(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    stats = pair.a.submit(empty, pair.peer, notif=b"req-7")
    assert (stats.blocks, stats.bytes) == (0, 0)
    pair.b.wait_notification("unit-a", b"req-7", timeout=10)
    pair.a.submit_async(empty, pair.peer, notif=b"req-8").wait()
    pair.b.wait_notification("unit-a", b"req-8", timeout=10)
    assert not pair.dst.any() and pair.a.live_handles == 0


def test_waiting_after_close_names_the_closed_transport(pair: Pair) -> None:
    """Several batches: the last one (with the notification) is posted only by wait(), so it
    is certainly in flight when close() releases every handle."""
    off = np.arange(8, dtype=np.int64) * 1000
    pending = pair.a.submit_async(pair.plan(off, off, 1000), pair.peer, 3, notif=b"late")
    pair.a.close()
    assert pending.done
    with pytest.raises(TransferError, match="transport closed") as info:
        pending.wait()
    assert "AttributeError" not in str(info.value) and info.value.agent == "unit-a"
    with pytest.raises(TransferError, match="transport closed"):  # the same error again
        pending.wait()


def test_close_on_another_thread_waits_for_a_state_check_in_progress(pair: Pair) -> None:
    """close() on one thread while wait() polls on another: close() must not release a handle
    (or drop the agent) while NIXL is checking it. The agent's check is wrapped so close()
    starts in the middle of a check."""
    off = np.arange(8, dtype=np.int64) * 1000
    pending = pair.a.submit_async(pair.plan(off, off, 1000), pair.peer, 3, notif=b"race")
    agent = pair.a._agent
    real_release, real_check = agent.release_xfer_handle, agent.check_xfer_state
    released: set[Any] = set()
    released_during_check: list[bool] = []
    closer: list[threading.Thread] = []

    def release(handle: Any) -> Any:
        released.add(handle)
        return real_release(handle)

    def check(handle: Any) -> Any:
        if not closer:
            closer.append(threading.Thread(target=pair.a.close))
            closer[0].start()
            closer[0].join(0.3)  # close() finishes here unless it waits for this check
        released_during_check.append(handle in released)
        if handle in released:
            return "ERR"  # never hand NIXL a released handle, even on the unfixed code path
        return real_check(handle)

    agent.release_xfer_handle, agent.check_xfer_state = release, check
    # Either the transfer completes before close() takes effect, or the waiter is told the
    # transport closed; never an untyped error from a released handle or a dropped agent.
    try:
        pending.wait()
    except TransferError as err:
        assert "transport closed" in str(err)
    closer[0].join(20)
    assert not closer[0].is_alive()
    assert released_during_check and not any(released_during_check)
    assert released  # close() did release the in-flight handles, after the check


def test_submit_after_release_or_close_says_why() -> None:
    layers, pages, item = 2, 8, 128
    src = np.arange(layers * pages * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    s_layout = kvplan.Layout.mla([src.ctypes.data + i * pages * item for i in range(layers)],
                                 [pages * item] * layers, item, layer_ids=[0, 1])
    d_layout = kvplan.Layout.mla([dst.ctypes.data + i * pages * item for i in range(layers)],
                                 [pages * item] * layers, item, layer_ids=[0, 1])
    with _agents("release", s_layout, d_layout) as (a, b, peer):
        prepped = a.prep(s_layout, d_layout, peer)
        local, remote = prepped.indices(np.array([1, 2]), np.array([3, 4]))
        prepped.release()
        with pytest.raises(TransferError, match=r"prepped lists .* released") as info:
            prepped.submit(local, remote)
        assert "NIXL_ERR" not in str(info.value)
        again = a.prep(s_layout, d_layout, peer)
        a.close()
        with pytest.raises(TransferError, match="transport is closed"):
            again.submit(local, remote)
    assert not dst.any()


# ---------------------------------------------------------------------------------------------
# In-process: a stand-in agent for a transfer that never finishes and a handle NIXL keeps
# ---------------------------------------------------------------------------------------------


class StuckAgent:
    """Real-signature stand-in: requests stay ``PROC`` forever; release fails ``refuse`` times."""

    def __init__(self, refuse: int = 0) -> None:
        self.backends = {"UCX": 1}
        self.refuse = refuse
        self.live: set[int] = set()
        self.next = 0

    def register_memory(self, reg_list: Any, mem_type: str | None = None,
                        backends: list[str] = []) -> Any:
        return list(reg_list)

    def deregister_memory(self, dereg_list: Any, backends: list[str] = []) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return b"md"

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return b"peer"

    def remove_remote_agent(self, agent: str) -> None:
        pass

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        assert isinstance(descs, np.ndarray) and descs.flags.c_contiguous
        return descs

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any,
                        remote_agent: str, notif_msg: bytes = b"",
                        backends: list[str] = []) -> int:
        self.next += 1
        self.live.add(self.next)
        return self.next

    def transfer(self, handle: int, notif_msg: bytes = b"") -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        assert handle in self.live, "state of a released handle"
        return "PROC"

    def release_xfer_handle(self, handle: int) -> None:
        if self.refuse:
            self.refuse -= 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.live.remove(handle)


def test_timeout_raises_and_releases_the_handle() -> None:
    NixlTransport = _nixl_mod().NixlTransport
    agent = StuckAgent()
    t = NixlTransport("stuck", agent=agent, timeout=0.2)
    t.register_buffers([0x10000], [1 << 20])
    peer = t.add_peer(b"md")
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="timed out") as info:
        t.submit(BlockSlice(np.array([0x10000], np.uint64), np.array([0], np.uint64),
                           np.array([64], np.uint64)), peer)
    assert time.monotonic() - t0 < 10
    assert info.value.state == "PROC (timed out)" and info.value.agent == "stuck"
    assert agent.live == set() and t.live_handles == 0


def test_a_handle_nixl_refuses_to_release_is_released_at_close() -> None:
    NixlTransport = _nixl_mod().NixlTransport
    agent = StuckAgent(refuse=1)
    t = NixlTransport("stuck", agent=agent, timeout=0.2)
    t.register_buffers([0x10000], [1 << 20])
    with pytest.raises(TransferError):
        t.submit(BlockSlice(np.array([0x10000], np.uint64), np.array([0], np.uint64),
                           np.array([64], np.uint64)), t.add_peer(b"md"))
    assert t.live_handles == 1 and len(agent.live) == 1
    t.close()
    assert agent.live == set()


# ---------------------------------------------------------------------------------------------
# Real two-process transfers (each peer its own process and NIXL agent)
# ---------------------------------------------------------------------------------------------

#: A small Kimi-Linear-style hybrid: MLA on layers 3 and 7, two state components elsewhere.
TINY_HYBRID = ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                          (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))


def _hybrid() -> Any:
    from kvplan.testing import model_peers

    peers = model_peers(TINY_HYBRID, pages=64, pp_size=2, state_slots=4)
    src_pages = np.arange(5, 5 + 40, dtype=np.int64)
    dst_pages = fragmented_pages(40, 1 / 3, seed=7, shuffle_runs=True, capacity=64)
    return peers, src_pages, dst_pages


def test_prepped_hybrid_prefill_pp2_to_decode_pp1() -> None:
    """The prepped path (one descriptor per page per entry pair) of the hybrid request that
    test_transfers_engines.py plans on every engine."""
    from support.engine_peers import assert_stages_landed, cluster, wait_stage_notifications

    peers, src_pages, dst_pages = _hybrid()
    decode, stages = peers.decode, peers.prefill
    src_slot, dst_slot = 2, 1
    with cluster(decode, stages, engine="nixl") as c:
        dpeer = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        for spec in stages:  # both stages in flight at once, as real PP stages are
            c.peers[spec.name].send("transfer_prepped", dpeer.layout_wire,
                                    c.sessions[spec.name], src_pages, dst_pages, src_slot,
                                    dst_slot, spec.name.encode())
        results = [c.peers[spec.name].result(60, "transfer") for spec in stages]
        wait_stage_notifications(c, stages)  # the decode sees each stage's completion
        assert_stages_landed(c, decode, stages, before, src_pages, dst_pages, src_slot, dst_slot)
        assert all(c.peers[s.name].call("live_handles") == 0 for s in stages)
    kv_bytes = 40 * TINY_HYBRID.kv_bytes_per_token
    state_bytes = 3 * sum(s.bytes_per_slot for s in TINY_HYBRID.state)
    assert [r["bytes"] for r in results] == [kv_bytes + state_bytes] * 2
    assert all(r["blocks"] == 40 + 6 for r in results)  # one descriptor per page


@pytest.mark.slow
def test_fault_decode_killed_mid_transfer() -> None:
    """256 MiB in 65,536 descriptors (about a second here); the decode process is SIGKILLed
    once the first bytes have landed. The prefill gets a TransferError, holds no handle, and
    stays alive."""
    from kvplan.testing import SENTINEL
    from support.engine_peers import cluster

    n, item = 65536, 4096
    decode, prefill = raw_pair(n, item)
    with cluster(decode, [prefill], engine="nixl") as c:
        d, p = c.peers["decode"], c.peers["prefill"]
        offs = np.arange(n, dtype=np.uint64) * np.uint64(item)
        p.send("submit_raw", c.sessions["prefill"], offs, np.uint64(d.base) + offs,
               np.full(n, item, np.uint64))
        first = c.arenas["decode"].array[:item]
        deadline = time.monotonic() + 60
        while (first == SENTINEL).all() and time.monotonic() < deadline:
            time.sleep(0.0005)
        t0 = time.monotonic()
        d.kill()
        with pytest.raises(TransferError) as info:
            p.result(60, "submit_raw")
        assert time.monotonic() - t0 < 30
        err = info.value
        assert err.engine == "nixl" and err.session == d.session and err.agent == p.session
        assert err.blocks == n and err.bytes == n * item and err.state
        assert p.process.is_alive() and p.call("live_handles") == 0
        # Another request to the dead peer fails too, in bounded time.
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            p.call("submit_raw", c.sessions["prefill"], [0], [d.base], [item], timeout=60)
        assert time.monotonic() - t0 < 30
        assert p.call("live_handles") == 0


def test_fault_destination_outside_registered_memory_then_a_good_transfer() -> None:
    from support.engine_peers import assert_decode_bytes, cluster

    decode, prefill = raw_pair()
    with cluster(decode, [prefill], engine="nixl") as c:
        d, p = c.peers["decode"], c.peers["prefill"]
        before = c.arenas["decode"].array.copy()
        outside = d.base + decode.size + (1 << 20)
        with pytest.raises(TransferError) as info:
            p.call("submit_raw", c.sessions["prefill"], [0, 4096], [outside, outside + 4096],
                   [4096, 4096], timeout=30)
        err = info.value
        assert (err.session, err.blocks, err.bytes, err.status) == (d.session, 2, 8192, -4)
        assert err.agent == p.session and "NIXL_ERR_NOT_FOUND" in (err.state or "")
        assert_decode_bytes(c.arenas["decode"].array, before, decode)
        assert p.call("live_handles") == 0
        p.call("submit_raw", c.sessions["prefill"], [0], [d.base], [4096], timeout=30)
        np.testing.assert_array_equal(c.arenas["decode"].array[:4096],
                                      c.arenas["prefill"].array[:4096])


def test_fault_unknown_peer() -> None:
    from support.engine_peers import cluster

    decode, prefill = raw_pair()
    with cluster(decode, [prefill], engine="nixl") as c:
        d, p = c.peers["decode"], c.peers["prefill"]
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="unknown peer 'not-loaded'") as info:
            p.call("submit_raw", "not-loaded", [0], [d.base], [4096], timeout=30)
        assert time.monotonic() - t0 < 30
        assert info.value.agent == p.session and info.value.session == "not-loaded"
        assert p.call("live_handles") == 0


# ---------------------------------------------------------------------------------------------
# kvplan demo --engine nixl
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kvplan_demo_over_nixl_verifies_every_byte() -> None:
    res = subprocess.run([sys.executable, "-m", "kvplan.cli", "demo", "--engine", "nixl",
                          "--layers", "16", "--pages", "1024"], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout
    assert "NIXL (UCX) on this host" in out
    assert "entries paired: 4 KV + 24 state" in out
    assert re.search(r"^verified: \d+ bytes OK", out, re.M), out


_EXIT_SCRIPT = """
import sys
import numpy as np
import kvplan
from kvplan.engines import NixlTransport
from kvplan.engines.nixl import transport as nixl_transport

a, b = NixlTransport("exit-a"), NixlTransport("exit-b")
src = np.arange(1 << 16, dtype=np.uint8)
dst = np.zeros(1 << 16, np.uint8)
a.register_buffers([src.ctypes.data], [src.nbytes], device="cpu")
b.register_buffers([dst.ctypes.data], [dst.nbytes], device="cpu")
peer = a.add_peer(b.metadata())
plan = kvplan.BlockSlice(np.array([src.ctypes.data], np.uint64),
                        np.array([dst.ctypes.data], np.uint64), np.array([4096], np.uint64))
a.submit(plan, peer, notif=b"done", timeout=30.0)
b.wait_notification("exit-a", b"done", timeout=30.0)
assert (dst[:4096] == src[:4096]).all()
if sys.argv[1] == "close":
    a.close()
    b.close()
    assert len(nixl_transport._OPEN) == 0
else:
    assert len(nixl_transport._OPEN) == 2  # left to kvplan's exit hook
print("ok", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_process_that_used_nixl_exits_cleanly_closed_or_not(how: str, tmp_path) -> None:
    """A script that moved bytes with NIXL exits with status 0 (no crash in teardown), whether
    it called close() or left the transports to interpreter exit."""
    script = tmp_path / "nixl_exit.py"
    script.write_text(_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout.strip().endswith("ok")


def test_the_exit_hook_closes_every_open_transport() -> None:
    """The exit hook releases each transport the program left open (the agent is dropped
    before the interpreter tears modules down)."""
    from kvplan.engines import NixlTransport
    from kvplan.engines.nixl import transport as nixl_transport

    t = NixlTransport("exit-hook")
    assert t in nixl_transport._OPEN
    nixl_transport._close_open_transports()
    assert t not in nixl_transport._OPEN and t._agent is None
    with pytest.raises(TransferError):
        t.submit(BlockSlice(np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                           np.ones(1, np.uint64)), "nobody")
