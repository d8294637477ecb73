"""kvplan's ``send_kvcache_dcp`` against SGLang 0.5.23's real method (real class, wheel code).

Each case runs SGLang's ``MooncakeKVManager.send_kvcache_dcp`` (which plans with its
``build_dcp_token_transfer_plan``) on a manager built without ``__init__`` and a recording
engine, then the same call with kvplan installed, and compares the byte maps (which source byte
each destination byte is written from; blocks may be merged differently) and the statuses.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from support.sglang_models import SESSION, engine_blocks, load_sglang_or_fail

SRC_BASE, DST_BASE, BUF = 1 << 20, 1 << 30, 1 << 18  # disjoint buffers, BUF bytes each


@pytest.fixture(scope="module")
def sg() -> Any:
    return load_sglang_or_fail()


def byte_map(blocks: list[tuple[int, int, int]]) -> dict[int, int]:
    """Destination byte -> source byte; a destination byte written twice fails."""
    out: dict[int, int] = {}
    for src, dst, length in blocks:
        for k in range(length):
            assert dst + k not in out, f"destination byte {dst + k:#x} written twice"
            out[dst + k] = src + k
    return out


def manager(sg: Any, cls: type, *, n_target: int, n_draft: int, page: int, widths: list[int],
            ids: bool) -> Any:
    n = n_target + n_draft
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=[SRC_BASE + i * BUF for i in range(n)],
        kv_data_lens=[BUF] * n,
        kv_item_lens=[w * page for w in widths],
        kv_layer_ids=list(range(n)) if ids else [],
        num_draft_entries=n_draft, page_size=page, prefill_start_layer=0, engine_rank=0)
    mgr = sg.manager_object(cls, kv_args=kv_args, is_mla_backend=True)
    mgr.seen = []
    return mgr


def call(mgr: Any, n: int, src_pages: np.ndarray, dst_pages: np.ndarray, *, size: int,
         rank: int, offset: int, prefix: int, tokens: int | None, ids: bool,
         dst_order: list[int] | None = None, dst_item_lens: list[int] | None = None) -> Any:
    order = dst_order if dst_order is not None else list(range(n))
    return mgr.send_kvcache_dcp(
        SESSION, src_pages, [DST_BASE + j * BUF for j in order], dst_pages,
        dcp_token_item_lens=[w // mgr.kv_args.page_size for w in mgr.kv_args.kv_item_lens],
        dst_dcp_size=size, dst_dcp_rank=rank, src_page_offset=offset, decode_prefix_len=prefix,
        num_kv_tokens=tokens, executor=None, dst_layer_ids=order if ids else [],
        dst_kv_item_lens=dst_item_lens)


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return ("raise", type(exc).__name__)


def run_both(sg: Any, cls: type, build: Any, send: Any) -> tuple[Any, Any]:
    """(status, byte map, blocks seen by _transfer_data) with SGLang's method, then kvplan's."""
    results = []
    for on in (False, True):
        if on:
            compat.install(cls)
        try:
            mgr = build()
            rc = outcome(lambda: send(mgr))
            results.append((rc, byte_map(engine_blocks(mgr.engine.calls)), mgr))
        finally:
            if on:
                compat.uninstall(cls)
    return results[0], results[1]


CASES = [  # (dcp size, page, tokens, target entries, draft entries, layer ids, chunk offset)
    (2, 2, 4, 1, 1, False, 0), (2, 2, 3, 2, 1, True, 0), (2, 4, 37, 3, 0, True, 2),
    (4, 1, 9, 2, 1, False, 0), (4, 4, 61, 2, 2, True, 4), (4, 2, 3, 1, 0, False, 0),
    (8, 1, 56, 3, 1, True, 8), (8, 4, 100, 2, 1, False, 0), (8, 2, 5, 1, 1, True, 0),
]


@pytest.mark.parametrize("size,page,tokens,n_target,n_draft,ids,offset", CASES)
def test_byte_maps_and_statuses_match_sglang(sg: Any, size: int, page: int, tokens: int,
                                             n_target: int, n_draft: int, ids: bool,
                                             offset: int) -> None:
    rng = np.random.default_rng(size * 1000 + tokens)
    widths = [int(w) for w in rng.choice([8, 16, 24], size=n_target)] + [16] * n_draft
    n_src_pages = -(-tokens // page)
    src = rng.choice(200, size=n_src_pages, replace=False).astype(np.int32)
    # decode pages after the prefix: enough for the draft rows (virtual pages) and target rows
    n_dst_pages = offset // size + -(-(offset * page + tokens) // page) + 1
    dst = rng.choice(400, size=n_dst_pages, replace=False).astype(np.int32)
    prefix = 2 * page * size
    n = n_target + n_draft
    for rank in range(size):
        def build() -> Any:
            return manager(sg, sg.MooncakeKVManager, n_target=n_target, n_draft=n_draft,
                           page=page, widths=widths, ids=ids)

        def send(mgr: Any) -> Any:
            return call(mgr, n, src, dst, size=size, rank=rank, offset=offset, prefix=prefix,
                        tokens=tokens, ids=ids)

        (rc_s, map_s, _), (rc_k, map_k, mgr_k) = run_both(sg, sg.MooncakeKVManager, build, send)
        assert rc_s == rc_k == ("ok", 0)
        assert map_k == map_s
        assert map_s or (n_draft == 0 and rank >= tokens)  # a rank the chunk deals nothing to
        assert isinstance(mgr_k._kvplan_templates, compat.TemplateCache)
        assert len(mgr_k._kvplan_templates) == 1  # planned by kvplan, not handed to SGLang


def test_decode_entries_in_another_order_pair_by_layer_id(sg: Any) -> None:
    page, size, tokens = 2, 4, 13
    src, dst = np.arange(7, dtype=np.int32), np.arange(10, 20, dtype=np.int32)
    for rank in range(size):
        (rc_s, map_s, _), (rc_k, map_k, _) = run_both(
            sg, sg.MooncakeKVManager,
            lambda: manager(sg, sg.MooncakeKVManager, n_target=3, n_draft=1, page=page,
                            widths=[8, 16, 8, 16], ids=True),
            lambda m: call(m, 4, src, dst, size=size, rank=rank, offset=0, prefix=0,
                           tokens=tokens, ids=True, dst_order=[3, 1, 0, 2]))
        assert rc_s == rc_k == ("ok", 0) and map_k == map_s and map_s


@pytest.mark.parametrize("kw,expected", [
    (dict(prefix=3, tokens=4), ("raise", "ValueError")),   # misaligned decode prefix
    (dict(prefix=0, tokens=None), ("raise", "ValueError")),  # no token count
    (dict(prefix=0, tokens=0), ("ok", 0)),                 # nothing to send
    (dict(prefix=0, tokens=4, offset=1), ("ok", 0)),       # chunk not on a virtual page
])
def test_sglang_statuses_and_errors_are_kept(sg: Any, kw: dict[str, Any], expected: Any) -> None:
    src, dst = np.array([5, 9], dtype=np.int32), np.array([2, 3, 4], dtype=np.int32)
    (rc_s, map_s, _), (rc_k, map_k, _) = run_both(
        sg, sg.MooncakeKVManager,
        lambda: manager(sg, sg.MooncakeKVManager, n_target=1, n_draft=1, page=2,
                        widths=[8, 8], ids=False),
        lambda m: call(m, 2, src, dst, size=2, rank=1, offset=kw.get("offset", 0),
                       prefix=kw["prefix"], tokens=kw["tokens"], ids=False))
    assert rc_s == rc_k == expected
    assert map_k == map_s


def test_too_few_decode_pages_is_a_typed_error(sg: Any) -> None:
    """SGLang indexes past the decode page list (numpy IndexError); kvplan names the shortage."""
    src, dst = np.arange(8, dtype=np.int32), np.array([1], dtype=np.int32)
    (rc_s, _, _), (rc_k, map_k, _) = run_both(
        sg, sg.MooncakeKVManager,
        lambda: manager(sg, sg.MooncakeKVManager, n_target=1, n_draft=0, page=2, widths=[8],
                        ids=False),
        lambda m: call(m, 1, src, dst, size=2, rank=0, offset=0, prefix=0, tokens=16,
                       ids=False))
    assert rc_s == ("raise", "IndexError")
    assert rc_k[0] == "raise" and rc_k[1] in ("KvPlanError", "IndexBoundsError")
    assert map_k == {}


def test_unpaired_prefill_entry_is_a_pairing_error(sg: Any) -> None:
    """A prefill layer the decode does not publish: kvplan refuses instead of pairing later
    entries with the wrong decode buffers."""
    compat.install(sg.MooncakeKVManager)
    try:
        mgr = manager(sg, sg.MooncakeKVManager, n_target=3, n_draft=0, page=2,
                      widths=[8, 8, 8], ids=True)
        with pytest.raises(kvplan.PairingError):
            mgr.send_kvcache_dcp(
                SESSION, np.arange(2, dtype=np.int32), [DST_BASE, DST_BASE + BUF],
                np.arange(4, dtype=np.int32), dcp_token_item_lens=[8, 8, 8], dst_dcp_size=2,
                dst_dcp_rank=0, src_page_offset=0, decode_prefix_len=0, num_kv_tokens=4,
                executor=None, dst_layer_ids=[0, 2])
        assert mgr.engine.calls == []
    finally:
        compat.uninstall(sg.MooncakeKVManager)


def test_install_uninstall_restore_send_kvcache_dcp_exactly(sg: Any) -> None:
    cls = sg.MooncakeKVManager
    before = dict(vars(cls))
    original = cls.__dict__["send_kvcache_dcp"]
    assert "send_kvcache_dcp" in compat.install(cls)
    assert cls.__dict__["send_kvcache_dcp"] is not original
    assert "send_kvcache_dcp" in compat.uninstall(cls)
    assert dict(vars(cls)) == before
    assert "send_kvcache_dcp" not in sg.AscendKVManager.__dict__ or (
        "send_kvcache_dcp" not in compat.REPLACED_METHODS["AscendKVManager"])


def test_subclass_overriding_transfer_data_sees_the_blocks(sg: Any) -> None:
    """SGLang's method hands its one block list to ``self._transfer_data``; so does kvplan's."""
    def _transfer_data(self: Any, session: str, blocks: Any) -> int:
        self.seen.append(list(blocks))
        return 0

    cls = type("TracingManager", (sg.MooncakeKVManager,), {"_transfer_data": _transfer_data})
    src, dst = np.arange(5, dtype=np.int32), np.arange(20, 30, dtype=np.int32)
    (rc_s, _, mgr_s), (rc_k, _, mgr_k) = run_both(
        sg, cls,
        lambda: manager(sg, cls, n_target=2, n_draft=1, page=2, widths=[8, 16, 8], ids=True),
        lambda m: call(m, 3, src, dst, size=4, rank=3, offset=0, prefix=0, tokens=10,
                       ids=True))
    assert rc_s == rc_k == ("ok", 0)
    assert len(mgr_s.seen) == len(mgr_k.seen) == 1
    assert byte_map(mgr_k.seen[0]) == byte_map(mgr_s.seen[0]) and mgr_s.seen[0]
    assert mgr_s.engine.calls == mgr_k.engine.calls == []


def test_override_sees_the_empty_list_for_a_rank_the_chunk_deals_nothing_to(sg: Any) -> None:
    """A decode rank with no token of the chunk: SGLang still calls ``_transfer_data`` (with an
    empty list), so an override sees that call with kvplan installed too."""
    def _transfer_data(self: Any, session: str, blocks: Any) -> int:
        self.seen.append(list(blocks))
        return 0

    cls = type("TracingManager", (sg.MooncakeKVManager,), {"_transfer_data": _transfer_data})
    src, dst = np.arange(2, dtype=np.int32), np.arange(20, 30, dtype=np.int32)
    (rc_s, _, mgr_s), (rc_k, _, mgr_k) = run_both(
        sg, cls,
        lambda: manager(sg, cls, n_target=2, n_draft=0, page=2, widths=[8, 16], ids=True),
        lambda m: call(m, 2, src, dst, size=4, rank=3, offset=0, prefix=0, tokens=3, ids=True))
    assert rc_s == rc_k == ("ok", 0)
    assert mgr_s.seen == mgr_k.seen == [[]]
    assert mgr_s.engine.calls == mgr_k.engine.calls == []


def test_sglang_dcp_code_runs_from_the_wheel_without_stand_ins(sg: Any) -> None:
    """The method and its planner are the wheel's, and nothing they reach is a stand-in."""
    visited = sg.verify_closure()
    for name in ("mooncake.conn.MooncakeKVManager.send_kvcache_dcp",
                 "common.utils.build_dcp_token_transfer_plan",
                 "utils.resolve_dcp_dst_entry_indices"):
        assert f"sglang.srt.disaggregation.{name}" in visited


