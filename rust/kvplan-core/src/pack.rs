//! Pack plans: a request's plan split in two, so the network moves few large blocks.
//!
//! When the source rows a decode rank needs are strided (a prefill at DCP 1 sending to a decode
//! at DCP N holds the rank's tokens one row apart in every page: the direct plan is one block per
//! token per layer), the prefill first gathers those rows into a *pack buffer* of its own memory
//! (a local copy: a GPU kernel in production), laid out so that every run of blocks contiguous on
//! the decode side is contiguous in the pack buffer too; the network then moves one block per
//! destination-contiguous run.
//!
//! Both plans derive from the direct plan, block for block, so the decode receives exactly the
//! bytes the direct plan would write:
//! - `gather`: direct block `k` (`src → dst`, `len`) becomes `src → pack + offset_k`, with the
//!   blocks packed back to back in plan order (`offset_k` = bytes of the blocks before `k`);
//!   consecutive blocks contiguous on both the source and the pack side are merged;
//! - `network`: consecutive direct blocks contiguous on the decode side (hence in the pack
//!   buffer) become one block `pack + offset → dst`.
//!
//! Merges never cross a page pair (a pair's blocks stay a range of `pair_offsets`), and the
//! pack buffer must hold the plan's bytes, checked before the plan's output is requested. The
//! gather is the direct plan's columns rewritten in place (no second large allocation); the
//! network plan is small and allocated. State slots
//! are not packed (one block per state pair already): plan them with
//! [`Template::plan_state_into`].

use crate::error::{PlanError, Result};
use crate::plan::{AsColumns, Columns, FlatBuffer, Plan, PlanShape};
use crate::runs::PageIndex;
use crate::template::Template;

/// Caller-owned memory on the prefill side that receives the gathered rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackBuffer {
    /// First byte of the buffer.
    pub addr: u64,
    /// Bytes the buffer holds.
    pub size: u64,
}

/// A request's plan as a local gather into the pack buffer and a network plan out of it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PackedPlan {
    /// Prefill memory → pack buffer (executed locally by the caller before the transfer).
    pub gather: Plan,
    /// Pack buffer → decode memory, one block per destination-contiguous run.
    pub network: Plan,
    /// Bytes of the pack buffer the plans use (from its start).
    pub pack_bytes: u64,
}

/// What [`Template::plan_packed_into`] leaves besides the gather columns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PackedSummary {
    /// Blocks of the gather plan (the first values of the output columns).
    pub gather_blocks: usize,
    /// `n_pairs + 1` block offsets of the gather plan.
    pub gather_pair_offsets: Vec<usize>,
    /// The network plan (small: one block per destination-contiguous run).
    pub network: Plan,
    /// Bytes of the pack buffer the plans use (from its start): the plan's bytes.
    pub pack_bytes: u64,
}

impl Template {
    /// Plans one request (as [`Template::plan_into`]) into columns from `make_output`, then
    /// rewrites them in place into the gather plan and returns the network plan (see the
    /// [`crate::pack`] module). The pack buffer is checked against the plan's bytes before
    /// `make_output` is called.
    ///
    /// # Errors
    /// As [`Template::plan_into`]; [`PlanError::PackTooSmall`]; [`PlanError::Overflow`] when
    /// the pack buffer's end overflows u64.
    pub fn plan_packed_into<'o, S: PageIndex, D: PageIndex, O>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
        pack: PackBuffer,
        make_output: impl FnOnce(&PlanShape) -> Result<O>,
    ) -> Result<(O, PackedSummary)>
    where
        O: AsColumns<'o>,
    {
        pack.addr
            .checked_add(pack.size)
            .ok_or(PlanError::Overflow {
                what: "pack buffer end",
            })?;
        let (mut output, summary) = self.plan_into(src, dst, n_tokens, |shape| {
            if shape.total_bytes > pack.size {
                return Err(PlanError::PackTooSmall {
                    need: shape.total_bytes,
                    have: pack.size,
                    blocks: shape.n_blocks,
                });
            }
            make_output(shape)
        })?;
        let offsets = self.pair_offsets(&summary);
        let packed = pack_columns(output.columns(), summary.n_blocks, &offsets, pack)?;
        Ok((output, packed))
    }

    /// Allocating convenience over [`Template::plan_packed_into`].
    ///
    /// # Errors
    /// As [`Template::plan_packed_into`].
    pub fn plan_packed<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
        pack: PackBuffer,
    ) -> Result<PackedPlan> {
        let (buffer, packed) = self.plan_packed_into(src, dst, n_tokens, pack, |shape| {
            FlatBuffer::try_zeroed(shape.n_blocks)
        })?;
        let (src_addrs, dst_addrs, lengths) = buffer.into_columns(packed.gather_blocks)?;
        let gather = Plan {
            src_addrs,
            dst_addrs,
            lengths,
            n_runs: packed.gather_blocks,
            total_bytes: packed.pack_bytes,
            pair_offsets: packed.gather_pair_offsets,
        };
        Ok(PackedPlan {
            gather,
            network: packed.network,
            pack_bytes: packed.pack_bytes,
        })
    }
}

