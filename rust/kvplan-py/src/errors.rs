//! The kvplan exception hierarchy and the one place core errors become Python exceptions.

use kvplan_core::{ErrorClass, PlanError};
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
    });
    exception
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
