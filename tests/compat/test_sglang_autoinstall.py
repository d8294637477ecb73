"""The opt-in hook that installs kvplan into SGLang's managers in every process
(``KVPLAN_SGLANG_INSTALL=1`` and the ``kvplan-sglang-install.pth`` file kvplan's wheel and
editable install put into site-packages).

Each check runs in a fresh interpreter of this venv, so Python itself processes the ``.pth``
file at start-up, as in a scheduler SGLang spawns. SGLang's Mooncake and Ascend modules are
SGLang 0.5.23's own files (the wheel, through tests/support/sglang_loader.py), imported through
the import system after start-up, as SGLang imports them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kvplan.compat.sglang import autoinstall

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# Loads SGLang's manager modules as the test suite does, with the loader's finder placed right
# after kvplan's hook (SGLang's files are found by a finder after every hook in a server; the
# loader otherwise puts its own first). Prints what was installed, as JSON.
PROBE = r"""
import json, sys
sys.path.insert(0, TESTS)
started = {"kvplan": "kvplan" in sys.modules, "sglang": "sglang" in sys.modules,
           "hooks": [type(f).__name__ for f in sys.meta_path]}
import support.package_shells as shells
from kvplan.compat.sglang.autoinstall import SGLangInstallFinder

def enter(self):
    at = next((i + 1 for i, f in enumerate(sys.meta_path) if isinstance(f, SGLangInstallFinder)), 0)
    sys.meta_path.insert(at, self.finder)
    return self.finder

shells.finding.__enter__ = enter
from support.sglang_loader import load_sglang
sg = load_sglang()
from kvplan.compat.sglang import installed
print(json.dumps({"started": started,
                  "mooncake": list(installed(sg.MooncakeKVManager)),
                  "ascend": list(installed(sg.AscendKVManager)),
                  "on_error": sg.MooncakeKVManager.__dict__.get("_kvplan_on_error")}))
