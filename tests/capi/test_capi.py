"""The C ABI (rust/kvplan-capi, loaded with ctypes from the cdylib cargo builds) plans the same
blocks as ``kvplan.Template.plan`` for the same layouts and request, block for block: page plans,
token plans between page sizes, delta plans, and the same refusal for an index out of range."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan

from support.capi import (
    BUFFER_TOO_SMALL,
    INDEX_BOUNDS,
    NO_TOKENS,
    OK,
    LayoutDesc,
    PlanInfo,
    RequestDesc,
)
from support.capi import error as _error
from support.capi import c_array

u64p = ctypes.POINTER(ctypes.c_uint64)




class Peer:
    """One peer's MHA-style entries (K then V per layer, with ids), for both APIs."""

    def __init__(self, base: int, layers: list[int], pages: int, item_k: int, item_v: int,
                 page_size: int) -> None:
        self.ptrs, self.lens, self.items, self.ids, self.roles = [], [], [], [], []
        for role, item in (("k", item_k), ("v", item_v)):
            for layer in layers:
                self.ptrs.append(base + len(self.ptrs) * (1 << 32))
                self.lens.append(item * pages)
                self.items.append(item)
                self.ids.append(layer)
                self.roles.append(role)
        self.page_size = page_size

    def python(self) -> kvplan.Layout:
        return kvplan.Layout(self.ptrs, self.lens, self.items, self.ids, self.roles,
                             page_size=self.page_size)

    def c(self, lib: ctypes.CDLL) -> ctypes.c_void_p:
        n = len(self.ptrs)
        keep = [c_array(self.ptrs, ctypes.c_uint64), c_array(self.lens, ctypes.c_uint64),
                c_array(self.items, ctypes.c_uint64), c_array(self.ids, ctypes.c_int64),
                (ctypes.c_char_p * n)(*[r.encode() for r in self.roles])]
        addrs = [ctypes.addressof(a) for a in keep]
        desc = LayoutDesc(n, addrs[0], addrs[1], addrs[2], None, addrs[3], addrs[4], None,
                          self.page_size, 0, 1, 0, 1, None)
        handle = ctypes.c_void_p()
        status = lib.kvplan_layout_new(ctypes.byref(desc), ctypes.byref(handle))
        assert status == OK, _error(lib)
        return handle


def _templates(lib: ctypes.CDLL, src: Peer, dst: Peer) -> tuple[kvplan.Template, ctypes.c_void_p]:
    s, d = src.c(lib), dst.c(lib)
    template = ctypes.c_void_p()
    status = lib.kvplan_template_new(s, d, None, ctypes.byref(template))
    assert status == OK, _error(lib)
    assert lib.kvplan_layout_free(s) == OK and lib.kvplan_layout_free(d) == OK
    return kvplan.Template(src.python(), dst.python()), template


def _c_plan(lib: ctypes.CDLL, template: ctypes.c_void_p, src: list[int], dst: list[int],
            n_tokens: int | None, skip: int) -> tuple[int, str, np.ndarray | None]:
    s, d = c_array(src, ctypes.c_int64), c_array(dst, ctypes.c_int64)
    request = RequestDesc(ctypes.addressof(s), len(src), ctypes.addressof(d), len(dst),
                          NO_TOKENS if n_tokens is None else n_tokens, skip)
    info = PlanInfo()
    status = lib.kvplan_prepare(template, ctypes.byref(request), ctypes.byref(info))
    if status != OK:
        return status, _error(lib), None
    n = info.n_blocks
    out = np.zeros((3, n + 1), dtype=np.uint64)
    ptr = [out[i].ctypes.data_as(u64p) for i in range(3)]
    if n > 0:
        assert lib.kvplan_plan_into(template, ctypes.byref(request), *ptr, ctypes.c_size_t(n - 1),
                                    None) == BUFFER_TOO_SMALL
    status = lib.kvplan_plan_into(template, ctypes.byref(request), *ptr, ctypes.c_size_t(n),
                                  ctypes.byref(info))
    assert status == OK, _error(lib)
    assert info.n_blocks == n
    assert not out[:, n].any(), "the C ABI wrote past the plan's blocks"
    return status, "", out[:, :n]


def _compare(lib: ctypes.CDLL, py: kvplan.Template, c: ctypes.c_void_p, src: list[int],
             dst: list[int], n_tokens: int | None = None, skip: int = 0) -> int:
    status, message, blocks = _c_plan(lib, c, src, dst, n_tokens, skip)
    try:
        plan = py.plan(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
                       n_tokens=n_tokens, skip_tokens=skip)
    except kvplan.KvPlanError as err:
        assert status != OK, f"Python refused ({err}) but the C ABI planned"
        assert message == str(err)
        return 0
    assert status == OK, f"the C ABI refused ({message}) but Python planned"
    assert blocks is not None
    np.testing.assert_array_equal(blocks[0], plan.src_addrs)
    np.testing.assert_array_equal(blocks[1], plan.dst_addrs)
    np.testing.assert_array_equal(blocks[2], plan.lengths)
    return blocks.shape[1]


LAYERS = [0, 1, 2, 3, 4]


def test_page_plan_block_for_block(lib: ctypes.CDLL) -> None:
    py, c = _templates(lib, Peer(1 << 40, LAYERS, 64, 512, 384, 16),
                       Peer(1 << 50, LAYERS[::-1], 64, 512, 384, 16))
    src = [0, 1, 2, 9, 40, 41, 63, 62, 61, 5]
    dst = [7, 8, 9, 1, 20, 21, 3, 2, 1, 60]
    # Five runs (0-2, 9, 40-41, 63-61 descending, 5), one block per run and entry.
    assert _compare(lib, py, c, src, dst) == 2 * len(LAYERS) * 5
    # The same refusal, word for word, for an index out of range.
    status, message, _ = _c_plan(lib, c, [64], [0], None, 0)
    assert status == INDEX_BOUNDS
    assert lib.kvplan_last_error_kind() == b"index_bounds"
    with pytest.raises(kvplan.IndexBoundsError) as err:
        py.plan(np.array([64]), np.array([0]))
    assert message == str(err.value)
    assert lib.kvplan_template_free(c) == OK


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_token_and_delta_plans_block_for_block(lib: ctypes.CDLL, data: st.DataObject) -> None:
    ps, pd = data.draw(st.sampled_from([(16, 16), (16, 32), (32, 16), (8, 24)]))
    pages = 24
    py, c = _templates(lib, Peer(1 << 40, LAYERS, pages, 64 * ps, 32 * ps, ps),
                       Peer(1 << 50, LAYERS, pages, 64 * pd, 32 * pd, pd))
    try:
        n_tokens = data.draw(st.integers(0, 160))
        src = data.draw(st.lists(st.integers(0, pages - 1), min_size=-(-n_tokens // ps),
                                 max_size=-(-n_tokens // ps) + 1, unique=True))
        dst = data.draw(st.lists(st.integers(0, pages - 1), min_size=-(-n_tokens // pd),
                                 max_size=-(-n_tokens // pd) + 1, unique=True))
        skip = data.draw(st.integers(0, n_tokens))
        given_tokens = data.draw(st.sampled_from([n_tokens, None]))
        _compare(lib, py, c, src, dst, given_tokens, skip if given_tokens is not None else 0)
    finally:
        assert lib.kvplan_template_free(c) == OK
