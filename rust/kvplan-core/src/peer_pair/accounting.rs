//! Block accounting: the blocks and bytes every group and pair of a plan holds, read from the
//! plan's summary alone (before the plan is emitted, or without its columns). This module owns
//! the per-group counts a template derives once; every offset table (per group, per pair) and
//! every byte count per block range comes from here.

use crate::error::{PlanError, Result};
use crate::kernels::rings::RingLane;
use crate::kernels::tokens::TokenTemplate;
use crate::model::pieces::{MAX_LANES, PIECE_CLASSES, Piece, TOKEN_CLASSES, total_len};
use crate::model::plan::{PlanSummary, PlanUnit, StateShape};
use crate::peer_pair::coalesce::EmissionGroup;

/// What a template's plans hold per group and per pair, derived once at build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockAccounting {
    groups: Vec<EmissionGroup>,
    /// The group of each page pair (`None` for elided pairs).
    pair_groups: Vec<Option<usize>>,
    /// Pieces emitting one block per run, and one block per page.
    per_run: usize,
    per_page: usize,
    /// Per group, the bytes its pieces move per page of a page plan.
    page_bytes: Vec<u64>,
    /// Per group, its token pieces of each class (empty when the template cannot plan by
    /// token): what block counts of a token plan are made of.
    token_classes: Vec<[usize; TOKEN_CLASSES]>,
    /// Per group, the bytes its token pieces of each lane move per token.
    token_lane_bytes: Vec<[u64; MAX_LANES]>,
    /// Per state pair, the blocks and bytes it moves per slot (0 bytes: elided or not this
    /// rank pair's, it owns no block; several blocks: the slices of a TP-split slot).
    state_lens: Vec<(usize, u64)>,
    /// The template's ring lanes, whose rows a slot request moves after its slots.
    rings: Vec<RingLane>,
}

impl BlockAccounting {
    /// The accounting of `groups` over `pieces` (page plans), `tokens` (token plans, when the
    /// template can plan by token), the state pairs' item lengths and the ring-state pairs.
    ///
    /// # Errors
    /// [`PlanError::Overflow`] when a group's bytes per page or per token overflow u64.
    pub(crate) fn new(
        groups: Vec<EmissionGroup>,
        pair_groups: Vec<Option<usize>>,
        pieces: &[Piece],
        tokens: Option<&TokenTemplate>,
        (state_lens, rings): (Vec<(usize, u64)>, Vec<RingLane>),
    ) -> Result<Self> {
        let per_run = pieces.iter().filter(|p| p.per_run()).count();
        let page_bytes = groups
            .iter()
            .map(|g| {
                total_len(
                    &pieces[g.first_piece..g.first_piece + g.n_pieces],
                    "group bytes",
                )
            })
            .collect::<Result<_>>()?;
        let (mut token_classes, mut token_lane_bytes) = (Vec::new(), Vec::new());
        if let Some(tokens) = tokens {
            for g in &groups {
                let (start, end) = (
                    tokens.pair_pieces[g.first_pair].0,
                    tokens.pair_pieces[g.last_pair].1,
                );
                let (mut classes, mut lanes) = ([0; TOKEN_CLASSES], [0u64; MAX_LANES]);
                for piece in &tokens.pieces[start..end] {
                    let class = piece.class();
                    classes[class] += 1;
                    let lane = &mut lanes[class / PIECE_CLASSES];
                    *lane = lane.checked_add(piece.len).ok_or(PlanError::Overflow {
                        what: "group bytes",
                    })?;
                }
                token_classes.push(classes);
                token_lane_bytes.push(lanes);
            }
        }
        Ok(Self {
            per_run,
            per_page: pieces.len() - per_run,
            groups,
            pair_groups,
            page_bytes,
            token_classes,
            token_lane_bytes,
            state_lens,
            rings,
        })
    }

    /// Emission groups in block order (one per emitting pair unless pairs were coalesced).
    pub fn groups(&self) -> &[EmissionGroup] {
        &self.groups
    }

    /// The group of each page pair (`None` for an elided pair).
    pub fn pair_groups(&self) -> &[Option<usize>] {
        &self.pair_groups
    }

