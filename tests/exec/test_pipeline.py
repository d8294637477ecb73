"""``kvplan.exec.pipeline.run_rounds``: a request's rounds run double-buffered.

The in-process tests hand the network step to a fake engine: ``submit`` starts a thread that
runs ``kvplan.copy_local`` of the round's network plan (prefill arena -> decode arena) and
``wait`` joins it. That is a test of the pipeline's ordering, not a stand-in for an engine: every
step records events, and the tests check that no round buffer is reused before the step that
reads it ended, that a network transfer really overlaps the neighbours' copies (a gather that
waits for the previous round's network to start would hang a pipeline that runs the steps one
after another), that the decode memory equals the direct plan's byte for byte, and that a
failure mid-way stops the pipeline with one error naming the round. The last test runs the
rounds over two real Mooncake engines on TCP loopback.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.exec.pipeline import RoundFailed, RoundsReport, run_rounds
from kvplan.testing.oracle import apply_plan
from kvplan.testing.ranks import Model, Rank, rank_memory

MODEL = Model(layers=2, kv_heads=8, head_dim=4, dtype_size=2)
PAGES = 12
SRC_PAGES = np.arange(10)
DST_PAGES = np.array([11, 3, 5, 7, 9, 0, 2, 4, 6, 8])
ARENA = 1024  # bytes per side: two round buffers of 512 bytes, so the request takes 5 rounds
PATIENCE_S = 3.0  # how long a step waits for a neighbour it must overlap before failing


class Rig:
    """A head-sliced request (prefill TP 2 rank 0 -> decode TP 4 rank 1) planned in rounds
    through two small arenas, and the decode memory the direct plan writes."""

    def __init__(self) -> None:
        src = rank_memory(MODEL, Rank(0, 2, 4, "NHD", PAGES), seed=3)
        dst = rank_memory(MODEL, Rank(1, 4, 4, "NHD", PAGES))
        self.src, self.dst = src.memory.data, dst.memory.data
        self.src_arena = np.zeros(ARENA, np.uint8)
        self.dst_arena = np.zeros(2 * ARENA, np.uint8)
        template = kvplan.Template(src.layout, dst.layout)
        self.rounds = template.plan_rounds(
            SRC_PAGES, DST_PAGES, src_arena=(self.src_arena.ctypes.data, self.src_arena.size),
            dst_arena=(self.dst_arena.ctypes.data, self.dst_arena.size))
        want = dst.memory.copy()
        apply_plan(template.plan(SRC_PAGES, DST_PAGES), src.memory, want)
        self.want = want.data
        assert len(self.rounds) >= 4 and not np.array_equal(self.want, self.dst)


class FakeEngine:
    """``submit`` runs the network plan's copy on a thread; ``wait`` joins it. Every start and
    end is recorded, with the copies' events, in one list."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.started: dict[tuple[str, int], threading.Event] = {}
        self.submits = self.waits = 0
        # Hooks a test sets: run inside a round's step before its copy (round index -> hook).
        self.before: dict[tuple[str, int], Callable[[], None]] = {}
        self.fail: dict[tuple[str, int], BaseException] = {}

    def event(self, what: str, k: int) -> None:
        with self.lock:
            self.events.append((what, k))
            self.started.setdefault((what, k), threading.Event()).set()

    def saw(self, what: str, k: int) -> threading.Event:
        with self.lock:
            return self.started.setdefault((what, k), threading.Event())

    def _round(self, plan: kvplan.TransferPlan, step: str) -> int:
        # The rounds hand out the same plan objects every time (rounds of one buffer have
        # equal network columns, so only identity tells them apart).
        found = [r.index for r in self.rig.rounds if getattr(r, step) is plan]
        assert len(found) == 1, f"{step} plan of no round or of several: {found}"
        return found[0]

    def _step(self, step: str, plan: kvplan.TransferPlan, run: Callable[[], object]) -> None:
        k = self._round(plan, step)
        self.event(f"{step}_start", k)
        if (step, k) in self.before:
            self.before[step, k]()
        if (step, k) in self.fail:
            raise self.fail[step, k]
        run()
        self.event(f"{step}_end", k)

    def gather(self, plan: kvplan.TransferPlan) -> None:
        self._step("gather", plan,
                   lambda: kvplan.copy_local(plan, [self.rig.src], [self.rig.src_arena]))

    def scatter(self, plan: kvplan.TransferPlan) -> None:
        self._step("scatter", plan,
                   lambda: kvplan.copy_local(plan, [self.rig.dst_arena], [self.rig.dst]))

    def submit(self, plan: kvplan.TransferPlan) -> Any:
        self.submits += 1
        box: list[BaseException] = []

        def transfer() -> None:
            try:
                self._step("network", plan, lambda: kvplan.copy_local(
                    plan, [self.rig.src_arena], [self.rig.dst_arena]))
            except BaseException as exc:  # handed to wait(), as an engine reports a failure
                box.append(exc)

        thread = threading.Thread(target=transfer)
        thread.start()
        return thread, box

    def wait(self, handle: Any) -> None:
        self.waits += 1
        thread, box = handle
        thread.join()
        if box:
            raise box[0]

    def run(self, **kwargs: Any) -> RoundsReport:
        return run_rounds(self.rig.rounds, submit=self.submit, wait=self.wait,
                          gather=self.gather, scatter=self.scatter, **kwargs)

    def at(self, what: str, k: int) -> int:
        return self.events.index((what, k))


