//! Batches of token requests (a token range, further pools, per-pool ranges) merge blocks
//! across consecutive requests as page requests do: checked against each request's own plan
//! (bytes), against the per-pool single-pool templates' page batches (block counts), and the
//! requests a block range names against the requests whose bytes it holds.

mod support;

use kvplan_core::{
    BatchPlan, Layout, LayoutContext, Plan, PoolId, Request, Template, TemplateOptions,
};
use support::reference::{Arena, apply, reference};

const PAGES: u64 = 96;
const PAGE: u64 = 4;
const ITEM: u64 = 64;

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

fn ctx() -> LayoutContext {
    LayoutContext {
        page_size: PAGE,
        ..LayoutContext::default()
    }
}

/// MLA layers `layers` at `base`, one buffer of `PAGES` pages each.
fn mla(base: u64, layers: std::ops::Range<u64>) -> Layout {
    let n = layers.clone().count();
    Layout::mla(
        layers.clone().map(|l| base + l * ITEM * PAGES).collect(),
        vec![ITEM * PAGES; n],
        vec![ITEM; n],
        Some(layers.map(|l| l as i64).collect()),
        ctx(),
    )
    .unwrap()
}

/// Four MLA layers: 0 and 1 on the request's pages, 2 and 3 in pool 1 (`PAGE` tokens a page).
fn pooled(base: u64) -> Layout {
    mla(base, 0..4).with_pool(&[2, 3], PAGE, 1).unwrap()
}

fn template(src: &Layout, dst: &Layout) -> Template {
    Template::new(src, dst, TemplateOptions::default()).unwrap()
}

/// One pool's pages of every request: ascending runs of random lengths (never a page one below
/// the page before on both sides), each request continuing the previous one on both sides
/// about half the time; destinations disjoint. A request may take no page of a pool.
fn pool_lists(rng: &mut Rng, n: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    let counts: Vec<usize> = (0..n).map(|_| rng.below(4) as usize).collect();
    lists_of(rng, &counts)
}

/// [`pool_lists`] with request `r` taking `counts[r]` pages.
fn lists_of(rng: &mut Rng, counts: &[usize]) -> Vec<(Vec<i64>, Vec<i64>)> {
    let (mut s, mut d) = (0i64, 0i64);
    let mut out = Vec::new();
    for &k in counts {
        if rng.below(2) == 0 {
            s += 1 + rng.below(3) as i64;
            d += 1 + rng.below(3) as i64;
        }
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for _ in 0..k {
            src.push(s);
            dst.push(d);
            s += 1 + i64::from(rng.below(4) == 0);
            d += 1 + i64::from(rng.below(4) == 0);
        }
        out.push((src, dst));
    }
    assert!(d < PAGES as i64 && s < PAGES as i64);
    out
}

fn columns(batch: &BatchPlan, blocks: std::ops::Range<usize>) -> Plan {
    Plan {
        src_addrs: batch.src_addrs[blocks.clone()].to_vec(),
        dst_addrs: batch.dst_addrs[blocks.clone()].to_vec(),
        lengths: batch.lengths[blocks].to_vec(),
        ..Plan::default()
    }
}

/// Overlays arenas (numbered bytes are never 0).
fn overlay(dst: &Layout, parts: impl Iterator<Item = Arena>) -> Arena {
    let mut want = Arena::zeroed(dst);
    for one in parts {
        for (w, b) in want.bytes.iter_mut().zip(&one.bytes) {
            if *b != 0 {
                *w = *b;
            }
        }
    }
    want
}

fn applied(src: &Layout, dst: &Layout, plan: &Plan, source: &Arena) -> Arena {
    let mut got = Arena::zeroed(dst);
    apply(src, dst, plan, source, &mut got);
    got
}

/// The requests with destination bytes in `blocks` of `batch`, from the requests' own plans
/// (a batch's requests write disjoint destinations).
fn holders(batch: &BatchPlan, blocks: std::ops::Range<usize>, alone: &[Plan]) -> Vec<usize> {
    let hit = |p: &Plan| {
        blocks.clone().any(|b| {
            let (a, n) = (batch.dst_addrs[b], batch.lengths[b]);
            (0..p.dst_addrs.len())
                .any(|k| p.dst_addrs[k] < a + n && a < p.dst_addrs[k] + p.lengths[k])
        })
    };
    (0..alone.len()).filter(|&r| hit(&alone[r])).collect()
}

