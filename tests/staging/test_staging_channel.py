"""kvplan's side channel (``kvplan.staging.channel``): length-framed messages over TCP, the
framing both connectors write (untagged for SGLang, tagged for vLLM), and typed errors naming
the peer and the byte counts."""

from __future__ import annotations

import queue
import socket
import struct
import threading
from typing import Any, cast

import pytest

from kvplan import KvPlanError
from kvplan.staging import (
    CHANNEL_REASONS,
    ChannelError,
    FrameConnection,
    FrameListener,
    Framing,
    parse_address,
)

UNTAGGED = Framing(1 << 16)
TAGGED = Framing(1 << 16, tags=b"OM")
WAIT_S = 10.0  # a bound on waiting for another thread, never a timing assertion


class Pieces:
    """A socket whose ``recv`` hands out ``data`` in the given piece sizes, then end of
    stream: a frame split across reads exactly where the test says."""

    def __init__(self, data: bytes, sizes: list[int]) -> None:
        self.data, self.sizes = data, list(sizes)

    def recv(self, n: int) -> bytes:
        size = min(n, self.sizes.pop(0) if self.sizes else n)
        out, self.data = self.data[:size], self.data[size:]
        return out


def read_all(framing: Framing, data: bytes, sizes: list[int]) -> list[tuple[bytes, bytes]]:
    return list(framing.read(cast(socket.socket, Pieces(data, sizes)), "peer:1"))


# ------------------------------------------------------------------------------- the wire
def test_frames_are_the_connectors_wire_bytes() -> None:
    """SGLang's frames are a u32 length and the body; vLLM's a tag byte before the length."""
    from kvplan.compat.sglang import rounds
    from kvplan.compat.vllm import staging as vstaging

    assert rounds.FRAMING.pack(b"abc") == struct.pack("<I", 3) + b"abc"
    assert rounds.SocketChannel.MAX_MESSAGE == 1 << 28
    assert vstaging.FRAMING.pack(b"abc", b"O") == struct.pack("<cI", b"O", 3) + b"abc"
    assert vstaging.FRAMING.pack(b"", b"M") == b"M\0\0\0\0"
    assert vstaging.FRAMING.max_frame == vstaging.MAX_OPEN_BYTES


@pytest.mark.parametrize("framing, tag", [(UNTAGGED, b""), (TAGGED, b"M")])
def test_frames_split_across_reads_arrive_whole(framing: Framing, tag: bytes) -> None:
    bodies = [b"x" * 300, b"", b"hello", bytes(range(256)) * 3]
    tags = [tag, tag, tag, b"O" if tag else b""]
    wire = b"".join(framing.pack(b, t) for b, t in zip(bodies, tags))
    # one byte at a time, then in uneven pieces that cut headers and bodies
    assert read_all(framing, wire, [1] * len(wire)) == list(zip(tags, bodies))
    assert read_all(framing, wire, [3, 7, 2, 500, 1, 9, 4]) == list(zip(tags, bodies))


def test_zero_length_frames_over_tcp() -> None:
    got: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
    listener = FrameListener("127.0.0.1", TAGGED, lambda conn, tag, body: got.put((tag, body)))
    try:
        conn = FrameConnection.connect(listener.address, TAGGED, timeout_s=5)
        conn.send(b"", b"O")
        conn.send(b"after", b"M")
        assert got.get(timeout=WAIT_S) == (b"O", b"")
        assert got.get(timeout=WAIT_S) == (b"M", b"after")
        conn.close()
    finally:
        listener.close()


# ------------------------------------------------------------------------------- errors
def test_channel_error_is_a_kvplan_error_and_a_connection_error() -> None:
    err = ChannelError.make("h:1", "closed", "gone")
    assert isinstance(err, KvPlanError) and isinstance(err, ConnectionError)
    assert err.kind == "channel" and "h:1" in str(err)
    assert set(CHANNEL_REASONS) >= {"short_read", "oversized", "bad_tag", "closed",
                                     "unreachable", "bad_address"}


def test_oversized_frame_refused_on_send_and_on_read() -> None:
    small = Framing(8)
    with pytest.raises(ChannelError) as sent:
        small.pack(b"123456789", peer="10.0.0.2:7000")
    e = sent.value
    assert (e.reason, e.peer, e.expected, e.limit) == ("oversized", "10.0.0.2:7000", 9, 8)
    assert "9 bytes" in str(e) and "8" in str(e)
    assert small.pack(b"12345678") == struct.pack("<I", 8) + b"12345678"  # the limit itself
    with pytest.raises(ChannelError) as read:
        read_all(small, struct.pack("<I", 1 << 20) + b"x" * 16, [64])
    e = read.value
    assert (e.reason, e.peer, e.expected, e.limit) == ("oversized", "peer:1", 1 << 20, 8)


@pytest.mark.parametrize("framing, tag", [(UNTAGGED, b""), (TAGGED, b"M")])
def test_peer_closing_mid_frame_is_a_short_read(framing: Framing, tag: bytes) -> None:
    frame = framing.pack(b"0123456789", tag)
    head = framing.header.size
    with pytest.raises(ChannelError) as body:
        read_all(framing, frame[:head + 4], [2, 100])
    e = body.value
    assert (e.reason, e.peer, e.expected, e.received) == ("short_read", "peer:1", 10, 4)
    assert "4 of the 10 bytes" in str(e)
    with pytest.raises(ChannelError) as header:
        read_all(framing, frame[:head - 1], [100])
    assert (header.value.expected, header.value.received) == (head, head - 1)
    # a close between frames is the end of the stream, not an error
    assert read_all(framing, frame, [100]) == [(tag, b"0123456789")]