def _await(event: threading.Event, what: str) -> Callable[[], None]:
    def hook() -> None:
        assert event.wait(PATIENCE_S), f"{what} never started: the steps did not overlap"
    return hook


def test_rounds_land_byte_exact_and_reuse_buffers_only_once_read() -> None:
    rig = Rig()
    engine = FakeEngine(rig)
    report = engine.run()
    assert np.array_equal(rig.dst, rig.want)
    n = len(rig.rounds)
    assert report.bytes == rig.rounds.bytes
    assert [t.index for t in report.rounds] == list(range(n))
    assert engine.submits == engine.waits == n
    for k, r in enumerate(rig.rounds):
        assert engine.at("gather_end", k) < engine.at("network_start", k)
        assert engine.at("network_end", k) < engine.at("scatter_start", k)
        earlier = [j for j in range(k) if rig.rounds[j].buffer == r.buffer]
        if earlier:
            j = earlier[-1]
            # the prefill buffer: gathered into again only after the engine read it
            assert engine.at("network_end", j) < engine.at("gather_start", k)
            # the decode buffer: written again only after its scatter read it
            assert engine.at("scatter_end", j) < engine.at("network_start", k)
        t = report.rounds[k]
        assert t.gather[0] <= t.gather[1] <= t.network[0] <= t.network[1] <= t.scatter[0]


def test_a_network_transfer_overlaps_the_next_gather_and_the_previous_scatter() -> None:
    rig = Rig()
    engine = FakeEngine(rig)
    for k in range(1, len(rig.rounds) - 1):
        # Round k's transfer does not end before round k+1's gather started, and round k-1's
        # scatter does not end before round k's transfer started: run one after another, each
        # would wait for a step that only starts after it ended.
        engine.before["network", k] = _await(engine.saw("gather_start", k + 1),
                                             f"round {k + 1}'s gather")
        engine.before["scatter", k - 1] = _await(engine.saw("network_start", k),
                                                 f"round {k}'s network")
    engine.run()
    assert np.array_equal(rig.dst, rig.want)


def test_a_failed_transfer_mid_way_stops_the_pipeline_and_names_the_round() -> None:
    rig = Rig()
    engine = FakeEngine(rig)
    refused = kvplan.TransferError("peer refused the batch")
    refused.status = -1
    engine.fail["network", 2] = refused
    with pytest.raises(RoundFailed, match=r"round 2 \(3 of \d+\): network failed: "
                                          r"TransferError: peer refused the batch") as err:
        engine.run()
    assert isinstance(err.value, kvplan.TransferError)
    assert (err.value.round, err.value.step, err.value.status) == (2, "network", -1)
    assert err.value.__cause__ is refused
    # Every submitted transfer was waited on; nothing of round 2 or later was scattered and no
    # transfer was submitted after the failed one.
    assert engine.submits == engine.waits == 3
    assert not [e for e in engine.events if e[0].startswith("scatter") and e[1] >= 2]
    assert not [e for e in engine.events if e[0] == "network_start" and e[1] > 2]


