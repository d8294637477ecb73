"""Staging settings as the engines pass them: vLLM's ``kv_connector_extra_config`` keys
(``kvplan_staging``, ``kvplan_staging_arena_mib``, ``kvplan_staging_buffers``,
``kvplan_staging_timeout_s``, ``kvplan_staging_costs``) and SGLang's environment
(``KVPLAN_STAGING``, ``KVPLAN_STAGING_ARENA_MIB``, ``KVPLAN_STAGING_BUFFERS``,
``KVPLAN_STAGING_TIMEOUT_S``, ``KVPLAN_STAGING_COSTS``).

The staging timeout is how long a staged request may go without progress (a round written,
read, acknowledged or scattered) before it fails with reason ``timeout``. It bounds a peer
that is alive but stuck; a peer that dies fails the request as soon as its side channel
closes, whatever the timeout. Given (``kvplan_staging_timeout_s`` /
``KVPLAN_STAGING_TIMEOUT_S``), it is the bound on both sides. Not given, a vLLM NIXL staged
read waits as long as the prefill keeps the request's blocks for a silent decode: the
prefill's KV lease (vLLM's ``kv_lease_duration``, which its staging message carries to the
decode, so both sides wait alike), and never less than :data:`DEFAULT_TIMEOUT_S`
(:meth:`StagingConfig.patience`); vLLM's own read of the same blocks waits that long too.
Elsewhere the default is :data:`DEFAULT_TIMEOUT_S`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvplan._core import KvPlanError, TransferCost
from kvplan._errors import ConfigError

__all__ = ["COST_FIELDS", "DEFAULT_ARENA_MIB", "DEFAULT_BUFFERS", "DEFAULT_TIMEOUT_S",
           "ENV_VARS", "MAX_ARENA_MIB", "MAX_BUFFERS", "MODES", "STAGING_OPTIONS",
           "StagingConfig", "format_costs"]

DEFAULT_ARENA_MIB = 64
DEFAULT_BUFFERS = 2
#: Seconds without progress (a round written, acknowledged or scattered) before a staged
#: request fails with reason ``timeout``, where no timeout was given and no longer lease
#: applies (:meth:`StagingConfig.patience`).
DEFAULT_TIMEOUT_S = 30.0
#: An arena is host memory pinned by the engine's registration: a bound that catches a
#: value given in bytes where MiB were meant.
MAX_ARENA_MIB = 1 << 16
MAX_BUFFERS = 64
#: ``auto``: staged where both peers agreed and ``transfer_advice`` prefers it; ``always``:
#: staged wherever both peers agreed; ``off``: no arena, nothing advertised, the direct path.
MODES = ("auto", "always", "off")

Mode = Literal["auto", "always", "off"]


def _error(option: str, value: Any, message: str) -> ConfigError:
    err = ConfigError(message)
    err.option, err.value, err.known = option, value, tuple(STAGING_OPTIONS)
    return err


def _mode(option: str, value: Any) -> str:
    text = str(value).strip().lower() if isinstance(value, (str, bool)) else None
    aliases = {"true": "auto", "1": "auto", "on": "auto", "false": "off", "0": "off",
               "no": "off"}
    if isinstance(value, bool):
        text = "auto" if value else "off"
    text = aliases.get(text, text) if text is not None else None
    if text not in MODES:
        raise _error(option, value, f"{option}={value!r}: one of {', '.join(MODES)} is required")
    return text


def _int_in(low: int, high: int) -> Callable[[str, Any], int]:
    def parse(option: str, value: Any) -> int:
        if isinstance(value, str) and value.strip().lstrip("+").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _error(option, value, f"{option}={value!r}: an integer from {low} to {high} "
                         "is required")
        return value
    return parse


def _positive_number(value: Any) -> float | None:
    """``value`` as a finite float greater than 0 (a number or its text; never a bool), or
    None when it is not one."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _seconds(option: str, value: Any) -> float:
    seconds = _positive_number(value)
    if seconds is None:
        raise _error(option, value, f"{option}={value!r}: a finite number of seconds greater "
                     "than 0 is required")
    return seconds


#: The three numbers of a :class:`kvplan.TransferCost`, in the order :func:`format_costs`
#: writes them.
COST_FIELDS = ("per_block_s", "network_bytes_per_s", "copy_bytes_per_s")


def format_costs(costs: TransferCost) -> str:
    """``costs`` in the form ``kvplan_staging_costs`` / ``KVPLAN_STAGING_COSTS`` reads:
    ``per_block_s=...,network_bytes_per_s=...,copy_bytes_per_s=...``."""
    return ",".join(f"{name}={getattr(costs, name):.6g}" for name in COST_FIELDS)


