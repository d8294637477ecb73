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
//!
//! Engines do not all cut a layer's state into the same tensors (SGLang and vLLM keep a KDA
//! layer's q, k and v short-convolution states as one tensor, a layer with three separate
//! convolutions keeps three). A manifest declares such alternatives as [`Fusion`]s, and
//! [`check_manifest`] decides which form a layout holds: a fusion is taken
//! ([`ModelManifest::packed`]) when the layout holds an entry of the fusion's role on a layer of
//! its parts, otherwise the parts are checked as they are. A layout is checked against one form,
//! never a union of both: a part held beside the fused entry, or only some parts, is refused
//! naming them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use crate::error::{ManifestProblem, PlanError, Result, layer_ranges};
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
                notes: Vec::new(),
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

/// Components an engine may hold as one entry per layer instead of one entry each.
///
/// On every layer holding the components `parts`, an engine may publish one entry of role
/// `role` whose item is the parts' items together ([`ModelManifest::packed`]: bytes the parts'
/// sum, everything else equal). With one part it is that component under another name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fusion {
    /// The role of the one entry.
    pub role: String,
    /// The roles of the components it holds, each once, `role` not among them.
    pub parts: Vec<String>,
}

impl Fusion {
    /// Its parts for messages: `a, b, c`.
    fn parts_text(&self) -> String {
        self.parts.join(", ")
    }

    /// What a refusal adds when the layout holds the parts' form and misses some of them.
    fn also_held_as(&self) -> String {
        match self.parts.as_slice() {
            [one] => format!("{one} may also be held as {}", quoted(&self.role)),
            _ => format!(
                "{} may also be held as one {} entry per layer",
                self.parts_text(),
                quoted(&self.role)
            ),
        }
    }
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
    /// Parts an engine may hold as one entry per layer; [`check_manifest`] checks a layout
    /// against the form it holds.
    pub fusions: Vec<Fusion>,
}

/// One component of [`ModelManifest::pack`]'s result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packed {
    /// The manifest's component at this index, unchanged (not a part).
    Kept(usize),
    /// Parts merged into one component of the fused role.
    Merged(ManifestComponent),
}