    /// Pieces of a page plan emitting one block per page (0: only per-run pieces).
    pub(crate) fn per_page_pieces(&self) -> usize {
        self.per_page
    }

    /// Blocks of a page request of `pages` index pairs in `runs` runs (`None` on overflow).
    pub(crate) fn page_blocks(&self, runs: usize, pages: usize) -> Option<usize> {
        self.per_run
            .checked_mul(runs)?
            .checked_add(self.per_page.checked_mul(pages)?)
    }

    /// State pairs that move bytes: the blocks of a slot request.
    pub(crate) fn moving_state_pairs(&self) -> usize {
        self.moving_state().count()
    }

    /// Blocks state pair `pair` moves per slot (several: the slices of a TP-split slot).
    pub(crate) fn state_pair_blocks(&self, pair: usize) -> usize {
        self.state_lens.get(pair).map_or(0, |&(n, _)| n)
    }

    /// `(blocks, bytes)` of each state pair that moves bytes, in order.
    fn moving_state(&self) -> impl Iterator<Item = &(usize, u64)> {
        self.state_lens.iter().filter(|(_, bytes)| *bytes > 0)
    }

    /// The slot groups of a state plan (its moving state pairs, when its slots move), and the
    /// ring pair of each of its later groups (its moving ring pairs, when its rows move).
    fn state_groups(&self, shape: &StateShape) -> (usize, Vec<&RingLane>) {
        let slots = if shape.slots {
            self.moving_state_pairs()
        } else {
            0
        };
        let rings = match shape.ring_positions {
            Some(_) => self.rings.iter().filter(|l| l.moving()).collect(),
            None => Vec::new(),
        };
        (slots, rings)
    }

    /// The block span of a state plan's ring rows and the bytes they move (`None`: no ring
    /// rows): they follow the slots' blocks.
    pub(crate) fn ring_span(&self, summary: &PlanSummary) -> Option<(usize, usize, u64)> {
        let PlanUnit::State(shape) = summary.unit else {
            return None;
        };
        let n = shape.ring_positions?;
        let (slots, rings) = self.state_groups(&shape);
        let bytes = rings.iter().map(|ring| ring.bytes(n).unwrap_or(0)).sum();
        Some((slots, slots + shape.ring_blocks, bytes))
    }

    /// Blocks group `group` holds in a plan of this shape: one function for page, token and
    /// state plans (a state plan's groups are its moving state pairs, one block each or one per slice of a TP-split slot, then
    /// its moving ring pairs).
    pub fn group_blocks(&self, group: usize, summary: &PlanSummary) -> usize {
        match &summary.unit {
            PlanUnit::State(shape) => {
                let (slots, rings) = self.state_groups(shape);
                match (group.checked_sub(slots), shape.ring_positions) {
                    (None, _) => self.moving_state().nth(group).map_or(0, |&(n, _)| n),
                    (Some(r), Some(n)) => rings.get(r).map_or(0, |ring| ring.blocks(n) as usize),
                    (Some(_), None) => 0,
                }
            }
            PlanUnit::Tokens(tokens) => self.token_classes.get(group).map_or(0, |classes| {
                classes
                    .iter()
                    .zip(tokens.class_blocks)
                    .map(|(pieces, blocks)| pieces * blocks)
                    .sum()
            }),
            PlanUnit::Pages(found) => self
                .groups
                .get(group)
                .map_or(0, |g| g.n_blocks(found.n_runs, found.n_pages)),
        }
    }

