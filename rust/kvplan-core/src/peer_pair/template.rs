//! A compiled peer pair: entries paired and validated once (module `check`), turned into
//! pieces once (module `pieces`), grouped once (module `coalesce`), with the strategy chosen
//! once: a page plan (kernels in `emit`) or a token plan (module `tokens`). Every request goes
//! through [`Template::prepare`]; what a plan's groups and pairs hold is the template's
//! [`BlockAccounting`]. Pack, staged, descriptor, advice and layer-wise planners borrow a
//! template; it keeps the two layouts so they derive what they need themselves.

use crate::error::{PlanError, Result, Side};
use crate::kernels::rings::{self, RingLane};
use crate::kernels::tokens::{LaneLists, PoolRanges, TokenTemplate, count_blocks_in, emit_tokens};
use crate::model::layer_groups::{EntryTag, LayerGroups, SliceKey};
use crate::model::pieces::{Fragments, PairSpec, Piece, total_len};
use crate::model::plan::{
    AsColumns, Columns, FlatBuffer, Plan, PlanSummary, PlanUnit, StateShape, StateTail, TokenShape,
};
use crate::model::request::{Indices, PoolLists, Request};
use crate::model::runs::{IndexLimits, PageIndex, RunRule, check_unique, scan_runs, write_runs_by};
use crate::peer::entry::{Indexing, POOLS, Pool, PoolId};
use crate::peer::layout::Layout;
use crate::peer_pair::accounting::BlockAccounting;
use crate::peer_pair::coalesce::build_emission_groups;
use crate::rules::capabilities::{Asked, Feature, Planner};
use crate::rules::check::{
    TemplateOptions, check_pairs_sliced, needs_tokens, pair_fragments, pair_spec,
};
use crate::rules::heads::HeadSlicing;

/// How a template turns pairs into blocks (independent of how entries are paired).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeometryOptions {
    /// Bytes of each item to move.
    pub fragments: Fragments,
    /// Merge consecutive pairs whose items touch on both sides into one block per page (or per
    /// run); off: every pair keeps its own blocks (per-layer submission).
    pub coalesce: bool,
}

impl Default for GeometryOptions {
    fn default() -> Self {
        Self {
            fragments: Fragments::Whole,
            coalesce: true,
        }
    }
}

/// Validated entry pairs for one (prefill layout, decode layout) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub(crate) page_pairs: Vec<PairSpec>,
    /// Page pairs with a non-zero item length, in order: the ones that emit blocks.
    pub(crate) emitting: Vec<PairSpec>,
    pub(crate) state_pairs: Vec<PairSpec>,
    /// The ring lanes (module `rings`): each ring-state pair with its walk
    /// ([`crate::Walk::Ring`], each side's rows per request slot). Not slot pairs: a slot
    /// request moves their live rows, by the walk, only when it gives its positions.
    pub(crate) ring_lanes: Vec<RingLane>,
    /// The pieces of the state pairs that move bytes, in order: one per pair, or one per byte
    /// slice of a TP-split pair (a slot is a one-page request).
    pub(crate) state_pieces: Vec<Piece>,
    /// Sum of item lengths over emitting pairs: bytes moved per page index pair.
    pub(crate) bytes_per_page: u64,
    /// Per pool ([`PoolId::index`]) and side, the smallest capacity over the emitting pairs
    /// whose entries that pool's pages index: every index of that pool's list must lie below
    /// it. A side without a pool has its request-pages limit there (its entries, windows
    /// included, are indexed by the request's pages).
    pub(crate) limits: [IndexLimits; POOLS],
    pub(crate) check_dst_overlap: bool,
    /// `TemplateOptions::replicas_send`: every writer of a decode rank sends (for the decode
    /// arena's shares, [`crate::rules::heads::arena_sender`]).
    pub(crate) replicas_send: bool,
    /// Emission units in block order (group-major, then fragment).
    pub(crate) pieces: Vec<Piece>,
    /// Groups, and what every group and pair of a plan holds.
    pub(crate) blocks: BlockAccounting,
    /// Head slicing between different TP sizes, when both layouts publish their geometry.
    heads: Option<HeadSlicing>,
    /// How requests are planned, chosen once at build.
    pub(crate) strategy: Strategy,
    /// The two layouts (prefill, decode): labels for messages, and what the planners that
    /// borrow a template read (layer tags and ranks for layer-wise slices, decode page entries
    /// for staging slots).
    pub(crate) layouts: (Layout, Layout),
}

/// How a template plans requests, chosen once when it is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// Whole pages are copied as they are; a request with `n_tokens` is planned by token when
    /// the pairs can be cut into tokens (else the reason they cannot).
    Pages { tokens: Result<TokenTemplate> },
    /// Every request is planned by token: the layouts' tokens per page or memory orders differ.
    Tokens(TokenTemplate),
}

impl Strategy {
    /// Token pieces, or why the pairs cannot be planned token by token.
    pub(crate) fn tokens(&self) -> Result<&TokenTemplate> {
        match self {
            Self::Pages { tokens } => tokens.as_ref().map_err(Clone::clone),
            Self::Tokens(tokens) => Ok(tokens),
        }
    }

    /// Whether every request is a token request.
    pub(crate) fn by_token(&self) -> bool {
        matches!(self, Self::Tokens(_))
    }
}

impl Template {
    /// Pairs `src` (prefill) entries with `dst` (decode) entries, page entries with page entries
    /// and state entries with state entries, and checks that every pair agrees on item length.
    ///
    /// # Errors
    /// Pairing errors, [`PlanError::SizeMismatch`] naming layer, role and both sizes, or
    /// [`PlanError::Overflow`].
    pub fn new(src: &Layout, dst: &Layout, options: TemplateOptions) -> Result<Self> {
        Self::with_geometry(src, dst, options, &GeometryOptions::default())
    }

    /// As [`Template::new`], with explicit fragments and coalescing.
    ///
    /// # Errors
    /// As [`Template::new`]; [`PlanError::Geometry`] for fragments that do not fit their items.
    pub fn with_geometry(
        src: &Layout,
        dst: &Layout,
        options: TemplateOptions,
        geometry: &GeometryOptions,
    ) -> Result<Self> {
        Self::build(src, dst, options, geometry, None)
    }

    /// As [`Template::with_geometry`], coalescing only pairs whose entries belong to the same
    /// layer group (or both to the seal): every group's blocks stay its own, so a layer group
    /// of a cross-layer pool is one strided piece per run and can be sent alone.
    ///
    /// # Errors
    /// As [`Template::with_geometry`].
    pub fn with_layer_groups(
        src: &Layout,
        dst: &Layout,
        options: TemplateOptions,
        geometry: &GeometryOptions,
        groups: &LayerGroups,
    ) -> Result<Self> {
        Self::build(src, dst, options, geometry, Some(groups))
    }

