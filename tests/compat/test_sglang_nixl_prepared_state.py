"""kvplan's ``NixlKVManager._prepare_state_xfer`` and ``_send_prepared_states`` against SGLang
0.5.23's own, on the real ``nixl/conn.py`` (loaded from the wheel by ``support.sglang_nixl``).

SGLang prepares, per decode peer, one strided descriptor list per side over the state
components it moves whole, and per request indexes them (``make_prepped_xfer``). kvplan's
replacement builds the lists from the core's ``Template.descriptor_runs`` of each component's
template and takes the indices from ``Template.prepped_state_indices``. Here, per seeded case,
both register the same decode peer on fresh managers and send the same requests; the recording
agent keeps every prepared list and every prepared transfer, and each index is mapped through
its list to the ``(src, dst, len)`` descriptor it names. Where the request is good, both write
exactly the bytes a reference pairing says (entry by entry, slot to slot), and kvplan's lists
never hold more descriptors than SGLang's; where it is bad, SGLang refuses (its ``ValueError``
or ``RuntimeError``) and kvplan refuses with a typed ``kvplan.KvPlanError`` naming the values,
before any transfer is made.

SGLang's ``_PreparedStatePlan`` and ``_PreparedStateComponent`` are ``msgspec.Struct`` records;
msgspec is not installed here, so the module fixture gives the loaded module plain records of
the same fields (and puts its classes back afterwards)."""

from __future__ import annotations

import contextlib
import re
import types
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from kvplan.compat.sglang import nixl_state
from support.package_shells import walk_globals
from support.sglang_models import SESSION, load_sglang_or_fail
from support.sglang_nixl import RecordingAgent, load_nixl

CASES = 1000
SENDS = 2


