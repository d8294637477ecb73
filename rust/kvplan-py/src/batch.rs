//! `Template.plan_batch` and `Template.plan_batch_flat`: many requests to one peer planned by
//! the core's `BatchPlanner` into one pooled buffer, and `BatchPlan`, its blocks with each
//! request's place in them. The requests' index arrays are borrowed without copying; nothing
//! is built per block. `plan_batch` reads the arrays the caller passed per request;
//! `plan_batch_flat` takes every request's pages concatenated with offsets (the core's
//! `FlatRequests`), a handful of arrays whatever the number of requests.

use std::sync::Arc;

use kvplan_core::{
    BatchSummary, FlatBuffer, FlatRequests, Indices, LeaseRef, PageIndex, Request, Template,
};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PySequence, PyTuple};

use crate::errors::{KvPlanError, to_py_err};
use crate::input::{IndexArray, IndexSlice, RequestArrays, WindowSlices, core_request};
use crate::plan::{PyBlockSlice, PyBlocks, pooled_columns};
use crate::pool;
use crate::request::{PyRequest, RequestInput};

/// A request as the caller passed it, borrowed: a tuple's arrays and token count, or a
/// `kvplan.Request`.
enum BorrowedRequest<'py> {
    Tuple {
        src: IndexArray<'py>,
        dst: IndexArray<'py>,
        n_tokens: Option<u64>,
    },
    Value(Box<RequestInput<'py>>),
}

/// One request's slices, as the core's request is built from them.
struct BatchItem<'a> {
    /// Each side's pages; `None` for a state slot request.
    pages: Option<(IndexSlice<'a>, IndexSlice<'a>)>,
    slot: (i64, i64),
    /// The state slot a page request carries too.
    state_slot: Option<(i64, i64)>,
    window: WindowSlices<'a>,
    n_tokens: Option<u64>,
    skip_tokens: u64,
    pool_tokens: [Option<(u64, u64)>; kvplan_core::POOLS],
}

/// Reads `requests`: each a `kvplan.Request`, or a `(src_pages, dst_pages)` or
/// `(src_pages, dst_pages, n_tokens)` tuple of 1-D int32 or int64 arrays.
fn borrow_requests<'py>(requests: &Bound<'py, PyAny>) -> PyResult<Vec<BorrowedRequest<'py>>> {
    let sequence = requests.cast::<PySequence>().map_err(|_| {
        PyTypeError::new_err(format!(
            "requests must be a sequence of (src_pages, dst_pages[, n_tokens]) tuples, got {}",
            requests
                .get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    let n = sequence.len()?;
    let mut out = Vec::with_capacity(n);
    for r in 0..n {
        let item = sequence.get_item(r)?;
        if let Ok(request) = item.cast::<PyRequest>() {
            out.push(BorrowedRequest::Value(Box::new(RequestInput::of_request(
                request,
            )?)));
            continue;
        }
        let tuple = item
            .cast::<PyTuple>()
            .ok()
            .filter(|t| matches!(t.len(), 2 | 3));
        let Some(tuple) = tuple else {
            return Err(PyTypeError::new_err(format!(
                "request {r} must be a kvplan.Request or a (src_pages, dst_pages) or \
                 (src_pages, dst_pages, n_tokens) tuple, got {}",
                item.get_type().name()?
            )));
        };
        let n_tokens = if tuple.len() == 3 {
            let value = tuple.get_item(2)?;
            if value.is_none() {
                None
            } else {
                Some(value.extract::<u64>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "request {r}: n_tokens must be a non-negative int or None, got {value}"
                    ))
                })?)
            }
        } else {
            None
        };
        out.push(BorrowedRequest::Tuple {
            src: borrow_index(&tuple.get_item(0)?, r, "src_pages")?,
            dst: borrow_index(&tuple.get_item(1)?, r, "dst_pages")?,
            n_tokens,
        });
    }
    Ok(out)
}

/// One index array of request `r`; the error names the request (built only on failure: a
/// batch of many small requests would otherwise format two names per request).
fn borrow_index<'py>(obj: &Bound<'py, PyAny>, r: usize, arg: &str) -> PyResult<IndexArray<'py>> {
    IndexArray::extract(obj, arg)
        .or_else(|_| IndexArray::extract(obj, &format!("request {r} {arg}")))
}

