"""Where benchmark results live (``bench/results/``) and how a results file is written."""

from __future__ import annotations

import os
from collections.abc import Iterable

from . import BENCH_DIR

RESULTS_DIR = os.path.join(BENCH_DIR, "results")


def write_lines(out_dir: str, name: str, lines: Iterable[str]) -> str:
    """Write ``lines`` (newline-terminated) to ``out_dir/name``, creating the directory;
    return the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path
