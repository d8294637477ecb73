//! The direct-or-staged choice: a pure function of a request's counts and an engine's measured
//! costs, so the rule lives in one place and every caller (bindings, benchmarks) asks it.
//!
//! A request can go to the engine as its **direct** plan (one engine block per direct block)
//! or **staged**: gathered locally into a staging buffer, sent as a few large network blocks,
//! and scattered locally on the decode. Both move the same bytes over the network; staging
//! trades engine blocks for two local copies. With a [`TransferCost`] measured once per engine
//! (`per_block_s`: what one more engine block costs; `network_bytes_per_s`: the engine's
//! streaming bandwidth; `copy_bytes_per_s`: the local copy bandwidth), the model is
//!
//! ```text
//! direct_s = direct_blocks × per_block_s + bytes / network_bytes_per_s
//! staged_s = gather_bytes / copy_bytes_per_s
//!          + network_blocks × per_block_s + bytes / network_bytes_per_s
//!          + scatter_bytes / copy_bytes_per_s
//! ```
//!
//! and [`advise`] picks the smaller; a tie goes to direct (no staging buffers, no local
//! copies, nothing to gain).

use crate::error::{PlanError, Result};
use crate::model::request::Request;
use crate::model::runs::PageIndex;
use crate::peer_pair::template::Template;
use crate::planners::staged::StagedPlanner;

/// What moving bytes costs on one engine, measured once (see `kvplan.engines.measure_cost`).
///
/// Every value is finite and greater than zero; [`TransferCost::new`] refuses anything else,
/// so an [`Advice`] never comes from a NaN, an infinity or a zero bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
#[allow(clippy::struct_field_names)] // the unit suffix is part of each name: seconds, bytes/s
pub struct TransferCost {
    per_block_s: f64,
    network_bytes_per_s: f64,
    copy_bytes_per_s: f64,
}

impl TransferCost {
    /// A validated cost: seconds per engine block, network and local copy bandwidths in bytes
    /// per second.
    ///
    /// # Errors
    /// [`PlanError::InvalidCost`] naming the first value that is not a finite number > 0.
    pub fn new(per_block_s: f64, network_bytes_per_s: f64, copy_bytes_per_s: f64) -> Result<Self> {
        for (field, value) in [
            ("per_block_s", per_block_s),
            ("network_bytes_per_s", network_bytes_per_s),
            ("copy_bytes_per_s", copy_bytes_per_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(PlanError::InvalidCost {
                    field,
                    value: format!("{value:?}"),
                });
            }
        }
        Ok(Self {
            per_block_s,
            network_bytes_per_s,
            copy_bytes_per_s,
        })
    }

    /// Seconds one engine block costs on top of its bytes.
    pub fn per_block_s(&self) -> f64 {
        self.per_block_s
    }

    /// The engine's streaming bandwidth, bytes per second.
    pub fn network_bytes_per_s(&self) -> f64 {
        self.network_bytes_per_s
    }

    /// The local copy (gather, scatter) bandwidth, bytes per second.
    pub fn copy_bytes_per_s(&self) -> f64 {
        self.copy_bytes_per_s
    }
}

/// Which way to send a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Submit the direct plan.
    Direct,
    /// Gather, submit the staged network plan, scatter.
    Staged,
}

impl Choice {
    /// `"direct"` or `"staged"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Choice::Direct => "direct",
            Choice::Staged => "staged",
        }
    }
}

/// The choice for one request and the estimates it rests on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Advice {
    /// The path with the smaller estimate (direct on a tie).
    pub choice: Choice,
    /// Estimated seconds of the direct path.
    pub direct_s: f64,
    /// Estimated seconds of the staged path (gather + network + scatter).
    pub staged_s: f64,
    /// Engine blocks of the direct path.
    pub direct_blocks: usize,
    /// Engine blocks of the staged path (its network plan).
    pub staged_blocks: usize,
    /// Bytes either path moves over the network.
    pub bytes: u64,
    /// Bytes the staged path copies locally (gather + scatter).
    pub copy_bytes: u64,
}

/// Direct or staged for a request of these counts, by the model in the module documentation.
///
/// `direct_blocks`: blocks of the direct plan; `staged_network_blocks`: blocks of the staged
/// network plan; `bytes`: bytes of the request (the same over the network either way);
/// `gather_bytes`, `scatter_bytes`: bytes the staged path copies on the prefill and on the
/// decode.
pub fn advise(
    direct_blocks: usize,
    staged_network_blocks: usize,
    bytes: u64,
    gather_bytes: u64,
    scatter_bytes: u64,
    cost: &TransferCost,
) -> Advice {
    let network_s = real(bytes) / cost.network_bytes_per_s;
    let direct_s = real(direct_blocks) * cost.per_block_s + network_s;
    let copy_bytes = gather_bytes.saturating_add(scatter_bytes);
    let staged_s = real(gather_bytes) / cost.copy_bytes_per_s
        + real(staged_network_blocks) * cost.per_block_s
        + network_s
        + real(scatter_bytes) / cost.copy_bytes_per_s;
    let choice = if staged_s < direct_s {
        Choice::Staged
    } else {
        Choice::Direct
    };
    Advice {
        choice,
        direct_s,
        staged_s,
        direct_blocks,
        staged_blocks: staged_network_blocks,
        bytes,
        copy_bytes,
    }
}