/// Index element types a batch's slices can be read as.
trait SliceOf: PageIndex {
    const DTYPE: &'static str;
    fn of(slice: IndexSlice<'_>) -> Option<&[Self]>;
}

impl SliceOf for i32 {
    const DTYPE: &'static str = "int32";
    fn of(slice: IndexSlice<'_>) -> Option<&[i32]> {
        match slice {
            IndexSlice::I32(s) => Some(s),
            IndexSlice::I64(_) => None,
        }
    }
}

impl SliceOf for i64 {
    const DTYPE: &'static str = "int64";
    fn of(slice: IndexSlice<'_>) -> Option<&[i64]> {
        match slice {
            IndexSlice::I64(s) => Some(s),
            IndexSlice::I32(_) => None,
        }
    }
}

/// The planned batch: the pooled output and the summary (and digests when asked for).
type Planned = kvplan_core::Result<(FlatBuffer, BatchSummary, Option<Vec<u64>>)>;

/// What request digests are computed with: both layouts' fingerprints and, per request, its
/// lease (empty: none given).
type DigestArgs<'a> = Option<((u64, u64), &'a [Option<LeaseRef<'a>>])>;

/// The leases a batch was planned with: the caller's objects (returned by `request_leases`)
/// and, per request, the epoch and request id bytes the core's digests read.
pub(crate) struct BatchLeases {
    objects: Vec<Py<PyAny>>,
    parts: Vec<Option<(u64, Vec<u8>)>>,
}

impl BatchLeases {
    /// Reads `leases`: a sequence of one lease (an object with `epoch` and `request`, such as
    /// `kvplan.Lease`) or `None` per request.
    fn extract(leases: &Bound<'_, PyAny>, n_requests: usize) -> PyResult<Self> {
        let sequence = leases.cast::<PySequence>().map_err(|_| {
            PyTypeError::new_err(format!(
                "leases must be a sequence of one kvplan.Lease (or None) per request, got {}",
                leases
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })?;
        let n = sequence.len()?;
        if n != n_requests {
            return Err(KvPlanError::new_err(format!(
                "leases has {n} values for {n_requests} requests; give one lease (or None) per \
                 request"
            )));
        }
        let (mut objects, mut parts) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for r in 0..n {
            let item = sequence.get_item(r)?;
            parts.push(if item.is_none() {
                None
            } else {
                Some(crate::digest::lease_parts(&item).map_err(|e| {
                    KvPlanError::new_err(format!("request {r}: {}", e.value(leases.py())))
                })?)
            });
            objects.push(item.unbind());
        }
        Ok(Self { objects, parts })
    }

    fn refs(&self) -> Vec<Option<LeaseRef<'_>>> {
        self.parts
            .iter()
            .map(|p| {
                p.as_ref().map(|(epoch, request)| LeaseRef {
                    epoch: *epoch,
                    request,
                })
            })
            .collect()
    }
}

/// Requests with this many index pairs in all are planned with the GIL released.
const DETACH_MIN_PAGES: usize = 1024;

/// The core's requests over the slices (all of one dtype per side), planned.
fn plan_typed<S: SliceOf, D: SliceOf>(
    py: Python<'_>,
    template: &Template,
    slices: &[BatchItem<'_>],
    digests: DigestArgs<'_>,
) -> PyResult<Planned> {
    let mut requests: Vec<Request<'_, S, D>> = Vec::with_capacity(slices.len());
    let mut pages = 0usize;
    for (r, item) in slices.iter().enumerate() {
        let Some((src, dst)) = item.pages else {
            let (src, dst) = item.slot;
            let slot = Indices::Slot { src, dst };
            let (n, k) = (item.n_tokens, item.skip_tokens);
            requests.push(core_request(slot, n, k, [(None, None); kvplan_core::POOLS]));
            continue;
        };
        let (Some(src), Some(dst)) = (S::of(src), D::of(dst)) else {
            return Err(PyTypeError::new_err(format!(
                "request {r}: every request of a batch takes the dtypes of the first \
                 (src_pages {}, dst_pages {}); convert with .astype",
                S::DTYPE,
                D::DTYPE
            )));
        };
        pages = pages.saturating_add(src.len().max(dst.len()));
        // A side's window pages have that side's dtype (checked when borrowed).
        let window = item
            .window
            .pools()
            .map(|(ws, wd)| (ws.and_then(S::of), wd.and_then(D::of)));
        let pages_of = Indices::Pages { src, dst };
        let (n, k) = (item.n_tokens, item.skip_tokens);
        let mut request = core_request(pages_of, n, k, window);
        request.pool_tokens = item.pool_tokens;
        request.state_slot = item.state_slot;
        requests.push(request);
    }
    let plan = || plan_requests(template, &requests, digests);
    Ok(if pages < DETACH_MIN_PAGES {
        plan()
    } else {
        py.detach(plan)
    })
}

/// The one planning path of both batch forms: the core's batch planner over `requests`, into
/// a pooled buffer, and each request's digest when asked for.
fn plan_requests<S: PageIndex, D: PageIndex>(
    template: &Template,
    requests: &[Request<'_, S, D>],
    digests: DigestArgs<'_>,
) -> Planned {
    let planner = template.batch();
    let (buffer, summary) = planner.plan_into(requests, |summary| {
        Ok(FlatBuffer {
            data: pool::take(summary.n_blocks.saturating_mul(3))?,
            capacity: summary.n_blocks,
        })
    })?;
    let digests = match digests {
        Some((prints, leases)) => Some(planner.request_digests(requests, prints, leases)?),
        None => None,
    };
    Ok((buffer, summary, digests))
}

/// The slice view of request `r`'s array; the error names the request (built on failure only).
fn slice_of<'a>(array: &'a IndexArray<'_>, r: usize, arg: &str) -> PyResult<IndexSlice<'a>> {
    array
        .as_slice(arg)
        .or_else(|_| array.as_slice(&format!("request {r} {arg}")))
}

/// The wire fingerprints request digests are computed between, when asked for.
fn digest_prints(fingerprints: Option<(u64, u64)>, digests: bool) -> PyResult<Option<(u64, u64)>> {
    if !digests {
        return Ok(None);
    }
    fingerprints
        .map(Some)
        .ok_or_else(|| KvPlanError::new_err("request digests need both layouts' wire fingerprints"))
}

/// The `BatchPlan` of a planned batch (or the planning error, raised).
fn batch_plan(
    py: Python<'_>,
    template: &Arc<Template>,
    planned: Planned,
    fingerprints: Option<(u64, u64)>,
    leases: Option<BatchLeases>,
) -> PyResult<Py<PyBatchPlan>> {
    let (buffer, summary, digests) = planned.map_err(to_py_err)?;
    let columns = pooled_columns(py, buffer.data, buffer.capacity, summary.n_blocks)?;
    let plan = PyBatchPlan {
        template: Arc::clone(template),
        summary,
        fingerprints,
        digests,
        leases: leases.map(|l| l.objects),
    };
    Py::new(
        py,
        PyClassInitializer::from(PyBlocks::new(columns)).add_subclass(plan),
    )
}

/// Plans `requests` with `template` (see `Template.plan_batch`).
pub(crate) fn plan_batch(
    py: Python<'_>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    requests: &Bound<'_, PyAny>,
    digests: bool,
    leases: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyBatchPlan>> {
    let borrowed = borrow_requests(requests)?;
    let leases = leases
        .map(|l| BatchLeases::extract(l, borrowed.len()))
        .transpose()?;
    let refs = leases.as_ref().map(BatchLeases::refs).unwrap_or_default();
    let mut slices = Vec::with_capacity(borrowed.len());
    for (r, request) in borrowed.iter().enumerate() {
        slices.push(match request {
            BorrowedRequest::Tuple { src, dst, n_tokens } => BatchItem {
                pages: Some((
                    slice_of(src, r, "src_pages")?,
                    slice_of(dst, r, "dst_pages")?,
                )),
                slot: (0, 0),
                state_slot: None,
                window: WindowSlices::default(),
                n_tokens: *n_tokens,
                skip_tokens: 0,
                pool_tokens: [None; kvplan_core::POOLS],
            },
            BorrowedRequest::Value(input) => {
                let pages = input
                    .pages
                    .as_ref()
                    .map(RequestArrays::slices)
                    .transpose()?;
                let window = match pages {
                    Some(pages) => input.window.slices(pages)?,
                    None => WindowSlices::default(),
                };
                BatchItem {
                    pages,
                    slot: input.slot,
                    state_slot: input.state_slot,
                    window,
                    n_tokens: input.n_tokens,
                    skip_tokens: input.skip_tokens,
                    pool_tokens: input.pool_tokens,
                }
            }
        });
    }
    let prints =
        digest_prints(fingerprints, digests || leases.is_some())?.map(|p| (p, refs.as_slice()));
    // The first request with pages sets the batch's dtypes (slots have none).
    let first = slices.iter().find_map(|item| item.pages);
    let planned = match first {
        Some((IndexSlice::I32(_), IndexSlice::I32(_))) => {
            plan_typed::<i32, i32>(py, template, &slices, prints)?
        }
        Some((IndexSlice::I32(_), IndexSlice::I64(_))) => {
            plan_typed::<i32, i64>(py, template, &slices, prints)?
        }
        Some((IndexSlice::I64(_), IndexSlice::I32(_))) => {
            plan_typed::<i64, i32>(py, template, &slices, prints)?
        }
        Some((IndexSlice::I64(_), IndexSlice::I64(_))) | None => {
            plan_typed::<i64, i64>(py, template, &slices, prints)?
        }
    };
    batch_plan(py, template, planned, fingerprints, leases)
}

/// A borrowed 1-D int64 array argument of a flat batch (offsets, token counts), or a
/// `TypeError` naming the argument and what it was.
fn int64_arg<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<IndexArray<'py>> {
    use numpy::PyArrayMethods;
    let array = obj
        .cast::<PyArray1<i64>>()
        .map_err(|_| int64_error(obj, name))?;
    let borrowed = array.try_readonly().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} is being written elsewhere (mutably borrowed)"
        ))
    })?;
    Ok(IndexArray::I64(borrowed))
}

