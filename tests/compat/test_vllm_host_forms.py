"""kvplan's vLLM drop-ins install only into methods of a form kvplan was built for.

Every real release the loader runs (vLLM 0.33.0 here, 0.34.0 and 0.32.0's CPU build in child
processes) installs: ``install`` on the Mooncake and NIXL workers, ``KvplanMooncakeConnector``
and the name the plugin registers, resolved through vLLM's own factory. A worker class whose
method has another signature, a helper kvplan's replacement calls that changed, or a caller
that no longer calls the replaced method is refused with :class:`kvplan.IncompatibleHostError`
naming the class, the method, the host's vLLM version and what differs, and nothing is
replaced.
"""

from __future__ import annotations

import os
import types

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import (  # noqa: E402
    OTHER_RELEASES, VLLM_VERSION, load_vllm, load_vllm_nixl, ALL_TESTS)

import kvplan  # noqa: E402
from kvplan.compat import vllm as compat  # noqa: E402
from kvplan.compat.vllm import connector as vllm_connector  # noqa: E402
from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402


@pytest.fixture(scope="module")
def v():
    return load_vllm()


@pytest.fixture(scope="module")
def nixl():
    return load_vllm_nixl()


def test_error_is_exported_and_typed():
    assert kvplan.IncompatibleHostError.__mro__[1] is kvplan.KvPlanError
    assert "IncompatibleHostError" in kvplan.__all__
    assert kvplan.IncompatibleHostError("x").kind == "incompatible_host"


@pytest.mark.parametrize("name", ["mooncake", "nixl", "nixl_pull", "nixl_push"])
def test_real_release_installs(v, nixl, name):
    W = {"mooncake": v.MooncakeConnectorWorker, "nixl": nixl.NixlConnectorWorker,
         "nixl_pull": nixl.NixlPullConnectorWorker,
         "nixl_push": nixl.NixlPushConnectorWorker}[name]
    before = dict(W.__dict__)
    assert compat.install(W)
    assert compat.uninstall(W)
    assert dict(W.__dict__) == before


def test_connector_and_plugin_build_on_a_real_release(v, monkeypatch):
    """The plugin's registered name resolved through vLLM's factory builds kvplan's class."""
    monkeypatch.setattr(vllm_connector, "_CONNECTOR", None)
    factory = v.KVConnectorFactory
    monkeypatch.setattr(factory, "_registry", dict(factory._registry))
    compat.register_plugin()
    cls = factory._registry[compat.CONNECTOR_NAME]()
    assert cls.__name__ == "KvplanMooncakeConnector"
    assert cls.__module__ == cls.Worker.__module__ == "kvplan.compat.vllm"
    assert compat.installed(cls.Worker) == compat.REPLACED_METHODS


def refusal(fn, *args):
    with pytest.raises(kvplan.IncompatibleHostError) as err:
        fn(*args)
    return err.value


def test_mooncake_worker_with_another_signature_is_refused(v):
    class ChangedWorker(v.MooncakeConnectorWorker):
        async def _build_transfer_params(self, ready_reqs, agent_meta, local_regions,
                                         remote_regions, leases=None):
            return [], [], [], [], None

    err = refusal(compat.install, ChangedWorker)
    assert (err.cls, err.method, err.host_version) == (
        "ChangedWorker", "_build_transfer_params", VLLM_VERSION)
    assert err.seen == ("async (self, ready_reqs, agent_meta, local_regions, remote_regions, "
                        "leases=None)")
    assert err.supported == (
        "async (self, ready_reqs, agent_meta, local_regions, remote_regions)",)
    assert str(err).startswith(f"vLLM {VLLM_VERSION}: ChangedWorker._build_transfer_params "
                               "is async (self, ready_reqs, agent_meta, local_regions, "
                               "remote_regions, leases=None), not a form kvplan was built for")
    assert "Nothing was replaced" in str(err)
    assert compat.installed(ChangedWorker) == ()
    assert "_send_blocks" not in ChangedWorker.__dict__


def test_mooncake_sync_planner_is_refused(v):
    """The same parameters but not a coroutine function: vLLM's caller awaits it."""
    class SyncWorker(v.MooncakeConnectorWorker):
        def _build_transfer_params(self, ready_reqs, agent_meta, local_regions,
                                   remote_regions):
            return [], [], [], [], None

    err = refusal(compat.install, SyncWorker)
    assert err.seen == "(self, ready_reqs, agent_meta, local_regions, remote_regions)"