    fn build(
        src: &Layout,
        dst: &Layout,
        options: TemplateOptions,
        geometry: &GeometryOptions,
        layer_groups: Option<&LayerGroups>,
    ) -> Result<Self> {
        // The one head-slicing rule for page and token plans alike, derived once: the checks
        // read it, and once they pass it is the template's.
        let heads = HeadSlicing::between(src, dst, options.replicas_send);
        let checks = check_pairs_sliced(src, dst, options, &heads);
        if let Some(problem) = checks.iter().find_map(|c| c.problem.clone()) {
            return Err(problem);
        }
        let heads = heads?;
        crate::rules::check::same_representations(src, dst, &checks)?;
        let spec_of = |kind: Indexing| -> Vec<PairSpec> {
            checks
                .iter()
                .filter(|c| c.kind == kind)
                .filter_map(|c| c.dst_entry.map(|d| pair_spec(src, dst, c.src_entry, d)))
                .collect()
        };
        let (page_pairs, mut state_pairs) = (spec_of(Indexing::Page), spec_of(Indexing::State));
        let coalesce_keys: Vec<SliceKey> = layer_groups
            .map(|groups| {
                let tag = |p: &PairSpec| EntryTag::of(src, p.src_entry);
                page_pairs.iter().map(|p| groups.key(&tag(p))).collect()
            })
            .unwrap_or_default();
        let by_token = needs_tokens(src, dst);
        let moves_pages = heads.as_ref().is_none_or(HeadSlicing::moves_pages);
        let emitting: Vec<PairSpec> = page_pairs
            .iter()
            .copied()
            .filter(|p| p.item_len > 0 && moves_pages)
            .collect();
        let src_labels = crate::rules::check::entry_labels(src);
        if let Some(slicing) = &heads {
            slice_state_pairs(slicing, src, &mut state_pairs);
        }
        // State is not dealt over decode context-parallel ranks: every decode rank receives
        // it, from one source rank (module `dcp`).
        if crate::rules::dcp::dealt_pair(src, dst) && !crate::rules::dcp::sends_undealt(src, dst) {
            for pair in &mut state_pairs {
                (pair.item_len, pair.dst_item_len) = (0, 0);
            }
        }
        // A page plan moves the head slicing's fragments (restricted to the caller's, if any);
        // a token template places heads per token (module `tokens`), its page groups only say
        // which pairs' blocks go together.
        let head_fragments = match &heads {
            Some(slicing) if !by_token => slicing.page_fragments(),
            _ => Fragments::Whole,
        };
        let given = pair_fragments(&geometry.fragments, &page_pairs, &src_labels)?;
        let (pieces, groups, pair_groups) = if moves_pages {
            build_emission_groups(
                &page_pairs,
                &given,
                &head_fragments,
                geometry.coalesce,
                &coalesce_keys,
                &src_labels,
            )?
        } else {
            (Vec::new(), Vec::new(), vec![None; page_pairs.len()])
        };
        let tokens = TokenTemplate::build(
            src,
            dst,
            &page_pairs,
            &given,
            heads.as_ref(),
            (&src_labels, &crate::rules::check::entry_labels(dst)),
        );
        let strategy = match tokens {
            Ok(tokens) if by_token => Strategy::Tokens(tokens),
            Err(problem) if by_token => return Err(problem),
            tokens => Strategy::Pages { tokens },
        };
        let bytes_per_page = total_len(&pieces, "bytes per page")?;
        // Ring pairs (both sides rings: `check_pairs` refuses a ring against a slot) leave the
        // slot pairs and become the template's ring lanes (module `rings`).
        let (ring_specs, mut state_pairs): (Vec<PairSpec>, Vec<PairSpec>) = state_pairs
            .into_iter()
            .partition(|p| src.entry(p.src_entry).ring().is_some());
        let ring_lanes: Vec<RingLane> = ring_specs
            .into_iter()
            .filter_map(|p| {
                let rows = src
                    .entry(p.src_entry)
                    .ring()
                    .zip(dst.entry(p.dst_entry).ring())?;
                Some(RingLane::new(p, rows))
            })
            .collect();
        // Per slot pair, the byte slices it moves: a TP channel split's slices (module
        // `state_split`), else the whole (or head-sliced) item; a pair that moves nothing
        // gets item length 0, as an elided entry.
        let mut state_fragments = Vec::with_capacity(state_pairs.len());
        for pair in &mut state_pairs {
            let split = if pair.item_len > 0 {
                crate::rules::state_split::fragments(src, pair.src_entry, dst, pair.dst_entry)?
            } else {
                None
            };
            let fragments = match split {
                Some(fragments) => fragments,
                None if pair.item_len > 0 => vec![pair.whole()],
                None => Vec::new(),
            };
            if fragments.is_empty() {
                (pair.item_len, pair.dst_item_len) = (0, 0);
            }
            state_fragments.push(fragments);
        }
        let state_lens = state_fragments
            .iter()
            .map(|f| (f.len(), f.iter().map(|f| f.len).sum()))
            .collect();
        let blocks = BlockAccounting::new(
            groups,
            pair_groups,
            &pieces,
            strategy.tokens().ok(),
            (state_lens, ring_lanes.clone()),
        )?;
        let state_pieces = state_pairs
            .iter()
            .zip(&state_fragments)
            .flat_map(|(p, fragments)| fragments.iter().map(|&f| p.piece(f)))
            .collect();
        // Per side and pool, the pairs whose entries that pool's pages index; a side without
        // the pool indexes them by the request's pages.
        let limit = |layout: &Layout, pool: PoolId, capacity: fn(&PairSpec) -> (usize, u64)| {
            let pool = if layout.pool(pool).is_some() {
                pool
            } else {
                PoolId::PAGES
            };
            emitting
                .iter()
                .map(capacity)
                .filter(|&(entry, _)| layout.entry(entry).pool() == Some(pool))
                .fold(u64::MAX, |limit, (_, c)| limit.min(c))
        };
        let src_side = |p: &PairSpec| (p.src_entry, p.src_capacity);
        let dst_side = |p: &PairSpec| (p.dst_entry, p.dst_capacity);
        let limits = PoolId::ALL.map(|pool| IndexLimits {
            src: limit(src, pool, src_side),
            dst: limit(dst, pool, dst_side),
        });
        Ok(Self {
            page_pairs,
            emitting,
            state_pairs,
            ring_lanes,
            state_pieces,
            bytes_per_page,
            limits,
            check_dst_overlap: options.check_dst_overlap,
            replicas_send: options.replicas_send,
            pieces,
            blocks,
            heads,
            strategy,
            layouts: (src.clone(), dst.clone()),
        })
    }

    /// Refuses this template for `what` (a planner that gives each state pair one block per
    /// slot) when a state pair moves several byte slices of a slot (a TP channel split
    /// re-sliced between different TP sizes, module `state_split`).
    ///
    /// # Errors
    /// [`PlanError::Geometry`] naming the planner and the number of such pairs.
    pub(crate) fn one_block_per_state_pair(&self, what: &str) -> Result<()> {
        let sliced = self.sliced_state_pairs();
        if sliced == 0 {
            return Ok(());
        }
        Err(PlanError::Geometry {
            what: format!(
                "{what} give each state pair one block per slot, but this template re-slices \
                 {sliced} state pairs into several byte slices (a TP channel split between \
                 different TP sizes): plan its slots with Template::plan or plan_batch"
            ),
        })
    }

    /// State pairs that move several byte slices of a slot (a TP channel split between
    /// different TP sizes) rather than one block.
    pub(crate) fn sliced_state_pairs(&self) -> usize {
        (0..self.state_pairs.len())
            .filter(|&p| self.blocks.state_pair_blocks(p) > 1)
            .count()
    }

    /// The head slicing between the two layouts' TP sizes (`None` when either does not publish
    /// its attention geometry).
    pub fn head_slicing(&self) -> Option<&HeadSlicing> {
        self.heads.as_ref()
    }

    /// Why this template moves no page bytes although it pairs entries (a prefill rank that
    /// holds none of the decode rank's heads, or is not the elected sender of replicated
    /// heads, or with `replicas_send` not one of the decode rank's writers); `None` when it
    /// moves pages or has no page pairs.
    pub fn empty_reason(&self) -> Option<String> {
        if self.page_pairs.is_empty() {
            return None;
        }
        self.heads
            .as_ref()
            .and_then(HeadSlicing::empty_reason)
            .or_else(|| {
                let tokens = self.strategy.tokens().ok()?;
                tokens.empty_reason.clone()
            })
    }

    /// Emission units in block order: group-major, then fragment.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// What every group and pair of this template's plans holds: groups, per-pair and
    /// per-group block offsets and bytes.
    pub fn blocks(&self) -> &BlockAccounting {
        &self.blocks
    }

    /// The prefill (source) and decode (destination) layouts.
    pub fn layouts(&self) -> (&Layout, &Layout) {
        (&self.layouts.0, &self.layouts.1)
    }

    /// "layer L, role R" of an entry on one side, for messages.
    pub(crate) fn entry_label(&self, side: Side, entry: usize) -> String {
        let layout = side.pick(&self.layouts.0, &self.layouts.1);
        if entry >= layout.n_entries() {
            return String::new();
        }
        format!(
            "layer {}, role {}",
            layout.layer_label(entry),
            layout.role_label(entry)
        )
    }

    /// Page-entry pairs in planning order (including elided pairs with `item_len == 0`).
    pub fn page_pairs(&self) -> &[PairSpec] {
        &self.page_pairs
    }

    /// State-entry pairs in planning order (ring-state pairs apart, as lanes: [`Template::ring_lanes`]).
    pub fn state_pairs(&self) -> &[PairSpec] {
        &self.state_pairs
    }

    /// The ring lanes in planning order: each ring-state pair ([`RingLane::pair`]) with its
    /// walk ([`crate::Walk::Ring`], each side's rows per request slot).
    pub fn ring_lanes(&self) -> &[RingLane] {
        &self.ring_lanes
    }

    /// Page pairs that emit blocks (non-zero item length).
    pub fn emitting_pairs(&self) -> &[PairSpec] {
        &self.emitting
    }

    /// Bytes moved per page index pair (sum of item lengths over emitting pairs).
    pub fn bytes_per_page(&self) -> u64 {
        self.bytes_per_page
    }

    /// Per side, the bound every page index must lie below: the smallest capacity over the
    /// emitting pairs (`u64::MAX` when no pair emits).
    pub fn index_limits(&self) -> IndexLimits {
        self.limits[PoolId::PAGES.index()]
    }

    /// [`Template::index_limits`] of the pages of pool `pool` (a side without that pool: its
    /// request-pages limit).
    pub fn pool_limits(&self, pool: PoolId) -> IndexLimits {
        self.limits[pool.index()]
    }
}

