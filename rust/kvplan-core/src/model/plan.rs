//! A request's plan as data: the output columns, the plan's size before and after emission,
//! and owned buffers for callers that do not bring their own memory.

use crate::error::{PlanError, Result};
use crate::model::pieces::TOKEN_CLASSES;
use crate::model::runs::RunScan;

/// Three output columns of equal length: source addresses, destination addresses, lengths.
pub struct Columns<'a> {
    /// Source addresses.
    pub src_addrs: &'a mut [u64],
    /// Destination addresses.
    pub dst_addrs: &'a mut [u64],
    /// Lengths in bytes.
    pub lengths: &'a mut [u64],
}

impl<'a> Columns<'a> {
    /// Splits one buffer of `3 * capacity` values into three columns of `capacity` values.
    pub fn from_flat(buffer: &'a mut [u64], capacity: usize) -> Self {
        let (src_addrs, rest) = buffer.split_at_mut(capacity);
        let (dst_addrs, rest) = rest.split_at_mut(capacity);
        Self {
            src_addrs,
            dst_addrs,
            lengths: &mut rest[..capacity],
        }
    }

    /// The same columns, borrowed again (for a callee that writes part of them first).
    pub(crate) fn reborrow(&mut self) -> Columns<'_> {
        Columns {
            src_addrs: self.src_addrs,
            dst_addrs: self.dst_addrs,
            lengths: self.lengths,
        }
    }

    /// Values `range` of each column.
    pub fn range(&mut self, range: std::ops::Range<usize>) -> Columns<'_> {
        Columns {
            src_addrs: &mut self.src_addrs[range.clone()],
            dst_addrs: &mut self.dst_addrs[range.clone()],
            lengths: &mut self.lengths[range],
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.src_addrs
            .len()
            .min(self.dst_addrs.len())
            .min(self.lengths.len())
    }
}

/// Whether a request is planned by page (index pairs copied item by item), by token, or as one
/// state slot per side, with what its validating pass found.
// A token shape holds per-lane and per-pool counts on the stack (no allocation per request);
// boxing it would allocate once per planned request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanUnit {
    /// Page plan: what the run scan found (blocks = runs × per-run pieces + pages × per-page
    /// pieces).
    Pages(RunScan),
    /// Token plan (the template plans by token, or `n_tokens` was given).
    Tokens(TokenShape),
    /// State plan: one block per state pair that moves bytes, then the ring rows of each
    /// ring-state pair when the slot request gives the positions it has processed.
    State(StateShape),
}

/// The size of a slot request's plan: its state slots and its ring rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateShape {
    /// Whether the plain state pairs' slots move (a ring-only plan moves none of them).
    pub slots: bool,
    /// Positions the request has processed: each ring pair moves the rows of the last
    /// `min(R_p, R_d, n)` of them (`None`: no ring rows move).
    pub ring_positions: Option<u64>,
    /// Blocks of the ring rows (after the slots' blocks).
    pub ring_blocks: usize,
}

impl StateShape {
    /// A slot request without ring rows.
    pub const SLOTS: StateShape = StateShape {
        slots: true,
        ring_positions: None,
        ring_blocks: 0,
    };
}

/// The size of a token request's plan, known before any output exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenShape {
    /// The request's tokens: the plan moves `first_token..n_tokens`.
    pub n_tokens: u64,
    /// Leading tokens not moved (a delta request's `skip_tokens`; 0 for a whole request).
    pub first_token: u64,
    /// Per pool ([`crate::PoolId::index`]), the global tokens `(first, n)` its entries move:
    /// `(first_token, n_tokens)` for every pool without a token range of its own.
    pub pool_ranges: [(u64, u64); crate::peer::entry::POOLS],
    /// Leading pages of each side's list the plan does not touch (none of their tokens move).
    pub first_pages: (usize, usize),
    /// Leading source pages holding them (`ceil(n_tokens / P_s)`).
    pub src_pages: usize,
    /// Leading destination pages holding them.
    pub dst_pages: usize,
    /// Per further pool ([`crate::PoolId::index`]; place 0, the request's pages, is `src_pages`
    /// and `dst_pages`): the leading pages of each side's list of that pool holding its
    /// entries' tokens, and the leading ones of those the plan does not touch: `(0, 0)` each
    /// for a side without that pool.
    pub pool_pages: [((usize, usize), (usize, usize)); crate::peer::entry::POOLS],
    /// Segments (token ranges inside one page on each side).
    pub n_segments: usize,
    /// Blocks one piece of each class emits.
    pub class_blocks: [usize; TOKEN_CLASSES],
    /// Blocks of the whole plan.
    pub n_blocks: usize,
    /// Bytes the plan moves.
    pub total_bytes: u64,
}

