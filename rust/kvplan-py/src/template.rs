//! `Template`: a compiled peer pair, planned per request. The GIL is released around every
//! pass over index arrays; plans come back as NumPy columns viewing a pooled Rust buffer or the
//! caller's `out=` array.

use std::sync::Arc;

use kvplan_core::{
    BlockRequest, Columns, FlatBuffer, GeometryOptions, PageIndex, PlanSummary, Template,
};
use numpy::{PyArray2, PyArrayMethods, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::{IndexVisitor, RequestArrays, pairs_array, visit_request};
use crate::errors::{KvPlanError, to_py_err};
use crate::layout::PyLayout;
use crate::options::{fragments_arg, template_options};
use crate::plan::{Column, PyTransferPlan, out_columns, pooled_columns};
use crate::pool;

/// `(kind, src_entry, dst_entry or None, exception or None)`: the exception is the one
/// `Template(...)` would raise for this entry, built by the one mapping in `errors.rs`.
type EntryCheckRow = (&'static str, usize, Option<usize>, Option<Py<PyAny>>);

/// One row per source entry, page entries first: its partner or why it has none.
/// `Template(...)` raises exactly the first problem listed here.
#[pyfunction]
#[pyo3(signature = (src_layout, dst_layout, pairing=None, *, allow_positional_fallback=None, prefill_start_layer=None, legacy_kind=None, replicas_send=false))]
#[allow(clippy::too_many_arguments)]
pub fn check_pairs(
    py: Python<'_>,
    src_layout: PyRef<'_, PyLayout>,
    dst_layout: PyRef<'_, PyLayout>,
    pairing: Option<&Bound<'_, PyAny>>,
    allow_positional_fallback: Option<bool>,
    prefill_start_layer: Option<usize>,
    legacy_kind: Option<&str>,
    replicas_send: bool,
) -> PyResult<Vec<EntryCheckRow>> {
    let options = template_options(
        pairing,
        allow_positional_fallback,
        prefill_start_layer,
        legacy_kind,
        false,
        replicas_send,
    )?;
    let checks = kvplan_core::check_pairs(&src_layout.inner, &dst_layout.inner, options);
    Ok(checks
        .into_iter()
        .map(|c| {
            let exception = c.problem.map(|p| to_py_err(p).into_value(py).into_any());
            (c.kind.as_str(), c.src_entry, c.dst_entry, exception)
        })
        .collect())
}

/// Whether every plan between these layouts is a token plan (different page sizes or memory
/// orders): the core's rule, for callers that describe a pair before building its template.
#[pyfunction]
pub fn needs_tokens(src_layout: PyRef<'_, PyLayout>, dst_layout: PyRef<'_, PyLayout>) -> bool {
    kvplan_core::needs_tokens(&src_layout.inner, &dst_layout.inner)
}

/// A small core plan's three columns moved into NumPy arrays (the plan keeps its counts and
/// offsets; its columns are left empty).
fn owned_columns(py: Python<'_>, plan: &mut kvplan_core::Plan) -> [Column; 3] {
    [
        std::mem::take(&mut plan.src_addrs),
        std::mem::take(&mut plan.dst_addrs),
        std::mem::take(&mut plan.lengths),
    ]
    .map(|column| numpy::PyArray1::from_vec(py, column).unbind())
}

/// Borrows `out` for writing: a `TypeError` for a wrong type, dtype, shape or memory order
/// (input shape), a `KvPlanError` for a read-only array or one whose memory overlaps an input
/// (never a panic).
fn writable_out<'py>(
    out: &Bound<'py, PyAny>,
    inputs: &RequestArrays<'_>,
) -> PyResult<PyReadwriteArray2<'py, u64>> {
    let array = out.cast::<PyArray2<u64>>().map_err(|_| {
        PyTypeError::new_err("out must be a 2-D numpy array of dtype uint64 with shape (3, M)")
    })?;
    // A Fortran-ordered array would have a slice view too, with the rows scrambled.
    if !array.is_c_contiguous() || array.shape()[0] != 3 {
        return Err(PyTypeError::new_err(format!(
            "out must be a C-contiguous (3, M) uint64 array, got shape {:?}",
            array.shape()
        )));
    }
    // NumPy's borrow tracking only sees aliasing through a shared base object; two views of
    // one buffer made separately (np.frombuffer twice) have different bases. Compare the
    // address ranges themselves.
    let start = array.data() as usize;
    let out_range = (start, start + array.len() * 8);
    for (input, name) in inputs.named() {
        let range = input.byte_range();
        let overlaps = range.0 < range.1
            && out_range.0 < out_range.1
            && range.0 < out_range.1
            && out_range.0 < range.1;
        if overlaps {
            return Err(KvPlanError::new_err(format!(
                "out overlaps {name} in memory (out is bytes {:#x}..{:#x}, {name} is bytes \
                 {:#x}..{:#x}): planning would overwrite its own input; pass a separate out array",
                out_range.0, out_range.1, range.0, range.1
            )));
        }
    }
    array.try_readwrite().map_err(|err| {
        KvPlanError::new_err(format!(
            "out cannot be written: {err} (read-only, or it shares memory with an input)"
        ))
    })
}

