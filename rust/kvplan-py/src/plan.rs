//! Plans as Python objects: `TransferPlan` (a request's blocks plus what they are made of) and
//! `BlockSlice` (a slice of blocks, e.g. for one engine submission). Both hold three uint64 NumPy
//! columns that view Rust- or caller-owned memory without a copy; nothing is built per block.

use std::sync::Arc;

use numpy::ndarray::ArrayView1;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PySlice;

use kvplan_core::{FlatBuffer, PlanSummary, Template};

use crate::errors::KvPlanError;
use crate::pool;

pub(crate) type Column = Py<PyArray1<u64>>;

/// Owner of a pooled plan's memory. The plan's NumPy columns hold it as their base object; when
/// the last of them dies the buffer returns to the pool.
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

/// The three columns `[k*stride, k*stride + n)` of a pooled buffer, as arrays owning it.
pub(crate) fn pooled_columns(
    py: Python<'_>,
    data: Vec<u64>,
    stride: usize,
    n: usize,
) -> PyResult<[Column; 3]> {
    let owner = Bound::new(py, PyPlanBuffer { data })?;
    let data = owner.get().data.as_slice();
    let column = |k: usize| -> Column {
        let view = ArrayView1::from(&data[k * stride..k * stride + n]);
        // SAFETY: the array keeps `owner` alive through its base reference; `owner` is frozen,
        // so its Vec is never mutated, moved or reallocated until the owner is dropped.
        unsafe { PyArray1::borrow_from_array(&view, owner.clone().into_any()) }.unbind()
    };
    Ok([column(0), column(1), column(2)])
}

/// Output columns for a plan of this shape, from the pool (warm memory when a plan of similar
/// size has died since).
pub(crate) fn pooled(shape: &PlanSummary) -> kvplan_core::Result<FlatBuffer> {
    Ok(FlatBuffer {
        data: pool::take(shape.n_blocks.saturating_mul(3))?,
        capacity: shape.n_blocks,
    })
}

/// A small core plan's three columns moved into NumPy arrays (the plan keeps its counts and
/// offsets; its columns are left empty).
pub(crate) fn owned_columns(py: Python<'_>, plan: &mut kvplan_core::Plan) -> [Column; 3] {
    [
        std::mem::take(&mut plan.src_addrs),
        std::mem::take(&mut plan.dst_addrs),
        std::mem::take(&mut plan.lengths),
    ]
    .map(|column| PyArray1::from_vec(py, column).unbind())
}

/// The first `n` values of each row of a caller's `(3, M)` array, as plain 1-D `ndarray` views
/// (also when `out` is a subclass such as `np.matrix`, whose rows would stay 2-D).
pub(crate) fn out_columns(out: &Bound<'_, numpy::PyArray2<u64>>, n: usize) -> [Column; 3] {
    let stride = out.shape()[1];
    let base = out.data().cast_const();
    let column = |k: usize| -> Column {
        // SAFETY: `out` is C-contiguous with 3 rows of `stride` values (checked before
        // planning), `n <= stride`, and the new array holds `out` as its base object, so the
        // memory outlives the view; NumPy never reallocates an array that has views.
        unsafe {
            let row = std::slice::from_raw_parts(base.add(k * stride), n);
            PyArray1::borrow_from_array(&ArrayView1::from(row), out.clone().into_any())
        }
        .unbind()
    };
    [column(0), column(1), column(2)]
}

/// Three equally long uint64 columns (source addresses, destination addresses, lengths): the
/// base of every plan-like result (`TransferPlan`, `BatchPlan`, `BlockSlice`), which owns the columns and
/// the views of them every engine adapter reads.
#[pyclass(frozen, subclass, name = "Blocks", module = "kvplan._core")]
pub struct PyBlocks {
    src_addrs: Column,
    dst_addrs: Column,
    lengths: Column,
}

impl PyBlocks {
    pub(crate) fn new([src_addrs, dst_addrs, lengths]: [Column; 3]) -> Self {
        Self {
            src_addrs,
            dst_addrs,
            lengths,
        }
    }

    pub(crate) fn len(&self, py: Python<'_>) -> usize {
        self.lengths.bind(py).len()
    }

