//! `Template(...)`: the peer pair compiled from Python's arguments (the core's options, the
//! geometry keywords, optional layer groups), with the layouts' fingerprints that plan
//! digests carry.

use std::sync::Arc;

use kvplan_core::{GeometryOptions, LayerGroups, Template, TemplateOptions};
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::layout::PyLayout;
use crate::options::fragments_arg;

/// The compiled template and the core's fingerprints of the (prefill, decode) layouts
/// (`None` when a layout has no wire encoding).
pub(crate) type Compiled = (Arc<Template>, Option<(u64, u64)>);

/// Compiles `src` → `dst` with `options` (pairing and checks), `fragments` and `coalesce`
/// (the emission geometry) and, when given, `layer_groups` that no coalesced block may span.
pub(crate) fn compile(
    src: &PyLayout,
    dst: &PyLayout,
    options: TemplateOptions,
    fragments: Option<&Bound<'_, PyAny>>,
    coalesce: bool,
    layer_groups: Option<&LayerGroups>,
) -> PyResult<Compiled> {
    let geometry = GeometryOptions {
        fragments: fragments_arg(fragments)?,
        coalesce,
    };
    let template = match layer_groups {
        Some(groups) => {
            Template::with_layer_groups(&src.inner, &dst.inner, options, &geometry, groups)
        }
        None => Template::with_geometry(&src.inner, &dst.inner, options, &geometry),
    }
    .map_err(to_py_err)?;
    let fingerprint = |layout: &PyLayout| kvplan_core::layout_fingerprint(&layout.inner).ok();
    let fingerprints = fingerprint(src).zip(fingerprint(dst));
    Ok((Arc::new(template), fingerprints))
}
