//! `failed_pages`: the decode pages, per pool, and the state slots that a plan's failed blocks
//! were to write (the core's `planners::failures`), for a transfer engine's failure report;
//! `failed_batch_pages` the same per request of a batch.

use kvplan_core::{Indices, Request};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::batch::PyBatchPlan;
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
    let ranges = block_ranges(&failed)?;
    let (_, dst) = template.inner.layouts();
    let found = kvplan_core::failed_pages(dst, dst_addrs.as_slice()?, lengths.as_slice()?, &ranges)
        .map_err(to_py_err)?;
    let pools = PyDict::new(py);
    for (pool, pages) in found.pools {
        pools.set_item(pool.index(), pages.into_pyarray(py))?;
    }
    Ok((pools, found.slots.into_pyarray(py)))
}

/// One failed request of a batch as Python receives it: its position, `{pool: pages}` and
/// its slots.
type RequestPages<'py> = (usize, Bound<'py, PyDict>, Bound<'py, PyArray1<i64>>);

/// One request's destination pages as the batch verdict reads them: per pool its page array,
/// or a state slot.
enum DstPages<'py> {
    Pages(Vec<(usize, PyReadonlyArray1<'py, i64>)>),
    Slot(i64),
}

/// `(start, stop)` ranges as block ranges, a negative bound refused naming the range.
fn block_ranges(failed: &[(i64, i64)]) -> PyResult<Vec<std::ops::Range<usize>>> {
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
    Ok(ranges)
}

/// Per request of `batch` with failed pages or slots, in batch order: `(request, {pool:
/// sorted page ids}, sorted slots)`, for blocks `failed` of the batch (its `dst_addrs` and
/// `lengths` columns). `dst_pages` gives each request's destination pages as planned (`{pool:
/// int64 pages}`) or its destination state slot (an int), so the blocks of fused requests name
/// each request its own pages.
#[pyfunction]
pub fn failed_batch_pages<'py>(
    py: Python<'py>,
    batch: PyRef<'_, PyBatchPlan>,
    dst_addrs: PyReadonlyArray1<'_, u64>,
    lengths: PyReadonlyArray1<'_, u64>,
    dst_pages: Vec<Bound<'py, PyAny>>,
    failed: Vec<(i64, i64)>,
) -> PyResult<Vec<RequestPages<'py>>> {
    let ranges = block_ranges(&failed)?;
    let mut held = Vec::with_capacity(dst_pages.len());
    for (r, item) in dst_pages.iter().enumerate() {
        if let Ok(slot) = item.extract::<i64>() {
            held.push(DstPages::Slot(slot));
            continue;
        }
        let pools: std::collections::BTreeMap<usize, PyReadonlyArray1<'py, i64>> =
            item.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "dst_pages[{r}] must be a dict of pool id to int64 page array or a state slot \
                 int, got {}",
                    item.get_type()
                        .name()
                        .map_or_else(|_| "?".into(), |n| n.to_string())
                ))
            })?;
        if let Some(&pool) = pools.keys().find(|&&p| p >= kvplan_core::POOLS) {
            return Err(IndexBoundsError::new_err(format!(
                "failed blocks: dst_pages[{r}] names pool {pool}; pools are 0..{}",
                kvplan_core::POOLS
            )));
        }
        held.push(DstPages::Pages(pools.into_iter().collect()));
    }
    let mut requests: Vec<Request<'_, i64, i64>> = Vec::with_capacity(held.len());
    for pages in &held {
        requests.push(match pages {
            DstPages::Slot(slot) => Request::slot(0, *slot),
            DstPages::Pages(pools) => {
                let mut request = Request::new(&[], &[], None);
                for (pool, array) in pools {
                    let slice = array.as_slice()?;
                    if *pool == 0 {
                        request.indices = Indices::Pages {
                            src: &[],
                            dst: slice,
                        };
                    } else {
                        request.pool_pages[*pool].1 = Some(slice);
                    }
                }
                request
            }
        });
    }
    let (template, summary) = batch.template_and_summary();
    let (_, dst) = template.layouts();
    let found = kvplan_core::failed_batch_pages(
        dst,
        dst_addrs.as_slice()?,
        lengths.as_slice()?,
        summary,
        &requests,
        &ranges,
    )
    .map_err(to_py_err)?;
    let mut out = Vec::with_capacity(found.len());
    for failure in found {
        let pools = PyDict::new(py);
        for (pool, pages) in failure.pages.pools {
            pools.set_item(pool.index(), pages.into_pyarray(py))?;
        }
        out.push((failure.request, pools, failure.pages.slots.into_pyarray(py)));
    }
    Ok(out)
}
