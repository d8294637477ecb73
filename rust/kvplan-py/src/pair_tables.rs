//! What two layouts pair, as Python tables: `check_pairs` (each source entry's partner or why
//! it has none) and `needs_tokens`, asked before building a `Template`, and a built template's
//! `pairs` and `state_pairs`.

use kvplan_core::PairSpec;
use numpy::PyArray2;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py_err;
use crate::input::pairs_array;
use crate::layout::PyLayout;
use crate::options::template_options;

/// `(kind, src_entry, dst_entry or None, exception or None)`: the exception is the one
/// `Template(...)` would raise for this entry, built by the one mapping in `errors.rs`.
type EntryCheckRow = (&'static str, usize, Option<usize>, Option<Py<PyAny>>);

/// One row per source entry, page entries first: its partner or why it has none.
/// `Template(...)` raises exactly the first problem listed here.
#[pyfunction]
#[pyo3(signature = (src_layout, dst_layout, pairing=None, *, replicas_send=false, **removed_keywords))]
pub fn check_pairs(
    py: Python<'_>,
    src_layout: PyRef<'_, PyLayout>,
    dst_layout: PyRef<'_, PyLayout>,
    pairing: Option<&Bound<'_, PyAny>>,
    replicas_send: bool,
    removed_keywords: Option<&Bound<'_, PyDict>>,
) -> PyResult<Vec<EntryCheckRow>> {
    let options = template_options(
        "check_pairs",
        pairing,
        removed_keywords,
        false,
        replicas_send,
    )?;
    let checks = kvplan_core::check_pairs(&src_layout.inner, &dst_layout.inner, options);
    Ok(checks
        .into_iter()
        .map(|c| {
            let exception = c.problem.map(|p| to_py_err(p).into_value(py).into_any());
            (c.kind.as_str(), c.src_entry, c.dst_entry, exception)
        })
        .collect())
}

/// Whether every plan between these layouts is a token plan (different page sizes or memory
/// orders): the core's rule, for callers that describe a pair before building its template.
#[pyfunction]
pub fn needs_tokens(src_layout: PyRef<'_, PyLayout>, dst_layout: PyRef<'_, PyLayout>) -> bool {
    kvplan_core::needs_tokens(&src_layout.inner, &dst_layout.inner)
}

/// `(n, 2)` int64: (src entry, dst entry) of each pair, in the template's order.
pub(crate) fn entry_pairs<'py>(
    py: Python<'py>,
    pairs: &[PairSpec],
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    pairs_array(py, pairs.iter().map(|p| [p.src_entry, p.dst_entry]))
}
