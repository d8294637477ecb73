"""A vLLM worker's layout identity, as both kvplan connectors compute it (docs/identity.md,
"At the handshake").

:func:`worker_semantics` reads the model semantics from a worker's ``vllm_config`` and
:func:`regions_layout` builds the layout of the KV regions a worker registered, with the heads
of its model where the regions hold whole heads. The Mooncake connector
(:mod:`kvplan.compat.vllm.staging`) and the NIXL connector (:mod:`kvplan.compat.vllm.nixl`)
read their regions from their own worker attributes and hand them here, so the two compute an
identity by the same rules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import kvplan
from kvplan.identity import ModelSemantics, declarable_rope, hf_rope, model_name_of

__all__ = ["MOONCAKE_TRANSFER", "NIXL_TRANSFER", "identity_source", "layout_order",
           "memory_order", "regions_layout", "worker_roles", "worker_semantics"]

#: vLLM's Mooncake connector: the prefill writes into the decode's KV cache.
MOONCAKE_TRANSFER = "push"
#: vLLM's NIXL connector (pull mode, ``NixlConnector``): the decode reads the prefill's blocks.
NIXL_TRANSFER = "pull"


def worker_semantics(vllm_config: Any, transfer: str = MOONCAKE_TRANSFER) -> ModelSemantics:
    """The model semantics vLLM's config says: the served model name (else
    ``model_config.model``) and ``.revision``, the RoPE configuration of
    ``model_config.hf_text_config`` (else ``hf_config``), the speculative config's draft
    ``model`` by its last path part, and ``kv_connector_extra_config``'s
    ``enable_cross_layers_blocks``. A field the config does not have is left undeclared.

    The name, not the path: the two peers of one deployment may keep the same weights at other
    local paths, and a PD router sends each request to both under the one served name."""
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config",
                                                                 None)
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "model", None) if spec is not None else None
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None),
                    "kv_connector_extra_config", None)
    cross = extra.get("enable_cross_layers_blocks", False) if isinstance(extra, dict) else False
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model = model_name_of(str(served or getattr(model_config, "model", "") or ""))
    return ModelSemantics(
        model=model, revision=str(getattr(model_config, "revision", "") or ""),
        rope=declarable_rope(hf_rope(hf) if hf is not None else None),
        drafts=(model_name_of(draft),) if isinstance(draft, str) and draft else (),
        transfer=transfer,  # type: ignore[arg-type]
        cross_layer=str(cross).lower() == "true")


def worker_roles(vllm_config: Any) -> tuple[str, ...]:
    """The roles of a worker of ``kv_transfer_config.kv_role``: ``kv_producer`` is a
    prefill, ``kv_consumer`` a decode, ``kv_both`` either."""
    role = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None)
    return {"kv_producer": ("prefill",), "kv_consumer": ("decode",)}.get(
        str(role), ("prefill", "decode"))


#: vLLM's KV cache layout names (its ``KVCacheLayout`` members, and the older ``NHD`` / ``HND``
#: it still takes for them) of per-layer regions, with the memory order of one block they mean:
#: heads outermost in the block (``LBHNC``) or tokens (``LBNHC``). The other layouts (several
#: layers in one block, a layer's heads outside its blocks) lay a block out in a way kvplan's
#: region layouts do not describe.
_LAYOUT_ORDERS = {"LBHNC": "HND", "HND": "HND", "LBNHC": "NHD", "NHD": "NHD"}
#: The environment variable vLLM reads for an explicit KV cache layout.
LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"


def layout_order(name: Any) -> str | None:
    """The memory order (``HND`` / ``NHD``) of vLLM's KV cache layout ``name`` (a
    ``KVCacheLayout`` member or its name, as a NIXL handshake names it); None for a layout
    kvplan's region layouts do not describe, or none named."""
    return _LAYOUT_ORDERS.get(str(getattr(name, "name", name) or "").upper())


