//! Requests addressed by state slot (`Template.plan_state`, `Template.plan_ring`): a slot pair
//! in, one `TransferPlan` out, its columns moved or pooled without a copy.

use std::sync::Arc;

use kvplan_core::Template;
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::plan::{PyTransferPlan, owned_columns};
use crate::request::RequestInput;

/// The live rows of every ring-state pair of slots `(src, dst)` after `n_positions`
/// positions, relaid out between ring sizes: the ring lane of the slot request
/// `Request(slot=(src, dst), n_tokens=n_positions)` alone (the core's `Template::plan_ring`).
pub(crate) fn plan_ring(
    py: Python<'_>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    (src_slot, dst_slot): (i64, i64),
    n_positions: u64,
) -> PyResult<Py<PyTransferPlan>> {
    let mut plan = py
        .detach(|| template.plan_ring(src_slot, dst_slot, n_positions))
        .map_err(to_py_err)?;
    let columns = owned_columns(py, &mut plan);
    Py::new(
        py,
        PyTransferPlan::packed(columns, Arc::clone(template), &plan, fingerprints),
    )
}

/// One block per state pair for slots `(src, dst)` (elided pairs emit nothing), or for a slot
/// `kvplan.Request` in `src_slot`: the direct plan of a slot request (with its ring rows when
/// the request gives `n_tokens`).
pub(crate) fn plan_state<'py>(
    py: Python<'py>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_slot: &Bound<'py, PyAny>,
    dst_slot: Option<&Bound<'py, PyAny>>,
) -> PyResult<Py<PyTransferPlan>> {
    let request = RequestInput::of_slots("plan_state", src_slot, dst_slot)?;
    crate::one_request::plan_input(py, template, fingerprints, &request, None)
}
