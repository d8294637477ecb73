//! Plans as data a test can compare: blocks as `[src, dst, len]` triples, what they copy byte
//! by byte, the registered buffers they must stay in, state slot plans, and page lists.

use kvplan_core::{AsColumns, FlatBuffer, Layout, Plan, PlanSummary, Request, Template};

/// Registered buffers `(start, end)` of a layout, one per entry, in entry order.
pub fn buffers(layout: &Layout) -> Vec<(u64, u64)> {
    let p = layout.parts();
    p.data_ptrs
        .iter()
        .zip(&p.data_lens)
        .map(|(&a, &n)| (a, a + n))
        .collect()
}

/// Blocks of three columns as `[src, dst, len]` triples.
pub fn of_columns(src: &[u64], dst: &[u64], lengths: &[u64]) -> Vec<[u64; 3]> {
    (0..lengths.len())
        .map(|k| [src[k], dst[k], lengths[k]])
        .collect()
}

/// A plan's blocks as `[src, dst, len]` triples.
pub fn triples(plan: &Plan) -> Vec<[u64; 3]> {
    of_columns(&plan.src_addrs, &plan.dst_addrs, &plan.lengths)
}

/// What blocks do, whatever their cut: every `(destination byte, source byte)` copy, sorted, so
/// two lists of blocks moving the same bytes compare equal, and a destination byte written
/// twice shows as two neighbours with the same first value.
pub fn byte_map(blocks: &[[u64; 3]]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = blocks
        .iter()
        .flat_map(|&[s, d, n]| (0..n).map(move |b| (d + b, s + b)))
        .collect();
    out.sort_unstable();
    out
}

/// The state plan moving slot `src` to slot `dst`, planned into an output of one block per
/// state pair, as a plan (total bytes as the summary reports) and its summary.
pub fn state_plan(t: &Template, src: i64, dst: i64) -> (Plan, PlanSummary) {
    let mut out = FlatBuffer::zeroed(t.state_pairs().len());
    let summary = t
        .plan_into(&Request::slot(src, dst), |_| Ok(out.columns()))
        .map(|(_, summary)| summary)
        .unwrap();
    let (src_addrs, dst_addrs, lengths) = out.into_columns(summary.n_blocks).unwrap();
    let plan = Plan {
        src_addrs,
        dst_addrs,
        lengths,
        total_bytes: summary.total_bytes,
        ..Plan::default()
    };
    (plan, summary)
}

/// `count` distinct pages below `capacity`, in an order fixed by `seed`: pages swapped by a
/// xorshift, so some runs stay consecutive and some jump.
pub fn scrambled_pages(count: u64, capacity: u64, seed: u64) -> Vec<i64> {
    let mut pages: Vec<i64> = (0..capacity as i64).collect();
    let mut x = seed | 1;
    for k in (1..pages.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(3) {
            pages.swap(k, (x % (k as u64 + 1)) as usize);
        }
    }
    pages.truncate(count as usize);
    pages
}