impl ModelManifest {
    /// The manifest's own problems: a zero size or row, heads that do not divide a row, a
    /// layer outside the model, a component declared twice on one layer, a fusion without
    /// parts, with a part twice or with its own role among its parts.
    fn malformed(&self) -> Vec<ManifestProblem> {
        let mut out = Vec::new();
        let mut bad = |what: String| out.push(ManifestProblem::Malformed { what });
        if self.num_layers == 0 {
            bad("num_layers must be at least 1, got 0".into());
        }
        for (k, f) in self.fusions.iter().enumerate() {
            if let Some(why) = fusion_shape_problem(&f.role, &f.parts) {
                bad(format!("fusion {k} ({:?} of {:?}): {why}", f.role, f.parts));
            }
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

/// Why `role` and `parts` cannot be a fusion (no role, no parts, an empty or repeated part, the
/// role among its parts), or `None`.
fn fusion_shape_problem(role: &str, parts: &[String]) -> Option<&'static str> {
    let distinct: HashSet<&str> = parts.iter().map(String::as_str).collect();
    (role.is_empty()
        || parts.is_empty()
        || parts.iter().any(String::is_empty)
        || distinct.len() != parts.len()
        || distinct.contains(role))
    .then_some("needs a role and one or more distinct part roles other than it")
}

/// `s` as Python writes a string (`'kv'`), so that messages read the same from every binding.
fn quoted(s: &str) -> String {
    format!("'{s}'")
}

impl ModelManifest {
    /// The manifest as seen by an engine that keeps the components `parts` of a layer in one
    /// entry of role `role` (vLLM packs an attention layer's K and V in one region; SGLang keeps
    /// a KDA layer's three conv states in one tensor): on each layer that holds the parts, their
    /// components merge into one of role `role` whose `bytes` are the parts' sum; everything
    /// else (indexing, rows, sharding, window, ring) must be the same for every part and is
    /// kept. Layers are grouped as the parts' components group them; other components are kept
    /// as they are, in order (the merged ones where the first part's component was). A manifest
    /// without the parts is returned unchanged; one part renames its components. The fusions are
    /// kept.
    ///
    /// # Errors
    /// [`PlanError::Manifest`] (one [`ManifestProblem::Malformed`]): parts that are not one or
    /// more distinct roles other than `role`, a layer that holds some parts but not all, parts
    /// that differ in anything but their bytes, or a layer that already has a component of
    /// `role` of the same indexing, naming the roles, the layers and the fields that differ.
    pub fn packed(&self, role: &str, parts: &[String]) -> Result<ModelManifest> {
        let components = self
            .pack(role, parts)?
            .into_iter()
            .map(|p| match p {
                Packed::Kept(i) => self.components[i].clone(),
                Packed::Merged(c) => c,
            })
            .collect();
        Ok(ModelManifest {
            components,
            ..self.clone()
        })
    }

    /// [`ModelManifest::packed`]'s components, each either kept (by index) or merged, so that a
    /// binding keeps its own objects for the components it does not change.
    ///
    /// # Errors
    /// As [`ModelManifest::packed`].
    pub fn pack(&self, role: &str, parts: &[String]) -> Result<Vec<Packed>> {
        let refuse = |what: String| PlanError::Manifest {
            model: self.model.clone(),
            problems: vec![ManifestProblem::Malformed { what }],
            notes: Vec::new(),
        };
        let names = parts.join(", ");
        if fusion_shape_problem(role, parts).is_some() {
            return Err(refuse(format!(
                "packed({}, {parts:?}) needs one or more distinct part roles other than {}",
                quoted(role),
                quoted(role)
            )));
        }
        let kept = || (0..self.components.len()).map(Packed::Kept).collect();
        // Per layer the parts' components holding it, in part order.
        let mut at: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
        for p in parts {
            for (i, c) in self.components.iter().enumerate() {
                if &c.role == p {
                    for &layer in &c.layers {
                        at.entry(layer).or_default().push(i);
                    }
                }
            }
        }
        if at.is_empty() {
            return Ok(kept());
        }
        let mut problems: Vec<(String, Vec<i64>)> = Vec::new();
        let mut add = |why: String, layer: i64| match problems.iter_mut().find(|(w, _)| *w == why) {
            Some((_, layers)) => layers.push(layer),
            None => problems.push((why, vec![layer])),
        };
        let mut groups: Vec<(Vec<usize>, Vec<i64>)> = Vec::new();
        let mut sorted_parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        sorted_parts.sort_unstable();
        for (&layer, held) in &at {
            let c = |i: usize| &self.components[i];
            let mut roles: Vec<&str> = held.iter().map(|&i| c(i).role.as_str()).collect();
            roles.sort_unstable();
            if roles != sorted_parts {
                add(
                    format!("hold {}, not one each of {names}", roles.join(", ")),
                    layer,
                );
                continue;
            }
            let first = c(held[0]);
            let fields: [Field; 6] = [
                ("kind", |c| quoted(c.indexing.as_str())),
                ("tokens_per_row", |c| c.tokens_per_row.to_string()),
                ("sharding", |c| quoted(sharding_name(c.sharding))),
                ("kv_heads", |c| match c.sharding {
                    Sharding::Heads { kv_heads } => kv_heads.to_string(),
                    _ => "1".into(),
                }),
                ("window", |c| py_option(c.window)),
                ("ring", |c| py_option(c.ring)),
            ];
            let differ: Vec<String> = fields
                .iter()
                .filter(|(_, f)| held.iter().any(|&i| f(c(i)) != f(first)))
                .map(|(name, f)| {
                    let values: Vec<String> = held
                        .iter()
                        .map(|&i| format!("{} {}", c(i).role, f(c(i))))
                        .collect();
                    format!("{name} ({})", values.join(", "))
                })
                .collect();
            if !differ.is_empty() {
                add(format!("the parts differ in {}", differ.join(", ")), layer);
                continue;
            }
            // The component of each part, in part order (each is there: the roles matched).
            let Some(key) = parts
                .iter()
                .map(|p| held.iter().copied().find(|&i| &c(i).role == p))
                .collect::<Option<Vec<usize>>>()
            else {
                continue;
            };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, layers)) => layers.push(layer),
                None => groups.push((key, vec![layer])),
            }
        }
        let taken: HashSet<(i64, Indexing)> = self
            .components
            .iter()
            .filter(|c| c.role == role)
            .flat_map(|c| c.layers.iter().map(move |&l| (l, c.indexing)))
            .collect();
        let clash: Vec<i64> = at
            .iter()
            .filter(|(l, held)| taken.contains(&(**l, self.components[held[0]].indexing)))
            .map(|(l, _)| *l)
            .collect();
        if !clash.is_empty() {
            problems.push((format!("already have a {} component", quoted(role)), clash));
        }
        if !problems.is_empty() {
            let why: Vec<String> = problems
                .iter()
                .map(|(why, layers)| format!("layers {} {why}", layer_ranges(layers)))
                .collect();
            return Err(refuse(format!(
                "cannot pack {names} into one {} entry per layer: {}",
                quoted(role),
                why.join("; ")
            )));
        }
        let mut merged: HashMap<usize, Vec<ManifestComponent>> = HashMap::new();
        for (key, layers) in groups {
            let first = &self.components[key[0]];
            merged.entry(key[0]).or_default().push(ManifestComponent {
                role: role.to_owned(),
                layers,
                bytes: key.iter().map(|&i| self.components[i].bytes).sum(),
                ..first.clone()
            });
        }
        let mut out = Vec::new();
        for (i, c) in self.components.iter().enumerate() {
            if !parts.contains(&c.role) {
                out.push(Packed::Kept(i));
            } else if let Some(m) = merged.remove(&i) {
                out.extend(m.into_iter().map(Packed::Merged));
            }
        }
        Ok(out)
    }

    /// The manifest in the form `held` (the layout's `(layer, role, indexing)` keys) holds,
    /// without fusions, and the notes a refusal adds: per fusion whose parts the layout holds
    /// beside the fused entry, and per fusion not taken (its parts checked as they are).
    fn as_held<'a>(
        &'a self,
        held: &HashSet<(i64, &str, Indexing)>,
    ) -> Result<(ModelManifest, Vec<&'a Fusion>, Vec<String>)> {
        let mut manifest = ModelManifest {
            fusions: Vec::new(),
            ..self.clone()
        };
        let mut not_taken = Vec::new();
        let mut both = Vec::new();
        for f in &self.fusions {
            let parts: Vec<&ManifestComponent> = manifest
                .components
                .iter()
                .filter(|c| f.parts.contains(&c.role))
                .collect();
            if parts.is_empty() {
                continue;
            }
            let holds = |role: &str, c: &ManifestComponent| {
                c.layers
                    .iter()
                    .any(|&l| held.contains(&(l, role, c.indexing)))
            };
            if !parts.iter().any(|c| holds(&f.role, c)) {
                not_taken.push(f);
                continue;
            }
            let beside: Vec<&str> = f
                .parts
                .iter()
                .filter(|p| parts.iter().any(|c| &c.role == *p && holds(p, c)))
                .map(String::as_str)
                .collect();
            if !beside.is_empty() {
                both.push(format!(
                    "this layout holds {} beside the one {} entry that holds {}: a layout holds \
                     either the one entry or its parts, never both",
                    beside.join(", "),
                    quoted(&f.role),
                    f.parts_text()
                ));
            }
            manifest = manifest.packed(&f.role, &f.parts)?;
        }
        Ok((manifest, not_taken, both))
    }
}

