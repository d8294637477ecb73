"""The live SGLang harness against a race inside SGLang 0.5.23, without servers.

SGLang's Mooncake transfer thread can die of a ``KeyError`` from its own ``check_status``
(a room the scheduler dropped between a membership test and a read); the prefill then
completes no transfer and every request of its group times out. The harness recognises exactly
that death in a server's log (``sglang_race.transfer_thread_race``), gives up a request as soon
as its prefill's log shows it, and reruns the group once on new servers; any other failure,
kvplan's above all, stays a failure."""

from __future__ import annotations

import concurrent.futures
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))

import e2e_harness as harness  # noqa: E402
import sglang_e2e  # noqa: E402
import sglang_race as race  # noqa: E402
import sglang_staged_case  # noqa: E402

SITE = "/root/.cache/kvplan/e2e/venv-sglang-0.5.23/lib/python3.11/site-packages"
PY = "/root/.pyenv/versions/3.11.7/lib/python3.11"
KVPLAN_FRAME = (f'  File "{SITE}/kvplan/compat/sglang/dropins.py", line 280, in send_kvcache\n'
                f"    status = self.check_status(room)\n")
CHECK_STATUS_FRAME = (f'  File "{SITE}/sglang/srt/disaggregation/common/conn.py", line 609, '
                      f"in check_status\n")

#: Lines 97-122 of a real prefill's log (kvplan16 group, SGLang 0.5.23, 2026-12-07), the
#: install paths shortened to SITE and PY: the traceback of the dying thread with another
#: process's access log line printed into its middle.
REAL = f"""\
[2026-12-07 01:33:27] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cpu graph: False, input throughput (token/s): 312.40
[2026-12-07 01:33:27] INFO:     127.0.0.1:59026 - "POST /generate HTTP/1.1" 200 OK
[2026-12-07 01:33:27] Prefill batch, #new-seq: 1, #new-token: 250, #cached-token: 0, token usage: 0.03, #running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cpu graph: False, input throughput (token/s): 1425.16
Exception in thread Thread-4 (transfer_worker):
Traceback (most recent call last):
  File "{SITE}/sglang/srt/disaggregation/mooncake/conn.py", line 2857, in transfer_worker
    or self.check_status(kv_chunk.room) == KVPoll.Success
       ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
{CHECK_STATUS_FRAME}\
[2026-12-07 01:33:27] INFO:     127.0.0.1:59036 - "POST /generate HTTP/1.1" 200 OK
    return self.request_status[bootstrap_room]
           ~~~~~~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^
KeyError: 228690341447653909

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "{PY}/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "{PY}/threading.py", line 982, in run
    self._target(*self._args, **self._kwargs)
  File "{SITE}/sglang/srt/disaggregation/mooncake/conn.py", line 2882, in transfer_worker
    raise RuntimeError(
RuntimeError: Transfer thread failed because of 228690341447653909. Prefill instance with bootstrap_port=31011 is dead.
[2026-12-07 01:33:28] INFO:     127.0.0.1:59046 - "GET /metrics HTTP/1.1" 200 OK
[2026-12-07 01:33:37] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cpu graph: False, input throughput (token/s): 6.90
"""  # noqa: E501
DEAD_LINE = ("RuntimeError: Transfer thread failed because of 228690341447653909. Prefill "
             "instance with bootstrap_port=31011 is dead.")


def changed(old: str, new: str, text: str = REAL) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


# --------------------------------------------------------------------------------------------
# The detector


def test_the_real_log_shows_the_race_and_its_evidence() -> None:
    assert race.transfer_thread_race(REAL) == [
        "4: Exception in thread Thread-4 (transfer_worker):",
        "9: " + CHECK_STATUS_FRAME.strip(),
        "11: return self.request_status[bootstrap_room]",
        "13: KeyError: 228690341447653909",
        "24: " + DEAD_LINE,
    ]


def test_the_race_without_anything_logged_in_its_middle() -> None:
    text = changed('[2026-12-07 01:33:27] INFO:     127.0.0.1:59036 - "POST /generate HTTP/1.1"'
                   ' 200 OK\n', "")
    assert race.transfer_thread_race(text)[-1] == "23: " + DEAD_LINE


