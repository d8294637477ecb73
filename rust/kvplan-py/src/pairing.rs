//! Entry pairing: the `Pairing` value templates take, and, on their own, SGLang's
//! `build_transfer_entry_pairs` and strict legacy PP slicing.

use std::ffi::CString;

use kvplan_core::{EntryMetadata, LegacyKind, Pairing, PairingMode};
use numpy::PyArray2;
use pyo3::exceptions::{PyDeprecationWarning, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::errors::{KvPlanError, short_repr, to_py_err};
use crate::input::pairs_array;

/// SGLang's `build_transfer_entry_pairs`; when both sides give roles, entries pair only with
/// entries of the same role (keyed by (layer id, role), or by position within each role).
#[pyfunction]
#[pyo3(signature = (src_layer_ids, dst_layer_ids, n_src, n_dst, allow_positional_fallback=false, *, src_roles=None, dst_roles=None))]
#[allow(clippy::too_many_arguments)]
pub fn pair_entries(
    py: Python<'_>,
    src_layer_ids: Option<Vec<i64>>,
    dst_layer_ids: Option<Vec<i64>>,
    n_src: usize,
    n_dst: usize,
    allow_positional_fallback: bool,
    src_roles: Option<Vec<String>>,
    dst_roles: Option<Vec<String>>,
) -> PyResult<Bound<'_, PyArray2<i64>>> {
    let src = EntryMetadata {
        layer_ids: src_layer_ids.as_deref(),
        roles: src_roles.as_deref(),
        n_entries: n_src,
    };
    let dst = EntryMetadata {
        layer_ids: dst_layer_ids.as_deref(),
        roles: dst_roles.as_deref(),
        n_entries: n_dst,
    };
    let pairs =
        kvplan_core::pair_entries(src, dst, allow_positional_fallback).map_err(to_py_err)?;
    pairs_array(py, pairs.into_iter())
}

pub(crate) fn parse_legacy_kind(kind: &str) -> PyResult<LegacyKind> {
    match kind {
        "mla" => Ok(LegacyKind::Mla),
        "mha" => Ok(LegacyKind::Mha),
        other => Err(KvPlanError::new_err(format!(
            "legacy kind must be \"mla\" or \"mha\", got {other:?}"
        ))),
    }
}

/// Positional PP slicing for peers without layer ids (strict; see the core's `legacy_pp_pairs`).
#[pyfunction]
#[pyo3(signature = (kind, n_src, n_dst, prefill_start_layer, *, num_draft_entries=0, decode_num_layers=None))]
pub fn legacy_pp_pairs<'py>(
    py: Python<'py>,
    kind: &str,
    n_src: usize,
    n_dst: usize,
    prefill_start_layer: usize,
    num_draft_entries: usize,
    decode_num_layers: Option<usize>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let kind = parse_legacy_kind(kind)?;
    let pairs = kvplan_core::legacy_pp_pairs(
        kind,
        n_src,
        n_dst,
        prefill_start_layer,
        num_draft_entries,
        decode_num_layers,
    )
    .map_err(to_py_err)?;
    pairs_array(py, pairs.into_iter())
}

/// How a `Template` pairs prefill entries with decode entries (an immutable value).
///
/// Build one with `Pairing.by_layer_id(...)`, `Pairing.positional()` or
/// `Pairing.legacy(...)`; pass it as `pairing=` to `Template`, `compare` and `check_pairs`.
#[pyclass(
    frozen,
    eq,
    hash,
    skip_from_py_object,
    name = "Pairing",
    module = "kvplan"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyPairing {
    pub(crate) inner: Pairing,
}

#[pymethods]
impl PyPairing {
    /// Pair by (global layer id, role). Peers that publish no ids pair positionally when
    /// `allow_positional_fallback`, or by legacy PP slicing from `prefill_start_layer` when
    /// their entry counts differ (`legacy_kind` "mla" or "mha"; inferred from roles if None).
    #[staticmethod]
    #[pyo3(signature = (allow_positional_fallback=false, *, prefill_start_layer=None, legacy_kind=None))]
    fn by_layer_id(
        allow_positional_fallback: bool,
        prefill_start_layer: Option<usize>,
        legacy_kind: Option<&str>,
    ) -> PyResult<Self> {
        let kind = legacy_kind.map(parse_legacy_kind).transpose()?;
        Ok(Self {
            inner: Pairing::by_layer_id(allow_positional_fallback, prefill_start_layer, kind),
        })
    }

