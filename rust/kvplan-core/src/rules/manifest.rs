//! Model manifests: every component a model has (its role, layers, item bytes at TP 1, TP
//! sharding, window or ring), checked against one peer's layout, so that a layout missing a
//! component (a state pool never registered, an indexer, a window layer) is refused naming it.
//!
//! Pairing only checks that the two peers agree with each other: a prefill and a decode that
//! both leave out the same component pair cleanly and move half a model. A manifest is what the
//! model has, independent of either peer. [`check_manifest`] compares one layout (one TP rank of
//! one PP stage) with it and reports every problem at once: each missing component with the
//! layers it is missing on, each item size that differs from what the manifest gives at the
//! layout's TP coordinates (both values), each window or ring that differs, and the layout's
//! entries no component declares. Draft entries are not part of a model's manifest and are not
//! checked.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::error::{ManifestProblem, PlanError, Result};
use crate::peer::entry::Indexing;
use crate::peer::layout::{Layout, heads_per_rank_at};

/// How a component's items are split between TP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Every rank holds the whole item (an MLA latent, its indexer).
    Replicated,
    /// The item holds `kv_heads` heads of equal size; a rank holds `max(1, kv_heads / tp_size)`
    /// of them (the core's [`heads_per_rank_at`]; fewer heads than ranks replicate them).
    Heads {
        /// The model's KV heads.
        kv_heads: u32,
    },
    /// The item is split evenly along its leading axis: a rank holds `bytes / tp_size` (a
    /// linear-attention state).
    Split,
}

impl Sharding {
    /// Parses the bindings' name (`replicated`, `heads`, `split`); `kv_heads` is used by
    /// `heads` only.
    ///
    /// # Errors
    /// [`PlanError::Manifest`] naming the unknown name.
    pub fn parse(model: &str, name: &str, kv_heads: u32) -> Result<Self> {
        match name {
            "replicated" => Ok(Sharding::Replicated),
            "heads" => Ok(Sharding::Heads { kv_heads }),
            "split" => Ok(Sharding::Split),
            other => Err(PlanError::Manifest {
                model: model.to_owned(),
                problems: vec![ManifestProblem::Malformed {
                    what: format!(
                        "unknown sharding {other:?}; expected \"replicated\", \"heads\" or \"split\""
                    ),
                }],
            }),
        }
    }
}

/// One component of a model: the entries of one role on a set of layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestComponent {
    /// The role its entries publish (`kv`, `k`, `v`, `indexer`, `swa`, a state name, ...).
    pub role: String,
    /// Page entries (indexed by a pool's pages) or state entries (by a request's slot).
    pub indexing: Indexing,
    /// Global layer ids that hold it.
    pub layers: Vec<i64>,
    /// Bytes at TP 1 of one row (page entries: one token's, or `tokens_per_row` tokens' for a
    /// compressed cache) or of one state slot.
    pub bytes: u64,
    /// Tokens one row holds (page entries; 1 for a row per token).
    pub tokens_per_row: u64,
    /// How its items are split between TP ranks.
    pub sharding: Sharding,
    /// The sliding window of its page entries in tokens (`None`: full attention).
    pub window: Option<u64>,
    /// The rows per slot of its ring-state entries (`None`: whole slots).
    pub ring: Option<u64>,
}

/// Every component a model has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelManifest {
    /// The model's name, for messages.
    pub model: String,
    /// Layers of the whole model.
    pub num_layers: u64,
    /// Its components.
    pub components: Vec<ManifestComponent>,
}

