"""Layout JSON files for ``kvplan explain``: loading, writing.

A bad file is one ``ValueError`` line naming the option and the file, then what
``Layout.from_dict`` (the bindings and the core, the one place layouts are checked) says: the
field, the entry and the value.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvplan.explain.words import one_line, short

__all__ = ["load_layout", "write_layouts"]


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
    if not isinstance(data, dict):  # the file's shape; the layout's fields are the core's to check
        raise ValueError(f"{where}: expected a JSON object (Layout.to_dict), got "
                         f"{type(data).__name__} {short(data)}")
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
