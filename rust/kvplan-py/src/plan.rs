//! Runs, pairing, templates and plans. The GIL is released around every pass over index arrays;
//! plans come back as NumPy arrays viewing a pooled Rust buffer (no copy, no per-block objects).

use kvplan_core::{
    Columns, EntryMetadata, FlatBuffer, LegacyKind, PageIndex, PlanError, PlanSummary, Template,
    TemplateOptions,
};
use numpy::ndarray::{Array2, ArrayView1};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::{IndexArray, IndexVisitor, visit_request};
use crate::errors::{KvPlanError, to_py_err};
use crate::layout::PyLayout;
use crate::pool;

/// `(n, 2)` int64 array of entry pairs; an index beyond int64 (only reachable with bare counts
/// of 2**63 or more) is an error, never a negative index.
fn pairs_array(
    py: Python<'_>,
    pairs: impl ExactSizeIterator<Item = [usize; 2]>,
) -> PyResult<Bound<'_, PyArray2<i64>>> {
    let n = pairs.len();
    // The pair count can come from bare integers (legacy_pp_pairs): this copy may not fit even
    // when the core's own list did, and must then raise, not abort.
    let values = n.saturating_mul(2);
    let mut flat: Vec<i64> = Vec::new();
    flat.try_reserve_exact(values)
        .map_err(|_| to_py_err(PlanError::out_of_memory::<i64>("entry pairs", values)))?;
    for [i, j] in pairs {
        let (Ok(i), Ok(j)) = (i64::try_from(i), i64::try_from(j)) else {
            return Err(KvPlanError::new_err("an entry index does not fit int64"));
        };
        flat.extend_from_slice(&[i, j]);
    }
    Ok(Array2::from_shape_vec((n, 2), flat)
        .expect("two columns by construction")
        .into_pyarray(py))
}

/// `(src_starts, dst_starts, lengths)`.
type Runs<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
);

/// Runs contiguous on both sides as `(src_starts, dst_starts, lengths)` int64 arrays.
///
/// Contract: 1-D C-contiguous int32/int64 arrays, borrowed without copying; GIL released.
#[pyfunction]
#[pyo3(signature = (src, dst, /))]
pub fn group_contiguous<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
) -> PyResult<Runs<'py>> {
    struct Group;
    impl IndexVisitor for Group {
        type Output = kvplan_core::Result<(Vec<u64>, Vec<u64>, Vec<u64>)>;
        fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
            kvplan_core::group_contiguous(src, dst)
        }
    }
    let (src_array, dst_array) = (
        IndexArray::extract(src, "src")?,
        IndexArray::extract(dst, "dst")?,
    );
    let (src_slice, dst_slice) = (src_array.as_slice("src")?, dst_array.as_slice("dst")?);
    let (s, d, l) = visit_request(py, src_slice, dst_slice, Group).map_err(to_py_err)?;
    let signed = |v: Vec<u64>| signed_in_place(v).into_pyarray(py);
    Ok((signed(s), signed(d), signed(l)))
}

/// The same allocation reinterpreted as int64 (no copy, no second allocation).
///
/// Every value is a validated index, a run start or a run length: all below 2**63, so the
/// reinterpretation is exact.
fn signed_in_place(v: Vec<u64>) -> Vec<i64> {
    debug_assert!(v.iter().all(|&x| i64::try_from(x).is_ok()));
    let mut v = std::mem::ManuallyDrop::new(v);
    let (ptr, len, capacity) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: i64 and u64 have the same size and alignment, so the allocation's layout is the
    // one a Vec<i64> of this capacity frees; every bit pattern is a valid i64; the original
    // Vec is never dropped or used again (ManuallyDrop), so the allocation has one owner.
    unsafe { Vec::from_raw_parts(ptr.cast::<i64>(), len, capacity) }
}

