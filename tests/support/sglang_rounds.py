"""Peers for the staged-rounds tests of kvplan's SGLang Mooncake drop-in: host KV pools
registered with real Mooncake TCP loopback engines, a side channel as a queue with a listener
thread per peer (what SGLang's socket listener does), an engine wrapper that counts the
descriptors SGLang would hand Mooncake and can fail one call, and the MLA request the rounds
and failure-verdict tests share."""

from __future__ import annotations

import queue
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.compat import sglang as compat
from kvplan.compat.sglang import rounds
from kvplan.engines import MooncakeTransport
from kvplan.presets import fragmented_pages
from kvplan.staging import StagingConfig
from kvplan.staging.receiver import arena_claim, claims_overlap
from support.sglang_loader import InlineExecutor
from support.sglang_models import load_loader, load_sglang_or_fail

ALWAYS = StagingConfig(mode="always", arena_mib=1, buffers=2, timeout_s=5.0)


@pytest.fixture(scope="module", name="sg")
def sglang_installed() -> Iterator[Any]:
    """The fixture ``sg``: SGLang's modules with kvplan installed into its
    ``MooncakeKVManager`` for the test module (import it into a test module to use it)."""
    from support.engine_peers import require_mooncake

    require_mooncake()
    sg = load_sglang_or_fail()
    load_loader().load_head_slicing(sg)
    compat.install(sg.MooncakeKVManager)
    yield sg
    compat.uninstall(sg.MooncakeKVManager)


class Listener:
    """One peer's side-channel listener: messages handled in arrival order on its thread."""

    def __init__(self) -> None:
        self.q: queue.Queue[bytes | None] = queue.Queue()
        self.handler: Callable[[bytes], None] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (data := self.q.get()) is not None:
            assert self.handler is not None
            self.handler(data)

    def stop(self) -> None:
        self.q.put(None)
        self.thread.join(10)


class Engine:
    """What SGLang's ``MooncakeTransferEngine.batch_transfer_sync`` does, counting the
    descriptors it was handed; ``fail_call`` makes that call (1-based) fail as Mooncake does."""

    def __init__(self, transport: MooncakeTransport, fail_call: int | None = None) -> None:
        self.transport, self.fail_call = transport, fail_call
        self.calls = self.blocks = 0

    def batch_transfer_sync(self, session: str, src: list[int], dst: list[int],
                            lengths: list[int]) -> int:
        self.calls += 1
        self.blocks += len(src)
        if self.calls == self.fail_call:
            return -1
        return self.transport._engine_write(session, src, dst, lengths)


class Peer:
    """One rank: its KV pools in one host array registered with its own Mooncake engine."""

    def __init__(self, n_entries: int, entry_bytes: int, seed: int | None) -> None:
        self.memory = (np.random.default_rng(seed).integers(0, 256, n_entries * entry_bytes,
                                                            dtype=np.uint8)
                       if seed is not None else np.zeros(n_entries * entry_bytes, np.uint8))
        base = int(self.memory.ctypes.data)
        self.ptrs = [base + e * entry_bytes for e in range(n_entries)]
        self.lens = [entry_bytes] * n_entries
        self.entry_bytes = entry_bytes
        self.transport = MooncakeTransport("127.0.0.1")
        self.transport.register_buffers([base], [self.memory.nbytes])
        self.session = self.transport.local_session_id()
        self.listener = Listener()

    def entry(self, e: int) -> np.ndarray:
        return self.memory[e * self.entry_bytes:(e + 1) * self.entry_bytes]

    def close(self) -> None:
        self.listener.stop()
        self.transport.close()


class Net:
    """Sessions to listeners: ``send(peer, data)`` as each side's staging calls it."""

    def __init__(self, peers: list[Peer]) -> None:
        self.by_session = {p.session: p for p in peers}

    def send(self, peer: str, data: bytes) -> None:
        self.by_session[peer].listener.q.put(bytes(data))


def attach_staging(mgr: Any, peer: Peer, net: Net, config: StagingConfig = ALWAYS,
            costs: kvplan.TransferCost | None = None) -> Any:
    staging = rounds.attach(mgr, engine=peer.transport, send=net.send, reply_to=peer.session,
                            config=config, costs=costs)
    assert staging is not None
    peer.listener.handler = staging.deliver
    return staging


def register_decode(prefill: Any, decode: Any | None, session: str, decode_rank: int = 0) -> Any:
    """The decode's registration reaching the prefill: its capabilities (or none)."""
    reg = decode.capabilities() if decode is not None else {}
    return prefill.on_registration(session, reg, decode_rank)


# ------------------------------------------------------------------------------- MLA
LAYERS, ITEM, CAP, TOKENS = 4, 1152, 640, 300


