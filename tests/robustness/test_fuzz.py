"""Fuzzing of the public Python API with hypothesis.

Two modes, chosen by the hypothesis profile (tests/conftest.py):

- deterministic (default, CI): each target runs a fixed number of batches, batch ``k`` with
  hypothesis seed ``k``, so every run checks the same examples and a green run means the code
  is right, not that the draw was kind;
- explore (``scripts/fuzz [seconds]``): each target runs batches with fresh random seeds until
  its share of ``KVPLAN_FUZZ_SECONDS`` is spent and prints how many examples it ran. A failure
  found this way is added to the suite as an ``@example`` or a fixed test.

Properties, on every input:
- an accepted layout round-trips (wire bytes and dict) and its template's pairs equal the
  reference's (tests/support/reference.py); a rejected one raises KvPlanError / TypeError /
  OverflowError (Python ints out of the u64 / i64 range), never anything else;
- an accepted plan equals the reference's blocks, every block lies inside its entry's buffer,
  sum of lengths = pages x bytes per page, and with check_dst_overlap no destination item is
  written twice; a rejected request is rejected exactly when the reference rejects it, with the
  matching exception class (argument type errors before value errors, as docs/api.md states);
- wire decoding of mutated or random bytes raises KvPlanError or yields a valid layout.
"""

from __future__ import annotations

import os
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import kvplan
from kvplan import (
    IndexBoundsError,
    KvPlanError,
    Layout,
    Pairing,
    PairingError,
    SizeMismatchError,
    Template,
)

from support import reference as ref
from support.robustness_checks import accepts_index_array, assert_invariants, ref_layout

# Minutes of hypothesis batches: CI and scripts/test run them, a plain local pytest does not.
pytestmark = pytest.mark.slow

EXPLORE = os.environ.get("KVPLAN_HYPOTHESIS_PROFILE") == "explore"
BUDGET = float(os.environ.get("KVPLAN_FUZZ_SECONDS", "40"))
SHARES = {"plan": 0.5, "wire": 0.2, "free": 0.3}
# Deterministic mode: batches per target (batch k uses seed k); about as long as the old 40 s budget.
BATCHES = {"plan": 30, "wire": 20, "free": 30}
U64_MAX = 2**64 - 1
ACCEPTABLE = (KvPlanError, TypeError, OverflowError)

BATCH = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def run_for(share: str, test, counter: dict) -> None:
    """Runs the hypothesis test `test` in batches: a fixed, seeded set in deterministic mode;
    fresh random seeds until this target's time share is spent in explore mode."""
    batches = 0
    if EXPLORE:
        deadline = time.monotonic() + BUDGET * SHARES[share]
        while True:
            test()
            batches += 1
            if time.monotonic() >= deadline:
                break
        what = f"{BUDGET * SHARES[share]:.0f} s budget, random seeds"
    else:
        for k in range(BATCHES[share]):
            seed(k)(test)()
            batches += 1
        what = f"seeds 0..{BATCHES[share] - 1}"
    print(f"\n[fuzz {share}] {counter['n']} examples in {batches} batches "
          f"({what}); {dict((k, v) for k, v in counter.items() if k != 'n')}")
    assert counter["n"] >= 50 * batches * 0.5  # the body really ran


# ------------------------------------------------------------------------------ strategies


@st.composite
def buffers(draw, n: int, item: int | None = None):
    """n buffers: (ptrs, lens, items), with capacities from 0 up and addresses up to 2**64."""
    ptrs, lens, items = [], [], []
    for _ in range(n):
        it = item if item is not None else draw(st.sampled_from([0, 1, 8, 64, 64, 1152, 3]))
        cap = draw(st.one_of(st.integers(0, 40), st.sampled_from([0, 1, 2**20, 2**40])))
        ln = it * cap + draw(st.integers(0, max(it - 1, 0)))
        ln = min(ln, U64_MAX - 4096)
        where = draw(st.sampled_from(["low", "gib", "top", "any"]))
        if where == "low":
            p = draw(st.integers(0, 2**20)) * 64
        elif where == "gib":
            p = draw(st.integers(1, 64)) << 32
        elif where == "top":
            p = U64_MAX - ln - draw(st.integers(0, 3))
        else:
            p = draw(st.integers(0, U64_MAX - ln))
        ptrs.append(p)
        lens.append(ln)
        items.append(it)
    return ptrs, lens, items


