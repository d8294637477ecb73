//! `StagedPlan`: a staged plan's three `TransferPlan`s and the core's summary of it.

use pyo3::prelude::*;

use crate::plan::PyTransferPlan;

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
}

#[pymethods]
impl PyStagedPlan {
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
