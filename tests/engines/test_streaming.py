"""The streaming submitter's scheduling, with a transport that records what it is handed:
when each slice goes out, the size threshold, an unknown destination, cancel and close. The
bytes themselves are checked over real engines in test_streaming_engines.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvplan
from kvplan.engines import StreamingSubmitter, TransferStats
from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset


class Recorder:
    """Records each submission's first source address and block count; ``gate`` holds the
    submitter's thread inside a submission until set."""

    engine_name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.gate = threading.Event()
        self.gate.set()

    def submit(self, plan, peer, max_blocks=None, **kw) -> TransferStats:
        self.gate.wait(10)
        src = np.asarray(plan.src_addrs)
        self.calls.append((peer, int(src[0]) if len(src) else -1, len(src)))
        return TransferStats(peer, len(src), int(np.asarray(plan.lengths).sum()), 1, 0.0)


def _setup(group_size: int = 2):
    preset = get_preset("deepseek-v3", 6)
    src = preset.layout(range(6), page_size=1, capacity=32, base=PREFILL_BASE)
    dst = preset.layout(range(6), page_size=1, capacity=32, base=DECODE_BASE)
    groups = kvplan.LayerGroups.fixed(group_size)
    template = kvplan.Template(src, dst, layer_groups=groups)
    plan = template.plan(np.arange(8), np.arange(8) + 4)
    return template, template.layer_slices(groups), plan


def _first_src_of_group(plan, slices, k: int) -> int:
    start = slices.of(plan).ranges[k][0][0]
    return int(plan.src_addrs[start])


def _wait_calls(rec: Recorder, n: int) -> None:
    for _ in range(1000):
        if len(rec.calls) >= n:
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"{len(rec.calls)} submissions, expected {n}")


def test_each_group_goes_out_once_all_its_layers_are_ready():
    template, slices, plan = _setup()
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        req = s.open("a", plan, "peer")
        for layer in (1, 4, 0):  # group 0 complete after 0; group 2 waits for 5
            s.ready(layer)
        _wait_calls(rec, 1)
        s.ready(0)  # a repeated signal changes nothing
        req.ready(5)
        _wait_calls(rec, 2)
        assert len(rec.calls) == 2
        req.seal()
        stats = req.wait(10)
    firsts = [c[1] for c in rec.calls]
    assert firsts == [_first_src_of_group(plan, slices, 0), _first_src_of_group(plan, slices, 2),
                      _first_src_of_group(plan, slices, 1)]  # group 1 only at seal
    assert (stats.blocks, stats.bytes, stats.slices) == (plan.n_blocks, plan.total_bytes, 3)
    assert stats.streamed


def test_small_requests_go_out_in_one_piece_and_unknown_peers_wait():
    template, slices, plan = _setup()
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=plan.total_bytes + 1) as s:
        req = s.open("small", plan, None)
        for layer in range(6):
            s.ready(layer)
        req.seal()
        with pytest.raises(kvplan.TransferError, match="not complete"):
            req.wait(0.2)  # nothing can go out before the peer is known
        req.set_peer("late-peer")
        stats = req.wait(10)
    assert rec.calls == [("late-peer", int(plan.src_addrs[0]), plan.n_blocks)]
    assert not stats.streamed and stats.slices == 0


def test_cancel_and_close_give_clean_verdicts_and_later_calls_raise():
    template, slices, plan = _setup()
    rec = Recorder()
    s = StreamingSubmitter(rec, slices, min_stream_bytes=0)
    cancelled = s.open("c", plan, "peer")
    cancelled.cancel()
    with pytest.raises(kvplan.TransferError, match="cancelled") as err:
        cancelled.wait(10)
    assert err.value.state == "cancelled"
    pending = s.open("p", plan, "peer")
    s.ready(0)
    s.close()
    with pytest.raises(kvplan.TransferError, match="closed before the request completed"):
        pending.wait(10)
    with pytest.raises(kvplan.TransferError, match="after close"):
        s.ready(1)
    with pytest.raises(kvplan.TransferError, match="after close"):
        s.open("x", plan, "peer")
    assert [c[0] for c in rec.calls] == []  # group 0 needs layers 0 and 1: nothing was sent


