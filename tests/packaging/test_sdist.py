"""The source distribution (docs/install.md's path for hosts without a wheel): it must carry
every crate its ``Cargo.lock`` lists from the workspace, a ``Cargo.toml`` whose members agree
with that lock (the build runs ``--locked``), and the SGLang start-up hook that wheels install.

``maturin sdist`` takes about a second. Installing the sdist into a fresh venv and running
``kvplan demo`` there is ``scripts/test-sdist`` (CI runs it from ``scripts/test``).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the CI interpreter is 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
HOOK = "python/kvplan.data/purelib/kvplan-sglang-install.pth"
pytestmark = pytest.mark.xdist_group("build")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    maturin = Path(sys.executable).parent / "maturin"
    if not maturin.exists():
        pytest.fail(f"{maturin} is missing: run scripts/setup-env", pytrace=False)
    out = tmp_path_factory.mktemp("sdist")
    res = subprocess.run([str(maturin), "sdist", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = out.glob("kvplan-*.tar.gz")
    return path


def members(tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """The archive's files by path below its top folder (``kvplan-X.Y.Z/``)."""
    return {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name and m.isfile()}


def read_toml(tar: tarfile.TarFile, info: tarfile.TarInfo) -> dict[str, object]:
    f = tar.extractfile(info)
    assert f is not None
    return tomllib.load(io.BytesIO(f.read()))


def test_sdist_holds_every_workspace_crate_of_its_lock_and_the_sglang_hook(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        files = members(tar)
        lock = read_toml(tar, files["Cargo.lock"])
        manifest = read_toml(tar, files["Cargo.toml"])
        # The lock's workspace crates: the packages with no registry source.
        locked = {p["name"] for p in lock["package"] if "source" not in p}  # type: ignore[union-attr,index]
        workspace = manifest["workspace"]
        assert isinstance(workspace, dict)
        in_sdist = {}
        for member in workspace["members"]:
            crate = f"{member}/Cargo.toml"
            assert crate in files, f"workspace member {member} is not in the sdist"
            name = read_toml(tar, files[crate])["package"]["name"]  # type: ignore[index]
            src = [f for f in files if f.startswith(f"{member}/src/")]
            assert src, f"{member} has no sources in the sdist"
            in_sdist[name] = member
    assert locked == set(in_sdist), (
        f"Cargo.lock's workspace crates {sorted(locked)} != the sdist's members "
        f"{sorted(in_sdist)}: the --locked build would refuse")
    assert {"kvplan-capi", "kvplan-core", "kvplan-mooncake-ffi", "kvplan-py"} <= locked
    assert HOOK in files, "the SGLang start-up hook (the wheel's .pth) is missing"
    hook = (ROOT / HOOK).read_bytes()
    with tarfile.open(sdist) as tar:
        f = tar.extractfile(members(tar)[HOOK])
        assert f is not None and f.read() == hook


def test_sdist_cargo_metadata_resolves_locked_and_offline(sdist: Path, tmp_path: Path) -> None:
    """What ``pip install`` of the sdist runs first (maturin's ``cargo metadata`` under
    ``--locked``), offline: the registry crates are the workspace's, already fetched."""
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.fail("cargo is not on PATH: run scripts/setup-env", pytrace=False)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (top,) = tmp_path.iterdir()
    res = subprocess.run([cargo, "metadata", "--locked", "--offline", "--format-version", "1",
                          "--manifest-path", str(top / "rust/kvplan-py/Cargo.toml")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
