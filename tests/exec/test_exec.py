"""kvplan.exec: one stage list per kind of plan, one executor interface, two executors.

Both executors (the NumPy one of ``kvplan.exec.numpy`` and ``kvplan.torch.TorchExecutor``) run
a direct, a staged, a packed, a row-gather and a conversion plan (quantized on the prefill, and
dequantized on the decode) through the one ``run(plan)`` and must leave the decode memory equal,
byte for byte, to the reference written from the layout definitions (``reference_copy``, or the
conversion reference of convert_cases). The torch half needs torch (the ``kvplan[torch]`` extra)
and is skipped without it. ``import kvplan.exec`` must not import torch.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvplan
from kvplan.exec import Executor, Role, stages
from kvplan.exec.numpy import Memory, NumpyExecutor, apply_conversion
from kvplan.testing.oracle import reference_copy
from kvplan.testing.ranks import Model, Rank, rank_memory

from support.convert_cases import (Deployment, decode, dequantized_prefill, expected_decode,
                                   fill_twin, plain_decode, prefill, quantized_prefill)

EXECUTORS = ["numpy", "torch"]
N_TOKENS = 11
SRC_PAGES = np.array([5, 0, 3, 1, 7, 2], dtype=np.int64)  # page size 2: 12 tokens
DST_PAGES = np.array([4, 1, 2], dtype=np.int64)  # page size 4: 12 tokens


# Whether PyTorch is really installed, decided on the import path and not by ``import torch``:
# other tests in the same process load engine code with a stand-in ``torch`` module in
# ``sys.modules``, which an import at test time would take for the real one.
TORCH_INSTALLED = importlib.machinery.PathFinder.find_spec("torch") is not None


def _torch() -> Any:
    if not TORCH_INSTALLED and os.environ.get("KVPLAN_REQUIRE_TORCH") != "1":
        pytest.skip("kvplan.torch needs PyTorch, not installed here (pip install "
                    "'kvplan[torch]', or run bash scripts/test-torch)")
    import torch
    return torch


def _region(size: int) -> Memory:
    return Memory.of(np.zeros(size, dtype=np.uint8))


def _executor(name: str, memories: dict[Role, Memory]) -> Executor:
    """The named executor over ``memories``: the NumPy one by role, the torch one over tensors
    sharing the same bytes (so both read and write the arrays the reference is compared to)."""
    if name == "numpy":
        return NumpyExecutor(memories["src"], memories["dst"],
                             src_staging=memories.get("src_staging"),
                             dst_staging=memories.get("dst_staging"))
    torch = _torch()
    from kvplan.torch import TorchExecutor
    return TorchExecutor({role: torch.from_numpy(m.data) for role, m in memories.items()})


# Each case: (memories by role, plan, the expected decode bytes, the network bytes).
Case = tuple[dict[Role, Memory], Any, np.ndarray, int]


def _kv_case(kind: str) -> Case:
    """One token request between a TP 1 prefill (page size 2, NHD) and a decode (page size 4,
    HND), planned as ``kind``; the expected decode is ``reference_copy``'s."""
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2)
    src = rank_memory(model, Rank(page_size=2, capacity=8), seed=3)
    dst = rank_memory(model, Rank(page_size=4, memory_order="HND", capacity=6))
    want = dst.memory.copy()
    reference_copy(src.layout, src.memory, dst.layout, want, SRC_PAGES, DST_PAGES,
                   n_tokens=N_TOKENS)
    template = kvplan.Template(src.layout, dst.layout)
    memories: dict[Role, Memory] = {"src": src.memory, "dst": dst.memory}
    size = int(src.memory.data.size)
    if kind == "direct":
        plan: Any = template.plan(SRC_PAGES, DST_PAGES, n_tokens=N_TOKENS)
        return memories, plan, want.data, plan.total_bytes
    memories["src_staging"] = pack = _region(size)
    region = (pack.base, size)
    if kind == "staged":
        memories["dst_staging"] = dst_staging = _region(size)
        plan = template.plan_staged(SRC_PAGES, DST_PAGES, src_staging=region,
                                    dst_staging=(dst_staging.base, size), n_tokens=N_TOKENS)
        return memories, plan, want.data, plan.network.total_bytes
    if kind == "packed":
        plan = template.plan_packed(SRC_PAGES, DST_PAGES, pack=region, n_tokens=N_TOKENS)
    else:
        plan = template.plan_row_gather(SRC_PAGES, DST_PAGES, pack=region, n_tokens=N_TOKENS)
    return memories, plan, want.data, plan[1].total_bytes