/// Every single block, and random block ranges, name exactly the requests with bytes in them.
fn check_blame(rng: &mut Rng, t: &Template, batch: &BatchPlan, alone: &[Plan], what: &str) {
    let n = batch.summary.n_blocks;
    let mut ranges: Vec<_> = (0..n).map(|b| b..b + 1).collect();
    for _ in 0..8 {
        let a = rng.below(n as u64 + 1) as usize;
        let b = a + rng.below((n - a) as u64 + 1) as usize;
        ranges.push(a..b);
    }
    for range in ranges {
        assert_eq!(
            t.batch_requests_in(&batch.summary, range.clone()),
            holders(batch, range.clone(), alone),
            "{what}: blocks {range:?}"
        );
    }
}

#[test]
fn token_requests_merge_across_requests_as_page_requests_do() {
    let mut rng = Rng(50);
    let (src, dst) = (mla(1 << 32, 0..2), mla(1 << 40, 0..2));
    let t = template(&src, &dst);
    let source = Arena::numbered(&src);
    let mut fused = 0;
    for case in 0..60 {
        let n = 1 + rng.below(8) as usize;
        let lists = pool_lists(&mut rng, n);
        let tokens: Vec<Request<'_>> = lists
            .iter()
            .map(|(s, d)| Request::tokens(s, d, s.len() as u64 * PAGE))
            .collect();
        let pages: Vec<Request<'_>> = lists.iter().map(|(s, d)| Request::pages(s, d)).collect();
        let batch = t.batch().plan(&tokens).unwrap();
        let want = overlay(
            &dst,
            tokens
                .iter()
                .map(|r| reference(&t, &src, &dst, r, None, &source)),
        );
        let got = applied(
            &src,
            &dst,
            &columns(&batch, 0..batch.summary.n_blocks),
            &source,
        );
        assert!(got.bytes == want.bytes, "case {case}: batch bytes differ");
        let plain = t.batch().plan(&pages).unwrap();
        assert_eq!(
            batch.summary.n_blocks, plain.summary.n_blocks,
            "case {case}"
        );
        assert_eq!(
            batch.summary.segment_requests,
            plain.summary.segment_requests
        );
        fused += n - batch.summary.n_segments();
        let alone: Vec<Plan> = tokens.iter().map(|r| t.plan(r).unwrap()).collect();
        check_blame(&mut rng, &t, &batch, &alone, &format!("case {case}"));
    }
    assert!(fused > 20, "the cases fuse requests ({fused} boundaries)");
}

#[test]
fn two_one_page_token_requests_that_continue_each_other_are_one_block_per_layer() {
    let (src, dst) = (mla(1 << 32, 0..2), mla(1 << 40, 0..2));
    let t = template(&src, &dst);
    let (s0, d0, s1, d1) = ([0i64], [10i64], [1i64], [11i64]);
    let whole = [
        Request::tokens(&s0, &d0, PAGE),
        Request::tokens(&s1, &d1, PAGE),
    ];
    let batch = t.batch().plan(&whole).unwrap();
    assert_eq!(batch.summary.n_blocks, 2);
    assert_eq!(batch.summary.n_segments(), 1);
    assert_eq!(batch.lengths, vec![2 * ITEM; 2]);
    assert_eq!(batch.summary.requests_in(0..1), vec![0, 1]);
    // One token of each page: the bytes between them do not move, so nothing merges.
    let partial = [Request::tokens(&s0, &d0, 1), Request::tokens(&s1, &d1, 1)];
    let batch = t.batch().plan(&partial).unwrap();
    assert_eq!(batch.summary.n_blocks, 4);
    assert_eq!(batch.summary.n_segments(), 2);
}

/// Pooled requests: pool 0's pages and pool 1's, each pool with its own token range
/// (`own_ranges`) or both the request's range (then both pools take as many pages).
fn pooled_requests(pools: &[Vec<(Vec<i64>, Vec<i64>)>; 2], own_ranges: bool) -> Vec<Request<'_>> {
    pools[0]
        .iter()
        .zip(&pools[1])
        .map(|((s0, d0), (s1, d1))| {
            let request = Request::tokens(s0, d0, s0.len() as u64 * PAGE).with_pool_pages(
                PoolId(1),
                Some(&s1[..]),
                Some(&d1[..]),
            );
            if own_ranges {
                request.with_pool_tokens(PoolId(1), s1.len() as u64 * PAGE, 0)
            } else {
                request
            }
        })
        .collect()
}

