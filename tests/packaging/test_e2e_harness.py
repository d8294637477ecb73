"""The live end-to-end drivers' own logic, without servers: which failures are kvplan's and which
the environment's, the one retry of a reference set, the server phases, the warm-up, the
thread and NIXL settings, and the build lock around the wheel build."""

from __future__ import annotations

import contextlib
import fcntl
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))

import e2e_harness as harness  # noqa: E402
import vllm_e2e  # noqa: E402


def fake_setup(tmp_path: Path) -> vllm_e2e.Setup:
    venv = harness.Venv(tmp_path / "venv", steps=[])
    models = {k: tmp_path / k for k in "abc"}
    return vllm_e2e.Setup(venv, models, tmp_path / "033", True, tmp_path / "034")


def test_reference_failure_is_environment_and_kvplan_failure_is_kvplan(capsys: Any) -> None:
    results = harness.Results()
    ref = results.part(environment=True)
    ref.record("nixl vllm-reference: partial block", False, "HTTP 500")
    results.note_retry("nixl vllm-reference", ref)
    again = results.part(environment=True)
    again.record("nixl vllm-reference: partial block [retry]", True)
    results.absorb(again)
    mine = results.part(environment=False)
    mine.record("nixl kvplan vllm-0.32: partial block", False, "HTTP 500")
    results.absorb(mine)
    results.skip("nixl kvplan vllm-0.34-module: all cases", "why")
    out = capsys.readouterr().out
    assert "ENV-FAIL  nixl vllm-reference: partial block  (HTTP 500)" in out
    assert "FAIL  nixl kvplan vllm-0.32: partial block" in out
    assert "RETRY nixl vllm-reference: 1 of 1 cases of the engine's own connector failed" in out
    assert (results.passed, results.failed, results.skipped) == (1, 1, 1)
    assert results.summary_lines("e2e-vllm") == [
        "e2e-vllm: 1 passed, 1 failed, 1 skipped",
        "e2e-vllm kvplan cases: 0 passed, 1 failed",
        "e2e-vllm reference (environment) cases: 1 passed, 0 failed; sets run again after an "
        "environment failure: nixl vllm-reference (1 of 1 failed on the first run)"]


