"""``kvplan demo``: plan and move a hybrid model's KV cache between processes, check every byte.

Scenario (the one the seed fix was about): a Kimi-Linear-style hybrid model, full-attention MLA
on every 4th layer, Mamba-style per-request state (conv + temporal) on every other layer. The
prefill side runs pipeline-parallel (PP=2, two processes, each holding and registering only its
own layers); the decode side runs PP=1 in a third process. Destination pages are fragmented, as
they are when they come from a free list. Each prefill process plans with kvplan (pairing by
global layer id and role) and writes with the Mooncake Transfer Engine over TCP on 127.0.0.1.
Afterwards the parent reads the whole decode pool: planned bytes must equal the source, every
other byte must still be the sentinel.

The machinery here (memory arenas shared through ``mmap``, spawned peer processes, a small
request/response protocol over pipes) is reused by the integration tests.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Arena",
    "Entry",
    "HybridModel",
    "MhaModel",
    "PeerProcess",
    "PeerSpec",
    "PeerFailure",
    "build_layout",
    "fragmented_pages",
    "pack_entries",
    "run_demo",
    "main",
]

#: Byte the decode pool is filled with before a transfer; sources never contain it.
SENTINEL = 0xA5

#: Environment for engine processes: fail a hung peer in ~5 s, keep glog quiet.
ENGINE_ENV = {"MC_TRANSFER_TIMEOUT": "5", "MC_LOG_LEVEL": "ERROR"}


# ---------------------------------------------------------------------------------------------
# Memory: one arena per process, shared with the parent through a mmap'ed file
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One buffer of a peer: ``capacity`` items of ``item_len`` bytes at ``offset`` in its arena."""

    layer_id: int
    role: str  # "kv", "k", "v", or a state name such as "mamba_conv"
    kind: str  # "page" or "state"
    offset: int
    item_len: int
    capacity: int

    @property
    def nbytes(self) -> int:
        return self.item_len * self.capacity


@dataclass(frozen=True)
class PeerSpec:
    """A peer's buffers and how to describe them to kvplan.

    ``style`` picks the Layout constructor: ``"hybrid_mla"`` (``Layout.hybrid_linear`` +
    ``with_state``), ``"npu_groups"`` (``Layout.npu_groups`` + ``with_state``; page entries
    group-major) or ``"mha"`` (``Layout.mha``); ``"raw"`` registers the buffers without
    building a layout (engine-level tests).
    """

    name: str
    style: str
    entries: tuple[Entry, ...]
    num_model_layers: int
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def size(self) -> int:
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["entries"] = [asdict(e) for e in self.entries]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerSpec:
        d = dict(d)
        d["entries"] = tuple(Entry(**e) for e in d["entries"])
        return cls(**d)


def pack_entries(entries: Sequence[tuple[int, str, str, int, int]], align: int = 4096
                 ) -> tuple[Entry, ...]:
    """Lay ``(layer, role, kind, item_len, capacity)`` buffers out back to back, page aligned."""
    out, offset = [], 0
    for layer, role, kind, item_len, capacity in entries:
        out.append(Entry(layer, role, kind, offset, item_len, capacity))
        offset += -(-item_len * capacity // align) * align
    return tuple(out)


class Arena:
    """A zero-initialised byte buffer backed by a file that several processes map shared.

    The parent creates it; peers attach by path. Placed in ``/dev/shm`` when that has room,
    else in the temp directory (small ``/dev/shm`` in containers).
    """

    def __init__(self, path: str, size: int, *, create: bool) -> None:
        self.path = path
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(size, 1))
            self._mmap = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=size)

    @property
    def base(self) -> int:
        """Address of byte 0 in this process."""
        return int(self.array.ctypes.data)

    def view(self, entry: Entry) -> np.ndarray:
        """``(capacity, item_len)`` uint8 view of one buffer."""
        flat = self.array[entry.offset: entry.offset + entry.nbytes]
        return flat.reshape(entry.capacity, entry.item_len)

    def close(self) -> None:
        self.array = np.zeros(0, dtype=np.uint8)  # drop the export before closing the map
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive somewhere; the OS unmaps at exit
            pass


