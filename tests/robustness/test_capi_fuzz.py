"""Fuzzing of the C ABI (rust/kvplan-capi) through ctypes, as a C caller would use it.

Each example builds random layouts (any array null or misaligned, unknown kinds and memory
orders, roles that are null or not UTF-8, zero page sizes and TP sizes, addresses near 2**64),
some through version 4 descriptors whose state entries declare TP channel splits (between TP
sizes 1, 2 and 4, or with any channels, rows, shard group counts and groups, a wrong
``struct_size``, counts that do not sum to ``n_shard_groups``), templates from live, freed,
foreign or made-up handles, and random requests of version 1 or 2 (negative and huge pages and
state slots, unequal lengths, a null array with a non-zero length, token counts and skips of
any size), and plans them into columns that are too small, null, misaligned, overlapping each
other or the request, with the info struct inside a column or inside the request.

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
    NO_SLOT,
    NO_STATE_SPLIT,
    NULL_POINTER,
    OK,
    OTHER,
    PANIC,
    STATUSES,
    Attention,
    LayoutDesc,
    LayoutDesc3,
    LayoutDesc4,
    PlanInfo,
    RequestDesc,
    RequestDesc2,
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
STATE_SLOTS = 8  # slots of every coherent state buffer


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
    # (base, len, item) of each state entry declaring a split of its slot over TP ranks.
    split: list[tuple[int, int, int]] = field(default_factory=list)


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
class SplitState:
    """A state entry of a coherent pair: ``model`` channels over the TP ranks in ``rows`` rows
    cut into ``groups`` (sharded), a replicated slot of ``whole`` bytes (``model`` 0), or a
    slot of ``whole`` bytes without a split (``model`` None)."""

    model: int | None
    rows: int
    groups: list[int]
    per_channel: int
    whole: int

    def channels(self, tp: int) -> int:
        return NO_STATE_SPLIT if self.model is None else self.model // tp

    def item(self, tp: int) -> int:
        return self.rows * (self.model // tp) * self.per_channel if self.model else self.whole


@dataclass
class Shape:
    """What the two peers of a coherent pair share: entries, item sizes, layer ids, roles, and
    in an example of version 4 layouts (``v4``) the state entries after them (each peer at a
    TP size of its own)."""

    items: list[int]
    ids: list[int]
    roles: list[bytes | None]
    page_size: int
    v4: bool = False
    states: list[SplitState] = field(default_factory=list)
    tp_sizes: tuple[int, int] = (1, 1)  # of the prefill and decode peers when they have states


def draw_split_state(draw) -> SplitState:
    kind = draw(st.sampled_from(["sharded"] * 3 + ["replicated", "whole"]))
    whole = 8 * draw(st.integers(1, 8))
    if kind == "replicated":
        return SplitState(0, draw(st.integers(1, 3)), [], 1, whole)
    if kind == "whole":
        return SplitState(None, 1, [], 1, whole)
    # Sub-blocks of a multiple of 4 channels divide over TP sizes 1, 2 and 4.
    groups = draw(st.lists(st.integers(1, 4).map(lambda g: 4 * g), max_size=4))
    model = sum(groups) if groups else 4 * draw(st.integers(1, 8))
    return SplitState(model, draw(st.integers(1, 3)), groups, draw(st.sampled_from([1, 2, 4])),
                      whole)


def draw_shape(draw, v4: bool) -> Shape:
    """The shape of an example's coherent pair; with `v4`, mostly with state entries."""
    n = draw(st.integers(1, 6))
    item = draw(st.sampled_from([64, 512, 1152]))
    roles = draw(st.sampled_from([[b"kv"] * n, [b"k", b"v"] * n, [None] * n]))[:n]
    ids = list(range(n)) if roles[0] != b"k" else [i // 2 for i in range(n)]
    shape = Shape([item] * n, ids, roles, draw(st.sampled_from([1, 16])), v4)
    if v4:
        shape.states = [draw_split_state(draw)
                        for _ in range(draw(st.sampled_from([1, 1, 2, 3, 0])))]
        # Mostly two TP sizes, so that split slots move in slices.
        shape.tp_sizes = draw(st.sampled_from(
            [(1, 2), (4, 2), (2, 1), (1, 4), (2, 4), (4, 1), (2, 2), (1, 1), (4, 4)]))
    return shape


def draw_layout(draw, lib: ctypes.CDLL, memory: Memory, handles: list[int],
                shape: Shape, side: int) -> DrawnLayout:
    """A layout, mostly of `shape` (a coherent one), else of any values. `side` is 0 for the
    prefill peer and 1 for a decode peer: which of the shape's TP sizes it has."""
    if draw(st.integers(0, 9)) < 9:
        # A coherent layout of the shared shape (so that templates and plans are reached),
        # still through every pointer and value check below.
        n = len(shape.items)
        items, ids, roles = list(shape.items), list(shape.ids), list(shape.roles)
        pages = [64] * n
        lens = [it * p for it, p in zip(items, pages)]
        kinds = [0] * n
        split = None
        tp, rank = 1, 0
        if shape.states:
            # State entries after the pages, split over this peer's own TP size (version 4).
            tp = shape.tp_sizes[min(side, 1)]
            rank = draw(st.integers(0, tp - 1))
            for k, state in enumerate(shape.states):
                items.append(state.item(tp))
                lens.append(state.item(tp) * STATE_SLOTS)
                ids.append(100 + k)
                roles.append(None if roles[0] is None else b"mamba")
                kinds.append(1)
            split = ([0] * n + [s.channels(tp) for s in shape.states],
                     [0] * n + [0 if s.model is None else s.rows for s in shape.states],
                     [0] * n + [len(s.groups) for s in shape.states],
                     [g for s in shape.states for g in s.groups])
        base = draw(st.integers(1, 1 << 20)) << 20
        ptrs = [base + i * (1 << 30) for i in range(len(items))]
        if split is not None:
            split[0][:n] = [NO_STATE_SPLIT] * n
        strides = list(items)
        version = 4 if shape.v4 else 1
        return _layout_new(draw, lib, memory, handles, ptrs, lens, items, strides, ids,
                           roles if roles[0] is not None else None, kinds,
                           shape.page_size, coherent=True, version=version, split=split,
                           tp=(tp, rank))
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
                       draw(st.sampled_from([1, 1, 16, 32, 0, 3])), coherent=False,
                       version=4 if shape.v4 else 1, split=None, tp=None)


