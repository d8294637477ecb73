//! A compiled peer pair: entries paired and validated once (module `check`), turned into
//! pieces once (module `pieces`), with the strategy chosen once: a page plan (kernels in
//! `emit`) or a token plan (module `tokens`). Every request goes through [`Template::prepare`].

use crate::check::{
    TemplateOptions, check_pairs_sliced, compose, entry_labels, needs_tokens, pair_fragments,
    pair_spec,
};
use crate::error::{PlanError, Result, Side};
use crate::groups::{LayerGroups, SliceKey, StreamFacts};
use crate::heads::HeadSlicing;
use crate::layout::{EntryKind, Layout};
use crate::pieces::{
    Fragment, Fragments, PIECE_CLASSES, PairSpec, Piece, TOKEN_CLASSES, total_len,
};
use crate::plan::{
    AsColumns, Columns, FlatBuffer, Plan, PlanShape, PlanSummary, PlanUnit, TokenShape,
};
use crate::runs::{IndexLimits, PageIndex, RunRule, check_unique, scan_runs, write_runs_by};
use crate::tokens::{TokenTemplate, count_blocks, emit_tokens};

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

/// Consecutive emitting page pairs whose blocks are emitted together (one pair unless
/// coalesced), with the pieces they emit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// First page pair of the group (index into [`Template::page_pairs`]).
    pub first_pair: usize,
    /// Last page pair of the group; it owns the group's blocks in per-pair offsets.
    pub last_pair: usize,
    /// The group's pieces: `pieces()[first_piece .. first_piece + n_pieces]`.
    pub first_piece: usize,
    /// Number of pieces.
    pub n_pieces: usize,
    /// Pieces emitting one block per run.
    pub per_run: usize,
    /// Pieces emitting one block per page.
    pub per_page: usize,
}

impl Group {
    /// Blocks the group emits for a request of `pages` index pairs in `runs` runs.
    pub fn n_blocks(&self, runs: usize, pages: usize) -> usize {
        self.per_run * runs + self.per_page * pages
    }
}

