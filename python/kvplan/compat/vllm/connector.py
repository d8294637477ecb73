"""``KvplanMooncakeConnector`` for vLLM's factory (built on first access: vLLM is imported
then) and :func:`register_plugin`, kvplan's ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvplan.identity import PeerCheck
from kvplan.compat.vllm import forms, manifest, metrics, nixl
from kvplan.compat.vllm import semantics
from kvplan.compat.vllm.cpu_host import _worker_device_on_cpu
from kvplan.compat.vllm.install import _CAP, install

#: The module vLLM loads kvplan's connector classes from by name (its ``__getattr__`` builds
#: them): ``kv_connector_module_path`` and the plugin's registrations name it.
_MODULE_PATH = "kvplan.compat.vllm"
_CONNECTOR: type | None = None
_VLLM_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _connector_class() -> type:
    global _CONNECTOR
    if _CONNECTOR is None:
        import importlib

        mc = importlib.import_module(_VLLM_MOONCAKE)

        base_worker = mc.MooncakeConnectorWorker
        stats_cls = metrics.stats_class(mc.MooncakeKVConnectorStats)
        prom_cls = metrics.prom_metrics_class(mc)

        class KvplanMooncakeConnectorWorker(base_worker):  # type: ignore[misc,valid-type]
            """vLLM's Mooncake worker planning its transfers with kvplan."""

            def register_kv_caches(self, *args: Any, **kwargs: Any) -> Any:
                out = super().register_kv_caches(*args, **kwargs)
                # kvplan_manifest: this worker's layout against the model's manifest, once
                # its regions are known (ManifestError: the worker does not start)
                from kvplan.compat.vllm.staging import manifest_layout

                manifest.check_worker_manifest(self, CONNECTOR_NAME, manifest_layout)
                return out

            def shutdown(self) -> Any:
                try:
                    return super().shutdown()
                finally:  # after vLLM's own, once: kvplan's channels, listener and arena
                    close_staging(self)

        install(KvplanMooncakeConnectorWorker)

        class KvplanMooncakeConnector(mc.MooncakeConnector):  # type: ignore[misc,name-defined]
            """vLLM's ``MooncakeConnector`` (``SupportsHMA``) whose worker plans with kvplan;
            it also starts on a host without an accelerator (vLLM's own worker does not)."""

            def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
                # kvplan's options first: an unknown one refuses before anything starts
                options = forms.kvplan_options(vllm_config, CONNECTOR_NAME)
                with _worker_device_on_cpu(mc):
                    super().__init__(vllm_config, role, kv_cache_config)
                if self.connector_worker is not None:
                    # vLLM's constructor names its worker class directly; the subclass adds
                    # no state, so the built worker takes the planning subclass as is.
                    self.connector_worker.__class__ = KvplanMooncakeConnectorWorker
                    if _CAP in options:
                        setattr(self.connector_worker, _CAP, options[_CAP])
                    if manifest.OPTION in options:
                        self.connector_worker.__dict__[manifest.MANIFEST_ATTR] = options[
                            manifest.OPTION]
                    # vLLM's series plus kvplan's per-request plan columns
                    self.connector_worker.xfer_stats = stats_cls()
                    _start_staging(self.connector_worker, options, mc)

            @classmethod
            def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
                return stats_cls(data=data or {})

            @classmethod
            def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                                   labelnames: list[str],
                                   per_engine_labelvalues: dict[int, list[object]]) -> Any:
                return prom_cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        KvplanMooncakeConnector.__module__ = _MODULE_PATH
        KvplanMooncakeConnectorWorker.__module__ = _MODULE_PATH
        KvplanMooncakeConnector.Worker = KvplanMooncakeConnectorWorker
        KvplanMooncakeConnector.Stats = stats_cls
        KvplanMooncakeConnector.PromMetrics = prom_cls
        _CONNECTOR = KvplanMooncakeConnector
    return _CONNECTOR


def _start_staging(worker: Any, options: dict[str, Any], module: Any) -> None:
    """Staging asked for by a ``kvplan_staging`` key other than ``off``
    (:func:`kvplan.compat.vllm.staging.start_staging`): the worker's arena registered with its Mooncake engine now
    (start-up); its channel listener; the handshake hooks (the decode's pull request carries
    its staging message, the prefill reads it); the engine's costs. Without the key, or with
    ``off``, nothing is allocated or replaced and the worker is vLLM's path."""
    def setup(state: Any) -> None:
        staging = staging_module()
        state.identity = PeerCheck(identity_source(worker), _staging_log)
        host = str(worker.__dict__.get("hostname") or "127.0.0.1")
        state.name = f"{host}:{worker.__dict__.get('rpc_port')}"
        staging.hook_handshake(worker, state, module)
        state.serve(worker, host)

    staging_module().start_staging(worker, options, engine=None, cost_engine="mooncake",
                                   setup=setup)


def close_staging(worker: Any) -> bool:
    """The worker's staging state closed (:meth:`kvplan.compat.vllm.staging.WorkerStaging.close`:
    its streams still receiving cancelled, its channels and listener closed and their threads
    waited for, its arena unregistered) and dropped from the worker, so a second call does
    nothing; whether there was one."""
    state = worker.__dict__.pop(staging_module().STAGING_ATTR, None)
    if state is None:
        return False
    state.close()
    return True


def identity_source(worker: Any) -> Callable[[], Any]:
    """The Mooncake worker's layout identity (``staging.worker_identity``) once its KV cache
    is registered (None until then), its ``kvplan:layout_info`` recorded into its stats the
    first time (:func:`kvplan.compat.vllm.semantics.identity_source`)."""
    return semantics.identity_source(
        worker, lambda w: staging_module().worker_identity(w), _staging_log)


def staging_module() -> Any:
    from kvplan.compat.vllm import staging

    return staging


_staging_log = logging.getLogger("vllm.kvplan.staging")

#: The name vLLM's ``--kv-transfer-config`` uses for kvplan's connector once the plugin ran.
CONNECTOR_NAME = "KvplanMooncakeConnector"
_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


def register_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (declared in kvplan's package metadata):
    registers ``KvplanMooncakeConnector`` and ``KvplanNixlConnector`` with vLLM's
    ``KVConnectorFactory``, so ``"kv_connector": "KvplanMooncakeConnector"`` (or the NIXL one)
    needs no ``kv_connector_module_path``.

    vLLM runs general plugins in every process it starts, possibly several times: a name that
    is already registered is left as it is. The factory imports the package and builds the
    class only when a connector of that name is created."""
    import importlib

    factory = importlib.import_module(_FACTORY).KVConnectorFactory
    for name in (CONNECTOR_NAME, nixl.CONNECTOR_NAME):
        if name not in factory._registry:
            factory.register_connector(name, _MODULE_PATH, name)

