//! One registered transfer entry as one value (its buffer, item length, stride, layer, role,
//! draft-ness, representation and kind), and the page pools entries are indexed by.
//!
//! What an entry may carry depends on its kind, and the kind says it by construction: a page
//! entry has a pool and may have a sliding window, a state entry may be a ring, so "a window on
//! a state entry" or "a ring on a page entry" cannot be written.

use crate::error::{PlanError, Result};
use crate::peer::kv_format::Representation;

/// A side's page index space: one list of pages a request gives for that side, with its own
/// page size and index limit (as an engine keeps one block table per KV-cache group). Pool 0
/// ([`PoolId::PAGES`]) is the request's own pages; a layout adds further pools with
/// [`crate::Layout::with_pool`] (or [`crate::Layout::with_window_pool`]), numbered in the order
/// they are added, below [`POOLS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u8);

impl PoolId {
    /// The request's pages (its KV pages), at the layout's page size.
    pub const PAGES: PoolId = PoolId(0);
    /// The first further pool: the one [`crate::Layout::with_window_pool`] adds to a layout
    /// with no other further pool, whose pages a request gives as its window pages.
    pub const WINDOW: PoolId = PoolId(1);

    /// Every pool a side can have, in the order of [`PoolId::index`].
    pub const ALL: [PoolId; POOLS] = {
        let mut all = [PoolId(0); POOLS];
        let mut k = 0;
        while k < POOLS {
            all[k] = PoolId(k as u8);
            k += 1;
        }
        all
    };

    /// Its position in per-pool arrays.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// The most pools a side can have (its pages and seven further pools): per-request page lists
/// and limits stay on the stack.
pub const POOLS: usize = 8;

/// One page pool of a layout: the pages of one index space, each holding `page_size` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pool {
    /// Which index space.
    pub id: PoolId,
    /// Tokens per page.
    pub page_size: u64,
    /// Tokens one row of its entries holds (1: a row per token; a compressed cache keeps one
    /// row per `tokens_per_row` tokens). `page_size` is a multiple of it, so a row never spans
    /// pages; a token plan moves row `r` once its last token (`(r + 1) × tokens_per_row − 1`)
    /// is in the request's range.
    pub tokens_per_row: u64,
}

impl Pool {
    /// Rows one page holds.
    pub fn rows_per_page(&self) -> u64 {
        self.page_size / self.tokens_per_row.max(1)
    }
}

/// What indexes an entry, with what only that kind of entry can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryKind {
    /// Indexed by the pages of `pool` (KV cache); planned by [`crate::Template::plan_into`].
    Page {
        /// The pool whose pages index it.
        pool: PoolId,
        /// Sliding-window size in tokens (`None`: the entry keeps every token).
        window: Option<u64>,
    },
    /// Indexed by a per-request slot (Mamba conv/temporal state).
    State {
        /// Rows per request slot of a ring-state entry (`None`: one whole slot).
        ring: Option<u64>,
        /// How a slot's channels are split over the layout's TP ranks (`None`: the slot is
        /// moved whole, or sliced by the layouts' attention geometry).
        channels: Option<StateChannels>,
    },
}

/// The most sub-blocks ([`StateChannels::groups`]) a TP-split state entry can have.
pub const MAX_SHARD_GROUPS: usize = 4;

/// How one state slot's bytes follow the TP split of its channels: a slot is `outer_rows`
/// rows, each of this rank's `channels` channels of the same number of bytes. The model's
/// channels are cut into sub-blocks (`groups`, channel counts at TP 1; one sub-block of
/// `channels × tp_size` when none are given), each split evenly over the TP ranks on its own:
/// rank `r` holds channels `r·G/tp .. (r+1)·G/tp` of a sub-block of `G`, and a row stores the
/// rank's share of each sub-block in order. `channels == 0` marks a state replicated on every
/// rank: its whole slot moves, from one elected prefill rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateChannels {
    /// Channels per rank in a row (0: replicated).
    pub channels: u64,
    /// Rows per slot (a Kimi conv state keeps one row per convolution tap: K - 1).
    pub outer_rows: u64,
    groups: [u64; MAX_SHARD_GROUPS],
    n_groups: u8,
}