def arena_dir(total_bytes: int) -> str:
    """A fresh directory for arenas, in ``/dev/shm`` when it has room for ``total_bytes``."""
    root = "/dev/shm"
    try:
        if shutil.disk_usage(root).free < total_bytes * 1.25 + (64 << 20):
            root = tempfile.gettempdir()
    except OSError:
        root = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="kvplan-", dir=root)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HybridModel:
    """Kimi-Linear-style hybrid: MLA on full-attention layers, per-request state elsewhere.

    ``full_attention_ids`` default to every 4th layer (3, 7, 11, ...). Each linear layer has one
    buffer per state name with ``state_slots`` slots (one slot per running request).
    """

    name: str = "Kimi-Linear-style hybrid MLA"
    num_layers: int = 8
    full_attention_ids: tuple[int, ...] | None = None
    kv_item_len: int = 1152  # 576 latent elements x bf16, page_size 1
    pages: int = 64  # decode pages per KV buffer
    prefill_pages: int | None = None  # prefill pages per KV buffer (default: pages)
    state_item_lens: tuple[tuple[str, int], ...] = (("mamba_conv", 3072), ("mamba_temporal", 8192))
    state_slots: int = 4

    @property
    def full_ids(self) -> tuple[int, ...]:
        if self.full_attention_ids is not None:
            return self.full_attention_ids
        return tuple(i for i in range(self.num_layers) if i % 4 == 3)

    @property
    def linear_ids(self) -> tuple[int, ...]:
        full = set(self.full_ids)
        return tuple(i for i in range(self.num_layers) if i not in full)

    def peer(self, name: str, layers: Sequence[int], *, pages: int, pp_rank: int = 0,
             pp_size: int = 1) -> PeerSpec:
        """The buffers of a process holding ``layers``: KV entries, then state by name."""
        owned = set(layers)
        rows: list[tuple[int, str, str, int, int]] = [
            (i, "kv", "page", self.kv_item_len, pages) for i in self.full_ids if i in owned]
        for state, item_len in self.state_item_lens:
            rows += [(i, state, "state", item_len, self.state_slots)
                     for i in self.linear_ids if i in owned]
        return PeerSpec(name, "hybrid_mla", pack_entries(rows), self.num_layers, pp_rank, pp_size)

    def decode(self) -> PeerSpec:
        return self.peer("decode", range(self.num_layers), pages=self.pages)

    def prefill(self, pp_size: int) -> list[PeerSpec]:
        """Prefill stages with contiguous, near-equal layer ranges (the usual PP split)."""
        bounds = np.linspace(0, self.num_layers, pp_size + 1).round().astype(int)
        return [self.peer(f"prefill{r}", range(bounds[r], bounds[r + 1]),
                          pages=self.prefill_pages or self.pages, pp_rank=r, pp_size=pp_size)
                for r in range(pp_size)]


@dataclass(frozen=True)
class MhaModel:
    """Plain MHA/GQA with K and V buffers of different item lengths (e.g. 192- vs 128-dim heads)."""

    name: str = "MHA, K/V of different widths"
    num_layers: int = 4
    k_item_len: int = 768
    v_item_len: int = 512
    pages: int = 48

    def peer(self, name: str) -> PeerSpec:
        rows = [(i, "k", "page", self.k_item_len, self.pages) for i in range(self.num_layers)]
        rows += [(i, "v", "page", self.v_item_len, self.pages) for i in range(self.num_layers)]
        return PeerSpec(name, "mha", pack_entries(rows), self.num_layers)


