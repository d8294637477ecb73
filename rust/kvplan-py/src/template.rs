//! `Template`: a compiled peer pair, planned per request. The GIL is released around every
//! pass over index arrays; plans come back as NumPy columns viewing a pooled Rust buffer or the
//! caller's `out=` array.

use std::sync::Arc;

use kvplan_core::{
    BlockRequest, Columns, FlatBuffer, GeometryOptions, PageIndex, PlanSummary, Request, Template,
};
use numpy::{PyArray2, PyArrayMethods, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::{IndexArray, RequestArrays, RequestPlanner, pairs_array, plan_request};
use crate::errors::{KvPlanError, to_py_err};
use crate::layout::PyLayout;
use crate::options::{fragments_arg, template_options};
use crate::plan::{PyTransferPlan, out_columns, owned_columns, pooled, pooled_columns};

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

/// Borrows `out` for writing: a `TypeError` for a wrong type, dtype, shape or memory order
/// (input shape), a `KvPlanError` for a read-only array or one whose memory overlaps an input
/// (never a panic).
fn writable_out<'py, 'i>(
    out: &Bound<'py, PyAny>,
    inputs: impl IntoIterator<Item = (&'i IndexArray<'i>, &'i str)>,
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
    for (input, name) in inputs {
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

/// The argument names of the two window page lists, for errors.
const WINDOW_NAMES: (&str, &str) = ("window_pages[0]", "window_pages[1]");

/// `window_pages=`: `None`, or a `(src, dst)` tuple of index arrays or `None`s, borrowed.
fn window_pages_arg<'py>(
    window_pages: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Option<IndexArray<'py>>, Option<IndexArray<'py>>)> {
    let Some(obj) = window_pages.filter(|o| !o.is_none()) else {
        return Ok((None, None));
    };
    let shape_error = || {
        PyTypeError::new_err(format!(
            "window_pages must be None or a tuple (src, dst) of two index arrays (or None for a \
             side without a window pool), got {}",
            obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    };
    let tuple = obj.cast::<PyTuple>().map_err(|_| shape_error())?;
    if tuple.len() != 2 {
        return Err(shape_error());
    }
    let side = |k: usize, name: &str| -> PyResult<Option<IndexArray<'py>>> {
        let item = tuple.get_item(k)?;
        if item.is_none() {
            return Ok(None);
        }
        IndexArray::extract(&item, name).map(Some)
    };
    Ok((side(0, WINDOW_NAMES.0)?, side(1, WINDOW_NAMES.1)?))
}

/// A validated peer pair (prefill layout → decode layout), built once, planned per request.
#[pyclass(frozen, name = "Template", module = "kvplan._core")]
pub struct PyTemplate {
    /// Shared with every plan, which asks it for its block offsets.
    pub(crate) inner: Arc<Template>,
    /// The core's fingerprints of the (prefill, decode) layouts, for plan digests (`None` when
    /// a layout has no wire encoding).
    pub(crate) fingerprints: Option<(u64, u64)>,
}

/// One request planned into a pooled buffer; the core decides between a page and a token plan.
struct PlanPooled<'t>(&'t Template);

impl RequestPlanner for PlanPooled<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, PlanSummary)>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        self.0.plan_into(request, pooled)
    }
}

/// The same into the caller's `out=` columns.
struct PlanInto<'t, 'o>(&'t Template, Columns<'o>);

impl RequestPlanner for PlanInto<'_, '_> {
    type Output = kvplan_core::Result<PlanSummary>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        let columns = self.1;
        self.0
            .plan_into(request, move |_| Ok(columns))
            .map(|(_, summary)| summary)
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

    /// Per page pair, the core's coalescing (`kvplan_core::coalescing`): `(kind, side,
    /// per_page)` with kind `joined`, `first`, `elided`, `by_token`, `fragments`, `strides`,
    /// `apart`, `beyond_stride` or `options`, the side (`src`/`dst`) for the last three, and
    /// whether the pair's blocks end at every page.
    #[getter]
    fn coalescing(&self) -> Vec<(&'static str, Option<&'static str>, bool)> {
        use kvplan_core::{Coalescing, JoinBlocker, Side};
        let side = |s: Side| Some(s.pick("src", "dst"));
        kvplan_core::coalescing(&self.inner)
            .into_iter()
            .map(|pair| {
                let (kind, on) = match pair.coalescing {
                    Coalescing::Joined => ("joined", None),
                    Coalescing::First => ("first", None),
                    Coalescing::Elided => ("elided", None),
                    Coalescing::ByToken => ("by_token", None),
                    Coalescing::Fragments => ("fragments", None),
                    Coalescing::Options => ("options", None),
                    Coalescing::Join(JoinBlocker::Strides(s)) => ("strides", side(s)),
                    Coalescing::Join(JoinBlocker::Apart(s)) => ("apart", side(s)),
                    Coalescing::Join(JoinBlocker::BeyondStride(s)) => ("beyond_stride", side(s)),
                };
                (kind, on, pair.per_page)
            })
            .collect()
    }