/// SGLang's `build_transfer_entry_pairs`; when both sides give roles, entries pair only with
/// entries of the same role (keyed by (layer id, role), or by position within each role).
#[pyfunction]
#[pyo3(signature = (src_layer_ids, dst_layer_ids, n_src, n_dst, allow_positional_fallback=false, *, src_roles=None, dst_roles=None))]
#[allow(clippy::too_many_arguments)]
pub fn pair_entries(
    py: Python<'_>,
    src_layer_ids: Option<Vec<i64>>,
    dst_layer_ids: Option<Vec<i64>>,
    n_src: usize,
    n_dst: usize,
    allow_positional_fallback: bool,
    src_roles: Option<Vec<String>>,
    dst_roles: Option<Vec<String>>,
) -> PyResult<Bound<'_, PyArray2<i64>>> {
    let src = EntryMetadata {
        layer_ids: src_layer_ids.as_deref(),
        roles: src_roles.as_deref(),
        n_entries: n_src,
    };
    let dst = EntryMetadata {
        layer_ids: dst_layer_ids.as_deref(),
        roles: dst_roles.as_deref(),
        n_entries: n_dst,
    };
    let pairs =
        kvplan_core::pair_entries(src, dst, allow_positional_fallback).map_err(to_py_err)?;
    pairs_array(py, pairs.into_iter())
}

fn parse_legacy_kind(kind: &str) -> PyResult<LegacyKind> {
    match kind {
        "mla" => Ok(LegacyKind::Mla),
        "mha" => Ok(LegacyKind::Mha),
        other => Err(KvPlanError::new_err(format!(
            "legacy kind must be \"mla\" or \"mha\", got {other:?}"
        ))),
    }
}

/// Positional PP slicing for peers without layer ids (strict; see the core's `legacy_pp_pairs`).
#[pyfunction]
#[pyo3(signature = (kind, n_src, n_dst, prefill_start_layer, *, num_draft_entries=0, decode_num_layers=None))]
pub fn legacy_pp_pairs<'py>(
    py: Python<'py>,
    kind: &str,
    n_src: usize,
    n_dst: usize,
    prefill_start_layer: usize,
    num_draft_entries: usize,
    decode_num_layers: Option<usize>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let kind = parse_legacy_kind(kind)?;
    let pairs = kvplan_core::legacy_pp_pairs(
        kind,
        n_src,
        n_dst,
        prefill_start_layer,
        num_draft_entries,
        decode_num_layers,
    )
    .map_err(to_py_err)?;
    pairs_array(py, pairs.into_iter())
}

/// `(buffers pooled, bytes pooled, hits, misses)` of the plan output pool.
#[pyfunction]
pub fn pool_stats() -> (usize, usize, u64, u64) {
    pool::stats()
}

/// Owner of a plan's memory. NumPy arrays of a plan view it; when the last one dies the buffer
/// returns to the pool.
#[pyclass(frozen, name = "PlanBuffer", module = "kvplan._core")]
pub struct PyPlanBuffer {
    data: Vec<u64>,
}

impl Drop for PyPlanBuffer {
    fn drop(&mut self) {
        pool::give_back(std::mem::take(&mut self.data));
    }
}

#[pymethods]
impl PyPlanBuffer {
    /// Bytes held (the pooled capacity, which may exceed the plan's own bytes).
    #[getter]
    fn nbytes(&self) -> usize {
        self.data.len() * 8
    }
}

type Column<'py> = Bound<'py, PyArray1<u64>>;
/// What `_plan` returns, laid out as `kvplan.TransferPlan`'s tuple fields: `(src_addrs,
/// dst_addrs, lengths, n_runs, total_bytes, emitting)`. When the plan was written into `out`,
/// the first field is the block count and the next two are `None` (Python slices `out`).
type RawPlan<'py> = (
    Bound<'py, PyAny>,
    Option<Column<'py>>,
    Option<Column<'py>>,
    usize,
    u64,
    Py<PyTuple>,
);

fn template_options(
    allow_positional_fallback: bool,
    prefill_start_layer: Option<usize>,
    legacy_kind: Option<&str>,
    check_dst_overlap: bool,
) -> PyResult<TemplateOptions> {
    Ok(TemplateOptions {
        allow_positional_fallback,
        prefill_start_layer,
        legacy_kind: legacy_kind.map(parse_legacy_kind).transpose()?,
        check_dst_overlap,
    })
}

