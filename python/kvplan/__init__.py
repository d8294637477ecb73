"""kvplan: KV-cache transfer planning for prefill/decode disaggregated LLM serving.

Pair prefill and decode transfer entries by global layer id, group page indices into runs that
are contiguous on both sides, and emit ``(src_addr, dst_addr, length)`` blocks, in Rust. Engine
adapters live in :mod:`kvplan.engines` and are imported only on demand.
"""

from __future__ import annotations

from kvplan._core import (
    DTYPES,
    SCALE_FORMATS,
    Advice,
    ConversionPlan,
    ConversionTemplate,
    IndexBoundsError,
    KvPlanError,
    LayerGroups,
    LayerSlices,
    Layout,
    LayoutEntry,
    LayoutError,
    Pairing,
    PairingError,
    Blocks,
    BatchPlan,
    PlanBatch,
    PlanSlices,
    RowGather,
    SizeMismatchError,
    StagedPlan,
    Template,
    TpPeers,
    TransferCost,
    TransferPlan,
    WorkManifest,
    __version__,
    advise,
    copy_local,
    group_contiguous,
    legacy_pp_pairs,
    pair_entries,
    tp_peers,
)
from kvplan._errors import ConfigError, IncompatibleHostError, TransferError
from kvplan.integrity import IntegrityError
from kvplan.leases import Lease, LeaseError, LeaseTable, StaleLeaseError, UnknownLeaseError
from kvplan.policy import PairingChoice, select_pairing
from kvplan.report import CompatReport, EntryCheck, compare

__all__ = [
    "Advice",
    "CompatReport",
    "ConfigError",
    "EntryCheck",
    "IncompatibleHostError",
    "IndexBoundsError",
    "IntegrityError",
    "KvPlanError",
    "LayerGroups",
    "LayerSlices",
    "Layout",
    "LayoutEntry",
    "LayoutError",
    "Lease",
    "LeaseError",
    "LeaseTable",
    "Pairing",
    "PairingChoice",
    "PairingError",
    "Blocks",
    "BatchPlan",
    "PlanBatch",
    "PlanSlices",
    "RowGather",
    "SizeMismatchError",
    "StagedPlan",
    "StaleLeaseError",
    "UnknownLeaseError",
    "Template",
    "ConversionPlan",
    "DTYPES",
    "SCALE_FORMATS",
    "ConversionTemplate",
    "TpPeers",
    "TransferCost",
    "TransferError",
    "TransferPlan",
    "WorkManifest",
    "__version__",
    "advise",
    "compare",
    "copy_local",
    "group_contiguous",
    "legacy_pp_pairs",
    "pair_entries",
    "select_pairing",
    "tp_peers",
]
