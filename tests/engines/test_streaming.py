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


def test_each_group_goes_out_once_all_its_layers_are_ready():
    template, slices, plan = _setup()
    rec = Recorder()
    with StreamingSubmitter(rec, slices, min_stream_bytes=0) as s:
        req = s.open("a", plan, "peer")
        for layer in (1, 4, 0):  # group 0 complete after 0; group 2 waits for 5
            s.ready(layer)
        s.ready(0)  # a repeated signal changes nothing
        req.ready(5)
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