def test_serve_prepared_exit_code_counts_failures_not_skips(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.write_text("{}")

    def only_skips_and_passes(_: str) -> harness.Results:
        r = harness.Results()
        r.record("a", True)
        r.skip("b", "not here")
        return r

    def env_failure(_: str) -> harness.Results:
        r = harness.Results(environment=True)
        r.record("a", False)
        return r

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(harness.LOCK_HELD_ENV, "1")
        assert harness.serve_prepared("t", str(state), only_skips_and_passes) == 0
        assert harness.serve_prepared("t", str(state), env_failure) == 1


def run_with_outcomes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: set[str],
                      only: list[str], gate: str | None = None) -> tuple[list[str],
                                                                      harness.Results]:
    """run_servers with run_connector replaced: each set records one case, failing when its
    label is in ``fail`` (every run of it)."""
    calls: list[str] = []

    def fake_run_connector(servers: Any, connector: vllm_e2e.Connector, reference: Any,
                           results: harness.Results, suffix: str = "") -> None:
        calls.append(connector.label + suffix)
        results.record(f"{connector.label}: case{suffix}", connector.label not in fail)

    monkeypatch.setenv("KVPLAN_E2E_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(vllm_e2e, "run_connector", fake_run_connector)
    monkeypatch.setattr(vllm_e2e, "run_staged", fake_run_connector)
    monkeypatch.setattr(vllm_e2e, "vllm034_gate",
                        lambda setup: {"mooncake": gate, "nixl": gate})
    results = vllm_e2e.run_servers(fake_setup(tmp_path), only)
    return calls, results


def test_a_failed_reference_set_runs_once_more_and_a_kvplan_set_never(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls, results = run_with_outcomes(tmp_path, monkeypatch,
                                       {"nixl vllm-reference", "nixl kvplan vllm-0.32"},
                                       ["nixl vllm-reference", "nixl kvplan vllm-0.32"])
    # (--only matches by substring: the 0.34 reference set runs too, and passes.)
    assert calls == ["nixl vllm-reference", "nixl vllm-reference [retry]",
                     "nixl kvplan vllm-0.32", "nixl vllm-reference vllm-0.34-module"]
    # The reference failed twice: an environment failure, counted; kvplan's failure counted
    # as kvplan's.
    assert (results.failed, results.env_failed) == (2, 1)
    assert results.retried == ["nixl vllm-reference (1 of 1 failed on the first run)"]


def test_a_reference_that_passes_on_the_retry_counts_the_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def flaky(servers: Any, connector: vllm_e2e.Connector, reference: Any,
              results: harness.Results, suffix: str = "") -> None:
        calls.append(connector.label + suffix)
        results.record(f"{connector.label}: case{suffix}", calls.count(connector.label) > 1
                       or connector.label != "mooncake vllm-reference" or bool(suffix))

    monkeypatch.setenv("KVPLAN_E2E_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(vllm_e2e, "run_connector", flaky)
    monkeypatch.setattr(vllm_e2e, "vllm034_gate",
                        lambda setup: {"mooncake": None, "nixl": None})
    results = vllm_e2e.run_servers(fake_setup(tmp_path), ["mooncake vllm-reference"])
    # "mooncake vllm-reference" names the 0.32 set and the by-name-only 0.33/0.34 ones; the
    # first one's retry passes.
    assert calls[:2] == ["mooncake vllm-reference", "mooncake vllm-reference [retry]"]
    assert calls.count("mooncake vllm-reference [retry]") == 1
    assert results.failed == 0 and results.env_passed == results.passed == len(calls) - 1


def test_0_34_sets_are_skipped_with_the_gate_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls, results = run_with_outcomes(tmp_path, monkeypatch, set(), ["vllm-0.34-module"],
                                       gate="IncompatibleHostError: no")
    assert calls == []
    assert results.skipped == 4 and results.failed == 0
    assert all("IncompatibleHostError: no" in line for line in results.lines)


def test_the_default_run_includes_kvplan_over_0_34_modules(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls, _ = run_with_outcomes(tmp_path, monkeypatch, set(), [])
    assert "mooncake kvplan vllm-0.34-module" in calls
    assert "nixl kvplan vllm-0.34-module" in calls
    assert "mooncake kvplan staged vllm-0.32" in calls
    assert not any("vllm-reference vllm-0.3" in c for c in calls)


def test_at_most_three_servers_serve_at_once_and_each_pair_warms_up_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    alive: list[int] = []

    @contextlib.contextmanager
    def running(servers: Sequence[harness.Server], timeout: float
                ) -> Iterator[Sequence[harness.Server]]:
        alive.append(len(servers))
        events.append("start " + ",".join(s.name.rsplit("-", 1)[-1] for s in servers))
        yield servers

    monkeypatch.setattr(harness, "running", running)
    monkeypatch.setattr(harness.Server, "stop", lambda self, grace_s=30.0: None)
    monkeypatch.setattr(vllm_e2e, "collect_reference",
                        lambda plain, results: {n: [1] for n in vllm_e2e.PROMPTS})
    monkeypatch.setattr(vllm_e2e, "connector_in_use", lambda c, g: "ok")
    monkeypatch.setattr(vllm_e2e.PdPair, "warm_up",
                        lambda self: events.append(f"warm {self.prefill.name}") or "w")
    monkeypatch.setattr(vllm_e2e, "compare_equal",
                        lambda pair, n, k, ref: events.append(f"case {n}") or "ok")
    monkeypatch.setattr(vllm_e2e, "bad_input", lambda *a: events.append("bad") or "ok")
    monkeypatch.setattr(vllm_e2e, "negative_control",
                        lambda pair, *a: events.append(f"negative {pair.prefill.name}") or "ok")
    monkeypatch.setattr(vllm_e2e, "kvplan_nixl_ids_logged", lambda pair: "ok")
    servers = vllm_e2e.VllmServers(fake_setup(tmp_path), tmp_path / "logs")
    connector = next(c for c in vllm_e2e.connectors(fake_setup(tmp_path))
                     if c.label == "nixl kvplan vllm-0.32")
    results = harness.Results()
    reference: dict[str, list[int]] = {}
    vllm_e2e.run_connector(servers, connector, reference, results)
    assert results.failed == 0 and results.passed == 1 + len(vllm_e2e.PROMPTS) + 3
    # Four with the plain server (stopped before the first PD request), then three, then two.
    assert alive == [4, 2]
    vllm_e2e.run_connector(servers, connector, reference, harness.Results())
    assert alive[2:] == [3, 2]
    first = events.index("case partial block")
    assert events[first - 1] == "warm nixl_kvplan_vllm-0.32-prefill-a"
    negative = [i for i, e in enumerate(events) if e.startswith("negative")][0]
    assert events[negative - 1] == "warm nixl_kvplan_vllm-0.32-prefill-b"


def test_warm_up_retries_a_failed_handshake_and_never_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_e2e.time, "sleep", lambda s: None)
    prefill = harness.Server("p", [], 1, {}, tmp_path)
    decode = harness.Server("d", [], 2, {}, tmp_path)
    pair = vllm_e2e.PdPair("nixl", prefill, decode)
    tries: list[int] = []

    def generate(ids: list[int], max_tokens: int = 16, timeout_s: float = 0) -> list[int]:
        assert timeout_s >= vllm_e2e.WARM_UP_TIMEOUT_S > vllm_e2e.REQUEST_TIMEOUT_S
        tries.append(len(ids))
        if len(tries) < 3:
            raise harness.HttpError(500, "handshake_setup_failed")
        return [1]

    monkeypatch.setattr(pair, "generate", generate)
    said = pair.warm_up()
    assert "answered on try 3" in said and "handshake_setup_failed" in said
    tries.clear()

    def never(ids: list[int], max_tokens: int = 16, timeout_s: float = 0) -> list[int]:
        tries.append(1)
        raise harness.HttpError(500, "x")

    monkeypatch.setattr(pair, "generate", never)
    assert "no answer in 3 tries" in pair.warm_up()
    assert len(tries) == vllm_e2e.WARM_UP_ATTEMPTS


def test_servers_bound_their_threads_and_nixl_is_sized_to_this_machine(tmp_path: Path) -> None:
    servers = vllm_e2e.VllmServers(fake_setup(tmp_path), tmp_path)
    nixl = next(c for c in vllm_e2e.connectors(fake_setup(tmp_path))
                if c.label == "nixl vllm-reference")
    server = servers.server("x", "a", vllm_e2e.DECODE_PORT, nixl, "kv_consumer")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        assert server.env[name] == "1"
    assert server.env["TOKENIZERS_PARALLELISM"] == "false"
    config = nixl.transfer_config("kv_consumer", vllm_e2e.DECODE_PORT)
    assert config["kv_connector_extra_config"]["num_threads"] == 1
    assert config["kv_connector_extra_config"]["kv_lease_duration"] >= 60


def test_the_wheel_build_holds_dev_builds_lock(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    lock = tmp_path / "build.lock"
    monkeypatch.setattr(harness, "BUILD_LOCK", lock)
    held: list[bool] = []

    def fake_run(cmd: Sequence[Any], **kw: Any) -> str:
        if "build" in [str(c) for c in cmd]:
            with open(lock, "a+") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held.append(True)
                else:
                    held.append(False)
                    fcntl.flock(fh, fcntl.LOCK_UN)
            out = Path(str(cmd[cmd.index("--out") + 1]))
            (out / "kvplan-0-py3-none-any.whl").write_bytes(b"")
            return ""
        return str(tmp_path / "venv" / "site-packages" / "kvplan" / "__init__.py")

    checkout = tmp_path / "checkout"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".venv" / "bin" / "maturin").write_text("")
    monkeypatch.setattr(harness, "run", fake_run)
    harness.install_checkout(harness.Venv(tmp_path / "venv", steps=[]), checkout)
    assert held == [True]


def test_a_hung_server_leaves_its_stacks(tmp_path: Path) -> None:
    if harness.py_spy() is None:
        pytest.skip("no py-spy on PATH or in a cached e2e venv")
    # "up" is printed from inside hang_here, so once it is in the log the stack holds the
    # frame; the wait for it is bounded only by the child's own sleep (a loaded machine can
    # take seconds to start Python).
    server = harness.Server("sleeper", [sys.executable, "-c",
                                        "import time\ndef hang_here():\n"
                                        "    print('up', flush=True)\n    time.sleep(600)\n"
                                        "hang_here()"],
                            0, {}, tmp_path).start()
    try:
        import time
        while "up" not in server.log_since(0):
            assert server.proc.poll() is None, server.log_since(0)
            time.sleep(0.1)
        note = harness.dump_stacks(server, "test")
    finally:
        server.stop(grace_s=5)
    stacks = (tmp_path / "sleeper.stacks.txt").read_text()
    assert "hang_here" in stacks and "=== " in stacks
    assert "sleeper.stacks.txt" in note and "hang_here" in note


def test_the_nixl_staged_set_runs_by_name_with_staging_in_nixls_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NIXL staged set is left out of the default run and runs staged when named; its
    servers get kvplan's staging options beside NIXL's own extra config keys."""
    calls, _ = run_with_outcomes(tmp_path, monkeypatch, set(), [])
    assert "nixl kvplan staged vllm-0.32" not in calls
    staged: list[str] = []
    monkeypatch.setattr(vllm_e2e, "run_staged",
                        lambda servers, c, reference, results: staged.append(c.label))
    vllm_e2e.run_servers(fake_setup(tmp_path), ["nixl kvplan staged"])
    assert staged == ["nixl kvplan staged vllm-0.32"]
    (connector,) = [c for c in vllm_e2e.connectors(fake_setup(tmp_path))
                    if c.label == "nixl kvplan staged vllm-0.32"]
    assert connector.staged and connector.by_name_only and connector.transport == "nixl"
    extra = connector.transfer_config("kv_consumer", vllm_e2e.DECODE_PORT)[
        "kv_connector_extra_config"]
    assert extra == {"enforce_handshake_compat": False, "num_threads": 1,
                     "kv_lease_duration": vllm_e2e.NIXL_LEASE_S, **vllm_e2e.STAGED_OPTIONS}


def test_the_nixl_decodes_staged_read_line_is_parsed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """staged_rows reads the line kvplan's NIXL decode says per staged read (said here by
    kvplan's own StagedRead): rounds, network reads and the descriptors of vLLM's read, and
    nothing from other lines."""
    import logging
    import types

    from kvplan.compat.vllm.nixl_staging import StagedRead

    rounds = [types.SimpleNamespace(manifest=types.SimpleNamespace(bytes=2 ** 20)),
              types.SimpleNamespace(manifest=types.SimpleNamespace(bytes=786432))]
    read = StagedRead("cmpl-1-0", None, None, None, rounds, None, peer="eng:tp0",
                      direct_descriptors=56)
    read.ended = read.started + 0.25
    with caplog.at_level(logging.INFO, logger="vllm.kvplan.staging"):
        read._said_done()
    (said,) = [r.getMessage() for r in caplog.records]
    decode = harness.Server("d", [], 2, {}, tmp_path)
    decode.log_path.parent.mkdir(parents=True, exist_ok=True)
    decode.log_path.write_text(
        f"(Worker pid=1) INFO 12-07 06:00:00 [nixl_staging.py:1] {said}\n"
        "(Worker pid=1) INFO kvplan staging (always): 2 MiB arena in 2 buffers registered\n")
    pair = vllm_e2e.PdPair("nixl", harness.Server("p", [], 1, {}, tmp_path), decode)
    assert vllm_e2e.staged_rows(pair) == [
        {"req": "cmpl-1-0", "rounds": 2.0, "network_blocks": 2.0, "direct_blocks": 56.0,
         "bytes": 1835008.0, "seconds": 0.25}]


def test_the_nixl_staged_set_ends_with_its_fault_cases_on_a_short_lease_prefill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NIXL staged set's second phase starts a fifth server, a staging prefill on ``a``
    whose lease is FAULT_LEASE_S (the scored pairs keep NIXL_LEASE_S); after the other cases
    it records vLLM's own read of a stale reference on the direct pair, then runs the stale
    reference and the killed prefill (last) on the fault prefill with the direct pair's
    staging decode. The Mooncake staged set has no fault cases."""
    phases: list[list[harness.Server]] = []
    events: list[str] = []

    @contextlib.contextmanager
    def running(servers: Sequence[harness.Server], timeout: float
                ) -> Iterator[Sequence[harness.Server]]:
        phases.append(list(servers))
        yield servers

    def event(name: str) -> Any:
        return lambda *a, **k: events.append(name) or "ok"

    monkeypatch.setattr(harness, "running", running)
    monkeypatch.setattr(harness.Server, "stop", lambda self, grace_s=30.0: None)
    monkeypatch.setattr(vllm_e2e, "collect_reference",
                        lambda plain, results: {n: [1] for n in vllm_e2e.PROMPTS})
    for name in ("connector_in_use", "fragment", "compare_equal", "nixl_staged_counts",
                 "staged_counts", "staged_reduction", "negative_control",
                 "nixl_direct_when_off", "direct_when_off"):
        monkeypatch.setattr(vllm_e2e, name, event(name))
    monkeypatch.setattr(vllm_e2e, "staged_rows", lambda pair, offset=0: [{}] * pair.sent)
    monkeypatch.setattr(vllm_e2e, "staged_log_offset", lambda pair: 0)
    monkeypatch.setattr(vllm_e2e.harness.Server, "log_since", lambda self, offset: "".join(
        f"{vllm_e2e.STAGING_STARTED}\n"))
    monkeypatch.setattr(vllm_e2e.PdPair, "warm_up",
                        lambda self: events.append(f"warm {self.prefill.name}") or "w")
    monkeypatch.setattr(vllm_e2e, "direct_read_of_stale_blocks",
                        lambda pair, ref: events.append(f"record {pair.prefill.name} "
                                                        f"{pair.decode.name}") or "r")
    monkeypatch.setattr(vllm_e2e, "stale_after_lease",
                        lambda pair, ref: events.append(f"stale {pair.prefill.name} "
                                                        f"{pair.decode.name}") or "ok")
    monkeypatch.setattr(vllm_e2e, "killed_before_read",
                        lambda pair, ref: events.append(f"killed {pair.prefill.name}") or "ok")
    servers = vllm_e2e.VllmServers(fake_setup(tmp_path), tmp_path / "logs")
    by_label = {c.label: c for c in vllm_e2e.connectors(fake_setup(tmp_path))}
    results = harness.Results()
    vllm_e2e.run_staged(servers, by_label["nixl kvplan staged vllm-0.32"], {}, results)
    assert results.failed == 0, results.lines
    tag = "nixl_kvplan_staged_vllm-0.32"
    assert [s.name for s in phases[1]] == [f"{tag}-prefill-b", f"{tag}-decode-b",
                                           f"{tag}-prefill-off", f"{tag}-decode-a2",
                                           f"{tag}-prefill-faults"]
    faults = phases[1][4]
    config = json.loads(faults.argv[faults.argv.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert extra["kv_lease_duration"] == vllm_e2e.FAULT_LEASE_S < vllm_e2e.NIXL_LEASE_S
    assert {k: extra[k] for k in vllm_e2e.STAGED_OPTIONS} == vllm_e2e.STAGED_OPTIONS
    for scored in phases[0] + phases[1][:4]:
        if "--kv-transfer-config" in scored.argv:
            other = json.loads(scored.argv[scored.argv.index("--kv-transfer-config") + 1])
            assert other["kv_connector_extra_config"]["kv_lease_duration"] == \
                vllm_e2e.NIXL_LEASE_S
    assert events[-4:] == [f"record {tag}-prefill-off {tag}-decode-a2",
                           f"warm {tag}-prefill-faults",
                           f"stale {tag}-prefill-faults {tag}-decode-a2",
                           f"killed {tag}-prefill-faults"]
    names = [line.split("  ")[1] for line in results.lines]
    assert names[-3:] == ["nixl kvplan staged vllm-0.32: staging off on the prefill",
                          "nixl kvplan staged vllm-0.32: stale reference after the lease, "
                          "blocks reused",
                          "nixl kvplan staged vllm-0.32: prefill killed before the decode's "
                          "read"]
    phases.clear()
    events.clear()
    mooncake = harness.Results()
    vllm_e2e.run_staged(servers, by_label["mooncake kvplan staged vllm-0.32"], {1: [1]},
                        mooncake)
    assert len(phases[1]) == 4 and not [e for e in events if e.startswith(("stale", "kill"))]


def test_a_faulted_decode_never_passes_wrong_tokens_as_a_success(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """faulted_decode: an HTTP error is the fault reported; 200 with the plain server's
    tokens is a recompute (not a failure); 200 with other tokens raises, and so does no
    answer (the decode's stacks dumped)."""
    decode = harness.Server("d", [], 2, {}, tmp_path)
    answers: list[Any] = []

    def complete(server: Any, ids: Any, max_tokens: int, params: Any = None,
                 timeout_s: float = 0) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return {"choices": [{"token_ids": answer}]}

    monkeypatch.setattr(vllm_e2e, "complete", complete)
    monkeypatch.setattr(harness, "dump_stacks", lambda server, why: "stacks")
    answers.append(harness.HttpError(500, "failed KV load"))
    said, failed = vllm_e2e.faulted_decode(decode, [1], {}, [7, 8], 5.0)
    assert failed and said.startswith("HTTP 500")
    answers.append([7, 8])
    said, failed = vllm_e2e.faulted_decode(decode, [1], {}, [7, 8], 5.0)
    assert not failed and "recomputed" in said
    answers.append([7, 9])
    with pytest.raises(AssertionError, match="wrong KV bytes"):
        vllm_e2e.faulted_decode(decode, [1], {}, [7, 8], 5.0)
    answers.append(TimeoutError())
    with pytest.raises(AssertionError, match="no answer within 5 s"):
        vllm_e2e.faulted_decode(decode, [1], {}, [7, 8], 5.0)


def fault_logs(tmp_path: Path) -> tuple[harness.Server, harness.Server]:
    prefill = harness.Server("p", [], 1, {}, tmp_path)
    decode = harness.Server("d", [], 2, {}, tmp_path)
    for server in (prefill, decode):
        server.log_path.parent.mkdir(parents=True, exist_ok=True)
        server.log_path.write_text("(Worker pid=1) INFO start\n")
    return prefill, decode


def kvplan_verdict_line(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
                        request: str, blocks: tuple[int, ...], reason: str) -> str:
    """The decode's verdict line for a failed staged read, as kvplan's StagedRead says it."""
    import logging
    import types

    import kvplan.failures
    from kvplan.compat.vllm.nixl_staging import StagedRead

    monkeypatch.setattr(kvplan.failures, "verdict_for_unscattered_rounds",
                        lambda req, template, rounds, scattered, reason="":
                        kvplan.failures.FailureVerdict(req, {0: blocks}, reason))
    read = StagedRead(request, types.SimpleNamespace(scattered=0), None, None, [], None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.kvplan.staging"):
        read.failed(types.SimpleNamespace(reason="peer_failed", detail=reason))
    (said,) = [r.getMessage() for r in caplog.records]
    return f"(Worker pid=1) WARNING 12-07 09:00:00 [nixl_staging.py:1] {said}\n"


def test_the_stale_reference_case_wants_the_refusal_the_verdict_and_vllms_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """stale_after_lease passes only when the prefill refused the stream (not held) naming
    the request, the decode's kvplan verdict (read from kvplan's own line) names all the
    request's blocks with that reason, vLLM's NIXL failure line names the same request, and
    the HTTP answer was an error; each missing piece fails it."""
    prefill, decode = fault_logs(tmp_path)
    pair = vllm_e2e.PdPair("nixl", prefill, decode)
    remote = "cmpl-r1-0"
    params = {"remote_block_ids": [[11, 12, 13, 14, 15]], "remote_request_id": remote}
    monkeypatch.setattr(vllm_e2e, "prefill_only", lambda server, ids: params)
    monkeypatch.setattr(vllm_e2e, "reuse_blocks", lambda server, blocks: "reused")
    monkeypatch.setattr(vllm_e2e.time, "sleep", lambda s: None)
    not_held = (f"not_held: this prefill no longer holds request {remote!r} (its KV lease "
                "expired, or its blocks were freed or never kept for a decode)")
    refusal = (f"(Worker pid=2) ERROR [nixl_staging.py:1] kvplan staging: refused "
               f"'{remote}@d:tp0' to d: request {remote}: this prefill no longer holds "
               f"request {remote!r} (its KV lease expired)\n")
    failure = ("(Worker pid=1) ERROR [base_worker.py:1] NIXL transfer failure: transfer_failed "
               "| Context: {'failure_type': 'transfer_failed', 'request_id': 'cmpl-d9-0', "
               f"'engine_id': 'e', 'remote_request_id': '{remote}', 'xfer_state': 'ERR'}}\n")
    verdict = kvplan_verdict_line(caplog, monkeypatch, "cmpl-d9-0", (3, 5, 7, 9, 11), not_held)

    def run(answer: tuple[str, bool], prefill_says: str, decode_says: str) -> str:
        def faulted(*a: Any) -> tuple[str, bool]:
            with open(prefill.log_path, "a") as fh:
                fh.write(prefill_says)
            with open(decode.log_path, "a") as fh:
                fh.write(decode_says)
            return answer

        monkeypatch.setattr(vllm_e2e, "faulted_decode", faulted)
        return vllm_e2e.stale_after_lease(pair, {vllm_e2e.FAULT_PROMPT: [1]})

    said = run(("HTTP 500", True), refusal, verdict + failure)
    assert "request cmpl-d9-0 blocks [3, 5, 7, 9, 11]" in said and "transfer_failed" in said
    with pytest.raises(AssertionError, match="not reported"):
        run(("HTTP 200 (recomputed)", False), refusal, verdict + failure)
    with pytest.raises(AssertionError, match="refused"):
        run(("HTTP 500", True), "", verdict + failure)
    with pytest.raises(AssertionError, match="verdicts"):
        run(("HTTP 500", True), refusal, failure)
    short = kvplan_verdict_line(caplog, monkeypatch, "cmpl-d9-0", (3, 5), not_held)
    with pytest.raises(AssertionError, match="not the request's 5 blocks"):
        run(("HTTP 500", True), refusal, short + failure)
    with pytest.raises(AssertionError, match="NIXL transfer failure"):
        run(("HTTP 500", True), refusal, verdict)


def test_the_killed_prefill_case_wants_vllms_failure_and_kvplans_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """killed_before_read kills the prefill's whole process group before the decode's half,
    and passes only on an HTTP error whose request vLLM's NIXL failure line names with all
    its blocks, beside kvplan's own line: its verdict of the stream, or its fall-back to
    vLLM's read when the prefill's listener refused the connection."""
    import types

    prefill, decode = fault_logs(tmp_path)
    killed: list[tuple[int, int]] = []
    prefill.proc = types.SimpleNamespace(pid=4242, wait=lambda timeout=None: 0)  # type: ignore[assignment]
    monkeypatch.setattr(vllm_e2e.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(vllm_e2e, "group_alive", lambda pgid: False)
    pair = vllm_e2e.PdPair("nixl", prefill, decode)
    remote = "cmpl-r2-0"
    params = {"remote_block_ids": [[1, 2, 3, 4, 5]], "remote_request_id": remote}
    monkeypatch.setattr(vllm_e2e, "prefill_only", lambda server, ids: params)

    def failure(blocks: int) -> str:
        return ("(Worker pid=1) ERROR [pull_worker.py:562] NIXL transfer failure: "
                "transfer_setup_failed. Deferring failure reporting | Context: {'failure_type': "
                "'transfer_setup_failed', 'request_id': 'cmpl-d2-0', 'engine_id': 'e', "
                f"'remote_request_id': '{remote}', 'num_local_blocks': {blocks}}}\n")

    fallback = ("kvplan staging: no channel to p:tp0 at '127.0.0.1:1' (kvplan staging channel "
                "with 127.0.0.1:1: unreachable: ConnectionRefusedError): direct path\n")
    verdict = kvplan_verdict_line(caplog, monkeypatch, "cmpl-d2-0", (6, 7, 8, 9, 10),
                                  "peer_failed: closed")

    def run(answer: tuple[str, bool], decode_says: str) -> str:
        def faulted(*a: Any) -> tuple[str, bool]:
            with open(decode.log_path, "a") as fh:
                fh.write(decode_says)
            return answer

        monkeypatch.setattr(vllm_e2e, "faulted_decode", faulted)
        return vllm_e2e.killed_before_read(pair, {vllm_e2e.FAULT_PROMPT: [1]})

    said = run(("HTTP 500", True), fallback + failure(5))
    assert killed == [(4242, vllm_e2e.signal.SIGKILL)]
    assert "transfer_setup_failed of request cmpl-d2-0 (5 blocks)" in said and \
        "no channel" in said
    assert "blocks [6, 7, 8, 9, 10]" in run(("HTTP 500", True), verdict + failure(5))
    with pytest.raises(AssertionError, match="not reported"):
        run(("HTTP 200 (recomputed)", False), fallback + failure(5))
    with pytest.raises(AssertionError, match="neither a verdict nor its fall-back"):
        run(("HTTP 500", True), failure(5))
    with pytest.raises(AssertionError, match="wanted one naming its 5 blocks"):
        run(("HTTP 500", True), fallback + failure(4))
    with pytest.raises(AssertionError, match="wanted one naming its 5 blocks"):
        run(("HTTP 500", True), fallback)


def test_the_mooncake_kvplan_set_checks_a_manifest_and_starts_a_refused_decode_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mooncake kvplan vllm-0.32``: the pair under test gets the tiny Llama's own manifest,
    a decode with a manifest naming a state the model lacks starts beside the first phase
    (outside the servers it waits for) and is stopped after; the case runs before the PD
    prompts; no other server gets a manifest."""
    import kvplan.presets

    events: list[str] = []
    groups: list[list[harness.Server]] = []
    started: list[str] = []
    stopped: list[str] = []

    @contextlib.contextmanager
    def running(servers: Sequence[harness.Server], timeout: float
                ) -> Iterator[Sequence[harness.Server]]:
        groups.append(list(servers))
        yield servers

    checked: dict[str, Any] = {}

    def check(holding: list[harness.Server], refused: harness.Server, at: float) -> str:
        checked.update(holding=holding, refused=refused)
        events.append("manifest")
        return "ok"

    monkeypatch.setattr(harness, "running", running)
    monkeypatch.setattr(harness.Server, "start", lambda self: started.append(self.name) or self)
    monkeypatch.setattr(harness.Server, "stop",
                        lambda self, grace_s=30.0: stopped.append(self.name))
    monkeypatch.setattr(vllm_e2e, "collect_reference",
                        lambda plain, results: {n: [1] for n in vllm_e2e.PROMPTS})
    monkeypatch.setattr(vllm_e2e, "connector_in_use", lambda c, g: "ok")
    monkeypatch.setattr(vllm_e2e.PdPair, "warm_up", lambda self: events.append("warm") or "w")
    monkeypatch.setattr(vllm_e2e, "compare_equal", lambda pair, n, k, ref: "ok")
    monkeypatch.setattr(vllm_e2e, "kvplan_metrics_served", lambda pair: "ok")
    monkeypatch.setattr(vllm_e2e, "bad_input", lambda *a: "ok")
    monkeypatch.setattr(vllm_e2e, "negative_control", lambda pair, *a: "ok")
    monkeypatch.setattr(vllm_e2e, "manifest_check", check)
    setup = fake_setup(tmp_path)
    servers = vllm_e2e.VllmServers(setup, tmp_path / "logs")
    (connector,) = [c for c in vllm_e2e.connectors(setup) if c.manifest]
    assert connector.label == "mooncake kvplan vllm-0.32" and not connector.by_name_only
    results = harness.Results()
    vllm_e2e.run_connector(servers, connector, {}, results)
    assert results.failed == 0 and results.passed == 1 + 1 + len(vllm_e2e.PROMPTS) + 1 + 2
    assert any(line.startswith("PASS  mooncake kvplan vllm-0.32: manifest at start-up")
               for line in results.lines)
    refused = checked["refused"]
    assert started == [refused.name] and refused.name in stopped
    assert [len(g) for g in groups] == [4, 2] and all(refused not in g for g in groups)
    assert events[:2] == ["manifest", "warm"]
    assert refused.port == vllm_e2e.MANIFEST_DECODE_PORT

    def manifest_of(server: harness.Server) -> Any:
        if "--kv-transfer-config" not in server.argv:
            return None  # the plain server
        config = json.loads(server.argv[server.argv.index("--kv-transfer-config") + 1])
        path = config["kv_connector_extra_config"].get(vllm_e2e.MANIFEST_OPTION)
        return None if path is None else kvplan.presets.load_manifest(path)

    model = vllm_e2e.MODELS["a"]
    for server in checked["holding"]:
        held = manifest_of(server)
        assert [c.role for c in held.components] == ["k", "v"]
        # vLLM's region of a layer holds K and V: a token's row of both, 32 KiB a block
        (kv,) = held.packed("kv", ("k", "v")).components
        assert kv.bytes * vllm_e2e.BLOCK == 32 * 1024 and kv.layers == tuple(range(4))
        assert held.num_layers == model.num_layers and kv.kv_heads == model.kv_heads
    assert [c.role for c in manifest_of(refused).components] == [
        "k", "v", vllm_e2e.MANIFEST_LACKED]
    others = [s for g in groups for s in g if s not in checked["holding"]]
    assert len(others) == 4 and all(manifest_of(s) is None for s in others)


def test_other_sets_start_no_manifest_decode(tmp_path: Path) -> None:
    """Only one set checks a manifest; its refused decode's ports are its own."""
    assert [c.label for c in vllm_e2e.connectors(fake_setup(tmp_path)) if c.manifest] == [
        "mooncake kvplan vllm-0.32"]
    for ports in (vllm_e2e.MOONCAKE_BOOTSTRAP, vllm_e2e.NIXL_SIDE_CHANNEL):
        assert vllm_e2e.MANIFEST_DECODE_PORT in ports
        assert len(set(ports.values())) == len(ports)


HELD_LINE = ("INFO 12-07 10:00:00 [manifest.py:1] kvplan: KvplanMooncakeConnector "
             "(kvplan_manifest): this worker (TP rank 0 of 1, PP rank 0 of 1, 2 of 2 KV heads) "
             "holds every component of the manifest of tiny-llama-a\n")
REFUSED_LINE = ("ERROR 12-07 10:00:00 [manifest.py:1] kvplan: KvplanMooncakeConnector "
                "(kvplan_manifest): this worker (TP rank 0 of 1, PP rank 0 of 1) does not hold "
                "the manifest of tiny-llama-a, refusing to start: missing mamba_temporal on "
                "layers 0-3\n")


def finished_server(tmp_path: Path, name: str, log_text: str,
                    code: str = "pass") -> harness.Server:
    server = harness.Server(name, [sys.executable, "-c", code], 0, {}, tmp_path).start()
    if code == "pass":
        assert server.proc is not None
        server.proc.wait()
    server.log_path.write_text(log_text)
    return server


def test_manifest_check_wants_one_held_line_per_server_and_the_refusal_naming_the_component(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    pair = [finished_server(tmp_path, n, HELD_LINE) for n in ("prefill", "decode")]
    error = "kvplan._core.ManifestError: " + REFUSED_LINE.split("] ", 1)[1]
    refused = finished_server(tmp_path, "refused", REFUSED_LINE + error)
    said = vllm_e2e.manifest_check(pair, refused, time.monotonic())
    assert "prefill, decode hold it; refused exited (0)" in said and "mamba_temporal" in said
    # still shutting down once its engine core failed on the refusal: passes, and is stopped
    engine = ("(EngineCore pid=1) ERROR RuntimeError: Worker failed with error '" +
              REFUSED_LINE.split("] ", 1)[1].rstrip() + "'\n")
    ending = finished_server(tmp_path, "ending", "", code="import time; time.sleep(60)")
    ending.log_path.write_text(REFUSED_LINE + error + engine)
    try:
        said = vllm_e2e.manifest_check(pair, ending, time.monotonic())
        # killed at once rather than left to finish vLLM's slow shutdown
        assert "ending its engine failed to start (killed)" in said
        assert ending.stopped and not ending.alive()
    finally:
        ending.stop(grace_s=5)
    # a pair server without the line (no check ran), or with two (one worker each here)
    for text in ("", HELD_LINE * 2):
        pair[1].log_path.write_text(text)
        with pytest.raises(AssertionError, match="decode logged"):
            vllm_e2e.manifest_check(pair, refused, time.monotonic())
    pair[1].log_path.write_text(HELD_LINE)
    # a refused server that exited for another reason, or refused without naming what lacks
    for text in ("RuntimeError: engine core failed\n", REFUSED_LINE,
                 REFUSED_LINE.replace("mamba_temporal", "kv") + error.replace(
                     "mamba_temporal", "kv")):
        refused.log_path.write_text(text)
        with pytest.raises(AssertionError, match="ended without kvplan's ManifestError naming"):
            vllm_e2e.manifest_check(pair, refused, time.monotonic())
    # one that neither exits nor serves within the bound, and one that serves
    hung = finished_server(tmp_path, "hung", "", code="import time; time.sleep(60)")
    try:
        with pytest.raises(AssertionError, match="neither started nor failed in 0 s"):
            vllm_e2e.manifest_check(pair, hung, time.monotonic(), timeout_s=0)
        monkeypatch.setattr(hung, "ready", lambda: True)
        with pytest.raises(AssertionError, match="hung serves although its manifest"):
            vllm_e2e.manifest_check(pair, hung, time.monotonic())
    finally:
        hung.stop(grace_s=5)