def test_ready_never_blocks_while_a_slice_is_in_the_engine():
    template, slices, plan = _setup(group_size=1)
    rec = Recorder()
    rec.gate.clear()  # the submitter's thread is stuck inside its first submission
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        req = s.open("a", plan, "peer")
        for layer in range(6):
            s.ready(layer)  # returns at once although the engine call has not returned
        req.seal()
        assert not req.done
        rec.gate.set()
        assert req.wait(10).slices == 6
    preset = get_preset("deepseek-v3", 6)
    other = kvplan.Template(*[preset.layout(range(6), page_size=1, capacity=32, base=b)
                              for b in (PREFILL_BASE, DECODE_BASE)])
    with StreamingSubmitter(rec, slices) as s, \
            pytest.raises(kvplan.KvPlanError, match="another template"):
        s.open("b", other.plan(np.arange(2), np.arange(2)), "peer")


def test_a_layer_never_signalled_is_reported_by_the_verdict():
    template, slices, plan = _setup()
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        req = s.open("skipped", plan, "peer")
        for layer in (0, 1, 2, 5):  # the hook of layers 3 and 4 never fired
            s.ready(layer)
        req.seal()
        stats = req.wait(10)
        assert stats.unsignalled_layers == (3, 4)
        assert stats.unsignalled_slices == (1, 2)
        # Every byte still went out (the forward wrote those layers before the seal).
        assert (stats.blocks, stats.bytes) == (plan.n_blocks, plan.total_bytes)
        full = s.open("full", plan, "peer")
        for layer in range(6):
            full.ready(layer)
        full.seal()
        assert full.wait(10).unsignalled_layers == ()


def test_require_signals_fails_a_request_sealed_with_unsignalled_layers():
    template, slices, plan = _setup()
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=0, require_signals=True) as s:
        req = s.open("skipped", plan, "peer")
        for layer in (0, 1, 2):
            s.ready(layer)
        req.seal()
        with pytest.raises(kvplan.TransferError, match=r"sealed before layers 3 was signalled|"
                           r"sealed before layers 3-5 were signalled") as err:
            req.wait(10)
    assert err.value.state == "unsignalled"
    assert err.value.layers == [3, 4, 5] and err.value.slice == 1
    assert "slice 1 (layer group 1, layers 2-3); slice 2 (layer group 2, layers 4-5)" in str(
        err.value)
    # At most group 0 went out (while streaming); nothing was sent after the seal.
    assert [c[1] for c in rec.calls] in ([], [_first_src_of_group(plan, slices, 0)])


def test_a_linear_layers_state_goes_out_with_its_group():
    preset = get_preset("kimi-linear", 8)
    src = preset.layout(range(8), page_size=1, capacity=32, state_slots=4, base=PREFILL_BASE)
    dst = preset.layout(range(8), page_size=1, capacity=32, state_slots=4, base=DECODE_BASE)
    groups = kvplan.LayerGroups.fixed(4)
    template = kvplan.Template(src, dst, layer_groups=groups)
    slices = template.layer_slices(groups)
    plan = template.plan(np.arange(8), np.arange(8) + 4)
    state = template.plan_state(1, 2)
    state_cut = slices.of(state)
    assert state_cut.seal_work == (0, 0) and all(state_cut.ranges)
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        req = s.open("hybrid", plan, "peer", state_plan=state)
        for layer in range(4):
            s.ready(layer)
        # Group 0 goes out before the seal: its page ranges in one submission, then its
        # layers' state in another.
        want = [("peer", int(p.src_addrs[ranges[0][0]]), sum(b - a for a, b in ranges))
                for p, ranges in ((plan, slices.of(plan).ranges[0]), (state, state_cut.ranges[0]))]
        for _ in range(500):
            if len(rec.calls) >= len(want):
                break
            threading.Event().wait(0.01)
        first_group = list(rec.calls)
        req.seal()
        stats = req.wait(10)
    assert first_group == want
    assert (stats.blocks, stats.bytes) == (plan.n_blocks + state.n_blocks,
                                           plan.total_bytes + state.total_bytes)
    assert req.manifest.seal == (0, 0)


