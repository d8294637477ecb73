"""``ArenaShares``: streams are granted by the bytes of the decode arena their rounds land in
(their claim), not by the writer index the wire names. Disjoint claims are granted together,
overlapping ones take turns in admission order, a stream that ends while queued passes nothing
on and blocks nobody, and a randomized sequence of admits and ends never has two granted
streams' claims overlap and grants every stream in the end. With the core's rounds: senders of
one TP pair claim disjoint shares, a prefill of another TP size claims across them."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvplan.staging import ArenaShares, ReceiveStaged, StagingArena
from kvplan.staging import wire
from kvplan.staging.receiver import arena_claim, claims_overlap
from support.staging_rounds import claiming, gqa_peer, has_plan_rounds


def stream(name: str, *ranges: tuple[int, int], n: int = 2, writer: int = 0,
           told: list[bytes] | None = None) -> ReceiveStaged:
    sent = told if told is not None else []
    return ReceiveStaged(name, claiming(n, *ranges) if ranges else [], lambda plan: None,
                         sent.append, writer=writer, timeout_s=60.0)


def stopped(r: ReceiveStaged) -> None:
    """The prefill says it stopped (its failure message): the stream ends, its claim is free."""
    r.on_message(wire.encode(wire.FAIL, r.request, writer=r.writer, round_index=0,
                             n_rounds=r.n_rounds, payload=b"peer_failed: stopped"))
    assert r.failed


def grants(told: list[bytes]) -> list[str]:
    return [m.request for m in map(wire.decode, told) if m.kind == wire.GRANT]


def test_a_claim_is_the_union_of_its_rounds_ranges() -> None:
    assert arena_claim(claiming(4, (0, 10), (50, 60))) == ((0, 10), (50, 60))
    assert arena_claim(claiming(3, (20, 30), (0, 10), (10, 15))) == ((0, 15), (20, 30))
    assert arena_claim(claiming(2, (5, 5), (8, 12))) == ((8, 12),)  # an empty round: nothing
    assert arena_claim([]) == ()
    assert claims_overlap(((0, 10), (50, 60)), ((55, 56),))
    assert not claims_overlap(((0, 10), (50, 60)), ((10, 50), (60, 70)))
    assert not claims_overlap((), ((0, 100),))


def test_disjoint_claims_of_one_writer_are_granted_together() -> None:
    shares, told = ArenaShares(), []
    a, b = stream("a", (0, 100), told=told), stream("b", (100, 200), told=told)
    assert shares.admit(a) and shares.admit(b)
    assert a.granted and b.granted and grants(told) == ["a", "b"]
    assert shares.holders() == [a, b] and shares.queued() == []


def test_overlapping_claims_take_turns_whatever_their_writers() -> None:
    shares, told = ArenaShares(), []
    a = stream("a", (0, 100), writer=0, told=told)
    b = stream("b", (50, 150), writer=1, told=told)  # another writer index, the same bytes
    assert shares.admit(a) and not shares.admit(b)
    assert not b.granted and shares.holders() == [a] and shares.queued() == [b]
    stopped(a)
    assert b.granted and shares.holders() == [b] and shares.queued() == []
    assert grants(told) == ["a", "b"]


def test_a_later_stream_does_not_overtake_an_earlier_queued_one_it_overlaps() -> None:
    """c overlaps no holder, but it overlaps b, queued before it: c waits for b (else a run
    of streams like c could keep b waiting for ever)."""
    shares = ArenaShares()
    a, b, c = stream("a", (0, 100)), stream("b", (50, 150)), stream("c", (120, 200))
    d = stream("d", (300, 400))
    assert shares.admit(a) and not shares.admit(b) and not shares.admit(c)
    assert shares.admit(d)  # overlaps nothing granted or queued
    assert shares.queued() == [b, c]
    stopped(a)
    assert b.granted and not c.granted and shares.holders() == [d, b]
    stopped(b)
    assert c.granted and shares.holders() == [d, c] and shares.queued() == []


def test_a_stream_that_ends_while_queued_is_never_granted_and_blocks_nobody() -> None:
    shares, told = ArenaShares(), []
    a = stream("a", (0, 100), told=told)
    b = stream("b", (50, 150), told=told)
    c = stream("c", (120, 200), told=told)  # waits for b only
    assert shares.admit(a) and not shares.admit(b) and not shares.admit(c)
    b.cancel()  # the engine aborted b while it waited
    assert b.failed and not b.granted
    assert c.granted and shares.holders() == [a, c] and shares.queued() == []
    stopped(a)
    assert shares.holders() == [c]
    assert grants(told) == ["a", "c"]  # b's prefill was told it failed, never granted
    assert wire.decode([m for m in told if wire.decode(m).request == "b"][0]).kind == wire.FAIL


def test_a_stream_of_no_rounds_claims_nothing() -> None:
    shares = ArenaShares()
    a = stream("a", (0, 100))
    empty = stream("empty")
    assert empty.loaded and shares.admit(a) and shares.admit(empty)
    assert shares.holders() == [a]
    b = stream("b", (0, 10))
    assert not shares.admit(b)


@pytest.mark.parametrize("seed", [3, 11, 2026])
def test_random_admits_and_ends_never_overlap_and_grant_everyone(seed: int) -> None:
    """Streams of 1 to 3 ranges in a 64-byte arena, admitted and ended (the holder's prefill
    stopped, or a queued stream cancelled) at random. After every step: no two granted
    streams still holding overlap, each holder is granted and each queued stream is not, no
    stream was granted past an earlier queued one it overlaps, and each queued stream
    overlaps a holder or an earlier queued stream (nothing waits for nothing). At the end,
    with the holders ended one by one, every stream not cancelled was granted."""
    rng = random.Random(seed)
    shares, told = ArenaShares(), []
    order: dict[ReceiveStaged, int] = {}
    live: list[ReceiveStaged] = []
    cancelled: set[str] = set()
    most = 0

    def claim(r: ReceiveStaged) -> Any:
        return arena_claim(r.rounds)

    def check() -> None:
        nonlocal most
        holders, queued = shares.holders(), shares.queued()
        most = max(most, len(holders))
        holding = [r for r in live if r.granted and r.state == "receiving"]
        assert set(holding) <= set(holders)
        for i, x in enumerate(holders):
            assert x.granted
            for y in holders[i + 1:]:
                assert not claims_overlap(claim(x), claim(y)), (x.request, y.request)
        for i, q in enumerate(queued):
            assert not q.granted and q.state == "receiving"
            assert not any(claims_overlap(claim(q), claim(h)) and order[h] > order[q]
                           for h in holders), q.request  # overtaken
            assert any(claims_overlap(claim(q), claim(o)) for o in holders + queued[:i]), \
                q.request  # waits for nothing

    for step in range(400):
        holders, queued = shares.holders(), shares.queued()
        if rng.random() < 0.55 or not (holders or queued):
            ranges = []
            for _ in range(rng.randint(1, 3)):
                lo = rng.randrange(64)
                ranges.append((lo, min(64, lo + rng.randint(1, 16))))
            r = stream(f"s{step}", *ranges, n=rng.randint(1, 4), writer=rng.randrange(2),
                       told=told)
            order[r] = step
            live.append(r)
            shares.admit(r)
        elif holders and (not queued or rng.random() < 0.8):
            stopped(rng.choice(holders))
        else:
            q = rng.choice(queued)
            q.cancel()
            cancelled.add(q.request)
        check()
    while shares.holders():
        stopped(shares.holders()[0])
        check()
    assert shares.queued() == []
    granted = set(grants(told))
    assert len(granted) == len(grants(told))  # one grant per stream
    assert granted == {r.request for r in live} - cancelled
    assert len(cancelled) > 5 and len(granted) > 100 and most >= 3


@pytest.mark.skipif(not has_plan_rounds(), reason="Template.plan_rounds is not in this build")
def test_senders_of_other_tp_sizes_wait_for_every_share_they_overlap() -> None:
    """Decode rank 0 of TP 2 filled by 4 prefill ranks of TP 8 (senders 0-3 of 4) and by 2
    ranks of TP 4 (senders 0-1 of 2), each stream writer 0 or 1 by its index, into one decode
    arena. The TP 8 streams claim disjoint quarters and are granted together; the TP 4 rank 1
    stream (writer 1) overlaps TP 8 senders 2 and 3, so it waits for both, not only for the
    stream with its writer index."""
    from kvplan import Template
    from kvplan.presets import fragmented_pages

    decode = gqa_peer(0, 2, None)
    src_arena, dst_arena = StagingArena(64 << 10, 2), StagingArena(64 << 10, 2)
    src = np.random.default_rng(5).permutation(32)[:10].astype(np.int64)
    dst = fragmented_pages(10, 1.0, seed=5, shuffle_runs=True, capacity=32)

    def rounds(rank: int, tp: int) -> Any:
        template = Template(gqa_peer(rank, tp, rank).layout, decode.layout)
        return template.plan_rounds(src, dst, src_arena=src_arena.region,
                                    dst_arena=dst_arena.region, buffers=2)

    tp8 = [rounds(r, 8) for r in range(4)]
    tp4 = [rounds(r, 4) for r in range(2)]
    assert [r.sender for r in tp8] == [(i, 4) for i in range(4)]
    assert [r.sender for r in tp4] == [(i, 2) for i in range(2)]
    claims8, claim4 = [arena_claim(r) for r in tp8], arena_claim(tp4[1])
    for c, r in zip(claims8, tp8):  # each within its sender's share
        assert c and r.dst_share[0] <= c[0][0] and c[-1][1] <= r.dst_share[1]
    assert [claims_overlap(claim4, c) for c in claims8] == [False, False, True, True]
    shares = ArenaShares()
    eights = [ReceiveStaged(f"p8-{i}", r, lambda plan: None, lambda data: None, writer=i)
              for i, r in enumerate(tp8)]
    four = ReceiveStaged("p4-1", tp4[1], lambda plan: None, lambda data: None, writer=1)
    assert all(shares.admit(r) for r in eights)
    assert not shares.admit(four)
    stopped(eights[1])  # the stream of its writer index ends: senders 2 and 3 still write
    assert not four.granted
    stopped(eights[2])
    assert not four.granted
    stopped(eights[3])
    assert four.granted and shares.holders() == [eights[0], four]
