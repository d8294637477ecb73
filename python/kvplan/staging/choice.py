"""Staged or direct, per request: :func:`choose_path`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvplan._core import Advice, Request, Template, TransferCost
from kvplan._errors import ConfigError
from kvplan.staging.config import MODES
from kvplan.staging.negotiation import DirectFallback, Negotiated

__all__ = ["PathChoice", "choose_path"]


@dataclass(frozen=True)
class PathChoice:
    """``path`` for one request, ``why`` in words, and ``advice`` when
    ``Template.transfer_advice`` was asked."""

    path: Literal["staged", "direct"]
    why: str
    advice: Advice | None = None

    @property
    def staged(self) -> bool:
        return self.path == "staged"


def choose_path(template: Template, request: Request | tuple[Any, Any],
                costs: TransferCost | None, agreement: Negotiated | None, *,
                mode: str = "auto") -> PathChoice:
    """Staged or direct for ``request`` (a ``kvplan.Request`` or ``(src_pages, dst_pages)``).

    Direct when there is no agreement with the peer (its :class:`DirectFallback` reason is
    the why) or ``mode`` is ``"off"``; staged wherever agreed with ``mode="always"``; otherwise
    (``"auto"``) what ``template.transfer_advice`` decides with ``costs``, the engine's measured
    :class:`kvplan.TransferCost` (:func:`kvplan.engines.measure_cost`); without costs, direct.

    Raises:
        As ``Template.transfer_advice`` for a request it refuses (IndexBoundsError,
        KvPlanError, TypeError); :class:`kvplan.ConfigError` for a ``mode`` that is not auto,
        always or off.
    """
    if mode not in MODES:
        err = ConfigError(f"choose_path: mode={mode!r}: one of {', '.join(MODES)} is required")
        err.option, err.value, err.known = "mode", mode, MODES
        raise err
    if agreement is None:
        return PathChoice("direct", "no staging negotiated with the peer")
    if isinstance(agreement, DirectFallback):
        return PathChoice("direct", agreement.reason)
    if mode == "off":
        return PathChoice("direct", "staging is off")
    if mode == "always":
        return PathChoice("staged", "staging is always used where agreed")
    if costs is None:
        return PathChoice("direct", "no measured engine costs to advise with")
    if isinstance(request, Request):
        advice = template.transfer_advice(request, cost=costs)
    else:
        src, dst = request
        advice = template.transfer_advice(src, dst, costs)
    why = (f"{advice.choice}: direct {advice.direct_blocks} blocks ~{advice.direct_s * 1e3:.3g} "
           f"ms, staged {advice.staged_blocks} blocks ~{advice.staged_s * 1e3:.3g} ms")
    return PathChoice(advice.choice, why, advice)
