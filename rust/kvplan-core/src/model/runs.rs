//! Grouping paired page indices into maximal runs that are contiguous on both sides.
//!
//! Two rules ([`RunRule`]), one implementation:
//! - [`RunRule::Ascending`] (SGLang's `group_concurrent_contiguous`, [`group_contiguous`]): a
//!   run breaks at position `i + 1` as soon as either side's step is not exactly `+1`
//!   (duplicates, descents and gaps all break);
//! - [`RunRule::EitherDirection`] (what plans use): a run also continues while *both* sides step
//!   by exactly `-1` (pages handed over in offload or eviction order: `[7, 6, 5] → [3, 2, 1]`
//!   copies pages `5..8` to `1..4`, one contiguous block per entry on each side). A run never
//!   mixes directions: a step in the other direction, or opposite steps on the two sides, breaks
//!   it. Runs are taken greedily from the first position.
//!
//! A plan is a set of copies, so a descending run is emitted as the ascending run over the same
//! pages (its lowest page first on each side); pieces with one block per page keep the
//! request's page order. A caller that expands each index into several consecutive ones before
//! planning (vLLM's kernel blocks) reorders the pairs first ([`reverse_descending_runs`]): the
//! rule above sees only steps of one, and an expanded descending stretch steps down by pieces.
//!
//! Runs are computed in two passes so nothing is allocated: [`scan`] / [`scan_runs`] validate
//! and count, [`write_runs`] fills caller-provided slices.

use crate::error::{PlanError, Result, Side, try_vec};

/// An integer page or slot index as engines hand it over (SGLang uses int32, others int64).
///
/// Comparisons and steps work in the native width: the scans then vectorise on baseline x86-64
/// (SSE2 has 32-bit compares but no 64-bit min/max), which matters for int32 page tables.
pub trait PageIndex: Copy + Ord + Send + Sync + 'static {
    /// The index widened to `i64`.
    fn get(self) -> i64;
    /// Whether `next == self + 1` (computed without overflow).
    fn steps_to(self, next: Self) -> bool;
}

macro_rules! page_index {
    ($($t:ty),*) => {$(
        impl PageIndex for $t {
            #[inline]
            fn get(self) -> i64 {
                i64::from(self)
            }
            #[inline]
            fn steps_to(self, next: Self) -> bool {
                // A wrapped difference is never exactly 1 unless the true step is 1.
                next.wrapping_sub(self) == 1
            }
        }
    )*};
}
page_index!(i32, i64);

/// Which steps between consecutive index pairs continue a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunRule {
    /// Both sides step by `+1` (SGLang's `group_concurrent_contiguous`).
    Ascending,
    /// Both sides step by `+1`, or both by `-1`, for the whole run (plans).
    #[default]
    EitherDirection,
}

/// Set in a run's length slot by [`write_runs`] under [`RunRule::EitherDirection`] for a run
/// whose pages descend in request order (its start is then its lowest page on each side). Run
/// lengths never reach it: a run has fewer pages than a slice can hold.
pub(crate) const DESCENDING: u64 = 1 << 63;

/// What one validating pass over a request's index arrays found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunScan {
    /// Number of index pairs.
    pub n_pages: usize,
    /// Number of maximal runs contiguous on both sides.
    pub n_runs: usize,
    /// Largest source index (0 when empty).
    pub max_src: u64,
    /// Largest destination index (0 when empty).
    pub max_dst: u64,
    /// Runs of two or more pages that descend (only under [`RunRule::EitherDirection`]).
    pub descending_runs: usize,
}

/// Validates a request's index arrays (equal lengths, no negative value) and counts its runs
/// under [`RunRule::Ascending`].
///
/// # Errors
/// As [`scan_runs`].
pub fn scan<S: PageIndex, D: PageIndex>(src: &[S], dst: &[D]) -> Result<RunScan> {
    scan_runs(src, dst, RunRule::Ascending)
}

