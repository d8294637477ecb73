"""Fuzzing of the C ABI (rust/kvplan-capi) through ctypes, as a C caller would use it.

Each example builds random layouts (any array null or misaligned, unknown kinds and memory
orders, roles that are null or not UTF-8, zero page sizes and TP sizes, addresses near 2**64),
templates from live, freed, foreign or made-up handles, and random requests (negative and huge
pages, unequal lengths, a null array with a non-zero length, token counts and skips of any
size), and plans them into columns that are too small, null, misaligned, overlapping each other
or the request, with the info struct inside a column or inside the request.

Properties of every call:
- it returns a known status (never `KVPLAN_STATUS_PANIC`, never a crash); a failure comes with a
  message and a kind that agree with the status;
- it writes nothing outside the caller's buffers: every output lives between guard words that
  must stay as they were, every input (descriptor, arrays, strings, request) must be unchanged
  byte for byte, and a plan writes nothing past its block count in a column;
- a handle out of a failed constructor is null; a freed or made-up handle is refused with
  `KVPLAN_STATUS_INVALID_HANDLE`;
- a plan that succeeds moves `info.total_bytes` in blocks that each lie inside one buffer of
  their side, as many blocks as `kvplan_prepare` announced, and `KVPLAN_STATUS_BUFFER_TOO_SMALL`
  leaves the columns untouched.

Deterministic by default (the hypothesis profile of tests/conftest.py, a fixed number of
examples); ``scripts/fuzz`` runs it with fresh random seeds for its share of the time budget.
A finding becomes a fixed case below (``test_*``) and a fix in the library.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.capi import (
    BUFFER_TOO_SMALL,
    INVALID_ARGUMENT,
    INVALID_HANDLE,
    NULL_POINTER,
    OK,
    OTHER,
    PANIC,
    STATUSES,
    Attention,
    LayoutDesc,
    PlanInfo,
    RequestDesc,
    TemplateOptions,
    load,
)

EXPLORE = os.environ.get("KVPLAN_HYPOTHESIS_PROFILE") == "explore"
BUDGET = float(os.environ.get("KVPLAN_CAPI_FUZZ_SECONDS", "60"))
EXAMPLES = 300
GUARD = 4  # guard words on each side of every output
CANARY = 0xA5C3_5A3C_DEAD_BEEF
U64_MAX = 2**64 - 1
# A handle value no call ever returned (an odd address: never a live allocation).
MADE_UP_HANDLE = 0x7F00_DEAD_BEE1


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return load()


# ----------------------------------------------------------------------------- memory


@dataclass
class Memory:
    """Every buffer one example hands to the library, with what must hold of it afterwards:
    inputs unchanged byte for byte, outputs' guard words unchanged."""

    keep: list[object] = field(default_factory=list)
    inputs: list[tuple[int, bytes, str]] = field(default_factory=list)
    guards: list[tuple[int, int, str]] = field(default_factory=list)

    def input_words(self, values: list[int], ctype: type, what: str, offset: int = 0) -> int:
        """`values` in a fresh array, its address plus `offset` bytes (a misaligned pointer
        when `offset` is not a multiple of the value size; the array has room for it)."""
        size = ctypes.sizeof(ctype)
        raw = (ctypes.c_uint8 * (size * len(values) + 16))()
        self.keep.append(raw)
        addr = ctypes.addressof(raw) + offset
        for i, v in enumerate(values):
            ctype.from_address(addr + i * size).value = v
        self.inputs.append((ctypes.addressof(raw), ctypes.string_at(raw, len(raw)), what))
        return addr

    def input_struct(self, value: ctypes.Structure, what: str, offset: int = 0) -> int:
        raw = (ctypes.c_uint8 * (ctypes.sizeof(value) + 16))()
        self.keep.append(raw)
        addr = ctypes.addressof(raw) + offset
        ctypes.memmove(addr, ctypes.addressof(value), ctypes.sizeof(value))
        self.inputs.append((ctypes.addressof(raw), ctypes.string_at(raw, len(raw)), what))
        return addr

    def input_strings(self, strings: list[bytes | None], what: str) -> int:
        """An array of `char *`, each a NUL-terminated copy of its string (or null)."""
        holders = [None if s is None else ctypes.create_string_buffer(s) for s in strings]
        self.keep.append(holders)
        for i, h in enumerate(holders):
            if h is not None:
                self.inputs.append((ctypes.addressof(h), h.raw, f"{what}[{i}]"))
        return self.input_words(
            [0 if h is None else ctypes.addressof(h) for h in holders], ctypes.c_uint64, what)

    def output_words(self, n: int, what: str) -> int:
        """`n` words filled with the canary between guard words; the address of the first."""
        raw = (ctypes.c_uint64 * (n + 2 * GUARD))(*([CANARY] * (n + 2 * GUARD)))
        self.keep.append(raw)
        self.guards.append((ctypes.addressof(raw), n, what))
        return ctypes.addressof(raw) + 8 * GUARD

    def check(self) -> None:
        for addr, before, what in self.inputs:
            assert ctypes.string_at(addr, len(before)) == before, f"the library wrote into {what}"
        for addr, n, what in self.guards:
            words = (ctypes.c_uint64 * (n + 2 * GUARD)).from_address(addr)
            outside = list(words[:GUARD]) + list(words[GUARD + n:])
            assert outside == [CANARY] * (2 * GUARD), f"the library wrote outside {what}"