/// Validated entry pairs for one (prefill layout, decode layout) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub(crate) page_pairs: Vec<PairSpec>,
    /// Page pairs with a non-zero item length, in order: the ones that emit blocks.
    pub(crate) emitting: Vec<PairSpec>,
    pub(crate) state_pairs: Vec<PairSpec>,
    /// One piece per state pair that moves bytes (a slot is a one-page request), in order.
    pub(crate) state_pieces: Vec<Piece>,
    /// Sum of item lengths over emitting pairs: bytes moved per page index pair.
    pub(crate) bytes_per_page: u64,
    /// Smallest capacity over emitting pairs, per side: every index must lie below it.
    pub(crate) src_limit: u64,
    pub(crate) dst_limit: u64,
    pub(crate) check_dst_overlap: bool,
    /// Emission units in block order (group-major, then fragment).
    pub(crate) pieces: Vec<Piece>,
    /// Pieces emitting one block per run, and one block per page.
    pub(crate) per_run_pieces: usize,
    pub(crate) per_page_pieces: usize,
    pub(crate) groups: Vec<Group>,
    /// The group of each page pair (`None` for elided pairs).
    pub(crate) pair_groups: Vec<Option<usize>>,
    /// "layer L, role R" per entry of each side, for error messages.
    src_labels: Vec<String>,
    dst_labels: Vec<String>,
    /// Head slicing between different TP sizes, when both layouts publish their geometry.
    heads: Option<HeadSlicing>,
    /// Tokens per page on each side.
    pub(crate) page_sizes: (u64, u64),
    /// Per page pair, its group's token pieces of each class (empty when the template cannot
    /// plan by token): what block offsets of a token plan are made of.
    pub(crate) token_groups: Vec<[usize; TOKEN_CLASSES]>,
    /// How requests are planned, chosen once at build.
    pub(crate) strategy: Strategy,
    /// What layer-wise slicing needs (module `slices`): each page pair's layer id, role and
    /// kind, and both peers' ranks.
    pub(crate) stream: StreamFacts,
    /// Per page pair, the position of its decode entry among the decode layout's page
    /// entries, and their number: the decode staging slots of a staged plan (module `staged`).
    pub(crate) dst_slots: (Vec<usize>, usize),
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
        let spec_of = |kind: EntryKind| -> Vec<PairSpec> {
            checks
                .iter()
                .filter(|c| c.kind == kind)
                .filter_map(|c| c.dst_entry.map(|d| pair_spec(src, dst, c.src_entry, d)))
                .collect()
        };
        let (page_pairs, mut state_pairs) = (spec_of(EntryKind::Page), spec_of(EntryKind::State));
        let stream = StreamFacts::new(src, dst, &page_pairs, &state_pairs);
        let coalesce_keys: Vec<SliceKey> = layer_groups
            .map(|groups| stream.page_tags.iter().map(|t| groups.key(t)).collect())
            .unwrap_or_default();
        let by_token = needs_tokens(src, dst);
        let moves_pages = heads.as_ref().is_none_or(HeadSlicing::moves_pages);
        let emitting: Vec<PairSpec> = page_pairs
            .iter()
            .copied()
            .filter(|p| p.item_len > 0 && moves_pages)
            .collect();
        let labels = (entry_labels(src), entry_labels(dst));
        if let Some(slicing) = &heads {
            slice_state_pairs(slicing, &mut state_pairs);
        }
        // State is not dealt over decode context-parallel ranks: every decode rank receives
        // it, from one source rank (module `dcp`).
        if crate::dcp::dealt_pair(src, dst) && !crate::dcp::sends_undealt(src, dst) {
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
        let given = pair_fragments(&geometry.fragments, &page_pairs, &labels.0)?;
        let (pieces, groups, pair_groups) = if moves_pages {
            build_groups(
                &page_pairs,
                &given,
                &head_fragments,
                geometry.coalesce,
                &coalesce_keys,
                &labels.0,
            )?
        } else {
            (Vec::new(), Vec::new(), vec![None; page_pairs.len()])
        };
        let page_sizes = (src.context().page_size, dst.context().page_size);
        let tokens = TokenTemplate::build(
            src,
            dst,
            &page_pairs,
            &given,
            heads.as_ref(),
            (&labels.0, &labels.1),
        );
        let strategy = match tokens {
            Ok(tokens) if by_token => Strategy::Tokens(tokens),
            Err(problem) if by_token => return Err(problem),
            tokens => Strategy::Pages { tokens },
        };
        let bytes_per_page = total_len(&pieces, "bytes per page")?;
        let per_run_pieces = pieces.iter().filter(|p| p.per_run()).count();
        let token_groups = match strategy.tokens() {
            Ok(tokens) => token_groups(tokens, &groups),
            Err(_) => Vec::new(),
        };
        let state_pieces = state_pairs
            .iter()
            .filter(|p| p.item_len > 0)
            .map(|p| p.piece(p.whole()))
            .collect();
        let (src_limit, dst_limit) = emitting.iter().fold((u64::MAX, u64::MAX), |(s, d), p| {
            (s.min(p.src_capacity), d.min(p.dst_capacity))
        });
        let dst_page_entries = dst.entries_of_kind(EntryKind::Page);
        let mut slot_of = vec![0; dst.n_entries()];
        for (slot, &entry) in dst_page_entries.iter().enumerate() {
            slot_of[entry] = slot;
        }
        let dst_slots = (
            page_pairs.iter().map(|p| slot_of[p.dst_entry]).collect(),
            dst_page_entries.len(),
        );
        Ok(Self {
            dst_slots,
            page_pairs,
            emitting,
            state_pairs,
            state_pieces,
            bytes_per_page,
            src_limit,
            dst_limit,
            check_dst_overlap: options.check_dst_overlap,
            per_run_pieces,
            per_page_pieces: pieces.len() - per_run_pieces,
            pieces,
            groups,
            pair_groups,
            src_labels: labels.0,
            dst_labels: labels.1,
            heads,
            page_sizes,
            token_groups,
            strategy,
            stream,
        })
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

    /// Emission groups in block order (one per emitting pair unless pairs were coalesced).
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// The group of each page pair (`None` for an elided pair).
    pub fn pair_groups(&self) -> &[Option<usize>] {
        &self.pair_groups
    }

    /// Blocks of a request of `pages` index pairs in `runs` runs (`None` on overflow).
    pub fn n_blocks(&self, runs: usize, pages: usize) -> Option<usize> {
        self.per_run_pieces
            .checked_mul(runs)?
            .checked_add(self.per_page_pieces.checked_mul(pages)?)
    }

    /// "layer L, role R" of an entry on one side, for messages.
    pub(crate) fn entry_label(&self, side: Side, entry: usize) -> String {
        side.pick(&self.src_labels, &self.dst_labels)
            .get(entry)
            .cloned()
            .unwrap_or_default()
    }

    /// Page-entry pairs in planning order (including elided pairs with `item_len == 0`).
    pub fn page_pairs(&self) -> &[PairSpec] {
        &self.page_pairs
    }

    /// State-entry pairs in planning order.
    pub fn state_pairs(&self) -> &[PairSpec] {
        &self.state_pairs
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
        IndexLimits {
            src: self.src_limit,
            dst: self.dst_limit,
        }
    }
}

