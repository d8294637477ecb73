//! The ring lanes: the live rows of ring-state pairs between rings of different sizes.
//!
//! A ring-state entry keeps, per request slot, `R` rows (its items): position `p` of a request
//! lives in row `slot × R + p mod R`, so the ring holds the last `R` positions (a compressor's
//! state rows, a speculative decoder's ring). Prefill and decode may keep rings of different
//! sizes (`R_p ≠ R_d`): whole-ring copies would put positions in the wrong rows, so a slot
//! request that has processed `n` positions moves the live positions both rings hold,
//! `n − min(R_p, R_d, n) .. n`, each from its prefill row to its decode row. Consecutive
//! positions are one block while both rows step by one (neither ring wraps) and each side's
//! rows are packed (`stride == item_len`); otherwise a block per position.
//!
//! A ring is a lane like the token template's lanes: a [`RingLane`] is data, a ring-state pair
//! and its walk [`Walk::Ring`], and the live-position rule is that walk's
//! [`Walk::start`] (the rule of a sliding window of `min(R_p, R_d)` tokens). The template holds
//! its ring lanes as a list; `Template::prepare` counts them (by arithmetic, never by walking
//! the positions) and emits them after the request's state slots, into the plan's exactly
//! sized columns, and `Template::plan_ring` is the same slot path without the slots.
//!
//! Why the rows keep their own kernel rather than joining the token kernels (module `tokens`):
//! in the address model of module `pieces` a ring side is a token side whose "page" is one lap
//! of the ring (`R` slots, map `Paged { page_size: R }`) and whose page list repeats the
//! request's slot once per lap, so position `p` lands in row `slot × R + p mod R` and a run
//! is cut where a ring wraps (the next page index is not the previous plus one), as the token
//! kernels cut runs. But the token kernels read a request's page lists by position, and that
//! list would be `n / R` entries long after `n` positions (`n` may be near `u64::MAX`), where
//! the live rows touch at most two laps; a slot request carries no page lists at all. So the
//! lane and its walk are shared data and the rule (which positions move) is the walk's, while
//! the row emission below (where they go, O(1) per run) stays its own kernel.

use crate::error::{PlanError, Result, Side};
use crate::model::pieces::{PairSpec, Walk};
use crate::model::plan::Columns;

/// One ring lane of a template: a ring-state pair and the walk of its live positions, a
/// [`Walk::Ring`] with each side's rows per request slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLane {
    pair: PairSpec,
    walk: Walk,
}

/// One block run of a ring lane: its first position and positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowRun {
    first: u64,
    len: u64,
}

impl RingLane {
    /// The ring lane of `pair`, whose source ring keeps `rows.0` rows per request slot and
    /// destination ring `rows.1`.
    pub(crate) fn new(pair: PairSpec, (src_rows, dst_rows): (u64, u64)) -> Self {
        Self {
            pair,
            walk: Walk::Ring { src_rows, dst_rows },
        }
    }

    /// The ring-state pair.
    pub fn pair(&self) -> &PairSpec {
        &self.pair
    }

    /// Its walk: [`Walk::Ring`].
    pub fn walk(&self) -> Walk {
        self.walk
    }

    /// Each side's rows per request slot.
    pub fn rows(&self) -> (u64, u64) {
        // Built only by `RingLane::new`, whose walk is a ring; (0, 0) would move nothing.
        self.walk.ring_rows().unwrap_or((0, 0))
    }

    /// Whether the lane moves bytes (an elided pair moves none).
    pub(crate) fn moving(&self) -> bool {
        self.pair.item_len > 0
    }

    /// The live positions after `n` positions: `walk.start(0, n) .. n`.
    fn live(&self, n: u64) -> (u64, u64) {
        (self.walk.start(0, n), n)
    }

    /// Blocks the lane emits after `n` positions (none for an elided pair).
    pub(crate) fn blocks(&self, n: u64) -> u64 {
        if !self.moving() {
            return 0;
        }
        if self.packed() {
            self.runs(n).count() as u64
        } else {
            let (first, n) = self.live(n);
            n - first
        }
    }

    /// Bytes the lane moves after `n` positions.
    ///
    /// # Errors
    /// [`PlanError::Overflow`].
    pub(crate) fn bytes(&self, n: u64) -> Result<u64> {
        let (first, n) = self.live(n);
        (n - first)
            .checked_mul(self.pair.item_len)
            .ok_or(PlanError::Overflow { what: "ring bytes" })
    }

    /// Whether the slot's ring (`rows` items from `slot × rows`) on `side` lies inside that
    /// side's buffer (an elided pair holds nothing).
    pub(crate) fn slot_fits(&self, side: Side, slot: u64) -> bool {
        let capacity = side.pick(self.pair.src_capacity, self.pair.dst_capacity);
        let rows = side.pick(self.rows().0, self.rows().1);
        let end = slot.checked_add(1).and_then(|s| s.checked_mul(rows));
        !self.moving() || end.is_some_and(|end| end <= capacity)
    }

    /// Whether consecutive rows are adjacent in memory on both sides, so that positions
    /// between ring wraps form one block.
    fn packed(&self) -> bool {
        self.pair.src_stride == self.pair.item_len && self.pair.dst_stride == self.pair.dst_item_len
    }

