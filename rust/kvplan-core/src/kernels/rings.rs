//! The ring lane: the live rows of ring-state pairs between rings of different sizes.
//!
//! A ring-state entry keeps, per request slot, `R` rows (its items): position `p` of a request
//! lives in row `slot × R + p mod R`, so the ring holds the last `R` positions (a compressor's
//! state rows, a speculative decoder's ring). Prefill and decode may keep rings of different
//! sizes (`R_p ≠ R_d`): whole-ring copies would put positions in the wrong rows, so a slot
//! request that has processed `n` positions moves the live positions both rings hold,
//! `n − min(R_p, R_d, n) .. n` (the same "last W tokens" rule as a sliding window, over a
//! modular token map), each from its prefill row to its decode row. Consecutive positions are
//! one block while both rows step by one (neither ring wraps) and each side's rows are packed
//! (`stride == item_len`); otherwise a block per position.
//!
//! `Template::prepare` counts these blocks (by arithmetic, never by walking the positions) and
//! emits them after the request's state slots, into the plan's exactly sized columns.

use crate::error::{PlanError, Result};
use crate::model::pieces::PairSpec;
use crate::model::plan::Columns;

/// One ring-state pair with each side's rows per request slot.
pub type RingPair = (PairSpec, (u64, u64));

/// One block run of a ring pair: its first position and positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowRun {
    first: u64,
    len: u64,
}

/// Blocks one ring pair emits after `n` positions (none for an elided pair).
pub(crate) fn pair_blocks((pair, rows): &RingPair, n: u64) -> u64 {
    if pair.item_len == 0 {
        return 0;
    }
    block_count(pair, *rows, n)
}

/// Bytes one ring pair moves after `n` positions.
///
/// # Errors
/// [`PlanError::Overflow`].
pub(crate) fn pair_bytes((pair, rows): &RingPair, n: u64) -> Result<u64> {
    live_positions(*rows, n)
        .checked_mul(pair.item_len)
        .ok_or(PlanError::Overflow { what: "ring bytes" })
}

/// Blocks and bytes of every ring pair after `n` positions.
///
/// # Errors
/// [`PlanError::Overflow`].
pub(crate) fn count(pairs: &[RingPair], n: u64) -> Result<(u64, u64)> {
    let mut n_blocks = 0u64;
    let mut total_bytes = 0u64;
    for ring in pairs {
        n_blocks = n_blocks.saturating_add(pair_blocks(ring, n));
        total_bytes = pair_bytes(ring, n)?
            .checked_add(total_bytes)
            .ok_or(PlanError::Overflow { what: "ring bytes" })?;
    }
    Ok((n_blocks, total_bytes))
}

/// Writes the ring rows of slots `slots` after `n` positions into `out` from block `at`, pair
/// by pair (slots checked against every pair's buffer, columns sized by [`count`]); returns
/// the block after the last written.
pub(crate) fn emit(
    pairs: &[RingPair],
    slots: (u64, u64),
    n: u64,
    out: &mut Columns<'_>,
    at: usize,
) -> usize {
    let mut k = at;
    for (pair, rows) in pairs.iter().filter(|(p, _)| p.item_len > 0) {
        for run in runs(pair, *rows, n) {
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

/// Whether the slot's ring (`rows` items from `slot × rows`) lies inside a buffer of
/// `capacity` items.
pub(crate) fn slot_fits(slot: u64, rows: u64, capacity: u64) -> bool {
    let end = slot.checked_add(1).and_then(|s| s.checked_mul(rows));
    end.is_some_and(|end| end <= capacity)
}

/// Positions both rings hold after `n` positions: `min(R_p, R_d, n)`.
fn live_positions((rs, rd): (u64, u64), n: u64) -> u64 {
    rs.min(rd).min(n)
}

/// Whether consecutive rows are adjacent in memory on both sides, so that positions between
/// ring wraps form one block.
fn packed(pair: &PairSpec) -> bool {
    pair.src_stride == pair.item_len && pair.dst_stride == pair.dst_item_len
}

/// How many blocks [`runs`] yields: one per live position on a padded side, else one per stretch
/// between ring wraps (at most three: the live positions are no more than either ring's rows,
/// so each ring wraps at most once among them).
fn block_count(pair: &PairSpec, rows: (u64, u64), n: u64) -> u64 {
    if packed(pair) {
        runs(pair, rows, n).count() as u64
    } else {
        live_positions(rows, n)
    }
}

/// The block runs of one ring pair: live positions `n − min(R_p, R_d, n) .. n`, cut where
/// either ring wraps (its next row is row 0 of the slot) or, on a side whose rows are padded,
/// at every position. Each run costs O(1), whatever its length.
fn runs(pair: &PairSpec, (rs, rd): (u64, u64), n: u64) -> impl Iterator<Item = RowRun> {
    let live = live_positions((rs, rd), n);
    let packed = packed(pair);
    // The first position after `at` where a ring of `rows` rows wraps (`n` past the end).
    let next_wrap = move |at: u64, rows: u64| {
        (at / rows)
            .checked_add(1)
            .and_then(|k| k.checked_mul(rows))
            .map_or(n, |wrap| wrap.min(n))
    };
    let mut at = n - live;
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

#[cfg(test)]
mod tests {
    use super::*;

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
            let cut = !packed(pair) || p.is_multiple_of(rs) || p.is_multiple_of(rd);
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
                    for n in 0..20 {
                        let got: Vec<RowRun> = runs(&pair, (rs, rd), n).collect();
                        assert_eq!(got, walked(&pair, (rs, rd), n), "{rs} {rd} {n}");
                        assert_eq!(block_count(&pair, (rs, rd), n), got.len() as u64);
                    }
                }
            }
        }
    }

    #[test]
    fn huge_rings_cost_by_blocks_not_positions() {
        // 2**36 live positions of packed rings: one or a few blocks, found without visiting
        // each position (a walk took tens of seconds here and never answered for larger).
        let packed_pair = pair(8, 8);
        let rows = 1u64 << 36;
        let got: Vec<RowRun> = runs(&packed_pair, (rows, rows), rows).collect();
        assert_eq!(
            got,
            vec![RowRun {
                first: 0,
                len: rows
            }]
        );
        // Rings of R and R + 1 rows after 3R + 5 positions: R live positions, cut where the
        // first wraps (3R) and where the second does (3R + 3).
        let got: Vec<RowRun> = runs(&packed_pair, (rows, rows + 1), 3 * rows + 5).collect();
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
        let got: Vec<RowRun> = runs(&packed_pair, (n - 1, n), n).collect();
        assert_eq!(got.iter().map(|r| r.len).sum::<u64>(), n - 1);
        // Padded rows are a block per position: counted, not walked.
        assert_eq!(block_count(&pair(16, 8), (rows, rows), rows), rows);
    }
}
