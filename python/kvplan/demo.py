"""``kvplan demo``: plan and move a hybrid model's KV cache between processes, check every byte.

Scenario: the Kimi-Linear-style hybrid preset (``kvplan.presets``): full-attention MLA on every
4th layer, per-request state (conv + recurrent) on the other layers. The prefill side runs
pipeline-parallel (two processes by default, each holding and registering only its own layers);
the decode side runs PP=1 in a third process. Destination pages are fragmented, as they are when
they come from a free list. Each prefill process receives the decode layout as wire bytes, plans
with kvplan (pairing by global layer id and role) and writes with the Mooncake Transfer Engine
over TCP on 127.0.0.1, or with NIXL (``--engine nixl``: one NIXL agent per process, UCX on this
host, agent metadata exchanged as bytes, and a completion notification per stage that the
decode process waits for). Afterwards the parent reads the whole decode pool: planned bytes must
equal the source, every other byte must still be the sentinel.

``--layout cross-layer`` gives every process one cross-layer KV pool instead of one buffer per
layer: per page, the items of all its full-attention layers side by side (``Layout.cross_layer``,
vLLM's cross-layer layout); state entries stay per layer. The planner coalesces a stage's layers
into one block per page (per run when a pool page is moved whole on both sides, as at PP=1),
instead of one block per layer per run.

``--verify digest`` has the decode check the request itself, as a serving decode would: each
prefill process digests what it sends (``Transport.manifest``) and hands the manifests to its
last submit; over NIXL they travel in the completion notification, over Mooncake the parent
carries them as the side channel. The decode process re-plans each stage's request from the
stage's layout bytes and verifies what landed in its registered memory
(``Transport.check_landed``). The default, ``--verify bytes``, compares the whole decode pool
with the sources from the parent.

The processes, arenas and the verifier are :mod:`kvplan.testing`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplan.presets import ModelPreset, fragmented_pages, get_preset, split_layers
from kvplan.testing import (
    SENTINEL,
    Arena,
    PeerFailure,
    PeerProcess,
    PeerSpec,
    arena_dir,
    fill_source,
    first_wrong_byte,
    model_peers,
)

__all__ = ["DemoReport", "add_arguments", "demo_model", "run_demo", "run_stream_demo", "stream_regime"]

#: What the report calls each engine's transport.
ENGINE_LABELS = {"mooncake": "Mooncake TCP on 127.0.0.1", "nixl": "NIXL (UCX) on this host"}

#: Fragmentation of the decode pages: a break after a quarter of the pages (runs of ~4 pages).
DEMO_FRAGMENTATION = 0.25
#: Bounds of ``kvplan demo``'s options: far past any model, and small enough that a typo
#: gets a one-line refusal instead of a multi-terabyte arena or an endless fill.
MAX_DEMO_LAYERS = 1024
MAX_DEMO_PAGES = 1 << 22
MAX_DEMO_PP = 64
MAX_DEMO_STATE_SLOTS = 4096
MAX_DEMO_LAYER_MS = 10_000.0
#: Pages per KV buffer of the monolithic demo.
DEFAULT_PAGES = 8192
#: The streaming demo's defaults: a prefill whose compute per layer group (4 x 40 ms) is longer
#: than that group's transfer over Mooncake TCP loopback even on a busy two-core machine, the
#: regime streaming is for (the transfer hides behind the forward; the tail is one group's).
DEFAULT_STREAM_PAGES = 512
DEFAULT_LAYER_MS = 40.0
DEFAULT_STREAM_GROUP = 4

#: ``--layout`` choices: one buffer per full-attention layer, or one cross-layer pool per peer.
LAYOUTS = ("per-layer", "cross-layer")

#: ``--verify`` choices: the parent compares every byte of the decode pool (default), or the
#: decode process checks the prefill stages' integrity digests.
VERIFY = ("bytes", "digest")


@dataclass
class DemoReport:
    model: str
    layers: int
    full_attention_layers: int
    prefill_pp: int
    pages: int
    request_pages: int
    entries_paired: int = 0
    state_entries_paired: int = 0
    runs: int = 0
    blocks: int = 0
    bytes: int = 0
    batches: int = 0
    template_s: float = 0.0
    plan_s: float = 0.0
    transfer_s: float = 0.0
    handshake_bytes: int = 0
    wall_s: float = 0.0
    verified_bytes: int = 0
    error: str | None = None
    engine: str = "mooncake"
    notifications: int = 0
    layout: str = "per-layer"
    groups: int = 0  # emission groups over all stages (coalesced KV pairs)
    verify: str = "bytes"
    digest_stages: int = 0  # stages whose digests the decode verified (--verify digest)
    digest_plans: int = 0  # plans (page and state) verified over those stages
    pool_strides: list[int] = field(default_factory=list)  # decode first, then each stage
    per_peer: list[dict[str, Any]] = field(default_factory=list)

    def _per_run(self) -> bool:
        """Whether KV blocks are one per run (per pair or group), not one per page."""
        kv = self.blocks - self.state_entries_paired
        groups = self.groups if self.layout == "cross-layer" else self.entries_paired
        return kv == groups * self.runs

    def _runs_line(self) -> str:
        text = f"runs:           {self.runs:,} (runs of pages contiguous on both sides"
        if self._per_run():
            return (f"{text}: {self.request_pages / max(self.runs, 1):.1f} pages per block "
                    f"instead of 1)")
        return f"{text}; blocks here are per page, see below)"

    def _blocks_line(self) -> str:
        calls = f"in {self.batches} engine calls"
        if self.layout != "cross-layer":
            return (f"blocks:         {self.blocks:,} = {self.entries_paired} KV pairs x "
                    f"{self.runs:,} runs + {self.state_entries_paired} state, {calls}")
        unit = (f"{self.runs:,} runs (each group is a whole pool page on both sides)"
                if self._per_run()
                else f"{self.request_pages:,} pages (a stage's layers are part of a decode "
                     f"pool page: one block per page)")
        return (f"blocks:         {self.blocks:,} = {self.entries_paired} KV pairs coalesced "
                f"into {self.groups} group(s) x {unit} + {self.state_entries_paired} state, "
                f"{calls}")

    def lines(self) -> list[str]:
        gbps = self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0
        out = [
            f"model:          {self.model}: {self.layers} layers, "
            f"{self.full_attention_layers} full-attention (MLA) + "
            f"{self.layers - self.full_attention_layers} linear (state)",
            f"topology:       prefill PP={self.prefill_pp} ({self.prefill_pp} processes) -> "
            f"decode PP=1, {ENGINE_LABELS[self.engine]}",
            f"handshake:      decode layout {self.handshake_bytes:,} bytes on the wire "
            f"(Layout.to_bytes)",
            f"entries paired: {self.entries_paired} KV + {self.state_entries_paired} state "
            f"(by global layer id and role)",
            f"pages:          {self.request_pages} of {self.pages} per KV buffer, "
            f"fragmented destination",
            self._runs_line(),
            self._blocks_line(),
            f"bytes:          {self.bytes:,} ({self.bytes / 2**20:.1f} MiB, "
            f"{self.bytes / max(self.blocks, 1) / 1024:.1f} KiB per block on average)",
            f"planning time:  {(self.template_s + self.plan_s) * 1e3:.2f} ms "
            f"(template {self.template_s * 1e3:.2f} ms, once per peer pair; "
            f"plan {self.plan_s * 1e3:.2f} ms, per request)",
            f"transfer time:  {self.transfer_s * 1e3:.1f} ms ({gbps:.2f} GB/s)",
        ]
        if self.layout == "cross-layer":
            decode_stride, *stage_strides = self.pool_strides
            out.insert(2, f"layout:         cross-layer pools (KV of every full-attention "
                          f"layer of a page side by side; state per layer): decode page "
                          f"{decode_stride:,} B, prefill stage pages "
                          f"{', '.join(f'{n:,}' for n in stage_strides)} B")
        if self.engine == "nixl":
            out.append(f"notifications:  {self.notifications} of {self.prefill_pp} completion "
                       f"notifications received by the decode agent")
        if self.error is not None:
            out.append(f"VERIFICATION FAILED: {self.error}")
        elif self.verify == "digest":
            out.append(f"verified (digest): {self.digest_stages} of {self.prefill_pp} prefill "
                       f"stages match, checked by the decode process ({self.digest_plans} "
                       f"plans: plan digest and content digest of {self.entries_paired} KV + "
                       f"{self.state_entries_paired} state pairs, {self.bytes:,} bytes)")
        else:
            out.append(f"verified: {self.verified_bytes} bytes OK "
                       f"(whole decode pool: planned bytes match the source, the rest untouched)")
        return out


@dataclass
class _DemoPeers:
    """The arenas and engine processes of one demo run: ``peers[0]`` serves ``decode``, each
    further one a prefill stage's source arena, connected to the decode through ``sessions``."""

    workdir: str
    decode: Arena
    sources: list[Arena]
    peers: list[PeerProcess]
    sessions: list[Any]


