"""install / uninstall: put the drop-in methods on an SGLang manager class and restore exactly
what was there."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, Literal

from kvplan._core import KvPlanError
from kvplan.compat._methods import MethodPatches, require_method
from kvplan.compat.sglang import nixl
from kvplan.compat.sglang.dcp import send_kvcache_dcp
from kvplan.compat.sglang.dropins import (
    _send_kvcache_generic,
    _send_mamba_state,
    _send_mamba_state_slice,
    ascend_send_kvcache,
    send_kvcache,
    send_kvcache_slice,
)
from kvplan.compat.sglang.registry import (
    _ORIGINALS,
    NIXL_MANAGER,
    REPLACED_METHODS,
    _dropin,
    _manager_kind,
    _register_sglang_classes,
    _resolve_original,
)
from kvplan.compat.sglang.manifest import hook_manifest, unhook_manifest
from kvplan.compat.sglang.nixl import hook_identity, unhook_identity
from kvplan.compat.sglang.rounds import hook_start_up, unhook_register_info, unhook_start_up
from kvplan.compat.sglang.settings import DEFAULT_MAX_BLOCKS_PER_BATCH
from kvplan.compat.sglang.staged import send_kvcache_staged

_log = logging.getLogger("kvplan.compat.sglang")

#: What a drop-in returns for a refused request under ``on_error="status"``: a non-zero status,
#: which SGLang's transfer worker treats as a failed send of that request.
REFUSED_STATUS = -1


def _reporting(fn: Callable[..., int]) -> Callable[..., int]:
    """``fn`` as installed: under ``on_error="status"`` a kvplan error is logged with its
    reason and becomes :data:`REFUSED_STATUS`; otherwise it propagates."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> int:
        try:
            return fn(self, *args, **kwargs)
        except KvPlanError as exc:
            if getattr(self, "_kvplan_on_error", "raise") != "status":
                raise
            session = args[0] if args else kwargs.get("mooncake_session_id")
            _log.error("kvplan refused %s for session %s: %s: %s (status %d: SGLang fails "
                       "this request)", fn.__name__, session, type(exc).__name__, exc,
                       REFUSED_STATUS)
            return REFUSED_STATUS

    return method


_DROPINS: dict[str, Callable[..., int]] = {
    "_send_kvcache_generic": _dropin(_reporting(_send_kvcache_generic)),
    "send_kvcache": _dropin(_reporting(send_kvcache)),
    "_send_mamba_state": _dropin(_reporting(_send_mamba_state)),
    "_send_mamba_state_slice": _dropin(_reporting(_send_mamba_state_slice)),
    "send_kvcache_slice": _dropin(_reporting(send_kvcache_slice)),
    "send_kvcache_dcp": _dropin(_reporting(send_kvcache_dcp)),
    "send_kvcache_staged": _dropin(_reporting(send_kvcache_staged)),
}


_ASCEND_DROPINS = dict(_DROPINS, send_kvcache=_dropin(_reporting(ascend_send_kvcache)))


