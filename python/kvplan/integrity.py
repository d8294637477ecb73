"""Integrity manifests: the prefill says what it planned and sent, the decode checks it.

The prefill builds a :class:`Manifest` after its transfer (``side="src"``: the bytes it sent)
and ships :meth:`Manifest.to_bytes` with its completion notification. The decode, which knows
both layouts and both page lists, builds its own manifest of the same plan over what landed in
its memory (``side="dst"``) and calls :func:`verify`, which raises :class:`IntegrityError`
naming the first thing that differs: a layout fingerprint, a page list, the pair or block
count, the plan itself, or the bytes (with the template and the layer and role of the first
pair whose bytes differ). Every digest is computed by the native core (docs/integrity.md).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import numpy as np
import numpy.typing as npt

from kvplan._core import (
    BatchPlan,
    KvPlanError,
    Layout,
    Template,
    TransferPlan,
    combine_pair_digests,
    index_digest,
)
from kvplan.leases import Lease, LeaseError, LeaseTable, check_epoch

__all__ = [
    "BatchVerdict",
    "IntegrityError",
    "build_batch_manifests",
    "check_batch",
    "Manifest",
    "build_manifest",
    "check_notification",
    "is_notification",
    "pack_notification",
    "read_notification",
    "read_work",
    "template_label",
    "unpack_notification",
    "verify",
]

_MAGIC = b"KVPM"
_VERSION = 1
#: Version 2 carries the destination's lease after the pair digests (flag bit 0).
_VERSION_LEASE = 2
_FLAG_LEASE = 1
_HEAD = struct.Struct("<4sHH9QI")
_Pages = npt.NDArray[np.int32] | npt.NDArray[np.int64] | int
if TYPE_CHECKING:  # typing_extensions is a type checker's dependency, not the wheel's
    from typing_extensions import Buffer

    _Buffer = Buffer | npt.NDArray[np.generic]


class IntegrityError(KvPlanError):
    """The decode's digests disagree with the prefill's.

    ``what`` is one of ``"lease"``, ``"layout"``, ``"pages"``, ``"pairs"``, ``"blocks"``,
    ``"plan"``, ``"content"``, ``"plans"`` (a payload with another number of manifests) or
    ``"request"`` (a batch request the decode cannot plan, :func:`check_batch`); ``template`` names the (prefill, decode) rank pair; for ``"content"``,
    ``pair``, ``layer`` and ``role`` name the first entry pair whose bytes differ and
    ``bad_pairs`` counts the pairs that differ.
    """

    what: str = ""
    template: str = ""
    pair: int | None = None
    layer: int | None = None
    role: str | None = None
    bad_pairs: int = 0


@dataclass(frozen=True)
class Manifest:
    """What one side planned and the digest of the bytes it read through that plan.

    ``lease``: the destination's lease the plan was made for (:mod:`kvplan.leases`); the
    ``plan_digest`` is then the leased digest, bound to that allocation."""

    src_fingerprint: int
    dst_fingerprint: int
    src_pages_digest: int
    dst_pages_digest: int
    n_pairs: int
    n_blocks: int
    total_bytes: int
    plan_digest: int
    content_digest: int
    pair_digests: tuple[int, ...]
    lease: Lease | None = None

    def to_bytes(self) -> bytes:
        """Little-endian: magic ``KVPM``, version u16, flags u16, nine u64 fields in
        declaration order, the pair count u32, then one u64 per pair digest; with a lease,
        version 2, flag bit 0, and :meth:`kvplan.leases.Lease.to_bytes` after the digests
        (version 1, without a lease, is what older builds write and read)."""
        leased = self.lease is not None
        head = _HEAD.pack(
            _MAGIC,
            _VERSION_LEASE if leased else _VERSION,
            _FLAG_LEASE if leased else 0,
            self.src_fingerprint,
            self.dst_fingerprint,
            self.src_pages_digest,
            self.dst_pages_digest,
            self.n_pairs,
            self.n_blocks,
            self.total_bytes,
            self.plan_digest,
            self.content_digest,
            len(self.pair_digests),
        )
        tail = self.lease.to_bytes() if self.lease is not None else b""
        return head + struct.pack(f"<{len(self.pair_digests)}Q", *self.pair_digests) + tail

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Decodes :meth:`to_bytes`; anything else raises :class:`KvPlanError`."""
        data = bytes(data)
        if len(data) < _HEAD.size or data[:4] != _MAGIC:
            raise KvPlanError(
                f"not a kvplan integrity manifest ({len(data)} bytes, starting {data[:4]!r})"
            )
        _, version, flags, *fields, count = _HEAD.unpack_from(data)
        if (version, flags) not in ((_VERSION, 0), (_VERSION_LEASE, _FLAG_LEASE)):
            raise KvPlanError(
                f"integrity manifest version {version} flags {flags:#x}; this build reads "
                f"version {_VERSION} with flags 0 and version {_VERSION_LEASE} with flags "
                f"{_FLAG_LEASE:#x}"
            )
        end = _HEAD.size + 8 * count
        lease = None
        if flags & _FLAG_LEASE and end <= len(data):
            lease, lease_end = Lease.read(data, end)
        else:
            lease_end = end
        if len(data) != lease_end:
            raise KvPlanError(
                f"integrity manifest announces {count} pair digests"
                f"{' and a lease' if lease else ''} but carries {len(data) - _HEAD.size} bytes "
                f"after its header ({lease_end - _HEAD.size} expected)"
            )
        pairs = struct.unpack_from(f"<{count}Q", data, _HEAD.size)
        names = [f for f in cls.__dataclass_fields__ if f not in ("pair_digests", "lease")]
        return cls(**dict(zip(names, fields, strict=True)), pair_digests=tuple(pairs),
                   lease=lease)


