"""Per request, vLLM's NIXL read against kvplan's staged read through ``KvplanNixlConnector``,
each as a fraction of the wire ceiling, as vLLM's engine pays it.

    .venv/bin/python bench/vllm_nixl_staged.py                 # full set, writes the results file
    .venv/bin/python bench/vllm_nixl_staged.py --quick         # smoke run (tiny case), no file
    .venv/bin/python bench/vllm_nixl_staged.py --cases gqa-4k-f100 --repeats 5

Two workers of ``KvplanNixlConnector`` (a prefill and a decode) are built over vLLM 0.33's real
``NixlPullConnectorWorker`` from the wheel, with real NIXL agents (UCX on loopback) in this one
process, their KV caches in host memory registered with their agents, handshaken through vLLM's
own ``_nixl_handshake`` (``tests/support/vllm_nixl_pair.py``, the set-up the staged-read tests
use). The prefill holds the request (vLLM's ``start_load_kv`` with its lease), its pages
contiguous; the decode's pages are fragmented (``kvplan.presets.fragmented_pages``, runs
shuffled). Per request, three paths, each timed from the decode's first call until vLLM's own
``_pop_done_transfers`` reports the request done, polled every 0.2 ms:

- **vLLM**: vLLM's own ``_read_blocks`` (vLLM's class, what a worker with staging off runs):
  its descriptor ids and one ``make_prepped_xfer`` READ of one descriptor per block and KV
  region, against the prepped descriptor lists vLLM builds once per peer at the handshake
  (built once here, outside the timer, as vLLM does);
- **kvplan staged**: kvplan's worker's ``_read_blocks`` with ``kvplan_staging: always`` and a
  64 MiB arena per side in two round buffers: the decode plans the rounds and opens the
  stream, the prefill's listener plans them too and gathers each round into its arena, the
  decode READs each round (one descriptor) and scatters it into its KV cache, the last
  scatter ends the read (``DONE``, after vLLM's notification went to the prefill). Both sides'
  planning, the prefill's gather and the decode's scatter are inside the time;
- **ceiling**: the same number of bytes as ONE NIXL descriptor READ by the decode's agent
  from the prefill's KV memory into its own (``initialize_xfer``, ``transfer``, polled to DONE
  every 0.2 ms, released).

Paths are sampled interleaved (A B C, B C A, ...; collector off), after one untimed checked run
of each path, which compares the whole decode KV memory with the expected bytes (the decode's
pages hold the prefill's, every other byte zero). Before every timed sample the request's
decode pages (the ceiling: its destination span) are zeroed, after it they are compared with
the prefill's pages: a wrong copy fails the run. What is outside every timer: building the
workers and agents, the handshake, vLLM's prepped lists, the prefill's ``start_load_kv`` of
the request, zeroing and checking, and draining the prefill's notifications (vLLM's
``_get_new_notifs``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

import numpy as np  # noqa: E402
from harness.machine import describe, sh  # noqa: E402  (also: tests/ on sys.path, support.*)
from harness.results import RESULTS_DIR, write_lines  # noqa: E402

import kvplan  # noqa: E402
from kvplan.presets import fragmented_pages  # noqa: E402

PATHS = ("vllm", "staged", "ceiling")
LABELS = {"vllm": "vLLM `_read_blocks`", "staged": "kvplan staged",
          "ceiling": "ceiling (1 descriptor)"}
POLL_S = 0.0002  # every path's poll interval (NixlRoundReader's own default too)
ARENA_MIB, BUFFERS = 64, 2
QUICK_ARENA_MIB = 1  # --quick: small enough that the tiny request takes several rounds
TARGET = 0.8


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    label: str
    layers: int
    tokens: int
    block: int
    fragmentation: float
    mla: bool = False

    def geometry(self) -> Any:
        from support.vllm_nixl import Geometry

        pages = self.pages
        if self.mla:  # DeepSeek-V3's latent row per token, bf16: one region per layer
            return Geometry(block=self.block, heads=1, head_bytes=576 * 2, layers=self.layers,
                            blocks=2 * pages + 2, mla=True)
        # a dense GQA model: 8 KV heads of 128 bf16 (Llama-3-8B's), K and V per layer
        return Geometry(block=self.block, heads=8, head_bytes=128 * 2, layers=self.layers,
                        blocks=2 * pages + 2)

    @property
    def pages(self) -> int:
        return -(-self.tokens // self.block)


GQA = "GQA 8x128 bf16"
MLA = "MLA (576 bf16 rows)"
CASES = [
    Case("gqa-1k-f5", f"{GQA}, 32 layers, block 16, 1K tokens, decode 5 % fragmented", 32, 1024,
         16, 0.05),
    Case("gqa-1k-f100", f"{GQA}, 32 layers, block 16, 1K tokens, decode 100 % fragmented", 32,
         1024, 16, 1.0),
    Case("gqa-4k-f5", f"{GQA}, 32 layers, block 16, 4K tokens, decode 5 % fragmented", 32, 4096,
         16, 0.05),
    Case("gqa-4k-f100", f"{GQA}, 32 layers, block 16, 4K tokens, decode 100 % fragmented", 32,
         4096, 16, 1.0),
    # 32 layers x 8K tokens is 1 GiB a side before the decode's spare pages: 8 layers here
    Case("gqa-8k-f5", f"{GQA}, 8 of 32 layers, block 32, 8K tokens, decode 5 % fragmented", 8,
         8192, 32, 0.05),
    Case("gqa-8k-f100", f"{GQA}, 8 of 32 layers, block 32, 8K tokens, decode 100 % fragmented",
         8, 8192, 32, 1.0),
    Case("mla-4k-f5", f"{MLA}, 61 layers, block 16, 4K tokens, decode 5 % fragmented", 61, 4096,
         16, 0.05, mla=True),
    Case("mla-4k-f100", f"{MLA}, 61 layers, block 16, 4K tokens, decode 100 % fragmented", 61,
         4096, 16, 1.0, mla=True),
]
QUICK = [
    Case("gqa-tiny", f"{GQA}, 4 layers, block 16, 256 tokens, decode 100 % fragmented", 4, 256,
         16, 1.0),
    Case("mla-tiny", f"{MLA}, 4 layers, block 16, 256 tokens, decode 100 % fragmented", 4, 256,
         16, 1.0, mla=True),
]


# ----------------------------------------------------------------------------------------------
# The rig: vLLM's workers with kvplan's connector, real NIXL agents, one request's pages
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def connector() -> Iterator[tuple[Any, Any, Any]]:
    """vLLM's NIXL workers from the wheel and ``connector_class()`` over them (the staged-read
    tests' fixtures), patched for the run and restored after."""
    import pytest
    from support.vllm_nixl import installed_connector, release_modules
    from support.vllm_nixl_pair import load_agents

    mp = pytest.MonkeyPatch()
    try:
        with release_modules() as nixl, installed_connector(nixl, mp) as c:
            load_agents(c, nixl, mp)
            yield c, nixl, mp
    finally:
        mp.undo()


