//! Plans as Python objects: `TransferPlan` (a request's blocks plus what they are made of) and
//! `PlanBatch` (a slice of blocks for one engine submission). Both hold three uint64 NumPy
//! columns that view Rust- or caller-owned memory without a copy; nothing is built per block.

use std::sync::Arc;

use numpy::ndarray::ArrayView1;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PySlice;

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

/// Three equally long uint64 columns: source addresses, destination addresses, lengths.
struct Blocks {
    src_addrs: Column,
    dst_addrs: Column,
    lengths: Column,
}

impl Blocks {
    fn n_blocks(&self, py: Python<'_>) -> usize {
        self.lengths.bind(py).len()
    }

    fn as_lists(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
        let list = |c: &Column| c.bind(py).call_method0("tolist").map(Bound::unbind);
        Ok((
            list(&self.src_addrs)?,
            list(&self.dst_addrs)?,
            list(&self.lengths)?,
        ))
    }

    fn slice(&self, py: Python<'_>, start: usize, stop: usize) -> PyResult<Blocks> {
        let slice = PySlice::new(py, start as isize, stop as isize, 1);
        let cut = |c: &Column| -> PyResult<Column> {
            Ok(c.bind(py)
                .get_item(&slice)?
                .cast_into::<PyArray1<u64>>()?
                .unbind())
        };
        Ok(Blocks {
            src_addrs: cut(&self.src_addrs)?,
            dst_addrs: cut(&self.dst_addrs)?,
            lengths: cut(&self.lengths)?,
        })
    }
}

/// A slice of a plan's blocks (views, no copy), sized for one engine submission. It unpacks
/// as `src_addrs, dst_addrs, lengths = batch`.
#[pyclass(frozen, name = "PlanBatch", module = "kvplan._core")]
pub struct PyPlanBatch {
    blocks: Blocks,
}

#[pymethods]
impl PyPlanBatch {
    /// Three equally long 1-D uint64 arrays (kept, not copied).
    #[new]
    fn new(
        src_addrs: Bound<'_, PyArray1<u64>>,
        dst_addrs: Bound<'_, PyArray1<u64>>,
        lengths: Bound<'_, PyArray1<u64>>,
    ) -> PyResult<Self> {
        let lens = [src_addrs.len(), dst_addrs.len(), lengths.len()];
        if lens[0] != lens[1] || lens[1] != lens[2] {
            return Err(KvPlanError::new_err(format!(
                "src_addrs, dst_addrs and lengths must have equal lengths, got {}, {} and {}",
                lens[0], lens[1], lens[2]
            )));
        }
        Ok(Self {
            blocks: Blocks {
                src_addrs: src_addrs.unbind(),
                dst_addrs: dst_addrs.unbind(),
                lengths: lengths.unbind(),
            },
        })
    }

    #[getter]
    fn src_addrs(&self, py: Python<'_>) -> Column {
        self.blocks.src_addrs.clone_ref(py)
    }

    #[getter]
    fn dst_addrs(&self, py: Python<'_>) -> Column {
        self.blocks.dst_addrs.clone_ref(py)
    }

    #[getter]
    fn lengths(&self, py: Python<'_>) -> Column {
        self.blocks.lengths.clone_ref(py)
    }

    #[getter]
    fn n_blocks(&self, py: Python<'_>) -> usize {
        self.blocks.n_blocks(py)
    }

    /// The three columns as Python lists, the argument type engines convert fastest.
    fn as_lists(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
        self.blocks.as_lists(py)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let columns = (self.src_addrs(py), self.dst_addrs(py), self.lengths(py));
        columns
            .into_pyobject(py)?
            .into_any()
            .try_iter()
            .map(Bound::into_any)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("PlanBatch(n_blocks={})", self.blocks.n_blocks(py))
    }
}

/// How a template's blocks divide among its emission groups and entry pairs, whatever the
/// request: a group emits `per_run` blocks per run and `per_page` blocks per page; its blocks
/// belong to its last pair (the other pairs of a coalesced group, and elided pairs, own none).
pub(crate) struct BlockShape {
    /// Per group: (blocks per run, blocks per page).
    pub(crate) groups: Vec<(usize, usize)>,
    /// Per entry pair: its group, or `None` for an elided pair.
    pub(crate) pair_groups: Vec<Option<usize>>,
    /// Per entry pair: whether it owns its group's blocks.
    pub(crate) owner: Vec<bool>,
    /// Per group, for token plans: its token pieces of each class (empty when the template
    /// cannot plan by token).
    pub(crate) token_groups: Vec<[usize; kvplan_core::TOKEN_CLASSES]>,
    /// Fingerprints of the (prefill, decode) layouts the template was built from (`None` when
    /// a layout has no wire encoding, e.g. a role longer than the format allows).
    pub(crate) fingerprints: Option<(u64, u64)>,
}