impl ModelManifest {
    /// The manifest's own problems: a zero size or row, heads that do not divide a row, a
    /// layer outside the model, a component declared twice on one layer.
    fn malformed(&self) -> Vec<ManifestProblem> {
        let mut out = Vec::new();
        let mut bad = |what: String| out.push(ManifestProblem::Malformed { what });
        if self.num_layers == 0 {
            bad("num_layers must be at least 1, got 0".into());
        }
        let mut seen: HashMap<(i64, &str, Indexing), usize> = HashMap::new();
        for (k, c) in self.components.iter().enumerate() {
            let name = format!("component {k} ({:?})", c.role);
            if c.bytes == 0 {
                bad(format!("{name}: bytes must be at least 1, got 0"));
            }
            if c.tokens_per_row == 0 {
                bad(format!("{name}: tokens_per_row must be at least 1, got 0"));
            }
            if let Sharding::Heads { kv_heads } = c.sharding
                && (kv_heads == 0 || c.bytes % u64::from(kv_heads) != 0)
            {
                bad(format!(
                    "{name}: {} bytes do not split into kv_heads {kv_heads} heads of equal size",
                    c.bytes
                ));
            }
            if c.layers.is_empty() {
                bad(format!("{name}: declares no layers"));
            }
            for &layer in &c.layers {
                if layer < 0 || layer as u64 >= self.num_layers {
                    bad(format!(
                        "{name}: layer {layer} is outside the model's layers 0..{}",
                        self.num_layers
                    ));
                }
                if let Some(other) = seen.insert((layer, c.role.as_str(), c.indexing), k) {
                    bad(format!(
                        "{name}: layer {layer} is declared by component {other} with the same role too"
                    ));
                }
            }
        }
        out
    }
}