@st.composite
def layouts(draw, ids_pool: list[int], item: int | None):
    """A layout from any constructor, sometimes with draft and state entries appended."""
    kind = draw(st.sampled_from(["raw", "mla", "mha", "hybrid", "npu"]))
    ids = draw(st.lists(st.sampled_from(ids_pool), min_size=0, max_size=6)) if ids_pool else []
    publish = draw(st.booleans())
    if kind == "raw":
        ptrs, lens, items = draw(buffers(len(ids) or draw(st.integers(0, 4)), item))
        roles = draw(st.sampled_from([None, "kv", "mixed"]))
        role_list = None if roles is None else (
            ["kv"] * len(ptrs) if roles == "kv" else draw(st.lists(st.sampled_from(["k", "v"]), min_size=len(ptrs), max_size=len(ptrs)))
        )
        layout = Layout(ptrs, lens, items, ids if publish and ids else None, role_list)
    elif kind == "mla":
        ptrs, lens, items = draw(buffers(len(ids), item))
        layout = Layout.mla(ptrs, lens, items, layer_ids=ids if publish else None)
    elif kind == "mha":
        k = draw(buffers(len(ids), item))
        v = draw(buffers(len(ids), item))
        layout = Layout.mha(k[0], v[0], k[1], v[1], k[2], v[2], layer_ids=ids if publish else None)
    elif kind == "hybrid":
        full = sorted(set(ids))
        mla = draw(st.booleans())
        ptrs, lens, items = draw(buffers(len(full) * (1 if mla else 2), item))
        layout = Layout.hybrid_linear(full, ptrs, lens, items, mla=mla)
    else:
        groups = draw(st.integers(1, 3))
        ptrs, lens, items = draw(buffers(len(ids) * groups + draw(st.sampled_from([0, 0, 0, 1])), item))
        layout = Layout.npu_groups(ids, ptrs, lens, items)
    if draw(st.integers(0, 4)) == 0:
        n = draw(st.integers(1, 2))
        ptrs, lens, items = draw(buffers(n, item))
        layout = layout.with_draft(ptrs, lens, items, draft_layer_ids=[0] * n, num_hidden_layers=40)
    if draw(st.integers(0, 2)) == 0:
        n = draw(st.integers(1, 2))
        state_item = 16 if item is not None else draw(st.sampled_from([16, 0, 4096]))
        ptrs, lens, items = draw(buffers(n, state_item))
        layout = layout.with_state("mamba_conv", ptrs, lens, items, list(range(n)))
    return layout


def index_array(draw, n: int, limit: int):
    """An index array of int32 / int64 (sometimes another type) mostly inside 0..limit."""
    span = max(min(limit, 2**31 - 1), 1)
    mode = draw(st.sampled_from(["run", "random", "random", "runs", "extreme"]))
    if mode == "run":
        start = draw(st.integers(0, span))
        values = [start + k for k in range(n)]
    elif mode == "runs":
        values, cur = [], draw(st.integers(0, span))
        for _ in range(n):
            cur = draw(st.integers(0, span)) if draw(st.integers(0, 4)) == 0 else cur + 1
            values.append(cur)
    else:
        values = [draw(st.integers(0, span + 1)) for _ in range(n)]
        if mode == "extreme" and values:
            values[draw(st.integers(0, n - 1))] = draw(
                st.sampled_from([-1, -(2**31), 2**31 - 1, limit, limit - 1, 2**63 - 1, -(2**63)])
            )
    dtype = draw(st.sampled_from(["i4", "i8", "i8", "i4", "bad"]))
    if dtype == "bad":
        # Candidates that are usually refused; whether kvplan accepts one is decided by the
        # array itself (a strided view of one element is C-contiguous, for instance), and an
        # accepted one is planned with the values it really holds.
        arg = draw(st.sampled_from([
            lambda v: np.array(v, dtype=np.float64),
            lambda v: np.array(v, dtype=np.uint64) if all(x >= 0 for x in v) else np.array(v, dtype=object),
            lambda v: np.array(v, dtype=">i8"),
            lambda v: list(v),
            lambda v: np.array(v + v + [0, 0], dtype=np.int64)[::2],
            lambda v: np.array(v, dtype=np.int64).reshape(1, -1),
        ]))(values)
        if accepts_index_array(arg):
            return arg, arg.tolist(), True
        return arg, values, False
    if dtype == "i4" and any(not -(2**31) <= x < 2**31 for x in values):
        dtype = "i8"
    return np.array(values, dtype=dtype), values, True


