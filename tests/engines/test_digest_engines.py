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
from support.engine_peers import Engine


def test_manifest_travels_between_processes_and_catches_a_corrupted_block(
        engine: Engine) -> None:
    from support.engine_peers import mha_k_v_case

    decode, prefill, src_pages, dst_pages = mha_k_v_case()
    with engine.cluster(decode, [prefill]) as c:
        dpeer, ppeer = c.peers["decode"], c.peers["prefill"]
        res = ppeer.call("transfer", dpeer.layout_wire, c.sessions["prefill"], src_pages,
                         dst_pages, None, None, 7, b"", None, True, timeout=60)
        manifest = res["manifest"]
        (sent,) = unpack_notification(manifest)
        assert sent.n_blocks == res["blocks"] and sent.total_bytes == res["bytes"]
        # NIXL: the decode takes the manifest from the completion notification itself.
        payload = None if engine.notifies else manifest
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


#: A small Kimi-Linear-style hybrid: MLA on layers 3 and 7, two state components elsewhere.
def _tiny_hybrid() -> object:
    from kvplan.presets import ModelPreset, StateSpec

    return ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                       (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))


def test_engine_hooks_carry_both_pp_stages_manifests_and_name_a_corrupted_state_slot(
        engine: Engine) -> None:
    """Two prefill PP stages write a hybrid request (pages and state slots) through the
    transports' own hooks: each digests over its registered memory (``Transport.manifest``)
    and hands the page and state manifests to its last ``submit(..., manifest=...)``. NIXL
    carries them in the completion notification together with the stage's own message
    (``wait_manifests`` finds them by it; plain ``wait_notification`` still sees the
    completion); Mooncake returns them for the caller's channel. The decode's
    ``check_landed`` over its registered memory passes, then names the template, layer and
    role of a state slot overwritten through the engine, and a page list that is not the one
    the prefill planned."""
    from kvplan.integrity import read_notification
    from kvplan.presets import fragmented_pages
    from kvplan.testing import model_peers

    peers = model_peers(_tiny_hybrid(), pages=64, pp_size=2, state_slots=4)  # type: ignore[arg-type]
    src_pages = np.arange(5, 45, dtype=np.int64)
    dst_pages = fragmented_pages(40, 1 / 3, seed=7, shuffle_runs=True, capacity=64)
    src_slot, dst_slot = 1, 3
    with engine.cluster(peers.decode, peers.prefill) as c:
        dpeer = c.peers["decode"]
        stages = [c.peers[s.name] for s in peers.prefill]
        for p in stages:  # both stages write concurrently, as PP stages do
            p.send("transfer", dpeer.layout_wire, c.sessions[p.spec.name], src_pages, dst_pages,
                   src_slot, dst_slot, None, p.spec.name.encode(), None, True)
        manifests = {p.spec.name: p.result(60.0, "transfer")["manifest"] for p in stages}
        for p in stages:
            # The stage's own completion message rides along where the engine has one (NIXL).
            message, sent = read_notification(manifests[p.spec.name])
            assert message == (p.spec.name.encode() if engine.notifies else b"")
            assert len(sent) == 2  # page plan, state plan
            # NIXL: the decode takes the manifests from the notification carrying the message.
            payload = None if engine.notifies else manifests[p.spec.name]
            assert dpeer.call("check_digest", p.layout_wire, payload, src_pages, dst_pages,
                              src_slot, dst_slot, p.session, 30.0, None, p.spec.name.encode(),
                              timeout=60) == 2
        if engine.notifies:  # a decode that does not verify still sees the completion
            stage = stages[0]
            stage.call("transfer", dpeer.layout_wire, c.sessions[stage.spec.name], src_pages,
                       dst_pages, src_slot, dst_slot, None, b"plain", None, True, timeout=60)
            assert dpeer.call("wait_notification", stage.session, b"plain", 30.0)

        # Overwrite 8 bytes of stage 1's last state pair's destination slot through the engine.
        stage = stages[1]
        src_layout = kvplan.Layout.from_bytes(stage.layout_wire)
        dst_layout = kvplan.Layout.from_bytes(dpeer.layout_wire)
        template = kvplan.Template(src_layout, dst_layout)
        state_plan = template.plan_state(src_slot, dst_slot)
        pair = len(template.state_pairs) - 1
        block = int(state_plan.pair_offsets[pair])
        target = int(state_plan.dst_addrs[block])
        landed = c.arenas["decode"].array[target - dpeer.base:][:8]
        source = c.arenas[stage.spec.name].array
        offset = next(o for o in range(0, source.size - 8, 8)
                      if not np.array_equal(source[o:o + 8], landed))
        stage.call("submit_raw", c.sessions[stage.spec.name], [offset], [target], [8],
                   timeout=60)
        with pytest.raises(IntegrityError) as info:
            dpeer.call("check_digest", stage.layout_wire, manifests[stage.spec.name], src_pages,
                       dst_pages, src_slot, dst_slot, stage.session, 30.0, timeout=60)
        dst_entry = int(template.state_pairs[pair][1])
        assert info.value.what == "content" and info.value.pair == pair
        assert (info.value.layer, info.value.role) == (dst_layout.layer_ids[dst_entry],
                                                       dst_layout.roles[dst_entry])
        assert info.value.template == "prefill pp 1/2 tp 0/1 -> decode pp 0/1 tp 0/1"
        assert f"state pair {pair}" in str(info.value)

        # The decode verifies against another page list than the prefill planned with.
        with pytest.raises(IntegrityError) as info:
            dpeer.call("check_digest", stages[0].layout_wire, manifests[stages[0].spec.name],
                       src_pages, np.roll(dst_pages, 1), src_slot, dst_slot, None, 30.0,
                       timeout=60)
        assert info.value.what == "pages" and "decode (dst) page list differs" in str(info.value)
