"""What a kvplan peer says about staging in its handshake, and what two peers agree on.

Each kvplan peer adds :class:`Capabilities` (a small JSON object, :meth:`Capabilities.to_bytes`,
at most :data:`MAX_MESSAGE_BYTES`) to the handshake it already makes: the kvplan version, the
staging protocol version and, per rank it speaks for, its arena (address, size, round buffers,
whether the transfer engine registered it). :func:`negotiate` is a pure function of the two
messages: a :class:`StagingAgreement` when staged transfers can run between them, else a
:class:`DirectFallback` whose reason :class:`FallbackLog` logs once per peer.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Union

from kvplan._core import KvPlanError

__all__ = ["MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "ArenaInfo", "Capabilities",
           "DirectFallback", "FallbackLog", "Negotiated", "StagingAgreement", "negotiate"]

#: Bumped whenever a message of the round protocol (``kvplan.staging.wire``), the meaning of a
#: field here or where the core cuts a request's rounds changes (both peers plan the rounds and
#: the decode checks each arrival against its own plan); peers of different versions use the
#: direct path. 2: every round but a stream's last fills its round buffer (1 ended a round at
#: the last block end within it). 3: the decode arena is shared among the prefill ranks the
#: template's head slicing sends from (one elected holder per replicated head, e.g. one for
#: MLA TP 2 -> 1), not among every staging writer (2 gave that one sender half the arena).
PROTOCOL_VERSION = 3

#: The message's key in a handshake that carries a dict (``Capabilities.to_dict``).
HANDSHAKE_KEY = "kvplan_staging"

#: A capability message longer than this is refused (a handshake field, not a payload).
MAX_MESSAGE_BYTES = 4096


def _bad(message: str) -> KvPlanError:
    err = KvPlanError(f"staging capabilities: {message}")
    err.kind = "staging"
    return err


def _int(raw: dict[str, Any], key: str, low: int = 0) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(f"{key}={value!r}: an integer >= {low} is required")
    return value


@dataclass(frozen=True)
class ArenaInfo:
    """One rank's arena: ``rank`` (the TP rank it belongs to), ``addr`` and ``size`` of the
    memory, ``buffers`` round buffers, ``registered`` with the transfer engine."""

    rank: int
    addr: int
    size: int
    buffers: int
    registered: bool

    @property
    def region(self) -> tuple[int, int]:
        return self.addr, self.size

    @property
    def buffer_bytes(self) -> int:
        return self.size // self.buffers if self.buffers else 0

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "addr": self.addr, "size": self.size,
                "buffers": self.buffers, "registered": self.registered}

    @classmethod
    def from_dict(cls, raw: Any) -> ArenaInfo:
        if not isinstance(raw, dict):
            raise _bad(f"an arena must be an object, got {type(raw).__name__}")
        registered = raw.get("registered")
        if not isinstance(registered, bool):
            raise _bad(f"registered={registered!r}: true or false is required")
        return cls(_int(raw, "rank"), _int(raw, "addr"), _int(raw, "size"),
                   _int(raw, "buffers", 1), registered)


@dataclass(frozen=True)
class Capabilities:
    """A kvplan peer's staging capabilities, as its handshake carries them."""

    kvplan_version: str
    protocol: int = PROTOCOL_VERSION
    arenas: tuple[ArenaInfo, ...] = ()

    @classmethod
    def local(cls, arenas: tuple[ArenaInfo, ...] | list[ArenaInfo] = ()) -> Capabilities:
        """This process's message: the installed kvplan and :data:`PROTOCOL_VERSION`."""
        from kvplan import __version__

        return cls(str(__version__), PROTOCOL_VERSION, tuple(arenas))

    def arena(self, rank: int | None) -> ArenaInfo | None:
        """The arena of ``rank``; with ``None``, the only arena (None when there are several
        or none)."""
        if rank is None:
            return self.arenas[0] if len(self.arenas) == 1 else None
        return next((a for a in self.arenas if a.rank == rank), None)

    def to_dict(self) -> dict[str, Any]:
        return {"kvplan": self.kvplan_version, "protocol": self.protocol,
                "arenas": [a.to_dict() for a in self.arenas]}

    def to_bytes(self) -> bytes:
        data = json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise _bad(f"{len(data)} bytes for {len(self.arenas)} arenas, more than "
                       f"{MAX_MESSAGE_BYTES}")
        return data

    @classmethod
    def from_dict(cls, raw: Any) -> Capabilities:
        """Parse a peer's message. Only ``protocol`` is read strictly first, so a message of
        another protocol version still parses far enough for :func:`negotiate` to name it.

        Raises:
            KvPlanError: ``kind == "staging"``: not a capability message of any version.
        """
        if not isinstance(raw, dict):
            raise _bad(f"an object is required, got {type(raw).__name__}")
        protocol = _int(raw, "protocol", 1)
        version = raw.get("kvplan")
        if not isinstance(version, str):
            raise _bad(f"kvplan={version!r}: a version string is required")
        if protocol != PROTOCOL_VERSION:
            return cls(version, protocol, ())
        arenas = raw.get("arenas")
        if not isinstance(arenas, list):
            raise _bad(f"arenas={arenas!r}: a list is required")
        return cls(version, protocol, tuple(ArenaInfo.from_dict(a) for a in arenas))

    @classmethod
    def from_bytes(cls, data: bytes) -> Capabilities:
        if len(data) > MAX_MESSAGE_BYTES:
            raise _bad(f"{len(data)} bytes, more than {MAX_MESSAGE_BYTES}")
        try:
            raw = json.loads(bytes(data).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise _bad(f"not JSON: {exc}") from None
        return cls.from_dict(raw)


@dataclass(frozen=True)
class StagingAgreement:
    """Staged transfers between a prefill rank and a decode rank: both arenas (the planner's
    ``src_arena`` and ``dst_arena``), the round buffers both use and the peer's kvplan
    version."""

    src_arena: tuple[int, int]
    dst_arena: tuple[int, int]
    buffers: int
    peer_version: str
    staged: bool = field(default=True, init=False)

    @property
    def round_bytes(self) -> int:
        """The largest round: the smaller of the two round buffers."""
        return min(self.src_arena[1], self.dst_arena[1]) // self.buffers


@dataclass(frozen=True)
class DirectFallback:
    """No staged transfers with this peer: today's direct path, and why."""

    reason: str
    staged: bool = field(default=False, init=False)


Negotiated = Union[StagingAgreement, DirectFallback]


def negotiate(local: Capabilities | None, remote: Capabilities | dict[str, Any] | bytes | None,
              *, sending: bool = True, local_rank: int | None = None,
              remote_rank: int | None = None) -> Negotiated:
    """What this peer and ``remote`` agree on, computed alike on both sides.

    ``sending``: this peer is the prefill (its arena is the source). ``local_rank`` /
    ``remote_rank`` pick each side's arena (``None``: the side's only arena). ``remote`` may be
    the peer's raw message (bytes or dict, as the handshake delivered it) or ``None`` when the
    handshake had none: a peer that is not kvplan, or a kvplan without staging.

    The direct path, with the reason, when: staging is off here (``local`` None or no arena)
    or the peer sent no message, a malformed one or one of another protocol version; either
    arena is missing for the rank, unregistered or empty; the two arenas split into different
    numbers of round buffers. Never raises for what the peer sent.
    """
    if local is None:
        return DirectFallback("staging is off on this peer")
    if remote is None:
        return DirectFallback("the peer sent no kvplan staging capabilities (not kvplan, or "
                              "staging off there)")
    if not isinstance(remote, Capabilities):
        try:
            remote = (Capabilities.from_bytes(remote) if isinstance(remote, (bytes, bytearray))
                      else Capabilities.from_dict(remote))
        except KvPlanError as exc:
            return DirectFallback(f"the peer's staging capabilities are malformed: {exc}")
    if remote.protocol != local.protocol:
        return DirectFallback(f"staging protocol {remote.protocol} (kvplan "
                              f"{remote.kvplan_version}) on the peer, {local.protocol} (kvplan "
                              f"{local.kvplan_version}) here")
    mine, theirs = local.arena(local_rank), remote.arena(remote_rank)
    for who, arena, rank, caps in (("this peer", mine, local_rank, local),
                                   ("the peer", theirs, remote_rank, remote)):
        if arena is None:
            ranks = sorted(a.rank for a in caps.arenas)
            want = "its only arena" if rank is None else f"rank {rank}'s arena"
            return DirectFallback(f"{who} has no staging arena for {want} (arenas of ranks "
                                  f"{ranks})")
        if not arena.registered:
            return DirectFallback(f"{who}'s staging arena of rank {arena.rank} is not "
                                  "registered with its transfer engine")
        if arena.addr == 0 or arena.buffer_bytes == 0:
            return DirectFallback(f"{who}'s staging arena of rank {arena.rank} is empty "
                                  f"(addr {arena.addr:#x}, {arena.size} bytes, "
                                  f"{arena.buffers} buffers)")
    assert mine is not None and theirs is not None
    if mine.buffers != theirs.buffers:
        return DirectFallback(f"round buffers differ: {mine.buffers} here, {theirs.buffers} on "
                              "the peer")
    src, dst = (mine, theirs) if sending else (theirs, mine)
    return StagingAgreement(src.region, dst.region, mine.buffers, remote.kvplan_version)


class FallbackLog:
    """Says a peer's direct-path reason once per peer and reason (a handshake repeated with
    the same outcome logs nothing; a new reason for the peer logs again)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger if logger is not None else logging.getLogger("kvplan.staging")
        self._said: dict[str, str] = {}
        self._lock = threading.Lock()

    def note(self, peer: str, outcome: Negotiated) -> bool:
        """Log ``outcome`` for ``peer`` unless already said; True when it logged."""
        said = outcome.reason if isinstance(outcome, DirectFallback) else ""
        with self._lock:
            if self._said.get(peer) == said:
                return False
            self._said[peer] = said
        if isinstance(outcome, DirectFallback):
            self._log.info("kvplan: direct transfers with peer %s: %s", peer, outcome.reason)
        else:
            self._log.info("kvplan: staged transfers with peer %s (%d round buffers of %d "
                           "bytes)", peer, outcome.buffers, outcome.round_bytes)
        return True