#[test]
fn pooled_batches_merge_per_pool_as_the_per_pool_templates_batches_do() {
    let mut rng = Rng(51);
    let (src, dst) = (pooled(1 << 32), pooled(1 << 40));
    let t = template(&src, &dst);
    // The per-group path: each pool's layers as a template of their own, planned by page.
    let parts = [
        template(&mla(1 << 32, 0..2), &mla(1 << 40, 0..2)),
        template(&mla(1 << 32, 2..4), &mla(1 << 40, 2..4)),
    ];
    let source = Arena::numbered(&src);
    let mut fused = 0;
    for case in 0..80 {
        let n = 1 + rng.below(8) as usize;
        let own_ranges = case % 2 == 0;
        let pools = if own_ranges {
            [pool_lists(&mut rng, n), pool_lists(&mut rng, n)]
        } else {
            // One range for both pools: as many pages in each.
            let first = pool_lists(&mut rng, n);
            let counts: Vec<usize> = first.iter().map(|(s, _)| s.len()).collect();
            let second = lists_of(&mut rng, &counts);
            [first, second]
        };
        let reqs = pooled_requests(&pools, own_ranges);
        let batch = match t.batch().plan(&reqs) {
            Ok(batch) => batch,
            Err(err) => panic!("case {case}: {err}"),
        };
        let alone: Vec<Plan> = reqs.iter().map(|r| t.plan(r).unwrap()).collect();
        let want = overlay(&dst, alone.iter().map(|p| applied(&src, &dst, p, &source)));
        let got = applied(
            &src,
            &dst,
            &columns(&batch, 0..batch.summary.n_blocks),
            &source,
        );
        assert!(got.bytes == want.bytes, "case {case}: batch bytes differ");
        let per_pool: usize = (0..2)
            .map(|g| {
                let pages: Vec<Request<'_>> =
                    pools[g].iter().map(|(s, d)| Request::pages(s, d)).collect();
                parts[g].batch().plan(&pages).unwrap().summary.n_blocks
            })
            .sum();
        assert_eq!(batch.summary.n_blocks, per_pool, "case {case}");
        let solo: usize = alone.iter().map(|p| p.lengths.len()).sum();
        assert!(batch.summary.n_blocks <= solo);
        fused += n - batch.summary.n_segments();
        check_blame(&mut rng, &t, &batch, &alone, &format!("case {case}"));
    }
    assert!(fused > 60, "the cases fuse requests ({fused} boundaries)");
}

/// Two requests whose pools continue each other in opposite orders: pool 0 merges in the
/// request order given, pool 1 in the other, as the per-pool batches of that order.
#[test]
fn each_pool_merges_where_its_own_pages_continue() {
    let (src, dst) = (pooled(1 << 32), pooled(1 << 40));
    let t = template(&src, &dst);
    let lists: [[i64; 1]; 8] = [[0], [10], [5], [16], [1], [11], [4], [15]];
    let request = |k: usize| {
        Request::tokens(&lists[k][..], &lists[k + 1][..], PAGE).with_pool_pages(
            PoolId(1),
            Some(&lists[k + 2][..]),
            Some(&lists[k + 3][..]),
        )
    };
    let (first, second) = (request(0), request(4));
    // Pool 0 continues (0 -> 10, then 1 -> 11); pool 1 does not (5 -> 16, then 4 -> 15).
    let batch = t.batch().plan(&[first, second]).unwrap();
    assert_eq!(batch.summary.n_blocks, 2 + 4);
    assert_eq!(batch.summary.n_segments(), 1);
    let reversed = t.batch().plan(&[second, first]).unwrap();
    assert_eq!(reversed.summary.n_blocks, 4 + 2);
    for (b, plan) in [(&batch, [0, 1]), (&reversed, [1, 0])] {
        let alone: Vec<Plan> = plan
            .iter()
            .map(|&k| t.plan(&[first, second][k]).unwrap())
            .collect();
        let mut rng = Rng(3);
        check_blame(&mut rng, &t, b, &alone, "opposite orders");
    }
}

