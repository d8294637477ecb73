//! `out=` of `Template.plan`: the caller's `(3, M)` uint64 array, checked and borrowed for
//! writing, so a wrong array is a typed error before any planning and never a panic.

use numpy::{PyArray2, PyArrayMethods, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::KvPlanError;
use crate::input::IndexArray;

/// Borrows `out` for writing: a `TypeError` for a wrong type, dtype, shape or memory order
/// (input shape), a `KvPlanError` for a read-only array or one whose memory overlaps an input
/// (never a panic).
pub(crate) fn writable_out<'py, 'i, 'a: 'i>(
    out: &Bound<'py, PyAny>,
    inputs: impl IntoIterator<Item = (&'i IndexArray<'a>, &'static str)>,
) -> PyResult<PyReadwriteArray2<'py, u64>> {
    let array = out.cast::<PyArray2<u64>>().map_err(|_| {
        PyTypeError::new_err("out must be a 2-D numpy array of dtype uint64 with shape (3, M)")
    })?;
    // A Fortran-ordered array would have a slice view too, with the rows scrambled.
    if !array.is_c_contiguous() || array.shape()[0] != 3 {
        return Err(PyTypeError::new_err(format!(
            "out must be a C-contiguous (3, M) uint64 array, got shape {:?}",
            array.shape()
        )));
    }
    // NumPy's borrow tracking only sees aliasing through a shared base object; two views of
    // one buffer made separately (np.frombuffer twice) have different bases. Compare the
    // address ranges themselves.
    let start = array.data() as usize;
    let out_range = (start, start + array.len() * 8);
    for (input, name) in inputs {
        let range = input.byte_range();
        let overlaps = range.0 < range.1
            && out_range.0 < out_range.1
            && range.0 < out_range.1
            && out_range.0 < range.1;
        if overlaps {
            return Err(KvPlanError::new_err(format!(
                "out overlaps {name} in memory (out is bytes {:#x}..{:#x}, {name} is bytes \
                 {:#x}..{:#x}): planning would overwrite its own input; pass a separate out array",
                out_range.0, out_range.1, range.0, range.1
            )));
        }
    }
    array.try_readwrite().map_err(|err| {
        KvPlanError::new_err(format!(
            "out cannot be written: {err} (read-only, or it shares memory with an input)"
        ))
    })
}
