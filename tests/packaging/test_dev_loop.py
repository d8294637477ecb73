"""The development loop: `scripts/dev-build` rebuilds the extension that the tests import, and
fails loudly when it cannot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvplan._core

ROOT = Path(__file__).resolve().parents[2]
DEV_BUILD = ROOT / "scripts" / "dev-build"
EXTENSION = Path(kvplan._core.__file__).resolve()

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("build"), pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "maturin").exists() or EXTENSION.parent != ROOT / "python" / "kvplan",
    reason="needs the editable development install made by scripts/setup-env (.venv with maturin)",
)]


def test_dev_build_failure_is_an_error():
    # The script filters maturin's output; the filter must not turn maturin's failure into success.
    result = subprocess.run(["bash", str(DEV_BUILD), "--no-such-maturin-flag"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "no-such-maturin-flag" in result.stdout + result.stderr


def test_dev_build_after_a_rust_edit_replaces_the_imported_extension():
    before = EXTENSION.stat()
    # An edit, as cargo sees it: the bindings crate's root is newer than its last build.
    lib_rs = ROOT / "rust" / "kvplan-py" / "src" / "lib.rs"
    os.utime(lib_rs)
    result = subprocess.run(["bash", str(DEV_BUILD)], capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    after = EXTENSION.stat()
    # A new file (new inode: maturin replaces it, so processes that loaded the old one are safe),
    # written after the edit.
    assert (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns)
    assert after.st_mtime_ns >= lib_rs.stat().st_mtime_ns
    # A fresh interpreter imports the rebuilt file and it plans.
    probe = (
        "import numpy as np, kvplan, kvplan._core as c\n"
        "src = kvplan.Layout.mla([4096], [64 * 16], [64])\n"
        "dst = kvplan.Layout.mla([1 << 20], [64 * 16], [64])\n"
        "p = kvplan.Template(src, dst).plan(np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64))\n"
        "print(c.__file__, p.n_blocks, p.total_bytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert Path(out[0]).resolve() == EXTENSION and out[1:] == ["1", "256"]
