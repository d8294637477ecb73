"""The test suite's root: where the support package is found, and the hypothesis profiles.

The tests live in folders that follow the code (``core/`` for the planner's contract,
``features/<feature>/``, ``python/``, ``exec/``, ``capi/``, ``engines/``, ``compat/``, ``cli/``,
``robustness/``, ``packaging/``; docs/development.md's feature index maps each feature to its
folder), none of them a package; what they share is the one support package ``tests/support``,
imported as ``support``. This file puts ``tests/`` at the front of
``sys.path`` before any test module is collected, so ``from support import ...`` works from
every folder and under any pytest import mode; processes started with multiprocessing's
``spawn`` method get the same ``sys.path`` from their parent. A test module's basename must be
unique across the folders (they are imported as top-level modules).

Hypothesis profiles: the test suite is deterministic; random exploration is a separate command.

- ``deterministic`` (the default, and the only profile allowed when ``CI=true``): every hypothesis test draws its examples from
  a seed derived from the test itself (``derandomize=True``) and reads no example database, so the
  same code gives the same verdict on every run and every machine.
- ``explore`` (selected by ``KVPLAN_HYPOTHESIS_PROFILE=explore``, which ``scripts/fuzz`` sets):
  fresh random seeds on every run, for open-ended search. Anything it finds becomes an
  ``@example`` (or a fixed case) in the suite, so the deterministic run keeps checking it.

``KVPLAN_HYPOTHESIS_EXAMPLES=N`` (a whole number; ``scripts/property-suites`` sets it) makes every
collected hypothesis test draw N examples instead of its own ``max_examples``, under either
profile: a long run of the properties at one size. Unset, each test keeps its own size.
"""

from __future__ import annotations

import os
import sys

from hypothesis import HealthCheck, settings

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

settings.register_profile(
    "deterministic",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
)
PROFILE = os.environ.get("KVPLAN_HYPOTHESIS_PROFILE", "deterministic")
if PROFILE not in ("deterministic", "explore"):
    raise RuntimeError(
        f"KVPLAN_HYPOTHESIS_PROFILE must be 'deterministic' or 'explore', got {PROFILE!r}"
    )
if PROFILE == "explore":
    if os.environ.get("CI", "").lower() == "true":
        # CI's verdict must not depend on the draw: random search is a separate command.
        raise RuntimeError("KVPLAN_HYPOTHESIS_PROFILE=explore is refused when CI=true; "
                           "CI runs the deterministic profile (random search: scripts/fuzz)")
    # Registered only when selected (and never under CI), so no run of the suite can load a
    # randomized profile by name.
    settings.register_profile(
        "explore",
        derandomize=False,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
settings.load_profile(PROFILE)

_EXAMPLES = os.environ.get("KVPLAN_HYPOTHESIS_EXAMPLES", "")
if _EXAMPLES and not (_EXAMPLES.isdigit() and int(_EXAMPLES) > 0):
    raise RuntimeError(
        f"KVPLAN_HYPOTHESIS_EXAMPLES must be a whole number above 0, got {_EXAMPLES!r}"
    )


def pytest_collection_modifyitems(items):
    """The compat reruns under the other vLLM releases (``compat/test_other_releases.py``, one
    long child pytest each) go first: pytest-xdist hands out work in collection order (after
    its multi-test xdist groups), so started first they run beside the rest instead of
    forming the run's tail.

    With ``KVPLAN_HYPOTHESIS_EXAMPLES`` set, every hypothesis test draws that many examples.
    A test's own ``@settings(max_examples=...)`` outranks any profile, so the count is set on
    the test's settings, which hypothesis reads when the test runs.
    """
    first = [item for item in items if item.path.name == "test_other_releases.py"]
    if first:
        items[:] = first + [item for item in items if item.path.name != "test_other_releases.py"]
    if not _EXAMPLES:
        return
    for item in items:
        test = getattr(item, "obj", None)
        if not getattr(test, "is_hypothesis_test", False):
            continue
        own = getattr(test, "_hypothesis_internal_use_settings", None) or settings.default
        test._hypothesis_internal_use_settings = settings(own, max_examples=int(_EXAMPLES))


def pytest_report_header(config):  # noqa: ARG001 (pytest hook signature)
    examples = f", {_EXAMPLES} examples per test" if _EXAMPLES else ""
    return f"hypothesis profile: {PROFILE}{examples}"
