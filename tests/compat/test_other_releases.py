"""The compat tests again under the vLLM releases a plain process does not load (0.32.0's CPU
build and 0.34.0; 0.33.0 runs in-process): one child pytest per release for every file at once,
so the child's start-up (a fresh interpreter, kvplan and the release's wheel loaded) is paid
once per release, not once per file.

Each test file declares, beside its tests, what runs again: a module-level
``RERUN_UNDER_RELEASES`` mapping a release to the names of the tests whose path goes through
vLLM code that differs between the releases (a function's name runs all its parametrizations;
``name[id]`` one of them), or to :data:`support.vllm_loader.ALL_TESTS` for the whole file.
A name the file no longer has fails the child run (pytest finds no such test); the child's
failures are named by their node ids. ``tests/conftest.py`` moves these two tests to the front
of the collection, each in its own xdist group, so the two children start early on two workers.
"""

from __future__ import annotations

import importlib
import os
import re

import pytest

from support.vllm_loader import ALL_TESTS, OTHER_RELEASES, rerun_under_release

HERE = os.path.dirname(os.path.abspath(__file__))
_DECLARES = re.compile(r"^RERUN_UNDER_RELEASES\b", re.M)


def declared_reruns() -> dict[str, list[str]]:
    """Every compat file's declared reruns, by release: node ids (a whole file: its path)."""
    by_release: dict[str, list[str]] = {release: [] for release in OTHER_RELEASES}
    for name in sorted(os.listdir(HERE)):
        path = os.path.join(HERE, name)
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        with open(path, encoding="utf-8") as f:
            if not _DECLARES.search(f.read()):
                continue
        # the module pytest imported (tests/compat is on sys.path: test modules are top-level)
        module = importlib.import_module(name[:-3])
        for release, names in module.RERUN_UNDER_RELEASES.items():
            assert release in by_release, f"{name}: {release!r} is not one of {OTHER_RELEASES}"
            if names == ALL_TESTS:
                by_release[release].append(path)
            else:
                assert names and not isinstance(names, str), f"{name}: {names!r}"
                by_release[release].extend(f"{path}::{test}" for test in names)
    return by_release


@pytest.mark.skipif(os.environ.get("KVPLAN_VLLM_RELEASE") is not None,
                    reason="this process already runs the release it was given")
@pytest.mark.parametrize("release", [
    pytest.param(release, marks=pytest.mark.xdist_group(f"vllm-release-{release}"))
    for release in OTHER_RELEASES])
def test_other_releases(release: str) -> None:
    node_ids = declared_reruns()[release]
    assert node_ids, f"no compat file declares a rerun under {release}"
    rerun_under_release(node_ids, release)
