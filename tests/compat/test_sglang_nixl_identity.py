"""The layout identity at SGLang's NIXL registration (``install(NixlKVManager)``, docs/sglang.md
"Layout identity with NIXL").

SGLang 0.5.23's real ``NixlKVManager`` (from the wheel, ``support.sglang_nixl``) on both sides:
the decode's ``build_receiver_registration_message``, the prefill's
``KVArgsRegisterInfo.from_zmq`` and ``_add_remote_peer``, then ``add_transfer_request`` and
SGLang's ``conclude_failure``. What those call that is not about the identity (the peer's
prepared descriptor lists, the status message to the decode's socket) is recorded on the
instance.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

import kvplan
from kvplan import IncompatiblePeerError
from kvplan.compat import sglang as compat
from kvplan.compat.sglang import nixl as sg_nixl
from kvplan.compat.sglang import rounds
from kvplan.identity import IDENTITY_KEY
from support.log_records import records
from support.sglang_models import load_sglang_or_fail
from support.sglang_nixl import RecordingAgent, load_nixl

ROPE_1 = {"rope_type": "yarn", "factor": 1.0}
ROPE_2 = {"rope_type": "yarn", "factor": 2.0}
LAYERS, ITEM, SLOTS, ROOM = 4, 1152, 64, 7001


@pytest.fixture(scope="module")
def nx() -> Iterator[Any]:
    sg = load_sglang_or_fail()
    mod = load_nixl(sg)
    compat.install(mod.NixlKVManager)
    yield types.SimpleNamespace(sg=sg, mod=mod, cls=mod.NixlKVManager)
    compat.uninstall(mod.NixlKVManager)


def server_args(*, model: str = "org/model", revision: str = "abc123", rope: Any = ROPE_1,
                draft: str | None = None) -> Any:
    """The attributes of SGLang's ``ServerArgs`` the identity reads (0.5.23's names)."""
    return types.SimpleNamespace(model_path=model, revision=revision,
                                 speculative_draft_model_path=draft,
                                 json_model_override_args=json.dumps({"rope_scaling": rope}))


class Agent(RecordingAgent):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.remote = name, []

    def get_agent_metadata(self) -> bytes:
        return f"nixl-{self.name}".encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        self.remote.append(metadata)
        return metadata.decode()


def manager(nx: Any, name: str, mode: str, args: Any, base: int) -> Any:
    """An MLA manager (one latent per token, ``LAYERS`` pools) as SGLang's ``__init__``
    leaves it, with what the registration and request paths read."""
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=[base + i * ITEM * SLOTS for i in range(LAYERS)],
        kv_data_lens=[ITEM * SLOTS] * LAYERS, kv_item_lens=[ITEM] * LAYERS,
        kv_data_mem_kinds=["DRAM"] * LAYERS, kv_layer_ids=list(range(LAYERS)),
        aux_data_ptrs=[], state_data_ptrs=[], state_item_lens=[], state_data_lens=[],
        state_dim_per_tensor=[], state_layer_ids=[], state_types=[], gpu_id=0, engine_rank=0,
        page_size=1, prefill_start_layer=0, mla_compression_ratios=None, num_draft_entries=0)
    mode_enum = getattr(nx.mod.DisaggregationMode, mode)
    sent: list[Any] = []
    prepared: list[str] = []
    mgr = nx.sg.manager_object(
        nx.cls, kv_args=kv_args, agent=Agent(name), is_mla_backend=True, server_args=args,
        disaggregation_mode=mode_enum, enable_staging=False, local_ip="127.0.0.1",
        rank_port=17000, dcp_size=1, dcp_rank=0, decode_kv_args_table={},
        transfer_infos={}, transfer_queues=[queue.Queue()], request_status={},
        failure_lock=threading.Lock(), failure_records={}, deferred_bootstrap=None)
    # SGLang's own preparation of a registered peer and its status socket: not what is tested
    mgr.__dict__.update(
        requires_dcp_relayout=lambda size, rank: False,
        check_peer_aux_buffer_count=lambda agent, n: None,
        _prepare_payload_xfer=lambda info: prepared.append(info.agent_name),
        _prepare_state_xfer=lambda info: None,
        send_kv_status_message=lambda **kw: sent.append(kw))
    mgr.__dict__["_test"] = types.SimpleNamespace(sent=sent, prepared=prepared)
    return mgr


def register(nx: Any, pmgr: Any, dmgr: Any) -> Any:
    """The decode's registration as the prefill's bootstrap thread handles it: guard frame
    stripped, ``KVArgsRegisterInfo.from_zmq``, ``_add_remote_peer``."""
    frames = dmgr.build_receiver_registration_message()
    assert frames[0] == nx.mod.GUARD
    info = nx.mod.KVArgsRegisterInfo.from_zmq(frames[1:])
    pmgr._add_remote_peer(info)
    return info


def request(pmgr: Any, dmgr: Any) -> Any:
    """One room bootstrapped to the decode, then the sender's first chunk."""
    import numpy as np

    pmgr.transfer_infos[ROOM] = {dmgr.agent.name: types.SimpleNamespace(
        is_dummy=False, endpoint="127.0.0.1", dst_port=17000, room=ROOM)}
    pmgr.request_status[ROOM] = nx_poll(pmgr).WaitingForInput
    pmgr.add_transfer_request(ROOM, np.arange(4, dtype=np.int32), slice(0, 4), False)
    return pmgr.transfer_queues[0]


