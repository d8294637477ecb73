"""Peer processes: one spawned process per :class:`~kvplan.testing.PeerSpec`, each owning a
transfer engine (Mooncake or NIXL, chosen per process), registering its arena and serving
commands over a pipe.

The parent never touches an engine itself, so an engine crash costs a child, not the caller.
Start-up answers with what a real worker publishes in its bootstrap handshake: the engine's
session id, the peer's layout in kvplan's wire format (``Layout.to_bytes``) and, for NIXL, the
agent metadata other peers load with :meth:`PeerProcess.connect`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvplan.testing.memory import Arena
from kvplan.testing.specs import PeerSpec, build_layout

__all__ = ["ENGINE_ENV", "ENGINES", "PeerFailure", "PeerProcess"]

#: Environment for engine processes: fail a hung peer in ~5 s, keep the engine's log quiet.
ENGINE_ENV = {"MC_TRANSFER_TIMEOUT": "5", "MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "ERROR"}

#: Engines a peer process can own.
ENGINES = ("mooncake", "nixl")


def _make_transport(engine: str, name: str) -> Any:
    if engine == "mooncake":
        from kvplan.engines import MooncakeTransport

        return MooncakeTransport("127.0.0.1")
    if engine == "nixl":
        from kvplan.engines.nixl import NixlTransport

        return NixlTransport(f"kvplan-{name}-{os.getpid()}")
    raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")


class PeerFailure(RuntimeError):
    """A peer process died, timed out, or raised something other than a TransferError."""


@dataclass
class _PeerState:
    """What a peer process holds between commands."""

    transport: Any
    spec: PeerSpec
    arena: Arena
    engine: str = "mooncake"
    layout: Any = None  # kvplan.Layout of this peer (None for "raw" specs)
    templates: dict[bytes, Any] = field(default_factory=dict)  # per decode layout (wire bytes)
    prepped: dict[tuple[bytes, str], Any] = field(default_factory=dict)  # NIXL PreppedPair
    #: Templates of staged transfers, per (prefill layout, decode layout) wire bytes.
    staged_templates: dict[tuple[bytes, bytes], Any] = field(default_factory=dict)

    @property
    def staging(self) -> tuple[int, int] | None:
        """``(addr, size)`` of this peer's staging region, None without one."""
        if not self.spec.staging:
            return None
        return self.arena.base + self.spec.staging_offset, self.spec.staging

    def staging_view(self) -> np.ndarray:
        """The staging region's bytes (a view of the arena)."""
        at = self.spec.staging_offset
        return self.arena.array[at:at + self.spec.staging]

    def buffers_view(self) -> np.ndarray:
        """The arena's bytes before the staging region (every buffer of the layout)."""
        return self.arena.array[:self.spec.buffers_end]


