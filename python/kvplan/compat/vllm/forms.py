"""What kvplan's vLLM Mooncake drop-in requires of the host's connector, and the check.

``kvplan.compat.vllm.install`` (and so ``KvplanMooncakeConnector`` and the plugin's
registered name, which build their worker class through it) replaces
``MooncakeConnectorWorker._build_transfer_params`` and ``_send_blocks``, and its replacement
calls back into vLLM's ``_get_sender_transfer_plan``, ``_logical_to_kernel_block_ids`` and the
module's ``_block_ids_for_region``, ``MambaSpec`` and ``NULL_BLOCK_ID``, and relies on
``send_kv_to_decode`` calling the two replaced methods. :func:`check_mooncake` compares each
with the forms kvplan was built and tested for (:data:`MOONCAKE_METHODS`, with the releases);
anything else raises :class:`kvplan.IncompatibleHostError` before a method is replaced.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kvplan.compat._methods import names_read, refuse, require_method, signature_text

__all__ = ["MOONCAKE_METHODS", "MOONCAKE_MODULE_FUNCTIONS", "MOONCAKE_MODULE_NAMES",
           "OPTION_PREFIX", "check_mooncake", "kvplan_options"]

_RELEASES = "vLLM 0.32.0, 0.33.0, 0.34.0"
#: The worker methods, by name: the one signature each has in every release kvplan supports.
MOONCAKE_METHODS = {
    "_build_transfer_params":
        "async (self, ready_reqs, agent_meta, local_regions, remote_regions)",
    "_send_blocks": "(self, remote_session, src_ptrs, dst_ptrs, lengths)",
    "_get_sender_transfer_plan":
        "(self, local_kv_block_len, remote_kv_block_len, remote_tp_rank, remote_tp_size)",
    "_logical_to_kernel_block_ids": "(self, block_ids)",
}
#: The connector module's functions kvplan's replacement calls.
MOONCAKE_MODULE_FUNCTIONS = {
    "_block_ids_for_region": "(block_ids_by_group, group_index, shared_group_ids=())",
}
#: The connector module's names kvplan's replacement reads.
MOONCAKE_MODULE_NAMES = ("MambaSpec", "NULL_BLOCK_ID")
# vLLM's caller of the replaced methods: it must still call both (else nothing kvplan installs
# would run, silently).
_CALLER = "send_kv_to_decode"
_REPLACED = ("_build_transfer_params", "_send_blocks")


def check_mooncake(worker_class: type, original: Callable[[type, str], Any]) -> None:
    """Raise :class:`kvplan.IncompatibleHostError` unless ``worker_class``'s host methods and
    module are the ones kvplan was built for. ``original(cls, name)`` is the method ``cls``
    resolves to without kvplan's replacements."""
    for name, form in MOONCAKE_METHODS.items():
        require_method(worker_class, name, {form: _RELEASES}, "vLLM",
                       resolved=original(worker_class, name) or _missing(worker_class, name))
    caller = original(worker_class, _CALLER) or _missing(worker_class, _CALLER)
    lacking = [name for name in _REPLACED if name not in names_read(caller)]
    if lacking:
        raise refuse(worker_class, _owner(caller, worker_class), _CALLER,
                     signature_text(caller),
                     {f"a {_CALLER} that calls {' and '.join(_REPLACED)}": _RELEASES}, "vLLM",
                     why=f"it no longer calls {', '.join(lacking)}")
    module = _connector_module(worker_class)
    for name, form in MOONCAKE_MODULE_FUNCTIONS.items():
        function = getattr(module, name, None)
        seen = "missing" if function is None else signature_text(function)
        if seen != form:
            raise refuse(worker_class, module.__name__, name, seen, {form: _RELEASES}, "vLLM")
    for name in MOONCAKE_MODULE_NAMES:
        if not hasattr(module, name):
            raise refuse(worker_class, module.__name__, name, "missing",
                         {"a module attribute": _RELEASES}, "vLLM")