/// A request's plan size: known after one validating pass, before any output exists, and the
/// same once the plan is emitted (the columns then hold `n_blocks` valid values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSummary {
    /// Blocks the plan holds.
    pub n_blocks: usize,
    /// Bytes the plan moves.
    pub total_bytes: u64,
    /// How the request is planned, and what its validating pass found.
    pub unit: PlanUnit,
    /// The state slots (and ring rows) a page request carrying a state slot moves after its
    /// page or token blocks ([`crate::Request::state_slot`]); counted in `n_blocks` and
    /// `total_bytes`. `None` for every other request.
    pub state: Option<StateTail>,
}

/// The state part of a request that carries pages and a state slot: the size of the state
/// plan that follows its page or token blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateTail {
    /// The state plan's shape (its slots, and its ring rows when it has ring positions).
    pub shape: StateShape,
    /// Blocks of the state plan (the last `n_blocks` of the request's plan).
    pub n_blocks: usize,
    /// Bytes the state plan moves.
    pub total_bytes: u64,
}

impl StateTail {
    /// The state plan's own summary, as a slot request's.
    pub fn summary(&self) -> PlanSummary {
        PlanSummary {
            n_blocks: self.n_blocks,
            total_bytes: self.total_bytes,
            unit: PlanUnit::State(self.shape),
            state: None,
        }
    }
}

impl PlanSummary {
    /// A summary of one unit (no state tail).
    pub const fn of(n_blocks: usize, total_bytes: u64, unit: PlanUnit) -> Self {
        Self {
            n_blocks,
            total_bytes,
            unit,
            state: None,
        }
    }

    /// The page (or token) part of a summary with a state tail: the summary without it (the
    /// summary itself when it has none).
    #[must_use]
    pub fn head(&self) -> PlanSummary {
        match self.state {
            Some(tail) => PlanSummary {
                n_blocks: self.n_blocks - tail.n_blocks,
                total_bytes: self.total_bytes - tail.total_bytes,
                unit: self.unit,
                state: None,
            },
            None => *self,
        }
    }

    /// Runs contiguous on both sides (a token plan's segments; a state plan counts its slots as
    /// one run when they move anything, and each ring block as one); a state tail's runs are
    /// added to the page or token runs before it.
    pub fn n_runs(&self) -> usize {
        if let Some(tail) = self.state {
            return self.head().n_runs() + tail.summary().n_runs();
        }
        match self.unit {
            PlanUnit::Pages(found) => found.n_runs,
            PlanUnit::Tokens(tokens) => tokens.n_segments,
            // The slots' blocks are one run; each ring block is a run of its own.
            PlanUnit::State(shape) => {
                usize::from(self.n_blocks > shape.ring_blocks) + shape.ring_blocks
            }
        }
    }

    /// Index pairs of a page plan (0 for token and state plans).
    pub fn n_pages(&self) -> usize {
        match self.unit {
            PlanUnit::Pages(found) => found.n_pages,
            _ => 0,
        }
    }

    /// Leading tokens the plan does not move (a delta request's skip count; 0 otherwise).
    pub fn skip_tokens(&self) -> u64 {
        match self.unit {
            PlanUnit::Tokens(tokens) => tokens.first_token,
            _ => 0,
        }
    }
}

/// An owned plan (allocating convenience over [`Template::plan_into`](crate::Template::plan_into)).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Source addresses.
    pub src_addrs: Vec<u64>,
    /// Destination addresses.
    pub dst_addrs: Vec<u64>,
    /// Lengths in bytes.
    pub lengths: Vec<u64>,
    /// Runs contiguous on both sides.
    pub n_runs: usize,
    /// Bytes moved.
    pub total_bytes: u64,
    /// `n_pairs + 1` block offsets: page pair `p`'s blocks are `pair_offsets[p]..
    /// pair_offsets[p + 1]` (see [`crate::BlockAccounting::pair_offsets`]).
    pub pair_offsets: Vec<usize>,
}