class Rig:
    """One case: the prefill and decode workers (staging on), the request's pages, vLLM's
    prepped lists, and the three paths as callables ending when the request is done."""

    def __init__(self, c: Any, nixl: Any, mp: Any, case: Case, arena_mib: int) -> None:
        from support.vllm_nixl_pair import Pair

        self.case, g = case, case.geometry()
        n = case.pages
        self.src_pages = np.arange(1, n + 1, dtype=np.int64)  # a fresh prefill allocation
        self.dst_pages = fragmented_pages(n, case.fragmentation, seed=7, shuffle_runs=True,
                                          capacity=g.blocks).astype(np.int64)
        staging = {"kvplan_staging": "always", "kvplan_staging_arena_mib": arena_mib,
                   "kvplan_staging_buffers": BUFFERS}
        self.pair = Pair(c, nixl, mp, geometry=g, prefill_pages=self.src_pages.tolist(),
                         decode_pages=self.dst_pages.tolist(), staging=staging)
        self.regions, self.block_bytes = g.regions, g.block_bytes()
        self.p_blocks = self.pair.p_mem.reshape(g.regions, g.blocks, self.block_bytes)
        self.d_blocks = self.pair.d_mem.reshape(g.regions, g.blocks, self.block_bytes)
        self.bytes = g.regions * n * self.block_bytes
        self.prepped = self.pair.prep()  # vLLM's, once per peer (its handshake)
        self.arena_bytes = arena_mib << 20
        self.seq = 0
        self.descriptors: dict[str, int] = {}
        self.rounds = 0
        self.agent = self.pair.decode.nixl_wrapper.agent  # below kvplan's StagingAgent
        self._ceiling_descs()

    # -- the paths -----------------------------------------------------------------------------

    def _ids(self) -> tuple[str, str]:
        self.seq += 1
        return f"req-d{self.seq}", f"req-p{self.seq}"

    def prepare(self, path: str) -> tuple[str, str]:
        """Untimed: the prefill holds a fresh request (vLLM's ``start_load_kv``), the
        destination is zeroed."""
        request, remote = self._ids()
        if path == "ceiling":
            self.pair.d_mem[:self.bytes] = 0
        else:
            self.pair.keep(request=remote)
            self.d_blocks[:, self.dst_pages] = 0
        return request, remote

    def run(self, path: str, request: str, remote: str) -> None:
        """The timed part: from the decode's first call until the request is done."""
        if path == "ceiling":
            self.ceiling()
            return
        handles = self.pair.read(vllm_only=path == "vllm", prepped=self.prepped,
                                 request=request, remote_request=remote)
        handle = handles[0]
        done, failed = self.pair.poll(timeout_s=120.0, interval_s=POLL_S)
        if failed or done != {request}:
            raise SystemExit(f"{self.case.name} {path}: the read of {request} failed "
                             f"(done {done}, failed {failed})")
        self.last_handle = handle

    def _ceiling_descs(self) -> None:
        from kvplan.engines.nixl.descriptors import descriptor_rows

        one = np.array([self.bytes], np.uint64)
        self.local_descs = self.agent.get_xfer_descs(descriptor_rows(
            np.array([self.pair.d_mem.ctypes.data], np.uint64), one, 0), "DRAM")
        self.remote_descs = self.agent.get_xfer_descs(descriptor_rows(
            np.array([self.pair.p_mem.ctypes.data], np.uint64), one, 0), "DRAM")

    def ceiling(self) -> None:
        agent = self.agent
        handle = agent.initialize_xfer("READ", self.local_descs, self.remote_descs,
                                       self.pair.agent_name, b"")
        try:
            state = agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise SystemExit(f"{self.case.name} ceiling: NIXL reported ERR")
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
        finally:
            agent.release_xfer_handle(handle)

    def after(self, path: str, remote: str) -> None:
        """Untimed: the bytes checked, the prefill's notifications drained (vLLM's own
        ``_get_new_notifs``, which frees the request)."""
        if not self.pages_ok(path):
            raise SystemExit(f"{self.case.name} {path}: the decode's bytes differ from the "
                             f"prefill's pages")
        if path != "ceiling":
            self.drain(remote)

    def drain(self, remote: str, timeout_s: float = 10.0) -> None:
        """Until vLLM's own ``_get_new_notifs`` of the prefill freed ``remote``."""
        deadline = time.monotonic() + timeout_s
        held = self.pair.prefill._reqs_to_send
        while remote in held and time.monotonic() < deadline:
            self.pair.prefill._get_new_notifs()
            if remote in held:
                time.sleep(0.001)
        if remote in held:
            raise SystemExit(f"{self.case.name}: the prefill was not notified of {remote}")

    # -- checks --------------------------------------------------------------------------------

    def pages_ok(self, path: str) -> bool:
        if path == "ceiling":
            return bool(np.array_equal(self.pair.d_mem[:self.bytes],
                                       self.pair.p_mem[:self.bytes]))
        return bool(np.array_equal(self.d_blocks[:, self.dst_pages],
                                   self.p_blocks[:, self.src_pages]))

    def whole_ok(self, path: str) -> bool:
        """The whole decode KV memory against the expected bytes (run from all zeros)."""
        want = np.zeros_like(self.pair.d_mem)
        if path == "ceiling":
            want[:self.bytes] = self.pair.p_mem[:self.bytes]
        else:
            want.reshape(self.d_blocks.shape)[:, self.dst_pages] = \
                self.p_blocks[:, self.src_pages]
        ok = bool(np.array_equal(self.pair.d_mem, want))
        del want
        return ok

    def checked_run(self, path: str) -> None:
        """Untimed: one run of the path from a zeroed decode, the whole memory compared; the
        path's descriptor count recorded."""
        from kvplan.compat.vllm.nixl_staging import StagedRead

        self.pair.d_mem[:] = 0
        request, remote = self.prepare(path)
        self.run(path, request, remote)
        if not self.whole_ok(path):
            raise SystemExit(f"{self.case.name} {path}: the decode's KV memory differs from "
                             f"the expected bytes")
        if path != "ceiling":
            self.drain(remote)
        if path == "ceiling":
            self.descriptors[path] = 1
        elif path == "vllm":
            self.descriptors[path] = int(
                self.pair.decode.xfer_stats.data["num_descriptors"][-1])
        else:
            handle = self.last_handle
            if not isinstance(handle, StagedRead):
                raise SystemExit(f"{self.case.name}: kvplan's worker did not stage the read")
            self.rounds = len(handle.rounds)
            self.descriptors[path] = len(handle.rounds)  # one network read per round
            self.gather_blocks = sum(len(r.gather) for r in handle.rounds)
            self.scatter_blocks = sum(len(r.scatter) for r in handle.rounds)

    def close(self) -> None:
        self.pair.release(self.prepped)
        self.pair.close()
        for w, mem in ((self.pair.prefill, self.pair.p_mem), (self.pair.decode,
                                                              self.pair.d_mem)):
            agent = w.nixl_wrapper
            agent = getattr(agent, "agent", agent)
            with contextlib.suppress(Exception):
                agent.deregister_memory(agent.get_reg_descs(
                    [(mem.ctypes.data, mem.nbytes, 0, "")], "DRAM"))


