//! `nixl_desc_ids`: vLLM's NIXL descriptor ids (`_compute_desc_ids`) from the core's
//! `nixl_ids` module. Arguments are taken as vLLM holds them (lists of Python ints, `None` for
//! a default); an argument of a kind the core does not model (a block list that is not ints, a
//! count that is not a Python int, a ratio that is neither int nor float) makes the function
//! return `None`, so the caller runs vLLM's own method. Every other refusal is a typed error.

use kvplan_core::{BlockScale, DescIdRequest};
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyTuple};

use crate::errors::to_py_err;
use crate::ids::index_vec;

/// The items of a list or tuple, `None` for anything else.
fn items<'py>(obj: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(list) = obj.cast::<PyList>() {
        Some(list.iter().collect())
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        Some(tuple.iter().collect())
    } else {
        None
    }
}

/// A list or tuple of Python ints (bools included: numpy reads them as 0 and 1) as `i64`;
/// `None` when it holds anything else (a numpy integer would change the dtype vLLM's prefix
/// sum returns) or a value outside `i64`.
fn exact_ints(obj: &Bound<'_, PyAny>) -> Option<Vec<i64>> {
    items(obj)?
        .iter()
        .map(|item| {
            if item.cast::<PyInt>().is_ok() {
                item.extract::<i64>().ok()
            } else {
                None
            }
        })
        .collect()
}

/// An argument of a kind the core does not model: the caller runs vLLM's own method.
struct Decline;

fn optional_ints(obj: Option<&Bound<'_, PyAny>>) -> Result<Option<Vec<i64>>, Decline> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => exact_ints(o).map(Some).ok_or(Decline),
    }
}

fn scale(obj: Option<&Bound<'_, PyAny>>) -> Result<Option<BlockScale>, Decline> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) if o.cast::<PyFloat>().is_ok() => o
            .extract::<f64>()
            .map(|r| Some(BlockScale::Float(r)))
            .map_err(|_| Decline),
        Some(o) if o.cast::<PyInt>().is_ok() || o.cast::<PyBool>().is_ok() => o
            .extract::<i64>()
            .map(|r| Some(BlockScale::Int(r)))
            .map_err(|_| Decline),
        Some(_) => Err(Decline),
    }
}

fn optional_truth(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<bool>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => o.is_truthy().map(Some),
    }
}

/// vLLM's `_compute_desc_ids(block_ids, dst_num_blocks, block_size_ratio,
/// physical_blocks_per_logical, region_num_blocks, region_group_ids,
/// uses_region_group_mapping)` for a model without Mamba state, with the worker attributes it
/// reads passed by keyword: an int64 array, or `None` when an argument is of a kind the core
/// does not model. vLLM 0.34's form passes `pairs = (regions, keys)` instead of the layer
/// routing and region group arguments (which are then not read).
#[pyfunction]
#[pyo3(signature = (
    block_ids, /, *, num_blocks, block_size_ratio, region_num_blocks, layer_groups,
    num_regions, num_layers, region_groups, worker_region_groups, grouped, worker_grouped,
    pairs=None,
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn nixl_desc_ids<'py>(
    py: Python<'py>,
    block_ids: &Bound<'py, PyAny>,
    num_blocks: &Bound<'py, PyAny>,
    block_size_ratio: Option<&Bound<'py, PyAny>>,
    region_num_blocks: Option<&Bound<'py, PyAny>>,
    layer_groups: &Bound<'py, PyAny>,
    num_regions: &Bound<'py, PyAny>,
    num_layers: usize,
    region_groups: Option<&Bound<'py, PyAny>>,
    worker_region_groups: &Bound<'py, PyAny>,
    grouped: Option<&Bound<'py, PyAny>>,
    worker_grouped: &Bound<'py, PyAny>,
    pairs: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyArray1<i64>>>> {
    macro_rules! or_decline {
        ($e:expr) => {
            match $e {
                Some(v) => v,
                None => return Ok(None),
            }
        };
    }
    let Ok(num_blocks) = num_blocks.extract::<i64>() else {
        return Ok(None);
    };
    let num_regions = if num_regions.is_truthy()? {
        or_decline!(num_regions.extract::<usize>().ok())
    } else {
        0
    };
    let scale = or_decline!(scale(block_size_ratio).ok());
    let region_num_blocks = or_decline!(optional_ints(region_num_blocks).ok());
    let layer_groups = or_decline!(exact_ints(layer_groups));
    let region_groups = or_decline!(optional_ints(region_groups).ok());
    let worker_region_groups = or_decline!(exact_ints(worker_region_groups));
    let grouped = optional_truth(grouped)?;
    let worker_grouped = worker_grouped.is_truthy()?;
    // vLLM 0.34's (regions, keys): two lists of Python ints
    let pairs = match pairs {
        Some(p) if !p.is_none() => {
            let both = or_decline!(items(p));
            if both.len() != 2 {
                return Ok(None);
            }
            Some((
                or_decline!(exact_ints(&both[0])),
                or_decline!(exact_ints(&both[1])),
            ))
        }
        _ => None,
    };
    let mut groups: Vec<Vec<i64>> = Vec::new();
    for group in or_decline!(items(block_ids)) {
        groups.push(or_decline!(index_vec(&group)?));
    }
    let request = DescIdRequest {
        num_blocks,
        scale,
        region_num_blocks: region_num_blocks.as_deref(),
        layer_groups: &layer_groups,
        num_regions,
        num_layers,
        region_groups: region_groups.as_deref(),
        worker_region_groups: &worker_region_groups,
        grouped,
        worker_grouped,
        pairs: pairs
            .as_ref()
            .map(|(regions, keys)| (regions.as_slice(), keys.as_slice())),
    };
    let slices: Vec<&[i64]> = groups.iter().map(Vec::as_slice).collect();
    let ids = py
        .detach(|| kvplan_core::desc_ids(&request, &slices))
        .map_err(to_py_err)?;
    Ok(Some(ids.into_pyarray(py)))
}