Split = tuple[list[int], list[int], list[int], list[int]]  # channels, rows, counts, groups
SPLIT_CHANNELS = [NO_STATE_SPLIT, NO_STATE_SPLIT, 0, 1, 2, 7, 8, 16, 2**63, U64_MAX - 1]


def draw_split(draw, n: int) -> Split:
    """Any split fields of `n` entries: mostly refused (channels of page entries, 0 rows, too
    many or empty groups, counts that do not sum to the groups given)."""
    channels = [draw(st.sampled_from(SPLIT_CHANNELS)) for _ in range(n)]
    rows = [draw(st.sampled_from([0, 0, 1, 1, 2, 3, U64_MAX])) for _ in range(n)]
    counts = [draw(st.sampled_from([0, 0, 0, 1, 2, 4, 5, 255])) for _ in range(n)]
    groups = draw(st.lists(st.sampled_from([0, 1, 2, 4, 8, 16, U64_MAX]), max_size=8))
    if draw(st.booleans()):
        # Counts and groups of equal lengths, so that the core's checks are reached.
        groups = (groups * (sum(counts) + 1))[:sum(counts)] if groups else [4] * sum(counts)
    return channels, rows, counts, groups


def mutate_split(draw, split: Split) -> Split:
    """A coherent split with one value changed (a near miss the core must refuse)."""
    channels, rows, counts, groups = (list(v) for v in split)
    n = len(channels)
    what = draw(st.sampled_from(["channels", "rows", "counts", "groups"]))
    i = draw(st.integers(0, n - 1))
    if what == "channels":
        channels[i] = draw(st.sampled_from(SPLIT_CHANNELS))
    elif what == "rows":
        rows[i] = draw(st.sampled_from([0, 1, 2, U64_MAX]))
    elif what == "counts":
        counts[i] = draw(st.sampled_from([0, 1, 3, 5, 255]))
    elif groups:
        groups[draw(st.integers(0, len(groups) - 1))] = draw(st.sampled_from([0, 1, 3, U64_MAX]))
    return channels, rows, counts, groups


