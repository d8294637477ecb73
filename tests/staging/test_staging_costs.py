"""The engine's costs settled once at a connector's start-up (``kvplan.staging.startup_costs``,
shared by the vLLM Mooncake connector and the SGLang Mooncake drop-in): given ones are used as
they are and nothing is measured, ``auto`` otherwise measures on loopback, and a failed
measurement is a warning that leaves ``auto`` on the direct path."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvplan import TransferCost, TransferError
from kvplan.engines import measure
from kvplan.staging import StagingConfig, loopback_costs, startup_costs

GIVEN = TransferCost(per_block_s=3e-6, network_bytes_per_s=2e9, copy_bytes_per_s=9e9)
MEASURED = TransferCost(per_block_s=5e-6, network_bytes_per_s=1e9, copy_bytes_per_s=6e9)
LOG = logging.getLogger("kvplan.test.staging.costs")


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The measurements asked for (engines), each answered with ``MEASURED``."""
    calls: list[str] = []

    def fake(engine: str = "mooncake", **_: Any) -> TransferCost:
        calls.append(engine)
        return MEASURED

    monkeypatch.setattr(measure, "measure_loopback", fake)
    return calls


def test_given_costs_skip_the_measurement(measured: list[str]) -> None:
    for mode in ("auto", "always"):
        costs, said = startup_costs(StagingConfig(mode=mode, costs=GIVEN), LOG,
                                    option="KVPLAN_STAGING_COSTS")
        assert costs == GIVEN
        assert said == ("given costs per_block_s=3e-06,network_bytes_per_s=2e+09,"
                        "copy_bytes_per_s=9e+09 (KVPLAN_STAGING_COSTS)")
    assert measured == []


def test_auto_measures_once_and_always_measures_nothing(measured: list[str]) -> None:
    costs, said = startup_costs(StagingConfig(mode="auto"), LOG, option="kvplan_staging_costs")
    assert costs == MEASURED and measured == ["mooncake"]
    assert said.startswith("measured costs per_block_s=5e-06,network_bytes_per_s=1e+09,"
                           "copy_bytes_per_s=6e+09 (mooncake loopback; set "
                           "kvplan_staging_costs")
    costs, said = startup_costs(StagingConfig(mode="always"), LOG, option="x")
    assert costs is None and measured == ["mooncake"] and "no costs needed" in said


def test_a_failed_measurement_is_a_warning_and_auto_stays_direct(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(engine: str = "mooncake", **_: Any) -> TransferCost:
        raise TransferError("mooncake: no TCP transport on this host")

    monkeypatch.setattr(measure, "measure_loopback", refuse)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert loopback_costs(LOG) is None
        costs, said = startup_costs(StagingConfig(mode="auto"), LOG,
                                    option="KVPLAN_STAGING_COSTS")
    assert costs is None
    assert said == ("no costs (the measurement failed), so auto takes the direct path (set "
                    "KVPLAN_STAGING_COSTS, or staging always)")
    warned = [r.getMessage() for r in caplog.records if r.name == LOG.name]
    assert warned == ["kvplan staging: measuring Mooncake's costs on loopback failed "
                      "(TransferError: mooncake: no TCP transport on this host)"] * 2