class _Record:
    """A frozen ``msgspec.Struct``'s behaviour the NIXL module relies on: keyword fields."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


@pytest.fixture(scope="module")
def nx() -> Iterator[Any]:
    sg = load_sglang_or_fail()
    mod = load_nixl(sg)
    cls = mod.NixlKVManager
    saved = {name: mod.__dict__[name] for name in ("_PreparedStatePlan",
                                                   "_PreparedStateComponent")}
    mod.__dict__["_PreparedStatePlan"] = type("_PreparedStatePlan", (_Record,), {})
    mod.__dict__["_PreparedStateComponent"] = type("_PreparedStateComponent", (_Record,), {})
    # the prepared state methods reach nothing but SGLang's own code and Python's
    walk_globals([cls._prepare_state_xfer, cls._send_prepared_states,
                  cls._plan_prepared_state_component, cls._prepared_state_pairs,
                  cls._state_component_is_whole_slot, cls._build_prepared_state_plan],
                 ("sglang.",))
    try:
        yield types.SimpleNamespace(sg=sg, mod=mod, cls=cls, ST=mod.StateType)
    finally:
        mod.__dict__.update(saved)


@contextlib.contextmanager
def installed(cls: type) -> Iterator[None]:
    compat.install(cls)
    try:
        yield
    finally:
        compat.uninstall(cls)


def _expand(handle: Any) -> np.ndarray:
    rows = np.asarray(handle.parts[0], dtype=np.uint64)
    out = [(a + k * s, n) for a, n, _d, s, c in rows.tolist() for k in range(c)]
    return np.asarray(out, dtype=np.uint64).reshape(-1, 2)


PREPARED = ("MAMBA", "DSA", "QSA_PENDING", "QSA_COMPRESSED", "MINIMAX_INDEX_K", "SWA",
            "SWA_RING", "BLOCK_SCALE", "DSV4_REQUEST_STATE")
FLAT = ("MAMBA", "DSA", "QSA_PENDING", "QSA_COMPRESSED", "MINIMAX_INDEX_K")


class Component:
    """One state component's entries on both sides (pointers, buffer lengths, item lengths,
    layer ids) and its type."""

    def __init__(self, rng: np.random.Generator, k: int, mla: bool) -> None:
        self.type = str(rng.choice(PREPARED))
        flat = mla or self.type in FLAT
        n = int(rng.integers(1, 5))
        n_dst = n + int(rng.integers(1, 3)) if flat and rng.random() < 0.15 else n
        self.items = [int(rng.choice([16, 64, 96, 256])) for _ in range(n)]
        ids = [int(i) for i in rng.permutation(8)[:n]]
        extra = [i for i in range(8, 8 + n_dst - n)]
        self.src_ids: list[int] | None = ids
        self.dst_ids: list[int] | None = [int(i) for i in rng.permutation(ids + extra)]
        by_id = {i: it for i, it in zip(ids, self.items)}
        self.dst_items = [by_id.get(i, int(rng.choice([16, 64]))) for i in self.dst_ids]
        if rng.random() < 0.25:
            self.src_ids = self.dst_ids = None
            self.dst_items = self.items + [64] * (n_dst - n)
        elif rng.random() < 0.05:
            self.dst_ids = None  # one-sided ids: SGLang's positional fallback at PP 1
            self.dst_items = self.items + [64] * (n_dst - n)
        if rng.random() < 0.04:  # a stride mismatch: SGLang rejects the peer
            j = int(rng.integers(n_dst))
            self.dst_items[j] *= 2
        self.src_caps = [int(rng.integers(1, 40)) for _ in range(n)]
        self.dst_caps = [int(rng.integers(1, 40)) for _ in range(n_dst)]
        self.src_ptrs = [0x1_0000_0000 + (k * 8 + e) * 0x100_0000 for e in range(n)]
        self.dst_ptrs = [0x9_0000_0000 + (k * 8 + e) * 0x100_0000 for e in range(n_dst)]
        self.src_data = [it * c + int(rng.integers(0, it)) for it, c in zip(self.items,
                                                                             self.src_caps)]
        self.dst_data = [it * c + int(rng.integers(0, it)) for it, c in zip(self.dst_items,
                                                                             self.dst_caps)]
        for side in ("src", "dst"):  # an unregistered entry: SGLang leaves its pair out
            ptrs = getattr(self, f"{side}_ptrs")
            if rng.random() < 0.1:
                ptrs[int(rng.integers(len(ptrs)))] = 0
        if rng.random() < 0.03:  # a buffer shorter than its item: the component stays generic
            self.src_data[0] = self.items[0] // 2

    def pairs(self, flat: bool) -> list[tuple[int, int]] | None:
        """The reference pairing (SGLang's rules, written out): by layer id in occurrence
        order, positional otherwise; live pairs only."""
        n, n_dst = len(self.src_ptrs), len(self.dst_ptrs)
        if not flat or not (self.src_ids and self.dst_ids):
            if n != n_dst and not flat:
                return None
            if n_dst < n:
                return None
            pairs = [(i, i) for i in range(n)]
        else:
            where: dict[int, deque[int]] = {}
            for j, lid in enumerate(self.dst_ids):
                where.setdefault(lid, deque()).append(j)
            pairs = [(i, where[lid].popleft()) for i, lid in enumerate(self.src_ids)]
        return [(s, d) for s, d in pairs if self.src_ptrs[s] and self.dst_ptrs[d]]


class Case:
    def __init__(self, nx: Any, rng: np.random.Generator) -> None:
        self.mla = bool(rng.random() < 0.3)
        self.components = [Component(rng, k, self.mla) for k in range(int(rng.integers(1, 4)))]
        self.decode_tp = 1 if rng.random() < 0.9 else 2
        self.dcp_peer = bool(rng.random() < 0.02)
        self.nx = nx

    def manager(self, cls: type) -> Any:
        st = self.nx.ST
        cs = self.components
        kv_args = types.SimpleNamespace(
            state_types=[st[c.type] for c in cs], state_data_ptrs=[c.src_ptrs for c in cs],
            state_data_lens=[c.src_data for c in cs], state_item_lens=[c.items for c in cs],
            state_layer_ids=[c.src_ids or [] for c in cs], gpu_id=0, mla_compression_ratios=None)
        return self.nx.sg.manager_object(
            cls, kv_args=kv_args, agent=RecordingAgent(), _prepared_state_plans={},
            _state_layout_rejections={}, _prepared_state_components=frozenset(range(len(cs))),
            _use_strided_descs=True, is_mla_backend=self.mla)

    def peer(self) -> Any:
        cs = self.components
        return types.SimpleNamespace(
            agent_name=SESSION, gpu_id=1, dst_dcp_size=2 if self.dcp_peer else 1,
            requires_dcp_relayout=False, decode_tp_size=self.decode_tp,
            dst_state_data_ptrs=[c.dst_ptrs for c in cs],
            dst_state_data_lens=[c.dst_data for c in cs],
            dst_state_item_lens=[c.dst_items for c in cs],
            dst_state_layer_ids=[c.dst_ids or [] for c in cs])

    def live(self, k: int) -> list[tuple[int, int]]:
        c = self.components[k]
        return c.pairs(self.mla or c.type in FLAT) or []

    def truth(self, k: int, src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
        c = self.components[k]
        return [(c.src_ptrs[s] + a * c.items[s], c.dst_ptrs[d] + b * c.dst_items[d], c.items[s])
                for s, d in self.live(k) for a, b in zip(src, dst)]

    def slots(self, k: int) -> tuple[int, int]:
        c = self.components[k]
        live = self.live(k)
        return (min(c.src_caps[s] for s, _ in live), min(c.dst_caps[d] for _, d in live))


def prepare(case: Case, patched: bool) -> tuple[Any, tuple[Any, ...]]:
    with installed(case.nx.cls) if patched else contextlib.nullcontext():
        mgr = case.manager(case.nx.cls)
        mgr._prepare_state_xfer(case.peer())
    plan = mgr._prepared_state_plans.get(SESSION)
    rejected = SESSION in mgr._state_layout_rejections
    components = sorted(plan.components) if plan is not None else None
    lists = [_expand(h) for _, h in ((0, plan.src_handle), (1, plan.dst_handle))] \
        if plan is not None else None
    return mgr, (rejected, components, lists)


def send(case: Case, mgr: Any, patched: bool, src: list[Any], dst: list[Any]) -> tuple[Any, ...]:
    plan = mgr._prepared_state_plans[SESSION]
    before = len(mgr.agent.prepped)
    with installed(case.nx.cls) if patched else contextlib.nullcontext():
        try:
            handles = list(mgr._send_prepared_states(plan=plan, prefill_state_indices=src,
                                                     dst_state_indices=dst))
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            return ("raise", exc, len(mgr.agent.prepped) - before)
    made = mgr.agent.prepped[before:]
    assert len(handles) == len(made) <= 1
    out: list[tuple[int, int, int]] = []
    for op, local, li, remote, ri in made:
        assert op == "WRITE" and li.dtype == np.int32 and ri.dtype == np.int32
        s, d = _expand(local)[li], _expand(remote)[ri]
        assert (s[:, 1] == d[:, 1]).all()
        out += zip(s[:, 0].tolist(), d[:, 0].tolist(), s[:, 1].tolist())
    return ("ok", sorted(out))


def _request(rng: np.random.Generator, case: Case, prepared: list[int]
             ) -> tuple[list[Any], list[Any], str, list[tuple[int, int, int]]]:
    """Per-component index lists (random slots within both slot limits), possibly one bad;
    the reference byte map of a good request."""
    n = len(case.components)
    src: list[Any] = [[] for _ in range(n)]
    dst: list[Any] = [[] for _ in range(n)]
    truth: list[tuple[int, int, int]] = []
    bad = ""
    for k in prepared:
        c = case.components[k]
        m = 1 if c.type == "MAMBA" else int(rng.integers(1, 4))
        s_lim, d_lim = case.slots(k)
        a = [int(v) for v in rng.integers(0, s_lim, m)]
        b = [int(v) for v in rng.integers(0, d_lim, m)]
        r = rng.random()
        if not bad and r < 0.05:
            a[-1], bad = s_lim + int(rng.integers(0, 3)), f"prefill slot {s_lim}+"
        elif not bad and r < 0.10:
            b[0], bad = d_lim + int(rng.integers(0, 3)), f"decode slot {d_lim}+"
        elif not bad and r < 0.13:
            a[0], bad = -1 - int(rng.integers(0, 3)), "negative prefill slot"
        elif not bad and r < 0.15:
            b = b + [0]
            bad = "unequal counts"
        elif not bad and r < 0.17 and c.type == "MAMBA":
            a, b, bad = a + [0], b + [0], "two Mamba slots"
        elif not bad and r < 0.18:
            src[k], dst[k], bad = np.asarray(a, np.float64), b, "float indices"
            continue
        else:
            truth += case.truth(k, a, b)
        src[k] = np.asarray(a, dtype=rng.choice([np.int32, np.int64])) if rng.random() < 0.5 \
            else a
        dst[k] = b
    return src, dst, bad, sorted(truth)


def _case(nx: Any, rng: np.random.Generator, seen: Counter[str]) -> None:
    case = Case(nx, rng)
    (orig_mgr, orig), (new_mgr, new) = (prepare(case, patched) for patched in (False, True))
    where = case.__dict__ | {"components": [c.__dict__ for c in case.components]}
    assert orig[:2] == new[:2], (where, orig[:2], new[:2])
    if orig[0]:
        assert "stride" in orig_mgr._state_layout_rejections[SESSION]
        # kvplan's names the component, its entry pairs and both item lengths
        assert "item size mismatch" in new_mgr._state_layout_rejections[SESSION], where
        seen["prepare: rejected by both"] += 1
        return
    if orig[1] is None:
        seen["prepare: generic for both"] += 1
        return
    seen["prepare: prepared by both"] += 1
    # never more descriptors than SGLang's lists
    assert len(new[2][0]) <= len(orig[2][0]) and len(new[2][1]) <= len(orig[2][1]), where
    seen["prepare: fewer descriptors"] += int(len(new[2][0]) + len(new[2][1])
                                             < len(orig[2][0]) + len(orig[2][1]))
    for _ in range(SENDS):
        src, dst, bad, truth = _request(rng, case, orig[1])
        a, b = send(case, orig_mgr, False, src, dst), send(case, new_mgr, True, src, dst)
        info = (where, bad, src, dst, a, b)
        if not bad:
            assert a == ("ok", truth), info
            assert b == a, info
            seen["send: same bytes"] += 1
            continue
        assert b[0] == "raise" and isinstance(b[1], kvplan.KvPlanError), info
        assert b[2] == 0, info  # nothing prepared, nothing posted
        if "slot" in bad and "Mamba" not in bad:
            assert isinstance(b[1], kvplan.IndexBoundsError), info
        if a[0] == "ok":  # SGLang wrote with an index past a list or an entry
            seen["send: SGLang wrote, kvplan refused"] += 1
        else:
            assert isinstance(a[1], (ValueError, RuntimeError)), info
            seen["send: refused by both"] += 1


@pytest.fixture(scope="module")
def sweep(nx: Any) -> Counter[str]:
    rng = np.random.default_rng(60211)
    seen: Counter[str] = Counter()
    for _ in range(CASES):
        _case(nx, rng, seen)
    return seen


def test_prepared_state_plans_equal_sglang(sweep: Counter[str]) -> None:
    prepares = sum(v for k, v in sweep.items() if k.startswith("prepare: ") and
                   "fewer" not in k)
    sends = sum(v for k, v in sweep.items() if k.startswith("send: "))
    assert prepares == CASES, sweep
    assert sends >= 1000, sweep
    assert sweep["send: same bytes"] >= 0.7 * sends, sweep
    assert sweep["send: refused by both"] >= 100, sweep
    assert sweep["prepare: fewer descriptors"] >= 100, sweep
    for key in ("prepare: rejected by both", "prepare: generic for both"):
        assert sweep[key] >= 10, sweep


def _one(nx: Any, seed: int = 5) -> Case:
    rng = np.random.default_rng(seed)
    while True:
        case = Case(nx, rng)
        case.decode_tp, case.dcp_peer = 1, False
        c = case.components[0]
        c.src_ptrs = [p or 0x7_0000_0000 for p in c.src_ptrs]
        c.dst_ptrs = [p or 0xF_0000_0000 for p in c.dst_ptrs]
        c.type = "DSA"
        c.src_caps, c.dst_caps = [30] * len(c.items), [30] * len(c.dst_items)
        c.src_data = [it * 30 for it in c.items]
        c.dst_data = [it * 30 for it in c.dst_items]
        mgr, (rejected, comps, _) = prepare(case, True)
        if not rejected and comps and 0 in comps and len(case.live(0)) >= 2:
            return case


def test_refusals_name_the_values_and_post_nothing(nx: Any) -> None:
    case = _one(nx)
    s_lim, d_lim = case.slots(0)
    with installed(nx.cls):
        mgr = case.manager(nx.cls)
        mgr._prepare_state_xfer(case.peer())
        plan = mgr._prepared_state_plans[SESSION]
        assert isinstance(plan, nixl_state.PreparedStates)
        for src, dst, err, text in (
                ([[0, s_lim]], [[0, 0]], kvplan.IndexBoundsError,
                 rf"state component 0, .*{re.escape(str(case.live(0)[0]))}.*src index {s_lim} "),
                ([[0]], [[d_lim + 5]], kvplan.IndexBoundsError, f"dst index {d_lim + 5}"),
                ([[-3]], [[0]], kvplan.IndexBoundsError, "src index -3"),
                ([[0, 1]], [[0]], kvplan.KvPlanError, "2 prefill state indices but 1"),
                ([[0.0]], [[0]], kvplan.KvPlanError, "float64")):
            with pytest.raises(err, match=text):
                list(mgr._send_prepared_states(plan=plan, prefill_state_indices=src,
                                               dst_state_indices=dst))
        assert mgr.agent.prepped == [] and mgr.agent.posted == 0


def test_lists_are_the_core_runs_one_row_per_pair(nx: Any) -> None:
    """kvplan's lists are each component template's ``descriptor_runs``, one strided row per
    live entry pair with the component's slot limit; where the entries of a component hold
    equal slots they are SGLang's rows, row for row."""
    rng = np.random.default_rng(17)
    compared = 0
    for _ in range(200):
        case = Case(nx, rng)
        case.decode_tp, case.dcp_peer = 1, False
        for c in case.components:
            c.src_data = [it * 9 for it in c.items]
            c.dst_data = [it * 13 for it in c.dst_items]
        orig_mgr, orig = prepare(case, False)
        new_mgr, new = prepare(case, True)
        if orig[1] is None:
            continue
        plan = new_mgr._prepared_state_plans[SESSION]
        rows = [(h.parts[0], o.parts[0]) for h, o in (
            (plan.src_handle, orig_mgr._prepared_state_plans[SESSION].src_handle),
            (plan.dst_handle, orig_mgr._prepared_state_plans[SESSION].dst_handle))]
        for side, (mine, theirs) in zip(("src", "dst"), rows):
            runs = np.concatenate([plan.components[k].template.descriptor_runs(side)
                                   for k in sorted(plan.components)])
            assert mine[:, [0, 1, 3, 4]].tolist() == runs.tolist()
            assert len(mine) == sum(len(case.live(k)) for k in plan.components)
            assert sorted(map(tuple, mine.tolist())) == sorted(map(tuple, theirs.tolist()))
        compared += 1
    assert compared >= 50


def _own(cls: type, **methods: Any) -> type:
    return type("Own", (cls,), methods)


def test_a_subclass_keeps_its_own_seam(nx: Any) -> None:
    """A subclass's ``_send_prepared_states`` gets SGLang's plans (kvplan's
    ``_prepare_state_xfer`` defers); a subclass's ``_prepare_state_xfer`` or SGLang helper runs
    and its plans are sent by SGLang's own ``_send_prepared_states``; an instance attribute
    likewise."""
    case = _one(nx, 9)
    sglang_send = vars(nx.cls)["_send_prepared_states"]
    sglang_prepare = vars(nx.cls)["_prepare_state_xfer"]
    sglang_plan_component = vars(nx.cls)["_plan_prepared_state_component"]
    calls: list[str] = []

    def send(self: Any, **kw: Any) -> Any:
        calls.append("send")
        yield from sglang_send(self, **kw)

    def prep(self: Any, peer_info: Any) -> None:
        calls.append("prepare")
        sglang_prepare(self, peer_info)

    def plan_component(self: Any, **kw: Any) -> Any:
        calls.append("component")
        return sglang_plan_component(self, **kw)

    src, dst = [[1]], [[2]]
    want = case.truth(0, [1], [2])
    for own, expected in ((_own(nx.cls, _send_prepared_states=send), "send"),
                          (_own(nx.cls, _prepare_state_xfer=prep), "prepare"),
                          (_own(nx.cls, _plan_prepared_state_component=plan_component),
                           "component")):
        calls.clear()
        with installed(nx.cls):
            mgr = case.manager(own)
            mgr._prepare_state_xfer(case.peer())
            plan = mgr._prepared_state_plans[SESSION]
            assert not isinstance(plan, nixl_state.PreparedStates), expected
            out = send_via(mgr, plan, src, dst)
        assert expected in calls
        assert sorted(out) == sorted(want) or not want
    with installed(nx.cls):
        mgr = case.manager(nx.cls)
        mgr.__dict__["_plan_prepared_state_component"] = types.MethodType(plan_component, mgr)
        calls.clear()
        mgr._prepare_state_xfer(case.peer())
        assert calls and not isinstance(mgr._prepared_state_plans[SESSION],
                                        nixl_state.PreparedStates)


def send_via(mgr: Any, plan: Any, src: Any, dst: Any) -> list[tuple[int, int, int]]:
    list(mgr._send_prepared_states(plan=plan, prefill_state_indices=src, dst_state_indices=dst))
    out: list[tuple[int, int, int]] = []
    for _, local, li, remote, ri in mgr.agent.prepped:
        s, d = _expand(local)[li], _expand(remote)[ri]
        out += zip(s[:, 0].tolist(), d[:, 0].tolist(), s[:, 1].tolist())
    return out


def test_install_lists_them_and_uninstall_restores_them(nx: Any) -> None:
    names = ("_prepare_state_xfer", "_send_prepared_states")
    originals = {n: vars(nx.cls)[n] for n in names}
    with installed(nx.cls):
        for n in names:
            assert n in compat.installed(nx.cls)
            assert vars(nx.cls)[n] is not originals[n]
    for n in names:
        assert vars(nx.cls)[n] is originals[n]


def test_a_layout_the_core_refuses_leaves_the_component_to_the_request_path(
        nx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration never raises out of SGLang's bootstrap thread for a layout the core
    refuses (other than a stride mismatch, SGLang's own rejection): that component is left to
    the per-request path, which plans it or refuses it per request."""
    case = _one(nx, 13)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise kvplan.LayoutError("refused for the test")

    monkeypatch.setattr(nixl_state, "Layout", refuse)
    with installed(nx.cls):
        mgr = case.manager(nx.cls)
        mgr._prepare_state_xfer(case.peer())
    assert SESSION not in mgr._prepared_state_plans
    assert SESSION not in mgr._state_layout_rejections
