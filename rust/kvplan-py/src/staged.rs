//! Staged plans (`Template.plan_staged`): arguments converted, the core's `staged` module
//! called, and `StagedPlan`, its three `TransferPlan`s with the core's summary of it.

use std::sync::Arc;

use kvplan_core::{
    FlatBuffer, MultiStage, PageIndex, PlanPart, Request, StagedPlan, StagedPlanner, Template,
};
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::input::RequestPlanner;
use crate::plan::{PyTransferPlan, owned_columns, pooled, pooled_columns};
use crate::pool;
use crate::request::{Loose, RequestInput};

/// A request planned as a gather into a prefill staging region, a network plan between the
/// staging regions and a scatter into the decode's pages (`Template.plan_staged`).
#[pyclass(frozen, name = "StagedPlan", module = "kvplan._core")]
pub struct PyStagedPlan {
    /// Prefill memory → prefill staging region (run locally by the prefill).
    #[pyo3(get)]
    pub(crate) gather: Py<PyTransferPlan>,
    /// Prefill staging region → decode staging region (moved by the engine).
    #[pyo3(get)]
    pub(crate) network: Py<PyTransferPlan>,
    /// Decode staging region → decode memory (run locally by the decode).
    #[pyo3(get)]
    pub(crate) scatter: Py<PyTransferPlan>,
    /// Bytes of the prefill staging region used, from its start.
    #[pyo3(get)]
    pub(crate) src_staging_bytes: u64,
    /// Offsets `(start, end)` of the decode staging region this writer's share covers.
    #[pyo3(get)]
    pub(crate) dst_staging_range: (u64, u64),
    /// Bytes the decode staging region must hold for all writers.
    #[pyo3(get)]
    pub(crate) dst_staging_bytes: u64,
    /// Blocks of the request's direct plan.
    #[pyo3(get)]
    pub(crate) direct_blocks: usize,
    /// `(writer index, number of writers)` of this prefill rank in the decode region.
    #[pyo3(get)]
    pub(crate) writer: (u32, u32),
    /// The core's stages of the plan (`StagedPlan.stages`).
    pub(crate) stages: &'static [kvplan_core::Stage],
}

#[pymethods]
impl PyStagedPlan {
    /// The plan's stages in the order they run: `(kind, side, part, reads, writes)` each.
    #[getter]
    fn stages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        crate::stages::stage_tuple(py, self.stages)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let blocks = |p: &Py<PyTransferPlan>| p.borrow(py).n_blocks_value();
        format!(
            "StagedPlan(gather={}, network={}, scatter={} blocks, direct_blocks={}, \
             src_staging_bytes={}, dst_staging_range={:?}, writer={:?})",
            blocks(&self.gather),
            blocks(&self.network),
            blocks(&self.scatter),
            self.direct_blocks,
            self.src_staging_bytes,
            self.dst_staging_range,
            self.writer
        )
    }
}

/// One request planned as a staged plan between two staging regions.
struct PlanStaged<'t>(
    &'t Template,
    kvplan_core::StagingRegion,
    kvplan_core::StagingRegion,
);

impl RequestPlanner for PlanStaged<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, FlatBuffer, StagedPlan<PlanPart>)>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        StagedPlanner::new(self.0).plan_into(request, self.1, self.2, |shape| {
            Ok((pooled(shape)?, pooled(shape)?))
        })
    }
}

/// Plans one request (as `plan`) as a staged plan: `gather` from prefill memory into
/// `src_staging = (addr, size)` (prefill memory), `network` from there into `dst_staging =
/// (addr, size)` (the decode's staging region, at this writer's offsets) and `scatter` from
/// there into the decode's pages. A `SizeMismatchError` names the bytes needed when a region
/// is too small.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_staged(
    py: Python<'_>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_pages: &Bound<'_, PyAny>,
    dst_pages: Option<&Bound<'_, PyAny>>,
    src_staging: (u64, u64),
    dst_staging: (u64, u64),
    n_tokens: Option<u64>,
) -> PyResult<PyStagedPlan> {
    let loose = Loose {
        n_tokens,
        ..Loose::default()
    };
    let request = RequestInput::of_args("plan_staged", src_pages, dst_pages, loose)?;
    let region = |(addr, size): (u64, u64)| kvplan_core::StagingRegion { addr, size };
    let planner = PlanStaged(template, region(src_staging), region(dst_staging));
    let (gather, scatter, staged) = request.plan(py, planner)?.map_err(to_py_err)?;
    let stages = staged.stages();
    let part = |columns, n_blocks, pair_offsets| -> PyResult<Py<PyTransferPlan>> {
        let plan = kvplan_core::Plan {
            n_runs: n_blocks,
            total_bytes: staged.src_staging_bytes,
            pair_offsets,
            ..kvplan_core::Plan::default()
        };
        let half = PyTransferPlan::packed(columns, Arc::clone(template), &plan, fingerprints);
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
    Ok(PyStagedPlan {
        gather: pooled_part(gather, staged.gather.n_blocks, staged.gather.pair_offsets)?,
        network: part(network_columns, network.n_runs, network.pair_offsets)?,
        scatter: pooled_part(
            scatter,
            staged.scatter.n_blocks,
            staged.scatter.pair_offsets,
        )?,
        src_staging_bytes: staged.src_staging_bytes,
        dst_staging_range: staged.dst_staging_range,
        dst_staging_bytes: staged.dst_staging_bytes,
        direct_blocks: staged.direct_blocks,
        writer: staged.writer,
        stages,
    })
}
