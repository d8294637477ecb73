"""``kvplan.staging.host_memory`` / ``host_views``: the one check, used by the vLLM connector
(its KV tensors' devices) and the SGLang drop-in (its pool addresses against this process's
mappings), that a round's host copy may touch the KV buffers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvplan.staging import host_memory, host_views
from kvplan.staging import memory as staging_memory


def tensor(device: str | None) -> Any:
    return SimpleNamespace(device=None if device is None else SimpleNamespace(type=device))


def test_regions_inside_this_process_mappings_are_host() -> None:
    a = np.zeros(1 << 16, np.uint8)
    addr = int(a.ctypes.data)
    assert host_memory([(addr, a.nbytes)])
    assert host_memory([(addr + 100, 1000), (addr, 1)])
    assert host_memory([])
    assert not host_memory([(addr, 1 << 46)])  # runs past every mapping
    assert not host_memory([((1 << 47) - 4096, 4096)])  # nothing mapped there
    assert not host_memory([(addr, a.nbytes), (16, 16)])  # one region outside: False


def test_unreadable_mappings_are_not_host(monkeypatch: pytest.MonkeyPatch) -> None:
    a = np.zeros(4096, np.uint8)
    monkeypatch.setattr(staging_memory, "MAPS", "/nonexistent/kvplan/maps")
    assert not host_memory([(int(a.ctypes.data), a.nbytes)])


def test_tensors_on_a_device_are_not_host() -> None:
    assert host_memory(tensors=[tensor("cpu"), np.zeros(4), tensor(None)])
    assert not host_memory(tensors=[tensor("cpu"), tensor("cuda")])
    assert not host_memory(tensors=[tensor("npu")])
    assert host_memory(tensors=[SimpleNamespace(device=object())])  # a device without a type


def test_host_views_share_the_memory() -> None:
    a = np.arange(64, dtype=np.uint8)
    b = np.zeros(32, np.uint8)
    va, vb = host_views([(int(a.ctypes.data), a.nbytes), (int(b.ctypes.data) + 8, 16)])
    assert va.dtype == np.uint8 and va.nbytes == 64 and vb.nbytes == 16
    np.testing.assert_array_equal(va, a)
    vb[:] = 7
    assert b[8:24].tolist() == [7] * 16 and b[:8].tolist() == [0] * 8


def test_both_connectors_ask_the_one_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplan.compat.sglang import rounds
    from kvplan.compat.vllm import staging as vstaging

    a = np.zeros(4096, np.uint8)
    assert rounds.host_pools([int(a.ctypes.data)], [a.nbytes])
    assert not vstaging.host_kv(SimpleNamespace(device_kv_caches={"l0": tensor("cuda")}))
    assert vstaging.host_kv(SimpleNamespace(device_kv_caches={"l0": tensor("cpu")}))
    assert vstaging.host_kv(SimpleNamespace())  # tensors not recorded: host, as before
    asked: list[Any] = []

    def spy(regions: Any = (), *, tensors: Any = ()) -> bool:
        asked.append((list(regions), list(tensors)))
        return False

    monkeypatch.setattr(rounds, "host_memory", spy)
    monkeypatch.setattr(vstaging, "host_memory", spy)
    assert not rounds.host_pools([10, 20], [1, 2])
    assert not vstaging.host_kv(SimpleNamespace(device_kv_caches={"l0": "t"}))
    assert asked == [([(10, 1), (20, 2)], []), ([], ["t"])]