# ----------------------------------------------------------------------------------------------
# Sampling and the report
# ----------------------------------------------------------------------------------------------


def sample(rig: Rig, repeats: int) -> dict[str, list[float]]:
    """Every path once per repetition, the order rotated, one timed call each, collector off."""
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    was = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for path in PATHS[r % 3:] + PATHS[:r % 3]:
                request, remote = rig.prepare(path)
                t0 = time.perf_counter()
                rig.run(path, request, remote)
                times[path].append(time.perf_counter() - t0)
                rig.after(path, remote)
    finally:
        if was:
            gc.enable()
    return times


def measure(c: Any, nixl: Any, mp: Any, case: Case, repeats: int, arena_mib: int
            ) -> dict[str, Any]:
    t0 = time.monotonic()
    rig = Rig(c, nixl, mp, case, arena_mib)
    try:
        t1 = time.monotonic()
        for path in PATHS:
            rig.checked_run(path)
        t2 = time.monotonic()
        times = sample(rig, repeats)
        print(f"{case.name}: set-up {t1 - t0:.1f} s, checked runs {t2 - t1:.1f} s, "
              f"samples {time.monotonic() - t2:.1f} s", file=sys.stderr, flush=True)
        med = {p: statistics.median(v) for p, v in times.items()}
        low = {p: min(v) for p, v in times.items()}
        return dict(
            case=case.name, label=case.label, request_bytes=rig.bytes,
            arena_bytes=rig.arena_bytes, buffers=BUFFERS, rounds=rig.rounds,
            descriptors=rig.descriptors, gather_blocks=rig.gather_blocks,
            scatter_blocks=rig.scatter_blocks, times=times,
            ceiling_gbps=rig.bytes / med["ceiling"] / 1e9,
            fraction_median={p: med["ceiling"] / med[p] for p in PATHS},
            fraction_min={p: low["ceiling"] / low[p] for p in PATHS},
            bytes_ok={p: True for p in PATHS})
    finally:
        rig.close()
        del rig
        gc.collect()


def ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| request | MiB | ceiling (GB/s) | vLLM `_read_blocks` | kvplan staged | ceiling "
        "(1 descriptor) | descriptors: vLLM / staged network (rounds) / ceiling | staged "
        "gather / scatter blocks |",
        "| --- | ---: | ---: | --- | --- | --- | --- | --- |"]
    for row in rows:
        cells = []
        for p in PATHS:
            t = row["times"][p]
            cells.append(f"{ms(statistics.median(t))} ({ms(min(t))}): "
                         f"**{row['fraction_median'][p]:.2f}** ({row['fraction_min'][p]:.2f})")
        d = row["descriptors"]
        out.append(
            f"| {row['label']} | {row['request_bytes'] / 2**20:,.1f} | "
            f"{row['ceiling_gbps']:.2f} | " + " | ".join(cells) +
            f" | {d['vllm']:,} / {d['staged']:,} ({row['rounds']}) / {d['ceiling']} | "
            f"{row['gather_blocks']:,} / {row['scatter_blocks']:,} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the tiny case, 1 repeat, 1 MiB arena, no results file unless --out")
    ap.add_argument("--cases", default=None, help="comma-separated case names (see --list)")
    ap.add_argument("--repeats", type=int, default=None, help="timed samples per path "
                    "(default 5; --quick 1)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/"
                    "vllm-nixl-staged.md; --quick writes none unless given)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    args = ap.parse_args(argv)
    pool = QUICK if args.quick else CASES
    if args.list:
        for case in CASES + QUICK:
            print(f"{case.name}: {case.label}")
        return 0
    if args.cases:
        by_name = {case.name: case for case in CASES + QUICK}
        unknown = [n for n in args.cases.split(",") if n not in by_name]
        if unknown:
            ap.error(f"unknown cases {unknown}; known: {sorted(by_name)}")
        pool = [by_name[n] for n in args.cases.split(",")]
    repeats = args.repeats or (1 if args.quick else 5)
    arena_mib = QUICK_ARENA_MIB if args.quick else ARENA_MIB
    load0, uptime0 = os.getloadavg()[0], sh("uptime")
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    with connector() as (c, nixl, mp):
        for case in pool:
            row = measure(c, nixl, mp, case, repeats, arena_mib)
            rows.append(row)
            print("\n".join(table([row])[2:]), flush=True)
    elapsed = time.monotonic() - started
    uptime1 = sh("uptime")
    command = "nice -n 10 .venv/bin/python bench/vllm_nixl_staged.py" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(repeats=repeats, arena_bytes=arena_mib << 20, rows=[
                {k: v for k, v in r.items()} for r in rows]), f, indent=1)
    out = args.out or (None if args.quick else os.path.join(RESULTS_DIR, "vllm-nixl-staged.md"))
    if out is None:
        return 0
    lines = [
        "# vLLM's NIXL read vs kvplan's staged read in `KvplanNixlConnector`, against the wire "
        "ceiling", "",
        "Generated by `bench/vllm_nixl_staged.py` (what each path covers: the script's "
        "docstring); the section \"What this shows\" is written by hand after the run.", "",
        "```", command, "```", "",
        f"Run took {elapsed:.0f} s. `uptime` at the start: `{uptime0}`; at the end: "
        f"`{uptime1}`. The machine is a shared 2-core VM that other sessions kept busy "
        "during the run: every time here is on a loaded machine.", ""]
    lines += describe(load0, kvplan.__version__) + [""]
    lines += [
        f"Each cell: median (min) per request over {repeats} interleaved samples after an "
        "untimed checked run, then the **fraction of the ceiling** as bytes/s over the "
        "ceiling's bytes/s: median/median in bold, (min/min) in brackets. The ceiling is the "
        "request's bytes as one NIXL READ descriptor between the same two agents. kvplan "
        f"staged: {arena_mib} MiB arena per side in {BUFFERS} round buffers. Target: staged "
        f">= {TARGET} of the ceiling.", ""]
    lines += table(rows) + [""]
    lines += ["## Byte checks", ""]
    for row in rows:
        lines.append(f"- {row['case']}: whole decode KV memory equal to the expected bytes "
                     f"after one untimed run of each path; the request's pages equal after "
                     f"every timed sample of {', '.join(PATHS)}")
    lines += ["", "<!-- hand-written section below -->", ""]
    write_lines(os.path.dirname(out), os.path.basename(out), lines)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
