//! Failure verdicts: the pages failed blocks were to write, per pool and per request, checked
//! against a reference that intersects each failed block with every item of every destination
//! entry (no address walk), over plans and batches of several layouts.
#![allow(clippy::single_range_in_vec_init)] // one failed range is a list of one range

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use kvplan_core::{
    EntryKind, FailedPages, Layout, PlanError, PoolId, Request, Template, TemplateOptions,
    failed_batch_pages, failed_pages,
};
use support::layouts::{KvLayout, kv_pool, paged};

const PAGES: u64 = 64;

/// A deterministic generator (SplitMix64): the cases are the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn peers() -> Vec<(&'static str, Layout, Layout)> {
    let mha = |base| KvLayout::mha(base, 0..3, 32, 32 * PAGES).build();
    let pool = |base, context| kv_pool(base, PAGES, 0..2, 16, context);
    vec![
        ("mha", mha(0x10_0000), mha(0x90_0000)),
        ("pool", pool(0x10_0000, paged(1)), pool(0x90_0000, paged(1))),
        (
            "tokens",
            KvLayout::mha(0x10_0000, 0..2, 64, 64 * PAGES)
                .context(paged(2))
                .build(),
            KvLayout::mha(0x90_0000, 0..2, 128, 128 * PAGES / 2)
                .context(paged(4))
                .build(),
        ),
    ]
}

type Pages = BTreeMap<usize, BTreeSet<i64>>;

/// Every (pool, page) of `dst` whose item bytes overlap a failed block's destination bytes.
fn reference(dst: &Layout, dst_addrs: &[u64], lengths: &[u64], failed: &[usize]) -> Pages {
    let mut out = Pages::new();
    for &b in failed {
        let (lo, hi) = (dst_addrs[b], dst_addrs[b] + lengths[b]);
        for entry in dst.entries() {
            if entry.item_len == 0 {
                continue;
            }
            let EntryKind::Page { pool, .. } = entry.kind else {
                continue;
            };
            let (base, len) = entry.buffer;
            for p in (0..).take_while(|p| p * entry.stride + entry.item_len <= len) {
                let item = base + p * entry.stride;
                if item < hi && lo < item + entry.item_len {
                    out.entry(pool.index()).or_default().insert(p as i64);
                }
            }
        }
    }
    out
}

fn as_map(found: &FailedPages) -> Pages {
    found
        .pools
        .iter()
        .map(|(pool, pages)| (pool.index(), pages.iter().copied().collect()))
        .collect()
}

/// Random failed ranges over `n` blocks and the block positions they cover.
fn failed_ranges(rng: &mut Rng, n: usize) -> (Vec<Range<usize>>, Vec<usize>) {
    let mut ranges = Vec::new();
    let mut blocks = BTreeSet::new();
    for _ in 0..=rng.below(3) {
        let start = rng.below(n as u64 + 1) as usize;
        let end = start + rng.below((n - start) as u64 + 1) as usize;
        blocks.extend(start..end);
        ranges.push(start..end);
    }
    (ranges, blocks.into_iter().collect())
}

#[test]
fn plan_failures_name_exactly_the_pages_of_failed_blocks() {
    let mut rng = Rng(0x5EED_FA11);
    for (name, src, dst) in peers() {
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let capacity = template.index_limits();
        for _ in 0..200 {
            let len = 1 + rng.below(12) as usize;
            let mut dst_free: Vec<i64> = (0..capacity.dst as i64).collect();
            let src_pages: Vec<i64> = (0..len).map(|_| rng.below(capacity.src) as i64).collect();
            let dst_pages: Vec<i64> = (0..len)
                .map(|_| dst_free.remove(rng.below(dst_free.len() as u64) as usize))
                .collect();
            let request = Request::pages(&src_pages, &dst_pages);
            let Ok(plan) = template.plan(&request) else {
                continue;
            };
            let n = plan.lengths.len();
            if n == 0 {
                continue;
            }
            let (ranges, blocks) = failed_ranges(&mut rng, n);
            let found = failed_pages(&dst, &plan.dst_addrs, &plan.lengths, &ranges)
                .unwrap_or_else(|e| panic!("{name}: {e}; {:?}", dst.entries()));
            let expected = reference(&dst, &plan.dst_addrs, &plan.lengths, &blocks);
            assert_eq!(as_map(&found), expected, "{name}: {ranges:?}");
            assert!(found.slots.is_empty());
            // Every page named is one of the request's (a failed block names no stranger).
            for (_, pages) in &found.pools {
                assert!(pages.iter().all(|p| dst_pages.contains(p)), "{name}");
            }
        }
    }
}

