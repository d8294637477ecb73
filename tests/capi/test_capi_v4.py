"""Version 4 of the C ABI (``KvplanLayoutDesc4``, ``kvplan_layout_new4``) through ctypes: hybrid
layouts whose state entries declare a TP channel split (channels per rank or
``KVPLAN_NO_STATE_SPLIT``, outer rows, shard groups as counts plus one flat array; replicated
slots) plan, between any prefill and decode TP sizes of 1, 2 and 4 and any ranks, the blocks
``Template.plan`` plans for the same layouts built with ``Layout.with_state(channels=,
outer_rows=, shard_groups=)``, block for block, through request structs of versions 1 to 3;
a template both refuse is refused with the same message; every malformed split is a status and
a message naming the values."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvplan

from support.capi import (
    ENTRY_PAGE,
    ENTRY_STATE,
    HEAD_SLICING,
    INVALID_ARGUMENT,
    LAYOUT,
    MAX_SHARD_GROUPS,
    NO_SLOT,
    NO_STATE_SPLIT,
    NO_TOKENS,
    NULL_POINTER,
    OK,
    LayoutDesc,
    LayoutDesc3,
    LayoutDesc4,
    PlanInfo,
    RequestDesc,
    RequestDesc2,
    RequestDesc3,
)
from support.capi import error as _error
from support.capi import c_array, both_templates

u64p = ctypes.POINTER(ctypes.c_uint64)
SLOTS = 4  # state slots of every state buffer
PAGES = 16  # pages of every page buffer
PAGE_SIZE = 16
PAGE_ITEM = 64
TP_SIZES = (1, 2, 4)
CASES = 300




@dataclass
class State:
    """One state entry of the model (role ``s<layer>``), as both TP sizes hold it."""

    layer: int
    split: str  # "sharded", "replicated" (0 channels) or "whole" (no split)
    rows: int = 1
    model: int = 0  # the model's channels (sharded)
    groups: list[int] = field(default_factory=list)  # shard groups at TP 1 (sharded)
    per_channel: int = 1  # bytes of one channel (sharded)
    whole: int = 0  # bytes of a replicated or whole slot
    in_base: bool = False  # a whole slot given by Layout(kinds=) rather than with_state

    @property
    def role(self) -> str:
        return f"s{self.layer}"

    def channels(self, tp: int) -> int | None:
        """``state_channels`` at TP ``tp``: this rank's channels, 0 or ``None`` (no split)."""
        return {"sharded": self.model // tp, "replicated": 0, "whole": None}[self.split]

    def item(self, tp: int) -> int:
        if self.split == "sharded":
            return self.rows * (self.model // tp) * self.per_channel
        return self.whole


@dataclass
class Entry:
    """One entry of a side, in the order both descriptors give them (``channels`` ``None``:
    no split)."""

    kind: str
    layer: int
    role: str
    item: int
    n_items: int
    channels: int | None = None
    rows: int = 0
    groups: list[int] = field(default_factory=list)


@dataclass
class Side:
    """One peer at TP ``tp``, rank ``rank``: the model's page entries and whole slots given
    to ``Layout`` in ``order``, then each other state entry appended by ``with_state``."""

    base: int
    tp: int
    rank: int
    states: list[State]
    order: list[int]  # base entries: -1 - i for page entry i, k for self.states[k]
    # How the C descriptor gives what it may leave out (null arrays) and how Python is called.
    forms: np.random.Generator | None = None

    def base_entries(self) -> list[Entry]:
        out = []
        for k in self.order:
            if k < 0:
                out.append(Entry("page", -1 - k, "kv", PAGE_ITEM, PAGES))
            else:
                s = self.states[k]
                out.append(Entry("state", s.layer, s.role, s.item(self.tp), SLOTS))
        return out

    def appended(self) -> list[Entry]:
        return [Entry("state", s.layer, s.role, s.item(self.tp), SLOTS, s.channels(self.tp),
                      s.rows, list(s.groups))
                for s in self.states if not s.in_base]

    def entries(self) -> list[Entry]:
        return self.base_entries() + self.appended()

    def ptr(self, k: int) -> int:
        return self.base + (k << 32)

    def python(self) -> kvplan.Layout:
        base = self.base_entries()
        layout = kvplan.Layout(
            [self.ptr(k) for k in range(len(base))], [e.item * e.n_items for e in base],
            [e.item for e in base], [e.layer for e in base], [e.role for e in base],
            kinds=[e.kind for e in base], page_size=PAGE_SIZE, tp_rank=self.rank,
            tp_size=self.tp)
        rng = self.forms or np.random.default_rng(0)
        for k, e in enumerate(self.appended(), start=len(base)):
            kwargs: dict[str, object] = {}
            if e.channels is not None:
                scalar = bool(rng.random() < 0.5)
                kwargs["channels"] = e.channels if scalar else [e.channels]
                if e.rows != 1 or rng.random() < 0.5:
                    kwargs["outer_rows"] = e.rows if scalar else [e.rows]
                if e.groups or rng.random() < 0.5:
                    kwargs["shard_groups"] = [e.groups or None]
            layout = layout.with_state(e.role, [self.ptr(k)], [e.item * e.n_items], [e.item],
                                       [e.layer], **kwargs)  # type: ignore[arg-type]
        return layout

    def desc4(self) -> tuple[LayoutDesc4, dict[str, ctypes.Array]]:  # type: ignore[type-arg]
        """The C descriptor and the arrays it points to (kept alive by the caller); arrays a
        layout may leave out are left out (null) at random when they say nothing."""
        entries = self.entries()
        n = len(entries)
        rng = self.forms or np.random.default_rng(0)
        channels = [NO_STATE_SPLIT if e.channels is None else e.channels for e in entries]
        rows = [0 if e.channels is None else e.rows for e in entries]
        counts = [len(e.groups) for e in entries]
        groups = [g for e in entries for g in e.groups]
        arrays = {
            "ptrs": c_array([self.ptr(k) for k in range(n)], ctypes.c_uint64),
            "lens": c_array([e.item * e.n_items for e in entries], ctypes.c_uint64),
            "items": c_array([e.item for e in entries], ctypes.c_uint64),
            "ids": c_array([e.layer for e in entries], ctypes.c_int64),
            "roles": (ctypes.c_char_p * n)(*[e.role.encode() for e in entries]),
            "kinds": c_array([ENTRY_STATE if e.kind == "state" else ENTRY_PAGE for e in entries],
                          ctypes.c_uint8),
            "channels": c_array(channels, ctypes.c_uint64),
            "rows": c_array(rows, ctypes.c_uint64),
            "counts": c_array(counts, ctypes.c_uint8),
            "groups": c_array(groups, ctypes.c_uint64),
        }
        addr = {k: ctypes.addressof(a) for k, a in arrays.items()}
        base = LayoutDesc(n, addr["ptrs"], addr["lens"], addr["items"], None, addr["ids"],
                          addr["roles"], addr["kinds"], PAGE_SIZE, self.rank, self.tp, 0, 1,
                          None)
        split = any(e.channels is not None for e in entries)
        some_rows = any(e.channels is not None and e.rows != 1 for e in entries)
        desc = LayoutDesc4(
            ctypes.sizeof(LayoutDesc4), base, None, None, None, 0, None,
            addr["channels"] if split or rng.random() < 0.5 else None,
            addr["rows"] if some_rows or (split and rng.random() < 0.5) else None,
            addr["counts"] if groups or (split and rng.random() < 0.5) else None,
            addr["groups"] if groups else None, len(groups))
        return desc, arrays

    def c(self, lib: ctypes.CDLL) -> ctypes.c_void_p:
        desc, _keep = self.desc4()
        handle = ctypes.c_void_p()
        status = lib.kvplan_layout_new4(ctypes.byref(desc), ctypes.byref(handle))
        assert status == OK, _error(lib)
        return handle



@dataclass
class CRequest:
    """A request of pages and/or a slot pair, as the struct of ABI ``version`` gives it."""

    src: list[int]
    dst: list[int]
    slot: tuple[int, int] | None
    version: int

    def desc(self) -> tuple[ctypes.Structure, list[object]]:
        arrays = [c_array(self.src, ctypes.c_int64), c_array(self.dst, ctypes.c_int64)]
        a, b = (ctypes.addressof(x) for x in arrays)
        s, d = self.slot if self.slot is not None else (NO_SLOT, NO_SLOT)
        desc: ctypes.Structure
        if self.version == 1:
            assert self.slot is None
            desc = RequestDesc(a, len(self.src), b, len(self.dst), NO_TOKENS, 0)
        elif self.version == 2:
            desc = RequestDesc2(ctypes.sizeof(RequestDesc2), a, len(self.src), b, len(self.dst),
                                NO_TOKENS, 0, s, d, 0, None, 0, None, 0)
        else:
            desc = RequestDesc3(ctypes.sizeof(RequestDesc3), a, len(self.src), b, len(self.dst),
                                NO_TOKENS, 0, s, d, None, 0, None, 0)
        return desc, list(arrays)

    def python(self) -> kvplan.Request:
        if not self.src and not self.dst:
            return kvplan.Request(slot=self.slot)
        return kvplan.Request(np.array(self.src, dtype=np.int64),
                              np.array(self.dst, dtype=np.int64), slot=self.slot)


def _plan(lib: ctypes.CDLL, template: ctypes.c_void_p, request: CRequest
          ) -> tuple[int, str, np.ndarray | None]:
    suffix = "" if request.version == 1 else str(request.version)
    prepare, plan_into = (getattr(lib, f"kvplan_prepare{suffix}"),
                          getattr(lib, f"kvplan_plan_into{suffix}"))
    desc, _keep = request.desc()
    info = PlanInfo()
    status = prepare(template, ctypes.byref(desc), ctypes.byref(info))
    if status != OK:
        return status, _error(lib), None
    n = info.n_blocks
    out = np.zeros((3, n + 1), dtype=np.uint64)
    cols = [out[i].ctypes.data_as(u64p) for i in range(3)]
    status = plan_into(template, ctypes.byref(desc), *cols, ctypes.c_size_t(n),
                       ctypes.byref(info))
    assert status == OK, _error(lib)
    assert info.n_blocks == n and not out[:, n].any(), "the C ABI wrote past the plan's blocks"
    assert int(out[2, :n].sum()) == info.total_bytes
    return status, "", out[:, :n]


def _compare(lib: ctypes.CDLL, py: kvplan.Template, c: ctypes.c_void_p,
             request: CRequest) -> np.ndarray | None:
    """The C ABI's blocks, equal to Python's plan; ``None`` when both refuse (same message)."""
    status, message, blocks = _plan(lib, c, request)
    try:
        plan = py.plan(request.python())
    except kvplan.KvPlanError as err:
        assert status != OK, f"Python refused ({err}) but the C ABI planned"
        assert message == str(err)
        return None
    assert status == OK, f"the C ABI refused ({message}) but Python planned"
    assert blocks is not None
    np.testing.assert_array_equal(blocks[0], plan.src_addrs)
    np.testing.assert_array_equal(blocks[1], plan.dst_addrs)
    np.testing.assert_array_equal(blocks[2], plan.lengths)
    return blocks


def test_abi_version_is_4_or_later(lib: ctypes.CDLL) -> None:
    assert lib.kvplan_abi_version() >= 4


def _draw_state(rng: np.random.Generator, layer: int) -> State:
    split = str(rng.choice(["sharded"] * 3 + ["replicated", "whole"]))
    if split == "sharded":
        # Sub-blocks of a multiple of 4 channels divide over every TP size drawn.
        groups = [4 * int(rng.integers(1, 5)) for _ in range(int(rng.integers(0, 5)))]
        model = sum(groups) if groups else 4 * int(rng.integers(1, 9))
        return State(layer, split, int(rng.integers(1, 4)), model, groups,
                     int(rng.choice([1, 2, 4])))
    rows = int(rng.integers(1, 4)) if split == "replicated" else 1
    return State(layer, split, rows, whole=8 * int(rng.integers(1, 9)),
                 in_base=split == "whole" and bool(rng.random() < 0.5))


def _overlaps(tp_p: int, r_p: int, tp_d: int, r_d: int) -> bool:
    """Whether the two ranks hold some channel of a split evenly over each side's ranks."""
    return r_p * tp_d < (r_d + 1) * tp_p and r_d * tp_p < (r_p + 1) * tp_d


def _pages(rng: np.random.Generator, n: int) -> list[int]:
    return [int(p) for p in rng.permutation(PAGES)[:n]]


def test_split_state_plans_the_blocks_python_plans(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(20261207)
    planned = refused = templates_refused = sliced = replicated = 0
    for case in range(CASES):
        n_pages = int(rng.integers(1, 3))
        states = [_draw_state(rng, layer) for layer in range(int(rng.integers(1, 5)))]
        base = [-1 - i for i in range(n_pages)] + [k for k, s in enumerate(states) if s.in_base]
        order = [int(k) for k in rng.permutation(base)]
        tp_p, tp_d = (int(t) for t in rng.choice(TP_SIZES, 2))
        r_d = int(rng.integers(0, tp_d))
        ranks = [r for r in range(tp_p) if _overlaps(tp_p, r, tp_d, r_d)]
        r_p = int(rng.choice(ranks)) if rng.random() < 0.8 else int(rng.integers(0, tp_p))
        src = Side(1 << 44, tp_p, r_p, states, order, rng)
        dst_states = states
        if rng.random() < 0.05 and any(s.split == "sharded" for s in states):
            # The decode describes one state's channels in other rows: both refuse the pair.
            k = next(k for k, s in enumerate(states) if s.split == "sharded")
            dst_states = list(states)
            dst_states[k] = State(**{**vars(states[k]), "rows": states[k].rows + 1})
        dst = Side(2 << 44, tp_d, r_d, dst_states, order, rng)
        for side in (src, dst):
            assert side.python().state_channels == [
                None if e.channels is None else (e.channels, e.rows, e.groups)
                for e in side.entries()]
        py, c, message = both_templates(lib, src, dst)
        if py is None:
            assert "outer rows" in message, message
            templates_refused += 1
            continue
        assert c is not None
        for _ in range(2):
            form = str(rng.choice(["slot", "pages+slot", "pages"], p=[0.3, 0.5, 0.2]))
            n = int(rng.integers(1, 5)) if form != "slot" else 0
            slot = None
            if form != "pages":
                # Now and then a slot past the decode's buffers: both refuse, naming it.
                slot = (int(rng.integers(0, SLOTS)),
                        int(rng.integers(0, SLOTS + (rng.random() < 0.04))))
            version = int(rng.choice([2, 3] if slot is not None else [1, 2, 3]))
            request = CRequest(_pages(rng, n), _pages(rng, n), slot, version)
            blocks = _compare(lib, py, c, request)
            if blocks is None:
                refused += 1
                continue
            planned += 1
            entries = src.entries()
            for src_addr, length in zip(blocks[0], blocks[2]):
                e = entries[(int(src_addr) - src.base) >> 32]
                sliced += e.channels is not None and e.channels > 0 and int(length) < e.item
                replicated += e.channels == 0
        assert lib.kvplan_template_free(c) == OK, case
    # The draws reached what they are for: slices between TP sizes, replicated slots from
    # the elected rank, refused pairs and refused requests.
    assert planned >= 500 and sliced >= 500 and replicated >= 50, (planned, sliced, replicated)
    assert refused > 0 and templates_refused > 0, (refused, templates_refused)


def _conv_side(tp: int = 1, rank: int = 0) -> Side:
    """A KV page entry, then a conv state of q|k|v sub-blocks (8, 8, 16 channels of 2 bytes)
    in 3 rows, a temporal state of 8 channels of 64 bytes in 1 row and a replicated slot of
    40 bytes: the layout ``rust/kvplan-capi/tests/state_split.rs`` builds."""
    states = [State(0, "sharded", 3, 32, [8, 8, 16], 2), State(1, "sharded", 1, 8, [], 64),
              State(2, "replicated", 1, whole=40)]
    return Side(1 << 44, tp, rank, states, [-1])


def test_the_mirrors_struct_size_is_accepted_and_others_are_refused(lib: ctypes.CDLL) -> None:
    for size, want in [(ctypes.sizeof(LayoutDesc4), OK),
                       (ctypes.sizeof(LayoutDesc3), INVALID_ARGUMENT),
                       (ctypes.sizeof(LayoutDesc4) + 8, INVALID_ARGUMENT), (0, INVALID_ARGUMENT)]:
        desc, _keep = _conv_side().desc4()
        desc.struct_size = size
        handle = ctypes.c_void_p()
        status = lib.kvplan_layout_new4(ctypes.byref(desc), ctypes.byref(handle))
        assert status == want, (size, _error(lib))
        if status == OK:
            assert lib.kvplan_layout_free(handle) == OK
        else:
            message = _error(lib)
            assert not handle.value and "struct_size" in message and str(size) in message, message


Edit = Callable[[LayoutDesc4, dict[str, ctypes.Array]], None]  # type: ignore[type-arg]


def _set(name: str, index: int, value: int) -> Edit:
    def edit(desc: LayoutDesc4, arrays: dict[str, ctypes.Array]) -> None:  # type: ignore[type-arg]
        arrays[name][index] = value
    return edit


def _groups(counts: list[int], groups: list[int]) -> Edit:
    def edit(desc: LayoutDesc4, arrays: dict[str, ctypes.Array]) -> None:  # type: ignore[type-arg]
        arrays["counts"] = c_array(counts, ctypes.c_uint8)
        arrays["groups"] = c_array(groups, ctypes.c_uint64)
        desc.shard_group_counts = ctypes.addressof(arrays["counts"])
        desc.shard_groups = ctypes.addressof(arrays["groups"])
        desc.n_shard_groups = len(groups)
    return edit


def _field(name: str, value: int | None) -> Edit:
    def edit(desc: LayoutDesc4, arrays: dict[str, ctypes.Array]) -> None:  # type: ignore[type-arg]
        setattr(desc, name, value)
    return edit


def _both(*edits: Edit) -> Edit:
    def edit(desc: LayoutDesc4, arrays: dict[str, ctypes.Array]) -> None:  # type: ignore[type-arg]
        for e in edits:
            e(desc, arrays)
    return edit


# (what, edit of the conv side's descriptor, status, words of the message, and for a split the
# core refuses, that split of entry 1 as Python's with_state takes it: (channels, outer rows,
# shard groups)).
BAD: list[tuple[str, Edit, int, list[str], tuple[int, int, list[int]] | None]] = [
    ("channels not dividing the item", _set("channels", 1, 7), LAYOUT,
     ["entry 1 (s0)", "192", "3 rows of 7 channels"], (7, 3, [8, 8, 16])),
    ("groups not summing to channels x TP", _groups([0, 3, 0, 0], [8, 8, 8]), LAYOUT,
     ["entry 1", "[8, 8, 8]", "24", "32"], (32, 3, [8, 8, 8])),
    ("more groups than the core keeps", _groups([0, 5, 0, 0], [8, 8, 8, 4, 4]), LAYOUT,
     ["entry 1", f"at most {MAX_SHARD_GROUPS} shard groups, got 5"], (32, 3, [8, 8, 8, 4, 4])),
    ("a group of 0 channels", _groups([0, 3, 0, 0], [8, 0, 24]), LAYOUT,
     ["entry 1", "positive channel counts", "[8, 0, 24]"], (32, 3, [8, 0, 24])),
    ("0 rows", _set("rows", 1, 0), LAYOUT,
     ["entry 1 (state_channels[1] = 32)", "at least 1 outer row, got 0"], (32, 0, [8, 8, 16])),
    ("groups on a replicated slot", _groups([0, 3, 0, 1], [8, 8, 16, 4]), LAYOUT,
     ["entry 3 (state_channels[3] = 0)", "replicated", "[4]"], None),
    ("a split on a page entry", _both(_set("channels", 0, 1), _set("rows", 0, 1)), LAYOUT,
     ["entry 0", "applies to state entries"], None),
    ("a null shard_groups with a count", _field("shard_groups", None), NULL_POINTER,
     ["shard_groups is null but its length is 3"], None),
    ("counts and values of unequal lengths", _field("n_shard_groups", 2), INVALID_ARGUMENT,
     ["shard_group_counts sum to 3 shard groups, but n_shard_groups is 2"], None),
    ("null counts with values", _field("shard_group_counts", None), INVALID_ARGUMENT,
     ["shard_group_counts is null: it gives 0 shard groups, but n_shard_groups is 3"], None),
    ("rows without channels", _field("state_channels", None), INVALID_ARGUMENT,
     ["state_outer_rows is not null, but state_channels is null"], None),
    ("rows on an entry without a split", _set("rows", 0, 1), INVALID_ARGUMENT,
     ["state_outer_rows[0] is 1", "KVPLAN_NO_STATE_SPLIT"], None),
    ("groups on an entry without a split", _groups([1, 3, 0, 0], [8, 8, 8, 16]),
     INVALID_ARGUMENT, ["shard_group_counts[0] is 1 (groups [8])", "KVPLAN_NO_STATE_SPLIT"],
     None),
]


@pytest.mark.parametrize(("what", "edit", "status", "words", "python"), BAD,
                         ids=[case[0] for case in BAD])
def test_bad_splits_are_refused_naming_the_values(
        lib: ctypes.CDLL, what: str, edit: Edit, status: int, words: list[str],
        python: tuple[int, int, list[int]] | None) -> None:
    side = _conv_side()
    desc, arrays = side.desc4()
    edit(desc, arrays)
    handle = ctypes.c_void_p()
    got = lib.kvplan_layout_new4(ctypes.byref(desc), ctypes.byref(handle))
    message = _error(lib)
    assert got == status, (what, got, message)
    assert not handle.value, "a refused descriptor left a handle"
    assert lib.kvplan_last_error_kind().decode() == lib.kvplan_status_name(status).decode()
    for word in words:
        assert word in message, (word, message)
    if python is not None:
        # The same split through Python: a LayoutError whose reason is the C message's.
        channels, rows, groups = python
        e = side.entries()[1]
        with pytest.raises(kvplan.LayoutError) as err:
            kvplan.Layout([side.ptr(0)], [PAGE_ITEM * PAGES], [PAGE_ITEM], [0], ["kv"],
                          page_size=PAGE_SIZE).with_state(
                e.role, [side.ptr(1)], [e.item * SLOTS], [e.item], [e.layer],
                channels=channels, outer_rows=rows, shard_groups=[groups])
        # The same words. Where the core's split itself is refused, each names the layout entry
        # and the values of its own arguments before the core's reason: the C ABI its
        # descriptor's state_channels[1], Python its with_state's channels[0], outer_rows[0]
        # and shard_groups[0].
        if message != str(err.value):
            reason = message.split("): ", 1)[-1]
            assert message == f"entry 1 (state_channels[1] = {channels}): {reason}", message
            assert str(err.value) == (
                f"entry 1 (channels[0] = {channels}, outer_rows[0] = "
                f"{1 if rows is None else rows}, shard_groups[0] = {groups}): {reason}"), err.value


def test_a_descriptor_without_splits_plans_as_version_3(lib: ctypes.CDLL) -> None:
    """Null split arrays (or every entry ``KVPLAN_NO_STATE_SPLIT``) make the version 3 layout."""
    def unsplit(base: int) -> Side:
        side = _conv_side()
        side.base = base
        side.states = [State(s.layer, "whole", whole=s.item(1)) for s in side.states]
        return side

    def v3(side: Side) -> ctypes.c_void_p:
        desc4, _keep = side.desc4()
        desc = LayoutDesc3(ctypes.sizeof(LayoutDesc3), desc4.base, None, None, None, 0, None)
        handle = ctypes.c_void_p()
        assert lib.kvplan_layout_new3(ctypes.byref(desc), ctypes.byref(handle)) == OK
        return handle

    src, dst = unsplit(1 << 44), unsplit(2 << 44)
    request = CRequest([0, 3], [2, 1], (1, 2), 2)
    want = []
    for make in (v3, lambda s: s.c(lib)):
        for seed in range(4):  # null arrays or all KVPLAN_NO_STATE_SPLIT, by the draw
            src.forms = dst.forms = np.random.default_rng(seed)
            s, d = make(src), make(dst)
            template = ctypes.c_void_p()
            assert lib.kvplan_template_new(s, d, None, ctypes.byref(template)) == OK
            assert lib.kvplan_layout_free(s) == OK and lib.kvplan_layout_free(d) == OK
            status, message, blocks = _plan(lib, template, request)
            assert status == OK and blocks is not None, message
            want.append(blocks)
            assert lib.kvplan_template_free(template) == OK
    for blocks in want:
        np.testing.assert_array_equal(blocks, want[0])
    # One block per entry: two pages, three whole slots.
    assert want[0][2].tolist() == [PAGE_ITEM, PAGE_ITEM, 192, 512, 40]


def test_sides_that_split_differently_are_refused_at_the_template(lib: ctypes.CDLL) -> None:
    src, dst = _conv_side(), _conv_side(2, 0)
    dst.base = 2 << 44
    # The decode's conv state in 2 rows of 16 channels of 2 bytes: other rows than the
    # prefill's 3 (and another item, 64 bytes).
    dst.states[0] = State(0, "sharded", 2, 32, [8, 8, 16], 2)
    py, c, message = both_templates(lib, src, dst)
    assert py is None and c is None
    assert "outer rows" in message and "3" in message and "2" in message, message
    s, d = src.c(lib), dst.c(lib)
    template = ctypes.c_void_p()
    assert lib.kvplan_template_new(s, d, None, ctypes.byref(template)) == HEAD_SLICING
    assert not template.value
    assert lib.kvplan_layout_free(s) == OK and lib.kvplan_layout_free(d) == OK