/// One problem as it is found: its kind and role, the values it is about, and one layer; the
/// layers of equal keys are gathered into one problem.
#[derive(PartialEq, Eq)]
enum Key<'a> {
    Missing(&'a str, Indexing),
    ItemSize(&'a str, u64, u64, String),
    Shape(&'a str, &'static str, Option<u64>, Option<u64>),
    Unexpected(&'a str, Indexing),
    OutsideStage(&'a str),
}

/// Checks that `layout` holds every component of `manifest` on the layers it holds, with the
/// item sizes the manifest gives at the layout's TP coordinates, and nothing else.
///
/// `stage` is the range of global layer ids the layout's PP stage holds; `None` is the whole
/// model, allowed only for a layout of PP size 1 (a stage's range cannot be told from its
/// entries: a missing first or last layer would look like a shorter stage).
///
/// # Errors
/// [`PlanError::Manifest`] listing every problem (module docs), in manifest order: missing
/// components first by component, then sizes, windows and rings, then the layout's entries that
/// no component declares.
pub fn check_manifest(
    layout: &Layout,
    manifest: &ModelManifest,
    stage: Option<Range<i64>>,
) -> Result<()> {
    let fail = |problems: Vec<ManifestProblem>| PlanError::Manifest {
        model: manifest.model.clone(),
        problems,
    };
    let malformed = manifest.malformed();
    if !malformed.is_empty() {
        return Err(fail(malformed));
    }
    let ctx = layout.context();
    let stage = match stage {
        Some(range) => range,
        None if ctx.pp_size > 1 => {
            return Err(fail(vec![ManifestProblem::StageRange {
                pp_rank: ctx.pp_rank,
                pp_size: ctx.pp_size,
            }]));
        }
        None => 0..manifest.num_layers as i64,
    };
    let mut problems = Vec::new();
    if let Some(n) = ctx.num_model_layers
        && n != manifest.num_layers
    {
        problems.push(ManifestProblem::ModelLayers {
            manifest: manifest.num_layers,
            layout: n,
        });
    }
    let mut by_key: HashMap<(i64, &str, Indexing), Vec<usize>> = HashMap::new();
    let mut unnamed = 0;
    for (i, e) in layout.entries().iter().enumerate() {
        if e.draft {
            continue;
        }
        match e.layer {
            Some(layer) => by_key
                .entry((layer, e.role.as_str(), e.indexing()))
                .or_default()
                .push(i),
            None => unnamed += 1,
        }
    }
    let mut found: Vec<(Key<'_>, Vec<i64>)> = Vec::new();
    let tp = ctx.tp_size.max(1);
    let mut declared: HashSet<(i64, &str, Indexing)> = HashSet::new();
    for c in &manifest.components {
        for &layer in &c.layers {
            declared.insert((layer, c.role.as_str(), c.indexing));
        }
    }
    let mut sized: Vec<(Key<'_>, Vec<i64>)> = Vec::new();
    for c in &manifest.components {
        let mut layers = c.layers.clone();
        layers.sort_unstable();
        for layer in layers {
            let entries = by_key.get(&(layer, c.role.as_str(), c.indexing));
            if !stage.contains(&layer) {
                if entries.is_some() {
                    note(Key::OutsideStage(&c.role), layer, &mut sized);
                }
                continue;
            }
            let Some(entries) = entries else {
                note(Key::Missing(&c.role, c.indexing), layer, &mut found);
                continue;
            };
            for &i in entries {
                let e = layout.entry(i);
                let (expected, why) = expected_item(c, layout.entry_page_size(i), tp);
                if e.item_len != expected {
                    note(
                        Key::ItemSize(&c.role, expected, e.item_len, why),
                        layer,
                        &mut sized,
                    );
                }
                match c.indexing {
                    Indexing::Page if e.window() != c.window => note(
                        Key::Shape(&c.role, "window", c.window, e.window()),
                        layer,
                        &mut sized,
                    ),
                    Indexing::State if e.ring() != c.ring => note(
                        Key::Shape(&c.role, "ring", c.ring, e.ring()),
                        layer,
                        &mut sized,
                    ),
                    _ => {}
                }
            }
        }
    }
    found.extend(sized);
    let mut keys: Vec<_> = by_key.keys().copied().collect();
    keys.sort_unstable_by_key(|&(layer, role, indexing)| (role, indexing.as_str(), layer));
    for (layer, role, indexing) in keys {
        if !declared.contains(&(layer, role, indexing)) {
            note(Key::Unexpected(role, indexing), layer, &mut found);
        }
    }
    for (key, mut layers) in found {
        layers.dedup();
        let role = |r: &str| r.to_owned();
        problems.push(match key {
            Key::Missing(r, indexing) => ManifestProblem::Missing {
                role: role(r),
                indexing: indexing.as_str(),
                layers,
            },
            Key::ItemSize(r, expected, got, why) => ManifestProblem::ItemSize {
                role: role(r),
                layers,
                expected,
                got,
                why,
            },
            Key::Shape(r, what, expected, got) => ManifestProblem::Shape {
                role: role(r),
                layers,
                what,
                expected,
                got,
            },
            Key::Unexpected(r, indexing) => ManifestProblem::Unexpected {
                role: role(r),
                indexing: indexing.as_str(),
                layers,
            },
            Key::OutsideStage(r) => ManifestProblem::OutsideStage {
                role: role(r),
                layers,
                start: stage.start,
                end: stage.end,
            },
        });
    }
    if unnamed > 0 {
        problems.push(ManifestProblem::NoLayerIds { count: unnamed });
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(fail(problems))
    }
}

/// Adds `layer` to the problem `key` (a new problem when none has that key yet).
fn note<'a>(key: Key<'a>, layer: i64, found: &mut Vec<(Key<'a>, Vec<i64>)>) {
    match found.iter_mut().find(|(k, _)| *k == key) {
        Some((_, layers)) => layers.push(layer),
        None => found.push((key, vec![layer])),
    }
}

/// The item size a component's entry holds at TP size `tp` with `page_size` tokens per page
/// (its pool's), and how it follows from the manifest, in words.
fn expected_item(c: &ManifestComponent, page_size: u64, tp: u32) -> (u64, String) {
    let (bytes, share) = match c.sharding {
        Sharding::Replicated => (c.bytes, String::new()),
        Sharding::Heads { kv_heads } => {
            let heads = heads_per_rank_at(kv_heads, tp);
            (
                c.bytes / u64::from(kv_heads) * u64::from(heads),
                format!(", {heads} of {kv_heads} heads at TP {tp}"),
            )
        }
        Sharding::Split => (c.bytes / u64::from(tp), format!(", split over TP {tp}")),
    };
    match c.indexing {
        Indexing::State => (bytes, format!("{} bytes per slot{share}", c.bytes)),
        Indexing::Page => {
            let rows = page_size / c.tokens_per_row;
            let per_row = if c.tokens_per_row == 1 {
                "token".to_owned()
            } else {
                format!("{}-token row", c.tokens_per_row)
            };
            (
                rows.saturating_mul(bytes),
                format!(
                    "{} bytes per {per_row}{share}, {rows} rows per {page_size}-token page",
                    c.bytes
                ),
            )
        }
    }
}