@pytest.mark.parametrize("text", [
    # kvplan's code between SGLang's transfer worker and check_status
    changed(CHECK_STATUS_FRAME, KVPLAN_FRAME + CHECK_STATUS_FRAME),
    # the same read, but in a kvplan frame
    changed(CHECK_STATUS_FRAME, f'  File "{SITE}/kvplan/compat/sglang/dropins.py", line 290, '
            "in check_status\n"),
    # kvplan's code wrapping the thread's target
    changed(f'  File "{SITE}/sglang/srt/disaggregation/mooncake/conn.py", line 2882',
            f'  File "{SITE}/kvplan/compat/sglang/install.py", line 88, in method\n'
            "    return fn(self, *args, **kwargs)\n"
            f'  File "{SITE}/sglang/srt/disaggregation/mooncake/conn.py", line 2882'),
], ids=["kvplan-frame-before-check-status", "keyerror-in-kvplan", "kvplan-wraps-the-thread"])
def test_a_traceback_through_kvplan_is_not_the_race(text: str) -> None:
    assert "kvplan/compat/sglang" in text
    assert race.transfer_thread_race(text) == []


@pytest.mark.parametrize("text", [
    # another exception type from the same read
    changed("KeyError: 228690341447653909", "ValueError: 228690341447653909"),
    # a KeyError from the transfer worker's own code, not from check_status
    changed(CHECK_STATUS_FRAME + '[2026-12-07 01:33:27] INFO:     127.0.0.1:59036 - "POST '
            '/generate HTTP/1.1" 200 OK\n    return self.request_status[bootstrap_room]\n', ""),
    # check_status reading something else
    changed("    return self.request_status[bootstrap_room]",
            "    return self.transfer_infos[bootstrap_room]"),
    # the thread dying of an error of another room than the KeyError's
    changed("failed because of 228690341447653909.", "failed because of 17."),
    # the thread dying of an AttributeError
    changed("KeyError: 228690341447653909", "AttributeError: 'NoneType' object has no attribute "
            "'x'").replace("because of 228690341447653909.",
                           "because of 'NoneType' object has no attribute 'x'."),
    # an explicit cause instead of an exception raised while handling the KeyError
    changed("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:"),
], ids=["valueerror", "keyerror-elsewhere", "other-read", "other-room", "attributeerror",
        "explicit-cause"])
def test_another_death_of_the_transfer_thread_is_not_the_race(text: str) -> None:
    assert race.DEAD_SAID in text
    assert race.transfer_thread_race(text) == []


def test_a_clean_log_or_half_a_traceback_is_not_the_race() -> None:
    lines = REAL.splitlines(keepends=True)
    clean = "".join(lines[:3] + lines[24:])
    assert race.transfer_thread_race(clean) == []
    assert race.transfer_thread_race("") == []
    # the thread's last line on its own (a logger repeating it), no traceback
    assert race.transfer_thread_race(clean + DEAD_LINE + "\n") == []
    # the log read while the traceback is still being written
    assert race.transfer_thread_race("".join(lines[:20])) == []
    # without the thread's header line
    assert race.transfer_thread_race("".join(lines[:3] + lines[4:])) == []


def test_race_in_logs_names_the_log_and_its_line(tmp_path: Path) -> None:
    clean, dead = tmp_path / "decode.log", tmp_path / "prefill.log"
    clean.write_text(REAL.split("Exception in thread")[0])
    # A progress bar's carriage returns stay inside their line, as in an editor.
    dead.write_bytes(b"Loading 10%\rLoading 100%\n" + REAL.encode())
    assert race.race_in_logs([clean]) == ""
    assert race.race_in_logs([tmp_path / "missing.log", clean, dead]) == \
        f"{dead} line 25: {DEAD_LINE}"


# --------------------------------------------------------------------------------------------
# Giving up a request early