/// Pieces, groups and each page pair's group. Without fragments, a pair continues the group of
/// the emitting pair before it when both are whole-item transfers whose items touch on both
/// sides (`base = previous base + previous item`, equal strides) and the group still fits in
/// one stride on each side; a pair with fragments is a group of its own, one piece per fragment.
/// With `coalesce_keys` (one per page pair), only pairs of equal keys join (layer-group edges).
#[allow(clippy::type_complexity)]
fn build_groups(
    page_pairs: &[PairSpec],
    given: &[Option<Vec<Fragment>>],
    head_fragments: &Fragments,
    coalesce: bool,
    coalesce_keys: &[SliceKey],
    src_labels: &[String],
) -> Result<(Vec<Piece>, Vec<Group>, Vec<Option<usize>>)> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut groups: Vec<Group> = Vec::new();
    let mut pair_groups = vec![None; page_pairs.len()];
    // Whether the last group is whole items (fragment-free), so a touching pair may join it.
    let mut open = false;
    for (index, (pair, given)) in page_pairs.iter().zip(given).enumerate() {
        let label = || src_labels.get(pair.src_entry).cloned().unwrap_or_default();
        // Head slicing's fragments, restricted to the caller's where both are given.
        let fragments = match (given, head_fragments.of_pair(index)) {
            (None, None) => None,
            (Some(user), None) => Some(user.clone()),
            (None, Some(heads)) => Some(heads.to_vec()),
            (Some(user), Some(heads)) => {
                let pair_label = || format!("page pair {index} ({})", label());
                Some(compose(user, heads, &pair_label)?)
            }
        };
        if pair.item_len == 0 {
            continue;
        }
        let Some(fragments) = fragments else {
            let whole = pair.piece(pair.whole());
            // Coalesce with the previous group when it is a whole-item group this pair touches.
            if coalesce
                && open
                && let Some(group) = groups.last_mut()
                && let Some(last) = pieces.last_mut()
                && touches(last, &whole)
                && coalesce_keys.get(group.last_pair) == coalesce_keys.get(index)
            {
                last.len += whole.len; // <= the strides (checked by `touches`)
                group.last_pair = index;
                let per_run = usize::from(last.per_run());
                (group.per_run, group.per_page) = (per_run, 1 - per_run);
                pair_groups[index] = Some(groups.len() - 1);
                continue;
            }
            pair_groups[index] = Some(groups.len());
            let per_run = usize::from(whole.per_run());
            groups.push(Group {
                first_pair: index,
                last_pair: index,
                first_piece: pieces.len(),
                n_pieces: 1,
                per_run,
                per_page: 1 - per_run,
            });
            pieces.push(whole);
            open = true;
            continue;
        };
        open = false;
        pair_groups[index] = Some(groups.len());
        let first_piece = pieces.len();
        // Inside the item (checked), so inside the buffer.
        pieces.extend(fragments.iter().map(|&f| pair.piece(f)));
        let per_run = pieces[first_piece..].iter().filter(|p| p.per_run()).count();
        groups.push(Group {
            first_pair: index,
            last_pair: index,
            first_piece,
            n_pieces: fragments.len(),
            per_run,
            per_page: fragments.len() - per_run,
        });
    }
    Ok((pieces, groups, pair_groups))
}