@contextlib.contextmanager
def _demo_peers(decode_spec: PeerSpec, prefill_specs: Sequence[PeerSpec], *, seed: int, quiet: bool,
                engine: str, engine_log_in_failure: bool = False) -> Iterator[_DemoPeers]:
    """Create the decode arena (filled with ``SENTINEL``) and each prefill stage's (seeded
    bytes), start one engine process per arena and connect every prefill to the decode; on
    exit stop them and remove the arenas. With ``engine_log_in_failure``, a ``PeerFailure``
    is raised again with the last lines of the engines' log."""
    total = decode_spec.size + sum(s.size for s in prefill_specs)
    workdir = arena_dir(total)
    arenas: list[Arena] = []
    peers: list[PeerProcess] = []
    try:
        decode = Arena(os.path.join(workdir, "decode"), decode_spec.size, create=True)
        arenas.append(decode)
        decode.array[:] = SENTINEL
        sources = []
        for r, spec in enumerate(prefill_specs):
            a = Arena(os.path.join(workdir, spec.name), spec.size, create=True)
            arenas.append(a)
            fill_source(a, seed + 1 + r)
            sources.append(a)
        # Start all engines at once (start-up dominates the wall time), then wait for them.
        log = os.path.join(workdir, "engines.log") if quiet else None
        peers.append(PeerProcess(decode_spec, decode, wait=False, log_path=log, engine=engine))
        peers += [PeerProcess(spec, a, wait=False, log_path=log, engine=engine)
                  for spec, a in zip(prefill_specs, sources)]
        for p in peers:
            p.ready()
        # NIXL: each prefill agent loads the decode agent's metadata (bytes over the pipe).
        sessions = [p.connect(peers[0]) for p in peers[1:]]
        yield _DemoPeers(workdir, decode, sources, peers, sessions)
    except PeerFailure as exc:
        if not engine_log_in_failure:
            raise
        tail = _log_tail(os.path.join(workdir, "engines.log"))
        raise PeerFailure(f"{exc}\n--- engine log (last lines) ---\n{tail}" if tail
                          else str(exc)) from None
    finally:
        for p in peers:
            p.stop()
        for a in arenas:
            a.close()
        shutil.rmtree(workdir, ignore_errors=True)


