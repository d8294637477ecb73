//! Staged plans: a request's direct plan as a gather into a prefill staging region, a few large
//! network blocks from it into a decode staging region, and a scatter from there into the
//! decode's pages.
//!
//! Prefill TP ≠ decode TP on token-major (NHD) pages makes one direct block per token per head
//! slice; staging turns the network part into one block per (writer, contiguous slot range),
//! at the price of two local copies (GPU kernels in production, [`crate::local`] on CPU).
//!
//! All three plans derive from the direct plan of the request, so every byte lands where the
//! direct plan puts it. Direct block `k` of pair range `p` (a range of `pair_offsets`) is placed
//! at offset `off_k` of its range (the bytes of the range's blocks before it):
//! - `gather`: `src_k → src_staging + S_p + off_k`, the ranges back to back in plan order from
//!   the region's start (the gather rewrite of [`crate::pack`]);
//! - `network`: one block `src_staging + S_p → dst_staging + D_p` per range, merged with the
//!   previous one when it continues on both sides, so the network plan's pair offsets are one
//!   range of all its blocks (not per entry pair);
//! - `scatter`: `dst_staging + D_p + off_k → dst_k`, merged within a range when both sides
//!   continue.
//!
//! The decode offsets `D_p` follow SGLang 0.5.23's staging layout (`compute_staging_layout`).
//! A decode region is filled by one or several *writers* ([`crate::heads::staging_writer`]:
//! `tp_p / tp_d` prefill ranks when the prefill TP is larger) and, under prefill PP, by every
//! prefill stage. With one writer and prefill PP 1, `D_p = S_p` (plain back-to-back packing).
//! Otherwise every writer owns `writer_bytes = slot_bytes × slots` bytes at `writer_index ×
//! writer_bytes`, holding one *slot* per decode page entry (the decode layout's page entries in
//! its order: SGLang's K entries then V entries), and range `p` lands in the slot of its decode
//! entry: `D_p = writer_index × writer_bytes + slot(p) × slot_bytes`, so PP stages fill disjoint
//! slots. Every entry pair of the request must then move the same `slot_bytes`
//! ([`PlanError::StagingSlotSizes`] otherwise). A coalesced group (one range for several pairs)
//! takes as many consecutive slots as it has pairs.
//!
//! Within a range, blocks keep plan order. For a head-sliced NHD request that order is
//! token-major (`[token][sent heads][head_dim]` per entry: SGLang's staging layout), because
//! a page request is staged from the template's token plan whenever that plan moves the same
//! bytes in no more blocks (the page plan of a sliced NHD pair is slot-major instead).
//!
//! Regions are checked before any output exists: the prefill region must hold the plan's
//! bytes, the decode region every writer's share (`writers × writer_bytes`), else
//! [`PlanError::StagingTooSmall`] naming both sizes; no block ever reaches past a region's end.
//! State slots are not staged (one block per state pair already): plan them with
//! [`Template::plan_state_into`].

use crate::error::{PlanError, Result};
use crate::heads::staging_writer;
use crate::pack::{PackBuffer, PairBounds, PlanBuilder, gather_in_place, plan_bytes};
use crate::plan::{AsColumns, FlatBuffer, Plan, PlanShape, PlanUnit};
use crate::runs::PageIndex;
use crate::template::Template;

/// Registered memory a staged plan stages bytes in: `(addr, size)`, like a pack buffer.
pub type StagingRegion = PackBuffer;

/// A request's plan as a local gather, a network plan between staging regions and a local
/// scatter (see the [`crate::staged`] module).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StagedPlan {
    /// Prefill memory → prefill staging region (run locally by the prefill before the network).
    pub gather: Plan,
    /// Prefill staging region → decode staging region (moved by the engine).
    pub network: Plan,
    /// Decode staging region → decode memory (run locally by the decode after the network).
    pub scatter: Plan,
    /// Bytes of the prefill staging region the plan uses, from its start.
    pub src_staging_bytes: u64,
    /// Offsets `[start, end)` of the decode staging region this writer's share covers (its
    /// bytes are written at slots inside it).
    pub dst_staging_range: (u64, u64),
    /// Bytes the decode staging region must hold for all writers.
    pub dst_staging_bytes: u64,
    /// Blocks of the request's direct plan ([`Template::plan`]), for a direct-or-staged choice.
    pub direct_blocks: usize,
    /// `(writer index, number of writers)` of this prefill rank in the decode region.
    pub writer: (u32, u32),
}

