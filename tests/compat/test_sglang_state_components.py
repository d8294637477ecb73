"""SGLang 0.5.23's page-indexed state components (``state_type`` SWA KV, DSA index-K, QSA, ...)
through kvplan's ``_send_kvcache_generic``, against SGLang's own method from the wheel.

A state component is its own page pool: per layer one buffer, indexed by the component's page
indices (an SWA pool's pages of the window, ...), paired by its layer ids. For random requests
on random deployments (prefill PP stages holding a part of the layers, decode entries in another
order, elided DSA entries on either side) the original and the patched manager run the same call
against a recording engine; the destination byte maps and statuses must be identical. SGLang's
stride check and its failure path (``conclude_failure``, -1) are kept; a component without layer
ids stays SGLang's own (positional) path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvplan.compat import sglang as compat
from support.sglang_models import SESSION, canonical, engine_blocks, load_sglang_or_fail

PAGES = 64
SRC_BASE, DST_BASE, SPAN = 0x1000_0000, 0x9000_0000, 1 << 20
#: per run: whether kvplan's template planned the call (not SGLang's own method)
PLANNED_BY_KVPLAN: list[bool] = []


@pytest.fixture(scope="module")
def sg() -> Any:
    return load_sglang_or_fail()


@contextlib.contextmanager
def patched(sg: Any, on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    compat.install(sg.MooncakeKVManager)
    try:
        yield
    finally:
        compat.uninstall(sg.MooncakeKVManager)


def component(rng: np.random.Generator, state_type: str) -> dict[str, Any]:
    """One state component of a random deployment: the prefill holds a stage of the layers,
    the decode every layer in a shuffled order; per layer one buffer and item length."""
    layers = int(rng.integers(1, 7))
    stages = int(rng.integers(1, 3)) if layers > 1 else 1
    stage = int(rng.integers(0, stages))
    held = np.array_split(np.arange(layers), stages)[stage].tolist()
    items = [int(rng.choice([32, 64, 96])) for _ in range(layers)]
    decode_order = rng.permutation(layers).tolist()
    src_items = [items[layer] for layer in held]
    dst_items = [items[layer] for layer in decode_order]
    if state_type == "DSA" and rng.random() < 0.4:  # elided index-K on one side
        if rng.random() < 0.5:
            src_items[int(rng.integers(0, len(held)))] = 0
        else:
            dst_items[int(rng.integers(0, layers))] = 0
    if rng.random() < 0.2:  # a decode stride that differs from its prefill partner's
        k = int(rng.integers(0, layers))
        dst_items[k] = dst_items[k] + 32
    return dict(
        pp_size=stages,
        src_ptrs=[SRC_BASE + layer * SPAN for layer in held], src_items=src_items,
        src_ids=held, dst_ptrs=[DST_BASE + layer * SPAN for layer in decode_order],
        dst_items=dst_items, dst_ids=decode_order)


def indices(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(0, 20))
    if rng.random() < 0.5:
        s0, d0 = int(rng.integers(0, PAGES - n)), int(rng.integers(0, PAGES - n))
        return (np.arange(s0, s0 + n, dtype=np.int32), np.arange(d0, d0 + n, dtype=np.int32))
    return (rng.choice(PAGES, n, replace=False).astype(np.int32),
            rng.choice(PAGES, n, replace=False).astype(np.int32))


def run(sg: Any, comp: dict[str, Any], state_type: Any, src: np.ndarray, dst: np.ndarray, *,
        kvplan: bool, with_dst_items: bool = True, validated: bool = False,
        ids: bool = True) -> tuple[Any, ...]:
    failures: list[dict[str, Any]] = []
    with patched(sg, kvplan):
        kv_args = type("KVArgs", (), {})()
        kv_args.state_data_ptrs = [comp["src_ptrs"]]
        kv_args.state_data_lens = [[SPAN] * len(comp["src_ptrs"])]
        mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=kv_args, pp_size=comp["pp_size"],
                                state_strides_validated={SESSION} if validated else set())
        mgr.conclude_failure = lambda **kw: failures.append(kw)
        try:
            rc = mgr._send_kvcache_generic(
                SESSION, comp["src_ptrs"], comp["dst_ptrs"], comp["src_items"], src, dst, None,
                state_type=state_type, src_layer_ids=comp["src_ids"] if ids else None,
                dst_layer_ids=comp["dst_ids"] if ids else None,
                dst_item_lens=comp["dst_items"] if with_dst_items else None,
                bootstrap_room=7)
        except Exception as exc:  # noqa: BLE001 - compared below
            return ("raise", type(exc).__name__)
    PLANNED_BY_KVPLAN.append(len(mgr.__dict__.get("_kvplan_templates") or ()) > 0)
    return ("ok", rc, canonical(engine_blocks(mgr.engine.calls)), failures)


@pytest.mark.parametrize("name", ["SWA", "DSA", "QSA_PENDING", "SWA_RING", "DSV4_REQUEST_STATE",
                                  "BLOCK_SCALE", "BLOCK_SCALE_SWA"])
def test_state_components_move_the_same_bytes_as_sglang(sg: Any, name: str) -> None:
    state_type = getattr(sg.StateType, name)
    rng = np.random.default_rng(sum(map(ord, name)))
    outcomes = {"ok": 0, "failed": 0}
    for _ in range(150):
        comp = component(rng, name)
        src, dst = indices(rng)
        for validated in (False, True):
            theirs = run(sg, comp, state_type, src, dst, kvplan=False, validated=validated)
            ours = run(sg, comp, state_type, src, dst, kvplan=True, validated=validated)
            assert ours == theirs, (name, comp, src.tolist(), dst.tolist(), validated)
            if ours[0] == "ok" and ours[1] == 0 and len(src):
                assert PLANNED_BY_KVPLAN[-1], "kvplan's drop-in handed the call to SGLang"
            outcomes["ok" if theirs[1] == 0 else "failed"] += 1
    # Both branches ran: transfers, and stride mismatches failing the request.
    assert outcomes["ok"] > 100 and outcomes["failed"] > 10, outcomes


def test_a_stride_mismatch_fails_the_request_as_sglang_does_and_moves_nothing(sg: Any) -> None:
    comp = dict(pp_size=1, src_ptrs=[SRC_BASE, SRC_BASE + SPAN], src_items=[64, 64],
                src_ids=[0, 1], dst_ptrs=[DST_BASE, DST_BASE + SPAN], dst_items=[64, 32],
                dst_ids=[0, 1])
    pages = np.arange(4, dtype=np.int32)
    ours = run(sg, comp, sg.StateType.SWA, pages, pages, kvplan=True)
    assert ours[:3] == ("ok", -1, [])
    assert ours[3] == [{"bootstrap_room": 7, "failure_reason": ours[3][0]["failure_reason"]}]
    assert "item length mismatch" in ours[3][0]["failure_reason"]
    assert ours == run(sg, comp, sg.StateType.SWA, pages, pages, kvplan=False)
    # A session whose strides were validated at registration is not checked again.
    sent = run(sg, comp, sg.StateType.SWA, pages, pages, kvplan=True, validated=True)
    assert sent[1] == 0 and len(sent[2]) == 2 and sent[3] == []


def test_elided_dsa_entries_move_nothing_on_either_side(sg: Any) -> None:
    comp = dict(pp_size=1, src_ptrs=[SRC_BASE, SRC_BASE + SPAN, SRC_BASE + 2 * SPAN],
                src_items=[64, 0, 64], src_ids=[0, 1, 2],
                dst_ptrs=[DST_BASE, DST_BASE + SPAN, DST_BASE + 2 * SPAN],
                dst_items=[64, 64, 0], dst_ids=[0, 1, 2])
    pages = np.arange(3, dtype=np.int32)
    ours = run(sg, comp, sg.StateType.DSA, pages, pages, kvplan=True)
    assert ours == ("ok", 0, [(SRC_BASE, DST_BASE, 3 * 64)], [])
    assert ours == run(sg, comp, sg.StateType.DSA, pages, pages, kvplan=False)


def test_a_component_without_layer_ids_stays_sglangs_positional_path(sg: Any) -> None:
    comp = dict(pp_size=1, src_ptrs=[SRC_BASE], src_items=[64], src_ids=[0],
                dst_ptrs=[DST_BASE], dst_items=[64], dst_ids=[0])
    pages = np.array([3, 4], dtype=np.int32)
    ours = run(sg, comp, sg.StateType.SWA, pages, pages, kvplan=True, ids=False)
    assert not PLANNED_BY_KVPLAN[-1]
    assert ours == run(sg, comp, sg.StateType.SWA, pages, pages, kvplan=False, ids=False)
    assert ours[2] == [(SRC_BASE + 3 * 64, DST_BASE + 3 * 64, 128)]