def _quantizing_case() -> Case:
    """bf16 prefill -> fp8 decode, quantized on the prefill; expected: the decode quantizing
    the same bf16 KV itself."""
    dep = Deployment(ps_p=2, ps_d=1, out_dtype="fp8_e4m3", scales="per_token_head")
    src, (real, twin) = prefill(dep, 0, 0, seed=7), decode(dep, 0)
    src_pages, dst_pages = np.array([3, 0, 5], np.int64), np.array([8, 2, 6, 1, 4], np.int64)
    fill_twin(dep, [src], twin, src_pages, dst_pages, 5)
    want = expected_decode(dep, 0, real, twin, dst_pages, 5)
    staging = _region(int(sum(e.data_len for e in src.layout.entries())) * 2 + 64)
    plan = kvplan.ConversionTemplate(src.layout, real.layout).plan(
        src_pages, dst_pages, (staging.base, staging.data.size), n_tokens=5)
    assert plan.convert_on == "prefill"
    return ({"src": src.memory, "src_staging": staging, "dst": real.memory}, plan, want,
            plan.network_bytes)


def _dequantizing_case() -> Case:
    """fp8 prefill with scales -> bf16 decode, dequantized on the decode; expected: every
    prefill value dequantized with its own scale and copied (``reference_copy``)."""
    dep = Deployment(ps_p=1, ps_d=2, out_dtype="fp8_e4m3")
    src = quantized_prefill(dep, 0, 0, seed=9)
    (real, _), (want, _) = plain_decode(dep, 0), plain_decode(dep, 0)
    src_pages, dst_pages = np.array([4, 0, 7, 2, 9], np.int64), np.array([5, 1, 3], np.int64)
    bf16 = dequantized_prefill(dep, src)
    reference_copy(bf16.layout, bf16.memory, want.layout, want.memory, src_pages, dst_pages,
                   n_tokens=5)
    size = int(sum(e.data_len for e in src.layout.entries())) * 2 + 64
    staging, dst_staging = _region(size), _region(size)
    plan = kvplan.ConversionTemplate(src.layout, real.layout).plan(
        src_pages, dst_pages, (staging.base, size), dst_staging=(dst_staging.base, size),
        n_tokens=5)
    assert plan.convert_on == "decode"
    return ({"src": src.memory, "src_staging": staging, "dst_staging": dst_staging,
             "dst": real.memory}, plan, want.arena, plan.network_bytes)


CASES: dict[str, Callable[[], Case]] = {
    "direct": lambda: _kv_case("direct"),
    "staged": lambda: _kv_case("staged"),
    "packed": lambda: _kv_case("packed"),
    "row_gather": lambda: _kv_case("row_gather"),
    "quantize_on_prefill": _quantizing_case,
    "dequantize_on_decode": _dequantizing_case,
}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("name", EXECUTORS)
def test_executor_writes_the_reference_decode_bytes(name: str, kind: str) -> None:
    memories, plan, want, network_bytes = CASES[kind]()
    executor = _executor(name, memories)
    assert isinstance(executor, Executor)
    before = memories["dst"].data.copy()
    assert executor.run(plan) == network_bytes
    dst = memories["dst"].data
    bad = np.flatnonzero(dst != want)
    assert bad.size == 0, f"{name} {kind}: {bad.size} wrong decode bytes, the first at {bad[0]}"
    assert not np.array_equal(dst, before), "the request moved no byte"


