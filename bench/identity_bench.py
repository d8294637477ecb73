"""Cost of a layout's identity (kvplan.layout_identity: the canonical encoding, its SHA-256 and
the two ids) per layout, for the presets' layouts, from Python (what a connector pays at start-up
and per handshake) and, for scale, of a compatibility verdict between two such identities.
Target: <= 10 us per layout. Medians of REPEATS timed batches of CALLS calls each.

    .venv/bin/python bench/identity_bench.py
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import kvplan
from kvplan import ModelSemantics, compatibility, layout_identity
from kvplan.presets import PRESETS

CALLS, REPEATS = 2000, 7
SEMANTICS = ModelSemantics(model="org/model", revision="0123456789abcdef",
                           rope={"type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 4096},
                           drafts=("org/draft",), transfer="push")


def per_call_us(fn: Callable[[], object], calls: int = CALLS) -> float:
    fn()
    batches = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - t) / calls)
    return statistics.median(batches) * 1e6


def main() -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, load {os.getloadavg()[0]:.1f}")
    print(f"{'layout':<34} {'entries':>7} {'encoding B':>10} {'identity us':>11} "
          f"{'verdict us':>10}")
    worst = 0.0
    for key, preset in PRESETS.items():
        layout = preset.layout(range(preset.num_layers), page_size=16, capacity=64)
        identity = layout_identity(layout, SEMANTICS)
        us = per_call_us(functools.partial(layout_identity, layout, SEMANTICS))
        verdict_us = per_call_us(functools.partial(compatibility, identity, identity), calls=200)
        worst = max(worst, us)
        name = f"{preset.name} ({preset.num_layers} layers)"
        print(f"{name:<34} {len(layout):>7} {len(identity.class_encoding()):>10} {us:>11.2f} "
              f"{verdict_us:>10.1f}")
    print(f"worst identity: {worst:.2f} us per layout "
          f"({'meets' if worst <= 10 else 'misses'} the target <= 10 us)")
    print(f"kvplan {kvplan.__version__}")


if __name__ == "__main__":
    main()
