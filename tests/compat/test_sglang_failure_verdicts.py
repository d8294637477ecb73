"""Failure verdicts of the SGLang Mooncake drop-in, on SGLang 0.5.23's real MooncakeKVManager
(loaded from the wheel, patched with kvplan.compat.sglang.install).

An engine that fails batch ``k`` of a planned call: SGLang's status stays -1, one ERROR line on
SGLang's Mooncake logger names the decode session, the pool and exactly the destination pages
the failed batch and the unsubmitted batches after it were to write (checked against the
engine's own record of which blocks went through, and the deployment's ground truth, not
kvplan's plan), and the manager keeps the verdict. A call that succeeds logs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvplan.compat import sglang as compat
from kvplan.compat.sglang.verdicts import failure_verdicts
from kvplan.failures import STATE_GROUP
from support.sglang_models import SESSION, Deployment, load_loader, load_sglang_or_fail, request

SGLANG_LOGGER = "sglang.srt.disaggregation.mooncake.conn"


@pytest.fixture(scope="module")
def sg() -> Any:
    return load_sglang_or_fail()


@contextlib.contextmanager
def installed(cls: type) -> Iterator[None]:
    compat.install(cls)
    try:
        yield
    finally:
        compat.uninstall(cls)


class FailingEngine:
    """SGLang's engine wrapper's ``batch_transfer_sync``: records each call; call ``fail_at``
    (and every later one) returns -1, as SGLang's wrapper does for a failed batch."""

    def __init__(self, fail_at: int | None, *, only: bool = False) -> None:
        self.fail_at, self.only = fail_at, only
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []

    def batch_transfer_sync(self, session: str, src: list[int], dst: list[int],
                            lengths: list[int]) -> int:
        index = len(self.calls)
        self.calls.append((session, list(src), list(dst), list(lengths)))
        if self.fail_at is None or index < self.fail_at or (self.only and index > self.fail_at):
            return 0
        return -1


def kv_manager(sg: Any, dep: Deployment, engine: FailingEngine, max_blocks: int) -> Any:
    return sg.manager_object(sg.MooncakeKVManager, kv_args=dep.kv_args(), engine=engine,
                             is_mla_backend=True, pp_size=dep.pp_size,
                             decode_kv_args_table={SESSION: dep.register_info()},
                             kvplan_max_blocks_per_batch=max_blocks)


def unwritten_pages(dep: Deployment, src: np.ndarray, dst: np.ndarray,
                    written_calls: list[tuple[str, list[int], list[int], list[int]]]) -> set[int]:
    """Independently: the decode pages of the request (ground truth: one block per page per
    entry) with a byte outside every block the engine accepted."""
    landed = sorted((d, d + n) for _, _, dsts, lens in written_calls
                    for d, n in zip(dsts, lens))
    out = set()
    for _s, d, n in (b for b in _truth_blocks(dep, src, dst)):
        if not any(lo <= d and d + n <= hi for lo, hi in landed):
            out.add(_page_of(dep, d))
    return out