def desc4_of(draw, memory: Memory, base: LayoutDesc, n: int, split: Split | None,
             coherent: bool) -> tuple[LayoutDesc4, Split | None]:
    """A version 4 descriptor around `base`: a coherent split (now and then one value off), or
    any split fields, each array valid, null or misaligned."""
    desc = LayoutDesc4()
    desc.base = base
    size = ctypes.sizeof(LayoutDesc4)
    desc.struct_size = draw(st.sampled_from(
        [size] * (100 if coherent else 8) + [ctypes.sizeof(LayoutDesc3), 0, size + 8]))
    if split is None and (coherent or draw(st.booleans())):
        # No split: null arrays, or every entry KVPLAN_NO_STATE_SPLIT.
        if draw(st.booleans()):
            split = ([NO_STATE_SPLIT] * n, [0] * n, [0] * n, [])
    elif split is None:
        split = draw_split(draw, n)
    elif draw(st.integers(0, 7)) == 7:
        split = mutate_split(draw, split)
    if split is not None:
        channels, rows, counts, groups = split
        desc.state_channels = draw_array(draw, memory, channels, ctypes.c_uint64,
                                         "state_channels", True, coherent)
        desc.state_outer_rows = draw_array(draw, memory, rows, ctypes.c_uint64,
                                           "state_outer_rows", True, coherent)
        desc.shard_group_counts = draw_array(draw, memory, counts, ctypes.c_uint8,
                                             "shard_group_counts", True, coherent)
        desc.shard_groups = draw_array(draw, memory, groups, ctypes.c_uint64, "shard_groups",
                                       True, coherent)
        # A given array holds as many values as it says; a null one may say any count.
        desc.n_shard_groups = (len(groups) if desc.shard_groups is not None or coherent else
                               draw(st.sampled_from([0, len(groups), 3, 2**63])))
    if not coherent:
        if draw(st.integers(0, 3)) == 3:
            desc.rings = memory.input_words([draw(st.sampled_from([0, 0, 2, 3])) for _ in range(n)],
                                            ctypes.c_uint64, "rings")
        desc.n_pools = draw(st.sampled_from([0, 0, 0, 1]))  # pools stays null
    return desc, split


def _layout_new(draw, lib: ctypes.CDLL, memory: Memory, handles: list[int], ptrs: list[int],
                lens: list[int], items: list[int], strides: list[int], ids: list[int],
                roles: list[bytes | None] | None, kinds: list[int], page_size: int,
                coherent: bool, version: int, split: Split | None,
                tp: tuple[int, int] | None) -> DrawnLayout:
    """kvplan_layout_new (or kvplan_layout_new4 of a version 4 descriptor around the same
    fields) on these values, each array passed valid, null or misaligned (rarely, for a
    coherent layout), and the checks of its result."""
    n = len(ptrs)
    # A coherent version 4 layout passes its version 1 fields as given (the version 1 examples
    # draw their pointers), so that its draws go to the split fields and its plans are reached.
    steady = coherent and version == 4

    def array(values: list[int], ctype: type, what: str, optional: bool) -> int | None:
        if steady:
            return memory.input_words(values, ctype, what)
        return draw_array(draw, memory, values, ctype, what, optional, coherent)

    desc = LayoutDesc()
    desc.n_entries = n
    desc.data_ptrs = array(ptrs, ctypes.c_uint64, "data_ptrs", False)
    desc.data_lens = array(lens, ctypes.c_uint64, "data_lens", False)
    desc.item_lens = array(items, ctypes.c_uint64, "item_lens", False)
    desc.strides = array(strides, ctypes.c_uint64, "strides", True)
    desc.layer_ids = array(ids, ctypes.c_int64, "layer_ids", True)
    desc.roles = None if roles is None else memory.input_strings(roles, "roles")
    desc.kinds = array(kinds, ctypes.c_uint8, "kinds", True)
    desc.page_size = page_size
    if coherent:
        assert tp is not None
        desc.tp_size, desc.tp_rank, desc.pp_size, desc.pp_rank = tp[0], tp[1], 1, 0
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
    given: ctypes.Structure = desc
    name = "kvplan_layout_new"
    if version == 4:
        given, split = desc4_of(draw, memory, desc, n, split, coherent)
        name = "kvplan_layout_new4"
    layout_new = getattr(lib, name)
    desc_mode = "valid" if steady else draw(
        st.sampled_from(["valid"] * (100 if coherent else 8) + ["null", "misaligned"]))
    desc_ptr = (None if desc_mode == "null" else
                memory.input_struct(given, "desc", 0 if desc_mode == "valid" else 4))
    out_mode = "valid" if steady else draw(
        st.sampled_from(["valid"] * (100 if coherent else 8) + ["null", "in_desc"]))
    out = memory.output_words(1, "the layout handle") if out_mode == "valid" else None
    if out_mode == "in_desc" and desc_ptr is not None:
        # The handle would land on the descriptor while it is read: refused.
        status = layout_new(desc_ptr, desc_ptr)
        check_status(lib, status, f"{name} (out inside desc)")
        assert status in (NULL_POINTER, INVALID_ARGUMENT)
        memory.check()

    status = layout_new(desc_ptr, out)
    check_status(lib, status, name)
    memory.check()
    handle = words_at(out, 1)[0] if out else 0
    if status == OK:
        assert handle != 0
        handles.append(handle)
        count = memory.output_words(1, "n_entries")
        assert lib.kvplan_layout_n_entries(handle, count) == OK
        assert words_at(count, 1) == [n]
    elif out:
        assert handle == 0, f"a failed {name} left a handle in *out"
    sliced = [(ptrs[i], lens[i], items[i]) for i in range(n)
              if split is not None and version == 4 and 0 < split[0][i] < NO_STATE_SPLIT]
    return DrawnLayout(status, handle, list(zip(ptrs, lens)), sliced if status == OK else [])