def nx_poll(mgr: Any) -> Any:
    import sys

    return sys.modules[type(mgr).__mro__[1].__module__].KVPoll




MISMATCHES = [
    ("other model", {"model": "org/other"}, ('"org/model"', '"org/other"')),
    ("two revisions", {"revision": "def456"}, ('"abc123"', '"def456"')),
    ("RoPE factor 1 -> 2", {"rope": ROPE_2}, ('"factor\\":1', '"factor\\":2')),
    ("draft on the decode only", {"draft": "/models/eagle-head"}, ("eagle-head",)),
]


@pytest.mark.parametrize("case, decode_kw, values", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_prefill_refuses_an_incompatible_decode_and_fails_its_transfers(
        nx: Any, case: str, decode_kw: dict[str, Any], values: tuple[str, ...]) -> None:
    pmgr = manager(nx, "prefill", "PREFILL", server_args(), 1 << 32)
    dmgr = manager(nx, "decode", "DECODE", server_args(**decode_kw), 1 << 36)
    p_class = sg_nixl.nixl_identity(pmgr).identity.local.class_id
    d_class = sg_nixl.nixl_identity(dmgr).identity.local.class_id
    assert p_class != d_class
    with records("kvplan.compat.sglang") as said:
        for _ in range(2):  # a restarted decode registers again: checked again
            info = register(nx, pmgr, dmgr)
    assert info.kvplan_staging[IDENTITY_KEY]["class_id"] == d_class
    err = sg_nixl.nixl_identity(pmgr).refused["decode"]
    assert isinstance(err, IncompatiblePeerError) and isinstance(err, kvplan.KvPlanError)
    assert err.refused_by == "semantics" and err.local_role == "prefill"
    reason = str(err)
    assert reason.startswith("kvplan refuses transfers with peer decode")
    assert p_class in reason and d_class in reason
    for value in values:
        assert value in reason, (value, reason)
    assert [r.levelno for r in said if "refuses" in r.getMessage()] == [logging.ERROR]
    queued = request(pmgr, dmgr)
    assert queued.empty()  # never reaches SGLang's transfer worker: no byte moves
    assert pmgr.request_status[ROOM] == nx_poll(pmgr).Failed
    assert pmgr.failure_records[ROOM] == reason
    (status,) = pmgr._test.sent
    assert status["failure_reason"] == reason and status["targets"] == [("127.0.0.1", 17000)]
    assert pmgr.agent.transfers == [] and pmgr.agent.posted == 0


@pytest.mark.parametrize("p_model, d_model", [
    ("org/model", "org/model"),
    ("/weights/model", "/models/model/"),  # one model at each host's own path
])
def test_compatible_decode_is_registered_and_served_as_before(
        nx: Any, p_model: str, d_model: str) -> None:
    pmgr = manager(nx, "prefill", "PREFILL", server_args(model=p_model), 1 << 32)
    dmgr = manager(nx, "decode", "DECODE", server_args(model=d_model), 1 << 36)
    with records("kvplan.compat.sglang") as said:
        info = register(nx, pmgr, dmgr)
    assert sg_nixl.nixl_identity(pmgr).refused == {}
    assert pmgr.decode_kv_args_table["decode"] is info and pmgr._test.prepared == ["decode"]
    assert pmgr.agent.remote == [b"nixl-decode"]
    assert any("layout identities compatible" in r.getMessage() for r in said)
    queued = request(pmgr, dmgr)
    assert queued.qsize() == 1 and pmgr._test.sent == []


def test_decode_without_kvplan_is_accepted_said_once(nx: Any) -> None:
    pmgr = manager(nx, "prefill", "PREFILL", server_args(), 1 << 32)
    dmgr = manager(nx, "decode", "DECODE", server_args(revision="other"), 1 << 36)
    frames = dmgr.build_receiver_registration_message()
    with records("kvplan.compat.sglang") as said:
        for _ in range(2):  # SGLang's own message: its 24 frames after the guard
            info = nx.mod.KVArgsRegisterInfo.from_zmq(frames[1:sg_nixl.NIXL_REGISTRATION_FRAME
                                                            + 1])
            pmgr._add_remote_peer(info)
    lines = [r for r in said if "sent no layout identity" in r.getMessage()]
    assert len(lines) == 1 and "peer decode" in lines[0].getMessage()
    assert request(pmgr, dmgr).qsize() == 1


def test_prefill_without_kvplan_reads_the_registration_as_before(nx: Any) -> None:
    """SGLang's own parse of the message with kvplan's frame: every field as without it."""
    dmgr = manager(nx, "decode", "DECODE", server_args(), 1 << 36)
    frames = dmgr.build_receiver_registration_message()
    assert len(frames) == sg_nixl.NIXL_REGISTRATION_FRAME + 2
    assert frames[-1].startswith(rounds.REGISTRATION_TAG)
    parse = nx.mod.KVArgsRegisterInfo.from_zmq.__func__._kvplan_original.__func__
    plain = parse(nx.mod.KVArgsRegisterInfo, frames[1:-1])
    extended = parse(nx.mod.KVArgsRegisterInfo, frames[1:])
    assert plain == extended and not hasattr(plain, "kvplan_staging")


def test_layout_info_metric_is_set_once_the_identity_is_known(nx: Any) -> None:
    from kvplan.compat.sglang import metrics

    pmgr = manager(nx, "prefill-m", "PREFILL", server_args(revision="metric"), 1 << 40)
    mine = sg_nixl.nixl_identity(pmgr).identity.local
    assert {"class_id": mine.class_id, "layout_id": mine.layout_id, "role": "prefill",
            "engine": "sglang"} in [dict(labels) for labels in metrics.layout_info()]


def test_install_uninstall_restore_the_hooks(nx: Any) -> None:
    for name in sg_nixl.IDENTITY_HOOKS:
        assert getattr(nx.cls.__dict__[name], "_kvplan_identity", False), name
    compat.uninstall(nx.cls)
    try:
        for name in sg_nixl.IDENTITY_HOOKS:
            assert not getattr(getattr(nx.cls, name), "_kvplan_identity", False), name
        assert not hasattr(nx.mod.KVArgsRegisterInfo.from_zmq.__func__, "_kvplan_original")
    finally:
        compat.install(nx.cls)