def _pages_digest(pages: _Pages) -> int:
    if isinstance(pages, int):
        pages = np.array([pages], dtype=np.int64)
    return index_digest(pages)


def build_manifest(
    plan: TransferPlan,
    side: Literal["src", "dst"],
    buffers: Iterable[_Buffer],
    *,
    src_pages: _Pages,
    dst_pages: _Pages,
    lease: Lease | None = None,
) -> Manifest:
    """The manifest of ``plan`` (planned from ``src_pages`` to ``dst_pages``, page arrays or,
    for a state plan, the two slots) with the content read on ``side`` from ``buffers``;
    ``lease``: the destination's lease the plan was made for, carried and digested."""
    src_fp, dst_fp = plan.layout_fingerprints
    pairs = plan.pair_content_digests(side, buffers)
    return Manifest(
        src_fingerprint=src_fp,
        dst_fingerprint=dst_fp,
        src_pages_digest=_pages_digest(src_pages),
        dst_pages_digest=_pages_digest(dst_pages),
        n_pairs=plan.n_pairs,
        n_blocks=plan.n_blocks,
        total_bytes=plan.total_bytes,
        plan_digest=plan.digest(lease=lease),
        content_digest=combine_pair_digests(pairs),
        pair_digests=tuple(int(d) for d in pairs),
        lease=lease,
    )


def template_label(src_layout: Layout, dst_layout: Layout) -> str:
    """``prefill pp 0/2 tp 1/4 -> decode pp 0/1 tp 0/2``: the rank pair a template serves."""

    def ranks(layout: Layout) -> str:
        return f"pp {layout.pp_rank}/{layout.pp_size} tp {layout.tp_rank}/{layout.tp_size}"

    return f"prefill {ranks(src_layout)} -> decode {ranks(dst_layout)}"


def _fail(message: str, what: str, template: str, **attrs: object) -> IntegrityError:
    error = IntegrityError(f"integrity check failed for {template}: {message}")
    error.what = what
    error.template = template
    for name, value in attrs.items():
        setattr(error, name, value)
    return error


def _lease_text(lease: Lease | None) -> str:
    return "none" if lease is None else f"request {lease.request!r} epoch {lease.epoch}"