def _logging_refusals(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A NIXL drop-in as installed: SGLang's NIXL transfer worker already fails the one room
    whose send raises (``conclude_failure``) and goes on, so a kvplan error always propagates;
    under ``on_error="status"`` its reason is logged first."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except KvPlanError as exc:
            if getattr(self, "_kvplan_on_error", "raise") == "status":
                peer = args[0] if args else kwargs.get("peer_name")
                _log.error("kvplan refused %s for peer %s: %s: %s (SGLang fails this "
                           "request)", fn.__name__, peer, type(exc).__name__, exc)
            raise

    return method


_NIXL_DROPINS: dict[str, Callable[..., Any]] = {
    name: _dropin(_logging_refusals(getattr(nixl, name)))
    for name in REPLACED_METHODS[NIXL_MANAGER]
}

# What each manager kind's classes get, and what each patched class held before.
_PATCHES = {
    kind: MethodPatches({name: dropins[name] for name in REPLACED_METHODS[kind]})
    for kind, dropins in (("MooncakeKVManager", _DROPINS), ("AscendKVManager", _ASCEND_DROPINS),
                          (NIXL_MANAGER, _NIXL_DROPINS))
}


def _require_nixl_forms(manager_class: type, names: list[str]) -> None:
    """Refuse (``kvplan.IncompatibleHostError``: class, method, host version, the signature
    seen and the ones supported) before anything is replaced, unless each NIXL method kvplan
    replaces has a form it was built for and still reads what the replacement reads."""
    for name in names:
        forms = nixl.SUPPORTED_FORMS[name]
        require_method(manager_class, name, forms, "SGLang",
                       reads={form: nixl.READS[name] for form in forms},
                       resolved=_resolve_original(manager_class, name))



def install(manager_class: type, *, max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH,
            decode_kv_layers: int | None = None,
            on_error: Literal["raise", "status"] = "raise") -> tuple[str, ...]:
    """Replace ``manager_class``'s planning methods with kvplan's (see the module docstring).

    Args:
        manager_class: SGLang 0.5.23's ``MooncakeKVManager``, ``AscendKVManager`` or
            ``NixlKVManager`` (or a subclass). Installing twice is a no-op for the methods
            already replaced. A NIXL manager whose replaced methods have another signature
            than SGLang 0.5.23's is refused with ``kvplan.IncompatibleHostError``, nothing
            replaced.
        max_blocks_per_batch: Blocks per ``engine.batch_transfer_sync`` call.
        decode_kv_layers: The decode's target KV layer count (dense KV layers, without draft),
            needed only by MHA peers that publish no layer ids when the prefill's entry count
            differs from the decode's (PP > 1); SGLang guesses it from the counts, kvplan does
            not. An instance attribute ``kvplan_decode_kv_layers`` overrides it.
        on_error: What a request kvplan refuses (a ``KvPlanError``: pairing, sizes, bounds)
            does. ``"raise"``: the typed error propagates to the caller. ``"status"`` (for
            live servers): the reason is logged (logger ``kvplan.compat.sglang``) and the
            method returns -1, which SGLang's transfer worker handles as a failed send of that
            request; an exception would instead end the prefill's transfer thread. Errors that
            are not kvplan's propagate either way. On a ``NixlKVManager`` the error propagates
            under both (logged first under ``"status"``): SGLang's NIXL worker fails that one
            request on any exception and keeps running.

    Returns:
        The names of the methods replaced.
    """
    if max_blocks_per_batch <= 0:
        raise ValueError(f"max_blocks_per_batch must be positive, got {max_blocks_per_batch}")
    if on_error not in ("raise", "status"):
        raise ValueError(f"on_error must be 'raise' or 'status', got {on_error!r}")
    kind = _manager_kind(manager_class)
    _register_sglang_classes(manager_class)
    patches = _PATCHES[kind]
    already = patches.installed(manager_class)
    if kind == NIXL_MANAGER:
        _require_nixl_forms(manager_class, [n for n in patches.replacements if n not in already])
        # layout identities at the decode's registration (kvplan.compat.sglang.nixl); a host
        # without the methods is refused here, before anything is replaced
        hook_identity(manager_class)
    # SGLang's functions, resolved before the drop-ins hide them
    originals = {(manager_class, name): _resolve_original(manager_class, name)
                 for name in patches.replacements if name not in already}
    replaced = patches.install(manager_class)
    _ORIGINALS.update(originals)
    setattr(manager_class, "_kvplan_max_blocks_per_batch", max_blocks_per_batch)
    setattr(manager_class, "_kvplan_decode_kv_layers", decode_kv_layers)
    setattr(manager_class, "_kvplan_on_error", on_error)
    # KVPLAN_MANIFEST: the manager's layout against the model's manifest once SGLang
    # registered its KV memory, before the start-up hook below starts anything
    # (kvplan.compat.sglang.manifest)
    hook_manifest(manager_class)
    if kind == "MooncakeKVManager":
        # the manager's start-up gives it the layout identity exchange at SGLang's
        # registration and, with KVPLAN_STAGING on, staged transfers in rounds (an arena and
        # a side channel; kvplan.compat.sglang.rounds.start_up)
        hook_start_up(manager_class)
    return replaced


def uninstall(manager_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``manager_class``; returns the names."""
    restored = tuple(name for patches in _PATCHES.values()
                     for name in patches.uninstall(manager_class))
    for name in restored:
        _ORIGINALS.pop((manager_class, name), None)
    for attr in ("_kvplan_max_blocks_per_batch", "_kvplan_decode_kv_layers", "_kvplan_on_error"):
        if attr in manager_class.__dict__:
            delattr(manager_class, attr)
    # the registration parse a staged manager's start-up hook wrapped (rounds.attach)
    info_cls = getattr(sys.modules.get(manager_class.__module__), "KVArgsRegisterInfo", None)
    if isinstance(info_cls, type):
        unhook_register_info(info_cls)
    unhook_start_up(manager_class)
    unhook_manifest(manager_class)
    unhook_identity(manager_class)
    return restored


def installed(manager_class: type) -> tuple[str, ...]:
    """Names of the methods currently replaced on ``manager_class`` itself."""
    return tuple(name for patches in _PATCHES.values()
                 for name in patches.installed(manager_class))
