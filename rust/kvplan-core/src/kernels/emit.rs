//! Page emission: a request's runs × a template's page pieces (whole pairs, coalesced groups
//! of pairs, or fragments: [`Piece`]s with one slot per page) → `(src_addr, dst_addr, length)`
//! columns. The kernels take pieces and runs only, never a template.
//!
//! Blocks are piece major, run minor (SGLang's order when every piece is one packed pair), so
//! with only per-run pieces piece `p`'s blocks are the slice `p*R .. (p+1)*R` of the output, `R`
//! being the request's run count; a per-page piece has one block per page instead.
//!
//! Emission allocates nothing: the caller has written the runs into the output's own first `R`
//! slots (as page indices); every pair's blocks are then expanded, last pair first, so that
//! pair 0 finally overwrites the runs in place. A pair whose item length equals the pair
//! expanded just before it is derived from that pair's blocks by adding the base difference;
//! requests with a handful of runs are expanded from a stack copy instead. The caller has
//! validated every index against every paired buffer's capacity, and layouts guarantee
//! `base + capacity * item_len` fits in u64, so the expansion cannot overflow.

use crate::model::pieces::Piece;
use crate::model::plan::Columns;
use crate::model::runs::DESCENDING;

/// Expands `runs` runs, stored as page indices in the first `runs` slots of `out`, into the
/// blocks of every piece in `pairs`, all of which are [`Piece::per_run`] (`out` holds at least
/// `runs * pairs.len()` values).
pub(crate) fn expand_runs(pairs: &[Piece], runs: usize, out: Columns<'_>) {
    if runs <= SMALL_RUNS {
        expand_small(pairs, runs, out);
        return;
    }
    // Last pair first, so the runs in slots 0..R survive until pair 0 overwrites them.
    // A pair with the same item length as the pair expanded just before it (every MLA
    // layer, every K and every V entry) is that pair's blocks shifted by the difference of
    // the bases: an add per value instead of a 64-bit multiply.
    let mut previous: Option<(usize, &Piece)> = None;
    for (p, pair) in pairs.iter().enumerate().rev() {
        let to = p * runs;
        let columns = [&mut *out.src_addrs, &mut *out.dst_addrs, &mut *out.lengths];
        match previous {
            Some((from, prev)) if prev.len == pair.len => {
                let src_delta = pair.src.base.wrapping_sub(prev.src.base);
                let dst_delta = pair.dst.base.wrapping_sub(prev.dst.base);
                let [src_col, dst_col, len_col] = columns;
                derive(src_col, runs, from, to, |x| x.wrapping_add(src_delta));
                derive(dst_col, runs, from, to, |x| x.wrapping_add(dst_delta));
                derive(len_col, runs, from, to, |x| x);
            }
            _ => {
                let item = pair.len;
                let [src_col, dst_col, len_col] = columns;
                derive(src_col, runs, 0, to, |x| pair.src.base + x * item);
                derive(dst_col, runs, 0, to, |x| pair.dst.base + x * item);
                derive(len_col, runs, 0, to, |x| x * item);
            }
        }
        previous = Some((to, pair));
    }
}

/// Requests with at most this many runs are expanded pair by pair from a stack copy of the
/// runs: for a handful of runs per pair, per-pair bookkeeping would cost more than the blocks.
const SMALL_RUNS: usize = 8;

fn expand_small(pairs: &[Piece], runs: usize, out: Columns<'_>) {
    if runs == 1 {
        // One run (a request whose pages are contiguous on both sides, the common case): one
        // block per pair, written in pair order with no per-pair chunk bookkeeping. Pairs of
        // one item length (every MLA layer, every K and every V entry) share the run's
        // offsets, so a block is two adds instead of three multiplies.
        let (s, d, n) = (out.src_addrs[0], out.dst_addrs[0], out.lengths[0]);
        let m = pairs.len();
        let blocks = out.src_addrs[..m]
            .iter_mut()
            .zip(&mut out.dst_addrs[..m])
            .zip(&mut out.lengths[..m]);
        let mut item = None::<u64>;
        let (mut src_off, mut dst_off, mut bytes) = (0u64, 0u64, 0u64);
        for (pair, ((src, dst), len)) in pairs.iter().zip(blocks) {
            if item != Some(pair.len) {
                item = Some(pair.len);
                (src_off, dst_off, bytes) = (s * pair.len, d * pair.len, n * pair.len);
            }
            (*src, *dst, *len) = (pair.src.base + src_off, pair.dst.base + dst_off, bytes);
        }
        return;
    }
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
        let item = pair.len;
        for r in 0..runs {
            src[r] = pair.src.base + starts[0][r] * item;
            dst[r] = pair.dst.base + starts[1][r] * item;
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

/// Expands `runs` runs (page indices in the first `runs` slots of `out`, covering `pages` index
/// pairs) into the blocks of `pieces`, any mix of per-run and per-page pieces: piece-major, and
/// within a piece run-minor (a per-page piece: the request's pages in order, a descending run's
/// from its highest page down). `out` holds at least the plan's block count; a run's length may
/// carry [`DESCENDING`] (its start is then its lowest page on each side).
///
/// Pieces are written last first, so the runs in slots `0..runs` survive until piece 0 (the
/// only one whose blocks cover those slots: every piece has at least `runs` blocks) overwrites
/// them; piece 0 itself is written from its last block backwards, never over a run not yet read.
pub(crate) fn expand_pieces(pieces: &[Piece], runs: usize, pages: usize, out: Columns<'_>) {
    let mut end = pieces
        .iter()
        .map(|p| if p.per_run() { runs } else { pages })
        .sum::<usize>();
    for piece in pieces.iter().rev() {
        if piece.per_run() {
            let start = end - runs;
            // Run r is read from slot r and written to slot start + r >= r: in place for
            // piece 0, untouched runs otherwise.
            for r in 0..runs {
                let (s, d) = (out.src_addrs[r], out.dst_addrs[r]);
                let n = out.lengths[r] & !DESCENDING;
                out.src_addrs[start + r] = piece.src.base + s * piece.len;
                out.dst_addrs[start + r] = piece.dst.base + d * piece.len;
                out.lengths[start + r] = n * piece.len;
            }
            end = start;
        } else {
            // Runs last to first, pages last to first: run r's pages go to positions at or
            // after r, and only runs before r remain to be read.
            // The piece's fields in locals: the loop below then keeps them in registers.
            let (src_base, src_stride) = (piece.src.base, piece.src.page_stride);
            let (dst_base, dst_stride, len) = (piece.dst.base, piece.dst.page_stride, piece.len);
            let mut at = end;
            for r in (0..runs).rev() {
                let (s, d, tagged) = (out.src_addrs[r], out.dst_addrs[r], out.lengths[r]);
                let n = (tagged & !DESCENDING) as usize;
                at -= n;
                if tagged & DESCENDING == 0 {
                    for k in (0..n).rev() {
                        out.src_addrs[at + k] = src_base + (s + k as u64) * src_stride;
                        out.dst_addrs[at + k] = dst_base + (d + k as u64) * dst_stride;
                        out.lengths[at + k] = len;
                    }
                } else {
                    // Request order: the run's highest page first.
                    for k in (0..n).rev() {
                        let page = (n - 1 - k) as u64;
                        out.src_addrs[at + k] = src_base + (s + page) * src_stride;
                        out.dst_addrs[at + k] = dst_base + (d + page) * dst_stride;
                        out.lengths[at + k] = len;
                    }
                }
            }
            end = at;
        }
    }
}