/// Validates a request's index arrays (equal lengths, no negative value) and counts its runs
/// under `rule`.
///
/// Branch-free passes (min/max of each side, then run breaks and descending steps) that the
/// compiler vectorises; only a request with steps of `-1` on both sides takes a sequential
/// pass for its runs, and positions are only looked up on the error path.
///
/// # Errors
/// [`PlanError::LengthMismatch`] or [`PlanError::NegativeIndex`].
pub fn scan_runs<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
    rule: RunRule,
) -> Result<RunScan> {
    if src.len() != dst.len() {
        return Err(PlanError::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    let ((min_src, max_src), (min_dst, max_dst), breaks, descents) = if src.len() <= SHORT_SCAN {
        scan_short(src, dst)
    } else {
        let descents = if rule == RunRule::EitherDirection && !src.is_empty() {
            count_descents(src, dst)
        } else {
            0
        };
        let breaks = if src.is_empty() {
            0
        } else {
            count_breaks(src, dst)
        };
        (min_max(src), min_max(dst), breaks, descents)
    };
    if min_src < 0 {
        return Err(first_negative(Side::Src, src));
    }
    if min_dst < 0 {
        return Err(first_negative(Side::Dst, dst));
    }
    let (mut n_runs, mut descending_runs) = if src.is_empty() {
        (0, 0)
    } else {
        (1 + breaks, 0)
    };
    if rule == RunRule::EitherDirection && !src.is_empty() && descents > 0 {
        let mut runs = 0;
        for_each_run(src, dst, |_, _, descending| {
            runs += 1;
            descending_runs += usize::from(descending);
        });
        n_runs = runs;
    }
    Ok(RunScan {
        n_pages: src.len(),
        n_runs,
        max_src: max_src as u64,
        max_dst: max_dst as u64,
        descending_runs,
    })
}

/// Requests of at most this many pages are scanned in one fused pass ([`scan_short`]): for a
/// few pages, the setup of four vectorised passes costs more than the pages themselves (a
/// batch of many small requests scans each one).
const SHORT_SCAN: usize = 64;

/// `((min, max) of src, (min, max) of dst, breaks, descents)` of two equally long slices in
/// one pass: the values [`min_max`], [`count_breaks`] and [`count_descents`] give.
fn scan_short<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
) -> ((i64, i64), (i64, i64), usize, usize) {
    let (Some(&s0), Some(&d0)) = (src.first(), dst.first()) else {
        return ((0, 0), (0, 0), 0, 0);
    };
    let (mut src_range, mut dst_range) = ((s0, s0), (d0, d0));
    let (mut breaks, mut descents) = (0usize, 0usize);
    let src_steps = src.iter().zip(&src[1..]);
    let dst_steps = dst.iter().zip(&dst[1..]);
    for ((&a0, &a1), (&b0, &b1)) in src_steps.zip(dst_steps) {
        src_range = (src_range.0.min(a1), src_range.1.max(a1));
        dst_range = (dst_range.0.min(b1), dst_range.1.max(b1));
        breaks += usize::from(!(steps(a0, a1) & steps(b0, b1)));
        descents += usize::from(steps(a1, a0) & steps(b1, b0));
    }
    (
        (src_range.0.get(), src_range.1.get()),
        (dst_range.0.get(), dst_range.1.get()),
        breaks,
        descents,
    )
}

/// Positions `i >= 1` where both sides step by exactly `-1` (branch-free, like the breaks).
#[inline]
fn count_descents<S: PageIndex, D: PageIndex>(src: &[S], dst: &[D]) -> usize {
    let src_steps = src.iter().zip(&src[1..]);
    let dst_steps = dst.iter().zip(&dst[1..]);
    src_steps
        .zip(dst_steps)
        .map(|((&s0, &s1), (&d0, &d1))| usize::from(s1.steps_to(s0) & d1.steps_to(d0)))
        .sum()
}

/// The runs of a non-empty request under [`RunRule::EitherDirection`], in order, as `(first
/// position, pages, descending)`: the one sequential definition that counting and writing
/// share. A run of one page continues in whichever direction the next step takes both sides;
/// a longer one only in its own.
fn for_each_run<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
    mut run: impl FnMut(usize, usize, bool),
) {
    let len = src.len().min(dst.len());
    let (mut start, mut direction) = (0usize, None::<bool>); // Some(true): descending
    for i in 1..len {
        let up = steps(src[i - 1], src[i]) & steps(dst[i - 1], dst[i]);
        let down = steps(src[i], src[i - 1]) & steps(dst[i], dst[i - 1]);
        let step = if up {
            Some(false)
        } else if down {
            Some(true)
        } else {
            None
        };
        match (step, direction) {
            (Some(s), None) => direction = Some(s),
            (Some(s), Some(d)) if s == d => {}
            _ => {
                run(start, i - start, direction == Some(true));
                (start, direction) = (i, None);
            }
        }
    }
    run(start, len - start, direction == Some(true));
}

