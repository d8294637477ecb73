"""What a logger emits while a block runs, for tests that assert on log lines."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def records(logger: str) -> Iterator[list[logging.LogRecord]]:
    """Every record that reaches ``logger`` (INFO and up) while the block runs; the logger's
    level is restored afterwards."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = got.append  # type: ignore[method-assign]
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield got
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
