"""Abort, reuse, late write over the real engines (Mooncake TCP, NIXL UCX; two transports in
this process on loopback): the decode aborts request A, reuses its pages for B, and A's writer
moves its bytes after B's; the decode's lease table refuses A's completion naming B, and B's
own check then fails on the bytes the engine really wrote. A clean abort flags nothing. And a
dropped completion status (NIXL's notification; Mooncake's side-channel message, with a writer
that stopped half-way) leaves the request unloaded, its late status refused, and the verifier
names the bytes that never landed."""

from __future__ import annotations

import queue

import numpy as np
import pytest

import kvplan
from kvplan import LeaseTable, BlockSlice, StaleLeaseError
from kvplan.engines.measure import loopback_transports
from kvplan.testing.oracle import array_pool
from support.engine_peers import Engine

PAGES = 16
LAYERS = 3
ITEM = 128


def pool(array: np.ndarray) -> kvplan.Layout:
    """A cross-layer pool: page ``p`` holds every layer's item."""
    return array_pool(array, LAYERS, ITEM)


@pytest.mark.parametrize("late", [True, False], ids=["late-writer", "clean-abort"])
def test_a_late_writer_is_refused_naming_the_request_it_overwrote(engine: Engine,
                                                                   late: bool) -> None:
    rng = np.random.default_rng(3)
    src_a = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    src_b = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src_a)
    layout_a, layout_b, layout_d = pool(src_a), pool(src_b), pool(dst)
    t_a, t_b = kvplan.Template(layout_a, layout_d), kvplan.Template(layout_b, layout_d)
    table = LeaseTable(PAGES)
    a_src, a_dst = np.array([2, 3, 4], dtype=np.int64), np.array([5, 6, 7], dtype=np.int64)
    b_src, b_dst = np.array([9, 1], dtype=np.int64), np.array([6, 7], dtype=np.int64)
    lease_a = table.grant("req-A", a_dst)
    plan_a = t_a.plan(a_src, a_dst)
    sender, receiver = loopback_transports(engine.name)
    try:
        sender.register_buffers([src_a.ctypes.data, src_b.ctypes.data],
                                [src_a.nbytes, src_b.nbytes])
        receiver.register_buffers([dst.ctypes.data], [dst.nbytes])
        peer = receiver.local_session_id()
        if engine.name == "nixl":
            peer = sender.add_peer(receiver.metadata())  # type: ignore[attr-defined]
        manifest_a = sender.manifest(plan_a, src_pages=a_src, dst_pages=a_dst, lease=lease_a)
        table.abort(lease_a)
        assert table.fence(b_dst) == (lease_a,)
        if not late:
            # A's writer stopped before the reuse: its completion is stale and harms nobody.
            with pytest.raises(StaleLeaseError) as stopped:
                table.check(lease_a)
            assert stopped.value.overwritten == ()
            assert table.settle(lease_a) == ()
        else:
            with pytest.raises(kvplan.LeaseError, match="may still land"):
                table.grant("req-B", b_dst)
        lease_b = table.grant("req-B", b_dst, force=late)
        plan_b = t_b.plan(b_src, b_dst)
        stats_b = sender.submit(plan_b, peer, manifest=[
            sender.manifest(plan_b, src_pages=b_src, dst_pages=b_dst, lease=lease_b)])
        check_b = dict(src_layout=layout_b, dst_layout=layout_d, src_pages=b_src,
                       dst_pages=b_dst, template=t_b, lease=lease_b, leases=table)
        receiver.check_landed(stats_b.integrity, **check_b)  # type: ignore[arg-type]
        if late:
            # The aborted writer's bytes reach the engine after B's, over B's pages.
            stats_a = sender.submit(plan_a, peer, manifest=[manifest_a])
            with pytest.raises(StaleLeaseError, match=r"'req-A' epoch 1 was aborted.*held now "
                                                      r"by 'req-B' \(epoch 2\)") as refused:
                receiver.check_landed(stats_a.integrity, src_layout=layout_a,
                                      dst_layout=layout_d, src_pages=a_src, dst_pages=a_dst,
                                      template=t_a, lease=lease_b, leases=table)
            assert refused.value.overwritten == (lease_b,)
            assert table.settle(lease_a) == (lease_b,)
            # B's bytes really were overwritten, and B's check says so now.
            with pytest.raises(kvplan.IntegrityError) as broken:
                receiver.check_landed(stats_b.integrity, **check_b)  # type: ignore[arg-type]
            assert broken.value.what == "content"
        else:
            receiver.check_landed(stats_b.integrity, **check_b)  # type: ignore[arg-type]
        table.release(lease_b)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.nixl