/// Whether `next` (a whole item) starts where `group` (whole items) ends on both sides, with
/// the same strides, and the widened group still fits in one stride on each side (so it never
/// reaches into the next page: packed per-layer buffers, stride = item, never coalesce).
fn touches(group: &Piece, next: &Piece) -> bool {
    let (gs, gd) = (&group.src, &group.dst);
    gs.page_stride == next.src.page_stride
        && gd.page_stride == next.dst.page_stride
        && gs.base.checked_add(group.len) == Some(next.src.base)
        && gd.base.checked_add(group.len) == Some(next.dst.base)
        && group
            .len
            .checked_add(next.len)
            .is_some_and(|w| w <= gs.page_stride && w <= gd.page_stride)
}

/// Per group, its pairs' token pieces of each class.
fn token_groups(tokens: &TokenTemplate, groups: &[Group]) -> Vec<[usize; TOKEN_CLASSES]> {
    groups
        .iter()
        .map(|g| {
            let (start, end) = (
                tokens.pair_pieces[g.first_pair].0,
                tokens.pair_pieces[g.last_pair].1,
            );
            let mut classes = [0; TOKEN_CLASSES];
            for piece in &tokens.pieces[start..end] {
                classes[tokens.class_of(piece)] += 1;
            }
            classes
        })
        .collect()
}

