//! A compiled peer pair: entries paired and validated once, ready for per-request planning.

use std::collections::HashMap;

use crate::emit::Piece;
use crate::error::{PlanError, Result, Side};
use crate::heads::HeadSlicing;
use crate::layout::{EntryKind, Layout, is_mha_role};
use crate::pairing::{EntryMetadata, LegacyKind, Pairing, Partner, legacy_pp_pairs, pair_each};
use crate::plan::{AsColumns, Columns, FlatBuffer, Plan, PlanShape, PlanSummary, PlanUnit};
use crate::runs::{IndexLimits, PageIndex, scan, write_runs};
use crate::tokens::TokenTemplate;

/// Everything planning needs about one source/destination entry pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairSpec {
    /// Index of the source entry in the source layout.
    pub src_entry: usize,
    /// Index of the destination entry in the destination layout.
    pub dst_entry: usize,
    /// Source buffer base address.
    pub src_base: u64,
    /// Destination buffer base address.
    pub dst_base: u64,
    /// Bytes per source item (equal to `dst_item_len` unless heads are re-sliced between
    /// different TP sizes; checked at template time).
    pub item_len: u64,
    /// Bytes per destination item.
    pub dst_item_len: u64,
    /// Items the source buffer holds.
    pub src_capacity: u64,
    /// Items the destination buffer holds.
    pub dst_capacity: u64,
    /// Bytes between consecutive source items.
    pub src_stride: u64,
    /// Bytes between consecutive destination items.
    pub dst_stride: u64,
}

/// Bytes `src_off..src_off+len` of a source item go to `dst_off..dst_off+len` of its
/// destination item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragment {
    /// Offset inside the source item.
    pub src_off: u64,
    /// Offset inside the destination item.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
}

/// Which bytes of each item a template moves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Fragments {
    /// Every item whole (one fragment `(0, 0, item_len)` per pair).
    #[default]
    Whole,
    /// The same fragments for every emitting page pair.
    Every(Vec<Fragment>),
    /// Per page pair in planning order (elided pairs included); `None` = the whole item.
    PerPair(Vec<Option<Vec<Fragment>>>),
}

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

/// How to pair the two layouts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TemplateOptions {
    /// How entries pair (by layer id by default).
    pub pairing: Pairing,
    /// Reject requests that would write one destination item twice.
    pub check_dst_overlap: bool,
}

