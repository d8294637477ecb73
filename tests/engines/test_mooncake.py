"""Mooncake adapter: unit tests against a recording stand-in, then real two-process transfers.

The first half runs the adapter against ``FakeMooncake``, an engine with Mooncake's method
signatures that *raises* wherever the real engine would crash the process (a call before
``initialize``, unequal ``batch_register_memory`` lists, waiting twice on a batch id or on 0).
So these tests prove the adapter never walks into a segfault trap.

The second half (``@pytest.mark.mooncake``) moves real bytes with the real engine over TCP on
127.0.0.1 between spawned processes and checks every byte of the decode pool. It fails, never
skips, when Mooncake is missing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvplan import BlockSlice
from kvplan.engines import MooncakeTransport, TransferError, TransferStats, merge_regions
from kvplan.presets import ModelPreset, StateSpec, fragmented_pages
from kvplan.testing.oracle import Memory, apply_plan

from support.engine_peers import raw_pair

# ---------------------------------------------------------------------------------------------
# A stand-in with Mooncake's signatures whose crash sites raise instead
# ---------------------------------------------------------------------------------------------


class WouldSegfault(AssertionError):
    """The real engine would have killed the process here."""


class FakeMooncake:
    """Records calls; mirrors ``mooncake.engine.TransferEngine`` 0.3.13 signatures."""

    def __init__(self, *, init_status: int = 0, write_status: int = 0, async_ids: bool = True,
                 register_status: int = 0) -> None:
        self.initialized = False
        self.init_status = init_status
        self.write_status = write_status
        self.register_status = register_status
        self.async_ids = async_ids
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.live_ids: dict[int, int] = {}  # id -> entries, not yet waited
        self.max_in_flight = 0
        self._next_id = 0x7F0000001000

    def _ready(self, name: str) -> None:
        if not self.initialized:
            raise WouldSegfault(f"{name} before a successful initialize")

    def _in_flight(self) -> int:
        return sum(self.live_ids.values())

    def initialize(self, arg0: str, arg1: str, arg2: str, arg3: str) -> int:
        self.calls.append(("initialize", (arg0, arg1, arg2, arg3)))
        self.initialized = self.init_status == 0
        return self.init_status

    def get_rpc_port(self) -> int:
        self._ready("get_rpc_port")
        return 15000

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        self._ready("register_memory")
        self.calls.append(("register_memory", (buffer_addr, capacity)))
        return self.register_status

    def batch_register_memory(self, buffer_addresses: list[int], capacities: list[int],
                              location: str = "*") -> int:
        self._ready("batch_register_memory")
        if len(buffer_addresses) != len(capacities):
            raise WouldSegfault("batch_register_memory with lists of different lengths")
        self.calls.append(("batch_register_memory", (list(buffer_addresses), list(capacities))))
        return self.register_status

    def batch_unregister_memory(self, arg0: list[int]) -> int:
        self._ready("batch_unregister_memory")
        self.calls.append(("batch_unregister_memory", (list(arg0),)))
        return 0

    def _check_lists(self, *lists: Any) -> None:
        for lst in lists:
            assert type(lst) is list, f"adapter passed {type(lst).__name__}, not a list"
            assert all(type(v) is int and v >= 0 for v in lst)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: list[int],
                                  peer_buffer_addresses: list[int], lengths: list[int],
                                  transport_hint: str = "") -> int:
        self._ready("batch_transfer_sync_write")
        self._check_lists(buffers, peer_buffer_addresses, lengths)
        self.max_in_flight = max(self.max_in_flight, self._in_flight() + len(buffers))
        self.calls.append(("write", (target_hostname, buffers, peer_buffer_addresses, lengths)))
        if isinstance(self.write_status, BaseException):
            raise self.write_status
        return self.write_status

    def batch_transfer_async_write(self, target_hostname: str, buffers: list[int],
                                   peer_buffer_addresses: list[int], lengths: list[int],
                                   transport_hint: str = "") -> int:
        self._ready("batch_transfer_async_write")
        self._check_lists(buffers, peer_buffer_addresses, lengths)
        self.calls.append(("async_write", (target_hostname, buffers, peer_buffer_addresses,
                                           lengths)))
        if not self.async_ids:
            return 0
        self._next_id += 64
        self.live_ids[self._next_id] = len(buffers)
        self.max_in_flight = max(self.max_in_flight, self._in_flight())
        return self._next_id

    def get_batch_transfer_status(self, arg0: list[int]) -> int:
        self._ready("get_batch_transfer_status")
        for bid in arg0:
            if bid not in self.live_ids:
                raise WouldSegfault(f"get_batch_transfer_status on {bid:#x}: 0, bogus or waited")
            del self.live_ids[bid]
        self.calls.append(("wait", (list(arg0),)))
        return 0 if not isinstance(self.write_status, int) else self.write_status

    def send_probe(self, peer_server_name: str) -> int:
        self._ready("send_probe")
        return -102


@dataclass
class Plan:
    """The smallest plan-like object: three uint64 arrays."""

    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    lengths: np.ndarray


def make_plan(n: int, *, src0: int = 0x10000, dst0: int = 0x900000, length: int = 64) -> Plan:
    i = np.arange(n, dtype=np.uint64)
    return Plan(src0 + i * np.uint64(length), dst0 + i * np.uint64(2 * length),
                np.full(n, length, dtype=np.uint64))


def transport(**engine_kw: Any) -> tuple[MooncakeTransport, FakeMooncake]:
    fake = FakeMooncake(**engine_kw)
    t = MooncakeTransport("127.0.0.1", engine=fake)
    t.register_buffers([0x10000], [1 << 20])
    return t, fake


def writes(fake: FakeMooncake) -> list[tuple[Any, ...]]:
    return [args for name, args in fake.calls if name == "write"]


# ---------------------------------------------------------------------------------------------
# Unit tests (stand-in engine)
# ---------------------------------------------------------------------------------------------


def test_import_kvplan_imports_no_engine() -> None:
    code = ("import sys, kvplan; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('mooncake', 'memfabric_hybrid') or m.startswith('kvplan.engines')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_init_failure_raises_and_engine_is_never_touched_again() -> None:
    fake = FakeMooncake(init_status=-1)
    with pytest.raises(TransferError, match="initialize"):
        MooncakeTransport("127.0.0.1", engine=fake)
    assert [name for name, _ in fake.calls] == ["initialize"]


def test_session_id_is_host_and_rpc_port() -> None:
    t, _ = transport()
    assert t.local_session_id() == "127.0.0.1:15000"


def test_default_batches_are_bounded_at_1024_and_lists_are_plain_ints() -> None:
    t, fake = transport()
    stats = t.submit(make_plan(2500), "peer:1")
    sizes = [len(w[1]) for w in writes(fake)]
    assert sizes == [1024, 1024, 452]
    assert stats == TransferStats("peer:1", 2500, 2500 * 64, 3, stats.seconds)
    first = writes(fake)[0]
    assert first[0] == "peer:1"
    assert first[1][:2] == [0x10000, 0x10040] and first[2][:2] == [0x900000, 0x900080]
    assert first[3][:2] == [64, 64]


def test_explicit_batch_bound_and_batch_contents_cover_plan_in_order() -> None:
    t, fake = transport()
    plan = make_plan(10)
    t.submit(plan, "p:1", max_blocks_per_batch=3)
    ws = writes(fake)
    assert [len(w[1]) for w in ws] == [3, 3, 3, 1]
    assert sum((w[2] for w in ws), []) == plan.dst_addrs.tolist()


def test_empty_plan_makes_no_engine_call() -> None:
    t, fake = transport()
    stats = t.submit(make_plan(0), "p:1")
    assert writes(fake) == [] and stats.blocks == 0 and stats.batches == 0


def test_zero_length_blocks_are_dropped() -> None:
    t, fake = transport()
    plan = make_plan(4)
    plan.lengths[1] = 0
    stats = t.submit(plan, "p:1")
    assert stats.blocks == 3 and writes(fake)[0][3] == [64, 64, 64]


def test_plan_arrays_are_validated_before_the_engine() -> None:
    t, fake = transport()
    with pytest.raises(ValueError, match="differ in length"):
        t.submit(Plan(np.zeros(2, np.uint64), np.zeros(3, np.uint64), np.ones(2, np.uint64)),
                 "p:1")
    with pytest.raises(ValueError, match="negative"):
        t.submit(Plan(np.array([-1, 0x10000]), np.array([0, 0]), np.array([1, 1])), "p:1")
    with pytest.raises(TypeError):
        t.submit(Plan(np.zeros((2, 2), np.uint64), np.zeros(2, np.uint64),
                      np.ones(2, np.uint64)), "p:1")
    assert writes(fake) == []


def test_unregistered_source_is_refused_before_sending() -> None:
    # TCP would send whatever memory the address points at; the adapter checks first.
    t, fake = transport()
    plan = make_plan(3)
    plan.src_addrs[2] = np.uint64(0x10000 + (1 << 20) - 32)  # straddles the region's end
    with pytest.raises(TransferError, match="block 2: source"):
        t.submit(plan, "p:1")
    assert writes(fake) == []
    t.submit(plan, "p:1", check_sources=False)  # the caller may opt out


def test_nonzero_status_becomes_transfer_error_with_fields() -> None:
    t, fake = transport(write_status=-1)
    with pytest.raises(TransferError) as info:
        t.submit(make_plan(1500), "10.0.0.2:777")
    err = info.value
    assert isinstance(err, TransferError) and isinstance(err, RuntimeError)
    assert (err.session, err.batch, err.blocks, err.bytes, err.status) == (
        "10.0.0.2:777", 0, 1024, 1024 * 64, -1)
    msg = str(err)
    for part in ("10.0.0.2:777", "batch 0", "1024 blocks", "65536 bytes", "status -1"):
        assert part in msg
    assert len(writes(fake)) == 1  # stops at the first failed batch


def test_engine_exception_becomes_transfer_error() -> None:
    boom = TypeError("incompatible function arguments")
    t, fake = transport(write_status=boom)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="raised TypeError") as info:
        t.submit(make_plan(3), "p:1")
    assert isinstance(info.value.__cause__, TypeError)
    assert info.value.status is None and info.value.batch == 0


def test_merge_regions_merges_overlaps_and_drops_empty() -> None:
    assert merge_regions([100, 100, 150, 390, 300, 50], [100, 100, 100, 20, 100, 0]) == [
        (100, 150), (300, 110)]
    assert merge_regions([0, 10], [10, 10]) == [(0, 10), (10, 10)]  # touching stays separate


def test_register_each_region_once_and_lists_equal_length() -> None:
    fake = FakeMooncake()
    t = MooncakeTransport("127.0.0.1", engine=fake)

    class L:
        data_ptrs = [0x1000, 0x3000, 0x1000, 0x2000]
        data_lens = [0x1000, 0x1000, 0x1000, 0]

    assert t.register(L()) == 2
    assert ("batch_register_memory", ([0x1000, 0x3000], [0x1000, 0x1000])) in fake.calls
    assert t.register(L()) == 0  # already registered: no engine call (would be -7)
    assert t.register_buffers([0x1800], [0x100]) == 0  # inside an earlier region
    with pytest.raises(TransferError, match="partly overlaps"):
        t.register_buffers([0x3800], [0x1000])
    assert t.register_buffers([0x8000], [0x10]) == 1  # single region: register_memory
    assert ("register_memory", (0x8000, 0x10)) in fake.calls
    assert t.registered_regions == [(0x1000, 0x1000), (0x3000, 0x1000), (0x8000, 0x10)]


def test_register_failure_raises() -> None:
    fake = FakeMooncake(register_status=-7)
    t = MooncakeTransport("127.0.0.1", engine=fake)
    with pytest.raises(TransferError, match="ADDRESS_OVERLAPPED"):
        t.register_buffers([0x1000, 0x4000], [16, 16])
    assert t.registered_regions == []


def test_closed_transport_refuses_calls() -> None:
    t, fake = transport()
    t.close()
    assert ("batch_unregister_memory", ([0x10000],)) in fake.calls
    with pytest.raises(TransferError, match="closed"):
        t.submit(make_plan(1), "p:1")
    with pytest.raises(TransferError, match="closed"):
        t.local_session_id()


def test_async_ids_are_waited_exactly_once_and_in_flight_is_capped() -> None:
    t, fake = transport()
    pending = t.submit_async(make_plan(5000), "p:1", max_blocks_per_batch=512)
    stats = pending.wait()
    assert stats.blocks == 5000 and stats.batches == 10
    assert fake.live_ids == {}  # every id waited; a second wait would have raised WouldSegfault
    assert fake.max_in_flight <= 1024
    assert pending.wait() is stats  # waiting again does not touch the engine
    assert sum(1 for n, _ in fake.calls if n == "wait") == 10


def test_two_async_handles_share_the_peer_budget() -> None:
    t, fake = transport()
    h1 = t.submit_async(make_plan(1024), "p:1")
    h2 = t.submit_async(make_plan(1024), "p:1")  # retires h1's batch first
    assert fake.max_in_flight <= 1024
    assert h1.done
    h2.wait()
    h1.wait()
    assert fake.live_ids == {}


def test_sync_submit_retires_outstanding_async_batches() -> None:
    t, fake = transport()
    h = t.submit_async(make_plan(1000), "p:1")
    t.submit(make_plan(1000), "p:1")
    assert fake.max_in_flight <= 1024 and h.done
    h.wait()


def test_failed_async_submit_is_never_waited() -> None:
    t, fake = transport(async_ids=False)  # every submit returns 0
    with pytest.raises(TransferError, match="batch 0"):
        t.submit_async(make_plan(10), "p:1")
    assert not any(n == "wait" for n, _ in fake.calls)


def test_async_failure_after_partial_submit_waits_the_rest() -> None:
    t, fake = transport()
    real_submit = fake.batch_transfer_async_write
    count = {"n": 0}

    def flaky(*args: Any) -> int:
        count["n"] += 1
        return 0 if count["n"] == 3 else real_submit(*args)

    fake.batch_transfer_async_write = flaky  # type: ignore[method-assign,assignment]
    with pytest.raises(TransferError, match="batch 2"):
        t.submit_async(make_plan(10), "p:1", max_blocks_per_batch=2)
    assert fake.live_ids == {}  # batches 0 and 1 were waited, once each


def test_close_waits_outstanding_async_batches() -> None:
    t, fake = transport()
    t.submit_async(make_plan(100), "p:1", max_blocks_per_batch=10)
    assert fake.live_ids
    t.close()
    assert fake.live_ids == {}


def test_mc_tcp_queue_env_raises_in_flight_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "4096")
    t = MooncakeTransport("127.0.0.1", engine=FakeMooncake())
    assert t._in_flight.cap == 4096 and t.max_blocks_per_batch == 1024


# ---------------------------------------------------------------------------------------------
# Real two-process transfers (Mooncake TCP on 127.0.0.1)
# ---------------------------------------------------------------------------------------------

mooncake = pytest.mark.mooncake


@pytest.fixture(autouse=False)
def mooncake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from support.engine_peers import require_mooncake

    require_mooncake()
    # Spawned peers inherit these: a hung peer fails in ~5 s, logs stay at ERROR.
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")


#: A small Kimi-Linear-style hybrid: MLA on layers 3 and 7, two state components elsewhere.
TINY_HYBRID = ModelPreset("tiny-hybrid", "tiny hybrid MLA", 8, "mla", 1152, 4,
                          (StateSpec("mamba_conv", 3072), StateSpec("mamba_temporal", 8192)))


def _hybrid():
    from kvplan.testing import model_peers

    peers = model_peers(TINY_HYBRID, pages=64, pp_size=2, state_slots=4)
    src_pages = np.arange(5, 5 + 40, dtype=np.int64)
    dst_pages = fragmented_pages(40, 1 / 3, seed=7, shuffle_runs=True, capacity=64)
    return peers, src_pages, dst_pages


def test_hybrid_layouts_positional_pairing_targets_the_wrong_decode_layer() -> None:
    """On plans alone: id pairing sends prefill stage 1's layer 7 to decode layer 7, while
    positional pairing of the same buffers (no ids) would send it to decode layer 3."""
    import kvplan
    from kvplan.testing import build_layout

    peers, src_pages, dst_pages = _hybrid()
    decode = peers.decode
    stage1 = peers.prefill[1]
    d_base, s_base = 0x7000_0000_0000, 0x1000_0000_0000
    d_layout = build_layout(decode, d_base)
    s_layout = build_layout(stage1, s_base)
    kv = {e.layer_id: e for e in decode.entries if e.kind == "page"}
    assert sorted(kv) == [3, 7] and [e.layer_id for e in stage1.entries if e.kind == "page"] == [7]

    def layer_of(addr: int) -> int:
        for e in decode.entries:
            if d_base + e.offset <= addr < d_base + e.offset + e.nbytes:
                return e.layer_id
        raise AssertionError(f"{addr:#x} is outside every decode buffer")

    plan = kvplan.Template(s_layout, d_layout).plan(src_pages, dst_pages)
    assert {layer_of(int(a)) for a in plan.dst_addrs} == {7}

    # The same KV buffers published without ids, paired by position (the bug kvplan exists to
    # prevent: plausible bytes in the wrong layer).
    from kvplan.testing import PeerSpec

    def kv_only(spec: PeerSpec) -> PeerSpec:
        return PeerSpec(spec.name, spec.style, tuple(e for e in spec.entries if e.kind == "page"),
                        spec.num_model_layers, spec.pp_rank, spec.pp_size)

    positional = kvplan.Template(build_layout(kv_only(stage1), s_base, with_ids=False),
                                 build_layout(kv_only(decode), d_base, with_ids=False),
                                 kvplan.Pairing.by_layer_id(allow_positional_fallback=True))
    wrong = positional.plan(src_pages, dst_pages)
    assert {layer_of(int(a)) for a in wrong.dst_addrs} == {3}
    # Same sources, same byte count, different destination layer: nothing would have failed.
    assert wrong.total_bytes == plan.total_bytes
    np.testing.assert_array_equal(wrong.src_addrs, plan.src_addrs)

    # Positional pairing of the state entries would also cross layers (and even state kinds).
    s_states = [e for e in stage1.entries if e.kind == "state"]
    d_states = [e for e in decode.entries if e.kind == "state"]
    pos = kvplan.pair_entries(None, None, len(s_states), len(d_states),
                              allow_positional_fallback=True)
    crossed = [(s_states[i].layer_id, s_states[i].role, d_states[j].layer_id, d_states[j].role)
               for i, j in pos.tolist()]
    assert all((sl, sr) != (dl, dr) for sl, sr, dl, dr in crossed), crossed
    by_id = kvplan.Template(s_layout, d_layout).state_pairs.tolist()
    n_pages = sum(1 for e in stage1.entries if e.kind == "page")
    n_dpages = sum(1 for e in decode.entries if e.kind == "page")
    for i, j in by_id:  # identity pairing: same layer, same state name
        s_e, d_e = stage1.entries[i], decode.entries[j]
        assert i >= n_pages and j >= n_dpages
        assert (s_e.layer_id, s_e.role) == (d_e.layer_id, d_e.role)

    # SGLang-style positional PP slicing (start at the stage's first layer) has no decode entry
    # for stage 1 at all: kvplan refuses instead of indexing past the end.
    with pytest.raises(kvplan.PairingError):
        kvplan.legacy_pp_pairs("mla", 1, 2, 4)


@mooncake
def test_many_small_blocks_are_batched_under_the_tcp_limit(mooncake_env: None) -> None:
    """3,000 blocks in one plan: more than Mooncake TCP accepts per call (~2,048), so only the
    default 1,024-block batching makes this work."""
    from support.engine_peers import assert_decode_bytes, cluster

    decode, prefill = raw_pair()
    n, size = 3000, 64
    rng = np.random.default_rng(5)
    dst_slots = rng.permutation(decode.size // size)[:n]
    src = np.arange(n, dtype=np.uint64) * np.uint64(size)
    dst = dst_slots.astype(np.uint64) * np.uint64(size)
    lengths = np.full(n, size, np.uint64)
    with cluster(decode, [prefill]) as c:
        d = c.peers["decode"]
        expected = Memory(c.arenas["decode"].array.copy(), 0)
        stats = c.peers["prefill"].call("submit_raw", d.session, src, np.uint64(d.base) + dst,
                                        lengths, timeout=60)
        # The blocks as memmoves between the arenas (offsets as addresses).
        apply_plan(BlockSlice(src, dst, lengths), Memory(c.arenas["prefill"].array, 0), expected)
        assert_decode_bytes(c.arenas["decode"].array, expected.data, decode)
    assert stats["blocks"] == n and stats["batches"] == 3


@mooncake
def test_fault_decode_gone_before_submit(mooncake_env: None) -> None:
    from support.engine_peers import cluster

    peers, src_pages, dst_pages = _hybrid()
    decode, stages = peers.decode, peers.prefill
    with cluster(decode, stages[:1]) as c:
        d = c.peers["decode"]
        d.kill()  # the decode worker crashed after the handshake
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            c.peers["prefill0"].call("transfer", d.layout_wire, d.session,
                                     src_pages, dst_pages, 0, 0, None, timeout=30)
        elapsed = time.monotonic() - t0
        err = info.value
        assert err.session == d.session and err.batch == 0 and err.status == -1
        assert err.blocks and err.bytes
        assert d.session in str(err) and "batch 0" in str(err)
        assert elapsed < 15
        # The prefill process survived, its engine still answers, and it sees the peer dead.
        assert c.peers["prefill0"].process.is_alive()
        assert c.peers["prefill0"].call("probe", d.session, timeout=10) == -102


@mooncake
def test_fault_destination_outside_registered_region(mooncake_env: None) -> None:
    from support.engine_peers import assert_decode_bytes, cluster

    decode, prefill = raw_pair()
    with cluster(decode, [prefill]) as c:
        d = c.peers["decode"]
        before = c.arenas["decode"].array.copy()
        outside = d.base + decode.size + (1 << 20)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            c.peers["prefill"].call("submit_raw", d.session, [0, 4096], [outside, outside + 4096],
                                    [4096, 4096], timeout=30)
        assert time.monotonic() - t0 < 15
        err = info.value
        assert (err.session, err.batch, err.blocks, err.bytes, err.status) == (
            d.session, 0, 2, 8192, -1)
        assert_decode_bytes(c.arenas["decode"].array, before, decode)  # nothing landed
        # Both processes are fine and the next good transfer works.
        c.peers["prefill"].call("submit_raw", d.session, [0], [d.base], [4096], timeout=30)
        np.testing.assert_array_equal(c.arenas["decode"].array[:4096],
                                      c.arenas["prefill"].array[:4096])


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Returns once every thread of ``pid`` is in the stopped state ("T" in /proc)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    # The state follows the parenthesised command name.
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just exited
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} did not stop within {timeout} s (thread states {states})",
                        pytrace=False)
        time.sleep(0.01)


@pytest.mark.slow
@mooncake
def test_fault_hung_decode_times_out(mooncake_env: None) -> None:
    """A stopped (not dead) decode process: the engine gives up after MC_TRANSFER_TIMEOUT=5 s."""
    from support.engine_peers import cluster

    # 128 MiB: more than the loopback socket buffers can hold (Linux lets a receive buffer grow
    # to 32 MiB by default), so the write cannot complete into the kernel while the receiver is
    # stopped.
    size = 128 << 20
    decode, prefill = raw_pair(size // 4096)
    with cluster(decode, [prefill]) as c:
        d = c.peers["decode"]
        c.peers["prefill"].call("submit_raw", d.session, [0], [d.base], [4096], timeout=30)
        pid = d.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            # kill() returns before the signal is acted on: wait until every thread of the
            # decode process is stopped, or a busy machine lets it receive this very transfer.
            _wait_stopped(pid)
            t0 = time.monotonic()
            with pytest.raises(TransferError) as info:
                c.peers["prefill"].call("submit_raw", d.session, [0], [d.base], [size],
                                        timeout=40)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert info.value.status == -1
        assert 4 < elapsed < 15  # MC_TRANSFER_TIMEOUT=5


# ---------------------------------------------------------------------------------------------
# kvplan demo
# ---------------------------------------------------------------------------------------------


def test_demo_verifier_names_the_first_wrong_byte(tmp_path: Any) -> None:
    """The demo's own verifier (no engine): a correct copy passes, then one corrupted planned
    byte and one touched sentinel byte are each reported with layer, role, item and byte."""
    from kvplan.testing import SENTINEL, Arena, fill_source, first_wrong_byte, model_peers

    peers = model_peers(TINY_HYBRID, pages=16, pp_size=1, state_slots=2)
    decode, stage = peers.decode, peers.prefill[0]
    d = Arena(str(tmp_path / "d"), decode.size, create=True)
    s = Arena(str(tmp_path / "s"), stage.size, create=True)
    d.array[:] = SENTINEL
    fill_source(s, 1)
    src_pages, dst_pages = np.array([0, 1, 2]), np.array([9, 4, 5])
    by_key = {(e.layer_id, e.role): e for e in decode.entries}
    for e in stage.entries:
        t = by_key[(e.layer_id, e.role)]
        if e.kind == "page":
            d.view(t)[dst_pages] = s.view(e)[src_pages]
        else:
            d.view(t)[1] = s.view(e)[0]
    writes = [(s, stage, src_pages, dst_pages, 0, 1)]
    assert first_wrong_byte(d, decode, writes) is None
    kv7 = by_key[(7, "kv")]
    d.view(kv7)[4, 17] ^= 0xFF
    msg = first_wrong_byte(d, decode, writes)
    assert msg is not None and msg.startswith("decode layer 7 kv item 4 byte 17")
    d.view(kv7)[4, 17] ^= 0xFF
    d.view(kv7)[3, 0] = 0
    msg = first_wrong_byte(d, decode, writes)
    assert msg is not None and msg.startswith("decode layer 7 kv item 3 byte 0")
    assert "not planned" in msg
    d.close()
    s.close()


@pytest.mark.slow
@mooncake
def test_kvplan_demo_command_verifies_every_byte(mooncake_env: None) -> None:
    """``kvplan demo`` end to end (smaller than the default size to keep the suite quick)."""
    res = subprocess.run([sys.executable, "-m", "kvplan.cli", "demo", "--layers", "16",
                          "--pages", "1024"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout
    assert "16 layers, 4 full-attention (MLA) + 12 linear (state)" in out
    assert "entries paired: 4 KV + 24 state" in out
    assert re.search(r"^verified: \d+ bytes OK", out, re.M), out
    for key in ("pages:", "runs:", "blocks:", "bytes:", "planning time:", "transfer time:"):
        assert key in out
