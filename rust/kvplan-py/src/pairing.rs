//! Entry pairing on its own: SGLang's `build_transfer_entry_pairs` and strict legacy PP slicing.

use kvplan_core::{EntryMetadata, LegacyKind};
use numpy::PyArray2;
use pyo3::prelude::*;

use crate::convert::pairs_array;
use crate::errors::{KvPlanError, to_py_err};

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
