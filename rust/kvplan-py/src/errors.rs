//! The kvplan exception hierarchy and the one place core errors become Python exceptions.

use kvplan_core::{ErrorClass, ManifestProblem, PlanError};
use pyo3::create_exception;
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    kvplan,
    KvPlanError,
    PyValueError,
    "Base class of every kvplan planning error."
);
create_exception!(
    kvplan,
    PairingError,
    KvPlanError,
    "Transfer entries could not be paired."
);
create_exception!(
    kvplan,
    IndexBoundsError,
    KvPlanError,
    "A page or slot index is negative or outside its buffer."
);
create_exception!(
    kvplan,
    SizeMismatchError,
    KvPlanError,
    "Paired entries disagree on item size."
);
create_exception!(kvplan, LayoutError, KvPlanError, "A layout is malformed.");
create_exception!(
    kvplan,
    ManifestError,
    LayoutError,
    "A layout does not hold every component of a model's manifest as declared (or the \
     manifest is malformed); `model` names the model and `problems` each component, its layers \
     and both values."
);
create_exception!(
    kvplan,
    UnsupportedError,
    KvPlanError,
    "A planner was asked for a request feature it does not support; `planner` and `feature` \
     name both (`kvplan.planner_support()` lists what each planner supports)."
);

/// Maps a core error to its Python exception, with the core's stable name of the error's
/// family as its `kind` attribute (so Python tells errors apart without reading messages).
/// A batch's errors also carry `requests`: the indices of the batch's requests they are about
/// (the one whose own error it is, or the two that write one page), so a caller that keeps
/// per-request verdicts can fail exactly those.
/// (Not a `From` impl: both types are foreign here.)
pub(crate) fn to_py_err(err: PlanError) -> PyErr {
    let kind = err.kind();
    let exception = exception_of(&err);
    let unsupported = match innermost(&err) {
        PlanError::Unsupported {
            planner, feature, ..
        } => Some((*planner, *feature)),
        _ => None,
    };
    let requests = match &err {
        PlanError::InRequest { request, .. } => Some(vec![*request]),
        PlanError::RequestsOverlap { first, second, .. } => Some(vec![*first, *second]),
        _ => None,
    };
    Python::attach(|py| {
        // An exception instance always takes attributes; failing here would hide the error.
        let value = exception.value(py);
        let _ = value.setattr("kind", kind);
        if let Some((planner, feature)) = unsupported {
            let _ = value.setattr("planner", planner);
            let _ = value.setattr("feature", feature);
        }
        if let Some(requests) = requests
            && let Ok(tuple) = pyo3::types::PyTuple::new(py, requests)
        {
            let _ = value.setattr("requests", tuple);
        }
        if let PlanError::Manifest {
            model, problems, ..
        } = innermost(&err)
        {
            let _ = value.setattr("model", model);
            let rows: Vec<_> = problems.iter().map(problem_row).collect();
            if let Ok(tuple) = pyo3::types::PyTuple::new(py, rows) {
                let _ = value.setattr("problems", tuple);
            }
        }
    });
    exception
}

/// One manifest problem as `(kind, role, layers, expected, got)`: the role and layers of the
/// component it is about (`""` and `()` for a problem about the whole layout), and the two
/// values where it compares two (`None` otherwise, or for a value that is none).
type ProblemRow = (&'static str, String, Vec<i64>, Option<u64>, Option<u64>);

fn problem_row(problem: &ManifestProblem) -> ProblemRow {
    let kind = problem.kind();
    match problem {
        ManifestProblem::Missing { role, layers, .. }
        | ManifestProblem::Unexpected { role, layers, .. }
        | ManifestProblem::OutsideStage { role, layers, .. } => {
            (kind, role.clone(), layers.clone(), None, None)
        }
        ManifestProblem::ItemSize {
            role,
            layers,
            expected,
            got,
            ..
        } => (
            kind,
            role.clone(),
            layers.clone(),
            Some(*expected),
            Some(*got),
        ),
        ManifestProblem::Shape {
            role,
            layers,
            expected,
            got,
            ..
        } => (kind, role.clone(), layers.clone(), *expected, *got),
        ManifestProblem::ModelLayers { manifest, layout } => {
            (kind, String::new(), vec![], Some(*manifest), Some(*layout))
        }
        ManifestProblem::Malformed { .. }
        | ManifestProblem::StageRange { .. }
        | ManifestProblem::NoLayerIds { .. } => (kind, String::new(), vec![], None, None),
    }
}

/// The error a batch's `InRequest` wraps (itself for any other error).
fn innermost(err: &PlanError) -> &PlanError {
    match err {
        PlanError::InRequest { source, .. } => innermost(source),
        other => other,
    }
}

fn exception_of(err: &PlanError) -> PyErr {
    let message = err.to_string();
    if matches!(innermost(err), PlanError::Unsupported { .. }) {
        return UnsupportedError::new_err(message);
    }
    if matches!(innermost(err), PlanError::Manifest { .. }) {
        return ManifestError::new_err(message);
    }
    match err.class() {
        ErrorClass::Pairing => PairingError::new_err(message),
        ErrorClass::IndexBounds => IndexBoundsError::new_err(message),
        ErrorClass::SizeMismatch => SizeMismatchError::new_err(message),
        ErrorClass::Layout => LayoutError::new_err(message),
        ErrorClass::Memory => PyMemoryError::new_err(message),
        ErrorClass::Other => KvPlanError::new_err(message),
    }
}

/// `repr(obj)`, cut to a readable length for an error message.
pub(crate) fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    const MAX: usize = 60;
    let text = obj
        .repr()
        .map_or_else(|_| "<unprintable>".to_owned(), |r| r.to_string());
    if text.chars().count() <= MAX {
        return text;
    }
    let cut: String = text.chars().take(MAX).collect();
    format!("{cut}…")
}