"""


def _probe(value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != autoinstall.ENV_VAR}
    if value is not None:
        env[autoinstall.ENV_VAR] = value
    out = subprocess.run([sys.executable, "-c", PROBE.replace("TESTS", repr(str(TESTS)))],
                         env=env, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_pth_file_is_in_site_packages() -> None:
    # The editable install (scripts/setup-env) and the wheel both put it there; a missing file
    # would make KVPLAN_SGLANG_INSTALL silently do nothing.
    pth = Path(sysconfig.get_paths()["purelib"]) / "kvplan-sglang-install.pth"
    assert pth.is_file(), f"{pth} missing: reinstall kvplan (scripts/setup-env)"
    shipped = ROOT / "python" / "kvplan.data" / "purelib" / "kvplan-sglang-install.pth"
    assert shipped.read_text() == pth.read_text()
    assert shipped.read_text() == autoinstall.pth_text()


# Two spellings through a real SGLang import (each starts SGLang in a child); every spelling
# is read by the same parser (test_enabled_reads_the_variable_strictly).
@pytest.mark.parametrize("value", ["1", " On "])
def test_opted_in_every_manager_class_sglang_imports_gets_kvplan(value: str) -> None:
    got = _probe(value)
    # Armed at start-up by the .pth file, without importing anything of SGLang.
    assert "SGLangInstallFinder" in got["started"]["hooks"], got
    assert got["started"]["sglang"] is False, got
    assert got["mooncake"] == ["_send_kvcache_generic", "send_kvcache", "_send_mamba_state",
                               "_send_mamba_state_slice", "send_kvcache_slice", "send_kvcache_dcp",
                               "send_kvcache_staged"]
    assert got["ascend"] == ["_send_kvcache_generic", "send_kvcache", "_send_mamba_state"]
    assert got["on_error"] == "status"


@pytest.mark.parametrize("value", [None, "", "0", " 0 ", "false", "no", "off", "OFF", "False"])
def test_off_by_default_nothing_is_installed_or_imported(value: str | None) -> None:
    got = _probe(value)
    assert got["started"] == {"kvplan": False, "sglang": False, "hooks": got["started"]["hooks"]}
    assert "SGLangInstallFinder" not in got["started"]["hooks"], got
    assert got["mooncake"] == [] and got["ascend"] == [], got
    assert got["on_error"] is None


def test_enabled_reads_the_variable_strictly() -> None:
    for on in ("1", "true", "yes", "on", " Yes ", "ON"):
        assert autoinstall.enabled({"KVPLAN_SGLANG_INSTALL": on}), on
    assert not autoinstall.enabled({})
    for off in ("", "0", "false", "no", "off", " No ", "FALSE", "  "):
        assert not autoinstall.enabled({"KVPLAN_SGLANG_INSTALL": off}), off
    for bad in ("2", "maybe", "enable", "y", "n", "disabled", "0.0"):
        with pytest.raises(autoinstall.HookSettingError, match=f"KVPLAN_SGLANG_INSTALL="
                                                               f"'{bad}' is neither on") as e:
            autoinstall.enabled({"KVPLAN_SGLANG_INSTALL": bad})
        assert e.value.value == bad


def _sglang_shell(root: Path) -> None:
    """A minimal ``sglang`` package whose Mooncake module defines the manager class."""
    pkg = root / "sglang" / "srt" / "disaggregation" / "mooncake"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == root:
            break
        (d / "__init__.py").write_text("")
    (pkg / "conn.py").write_text("class MooncakeKVManager:\n    pass\n")


_IMPORT_SGLANG = ("import sys; sys.path.insert(0, sys.argv[1])\n"
                  "try:\n    import sglang.srt.disaggregation.mooncake.conn\n"
                  "except ImportError as exc:\n    print('ImportError:', exc)\n"
                  "else:\n    print('imported')\n")


def test_opted_in_with_kvplan_failing_to_import_sglang_refuses_loudly(tmp_path: Path) -> None:
    # A broken kvplan first on the path (as a failed build would leave it): SGLang must not
    # start without kvplan when the operator asked for it.
    broken = tmp_path / "broken" / "kvplan"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('kvplan._core: simulated failure')\n")
    _sglang_shell(tmp_path / "shell")
    env = dict(os.environ, KVPLAN_SGLANG_INSTALL="1", PYTHONPATH=str(tmp_path / "broken"))
    run = subprocess.run([sys.executable, "-c", _IMPORT_SGLANG, str(tmp_path / "shell")],
                         env=env, check=True, capture_output=True, text=True)
    assert "ImportError: KVPLAN_SGLANG_INSTALL='1' asks for kvplan in SGLang's transfer " \
        "managers, but kvplan's hook could not be armed (ImportError: kvplan._core: " \
        "simulated failure)" in run.stdout, run.stdout
    assert "imported" not in run.stdout.splitlines()
    # Said once at start-up too, although site-packages may be processed twice.
    assert run.stderr.count("kvplan: KVPLAN_SGLANG_INSTALL='1' is set but kvplan's SGLang hook "
                            "could not be armed at start-up (ImportError: kvplan._core: "
                            "simulated failure)") == 1, run.stderr


def test_opted_in_kvplan_importable_only_after_start_up_is_armed_at_sglang_import(
        tmp_path: Path) -> None:
    # An editable install's path line (kvplan.pth) sorts after the hook's .pth, so at start-up
    # kvplan may not be importable yet. Run without site (-S), the hook's line executed as site
    # executes it before kvplan is on the path: nothing said, and SGLang's import arms the hook
    # (the shell's module lacks the class, so the armed hook's own refusal is what comes back).
    pkg = tmp_path / "sglang" / "srt" / "disaggregation" / "mooncake"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == tmp_path:
            break
        (d / "__init__.py").write_text("")
    (pkg / "conn.py").write_text("class SomethingElse:\n    pass\n")
    line = autoinstall.pth_text().splitlines()[-1]
    code = ("import sys\n"
            f"sys.path.append({sysconfig.get_paths()['purelib']!r})\n"
            f"exec({line!r})\n"
            "print('pending', [getattr(f, '__name__', '') for f in sys.meta_path][0])\n"
            f"sys.path.insert(0, {str(ROOT / 'python')!r})\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "try:\n    import sglang.srt.disaggregation.mooncake.conn\n"
            "except ImportError as exc:\n    print('ImportError:', exc)\n")
    env = dict(os.environ, KVPLAN_SGLANG_INSTALL="1")
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path)], env=env, check=True,
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.stdout.splitlines()[0] == "pending KvplanSGLangHookPending", run.stdout
    assert "ImportError: KVPLAN_SGLANG_INSTALL is set but sglang.srt.disaggregation.mooncake." \
        "conn defines no class MooncakeKVManager" in run.stdout, run.stdout
    assert run.stderr == "", run.stderr


@pytest.mark.parametrize("value", ["maybe", "2", "enabled"])
def test_an_unknown_value_refuses_sglang_and_says_so(tmp_path: Path, value: str) -> None:
    _sglang_shell(tmp_path)
    env = dict(os.environ, KVPLAN_SGLANG_INSTALL=value)
    run = subprocess.run([sys.executable, "-c", _IMPORT_SGLANG, str(tmp_path)], env=env,
                         check=True, capture_output=True, text=True)
    assert f"KVPLAN_SGLANG_INSTALL='{value}' is neither on (1, true, yes, on) nor off" \
        in run.stdout, run.stdout
    assert run.stdout.startswith("ImportError:"), run.stdout
    assert "HookSettingError" in run.stderr, run.stderr


@pytest.mark.parametrize("value", ["false", "no", "off"])
def test_off_words_import_sglang_untouched(tmp_path: Path, value: str) -> None:
    _sglang_shell(tmp_path)
    env = dict(os.environ, KVPLAN_SGLANG_INSTALL=value)
    run = subprocess.run([sys.executable, "-c", _IMPORT_SGLANG + "print('kvplan' in sys.modules)",
                          str(tmp_path)], env=env, check=True, capture_output=True, text=True)
    assert run.stdout.split() == ["imported", "False"] and run.stderr == ""


def test_a_module_without_the_class_fails_its_import(tmp_path: Path) -> None:
    # A server opted in must not run without kvplan because SGLang renamed its class.
    pkg = tmp_path / "sglang" / "srt" / "disaggregation" / "mooncake"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == tmp_path:
            break
        (d / "__init__.py").write_text("")
    (pkg / "conn.py").write_text("class SomethingElse:\n    pass\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "try:\n    import sglang.srt.disaggregation.mooncake.conn\n"
            "except ImportError as exc:\n    print('ImportError:', exc)\n")
    env = dict(os.environ, KVPLAN_SGLANG_INSTALL="1")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    assert "ImportError: KVPLAN_SGLANG_INSTALL is set but sglang.srt.disaggregation.mooncake.conn " \
        "defines no class MooncakeKVManager" in out, out


def test_arm_installs_into_a_module_already_imported_and_only_once() -> None:
    code = r"""
import json, sys
sys.path.insert(0, TESTS)
from support.sglang_loader import load_sglang
sg = load_sglang()  # imported before the hook exists
from kvplan.compat.sglang import autoinstall, installed
first = autoinstall.arm()
second = autoinstall.arm()
hooks = sum(isinstance(f, autoinstall.SGLangInstallFinder) for f in sys.meta_path)
autoinstall.disarm()
print(json.dumps({"same": first is second, "hooks": hooks,
                  "left": sum(isinstance(f, autoinstall.SGLangInstallFinder) for f in sys.meta_path),
                  "mooncake": len(installed(sg.MooncakeKVManager))}))
""".replace("TESTS", repr(str(TESTS)))
    env = {k: v for k, v in os.environ.items() if k != autoinstall.ENV_VAR}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"same": True, "hooks": 1, "left": 0,
                                                        "mooncake": 7}
