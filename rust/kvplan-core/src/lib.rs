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
//! The modules sit in folders by job, and the folders and the modules in each form layers: a
//! module uses only modules of the folders above its own and, in its own folder, of the layers
//! above its own, so none imports another in a circle and no import runs back up. This list is
//! the one statement of the order; `tests/module_layers.rs` reads it and fails on any `crate::`
//! use that breaks it, and on a module missing from it. Data flows down the folders: a peer's
//! layout, the model of a plan, the rules, the kernels, the compiled peer pair, the planners.
//!
//! <!-- module layers -->
//! 1. `error` (the one error type).
//! 2. `peer/` (one peer's side):
//!    1. `kv_format` (KV dtypes and scale layouts: names only).
//!    2. `entry` (one entry as one value, its kind and its page pools).
//!    3. `layout` (a peer's buffers, their constructors and contexts).
//! 3. `model/` (the data model of a plan):
//!    1. `pieces` (the address model), `runs` (the request scan).
//!    2. `plan` (output types), `request` (the one request value), `layer_groups` (the caller's
//!       layer groups).
//! 4. `rules/` (what may be planned):
//!    1. `pairing` (entries by layer id), `capabilities` (what each planner supports),
//!       `manifest` (a model's components against a layout).
//!    2. `dcp` (the dealt token map), `heads` (TP head slicing).
//!    3. `state_split` (a state slot re-sliced over TP channel splits).
//!    4. `check` (every rule).
//! 5. `exchange/` (what leaves the planner):
//!    1. `local` (plans on CPU byte slices), `wire` (the binary layout encoding).
//!    2. `digest` (fingerprints and digests), `identity` (the address-free identity of a
//!       layout).
//! 6. `kernels/` (the emission kernels):
//!    1. `emit` (the page kernels), `tokens` (the token kernels), `rings` (the ring lanes'
//!       rows).
//! 7. `peer_pair/` (a compiled peer pair):
//!    1. `coalesce` (which pairs emit together).
//!    2. `accounting` (blocks and bytes per group and pair).
//!    3. `template` (build once, pick the strategy, one request path).
//! 8. `planners/` (the planners that borrow a template):
//!    1. `pack` (gather + network), `descriptors` (NIXL prepped tables), `batch` (many requests
//!       in one plan), `coalescing` (why page pairs emit their blocks apart), `nixl_ids`
//!       (descriptor ids in vLLM's NIXL layout).
//!    2. `staged` (gather + network between staging regions + scatter), `slices` (layer-wise
//!       views of a plan or a batch, the manifest), `failures` (the pages failed blocks were to
//!       write).
//!    3. `advice` (direct or staged), `convert` (conversion plans between representations),
//!       `rounds` (a staged plan in rounds through bounded arenas).
//!    4. `compatibility` (verdicts on a prefill and a decode identity), `stages` (the stages
//!       of every multi-stage plan, in the order they run).
//! <!-- end module layers -->
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod error;
pub mod exchange;
pub mod kernels;
pub mod model;
pub mod peer;
pub mod peer_pair;
pub mod planners;
pub mod rules;

pub use error::{ErrorClass, HeadProblem, ManifestProblem, PlanError, Result, Side, layer_ranges};
pub use exchange::digest::{
    LeaseRef, PlanBlocks, Region, content_digest, delta_plan_digest, index_digest,
    layout_fingerprint, leased_plan_digest, pair_content_digests, plan_digest, request_plan_digest,
};
pub use exchange::identity::{
    CLASS_ID_PREFIX, IDENTITY_VERSION, LAYOUT_ID_PREFIX, LayoutIdentity, Semantics, TransferMode,
};
pub use exchange::local::{RegionMut, check_local_buffers, copy_local};
pub use kernels::rings::RingLane;
pub use kernels::tokens::TokenTemplate;
pub use model::layer_groups::{EntryTag, LayerGroups, PeerRanks, SliceKey};
pub use model::pieces::{
    Fragment, Fragments, Lane, MAX_LANES, PIECE_CLASSES, PairSpec, Piece, PieceSide, TOKEN_CLASSES,
    TokenMap, Walk,
};
pub use model::plan::{
    AsColumns, Columns, FlatBuffer, Plan, PlanPart, PlanSummary, PlanUnit, StateShape, StateTail,
    TokenShape,
};
pub use model::request::{Indices, PoolLists, Request};
pub use model::runs::{
    IndexLimits, PageIndex, RunRule, RunScan, group_contiguous, reverse_descending_runs, scan_runs,
};
pub use peer::entry::{
    Entry, EntryKind, Indexing, MAX_SHARD_GROUPS, POOLS, Pool, PoolId, StateChannels,
};
pub use peer::kv_format::{KvDtype, MX_BLOCK, Representation, ScaleFormat, ScaleLayout};
pub use peer::layout::{
    AttentionGeometry, Layout, LayoutContext, LayoutParts, MHA_ROLES, MemoryOrder,
    heads_per_rank_at,
};
pub use peer_pair::accounting::BlockAccounting;
pub use peer_pair::coalesce::{EmissionGroup, JoinBlocker};
pub use peer_pair::template::{BlockRequest, GeometryOptions, Template};
pub use planners::advice::{Advice, Choice, TransferCost, advise, transfer_advice};
pub use planners::batch::{BatchPlan, BatchPlanner, BatchSummary, FlatRequests};
pub use planners::coalescing::{Coalescing, PairCoalescing, coalescing};
pub use planners::compatibility::{Verdict, VerdictKind, compatibility, compatibility_with};
pub use planners::descriptors::{
    DescriptorRun, DescriptorTable, DescriptorTables, PreppedIndices, PreppedShape,
};
pub use planners::failures::{FailedPages, RequestFailure, failed_batch_pages, failed_pages};
pub use planners::nixl_ids::{BlockScale, DescIdRequest, desc_ids};
pub use planners::pack::{PackBuffer, PackPlanner, PackedCounts, PackedPlan, RowCopy, RowGather};
pub use planners::rounds::{
    Arena, DEFAULT_BUFFERS, RoundBlocks, RoundManifest, RoundsPlanner, StagedRounds,
};
pub use planners::slices::{
    BatchCall, BatchPart, BatchSlices, LayerSlices, PlanSlices, SliceWork, WorkManifest,
};
pub use planners::staged::{StagedCounts, StagedPlan, StagedPlanner, StagingRegion};
pub use planners::stages::{MultiStage, Part, PlanForm, Role, Stage, StageKind};
pub use rules::capabilities::{Asked, Feature, Planner, SUPPORT};
pub use rules::check::{EntryCheck, TemplateOptions, check_pairs, needs_tokens};
pub use rules::dcp::DcpContext;
pub use rules::heads::{
    ArenaSender, HeadSlicing, Link, SlicedHeads, TpSplit, arena_sender, heads_text,
    staging_replicas_write, staging_writer,
};
pub use rules::manifest::{
    Fusion, ManifestComponent, ModelManifest, Packed, Sharding, check_manifest,
};
pub use rules::pairing::{
    EntryMetadata, LegacyKind, Pairing, PairingMode, legacy_pp_pairs, pair_each, pair_entries,
};