#[cold]
fn int64_error(obj: &Bound<'_, PyAny>, name: &str) -> PyErr {
    use numpy::PyUntypedArrayMethods;
    let (what, advice) = match obj.cast::<numpy::PyUntypedArray>() {
        Ok(array) => {
            let dtype = array
                .dtype()
                .str()
                .map_or_else(|_| "?".into(), |s| s.to_string());
            let advice = if array.ndim() == 1 {
                "; convert with .astype(np.int64)"
            } else {
                ""
            };
            (
                format!("a {}-D numpy array of dtype {dtype}", array.ndim()),
                advice,
            )
        }
        Err(_) => (
            obj.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string()),
            "",
        ),
    };
    PyTypeError::new_err(format!(
        "{name} must be a 1-D numpy array of dtype int64, got {what}{advice}"
    ))
}

/// The int64 slice of an array `int64_arg` accepted.
fn int64_slice<'a>(array: &'a IndexArray<'_>, name: &str) -> PyResult<&'a [i64]> {
    match array.as_slice(name)? {
        IndexSlice::I64(s) => Ok(s),
        IndexSlice::I32(_) => Err(PyTypeError::new_err(format!(
            "{name} must be of dtype int64"
        ))),
    }
}

/// A flat batch's slices, planned by the core's batch planner: the requests are cut from the
/// slices and planned with the GIL released (unless the batch is tiny).
#[allow(clippy::too_many_arguments)]
fn plan_flat_typed<S: PageIndex, D: PageIndex>(
    py: Python<'_>,
    template: &Template,
    src: &[S],
    dst: &[D],
    offsets: &[i64],
    dst_offsets: Option<&[i64]>,
    n_tokens: Option<&[i64]>,
    digests: DigestArgs<'_>,
) -> Planned {
    let flat = FlatRequests {
        src,
        dst,
        offsets,
        dst_offsets,
        n_tokens,
    };
    let plan = || plan_requests(template, &flat.requests()?, digests);
    if src.len().max(dst.len()) < DETACH_MIN_PAGES {
        plan()
    } else {
        py.detach(plan)
    }
}