/// Where each pair range of a direct plan lands in the decode region.
struct DecodePlacement {
    /// Per pair range, its offset in the decode region.
    offsets: Vec<u64>,
    /// This writer's share of the region.
    range: (u64, u64),
    /// Bytes the region must hold for all writers.
    need: u64,
    /// What the need is made of, for messages.
    layout: String,
}

impl Template {
    /// Plans one request (as [`Template::plan`]) as a staged plan through `src_staging` (prefill
    /// memory) and `dst_staging` (decode memory); see the [`crate::staged`] module.
    ///
    /// # Errors
    /// As [`Template::plan`]; [`PlanError::StagingTooSmall`] for a region smaller than what the
    /// plan places in it; [`PlanError::StagingSlotSizes`] when decode slots are needed and the
    /// pairs move different bytes; [`PlanError::Geometry`] for a coalesced group whose decode
    /// entries are not consecutive page entries or TP sizes neither of which divides the other
    /// ([`crate::heads::staging_writer`]); [`PlanError::Overflow`].
    pub fn plan_staged<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
        src_staging: StagingRegion,
        dst_staging: StagingRegion,
    ) -> Result<StagedPlan> {
        for (region, what) in [
            (src_staging, "prefill staging region end"),
            (dst_staging, "decode staging region end"),
        ] {
            region
                .addr
                .checked_add(region.size)
                .ok_or(PlanError::Overflow { what })?;
        }
        let direct = self.prepare(src, dst, n_tokens)?;
        let staged_tokens = self.staging_tokens(src, dst, n_tokens, &direct);
        let (mut buffer, summary) = self.plan_into(src, dst, staged_tokens, |shape| {
            if shape.total_bytes > src_staging.size {
                return Err(PlanError::StagingTooSmall {
                    region: "prefill",
                    need: shape.total_bytes,
                    have: src_staging.size,
                    layout: format!("the gather of {} blocks", shape.n_blocks),
                });
            }
            FlatBuffer::try_zeroed(shape.n_blocks)
        })?;
        let n = summary.n_blocks;
        let bounds = PairBounds::of(&self.pair_offsets(&summary), n);
        let columns = buffer.columns();
        let range_bytes: Vec<u64> = bounds
            .get()
            .windows(2)
            .map(|r| plan_bytes(&columns.lengths[r[0]..r[1]]))
            .collect::<Result<_>>()?;
        let total = plan_bytes(&range_bytes)?;
        let writer = staging_writer(
            self.stream.prefill.tp_size,
            self.stream.prefill.tp_rank,
            self.stream.decode.tp_size,
        )?;
        let placement = self.place_decode(&bounds, &range_bytes, writer)?;
        if placement.need > dst_staging.size {
            return Err(PlanError::StagingTooSmall {
                region: "decode",
                need: placement.need,
                have: dst_staging.size,
                layout: placement.layout,
            });
        }
        // Network and scatter read the direct destinations, so they are built before the
        // gather rewrite overwrites them. Every address below lies inside its region: the
        // offsets plus the bytes are at most the sizes checked above.
        let mut network = PlanBuilder::default();
        let mut scatter = PlanBuilder::with_capacity(n)?; // at most the direct plan's blocks
        let mut at = src_staging.addr;
        for (r, range) in bounds.get().windows(2).enumerate() {
            let staged = dst_staging.addr + placement.offsets[r];
            if range_bytes[r] > 0 {
                network.push_merged((at, staged, range_bytes[r]))?;
            }
            let mut off = 0;
            for k in range[0]..range[1] {
                let (d, l) = (columns.dst_addrs[k], columns.lengths[k]);
                scatter.push_merged((staged + off, d, l))?;
                off += l;
            }
            scatter.end_pair();
            at += range_bytes[r];
        }
        network.end_pair();
        let (written, gather_offsets) = gather_in_place(columns, &bounds, src_staging.addr);
        let (mut src_addrs, dst_addrs, lengths) = buffer.into_columns(written)?;
        // The source column keeps the direct plan's allocation (three columns of every direct
        // block); a gather is usually far smaller, so it gives the rest back.
        src_addrs.shrink_to_fit();
        let mut gather = Plan {
            src_addrs,
            dst_addrs,
            lengths,
            n_runs: written,
            total_bytes: total,
            pair_offsets: gather_offsets,
        };
        let mut scatter = scatter.finish(total);
        if !bounds.by_pair {
            // No pair structure (no page pairs): the direct plan's offsets, as pack plans keep.
            gather.pair_offsets = self.pair_offsets(&summary);
            scatter.pair_offsets.clone_from(&gather.pair_offsets);
        }
        let network = network.finish(total);
        Ok(StagedPlan {
            gather,
            network,
            scatter,
            src_staging_bytes: total,
            dst_staging_range: placement.range,
            dst_staging_bytes: placement.need,
            direct_blocks: direct.n_blocks,
            writer,
        })
    }

    /// The `n_tokens` the staged plan is derived with: a page request is staged from its token
    /// plan when that moves the same bytes in no more blocks (token-major order within each
    /// pair), else from its page plan; a token request as given.
    fn staging_tokens<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
        direct: &PlanShape,
    ) -> Option<u64> {
        let PlanUnit::Pages(found) = direct.unit else {
            return n_tokens;
        };
        if found.n_pages == 0 || self.tokens.is_err() {
            return None;
        }
        let tokens = (src.len() as u64).checked_mul(self.page_sizes.0)?;
        match self.prepare(src, dst, Some(tokens)) {
            Ok(shape)
                if shape.total_bytes == direct.total_bytes && shape.n_blocks <= direct.n_blocks =>
            {
                Some(tokens)
            }
            _ => None,
        }
    }

    /// The decode offset of every pair range (see the module documentation).
    fn place_decode(
        &self,
        bounds: &PairBounds,
        range_bytes: &[u64],
        (writer, writers): (u32, u32),
    ) -> Result<DecodePlacement> {
        let total = plan_bytes(range_bytes)?;
        if (writers == 1 && self.stream.prefill.pp_size <= 1) || !bounds.by_pair {
            let mut offsets = Vec::with_capacity(range_bytes.len());
            let mut at = 0;
            for &bytes in range_bytes {
                offsets.push(at);
                at += bytes;
            }
            return Ok(DecodePlacement {
                offsets,
                range: (0, total),
                need: total,
                layout: format!("the plan's {total} bytes"),
            });
        }
        let (dst_slots, n_slots) = (&self.dst_slots.0, self.dst_slots.1 as u64);
        // Per moving range its first slot, and the bytes of one slot.
        let mut placed: Vec<Option<u64>> = vec![None; range_bytes.len()];
        let mut slot_bytes: Option<(usize, u64)> = None;
        for (pair, &bytes) in range_bytes.iter().enumerate() {
            if bytes == 0 {
                continue;
            }
            // The pairs whose blocks this range holds: its group's (one, unless coalesced).
            let members: Vec<usize> = match self.pair_groups.get(pair).copied().flatten() {
                Some(g) => (self.groups[g].first_pair..=pair)
                    .filter(|&q| self.pair_groups[q] == Some(g))
                    .collect(),
                None => vec![pair],
            };
            let first = dst_slots[members[0]];
            let consecutive = members
                .iter()
                .enumerate()
                .all(|(i, &q)| dst_slots[q] == first + i);
            let count = members.len() as u64;
            if !consecutive || !bytes.is_multiple_of(count) {
                return Err(PlanError::Geometry {
                    what: format!(
                        "page pairs {}..={pair} are coalesced into one block range but their \
                         decode entries are not consecutive page entries, so they have no \
                         staging slots; build the template with coalesce=False",
                        members[0]
                    ),
                });
            }
            let per_slot = bytes / count;
            match slot_bytes {
                None => slot_bytes = Some((pair, per_slot)),
                Some((first_pair, first_bytes)) if first_bytes != per_slot => {
                    return Err(PlanError::StagingSlotSizes {
                        first_pair,
                        first_bytes,
                        pair,
                        bytes: per_slot,
                    });
                }
                Some(_) => {}
            }
            placed[pair] = Some(first as u64);
        }
        let slot = slot_bytes.map_or(0, |(_, b)| b);
        let overflow = || PlanError::Overflow {
            what: "decode staging layout",
        };
        let writer_bytes = slot.checked_mul(n_slots).ok_or_else(overflow)?;
        let start = writer_bytes
            .checked_mul(u64::from(writer))
            .ok_or_else(overflow)?;
        let need = writer_bytes
            .checked_mul(u64::from(writers))
            .ok_or_else(overflow)?;
        // Slots lie below `n_slots` and a range's slots are consecutive, so every range lies
        // inside this writer's share; two ranges never share a slot (one decode entry per pair).
        let offsets = placed
            .iter()
            .map(|p| p.map_or(start, |first| start + first * slot))
            .collect();
        Ok(DecodePlacement {
            offsets,
            range: (start, start + writer_bytes),
            need,
            layout: format!(
                "{writers} writer(s) × {n_slots} decode page entries × {slot} bytes per entry"
            ),
        })
    }
}