/// `(min, max)` of the values, `(0, 0)` when empty.
fn min_max<T: PageIndex>(values: &[T]) -> (i64, i64) {
    let Some(&first) = values.first() else {
        return (0, 0);
    };
    let (lo, hi) = values
        .iter()
        .fold((first, first), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    (lo.get(), hi.get())
}

#[inline]
fn steps<T: PageIndex>(prev: T, next: T) -> bool {
    prev.steps_to(next)
}

/// For each consecutive pair of positions, whether a run breaks there: either side's step is
/// not exactly +1. Both counting and masking go through this one definition.
#[inline]
fn step_breaks<'a, S: PageIndex, D: PageIndex>(
    src: &'a [S],
    dst: &'a [D],
) -> impl Iterator<Item = bool> + 'a {
    let src_steps = src.iter().zip(&src[1..]);
    let dst_steps = dst.iter().zip(&dst[1..]);
    src_steps
        .zip(dst_steps)
        .map(|((&s0, &s1), (&d0, &d1))| !(steps(s0, s1) & steps(d0, d1)))
}

/// Positions `i >= 1` where a run breaks.
#[inline]
fn count_breaks<S: PageIndex, D: PageIndex>(src: &[S], dst: &[D]) -> usize {
    step_breaks(src, dst).map(usize::from).sum()
}

/// Bit `k` set when a run breaks between `src[k]` and `src[k + 1]`; at most 65 values per call.
#[inline]
fn break_mask<S: PageIndex, D: PageIndex>(src: &[S], dst: &[D]) -> u64 {
    step_breaks(src, dst)
        .enumerate()
        .fold(0u64, |mask, (k, broken)| mask | (u64::from(broken) << k))
}

fn first_negative<T: PageIndex>(side: Side, values: &[T]) -> PlanError {
    // The error reports a value the caller passed, never a placeholder: when the negative value
    // the scan saw is gone by now, the array was written concurrently.
    values
        .iter()
        .map(|v| v.get())
        .enumerate()
        .find(|&(_, v)| v < 0)
        .map_or(PlanError::InputChanged, |(position, index)| {
            PlanError::NegativeIndex {
                side,
                index,
                position,
            }
        })
}

/// Exclusive upper bounds that every source / destination index must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexLimits {
    /// Every source index must be below this.
    pub src: u64,
    /// Every destination index must be below this.
    pub dst: u64,
}

impl IndexLimits {
    /// No bound beyond non-negativity.
    pub const NONE: Self = Self {
        src: u64::MAX,
        dst: u64::MAX,
    };
}

/// Writes the runs of `(src, dst)` as `(src_start, dst_start, length)` into three slices and
/// returns how many it wrote. Under [`RunRule::EitherDirection`], when the scan found
/// descending runs (`found.descending_runs > 0`), a descending run is written with its lowest
/// page on each side as its start and its top bit (`1 << 63`) set in its length.
///
/// Every run is checked against `limits` again (its lowest and highest index: inside a run the
/// values step by one), so inputs mutated after [`scan_runs`] validated them (another thread
/// writing the arrays while the GIL is released) cannot yield an out-of-bounds run.
///
/// # Errors
/// [`PlanError::OutputTooSmall`] when an output slice is shorter than the run count, or
/// [`PlanError::InputChanged`] when a run breaks `limits` (or is negative).
pub fn write_runs<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
    limits: IndexLimits,
    src_starts: &mut [u64],
    dst_starts: &mut [u64],
    lengths: &mut [u64],
) -> Result<usize> {
    write_runs_by(src, dst, limits, false, [src_starts, dst_starts, lengths])
}

