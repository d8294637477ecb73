//! Requests addressed by state slot (`Template.plan_state`, `Template.plan_ring`): a slot pair
//! in, one `TransferPlan` out, its columns moved or pooled without a copy.

use std::sync::Arc;

use kvplan_core::{Indices, PageIndex, Plan, PlanError, Request, Template};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::errors::{short_repr, to_py_err};
use crate::input::RequestPlanner;
use crate::plan::{PyTransferPlan, owned_columns};
use crate::request::{PyRequest, RequestInput};

/// The ring lane of a slot request: its live ring rows after `n_tokens` positions.
struct RingRows<'t>(&'t Template);

impl RequestPlanner for RingRows<'_> {
    type Output = kvplan_core::Result<Plan>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        request.refuse_delta("plan_ring")?;
        let Indices::Slot { src, dst } = request.indices else {
            return Err(PlanError::Geometry {
                what: "plan_ring plans a state slot request, not page lists".into(),
            });
        };
        self.0.plan_ring(src, dst, request.n_tokens.unwrap_or(0))
    }
}

/// The live rows of every ring-state pair of slots `(src, dst)` after `n_positions`
/// positions, relaid out between ring sizes: the ring lane of the slot request
/// `Request(slot=(src, dst), n_tokens=n_positions)` alone (the core's `Template::plan_ring`).
/// Takes that `kvplan.Request` in `src_slot`, or the old form's slots and `n_positions`.
pub(crate) fn plan_ring<'py>(
    py: Python<'py>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_slot: &Bound<'py, PyAny>,
    dst_slot: Option<&Bound<'py, PyAny>>,
    n_positions: Option<&Bound<'py, PyAny>>,
) -> PyResult<Py<PyTransferPlan>> {
    let mut request = RequestInput::of_slots("plan_ring", src_slot, dst_slot)?;
    let n_positions = n_positions.filter(|n| !n.is_none());
    let is_request = src_slot.cast::<PyRequest>().is_ok();
    request.n_tokens = match (is_request, n_positions) {
        (true, Some(_)) => {
            return Err(PyTypeError::new_err(
                "plan_ring(request) takes the positions from the Request's n_tokens; give \
                 n_tokens to Request(...), not n_positions to plan_ring",
            ));
        }
        (true, None) if request.n_tokens.is_none() => {
            return Err(PyTypeError::new_err(
                "plan_ring(request) needs the positions processed: give \
                 Request(slot=(src_slot, dst_slot), n_tokens=n_positions)",
            ));
        }
        (true, None) => request.n_tokens,
        (false, None) => {
            return Err(PyTypeError::new_err(
                "plan_ring() needs n_positions with src_slot and dst_slot (or one kvplan.Request)",
            ));
        }
        (false, Some(n)) => Some(positions_arg(n)?),
    };
    let mut plan = request.plan(py, RingRows(template))?.map_err(to_py_err)?;
    let columns = owned_columns(py, &mut plan);
    Py::new(
        py,
        PyTransferPlan::packed(columns, Arc::clone(template), &plan, fingerprints),
    )
}

/// `n_positions`: an int in `0..2**64` (an int outside is an `OverflowError` naming it).
fn positions_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if !obj.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "n_positions must be an int, got {}",
            obj.get_type().name()?
        )));
    }
    obj.extract::<u64>().map_err(|_| {
        PyOverflowError::new_err(format!(
            "n_positions must be an int in 0..2**64, got {}",
            short_repr(obj)
        ))
    })
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
