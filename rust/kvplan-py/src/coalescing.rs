//! How a template's page pairs become emission groups, for Python: the core's coalescing
//! verdict per pair (`Template.coalescing`), which pairs emit, and each pair's group.

use kvplan_core::{Coalescing, JoinBlocker, Side, Template};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// `(kind, side, per_page)` of one page pair (see `Template.coalescing`).
pub(crate) type CoalescingRow = (&'static str, Option<&'static str>, bool);

/// The core's coalescing of every page pair, each verdict and side by its Python name.
pub(crate) fn coalescing_rows(template: &Template) -> Vec<CoalescingRow> {
    let side = |s: Side| Some(s.pick("src", "dst"));
    kvplan_core::coalescing(template)
        .into_iter()
        .map(|pair| {
            let (kind, on) = match pair.coalescing {
                Coalescing::Joined => ("joined", None),
                Coalescing::First => ("first", None),
                Coalescing::Elided => ("elided", None),
                Coalescing::ByToken => ("by_token", None),
                Coalescing::Fragments => ("fragments", None),
                Coalescing::Options => ("options", None),
                Coalescing::Join(JoinBlocker::Strides(s)) => ("strides", side(s)),
                Coalescing::Join(JoinBlocker::Apart(s)) => ("apart", side(s)),
                Coalescing::Join(JoinBlocker::BeyondStride(s)) => ("beyond_stride", side(s)),
            };
            (kind, on, pair.per_page)
        })
        .collect()
}

/// Per page pair, whether it belongs to an emission group (it emits blocks).
pub(crate) fn emitting<'py>(py: Python<'py>, template: &Template) -> PyResult<Bound<'py, PyTuple>> {
    let groups = template.blocks().pair_groups().iter();
    PyTuple::new(py, groups.map(Option::is_some))
}

/// The emission group of each page pair, int64, -1 for an elided pair.
pub(crate) fn pair_groups<'py>(py: Python<'py>, template: &Template) -> Bound<'py, PyArray1<i64>> {
    let groups = template.blocks().pair_groups().iter();
    let groups: Vec<i64> = groups.map(|g| g.map_or(-1, |g| g as i64)).collect();
    numpy::IntoPyArray::into_pyarray(groups, py)
}
