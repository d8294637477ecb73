"""vLLM NIXL connector: kvplan's core computes the per-request NIXL descriptor ids.

``kvplan.compat.vllm.install(NixlConnectorWorker)`` (or any subclass of vLLM's
``NixlBaseConnectorWorker``: the pull and push workers) lands here. It replaces one method,
``_compute_desc_ids``, which vLLM calls twice per transfer (remote and local side) before
``make_prepped_xfer``, in one of the two forms kvplan knows (:data:`SUPPORTED_FORMS`):

* vLLM 0.32 / 0.33: ``(block_ids, dst_num_blocks, block_size_ratio,
  physical_blocks_per_logical, region_num_blocks=None, region_group_ids=None,
  uses_region_group_mapping=None)``;
* vLLM 0.34: ``(block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
  pairs, region_num_blocks=None, ssm_regions=None)``, ``pairs`` being the handshake's
  ``(regions, keys)``.

The replacement for the host's form hands vLLM's arguments and the worker attributes vLLM's
method reads to ``kvplan._core.nixl_desc_ids`` unchanged; the core resolves the defaults,
checks every block id against its region and returns the same int64 ids vLLM's method returns
(layer routing, flat, region-group-mapped and paired layouts, block-size ratios).
``uninstall`` restores exactly what was there. A host whose method has any other signature, or
no longer reads the worker attributes the replacement reads, is refused at install time with
:class:`kvplan.IncompatibleHostError` and nothing is replaced. docs/vllm.md has the account.

It declines, running vLLM's own method, when the model has Mamba state (another descriptor
layout, not in the core) or an argument is of a kind the core does not model (block ids that
are not ints, counts that are not Python ints). What it refuses that vLLM's method does not: a
block id outside its region (vLLM would return the id of another region's descriptor), a
negative one or one past int32 (:class:`kvplan.IndexBoundsError`, with the group, position, id
and region); counts and regions that do not fit together, where vLLM asserts
(:class:`kvplan.LayoutError`).

``connector_class()``'s worker also checks layout identities at vLLM's NIXL handshake
(docs/identity.md): in pull mode the decode asks the prefill's side channel for its agent
metadata before it reads anything, once per prefill engine, so that reply is where the prefill's
identity goes. The prefill's ``register_kv_caches`` (and 0.34's ``restore_kv_caches``, which
encodes the metadata again) adds it to the msgpack map of ``NixlAgentMetadata`` under
``kvplan_identity``; the decode runs vLLM's own ``_nixl_handshake`` with a ``NixlAgentMetadata``
that keeps that field, and its ``add_remote_agent`` refuses an incompatible prefill with
:class:`kvplan.IncompatiblePeerError` before the agent is added. vLLM then fails the handshake
and every request waiting on it goes to ``_failed_recv_reqs``. The request's
``kv_transfer_params`` were not used: they pass through whatever proxy routes the request
(which may drop keys it does not know), are sent once per request instead of once per peer,
and reach the worker only through the scheduler's fixed ``ReqMeta`` fields. A decode without
kvplan decodes the map with vLLM's ``NixlAgentMetadata``, which skips the unknown key, and
the compatibility hash covers the configuration, not these bytes.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from kvplan._core import nixl_desc_ids
from kvplan.compat.vllm import forms, manifest, nixl_layout
from kvplan.compat._methods import MethodPatches, require_method
from kvplan.compat.vllm.load_failures import kv_cache_group_count, report_load_failure
from kvplan.compat.vllm.nixl_layout import worker_layout
from kvplan.compat.vllm.nixl_metadata import add_to_agent_metadata

__all__ = ["install", "uninstall", "installed", "REPLACED_METHODS", "is_nixl_worker",
           "connector_class", "CONNECTOR_NAME", "SUPPORTED_FORMS", "host_form",
           "report_load_failure", "kv_cache_group_count",
           "add_to_agent_metadata", "advertise_identity", "check_remote_identity", "identity_handshake", "peer_check",
           "manifest_layout", "NO_STATE_LAYOUT", "worker_identity", "worker_layout",
           "check_region_layers", "check_pull_stage", "stage_check", "pp_rank"]

# A child of vLLM's "vllm" logger: inside a vLLM process its INFO lines go through vLLM's own
# handler, as the connector's do; elsewhere it is a plain logger.
logger = logging.getLogger("vllm.kvplan.nixl")

_BASE = "NixlBaseConnectorWorker"
_NAME = "_compute_desc_ids"


def is_nixl_worker(cls: type) -> bool:
    """Whether ``cls`` is vLLM's ``NixlBaseConnectorWorker`` or a subclass of it."""
    return any(k.__name__ == _BASE for k in cls.__mro__)