/// [`write_runs`] with descending runs (`descending`: the scan under
/// [`RunRule::EitherDirection`] found some; otherwise every run ascends and the vectorised
/// path writes them).
pub(crate) fn write_runs_by<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
    limits: IndexLimits,
    descending: bool,
    [src_starts, dst_starts, lengths]: [&mut [u64]; 3],
) -> Result<usize> {
    let capacity = src_starts.len().min(dst_starts.len()).min(lengths.len());
    let (Some(&s0), Some(&d0)) = (src.first(), dst.first()) else {
        return Ok(0);
    };
    if capacity == 0 {
        return Err(PlanError::OutputTooSmall { have: 0, need: 1 });
    }
    if descending {
        return write_either_direction(src, dst, limits, [src_starts, dst_starts, lengths]);
    }
    // First pass: each run's first indices, and (in `lengths`) the position where it starts.
    // Positions are examined 64 at a time as a bit mask of breaks (a branch-free, vectorisable
    // computation), so long contiguous stretches cost a few instructions per page and only the
    // breaks themselves take the slow path.
    (src_starts[0], dst_starts[0], lengths[0]) = (s0.get() as u64, d0.get() as u64, 0);
    let mut n = 1usize;
    let len = src.len().min(dst.len());
    let mut chunk_start = 1usize;
    while chunk_start < len {
        let chunk_end = (chunk_start + 64).min(len);
        let mut breaks = break_mask(
            &src[chunk_start - 1..chunk_end],
            &dst[chunk_start - 1..chunk_end],
        );
        while breaks != 0 {
            let position = chunk_start + breaks.trailing_zeros() as usize;
            breaks &= breaks - 1;
            if n == capacity {
                return Err(PlanError::OutputTooSmall {
                    have: capacity,
                    need: n + 1,
                });
            }
            (src_starts[n], dst_starts[n], lengths[n]) = (
                src[position].get() as u64,
                dst[position].get() as u64,
                position as u64,
            );
            n += 1;
        }
        chunk_start = chunk_end;
    }
    // Second pass: start positions become lengths; each run's span is checked.
    let total = len as u64;
    for r in 0..n {
        let end = if r + 1 < n { lengths[r + 1] } else { total };
        let len = end - lengths[r];
        lengths[r] = len;
        // `as u64` turned negatives into huge values, which the limits reject too.
        let fits = |start: u64, limit: u64| {
            start < limit && start.checked_add(len - 1).is_some_and(|last| last < limit)
        };
        if !fits(src_starts[r], limits.src) || !fits(dst_starts[r], limits.dst) {
            return Err(PlanError::InputChanged);
        }
    }
    Ok(n)
}

/// The sequential writer of [`write_runs_by`] for requests with descending runs.
fn write_either_direction<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
    limits: IndexLimits,
    [src_starts, dst_starts, lengths]: [&mut [u64]; 3],
) -> Result<usize> {
    let capacity = src_starts.len().min(dst_starts.len()).min(lengths.len());
    let (mut n, mut failed) = (0usize, None);
    for_each_run(src, dst, |at, pages, descending| {
        if failed.is_some() {
            return;
        }
        if n == capacity {
            failed = Some(PlanError::OutputTooSmall {
                have: capacity,
                need: n + 1,
            });
            return;
        }
        // The lowest page of each side: the last of a descending run, else the first.
        let low = if descending { at + pages - 1 } else { at };
        let (s, d) = (src[low].get(), dst[low].get());
        let len = pages as u64;
        // `as u64` turns negatives into huge values, which the limits reject too.
        let fits = |start: i64, limit: u64| {
            let start = start as u64;
            start < limit && start.checked_add(len - 1).is_some_and(|last| last < limit)
        };
        if !fits(s, limits.src) || !fits(d, limits.dst) {
            failed = Some(PlanError::InputChanged);
            return;
        }
        let flag = if descending { DESCENDING } else { 0 };
        (src_starts[n], dst_starts[n], lengths[n]) = (s as u64, d as u64, len | flag);
        n += 1;
    });
    failed.map_or(Ok(n), Err)
}