def words_at(addr: int, n: int) -> list[int]:
    return list((ctypes.c_uint64 * n).from_address(addr)) if n else []


# (call, status name) -> how many times; printed and checked so a green run shows that the
# draws reached every path (planned blocks, each refusal), not only the first checks.
SEEN: Counter[tuple[str, str]] = Counter()


def check_status(lib: ctypes.CDLL, status: int, call: str) -> None:
    """A known status, never a panic; a failure comes with a message and an agreeing kind."""
    assert status in STATUSES, f"{call} returned {status}, no KvplanStatus"
    SEEN[call.split(" ")[0], lib.kvplan_status_name(status).decode()] += 1
    message = lib.kvplan_last_error_message().decode()
    assert status != PANIC, f"{call} panicked: {message}"
    if status != OK:
        kind = lib.kvplan_last_error_kind().decode()
        name = lib.kvplan_status_name(status).decode()
        assert message, f"{call} failed with {name} and no message"
        # The core's kinds name their status; an output too small is the core's kind "other".
        assert kind == name or status == OTHER or (status == BUFFER_TOO_SMALL and kind == "other"), (
            f"{call}: status {name} with kind {kind!r} ({message})")


# ------------------------------------------------------------------------- strategies

ADDRESSES = st.one_of(
    st.integers(0, 2**20).map(lambda p: p * 64),
    st.integers(1, 64).map(lambda g: g << 32),
    st.integers(0, 4096).map(lambda d: U64_MAX - d),
    st.integers(0, U64_MAX),
)
POINTER_MODES = st.sampled_from(["valid"] * 6 + ["null", "misaligned"])


@dataclass
class DrawnLayout:
    status: int
    handle: int
    buffers: list[tuple[int, int]]  # (base, len) per entry, for the block checks


def draw_array(draw, memory: Memory, values: list[int], ctype: type, what: str,
               optional: bool, coherent: bool = False) -> int | None:
    if coherent:
        mode = draw(st.sampled_from(["valid"] * 100 + ["null", "misaligned"]))
    else:
        mode = draw(POINTER_MODES if not optional else st.sampled_from(
            ["valid"] * 3 + ["null"] * 3 + ["misaligned"]))
    if mode == "null":
        return None
    offset = draw(st.sampled_from([1, 4])) if mode == "misaligned" and ctypes.sizeof(ctype) > 1 else 0
    return memory.input_words(values, ctype, what, offset)


@dataclass
class Shape:
    """What the two peers of a coherent pair share: entries, item sizes, layer ids, roles."""

    items: list[int]
    ids: list[int]
    roles: list[bytes | None]
    page_size: int