    /// Views of blocks `start..stop` (no copy).
    pub(crate) fn slice(&self, py: Python<'_>, start: usize, stop: usize) -> PyResult<Self> {
        let slice = PySlice::new(py, start as isize, stop as isize, 1);
        let cut = |c: &Column| -> PyResult<Column> {
            Ok(c.bind(py)
                .get_item(&slice)?
                .cast_into::<PyArray1<u64>>()?
                .unbind())
        };
        Ok(Self::new([
            cut(&self.src_addrs)?,
            cut(&self.dst_addrs)?,
            cut(&self.lengths)?,
        ]))
    }

    /// The three column arrays.
    fn arrays<'py>(&self, py: Python<'py>) -> [&Bound<'py, PyArray1<u64>>; 3] {
        [
            self.src_addrs.bind(py),
            self.dst_addrs.bind(py),
            self.lengths.bind(py),
        ]
    }
}

#[pymethods]
impl PyBlocks {
    /// Source addresses (uint64, viewed, not copied).
    #[getter]
    fn src_addrs(&self, py: Python<'_>) -> Column {
        self.src_addrs.clone_ref(py)
    }

    /// Destination addresses (uint64).
    #[getter]
    fn dst_addrs(&self, py: Python<'_>) -> Column {
        self.dst_addrs.clone_ref(py)
    }

    /// Lengths in bytes (uint64).
    #[getter]
    fn lengths(&self, py: Python<'_>) -> Column {
        self.lengths.clone_ref(py)
    }

    /// Blocks held.
    #[getter]
    fn n_blocks(&self, py: Python<'_>) -> usize {
        self.len(py)
    }

    /// The three columns as Python lists (one `.tolist()` each, no Python loop per block), the
    /// argument type engines convert fastest.
    fn as_lists(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
        let list = |c: &Column| c.bind(py).call_method0("tolist").map(Bound::unbind);
        Ok((
            list(&self.src_addrs)?,
            list(&self.dst_addrs)?,
            list(&self.lengths)?,
        ))
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.len(py)
    }
}

/// A run of blocks (views, no copy): a slice of a plan's blocks (`batches(max_blocks)` sizes
/// them for one engine submission) or three columns built by hand. It unpacks as
/// `src_addrs, dst_addrs, lengths = blocks`. Its old name, `PlanBatch`, is an alias in
/// `kvplan._core` for this release.
#[pyclass(frozen, extends = PyBlocks, name = "BlockSlice", module = "kvplan._core")]
pub struct PyBlockSlice;

#[pymethods]
impl PyBlockSlice {
    /// Three equally long 1-D uint64 arrays (kept, not copied).
    #[new]
    fn new(
        src_addrs: Bound<'_, PyArray1<u64>>,
        dst_addrs: Bound<'_, PyArray1<u64>>,
        lengths: Bound<'_, PyArray1<u64>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let lens = [src_addrs.len(), dst_addrs.len(), lengths.len()];
        if lens[0] != lens[1] || lens[1] != lens[2] {
            return Err(KvPlanError::new_err(format!(
                "src_addrs, dst_addrs and lengths must have equal lengths, got {}, {} and {}",
                lens[0], lens[1], lens[2]
            )));
        }
        let blocks = PyBlocks::new([src_addrs.unbind(), dst_addrs.unbind(), lengths.unbind()]);
        Ok(PyClassInitializer::from(blocks).add_subclass(Self))
    }

    fn __iter__<'py>(slf: PyRef<'py, Self>, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let blocks = slf.as_super();
        let columns = (
            blocks.src_addrs(py),
            blocks.dst_addrs(py),
            blocks.lengths(py),
        );
        columns
            .into_pyobject(py)?
            .into_any()
            .try_iter()
            .map(Bound::into_any)
    }

    fn __repr__(slf: PyRef<'_, Self>, py: Python<'_>) -> String {
        format!("BlockSlice(n_blocks={})", slf.as_super().len(py))
    }
}

/// The `(src_addr, dst_addr, length)` blocks of one request, entry-pair major, run minor.
///
/// The three uint64 arrays view one pooled Rust buffer (or the caller's `out=` array) without
/// a copy; a pooled buffer returns to kvplan's pool when the last of them dies, so they stay
/// valid after the plan object is gone.
#[pyclass(frozen, extends = PyBlocks, name = "TransferPlan", module = "kvplan._core")]
pub struct PyTransferPlan {
    n_blocks: usize,
    n_runs: usize,
    total_bytes: u64,
    /// The template and the plan's summary: the core answers every block-offset question.
    template: Arc<Template>,
    summary: PlanSummary,
    /// Fingerprints of the template's two layouts (`None`: a layout has no wire encoding).
    fingerprints: Option<(u64, u64)>,
    /// A pack plan's pair offsets, from the core (`None`: a plan of the template, whose
    /// offsets the template answers from the summary).
    packed_offsets: Option<Vec<usize>>,
}

