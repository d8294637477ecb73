"""What the benchmarks share: timing loops (``timing``), the machine they ran on (``machine``),
where and how results are written (``results``), and the torch benchmarks' device tensors and
MHA layouts (``torch_pools``, which imports torch).

Importing this package also makes the test support package importable as ``support``
(``tests/support``: the SGLang loader, synthetic SGLang deployments, the leak workload), by
putting ``tests/`` at the front of ``sys.path`` as ``tests/conftest.py`` does. The benchmarks may use the
tests' support code; the tests never import anything from ``bench/``.
"""

from __future__ import annotations

import os
import sys

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH_DIR)
TESTS_DIR = os.path.join(REPO, "tests")

if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