/// `(kind, src_entry, dst_entry or None, problem or None, exception name or None)`.
type EntryCheckRow = (
    &'static str,
    usize,
    Option<usize>,
    Option<String>,
    Option<String>,
);

/// One row per source entry, page entries first: its partner or why it has none.
/// `Template(...)` raises exactly the first problem listed here.
#[pyfunction]
#[pyo3(signature = (src_layout, dst_layout, allow_positional_fallback=false, *, prefill_start_layer=None, legacy_kind=None))]
pub fn check_pairs(
    py: Python<'_>,
    src_layout: PyRef<'_, PyLayout>,
    dst_layout: PyRef<'_, PyLayout>,
    allow_positional_fallback: bool,
    prefill_start_layer: Option<usize>,
    legacy_kind: Option<&str>,
) -> PyResult<Vec<EntryCheckRow>> {
    let options = template_options(
        allow_positional_fallback,
        prefill_start_layer,
        legacy_kind,
        false,
    )?;
    let checks = kvplan_core::check_pairs(&src_layout.inner, &dst_layout.inner, options);
    checks
        .into_iter()
        .map(|c| {
            let problem = c.problem.map(|p| (p.to_string(), to_py_err(p)));
            // The exception's own type name: the one mapping in errors.rs decides both.
            let (message, name) = match problem {
                Some((message, err)) => (Some(message), Some(err.get_type(py).name()?.to_string())),
                None => (None, None),
            };
            Ok((c.kind.as_str(), c.src_entry, c.dst_entry, message, name))
        })
        .collect()
}

/// Borrows `out` for writing: a `TypeError` for a wrong type or dtype, a `KvPlanError` for a
/// wrong layout, a read-only array or one whose memory overlaps an input (never a panic).
fn writable_out<'py>(
    out: &Bound<'py, PyAny>,
    inputs: [(&IndexArray<'_>, &str); 2],
) -> PyResult<PyReadwriteArray2<'py, u64>> {
    let array = out.cast::<PyArray2<u64>>().map_err(|_| {
        PyTypeError::new_err("out must be a 2-D numpy array of dtype uint64 with shape (3, M)")
    })?;
    // A Fortran-ordered array would have a slice view too, with the rows scrambled.
    if !array.is_c_contiguous() || array.shape()[0] != 3 {
        return Err(KvPlanError::new_err(format!(
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

/// A compiled peer pair. Python's `kvplan.Template` subclasses it to return `TransferPlan`s.
#[pyclass(frozen, subclass, name = "Template", module = "kvplan._core")]
pub struct PyTemplate {
    inner: Template,
    /// Per page pair, whether it emits blocks; shared by every plan of this template.
    emitting: Py<PyTuple>,
}

struct PlanPooled<'t>(&'t Template);

impl IndexVisitor for PlanPooled<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, PlanSummary)>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        self.0.plan_into(src, dst, |shape| {
            Ok(FlatBuffer {
                data: pool::take(shape.n_blocks.saturating_mul(3))?,
                capacity: shape.n_blocks,
            })
        })
    }
}

struct PlanInto<'t, 'o>(&'t Template, Columns<'o>);

impl IndexVisitor for PlanInto<'_, '_> {
    type Output = kvplan_core::Result<PlanSummary>;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        let columns = self.1;
        self.0
            .plan_into(src, dst, move |_| Ok(columns))
            .map(|(_, summary)| summary)
    }
}