/// Validated entry pairs for one (prefill layout, decode layout) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub(crate) page_pairs: Vec<PairSpec>,
    /// Page pairs with a non-zero item length, in order: the ones that emit blocks.
    pub(crate) emitting: Vec<PairSpec>,
    pub(crate) state_pairs: Vec<PairSpec>,
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
    /// Whole pages cannot be copied as they are (page sizes or memory orders differ).
    pub(crate) by_token: bool,
    /// Token pieces (module `tokens`), or why the pairs cannot be planned token by token.
    pub(crate) tokens: Result<TokenTemplate>,
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
        let checks = check_pairs(src, dst, options);
        if let Some(problem) = checks.iter().find_map(|c| c.problem.clone()) {
            return Err(problem);
        }
        let spec_of = |kind: EntryKind| -> Vec<PairSpec> {
            checks
                .iter()
                .filter(|c| c.kind == kind)
                .filter_map(|c| c.dst_entry.map(|d| pair_spec(src, dst, c.src_entry, d)))
                .collect()
        };
        let (page_pairs, mut state_pairs) = (spec_of(EntryKind::Page), spec_of(EntryKind::State));
        // The one head-slicing rule for page and token plans alike; checked by `check_pairs`
        // above, so it succeeds here.
        let heads = HeadSlicing::between(src, dst)?;
        let by_token = crate::tokens::needs_tokens(src, dst);
        let moves_pages = heads.as_ref().is_none_or(HeadSlicing::moves_pages);
        let emitting: Vec<PairSpec> = page_pairs
            .iter()
            .copied()
            .filter(|p| p.item_len > 0 && moves_pages)
            .collect();
        let labels = (entry_labels(src), entry_labels(dst));
        let sliced_geometry;
        let page_geometry = match &heads {
            Some(slicing) => {
                if geometry.fragments != Fragments::Whole {
                    return Err(PlanError::Geometry {
                        what: "fragments= cannot be combined with head slicing: both layouts \
                               publish their attention geometry, so kvplan computes the \
                               fragments"
                            .into(),
                    });
                }
                slice_state_pairs(slicing, &mut state_pairs);
                // A by-token template places heads per token (module `tokens`); its page
                // groups only say which pairs' blocks go together.
                sliced_geometry = GeometryOptions {
                    fragments: if by_token {
                        Fragments::Whole
                    } else {
                        slicing.page_fragments()
                    },
                    coalesce: geometry.coalesce,
                };
                &sliced_geometry
            }
            None => geometry,
        };
        let (pieces, groups, pair_groups) = if moves_pages {
            build_groups(&page_pairs, page_geometry, &labels.0)?
        } else {
            (Vec::new(), Vec::new(), vec![None; page_pairs.len()])
        };
        let page_sizes = (src.context().page_size, dst.context().page_size);
        let tokens = TokenTemplate::build(
            src,
            dst,
            &page_pairs,
            &geometry.fragments,
            heads.as_ref(),
            (&labels.0, &labels.1),
        );
        if by_token && let Err(problem) = &tokens {
            return Err(problem.clone());
        }
        let bytes_per_page = pieces
            .iter()
            .try_fold(0u64, |acc, p| acc.checked_add(p.len))
            .ok_or(PlanError::Overflow {
                what: "bytes per page",
            })?;
        let per_run_pieces = pieces.iter().filter(|p| p.per_run()).count();
        let src_limit = emitting
            .iter()
            .map(|p| p.src_capacity)
            .min()
            .unwrap_or(u64::MAX);
        let dst_limit = emitting
            .iter()
            .map(|p| p.dst_capacity)
            .min()
            .unwrap_or(u64::MAX);
        Ok(Self {
            page_pairs,
            emitting,
            state_pairs,
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
            by_token,
            tokens,
        })
    }

    /// The head slicing between the two layouts' TP sizes (`None` when either does not publish
    /// its attention geometry).
    pub fn head_slicing(&self) -> Option<&HeadSlicing> {
        self.heads.as_ref()
    }

    /// Why this template moves no page bytes although it pairs entries (a prefill rank that
    /// holds none of the decode rank's heads, or is not the elected sender of replicated
    /// heads); `None` when it moves pages or has no page pairs.
    pub fn empty_reason(&self) -> Option<String> {
        if self.page_pairs.is_empty() {
            return None;
        }
        self.heads.as_ref().and_then(HeadSlicing::empty_reason)
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

fn entry_labels(layout: &Layout) -> Vec<String> {
    (0..layout.n_entries())
        .map(|i| {
            format!(
                "layer {}, role {}",
                layout.layer_label(i),
                layout.role_label(i)
            )
        })
        .collect()
}

/// The pairing verdict for one source entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryCheck {
    /// Page or state entry.
    pub kind: EntryKind,
    /// Source entry index.
    pub src_entry: usize,
    /// Its destination partner, when pairing found one.
    pub dst_entry: Option<usize>,
    /// Why the entry cannot be transferred (no partner, list-level pairing failure, or a size
    /// mismatch with its partner); `None` when it is fine.
    pub problem: Option<PlanError>,
}

/// Checks every source entry of `src` against `dst`: page entries first, then state entries,
/// each in layout order. [`Template::new`] fails with the first problem of this list, so a
/// compatibility report built from it never disagrees with the template.
pub fn check_pairs(src: &Layout, dst: &Layout, options: TemplateOptions) -> Vec<EntryCheck> {
    let state_options = TemplateOptions {
        pairing: options.pairing.for_state(),
        ..options
    };
    let heads = HeadSlicing::between(src, dst);
    let mut checks = check_kind(src, dst, EntryKind::Page, options, &heads);
    checks.extend(check_kind(
        src,
        dst,
        EntryKind::State,
        state_options,
        &heads,
    ));
    checks
}