def _worker_ids(self: Any, block_ids: Any, read_worker: Any, **arguments: Any) -> Any:
    """The core's ids for an attention-only worker, or None when vLLM's own method must run.

    ``read_worker`` reads the worker attributes the host's form needs; a partly built worker
    (an attribute missing) declines, so vLLM's method fails (or not) its own way.
    """
    try:
        if self._has_mamba:
            return None
        worker = read_worker(self)
    except AttributeError:
        return None
    ids = nixl_desc_ids(block_ids, **worker, **arguments)
    if ids is not None and not _first_call_logged:
        _log_first_call(len(ids))
    return ids


def _region_group_worker(self: Any) -> dict[str, Any]:
    return {"layer_groups": self._transfer_layer_group_ids, "num_regions": self.num_regions,
            "num_layers": len(self.block_len_per_layer),
            "worker_region_groups": self.region_group_ids,
            "worker_grouped": self._uses_region_group_mapping}


def _paired_worker(self: Any) -> dict[str, Any]:
    return {"layer_groups": (), "num_regions": self.num_regions,
            "num_layers": len(self.block_len_per_layer), "worker_region_groups": (),
            "worker_grouped": False}


def _compute_desc_ids(self: Any, block_ids: Any, dst_num_blocks: int,
                      block_size_ratio: float | None, physical_blocks_per_logical: int,
                      region_num_blocks: list[int] | None = None,
                      region_group_ids: list[int] | None = None,
                      uses_region_group_mapping: bool | None = None) -> Any:
    """vLLM 0.32 / 0.33's form: layer routing, flat or region-group-mapped ids."""
    ids = _worker_ids(self, block_ids, _region_group_worker, num_blocks=dst_num_blocks,
                      block_size_ratio=block_size_ratio, region_num_blocks=region_num_blocks,
                      region_groups=region_group_ids, grouped=uses_region_group_mapping)
    if ids is not None:
        return ids
    return _vllm_method(self.__class__)(
        self, block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
        region_num_blocks, region_group_ids, uses_region_group_mapping)


def _compute_paired_desc_ids(self: Any, block_ids: Any, dst_num_blocks: int,
                             block_size_ratio: float | None, physical_blocks_per_logical: int,
                             pairs: Any, region_num_blocks: list[int] | None = None,
                             ssm_regions: Any = None) -> Any:
    """vLLM 0.34's form: the handshake's region pairs ``(regions, keys)`` name which region
    reads which block list."""
    ids = _worker_ids(self, block_ids, _paired_worker, num_blocks=dst_num_blocks,
                      block_size_ratio=block_size_ratio, region_num_blocks=region_num_blocks,
                      region_groups=None, grouped=None, pairs=pairs)
    if ids is not None:
        return ids
    return _vllm_method(self.__class__)(
        self, block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
        pairs, region_num_blocks, ssm_regions)


_first_call_logged = False


def _log_first_call(n_ids: int) -> None:
    """Once per process, so a server's log shows kvplan computing the ids (the e2e reads it)."""
    global _first_call_logged
    _first_call_logged = True
    logger.info("kvplan computes vLLM's NIXL descriptor ids (first request: %d ids)", n_ids)


#: vLLM's ``_compute_desc_ids`` signatures kvplan replaces, with the releases each was
#: checked against (byte for byte, tests/compat/test_vllm_nixl.py), and kvplan's replacement.
FORM_BY_REGION_GROUP = ("(self, block_ids, dst_num_blocks, block_size_ratio, "
                        "physical_blocks_per_logical, region_num_blocks=None, "
                        "region_group_ids=None, uses_region_group_mapping=None)")
FORM_BY_PAIRS = ("(self, block_ids, dst_num_blocks, block_size_ratio, "
                 "physical_blocks_per_logical, pairs, region_num_blocks=None, ssm_regions=None)")
SUPPORTED_FORMS = {FORM_BY_REGION_GROUP: "vLLM 0.32.0, 0.33.0", FORM_BY_PAIRS: "vLLM 0.34.0"}
# The worker attributes each replacement reads: vLLM's method of that form must read them too,
# or the release keeps the signature but not the attributes (and every call would decline).
_READS = {
    FORM_BY_REGION_GROUP: ("_has_mamba", "_transfer_layer_group_ids", "num_regions",
                           "block_len_per_layer", "region_group_ids",
                           "_uses_region_group_mapping"),
    FORM_BY_PAIRS: ("_has_mamba", "num_regions", "block_len_per_layer"),
}
_PATCHES_BY_FORM = {FORM_BY_REGION_GROUP: MethodPatches({_NAME: _compute_desc_ids}),
                    FORM_BY_PAIRS: MethodPatches({_NAME: _compute_paired_desc_ids})}
_REPLACEMENTS = {id(patches.replacements[_NAME]): patches
                 for patches in _PATCHES_BY_FORM.values()}
REPLACED_METHODS = (_NAME,)

_VLLM: dict[type, Any] = {}


