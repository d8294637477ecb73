"""How numbers read in RESULTS.md."""

from __future__ import annotations

import math


def fmt_ns(ns: float) -> str:
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "–"
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_ratio(x):
    if x is None or math.isnan(x):
        return "–"
    return f"{x:,.0f}×" if x >= 10 else f"{x:.1f}×"


def status(ok: bool, how: str) -> str:
    return f"met ({how})" if ok else f"**missed** ({how})"
