//! Requests addressed by state slot (`Template.plan_state`, `Template.plan_ring`): a slot pair
//! in, one `TransferPlan` out, its columns moved or pooled without a copy.

use std::sync::Arc;

use kvplan_core::{Request, Template};
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::plan::{PyTransferPlan, owned_columns, pooled, pooled_columns};

/// The live rows of every ring-state pair of slots `(src, dst)` after `n_positions`
/// positions, relaid out between ring sizes by the core's `RingPlanner`.
pub(crate) fn plan_ring(
    py: Python<'_>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    (src_slot, dst_slot): (i64, i64),
    n_positions: u64,
) -> PyResult<Py<PyTransferPlan>> {
    let mut plan = py
        .detach(|| kvplan_core::RingPlanner::new(template).plan(src_slot, dst_slot, n_positions))
        .map_err(to_py_err)?;
    let columns = owned_columns(py, &mut plan);
    Py::new(
        py,
        PyTransferPlan::packed(columns, Arc::clone(template), &plan, fingerprints),
    )
}

/// One block per state pair for slots `(src, dst)` (elided pairs emit nothing).
pub(crate) fn plan_state(
    py: Python<'_>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    (src_slot, dst_slot): (i64, i64),
) -> PyResult<Py<PyTransferPlan>> {
    let (buffer, summary) = template
        .plan_into(&Request::slot(src_slot, dst_slot), pooled)
        .map_err(to_py_err)?;
    let columns = pooled_columns(py, buffer.data, buffer.capacity, summary.n_blocks)?;
    Py::new(
        py,
        PyTransferPlan::new(columns, Arc::clone(template), summary, fingerprints),
    )
}
