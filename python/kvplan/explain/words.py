"""Formatting shared by ``kvplan explain``'s messages: values cut to one line, byte counts."""

from __future__ import annotations

from kvplan._cli_args import one_line, short

__all__ = ["format_bytes", "one_line", "short"]


def format_bytes(n: float) -> str:
    """``"1.50 KiB (1,536 B)"``; below 1 KiB just ``"512 B"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit} ({int(n):,} B)"
    return f"{int(n):,} B"
