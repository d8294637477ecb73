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
//! pack buffer must hold the plan's bytes, checked before anything is written. State slots
//! are not packed (one block per state pair already): plan them with
//! [`Template::plan_state_into`].

use crate::error::{PlanError, Result};
use crate::plan::Plan;
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

impl Template {
    /// Plans one request (as [`Template::plan`]) and splits it into a gather into `pack` and a
    /// network plan from `pack` (see the [`crate::pack`] module).
    ///
    /// # Errors
    /// As [`Template::plan`]; [`PlanError::PackTooSmall`] when `pack` cannot hold the plan's
    /// bytes; [`PlanError::Overflow`] when the pack buffer's end overflows u64.
    pub fn plan_packed<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
        pack: PackBuffer,
    ) -> Result<PackedPlan> {
        let direct = self.plan(src, dst, n_tokens)?;
        pack_plan(&direct, pack)
    }
}

/// Splits a direct plan into a gather into `pack` and a network plan from it.
///
/// # Errors
/// [`PlanError::PackTooSmall`], [`PlanError::Overflow`], [`PlanError::OutOfMemory`].
pub fn pack_plan(direct: &Plan, pack: PackBuffer) -> Result<PackedPlan> {
    let need = direct.total_bytes;
    if need > pack.size {
        return Err(PlanError::PackTooSmall {
            need,
            have: pack.size,
            blocks: direct.lengths.len(),
        });
    }
    pack.addr
        .checked_add(pack.size)
        .ok_or(PlanError::Overflow {
            what: "pack buffer end",
        })?;
    let n = direct.lengths.len();
    let offsets = &direct.pair_offsets;
    let by_pair = offsets.len() >= 2 && offsets[0] == 0 && offsets.last() == Some(&n);
    let whole = [0, n];
    let bounds: &[usize] = if by_pair { offsets } else { &whole };
    let mut gather = Builder::with_capacity(n)?;
    let mut network = Builder::with_capacity(n)?;
    let mut at = pack.addr;
    for pair in bounds.windows(2) {
        for k in pair[0]..pair[1] {
            let len = direct.lengths[k];
            gather.push(direct.src_addrs[k], at, len);
            network.push(at, direct.dst_addrs[k], len);
            at += len; // at most pack.addr + total_bytes <= pack.addr + pack.size
        }
        gather.end_pair();
        network.end_pair();
    }
    Ok(PackedPlan {
        gather: gather.finish(by_pair, offsets),
        network: network.finish(by_pair, offsets),
        pack_bytes: need,
    })
}

/// Appends blocks, merging one into the previous when both sides continue it (never across
/// a pair boundary).
struct Builder {
    plan: Plan,
    /// Whether the next block may merge into the last one (false at a pair's start).
    open: bool,
    /// Block offsets of the pairs ended so far.
    pair_offsets: Vec<usize>,
}

impl Builder {
    fn with_capacity(n: usize) -> Result<Self> {
        let column = || -> Result<Vec<u64>> {
            let mut v = Vec::new();
            v.try_reserve_exact(n)
                .map_err(|_| PlanError::out_of_memory::<u64>("pack plan column", n))?;
            Ok(v)
        };
        Ok(Self {
            plan: Plan {
                src_addrs: column()?,
                dst_addrs: column()?,
                lengths: column()?,
                ..Plan::default()
            },
            open: false,
            pair_offsets: vec![0],
        })
    }

    fn push(&mut self, src: u64, dst: u64, len: u64) {
        let p = &mut self.plan;
        if self.open
            && let (Some(&s), Some(&d), Some(l)) =
                (p.src_addrs.last(), p.dst_addrs.last(), p.lengths.last_mut())
            && s + *l == src
            && d + *l == dst
        {
            *l += len;
        } else {
            p.src_addrs.push(src);
            p.dst_addrs.push(dst);
            p.lengths.push(len);
        }
        p.total_bytes += len;
        self.open = true;
    }

    fn end_pair(&mut self) {
        self.pair_offsets.push(self.plan.lengths.len());
        self.open = false;
    }

    /// The plan; its pair offsets follow the direct plan's pairs (or, when the direct plan
    /// has none, stay as the direct plan's).
    fn finish(self, by_pair: bool, direct_offsets: &[usize]) -> Plan {
        let mut plan = self.plan;
        plan.n_runs = plan.lengths.len();
        plan.pair_offsets = if by_pair {
            self.pair_offsets
        } else {
            direct_offsets.to_vec()
        };
        plan
    }
}
