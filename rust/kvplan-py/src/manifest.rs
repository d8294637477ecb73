//! `check_manifest` and `pack_manifest`: a model's manifest against one peer's layout, and a
//! manifest with some components held as one entry (the core's `rules::manifest`); this module
//! only converts the manifest's plain data.

use kvplan_core::{Fusion, Indexing, ManifestComponent, ModelManifest, Packed, Sharding};
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

/// One fusion as Python passes it: `(role, parts)`.
type FusionTuple = (String, Vec<String>);

fn manifest(
    model: String,
    num_layers: u64,
    components: Vec<ComponentTuple>,
    fusions: Vec<FusionTuple>,
) -> PyResult<ModelManifest> {
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
    let fusions = fusions
        .into_iter()
        .map(|(role, parts)| Fusion { role, parts })
        .collect();
    Ok(ModelManifest {
        model,
        num_layers,
        components,
        fusions,
    })
}

fn component_tuple(c: ManifestComponent) -> ComponentTuple {
    let (sharding, kv_heads) = match c.sharding {
        Sharding::Replicated => ("replicated", 1),
        Sharding::Heads { kv_heads } => ("heads", kv_heads),
        Sharding::Split => ("split", 1),
    };
    (
        c.role,
        c.indexing.as_str().to_owned(),
        c.layers,
        c.bytes,
        c.tokens_per_row,
        sharding.to_owned(),
        kv_heads,
        c.window,
        c.ring,
    )
}

/// Checks that `layout` holds every component of the manifest, in the form it holds each
/// fusion (`ManifestError` listing every problem otherwise). `stage` is the `(start, end)` of
/// the layers the layout's PP stage holds.
#[pyfunction]
#[pyo3(signature = (layout, *, model, num_layers, components, fusions=Vec::new(), stage=None))]
pub fn check_manifest(
    layout: PyRef<'_, PyLayout>,
    model: String,
    num_layers: u64,
    components: Vec<ComponentTuple>,
    fusions: Vec<FusionTuple>,
    stage: Option<(i64, i64)>,
) -> PyResult<()> {
    let manifest = manifest(model, num_layers, components, fusions)?;
    kvplan_core::check_manifest(&layout.inner, &manifest, stage.map(|(a, b)| a..b))
        .map_err(to_py_err)
}

/// The manifest's components with `parts` held as one entry of role `role` per layer: per
/// component the index of one kept as it is, or the tuple of a merged one.
#[pyfunction]
#[pyo3(signature = (*, model, num_layers, components, role, parts))]
pub fn pack_manifest(
    model: String,
    num_layers: u64,
    components: Vec<ComponentTuple>,
    role: String,
    parts: Vec<String>,
) -> PyResult<Vec<Py<PyAny>>> {
    let manifest = manifest(model, num_layers, components, Vec::new())?;
    let packed = manifest.pack(&role, &parts).map_err(to_py_err)?;
    Python::attach(|py| {
        packed
            .into_iter()
            .map(|p| {
                Ok(match p {
                    Packed::Kept(i) => i.into_pyobject(py)?.into_any().unbind(),
                    Packed::Merged(c) => component_tuple(c).into_pyobject(py)?.into_any().unbind(),
                })
            })
            .collect()
    })
}