def pick_handle(draw, live: int, freed: int, other_kind: int) -> int | None:
    choice = draw(st.sampled_from(["live"] * 24 + ["null", "freed", "made_up", "other_kind"]))
    return {"live": live, "null": None, "freed": freed, "made_up": MADE_UP_HANDLE,
            "other_kind": other_kind}[choice] or None


def draw_request(draw, memory: Memory, version: int = 1, has_state: bool = False
                 ) -> tuple[int | None, RequestDesc | RequestDesc2, list[tuple[int, int]]]:
    """A request of `version` 1 or 2 (a page request, or with a state slot pair: a version 2
    request; mostly slots the layouts hold when they have state entries, mostly none when
    not), as its address, the struct and the byte ranges of its page arrays."""
    # Mostly pages every coherent layout holds (so that plans are reached), else any value.
    sane = draw(st.integers(0, 9)) < 7
    page = st.integers(0, 63) if sane else st.one_of(
        st.integers(0, 70), st.integers(-3, -1), st.sampled_from([2**40, 2**63 - 1]))
    src = draw(st.lists(page, min_size=draw(st.sampled_from([0, 1, 1, 1])), max_size=12))
    equal = sane or draw(st.booleans())
    dst = ([draw(page) for _ in src] if equal else draw(st.lists(page, max_size=12)))
    ranges = []
    request: RequestDesc | RequestDesc2 = RequestDesc() if version == 1 else RequestDesc2()
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
    if isinstance(request, RequestDesc2):
        size = ctypes.sizeof(RequestDesc2)
        request.struct_size = draw(st.sampled_from([size] * 24 + [0, ctypes.sizeof(RequestDesc)]))
        if sane and has_state != (draw(st.integers(0, 7)) == 7):
            # Slots every coherent state buffer holds (now and then one past the decode's).
            request.src_slot = draw(st.integers(0, STATE_SLOTS - 1))
            request.dst_slot = draw(st.integers(0, STATE_SLOTS))
        elif sane:
            request.src_slot = request.dst_slot = NO_SLOT
        else:
            slot = st.sampled_from([-1, -2, 0, 1, STATE_SLOTS, 2**62, -(2**63)])
            request.src_slot, request.dst_slot = draw(slot), draw(slot)
        # Window pages are given for neither side (a side bit without its pages is refused).
        request.window_sides = draw(st.sampled_from([0] * 24 + [1, 2, 3]))
    mode = draw(st.sampled_from(["valid"] * 24 + ["null", "misaligned"]))
    addr = None if mode == "null" else memory.input_struct(request, "request",
                                                           0 if mode == "valid" else 4)
    return addr, request, ranges


def inside_one(start: int, length: int, buffers: list[tuple[int, int]]) -> bool:
    return any(base <= start and start + length <= base + size for base, size in buffers)


