//! Argument conversion for the core's integrity digests: a side's memory as zero-copy byte
//! regions of Python buffers, and a plan's columns as slices. The hashing is the core's.

use kvplan_core::{PlanBlocks, Region, Side};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::{KvPlanError, to_py_err};
use crate::input::IndexArray;

/// Plans of at least this many blocks, or moving at least `DETACH_BYTES`, are digested with
/// the GIL released (a few long blocks take as long to hash as many short ones).
const DETACH_BLOCKS: usize = 256;
const DETACH_BYTES: u64 = 1 << 20;

/// `"src"` or `"dst"`, else a `KvPlanError`.
pub(crate) fn parse_side(side: &str) -> PyResult<Side> {
    match side {
        "src" => Ok(Side::Src),
        "dst" => Ok(Side::Dst),
        other => Err(KvPlanError::new_err(format!(
            "side must be \"src\" or \"dst\", got {other:?}"
        ))),
    }
}

/// Python buffers held for the duration of a digest: each one's address and size in bytes.
pub(crate) struct Buffers<'py> {
    /// Keeps every buffer alive (and numpy's view of a non-array buffer).
    _arrays: Vec<Bound<'py, PyUntypedArray>>,
    spans: Vec<(usize, usize)>,
}

impl<'py> Buffers<'py> {
    /// Borrows every object of `buffers` without copying: a numpy array of any dtype as it is,
    /// anything else with the buffer protocol through `numpy.frombuffer`. Each must be
    /// C-contiguous.
    pub(crate) fn extract(py: Python<'py>, buffers: &Bound<'py, PyAny>) -> PyResult<Self> {
        Self::extract_named(py, buffers, "buffers", false)
    }

    /// As [`Buffers::extract`], naming the argument `name` in messages; with `writable`, a
    /// read-only buffer is a `KvPlanError`.
    pub(crate) fn extract_named(
        py: Python<'py>,
        buffers: &Bound<'py, PyAny>,
        name: &str,
        writable: bool,
    ) -> PyResult<Self> {
        let frombuffer = py.import("numpy")?.getattr("frombuffer")?;
        let mut arrays = Vec::new();
        let mut spans = Vec::new();
        for (i, obj) in buffers.try_iter()?.enumerate() {
            let obj = obj?;
            let array = if let Ok(array) = obj.cast::<PyUntypedArray>() {
                array.clone()
            } else {
                let view = frombuffer.call1((&obj, "uint8")).map_err(|e| {
                    PyTypeError::new_err(format!(
                        "{name}[{i}] ({}) is not a C-contiguous object with the buffer \
                         protocol: {e}",
                        obj.get_type()
                            .name()
                            .map_or_else(|_| "?".into(), |n| n.to_string())
                    ))
                })?;
                view.cast_into::<PyUntypedArray>()?
            };
            if writable
                && !array
                    .getattr("flags")?
                    .getattr("writeable")?
                    .extract::<bool>()?
            {
                return Err(KvPlanError::new_err(format!(
                    "{name}[{i}] is read-only ({}, {} bytes): a local copy writes its \
                     destination buffers; pass writable memory (a numpy array, bytearray or \
                     writable memoryview)",
                    obj.get_type()
                        .name()
                        .map_or_else(|_| "?".into(), |n| n.to_string()),
                    array.len() * array.dtype().itemsize()
                )));
            }
            if !array.is_c_contiguous() {
                return Err(PyTypeError::new_err(format!(
                    "{name}[{i}] is not C-contiguous (shape {:?}, strides {:?}): pass the \
                     whole registered buffer, not a strided view",
                    array.shape(),
                    array.strides()
                )));
            }
            let nbytes = array.len() * array.dtype().itemsize();
            // SAFETY: `as_array_ptr` points to the live array object held by `array`; reading
            // its `data` field does not touch the data.
            let data = unsafe { (*array.as_array_ptr()).data };
            spans.push((data as usize, nbytes));
            arrays.push(array);
        }
        Ok(Self {
            _arrays: arrays,
            spans,
        })
    }

    /// The address and size of every buffer (plain values, `Send`).
    pub(crate) fn spans(&self) -> &[(usize, usize)] {
        &self.spans
    }
}

