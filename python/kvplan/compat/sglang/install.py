"""install / uninstall: put the drop-in methods on an SGLang manager class and restore exactly
what was there."""

from __future__ import annotations

from collections.abc import Callable

from kvplan.compat._methods import MethodPatches
from kvplan.compat.sglang.dcp import send_kvcache_dcp
from kvplan.compat.sglang.dropins import (
    _send_kvcache_generic,
    _send_mamba_state,
    ascend_send_kvcache,
    send_kvcache,
    send_kvcache_slice,
)
from kvplan.compat.sglang.registry import (
    _ORIGINALS,
    REPLACED_METHODS,
    _dropin,
    _manager_kind,
    _register_sglang_classes,
    _resolve_original,
)
from kvplan.compat.sglang.settings import DEFAULT_MAX_BLOCKS_PER_BATCH
from kvplan.compat.sglang.staged import send_kvcache_staged

_DROPINS: dict[str, Callable[..., int]] = {
    "_send_kvcache_generic": _dropin(_send_kvcache_generic),
    "send_kvcache": _dropin(send_kvcache),
    "_send_mamba_state": _dropin(_send_mamba_state),
    "send_kvcache_slice": _dropin(send_kvcache_slice),
    "send_kvcache_dcp": _dropin(send_kvcache_dcp),
    "send_kvcache_staged": _dropin(send_kvcache_staged),
}


_ASCEND_DROPINS = dict(_DROPINS, send_kvcache=_dropin(ascend_send_kvcache))

# What each manager kind's classes get, and what each patched class held before.
_PATCHES = {
    kind: MethodPatches({name: dropins[name] for name in REPLACED_METHODS[kind]})
    for kind, dropins in (("MooncakeKVManager", _DROPINS), ("AscendKVManager", _ASCEND_DROPINS))
}


def install(manager_class: type, *, max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH,
            decode_kv_layers: int | None = None) -> tuple[str, ...]:
    """Replace ``manager_class``'s planning methods with kvplan's (see the module docstring).

    Args:
        manager_class: SGLang 0.5.23's ``MooncakeKVManager`` or ``AscendKVManager`` (or a
            subclass). Installing twice is a no-op for the methods already replaced.
        max_blocks_per_batch: Blocks per ``engine.batch_transfer_sync`` call.
        decode_kv_layers: The decode's target KV layer count (dense KV layers, without draft),
            needed only by MHA peers that publish no layer ids when the prefill's entry count
            differs from the decode's (PP > 1); SGLang guesses it from the counts, kvplan does
            not. An instance attribute ``kvplan_decode_kv_layers`` overrides it.

    Returns:
        The names of the methods replaced.
    """
    if max_blocks_per_batch <= 0:
        raise ValueError(f"max_blocks_per_batch must be positive, got {max_blocks_per_batch}")
    kind = _manager_kind(manager_class)
    _register_sglang_classes(manager_class)
    patches = _PATCHES[kind]
    already = patches.installed(manager_class)
    # SGLang's functions, resolved before the drop-ins hide them
    originals = {(manager_class, name): _resolve_original(manager_class, name)
                 for name in patches.replacements if name not in already}
    replaced = patches.install(manager_class)
    _ORIGINALS.update(originals)
    setattr(manager_class, "_kvplan_max_blocks_per_batch", max_blocks_per_batch)
    setattr(manager_class, "_kvplan_decode_kv_layers", decode_kv_layers)
    return replaced


def uninstall(manager_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``manager_class``; returns the names."""
    restored = tuple(name for patches in _PATCHES.values()
                     for name in patches.uninstall(manager_class))
    for name in restored:
        _ORIGINALS.pop((manager_class, name), None)
    for attr in ("_kvplan_max_blocks_per_batch", "_kvplan_decode_kv_layers"):
        if attr in manager_class.__dict__:
            delattr(manager_class, attr)
    return restored


def installed(manager_class: type) -> tuple[str, ...]:
    """Names of the methods currently replaced on ``manager_class`` itself."""
    return tuple(name for patches in _PATCHES.values()
                 for name in patches.installed(manager_class))
