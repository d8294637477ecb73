"""``kvplan demo`` on small models: every in-range ``--layers`` / ``--pp`` either runs and
verifies or is refused in one line (exit 2), never a traceback with exit 1, the status the demo
keeps for a wrong byte.

With the demo's model (full attention on every 4th layer), 4 layers at PP=2 leave the first
stage with state layers only: it owns no KV page pool at all.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvplan import cli


def run_demo_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvplan.cli", "demo", "--pages", "64", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.mooncake
@pytest.mark.parametrize("argv", [("--layers", "4", "--pp", "2"),
                                  ("--layers", "5", "--pp", "2", "--verify", "digest")])
def test_demo_runs_when_a_prefill_stage_holds_no_full_attention_layer(argv: tuple[str, ...]
                                                                      ) -> None:
    from support.engine_peers import require_mooncake

    require_mooncake()
    res = run_demo_cli(*argv)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "VERIFICATION FAILED" not in res.stdout
    assert "1 full-attention (MLA)" in res.stdout, res.stdout
    assert ("verified: " in res.stdout) or ("2 of 2 prefill stages match" in res.stdout), \
        res.stdout


def test_demo_refuses_cross_layer_when_a_stage_has_no_kv_pool(capsys: Any) -> None:
    rc = cli.main(["demo", "--layers", "4", "--pp", "3", "--layout", "cross-layer",
                   "--pages", "64"])
    out = capsys.readouterr()
    if "needs the Mooncake Transfer Engine" in out.err:  # pragma: no cover - broken env
        pytest.fail(out.err)
    assert rc == 2, (rc, out.out, out.err)
    assert out.out == ""
    assert out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
    assert ("--layout cross-layer needs a full-attention layer (every 4th) on every prefill "
            "stage; with --layers 4 --pp 3 stage(s) [0, 1] hold none") in out.err, out.err


def test_an_unexpected_exception_exits_3_never_the_wrong_byte_status(
        monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from kvplan import demo

    def broken(*_: Any, **__: Any) -> Any:
        raise StopIteration("a defect")

    monkeypatch.setattr(demo, "run_demo", broken)
    rc = cli.main(["demo", "--layers", "8", "--pages", "64"])
    err = capsys.readouterr().err
    assert rc == cli.INTERNAL_ERROR_STATUS == 3, (rc, err)
    assert "kvplan demo: internal error (StopIteration: a defect); exit 3" in err, err