    /// Bytes group `group` moves in a plan of this shape: the twin of
    /// [`BlockAccounting::group_blocks`], so a request's bytes per block range are known before
    /// it is planned (a staged plan's layout and its counts for the advice).
    ///
    /// # Errors
    /// [`PlanError::Overflow`].
    pub fn group_bytes(&self, group: usize, summary: &PlanSummary) -> Result<u64> {
        let overflow = || PlanError::Overflow {
            what: "group bytes",
        };
        match &summary.unit {
            PlanUnit::State(shape) => {
                let (slots, rings) = self.state_groups(shape);
                match (group.checked_sub(slots), shape.ring_positions) {
                    (None, _) => Ok(self.moving_state().nth(group).map_or(0, |&(_, b)| b)),
                    (Some(r), Some(n)) => rings.get(r).map_or(Ok(0), |ring| ring.bytes(n)),
                    (Some(_), None) => Ok(0),
                }
            }
            // A lane's class-0 count is its moved tokens: every piece of the lane moves its
            // length for each of them.
            PlanUnit::Tokens(shape) => self.token_lane_bytes.get(group).map_or(Ok(0), |lanes| {
                lanes
                    .iter()
                    .enumerate()
                    .try_fold(0u64, |sum, (lane, &bytes)| {
                        let moved = shape.class_blocks[lane * PIECE_CLASSES] as u64;
                        bytes
                            .checked_mul(moved)
                            .and_then(|b| b.checked_add(sum))
                            .ok_or_else(overflow)
                    })
            }),
            PlanUnit::Pages(found) => self.page_bytes.get(group).map_or(Ok(0), |&bytes| {
                bytes.checked_mul(found.n_pages as u64).ok_or_else(overflow)
            }),
        }
    }

    /// Groups of a plan of this kind (the page groups, or a state plan's moving state pairs).
    pub fn n_groups(&self, summary: &PlanSummary) -> usize {
        match &summary.unit {
            PlanUnit::State(shape) => {
                let (slots, rings) = self.state_groups(shape);
                slots + rings.len()
            }
            _ => self.groups.len(),
        }
    }

    /// `n_groups + 1` block offsets of a plan: group `g`'s blocks are `offsets[g]..offsets[g+1]`.
    pub fn group_offsets(&self, summary: &PlanSummary) -> Vec<usize> {
        offsets((0..self.n_groups(summary)).map(|g| self.group_blocks(g, summary)))
    }

    /// The group of each pair of a plan of this kind (`None`: an elided pair, which owns no
    /// blocks): page pairs for page and token plans; for state plans the state pairs (when
    /// its slots move), then the ring-state pairs (when its ring rows move).
    pub fn plan_pair_groups(&self, summary: &PlanSummary) -> Vec<Option<usize>> {
        let PlanUnit::State(shape) = summary.unit else {
            return self.pair_groups.clone();
        };
        let mut next = 0;
        let mut group = |len: u64| {
            (len > 0).then(|| {
                next += 1;
                next - 1
            })
        };
        let slots = self.state_lens.iter().filter(|_| shape.slots);
        let mut out: Vec<Option<usize>> = slots.map(|&(_, bytes)| group(bytes)).collect();
        if shape.ring_positions.is_some() {
            out.extend(self.rings.iter().map(|l| group(l.pair().item_len)));
        }
        out
    }

    /// Whether pair `pair` of group `group` owns the group's blocks: a group's blocks belong to
    /// its last pair (a state pair is a group of its own).
    fn owns(&self, summary: &PlanSummary, pair: usize, group: usize) -> bool {
        matches!(summary.unit, PlanUnit::State(_)) || self.groups[group].last_pair == pair
    }

    /// `n_pairs + 1` block offsets of a plan: pair `p`'s blocks are `offsets[p]..offsets[p+1]`.
    /// A group's blocks belong to its last pair (the others, and elided pairs, own none), so
    /// the ranges partition the plan and submitting pair by pair in order sends a coalesced
    /// group when its last layer is done.
    pub fn pair_offsets(&self, summary: &PlanSummary) -> Vec<usize> {
        let groups = self.plan_pair_groups(summary);
        offsets(groups.iter().enumerate().map(|(p, group)| match *group {
            Some(g) if self.owns(summary, p, g) => self.group_blocks(g, summary),
            _ => 0,
        }))
    }

    /// Bytes of every pair's block range (see [`BlockAccounting::pair_offsets`]) in a plan of
    /// this shape: a group's bytes belong to its last pair, other pairs own none.
    ///
    /// # Errors
    /// As [`BlockAccounting::group_bytes`].
    pub fn pair_bytes(&self, summary: &PlanSummary) -> Result<Vec<u64>> {
        let groups = self.plan_pair_groups(summary);
        groups
            .iter()
            .enumerate()
            .map(|(p, group)| match *group {
                Some(g) if self.owns(summary, p, g) => self.group_bytes(g, summary),
                _ => Ok(0),
            })
            .collect()
    }
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