# ------------------------------------------------------------------------------ plan target


def ref_kind_pairs(rs: ref.RefLayout, rd: ref.RefLayout, kind: str, fallback: bool):
    """Reference pairing of one entry kind. Layouts publish ids and roles per kind (all or none),
    so a kind whose entries carry None ids / empty roles publishes none."""
    si, di = rs.select(kind), rd.select(kind)

    def sub(values, idx):
        if values is None:
            return None
        picked = [values[k] for k in idx]
        return None if any(v is None or v == "" for v in picked) else picked

    local = ref.pair_entries(sub(rs.ids, si), sub(rd.ids, di), len(si), len(di), fallback,
                             sub(rs.roles, si), sub(rd.roles, di))
    pairs = [(si[a], di[b]) for a, b in local]
    if kind == "page" and sub(rd.ids, di) is not None:
        _check_no_component_left_out(rs, rd, si, di, pairs)
    mismatch = any(rs.items[i] != rd.items[j] for i, j in pairs)
    return pairs, mismatch


def _check_no_component_left_out(rs: ref.RefLayout, rd: ref.RefLayout, si: list[int],
                                 di: list[int], pairs: list[tuple[int, int]]) -> None:
    """A decode page entry nothing pairs with, of a layer (and draft-ness) the prefill sends,
    whose role the prefill has no entry of for that layer (or a sidecar role): the decode would
    hold the layer without it, so the template is refused."""
    def role(layout: ref.RefLayout, i: int) -> str | None:
        return layout.roles[i] if layout.roles is not None and layout.roles[i] else None

    def draft(layout: ref.RefLayout, i: int) -> bool:
        return (role(layout, i) or "").startswith("draft")

    def sidecar(r: str | None) -> bool:
        return r is not None and (r == "indexer" or r.endswith(("scale", "scales")))

    paired = {j for _, j in pairs}
    for j in di:
        if j in paired:
            continue
        layer = rd.ids[j]  # type: ignore[index]
        has_role = any(rs.ids is not None and rs.ids[i] == layer and role(rs, i) == role(rd, j)
                       and draft(rs, i) == draft(rd, j) for i in si)
        sent = any(rd.ids[k] == layer and draft(rd, k) == draft(rd, j)  # type: ignore[index]
                   for k in paired)
        if (sidecar(role(rd, j)) or not has_role) and sent:
            raise ref.RefError("pairing", f"the prefill sends layer {layer} without a "
                                          f"{role(rd, j)} entry")


def expected_template(src: Layout, dst: Layout, fallback: bool):
    """(rs, rd, page pairs, state pairs, None) or (..., set of acceptable exception classes)."""
    rs, rd = ref_layout(src), ref_layout(dst)
    result = []
    for kind in ("page", "state"):
        try:
            pairs, mismatch = ref_kind_pairs(rs, rd, kind, fallback)
        except ref.RefError:
            # kvplan reports the first problem in entry order: a size mismatch of an earlier
            # entry may come before the missing partner
            return rs, rd, None, None, (PairingError, SizeMismatchError)
        if mismatch:
            return rs, rd, None, None, (SizeMismatchError,)
        result.append(pairs)
    return rs, rd, result[0], result[1], None