def test_each_kind_of_plan_has_its_stage_list() -> None:
    def described(case: Callable[[], Case]) -> list[tuple[Any, ...]]:
        return [(s.kind, s.side, s.reads, s.writes) for s in stages(case()[1])]

    assert described(CASES["direct"]) == [("network", None, "src", "dst")]
    assert described(CASES["staged"]) == [
        ("copy", "src", "src", "src_staging"), ("network", None, "src_staging", "dst_staging"),
        ("copy", "dst", "dst_staging", "dst")]
    assert described(CASES["packed"]) == [
        ("copy", "src", "src", "src_staging"), ("network", None, "src_staging", "dst")]
    assert described(CASES["row_gather"]) == [
        ("rows", "src", "src", "src_staging"), ("network", None, "src_staging", "dst")]
    assert described(CASES["quantize_on_prefill"]) == [
        ("copy", "src", "src", "src_staging"), ("convert", "src", "src_staging", "src_staging"),
        ("network", None, "src_staging", "dst"), ("copy", "dst", "dst", "dst")]
    assert described(CASES["dequantize_on_decode"]) == [
        ("copy", "src", "src", "src_staging"), ("network", None, "src_staging", "dst_staging"),
        ("convert", "dst", "dst_staging", "dst"), ("copy", "dst", "dst_staging", "dst")]


def test_the_stage_lists_are_the_cores() -> None:
    # Each plan's stages are the core's list for its form, read from the plan where the plan
    # is a core object and by the form's name where it reaches Python as columns or a pair.
    forms = {"direct": "direct", "staged": "staged", "packed": "packed",
             "row_gather": "row_gather", "quantize_on_prefill": "convert_on_prefill",
             "dequantize_on_decode": "convert_on_decode"}
    for kind, form in forms.items():
        plan = CASES[kind]()[1]
        assert [tuple(s) for s in stages(plan)] == list(kvplan._core.plan_stages(form)), kind
        if isinstance(plan, (kvplan.StagedPlan, kvplan.ConversionPlan)):
            assert plan.stages == kvplan._core.plan_stages(form), kind
    assert stages(CASES["staged"]()[1]) is stages(CASES["staged"]()[1])  # built once per list
    with pytest.raises(ValueError, match='no plan form is named "pack"; the forms are direct, '
                                         'staged, rounds, packed, row_gather, '
                                         'convert_on_prefill, convert_on_decode'):
        kvplan._core.plan_stages("pack")


def test_a_value_that_is_no_plan_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="a str is not a plan an executor runs"):
        stages("gather")  # type: ignore[arg-type]


def test_a_missing_staging_region_is_named_before_any_byte_moves() -> None:
    memories, plan, _, _ = CASES["staged"]()
    before = memories["dst"].data.copy()
    executor = NumpyExecutor(memories["src"], memories["dst"],
                             src_staging=memories["src_staging"])
    message = r"the network stage \(network\) of this StagedPlan writes dst_staging: give dst_"
    with pytest.raises(kvplan.KvPlanError, match=message):
        executor.run(plan)
    assert np.array_equal(memories["dst"].data, before)


def test_apply_conversion_takes_the_old_staging_keyword_with_a_warning() -> None:
    memories, plan, want, _ = CASES["quantize_on_prefill"]()
    with pytest.warns(DeprecationWarning, match=r"staging=\) is deprecated: pass src_staging="):
        apply_conversion(plan, memories["src"], dst_mem=memories["dst"],
                         staging=memories["src_staging"])
    assert np.array_equal(memories["dst"].data, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_conversion(plan, memories["src"], memories["src_staging"], memories["dst"])


def test_the_torch_executor_is_an_executor() -> None:
    _torch()
    from kvplan.exec.torch import TorchExecutor
    executor: Executor = TorchExecutor([])
    assert isinstance(executor, Executor)


def test_importing_kvplan_exec_imports_no_torch() -> None:
    # A finder that refuses torch: importing the package and its NumPy executor must not ask.
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch was imported')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import kvplan.exec, kvplan.exec.numpy\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