impl BlockShape {
    /// The fingerprints of a template's two layouts, for the plan digest.
    pub(crate) fn fingerprints(
        src: &kvplan_core::Layout,
        dst: &kvplan_core::Layout,
    ) -> Option<(u64, u64)> {
        let src = kvplan_core::layout_fingerprint(src).ok()?;
        Some((src, kvplan_core::layout_fingerprint(dst).ok()?))
    }

    /// The shape of a page template.
    pub(crate) fn of_pages(
        template: &kvplan_core::Template,
        fingerprints: Option<(u64, u64)>,
    ) -> Self {
        let groups = template
            .groups()
            .iter()
            .map(|g| (g.per_run, g.per_page))
            .collect();
        let owners = template.groups().iter().map(|g| g.last_pair);
        let mut owner = vec![false; template.page_pairs().len()];
        for last in owners {
            owner[last] = true;
        }
        let token_groups = template.token_template().map_or_else(
            |_| Vec::new(),
            |tokens| {
                let groups = template.groups().iter();
                groups
                    .map(|g| {
                        let mut classes = [0; kvplan_core::TOKEN_CLASSES];
                        let (start, end) = (
                            tokens.pair_pieces[g.first_pair].0,
                            tokens.pair_pieces[g.last_pair].1,
                        );
                        for piece in &tokens.pieces[start..end] {
                            classes[piece.class] += 1;
                        }
                        classes
                    })
                    .collect()
            },
        );
        Self {
            groups,
            pair_groups: template.pair_groups().to_vec(),
            owner,
            token_groups,
            fingerprints,
        }
    }

    /// The shape of a state plan: one block per emitting state pair.
    pub(crate) fn of_state(
        template: &kvplan_core::Template,
        fingerprints: Option<(u64, u64)>,
    ) -> Self {
        let mut groups = Vec::new();
        let pair_groups: Vec<Option<usize>> = template
            .state_pairs()
            .iter()
            .map(|p| {
                (p.item_len > 0).then(|| {
                    groups.push((1, 0));
                    groups.len() - 1
                })
            })
            .collect();
        let owner = pair_groups.iter().map(Option::is_some).collect();
        Self {
            groups,
            pair_groups,
            owner,
            token_groups: Vec::new(),
            fingerprints,
        }
    }
}

/// A plan's block counts: the template's [`BlockShape`] for this request's runs and pages.
pub(crate) struct PairShape {
    pub(crate) shape: Arc<BlockShape>,
    pub(crate) runs: usize,
    pub(crate) pages: usize,
    /// A token plan: blocks one piece of each class emits.
    pub(crate) tokens: Option<[usize; kvplan_core::TOKEN_CLASSES]>,
}

impl PairShape {
    fn group_len(&self, group: usize) -> usize {
        if let Some(blocks) = &self.tokens {
            let classes = self.shape.token_groups[group].iter();
            return classes
                .zip(blocks)
                .map(|(pieces, blocks)| pieces * blocks)
                .sum();
        }
        let (per_run, per_page) = self.shape.groups[group];
        per_run * self.runs + per_page * self.pages
    }

    /// Blocks owned by pair `pair`.
    fn pair_len(&self, pair: usize) -> usize {
        match self.shape.pair_groups[pair] {
            Some(group) if self.shape.owner[pair] => self.group_len(group),
            _ => 0,
        }
    }

    fn offsets(lens: impl Iterator<Item = usize>) -> Vec<i64> {
        let mut offsets = vec![0i64];
        let mut at = 0i64;
        for len in lens {
            at += len as i64;
            offsets.push(at);
        }
        offsets
    }
}

/// The `(src_addr, dst_addr, length)` blocks of one request, entry-pair major, run minor.
///
/// The three uint64 arrays view one pooled Rust buffer (or the caller's `out=` array) without
/// a copy; a pooled buffer returns to kvplan's pool when the last of them dies, so they stay
/// valid after the plan object is gone.
#[pyclass(frozen, name = "TransferPlan", module = "kvplan._core")]
pub struct PyTransferPlan {
    blocks: Blocks,
    n_blocks: usize,
    n_runs: usize,
    total_bytes: u64,
    pairs: PairShape,
}