def _host_method(cls: type) -> Any:
    """The ``_compute_desc_ids`` that ``cls`` resolves to without kvplan's: down its MRO, a
    class's own method, or, for a class kvplan patched, the one it held before (vLLM's, or a
    subclass's override); ``None`` when there is none."""
    for klass in cls.__mro__:
        candidate = klass.__dict__.get(_NAME)
        patches = _REPLACEMENTS.get(id(candidate))
        if patches is not None:
            candidate = patches.replaced(klass, _NAME)
        if candidate is not None:
            return candidate
    return None


def _vllm_method(cls: type) -> Any:
    method = _VLLM.get(cls)
    if method is None:
        method = _host_method(cls)
        if method is None:
            raise TypeError(f"{cls.__name__} has no {_NAME} of vLLM's")
        _VLLM[cls] = method
    return method


def host_form(worker_class: type) -> str:
    """The form of ``worker_class``'s ``_compute_desc_ids`` among :data:`SUPPORTED_FORMS`;
    :class:`kvplan.IncompatibleHostError` (naming the class, the method, the host's vLLM
    version, the signature seen and the supported ones) for any other."""
    if not is_nixl_worker(worker_class):
        raise TypeError(f"{worker_class.__name__} is not vLLM's {_BASE} (or a subclass)")
    return require_method(worker_class, _NAME, SUPPORTED_FORMS, "vLLM", reads=_READS,
                          resolved=_host_method(worker_class))


def install(worker_class: type) -> tuple[str, ...]:
    """Replace ``worker_class``'s ``_compute_desc_ids`` with kvplan's for the host's form;
    returns the names replaced (none when already installed). A host method of another form
    is refused (:func:`host_form`) and nothing is replaced."""
    form = host_form(worker_class)
    _VLLM.clear()  # every class resolves afresh after a change
    return _PATCHES_BY_FORM[form].install(worker_class)


def uninstall(worker_class: type) -> tuple[str, ...]:
    """Restore exactly what :func:`install` replaced on ``worker_class``."""
    _VLLM.clear()
    restored: tuple[str, ...] = ()
    for patches in _PATCHES_BY_FORM.values():
        restored += patches.uninstall(worker_class)
    return restored


def installed(worker_class: type) -> tuple[str, ...]:
    names: tuple[str, ...] = ()
    for patches in _PATCHES_BY_FORM.values():
        names += patches.installed(worker_class)
    return names


# ---------------------------------------------------------------------------------------------
# The connector class for vLLM's factory (built on first access: vLLM is imported then)
# ---------------------------------------------------------------------------------------------
#: The name vLLM's ``--kv-transfer-config`` uses for kvplan's NIXL connector.
CONNECTOR_NAME = "KvplanNixlConnector"
_VLLM_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_CONNECTOR: type | None = None


