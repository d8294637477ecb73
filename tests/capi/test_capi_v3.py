"""Version 3 of the C ABI (``KvplanLayoutDesc3``, ``KvplanRequest3``, ``kvplan_layout_new3``,
``kvplan_prepare3``, ``kvplan_plan_into3``) through ctypes: a layout with pools of its own
(``Layout.with_pool``) and a request giving each pool's pages per side and each pool's own
token range plan the blocks ``Template.plan(kvplan.Request(pool_pages=, pool_tokens=))``
plans, block for block; every malformed descriptor or request is a status and a message naming
the values."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvplan

from support.capi import (
    ENTRY_PAGE,
    INVALID_ARGUMENT,
    NO_SLOT,
    NO_TOKENS,
    NULL_POINTER,
    OK,
    POOL_DST,
    POOL_SRC,
    LayoutDesc,
    LayoutDesc3,
    PlanInfo,
    Pool,
    PoolPages,
    PoolTokens,
    RequestDesc3,
)
from support.capi import error as _error
from support.capi import c_array, both_templates

u64p = ctypes.POINTER(ctypes.c_uint64)
TOKEN = 16  # bytes of one token of the request's pages
ROW = 24  # bytes of one row of a pool's entries
CAPACITY = 32  # pages of every buffer
LAYOUT = 13  # KvplanStatus of the core's layout errors
CORE = -2  # a case refused by the core, with the message Python's plan gives




@dataclass
class Peer:
    """Two entries on the request's pages (``page_size`` tokens of ``TOKEN`` bytes), then two
    per pool ``(page size, tokens per row)``, built the same way for Python and the C ABI."""

    base: int
    page_size: int
    pools: list[tuple[int, int]]
    windows: list[int | None] = field(default_factory=list)

    def items(self) -> list[int]:
        return [self.page_size * TOKEN] * 2 + [p // r * ROW for p, r in self.pools for _ in "ab"]

    def entry_pools(self) -> list[int]:
        return [0, 0] + [k + 1 for k in range(len(self.pools)) for _ in "ab"]

    def arrays(self) -> tuple[list[int], list[int], list[int]]:
        items = self.items()
        lens = [CAPACITY * i for i in items]
        ptrs = [self.base + k * (1 << 32) for k in range(len(items))]
        return ptrs, lens, items

    def python(self) -> kvplan.Layout:
        ptrs, lens, items = self.arrays()
        n = len(items)
        layout = kvplan.Layout(ptrs, lens, items, list(range(n)), ["kv"] * n,
                               page_size=self.page_size)
        if self.windows:
            layout = layout.with_windows(self.windows)
        for k, (page, per_row) in enumerate(self.pools):
            layout = layout.with_pool([2 + 2 * k, 3 + 2 * k], page, tokens_per_row=per_row)
        return layout

    def desc3(self) -> tuple[LayoutDesc3, list[object]]:
        """The C descriptor and the arrays it points to (kept alive by the caller)."""
        ptrs, lens, items = self.arrays()
        n = len(items)
        keep: list[object] = [
            c_array(ptrs, ctypes.c_uint64), c_array(lens, ctypes.c_uint64),
            c_array(items, ctypes.c_uint64), c_array(list(range(n)), ctypes.c_int64),
            (ctypes.c_char_p * n)(*[b"kv"] * n), c_array([ENTRY_PAGE] * n, ctypes.c_uint8),
            c_array([w or 0 for w in self.windows], ctypes.c_uint64),
            (Pool * max(len(self.pools), 1))(*[Pool(p, r) for p, r in self.pools]),
            c_array(self.entry_pools(), ctypes.c_uint8),
        ]
        addr = [ctypes.addressof(a) for a in keep]  # type: ignore[arg-type]
        base = LayoutDesc(n, addr[0], addr[1], addr[2], None, addr[3], addr[4], addr[5],
                          self.page_size, 0, 1, 0, 1, None)
        desc = LayoutDesc3(ctypes.sizeof(LayoutDesc3), base, addr[6] if self.windows else None,
                           None, addr[7], len(self.pools), addr[8])
        return desc, keep

    def c(self, lib: ctypes.CDLL) -> ctypes.c_void_p:
        desc, _keep = self.desc3()
        handle = ctypes.c_void_p()
        status = lib.kvplan_layout_new3(ctypes.byref(desc), ctypes.byref(handle))
        assert status == OK, _error(lib)
        return handle



@dataclass
class CRequest:
    """A ``KvplanRequest3`` and the arrays it points to."""

    src: list[int]
    dst: list[int]
    n_tokens: int | None = None
    skip_tokens: int = 0
    pool_pages: dict[int, tuple[list[int] | None, list[int] | None]] = field(
        default_factory=dict)
    pool_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)

    def desc(self) -> tuple[RequestDesc3, list[object]]:
        keep: list[object] = [c_array(self.src, ctypes.c_int64), c_array(self.dst, ctypes.c_int64)]
        pages = []
        for pool, (s, d) in self.pool_pages.items():
            sa, da = c_array(s or [], ctypes.c_int64), c_array(d or [], ctypes.c_int64)
            keep += [sa, da]
            sides = (POOL_SRC if s is not None else 0) | (POOL_DST if d is not None else 0)
            pages.append(PoolPages(pool, sides, ctypes.addressof(sa), len(s or []),
                                   ctypes.addressof(da), len(d or [])))
        tokens = [PoolTokens(pool, n, skip) for pool, (n, skip) in self.pool_tokens.items()]
        page_table = (PoolPages * max(len(pages), 1))(*pages)
        token_table = (PoolTokens * max(len(tokens), 1))(*tokens)
        keep += [page_table, token_table]
        desc = RequestDesc3(
            ctypes.sizeof(RequestDesc3), ctypes.addressof(keep[0]), len(self.src),  # type: ignore[arg-type]
            ctypes.addressof(keep[1]), len(self.dst),  # type: ignore[arg-type]
            NO_TOKENS if self.n_tokens is None else self.n_tokens, self.skip_tokens,
            NO_SLOT, NO_SLOT, ctypes.addressof(page_table), len(pages),
            ctypes.addressof(token_table), len(tokens))
        return desc, keep

    def python(self) -> kvplan.Request:
        def arr(v: list[int] | None) -> np.ndarray | None:
            return None if v is None else np.array(v, dtype=np.int64)
        return kvplan.Request(
            np.array(self.src, dtype=np.int64), np.array(self.dst, dtype=np.int64),
            n_tokens=self.n_tokens, skip_tokens=self.skip_tokens,
            pool_pages={p: (arr(s), arr(d)) for p, (s, d) in self.pool_pages.items()} or None,
            pool_tokens=self.pool_tokens or None)


def _plan3(lib: ctypes.CDLL, template: ctypes.c_void_p, desc: RequestDesc3
           ) -> tuple[int, str, np.ndarray | None]:
    info = PlanInfo()
    status = lib.kvplan_prepare3(template, ctypes.byref(desc), ctypes.byref(info))
    if status != OK:
        return status, _error(lib), None
    n = info.n_blocks
    out = np.zeros((3, n + 1), dtype=np.uint64)
    cols = [out[i].ctypes.data_as(u64p) for i in range(3)]
    status = lib.kvplan_plan_into3(template, ctypes.byref(desc), *cols, ctypes.c_size_t(n),
                                   ctypes.byref(info))
    assert status == OK, _error(lib)
    assert info.n_blocks == n and not out[:, n].any(), "the C ABI wrote past the plan's blocks"
    return status, "", out[:, :n]


def _compare(lib: ctypes.CDLL, py: kvplan.Template, c: ctypes.c_void_p,
             request: CRequest) -> int:
    desc, _keep = request.desc()
    status, message, blocks = _plan3(lib, c, desc)
    try:
        plan = py.plan(request.python())
    except kvplan.KvPlanError as err:
        assert status != OK, f"Python refused ({err}) but the C ABI planned"
        assert message == str(err)
        return -1
    assert status == OK, f"the C ABI refused ({message}) but Python planned"
    assert blocks is not None
    np.testing.assert_array_equal(blocks[0], plan.src_addrs)
    np.testing.assert_array_equal(blocks[1], plan.dst_addrs)
    np.testing.assert_array_equal(blocks[2], plan.lengths)
    return int(blocks.shape[1])


def test_abi_version_is_3_or_later(lib: ctypes.CDLL) -> None:
    assert lib.kvplan_abi_version() >= 3


def _pages(rng: np.random.Generator, tokens: int, page_size: int) -> list[int]:
    n = -(-tokens // page_size)
    if rng.random() < 0.015 and n > 0:
        n -= 1  # too few: both refuse, naming the pool and side
    return [int(p) for p in rng.permutation(CAPACITY)[:n]]


def test_pooled_requests_plan_the_blocks_python_plans(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(20261206)
    planned = refused = 0
    for case in range(260):
        n_pools = int(rng.integers(1, 4))
        rows = [int(rng.choice([1, 2, 4])) for _ in range(n_pools)]
        peers = []
        for side in range(2):
            pools = [(r * int(rng.choice([1, 2, 4])), r) for r in rows]
            page_size = int(rng.choice([2, 4, 8]))
            peer = Peer((1 + side) << 44, page_size, pools)
            if rng.random() < 0.2:
                # A window on the first entry of pool 1 (one-token rows: a window pool).
                peer.pools[0] = (peer.pools[0][0] // peer.pools[0][1], 1)
                peer.windows = [None] * len(peer.items())
                peer.windows[2] = 4
            peers.append(peer)
        if peers[0].windows != peers[1].windows or any(
                a[1] != b[1] for a, b in zip(peers[0].pools, peers[1].pools)):
            peers[1].windows = list(peers[0].windows)
            peers[1].pools = [(p // r * a[1], a[1]) for (p, r), a in
                              zip(peers[1].pools, peers[0].pools)]
        py, c, _ = both_templates(lib, *peers)
        assert py is not None and c is not None
        max_tokens = CAPACITY * min(min(p.page_size, *(q for q, _ in p.pools)) for p in peers)
        n = int(rng.integers(1, max_tokens))
        skip = int(rng.integers(0, n)) if rng.random() < 0.3 else 0
        request = CRequest(_pages(rng, n, peers[0].page_size), _pages(rng, n, peers[1].page_size),
                           n_tokens=n, skip_tokens=skip)
        for k in range(n_pools):
            pool = k + 1
            tokens = n
            if rng.random() < 0.3:
                tokens = int(rng.integers(0, n + 1))
                request.pool_tokens[pool] = (tokens, int(rng.integers(0, tokens + 1)))
            request.pool_pages[pool] = (_pages(rng, tokens, peers[0].pools[k][0]),
                                        _pages(rng, tokens, peers[1].pools[k][0]))
        got = _compare(lib, py, c, request)
        planned, refused = planned + (got >= 0), refused + (got < 0)
        assert lib.kvplan_template_free(c) == OK, case
    assert planned >= 200 and refused > 0, (planned, refused)


def _pooled_pair(lib: ctypes.CDLL) -> tuple[kvplan.Template, ctypes.c_void_p]:
    src, dst = Peer(1 << 44, 4, [(8, 4), (4, 1)]), Peer(2 << 44, 4, [(8, 4), (4, 1)])
    py, c, _ = both_templates(lib, src, dst)
    assert py is not None and c is not None
    return py, c


def _good() -> CRequest:
    return CRequest([0, 1, 2, 3], [4, 5, 6, 7], n_tokens=16,
                    pool_pages={1: ([0, 1], [2, 3]), 2: ([0, 1, 2, 3], [4, 5, 6, 7])})


def test_a_good_request_plans(lib: ctypes.CDLL) -> None:
    py, c = _pooled_pair(lib)
    assert _compare(lib, py, c, _good()) > 0


@pytest.mark.parametrize(("edit", "status", "needles"), [
    (lambda r: r.pool_pages.update({8: ([0], [0])}), INVALID_ARGUMENT,
     ["pool_pages[2].pool is 8; a request's pools are 1 to 7"]),
    (lambda r: r.pool_pages.update({0: ([0], [0])}), INVALID_ARGUMENT,
     ["pool_pages[2].pool is 0"]),
    (lambda r: r.pool_tokens.update({9: (4, 0)}), INVALID_ARGUMENT,
     ["pool_tokens[0].pool is 9"]),
    # The core's refusals: the message Python's plan gives.
    (lambda r: r.pool_pages.update({1: ([0], [2, 3])}), CORE,
     ["n_tokens 16 needs 2 src pool 1 pages of 8 tokens, but 1 were given"]),
    (lambda r: r.pool_pages.update({3: ([0], [0])}), CORE, ["pool 3"]),
    (lambda r: r.pool_tokens.update({1: (4, 5)}), -1,
     ["pool_tokens of pool 1: skip_tokens 5 is past its n_tokens 4"]),
])
def test_bad_pools_are_refused_naming_the_values(lib: ctypes.CDLL, edit, status: int,  # type: ignore[no-untyped-def]
                                                 needles: list[str]) -> None:
    py, c = _pooled_pair(lib)
    request = _good()
    edit(request)
    desc, _keep = request.desc()
    got, message, _ = _plan3(lib, c, desc)
    assert got != OK and (status in (-1, CORE) or got == status), (got, message)
    for needle in needles:
        assert needle in message, message
    if status == CORE:
        with pytest.raises(kvplan.KvPlanError) as err:
            py.plan(request.python())
        assert str(err.value) == message


def _status(lib: ctypes.CDLL, c: ctypes.c_void_p, desc: RequestDesc3) -> tuple[int, str]:
    info = PlanInfo()
    status = lib.kvplan_prepare3(c, ctypes.byref(desc), ctypes.byref(info))
    return status, _error(lib) if status != OK else ""


def test_malformed_request_structs_are_refused(lib: ctypes.CDLL) -> None:
    _, c = _pooled_pair(lib)
    desc, keep = _good().desc()
    table = keep[-2]

    def check(what: str, status: int, needle: str) -> None:
        got, message = _status(lib, c, desc)
        assert got == status and needle in message, (what, got, message)

    desc.struct_size -= 8
    check("size", INVALID_ARGUMENT, "request->struct_size is")
    desc.struct_size += 8
    table[1].pool = 1  # type: ignore[index]
    check("twice", INVALID_ARGUMENT, "pool_pages gives pool 1 twice (pool_pages[1])")
    table[1].pool = 2  # type: ignore[index]
    table[0].sides = 4  # type: ignore[index]
    check("sides", INVALID_ARGUMENT, "pool_pages[0].sides is 0x4")
    table[0].sides = POOL_DST  # type: ignore[index]
    check("no bit", INVALID_ARGUMENT,
          "pool_pages[0].src_pages holds 2 values, but pool_pages[0].sides (0x2) does not give")
    table[0].sides = POOL_SRC | POOL_DST  # type: ignore[index]
    table[0].src_pages = None  # type: ignore[index]
    check("null", NULL_POINTER, "pool_pages[0].src_pages")
    table[0].src_pages = ctypes.addressof(keep[2])  # type: ignore[index, arg-type]
    saved = desc.pool_pages
    desc.pool_pages = None
    check("null table", NULL_POINTER, "pool_pages")
    desc.pool_pages = saved
    desc.n_pool_pages = 8
    check("too many", INVALID_ARGUMENT, "n_pool_pages is 8; a request gives at most 7 pools")
    desc.n_pool_pages = 2
    assert _status(lib, c, desc) == (OK, "")


def test_outputs_overlapping_pool_inputs_are_refused(lib: ctypes.CDLL) -> None:
    _, c = _pooled_pair(lib)
    request = _good()
    request.pool_tokens = {1: (16, 0)}
    desc, keep = request.desc()
    info = PlanInfo()
    assert lib.kvplan_prepare3(c, ctypes.byref(desc), ctypes.byref(info)) == OK
    n = info.n_blocks
    out = np.zeros((3, n), dtype=np.uint64)
    cols = [out[i].ctypes.data_as(u64p) for i in range(3)]
    # A pool's pages, and the pool tables themselves, are inputs no column may cover.
    for target, name in [(keep[2], "pool_pages[0].src_pages"), (keep[-2], "pool_pages"),
                         (keep[-1], "pool_tokens")]:
        status = lib.kvplan_plan_into3(c, ctypes.byref(desc), ctypes.addressof(target),  # type: ignore[arg-type]
                                       cols[1], cols[2], ctypes.c_size_t(n), None)
        message = _error(lib)
        assert status == INVALID_ARGUMENT and "overlap" in message and name in message, message
    # The info overlapping a pool's pages.
    status = lib.kvplan_prepare3(c, ctypes.byref(desc), ctypes.addressof(keep[4]))  # type: ignore[arg-type]
    message = _error(lib)
    assert status == INVALID_ARGUMENT and "pool_pages[1].src_pages" in message, message
    assert lib.kvplan_plan_into3(c, ctypes.byref(desc), *cols, ctypes.c_size_t(n), None) == OK


def test_bad_layout_descriptors_are_refused(lib: ctypes.CDLL) -> None:
    peer = Peer(1 << 44, 4, [(8, 4), (4, 1)])

    def new(edit) -> tuple[int, str]:  # type: ignore[no-untyped-def]
        desc, keep = peer.desc3()
        edit(desc, keep)
        handle = ctypes.c_void_p()
        status = lib.kvplan_layout_new3(ctypes.byref(desc), ctypes.byref(handle))
        if status == OK:
            assert lib.kvplan_layout_free(handle) == OK
            return status, ""
        assert not handle.value
        return status, _error(lib)

    assert new(lambda d, k: None) == (OK, "")

    def out_of_range(d: LayoutDesc3, k: list[object]) -> None:
        k[8][5] = 3  # type: ignore[index]

    status, message = new(out_of_range)
    assert status == INVALID_ARGUMENT and "entry_pools[5] is 3, but the layout keeps 2 pools" \
        in message, message

    def too_many(d: LayoutDesc3, k: list[object]) -> None:
        d.n_pools = 8

    status, message = new(too_many)
    assert status == INVALID_ARGUMENT and "n_pools is 8" in message, message

    def zero_row(d: LayoutDesc3, k: list[object]) -> None:
        k[7][0].tokens_per_row = 3  # type: ignore[index]

    status, message = new(zero_row)
    assert status == LAYOUT and "pool 1: page_size must be a multiple of tokens_per_row, got " \
        "page_size 8, tokens_per_row 3" in message, message

    def null_pools(d: LayoutDesc3, k: list[object]) -> None:
        d.pools = None

    status, message = new(null_pools)
    assert status == NULL_POINTER and "pools" in message, message

    def short_size(d: LayoutDesc3, k: list[object]) -> None:
        d.struct_size = ctypes.sizeof(LayoutDesc3) - 8

    status, message = new(short_size)
    assert status == INVALID_ARGUMENT and "desc->struct_size" in message, message