#[pymethods]
impl PyTemplate {
    #[new]
    #[pyo3(signature = (src_layout, dst_layout, allow_positional_fallback=false, *, prefill_start_layer=None, legacy_kind=None, check_dst_overlap=false))]
    fn new(
        py: Python<'_>,
        src_layout: PyRef<'_, PyLayout>,
        dst_layout: PyRef<'_, PyLayout>,
        allow_positional_fallback: bool,
        prefill_start_layer: Option<usize>,
        legacy_kind: Option<&str>,
        check_dst_overlap: bool,
    ) -> PyResult<Self> {
        let options = template_options(
            allow_positional_fallback,
            prefill_start_layer,
            legacy_kind,
            check_dst_overlap,
        )?;
        let inner =
            Template::new(&src_layout.inner, &dst_layout.inner, options).map_err(to_py_err)?;
        let emitting =
            PyTuple::new(py, inner.page_pairs().iter().map(|p| p.item_len > 0))?.unbind();
        Ok(Self { inner, emitting })
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

    /// Per page pair: whether it emits blocks (item length > 0).
    #[getter]
    fn emitting(&self, py: Python<'_>) -> Py<PyTuple> {
        self.emitting.clone_ref(py)
    }

    #[getter]
    fn pair_item_lens(&self) -> Vec<u64> {
        self.inner.page_pairs().iter().map(|p| p.item_len).collect()
    }

    /// Bytes moved per page index pair.
    #[getter]
    fn bytes_per_page(&self) -> u64 {
        self.inner.bytes_per_page()
    }

    /// Plans one request. Contract: 1-D C-contiguous int32/int64 index arrays (borrowed, not
    /// copied); GIL released while planning. Without `out`, the columns view one pooled buffer.
    /// With `out` (C-contiguous `(3, M)` uint64), the columns are written into its rows and
    /// `None` is returned in their place.
    #[pyo3(signature = (src_pages, dst_pages, out=None))]
    fn _plan<'py>(
        &self,
        py: Python<'py>,
        src_pages: &Bound<'py, PyAny>,
        dst_pages: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<RawPlan<'py>> {
        let (src_array, dst_array) = (
            IndexArray::extract(src_pages, "src_pages")?,
            IndexArray::extract(dst_pages, "dst_pages")?,
        );
        let (src, dst) = (
            src_array.as_slice("src_pages")?,
            dst_array.as_slice("dst_pages")?,
        );
        let template = &self.inner;
        if let Some(out) = out {
            let mut out =
                writable_out(out, [(&src_array, "src_pages"), (&dst_array, "dst_pages")])?;
            let capacity = out.shape()[1];
            let flat = out.as_slice_mut()?;
            let columns = Columns::from_flat(flat, capacity);
            let summary =
                visit_request(py, src, dst, PlanInto(template, columns)).map_err(to_py_err)?;
            let n_blocks = summary.n_blocks.into_pyobject(py)?.into_any();
            let emitting = self.emitting.clone_ref(py);
            return Ok((
                n_blocks,
                None,
                None,
                summary.n_runs,
                summary.total_bytes,
                emitting,
            ));
        }
        let (buffer, summary) =
            visit_request(py, src, dst, PlanPooled(template)).map_err(to_py_err)?;
        let n = summary.n_blocks;
        let stride = buffer.capacity;
        let owner = Bound::new(py, PyPlanBuffer { data: buffer.data })?;
        let data = owner.get().data.as_slice();
        let column = |k: usize| -> Column<'py> {
            let view = ArrayView1::from(&data[k * stride..k * stride + n]);
            // SAFETY: the array keeps `owner` alive through its base reference; `owner` is frozen,
            // so its Vec is never mutated, moved or reallocated until the owner is dropped.
            unsafe { PyArray1::borrow_from_array(&view, owner.clone().into_any()) }
        };
        Ok((
            column(0).into_any(),
            Some(column(1)),
            Some(column(2)),
            summary.n_runs,
            summary.total_bytes,
            self.emitting.clone_ref(py),
        ))
    }

    /// Plans one per-request state slot: one block per state pair.
    #[pyo3(signature = (src_slot, dst_slot))]
    fn _plan_state<'py>(
        &self,
        py: Python<'py>,
        src_slot: i64,
        dst_slot: i64,
    ) -> PyResult<(Column<'py>, Column<'py>, Column<'py>)> {
        let n = self.inner.state_pairs().len();
        let mut buffer = FlatBuffer::try_zeroed(n).map_err(to_py_err)?;
        let written = self
            .inner
            .plan_state_into(src_slot, dst_slot, Columns::from_flat(&mut buffer.data, n))
            .map_err(to_py_err)?;
        let (src_addrs, dst_addrs, lengths) = buffer.into_columns(written).map_err(to_py_err)?;
        Ok((
            src_addrs.into_pyarray(py),
            dst_addrs.into_pyarray(py),
            lengths.into_pyarray(py),
        ))
    }
}
