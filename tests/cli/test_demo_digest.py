"""``kvplan demo --verify digest``: the decode process verifies the request from the integrity
digests the prefill processes sent (NIXL: in the completion notification; Mooncake: carried
by the parent), instead of the parent comparing every byte."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvplan.integrity import IntegrityError


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_demo_verify_digest_reports_the_decode_digest_verdict(engine: str) -> None:
    from support.engine_peers import require_mooncake, require_nixl

    (require_nixl if engine == "nixl" else require_mooncake)()
    res = subprocess.run([sys.executable, "-m", "kvplan.cli", "demo", "--verify", "digest",
                          "--engine", engine, "--layers", "16", "--pages", "512", "--pp", "2"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout
    assert "the decode verifying by digest" in out
    assert re.search(r"^verified \(digest\): 2 of 2 prefill stages match, checked by the decode "
                     r"process \(4 plans: plan digest and content digest of 4 KV \+ 24 state "
                     r"pairs, [\d,]+ bytes\)$", out, re.M), out
    assert "bytes OK" not in out  # the parent's byte comparison did not run
    if engine == "nixl":
        assert "notifications:  2 of 2" in out


def test_demo_verify_defaults_to_bytes_and_refuses_other_values(capsys: Any) -> None:
    import argparse

    from kvplan import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args([]).verify == "bytes"
    with pytest.raises(SystemExit):
        parser.parse_args(["--verify", "crc"])
    assert "invalid choice: 'crc'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown verification 'crc'"):
        demo.run_demo(demo.demo_model(8), pages=8, verify="crc")


class _Decode:
    """The decode peer's ``check_digest`` answers: stage name -> plans verified, or the
    IntegrityError the real peer process re-raises in the parent."""

    def __init__(self, answers: dict[bytes, Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[Any, ...]] = []

    def call(self, cmd: str, *args: Any, timeout: float) -> int:
        assert cmd == "check_digest"
        self.calls.append(args)
        answer = self.answers[args[-1]]
        if isinstance(answer, BaseException):
            raise answer
        return int(answer)


class _Stage:
    def __init__(self, name: str) -> None:
        self.spec = type("Spec", (), {"name": name})()
        self.session = f"session-{name}"
        self.layout_wire = name.encode() + b"-layout"


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_demo_digest_verdict_names_the_failing_stage_and_counts_the_rest(engine: str) -> None:
    from kvplan import demo

    bad = IntegrityError("integrity check failed for prefill pp 1/2 tp 0/1 -> decode pp 0/1 "
                         "tp 0/1: the bytes of 1 of 14 entry pairs differ")
    dpeer = _Decode({b"p0": 2, b"p1": bad})
    stages = [_Stage("p0"), _Stage("p1")]
    report = demo.DemoReport("m", 8, 2, 2, 16, 8, engine=engine, verify="digest")
    pages = np.arange(4, dtype=np.int64)
    error = demo._check_digests(report, dpeer, stages, [b"m0", b"m1"],  # type: ignore[arg-type]
                                pages, pages, 1, 1)
    assert error == str(bad)
    assert (report.digest_stages, report.digest_plans) == (1, 2)
    # Mooncake: the parent carries each stage's own manifests; NIXL: the decode waits for them.
    carried = [args[1] for args in dpeer.calls]
    assert carried == ([None, None] if engine == "nixl" else [b"m0", b"m1"])
    assert [args[0] for args in dpeer.calls] == [b"p0-layout", b"p1-layout"]
    report.error = error
    assert report.lines()[-1] == f"VERIFICATION FAILED: {bad}"


def test_demo_refuses_stream_with_digest_verification(capsys: Any) -> None:
    import argparse

    from kvplan import demo

    parser = argparse.ArgumentParser()
    run = demo.add_arguments(parser)
    assert run(parser.parse_args(["--stream", "--verify", "digest"])) == 2
    assert "--stream verifies every byte itself" in capsys.readouterr().err