def connector_class() -> type:
    """``KvplanNixlConnector``: vLLM's pull-mode ``NixlConnector`` whose worker computes the
    descriptor ids with kvplan and checks the prefill's layout identity at the handshake
    (:func:`advertise_identity`, :func:`check_remote_identity`). Everything else (handshake,
    registration, reads, notifications, failure handling) is vLLM's."""
    global _CONNECTOR
    if _CONNECTOR is None:
        from kvplan.compat.vllm import metrics, nixl_staging

        nixl = importlib.import_module(_VLLM_NIXL)
        base = nixl.NixlPullConnectorWorker
        stats = importlib.import_module(_VLLM_NIXL + ".stats")
        stats_cls = metrics.nixl_stats_class(stats.NixlKVConnectorStats)
        prom_cls = metrics.nixl_prom_metrics_class(stats.NixlPromMetrics)
        handshake = identity_handshake(base)

        class KvplanNixlConnectorWorker(base):  # type: ignore[misc,valid-type]
            """vLLM's NIXL pull worker with kvplan's descriptor ids and layout identity."""

            _nixl_handshake = handshake

            def register_kv_caches(self, *args: Any, **kwargs: Any) -> Any:
                out = super().register_kv_caches(*args, **kwargs)
                # kvplan_manifest: this worker's regions against the model's manifest
                # (ManifestError: the worker does not start)
                manifest.check_worker_manifest(self, CONNECTOR_NAME, manifest_layout)
                advertise_identity(self)
                nixl_staging.advertise_staging(self)
                return out

            def add_remote_agent(self, nixl_agent_meta: Any, *args: Any, **kwargs: Any) -> Any:
                check_remote_identity(self, nixl_agent_meta)  # before any descriptor or read
                agent = super().add_remote_agent(nixl_agent_meta, *args, **kwargs)
                rank = args[0] if args else kwargs.get("remote_tp_rank", 0)
                size = args[1] if len(args) > 1 else kwargs.get("remote_tp_size", 1)
                nixl_staging.negotiate_peer(self, nixl_agent_meta, int(rank), agent, int(size))
                return agent

        read_blocks = _read_blocks_signature(base)
        if read_blocks is not None:  # staged reads (kvplan_staging): vLLM's read otherwise
            def _read_blocks(self: Any, *args: Any, **kwargs: Any) -> Any:
                if nixl_staging.worker_staging(self) is not None:
                    call = read_blocks.bind(self, *args, **kwargs).arguments
                    try:
                        if nixl_staging.staged_read(
                                self, call["read_spec"], call["dst_engine_id"],
                                call["request_id"], call["remote_request_id"],
                                call["expected_consumers"]):
                            return True
                    except Exception:  # nothing was read yet: vLLM's read takes it
                        nixl_staging._staging_log.exception(
                            "req %s: kvplan's staged read failed to start; direct path",
                            call["request_id"])
                    # a prefill that negotiated staging answers whether it still holds the
                    # request with those pages (pinned for the read); else the request fails.
                    # Not waited for here: vLLM's polling starts vLLM's read on the answer
                    held = nixl_staging.check_held(
                        self, call["read_spec"], call["dst_engine_id"], call["request_id"],
                        call["remote_request_id"],
                        lambda: super(KvplanNixlConnectorWorker, self)._read_blocks(
                            *args, **kwargs))
                    if held is not None:
                        # False: routed to vLLM's failure reporting (its refused handle says
                        # ERR): vLLM posts no sibling read and does not notify the prefill
                        return held
                return super(KvplanNixlConnectorWorker, self)._read_blocks(*args, **kwargs)

            KvplanNixlConnectorWorker._read_blocks = _read_blocks

        def start_load_kv(self: Any, metadata: Any) -> Any:
            out = super(KvplanNixlConnectorWorker, self).start_load_kv(metadata)
            # the block ids of the requests vLLM now keeps for decodes: a staged stream
            # reads only those of a request still held
            nixl_staging.record_sent_blocks(self, metadata)
            # the decode's requests vLLM finished during their receive: their staged reads
            # stop (those vLLM's start_load_kv just started too)
            nixl_staging.stop_aborted_reads(self, metadata)
            return out

        KvplanNixlConnectorWorker.start_load_kv = start_load_kv

        if hasattr(base, "_reap_expired_send_leases"):  # vLLM 0.32 to 0.34
            def _reap_expired_send_leases(self: Any, done_sending: set[str]) -> Any:
                # a request a staged stream gathers from is not freed by its lease's expiry
                # while the stream holds it
                leases = nixl_staging.send_leases(self)
                with leases.lock:
                    leases.extend_pinned(self)
                    return super(KvplanNixlConnectorWorker, self)._reap_expired_send_leases(
                        done_sending)

            KvplanNixlConnectorWorker._reap_expired_send_leases = _reap_expired_send_leases

        def shutdown(self: Any) -> Any:
            try:
                return super(KvplanNixlConnectorWorker, self).shutdown()
            finally:  # after vLLM's own, once: kvplan's streams, listener and arena
                nixl_staging.close_staging(self)

        KvplanNixlConnectorWorker.shutdown = shutdown

        if hasattr(base, "restore_kv_caches"):  # vLLM 0.34 re-encodes the metadata there
            def restore_kv_caches(self: Any) -> Any:
                out = super(KvplanNixlConnectorWorker, self).restore_kv_caches()
                advertise_identity(self)
                nixl_staging.advertise_staging(self)
                return out

            KvplanNixlConnectorWorker.restore_kv_caches = restore_kv_caches

        install(KvplanNixlConnectorWorker)

        class KvplanNixlConnector(nixl.NixlPullConnector):  # type: ignore[misc,name-defined]
            """vLLM's ``NixlConnector`` (pull mode) whose worker takes its descriptor ids from
            kvplan's core."""

            def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
                # kvplan's options first: an unknown one refuses before anything starts
                options = forms.kvplan_options(vllm_config, CONNECTOR_NAME)
                super().__init__(vllm_config, role, kv_cache_config)
                if self.connector_worker is not None:
                    # vLLM's constructor names its worker class; the subclass adds no state.
                    self.connector_worker.__class__ = KvplanNixlConnectorWorker
                    if manifest.OPTION in options:
                        self.connector_worker.__dict__[manifest.MANIFEST_ATTR] = options[
                            manifest.OPTION]
                    # vLLM's series plus kvplan:layout_info
                    self.connector_worker.xfer_stats = stats_cls()
                    # kvplan_staging: the arena registered with the worker's agent now,
                    # before register_kv_caches takes the agent's metadata
                    nixl_staging.start_staging(self.connector_worker, options,
                                               nixl_staging.vllm_lease_s(vllm_config))
                # the scheduler side sends the workers the block ids of the requests kept
                # for decodes, which a staged stream is checked against
                self._kvplan_sends_blocks = options.get("kvplan_staging", "off") != "off"

            def request_finished(self, request: Any, *args: Any, **kwargs: Any) -> Any:
                out = super().request_finished(request, *args, **kwargs)
                if self.__dict__.get("_kvplan_sends_blocks"):
                    nixl_staging.note_finished(self, request, out)
                return out

            def request_finished_all_groups(self, request: Any, *args: Any,
                                            **kwargs: Any) -> Any:
                out = super().request_finished_all_groups(request, *args, **kwargs)
                if self.__dict__.get("_kvplan_sends_blocks"):
                    nixl_staging.note_finished(self, request, out)
                return out

            def build_connector_meta(self, scheduler_output: Any) -> Any:
                meta = super().build_connector_meta(scheduler_output)
                if self.__dict__.get("_kvplan_sends_blocks"):
                    nixl_staging.attach_sent_blocks(self, meta)
                return meta

            @classmethod
            def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
                return stats_cls(data=data) if data is not None else stats_cls()

            @classmethod
            def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                                   labelnames: list[str],
                                   per_engine_labelvalues: dict[int, list[object]]) -> Any:
                return prom_cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        KvplanNixlConnector.__module__ = "kvplan.compat.vllm"
        KvplanNixlConnectorWorker.__module__ = "kvplan.compat.vllm"
        KvplanNixlConnector.Worker = KvplanNixlConnectorWorker
        KvplanNixlConnector.Stats = stats_cls
        KvplanNixlConnector.PromMetrics = prom_cls
        _CONNECTOR = KvplanNixlConnector
    return _CONNECTOR


