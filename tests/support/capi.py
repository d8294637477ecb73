"""The C ABI (rust/kvplan-capi) through ctypes: its structs, the cdylib cargo builds, and the
library loaded with every entry point's argument and return types declared.

Pointer arguments are declared ``c_void_p`` so that a test can pass ``None`` (null), a
``ctypes.byref``, a ctypes array or pointer, or a bare integer address (a misaligned pointer, a
handle that was never created) exactly as a C caller could. Shared by ``tests/capi/`` (the same
blocks as ``kvplan.Template.plan``, every struct's size and field offsets as the header's, one
file per ABI version) and ``tests/robustness/test_capi_fuzz.py`` (no input crashes the library
or makes it write outside the caller's buffers).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import kvplan

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "rust" / "kvplan-capi" / "include" / "kvplan.h"

NO_TOKENS = -1
NO_SLOT = -1
WINDOW_SRC, WINDOW_DST = 1, 2
POOL_SRC, POOL_DST = 1, 2
ENTRY_PAGE, ENTRY_STATE = 0, 1
ORDER_NHD, ORDER_HND = 0, 1
PAIR_BY_LAYER_ID, PAIR_POSITIONAL = 0, 1
NO_STATE_SPLIT = 2**64 - 1  # KvplanLayoutDesc4::state_channels of an entry without a split
MAX_SHARD_GROUPS = 4

# KvplanStatus (include/kvplan.h).
OK = 0
NULL_POINTER = 1
INVALID_ARGUMENT = 2
INVALID_HANDLE = 3
BUFFER_TOO_SMALL = 4
PANIC = 5
INDEX_BOUNDS = 11
LAYOUT = 13
OTHER = 15
HEAD_SLICING = 16
# Every code the header's KvplanStatus names: the boundary's own and the core's.
STATUSES = frozenset(
    int(code) for code in re.findall(r"^\s*KVPLAN_STATUS_\w+ = (\d+),", HEADER.read_text(), re.M))

u64p = ctypes.POINTER(ctypes.c_uint64)
i64p = ctypes.POINTER(ctypes.c_int64)


class Attention(ctypes.Structure):
    _fields_ = [
        ("total_kv_heads", ctypes.c_uint32),
        ("heads_per_rank", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("dtype_size", ctypes.c_uint32),
        ("memory_order", ctypes.c_uint32),
    ]


class LayoutDesc(ctypes.Structure):
    _fields_ = [
        ("n_entries", ctypes.c_size_t),
        ("data_ptrs", ctypes.c_void_p),
        ("data_lens", ctypes.c_void_p),
        ("item_lens", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("layer_ids", ctypes.c_void_p),
        ("roles", ctypes.c_void_p),
        ("kinds", ctypes.c_void_p),
        ("page_size", ctypes.c_uint64),
        ("tp_rank", ctypes.c_uint32),
        ("tp_size", ctypes.c_uint32),
        ("pp_rank", ctypes.c_uint32),
        ("pp_size", ctypes.c_uint32),
        ("attention", ctypes.c_void_p),
    ]


class TemplateOptions(ctypes.Structure):
    _fields_ = [
        ("pairing", ctypes.c_uint32),
        ("check_dst_overlap", ctypes.c_uint8),
        ("replicas_send", ctypes.c_uint8),
    ]


class RequestDesc(ctypes.Structure):
    _fields_ = [
        ("src_pages", ctypes.c_void_p),
        ("n_src", ctypes.c_size_t),
        ("dst_pages", ctypes.c_void_p),
        ("n_dst", ctypes.c_size_t),
        ("n_tokens", ctypes.c_int64),
        ("skip_tokens", ctypes.c_uint64),
    ]


class LayoutDesc2(ctypes.Structure):
    """``KvplanLayoutDesc2`` (ABI version 2): a ``LayoutDesc`` with windows, a window pool and
    rings; ``struct_size`` must be ``ctypes.sizeof(LayoutDesc2)``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("base", LayoutDesc),
        ("windows", ctypes.c_void_p),
        ("window_page_size", ctypes.c_uint64),
        ("rings", ctypes.c_void_p),
    ]


