"""The transports' integrity hooks in one process: the prefill digests over its registered
memory (``Transport.manifest``) and hands the manifests to ``submit(..., manifest=...)``; the
decode waits for them (NIXL: ``wait_manifests``, by the completion message they carry) and
checks what landed in its registered memory (``Transport.check_landed``). Real NIXL agents;
for Mooncake's async path a loopback stand-in with Mooncake's signatures that copies in
process. The two-process runs are in test_digest_engines.py."""

from __future__ import annotations

import ctypes
import importlib
import struct
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.engines import MooncakeTransport, TransferError, Transport
from kvplan.integrity import (
    IntegrityError,
    build_manifest,
    pack_notification,
    read_notification,
    unpack_notification,
)

LAYERS, PAGES, ITEM = 3, 32, 256


def _layouts() -> tuple[np.ndarray, np.ndarray, kvplan.Layout, kvplan.Layout]:
    src = np.random.default_rng(5).integers(0, 255, LAYERS * PAGES * ITEM, dtype=np.uint8)
    dst = np.zeros_like(src)
    entry = PAGES * ITEM
    layouts = [kvplan.Layout.mla([a.ctypes.data + i * entry for i in range(LAYERS)],
                                 [entry] * LAYERS, ITEM, layer_ids=[4, 5, 6])
               for a in (src, dst)]
    return src, dst, layouts[0], layouts[1]


SRC_PAGES = np.array([3, 4, 5, 9, 10, 20], np.int64)
DST_PAGES = np.array([7, 8, 1, 2, 30, 31], np.int64)


def _nixl() -> Any:
    from support.engine_peers import require_nixl

    require_nixl()
    return importlib.import_module("kvplan.engines.nixl").NixlTransport


def test_nixl_manifest_travels_in_the_completion_notification_and_checks_what_landed() -> None:
    NixlTransport = _nixl()
    src, dst, s_layout, d_layout = _layouts()
    template = kvplan.Template(s_layout, d_layout)
    plan = template.plan(SRC_PAGES, DST_PAGES)
    a, b = NixlTransport("digest-a", timeout=20), NixlTransport("digest-b", timeout=20)
    try:
        a.register(s_layout)
        b.register(d_layout)
        # The digests read the registered memory (one region per layer) in place.
        views = a.registered_buffers()
        assert [(v.ctypes.data, v.size) for v in views] == [
            (src.ctypes.data + i * PAGES * ITEM, PAGES * ITEM) for i in range(LAYERS)]
        views[1][0] ^= 1
        assert src[PAGES * ITEM] == views[1][0]
        views[1][0] ^= 1
        manifest = a.manifest(plan, src_pages=SRC_PAGES, dst_pages=DST_PAGES)
        assert manifest == build_manifest(plan, "src", [src], src_pages=SRC_PAGES,
                                          dst_pages=DST_PAGES)
        peer = a.add_peer(b.metadata())
        stats = a.submit(plan, peer, notif=b"req-1", manifest=manifest)
        assert read_notification(stats.integrity) == (b"req-1", [manifest])
        got = b.wait_manifests("digest-a", b"req-1", timeout=20)
        assert got == [manifest]
        mine = b.check_landed(got, src_layout=s_layout, dst_layout=d_layout,
                              src_pages=SRC_PAGES, dst_pages=DST_PAGES)
        assert mine[0].content_digest == manifest.content_digest

        # The prepped path moves the same request; the manifest is the plan's all the same.
        dst[:] = 0
        prepped = a.prep(s_layout, d_layout, peer, template)
        local, remote = prepped.indices(SRC_PAGES, DST_PAGES)
        stats = prepped.submit(local, remote, notif=b"req-2", manifest=[manifest])
        assert unpack_notification(stats.integrity) == [manifest]
        got = b.wait_manifests("digest-a", b"req-2", timeout=20)
        b.check_landed(got, src_layout=s_layout, dst_layout=d_layout, src_pages=SRC_PAGES,
                       dst_pages=DST_PAGES, template=template)

        # One byte of layer 5's pages differs at the decode: the error names it.
        pair = 1
        block = int(plan.pair_offsets[pair])
        dst[int(plan.dst_addrs[block]) - dst.ctypes.data + 7] ^= 0x5A
        with pytest.raises(IntegrityError) as info:
            b.check_landed(got, src_layout=s_layout, dst_layout=d_layout,
                           src_pages=SRC_PAGES, dst_pages=DST_PAGES)
        err = info.value
        assert (err.what, err.pair, err.layer, err.role, err.bad_pairs) == ("content", 1, 5,
                                                                            "kv", 1)
        assert err.template == "prefill pp 0/1 tp 0/1 -> decode pp 0/1 tp 0/1"
        assert a.live_handles == 0
    finally:
        a.close()
        b.close()


def test_nixl_wait_manifests_matches_the_message_and_times_out_naming_it() -> None:
    NixlTransport = _nixl()
    src, _, s_layout, d_layout = _layouts()
    plan = kvplan.Template(s_layout, d_layout).plan(SRC_PAGES, DST_PAGES)
    a, b = NixlTransport("wait-a", timeout=20), NixlTransport("wait-b", timeout=20)
    try:
        a.register(s_layout)
        b.register(d_layout)
        peer = a.add_peer(b.metadata())
        manifest = a.manifest(plan, src_pages=SRC_PAGES, dst_pages=DST_PAGES)
        a.submit(plan, peer, notif=b"one", manifest=manifest)
        a.submit(plan, peer, notif=b"two", manifest=manifest)
        a.submit(plan, peer, notif=b"two")  # a plain notification is no manifest
        assert b.wait_manifests("wait-a", b"two", timeout=20) == [manifest]
        b.wait_notification("wait-a", b"two", timeout=20)  # the plain one, still there
        with pytest.raises(TransferError, match="no integrity notification b'two'"):
            b.wait_manifests("wait-a", b"two", timeout=0.2)
        # A decode that does not verify sees the completion of a digested request too.
        b.wait_notification("wait-a", b"one", timeout=20)
    finally:
        a.close()
        b.close()