/// A validated peer pair (prefill layout → decode layout), built once, planned per request.
#[pyclass(frozen, name = "Template", module = "kvplan._core")]
pub struct PyTemplate {
    /// Shared with every plan, which asks it for its block offsets.
    inner: Arc<Template>,
    /// The core's fingerprints of the (prefill, decode) layouts, for plan digests (`None` when
    /// a layout has no wire encoding).
    fingerprints: Option<(u64, u64)>,
}

/// Output columns for a plan of this shape, from the pool (warm memory when a plan of similar
/// size has died since).
fn pooled(shape: &kvplan_core::PlanShape) -> kvplan_core::Result<FlatBuffer> {
    Ok(FlatBuffer {
        data: pool::take(shape.n_blocks.saturating_mul(3))?,
        capacity: shape.n_blocks,
    })
}

/// One request (`n_tokens` as given) planned into a pooled buffer; the core decides between a
/// page and a token plan.
struct PlanPooled<'t>(&'t Template, Option<u64>);

impl IndexVisitor for PlanPooled<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, PlanSummary)>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        self.0.plan_into(src, dst, self.1, pooled)
    }
}

/// The same into the caller's `out=` columns.
struct PlanInto<'t, 'o>(&'t Template, Option<u64>, Columns<'o>);

impl IndexVisitor for PlanInto<'_, '_> {
    type Output = kvplan_core::Result<PlanSummary>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        let columns = self.2;
        self.0
            .plan_into(src, dst, self.1, move |_| Ok(columns))
            .map(|(_, summary)| summary)
    }
}

/// One request planned and split around a pack buffer.
struct PlanPacked<'t>(&'t Template, Option<u64>, kvplan_core::PackBuffer);

impl IndexVisitor for PlanPacked<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, kvplan_core::PackedSummary)>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        self.0.plan_packed_into(src, dst, self.1, self.2, pooled)
    }
}

/// One request planned as a row gather and a network plan.
struct PlanRowGather<'t>(&'t Template, Option<u64>, kvplan_core::PackBuffer);

impl IndexVisitor for PlanRowGather<'_> {
    type Output = kvplan_core::Result<(kvplan_core::RowGather, kvplan_core::Plan)>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        self.0.plan_row_gather(src, dst, self.1, self.2)
    }
}

/// The gather of a pack plan as source rows (`Template.plan_row_gather`): what a gather kernel
/// takes instead of one block per row.
#[pyclass(name = "RowGather", module = "kvplan._core", frozen)]
pub struct PyRowGather {
    rows: Vec<Py<numpy::PyArray1<u64>>>,
    copies: Py<PyArray2<u64>>,
    pack_bytes: u64,
}

#[pymethods]
impl PyRowGather {
    /// Per token lane (0: target tokens, 1: draft tokens sent whole), the source row of every
    /// token moved, in token order (`row = source page index * rows_per_page + slot`), uint64.
    #[getter]
    fn rows(&self, py: Python<'_>) -> Vec<Py<numpy::PyArray1<u64>>> {
        self.rows.iter().map(|r| r.clone_ref(py)).collect()
    }

    /// One row per copy (piece), uint64 columns `lane, src_base, page_stride, row_stride,
    /// rows_per_page, len, pack_addr`: row `r = rows[lane][k]` copies `len` bytes from
    /// `src_base + (r // rows_per_page) * page_stride + (r % rows_per_page) * row_stride` to
    /// `pack_addr + k * len`.
    #[getter]
    fn copies(&self, py: Python<'_>) -> Py<PyArray2<u64>> {
        self.copies.clone_ref(py)
    }

