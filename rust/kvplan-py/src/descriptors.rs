//! Prepped descriptor tables (`Template.descriptor_table`, `Template.descriptor_runs`,
//! `Template.prepped_indices`, `Template.prepped_state_indices`): arguments converted, the core's `descriptors` module
//! called, its vectors handed to NumPy without copying.

use kvplan_core::{DescriptorTables, PageIndex, PreppedIndices, Request, Side, Template};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::prelude::*;

use crate::errors::{KvPlanError, to_py_err};
use crate::input::RequestPlanner;
use crate::request::{Loose, RequestInput};

/// `(addrs, lens)` of one side's table, both uint64.
pub(crate) type TableArrays<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u64>>);
/// `(src_idx, dst_idx)` of a prepped request, both int64.
pub(crate) type IndexArrays<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);

fn side_arg(side: &str) -> PyResult<Side> {
    match side {
        "src" => Ok(Side::Src),
        "dst" => Ok(Side::Dst),
        other => Err(KvPlanError::new_err(format!(
            "side must be \"src\" (prefill) or \"dst\" (decode), got {other:?}"
        ))),
    }
}

fn index_arrays(py: Python<'_>, indices: PreppedIndices) -> IndexArrays<'_> {
    (indices.src.into_pyarray(py), indices.dst.into_pyarray(py))
}

/// One side's prepped descriptor table (built with the GIL released: it may hold millions of
/// descriptors).
pub(crate) fn descriptor_table<'py>(
    py: Python<'py>,
    template: &Template,
    side: &str,
) -> PyResult<TableArrays<'py>> {
    let side = side_arg(side)?;
    let table = py
        .detach(|| DescriptorTables::new(template).table(side))
        .map_err(to_py_err)?;
    Ok((table.addrs.into_pyarray(py), table.lens.into_pyarray(py)))
}

/// One side's prepped table as `(n, 4)` uint64 rows `(base, len, stride, count)`, one per
/// run (nothing expanded).
pub(crate) fn descriptor_runs<'py>(
    py: Python<'py>,
    template: &Template,
    side: &str,
) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let side = side_arg(side)?;
    let runs = DescriptorTables::new(template)
        .runs(side)
        .map_err(to_py_err)?;
    let flat: Vec<u64> = runs
        .iter()
        .flat_map(|r| [r.base, r.len, r.stride, r.count])
        .collect();
    let array = Array2::from_shape_vec((runs.len(), 4), flat)
        .map_err(|e| KvPlanError::new_err(e.to_string()))?;
    Ok(array.into_pyarray(py))
}

struct Indices<'t>(&'t Template);

impl RequestPlanner for Indices<'_> {
    type Output = kvplan_core::Result<PreppedIndices>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        DescriptorTables::new(self.0).indices(request)
    }
}

/// A page request's indices into the prepped tables (index arrays borrowed without copying,
/// the GIL released for large requests, as `Template.plan`).
pub(crate) fn prepped_indices<'py>(
    py: Python<'py>,
    template: &Template,
    src_pages: &Bound<'py, PyAny>,
    dst_pages: Option<&Bound<'py, PyAny>>,
) -> PyResult<IndexArrays<'py>> {
    let request = RequestInput::of_args("prepped_indices", src_pages, dst_pages, Loose::default())?;
    let indices = request.plan(py, Indices(template))?.map_err(to_py_err)?;
    Ok(index_arrays(py, indices))
}

/// A state slot's indices into the prepped tables.
pub(crate) fn prepped_state_indices<'py>(
    py: Python<'py>,
    template: &Template,
    src_slot: &Bound<'py, PyAny>,
    dst_slot: Option<&Bound<'py, PyAny>>,
) -> PyResult<IndexArrays<'py>> {
    let request = RequestInput::of_slots("prepped_state_indices", src_slot, dst_slot)?;
    let indices = request.plan(py, Indices(template))?.map_err(to_py_err)?;
    Ok(index_arrays(py, indices))
}