/// Narrows each state pair to the one fragment this rank pair moves (replicated state: the
/// whole item from the elected prefill rank; sharded state: the overlap of the two ranks'
/// shares); a pair that moves nothing gets item length 0, as an elided entry. Addresses stay
/// `base + slot * stride`, with the fragment's offsets folded into the bases.
fn slice_state_pairs(slicing: &HeadSlicing, pairs: &mut [PairSpec]) {
    for pair in pairs.iter_mut().filter(|p| p.item_len > 0) {
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
    /// full pages of the shorter side); see [`Template::prepare_tokens`].
    ///
    /// # Errors
    /// Unequal lengths (page request), too few pages for `n_tokens` (token request), a
    /// negative index, an index outside any paired buffer, a repeated destination index (when
    /// the template checks overlap), the template's token error, or overflow of the totals.
    pub fn prepare<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
    ) -> Result<PlanShape> {
        if self.strategy.by_token() || n_tokens.is_some() {
            let shape = self.prepare_tokens(src, dst, n_tokens)?;
            return Ok(PlanShape {
                n_blocks: shape.n_blocks,
                total_bytes: shape.total_bytes,
                unit: PlanUnit::Tokens(shape),
            });
        }
        // Runs that descend on both sides are one run too (see the `runs` module).
        let found = scan_runs(src, dst, RunRule::EitherDirection)?;
        if found.n_pages > 0 {
            // One comparison per side covers every pair: the limits are the smallest capacities.
            if found.max_src >= self.src_limit {
                return Err(self.out_of_range(Side::Src, src));
            }
            if found.max_dst >= self.dst_limit {
                return Err(self.out_of_range(Side::Dst, dst));
            }
            if self.check_dst_overlap {
                check_unique(dst)?;
            }
        }
        let n_blocks = self
            .n_blocks(found.n_runs, found.n_pages)
            .ok_or(PlanError::Overflow {
                what: "block count",
            })?;
        let total_bytes = (found.n_pages as u64)
            .checked_mul(self.bytes_per_page)
            .ok_or(PlanError::Overflow {
                what: "total bytes",
            })?;
        Ok(PlanShape {
            n_blocks,
            total_bytes,
            unit: PlanUnit::Pages(found),
        })
    }

    /// Plans one request (see [`Template::prepare`]) into columns obtained from `make_output`
    /// once the plan size is known.
    ///
    /// Allocates nothing itself. `make_output` receives the validated shape and returns columns
    /// of at least `shape.n_blocks` values each (a pooled buffer, a caller's `out=` array…).
    ///
    /// # Errors
    /// As [`Template::prepare`], whatever `make_output` returns, [`PlanError::OutputTooSmall`],
    /// or an index that changed between validation and emission (inputs mutated concurrently).
    pub fn plan_into<'o, S: PageIndex, D: PageIndex, O>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
        make_output: impl FnOnce(&PlanShape) -> Result<O>,
    ) -> Result<(O, PlanSummary)>
    where
        O: AsColumns<'o>,
    {
        let shape = self.prepare(src, dst, n_tokens)?;
        let mut output = make_output(&shape)?;
        let out = output.columns();
        if out.capacity() < shape.n_blocks {
            return Err(PlanError::OutputTooSmall {
                have: out.capacity(),
                need: shape.n_blocks,
            });
        }
        let summary = match shape.unit {
            PlanUnit::Pages(found) => self.emit_request(src, dst, &shape, &found, out)?,
            PlanUnit::Tokens(tokens) => {
                let limits = (self.src_limit, self.dst_limit);
                let token_pieces = self.token_template()?;
                let (src, dst) = (&src[..tokens.src_pages], &dst[..tokens.dst_pages]);
                emit_tokens(token_pieces, src, dst, limits, &tokens, out)?;
                shape.summary()
            }
        };
        Ok((output, summary))
    }

    fn emit_request<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        shape: &PlanShape,
        found: &crate::runs::RunScan,
        out: Columns<'_>,
    ) -> Result<PlanSummary> {
        let pieces = &self.pieces;
        let summary = shape.summary();
        if pieces.is_empty() || found.n_pages == 0 {
            return Ok(summary);
        }
        // Runs go into the first slots as page indices; limits are re-checked per run, and a
        // run count that differs from the validating scan means the inputs changed meanwhile.
        let expected = found.n_runs;
        let limits = IndexLimits {
            src: self.src_limit,
            dst: self.dst_limit,
        };
        let runs = write_runs_by(
            src,
            dst,
            limits,
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
        if self.per_page_pieces == 0 {
            if found.descending_runs > 0 {
                // Per-run pieces only: a descending run is its pages in ascending order.
                out.lengths[..runs]
                    .iter_mut()
                    .for_each(|n| *n &= !crate::runs::DESCENDING);
            }
            crate::emit::expand_runs(pieces, runs, out);
        } else {
            crate::emit::expand_pieces(pieces, runs, found.n_pages, out);
        }
        Ok(summary)
    }

    /// Allocating convenience: plans one request (see [`Template::prepare`]) into freshly
    /// allocated columns.
    ///
    /// # Errors
    /// As [`Template::plan_into`].
    pub fn plan<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
    ) -> Result<Plan> {
        let (buffer, summary) = self.plan_into(src, dst, n_tokens, |shape| {
            FlatBuffer::try_zeroed(shape.n_blocks)
        })?;
        let (src_addrs, dst_addrs, lengths) = buffer.into_columns(summary.n_blocks)?;
        Ok(Plan {
            src_addrs,
            dst_addrs,
            lengths,
            n_runs: summary.n_runs,
            total_bytes: summary.total_bytes,
            pair_offsets: self.pair_offsets(&summary),
        })
    }

    /// Plans one per-request state slot: one block per state pair with a non-zero item length,
    /// `(src_base + item_len*src_slot, dst_base + item_len*dst_slot, item_len)`.
    ///
    /// The summary counts the slot as one run (of one index) when any block is written.
    ///
    /// # Errors
    /// A negative slot or one outside a paired buffer's capacity; [`PlanError::OutputTooSmall`].
    pub fn plan_state_into(
        &self,
        src_slot: i64,
        dst_slot: i64,
        out: Columns<'_>,
    ) -> Result<PlanSummary> {
        // Elided state entries (item_len 0) move nothing and hold no slots, as page entries;
        // each moving pair has one piece (a slot is a one-page request of it).
        let pairs = self.state_pairs.iter().filter(|p| p.item_len > 0);
        let n = self.state_pieces.len();
        if out.capacity() < n {
            return Err(PlanError::OutputTooSmall {
                have: out.capacity(),
                need: n,
            });
        }
        for (side, slot) in [(Side::Src, src_slot), (Side::Dst, dst_slot)] {
            if slot < 0 {
                return Err(PlanError::NegativeIndex {
                    side,
                    index: slot,
                    position: 0,
                });
            }
        }
        let (s, d) = (src_slot as u64, dst_slot as u64);
        for (k, (pair, piece)) in pairs.zip(&self.state_pieces).enumerate() {
            if s >= pair.src_capacity {
                return Err(self.index_error(Side::Src, pair, src_slot, 0));
            }
            if d >= pair.dst_capacity {
                return Err(self.index_error(Side::Dst, pair, dst_slot, 0));
            }
            // In bounds, so the layout's base + len check rules out overflow.
            out.src_addrs[k] = piece.src.base + s * piece.src.page_stride;
            out.dst_addrs[k] = piece.dst.base + d * piece.dst.page_stride;
            out.lengths[k] = piece.len;
        }
        // Bounded by the layouts: each item lies inside a buffer whose end fits in u64.
        let total_bytes = self.state_pieces.iter().map(|p| p.len).sum();
        Ok(PlanSummary {
            n_runs: usize::from(n > 0),
            n_blocks: n,
            total_bytes,
            n_pages: 0,
            tokens: None,
            state: true,
        })
    }

    pub(crate) fn out_of_range<T: PageIndex>(&self, side: Side, values: &[T]) -> PlanError {
        // Report the first position that breaks the first pair it does not fit.
        for pair in &self.emitting {
            let capacity = side.pick(pair.src_capacity, pair.dst_capacity);
            if let Some((position, index)) = values
                .iter()
                .map(|v| v.get())
                .enumerate()
                .find(|&(_, v)| v as u64 >= capacity)
            {
                return self.index_error(side, pair, index, position);
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

    /// Whether every page plan of this template is a token plan: the two layouts have
    /// different tokens per page, or different memory orders ([`needs_tokens`]).
    pub fn by_token(&self) -> bool {
        self.strategy.by_token()
    }

    /// Tokens per page of the source and destination layouts.
    pub fn page_sizes(&self) -> (u64, u64) {
        self.page_sizes
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
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
    ) -> Result<TokenShape> {
        let tokens = self.token_template()?;
        let (n, src_pages, dst_pages) = self.validate_tokens(src, dst, n_tokens)?;
        let (src, dst) = (&src[..src_pages], &dst[..dst_pages]);
        let (class_blocks, n_segments, n_blocks, total_bytes) = count_blocks(tokens, src, dst, n)?;
        Ok(TokenShape {
            n_tokens: n,
            src_pages,
            dst_pages,
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
        let tokens = self.token_template()?;
        let maps = tokens.maps;
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
        let (src_pages, dst_pages) = tokens.pages_needed(n);
        for (side, pages, needed, map) in [
            (Side::Src, src.len(), src_pages, maps.0),
            (Side::Dst, dst.len(), dst_pages, maps.1),
        ] {
            if needed > pages as u64 {
                return Err(PlanError::TokenCount {
                    side,
                    n_tokens: n,
                    page_size: map.page_size(),
                    needed,
                    given: pages,
                });
            }
        }
        // At most the given lengths (checked above), so they fit usize.
        let (src_pages, dst_pages) = (src_pages as usize, dst_pages as usize);
        let (src, dst) = (&src[..src_pages], &dst[..dst_pages]);
        if !tokens.pieces.is_empty() && n > 0 {
            self.check_pages(Side::Src, src, self.src_limit)?;
            self.check_pages(Side::Dst, dst, self.dst_limit)?;
            if self.check_dst_overlap {
                check_unique(dst)?;
            }
        }
        Ok((n, src_pages, dst_pages))
    }

    /// The first position of `values` below 0 or at/above `limit`, as the error to report.
    fn check_pages<T: PageIndex>(&self, side: Side, values: &[T], limit: u64) -> Result<()> {
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
                    position,
                });
            }
            return Err(self.out_of_range(side, values));
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
                    let (src, dst) = self.page_sizes;
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
                self.n_blocks(runs, pages).ok_or(PlanError::Overflow {
                    what: "block count",
                })
            }
            BlockRequest::Tokens {
                n_tokens,
                fragmented,
            } => {
                let tokens = self.token_template()?;
                Ok(crate::tokens::model_counts(tokens, n_tokens, !fragmented)?.2)
            }
        }
    }

    /// Blocks of a token request of `n_tokens` tokens without planning it (see
    /// [`BlockRequest::Tokens`]). Returns `(blocks, segments)`.
    ///
    /// # Errors
    /// As [`Template::count_blocks`].
    pub fn token_blocks(&self, n_tokens: u64, fragmented: bool) -> Result<(usize, usize)> {
        self.token_count(n_tokens, fragmented)
    }

    /// `(blocks, segments)` of a token request over consecutive (or, `fragmented`, never
    /// consecutive) pages.
    fn token_count(&self, n_tokens: u64, fragmented: bool) -> Result<(usize, usize)> {
        // Counted over model pages that are never allocated, in time independent of the
        // token count past a few periods of the token placement.
        let tokens = self.token_template()?;
        let (_, segments, blocks, _) = crate::tokens::model_counts(tokens, n_tokens, !fragmented)?;
        Ok((blocks, segments))
    }

    /// Blocks group `group` holds in a plan of this shape: one function for page, token and
    /// state plans (a state plan's groups are its moving state pairs, one block each).
    pub fn group_blocks(&self, group: usize, summary: &PlanSummary) -> usize {
        if summary.state {
            return usize::from(group < self.state_pieces.len());
        }
        if let Some(tokens) = &summary.tokens {
            let classes = self
                .token_groups
                .get(group)
                .map_or(&[0; TOKEN_CLASSES], |c| c);
            return classes
                .iter()
                .zip(tokens.class_blocks)
                .map(|(pieces, blocks)| pieces * blocks)
                .sum();
        }
        self.groups
            .get(group)
            .map_or(0, |g| g.n_blocks(summary.n_runs, summary.n_pages))
    }

    /// Bytes group `group` moves in a plan of this shape: the twin of
    /// [`Template::group_blocks`], so a request's bytes per block range are known before it is
    /// planned (a staged plan's layout and its counts for the advice).
    ///
    /// # Errors
    /// [`PlanError::Overflow`]; the template's token error for a token summary (which only a
    /// template that plans by token has).
    pub fn group_bytes(&self, group: usize, summary: &PlanSummary) -> Result<u64> {
        let overflow = || PlanError::Overflow {
            what: "group bytes",
        };
        if summary.state {
            return Ok(self.state_pieces.get(group).map_or(0, |p| p.len));
        }
        let Some(g) = self.groups.get(group) else {
            return Ok(0);
        };
        if let Some(shape) = &summary.tokens {
            let tokens = self.token_template()?;
            let pieces = &tokens.pieces
                [tokens.pair_pieces[g.first_pair].0..tokens.pair_pieces[g.last_pair].1];
            // A lane's class-0 count is its moved tokens: every piece of the lane moves its
            // length for each of them.
            return pieces.iter().try_fold(0u64, |sum, piece| {
                let lane = tokens.class_of(piece) / PIECE_CLASSES;
                let moved = shape.class_blocks[lane * PIECE_CLASSES] as u64;
                piece
                    .len
                    .checked_mul(moved)
                    .and_then(|b| b.checked_add(sum))
                    .ok_or_else(overflow)
            });
        }
        let pieces = &self.pieces[g.first_piece..g.first_piece + g.n_pieces];
        total_len(pieces, "group bytes")?
            .checked_mul(summary.n_pages as u64)
            .ok_or_else(overflow)
    }

    /// Groups of a plan of this kind (the page groups, or a state plan's moving state pairs).
    pub fn n_groups(&self, summary: &PlanSummary) -> usize {
        if summary.state {
            self.state_pieces.len()
        } else {
            self.groups.len()
        }
    }

    /// `n_groups + 1` block offsets of a plan: group `g`'s blocks are `offsets[g]..offsets[g+1]`.
    pub fn group_offsets(&self, summary: &PlanSummary) -> Vec<usize> {
        offsets((0..self.n_groups(summary)).map(|g| self.group_blocks(g, summary)))
    }

    /// The group of each pair of a plan of this kind (`None`: an elided pair, which owns no
    /// blocks): page pairs for page and token plans, state pairs for state plans.
    pub fn plan_pair_groups(&self, summary: &PlanSummary) -> Vec<Option<usize>> {
        if !summary.state {
            return self.pair_groups.clone();
        }
        let mut next = 0;
        let moving = self.state_pairs.iter().map(|p| {
            (p.item_len > 0).then(|| {
                next += 1;
                next - 1
            })
        });
        moving.collect()
    }

    /// `n_pairs + 1` block offsets of a plan: pair `p`'s blocks are `offsets[p]..offsets[p+1]`.
    /// A group's blocks belong to its last pair (the others, and elided pairs, own none), so
    /// the ranges partition the plan and submitting pair by pair in order sends a coalesced
    /// group when its last layer is done.
    pub fn pair_offsets(&self, summary: &PlanSummary) -> Vec<usize> {
        let groups = self.plan_pair_groups(summary);
        let owns = |p: usize, g: usize| summary.state || self.groups[g].last_pair == p;
        offsets(groups.iter().enumerate().map(|(p, group)| match *group {
            Some(g) if owns(p, g) => self.group_blocks(g, summary),
            _ => 0,
        }))
    }

    /// Bytes of every pair's block range (see [`Template::pair_offsets`]) in a plan of this
    /// shape: a group's bytes belong to its last pair, other pairs own none.
    ///
    /// # Errors
    /// As [`Template::group_bytes`].
    pub fn pair_bytes(&self, summary: &PlanSummary) -> Result<Vec<u64>> {
        let groups = self.plan_pair_groups(summary);
        let owns = |p: usize, g: usize| summary.state || self.groups[g].last_pair == p;
        groups
            .iter()
            .enumerate()
            .map(|(p, group)| match *group {
                Some(g) if owns(p, g) => self.group_bytes(g, summary),
                _ => Ok(0),
            })
            .collect()
    }
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
) -> Result<(Vec<i64>, Vec<i64>)> {
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
    let (src_pages, dst_pages) = tokens.pages_needed(n_tokens);
    Ok((pages(src_pages)?, pages(dst_pages)?))
}

