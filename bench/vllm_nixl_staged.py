"""Per request, vLLM's NIXL read against kvplan's staged read through ``KvplanNixlConnector``,
each as a fraction of the wire ceiling, as vLLM's engine pays it.

    .venv/bin/python bench/vllm_nixl_staged.py                 # full set, writes the results file
    .venv/bin/python bench/vllm_nixl_staged.py --quick         # smoke run (tiny case), no file
    .venv/bin/python bench/vllm_nixl_staged.py --cases gqa-4k-f100 --repeats 5
    .venv/bin/python bench/vllm_nixl_staged.py --tp            # TP 1 -> 2 and 2 -> 1 cases,
                                                               # vllm-nixl-staged-tp.md
    .venv/bin/python bench/vllm_nixl_staged.py --quick --tp    # their smoke run, no file

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

Between TP sizes that differ (``--tp``; ``TpRig``): every prefill and decode rank is its own
worker with its own agent and KV cache, both sides in vLLM's block-contiguous ``LBHNC`` layout,
each decode rank handshaken with the prefill ranks vLLM's ``compute_tp_mapping`` names, vLLM's
prepped lists per (decode rank, prefill rank) built once as its ``add_remote_agent`` does. The
timed reads are decode rank 0's: at prefill TP 1 -> decode TP 2 its heads' half of each prefill
block (vLLM's cost per decode rank; rank 1 reads after it, untimed), at prefill TP 2 -> decode
TP 1 its reads from both prefill ranks (one ``_read_blocks`` each). The ceiling is each timed
prefill rank read's bytes as one descriptor.
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
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def tp(self) -> bool:
        return (self.prefill_tp, self.decode_tp) != (1, 1)

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
# Prefill and decode TP sizes that differ (vLLM's block-contiguous LBHNC, heads outermost): TP 1
# -> 2 times decode rank 0's read (its 4 heads of the prefill's blocks: what vLLM pays per rank;
# rank 1 reads untimed after it, so the prefill gets both ranks' notifications), TP 2 -> 1 the
# decode's reads from both prefill ranks (4 heads each) for the request.
P1D2 = "prefill TP 1 -> decode TP 2, decode rank 0's read (4 of 8 heads)"
P2D1 = "prefill TP 2 -> decode TP 1, the decode's reads from both prefill ranks"
#: The TP cases, generated from their factors: the direction (name prefix, prefill and decode
#: TP, what is timed) with the request sizes it runs (prefill TP 2 -> decode TP 1: the 1K
#: requests only), times the decode's fragmentation. A size is its tokens and the layers kept
#: (32 layers of 4K tokens are 1 GiB a side before the decode's spare pages: 8 there).
TP_DIRECTIONS = (("p1d2", 1, 2, P1D2, (1024, 4096)), ("p2d1", 2, 1, P2D1, (1024,)))
TP_LAYERS = {1024: 32, 4096: 8}
TP_FRAGMENTATIONS = (0.05, 1.0)


def _tp_case(prefix: str, prefill_tp: int, decode_tp: int, what: str, tokens: int,
             fragmentation: float) -> Case:
    layers, k, pct = TP_LAYERS[tokens], tokens // 1024, round(fragmentation * 100)
    kept = "32 layers" if layers == 32 else f"{layers} of 32 layers"
    return Case(f"{prefix}-gqa-{k}k-f{pct}", f"{GQA}, {kept}, block 16, {k}K tokens, decode "
                f"{pct} % fragmented; {what}", layers, tokens, 16, fragmentation,
                prefill_tp=prefill_tp, decode_tp=decode_tp)


TP_CASES = [_tp_case(prefix, p, d, what, tokens, f)
            for prefix, p, d, what, sizes in TP_DIRECTIONS for tokens in sizes
            for f in TP_FRAGMENTATIONS]
QUICK = [
    Case("gqa-tiny", f"{GQA}, 4 layers, block 16, 256 tokens, decode 100 % fragmented", 4, 256,
         16, 1.0),
    Case("mla-tiny", f"{MLA}, 4 layers, block 16, 256 tokens, decode 100 % fragmented", 4, 256,
         16, 1.0, mla=True),
    Case("p1d2-tiny", f"{GQA}, 4 layers, block 16, 256 tokens, decode 100 % fragmented; {P1D2}",
         4, 256, 16, 1.0, prefill_tp=1, decode_tp=2),
    Case("p2d1-tiny", f"{GQA}, 4 layers, block 16, 256 tokens, decode 100 % fragmented; {P2D1}",
         4, 256, 16, 1.0, prefill_tp=2, decode_tp=1),
]
ALL = CASES + TP_CASES + QUICK


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


ENGINE = "prefill-0"


class TpRig(Rig):
    """One case between TP sizes that differ: every prefill rank and decode rank a worker of
    ``KvplanNixlConnector`` (staging on) with its own KV cache in host memory registered with
    its own NIXL agent, each decode rank handshaken with the prefill ranks vLLM's TP mapping
    (``compute_tp_mapping``) names for it, both sides naming vLLM's block-contiguous layout
    (``LBHNC``: heads outermost, so a rank's heads are one range of a block). vLLM's prepped
    lists per (decode rank, prefill rank) are what its ``add_remote_agent`` builds
    (``_build_fa_remote``, ``_build_local_splits_from_plan``), once, outside the timer. The
    timed decode is rank 0: its reads of the request, one ``_read_blocks`` per prefill rank
    the mapping names (vLLM's ``_read_blocks_for_req`` loop), until vLLM's polling reports it
    done. The other decode ranks read after, untimed, so each prefill rank gets every
    consumer's notification."""

    def __init__(self, c: Any, nixl: Any, mp: Any, case: Case, arena_mib: int) -> None:
        from support.vllm_nixl_pair import TpPair

        self.c, self.nixl, self.case = c, nixl, case
        g = self.g = case.geometry()
        n = case.pages
        self.src_pages = np.arange(1, n + 1, dtype=np.int64)
        self.dst_pages = fragmented_pages(n, case.fragmentation, seed=7, shuffle_runs=True,
                                          capacity=g.blocks).astype(np.int64)
        staging = {"kvplan_staging": "always", "kvplan_staging_arena_mib": arena_mib,
                   "kvplan_staging_buffers": BUFFERS}
        P, D = case.prefill_tp, case.decode_tp
        # the request is kept per run (prepare), not at set-up
        self.pair = TpPair(c, nixl, mp, prefill_tp=P, decode_tp=D, geometry=g,
                           prefill_pages=self.src_pages.tolist(),
                           decode_pages=self.dst_pages.tolist(), staging=staging, keep=False)
        self.p_mem, self.d_mem = self.pair.p_mem, self.pair.d_mem
        self.prefill, self.decode = self.pair.prefill, self.pair.decode
        self.plans, self.sources = self.pair.plans, self.pair.sources
        self.prepped = [self.pair.prep(d) for d in range(D)]  # vLLM's, once per peer
        # each (decode rank, prefill rank) read: the heads both hold, as byte ranges of a block
        hb = g.block * g.head_bytes
        self.spans: list[list[tuple[int, int, int, int]]] = []  # (r, d offset, p offset, len)
        for d in range(D):
            spans = []
            for r in self.sources[d]:
                d0, p0 = d * g.heads // D, r * g.heads // P
                lo, hi = max(d0, p0), min(d0 + g.heads // D, p0 + g.heads // P)
                assert lo < hi, (d, r)
                spans.append((r, (lo - d0) * hb, (lo - p0) * hb, (hi - lo) * hb))
            self.spans.append(spans)
        self.d_bb, self.p_bb = g.block_bytes(D), g.block_bytes(P)
        self.d_blocks = [m.reshape(g.regions, g.blocks, self.d_bb) for m in self.d_mem]
        self.p_blocks = [m.reshape(g.regions, g.blocks, self.p_bb) for m in self.p_mem]
        # the timed decode's reads: rank 0's, bytes per prefill rank read
        self.read_bytes = [g.regions * n * length for _, _, _, length in self.spans[0]]
        self.bytes = sum(self.read_bytes)
        self.arena_bytes = arena_mib << 20
        self.seq = 0
        self.descriptors: dict[str, int] = {}
        self.rounds = 0
        self.agent = getattr(self.decode[0].nixl_wrapper, "agent", self.decode[0].nixl_wrapper)
        self._ceiling_descs()

    def prepare(self, path: str) -> tuple[str, str]:
        request, remote = self._ids()
        if path == "ceiling":
            self.d_mem[0][:self.bytes] = 0
        else:
            self.pair.keep(request=remote)
            for blocks in self.d_blocks:
                blocks[:, self.dst_pages] = 0
        return request, remote

    def read(self, d: int, path: str, request: str, remote: str) -> list[Any]:
        """Decode rank ``d``'s reads of the request (``TpPair.read``: one ``_read_blocks`` per
        prefill rank the mapping names) with the lists prepared once, then vLLM's polling
        until it reports the request done."""
        handles = self.pair.read(d, vllm_only=path == "vllm", request=request,
                                 remote_request=remote, prepped=self.prepped[d])
        done, failed = self.pair.poll(d, timeout_s=120.0, interval_s=POLL_S)
        if failed or done != {request}:
            raise SystemExit(f"{self.case.name} {path}: decode rank {d}'s read of {request} "
                             f"failed (done {done}, failed {failed})")
        return handles

    def run(self, path: str, request: str, remote: str) -> None:
        if path == "ceiling":
            self.ceiling()
            return
        self.last_handles = self.read(0, path, request, remote)

    def after(self, path: str, remote: str) -> None:
        if path != "ceiling":  # the other decode ranks' reads, untimed
            request = f"{remote}-rest"
            for d in range(1, len(self.decode)):
                self.read(d, path, request, remote)
        if not self.pages_ok(path):
            raise SystemExit(f"{self.case.name} {path}: the decode's bytes differ from the "
                             f"prefill's pages")
        if path != "ceiling":
            self.drain(remote)

    def _ceiling_descs(self) -> None:
        from kvplan.engines.nixl.descriptors import descriptor_rows

        self.ceiling_descs = []
        off = 0
        for (r, _, _, _), size in zip(self.spans[0], self.read_bytes):
            one = np.array([size], np.uint64)
            local = self.agent.get_xfer_descs(descriptor_rows(
                np.array([self.d_mem[0].ctypes.data + off], np.uint64), one, 0), "DRAM")
            remote = self.agent.get_xfer_descs(descriptor_rows(
                np.array([self.p_mem[r].ctypes.data], np.uint64), one, 0), "DRAM")
            self.ceiling_descs.append((local, remote, self.decode[0]._remote_agents[ENGINE][
                (0, r)], r, off, size))
            off += size

    def ceiling(self) -> None:
        """Each prefill rank read of the timed decode as ONE descriptor READ of its bytes, all
        posted, then polled to DONE."""
        agent = self.agent
        handles = [agent.initialize_xfer("READ", local, remote, name, b"")
                   for local, remote, name, *_ in self.ceiling_descs]
        try:
            states = [agent.transfer(h) for h in handles]
            while any(s != "DONE" for s in states):
                if "ERR" in states:
                    raise SystemExit(f"{self.case.name} ceiling: NIXL reported ERR")
                time.sleep(POLL_S)
                states = [s if s == "DONE" else agent.check_xfer_state(h)
                          for h, s in zip(handles, states)]
        finally:
            for h in handles:
                agent.release_xfer_handle(h)

    def drain(self, remote: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self.prefill:
            while remote in w._reqs_to_send and time.monotonic() < deadline:
                w._get_new_notifs()
                if remote in w._reqs_to_send:
                    time.sleep(0.001)
            if remote in w._reqs_to_send:
                raise SystemExit(f"{self.case.name}: prefill rank {w.tp_rank} was not notified "
                                 f"of {remote}")

    def pages_ok(self, path: str) -> bool:
        if path == "ceiling":
            return all(np.array_equal(self.d_mem[0][off:off + size], self.p_mem[r][:size])
                       for _, _, _, r, off, size in self.ceiling_descs)
        for d, spans in enumerate(self.spans):
            got = self.d_blocks[d][:, self.dst_pages]
            for r, d_off, p_off, length in spans:
                if not np.array_equal(got[:, :, d_off:d_off + length],
                                      self.p_blocks[r][:, self.src_pages, p_off:p_off + length]):
                    return False
        return True

    def whole_ok(self, path: str) -> bool:
        if path == "ceiling":
            want = np.zeros_like(self.d_mem[0])
            for _, _, _, r, off, size in self.ceiling_descs:
                want[off:off + size] = self.p_mem[r][:size]
            return bool(np.array_equal(self.d_mem[0], want))
        for d, spans in enumerate(self.spans):
            want = np.zeros_like(self.d_blocks[d])
            for r, d_off, p_off, length in spans:
                want[:, self.dst_pages, d_off:d_off + length] = \
                    self.p_blocks[r][:, self.src_pages, p_off:p_off + length]
            if not np.array_equal(self.d_blocks[d], want):
                return False
        return True

    def checked_run(self, path: str) -> None:
        from kvplan.compat.vllm.nixl_staging import StagedRead

        for m in self.d_mem:
            m[:] = 0
        stats = self.decode[0].xfer_stats.data["num_descriptors"]
        before = len(stats)
        request, remote = self.prepare(path)
        self.run(path, request, remote)
        timed = len(stats)
        self.after(path, remote)  # the other ranks' reads, the request's pages checked
        if not self.whole_ok(path):
            raise SystemExit(f"{self.case.name} {path}: the decode's KV memory differs from "
                             f"the expected bytes")
        if path == "ceiling":
            self.descriptors[path] = len(self.ceiling_descs)
        elif path == "vllm":
            self.descriptors[path] = int(sum(stats[before:timed]))
        else:
            handles = self.last_handles
            if not all(isinstance(h, StagedRead) for h in handles):
                raise SystemExit(f"{self.case.name}: kvplan's worker did not stage every read")
            self.rounds = sum(len(h.rounds) for h in handles)
            self.descriptors[path] = self.rounds
            self.gather_blocks = sum(len(r.gather) for h in handles for r in h.rounds)
            self.scatter_blocks = sum(len(r.scatter) for h in handles for r in h.rounds)

    def close(self) -> None:
        self.pair.close()


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
    rig = (TpRig if case.tp else Rig)(c, nixl, mp, case, arena_mib)
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
                    "vllm-nixl-staged.md, or vllm-nixl-staged-tp.md for the TP cases; --quick "
                    "writes none unless given)")
    ap.add_argument("--tp", action="store_true", help="the cases between prefill and decode "
                    "TP sizes that differ (with --quick: their tiny ones); their results file is "
                    "bench/results/vllm-nixl-staged-tp.md")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    args = ap.parse_args(argv)
    pool = QUICK if args.quick else CASES
    if args.tp:
        pool = [c for c in QUICK if c.tp] if args.quick else TP_CASES
    elif args.quick:
        pool = [c for c in QUICK if not c.tp]
    if args.list:
        for case in ALL:
            print(f"{case.name}: {case.label}")
        return 0
    if args.cases:
        by_name = {case.name: case for case in ALL}
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
    niceness = os.nice(0)  # the command as it ran: under nice only where it did
    command = ((f"nice -n {niceness} " if niceness else "") +
               ".venv/bin/python bench/vllm_nixl_staged.py" + (
                   " " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(repeats=repeats, arena_bytes=arena_mib << 20, rows=[
                {k: v for k, v in r.items()} for r in rows]), f, indent=1)
    tp = any(case.tp for case in pool)
    if tp and not all(case.tp for case in pool) and args.out is None and not args.quick:
        ap.error("cases with and without TP sizes that differ go to different results files: "
                 "run them apart or name --out")
    out = args.out or (None if args.quick else os.path.join(
        RESULTS_DIR, "vllm-nixl-staged-tp.md" if tp else "vllm-nixl-staged.md"))
    if out is None:
        return 0
    lines = [
        "# vLLM's NIXL read vs kvplan's staged read in `KvplanNixlConnector`, against the wire "
        "ceiling", "",
        "Generated by `bench/vllm_nixl_staged.py` (what each path covers: the script's "
        "docstring); the section \"What this shows\" is written by hand after the run.", "",
        "```", command, "```", "",
        f"Run took {elapsed:.0f} s. `uptime` at the start: `{uptime0}`; at the end: "
        f"`{uptime1}`. The machine is a shared 2-core VM: the load averages say how busy "
        "it was (the run's own NIXL agents and copies count in them).", ""]
    lines += describe(load0, kvplan.__version__) + [""]
    lines += [
        f"Each cell: median (min) per request over {repeats} interleaved samples after an "
        "untimed checked run, then the **fraction of the ceiling** as bytes/s over the "
        "ceiling's bytes/s: median/median in bold, (min/min) in brackets. The ceiling is the "
        "request's bytes as one NIXL READ descriptor between the same two agents. kvplan "
        f"staged: {arena_mib} MiB arena per side in {BUFFERS} round buffers. Target: staged "
        f">= {TARGET} of the ceiling.", ""]
    if tp:
        lines += [
            "Prefill and decode TP sizes that differ (both sides in vLLM's block-contiguous "
            "`LBHNC` layout, heads outermost; 8 KV heads in all): prefill TP 1 -> decode TP 2 "
            "times decode rank 0's read of the request (its 4 heads: half of each prefill "
            "block), what vLLM pays per decode rank (rank 1 reads after it, untimed, so the "
            "prefill gets both notifications); prefill TP 2 -> decode TP 1 times the decode's "
            "reads from both prefill ranks (one `_read_blocks` each, vLLM's loop; each lands "
            "half of each decode block), until vLLM's polling reports the request done. "
            "vLLM's descriptor lists for each (decode rank, prefill rank) are the ones its "
            "`add_remote_agent` builds (`_build_fa_remote`, `_build_local_splits_from_plan`), "
            "built once outside the timer. MiB: the bytes the timed reads move. The ceiling: "
            "each timed prefill rank read's bytes as ONE descriptor (so 1 descriptor for TP 1 "
            "-> 2, 2 posted together for TP 2 -> 1). kvplan staged: one staged stream per "
            "prefill rank read; its descriptor count is the network reads (rounds) of all of "
            "them. Byte checks: every decode rank's pages hold exactly its heads' bytes of the "
            "prefill ranks' pages, every other byte zero.", ""]
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
