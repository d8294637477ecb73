//! Pack plans (`Template.plan_packed`, `Template.plan_row_gather`): arguments converted, the
//! core's `pack` module called, its gather and network plans handed out as `TransferPlan`s
//! and a `RowGather`.

use std::sync::Arc;

use kvplan_core::{FlatBuffer, PackPlanner, PackedPlan, PageIndex, PlanPart, Request, Template};
use numpy::{PyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::{KvPlanError, to_py_err};
use crate::input::RequestPlanner;
use crate::plan::{PyTransferPlan, owned_columns, pooled, pooled_columns};
use crate::request::{Loose, RequestInput};

/// One request planned and split around a pack buffer.
struct PlanPacked<'t>(&'t Template, kvplan_core::PackBuffer);

impl RequestPlanner for PlanPacked<'_> {
    type Output = kvplan_core::Result<(FlatBuffer, PackedPlan<PlanPart>)>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        PackPlanner::new(self.0).plan_into(request, self.1, pooled)
    }
}

/// One request planned as a row gather and a network plan.
struct PlanRowGather<'t>(&'t Template, kvplan_core::PackBuffer);

impl RequestPlanner for PlanRowGather<'_> {
    type Output = kvplan_core::Result<(kvplan_core::RowGather, kvplan_core::Plan)>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        PackPlanner::new(self.0).row_gather(request, self.1)
    }
}

/// The gather of a pack plan as source rows (`Template.plan_row_gather`): what a gather kernel
/// takes instead of one block per row.
#[pyclass(name = "RowGather", module = "kvplan._core", frozen)]
pub struct PyRowGather {
    rows: Vec<Py<numpy::PyArray1<u64>>>,
    copies: Py<PyArray2<u64>>,
    pack_bytes: u64,
}

#[pymethods]
impl PyRowGather {
    /// Per token lane (0: target tokens, 1: draft tokens sent whole), the source row of every
    /// token moved, in token order (`row = source page index * rows_per_page + slot`), uint64.
    #[getter]
    fn rows(&self, py: Python<'_>) -> Vec<Py<numpy::PyArray1<u64>>> {
        self.rows.iter().map(|r| r.clone_ref(py)).collect()
    }

    /// One row per copy (piece), uint64 columns `lane, src_base, page_stride, row_stride,
    /// rows_per_page, len, pack_addr`: row `r = rows[lane][k]` copies `len` bytes from
    /// `src_base + (r // rows_per_page) * page_stride + (r % rows_per_page) * row_stride` to
    /// `pack_addr + k * len`.
    #[getter]
    fn copies(&self, py: Python<'_>) -> Py<PyArray2<u64>> {
        self.copies.clone_ref(py)
    }

    /// Bytes of the pack buffer used, from its start.
    #[getter]
    fn pack_bytes(&self) -> u64 {
        self.pack_bytes
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let rows: usize = self.rows.iter().map(|r| r.bind(py).len()).sum();
        format!(
            "RowGather(copies={}, rows={rows}, pack_bytes={})",
            self.copies.bind(py).shape()[0],
            self.pack_bytes
        )
    }
}

/// Plans one request (as `plan`) split in two around a pack buffer `pack = (addr, size)` of
/// prefill memory: `(gather, network)`, the gather from prefill memory into the buffer
/// (executed by the caller) and the network plan from the buffer to the decode, one block
/// per destination-contiguous run. A `SizeMismatchError` names the bytes needed when the
/// buffer is too small.
pub(crate) fn plan_packed<'py>(
    py: Python<'py>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_pages: &Bound<'py, PyAny>,
    dst_pages: Option<&Bound<'py, PyAny>>,
    pack: (u64, u64),
    n_tokens: Option<u64>,
) -> PyResult<(Py<PyTransferPlan>, Py<PyTransferPlan>)> {
    let loose = Loose {
        n_tokens,
        ..Loose::default()
    };
    let request = RequestInput::of_args("plan_packed", src_pages, dst_pages, loose)?;
    let buffer = kvplan_core::PackBuffer {
        addr: pack.0,
        size: pack.1,
    };
    let planner = PlanPacked(template, buffer);
    let (columns, packed) = request.plan(py, planner)?.map_err(to_py_err)?;
    let gather_columns =
        pooled_columns(py, columns.data, columns.capacity, packed.gather.n_blocks)?;
    let gather = kvplan_core::Plan {
        n_runs: packed.gather.n_blocks,
        total_bytes: packed.pack_bytes,
        pair_offsets: packed.gather.pair_offsets,
        ..kvplan_core::Plan::default()
    };
    let mut network = packed.network;
    let network_columns = owned_columns(py, &mut network);
    let half = |columns, plan: &kvplan_core::Plan| {
        let half = PyTransferPlan::packed(columns, Arc::clone(template), plan, fingerprints);
        Py::new(py, half)
    };
    Ok((
        half(gather_columns, &gather)?,
        half(network_columns, &network)?,
    ))
}

/// Plans one token request as a gather of source rows into the pack buffer at
/// `pack=(addr, size)` and the network plan out of it: the network plan `plan_packed`
/// returns, and a gather that copies what its gather copies, described by rows instead of
/// one block per row. A `SizeMismatchError` names the bytes needed when the buffer is too
/// small; a page request (no `n_tokens` on a template that plans by page) is a
/// `KvPlanError`.
pub(crate) fn plan_row_gather<'py>(
    py: Python<'py>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_pages: &Bound<'py, PyAny>,
    dst_pages: Option<&Bound<'py, PyAny>>,
    pack: (u64, u64),
    n_tokens: Option<u64>,
) -> PyResult<(PyRowGather, Py<PyTransferPlan>)> {
    let loose = Loose {
        n_tokens,
        ..Loose::default()
    };
    let request = RequestInput::of_args("plan_row_gather", src_pages, dst_pages, loose)?;
    let buffer = kvplan_core::PackBuffer {
        addr: pack.0,
        size: pack.1,
    };
    let planner = PlanRowGather(template, buffer);
    let (gather, mut network) = request.plan(py, planner)?.map_err(to_py_err)?;
    let rows = gather
        .rows
        .into_iter()
        .map(|r| numpy::PyArray1::from_vec(py, r).unbind())
        .collect();
    let table: Vec<Vec<u64>> = gather
        .copies
        .iter()
        .map(|c| {
            vec![
                c.lane as u64,
                c.src_base,
                c.page_stride,
                c.row_stride,
                c.rows_per_page,
                c.len,
                c.pack_addr,
            ]
        })
        .collect();
    let copies = if table.is_empty() {
        numpy::PyArray2::<u64>::zeros(py, [0, 7], false).unbind()
    } else {
        PyArray2::from_vec2(py, &table)
            .map_err(|e| KvPlanError::new_err(e.to_string()))?
            .unbind()
    };
    let network_columns = owned_columns(py, &mut network);
    let network = PyTransferPlan::packed(
        network_columns,
        Arc::clone(template),
        &network,
        fingerprints,
    );
    let network = Py::new(py, network)?;
    Ok((
        PyRowGather {
            rows,
            copies,
            pack_bytes: gather.pack_bytes,
        },
        network,
    ))
}