def test_fuzz_layouts_templates_and_plans():
    counter = {"n": 0, "templates": 0, "plans": 0, "rejected_plans": 0, "state_plans": 0}

    @BATCH
    @given(st.data())
    def body(data):
        counter["n"] += 1
        item = data.draw(st.sampled_from([None, 64, 64, 1152]))  # None: item sizes may differ
        pool = data.draw(st.lists(st.integers(0, 9), min_size=0, max_size=6, unique=True))
        try:
            src = data.draw(layouts(pool, item))
            dst = data.draw(layouts(pool + data.draw(st.lists(st.integers(0, 12), max_size=3)), item))
        except ACCEPTABLE:
            return
        for layout in (src, dst):
            assert Layout.from_bytes(layout.to_bytes()) == layout
            assert Layout.from_dict(layout.to_dict()) == layout
        fallback = data.draw(st.booleans())
        overlap = data.draw(st.booleans())
        rs, rd, pairs, state_pairs, ref_error = expected_template(src, dst, fallback)
        try:
            t = Template(src, dst, Pairing.by_layer_id(allow_positional_fallback=fallback),
                         check_dst_overlap=overlap)
        except (SizeMismatchError, PairingError) as exc:
            assert ref_error is not None and isinstance(exc, ref_error), (ref_error, exc)
            return
        assert ref_error is None, f"template accepted but the reference expects {ref_error}"
        counter["templates"] += 1
        assert [tuple(p) for p in t.pairs.tolist()] == pairs
        assert [tuple(p) for p in t.state_pairs.tolist()] == state_pairs

        # page plans
        emitting = [(i, j) for (i, j), e in zip(pairs, t.emitting) if e]
        limit = min([min(rs.capacity(i), rd.capacity(j)) for i, j in emitting], default=64)
        n = data.draw(st.integers(0, 48))
        sp, sv, s_ok = index_array(data.draw, n, limit)
        dp, dv, d_ok = index_array(data.draw, n + data.draw(st.sampled_from([0, 0, 0, 0, 1, -1])) if n else n, limit)
        if not (s_ok and d_ok):
            with pytest.raises(TypeError):
                t.plan(sp, dp)
            return
        try:
            exp = ref.plan_blocks(rs, rd, pairs, sv, dv)
            exp_err = None
            if overlap and len(sv) and len(set(dv)) != len(dv):
                exp_err = "duplicate"
        except ref.RefError as exc:
            exp_err = exc.kind
        try:
            plan = t.plan(sp, dp)
        except IndexBoundsError as exc:
            assert exp_err in ("bounds", "duplicate", "value") and (
                "negative" in str(exc) or "outside" in str(exc) or "twice" in str(exc)), (exp_err, exc)
            counter["rejected_plans"] += 1
        except KvPlanError as exc:
            assert exp_err == "value" and "equal length" in str(exc), (exp_err, exc)
            counter["rejected_plans"] += 1
        else:
            assert exp_err is None, f"plan accepted but the reference says {exp_err}"
            assert plan.as_lists() == (exp.src, exp.dst, exp.lengths)
            assert plan.pair_offsets.tolist() == exp.pair_offsets and plan.n_runs == exp.n_runs
            assert_invariants(plan, t, src, dst, len(sv), overlap=overlap)
            counter["plans"] += 1

        # state plans
        if state_pairs:
            slot = st.one_of(st.integers(-2, 40), st.sampled_from([2**31 - 1, 2**63 - 1, -(2**63)]))
            a, b = data.draw(slot), data.draw(slot)
            try:
                exp = ref.plan_state_blocks(rs, rd, state_pairs, a, b)
                exp_err = None
            except ref.RefError as exc:
                exp_err = exc.kind
            try:
                got = t.plan_state(a, b)
            except IndexBoundsError:
                assert exp_err is not None
            else:
                assert exp_err is None
                assert got.as_lists() == (exp.src, exp.dst, exp.lengths)
                counter["state_plans"] += 1

    run_for("plan", body, counter)
    assert counter["templates"] > 0 and counter["plans"] > 0 and counter["rejected_plans"] > 0


