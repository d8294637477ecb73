"""The one error a staged transfer fails with."""

from __future__ import annotations

from kvplan._core import KvPlanError

__all__ = ["StagingError", "REASONS"]

#: What can fail a staged request, as :attr:`StagingError.reason` names it.
REASONS = (
    "engine_failed",      # the transfer engine refused or failed a round's network write
    "gather_failed",      # the prefill's local copy into its arena raised
    "scatter_failed",     # the decode's local copy out of its arena raised
    "manifest_mismatch",  # a round's manifest differs from what the decode planned
    "out_of_order",       # a round arrived other than next, or for a buffer it may not use
    "bad_message",        # a notification that is not a staging message of this protocol
    "timeout",            # no progress within the staging timeout
    "peer_failed",        # the other side reported its own failure
    "peer_gone",          # the other side disconnected or could not be notified
    "cancelled",          # the engine aborted the request
    "not_held",           # the prefill no longer holds the request's blocks (freed, expired)
    "pages_mismatch",     # the stream names pages that are not the prefill's for the request
)


class StagingError(KvPlanError):
    """A staged transfer failed: ``request`` names the request, ``round`` the round index
    (``None`` before the first round), ``reason`` one of :data:`REASONS`, ``writer`` the
    prefill writer index of the stream and ``detail`` the specifics (statuses, the fields that
    differ). Raised, or handed to the failure callback, exactly once per request stream; no
    byte of a failed request is reported loaded."""

    kind = "staging"
    request: str = ""
    round: int | None = None
    reason: str = ""
    writer: int = 0
    detail: str = ""

    @classmethod
    def make(cls, request: str, round_index: int | None, reason: str, detail: str, *,
             writer: int = 0) -> StagingError:
        where = "before its first round" if round_index is None else f"in round {round_index}"
        who = f"request {request!r}" + (f" (writer {writer})" if writer else "")
        err = cls(f"staged transfer of {who} failed {where}: {reason}: {detail}")
        err.request, err.round, err.reason, err.writer, err.detail = (
            request, round_index, reason, writer, detail)
        return err