def verify(
    received: Manifest | bytes,
    expected: Manifest,
    *,
    template: Template,
    src_layout: Layout,
    dst_layout: Layout,
    state: bool = False,
) -> None:
    """Compares the prefill's manifest (``received``) with the decode's own (``expected``,
    from :func:`build_manifest` over ``side="dst"``) for the plan ``template`` built between
    ``src_layout`` and ``dst_layout`` (``state=True`` for a state plan). Raises
    :class:`IntegrityError` naming the first difference, checked in the order an operator
    needs them: the lease, the layouts, the page lists, the pair and block counts, the plan,
    the bytes."""
    sent = received if isinstance(received, Manifest) else Manifest.from_bytes(received)
    label = template_label(src_layout, dst_layout)
    if sent.lease != expected.lease:
        raise _fail(
            f"the prefill planned for lease {_lease_text(sent.lease)}, the decode's pages are "
            f"held by {_lease_text(expected.lease)} (a writer for another allocation of "
            f"these pages: an aborted request's late writer, or pages reallocated)",
            "lease",
            label,
        )
    for side, a, b in (
        ("prefill", sent.src_fingerprint, expected.src_fingerprint),
        ("decode", sent.dst_fingerprint, expected.dst_fingerprint),
    ):
        if a != b:
            raise _fail(
                f"the {side} layout fingerprint differs: the prefill planned with {a:016x}, "
                f"the decode holds {b:016x} (the two sides use different versions of the "
                f"{side} layout: re-run the handshake)",
                "layout",
                label,
            )
    for side, a, b in (
        ("prefill (src)", sent.src_pages_digest, expected.src_pages_digest),
        ("decode (dst)", sent.dst_pages_digest, expected.dst_pages_digest),
    ):
        if a != b:
            raise _fail(
                f"the {side} page list differs: digest {a:016x} at the prefill, {b:016x} at "
                f"the decode (pages sent for another request, or reallocated)",
                "pages",
                label,
            )
    if sent.n_pairs != expected.n_pairs:
        raise _fail(
            f"the prefill planned {sent.n_pairs} entry pairs, the decode {expected.n_pairs}",
            "pairs",
            label,
        )
    if sent.n_blocks != expected.n_blocks:
        raise _fail(
            f"the prefill planned {sent.n_blocks} blocks ({sent.total_bytes} bytes), the "
            f"decode {expected.n_blocks} ({expected.total_bytes} bytes)",
            "blocks",
            label,
        )
    if sent.plan_digest != expected.plan_digest:
        raise _fail(
            f"same layouts, pages and block count but different blocks: plan digest "
            f"{sent.plan_digest:016x} at the prefill, {expected.plan_digest:016x} at the decode "
            f"(the two sides planned with different pairing options or kvplan versions)",
            "plan",
            label,
        )
    if (
        sent.content_digest == expected.content_digest
        and sent.pair_digests == expected.pair_digests
    ):
        return
    bad = [p for p, (a, b) in enumerate(zip(sent.pair_digests, expected.pair_digests)) if a != b]
    if not bad:
        raise _fail(
            f"content digest {sent.content_digest:016x} at the prefill, "
            f"{expected.content_digest:016x} at the decode",
            "content",
            label,
        )
    pair = bad[0]
    pairs = template.state_pairs if state else template.pairs
    dst_entry = int(pairs[pair][1])
    ids = dst_layout.layer_ids
    roles = dst_layout.roles
    layer = None if ids is None else ids[dst_entry]
    role = None if roles is None else roles[dst_entry]
    raise _fail(
        f"the bytes of {len(bad)} of {sent.n_pairs} entry pairs differ; first: "
        f"{'state ' if state else ''}pair {pair} (layer {layer}, role {role}, decode entry "
        f"{dst_entry}): {sent.pair_digests[pair]:016x} sent, {expected.pair_digests[pair]:016x} "
        f"landed",
        "content",
        label,
        pair=pair,
        layer=layer,
        role=role,
        bad_pairs=len(bad),
    )


_NOTIFY_MAGIC = b"KVPN"
_NOTIFY_VERSION = 2
#: Version 3 adds a work record after the message (layer-wise streaming's expected work).
_NOTIFY_VERSION_WORK = 3
_NOTIFY_HEAD = struct.Struct("<4sHH")
_NOTIFY_MESSAGE = struct.Struct("<I")