def fuzz_one(lib: ctypes.CDLL, data: st.DataObject, v4: bool = False) -> None:
    """One example: version 1 layouts and requests, or (`v4`) version 4 layouts (state
    entries split over TP sizes, any split fields) and requests of versions 1 and 2."""
    draw = data.draw
    memory = Memory()
    layouts: list[int] = []
    templates: list[int] = []
    try:
        shape = draw_shape(draw, v4)
        src = draw_layout(draw, lib, memory, layouts, shape, 0)
        dst = draw_layout(draw, lib, memory, layouts, shape, 1)
        # A freed layout, for the use-after-free handles.
        spare = draw_layout(draw, lib, memory, [], shape, 1)
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
            plan_one(lib, draw, memory, template, src, dst, shape)

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
             src: DrawnLayout, dst: DrawnLayout, shape: Shape) -> None:
    src_buffers, dst_buffers = src.buffers, dst.buffers
    has_state = bool(shape.states)
    version = 1 if not shape.v4 else draw(st.sampled_from([2, 2, 2, 1] if has_state else [1, 2]))
    suffix = "" if version == 1 else "2"
    prepare, plan_into = f"kvplan_prepare{suffix}", f"kvplan_plan_into{suffix}"
    request, raw, page_ranges = draw_request(draw, memory, version, has_state)
    info_out = memory.output_words(5, "info")
    # A null argument, or an info struct inside the request, is refused.
    probe = draw(st.sampled_from([None, "null_request", "null_info", "info_in_request"]))
    if probe is not None and request is not None:
        status = getattr(lib, prepare)(template, None if probe == "null_request" else request,
                                       {"null_request": info_out, "null_info": None,
                                        "info_in_request": request}[probe])
        check_status(lib, status, f"{prepare} ({probe})")
        assert status in (NULL_POINTER, INVALID_ARGUMENT, INVALID_HANDLE), (
            f"{prepare} ({probe}) returned {status}")
        memory.check()
    status = getattr(lib, prepare)(template, request, info_out)
    check_status(lib, status, prepare)
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
    status = getattr(lib, plan_into)(template, request, *passed, capacity, info_ptr)
    check_status(lib, status, plan_into)
    memory.check()
    if status == OK:
        assert prepared is not None, f"{plan_into} planned a request {prepare} refused"
        n = prepared.n_blocks
        assert n <= capacity
        src_addrs, dst_addrs, lengths = (words_at(c, capacity) for c in columns)
        assert src_addrs[n:] == dst_addrs[n:] == lengths[n:] == [CANARY] * (capacity - n), (
            f"{plan_into} wrote past the plan's blocks")
        assert sum(lengths[:n]) == prepared.total_bytes
        for i in range(n):
            assert inside_one(src_addrs[i], lengths[i], src_buffers), (
                f"src block {i} outside the buffers")
            assert inside_one(dst_addrs[i], lengths[i], dst_buffers), (
                f"dst block {i} outside the buffers")
            # A slice of a split slot (less than the slot, between TP sizes or sub-blocks).
            if any(base <= src_addrs[i] < base + size and lengths[i] < item
                   for base, size, item in src.split):
                SEEN["split state", "sliced"] += 1
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


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def _fuzz4(lib: ctypes.CDLL, data: st.DataObject) -> None:
    fuzz_one(lib, data, v4=True)


def test_capi_fuzz(lib: ctypes.CDLL) -> None:
    """No input crashes the C ABI or makes it write outside the caller's buffers."""
    SEEN.clear()
    batches = 0
    deadline = time.monotonic() + BUDGET
    while True:
        _fuzz(lib)
        _fuzz4(lib)
        batches += 1
        if not EXPLORE or time.monotonic() >= deadline:
            break
    what = f"random seeds, {BUDGET:.0f} s budget" if EXPLORE else "deterministic"
    print(f"\n[fuzz capi] {batches} batch(es) of {EXAMPLES} examples of version 1 and as many "
          f"of version 4 ({what}): "
          f"{dict(sorted(SEEN.items()))}")
    for call, status in [("kvplan_plan_into", "ok"), ("kvplan_plan_into", "buffer_too_small"),
                         ("kvplan_plan_into", "invalid_argument"), ("kvplan_plan_into", "null_pointer"),
                         ("kvplan_prepare", "index_bounds"), ("kvplan_prepare", "invalid_handle"),
                         ("kvplan_layout_new", "layout"), ("kvplan_template_new", "invalid_handle"),
                         ("kvplan_template_new", "ok"),
                         ("kvplan_layout_new4", "ok"), ("kvplan_layout_new4", "layout"),
                         ("kvplan_layout_new4", "invalid_argument"),
                         ("kvplan_layout_new4", "null_pointer"), ("kvplan_prepare2", "ok"),
                         ("kvplan_plan_into2", "ok"), ("kvplan_plan_into2", "buffer_too_small"),
                         ("split state", "sliced")]:
        # At least twice, not more: hypothesis mixes the literals of every test module loaded
        # in the process into its draws, so under xdist a derandomized run's counts vary with
        # the modules a worker loaded before (the rarest path here has drawn 12 to 18 times).
        assert SEEN[call, status] >= 2, f"the draws reached {call} -> {status} only {SEEN[call, status]} times"