def _owner(function: Any, worker_class: type) -> str:
    parts = getattr(function, "__qualname__", "").split(".")
    return parts[-2] if len(parts) >= 2 else worker_class.__name__


def _missing(worker_class: type, name: str) -> Any:
    raise refuse(worker_class, worker_class.__name__, name, "missing",
                 {MOONCAKE_METHODS.get(name, "a method"): _RELEASES}, "vLLM")


def _connector_module(worker_class: type) -> Any:
    for klass in worker_class.__mro__:
        if klass.__name__ == "MooncakeConnectorWorker":
            return sys.modules[klass.__module__]
    raise TypeError(f"{worker_class.__name__} is not vLLM's MooncakeConnectorWorker "
                    "(or a subclass)")


#: ``kv_connector_extra_config`` keys beginning with this are kvplan's (every other key is
#: vLLM's connector's own, passed through untouched).
OPTION_PREFIX = "kvplan"


def _positive_int(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _config_error(option, value, (),
                            f"{option}={value!r}: a positive integer is required")
    return value


def _staging_options() -> dict[str, Callable[[str, Any], Any]]:
    from kvplan.staging.config import STAGING_OPTIONS

    return dict(STAGING_OPTIONS)


def _manifest(option: str, value: Any) -> Any:
    """``kvplan_manifest``'s parser: :func:`kvplan.presets.load_manifest` of a string (a preset
    key, ``key:num_layers`` or the path of a JSON manifest); :class:`kvplan.ManifestError`
    naming the option and the value otherwise."""
    from kvplan._core import ManifestError
    from kvplan.presets import load_manifest

    if not isinstance(value, str):
        raise ManifestError(f"{option}={value!r}: expected a preset key, key:num_layers or the "
                            f"path of a JSON manifest (a string)")
    try:
        return load_manifest(value)
    except ManifestError as err:
        raise ManifestError(f"{option}={value!r}: {err}") from err


#: Each kvplan option a connector takes, with its parser (the Mooncake connector takes the
#: ``kvplan_staging*`` keys of :data:`kvplan.staging.STAGING_OPTIONS`, and ``kvplan_manifest``:
#: the model manifest its workers check at start-up, :mod:`kvplan.compat.vllm.manifest`; the
#: NIXL connector takes ``kvplan_manifest`` and the ``kvplan_staging*`` keys).
OPTIONS: dict[str, dict[str, Callable[[str, Any], Any]]] = {
    "KvplanMooncakeConnector": {"kvplan_max_blocks_per_batch": _positive_int,
                                "kvplan_manifest": _manifest, **_staging_options()},
    "KvplanNixlConnector": {"kvplan_manifest": _manifest, **_staging_options()},
}


def _config_error(option: str, value: Any, known: tuple[str, ...], message: str) -> Exception:
    from kvplan._errors import ConfigError

    err = ConfigError(message)
    err.option, err.value, err.known = option, value, known
    return err


def kvplan_options(vllm_config: Any, connector: str) -> dict[str, Any]:
    """The kvplan options of ``vllm_config.kv_transfer_config.kv_connector_extra_config``
    for ``connector`` (parsed); :class:`kvplan.ConfigError` for a key beginning with
    ``kvplan`` that the connector does not take, or a bad value."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    parsers = OPTIONS[connector]
    known = tuple(sorted(parsers))
    parsed = {}
    for key, value in extra.items():
        if not str(key).startswith(OPTION_PREFIX):
            continue
        parser = parsers.get(key)
        if parser is None:
            raise _config_error(
                key, value, known,
                f"kv_connector_extra_config: {key!r} is not an option of {connector} (its "
                f"kvplan options: {', '.join(known) or 'none'}); keys beginning with "
                f"{OPTION_PREFIX!r} are kvplan's, and an unknown one is refused rather than "
                "ignored")
        parsed[key] = parser(key, value)
    return parsed
