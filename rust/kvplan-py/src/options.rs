//! Keyword parsing of the Python API: what `Layout`'s constructors, `Template` and
//! `check_pairs` accept, turned into the core's option values. Only conversion and the
//! messages for arguments of the wrong type live here; the rules and defaults are the core's
//! (e.g. `AttentionGeometry::for_rank`, `Pairing::by_layer_id`).

use std::ffi::CString;

use kvplan_core::{
    AttentionGeometry, Fragment, Fragments, LayoutContext, MemoryOrder, Pairing, TemplateOptions,
};
use pyo3::exceptions::{PyDeprecationWarning, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use crate::errors::to_py_err;
use crate::pairing::{PyPairing, parse_legacy_kind};

/// `fragments=`: `None` (whole items), a list of `(src_off, dst_off, len)` tuples for every
/// page pair, or one such list (or `None`) per page pair.
pub(crate) fn fragments_arg(fragments: Option<&Bound<'_, PyAny>>) -> PyResult<Fragments> {
    let Some(obj) = fragments.filter(|o| !o.is_none()) else {
        return Ok(Fragments::Whole);
    };
    let to_fragments = |list: Vec<(u64, u64, u64)>| -> Vec<Fragment> {
        list.into_iter()
            .map(|(src_off, dst_off, len)| Fragment {
                src_off,
                dst_off,
                len,
            })
            .collect()
    };
    if let Ok(every) = obj.extract::<Vec<(u64, u64, u64)>>() {
        return Ok(Fragments::Every(to_fragments(every)));
    }
    if let Ok(per_pair) = obj.extract::<Vec<Option<Vec<(u64, u64, u64)>>>>() {
        return Ok(Fragments::PerPair(
            per_pair
                .into_iter()
                .map(|list| list.map(to_fragments))
                .collect(),
        ));
    }
    Err(PyTypeError::new_err(format!(
        "fragments must be None, a list of (src_off, dst_off, len) tuples of non-negative ints, or one such list (or None) per page pair; got {}",
        obj.repr()?
    )))
}

/// The core's options from `Template` / `check_pairs` arguments: a `Pairing`, or the deprecated
/// shorthands that build one (warned about at the Python line that called in).
pub(crate) fn template_options(
    pairing: Option<&Bound<'_, PyAny>>,
    allow_positional_fallback: Option<bool>,
    prefill_start_layer: Option<usize>,
    legacy_kind: Option<&str>,
    check_dst_overlap: bool,
    replicas_send: bool,
) -> PyResult<TemplateOptions> {
    let shorthand = PairingShorthand {
        allow_positional_fallback,
        prefill_start_layer,
        legacy_kind,
    };
    Ok(TemplateOptions {
        pairing: Python::attach(|py| resolve_pairing(py, pairing, shorthand, 1))?,
        check_dst_overlap,
        replicas_send,
    })
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

/// `repr(obj)`, cut to a readable length for an error message.
pub(crate) fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    const MAX: usize = 60;
    let text = obj
        .repr()
        .map_or_else(|_| "<unprintable>".to_owned(), |r| r.to_string());
    if text.chars().count() <= MAX {
        return text;
    }
    let cut: String = text.chars().take(MAX).collect();
    format!("{cut}…")
}

/// Reads the peer context from keyword arguments, rejecting unknown keys.
pub(crate) fn context_from(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<LayoutContext> {
    let mut context = LayoutContext::default();
    let Some(kwargs) = kwargs else {
        return Ok(context);
    };
    let mut attention = AttentionKeywords::default();
    for (key, value) in kwargs.iter() {
        let key: String = key.extract()?;
        // Name the keyword and its range in the message (PyO3's OverflowError names neither).
        let field = |range: &str| {
            PyTypeError::new_err(format!("{key} must be {range}, got {}", short_repr(&value)))
        };
        // A bool is an int to Python, never a count or a rank (a JSON `true` is a mistake).
        let is_bool = value.cast::<PyBool>().is_ok();
        let u64_field = || {
            value
                .extract::<u64>()
                .ok()
                .filter(|_| !is_bool)
                .ok_or_else(|| field("an int in 0..2**64"))
        };
        let u32_field = || {
            value
                .extract::<u32>()
                .ok()
                .filter(|_| !is_bool)
                .ok_or_else(|| field("an int in 0..2**32"))
        };
        // The attention keywords accept None ("not published"), as from_dict writes them.
        let optional_u32 = || -> PyResult<Option<u32>> {
            if value.is_none() {
                Ok(None)
            } else {
                u32_field().map(Some)
            }
        };
        match key.as_str() {
            "page_size" => context.page_size = u64_field()?,
            "device" => context.device = value.extract().map_err(|_| field("a str"))?,
            "num_model_layers" => {
                context.num_model_layers = if value.is_none() {
                    None
                } else {
                    Some(u64_field()?)
                };
            }
            "pp_rank" => context.pp_rank = u32_field()?,
            "pp_size" => context.pp_size = u32_field()?,
            "tp_rank" => context.tp_rank = u32_field()?,
            "tp_size" => context.tp_size = u32_field()?,
            "dcp_size" => context.dcp.size = u32_field()?,
            "dcp_rank" => context.dcp.rank = u32_field()?,
            "dcp_interleave" => context.dcp.interleave = u64_field()?,
            "kv_heads" => attention.kv_heads = optional_u32()?,
            "heads_per_rank" => attention.heads_per_rank = optional_u32()?,
            "head_dim" => attention.head_dim = optional_u32()?,
            "dtype_size" => attention.dtype_size = optional_u32()?,
            "memory_order" => {
                attention.memory_order = if value.is_none() {
                    None
                } else {
                    let name: String = value.extract().map_err(|_| field("\"NHD\" or \"HND\""))?;
                    Some(MemoryOrder::parse(&name).map_err(to_py_err)?)
                };
            }
            other => {
                return Err(PyTypeError::new_err(format!(
                    "unexpected keyword argument {other:?}; layout context keys are page_size, device, num_model_layers, pp_rank, pp_size, tp_rank, tp_size, dcp_size, dcp_rank, dcp_interleave, kv_heads, heads_per_rank, head_dim, dtype_size, memory_order"
                )));
            }
        }
    }
    context.attention = attention.resolve(context.tp_size)?;
    Ok(context)
}

/// The attention keywords as given; all or none of `kv_heads`, `head_dim`, `dtype_size` (and
/// optionally `heads_per_rank`, `memory_order`).
#[derive(Default)]
struct AttentionKeywords {
    kv_heads: Option<u32>,
    heads_per_rank: Option<u32>,
    head_dim: Option<u32>,
    dtype_size: Option<u32>,
    memory_order: Option<MemoryOrder>,
}

impl AttentionKeywords {
    fn resolve(self, tp_size: u32) -> PyResult<Option<AttentionGeometry>> {
        let Self {
            kv_heads,
            heads_per_rank,
            head_dim,
            dtype_size,
            memory_order,
        } = self;
        match (kv_heads, head_dim, dtype_size) {
            (None, None, None) if heads_per_rank.is_none() && memory_order.is_none() => Ok(None),
            (Some(total_kv_heads), Some(head_dim), Some(dtype_size)) => {
                Ok(Some(AttentionGeometry::for_rank(
                    total_kv_heads,
                    head_dim,
                    dtype_size,
                    tp_size,
                    heads_per_rank,
                    memory_order,
                )))
            }
            _ => Err(PyTypeError::new_err(
                "the attention geometry needs kv_heads, head_dim and dtype_size together \
                 (heads_per_rank defaults to max(1, kv_heads // tp_size), memory_order to \"NHD\")",
            )),
        }
    }
}
