//! Entry pairing: the `Pairing` value templates take, and, on their own, SGLang's
//! `build_transfer_entry_pairs` and strict legacy PP slicing.

use kvplan_core::{EntryMetadata, LegacyKind, Pairing, PairingMode};
use numpy::PyArray2;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

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

    /// The `Pairing` a call of `function` asked for, for Python functions that take
    /// `Template`'s `pairing` argument and forward it (`kvplan.compare`): `keywords` are the
    /// call's keywords outside its signature, refused as `Template` refuses them.
    #[staticmethod]
    #[pyo3(name = "_from_arguments")]
    fn from_arguments(
        function: &str,
        pairing: Option<&Bound<'_, PyAny>>,
        keywords: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: pairing_argument(function, pairing, keywords)?,
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
    /// repr, and what the errors for a removed pairing keyword tell callers to write.
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

/// The keywords that once built a `Pairing.by_layer_id(...)` in place of `pairing=`, in that
/// method's argument order (the order the hint writes them in).
const REMOVED_KEYWORDS: [&str; 3] = [
    "allow_positional_fallback",
    "prefill_start_layer",
    "legacy_kind",
];

/// The pairing a call of `function` asked for: `pairing` (a `Pairing`; `None` is
/// `Pairing.by_layer_id()`). `other_keywords` holds the keywords the signature does not name:
/// the removed pairing keywords, and a bool `pairing`, are a `TypeError` that says what to
/// write instead; any other keyword is a `TypeError` as Python words it.
pub(crate) fn pairing_argument(
    function: &str,
    pairing: Option<&Bound<'_, PyAny>>,
    other_keywords: Option<&Bound<'_, PyDict>>,
) -> PyResult<Pairing> {
    let pairing = pairing.filter(|p| !p.is_none());
    let keywords = other_keywords.filter(|k| !k.is_empty());
    if let Some(keywords) = keywords {
        for key in keywords.keys() {
            if !REMOVED_KEYWORDS.contains(&key.str()?.to_str()?) {
                return Err(PyTypeError::new_err(format!(
                    "{function}() got an unexpected keyword argument {}",
                    key.repr()?
                )));
            }
        }
    }
    let bool_pairing = pairing.and_then(|p| p.cast::<PyBool>().ok());
    if keywords.is_some() || bool_pairing.is_some() {
        return Err(removed_spelling(function, bool_pairing, keywords)?);
    }
    let Some(p) = pairing else {
        return Ok(Pairing::default());
    };
    if let Ok(p) = p.cast::<PyPairing>() {
        return Ok(p.get().inner);
    }
    Err(PyTypeError::new_err(format!(
        "{function}(): pairing must be a kvplan.Pairing, got {} of type {}",
        short_repr(p),
        p.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}

/// The `TypeError` for a removed spelling (a bool `pairing`, standing for
/// `allow_positional_fallback`, and the removed keywords): what the call wrote and the
/// `pairing=kvplan.Pairing.by_layer_id(...)` that means what it meant. When a value is not one
/// `Pairing.by_layer_id` takes, the hint writes it as given (and that call then says why).
fn removed_spelling(
    function: &str,
    bool_pairing: Option<&Bound<'_, PyBool>>,
    keywords: Option<&Bound<'_, PyDict>>,
) -> PyResult<PyErr> {
    let mut written = Vec::new();
    let mut values: Vec<(&str, Bound<'_, PyAny>)> = Vec::new();
    if let Some(flag) = bool_pairing {
        written.push(format!("a bool pairing ({})", short_repr(flag.as_any())));
        values.push((REMOVED_KEYWORDS[0], flag.as_any().clone()));
    }
    for name in REMOVED_KEYWORDS {
        if let Some(value) = keywords.map(|k| k.get_item(name)).transpose()?.flatten() {
            written.push(format!("{name}="));
            // A keyword says it more plainly than a bool standing in the pairing's place.
            values.retain(|(n, _)| *n != name);
            values.push((name, value));
        }
    }
    let value = |name: &str| values.iter().find(|(n, _)| *n == name).map(|(_, v)| v);
    let resolved = by_layer_id_from(
        value(REMOVED_KEYWORDS[0]),
        value(REMOVED_KEYWORDS[1]),
        value(REMOVED_KEYWORDS[2]),
    );
    let instead = match resolved {
        Some(p) if p == Pairing::default() => {
            format!("{} (the default: leave it out)", PyPairing::expression(p))
        }
        Some(p) => PyPairing::expression(p),
        None => {
            let args: Vec<String> = REMOVED_KEYWORDS
                .iter()
                .filter_map(|name| value(name).map(|v| format!("{name}={}", short_repr(v))))
                .collect();
            format!("Pairing.by_layer_id({})", args.join(", "))
        }
    };
    let verb = if written.len() == 1 { "was" } else { "were" };
    Ok(PyTypeError::new_err(format!(
        "{function}(): {} {verb} removed: pass pairing=kvplan.{instead}",
        written.join(", ")
    )))
}

/// `Pairing.by_layer_id(...)` of the removed keywords' values, or `None` when one is not a
/// value that method takes (a bool is never a layer).
fn by_layer_id_from(
    fallback: Option<&Bound<'_, PyAny>>,
    start: Option<&Bound<'_, PyAny>>,
    kind: Option<&Bound<'_, PyAny>>,
) -> Option<Pairing> {
    let fallback = match fallback {
        None => false,
        Some(v) => v.cast::<PyBool>().ok()?.is_true(),
    };
    let start = match start {
        None => None,
        Some(v) if v.cast::<PyBool>().is_ok() => return None,
        Some(v) => Some(v.extract::<usize>().ok()?),
    };
    let kind = match kind {
        None => None,
        Some(v) => Some(parse_legacy_kind(v.extract::<&str>().ok()?).ok()?),
    };
    Some(Pairing::by_layer_id(fallback, start, kind))
}
