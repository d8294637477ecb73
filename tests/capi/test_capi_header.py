"""The ctypes mirror of the C ABI (tests/support/capi.py) is the header's: a C program compiled
against rust/kvplan-capi/include/kvplan.h prints every struct's size and each field's offset and
size, every constant and every status code, and the mirror must give the same numbers. A field
added to a struct, reordered or retyped in the header without the mirror following would
otherwise only show as wrong values read by the library (or a ``struct_size`` refusal)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import capi

# Each mirrored struct and its name in the header.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "KvplanAttention": capi.Attention,
    "KvplanLayoutDesc": capi.LayoutDesc,
    "KvplanTemplateOptions": capi.TemplateOptions,
    "KvplanRequest": capi.RequestDesc,
    "KvplanLayoutDesc2": capi.LayoutDesc2,
    "KvplanRequest2": capi.RequestDesc2,
    "KvplanPool": capi.Pool,
    "KvplanLayoutDesc3": capi.LayoutDesc3,
    "KvplanPoolPages": capi.PoolPages,
    "KvplanPoolTokens": capi.PoolTokens,
    "KvplanRequest3": capi.RequestDesc3,
    "KvplanLayoutDesc4": capi.LayoutDesc4,
    "KvplanPlanInfo": capi.PlanInfo,
}
# Each mirrored constant and its name in the header.
CONSTANTS: dict[str, int] = {
    "KVPLAN_NO_TOKENS": capi.NO_TOKENS,
    "KVPLAN_NO_SLOT": capi.NO_SLOT,
    "KVPLAN_WINDOW_SRC": capi.WINDOW_SRC,
    "KVPLAN_WINDOW_DST": capi.WINDOW_DST,
    "KVPLAN_POOL_SRC": capi.POOL_SRC,
    "KVPLAN_POOL_DST": capi.POOL_DST,
    "KVPLAN_ENTRY_PAGE": capi.ENTRY_PAGE,
    "KVPLAN_ENTRY_STATE": capi.ENTRY_STATE,
    "KVPLAN_NO_STATE_SPLIT": capi.NO_STATE_SPLIT,
    "KVPLAN_MAX_SHARD_GROUPS": capi.MAX_SHARD_GROUPS,
    "KVPLAN_ORDER_NHD": capi.ORDER_NHD,
    "KVPLAN_ORDER_HND": capi.ORDER_HND,
    "KVPLAN_PAIR_BY_LAYER_ID": capi.PAIR_BY_LAYER_ID,
    "KVPLAN_PAIR_POSITIONAL": capi.PAIR_POSITIONAL,
}
STATUSES = {
    "KVPLAN_STATUS_OK": capi.OK,
    "KVPLAN_STATUS_NULL_POINTER": capi.NULL_POINTER,
    "KVPLAN_STATUS_INVALID_ARGUMENT": capi.INVALID_ARGUMENT,
    "KVPLAN_STATUS_INVALID_HANDLE": capi.INVALID_HANDLE,
    "KVPLAN_STATUS_BUFFER_TOO_SMALL": capi.BUFFER_TOO_SMALL,
    "KVPLAN_STATUS_PANIC": capi.PANIC,
    "KVPLAN_STATUS_INDEX_BOUNDS": capi.INDEX_BOUNDS,
    "KVPLAN_STATUS_LAYOUT": capi.LAYOUT,
    "KVPLAN_STATUS_OTHER": capi.OTHER,
    "KVPLAN_STATUS_HEAD_SLICING": capi.HEAD_SLICING,
}


def _compiler() -> str:
    for name in ("cc", "gcc", "clang"):
        if found := shutil.which(name):
            return found
    raise AssertionError("a C compiler is needed to read the header (scripts/setup-env installs gcc)")


def _program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvplan.h"',
             "int main(void) {"]
    for c_name, struct in STRUCTS.items():
        lines.append(f'  printf("{c_name} %zu\\n", sizeof({c_name}));')
        for field, _ in struct._fields_:  # type: ignore[misc]
            lines.append(f'  printf("{c_name}.{field} %zu %zu\\n", offsetof({c_name}, {field}), '
                         f"sizeof((({c_name} *)0)->{field}));")
    for name in CONSTANTS:
        # As the 64-bit word a field holding it carries (-1 and UINT64_MAX alike).
        lines.append(f'  printf("{name} %llu\\n", (unsigned long long)({name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def header_numbers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """What the C program compiled against the header prints: name -> numbers."""
    work: Path = tmp_path_factory.mktemp("header")
    (work / "layout.c").write_text(_program())
    exe = work / "layout"
    built = subprocess.run([_compiler(), "-std=c11", "-Wall", "-Wextra", "-Werror",
                            f"-I{capi.HEADER.parent}", "-o", str(exe), str(work / "layout.c")],
                           capture_output=True, text=True)
    # A field or constant the mirror names and the header does not: no such member.
    assert built.returncode == 0, f"the mirror names what the header lacks:\n{built.stderr}"
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    numbers: dict[str, list[int]] = {}
    for line in out.splitlines():
        name, *values = line.split()
        numbers[name] = [int(v) for v in values]
    return numbers


@pytest.mark.parametrize("c_name", list(STRUCTS))
def test_struct_mirrors_the_header(header_numbers: dict[str, list[int]], c_name: str) -> None:
    struct = STRUCTS[c_name]
    assert [ctypes.sizeof(struct)] == header_numbers[c_name], f"sizeof({c_name})"
    for field, _ in struct._fields_:  # type: ignore[misc]
        described = getattr(struct, field)
        assert [described.offset, described.size] == header_numbers[f"{c_name}.{field}"], (
            f"{c_name}.{field}: (offset, size) in the mirror vs the header")


def test_constants_mirror_the_header(header_numbers: dict[str, list[int]]) -> None:
    for name, value in CONSTANTS.items():
        assert [value % 2**64] == header_numbers[name], name


def test_every_header_struct_is_mirrored() -> None:
    """A struct the header gains is mirrored here (or this list says why not)."""
    declared = set(re.findall(r"^typedef struct (Kvplan\w+) \{", capi.HEADER.read_text(), re.M))
    assert declared == set(STRUCTS)


def test_statuses_are_the_headers() -> None:
    codes = dict(re.findall(r"^\s*(KVPLAN_STATUS_\w+) = (\d+),", capi.HEADER.read_text(), re.M))
    assert capi.STATUSES == {int(c) for c in codes.values()}
    for name, value in STATUSES.items():
        assert int(codes[name]) == value, name
    # The last code the header names is in the set the fuzz target accepts.
    assert max(int(c) for c in codes.values()) in capi.STATUSES