def _truth_blocks(dep: Deployment, src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    sptrs, dptrs = dep.src_lists()[0], dep.dst_lists()[0]
    where = {e: j for j, e in enumerate(dep.dst_entries)}
    blocks = []
    for i, e in enumerate(dep.src_entries):
        j, length = where[e], dep.items[e]
        for s, d in zip(src.tolist(), dst.tolist()):
            blocks.append((sptrs[i] + s * length, dptrs[j] + d * length, length))
    return blocks


def _page_of(dep: Deployment, addr: int) -> int:
    dptrs = dep.dst_lists()[0]
    j = max(k for k, p in enumerate(dptrs) if p <= addr)
    return (addr - dptrs[j]) // dep.items[dep.dst_entries[j]]


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SGLANG_LOGGER and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("seed,batch,max_blocks", [
    (0, 0, 16), (1, 1, 16), (2, -1, 10), (3, -1, 12), (4, -2, 7), (5, -1, 5)])
def test_a_failed_batch_names_exactly_the_unwritten_pages(
        sg: Any, caplog: pytest.LogCaptureFixture, seed: int, batch: int,
        max_blocks: int) -> None:
    """Batch ``batch`` of the call fails (negative: counted from the last); the plan is entry
    major, so a late batch leaves only part of the request's pages unwritten."""
    rng = np.random.default_rng(seed)
    dep = Deployment("mla", 6, list(range(6)), 1, 0, item_seed=seed)
    src, dst = request(rng, fragmented=True, n=24)
    dptrs, _, dids = dep.dst_lists()
    with installed(sg.MooncakeKVManager):
        probe = FailingEngine(None)  # how many batches the call makes
        assert kv_manager(sg, dep, probe, max_blocks).send_kvcache(
            SESSION, src, dptrs, dst, None, dst_layer_ids=dids) == 0
        fail_at = batch % len(probe.calls)
        engine = FailingEngine(fail_at)
        mgr = kv_manager(sg, dep, engine, max_blocks)
        caplog.set_level(logging.ERROR)
        rc = mgr.send_kvcache(SESSION, src, dptrs, dst, None, dst_layer_ids=dids)
    assert rc == -1  # SGLang's status
    assert len(engine.calls) == fail_at + 1  # later batches are not submitted
    assert engine.calls == probe.calls[:fail_at + 1]
    want = unwritten_pages(dep, src, dst, engine.calls[:fail_at])
    assert want  # the failed batch held blocks
    if batch < 0:
        assert want < set(dst.tolist())  # a strict part of the request
    kept = failure_verdicts(mgr)
    assert len(kept) == 1
    record = kept[0]
    assert record.session == SESSION and record.room is None
    verdict = record.verdict
    assert verdict.request_id == "?"
    assert dict(verdict.blocks) == {0: tuple(sorted(want))}
    assert f"Mooncake batch {fail_at}" in verdict.reason
    errors = _errors(caplog)
    assert len(errors) == 1
    line = errors[0].getMessage()
    assert SESSION in line and f"group 0: blocks {sorted(want)}" in line


def test_a_successful_call_logs_and_keeps_nothing(
        sg: Any, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(9)
    dep = Deployment("mla", 6, list(range(6)), 1, 0)
    src, dst = request(rng, fragmented=True, n=24)
    engine = FailingEngine(None)
    with installed(sg.MooncakeKVManager):
        mgr = kv_manager(sg, dep, engine, max_blocks=16)
        dptrs, _, dids = dep.dst_lists()
        caplog.set_level(logging.DEBUG)
        assert mgr.send_kvcache(SESSION, src, dptrs, dst, None, dst_layer_ids=dids) == 0
    assert len(engine.calls) > 1
    assert failure_verdicts(mgr) == []
    assert _errors(caplog) == []
    assert not any("unwritten" in r.getMessage() for r in caplog.records)


def test_a_failed_state_send_names_the_room_and_the_decode_slot(
        sg: Any, caplog: pytest.LogCaptureFixture) -> None:
    src_ids, dst_ids, items = [3, 7], [3, 7], [16, 16]
    engine = FailingEngine(0)
    with installed(sg.MooncakeKVManager):
        mgr = sg.manager_object(sg.MooncakeKVManager, engine=engine, kv_args=types.SimpleNamespace(
            state_data_ptrs=[[1000, 101000]], state_data_lens=[[64 * 16, 64 * 16]]))
        req = types.SimpleNamespace(mooncake_session_id=SESSION, room=4242)
        caplog.set_level(logging.ERROR)
        rc = mgr._send_mamba_state(req, [2], [1000, 101000], items, [9000000, 9100000], [5],
                                   src_ids, dst_ids, items)
    assert rc == -1
    (record,) = failure_verdicts(mgr)
    assert (record.session, record.room) == (SESSION, 4242)
    assert record.verdict.request_id == "4242"
    assert dict(record.verdict.blocks) == {STATE_GROUP: (5,)}
    (line,) = [r.getMessage() for r in _errors(caplog)]
    assert "'4242'" in line and "state slots [5]" in line and SESSION in line


def test_a_failed_entry_pair_of_the_per_pair_path_names_its_pages_once(
        sg: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A custom memory pool: one executor task per entry pair, awaited with SGLang's own
    ``_await_transfer_futures``; pair 2's write fails, the later pairs are cancelled."""
    from support.sglang_loader import InlineExecutor

    dep = Deployment("mla", 4, list(range(4)), 1, 0)
    src, dst = np.array([1, 2, 5], np.int32), np.array([7, 3, 60], np.int32)
    engine = FailingEngine(2, only=True)
    with installed(sg.MooncakeKVManager):
        mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=dep.kv_args(), engine=engine,
                                is_mla_backend=True, enable_custom_mem_pool=True,
                                decode_kv_args_table={SESSION: dep.register_info()})
        dptrs, _, dids = dep.dst_lists()
        caplog.set_level(logging.ERROR)
        rc = mgr.send_kvcache(SESSION, src, dptrs, dst, InlineExecutor(), dst_layer_ids=dids)
    assert rc == -1
    (record,) = failure_verdicts(mgr)
    assert dict(record.verdict.blocks) == {0: (3, 7, 60)}
    assert "entry pair 2 not written" in record.verdict.reason
    assert "entry pair 0" not in record.verdict.reason  # pairs 0 and 1 went through
    assert len([r for r in _errors(caplog) if "unwritten" in r.getMessage()]) == 1


def test_the_kept_verdicts_are_bounded(sg: Any) -> None:
    from kvplan.compat.sglang import verdicts

    dep = Deployment("mla", 2, [0, 1], 1, 0)
    src, dst = np.array([1, 2], np.int32), np.array([3, 4], np.int32)
    with installed(sg.MooncakeKVManager):
        mgr = kv_manager(sg, dep, FailingEngine(0), max_blocks=16)
        dptrs, _, dids = dep.dst_lists()
        for i in range(verdicts.KEEP_VERDICTS + 5):
            assert mgr.send_kvcache(f"{SESSION}{i}", src, dptrs, dst, None,
                                    dst_layer_ids=dids) == -1
    kept = failure_verdicts(mgr)
    assert len(kept) == verdicts.KEEP_VERDICTS
    assert kept[0].session == f"{SESSION}5" and kept[-1].verdict.group(0) == (3, 4)


# ---------------------------------------------------------------------------------------------
# Real Mooncake: a dead decode session
# ---------------------------------------------------------------------------------------------


def _dead_session_main(conn: Any, tests_dir: str, wrapper: str, src_pages: list[int],
                       dst_pages: list[int]) -> None:
    """A real MooncakeKVManager (patched) over a real Mooncake engine on loopback sends one
    MLA request to a decode session nothing listens at; reports the status, the kept verdicts
    and SGLang's logger's ERROR lines."""
    try:
        import os
        import socket
        import sys

        os.environ.update({"MC_TRANSFER_TIMEOUT": "5", "MC_LOG_LEVEL": "ERROR"})
        if wrapper == "sglang-lists":
            os.environ["KVPLAN_MOONCAKE_NATIVE"] = "0"
        sys.path.insert(0, tests_dir)
        from support.sglang_models import load_loader

        from kvplan.engines import MooncakeTransport

        loader = load_loader()
        sg = loader.load_sglang()
        layers, pages, item = 2, 16, 64
        src_buf = np.arange(layers * pages * item, dtype=np.uint64).astype(np.uint8)
        transport = MooncakeTransport("127.0.0.1")
        base = src_buf.ctypes.data
        transport.register_buffers([base], [src_buf.nbytes])
        engine = object.__new__(loader.load_engine_wrapper(sg))
        engine.engine = transport._engine
        engine.hostname = "127.0.0.1"
        engine.session_id = transport.local_session_id()
        with socket.socket() as s:  # a port nothing listens at once closed
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        kv_args = types.SimpleNamespace(
            kv_data_ptrs=[base + i * pages * item for i in range(layers)],
            kv_data_lens=[pages * item] * layers, kv_item_lens=[item] * layers,
            kv_layer_ids=list(range(layers)), prefill_start_layer=0, prefill_end_layer=None,
            mla_compression_ratios=None, num_draft_entries=0, page_size=1, engine_rank=0,
            pp_rank=0)
        dst_ptrs = [0x9_0000_0000 + i * 0x100000 for i in range(layers)]
        info = types.SimpleNamespace(dst_kv_ptrs=dst_ptrs, dst_kv_item_lens=[item] * layers,
                                     dst_kv_item_len=item, dst_kv_layer_ids=list(range(layers)))
        lines: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno >= logging.ERROR:
                    lines.append(record.getMessage())

        logging.getLogger(SGLANG_LOGGER).addHandler(Keep())
        compat.install(sg.MooncakeKVManager)
        mgr = sg.manager_object(sg.MooncakeKVManager, kv_args=kv_args, engine=engine,
                                is_mla_backend=True, decode_kv_args_table={dead: info})
        rc = mgr.send_kvcache(dead, np.asarray(src_pages, np.int32), dst_ptrs,
                              np.asarray(dst_pages, np.int32), None,
                              dst_layer_ids=list(range(layers)))
        kept = [(r.session == dead, r.room, dict(r.verdict.blocks)) for r in failure_verdicts(mgr)]
        transport.close()
        conn.send(("ok", rc, kept, [line.replace(dead, "<dead>") for line in lines]))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send(("fail", f"{exc!r}\n{traceback.format_exc()}"))


@pytest.mark.parametrize("wrapper", ["sglang", "sglang-lists"])
def test_a_dead_decode_session_over_real_mooncake_names_every_page(wrapper: str) -> None:
    import multiprocessing as mp
    import os

    from support.engine_peers import require_mooncake

    require_mooncake()
    load_sglang_or_fail()
    src_pages, dst_pages = [3, 4, 5, 9, 11], [40, 2, 3, 17, 8]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = ctx.Process(target=_dead_session_main,
                       args=(child, tests_dir, wrapper, src_pages, dst_pages), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(120):
        proc.kill()
        pytest.fail("the prefill did not answer in 120 s")
    res = parent.recv()
    proc.join(30)
    assert res[0] == "ok", res[1]
    _, rc, kept, lines = res
    assert rc == -1  # SGLang's status for a failed batch
    assert kept == [(True, None, {0: tuple(sorted(dst_pages))})]
    ours = [line for line in lines if "unwritten destination pages" in line]
    assert len(ours) == 1
    assert "<dead>" in ours[0] and f"group 0: blocks {sorted(dst_pages)}" in ours[0]


# ---------------------------------------------------------------------------------------------
# Staged rounds: a round's write fails mid-way
# ---------------------------------------------------------------------------------------------


def test_a_failed_staged_request_names_the_pages_of_the_unscattered_rounds(
        caplog: pytest.LogCaptureFixture) -> None:
    """The staged-rounds drop-in over real Mooncake loopback (the rounds tests' MLA pair): the
    last round's write fails. Every decode page whose bytes are not all in the decode's pool
    afterwards is named (the pages of the rounds the decode had not acknowledged scattering),
    in one ERROR line, and the manager keeps the verdict."""
    from support import sglang_rounds as tr
    from kvplan.staging import StagingConfig

    from support.engine_peers import require_mooncake

    require_mooncake()
    sg = load_sglang_or_fail()
    load_loader().load_head_slicing(sg)
    with installed(sg.MooncakeKVManager):
        pre, dec, pmgr, dmgr, engine = tr.mla_pair(sg)
        try:
            net = tr.Net([pre, dec])
            config = StagingConfig(mode="always", arena_mib=1, buffers=4, timeout_s=5.0)
            p = tr.attach_staging(pmgr, pre, net, config)
            d = tr.attach_staging(dmgr, dec, net, config)
            tr.register_decode(p, d, dec.session)
            src, dst = tr.mla_pages()
            before = dec.memory.copy()
            calls = engine.calls
            assert tr.send_mla(pmgr, dec, src, dst) == 0  # how many writes the request takes
            assert failure_verdicts(pmgr) == []
            engine.fail_call = 2 * engine.calls - calls  # the next send's last write
            dec.memory[:] = before
            caplog.set_level(logging.ERROR, logger="kvplan.compat.sglang")
            assert tr.send_mla(pmgr, dec, src, dst) == -1
            want = tr.mla_expected(pre, before, src, dst).reshape(tr.LAYERS, tr.CAP, tr.ITEM)
            have = dec.memory.reshape(tr.LAYERS, tr.CAP, tr.ITEM)
            landed = {int(x) for x in dst if np.array_equal(have[:, x], want[:, x])}
        finally:
            pre.close()
            dec.close()
    (record,) = failure_verdicts(pmgr)
    assert record.session == dec.session and record.room is None
    named = set(record.verdict.group(0))
    assert set(record.verdict.blocks) == {0}
    # no unwritten page goes unnamed (a page whose scatter the prefill had not yet seen
    # acknowledged is named too: the prefill cannot tell that it landed)
    assert named | landed == set(dst.tolist())
    lines = [r.getMessage() for r in caplog.records
             if "staged transfer to" in r.getMessage()]  # the prefill's line
    assert len(lines) == 1 and "unwritten destination pages" in lines[0]
    assert f"group 0: blocks {sorted(named)}" in lines[0]
