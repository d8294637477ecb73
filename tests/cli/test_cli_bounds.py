"""Every console option is bounded and validated up front: bad values, typos and requests that
cannot fit in memory end in one line on stderr and exit 2 (never a traceback, exit 1, an
out-of-memory kill or a run of minutes); options that have no effect say so; ``--version``."""

from __future__ import annotations

import pytest

from kvplan import cli
from kvplan.demo import stream_regime


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line_usage_error(rc: int, out: str, err: str, prefix: str, *needles: str) -> None:
    assert rc == 2, (rc, out, err)
    assert out == "" and "Traceback" not in err, (out, err)
    (line,) = err.splitlines()
    assert line.startswith(prefix), line
    for needle in needles:
        assert needle in line, (needle, line)


@pytest.mark.parametrize(("argv", "needles"), [
    (["--pages", str(10**12)], ["--pages", "1..4194304", str(10**12)]),
    (["--pages", str(10**8)], ["--pages", str(10**8)]),
    (["--layers", str(10**6)], ["--layers", "4..1024"]),
    (["--layers", "3"], ["--layers", "4..1024", "got 3"]),
    (["--seed", "-1"], ["--seed", "got -1"]),
    (["--pp", "0"], ["--pp"]),
    (["--pp", "40", "--layers", "8"], ["--pp must be at most --layers (8), got 40"]),
    (["--request-pages", "9000"], ["--request-pages must be at most --pages (8192), got 9000"]),
    (["--layer-ms", "5"], ["--layer-ms and --stream-group apply only with --stream"]),
    (["--stream", "--layer-ms", "nan"], ["--layer-ms", "nan"]),
    (["--stream", "--layer-ms", "-1"], ["--layer-ms"]),
    (["--stream", "--stream-group", "0"], ["--stream-group"]),
    (["--max-blocks", "0"], ["--max-blocks"]),
    (["--state-slots", "0"], ["--state-slots"]),
])
def test_demo_refuses_bad_options_in_one_line(capsys: pytest.CaptureFixture[str],
                                              argv: list[str], needles: list[str]) -> None:
    rc, out, err = _run(capsys, "demo", *argv)
    _one_line_usage_error(rc, out, err, "kvplan demo: ", *needles)


def test_demo_refuses_arenas_larger_than_half_the_free_memory(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplan import _cli_args

    monkeypatch.setattr(_cli_args, "available_memory", lambda: 1 << 30)  # 1 GiB free
    rc, out, err = _run(capsys, "demo", "--pages", "65536")  # ~1.8 GiB of arenas
    _one_line_usage_error(rc, out, err, "kvplan demo: ", "--pages 65,536", "1.00 GiB",
                          "lower --pages")


def test_explain_refuses_a_request_that_cannot_fit_before_allocating(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "explain", "--preset", "deepseek-v3", "--pages", "1000000000")
    _one_line_usage_error(rc, out, err, "kvplan explain: ", "--pages 1,000,000,000", "GiB",
                          "lower --pages")


def test_explain_refuses_blocks_that_cannot_fit_by_the_cores_count(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The index arrays of 100,000 pages fit in 128 MiB, the core's 6,100,000 blocks of the
    fully fragmented DeepSeek-V3 request (61 layers x 100,000 runs) do not: refused before
    planning, naming the core's count."""
    from kvplan import _cli_args

    monkeypatch.setattr(_cli_args, "available_memory", lambda: 256 << 20)
    rc, out, err = _run(capsys, "explain", "--preset", "deepseek-v3", "--pages", "100000",
                        "--fragmentation", "1")
    _one_line_usage_error(rc, out, err, "kvplan explain: ", "--pages 100,000",
                          "6,100,000 blocks", "lower --pages")


def test_explain_refuses_an_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "explain", "--preset", "deepseek-v3", "--backend", "acsend")
    _one_line_usage_error(rc, out, err, "kvplan explain: ", "--backend", "'acsend'", "ascend")


def test_explain_says_when_a_start_layer_has_no_effect(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "explain", "--preset", "kimi-linear", "--pp", "2",
                      "--prefill-start-layer", "0,10")
    assert rc == 0
    assert ("--prefill-start-layer has no effect on stage 0/2, stage 1/2: they pair by layer "
            "id, not by legacy slicing") in out
    rc, out, _ = _run(capsys, "explain", "--preset", "kimi-linear", "--pp", "2")
    assert rc == 0 and "no effect" not in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    rc, out, _ = _run(capsys, "--version")
    assert rc == 0 and out.strip() == f"kvplan {version('kvplan')}"


def test_the_stream_report_names_its_regime_and_by_how_much() -> None:
    hidden = stream_regime(0.030, 0.240, 0.100)
    assert hidden.startswith("compute hides the transfer: after the last layer only the last "
                             "group's transfer was left, 0.30x one group's compute (100.0 ms)")
    assert hidden.endswith("streamed tail 30.0 ms = 0.12x the monolithic 240.0 ms, 88% of it "
                           "hidden")
    bound = stream_regime(0.300, 0.400, 0.100)
    assert bound.startswith("transfer-bound: the tail is 3.0x one group's compute (100.0 ms), "
                            "so slices queued behind each other; streamed tail 300.0 ms = "
                            "0.75x the monolithic 400.0 ms, 25% of it hidden")
    assert bound.endswith("raise --layer-ms or lower --pages to see compute hide the transfer")
