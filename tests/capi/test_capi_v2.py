"""Version 2 of the C ABI (``KvplanRequest2``, ``KvplanLayoutDesc2``, ``kvplan_prepare2``,
``kvplan_plan_into2``, ``kvplan_layout_new2``) through ctypes: a C caller gives everything a
``kvplan.Request`` gives (a state slot pair with ring rows, window pool pages per side, the
token range) and gets the blocks ``Template.plan(kvplan.Request(...))`` plans, block for block;
version 1 callers plan as before; every malformed request or descriptor is a status and a
message naming the values."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvplan

from support.capi import (
    ENTRY_PAGE,
    ENTRY_STATE,
    INVALID_ARGUMENT,
    NO_SLOT,
    NO_TOKENS,
    NULL_POINTER,
    OK,
    WINDOW_DST,
    WINDOW_SRC,
    LayoutDesc,
    LayoutDesc2,
    PlanInfo,
    RequestDesc,
    RequestDesc2,
)
from support.capi import error as _error
from support.capi import c_array

u64p = ctypes.POINTER(ctypes.c_uint64)
TOKEN = 16  # bytes of one token in every page entry below




@dataclass
class Peer:
    """One peer's entries, built the same way for Python and for the C ABI."""

    base: int
    page_size: int
    window_page_size: int | None = None
    ptrs: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    items: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    windows: list[int | None] = field(default_factory=list)
    rings: list[int | None] = field(default_factory=list)

    def add(self, layer: int, role: str, item: int, n_items: int, *, kind: str = "page",
            window: int | None = None, ring: int | None = None) -> Peer:
        self.ptrs.append(self.base + len(self.ptrs) * (1 << 32))
        self.lens.append(item * n_items)
        self.items.append(item)
        self.ids.append(layer)
        self.roles.append(role)
        self.kinds.append(kind)
        self.windows.append(window)
        self.rings.append(ring)
        return self

    def python(self) -> kvplan.Layout:
        windows = self.windows if any(w is not None for w in self.windows) else None
        rings = self.rings if any(r is not None for r in self.rings) else None
        return kvplan.Layout(self.ptrs, self.lens, self.items, self.ids, self.roles,
                             kinds=self.kinds, windows=windows,
                             window_page_size=self.window_page_size, rings=rings,
                             page_size=self.page_size)

    def desc2(self) -> tuple[LayoutDesc2, list[object]]:
        """The C descriptor and the arrays it points to (kept alive by the caller)."""
        n = len(self.ptrs)
        keep: list[object] = [
            c_array(self.ptrs, ctypes.c_uint64), c_array(self.lens, ctypes.c_uint64),
            c_array(self.items, ctypes.c_uint64), c_array(self.ids, ctypes.c_int64),
            (ctypes.c_char_p * n)(*[r.encode() for r in self.roles]),
            c_array([ENTRY_STATE if k == "state" else ENTRY_PAGE for k in self.kinds],
                 ctypes.c_uint8),
            c_array([w or 0 for w in self.windows], ctypes.c_uint64),
            c_array([r or 0 for r in self.rings], ctypes.c_uint64),
        ]
        addr = [ctypes.addressof(a) for a in keep]  # type: ignore[arg-type]
        base = LayoutDesc(n, addr[0], addr[1], addr[2], None, addr[3], addr[4], addr[5],
                          self.page_size, 0, 1, 0, 1, None)
        has_windows = any(w is not None for w in self.windows)
        has_rings = any(r is not None for r in self.rings)
        desc = LayoutDesc2(ctypes.sizeof(LayoutDesc2), base, addr[6] if has_windows else None,
                           self.window_page_size or 0, addr[7] if has_rings else None)
        return desc, keep

    def c(self, lib: ctypes.CDLL) -> ctypes.c_void_p:
        desc, _keep = self.desc2()
        handle = ctypes.c_void_p()
        status = lib.kvplan_layout_new2(ctypes.byref(desc), ctypes.byref(handle))
        assert status == OK, _error(lib)
        return handle


