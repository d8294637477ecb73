//! `Template.plan`: one request planned into pooled columns or the caller's `out=` columns
//! (the core decides between a page and a token plan), handed out as a `TransferPlan`.

use std::sync::Arc;

use kvplan_core::{Columns, FlatBuffer, PageIndex, PlanSummary, Request, Template};
use numpy::{PyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::input::RequestPlanner;
use crate::out_arg::writable_out;
use crate::plan::{PyTransferPlan, out_columns, pooled, pooled_columns};
use crate::request::{Loose, RequestInput};

/// One request planned into a pooled buffer; the core decides between a page and a token plan.
struct PlanPooled<'t>(&'t Template);

impl RequestPlanner for PlanPooled<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, PlanSummary)>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        self.0.plan_into(request, pooled)
    }
}

/// The same into the caller's `out=` columns.
struct PlanInto<'t, 'o>(&'t Template, Columns<'o>);

impl RequestPlanner for PlanInto<'_, '_> {
    type Output = kvplan_core::Result<PlanSummary>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        let columns = self.1;
        self.0
            .plan_into(request, move |_| Ok(columns))
            .map(|(_, summary)| summary)
    }
}

/// Plans one request (`Template.plan`, whose docstring says what each argument means): a
/// `kvplan.Request` in `src_pages`, or the old form's arguments.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_one<'py>(
    py: Python<'py>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_pages: &Bound<'py, PyAny>,
    dst_pages: Option<&Bound<'py, PyAny>>,
    n_tokens: Option<u64>,
    skip_tokens: u64,
    window_pages: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Py<PyTransferPlan>> {
    let loose = Loose {
        n_tokens,
        skip_tokens,
        window_pages,
    };
    let request = RequestInput::of_args("plan", src_pages, dst_pages, loose)?;
    plan_input(py, template, fingerprints, &request, out)
}

/// Plans one borrowed request (see [`plan_one`]); `plan_state` plans its slot here too.
pub(crate) fn plan_input<'py>(
    py: Python<'py>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    request: &RequestInput<'py>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Py<PyTransferPlan>> {
    let (columns, summary) = if let Some(out) = out {
        let mut writable = writable_out(out, request.named())?;
        let capacity = writable.shape()[1];
        let flat = writable.as_slice_mut()?;
        let planner = PlanInto(template, Columns::from_flat(flat, capacity));
        let summary = request.plan(py, planner)?.map_err(to_py_err)?;
        drop(writable);
        let out = out.cast::<PyArray2<u64>>()?;
        (out_columns(out, summary.n_blocks), summary)
    } else {
        let (buffer, summary) = request.plan(py, PlanPooled(template))?.map_err(to_py_err)?;
        let columns = pooled_columns(py, buffer.data, buffer.capacity, summary.n_blocks)?;
        (columns, summary)
    };
    Py::new(
        py,
        PyTransferPlan::new(columns, Arc::clone(template), summary, fingerprints),
    )
}
