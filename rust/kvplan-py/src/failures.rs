//! `failed_pages`: the decode pages, per pool, and the state slots that a plan's failed blocks
//! were to write (the core's `planners::failures`), for a transfer engine's failure report.

use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::compile::PyTemplate;
use crate::errors::{IndexBoundsError, to_py_err};

/// The destination pages per pool (`{pool: sorted int64 page ids}`, only pools with a failed
/// page) and the sorted state slots that blocks `failed` (`(start, stop)` block ranges) of a
/// plan of `template` were to write, the plan given by its `dst_addrs` and `lengths` columns.
#[pyfunction]
pub fn failed_pages<'py>(
    py: Python<'py>,
    template: PyRef<'_, PyTemplate>,
    dst_addrs: PyReadonlyArray1<'_, u64>,
    lengths: PyReadonlyArray1<'_, u64>,
    failed: Vec<(i64, i64)>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyArray1<i64>>)> {
    let mut ranges = Vec::with_capacity(failed.len());
    for (k, &(start, stop)) in failed.iter().enumerate() {
        let (Ok(lo), Ok(hi)) = (usize::try_from(start), usize::try_from(stop)) else {
            return Err(IndexBoundsError::new_err(format!(
                "failed blocks: failed range {k} is [{start}, {stop}): block positions are not \
                 negative"
            )));
        };
        ranges.push(lo..hi);
    }
    let (_, dst) = template.inner.layouts();
    let found = kvplan_core::failed_pages(dst, dst_addrs.as_slice()?, lengths.as_slice()?, &ranges)
        .map_err(to_py_err)?;
    let pools = PyDict::new(py);
    for (pool, pages) in found.pools {
        pools.set_item(pool.index(), pages.into_pyarray(py))?;
    }
    Ok((pools, found.slots.into_pyarray(py)))
}