    /// Bytes of the pack buffer used, from its start.
    #[getter]
    fn pack_bytes(&self) -> u64 {
        self.pack_bytes
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let rows: usize = self.rows.iter().map(|r| r.bind(py).len()).sum();
        format!(
            "RowGather(copies={}, rows={rows}, pack_bytes={})",
            self.copies.bind(py).shape()[0],
            self.pack_bytes
        )
    }
}

/// One request planned as a staged plan between two staging regions.
struct PlanStaged<'t>(
    &'t Template,
    Option<u64>,
    kvplan_core::StagingRegion,
    kvplan_core::StagingRegion,
);

impl IndexVisitor for PlanStaged<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, FlatBuffer, kvplan_core::StagedSummary)>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        self.0
            .plan_staged_into(src, dst, self.1, self.2, self.3, |shape| {
                Ok((pooled(shape)?, pooled(shape)?))
            })
    }
}

/// One request's direct-or-staged advice.
struct TransferAdvice<'t>(&'t Template, Option<u64>, kvplan_core::TransferCost);

impl IndexVisitor for TransferAdvice<'_> {
    type Output = kvplan_core::Result<kvplan_core::Advice>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        self.0.transfer_advice(src, dst, self.1, &self.2)
    }
}

#[pymethods]
impl PyTemplate {
    #[new]
    #[pyo3(signature = (src_layout, dst_layout, pairing=None, *, allow_positional_fallback=None, prefill_start_layer=None, legacy_kind=None, check_dst_overlap=false, fragments=None, coalesce=true, layer_groups=None, replicas_send=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        src_layout: PyRef<'_, PyLayout>,
        dst_layout: PyRef<'_, PyLayout>,
        pairing: Option<&Bound<'_, PyAny>>,
        allow_positional_fallback: Option<bool>,
        prefill_start_layer: Option<usize>,
        legacy_kind: Option<&str>,
        check_dst_overlap: bool,
        fragments: Option<&Bound<'_, PyAny>>,
        coalesce: bool,
        layer_groups: Option<PyRef<'_, crate::slices::PyLayerGroups>>,
        replicas_send: bool,
    ) -> PyResult<Self> {
        let options = template_options(
            pairing,
            allow_positional_fallback,
            prefill_start_layer,
            legacy_kind,
            check_dst_overlap,
            replicas_send,
        )?;
        let geometry = GeometryOptions {
            fragments: fragments_arg(fragments)?,
            coalesce,
        };
        let (src, dst) = (&src_layout.inner, &dst_layout.inner);
        let inner = match &layer_groups {
            Some(groups) => {
                Template::with_layer_groups(src, dst, options, &geometry, &groups.inner)
            }
            None => Template::with_geometry(src, dst, options, &geometry),
        }
        .map_err(to_py_err)?;
        let fingerprint = |layout: &PyLayout| kvplan_core::layout_fingerprint(&layout.inner).ok();
        let fingerprints = fingerprint(&src_layout).zip(fingerprint(&dst_layout));
        Ok(Self {
            inner: Arc::new(inner),
            fingerprints,
        })
    }

    /// `(n_pairs, 2)` int64: (src entry, dst entry) of every page-entry pair, in planning order.
    #[getter]
    fn pairs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        pairs_array(
            py,
            self.inner
                .page_pairs()
                .iter()
                .map(|p| [p.src_entry, p.dst_entry]),
        )
    }

    /// `(n_state_pairs, 2)` int64: (src entry, dst entry) of every state-entry pair.
    #[getter]
    fn state_pairs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        pairs_array(
            py,
            self.inner
                .state_pairs()
                .iter()
                .map(|p| [p.src_entry, p.dst_entry]),
        )
    }

    /// Per page pair: whether it emits blocks (item length > 0 and, between TP sizes, heads to
    /// move).
    #[getter]
    fn emitting<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.pair_groups().iter().map(Option::is_some))
    }

    /// Page-entry pairs (including elided pairs with item length 0).
    #[getter]
    fn n_pairs(&self) -> usize {
        self.inner.page_pairs().len()
    }

    /// Why this template moves no page bytes although it pairs entries (between different TP
    /// sizes: the prefill rank holds none of the decode rank's heads, or is not their elected
    /// sender); None when it moves pages.
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
        let request = BlockRequest::Tokens {
            n_tokens,
            fragmented,
        };
        self.inner.count_blocks(request).map_err(to_py_err)
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
        let c = self
            .inner
            .packed_block_counts(n_tokens, fragmented)
            .map_err(to_py_err)?;
        Ok((c.direct, c.gather, c.network))
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
        self.inner.groups().len()
    }

    /// The group of each page pair (int64; -1 for an elided pair).
    #[getter]
    fn pair_groups<'py>(&self, py: Python<'py>) -> Bound<'py, numpy::PyArray1<i64>> {
        let groups = self.inner.pair_groups().iter();
        numpy::IntoPyArray::into_pyarray(
            groups
                .map(|g| g.map_or(-1, |g| g as i64))
                .collect::<Vec<_>>(),
            py,
        )
    }

    /// Blocks of a request of `n_pages` index pairs in `n_runs` runs (runs contiguous on both
    /// sides), without planning it.
    #[pyo3(signature = (n_pages, n_runs=1))]
    fn n_blocks_for(&self, n_pages: usize, n_runs: usize) -> PyResult<usize> {
        let request = BlockRequest::Pages {
            pages: n_pages,
            runs: n_runs,
        };
        self.inner.count_blocks(request).map_err(to_py_err)
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
    #[pyo3(signature = (src_pages, dst_pages, *, n_tokens=None, out=None))]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: &Bound<'py, PyAny>,
        n_tokens: Option<u64>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<PyTransferPlan> {
        let arrays = RequestArrays::extract(src_pages, dst_pages, ("src_pages", "dst_pages"))?;
        let (src, dst) = arrays.slices()?;
        let template: &Template = &self.inner;
        let (columns, summary) = if let Some(out) = out {
            let mut writable = writable_out(out, &arrays)?;
            let capacity = writable.shape()[1];
            let flat = writable.as_slice_mut()?;
            let summary = visit_request(
                py,
                src,
                dst,
                PlanInto(template, n_tokens, Columns::from_flat(flat, capacity)),
            )
            .map_err(to_py_err)?;
            drop(writable);
            let out = out.cast::<PyArray2<u64>>()?;
            (out_columns(out, summary.n_blocks), summary)
        } else {
            let (buffer, summary) =
                visit_request(py, src, dst, PlanPooled(template, n_tokens)).map_err(to_py_err)?;
            let columns = pooled_columns(py, buffer.data, buffer.capacity, summary.n_blocks)?;
            (columns, summary)
        };
        Ok(PyTransferPlan::new(
            columns,
            Arc::clone(&self.inner),
            summary,
            self.fingerprints,
        ))
    }

    /// Plans one request (as `plan`) split in two around a pack buffer `pack = (addr, size)` of
    /// prefill memory: `(gather, network)`, the gather from prefill memory into the buffer
    /// (executed by the caller) and the network plan from the buffer to the decode, one block
    /// per destination-contiguous run. A `SizeMismatchError` names the bytes needed when the
    /// buffer is too small.
    #[pyo3(signature = (src_pages, dst_pages, *, pack, n_tokens=None))]
    fn plan_packed<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = crate::convert::pack_arg)] pack: (u64, u64),
        n_tokens: Option<u64>,
    ) -> PyResult<(PyTransferPlan, PyTransferPlan)> {
        let arrays = RequestArrays::extract(src_pages, dst_pages, ("src_pages", "dst_pages"))?;
        let (src, dst) = arrays.slices()?;
        let buffer = kvplan_core::PackBuffer {
            addr: pack.0,
            size: pack.1,
        };
        let (columns, packed) =
            visit_request(py, src, dst, PlanPacked(&self.inner, n_tokens, buffer))
                .map_err(to_py_err)?;
        let gather_columns =
            pooled_columns(py, columns.data, columns.capacity, packed.gather_blocks)?;
        let gather = kvplan_core::Plan {
            n_runs: packed.gather_blocks,
            total_bytes: packed.pack_bytes,
            pair_offsets: packed.gather_pair_offsets,
            ..kvplan_core::Plan::default()
        };
        let mut network = packed.network;
        let network_columns = owned_columns(py, &mut network);
        let half = |columns, plan: &kvplan_core::Plan| {
            PyTransferPlan::packed(columns, Arc::clone(&self.inner), plan, self.fingerprints)
        };
        Ok((
            half(gather_columns, &gather),
            half(network_columns, &network),
        ))
    }

    /// Plans one token request as a gather of source rows into the pack buffer at
    /// `pack=(addr, size)` and the network plan out of it: the network plan `plan_packed`
    /// returns, and a gather that copies what its gather copies, described by rows instead of
    /// one block per row. A `SizeMismatchError` names the bytes needed when the buffer is too
    /// small; a page request (no `n_tokens` on a template that plans by page) is a
    /// `KvPlanError`.
    #[pyo3(signature = (src_pages, dst_pages, *, pack, n_tokens=None))]
    fn plan_row_gather<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = crate::convert::pack_arg)] pack: (u64, u64),
        n_tokens: Option<u64>,
    ) -> PyResult<(PyRowGather, PyTransferPlan)> {
        let arrays = RequestArrays::extract(src_pages, dst_pages, ("src_pages", "dst_pages"))?;
        let (src, dst) = arrays.slices()?;
        let buffer = kvplan_core::PackBuffer {
            addr: pack.0,
            size: pack.1,
        };
        let (gather, mut network) =
            visit_request(py, src, dst, PlanRowGather(&self.inner, n_tokens, buffer))
                .map_err(to_py_err)?;
        let rows = gather
            .rows
            .into_iter()
            .map(|r| numpy::PyArray1::from_vec(py, r).unbind())
            .collect();
        let table: Vec<Vec<u64>> = gather
            .copies
            .iter()
            .map(|c| {
                vec![
                    c.lane as u64,
                    c.src_base,
                    c.page_stride,
                    c.row_stride,
                    c.rows_per_page,
                    c.len,
                    c.pack_addr,
                ]
            })
            .collect();
        let copies = if table.is_empty() {
            numpy::PyArray2::<u64>::zeros(py, [0, 7], false).unbind()
        } else {
            PyArray2::from_vec2(py, &table)
                .map_err(|e| KvPlanError::new_err(e.to_string()))?
                .unbind()
        };
        let network_columns = owned_columns(py, &mut network);
        let network = PyTransferPlan::packed(
            network_columns,
            Arc::clone(&self.inner),
            &network,
            self.fingerprints,
        );
        Ok((
            PyRowGather {
                rows,
                copies,
                pack_bytes: gather.pack_bytes,
            },
            network,
        ))
    }

    /// Plans one request (as `plan`) as a staged plan: `gather` from prefill memory into
    /// `src_staging = (addr, size)` (prefill memory), `network` from there into `dst_staging =
    /// (addr, size)` (the decode's staging region, at this writer's offsets) and `scatter` from
    /// there into the decode's pages. A `SizeMismatchError` names the bytes needed when a region
    /// is too small.
    #[pyo3(signature = (src_pages, dst_pages, *, src_staging, dst_staging, n_tokens=None))]
    fn plan_staged(
        &self,
        py: Python<'_>,
        src_pages: &Bound<'_, PyAny>,
        dst_pages: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::convert::src_staging_arg)] src_staging: (u64, u64),
        #[pyo3(from_py_with = crate::convert::dst_staging_arg)] dst_staging: (u64, u64),
        n_tokens: Option<u64>,
    ) -> PyResult<crate::staged::PyStagedPlan> {
        let arrays = RequestArrays::extract(src_pages, dst_pages, ("src_pages", "dst_pages"))?;
        let (src, dst) = arrays.slices()?;
        let region = |(addr, size): (u64, u64)| kvplan_core::StagingRegion { addr, size };
        let visitor = PlanStaged(
            &self.inner,
            n_tokens,
            region(src_staging),
            region(dst_staging),
        );
        let (gather, scatter, staged) = visit_request(py, src, dst, visitor).map_err(to_py_err)?;
        let part = |columns, n_blocks, pair_offsets| -> PyResult<Py<PyTransferPlan>> {
            let plan = kvplan_core::Plan {
                n_runs: n_blocks,
                total_bytes: staged.total_bytes,
                pair_offsets,
                ..kvplan_core::Plan::default()
            };
            let half =
                PyTransferPlan::packed(columns, Arc::clone(&self.inner), &plan, self.fingerprints);
            Py::new(py, half)
        };
        // A part far smaller than its buffer (the gather of a head-sliced NHD request: 160 of
        // 5.2M blocks) is copied out and its buffer goes straight back to the pool, so a live
        // small plan never holds the memory of the large one.
        let pooled_part = |buffer: FlatBuffer, n_blocks: usize, pair_offsets| {
            let columns = if n_blocks.saturating_mul(4) < buffer.capacity {
                let FlatBuffer { data, capacity } = buffer;
                let columns = [0, 1, 2].map(|k| {
                    let column = &data[k * capacity..k * capacity + n_blocks];
                    numpy::PyArray1::from_slice(py, column).unbind()
                });
                pool::give_back(data);
                columns
            } else {
                pooled_columns(py, buffer.data, buffer.capacity, n_blocks)?
            };
            part(columns, n_blocks, pair_offsets)
        };
        let mut network = staged.network;
        let network_columns = owned_columns(py, &mut network);
        Ok(crate::staged::PyStagedPlan {
            gather: pooled_part(gather, staged.gather_blocks, staged.gather_pair_offsets)?,
            network: part(network_columns, network.n_runs, network.pair_offsets)?,
            scatter: pooled_part(scatter, staged.scatter_blocks, staged.scatter_pair_offsets)?,
            src_staging_bytes: staged.total_bytes,
            dst_staging_range: staged.dst_staging_range,
            dst_staging_bytes: staged.dst_staging_bytes,
            direct_blocks: staged.direct_blocks,
            writer: staged.writer,
        })
    }

    /// Direct or staged for one request (taken as `plan` takes it) on an engine of `cost`: the
    /// core's rule over the request's direct and staged network block counts.
    #[pyo3(signature = (src_pages, dst_pages, cost, *, n_tokens=None))]
    fn transfer_advice(
        &self,
        py: Python<'_>,
        src_pages: &Bound<'_, PyAny>,
        dst_pages: &Bound<'_, PyAny>,
        cost: PyRef<'_, crate::advice::PyTransferCost>,
        n_tokens: Option<u64>,
    ) -> PyResult<crate::advice::PyAdvice> {
        let arrays = RequestArrays::extract(src_pages, dst_pages, ("src_pages", "dst_pages"))?;
        let (src, dst) = arrays.slices()?;
        let visitor = TransferAdvice(&self.inner, n_tokens, cost.inner);
        let advice = visit_request(py, src, dst, visitor).map_err(to_py_err)?;
        Ok(advice.into())
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

    /// One side's prepped descriptor table, `(addrs, lens)` uint64: descriptor `j * pages + k`
    /// is page `k` of emission piece `j`, then one descriptor per slot of every state pair
    /// that moves bytes. The address model is the plan's (strides, head fragments, coalesced
    /// groups); a token template (different page sizes or memory orders) is a KvPlanError.
    fn descriptor_table<'py>(
        &self,
        py: Python<'py>,
        side: &str,
    ) -> PyResult<crate::descriptors::TableArrays<'py>> {
        crate::descriptors::descriptor_table(py, &self.inner, side)
    }

    /// A page request as `(src_idx, dst_idx)` int64 indices into the two prepped tables, piece
    /// major, page minor; validated exactly as `plan` validates the same request.
    fn prepped_indices<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: &Bound<'py, PyAny>,
    ) -> PyResult<crate::descriptors::IndexArrays<'py>> {
        crate::descriptors::prepped_indices(py, &self.inner, src_pages, dst_pages)
    }

    /// State slot `src_slot` -> `dst_slot` as `(src_idx, dst_idx)` int64 indices into the two
    /// prepped tables, one per state pair that moves bytes; validated as `plan_state`.
    fn prepped_state_indices<'py>(
        &self,
        py: Python<'py>,
        src_slot: i64,
        dst_slot: i64,
    ) -> PyResult<crate::descriptors::IndexArrays<'py>> {
        crate::descriptors::prepped_state_indices(py, &self.inner, src_slot, dst_slot)
    }

    /// Plans one request's state slot: one block per state pair (elided pairs emit nothing),
    /// `(src_base + L*src_slot, dst_base + L*dst_slot, L)`.
    fn plan_state(&self, py: Python<'_>, src_slot: i64, dst_slot: i64) -> PyResult<PyTransferPlan> {
        let n = self.inner.state_pairs().len();
        let mut buffer = FlatBuffer::try_zeroed(n).map_err(to_py_err)?;
        let summary = self
            .inner
            .plan_state_into(src_slot, dst_slot, Columns::from_flat(&mut buffer.data, n))
            .map_err(to_py_err)?;
        let columns = pooled_columns(py, buffer.data, n, summary.n_blocks)?;
        Ok(PyTransferPlan::new(
            columns,
            Arc::clone(&self.inner),
            summary,
            self.fingerprints,
        ))
    }
}