def test_mooncake_changed_helper_is_refused(v):
    class HelperChanged(v.MooncakeConnectorWorker):
        def _get_sender_transfer_plan(self, local_kv_block_len, remote_kv_block_len,
                                      remote_tp_rank, remote_tp_size, remote_pp_rank):
            raise AssertionError("never called")

    err = refusal(compat.install, HelperChanged)
    assert err.method == "_get_sender_transfer_plan"
    assert err.seen.endswith("remote_tp_size, remote_pp_rank)")


def test_mooncake_caller_that_no_longer_calls_the_planner_is_refused(v):
    class NewCaller(v.MooncakeConnectorWorker):
        async def send_kv_to_decode(self, identity, sock, meta):
            return await self._plan_and_send(meta)

    err = refusal(compat.install, NewCaller)
    assert err.method == "send_kv_to_decode"
    assert "it no longer calls _build_transfer_params, _send_blocks" in str(err)


def test_mooncake_module_helper_changed_is_refused(v, monkeypatch):
    monkeypatch.setattr(v.mc, "_block_ids_for_region",
                        lambda block_ids_by_group, group_index: block_ids_by_group)
    err = refusal(compat.install, v.MooncakeConnectorWorker)
    assert err.method == "_block_ids_for_region"
    assert err.seen == "(block_ids_by_group, group_index)"
    assert compat.installed(v.MooncakeConnectorWorker) == ()


def test_connector_and_plugin_refuse_a_changed_host(v, monkeypatch):
    """KvplanMooncakeConnector (and so the plugin's name, resolved by vLLM's factory) is
    built through install: a changed host method refuses it."""
    async def changed(self, ready_reqs, agent_meta, local_regions, remote_regions, extra):
        return [], [], [], [], None

    monkeypatch.setattr(v.MooncakeConnectorWorker, "_build_transfer_params", changed)
    monkeypatch.setattr(vllm_connector, "_CONNECTOR", None)
    err = refusal(getattr, compat, "KvplanMooncakeConnector")
    assert err.method == "_build_transfer_params"
    factory = v.KVConnectorFactory
    monkeypatch.setattr(factory, "_registry", dict(factory._registry))
    compat.register_plugin()
    err = refusal(factory._registry[compat.CONNECTOR_NAME])
    assert err.cls == "KvplanMooncakeConnectorWorker"
    assert vllm_connector._CONNECTOR is None


def test_nixl_worker_with_another_signature_is_refused(nixl):
    class ChangedNixl(nixl.NixlConnectorWorker):
        def _compute_desc_ids(self, block_ids, dst_num_blocks, block_size_ratio,
                              physical_blocks_per_logical, pairs, region_num_blocks=None,
                              ssm_regions=None, ple_region=None):
            raise AssertionError("never called")

    err = refusal(compat.install, ChangedNixl)
    assert (err.cls, err.method, err.host_version) == (
        "ChangedNixl", "_compute_desc_ids", VLLM_VERSION)
    assert err.seen.endswith("ssm_regions=None, ple_region=None)")
    assert err.supported == tuple(vllm_nixl.SUPPORTED_FORMS)
    assert "(vLLM 0.34.0)" in str(err) and "(vLLM 0.32.0, 0.33.0)" in str(err)
    assert compat.installed(ChangedNixl) == ()


def test_nixl_known_signature_without_the_attributes_is_refused(nixl):
    """A release that keeps a known signature but no longer reads the worker attributes the
    replacement reads (every call would fall back, or read stale state)."""
    form = vllm_nixl.host_form(nixl.NixlBaseConnectorWorker)
    params = form[1:-1]
    namespace: dict = {}
    exec(f"def _compute_desc_ids({params}):\n    return self._other_state\n",  # noqa: S102
         namespace)
    Stale = types.new_class("StaleNixl", (nixl.NixlConnectorWorker,))
    Stale._compute_desc_ids = namespace["_compute_desc_ids"]
    err = refusal(compat.install, Stale)
    assert "it no longer reads _has_mamba" in str(err)