#: What kvplan's staged read takes from vLLM's ``_read_blocks`` (vLLM 0.32 to 0.34).
_READ_BLOCKS_ARGS = ("read_spec", "dst_engine_id", "request_id", "remote_request_id",
                     "expected_consumers")


def _read_blocks_signature(worker_class: type) -> Any:
    """The signature of ``worker_class._read_blocks`` where it takes the arguments a staged
    read needs (None otherwise: the worker keeps vLLM's read for every request)."""
    import inspect

    method = getattr(worker_class, "_read_blocks", None)
    try:
        signature = inspect.signature(method) if method is not None else None
    except (TypeError, ValueError):
        return None
    if signature is None or any(a not in signature.parameters for a in _READ_BLOCKS_ARGS):
        return None
    return signature


# ---------------------------------------------------------------------------------------------
# The layout identity at vLLM's NIXL handshake (docs/vllm.md, "Layout identity with NIXL")
# ---------------------------------------------------------------------------------------------
#: The worker attribute holding its :class:`kvplan.identity.PeerCheck`.
IDENTITY_ATTR = "_kvplan_identity_check"
#: What the identity hook needs of vLLM's ``_nixl_handshake``: it decodes the prefill's agent
#: metadata with the module's ``NixlAgentMetadata`` and hands it to ``add_remote_agent``.
_HANDSHAKE_NAMES = ("NixlAgentMetadata", "add_remote_agent")
_HANDSHAKE_RELEASES = "vLLM 0.32.0, 0.33.0, 0.34.0"


def manifest_layout(worker: Any, engine: str) -> tuple[Any, frozenset[str]]:
    """The NIXL worker's layout for its ``kvplan_manifest`` check (``manifest.roles_layout``:
    each region's role and window from its layer's spec, and the packed roles it holds), its
    layer ids read from the layers' names by vLLM's ``extract_layer_index`` (vLLM's NIXL worker
    records no index): :func:`worker_layout` of its ``region_names`` (the layer each region was
    registered for), or for a model with Mamba state :func:`nixl_layout.state_layout`, one
    entry per layer behind each region (the regions are shared by a layer of every KV group).

    Raises:
        ManifestError: A layer name without a layer id, or what ``manifest.roles_layout``
            refuses (a worker kvplan builds no layout of: a PP, DCP or PCP size above 1, heads
            not whole, a KV cache layout kvplan does not describe, Mamba state whose regions'
            layers cannot be read, :data:`NO_STATE_LAYOUT`), naming why; logged at ERROR first.
    """
    d = worker.__dict__
    specs = d.get("_layer_specs") or {}
    why = ("kvplan builds no layout of this NIXL worker (a PP, DCP or PCP size above 1, "
           "regions that do not hold whole KV heads alike, or a KV cache layout vLLM resolved "
           "that kvplan does not describe)")
    if d.get("_has_mamba"):
        members = nixl_layout.region_layers(worker)
        if members is None:  # the regions' layers unread: refused, saying why
            names = [str(n) for n in d.get("region_names") or ()]
            return manifest.roles_layout(None, names, _layer_ids(names, engine), specs,
                                         engine, NO_STATE_LAYOUT)
        _layer_ids([n for layers in members for n in layers], engine)  # names each id
        layout, names, ids = nixl_layout.state_layout(worker, _extract_layer_index())
        return manifest.roles_layout(layout, names, ids, specs, engine, why)
    names = [str(n) for n in d.get("region_names") or ()]
    ids = _layer_ids(names, engine)
    layout = worker_layout(worker) if names else None
    return manifest.roles_layout(layout, names, ids, specs, engine, why)