/// Rewrites the first `n` blocks of a direct plan in place into the gather plan (sources kept,
/// destinations packed back to back from `pack.addr`, merged where both sides continue) and
/// returns it with the network plan. `offsets` are the direct plan's pair offsets.
///
/// # Errors
/// [`PlanError::PackTooSmall`], [`PlanError::Overflow`], [`PlanError::OutOfMemory`].
pub fn pack_columns(
    out: Columns<'_>,
    n: usize,
    offsets: &[usize],
    pack: PackBuffer,
) -> Result<PackedSummary> {
    let n = n.min(out.capacity());
    let need = plan_bytes(&out.lengths[..n])?;
    if need > pack.size {
        return Err(PlanError::PackTooSmall {
            need,
            have: pack.size,
            blocks: n,
        });
    }
    pack.addr
        .checked_add(pack.size)
        .ok_or(PlanError::Overflow {
            what: "pack buffer end",
        })?;
    let bounds = PairBounds::of(offsets, n);
    // The network plan reads the direct destinations, so it is built before the gather
    // rewrite overwrites them: one block per destination-contiguous run of a pair (the pack
    // side continues with it, the blocks being packed back to back).
    let mut network = PlanBuilder::default();
    let mut at = pack.addr;
    for pair in bounds.get().windows(2) {
        for k in pair[0]..pair[1] {
            network.push_merged((at, out.dst_addrs[k], out.lengths[k]))?;
            at += out.lengths[k]; // at most pack.addr + need <= pack.addr + pack.size
        }
        network.end_pair();
    }
    let (written, gather_offsets) = gather_in_place(out, &bounds, pack.addr);
    let mut network = network.finish(need);
    let gather_pair_offsets = if bounds.by_pair {
        gather_offsets
    } else {
        // No pair structure to follow: keep the direct plan's (empty or trivial) offsets.
        network.pair_offsets = offsets.to_vec();
        offsets.to_vec()
    };
    Ok(PackedSummary {
        gather_blocks: written,
        gather_pair_offsets,
        network,
        pack_bytes: need,
    })
}

/// Bytes of blocks of these lengths.
///
/// # Errors
/// [`PlanError::Overflow`].
pub(crate) fn plan_bytes(lengths: &[u64]) -> Result<u64> {
    lengths.iter().try_fold(0u64, |sum, &l| {
        sum.checked_add(l)
            .ok_or(PlanError::Overflow { what: "plan bytes" })
    })
}

/// The block ranges a plan's blocks are walked in: its pair offsets when they cover its `n`
/// blocks, else one range of all of them.
pub(crate) struct PairBounds {
    /// Whether the ranges are the plan's pairs.
    pub(crate) by_pair: bool,
    bounds: Vec<usize>,
}

