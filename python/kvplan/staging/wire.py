"""The round protocol's messages: a fixed 24-byte little-endian header, the request id (UTF-8)
and a payload (a round's ``RoundManifest.to_bytes()``, or a failure's reason).

=====  ======  =====================================================================
bytes  field   meaning
=====  ======  =====================================================================
0-2    magic   ``b"KVS"``
3      proto   :data:`kvplan.staging.negotiation.PROTOCOL_VERSION`
4      kind    1 round written, 2 round scattered (the ack), 3 failed, 4 the decode
               arena's share is this stream's (the grant)
5      -       0
6-7    writer  the prefill writer's index in the decode arena (0 when alone)
8-11   round   round index (``0xFFFFFFFF``: none, a failure before the first round)
12-15  rounds  the request's round count
16-17  buffer  the round buffer the round was written into
18-19  idlen   bytes of the request id
20-23  paylen  bytes of the payload
=====  ======  =====================================================================
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvplan._core import KvPlanError
from kvplan.staging.negotiation import PROTOCOL_VERSION

__all__ = ["ACK", "FAIL", "GRANT", "ROUND", "Message", "WireError", "check_stream", "decode",
           "encode"]

ROUND, ACK, FAIL, GRANT = 1, 2, 3, 4
KIND_NAMES = {ROUND: "round", ACK: "ack", FAIL: "fail", GRANT: "grant"}
MAGIC = b"KVS"
NO_ROUND = 0xFFFFFFFF
_HEADER = struct.Struct("<3sBBBHIIHHI")
#: A payload larger than this is not a manifest or a reason.
MAX_PAYLOAD = 1 << 16


class WireError(KvPlanError):
    """Bytes that are not a message of this protocol version (the receiver fails the stream
    with reason ``bad_message``), or a stream name the header cannot carry."""

    kind = "staging"


def check_stream(request: str, writer: int) -> None:
    """Refuse a request id or writer index a message cannot carry (before any byte moves).

    Raises:
        WireError: a request id of more than 65,535 UTF-8 bytes, or a writer outside
            0..65,535 (both named).
    """
    if not isinstance(request, str) or len(request.encode(errors="replace")) > 0xFFFF:
        shown = request[:40] if isinstance(request, str) else request
        raise WireError(f"request id {shown!r}... is not a string of at most 65535 UTF-8 "
                        "bytes")
    if isinstance(writer, bool) or not isinstance(writer, int) or not 0 <= writer <= 0xFFFF:
        raise WireError(f"writer {writer!r} is not an integer from 0 to 65535")


@dataclass(frozen=True)
class Message:
    kind: int
    request: str
    writer: int
    round: int | None
    n_rounds: int
    buffer: int
    payload: bytes

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, str(self.kind))


def encode(kind: int, request: str, *, writer: int = 0, round_index: int | None = None,
           n_rounds: int = 0, buffer: int = 0, payload: bytes = b"") -> bytes:
    check_stream(request, writer)
    rid = request.encode()
    if kind not in KIND_NAMES or len(payload) > MAX_PAYLOAD:
        raise WireError(f"cannot encode a {kind} message of a {len(rid)}-byte request id and a "
                        f"{len(payload)}-byte payload")
    head = _HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, 0, writer,
                        NO_ROUND if round_index is None else round_index, n_rounds, buffer,
                        len(rid), len(payload))
    return head + rid + bytes(payload)


def decode(data: bytes) -> Message:
    """Parse one message.

    Raises:
        WireError: short, of another magic or protocol version, an unknown kind, or lengths
            that do not add up.
    """
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise WireError(f"{len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, proto, kind, _, writer, rnd, n_rounds, buffer, idlen, paylen = \
        _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"magic {magic!r}, not {MAGIC!r}")
    if proto != PROTOCOL_VERSION:
        raise WireError(f"protocol version {proto}, not {PROTOCOL_VERSION}")
    if kind not in KIND_NAMES:
        raise WireError(f"unknown message kind {kind}")
    if _HEADER.size + idlen + paylen != len(data):
        raise WireError(f"{len(data)} bytes, the header says {_HEADER.size + idlen + paylen}")
    try:
        request = data[_HEADER.size:_HEADER.size + idlen].decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"request id is not UTF-8: {exc}") from None
    return Message(kind, request, writer, None if rnd == NO_ROUND else rnd, n_rounds, buffer,
                   data[_HEADER.size + idlen:])


def request_of(data: bytes) -> tuple[str, int] | None:
    """``(request, writer)`` of a message, without checking the rest (None when unreadable):
    how a router finds the stream a message belongs to."""
    try:
        m = decode(data)
    except WireError:
        return None
    return m.request, m.writer
