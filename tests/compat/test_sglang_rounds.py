"""Staged transfers in rounds through kvplan's SGLang Mooncake drop-in, over real Mooncake TCP
loopback: SGLang 0.5.23's real ``MooncakeKVManager`` class (built as the other SGLang tests
build it, ``install`` applied), ``kvplan.compat.sglang.rounds.attach`` as the start-up hook on
both peers, the decode's capabilities in its registration, and the side channel a queue with a
listener thread per peer (what a socket listener does).

Counts, never timing: the network descriptors the prefill's engine was handed, staged against
the direct path of the same request.
"""

from __future__ import annotations

import logging
import threading
import types
from typing import Any

import numpy as np
import kvplan
import pytest

from kvplan.compat import sglang as compat
from kvplan.compat.sglang import metrics, rounds
from kvplan.presets import fragmented_pages
from kvplan.staging import DirectFallback, StagingAgreement, StagingConfig, startup_costs
from support.sglang_loader import InlineExecutor
from support.sglang_models import load_loader
from support.sglang_rounds import (
    ALWAYS,
    CAP,
    ITEM,
    LAYERS,
    TOKENS,
    Engine,
    Net,
    Peer,
    attach_staging,
    mla_expected,
    mla_pages,
    mla_pair,
    register_decode,
    send_mla,
    sglang_installed,  # noqa: F401 (the fixture sg)
)


def test_fragmented_mla_request_lands_byte_exact_in_rounds(sg: Any) -> None:
    pre, dec, pmgr, dmgr, engine = mla_pair(sg)
    try:
        net = Net([pre, dec])
        p, d = attach_staging(pmgr, pre, net), attach_staging(dmgr, dec, net)
        assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
        src, dst = mla_pages()
        before = dec.memory.copy()
        totals = metrics.staged_totals()
        assert send_mla(pmgr, dec, src, dst) == 0
        staged_blocks = engine.blocks
        kind, report = p.last[dec.session]
        assert kind == "staged" and report.rounds >= 2  # 1.38 MB through 256 KiB buffers
        np.testing.assert_array_equal(dec.memory, mla_expected(pre, before, src, dst))
        after = metrics.staged_totals()
        assert after["requests"] == totals["requests"] + 1
        assert after["network_blocks"] - totals["network_blocks"] == staged_blocks
        assert after["rounds"] - totals["rounds"] == report.rounds
        assert not d.receivers  # the decode stream ended loaded
        # the same request on the direct path (staging detached), into a cleared pool
        rounds.detach(pmgr)
        dec.memory[:] = 0
        engine.blocks = 0
        assert send_mla(pmgr, dec, src, dst) == 0
        np.testing.assert_array_equal(dec.memory, mla_expected(pre, before, src, dst))
        print(f"mla: direct {engine.blocks} staged {staged_blocks} rounds {report.rounds}")
        assert engine.blocks >= 10 * staged_blocks, (engine.blocks, staged_blocks)
    finally:
        pre.close()
        dec.close()


def test_failure_mid_way_fails_the_request_and_nothing_is_loaded(sg: Any) -> None:
    pre, dec, pmgr, dmgr, engine = mla_pair(sg, fail_call=3)  # round 2's write fails
    try:
        net = Net([pre, dec])
        config = StagingConfig(mode="always", arena_mib=1, buffers=4, timeout_s=5.0)
        p, d = attach_staging(pmgr, pre, net, config), attach_staging(dmgr, dec, net, config)
        register_decode(p, d, dec.session)
        loaded: list[str] = []
        opened: list[Any] = []
        real_open = d._open

        def spy(body: bytes) -> None:
            real_open(body)
            opened.extend(d.receivers.values())

        d._open = spy
        src, dst = mla_pages()
        totals = metrics.staged_totals()
        # SGLang's transfer worker turns a non-zero status into conclude_failure: Failed
        assert send_mla(pmgr, dec, src, dst) == -1
        kind, err = p.last[dec.session]
        assert kind == "failed" and err.reason == "engine_failed" and err.round == 2
        assert len(opened) == 1
        r = opened[0]
        # the prefill's failure message reaches the decode's listener after the status
        pause = threading.Event()
        for _ in range(200):
            if r.failed:
                break
            pause.wait(0.05)
        assert r.failed and not r.loaded and r.scattered == 2
        assert r.error.reason == "peer_failed"
        loaded.extend(x.request for x in opened if x.loaded)
        assert loaded == []
        assert metrics.staged_totals() == totals  # a failed request is not counted as staged
    finally:
        pre.close()
        dec.close()


