"""Integrity manifests between real processes: the prefill digests what it sends and ships the
manifest with its NIXL completion notification (or returns it for the caller's own side
channel with Mooncake); the decode process re-plans from the handshake's layout bytes, digests
what landed in its own memory and verifies. A clean transfer passes; one block then
overwritten through the real engine raises IntegrityError naming the layer and role."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan.integrity import IntegrityError, unpack_notification


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_manifest_travels_between_processes_and_catches_a_corrupted_block(engine: str) -> None:
    from support.engine_peers import cluster, mha_k_v_case, require_mooncake, require_nixl

    (require_nixl if engine == "nixl" else require_mooncake)()
    decode, prefill, src_pages, dst_pages = mha_k_v_case()
    with cluster(decode, [prefill], engine=engine) as c:
        dpeer, ppeer = c.peers["decode"], c.peers["prefill"]
        res = ppeer.call("transfer", dpeer.layout_wire, c.sessions["prefill"], src_pages,
                         dst_pages, None, None, 7, b"", None, True, timeout=60)
        manifest = res["manifest"]
        (sent,) = unpack_notification(manifest)
        assert sent.n_blocks == res["blocks"] and sent.total_bytes == res["bytes"]
        # NIXL: the decode takes the manifest from the completion notification itself.
        payload = None if engine == "nixl" else manifest
        assert dpeer.call("check_digest", ppeer.layout_wire, payload, src_pages, dst_pages,
                          None, None, ppeer.session, 30.0, timeout=60) == 1

        # Overwrite 16 bytes of pair 5's first destination block through the engine.
        src_layout = kvplan.Layout.from_bytes(ppeer.layout_wire)
        dst_layout = kvplan.Layout.from_bytes(dpeer.layout_wire)
        plan = kvplan.Template(src_layout, dst_layout).plan(np.asarray(src_pages, np.int64),
                                                           np.asarray(dst_pages, np.int64))
        block = int(plan.pair_offsets[5])
        at = int(plan.dst_addrs[block]) - dpeer.base
        landed = c.arenas["decode"].array[at:at + 16]
        source = c.arenas["prefill"].array
        offset = next(o for o in range(0, source.size - 16, 16)
                      if not np.array_equal(source[o:o + 16], landed))
        ppeer.call("submit_raw", c.sessions["prefill"], [offset], [int(plan.dst_addrs[block])],
                   [16], timeout=60)
        with pytest.raises(IntegrityError) as info:
            dpeer.call("check_digest", ppeer.layout_wire, manifest, src_pages, dst_pages, None,
                       None, ppeer.session, 30.0, timeout=60)
        dst_entry = int(plan_pairs(src_layout, dst_layout)[5][1])
        assert info.value.what == "content" and info.value.pair == 5
        assert (info.value.layer, info.value.role) == (dst_layout.layer_ids[dst_entry],
                                                       dst_layout.roles[dst_entry])
        assert "1 of 8 entry pairs differ" in str(info.value)


def plan_pairs(src: kvplan.Layout, dst: kvplan.Layout) -> np.ndarray:
    return kvplan.Template(src, dst).pairs
