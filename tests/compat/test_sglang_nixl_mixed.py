"""kvplan's ``NixlKVManager.send_kvcache_mixed`` against SGLang 0.5.23's own, on the real
``nixl/conn.py`` (loaded from the wheel by ``support.sglang_nixl``).

SGLang's mixed path (the decode registers KV entries of several memory kinds, e.g. a HiSparse
host pool) splits the entries into runs of equal ``(src kind, dst kind)``
(``_kv_xfer_mem_segments``), prepares two lists per run with ``_prep_equal_tp_dlist``
(``_init_mixed_equal_tp_prep_handles``; kvplan's builds them from the segment template's
``descriptor_runs``) and per request indexes them with
``repeat_indices_over_layers``: entry-major ``(entry - start) * slots + page``, the prefill
list with ``_num_slots_src`` slots per entry, the decode's with the segment's
``dst_num_slots``. kvplan's replacement takes the indices from ``Template.prepped_indices`` of
a template whose prepped tables are those two lists. Here, per call, SGLang's path and
kvplan's run on fresh managers (registration and send); the recording agent keeps every
prepared list and every ``make_prepped_xfer``, and each index is mapped through its list to
the ``(src, dst, len)`` descriptor it names. Where SGLang's descriptors are the right ones,
kvplan's index arrays, dtypes, handles and descriptors are identical; where the input is bad
(a negative page, a page past either list's slots, page lists of different lengths) SGLang
indexes another entry's slots or hands NIXL unequal lists, and kvplan refuses with a typed
error before anything is posted.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from support.package_shells import walk_globals
from support.sglang_models import SESSION, load_sglang_or_fail
from support.sglang_nixl import RecordingAgent, load_nixl

CALLS = 1000
KINDS = ("VRAM", "DRAM")


@pytest.fixture(scope="module")
def nx() -> Any:
    sg = load_sglang_or_fail()
    mod = load_nixl(sg)
    cls = mod.NixlKVManager
    # the mixed path's methods reach nothing but SGLang's own code and Python's
    walk_globals([cls._init_mixed_equal_tp_prep_handles, cls.send_kvcache_mixed,
                  mod._kv_xfer_mem_segments, mod.repeat_indices_over_layers], ("sglang.",))
    return types.SimpleNamespace(sg=sg, mod=mod, cls=cls)


@contextlib.contextmanager
def installed(cls: type) -> Iterator[None]:
    compat.install(cls)
    try:
        yield
    finally:
        compat.uninstall(cls)


def _rows(handle: Any) -> np.ndarray:
    """The ``(addr, len, dev)`` descriptors of a recorded prepared list (strided rows
    expanded as NIXL expands them)."""
    rows = np.asarray(handle.parts[0], dtype=np.uint64)
    if rows.shape[1] == 3:
        return rows
    out = [(a + k * s, n, d) for a, n, d, s, c in rows.tolist() for k in range(c)]
    return np.asarray(out, dtype=np.uint64).reshape(-1, 3)


class Case:
    """One geometry: prefill entries (pointers, item lengths, buffer lengths, memory kinds)
    and the decode's (pointers, item lengths, memory kinds, slot count)."""

    def __init__(self, rng: np.random.Generator) -> None:
        n = int(rng.integers(1, 9))
        self.items = [int(rng.choice([64, 576, 1152, 4096])) for _ in range(n)]
        # HiSparse: a decode host pool's slot stride may exceed the prefill's item
        self.dst_items = [it * int(rng.choice([1, 1, 2, 3])) for it in self.items]
        slots = [int(rng.integers(2, 64)) for _ in range(n)]
        self.data = [it * s for it, s in zip(self.items, slots)]
        self.ptrs = [0x1_0000_0000 + k * 0x1000_0000 for k in range(n)]
        if rng.random() < 0.3:  # per-layer buffers packed back to back
            self.ptrs = list(np.cumsum([0x2_0000_0000, *self.data[:-1]]).tolist())
        self.dst_ptrs = [0x9_0000_0000 + k * 0x1000_0000 for k in range(n)]
        self.src_kinds = [str(rng.choice(KINDS)) if rng.random() < 0.3 else "VRAM"
                          for _ in range(n)]
        self.dst_kinds = [str(rng.choice(KINDS)) for _ in range(n)]
        self.num_slots_src = min(slots)
        self.dst_num_slots = None if rng.random() < 0.4 else int(rng.integers(2, 80))
        self.strided = bool(rng.random() < 0.5)

    @property
    def dst_slots(self) -> int:
        return self.num_slots_src if self.dst_num_slots is None else self.dst_num_slots

    def manager(self, nx: Any) -> Any:
        kv_args = types.SimpleNamespace(kv_data_ptrs=list(self.ptrs),
                                        kv_data_lens=list(self.data),
                                        kv_item_lens=list(self.items),
                                        kv_data_mem_kinds=list(self.src_kinds), gpu_id=0)
        info = types.SimpleNamespace(agent_name=SESSION, gpu_id=1,
                                     dst_kv_ptrs=list(self.dst_ptrs),
                                     dst_kv_item_lens=list(self.dst_items),
                                     dst_kv_mem_kinds=list(self.dst_kinds),
                                     dst_num_slots=self.dst_num_slots, kv_xfer_segments=None)
        return nx.sg.manager_object(nx.cls, kv_args=kv_args, agent=RecordingAgent(),
                                    decode_kv_args_table={SESSION: info},
                                    prep_handles_segment_src={}, prep_handles={},
                                    _num_slots_src=self.num_slots_src,
                                    _use_strided_descs=self.strided)

    def truth(self, src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
        """Every entry's page ``src[k]`` to its page ``dst[k]``: the bytes the call means."""
        return sorted((p + int(s) * it, q + int(d) * dit, it)
                      for p, q, it, dit in zip(self.ptrs, self.dst_ptrs, self.items,
                                               self.dst_items)
                      for s, d in zip(src.tolist(), dst.tolist()))


def run(nx: Any, case: Case, patched: bool, src: np.ndarray, dst: np.ndarray
        ) -> tuple[Any, ...]:
    """Registration (``_init_mixed_equal_tp_prep_handles``, SGLang's or kvplan's) and one
    ``send_kvcache_mixed``: ``("ok", indices, descriptors,
    handles returned == handles posted)`` or ``("raise", exc, prepped calls made)``."""
    with installed(nx.cls) if patched else contextlib.nullcontext():
        mgr = case.manager(nx)
        segments = nx.mod._kv_xfer_mem_segments(case.src_kinds, case.dst_kinds)
        info = mgr.decode_kv_args_table[SESSION]
        mgr._init_mixed_equal_tp_prep_handles(info, segments)
        try:
            handles = mgr.send_kvcache_mixed(SESSION, src, dst)
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            return ("raise", exc, len(mgr.agent.prepped))
    agent = mgr.agent
    indices, descs = [], []
    for (op, local, li, remote, ri), seg in zip(agent.prepped, info.kv_xfer_segments,
                                                strict=True):
        assert op == "WRITE" and local is seg.src_handle and remote is seg.dst_handle
        indices.append((li.dtype.str, li.tolist(), ri.dtype.str, ri.tolist()))
        if len(li) != len(ri):
            descs.append(None)  # NIXL refuses unequal lists
            continue
        s_rows, d_rows = _rows(local), _rows(remote)
        if li.size and (li.min() < 0 or ri.min() < 0 or li.max() >= len(s_rows)
                        or ri.max() >= len(d_rows)):
            descs.append(None)  # NIXL refuses an index past its list
            continue
        s, d = s_rows[li], d_rows[ri]
        assert (s[:, 1] == d[:, 1]).all()
        descs.append(sorted(zip(s[:, 0].tolist(), d[:, 0].tolist(), s[:, 1].tolist())))
    assert len(handles) == len(agent.prepped) == agent.posted
    return ("ok", indices, descs)


def _pages(rng: np.random.Generator, case: Case) -> tuple[np.ndarray, np.ndarray, str]:
    m = int(rng.integers(0, min(case.num_slots_src, case.dst_slots) + 1))
    src = rng.permutation(case.num_slots_src)[:m].astype(np.int32)
    dst = rng.permutation(case.dst_slots)[:m].astype(np.int32)
    bad = rng.random()
    if m and bad < 0.04:
        src[int(rng.integers(m))] = -1 - int(rng.integers(3))
        return src, dst, "negative source page"
    if m and bad < 0.07:
        dst[int(rng.integers(m))] = -1
        return src, dst, "negative destination page"
    if m and bad < 0.10:
        src[int(rng.integers(m))] = case.num_slots_src + int(rng.integers(3))
        return src, dst, "source page past the list's slots"
    if m and bad < 0.13:
        dst[int(rng.integers(m))] = case.dst_slots + int(rng.integers(3))
        return src, dst, "destination page past the list's slots"
    if bad < 0.15:
        return src, np.concatenate([dst, np.asarray([0], np.int32)]), "unequal lengths"
    return src, dst, ""


def _mixed_case(nx: Any, rng: np.random.Generator) -> str:
    case = Case(rng)
    src, dst, bad = _pages(rng, case)
    orig, new = (run(nx, case, patched, src, dst) for patched in (False, True))
    where = (bad, case.__dict__, src.tolist(), dst.tolist())
    if not bad:
        truth = case.truth(src, dst)
        assert orig[0] == "ok", where
        # SGLang's descriptors are the right bytes, segment by segment
        assert sorted(r for seg in orig[2] for r in seg) == truth, where
        assert new == orig, where  # same indices (int32), same descriptors
        return "same"
    # SGLang posts what another entry's slots or NIXL's refusal make of it; kvplan refuses
    # with a typed error before any transfer is made
    assert orig[0] == "ok" and (None in orig[2] or sorted(
        r for seg in orig[2] for r in seg) != case.truth(src, dst)), where
    assert new[0] == "raise" and isinstance(new[1], kvplan.KvPlanError), (where, new)
    assert new[2] == 0, where
    if "page" in bad:
        assert isinstance(new[1], kvplan.IndexBoundsError), (where, new)
    return "refused"


@pytest.fixture(scope="module")
def mixed_sweep(nx: Any) -> Counter[str]:
    rng = np.random.default_rng(7727)
    return Counter(_mixed_case(nx, rng) for _ in range(CALLS))


def test_mixed_indices_equal_sglang(mixed_sweep: Counter[str]) -> None:
    assert sum(mixed_sweep.values()) == CALLS
    assert mixed_sweep["same"] >= 0.8 * CALLS and mixed_sweep["refused"] >= 60, mixed_sweep


def test_the_core_tables_are_sglangs_lists_row_for_row(nx: Any) -> None:
    """The template's prepped tables (``Template.descriptor_table``) are the lists SGLang
    prepared for each segment, descriptor for descriptor: entry-major, each entry's slots in
    order, as many slots as SGLang prepared (``_num_slots_src``, the smallest over all
    entries, where a segment's own entries may hold more; the decode's ``dst_num_slots``)."""
    rng = np.random.default_rng(11)
    for _ in range(60):
        case = Case(rng)
        with installed(nx.cls):
            mgr = case.manager(nx)
            info = mgr.decode_kv_args_table[SESSION]
            mgr._init_mixed_equal_tp_prep_handles(
                info, nx.mod._kv_xfer_mem_segments(case.src_kinds, case.dst_kinds))
            for seg in info.kv_xfer_segments:
                tpl = compat.nixl.mixed_segment_template(mgr, SESSION, info, seg)
                for side, handle in (("src", seg.src_handle), ("dst", seg.dst_handle)):
                    addrs, lens = tpl.descriptor_table(side)
                    rows = _rows(handle)
                    assert addrs.tolist() == rows[:, 0].tolist(), (side, case.__dict__)
                    assert lens.tolist() == rows[:, 1].tolist(), (side, case.__dict__)


def test_refusals_name_the_page_and_post_nothing(nx: Any) -> None:
    rng = np.random.default_rng(3)
    case = Case(rng)
    case.src_kinds = ["VRAM"] * len(case.items)
    case.dst_kinds = ["DRAM"] + ["VRAM"] * (len(case.items) - 1)
    past = np.asarray([0, case.num_slots_src], np.int32)
    with installed(nx.cls):
        mgr = case.manager(nx)
        info = mgr.decode_kv_args_table[SESSION]
        mgr._init_mixed_equal_tp_prep_handles(
            info, nx.mod._kv_xfer_mem_segments(case.src_kinds, case.dst_kinds))
        with pytest.raises(kvplan.IndexBoundsError, match=str(case.num_slots_src)):
            mgr.send_kvcache_mixed(SESSION, past, np.asarray([0, 1], np.int32))
        with pytest.raises(kvplan.KvPlanError):
            mgr.send_kvcache_mixed(SESSION, np.asarray([0, 1], np.int32),
                                   np.asarray([0], np.int32))
        assert mgr.agent.prepped == [] and mgr.agent.posted == 0


def test_an_index_past_nixls_int32_range_is_refused() -> None:
    wide = np.asarray([3, (1 << 31) + 7], np.int64)
    with pytest.raises(kvplan.IndexBoundsError, match=str((1 << 31) + 7)):
        compat.nixl._int32_indices(wide, "source")
    assert compat.nixl._int32_indices(wide[:1], "source").dtype == np.int32


def test_sglangs_errors_are_kept(nx: Any) -> None:
    case = Case(np.random.default_rng(4))
    one = np.asarray([0], np.int32)
    for patched in (False, True):
        with installed(nx.cls) if patched else contextlib.nullcontext():
            mgr = case.manager(nx)
            with pytest.raises(KeyError):
                mgr.send_kvcache_mixed("nobody", one, one)
            with pytest.raises(AssertionError):  # no mixed plan registered
                mgr.send_kvcache_mixed(SESSION, one, one)
            mgr.decode_kv_args_table[SESSION].kv_xfer_segments = []
            with pytest.raises(RuntimeError, match="Missing NIXL mixed KV transfer plan"):
                mgr.send_kvcache_mixed(SESSION, one, one)
            mgr.decode_kv_args_table[SESSION].kv_xfer_segments = None
            mgr._init_mixed_equal_tp_prep_handles(
                mgr.decode_kv_args_table[SESSION],
                nx.mod._kv_xfer_mem_segments(case.src_kinds, case.dst_kinds))
            mgr.agent.make_prepped_xfer = lambda *a, **k: None  # NIXL made no handle
            with pytest.raises(Exception, match="failed to create mixed prepped transfer"):
                mgr.send_kvcache_mixed(SESSION, one, one)


def test_lists_of_a_replaced_builder_are_indexed_by_sglangs_own_method(nx: Any) -> None:
    """A subclass's ``_prep_equal_tp_dlist`` builds lists kvplan has not seen: SGLang's own
    ``send_kvcache_mixed`` indexes them (a page past kvplan's slot count is not refused), as
    it does when an instance replaces ``_init_mixed_equal_tp_prep_handles``."""
    case = Case(np.random.default_rng(8))
    past = np.asarray([case.num_slots_src], np.int32)  # kvplan's lists refuse it
    dst = np.asarray([0], np.int32)

    def own(cls: type) -> Any:
        class Own(cls):  # type: ignore[misc,valid-type]
            def _prep_equal_tp_dlist(self, *args: Any, **kwargs: Any) -> Any:
                return cls._prep_equal_tp_dlist(self, *args, **kwargs)
        return Own

    seen = []
    for patched in (False, True):
        with installed(nx.cls) if patched else contextlib.nullcontext():
            mgr = case.manager(types.SimpleNamespace(sg=nx.sg, cls=own(nx.cls)))
            info = mgr.decode_kv_args_table[SESSION]
            mgr._init_mixed_equal_tp_prep_handles(
                info, nx.mod._kv_xfer_mem_segments(case.src_kinds, case.dst_kinds))
            mgr.send_kvcache_mixed(SESSION, past, dst)
            seen.append([(li.tolist(), ri.tolist()) for _, _, li, _, ri in mgr.agent.prepped])
    assert seen[0] == seen[1] and seen[0]
    with installed(nx.cls):
        mgr = case.manager(nx)
        info = mgr.decode_kv_args_table[SESSION]
        mgr._init_mixed_equal_tp_prep_handles(
            info, nx.mod._kv_xfer_mem_segments(case.src_kinds, case.dst_kinds))
        with pytest.raises(kvplan.IndexBoundsError):
            mgr.send_kvcache_mixed(SESSION, past, dst)
        mgr.__dict__["_init_mixed_equal_tp_prep_handles"] = lambda *a: None
        mgr.send_kvcache_mixed(SESSION, past, dst)
        assert len(mgr.agent.prepped) == len(info.kv_xfer_segments)


def test_install_lists_it_and_uninstall_restores_it(nx: Any) -> None:
    original = vars(nx.cls)["send_kvcache_mixed"]
    with installed(nx.cls):
        assert "send_kvcache_mixed" in compat.installed(nx.cls)
        assert vars(nx.cls)["send_kvcache_mixed"] is not original
    assert vars(nx.cls)["send_kvcache_mixed"] is original