def pack_notification(manifests: Sequence[Manifest], message: bytes = b"",
                      work: bytes = b"") -> bytes:
    """The bytes a prefill sends with its completion notification (NIXL) or through its own
    side channel (Mooncake): magic ``KVPN``, version u16 (2), count u16, the length u32 and
    bytes of ``message`` (the caller's own completion message, empty by default), then per
    manifest a u32 length and :meth:`Manifest.to_bytes` (the page plan's first, then the
    state plan's). Version 1, still read, had no message.

    ``work``: a streamed request's work record (:mod:`kvplan.engines.streaming`: its
    expected-work manifest and the slices the prefill sent), carried after the message as a
    u32 length and its bytes; the version is then 3."""
    message, work = bytes(message), bytes(work)
    version = _NOTIFY_VERSION_WORK if work else _NOTIFY_VERSION
    parts = [_NOTIFY_HEAD.pack(_NOTIFY_MAGIC, version, len(manifests)),
             _NOTIFY_MESSAGE.pack(len(message)), message]
    if work:
        parts += [_NOTIFY_MESSAGE.pack(len(work)), work]
    for m in manifests:
        data = m.to_bytes()
        parts.append(struct.pack("<I", len(data)) + data)
    return b"".join(parts)


def is_notification(data: bytes) -> bool:
    """Whether ``data`` starts like :func:`pack_notification`'s output."""
    return bytes(data[:4]) == _NOTIFY_MAGIC


def read_notification(data: bytes) -> tuple[bytes, list[Manifest]]:
    """Decodes :func:`pack_notification`: ``(message, manifests)``; anything else raises
    :class:`KvPlanError`."""
    message, _, manifests = _read(data)
    return message, manifests


def read_work(data: bytes) -> bytes:
    """The work record :func:`pack_notification` carried (empty when it carried none)."""
    return _read(data)[1]


def _read(data: bytes) -> tuple[bytes, bytes, list[Manifest]]:
    data = bytes(data)
    if len(data) < _NOTIFY_HEAD.size or not is_notification(data):
        raise KvPlanError(f"not a kvplan integrity notification ({len(data)} bytes)")
    _, version, count = _NOTIFY_HEAD.unpack_from(data)
    at, fields = _NOTIFY_HEAD.size, [b"", b""]
    if version not in (1, _NOTIFY_VERSION, _NOTIFY_VERSION_WORK):
        raise KvPlanError(f"integrity notification version {version}; this build reads 1 to "
                          f"{_NOTIFY_VERSION_WORK}")
    # Version 2: the message; version 3: the message, then the work record.
    for k, what in enumerate(("message", "work record")[: max(0, version - 1)]):
        if at + _NOTIFY_MESSAGE.size > len(data):
            raise KvPlanError(f"integrity notification truncated in its {what} length")
        (n,) = _NOTIFY_MESSAGE.unpack_from(data, at)
        at += _NOTIFY_MESSAGE.size
        if at + n > len(data):
            raise KvPlanError(f"integrity notification announces a {n}-byte {what} but "
                              f"carries {len(data) - at} bytes after it")
        fields[k], at = data[at:at + n], at + n
    message, work = fields
    out = []
    for _ in range(count):
        if at + 4 > len(data):
            raise KvPlanError("integrity notification truncated")
        (n,) = struct.unpack_from("<I", data, at)
        out.append(Manifest.from_bytes(data[at + 4 : at + 4 + n]))
        at += 4 + n
    if at != len(data):
        raise KvPlanError(f"integrity notification has {len(data) - at} trailing bytes")
    return message, work, out


def unpack_notification(data: bytes) -> list[Manifest]:
    """The manifests of :func:`pack_notification`'s output (see :func:`read_notification`)."""
    return read_notification(data)[1]


