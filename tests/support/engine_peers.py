"""Helpers for tests that move real bytes between spawned processes.

The processes themselves are :class:`kvplan.testing.PeerProcess` (the demo uses the same ones).
What lives here is test-only: context managers that own arenas and peers and always clean up,
:class:`Engine`, the handle the ``engine`` fixture (tests/engines/conftest.py) gives a test for
each real engine, and :func:`expected_decode`, the whole expected decode arena computed by
:mod:`kvplan.testing.oracle` from the layouts the peers publish, compared with the real one in
one go (:func:`assert_decode_bytes`), so the check shares no code with kvplan's planning or
with :func:`kvplan.testing.first_wrong_byte`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvplan.testing import (
    SENTINEL,
    Arena,
    PeerProcess,
    PeerSpec,
    arena_dir,
    build_layout,
    fill_source,
)
from kvplan.testing.oracle import Memory, reference_copy

__all__ = ["ENGINE_HANDLES", "Cluster", "Engine", "assert_decode_bytes", "cluster",
           "expected_decode", "peer_group", "require_mooncake", "require_nixl"]


def require_mooncake() -> None:
    """Fail (never skip) when Mooncake is missing: CI must run the real transfers."""
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as exc:  # pragma: no cover - only on a broken environment
        pytest.fail(f"mooncake-transfer-engine is required for these tests and failed to import: "
                    f"{exc}. Run scripts/setup-env.", pytrace=False)


def require_nixl() -> None:
    """Fail (never skip) when NIXL is missing: CI must run the real transfers."""
    try:
        importlib.import_module("nixl_cu12._api")
    except ImportError as exc:  # pragma: no cover - only on a broken environment
        pytest.fail(f"nixl-cu12 is required for these tests and failed to import: {exc}. "
                    f"Run scripts/setup-env (pip install --no-deps nixl-cu12).", pytrace=False)


@dataclass
class Cluster:
    """Arenas and peer processes of one test; filled by :func:`cluster`."""

    workdir: str
    arenas: dict[str, Arena] = field(default_factory=dict)
    peers: dict[str, PeerProcess] = field(default_factory=dict)
    specs: dict[str, PeerSpec] = field(default_factory=dict)
    #: Per source peer: the session it submits to (NIXL: the decode agent's name, loaded).
    sessions: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def cluster(decode: PeerSpec, sources: Sequence[PeerSpec], *, seed: int = 1,
            engine: str = "mooncake") -> Iterator[Cluster]:
    """Create a sentinel-filled decode arena and random source arenas, start one peer process
    per spec (all at once) running ``engine``, connect every source to the decode peer, and
    stop/kill every process and delete every file on exit."""
    total = decode.size + sum(s.size for s in sources)
    c = Cluster(arena_dir(total))
    try:
        for i, spec in enumerate([decode, *sources]):
            arena = Arena(os.path.join(c.workdir, spec.name), spec.size, create=True)
            c.arenas[spec.name] = arena
            c.specs[spec.name] = spec
            if spec is decode:
                arena.array[:] = SENTINEL
            else:
                fill_source(arena, seed + i)
        for spec in [decode, *sources]:
            c.peers[spec.name] = PeerProcess(spec, c.arenas[spec.name], wait=False,
                                             engine=engine)
        for p in c.peers.values():
            p.ready(60.0)
        for spec in sources:
            c.sessions[spec.name] = c.peers[spec.name].connect(c.peers[decode.name])
        yield c
    finally:
        for p in c.peers.values():
            p.stop()
        for a in c.arenas.values():
            a.close()
        shutil.rmtree(c.workdir, ignore_errors=True)


@contextlib.contextmanager
def peer_group(specs: Sequence[PeerSpec], sources: set[str], *, engine: str = "mooncake"
               ) -> Iterator[tuple[dict[str, Arena], dict[str, PeerProcess]]]:
    """Any number of peers running ``engine`` (several decode ranks, say): random arenas for
    the peers named in ``sources``, sentinel-filled arenas for the others, one process per spec
    (all started at once), every source connected to every other peer (its ``session`` is
    what a source submits to); every process stopped and every file deleted on exit."""
    workdir = arena_dir(sum(s.size for s in specs))
    arenas: dict[str, Arena] = {}
    procs: dict[str, PeerProcess] = {}
    try:
        for i, s in enumerate(specs):
            arenas[s.name] = Arena(os.path.join(workdir, s.name), s.size, create=True)
            if s.name in sources:
                fill_source(arenas[s.name], 11 + i)
            else:
                arenas[s.name].array[:] = SENTINEL
        for s in specs:
            procs[s.name] = PeerProcess(s, arenas[s.name], wait=False, engine=engine)
        for p in procs.values():
            p.ready(60.0)
        for name in sources:
            for s in specs:
                if s.name not in sources:
                    procs[name].connect(procs[s.name])
        yield arenas, procs
    finally:
        for p in procs.values():
            p.stop()
        for a in arenas.values():
            a.close()
        shutil.rmtree(workdir, ignore_errors=True)


#: Where :func:`expected_decode` places every peer's layout: the oracle reads and writes
#: :class:`~kvplan.testing.oracle.Memory` objects, one per arena, so one address serves all.
_ORACLE_BASE = 1 << 40


def expected_decode(decode: PeerSpec, decode_before: np.ndarray,
                    writes: Sequence[tuple[PeerSpec, np.ndarray, np.ndarray, np.ndarray,
                                           int | None, int | None]], *,
                    n_tokens: int | None = None) -> np.ndarray:
    """The whole decode arena as it must be after the writes, by :mod:`kvplan.testing.oracle`.

    ``writes``: per source peer ``(spec, source_arena_bytes, src_pages, dst_pages, src_slot,
    dst_slot)``, each planned with ``n_tokens`` (a token plan) or page for page; the oracle
    reads only the layouts the specs describe (``build_layout``), never a plan.
    """
    want = Memory(decode_before.copy(), _ORACLE_BASE)
    dst_layout = build_layout(decode, _ORACLE_BASE)
    for spec, src_bytes, src_pages, dst_pages, src_slot, dst_slot in writes:
        reference_copy(build_layout(spec, _ORACLE_BASE), Memory(src_bytes, _ORACLE_BASE),
                       dst_layout, want, src_pages, dst_pages, n_tokens=n_tokens,
                       src_slot=src_slot, dst_slot=dst_slot)
    return want.data


def assert_decode_bytes(got: np.ndarray, expected: np.ndarray, decode: PeerSpec) -> None:
    """Compare every byte; on failure name the first wrong byte's buffer, item and offset."""
    assert got.shape == expected.shape
    bad = np.flatnonzero(got != expected)
    if bad.size:
        off = int(bad[0])
        where = "outside every buffer"
        for e in decode.entries:
            if e.offset <= off < e.offset + e.nbytes:
                item, byte = divmod(off - e.offset, e.stride)
                if byte < e.item_len:  # else a gap between this entry's items
                    where = f"layer {e.layer_id} {e.role} item {item} byte {byte}"
        pytest.fail(f"{bad.size} wrong bytes in the decode arena; first at offset {off} ({where}):"
                    f" got {int(got[off]):#04x}, expected {int(expected[off]):#04x}"
                    f" (sentinel {SENTINEL:#04x})", pytrace=False)