def _layer_ids(names: list[str], engine: str) -> list[int]:
    from kvplan._core import ManifestError

    if not names:
        return []
    extract = _extract_layer_index()
    try:
        return [int(extract(n)) for n in names]
    except (AssertionError, ValueError, TypeError) as exc:
        err = ManifestError(
            f"kvplan: {engine}: cannot check the manifest at start-up: vLLM's "
            f"extract_layer_index reads no layer id from the region names {names!r:.300} "
            f"({exc}). Remove {manifest.OPTION} to start without the check")
        manifest.logger.error("%s", err)
        raise err from exc


#: Why a NIXL worker with Mamba state may have no layout: the layers behind its regions could
#: not be read.
NO_STATE_LAYOUT = (
    "kvplan builds no layout of this NIXL worker with Mamba state: vLLM's NIXL worker "
    "registers one region per distinct base address, shared by a layer of every KV group (an "
    "attention layer and Mamba layers), and kvplan reads the layers behind each region from "
    "vLLM's region_members or the caches it registered; here a layer lies in no region or "
    "several, or a region holds none")


def _extract_layer_index() -> Any:
    import importlib

    return importlib.import_module("vllm.model_executor.models.utils").extract_layer_index


def worker_identity(worker: Any, layer_ids: bool = False) -> Any:
    """The NIXL worker's :class:`kvplan.LayoutIdentity` (:func:`worker_layout` with the
    semantics of its ``vllm_config``, transfer ``pull``; for a model with Mamba state its
    :func:`nixl_layout.state_layout`, one entry per layer behind each region, described by the
    layers' specs as its manifest check describes them, ``manifest.region_roles``: an
    attention layer's ``kv`` page, a Mamba layer's ``state`` of its spec's state bytes); None
    while it has no layout. A PP stage's layout (PP size above 1) holds each region's global
    layer id and the stage's PP rank (:func:`pp_rank`); with ``layer_ids`` a worker at PP size
    1 gives its layer ids too (what a PP stage's identity is compared with)."""
    import kvplan
    from kvplan.compat.vllm.semantics import NIXL_TRANSFER, worker_semantics

    d = worker.__dict__
    if d.get("_has_mamba"):
        layout, names, ids = nixl_layout.state_layout(worker, _extract_layer_index())
        try:
            layout, _ = manifest.region_roles(layout, names, ids, d.get("_layer_specs") or {}, "")
        except ValueError:
            return None  # regions kvplan cannot describe: nothing checked, as before
    elif layer_ids or int(d.get("pp_size", 1) or 1) != 1:
        layout = worker_layout(worker, _extract_layer_index(), pp_rank(worker))
    else:
        layout = worker_layout(worker)
    if layout is None:
        return None
    return kvplan.layout_identity(layout, worker_semantics(d.get("vllm_config"), NIXL_TRANSFER))


def pp_rank(worker: Any) -> int | None:
    """The worker's rank in its PP group (vLLM's ``get_pp_group().rank_in_group``; 0 at PP
    size 1; None where vLLM's group is not set up)."""
    if int(worker.__dict__.get("pp_size", 1) or 1) == 1:
        return 0
    try:
        state = importlib.import_module("vllm.distributed.parallel_state")
        return int(state.get_pp_group().rank_in_group)
    except Exception:  # defensive: no PP group in this process
        return None


def peer_check(worker: Any) -> Any:
    """The worker's :class:`kvplan.identity.PeerCheck` (made once), its identity from
    :func:`worker_identity` once the KV cache is registered, logged through vLLM's logger."""
    check = worker.__dict__.get(IDENTITY_ATTR)
    if check is None:
        from kvplan.compat.vllm.semantics import identity_source
        from kvplan.identity import PeerCheck

        check = PeerCheck(identity_source(worker, worker_identity, logger), logger)
        worker.__dict__[IDENTITY_ATTR] = check
    return check


def advertise_identity(worker: Any) -> bool:
    """Add the worker's identity message to the agent metadata its handshake serves, under
    :data:`kvplan.identity.IDENTITY_KEY` (:func:`add_to_agent_metadata`); whether it did (not
    before the KV cache is registered, nor without an identity)."""
    from kvplan.identity import IDENTITY_KEY

    if worker.__dict__.get("xfer_handshake_metadata") is None:
        return False
    message = peer_check(worker).message()
    if message is None:
        return False
    return add_to_agent_metadata(worker, IDENTITY_KEY, message)