/// A request's index pairs reordered so that each stretch stepping by `-1` on both sides reads
/// ascending: the same pairs, so the same copies. For a caller that expands every index into
/// several consecutive sub-indices before planning (vLLM's kernel blocks): a descending
/// stretch expands into ascending pieces that step down from piece to piece, which no run
/// joins, while the reordered stretch expands into one ascending run.
///
/// Each maximal stretch of positions joined by descending steps is reversed in place (the
/// order vLLM's Mooncake connector plans from 0.34 on). The reordering is kept only when the
/// request then has no more runs under [`RunRule::Ascending`] than it had: reversing a stretch
/// can break a run that ran into its top when pages repeat, and a run count under the
/// ascending rule is what the expansion keeps (an index expanded into `k` sub-indices steps by
/// `+1` into the next one's exactly when the two indices do). `None` when no step descends or
/// the reordering would not help: the request is then best planned as it is.
///
/// # Errors
/// [`PlanError::LengthMismatch`]; [`PlanError::OutOfMemory`] when the reordered copy cannot be
/// allocated.
#[allow(clippy::type_complexity)]
pub fn reverse_descending_runs<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
) -> Result<Option<(Vec<S>, Vec<D>)>> {
    if src.len() != dst.len() {
        return Err(PlanError::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    if src.len() < 2 || count_descents(src, dst) == 0 {
        return Ok(None);
    }
    let (mut s, mut d) = (copy_of(src)?, copy_of(dst)?);
    let mut i = 1;
    while i < src.len() {
        if !descends(src, dst, i) {
            i += 1;
            continue;
        }
        // Steps i..end descend: positions i - 1..end are one stretch.
        let start = i - 1;
        while i < src.len() && descends(src, dst, i) {
            i += 1;
        }
        s[start..i].reverse();
        d[start..i].reverse();
    }
    Ok((count_breaks(&s, &d) <= count_breaks(src, dst)).then_some((s, d)))
}

/// Whether the step into position `i >= 1` is `-1` on both sides.
#[inline]
fn descends<S: PageIndex, D: PageIndex>(src: &[S], dst: &[D], i: usize) -> bool {
    src[i].steps_to(src[i - 1]) & dst[i].steps_to(dst[i - 1])
}

fn copy_of<T: PageIndex>(values: &[T]) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(values.len())
        .map_err(|_| PlanError::out_of_memory::<T>("the reordered request", values.len()))?;
    out.extend_from_slice(values);
    Ok(out)
}

/// Allocating convenience: validates, then returns `(src_starts, dst_starts, lengths)`.
///
/// # Errors
/// As [`scan`]; [`PlanError::OutOfMemory`] when the result cannot be allocated;
/// [`PlanError::InputChanged`] when the arrays were written while this ran.
pub fn group_contiguous<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
) -> Result<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let found = scan(src, dst)?;
    runs_of_scan(src, dst, &found)
}

/// The runs of arrays that `found` was scanned from, re-validated as a plan is: the arrays may
/// have been written since (another thread, GIL released), and the result must then be a
/// tiling of the positions with non-negative starts and no empty run, or an error.
fn runs_of_scan<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
    found: &RunScan,
) -> Result<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let n = found.n_runs;
    let mut starts_src = try_vec(n, 0, "run starts")?;
    let mut starts_dst = try_vec(n, 0, "run starts")?;
    let mut lengths = try_vec(n, 0, "run lengths")?;
    // Negative values are huge as u64, so these limits refuse them again.
    let non_negative = i64::MAX as u64 + 1;
    let limits = IndexLimits {
        src: non_negative,
        dst: non_negative,
    };
    let written = write_runs(
        src,
        dst,
        limits,
        &mut starts_src,
        &mut starts_dst,
        &mut lengths,
    )
    .map_err(|err| match err {
        // The buffers were sized by the scan: more runs now means the inputs changed.
        PlanError::OutputTooSmall { .. } => PlanError::InputChanged,
        other => other,
    })?;
    if written != n {
        return Err(PlanError::InputChanged);
    }
    Ok((starts_src, starts_dst, lengths))
}

