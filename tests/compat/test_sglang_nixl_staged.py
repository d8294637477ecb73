"""kvplan's ``NixlKVManager.send_kvcache_staged`` against SGLang 0.5.23's own (nixl/conn.py from
the wheel), on host memory: the gather kernel is the loader's recorder (applied with its
byte-level semantics), the NIXL agent records the descriptors each side posts. On random staged
requests (KV heads, both attention TP sizes, every writer a decode rank asks, page sizes, page
lists) kvplan's descriptors must move the bytes SGLang's do, no more descriptors, with SGLang's
gather call unchanged; pages outside the pool tensors are refused before the kernel runs."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from support.sglang_models import canonical, load_loader, load_sglang_or_fail
from support.sglang_nixl import RecordingAgent, load_nixl
from support.sglang_staging import POOL_PAGES, StagedWorld, asked

CALLS = 1000
NO_RIGHT_ANSWER = [(-1, -1, -1)]


@pytest.fixture(scope="module")
def sg() -> Any:
    sg = load_sglang_or_fail()
    load_loader().load_staging(sg)
    sg.nixl_cls = load_nixl(sg).NixlKVManager
    return sg


def _call(sg: Any, world: StagedWorld, r_p: int, patched: bool, pages: Any,
          region: int) -> tuple[Any, ...]:
    ctx: Any = contextlib.nullcontext()
    if patched:
        compat.install(sg.nixl_cls)
        ctx = contextlib.ExitStack()
        ctx.callback(compat.uninstall, sg.nixl_cls)
    with ctx:
        mgr = world.manager(sg.nixl_cls, 0, r_p, agent=RecordingAgent())
        mgr.kv_args.gpu_id = 0
        before = len(sg.gather_kernel.calls)
        try:
            handle = mgr.send_kvcache_staged(
                "decode-0", pages, world.region_ptr, region, 1, world.r_d, world.tp_d,
                world.dst_item_len(), staging_buffer=mgr.staging)
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            return ("raise", exc)
    gathers = sg.gather_kernel.calls[before:]
    kinds = [(c["src_head_start"], c["num_heads"], c["page_size"],
              np.asarray(c["page_indices_np"]).tolist(), c["staging_buffer"] is mgr.staging)
             for c in gathers]
    # each run has a staging buffer of its own: sources as offsets into it
    base = mgr.staging.get_ptr()
    written = [(s - base, d, n) for s, d, n in mgr.agent.written()]
    return ("ok", handle is None, canonical(written), mgr.agent.descriptor_count(),
            kinds, mgr.agent.posted)


def _staged_case(sg: Any, rng: np.random.Generator) -> str:
    heads = int(rng.choice([1, 2, 8, 16]))
    tp_p, tp_d = (int(x) for x in rng.choice([1, 2, 4, 8], size=2))
    r_d = int(rng.integers(0, tp_d))
    r_p = int(rng.choice(asked(tp_p, tp_d, r_d)))
    page = int(rng.choice([1, 2, 4]))
    n = int(rng.integers(1, 6))
    pages = rng.choice(POOL_PAGES, size=n, replace=False).astype(np.int32)
    bad = rng.random() < 0.05
    if bad:
        pages[int(rng.integers(0, n))] = POOL_PAGES + int(rng.integers(0, 3))
    world = StagedWorld(sg, heads=heads, tp_p=tp_p, tp_d=tp_d, r_d=r_d, page=page,
                        src_pages=pages, dst_pages=pages, seed=int(rng.integers(0, 1 << 30)))
    region = world.region - (int(rng.integers(1, 64)) if rng.random() < 0.05 else 0)
    where = f"H={heads} TP {tp_p}->{tp_d} rank {r_p}->{r_d} page {page} pages {pages.tolist()}"
    orig = _call(sg, world, r_p, False, pages, region)
    new = _call(sg, world, r_p, True, pages, region)
    if bad:
        assert new[0] == "raise" and isinstance(new[1], kvplan.IndexBoundsError), (where, new)
        return "refused"
    assert orig[0] == "ok" and new[0] == "ok", (where, orig, new)
    assert new[1] == orig[1], where  # the same fall-back (None) or the same transfer
    assert new[2] == orig[2], where
    assert new[3] <= orig[3] and new[5] == orig[5], (where, new[3], orig[3])
    assert new[4] == orig[4], where  # the gather kernel called as SGLang calls it
    return "fallback" if orig[1] else "same"


@pytest.fixture(scope="module")
def staged_sweep(sg: Any) -> Counter[str]:
    rng = np.random.default_rng(5304)
    return Counter(_staged_case(sg, rng) for _ in range(CALLS))


def test_staged_descriptors_equal_sglang(staged_sweep: Counter[str]) -> None:
    assert sum(staged_sweep.values()) >= CALLS
    assert staged_sweep["same"] >= 0.8 * CALLS, staged_sweep
    assert staged_sweep["refused"] > 0 and staged_sweep["fallback"] > 0, staged_sweep


def test_staged_is_planned_by_kvplan(sg: Any) -> None:
    world = StagedWorld(sg, heads=8, tp_p=2, tp_d=4, r_d=3, page=2)
    compat.install(sg.nixl_cls)
    try:
        mgr = world.manager(sg.nixl_cls, 0, 1, agent=RecordingAgent())
        mgr.kv_args.gpu_id = 0
        mgr.send_kvcache_staged("decode-0", world.src_pages, world.region_ptr, world.region, 1,
                                3, 4, world.dst_item_len(), staging_buffer=mgr.staging)
        assert len(compat.template_cache(mgr)) == 1  # the staged template, cached per peer
        (op, src, dst, peer), = mgr.agent.transfers
        assert (op, peer, len(src)) == ("WRITE", "decode-0", 1)
        assert int(src[0, 0]) == mgr.staging.get_ptr() and int(dst[0, 0]) == world.region_ptr
    finally:
        compat.uninstall(sg.nixl_cls)


def test_a_page_past_the_pool_is_refused_before_the_gather(sg: Any) -> None:
    world = StagedWorld(sg, heads=8, tp_p=2, tp_d=4, r_d=3, page=2,
                        src_pages=(3, POOL_PAGES), dst_pages=(1, 2))
    compat.install(sg.nixl_cls)
    try:
        mgr = world.manager(sg.nixl_cls, 0, 1, agent=RecordingAgent())
        mgr.kv_args.gpu_id = 0
        before = len(sg.gather_kernel.calls)
        with pytest.raises(kvplan.IndexBoundsError):
            mgr.send_kvcache_staged("decode-0", world.src_pages, world.region_ptr,
                                    world.region, 1, 3, 4, world.dst_item_len(),
                                    staging_buffer=mgr.staging)
        assert len(sg.gather_kernel.calls) == before and not mgr.agent.transfers
    finally:
        compat.uninstall(sg.nixl_cls)


def test_prefill_pp_goes_to_sglangs_own_method(sg: Any) -> None:
    world = StagedWorld(sg, heads=8, tp_p=2, tp_d=4, r_d=3, page=2, pp=2)
    runs = []
    for patched in (False, True):
        if patched:
            compat.install(sg.nixl_cls)
        try:
            mgr = world.manager(sg.nixl_cls, 1, 1, agent=RecordingAgent())
            mgr.kv_args.gpu_id = 0
            mgr.send_kvcache_staged("decode-0", world.src_pages, world.region_ptr,
                                    world.region, 1, 3, 4, world.dst_item_len(),
                                    staging_buffer=mgr.staging)
            base = mgr.staging.get_ptr()
            runs.append([(s - base, d, n) for s, d, n in mgr.agent.written()])
            if patched:
                assert len(compat.template_cache(mgr)) == 0  # not planned by kvplan
        finally:
            if patched:
                compat.uninstall(sg.nixl_cls)
    assert runs[0] == runs[1] and runs[0]