def demo_model(layers: int = 48) -> ModelPreset:
    """The demo's model: the Kimi-Linear-style preset with ``layers`` layers."""
    return get_preset("kimi-linear", layers)


def run_demo(model: ModelPreset, *, pages: int, prefill_pp: int = 2,
             request_pages: int | None = None, state_slots: int = 2, seed: int = 0,
             max_blocks_per_batch: int | None = None, quiet: bool = True,
             engine: str = "mooncake", layout: str = "per-layer", verify: str = "bytes"
             ) -> DemoReport:
    """Run the hybrid scenario end to end and return the verified report (never raises on a
    wrong byte: the report says which one).

    ``verify``: ``"bytes"`` (the parent compares the whole decode pool with the sources) or
    ``"digest"`` (the decode process checks each stage's integrity manifests, carried in the
    NIXL completion notification or, with Mooncake, by the parent).

    ``layout``: ``"per-layer"`` (one KV buffer per full-attention layer) or ``"cross-layer"``
    (one cross-layer KV pool per process, state per layer), the same on every process.

    ``quiet`` sends the engines' log lines to a file instead of stderr; when a peer fails, the
    end of that log is attached to the :class:`~kvplan.testing.PeerFailure`.
    """
    import kvplan  # noqa: F401  (fail here, clearly, if the extension is not built)

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    if verify not in VERIFY:
        raise ValueError(f"unknown verification {verify!r}; choose from {VERIFY}")
    t_wall = time.perf_counter()
    peers_spec = model_peers(model, pages=pages, pp_size=prefill_pp, state_slots=state_slots,
                             cross_layer=layout == "cross-layer")
    decode_spec, prefill_specs = peers_spec.decode, peers_spec.prefill
    n_req = request_pages if request_pages is not None else pages * 3 // 4
    src_pages = np.arange(n_req, dtype=np.int64) + (pages - n_req) // 2
    dst_pages = fragmented_pages(n_req, DEMO_FRAGMENTATION if n_req <= pages * 3 // 4 else 0.0,
                                 seed=seed, shuffle_runs=True, capacity=pages)
    src_slot, dst_slot = 1 % state_slots, state_slots - 1

    report = DemoReport(model.name, model.num_layers, len(model.kv_layers()), prefill_pp,
                        pages, n_req, engine=engine, layout=layout, verify=verify)
    # A stage may hold no full-attention layer (4 layers at PP=2: the first stage is all
    # state), so it has no page pool: stride 0.
    report.pool_strides = [next((e.stride for e in spec.entries if e.kind == "page"), 0)
                           for spec in (decode_spec, *prefill_specs)]
    with _demo_peers(decode_spec, prefill_specs, seed=seed, quiet=quiet, engine=engine,
                     engine_log_in_failure=True) as run:
        decode, sources, peers, sessions = run.decode, run.sources, run.peers, run.sessions
        dpeer = peers[0]
        report.handshake_bytes = len(dpeer.layout_wire or b"")
        # The prefill stages write concurrently, as real PP stages do: send every request
        # first, then collect the answers.
        for p, session in zip(peers[1:], sessions):
            p.send("transfer", dpeer.layout_wire, session, src_pages, dst_pages,
                   src_slot, dst_slot, max_blocks_per_batch, p.spec.name.encode(), None,
                   verify == "digest")
        manifests = []
        for p in peers[1:]:
            res = p.result(120.0, "transfer")
            manifests.append(res.get("manifest"))
            report.per_peer.append(res)
            report.entries_paired += res["pairs"]
            report.state_entries_paired += res["state_pairs"]
            report.groups += res["groups"]
            report.runs = max(report.runs, res["runs"])  # same pages on every stage
            report.blocks += res["blocks"]
            report.bytes += res["bytes"]
            report.batches += res["batches"]
            report.template_s = max(report.template_s, res["template_s"])
            report.plan_s = max(report.plan_s, res["plan_s"])
            report.transfer_s = max(report.transfer_s, res["transfer_s"])
        if verify == "digest":
            report.error = _check_digests(report, dpeer, peers[1:], manifests, src_pages,
                                          dst_pages, src_slot, dst_slot)
        else:
            if engine == "nixl":  # the decode learns of completion from NIXL, not from us
                for p in peers[1:]:
                    dpeer.call("wait_notification", p.session, p.spec.name.encode(), 60.0)
                    report.notifications += 1
            writes = [(a, s, src_pages, dst_pages, src_slot, dst_slot)
                      for a, s in zip(sources, prefill_specs)]
            report.error = first_wrong_byte(decode, decode_spec, writes)
            if report.error is None:
                report.verified_bytes = decode.size
    report.wall_s = time.perf_counter() - t_wall
    return report