def test_unknown_tags_are_refused() -> None:
    with pytest.raises(ChannelError) as read:
        read_all(TAGGED, struct.pack("<cI", b"X", 3) + b"abc", [100])
    assert read.value.reason == "bad_tag" and "b'X'" in str(read.value)
    for framing, tag in ((TAGGED, b"X"), (TAGGED, b""), (UNTAGGED, b"M")):
        with pytest.raises(ChannelError) as sent:
            framing.pack(b"abc", tag)
        assert sent.value.reason == "bad_tag"


def test_bad_address_and_unreachable_peer() -> None:
    assert parse_address("10.1.2.3:8000") == ("10.1.2.3", 8000)
    for address in ("nohost", ":80", "host:", "host:port"):
        with pytest.raises(ChannelError) as bad:
            parse_address(address)
        assert bad.value.reason == "bad_address" and address in str(bad.value)
    free = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{free.getsockname()[1]}"
    free.close()  # nothing listens there now
    with pytest.raises(ChannelError) as gone:
        FrameConnection.connect(address, UNTAGGED, timeout_s=5)
    assert gone.value.reason == "unreachable" and gone.value.peer == address


def test_closed_peer_fails_the_send_and_ends_the_reader() -> None:
    accepted: queue.Queue[FrameConnection] = queue.Queue()
    closes: queue.Queue[Any] = queue.Queue()

    def on_frame(conn: FrameConnection, tag: bytes, body: bytes) -> None:
        accepted.put(conn)

    listener = FrameListener("127.0.0.1", UNTAGGED, on_frame)
    conn = FrameConnection.connect(listener.address, UNTAGGED, timeout_s=5,
                                   on_frame=lambda tag, body: None, on_close=closes.put)
    conn.send(b"hi")
    accepted.get(timeout=WAIT_S)
    listener.close()  # closes the accepted connection too: the client's reader ends cleanly
    assert closes.get(timeout=WAIT_S) is None
    assert conn.closed and conn.error is None
    with pytest.raises(ChannelError) as after:
        conn.send(b"x" * 5)
    e = after.value
    assert e.reason == "closed" and e.peer == listener.address and "5 bytes" in str(e)
    assert isinstance(e, OSError)  # what code catching a failed socket call expects


def test_listener_drops_a_connection_that_announces_an_oversized_frame() -> None:
    ended: queue.Queue[ChannelError | None] = queue.Queue()
    got: list[bytes] = []
    listener = FrameListener("127.0.0.1", Framing(16), lambda c, t, b: got.append(b),
                             lambda conn, error: ended.put(error))
    try:
        host, port = parse_address(listener.address)
        with socket.create_connection((host, port), timeout=5) as raw:
            raw.sendall(struct.pack("<I", 4) + b"good" + struct.pack("<I", 17) + b"x" * 17)
            error = ended.get(timeout=WAIT_S)
            assert raw.recv(1) == b""  # the listener closed its end
        assert got == [b"good"]
        assert isinstance(error, ChannelError)
        assert (error.reason, error.expected, error.limit) == ("oversized", 17, 16)
    finally:
        listener.close()


def test_a_failing_handler_does_not_end_the_connection() -> None:
    got: queue.Queue[bytes] = queue.Queue()

    def on_frame(conn: FrameConnection, tag: bytes, body: bytes) -> None:
        if body == b"bad":
            raise RuntimeError("handler failed")
        got.put(body)

    listener = FrameListener("127.0.0.1", UNTAGGED, on_frame)
    try:
        conn = FrameConnection.connect(listener.address, UNTAGGED, timeout_s=5)
        for body in (b"one", b"bad", b"two"):
            conn.send(body)
        assert [got.get(timeout=WAIT_S) for _ in range(2)] == [b"one", b"two"]
        conn.close()
    finally:
        listener.close()


# ------------------------------------------------------------------------------- concurrency
def test_concurrent_senders_never_interleave_frames_and_replies_come_back() -> None:
    """Four threads send on one connection; every frame arrives whole, each sender's in
    order, and the listener's replies on the same connection reach the client's reader."""
    senders, per_sender = 4, 150
    received: list[bytes] = []
    replies: queue.Queue[bytes] = queue.Queue()

    def on_frame(conn: FrameConnection, tag: bytes, body: bytes) -> None:
        received.append(body)
        if len(received) == senders * per_sender:
            conn.send(b"all", b"M")

    listener = FrameListener("127.0.0.1", TAGGED, on_frame)
    try:
        conn = FrameConnection.connect(listener.address, TAGGED, timeout_s=5,
                                       on_frame=lambda tag, body: replies.put(tag + body))

        def send(k: int) -> None:
            for i in range(per_sender):
                # bodies of different lengths, so an interleaved frame would not parse
                conn.send(f"{k}:{i}:".encode() + bytes([k]) * (i * 37 % 4000), b"M")

        threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert replies.get(timeout=WAIT_S) == b"Mall"
        for k in range(senders):
            mine = [b for b in received if b.startswith(f"{k}:".encode())]
            assert [int(b.split(b":")[1]) for b in mine] == list(range(per_sender))
            for b in mine:
                i = int(b.split(b":")[1])
                assert b.split(b":", 2)[2] == bytes([k]) * (i * 37 % 4000)
        conn.close()
    finally:
        listener.close()