def _templates(lib: ctypes.CDLL, src: Peer, dst: Peer) -> tuple[kvplan.Template, ctypes.c_void_p]:
    s, d = src.c(lib), dst.c(lib)
    template = ctypes.c_void_p()
    status = lib.kvplan_template_new(s, d, None, ctypes.byref(template))
    assert status == OK, _error(lib)
    assert lib.kvplan_layout_free(s) == OK and lib.kvplan_layout_free(d) == OK
    return kvplan.Template(src.python(), dst.python()), template


@dataclass
class CRequest:
    """A ``KvplanRequest2`` and the arrays it points to."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    n_tokens: int | None = None
    skip_tokens: int = 0
    slot: tuple[int, int] | None = None
    window_pages: tuple[list[int] | None, list[int] | None] | None = None

    def desc(self) -> tuple[RequestDesc2, list[object]]:
        src_w, dst_w = self.window_pages or (None, None)
        arrays = [c_array(v or [], ctypes.c_int64) for v in (self.src, self.dst, src_w, dst_w)]
        addr = [ctypes.addressof(a) for a in arrays]
        sides = (WINDOW_SRC if src_w is not None else 0) | (WINDOW_DST if dst_w is not None else 0)
        s_slot, d_slot = self.slot if self.slot is not None else (NO_SLOT, NO_SLOT)
        desc = RequestDesc2(
            ctypes.sizeof(RequestDesc2), addr[0], len(self.src), addr[1], len(self.dst),
            NO_TOKENS if self.n_tokens is None else self.n_tokens, self.skip_tokens,
            s_slot, d_slot, sides, addr[2], len(src_w or []), addr[3], len(dst_w or []))
        return desc, list(arrays)

    def gives_pages(self) -> bool:
        return bool(self.src or self.dst) or self.window_pages is not None

    def python(self) -> kvplan.Request:
        if self.slot is not None and not self.gives_pages():
            return kvplan.Request(slot=self.slot, n_tokens=self.n_tokens,
                                  skip_tokens=self.skip_tokens)
        window = None
        if self.window_pages is not None:
            window = tuple(None if w is None else np.array(w, dtype=np.int64)
                           for w in self.window_pages)
        # Pages with slots: a hybrid model's whole request.
        return kvplan.Request(np.array(self.src, dtype=np.int64),
                              np.array(self.dst, dtype=np.int64), window_pages=window,
                              slot=self.slot, n_tokens=self.n_tokens,
                              skip_tokens=self.skip_tokens)


def _plan2(lib: ctypes.CDLL, template: ctypes.c_void_p, desc: RequestDesc2
           ) -> tuple[int, str, np.ndarray | None]:
    info = PlanInfo()
    status = lib.kvplan_prepare2(template, ctypes.byref(desc), ctypes.byref(info))
    if status != OK:
        return status, _error(lib), None
    n = info.n_blocks
    out = np.zeros((3, n + 1), dtype=np.uint64)
    cols = [out[i].ctypes.data_as(u64p) for i in range(3)]
    status = lib.kvplan_plan_into2(template, ctypes.byref(desc), *cols, ctypes.c_size_t(n),
                                   ctypes.byref(info))
    assert status == OK, _error(lib)
    assert info.n_blocks == n and not out[:, n].any(), "the C ABI wrote past the plan's blocks"
    return status, "", out[:, :n]


def _compare(lib: ctypes.CDLL, py: kvplan.Template, c: ctypes.c_void_p,
             request: CRequest) -> int:
    desc, _keep = request.desc()
    status, message, blocks = _plan2(lib, c, desc)
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


ROW = 64


def _hybrid(base: int, ring: int) -> Peer:
    """Two KV layers, a plain state entry (one 128-byte slot per request, 3 slots) and a ring
    state entry (`ring` rows of 64 bytes per slot, 3 slots)."""
    peer = Peer(base, page_size=4)
    for layer in (0, 1):
        for role in ("k", "v"):
            peer.add(layer, role, 4 * TOKEN, 32)
    peer.add(0, "conv", 128, 3, kind="state")
    peer.add(0, "ring", ROW, 3 * ring, kind="state", ring=ring)
    return peer


def test_abi_version_is_2_or_later(lib: ctypes.CDLL) -> None:
    assert lib.kvplan_abi_version() >= 2


def test_slot_request_equals_python_request(lib: ctypes.CDLL) -> None:
    py, c = _templates(lib, _hybrid(1 << 40, 2), _hybrid(1 << 50, 4))
    for s, d in [(0, 0), (1, 2), (2, 1)]:
        # The plain slot alone, then with the ring rows of the last positions.
        assert _compare(lib, py, c, CRequest(slot=(s, d))) == 1
        for n in (0, 1, 3, 7):
            blocks = _compare(lib, py, c, CRequest(slot=(s, d), n_tokens=n))
            assert blocks >= 1 + min(n, 1)
    # A slot outside the decode's buffers: the core's refusal, word for word.
    assert _compare(lib, py, c, CRequest(slot=(0, 3))) == -1
    assert lib.kvplan_template_free(c) == OK


def test_pages_with_slots_plan_the_pages_then_the_slots(lib: ctypes.CDLL) -> None:
    """A request struct with pages and both slots is a hybrid model's whole request: the
    blocks Python's ``Request(src, dst, slot=...)`` plans, which are the page plan of the same
    pages followed by the slot request's plan (ring rows of the last ``n_tokens`` positions)."""
    py, c = _templates(lib, _hybrid(1 << 40, 2), _hybrid(1 << 50, 4))
    rng = np.random.default_rng(11)
    for n_tokens in (None, 0, 1, 5, 8, 12):
        for s, d in [(0, 0), (1, 2), (2, 1)]:
            src, dst = rng.permutation(32)[:3].tolist(), rng.permutation(32)[:3].tolist()
            whole = CRequest(src, dst, n_tokens, slot=(s, d))
            n = _compare(lib, py, c, whole)
            desc, _keep = whole.desc()
            _, _, blocks = _plan2(lib, c, desc)
            desc_pages, _keep_p = CRequest(src, dst, n_tokens).desc()
            desc_slot, _keep_s = CRequest(slot=(s, d), n_tokens=n_tokens).desc()
            _, _, pages = _plan2(lib, c, desc_pages)
            _, _, state = _plan2(lib, c, desc_slot)
            assert blocks is not None and pages is not None and state is not None
            assert n == pages.shape[1] + state.shape[1] and state.shape[1] >= 1
            np.testing.assert_array_equal(blocks, np.concatenate([pages, state], axis=1))
    # A slot past the decode's buffers with good pages: the core's refusal, as Python's.
    assert _compare(lib, py, c, CRequest([0, 1], [2, 3], slot=(0, 3))) == -1
    # Slots without pages stay a slot request (its n_tokens are ring positions only).
    assert _compare(lib, py, c, CRequest(slot=(1, 1), n_tokens=40)) >= 1
    assert lib.kvplan_template_free(c) == OK