impl PyTransferPlan {
    /// A plan of `template` over `columns` (its first `summary.n_blocks` blocks).
    // The plan keeps its summary: moved in once per plan.
    #[allow(clippy::large_types_passed_by_value)]
    pub(crate) fn new(
        columns: [Column; 3],
        template: Arc<Template>,
        summary: PlanSummary,
        fingerprints: Option<(u64, u64)>,
    ) -> PyClassInitializer<Self> {
        PyClassInitializer::from(PyBlocks::new(columns)).add_subclass(Self::described(
            template,
            summary,
            fingerprints,
        ))
    }

    #[allow(clippy::large_types_passed_by_value)]
    fn described(
        template: Arc<Template>,
        summary: PlanSummary,
        fingerprints: Option<(u64, u64)>,
    ) -> Self {
        Self {
            n_blocks: summary.n_blocks,
            n_runs: summary.n_runs(),
            total_bytes: summary.total_bytes,
            template,
            summary,
            fingerprints,
            packed_offsets: None,
        }
    }

    /// One of a pack plan's two halves (gather or network), with its own pair offsets; its
    /// blocks are `columns` (`plan` gives their count as `n_runs`, its columns may be empty).
    pub(crate) fn packed(
        columns: [Column; 3],
        template: Arc<Template>,
        plan: &kvplan_core::Plan,
        fingerprints: Option<(u64, u64)>,
    ) -> PyClassInitializer<Self> {
        // Counted as runs of a page plan with no pages: the template's group and slice views
        // are refused for a pack half (it has its own pair offsets).
        let scan = kvplan_core::RunScan {
            n_runs: plan.n_runs,
            ..kvplan_core::RunScan::default()
        };
        let summary = PlanSummary {
            n_blocks: plan.n_runs,
            total_bytes: plan.total_bytes,
            unit: kvplan_core::PlanUnit::Pages(scan),
            state: None,
        };
        let mut out = Self::described(template, summary, fingerprints);
        out.packed_offsets = Some(plan.pair_offsets.clone());
        PyClassInitializer::from(PyBlocks::new(columns)).add_subclass(out)
    }

    /// Block offsets of each entry pair.
    fn offsets(&self) -> Vec<usize> {
        match &self.packed_offsets {
            Some(offsets) => offsets.clone(),
            None => self.template.pair_offsets(&self.summary),
        }
    }

    /// Refuses group and layer-slice views of a pack plan (its blocks follow the pack buffer,
    /// not the template's emission groups).
    pub(crate) fn check_grouped(&self) -> PyResult<()> {
        if self.packed_offsets.is_some() {
            return Err(KvPlanError::new_err(
                "a pack plan (gather or network half) has pair offsets but no emission groups \
                 or layer slices; use the direct plan (template.plan) for those",
            ));
        }
        Ok(())
    }

    /// The template that planned it and the plan's summary (for the core's questions).
    pub(crate) fn template_and_summary(&self) -> (&Arc<Template>, &PlanSummary) {
        (&self.template, &self.summary)
    }

    fn n_pair_slots(&self) -> usize {
        match &self.packed_offsets {
            Some(offsets) => offsets.len().saturating_sub(1),
            None => self.template.blocks().plan_pair_groups(&self.summary).len(),
        }
    }
}

/// Offsets as int64 for NumPy (block counts fit: a plan's blocks are allocated).
fn offsets_array(py: Python<'_>, offsets: Vec<usize>) -> Bound<'_, PyArray1<i64>> {
    offsets
        .into_iter()
        .map(|o| o as i64)
        .collect::<Vec<_>>()
        .into_pyarray(py)
}

/// `start..stop` of item `index` (negative counts from the end) in `offsets`.
fn range_of<'py>(
    py: Python<'py>,
    offsets: &[usize],
    index: isize,
    what: &str,
    of: &str,
) -> PyResult<Bound<'py, PySlice>> {
    let n = offsets.len() as isize - 1;
    let at = if index < 0 { index + n } else { index };
    if !(0..n).contains(&at) {
        return Err(PyIndexError::new_err(format!(
            "{what} {index} is out of range for a plan of {n} {of}"
        )));
    }
    let (start, stop) = (offsets[at as usize], offsets[at as usize + 1]);
    Ok(PySlice::new(py, start as isize, stop as isize, 1))
}

