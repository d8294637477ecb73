//! Keyword parsing of the Python API: what `Layout`'s constructors, `Template` and
//! `check_pairs` accept, turned into the core's option values (the pairing keywords are read
//! by `pairing`). Only conversion and the messages for arguments of the wrong type live here;
//! the rules and defaults are the core's (e.g. `AttentionGeometry::for_rank`).

use kvplan_core::{
    AttentionGeometry, Fragment, Fragments, LayoutContext, MemoryOrder, TemplateOptions,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use crate::errors::{short_repr, to_py_err};
use crate::pairing::pairing_argument;

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

/// The core's options from the arguments of `function` (`Template`, `ConversionTemplate`,
/// `check_pairs`): `pairing` and the keywords outside the signature are read by
/// `pairing::pairing_argument`, which refuses the removed pairing keywords.
pub(crate) fn template_options(
    function: &str,
    pairing: Option<&Bound<'_, PyAny>>,
    other_keywords: Option<&Bound<'_, PyDict>>,
    check_dst_overlap: bool,
    replicas_send: bool,
) -> PyResult<TemplateOptions> {
    Ok(TemplateOptions {
        pairing: pairing_argument(function, pairing, other_keywords)?,
        check_dst_overlap,
        replicas_send,
    })
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
