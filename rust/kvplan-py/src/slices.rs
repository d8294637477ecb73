//! Layer-wise streaming: `LayerGroups`, `LayerSlices` (a template's groups, built once),
//! `PlanSlices` (one plan's block ranges per group and the seal) and `WorkManifest` (expected work
//! on the wire). Every answer is the core's; this module only converts.

use std::sync::Arc;

use kvplan_core::{
    BatchCall, BatchPart, BatchSlices, LayerGroups, LayerSlices, PeerRanks, PlanSlices, Template,
    WorkManifest,
};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{KvPlanError, to_py_err};
use crate::plan::PyTransferPlan;

/// `(pp_rank, pp_size, tp_rank, tp_size)`.
type Ranks = (u32, u32, u32, u32);

fn ranks(p: PeerRanks) -> Ranks {
    (p.pp_rank, p.pp_size, p.tp_rank, p.tp_size)
}

/// Which layers stream together, keyed by global layer id, and which entries wait for the seal.
#[pyclass(frozen, name = "LayerGroups", module = "kvplan._core")]
pub struct PyLayerGroups {
    pub(crate) inner: LayerGroups,
}

fn marked(
    groups: kvplan_core::Result<LayerGroups>,
    seal_layers: Option<Vec<i64>>,
    seal_roles: Option<Vec<String>>,
) -> PyResult<PyLayerGroups> {
    let groups = groups.map_err(to_py_err)?;
    Ok(PyLayerGroups {
        inner: groups.with_seal(
            &seal_layers.unwrap_or_default(),
            &seal_roles.unwrap_or_default(),
        ),
    })
}

#[pymethods]
impl PyLayerGroups {
    /// Every layer its own group (group id = layer id).
    #[staticmethod]
    #[pyo3(signature = (*, seal_layers=None, seal_roles=None))]
    fn every_layer(
        seal_layers: Option<Vec<i64>>,
        seal_roles: Option<Vec<String>>,
    ) -> PyResult<Self> {
        marked(Ok(LayerGroups::every_layer()), seal_layers, seal_roles)
    }

    /// Groups of `size` consecutive global layer ids (layer `l` in group `l // size`).
    #[staticmethod]
    #[pyo3(signature = (size, *, seal_layers=None, seal_roles=None))]
    fn fixed(
        size: u64,
        seal_layers: Option<Vec<i64>>,
        seal_roles: Option<Vec<String>>,
    ) -> PyResult<Self> {
        marked(LayerGroups::fixed(size), seal_layers, seal_roles)
    }

    /// The caller's disjoint sets of layer ids (group `g` = `sets[g]`).
    #[staticmethod]
    #[pyo3(signature = (sets, *, seal_layers=None, seal_roles=None))]
    fn sets(
        sets: Vec<Vec<i64>>,
        seal_layers: Option<Vec<i64>>,
        seal_roles: Option<Vec<String>>,
    ) -> PyResult<Self> {
        marked(LayerGroups::sets(sets), seal_layers, seal_roles)
    }

    /// The group id of a layer (`None`: no group covers it).
    fn group_of(&self, layer: i64) -> Option<u64> {
        self.inner.group_of(layer)
    }
}

/// A template's layer groups: per group the layers it waits for and the emission groups it
/// sends; the rest is the seal. Built once per template.
#[pyclass(frozen, name = "LayerSlices", module = "kvplan._core")]
pub struct PyLayerSlices {
    template: Arc<Template>,
    inner: LayerSlices,
}

impl PyLayerSlices {
    pub(crate) fn build(template: Arc<Template>, groups: &PyLayerGroups) -> PyResult<Self> {
        let inner = LayerSlices::new(&template, &groups.inner).map_err(to_py_err)?;
        Ok(Self { template, inner })
    }
}

#[pymethods]
impl PyLayerSlices {
    /// Slices (one per listed layer group, empty ones included).
    #[getter]
    fn n_slices(&self) -> usize {
        self.inner.slices().len()
    }

    /// Each slice's layer-group id.
    #[getter]
    fn group_ids(&self) -> Vec<u64> {
        self.inner.slices().iter().map(|s| s.layer_group).collect()
    }

    /// Per slice, the layer ids it waits for (this template's layers in the group).
    #[getter]
    fn layers(&self) -> Vec<Vec<i64>> {
        self.inner
            .slices()
            .iter()
            .map(|s| s.layers.clone())
            .collect()
    }

    /// Emission groups sent with the seal.
    #[getter]
    fn seal_groups(&self) -> Vec<usize> {
        self.inner.seal_emission_groups().to_vec()
    }

    /// `((pp_rank, pp_size, tp_rank, tp_size) of the prefill, the same of the decode)`.
    #[getter]
    fn peers(&self) -> (Ranks, Ranks) {
        let (p, d) = self.inner.peers();
        (ranks(p), ranks(d))
    }