def draw_shape(draw) -> Shape:
    n = draw(st.integers(1, 6))
    item = draw(st.sampled_from([64, 512, 1152]))
    roles = draw(st.sampled_from([[b"kv"] * n, [b"k", b"v"] * n, [None] * n]))[:n]
    ids = list(range(n)) if roles[0] != b"k" else [i // 2 for i in range(n)]
    return Shape([item] * n, ids, roles, draw(st.sampled_from([1, 16])))


def draw_layout(draw, lib: ctypes.CDLL, memory: Memory, handles: list[int],
                shape: Shape) -> DrawnLayout:
    if draw(st.integers(0, 9)) < 9:
        # A coherent layout of the shared shape (so that templates and plans are reached),
        # still through every pointer and value check below.
        n = len(shape.items)
        items, ids, roles = shape.items, shape.ids, shape.roles
        pages = [64] * n
        lens = [it * p for it, p in zip(items, pages)]
        base = draw(st.integers(1, 1 << 20)) << 20
        ptrs = [base + i * (1 << 30) for i in range(n)]
        kinds = [0] * n
        strides = list(items)
        return _layout_new(draw, lib, memory, handles, ptrs, lens, items, strides, ids,
                           [r for r in roles] if roles[0] is not None else None, kinds,
                           shape.page_size, coherent=True)
    n = draw(st.integers(0, 6))
    item = draw(st.sampled_from([0, 1, 8, 64, 1152, 4096]))
    items = [draw(st.sampled_from([item, item, 3, 0, 64])) for _ in range(n)]
    pages = [draw(st.sampled_from([0, 1, 4, 16, 64, 2**40])) for _ in range(n)]
    lens = [min(it * p + draw(st.integers(0, 2)), U64_MAX) for it, p in zip(items, pages)]
    ptrs = [draw(ADDRESSES) for _ in range(n)]
    ids = [draw(st.integers(-2, 4)) for _ in range(n)]
    role_pool = [b"kv", b"k", b"v", b"indexer", b"scale", b"", b"\xff\xfe", None]
    roles = [draw(st.sampled_from(role_pool)) for _ in range(n)]
    kinds = [draw(st.sampled_from([0, 0, 0, 1, 2, 255])) for _ in range(n)]
    strides = [it + draw(st.sampled_from([0, 0, 8, -1 if it else 0])) for it in items]
    return _layout_new(draw, lib, memory, handles, ptrs, lens, items, strides, ids,
                       roles if draw(st.booleans()) else None, kinds,
                       draw(st.sampled_from([1, 1, 16, 32, 0, 3])), coherent=False)


def _layout_new(draw, lib: ctypes.CDLL, memory: Memory, handles: list[int], ptrs: list[int],
                lens: list[int], items: list[int], strides: list[int], ids: list[int],
                roles: list[bytes | None] | None, kinds: list[int], page_size: int,
                coherent: bool) -> DrawnLayout:
    """kvplan_layout_new on these values, each array passed valid, null or misaligned (rarely,
    for a coherent layout), and the checks of its result."""
    n = len(ptrs)
    desc = LayoutDesc()
    desc.n_entries = n
    desc.data_ptrs = draw_array(draw, memory, ptrs, ctypes.c_uint64, "data_ptrs", False, coherent)
    desc.data_lens = draw_array(draw, memory, lens, ctypes.c_uint64, "data_lens", False, coherent)
    desc.item_lens = draw_array(draw, memory, items, ctypes.c_uint64, "item_lens", False, coherent)
    desc.strides = draw_array(draw, memory, strides, ctypes.c_uint64, "strides", True, coherent)
    desc.layer_ids = draw_array(draw, memory, ids, ctypes.c_int64, "layer_ids", True, coherent)
    desc.roles = None if roles is None else memory.input_strings(roles, "roles")
    desc.kinds = draw_array(draw, memory, kinds, ctypes.c_uint8, "kinds", True, coherent)
    desc.page_size = page_size
    if coherent:
        desc.tp_size, desc.tp_rank, desc.pp_size, desc.pp_rank = 1, 0, 1, 0
    else:
        desc.tp_size = draw(st.sampled_from([1, 1, 2, 4, 0]))
        desc.tp_rank = draw(st.integers(0, 4))
        desc.pp_size = draw(st.sampled_from([1, 1, 2, 0]))
        desc.pp_rank = draw(st.integers(0, 2))
    if not coherent and draw(st.booleans()):
        attention = Attention(draw(st.sampled_from([0, 1, 2, 8])), draw(st.sampled_from([0, 1, 2, 4])),
                              draw(st.sampled_from([0, 1, 64, 128])), draw(st.sampled_from([0, 1, 2])),
                              draw(st.sampled_from([0, 0, 1, 2])))
        desc.attention = memory.input_struct(attention, "attention",
                                             draw(st.sampled_from([0, 0, 0, 2])))
    desc_mode = draw(st.sampled_from(["valid"] * (100 if coherent else 8) + ["null", "misaligned"]))
    desc_ptr = (None if desc_mode == "null" else
                memory.input_struct(desc, "desc", 0 if desc_mode == "valid" else 4))
    out_mode = draw(st.sampled_from(["valid"] * (100 if coherent else 8) + ["null", "in_desc"]))
    out = memory.output_words(1, "the layout handle") if out_mode == "valid" else None
    if out_mode == "in_desc" and desc_ptr is not None:
        # The handle would land on the descriptor while it is read: refused.
        status = lib.kvplan_layout_new(desc_ptr, desc_ptr)
        check_status(lib, status, "kvplan_layout_new (out inside desc)")
        assert status in (NULL_POINTER, INVALID_ARGUMENT)
        memory.check()

    status = lib.kvplan_layout_new(desc_ptr, out)
    check_status(lib, status, "kvplan_layout_new")
    memory.check()
    handle = words_at(out, 1)[0] if out else 0
    if status == OK:
        assert handle != 0
        handles.append(handle)
        count = memory.output_words(1, "n_entries")
        assert lib.kvplan_layout_n_entries(handle, count) == OK
        assert words_at(count, 1) == [n]
    elif out:
        assert handle == 0, "a failed kvplan_layout_new left a handle in *out"
    return DrawnLayout(status, handle, list(zip(ptrs, lens)))


def pick_handle(draw, live: int, freed: int, other_kind: int) -> int | None:
    choice = draw(st.sampled_from(["live"] * 24 + ["null", "freed", "made_up", "other_kind"]))
    return {"live": live, "null": None, "freed": freed, "made_up": MADE_UP_HANDLE,
            "other_kind": other_kind}[choice] or None


def draw_request(draw, memory: Memory) -> tuple[int | None, RequestDesc, list[tuple[int, int]]]:
    """A request (its address, the struct, the byte ranges of its page arrays)."""
    # Mostly pages every coherent layout holds (so that plans are reached), else any value.
    sane = draw(st.integers(0, 9)) < 7
    page = st.integers(0, 63) if sane else st.one_of(
        st.integers(0, 70), st.integers(-3, -1), st.sampled_from([2**40, 2**63 - 1]))
    src = draw(st.lists(page, min_size=draw(st.sampled_from([0, 1, 1, 1])), max_size=12))
    equal = sane or draw(st.booleans())
    dst = ([draw(page) for _ in src] if equal else draw(st.lists(page, max_size=12)))
    ranges = []
    request = RequestDesc()
    for name, values in (("src_pages", src), ("dst_pages", dst)):
        mode = draw(st.sampled_from(["valid"] * 24 + ["null", "misaligned"]))
        addr = (None if mode == "null" else
                memory.input_words(values, ctypes.c_int64, name, 0 if mode == "valid" else 4))
        setattr(request, name, addr)
        setattr(request, "n_src" if name == "src_pages" else "n_dst", len(values))
        if addr:
            ranges.append((addr, 8 * len(values)))
    if sane:
        request.n_tokens = draw(st.sampled_from([-1] * 8 + [0, 1, 17]))
        request.skip_tokens = draw(st.sampled_from([0] * 8 + [1, 16]))
    else:
        request.n_tokens = draw(st.sampled_from([-1, 0, 1, 17, 64, 200, -2, 2**62]))
        request.skip_tokens = draw(st.sampled_from([0, 1, 16, 2**63]))
    mode = draw(st.sampled_from(["valid"] * 24 + ["null", "misaligned"]))
    addr = None if mode == "null" else memory.input_struct(request, "request",
                                                           0 if mode == "valid" else 4)
    return addr, request, ranges


def inside_one(start: int, length: int, buffers: list[tuple[int, int]]) -> bool:
    return any(base <= start and start + length <= base + size for base, size in buffers)


def fuzz_one(lib: ctypes.CDLL, data: st.DataObject) -> None:
    draw = data.draw
    memory = Memory()
    layouts: list[int] = []
    templates: list[int] = []
    try:
        shape = draw_shape(draw)
        src = draw_layout(draw, lib, memory, layouts, shape)
        dst = draw_layout(draw, lib, memory, layouts, shape)
        # A freed layout, for the use-after-free handles.
        spare = draw_layout(draw, lib, memory, [], shape)
        if spare.status == OK:
            assert lib.kvplan_layout_free(spare.handle) == OK
            status = lib.kvplan_layout_free(spare.handle)
            assert status == INVALID_HANDLE, "a double free was not refused"
        options = None
        if draw(st.booleans()):
            options = memory.input_struct(
                TemplateOptions(draw(st.sampled_from([0, 1, 2])), draw(st.integers(0, 2)),
                                draw(st.integers(0, 1))), "options")
        out = memory.output_words(1, "the template handle")
        status = lib.kvplan_template_new(
            pick_handle(draw, src.handle, spare.handle, 0),
            pick_handle(draw, dst.handle, spare.handle, 0), options, out)
        check_status(lib, status, "kvplan_template_new")
        memory.check()
        template = words_at(out, 1)[0]
        if status != OK:
            assert template == 0
            return
        templates.append(template)
        # The layouts may go before their template.
        if draw(st.booleans()):
            for handle in layouts:
                assert lib.kvplan_layout_free(handle) == OK
            layouts.clear()

        for _ in range(draw(st.integers(1, 4))):
            plan_one(lib, draw, memory, template, src.buffers, dst.buffers)

        assert lib.kvplan_template_free(template) == OK
        templates.remove(template)
        # Use after free: refused, never dereferenced.
        info = memory.output_words(5, "info")
        request, _, _ = draw_request(draw, memory)
        status = lib.kvplan_prepare(template, request, info)
        check_status(lib, status, "kvplan_prepare after free")
        assert status == INVALID_HANDLE
        assert lib.kvplan_template_free(template) == INVALID_HANDLE
        memory.check()
    finally:
        for handle in templates:
            lib.kvplan_template_free(handle)
        for handle in layouts:
            lib.kvplan_layout_free(handle)


def plan_one(lib: ctypes.CDLL, draw, memory: Memory, template: int,
             src_buffers: list[tuple[int, int]], dst_buffers: list[tuple[int, int]]) -> None:
    request, raw, page_ranges = draw_request(draw, memory)
    info_out = memory.output_words(5, "info")
    # A null argument, or an info struct inside the request, is refused.
    probe = draw(st.sampled_from([None, "null_request", "null_info", "info_in_request"]))
    if probe is not None and request is not None:
        status = lib.kvplan_prepare(template, None if probe == "null_request" else request,
                                    {"null_request": info_out, "null_info": None,
                                     "info_in_request": request}[probe])
        check_status(lib, status, f"kvplan_prepare ({probe})")
        assert status in (NULL_POINTER, INVALID_ARGUMENT, INVALID_HANDLE), (
            f"kvplan_prepare ({probe}) returned {status}")
        memory.check()
    status = lib.kvplan_prepare(template, request, info_out)
    check_status(lib, status, "kvplan_prepare")
    memory.check()
    prepared = PlanInfo.from_address(info_out) if status == OK else None
    n_blocks = prepared.n_blocks if prepared else draw(st.integers(0, 8))
    if n_blocks > 100_000:
        return  # columns this large are not worth allocating here

    capacity = max(0, n_blocks + draw(st.sampled_from([0, 0, 0, 1, 3, -1, -1, -2, -n_blocks])))
    columns = [memory.output_words(capacity, name) for name in ("src_addrs", "dst_addrs", "lengths")]
    passed = list(columns)
    for i in range(3):
        mode = draw(st.sampled_from(["own"] * 30 + ["null", "misaligned", "shared", "pages"]))
        if mode == "null":
            passed[i] = None
        elif mode == "misaligned":
            passed[i] = columns[i] + 4  # its last value reaches into the guard words
        elif mode == "shared":
            passed[i] = columns[(i + 1) % 3]
        elif mode == "pages" and page_ranges:
            passed[i] = page_ranges[0][0]
    info_mode = draw(st.sampled_from(["own"] * 12 + ["null", "in_column", "in_request"]))
    if info_mode == "in_column" and capacity < 5:
        info_mode = "own"  # the info must fit where it points: inside a column of 5 values or more
    info = memory.output_words(5, "the plan's info")
    info_ptr = {"own": info, "null": None, "in_column": columns[0],
                "in_request": request}[info_mode]
    status = lib.kvplan_plan_into(template, request, *passed, capacity, info_ptr)
    check_status(lib, status, "kvplan_plan_into")
    memory.check()
    if status == OK:
        assert prepared is not None, "kvplan_plan_into planned a request kvplan_prepare refused"
        n = prepared.n_blocks
        assert n <= capacity
        src, dst, lengths = (words_at(c, capacity) for c in columns)
        assert src[n:] == dst[n:] == lengths[n:] == [CANARY] * (capacity - n), (
            "kvplan_plan_into wrote past the plan's blocks")
        assert sum(lengths[:n]) == prepared.total_bytes
        for i in range(n):
            assert inside_one(src[i], lengths[i], src_buffers), f"src block {i} outside the buffers"
            assert inside_one(dst[i], lengths[i], dst_buffers), f"dst block {i} outside the buffers"
        if info_ptr == info:
            assert bytes(PlanInfo.from_address(info)) == bytes(prepared)
    elif status == BUFFER_TOO_SMALL:
        for c in columns:
            assert words_at(c, capacity) == [CANARY] * capacity, (
                "BUFFER_TOO_SMALL but the columns were written")


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def _fuzz(lib: ctypes.CDLL, data: st.DataObject) -> None:
    fuzz_one(lib, data)


def test_capi_fuzz(lib: ctypes.CDLL) -> None:
    """No input crashes the C ABI or makes it write outside the caller's buffers."""
    SEEN.clear()
    batches = 0
    deadline = time.monotonic() + BUDGET
    while True:
        _fuzz(lib)
        batches += 1
        if not EXPLORE or time.monotonic() >= deadline:
            break
    what = f"random seeds, {BUDGET:.0f} s budget" if EXPLORE else "deterministic"
    print(f"\n[fuzz capi] {batches} batch(es) of {EXAMPLES} examples ({what}): "
          f"{dict(sorted(SEEN.items()))}")
    for call, status in [("kvplan_plan_into", "ok"), ("kvplan_plan_into", "buffer_too_small"),
                         ("kvplan_plan_into", "invalid_argument"), ("kvplan_plan_into", "null_pointer"),
                         ("kvplan_prepare", "index_bounds"), ("kvplan_prepare", "invalid_handle"),
                         ("kvplan_layout_new", "layout"), ("kvplan_template_new", "invalid_handle"),
                         ("kvplan_template_new", "ok")]:
        assert SEEN[call, status] >= 5, f"the draws reached {call} -> {status} only {SEEN[call, status]} times"
