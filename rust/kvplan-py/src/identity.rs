//! `LayoutIdentity`, `Verdict`, `layout_identity` and `compatibility`: the core's address-free
//! identity of a layout and its compatibility verdicts, converted and forwarded.

use kvplan_core::{LayoutIdentity, Semantics, TransferMode, Verdict};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_py_err;
use crate::layout::PyLayout;
use crate::options::template_options;

/// A layout's address-free identity with the caller's model semantics.
#[pyclass(frozen, name = "LayoutIdentity", module = "kvplan._core")]
pub struct PyLayoutIdentity {
    /// The layout it was computed from, shared (a verdict asks the planner about it).
    layout: Py<PyLayout>,
    inner: LayoutIdentity,
}

#[pymethods]
impl PyLayoutIdentity {
    /// Same on every rank of a deployment: what a router matches and the info metric exports.
    #[getter]
    fn class_id(&self) -> String {
        self.inner.class_id()
    }

    /// One rank's exact layout: what an offload store keys blocks by.
    #[getter]
    fn layout_id(&self) -> String {
        self.inner.layout_id()
    }

    /// The canonical class encoding the class id hashes.
    fn class_encoding<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let encoding = kvplan_core::exchange::identity::class_encoding(
            &self.layout.get().inner,
            self.inner.semantics(),
        );
        PyBytes::new(py, &encoding)
    }

    /// The layout it was computed from.
    #[getter]
    fn layout(&self, py: Python<'_>) -> Py<PyLayout> {
        self.layout.clone_ref(py)
    }

    /// Model id (`""`: not declared).
    #[getter]
    fn model(&self) -> &str {
        &self.inner.semantics().model
    }

    /// Model revision (`""`: not declared).
    #[getter]
    fn revision(&self) -> &str {
        &self.inner.semantics().revision
    }

    /// RoPE configuration as canonical text (`""`: not declared).
    #[getter]
    fn rope(&self) -> &str {
        &self.inner.semantics().rope
    }

    /// Draft models, sorted, each once.
    #[getter]
    fn drafts(&self) -> Vec<String> {
        self.inner.semantics().drafts.clone()
    }

    /// `"push"` or `"pull"`.
    #[getter]
    fn transfer(&self) -> &'static str {
        self.inner.semantics().transfer.as_str()
    }

    /// Whether the engine keeps cross-layer KV blocks.
    #[getter]
    fn cross_layer(&self) -> bool {
        self.inner.semantics().cross_layer
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyLayoutIdentity>()
            .is_ok_and(|o| o.get().inner.layout_id() == self.inner.layout_id())
    }

    fn __hash__(&self) -> u64 {
        let digest = self.inner.class_digest();
        u64::from_le_bytes([
            digest[0], digest[1], digest[2], digest[3], digest[4], digest[5], digest[6], digest[7],
        ])
    }

    fn __repr__(&self) -> String {
        format!(
            "LayoutIdentity(class_id={:?}, layout_id={:?})",
            self.inner.class_id(),
            self.inner.layout_id()
        )
    }
}

/// A compatibility verdict: `kind`, the `reason` in words naming both values, and what refused.
#[pyclass(frozen, name = "Verdict", module = "kvplan._core")]
pub struct PyVerdict {
    inner: Verdict,
}

#[pymethods]
impl PyVerdict {
    /// `"plannable"`, `"plannable_with_conversion"` or `"refused"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind.as_str()
    }

    /// Why, naming the prefill's and the decode's values.
    #[getter]
    fn reason(&self) -> &str {
        &self.inner.reason
    }

    /// `"semantics"` or the planner error's `kind`; `None` when plannable.
    #[getter]
    fn refused_by(&self) -> Option<&'static str> {
        self.inner.refused_by
    }

    /// Whether a plan may be built.
    #[getter]
    fn plannable(&self) -> bool {
        self.inner.plannable()
    }

    fn __bool__(&self) -> bool {
        self.inner.plannable()
    }

    fn __repr__(&self) -> String {
        format!(
            "Verdict(kind={:?}, reason={:?})",
            self.inner.kind.as_str(),
            self.inner.reason
        )
    }
}

/// The identity of `layout` with the caller's semantics. `transfer` is `"push"` or `"pull"`
/// (`LayoutError` otherwise); `drafts` are sorted and each kept once.
#[pyfunction]
#[pyo3(signature = (layout, *, model, revision, rope, drafts, transfer, cross_layer))]
#[allow(clippy::too_many_arguments)]
pub fn layout_identity(
    layout: Bound<'_, PyLayout>,
    model: String,
    revision: String,
    rope: String,
    drafts: Vec<String>,
    transfer: &str,
    cross_layer: bool,
) -> PyResult<PyLayoutIdentity> {
    let transfer = TransferMode::parse(transfer).map_err(to_py_err)?;
    let semantics = Semantics::new(model, revision, rope, drafts, transfer, cross_layer);
    let inner = LayoutIdentity::new(&layout.get().inner, semantics);
    Ok(PyLayoutIdentity {
        layout: layout.unbind(),
        inner,
    })
}

/// The verdict on `prefill` sending to `decode`, planned with `pairing` (default by layer id).
#[pyfunction]
#[pyo3(signature = (prefill, decode, pairing=None, *, replicas_send=false))]
pub fn compatibility(
    prefill: PyRef<'_, PyLayoutIdentity>,
    decode: PyRef<'_, PyLayoutIdentity>,
    pairing: Option<&Bound<'_, PyAny>>,
    replicas_send: bool,
) -> PyResult<PyVerdict> {
    let options = template_options("compatibility", pairing, None, false, replicas_send)?;
    let inner = kvplan_core::compatibility_with(
        (&prefill.layout.get().inner, &prefill.inner),
        (&decode.layout.get().inner, &decode.inner),
        options,
    );
    Ok(PyVerdict { inner })
}
