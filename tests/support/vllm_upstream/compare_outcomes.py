"""Compare two pytest JUnit XML reports test id by test id (scripts/test-vllm-upstream).

    python compare_outcomes.py ALONE.xml KVPLAN.xml [EXPECTED_DIFFERENCES]
    python compare_outcomes.py --passing-ids ALONE.xml > passing-alone-VERSION.txt

Prints each run's counts (passed / failed / skipped / error). Exits 1, listing every differing
test id with both outcomes, when a test id's outcome differs between the runs or a test id is in
one report only. An outcome is ``passed``, ``skipped``, or ``failed`` / ``error`` with the
exception's type (``failed AssertionError``): a test that fails on vLLM alone must fail the same
way with kvplan installed. The messages themselves are not compared (they carry addresses, ports
and timings that differ between any two runs).

EXPECTED_DIFFERENCES lists test ids (a tab, then the reason) that pass on vLLM alone and fail
with kvplan for a stated reason; each must still do exactly that (an entry whose outcomes no
longer differ, or differ otherwise, fails the comparison as stale).
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET

_TYPE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Failed|Interrupt|Warning|"
                   r"Timeout|Skipped|Iteration)\w*)\b")


def _kind(element: ET.Element) -> str:
    """The exception type a <failure>/<error> element names (``type``, else the message)."""
    for text in (element.get("type") or "", element.get("message") or "",
                 (element.text or "").strip().splitlines()[-1:][0] if element.text else ""):
        text = text.strip()
        found = _TYPE.match(text.removeprefix("E ").strip())
        if found:
            return found.group(1).rsplit(".", 1)[-1]
    return "?"


def outcomes(path: str) -> dict[str, str]:
    """Test id -> outcome for one JUnit report. A test with a failing setup or teardown beside
    its call is reported as ``error``, as pytest's own summary counts it."""
    result: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        found = "passed"
        for child in case:
            if child.tag == "error":
                found = f"error {_kind(child)}"
            elif child.tag == "failure" and not found.startswith("error"):
                found = f"failed {_kind(child)}"
            elif child.tag == "skipped" and found == "passed":
                found = "skipped"
        previous = result.get(test_id)
        if previous is not None and previous != found:  # junit repeats a case for a teardown error
            found = previous if previous.startswith("error") else found
        result[test_id] = found
    return result


def counts(result: dict[str, str]) -> str:
    tally = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for outcome in result.values():
        tally[outcome.split()[0]] += 1
    return ", ".join(f"{n} {k}" for k, n in tally.items())


def expected_differences(path: str) -> dict[str, str]:
    """Test id -> reason, from a file of ``id<TAB>reason`` lines (``#`` comments)."""
    expected: dict[str, str] = {}
    with open(path) as lines:
        for line in lines:
            if line.strip() and not line.startswith("#"):
                test_id, _, reason = line.rstrip("\n").partition("\t")
                expected[test_id] = reason
    return expected


def passing_node_ids(path: str) -> list[str]:
    """The pytest node ids (``tests/.../test_x.py::Class::test[param]``) that passed in one
    JUnit report, sorted: what ``--passing`` runs, one per line (pytest's ``@file``)."""
    ids = set()
    for case in ET.parse(path).getroot().iter("testcase"):
        if any(child.tag in ("failure", "error", "skipped") for child in case):
            continue
        parts = (case.get("classname") or "").split(".")
        module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
        ids.add("/".join(parts[:module + 1]) + ".py::"
                + "::".join([*parts[module + 1:], case.get("name") or ""]))
    return sorted(ids)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--passing-ids":
        ids = passing_node_ids(argv[2])
        if not ids:
            print(f"no passed test in {argv[2]}", file=sys.stderr)
            return 1
        print("\n".join(ids))
        return 0
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    alone, kvplan = outcomes(argv[1]), outcomes(argv[2])
    expected = expected_differences(argv[3]) if len(argv) == 4 else {}
    print(f"vLLM alone:          {len(alone)} tests: {counts(alone)}")
    print(f"kvplan installed:    {len(kvplan)} tests: {counts(kvplan)}")
    if not alone:
        print("no test ran on vLLM alone", file=sys.stderr)
        return 1
    differ, stale, explained = [], [], []
    for test_id in sorted(alone.keys() | kvplan.keys()):
        a, b = alone.get(test_id, "absent"), kvplan.get(test_id, "absent")
        if test_id in expected:
            if a == "absent" and b == "absent":
                continue  # not selected in this run
            if a == "passed" and b.startswith("failed"):
                explained.append((test_id, expected[test_id]))
            else:
                stale.append((test_id, a, b))
        elif a != b:
            differ.append((test_id, a, b))
    for test_id, reason in explained:
        print(f"  expected difference: {test_id}: {reason}")
    if stale:
        print(f"{len(stale)} expected difference(s) no longer as listed (stale entries):")
        for test_id, a, b in stale:
            print(f"  {test_id}: {a} -> {b}")
    if differ:
        print(f"{len(differ)} test id(s) whose outcome differs (vLLM alone -> kvplan installed):")
        for test_id, a, b in differ:
            print(f"  {test_id}: {a} -> {b}")
    return 1 if differ or stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
