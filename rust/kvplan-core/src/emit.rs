//! Per-request block emission: runs × entry pairs → `(src_addr, dst_addr, length)` columns.
//!
//! Blocks are entry-pair major, run minor (SGLang's order), so pair `p`'s blocks are the
//! contiguous slice `p*R .. (p+1)*R` of the output, `R` being the request's run count.
//!
//! The hot path allocates nothing: the runs are first written into the output's own first `R`
//! slots (as page indices), then every pair's blocks are expanded, last pair first, so that
//! pair 0 finally overwrites the runs in place. A pair whose item length equals the pair
//! expanded just before it is derived from that pair's blocks by adding the base difference;
//! requests with a handful of runs are expanded from a stack copy instead. Every index is
//! validated against every paired buffer's capacity before the first address is computed (and
//! each run again while it is written), and layouts guarantee `base + capacity * item_len` fits
//! in u64, so the expansion cannot overflow.

use crate::error::{PlanError, Result, Side};
use crate::runs::{IndexLimits, PageIndex, RunScan, scan, write_runs};
use crate::template::{PairSpec, Template};

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

    fn capacity(&self) -> usize {
        self.src_addrs
            .len()
            .min(self.dst_addrs.len())
            .min(self.lengths.len())
    }
}

/// The size of a request's plan, known after one validating pass and before any output exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanShape {
    /// What the run scan found.
    pub scan: RunScan,
    /// Blocks the plan holds: runs × emitting pairs.
    pub n_blocks: usize,
    /// Bytes the plan moves: pages × bytes per page.
    pub total_bytes: u64,
}

/// A finished plan's size (the columns hold `n_blocks` valid values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSummary {
    /// Runs contiguous on both sides.
    pub n_runs: usize,
    /// Blocks written.
    pub n_blocks: usize,
    /// Bytes moved.
    pub total_bytes: u64,
}

/// An owned plan (allocating convenience over [`Template::plan_into`]).
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
}

impl Template {
    /// Validates a request's page indices and returns the size of its plan.
    ///
    /// # Errors
    /// Unequal lengths, a negative index, an index outside any paired buffer, a repeated
    /// destination index (when the template checks overlap) or overflow of the totals.
    pub fn prepare<S: PageIndex, D: PageIndex>(&self, src: &[S], dst: &[D]) -> Result<PlanShape> {
        let found = scan(src, dst)?;
        if found.n_pages > 0 {
            // One comparison per side covers every pair: the limits are the smallest capacities.
            if found.max_src >= self.src_limit {
                return Err(self.out_of_range(Side::Src, src));
            }
            if found.max_dst >= self.dst_limit {
                return Err(self.out_of_range(Side::Dst, dst));
            }
            if self.check_dst_overlap {
                check_unique(dst)?;
            }
        }
        let n_blocks =
            found
                .n_runs
                .checked_mul(self.emitting.len())
                .ok_or(PlanError::Overflow {
                    what: "block count",
                })?;
        let total_bytes = (found.n_pages as u64)
            .checked_mul(self.bytes_per_page)
            .ok_or(PlanError::Overflow {
                what: "total bytes",
            })?;
        Ok(PlanShape {
            scan: found,
            n_blocks,
            total_bytes,
        })
    }