/// Narrows each state pair to the one fragment this rank pair moves (replicated state: the
/// whole item from the elected prefill rank; sharded state: the overlap of the two ranks'
/// shares); a pair that moves nothing gets item length 0, as an elided entry. Addresses stay
/// `base + slot * stride`, with the fragment's offsets folded into the bases.
/// Pairs with a TP channel split are sliced by it instead (module `state_split`).
fn slice_state_pairs(slicing: &HeadSlicing, src: &Layout, pairs: &mut [PairSpec]) {
    let unsplit = |p: &&mut PairSpec| p.item_len > 0 && src.entry(p.src_entry).channels().is_none();
    for pair in pairs.iter_mut().filter(unsplit) {
        // Checked by `check_pairs`: the lengths are equal or in the TP ratio.
        if let Ok(Some(f)) = slicing.state_fragment(pair.item_len, pair.dst_item_len) {
            pair.src_base += f.src_off; // inside the first item, so inside the buffer
            pair.dst_base += f.dst_off;
            (pair.item_len, pair.dst_item_len) = (f.len, f.len);
        } else {
            (pair.item_len, pair.dst_item_len) = (0, 0);
        }
    }
}

// ------------------------------------------------------------------------- per request

impl Template {
    /// Validates a request and returns the size of its plan: the one entry point every plan
    /// goes through, so every block lies inside its entry's registered buffer whatever the
    /// template.
    ///
    /// A page request (`n_tokens` is `None` and the template does not plan by token) takes
    /// equally long index lists, page `src[i]` to page `dst[i]`. A token request (`n_tokens`
    /// given, or [`Template::by_token`]: page sizes or memory orders differ) takes each side's
    /// pages in token order, of any lengths, and moves the first `n_tokens` tokens (default: the
    /// full pages of the shorter side). A slot request moves one state slot per state pair
    /// and, given `n_tokens` (the positions the request has processed), the rows of each
    /// ring-state pair that both sides' rings hold: the last `min(R_p, R_d, n_tokens)`
    /// positions (module `rings`), after the slots' blocks.
    ///
    /// # Errors
    /// Unequal lengths (page request), too few pages for `n_tokens` (token request), a
    /// negative index, an index outside any paired buffer, a repeated destination index (when
    /// the template checks overlap), the template's token error, `n_tokens` on a slot request
    /// of a template without ring-state pairs, a slot whose ring lies past its buffer, or
    /// overflow of the totals.
    pub fn prepare<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
    ) -> Result<PlanSummary> {
        self.admit(Planner::Plan, request)?;
        if let Some((src, dst)) = request.state_slot {
            return self.prepare_with_state(request, (src, dst));
        }
        let (src, dst) = match request.indices {
            Indices::Slot { src, dst } => {
                // Not a planner's limit: a slot holds no tokens to skip.
                request.refuse_delta("a state slot request")?;
                return self.prepare_slot(src, dst, request.n_tokens, true);
            }
            Indices::Pages { src, dst } => (src, dst),
        };
        // A delta request is planned by token: its first token may fall inside a page.
        if self.strategy.by_token() || request.n_tokens.is_some() || request.skip_tokens > 0 {
            let shape = self.prepare_tokens(request, (src, dst))?;
            return Ok(PlanSummary {
                n_blocks: shape.n_blocks,
                total_bytes: shape.total_bytes,
                unit: PlanUnit::Tokens(shape),
                state: None,
            });
        }
        // A page plan's layouts keep no windows (windows make a token template), so no side
        // has a window pool for window pages to index: refused, not ignored.
        if let Some(k) = request.pool_tokens.iter().position(Option::is_some) {
            return Err(PlanError::Geometry {
                what: format!(
                    "pool_tokens gave pool {k} a token range, but neither side's layout keeps \
                     a pool {k}"
                ),
            });
        }
        for pool in &PoolId::ALL[1..] {
            let lists = request.pool_lists(*pool);
            for (side, given) in [
                (Side::Src, lists.0.is_some()),
                (Side::Dst, lists.1.is_some()),
            ] {
                if given {
                    return Err(PlanError::Geometry {
                        what: pages_without_pool(side, *pool),
                    });
                }
            }
        }
        // Runs that descend on both sides are one run too (see the `runs` module).
        let found = scan_runs(src, dst, RunRule::EitherDirection)?;
        if found.n_pages > 0 {
            // One comparison per side covers every pair: the limits are the smallest capacities.
            let limits = self.index_limits();
            if found.max_src >= limits.src {
                return Err(self.out_of_range(Side::Src, PoolId::PAGES, src, 0));
            }
            if found.max_dst >= limits.dst {
                return Err(self.out_of_range(Side::Dst, PoolId::PAGES, dst, 0));
            }
            if self.check_dst_overlap {
                check_unique(dst)?;
            }
        }
        // `let … else` rather than `ok_or`: an error built eagerly would be built and dropped
        // once per request (measurable in a batch of many small requests).
        let Some(n_blocks) = self.blocks.page_blocks(found.n_runs, found.n_pages) else {
            return Err(PlanError::Overflow {
                what: "block count",
            });
        };
        let Some(total_bytes) = (found.n_pages as u64).checked_mul(self.bytes_per_page) else {
            return Err(PlanError::Overflow {
                what: "total bytes",
            });
        };
        Ok(PlanSummary {
            n_blocks,
            total_bytes,
            unit: PlanUnit::Pages(found),
            state: None,
        })
    }

    /// Validates a page request that carries a state slot (`slot`): its page part as a
    /// request of its own, then its state part as the slot request
    /// [`Request::state_part`] (ring positions `n_tokens` when the template has ring-state
    /// pairs); the summary counts both, the state plan as its tail.
    fn prepare_with_state<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        (src, dst): (i64, i64),
    ) -> Result<PlanSummary> {
        if self.state_pairs.is_empty() && self.ring_lanes.is_empty() {
            return Err(PlanError::Geometry {
                what: format!(
                    "the request carries state slot ({src}, {dst}), but this template pairs no \
                     state entries (Layout.with_state adds them): plan its pages without a slot"
                ),
            });
        }
        let head = self.prepare(&request.pages_part())?;
        let rings = !self.ring_lanes.is_empty();
        let n_tokens = request.n_tokens.filter(|_| rings);
        let state = self.prepare_slot(src, dst, n_tokens, true)?;
        let PlanUnit::State(shape) = state.unit else {
            return Err(PlanError::InputChanged);
        };
        let n_blocks = head
            .n_blocks
            .checked_add(state.n_blocks)
            .ok_or(PlanError::Overflow {
                what: "block count",
            })?;
        let total_bytes =
            head.total_bytes
                .checked_add(state.total_bytes)
                .ok_or(PlanError::Overflow {
                    what: "total bytes",
                })?;
        Ok(PlanSummary {
            n_blocks,
            total_bytes,
            unit: head.unit,
            state: Some(StateTail {
                shape,
                n_blocks: state.n_blocks,
                total_bytes: state.total_bytes,
            }),
        })
    }

    /// Validates a slot request: both slots non-negative and inside every moving state pair's
    /// buffer (when `slots`: the plain state pairs' slots move), and, given `n_tokens`
    /// positions, inside every ring pair's buffer (its ring rows move).
    fn prepare_slot(
        &self,
        src: i64,
        dst: i64,
        n_tokens: Option<u64>,
        slots: bool,
    ) -> Result<PlanSummary> {
        if n_tokens.is_some() && self.ring_lanes.is_empty() {
            let rule = "this template has no ring-state pairs (Layout.with_rings marks them)";
            return Err(PlanError::Geometry {
                what: match n_tokens.filter(|_| slots) {
                    Some(n) => format!(
                        "a state slot request takes n_tokens (the positions it has processed) \
                         only for ring-state entries, and {rule}; got n_tokens {n}"
                    ),
                    None => rule.to_string(),
                },
            });
        }
        let (s, d) = crate::model::request::slot_indices(src, dst)?;
        let (mut n_blocks, mut total_bytes) = (0, 0);
        if slots {
            // Elided state entries (item_len 0) move nothing and hold no slots, as page entries.
            for pair in self.state_pairs.iter().filter(|p| p.item_len > 0) {
                if s >= pair.src_capacity {
                    return Err(self.index_error(Side::Src, pair, src, 0));
                }
                if d >= pair.dst_capacity {
                    return Err(self.index_error(Side::Dst, pair, dst, 0));
                }
            }
            // Bounded by the layouts: each item lies inside a buffer whose end fits in u64.
            n_blocks = self.state_pieces.len();
            total_bytes = self.state_pieces.iter().map(|p| p.len).sum();
        }
        let mut shape = StateShape {
            slots,
            ..StateShape::SLOTS
        };
        if let Some(n) = n_tokens {
            for lane in &self.ring_lanes {
                self.check_ring_slot(lane, Side::Src, s)?;
                self.check_ring_slot(lane, Side::Dst, d)?;
            }
            // Counted by arithmetic: a lane's blocks are a few runs or one per live position.
            let (ring_blocks, ring_bytes) = rings::count(&self.ring_lanes, n)?;
            let too_many = || PlanError::OutOfMemory {
                what: "ring plan columns",
                bytes: u128::from(ring_blocks) * 8,
            };
            shape.ring_positions = Some(n);
            shape.ring_blocks = usize::try_from(ring_blocks).map_err(|_| too_many())?;
            n_blocks = n_blocks
                .checked_add(shape.ring_blocks)
                .ok_or_else(too_many)?;
            total_bytes = ring_bytes
                .checked_add(total_bytes)
                .ok_or(PlanError::Overflow { what: "ring bytes" })?;
        }
        Ok(PlanSummary {
            n_blocks,
            total_bytes,
            unit: PlanUnit::State(shape),
            state: None,
        })
    }

    /// The slot's ring (`rows` items from `slot × rows`) lies inside the ring lane's buffer on
    /// `side` (an elided pair holds nothing).
    fn check_ring_slot(&self, lane: &RingLane, side: Side, slot: u64) -> Result<()> {
        if lane.slot_fits(side, slot) {
            return Ok(());
        }
        let (pair, rows) = (lane.pair(), lane.rows());
        let capacity = side.pick(pair.src_capacity, pair.dst_capacity);
        let rows = side.pick(rows.0, rows.1);
        let entry = side.pick(pair.src_entry, pair.dst_entry);
        Err(PlanError::IndexOutOfRange {
            side,
            index: i64::try_from(slot).unwrap_or(i64::MAX),
            position: 0,
            capacity: capacity / rows,
            entry,
            label: self.entry_label(side, entry),
            item_len: pair.item_len,
        })
    }

    /// The ring rows alone of slots `(src_slot, dst_slot)` after `n_positions` positions: the
    /// ring lane of the slot request `Request::slot(src_slot, dst_slot)` with `n_tokens =
    /// n_positions`, without the plain state pairs' slots, one block range per ring pair.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for a template without ring-state pairs,
    /// [`PlanError::NegativeIndex`] for a negative slot, [`PlanError::IndexOutOfRange`] for a
    /// slot whose ring lies past its buffer, [`PlanError::Overflow`],
    /// [`PlanError::OutOfMemory`].
    pub fn plan_ring(&self, src_slot: i64, dst_slot: i64, n_positions: u64) -> Result<Plan> {
        let request = Request {
            n_tokens: Some(n_positions),
            ..Request::slot(src_slot, dst_slot)
        };
        let summary = self.prepare_slot(src_slot, dst_slot, Some(n_positions), false)?;
        self.plan_prepared(&request, summary)
    }

    /// Plans one request (see [`Template::prepare`]) into columns obtained from `make_output`
    /// once the plan size is known.
    ///
    /// Allocates nothing itself. `make_output` receives the validated summary and returns
    /// columns of at least `summary.n_blocks` values each (a pooled buffer, a caller's `out=`
    /// array…).
    ///
    /// # Errors
    /// As [`Template::prepare`], whatever `make_output` returns, [`PlanError::OutputTooSmall`],
    /// or an index that changed between validation and emission (inputs mutated concurrently).
    pub fn plan_into<'o, S: PageIndex, D: PageIndex, O>(
        &self,
        request: &Request<'_, S, D>,
        make_output: impl FnOnce(&PlanSummary) -> Result<O>,
    ) -> Result<(O, PlanSummary)>
    where
        O: AsColumns<'o>,
    {
        let summary = self.prepare(request)?;
        let mut output = make_output(&summary)?;
        self.emit_prepared(request, &summary, output.columns())?;
        Ok((output, summary))
    }

    /// Emits a request that [`Template::prepare`] validated into `out` (at least
    /// `summary.n_blocks` values per column).
    pub(crate) fn emit_prepared<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        summary: &PlanSummary,
        mut out: Columns<'_>,
    ) -> Result<()> {
        if out.capacity() < summary.n_blocks {
            return Err(PlanError::OutputTooSmall {
                have: out.capacity(),
                need: summary.n_blocks,
            });
        }
        if let (Some(tail), Some(_)) = (summary.state, request.state_slot) {
            // The page or token blocks first, then the state plan's (as two plans, one after
            // the other).
            let head = summary.head();
            self.emit_prepared(&request.pages_part(), &head, out.range(0..head.n_blocks))?;
            let state = request
                .state_part(tail.shape.ring_positions.is_some())
                .ok_or(PlanError::InputChanged)?;
            let at = head.n_blocks;
            let tail_out = out.range(at..at + tail.n_blocks);
            return self.emit_prepared(&state, &tail.summary(), tail_out);
        }
        if summary.state.is_some() || request.state_slot.is_some() {
            return Err(PlanError::InputChanged);
        }
        // The unit by reference: a token shape is large, and this runs once per request.
        match (request.indices, &summary.unit) {
            (Indices::Pages { src, dst }, PlanUnit::Pages(found)) => {
                if !self.pieces.is_empty() && found.n_pages > 0 {
                    let runs = self.write_request_runs(src, dst, found, out.reborrow())?;
                    self.expand_runs(runs, found.n_pages, found.descending_runs > 0, out);
                }
            }
            (Indices::Pages { src, dst }, PlanUnit::Tokens(shape)) => {
                let limits = self.limits.map(|l| (l.src, l.dst));
                let tokens = self.token_template()?;
                let lists = request_lists(
                    request,
                    (&src[..shape.src_pages], &dst[..shape.dst_pages]),
                    shape.pool_pages.map(|(read, _)| read),
                );
                emit_tokens(tokens, &lists, limits, shape, out)?;
            }
            (Indices::Slot { src, dst }, PlanUnit::State(shape)) => {
                let slots = (src as u64, dst as u64);
                let at = if shape.slots {
                    self.emit_slot(slots, out.reborrow())
                } else {
                    0
                };
                if let Some(n) = shape.ring_positions {
                    rings::emit(&self.ring_lanes, slots, n, &mut out, at);
                }
            }
            (Indices::Slot { .. }, _) | (Indices::Pages { .. }, PlanUnit::State(_)) => {
                return Err(PlanError::InputChanged);
            }
        }
        Ok(())
    }

    /// Emits validated token request `request` (of summary `summary`) as a member of a segment
    /// of fused token requests (see [`crate::kernels::tokens::emit_tokens_joined`]): each
    /// piece's blocks from `cursor`, below `starts`, the classes in `joins` joined to the
    /// previous member's last block.
    ///
    /// # Errors
    /// [`PlanError::InputChanged`] for a request not planned by token or an index that changed.
    pub(crate) fn emit_prepared_joined<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        summary: &PlanSummary,
        joins: u64,
        places: (&mut [usize], &[usize]),
        out: &mut Columns<'_>,
    ) -> Result<()> {
        let (Indices::Pages { src, dst }, PlanUnit::Tokens(shape)) =
            (request.indices, &summary.unit)
        else {
            return Err(PlanError::InputChanged);
        };
        let (Some(src), Some(dst)) = (src.get(..shape.src_pages), dst.get(..shape.dst_pages))
        else {
            return Err(PlanError::InputChanged);
        };
        let limits = self.limits.map(|l| (l.src, l.dst));
        let tokens = self.token_template()?;
        let lists = request_lists(request, (src, dst), shape.pool_pages.map(|(read, _)| read));
        crate::kernels::tokens::emit_tokens_joined(
            tokens, &lists, limits, shape, joins, places, out,
        )
    }

    /// The token classes whose blocks continue from validated token request `prev` into
    /// `next` (see [`crate::kernels::tokens::boundary_merges`]); none for other requests.
    pub(crate) fn token_merges<S: PageIndex, D: PageIndex>(
        &self,
        prev: (&Request<'_, S, D>, &PlanSummary),
        next: (&Request<'_, S, D>, &PlanSummary),
    ) -> u64 {
        let Ok(tokens) = self.token_template() else {
            return 0;
        };
        let (PlanUnit::Tokens(prev_shape), PlanUnit::Tokens(next_shape)) =
            (&prev.1.unit, &next.1.unit)
        else {
            return 0;
        };
        let (Some(prev_lists), Some(next_lists)) = (
            token_lists(prev.0, prev_shape),
            token_lists(next.0, next_shape),
        ) else {
            return 0;
        };
        crate::kernels::tokens::boundary_merges(
            tokens,
            (&prev_lists, prev_shape),
            (&next_lists, next_shape),
        )
    }

    /// Writes a validated page request's runs into the first `found.n_runs` slots of `out`
    /// as `(src page, dst page, pages | DESCENDING)`; returns the run count. Limits are
    /// re-checked per run, and a run count that differs from the validating scan means the
    /// inputs changed meanwhile.
    pub(crate) fn write_request_runs<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        found: &crate::model::runs::RunScan,
        out: Columns<'_>,
    ) -> Result<usize> {
        let expected = found.n_runs;
        if out.capacity() < expected {
            return Err(PlanError::OutputTooSmall {
                have: out.capacity(),
                need: expected,
            });
        }
        let runs = write_runs_by(
            src,
            dst,
            self.index_limits(),
            found.descending_runs > 0,
            [
                &mut out.src_addrs[..expected],
                &mut out.dst_addrs[..expected],
                &mut out.lengths[..expected],
            ],
        )
        .map_err(|err| match err {
            PlanError::OutputTooSmall { .. } => PlanError::InputChanged,
            other => other,
        })?;
        if runs != expected {
            return Err(PlanError::InputChanged);
        }
        Ok(runs)
    }

    /// Expands `runs` runs (of `pages` pages in all) held in the first slots of `out` into the
    /// template's blocks, in place.
    pub(crate) fn expand_runs(
        &self,
        runs: usize,
        pages: usize,
        descending: bool,
        out: Columns<'_>,
    ) {
        if self.blocks.per_page_pieces() == 0 {
            if descending {
                // Per-run pieces only: a descending run is its pages in ascending order.
                out.lengths[..runs]
                    .iter_mut()
                    .for_each(|n| *n &= !crate::model::runs::DESCENDING);
            }
            crate::kernels::emit::expand_runs(&self.pieces, runs, out);
        } else {
            crate::kernels::emit::expand_pieces(&self.pieces, runs, pages, out);
        }
    }

    /// One block per state piece (a moving state pair's whole item, or each byte slice of a
    /// TP-split pair), `(src_base + stride*src, dst_base + stride*dst, len)`: a slot is a
    /// one-page request of each piece (slots validated).
    /// Returns the blocks written.
    fn emit_slot(&self, (s, d): (u64, u64), out: Columns<'_>) -> usize {
        for (k, piece) in self.state_pieces.iter().enumerate() {
            // In bounds, so the layout's base + len check rules out overflow.
            out.src_addrs[k] = piece.src.base + s * piece.src.page_stride;
            out.dst_addrs[k] = piece.dst.base + d * piece.dst.page_stride;
            out.lengths[k] = piece.len;
        }
        self.state_pieces.len()
    }

    /// Allocating convenience: plans one request (see [`Template::prepare`]) into freshly
    /// allocated columns.
    ///
    /// # Errors
    /// As [`Template::plan_into`].
    pub fn plan<S: PageIndex, D: PageIndex>(&self, request: &Request<'_, S, D>) -> Result<Plan> {
        let summary = self.prepare(request)?;
        self.plan_prepared(request, summary)
    }

    /// Emits a request `summary` validated into freshly allocated columns.
    // The summary is consumed here, once per request; a copy of its counts costs less than
    // the planning it describes.
    #[allow(clippy::large_types_passed_by_value)]
    fn plan_prepared<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        summary: PlanSummary,
    ) -> Result<Plan> {
        let mut buffer = FlatBuffer::try_zeroed(summary.n_blocks)?;
        self.emit_prepared(request, &summary, buffer.columns())?;
        let (src_addrs, dst_addrs, lengths) = buffer.into_columns(summary.n_blocks)?;
        Ok(Plan {
            src_addrs,
            dst_addrs,
            lengths,
            n_runs: summary.n_runs(),
            total_bytes: summary.total_bytes,
            pair_offsets: self.pair_offsets(&summary),
        })
    }

    /// `n_pairs + 1` block offsets of a plan of this shape ([`BlockAccounting::pair_offsets`]);
    /// a plan with a state tail lists its page pairs, then its state (and ring) pairs, whose
    /// ranges follow the page blocks.
    pub fn pair_offsets(&self, summary: &PlanSummary) -> Vec<usize> {
        let Some(tail) = summary.state else {
            return self.blocks.pair_offsets(summary);
        };
        let head = summary.head();
        let mut offsets = self.blocks.pair_offsets(&head);
        let at = head.n_blocks;
        let state = self.blocks.pair_offsets(&tail.summary());
        offsets.extend(state.iter().skip(1).map(|o| at + o));
        offsets
    }

    /// Bytes of every pair's block range of a plan of this shape (the ranges of
    /// [`Template::pair_offsets`]): [`BlockAccounting::pair_bytes`] of its page (or token)
    /// pairs, then of its state (and ring) pairs when it has a state tail.
    ///
    /// # Errors
    /// As [`BlockAccounting::pair_bytes`].
    pub fn pair_bytes(&self, summary: &PlanSummary) -> Result<Vec<u64>> {
        let Some(tail) = summary.state else {
            return self.blocks.pair_bytes(summary);
        };
        let mut bytes = self.blocks.pair_bytes(&summary.head())?;
        bytes.extend(self.blocks.pair_bytes(&tail.summary())?);
        Ok(bytes)
    }

    /// Pair ranges of a plan of this shape that are page (or token) pairs: the first ones of
    /// [`Template::pair_offsets`]; a slot request has none, its ranges are all state pairs'.
    pub fn page_pair_ranges(&self, summary: &PlanSummary) -> usize {
        match summary.unit {
            PlanUnit::State(_) => 0,
            _ => self.blocks.pair_groups().len(),
        }
    }

    ///
    /// `values` are pages of `pool` on `side`, the first at position `offset` of its list: only
    /// the pairs whose entries that pool indexes can refuse them, and the position reported is
    /// the one in the caller's list.
    pub(crate) fn out_of_range<T: PageIndex>(
        &self,
        side: Side,
        pool: PoolId,
        values: &[T],
        offset: usize,
    ) -> PlanError {
        let layout = side.pick(&self.layouts.0, &self.layouts.1);
        // A side without the pool indexes its entries by the request's pages.
        let pool = if layout.pool(pool).is_some() {
            pool
        } else {
            PoolId::PAGES
        };
        let indexed = |pair: &&PairSpec| {
            layout
                .entry(side.pick(pair.src_entry, pair.dst_entry))
                .pool()
                == Some(pool)
        };
        // Report the first position that breaks the first pair it does not fit.
        for pair in self.emitting.iter().filter(indexed) {
            let capacity = side.pick(pair.src_capacity, pair.dst_capacity);
            if let Some((position, index)) = values
                .iter()
                .map(|v| v.get())
                .enumerate()
                .find(|&(_, v)| v as u64 >= capacity)
            {
                return self.index_error(side, pair, index, offset + position);
            }
        }
        PlanError::InputChanged
    }

    /// `index` (at `position` of its list) lies outside `pair`'s buffer on `side`.
    fn index_error(&self, side: Side, pair: &PairSpec, index: i64, position: usize) -> PlanError {
        let (capacity, entry) = side.pick(
            (pair.src_capacity, pair.src_entry),
            (pair.dst_capacity, pair.dst_entry),
        );
        PlanError::IndexOutOfRange {
            side,
            index,
            position,
            capacity,
            entry,
            label: self.entry_label(side, entry),
            item_len: pair.item_len,
        }
    }
}

