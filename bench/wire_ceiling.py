"""Per request, the fraction of the wire ceiling each transfer path reaches, on loopback engines.

    .venv/bin/python bench/wire_ceiling.py                    # full set, writes the results file
    .venv/bin/python bench/wire_ceiling.py --quick            # smoke run (< 60 s), no file
    .venv/bin/python bench/wire_ceiling.py --cases mla-4k-f5 --engines nixl --repeats 5

The **wire ceiling** of a request is the same number of bytes moved as ONE descriptor on the
same engine and transport (from the prefill's pages region into the decode's staging region,
both registered). Against it, per request, on Mooncake TCP (two engines on 127.0.0.1) and NIXL
UCX (two agents), both ends in this process, host memory:

- **ceiling**: ``Transport.submit`` of one block holding the request's bytes;
- **host**: the host engine's own descriptor generation and hand-off, per row: SGLang 0.5.23's
  real ``MooncakeKVManager`` methods from the wheel (``_send_kvcache_generic`` for MLA,
  ``send_kvcache_slice`` for TP-mismatched heads, ``send_kvcache_dcp`` for DCP; loaded by
  ``tests/support/sglang_loader.py``), whose one ``_transfer_data`` call hands all its
  descriptors to the engine in one call: on Mooncake SGLang's own ``MooncakeTransferEngine``
  wrapper around the real engine (``batch_transfer_sync_write``); on NIXL the same lists as one
  ``initialize_xfer`` transfer, posted and polled to DONE (SGLang's descriptors on NIXL, not its
  NIXL connector). A request shape no host engine sends (decode pages of another size) has no
  host column;
- **kvplan direct**: ``Template.plan`` + ``Transport.submit`` (kvplan's bounded batches);
- **kvplan staged**: ``Template.plan_staged`` + ``kvplan.copy_local`` of the gather +
  ``Transport.submit`` of the network plan + ``kvplan.copy_local`` of the scatter, one after
  another; each step is timed too;
- **kvplan rounds**: ``Template.plan_rounds`` through a 64 MiB arena per side (two round
  buffers) run by ``kvplan.exec.pipeline.run_rounds`` (rounds overlapping), where this build has
  them; otherwise the column says so.

Same work on every side: each path's descriptor generation (planning) is paid per request, so it
is inside its time; transports, registration, templates and the host's manager objects are
built once per case, outside. Paths are sampled interleaved in one process (each repetition
runs every path once, the order rotated per repetition, collector off; an untimed call of each
path first). Before timing, every path runs once into a zeroed decode arena and its decode
pages are compared byte for byte with the expected bytes (SGLang's descriptors applied with
numpy where SGLang has the path, else kvplan's direct plan applied with numpy); the ceiling's
destination is compared with the source bytes it moved.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
#: Mooncake TCP refuses a batch whose entries overflow its per-peer lane queues (1,024 transfers
#: per lane by default: a one-call batch of ~4K descriptors already fails). The host engines
#: hand a request to Mooncake in one call, so the run raises the queue to the largest value
#: this build accepts (32,768; one call of 12,566 descriptors then passes, 100,000 still fail).
#: ``--mooncake-queue 0`` keeps the engine's default.
MOONCAKE_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
MOONCAKE_QUEUE = 32768

import numpy as np  # noqa: E402
from harness.machine import describe  # noqa: E402  (also: tests/ on sys.path, support.*)
from harness.results import RESULTS_DIR, write_lines  # noqa: E402
from harness.timing import alternating  # noqa: E402

import kvplan  # noqa: E402
from kvplan.presets import fragmented_pages  # noqa: E402

ROUND_ARENA = 64 << 20  # bytes of each side's round arena (the target's bound)
QUICK_ARENA = 1 << 20  # --quick: small enough that the tiny requests take several rounds
ROUND_BUFFERS = 2
ALIGN = 4096
PATHS = ("ceiling", "host", "direct", "staged", "rounds")
NOT_BUILT = "n/a (not built yet)"


def up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ----------------------------------------------------------------------------------------------
# Cases: the request's layouts, pages and the host engine's own sender
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    """One request placed in the two arenas: kvplan's template and arguments, the spans of the
    two sides' pages, and the host engine's sender (a callable taking the engine adapter)."""

    template: kvplan.Template
    src_pages: np.ndarray
    dst_pages: np.ndarray
    src_span: int
    dst_span: int
    n_tokens: int | None
    host_label: str
    host: Callable[[Any], int] | None  # sends the request through the adapter; returns rc
    writers: int = 1  # prefill ranks writing into the decode's staging region (its size)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    label: str
    kind: str  # "mla", "tp", "page", "dcp"
    layers: int
    tokens: int
    fragmentation: float

    def build(self, sg: Any, src_base: int, dst_base: int) -> Built:
        return BUILDERS[self.kind](self, sg, src_base, dst_base)


MLA_ITEM = 576 * 2  # DeepSeek-V3's latent row per token per layer, bf16


def build_mla(case: Case, sg: Any, src_base: int, dst_base: int) -> Built:
    """61-layer MLA (DeepSeek-V3 rows), page 1: prefill pages consecutive, decode pages with
    round(f * (n - 1)) breaks in shuffled runs (``fragmented_pages``)."""
    n, layers, item = case.tokens, case.layers, MLA_ITEM
    src_cap, dst_cap = n, 2 * n
    src_ptrs = [src_base + i * item * src_cap for i in range(layers)]
    dst_ptrs = [dst_base + i * item * dst_cap for i in range(layers)]
    geometry = dict(page_size=1, kv_heads=1, head_dim=576, dtype_size=2)
    src = kvplan.Layout.mla(src_ptrs, [item * src_cap] * layers, item, list(range(layers)),
                            **geometry)
    dst = kvplan.Layout.mla(dst_ptrs, [item * dst_cap] * layers, item, list(range(layers)),
                            **geometry)
    src_pages = np.arange(n, dtype=np.int64)
    dst_pages = fragmented_pages(n, case.fragmentation, seed=7, shuffle_runs=True,
                                 capacity=dst_cap).astype(np.int64)
    host = None
    if sg is not None:
        mgr = sg.make_manager(is_mla_backend=True)
        s32, d32 = src_pages.astype(np.int32), dst_pages.astype(np.int32)

        def host(adapter: Any) -> int:
            mgr.engine = adapter
            return int(mgr.send(src_ptrs, dst_ptrs, [item] * layers, s32, d32,
                                session=adapter.session))

    return Built(kvplan.Template(src, dst), src_pages, dst_pages, layers * item * src_cap,
                 layers * item * dst_cap, None,
                 "SGLang 0.5.23 `_send_kvcache_generic`", host)


GQA = dict(heads=8, head_dim=128, dtype=2)


def gqa_layout(base: int, layers: int, page: int, capacity: int, tp: int, rank: int
               ) -> tuple[kvplan.Layout, list[int], int]:
    item = page * max(1, GQA["heads"] // tp) * GQA["head_dim"] * GQA["dtype"]
    span = item * capacity
    ptrs = [base + e * span for e in range(2 * layers)]
    layout = kvplan.Layout.mha(ptrs[:layers], ptrs[layers:], [span] * layers, [span] * layers,
                               item, item, layer_ids=list(range(layers)), page_size=page,
                               tp_rank=rank, tp_size=tp, kv_heads=GQA["heads"],
                               head_dim=GQA["head_dim"], dtype_size=GQA["dtype"],
                               memory_order="NHD")
    return layout, ptrs, item


def build_tp(case: Case, sg: Any, src_base: int, dst_base: int) -> Built:
    """GQA 8 x 128 bf16, page 16, NHD, prefill TP 8 -> decode TP 2: the request of prefill rank
    0 to decode rank 0 (one of decode rank 0's four writers), decode pages 50 % fragmented."""
    page, layers = 16, case.layers
    pages = -(-case.tokens // page)
    cap = 2 * pages + 2
    src, sptrs, sitem = gqa_layout(src_base, layers, page, cap, 8, 0)
    dst, dptrs, ditem = gqa_layout(dst_base, layers, page, cap, 2, 0)
    src_pages = np.arange(pages, dtype=np.int64)
    dst_pages = fragmented_pages(pages, case.fragmentation, seed=7, shuffle_runs=True,
                                 capacity=cap).astype(np.int64)
    host = None
    if sg is not None:
        from support.sglang_loader import InlineExecutor, load_head_slicing

        load_head_slicing(sg)
        ids = list(range(layers)) * 2
        kv_args = types.SimpleNamespace(
            kv_item_lens=[sitem] * (2 * layers), page_size=page,
            total_kv_head_num=GQA["heads"], kv_head_num=1, engine_rank=0, kv_data_ptrs=sptrs,
            kv_layer_ids=ids, prefill_start_layer=0)
        M = sg.MooncakeKVManager
        me = types.SimpleNamespace(kv_args=kv_args, attn_tp_size=8, pp_size=1, engine=None,
                                   enable_deferred_decode_kv_release=False)
        me._await_transfer_futures = types.MethodType(M._await_transfer_futures, me)
        me.get_mha_kv_ptrs_with_pp = types.MethodType(sg.get_mha_kv_ptrs_with_pp, me)
        s32, d32 = src_pages.astype(np.int32), dst_pages.astype(np.int32)
        executor = InlineExecutor()

        def host(adapter: Any) -> int:
            me.engine = adapter
            return int(M.send_kvcache_slice(me, adapter.session, s32, dptrs, d32, 0, 2, ditem,
                                            executor, dst_layer_ids=ids))

    return Built(kvplan.Template(src, dst), src_pages, dst_pages, 2 * layers * sitem * cap,
                 2 * layers * ditem * cap, None, "SGLang 0.5.23 `send_kvcache_slice`", host,
                 writers=4)


def build_page(case: Case, sg: Any, src_base: int, dst_base: int) -> Built:
    """GQA 8 x 128 bf16, TP 1, NHD, prefill pages of 16 tokens (fully fragmented) -> decode
    pages of 64 (fully fragmented). No host engine sends between pages of different sizes."""
    layers, n = case.layers, case.tokens
    sp, dp = -(-n // 16), -(-n // 64)
    scap, dcap = 2 * sp + 2, 2 * dp + 2
    src, _, sitem = gqa_layout(src_base, layers, 16, scap, 1, 0)
    dst, _, ditem = gqa_layout(dst_base, layers, 64, dcap, 1, 0)
    src_pages = fragmented_pages(sp, case.fragmentation, seed=3, shuffle_runs=True,
                                 capacity=scap).astype(np.int64)
    dst_pages = fragmented_pages(dp, case.fragmentation, seed=7, shuffle_runs=True,
                                 capacity=dcap).astype(np.int64)
    return Built(kvplan.Template(src, dst), src_pages, dst_pages, 2 * layers * sitem * scap,
                 2 * layers * ditem * dcap, n,
                 "none (no host engine sends between page sizes)", None)


DCP_ROW, DCP_PAGE, DCP_SIZE = 576, 64, 4  # FP8 latent rows, 64-token pages, decode DCP 4


def build_dcp(case: Case, sg: Any, src_base: int, dst_base: int) -> Built:
    """MLA rows of 576 bytes (FP8), page 64, prefill DCP 1 -> decode DCP 4 dealt token by token
    (interleave 1, SGLang's deal): the share of decode rank 0, its pages 30 % fragmented."""
    layers, n = case.layers, case.tokens
    item = DCP_PAGE * DCP_ROW
    src_count = -(-n // DCP_PAGE)
    share = len(range(0, n, DCP_SIZE))
    dst_count = -(-share // DCP_PAGE)
    scap, dcap = 2 * src_count, 2 * dst_count

    def ptrs(base: int, cap: int) -> list[int]:
        return [base + k * item * cap for k in range(layers)]

    src = kvplan.Layout.mla(ptrs(src_base, scap), [item * scap] * layers, item,
                            list(range(layers)), page_size=DCP_PAGE)
    dst = kvplan.Layout.mla(ptrs(dst_base, dcap), [item * dcap] * layers, item,
                            list(range(layers)), page_size=DCP_PAGE, dcp_size=DCP_SIZE,
                            dcp_rank=0, dcp_interleave=1)
    src_pages = np.arange(src_count, dtype=np.int64)
    dst_pages = fragmented_pages(dst_count, case.fragmentation, seed=0,
                                 capacity=dcap).astype(np.int64)
    host = None
    if sg is not None:
        sglang_dcp(sg)
        kv_args = types.SimpleNamespace(
            kv_data_ptrs=ptrs(src_base, scap), kv_data_lens=[item * scap] * layers,
            kv_item_lens=[item] * layers, kv_layer_ids=list(range(layers)),
            num_draft_entries=0, page_size=DCP_PAGE, prefill_start_layer=0, engine_rank=0)
        mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=kv_args, is_mla_backend=True,
                                engine=None)
        s32, d32 = src_pages.astype(np.int32), dst_pages.astype(np.int32)
        dptrs = ptrs(dst_base, dcap)

        def host(adapter: Any) -> int:
            mgr.engine = adapter
            return int(mgr.send_kvcache_dcp(
                adapter.session, s32, dptrs, d32, dcp_token_item_lens=[DCP_ROW] * layers,
                dst_dcp_size=DCP_SIZE, dst_dcp_rank=0, src_page_offset=0, decode_prefix_len=0,
                num_kv_tokens=n, executor=None, dst_layer_ids=list(range(layers)),
                pack_buffer=None))

    return Built(kvplan.Template(src, dst), src_pages, dst_pages, layers * item * scap,
                 layers * item * dcap, n, "SGLang 0.5.23 `send_kvcache_dcp`", host)


def sglang_dcp(sg: Any) -> None:
    from support.sglang_loader import load_dcp_pack

    load_dcp_pack(sg)


BUILDERS: dict[str, Callable[[Case, Any, int, int], Built]] = {
    "mla": build_mla, "tp": build_tp, "page": build_page, "dcp": build_dcp}

MLA = "MLA 61 layers, page 1"
CASES = [
    Case("mla-4k-f5", f"{MLA}, 4K tokens, decode 5 % fragmented", "mla", 61, 4096, 0.05),
    Case("mla-4k-f100", f"{MLA}, 4K tokens, decode 100 % fragmented", "mla", 61, 4096, 1.0),
    # 61 layers x 32K tokens is 2.3 GB a side before staging; 8 layers keep the run < 8 GiB
    Case("mla-32k-f5", "MLA 8 of 61 layers, page 1, 32K tokens, decode 5 % fragmented", "mla",
         8, 32768, 0.05),
    Case("mla-32k-f100", "MLA 8 of 61 layers, page 1, 32K tokens, decode 100 % fragmented",
         "mla", 8, 32768, 1.0),
    Case("gqa-tp-1k", "GQA 8x128 bf16 32 layers page 16, TP 8->2 NHD, 1K tokens", "tp", 32,
         1024, 0.5),
    Case("gqa-tp-8k", "GQA 8x128 bf16 32 layers page 16, TP 8->2 NHD, 8K tokens", "tp", 32,
         8192, 0.5),
    Case("page-16-64", "GQA 8x128 bf16 32 layers, page 16 -> 64, 4K tokens, both sides "
         "100 % fragmented", "page", 32, 4096, 1.0),
    Case("dcp-1-4", "MLA 24 layers FP8 rows page 64, DCP 1 -> 4 (token deal), 8K tokens, "
         "decode 30 % fragmented", "dcp", 24, 8192, 0.3),
]
QUICK = [
    Case("mla-tiny", "MLA 4 layers, page 1, 256 tokens, decode 100 % fragmented", "mla", 4,
         256, 1.0),
    Case("gqa-tp-tiny", "GQA 8x128 bf16 4 layers page 16, TP 8->2 NHD, 256 tokens", "tp", 4,
         256, 0.5),
]


# ----------------------------------------------------------------------------------------------
# Engines: two transports, two arenas, and the adapter the host engine's code hands its lists to
# ----------------------------------------------------------------------------------------------


class MooncakeHost:
    """The engine a SGLang manager holds: SGLang 0.5.23's own ``MooncakeTransferEngine`` wrapper
    (its ``batch_transfer_sync`` from the wheel) around the sender's real Mooncake engine."""

    def __init__(self, sg: Any, engine: Any, session: str) -> None:
        from support.sglang_loader import load_engine_wrapper

        cls = load_engine_wrapper(sg)
        self.wrapper = object.__new__(cls)
        self.wrapper.engine = engine
        self.session = session
        self.calls: list[tuple[list[int], list[int], list[int]]] = []
        self.record = False

    def batch_transfer_sync(self, session_id: str, src: list[int], dst: list[int],
                            lengths: list[int]) -> int:
        if self.record:
            self.calls.append((src, dst, lengths))
        return int(self.wrapper.batch_transfer_sync(session_id, src, dst, lengths))


class NixlHost:
    """The host engine's lists on NIXL: one transfer of all of them (``get_xfer_descs`` on both
    sides, ``initialize_xfer``, ``transfer``), polled to DONE and released."""

    def __init__(self, transport: Any, peer: str) -> None:
        from kvplan.engines.nixl import descriptor_rows

        self.rows = descriptor_rows
        self.agent = transport._agent
        (self.local_mem, self.local_dev), (self.remote_mem, self.remote_dev) = \
            transport._mems(peer, 0)
        self.session = peer
        self.calls: list[tuple[list[int], list[int], list[int]]] = []
        self.record = False

    def batch_transfer_sync(self, session_id: str, src: list[int], dst: list[int],
                            lengths: list[int]) -> int:
        if self.record:
            self.calls.append((src, dst, lengths))
        n = np.asarray(lengths, np.uint64)
        local = self.agent.get_xfer_descs(
            self.rows(np.asarray(src, np.uint64), n, self.local_dev), self.local_mem)
        remote = self.agent.get_xfer_descs(
            self.rows(np.asarray(dst, np.uint64), n, self.remote_dev), self.remote_mem)
        handle = self.agent.initialize_xfer("WRITE", local, remote, session_id, b"")
        try:
            if self.agent.transfer(handle) not in ("PROC", "DONE"):
                return -1
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                pass
            return 0 if state == "DONE" else -1
        finally:
            self.agent.release_xfer_handle(handle)


class Rig:
    """One engine's two loopback transports and two registered host arenas."""

    def __init__(self, engine: str, src_bytes: int, dst_bytes: int, sg: Any) -> None:
        self.engine = engine
        self.sg = sg
        self.src = np.empty(src_bytes, np.uint8)
        rng = np.random.default_rng(1)
        for lo in range(0, src_bytes, 64 << 20):  # in pieces: no second arena-sized array
            piece = self.src[lo:lo + (64 << 20)]
            piece[:] = rng.integers(0, 256, piece.size, dtype=np.uint8)
        self.dst = np.zeros(dst_bytes, np.uint8)
        self.open()

    def open(self) -> None:
        from kvplan.engines.measure import loopback_transports

        self.sender, self.receiver = loopback_transports(self.engine)
        self.sender.register_buffers([self.src.ctypes.data], [self.src.size])
        self.receiver.register_buffers([self.dst.ctypes.data], [self.dst.size])
        if self.engine == "nixl":
            self.peer = self.sender.add_peer(self.receiver.metadata())  # type: ignore[attr-defined]
            self.host: Any = NixlHost(self.sender, self.peer)
        else:
            self.peer = self.receiver.local_session_id()
            self.host = (MooncakeHost(self.sg, self.sender._engine, self.peer)  # type: ignore[attr-defined]
                         if self.sg is not None else None)

    def reopen(self) -> None:
        """Fresh transports on the same arenas: Mooncake's TCP session can be left broken by a
        refused over-full batch (the next write on it fails), so one refusal must not decide
        the other paths' results."""
        self.close()
        self.open()

    def submit(self, plan: Any) -> None:
        self.sender.submit(plan, self.peer)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


# ----------------------------------------------------------------------------------------------
# The paths
# ----------------------------------------------------------------------------------------------


def rounds_api() -> tuple[Callable[..., Any] | None, str]:
    """``kvplan.exec.pipeline.run_rounds`` when this build has it and ``Template.plan_rounds``,
    else (None, why)."""
    if not hasattr(kvplan.Template, "plan_rounds"):
        return None, NOT_BUILT
    try:
        from kvplan.exec import pipeline
    except ImportError:
        return None, NOT_BUILT
    run = getattr(pipeline, "run_rounds", None)
    return (run, "") if run is not None else (None, NOT_BUILT)


@dataclasses.dataclass
class Setup:
    """A case placed on a rig: views, regions and the paths as callables."""

    built: Built
    src_pages_view: np.ndarray
    dst_pages_view: np.ndarray
    src_staging: tuple[int, int]
    dst_staging: tuple[int, int]
    src_staging_view: np.ndarray
    dst_staging_view: np.ndarray
    src_arena: tuple[int, int]
    dst_arena: tuple[int, int]
    request_bytes: int


def arena_sizes(built_probe: Built, request_bytes: int, arena: int) -> tuple[int, int]:
    src = up(built_probe.src_span) + up(request_bytes) + arena
    dst = up(built_probe.dst_span) + up(built_probe.writers * request_bytes) + arena
    return src, dst


def place(rig: Rig, built: Built, request_bytes: int, arena: int) -> Setup:
    s0, d0 = rig.src.ctypes.data, rig.dst.ctypes.data
    s_st, d_st = up(built.src_span), up(built.dst_span)
    s_n, d_n = up(request_bytes), up(built.writers * request_bytes)
    s_ar, d_ar = s_st + s_n, d_st + d_n
    return Setup(built, rig.src[:built.src_span], rig.dst[:built.dst_span],
                 (s0 + s_st, s_n), (d0 + d_st, d_n),
                 rig.src[s_st:s_st + s_n], rig.dst[d_st:d_st + d_n],
                 (s0 + s_ar, arena), (d0 + d_ar, arena), request_bytes)


def plan_kwargs(built: Built) -> dict[str, Any]:
    return {} if built.n_tokens is None else {"n_tokens": built.n_tokens}


def paths(rig: Rig, st: Setup, steps: list[dict[str, float]], reports: list[Any]
          ) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """The callables of every path that runs here, and a note for each that does not."""
    b = st.built
    kw = plan_kwargs(b)
    src0 = np.array([rig.src.ctypes.data], np.uint64)
    dst0 = np.array([st.dst_staging[0]], np.uint64)
    n0 = np.array([st.request_bytes], np.uint64)
    notes: dict[str, str] = {}

    def ceiling() -> None:
        rig.submit(kvplan.BlockSlice(src0, dst0, n0))

    def direct() -> None:
        rig.submit(b.template.plan(b.src_pages, b.dst_pages, **kw))

    def staged() -> None:
        t0 = time.perf_counter()
        sp = b.template.plan_staged(b.src_pages, b.dst_pages, src_staging=st.src_staging,
                                    dst_staging=st.dst_staging, **kw)
        t1 = time.perf_counter()
        kvplan.copy_local(sp.gather, [st.src_pages_view], [st.src_staging_view])
        t2 = time.perf_counter()
        rig.submit(sp.network)
        t3 = time.perf_counter()
        kvplan.copy_local(sp.scatter, [st.dst_staging_view], [st.dst_pages_view])
        t4 = time.perf_counter()
        steps.append({"plan": t1 - t0, "gather": t2 - t1, "network": t3 - t2,
                      "scatter": t4 - t3})

    fns: dict[str, Callable[[], Any]] = {"ceiling": ceiling}
    if b.host is not None and rig.host is not None:
        host_fn = b.host
        adapter = rig.host

        def host() -> None:
            rc = host_fn(adapter)
            if rc != 0:
                if not host_refusals.armed:
                    raise HostRefused(rc)
                host_refusals.codes.append(rc)

        fns["host"] = host
    else:
        notes["host"] = "n/a (no host path for this shape)" if b.host is None else "n/a"
    fns["direct"] = direct
    fns["staged"] = staged
    run_rounds, why = rounds_api()
    if run_rounds is None:
        notes["rounds"] = why
    else:
        fns["rounds"] = rounds_path(rig, st, run_rounds, reports)
    return fns, notes


def rounds_path(rig: Rig, st: Setup, run_rounds: Callable[..., Any],
                reports: list[Any]) -> Callable[[], Any]:
    """``plan_rounds`` through the two 64 MiB arenas, run by ``run_rounds``: the network plans
    go through the sender's ``submit_async`` (waited on by the pipeline), the gathers and
    scatters through ``copy_local`` (the pipeline's default copies)."""
    b = st.built
    kw = plan_kwargs(b)
    s_off = st.src_arena[0] - rig.src.ctypes.data
    d_off = st.dst_arena[0] - rig.dst.ctypes.data
    src_arena_view = rig.src[s_off:s_off + st.src_arena[1]]
    dst_arena_view = rig.dst[d_off:d_off + st.dst_arena[1]]
    post = getattr(rig.sender, "submit_async")

    def rounds() -> None:
        plan = b.template.plan_rounds(b.src_pages, b.dst_pages, src_arena=st.src_arena,
                                      dst_arena=st.dst_arena, buffers=ROUND_BUFFERS, **kw)
        reports.append(run_rounds(plan, submit=lambda net: post(net, rig.peer),
                                  wait=lambda handle: handle.wait(),
                                  src_buffers=[st.src_pages_view], src_arena=src_arena_view,
                                  dst_arena=dst_arena_view, dst_buffers=[st.dst_pages_view]))

    return rounds


class Refusals:
    """The host engine's refused calls while sampling (the check run raises instead)."""

    def __init__(self) -> None:
        self.armed = False
        self.codes: list[int] = []


host_refusals = Refusals()


class HostRefused(RuntimeError):
    def __init__(self, rc: int) -> None:
        super().__init__(f"the host engine's call returned {rc}")
        self.rc = rc


# ----------------------------------------------------------------------------------------------
# Expected bytes and checks
# ----------------------------------------------------------------------------------------------


def apply_blocks(src: np.ndarray, src_base: int, dst: np.ndarray, dst_base: int,
                 blocks: Iterator[tuple[int, int, int]]) -> int:
    n = 0
    for s, d, ln in blocks:
        s, d = s - src_base, d - dst_base
        dst[d:d + ln] = src[s:s + ln]
        n += 1
    return n


def expected_pages(rig: Rig, st: Setup, host_calls: list[Any]) -> tuple[np.ndarray, str]:
    """The decode pages as they must be after the request: SGLang's descriptors applied with
    numpy where SGLang sent it, else kvplan's direct plan's."""
    want = np.zeros(st.built.dst_span, np.uint8)
    s0, d0 = rig.src.ctypes.data, rig.dst.ctypes.data
    if host_calls:
        for src, dst, ln in host_calls:
            apply_blocks(rig.src, s0, want, d0, zip(src, dst, ln))
        return want, "SGLang's descriptors"
    b = st.built
    plan = b.template.plan(b.src_pages, b.dst_pages, **plan_kwargs(b))
    apply_blocks(rig.src, s0, want, d0, zip(*(c.tolist() for c in
                                              (plan.src_addrs, plan.dst_addrs, plan.lengths))))
    return want, "kvplan's direct plan"


@dataclasses.dataclass
class Row:
    engine: str
    case: str
    label: str
    host_label: str
    request_bytes: int
    descriptors: dict[str, int]
    times: dict[str, list[float]]  # seconds per sample
    notes: dict[str, str]
    bytes_ok: dict[str, bool]
    expected_from: str
    steps: dict[str, float]  # median seconds of the staged path's steps
    rounds: int | None = None
    arena_bytes: int = ROUND_ARENA
    round_steps: dict[str, float] = dataclasses.field(default_factory=dict)

    def median(self, path: str) -> float | None:
        t = self.times.get(path)
        return statistics.median(t) if t else None

    def fraction(self, path: str, how: Callable[[list[float]], float]) -> float | None:
        c, t = self.times.get("ceiling"), self.times.get(path)
        return how(c) / how(t) if c and t else None

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["median_s"] = {p: self.median(p) for p in self.times}
        d["fraction_median"] = {p: self.fraction(p, statistics.median) for p in self.times}
        d["fraction_min"] = {p: self.fraction(p, min) for p in self.times}
        return d


def run_case(engine: str, case: Case, sg: Any, repeats: int, arena: int = ROUND_ARENA) -> Row:
    probe = case.build(None, 1 << 40, 1 << 44)
    kw = plan_kwargs(probe)
    probe_plan = probe.template.plan(probe.src_pages, probe.dst_pages, **kw)
    request_bytes = int(probe_plan.total_bytes)
    del probe_plan
    src_bytes, dst_bytes = arena_sizes(probe, request_bytes, arena)
    rig = Rig(engine, src_bytes, dst_bytes, sg)
    try:
        built = case.build(sg, rig.src.ctypes.data, rig.dst.ctypes.data)
        st = place(rig, built, request_bytes, arena)
        steps: list[dict[str, float]] = []
        reports: list[Any] = []
        fns, notes = paths(rig, st, steps, reports)
        ok: dict[str, bool] = {}
        descriptors = {"ceiling": 1}
        host_calls: list[Any] = []
        # the host runs first, recording its lists, so the expected bytes can come from them
        if "host" in fns:
            rig.host.record, rig.host.calls = True, []
            rig.dst[:] = 0
            try:
                fns["host"]()
            except HostRefused as exc:
                n = sum(len(c[0]) for c in rig.host.calls)
                notes["host"] = (f"refused: the engine call of {n:,} descriptors returned "
                                 f"{exc.rc}")
                del fns["host"]
                host_calls, rig.host.calls = rig.host.calls, []
                rig.reopen()
                fns, _ = paths(rig, st, steps, reports)
                fns.pop("host", None)
                rig.host.calls = host_calls
            host_calls, rig.host.record = rig.host.calls, False
            rig.host.calls = []
            descriptors["host"] = sum(len(c[0]) for c in host_calls)
        want, expected_from = expected_pages(rig, st, host_calls if "host" in fns else [])
        if "host" in fns:
            ok["host"] = bool(np.array_equal(st.dst_pages_view, want))
        descriptors["direct"] = b_direct = len(built.template.plan(
            built.src_pages, built.dst_pages, **kw))
        del b_direct
        sp = built.template.plan_staged(built.src_pages, built.dst_pages,
                                        src_staging=st.src_staging, dst_staging=st.dst_staging,
                                        **kw)
        descriptors["staged"] = sp.network.n_blocks
        descriptors["staged_gather"] = sp.gather.n_blocks
        descriptors["staged_scatter"] = sp.scatter.n_blocks
        del sp
        n_rounds = None
        for path in ("ceiling", "direct", "staged", "rounds"):
            if path not in fns:
                continue
            rig.dst[:] = 0
            fns[path]()
            if path == "ceiling":
                n = st.request_bytes
                ok[path] = bool(np.array_equal(st.dst_staging_view[:n], rig.src[:n]))
            else:
                ok[path] = bool(np.array_equal(st.dst_pages_view, want))
        if "rounds" in fns:
            rp = built.template.plan_rounds(built.src_pages, built.dst_pages,
                                            src_arena=st.src_arena, dst_arena=st.dst_arena,
                                            buffers=ROUND_BUFFERS, **kw)
            n_rounds = len(rp)
            descriptors["rounds"] = rp.n_network_blocks
            del rp
        del want
        steps.clear()
        reports.clear()
        nothing = lambda: None  # noqa: E731
        host_refusals.armed, host_refusals.codes = True, []
        try:
            samples = alternating({k: (f, nothing, nothing) for k, f in fns.items()}, repeats)
        finally:
            host_refusals.armed = False
        times = {k: [v / 1e9 for v in vs] for k, vs in samples.items()}
        if host_refusals.codes:  # a refused call moved nothing: its time is not a transfer's
            times.pop("host", None)
            notes["host"] = (f"refused in {len(host_refusals.codes)} of {repeats} timed calls "
                             f"(returned {sorted(set(host_refusals.codes))}; "
                             f"{descriptors.get('host', 0):,} descriptors in one call)")
        step_med = ({k: statistics.median(s[k] for s in steps) for k in steps[0]} if steps
                    else {})
        round_steps = {}
        if reports:  # the rounds' steps summed per request (they overlap), medians
            round_steps = {
                "elapsed": statistics.median(r.elapsed_s for r in reports),
                "serial": statistics.median(r.serial_s for r in reports),
                **{k: statistics.median(sum(getattr(t, f"{k}_s") for t in r.rounds)
                                        for r in reports)
                   for k in ("gather", "network", "scatter")}}
        return Row(engine, case.name, case.label, built.host_label, request_bytes, descriptors,
                   times, notes, ok, expected_from, step_med, n_rounds, arena, round_steps)
    finally:
        rig.close()


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def cell(row: Row, path: str) -> str:
    if path not in row.times:
        return row.notes.get(path, "n/a")
    med, fm, fmin = row.median(path), row.fraction(path, statistics.median), row.fraction(
        path, min)
    assert med is not None and fm is not None and fmin is not None
    check = "" if row.bytes_ok.get(path) else " **bytes differ**"
    return f"{med * 1e3:,.1f} ms: **{fm:.2f}** ({fmin:.2f}){check}"


def table(rows: list[Row]) -> list[str]:
    arenas = sorted({r.arena_bytes for r in rows})
    arena = " / ".join(f"{a / 2**20:g} MiB" for a in arenas)
    out = ["| engine | request | MiB | ceiling (GB/s) | host path | kvplan direct | "
           f"kvplan staged | kvplan rounds ({arena} arena) | descriptors: host / direct / "
           "staged network / rounds network |",
           "| --- | --- | ---: | ---: | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r.median("ceiling")
        assert c is not None
        d = r.descriptors
        counts = " / ".join(f"{d[k]:,}" if k in d else "–" for k in ("host", "direct", "staged",
                                                                     "rounds"))
        if r.rounds is not None:
            counts += f" ({r.rounds} rounds)"
        out.append(f"| {r.engine} | {r.label}; host: {r.host_label} | "
                   f"{r.request_bytes / 2**20:,.1f} | {r.request_bytes / c / 1e9:.2f} | "
                   + " | ".join(cell(r, p) for p in ("host", "direct", "staged", "rounds"))
                   + f" | {counts} |")
    return out


def _ms(*seconds: float) -> str:
    """Table cells of times in milliseconds."""
    return " | ".join(f"{t * 1e3:.1f}" for t in seconds)


def _with_steps(rows: list[Row], steps: Callable[[Row], dict[str, float]]
                ) -> Iterator[tuple[Row, dict[str, float], float]]:
    """The rows whose path recorded ``steps``, each with those steps and its ceiling's
    median (s)."""
    for r in rows:
        s = steps(r)
        if not s:
            continue
        c = r.median("ceiling")
        assert c is not None
        yield r, s, c


def steps_table(rows: list[Row]) -> list[str]:
    out = ["| engine | request | gather / scatter blocks | plan (ms) | gather (ms) | "
           "network (ms) | scatter (ms) | gather GB/s | scatter GB/s | ceiling (ms) |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r, s, c in _with_steps(rows, lambda r: r.steps):
        gb = r.request_bytes / 1e9
        out.append(f"| {r.engine} | {r.case} | {r.descriptors['staged_gather']:,} / "
                   f"{r.descriptors['staged_scatter']:,} | "
                   f"{_ms(s['plan'], s['gather'], s['network'], s['scatter'])} | "
                   f"{gb / s['gather']:.2f} | {gb / s['scatter']:.2f} | {_ms(c)} |")
    return out


def rounds_table(rows: list[Row]) -> list[str]:
    out = ["| engine | request | rounds | network blocks | elapsed (ms) | steps one after "
           "another (ms) | gather (ms) | network (ms) | scatter (ms) | ceiling (ms) |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r, s, c in _with_steps(rows, lambda r: r.round_steps):
        out.append(f"| {r.engine} | {r.case} | {r.rounds} | {r.descriptors['rounds']:,} | "
                   f"{_ms(s['elapsed'], s['serial'], s['gather'], s['network'], s['scatter'], c)}"
                   " |")
    return out


def engines_available(names: list[str]) -> tuple[list[str], list[str]]:
    have, missing = [], []
    for name in names:
        mod = {"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}.get(name)
        if mod is None:
            raise SystemExit(f"unknown engine {name!r}; choose from mooncake, nixl")
        try:
            __import__(mod)
            have.append(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    return have, missing


def load_host() -> tuple[Any, str]:
    try:
        from support import sglang_loader

        return sglang_loader.load_sglang(), ""
    except Exception as exc:  # no wheel cached and no network: the host column says so
        return None, f"SGLang 0.5.23 not loadable here ({exc!r})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the two tiny cases, one repeat, no results file (a smoke run)")
    ap.add_argument("--cases", default=None, help="comma-separated case names (see --list)")
    ap.add_argument("--engines", default="mooncake,nixl")
    ap.add_argument("--repeats", type=int, default=None, help="samples per path (default 3; "
                    "1 with --quick)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/"
                    "wire-ceiling.md for a full run, none with --quick)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--arena-kib", type=int, default=None,
                    help=f"each side's round arena (default {ROUND_ARENA >> 10} KiB; "
                    f"{QUICK_ARENA >> 10} KiB with --quick)")
    ap.add_argument("--mooncake-queue", type=int, default=MOONCAKE_QUEUE,
                    help=f"{MOONCAKE_QUEUE_ENV} for the Mooncake engines (default "
                    f"{MOONCAKE_QUEUE}; 0: the engine's default)")
    args = ap.parse_args(argv)
    if args.mooncake_queue:
        os.environ[MOONCAKE_QUEUE_ENV] = str(args.mooncake_queue)
    every = CASES + QUICK
    if args.list:
        for c in every:
            print(f"{c.name}: {c.label}")
        return 0
    by_name = {c.name: c for c in every}
    if args.cases:
        unknown = [n for n in args.cases.split(",") if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(by_name)}")
        cases = [by_name[n] for n in args.cases.split(",")]
    else:
        cases = QUICK if args.quick else CASES
    repeats = args.repeats or (1 if args.quick else 3)
    arena = args.arena_kib << 10 if args.arena_kib else (QUICK_ARENA if args.quick else
                                                         ROUND_ARENA)
    engines, missing = engines_available(args.engines.split(","))
    for m in missing:
        print(f"skipped engine: {m}", flush=True)
    sg, sg_note = load_host()
    if sg_note:
        print(sg_note, flush=True)
    load0 = os.getloadavg()[0]
    t_start = time.time()
    rows: list[Row] = []
    errors: list[str] = []

    def dump() -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"repeats": repeats, "engines": engines, "missing_engines": missing,
                           "host_note": sg_note, "errors": errors,
                           "rows": [r.as_json() for r in rows]}, f, indent=1)

    for case in cases:
        for engine in engines:
            try:
                row = run_case(engine, case, sg, repeats, arena)
            except Exception as exc:  # one case failing leaves the others' rows standing
                errors.append(f"{engine} {case.name}: {type(exc).__name__}: {exc}")
                print(f"FAILED {errors[-1]}", flush=True)
                continue
            rows.append(row)
            print(table([row])[-1], flush=True)
            dump()
    elapsed = time.time() - t_start
    lines = table(rows)
    print("\n".join(lines))
    print("\n".join(steps_table(rows)))
    print("\n".join(rounds_table(rows)))
    dump()
    out = args.out or (None if args.quick else os.path.join(RESULTS_DIR, "wire-ceiling.md"))
    if out:
        cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv or sys.argv[1:]))
        doc = report(rows, cmd, load0, elapsed, repeats, missing + errors, sg_note)
        path = write_lines(os.path.dirname(out), os.path.basename(out), doc)
        print(f"wrote {path}")
    return 1 if errors else 0


METHOD = [
    "- **ceiling**: the request's bytes as ONE descriptor (`Transport.submit` of one block, "
    "from the prefill's pages region into the decode's staging region) on the same engine and "
    "transport.",
    "- **host path**: the host engine's own descriptor generation and hand-off, named per row: "
    "SGLang 0.5.23's real `MooncakeKVManager` methods from the wheel (`tests/support/"
    "sglang_loader.py`), planning included. On Mooncake their engine is SGLang's own "
    "`MooncakeTransferEngine` wrapper around the real engine (`batch_transfer_sync_write`, one "
    "call per `_transfer_data`); on NIXL the same lists go out as one `initialize_xfer` "
    "transfer (SGLang's descriptors on NIXL, not SGLang's NIXL connector). `refused` = the "
    "engine returned non-zero for that one call.",
    "- **kvplan direct**: `Template.plan` + `Transport.submit` (kvplan's bounded batches, 1,024 "
    "blocks per Mooncake call).",
    "- **kvplan staged**: `Template.plan_staged` + `kvplan.copy_local` gather + `submit` of "
    "the network plan + `kvplan.copy_local` scatter, one after another (staging regions as "
    "large as the request).",
    "- **kvplan rounds**: `Template.plan_rounds` through one arena per side (two round "
    "buffers) run by `kvplan.exec.pipeline.run_rounds` (network plans through "
    "`submit_async`, waited on by the pipeline; copies by `copy_local`).",
    "- Planning is paid per request by every path, so it is inside each path's time; engines, "
    "registration, templates and the host's manager objects are built once per case, outside. "
    "Both ends in one process, host memory.",
    f"- Mooncake TCP: `{MOONCAKE_QUEUE_ENV}` raised to {MOONCAKE_QUEUE:,} for every path (the "
    "default 1,024 per lane refuses a one-call batch of ~4K descriptors); one call of 100,000 "
    "or more is still refused.",
    "- Byte checks (outside timing): every path runs once into a zeroed decode arena first; its "
    "decode pages must equal SGLang's descriptors applied with numpy (kvplan's direct plan "
    "where SGLang has no path), and the ceiling's destination the source bytes it moved.",
    "- The 32K-token MLA cases keep 8 of the 61 layers (61 x 32K tokens is 2.3 GB a side "
    "before staging and the checks' copies; the run stays under 8 GiB). The TP 8 -> 2 case is "
    "the request of prefill rank 0 to decode rank 0 (one of its four writers).",
]


def report(rows: list[Row], cmd: str, load0: float, elapsed: float, repeats: int,
           missing: list[str], sg_note: str) -> list[str]:
    lines = ["# The wire ceiling: what fraction of it each transfer path reaches, per request",
             "", f"Command: `.venv/bin/{cmd}` ({elapsed:.0f} s)", ""]
    lines += describe(load0, kvplan.__version__) + [""]
    lines += ["## What is measured", ""] + METHOD + [""]
    lines += [f"Each cell: median per request, then **median fraction of the ceiling** "
              f"(ceiling median / path median) and (min / min), over {repeats} interleaved "
              "samples after an untimed checked run. The ceiling column is the request's "
              "bytes / the one-descriptor median.", ""]
    if missing:
        lines += [f"Not run: {'; '.join(missing)}.", ""]
    if sg_note:
        lines += [sg_note, ""]
    lines += table(rows) + [""]
    lines += ["## The staged path's steps (medians)", ""] + steps_table(rows) + [""]
    lines += ["## The rounds path's steps (medians of each step's time summed over the "
              "request's rounds; they overlap, so elapsed is below their sum)", ""]
    lines += rounds_table(rows) + [""]
    lines += ["## Byte checks", ""]
    for r in rows:
        bad = [p for p, v in r.bytes_ok.items() if not v]
        lines.append(f"- {r.engine} {r.case}: expected bytes from {r.expected_from}; "
                     + (f"**differ: {bad}**" if bad else
                        f"equal for {', '.join(sorted(r.bytes_ok))}"))
    return lines + [""]


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