def test_a_pending_request_gives_up_once_its_prefill_log_shows_the_race(tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    log.write_text(REAL.split("Exception in thread")[0])
    done: concurrent.futures.Future[object] = concurrent.futures.Future()
    done.set_result(1)
    race.wait_watching([done], [log], poll_s=0.01)  # answered: no wait, no error
    pending: concurrent.futures.Future[object] = concurrent.futures.Future()
    log.write_text(REAL)
    with pytest.raises(race.TransferThreadDied, match=f"{log} line 24: RuntimeError"):
        race.wait_watching([done, pending], [log], poll_s=0.01)
    assert not pending.done()


# --------------------------------------------------------------------------------------------
# The retry decision


def group(tmp_path: Path, outcomes: list[tuple[bool, bool]], *,
          raises: type[Exception] | None = None) -> tuple[list[bool], Any]:
    """A group run as ``race.run_group`` sees it: run ``i`` records one case that passes when
    ``outcomes[i][0]`` and writes a prefill log with the race when ``outcomes[i][1]``."""
    runs: list[bool] = []
    logs: list[Path] = []

    def run(part: harness.Results, retry: bool) -> None:
        i = len(runs)
        runs.append(retry)
        ok, dead = outcomes[i]
        log = tmp_path / f"prefill-{i}.log"
        log.write_text(REAL if dead else "clean\n")
        logs[:] = [tmp_path / f"decode-{i}.log", log]
        part.record("kvplan in both schedulers, page size 16", ok, "" if ok else "timed out")
        if raises is not None and not ok:
            raise raises("the router never answered")

    return runs, (run, lambda: logs)


def test_a_failed_group_with_the_race_runs_once_more_and_the_rerun_counts(
        tmp_path: Path, capsys: Any) -> None:
    results = harness.Results()
    runs, (run, logs) = group(tmp_path, [(False, True), (True, False)])
    assert race.run_group(results, "kvplan16 group", run, logs)
    assert runs == [False, True]
    assert (results.passed, results.failed, results.env_failed) == (1, 0, 0)
    assert results.lines[-1] == "PASS  kvplan in both schedulers, page size 16 [retry]"
    note = results.lines[0]
    assert note.startswith("RETRY kvplan16 group: 1 of 1 cases failed after SGLang's own "
                           "Mooncake transfer thread died of its check_status KeyError race")
    assert f"{tmp_path / 'prefill-0.log'} line 24: {DEAD_LINE}" in note
    assert "an environment failure, not kvplan's" in note
    assert results.retried == [f"kvplan16 group (1 of 1 failed on the first run; SGLang's own "
                               f"Mooncake transfer thread died of its check_status KeyError "
                               f"race ({tmp_path / 'prefill-0.log'} line 24: {DEAD_LINE}))"]
    out = capsys.readouterr().out
    assert "FAIL  kvplan in both schedulers, page size 16  (timed out)" in out
    assert results.summary_lines("e2e-sglang")[0] == "e2e-sglang: 1 passed, 0 failed"


def test_a_failed_group_without_the_race_is_not_run_again(tmp_path: Path) -> None:
    results = harness.Results()
    runs, (run, logs) = group(tmp_path, [(False, False)])
    assert not race.run_group(results, "kvplan16 group", run, logs)
    assert runs == [False]
    assert (results.passed, results.failed, results.env_failed) == (0, 1, 0)
    assert results.retried == []
    assert results.lines == ["FAIL  kvplan in both schedulers, page size 16  (timed out)"]


def test_a_rerun_that_fails_again_stays_failed_and_there_is_no_third_run(
        tmp_path: Path) -> None:
    results = harness.Results()
    runs, (run, logs) = group(tmp_path, [(False, True), (False, True)])
    assert race.run_group(results, "kvplan16 group", run, logs)
    assert runs == [False, True]
    # kvplan's case, failed: counted as kvplan's, not the environment's
    assert (results.passed, results.failed, results.env_failed) == (0, 1, 0)
    assert results.summary_lines("t")[1] == "t kvplan cases: 0 passed, 1 failed"


def test_a_passing_group_runs_once(tmp_path: Path) -> None:
    results = harness.Results()
    runs, (run, logs) = group(tmp_path, [(True, True)])  # the race alone is no failure
    assert not race.run_group(results, "kvplan16 group", run, logs)
    assert runs == [False] and (results.passed, results.failed) == (1, 0)


def test_a_group_stopped_by_an_exception(tmp_path: Path) -> None:
    """A step outside the cases (the router's first request) raising: with the race in the
    logs the group runs once more; without it the exception goes on, its cases counted."""
    results = harness.Results()
    runs, (run, logs) = group(tmp_path, [(False, True), (True, False)],
                              raises=race.TransferThreadDied)
    assert race.run_group(results, "kvplan16 group", run, logs)
    assert runs == [False, True] and (results.passed, results.failed) == (1, 0)
    assert results.retried[0].startswith("kvplan16 group (2 of 2 failed on the first run; ")

    results = harness.Results()
    runs, (run, logs) = group(tmp_path, [(False, False)], raises=TimeoutError)
    with pytest.raises(TimeoutError, match="the router never answered"):
        race.run_group(results, "kvplan16 group", run, logs)
    assert runs == [False] and (results.passed, results.failed) == (0, 1)


def test_a_reference_group_runs_once_more_after_any_failure(tmp_path: Path) -> None:
    results = harness.Results()
    runs, (run, logs) = group(tmp_path, [(False, False), (True, False)])
    assert race.run_group(results, "SGLang's manager", run, logs, environment=True,
                          retry_any_failure=True)
    assert runs == [False, True]
    assert (results.passed, results.env_passed, results.failed) == (1, 1, 0)
    assert results.retried == ["SGLang's manager (1 of 1 failed on the first run)"]
    assert "cases of the engine's own connector failed" in results.lines[0]


def test_the_driver_reruns_a_group_on_new_servers(tmp_path: Path) -> None:
    """``sglang_e2e.run_group``: the second run's servers are new (``-retry`` names, new
    ports, new logs), and only the first run's logs decide."""
    engine = sglang_e2e.Engine(venv=tmp_path, models={"llama-a": str(tmp_path / "a")},
                               log_dir=tmp_path, ports=sglang_e2e.Ports())
    seen: list[tuple[str, int]] = []

    def body(eng: sglang_e2e.Engine, part: harness.Results) -> None:
        prefill = eng.server("kvplan-prefill-p16", sglang_e2e.MODEL_A, page_size=16,
                             mode="prefill", kvplan=True)
        decode = eng.server("kvplan-decode-p16", sglang_e2e.MODEL_A, page_size=16,
                            mode="decode", kvplan=True)
        seen.extend((s.name, s.port) for s in (prefill, decode))
        first = len(seen) == 2
        prefill.log_path.write_text(REAL if first else "")
        part.record("kvplan in both schedulers, page size 16", not first)

    results = harness.Results()
    sglang_e2e.run_group(results, engine, "kvplan16 group", body)
    names = [name for name, _ in seen]
    assert names == ["kvplan-prefill-p16", "kvplan-decode-p16", "kvplan-prefill-p16-retry",
                     "kvplan-decode-p16-retry"]
    assert len({port for _, port in seen}) == 4
    assert (results.passed, results.failed) == (1, 0)
    assert f"{tmp_path / 'kvplan-prefill-p16.log'} line 24" in results.retried[0]


def test_every_group_of_the_driver_runs_and_only_the_one_with_the_race_runs_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_cases`` with its servers and cases stubbed: every group starts its servers and
    runs its cases once; the page-16 group, whose first prefill logs the race, runs once
    more on ``-retry`` servers; a kvplan case failing without the race stays failed."""
    started: list[str] = []
    cases: list[str] = []

    def start(self: harness.Server) -> harness.Server:
        started.append(self.name)
        self.proc = object()  # type: ignore[assignment]
        self.log_path.write_text("")
        return self

    def compare_all(name: str, results: harness.Results, reference: Any, run: Any,
                    prefill: Any = None, **kw: Any) -> None:
        cases.append(name + results.suffix)
        if prefill is not None and prefill.name == "kvplan-prefill-p16":
            prefill.log_path.write_text(REAL)
        results.record(name, not (prefill is not None and prefill.name in (
            "kvplan-prefill-p16", "kvplan-nixl-prefill-p1")))

    def ok(*args: Any) -> str:
        return "ok"

    monkeypatch.setattr(harness.Server, "start", start)
    monkeypatch.setattr(harness.Server, "wait_ready", lambda self, timeout_s: None)
    monkeypatch.setattr(harness.Server, "stop", lambda self, grace_s=30.0: None)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(sglang_e2e, "plain_generate", lambda server, ids, n=0: [1])
    monkeypatch.setattr(sglang_e2e, "compare_all", compare_all)
    monkeypatch.setattr(sglang_e2e, "wait_for_workers", lambda router, prefill: None)
    for name in ("installed_check", "mismatched_decode", "manifest_refusal", "negative_control",
                 "identity_refused", "nixl_mismatched_decode"):
        monkeypatch.setattr(sglang_e2e, name, ok)
    monkeypatch.setattr(sglang_staged_case, "run_staged",
                        lambda engine, model, results, *a: results.record("staged", True))
    models = {m.name: str(tmp_path / m.name) for m in (
        sglang_e2e.MODEL_A, sglang_e2e.MODEL_B, sglang_e2e.MODEL_A_2_LAYERS,
        sglang_e2e.MODEL_HYBRID)}
    prepared = sglang_e2e.Prepared(venv=str(tmp_path), models=models, nixl=str(tmp_path))
    results = sglang_e2e.run_cases(prepared, set(sglang_e2e.CASE_KEYS))
    page_16 = "kvplan in both schedulers, page size 16"
    assert cases.count(page_16) == 1 and cases.count(page_16 + " [retry]") == 1
    assert [c for c in cases if "[retry]" in c] == [page_16 + " [retry]",
                                                     "kvplan, page size 16, behind SGLang's "
                                                     "router (Rust) [retry]",
                                                     "kvplan, page size 16, behind SGLang's "
                                                     "mini load balancer [retry]"]
    assert "kvplan-prefill-p16-retry" in started and "router-retry" in started
    assert len(started) == len(set(started))  # every server is new
    # the page-16 group's rerun passed; NIXL page 1 failed without the race: counted, no rerun
    assert results.failed == 1 and results.env_failed == 0
    assert "FAIL  NIXL: kvplan in both schedulers, page size 1" in results.lines
    assert "kvplan-nixl-prefill-p1-retry" not in started
    assert len(results.retried) == 1 and "kvplan-prefill-p16.log line 24" in results.retried[0]
    assert "Qwen3-Next" in " ".join(cases) and "staged" in " ".join(results.lines)
