//! kvplan core: plans KV-cache transfers between a prefill peer and a decode peer.
//!
//! Pure Rust, no Python. Data flows one way: [`Layout`]s (once per peer) → [`Template`] (once
//! per peer pair: entries paired by global layer id and validated) → per-request plans
//! (`(src_addr, dst_addr, length)` columns) → a transfer engine.
#![forbid(unsafe_code)]

pub mod descriptors;
pub mod digest;
pub mod emit;
pub mod error;
pub mod heads;
pub mod layout;
pub mod pairing;
pub mod plan;
pub mod runs;
pub mod template;
pub mod tokens;
pub mod wire;

pub use descriptors::{DescriptorTable, PreppedIndices, PreppedShape};
pub use digest::{
    PlanBlocks, Region, content_digest, index_digest, layout_fingerprint, pair_content_digests,
    plan_digest,
};
pub use emit::Piece;
pub use error::{ErrorClass, PlanError, Result, Side, try_vec};
pub use heads::{HeadSlicing, Link, SlicedHeads, TpSplit, heads_text};
pub use layout::{AttentionGeometry, EntryKind, Layout, LayoutContext, LayoutParts, MemoryOrder};
pub use pairing::{
    EntryMetadata, EntryPair, LegacyKind, Pairing, PairingMode, Partner, legacy_pp_pairs,
    pair_each, pair_entries,
};
pub use plan::{AsColumns, Columns, FlatBuffer, Plan, PlanShape, PlanSummary, PlanUnit};
pub use runs::{IndexLimits, PageIndex, RunScan, group_contiguous};
pub use template::{
    EntryCheck, Fragment, Fragments, GeometryOptions, Group, PairSpec, Template, TemplateOptions,
    check_pairs,
};
pub use tokens::{TOKEN_CLASSES, TokenPiece, TokenShape, TokenTemplate, needs_tokens};