def check_remote_identity(worker: Any, metadata: Any) -> Any:
    """The decode's verdict on the prefill whose agent metadata is ``metadata``, before
    ``add_remote_agent`` registers it: :class:`kvplan.IncompatiblePeerError` (logged once
    at ERROR) when refused, which fails vLLM's handshake, so every request waiting on it
    takes vLLM's failed-receive path and no block is read; None for a prefill that sent no
    identity (said once) or while this worker has none. A plannable verdict on two layouts of
    Mamba state is also refused where vLLM pairs the two sides' regions by index (0.32,
    0.33: no ``_pair_regions``) and a region holds other layers on the two sides
    (:func:`check_region_layers`). A prefill's PP stage (its identity's PP size above 1) is
    compared by global layer id with this worker's layout with its layer ids (a stage holding
    layers this decode lacks is refused by the core, naming the layer), and a plannable one
    is then refused as vLLM's pull read cannot take it (:func:`check_pull_stage`). A decode
    that is itself a PP stage (a ``kv_both`` worker; vLLM refuses a ``kv_consumer`` at PP size
    above 1) checks nothing, as before: vLLM reads its layers' slice of the prefill's regions,
    which the core's pairing of whole layouts does not describe (said once per peer)."""
    from kvplan.identity import IDENTITY_KEY

    peer = f"engine {getattr(metadata, 'engine_id', '?')}"
    sent = getattr(metadata, IDENTITY_KEY, None)
    if int(worker.__dict__.get("pp_size", 1) or 1) != 1:
        said = worker.__dict__.setdefault("_kvplan_stage_refusals", set())
        if ("decode-stage", peer) not in said:
            said.add(("decode-stage", peer))
            logger.info("kvplan: this decode is a PP stage: vLLM reads its layers' slice of "
                        "%s's regions, a pairing the layout identities do not describe: no "
                        "compatibility check, transfers as before", peer)
        return None
    stage = _sent_pp_size(sent) > 1
    check = stage_check(worker) if stage else peer_check(worker)
    verdict = check.check(peer, sent, local_role="decode")
    if verdict and stage:
        check_pull_stage(worker, check.local, sent, peer)
    if verdict and not hasattr(type(worker), "_pair_regions"):
        check_region_layers(worker, check.local, sent, peer)
    return verdict


def _sent_pp_size(sent: Any) -> int:
    layout = sent.get("layout") if isinstance(sent, dict) else None
    try:
        return int(layout.get("pp_size", 1) or 1) if isinstance(layout, dict) else 1
    except (TypeError, ValueError):
        return 1


#: The worker attribute holding the :class:`kvplan.identity.PeerCheck` of its identity with
#: layer ids, which a prefill's PP stage is checked against.
STAGE_CHECK_ATTR = "_kvplan_stage_identity_check"


def stage_check(worker: Any) -> Any:
    """The worker's :class:`kvplan.identity.PeerCheck` for a prefill's PP stage (made once):
    its identity with each region's global layer id (``worker_identity(worker,
    layer_ids=True)``), so the core pairs the stage's regions with this worker's by layer id.
    The identity this worker sends stays :func:`peer_check`'s."""
    check = worker.__dict__.get(STAGE_CHECK_ATTR)
    if check is None:
        from kvplan.identity import PeerCheck

        failed: list[str] = []

        def source() -> Any:  # not identity_source: this identity is no kvplan:layout_info
            if failed:
                return None
            try:
                return worker_identity(worker, True)
            except Exception as exc:  # defensive: an engine config of another shape
                failed.append(f"{type(exc).__name__}: {exc}")
                logger.warning("kvplan: no layout identity with layer ids for this worker "
                               "(%s): a prefill's PP stages are not checked", failed[0])
                return None

        check = PeerCheck(source, logger)
        worker.__dict__[STAGE_CHECK_ATTR] = check
    return check


def check_pull_stage(worker: Any, local: Any, sent: Any, peer: str) -> None:
    """Refuse (:class:`kvplan.IncompatiblePeerError`, ``refused_by == "pipeline"``, logged
    once per peer at ERROR) a prefill's PP stage whose layers the core pairs with this
    decode's: kvplan's NIXL connector is vLLM's pull mode, whose read does not take a prefill
    at PP size above 1. vLLM 0.32 / 0.33 register one set of the prefill's regions per TP rank
    and read its region ``i`` into the decode's region ``i``, so the decode's first layers would
    take the stage's; vLLM 0.34 pairs regions by layer name and refuses a prefill that does not
    hold every layer of the decode. The error names the stage's PP rank and size and both
    sides' layer ids."""
    if local is None:
        return
    theirs = sent["layout"]
    stage_layers = sorted(set(int(n) for n in theirs.get("layer_ids") or ()))
    my_layers = sorted(set(int(n) for n in local.layout.to_dict().get("layer_ids") or ()))
    how = ("pairs regions by layer name and requires the prefill to hold every layer of the "
           "decode" if hasattr(type(worker), "_pair_regions") else
           "reads the prefill's KV region i into the decode's region i, from one set of "
           "regions per prefill TP rank, so the decode's layers "
           f"{my_layers[:len(stage_layers)]} would take the stage's {stage_layers}")
    reason = (f"the prefill is PP stage {theirs.get('pp_rank')} of {theirs.get('pp_size')} "
              f"holding layers {stage_layers}, the decode holds layers {my_layers}: vLLM's "
              f"NIXL pull read does not take a prefill at PP size above 1 (it {how}); serve "
              f"the prefill at PP size 1")
    raise _refusal(worker, local, sent, peer, "pipeline", reason)