// ------------------------------------------------------------------- token requests, blocks

/// A request shape whose blocks [`Template::count_blocks`] counts without planning it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockRequest {
    /// A page request of `pages` index pairs in `runs` runs contiguous on both sides.
    Pages {
        /// Index pairs.
        pages: usize,
        /// Runs (between 1 and `pages`, 0 for no pages).
        runs: usize,
    },
    /// A token request of `n_tokens` tokens: pages consecutive on both sides, or
    /// (`fragmented`) no two pages consecutive on either side.
    Tokens {
        /// Tokens.
        n_tokens: u64,
        /// No two pages consecutive.
        fragmented: bool,
    },
}

impl Template {
    /// Token pieces, or why this template cannot plan by token.
    ///
    /// # Errors
    /// The reason the pairs' items cannot be cut into tokens.
    pub fn token_template(&self) -> Result<&TokenTemplate> {
        self.strategy.tokens()
    }

    /// What planning on this template asks of any planner, before a request: its sliding
    /// window and whether it plans by token.
    pub fn asked(&self) -> Asked {
        let window = self.strategy.tokens().ok().and_then(|t| t.window);
        Asked {
            window: window.unwrap_or(0),
            page_sizes: self.page_sizes(),
            sliced_state_pairs: self.sliced_state_pairs(),
            ..Asked::default()
        }
        .with(Feature::Window, window.is_some())
        .with(Feature::TokenPlan, self.by_token())
    }

