//! Layer-wise streaming: `LayerGroups`, `LayerSlices` (a template's groups, built once),
//! `PlanSlices` (one plan's block ranges per group and the seal) and `WorkManifest` (expected work
//! on the wire). Every answer is the core's; this module only converts.

use std::sync::Arc;

use kvplan_core::{LayerGroups, LayerSlices, PeerRanks, PlanSlices, Template, WorkManifest};
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
        self.inner.slices().iter().map(|s| s.group).collect()
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
        self.inner.seal_groups().to_vec()
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
            .map(|w| (w.group, w.blocks, w.bytes))
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
            .map(|w| (w.group, w.blocks, w.bytes))
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
