"""Lifecycle faults replayed in host memory: an aborted request's late writer.

:func:`replay_late_writers` replays, trial after trial, what serving engines get wrong when a
decode aborts request A and gives its pages to request B: A's writer may still be in flight,
and its late bytes land in B's pages. Each trial draws at random how much A wrote before the
abort, whether its writer is late at all (or stopped and reported before the pages were
reused), which pages B reuses, and where A's late blocks and A's completion fall among B's
write and B's check. The decode runs what :mod:`kvplan.leases` gives it: a
:class:`~kvplan.leases.LeaseTable`, leased manifests and
:func:`~kvplan.integrity.check_notification`. The counts say whether every late writer was
detected and nothing else was flagged. Plans are planned by the core and applied as memmoves
between NumPy arrays, so the replay is deterministic for a seed; the same faults over real
engines are in the engine tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvplan._core import Layout, BlockSlice, Template, TransferPlan
from kvplan.integrity import IntegrityError, Manifest, build_manifest, check_notification
from kvplan.leases import Lease, LeaseTable, StaleLeaseError
from kvplan.testing.oracle import Memory, apply_plan, array_pool

__all__ = ["LateWriterCounts", "replay_late_writers"]


@dataclass
class LateWriterCounts:
    """What :func:`replay_late_writers` saw, trial by trial.

    ``late``: trials whose aborted writer wrote after the abort; ``detected``: of those, the
    ones the decode flagged (B's check failed, or A's completion was refused naming B);
    ``fenced``: late trials in which :meth:`LeaseTable.fence` named A before B reused the
    pages; ``caught_before_use``: late trials in which B's own check failed; ``corrupted``:
    late trials in which B's bytes ended up wrong. ``clean``: trials whose writer stopped and
    reported before the reuse; ``false_alarms``: clean trials flagged anyway."""

    trials: int = 0
    late: int = 0
    detected: int = 0
    fenced: int = 0
    caught_before_use: int = 0
    corrupted: int = 0
    clean: int = 0
    false_alarms: int = 0


def _write(plan: TransferPlan, blocks: npt.NDArray[np.int64], src: npt.NDArray[np.uint8],
           dst: npt.NDArray[np.uint8]) -> None:
    """Blocks ``blocks`` of ``plan`` (in that order) as memmoves from ``src`` to ``dst``."""
    part = BlockSlice(*(np.ascontiguousarray(np.asarray(c)[blocks])
                       for c in (plan.src_addrs, plan.dst_addrs, plan.lengths)))
    apply_plan(part, Memory.of(src), Memory.of(dst))


def replay_late_writers(trials: int, *, seed: int, pages: int = 32, layers: int = 2,
                        item: int = 64, request_pages: int = 6) -> LateWriterCounts:
    """Replays ``trials`` abort-then-reuse trials on a decode pool of ``pages`` pages of
    ``layers`` × ``item`` bytes (requests of 1 to ``request_pages`` pages) and counts them."""
    rng = np.random.default_rng(seed)
    size = pages * layers * item
    # Two prefills with different bytes, so that A's late bytes differ from B's.
    src_a = rng.integers(0, 256, size, dtype=np.uint8)
    src_b = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    src_layout_a, src_layout_b = array_pool(src_a, layers, item), array_pool(src_b, layers, item)
    dst_layout = array_pool(dst, layers, item)
    template_a, template_b = Template(src_layout_a, dst_layout), Template(src_layout_b, dst_layout)
    table = LeaseTable(pages)
    counts = LateWriterCounts()

    def plan_for(template: Template, src: npt.NDArray[np.uint8], dst_pages: npt.NDArray[np.int64],
                 lease: Lease) -> tuple[TransferPlan, npt.NDArray[np.int64], bytes]:
        src_pages = rng.choice(pages, size=len(dst_pages), replace=False).astype(np.int64)
        plan = template.plan(src_pages, dst_pages)
        manifest = build_manifest(plan, "src", [src], src_pages=src_pages, dst_pages=dst_pages,
                                  lease=lease)
        return plan, src_pages, manifest.to_bytes()

    def check(manifest: bytes, layout: Layout, template: Template, src_pages: npt.NDArray[np.int64],
              dst_pages: npt.NDArray[np.int64], lease: Lease) -> bool:
        """The decode's check of one completion: True when it passes."""
        try:
            check_notification([Manifest.from_bytes(manifest)], src_layout=layout, dst_layout=dst_layout,
                               buffers=[dst], src_pages=src_pages, dst_pages=dst_pages,
                               template=template, lease=lease, leases=table)
        except IntegrityError:
            return False
        return True

    for trial in range(trials):
        counts.trials += 1
        a_pages = np.sort(rng.choice(pages, size=int(rng.integers(1, request_pages + 1)),
                                     replace=False)).astype(np.int64)
        lease_a = table.grant(f"A{trial}", a_pages)
        plan_a, a_src_pages, manifest_a = plan_for(template_a, src_a, a_pages, lease_a)
        order = rng.permutation(plan_a.n_blocks).astype(np.int64)
        before = int(rng.integers(0, plan_a.n_blocks + 1))
        _write(plan_a, order[:before], src_a, dst)
        table.abort(lease_a)
        late = bool(rng.integers(0, 2))
        # A late writer writes at least one block after the abort (maybe one it wrote before).
        late_blocks = (rng.choice(plan_a.n_blocks, size=int(rng.integers(1, plan_a.n_blocks + 1)),
                                  replace=False).astype(np.int64) if late else order[:0])
        flagged = False
        if not late:
            # The writer stopped: its completion (a cancelled transfer) arrives before any
            # reuse and is refused as aborted, overwriting nobody; then the lease settles.
            try:
                table.check(lease_a)
            except StaleLeaseError as error:
                flagged |= bool(error.overwritten)
            table.settle(lease_a)
        # B reuses some of A's pages, and maybe free ones.
        free = np.setdiff1d(np.arange(pages), a_pages)
        reuse = rng.choice(a_pages, size=int(rng.integers(1, len(a_pages) + 1)), replace=False)
        extra = rng.choice(free, size=int(rng.integers(0, min(2, len(free)) + 1)), replace=False)
        b_pages = rng.permutation(np.concatenate([reuse, extra])).astype(np.int64)
        if late and lease_a in table.fence(b_pages):
            counts.fenced += 1
        # An engine that reuses without waiting for the fence (as engines do today).
        lease_b = table.grant(f"B{trial}", b_pages, force=late)
        plan_b, b_src_pages, manifest_b = plan_for(template_b, src_b, b_pages, lease_b)
        # Events after the reuse: B's write, B's check, and (late trials) A's late write and
        # then A's completion, anywhere after its write.
        steps = ["b_write", "b_check"]
        if late:
            at = int(rng.integers(0, 3))
            steps.insert(at, "a_write")
            steps.insert(int(rng.integers(at + 1, len(steps) + 1)), "a_done")
        b_ok = True
        for step in steps:
            if step == "b_write":
                _write(plan_b, np.arange(plan_b.n_blocks, dtype=np.int64), src_b, dst)
            elif step == "b_check":
                b_ok = check(manifest_b, src_layout_b, template_b, b_src_pages, b_pages, lease_b)
            elif step == "a_write":
                _write(plan_a, late_blocks, src_a, dst)
            else:
                try:
                    check(manifest_a, src_layout_a, template_a, a_src_pages, a_pages, lease_a)
                except StaleLeaseError as error:
                    flagged |= lease_b in error.overwritten
                table.settle(lease_a)
        flagged |= not b_ok
        if late:
            counts.late += 1
            counts.detected += flagged
            counts.caught_before_use += not b_ok
            counts.corrupted += not check(manifest_b, src_layout_b, template_b, b_src_pages,
                                          b_pages, lease_b)
        else:
            counts.clean += 1
            counts.false_alarms += flagged
        table.release(lease_b)
    return counts