    /// What planning `request` on this template asks of a planner (see [`Template::asked`]).
    pub fn asked_by<S: PageIndex, D: PageIndex>(&self, request: &Request<'_, S, D>) -> Asked {
        let pages = !request.is_slot();
        let given = pages && request.n_tokens.is_some();
        let template = self.asked();
        let sliced = template.sliced_state_pairs > 0;
        Asked {
            skip_tokens: request.skip_tokens,
            n_tokens_given: given && !self.by_token(),
            ring_positions: request.n_tokens.unwrap_or(0),
            state_slot: request.state_slot.unwrap_or_default(),
            ..template
        }
        .with(Feature::Delta, request.skip_tokens > 0)
        .with(Feature::StateSlot, !pages)
        .with(Feature::Ring, !pages && request.n_tokens.is_some())
        .with(Feature::PoolRange, request.has_pool_tokens())
        .with(
            Feature::PagesWithState,
            pages && request.state_slot.is_some(),
        )
        .with(
            // a page request moves no state pair: only a request that carries a slot asks
            Feature::SlicedState,
            (!pages || request.state_slot.is_some()) && sliced,
        )
        .with(
            Feature::TokenPlan,
            given || pages && request.skip_tokens > 0,
        )
    }

    /// The check every planner's entry runs: refuses a request feature `planner` does not
    /// declare in [`crate::rules::capabilities::SUPPORT`].
    ///
    /// # Errors
    /// [`PlanError::Unsupported`] naming the planner and the feature.
    pub fn admit<S: PageIndex, D: PageIndex>(
        &self,
        planner: Planner,
        request: &Request<'_, S, D>,
    ) -> Result<()> {
        crate::rules::capabilities::check(planner, &self.asked_by(request))
    }