impl StateChannels {
    /// A split of `channels` channels per rank in `outer_rows` rows, with sub-blocks `groups`
    /// (channel counts at TP 1; empty: one sub-block).
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] for 0 rows, more than [`MAX_SHARD_GROUPS`] sub-blocks, a
    /// sub-block of 0 channels, or sub-blocks on a replicated state.
    pub fn new(channels: u64, outer_rows: u64, groups: &[u64]) -> Result<Self> {
        let bad = |what: String| Err(PlanError::InvalidLayout { what });
        if outer_rows == 0 {
            return bad("a state channel split needs at least 1 outer row, got 0".into());
        }
        if groups.len() > MAX_SHARD_GROUPS {
            return bad(format!(
                "a state channel split has at most {MAX_SHARD_GROUPS} shard groups, got {} \
                 ({groups:?})",
                groups.len()
            ));
        }
        if groups.contains(&0) {
            return bad(format!(
                "shard groups must be positive channel counts, got {groups:?}"
            ));
        }
        if channels == 0 && !groups.is_empty() {
            return bad(format!(
                "a replicated state (0 channels per rank) has no shard groups, got {groups:?}"
            ));
        }
        let mut out = Self {
            channels,
            outer_rows,
            groups: [0; MAX_SHARD_GROUPS],
            n_groups: groups.len() as u8,
        };
        out.groups[..groups.len()].copy_from_slice(groups);
        Ok(out)
    }

    /// The sub-blocks' channel counts at TP 1 (empty: one sub-block).
    pub fn groups(&self) -> &[u64] {
        &self.groups[..usize::from(self.n_groups)]
    }

    /// Whether the state is replicated on every rank (0 channels per rank).
    pub fn replicated(&self) -> bool {
        self.channels == 0
    }
}

impl EntryKind {
    /// A page entry of the request's pages, keeping every token.
    pub const PAGE: EntryKind = EntryKind::Page {
        pool: PoolId::PAGES,
        window: None,
    };

    /// A whole-slot state entry.
    pub const STATE: EntryKind = EntryKind::State {
        ring: None,
        channels: None,
    };

    /// Page or state, without the per-kind fields.
    pub fn indexing(self) -> Indexing {
        match self {
            EntryKind::Page { .. } => Indexing::Page,
            EntryKind::State { .. } => Indexing::State,
        }
    }

    /// The fresh kind (no pool but the request's pages, no window, no ring) of `indexing`.
    pub fn of(indexing: Indexing) -> Self {
        match indexing {
            Indexing::Page => Self::PAGE,
            Indexing::State => Self::STATE,
        }
    }
}

/// Whether an entry is indexed by KV page or by per-request state slot: the kind as the
/// ingestion lists ([`crate::LayoutParts`]), Python and the wire name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Indexing {
    /// Indexed by page.
    Page,
    /// Indexed by a per-request slot.
    State,
}

impl Indexing {
    /// The name used in Python and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Indexing::Page => "page",
            Indexing::State => "state",
        }
    }

    /// Parses [`Indexing::as_str`] output.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] for any other string.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "page" => Ok(Indexing::Page),
            "state" => Ok(Indexing::State),
            other => Err(PlanError::InvalidLayout {
                what: format!("unknown entry kind {other:?}; expected \"page\" or \"state\""),
            }),
        }
    }
}

/// One registered transfer entry: item `i` is the `item_len` bytes at
/// `buffer.0 + i * stride`, inside the `buffer.1` bytes of its buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Entry {
    /// Base address and length in bytes of the buffer.
    pub buffer: (u64, u64),
    /// Bytes of one page or slot.
    pub item_len: u64,
    /// Bytes between consecutive items (at least `item_len`).
    pub stride: u64,
    /// Global layer id (`None`: not published).
    pub layer: Option<i64>,
    /// Role (`""`: not published).
    pub role: String,
    /// Whether it belongs to the draft model (speculative decoding).
    pub draft: bool,
    /// KV representation (`None`: none published).
    pub format: Option<Representation>,
    /// What indexes it, with its window or ring.
    pub kind: EntryKind,
}

impl Entry {
    /// Page or state.
    pub fn indexing(&self) -> Indexing {
        self.kind.indexing()
    }

    /// Whether it is indexed by page.
    pub fn is_page(&self) -> bool {
        matches!(self.kind, EntryKind::Page { .. })
    }

    /// Its sliding window in tokens (`None`: a full entry, or a state entry).
    pub fn window(&self) -> Option<u64> {
        match self.kind {
            EntryKind::Page { window, .. } => window,
            EntryKind::State { .. } => None,
        }
    }

    /// Its rows per request slot (`None`: not a ring, or a page entry).
    pub fn ring(&self) -> Option<u64> {
        match self.kind {
            EntryKind::State { ring, .. } => ring,
            EntryKind::Page { .. } => None,
        }
    }

    /// Its TP channel split (`None`: none, or a page entry).
    pub fn channels(&self) -> Option<StateChannels> {
        match self.kind {
            EntryKind::State { channels, .. } => channels,
            EntryKind::Page { .. } => None,
        }
    }

    /// The pool whose pages index it (`None` for a state entry).
    pub fn pool(&self) -> Option<PoolId> {
        match self.kind {
            EntryKind::Page { pool, .. } => Some(pool),
            EntryKind::State { .. } => None,
        }
    }
}
