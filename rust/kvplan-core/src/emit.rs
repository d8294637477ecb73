//! Block emission: a request's runs × a template's emitting pairs → `(src_addr, dst_addr,
//! length)` columns.
//!
//! Blocks are entry-pair major, run minor (SGLang's order), so pair `p`'s blocks are the
//! contiguous slice `p*R .. (p+1)*R` of the output, `R` being the request's run count.
//!
//! Emission allocates nothing: the caller has written the runs into the output's own first `R`
//! slots (as page indices); every pair's blocks are then expanded, last pair first, so that
//! pair 0 finally overwrites the runs in place. A pair whose item length equals the pair
//! expanded just before it is derived from that pair's blocks by adding the base difference;
//! requests with a handful of runs are expanded from a stack copy instead. The caller has
//! validated every index against every paired buffer's capacity, and layouts guarantee
//! `base + capacity * item_len` fits in u64, so the expansion cannot overflow.

use crate::plan::Columns;
use crate::template::PairSpec;

/// Expands `runs` runs, stored as page indices in the first `runs` slots of `out`, into the
/// blocks of every pair in `pairs` (`out` holds at least `runs * pairs.len()` values).
pub(crate) fn expand_runs(pairs: &[PairSpec], runs: usize, out: Columns<'_>) {
    if runs <= SMALL_RUNS {
        expand_small(pairs, runs, out);
        return;
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
