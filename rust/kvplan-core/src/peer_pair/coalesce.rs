//! Coalescing: which consecutive page pairs emit their blocks together. A pair joins the group
//! of the pair before it when both are whole-item transfers whose items touch on both sides;
//! this module alone owns that rule and the [`EmissionGroup`]s it makes.

use crate::error::{Result, Side};
use crate::model::layer_groups::SliceKey;
use crate::model::pieces::{Fragment, Fragments, PairSpec, Piece};
use crate::rules::check::compose;

/// Consecutive emitting page pairs whose blocks are emitted together (one pair unless
/// coalesced), with the pieces they emit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmissionGroup {
    /// First page pair of the group (index into [`crate::Template::page_pairs`]).
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

impl EmissionGroup {
    /// Blocks the group emits for a request of `pages` index pairs in `runs` runs.
    pub fn n_blocks(&self, runs: usize, pages: usize) -> usize {
        self.per_run * runs + self.per_page * pages
    }
}

/// Pieces, groups and each page pair's group. Without fragments, a pair continues the group of
/// the emitting pair before it when both are whole-item transfers whose items touch on both
/// sides (`base = previous base + previous item`, equal strides) and the group still fits in
/// one stride on each side; a pair with fragments is a group of its own, one piece per fragment.
/// With `coalesce_keys` (one per page pair), only pairs of equal keys join (layer-group edges).
#[allow(clippy::type_complexity)]
pub(crate) fn build_emission_groups(
    page_pairs: &[PairSpec],
    given: &[Option<Vec<Fragment>>],
    head_fragments: &Fragments,
    coalesce: bool,
    coalesce_keys: &[SliceKey],
    src_labels: &[String],
) -> Result<(Vec<Piece>, Vec<EmissionGroup>, Vec<Option<usize>>)> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut groups: Vec<EmissionGroup> = Vec::new();
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
            groups.push(EmissionGroup {
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
        groups.push(EmissionGroup {
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

/// Why a whole item does not widen the whole-item group before it (the rule [`build_emission_groups`]
/// applies), on the first side that refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinBlocker {
    /// The two sides' page strides differ on this side.
    Strides(Side),
    /// The item does not start where the group ends on this side (its own buffer).
    Apart(Side),
    /// The widened group would be longer than one page stride on this side (it would reach
    /// into the next page: e.g. per-layer buffers packed back to back, stride = item).
    BeyondStride(Side),
}

/// Why `next` (a whole item) cannot join `group` (whole items): `None` when it starts where
/// `group` ends on both sides, with the same strides, and the widened group still fits in one
/// stride on each side.
pub(crate) fn join_blocker(group: &Piece, next: &Piece) -> Option<JoinBlocker> {
    let sides = [
        (Side::Src, &group.src, &next.src),
        (Side::Dst, &group.dst, &next.dst),
    ];
    for (side, g, n) in sides {
        if g.page_stride != n.page_stride {
            return Some(JoinBlocker::Strides(side));
        }
    }
    for (side, g, n) in sides {
        if g.base.checked_add(group.len) != Some(n.base) {
            return Some(JoinBlocker::Apart(side));
        }
    }
    for (side, g, _) in sides {
        if group
            .len
            .checked_add(next.len)
            .is_none_or(|w| w > g.page_stride)
        {
            return Some(JoinBlocker::BeyondStride(side));
        }
    }
    None
}

/// Whether `next` (a whole item) starts where `group` (whole items) ends on both sides, with
/// the same strides, and the widened group still fits in one stride on each side (so it never
/// reaches into the next page: packed per-layer buffers, stride = item, never coalesce).
fn touches(group: &Piece, next: &Piece) -> bool {
    join_blocker(group, next).is_none()
}