    /// Per page pair: whether it emits blocks (item length > 0 and, between TP sizes, heads to
    /// move).
    #[getter]
    fn emitting<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(
            py,
            self.inner
                .blocks()
                .pair_groups()
                .iter()
                .map(Option::is_some),
        )
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
        let c = kvplan_core::PackPlanner::new(&self.inner)
            .counts(n_tokens, fragmented)
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
        self.inner.blocks().groups().len()
    }

    /// The group of each page pair (int64; -1 for an elided pair).
    #[getter]
    fn pair_groups<'py>(&self, py: Python<'py>) -> Bound<'py, numpy::PyArray1<i64>> {
        let groups = self.inner.blocks().pair_groups().iter();
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
    ///
    /// Delta plans: with `skip_tokens` K > 0 the decode holds the request's first K tokens
    /// already (K any count, not only a page multiple) and the plan moves tokens K.. only, by
    /// token, from the same whole page lists; the pages before the one holding token K are not
    /// read. The plan digest covers K.
    ///
    /// Window pools: when a side's window entries keep a pool of their own
    /// (`Layout.with_windows(..., window_page_size=)`), `window_pages` is `(src, dst)`, each
    /// side's window pages (that pool's pages of the request in token order from its first
    /// token, the dtype of that side's pages; the pages before the window are not read) or
    /// `None` for a side without a window pool.
    #[pyo3(signature = (src_pages, dst_pages, *, n_tokens=None, skip_tokens=0, window_pages=None, out=None))]
    #[allow(clippy::too_many_arguments)]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: &Bound<'py, PyAny>,
        n_tokens: Option<u64>,
        skip_tokens: u64,
        window_pages: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyTransferPlan>> {
        let arrays = RequestArrays::extract(src_pages, dst_pages, ("src_pages", "dst_pages"))?;
        let (src, dst) = arrays.slices()?;
        let window_arrays = window_pages_arg(window_pages)?;
        let window_slices = (
            window_arrays
                .0
                .as_ref()
                .map(|a| a.as_slice(WINDOW_NAMES.0))
                .transpose()?,
            window_arrays
                .1
                .as_ref()
                .map(|a| a.as_slice(WINDOW_NAMES.1))
                .transpose()?,
        );
        let tokens = crate::convert::TokenArgs {
            n_tokens,
            skip_tokens,
            window: crate::convert::WindowSlices::new((src, dst), window_slices)?,
        };
        let template: &Template = &self.inner;
        let (columns, summary) = if let Some(out) = out {
            let window_inputs = [
                window_arrays.0.as_ref().map(|a| (a, WINDOW_NAMES.0)),
                window_arrays.1.as_ref().map(|a| (a, WINDOW_NAMES.1)),
            ];
            let inputs = arrays
                .named()
                .into_iter()
                .chain(window_inputs.into_iter().flatten());
            let mut writable = writable_out(out, inputs)?;
            let capacity = writable.shape()[1];
            let flat = writable.as_slice_mut()?;
            let planner = PlanInto(template, Columns::from_flat(flat, capacity));
            let summary = plan_request(py, (src, dst), tokens, planner).map_err(to_py_err)?;
            drop(writable);
            let out = out.cast::<PyArray2<u64>>()?;
            (out_columns(out, summary.n_blocks), summary)
        } else {
            let (buffer, summary) =
                plan_request(py, (src, dst), tokens, PlanPooled(template)).map_err(to_py_err)?;
            let columns = pooled_columns(py, buffer.data, buffer.capacity, summary.n_blocks)?;
            (columns, summary)
        };
        Py::new(
            py,
            PyTransferPlan::new(columns, Arc::clone(&self.inner), summary, self.fingerprints),
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
    #[pyo3(signature = (src_pages, dst_pages, *, pack, n_tokens=None))]
    fn plan_packed<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = crate::convert::pack_arg)] pack: (u64, u64),
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

    /// The live rows of every ring-state pair for one request: slot `src_slot` (prefill)
    /// and `dst_slot` (decode) after `n_positions` positions, each position from its prefill
    /// row to its decode row (rings of different sizes relaid out), one block range per ring
    /// pair.
    #[pyo3(signature = (src_slot, dst_slot, n_positions))]
    fn plan_ring(
        &self,
        py: Python<'_>,
        src_slot: i64,
        dst_slot: i64,
        n_positions: u64,
    ) -> PyResult<Py<PyTransferPlan>> {
        let template = &self.inner;
        let mut plan = py
            .detach(|| {
                kvplan_core::RingPlanner::new(template).plan(src_slot, dst_slot, n_positions)
            })
            .map_err(to_py_err)?;
        let columns = owned_columns(py, &mut plan);
        Py::new(
            py,
            PyTransferPlan::packed(columns, Arc::clone(&self.inner), &plan, self.fingerprints),
        )
    }

    /// Plans one request's state slot: one block per state pair (elided pairs emit nothing),
    /// `(src_base + L*src_slot, dst_base + L*dst_slot, L)`.
    fn plan_state(
        &self,
        py: Python<'_>,
        src_slot: i64,
        dst_slot: i64,
    ) -> PyResult<Py<PyTransferPlan>> {
        let (buffer, summary) = self
            .inner
            .plan_into(&Request::slot(src_slot, dst_slot), pooled)
            .map_err(to_py_err)?;
        let columns = pooled_columns(py, buffer.data, buffer.capacity, summary.n_blocks)?;
        Py::new(
            py,
            PyTransferPlan::new(columns, Arc::clone(&self.inner), summary, self.fingerprints),
        )
    }
}