def test_window_pool_request_equals_python_request(lib: ctypes.CDLL) -> None:
    def peer(base: int, window_page_size: int) -> Peer:
        p = Peer(base, page_size=4, window_page_size=window_page_size)
        for role in ("k", "v"):
            p.add(0, role, 4 * TOKEN, 32)
        for role in ("k", "v"):
            p.add(1, role, window_page_size * TOKEN, 32, window=8)
        return p

    py, c = _templates(lib, peer(1 << 40, 2), peer(1 << 50, 2))
    rng = np.random.default_rng(7)
    for n_tokens, skip in [(14, 0), (16, 5), (9, 9), (3, 0)]:
        src, dst = rng.permutation(32)[:4].tolist(), rng.permutation(32)[:4].tolist()
        n_window = -(-n_tokens // 2)
        window = (rng.permutation(32)[:n_window].tolist(),
                  rng.permutation(32)[:n_window].tolist())
        request = CRequest(src, dst, n_tokens, skip, window_pages=window)
        assert _compare(lib, py, c, request) > 0 or n_tokens == skip
    # The window pages of one side missing: the core's refusal, as Python's.
    assert _compare(lib, py, c, CRequest([0, 1], [2, 3], 8, window_pages=([0, 1, 2, 3], None))
                    ) == -1
    assert lib.kvplan_template_free(c) == OK


def test_version_1_callers_plan_as_before(lib: ctypes.CDLL) -> None:
    """A version 1 request to the version 1 functions plans what the same page request plans
    as a version 2 request, and what Python plans."""
    py, c = _templates(lib, _hybrid(1 << 40, 2), _hybrid(1 << 50, 4))
    src_pages, dst_pages = [3, 4, 5, 9], [0, 1, 2, 30]
    for n_tokens, skip in [(None, 0), (13, 0), (16, 6)]:
        s, d = c_array(src_pages, ctypes.c_int64), c_array(dst_pages, ctypes.c_int64)
        v1 = RequestDesc(ctypes.addressof(s), 4, ctypes.addressof(d), 4,
                         NO_TOKENS if n_tokens is None else n_tokens, skip)
        info = PlanInfo()
        assert lib.kvplan_prepare(c, ctypes.byref(v1), ctypes.byref(info)) == OK, _error(lib)
        out = np.zeros((3, info.n_blocks), dtype=np.uint64)
        cols = [out[i].ctypes.data_as(u64p) for i in range(3)]
        assert lib.kvplan_plan_into(c, ctypes.byref(v1), *cols, info.n_blocks, None) == OK
        v2 = CRequest(src_pages, dst_pages, n_tokens, skip)
        assert _compare(lib, py, c, v2) == info.n_blocks
        desc, _keep = v2.desc()
        _, _, blocks = _plan2(lib, c, desc)
        np.testing.assert_array_equal(out, blocks)
    assert lib.kvplan_template_free(c) == OK


def _refused(lib: ctypes.CDLL, template: ctypes.c_void_p, desc: RequestDesc2) -> tuple[int, str]:
    info = PlanInfo()
    status = lib.kvplan_prepare2(template, ctypes.byref(desc), ctypes.byref(info))
    out = np.zeros((3, 64), dtype=np.uint64)
    cols = [out[i].ctypes.data_as(u64p) for i in range(3)]
    status_into = lib.kvplan_plan_into2(template, ctypes.byref(desc), *cols, 64, None)
    assert status == status_into != OK
    assert not out.any(), "a refused request wrote blocks"
    return status, _error(lib)


@pytest.mark.parametrize(("change", "status", "words"), [
    ({"struct_size": ctypes.sizeof(RequestDesc)}, INVALID_ARGUMENT,
     ["request->struct_size is 48", f"reads {ctypes.sizeof(RequestDesc2)} bytes"]),
    ({"src_slot": NO_SLOT, "dst_slot": 1}, INVALID_ARGUMENT,
     ["src_slot is -1 and dst_slot is 1"]),
    ({"src_slot": -5, "dst_slot": 0}, INVALID_ARGUMENT, ["src_slot is -5"]),
    ({"window_sides": 4}, INVALID_ARGUMENT, ["window_sides is 0x4"]),
    ({"n_src_window": 3}, INVALID_ARGUMENT,
     ["src_window_pages holds 3 values", "window_sides (0x0)"]),
    ({"window_sides": WINDOW_SRC, "src_window_pages": None, "n_src_window": 2}, NULL_POINTER,
     ["src_window_pages is null but its length is 2"]),
    ({"src_pages": None, "n_src": 2}, NULL_POINTER, ["src_pages is null but its length is 2"]),
    ({"n_tokens": -3}, INVALID_ARGUMENT, ["n_tokens is -3"]),
])
def test_bad_requests_are_refused_naming_the_values(
        lib: ctypes.CDLL, change: dict[str, object], status: int, words: list[str]) -> None:
    _, c = _templates(lib, _hybrid(1 << 40, 2), _hybrid(1 << 50, 4))
    desc, _keep = CRequest([0, 1], [2, 3]).desc()
    for name, value in change.items():
        setattr(desc, name, value)
    got, message = _refused(lib, c, desc)
    assert got == status, message
    for word in words:
        assert word in message, message
    assert lib.kvplan_template_free(c) == OK


def test_a_slot_request_without_state_entries_answers_as_python(lib: ctypes.CDLL) -> None:
    """Without state pairs a slot request moves nothing (an empty plan, as in Python); with
    ring positions it is the core's geometry refusal, word for word."""
    plain = Peer(1 << 40, page_size=4).add(0, "kv", 4 * TOKEN, 8)
    py, c = _templates(lib, plain, Peer(1 << 50, page_size=4).add(0, "kv", 4 * TOKEN, 8))
    assert _compare(lib, py, c, CRequest(slot=(0, 0))) == 0
    assert _compare(lib, py, c, CRequest(slot=(0, 0), n_tokens=4)) == -1
    assert lib.kvplan_last_error_kind() == b"geometry"
    assert "no ring-state pairs" in _error(lib)
    assert lib.kvplan_template_free(c) == OK


def test_bad_layout_descriptors_are_refused_naming_the_values(lib: ctypes.CDLL) -> None:
    def refused(desc: LayoutDesc2) -> tuple[int, str]:
        handle = ctypes.c_void_p(1)
        status = lib.kvplan_layout_new2(ctypes.byref(desc), ctypes.byref(handle))
        assert status != OK and handle.value is None
        return status, _error(lib)

    desc, _keep = _hybrid(1 << 40, 2).desc2()
    desc.struct_size = ctypes.sizeof(LayoutDesc)
    status, message = refused(desc)
    assert status == INVALID_ARGUMENT and "desc->struct_size is" in message, message

    desc, _keep = _hybrid(1 << 40, 2).desc2()
    desc.window_page_size = 2
    status, message = refused(desc)
    assert status == INVALID_ARGUMENT and "window_page_size is 2" in message, message

    # A ring on a page entry and a window on a state entry: the core's layout refusals.
    peer = _hybrid(1 << 40, 2)
    peer.rings[0] = 2
    desc, _keep = peer.desc2()
    status, message = refused(desc)
    assert lib.kvplan_last_error_kind() == b"layout" and "ring" in message, message
    peer = _hybrid(1 << 40, 2)
    peer.windows[4] = 8
    desc, _keep = peer.desc2()
    status, message = refused(desc)
    assert lib.kvplan_last_error_kind() == b"layout" and "window" in message, message
    with pytest.raises(kvplan.LayoutError) as err:
        peer.python()
    assert message == str(err.value)


def test_random_version_2_requests_never_panic_nor_write_past_the_plan(lib: ctypes.CDLL) -> None:
    """Random slot pairs, window sides, counts, null arrays and struct sizes against a template
    with KV pages, a window pool, a plain state entry and a ring: every call returns a known
    status with a message (never a panic), agrees with Python on what plans, and writes no
    column value past the plan's blocks."""
    def peer(base: int, ring: int) -> Peer:
        p = _hybrid(base, ring)
        p.window_page_size = 2
        for role in ("k", "v"):
            p.add(1, role, 2 * TOKEN, 16, window=8)
        return p

    py, c = _templates(lib, peer(1 << 40, 2), peer(1 << 50, 4))
    rng = np.random.default_rng(20261206)
    guard = np.uint64(0xA5A5A5A5A5A5A5A5)
    seen: set[int] = set()
    compared = 0
    for _ in range(300):
        def pages(n_max: int) -> list[int] | None:
            if rng.random() < 0.1:
                return None
            values = rng.integers(0, 16, size=int(rng.integers(0, n_max)))
            if rng.random() < 0.1 and len(values):
                values[0] = rng.choice([-2, -1, 40])
            return values.tolist()

        slot = (int(rng.integers(-2, 4)), int(rng.integers(-2, 4))) if rng.random() < 0.4 else None
        n_tokens = int(rng.integers(-2, 14)) if rng.random() < 0.7 else None
        request = CRequest(pages(6) or [], pages(6) or [], n_tokens,
                           int(rng.integers(0, 12)) if rng.random() < 0.3 else 0)
        desc, _keep = request.desc()
        if slot is not None:
            desc.src_slot, desc.dst_slot = slot
        draw = rng.random()
        desc.window_sides = 3 if draw < 0.6 else int(rng.integers(0, 8)) if draw < 0.8 else 0
        windows: list[list[int] | None] = []
        for side in ("src", "dst"):
            window = pages(8)
            windows.append(window)
            if window is None:
                setattr(desc, f"{side}_window_pages", None)
                setattr(desc, f"n_{side}_window", int(rng.integers(0, 3)))
            else:
                array = c_array(window, ctypes.c_int64)
                _keep.append(array)
                setattr(desc, f"{side}_window_pages", ctypes.addressof(array))
                setattr(desc, f"n_{side}_window", len(window))
        if rng.random() < 0.05:
            desc.struct_size = int(rng.integers(0, 200))
        info = PlanInfo()
        status = lib.kvplan_prepare2(c, ctypes.byref(desc), ctypes.byref(info))
        out = np.full((3, 70), guard, dtype=np.uint64)
        cols = [out[i].ctypes.data_as(u64p) for i in range(3)]
        status_into = lib.kvplan_plan_into2(c, ctypes.byref(desc), *cols, 64, ctypes.byref(info))
        assert status_into in (status, 4), (status, status_into)  # 4: more than 64 blocks
        seen.add(status_into)
        if status_into != OK:
            assert status_into in {1, 2, 4, *range(10, 31)}, (status_into, _error(lib))
            assert _error(lib) and lib.kvplan_last_error_kind(), status_into
            assert (out == guard).all(), "a refused request wrote blocks"
            continue
        n = info.n_blocks
        assert (out[:, n:] == guard).all(), "the C ABI wrote past the plan's blocks"
        # What planned here plans the same through Python.
        if slot is not None:
            request.slot = slot
        sides = (desc.window_sides & WINDOW_SRC, desc.window_sides & WINDOW_DST)
        if any(sides):
            # A side's bit gives its list, empty when the pointer was null with no values.
            request.window_pages = ((windows[0] or []) if sides[0] else None,
                                    (windows[1] or []) if sides[1] else None)
        plan = py.plan(request.python())
        compared += 1
        np.testing.assert_array_equal(out[0, :n], plan.src_addrs)
        np.testing.assert_array_equal(out[1, :n], plan.dst_addrs)
        np.testing.assert_array_equal(out[2, :n], plan.lengths)
    # The draws reached planned requests and the boundary's and the core's refusals.
    assert {OK, INVALID_ARGUMENT, NULL_POINTER} <= seen and seen & set(range(10, 31)), seen
    assert compared >= 15, compared
    assert lib.kvplan_template_free(c) == OK


def test_outputs_on_the_window_pages_are_refused(lib: ctypes.CDLL) -> None:
    """The window page arrays are inputs like the page arrays: an info struct or a column
    placed on them is refused before anything is written."""
    _, c = _templates(lib, _hybrid(1 << 40, 2), _hybrid(1 << 50, 4))
    window = (ctypes.c_int64 * 16)(*range(16))
    desc, _keep = CRequest([0, 1], [2, 3]).desc()
    desc.window_sides, desc.dst_window_pages, desc.n_dst_window = WINDOW_DST, \
        ctypes.addressof(window), 16
    before = bytes(window)
    status = lib.kvplan_prepare2(c, ctypes.byref(desc), ctypes.addressof(window))
    assert status == INVALID_ARGUMENT and "overlaps dst_window_pages" in _error(lib)
    out = np.zeros((2, 16), dtype=np.uint64)
    status = lib.kvplan_plan_into2(c, ctypes.byref(desc), out[0].ctypes.data,
                                   ctypes.addressof(window), out[1].ctypes.data, 16, None)
    assert status == INVALID_ARGUMENT and "dst_addrs" in _error(lib), _error(lib)
    assert bytes(window) == before
    assert lib.kvplan_template_free(c) == OK