def _costs(option: str, value: Any) -> TransferCost:
    """A :class:`kvplan.TransferCost` as it is, a mapping of its three numbers (a JSON object
    in ``kv_connector_extra_config``), or text: ``name=number`` pairs separated by commas
    (:func:`format_costs`' form) or a JSON object. Each of the three exactly once, each a
    finite number greater than 0."""
    if isinstance(value, TransferCost):
        return value
    form = (f"{option}={value!r}: the engine's costs are required as "
            "'per_block_s=S,network_bytes_per_s=B,copy_bytes_per_s=C' (each a finite number "
            "greater than 0)")
    pairs: list[tuple[Any, Any]]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, str) and value.strip().startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            raise _error(option, value, form) from None
        if not isinstance(parsed, dict):
            raise _error(option, value, form)
        pairs = list(parsed.items())
    elif isinstance(value, str):
        pairs = []
        for part in value.split(","):
            name, sep, number = part.partition("=")
            if not sep:
                raise _error(option, value, form)
            pairs.append((name.strip(), number.strip()))
    else:
        raise _error(option, value, form)
    numbers: dict[str, float] = {}
    for name, number in pairs:
        if name not in COST_FIELDS or name in numbers:
            raise _error(option, value, f"{form}; {name!r} is unknown or repeated")
        x = _positive_number(number)
        if x is None:
            raise _error(option, value, f"{form}; {name}={number!r} is not such a "
                         "number")
        numbers[name] = x
    missing = [name for name in COST_FIELDS if name not in numbers]
    if missing:
        raise _error(option, value, f"{form}; missing: {', '.join(missing)}")
    try:
        return TransferCost(**numbers)
    except KvPlanError as exc:  # the core's own check, should it be stricter than this one
        raise _error(option, value, f"{form}; {exc}") from None


#: Each ``kv_connector_extra_config`` key with its parser (a connector's own option table
#: takes these in as they are).
STAGING_OPTIONS: dict[str, Callable[[str, Any], Any]] = {
    "kvplan_staging": _mode,
    "kvplan_staging_arena_mib": _int_in(1, MAX_ARENA_MIB),
    "kvplan_staging_buffers": _int_in(1, MAX_BUFFERS),
    "kvplan_staging_timeout_s": _seconds,
    "kvplan_staging_costs": _costs,
}

#: The environment variable read for each option (SGLang has no per-connector config).
ENV_VARS: dict[str, str] = {key: key.upper() for key in STAGING_OPTIONS}


@dataclass(frozen=True)
class StagingConfig:
    """How a kvplan peer stages: ``mode`` (:data:`MODES`), the arena (``arena_mib`` MiB split
    into ``buffers`` round buffers), ``timeout_s`` without progress before a staged request
    fails (``timeout_given``: the operator set it; else it is the default and a peer's lease
    may lengthen it, :meth:`patience`), and ``costs``: the engine's
    :class:`kvplan.TransferCost` as the operator gave it (``None``: ``auto`` measures them at
    start-up, :func:`kvplan.staging.startup_costs`)."""

    mode: Mode = "auto"
    arena_mib: int = DEFAULT_ARENA_MIB
    buffers: int = DEFAULT_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    costs: TransferCost | None = field(default=None, hash=False)
    timeout_given: bool = False

    def patience(self, lease_s: Any = None) -> float:
        """Seconds a staged request may go without progress: ``timeout_s`` where it was given;
        else the longer of ``timeout_s`` and ``lease_s`` (the prefill's KV lease, how long it
        keeps a request's blocks for a silent decode; anything but a finite number of seconds
        greater than 0 counts as none)."""
        if self.timeout_given:
            return self.timeout_s
        lease = _positive_number(lease_s)
        return self.timeout_s if lease is None else max(self.timeout_s, lease)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def arena_bytes(self) -> int:
        return self.arena_mib << 20

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> StagingConfig:
        """From ``kv_connector_extra_config`` (vLLM): the ``kvplan_staging*`` keys are read,
        every other key ignored; a bad value is a :class:`kvplan.ConfigError`."""
        parsed = {key[len("kvplan_staging_"):] if key != "kvplan_staging" else "mode":
                  STAGING_OPTIONS[key](key, value)
                  for key, value in options.items() if key in STAGING_OPTIONS}
        return cls(**parsed, timeout_given="kvplan_staging_timeout_s" in options)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StagingConfig:
        """From the environment (SGLang): ``KVPLAN_STAGING``, ``KVPLAN_STAGING_ARENA_MIB``,
        ``KVPLAN_STAGING_BUFFERS``, ``KVPLAN_STAGING_TIMEOUT_S``, ``KVPLAN_STAGING_COSTS``;
        unset ones keep their defaults, an empty one counts as unset."""
        env = os.environ if environ is None else environ
        options = {key: env[var] for key, var in ENV_VARS.items() if env.get(var, "") != ""}
        try:
            return cls.from_options(options)
        except ConfigError as exc:
            var = ENV_VARS.get(exc.option, exc.option)
            err = ConfigError(f"environment: {var}: {exc}")
            err.option, err.value, err.known = var, exc.value, tuple(ENV_VARS.values())
            raise err from None