fn offsets(lens: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut out = vec![0];
    let mut at = 0;
    for len in lens {
        at += len;
        out.push(at);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::check_pairs;
    use crate::layout::LayoutContext;
    use crate::pairing::Pairing;

    #[test]
    fn legacy_slicing_is_per_buffer_group() {
        // W-ascend-groups (docs/semantics.md): NPU groups, decode [g0 x4, g1 x4, draft g0, draft g1], prefill stage from layer 2.
        let ctx = LayoutContext::default;
        let roles = |r: &[&str]| r.iter().map(ToString::to_string).collect::<Vec<_>>();
        let parts = |ptrs: Vec<u64>, r: Vec<String>| crate::layout::LayoutParts {
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
            crate::layout::LayoutParts {
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
        crate::pairing::KEYS_BUILT.with(|k| k.set(0));
        let checks = check_pairs(&src, &dst, TemplateOptions::default());
        assert_eq!(crate::pairing::KEYS_BUILT.with(std::cell::Cell::get), 2 * n);
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
    use crate::layout::{Layout, LayoutContext};
    use crate::template::TemplateOptions;

    fn template(src: &Layout, dst: &Layout) -> Template {
        Template::new(src, dst, TemplateOptions::default()).unwrap()
    }

    #[test]
    fn worked_example_mla_flat_plan() {
        let ctx = LayoutContext::default;
        let src = Layout::mla(vec![1000, 2000], vec![640; 2], vec![64; 2], None, ctx()).unwrap();
        let dst = Layout::mla(vec![5000, 6000], vec![1024; 2], vec![64; 2], None, ctx()).unwrap();
        let plan = template(&src, &dst)
            .plan(&[0i32, 1, 2, 7], &[10i32, 11, 12, 3], None)
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
            .plan(&[0i64, 4], &[0i64, 1], None)
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
        let n = t.plan_state_into(3, 4, buf.columns()).unwrap().n_blocks;
        assert_eq!(
            buf.into_columns(n).unwrap(),
            (vec![2048], vec![6064], vec![16])
        );
        let mut buf = FlatBuffer::zeroed(2);
        assert!(matches!(
            t.plan_state_into(-1, 0, buf.columns()),
            Err(PlanError::NegativeIndex { .. })
        ));
    }

    #[test]
    fn an_output_too_large_to_allocate_is_an_error_not_an_abort() {
        for capacity in [usize::MAX, usize::MAX / 3, (isize::MAX as usize) / 8] {
            let err = FlatBuffer::try_zeroed(capacity).unwrap_err();
            assert_eq!(err.class(), crate::ErrorClass::Memory, "{err}");
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
        let n = t.plan_state_into(2, 3, buf.columns()).unwrap().n_blocks;
        assert_eq!((n, buf.data), (1, vec![1032, 3048, 16]));
    }
}
