//! `check_manifest`: a model's manifest against one peer's layout (the core's
//! `rules::manifest`); this module only converts the manifest's plain data.

use kvplan_core::{Indexing, ManifestComponent, ModelManifest, Sharding};
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::layout::PyLayout;

/// One component as Python passes it: `(role, kind, layers, bytes, tokens_per_row, sharding,
/// kv_heads, window, ring)`.
type ComponentTuple = (
    String,
    String,
    Vec<i64>,
    u64,
    u64,
    String,
    u32,
    Option<u64>,
    Option<u64>,
);

/// Checks that `layout` holds every component of the manifest (`ManifestError` listing every
/// problem otherwise). `stage` is the `(start, end)` of the layers the layout's PP stage holds.
#[pyfunction]
#[pyo3(signature = (layout, *, model, num_layers, components, stage=None))]
pub fn check_manifest(
    layout: PyRef<'_, PyLayout>,
    model: String,
    num_layers: u64,
    components: Vec<ComponentTuple>,
    stage: Option<(i64, i64)>,
) -> PyResult<()> {
    let components = components
        .into_iter()
        .map(
            |(role, kind, layers, bytes, tokens_per_row, sharding, kv_heads, window, ring)| {
                Ok(ManifestComponent {
                    role,
                    indexing: Indexing::parse(&kind)?,
                    layers,
                    bytes,
                    tokens_per_row,
                    sharding: Sharding::parse(&model, &sharding, kv_heads)?,
                    window,
                    ring,
                })
            },
        )
        .collect::<kvplan_core::Result<Vec<_>>>()
        .map_err(to_py_err)?;
    let manifest = ModelManifest {
        model,
        num_layers,
        components,
    };
    kvplan_core::check_manifest(&layout.inner, &manifest, stage.map(|(a, b)| a..b))
        .map_err(to_py_err)
}