    /// Plans one request into columns obtained from `make_output` once the plan size is known.
    ///
    /// Allocates nothing itself. `make_output` receives the validated shape and returns columns
    /// of at least `shape.n_blocks` values each (a pooled buffer, a caller's `out=` array…).
    ///
    /// # Errors
    /// As [`Template::prepare`], whatever `make_output` returns, [`PlanError::OutputTooSmall`],
    /// or an index that changed between validation and emission (inputs mutated concurrently).
    pub fn plan_into<'o, S: PageIndex, D: PageIndex, O>(
        &self,
        src: &[S],
        dst: &[D],
        make_output: impl FnOnce(&PlanShape) -> Result<O>,
    ) -> Result<(O, PlanSummary)>
    where
        O: AsColumns<'o>,
    {
        let shape = self.prepare(src, dst)?;
        let mut output = make_output(&shape)?;
        let summary = self.emit(src, dst, &shape, output.columns())?;
        Ok((output, summary))
    }

    fn emit<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        shape: &PlanShape,
        out: Columns<'_>,
    ) -> Result<PlanSummary> {
        let pairs = &self.emitting;
        if out.capacity() < shape.n_blocks {
            return Err(PlanError::OutputTooSmall {
                have: out.capacity(),
                need: shape.n_blocks,
            });
        }
        if pairs.is_empty() || shape.scan.n_pages == 0 {
            return Ok(PlanSummary {
                n_runs: shape.scan.n_runs,
                n_blocks: 0,
                total_bytes: shape.total_bytes,
            });
        }
        // Runs go into the first slots as page indices; limits are re-checked per run, and a
        // run count that differs from the validating scan means the inputs changed meanwhile.
        let expected = shape.scan.n_runs;
        let limits = IndexLimits {
            src: self.src_limit,
            dst: self.dst_limit,
        };
        let runs = write_runs(
            src,
            dst,
            limits,
            &mut out.src_addrs[..expected],
            &mut out.dst_addrs[..expected],
            &mut out.lengths[..expected],
        )
        .map_err(|err| match err {
            PlanError::OutputTooSmall { .. } => PlanError::InputChanged,
            other => other,
        })?;
        if runs != expected {
            return Err(PlanError::InputChanged);
        }
        if runs <= SMALL_RUNS {
            expand_small(pairs, runs, out);
            return Ok(PlanSummary {
                n_runs: runs,
                n_blocks: runs * pairs.len(),
                total_bytes: shape.total_bytes,
            });
        }
        // Last pair first, so the runs in slots 0..R survive until pair 0 overwrites them.
        // A pair with the same item length as the pair expanded just before it (every MLA
        // layer, every K and every V entry) is that pair's blocks shifted by the difference of
        // the bases: an add per value instead of a 64-bit multiply.
        let mut previous: Option<(usize, &PairSpec)> = None;
        for (p, pair) in pairs.iter().enumerate().rev() {
            let to = p * runs;
            let columns = [&mut *out.src_addrs, &mut *out.dst_addrs, &mut *out.lengths];
            match previous {
                Some((from, prev)) if prev.item_len == pair.item_len => {
                    let src_delta = pair.src_base.wrapping_sub(prev.src_base);
                    let dst_delta = pair.dst_base.wrapping_sub(prev.dst_base);
                    let [src_col, dst_col, len_col] = columns;
                    derive(src_col, runs, from, to, |x| x.wrapping_add(src_delta));
                    derive(dst_col, runs, from, to, |x| x.wrapping_add(dst_delta));
                    derive(len_col, runs, from, to, |x| x);
                }
                _ => {
                    let item = pair.item_len;
                    let [src_col, dst_col, len_col] = columns;
                    derive(src_col, runs, 0, to, |x| pair.src_base + x * item);
                    derive(dst_col, runs, 0, to, |x| pair.dst_base + x * item);
                    derive(len_col, runs, 0, to, |x| x * item);
                }
            }
            previous = Some((to, pair));
        }
        Ok(PlanSummary {
            n_runs: runs,
            n_blocks: runs * pairs.len(),
            total_bytes: shape.total_bytes,
        })
    }

    /// Allocating convenience: plans one request into freshly allocated columns.
    ///
    /// # Errors
    /// As [`Template::plan_into`].
    pub fn plan<S: PageIndex, D: PageIndex>(&self, src: &[S], dst: &[D]) -> Result<Plan> {
        let (buffer, summary) =
            self.plan_into(src, dst, |shape| FlatBuffer::try_zeroed(shape.n_blocks))?;
        let (src_addrs, dst_addrs, lengths) = buffer.into_columns(summary.n_blocks)?;
        Ok(Plan {
            src_addrs,
            dst_addrs,
            lengths,
            n_runs: summary.n_runs,
            total_bytes: summary.total_bytes,
        })
    }

    /// Plans one per-request state slot: one block per state pair with a non-zero item length,
    /// `(src_base + item_len*src_slot, dst_base + item_len*dst_slot, item_len)`.
    ///
    /// # Errors
    /// A negative slot or one outside a paired buffer's capacity; [`PlanError::OutputTooSmall`].
    pub fn plan_state_into(&self, src_slot: i64, dst_slot: i64, out: Columns<'_>) -> Result<usize> {
        // Elided state entries (item_len 0) move nothing and hold no slots, as page entries.
        let pairs = || self.state_pairs.iter().filter(|p| p.item_len > 0);
        let n = pairs().count();
        if out.capacity() < n {
            return Err(PlanError::OutputTooSmall {
                have: out.capacity(),
                need: n,
            });
        }
        for (side, slot) in [(Side::Src, src_slot), (Side::Dst, dst_slot)] {
            if slot < 0 {
                return Err(PlanError::NegativeIndex {
                    side,
                    index: slot,
                    position: 0,
                });
            }
        }
        let (s, d) = (src_slot as u64, dst_slot as u64);
        for (k, pair) in pairs().enumerate() {
            if s >= pair.src_capacity {
                return Err(self.state_out_of_range(Side::Src, src_slot, pair));
            }
            if d >= pair.dst_capacity {
                return Err(self.state_out_of_range(Side::Dst, dst_slot, pair));
            }
            // In bounds, so the layout's base + len check rules out overflow.
            out.src_addrs[k] = pair.src_base + s * pair.item_len;
            out.dst_addrs[k] = pair.dst_base + d * pair.item_len;
            out.lengths[k] = pair.item_len;
        }
        Ok(n)
    }

    fn out_of_range<T: PageIndex>(&self, side: Side, values: &[T]) -> PlanError {
        // Report the first position that breaks the first pair it does not fit.
        for pair in &self.emitting {
            let capacity = if side == Side::Src {
                pair.src_capacity
            } else {
                pair.dst_capacity
            };
            if let Some((position, index)) = values
                .iter()
                .map(|v| v.get())
                .enumerate()
                .find(|&(_, v)| v as u64 >= capacity)
            {
                let entry = if side == Side::Src {
                    pair.src_entry
                } else {
                    pair.dst_entry
                };
                return PlanError::IndexOutOfRange {
                    side,
                    index,
                    position,
                    capacity,
                    entry,
                    label: self.entry_label(side, entry),
                    item_len: pair.item_len,
                };
            }
        }
        PlanError::InputChanged
    }

    fn state_out_of_range(&self, side: Side, slot: i64, pair: &PairSpec) -> PlanError {
        let (capacity, entry) = if side == Side::Src {
            (pair.src_capacity, pair.src_entry)
        } else {
            (pair.dst_capacity, pair.dst_entry)
        };
        PlanError::IndexOutOfRange {
            side,
            index: slot,
            position: 0,
            capacity,
            entry,
            label: self.entry_label(side, entry),
            item_len: pair.item_len,
        }
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

/// Requests with at most this many runs are expanded pair by pair from a stack copy of the
/// runs: for a handful of runs per pair, per-pair bookkeeping would cost more than the blocks.
const SMALL_RUNS: usize = 8;

fn expand_small(pairs: &[PairSpec], runs: usize, out: Columns<'_>) {
    let mut starts = [[0u64; SMALL_RUNS]; 3];
    starts[0][..runs].copy_from_slice(&out.src_addrs[..runs]);
    starts[1][..runs].copy_from_slice(&out.dst_addrs[..runs]);
    starts[2][..runs].copy_from_slice(&out.lengths[..runs]);
    let blocks = out
        .src_addrs
        .chunks_exact_mut(runs)
        .zip(out.dst_addrs.chunks_exact_mut(runs))
        .zip(out.lengths.chunks_exact_mut(runs));
    for (pair, ((src, dst), len)) in pairs.iter().zip(blocks) {
        let item = pair.item_len;
        for r in 0..runs {
            src[r] = pair.src_base + starts[0][r] * item;
            dst[r] = pair.dst_base + starts[1][r] * item;
            len[r] = starts[2][r] * item;
        }
    }
}

/// `col[to..to+n] = f(col[from..from+n])`, in place when `from == to` (each value is read
/// before it is written); the two ranges never partly overlap (they are whole pair blocks).
fn derive(col: &mut [u64], n: usize, from: usize, to: usize, f: impl Fn(u64) -> u64) {
    use std::cmp::Ordering;
    match from.cmp(&to) {
        Ordering::Equal => col[to..to + n].iter_mut().for_each(|x| *x = f(*x)),
        Ordering::Less => {
            let (head, tail) = col.split_at_mut(to);
            let outputs = tail[..n].iter_mut().zip(&head[from..from + n]);
            outputs.for_each(|(out, &x)| *out = f(x));
        }
        Ordering::Greater => {
            let (head, tail) = col.split_at_mut(from);
            let outputs = head[to..to + n].iter_mut().zip(&tail[..n]);
            outputs.for_each(|(out, &x)| *out = f(x));
        }
    }
}

fn check_unique<T: PageIndex>(dst: &[T]) -> Result<()> {
    // Only when the template asks for it: this is the one allocating check (16 bytes per
    // index, so its allocation may fail for a large request).
    let mut seen: Vec<(i64, usize)> = Vec::new();
    seen.try_reserve_exact(dst.len())
        .map_err(|_| PlanError::out_of_memory::<(i64, usize)>("the overlap check", dst.len()))?;
    seen.extend(dst.iter().map(|v| v.get()).zip(0..));
    seen.sort_unstable();
    match seen.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(PlanError::DuplicateDestination {
            index: w[0].0,
            first: w[0].1,
            second: w[1].1,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Layout, LayoutContext};
    use crate::template::TemplateOptions;

    fn template(src: &Layout, dst: &Layout) -> Template {
        Template::new(src, dst, TemplateOptions::default()).unwrap()
    }

    #[test]
    fn e10_mla_flat() {
        let ctx = LayoutContext::default;
        let src = Layout::mla(vec![1000, 2000], vec![640; 2], vec![64; 2], None, ctx()).unwrap();
        let dst = Layout::mla(vec![5000, 6000], vec![1024; 2], vec![64; 2], None, ctx()).unwrap();
        let plan = template(&src, &dst)
            .plan(&[0i32, 1, 2, 7], &[10i32, 11, 12, 3])
            .unwrap();
        assert_eq!(plan.src_addrs, vec![1000, 1448, 2000, 2448]);
        assert_eq!(plan.dst_addrs, vec![5640, 5192, 6640, 6192]);
        assert_eq!(plan.lengths, vec![192, 64, 192, 64]);
        assert_eq!((plan.n_runs, plan.total_bytes), (2, 512));
    }

    #[test]
    fn index_past_capacity_is_rejected_with_values() {
        let ctx = LayoutContext::default;
        let src = Layout::mla(vec![0], vec![64], vec![16], Some(vec![0]), ctx()).unwrap();
        let dst = Layout::mla(vec![0], vec![64], vec![16], Some(vec![0]), ctx()).unwrap();
        let err = template(&src, &dst)
            .plan(&[0i64, 4], &[0i64, 1])
            .unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::IndexOutOfRange {
                    side: Side::Src,
                    index: 4,
                    position: 1,
                    capacity: 4,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn elided_state_entries_emit_nothing_and_hold_no_slots() {
        // Found by the Python fuzz run: an item_len-0 state entry (capacity 0) made every
        // slot out of range, while page entries with item_len 0 are simply skipped.
        let ctx = LayoutContext::default;
        let empty = || Layout::mla(vec![], vec![], vec![], None, ctx()).unwrap();
        let src = empty()
            .with_state(
                "conv",
                vec![1000, 2000],
                vec![0, 160],
                vec![0, 16],
                vec![0, 1],
            )
            .unwrap();
        let dst = empty()
            .with_state(
                "conv",
                vec![5000, 6000],
                vec![0, 160],
                vec![0, 16],
                vec![0, 1],
            )
            .unwrap();
        let t = template(&src, &dst);
        let mut buf = FlatBuffer::zeroed(2);
        let n = t.plan_state_into(3, 4, buf.columns()).unwrap();
        assert_eq!(
            buf.into_columns(n).unwrap(),
            (vec![2048], vec![6064], vec![16])
        );
        let mut buf = FlatBuffer::zeroed(2);
        assert!(matches!(
            t.plan_state_into(-1, 0, buf.columns()),
            Err(PlanError::NegativeIndex { .. })
        ));
    }

    #[test]
    fn an_output_too_large_to_allocate_is_an_error_not_an_abort() {
        for capacity in [usize::MAX, usize::MAX / 3, (isize::MAX as usize) / 8] {
            let err = FlatBuffer::try_zeroed(capacity).unwrap_err();
            assert_eq!(err.class(), crate::ErrorClass::Memory, "{err}");
            assert!(err.to_string().starts_with("cannot allocate "), "{err}");
        }
        assert_eq!(
            PlanError::out_of_memory::<u64>("plan output", usize::MAX).to_string(),
            format!(
                "cannot allocate {} bytes for plan output",
                u128::from(u64::MAX) * 8
            )
        );
        assert_eq!(FlatBuffer::try_zeroed(2).unwrap(), FlatBuffer::zeroed(2));
    }

    #[test]
    fn state_slot_e17() {
        let ctx = LayoutContext::default;
        let src = Layout::mla(vec![], vec![], vec![], None, ctx())
            .unwrap()
            .with_state("mamba", vec![1000], vec![160], vec![16], vec![7])
            .unwrap();
        let dst = Layout::mla(vec![], vec![], vec![], None, ctx())
            .unwrap()
            .with_state(
                "mamba",
                vec![2000, 3000],
                vec![80, 160],
                vec![8, 16],
                vec![3, 7],
            )
            .unwrap();
        let t = template(&src, &dst);
        let mut buf = FlatBuffer::zeroed(1);
        let n = t.plan_state_into(2, 3, buf.columns()).unwrap();
        assert_eq!((n, buf.data), (1, vec![1032, 3048, 16]));
    }
}