def build_layout(spec: PeerSpec, base: int, *, with_ids: bool = True) -> Any:
    """The :class:`kvplan.Layout` of ``spec`` with its arena at address ``base``.

    ``with_ids=False`` builds the same buffers without layer ids or roles, as a legacy peer
    would publish them (used to show what positional pairing would do).
    """
    import kvplan

    ents = spec.entries
    ctx: dict[str, Any] = dict(num_model_layers=spec.num_model_layers, pp_rank=spec.pp_rank,
                               pp_size=spec.pp_size)
    if not with_ids:
        return kvplan.Layout([base + e.offset for e in ents], [e.nbytes for e in ents],
                             [e.item_len for e in ents], None, None,
                             kinds=[e.kind for e in ents], **ctx)
    pages = [e for e in ents if e.kind == "page"]
    if spec.style == "mha":
        ks = [e for e in pages if e.role == "k"]
        vs = [e for e in pages if e.role == "v"]
        return kvplan.Layout.mha([base + e.offset for e in ks], [base + e.offset for e in vs],
                                 [e.nbytes for e in ks], [e.nbytes for e in vs],
                                 [e.item_len for e in ks], [e.item_len for e in vs],
                                 layer_ids=[e.layer_id for e in ks], **ctx)
    if spec.style == "npu_groups":
        # Ascend pools: G buffer groups per layer, group-major, each layer id once per group.
        groups = list(dict.fromkeys(e.role for e in pages))
        ids = [e.layer_id for e in pages if e.role == groups[0]]
        if [e.role for e in pages] != [g for g in groups for _ in ids]:
            raise ValueError("npu_groups entries must be group-major")
        layout = kvplan.Layout.npu_groups(ids, [base + e.offset for e in pages],
                                          [e.nbytes for e in pages],
                                          [e.item_len for e in pages], group_roles=groups, **ctx)
    elif spec.style == "hybrid_mla":
        layout = kvplan.Layout.hybrid_linear([e.layer_id for e in pages],
                                             [base + e.offset for e in pages],
                                             [e.nbytes for e in pages],
                                             [e.item_len for e in pages], mla=True, **ctx)
    else:
        raise ValueError(f"unknown layout style {spec.style!r}")
    states: dict[str, list[Entry]] = {}
    for e in ents:
        if e.kind == "state":
            states.setdefault(e.role, []).append(e)
    for name, group in states.items():
        layout = layout.with_state(name, [base + e.offset for e in group],
                                   [e.nbytes for e in group], [e.item_len for e in group],
                                   [e.layer_id for e in group])
    return layout


def fragmented_pages(rng: np.random.Generator, n: int, capacity: int, mean_run: int = 4
                     ) -> np.ndarray:
    """``n`` distinct page indices below ``capacity`` made of shuffled runs of 1..2*mean_run-1.

    This is what a decode free list hands out after some churn: short contiguous runs in
    random order.
    """
    if n > capacity:
        raise ValueError(f"cannot pick {n} pages out of {capacity}")
    lens = rng.integers(1, 2 * mean_run, size=capacity)
    starts = np.concatenate(([0], np.cumsum(lens)))
    starts = starts[starts < capacity]
    runs = [np.arange(s, min(s + ln, capacity)) for s, ln in zip(starts, lens)]
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order])[:n].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Peer processes
# ---------------------------------------------------------------------------------------------

class PeerFailure(RuntimeError):
    """A peer process died, timed out, or raised something other than a TransferError."""


@dataclass
class _PeerState:
    """What a peer process holds between commands."""

    transport: Any
    spec: PeerSpec
    arena: Arena
    layout: Any = None  # kvplan.Layout of this peer (None for "raw" specs)
    templates: dict[bytes, Any] = field(default_factory=dict)  # per decode layout (wire bytes)