/// Direct or staged for one request on an engine of this cost: [`advise`] over the request's
/// own counts, the blocks of its direct plan and of its staged network plan (the template's
/// writer position included), and its bytes (which the gather and the scatter each copy), from
/// [`StagedPlanner::counts`]: nothing is planned.
///
/// # Errors
/// As [`StagedPlanner::counts`].
pub fn transfer_advice<S: PageIndex, D: PageIndex>(
    template: &Template,
    request: &Request<'_, S, D>,
    cost: &TransferCost,
) -> Result<Advice> {
    let counts = StagedPlanner::new(template).counts(request)?;
    Ok(advise(
        counts.direct_blocks,
        counts.network_blocks,
        counts.bytes,
        counts.bytes,
        counts.bytes,
        cost,
    ))
}

/// A count as a float for the estimates: exact below 2^53, and an estimate of seconds needs
/// no more (a count that large is rounded by a relative 1e-16).
#[allow(clippy::cast_precision_loss)]
fn real(count: impl TryInto<u64>) -> f64 {
    count.try_into().map_or(u64::MAX as f64, |c: u64| c as f64)
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // exact sums (powers of two) and values read back unchanged
mod tests {
    use super::*;

    fn cost(per_block_s: f64, net: f64, copy: f64) -> TransferCost {
        TransferCost::new(per_block_s, net, copy).unwrap()
    }

    #[test]
    fn estimates_follow_the_model() {
        // 30 µs per block, 2 GB/s network, 10 GB/s copy.
        let c = cost(30e-6, 2e9, 10e9);
        let a = advise(10_000, 4, 4_000_000, 4_000_000, 4_000_000, &c);
        let network = 4e6 / 2e9;
        assert!((a.direct_s - (10_000.0 * 30e-6 + network)).abs() < 1e-12);
        let staged = 4e6 / 10e9 + 4.0 * 30e-6 + network + 4e6 / 10e9;
        assert!((a.staged_s - staged).abs() < 1e-12);
        assert_eq!(a.choice, Choice::Staged);
        assert_eq!(
            (a.direct_blocks, a.staged_blocks, a.bytes, a.copy_bytes),
            (10_000, 4, 4_000_000, 8_000_000)
        );
    }

    #[test]
    fn few_direct_blocks_stay_direct() {
        // The same blocks either way: staging only adds the copies.
        let a = advise(4, 4, 1 << 20, 1 << 20, 1 << 20, &cost(30e-6, 2e9, 10e9));
        assert_eq!(a.choice, Choice::Direct);
        assert!(a.staged_s > a.direct_s);
    }

    #[test]
    fn the_choice_flips_where_saved_blocks_pay_for_the_copies() {
        // Copies of 2 × 1 MB at 1 GB/s cost 2 ms; each saved block 1 µs: break-even at 2,000
        // saved blocks. One network block either side of it.
        let c = cost(1e-6, 1e9, 1e9);
        let (bytes, network_blocks) = (1_000_000, 1);
        let below = advise(2_000, network_blocks, bytes, bytes, bytes, &c);
        let above = advise(2_002, network_blocks, bytes, bytes, bytes, &c);
        assert_eq!(below.choice, Choice::Direct);
        assert_eq!(above.choice, Choice::Staged);
    }

    #[test]
    fn a_tie_goes_to_direct() {
        // Powers of two keep both sums exact: 3 blocks at 0.25 s = 1 block + 2 × 0.25 s copies.
        let c = cost(0.25, 1.0, 4.0);
        let a = advise(3, 1, 0, 1, 1, &c);
        assert_eq!(a.direct_s, a.staged_s);
        assert_eq!(a.choice, Choice::Direct);
        let empty = advise(0, 0, 0, 0, 0, &c);
        assert_eq!(
            (empty.choice, empty.direct_s, empty.staged_s),
            (Choice::Direct, 0.0, 0.0)
        );
    }

    #[test]
    fn costs_must_be_finite_and_positive() {
        for (i, bad) in [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY]
            .into_iter()
            .enumerate()
        {
            let mut values = [1e-6, 1e9, 1e10];
            values[i % 3] = bad;
            let err = TransferCost::new(values[0], values[1], values[2]).unwrap_err();
            let field = ["per_block_s", "network_bytes_per_s", "copy_bytes_per_s"][i % 3];
            match &err {
                PlanError::InvalidCost { field: f, value } => {
                    assert_eq!(*f, field);
                    assert_eq!(*value, format!("{bad:?}"));
                }
                other => panic!("unexpected error {other:?}"),
            }
            assert!(err.to_string().contains(field), "{err}");
        }
        let c = cost(1e-6, 1e9, 1e10);
        assert_eq!(
            (
                c.per_block_s(),
                c.network_bytes_per_s(),
                c.copy_bytes_per_s()
            ),
            (1e-6, 1e9, 1e10)
        );
    }

    #[test]
    fn choice_names() {
        assert_eq!(Choice::Direct.as_str(), "direct");
        assert_eq!(Choice::Staged.as_str(), "staged");
    }
}
