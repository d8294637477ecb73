"""``kvplan demo --stream``: real processes stream layer groups during a synthetic forward,
the decode verifies every byte, and the report puts both transfer tails on one line."""

from __future__ import annotations

import pytest

from kvplan.demo import demo_model, run_stream_demo


@pytest.mark.mooncake
def test_stream_demo_verifies_every_byte_and_reports_both_tails() -> None:
    from support.engine_peers import require_mooncake

    require_mooncake()
    lines = run_stream_demo(demo_model(16), pages=64, prefill_pp=2, layer_ms=1.0, group_size=4)
    assert lines[-1] != "error", lines
    assert any(line.startswith("verified:       streaming every byte; monolithic every byte")
               for line in lines), lines
    tail = [line for line in lines if line.startswith("tail:")]
    assert len(tail) == 1 and "streaming" in tail[0] and "monolithic" in tail[0], lines