    /// Whether every page plan of this template is a token plan: the two layouts have
    /// different tokens per page, or different memory orders ([`needs_tokens`]).
    pub fn by_token(&self) -> bool {
        self.strategy.by_token()
    }

    /// Tokens per page of the source and destination layouts.
    pub fn page_sizes(&self) -> (u64, u64) {
        let (src, dst) = self.layouts();
        (src.context().page_size, dst.context().page_size)
    }

    /// Validates a token request (through [`Template::prepare`]) and returns the size of its
    /// plan. `src` and `dst` are the request's pages in token order on each side (their lengths
    /// may differ); `n_tokens` defaults to the full pages of the shorter side. Only the pages
    /// holding the first `n_tokens` tokens are read (and validated); later ones are ignored.
    ///
    /// # Errors
    /// [`PlanError::TokenCount`] when a side has too few pages; a negative index or one outside
    /// a paired buffer; a repeated destination page (when the template checks overlap); the
    /// template's token error; overflow.
    fn prepare_tokens<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        (src, dst): (&[S], &[D]),
    ) -> Result<TokenShape> {
        let tokens = self.token_template()?;
        let skip_tokens = request.skip_tokens;
        let further = PoolId::ALL.map(|pool| request.pool_lists(pool));
        let (n, read, ranges) = self.validate_delta(
            (src, dst),
            further,
            request.n_tokens,
            skip_tokens,
            request.pool_tokens,
        )?;
        let (src_pages, dst_pages) = read[0];
        let lists = request_lists(request, (&src[..src_pages], &dst[..dst_pages]), read);
        let (class_blocks, n_segments, n_blocks, total_bytes) =
            count_blocks_in(tokens, &lists, &ranges)?;
        let first = tokens.first_pages_in(&ranges);
        let (src_first, dst_first) = first[0];
        let mut pool_pages = [((0, 0), (0, 0)); POOLS];
        for k in 1..POOLS {
            let ((s, d), (sf, df)) = (read[k], first[k]);
            pool_pages[k] = ((s, d), (sf.min(s), df.min(d)));
        }
        Ok(TokenShape {
            n_tokens: n,
            first_token: skip_tokens,
            pool_ranges: ranges,
            first_pages: (src_first.min(src_pages), dst_first.min(dst_pages)),
            src_pages,
            dst_pages,
            pool_pages,
            n_segments,
            class_blocks,
            n_blocks,
            total_bytes,
        })
    }

    /// Validates a token request (as [`Template::prepare`] does) without counting its blocks:
    /// returns the request's global token count and the leading pages of each side that hold
    /// them.
    ///
    /// # Errors
    /// As [`Template::prepare`] for a token request.
    pub(crate) fn validate_tokens<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
    ) -> Result<(u64, usize, usize)> {
        let (n, read, _) = self.validate_delta(
            (src, dst),
            [(None, None); POOLS],
            n_tokens,
            0,
            [None; POOLS],
        )?;
        Ok((n, read[0].0, read[0].1))
    }

    /// [`Template::validate_tokens`] for a request whose first `skip_tokens` tokens are not
    /// moved and whose entries in further pools read that pool's pages: only the pages holding
    /// tokens `skip_tokens..` of the lanes reading a list are read and validated. Returns the
    /// token count and, per pool, the leading pages of each side's list the request reads
    /// (pool 0: its pages).
    ///
    /// # Errors
    /// As [`Template::validate_tokens`]; [`PlanError::SkipTokens`] when `skip_tokens` exceeds
    /// the request's tokens; [`PlanError::Geometry`] when a further pool's pages are missing
    /// for a side that keeps that pool or given for one that does not, or a pool's own token
    /// range (`pool_tokens`, `(n_tokens, skip_tokens)` per further pool) is given for a pool no
    /// side keeps or skips past its tokens. Also returns each pool's range `(first, n)`.
    #[allow(clippy::type_complexity)]
    fn validate_delta<S: PageIndex, D: PageIndex>(
        &self,
        (src, dst): (&[S], &[D]),
        further: [PoolLists<'_, S, D>; POOLS],
        n_tokens: Option<u64>,
        skip_tokens: u64,
        pool_tokens: [Option<(u64, u64)>; POOLS],
    ) -> Result<(u64, [(usize, usize); POOLS], PoolRanges)> {
        let tokens = self.token_template()?;
        let maps = tokens.maps();
        let (src_layout, dst_layout) = self.layouts();
        // Each side's pool of each id (`None`: that side keeps no such pool).
        let pool_of = |layout: &Layout, id: PoolId| layout.pool(id).copied();
        for pool in &PoolId::ALL[1..] {
            let lists = further[pool.index()];
            for (side, layout, given) in [
                (Side::Src, src_layout, lists.0.is_some()),
                (Side::Dst, dst_layout, lists.1.is_some()),
            ] {
                let what = match (pool_of(layout, *pool), given) {
                    (Some(kept), false) => pages_missing(side, layout, kept),
                    (None, true) => pages_without_pool(side, *pool),
                    _ => continue,
                };
                return Err(PlanError::Geometry { what });
            }
        }
        let full = |pages: usize, size: u64| (pages as u64).checked_mul(size);
        let (src_full, dst_full) = (
            full(src.len(), maps.0.page_size()),
            full(dst.len(), maps.1.page_size()),
        );
        let n = match n_tokens {
            Some(n) => n,
            // A dealt side's pages hold only its share: the request's length is not in them.
            None if tokens.dealt() => {
                return Err(PlanError::Geometry {
                    what: "a decode-context-parallel template needs n_tokens, the request's \
                           global token count (each rank's pages hold only its share)"
                        .into(),
                });
            }
            None => src_full
                .zip(dst_full)
                .map(|(a, b)| a.min(b))
                .ok_or(PlanError::Overflow { what: "tokens" })?,
        };
        let mut ranges: PoolRanges = [(skip_tokens, n); POOLS];
        for pool in &PoolId::ALL[1..] {
            let Some((pool_n, pool_skip)) = pool_tokens[pool.index()] else {
                continue;
            };
            if pool_of(src_layout, *pool).is_none() && pool_of(dst_layout, *pool).is_none() {
                return Err(PlanError::Geometry {
                    what: format!(
                        "pool_tokens gave pool {} a token range, but neither side's layout \
                         keeps a pool {}",
                        pool.0, pool.0
                    ),
                });
            }
            if pool_skip > pool_n {
                return Err(PlanError::Geometry {
                    what: format!(
                        "pool_tokens of pool {}: skip_tokens {pool_skip} is past its \
                         n_tokens {pool_n}",
                        pool.0
                    ),
                });
            }
            ranges[pool.index()] = (pool_skip, pool_n);
        }
        let needed = tokens.list_pages_needed_in(&ranges);
        // Each side's list of each pool, its length and the page size the count is in.
        let given = |pool: PoolId, side: Side| -> usize {
            match (pool.index(), side) {
                (0, Side::Src) => src.len(),
                (0, Side::Dst) => dst.len(),
                (k, Side::Src) => further[k].0.map_or(0, <[S]>::len),
                (k, Side::Dst) => further[k].1.map_or(0, <[D]>::len),
            }
        };
        for pool in PoolId::ALL {
            for (side, layout, map, need) in [
                (Side::Src, src_layout, maps.0, needed[pool.index()].0),
                (Side::Dst, dst_layout, maps.1, needed[pool.index()].1),
            ] {
                let pages = given(pool, side);
                if need > pages as u64 {
                    let n = ranges[pool.index()].1;
                    let page_size = pool_of(layout, pool)
                        .filter(|_| pool != PoolId::PAGES)
                        .map_or(map.page_size(), |p| p.page_size);
                    return Err(PlanError::TokenCount {
                        side,
                        list: if layout.window_pool().is_some_and(|p| p.id == pool) {
                            "window pages"
                        } else {
                            pool_list_name(pool)
                        },
                        n_tokens: n,
                        page_size,
                        needed: need,
                        given: pages,
                    });
                }
            }
        }
        if skip_tokens > n {
            return Err(PlanError::SkipTokens {
                skip_tokens,
                n_tokens: n,
            });
        }
        // At most the given lengths (checked above), so they fit usize.
        let read: [(usize, usize); POOLS] = needed.map(|(s, d)| (s as usize, d as usize));
        if !tokens.pieces.is_empty() {
            // The pages before the one holding the first moved token are not read.
            let range = |pages: usize, first: usize| first.min(pages)..pages;
            let first = tokens.first_pages_in(&ranges);
            for pool in PoolId::ALL {
                let k = pool.index();
                // A pool moving no token reads none of its pages.
                if ranges[k].1 <= ranges[k].0 {
                    continue;
                }
                let limits = self.limits[k];
                let (src_list, dst_list) = if k == 0 {
                    (Some(src), Some(dst))
                } else {
                    further[k]
                };
                if let Some(list) = src_list {
                    let r = range(read[k].0, first[k].0);
                    self.check_pages(Side::Src, pool, list, r, limits.src)?;
                }
                if let Some(list) = dst_list {
                    let r = range(read[k].1, first[k].1);
                    self.check_pages(Side::Dst, pool, list, r.clone(), limits.dst)?;
                    if self.check_dst_overlap {
                        check_unique(&list[r])?;
                    }
                }
            }
        }
        Ok((n, read, ranges))
    }

    /// The first position of `values` below 0 or at/above `limit`, as the error to report.
    /// (`read`: the positions of `list`, a list of pages of `pool`, the request reads.)
    fn check_pages<T: PageIndex>(
        &self,
        side: Side,
        pool: PoolId,
        list: &[T],
        read: std::ops::Range<usize>,
        limit: u64,
    ) -> Result<()> {
        let offset = read.start;
        let values = &list[read];
        if let Some((position, index)) = values
            .iter()
            .map(|v| v.get())
            .enumerate()
            .find(|&(_, v)| v < 0 || v as u64 >= limit)
        {
            if index < 0 {
                return Err(PlanError::NegativeIndex {
                    side,
                    index,
                    position: offset + position,
                });
            }
            return Err(self.out_of_range(side, pool, values, offset));
        }
        Ok(())
    }

    /// Blocks of a request of the given shape without planning it: the one block count for
    /// every request shape.
    ///
    /// # Errors
    /// A page shape on a template that plans by token (its blocks depend on how the pages line
    /// up), a run count impossible for the page count, the template's token error, or
    /// overflow / memory for absurd counts.
    pub fn count_blocks(&self, request: BlockRequest) -> Result<usize> {
        match request {
            BlockRequest::Pages { pages, runs } => {
                if self.strategy.by_token() {
                    let (src, dst) = self.page_sizes();
                    return Err(PlanError::Geometry {
                        what: format!(
                            "this template plans by token (prefill {src}, decode {dst} tokens \
                             per page, or different memory orders): blocks depend on how the \
                             request's pages line up; plan the request and read plan.n_blocks"
                        ),
                    });
                }
                if runs > pages || (runs == 0 && pages > 0) {
                    return Err(PlanError::Geometry {
                        what: format!(
                            "a request of {pages} pages has between {} and {pages} runs, got {runs}",
                            usize::from(pages > 0)
                        ),
                    });
                }
                self.blocks
                    .page_blocks(runs, pages)
                    .ok_or(PlanError::Overflow {
                        what: "block count",
                    })
            }
            BlockRequest::Tokens {
                n_tokens,
                fragmented,
            } => {
                let tokens = self.token_template()?;
                Ok(crate::kernels::tokens::model_counts(tokens, n_tokens, !fragmented)?.2)
            }
        }
    }
}

