//! Grouping paired page indices into maximal runs that are contiguous on both sides.
//!
//! A run breaks at position `i + 1` as soon as either side's step is not exactly `+1`
//! (duplicates, descents and gaps all break), which is SGLang's `group_concurrent_contiguous`.
//! Runs are computed in two passes so nothing is allocated: [`scan`] validates and counts,
//! [`write_runs`] fills caller-provided slices.

use crate::error::{PlanError, Result, Side};

/// An integer page or slot index as engines hand it over (SGLang uses int32, others int64).
pub trait PageIndex: Copy + Send + Sync + 'static {
    /// The index widened to `i64`.
    fn get(self) -> i64;
}

impl PageIndex for i32 {
    #[inline]
    fn get(self) -> i64 {
        i64::from(self)
    }
}

impl PageIndex for i64 {
    #[inline]
    fn get(self) -> i64 {
        self
    }
}

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
}

/// Validates a request's index arrays (equal lengths, no negative value) and counts its runs.
///
/// # Errors
/// [`PlanError::LengthMismatch`] or [`PlanError::NegativeIndex`].
pub fn scan<S: PageIndex, D: PageIndex>(src: &[S], dst: &[D]) -> Result<RunScan> {
    if src.len() != dst.len() {
        return Err(PlanError::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    let mut result = RunScan {
        n_pages: src.len(),
        ..RunScan::default()
    };
    let (mut min_src, mut min_dst) = (0i64, 0i64);
    let (mut max_src, mut max_dst) = (0i64, 0i64);
    let (mut prev_src, mut prev_dst) = (i64::MIN, i64::MIN);
    for (&s, &d) in src.iter().zip(dst) {
        let (s, d) = (s.get(), d.get());
        // wrapping_sub: i64::MIN sentinels and extreme values must not overflow; a wrapped
        // difference is never exactly 1 unless the true step is 1.
        let continues =
            s.wrapping_sub(prev_src) == 1 && d.wrapping_sub(prev_dst) == 1 && prev_src != i64::MIN;
        result.n_runs += usize::from(!continues);
        min_src = min_src.min(s);
        min_dst = min_dst.min(d);
        max_src = max_src.max(s);
        max_dst = max_dst.max(d);
        prev_src = s;
        prev_dst = d;
    }
    // The minimum is tracked branch-free in the loop; the position is only looked up on error.
    if min_src < 0 {
        return Err(first_negative(Side::Src, src));
    }
    if min_dst < 0 {
        return Err(first_negative(Side::Dst, dst));
    }
    result.max_src = max_src as u64;
    result.max_dst = max_dst as u64;
    Ok(result)
}

fn first_negative<T: PageIndex>(side: Side, values: &[T]) -> PlanError {
    let (position, index) = values
        .iter()
        .map(|v| v.get())
        .enumerate()
        .find(|&(_, v)| v < 0)
        .unwrap_or((0, -1));
    PlanError::NegativeIndex {
        side,
        index,
        position,
    }
}

/// Writes the runs of `(src, dst)` as `(src_start, dst_start, length)` into three slices.
///
/// The inputs must have passed [`scan`], and each output slice must hold at least
/// `scan.n_runs` values. Returns the number of runs written.
///
/// # Errors
/// [`PlanError::OutputTooSmall`] when an output slice is shorter than the run count.
pub fn write_runs<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
    src_starts: &mut [u64],
    dst_starts: &mut [u64],
    lengths: &mut [u64],
) -> Result<usize> {
    let capacity = src_starts.len().min(dst_starts.len()).min(lengths.len());
    let mut n = 0usize;
    let (mut prev_src, mut prev_dst) = (i64::MIN, i64::MIN);
    for (&s, &d) in src.iter().zip(dst) {
        let (s, d) = (s.get(), d.get());
        if n > 0 && s.wrapping_sub(prev_src) == 1 && d.wrapping_sub(prev_dst) == 1 {
            lengths[n - 1] += 1;
        } else {
            if n == capacity {
                return Err(PlanError::OutputTooSmall {
                    have: capacity,
                    need: n + 1,
                });
            }
            src_starts[n] = s as u64;
            dst_starts[n] = d as u64;
            lengths[n] = 1;
            n += 1;
        }
        prev_src = s;
        prev_dst = d;
    }
    Ok(n)
}

/// Allocating convenience: validates, then returns `(src_starts, dst_starts, lengths)`.
///
/// # Errors
/// As [`scan`].
pub fn group_contiguous<S: PageIndex, D: PageIndex>(
    src: &[S],
    dst: &[D],
) -> Result<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let found = scan(src, dst)?;
    let mut starts_src = vec![0; found.n_runs];
    let mut starts_dst = vec![0; found.n_runs];
    let mut lengths = vec![0; found.n_runs];
    write_runs(src, dst, &mut starts_src, &mut starts_dst, &mut lengths)?;
    Ok((starts_src, starts_dst, lengths))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e1_runs() {
        let (s, d, l) =
            group_contiguous(&[0i32, 1, 2, 5, 6, 9], &[10i32, 11, 12, 13, 14, 20]).unwrap();
        assert_eq!((s, d, l), (vec![0, 5, 9], vec![10, 13, 20], vec![3, 2, 1]));
    }

    #[test]
    fn e2_duplicates_and_descents_break() {
        let (s, _, l) = group_contiguous(&[3i64, 3, 4], &[7i64, 8, 9]).unwrap();
        assert_eq!((s, l), (vec![3, 3], vec![1, 2]));
        let (s, _, l) = group_contiguous(&[5i64, 4, 3], &[1i64, 2, 3]).unwrap();
        assert_eq!((s, l), (vec![5, 4, 3], vec![1, 1, 1]));
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
    fn extreme_values_do_not_overflow() {
        let big = [i64::MAX, i64::MAX - 1, 0];
        let found = scan(&big, &big).unwrap();
        assert_eq!((found.n_runs, found.max_src), (3, i64::MAX as u64));
    }
}