/// Byte regions of `spans`, for as long as the [`Buffers`] they came from are held.
pub(crate) fn regions(spans: &[(usize, usize)]) -> Vec<Region<'_>> {
    spans
        .iter()
        .map(|&(addr, len)| Region {
            base: addr as u64,
            // SAFETY: each span is the data pointer and byte size of a C-contiguous numpy array
            // held alive by the `Buffers` borrowed for this call (the lifetime of `spans`), so
            // the memory is valid for `len` bytes; it is only read. Another thread may write it
            // concurrently (as a transfer engine does), which can change the digest but never
            // reads outside the buffer.
            bytes: if len == 0 {
                &[]
            } else {
                unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
            },
        })
        .collect()
}

/// The pair digests of `blocks` read on `side` from `buffers`, with the GIL released for
/// large plans.
pub(crate) fn pair_digests(
    py: Python<'_>,
    blocks: &PlanBlocks<'_>,
    side: Side,
    buffers: &Buffers<'_>,
) -> PyResult<Vec<u64>> {
    let spans = buffers.spans();
    let run = || kvplan_core::pair_content_digests(blocks, side, &regions(spans));
    let large =
        blocks.lengths.len() >= DETACH_BLOCKS || blocks.lengths.iter().sum::<u64>() >= DETACH_BYTES;
    let digests = if large { py.detach(run) } else { run() };
    digests.map_err(to_py_err)
}

/// `index_digest(pages)`: XXH3-64 of a page list (int32 or int64, widened to int64), as the
/// integrity manifest carries it.
#[pyfunction]
pub(crate) fn index_digest(pages: &Bound<'_, PyAny>) -> PyResult<u64> {
    let array = IndexArray::extract(pages, "pages")?;
    Ok(match array.as_slice("pages")? {
        crate::input::IndexSlice::I32(s) => kvplan_core::index_digest(s),
        crate::input::IndexSlice::I64(s) => kvplan_core::index_digest(s),
    })
}

/// `combine_pair_digests(pair_digests)`: the content digest of a plan from its pair digests
/// (what `TransferPlan.content_digest` returns, without hashing the bytes again).
#[pyfunction]
pub(crate) fn combine_pair_digests(pair_digests: Vec<u64>) -> u64 {
    kvplan_core::content_digest(&pair_digests)
}

/// A lease's request id as bytes: a `str` (UTF-8) or `bytes`.
fn request_id_bytes(request: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(text) = request.cast::<pyo3::types::PyString>() {
        return Ok(text.to_str()?.as_bytes().to_vec());
    }
    if let Ok(bytes) = request.cast::<pyo3::types::PyBytes>() {
        return Ok(bytes.as_bytes().to_vec());
    }
    Err(KvPlanError::new_err(format!(
        "a lease's request id must be str or bytes, got {}",
        request.get_type().name()?
    )))
}

/// A lease object's epoch and request id bytes (an object with `epoch` and `request`, such as
/// `kvplan.leases.Lease`), as the core's digests read them.
pub(crate) fn lease_parts(lease: &Bound<'_, PyAny>) -> PyResult<(u64, Vec<u8>)> {
    let epoch = lease.getattr("epoch")?;
    let epoch: u64 = epoch.extract().map_err(|_| {
        KvPlanError::new_err(format!(
            "a lease's epoch must be an int in [0, 2**64), got {epoch}"
        ))
    })?;
    Ok((epoch, request_id_bytes(&lease.getattr("request")?)?))
}

/// The core's request digest of a plan (its skip count and, when given, its lease bound in):
/// the one rule `TransferPlan.digest` and a batch's `request_digests` share.
pub(crate) fn request_digest(
    plan_digest: u64,
    skip_tokens: u64,
    lease: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let parts = lease.map(lease_parts).transpose()?;
    let lease = parts
        .as_ref()
        .map(|(epoch, request)| kvplan_core::LeaseRef {
            epoch: *epoch,
            request,
        });
    Ok(kvplan_core::request_plan_digest(
        plan_digest,
        skip_tokens,
        lease,
    ))
}

/// `leased_plan_digest(plan_digest, epoch, request)`: a plan digest bound to the destination's
/// lease (the request id, `str` or `bytes`, and the epoch the decode allocated its pages in).
#[pyfunction]
pub(crate) fn leased_plan_digest(
    plan_digest: u64,
    epoch: u64,
    request: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    Ok(kvplan_core::leased_plan_digest(
        plan_digest,
        epoch,
        &request_id_bytes(request)?,
    ))
}
