# Signatures of the native module (rust/kvplan-py). Users import these through `kvplan`.
import builtins
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import ClassVar, Literal, Protocol, final, overload

from typing_extensions import Buffer, disjoint_base

import numpy as np
import numpy.typing as npt

__all__ = [
    "Advice",
    "IndexBoundsError",
    "KvPlanError",
    "LayerGroups",
    "LayerSlices",
    "Layout",
    "LayoutEntry",
    "LayoutError",
    "LayoutIdentity",
    "ManifestError",
    "UnsupportedError",
    "MHA_ROLES",
    "DTYPES",
    "SCALE_FORMATS",
    "ConversionPlan",
    "ConversionTemplate",
    "MooncakeBatch",
    "MooncakeNative",
    "Pairing",
    "PairingError",
    "Blocks",
    "BatchPlan",
    "BatchSlices",
    "BlockSlice",
    "PlanBatch",
    "PlanBuffer",
    "PlanSlices",
    "Request",
    "RowGather",
    "SizeMismatchError",
    "RoundManifest",
    "StagedPlan",
    "StagedRound",
    "StagedRounds",
    "Template",
    "TpPeers",
    "TransferCost",
    "TransferPlan",
    "Verdict",
    "WorkManifest",
    "__version__",
    "advise",
    "check_pairs",
    "combine_pair_digests",
    "check_manifest",
    "compatibility",
    "copy_local",
    "feature_descriptions",
    "failed_batch_pages",
    "failed_pages",
    "group_contiguous",
    "heads_per_rank",
    "index_array",
    "index_digest",
    "layout_identity",
    "leased_plan_digest",
    "legacy_pp_pairs",
    "needs_tokens",
    "nixl_desc_ids",
    "pack_manifest",
    "pair_entries",
    "planner_support",
    "plan_stages",
    "pool_stats",
    "reverse_descending_runs",
    "staging_replicas_write",
    "tp_peers",
]

__version__: str
#: Roles of the separate K and V entries of an MHA layout (head-sharded between TP ranks).
MHA_ROLES: list[str]
#: KV dtype names by code (``ConversionPlan.in_dtypes`` / ``out_dtypes`` index it).
DTYPES: list[str]
#: Scale format names by code (``ConversionPlan.scale_formats`` indexes it): ``"float32"`` (the
#: per_token / per_token_head scales), ``"e8m0"`` (the mx block scales, one byte each).
SCALE_FORMATS: list[str]

class KvPlanError(ValueError):
    #: The core's stable name of the error's family (``"head_slicing"``, ``"size_mismatch"``,
    #: ``"fragments"``, ...; ``"other"`` for errors raised by Python code).
    kind: str
    #: For a batch plan's error, the indices of the batch's requests it is about (the request
    #: whose own error it is, or the two that write one page); empty otherwise.
    requests: tuple[int, ...]
class PairingError(KvPlanError): ...
class IndexBoundsError(KvPlanError): ...
class SizeMismatchError(KvPlanError): ...
class LayoutError(KvPlanError): ...
class ManifestError(LayoutError):
    #: The manifest's model name.
    model: str
    #: Every problem as ``(kind, role, layers, expected, got)`` (see
    #: :func:`kvplan.check_manifest`).
    problems: tuple[tuple[str, str, list[int], int | None, int | None], ...]

class UnsupportedError(KvPlanError):
    #: The planner asked (``"plan_staged"``, ``"plan_row_gather"``, ``"descriptor_table"``, ...).
    planner: str
    #: The feature it does not support (``"delta"``, ``"state_slot"``, ``"window"``,
    #: ``"token_plan"``).
    feature: str

def planner_support() -> list[tuple[str, list[tuple[str, bool]]]]:
    """Per planner, in the core's order, every request feature and whether it plans it."""
def feature_descriptions() -> list[tuple[str, str]]:
    """Every request feature with one line saying what it is, in the core's order."""

_Role = Literal["src", "src_staging", "dst_staging", "dst"]
#: One stage of a plan, as the core describes it: ``(kind, side, part, reads, writes)``.
_StageNames = tuple[Literal["copy", "rows", "convert", "network"], Literal["src", "dst"] | None,
                    Literal["gather", "network", "scatter", "rows"] | None, _Role, _Role]

def plan_stages(form: str) -> tuple[_StageNames, ...]:
    """The stages of the plan form named ``form`` (``"direct"``, ``"staged"``, ``"rounds"``,
    ``"packed"``, ``"row_gather"``, ``"convert_on_prefill"``, ``"convert_on_decode"``), in the
    order they run (what :func:`kvplan.exec.stages` reads).

    Raises:
        ValueError: No form is named ``form`` (the message lists the forms).
    """

_IndexArray = npt.NDArray[np.int32] | npt.NDArray[np.int64]
_I64Array = npt.NDArray[np.int64]
_Buffer = Buffer | npt.NDArray[np.generic]
_U64Array = npt.NDArray[np.uint64]

class _LeaseLike(Protocol):
    # What a lease argument reads: kvplan.leases.Lease, or anything with these two attributes.
    @property
    def epoch(self) -> int: ...
    @property
    def request(self) -> str | bytes: ...

def index_array(ids: Sequence[int] | npt.NDArray[np.int64], /) -> npt.NDArray[np.int64]:
    """``ids`` (a list or tuple of ints, or an int64 array, returned as is) as an int64 array,
    unboxed in one pass; a non-int element is a ``TypeError``, one outside int64 an
    ``IndexBoundsError``."""
def nixl_desc_ids(
    block_ids: Sequence[Sequence[int] | npt.NDArray[np.int64]], /, *, num_blocks: int,
    block_size_ratio: int | float | None, region_num_blocks: Sequence[int] | None,
    layer_groups: Sequence[int], num_regions: int, num_layers: int,
    region_groups: Sequence[int] | None, worker_region_groups: Sequence[int],
    grouped: object | None, worker_grouped: object,
    pairs: tuple[Sequence[int], Sequence[int]] | None = None,
) -> npt.NDArray[np.int64] | None:
    """vLLM's NIXL ``_compute_desc_ids`` for a model without Mamba state (the worker's
    attributes passed by keyword); ``None`` when an argument is of a kind the core does not
    model. A block id outside its region is an ``IndexBoundsError``. ``pairs``: vLLM 0.34's
    ``(regions, keys)`` (key major, pair order within a key); the layer routing and region
    group arguments are then not read."""
def failed_batch_pages(
    batch: BatchPlan, dst_addrs: _U64Array, lengths: _U64Array,
    dst_pages: Sequence[Mapping[int, _I64Array] | int], failed: Sequence[tuple[int, int]],
) -> list[tuple[int, dict[int, _I64Array], _I64Array]]:
    """Per request of ``batch`` with failed pages or slots, in batch order: ``(request,
    {pool: sorted page ids}, sorted slots)`` for blocks ``failed`` (``(start, stop)`` ranges)
    of the batch's ``dst_addrs`` / ``lengths``. ``dst_pages``: each request's destination
    pages as planned (``{pool: int64 pages}``) or its destination state slot (an int), so the
    blocks of fused requests name each request its own pages."""
def failed_pages(
    template: Template, dst_addrs: _U64Array, lengths: _U64Array,
    failed: Sequence[tuple[int, int]],
) -> tuple[dict[int, _I64Array], _I64Array]:
    """The destination pages per pool (``{pool: sorted page ids}``, only pools with a failed
    page) and the sorted state slots that blocks ``failed`` (``(start, stop)`` ranges) of a plan
    of ``template`` were to write; a reversed range, one past the plan, or a block in none of
    the decode's entries is an ``IndexBoundsError``."""
def group_contiguous(src: _IndexArray, dst: _IndexArray, /) -> tuple[_I64Array, _I64Array, _I64Array]: ...
def reverse_descending_runs(src: _IndexArray, dst: _IndexArray, /) -> tuple[_I64Array, _I64Array] | None:
    """``(src, dst)`` with each stretch that steps by -1 on both sides reversed in place (the
    same pairs, as new int64 arrays), or ``None`` when nothing descends or the reordering would
    leave more runs under the ascending rule; unequal lengths are a ``KvPlanError``."""
def pair_entries(
    src_layer_ids: Sequence[int] | None,
    dst_layer_ids: Sequence[int] | None,
    n_src: int,
    n_dst: int,
    allow_positional_fallback: bool = False,
    *,
    src_roles: Sequence[str] | None = None,
    dst_roles: Sequence[str] | None = None,
) -> _I64Array: ...
def legacy_pp_pairs(
    kind: str,
    n_src: int,
    n_dst: int,
    prefill_start_layer: int,
    *,
    num_draft_entries: int = 0,
    decode_num_layers: int | None = None,
) -> _I64Array: ...
def pool_stats() -> tuple[int, int, int, int]: ...
def combine_pair_digests(pair_digests: Sequence[int] | npt.NDArray[np.uint64]) -> int:
    """The content digest of a plan from its pair digests (no byte is hashed again)."""