def test_decode_refusing_the_request_fails_it_on_the_prefill(sg: Any) -> None:
    pre, dec, pmgr, dmgr, engine = mla_pair(sg)
    try:
        net = Net([pre, dec])
        p, d = attach_staging(pmgr, pre, net), attach_staging(dmgr, dec, net)
        register_decode(p, d, dec.session)
        # the decode's pool holds CAP // 2 pages: page CAP - 1 is outside it, which only the
        # decode knows (the prefill plans with unbounded stand-ins for the decode's lengths)
        dmgr.kv_args.kv_data_lens = [CAP // 2 * ITEM] * LAYERS
        src, dst = mla_pages()
        dst[-1] = CAP - 1
        before = dec.memory.copy()
        assert send_mla(pmgr, dec, src, dst) == -1
        kind, err = p.last[dec.session]
        assert kind == "failed" and err.reason == "peer_failed"
        assert "IndexBoundsError" in err.detail
        assert engine.blocks == 0  # nothing written
        np.testing.assert_array_equal(dec.memory, before)
    finally:
        pre.close()
        dec.close()


def test_non_kvplan_peer_keeps_the_direct_path_said_once(sg: Any,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    pre, dec, pmgr, dmgr, engine = mla_pair(sg)
    try:
        net = Net([pre, dec])
        p = attach_staging(pmgr, pre, net)
        with caplog.at_level(logging.INFO, logger="kvplan"):
            assert isinstance(register_decode(p, None, dec.session), DirectFallback)
            assert isinstance(register_decode(p, None, dec.session), DirectFallback)
        said = [r for r in caplog.records if dec.session in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        src, dst = mla_pages()
        before = dec.memory.copy()
        assert send_mla(pmgr, dec, src, dst) == 0
        np.testing.assert_array_equal(dec.memory, mla_expected(pre, before, src, dst))
        assert engine.blocks >= LAYERS * TOKENS // 2  # per-block writes, as without staging
        assert dec.session not in p.last  # the staged path was never asked
    finally:
        pre.close()
        dec.close()


def test_staging_off_attaches_nothing(sg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLAN_STAGING", "off")
    mgr = types.SimpleNamespace(kv_args=types.SimpleNamespace(engine_rank=0))
    assert rounds.attach(mgr, engine=object(), send=lambda p, d: None, reply_to="x") is None
    assert "_kvplan_staging" not in mgr.__dict__
    assert rounds.maybe_send(mgr, "s", [0], [0], [0], kind="mla") is None


def test_auto_without_measured_costs_keeps_the_direct_path(sg: Any) -> None:
    pre, dec, pmgr, dmgr, engine = mla_pair(sg)
    try:
        net = Net([pre, dec])
        auto = StagingConfig(mode="auto", arena_mib=1, buffers=2, timeout_s=5.0)
        p, d = attach_staging(pmgr, pre, net, auto), attach_staging(dmgr, dec, net, auto)
        register_decode(p, d, dec.session)
        src, dst = mla_pages()
        assert send_mla(pmgr, dec, src, dst) == 0
        assert p.last[dec.session][0] == "direct"
    finally:
        pre.close()
        dec.close()


AUTO = StagingConfig(mode="auto", arena_mib=1, buffers=2, timeout_s=5.0)


def test_auto_follows_the_advice_with_measured_and_with_given_costs(
        sg: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` asks the advice per request and takes the path it names, byte-exact either way.

    First with the costs ``start_up`` settles, measured here for real on Mooncake TCP
    loopback as in a server: what they advise depends on the machine's load at that moment,
    so the expected path is the advice itself. Then with fixed costs of this machine's order
    (3 µs a block, 2 GB/s network, 9 GB/s copy): the fragmented request (one direct block per
    token and layer) is staged, its log line saying why; a contiguous one (one direct block
    per layer) stays direct."""
    costs, said = startup_costs(AUTO, logging.getLogger("kvplan.compat.sglang"),
                                option="KVPLAN_STAGING_COSTS")
    assert costs is not None and said.startswith("measured costs per_block_s="), said
    advised: list[Any] = []
    choose = rounds.choose_path

    def recording(*args: Any, **kwargs: Any) -> Any:
        choice = choose(*args, **kwargs)
        advised.append(choice)
        return choice

    monkeypatch.setattr(rounds, "choose_path", recording)
    pre, dec, pmgr, dmgr, engine = mla_pair(sg)
    try:
        net = Net([pre, dec])
        p, d = attach_staging(pmgr, pre, net, AUTO, costs), attach_staging(dmgr, dec, net, AUTO, costs)
        assert p.costs is costs
        assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
        fragmented = mla_pages()
        contiguous = (np.arange(TOKENS, dtype=np.int32), np.arange(TOKENS, dtype=np.int32) + 7)

        def send(src: np.ndarray, dst: np.ndarray) -> str:
            """Sends one request and checks the decode's bytes; the path it took."""
            advised.clear()
            engine.blocks = 0
            before = dec.memory.copy()
            assert send_mla(pmgr, dec, src, dst) == 0
            np.testing.assert_array_equal(dec.memory, mla_expected(pre, before, src, dst))
            assert len(advised) == 1 and advised[0].advice is not None, advised
            kind, _ = p.last[dec.session]
            assert kind == advised[0].path
            if kind == "direct":
                assert engine.blocks == advised[0].advice.direct_blocks
            return str(kind)

        send(*fragmented)
        send(*contiguous)
        p.costs = kvplan.TransferCost(per_block_s=3e-6, network_bytes_per_s=2e9,
                                      copy_bytes_per_s=9e9)
        with caplog.at_level(logging.INFO, logger="kvplan.compat.sglang"):
            caplog.clear()
            assert send(*fragmented) == "staged"
        _, report = p.last[dec.session]
        assert report.rounds >= 2
        lines = [r.getMessage() for r in caplog.records if "staged request" in r.getMessage()]
        assert len(lines) == 1 and f"(direct plan: {LAYERS * TOKENS} blocks); why: staged: " \
            f"direct {LAYERS * TOKENS} blocks" in lines[0], lines
        assert send(*contiguous) == "direct"
        _, why = p.last[dec.session]
        assert why.startswith(f"direct: direct {LAYERS} blocks"), why
        assert engine.blocks == LAYERS
    finally:
        pre.close()
        dec.close()


def test_auto_with_a_failed_measurement_is_warned_and_stays_direct(
        sg: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from kvplan.engines import measure

    def refuse(engine: str = "mooncake", **_: Any) -> kvplan.TransferCost:
        raise kvplan.TransferError("mooncake: loopback refused")

    monkeypatch.setattr(measure, "measure_loopback", refuse)
    with caplog.at_level(logging.WARNING, logger="kvplan.compat.sglang"):
        costs, said = startup_costs(AUTO, logging.getLogger("kvplan.compat.sglang"),
                                    option="KVPLAN_STAGING_COSTS")
    assert costs is None and "so auto takes the direct path" in said
    assert any("measuring Mooncake's costs on loopback failed (TransferError: mooncake: "
               "loopback refused)" in r.getMessage() for r in caplog.records)
    pre, dec, pmgr, dmgr, engine = mla_pair(sg)
    try:
        net = Net([pre, dec])
        p, d = attach_staging(pmgr, pre, net, AUTO, costs), attach_staging(dmgr, dec, net, AUTO, costs)
        assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
        src, dst = mla_pages()
        before = dec.memory.copy()
        assert send_mla(pmgr, dec, src, dst) == 0
        assert p.last[dec.session] == ("direct", "no measured engine costs to advise with")
        np.testing.assert_array_equal(dec.memory, mla_expected(pre, before, src, dst))
        assert engine.blocks >= LAYERS * TOKENS // 2
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------------------- hetero TP
HEADS, TP_P, TP_D, PAGE, HEAD_BYTES, MHA_LAYERS, MHA_CAP, PAGES = 8, 4, 2, 4, 64, 4, 96, 40


def _mha_item(tp: int) -> int:
    return PAGE * (HEADS // tp) * HEAD_BYTES


def test_hetero_tp_request_lands_byte_exact_in_rounds(sg: Any) -> None:
    """Decode rank 0 of TP 2 (heads 0-3) filled by prefill ranks 0 and 1 of TP 4, each its own
    share of the decode arena."""
    loader = load_loader()
    n = 2 * MHA_LAYERS
    si, di = _mha_item(TP_P), _mha_item(TP_D)
    dec = Peer(n, MHA_CAP * di, None)
    pres = [Peer(n, MHA_CAP * si, 20 + r) for r in range(2)]
    try:
        net = Net([dec, *pres])
        dkv = types.SimpleNamespace(kv_data_ptrs=dec.ptrs, kv_data_lens=dec.lens,
                                    kv_item_lens=[di] * n, kv_layer_ids=[], engine_rank=0)
        dmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=dkv,
                                     attn_tp_size=TP_D)
        d = attach_staging(dmgr, dec, net)
        src = np.random.default_rng(3).permutation(MHA_CAP)[:PAGES].astype(np.int32)
        dst = fragmented_pages(PAGES, 1.0, seed=3, shuffle_runs=True,
                               capacity=MHA_CAP).astype(np.int32)
        staged_blocks, engines, mgrs = 0, [], []
        for r, pre in enumerate(pres):
            kv = types.SimpleNamespace(
                kv_data_ptrs=pre.ptrs, kv_data_lens=pre.lens, kv_item_lens=[si] * n,
                kv_layer_ids=[], page_size=PAGE, total_kv_head_num=HEADS,
                kv_head_num=HEADS // TP_P, engine_rank=r, prefill_start_layer=0)
            engine = Engine(pre.transport)
            mgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=kv,
                                        attn_tp_size=TP_P, engine=engine)
            p = attach_staging(mgr, pre, net)
            assert isinstance(register_decode(p, d, dec.session), StagingAgreement)
            rc = mgr.send_kvcache_slice(dec.session, src, dec.ptrs, dst, 0, TP_D, di,
                                        InlineExecutor(), dst_layer_ids=None)
            assert rc == 0
            assert p.last[dec.session][0] == "staged"
            staged_blocks += engine.blocks
            engines.append(engine)
            mgrs.append(mgr)
        # oracle: decode slot t, local head h of page dst[i] = prefill rank h // 2's head
        # h % 2 of slot t of page src[i], every entry (NHD items)
        got = dec.memory.reshape(n, MHA_CAP, PAGE, HEADS // TP_D, HEAD_BYTES)
        want = np.zeros_like(got)
        for r, pre in enumerate(pres):
            have = pre.memory.reshape(n, MHA_CAP, PAGE, HEADS // TP_P, HEAD_BYTES)
            lo = r * (HEADS // TP_P)
            want[:, dst.astype(np.int64), :, lo:lo + HEADS // TP_P] = \
                have[:, src.astype(np.int64)]
        np.testing.assert_array_equal(got, want)
        # the same requests directly
        dec.memory[:] = 0
        direct = 0
        for mgr, engine in zip(mgrs, engines):
            rounds.detach(mgr)
            engine.blocks = 0
            assert mgr.send_kvcache_slice(dec.session, src, dec.ptrs, dst, 0, TP_D, di,
                                          InlineExecutor(), dst_layer_ids=None) == 0
            direct += engine.blocks
        np.testing.assert_array_equal(got, want)
        print(f"tp 4->2: direct {direct} staged {staged_blocks}")
        assert direct >= 10 * staged_blocks, (direct, staged_blocks)
    finally:
        for p in (dec, *pres):
            p.close()


# ------------------------------------------------------------------------------- registration
def _registration_attrs(peer: Peer) -> dict[str, Any]:
    """What SGLang's ``build_receiver_registration_message`` reads from a decode manager."""
    return dict(local_ip="127.0.0.1", rank_port=17000, attn_tp_size=1, dcp_size=1, dcp_rank=0,
                enable_staging=False, _staging_ctx=None, kv_buffer_tensors=None,
                get_session_id=lambda: peer.session)


def _decode_kv_args(dec: Peer) -> Any:
    return types.SimpleNamespace(
        kv_data_ptrs=dec.ptrs, kv_data_lens=dec.lens, kv_item_lens=[ITEM] * LAYERS,
        kv_layer_ids=list(range(LAYERS)), engine_rank=0, aux_data_ptrs=[], state_data_ptrs=[],
        state_item_lens=[], state_layer_ids=[], state_dim_per_tensor=[])


@pytest.mark.parametrize("decode_staging", [True, False], ids=["kvplan-decode", "plain-decode"])
def test_sglang_registration_negotiates_and_socket_channel_carries_rounds(
        sg: Any, decode_staging: bool) -> None:
    """The decode's registration message is SGLang's own (20 frames) plus kvplan's frame; the
    prefill parses it with SGLang's ``KVArgsRegisterInfo.from_zmq`` and negotiates; the rounds
    travel over kvplan's TCP side channel. A decode without staging sends SGLang's 20 frames
    only, and the prefill keeps the direct path."""
    import sys

    loader = load_loader()
    conn = sys.modules["sglang.srt.disaggregation.mooncake.conn"]
    pre, dec, pmgr, _, engine = mla_pair(sg)
    pre.listener.stop()
    dec.listener.stop()
    staged: list[Any] = []
    try:
        dmgr = loader.manager_object(sg, sg.MooncakeKVManager, kv_args=_decode_kv_args(dec),
                                     is_mla_backend=True, **_registration_attrs(dec))
        plain = dmgr.build_receiver_registration_message()
        assert len(plain) == 20
        if decode_staging:
            staged.append(rounds.attach(dmgr, engine=dec.transport, config=ALWAYS))
        frames = dmgr.build_receiver_registration_message()
        assert frames[:20] == plain  # SGLang's own frames, unchanged
        assert len(frames) == (21 if decode_staging else 20)
        p = rounds.attach(pmgr, engine=pre.transport, config=ALWAYS)
        assert p is not None
        staged.append(p)
        info = conn.KVArgsRegisterInfo.from_zmq(frames)
        assert info.dst_kv_ptrs == dec.ptrs  # SGLang's parse, unchanged
        # what SGLang's _publish_peer_registration reads on the prefill
        pmgr.kv_args.aux_data_ptrs = []
        pmgr.kv_args.state_data_ptrs = []
        pmgr.kv_args.state_type = "none"
        pmgr.__dict__.update(session_lock=threading.Lock(), state_layout_rejections={},
                             failed_sessions=set(), session_failures={},
                             failed_session_probes={})
        # SGLang's bootstrap thread publishes the parsed registration; kvplan's instance hook
        # negotiates right after
        assert pmgr._publish_peer_registration(dec.session, info) is None
        assert pmgr.decode_kv_args_table[dec.session] is info
        outcome = p.peers[dec.session]
        assert isinstance(outcome, StagingAgreement if decode_staging else DirectFallback)
        src, dst = mla_pages()
        before = dec.memory.copy()
        assert send_mla(pmgr, dec, src, dst) == 0
        np.testing.assert_array_equal(dec.memory, mla_expected(pre, before, src, dst))
        if decode_staging:
            assert p.last[dec.session][0] == "staged" and engine.blocks <= 4
            assert p.endpoints[dec.session] == staged[0].reply_to
        else:
            assert dec.session not in p.last and engine.blocks >= LAYERS * TOKENS // 2
    finally:
        for s in staged:
            s.stop()
        rounds.unhook_register_info(conn.KVArgsRegisterInfo)
        pre.transport.close()
        dec.transport.close()


# ------------------------------------------------------------------------------- start-up
def test_start_up_hook_attaches_after_sglang_registers_its_kv(
        sg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``install`` wraps SGLang's ``register_buffer_to_engine``: after SGLang registered the
    KV memory, with ``KVPLAN_STAGING`` set the manager has an arena registered with the
    Mooncake engine inside SGLang's wrapper and a side channel on its ``local_ip``; unset, it
    has no staging and only the layout identity exchange at SGLang's registration."""
    loader = load_loader()
    cls = sg.MooncakeKVManager
    monkeypatch.delenv("KVPLAN_STAGING", raising=False)
    compat.install(cls)
    assert getattr(cls.__dict__["register_buffer_to_engine"], "_kvplan_start_up", False)
    dec = Peer(LAYERS, CAP * ITEM, None)
    dec.listener.stop()
    registered: list[Any] = []

    class Wrapper:  # SGLang's MooncakeTransferEngine: batch_register, the engine inside
        engine = dec.transport

        def batch_register(self, ptrs: list[int], lens: list[int]) -> int:
            registered.append((ptrs, lens))
            return 0

    kv = _decode_kv_args(dec)
    kv.aux_data_lens, kv.state_data_lens = [], []
    mgr = None
    try:
        plain = loader.manager_object(sg, cls, kv_args=kv, engine=Wrapper(),
                                      local_ip="127.0.0.1")
        plain.register_buffer_to_engine()
        assert registered == [(dec.ptrs, dec.lens)] and rounds.staging_of(plain) is None
        assert isinstance(plain.__dict__.get("_kvplan_identity_exchange"),
                          rounds.IdentityExchange)
        registered.clear()
        monkeypatch.setenv("KVPLAN_STAGING", "always")
        monkeypatch.setenv("KVPLAN_STAGING_ARENA_MIB", "1")
        compat.install(cls)
        mgr = loader.manager_object(sg, cls, kv_args=kv, engine=Wrapper(),
                                    local_ip="127.0.0.1")
        mgr.register_buffer_to_engine()
        assert registered == [(dec.ptrs, dec.lens)]  # SGLang's own registration first
        staging = rounds.staging_of(mgr)
        assert staging is not None and staging.arena.registered
        assert staging.config.mode == "always" and staging.arena.size == 1 << 20
        assert staging.reply_to.startswith("127.0.0.1:")
        monkeypatch.setenv("KVPLAN_STAGING", "sometimes")
        other = loader.manager_object(sg, cls, kv_args=kv, engine=Wrapper(),
                                      local_ip="127.0.0.1")
        with pytest.raises(kvplan.ConfigError, match="KVPLAN_STAGING"):
            other.register_buffer_to_engine()
    finally:
        if mgr is not None:
            rounds.detach(mgr)
        rounds.unhook_start_up(cls)
        assert "register_buffer_to_engine" not in cls.__dict__ or not getattr(
            cls.__dict__["register_buffer_to_engine"], "_kvplan_start_up", False)
        dec.transport.close()


GIVEN = "per_block_s=3e-06,network_bytes_per_s=2e+09,copy_bytes_per_s=9e+09"


@pytest.mark.parametrize("case", ["measured", "given", "failed"])
def test_start_up_settles_the_costs_auto_advises_with_and_says_which(
        sg: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        case: str) -> None:
    """``start_up`` with ``KVPLAN_STAGING=auto``: the manager's staging holds the measured
    costs (measured once), the given ``KVPLAN_STAGING_COSTS`` (nothing measured), or none
    after a failed measurement (warned; ``auto`` then keeps the direct path); one log line
    says the settings and which costs."""
    from kvplan.engines import measure

    measured = kvplan.TransferCost(per_block_s=5e-6, network_bytes_per_s=1e9,
                                   copy_bytes_per_s=6e9)
    calls: list[str] = []

    def fake(engine: str = "mooncake", **_: Any) -> kvplan.TransferCost:
        calls.append(engine)
        if case == "failed":
            raise kvplan.TransferError("mooncake: loopback refused")
        return measured

    monkeypatch.setattr(measure, "measure_loopback", fake)
    monkeypatch.setenv("KVPLAN_STAGING", "auto")
    monkeypatch.setenv("KVPLAN_STAGING_ARENA_MIB", "1")
    if case == "given":
        monkeypatch.setenv("KVPLAN_STAGING_COSTS", GIVEN)
    else:
        monkeypatch.delenv("KVPLAN_STAGING_COSTS", raising=False)
    dec = Peer(LAYERS, CAP * ITEM, None)
    dec.listener.stop()

    class Wrapper:  # SGLang's MooncakeTransferEngine, the engine inside
        engine = dec.transport

    mgr = load_loader().manager_object(sg, sg.MooncakeKVManager, kv_args=_decode_kv_args(dec),
                                       engine=Wrapper(), local_ip="127.0.0.1")
    try:
        with caplog.at_level(logging.INFO, logger="kvplan.compat.sglang"):
            staging = rounds.start_up(mgr)
        assert staging is not None and rounds.staging_of(mgr) is staging
        said = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("kvplan staging (auto)")]
        assert len(said) == 1, said
        assert said[0].startswith("kvplan staging (auto) on rank 0: 1 MiB arena in 2 buffers "
                                  "registered, channel 127.0.0.1:"), said
        if case == "measured":
            assert staging.costs == measured and calls == ["mooncake"]
            assert "; measured costs per_block_s=5e-06,network_bytes_per_s=1e+09," \
                "copy_bytes_per_s=6e+09 (mooncake loopback; set KVPLAN_STAGING_COSTS" in said[0]
        elif case == "given":
            assert calls == []  # given costs: nothing measured
            assert staging.costs == staging.config.costs == kvplan.TransferCost(
                per_block_s=3e-6, network_bytes_per_s=2e9, copy_bytes_per_s=9e9)
            assert said[0].endswith(f"; given costs {GIVEN} (KVPLAN_STAGING_COSTS)")
        else:
            assert staging.costs is None and calls == ["mooncake"]
            assert said[0].endswith("; no costs (the measurement failed), so auto takes the "
                                    "direct path (set KVPLAN_STAGING_COSTS, or staging always)")
            warned = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert [r.getMessage() for r in warned] == [
                "kvplan staging: measuring Mooncake's costs on loopback failed "
                "(TransferError: mooncake: loopback refused)"]
    finally:
        rounds.detach(mgr)
        dec.transport.close()


def test_start_up_refuses_bad_costs_naming_the_variable(
        sg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad ``KVPLAN_STAGING_COSTS`` stops the start-up before anything is measured or
    registered: a ``ConfigError`` naming the variable and the value."""
    from kvplan.engines import measure

    monkeypatch.setattr(measure, "measure_loopback", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv("KVPLAN_STAGING", "auto")
    bad = "per_block_s=3e-06,network_bytes_per_s=fast,copy_bytes_per_s=9e+09"
    monkeypatch.setenv("KVPLAN_STAGING_COSTS", bad)
    mgr = types.SimpleNamespace(engine=types.SimpleNamespace(engine=object()),
                                kv_args=types.SimpleNamespace(engine_rank=0))
    with pytest.raises(kvplan.ConfigError) as err:
        rounds.start_up(mgr)
    assert err.value.option == "KVPLAN_STAGING_COSTS" and err.value.value == bad
    assert "network_bytes_per_s='fast'" in str(err.value)
    assert rounds.staging_of(mgr) is None


def test_pools_outside_host_memory_keep_the_direct_path() -> None:
    """A device address (here: one no mapping of this process holds) is never copied through
    on the host: the request keeps the direct path."""
    memory = np.zeros(4096, np.uint8)
    assert rounds.host_pools([int(memory.ctypes.data)], [memory.nbytes])
    assert not rounds.host_pools([int(memory.ctypes.data)], [1 << 46])
    assert not rounds.host_pools([(1 << 47) - 4096], [4096])
