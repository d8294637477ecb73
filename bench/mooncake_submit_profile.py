"""Where Mooncake's own submit spends its time: native batches of 1,024 blocks into a real engine.

    .venv/bin/python bench/mooncake_submit_profile.py [BLOCKS] [REPS]      # timings only
    perf record -F 2500 --call-graph dwarf,16384 -o /tmp/submit.data -- \\
        .venv/bin/python bench/mooncake_submit_profile.py 1024 150
    perf script -i /tmp/submit.data -F tid,ip,sym > /tmp/submit.txt
    .venv/bin/python bench/mooncake_submit_profile.py --classify /tmp/submit.txt

Two Mooncake engines in this process over TCP on 127.0.0.1 (64-byte blocks, scattered
destinations). Each rep is one ``MooncakeNative.submit`` of BLOCKS blocks (kvplan fills the
request array, then Mooncake's ``submitTransfer``), timed, then its wait, timed separately.
``--classify`` reads ``perf script`` output and, for the samples of the submitting (main)
thread that lie inside ``TransferEngine::submitTransfer``, prints how many include each frame
below it (inclusive shares): which of Mooncake's per-block steps the submit's CPU time goes to.
"""

from __future__ import annotations

import collections
import os
import sys
import time


def run(blocks: int, reps: int) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import numpy as np

    from kvplan.engines import MooncakeTransport

    size = 128 * blocks
    a, b = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    s, r = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    s.register_buffers([a.ctypes.data], [size])
    r.register_buffers([b.ctypes.data], [size])
    peer = r.local_session_id()
    native = s._native_ready()
    if native is None:
        sys.exit(f"native hand-off unavailable: {s.handoff_reason}")
    src = a.ctypes.data + np.arange(blocks, dtype=np.uint64) * np.uint64(128)
    order = np.random.default_rng(0).permutation(blocks).astype(np.uint64)
    dst = b.ctypes.data + order * np.uint64(128)
    lengths = np.full(blocks, 64, np.uint64)
    load0 = os.getloadavg()[0]
    sub, wait = [], []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        batch = native.submit(peer, src, dst, lengths)
        t1 = time.perf_counter_ns()
        batch.wait(60.0)
        wait.append(time.perf_counter_ns() - t1)
        sub.append(t1 - t0)
    sub.sort()
    wait.sort()
    print(f"{blocks} blocks x {reps}: submit {sub[len(sub) // 2] / blocks:,.0f} ns/block median, "
          f"{sub[0] / blocks:,.0f} min; wait {wait[len(wait) // 2] / blocks:,.0f} ns/block "
          f"median; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    s.close()
    r.close()


def classify(path: str) -> None:
    text = open(path).read()
    samples = [chunk.strip().splitlines() for chunk in text.split("\n\n") if chunk.strip()]
    main_tid = min(int(lines[0].split()[0]) for lines in samples)
    shares: collections.Counter[str] = collections.Counter()
    n = 0
    for lines in samples:
        if int(lines[0].split()[0]) != main_tid:
            continue
        frames = [ln.strip().split(None, 1)[-1] for ln in lines[1:]]
        top = [i for i, f in enumerate(frames) if "TransferEngine::submitTransfer" in f]
        if not top:
            continue
        n += 1
        for name in {f.split("(")[0][:80] for f in frames[:max(top)]}:
            shares[name] += 1
    print(f"{n} samples of the submitting thread inside TransferEngine::submitTransfer")
    for name, k in shares.most_common(30):
        print(f"{k:5d} {100 * k / max(n, 1):5.1f}%  {name}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--classify":
        classify(sys.argv[2])
    else:
        run(int(sys.argv[1]) if len(sys.argv) > 1 else 1024,
            int(sys.argv[2]) if len(sys.argv) > 2 else 200)
