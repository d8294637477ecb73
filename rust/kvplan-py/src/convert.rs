//! Argument conversion: index arrays taken zero-copy as int32 or int64 slices.

use kvplan_core::PageIndex;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

/// A borrowed 1-D index array of either supported dtype (kept alive by the borrow).
pub(crate) enum IndexArray<'py> {
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
}

/// A plain slice view of an [`IndexArray`]; `Send`, so it may cross into `Python::detach`.
#[derive(Clone, Copy)]
pub(crate) enum IndexSlice<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl<'py> IndexArray<'py> {
    /// Borrows `obj` as a 1-D C-contiguous int32 or int64 numpy array, or raises a `TypeError`
    /// that names the argument and what it was.
    pub(crate) fn extract(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Self> {
        // `cast` checks type, ndim and dtype without building a Python exception on failure,
        // which matters for the per-call overhead of small requests.
        let borrow_error = |_| {
            PyTypeError::new_err(format!(
                "{name} is being written elsewhere (mutably borrowed)"
            ))
        };
        // int32 first: SGLang's page tables are int32.
        if let Ok(array) = obj.cast::<PyArray1<i32>>() {
            return Ok(IndexArray::I32(array.try_readonly().map_err(borrow_error)?));
        }
        if let Ok(array) = obj.cast::<PyArray1<i64>>() {
            return Ok(IndexArray::I64(array.try_readonly().map_err(borrow_error)?));
        }
        let what = match obj.cast::<PyUntypedArray>() {
            Ok(array) => format!(
                "a {}-D numpy array of dtype {}",
                array.ndim(),
                array.dtype().str()?
            ),
            Err(_) => format!("{}", obj.get_type().name()?),
        };
        Err(PyTypeError::new_err(format!(
            "{name} must be a 1-D numpy array of dtype int32 or int64 (native byte order), got {what}"
        )))
    }

    /// The slice view; a `TypeError` for non-contiguous arrays (no hidden copy).
    pub(crate) fn as_slice(&self, name: &str) -> PyResult<IndexSlice<'_>> {
        let contiguous_error = |_| {
            PyTypeError::new_err(format!(
                "{name} must be C-contiguous (use np.ascontiguousarray)"
            ))
        };
        Ok(match self {
            IndexArray::I32(a) => IndexSlice::I32(a.as_slice().map_err(contiguous_error)?),
            IndexArray::I64(a) => IndexSlice::I64(a.as_slice().map_err(contiguous_error)?),
        })
    }
}

/// Work that is generic over the two index dtypes of a request.
pub(crate) trait IndexVisitor {
    type Output;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output;
}

/// Calls `visitor` with the concrete slice types (four monomorphised variants).
pub(crate) fn dispatch<V: IndexVisitor>(
    src: IndexSlice<'_>,
    dst: IndexSlice<'_>,
    visitor: V,
) -> V::Output {
    match (src, dst) {
        (IndexSlice::I32(s), IndexSlice::I32(d)) => visitor.visit(s, d),
        (IndexSlice::I32(s), IndexSlice::I64(d)) => visitor.visit(s, d),
        (IndexSlice::I64(s), IndexSlice::I32(d)) => visitor.visit(s, d),
        (IndexSlice::I64(s), IndexSlice::I64(d)) => visitor.visit(s, d),
    }
}

impl IndexSlice<'_> {
    fn len(self) -> usize {
        match self {
            IndexSlice::I32(s) => s.len(),
            IndexSlice::I64(s) => s.len(),
        }
    }
}

/// Requests with fewer index pairs than this are planned without releasing the GIL: for a
/// handful of pages, releasing and re-acquiring it costs more than the planning itself.
const DETACH_MIN_PAGES: usize = 1024;

/// Runs `visitor` over the request, with the GIL released unless the request is tiny.
pub(crate) fn visit_request<V>(
    py: Python<'_>,
    src: IndexSlice<'_>,
    dst: IndexSlice<'_>,
    visitor: V,
) -> V::Output
where
    V: IndexVisitor + Send,
    V::Output: Send,
{
    if src.len().max(dst.len()) < DETACH_MIN_PAGES {
        dispatch(src, dst, visitor)
    } else {
        py.detach(|| dispatch(src, dst, visitor))
    }
}