def test_a_failed_gather_stops_the_pipeline_before_its_transfer() -> None:
    rig = Rig()
    engine = FakeEngine(rig)
    engine.fail["gather", 1] = kvplan.IndexBoundsError("block outside")
    with pytest.raises(RoundFailed, match=r"round 1 .*: gather failed: IndexBoundsError") as err:
        engine.run()
    assert (err.value.round, err.value.step) == (1, "gather")
    assert err.value.completed == sum(e[0] == "scatter_end" for e in engine.events)
    assert isinstance(err.value.__cause__, kvplan.IndexBoundsError)
    # Round 0's transfer may or may not have started before the failure (the gather of round 1
    # runs beside it); if it did, it was waited on. Round 1's never started.
    assert engine.submits == engine.waits <= 1
    assert ("network_start", 1) not in engine.events


def test_the_default_copies_run_copy_local_over_the_given_buffers() -> None:
    rig = Rig()
    engine = FakeEngine(rig)
    report = run_rounds(rig.rounds, submit=engine.submit, wait=engine.wait,
                        src_buffers=[rig.src], src_arena=rig.src_arena,
                        dst_arena=rig.dst_arena, dst_buffers=[rig.dst], threads=1)
    assert np.array_equal(rig.dst, rig.want)
    assert len(report.rounds) == len(rig.rounds) and report.serial_s >= 0


def test_a_default_copy_without_its_buffers_is_refused_by_name() -> None:
    rig = Rig()
    engine = FakeEngine(rig)
    with pytest.raises(kvplan.KvPlanError, match=r"without a gather callable, give src_arena"):
        run_rounds(rig.rounds, submit=engine.submit, wait=engine.wait, src_buffers=[rig.src],
                   scatter=engine.scatter)
    with pytest.raises(kvplan.KvPlanError,
                       match=r"without a scatter callable, give dst_arena and dst_buffers"):
        run_rounds(rig.rounds, submit=engine.submit, wait=engine.wait, gather=engine.gather)
    assert engine.submits == 0


def test_no_rounds_is_an_empty_report() -> None:
    engine = FakeEngine(Rig())
    report = run_rounds([], submit=engine.submit, wait=engine.wait, gather=engine.gather,
                        scatter=engine.scatter)
    assert (report.rounds, report.bytes, report.serial_s) == ([], 0, 0)
    assert engine.submits == 0 and not engine.events


def test_a_failed_scatter_waits_for_the_transfer_in_flight() -> None:
    rig = Rig()
    engine = FakeEngine(rig)
    engine.fail["scatter", 1] = kvplan.KvPlanError("decode memory went away")
    with pytest.raises(RoundFailed, match=r"round 1 .*: scatter failed: KvPlanError") as err:
        engine.run()
    assert (err.value.round, err.value.step, err.value.completed) == (1, "scatter", 1)
    assert engine.submits == engine.waits
    assert ("scatter_start", 2) not in engine.events


@pytest.mark.mooncake
def test_rounds_over_two_mooncake_engines_land_byte_exact(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from support.engine_peers import require_mooncake

    from kvplan.engines.measure import loopback_transports

    require_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    rig = Rig()
    sender: Any
    sender, receiver = loopback_transports("mooncake")
    try:
        sender.register_buffers([rig.src_arena.ctypes.data], [rig.src_arena.nbytes])
        receiver.register_buffers([rig.dst_arena.ctypes.data], [rig.dst_arena.nbytes])
        peer = receiver.local_session_id()
        report = run_rounds(rig.rounds, submit=lambda plan: sender.submit_async(plan, peer),
                            wait=lambda handle: handle.wait(), src_buffers=[rig.src],
                            src_arena=rig.src_arena, dst_arena=rig.dst_arena,
                            dst_buffers=[rig.dst])
    finally:
        sender.close()
        receiver.close()
    assert np.array_equal(rig.dst, rig.want)
    assert report.bytes == rig.rounds.bytes