# ------------------------------------------------------------------------------ wire target


def test_fuzz_wire_decoding():
    counter = {"n": 0, "accepted_mutants": 0, "rejected": 0}

    @BATCH
    @given(st.data())
    def body(data):
        counter["n"] += 1
        try:
            layout = data.draw(layouts(data.draw(st.lists(st.integers(0, 9), max_size=5, unique=True)), None))
        except ACCEPTABLE:
            return
        blob = layout.to_bytes()
        assert Layout.from_bytes(blob) == layout
        mode = data.draw(st.sampled_from(["edit", "edit_fix_crc", "truncate", "random", "extend"]))
        b = bytearray(blob)
        if mode.startswith("edit"):
            for _ in range(data.draw(st.integers(1, 4))):
                b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
            if mode == "edit_fix_crc":
                b[-4:] = zlib.crc32(bytes(b[:-4])).to_bytes(4, "little")
        elif mode == "truncate":
            del b[data.draw(st.integers(0, len(b) - 1)):]
        elif mode == "extend":
            b += data.draw(st.binary(min_size=1, max_size=16))
        else:
            b = bytearray(data.draw(st.binary(max_size=200)))
            if data.draw(st.booleans()):
                b[:4] = b"KVPL"
        try:
            decoded = Layout.from_bytes(bytes(b))
        except KvPlanError as exc:
            assert str(exc).startswith("wire data: ") or str(exc)
            counter["rejected"] += 1
        else:
            # accepted: a valid layout that round-trips (mutations may hit don't-care bytes only
            # if they left the same content, so it must equal the original unless the CRC was fixed)
            assert Layout.from_bytes(decoded.to_bytes()) == decoded
            if mode not in ("edit_fix_crc", "random"):
                assert decoded == layout
            counter["accepted_mutants"] += 1

    run_for("wire", body, counter)
    assert counter["rejected"] > 0


# ------------------------------------------------------------------------------ free functions