    /// The slice waiting for `layer` (`None`: a layer of the model with nothing to wait for
    /// here, a layer in no caller set included); a `KvPlanError` for an id no model layer has.
    fn slice_of_layer(&self, layer: i64) -> PyResult<Option<usize>> {
        self.inner.slice_of_layer(layer).map_err(to_py_err)
    }

    /// Cuts a plan of this template (page, token or state plan) into slices.
    fn of(&self, plan: PyRef<'_, PyTransferPlan>) -> PyResult<PyPlanSlices> {
        plan.check_grouped()?;
        let (template, summary) = plan.template_and_summary();
        if !Arc::ptr_eq(template, &self.template) {
            return Err(KvPlanError::new_err(
                "this plan was planned by another template than these slices were cut for; \
                 use template.layer_slices(groups) of the plan's own template",
            ));
        }
        Ok(PyPlanSlices {
            inner: self.inner.of(&self.template, summary),
            peers: self.inner.peers(),
        })
    }

    /// Cuts a batch plan of this template into slices: each segment cut as a plan laid out by
    /// its summary, its block ranges in the batch.
    fn of_batch(&self, batch: PyRef<'_, crate::batch::PyBatchPlan>) -> PyResult<PyBatchSlices> {
        let (template, summary) = batch.template_and_summary();
        self.check_template(template, "batch")?;
        Ok(PyBatchSlices {
            inner: self.inner.of_batch(&self.template, summary),
        })
    }
}

impl PyLayerSlices {
    fn check_template(&self, template: &Arc<Template>, what: &str) -> PyResult<()> {
        if Arc::ptr_eq(template, &self.template) {
            return Ok(());
        }
        Err(KvPlanError::new_err(format!(
            "this {what} was planned by another template than these slices were cut for; use \
             template.layer_slices(groups) of the {what}'s own template"
        )))
    }
}

/// A batch plan cut into slices: per segment its block ranges per slice and the seal, and the
/// engine calls that send a part of every segment, each naming the requests it holds.
#[pyclass(frozen, name = "BatchSlices", module = "kvplan._core")]
pub struct PyBatchSlices {
    inner: BatchSlices,
}

/// A call's ranges as an `(n, 2)` int64 array and its requests as int64.
type CallArrays<'py> = (Bound<'py, PyArray2<i64>>, Bound<'py, PyArray1<i64>>);

fn call_arrays<'py>(py: Python<'py>, call: &BatchCall) -> PyResult<CallArrays<'py>> {
    let flat: Vec<i64> = call
        .ranges
        .iter()
        .flat_map(|&(a, b)| [a as i64, b as i64])
        .collect();
    let ranges = Array2::from_shape_vec((call.ranges.len(), 2), flat)
        .map_err(|e| KvPlanError::new_err(e.to_string()))?;
    let requests: Vec<i64> = call.requests.iter().map(|&r| r as i64).collect();
    Ok((ranges.into_pyarray(py), requests.into_pyarray(py)))
}

fn max_blocks_arg(max_blocks: Option<i64>) -> PyResult<Option<usize>> {
    match max_blocks {
        None => Ok(None),
        Some(m) if m > 0 => Ok(Some(m as usize)),
        Some(m) => Err(KvPlanError::new_err(format!(
            "max_blocks must be positive, got {m}"
        ))),
    }
}

impl PyBatchSlices {
    fn calls_of<'py>(
        &self,
        py: Python<'py>,
        part: BatchPart<'_>,
        max_blocks: Option<i64>,
        skip: Option<Vec<bool>>,
    ) -> PyResult<Vec<CallArrays<'py>>> {
        let calls = self
            .inner
            .calls(part, max_blocks_arg(max_blocks)?, &skip.unwrap_or_default())
            .map_err(to_py_err)?;
        calls.iter().map(|c| call_arrays(py, c)).collect()
    }
}

#[pymethods]
impl PyBatchSlices {
    /// Segments of the batch.
    #[getter]
    fn n_segments(&self) -> usize {
        self.inner.n_segments()
    }

    /// Slices per segment (the template's layer groups).
    #[getter]
    fn n_slices(&self) -> usize {
        self.inner.n_slices
    }

