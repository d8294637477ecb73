"""Shared checks for the robustness suites (tests/robustness: adversarial, fuzz, regressions)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import numpy as np

from support import reference as ref

from kvplan import Layout


def accepts_index_array(obj) -> bool:
    """Whether kvplan takes `obj` as a page index array (else: TypeError, checked before any
    value): a 1-D numpy array of native-order int32 or int64 that numpy calls C-contiguous and
    aligned."""
    return (
        type(obj) is np.ndarray
        and obj.ndim == 1
        and obj.dtype in (np.dtype(np.int32), np.dtype(np.int64))
        and obj.dtype.isnative
        and obj.flags.c_contiguous
        and obj.flags.aligned
    )


def ref_layout(layout: Layout) -> ref.RefLayout:
    """The reference model of a kvplan Layout (built from its read-only properties)."""
    return ref.RefLayout(
        list(layout.data_ptrs),
        list(layout.data_lens),
        list(layout.item_lens),
        layout.layer_ids,
        layout.roles,
        list(layout.kinds),
    )


def assert_invariants(plan, template, src: Layout, dst: Layout, n_pages: int, *, overlap=False):
    """The safety properties of a page plan, independent of any reference: every block inside its
    entry's registered buffer on both sides (so no u64 wrap), a whole number of items, bytes
    conserved (sum of lengths = pages x bytes per page), and with the overlap check on no
    destination item written twice."""
    s, d, ln = plan.as_lists()
    offsets = plan.pair_offsets.tolist()
    assert offsets[-1] == len(ln) == plan.n_blocks
    written = set()
    for p, (i, j) in enumerate(template.pairs.tolist()):
        item = src.item_lens[i]
        assert dst.item_lens[j] == item
        for b in range(offsets[p], offsets[p + 1]):
            assert src.data_ptrs[i] <= s[b] and s[b] + ln[b] <= src.data_ptrs[i] + src.data_lens[i]
            assert dst.data_ptrs[j] <= d[b] and d[b] + ln[b] <= dst.data_ptrs[j] + dst.data_lens[j]
            assert ln[b] > 0 and ln[b] % item == 0 and (s[b] - src.data_ptrs[i]) % item == 0
            if overlap:
                first = (d[b] - dst.data_ptrs[j]) // item
                for k in range(ln[b] // item):
                    assert (j, first + k) not in written, "destination item written twice"
                    written.add((j, first + k))
    assert sum(ln) == n_pages * template.bytes_per_page == plan.total_bytes


TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_isolated(code: str, timeout: float = 120, *, prelude: str = "") -> str:
    """Runs ``prelude + code`` in a fresh interpreter (tests/ importable, one BLAS thread) and
    returns its stdout. Any non-zero exit (a segfault, an abort, a panic that ends the process)
    or a panic / allocation-failure message fails the test instead of killing pytest."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n" + prelude
         + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=TESTS_DIR,
    )
    assert proc.returncode == 0, (
        f"subprocess exited with {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-3000:]}"
    )
    assert "memory allocation of" not in proc.stderr, proc.stderr[-3000:]
    assert "panicked" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def run_racing_threads(worker: Callable[[int], object], n_threads: int, *,
                       switch_interval: float) -> list[threading.Thread]:
    """``worker(i)`` on ``n_threads`` threads at once, with the interpreter switching threads
    every ``switch_interval`` seconds (restored after) so their calls interleave as finely as
    possible; joins each (120 s at most) and returns the threads."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
    finally:
        sys.setswitchinterval(old)
    return threads