def test_a_dropped_status_is_never_counted_as_loaded() -> None:
    """NIXL: the prefill's bytes land but its completion notification is lost. The decode's
    wait for the request's manifests times out, so the request is aborted, never counted as
    loaded; when the status turns up after all, its lease is refused as aborted."""
    from support.engine_peers import require_nixl

    require_nixl()
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    s_layout, d_layout = pool(src), pool(dst)
    t = kvplan.Template(s_layout, d_layout)
    table = LeaseTable(PAGES)
    s_pages, d_pages = np.array([1, 2], dtype=np.int64), np.array([8, 9], dtype=np.int64)
    lease = table.grant("req-7", d_pages)
    plan = t.plan(s_pages, d_pages)
    sender, receiver = loopback_transports("nixl")
    try:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        receiver.register_buffers([dst.ctypes.data], [dst.nbytes])
        peer = sender.add_peer(receiver.metadata())  # type: ignore[attr-defined]
        manifest = sender.manifest(plan, src_pages=s_pages, dst_pages=d_pages, lease=lease)
        sender.submit(plan, peer)  # the bytes, and no status: it was dropped
        prefill = sender.local_session_id()
        with pytest.raises(kvplan.TransferError, match="req-7"):
            receiver.wait_manifests(prefill, b"req-7", timeout=1.0)  # type: ignore[attr-defined]
        table.abort(lease)  # not loaded: the decode gives up on the request
        # The status arrives late: a stale lease, refused before any byte is read.
        sender.submit(plan, peer, notif=b"req-7", manifest=[manifest])  # type: ignore[call-arg]
        received = receiver.wait_manifests(prefill, b"req-7")  # type: ignore[attr-defined]
        with pytest.raises(StaleLeaseError, match="'req-7' epoch 1 was aborted"):
            receiver.check_landed(received, src_layout=s_layout, dst_layout=d_layout,
                                  src_pages=s_pages, dst_pages=d_pages, template=t,
                                  lease=lease, leases=table)
        assert table.settle(lease) == ()
    finally:
        sender.close()
        receiver.close()


@pytest.mark.mooncake
def test_a_dropped_mooncake_status_is_never_counted_as_landed() -> None:
    """Mooncake: the target gets no notification, so a request's completion status is the
    prefill's side-channel message (``TransferStats.integrity``). The prefill's writer stops
    half-way (only the first half of its blocks reach the engine) and its status is lost: the
    decode's wait times out, so the request is aborted, never counted as landed; when the
    status turns up after all, its lease is refused as aborted, and the verifier over the bytes
    (the decode's own lease) names what never landed."""
    from support.engine_peers import require_mooncake

    require_mooncake()
    rng = np.random.default_rng(5)
    src = rng.integers(1, 256, PAGES * LAYERS * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    s_layout, d_layout = pool(src), pool(dst)
    t = kvplan.Template(s_layout, d_layout, coalesce=False)
    table = LeaseTable(PAGES)
    s_pages = np.array([1, 2, 5, 9], dtype=np.int64)
    d_pages = np.array([8, 10, 11, 3], dtype=np.int64)
    lease = table.grant("req-9", d_pages)
    plan = t.plan(s_pages, d_pages)
    assert plan.n_blocks >= 4
    side_channel: queue.Queue[bytes] = queue.Queue()
    sender, receiver = loopback_transports("mooncake")
    try:
        sender.register_buffers([src.ctypes.data], [src.nbytes])
        receiver.register_buffers([dst.ctypes.data], [dst.nbytes])
        peer = receiver.local_session_id()
        manifest = sender.manifest(plan, src_pages=s_pages, dst_pages=d_pages, lease=lease)
        half = plan.n_blocks // 2
        part = BlockSlice(plan.src_addrs[:half], plan.dst_addrs[:half], plan.lengths[:half])
        stats = sender.submit(part, peer, manifest=[manifest])
        assert stats.blocks == half and stats.integrity
        # The writer stopped here, and its status never reached the side channel.
        with pytest.raises(queue.Empty):
            side_channel.get(timeout=0.5)
        table.abort(lease)  # not landed: the decode gives up on the request
        assert table.fence(d_pages) == (lease,)
        # The lost status turns up late: its lease is refused before any byte is read.
        side_channel.put(stats.integrity)
        late = side_channel.get(timeout=1.0)
        check = dict(src_layout=s_layout, dst_layout=d_layout, src_pages=s_pages,
                     dst_pages=d_pages, template=t, lease=lease)
        with pytest.raises(StaleLeaseError, match="'req-9' epoch 1 was aborted"):
            receiver.check_landed(late, leases=table, **check)  # type: ignore[arg-type]
        # Read against the bytes, the status is incomplete: the verifier names the pairs
        # whose blocks never landed.
        with pytest.raises(kvplan.IntegrityError) as missing:
            receiver.check_landed(late, **check)  # type: ignore[arg-type]
        assert missing.value.what == "content"
        landed = np.zeros(plan.n_pairs, dtype=bool)
        offsets = plan.pair_offsets
        for p in range(plan.n_pairs):
            landed[p] = offsets[p + 1] <= half
        assert missing.value.bad_pairs == int((~landed).sum()) > 0
        assert table.settle(lease) == ()
    finally:
        sender.close()
        receiver.close()