def test_fuzz_runs_and_pairing():
    counter = {"n": 0}

    @BATCH
    @given(st.data())
    def body(data):
        counter["n"] += 1
        # group_contiguous
        n = data.draw(st.integers(0, 60))
        sp, sv, s_ok = index_array(data.draw, n, data.draw(st.sampled_from([10, 1000, 2**40])))
        dp, dv, d_ok = index_array(data.draw, n + data.draw(st.sampled_from([0, 0, 0, 1])), 2**40)
        if not (s_ok and d_ok):
            with pytest.raises(TypeError):
                kvplan.group_contiguous(sp, dp)
        else:
            bad = len(sv) != len(dv) or any(x < 0 for x in sv + dv)
            if bad:
                with pytest.raises(KvPlanError):
                    kvplan.group_contiguous(sp, dp)
            else:
                s, d, ln = kvplan.group_contiguous(sp, dp)
                assert list(zip(s.tolist(), d.tolist(), ln.tolist())) == ref.group_runs(sv, dv)
                assert int(ln.sum()) == len(sv)
        # pair_entries
        ids = st.one_of(st.none(), st.lists(st.integers(-3, 6), max_size=8),
                        st.lists(st.sampled_from([0, 2**63 - 1, -(2**63)]), max_size=3))
        src_ids, dst_ids = data.draw(ids), data.draw(ids)
        n_src = len(src_ids or []) + data.draw(st.sampled_from([0, 0, 0, 1, 2]))
        n_dst = len(dst_ids or []) + data.draw(st.sampled_from([0, 0, 0, 1, 2]))
        roles = None
        if data.draw(st.booleans()):
            roles = (data.draw(st.lists(st.sampled_from(["k", "v"]), min_size=n_src, max_size=n_src)),
                     data.draw(st.lists(st.sampled_from(["k", "v"]), min_size=n_dst, max_size=n_dst)))
        fallback = data.draw(st.booleans())
        try:
            expected = ref.pair_entries(src_ids, dst_ids, n_src, n_dst, fallback, *(roles or (None, None)))
        except ref.RefError:
            expected = None
        kw = {} if roles is None else {"src_roles": roles[0], "dst_roles": roles[1]}
        if expected is None:
            with pytest.raises(PairingError):
                kvplan.pair_entries(src_ids, dst_ids, n_src, n_dst, fallback, **kw)
        else:
            got = kvplan.pair_entries(src_ids, dst_ids, n_src, n_dst, fallback, **kw)
            assert [tuple(r) for r in got.tolist()] == expected
        # legacy_pp_pairs over the whole usize range (and beyond: OverflowError)
        count = st.one_of(st.integers(0, 40), st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1]))
        kind = data.draw(st.sampled_from(["mla", "mha"]))
        ns, nd, start, draft = (data.draw(count) for _ in range(4))
        layers = data.draw(st.one_of(st.none(), count))
        if ns > 4096 and ns < 2**64:
            ns = ns % 64
        args = (kind, ns, nd, start)
        kwargs = dict(num_draft_entries=draft if kind == "mla" else 0, decode_num_layers=layers)
        if any(x is not None and not 0 <= x < 2**64 for x in (ns, nd, start, *kwargs.values())):
            with pytest.raises(OverflowError):
                kvplan.legacy_pp_pairs(*args, **kwargs)
            return
        try:
            expected = ref.legacy_pp_pairs(*args, **kwargs)
        except ref.RefError:
            expected = None
        if expected is None:
            with pytest.raises(PairingError):
                kvplan.legacy_pp_pairs(*args, **kwargs)
        elif any(j >= 2**63 for _, j in expected):
            # Pair arrays are int64: an index >= 2**63 (only with n_dst >= 2**63, no real
            # layout) is refused rather than wrapped negative.
            counter["int64_unrepresentable"] = counter.get("int64_unrepresentable", 0) + 1
            with pytest.raises(KvPlanError, match="does not fit int64"):
                kvplan.legacy_pp_pairs(*args, **kwargs)
        else:
            got = kvplan.legacy_pp_pairs(*args, **kwargs)
            assert [tuple(r) for r in got.tolist()] == expected
            assert all(0 <= j < nd for _, j in expected)

    run_for("free", body, counter)


def test_argument_errors_precedence():
    # The case that made the fuzz oracle flaky: a strided view of one element is C-contiguous to
    # numpy, so kvplan takes it (and then the lengths differ: a value error). A refused dtype is
    # a TypeError even when the lengths differ too: type errors come before value errors.
    one = np.array([5, 0], dtype=np.int64)[::2]
    assert accepts_index_array(one) and one.tolist() == [5]
    with pytest.raises(KvPlanError, match="equal length"):
        kvplan.group_contiguous(one, np.array([1, 2], dtype=np.int32))
    assert [a.tolist() for a in kvplan.group_contiguous(one, np.array([9], dtype=np.int32))] == [[5], [9], [1]]
    with pytest.raises(TypeError, match="dst must be a 1-D numpy array"):
        kvplan.group_contiguous(one, np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="C-contiguous"):
        kvplan.group_contiguous(np.array([1, 0, 2, 0], dtype=np.int64)[::2], np.array([1], dtype=np.int64))


def test_fuzz_mode_is_deterministic_unless_exploring():
    # A green deterministic run must mean the same examples passed as on every other run.
    assert settings.default.derandomize is not EXPLORE
    assert settings.default.database is None
    assert sum(SHARES.values()) == pytest.approx(1.0)
    if not EXPLORE:
        assert all(n > 0 for n in BATCHES.values())
