//! `TransferCost`, `Advice` and `advise`: the core's direct-or-staged choice, converted and
//! forwarded (`Template.transfer_advice` asks the same rule with the core's counts).

use kvplan_core::{Advice, PageIndex, Request, Template, TransferCost};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::to_py_err;
use crate::input::RequestPlanner;
use crate::request::{Loose, RequestInput, shift_after};

/// What moving bytes costs on one engine (seconds per block, network and copy bandwidths).
#[pyclass(frozen, eq, name = "TransferCost", module = "kvplan._core")]
#[derive(PartialEq)]
pub struct PyTransferCost {
    pub(crate) inner: TransferCost,
}

#[pymethods]
impl PyTransferCost {
    #[new]
    #[pyo3(signature = (*, per_block_s, network_bytes_per_s, copy_bytes_per_s))]
    fn new(per_block_s: f64, network_bytes_per_s: f64, copy_bytes_per_s: f64) -> PyResult<Self> {
        TransferCost::new(per_block_s, network_bytes_per_s, copy_bytes_per_s)
            .map(|inner| Self { inner })
            .map_err(to_py_err)
    }

    #[getter]
    fn per_block_s(&self) -> f64 {
        self.inner.per_block_s()
    }

    #[getter]
    fn network_bytes_per_s(&self) -> f64 {
        self.inner.network_bytes_per_s()
    }

    #[getter]
    fn copy_bytes_per_s(&self) -> f64 {
        self.inner.copy_bytes_per_s()
    }

    /// Pickles as the keyword call that rebuilds it (measured costs cross process
    /// boundaries).
    fn __getnewargs_ex__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
        let kwargs = PyDict::new(py);
        let c = self.inner;
        kwargs.set_item("per_block_s", c.per_block_s())?;
        kwargs.set_item("network_bytes_per_s", c.network_bytes_per_s())?;
        kwargs.set_item("copy_bytes_per_s", c.copy_bytes_per_s())?;
        Ok((PyTuple::empty(py), kwargs))
    }

    fn __repr__(&self) -> String {
        let c = self.inner;
        format!(
            "TransferCost(per_block_s={:e}, network_bytes_per_s={:e}, copy_bytes_per_s={:e})",
            c.per_block_s(),
            c.network_bytes_per_s(),
            c.copy_bytes_per_s()
        )
    }
}

/// The choice for one request and the estimates it rests on.
#[pyclass(frozen, name = "Advice", module = "kvplan._core")]
pub struct PyAdvice {
    inner: Advice,
}

impl From<Advice> for PyAdvice {
    fn from(inner: Advice) -> Self {
        Self { inner }
    }
}

#[pymethods]
impl PyAdvice {
    /// `"direct"` or `"staged"`.
    #[getter]
    fn choice(&self) -> &'static str {
        self.inner.choice.as_str()
    }

    #[getter]
    fn direct_s(&self) -> f64 {
        self.inner.direct_s
    }

    #[getter]
    fn staged_s(&self) -> f64 {
        self.inner.staged_s
    }

    #[getter]
    fn direct_blocks(&self) -> usize {
        self.inner.direct_blocks
    }

    #[getter]
    fn staged_blocks(&self) -> usize {
        self.inner.staged_blocks
    }

    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes
    }

    #[getter]
    fn copy_bytes(&self) -> u64 {
        self.inner.copy_bytes
    }

    fn __repr__(&self) -> String {
        let a = self.inner;
        format!(
            "Advice(choice='{}', direct_s={:e}, staged_s={:e}, direct_blocks={}, staged_blocks={}, bytes={}, copy_bytes={})",
            a.choice.as_str(),
            a.direct_s,
            a.staged_s,
            a.direct_blocks,
            a.staged_blocks,
            a.bytes,
            a.copy_bytes
        )
    }
}

/// Direct or staged for a request of these counts (the core's rule).
#[pyfunction]
#[pyo3(signature = (direct_blocks, staged_network_blocks, bytes, gather_bytes, scatter_bytes, cost))]
pub fn advise(
    direct_blocks: usize,
    staged_network_blocks: usize,
    bytes: u64,
    gather_bytes: u64,
    scatter_bytes: u64,
    cost: PyRef<'_, PyTransferCost>,
) -> PyAdvice {
    kvplan_core::advise(
        direct_blocks,
        staged_network_blocks,
        bytes,
        gather_bytes,
        scatter_bytes,
        &cost.inner,
    )
    .into()
}

/// One request's direct-or-staged advice.
struct PlanAdvice<'t>(&'t Template, TransferCost);

impl RequestPlanner for PlanAdvice<'_> {
    type Output = kvplan_core::Result<Advice>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        kvplan_core::transfer_advice(self.0, request, &self.1)
    }
}

/// Direct or staged for one request (taken as `plan` takes it) on an engine of `cost`: the
/// core's rule over the request's direct and staged network block counts.
pub(crate) fn transfer_advice(
    py: Python<'_>,
    template: &Template,
    src_pages: &Bound<'_, PyAny>,
    dst_pages: Option<&Bound<'_, PyAny>>,
    cost: Option<&Bound<'_, PyAny>>,
    n_tokens: Option<u64>,
) -> PyResult<PyAdvice> {
    let (dst_pages, cost) = shift_after(src_pages, dst_pages, cost);
    let Some(cost) = cost else {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "transfer_advice() needs cost (a kvplan.TransferCost) after the request",
        ));
    };
    let cost = cost.extract::<PyRef<'_, PyTransferCost>>()?;
    let loose = Loose {
        n_tokens,
        ..Loose::default()
    };
    let request = RequestInput::of_args("transfer_advice", src_pages, dst_pages, loose)?;
    let planner = PlanAdvice(template, cost.inner);
    let advice = request.plan(py, planner)?.map_err(to_py_err)?;
    Ok(advice.into())
}
