"""A batch the peer refused on the native Mooncake hand-off is freed at once.

Mooncake frees a batch only when every task in it is marked finished, and only the per-task
status call marks one; the batch status call stops at the first failed task. The native
hand-off used to poll the batch status alone, so after a refusal it kept the batch for the whole
transfer timeout (30 s by default) before leaking it: the write, and the process, took that
long to finish. The child below runs with a 120 s timeout; each refused batch must come back as
a failure long before the timeout would have run out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.mooncake

CHILD = textwrap.dedent("""
    import time

    import numpy as np
    import mooncake.engine
    from mooncake.engine import TransferEngine

    from kvplan._core import MooncakeNative

    TIMEOUT_S = 120.0
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(1 << 16, np.uint8)
    buf[:8192] = np.arange(8192, dtype=np.uint64).astype(np.uint8)
    base = buf.ctypes.data
    assert engine.register_memory(base, buf.nbytes) == 0
    native = MooncakeNative(engine, mooncake.engine.__file__, MooncakeNative.VERIFIED_VERSION)
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    outside = base + (1 << 30)  # not registered by the peer: it refuses every block
    for blocks in (1, 2, 5):
        src = np.uint64(base) + np.arange(blocks, dtype=np.uint64) * np.uint64(1024)
        dst = np.uint64(outside) + np.arange(blocks, dtype=np.uint64) * np.uint64(1024)
        start = time.monotonic()
        try:
            native.write(session, src, dst, np.full(blocks, 1024, np.uint64), TIMEOUT_S)
        except RuntimeError as exc:
            assert "failed" in str(exc), exc
        else:
            raise AssertionError("a refused batch was reported as written")
        print(f"refused in {time.monotonic() - start:.3f} s")
    # The engine is still usable: a good write lands. Each refusal closes the TCP connection
    # (the peer drops it), and Mooncake's connection lanes may fail the first write queued
    # after that without sending it (the dropped connection counts as a failed connect round);
    # the next write opens a fresh connection. Mooncake's own list hand-off does the same, so
    # one such failure is Mooncake's, a second would be kvplan's.
    for attempt in (1, 2):
        try:
            native.write(session, np.array([base], np.uint64),
                         np.array([base + 32768], np.uint64), np.array([8192], np.uint64), 30.0)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    assert (buf[32768:40960] == buf[:8192]).all()
    engine.unregister_memory(base)
    print("refused 3 batches, then wrote one")
""")


def test_a_refused_native_batch_is_freed_without_waiting_out_the_timeout() -> None:
    from support.engine_peers import require_mooncake

    require_mooncake()
    env = dict(os.environ, MC_TRANSFER_TIMEOUT="120", MC_LOG_LEVEL="ERROR")
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "refused 3 batches, then wrote one" in res.stdout
    # A refused batch was kept for the whole transfer timeout (120 s here) before; now each
    # refusal comes back in about a second. Only the refused writes are timed, each against
    # half the timeout, so neither a loaded machine nor the write after them (Mooncake may
    # fail the first one on a dropped connection) can flip the verdict.
    waits = [float(line.split()[2]) for line in res.stdout.splitlines()
             if line.startswith("refused in ")]
    assert len(waits) == 3, res.stdout
    assert max(waits) < 60.0, f"a refused batch waited {max(waits):.1f} s: {waits}"
