//! The caller's layer groups for layer-wise streaming, keyed by **global layer id**.
//!
//! A serving engine signals "layer `l` is written" from its per-layer hook; kvplan sends a
//! group of layers once all of its layers are ready. [`LayerGroups`] says which layers go
//! together (every layer on its own, fixed-size groups of consecutive ids, or any list of
//! disjoint id sets) and which entries wait for the end of the forward (the **seal**): entries
//! of layers no group covers, draft entries, entries without a layer id, and whatever the caller
//! marks by layer id or role (e.g. indexer caches no hook fires for).
//!
//! A per-request state entry (a linear-attention or SSM layer's recurrent and conv state) goes
//! with its layer's group like a page entry: that layer's forward writes it, so the layer's
//! ready signal covers it.
//!
//! This module only classifies one entry ([`LayerGroups::key`]); the template uses it to stop
//! coalescing at group edges and `slices` uses it to cut plans into views.

use std::collections::{BTreeSet, HashMap};

use crate::error::{PlanError, Result};
use crate::peer::layout::Layout;

/// How layer ids are grouped.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Grouping {
    /// Group `g` holds the layer ids `g × size .. (g + 1) × size` (size 1: every layer alone).
    Fixed(u64),
    /// Group `g` is the caller's `g`-th set of layer ids.
    Sets {
        sets: Vec<Vec<i64>>,
        index: HashMap<i64, usize>,
    },
}

/// The caller's layer groups plus what it marks "at the end" (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerGroups {
    grouping: Grouping,
    seal_layers: BTreeSet<i64>,
    seal_roles: BTreeSet<String>,
}

/// Which slice an entry's blocks belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SliceKey {
    /// The layer group with this id.
    LayerGroup(u64),
    /// The seal: sent once the forward is done.
    Seal,
}

/// What grouping needs to know about one source entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryTag {
    /// Global layer id, when the layout publishes one.
    pub layer: Option<i64>,
    /// Role (`""` when not published).
    pub role: String,
    /// A draft (speculative decoding) entry.
    pub draft: bool,
    /// A per-request state entry.
    pub state: bool,
}

impl EntryTag {
    /// The tag of entry `entry` of `layout`.
    pub fn of(layout: &Layout, entry: usize) -> Self {
        let of = layout.entries().get(entry);
        Self {
            layer: of.and_then(|e| e.layer),
            role: of.map(|e| e.role.clone()).unwrap_or_default(),
            draft: layout.is_draft(entry),
            state: of.is_some_and(|e| !e.is_page()),
        }
    }
}

impl LayerGroups {
    /// Every layer its own group (group id = layer id).
    pub fn every_layer() -> Self {
        Self::with(Grouping::Fixed(1))
    }

    /// Groups of `size` consecutive layer ids: layer `l` is in group `l / size`, whatever PP
    /// stage holds it, so every stage and rank agrees on the groups.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for size 0.
    pub fn fixed(size: u64) -> Result<Self> {
        if size == 0 {
            return Err(geometry(
                "layer groups need a size of at least 1 layer, got 0".into(),
            ));
        }
        Ok(Self::with(Grouping::Fixed(size)))
    }

    /// The caller's sets of layer ids: group `g` is `sets[g]`. Sets may be empty; a layer id
    /// may appear in one set only.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] naming a layer id listed twice and its sets, or a negative id.
    pub fn sets(sets: Vec<Vec<i64>>) -> Result<Self> {
        let mut index = HashMap::new();
        for (g, set) in sets.iter().enumerate() {
            for &layer in set {
                if layer < 0 {
                    return Err(geometry(format!(
                        "layer group {g} lists layer id {layer}; layer ids are non-negative"
                    )));
                }
                if let Some(other) = index.insert(layer, g)
                    && other != g
                {
                    return Err(geometry(format!(
                        "layer {layer} is in layer groups {other} and {g}; a layer belongs to one group"
                    )));
                }
            }
        }
        Ok(Self::with(Grouping::Sets { sets, index }))
    }

    fn with(grouping: Grouping) -> Self {
        Self {
            grouping,
            seal_layers: BTreeSet::new(),
            seal_roles: BTreeSet::new(),
        }
    }

    /// The same groups, with the entries of these layer ids and roles sent in the seal
    /// (after the forward) instead of with their group.
    #[must_use]
    pub fn with_seal(mut self, layers: &[i64], roles: &[String]) -> Self {
        self.seal_layers.extend(layers);
        self.seal_roles.extend(roles.iter().cloned());
        self
    }

    /// The group of a layer id (`None`: no group covers it).
    pub fn group_of(&self, layer: i64) -> Option<u64> {
        if layer < 0 {
            return None;
        }
        match &self.grouping {
            Grouping::Fixed(size) => Some(layer as u64 / size),
            Grouping::Sets { index, .. } => index.get(&layer).map(|&g| g as u64),
        }
    }