impl PyTransferPlan {
    pub(crate) fn new(
        [src_addrs, dst_addrs, lengths]: [Column; 3],
        n_blocks: usize,
        n_runs: usize,
        total_bytes: u64,
        pairs: PairShape,
    ) -> Self {
        Self {
            blocks: Blocks {
                src_addrs,
                dst_addrs,
                lengths,
            },
            n_blocks,
            n_runs,
            total_bytes,
            pairs,
        }
    }
}

impl PyTransferPlan {
    /// Block offsets of every entry pair (`n_pairs + 1` values).
    fn pair_offset_values(&self) -> Vec<usize> {
        let n = self.pairs.shape.pair_groups.len();
        let mut offsets = Vec::with_capacity(n + 1);
        let mut at = 0;
        offsets.push(at);
        for p in 0..n {
            at += self.pairs.pair_len(p);
            offsets.push(at);
        }
        offsets
    }

    /// Runs `f` on the plan's columns and pair offsets as slices (borrowed, not copied).
    fn with_blocks<R>(
        &self,
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
        let (src, dst, lengths) = (
            borrow(&self.blocks.src_addrs)?,
            borrow(&self.blocks.dst_addrs)?,
            borrow(&self.blocks.lengths)?,
        );
        let offsets = self.pair_offset_values();
        f(&kvplan_core::PlanBlocks {
            src_addrs: src.as_slice()?,
            dst_addrs: dst.as_slice()?,
            lengths: lengths.as_slice()?,
            pair_offsets: &offsets,
        })
    }

    fn fingerprints(&self) -> PyResult<(u64, u64)> {
        self.pairs.shape.fingerprints.ok_or_else(|| {
            KvPlanError::new_err(
                "this plan's layouts have no wire encoding (a role or device name longer than \
                 65,535 bytes), so they have no fingerprint and the plan no digest",
            )
        })
    }

    fn pair_digest_values(
        &self,
        py: Python<'_>,
        side: &str,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u64>> {
        let side = crate::digest::parse_side(side)?;
        let buffers = crate::digest::Buffers::extract(py, buffers)?;
        self.with_blocks(py, |blocks| {
            crate::digest::pair_digests(py, blocks, side, &buffers)
        })
    }
}

#[pymethods]
impl PyTransferPlan {
    #[getter]
    fn src_addrs(&self, py: Python<'_>) -> Column {
        self.blocks.src_addrs.clone_ref(py)
    }

    #[getter]
    fn dst_addrs(&self, py: Python<'_>) -> Column {
        self.blocks.dst_addrs.clone_ref(py)
    }

    #[getter]
    fn lengths(&self, py: Python<'_>) -> Column {
        self.blocks.lengths.clone_ref(py)
    }

    #[getter]
    fn n_blocks(&self) -> usize {
        self.n_blocks
    }

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

    /// Entry pairs of the template (including elided pairs that emit nothing).
    #[getter]
    fn n_pairs(&self) -> usize {
        self.pairs.shape.pair_groups.len()
    }

    /// `n_pairs + 1` block offsets (int64): pair p's blocks are
    /// `pair_offsets[p]:pair_offsets[p+1]`. A coalesced group's blocks belong to its last pair.
    #[getter]
    fn pair_offsets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let n = self.pairs.shape.pair_groups.len();
        PairShape::offsets((0..n).map(|p| self.pairs.pair_len(p))).into_pyarray(py)
    }