#[test]
fn two_requests_writing_one_page_of_a_further_pool_are_refused_naming_both() {
    let (src, dst) = (pooled(1 << 32), pooled(1 << 40));
    let t = template(&src, &dst);
    let (s0, d0, s1, d1) = ([0i64], [10i64], [1i64], [11i64]);
    let (p0, p1, shared) = ([5i64], [6i64], [16i64]);
    let reqs = [
        Request::tokens(&s0, &d0, PAGE).with_pool_pages(
            PoolId(1),
            Some(&p0[..]),
            Some(&shared[..]),
        ),
        Request::tokens(&s1, &d1, PAGE).with_pool_pages(
            PoolId(1),
            Some(&p1[..]),
            Some(&shared[..]),
        ),
    ];
    let err = t.batch().plan(&reqs).unwrap_err();
    assert!(
        matches!(
            err,
            kvplan_core::PlanError::RequestsOverlap {
                what: "pool 1 page",
                index: 16,
                first: 0,
                second: 1
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("both write dst pool 1 page 16"),
        "{err}"
    );
}

/// Token templates of other shapes: page sizes that differ (2 source tokens a page, 4
/// destination), and a destination whose pages are not packed (items `2 × item` apart).
fn token_peers() -> Vec<(&'static str, Layout, Layout, u64)> {
    use support::layouts::{KvLayout, paged};
    let mha = |base, item: u64, page| {
        KvLayout::mha(base, 0..2, item, item * PAGES * 2).context(paged(page))
    };
    vec![
        (
            "page sizes",
            mha(1 << 32, 32, 2).build(),
            mha(1 << 40, 64, 4).build(),
            2,
        ),
        (
            "unpacked",
            mha(1 << 32, 64, 4).build(),
            mha(1 << 40, 64, 4).stride(128).build(),
            4,
        ),
    ]
}

#[test]
fn token_requests_of_any_count_copy_their_bytes_and_name_their_blocks() {
    let mut rng = Rng(52);
    for (name, src, dst, src_page) in token_peers() {
        let t = template(&src, &dst);
        let source = Arena::numbered(&src);
        let mut fused = 0;
        for case in 0..40 {
            let n = 1 + rng.below(8) as usize;
            let counts: Vec<usize> = (0..n).map(|_| 1 + rng.below(3) as usize).collect();
            let dst_lists = lists_of(&mut rng, &counts);
            // Whole source pages for the destination's: `PAGE / src_page` per page.
            let per = (PAGE / src_page) as i64;
            let lists: Vec<(Vec<i64>, Vec<i64>)> = dst_lists
                .into_iter()
                .map(|(_, d)| {
                    let s = d
                        .iter()
                        .flat_map(|&p| (0..per).map(move |k| per * p + k))
                        .collect();
                    (s, d)
                })
                .collect();
            // Whole pages or a partial last page.
            let tokens: Vec<u64> = lists
                .iter()
                .map(|(_, d)| d.len() as u64 * PAGE - rng.below(2) * rng.below(PAGE))
                .collect();
            let reqs: Vec<Request<'_>> = lists
                .iter()
                .zip(&tokens)
                .map(|((s, d), &n)| Request::tokens(s, d, n))
                .collect();
            let batch = t.batch().plan(&reqs).unwrap();
            let want = overlay(
                &dst,
                reqs.iter()
                    .map(|r| reference(&t, &src, &dst, r, None, &source)),
            );
            let got = applied(
                &src,
                &dst,
                &columns(&batch, 0..batch.summary.n_blocks),
                &source,
            );
            assert!(
                got.bytes == want.bytes,
                "{name} case {case}: batch bytes differ"
            );
            let alone: Vec<Plan> = reqs.iter().map(|r| t.plan(r).unwrap()).collect();
            let solo: usize = alone.iter().map(|p| p.lengths.len()).sum();
            assert!(batch.summary.n_blocks <= solo, "{name} case {case}");
            fused += n - batch.summary.n_segments();
            check_blame(&mut rng, &t, &batch, &alone, &format!("{name} case {case}"));
        }
        // Unpacked destination pages never continue one another: nothing merges there.
        if name == "unpacked" {
            assert_eq!(fused, 0, "{name}");
        } else {
            assert!(fused > 10, "{name}: the cases fuse ({fused} boundaries)");
        }
    }
}