    /// Ignore the page entries' layer ids and pair by position (within each role when both
    /// peers publish roles; extra decode entries allowed). State entries still pair by id.
    #[staticmethod]
    fn positional() -> Self {
        Self {
            inner: Pairing::positional(),
        }
    }

    /// Ignore the page entries' layer ids and slice strictly from `prefill_start_layer` (per
    /// role when both peers publish roles). State entries still pair by id.
    #[staticmethod]
    #[pyo3(signature = (kind=None, *, prefill_start_layer))]
    fn legacy(kind: Option<&str>, prefill_start_layer: usize) -> PyResult<Self> {
        let kind = kind.map(parse_legacy_kind).transpose()?;
        Ok(Self {
            inner: Pairing::legacy(kind, prefill_start_layer),
        })
    }

    /// The `Pairing` that `Template(src, dst, pairing, **shorthands)` uses, for Python functions
    /// that take `Template`'s pairing arguments and forward them (`kvplan.compare`). A bool
    /// `pairing` or a shorthand warns as `Template` does; `stacklevel` 2 blames the caller of
    /// the forwarding function.
    #[staticmethod]
    #[pyo3(name = "_from_template_arguments", signature = (pairing=None, *, allow_positional_fallback=None, prefill_start_layer=None, legacy_kind=None, stacklevel=2))]
    fn from_template_arguments(
        py: Python<'_>,
        pairing: Option<&Bound<'_, PyAny>>,
        allow_positional_fallback: Option<bool>,
        prefill_start_layer: Option<usize>,
        legacy_kind: Option<&str>,
        stacklevel: i32,
    ) -> PyResult<Self> {
        let shorthand = PairingShorthand {
            allow_positional_fallback,
            prefill_start_layer,
            legacy_kind,
        };
        Ok(Self {
            inner: resolve_pairing(py, pairing, shorthand, stacklevel)?,
        })
    }

    /// `"layer_id"`, `"positional"` or `"legacy"`.
    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.mode().as_str()
    }

    #[getter]
    fn allow_positional_fallback(&self) -> bool {
        self.inner.allow_positional_fallback()
    }

    #[getter]
    fn prefill_start_layer(&self) -> Option<usize> {
        self.inner.prefill_start_layer()
    }

    #[getter]
    fn legacy_kind(&self) -> Option<&'static str> {
        self.inner.legacy_kind().map(LegacyKind::as_str)
    }

    fn __repr__(&self) -> String {
        Self::expression(self.inner)
    }
}

impl PyPairing {
    /// The Python expression that builds `p` (`Pairing.by_layer_id(...)`, ...): its
    /// repr, and what the deprecation warnings tell callers to write.
    pub(crate) fn expression(p: Pairing) -> String {
        let kind = |k: Option<LegacyKind>| k.map(|k| format!("'{}'", k.as_str()));
        match p.mode() {
            PairingMode::Positional => "Pairing.positional()".into(),
            PairingMode::Legacy => {
                let start = p.prefill_start_layer().unwrap_or_default();
                match kind(p.legacy_kind()) {
                    Some(k) => format!("Pairing.legacy({k}, prefill_start_layer={start})"),
                    None => format!("Pairing.legacy(prefill_start_layer={start})"),
                }
            }
            PairingMode::LayerId => {
                let mut args = Vec::new();
                if p.allow_positional_fallback() {
                    args.push("allow_positional_fallback=True".to_string());
                }
                if let Some(start) = p.prefill_start_layer() {
                    args.push(format!("prefill_start_layer={start}"));
                }
                if let Some(k) = kind(p.legacy_kind()) {
                    args.push(format!("legacy_kind={k}"));
                }
                format!("Pairing.by_layer_id({})", args.join(", "))
            }
        }
    }
}