def _peer_main(conn: Any, spec_dict: dict[str, Any], arena_path: str, size: int,
               env: dict[str, str], log_path: str | None = None) -> None:
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
        from kvplan.engines import MooncakeTransport

        spec = PeerSpec.from_dict(spec_dict)
        arena = Arena(arena_path, size, create=False)
        state = _PeerState(MooncakeTransport("127.0.0.1"), spec, arena)
        if spec.style == "raw":  # plain buffers, no kvplan layout (engine fault tests)
            state.transport.register_buffers([arena.base + e.offset for e in spec.entries],
                                             [e.nbytes for e in spec.entries])
            wire = None
        else:
            state.layout = build_layout(spec, arena.base)
            state.transport.register(state.layout)
            wire = state.layout.to_bytes()
        conn.send(("ok", {"session": state.transport.local_session_id(), "base": arena.base,
                          "regions": state.transport.registered_regions, "layout": wire}))
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

            if isinstance(exc, TransferError):
                fields = {k: getattr(exc, k, None)
                          for k in ("engine", "session", "batch", "blocks", "bytes", "status")}
                conn.send(("transfer_error", str(exc), fields))
            else:
                conn.send(("fail", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    state.transport.close()
    conn.send(("ok", "stopped"))


def _cmd_transfer(state: _PeerState, dst_layout_wire: bytes, dst_session: str,
                  src_pages: np.ndarray, dst_pages: np.ndarray, src_slot: int | None,
                  dst_slot: int | None, max_blocks: int | None) -> dict[str, Any]:
    """Plan this peer's part of one request with kvplan and write it to the decode peer.

    The decode layout arrives as wire bytes (what the bootstrap handshake carries); the
    template is built once per decode layout and reused, as a serving worker would.
    """
    import kvplan

    t0 = time.perf_counter()
    template = state.templates.get(dst_layout_wire)
    if template is None:
        dst_layout = kvplan.Layout.from_bytes(dst_layout_wire)
        template = state.templates[dst_layout_wire] = kvplan.Template(state.layout, dst_layout)
    t1 = time.perf_counter()
    plan = template.plan(np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64))
    plans = [plan]
    if src_slot is not None and dst_slot is not None and len(template.state_pairs):
        plans.append(template.plan_state(src_slot, dst_slot))
    t2 = time.perf_counter()
    out: dict[str, Any] = {"template_s": t1 - t0, "plan_s": t2 - t1,
                           "pairs": int(len(template.pairs)),
                           "state_pairs": int(len(template.state_pairs)),
                           "runs": int(plan.n_runs), "blocks": 0, "bytes": 0, "batches": 0,
                           "transfer_s": 0.0}
    for p in plans:
        stats = state.transport.submit(p, dst_session, max_blocks)
        out["blocks"] += stats.blocks
        out["bytes"] += stats.bytes
        out["batches"] += stats.batches
        out["transfer_s"] += stats.seconds
    return out


def _raw_plan(state: _PeerState, src: Sequence[int], dst: Sequence[int],
              lengths: Sequence[int]) -> Any:
    from kvplan.engines._base import _Arrays

    return _Arrays(np.asarray(src, np.uint64) + np.uint64(state.arena.base),
                   np.asarray(dst, np.uint64), np.asarray(lengths, np.uint64))


def _cmd_submit_raw(state: _PeerState, dst_session: str, src: Sequence[int],
                    dst: Sequence[int], lengths: Sequence[int], max_blocks: int | None = None,
                    check_sources: bool = True) -> dict[str, Any]:
    """Write hand-made blocks (fault tests); ``src`` are offsets into this peer's arena."""
    stats = state.transport.submit(_raw_plan(state, src, dst, lengths), dst_session, max_blocks,
                                   check_sources=check_sources)
    return asdict(stats)


def _cmd_submit_async_raw(state: _PeerState, dst_session: str, src: Sequence[int],
                          dst: Sequence[int], lengths: Sequence[int],
                          max_blocks: int | None = None) -> dict[str, Any]:
    """Like ``submit_raw`` through Mooncake's async batch ids."""
    pending = state.transport.submit_async(_raw_plan(state, src, dst, lengths), dst_session,
                                           max_blocks)
    return asdict(pending.wait())


def _cmd_probe(state: _PeerState, peer: str) -> int:
    return int(state.transport.probe(peer))


_COMMANDS: dict[str, Callable[..., Any]] = {
    "transfer": _cmd_transfer,
    "submit_raw": _cmd_submit_raw,
    "submit_async_raw": _cmd_submit_async_raw,
    "probe": _cmd_probe,
}


class PeerProcess:
    """A spawned process running ``_peer_main`` for one :class:`PeerSpec`.

    The parent never touches an engine itself, so an engine crash costs a child, not the caller.
    """

    def __init__(self, spec: PeerSpec, arena: Arena, *, env: dict[str, str] | None = None,
                 wait: bool = True, start_timeout: float = 60.0, log_path: str | None = None
                 ) -> None:
        self.spec = spec
        self.log_path = log_path
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_peer_main, name=f"kvplan-{spec.name}",
            args=(child, spec.to_dict(), arena.path, arena.size, {**ENGINE_ENV, **(env or {})},
                  log_path),
            daemon=True)
        self.process.start()
        child.close()
        self.session = ""
        self.base = 0
        self.regions: list[tuple[int, int]] = []
        self.layout_wire: bytes | None = None
        self._broken = False
        if wait:
            self.ready(start_timeout)

    def ready(self, timeout: float = 60.0) -> PeerProcess:
        """Wait for start-up (engine initialised, arena registered); returns ``self``."""
        if not self.session:
            info = self._reply(timeout, "start")
            self.session, self.base, self.regions = info["session"], info["base"], info["regions"]
            self.layout_wire = info["layout"]
        return self

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


