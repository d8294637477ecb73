"""Staging settings from vLLM's ``kv_connector_extra_config`` and SGLang's environment."""

from __future__ import annotations

from typing import Any

import pytest

from kvplan import ConfigError, TransferCost
from kvplan.staging import ENV_VARS, STAGING_OPTIONS, StagingConfig, format_costs

COSTS = TransferCost(per_block_s=2e-6, network_bytes_per_s=1.5e9, copy_bytes_per_s=8e9)


def test_defaults() -> None:
    c = StagingConfig()
    assert (c.mode, c.arena_mib, c.buffers, c.timeout_s) == ("auto", 64, 2, 30.0)
    assert c.costs is None
    assert c.arena_bytes == 64 << 20 and c.enabled
    assert StagingConfig.from_options({}) == c == StagingConfig.from_env({})


def test_extra_config_keys_are_read_and_others_ignored() -> None:
    c = StagingConfig.from_options({"kvplan_staging": "always", "kvplan_staging_arena_mib": 16,
                                    "kvplan_staging_buffers": 4, "mooncake_protocol": "tcp",
                                    "kvplan_staging_timeout_s": 2.5})
    assert (c.mode, c.arena_mib, c.buffers, c.timeout_s) == ("always", 16, 4, 2.5)
    assert not StagingConfig.from_options({"kvplan_staging": False}).enabled


def test_environment() -> None:
    env = {"KVPLAN_STAGING": "off", "KVPLAN_STAGING_ARENA_MIB": "8",
           "KVPLAN_STAGING_BUFFERS": "3", "KVPLAN_STAGING_TIMEOUT_S": ""}
    c = StagingConfig.from_env(env)
    assert (c.mode, c.arena_mib, c.buffers, c.timeout_s) == ("off", 8, 3, 30.0)
    assert set(ENV_VARS.values()) == {"KVPLAN_STAGING", "KVPLAN_STAGING_ARENA_MIB",
                                      "KVPLAN_STAGING_BUFFERS", "KVPLAN_STAGING_TIMEOUT_S",
                                      "KVPLAN_STAGING_COSTS"}


@pytest.mark.parametrize("value", [
    "per_block_s=2e-6,network_bytes_per_s=1.5e9,copy_bytes_per_s=8e9",
    " copy_bytes_per_s = 8000000000 , per_block_s=0.000002,network_bytes_per_s=1.5e9 ",
    '{"per_block_s": 2e-6, "network_bytes_per_s": 1.5e9, "copy_bytes_per_s": 8e9}',
])
def test_costs_from_the_environment(value: str) -> None:
    """``KVPLAN_STAGING_COSTS``: ``name=number`` pairs in any order, or a JSON object."""
    c = StagingConfig.from_env({"KVPLAN_STAGING_COSTS": value})
    assert c.costs == COSTS and c.mode == "auto"


def test_costs_from_extra_config_and_as_written_at_start_up() -> None:
    """``kvplan_staging_costs``: a JSON object in ``kv_connector_extra_config``, the text form,
    or a ``TransferCost`` already parsed; :func:`format_costs` writes the text form back."""
    mapping = {"per_block_s": 2e-6, "network_bytes_per_s": 1.5e9, "copy_bytes_per_s": 8e9}
    assert StagingConfig.from_options({"kvplan_staging_costs": mapping}).costs == COSTS
    assert StagingConfig.from_options({"kvplan_staging_costs": COSTS}).costs == COSTS
    text = format_costs(COSTS)
    assert text == "per_block_s=2e-06,network_bytes_per_s=1.5e+09,copy_bytes_per_s=8e+09"
    assert StagingConfig.from_options({"kvplan_staging_costs": text}).costs == COSTS
    assert hash(StagingConfig(costs=COSTS)) == hash(StagingConfig())  # costs are not hashed


