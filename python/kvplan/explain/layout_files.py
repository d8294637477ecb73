"""Layout JSON files for ``kvplan explain``: loading with field-by-field checks, writing.

A bad file is one ``ValueError`` line naming the option, the file, the field, the entry and the
value (the native loader reports some of these as bare integer-conversion errors).
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvplan.explain.words import one_line, short

__all__ = ["check_layout_dict", "load_layout", "write_layouts"]

_U64 = 1 << 64
_I64 = 1 << 63
#: Layout dict fields holding unsigned 64-bit integers, one per entry (``Layout.to_dict``).
_U64_LISTS = ("data_ptrs", "data_lens", "item_lens")


def check_layout_dict(data: Any, where: str) -> None:
    """Check a parsed layout JSON document field by field, so that a bad file gets one line
    naming the field, the entry and the value (the native loader reports some of these as bare
    integer-conversion errors)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object (Layout.to_dict), got "
                         f"{type(data).__name__} {short(data)}")
    for name in _U64_LISTS:
        if name not in data:
            continue  # the native loader names missing keys
        value = data[name]
        if name == "item_lens" and not isinstance(value, list):
            # One item length for every entry is allowed.
            if type(value) is not int or not 0 <= value < _U64:
                raise ValueError(f"{where}: item_lens must be an integer in 0..2**64-1 or a "
                                 f"list of them, got {short(value)}")
            continue
        if not isinstance(value, list):
            raise ValueError(f"{where}: {name} must be a list of integers in 0..2**64-1, got "
                             f"{short(value)}")
        for k, v in enumerate(value):
            if type(v) is not int or not 0 <= v < _U64:
                raise ValueError(f"{where}: {name}[{k}] must be an integer in 0..2**64-1, got "
                                 f"{short(v)}")
    ids = data.get("layer_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise ValueError(f"{where}: layer_ids must be a list of integers (or null), got "
                             f"{short(ids)}")
        for k, v in enumerate(ids):
            if v is not None and (type(v) is not int or not -_I64 <= v < _I64):
                raise ValueError(f"{where}: layer_ids[{k}] must be a 64-bit integer or null, "
                                 f"got {short(v)}")
    for name in ("roles", "kinds"):
        value = data.get(name)
        if value is None:
            continue  # null roles mean "not published"; the native loader names other gaps
        if not isinstance(value, list):
            raise ValueError(f"{where}: {name} must be a list of strings, got {short(value)}")
        for k, v in enumerate(value):
            if not isinstance(v, str):
                raise ValueError(f"{where}: {name}[{k}] must be a string, got {short(v)}")
    for name in ("version", "page_size", "num_model_layers", "pp_rank", "pp_size", "tp_rank",
                 "tp_size"):
        v = data.get(name)
        if v is None and (name not in data or name == "num_model_layers"):
            continue
        if type(v) is not int or not 0 <= v < _U64:
            raise ValueError(f"{where}: {name} must be a non-negative integer, got {short(v)}")
    if "device" in data and not isinstance(data["device"], str):
        raise ValueError(f"{where}: device must be a string, got {short(data['device'])}")


def load_layout(path: str, option: str = "--prefill") -> Any:
    """A layout from a JSON file; every problem is a one-line ``ValueError`` naming the file."""
    from kvplan import KvPlanError, Layout

    where = f"{option} {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ValueError(f"{where}: cannot read: {err.strerror or err}") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError too
        raise ValueError(f"{where}: not a valid JSON file: {one_line(err)}") from None
    check_layout_dict(data, where)
    try:
        return Layout.from_dict(data)
    except (KvPlanError, TypeError, OverflowError, ValueError) as err:
        raise ValueError(f"{where}: {one_line(err)}") from None


def write_layouts(directory: str, stages: list[tuple[str, Any]], decode: Any) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        for _, layout in stages:
            name = f"prefill-stage{layout.pp_rank}.json" if layout.pp_size > 1 else "prefill.json"
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                json.dump(layout.to_dict(), f, indent=1)
        with open(os.path.join(directory, "decode.json"), "w", encoding="utf-8") as f:
            json.dump(decode.to_dict(), f, indent=1)
    except OSError as err:
        raise ValueError(f"--write-layouts {directory}: {err.strerror or err}"
                         + (f": {err.filename}" if err.filename else "")) from None
