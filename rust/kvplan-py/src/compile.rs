//! `Template(...)`: the value a `kvplan.Template` holds, the peer pair compiled from Python's
//! arguments (the core's options, the geometry keywords, optional layer groups), with the
//! layouts' fingerprints that plan digests carry.

use std::sync::Arc;

use kvplan_core::{GeometryOptions, LayerGroups, Template, TemplateOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py_err;
use crate::layout::PyLayout;
use crate::options::{fragments_arg, template_options};
use crate::slices::PyLayerGroups;

/// A validated peer pair (prefill layout → decode layout), built once, planned per request.
#[pyclass(frozen, name = "Template", module = "kvplan._core")]
pub struct PyTemplate {
    /// Shared with every plan, which asks it for its block offsets.
    pub(crate) inner: Arc<Template>,
    /// The core's fingerprints of the (prefill, decode) layouts, for plan digests (`None` when
    /// a layout has no wire encoding).
    pub(crate) fingerprints: Option<(u64, u64)>,
}

impl PyTemplate {
    /// The template `Template(...)` builds: the pairing and checks read as every template
    /// reads them (the removed pairing keywords refused), then compiled with the geometry.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_arguments(
        src: &PyLayout,
        dst: &PyLayout,
        pairing: Option<&Bound<'_, PyAny>>,
        removed_keywords: Option<&Bound<'_, PyDict>>,
        check_dst_overlap: bool,
        replicas_send: bool,
        fragments: Option<&Bound<'_, PyAny>>,
        coalesce: bool,
        layer_groups: Option<&PyLayerGroups>,
    ) -> PyResult<Self> {
        let options = template_options(
            "Template",
            pairing,
            removed_keywords,
            check_dst_overlap,
            replicas_send,
        )?;
        let groups = layer_groups.map(|g| &g.inner);
        let (inner, fingerprints) = compile(src, dst, options, fragments, coalesce, groups)?;
        Ok(Self {
            inner,
            fingerprints,
        })
    }
}

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