def check_notification(
    payload: bytes | Sequence[Manifest],
    *,
    src_layout: Layout,
    dst_layout: Layout,
    buffers: Iterable[_Buffer],
    src_pages: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    dst_pages: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    src_slot: int | None = None,
    dst_slot: int | None = None,
    n_tokens: int | None = None,
    template: Template | None = None,
    lease: Lease | None = None,
    leases: LeaseTable | None = None,
    skip_tokens: int = 0,
) -> list[Manifest]:
    """The decode-side check: re-plans the request from the prefill's layout (as the handshake
    carried it) and its own, digests what landed in ``buffers`` and verifies every manifest of
    ``payload`` (:func:`pack_notification`'s bytes, or the manifests themselves: page plan,
    then state plan when slots are given); raises :class:`IntegrityError` naming what
    differs. Returns the decode's own manifests.

    ``lease``: the decode's lease on ``dst_pages`` for this request; every manifest must carry
    it. ``leases``: the decode's :class:`~kvplan.leases.LeaseTable`; a manifest whose lease it
    does not hold live raises :class:`~kvplan.leases.StaleLeaseError` first, naming the
    requests the stale writer may have overwritten.

    ``skip_tokens``: K for a delta request (the prefill planned ``plan(..., skip_tokens=K)``:
    the decode held the first K tokens already), re-planned the same way; the plan digest
    covers K, so a manifest planned with another K fails as ``what="plan"`` (or on the block
    count)."""
    template = template or Template(src_layout, dst_layout)
    buffers = list(buffers)
    plans: list[tuple[TransferPlan, bool, _Pages, _Pages]] = [
        (template.plan(src_pages, dst_pages, n_tokens=n_tokens, skip_tokens=skip_tokens),
         False, src_pages, dst_pages)
    ]
    if src_slot is not None and dst_slot is not None and len(template.state_pairs):
        plans.append((template.plan_state(src_slot, dst_slot), True, src_slot, dst_slot))
    received = (unpack_notification(bytes(payload))
                if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload))
    label = template_label(src_layout, dst_layout)
    if len(received) != len(plans):
        raise _fail(
            f"the prefill sent {len(received)} plan manifests, the decode planned {len(plans)} "
            f"(page plan{' and state plan' if len(plans) > 1 else ''})",
            "plans",
            label,
        )
    if leases is not None:
        for sent in received:
            if sent.lease is None:
                raise _fail("the prefill's manifest carries no lease, and this decode grants "
                            "its pages under leases", "lease", label)
            leases.check(sent.lease)
    mine = []
    for (plan, state, sp, dp), sent in zip(plans, received, strict=True):
        own = build_manifest(plan, "dst", buffers, src_pages=sp, dst_pages=dp, lease=lease)
        verify(
            sent, own, template=template, src_layout=src_layout, dst_layout=dst_layout, state=state
        )
        mine.append(own)
    return mine


_IndexArray = npt.NDArray[np.int32] | npt.NDArray[np.int64]
#: One request of a batch as :meth:`kvplan.Template.plan_batch` takes it.
BatchRequest = tuple[_IndexArray, _IndexArray] | tuple[_IndexArray, _IndexArray, int | None]


def _split(request: BatchRequest) -> tuple[_IndexArray, _IndexArray, int | None]:
    if len(request) == 3:
        return request[0], request[1], request[2]
    return request[0], request[1], None


def build_batch_manifests(
    batch: BatchPlan,
    template: Template,
    requests: Sequence[BatchRequest],
    side: Literal["src", "dst"],
    buffers: Iterable[_Buffer],
) -> list[Manifest]:
    """One manifest per request of ``batch`` (planned by ``template`` from ``requests``), each
    of the request planned alone (what a decode verifying requests one by one recomputes),
    read on ``side`` from ``buffers`` and carrying the request's lease when the batch was
    planned with ``leases=``. Pack them with :func:`pack_notification` for the decode's
    :func:`check_batch`.

    Raises:
        KvPlanError: ``requests`` are not the batch's, or a request's plan digest differs from
            the one the batch computed for it (the batch was planned from other requests).
    """
    if len(requests) != batch.n_requests:
        raise KvPlanError(f"{len(requests)} requests for a batch of {batch.n_requests}")
    leases = batch.request_leases
    digests = batch.request_digests if leases is not None else None
    held = list(buffers)
    out = []
    for r, request in enumerate(requests):
        src, dst, n_tokens = _split(request)
        # The leases the batch was planned with are the caller's kvplan.Lease objects.
        lease = cast("Lease | None", leases[r] if leases is not None else None)
        plan = template.plan(src, dst, n_tokens=n_tokens)
        manifest = build_manifest(plan, side, held, src_pages=src, dst_pages=dst, lease=lease)
        if digests is not None and manifest.plan_digest != int(digests[r]):
            raise KvPlanError(f"request {r}: its plan digest {manifest.plan_digest:016x} differs "
                              f"from the batch's {int(digests[r]):016x}; pass the requests "
                              f"the batch was planned from")
        out.append(manifest)
    return out


