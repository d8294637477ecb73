//! `copy_local`: the core's CPU copier over Python buffers. Buffers are borrowed without a
//! copy (numpy arrays, bytearrays, memoryviews: anything C-contiguous with the buffer
//! protocol); the core checks that no destination shares memory with another buffer or the
//! plan's columns, and that every block lies inside one buffer, before any byte moves.

use kvplan_core::exchange::local::copy_local_threads;
use kvplan_core::{Region, RegionMut};
use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::digest::{Buffers, regions};
use crate::errors::{KvPlanError, to_py_err};
use crate::plan::PyTransferPlan;

/// Writable byte regions of `spans`, for as long as the [`Buffers`] they came from are held.
fn regions_mut(spans: &[(usize, usize)]) -> Vec<RegionMut<'_>> {
    spans
        .iter()
        .map(|&(addr, len)| RegionMut {
            base: addr as u64,
            // SAFETY: each span is the data pointer and byte size of a writable C-contiguous
            // numpy array held alive by the `Buffers` borrowed for this call (the lifetime of
            // `spans`), so the memory is valid for `len` bytes; `check_local_buffers` has
            // verified that no two of these spans, no source span and no plan column share a
            // byte, so this is the only reference to these bytes in this call. Another Python
            // thread writing the same memory meanwhile (the GIL is released) changes what is
            // copied, never where: every block was checked against the spans.
            bytes: if len == 0 {
                &mut []
            } else {
                unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
            },
        })
        .collect()
}

/// `copy_local(plan, src_buffers, dst_buffers, *, threads=None)`: executes a local plan (a
/// staged or pack plan's gather or scatter) on CPU memory, copying each block from the source
/// buffer holding it to the destination buffer holding it, with the GIL released, on up to
/// `threads` threads (`None`: the available cores up to four, one for a small plan). Returns
/// the bytes copied.
#[pyfunction]
#[pyo3(signature = (plan, src_buffers, dst_buffers, *, threads = None))]
pub(crate) fn copy_local(
    py: Python<'_>,
    plan: PyRef<'_, PyTransferPlan>,
    src_buffers: &Bound<'_, PyAny>,
    dst_buffers: &Bound<'_, PyAny>,
    threads: Option<usize>,
) -> PyResult<u64> {
    if threads == Some(0) {
        return Err(KvPlanError::new_err(
            "copy_local: threads must be at least 1 (or None for the default), got 0",
        ));
    }
    let sources = Buffers::extract_named(py, src_buffers, "src_buffers", false)?;
    let targets = Buffers::extract_named(py, dst_buffers, "dst_buffers", true)?;
    let as_u64 = |spans: &[(usize, usize)]| -> Vec<(u64, u64)> {
        spans.iter().map(|&(a, n)| (a as u64, n as u64)).collect()
    };
    let columns: Vec<(u64, u64)> = PyTransferPlan::column_arrays(&plan, py)
        .iter()
        .map(|c| (c.data() as u64, c.len() as u64 * 8))
        .collect();
    kvplan_core::check_local_buffers(&as_u64(sources.spans()), &as_u64(targets.spans()), &columns)
        .map_err(to_py_err)?;
    let (src_spans, dst_spans) = (sources.spans(), targets.spans());
    PyTransferPlan::with_blocks(&plan, py, |blocks| {
        let run = || {
            let src: Vec<Region<'_>> = regions(src_spans);
            let mut dst = regions_mut(dst_spans);
            copy_local_threads(
                blocks.src_addrs,
                blocks.dst_addrs,
                blocks.lengths,
                &src,
                &mut dst,
                threads,
            )
        };
        py.detach(run).map_err(to_py_err)
    })
}