/// Why pages of pool `pool` given for `side` cannot be used.
fn pages_without_pool(side: Side, pool: PoolId) -> String {
    if pool == PoolId::WINDOW {
        return format!(
            "window pages were given for the {side} side, whose layout has no window pool (nor \
             other pool 1; its window entries, if any, are indexed by the request's pages)"
        );
    }
    format!(
        "pages of pool {} were given for the {side} side, whose layout keeps no pool {}",
        pool.0, pool.0
    )
}

/// Why a request must give `side`'s pages of pool `kept`.
fn pages_missing(side: Side, layout: &Layout, kept: Pool) -> String {
    let window = layout.window_pool().is_some_and(|p| p.id == kept.id);
    if window {
        format!(
            "the window entries of the {side} side keep a pool of their own ({} tokens per \
             page): the request must give that side's window pages",
            kept.page_size
        )
    } else {
        format!(
            "the {side} side keeps pool {} ({} tokens per page, {} per row): the request must \
             give that side's pages of pool {}",
            kept.id.0, kept.page_size, kept.tokens_per_row, kept.id.0
        )
    }
}

/// The name of pool `pool`'s page list in a token-count error.
fn pool_list_name(pool: PoolId) -> &'static str {
    const NAMES: [&str; POOLS] = [
        "pages",
        "pool 1 pages",
        "pool 2 pages",
        "pool 3 pages",
        "pool 4 pages",
        "pool 5 pages",
        "pool 6 pages",
        "pool 7 pages",
    ];
    NAMES[pool.index()]
}

/// The page lists a validated token request of shape `shape` reads (as
/// [`Template::emit_prepared`] reads them); `None` for a slot request.
fn token_lists<'x, S: PageIndex, D: PageIndex>(
    request: &Request<'x, S, D>,
    shape: &TokenShape,
) -> Option<LaneLists<'x, [S], [D]>> {
    let Indices::Pages { src, dst } = request.indices else {
        return None;
    };
    let pages = (
        &src[..shape.src_pages.min(src.len())],
        &dst[..shape.dst_pages.min(dst.len())],
    );
    let read = shape.pool_pages.map(|(read, _)| read);
    Some(request_lists(request, pages, read))
}

/// A request's page lists per pool for its lanes: its pages (the leading ones read), then
/// each further pool's given list cut to the `read` pages (an empty list where not given).
fn request_lists<'x, S: PageIndex, D: PageIndex>(
    request: &Request<'x, S, D>,
    pages: (&'x [S], &'x [D]),
    read: [(usize, usize); POOLS],
) -> LaneLists<'x, [S], [D]> {
    let mut lists = LaneLists::same(pages.0, pages.1);
    for pool in &PoolId::ALL[1..] {
        let k = pool.index();
        let (s, d) = request.pool_lists(*pool);
        lists.pools[k] = (
            s.map_or(&[][..], |w| &w[..read[k].0.min(w.len())]),
            d.map_or(&[][..], |w| &w[..read[k].1.min(w.len())]),
        );
    }
    lists
}

/// Model page lists of each side, per pool (pool 0: its pages; empty for a pool a side does
/// not keep).
pub(crate) struct ModelLists {
    pub(crate) pools: Vec<(Vec<i64>, Vec<i64>)>,
}