def _peer_main(conn: Any, spec_dict: dict[str, Any], arena_path: str, size: int,
               env: dict[str, str], log_path: str | None = None, engine: str = "mooncake"
               ) -> None:
    """Entry point of a spawned peer: own an engine, register the arena, serve commands.

    Start-up answers with the handshake a real worker would publish: its session id and its
    layout in kvplan's wire format (``Layout.to_bytes``).
    """
    os.environ.update(env)
    if log_path is not None:  # the engine's glog writes to fd 2; keep the demo's output clean
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        spec = PeerSpec.from_dict(spec_dict)
        arena = Arena(arena_path, size, create=False)
        state = _PeerState(_make_transport(engine, spec.name), spec, arena, engine)
        if spec.style == "raw":  # plain buffers, no kvplan layout (engine fault tests)
            state.transport.register_buffers([arena.base + e.offset for e in spec.entries],
                                             [e.nbytes for e in spec.entries])
            wire = None
        else:
            state.layout = build_layout(spec, arena.base)
            state.transport.register(state.layout)
            wire = state.layout.to_bytes()
        if state.staging is not None:  # staged transfers read or write it through the engine
            state.transport.register_buffers([state.staging[0]], [state.staging[1]])
        # NIXL: the metadata describes the registered memory, so it is taken after register.
        metadata = state.transport.metadata() if engine == "nixl" else None
        conn.send(("ok", {"session": state.transport.local_session_id(), "base": arena.base,
                          "regions": state.transport.registered_regions, "layout": wire,
                          "metadata": metadata, "staging": state.staging}))
    except BaseException as exc:  # report start-up failures instead of dying silently
        conn.send(("fail", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # parent went away
            break
        cmd, args = msg[0], msg[1:]
        if cmd == "stop":
            break
        try:
            result = _COMMANDS[cmd](state, *args)
            conn.send(("ok", result))
        except BaseException as exc:
            from kvplan.engines import TransferError

            from kvplan.integrity import IntegrityError

            if isinstance(exc, IntegrityError):
                fields = {k: getattr(exc, k, None)
                          for k in ("what", "template", "pair", "layer", "role", "bad_pairs")}
                conn.send(("integrity_error", str(exc), fields))
            elif isinstance(exc, TransferError):
                fields = {k: getattr(exc, k, None)
                          for k in ("engine", "session", "batch", "blocks", "bytes", "status",
                                    "agent", "state")}
                conn.send(("transfer_error", str(exc), fields))
            else:
                conn.send(("fail", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    state.transport.close()
    conn.send(("ok", "stopped"))


def _submit_kw(state: _PeerState, notif: bytes) -> dict[str, Any]:
    return {"notif": notif} if state.engine == "nixl" else {}


def _cmd_transfer(state: _PeerState, dst_layout_wire: bytes, dst_session: str,
                  src_pages: np.ndarray, dst_pages: np.ndarray, src_slot: int | None,
                  dst_slot: int | None, max_blocks: int | None, notif: bytes = b"",
                  n_tokens: int | None = None, digest: bool = False) -> dict[str, Any]:
    """Plan this peer's part of one request with kvplan and write it to the decode peer.

    ``n_tokens`` (or page sizes that differ between the peers) makes it a token plan: the page
    arrays are each side's pages in token order (see ``Template.plan``).

    The decode layout arrives as wire bytes (what the bootstrap handshake carries); the
    template is built once per decode layout and reused, as a serving worker would. With
    NIXL, ``notif`` goes with the last plan, so the decode sees it after every byte landed.

    ``digest=True``: the transport digests what it sends (``Transport.manifest`` per plan)
    and the last submit carries the manifests (``manifest=``): NIXL sends them with the
    completion notification (carrying ``notif``); either way the packed notification is
    returned as ``manifest`` for a caller's own side channel (Mooncake).
    """
    import kvplan

    t0 = time.perf_counter()
    template = state.templates.get(dst_layout_wire)
    if template is None:
        dst_layout = kvplan.Layout.from_bytes(dst_layout_wire)
        template = state.templates[dst_layout_wire] = kvplan.Template(state.layout, dst_layout)
    t1 = time.perf_counter()
    plan = template.plan(np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64),
                         n_tokens=n_tokens)
    plans = [plan]
    if src_slot is not None and dst_slot is not None and len(template.state_pairs):
        plans.append(template.plan_state(src_slot, dst_slot))
    t2 = time.perf_counter()
    out: dict[str, Any] = {"template_s": t1 - t0, "plan_s": t2 - t1,
                           "pairs": int(len(template.pairs)),
                           "groups": int(template.n_groups),
                           "state_pairs": int(len(template.state_pairs)),
                           "runs": int(plan.n_runs), "blocks": 0, "bytes": 0, "batches": 0,
                           "transfer_s": 0.0}
    manifests = None
    if digest:
        pages = (np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64))
        sides: list[tuple[Any, Any]] = [pages, (src_slot, dst_slot)]
        manifests = [state.transport.manifest(p, src_pages=sp, dst_pages=dp)
                     for p, (sp, dp) in zip(plans, sides)]
    for k, p in enumerate(plans):
        last = k == len(plans) - 1
        kw = _submit_kw(state, notif) if last else {}
        stats = state.transport.submit(p, dst_session, max_blocks, **kw,
                                       manifest=manifests if last else None)
        if stats.integrity:
            out["manifest"] = stats.integrity
        out["blocks"] += stats.blocks
        out["bytes"] += stats.bytes
        out["batches"] += stats.batches
        out["transfer_s"] += stats.seconds
    return out


def _cmd_transfer_prepped(state: _PeerState, dst_layout_wire: bytes, dst_session: str,
                          src_pages: np.ndarray, dst_pages: np.ndarray, src_slot: int | None,
                          dst_slot: int | None, notif: bytes = b"") -> dict[str, Any]:
    """NIXL only: the same request as ``transfer`` through the prepped path, one descriptor
    per page per entry pair (vLLM's form); the descriptor lists are prepared once per decode
    layout and peer."""
    import kvplan

    if state.engine != "nixl":
        raise ValueError("transfer_prepped needs a NIXL peer")
    t0 = time.perf_counter()
    key = (dst_layout_wire, dst_session)
    prepped = state.prepped.get(key)
    if prepped is None:
        dst_layout = kvplan.Layout.from_bytes(dst_layout_wire)
        prepped = state.prepped[key] = state.transport.prep(state.layout, dst_layout,
                                                            dst_session)
    t1 = time.perf_counter()
    local, remote = prepped.indices(src_pages, dst_pages)
    parts = [(local, remote)]
    if src_slot is not None and dst_slot is not None and len(prepped.template.state_pairs):
        parts.append(prepped.state_indices(src_slot, dst_slot))
    t2 = time.perf_counter()
    out: dict[str, Any] = {"prep_s": t1 - t0, "indices_s": t2 - t1, "blocks": 0, "bytes": 0,
                           "batches": 0, "transfer_s": 0.0,
                           "table_rows": prepped.n_local + prepped.n_remote}
    for k, (li, ri) in enumerate(parts):
        stats = prepped.submit(li, ri, notif=notif if k == len(parts) - 1 else b"")
        out["blocks"] += stats.blocks
        out["bytes"] += stats.bytes
        out["batches"] += stats.batches
        out["transfer_s"] += stats.seconds
    return out


def _staged_plan(state: _PeerState, src_layout_wire: bytes, dst_layout_wire: bytes,
                 src_pages: np.ndarray, dst_pages: np.ndarray, n_tokens: int | None,
                 src_staging: tuple[int, int], dst_staging: tuple[int, int]) -> Any:
    """The staged plan of one request: the template of the two layouts (built once per pair),
    planned from the request and both staging regions. Prefill and decode each compute it
    from the same inputs, so both hold the same plan."""
    import kvplan

    key = (src_layout_wire, dst_layout_wire)
    template = state.staged_templates.get(key)
    if template is None:
        template = state.staged_templates[key] = kvplan.Template(
            kvplan.Layout.from_bytes(src_layout_wire), kvplan.Layout.from_bytes(dst_layout_wire))
    return template.plan_staged(np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64),
                                src_staging=(int(src_staging[0]), int(src_staging[1])),
                                dst_staging=(int(dst_staging[0]), int(dst_staging[1])),
                                n_tokens=n_tokens)


def _cmd_transfer_staged(state: _PeerState, dst_layout_wire: bytes, dst_session: str,
                         dst_staging: tuple[int, int], src_pages: np.ndarray,
                         dst_pages: np.ndarray, n_tokens: int | None = None,
                         notif: bytes = b"") -> dict[str, Any]:
    """Prefill side of a staged transfer: plan it, gather this peer's bytes into its staging
    region with ``kvplan.copy_local``, write the network plan into the decode's staging region
    (``dst_staging``, the decode's ``(addr, size)``). With NIXL, ``notif`` goes with the
    network plan, so the decode knows when to scatter."""
    import kvplan

    if state.staging is None or state.layout is None:
        raise ValueError(f"{state.spec.name} has no staging region (PeerSpec.staging)")
    t0 = time.perf_counter()
    staged = _staged_plan(state, state.layout.to_bytes(), dst_layout_wire, src_pages, dst_pages,
                          n_tokens, state.staging, dst_staging)
    t1 = time.perf_counter()
    kvplan.copy_local(staged.gather, [state.buffers_view()], [state.staging_view()])
    t2 = time.perf_counter()
    stats = state.transport.submit(staged.network, dst_session, **_submit_kw(state, notif))
    t3 = time.perf_counter()
    return {"plan_s": t1 - t0, "gather_s": t2 - t1, "network_s": t3 - t2,
            "direct_blocks": int(staged.direct_blocks), "gather_blocks": int(staged.gather.n_blocks),
            "blocks": stats.blocks, "bytes": stats.bytes, "writer": tuple(staged.writer),
            "dst_staging_range": tuple(staged.dst_staging_range)}


def _cmd_scatter_staged(state: _PeerState, src_layout_wire: bytes, src_staging: tuple[int, int],
                        src_pages: np.ndarray, dst_pages: np.ndarray, n_tokens: int | None = None,
                        peer: str | None = None, message: bytes = b"",
                        timeout: float = 30.0) -> dict[str, Any]:
    """Decode side of a staged transfer from one prefill writer: plan the same staged plan
    (the writer's layout and staging region as published), and once its network plan has
    landed (NIXL: ``message`` from ``peer`` arrived; Mooncake: the writer's submit returned)
    scatter from this peer's staging region into its buffers with ``kvplan.copy_local``."""
    import kvplan

    if state.staging is None or state.layout is None:
        raise ValueError(f"{state.spec.name} has no staging region (PeerSpec.staging)")
    if peer is not None:
        state.transport.wait_notification(peer, message, timeout)
    t0 = time.perf_counter()
    staged = _staged_plan(state, src_layout_wire, state.layout.to_bytes(), src_pages, dst_pages,
                          n_tokens, src_staging, state.staging)
    t1 = time.perf_counter()
    kvplan.copy_local(staged.scatter, [state.staging_view()], [state.buffers_view()])
    t2 = time.perf_counter()
    return {"plan_s": t1 - t0, "scatter_s": t2 - t1,
            "scatter_blocks": int(staged.scatter.n_blocks), "writer": tuple(staged.writer)}


def _raw_plan(state: _PeerState, src: Sequence[int], dst: Sequence[int],
              lengths: Sequence[int]) -> Any:
    from kvplan import BlockSlice

    return BlockSlice(np.asarray(src, np.uint64) + np.uint64(state.arena.base),
                   np.asarray(dst, np.uint64), np.asarray(lengths, np.uint64))


def _cmd_submit_raw(state: _PeerState, dst_session: str, src: Sequence[int],
                    dst: Sequence[int], lengths: Sequence[int], max_blocks: int | None = None,
                    check_sources: bool = True, notif: bytes = b"") -> dict[str, Any]:
    """Write hand-made blocks (fault tests); ``src`` are offsets into this peer's arena."""
    stats = state.transport.submit(_raw_plan(state, src, dst, lengths), dst_session, max_blocks,
                                   check_sources=check_sources, **_submit_kw(state, notif))
    return asdict(stats)


def _cmd_submit_async_raw(state: _PeerState, dst_session: str, src: Sequence[int],
                          dst: Sequence[int], lengths: Sequence[int],
                          max_blocks: int | None = None, notif: bytes = b"") -> dict[str, Any]:
    """Like ``submit_raw`` through the engine's async path (Mooncake batch ids, NIXL
    posted requests): every batch is submitted before the first wait."""
    pending = state.transport.submit_async(_raw_plan(state, src, dst, lengths), dst_session,
                                           max_blocks, **_submit_kw(state, notif))
    return asdict(pending.wait())


def _cmd_check_digest(state: _PeerState, src_layout_wire: bytes, payload: bytes | None,
                      src_pages: np.ndarray, dst_pages: np.ndarray, src_slot: int | None,
                      dst_slot: int | None, peer: str | None = None, timeout: float = 30.0,
                      n_tokens: int | None = None, message: bytes = b"") -> int:
    """Decode side: verify a prefill's integrity manifests against what landed in this
    peer's registered memory (``Transport.check_landed``; IntegrityError when they differ).
    ``payload`` None: wait for the NIXL integrity notification from ``peer`` carrying
    ``message`` (``NixlTransport.wait_manifests``). Returns the number of plans verified."""
    import kvplan

    received = (payload if payload is not None
                else state.transport.wait_manifests(peer, message, timeout))
    mine = state.transport.check_landed(
        received, src_layout=kvplan.Layout.from_bytes(src_layout_wire), dst_layout=state.layout,
        src_pages=np.asarray(src_pages, np.int64), dst_pages=np.asarray(dst_pages, np.int64),
        src_slot=src_slot, dst_slot=dst_slot, n_tokens=n_tokens)
    return len(mine)


def _cmd_probe(state: _PeerState, peer: str) -> int:
    return int(state.transport.probe(peer))


def _cmd_add_peer(state: _PeerState, metadata: bytes | None, device: str = "cpu") -> str | None:
    """Load a peer's NIXL metadata; returns its name (``None`` for engines without metadata)."""
    if state.engine != "nixl" or metadata is None:
        return None
    return str(state.transport.add_peer(metadata, device))


def _cmd_wait_notification(state: _PeerState, peer: str, message: bytes,
                           timeout: float = 30.0) -> bool:
    """Block until NIXL notification ``message`` from ``peer`` arrived (TransferError if not)."""
    state.transport.wait_notification(peer, message, timeout)
    return True


def _cmd_wait_stream(state: _PeerState, peer: str, message: bytes,
                     timeout: float = 30.0) -> dict[str, Any]:
    """The decode's completeness check of ``peer``'s streamed request ``message``
    (``NixlTransport.wait_stream``) as a dict of :class:`StreamCompleteness` fields."""
    got = state.transport.wait_stream(peer, message, timeout)
    return {"state": got.state, "missing": list(got.missing), "arrived": list(got.arrived),
            "detail": got.detail}


def _cmd_check_stream(state: _PeerState, final: bytes | None) -> dict[str, Any]:
    """The decode's completeness check of a final notification that came through the
    caller's side channel (Mooncake): :func:`kvplan.engines.streaming.check_stream`."""
    from kvplan.engines.streaming import check_stream

    got = check_stream(final)
    return {"state": got.state, "missing": list(got.missing), "arrived": list(got.arrived),
            "detail": got.detail}


class _Withholding:
    """A transport that silently drops exactly slice ``k``'s blocks (their source addresses,
    page and state) from whatever submission carries them, and with NIXL takes ``k`` out of
    that submission's slice receipt: a lost slice the engine reports as sent. The other
    slices of the same submission still go, so the decode must name ``k`` alone, however the
    streamer grouped the ready slices into submissions."""

    def __init__(self, inner: Any, k: int, dropped_src: np.ndarray) -> None:
        self._inner, self._k, self._dropped = inner, k, np.unique(dropped_src)
        self.engine_name = inner.engine_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def submit(self, plan: Any, peer: str, max_blocks: int | None = None, **kw: Any) -> Any:
        from kvplan import BlockSlice
        from kvplan.engines import TransferStats
        from kvplan.engines.streaming import read_receipt, slice_receipt

        src = np.asarray(plan.src_addrs)
        keep = ~np.isin(src, self._dropped)
        receipt = read_receipt(kw.get("notif", b""))
        if receipt is not None and self._k in receipt[0]:
            others = [s for s in receipt[0] if s != self._k]
            kw = {**kw, "notif": slice_receipt(others, receipt[1]) if others else b""}
        lost = TransferStats(peer, len(src), int(np.asarray(plan.lengths).sum()), 1, 0.0)
        if not keep.any() and not kw.get("notif"):
            return lost  # nothing of this submission left to send
        if not keep.all():
            plan = BlockSlice(*(np.ascontiguousarray(np.asarray(c)[keep])
                               for c in (plan.src_addrs, plan.dst_addrs, plan.lengths)))
        self._inner.submit(plan, peer, max_blocks, **kw)
        return lost  # the verdict counts the dropped blocks as sent


def _cmd_stream(state: _PeerState, dst_layout_wire: bytes, requests: Sequence[dict[str, Any]],
                group_size: int, order: Sequence[int], layer_ms: float = 0.0,
                min_stream_bytes: int = 0, seal_roles: Sequence[str] = (),
                timeout: float = 30.0, probes: bool = False,
                withhold: int | None = None) -> dict[str, Any]:
    """Stream requests layer group by layer group (``kvplan.engines.streaming``).

    Each request is ``{"name", "session", "src_pages", "dst_pages", "src_slot", "dst_slot"}``
    (``session`` may name a peer that does not exist: that request's slices fail). A "forward"
    thread signals the layers in ``order`` (``layer_ms`` of synthetic compute before each),
    through a device-event stand-in whose ``synchronize`` records the thread it ran on, then
    seals every request. Returns each request's verdict and stats, the signalling times, and
    with ``probes`` what a ready signal for an unknown layer and one after ``close`` raise.
    ``withhold``: slice ``withhold`` of the first request is silently dropped (see
    ``_Withholding``), as if lost on the way; its verdict still says sent.
    """
    import threading

    import kvplan
    from kvplan.engines.streaming import StreamingSubmitter

    dst_layout = kvplan.Layout.from_bytes(dst_layout_wire)
    groups = kvplan.LayerGroups.fixed(group_size, seal_roles=list(seal_roles))
    template = kvplan.Template(state.layout, dst_layout, layer_groups=groups)
    slices = template.layer_slices(groups)
    sync_threads: list[str] = []

    class Event:
        def synchronize(self) -> None:
            sync_threads.append(threading.current_thread().name)

    plans = [template.plan(np.asarray(r["src_pages"], np.int64),
                           np.asarray(r["dst_pages"], np.int64)) for r in requests]
    transport = state.transport
    if withhold is not None:
        first = requests[0]
        dropped = [plans[0].src_addrs[a:b] for a, b in slices.of(plans[0]).ranges[withhold]]
        if first.get("src_slot") is not None and len(template.state_pairs):
            first_state = template.plan_state(first["src_slot"], first["dst_slot"])
            dropped += [first_state.src_addrs[a:b]
                        for a, b in slices.of(first_state).ranges[withhold]]
        transport = _Withholding(transport, withhold, np.concatenate(dropped))
    streamer = StreamingSubmitter(transport, slices, min_stream_bytes=min_stream_bytes,
                                  timeout=timeout)
    opened = []
    for r, plan in zip(requests, plans):
        state_plan = (template.plan_state(r["src_slot"], r["dst_slot"])
                      if r.get("src_slot") is not None and len(template.state_pairs) else None)
        opened.append(streamer.open(r["name"], plan, r["session"], state_plan=state_plan,
                                    notif=r["name"].encode()))
    times: dict[str, float] = {}

    def forward() -> None:
        for layer in order:
            if layer_ms:
                time.sleep(layer_ms / 1000)
            streamer.ready(layer, event=Event())
        times["last_ready"] = time.perf_counter()
        for req in opened:
            req.seal()

    thread = threading.Thread(target=forward, name="forward")
    t0 = time.perf_counter()
    thread.start()
    thread.join()
    times["forward_s"] = time.perf_counter() - t0
    out: dict[str, Any] = {"requests": {}, "slices": slices.n_slices, "times": times}
    for req in opened:
        t_wait = time.perf_counter()
        try:
            st = req.wait(timeout)
            out["requests"][req.request] = {
                "ok": True, "blocks": st.blocks, "bytes": st.bytes, "slices": st.slices,
                "submissions": st.submissions, "streamed": st.streamed,
                "tail_s": st.tail_seconds, "seconds": st.seconds,
                "manifest": req.manifest.to_bytes(), "notification": st.notification}
        except kvplan.TransferError as exc:
            out["requests"][req.request] = {
                "ok": False, "error": str(exc), "slice": getattr(exc, "slice", None),
                "layers": getattr(exc, "layers", None), "state": getattr(exc, "state", None),
                "wait_s": time.perf_counter() - t_wait}
    # Read once every verdict is in: the submitter's thread synchronises the events it
    # dequeues, possibly after the forward has finished.
    out["sync_threads"] = sorted(set(sync_threads))
    if probes:
        try:
            streamer.ready(10_000)
        except kvplan.KvPlanError as exc:
            out["unknown_layer"] = f"{type(exc).__name__}: {exc}"
    streamer.close()
    if probes:
        try:
            streamer.ready(order[0])
        except kvplan.TransferError as exc:
            out["after_close"] = f"{type(exc).__name__}: {exc}"
    out["live_handles"] = int(getattr(state.transport, "live_handles", 0))
    return out


def _cmd_live_handles(state: _PeerState) -> int:
    """Transfer handles the NIXL adapter still holds (0 for other engines)."""
    return int(getattr(state.transport, "live_handles", 0))


def _cmd_handoff(state: _PeerState) -> tuple[str, str]:
    """How this peer's batches reach the engine, and why not natively (Mooncake; else '')."""
    return (str(getattr(state.transport, "handoff", "")),
            str(getattr(state.transport, "handoff_reason", "")))


_COMMANDS: dict[str, Callable[..., Any]] = {
    "handoff": _cmd_handoff,
    "transfer": _cmd_transfer,
    "transfer_prepped": _cmd_transfer_prepped,
    "transfer_staged": _cmd_transfer_staged,
    "scatter_staged": _cmd_scatter_staged,
    "submit_raw": _cmd_submit_raw,
    "submit_async_raw": _cmd_submit_async_raw,
    "check_digest": _cmd_check_digest,
    "probe": _cmd_probe,
    "add_peer": _cmd_add_peer,
    "wait_notification": _cmd_wait_notification,
    "live_handles": _cmd_live_handles,
    "stream": _cmd_stream,
    "wait_stream": _cmd_wait_stream,
    "check_stream": _cmd_check_stream,
}


class PeerProcess:
    """A spawned process running ``_peer_main`` for one :class:`PeerSpec`.

    ``engine`` picks the transfer engine the process owns: ``"mooncake"`` (TCP on 127.0.0.1)
    or ``"nixl"`` (a NIXL agent on UCX). The parent never touches an engine itself, so an
    engine crash costs a child, not the caller.
    """

    def __init__(self, spec: PeerSpec, arena: Arena, *, env: dict[str, str] | None = None,
                 wait: bool = True, start_timeout: float = 60.0, log_path: str | None = None,
                 engine: str = "mooncake") -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
        self.spec = spec
        self.engine = engine
        self.log_path = log_path
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_peer_main, name=f"kvplan-{spec.name}",
            args=(child, spec.to_dict(), arena.path, arena.size, {**ENGINE_ENV, **(env or {})},
                  log_path, engine),
            daemon=True)
        self.process.start()
        child.close()
        self.session = ""
        self.base = 0
        self.regions: list[tuple[int, int]] = []
        self.layout_wire: bytes | None = None
        self.metadata: bytes | None = None  # NIXL agent metadata (None for Mooncake)
        #: ``(addr, size)`` of the peer's staging region in its own address space, or None.
        self.staging: tuple[int, int] | None = None
        self._broken = False
        if wait:
            self.ready(start_timeout)

    def ready(self, timeout: float = 60.0) -> PeerProcess:
        """Wait for start-up (engine initialised, arena registered); returns ``self``."""
        if not self.session:
            info = self._reply(timeout, "start")
            self.session, self.base, self.regions = info["session"], info["base"], info["regions"]
            self.layout_wire = info["layout"]
            self.metadata = info.get("metadata")
            staging = info.get("staging")
            self.staging = (int(staging[0]), int(staging[1])) if staging is not None else None
        return self

    def connect(self, other: PeerProcess, timeout: float = 60.0) -> str:
        """Make ``other`` reachable from this peer; returns the session to submit to.

        NIXL: load ``other``'s agent metadata here (the bytes a bootstrap channel carries).
        Mooncake needs nothing: its session id is enough.
        """
        if self.engine != other.engine:
            raise ValueError(f"{self.spec.name} runs {self.engine}, {other.spec.name} "
                             f"runs {other.engine}")
        if self.engine == "nixl":
            name = self.call("add_peer", other.metadata, "cpu", timeout=timeout)
            assert name == other.session, (name, other.session)
        return other.session

    def _reply(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.05):
            if not self.process.is_alive():
                raise PeerFailure(f"{self.spec.name} died during {what} "
                                  f"(exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                self._broken = True
                raise PeerFailure(f"{self.spec.name} gave no answer to {what} in {timeout:.0f} s")
        try:
            kind, *payload = self._conn.recv()
        except EOFError:
            raise PeerFailure(f"{self.spec.name} closed its pipe during {what}") from None
        if kind == "ok":
            return payload[0]
        if kind == "integrity_error":
            from kvplan.integrity import IntegrityError

            error = IntegrityError(payload[0])
            for key, value in payload[1].items():
                setattr(error, key, value)
            raise error
        if kind == "transfer_error":
            from kvplan.engines import TransferError

            err = TransferError(payload[0])
            for key, value in payload[1].items():
                setattr(err, key, value)
            raise err
        raise PeerFailure(f"{self.spec.name} failed during {what}: {payload[0]}")

    def send(self, cmd: str, *args: Any) -> None:
        """Start command ``cmd`` in the peer without waiting (pair with :meth:`result`)."""
        if self._broken:  # a late answer to a timed-out command would be misread
            raise PeerFailure(f"{self.spec.name} timed out earlier; not reusable")
        try:
            self._conn.send((cmd, *args))
        except (BrokenPipeError, OSError) as exc:
            raise PeerFailure(f"{self.spec.name} is gone ({exc})") from None

    def result(self, timeout: float = 60.0, what: str = "command") -> Any:
        """The answer to the last :meth:`send`; re-raises the peer's TransferError here."""
        return self._reply(timeout, what)

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        """Run command ``cmd`` in the peer and return its result."""
        self.send(cmd, *args)
        return self._reply(timeout, cmd)

    def kill(self) -> None:
        """SIGKILL the peer (a crashed decode worker) and reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the peer to close its engine and exit; kill it if it does not."""
        if self.process.is_alive() and not self._broken:
            try:
                self._conn.send(("stop",))
                self._reply(timeout, "stop")
            except Exception:  # teardown: a late answer or a dead pipe must not mask the test
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self._conn.close()