@dataclass(frozen=True)
class BatchVerdict:
    """The decode's check of a batch, request by request: ``errors[r]`` is why request ``r``
    was refused (:class:`IntegrityError`, :class:`kvplan.StaleLeaseError` or
    :class:`kvplan.LeaseError`), every other request verified; ``manifests[r]`` is the
    decode's own manifest of a verified request (``None`` for a refused one)."""

    n_requests: int
    errors: Mapping[int, KvPlanError]
    manifests: tuple[Manifest | None, ...]

    @property
    def ok(self) -> bool:
        """True when every request verified."""
        return not self.errors

    @property
    def failed_requests(self) -> list[int]:
        """Indices of the refused requests, ascending."""
        return sorted(self.errors)

    @property
    def verified_requests(self) -> list[int]:
        """Indices of the verified requests, ascending."""
        return [r for r in range(self.n_requests) if r not in self.errors]


def _request_parts(request: object) -> tuple[_IndexArray, _IndexArray, int | None]:
    if not isinstance(request, tuple) or len(request) not in (2, 3):
        shape = f" of {len(request)}" if isinstance(request, tuple) else ""
        raise TypeError(f"a request is a (src_pages, dst_pages[, n_tokens]) tuple, got "
                        f"{type(request).__name__}{shape}")
    return _split(cast("BatchRequest", request))


def check_batch(
    payload: bytes | Sequence[Manifest],
    *,
    src_layout: Layout,
    dst_layout: Layout,
    buffers: Iterable[_Buffer],
    requests: Sequence[BatchRequest],
    leases: Sequence[Lease | None] | None = None,
    table: LeaseTable | None = None,
    template: Template | None = None,
) -> BatchVerdict:
    """The decode-side check of a batch: ``payload`` holds one manifest per request
    (:func:`build_batch_manifests`, packed or not); each request is checked on its own and
    never fails another.

    Per request, in this order: ``leases[r]`` (the decode's lease on the request's pages, when
    given) against the manifest's lease by :func:`kvplan.leases.check_epoch` (an older epoch of
    the request: :class:`~kvplan.StaleLeaseError` naming the request and both epochs; a newer
    one, an epoch going backwards: :class:`~kvplan.LeaseError`); ``table`` (the decode's
    :class:`~kvplan.LeaseTable`) refuses a lease that is not live there; then the request's
    plan and bytes, as :func:`check_notification`.

    A request the decode cannot re-plan (a page out of range, a negative page, page lists of
    unequal lengths, arrays of the wrong type or shape, not a 2- or 3-tuple) is refused on its
    own: its verdict is an :class:`IntegrityError` with ``what="request"`` naming the request
    and the planner's reason (chained as ``__cause__``); the other requests are checked.

    Raises:
        IntegrityError: the payload does not hold one manifest per request (``what="plans"``):
            nothing can be attributed then.
    """
    template = template or Template(src_layout, dst_layout)
    received = (unpack_notification(bytes(payload))
                if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload))
    label = template_label(src_layout, dst_layout)
    if len(received) != len(requests):
        raise _fail(f"the prefill sent {len(received)} manifests for a batch of "
                    f"{len(requests)} requests", "plans", label)
    if leases is not None and len(leases) != len(requests):
        raise KvPlanError(f"{len(leases)} leases for a batch of {len(requests)} requests")
    held = list(buffers)
    errors: dict[int, KvPlanError] = {}
    mine: list[Manifest | None] = []
    for r, (sent, request) in enumerate(zip(received, requests, strict=True)):
        expected = leases[r] if leases is not None else None
        try:
            src, dst, n_tokens = _request_parts(request)
            if expected is not None:
                if sent.lease is None:
                    raise _fail(f"request {r}: the prefill's manifest carries no lease, and "
                                f"the decode leased its pages to {_lease_text(expected)}",
                                "lease", label)
                check_epoch(sent.lease, expected)
            own = check_notification(
                [sent], src_layout=src_layout, dst_layout=dst_layout, buffers=held,
                src_pages=src, dst_pages=dst, n_tokens=n_tokens, template=template,
                lease=expected if expected is not None else sent.lease, leases=table)
            mine.append(own[0])
        except (IntegrityError, LeaseError) as error:
            error.requests = (r,)
            errors[r] = error
            mine.append(None)
        except (KvPlanError, TypeError, OverflowError) as error:
            # What the planner refuses (pages out of range, unequal lengths, a wrong array)
            # concerns this request alone: its verdict, never the batch's.
            refused = _fail(f"request {r}: the decode cannot plan it: {error}", "request", label)
            refused.__cause__ = error
            refused.requests = (r,)
            errors[r] = refused
            mine.append(None)
    return BatchVerdict(len(requests), errors, tuple(mine))