fn check_kind(
    src: &Layout,
    dst: &Layout,
    kind: EntryKind,
    options: TemplateOptions,
    heads: &Result<Option<HeadSlicing>>,
) -> Vec<EntryCheck> {
    let src_entries = src.entries_of_kind(kind);
    let dst_entries = dst.entries_of_kind(kind);
    let partners = local_partners(src, dst, &src_entries, &dst_entries, options);
    // Different tokens per page (or memory orders): paired page items differ in size by design
    // (item = page size x token bytes); they must agree per token instead (module `tokens`),
    // unless heads are sliced, where each side's item must be what its own geometry implies
    // (the same check as for page plans).
    let by_token = kind == EntryKind::Page && crate::tokens::needs_tokens(src, dst);
    src_entries
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let partner = match &partners {
                Ok(list) => list[i].clone(),
                // A list-level failure concerns every entry of the kind.
                Err(problem) => Err(problem.clone()),
            };
            match partner {
                Err(problem) => EntryCheck {
                    kind,
                    src_entry: s,
                    dst_entry: None,
                    problem: Some(problem),
                },
                Ok(j) => {
                    let d = dst_entries[j];
                    let (src_item_len, dst_item_len) =
                        (src.parts().item_lens[s], dst.parts().item_lens[d]);
                    let size_mismatch = || PlanError::SizeMismatch {
                        layer: src.layer_label(s),
                        role: src.role_label(s),
                        src_entry: s,
                        dst_entry: d,
                        src_item_len,
                        dst_item_len,
                    };
                    let head_problem = |what: String| PlanError::HeadMismatch {
                        what: format!(
                            "layer {}, role {} (src entry {s}, dst entry {d}): {what}",
                            src.layer_label(s),
                            src.role_label(s)
                        ),
                    };
                    let problem = match (heads, kind) {
                        (Err(problem), EntryKind::Page) => Some(problem.clone()),
                        (Ok(Some(_)), _) if src_item_len == 0 => None,
                        (Ok(Some(slicing)), EntryKind::Page)
                            if !(by_token && slicing.moves_whole_heads()) =>
                        {
                            slicing
                                .check_page_items(src_item_len, dst_item_len)
                                .err()
                                .map(head_problem)
                        }
                        _ if by_token => {
                            crate::tokens::pair_problem(src, dst, &pair_spec(src, dst, s, d))
                        }
                        (Ok(Some(slicing)), EntryKind::State) => slicing
                            .state_fragment(src_item_len, dst_item_len)
                            .err()
                            .map(head_problem),
                        _ => (src_item_len != dst_item_len).then(size_mismatch),
                    };
                    EntryCheck {
                        kind,
                        src_entry: s,
                        dst_entry: Some(d),
                        problem,
                    }
                }
            }
        })
        .collect()
}

/// Partners of one kind's entries, as positions within `dst_entries`.
fn local_partners(
    src: &Layout,
    dst: &Layout,
    src_entries: &[usize],
    dst_entries: &[usize],
    options: TemplateOptions,
) -> Result<Vec<Partner>> {
    let pairing = options.pairing;
    let (src_ids, src_roles) = metadata_of(src, src_entries, pairing);
    let (dst_ids, dst_roles) = metadata_of(dst, dst_entries, pairing);
    let (n_src, n_dst) = (src_entries.len(), dst_entries.len());
    let legacy = src_ids.is_none() && dst_ids.is_none() && n_src != n_dst;
    match pairing.prefill_start_layer() {
        Some(start) if legacy => {
            // Both peers say which buffer group each entry belongs to (k/v, NPU groups g0/g1…,
            // draft): slice each group on its own, as Ascend's per-group slicing does
            // (docs/semantics.md, Ascend).
            let src_drafts: Vec<bool> = src_entries.iter().map(|&i| src.is_draft(i)).collect();
            if let (Some(src_roles), Some(dst_roles)) = (&src_roles, &dst_roles) {
                let partners = slice_per_role(src_roles, &src_drafts, dst_roles, start)?;
                return Ok(partners.into_iter().map(Ok).collect());
            }
            let kind = match pairing.legacy_kind() {
                Some(kind) => kind,
                None => infer_legacy_kind(src_roles.as_deref(), &src_drafts)?,
            };
            let num_draft = src_drafts.iter().filter(|&&d| d).count();
            let decode_layers = dst.context().num_model_layers.map(|x| x as usize);
            let pairs = legacy_pp_pairs(kind, n_src, n_dst, start, num_draft, decode_layers)?;
            Ok(pairs.into_iter().map(|[_, j]| Ok(j)).collect())
        }
        _ => pair_each(
            EntryMetadata {
                layer_ids: src_ids.as_deref(),
                roles: src_roles.as_deref(),
                n_entries: n_src,
            },
            EntryMetadata {
                layer_ids: dst_ids.as_deref(),
                roles: dst_roles.as_deref(),
                n_entries: n_dst,
            },
            pairing.allow_positional_fallback(),
        ),
    }
}

/// Legacy positional slicing within each role: the prefill's entries of role `r` (in order) go to
/// the decode's entries of role `r` starting at `prefill_start_layer`; draft roles go to the last
/// entries of their role (the decode's draft band), as SGLang's draft tail does.
/// `src_drafts` says which source entries are draft entries.
fn positions_by_role(roles: &[String]) -> HashMap<&str, Vec<usize>> {
    let mut by_role: HashMap<&str, Vec<usize>> = HashMap::new();
    for (j, role) in roles.iter().enumerate() {
        by_role.entry(role.as_str()).or_default().push(j);
    }
    by_role
}