    /// The block range of entry pair `pair` (`pair_offsets[pair]:pair_offsets[pair+1]`).
    fn pair_blocks<'py>(&self, py: Python<'py>, pair: isize) -> PyResult<Bound<'py, PySlice>> {
        let n = self.pairs.shape.pair_groups.len() as isize;
        let index = if pair < 0 { pair + n } else { pair };
        if !(0..n).contains(&index) {
            return Err(PyIndexError::new_err(format!(
                "pair {pair} is out of range for a plan of {n} entry pairs"
            )));
        }
        let index = index as usize;
        let start: usize = (0..index).map(|p| self.pairs.pair_len(p)).sum();
        let stop = start + self.pairs.pair_len(index);
        Ok(PySlice::new(py, start as isize, stop as isize, 1))
    }

    /// Emission groups (one per emitting pair unless pairs were coalesced).
    #[getter]
    fn n_groups(&self) -> usize {
        self.pairs.shape.groups.len()
    }

    /// `n_groups + 1` block offsets (int64): group g's blocks are
    /// `group_offsets[g]:group_offsets[g+1]`.
    #[getter]
    fn group_offsets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let n = self.pairs.shape.groups.len();
        PairShape::offsets((0..n).map(|g| self.pairs.group_len(g))).into_pyarray(py)
    }

    /// The group of each entry pair (int64; -1 for an elided pair).
    #[getter]
    fn pair_groups<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let groups = self.pairs.shape.pair_groups.iter();
        groups
            .map(|g| g.map_or(-1, |g| g as i64))
            .collect::<Vec<_>>()
            .into_pyarray(py)
    }

    /// The block range of group `group` (all blocks carrying its pairs' bytes).
    fn group_blocks<'py>(&self, py: Python<'py>, group: isize) -> PyResult<Bound<'py, PySlice>> {
        let n = self.pairs.shape.groups.len() as isize;
        let index = if group < 0 { group + n } else { group };
        if !(0..n).contains(&index) {
            return Err(PyIndexError::new_err(format!(
                "group {group} is out of range for a plan of {n} groups"
            )));
        }
        let index = index as usize;
        let start: usize = (0..index).map(|g| self.pairs.group_len(g)).sum();
        let stop = start + self.pairs.group_len(index);
        Ok(PySlice::new(py, start as isize, stop as isize, 1))
    }

    /// Consecutive views of at most `max_blocks` blocks each (none for an empty plan).
    fn batches(&self, py: Python<'_>, max_blocks: i64) -> PyResult<Vec<PyPlanBatch>> {
        if max_blocks <= 0 {
            return Err(KvPlanError::new_err(format!(
                "max_blocks must be positive, got {max_blocks}"
            )));
        }
        let step = usize::try_from(max_blocks).unwrap_or(usize::MAX);
        (0..self.n_blocks)
            .step_by(step)
            .map(|start| {
                let stop = start.saturating_add(step).min(self.n_blocks);
                Ok(PyPlanBatch {
                    blocks: self.blocks.slice(py, start, stop)?,
                })
            })
            .collect()
    }

    /// All blocks as three Python lists (one `.tolist()` each, no Python loop per block).
    fn as_lists(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
        self.blocks.as_lists(py)
    }

    /// Fingerprints (XXH3-64 of the wire encoding) of the prefill and decode layouts the plan
    /// was planned between.
    #[getter]
    fn layout_fingerprints(&self) -> PyResult<(u64, u64)> {
        self.fingerprints()
    }

    /// The plan digest: a 64-bit integer hashing both layout fingerprints, the pair offsets and
    /// every block in plan order (encoding in docs/integrity.md). Equal on two peers exactly
    /// when they planned the same blocks between the same layouts.
    fn digest(&self, py: Python<'_>) -> PyResult<u64> {
        let fingerprints = self.fingerprints()?;
        self.with_blocks(py, |blocks| {
            let run = || kvplan_core::plan_digest(fingerprints, blocks);
            let digest = if blocks.lengths.len() >= 4096 {
                py.detach(run)
            } else {
                run()
            };
            digest.map_err(crate::errors::to_py_err)
        })
    }

    /// The digest of each entry pair's bytes (uint64, `n_pairs` values), read in plan order
    /// from `side` (`"src"` or `"dst"`) memory held by `buffers` (numpy arrays or other
    /// C-contiguous buffer-protocol objects, borrowed without a copy; the GIL is released
    /// while hashing). Every block must lie inside one buffer, else `IndexBoundsError`.
    fn pair_content_digests<'py>(
        &self,
        py: Python<'py>,
        side: &str,
        buffers: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        Ok(self.pair_digest_values(py, side, buffers)?.into_pyarray(py))
    }

    /// The content digest: a 64-bit integer over the pair digests of `side` (see
    /// `pair_content_digests`). The prefill's over `"src"` equals the decode's over `"dst"`
    /// exactly when every planned byte arrived at its planned place.
    fn content_digest(
        &self,
        py: Python<'_>,
        side: &str,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let pairs = self.pair_digest_values(py, side, buffers)?;
        Ok(kvplan_core::content_digest(&pairs))
    }

    fn __len__(&self) -> usize {
        self.n_blocks
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferPlan(n_blocks={}, n_runs={}, n_pairs={}, total_bytes={})",
            self.n_blocks,
            self.n_runs,
            self.pairs.shape.pair_groups.len(),
            self.total_bytes
        )
    }
}