impl PairBounds {
    pub(crate) fn of(offsets: &[usize], n: usize) -> Self {
        let by_pair = offsets.len() >= 2 && offsets[0] == 0 && offsets.last() == Some(&n);
        let bounds = if by_pair {
            offsets.to_vec()
        } else {
            vec![0, n]
        };
        Self { by_pair, bounds }
    }

    /// `ranges + 1` block offsets.
    pub(crate) fn get(&self) -> &[usize] {
        &self.bounds
    }
}

/// The one gather rewrite (pack and staged plans): rewrites the blocks `bounds` covers in place
/// into a gather from their sources into memory from `start`, the blocks back to back in plan
/// order, consecutive blocks of a range merged when they continue on the source side (the
/// packed side always does). Returns the gather's block count and its range offsets. The caller
/// has checked that `start` plus the blocks' bytes does not pass its region's end.
pub(crate) fn gather_in_place(
    out: Columns<'_>,
    bounds: &PairBounds,
    start: u64,
) -> (usize, Vec<usize>) {
    let (src, dst, len) = (out.src_addrs, out.dst_addrs, out.lengths);
    let bounds = bounds.get();
    let mut gather_offsets = Vec::with_capacity(bounds.len());
    gather_offsets.push(0);
    let mut written = 0usize; // gather blocks so far (<= blocks read: the rewrite stays behind)
    let mut at = start;
    for pair in bounds.windows(2) {
        // The open gather block of this range, kept in locals and written out when the next
        // block does not continue it (the rewrite index stays behind the read index, so every
        // block is read before its slot is overwritten).
        let mut gather: Option<(u64, u64, u64)> = None;
        for k in pair[0]..pair[1] {
            let (s, l) = (src[k], len[k]);
            gather = match gather {
                Some((gs, gd, gl)) if gs + gl == s && gd + gl == at => Some((gs, gd, gl + l)),
                Some(done) => {
                    (src[written], dst[written], len[written]) = done;
                    written += 1;
                    Some((s, at, l))
                }
                None => Some((s, at, l)),
            };
            at += l; // inside the region (checked by the caller)
        }
        if let Some(done) = gather {
            (src[written], dst[written], len[written]) = done;
            written += 1;
        }
        gather_offsets.push(written);
    }
    (written, gather_offsets)
}

/// A small plan as it grows (network and scatter plans), blocks merged within a pair range.
#[derive(Default)]
pub(crate) struct PlanBuilder {
    plan: Plan,
    /// First block of the current pair range.
    pair_start: usize,
}

impl PlanBuilder {
    /// Appends a block, merged into the previous one when it belongs to the same pair range
    /// and continues it on both sides.
    pub(crate) fn push_merged(&mut self, (src, dst, len): (u64, u64, u64)) -> Result<()> {
        let p = &mut self.plan;
        let n = p.lengths.len();
        if n > self.pair_start {
            let (ls, ld, ll) = (p.src_addrs[n - 1], p.dst_addrs[n - 1], p.lengths[n - 1]);
            if ls.checked_add(ll) == Some(src) && ld.checked_add(ll) == Some(dst) {
                p.lengths[n - 1] = ll + len; // both blocks lie in one region: no overflow
                return Ok(());
            }
        }
        for (column, value) in [
            (&mut p.src_addrs, src),
            (&mut p.dst_addrs, dst),
            (&mut p.lengths, len),
        ] {
            column
                .try_reserve(1)
                .map_err(|_| PlanError::out_of_memory::<u64>("plan column", column.len() + 1))?;
            column.push(value);
        }
        Ok(())
    }

    /// Ends a pair range: records its end offset (later blocks never merge into it).
    pub(crate) fn end_pair(&mut self) {
        if self.plan.pair_offsets.is_empty() {
            self.plan.pair_offsets.push(0);
        }
        self.pair_start = self.plan.lengths.len();
        self.plan.pair_offsets.push(self.pair_start);
    }

    pub(crate) fn finish(self, total_bytes: u64) -> Plan {
        let mut plan = self.plan;
        plan.n_runs = plan.lengths.len();
        plan.total_bytes = total_bytes;
        plan
    }
}
