//! Entry pairing: the `Pairing` value templates take, and, on their own, SGLang's
//! `build_transfer_entry_pairs` and strict legacy PP slicing.

use kvplan_core::{EntryMetadata, LegacyKind, Pairing, PairingMode};
use numpy::PyArray2;
use pyo3::prelude::*;

use crate::convert::pairs_array;
use crate::errors::{KvPlanError, to_py_err};
use crate::options::{PairingShorthand, resolve_pairing};

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
