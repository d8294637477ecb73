"""The engine's costs a connector's ``auto`` mode advises with, settled once at start-up:
:func:`startup_costs` (given by the operator, else measured on loopback, else none) and
:func:`loopback_costs` (the measurement, a failure logged)."""

from __future__ import annotations

import logging

from kvplan._core import TransferCost
from kvplan.staging.config import StagingConfig, format_costs

__all__ = ["loopback_costs", "startup_costs"]


def loopback_costs(log: logging.Logger, engine: str = "mooncake") -> TransferCost | None:
    """The host's ``engine`` costs measured on loopback
    (:func:`kvplan.engines.measure.measure_loopback`; Mooncake: TCP on 127.0.0.1), or None
    when that fails: a warning on ``log`` names the failure, and staging stays usable (``auto``
    then takes the direct path, ``always`` is unaffected)."""
    try:
        from kvplan.engines import measure

        return measure.measure_loopback(engine)
    except Exception as exc:  # the measurement is advice only: staging stays usable
        log.warning("kvplan staging: measuring %s's costs on loopback failed (%s: %s)",
                    engine.capitalize(), type(exc).__name__, exc)
        return None


def startup_costs(config: StagingConfig, log: logging.Logger, *, option: str,
                  engine: str = "mooncake") -> tuple[TransferCost | None, str]:
    """The costs a connector's per-request choice (:func:`kvplan.staging.choose_path`) uses,
    and the words its one start-up log line says them with.

    ``config.costs`` (the operator's, under ``option``: ``KVPLAN_STAGING_COSTS`` or
    ``kvplan_staging_costs``) are used as given and nothing is measured; otherwise ``auto``
    measures them once (:func:`loopback_costs`), and without either ``auto`` keeps the direct
    path. ``always`` needs no costs and measures nothing."""
    if config.costs is not None:
        return config.costs, f"given costs {format_costs(config.costs)} ({option})"
    if config.mode != "auto":
        return None, "no costs needed (always stages wherever both peers agree)"
    costs = loopback_costs(log, engine)
    if costs is not None:
        return costs, (f"measured costs {format_costs(costs)} ({engine} loopback; set "
                       f"{option} to these to skip the measurement)")
    return None, (f"no costs (the measurement failed), so auto takes the direct path (set "
                  f"{option}, or staging always)")
