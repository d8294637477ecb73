"""kvplan.compat.sglang.install on SGLang 0.5.23's real ``NixlKVManager`` (nixl/conn.py, loaded
from the wheel by ``support.sglang_nixl``), against SGLang's own methods.

Each call runs on the original and on the patched manager with a recording NIXL agent (NIXL's
call signatures); the descriptor rows each hands the agent are mapped to bytes (a destination
byte map) and compared, with the ground truth of where each byte belongs. Where SGLang's bytes
are right kvplan's must be identical, with no more descriptors; where SGLang raises, or would
write the wrong entry or outside a buffer, kvplan raises a typed ``kvplan.KvPlanError``. The
random sweeps (fixed seeds, at least 1,000 calls per method) run once per module.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from kvplan.compat._methods import host_version
from support.sglang_models import (
    SESSION,
    Deployment,
    canonical,
    load_sglang_or_fail,
    request,
)
from support.sglang_nixl import RecordingAgent, load_nixl

CALLS = 1000
#: The truth of a bad input (pages past a buffer, page lists of different lengths): no byte
#: map is right, so whatever SGLang writes (even nothing) is wrong and kvplan must refuse.
NO_RIGHT_ANSWER = [(-1, -1, -1)]


@pytest.fixture(scope="module")
def nx() -> Any:
    sg = load_sglang_or_fail()
    mod = load_nixl(sg)
    return types.SimpleNamespace(sg=sg, mod=mod, cls=mod.NixlKVManager)


@contextlib.contextmanager
def installed(cls: type, **kw: Any) -> Iterator[None]:
    compat.install(cls, **kw)
    try:
        yield
    finally:
        compat.uninstall(cls)


def nixl_manager(nx: Any, *, kv_args: types.SimpleNamespace, **attrs: Any) -> Any:
    kv_args.gpu_id = 0
    attrs.setdefault("prep_handles", {})
    attrs.setdefault("src_mem_kind", "VRAM")
    attrs.setdefault("decode_kv_args_table", {})
    return nx.sg.manager_object(nx.cls, kv_args=kv_args, agent=RecordingAgent(), **attrs)


def run(nx: Any, patched: bool, call: Callable[[Any], Any], make: Callable[[], Any]
        ) -> tuple[Any, ...]:
    """``call(manager)`` on a fresh manager, SGLang's own methods or kvplan's:
    ``("ok", byte map, descriptors)`` or ``("raise", exc)``."""
    ctx = installed(nx.cls) if patched else contextlib.nullcontext()
    with ctx:
        mgr = make()
        try:
            call(mgr)
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            return ("raise", exc)
    agent = mgr.agent
    return ("ok", canonical(agent.written()), agent.descriptor_count())


def judge(orig: tuple[Any, ...], new: tuple[Any, ...], truth: list[tuple[int, int, int]] | None,
          where: str) -> str:
    """'same' where SGLang is right (kvplan equal, no more descriptors), 'refused' where
    SGLang raises or is wrong and kvplan raises a typed error, 'fixed' where SGLang is wrong
    or raises and kvplan writes the right bytes."""
    if orig[0] == "ok" and (truth is None or orig[1] == truth):
        assert new[0] == "ok", f"kvplan raised {new[1]!r} where SGLang is right: {where}"
        assert new[1] == orig[1], where
        assert new[2] <= orig[2], (new[2], orig[2], where)
        return "same"
    if new[0] == "ok" and truth and new[1] == truth:
        # SGLang guessed the decode's layout wrong or failed on it (IndexError past its
        # slice); kvplan wrote the right bytes
        return "fixed"
    assert new[0] == "raise", (
        f"SGLang {'raised ' + repr(orig[1]) if orig[0] == 'raise' else 'wrote wrong bytes'} "
        f"and kvplan did not refuse: {where}")
    assert isinstance(new[1], kvplan.KvPlanError), (where, new[1])
    return "refused"


# ---------------------------------------------------------------------------------------------
# install / uninstall, and the signature check
# ---------------------------------------------------------------------------------------------
def test_install_uninstall_restore_the_class_exactly(nx: Any) -> None:
    before = dict(vars(nx.cls))
    names = compat.install(nx.cls)
    assert set(names) == {"_send_kvcache_generic", "_send_mamba_state", "_prep_equal_tp_dlist",
                          "_init_hetero_tp_prep_handle", "send_kvcache_staged",
                          "_send_mamba_state_slice", "_init_mixed_equal_tp_prep_handles",
                          "send_kvcache_mixed", "_prepare_state_xfer", "_send_prepared_states"}
    assert names == compat.REPLACED_METHODS["NixlKVManager"]
    assert compat.installed(nx.cls) == names
    assert compat.install(nx.cls) == ()
    assert compat.uninstall(nx.cls) == names
    assert dict(vars(nx.cls)) == before


def test_a_method_of_another_signature_is_refused_naming_it(nx: Any) -> None:
    class Changed(nx.cls):  # type: ignore[misc,name-defined]
        def _send_mamba_state(self, peer_name, prefill_state_indices, src_state_data_ptrs,
                              src_state_item_lens, dst_state_data_ptrs, dst_state_indices,
                              dst_gpu_id, src_layer_ids=None, dst_layer_ids=None,
                              dst_state_item_lens=None):  # type: ignore[no-untyped-def]
            return None

    before = dict(vars(Changed))
    with pytest.raises(kvplan.IncompatibleHostError) as info:
        compat.install(Changed)
    err = info.value
    assert (err.cls, err.method) == ("Changed", "_send_mamba_state")
    assert "dst_state_item_lens=None" in err.seen
    # the wheel's files run without its metadata here: the version is what the host publishes
    assert err.host_version == host_version(nx.cls.__module__)
    assert f"SGLang {err.host_version}:" in str(err) and "Nothing was replaced" in str(err)
    assert "(SGLang 0.5.23)" in str(err)  # the supported form, with its release
    assert compat.installed(Changed) == () and dict(vars(Changed)) == before


def test_start_up_hook_targets_the_nixl_module() -> None:
    from kvplan.compat.sglang import autoinstall

    assert autoinstall.TARGETS["sglang.srt.disaggregation.nixl.conn"] == "NixlKVManager"


# ---------------------------------------------------------------------------------------------
# _send_kvcache_generic (send_kvcache, and the layer-id path of maybe_send_extra)
# ---------------------------------------------------------------------------------------------
def _deployment(rng: np.random.Generator) -> Deployment:
    kind = str(rng.choice(["mla", "mha"]))
    pp = int(rng.choice([1, 2, 4]))
    num_layers = int(rng.integers(pp, 9))
    hybrid = bool(rng.random() < 0.25)
    kv_layers = list(range(0, num_layers, 2 if hybrid else 1))
    pp = min(pp, len(kv_layers))
    return Deployment(kind, num_layers, kv_layers, pp, int(rng.integers(0, pp)), hybrid=hybrid,
                      draft_layers=int(rng.choice([0, 0, 1])),
                      publish_ids=bool(rng.random() < 0.5),
                      item_seed=int(rng.integers(0, 1 << 30)))


def _generic_case(nx: Any, rng: np.random.Generator) -> tuple[str, str]:
    dep = _deployment(rng)
    src, dst = request(rng, fragmented=bool(rng.random() < 0.5))
    bad = rng.random()
    if bad < 0.05:  # a prefill page past the buffer
        src[int(rng.integers(0, src.size))] = 64 + int(rng.integers(0, 8))
    elif bad < 0.08:  # page lists of different lengths
        dst = dst[:-1] if dst.size > 1 else dst[:0]
    sptrs, _, items, sids = dep.src_lists()
    dptrs, _, dids = dep.dst_lists()
    with_ids = dep.kind == "mla" and dep.publish_ids and rng.random() < 0.5
    attrs = dict(is_mla_backend=dep.kind == "mla", pp_size=dep.pp_size,
                 decode_kv_args_table={SESSION: dep.register_info()})
    if dep.kind == "mha":
        attrs["kvplan_decode_kv_layers"] = len(dep.kv_layers)

    def call(mgr: Any) -> Any:
        if with_ids:
            return mgr._send_kvcache_generic(SESSION, mgr.kv_args.kv_data_ptrs, dptrs, items,
                                             src, dst, 3, src_layer_ids=sids or None,
                                             dst_layer_ids=dids or None)
        return mgr.send_kvcache(SESSION, src, dptrs, dst, 3)

    def make() -> Any:
        return nixl_manager(nx, kv_args=dep.kv_args(), **attrs)

    orig, new = run(nx, False, call, make), run(nx, True, call, make)
    truth = dep.truth(src, dst) if src.shape == dst.shape and src.max(initial=0) < 64 \
        else NO_RIGHT_ANSWER
    verdict = judge(orig, new, truth, f"{dep} ids={with_ids} src={src.tolist()} "
                                      f"dst={dst.tolist()}")
    return verdict, f"{dep.kind} pp{dep.pp_size}"


@pytest.fixture(scope="module")
def generic_sweep(nx: Any) -> Counter[tuple[str, str]]:
    rng = np.random.default_rng(20261206)
    return Counter(_generic_case(nx, rng) for _ in range(CALLS))


def test_generic_equals_sglang_wherever_sglang_is_right(
        generic_sweep: Counter[tuple[str, str]]) -> None:
    assert sum(generic_sweep.values()) >= CALLS
    same = Counter(shape for (verdict, shape) in generic_sweep if verdict == "same")
    for shape in ("mla pp1", "mla pp2", "mla pp4", "mha pp1", "mha pp2", "mha pp4"):
        assert same[shape] > 0, (shape, generic_sweep)
    # the bad inputs (pages past the buffer, unequal lists) and SGLang's wrong slicing
    assert sum(n for (v, _), n in generic_sweep.items() if v == "refused") >= 30


def test_a_page_past_the_buffer_is_refused_where_sglang_reads_past_it(nx: Any) -> None:
    dep = Deployment("mla", 4, [0, 1, 2, 3], 1, 0)
    dptrs, _, _ = dep.dst_lists()
    src, dst = np.array([3, 64], np.int32), np.array([0, 1], np.int32)

    def call(mgr: Any) -> Any:
        return mgr.send_kvcache(SESSION, src, dptrs, dst, 0)

    def make() -> Any:
        return nixl_manager(nx, kv_args=dep.kv_args(), is_mla_backend=True)

    orig = run(nx, False, call, make)
    assert orig[0] == "ok"  # SGLang reads page 64 of a 64-page buffer
    new = run(nx, True, call, make)
    assert new[0] == "raise" and isinstance(new[1], kvplan.IndexBoundsError), new


def test_descriptors_are_maximal_runs_not_blocks(nx: Any) -> None:
    # pages contiguous on both sides: one descriptor per entry pair, as SGLang's runs
    dep = Deployment("mha", 3, [0, 1, 2], 1, 0)
    dptrs, _, _ = dep.dst_lists()
    src, dst = np.arange(4, 36, dtype=np.int32), np.arange(10, 42, dtype=np.int32)

    def call(mgr: Any) -> Any:
        return mgr.send_kvcache(SESSION, src, dptrs, dst, 0)

    def make() -> Any:
        return nixl_manager(nx, kv_args=dep.kv_args())

    new = run(nx, True, call, make)
    assert new[0] == "ok" and new[2] == 6  # 3 layers x (K, V), one run each
    assert new[1] == dep.truth(src, dst)


def test_the_prepared_path_stays_sglangs(nx: Any) -> None:
    dep = Deployment("mla", 2, [0, 1], 1, 0)
    dptrs, _, _ = dep.dst_lists()
    src, dst = np.array([1, 2, 5], np.int32), np.array([7, 8, 0], np.int32)
    info = dep.register_info()
    info.dst_num_slots = 96
    out = []
    for patched in (False, True):
        with installed(nx.cls) if patched else contextlib.nullcontext():
            mgr = nixl_manager(nx, kv_args=dep.kv_args(), is_mla_backend=True,
                               prep_handles={"": "src-list", SESSION: "dst-list"},
                               decode_kv_args_table={SESSION: info}, _num_slots_src=64)
            mgr.send_kvcache(SESSION, src, dptrs, dst, 0)
        (_, s_side, s_idx, d_side, d_idx), = mgr.agent.prepped
        out.append((s_side, s_idx.tolist(), d_side, d_idx.tolist()))
    assert out[0] == out[1]


# ---------------------------------------------------------------------------------------------
# send_kvcache_dcp: SGLang's dispatch, kvplan's generic on each part (flat, token rows)
# ---------------------------------------------------------------------------------------------
def _dcp_case(nx: Any, rng: np.random.Generator) -> str:
    n_target = int(rng.integers(1, 5))
    n_draft = int(rng.choice([0, 1]))
    row = [int(rng.choice([576, 656, 1152])) for _ in range(n_target + n_draft)]
    tokens = 256
    sptrs = [0x1_0000_0000 + i * 0x100000 for i in range(n_target + n_draft)]
    regions = list(rng.permutation(n_target + n_draft + 1)[: n_target + n_draft])
    dst_all = [0x9_0000_0000 + i * 0x100000 for i in range(n_target + n_draft + 1)]
    n = int(rng.integers(1, 40))
    ts = rng.choice(tokens, size=n, replace=False).astype(np.int64)
    td = rng.choice(tokens, size=n, replace=False).astype(np.int64)
    if rng.random() < 0.05:
        ts[0] = tokens + 3  # a source token row past the buffer
    nd = int(rng.integers(0, 6)) if n_draft else 0
    plan = types.SimpleNamespace(
        target_src_token_indices=ts, target_dst_token_indices=td,
        draft_src_token_indices=rng.choice(tokens, size=nd, replace=False).astype(np.int64),
        draft_dst_token_indices=rng.choice(tokens, size=nd, replace=False).astype(np.int64))
    info = types.SimpleNamespace(dcp_token_item_lens=row, dst_kv_ptrs=dst_all,
                                 dcp_dst_region_indices=regions, gpu_id=1,
                                 dst_homogeneous_mem_kind="VRAM")
    kv = types.SimpleNamespace(kv_data_ptrs=sptrs, kv_data_lens=[tokens * r for r in row],
                               kv_item_lens=row, num_draft_entries=n_draft,
                               prefill_start_layer=0, mla_compression_ratios=None)

    def make() -> Any:
        # the layouts' buffers are the token rows here, so kvplan bounds them by kv_data_lens
        return nixl_manager(nx, kv_args=kv, is_mla_backend=True)

    def call(mgr: Any) -> Any:
        return mgr.send_kvcache_dcp(SESSION, info, plan, None)

    truth = []
    for part, (s_idx, d_idx) in enumerate(((ts, td), (plan.draft_src_token_indices,
                                                      plan.draft_dst_token_indices))):
        entries = range(n_target) if part == 0 else range(n_target, n_target + n_draft)
        for e in entries:
            for s, d in zip(s_idx.tolist(), d_idx.tolist()):
                truth.append((sptrs[e] + s * row[e], dst_all[regions[e]] + d * row[e], row[e]))
    if ts.max() >= tokens:
        truth = NO_RIGHT_ANSWER
    orig, new = run(nx, False, call, make), run(nx, True, call, make)
    return judge(orig, new, truth if truth is NO_RIGHT_ANSWER else canonical(truth),
                 f"dcp {row} {regions}")


@pytest.fixture(scope="module")
def dcp_sweep(nx: Any) -> Counter[str]:
    rng = np.random.default_rng(5301)
    return Counter(_dcp_case(nx, rng) for _ in range(CALLS))


def test_dcp_parts_equal_sglang(dcp_sweep: Counter[str]) -> None:
    assert sum(dcp_sweep.values()) >= CALLS
    assert dcp_sweep["same"] >= 0.9 * CALLS and dcp_sweep["refused"] > 0, dcp_sweep


# ---------------------------------------------------------------------------------------------
# _send_mamba_state
# ---------------------------------------------------------------------------------------------
def _state_case(nx: Any, rng: np.random.Generator) -> str:
    n_layers = int(rng.integers(1, 7))
    pp = int(rng.choice([1, 2]))
    all_ids = sorted(rng.choice(40, size=n_layers, replace=False).tolist())
    src_ids = all_ids[: max(1, n_layers // pp)] if pp > 1 else list(all_ids)
    slots = 8
    items = {i: int(rng.choice([0, 96, 128, 4096])) if rng.random() < 0.1
             else int(rng.choice([96, 128, 4096])) for i in all_ids}
    sptrs = [0x1_0000_0000 + k * 0x1000000 for k in range(len(src_ids))]
    dptrs = [0x9_0000_0000 + k * 0x1000000 for k in range(len(all_ids))]
    if rng.random() < 0.1:
        dptrs[int(rng.integers(0, len(dptrs)))] = 0  # SGLang skips a null decode pointer
    publish = rng.random() < 0.8 or pp == 1
    s_slot, d_slot = int(rng.integers(0, slots)), int(rng.integers(0, slots))
    if rng.random() < 0.05:
        s_slot = slots + 1  # past the prefill's slot buffer
    kv = types.SimpleNamespace(
        kv_data_ptrs=[], kv_data_lens=[], kv_item_lens=[], prefill_start_layer=0,
        state_data_ptrs=[sptrs], state_data_lens=[[slots * items[i] for i in src_ids]])
    s_items = [items[i] for i in src_ids]

    def make() -> Any:
        return nixl_manager(nx, kv_args=kv, pp_size=pp)

    def call(mgr: Any) -> Any:
        return mgr._send_mamba_state(SESSION, [s_slot], sptrs, s_items, dptrs, [d_slot], 2,
                                     src_ids if publish else None,
                                     all_ids if publish else None)

    where = {lid: j for j, lid in enumerate(all_ids)}
    truth = [(sptrs[k] + s_slot * items[lid], dptrs[where[lid]] + d_slot * items[lid],
              items[lid]) for k, lid in enumerate(src_ids) if dptrs[where[lid]]]
    orig, new = run(nx, False, call, make), run(nx, True, call, make)
    # a slot past the buffer is wrong only where some pair reads it
    reads_past = s_slot >= slots and any(n for _, _, n in truth)
    return judge(orig, new, NO_RIGHT_ANSWER if reads_past else canonical(truth),
                 f"state ids={src_ids}/{all_ids} pp={pp} publish={publish} slot={s_slot}")


@pytest.fixture(scope="module")
def state_sweep(nx: Any) -> Counter[str]:
    rng = np.random.default_rng(5302)
    return Counter(_state_case(nx, rng) for _ in range(CALLS))


def test_state_equals_sglang_wherever_sglang_is_right(state_sweep: Counter[str]) -> None:
    assert sum(state_sweep.values()) >= CALLS
    assert state_sweep["same"] >= 0.8 * CALLS and state_sweep["refused"] > 0, state_sweep


# ---------------------------------------------------------------------------------------------
# _prep_equal_tp_dlist: the strided rows
# ---------------------------------------------------------------------------------------------
def _dlist_case(nx: Any, rng: np.random.Generator) -> str:
    n = int(rng.integers(1, 9))
    items = [int(rng.choice([64, 576, 1152, 4096])) for _ in range(n)]
    slots = [int(rng.integers(1, 300)) for _ in range(n)]
    data = [it * s for it, s in zip(items, slots)]
    ptrs = [0x1_0000_0000 + k * 0x10000000 for k in range(n)]
    xfer = None if rng.random() < 0.5 else [int(rng.integers(1, it + 1)) for it in items]
    num_slots = None if rng.random() < 0.5 else int(rng.integers(1, min(slots) + 1))
    bad = rng.random()
    if bad < 0.03:
        xfer = list(items)
        xfer[0] += 1  # a transfer length past its stride: SGLang's ValueError
    elif bad < 0.06:
        num_slots = max(slots) + 5  # rows past a registered buffer
    elif bad < 0.08:
        data = data[:-1] if n > 1 else [*data, 1]  # unequal lists: SGLang's ValueError
    strided = bool(rng.random() < 0.5)

    def make() -> Any:
        return nixl_manager(nx, kv_args=types.SimpleNamespace(), _use_strided_descs=strided)

    def call(mgr: Any) -> Any:
        return mgr._prep_equal_tp_dlist(SESSION, ptrs, items, data, 0, num_slots=num_slots,
                                        mem_kind="VRAM", kv_xfer_lens=xfer)

    rows = []
    for patched in (False, True):
        with installed(nx.cls) if patched else contextlib.nullcontext():
            mgr = make()
            try:
                call(mgr)
                rows.append(("ok", [r.tolist() for _, r, _ in mgr.agent.dlists]))
            except Exception as exc:  # noqa: BLE001
                rows.append(("raise", exc))
    orig, new = rows
    past = num_slots is not None and any(num_slots > s for s in slots) and len(data) == n
    if orig[0] == "ok" and not past:
        assert new == orig, (orig, new)
        return "same"
    assert new[0] == "raise" and isinstance(new[1], kvplan.KvPlanError), (orig, new)
    return "refused"


@pytest.fixture(scope="module")
def dlist_sweep(nx: Any) -> Counter[str]:
    rng = np.random.default_rng(5303)
    return Counter(_dlist_case(nx, rng) for _ in range(CALLS))


def test_prepared_rows_equal_sglang(dlist_sweep: Counter[str]) -> None:
    assert sum(dlist_sweep.values()) >= CALLS
    assert dlist_sweep["same"] >= 0.85 * CALLS and dlist_sweep["refused"] > 0, dlist_sweep


def test_prepared_rows_are_one_per_entry(nx: Any) -> None:
    with installed(nx.cls):
        mgr = nixl_manager(nx, kv_args=types.SimpleNamespace(), _use_strided_descs=True)
        mgr._prep_equal_tp_dlist("", [0x1000, 0x9000], [64, 128], [64 * 10, 128 * 10], 0)
    (_, rows, _), = mgr.agent.dlists
    assert rows.tolist() == [[0x1000, 64, 0, 64, 10], [0x9000, 128, 0, 128, 10]]



# ---------------------------------------------------------------------------------------------
# _init_hetero_tp_prep_handle: prepared head-slice lists, then SGLang's send_kvcache_slice
# ---------------------------------------------------------------------------------------------
def _mixed_manager(nx: Any, items: list[int], dst_items: list[int], kinds: list[str],
                   slots: int, registered: list[int] | None = None) -> Any:
    n = len(items)
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=[0x1_0000_0000 + k * 0x1000_0000 for k in range(n)],
        kv_data_lens=registered or [it * slots for it in items], kv_item_lens=list(items),
        kv_data_mem_kinds=["VRAM"] * n)
    info = types.SimpleNamespace(
        agent_name=SESSION, gpu_id=1, dst_kv_ptrs=[0x9_0000_0000 + k * 0x1000_0000
                                                    for k in range(n)],
        dst_kv_item_lens=list(dst_items), dst_kv_mem_kinds=list(kinds), dst_num_slots=None,
        kv_xfer_segments=None)
    return nixl_manager(nx, kv_args=kv_args, decode_kv_args_table={SESSION: info},
                        prep_handles_segment_src={}, _num_slots_src=slots,
                        _use_strided_descs=True)


def test_mixed_lists_are_the_segment_templates_runs(nx: Any) -> None:
    """The mixed path's prepared lists and its indices are one template per memory-kind
    segment: each list is that template's ``Template.descriptor_runs`` (NIXL's strided rows
    with the segment's device), and ``send_kvcache_mixed`` indexes them with the same cached
    template's ``prepped_indices`` (the lists were built by a loop of their own, which only a
    test kept equal to the template's tables)."""
    with installed(nx.cls):
        assert "_init_mixed_equal_tp_prep_handles" in compat.installed(nx.cls)
        mgr = _mixed_manager(nx, [64, 576, 1152], [128, 576, 2304], ["VRAM", "DRAM", "DRAM"], 6)
        info = mgr.decode_kv_args_table[SESSION]
        segments = nx.mod._kv_xfer_mem_segments(["VRAM"] * 3, info.dst_kv_mem_kinds)
        mgr._init_mixed_equal_tp_prep_handles(info, segments)
        assert [(s.start, s.end, s.dst_num_slots) for s in info.kv_xfer_segments] == \
            [(0, 1, 6), (1, 3, 6)]
        for seg in info.kv_xfer_segments:
            tpl = compat.nixl.mixed_segment_template(mgr, SESSION, info, seg)
            for side, handle, dev in (("src", seg.src_handle, 0), ("dst", seg.dst_handle,
                                                                   1 if seg.start == 0 else 0)):
                runs = tpl.descriptor_runs(side)
                rows = handle.parts[0]
                assert rows[:, [0, 1, 3, 4]].tolist() == runs.tolist(), side
                assert set(rows[:, 2].tolist()) == {dev}, side
        # the send path finds the same templates in the peer's cache: nothing is rebuilt
        built = len(compat.nixl.template_cache(mgr))
        pages = np.asarray([5, 0, 2], np.int32)
        handles = mgr.send_kvcache_mixed(SESSION, pages, pages[::-1].copy())
        assert len(handles) == 2 and len(compat.nixl.template_cache(mgr)) == built


