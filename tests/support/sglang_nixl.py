"""Load SGLang 0.5.23's ``disaggregation/nixl/conn.py`` from the wheel the SGLang loader uses
(``support.sglang_loader``), and a recording stand-in for a NIXL agent.

The module is executed under its real dotted name with the loader's stand-ins for what it
imports and does not run here (torch, msgspec, zmq, the rest of SGLang's runtime, the ``nixl``
bindings: its ``try`` falls back to ``RuntimeError`` as on a host without them);
:func:`verify_closure` proves none of them is reachable from the methods the tests run. The manager is
never constructed (its ``__init__`` creates a NIXL agent, threads and sockets): tests build an
instance with ``sg.manager_object`` and give it a :class:`RecordingAgent` as ``agent``.

:class:`RecordingAgent` keeps NIXL 0.5's ``nixl_agent`` call signatures for the calls the send
paths make (``get_xfer_descs``, ``initialize_xfer``, ``transfer``, ``prep_xfer_dlist``,
``make_prepped_xfer``, ``check_xfer_state``) and records every descriptor list it is handed as
an ``(n, 3)`` uint64 array of ``(addr, len, dev_id)`` rows (strided ``(n, 5)`` rows are kept as
given): what the transfer would write is those rows, so a test maps them to bytes."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import types
from typing import Any

import numpy as np

from support.package_shells import Finder, finding, walk_globals
from support.sglang_loader import REAL_MODULES, REAL_PACKAGES, THIRD_PARTY_STANDINS, RUNTIME

NIXL_CONN = "sglang.srt.disaggregation.nixl.conn"


def load_nixl(sg: Any) -> types.ModuleType:
    """Execute ``nixl/conn.py`` from ``sg.root`` once; returns the module (``NixlKVManager``)."""
    mod = sys.modules.get(NIXL_CONN)
    if mod is not None and getattr(mod, "__file__", "").startswith(sg.root):
        return mod
    finder = Finder({"sglang": sg.root}, REAL_MODULES, real_packages=REAL_PACKAGES,
                    standins=(*THIRD_PARTY_STANDINS, "nixl", "triton"))
    path = os.path.join(sg.root, "srt", "disaggregation", "nixl", "conn.py")
    with finding(finder):
        spec = importlib.util.spec_from_file_location(NIXL_CONN, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[NIXL_CONN] = mod
        spec.loader.exec_module(mod)
    cls = mod.NixlKVManager
    assert cls._send_kvcache_generic.__code__.co_filename == path
    # the real helpers the send paths call, not stand-ins
    for name in ("group_concurrent_contiguous", "build_transfer_entry_pairs", "is_elided_entry"):
        assert getattr(mod, name) is getattr(sg, name, None) or \
            getattr(mod, name).__module__.startswith("sglang."), name
    mod.__dict__["get_device"] = lambda: types.SimpleNamespace(gpu_id=0)
    if "get_parallel" in mod.__dict__:
        mod.__dict__["get_parallel"] = lambda: RUNTIME.parallel
    verify_closure(mod)
    return mod


#: The NIXL manager's methods the tests run (and kvplan replaces or keeps).
RUN_METHODS = ("_send_kvcache_generic", "send_kvcache", "send_kvcache_dcp", "_send_mamba_state",
               "_send_mamba_state_slice",
               "_prep_equal_tp_dlist", "_prep_xfer_dlist", "_pack_stride_descs",
               "_expand_stride_descs", "_init_hetero_tp_prep_handle", "send_kvcache_slice",
               "_post_xfer")


def verify_closure(mod: types.ModuleType) -> list[str]:
    """No stand-in is reachable from the methods the tests run: every global they load,
    transitively through SGLang's module-level functions, is SGLang's or Python's."""
    cls = mod.NixlKVManager
    roots = [getattr(cls, name) for name in RUN_METHODS]
    roots += [mod.expand_page_indices_for_slice, mod.repeat_indices_over_layers,
              mod.build_dcp_token_transfer_plan]
    return walk_globals(roots, ("sglang.",))


class _Handle:
    """A transfer or prepared-list handle: truthy, names what it was made from."""

    _ids = itertools.count(1)

    def __init__(self, kind: str, *parts: Any) -> None:
        self.kind, self.parts, self.id = kind, parts, next(self._ids)

    def __repr__(self) -> str:
        return f"<{self.kind} #{self.id}>"


class RecordingAgent:
    """NIXL's ``nixl_agent`` call signatures for what the send paths call; records descriptor
    rows and transfers, and posts every transfer successfully."""

    def __init__(self) -> None:
        self.transfers: list[tuple[str, np.ndarray, np.ndarray, str]] = []
        self.prepped: list[tuple[str, Any, np.ndarray, Any, np.ndarray]] = []
        self.dlists: list[tuple[str, np.ndarray, str]] = []
        self.posted = 0

    def get_xfer_descs(self, descs: Any, mem_type: str = "DRAM", is_sorted: bool = False) -> Any:
        rows = np.asarray(descs, dtype=np.uint64)
        if rows.size == 0:
            rows = rows.reshape(0, 3)
        assert rows.ndim == 2 and rows.shape[1] == 3, rows.shape
        return _Handle("descs", rows.copy(), mem_type)

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None,
                        is_sorted: bool = False, backends: list[str] | None = None) -> Any:
        rows = xfer_list.parts[0] if isinstance(xfer_list, _Handle) else np.asarray(
            xfer_list, dtype=np.uint64)
        self.dlists.append((agent_name, rows.copy(), str(mem_type)))
        return _Handle("dlist", rows.copy(), agent_name)

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any,
                        remote_agent: str, notif_msg: bytes = b"",
                        backends: list[str] | None = None) -> Any:
        src, dst = local_descs.parts[0], remote_descs.parts[0]
        assert src.shape == dst.shape, (src.shape, dst.shape)
        assert (src[:, 1] == dst[:, 1]).all()
        self.transfers.append((operation, src, dst, remote_agent))
        return _Handle("xfer", operation, remote_agent)

    def make_prepped_xfer(self, operation: str, local_xfer_side: Any, local_indices: Any,
                          remote_xfer_side: Any, remote_indices: Any, notif_msg: bytes = b"",
                          backends: list[str] | None = None, skip_desc_merge: bool = False) -> Any:
        self.prepped.append((operation, local_xfer_side, np.asarray(local_indices),
                             remote_xfer_side, np.asarray(remote_indices)))
        return _Handle("xfer", operation)

    def transfer(self, handle: Any, notif_msg: bytes = b"") -> str:
        self.posted += 1
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        return "DONE"

    def written(self) -> list[tuple[int, int, int]]:
        """Every ``(src, dst, length)`` row of the recorded transfers, in order."""
        out: list[tuple[int, int, int]] = []
        for _, src, dst, _ in self.transfers:
            out.extend(zip(src[:, 0].tolist(), dst[:, 0].tolist(), src[:, 1].tolist()))
        return out

    def descriptor_count(self) -> int:
        return sum(len(src) for _, src, _, _ in self.transfers)
