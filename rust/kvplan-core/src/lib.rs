//! kvplan core: plans KV-cache transfers between a prefill peer and a decode peer.
//!
//! Pure Rust, no Python. Data flows one way: [`Layout`]s (once per peer) → [`Template`] (once
//! per peer pair: entries paired by global layer id and validated) → per-request plans
//! (`(src_addr, dst_addr, length)` columns) → a transfer engine.
//!
//! ```
//! use kvplan_core::{Columns, Layout, LayoutContext, PlanError, Request, Template, TemplateOptions};
//!
//! // Two layers of MLA latents, 1,152-byte pages, 64 pages per buffer, on each peer.
//! let layout = |base: u64| {
//!     Layout::mla(vec![base, base + (1 << 20)], vec![1152 * 64; 2], vec![1152; 2],
//!                 Some(vec![0, 1]), LayoutContext::default())
//! };
//! let template = Template::new(&layout(1 << 32)?, &layout(1 << 40)?, TemplateOptions::default())?;
//! let request = Request::pages(&[3i64, 4, 9], &[10i64, 11, 2]);
//!
//! // Allocating: 2 runs (pages 3-4 → 10-11, 9 → 2) × 2 layers = 4 blocks.
//! let plan = template.plan(&request)?;
//! assert_eq!(plan.lengths, [2 * 1152, 1152, 2 * 1152, 1152]);
//! assert_eq!(plan.src_addrs[0], (1 << 32) + 3 * 1152);
//! assert_eq!(plan.dst_addrs[0], (1 << 40) + 10 * 1152);
//!
//! // Into the caller's buffer: the block count first, then a plan that allocates nothing.
//! let n = template.prepare(&request)?.n_blocks;
//! let mut buffer = vec![0u64; 3 * n];
//! template.plan_into(&request, |_| Ok(Columns::from_flat(&mut buffer, n)))?;
//! assert_eq!(buffer[..n], plan.src_addrs[..]);
//! # Ok::<(), PlanError>(())
//! ```
//!
//! Modules form layers: a module uses only modules of the layers above its own, so none
//! imports another in a circle. This list is the one statement of the order;
//! `tests/module_layers.rs` reads it and fails on any `crate::` use that breaks it.
//!
//! <!-- module layers -->
//! 1. `error` (the one error type), `repr` (KV dtypes and scale layouts: names only).
//! 2. `layout` (a peer's buffers), `runs` (the request scan), `pairing` (entries by layer id),
//!    `pieces` (the address model), `local` (plans on CPU byte slices), `capabilities` (what
//!    each planner supports).
//! 3. `dcp` (the dealt token map), `groups` (layer groups), `heads` (TP head slicing), `plan`
//!    (output types), `request` (the one request value).
//! 4. `check` (every rule), `emit` (the page kernels), `wire` (the binary layout encoding).
//! 5. `tokens` (the token kernels), `nixl_ids` (descriptor ids in vLLM's NIXL layout),
//!    `digest` (fingerprints and digests), `coalesce` (which pairs emit together).
//! 6. `accounting` (blocks and bytes per group and pair).
//! 7. `template` (build once, pick the strategy, one request path).
//! 8. `pack` (gather + network), `descriptors` (NIXL prepped tables), `batch` (many requests
//!    in one plan), `ring` (ring state between rings of different sizes), `blockers` (why page
//!    pairs emit their blocks apart).
//! 9. `staged` (gather + network between staging regions + scatter), `slices` (layer-wise
//!    views of a plan or a batch, the manifest).
//! 10. `advice` (direct or staged), `convert` (conversion plans between representations).
//! <!-- end module layers -->
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod accounting;
pub mod advice;
pub mod batch;
pub mod blockers;
pub mod capabilities;
pub mod check;
pub mod coalesce;
pub mod convert;
pub mod dcp;
pub mod descriptors;
pub mod digest;
pub mod emit;
pub mod error;
pub mod groups;
pub mod heads;
pub mod layout;
pub mod local;
pub mod nixl_ids;
pub mod pack;
pub mod pairing;
pub mod pieces;
pub mod plan;
pub mod repr;
pub mod request;
pub mod ring;
pub mod runs;
pub mod slices;
pub mod staged;
pub mod template;
pub mod tokens;
pub mod wire;

pub use accounting::BlockAccounting;
pub use advice::{Advice, Choice, TransferCost, advise, transfer_advice};
pub use batch::{BatchPlan, BatchPlanner, BatchSummary, FlatRequests};
pub use blockers::{Coalescing, PairCoalescing, coalescing};
pub use capabilities::{Asked, Feature, Planner, SUPPORT};
pub use check::{EntryCheck, TemplateOptions, check_pairs, needs_tokens};
pub use coalesce::{Group, JoinBlocker};
pub use dcp::DcpContext;
pub use descriptors::{DescriptorTable, DescriptorTables, PreppedIndices, PreppedShape};
pub use digest::{
    LeaseRef, PlanBlocks, Region, content_digest, delta_plan_digest, index_digest,
    layout_fingerprint, leased_plan_digest, pair_content_digests, plan_digest, request_plan_digest,
};
pub use error::{ErrorClass, HeadProblem, PlanError, Result, Side};
pub use groups::{EntryTag, LayerGroups, PeerRanks, SliceKey};
pub use heads::{
    HeadSlicing, Link, SlicedHeads, TpSplit, heads_text, staging_replicas_write, staging_writer,
};
pub use layout::{
    AttentionGeometry, EntryKind, Layout, LayoutContext, LayoutParts, MHA_ROLES, MemoryOrder,
    heads_per_rank_at,
};
pub use local::{RegionMut, check_local_buffers, copy_local};
pub use nixl_ids::{BlockScale, DescIdRequest, desc_ids};
pub use pack::{PackBuffer, PackPlanner, PackedCounts, PackedPlan, RowCopy, RowGather};
pub use pairing::{
    EntryMetadata, LegacyKind, Pairing, PairingMode, legacy_pp_pairs, pair_each, pair_entries,
};
pub use pieces::{
    Fragment, Fragments, PIECE_CLASSES, PairSpec, Piece, PieceSide, TOKEN_CLASSES, TokenMap,
};
pub use plan::{AsColumns, Columns, FlatBuffer, Plan, PlanPart, PlanSummary, PlanUnit, TokenShape};
pub use repr::{KvDtype, MX_BLOCK, Representation, ScaleFormat, ScaleLayout};
pub use request::{Indices, Request};
pub use ring::RingPlanner;
pub use runs::{
    IndexLimits, PageIndex, RunRule, RunScan, group_contiguous, reverse_descending_runs, scan_runs,
};
pub use slices::{
    BatchCall, BatchPart, BatchSlices, LayerSlices, PlanSlices, SliceWork, WorkManifest,
};
pub use staged::{StagedCounts, StagedPlan, StagedPlanner, StagingRegion};
pub use template::{BlockRequest, GeometryOptions, Template};
pub use tokens::TokenTemplate;