/// The page lists a block count without the caller's pages assumes for a token request of
/// `n_tokens` tokens: `0, 1, 2, …` on each side (pages consecutive on both sides), or
/// (`fragmented`) `0, 2, 4, …` (no two pages consecutive), as many as every lane needs.
///
/// # Errors
/// [`PlanError::Overflow`] or [`PlanError::OutOfMemory`] for absurd token counts.
pub(crate) fn model_pages(
    tokens: &TokenTemplate,
    n_tokens: u64,
    fragmented: bool,
) -> Result<ModelLists> {
    let step = if fragmented { 2 } else { 1 };
    let pages = |count: u64| -> Result<Vec<i64>> {
        let n = usize::try_from(count).map_err(|_| PlanError::Overflow { what: "pages" })?;
        if i64::try_from(count.saturating_mul(step as u64)).is_err() {
            return Err(PlanError::Overflow { what: "pages" });
        }
        let mut v = crate::error::try_vec(n, 0i64, "page list")?;
        v.iter_mut().zip(0i64..).for_each(|(x, k)| *x = k * step);
        Ok(v)
    };
    let pools = tokens
        .list_pages_needed(n_tokens)
        .iter()
        .map(|&(src, dst)| Ok((pages(src)?, pages(dst)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(ModelLists { pools })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::layout::LayoutContext;
    use crate::rules::check::check_pairs;
    use crate::rules::pairing::Pairing;

    #[test]
    fn legacy_slicing_is_per_buffer_group() {
        // W-ascend-groups (docs/semantics.md): NPU groups, decode [g0 x4, g1 x4, draft g0, draft g1], prefill stage from layer 2.
        let ctx = LayoutContext::default;
        let roles = |r: &[&str]| r.iter().map(ToString::to_string).collect::<Vec<_>>();
        let parts = |ptrs: Vec<u64>, r: Vec<String>| crate::peer::layout::LayoutParts {
            data_lens: vec![64; ptrs.len()],
            item_lens: vec![8; ptrs.len()],
            data_ptrs: ptrs,
            roles: r,
            ..Default::default()
        };
        let src = Layout::new(
            parts(
                vec![102, 103, 202, 203, 300, 400],
                roles(&["g0", "g0", "g1", "g1", "draft_g0", "draft_g1"]),
            ),
            ctx(),
        )
        .unwrap();
        let dst_roles = roles(&[
            "g0", "g0", "g0", "g0", "g1", "g1", "g1", "g1", "draft_g0", "draft_g1",
        ]);
        let dst = Layout::new(
            parts(
                vec![100, 101, 102, 103, 200, 201, 202, 203, 300, 400],
                dst_roles,
            ),
            ctx(),
        )
        .unwrap();
        let options = TemplateOptions {
            pairing: Pairing::by_layer_id(false, Some(2), None),
            ..TemplateOptions::default()
        };
        let t = Template::new(&src, &dst, options).unwrap();
        let bases: Vec<u64> = t.page_pairs().iter().map(|p| p.dst_base).collect();
        assert_eq!(bases, vec![102, 103, 202, 203, 300, 400]);
        let too_far = TemplateOptions {
            pairing: Pairing::by_layer_id(false, Some(3), None),
            ..TemplateOptions::default()
        };
        assert!(matches!(
            Template::new(&src, &dst, too_far),
            Err(PlanError::LegacySlice { .. })
        ));
    }

    fn role_layout(roles: &[&str], ids: Option<Vec<i64>>) -> Layout {
        let n = roles.len();
        Layout::new(
            crate::peer::layout::LayoutParts {
                data_ptrs: (0..n as u64).map(|i| 1000 * (i + 1)).collect(),
                data_lens: vec![64; n],
                item_lens: vec![8; n],
                layer_ids: ids.map_or_else(Vec::new, |v| v.into_iter().map(Some).collect()),
                roles: roles.iter().map(ToString::to_string).collect(),
                kinds: vec![],
                drafts: vec![],
            },
            LayoutContext::default(),
        )
        .unwrap()
    }

    #[test]
    fn id_less_pairing_never_pairs_different_roles() {
        // Same counts, no ids, roles on both sides: a decode listed K, V per layer against a
        // prefill listed K block then V block pairs K with K and V with V.
        let prefill = role_layout(&["k", "k", "v", "v"], None);
        let decode = role_layout(&["k", "v", "k", "v"], None);
        let t = Template::new(&prefill, &decode, TemplateOptions::default()).unwrap();
        let pairs: Vec<[usize; 2]> = t
            .page_pairs()
            .iter()
            .map(|p| [p.src_entry, p.dst_entry])
            .collect();
        assert_eq!(pairs, vec![[0, 0], [1, 2], [2, 1], [3, 3]]);
        // A draft entry never pairs with a model entry: refused, and check_pairs (what the
        // compatibility report lists) names the same first problem Template raises.
        let prefill = role_layout(&["kv", "kv", "draft"], None);
        let decode = role_layout(&["kv", "kv", "kv"], None);
        let err = Template::new(&prefill, &decode, TemplateOptions::default()).unwrap_err();
        assert!(
            matches!(&err, PlanError::MissingRole { role, src_entry: 2, .. } if role == "draft")
        );
        let checks = check_pairs(&prefill, &decode, TemplateOptions::default());
        assert_eq!(
            checks[..2].iter().map(|c| c.dst_entry).collect::<Vec<_>>(),
            [Some(0), Some(1)]
        );
        assert_eq!(checks[2].problem, Some(err));
    }

    #[test]
    fn incompatible_template_does_linear_pairing_work() {
        // Every source id lacks a partner: check_pairs reports each entry, building each key
        // once (the missing-entry message used to rescan all earlier entries).
        let n = 20_000;
        let roles = vec!["kv"; n];
        let src = role_layout(&roles, Some((0..n as i64).collect()));
        let dst = role_layout(&roles, Some((0..n as i64).map(|i| i + 1_000_000).collect()));
        crate::rules::pairing::KEYS_BUILT.with(|k| k.set(0));
        let checks = check_pairs(&src, &dst, TemplateOptions::default());
        assert_eq!(
            crate::rules::pairing::KEYS_BUILT.with(std::cell::Cell::get),
            2 * n
        );
        assert!(
            checks
                .iter()
                .all(|c| matches!(c.problem, Some(PlanError::MissingLayer { .. })))
        );
    }

    #[test]
    fn size_mismatch_names_layer_role_and_sizes() {
        let src = Layout::mla(
            vec![1000],
            vec![160],
            vec![16],
            Some(vec![7]),
            LayoutContext::default(),
        )
        .unwrap();
        let dst = Layout::mla(
            vec![2000, 3000],
            vec![80, 320],
            vec![8, 32],
            Some(vec![3, 7]),
            LayoutContext::default(),
        )
        .unwrap();
        let err = Template::new(&src, &dst, TemplateOptions::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "item size mismatch for layer 7 role kv: src entry 0 has item_len 16 bytes, dst entry 1 has 32 bytes"
        );
    }
}

#[cfg(test)]
mod request_tests {
    use super::*;
    use crate::peer::layout::{Layout, LayoutContext};
    use crate::peer_pair::template::TemplateOptions;

    fn template(src: &Layout, dst: &Layout) -> Template {
        Template::new(src, dst, TemplateOptions::default()).unwrap()
    }

    #[test]
    fn worked_example_mla_flat_plan() {
        let ctx = LayoutContext::default;
        let src = Layout::mla(vec![1000, 2000], vec![640; 2], vec![64; 2], None, ctx()).unwrap();
        let dst = Layout::mla(vec![5000, 6000], vec![1024; 2], vec![64; 2], None, ctx()).unwrap();
        let plan = template(&src, &dst)
            .plan(&Request::pages(&[0i32, 1, 2, 7], &[10i32, 11, 12, 3]))
            .unwrap();
        assert_eq!(plan.src_addrs, vec![1000, 1448, 2000, 2448]);
        assert_eq!(plan.dst_addrs, vec![5640, 5192, 6640, 6192]);
        assert_eq!(plan.lengths, vec![192, 64, 192, 64]);
        assert_eq!((plan.n_runs, plan.total_bytes), (2, 512));
    }

    #[test]
    fn index_past_capacity_is_rejected_with_values() {
        let ctx = LayoutContext::default;
        let src = Layout::mla(vec![0], vec![64], vec![16], Some(vec![0]), ctx()).unwrap();
        let dst = Layout::mla(vec![0], vec![64], vec![16], Some(vec![0]), ctx()).unwrap();
        let err = template(&src, &dst)
            .plan(&Request::pages(&[0i64, 4], &[0i64, 1]))
            .unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::IndexOutOfRange {
                    side: Side::Src,
                    index: 4,
                    position: 1,
                    capacity: 4,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn elided_state_entries_emit_nothing_and_hold_no_slots() {
        // Found by the Python fuzz run: an item_len-0 state entry (capacity 0) made every
        // slot out of range, while page entries with item_len 0 are simply skipped.
        let ctx = LayoutContext::default;
        let empty = || Layout::mla(vec![], vec![], vec![], None, ctx()).unwrap();
        let src = empty()
            .with_state(
                "conv",
                vec![1000, 2000],
                vec![0, 160],
                vec![0, 16],
                vec![0, 1],
            )
            .unwrap();
        let dst = empty()
            .with_state(
                "conv",
                vec![5000, 6000],
                vec![0, 160],
                vec![0, 16],
                vec![0, 1],
            )
            .unwrap();
        let t = template(&src, &dst);
        let mut buf = FlatBuffer::zeroed(2);
        let n = t
            .plan_into(&Request::slot(3, 4), |_| Ok(buf.columns()))
            .map(|(_, summary)| summary)
            .unwrap()
            .n_blocks;
        assert_eq!(
            buf.into_columns(n).unwrap(),
            (vec![2048], vec![6064], vec![16])
        );
        let mut buf = FlatBuffer::zeroed(2);
        assert!(matches!(
            t.plan_into(&Request::slot(-1, 0), |_| Ok(buf.columns()))
                .map(|(_, summary)| summary),
            Err(PlanError::NegativeIndex { .. })
        ));
    }

    #[test]
    fn an_output_too_large_to_allocate_is_an_error_not_an_abort() {
        for capacity in [usize::MAX, usize::MAX / 3, (isize::MAX as usize) / 8] {
            let err = FlatBuffer::try_zeroed(capacity).unwrap_err();
            assert_eq!(err.class(), crate::error::ErrorClass::Memory, "{err}");
            assert!(err.to_string().starts_with("cannot allocate "), "{err}");
        }
        assert_eq!(
            PlanError::out_of_memory::<u64>("plan output", usize::MAX).to_string(),
            format!(
                "cannot allocate {} bytes for plan output",
                u128::from(u64::MAX) * 8
            )
        );
        assert_eq!(FlatBuffer::try_zeroed(2).unwrap(), FlatBuffer::zeroed(2));
    }

    #[test]
    fn worked_example_mamba_slot_stage1() {
        let ctx = LayoutContext::default;
        let src = Layout::mla(vec![], vec![], vec![], None, ctx())
            .unwrap()
            .with_state("mamba", vec![1000], vec![160], vec![16], vec![7])
            .unwrap();
        let dst = Layout::mla(vec![], vec![], vec![], None, ctx())
            .unwrap()
            .with_state(
                "mamba",
                vec![2000, 3000],
                vec![80, 160],
                vec![8, 16],
                vec![3, 7],
            )
            .unwrap();
        let t = template(&src, &dst);
        let mut buf = FlatBuffer::zeroed(1);
        let n = t
            .plan_into(&Request::slot(2, 3), |_| Ok(buf.columns()))
            .map(|(_, summary)| summary)
            .unwrap()
            .n_blocks;
        assert_eq!((n, buf.data), (1, vec![1032, 3048, 16]));
    }
}