/// No destination index repeated (what `check_dst_overlap` asks for).
///
/// # Errors
/// [`PlanError::DuplicateDestination`] naming the index and both positions;
/// [`PlanError::OutOfMemory`].
pub(crate) fn check_unique<T: PageIndex>(dst: &[T]) -> Result<()> {
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

    #[test]
    fn the_short_scan_finds_what_the_separate_passes_find() {
        // Short requests take one fused pass; it must agree with the passes long ones take.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for case in 0..2000 {
            let len = 1 + next(SHORT_SCAN as u64) as usize;
            let (mut src, mut dst) = (vec![next(50) as i32], vec![next(50) as i64]);
            for _ in 1..len {
                // Mostly +1 or -1 steps (runs, descents), sometimes a jump or a repeat.
                let step = |v: i64, k: u64| match k {
                    0..=4 => v + 1,
                    5..=7 => v - 1,
                    8 => v,
                    _ => v + 7,
                };
                let k = next(10);
                let both = next(4) > 0;
                src.push(step(i64::from(*src.last().unwrap()), k) as i32);
                dst.push(step(*dst.last().unwrap(), if both { k } else { next(10) }));
            }
            let want = (
                min_max(&src),
                min_max(&dst),
                count_breaks(&src, &dst),
                count_descents(&src, &dst),
            );
            assert_eq!(scan_short(&src, &dst), want, "case {case}: {src:?} {dst:?}");
        }
        let empty: [i64; 0] = [];
        assert_eq!(scan_short(&empty, &empty), ((0, 0), (0, 0), 0, 0));
    }

    #[test]
    fn worked_example_runs_basic() {
        let (s, d, l) =
            group_contiguous(&[0i32, 1, 2, 5, 6, 9], &[10i32, 11, 12, 13, 14, 20]).unwrap();
        assert_eq!((s, d, l), (vec![0, 5, 9], vec![10, 13, 20], vec![3, 2, 1]));
    }

    #[test]
    fn duplicates_and_descents_break_runs() {
        let (s, _, l) = group_contiguous(&[3i64, 3, 4], &[7i64, 8, 9]).unwrap();
        assert_eq!((s, l), (vec![3, 3], vec![1, 2]));
        let (s, _, l) = group_contiguous(&[5i64, 4, 3], &[1i64, 2, 3]).unwrap();
        assert_eq!((s, l), (vec![5, 4, 3], vec![1, 1, 1]));
    }

    /// `(lowest source page, lowest destination page, pages, descending)` of each run.
    fn either(src: &[i64], dst: &[i64]) -> Vec<(u64, u64, u64, bool)> {
        let found = scan_runs(src, dst, RunRule::EitherDirection).unwrap();
        let n = found.n_runs;
        let (mut s, mut d, mut l) = (vec![0; n], vec![0; n], vec![0; n]);
        let descending = found.descending_runs > 0;
        let limits = IndexLimits::NONE;
        let written = write_runs_by(src, dst, limits, descending, [&mut s, &mut d, &mut l]);
        assert_eq!(written, Ok(n), "{src:?} {dst:?}");
        let runs: Vec<_> = (0..n)
            .map(|r| (s[r], d[r], l[r] & !DESCENDING, l[r] & DESCENDING != 0))
            .collect();
        assert_eq!(runs.iter().filter(|r| r.3).count(), found.descending_runs);
        runs
    }

    #[test]
    fn runs_descending_on_both_sides_are_one_run_under_either_direction() {
        // Offload order: one run from the lowest page of each side.
        assert_eq!(either(&[7, 6, 5], &[3, 2, 1]), [(5, 1, 3, true)]);
        // Under SGLang's rule the same request is three runs.
        assert_eq!(
            group_contiguous(&[7i64, 6, 5], &[3i64, 2, 1]).unwrap().2,
            [1, 1, 1]
        );
        // Opposite directions on the two sides are a reversal: no run.
        assert_eq!(
            either(&[7, 6, 5], &[1, 2, 3]),
            [(7, 1, 1, false), (6, 2, 1, false), (5, 3, 1, false)]
        );
        // A run never mixes directions; a one-page run continues either way.
        assert_eq!(
            either(&[1, 2, 1, 2], &[5, 6, 5, 6]),
            [(1, 5, 2, false), (1, 5, 2, false)]
        );
        assert_eq!(
            either(&[4, 3, 4, 5, 9, 8], &[0, 9, 10, 11, 3, 2]),
            [(4, 0, 1, false), (3, 9, 3, false), (8, 2, 2, true)]
        );
        assert_eq!(either(&[0, 1, 2], &[4, 5, 6]), [(0, 4, 3, false)]);
        assert_eq!(either(&[3], &[3]), [(3, 3, 1, false)]);
    }

    #[test]
    fn either_direction_runs_tile_the_request_and_check_the_limits() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..300 {
            let len = 1 + next(40) as usize;
            let (mut src, mut dst) = (vec![next(50) as i64 + 20], vec![next(50) as i64 + 20]);
            for _ in 1..len {
                // Mostly steps of +-1 on both sides, sometimes jumps.
                let step = [1i64, -1, 1, -1, 3][next(5) as usize];
                let other = if next(6) == 0 { -step } else { step };
                src.push(src.last().unwrap() + step);
                dst.push(dst.last().unwrap() + other);
            }
            let mut pairs: Vec<(i64, i64)> = Vec::new();
            for (s, d, n, _) in either(&src, &dst) {
                pairs.extend((0..n as i64).map(|k| (s as i64 + k, d as i64 + k)));
            }
            let mut want: Vec<(i64, i64)> = src.iter().copied().zip(dst.iter().copied()).collect();
            pairs.sort_unstable();
            want.sort_unstable();
            assert_eq!(pairs, want, "{src:?} {dst:?}");
        }
        // A run past the limits (e.g. written since the scan) is refused.
        let (src, dst) = ([7i64, 6, 5], [3i64, 2, 1]);
        let (mut s, mut d, mut l) = ([0u64; 1], [0u64; 1], [0u64; 1]);
        let limits = IndexLimits { src: 7, dst: 10 };
        let written = write_runs_by(&src, &dst, limits, true, [&mut s, &mut d, &mut l]);
        assert_eq!(written, Err(PlanError::InputChanged));
    }

    /// Ascending-rule runs of `(src, dst)` with every index expanded into `k` consecutive ones.
    fn ascending_runs_expanded(src: &[i64], dst: &[i64], k: i64) -> usize {
        let expand = |v: &[i64]| -> Vec<i64> {
            v.iter()
                .flat_map(|&x| (0..k).map(move |j| x * k + j))
                .collect()
        };
        scan(&expand(src), &expand(dst)).unwrap().n_runs
    }

    /// vLLM 0.34's `_normalize_paired_block_order`, transcribed: each maximal stretch of steps
    /// that are `-1` on both sides, with the position before it, reversed.
    fn reversed_like_vllm(src: &[i64], dst: &[i64]) -> (Vec<i64>, Vec<i64>) {
        let (mut s, mut d) = (src.to_vec(), dst.to_vec());
        let edge = |i: usize| src[i + 1] - src[i] == -1 && dst[i + 1] - dst[i] == -1;
        let edges: Vec<bool> = (0..src.len().saturating_sub(1)).map(edge).collect();
        let mut e = 0;
        while e < edges.len() {
            if edges[e] {
                let start = e;
                while e < edges.len() && edges[e] {
                    e += 1;
                }
                s[start..=e].reverse();
                d[start..=e].reverse();
            } else {
                e += 1;
            }
        }
        (s, d)
    }

    #[test]
    fn descending_stretches_read_ascending_and_expand_into_one_run() {
        // Four sub-indices per index: [1, 0] -> [3, 2] is two pieces stepping down, one run
        // once reordered.
        let (s, d) = reverse_descending_runs(&[1i64, 0], &[3i64, 2])
            .unwrap()
            .unwrap();
        assert_eq!((s.as_slice(), d.as_slice()), (&[0, 1][..], &[2, 3][..]));
        assert_eq!(ascending_runs_expanded(&[1, 0], &[3, 2], 4), 2);
        assert_eq!(ascending_runs_expanded(&s, &d, 4), 1);
        // A stretch reversed in place joins the runs around it.
        let (s, d) = reverse_descending_runs(&[3i64, 2, 1, 4, 5], &[13i64, 12, 11, 14, 15])
            .unwrap()
            .unwrap();
        assert_eq!((s, d), (vec![1, 2, 3, 4, 5], vec![11, 12, 13, 14, 15]));
        let (s, _) = reverse_descending_runs(&[1i64, 2, 5, 4, 3, 9, 8], &[1i64, 2, 5, 4, 3, 9, 8])
            .unwrap()
            .unwrap();
        assert_eq!(s, [1, 2, 3, 4, 5, 8, 9]);
        // Nothing descends on both sides: nothing to reorder.
        assert_eq!(
            reverse_descending_runs(&[5i64, 4, 3], &[1i64, 2, 3]),
            Ok(None)
        );
        assert_eq!(
            reverse_descending_runs(&[0i32, 1, 2], &[4i32, 5, 6]),
            Ok(None)
        );
        assert_eq!(reverse_descending_runs::<i64, i64>(&[], &[]), Ok(None));
        assert_eq!(reverse_descending_runs(&[7i64], &[7i64]), Ok(None));
        // Repeated pages: reversing [2, 1] in [1, 2, 1, 2] gives [1, 1, 2, 2], three runs
        // where the request has two, so the request is kept as it is.
        assert_eq!(
            reverse_descending_runs(&[1i64, 2, 1, 2], &[1i64, 2, 1, 2]),
            Ok(None)
        );
        assert_eq!(
            reverse_descending_runs(&[1i64, 2], &[1i64]),
            Err(PlanError::LengthMismatch { src: 2, dst: 1 })
        );
    }

    #[test]
    fn reordered_requests_never_have_more_runs_than_either_order() {
        // Against the request as it is and as vLLM 0.34 reorders it, expanded by 1, 2 and 4:
        // never more runs, and the same pairs.
        let mut x: u64 = 0xD1B5_4A32_D192_ED03;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for case in 0..3000 {
            let len = 1 + next(24) as usize;
            let span = if case % 3 == 0 { 6 } else { 60 }; // small spans repeat pages
            let (mut src, mut dst) = (vec![next(span) as i64], vec![next(span) as i64]);
            for _ in 1..len {
                let step = [1i64, -1, -1, 1, 4, -3][next(6) as usize];
                let other = if next(8) == 0 { -step } else { step };
                src.push((src.last().unwrap() + step).rem_euclid(span as i64));
                dst.push((dst.last().unwrap() + other).rem_euclid(span as i64));
            }
            let (vs, vd) = reversed_like_vllm(&src, &dst);
            let (s, d) = reverse_descending_runs(&src, &dst)
                .unwrap()
                .unwrap_or_else(|| (src.clone(), dst.clone()));
            for k in [1, 2, 4] {
                let ours = ascending_runs_expanded(&s, &d, k);
                assert!(
                    ours <= ascending_runs_expanded(&src, &dst, k),
                    "{src:?} {dst:?}"
                );
                assert!(
                    ours <= ascending_runs_expanded(&vs, &vd, k),
                    "{src:?} {dst:?}"
                );
            }
            let mut pairs: Vec<(i64, i64)> = s.iter().copied().zip(d).collect();
            let mut want: Vec<(i64, i64)> = src.iter().copied().zip(dst).collect();
            pairs.sort_unstable();
            want.sort_unstable();
            assert_eq!(pairs, want);
        }
    }

    #[test]
    fn empty_and_errors() {
        assert_eq!(scan::<i32, i32>(&[], &[]).unwrap().n_runs, 0);
        assert_eq!(
            scan(&[1i32, 2], &[] as &[i32]),
            Err(PlanError::LengthMismatch { src: 2, dst: 0 })
        );
        assert_eq!(
            scan(&[1i64, -4], &[0i64, 1]),
            Err(PlanError::NegativeIndex {
                side: Side::Src,
                index: -4,
                position: 1
            })
        );
    }

    #[test]
    fn inputs_changed_after_the_scan_are_an_error_never_a_bad_tiling() {
        // Simulates another thread writing the arrays between the scan and the pass that
        // writes the runs: the scan saw `before`, the runs are written from `after`.
        let before = [0i64, 1, 2, 3, 4, 5];
        let found = scan(&before, &before).unwrap();
        assert_eq!(found.n_runs, 1);
        let more_runs = [0i64, 2, 4, 6, 8, 10];
        let negative = [0i64, 1, 2, -9, -8, -7];
        let fewer_runs_before = [0i64, 2, 4, 6, 8, 10];
        let few = scan(&fewer_runs_before, &fewer_runs_before).unwrap();
        for (after, scanned) in [(&more_runs, &found), (&negative, &found), (&before, &few)] {
            assert_eq!(
                runs_of_scan(after, after, scanned),
                Err(PlanError::InputChanged),
                "{after:?}"
            );
        }
        // Unchanged arrays give the runs.
        assert_eq!(
            runs_of_scan(&before, &before, &found).unwrap(),
            (vec![0], vec![0], vec![6])
        );
        assert!(
            !PlanError::InputChanged
                .to_string()
                .contains("output buffer")
        );
    }

    #[test]
    fn a_negative_value_gone_by_the_report_is_input_changed_not_a_made_up_value() {
        assert_eq!(
            first_negative(Side::Src, &[0i64, 1]),
            PlanError::InputChanged
        );
        assert_eq!(
            first_negative(Side::Dst, &[0i64, i64::MIN]),
            PlanError::NegativeIndex {
                side: Side::Dst,
                index: i64::MIN,
                position: 1
            }
        );
    }

    #[test]
    fn extreme_values_are_reported_as_passed() {
        // i32::MAX then i32::MIN: negative, whatever a wrapped step would say.
        assert_eq!(
            group_contiguous(&[i32::MAX, i32::MIN], &[0i32, 1]),
            Err(PlanError::NegativeIndex {
                side: Side::Src,
                index: i64::from(i32::MIN),
                position: 1
            })
        );
        assert_eq!(
            group_contiguous(&[0i64, 1], &[i64::MIN, i64::MAX]),
            Err(PlanError::NegativeIndex {
                side: Side::Dst,
                index: i64::MIN,
                position: 0
            })
        );
        let (s, d, l) = group_contiguous(&[i64::MAX - 1, i64::MAX], &[0i32, 1]).unwrap();
        assert_eq!((s, d, l), (vec![i64::MAX as u64 - 1], vec![0], vec![2]));
    }

    #[test]
    fn extreme_values_do_not_overflow() {
        let big = [i64::MAX, i64::MAX - 1, 0];
        let found = scan(&big, &big).unwrap();
        assert_eq!((found.n_runs, found.max_src), (3, i64::MAX as u64));
    }
}