class RequestDesc2(ctypes.Structure):
    """``KvplanRequest2`` (ABI version 2): a page or slot request with window pages;
    ``struct_size`` must be ``ctypes.sizeof(RequestDesc2)``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("src_pages", ctypes.c_void_p),
        ("n_src", ctypes.c_size_t),
        ("dst_pages", ctypes.c_void_p),
        ("n_dst", ctypes.c_size_t),
        ("n_tokens", ctypes.c_int64),
        ("skip_tokens", ctypes.c_uint64),
        ("src_slot", ctypes.c_int64),
        ("dst_slot", ctypes.c_int64),
        ("window_sides", ctypes.c_uint32),
        ("src_window_pages", ctypes.c_void_p),
        ("n_src_window", ctypes.c_size_t),
        ("dst_window_pages", ctypes.c_void_p),
        ("n_dst_window", ctypes.c_size_t),
    ]


class Pool(ctypes.Structure):
    """``KvplanPool`` (ABI version 3): one pool beside a layout's request pages."""

    _fields_ = [("page_size", ctypes.c_uint64), ("tokens_per_row", ctypes.c_uint64)]


class LayoutDesc3(ctypes.Structure):
    """``KvplanLayoutDesc3`` (ABI version 3): a ``LayoutDesc`` with windows, rings, a table of
    pools (``pools[k]`` is pool ``k + 1``) and each entry's pool; ``struct_size`` must be
    ``ctypes.sizeof(LayoutDesc3)``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("base", LayoutDesc),
        ("windows", ctypes.c_void_p),
        ("rings", ctypes.c_void_p),
        ("pools", ctypes.c_void_p),
        ("n_pools", ctypes.c_size_t),
        ("entry_pools", ctypes.c_void_p),
    ]


class LayoutDesc4(ctypes.Structure):
    """``KvplanLayoutDesc4`` (ABI version 4): ``LayoutDesc3``'s fields plus each state entry's
    TP channel split: ``state_channels`` (``NO_STATE_SPLIT`` for an entry without one),
    ``state_outer_rows``, ``shard_group_counts`` (``uint8_t`` per entry) and every entry's
    shard groups one after the other in ``shard_groups``; ``struct_size`` must be
    ``ctypes.sizeof(LayoutDesc4)``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("base", LayoutDesc),
        ("windows", ctypes.c_void_p),
        ("rings", ctypes.c_void_p),
        ("pools", ctypes.c_void_p),
        ("n_pools", ctypes.c_size_t),
        ("entry_pools", ctypes.c_void_p),
        ("state_channels", ctypes.c_void_p),
        ("state_outer_rows", ctypes.c_void_p),
        ("shard_group_counts", ctypes.c_void_p),
        ("shard_groups", ctypes.c_void_p),
        ("n_shard_groups", ctypes.c_size_t),
    ]


class PoolPages(ctypes.Structure):
    """``KvplanPoolPages`` (ABI version 3): one pool's pages per side."""

    _fields_ = [
        ("pool", ctypes.c_uint32),
        ("sides", ctypes.c_uint32),
        ("src_pages", ctypes.c_void_p),
        ("n_src", ctypes.c_size_t),
        ("dst_pages", ctypes.c_void_p),
        ("n_dst", ctypes.c_size_t),
    ]


class PoolTokens(ctypes.Structure):
    """``KvplanPoolTokens`` (ABI version 3): one pool's own token range."""

    _fields_ = [
        ("pool", ctypes.c_uint32),
        ("n_tokens", ctypes.c_uint64),
        ("skip_tokens", ctypes.c_uint64),
    ]