@pytest.mark.parametrize("option, value", [
    ("kvplan_staging", "sometimes"), ("kvplan_staging_arena_mib", 0),
    ("kvplan_staging_arena_mib", 64 << 20), ("kvplan_staging_arena_mib", True),
    ("kvplan_staging_buffers", 65), ("kvplan_staging_buffers", 1.5),
    ("kvplan_staging_timeout_s", -1), ("kvplan_staging_timeout_s", float("inf")),
    ("kvplan_staging_costs", "fast"), ("kvplan_staging_costs", "per_block_s=1e-6"),
    ("kvplan_staging_costs", "per_block_s=0,network_bytes_per_s=1e9,copy_bytes_per_s=1e9"),
    ("kvplan_staging_costs", "per_block_s=nan,network_bytes_per_s=1e9,copy_bytes_per_s=1e9"),
    ("kvplan_staging_costs",
     "per_block_s=1e-6,per_block_s=1e-6,network_bytes_per_s=1e9,copy_bytes_per_s=1e9"),
    ("kvplan_staging_costs",
     "per_block_s=1e-6,network_bytes_per_s=1e9,copy_bytes_per_s=1e9,latency_s=1"),
    ("kvplan_staging_costs", {"per_block_s": True, "network_bytes_per_s": 1e9,
                              "copy_bytes_per_s": 1e9}),
    ("kvplan_staging_costs", "{not json"), ("kvplan_staging_costs", [1e-6, 1e9, 1e9]),
    ("kvplan_staging_costs", None),
])
def test_bad_values_are_config_errors_naming_them(option: str, value: Any) -> None:
    with pytest.raises(ConfigError) as exc:
        StagingConfig.from_options({option: value})
    assert exc.value.option == option and exc.value.value == value
    assert option in str(exc.value) and exc.value.known == tuple(STAGING_OPTIONS)


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as exc:
        StagingConfig.from_env({"KVPLAN_STAGING_BUFFERS": "two"})
    assert exc.value.option == "KVPLAN_STAGING_BUFFERS" and exc.value.value == "two"
    assert str(exc.value).startswith("environment: KVPLAN_STAGING_BUFFERS")


def test_bad_costs_in_the_environment_name_the_variable() -> None:
    bad = "per_block_s=1e-6,network_bytes_per_s=-1,copy_bytes_per_s=1e9"
    with pytest.raises(ConfigError) as exc:
        StagingConfig.from_env({"KVPLAN_STAGING": "auto", "KVPLAN_STAGING_COSTS": bad})
    assert exc.value.option == "KVPLAN_STAGING_COSTS" and exc.value.value == bad
    assert str(exc.value).startswith("environment: KVPLAN_STAGING_COSTS")
    assert "network_bytes_per_s='-1'" in str(exc.value)


@pytest.mark.parametrize("lease, want", [
    (None, 30.0),        # no lease known: the default
    (120, 120.0),        # a longer lease: waited for
    ("90", 90.0),        # as a staging message may carry it
    (10, 30.0),          # a shorter lease: never less than the default
    (0, 30.0), (-5, 30.0), (float("nan"), 30.0), (float("inf"), 30.0), (True, 30.0),
    ("soon", 30.0),      # not a lease: the default
])
def test_patience_follows_a_longer_lease_unless_a_timeout_was_given(lease: Any,
                                                                   want: float) -> None:
    """Without a given timeout a staged request waits as long as the prefill's lease (never
    less than the default); a timeout given by option or environment is the bound."""
    assert StagingConfig.from_options({}).patience(lease) == want
    assert StagingConfig.from_env({"KVPLAN_STAGING_TIMEOUT_S": ""}).patience(lease) == want
    given = StagingConfig.from_options({"kvplan_staging_timeout_s": 2.5})
    assert given.timeout_given and given.patience(lease) == 2.5
    env = StagingConfig.from_env({"KVPLAN_STAGING_TIMEOUT_S": "45"})
    assert env.timeout_given and env.patience(lease) == 45.0
    assert not StagingConfig().timeout_given
