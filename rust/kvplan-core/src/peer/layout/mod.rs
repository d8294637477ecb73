//! A peer's registered transfer entries (its layout) and constructors for the pool shapes
//! serving engines use: MLA, MHA (K block then V block), hybrid-linear, NPU buffer groups,
//! draft entries and per-request state entries.
//!
//! One type, its impl in parts by job: `context` (what a layout is built in), `build` (the
//! checks every layout passes), `fields` (the per-entry setters), `pools` (page-index spaces)
//! and `shapes` (the engines' registrations). This file holds the type, its reads and the
//! shared error helpers. The parts share private fields, so they are one module to the layers.

mod build;
mod context;
mod fields;
mod pools;
mod shapes;
#[cfg(test)]
mod tests;

use crate::error::{PlanError, Result};
use crate::peer::entry::{Entry, Indexing, POOLS, Pool};

pub use context::{AttentionGeometry, DcpContext, LayoutContext, MemoryOrder, heads_per_rank_at};

/// Roles of the separate K and V entries of an MHA layout ([`Layout::mha`]): K/V heads are
/// sharded between TP ranks (an MLA latent, role `kv`, and NPU buffer groups are not).
pub const MHA_ROLES: [&str; 2] = [K_ROLE, V_ROLE];

/// The raw parallel lists a layout is built from (SGLang's `KVArgs` registration lists plus
/// roles and kinds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutParts {
    /// Base address of each buffer.
    pub data_ptrs: Vec<u64>,
    /// Bytes of each buffer.
    pub data_lens: Vec<u64>,
    /// Bytes of one page or slot of each buffer (the stride between consecutive indices).
    pub item_lens: Vec<u64>,
    /// Global layer id per entry (`None` = not published for that entry).
    pub layer_ids: Vec<Option<i64>>,
    /// Role per entry (`""` = not published).
    pub roles: Vec<String>,
    /// Kind per entry.
    pub kinds: Vec<Indexing>,
    /// Whether each entry belongs to the draft model (speculative decoding). Empty: derived
    /// from the roles, a role starting with `draft` marking a draft entry (the names
    /// [`Layout::with_draft`] gives).
    pub drafts: Vec<bool>,
}

/// Role of the K entries of an MHA layout.
pub(crate) const K_ROLE: &str = "k";
/// Role of the V entries of an MHA layout.
pub(crate) const V_ROLE: &str = "v";

/// Whether `role` names an entry that belongs to its layer's KV entry rather than standing
/// alone: a sparse-attention indexer cache (`indexer`) or quantization scales (a role ending in
/// `scale` or `scales`, such as `k_scale`). Such an entry is only transferred with its partner.
pub fn is_sidecar_role(role: &str) -> bool {
    role == "indexer" || role.ends_with("scale") || role.ends_with("scales")
}

/// Whether `role` names the K or V half of a layer (an MHA layout).
pub(crate) fn is_mha_role(role: &str) -> bool {
    role == K_ROLE || role == V_ROLE
}

/// The error for a list of `len` values where `expected` are needed.
pub(super) fn check_len(field: &'static str, len: usize, expected: usize) -> Result<()> {
    if len == expected {
        Ok(())
    } else {
        Err(PlanError::ListLength {
            field,
            len,
            expected,
        })
    }
}

/// A validated, immutable list of one peer's transfer entries plus its context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// One value per entry, in registration order.
    entries: Vec<Entry>,
    /// The page pools its page entries index: the request's pages first (at the context's page
    /// size), then a window pool when its window entries keep one.
    pools: Vec<Pool>,
    context: LayoutContext,
}

impl Layout {
    /// Number of entries.
    pub fn n_entries(&self) -> usize {
        self.entries.len()
    }

    /// The entries, in registration order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Entry `i`.
    pub fn entry(&self, i: usize) -> &Entry {
        &self.entries[i]
    }

    /// The entries as the parallel lists a layout is built from (a copy: the ingestion form,
    /// for callers that hand lists on, such as Python and the wire).
    pub fn parts(&self) -> LayoutParts {
        parts_of(&self.entries)
    }

    /// The peer context.
    pub fn context(&self) -> &LayoutContext {
        &self.context
    }

    /// How many items (pages or slots) entry `i` holds: the whole items that fit in its buffer,
    /// `(data_len - item_len) / stride + 1` (`data_len / item_len` when the stride is the item
    /// length); 0 for an elided entry (`item_len == 0`) or a buffer smaller than one item.
    pub fn capacity(&self, i: usize) -> u64 {
        let entry = &self.entries[i];
        let (len, item) = (entry.buffer.1, entry.item_len);
        if item == 0 || len < item {
            return 0;
        }
        // stride >= item > 0 (checked when the strides were set).
        (len - item) / entry.stride + 1
    }

    /// The entry's layer id as text (`None` when unpublished, as Python shows it), for messages.
    pub(crate) fn layer_label(&self, i: usize) -> String {
        self.entries[i]
            .layer
            .map_or_else(|| "None".into(), |id| id.to_string())
    }

    /// The entry's role (`None` when unpublished).
    pub fn role(&self, i: usize) -> Option<&str> {
        Some(self.entries[i].role.as_str()).filter(|r| !r.is_empty())
    }

    /// The entry's role as text (`None` when unpublished, as Python shows it), for messages.
    pub(crate) fn role_label(&self, i: usize) -> String {
        self.role(i).unwrap_or("None").to_string()
    }

    /// Whether entry `i` belongs to the draft model.
    pub fn is_draft(&self, i: usize) -> bool {
        self.entries[i].draft
    }

    /// Indices of the entries of one kind, in layout order.
    pub fn entries_of_kind(&self, kind: Indexing) -> Vec<usize> {
        (0..self.n_entries())
            .filter(|&i| self.entries[i].indexing() == kind)
            .collect()
    }
}

/// The parallel lists of `entries` (the ingestion form).
pub(super) fn parts_of(entries: &[Entry]) -> LayoutParts {
    let list = |field: fn(&Entry) -> u64| entries.iter().map(field).collect();
    LayoutParts {
        data_ptrs: list(|e| e.buffer.0),
        data_lens: list(|e| e.buffer.1),
        item_lens: list(|e| e.item_len),
        layer_ids: entries.iter().map(|e| e.layer).collect(),
        roles: entries.iter().map(|e| e.role.clone()).collect(),
        kinds: entries.iter().map(Entry::indexing).collect(),
        drafts: entries.iter().map(|e| e.draft).collect(),
    }
}

pub(super) fn invalid(what: String) -> PlanError {
    PlanError::InvalidLayout { what }
}

pub(super) fn too_many_pools() -> PlanError {
    invalid(format!(
        "a layout keeps at most {POOLS} pools (its pages and {} further ones)",
        POOLS - 1
    ))
}
