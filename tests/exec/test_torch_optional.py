"""torch stays optional: ``import kvplan`` (and kvplan.testing) never imports it, and
``import kvplan.torch`` without it says what to install. Runs without torch."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_import_kvplan_does_not_import_torch() -> None:
    done = run(
        "import sys, kvplan, kvplan.testing.oracle, kvplan.testing.ranks; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith('kvplan.torch')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_kvplan_torch_without_torch_names_the_extra() -> None:
    # None in sys.modules makes `import torch` fail as if torch were not installed.
    done = run(
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import kvplan.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert (
        "kvplan.torch needs PyTorch, which is not installed: pip install 'kvplan[torch]'"
        in done.stdout
    )
