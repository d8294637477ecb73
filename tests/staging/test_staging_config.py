"""Staging settings from vLLM's ``kv_connector_extra_config`` and SGLang's environment."""

from __future__ import annotations

from typing import Any

import pytest

from kvplan import ConfigError
from kvplan.staging import ENV_VARS, STAGING_OPTIONS, StagingConfig


def test_defaults() -> None:
    c = StagingConfig()
    assert (c.mode, c.arena_mib, c.buffers, c.timeout_s) == ("auto", 64, 2, 30.0)
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
                                      "KVPLAN_STAGING_BUFFERS", "KVPLAN_STAGING_TIMEOUT_S"}


@pytest.mark.parametrize("option, value", [
    ("kvplan_staging", "sometimes"), ("kvplan_staging_arena_mib", 0),
    ("kvplan_staging_arena_mib", 64 << 20), ("kvplan_staging_arena_mib", True),
    ("kvplan_staging_buffers", 65), ("kvplan_staging_buffers", 1.5),
    ("kvplan_staging_timeout_s", -1), ("kvplan_staging_timeout_s", float("inf")),
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