def wait_stage_notifications(c: Cluster, stages: Sequence[PeerSpec]) -> None:
    """NIXL: the decode receives each stage's completion notification (its name as the tag)."""
    for spec in stages:
        assert c.peers["decode"].call("wait_notification", c.peers[spec.name].session,
                                      spec.name.encode(), 30.0, timeout=60)


def assert_stages_landed(c: Cluster, decode: PeerSpec, stages: Sequence[PeerSpec],
                         before: np.ndarray, src_pages: np.ndarray, dst_pages: np.ndarray,
                         src_slot: int | None, dst_slot: int | None, *,
                         n_tokens: int | None = None) -> None:
    """The whole decode arena is ``before`` plus every stage's request (the same pages and
    state slots on each stage), checked byte for byte against :func:`expected_decode`."""
    writes = [(s, c.arenas[s.name].array, src_pages, dst_pages, src_slot, dst_slot)
              for s in stages]
    assert_decode_bytes(c.arenas[decode.name].array,
                        expected_decode(decode, before, writes, n_tokens=n_tokens), decode)


def raw_pair(pages: int = 64, item: int = 4096) -> tuple[PeerSpec, PeerSpec]:
    """Decode and prefill peers of one plain buffer each (engine-level tests, no layout)."""
    from kvplan.testing import pack_entries

    entries = pack_entries([(0, "kv", "page", item, pages)])
    return PeerSpec("decode", "raw", entries, 1), PeerSpec("prefill", "raw", entries, 1)


def mha_k_v_case() -> tuple[PeerSpec, PeerSpec, np.ndarray, np.ndarray]:
    """MHA peers whose K and V items differ in width (e.g. 192- vs 128-dim heads; 4 layers, K
    entries then V entries, 48 pages) and a request of 30 permuted source pages onto
    fragmented destination pages: ``(decode, prefill, src_pages, dst_pages)``."""
    from kvplan.presets import fragmented_pages
    from kvplan.testing import pack_entries

    rows = [(i, role, "page", item, 48) for role, item in (("k", 768), ("v", 512))
            for i in range(4)]
    decode = PeerSpec("decode", "mha", pack_entries(rows), 4)
    prefill = PeerSpec("prefill", "mha", pack_entries(rows), 4)
    rng = np.random.default_rng(3)
    src_pages = rng.permutation(48)[:30].astype(np.int64)
    dst_pages = fragmented_pages(30, 0.25, seed=3, shuffle_runs=True, capacity=48)
    return decode, prefill, src_pages, dst_pages


@dataclass(frozen=True)
class Engine:
    """One real transfer engine as an engine test sees it (the ``engine`` fixture's value):
    its name for :class:`kvplan.testing.PeerProcess`, and what differs between engines."""

    name: str
    #: A session no peer answers to (a request to it fails).
    unreachable_session: str

    def require(self) -> None:
        """Fail (never skip) when the engine is missing."""
        (require_nixl if self.name == "nixl" else require_mooncake)()

    @property
    def notifies(self) -> bool:
        """Whether the engine delivers a completion notification to the decode (NIXL); with
        Mooncake a finished write is the submitter's word alone."""
        return self.name == "nixl"

    def cluster(self, decode: PeerSpec, sources: Sequence[PeerSpec], *, seed: int = 1
                ) -> contextlib.AbstractContextManager[Cluster]:
        return cluster(decode, sources, seed=seed, engine=self.name)

    def peer_group(self, specs: Sequence[PeerSpec], sources: set[str]
                   ) -> contextlib.AbstractContextManager[
                       tuple[dict[str, Arena], dict[str, PeerProcess]]]:
        return peer_group(specs, sources, engine=self.name)

    def wait_stages(self, c: Cluster, stages: Sequence[PeerSpec]) -> None:
        """Where the engine notifies: the decode receives each stage's completion (sent with
        the stage's name as the tag)."""
        if self.notifies:
            wait_stage_notifications(c, stages)


#: Every real engine the tests run on: Mooncake over TCP on 127.0.0.1, NIXL over UCX.
ENGINE_HANDLES = {"mooncake": Engine("mooncake", "127.0.0.1:9"),
                  "nixl": Engine("nixl", "no-such-agent")}