class _LoopbackMooncake:
    """Mooncake's ``TransferEngine`` signatures (0.3.13) over one process: writes are copies."""

    def __init__(self) -> None:
        self._ids = 0

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 15999

    def register_memory(self, addr: int, length: int) -> int:
        return 0

    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int:
        return 0

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        return 0

    def batch_transfer_sync_write(self, peer: str, src: list[int], dst: list[int],
                                  lengths: list[int]) -> int:
        for s, d, n in zip(src, dst, lengths):
            ctypes.memmove(d, s, n)
        return 0

    def batch_transfer_async_write(self, peer: str, src: list[int], dst: list[int],
                                   lengths: list[int]) -> int:
        self.batch_transfer_sync_write(peer, src, dst, lengths)
        self._ids += 1
        return self._ids

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        return 0


def test_mooncake_returns_the_manifests_for_the_side_channel_sync_and_async() -> None:
    src, dst, s_layout, d_layout = _layouts()
    template = kvplan.Template(s_layout, d_layout)
    plan = template.plan(SRC_PAGES, DST_PAGES)
    state_like = template.plan(SRC_PAGES[:2], DST_PAGES[:2])  # a request's second plan
    t = MooncakeTransport("127.0.0.1", engine=_LoopbackMooncake(), max_blocks_per_batch=2)
    try:
        t.register(s_layout)
        t.register(d_layout)
        first = t.manifest(plan, src_pages=SRC_PAGES, dst_pages=DST_PAGES)
        assert t.submit(plan, "self").integrity == b""  # no manifest, nothing to send
        with t.submit_async(plan, "self", manifest=first) as pending:
            pass
        assert pending.stats is not None
        assert unpack_notification(pending.stats.integrity) == [first]
        assert sum(v.size for v in t.registered_buffers()) == src.size + dst.size
        t.check_landed(pending.stats.integrity, src_layout=s_layout, dst_layout=d_layout,
                       src_pages=SRC_PAGES, dst_pages=DST_PAGES)
        second = t.manifest(state_like, src_pages=SRC_PAGES[:2], dst_pages=DST_PAGES[:2])
        stats = t.submit(state_like, "self", manifest=[first, second])
        assert unpack_notification(stats.integrity) == [first, second]
    finally:
        t.close()


class _HostRegistry(Transport):
    """The engine base with registration only (what the digests' memory checks need)."""

    engine_name = "registry"

    def _engine_register(self, ptrs: list[int], lens: list[int], device: str) -> int:
        return 0

    def _engine_unregister(self, ptrs: list[int]) -> int:
        return 0


def test_device_memory_is_not_read_from_the_host_unless_buffers_are_given() -> None:
    src, _, s_layout, d_layout = _layouts()
    plan = kvplan.Template(s_layout, d_layout).plan(SRC_PAGES, DST_PAGES)
    t = _HostRegistry()
    t.register_buffers([src.ctypes.data], [src.size], "cuda:1")
    with pytest.raises(TransferError, match=r"is cuda:1 memory, which the host cannot digest"):
        t.manifest(plan, src_pages=SRC_PAGES, dst_pages=DST_PAGES)
    # Host buffers holding the same bytes (a staging copy, say) are digested instead.
    assert t.manifest(plan, src_pages=SRC_PAGES, dst_pages=DST_PAGES, buffers=[src]) == \
        build_manifest(plan, "src", [src], src_pages=SRC_PAGES, dst_pages=DST_PAGES)
    t.unregister_all()
    assert t.registered_buffers() == []


def test_notification_carries_a_message_and_still_reads_version_1() -> None:
    src, _, s_layout, d_layout = _layouts()
    plan = kvplan.Template(s_layout, d_layout).plan(SRC_PAGES, DST_PAGES)
    m = build_manifest(plan, "src", [src], src_pages=SRC_PAGES, dst_pages=DST_PAGES)
    data = pack_notification([m, m], b"stage-1")
    assert data[:4] == b"KVPN" and struct.unpack_from("<HHI", data, 4) == (2, 2, 7)
    assert read_notification(data) == (b"stage-1", [m, m])
    body = m.to_bytes()
    v1 = struct.pack("<4sHH", b"KVPN", 1, 1) + struct.pack("<I", len(body)) + body
    assert read_notification(v1) == (b"", [m])
    with pytest.raises(kvplan.KvPlanError, match="announces a 99-byte message"):
        read_notification(struct.pack("<4sHHI", b"KVPN", 2, 0, 99) + b"short")
    with pytest.raises(kvplan.KvPlanError, match="version 4"):
        read_notification(struct.pack("<4sHHI", b"KVPN", 4, 0, 0))
    # Version 3 carries a streamed request's work record after the message.
    from kvplan.integrity import read_work

    v3 = pack_notification([m], b"stage-1", work=b"record")
    assert struct.unpack_from("<HH", v3, 4) == (3, 1)
    assert read_notification(v3) == (b"stage-1", [m]) and read_work(v3) == b"record"
    assert read_work(data) == b""
    with pytest.raises(kvplan.KvPlanError, match="announces a 50-byte work record"):
        read_notification(struct.pack("<4sHHII", b"KVPN", 3, 0, 0, 50) + b"short")