def _check_digests(report: DemoReport, dpeer: PeerProcess, stages: list[PeerProcess],
                   manifests: list[bytes | None], src_pages: np.ndarray, dst_pages: np.ndarray,
                   src_slot: int, dst_slot: int) -> str | None:
    """The decode process verifies every stage's request from that stage's manifests (NIXL:
    the completion notification it received; Mooncake: the bytes the parent carries for it).
    Returns the first failure, naming the stage's template, or None."""
    from kvplan.integrity import IntegrityError

    failures = []
    for p, carried in zip(stages, manifests):
        payload = None if report.engine == "nixl" else carried
        try:
            report.digest_plans += dpeer.call(
                "check_digest", p.layout_wire, payload, src_pages, dst_pages, src_slot,
                dst_slot, p.session, 60.0, None, p.spec.name.encode(), timeout=90.0)
            report.digest_stages += 1
        except IntegrityError as exc:
            failures.append(str(exc))
        if report.engine == "nixl":
            report.notifications += 1
    if not failures:
        return None
    more = f" (and {len(failures) - 1} more stages)" if len(failures) > 1 else ""
    return failures[0] + more


def run_stream_demo(model: ModelPreset, *, pages: int, prefill_pp: int = 2,
                    request_pages: int | None = None, state_slots: int = 2, seed: int = 0,
                    layer_ms: float = DEFAULT_LAYER_MS, group_size: int = DEFAULT_STREAM_GROUP,
                    quiet: bool = True,
                    engine: str = "mooncake") -> list[str]:
    """Layer-wise streaming next to the monolithic send, in one run on the same bytes.

    Each prefill process runs a synthetic forward (``layer_ms`` per layer), signals every
    layer as it finishes and streams groups of ``group_size`` layers
    (:class:`kvplan.engines.StreamingSubmitter`); the decode arena is verified byte for byte.
    The decode is then reset and the same request is sent the monolithic way, after the last
    layer, and verified again. Returns the report lines, one starting ``tail:``.
    """
    from kvplan.presets import split_layers

    peers_spec = model_peers(model, pages=pages, pp_size=prefill_pp, state_slots=state_slots)
    decode_spec, prefill_specs = peers_spec.decode, peers_spec.prefill
    stages = split_layers(model.num_layers, prefill_pp)
    n_req = request_pages if request_pages is not None else pages * 3 // 4
    src_pages = np.arange(n_req, dtype=np.int64) + (pages - n_req) // 2
    dst_pages = fragmented_pages(n_req, DEMO_FRAGMENTATION, seed=seed, shuffle_runs=True,
                                 capacity=pages)
    src_slot, dst_slot = 1 % state_slots, state_slots - 1
    lines: list[str] = []
    with _demo_peers(decode_spec, prefill_specs, seed=seed, quiet=quiet, engine=engine) as run:
        decode, sources, peers, sessions = run.decode, run.sources, run.peers, run.sessions
        dpeer = peers[0]
        writes = [(a, s, src_pages, dst_pages, src_slot, dst_slot)
                  for a, s in zip(sources, prefill_specs)]
        # Streaming: every stage's forward signals its layers; slices leave as groups fill.
        decode.array[:] = SENTINEL
        for p, session, layers in zip(peers[1:], sessions, stages):
            request = {"name": p.spec.name, "session": session, "src_pages": src_pages,
                       "dst_pages": dst_pages, "src_slot": src_slot, "dst_slot": dst_slot}
            p.send("stream", dpeer.layout_wire, [request], group_size, list(layers), layer_ms)
        streamed = [p.result(300.0, "stream") for p in peers[1:]]
        if engine == "nixl":
            for p in peers[1:]:
                dpeer.call("wait_notification", p.session, p.spec.name.encode(), 60.0)
        results = [out["requests"][p.spec.name] for out, p in zip(streamed, peers[1:])]
        failed = [r["error"] for r in results if not r["ok"]]
        stream_error = failed[0] if failed else first_wrong_byte(decode, decode_spec, writes)
        # Monolithic: the same request after the last layer (its tail is its whole transfer).
        decode.array[:] = SENTINEL
        for p, session in zip(peers[1:], sessions):
            p.send("transfer", dpeer.layout_wire, session, src_pages, dst_pages, src_slot,
                   dst_slot, None, p.spec.name.encode())
        mono = [p.result(300.0, "transfer") for p in peers[1:]]
        if engine == "nixl":
            for p in peers[1:]:
                dpeer.call("wait_notification", p.session, p.spec.name.encode(), 60.0)
        mono_error = first_wrong_byte(decode, decode_spec, writes)
    ok = [r for r in results if r["ok"]]
    blocks = sum(r["blocks"] for r in ok)
    nbytes = sum(r["bytes"] for r in ok)
    slices = sum(r["slices"] for r in ok)
    forward = max(out["times"]["forward_s"] for out in streamed)
    tail = max((r["tail_s"] for r in ok), default=float("nan"))
    mono_tail = max(m["plan_s"] + m["transfer_s"] for m in mono)
    lines.append(f"streamed:       {slices} slices of {group_size} layers + seal, {blocks} "
                 f"blocks, {nbytes} bytes; synthetic forward {forward * 1e3:.1f} ms "
                 f"({layer_ms} ms per layer)")
    lines.append(f"verified:       streaming {'every byte' if stream_error is None else 'FAILED: ' + stream_error}; "
                 f"monolithic {'every byte' if mono_error is None else 'FAILED: ' + mono_error}")
    lines.append(f"tail:           streaming {tail * 1e3:.2f} ms vs monolithic "
                 f"{mono_tail * 1e3:.2f} ms (last ready signal -> decode holds every byte; "
                 f"same run, same bytes)")
    lines.append("regime:         " + stream_regime(tail, mono_tail, layer_ms * group_size / 1e3))
    if stream_error is not None or mono_error is not None:
        lines.append("error")
    return lines


