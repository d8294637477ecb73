"""Stand-ins for ``memfabric_hybrid.TransferEngine`` (the Ascend engine), which needs an NPU.

- :data:`FIXTURE` / :func:`fixture`: the recorded pybind11 signatures of memfabric 1.3.0
  (``support/fixtures/memfabric_signatures.json``; ``tests/engines/test_ascend.py
  --write-fixture`` regenerates it from an installed memfabric).
- :class:`FixtureEngine`: records every call after binding it to those signatures and checking
  the argument types, so a call shape the real binding would refuse fails without memfabric.
- :class:`StandInMemfabric`: the same signatures, validating a batch like memfabric and then
  copying the bytes in-process, so a transfer through the Ascend adapter can be checked byte
  for byte.
- :func:`plan_batch`: a :class:`kvplan.BlockSlice` from plain lists of addresses and lengths.
"""

from __future__ import annotations

import ctypes
import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "memfabric_signatures.json"

#: The engine methods the adapter calls; their signatures must match the fixture exactly.
ADAPTER_METHODS = ("initialize", "get_rpc_port", "batch_register_memory", "unregister_memory",
                   "batch_transfer_sync_write", "unInitialize")


def fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _check_type(annotation: str, value: Any, where: str) -> None:
    """The subset of pybind11 annotations memfabric uses."""
    if annotation == "str":
        assert isinstance(value, str), f"{where}: {value!r} is not a str"
    elif annotation == "typing.SupportsInt":
        assert type(value) is int and 0 <= value < 2**64, f"{where}: {value!r} is not a u64 int"
    elif annotation.startswith("collections.abc.Sequence"):
        assert type(value) is list, f"{where}: {type(value).__name__} passed, the adapter must " \
                                    f"pass lists (3x faster to convert than numpy arrays)"
        for v in value:
            assert type(v) is int and 0 <= v < 2**64, f"{where}: element {v!r} is not a u64 int"
    elif annotation.endswith("TransDataOpType"):
        assert value is not None
    else:
        raise AssertionError(f"{where}: no checker for annotation {annotation!r}")


class FixtureEngine:
    """Records calls after binding them to the fixture's signatures and checking types.

    Any call shape the real binding would refuse (wrong arity, unknown keyword, float, numpy
    array) fails here, without memfabric installed.
    """

    def __init__(self, statuses: dict[str, int] | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.statuses = statuses or {}
        spec = fixture()["methods"]
        for name, sig in spec.items():
            setattr(self, name, self._method(name, sig))

    def _method(self, name: str, sig: dict[str, Any]) -> Any:
        params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=inspect.Parameter.empty if d is None else d)
                  for p, _, d in sig["params"]]
        signature = inspect.Signature(params)
        types = {p: t for p, t, _ in sig["params"]}

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)  # TypeError on a wrong call shape
            for key, value in bound.arguments.items():
                _check_type(types[key], value, f"{name}({key}=...)")
            self.calls.append((name, dict(bound.arguments)))
            if sig["returns"] == "None":
                return None
            return self.statuses.get(name, 30001 if name == "get_rpc_port" else 0)

        return call


INVALID_PARAM = -2000


class StandInMemfabric:
    """In-process stand-in for ``memfabric_hybrid.TransferEngine``: same signatures, copies bytes.

    Engines find each other through ``network`` (session id -> engine). Like memfabric,
    ``batch_transfer_sync_write`` validates the whole batch before copying anything.
    """

    class TransDataOpType:  # the enum values of memfabric 1.3.0
        SDMA, HOST_RDMA, DEVICE_RDMA, DEVICE_URMA, DEVICE_UBOE = 1, 2, 8, 64, 128

    _next_port = 30001

    def __init__(self, network: dict[str, StandInMemfabric]) -> None:
        self.network = network
        self.session: str | None = None
        self.regions: list[tuple[int, int]] = []
        self.writes = 0
        StandInMemfabric._next_port += 1
        self._port = StandInMemfabric._next_port

    @staticmethod
    def _u64(*values: Any) -> None:
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**64:
                raise TypeError("incompatible function arguments")

    def initialize(self, store_url: str, session_id: str, role: str, device_id: int,
                   data_op_type: Any = TransDataOpType.SDMA, store_server_role: str = "Decode",
                   nic: str = "") -> int:
        if role not in ("Prefill", "Decode"):
            return -1
        self.session = session_id
        self.network[session_id] = self
        return 0

    def get_rpc_port(self) -> int:
        return self._port

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        return self.batch_register_memory([buffer_addr], [capacity])

    def batch_register_memory(self, buffer_addrs: Any, capacities: Any) -> int:
        self._u64(*buffer_addrs, *capacities)
        if len(buffer_addrs) != len(capacities):
            return -1
        self.regions += list(zip(buffer_addrs, capacities))
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        self.regions = [r for r in self.regions if r[0] != buffer_addr]
        return 0

    def _inside(self, addr: int, n: int) -> bool:
        return any(s <= addr and addr + n <= s + ln for s, ln in self.regions)

    def batch_transfer_sync_write(self, dest_session: str, buffers: Any, peer_buffers: Any,
                                  lengths: Any, flags: int = 0) -> int:
        self._u64(*buffers, *peer_buffers, *lengths, flags)
        if not (len(buffers) == len(peer_buffers) == len(lengths)):
            return -1
        peer = self.network.get(dest_session)
        if (not buffers or flags != 0 or peer is None or 0 in lengths or 0 in buffers
                or 0 in peer_buffers):
            return INVALID_PARAM
        if not all(peer._inside(d, n) for d, n in zip(peer_buffers, lengths)):
            return INVALID_PARAM
        for s, d, n in zip(buffers, peer_buffers, lengths):
            ctypes.memmove(d, s, n)
        self.writes += 1
        return 0

    def unInitialize(self) -> None:
        if self.session is not None:
            self.network.pop(self.session, None)


def plan_batch(src: list[int], dst: list[int], lengths: list[int]) -> Any:
    from kvplan import BlockSlice

    return BlockSlice(*(np.array(x, dtype=np.uint64) for x in (src, dst, lengths)))
