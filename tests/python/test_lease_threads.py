"""A LeaseTable shared between threads: a decode grants on its scheduler thread while transfer
threads release, abort and settle. Real threads, started together at a barrier, with a tiny
switch interval so they interleave inside the table's methods; every assertion is an invariant
that holds whatever the interleaving (never a timing)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvplan import LeaseError, LeaseTable, StaleLeaseError
from kvplan.leases import Lease

PAGES = 64


@pytest.fixture(autouse=True)
def interleave() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def together(*jobs: Callable[[], object]) -> list[object]:
    """Runs every job on its own thread, released at once; each job's result or exception."""
    barrier = threading.Barrier(len(jobs))
    out: list[object] = [None] * len(jobs)

    def run(k: int) -> None:
        barrier.wait()
        try:
            out[k] = jobs[k]()
        except BaseException as error:  # noqa: BLE001 - recorded and asserted on below
            out[k] = error

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_grants_never_lease_one_page_to_two_live_leases() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        table = LeaseTable(PAGES)
        # Four requests over overlapping page sets: at most the disjoint ones can win.
        wanted = [rng.choice(16, size=6, replace=False) for _ in range(4)]
        results = together(*(lambda r=r, p=p: table.grant(f"r{r}", p)
                             for r, p in enumerate(wanted)))
        won: list[tuple[Lease, set[int]]] = []
        for result, p in zip(results, wanted, strict=True):
            if isinstance(result, Lease):
                won.append((result, {int(x) for x in p}))
            else:
                assert isinstance(result, LeaseError), repr(result)
        assert won, "one of the grants always wins"
        for i, (a, pa) in enumerate(won):
            for b, pb in won[i + 1:]:
                assert not pa & pb, f"page(s) {sorted(pa & pb)} leased to {a} and {b}"
        # The holder table agrees with the winners, and epochs are distinct.
        assert len({lease.epoch for lease, _ in won}) == len(won)
        for lease, held in won:
            assert all(table.holder(x) == lease for x in held)


def test_a_grant_racing_an_abort_is_refused_or_fenced_never_a_key_error() -> None:
    for _ in range(3000):
        table = LeaseTable(PAGES)
        pages = np.arange(8)
        old = table.grant("old", pages)
        results = together(lambda: table.abort(old), lambda: table.grant("new", pages))
        assert results[0] is None, repr(results[0])
        # Before the abort the pages are held; after it the unsettled lease fences them: the
        # grant without force never takes them.
        assert isinstance(results[1], LeaseError), repr(results[1])
        assert table.fence(pages) == (old,)
        assert table.settle(old) == ()
        assert table.grant("new", pages).epoch == 2


def test_a_forced_grant_during_an_abort_is_recorded_as_overwriting_it() -> None:
    for _ in range(3000):
        table = LeaseTable(PAGES)
        pages = np.arange(8)
        old = table.grant("old", pages)
        results = together(lambda: table.abort(old),
                           lambda: table.grant("new", pages, force=True))
        assert results[0] is None, repr(results[0])
        new = results[1]
        if isinstance(new, Lease):
            # It ran after the abort: the reuse is remembered for the late writer.
            with pytest.raises(StaleLeaseError) as e:
                table.check(old)
            assert e.value.overwritten == (new,)
            assert table.settle(old) == (new,)
        else:
            # It ran before: the pages were still held by the live lease.
            assert isinstance(new, LeaseError) and "is held by request 'old'" in str(new)
            assert table.settle(old) == ()


def test_transfer_threads_settling_while_the_scheduler_grants_keep_the_table_consistent() -> None:
    table = LeaseTable(PAGES, history=64)
    rng = np.random.default_rng(11)
    live: list[Lease] = [table.grant(f"a{k}", np.arange(4 * k, 4 * k + 4)) for k in range(16)]
    granted: list[Lease] = []

    def scheduler() -> None:
        for k in range(3000):
            start = int(rng.integers(0, PAGES - 4))
            try:
                granted.append(table.grant(f"s{k}", np.arange(start, start + 4)))
            except LeaseError:
                pass

    def transfer(mine: list[Lease]) -> None:
        for lease in mine:
            table.abort(lease)
            table.settle(lease)

    results = together(scheduler, lambda: transfer(live[:8]), lambda: transfer(live[8:]))
    assert results == [None, None, None], results
    # Every page's holder is a live lease that holds it, and no two live leases share a page.
    seen: dict[int, Lease] = {}
    for lease in granted:
        current = table.live(lease.request)
        assert current == lease  # nothing released the scheduler's grants
    for page in range(PAGES):
        holder = table.holder(page)
        if holder is not None:
            assert holder in granted
            seen[page] = holder
    held_by = {lease: {p for p, h in seen.items() if h == lease} for lease in granted}
    assert all(len(pages) == 4 for pages in held_by.values())
    for lease in live:
        with pytest.raises(StaleLeaseError):
            table.check(lease)
