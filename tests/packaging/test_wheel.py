"""The release wheel: installs into a fresh venv, imports without engines, plans a request.

Building a manylinux wheel takes minutes, so this runs when CI=true (building the wheel with
``scripts/build-wheels`` if dist/ has no up-to-date one, and failing if that build fails) or
when an up-to-date wheel is already in dist/. Otherwise it skips with the reason.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Builds a wheel and a fresh venv (CI, scripts/test); one build at a time with the dev-loop tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("build")]
DIST = ROOT / "dist"
BUILD_SCRIPT = ROOT / "scripts" / "build-wheels"

# What goes into the wheel; scripts/build-wheels uses the same list for its own up-to-date check.
SOURCES = ["rust", "python", "Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md", "LICENSE"]
ENGINE_MODULES = ("mooncake", "memfabric_hybrid", "nixl", "nixl_cu12", "torch")
# A failed build is reported by every test that needs the wheel, but attempted once.
_build_failure: list[str] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def _version() -> str:
    """The Cargo workspace version, which maturin gives the Python package."""
    text = (ROOT / "Cargo.toml").read_text()
    pattern = r"^\[workspace\.package\][^\[]*?^version\s*=\s*\"([^\"]+)\""
    m = re.search(pattern, text, re.MULTILINE | re.DOTALL)
    assert m, "Cargo.toml has no [workspace.package] version"
    return m.group(1)


def _is_source(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return not (
        "/target/" in f"/{rel}"
        or "/__pycache__/" in rel
        or rel.endswith(".so")
        or rel.startswith("rust/kvplan-core/fuzz/")
    )


def _newest_source_mtime() -> float:
    newest = 0.0
    for name in SOURCES:
        top = ROOT / name
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        for p in files:
            if _is_source(p):
                newest = max(newest, p.stat().st_mtime)
    return newest


def _wheel_candidates(version: str) -> list[Path]:
    arch = platform.machine()
    return sorted(DIST.glob(f"kvplan-{version}-cp310-abi3-*manylinux*_{arch}.whl"))


def _up_to_date_wheel(version: str) -> Path | None:
    wheels = _wheel_candidates(version)
    if len(wheels) == 1 and wheels[0].stat().st_mtime >= _newest_source_mtime():
        return wheels[0]
    return None


@pytest.fixture(scope="module")
def wheel() -> Path:
    version = _version()
    found = _up_to_date_wheel(version)
    if found is not None:
        return found
    if not _in_ci():
        stale = _wheel_candidates(version)
        why = (
            f"{stale[0].name} is older than the sources"
            if stale
            else f"no kvplan-{version} manylinux wheel in dist/"
        )
        pytest.skip(f"{why}; run scripts/build-wheels (or set CI=true) to test the wheel")
    if _build_failure:
        pytest.fail(_build_failure[0], pytrace=False)
    print(f"test_wheel: building the wheel with {BUILD_SCRIPT.relative_to(ROOT)}", flush=True)
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        _build_failure.append(f"scripts/build-wheels exited {proc.returncode}:\n{tail}")
        pytest.fail(_build_failure[0], pytrace=False)
    found = _up_to_date_wheel(version)
    assert found is not None, (
        f"scripts/build-wheels succeeded but dist/ has no up-to-date kvplan-{version} manylinux"
        f" wheel: {sorted(p.name for p in DIST.glob('*'))}"
    )
    return found


def test_wheel_is_tagged_manylinux(wheel: Path) -> None:
    assert re.search(r"-cp310-abi3-manylinux", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        info = zf.read(f"kvplan-{_version()}.dist-info/WHEEL").decode()
        names = zf.namelist()
    tags = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Tag:")]
    assert tags, info
    assert all(t.startswith("cp310-abi3-manylinux") for t in tags), tags
    assert "Root-Is-Purelib: false" in info
    assert any(re.fullmatch(r"kvplan/_core\.abi3\.so", n) for n in names), names
    assert f"kvplan-{_version()}.dist-info/licenses/LICENSE" in names, names
    # Installed into site-packages itself, where Python runs it at start-up.
    assert f"kvplan-{_version()}.data/purelib/kvplan-sglang-install.pth" in names, names


PROBE = r"""
import importlib.metadata, json, os, sys, sysconfig
import numpy as np
import kvplan

engines = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ENGINE_MODULES
    or m == "kvplan.engines" or m.startswith("kvplan.engines.")
)

item = 1024
n = 4
src = kvplan.Layout.mla([0x10_0000_0000 + i * 2**30 for i in range(n)], [256 * item] * n, item)
dst = kvplan.Layout.mla([0x90_0000_0000 + i * 2**30 for i in range(n)], [256 * item] * n, item)
plan = kvplan.Template(src, dst).plan(
    np.arange(10, 74, dtype=np.int32), np.arange(100, 164, dtype=np.int32)
)
print(json.dumps({
    "engines": engines,
    "file": kvplan.__file__,
    "core": kvplan._core.__file__,
    "version": kvplan.__version__,
    "dist_version": importlib.metadata.version("kvplan"),
    "n_blocks": plan.n_blocks,
    "total_bytes": plan.total_bytes,
    "src0": int(plan.src_addrs[0]),
    "dst0": int(plan.dst_addrs[0]),
    "len0": int(plan.lengths[0]),
    "sglang_hook": os.path.isfile(os.path.join(sysconfig.get_paths()["purelib"],
                                               "kvplan-sglang-install.pth")),
    "sglang_hook_armed": any(type(f).__name__ == "SGLangInstallFinder" for f in sys.meta_path),
}))
""".replace("ENGINE_MODULES", repr(ENGINE_MODULES))


def test_wheel_installs_and_plans_in_fresh_venv(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env_dir = tmp_path_factory.mktemp("wheel-venv") / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") and k != "KVPLAN_SGLANG_INSTALL"}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        check=True,
        env=env,
        cwd=env_dir,
    )
    # -I: no user site, no PYTHON* variables and no current directory on sys.path, so only the
    # installed wheel can provide kvplan.
    out = subprocess.run(
        [str(py), "-I", "-c", PROBE],
        check=True,
        env=env,
        cwd=env_dir,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])

    assert got["engines"] == [], f"import kvplan loaded engine modules: {got['engines']}"
    site = str(env_dir)
    assert got["file"].startswith(site) and got["core"].startswith(site), got
    assert got["version"] == got["dist_version"] == _version(), got
    item = 1024
    assert got["n_blocks"] == 4, got  # one run of 64 pages per layer pair
    assert got["total_bytes"] == 4 * 64 * item, got
    assert got["src0"] == 0x10_0000_0000 + 10 * item, got
    assert got["dst0"] == 0x90_0000_0000 + 100 * item, got
    assert got["len0"] == 64 * item, got
    # The opt-in SGLang hook is in site-packages and off without KVPLAN_SGLANG_INSTALL.
    assert got["sglang_hook"] and not got["sglang_hook_armed"], got

    cli = subprocess.run(
        [str(env_dir / "bin" / "kvplan"), "--help"],
        check=True,
        env=env,
        cwd=env_dir,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert "explain" in cli.stdout, cli.stdout
