"""Formatting shared by ``kvplan explain``'s messages: values cut to one line, byte counts."""

from __future__ import annotations

from typing import Any

__all__ = ["format_bytes", "one_line", "short"]


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters so that an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def format_bytes(n: float) -> str:
    """``"1.50 KiB (1,536 B)"``; below 1 KiB just ``"512 B"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit} ({int(n):,} B)"
    return f"{int(n):,} B"