def test_mixed_lists_refuse_slots_past_a_buffer_and_overlapping_strides(nx: Any) -> None:
    """Where SGLang would prepare descriptors past a prefill buffer (a slot count above what
    an entry registered) or a decode stride below the item it receives (SGLang's
    ``ValueError``), kvplan's registration refuses with a typed error naming the values."""
    with installed(nx.cls):
        mgr = _mixed_manager(nx, [64, 64], [64, 64], ["DRAM", "DRAM"], 8,
                             registered=[64 * 8, 64 * 5])
        info = mgr.decode_kv_args_table[SESSION]
        segments = nx.mod._kv_xfer_mem_segments(["VRAM"] * 2, info.dst_kv_mem_kinds)
        with pytest.raises(kvplan.IndexBoundsError, match=r"entry 1: 8 prepared slots"):
            mgr._init_mixed_equal_tp_prep_handles(info, segments)
        assert info.kv_xfer_segments is None and not mgr.agent.dlists
        mgr = _mixed_manager(nx, [128], [64], ["DRAM"], 4)
        info = mgr.decode_kv_args_table[SESSION]
        with pytest.raises(kvplan.LayoutError, match="stride 64 is smaller than its item_len 128"):
            mgr._init_mixed_equal_tp_prep_handles(
                info, nx.mod._kv_xfer_mem_segments(["VRAM"], ["DRAM"]))