def mla_pair(sg: Any, seed: int = 11, fail_call: int | None = None
              ) -> tuple[Peer, Peer, Any, Any, Engine]:
    loader = load_loader()
    pre, dec = Peer(LAYERS, CAP * ITEM, seed), Peer(LAYERS, CAP * ITEM, None)
    engine = Engine(pre.transport, fail_call)

    def kv_args(p: Peer, rank: int) -> Any:
        return types.SimpleNamespace(
            kv_data_ptrs=p.ptrs, kv_data_lens=p.lens, kv_item_lens=[ITEM] * LAYERS,
            kv_layer_ids=list(range(LAYERS)), prefill_start_layer=0, engine_rank=rank,
            mla_compression_ratios=None, num_draft_entries=0)

    info = types.SimpleNamespace(dst_kv_ptrs=dec.ptrs, dst_kv_item_lens=[ITEM] * LAYERS,
                                 dst_kv_layer_ids=list(range(LAYERS)))
    pmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv_args(pre, 0),
                                 engine=engine, is_mla_backend=True,
                                 decode_kv_args_table={dec.session: info})
    dmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv_args(dec, 0),
                                 is_mla_backend=True)
    return pre, dec, pmgr, dmgr, engine


def mla_pages(seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(seed).permutation(CAP)[:TOKENS].astype(np.int32)
    dst = fragmented_pages(TOKENS, 1.0, seed=seed, shuffle_runs=True,
                           capacity=CAP).astype(np.int32)
    return src, dst


def mla_expected(pre: Peer, dec_before: np.ndarray, src: np.ndarray, dst: np.ndarray
                  ) -> np.ndarray:
    want = dec_before.copy().reshape(LAYERS, CAP, ITEM)
    have = pre.memory.reshape(LAYERS, CAP, ITEM)
    want[:, dst.astype(np.int64)] = have[:, src.astype(np.int64)]
    return want.reshape(-1)


def send_mla(mgr: Any, dec: Peer, src: np.ndarray, dst: np.ndarray) -> int:
    return int(mgr.send_kvcache(dec.session, src, dec.ptrs, dst, InlineExecutor(),
                                dst_layer_ids=list(range(LAYERS))))


# -------------------------------------------- several senders into one decode (PP, TP, ids)
def scattered_pages(seed: int, cap: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` prefill pages drawn from ``cap`` and as many fully fragmented decode pages."""
    src = np.random.default_rng(seed).permutation(cap)[:n].astype(np.int32)
    dst = fragmented_pages(n, 1.0, seed=seed, shuffle_runs=True, capacity=cap).astype(np.int32)
    return src, dst


def opened_streams(decode: Any) -> list[Any]:
    """Every decode stream the open messages start (a spy on the decode's ``_open``)."""
    opened: list[Any] = []
    real_open = decode._open

    def spy(body: bytes) -> None:
        known = set(decode.receivers)
        real_open(body)
        opened.extend(r for k, r in list(decode.receivers.items()) if k not in known)

    decode._open = spy
    return opened


def concurrently(sends: list[Any]) -> list[int]:
    """Every send on its own thread, all started together (as SGLang's PP stages run)."""
    codes: list[int] = [-99] * len(sends)
    start = threading.Barrier(len(sends))

    def run(i: int) -> None:
        start.wait()
        codes[i] = int(sends[i]())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return codes


def sglangs_own(sg: Any, sends: list[Any]) -> list[int]:
    """The sends through SGLang's own methods (kvplan uninstalled from the class), one by
    one; kvplan is installed again after."""
    compat.uninstall(sg.MooncakeKVManager)
    try:
        return [int(send()) for send in sends]
    finally:
        compat.install(sg.MooncakeKVManager)


def assert_disjoint_shares(streams: list[Any]) -> None:
    """No two streams' decode arena claims overlap."""
    claims = [arena_claim(r.rounds) for r in streams]
    for a in range(len(claims)):
        for b in range(a + 1, len(claims)):
            assert not claims_overlap(claims[a], claims[b]), (a, b, claims[a], claims[b])


def head_sliced_stages_expected(staged_shape: tuple[int, ...], senders: list[tuple[int, int]],
                                prefills: list[Any], src: np.ndarray, dst: np.ndarray,
                                stage_layers: int) -> np.ndarray:
    """The decode pool an MHA head-sliced transfer from every (PP stage, TP rank) in
    ``senders`` leaves, from the layout alone: decode K entry l (V entry ``layers + l``),
    heads of rank r, from the K (V) entry ``l - s * stage_layers`` of stage
    ``s = l // stage_layers``, TP rank r; NHD items. ``staged_shape`` is the decode pool as
    ``(2, layers, cap, page, heads, head_bytes)``."""
    _, _, cap, page, heads, head_bytes = staged_shape
    want = np.zeros(staged_shape, dtype=prefills[0].memory.dtype)
    per = heads // (max(r for _, r in senders) + 1)
    for (s, r), pre in zip(senders, prefills):
        have = pre.memory.reshape(2, stage_layers, cap, page, per, head_bytes)
        layers = slice(s * stage_layers, (s + 1) * stage_layers)
        want[:, layers, dst.astype(np.int64), :, r * per:(r + 1) * per] = \
            have[:, :, src.astype(np.int64)]
    return want