# ---------------------------------------------------------------------------------------------
# Verification (memory-lean: one buffer at a time)
# ---------------------------------------------------------------------------------------------

def expected_moves(src: PeerSpec, dst: PeerSpec) -> list[tuple[Entry, Entry]]:
    """Which source buffer lands in which decode buffer, by (layer id, role): the ground truth
    the check uses, written independently of kvplan's pairing."""
    by_key = {(e.layer_id, e.role): e for e in dst.entries}
    return [(e, by_key[(e.layer_id, e.role)]) for e in src.entries]


def first_wrong_byte(decode: Arena, dst_spec: PeerSpec,
                     writes: Sequence[tuple[Arena, PeerSpec, np.ndarray, np.ndarray, int | None,
                                            int | None]]) -> str | None:
    """``None`` if the decode arena holds exactly the expected bytes, else a description of the
    first wrong byte. ``writes``: per prefill peer (arena, spec, src_pages, dst_pages, src_slot,
    dst_slot)."""
    written: dict[Entry, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for arena, spec, src_pages, dst_pages, src_slot, dst_slot in writes:
        for s, d in expected_moves(spec, dst_spec):
            if s.kind == "page":
                idx_s, idx_d = np.asarray(src_pages), np.asarray(dst_pages)
            elif src_slot is not None:
                idx_s, idx_d = np.array([src_slot]), np.array([dst_slot])
            else:
                continue
            written.setdefault(d, []).append((arena.view(s), idx_s, idx_d))
    for d in dst_spec.entries:
        got = decode.view(d)
        mask = np.zeros(d.capacity, dtype=bool)
        for src_view, idx_s, idx_d in written.get(d, []):
            mask[idx_d] = True
            bad = got[idx_d] != src_view[idx_s]
            if bad.any():
                row, col = np.unravel_index(int(np.argmax(bad)), bad.shape)
                item = int(idx_d[row])
                return (f"decode layer {d.layer_id} {d.role} item {item} byte {col} "
                        f"(arena offset {d.offset + item * d.item_len + col}): "
                        f"got {int(got[item, col]):#04x}, expected "
                        f"{int(src_view[idx_s[row], col]):#04x}")
        untouched = got[~mask]
        bad = untouched != SENTINEL
        if bad.any():
            row, col = np.unravel_index(int(np.argmax(bad)), bad.shape)
            item = int(np.flatnonzero(~mask)[row])
            return (f"decode layer {d.layer_id} {d.role} item {item} byte {col} "
                    f"(arena offset {d.offset + item * d.item_len + col}) was not planned but "
                    f"changed: got {int(got[item, col]):#04x}, sentinel {SENTINEL:#04x}")
    return None


def fill_source(arena: Arena, seed: int) -> None:
    """Random bytes that never equal the sentinel, so an unwritten byte can never pass."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 255, size=arena.size, dtype=np.uint8)
    data[data == SENTINEL] = 0xFF
    arena.array[:] = data


# ---------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------

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
    per_peer: list[dict[str, Any]] = field(default_factory=list)

    def lines(self) -> list[str]:
        gbps = self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0
        out = [
            f"model:          {self.model}: {self.layers} layers, "
            f"{self.full_attention_layers} full-attention (MLA) + "
            f"{self.layers - self.full_attention_layers} linear (state)",
            f"topology:       prefill PP={self.prefill_pp} ({self.prefill_pp} processes) -> "
            f"decode PP=1, Mooncake TCP on 127.0.0.1",
            f"handshake:      decode layout {self.handshake_bytes:,} bytes on the wire "
            f"(Layout.to_bytes)",
            f"entries paired: {self.entries_paired} KV + {self.state_entries_paired} state "
            f"(by global layer id and role)",
            f"pages:          {self.request_pages} of {self.pages} per KV buffer, "
            f"fragmented destination",
            f"runs:           {self.runs:,} (runs of pages contiguous on both sides: "
            f"{self.request_pages / max(self.runs, 1):.1f} pages per block instead of 1)",
            f"blocks:         {self.blocks:,} = {self.entries_paired} KV pairs x {self.runs:,} "
            f"runs + {self.state_entries_paired} state, in {self.batches} engine calls",
            f"bytes:          {self.bytes:,} ({self.bytes / 2**20:.1f} MiB, "
            f"{self.bytes / max(self.blocks, 1) / 1024:.1f} KiB per block on average)",
            f"planning time:  {(self.template_s + self.plan_s) * 1e3:.2f} ms "
            f"(template {self.template_s * 1e3:.2f} ms, once per peer pair; "
            f"plan {self.plan_s * 1e3:.2f} ms, per request)",
            f"transfer time:  {self.transfer_s * 1e3:.1f} ms ({gbps:.2f} GB/s)",
        ]
        if self.error is None:
            out.append(f"verified: {self.verified_bytes} bytes OK "
                       f"(whole decode pool: planned bytes match the source, the rest untouched)")
        else:
            out.append(f"VERIFICATION FAILED: {self.error}")
        return out


def run_demo(model: HybridModel, *, prefill_pp: int = 2, request_pages: int | None = None,
             seed: int = 0, max_blocks_per_batch: int | None = None, quiet: bool = True
             ) -> DemoReport:
    """Run the hybrid scenario end to end and return the verified report (never raises on a
    wrong byte: the report says which one).

    ``quiet`` sends the engines' log lines to a file instead of stderr; when a peer fails, the
    end of that log is attached to the :class:`PeerFailure`.
    """
    import kvplan  # noqa: F401  (fail here, clearly, if the extension is not built)

    t_wall = time.perf_counter()
    rng = np.random.default_rng(seed)
    decode_spec = model.decode()
    prefill_specs = model.prefill(prefill_pp)
    n_req = request_pages if request_pages is not None else model.pages * 3 // 4
    src_cap = model.prefill_pages or model.pages
    src_pages = np.arange(n_req, dtype=np.int64) + (src_cap - n_req) // 2
    dst_pages = fragmented_pages(rng, n_req, model.pages)
    src_slot, dst_slot = 1 % model.state_slots, model.state_slots - 1

    report = DemoReport(model.name, model.num_layers, len(model.full_ids), prefill_pp,
                        model.pages, n_req)
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
        peers.append(PeerProcess(decode_spec, decode, wait=False, log_path=log))
        peers += [PeerProcess(spec, a, wait=False, log_path=log)
                  for spec, a in zip(prefill_specs, sources)]
        for p in peers:
            p.ready()
        dpeer = peers[0]
        report.handshake_bytes = len(dpeer.layout_wire or b"")
        # The prefill stages write concurrently, as real PP stages do: send every request
        # first, then collect the answers.
        for p in peers[1:]:
            p.send("transfer", dpeer.layout_wire, dpeer.session, src_pages, dst_pages,
                   src_slot, dst_slot, max_blocks_per_batch)
        for p in peers[1:]:
            res = p.result(120.0, "transfer")
            report.per_peer.append(res)
            report.entries_paired += res["pairs"]
            report.state_entries_paired += res["state_pairs"]
            report.runs = max(report.runs, res["runs"])  # same pages on every stage
            report.blocks += res["blocks"]
            report.bytes += res["bytes"]
            report.batches += res["batches"]
            report.template_s = max(report.template_s, res["template_s"])
            report.plan_s = max(report.plan_s, res["plan_s"])
            report.transfer_s = max(report.transfer_s, res["transfer_s"])
        writes = [(a, s, src_pages, dst_pages, src_slot, dst_slot)
                  for a, s in zip(sources, prefill_specs)]
        report.error = first_wrong_byte(decode, decode_spec, writes)
        if report.error is None:
            report.verified_bytes = decode.size
    except PeerFailure as exc:
        tail = _log_tail(os.path.join(workdir, "engines.log"))
        raise PeerFailure(f"{exc}\n--- engine log (last lines) ---\n{tail}" if tail
                          else str(exc)) from None
    finally:
        for p in peers:
            p.stop()
        for a in arenas:
            a.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report.wall_s = time.perf_counter() - t_wall
    return report


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def demo_model(layers: int = 48, pages: int = 8192) -> HybridModel:
    """Realistic size: 48 layers (12 MLA, 36 linear with conv + temporal state), 8,192 pages."""
    return HybridModel(name="Kimi-Linear-style hybrid MLA", num_layers=layers, pages=pages,
                       kv_item_len=1152,
                       state_item_lens=(("mamba_conv", 48 << 10), ("mamba_temporal", 512 << 10)),
                       state_slots=4)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvplan demo`` (see :mod:`kvplan.cli` for the options)."""
    from kvplan.cli import main as cli_main

    return cli_main(["demo", *(argv or [])])


def run_cli(args: Any) -> int:
    """Body of ``kvplan demo``: print the report; exit 1 naming the first wrong byte."""
    import importlib.util

    try:
        have_mooncake = importlib.util.find_spec("mooncake.engine") is not None
    except ModuleNotFoundError:
        have_mooncake = False
    if not have_mooncake:
        print("kvplan demo needs the Mooncake Transfer Engine: pip install "
              "'kvplan[mooncake]' (plus Debian libibverbs1 libnuma1), or run scripts/setup-env")
        return 2
    problems = [msg for bad, msg in [
        (args.layers < 4, "--layers must be at least 4 (full attention is every 4th layer)"),
        (not 1 <= args.pp <= args.layers, "--pp must be between 1 and --layers"),
        (args.pages < 1, "--pages must be positive"),
        (args.request_pages is not None and not 1 <= args.request_pages <= args.pages,
         "--request-pages must be between 1 and --pages"),
        (args.max_blocks is not None and args.max_blocks < 1, "--max-blocks must be positive"),
    ] if bad]
    if problems:
        print("kvplan demo: " + "; ".join(problems))
        return 2
    model = demo_model(args.layers, args.pages)
    print(f"kvplan demo: {model.num_layers}-layer hybrid model, {args.pages} pages, "
          f"prefill PP={args.pp} -> decode PP=1 over Mooncake TCP (127.0.0.1) ...", flush=True)
    try:
        report = run_demo(model, prefill_pp=args.pp, request_pages=args.request_pages,
                          seed=args.seed, max_blocks_per_batch=args.max_blocks)
    except PeerFailure as exc:
        print(f"kvplan demo: a peer process failed: {exc}")
        return 2
    for line in report.lines():
        print(line)
    print(f"wall time:      {report.wall_s:.1f} s ({args.pp + 1} processes, engine start-up "
          f"included)")
    return 0 if report.error is None else 1