/// Plans a flat batch with `template` (see `Template.plan_batch_flat`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_batch_flat(
    py: Python<'_>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_pages: &Bound<'_, PyAny>,
    dst_pages: &Bound<'_, PyAny>,
    offsets: &Bound<'_, PyAny>,
    dst_offsets: Option<&Bound<'_, PyAny>>,
    n_tokens: Option<&Bound<'_, PyAny>>,
    digests: bool,
    leases: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyBatchPlan>> {
    let arrays = RequestArrays::extract(src_pages, dst_pages, ("src_pages", "dst_pages"))?;
    let (src, dst) = arrays.slices()?;
    let offsets = int64_arg(offsets, "offsets")?;
    let dst_offsets = dst_offsets
        .map(|o| int64_arg(o, "dst_offsets"))
        .transpose()?;
    let n_tokens = n_tokens.map(|t| int64_arg(t, "n_tokens")).transpose()?;
    let offsets = int64_slice(&offsets, "offsets")?;
    let dst_offsets = dst_offsets
        .as_ref()
        .map(|o| int64_slice(o, "dst_offsets"))
        .transpose()?;
    let n_tokens = n_tokens
        .as_ref()
        .map(|t| int64_slice(t, "n_tokens"))
        .transpose()?;
    let leases = leases
        .map(|l| BatchLeases::extract(l, offsets.len().saturating_sub(1)))
        .transpose()?;
    let refs = leases.as_ref().map(BatchLeases::refs).unwrap_or_default();
    let prints =
        digest_prints(fingerprints, digests || leases.is_some())?.map(|p| (p, refs.as_slice()));
    let t = template.as_ref();
    let planned = match (src, dst) {
        (IndexSlice::I32(s), IndexSlice::I32(d)) => {
            plan_flat_typed(py, t, s, d, offsets, dst_offsets, n_tokens, prints)
        }
        (IndexSlice::I32(s), IndexSlice::I64(d)) => {
            plan_flat_typed(py, t, s, d, offsets, dst_offsets, n_tokens, prints)
        }
        (IndexSlice::I64(s), IndexSlice::I32(d)) => {
            plan_flat_typed(py, t, s, d, offsets, dst_offsets, n_tokens, prints)
        }
        (IndexSlice::I64(s), IndexSlice::I64(d)) => {
            plan_flat_typed(py, t, s, d, offsets, dst_offsets, n_tokens, prints)
        }
    };
    batch_plan(py, template, planned, fingerprints, leases)
}