fn slice_per_role(
    src_roles: &[String],
    src_drafts: &[bool],
    dst_roles: &[String],
    start: usize,
) -> Result<Vec<usize>> {
    // Positions of each role on both sides, in layout order (linear in the entry counts).
    let (src_by_role, dst_by_role) = (positions_by_role(src_roles), positions_by_role(dst_roles));
    let mut partners = vec![0; src_roles.len()];
    // Roles in order of first appearance, so the first error reported is deterministic.
    for (i, role) in src_roles.iter().enumerate() {
        let src_positions = &src_by_role[role.as_str()];
        if src_positions[0] != i {
            continue; // not this role's first entry: already handled
        }
        let dst_positions = dst_by_role
            .get(role.as_str())
            .map_or(&[][..], Vec::as_slice);
        let wanted = src_positions.len();
        let offset = if src_drafts[i] {
            dst_positions.len().checked_sub(wanted)
        } else {
            start
                .checked_add(wanted)
                .filter(|&end| end <= dst_positions.len())
                .map(|_| start)
        };
        let Some(offset) = offset else {
            return Err(PlanError::LegacySlice {
                reason: format!(
                    "prefill has {wanted} entries of role {role:?} from layer {start}, decode has only {} entries of that role",
                    dst_positions.len()
                ),
            });
        };
        for (k, &i) in src_positions.iter().enumerate() {
            partners[i] = dst_positions[offset + k];
        }
    }
    Ok(partners)
}

