//! Ring state between rings of different sizes.
//!
//! A ring-state entry keeps, per request slot, `R` rows (its items): position `p` of a request
//! lives in row `slot × R + p mod R`, so the ring holds the last `R` positions (a compressor's
//! state rows, a speculative decoder's ring). Prefill and decode may keep rings of different
//! sizes (`R_p ≠ R_d`): whole-ring copies would put positions in the wrong rows, so a ring plan
//! moves, for a request that has processed `n` positions, the live positions both rings hold,
//! `n − min(R_p, R_d, n) .. n`, each from its prefill row to its decode row. Consecutive
//! positions are one block while both rows step by one (neither ring wraps) and each side's
//! rows are packed (`stride == item_len`); otherwise a block per position.
//!
//! The plan is counted first and written once into exactly sized columns.

use crate::error::{PlanError, Result, Side};
use crate::pieces::PairSpec;
use crate::plan::Plan;
use crate::template::Template;

/// Plans the live rows of every ring-state pair of a template for one request.
#[derive(Debug, Clone, Copy)]
pub struct RingPlanner<'t> {
    template: &'t Template,
}

/// One block run of a ring pair: its first position and positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowRun {
    first: u64,
    len: u64,
}

impl<'t> RingPlanner<'t> {
    /// A planner over `template`'s ring pairs.
    pub fn new(template: &'t Template) -> Self {
        Self { template }
    }

    /// The live rows of request slot `src_slot` (prefill) and `dst_slot` (decode) after
    /// `n_positions` positions, one block range per ring pair in pair order (`pair_offsets`).
    ///
    /// # Errors
    /// [`PlanError::NegativeIndex`] for a negative slot, [`PlanError::IndexOutOfRange`] for a
    /// slot whose ring lies past its buffer, [`PlanError::Geometry`] for a template without
    /// ring pairs, [`PlanError::Overflow`], [`PlanError::OutOfMemory`].
    pub fn plan(&self, src_slot: i64, dst_slot: i64, n_positions: u64) -> Result<Plan> {
        let pairs = &self.template.ring_pairs;
        if pairs.is_empty() {
            return Err(PlanError::Geometry {
                what: "this template has no ring-state pairs (Layout.with_rings marks them)".into(),
            });
        }
        let slots = crate::request::slot_indices(src_slot, dst_slot)?;
        for (pair, rows) in pairs {
            self.check_slot(pair, Side::Src, slots.0, rows.0)?;
            self.check_slot(pair, Side::Dst, slots.1, rows.1)?;
        }
        // Count, then write once into exactly sized columns.
        let mut n_blocks = 0usize;
        let mut total_bytes = 0u64;
        for (pair, rows) in pairs.iter().filter(|(p, _)| p.item_len > 0) {
            for run in runs(pair, *rows, n_positions) {
                n_blocks += 1;
                total_bytes = run
                    .len
                    .checked_mul(pair.item_len)
                    .and_then(|b| b.checked_add(total_bytes))
                    .ok_or(PlanError::Overflow { what: "ring bytes" })?;
            }
        }
        let column = || -> Result<Vec<u64>> {
            let mut out = Vec::new();
            out.try_reserve_exact(n_blocks)
                .map_err(|_| PlanError::out_of_memory::<u64>("ring plan columns", n_blocks))?;
            Ok(out)
        };
        let (mut src_addrs, mut dst_addrs, mut lengths) = (column()?, column()?, column()?);
        let mut pair_offsets = Vec::with_capacity(pairs.len() + 1);
        pair_offsets.push(0);
        let mut n_runs = 0;
        for (pair, rows) in pairs {
            if pair.item_len > 0 {
                for run in runs(pair, *rows, n_positions) {
                    // Inside the slot's ring (checked above), so inside the buffer.
                    let row = |slot: u64, r: u64| slot * r + run.first % r;
                    src_addrs.push(pair.src_base + row(slots.0, rows.0) * pair.src_stride);
                    dst_addrs.push(pair.dst_base + row(slots.1, rows.1) * pair.dst_stride);
                    lengths.push(run.len * pair.item_len);
                    n_runs += 1;
                }
            }
            pair_offsets.push(src_addrs.len());
        }
        Ok(Plan {
            src_addrs,
            dst_addrs,
            lengths,
            n_runs,
            total_bytes,
            pair_offsets,
        })
    }

    /// The slot's ring (`rows` items from `slot × rows`) lies inside the pair's buffer.
    fn check_slot(self, pair: &PairSpec, side: Side, slot: u64, rows: u64) -> Result<()> {
        if pair.item_len == 0 {
            return Ok(()); // an elided entry holds nothing and moves nothing
        }
        let capacity = side.pick(pair.src_capacity, pair.dst_capacity);
        let end = slot.checked_add(1).and_then(|s| s.checked_mul(rows));
        if end.is_some_and(|end| end <= capacity) {
            return Ok(());
        }
        let entry = side.pick(pair.src_entry, pair.dst_entry);
        Err(PlanError::IndexOutOfRange {
            side,
            index: i64::try_from(slot).unwrap_or(i64::MAX),
            position: 0,
            capacity: capacity / rows,
            entry,
            label: self.template.entry_label(side, entry),
            item_len: pair.item_len,
        })
    }
}

/// The block runs of one ring pair: live positions `n − min(R_p, R_d, n) .. n`, cut where
/// either ring wraps (its next row is row 0 of the slot) or, on a side whose rows are padded,
/// at every position.
fn runs(pair: &PairSpec, (rs, rd): (u64, u64), n: u64) -> impl Iterator<Item = RowRun> {
    let live = rs.min(rd).min(n);
    let packed = pair.src_stride == pair.item_len && pair.dst_stride == pair.dst_item_len;
    let mut at = n - live;
    std::iter::from_fn(move || {
        if at >= n {
            return None;
        }
        let first = at;
        at += 1;
        while packed && at < n && !at.is_multiple_of(rs) && !at.is_multiple_of(rd) {
            at += 1;
        }
        Some(RowRun {
            first,
            len: at - first,
        })
    })
}