# --------------------------------------------------------------------------------------------
# With a pack buffer: SGLang's kernel gathers (on host memory here), kvplan plans
# --------------------------------------------------------------------------------------------
PACK_BASE = 1 << 34


def run_packed(sg: Any, *, size: int, rank: int, page: int, tokens: int, widths: list[int],
               n_draft: int, pack_bytes: int, src: np.ndarray, dst: np.ndarray, offset: int,
               seed: int) -> list[tuple[Any, dict[int, int], dict[int, bytes], Any]]:
    """(status, network byte map, decode pools and pack buffer bytes, manager) with SGLang's
    method, then kvplan's, each on fresh host memory filled from ``seed``."""
    from support.sglang_loader import HostMemory, HostPackBuffer, load_dcp_pack

    mod = load_dcp_pack(sg)
    kernel = mod.copy_mla_rows_into_pack
    n = len(widths)
    results = []
    for on in (False, True):
        calls: list[tuple[Any, ...]] = []

        def recording(ptrs: Any, rows: Any, pack: Any, lens: Any, src_lens: Any = None,
                      calls: list[tuple[Any, ...]] = calls) -> None:
            calls.append(([int(p) for p in ptrs], [int(r) for r in rows], pack.addr,
                          [int(w) for w in lens], src_lens))
            kernel(ptrs, rows, pack, lens, src_lens)

        memory = HostMemory()
        rng = np.random.default_rng(seed)
        for i in range(n):
            memory.add(SRC_BASE + i * BUF, rng.integers(0, 256, BUF, dtype=np.uint8))
            memory.add(DST_BASE + i * BUF, np.zeros(BUF, dtype=np.uint8))
        pack = HostPackBuffer(PACK_BASE, pack_bytes, memory)
        mod.copy_mla_rows_into_pack = recording
        if on:
            compat.install(sg.MooncakeKVManager)
        try:
            mgr = manager(sg, sg.MooncakeKVManager, n_target=n - n_draft, n_draft=n_draft,
                          page=page, widths=widths, ids=True)
            rc = outcome(lambda: mgr.send_kvcache_dcp(
                SESSION, src, [DST_BASE + j * BUF for j in range(n)], dst,
                dcp_token_item_lens=[w // page for w in mgr.kv_args.kv_item_lens],
                dst_dcp_size=size, dst_dcp_rank=rank, src_page_offset=offset,
                decode_prefix_len=0, num_kv_tokens=tokens, executor=None,
                dst_layer_ids=list(range(n)), pack_buffer=pack))
        finally:
            mod.copy_mla_rows_into_pack = kernel
            if on:
                compat.uninstall(sg.MooncakeKVManager)
        mgr.kernel_calls = calls
        blocks = engine_blocks(mgr.engine.calls)
        memory.apply(blocks)
        pools = {base: bytes(memory.regions[base]) for base in
                 [DST_BASE + j * BUF for j in range(n)] + [PACK_BASE]}
        results.append((rc, byte_map(blocks), pools, mgr))
    return results


PACKED_CASES = [  # (dcp size, page, tokens, widths of the target entries, chunk offset)
    (2, 2, 9, [8, 16], 0), (2, 4, 37, [24, 8, 16], 2), (4, 1, 13, [16], 0),
    (4, 4, 61, [8, 24], 4), (8, 1, 56, [8, 16, 8], 8), (8, 2, 5, [16, 8], 0),
]


@pytest.mark.parametrize("size,page,tokens,widths,offset", PACKED_CASES)
def test_pack_buffer_kvplan_plans_sglangs_kernel_gathers(sg: Any, size: int, page: int,
                                                         tokens: int, widths: list[int],
                                                         offset: int) -> None:
    rng = np.random.default_rng(size * 100 + tokens)
    src = rng.choice(200, size=-(-tokens // page), replace=False).astype(np.int32)
    dst = rng.choice(400, size=offset // size + -(-tokens // page) + 1,
                     replace=False).astype(np.int32)
    for rank in range(size):
        (rc_s, map_s, pools_s, mgr_s), (rc_k, map_k, pools_k, mgr_k) = run_packed(
            sg, size=size, rank=rank, page=page, tokens=tokens, widths=widths, n_draft=0,
            pack_bytes=1 << 16, src=src, dst=dst, offset=offset, seed=rank)
        assert rc_s == rc_k == ("ok", 0)
        # the kernel is given the same source pointers, rows, pack slice and widths
        assert mgr_k.kernel_calls == mgr_s.kernel_calls
        assert len(mgr_s.kernel_calls) == (1 if rank < tokens else 0)
        assert map_k == map_s  # network: the same pack bytes to the same decode bytes
        assert pools_k == pools_s  # decode pools and the pack buffer the kernel filled
        assert len(mgr_k._kvplan_templates) == 1  # planned by kvplan, not handed to SGLang
        if rank < tokens:  # the rank holds tokens of the chunk: they went through the pack
            assert map_s and all(PACK_BASE <= s < PACK_BASE + (1 << 16)
                                 for s in map_s.values())
            assert any(pools_s[PACK_BASE])


@pytest.mark.parametrize("size", [2, 4, 8])
def test_too_small_pack_buffer_falls_back_per_token_like_sglang(sg: Any, size: int) -> None:
    page, tokens, widths = 2, 40, [8, 16]
    src = np.arange(20, dtype=np.int32)
    dst = np.arange(100, 130, dtype=np.int32)
    for rank in range(size):
        (rc_s, map_s, pools_s, _), (rc_k, map_k, pools_k, mgr_k) = run_packed(
            sg, size=size, rank=rank, page=page, tokens=tokens, widths=widths, n_draft=0,
            pack_bytes=16, src=src, dst=dst, offset=0, seed=rank)
        assert rc_s == rc_k == ("ok", 0)
        assert map_k == map_s and pools_k == pools_s
        assert map_s and all(SRC_BASE <= s < DST_BASE for s in map_s.values())  # per token


def test_pack_buffer_with_draft_rows_is_sglangs(sg: Any) -> None:
    """kvplan packs draft rows too, SGLang sends them unpacked: the layouts differ, so
    SGLang's method runs (byte-identical by construction, checked here)."""
    src, dst = np.arange(8, dtype=np.int32), np.arange(100, 120, dtype=np.int32)
    for rank in range(4):
        (rc_s, map_s, pools_s, _), (rc_k, map_k, pools_k, mgr_k) = run_packed(
            sg, size=4, rank=rank, page=2, tokens=15, widths=[8, 16, 16], n_draft=1,
            pack_bytes=1 << 16, src=src, dst=dst, offset=0, seed=rank)
        assert rc_s == rc_k == ("ok", 0) and map_k == map_s and pools_k == pools_s and map_s
        assert not getattr(mgr_k, "_kvplan_templates", None)


def test_pack_buffer_subclass_overriding_transfer_data_sees_the_network_blocks(sg: Any) -> None:
    """With a pack buffer SGLang hands its one block list (out of the pack buffer) to
    ``self._transfer_data``; so does kvplan's."""
    from support.sglang_loader import HostPackBuffer, load_dcp_pack

    load_dcp_pack(sg)

    def _transfer_data(self: Any, session: str, blocks: Any) -> int:
        self.seen.append(list(blocks))
        return 0

    cls = type("TracingManager", (sg.MooncakeKVManager,), {"_transfer_data": _transfer_data})
    src, dst = np.arange(5, dtype=np.int32), np.arange(20, 30, dtype=np.int32)
    seen = []
    for on in (False, True):
        if on:
            compat.install(cls)
        try:
            mgr = manager(sg, cls, n_target=2, n_draft=0, page=2, widths=[8, 16], ids=True)
            rc = mgr.send_kvcache_dcp(
                SESSION, src, [DST_BASE, DST_BASE + BUF], dst, dcp_token_item_lens=[4, 8],
                dst_dcp_size=4, dst_dcp_rank=1, src_page_offset=0, decode_prefix_len=0,
                num_kv_tokens=10, executor=None, dst_layer_ids=[0, 1],
                pack_buffer=HostPackBuffer(PACK_BASE, 1 << 12))
        finally:
            if on:
                compat.uninstall(cls)
        assert rc == 0 and mgr.engine.calls == [] and len(mgr.seen) == 1
        seen.append(mgr.seen[0])
    assert byte_map(seen[1]) == byte_map(seen[0]) and seen[0]
    assert all(PACK_BASE <= s < PACK_BASE + (1 << 12) for s, _, _ in seen[1])