/// Many requests to one peer in one plan: the blocks of every request in one set of columns
/// (views of one pooled buffer), in segments. A segment is one request, or consecutive
/// requests whose pages touch on both sides, whose boundary blocks are merged; segments follow
/// the request order. An engine call that fails holds exactly the requests with bytes in its
/// blocks (`requests_in`): inside a segment, those whose runs or pages the call covers.
#[pyclass(frozen, extends = PyBlocks, name = "BatchPlan", module = "kvplan._core")]
pub struct PyBatchPlan {
    template: Arc<Template>,
    summary: BatchSummary,
    fingerprints: Option<(u64, u64)>,
    digests: Option<Vec<u64>>,
    leases: Option<Vec<Py<PyAny>>>,
}

fn int64_array(py: Python<'_>, values: impl Iterator<Item = usize>) -> Bound<'_, PyArray1<i64>> {
    values
        .map(|v| v as i64)
        .collect::<Vec<_>>()
        .into_pyarray(py)
}

impl PyBatchPlan {
    /// The template the batch was planned by, and its summary (for cutting it into slices).
    pub(crate) fn template_and_summary(&self) -> (&Arc<Template>, &BatchSummary) {
        (&self.template, &self.summary)
    }

    fn request_index(&self, request: i64) -> PyResult<usize> {
        let n = self.summary.n_requests();
        let at = if request < 0 {
            request + n as i64
        } else {
            request
        };
        usize::try_from(at).ok().filter(|&r| r < n).ok_or_else(|| {
            PyIndexError::new_err(format!("request {request} out of range for {n} requests"))
        })
    }

    fn calls(&self, max_blocks: i64) -> PyResult<Vec<std::ops::Range<usize>>> {
        let max = usize::try_from(max_blocks).unwrap_or(0);
        if max_blocks <= 0 {
            return Err(KvPlanError::new_err(format!(
                "max_blocks must be positive, got {max_blocks}"
            )));
        }
        self.summary.call_ranges(max).map_err(to_py_err)
    }
}

#[pymethods]
impl PyBatchPlan {
    /// Requests planned.
    #[getter]
    fn n_requests(&self) -> usize {
        self.summary.n_requests()
    }

    /// Segments (a request alone, or touching requests merged).
    #[getter]
    fn n_segments(&self) -> usize {
        self.summary.n_segments()
    }

    /// Bytes the batch moves.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.summary.total_bytes
    }

    /// `n_segments + 1` block offsets: segment `s` is blocks `segment_offsets[s] ..
    /// segment_offsets[s + 1]`.
    #[getter]
    fn segment_offsets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        int64_array(py, self.summary.segment_offsets.iter().copied())
    }

    /// `n_segments + 1` request offsets: segment `s` holds requests `segment_requests[s] ..
    /// segment_requests[s + 1]`.
    #[getter]
    fn segment_requests<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        int64_array(py, self.summary.segment_requests.iter().copied())
    }

    /// Per request, the segment it was planned in.
    #[getter]
    fn request_segments<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let s = &self.summary;
        let per = (0..s.n_segments()).flat_map(|seg| {
            std::iter::repeat_n(seg, s.segment_requests[seg + 1] - s.segment_requests[seg])
        });
        int64_array(py, per)
    }

    /// Per request, the bytes it moves.
    #[getter]
    fn request_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        let bytes: Vec<u64> = self
            .summary
            .requests
            .iter()
            .map(|r| r.total_bytes)
            .collect();
        bytes.into_pyarray(py)
    }

    /// Per request, its blocks if it were planned alone (`template.plan(...).n_blocks`).
    #[getter]
    fn request_n_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        int64_array(py, self.summary.requests.iter().map(|r| r.n_blocks))
    }

    /// The blocks holding request `request`'s bytes (its segment's blocks), as a slice.
    fn request_blocks<'py>(
        &self,
        py: Python<'py>,
        request: i64,
    ) -> PyResult<Bound<'py, pyo3::types::PySlice>> {
        let r = self.request_index(request)?;
        let range = self.summary.request_blocks(r).unwrap_or(0..0);
        Ok(pyo3::types::PySlice::new(
            py,
            range.start as isize,
            range.end as isize,
            1,
        ))
    }

    /// The requests with bytes in blocks `start .. stop`, in order (int64): inside a segment of
    /// fused requests, only those whose runs or pages the blocks cover.
    fn requests_in<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        stop: usize,
    ) -> Bound<'py, PyArray1<i64>> {
        let held = self.template.batch_requests_in(&self.summary, start..stop);
        int64_array(py, held.into_iter())
    }

    /// `(n_calls, 2)` int64 `[start, stop)` block ranges of at most `max_blocks` blocks, one
    /// per engine call: whole segments packed while they fit, a larger segment split alone.
    fn call_ranges<'py>(
        &self,
        py: Python<'py>,
        max_blocks: i64,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let calls = self.calls(max_blocks)?;
        let flat: Vec<i64> = calls
            .iter()
            .flat_map(|c| [c.start as i64, c.end as i64])
            .collect();
        let array = Array2::from_shape_vec((calls.len(), 2), flat)
            .map_err(|e| KvPlanError::new_err(e.to_string()))?;
        Ok(array.into_pyarray(py))
    }

    /// The blocks of each of `call_ranges(max_blocks)`, as views (no copy).
    fn batches(
        slf: PyRef<'_, Self>,
        py: Python<'_>,
        max_blocks: i64,
    ) -> PyResult<Vec<Py<PyBlockSlice>>> {
        let calls = slf.calls(max_blocks)?;
        calls
            .into_iter()
            .map(|call| {
                let blocks = slf.as_super().slice(py, call.start, call.end)?;
                Py::new(
                    py,
                    PyClassInitializer::from(blocks).add_subclass(PyBlockSlice),
                )
            })
            .collect()
    }

    /// Per request, the plan digest of the request planned alone (what a decode verifying
    /// requests one by one recomputes); planned with `plan_batch(..., digests=True)` only.
    #[getter]
    fn request_digests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u64>>> {
        match &self.digests {
            Some(d) => Ok(d.clone().into_pyarray(py)),
            None => Err(KvPlanError::new_err(
                "this batch was planned without request digests: plan_batch(..., digests=True)",
            )),
        }
    }

    /// Per request, the lease it was planned with (`None` for a request without one), as the
    /// caller passed them; `None` for a batch planned without `leases`.
    #[getter]
    fn request_leases(&self, py: Python<'_>) -> Option<Vec<Py<PyAny>>> {
        self.leases
            .as_ref()
            .map(|l| l.iter().map(|o| o.clone_ref(py)).collect())
    }

    /// Fingerprints of the prefill and decode layouts the batch was planned between.
    #[getter]
    fn layout_fingerprints(&self) -> PyResult<(u64, u64)> {
        self.fingerprints
            .ok_or_else(|| KvPlanError::new_err("a layout of this template has no wire encoding"))
    }

    fn __repr__(slf: PyRef<'_, Self>, py: Python<'_>) -> String {
        format!(
            "BatchPlan(n_requests={}, n_segments={}, n_blocks={}, total_bytes={})",
            slf.summary.n_requests(),
            slf.summary.n_segments(),
            slf.as_super().len(py),
            slf.summary.total_bytes
        )
    }
}