/// A field [`ModelManifest::pack`] compares between parts: its name and its value as Python
/// writes it.
type Field = (&'static str, fn(&ManifestComponent) -> String);

fn sharding_name(s: Sharding) -> &'static str {
    match s {
        Sharding::Replicated => "replicated",
        Sharding::Heads { .. } => "heads",
        Sharding::Split => "split",
    }
}

fn py_option(v: Option<u64>) -> String {
    v.map_or_else(|| "None".to_owned(), |v| v.to_string())
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
/// The manifest's fusions are resolved first, in order: a layout holding an entry of a
/// fusion's role on a layer of its parts is checked against the fused component
/// ([`ModelManifest::packed`]; a part beside it is unexpected), one without it against the parts
/// (a missing part is missing, and the refusal says which one entry would have held it).
///
/// `stage` is the range of global layer ids the layout's PP stage holds; `None` is the whole
/// model, allowed only for a layout of PP size 1 (a stage's range cannot be told from its
/// entries: a missing first or last layer would look like a shorter stage).
///
/// # Errors
/// [`PlanError::Manifest`] listing every problem (module docs), in manifest order: missing
/// components first by component, then sizes, windows and rings, then the layout's entries that
/// no component declares; its `notes` say which fused entry would have held missing parts and
/// which parts a layout holds beside their fused entry. A fusion taken whose parts cannot merge
/// is refused as [`ModelManifest::packed`] refuses it.
pub fn check_manifest(
    layout: &Layout,
    manifest: &ModelManifest,
    stage: Option<Range<i64>>,
) -> Result<()> {
    let malformed = manifest.malformed();
    if !malformed.is_empty() {
        return Err(PlanError::Manifest {
            model: manifest.model.clone(),
            problems: malformed,
            notes: Vec::new(),
        });
    }
    let held: HashSet<(i64, &str, Indexing)> = layout
        .entries()
        .iter()
        .filter(|e| !e.draft)
        .filter_map(|e| Some((e.layer?, e.role.as_str(), e.indexing())))
        .collect();
    let (resolved, not_taken, mut notes) = manifest.as_held(&held)?;
    match check_resolved(layout, &resolved, stage) {
        Err(PlanError::Manifest {
            model, problems, ..
        }) => {
            let missing: HashSet<&str> = problems
                .iter()
                .filter_map(|p| match p {
                    ManifestProblem::Missing { role, .. } => Some(role.as_str()),
                    _ => None,
                })
                .collect();
            notes.extend(
                not_taken
                    .iter()
                    .filter(|f| f.parts.iter().any(|p| missing.contains(p.as_str())))
                    .map(|f| format!("{}, of which this layout has none", f.also_held_as())),
            );
            Err(PlanError::Manifest {
                model,
                problems,
                notes,
            })
        }
        other => other,
    }
}

/// [`check_manifest`] of a manifest whose fusions are resolved.
fn check_resolved(
    layout: &Layout,
    manifest: &ModelManifest,
    stage: Option<Range<i64>>,
) -> Result<()> {
    let fail = |problems: Vec<ManifestProblem>| PlanError::Manifest {
        model: manifest.model.clone(),
        problems,
        notes: Vec::new(),
    };
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