def memory_order(vllm_config: Any = None, named: Any = None) -> str | None:
    """The memory order of the KV blocks vLLM lays out in this process, as vLLM itself decided
    it: the one derivation behind the layout identities, the manifest checks and the NIXL
    staging layouts of both kvplan connectors.

    ``named``: the layout name vLLM keeps for these blocks (a NIXL worker's
    ``kv_cache_layout``, or its host buffer's: what its handshake sends); its order, nothing
    else read. Else the layout vLLM resolved for the whole model, read as vLLM's workers read
    it (``vllm_config.cache_config.get_resolved_kv_cache_layout()``, vLLM 0.32 to 0.34): its
    engine core picks it once, and every worker adopts it before allocating its KV cache, from
    ``VLLM_KV_CACHE_LAYOUT`` where set, else the connector's required layout (``LBHNC`` for
    vLLM's NIXL and Mooncake connectors without MLA) where the attention backends take it,
    else the backends' first choice. So the environment variable alone does not say the
    order: a worker whose connector asks for ``LBHNC`` runs heads-outermost blocks with the
    variable unset. Only a config without resolved layouts falls back to the variable, then
    to ``NHD``.

    None where vLLM's layout is one kvplan's region layouts do not describe, and where vLLM
    has not resolved it yet (it decides later, from more than the variable): no order kvplan
    can vouch for."""
    if named is None:
        resolved = getattr(getattr(vllm_config, "cache_config", None),
                           "get_resolved_kv_cache_layout", None)
        if callable(resolved):
            try:
                named = resolved()
            except ValueError:  # vLLM's "not resolved yet"
                return None
        else:
            named = os.environ.get(LAYOUT_ENV) or "NHD"
    return layout_order(named)


def regions_layout(ptrs: Sequence[int], items: Sequence[int], ids: Sequence[int] | None, *,
                   blocks: int, context: dict[str, Any], use_mla: bool,
                   model_config: Any, order: str | None) -> kvplan.Layout | None:
    """The layout of a worker's registered KV regions (``ptrs``, each block's bytes
    ``items``, the regions' layer ids where known, ``blocks`` blocks per region) with the
    ``context`` (page size, TP and PP coordinates). For attention other than MLA, the heads of
    ``model_config.get_total_num_kv_heads()`` over the TP size, each head's bytes as one
    element, in the memory order ``order`` (``NHD`` / ``HND``: :func:`memory_order` of the
    worker, or :func:`layout_order` of what a peer's handshake names). None where the regions
    do not hold whole heads alike, or where ``order`` is None (vLLM lays the blocks out in an
    order kvplan does not describe, or has not decided it yet): a layout without the heads
    could refuse a TP pair vLLM plans, and one in a guessed order could accept a pair whose
    orders differ, so nothing is checked."""
    if not ptrs or len(items) != len(ptrs):
        return None
    args = (list(ptrs), [n * max(blocks, 1) for n in items], list(items),
            list(ids) if ids is not None and len(ids) == len(ptrs) else None)
    if use_mla:  # one latent per token, the same on every rank
        return kvplan.Layout(*args, **context)
    if order is None:
        return None  # an order kvplan cannot vouch for: no heads, so nothing is checked
    try:
        heads = int(model_config.get_total_num_kv_heads())
        per_rank = kvplan._core.heads_per_rank(heads, context["tp_size"])
        page = context["page_size"]
        # each head's bytes as one element: the regions say the bytes, not the dtype
        head_bytes = {n // (page * per_rank) for n in items if n % (page * per_rank) == 0}
        if len(head_bytes) != 1 or len(items) != sum(
                n == page * per_rank * next(iter(head_bytes)) for n in items):
            return None
        return kvplan.Layout(*args, kv_heads=heads, head_dim=next(iter(head_bytes)),
                             dtype_size=1, memory_order=order,
                             **context)
    except (AttributeError, TypeError, ValueError, kvplan.KvPlanError):
        # no heads: a layout without them could refuse a TP pair vLLM plans
        return None


def identity_source(worker: Any, compute: Callable[[Any], Any],
                    log: logging.Logger) -> Callable[[], Any]:
    """The worker's layout identity, ``compute(worker)``, once its KV cache is registered (None
    until then), its ``kvplan:layout_info`` recorded into its stats the first time (where the
    stats are kvplan's). A config kvplan cannot read gives no identity (said once on ``log``):
    the worker's peers then check nothing, as before."""
    from kvplan.compat.vllm import metrics

    failed: list[str] = []

    def source() -> Any:
        if failed:
            return None
        try:
            identity = compute(worker)
        except Exception as exc:  # defensive: an engine config of another shape
            failed.append(f"{type(exc).__name__}: {exc}")
            log.warning("kvplan: no layout identity for this worker (%s): its peers check no "
                        "compatibility", failed[0])
            return None
        if identity is not None:
            stats = getattr(worker, "xfer_stats", None)
            if isinstance(stats, metrics.LayoutStats):
                stats.record_layout(identity.class_id, identity.layout_id,
                                    worker_roles(worker.__dict__.get("vllm_config")))
        return identity

    return source
