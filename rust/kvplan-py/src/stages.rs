//! The stages of a multi-stage plan (the core's `planners::stages`), as tuples of names:
//! `(kind, side, part, reads, writes)` per stage, in the order they run. Plan classes hand out
//! their own (`StagedPlan.stages`, `StagedRounds.stages`, `ConversionPlan.stages`); a plan
//! that reaches Python as a tuple or as one stage is looked up by its form's name
//! (`plan_stages`).

use kvplan_core::{PlanForm, Stage};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// One stage's names.
type StageNames = (
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
    &'static str,
    &'static str,
);

fn names(stage: Stage) -> StageNames {
    (
        stage.kind.name(),
        stage.kind.side().map(|side| match side {
            kvplan_core::Side::Src => "src",
            kvplan_core::Side::Dst => "dst",
        }),
        stage.part.name(),
        stage.reads.name(),
        stage.writes.name(),
    )
}

/// `stages` as a tuple of `(kind, side, part, reads, writes)` tuples.
pub(crate) fn stage_tuple<'py>(
    py: Python<'py>,
    stages: &'static [Stage],
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, stages.iter().copied().map(names))
}

/// The stages of the plan form named `form` (`direct`, `staged`, `rounds`, `packed`,
/// `row_gather`, `convert_on_prefill`, `convert_on_decode`), in the order they run: one
/// `(kind, side, part, reads, writes)` tuple per stage.
#[pyfunction]
pub(crate) fn plan_stages<'py>(py: Python<'py>, form: &str) -> PyResult<Bound<'py, PyTuple>> {
    let Some(found) = PlanForm::named(form) else {
        let known: Vec<&str> = PlanForm::ALL.iter().map(|f| f.name()).collect();
        return Err(PyValueError::new_err(format!(
            "no plan form is named {form:?}; the forms are {}",
            known.join(", ")
        )));
    };
    stage_tuple(py, found.stages())
}