impl PyTransferPlan {
    /// Runs `f` on the plan's columns and pair offsets as slices (borrowed, not copied).
    pub(crate) fn with_blocks<R>(
        slf: &PyRef<'_, Self>,
        py: Python<'_>,
        f: impl FnOnce(&kvplan_core::PlanBlocks<'_>) -> PyResult<R>,
    ) -> PyResult<R> {
        let borrow = |c: &Column| {
            c.bind(py).try_readonly().map_err(|e| {
                KvPlanError::new_err(format!(
                    "the plan's columns are being written elsewhere: {e}"
                ))
            })
        };
        let blocks = slf.as_super();
        let (src, dst, lengths) = (
            borrow(&blocks.src_addrs)?,
            borrow(&blocks.dst_addrs)?,
            borrow(&blocks.lengths)?,
        );
        let offsets = slf.offsets();
        f(&kvplan_core::PlanBlocks {
            src_addrs: src.as_slice()?,
            dst_addrs: dst.as_slice()?,
            lengths: lengths.as_slice()?,
            pair_offsets: &offsets,
        })
    }

    /// The three column arrays (source addresses, destination addresses, lengths).
    pub(crate) fn column_arrays<'a, 'py>(
        slf: &'a PyRef<'_, Self>,
        py: Python<'py>,
    ) -> [&'a Bound<'py, PyArray1<u64>>; 3] {
        slf.as_super().arrays(py)
    }

    /// Blocks of the plan.
    pub(crate) fn n_blocks_value(&self) -> usize {
        self.n_blocks
    }

    fn fingerprints(&self) -> PyResult<(u64, u64)> {
        self.fingerprints.ok_or_else(|| {
            KvPlanError::new_err(
                "this plan's layouts have no wire encoding (a role or device name longer than \
                 65,535 bytes), so they have no fingerprint and the plan no digest",
            )
        })
    }

    fn pair_digest_values(
        slf: &PyRef<'_, Self>,
        py: Python<'_>,
        side: &str,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u64>> {
        let side = crate::digest::parse_side(side)?;
        let buffers = crate::digest::Buffers::extract(py, buffers)?;
        Self::with_blocks(slf, py, |blocks| {
            crate::digest::pair_digests(py, blocks, side, &buffers)
        })
    }
}

#[pymethods]
impl PyTransferPlan {
    /// Runs of index pairs contiguous on both sides (a state plan's slot counts as one run).
    #[getter]
    fn n_runs(&self) -> usize {
        self.n_runs
    }

    /// Bytes the plan moves.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Leading tokens of the request the plan does not move (`plan(..., skip_tokens=K)`; 0
    /// for a whole request).
    #[getter]
    fn skip_tokens(&self) -> u64 {
        self.summary.skip_tokens()
    }

    /// Entry pairs of the template (including elided pairs that emit nothing).
    #[getter]
    fn n_pairs(&self) -> usize {
        self.n_pair_slots()
    }

    /// `n_pairs + 1` block offsets (int64): pair p's blocks are
    /// `pair_offsets[p]:pair_offsets[p+1]`. A coalesced group's blocks belong to its last pair.
    #[getter]
    fn pair_offsets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        offsets_array(py, self.offsets())
    }

    /// The block range of entry pair `pair` (`pair_offsets[pair]:pair_offsets[pair+1]`).
    fn pair_blocks<'py>(&self, py: Python<'py>, pair: isize) -> PyResult<Bound<'py, PySlice>> {
        let offsets = self.offsets();
        range_of(py, &offsets, pair, "pair", "entry pairs")
    }

    /// Emission groups (one per emitting pair unless pairs were coalesced).
    #[getter]
    fn n_groups(&self) -> PyResult<usize> {
        self.check_grouped()?;
        Ok(self.template.blocks().n_groups(&self.summary))
    }

    /// `n_groups + 1` block offsets (int64): group g's blocks are
    /// `group_offsets[g]:group_offsets[g+1]`.
    #[getter]
    fn group_offsets<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        self.check_grouped()?;
        Ok(offsets_array(
            py,
            self.template.blocks().group_offsets(&self.summary),
        ))
    }

    /// The group of each entry pair (int64; -1 for an elided pair).
    #[getter]
    fn pair_groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        self.check_grouped()?;
        let groups = self.template.blocks().plan_pair_groups(&self.summary);
        Ok(groups
            .iter()
            .map(|g| g.map_or(-1, |g| g as i64))
            .collect::<Vec<_>>()
            .into_pyarray(py))
    }

    /// The block range of group `group` (all blocks carrying its pairs' bytes).
    fn group_blocks<'py>(&self, py: Python<'py>, group: isize) -> PyResult<Bound<'py, PySlice>> {
        self.check_grouped()?;
        let offsets = self.template.blocks().group_offsets(&self.summary);
        range_of(py, &offsets, group, "group", "groups")
    }

    /// Consecutive views of at most `max_blocks` blocks each (none for an empty plan).
    fn batches(
        slf: PyRef<'_, Self>,
        py: Python<'_>,
        max_blocks: i64,
    ) -> PyResult<Vec<Py<PyBlockSlice>>> {
        if max_blocks <= 0 {
            return Err(KvPlanError::new_err(format!(
                "max_blocks must be positive, got {max_blocks}"
            )));
        }
        let step = usize::try_from(max_blocks).unwrap_or(usize::MAX);
        let n = slf.n_blocks;
        (0..n)
            .step_by(step)
            .map(|start| {
                let stop = start.saturating_add(step).min(n);
                let blocks = slf.as_super().slice(py, start, stop)?;
                Py::new(
                    py,
                    PyClassInitializer::from(blocks).add_subclass(PyBlockSlice),
                )
            })
            .collect()
    }

    /// Fingerprints (XXH3-64 of the wire encoding) of the prefill and decode layouts the plan
    /// was planned between.
    #[getter]
    fn layout_fingerprints(&self) -> PyResult<(u64, u64)> {
        self.fingerprints()
    }

    /// The plan digest: a 64-bit integer hashing both layout fingerprints, the pair offsets and
    /// every block in plan order (encoding in docs/integrity.md). Equal on two peers exactly
    /// when they planned the same blocks between the same layouts. With `lease` (an object
    /// with `epoch` and `request`, such as `kvplan.leases.Lease`), the digest is bound to that
    /// allocation of the destination pages as well.
    #[pyo3(signature = (*, lease=None))]
    fn digest(
        slf: PyRef<'_, Self>,
        py: Python<'_>,
        lease: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let fingerprints = slf.fingerprints()?;
        Self::with_blocks(&slf, py, |blocks| {
            let run = || kvplan_core::plan_digest(fingerprints, blocks);
            let digest = if blocks.lengths.len() >= 4096 {
                py.detach(run)
            } else {
                run()
            };
            digest.map_err(crate::errors::to_py_err)
        })
        .and_then(|digest| crate::digest::request_digest(digest, slf.summary.skip_tokens(), lease))
    }

    /// The digest of each entry pair's bytes (uint64, `n_pairs` values), read in plan order
    /// from `side` (`"src"` or `"dst"`) memory held by `buffers` (numpy arrays or other
    /// C-contiguous buffer-protocol objects, borrowed without a copy; the GIL is released
    /// while hashing). Every block must lie inside one buffer, else `IndexBoundsError`.
    fn pair_content_digests<'py>(
        slf: PyRef<'_, Self>,
        py: Python<'py>,
        side: &str,
        buffers: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        Ok(Self::pair_digest_values(&slf, py, side, buffers)?.into_pyarray(py))
    }

    /// The content digest: a 64-bit integer over the pair digests of `side` (see
    /// `pair_content_digests`). The prefill's over `"src"` equals the decode's over `"dst"`
    /// exactly when every planned byte arrived at its planned place.
    fn content_digest(
        slf: PyRef<'_, Self>,
        py: Python<'_>,
        side: &str,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let pairs = Self::pair_digest_values(&slf, py, side, buffers)?;
        Ok(kvplan_core::content_digest(&pairs))
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferPlan(n_blocks={}, n_runs={}, n_pairs={}, total_bytes={})",
            self.n_blocks,
            self.n_runs,
            self.n_pair_slots(),
            self.total_bytes
        )
    }
}