def stream_regime(tail_s: float, mono_tail_s: float, group_compute_s: float) -> str:
    """Which regime a streaming run was in, and by how much. When the transfer keeps pace with
    the forward, each group's slice lands while the next group computes, so after the last
    layer only the last group's transfer is left: the streamed tail is at most one group's
    compute. A longer tail means the slices queued behind each other (transfer-bound)."""
    ratio = tail_s / mono_tail_s if mono_tail_s > 0 else float("nan")
    versus = (f"streamed tail {tail_s * 1e3:.1f} ms = {ratio:.2f}x the monolithic "
              f"{mono_tail_s * 1e3:.1f} ms, {max(0.0, 1 - ratio):.0%} of it hidden")
    group = f"one group's compute ({group_compute_s * 1e3:.1f} ms)"
    if tail_s <= group_compute_s:
        return (f"compute hides the transfer: after the last layer only the last group's "
                f"transfer was left, {tail_s / group_compute_s:.2f}x {group}; {versus}")
    return (f"transfer-bound: the tail is {tail_s / group_compute_s:.1f}x {group}, so slices "
            f"queued behind each other; {versus}; raise --layer-ms or lower --pages to see "
            f"compute hide the transfer")


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def add_arguments(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Fill ``kvplan demo``'s sub-parser; returns the function that runs the command."""
    from kvplan._cli_args import float_arg, int_arg, one_line_error

    setattr(parser, "error", one_line_error(parser))  # one line on stderr, exit 2
    parser.add_argument("--layers", type=int_arg(4, MAX_DEMO_LAYERS), default=48,
                        help="model layers; full attention (MLA) on every 4th (default 48, "
                             f"4..{MAX_DEMO_LAYERS})")
    parser.add_argument("--pages", type=int_arg(1, MAX_DEMO_PAGES), default=None,
                        help=f"pages per KV buffer on each side (default {DEFAULT_PAGES}, "
                             f"{DEFAULT_STREAM_PAGES} with --stream; the arenas must also fit "
                             "in half the memory this machine has free)")
    parser.add_argument("--request-pages", type=int_arg(1, MAX_DEMO_PAGES), default=None,
                        help="pages the request moves (default 3/4 of --pages)")
    parser.add_argument("--pp", type=int_arg(1, MAX_DEMO_PP), default=2,
                        help="prefill pipeline stages (default 2)")
    parser.add_argument("--state-slots", type=int_arg(1, MAX_DEMO_STATE_SLOTS), default=2,
                        help="request slots per state buffer (default 2)")
    parser.add_argument("--max-blocks", type=int_arg(1, (1 << 31) - 1), default=None,
                        help="blocks per engine call (default: the engine's bound, 1024 for "
                             "Mooncake, the whole plan for NIXL)")
    parser.add_argument("--seed", type=int_arg(0, (1 << 32) - 1), default=0,
                        help="random seed for data and pages (default 0)")
    parser.add_argument("--engine", choices=sorted(ENGINE_LABELS), default="mooncake",
                        help="transfer engine in every process: mooncake (TCP) or nixl (UCX); "
                             "default mooncake")
    parser.add_argument("--layout", choices=LAYOUTS, default="per-layer",
                        help="KV memory of every process: per-layer (one buffer per "
                             "full-attention layer, default) or cross-layer (one pool per "
                             "process, the items of all its full-attention layers side by "
                             "side in each page, vLLM's cross-layer layout; state buffers stay "
                             "per layer)")
    parser.add_argument("--verify", choices=VERIFY, default="bytes",
                        help="bytes (default): the parent compares the whole decode pool with "
                             "the sources; digest: the decode process checks the integrity "
                             "digests each prefill stage sent with its completion (NIXL "
                             "notification, or the parent as Mooncake's side channel)")
    parser.add_argument("--stream", action="store_true",
                        help="stream layer groups while a synthetic forward runs, then send "
                             "the same request monolithically; prints both transfer tails "
                             "and whether compute hid the transfer")
    parser.add_argument("--layer-ms", type=float_arg(0.0, MAX_DEMO_LAYER_MS), default=None,
                        help="synthetic compute per layer with --stream (default "
                             f"{DEFAULT_LAYER_MS:g} ms)")
    parser.add_argument("--stream-group", type=int_arg(1, MAX_DEMO_LAYERS), default=None,
                        help=f"layers per streamed group with --stream (default "
                             f"{DEFAULT_STREAM_GROUP})")
    return run_cli


def _stages_without_kv(model: ModelPreset, pp: int) -> list[int]:
    """The prefill stages (as ``kvplan.presets.split_layers`` splits) that hold no paged-KV
    layer: a cross-layer pool needs at least one."""
    return [r for r, layers in enumerate(split_layers(model.num_layers, pp))
            if not model.kv_layers(layers)]


def _arena_problem(model: ModelPreset, args: argparse.Namespace) -> str | None:
    """Why the arenas of this run cannot be had, or ``None``: every process's arena is mapped
    by it and by the parent, which also builds the expected decode pool to compare."""
    from kvplan._cli_args import available_memory

    peers = model_peers(model, pages=args.pages, pp_size=args.pp, state_slots=args.state_slots)
    total = peers.decode.size + sum(s.size for s in peers.prefill)
    need = total + 2 * peers.decode.size
    free = available_memory()
    if free is not None and need > free // 2:
        return (f"--pages {args.pages:,} with --layers {args.layers} needs arenas of "
                f"{total / 2**30:,.2f} GiB (about {need / 2**30:,.2f} GiB with the check), more "
                f"than half of the {free / 2**30:,.2f} GiB this machine has free: lower --pages "
                f"or --layers")
    return None


def run_cli(args: argparse.Namespace) -> int:
    """Body of ``kvplan demo``: print the report; exit 1 naming the first wrong byte (or the
    first digest that differs), 2 when the arguments are bad or a peer fails."""
    import importlib.util
    import sys

    module, hint = {
        "mooncake": ("mooncake.engine", "the Mooncake Transfer Engine: pip install "
                     "'kvplan[mooncake]' (plus Debian libibverbs1 libnuma1)"),
        "nixl": ("nixl_cu12._api", "NIXL: pip install --no-deps nixl-cu12 (its torch "
                 "requirement is not needed)"),
    }[args.engine]
    try:
        have_engine = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        have_engine = False
    if not have_engine:
        print(f"kvplan demo --engine {args.engine} needs {hint}, or run scripts/setup-env",
              file=sys.stderr)
        return 2
    if args.pages is None:
        args.pages = DEFAULT_STREAM_PAGES if args.stream else DEFAULT_PAGES
    problems = [msg for bad, msg in [
        (args.pp > args.layers, f"--pp must be at most --layers ({args.layers}), got {args.pp}"),
        (args.request_pages is not None and args.request_pages > args.pages,
         f"--request-pages must be at most --pages ({args.pages}), got {args.request_pages}"),
        (args.stream and (args.stream_group or DEFAULT_STREAM_GROUP) > args.layers,
         f"--stream-group must be at most --layers ({args.layers}), got {args.stream_group}"),
        (args.stream and args.verify == "digest",
         "--stream verifies every byte itself; --verify digest applies to the monolithic demo"),
        (not args.stream and (args.layer_ms is not None or args.stream_group is not None),
         "--layer-ms and --stream-group apply only with --stream"),
    ] if bad]
    model = demo_model(args.layers)
    if not problems and args.layout == "cross-layer":
        bare = _stages_without_kv(model, args.pp)
        problems += [f"--layout cross-layer needs a full-attention layer (every "
                     f"{model.full_attention_every}th) on every prefill stage; with --layers "
                     f"{args.layers} --pp {args.pp} stage(s) {bare} hold none: lower --pp, "
                     f"raise --layers or use --layout per-layer"] if bare else []
    if not problems:
        arena = _arena_problem(model, args)
        problems += [arena] if arena else []
    if problems:
        print("kvplan demo: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.stream:
        return _run_stream_cli(args, model)
    print(f"kvplan demo: {model.num_layers}-layer hybrid model, {args.pages} pages, "
          f"{args.layout} KV, prefill PP={args.pp} -> decode PP=1 over "
          f"{ENGINE_LABELS[args.engine]}"
          f"{', the decode verifying by digest' if args.verify == 'digest' else ''} ...",
          flush=True)
    try:
        report = run_demo(model, pages=args.pages, prefill_pp=args.pp,
                          request_pages=args.request_pages, state_slots=args.state_slots,
                          seed=args.seed, max_blocks_per_batch=args.max_blocks,
                          engine=args.engine, layout=args.layout, verify=args.verify)
    except PeerFailure as exc:
        print(f"kvplan demo: a peer process failed: {exc}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    print(f"wall time:      {report.wall_s:.1f} s ({args.pp + 1} processes, engine start-up "
          f"included)")
    return 0 if report.error is None else 1


def _run_stream_cli(args: argparse.Namespace, model: ModelPreset) -> int:
    """``kvplan demo --stream``: exit 1 when a byte is wrong, 2 when a peer fails."""
    import sys

    args.layer_ms = DEFAULT_LAYER_MS if args.layer_ms is None else args.layer_ms
    args.stream_group = args.stream_group or DEFAULT_STREAM_GROUP
    print(f"kvplan demo --stream: {model.num_layers}-layer hybrid model, {args.pages} pages, "
          f"prefill PP={args.pp} -> decode PP=1 over {ENGINE_LABELS[args.engine]}, "
          f"{args.layer_ms} ms per layer ...", flush=True)
    t0 = time.perf_counter()
    try:
        lines = run_stream_demo(model, pages=args.pages, prefill_pp=args.pp,
                                request_pages=args.request_pages,
                                state_slots=args.state_slots, seed=args.seed,
                                layer_ms=args.layer_ms, group_size=args.stream_group,
                                engine=args.engine)
    except PeerFailure as exc:
        print(f"kvplan demo: a peer process failed: {exc}", file=sys.stderr)
        return 2
    failed = lines[-1] == "error"
    for line in lines[:-1] if failed else lines:
        print(line)
    print(f"wall time:      {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0