    /// The engine calls sending slices `slices` of every segment: per call `(ranges, requests)`,
    /// its `(n, 2)` `[start, stop)` block ranges in the batch and the requests they hold, at
    /// most `max_blocks` blocks each (whole segments packed while they fit).
    /// Segments flagged in `skip_segments` (one bool per segment) are left out.
    #[pyo3(signature = (slices, *, max_blocks=None, skip_segments=None))]
    fn calls<'py>(
        &self,
        py: Python<'py>,
        slices: Vec<usize>,
        max_blocks: Option<i64>,
        skip_segments: Option<Vec<bool>>,
    ) -> PyResult<Vec<CallArrays<'py>>> {
        self.calls_of(py, BatchPart::Slices(&slices), max_blocks, skip_segments)
    }

    /// The engine calls sending every segment's seal, as `calls`.
    #[pyo3(signature = (*, max_blocks=None, skip_segments=None))]
    fn seal_calls<'py>(
        &self,
        py: Python<'py>,
        max_blocks: Option<i64>,
        skip_segments: Option<Vec<bool>>,
    ) -> PyResult<Vec<CallArrays<'py>>> {
        self.calls_of(py, BatchPart::Seal, max_blocks, skip_segments)
    }

    /// `(slices, seal)`: the slices segment `segment` has blocks in, and whether its seal has
    /// any (what must land before its requests are complete).
    fn segment_parts(&self, segment: usize) -> PyResult<(Vec<usize>, bool)> {
        if segment >= self.inner.n_segments() {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "segment {segment} out of range for {} segments",
                self.inner.n_segments()
            )));
        }
        Ok(self.inner.segment_parts(segment))
    }
}

/// One plan cut into slices: block ranges (views of the plan) and work per slice and the seal.
#[pyclass(frozen, name = "PlanSlices", module = "kvplan._core")]
pub struct PyPlanSlices {
    inner: PlanSlices,
    peers: (PeerRanks, PeerRanks),
}

#[pymethods]
impl PyPlanSlices {
    /// Slices, in the order of `LayerSlices.group_ids`.
    #[getter]
    fn n_slices(&self) -> usize {
        self.inner.ranges.len()
    }

    /// Per slice, its `(start, stop)` block ranges in the plan.
    #[getter]
    fn ranges(&self) -> Vec<Vec<(usize, usize)>> {
        self.inner.ranges.clone()
    }

    /// Per slice, `(group id, blocks, bytes)`.
    #[getter]
    fn work(&self) -> Vec<(u64, u64, u64)> {
        self.inner
            .work
            .iter()
            .map(|w| (w.layer_group, w.blocks, w.bytes))
            .collect()
    }

    /// The seal's `(start, stop)` block ranges in the plan.
    #[getter]
    fn seal_ranges(&self) -> Vec<(usize, usize)> {
        self.inner.seal_ranges.clone()
    }

    /// The seal's `(blocks, bytes)` in this plan.
    #[getter]
    fn seal_work(&self) -> (u64, u64) {
        (self.inner.seal.blocks, self.inner.seal.bytes)
    }

    /// The expected-work manifest of request `request` between this plan's peers, with the
    /// request's state plan slices (`state`) counted in the seal.
    #[pyo3(signature = (request, state=None))]
    fn manifest(&self, request: u64, state: Option<PyRef<'_, PyPlanSlices>>) -> PyWorkManifest {
        PyWorkManifest {
            inner: self
                .inner
                .manifest(request, self.peers, state.as_deref().map(|s| &s.inner)),
        }
    }
}

/// What one prefill peer sends one decode peer for one request: per layer group its blocks and
/// bytes, and the seal's; `to_bytes()` / `from_bytes()` are its versioned wire form.
#[pyclass(frozen, eq, name = "WorkManifest", module = "kvplan._core")]
#[derive(PartialEq)]
pub struct PyWorkManifest {
    inner: WorkManifest,
}

#[pymethods]
impl PyWorkManifest {
    /// The request id.
    #[getter]
    fn request(&self) -> u64 {
        self.inner.request
    }

    /// The prefill peer's `(pp_rank, pp_size, tp_rank, tp_size)`.
    #[getter]
    fn prefill(&self) -> Ranks {
        ranks(self.inner.prefill)
    }

    /// The decode peer's `(pp_rank, pp_size, tp_rank, tp_size)`.
    #[getter]
    fn decode(&self) -> Ranks {
        ranks(self.inner.decode)
    }

    /// Per layer group `(group id, blocks, bytes)`.
    #[getter]
    fn slices(&self) -> Vec<(u64, u64, u64)> {
        self.inner
            .slices
            .iter()
            .map(|w| (w.layer_group, w.blocks, w.bytes))
            .collect()
    }

    /// The seal's `(blocks, bytes)`.
    #[getter]
    fn seal(&self) -> (u64, u64) {
        (self.inner.seal.blocks, self.inner.seal.bytes)
    }

    /// Blocks over every slice and the seal.
    #[getter]
    fn total_blocks(&self) -> u64 {
        self.inner.total_blocks()
    }

    /// Bytes over every slice and the seal.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.inner.total_bytes()
    }

    /// The wire bytes (magic `KVSM`, version 1, CRC-32 trailer).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }

    /// Decodes `to_bytes()` output; a `KvPlanError` for anything else.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        WorkManifest::from_bytes(data)
            .map(|inner| Self { inner })
            .map_err(to_py_err)
    }

    fn __repr__(&self) -> String {
        format!(
            "WorkManifest(request={}, slices={}, blocks={}, bytes={})",
            self.inner.request,
            self.inner.slices.len(),
            self.inner.total_blocks(),
            self.inner.total_bytes()
        )
    }
}