class RequestDesc3(ctypes.Structure):
    """``KvplanRequest3`` (ABI version 3): a page or slot request with pages and a token range
    per pool; ``struct_size`` must be ``ctypes.sizeof(RequestDesc3)``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("src_pages", ctypes.c_void_p),
        ("n_src", ctypes.c_size_t),
        ("dst_pages", ctypes.c_void_p),
        ("n_dst", ctypes.c_size_t),
        ("n_tokens", ctypes.c_int64),
        ("skip_tokens", ctypes.c_uint64),
        ("src_slot", ctypes.c_int64),
        ("dst_slot", ctypes.c_int64),
        ("pool_pages", ctypes.c_void_p),
        ("n_pool_pages", ctypes.c_size_t),
        ("pool_tokens", ctypes.c_void_p),
        ("n_pool_tokens", ctypes.c_size_t),
    ]


class PlanInfo(ctypes.Structure):
    _fields_ = [
        ("n_blocks", ctypes.c_size_t),
        ("total_bytes", ctypes.c_uint64),
        ("n_runs", ctypes.c_size_t),
        ("n_pages", ctypes.c_size_t),
        ("skip_tokens", ctypes.c_uint64),
    ]


def cdylib() -> Path:
    """Builds kvplan-capi with cargo (a no-op when up to date) and returns its cdylib's path."""
    cargo = shutil.which("cargo")
    assert cargo, "cargo is needed to build the C ABI library"
    out = subprocess.run(
        [cargo, "build", "-p", "kvplan-capi", "--locked", "--message-format=json"],
        cwd=ROOT, check=True, capture_output=True, text=True, env=os.environ.copy(),
    ).stdout
    for line in out.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message["target"]["name"] == "kvplan_capi":
            for name in message["filenames"]:
                if name.endswith((".so", ".dylib")):
                    return Path(name)
    raise AssertionError("cargo built no kvplan_capi cdylib")


def load() -> ctypes.CDLL:
    """The C ABI library with every entry point's signature declared (as in kvplan.h)."""
    lib = ctypes.CDLL(str(cdylib()))
    vp, size, status = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32
    signatures: dict[str, tuple[list[type], type]] = {
        "kvplan_abi_version": ([], ctypes.c_uint32),
        "kvplan_layout_new": ([vp, vp], status),
        "kvplan_layout_free": ([vp], status),
        "kvplan_layout_n_entries": ([vp, vp], status),
        "kvplan_template_new": ([vp, vp, vp, vp], status),
        "kvplan_template_free": ([vp], status),
        "kvplan_template_bytes_per_page": ([vp, vp], status),
        "kvplan_prepare": ([vp, vp, vp], status),
        "kvplan_plan_into": ([vp, vp, vp, vp, vp, size, vp], status),
        "kvplan_layout_new2": ([vp, vp], status),
        "kvplan_prepare2": ([vp, vp, vp], status),
        "kvplan_plan_into2": ([vp, vp, vp, vp, vp, size, vp], status),
        "kvplan_layout_new3": ([vp, vp], status),
        "kvplan_prepare3": ([vp, vp, vp], status),
        "kvplan_plan_into3": ([vp, vp, vp, vp, vp, size, vp], status),
        "kvplan_layout_new4": ([vp, vp], status),
        "kvplan_last_error_message": ([], ctypes.c_char_p),
        "kvplan_last_error_kind": ([], ctypes.c_char_p),
        "kvplan_status_name": ([ctypes.c_int32], ctypes.c_char_p),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    return lib


def error(lib: ctypes.CDLL) -> str:
    """The message of the calling thread's last failed call."""
    return lib.kvplan_last_error_message().decode()


def c_array(values: Sequence[int], ctype: type) -> ctypes.Array:  # type: ignore[type-arg]
    """``values`` as a C array of ``ctype`` (one element at least, so that its address is a
    valid pointer even for an empty list)."""
    return (ctype * max(len(values), 1))(*[int(v) for v in values])


class BothForms(Protocol):
    """A peer a test builds twice: as a C-ABI layout handle and as a ``kvplan.Layout``."""

    def c(self, lib: ctypes.CDLL) -> ctypes.c_void_p: ...

    def python(self) -> kvplan.Layout: ...


def both_templates(lib: ctypes.CDLL, src: BothForms, dst: BothForms
                   ) -> tuple[kvplan.Template | None, ctypes.c_void_p | None, str]:
    """The C ABI's and the Python binding's template of ``src`` and ``dst``, or neither and the
    refusal's message: both must refuse alike, with the same message."""
    import kvplan

    s, d = src.c(lib), dst.c(lib)
    template = ctypes.c_void_p()
    status = lib.kvplan_template_new(s, d, None, ctypes.byref(template))
    c_message = error(lib) if status != 0 else ""
    assert lib.kvplan_layout_free(s) == 0 and lib.kvplan_layout_free(d) == 0
    try:
        py = kvplan.Template(src.python(), dst.python())
    except kvplan.KvPlanError as err:
        assert status != 0, f"Python refused ({err}) but the C ABI made a template"
        assert c_message == str(err)
        return None, None, c_message
    assert status == 0, c_message
    return py, template, ""