/// The keywords that build a `Pairing.by_layer_id(...)` in place of `pairing=` (deprecated).
#[derive(Clone, Copy)]
pub(crate) struct PairingShorthand<'a> {
    pub(crate) allow_positional_fallback: Option<bool>,
    pub(crate) prefill_start_layer: Option<usize>,
    pub(crate) legacy_kind: Option<&'a str>,
}

impl PairingShorthand<'_> {
    fn is_given(&self) -> bool {
        self.allow_positional_fallback.is_some()
            || self.prefill_start_layer.is_some()
            || self.legacy_kind.is_some()
    }
}

/// The pairing a call asked for: `pairing` (a `Pairing`, or a bool standing for
/// `allow_positional_fallback`, which positional callers pass there), or the shorthand keywords
/// that build one. A `Pairing` together with a shorthand is a `TypeError`.
///
/// The bool and the shorthands still work, but each call that uses them gets one
/// `DeprecationWarning` naming the `Pairing` to pass instead. `stacklevel` is `warnings.warn`'s:
/// 1 blames the Python line that called into Rust, 2 the line above it (for Python functions
/// that forward their own pairing arguments, such as `kvplan.compare`).
pub(crate) fn resolve_pairing(
    py: Python<'_>,
    pairing: Option<&Bound<'_, PyAny>>,
    shorthand: PairingShorthand<'_>,
    stacklevel: i32,
) -> PyResult<Pairing> {
    let pairing = pairing.filter(|p| !p.is_none());
    if let Some(p) = pairing
        && let Ok(p) = p.cast::<PyPairing>()
    {
        if shorthand.is_given() {
            return Err(PyTypeError::new_err(
                "pass either pairing= or its shorthand keywords (allow_positional_fallback, prefill_start_layer, legacy_kind), not both",
            ));
        }
        return Ok(p.get().inner);
    }
    let bool_pairing = match pairing {
        None => None,
        Some(p) => {
            // A bool is the only non-`Pairing` value accepted (`extract::<bool>` takes no int).
            let Ok(flag) = p.extract::<bool>() else {
                return Err(PyTypeError::new_err(format!(
                    "pairing must be a kvplan.Pairing, got {} of type {}",
                    short_repr(p),
                    p.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                )));
            };
            if shorthand.allow_positional_fallback.is_some() {
                return Err(PyTypeError::new_err(
                    "allow_positional_fallback given twice (positionally and as a keyword)",
                ));
            }
            Some(flag)
        }
    };
    let resolved = Pairing::by_layer_id(
        bool_pairing
            .or(shorthand.allow_positional_fallback)
            .unwrap_or(false),
        shorthand.prefill_start_layer,
        shorthand.legacy_kind.map(parse_legacy_kind).transpose()?,
    );
    if bool_pairing.is_some() || shorthand.is_given() {
        warn_deprecated_pairing(py, bool_pairing, shorthand, resolved, stacklevel)?;
    }
    Ok(resolved)
}

/// The `DeprecationWarning` for a bool `pairing` or shorthand keywords: what the call wrote, and
/// the `pairing=` that means the same. An error when warnings are errors.
fn warn_deprecated_pairing(
    py: Python<'_>,
    bool_pairing: Option<bool>,
    shorthand: PairingShorthand<'_>,
    resolved: Pairing,
    stacklevel: i32,
) -> PyResult<()> {
    let python_bool = |b: bool| if b { "True" } else { "False" };
    let mut written = Vec::new();
    if let Some(flag) = bool_pairing {
        written.push(format!("pairing={}", python_bool(flag)));
    }
    if let Some(flag) = shorthand.allow_positional_fallback {
        written.push(format!("allow_positional_fallback={}", python_bool(flag)));
    }
    if let Some(start) = shorthand.prefill_start_layer {
        written.push(format!("prefill_start_layer={start}"));
    }
    if let Some(kind) = shorthand.legacy_kind {
        written.push(format!("legacy_kind='{kind}'"));
    }
    let verb = if written.len() == 1 { "is" } else { "are" };
    let message = format!(
        "{} {verb} deprecated: pass pairing=kvplan.{}",
        written.join(", "),
        PyPairing::expression(resolved)
    );
    let message = CString::new(message).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let category = py.get_type::<PyDeprecationWarning>();
    PyErr::warn(py, category.as_any(), &message, stacklevel)
}
