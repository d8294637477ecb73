//! `Template`'s methods, the Python surface of a compiled peer pair: each hands its work to the
//! module of that job (`compile`, which holds the value and builds it, `one_request`, `batch`,
//! `pack`, `staged`, `advice`, `slots`, `coalescing`, `block_counts`, `descriptors`, `slices`).

use std::sync::Arc;

use numpy::PyArray2;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::compile::PyTemplate;
use crate::layout::PyLayout;
use crate::plan::PyTransferPlan;

#[pymethods]
impl PyTemplate {
    #[new]
    #[pyo3(signature = (src_layout, dst_layout, pairing=None, *, check_dst_overlap=false, fragments=None, coalesce=true, layer_groups=None, replicas_send=false, **removed_keywords))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        src_layout: PyRef<'_, PyLayout>,
        dst_layout: PyRef<'_, PyLayout>,
        pairing: Option<&Bound<'_, PyAny>>,
        check_dst_overlap: bool,
        fragments: Option<&Bound<'_, PyAny>>,
        coalesce: bool,
        layer_groups: Option<PyRef<'_, crate::slices::PyLayerGroups>>,
        replicas_send: bool,
        removed_keywords: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        Self::from_arguments(
            &src_layout,
            &dst_layout,
            pairing,
            removed_keywords,
            check_dst_overlap,
            replicas_send,
            fragments,
            coalesce,
            layer_groups.as_deref(),
        )
    }

    /// `(n_pairs, 2)` int64: (src entry, dst entry) of every page-entry pair, in planning order.
    #[getter]
    fn pairs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        crate::pair_tables::entry_pairs(py, self.inner.page_pairs())
    }

    /// `(n_state_pairs, 2)` int64: (src entry, dst entry) of every state-entry pair.
    #[getter]
    fn state_pairs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        crate::pair_tables::entry_pairs(py, self.inner.state_pairs())
    }

    /// Per page pair, the core's coalescing (`kvplan_core::coalescing`): `(kind, side,
    /// per_page)` with kind `joined`, `first`, `elided`, `by_token`, `fragments`, `strides`,
    /// `apart`, `beyond_stride` or `options`, the side (`src`/`dst`) for the last three, and
    /// whether the pair's blocks end at every page.
    #[getter]
    fn coalescing(&self) -> Vec<crate::coalescing::CoalescingRow> {
        crate::coalescing::coalescing_rows(&self.inner)
    }

    /// Per page pair: whether it emits blocks (item length > 0 and, between TP sizes, heads to
    /// move).
    #[getter]
    fn emitting<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        crate::coalescing::emitting(py, &self.inner)
    }

    /// Page-entry pairs (including elided pairs with item length 0).
    #[getter]
    fn n_pairs(&self) -> usize {
        self.inner.page_pairs().len()
    }

    /// Why this template moves no page bytes although it pairs entries (between TP sizes: no
    /// head of the decode rank's here, or not its elected sender); None when it moves pages.
    #[getter]
    fn empty_reason(&self) -> Option<String> {
        self.inner.empty_reason()
    }

    /// Item length of every page-entry pair (the prefill side's).
    #[getter]
    fn pair_item_lens(&self) -> Vec<u64> {
        self.inner.page_pairs().iter().map(|p| p.item_len).collect()
    }

    /// Blocks of a token plan of `n_tokens` tokens, without planning it: pages consecutive on
    /// both sides, or (`fragmented=True`) no two pages consecutive on either side.
    #[pyo3(signature = (n_tokens, *, fragmented=false))]
    fn n_token_blocks(&self, n_tokens: u64, fragmented: bool) -> PyResult<usize> {
        crate::block_counts::token_blocks(&self.inner, n_tokens, fragmented)
    }

    /// `(direct, gather, network)` blocks of a token plan of `n_tokens` tokens planned directly
    /// and through a pack buffer (as `plan_packed`), without planning the caller's request:
    /// pages consecutive on both sides, or (`fragmented=True`) no two pages consecutive.
    #[pyo3(signature = (n_tokens, *, fragmented=false))]
    fn packed_block_counts(
        &self,
        n_tokens: u64,
        fragmented: bool,
    ) -> PyResult<(usize, usize, usize)> {
        crate::block_counts::packed_counts(&self.inner, n_tokens, fragmented)
    }

    /// Whether every page plan is a token plan (page sizes or memory orders differ).
    #[getter]
    fn by_token(&self) -> bool {
        self.inner.by_token()
    }

    /// Tokens per page of the prefill and decode layouts.
    #[getter]
    fn page_sizes(&self) -> (u64, u64) {
        self.inner.page_sizes()
    }

    /// Bytes moved per page index pair.
    #[getter]
    fn bytes_per_page(&self) -> u64 {
        self.inner.bytes_per_page()
    }

    /// `(src stride, dst stride)` of every page-entry pair.
    #[getter]
    fn pair_strides(&self) -> Vec<(u64, u64)> {
        let pairs = self.inner.page_pairs().iter();
        pairs.map(|p| (p.src_stride, p.dst_stride)).collect()
    }

    /// Emission groups: one per emitting pair, fewer when pairs were coalesced.
    #[getter]
    fn n_groups(&self) -> usize {
        self.inner.blocks().groups().len()
    }

    /// The group of each page pair (int64; -1 for an elided pair).
    #[getter]
    fn pair_groups<'py>(&self, py: Python<'py>) -> Bound<'py, numpy::PyArray1<i64>> {
        crate::coalescing::pair_groups(py, &self.inner)
    }

    /// Blocks of a request of `n_pages` index pairs in `n_runs` runs (runs contiguous on both
    /// sides), or of a `kvplan.Request` in `n_pages`, without planning it.
    #[pyo3(signature = (n_pages, n_runs=None))]
    fn n_blocks_for(&self, n_pages: &Bound<'_, PyAny>, n_runs: Option<usize>) -> PyResult<usize> {
        crate::block_counts::blocks_for(&self.inner, n_pages, n_runs)
    }

    /// Plans the blocks that copy page `src_pages[i]` to `dst_pages[i]` for every entry pair.
    ///
    /// `src_pages`, `dst_pages`: equally long 1-D, C-contiguous, aligned int32/int64 NumPy
    /// arrays (borrowed, not copied; the GIL is released while planning). Without `out`, the
    /// plan's columns view one pooled buffer; with `out` (a C-contiguous `(3, M)` uint64 array
    /// not overlapping the inputs) they are views of its rows.
    ///
    /// Token plans: when the two layouts have different page sizes, or `n_tokens` is given, the
    /// arrays are each side's pages in token order (lengths may differ) and the plan moves the
    /// first `n_tokens` tokens (default: the full pages of the shorter side) token-exactly.
    ///
    /// Delta plans: with `skip_tokens` K > 0 (any count) the decode holds the first K tokens;
    /// the plan moves tokens K.. only, by token, from the same whole page lists (pages before
    /// the one holding token K are not read). The plan digest covers K.
    ///
    /// `window_pages=(src, dst)`: each side's window-pool pages in token order. `plan(request)`
    /// takes all of it as one `kvplan.Request`, as every planner method below does.
    #[pyo3(signature = (src_pages, dst_pages=None, *, n_tokens=None, skip_tokens=0, window_pages=None, out=None))]
    #[allow(clippy::too_many_arguments)]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: Option<&Bound<'py, PyAny>>,
        n_tokens: Option<u64>,
        skip_tokens: u64,
        window_pages: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyTransferPlan>> {
        crate::one_request::plan_one(
            py,
            &self.inner,
            self.fingerprints,
            src_pages,
            dst_pages,
            n_tokens,
            skip_tokens,
            window_pages,
            out,
        )
    }

    /// Plans many requests to this peer as one plan (`BatchPlan`): `requests` is a sequence of
    /// `(src_pages, dst_pages)` or `(src_pages, dst_pages, n_tokens)` tuples, each planned as
    /// `plan` would plan it; requests whose pages touch on both sides share merged blocks.
    /// `digests=True` also computes each request's plan digest as planned alone; `leases` (one
    /// `kvplan.Lease` or `None` per request) binds each request's digest to its lease, as
    /// `TransferPlan.digest(lease=)` binds a plan's (and implies `digests=True`).
    #[pyo3(signature = (requests, *, digests=false, leases=None))]
    fn plan_batch(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        digests: bool,
        leases: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<crate::batch::PyBatchPlan>> {
        crate::batch::plan_batch(
            py,
            &self.inner,
            self.fingerprints,
            requests,
            digests,
            leases,
        )
    }

    /// Plans a batch given flat (`BatchPlan`, the same as `plan_batch` of the same requests):
    /// every request's pages concatenated in `src_pages` and in `dst_pages` (1-D int32 or
    /// int64), and `offsets`, `n_requests + 1` int64 values: request `r` moves
    /// `src_pages[offsets[r]:offsets[r + 1]]` to the same slice of `dst_pages`, or to
    /// `dst_pages[dst_offsets[r]:dst_offsets[r + 1]]` when `dst_offsets` is given (token
    /// requests between different page sizes). `n_tokens`, an int64 array of one count per
    /// request, makes each a token request. No Python object per request is read.
    #[pyo3(signature = (src_pages, dst_pages, offsets, *, dst_offsets=None, n_tokens=None, digests=false, leases=None))]
    #[allow(clippy::too_many_arguments)]
    fn plan_batch_flat(
        &self,
        py: Python<'_>,
        src_pages: &Bound<'_, PyAny>,
        dst_pages: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        dst_offsets: Option<&Bound<'_, PyAny>>,
        n_tokens: Option<&Bound<'_, PyAny>>,
        digests: bool,
        leases: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<crate::batch::PyBatchPlan>> {
        crate::batch::plan_batch_flat(
            py,
            &self.inner,
            self.fingerprints,
            src_pages,
            dst_pages,
            offsets,
            dst_offsets,
            n_tokens,
            digests,
            leases,
        )
    }

    /// Plans one request (as `plan`) split in two around a pack buffer `pack = (addr, size)` of
    /// prefill memory: `(gather, network)`, the gather from prefill memory into the buffer
    /// (executed by the caller) and the network plan from the buffer to the decode, one block
    /// per destination-contiguous run. A `SizeMismatchError` names the bytes needed when the
    /// buffer is too small.
    #[pyo3(signature = (src_pages, dst_pages=None, *, pack, n_tokens=None))]
    fn plan_packed<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::input::pack_arg)] pack: (u64, u64),
        n_tokens: Option<u64>,
    ) -> PyResult<(Py<PyTransferPlan>, Py<PyTransferPlan>)> {
        crate::pack::plan_packed(
            py,
            &self.inner,
            self.fingerprints,
            src_pages,
            dst_pages,
            pack,
            n_tokens,
        )
    }

    /// Plans one token request as `plan_packed`'s network plan and a gather of source rows
    /// into the pack buffer at `pack=(addr, size)` (what its gather copies, as rows). A
    /// `SizeMismatchError` names the bytes needed when the buffer is too small; a page request
    /// (no `n_tokens` on a template that plans by page) is a `KvPlanError`.
    #[pyo3(signature = (src_pages, dst_pages=None, *, pack, n_tokens=None))]
    fn plan_row_gather<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::input::pack_arg)] pack: (u64, u64),
        n_tokens: Option<u64>,
    ) -> PyResult<(crate::pack::PyRowGather, Py<PyTransferPlan>)> {
        crate::pack::plan_row_gather(
            py,
            &self.inner,
            self.fingerprints,
            src_pages,
            dst_pages,
            pack,
            n_tokens,
        )
    }

    /// Plans one request (as `plan`) as a staged plan: `gather` from prefill memory into
    /// `src_staging = (addr, size)` (prefill memory), `network` from there into `dst_staging =
    /// (addr, size)` (the decode's staging region, at this writer's offsets) and `scatter` from
    /// there into the decode's pages. A `SizeMismatchError` names the bytes needed when a region
    /// is too small.
    #[pyo3(signature = (src_pages, dst_pages=None, *, src_staging, dst_staging, n_tokens=None))]
    fn plan_staged(
        &self,
        py: Python<'_>,
        src_pages: &Bound<'_, PyAny>,
        dst_pages: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = crate::input::src_staging_arg)] src_staging: (u64, u64),
        #[pyo3(from_py_with = crate::input::dst_staging_arg)] dst_staging: (u64, u64),
        n_tokens: Option<u64>,
    ) -> PyResult<crate::staged::PyStagedPlan> {
        crate::staged::plan_staged(
            py,
            &self.inner,
            self.fingerprints,
            src_pages,
            dst_pages,
            src_staging,
            dst_staging,
            n_tokens,
        )
    }

    /// Plans one request (as `plan`) as a staged plan in rounds through bounded arenas:
    /// `src_arena = (addr, size)` (prefill memory) and `dst_arena = (addr, size)` (decode
    /// memory), each split into `buffers` round buffers (the decode's per sender); round `k`
    /// gathers into prefill buffer `k % buffers`, sends it to decode buffer `k % buffers` and
    /// scatters from there. The staging memory used never exceeds the arenas.
    #[pyo3(signature = (src_pages, dst_pages=None, *, src_arena, dst_arena, buffers=kvplan_core::DEFAULT_BUFFERS, n_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn plan_rounds(
        &self,
        py: Python<'_>,
        src_pages: &Bound<'_, PyAny>,
        dst_pages: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = crate::input::src_arena_arg)] src_arena: (u64, u64),
        #[pyo3(from_py_with = crate::input::dst_arena_arg)] dst_arena: (u64, u64),
        buffers: u32,
        n_tokens: Option<u64>,
    ) -> PyResult<crate::rounds::PyStagedRounds> {
        crate::rounds::plan_rounds(
            py,
            &self.inner,
            self.fingerprints,
            src_pages,
            dst_pages,
            (src_arena, dst_arena),
            buffers,
            n_tokens,
        )
    }

    /// Direct or staged for one request (taken as `plan` takes it) on an engine of `cost`: the
    /// core's rule over the request's direct and staged network block counts.
    #[pyo3(signature = (src_pages, dst_pages=None, cost=None, *, n_tokens=None))]
    fn transfer_advice(
        &self,
        py: Python<'_>,
        src_pages: &Bound<'_, PyAny>,
        dst_pages: Option<&Bound<'_, PyAny>>,
        cost: Option<&Bound<'_, PyAny>>,
        n_tokens: Option<u64>,
    ) -> PyResult<crate::advice::PyAdvice> {
        crate::advice::transfer_advice(py, &self.inner, src_pages, dst_pages, cost, n_tokens)
    }

    /// This template's layer slices for `groups` (built once; cut plans with `.of(plan)`).
    /// A `KvPlanError` when a coalesced block holds layers of two groups: build the template
    /// with `layer_groups=groups`.
    fn layer_slices(
        &self,
        groups: PyRef<'_, crate::slices::PyLayerGroups>,
    ) -> PyResult<crate::slices::PyLayerSlices> {
        crate::slices::PyLayerSlices::build(Arc::clone(&self.inner), &groups)
    }

    /// One side's prepped descriptor table, `(addrs, lens)` uint64: page `k` of emission piece
    /// `j` at `j * pages + k`, then every slot of each moving state pair (docs/api.md).
    fn descriptor_table<'py>(
        &self,
        py: Python<'py>,
        side: &str,
    ) -> PyResult<crate::descriptors::TableArrays<'py>> {
        crate::descriptors::descriptor_table(py, &self.inner, side)
    }

    /// `descriptor_table(side)` unexpanded: `(n, 4)` uint64 runs `(base, len, stride, count)`,
    /// one per emission piece, then one per moving state pair.
    fn descriptor_runs<'py>(
        &self,
        py: Python<'py>,
        side: &str,
    ) -> PyResult<Bound<'py, numpy::PyArray2<u64>>> {
        crate::descriptors::descriptor_runs(py, &self.inner, side)
    }

    /// A page request as int64 indices into the two prepped tables, validated as `plan`.
    #[pyo3(signature = (src_pages, dst_pages=None))]
    fn prepped_indices<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<crate::descriptors::IndexArrays<'py>> {
        crate::descriptors::prepped_indices(py, &self.inner, src_pages, dst_pages)
    }

    /// State slot `src_slot` -> `dst_slot` as int64 indices into the two prepped tables.
    #[pyo3(signature = (src_slot, dst_slot=None))]
    fn prepped_state_indices<'py>(
        &self,
        py: Python<'py>,
        src_slot: &Bound<'py, PyAny>,
        dst_slot: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<crate::descriptors::IndexArrays<'py>> {
        crate::descriptors::prepped_state_indices(py, &self.inner, src_slot, dst_slot)
    }

    /// The live rows of every ring-state pair for slot `src_slot` -> `dst_slot` after
    /// `n_positions` positions, one block range per ring pair (or a slot `kvplan.Request`).
    #[pyo3(signature = (src_slot, dst_slot=None, n_positions=None))]
    fn plan_ring<'py>(
        &self,
        py: Python<'py>,
        src_slot: &Bound<'py, PyAny>,
        dst_slot: Option<&Bound<'py, PyAny>>,
        n_positions: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyTransferPlan>> {
        let (inner, fingerprints) = (&self.inner, self.fingerprints);
        crate::slots::plan_ring(py, inner, fingerprints, src_slot, dst_slot, n_positions)
    }

    /// Plans one request's state slot: one block per state pair (elided pairs emit nothing),
    /// `(src_base + L*src_slot, dst_base + L*dst_slot, L)`.
    #[pyo3(signature = (src_slot, dst_slot=None))]
    fn plan_state<'py>(
        &self,
        py: Python<'py>,
        src_slot: &Bound<'py, PyAny>,
        dst_slot: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyTransferPlan>> {
        crate::slots::plan_state(py, &self.inner, self.fingerprints, src_slot, dst_slot)
    }
}