/// Pieces, groups and each page pair's group. Without fragments, a pair continues the group of
/// the emitting pair before it when both are whole-item transfers whose items touch on both
/// sides (`base = previous base + previous item`, equal strides) and the group still fits in
/// one stride on each side; a pair with fragments is a group of its own, one piece per fragment.
#[allow(clippy::type_complexity)]
fn build_groups(
    page_pairs: &[PairSpec],
    geometry: &GeometryOptions,
    src_labels: &[String],
) -> Result<(Vec<Piece>, Vec<Group>, Vec<Option<usize>>)> {
    if let Fragments::PerPair(list) = &geometry.fragments
        && list.len() != page_pairs.len()
    {
        return Err(PlanError::Geometry {
            what: format!(
                "fragments give {} per-pair lists but the template has {} page pairs",
                list.len(),
                page_pairs.len()
            ),
        });
    }
    let mut pieces: Vec<Piece> = Vec::new();
    let mut groups: Vec<Group> = Vec::new();
    let mut pair_groups = vec![None; page_pairs.len()];
    // Whether the last group is whole items (fragment-free), so a touching pair may join it.
    let mut open = false;
    for (index, pair) in page_pairs.iter().enumerate() {
        let given = match &geometry.fragments {
            Fragments::Every(list) if pair.item_len > 0 => Some(list),
            Fragments::Whole | Fragments::Every(_) => None,
            Fragments::PerPair(lists) => lists[index].as_ref(),
        };
        let label = || src_labels.get(pair.src_entry).cloned().unwrap_or_default();
        let fragments = match given {
            Some(list) => check_fragments(index, pair, list, &label)?,
            None => None,
        };
        if pair.item_len == 0 {
            continue;
        }
        let Some(fragments) = fragments else {
            let whole = Piece {
                src_base: pair.src_base,
                dst_base: pair.dst_base,
                len: pair.item_len,
                src_stride: pair.src_stride,
                dst_stride: pair.dst_stride,
            };
            // Coalesce with the previous group when it is a whole-item group this pair touches.
            if geometry.coalesce
                && open
                && let Some(group) = groups.last_mut()
                && let Some(last) = pieces.last_mut()
                && touches(last, &whole)
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
        pieces.extend(fragments.iter().map(|f| Piece {
            // Inside the item (checked), so inside the buffer.
            src_base: pair.src_base + f.src_off,
            dst_base: pair.dst_base + f.dst_off,
            len: f.len,
            src_stride: pair.src_stride,
            dst_stride: pair.dst_stride,
        }));
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
    group.src_stride == next.src_stride
        && group.dst_stride == next.dst_stride
        && group.src_base.checked_add(group.len) == Some(next.src_base)
        && group.dst_base.checked_add(group.len) == Some(next.dst_base)
        && group
            .len
            .checked_add(next.len)
            .is_some_and(|w| w <= group.src_stride && w <= group.dst_stride)
}

/// Validates one pair's fragments: non-empty, each of positive length and inside the item on
/// both sides, no two overlapping on the destination. `None` when the list is exactly the
/// whole item (the default, which may coalesce).
fn check_fragments(
    index: usize,
    pair: &PairSpec,
    list: &[Fragment],
    label: &dyn Fn() -> String,
) -> Result<Option<Vec<Fragment>>> {
    let fail = |what: String| PlanError::Geometry {
        what: format!("page pair {index} ({}): {what}", label()),
    };
    if list.is_empty() {
        return Err(fail(
            "an empty fragment list (give None for the whole item)".into(),
        ));
    }
    let (item, dst_item) = (pair.item_len, pair.dst_item_len);
    for (k, f) in list.iter().enumerate() {
        let inside = |off: u64, item: u64| off.checked_add(f.len).is_some_and(|end| end <= item);
        if f.len == 0 {
            return Err(fail(format!(
                "fragment {k} (src_off {}, dst_off {}, len 0) is empty",
                f.src_off, f.dst_off
            )));
        }
        if !inside(f.src_off, item) || !inside(f.dst_off, dst_item) {
            let size = if item == dst_item {
                format!("{item} bytes")
            } else {
                format!("{item} (src) / {dst_item} (dst) bytes")
            };
            return Err(fail(format!(
                "fragment {k} (src_off {}, dst_off {}, len {}) is not inside the item of {size}",
                f.src_off, f.dst_off, f.len
            )));
        }
    }
    let mut by_dst: Vec<(u64, u64, usize)> = list
        .iter()
        .enumerate()
        .map(|(k, f)| (f.dst_off, f.len, k))
        .collect();
    by_dst.sort_unstable();
    for w in by_dst.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            let (a, b) = (w[0].2.min(w[1].2), w[0].2.max(w[1].2));
            return Err(fail(format!(
                "fragments {a} and {b} overlap on the destination (dst bytes {}..{} and {}..{})",
                list[a].dst_off,
                list[a].dst_off + list[a].len,
                list[b].dst_off,
                list[b].dst_off + list[b].len
            )));
        }
    }
    let whole = [Fragment {
        src_off: 0,
        dst_off: 0,
        len: item,
    }];
    Ok((list != whole || item != dst_item).then(|| list.to_vec()))
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

fn pair_spec(src: &Layout, dst: &Layout, s: usize, d: usize) -> PairSpec {
    PairSpec {
        src_entry: s,
        dst_entry: d,
        src_base: src.parts().data_ptrs[s],
        dst_base: dst.parts().data_ptrs[d],
        item_len: src.parts().item_lens[s],
        dst_item_len: dst.parts().item_lens[d],
        src_capacity: src.capacity(s),
        dst_capacity: dst.capacity(d),
        src_stride: src.strides()[s],
        dst_stride: dst.strides()[d],
    }
}

/// Ids and roles of a subset of entries; `None` when the subset does not publish them
/// (layouts guarantee all-or-none within a kind) or when `pairing` ignores its page ids.
fn metadata_of(
    layout: &Layout,
    entries: &[usize],
    pairing: Pairing,
) -> (Option<Vec<i64>>, Option<Vec<String>>) {
    let parts = layout.parts();
    let hide_ids = pairing.ignores_page_ids()
        && entries
            .first()
            .is_some_and(|&i| parts.kinds[i] == EntryKind::Page);
    let ids: Option<Vec<i64>> = if hide_ids {
        None
    } else {
        entries.iter().map(|&i| parts.layer_ids[i]).collect()
    };
    let roles: Vec<String> = entries.iter().map(|&i| parts.roles[i].clone()).collect();
    let roles = (!roles.is_empty() && roles.iter().all(|r| !r.is_empty())).then_some(roles);
    (ids.filter(|ids| !ids.is_empty()), roles)
}

fn infer_legacy_kind(src_roles: Option<&[String]>, src_drafts: &[bool]) -> Result<LegacyKind> {
    match src_roles {
        Some(roles) if roles.iter().any(|r| is_mha_role(r)) => Ok(LegacyKind::Mha),
        Some(roles) if roles.iter().zip(src_drafts).all(|(r, &d)| r == "kv" || d) => {
            Ok(LegacyKind::Mla)
        }
        _ => Err(PlanError::LegacySlice {
            reason: "peers publish no layer ids and their entry counts differ; say whether the layout is \"mla\" or \"mha\" (legacy_kind)".into(),
        }),
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
        if self.by_token || n_tokens.is_some() {
            let shape = self.prepare_tokens(src, dst, n_tokens)?;
            return Ok(PlanShape {
                n_blocks: shape.n_blocks,
                total_bytes: shape.total_bytes,
                unit: PlanUnit::Tokens(shape),
            });
        }
        let found = scan(src, dst)?;
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
            PlanUnit::Tokens(tokens) => self.emit_token_request(src, dst, &tokens, out)?,
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
        if pieces.is_empty() || found.n_pages == 0 {
            return Ok(PlanSummary {
                n_runs: found.n_runs,
                n_blocks: 0,
                total_bytes: shape.total_bytes,
                n_pages: found.n_pages,
                tokens: None,
            });
        }
        // Runs go into the first slots as page indices; limits are re-checked per run, and a
        // run count that differs from the validating scan means the inputs changed meanwhile.
        let expected = found.n_runs;
        let limits = IndexLimits {
            src: self.src_limit,
            dst: self.dst_limit,
        };
        let runs = write_runs(
            src,
            dst,
            limits,
            &mut out.src_addrs[..expected],
            &mut out.dst_addrs[..expected],
            &mut out.lengths[..expected],
        )
        .map_err(|err| match err {
            PlanError::OutputTooSmall { .. } => PlanError::InputChanged,
            other => other,
        })?;
        if runs != expected {
            return Err(PlanError::InputChanged);
        }
        if self.per_page_pieces == 0 {
            crate::emit::expand_runs(pieces, runs, out);
        } else {
            crate::emit::expand_pieces(pieces, runs, found.n_pages, out);
        }
        Ok(PlanSummary {
            n_runs: runs,
            n_blocks: shape.n_blocks,
            total_bytes: shape.total_bytes,
            n_pages: found.n_pages,
            tokens: None,
        })
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
        // Elided state entries (item_len 0) move nothing and hold no slots, as page entries.
        let pairs = || self.state_pairs.iter().filter(|p| p.item_len > 0);
        let n = pairs().count();
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
        for (k, pair) in pairs().enumerate() {
            if s >= pair.src_capacity {
                return Err(self.state_out_of_range(Side::Src, src_slot, pair));
            }
            if d >= pair.dst_capacity {
                return Err(self.state_out_of_range(Side::Dst, dst_slot, pair));
            }
            // In bounds, so the layout's base + len check rules out overflow.
            out.src_addrs[k] = pair.src_base + s * pair.src_stride;
            out.dst_addrs[k] = pair.dst_base + d * pair.dst_stride;
            out.lengths[k] = pair.item_len;
        }
        // Bounded by the layouts: each item lies inside a buffer whose end fits in u64.
        let total_bytes = pairs().map(|p| p.item_len).sum();
        Ok(PlanSummary {
            n_runs: usize::from(n > 0),
            n_blocks: n,
            total_bytes,
            n_pages: 0,
            tokens: None,
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
                let entry = side.pick(pair.src_entry, pair.dst_entry);
                return PlanError::IndexOutOfRange {
                    side,
                    index,
                    position,
                    capacity,
                    entry,
                    label: self.entry_label(side, entry),
                    item_len: pair.item_len,
                };
            }
        }
        PlanError::InputChanged
    }

    fn state_out_of_range(&self, side: Side, slot: i64, pair: &PairSpec) -> PlanError {
        let (capacity, entry) = side.pick(
            (pair.src_capacity, pair.src_entry),
            (pair.dst_capacity, pair.dst_entry),
        );
        PlanError::IndexOutOfRange {
            side,
            index: slot,
            position: 0,
            capacity,
            entry,
            label: self.entry_label(side, entry),
            item_len: pair.item_len,
        }
    }
}

pub(crate) fn check_unique<T: PageIndex>(dst: &[T]) -> Result<()> {
    // Only when the template asks for it: this is the one allocating check (16 bytes per
    // index, so its allocation may fail for a large request).
    let mut seen: Vec<(i64, usize)> = Vec::new();
    seen.try_reserve_exact(dst.len())
        .map_err(|_| PlanError::out_of_memory::<(i64, usize)>("the overlap check", dst.len()))?;
    seen.extend(dst.iter().map(|v| v.get()).zip(0..));
    seen.sort_unstable();
    match seen.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(PlanError::DuplicateDestination {
            index: w[0].0,
            first: w[0].1,
            second: w[1].1,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutContext;

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
