//! `group_contiguous`: runs of index pairs contiguous on both sides; `reverse_descending_runs`:
//! a request reordered so that its stretches descending on both sides read ascending.

use kvplan_core::PageIndex;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::input::{IndexVisitor, RequestArrays, visit_request};

/// `(src_starts, dst_starts, lengths)`.
type Runs<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
);

/// Runs contiguous on both sides as `(src_starts, dst_starts, lengths)` int64 arrays.
///
/// Contract: 1-D C-contiguous int32/int64 arrays, borrowed without copying; GIL released.
#[pyfunction]
#[pyo3(signature = (src, dst, /))]
pub fn group_contiguous<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
) -> PyResult<Runs<'py>> {
    struct Contiguous;
    impl IndexVisitor for Contiguous {
        type Output = kvplan_core::Result<(Vec<u64>, Vec<u64>, Vec<u64>)>;
        fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
            kvplan_core::group_contiguous(src, dst)
        }
    }
    let arrays = RequestArrays::extract(src, dst, ("src", "dst"))?;
    let (src_slice, dst_slice) = arrays.slices()?;
    let (s, d, l) = visit_request(py, src_slice, dst_slice, Contiguous).map_err(to_py_err)?;
    let signed = |v: Vec<u64>| signed_in_place(v).into_pyarray(py);
    Ok((signed(s), signed(d), signed(l)))
}

/// A reordered request's `(src, dst)`.
type Reordered<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);

/// `(src, dst)` reordered so that each stretch stepping by -1 on both sides reads ascending
/// (the same pairs), or `None` when nothing descends or the reordering would not leave fewer
/// or as many runs: [`kvplan_core::reverse_descending_runs`].
///
/// Contract: 1-D C-contiguous int32/int64 arrays, borrowed without copying; GIL released for
/// large requests. Returns new int64 arrays.
#[pyfunction]
#[pyo3(signature = (src, dst, /))]
pub fn reverse_descending_runs<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
) -> PyResult<Option<Reordered<'py>>> {
    struct Reverse;
    impl IndexVisitor for Reverse {
        type Output = kvplan_core::Result<Option<(Vec<i64>, Vec<i64>)>>;
        fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
            Ok(
                kvplan_core::reverse_descending_runs(src, dst)?.map(|(s, d)| {
                    (
                        s.iter().map(|x| x.get()).collect(),
                        d.iter().map(|x| x.get()).collect(),
                    )
                }),
            )
        }
    }
    let arrays = RequestArrays::extract(src, dst, ("src", "dst"))?;
    let (src_slice, dst_slice) = arrays.slices()?;
    let reordered = visit_request(py, src_slice, dst_slice, Reverse).map_err(to_py_err)?;
    Ok(reordered.map(|(s, d)| (s.into_pyarray(py), d.into_pyarray(py))))
}

/// The same allocation reinterpreted as int64 (no copy, no second allocation).
///
/// Every value is a validated index, a run start or a run length: all below 2**63, so the
/// reinterpretation is exact.
fn signed_in_place(v: Vec<u64>) -> Vec<i64> {
    debug_assert!(v.iter().all(|&x| i64::try_from(x).is_ok()));
    let mut v = std::mem::ManuallyDrop::new(v);
    let (ptr, len, capacity) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: i64 and u64 have the same size and alignment, so the allocation's layout is the
    // one a Vec<i64> of this capacity frees; every bit pattern is a valid i64; the original
    // Vec is never dropped or used again (ManuallyDrop), so the allocation has one owner.
    unsafe { Vec::from_raw_parts(ptr.cast::<i64>(), len, capacity) }
}