def check_region_layers(worker: Any, local: Any, sent: Any, peer: str) -> None:
    """Refuse (:class:`kvplan.IncompatiblePeerError`, ``refused_by == "region_layers"``,
    logged once per peer at ERROR) a prefill whose identity layout of Mamba state holds other
    layers (or roles) behind a region than this decode's: vLLM 0.32 / 0.33 read the prefill's
    region ``i`` into the decode's region ``i``, whatever layers share them, so a layer's
    state would land in another layer's. The error names the first such region and both
    sides' ``(layer, role)`` lists."""
    if local is None or not isinstance(sent, dict) or not isinstance(sent.get("layout"), dict):
        return
    mine = local.layout.to_dict()
    theirs = sent["layout"]
    if manifest.STATE_ROLE not in (mine.get("roles") or ()) or \
            manifest.STATE_ROLE not in (theirs.get("roles") or ()):
        return
    ours, peers = nixl_layout.region_groups(mine), nixl_layout.region_groups(theirs)
    if ours == peers:
        return
    where = next((i for i, (a, b) in enumerate(zip(peers, ours)) if a != b),
                 min(len(ours), len(peers)))
    reason = (f"vLLM reads the prefill's KV region {where} into the decode's region {where}, "
              f"and the prefill's holds (layer, role) "
              f"{list(peers[where]) if where < len(peers) else 'nothing'} where the decode's "
              f"holds {list(ours[where]) if where < len(ours) else 'nothing'} "
              f"({len(peers)} regions against {len(ours)}): a layer's state would land in "
              f"another's")
    raise _refusal(worker, local, sent, peer, "region_layers", reason)


def _refusal(worker: Any, local: Any, sent: dict[str, Any], peer: str, refused_by: str,
             reason: str) -> Exception:
    """The decode's refusal of prefill ``peer`` for ``reason`` (an
    :class:`kvplan.IncompatiblePeerError` naming both classes), logged at ERROR once per
    peer and ``refused_by``."""
    from kvplan._errors import IncompatiblePeerError

    err = IncompatiblePeerError(
        f"kvplan refuses transfers with peer {peer}: prefill {sent.get('class_id', '?')} "
        f"({peer}) -> decode {local.class_id} (here): {reason}")
    err.peer, err.local_class_id = peer, local.class_id
    err.peer_class_id, err.local_role = str(sent.get("class_id", "")), "decode"
    err.refused_by, err.reason = refused_by, reason
    said = worker.__dict__.setdefault("_kvplan_refusals_said", set())
    if (peer, refused_by) not in said:
        said.add((peer, refused_by))
        logger.error("%s", err)
    return err


def identity_handshake(worker_class: type) -> Any:
    """vLLM's own ``_nixl_handshake`` of ``worker_class``, run over its module's globals in
    which ``NixlAgentMetadata`` names a subclass with two more optional fields, the prefill's
    identity and its staging message (None from a prefill without kvplan, or with staging
    off), so ``add_remote_agent`` receives them.
    Nothing else of vLLM's method or module changes. :class:`kvplan.IncompatibleHostError`
    when the method does not decode the metadata and register it by those names."""
    import dataclasses
    import types

    from kvplan._errors import IncompatibleHostError
    from kvplan.identity import IDENTITY_KEY
    from kvplan.staging.negotiation import HANDSHAKE_KEY as META_KEY

    method = getattr(worker_class, "_nixl_handshake", None)
    code = getattr(method, "__code__", None)
    if code is None or code.co_freevars or any(n not in code.co_names
                                               for n in _HANDSHAKE_NAMES):
        raise IncompatibleHostError(
            f"{worker_class.__name__}._nixl_handshake does not decode the prefill's agent "
            f"metadata as NixlAgentMetadata and register it with add_remote_agent, as "
            f"{_HANDSHAKE_RELEASES} do: kvplan cannot check the prefill's layout identity")
    assert method is not None
    module_globals = method.__globals__
    metadata_cls = module_globals["NixlAgentMetadata"]
    extended = dataclasses.make_dataclass(
        "KvplanNixlAgentMetadata",
        [(IDENTITY_KEY, dict[str, Any] | None, dataclasses.field(default=None)),
         (META_KEY, dict[str, Any] | None, dataclasses.field(default=None))],
        bases=(metadata_cls,))
    extended.__module__ = __name__
    names = dict(module_globals)
    names["NixlAgentMetadata"] = extended
    hooked = types.FunctionType(code, names, method.__name__, method.__defaults__)
    hooked.__kwdefaults__ = method.__kwdefaults__
    hooked.__qualname__, hooked.__doc__ = method.__qualname__, method.__doc__
    hooked.__wrapped__ = method  # type: ignore[attr-defined]
    return hooked