class Copier(Recorder):
    """Records every block handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[np.ndarray] = []

    def submit(self, plan, peer, max_blocks=None, **kw) -> TransferStats:
        cols = [np.asarray(c, dtype=np.uint64) for c in (plan.src_addrs, plan.dst_addrs,
                                                         plan.lengths)]
        self.blocks.append(np.stack(cols, axis=1))
        return super().submit(plan, peer, max_blocks, **kw)


def _copy_map(blocks: np.ndarray) -> list[tuple[int, int, int]]:
    """The byte mapping a list of blocks performs, as maximal ``(src, dst, len)`` runs: two
    block lists with the same mapping give the same runs, however they were cut."""
    rows = sorted((int(s), int(d), int(n)) for s, d, n in blocks if n)
    out: list[tuple[int, int, int]] = []
    for s, d, n in rows:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


@pytest.mark.parametrize("key", ["deepseek-v3", "kimi-linear"])
def test_chunked_prefill_streams_each_chunks_new_pages(key: str):
    # A request of 12 pages prefilled in three chunks: each chunk plans only its new pages,
    # cuts that plan into slices and streams it; the state (final after the last chunk) goes
    # with the last chunk. Together the chunks move exactly the monolithic request.
    preset = get_preset(key, 8)
    src = preset.layout(range(8), page_size=2, capacity=32, state_slots=4, base=PREFILL_BASE)
    dst = preset.layout(range(8), page_size=2, capacity=32, state_slots=4, base=DECODE_BASE)
    groups = kvplan.LayerGroups.fixed(4)
    template = kvplan.Template(src, dst, layer_groups=groups)
    slices = template.layer_slices(groups)
    src_pages = np.array([3, 4, 5, 6, 9, 10, 11, 12, 13, 20, 21, 22], dtype=np.int64)
    dst_pages = np.array([0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 7, 8], dtype=np.int64)
    chunks = [(0, 5), (5, 9), (9, 12)]
    state = template.plan_state(1, 2) if preset.state else None
    rec = Copier()
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        for i, (a, b) in enumerate(chunks):
            plan = template.plan(src_pages[a:b], dst_pages[a:b])
            last = i == len(chunks) - 1
            req = s.open(f"r.chunk{i}", plan, "peer", state_plan=state if last else None)
            for layer in np.random.default_rng(i).permutation(8).tolist():
                req.ready(layer)
            req.seal()
            stats = req.wait(10)
            assert stats.unsignalled_layers == () and stats.streamed
            assert stats.slices == 2
            assert req.manifest.total_bytes == stats.bytes
    whole = template.plan(src_pages, dst_pages)
    expected = [np.stack([whole.src_addrs, whole.dst_addrs, whole.lengths], axis=1)]
    if state is not None:
        expected.append(np.stack([state.src_addrs, state.dst_addrs, state.lengths], axis=1))
    got = np.concatenate(rec.blocks)
    assert _copy_map(got) == _copy_map(np.concatenate(expected))
    assert int(got[:, 2].sum()) == whole.total_bytes + (state.total_bytes if state else 0)


def test_check_stream_names_a_slice_the_prefill_did_not_send():
    from kvplan.engines.streaming import check_stream, read_receipt, slice_receipt

    template, slices, plan = _setup()
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        req = s.open("a", plan, "peer")
        for layer in range(6):
            req.ready(layer)
        req.seal()
        final = req.wait(10).notification
    got = check_stream(final)  # the prefill's own account: every slice sent
    assert got.state == "complete" and got.arrived == (0, 1, 2)
    assert got.manifest == req.manifest
    # Receipts the decode saw (NIXL) take precedence: slice 2's never came.
    got = check_stream(final, arrived=[0, 1], message=b"a")
    assert got.state == "missing" and got.missing == (2,)
    work = req.manifest.slices[2]
    assert f"missing slice 2 (layer group 2, {work[1]} blocks, {work[2]} bytes)" in got.detail
    assert check_stream(None, arrived=[0]).state == "in_flight"
    with pytest.raises(kvplan.KvPlanError, match="expected b'b'"):
        check_stream(final, message=b"b")
    with pytest.raises(kvplan.KvPlanError, match="not a final notification"):
        check_stream(b"junk")
    assert read_receipt(slice_receipt([7, 9], b"a")) == ([7, 9], b"a")
    assert read_receipt(b"a") is None


def test_a_request_in_one_piece_is_complete_once_its_final_notification_is_in():
    from kvplan.engines.streaming import check_stream

    template, slices, plan = _setup()
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=plan.total_bytes + 1) as s:
        req = s.open("small", plan, "peer")
        req.seal()
        final = req.wait(10).notification
    got = check_stream(final, arrived=[])  # no receipts: it went in one piece
    assert got.state == "complete"


def test_groups_ready_while_a_submission_is_in_the_engine_go_out_together():
    template, slices, plan = _setup()
    rec = Recorder()
    rec.gate.clear()  # the first submission stays in the "engine"
    cut = slices.of(plan)
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        req = s.open("a", plan, "peer")
        req.ready(0)
        req.ready(1)
        threading.Event().wait(0.1)  # group 0 handed to the engine
        for layer in (2, 3, 4, 5):
            req.ready(layer)
        threading.Event().wait(0.1)
        rec.gate.set()
        req.seal()
        stats = req.wait(10)
    blocks = [sum(b - a for a, b in cut.ranges[k]) for k in range(3)]
    assert [c[2] for c in rec.calls] == [blocks[0], blocks[1] + blocks[2]]
    assert (stats.slices, stats.submissions, stats.blocks) == (3, 2, plan.n_blocks)


def test_the_withholding_test_transport_drops_one_slice_from_a_grouped_submission():
    """The lost-slice test's transport must drop exactly the withheld slice's blocks, and
    take that slice out of the receipt, when the streamer sends slices 1-3 in one
    submission (what happens under load): the decode then sees only slice 1 missing."""
    from kvplan.engines.streaming import read_receipt, slice_receipt
    from kvplan.testing.peers import _Withholding

    template, slices, plan = _setup(group_size=2)[:3]
    cut = slices.of(plan)
    recorder = Recorder()
    seen: list[tuple[np.ndarray, bytes]] = []
    inner_submit = recorder.submit

    def submit(p, peer, max_blocks=None, **kw):
        seen.append((np.asarray(p.src_addrs).copy(), kw.get("notif", b"")))
        return inner_submit(p, peer, max_blocks)

    recorder.submit = submit  # type: ignore[method-assign]
    dropped = np.concatenate([plan.src_addrs[a:b] for a, b in cut.ranges[1]])
    withholding = _Withholding(recorder, 1, dropped)
    a = cut.ranges[1][0][0]
    b = cut.ranges[2][-1][1]
    grouped = kvplan.BlockSlice(plan.src_addrs[a:b], plan.dst_addrs[a:b], plan.lengths[a:b])
    stats = withholding.submit(grouped, "peer", None, notif=slice_receipt([1, 2], b"r"),
                               timeout=1.0)
    assert stats.blocks == b - a  # the verdict counts the dropped blocks as sent
    ((sent, notif),) = seen
    assert sorted(sent.tolist()) == sorted(set(plan.src_addrs[a:b].tolist())
                                           - set(dropped.tolist()))
    assert read_receipt(notif) == ([2], b"r")
    # A submission holding only the withheld slice goes nowhere.
    only = kvplan.BlockSlice(*(c[cut.ranges[1][0][0]:cut.ranges[1][-1][1]]
                              for c in (plan.src_addrs, plan.dst_addrs, plan.lengths)))
    withholding.submit(only, "peer", None, notif=slice_receipt([1], b"r"), timeout=1.0)
    assert len(seen) == 1