def _asked(tp_p: int, tp_d: int, r_d: int) -> list[int]:
    """Prefill ranks SGLang 0.5.23's decode rank ``r_d`` asks for KV."""
    if tp_d > tp_p:
        return [r_d // (tp_d // tp_p)]
    k = tp_p // tp_d
    return list(range(r_d * k, (r_d + 1) * k))


_ORACLE_CHECKED: set[tuple[int, int, int, int]] = set()
HETERO = [(h, p, d, page) for h in (1, 2, 4, 8, 16) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)
          for page in (1, 4, 16) if p != d]


def _hetero_case(nx: Any, rng: np.random.Generator, heads: int, tp_p: int, tp_d: int,
                 page: int, r_d: int, r_p: int) -> str:
    from support.sglang_loader import load_head_slicing

    load_head_slicing(nx.sg)
    layers, head_bytes, cap = int(rng.integers(1, 4)), int(rng.choice([8, 16])), 12
    si = page * max(1, heads // tp_p) * head_bytes
    di = page * max(1, heads // tp_d) * head_bytes
    sptrs = [0x1_0000_0000 + e * 0x100000 for e in range(2 * layers)]
    dptrs = [0x9_0000_0000 + e * 0x100000 for e in range(2 * layers)]
    ids = list(range(layers)) * 2 if rng.random() < 0.5 else []
    n = int(rng.integers(1, cap))
    dst_slots = cap + 4 if rng.random() < 0.5 else None  # None: the prefill's slot count
    src = rng.choice(cap, size=n, replace=False).astype(np.int32)
    dst = rng.choice(dst_slots or cap, size=n, replace=False).astype(np.int32)
    info = types.SimpleNamespace(
        dst_kv_ptrs=dptrs, dst_kv_item_len=di, dst_kv_item_lens=[di] * len(dptrs),
        dst_kv_layer_ids=ids, decode_tp_size=tp_d, decode_tp_rank=r_d,
        dst_num_slots=dst_slots, gpu_id=1)
    strided = bool(rng.random() < 0.5)

    def make() -> Any:
        kv = types.SimpleNamespace(
            kv_data_ptrs=sptrs, kv_data_lens=[si * cap] * len(sptrs),
            kv_item_lens=[si] * len(sptrs), kv_layer_ids=ids, page_size=page,
            total_kv_head_num=heads, kv_head_num=max(1, heads // tp_p), engine_rank=r_p,
            prefill_start_layer=0, num_draft_entries=0)
        return nixl_manager(nx, kv_args=kv, attn_tp_size=tp_p, prep_handle_slice_src=None,
                            prep_handles_slice_dst={}, _use_strided_descs=strided,
                            decode_kv_args_table={SESSION: info})

    out = []
    for patched in (False, True):
        with installed(nx.cls) if patched else contextlib.nullcontext():
            mgr = make()
            try:
                mgr._init_hetero_tp_prep_handle(SESSION, info)
                mgr.send_kvcache_slice(SESSION, src, dst)
            except Exception as exc:  # noqa: BLE001
                out.append(("raise", exc))
                continue
        (_, s_side, s_idx, d_side, d_idx), = mgr.agent.prepped
        expand = mgr._expand_stride_descs
        s_rows = expand(s_side.parts[0]) if s_side.parts[0].shape[1] == 5 else s_side.parts[0]
        d_rows = expand(d_side.parts[0]) if d_side.parts[0].shape[1] == 5 else d_side.parts[0]
        blocks = list(zip(s_rows[s_idx, 0].tolist(), d_rows[d_idx, 0].tolist(),
                          s_rows[s_idx, 1].tolist()))
        out.append(("ok", [r.tolist() for _, r, _ in mgr.agent.dlists],
                    mgr.prep_handle_slice_src[1:], mgr.prep_handles_slice_dst[SESSION][1:],
                    canonical(blocks)))
    orig, new = out
    where = f"heads={heads} tp {tp_p}->{tp_d} r_p={r_p} r_d={r_d} page={page} ids={bool(ids)}"
    if orig[0] == "ok":
        assert new == orig, where  # the same rows, group index, slot counts and bytes
        return "same"
    if new[0] == "ok":
        # SGLang cannot prepare these lists (its assertion); kvplan's must write the oracle's
        # bytes: the heads this rank (as the replica elected for r_d) and r_d have in common.
        # The (slow) oracle runs on the first such call of each geometry.
        if (heads, tp_p, tp_d, page) in _ORACLE_CHECKED:
            return "fixed"
        _ORACLE_CHECKED.add((heads, tp_p, tp_d, page))
        from kvplan.compat.sglang.templates import elected_replica
        from kvplan.testing.fixtures import byte_map_of_blocks, oracle_byte_map

        geo = dict(page_size=page, kv_heads=heads, head_dim=head_bytes, dtype_size=1,
                   memory_order="NHD")
        roles = ["k"] * layers + ["v"] * layers
        lids = list(range(layers)) * 2
        src_l = kvplan.Layout(sptrs, [si * cap] * len(sptrs), si, lids, roles,
                              tp_rank=elected_replica(r_p, r_d, heads, tp_p, tp_d),
                              tp_size=tp_p, **geo)
        dst_l = kvplan.Layout(dptrs, [di * (cap + 4)] * len(dptrs), di, lids, roles,
                              tp_rank=r_d, tp_size=tp_d, **geo)
        want = oracle_byte_map([src_l], dst_l, src.tolist(), dst.tolist())
        assert byte_map_of_blocks(new[4]) == want, where
        return "fixed"
    assert isinstance(new[1], kvplan.KvPlanError), (where, orig, new)
    return "refused"


@pytest.fixture(scope="module")
def hetero_sweep(nx: Any) -> Counter[str]:
    rng = np.random.default_rng(5304)
    verdicts: Counter[str] = Counter()
    for heads, tp_p, tp_d, page in HETERO:
        for r_d in range(tp_d):
            for r_p in _asked(tp_p, tp_d, r_d):
                verdicts[_hetero_case(nx, rng, heads, tp_p, tp_d, page, r_d, r_p)] += 1
    return verdicts


def test_prepared_head_slice_lists_equal_sglang(hetero_sweep: Counter[str]) -> None:
    assert sum(hetero_sweep.values()) >= CALLS, hetero_sweep
    # "fixed": replicated heads where SGLang's group count is 0 (heads < the decode TP over
    # the prefill TP) and its own assertion stops it; kvplan prepares the oracle's bytes
    assert hetero_sweep["same"] >= 0.8 * sum(hetero_sweep.values()), hetero_sweep
    assert set(hetero_sweep) <= {"same", "fixed"}, hetero_sweep


def test_a_refusal_propagates_under_status_mode_and_is_logged(
        nx: Any, caplog: pytest.LogCaptureFixture) -> None:
    # SGLang's NIXL worker fails the one room whose send raises; a -1 status would instead be
    # taken for a transfer handle
    dep = Deployment("mla", 2, [0, 1], 1, 0)
    dptrs, _, _ = dep.dst_lists()
    with installed(nx.cls, on_error="status"), caplog.at_level("ERROR", "kvplan.compat.sglang"):
        mgr = nixl_manager(nx, kv_args=dep.kv_args(), is_mla_backend=True)
        with pytest.raises(kvplan.IndexBoundsError):
            mgr.send_kvcache(SESSION, np.array([99], np.int32), dptrs, np.array([0], np.int32), 0)
    assert "kvplan refused _send_kvcache_generic for peer decode-peer:1" in caplog.text
    assert mgr.agent.transfers == []


def test_a_replaced_slicer_is_called_as_sglang_calls_it(nx: Any) -> None:
    # a subclass's own get_mha_kv_ptrs_with_pp is SGLang's seam: kvplan hands the call to
    # SGLang's method, which calls it, rather than pairing by the registered layer ids
    calls: list[int] = []

    class Traced(nx.cls):  # type: ignore[misc,name-defined]
        def get_mha_kv_ptrs_with_pp(self, src_kv_ptrs, dst_kv_ptrs):  # type: ignore[no-untyped-def]
            calls.append(len(src_kv_ptrs))
            return super().get_mha_kv_ptrs_with_pp(src_kv_ptrs, dst_kv_ptrs)

    dep = Deployment("mha", 2, [0, 1], 1, 0)
    dptrs, _, _ = dep.dst_lists()
    src, dst = np.array([1, 2], np.int32), np.array([5, 9], np.int32)
    with installed(nx.cls):
        mgr = nx.sg.manager_object(Traced, kv_args=dep.kv_args(), agent=RecordingAgent(),
                                   prep_handles={}, src_mem_kind="VRAM",
                                   decode_kv_args_table={SESSION: dep.register_info()})
        mgr.kv_args.gpu_id = 0
        mgr.send_kvcache(SESSION, src, dptrs, dst, 0)
    assert calls == [4]
    assert canonical(mgr.agent.written()) == dep.truth(src, dst)

