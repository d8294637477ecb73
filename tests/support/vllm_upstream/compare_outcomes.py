"""Compare two pytest JUnit XML reports test id by test id (scripts/test-vllm-upstream).

    python compare_outcomes.py ALONE.xml KVPLAN.xml

Prints each run's counts (passed / failed / skipped / error). Exits 1, listing every differing
test id with both outcomes, when a test id's outcome differs between the runs or a test id is in
one report only. An outcome is ``passed``, ``skipped``, or ``failed`` / ``error`` with the
exception's type (``failed AssertionError``): a test that fails on vLLM alone must fail the same
way with kvplan installed. The messages themselves are not compared (they carry addresses, ports
and timings that differ between any two runs).
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


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    alone, kvplan = outcomes(argv[1]), outcomes(argv[2])
    print(f"vLLM alone:          {len(alone)} tests: {counts(alone)}")
    print(f"kvplan installed:    {len(kvplan)} tests: {counts(kvplan)}")
    differ = [(test_id, alone.get(test_id, "absent"), kvplan.get(test_id, "absent"))
              for test_id in sorted(alone.keys() | kvplan.keys())
              if alone.get(test_id) != kvplan.get(test_id)]
    if not alone:
        print("no test ran on vLLM alone", file=sys.stderr)
        return 1
    if differ:
        print(f"{len(differ)} test id(s) whose outcome differs (vLLM alone -> kvplan installed):")
        for test_id, a, b in differ:
            print(f"  {test_id}: {a} -> {b}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
