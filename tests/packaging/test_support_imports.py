"""The tests depend on ``tests/support``, never on ``bench/``; the benchmarks may use the support.

Read statically with ``ast`` from every Python file under ``tests/``: a test (or support module)
must not import a benchmark module by name, nor reach into ``bench/`` by path (a ``"bench"``
component handed to ``os.path.join``, ``Path(...)``, ``spec_from_file_location`` or a ``/``
between paths). Docstrings and other free text may still name the benchmark scripts, and
``bench/results/`` (the recorded numbers, no code) may be read: the README test checks its
numbers against them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
BENCH = REPO / "bench"


def bench_module_names() -> set[str]:
    """Top-level names a benchmark script or package is imported by (``bench/`` on sys.path)."""
    names = {p.stem for p in BENCH.glob("*.py")}
    names |= {p.parent.name for p in BENCH.glob("*/__init__.py")}
    return names


RESULTS = "bench/results"  # benchmark records, not benchmark code


def _names_bench(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    path = node.value
    if path == RESULTS or path.startswith(RESULTS + "/"):
        return False
    return path == "bench" or path.startswith("bench/") or "/bench/" in path


def bench_references(path: Path, bench_modules: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.split(".")[0] in bench_modules]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in bench_modules:
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            found += [f"line {node.lineno}: {ast.unparse(node)}"
                      for arg in node.args if _names_bench(arg)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if _names_bench(node.left) or _names_bench(node.right):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_bench_modules_are_found() -> None:
    # the check below is only as good as this list
    assert {"compare_sglang", "tp_bench", "leak_check", "harness"} <= bench_module_names()


#: Smoke tests that run one benchmark script as a program (a subprocess) and read its output:
#: test file -> the one script path it may name. Importing bench code stays forbidden there too.
RUNS_BENCH_SCRIPT = {
    "tests/packaging/test_wire_ceiling_smoke.py": "bench/wire_ceiling.py",
    "tests/packaging/test_vllm_nixl_staged_smoke.py": "bench/vllm_nixl_staged.py",
}


def test_no_test_imports_bench() -> None:
    bench_modules = bench_module_names()
    this_file = Path(__file__).resolve()  # it names bench/ to read it, not to import from it
    offenders = {}
    for p in sorted(TESTS.rglob("*.py")):
        name = str(p.relative_to(REPO))
        refs = bench_references(p, bench_modules) if p != this_file else []
        script = RUNS_BENCH_SCRIPT.get(name)
        if script is not None:
            named = [r for r in refs if r.endswith(f"'{script}'")]
            assert named, f"{name} no longer names {script}: drop it from RUNS_BENCH_SCRIPT"
            refs = [r for r in refs if r not in named]
        if refs:
            offenders[name] = refs
    assert not offenders, f"tests reach into bench/: {offenders}"


def test_reference_check_sees_path_loading(tmp_path: Path) -> None:
    # negative control: the ways tests used to load bench code are all caught
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os, importlib.util\n"
        "from pathlib import Path\n"
        "import tp_bench\n"
        "from compare_sglang import Scenario\n"
        "importlib.util.spec_from_file_location('x', os.path.join(HERE, '..', 'bench', 'x.py'))\n"
        "spec = Path(ROOT) / 'bench' / 'sglang_loader.py'\n", encoding="utf-8")
    assert len(bench_references(sample, bench_module_names())) == 4


def test_reading_the_benchmark_records_is_not_reaching_into_bench(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from pathlib import Path\n"
        "records = (Path(ROOT) / 'bench/results').glob('*.md')\n"
        "script = Path(ROOT) / 'bench/compare_sglang.py'\n", encoding="utf-8")
    assert bench_references(sample, set()) == ["line 3: Path(ROOT) / 'bench/compare_sglang.py'"]


def test_support_modules_do_not_shadow_kvplan_testing() -> None:
    # ``kvplan.testing.peers`` and a test helper called ``peers`` were easy to confuse
    support = {p.stem for p in (TESTS / "support").glob("*.py")} - {"__init__"}
    testing = {p.stem for p in (REPO / "python" / "kvplan" / "testing").glob("*.py")}
    assert support and not support & testing, support & testing