def test_nixl_worker_without_the_method_is_refused(nixl, monkeypatch):
    base = nixl.NixlBaseConnectorWorker
    monkeypatch.delattr(base, "_compute_desc_ids")
    err = refusal(compat.install, nixl.NixlConnectorWorker)
    assert err.seen == "missing"


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = dict.fromkeys(OTHER_RELEASES, ALL_TESTS)


# --------------------------------------------------------------------------------------------
# kvplan's options in kv_connector_extra_config
# --------------------------------------------------------------------------------------------
def mooncake_connector(v, extra):
    from support.vllm_cases import vllm_config, worker_dependencies
    from test_vllm_upstream import test_kv_cache_config

    config = vllm_config("kv_producer")
    config.kv_transfer_config.kv_connector_extra_config.update(extra)
    with worker_dependencies(v):
        return compat.KvplanMooncakeConnector(config, v.KVConnectorRole.WORKER,
                                              test_kv_cache_config(v))


@pytest.mark.parametrize("extra, option", [
    ({"kvplan_max_blocks": 64}, "kvplan_max_blocks"),
    ({"kvplan_max_blocks_per_batch": 0}, "kvplan_max_blocks_per_batch"),
    ({"kvplan_max_blocks_per_batch": "64"}, "kvplan_max_blocks_per_batch"),
    ({"kvplan_max_blocks_per_batch": True}, "kvplan_max_blocks_per_batch"),
])
def test_unknown_or_bad_kvplan_option_is_refused(v, extra, option):
    with pytest.raises(kvplan.ConfigError) as err:
        mooncake_connector(v, extra)
    assert err.value.option == option
    assert err.value.value == extra[option]
    assert err.value.kind == "config"
    assert isinstance(err.value, kvplan.KvPlanError)
    if option == "kvplan_max_blocks":
        assert str(err.value) == (
            "kv_connector_extra_config: 'kvplan_max_blocks' is not an option of "
            "KvplanMooncakeConnector (its kvplan options: kvplan_manifest, "
            "kvplan_max_blocks_per_batch, kvplan_staging, kvplan_staging_arena_mib, kvplan_staging_buffers, "
            "kvplan_staging_costs, kvplan_staging_timeout_s); keys beginning with 'kvplan' "
            "are kvplan's, and an unknown one is refused rather than ignored")
        assert err.value.known == ("kvplan_manifest", "kvplan_max_blocks_per_batch",
                                   "kvplan_staging",
                                   "kvplan_staging_arena_mib", "kvplan_staging_buffers",
                                   "kvplan_staging_costs", "kvplan_staging_timeout_s")


def test_known_kvplan_option_is_applied_and_vllm_keys_pass(v):
    connector = mooncake_connector(v, {"kvplan_max_blocks_per_batch": 64,
                                       "enforce_handshake_compat": False})
    worker = connector.connector_worker
    assert worker.kvplan_max_blocks_per_batch == 64
    assert type(worker).kvplan_max_blocks_per_batch == compat.DEFAULT_MAX_BLOCKS_PER_BATCH
    worker.shutdown()


def test_nixl_connector_takes_the_manifest_and_staging_options():
    from kvplan.compat.vllm import forms as vllm_forms

    config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
        kv_connector_extra_config={"kvplan_max_blocks_per_batch": 64}))
    with pytest.raises(kvplan.ConfigError, match="not an option of KvplanNixlConnector "
                       r"\(its kvplan options: kvplan_manifest, kvplan_staging, "
                       r"kvplan_staging_arena_mib, kvplan_staging_buffers, "
                       r"kvplan_staging_costs, kvplan_staging_timeout_s\)"):
        vllm_forms.kvplan_options(config, vllm_nixl.CONNECTOR_NAME)
    config.kv_transfer_config.kv_connector_extra_config = {"kvplan_staging": "auto",
                                                           "kvplan_staging_buffers": 3}
    assert vllm_forms.kvplan_options(config, vllm_nixl.CONNECTOR_NAME) == {
        "kvplan_staging": "auto", "kvplan_staging_buffers": 3}
    config.kv_transfer_config.kv_connector_extra_config = {"transfer_mode": "pull"}
    assert vllm_forms.kvplan_options(config, vllm_nixl.CONNECTOR_NAME) == {}