/// A plan's size and pair offsets without its columns: what a planner that writes into a
/// caller's output returns beside it (the columns hold its first `n_blocks` values).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PlanPart {
    /// Blocks written.
    pub n_blocks: usize,
    /// Bytes the blocks move.
    pub total_bytes: u64,
    /// `n_pairs + 1` block offsets: pair `p`'s blocks are `pair_offsets[p]..pair_offsets[p+1]`.
    pub pair_offsets: Vec<usize>,
}

impl PlanPart {
    /// The owned plan of this part over `buffer`, the output it was written into. A rewritten
    /// plan (gather, scatter) counts every block as its own run.
    ///
    /// # Errors
    /// [`PlanError::OutOfMemory`].
    pub(crate) fn into_plan(self, buffer: FlatBuffer) -> Result<Plan> {
        let (mut src_addrs, dst_addrs, lengths) = buffer.into_columns(self.n_blocks)?;
        // The source column keeps the allocation of the whole output; give the rest back.
        src_addrs.shrink_to_fit();
        Ok(Plan {
            src_addrs,
            dst_addrs,
            lengths,
            n_runs: self.n_blocks,
            total_bytes: self.total_bytes,
            pair_offsets: self.pair_offsets,
        })
    }
}

/// Something that lends three output columns (a pooled flat buffer, borrowed numpy rows…).
pub trait AsColumns<'o> {
    /// The columns.
    fn columns(&mut self) -> Columns<'_>;
}

impl<'o> AsColumns<'o> for Columns<'o> {
    fn columns(&mut self) -> Columns<'_> {
        Columns {
            src_addrs: self.src_addrs,
            dst_addrs: self.dst_addrs,
            lengths: self.lengths,
        }
    }
}

/// One owned allocation holding three columns of `capacity` values back to back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FlatBuffer {
    /// `3 * capacity` values: sources, then destinations, then lengths.
    pub data: Vec<u64>,
    /// Values per column.
    pub capacity: usize,
}

impl FlatBuffer {
    /// A zero-filled buffer of `capacity` values per column (aborts when memory runs out; see
    /// [`FlatBuffer::try_zeroed`] for sizes that come from a request).
    pub fn zeroed(capacity: usize) -> Self {
        Self {
            data: vec![0; capacity.saturating_mul(3)],
            capacity,
        }
    }

    /// A zero-filled buffer of `capacity` values per column, or an error naming its size.
    ///
    /// # Errors
    /// [`PlanError::OutOfMemory`].
    pub fn try_zeroed(capacity: usize) -> Result<Self> {
        let values = capacity.checked_mul(3).ok_or(PlanError::OutOfMemory {
            what: "plan output",
            bytes: capacity as u128 * 24,
        })?;
        Ok(Self {
            data: crate::error::try_vec(values, 0, "plan output")?,
            capacity,
        })
    }

    /// The first `n` values of each column as three owned vectors (the source column keeps
    /// this buffer's allocation).
    ///
    /// # Errors
    /// [`PlanError::OutOfMemory`] when the two other columns cannot be allocated.
    pub fn into_columns(self, n: usize) -> Result<(Vec<u64>, Vec<u64>, Vec<u64>)> {
        let Self { mut data, capacity } = self;
        let n = n.min(capacity);
        let copy = |from: usize| -> Result<Vec<u64>> {
            let mut column = Vec::new();
            column
                .try_reserve_exact(n)
                .map_err(|_| PlanError::out_of_memory::<u64>("plan column", n))?;
            column.extend_from_slice(&data[from..from + n]);
            Ok(column)
        };
        let lengths = copy(2 * capacity)?;
        let dst_addrs = copy(capacity)?;
        data.truncate(n);
        Ok((data, dst_addrs, lengths))
    }
}

impl AsColumns<'_> for FlatBuffer {
    fn columns(&mut self) -> Columns<'_> {
        Columns::from_flat(&mut self.data, self.capacity)
    }
}