#[test]
fn batch_failures_name_each_request_its_own_pages() {
    let mut rng = Rng(0xBA7C_4FA1);
    let (_, src, dst) = peers().remove(0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let mut fused_seen = 0;
    for _ in 0..300 {
        // Requests continuing each other on both sides fuse into one segment.
        let mut lists: Vec<(Vec<i64>, Vec<i64>)> = Vec::new();
        let (mut s, mut d) = (0i64, 0i64);
        for _ in 0..=rng.below(5) {
            if rng.below(2) == 0 {
                s += rng.below(3) as i64 + 1;
                d += rng.below(3) as i64 + 1;
            }
            let len = 1 + rng.below(3) as i64;
            lists.push(((s..s + len).collect(), (d..d + len).collect()));
            s += len;
            d += len;
        }
        let requests: Vec<Request<'_>> = lists
            .iter()
            .map(|(s, d)| Request::pages(s.as_slice(), d.as_slice()))
            .collect();
        let batch = template.batch().plan(&requests).unwrap();
        fused_seen += batch.summary.n_requests() - batch.summary.n_segments();
        let (ranges, blocks) = failed_ranges(&mut rng, batch.lengths.len());
        let found = failed_batch_pages(
            &dst,
            &batch.dst_addrs,
            &batch.lengths,
            &batch.summary,
            &requests,
            &ranges,
        )
        .unwrap();
        let all = reference(&dst, &batch.dst_addrs, &batch.lengths, &blocks);
        let mut named: BTreeSet<i64> = BTreeSet::new();
        let mut last = None;
        for failure in &found {
            assert!(last < Some(failure.request), "requests in batch order");
            last = Some(failure.request);
            let own = &lists[failure.request].1;
            let pages = failure.pages.pages(PoolId::PAGES);
            assert!(!pages.is_empty());
            for p in pages {
                assert!(
                    own.contains(p),
                    "page {p} named for request {}",
                    failure.request
                );
                assert!(named.insert(*p), "page {p} named twice");
            }
        }
        let expected: BTreeSet<i64> = all.get(&0).cloned().unwrap_or_default();
        assert_eq!(named, expected, "{ranges:?}");
    }
    assert!(fused_seen > 50, "the batches fused requests ({fused_seen})");
}

#[test]
fn bad_failed_ranges_are_typed_errors() {
    let (_, src, dst) = peers().remove(0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let plan = template
        .plan(&Request::pages(&[1i64, 2], &[5i64, 6]))
        .unwrap();
    let n = plan.lengths.len();
    let call = |ranges: &[Range<usize>]| failed_pages(&dst, &plan.dst_addrs, &plan.lengths, ranges);
    #[allow(clippy::reversed_empty_ranges)] // the reversed range is the bad input
    let reversed = call(&[3..1]).unwrap_err();
    assert!(matches!(reversed, PlanError::FailedBlocks { .. }));
    assert!(reversed.to_string().contains("[3, 1)"), "{reversed}");
    let past = call(&[0..n + 1]).unwrap_err();
    assert!(
        past.to_string().contains(&format!("has {n} blocks")),
        "{past}"
    );
    let uneven = failed_pages(&dst, &plan.dst_addrs, &plan.lengths[..1], &[]).unwrap_err();
    assert!(matches!(uneven, PlanError::FailedBlocks { .. }), "{uneven}");
    // A plan into another layout: its blocks lie in none of this decode's entries.
    let stranger = failed_pages(&src, &plan.dst_addrs, &plan.lengths, &[0..1]).unwrap_err();
    assert!(
        matches!(stranger, PlanError::BlockOutsideBuffers { .. }),
        "{stranger}"
    );
    assert_eq!(call(&[1..1]).unwrap(), FailedPages::default());
}
