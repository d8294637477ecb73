"""kvplan's own side channel for the round protocol: length-framed messages over TCP.

The engines' side channels cannot carry kvplan's messages (vLLM's Mooncake channel decodes
every frame as one of its msgspec messages; SGLang's bootstrap socket parses its messages by
position), so the connectors open a connection of their own. One frame is an optional tag byte
(:attr:`Framing.tags`: vLLM's connector tells an opening message from a round message by it),
the body's length as a little-endian ``u32``, and the body. A frame of more than
:attr:`Framing.max_frame` bytes is refused on both ends.

* :class:`FrameConnection`: one connection; whole frames out under a lock (any thread may
  send), and optionally a reader thread handing each frame to a callback in arrival order.
* :class:`FrameListener`: a TCP listener; each accepted connection a :class:`FrameConnection`
  read on its own thread.
* :class:`ChannelError`: why a connection failed (short read, oversized frame, unknown tag,
  closed or unreachable peer), naming the peer and the byte counts.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvplan._core import KvPlanError

__all__ = ["CHANNEL_REASONS", "ChannelError", "FrameConnection", "FrameListener", "Framing",
           "join_threads", "parse_address"]

_log = logging.getLogger("kvplan.staging.channel")

#: What a :class:`ChannelError` can be, as :attr:`ChannelError.reason` names it.
CHANNEL_REASONS = (
    "short_read",   # the peer closed the connection inside a frame
    "oversized",    # a frame longer than the framing's limit (sent or announced)
    "bad_tag",      # a tag byte the framing does not know (sent or received)
    "closed",       # the connection is closed, or a send on it failed
    "unreachable",  # connecting to the peer failed
    "bad_address",  # an address that is not ``host:port``
)

# Bytes asked of one ``recv``: a large body arrives in pieces of at most this.
_RECV_CHUNK = 1 << 20
_TAGGED, _UNTAGGED = struct.Struct("<cI"), struct.Struct("<I")


class ChannelError(KvPlanError, ConnectionError):
    """A side-channel connection failed: ``peer`` names the other end (``host:port``),
    ``reason`` one of :data:`CHANNEL_REASONS`; for a short read ``expected`` and ``received``
    are the bytes of the frame part that was being read and how many came; for an oversized
    frame ``expected`` is its length and ``limit`` the framing's. Also a ``ConnectionError``,
    so code that treats a failed socket call as a gone peer treats this one alike."""

    kind = "channel"
    peer: str = ""
    reason: str = ""
    expected: int | None = None
    received: int | None = None
    limit: int | None = None

    @classmethod
    def make(cls, peer: str, reason: str, detail: str, *, expected: int | None = None,
             received: int | None = None, limit: int | None = None) -> ChannelError:
        err = cls(f"kvplan staging channel with {peer}: {reason}: {detail}")
        err.peer, err.reason = peer, reason
        err.expected, err.received, err.limit = expected, received, limit
        return err


@dataclass(frozen=True)
class Framing:
    """How frames are written: ``tags`` the tag bytes a frame may carry before its length
    (empty: frames have no tag), ``max_frame`` the largest body in bytes."""

    max_frame: int
    tags: bytes = b""

    @property
    def header(self) -> struct.Struct:
        return _TAGGED if self.tags else _UNTAGGED

    def pack(self, data: bytes, tag: bytes = b"", *, peer: str = "") -> bytes:
        """One frame of ``data`` (tagged ``tag`` when the framing has tags)."""
        if len(data) > self.max_frame:
            raise ChannelError.make(peer, "oversized",
                                    f"a frame of {len(data)} bytes exceeds {self.max_frame}",
                                    expected=len(data), limit=self.max_frame)
        if self.tags:
            if len(tag) != 1 or tag not in self.tags:
                raise ChannelError.make(peer, "bad_tag", f"tag {tag!r} is not one of "
                                        f"{[bytes([t]) for t in self.tags]}")
            return self.header.pack(tag, len(data)) + data
        if tag:
            raise ChannelError.make(peer, "bad_tag", f"tag {tag!r} on an untagged framing")
        return self.header.pack(len(data)) + data

    def read(self, sock: socket.socket, peer: str) -> Iterator[tuple[bytes, bytes]]:
        """``(tag, body)`` per frame read from ``sock`` (``tag`` empty without tags) until
        the peer closes between frames. Raises :class:`ChannelError` when the peer closes
        inside a frame or announces a frame of an unknown tag or over :attr:`max_frame`;
        ``OSError`` of the socket passes through."""
        header = self.header
        while True:
            head = _read_exact(sock, header.size, peer, "frame header", at_start_ok=True)
            if head is None:
                return
            if self.tags:
                tag, n = header.unpack(head)
                if tag not in self.tags:
                    raise ChannelError.make(peer, "bad_tag",
                                            f"a frame of tag {tag!r} ({n} bytes announced)")
            else:
                (n,) = header.unpack(head)
                tag = b""
            if n > self.max_frame:
                raise ChannelError.make(peer, "oversized",
                                        f"a frame of {n} bytes exceeds {self.max_frame}",
                                        expected=n, limit=self.max_frame)
            body = _read_exact(sock, n, peer, "frame body")
            assert body is not None
            yield tag, body


def _read_exact(sock: socket.socket, n: int, peer: str, what: str, *,
                at_start_ok: bool = False) -> bytes | None:
    """Exactly ``n`` bytes; ``None`` when the peer closed before the first byte and
    ``at_start_ok``, else a short read is a :class:`ChannelError`."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), _RECV_CHUNK))
        if not chunk:
            if not out and at_start_ok:
                return None
            raise ChannelError.make(peer, "short_read",
                                    f"the peer closed after {len(out)} of the {n} bytes of a "
                                    f"{what}", expected=n, received=len(out))
        out += chunk
    return bytes(out)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` as ``(host, port)``; :class:`ChannelError` (``bad_address``) else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ChannelError.make(address, "bad_address", "host:port is required")
    return host, int(port)


OnFrame = Callable[[bytes, bytes], None]
OnClose = Callable[[ChannelError | None], None]


class FrameConnection:
    """One side-channel connection to ``peer``. :meth:`send` writes whole frames under a lock,
    so frames of concurrent senders never interleave. :meth:`read_in_thread` hands each frame
    received to ``on_frame(tag, body)`` in arrival order on a thread of its own (an exception
    of the callback is logged and the next frame read); when reading ends the connection is
    closed and ``on_close`` called once with the :class:`ChannelError` that ended it (``None``:
    the peer or this side closed it between frames)."""

    def __init__(self, sock: socket.socket, peer: str, framing: Framing) -> None:
        self.peer, self.framing = peer, framing
        self._sock = sock
        self._lock = threading.Lock()
        #: Set once the connection ended (closed here, or reading found it closed).
        self.closed = False
        #: What ended reading, when a :class:`ChannelError` did.
        self.error: ChannelError | None = None
        #: The reader thread (:meth:`read_in_thread`), None when read on the caller's.
        self.reader: threading.Thread | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # not TCP (a socketpair in tests): nothing to turn off
            pass

    @classmethod
    def connect(cls, address: str, framing: Framing, *, timeout_s: float,
                on_frame: OnFrame | None = None,
                on_close: OnClose | None = None) -> FrameConnection:
        """Connect to the listener at ``address`` within ``timeout_s``. With ``on_frame`` the
        connection is read on its own thread and blocks without a timeout afterwards; without
        it (a send-only connection) a send that stalls ``timeout_s`` fails. Raises
        :class:`ChannelError` (``bad_address``, ``unreachable``)."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ChannelError.make(address, "unreachable",
                                    f"{type(exc).__name__}: {exc}") from exc
        conn = cls(sock, address, framing)
        if on_frame is not None:
            sock.settimeout(None)
            conn.read_in_thread(on_frame, on_close)
        return conn

    def send(self, data: bytes, tag: bytes = b"") -> None:
        """One frame to the peer. Raises :class:`ChannelError`: ``oversized``, ``bad_tag``,
        or ``closed`` (closed before, or the send failed: the connection is closed then)."""
        frame = self.framing.pack(data, tag, peer=self.peer)
        with self._lock:
            if self.closed:
                raise ChannelError.make(self.peer, "closed",
                                        f"a frame of {len(data)} bytes after the connection "
                                        "closed")
            try:
                self._sock.sendall(frame)
            except OSError as exc:
                self.closed = True
                self._sock.close()
                raise ChannelError.make(self.peer, "closed",
                                        f"sending a frame of {len(data)} bytes failed: "
                                        f"{type(exc).__name__}: {exc}") from exc

    def frames(self) -> Iterator[tuple[bytes, bytes]]:
        """The frames received, read on the calling thread (:meth:`Framing.read`)."""
        return self.framing.read(self._sock, self.peer)

    def read_in_thread(self, on_frame: OnFrame, on_close: OnClose | None = None, *,
                       name: str = "kvplan-staging-channel") -> threading.Thread:
        thread = threading.Thread(target=self._read, args=(on_frame, on_close), name=name,
                                  daemon=True)
        self.reader = thread
        thread.start()
        return thread

    def _read(self, on_frame: OnFrame, on_close: OnClose | None) -> None:
        try:
            for tag, body in self.frames():
                try:
                    on_frame(tag, body)
                except Exception:  # one bad message must not end the connection
                    _log.exception("kvplan staging: a message from %s failed", self.peer)
        except ChannelError as exc:
            self.error = exc
            _log.warning("kvplan staging: dropping the channel: %s", exc)
        except OSError:
            pass  # closed under the reader: a send in flight fails on its own
        finally:
            self.close()
            if on_close is not None:
                on_close(self.error)

    def close(self, join_s: float = 0.0) -> None:
        """Close the connection (a reader thread then ends; waited for up to ``join_s``
        seconds, unless this is that thread); idempotent."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if join_s > 0:
            join_threads([self.reader], join_s)


def join_threads(threads: Iterable[threading.Thread | None], join_s: float) -> None:
    """Wait for ``threads`` to end, all of them within ``join_s`` seconds in total (the
    calling thread, and threads never started, are skipped)."""
    import time

    deadline = time.monotonic() + join_s
    for thread in threads:
        if thread is None or thread is threading.current_thread() or thread.ident is None:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))


class FrameListener:
    """A TCP listener on ``host`` (a free port; :attr:`address` is ``host:port``): each
    accepted connection is a :class:`FrameConnection` read on its own thread, its frames
    handed to ``on_frame(connection, tag, body)`` (replies go back on ``connection``) and,
    when it ends, ``on_close(connection, error)``."""

    def __init__(self, host: str, framing: Framing,
                 on_frame: Callable[[FrameConnection, bytes, bytes], None],
                 on_close: Callable[[FrameConnection, ChannelError | None], None] | None = None,
                 *, name: str = "kvplan-staging-listener") -> None:
        self.framing = framing
        self._on_frame, self._on_close = on_frame, on_close
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._conns: list[FrameConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name=name, daemon=True)
        self._acceptor.start()

    def threads(self) -> list[threading.Thread]:
        """The listener's threads: the accepting one and each open connection's reader."""
        with self._lock:
            readers = [c.reader for c in self._conns if c.reader is not None]
        return [self._acceptor, *readers]

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, where = self._server.accept()
            except OSError:
                return
            conn = FrameConnection(sock, f"{where[0]}:{where[1]}", self.framing)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns = [c for c in self._conns if not c.closed] + [conn]

            def on_frame(tag: bytes, body: bytes, conn: FrameConnection = conn) -> None:
                self._on_frame(conn, tag, body)

            def on_close(error: ChannelError | None, conn: FrameConnection = conn) -> None:
                if self._on_close is not None:
                    self._on_close(conn, error)

            conn.read_in_thread(on_frame, on_close, name="kvplan-staging-conn")

    def close(self, join_s: float = 0.0) -> None:
        """Stop listening and close every accepted connection; with ``join_s``, wait up to
        that long for the accepting thread and the connections' readers to end."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        try:  # wakes the accepting thread (closing alone leaves it blocked on Linux)
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        for conn in conns:
            conn.close()
        if join_s > 0:
            join_threads([self._acceptor, *(c.reader for c in conns)], join_s)
