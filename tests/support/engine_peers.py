"""Helpers for tests that move real bytes between spawned processes.

The processes themselves are :class:`kvplan.testing.PeerProcess` (the demo uses the same ones).
What lives here is test-only: a context manager that owns arenas and peers and always cleans
up, and an *independent* byte oracle: it builds the whole expected decode arena with plain numpy
and compares it with the real one in one go, so the check shares no code with kvplan's
pairing or with :func:`kvplan.testing.first_wrong_byte`.
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

from kvplan.testing import SENTINEL, Arena, PeerProcess, PeerSpec, arena_dir, fill_source

__all__ = ["Cluster", "cluster", "expected_decode", "assert_decode_bytes", "peer_group",
           "require_mooncake", "require_nixl"]


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
def peer_group(specs: Sequence[PeerSpec], sources: set[str]
               ) -> Iterator[tuple[dict[str, Arena], dict[str, PeerProcess]]]:
    """Any number of Mooncake peers (several decode ranks, say): random arenas for the peers
    named in ``sources``, sentinel-filled arenas for the others, one process per spec (all
    started at once); every process stopped and every file deleted on exit."""
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
            procs[s.name] = PeerProcess(s, arenas[s.name], wait=False)
        for p in procs.values():
            p.ready(60.0)
        yield arenas, procs
    finally:
        for p in procs.values():
            p.stop()
        for a in arenas.values():
            a.close()
        shutil.rmtree(workdir, ignore_errors=True)


def expected_decode(decode: PeerSpec, decode_before: np.ndarray,
                    writes: Sequence[tuple[PeerSpec, np.ndarray, np.ndarray, np.ndarray,
                                           int | None, int | None]]) -> np.ndarray:
    """The whole decode arena as it must be after the writes.

    ``writes``: per source peer ``(spec, source_arena_bytes, src_pages, dst_pages, src_slot,
    dst_slot)``. Ground truth: a source buffer lands in the decode buffer with the same global
    layer id and role; page buffers move ``src_pages[i] -> dst_pages[i]``, state buffers move
    slot ``src_slot -> dst_slot``. Item ``i`` of an entry is the ``item_len`` bytes at
    ``offset + i * stride`` (strides differ from item lengths in cross-layer pools).
    """
    expected = decode_before.copy()
    dst_of = {(e.layer_id, e.role): e for e in decode.entries}
    for spec, src_bytes, src_pages, dst_pages, src_slot, dst_slot in writes:
        for s in spec.entries:
            d = dst_of[(s.layer_id, s.role)]
            assert s.item_len == d.item_len
            pairs: list[tuple[int, int]]
            if s.kind == "page":
                pairs = list(zip(np.asarray(src_pages).tolist(), np.asarray(dst_pages).tolist()))
            elif src_slot is not None and dst_slot is not None:
                pairs = [(src_slot, dst_slot)]
            else:
                continue
            for si, di in pairs:  # plain loops: slow but obviously right
                a = s.offset + si * s.stride  # stride: bytes between items (cross-layer pools)
                b = d.offset + di * d.stride
                expected[b:b + d.item_len] = src_bytes[a:a + s.item_len]
    return expected


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
                         src_slot: int | None, dst_slot: int | None) -> None:
    """The whole decode arena is ``before`` plus every stage's request (the same pages and
    state slots on each stage), checked byte for byte against :func:`expected_decode`."""
    writes = [(s, c.arenas[s.name].array, src_pages, dst_pages, src_slot, dst_slot)
              for s in stages]
    assert_decode_bytes(c.arenas["decode"].array, expected_decode(decode, before, writes),
                        decode)


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
