//! Block ids handed over as Python lists (vLLM's `list[int]` per KV group) unboxed into an
//! int64 array in one pass in Rust, so a drop-in that receives lists runs no per-id Python
//! loop before planning.

use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::IndexBoundsError;

/// `ids` (a list or tuple of ints, or a 1-D int64 array, returned as is) as an int64 array.
/// An element that is not an integer is a `TypeError` naming its position; one outside int64
/// an `IndexBoundsError` (no index of a real pool is that large, and truncating it would plan
/// another block).
#[pyfunction]
#[pyo3(signature = (ids, /))]
pub(crate) fn index_array<'py>(
    py: Python<'py>,
    ids: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(list) = ids.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (position, item) in list.iter().enumerate() {
            out.push(unbox(&item, position)?);
        }
        return Ok(out.into_pyarray(py).into_any());
    }
    if let Ok(tuple) = ids.cast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for (position, item) in tuple.iter().enumerate() {
            out.push(unbox(&item, position)?);
        }
        return Ok(out.into_pyarray(py).into_any());
    }
    if ids.cast::<PyArray1<i64>>().is_ok() {
        return Ok(ids.clone());
    }
    Err(PyTypeError::new_err(format!(
        "ids must be a list or tuple of ints or a 1-D int64 numpy array, got {}",
        ids.get_type().name()?
    )))
}

/// `ids` as block ids when it is a list or tuple of ints or a 1-D int64 array; `None` for any
/// other object, or a list holding something that is not an int (the caller declines). An int
/// outside int64 is an `IndexBoundsError`, as in [`index_array`].
pub(crate) fn index_vec(ids: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = ids.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = ids.cast::<PyTuple>() {
        tuple.iter().collect()
    } else if let Ok(array) = ids.cast::<PyArray1<i64>>() {
        return Ok(Some(array.readonly().as_array().to_vec()));
    } else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(items.len());
    for (position, item) in items.iter().enumerate() {
        match unbox(item, position) {
            Ok(id) => out.push(id),
            Err(err) if err.is_instance_of::<PyTypeError>(ids.py()) => return Ok(None),
            Err(err) => return Err(err),
        }
    }
    Ok(Some(out))
}

fn unbox(item: &Bound<'_, PyAny>, position: usize) -> PyResult<i64> {
    item.extract::<i64>().map_err(|err| {
        if err.is_instance_of::<PyOverflowError>(item.py()) {
            IndexBoundsError::new_err(format!(
                "ids[{position}] = {item} is outside the int64 range of block indices"
            ))
        } else {
            PyTypeError::new_err(format!(
                "ids[{position}] must be an int, got {}",
                item.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        }
    })
}
