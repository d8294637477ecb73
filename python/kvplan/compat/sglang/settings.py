"""kvplan's settings on a manager: the blocks per engine call and the decode's KV layer count,
set per class by :func:`install` or per instance (``kvplan_max_blocks_per_batch``,
``kvplan_decode_kv_layers``)."""

from __future__ import annotations

from typing import Any

#: Blocks per engine call. Mooncake's TCP transport admits about 1,024 queued entries per peer.
DEFAULT_MAX_BLOCKS_PER_BATCH = 1024


def _instance_setting(manager: Any, name: str) -> Any:
    """A kvplan setting stored on the instance itself (``None`` when absent), without asking
    the object's ``__getattr__``."""
    attrs = getattr(manager, "__dict__", None)
    return None if attrs is None else attrs.get(name)


def setting_max_blocks(manager: Any) -> int:
    value = _instance_setting(manager, "kvplan_max_blocks_per_batch")
    if value is None:
        value = getattr(type(manager), "_kvplan_max_blocks_per_batch",
                        DEFAULT_MAX_BLOCKS_PER_BATCH)
    return int(value)


def setting_decode_kv_layers(manager: Any) -> int | None:
    value = _instance_setting(manager, "kvplan_decode_kv_layers")
    if value is None:
        value = getattr(type(manager), "_kvplan_decode_kv_layers", None)
    return None if value is None else int(value)


#: The environment variable naming the model manifest every manager checks its own layout
#: against at start-up (docs/manifests.md, "Checked at start-up"): a preset key, ``key:layers``
#: or the path of a JSON manifest. Unset or empty: no check.
MANIFEST_ENV = "KVPLAN_MANIFEST"