    /// The layer ids of group `group`, restricted to `0..limit` for fixed groups.
    pub fn layers_of(&self, group: u64, limit: u64) -> Vec<i64> {
        match &self.grouping {
            Grouping::Fixed(size) => {
                let start = group.saturating_mul(*size);
                let stop = start.saturating_add(*size).min(limit);
                (start..stop).map(|l| l as i64).collect()
            }
            Grouping::Sets { sets, .. } => usize::try_from(group)
                .ok()
                .and_then(|g| sets.get(g))
                .map_or_else(Vec::new, |s| {
                    let mut s = s.clone();
                    s.sort_unstable();
                    s.dedup();
                    s
                }),
        }
    }

    /// Groups to list for a model whose layer ids lie below `n_layers`: every caller set, or
    /// the fixed groups covering `0..n_layers`.
    pub fn n_groups(&self, n_layers: u64) -> u64 {
        match &self.grouping {
            Grouping::Fixed(size) => n_layers.div_ceil(*size),
            Grouping::Sets { sets, .. } => sets.len() as u64,
        }
    }

    /// Where an entry's blocks go: its layer's group (page and state entries alike), or the
    /// seal for draft and id-less entries, entries the caller marked, and layers no group
    /// covers.
    pub fn key(&self, tag: &EntryTag) -> SliceKey {
        if tag.draft || self.seal_roles.contains(&tag.role) {
            return SliceKey::Seal;
        }
        match tag.layer {
            Some(layer) if !self.seal_layers.contains(&layer) => self
                .group_of(layer)
                .map_or(SliceKey::Seal, SliceKey::LayerGroup),
            _ => SliceKey::Seal,
        }
    }
}

/// Layer ids as text, consecutive ids as ranges (`0-3, 7`).
pub(crate) fn ids_text(ids: &[i64]) -> String {
    if ids.is_empty() {
        return "none".into();
    }
    let mut parts: Vec<String> = Vec::new();
    let mut start = ids[0];
    for (k, &id) in ids.iter().enumerate() {
        let end = ids.get(k + 1).is_none_or(|&next| next != id + 1);
        if end {
            parts.push(if start == id {
                format!("{id}")
            } else {
                format!("{start}-{id}")
            });
            if let Some(&next) = ids.get(k + 1) {
                start = next;
            }
        }
    }
    parts.join(", ")
}

fn geometry(what: String) -> PlanError {
    PlanError::Geometry { what }
}

/// A peer's place in its cluster, as its layout publishes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PeerRanks {
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
}

impl PeerRanks {
    /// The ranks `layout` publishes.
    pub fn of(layout: &Layout) -> Self {
        let c = layout.context();
        Self {
            pp_rank: c.pp_rank,
            pp_size: c.pp_size,
            tp_rank: c.tp_rank,
            tp_size: c.tp_size,
        }
    }
}

/// What a template keeps for layer-wise slicing: each page pair's and each state pair's source
/// tag, both peers' ranks and how many model layers fixed groups cover.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct StreamFacts {
    /// Per page pair (planning order), its source entry's tag.
    pub page_tags: Vec<EntryTag>,
    /// Per state pair (template order), its source entry's tag.
    pub state_tags: Vec<EntryTag>,
    /// Prefill (source) ranks.
    pub prefill: PeerRanks,
    /// Decode (destination) ranks.
    pub decode: PeerRanks,
    /// Layer ids of the model lie below this: the layouts' model layer count, or one past the
    /// largest non-draft layer id of either layout when neither publishes it.
    pub n_layers: u64,
}

impl StreamFacts {
    /// The facts of a template pairing `src` with `dst` through `page_pairs` and
    /// `state_pairs`.
    pub fn new(
        src: &Layout,
        dst: &Layout,
        page_pairs: &[crate::model::pieces::PairSpec],
        state_pairs: &[crate::model::pieces::PairSpec],
    ) -> Self {
        let tags = |pairs: &[crate::model::pieces::PairSpec]| {
            pairs
                .iter()
                .map(|p| EntryTag::of(src, p.src_entry))
                .collect()
        };
        let (page_tags, state_tags) = (tags(page_pairs), tags(state_pairs));
        let published = |l: &Layout| l.context().num_model_layers;
        let seen = |l: &Layout| {
            l.entries()
                .iter()
                .filter(|e| !e.draft)
                .filter_map(|e| e.layer)
                .filter(|&id| id >= 0)
                .map(|id| id as u64 + 1)
                .max()
                .unwrap_or(0)
        };
        let n_layers = published(src)
            .or(published(dst))
            .unwrap_or_else(|| seen(src).max(seen(dst)));
        Self {
            page_tags,
            state_tags,
            prefill: PeerRanks::of(src),
            decode: PeerRanks::of(dst),
            n_layers,
        }
    }
}