def index_digest(pages: _IndexArray) -> int:
    """XXH3-64 of a page list (widened to int64), as integrity manifests carry it."""
def leased_plan_digest(plan_digest: int, epoch: int, request: str | bytes) -> int:
    """A plan digest bound to the destination's lease (request id and epoch)."""
def needs_tokens(src_layout: Layout, dst_layout: Layout) -> bool: ...
def check_pairs(
    src_layout: Layout,
    dst_layout: Layout,
    pairing: Pairing | None = None,
    *,
    replicas_send: bool = False,
) -> list[tuple[str, int, int | None, KvPlanError | None]]:
    """One row per source entry: ``(kind, src_entry, dst_entry or None, exception or None)``.

    ``pairing`` is a :class:`Pairing`, as for ``Template`` (which refuses the same removed
    keywords and bool)."""

@final
class Pairing:
    """How a ``Template`` pairs prefill entries with decode entries (an immutable value)."""

    @staticmethod
    def by_layer_id(
        allow_positional_fallback: bool = False,
        *,
        prefill_start_layer: int | None = None,
        legacy_kind: str | None = None,
    ) -> Pairing: ...
    @staticmethod
    def positional() -> Pairing: ...
    @staticmethod
    def legacy(kind: str | None = None, *, prefill_start_layer: int) -> Pairing: ...
    @staticmethod
    def _from_arguments(
        function: str, pairing: object, keywords: Mapping[str, object] | None
    ) -> Pairing:
        """The ``Pairing`` a call of ``function`` asked for, for Python functions that take
        ``Template``'s ``pairing`` and forward it (``kvplan.compare``): ``keywords`` (the call's
        keywords outside its signature) and a non-``Pairing`` ``pairing`` are refused as
        ``Template`` refuses them."""
    @property
    def mode(self) -> str: ...
    @property
    def allow_positional_fallback(self) -> bool: ...
    @property
    def prefill_start_layer(self) -> int | None: ...
    @property
    def legacy_kind(self) -> str | None: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class LayoutEntry:
    """One entry of a layout, as ``Layout.entries()`` lists it (read-only)."""

    @property
    def index(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def layer_id(self) -> int | None: ...
    @property
    def role(self) -> str | None: ...
    @property
    def is_draft(self) -> bool: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def data_len(self) -> int: ...
    @property
    def item_len(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def window(self) -> int | None: ...
    @property
    def page_size(self) -> int: ...
    @property
    def in_window_pool(self) -> bool: ...
    @property
    def ring(self) -> int | None: ...
    @property
    def sidecar(self) -> bool: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class Layout:
    def __new__(
        cls,
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: int | Sequence[int],
        layer_ids: Sequence[int | None] | None = None,
        roles: Sequence[str | None] | None = None,
        *,
        kinds: Sequence[str] | None = None,
        drafts: Sequence[bool] | None = None,
        strides: int | Sequence[int] | None = None,
        windows: Sequence[int | None] | None = None,
        window_page_size: int | None = None,
        rings: Sequence[int | None] | None = None,
        page_size: int = ...,
        device: str = ...,
        num_model_layers: int | None = ...,
        pp_rank: int = ...,
        pp_size: int = ...,
        tp_rank: int = ...,
        tp_size: int = ...,
        dcp_size: int = ...,
        dcp_rank: int = ...,
        dcp_interleave: int = ...,
        kv_heads: int | None = ...,
        heads_per_rank: int | None = ...,
        head_dim: int | None = ...,
        dtype_size: int | None = ...,
        memory_order: str | None = ...,
    ) -> Layout: ...
    @staticmethod
    def mla(
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: int | Sequence[int],
        layer_ids: Sequence[int] | None = None,
        *,
        strides: int | Sequence[int] | None = None,
        **context: object,
    ) -> Layout: ...
    @staticmethod
    def mha(
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        k_data_lens: Sequence[int],
        v_data_lens: Sequence[int],
        k_item_lens: int | Sequence[int],
        v_item_lens: int | Sequence[int],
        layer_ids: Sequence[int] | None = None,
        *,
        strides: int | Sequence[int] | None = None,
        **context: object,
    ) -> Layout: ...
    @staticmethod
    def hybrid_linear(
        full_attention_layer_ids: Sequence[int],
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: int | Sequence[int],
        *,
        mla: bool = True,
        strides: int | Sequence[int] | None = None,
        **context: object,
    ) -> Layout: ...
    @staticmethod
    def npu_groups(
        layer_ids: Sequence[int],
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: int | Sequence[int],
        *,
        group_roles: Sequence[str] | None = None,
        strides: int | Sequence[int] | None = None,
        **context: object,
    ) -> Layout: ...
    @staticmethod
    def cross_layer(
        pool_ptr: int,
        pool_len: int,
        layer_ids: Sequence[int] | None,
        item_lens: int | Sequence[int],
        *,
        roles: Sequence[str] | None = None,
        **context: object,
    ) -> Layout:
        """One allocation holding every layer of a page side by side: entry ``j``'s item of page
        ``i`` is at ``pool_ptr + i * sum(item_lens) + sum(item_lens[:j])``."""
    def with_draft(
        self,
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: int | Sequence[int],
        *,
        draft_layer_ids: Sequence[int],
        num_hidden_layers: int,
        roles: Sequence[str] | None = None,
        strides: int | Sequence[int] | None = None,
    ) -> Layout: ...
    def with_state(
        self,
        name: str,
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: int | Sequence[int],
        layer_ids: Sequence[int],
        *,
        strides: int | Sequence[int] | None = None,
        channels: int | Sequence[int] | None = None,
        outer_rows: int | Sequence[int] | None = None,
        shard_groups: Sequence[Sequence[int] | None] | None = None,
    ) -> Layout:
        """State entries appended (kind ``"state"``, role ``name``). With ``channels`` each new
        entry's slot is TP-split: ``outer_rows`` rows (default 1) of this rank's ``channels``
        channels, the model's channels cut into ``shard_groups`` sub-blocks (channel counts at
        TP 1; ``None``: one sub-block), each split evenly over the layout's ``tp_size`` ranks;
        0 channels marks a replicated slot (moved whole from one elected prefill rank). A
        template between two such layouts moves, per state pair, the byte slices of the decode
        rank's slot that the prefill rank holds (docs/sglang.md, ``_send_mamba_state_slice``).

        Raises:
            LayoutError: A split that does not fit the entry (rows × channels not dividing the
                item, shard groups not summing to ``channels × tp_size`` or not divisible by it,
                0 rows, more than 4 shard groups); the message names the layout entry and, for
                a split refused on its own, its ``channels[i]``, ``outer_rows[i]`` and
                ``shard_groups[i]``.
            TypeError: ``outer_rows`` or ``shard_groups`` without ``channels``.
        """
    @property
    def state_channels(self) -> list[tuple[int, int, list[int]] | None]:
        """Each entry's TP channel split ``(channels per rank, outer rows, shard groups)``
        (``None``: none)."""
    def fingerprint(self) -> int:
        """XXH3-64 of ``to_bytes()``: equal on two peers exactly when their layouts agree.

        It hashes the addresses too, so it is for checking that both sides of one handshake hold
        the same layout (plan digests), not a key across processes or restarts: for that use
        :func:`kvplan.layout_identity` (``class_id`` for a router or a metric, ``layout_id`` for
        an offload store)."""
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> Layout: ...
    def to_dict(self) -> dict[str, object]: ...
    @staticmethod
    def from_dict(data: dict[str, object]) -> Layout: ...
    def __len__(self) -> int: ...
    @property
    def n_entries(self) -> int: ...
    @property
    def data_ptrs(self) -> list[int]: ...
    @property
    def data_lens(self) -> list[int]: ...
    @property
    def item_lens(self) -> list[int]: ...
    @property
    def layer_ids(self) -> list[int | None] | None: ...
    @property
    def roles(self) -> list[str | None] | None: ...
    @property
    def kinds(self) -> list[str]: ...
    @property
    def drafts(self) -> list[bool]: ...
    def entries(self, kind: str | None = None) -> list[LayoutEntry]: ...
    @property
    def strides(self) -> list[int]: ...
    @property
    def windows(self) -> list[int | None]: ...
    def with_windows(self, windows: Sequence[int | None], *,
                     window_page_size: int | None = None) -> Layout:
        """Sliding-window entries (one window in tokens per entry, ``None`` for a full one);
        with ``window_page_size`` they keep a pool of their own, indexed by a request's window
        pages (``Template.plan(..., window_pages=)``) of that many tokens each."""
    @property
    def window_page_size(self) -> int | None:
        """Tokens per page of the window entries' own pool (``None``: none)."""
    def with_pool(self, entries: Sequence[int | str], page_size: int, *,
                  tokens_per_row: int = 1) -> Layout:
        """``entries`` (entry indices, or role names: every page entry of the request's pages
        with that role) in a pool of their own, the next pool id: one page index space of
        ``page_size`` tokens per page, as ``page_size / tokens_per_row`` rows (a compressed
        cache: one row per ``tokens_per_row`` tokens, moved once all its tokens are in the
        request's range). A request gives the pool's pages as ``Request(...,
        pool_pages={pool: (src, dst)})``.

        Raises:
            LayoutError: A page size that is not a multiple of ``tokens_per_row``, a 0, an
                entry out of range, a state entry, an entry already in a pool, no entry, a
                role no page entry has, too many pools, or a dealt (DCP) layout.
            TypeError: ``entries`` not a list of ints or strings.
        """
    @property
    def pools(self) -> list[tuple[int, int, int]]:
        """``(pool id, page_size, tokens_per_row)`` per pool, the request's pages (0) first."""
    @property
    def entry_pools(self) -> list[int | None]:
        """Each entry's pool id (``None`` for a state entry)."""
    @property
    def representations(self) -> list[str | None]:
        """KV representation per entry (``None``: none published), e.g. ``"fp8_e4m3:per_token"``."""
    def with_representations(self, representations: Sequence[str | None]) -> Layout:
        """The same layout with one KV representation per entry (``"dtype"`` or
        ``"dtype:scales"``, ``None`` for none); see docs/api.md, "KV representations"."""
    @property
    def rings(self) -> list[int | None]: ...
    def with_rings(self, rings: Sequence[int | None]) -> Layout: ...
    @property
    def capacities(self) -> list[int]: ...
    @property
    def page_size(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def num_model_layers(self) -> int | None: ...
    @property
    def pp_rank(self) -> int: ...
    @property
    def pp_size(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def dcp_size(self) -> int: ...
    @property
    def dcp_rank(self) -> int: ...
    @property
    def dcp_interleave(self) -> int: ...
    @property
    def kv_heads(self) -> int | None: ...
    @property
    def heads_per_rank(self) -> int | None: ...
    @property
    def head_dim(self) -> int | None: ...
    @property
    def dtype_size(self) -> int | None: ...
    @property
    def memory_order(self) -> str | None: ...

@final
class PlanBuffer:
    @property
    def nbytes(self) -> int: ...

@disjoint_base
class Blocks:
    """Three equally long uint64 columns (source addresses, destination addresses, lengths):
    the base of every plan-like result (``TransferPlan``, ``BatchPlan``, ``BlockSlice``)."""

    @property
    def src_addrs(self) -> _U64Array: ...
    @property
    def dst_addrs(self) -> _U64Array: ...
    @property
    def lengths(self) -> _U64Array: ...
    @property
    def n_blocks(self) -> int: ...
    def as_lists(self) -> tuple[list[int], list[int], list[int]]: ...
    def __len__(self) -> int: ...

@final
class BatchPlan(Blocks):
    """Many requests to one peer in one plan (``Template.plan_batch``, ``plan_batch_flat``):
    every request's blocks in one set of columns, in segments that follow the request order. A
    segment is one request, or consecutive requests whose pages touch on both sides, their
    boundary blocks merged. An engine call that fails holds exactly the requests of the
    segments its blocks belong to."""

    @property
    def n_requests(self) -> int: ...
    @property
    def n_segments(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def segment_offsets(self) -> _I64Array:
        """``n_segments + 1`` block offsets: segment ``s`` is blocks ``segment_offsets[s] ..
        segment_offsets[s + 1]``."""
    @property
    def segment_requests(self) -> _I64Array:
        """``n_segments + 1`` request offsets: segment ``s`` holds requests
        ``segment_requests[s] .. segment_requests[s + 1]``."""
    @property
    def request_segments(self) -> _I64Array:
        """Per request, the segment it was planned in."""
    @property
    def request_bytes(self) -> _U64Array:
        """Per request, the bytes it moves."""
    @property
    def request_n_blocks(self) -> _I64Array:
        """Per request, its blocks if planned alone (``Template.plan``)."""
    def request_blocks(self, request: int) -> slice:
        """The blocks holding ``request``'s bytes (its segment's blocks)."""
    def requests_in(self, start: int, stop: int) -> _I64Array:
        """The requests whose bytes blocks ``start .. stop`` hold, in order."""
    def call_ranges(self, max_blocks: int) -> npt.NDArray[np.int64]:
        """``(n_calls, 2)`` ``[start, stop)`` block ranges of at most ``max_blocks`` blocks, one
        per engine call: whole segments packed while they fit, a larger one split alone."""
    def batches(self, max_blocks: int) -> list[BlockSlice]:
        """The blocks of each of ``call_ranges(max_blocks)`` as views (no copy)."""
    @property
    def request_digests(self) -> _U64Array:
        """Per request, the plan digest of the request planned alone (``digests=True`` only).

        Raises:
            KvPlanError: The batch was planned without digests.
        """
    @property
    def request_leases(self) -> list[_LeaseLike | None] | None:
        """Per request, the lease it was planned with (``None`` for a request without one), as
        passed to ``leases=``; ``None`` for a batch planned without leases."""
    @property
    def layout_fingerprints(self) -> tuple[int, int]: ...

@final
class BlockSlice(Blocks):
    """A run of blocks (views, no copy): a slice of a plan's blocks (``batches(max_blocks)``
    sizes them for one engine submission) or three columns built by hand; unpacks as
    ``src_addrs, dst_addrs, lengths = blocks``."""

    def __new__(cls, src_addrs: _U64Array, dst_addrs: _U64Array, lengths: _U64Array) -> BlockSlice: ...
    def __iter__(self) -> Iterator[_U64Array]: ...

#: ``BlockSlice``'s old name, kept as an alias for this release.
PlanBatch = BlockSlice

@final
class RowGather:
    """The gather of a pack plan as source rows (``Template.plan_row_gather``): per token lane
    the rows moved, per piece one copy, instead of one block per row."""

    @property
    def rows(self) -> list[_U64Array]:
        """Per lane (0: target tokens, 1: draft tokens sent whole), the source row of every
        token moved, in token order: ``source page index * rows_per_page + slot``."""
    @property
    def copies(self) -> npt.NDArray[np.uint64]:
        """``(n_copies, 7)``: ``lane, src_base, page_stride, row_stride, rows_per_page, len,
        pack_addr``; row ``r = rows[lane][k]`` copies ``len`` bytes from ``src_base + (r //
        rows_per_page) * page_stride + (r % rows_per_page) * row_stride`` to ``pack_addr + k *
        len``."""
    @property
    def pack_bytes(self) -> int: ...

@final
class TransferPlan(Blocks):
    """The ``(src_addr, dst_addr, length)`` blocks of one request, entry-pair major, run minor.

    The three uint64 arrays view one pooled Rust buffer (or the caller's ``out=`` array) without
    a copy; a pooled buffer returns to kvplan's pool when the last of them dies.
    """

    @property
    def n_runs(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def skip_tokens(self) -> int: ...
    @property
    def n_pairs(self) -> int: ...
    @property
    def pair_offsets(self) -> _I64Array: ...
    def pair_blocks(self, pair: int) -> slice: ...
    @property
    def n_groups(self) -> int: ...
    @property
    def group_offsets(self) -> _I64Array: ...
    @property
    def pair_groups(self) -> _I64Array: ...
    def group_blocks(self, group: int) -> slice: ...
    def batches(self, max_blocks: int) -> list[BlockSlice]: ...
    @property
    def layout_fingerprints(self) -> tuple[int, int]:
        """Fingerprints of the prefill and decode layouts the plan was planned between."""
    def digest(self, *, lease: _LeaseLike | None = None) -> int:
        """The plan digest (64-bit int): both layout fingerprints, pair offsets, every block;
        with ``lease``, bound to that allocation of the destination pages."""
    def pair_content_digests(
        self, side: Literal["src", "dst"], buffers: Iterable[_Buffer]
    ) -> npt.NDArray[np.uint64]:
        """Per entry pair, XXH3-64 of the bytes its blocks cover on ``side`` (zero-copy).

        Raises:
            IndexBoundsError: A block does not lie inside one of ``buffers``.
            TypeError: A buffer is not C-contiguous or has no buffer protocol.
        """
    def content_digest(self, side: Literal["src", "dst"], buffers: Iterable[_Buffer]) -> int:
        """The content digest (64-bit int) over ``pair_content_digests(side, buffers)``."""

@final
class Request:
    """One transfer request as a value: each side's pages (``src``, ``dst``: 1-D int32/int64
    arrays, held as given, never copied) or one state slot per side (``slot=(src_slot,
    dst_slot)``), each side's pages of each further pool (``pool_pages={pool id: (src, dst)}``,
    ``None`` for a side without that pool; ``window_pages=(src, dst)`` is pool 1's, a window
    pool's) and the token range (``n_tokens``, ``skip_tokens``). ``pool_tokens={pool id:
    (n_tokens, skip_tokens)}`` gives a further pool a token range of its own (its entries move
    tokens ``skip_tokens..n_tokens`` of that pool's pages; ``(0, 0)`` with empty page arrays
    moves nothing of it), planned by ``plan`` and ``plan_batch`` only. Pages and a slot
    together (``Request(src, dst, slot=(src_slot, dst_slot))``) are a hybrid model's whole
    request: its plan is the page (or token) plan, then the slot request's plan (its state
    slots, and its ring rows of the last ``min(R_p, R_d, n_tokens)`` positions when
    ``n_tokens`` is given and the template has rings), planned by ``plan`` and ``plan_batch``
    only. Every planner method takes one in place of its page arrays; a feature the planner
    does not plan is an ``UnsupportedError`` naming both.

    Raises:
        TypeError: A page array that is not 1-D C-contiguous aligned int32/int64; only one
            side's pages; neither pages nor a slot; window pages of another dtype
            than that side's pages, or for a slot; a non-int count or a malformed slot; pool 1
            given both as ``window_pages`` and in ``pool_pages``; ``pool_pages`` not a dict;
            ``pool_tokens`` not a dict of ``(n_tokens, skip_tokens)`` tuples, or for a slot.
        KvPlanError: A negative ``n_tokens`` or ``skip_tokens``, or ``skip_tokens`` past
            ``n_tokens`` (the request's or a pool's); a ``pool_pages`` or ``pool_tokens`` key
            that is not a further pool id (1 to 7).
        IndexBoundsError: A negative slot.
    """

    def __new__(
        cls,
        src: _IndexArray | None = None,
        dst: _IndexArray | None = None,
        *,
        window_pages: tuple[_IndexArray | None, _IndexArray | None] | None = None,
        pool_pages: Mapping[int, tuple[_IndexArray | None, _IndexArray | None]] | None = None,
        slot: tuple[int, int] | None = None,
        n_tokens: int | None = None,
        skip_tokens: int | None = None,
        pool_tokens: Mapping[int, tuple[int, int]] | None = None,
    ) -> Request: ...
    @property
    def src(self) -> _IndexArray | None:
        """The caller's prefill page array (``None`` for a slot request)."""
    @property
    def dst(self) -> _IndexArray | None:
        """The caller's decode page array (``None`` for a slot request)."""
    @property
    def window_pages(self) -> tuple[_IndexArray | None, _IndexArray | None] | None: ...
    @property
    def pool_pages(self) -> Mapping[int, tuple[_IndexArray | None, _IndexArray | None]] | None:
        ...
    @property
    def slot(self) -> tuple[int, int] | None: ...
    @property
    def n_tokens(self) -> int | None: ...
    @property
    def skip_tokens(self) -> int: ...
    @property
    def pool_tokens(self) -> dict[int, tuple[int, int]] | None:
        """Each further pool's own ``(n_tokens, skip_tokens)`` by pool id (``None``: none)."""

@final
class Template:
    """A validated peer pair (prefill layout → decode layout), built once, planned per request.

    Between TP sizes (both layouts publish their attention geometry) the template moves the
    heads the two ranks have in common; of replicated prefill heads only the elected holder
    sends. ``replicas_send=True`` makes every writer of a decode rank send them instead: when
    the prefill TP is a multiple of a smaller decode TP, each of decode rank ``r_d``'s ``w =
    tp_p // tp_d`` prefill ranks ``r_d*w .. (r_d+1)*w`` moves its own copy (a decode side that
    expects one share per writer, as SGLang's staged transfer; ``plan_staged`` then fills this
    rank's share). Default off; no effect with one writer per decode rank, nor on state.

    ``pairing`` is a :class:`Pairing` (default ``Pairing.by_layer_id()``). The removed keywords
    ``allow_positional_fallback``, ``prefill_start_layer`` and ``legacy_kind``, and a bool as
    ``pairing``, raise a ``TypeError`` naming the ``pairing=kvplan.Pairing...`` to write instead.

    Raises (on construction):
        PairingError: A source entry has no partner, ids are one-sided, counts do not fit.
        SizeMismatchError: Paired entries have different item lengths (names layer, role, sizes).
    """

    def __new__(
        cls,
        src_layout: Layout,
        dst_layout: Layout,
        pairing: Pairing | None = None,
        *,
        check_dst_overlap: bool = False,
        fragments: Sequence[tuple[int, int, int]] | Sequence[Sequence[tuple[int, int, int]] | None] | None = None,
        coalesce: bool = True,
        layer_groups: LayerGroups | None = None,
        replicas_send: bool = False,
    ) -> Template: ...
    def layer_slices(self, groups: LayerGroups) -> LayerSlices:
        """This template's layer slices for ``groups``, built once; cut plans with ``.of(plan)``.

        Raises:
            KvPlanError: A coalesced block holds layers of two groups (or of a group and the
                seal); build the template with ``layer_groups=groups``.
        """
    @property
    def pairs(self) -> _I64Array: ...
    @property
    def state_pairs(self) -> _I64Array: ...
    @property
    def emitting(self) -> tuple[bool, ...]: ...
    @property
    def coalescing(self) -> list[tuple[str, str | None, bool]]:
        """Per page pair ``(kind, side, per_page)``: whether it emits with the pair before it
        (``joined``) or what keeps it apart (``first``, ``elided``, ``by_token``,
        ``fragments``, ``strides``/``apart``/``beyond_stride`` on ``side``, ``options``), and
        whether its blocks end at every page."""
    @property
    def n_pairs(self) -> int: ...
    @property
    def empty_reason(self) -> str | None:
        """Why this template moves no page bytes although it pairs entries (between TP sizes:
        the prefill rank holds none of the decode rank's heads, or is not their elected
        sender, or with ``replicas_send`` not one of the decode rank's writers); ``None`` when
        it moves pages."""
    @property
    def pair_item_lens(self) -> list[int]: ...
    @property
    def bytes_per_page(self) -> int: ...
    @property
    def pair_strides(self) -> list[tuple[int, int]]: ...
    @property
    def n_groups(self) -> int: ...
    @property
    def pair_groups(self) -> _I64Array: ...
    @overload
    def n_blocks_for(self, n_pages: Request, n_runs: None = None) -> int:
        """The blocks ``plan(request)`` plans, counted by the core's validation, nothing
        planned (raises as ``plan`` for the same request)."""
    @overload
    def n_blocks_for(self, n_pages: int, n_runs: int | None = None) -> int:
        """Blocks of a page request of ``n_pages`` index pairs in ``n_runs`` runs (runs
        contiguous on both sides; default 1), without planning it."""
    @property
    def page_sizes(self) -> tuple[int, int]: ...
    @property
    def by_token(self) -> bool: ...
    def n_token_blocks(self, n_tokens: int, *, fragmented: bool = False) -> int: ...
    def packed_block_counts(self, n_tokens: int, *, fragmented: bool = False
                            ) -> tuple[int, int, int]: ...
    def plan_batch(
        self,
        requests: Sequence[Request | tuple[_IndexArray, _IndexArray]
                           | tuple[_IndexArray, _IndexArray, int | None]],
        *,
        digests: bool = False,
        leases: Sequence[_LeaseLike | None] | None = None,
    ) -> BatchPlan:
        """Plan many requests to this peer as one plan: each ``(src_pages, dst_pages[,
        n_tokens])`` planned as ``plan`` would; requests whose pages touch on both sides share
        merged blocks. ``digests=True`` also computes each request's plan digest alone.
        ``leases`` (one per request, ``None`` for a request without one) binds each request's
        digest to its lease as ``TransferPlan.digest(lease=)`` does, and implies ``digests``.

        Raises:
            IndexBoundsError: A request's index is out of range (the message names the
                request), or two requests write one destination page (kind
                ``requests_overlap``, naming both).
            KvPlanError: A request's own error, naming the request.
            TypeError: A request is not a tuple of 1-D int32/int64 arrays, or its dtypes differ
                from the first request's.
        """
    def plan_batch_flat(
        self,
        src_pages: _IndexArray,
        dst_pages: _IndexArray,
        offsets: npt.NDArray[np.int64],
        *,
        dst_offsets: npt.NDArray[np.int64] | None = None,
        n_tokens: npt.NDArray[np.int64] | None = None,
        digests: bool = False,
        leases: Sequence[_LeaseLike | None] | None = None,
    ) -> BatchPlan:
        """Plan a batch given flat, the same ``BatchPlan`` as ``plan_batch`` of the same
        requests: every request's pages concatenated in ``src_pages`` and ``dst_pages`` (1-D
        int32 or int64, each array of one dtype), and ``offsets``, ``n_requests + 1`` int64
        values starting at 0 and ending at ``len(src_pages)``. Request ``r`` moves
        ``src_pages[offsets[r]:offsets[r + 1]]`` to the same slice of ``dst_pages``, or to
        ``dst_pages[dst_offsets[r]:dst_offsets[r + 1]]`` when ``dst_offsets`` is given (token
        requests between different page sizes). ``n_tokens``, one int64 count per request,
        makes every request a token request. No Python object per request is read.

        Raises:
            KvPlanError: Offsets that are empty, do not start at 0, are negative or decrease,
                or do not end at their array's length; ``dst_offsets`` or ``n_tokens`` of the
                wrong length, or a negative token count (kind ``flat_batch``, naming the
                values); a request's own error, naming the request.
            IndexBoundsError: As ``plan_batch``.
            TypeError: A page array that is not 1-D int32/int64, or offsets or token counts
                that are not 1-D int64.
        """
    @overload
    def plan(self, src_pages: Request, dst_pages: None = None, *,
             out: _U64Array | None = None) -> TransferPlan: ...
    @overload
    def plan(
        self,
        src_pages: _IndexArray,
        dst_pages: _IndexArray,
        *,
        n_tokens: int | None = None,
        skip_tokens: int = 0,
        window_pages: tuple[_IndexArray | None, _IndexArray | None] | None = None,
        out: _U64Array | None = None,
    ) -> TransferPlan:
        """Plan the blocks that copy page ``src_pages[i]`` to ``dst_pages[i]`` for every pair.

        ``skip_tokens``: the decode holds the request's first K tokens already (a delta plan:
        tokens K.. only, planned by token; the digest covers K).

        ``window_pages``: ``(src, dst)``, each side's window pages when its window entries keep
        a pool of their own (``Layout.with_windows(..., window_page_size=)``), in token order
        from the request's first token, with the dtype of that side's pages; ``None`` for a
        side without a window pool.

        When the layouts' page sizes differ, or ``n_tokens`` is given, both arrays are each
        side's pages in token order and the plan copies the first ``n_tokens`` tokens (default:
        the full pages of the shorter side) token by token.

        Raises:
            IndexBoundsError: An index is negative or not below its buffer's capacity.
            KvPlanError: Unequal lengths, ``out`` too small, read-only or overlapping an input,
                overflow.
            TypeError: Not a 1-D C-contiguous, aligned int32/int64 numpy array; ``out`` not a
                C-contiguous ``(3, M)`` uint64 array.
            MemoryError: The plan's output cannot be allocated.
        """
    @overload
    def plan_row_gather(self, src_pages: Request, dst_pages: None = None, *, pack: tuple[int, int]
                 ) -> tuple[RowGather, TransferPlan]: ...
    @overload
    def plan_row_gather(
        self,
        src_pages: _IndexArray,
        dst_pages: _IndexArray,
        *,
        pack: tuple[int, int],
        n_tokens: int | None = None,
    ) -> tuple[RowGather, TransferPlan]:
        """Plan one token request as ``plan_packed`` does, with the gather as source rows.

        Returns ``(rows, network)``: ``network`` is ``plan_packed``'s network plan, and
        ``rows`` copies into the pack buffer exactly what its gather copies (same pack layout).
        A too-small buffer is a ``SizeMismatchError``; a page request is a ``KvPlanError``.
        """
    @overload
    def plan_packed(self, src_pages: Request, dst_pages: None = None, *, pack: tuple[int, int]
                 ) -> tuple[TransferPlan, TransferPlan]: ...
    @overload
    def plan_packed(
        self,
        src_pages: _IndexArray,
        dst_pages: _IndexArray,
        *,
        pack: tuple[int, int],
        n_tokens: int | None = None,
    ) -> tuple[TransferPlan, TransferPlan]:
        """Plan one request as ``plan`` does, split in two around a pack buffer of prefill memory.

        ``pack`` is ``(address, size)``. Returns ``(gather, network)``: ``gather`` copies the
        plan's source rows into the pack buffer (packed back to back from its start, so every
        run contiguous on the decode side is contiguous in the buffer); the caller executes it
        before the transfer. ``network`` moves the buffer to the decode, one block per
        destination-contiguous run. Together they write exactly what ``plan`` writes. The halves
        have pair offsets but no group or layer-slice views.

        Raises:
            SizeMismatchError: The pack buffer is smaller than the plan's bytes (the message
                names the bytes needed).
            IndexBoundsError, KvPlanError, TypeError, MemoryError: As ``plan``.
        """
    @overload
    def plan_staged(self, src_pages: Request, dst_pages: None = None, *, src_staging: tuple[int, int],
                    dst_staging: tuple[int, int]) -> StagedPlan: ...
    @overload
    def plan_staged(
        self,
        src_pages: _IndexArray,
        dst_pages: _IndexArray,
        *,
        src_staging: tuple[int, int],
        dst_staging: tuple[int, int],
        n_tokens: int | None = None,
    ) -> StagedPlan:
        """Plan one request as ``plan`` does, as a gather, a network plan and a scatter.

        ``src_staging`` (prefill memory) and ``dst_staging`` (the decode's staging region) are
        ``(address, size)`` of registered memory. ``gather`` copies the request's bytes into the
        prefill region, back to back from its start; ``network`` moves them into the decode
        region at this prefill rank's writer offsets (one block per contiguous range); ``scatter``
        copies them from there into the decode's pages. Together they write exactly what
        ``plan`` writes. A request's state slots (a slot ``Request``, or pages with
        ``slot=``) are staged as more ranges after its pages when one writer fills the decode
        region at prefill PP 1 (else a ``KvPlanError``: ``plan_rounds`` takes them).

        Raises:
            SizeMismatchError: A staging region is smaller than what the plan places in it
                (the message names the bytes needed), or decode slots are needed and the entry
                pairs move different bytes.
            IndexBoundsError, KvPlanError, TypeError, MemoryError: As ``plan``.
        """
    @overload
    def plan_rounds(self, src_pages: Request, dst_pages: None = None, *,
                    src_arena: tuple[int, int], dst_arena: tuple[int, int],
                    buffers: int = 2) -> StagedRounds: ...
    @overload
    def plan_rounds(
        self,
        src_pages: _IndexArray,
        dst_pages: _IndexArray,
        *,
        src_arena: tuple[int, int],
        dst_arena: tuple[int, int],
        buffers: int = 2,
        n_tokens: int | None = None,
    ) -> StagedRounds:
        """Plan one request as ``plan_staged`` does, cut into rounds through bounded arenas.

        ``src_arena`` (prefill memory) and ``dst_arena`` (decode memory) are ``(address,
        size)`` of registered memory, each split into ``buffers`` round buffers (the decode
        arena first into one share per sender: each prefill rank this template's head slicing
        sends the decode rank's KV heads from, times ``pp_size``. Those are one elected holder
        per replicated head (MLA TP 2 -> 1: one rank; 2 KV heads over TP 4 -> 1: ranks 0 and
        2), or with ``replicas_send`` every one of the ``tp_p // tp_d`` writers. Without
        attention geometry pages move whole, so with the prefill TP larger one prefill rank
        sends them, ``r_d * tp_p // tp_d`` (vLLM's MLA read), or with ``replicas_send`` every
        writer. A prefill rank that sends nothing plans no round and owns no share). Round
        ``k`` gathers into
        prefill buffer ``k % buffers``, sends it as one block into this sender's decode buffer
        ``k % buffers`` and scatters from there; together the rounds write exactly what
        ``plan`` writes, and no round touches staging memory outside its two buffers.

        Raises:
            UnsupportedError: What ``plan_staged`` refuses (naming ``plan_rounds``).
            SizeMismatchError: An arena too small for one byte per round buffer.
            KvPlanError: ``buffers`` is 0, or an arena's size is not a multiple of its
                buffers (times the senders on the decode), naming the sizes; a prefill rank
                moving whole items (no attention geometry) that is not the decode rank's
                sender, naming the sender.
            IndexBoundsError, TypeError, MemoryError: As ``plan``.
        """
    @overload
    def transfer_advice(self, src_pages: Request, dst_pages: TransferCost, cost: None = None
                        ) -> Advice: ...
    @overload
    def transfer_advice(self, src_pages: Request, dst_pages: None = None, *,
                        cost: TransferCost) -> Advice: ...
    @overload
    def transfer_advice(
        self,
        src_pages: _IndexArray,
        dst_pages: _IndexArray,
        cost: TransferCost,
        *,
        n_tokens: int | None = None,
    ) -> Advice:
        """Direct or staged for one request (taken as ``plan`` takes it) on an engine of
        ``cost``: :func:`advise` over the request's direct-plan and staged network-plan block
        counts (this template's writer position included), computed by the core.

        Raises:
            IndexBoundsError, KvPlanError, TypeError, MemoryError: As ``plan_staged`` for the
                same request (no staging region is involved, so none is too small).
        """
    @overload
    def plan_state(self, src_slot: Request, dst_slot: None = None) -> TransferPlan:
        """A slot ``Request``'s plan (as ``plan(request)``): its state slots and, when it gives
        ``n_tokens`` (the positions it has processed), then its ring rows as ``plan_ring``
        plans them."""
    @overload
    def plan_state(self, src_slot: int, dst_slot: int) -> TransferPlan:
        """One block per paired state entry: ``(src_base + L*src_slot, dst_base + L*dst_slot, L)``.

        Raises:
            IndexBoundsError: A slot is negative or outside a paired state buffer.
        """
    @overload
    def plan_ring(self, src_slot: Request, dst_slot: None = None, n_positions: None = None
                  ) -> TransferPlan:
        """``plan_ring(slot_src, slot_dst, n)`` of a slot ``Request`` with ``n_tokens`` (the
        positions processed): ``Request(slot=(src_slot, dst_slot), n_tokens=n_positions)``.

        Raises:
            TypeError: The Request holds pages, gives no ``n_tokens``, or ``n_positions`` is
                given too.
            KvPlanError: The Request skips tokens (kind ``geometry``); as below.
        """
    @overload
    def plan_ring(self, src_slot: int, dst_slot: int, n_positions: int) -> TransferPlan:
        """The live rows of every ring-state pair (``Layout.with_rings``) for one request: the
        positions both rings hold after ``n_positions`` positions, ``n - min(R_p, R_d, n) ..
        n``, each from row ``src_slot * R_p + p % R_p`` to row ``dst_slot * R_d + p % R_d``;
        consecutive positions are one block until either ring wraps. These are the ring rows of
        ``plan(Request(slot=(src_slot, dst_slot), n_tokens=n_positions))`` alone, without the
        plain state slots that plan moves first.

        Raises:
            IndexBoundsError: A slot is negative or its ring lies outside a paired buffer.
            KvPlanError: The template has no ring-state pairs (kind ``geometry``).
        """
    def descriptor_table(self, side: str) -> tuple[_U64Array, _U64Array]:
        """``(addrs, lens)`` of one side's (``"src"`` or ``"dst"``) prepped descriptor table:
        descriptor ``j * pages + k`` is page ``k`` of emission piece ``j`` (the plan's address
        model: strides, head fragments, coalesced groups), then one descriptor per slot of every
        state pair that moves bytes.

        Raises:
            KvPlanError: The template plans by token (different page sizes or memory orders);
                a bad ``side``; a table too large to index with int64.
            MemoryError: The table cannot be allocated.
        """
    def descriptor_runs(self, side: str) -> _U64Array:
        """One side's (``"src"`` or ``"dst"``) prepped descriptor table as ``(n, 4)`` uint64 runs
        ``(base, len, stride, count)``, nothing expanded: one run per emission piece (its
        pages), then one per state pair that moves bytes (its slots). Run ``r``'s ``k``-th
        descriptor is ``len`` bytes at ``base + k * stride``; the runs expanded in order are
        ``descriptor_table(side)`` (the rows of a strided descriptor list, as NIXL's
        ``(addr, len, dev, stride, count)`` without the device).

        Raises:
            KvPlanError: As ``descriptor_table``, except that no table is allocated.
        """
    @overload
    def prepped_indices(self, src_pages: Request, dst_pages: None = None
                        ) -> tuple[_I64Array, _I64Array]: ...
    @overload
    def prepped_indices(self, src_pages: _IndexArray, dst_pages: _IndexArray
                        ) -> tuple[_I64Array, _I64Array]:
        """A page request as ``(src_idx, dst_idx)`` into the two prepped tables, piece major,
        page minor (empty when no page bytes move).

        Raises:
            IndexBoundsError, KvPlanError, TypeError: As ``plan`` for the same request; a
                token template (KvPlanError).
        """
    @overload
    def prepped_state_indices(self, src_slot: Request, dst_slot: None = None
                              ) -> tuple[_I64Array, _I64Array]: ...
    @overload
    def prepped_state_indices(self, src_slot: int, dst_slot: int
                              ) -> tuple[_I64Array, _I64Array]:
        """State slot ``src_slot`` -> ``dst_slot`` as indices into the two prepped tables.

        Raises:
            IndexBoundsError: As ``plan_state``.
        """

@final
class StagedPlan:
    """A request as ``gather`` (prefill memory → prefill staging), ``network`` (prefill staging →
    decode staging) and ``scatter`` (decode staging → decode pages), from ``Template.plan_staged``.
    The three plans have pair offsets but no group or layer-slice views; ``network``'s pair
    offsets are one range of all its blocks."""

    @property
    def gather(self) -> TransferPlan: ...
    @property
    def network(self) -> TransferPlan: ...
    @property
    def scatter(self) -> TransferPlan: ...
    @property
    def src_staging_bytes(self) -> int:
        """Bytes of the prefill staging region used, from its start."""
    @property
    def dst_staging_range(self) -> tuple[int, int]:
        """Offsets ``(start, end)`` of the decode staging region this writer's share covers."""
    @property
    def dst_staging_bytes(self) -> int:
        """Bytes the decode staging region must hold for all writers."""
    @property
    def direct_blocks(self) -> int:
        """Blocks of the request's direct plan (``Template.plan``)."""
    @property
    def writer(self) -> tuple[int, int]:
        """``(writer index, number of writers)`` of this prefill rank in the decode region."""
    @property
    def stages(self) -> tuple[_StageNames, ...]:
        """The plan's stages in the order they run, ``(kind, side, part, reads, writes)`` each:
        the gather on the prefill, the network, the scatter on the decode."""

@final
class RoundManifest:
    """What a decode is told about one round of ``Template.plan_rounds``: which round of how
    many, its bytes and where they land in the decode arena, with a fixed 64-byte wire form."""

    def __eq__(self, value: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]
    @property
    def index(self) -> int: ...
    @property
    def n_rounds(self) -> int: ...
    @property
    def buffer(self) -> int:
        """The round buffer it uses (``index % buffers``)."""
    @property
    def n_network_blocks(self) -> int: ...
    @property
    def sender(self) -> tuple[int, int]:
        """``(sender index, number of senders)`` into the decode arena."""
    @property
    def offset(self) -> int:
        """Bytes of the request before this round."""
    @property
    def bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def dst_bytes_range(self) -> tuple[int, int]:
        """Offsets ``(start, end)`` of the decode arena the round's bytes land in."""
    @property
    def is_last(self) -> bool: ...
    def to_bytes(self) -> builtins.bytes:
        """The fixed 64-byte wire form."""
    @staticmethod
    def from_bytes(data: builtins.bytes) -> RoundManifest:
        """Reads ``to_bytes``'s form back.

        Raises:
            KvPlanError: Not 64 bytes, a wrong magic or version, or values no round has.
        """

@final
class StagedRound:
    """One round of ``Template.plan_rounds``: ``gather`` (prefill memory → prefill round
    buffer), ``network`` (one block into the decode round buffer of the same number),
    ``scatter`` (decode round buffer → decode pages)."""

    @property
    def index(self) -> int: ...
    @property
    def buffer(self) -> int: ...
    @property
    def gather(self) -> TransferPlan: ...
    @property
    def network(self) -> TransferPlan: ...
    @property
    def scatter(self) -> TransferPlan: ...
    @property
    def manifest(self) -> RoundManifest: ...

@final
class StagedRounds:
    """A request's staged plan in rounds (``Template.plan_rounds``): a sequence of
    ``StagedRound``."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> StagedRound: ...
    def __iter__(self) -> Iterator[StagedRound]: ...
    @property
    def manifests(self) -> list[RoundManifest]: ...
    @property
    def stages(self) -> tuple[_StageNames, ...]:
        """The stages every round runs, in order (a staged plan's three)."""
    @property
    def bytes(self) -> int:
        """Bytes of the request."""
    @property
    def buffer_bytes(self) -> int:
        """The most bytes one round holds."""
    @property
    def buffers(self) -> int: ...
    @property
    def n_network_blocks(self) -> int: ...
    @property
    def direct_blocks(self) -> int: ...
    @property
    def staged_network_blocks(self) -> int:
        """Network blocks of the unchunked staged plan (``plan_staged``)."""
    @property
    def sender(self) -> tuple[int, int]:
        """``(sender index, number of senders)`` into the decode arena (index 0 for a prefill
        rank that sends nothing)."""
    @property
    def dst_share(self) -> tuple[int, int]:
        """Offsets ``(start, end)`` of the decode arena this sender's share covers (``(0, 0)``
        for a prefill rank that sends nothing)."""

@final
class ConversionTemplate:
    """Pairs a prefill and a decode layout as ``Template`` does and plans every pair whose
    representations differ as a conversion on the prefill (docs/api.md, "Conversion plans")."""

    def __new__(
        cls,
        src_layout: Layout,
        dst_layout: Layout,
        pairing: Pairing | None = None,
        *,
        check_dst_overlap: bool = False,
        replicas_send: bool = False,
    ) -> ConversionTemplate: ...
    @property
    def converts(self) -> bool:
        """Whether any pair converts."""
    @property
    def convert_on(self) -> str:
        """``"prefill"`` (quantizing before the network) or ``"decode"`` (dequantizing after)."""
    @overload
    def plan(self, src_pages: Request, dst_pages: tuple[int, int], staging: None = None, *,
             dst_staging: tuple[int, int] | None = None) -> ConversionPlan: ...
    @overload
    def plan(self, src_pages: Request, dst_pages: None = None, *, staging: tuple[int, int],
             dst_staging: tuple[int, int] | None = None) -> ConversionPlan: ...
    @overload
    def plan(self, src_pages: _IndexArray, dst_pages: _IndexArray, staging: tuple[int, int], *,
             dst_staging: tuple[int, int] | None = None,
             n_tokens: int | None = None) -> ConversionPlan:
        """One request through the prefill staging region ``staging = (addr, size)`` (and the
        decode's ``dst_staging`` when the decode converts)."""

@final
class ConversionPlan:
    """A request as gather, convert rows, network and scatter (docs/api.md, "Conversion plans")."""

    @property
    def stages(self) -> tuple[_StageNames, ...]:
        """The plan's stages in the order they run, ``(kind, side, part, reads, writes)`` each
        (the convert rows before the network on the prefill, after it on the decode)."""
    @property
    def gather(self) -> tuple[_U64Array, _U64Array, _U64Array]: ...
    @property
    def network(self) -> tuple[_U64Array, _U64Array, _U64Array]: ...
    @property
    def scatter(self) -> tuple[_U64Array, _U64Array, _U64Array]: ...
    @property
    def in_addrs(self) -> _U64Array: ...
    @property
    def out_addrs(self) -> _U64Array: ...
    @property
    def n_elems(self) -> _U64Array: ...
    @property
    def in_dtypes(self) -> npt.NDArray[np.uint8]: ...
    @property
    def out_dtypes(self) -> npt.NDArray[np.uint8]: ...
    @property
    def group_elems(self) -> _U64Array: ...
    @property
    def scale_formats(self) -> npt.NDArray[np.uint8]: ...
    @property
    def scale_addrs(self) -> _U64Array: ...
    @property
    def scale_dst_addrs(self) -> _U64Array: ...
    @property
    def gathered_bytes(self) -> int: ...
    @property
    def converted_bytes(self) -> int: ...
    @property
    def scale_bytes(self) -> int: ...
    @property
    def staging_bytes(self) -> int: ...
    @property
    def dst_staging_bytes(self) -> int: ...
    @property
    def convert_on(self) -> str: ...
    @property
    def network_bytes(self) -> int: ...
    @property
    def direct_blocks(self) -> int: ...
    @property
    def n_rows(self) -> int: ...
    @property
    def n_blocks(self) -> tuple[int, int, int]: ...
    def content_digest(self, side: Literal["src", "dst"], buffers: Iterable[_Buffer]) -> int:
        """The network's content digest on ``side``: the converted staging (``"src"``) or the
        decode's memory (``"dst"``); equal exactly when every converted byte and scale landed."""

def copy_local(plan: TransferPlan, src_buffers: Iterable[_Buffer], dst_buffers: Iterable[_Buffer],
               *, threads: int | None = None) -> int:
    """Execute a local plan (a staged or pack plan's gather or scatter) on CPU memory.

    Copies every block from the source buffer holding it to the destination buffer holding it
    (buffers borrowed without a copy; the GIL is released). Returns the bytes copied. Nothing is
    copied when any check fails: every block is checked before the first byte moves.

    ``threads``: how many threads copy (``None``: the available cores up to 4, one for a plan
    under 1 MiB; never more than one per 256 KiB or per block). The destination buffers are cut
    at addresses no block straddles, one range per thread, so the bytes written are the same for
    every count, blocks sharing destination bytes included (the later block in plan order wins).

    Raises:
        IndexBoundsError: A block does not lie inside one of its side's buffers.
        KvPlanError: A destination buffer is read-only, or shares memory with another buffer
            or the plan's columns (``kind == "buffer_overlap"``), or ``threads`` is 0.
        OverflowError: ``threads`` is negative.
        TypeError: A buffer is not C-contiguous or has no buffer protocol.
    """

@final
class TpPeers:
    """One rank's view of the KV-head split between a prefill and a decode TP group."""

    @property
    def side(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def prefill_tp(self) -> int: ...
    @property
    def decode_tp(self) -> int: ...
    @property
    def heads(self) -> tuple[int, int]: ...
    @property
    def replicas(self) -> int: ...
    @property
    def peers(self) -> list[int]: ...
    @property
    def send_to(self) -> list[int]: ...
    @property
    def receive_from(self) -> list[int]: ...
    @property
    def is_sender(self) -> bool: ...
    def heads_with(self, peer: int) -> tuple[int, int] | None: ...
    def reason(self, peer: int) -> str | None: ...

def heads_per_rank(kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds with ``kv_heads`` model heads over ``tp_size`` ranks:
    ``max(1, kv_heads // tp_size)`` (a TP size of 0 counts as 1); what layouts default
    ``heads_per_rank`` to and what :func:`tp_peers` splits by."""

def staging_replicas_write(kv_heads: int, prefill_tp: int, decode_tp: int) -> bool:
    """Whether the prefill ranks writing one decode rank's staging region hold replicas of
    the same heads (prefill TP above the decode TP and the KV head count), so each writer fills
    its own share and a staged template plans every writer (``replicas_send=True``)."""

def tp_peers(
    kv_heads: int,
    prefill_tp: int,
    decode_tp: int,
    *,
    prefill_rank: int | None = None,
    decode_rank: int | None = None,
) -> TpPeers:
    """The peers of one prefill or decode rank (give exactly one of the two ranks).

    Raises:
        KvPlanError: A count is 0, neither of ``kv_heads`` and a TP size divides the other, or
            the rank is outside its TP size.
        TypeError: Both ranks or neither given.
    """

@final
class TransferCost:
    """What moving bytes costs on one engine, measured once per engine (see
    :func:`kvplan.engines.measure_cost`): seconds one engine block costs on top of its bytes,
    the engine's streaming bandwidth and the local copy bandwidth (bytes per second).

    Raises:
        KvPlanError: A value is not a finite number greater than 0 (``kind == "cost"``).
    """

    def __new__(cls, *, per_block_s: float, network_bytes_per_s: float,
                copy_bytes_per_s: float) -> TransferCost: ...
    @property
    def per_block_s(self) -> float: ...
    @property
    def network_bytes_per_s(self) -> float: ...
    @property
    def copy_bytes_per_s(self) -> float: ...
    def __getnewargs_ex__(self) -> tuple[tuple[()], dict[str, float]]: ...
    def __eq__(self, other: object, /) -> bool: ...

@final
class Advice:
    """Direct or staged for one request, and the estimates the choice rests on::

        direct_s = direct_blocks * per_block_s + bytes / network_bytes_per_s
        staged_s = copy_bytes / copy_bytes_per_s + staged_blocks * per_block_s
                   + bytes / network_bytes_per_s

    ``choice`` is the smaller estimate's path, ``"direct"`` on a tie."""

    @property
    def choice(self) -> Literal["direct", "staged"]: ...
    @property
    def direct_s(self) -> float: ...
    @property
    def staged_s(self) -> float: ...
    @property
    def direct_blocks(self) -> int:
        """Engine blocks of the direct plan."""
    @property
    def staged_blocks(self) -> int:
        """Engine blocks of the staged network plan."""
    @property
    def bytes(self) -> int:
        """Bytes over the network (the same on both paths)."""
    @property
    def copy_bytes(self) -> int:
        """Bytes the staged path copies locally (gather + scatter)."""

def advise(direct_blocks: int, staged_network_blocks: int, bytes: int, gather_bytes: int,
           scatter_bytes: int, cost: TransferCost) -> Advice:
    """Direct or staged for a request of these counts (the rule
    :meth:`Template.transfer_advice` applies to a request's own counts)."""

_Ranks = tuple[int, int, int, int]

@final
class LayerGroups:
    """Which layers stream together, keyed by global layer id, and which entries wait for the
    seal (draft and id-less entries and layers in no group always do; ``seal_layers`` /
    ``seal_roles`` add more, e.g. indexer caches no per-layer hook fires for). A layer's
    per-request state goes with its group, like its pages."""

    @staticmethod
    def every_layer(*, seal_layers: Sequence[int] | None = None,
                    seal_roles: Sequence[str] | None = None) -> LayerGroups: ...
    @staticmethod
    def fixed(size: int, *, seal_layers: Sequence[int] | None = None,
              seal_roles: Sequence[str] | None = None) -> LayerGroups:
        """Groups of ``size`` consecutive global layer ids (layer ``l`` in group ``l // size``).

        Raises:
            KvPlanError: ``size`` is 0.
        """
    @staticmethod
    def sets(sets: Sequence[Sequence[int]], *, seal_layers: Sequence[int] | None = None,
             seal_roles: Sequence[str] | None = None) -> LayerGroups:
        """The caller's disjoint sets of layer ids (group ``g`` is ``sets[g]``).

        Raises:
            KvPlanError: A layer id in two sets, or a negative id.
        """
    def group_of(self, layer: int) -> int | None: ...

@final
class LayerSlices:
    """A template's layer groups: per slice the layers it waits for; the rest is the seal."""

    @property
    def n_slices(self) -> int: ...
    @property
    def group_ids(self) -> list[int]: ...
    @property
    def layers(self) -> list[list[int]]: ...
    @property
    def seal_groups(self) -> list[int]: ...
    @property
    def peers(self) -> tuple[_Ranks, _Ranks]:
        """``(pp_rank, pp_size, tp_rank, tp_size)`` of the prefill and of the decode."""
    def slice_of_layer(self, layer: int) -> int | None:
        """The slice waiting for ``layer``; ``None`` for a model layer with nothing to wait for.

        ``None`` also for a layer in no caller set (its entries go with the seal) and a layer of
        another PP stage: the answer for a model layer does not depend on the stage asked.

        Raises:
            KvPlanError: A layer id no model layer has (negative, or past the model's layer
                count and in no caller set).
        """
    def of(self, plan: TransferPlan) -> PlanSlices:
        """Cut a plan of this template (page, token or state plan) into slices.

        Raises:
            KvPlanError: The plan comes from another template.
        """
    def of_batch(self, batch: BatchPlan) -> BatchSlices:
        """Cut a batch plan of this template into slices, segment by segment.

        Raises:
            KvPlanError: The batch comes from another template.
        """

@final
class BatchSlices:
    """A batch plan cut into slices: the engine calls that send some slices (or the seal) of
    every segment, each naming the requests whose blocks it holds."""

    @property
    def n_segments(self) -> int: ...
    @property
    def n_slices(self) -> int: ...
    def calls(self, slices: Sequence[int], *, max_blocks: int | None = None,
              skip_segments: Sequence[bool] | None = None
              ) -> list[tuple[npt.NDArray[np.int64], _I64Array]]:
        """Per call ``(ranges, requests)``: its ``(n, 2)`` ``[start, stop)`` block ranges in the
        batch and the requests they hold; at most ``max_blocks`` blocks per call, whole
        segments packed while they fit; segments flagged in ``skip_segments`` left out.

        Raises:
            KvPlanError: A slice index out of range, ``max_blocks`` not positive, or
                ``skip_segments`` of another length than the segments.
        """
    def seal_calls(self, *, max_blocks: int | None = None,
                   skip_segments: Sequence[bool] | None = None
                   ) -> list[tuple[npt.NDArray[np.int64], _I64Array]]:
        """The calls sending every segment's seal, as ``calls``."""
    def segment_parts(self, segment: int) -> tuple[list[int], bool]:
        """``(slices, seal)``: the slices segment ``segment`` has blocks in, and whether its
        seal has any."""

@final
class PlanSlices:
    """One plan cut into slices: block ranges (views of the plan) and work per slice and seal."""

    @property
    def n_slices(self) -> int: ...
    @property
    def ranges(self) -> list[list[tuple[int, int]]]: ...
    @property
    def work(self) -> list[tuple[int, int, int]]:
        """Per slice ``(group id, blocks, bytes)``."""
    @property
    def seal_ranges(self) -> list[tuple[int, int]]: ...
    @property
    def seal_work(self) -> tuple[int, int]: ...
    def manifest(self, request: int, state: PlanSlices | None = None) -> WorkManifest: ...

@final
class WorkManifest:
    """Expected work of one request from one prefill peer to one decode peer."""

    @property
    def request(self) -> int: ...
    @property
    def prefill(self) -> _Ranks: ...
    @property
    def decode(self) -> _Ranks: ...
    @property
    def slices(self) -> list[tuple[int, int, int]]: ...
    @property
    def seal(self) -> tuple[int, int]: ...
    @property
    def total_blocks(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> WorkManifest:
        """Raises:
            KvPlanError: Not a manifest, an unknown version, a wrong length or CRC.
        """
    def __eq__(self, value: object, /) -> bool: ...

@final
class MooncakeNative:
    """Mooncake's native batch API behind one initialised ``mooncake.engine.TransferEngine``."""

    VERIFIED_VERSION: ClassVar[str]
    def __new__(cls, engine: object, module_path: str, version: str) -> MooncakeNative: ...
    def write(self, peer: str, src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64],
              lengths: npt.NDArray[np.uint64], timeout_s: float) -> None: ...
    def submit(self, peer: str, src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64],
               lengths: npt.NDArray[np.uint64]) -> MooncakeBatch: ...

@final
class MooncakeBatch:
    """One submitted native batch; wait exactly once."""

    def __len__(self) -> int: ...
    def wait(self, timeout_s: float) -> None: ...

@final
class LayoutIdentity:
    """A layout's address-free identity with the caller's model semantics (docs/identity.md);
    build it with :func:`kvplan.layout_identity`. Equal when the layout ids are equal."""

    @property
    def class_id(self) -> str:
        """``kvc1-`` + 52 base32 characters: the same on every TP, PP and DCP rank of a
        deployment (what a router matches and ``kvplan:layout_info`` exports)."""
    @property
    def layout_id(self) -> str:
        """``kvl1-`` + 52 base32 characters: one rank's exact layout (an offload store's key)."""
    def class_encoding(self) -> bytes:
        """The canonical encoding whose SHA-256 the class id is."""
    @property
    def layout(self) -> Layout: ...
    @property
    def model(self) -> str: ...
    @property
    def revision(self) -> str: ...
    @property
    def rope(self) -> str: ...
    @property
    def drafts(self) -> list[str]: ...
    @property
    def transfer(self) -> str: ...
    @property
    def cross_layer(self) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Verdict:
    """A compatibility verdict: ``kind``, the ``reason`` naming both values, and what refused.
    True when plannable."""

    @property
    def kind(self) -> Literal["plannable", "plannable_with_conversion", "refused"]: ...
    @property
    def reason(self) -> str: ...
    @property
    def refused_by(self) -> str | None:
        """``"semantics"`` or the planner error's ``kind``; ``None`` when plannable."""
    @property
    def plannable(self) -> bool: ...
    def __bool__(self) -> bool: ...

def layout_identity(layout: Layout, *, model: str, revision: str, rope: str, drafts: Sequence[str],
                    transfer: str, cross_layer: bool) -> LayoutIdentity:
    """The identity of ``layout`` with these semantics (use :func:`kvplan.layout_identity`).

    Raises:
        LayoutError: ``transfer`` is neither ``"push"`` nor ``"pull"``.
    """

_ManifestComponent = tuple[str, str, Sequence[int], int, int, str, int, int | None, int | None]

def check_manifest(
    layout: Layout, *, model: str, num_layers: int,
    components: Sequence[_ManifestComponent],
    fusions: Sequence[tuple[str, Sequence[str]]] = ...,
    stage: tuple[int, int] | None = None,
) -> None:
    """A model's manifest against ``layout``, each fusion ``(role, parts)`` in the form the
    layout holds it (use :func:`kvplan.check_manifest`).

    Raises:
        ManifestError: Every problem found, a malformed manifest, or a fusion the layout holds
            whose parts cannot merge.
        LayoutError: A component kind other than ``"page"`` or ``"state"``.
    """

def pack_manifest(
    *, model: str, num_layers: int, components: Sequence[_ManifestComponent], role: str,
    parts: Sequence[str],
) -> list[int | tuple[str, str, list[int], int, int, str, int, int | None, int | None]]:
    """The components with ``parts`` held as one entry of role ``role`` per layer: per
    component, the index of one kept as it is or a merged one (use
    :meth:`kvplan.manifests.ModelManifest.packed`).

    Raises:
        ManifestError: Parts that cannot merge, naming the roles, layers and fields.
        LayoutError: A component kind other than ``"page"`` or ``"state"``.
    """

def compatibility(prefill: LayoutIdentity, decode: LayoutIdentity, pairing: Pairing | None = None,
                  *, replicas_send: bool = False) -> Verdict:
    """The verdict on ``prefill`` sending to ``decode`` (use :func:`kvplan.compatibility`)."""
