"""Argument checking shared by the console commands: argparse ``type`` functions that name
the bound a value breaks, one-line usage errors (exit 2), and the memory a request may use."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["EXIT_USAGE", "available_memory", "float_arg", "int_arg", "int_list_arg",
           "one_line", "one_line_error", "short"]

#: The exit status of every command for bad input (an option, a file, a value).
EXIT_USAGE = 2


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters so that an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _bound(low: float, high: float | None) -> str:
    return f"at least {low}" if high is None else f"in {low}..{high}"


def int_arg(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high`` (the error names the bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also digit strings past Python's conversion limit
            raise argparse.ArgumentTypeError(f"expected an integer, got {short(text)}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_bound(low, high)}, got {value}")
        return value

    return parse


def float_arg(low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``[low, high]``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {short(text)}") from None
        if not low <= value <= high:  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        return value

    return parse


def int_list_arg(low: int, high: int, example: str) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each in ``low..high``."""
    def parse(text: str) -> list[int]:
        parts = text.split(",")
        try:
            values = [int(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers like {example}, got {short(text)}") from None
        bad = [v for v in values if not low <= v <= high]
        if bad:
            raise argparse.ArgumentTypeError(
                f"every value must be in {low}..{high}, got {bad[0]} in {short(text)}")
        return values

    return parse


def one_line_error(parser: argparse.ArgumentParser) -> Callable[[str], NoReturn]:
    """argparse's ``error`` as one line on stderr and exit 2 (no usage block)."""
    def error(message: str) -> NoReturn:
        sys.stderr.write(f"{parser.prog}: {one_line(ValueError(message), 500)} "
                         f"(see --help)\n")
        raise SystemExit(EXIT_USAGE)

    return error


def available_memory() -> int | None:
    """Bytes the machine can still give this process (``MemAvailable``, capped by an address
    space limit), or ``None`` where neither is known."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    free: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if limit not in (resource.RLIM_INFINITY, -1):
        free = limit if free is None else min(free, limit)
    return free
