"""The round protocol's messages: a fixed 24-byte little-endian header, the request id (UTF-8)
and a payload (a round's ``RoundManifest.to_bytes()``, or a failure's reason).

=====  ======  =====================================================================
bytes  field   meaning
=====  ======  =====================================================================
0-2    magic   ``b"KVS"``
3      proto   :data:`kvplan.staging.negotiation.PROTOCOL_VERSION`
4      kind    1 round written, 2 round scattered (the ack), 3 failed
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

from kvplan.staging.negotiation import PROTOCOL_VERSION

__all__ = ["ACK", "FAIL", "ROUND", "Message", "WireError", "decode", "encode"]

ROUND, ACK, FAIL = 1, 2, 3
KIND_NAMES = {ROUND: "round", ACK: "ack", FAIL: "fail"}
MAGIC = b"KVS"
NO_ROUND = 0xFFFFFFFF
_HEADER = struct.Struct("<3sBBBHIIHHI")
#: A payload larger than this is not a manifest or a reason.
MAX_PAYLOAD = 1 << 16


class WireError(ValueError):
    """Bytes that are not a message of this protocol version (the receiver fails the stream
    with reason ``bad_message``)."""


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
    rid = request.encode()
    if kind not in KIND_NAMES or len(rid) > 0xFFFF or len(payload) > MAX_PAYLOAD:
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