    /// The block runs of the lane: its walk's positions, cut where either ring wraps (its
    /// next row is row 0 of the slot) or, on a side whose rows are padded, at every position
    /// (at most three runs on packed rows: the live positions are no more than either ring's
    /// rows, so each ring wraps at most once among them). Each run costs O(1), whatever its
    /// length.
    fn runs(&self, n: u64) -> impl Iterator<Item = RowRun> {
        let (rs, rd) = self.rows();
        let (mut at, n) = self.live(n);
        let packed = self.packed();
        // The first position after `at` where a ring of `rows` rows wraps (`n` past the end).
        let next_wrap = move |at: u64, rows: u64| {
            (at / rows)
                .checked_add(1)
                .and_then(|k| k.checked_mul(rows))
                .map_or(n, |wrap| wrap.min(n))
        };
        std::iter::from_fn(move || {
            if at >= n {
                return None;
            }
            let first = at;
            at = if packed {
                next_wrap(first, rs).min(next_wrap(first, rd))
            } else {
                first + 1
            };
            Some(RowRun {
                first,
                len: at - first,
            })
        })
    }
}

/// Blocks and bytes of every ring lane after `n` positions.
///
/// # Errors
/// [`PlanError::Overflow`].
pub(crate) fn count(lanes: &[RingLane], n: u64) -> Result<(u64, u64)> {
    let mut n_blocks = 0u64;
    let mut total_bytes = 0u64;
    for lane in lanes {
        n_blocks = n_blocks.saturating_add(lane.blocks(n));
        total_bytes = lane
            .bytes(n)?
            .checked_add(total_bytes)
            .ok_or(PlanError::Overflow { what: "ring bytes" })?;
    }
    Ok((n_blocks, total_bytes))
}

/// Writes the ring rows of slots `slots` after `n` positions into `out` from block `at`, lane
/// by lane (slots checked against every lane's buffers, columns sized by [`count`]); returns
/// the block after the last written.
pub(crate) fn emit(
    lanes: &[RingLane],
    slots: (u64, u64),
    n: u64,
    out: &mut Columns<'_>,
    at: usize,
) -> usize {
    let mut k = at;
    for lane in lanes.iter().filter(|l| l.moving()) {
        let (pair, rows) = (&lane.pair, lane.rows());
        for run in lane.runs(n) {
            // Inside the slot's ring (checked), so inside the buffer.
            let row = |slot: u64, r: u64| slot * r + run.first % r;
            out.src_addrs[k] = pair.src_base + row(slots.0, rows.0) * pair.src_stride;
            out.dst_addrs[k] = pair.dst_base + row(slots.1, rows.1) * pair.dst_stride;
            out.lengths[k] = run.len * pair.item_len;
            k += 1;
        }
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(src_stride: u64, dst_stride: u64, rows: (u64, u64)) -> RingLane {
        RingLane::new(pair(src_stride, dst_stride), rows)
    }

    fn pair(src_stride: u64, dst_stride: u64) -> PairSpec {
        PairSpec {
            src_entry: 0,
            dst_entry: 0,
            src_base: 0,
            dst_base: 0,
            item_len: 8,
            dst_item_len: 8,
            src_capacity: u64::MAX,
            dst_capacity: u64::MAX,
            src_stride,
            dst_stride,
        }
    }

    /// The runs as the position-by-position walk cuts them: one position at a time, a new run
    /// where either ring wraps or a side is padded.
    fn walked(pair: &PairSpec, (rs, rd): (u64, u64), n: u64) -> Vec<RowRun> {
        let mut out: Vec<RowRun> = Vec::new();
        for p in n - rs.min(rd).min(n)..n {
            let packed = pair.src_stride == pair.item_len && pair.dst_stride == pair.dst_item_len;
            let cut = !packed || p.is_multiple_of(rs) || p.is_multiple_of(rd);
            match out.last_mut() {
                Some(run) if !cut => run.len += 1,
                _ => out.push(RowRun { first: p, len: 1 }),
            }
        }
        out
    }

    #[test]
    fn runs_match_the_position_walk() {
        for (src_stride, dst_stride) in [(8, 8), (16, 8), (8, 24)] {
            let pair = pair(src_stride, dst_stride);
            for rs in 1..7 {
                for rd in 1..7 {
                    let ring = lane(src_stride, dst_stride, (rs, rd));
                    for n in 0..20 {
                        let got: Vec<RowRun> = ring.runs(n).collect();
                        assert_eq!(got, walked(&pair, (rs, rd), n), "{rs} {rd} {n}");
                        assert_eq!(ring.blocks(n), got.len() as u64);
                    }
                }
            }
        }
    }

    #[test]
    fn huge_rings_cost_by_blocks_not_positions() {
        // 2**36 live positions of packed rings: one or a few blocks, found without visiting
        // each position (a walk took tens of seconds here and never answered for larger).
        let rows = 1u64 << 36;
        let got: Vec<RowRun> = lane(8, 8, (rows, rows)).runs(rows).collect();
        assert_eq!(
            got,
            vec![RowRun {
                first: 0,
                len: rows
            }]
        );
        // Rings of R and R + 1 rows after 3R + 5 positions: R live positions, cut where the
        // first wraps (3R) and where the second does (3R + 3).
        let got: Vec<RowRun> = lane(8, 8, (rows, rows + 1)).runs(3 * rows + 5).collect();
        assert_eq!(
            got,
            vec![
                RowRun {
                    first: 2 * rows + 5,
                    len: rows - 5
                },
                RowRun {
                    first: 3 * rows,
                    len: 3
                },
                RowRun {
                    first: 3 * rows + 3,
                    len: 2
                },
            ]
        );
        // Rows near u64::MAX: the next wrap past the end is the end, not an overflow.
        let n = u64::MAX;
        let got: Vec<RowRun> = lane(8, 8, (n - 1, n)).runs(n).collect();
        assert_eq!(got.iter().map(|r| r.len).sum::<u64>(), n - 1);
        // Padded rows are a block per position: counted, not walked.
        assert_eq!(lane(16, 8, (rows, rows)).blocks(rows), rows);
    }
}
