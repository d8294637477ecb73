//! Batch plans: many requests in one plan. Checked against the byte-level reference (each
//! request's reference copy, overlaid), segment by segment, and against the requests planned
//! one by one; the verdict helpers (`requests_in`, `call_ranges`) against their definitions.

mod support;

use kvplan_core::{
    BatchPart, BatchSummary, FlatRequests, GeometryOptions, LayerGroups, LayerSlices, Layout,
    LeaseRef, Plan, PlanBlocks, PlanError, Request, Template, TemplateOptions, layout_fingerprint,
    plan_digest, request_plan_digest,
};
use support::layouts::{KvLayout, kv_pool, paged};
use support::reference::{Arena, apply, reference};

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

/// Peer pairs a batch is planned between: per-run pieces (MHA, one buffer per entry), per-page
/// pieces (a cross-layer pool, every layer's item of a page side by side), and a token
/// template (page sizes 2 and 4).
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

/// Disjoint destination pages for `n` requests: runs of random lengths, every other request
/// continuing the previous one on both sides (so that segments form), the others elsewhere.
fn requests(rng: &mut Rng, n: usize, capacity: (u64, u64)) -> Vec<(Vec<i64>, Vec<i64>)> {
    let mut free_dst: Vec<i64> = (0..capacity.1 as i64).collect();
    let mut out: Vec<(Vec<i64>, Vec<i64>)> = Vec::new();
    for _ in 0..n {
        let len = 1 + rng.below(4) as usize;
        let continues = rng.below(2) == 0;
        let (src, dst): (Vec<i64>, Vec<i64>) = match out.last() {
            Some((ps, pd)) if continues => {
                let (s0, d0) = (ps.last().unwrap() + 1, pd.last().unwrap() + 1);
                (
                    (s0..s0 + len as i64).collect(),
                    (d0..d0 + len as i64).collect(),
                )
            }
            _ => {
                let s0 = rng.below(capacity.0 - 8) as i64;
                let d0 = rng.below(capacity.1 - 8) as i64;
                let descending = rng.below(4) == 0;
                let steps = |base: i64| -> Vec<i64> {
                    (0..len as i64)
                        .map(|k| {
                            if descending {
                                base + len as i64 - k
                            } else {
                                base + k
                            }
                        })
                        .collect()
                };
                (steps(s0), steps(d0))
            }
        };
        // Keep destinations disjoint: drop a request whose pages another already writes.
        if dst
            .iter()
            .any(|d| *d as u64 >= capacity.1 || !free_dst.contains(d))
            || src.iter().any(|s| *s as u64 >= capacity.0)
        {
            continue;
        }
        free_dst.retain(|d| !dst.contains(d));
        out.push((src, dst));
    }
    out
}

fn as_requests(lists: &[(Vec<i64>, Vec<i64>)]) -> Vec<Request<'_>> {
    lists.iter().map(|(s, d)| Request::pages(s, d)).collect()
}

fn columns_plan(src: &[u64], dst: &[u64], lengths: &[u64]) -> Plan {
    Plan {
        src_addrs: src.to_vec(),
        dst_addrs: dst.to_vec(),
        lengths: lengths.to_vec(),
        ..Plan::default()
    }
}

/// Overlays each request's reference copy (numbered bytes are never 0).
fn expected(
    t: &Template,
    src: &Layout,
    dst: &Layout,
    reqs: &[Request<'_>],
    source: &Arena,
) -> Arena {
    let mut want = Arena::zeroed(dst);
    for request in reqs {
        let one = reference(t, src, dst, request, None, source);
        for (w, b) in want.bytes.iter_mut().zip(&one.bytes) {
            if *b != 0 {
                *w = *b;
            }
        }
    }
    want
}

#[test]
fn batch_moves_the_bytes_of_every_request_and_segments_hold_their_requests() {
    let mut rng = Rng(7);
    let mut fused = 0usize;
    for (name, src, dst) in peers() {
        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let source = Arena::numbered(&src);
        let capacity = if t.by_token() {
            (PAGES, PAGES / 2)
        } else {
            (PAGES, PAGES)
        };
        for case in 0..60 {
            let n = 1 + rng.below(8) as usize;
            let lists = requests(&mut rng, n, capacity);
            // A token template takes whole source pages per decode page (2 per 1).
            let lists: Vec<_> = if t.by_token() {
                lists
                    .into_iter()
                    .map(|(_, d)| {
                        let s = d.iter().flat_map(|&p| [2 * p, 2 * p + 1]).collect();
                        (s, d)
                    })
                    .collect()
            } else {
                lists
            };
            let reqs = as_requests(&lists);
            let batch = t.batch().plan(&reqs).unwrap();
            let summary = &batch.summary;
            let plan = columns_plan(&batch.src_addrs, &batch.dst_addrs, &batch.lengths);
            let mut got = Arena::zeroed(&dst);
            apply(&src, &dst, &plan, &source, &mut got);
            let want = expected(&t, &src, &dst, &reqs, &source);
            assert!(
                got.bytes == want.bytes,
                "{name} case {case}: batch bytes differ"
            );

            // Per segment: its blocks move exactly its requests' bytes.
            let solo: usize = reqs.iter().map(|r| t.plan(r).unwrap().lengths.len()).sum();
            assert!(summary.n_blocks <= solo, "{name} case {case}");
            for s in 0..summary.n_segments() {
                let blocks = summary.segment_offsets[s]..summary.segment_offsets[s + 1];
                let held = summary.segment_requests[s]..summary.segment_requests[s + 1];
                fused += held.len() - 1;
                let part = columns_plan(
                    &batch.src_addrs[blocks.clone()],
                    &batch.dst_addrs[blocks.clone()],
                    &batch.lengths[blocks.clone()],
                );
                let mut one = Arena::zeroed(&dst);
                apply(&src, &dst, &part, &source, &mut one);
                let want = expected(&t, &src, &dst, &reqs[held.clone()], &source);
                assert!(one.bytes == want.bytes, "{name} case {case} segment {s}");
                if held.len() == 1 {
                    let alone = t.plan(&reqs[held.start]).unwrap();
                    assert_eq!(part.src_addrs, alone.src_addrs, "{name} case {case}");
                    assert_eq!(part.lengths, alone.lengths, "{name} case {case}");
                }
            }
            let bytes: u64 = reqs.iter().map(|r| t.plan(r).unwrap().total_bytes).sum();
            assert_eq!(summary.total_bytes, bytes);
        }
    }
    assert!(fused > 50, "the cases fuse requests ({fused} boundaries)");
}

#[test]
fn touching_requests_coalesce_into_the_blocks_of_one_request() {
    let src = KvLayout::mla(0x1000, 0..4, 64, 64 * PAGES).build();
    let dst = KvLayout::mla(0x100_0000, 0..4, 64, 64 * PAGES).build();
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    // 15 requests of 4 pages each, allocated back to back on both sides.
    let lists: Vec<(Vec<i64>, Vec<i64>)> = (0..15)
        .map(|r| {
            (
                (4 * r..4 * r + 4).collect(),
                (4 * r + 1..4 * r + 5).collect(),
            )
        })
        .collect();
    let reqs = as_requests(&lists);
    let batch = t.batch().plan(&reqs).unwrap();
    let all: (Vec<i64>, Vec<i64>) = ((0..60).collect(), (1..61).collect());
    let whole = t.plan(&Request::pages(&all.0, &all.1)).unwrap();
    assert_eq!(batch.src_addrs, whole.src_addrs);
    assert_eq!(batch.dst_addrs, whole.dst_addrs);
    assert_eq!(batch.lengths, whole.lengths);
    assert_eq!(batch.summary.n_segments(), 1);
    assert_eq!(batch.summary.requests_in(0..1), (0..15).collect::<Vec<_>>());
}

fn summary_of(segment_blocks: &[usize], segment_sizes: &[usize]) -> BatchSummary {
    let mut offsets = vec![0];
    let mut firsts = vec![0];
    for (&b, &n) in segment_blocks.iter().zip(segment_sizes) {
        offsets.push(offsets.last().unwrap() + b);
        firsts.push(firsts.last().unwrap() + n);
    }
    let src = KvLayout::mla(0x1000, 0..1, 64, 64 * PAGES).build();
    let t = Template::new(&src, &src.clone(), TemplateOptions::default()).unwrap();
    let one = t.prepare(&Request::<i64, i64>::pages(&[0], &[0])).unwrap();
    BatchSummary {
        n_blocks: *offsets.last().unwrap(),
        total_bytes: 0,
        segment_offsets: offsets,
        segment_requests: firsts.clone(),
        requests: vec![one; *firsts.last().unwrap()],
        merges: Vec::new(),
    }
}

#[test]
fn calls_cover_the_batch_and_name_exactly_the_requests_they_hold() {
    let mut rng = Rng(11);
    for _ in 0..300 {
        let n = 1 + rng.below(12) as usize;
        let blocks: Vec<usize> = (0..n).map(|_| rng.below(9) as usize).collect();
        let sizes: Vec<usize> = (0..n).map(|_| 1 + rng.below(3) as usize).collect();
        let summary = summary_of(&blocks, &sizes);
        let max = 1 + rng.below(10) as usize;
        let calls = summary.call_ranges(max).unwrap();
        // In order, back to back, from 0 to the end, none empty or larger than `max`.
        let mut at = 0;
        for call in &calls {
            assert_eq!(call.start, at);
            assert!(call.end > call.start && call.end - call.start <= max);
            at = call.end;
        }
        assert_eq!(at, summary.n_blocks);
        // A call holds a request exactly when one of the request's blocks is in the call.
        for call in &calls {
            let held = summary.requests_in(call.clone());
            for r in 0..summary.n_requests() {
                let mine = summary.request_blocks(r).unwrap();
                let overlaps = !mine.is_empty() && mine.start < call.end && call.start < mine.end;
                assert_eq!(held.contains(&r), overlaps, "request {r} in call {call:?}");
            }
        }
        // A segment that fits in one call is never split.
        for s in 0..summary.n_segments() {
            let (a, b) = (summary.segment_offsets[s], summary.segment_offsets[s + 1]);
            if b - a <= max && b > a {
                assert!(
                    calls.iter().any(|c| c.start <= a && b <= c.end),
                    "segment {s}"
                );
            }
        }
    }
    assert!(matches!(
        summary_of(&[1], &[1]).call_ranges(0),
        Err(PlanError::Geometry { .. })
    ));
}

#[test]
fn two_requests_writing_one_page_are_refused_naming_both() {
    let src = KvLayout::mla(0x1000, 0..2, 64, 64 * PAGES).build();
    let dst = KvLayout::mla(0x100_0000, 0..2, 64, 64 * PAGES).build();
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let lists = vec![
        (vec![0i64, 1], vec![10i64, 11]),
        (vec![5, 6], vec![30, 31]),
        (vec![2, 3], vec![20, 11]),
    ];
    let err = t.batch().plan(&as_requests(&lists)).unwrap_err();
    assert_eq!(
        err,
        PlanError::RequestsOverlap {
            what: "page",
            index: 11,
            first: 0,
            second: 2
        }
    );
    assert_eq!(err.kind(), "requests_overlap");
    assert!(err.to_string().contains("requests 0 and 2"), "{err}");

    // A request's own error names the request and keeps its kind.
    let lists = vec![(vec![0i64], vec![0i64]), (vec![1], vec![PAGES as i64])];
    let err = t.batch().plan(&as_requests(&lists)).unwrap_err();
    assert!(
        matches!(err, PlanError::InRequest { request: 1, .. }),
        "{err:?}"
    );
    assert_eq!(err.kind(), "index_bounds");
    assert!(
        err.to_string()
            .starts_with("request 1 of the batch: dst index 64"),
        "{err}"
    );

    // An empty batch plans nothing.
    let empty = t.batch().plan::<i64, i64>(&[]).unwrap();
    assert_eq!((empty.summary.n_blocks, empty.summary.n_segments()), (0, 0));
}

#[test]
fn request_digests_are_the_digests_of_the_requests_planned_alone() {
    let src = KvLayout::mha(0x1000, 0..3, 32, 32 * PAGES).build();
    let dst = KvLayout::mha(0x100_0000, 0..3, 32, 32 * PAGES).build();
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let prints = (
        layout_fingerprint(&src).unwrap(),
        layout_fingerprint(&dst).unwrap(),
    );
    let lists = requests(&mut Rng(3), 12, (PAGES, PAGES));
    let reqs = as_requests(&lists);
    let digests = t.batch().request_digests(&reqs, prints, &[]).unwrap();
    // With a lease per request (some without), each digest is the one rule of a plan alone.
    let ids: Vec<String> = (0..reqs.len()).map(|r| format!("req-{r}")).collect();
    let leases: Vec<Option<LeaseRef<'_>>> = ids
        .iter()
        .enumerate()
        .map(|(r, id)| {
            (r % 3 != 0).then_some(LeaseRef {
                epoch: 10 + r as u64,
                request: id.as_bytes(),
            })
        })
        .collect();
    let leased = t.batch().request_digests(&reqs, prints, &leases).unwrap();
    for r in 0..reqs.len() {
        assert_eq!(leased[r], request_plan_digest(digests[r], 0, leases[r]));
        assert_eq!(leased[r] == digests[r], leases[r].is_none(), "request {r}");
    }
    let err = t
        .batch()
        .request_digests(&reqs, prints, &leases[..2])
        .unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("2 leases for {} requests", reqs.len())),
        "{err}"
    );
    for (r, request) in reqs.iter().enumerate() {
        let alone = t.plan(request).unwrap();
        let blocks = PlanBlocks {
            src_addrs: &alone.src_addrs,
            dst_addrs: &alone.dst_addrs,
            lengths: &alone.lengths,
            pair_offsets: &alone.pair_offsets,
        };
        assert_eq!(
            digests[r],
            plan_digest(prints, &blocks).unwrap(),
            "request {r}"
        );
    }
}

/// `(src pages, dst pages, src offsets, dst offsets)` of `lists` concatenated.
fn flat(lists: &[(Vec<i64>, Vec<i64>)]) -> (Vec<i64>, Vec<i64>, Vec<i64>, Vec<i64>) {
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    let (mut src_offsets, mut dst_offsets) = (vec![0i64], vec![0i64]);
    for (s, d) in lists {
        src.extend_from_slice(s);
        dst.extend_from_slice(d);
        src_offsets.push(src.len() as i64);
        dst_offsets.push(dst.len() as i64);
    }
    (src, dst, src_offsets, dst_offsets)
}

#[test]
fn a_flat_batch_is_its_requests_planned_as_a_batch() {
    let mut rng = Rng(19);
    for (name, src, dst) in peers() {
        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        for case in 0..40 {
            let n = rng.below(10) as usize;
            let lists = requests(&mut rng, n, (PAGES, PAGES / 2));
            let lists: Vec<_> = if t.by_token() {
                lists
                    .into_iter()
                    .map(|(_, d)| (d.iter().flat_map(|&p| [2 * p, 2 * p + 1]).collect(), d))
                    .collect()
            } else {
                lists
            };
            let (s, d, so, dof) = flat(&lists);
            let mut given = FlatRequests::new(&s, &d, &so);
            given.dst_offsets = Some(&dof);
            let reqs = given.requests().unwrap();
            assert_eq!(reqs, as_requests(&lists), "{name} case {case}");
            assert_eq!(
                t.batch().plan(&reqs).unwrap(),
                t.batch().plan(&as_requests(&lists)).unwrap(),
                "{name} case {case}"
            );
            if so == dof {
                assert_eq!(FlatRequests::new(&s, &d, &so).requests().unwrap(), reqs);
            }
        }
    }
    // Token counts, one per request.
    let tokens = [3i64, 0];
    let (s, d) = ([1i64, 2, 3], [4i64, 5, 6]);
    let mut given = FlatRequests::new(&s, &d, &[0, 2, 3]);
    given.n_tokens = Some(&tokens);
    let reqs = given.requests().unwrap();
    assert_eq!(
        reqs,
        vec![
            Request::tokens(&s[..2], &d[..2], 3),
            Request::tokens(&s[2..], &d[2..], 0)
        ]
    );
}

#[test]
fn flat_offsets_that_do_not_describe_the_pages_are_refused_naming_the_values() {
    let (s, d) = ([0i32, 1, 2, 3], [5i64, 6, 7, 8]);
    let refused = |offsets: &[i64], dst_offsets: Option<&[i64]>, n_tokens: Option<&[i64]>| {
        let given = FlatRequests {
            src: &s,
            dst: &d,
            offsets,
            dst_offsets,
            n_tokens,
        };
        let err = given.requests().unwrap_err();
        assert_eq!(err.kind(), "flat_batch", "{err}");
        assert_eq!(err.class(), kvplan_core::ErrorClass::Other);
        err.to_string()
    };
    let cases: &[(&[i64], &str)] = &[
        (&[], "flat batch: offsets is empty"),
        (&[1, 2, 4], "offsets[0] is 1; offsets start at 0"),
        (&[-1, 2, 4], "offsets[0] is -1; offsets start at 0"),
        (&[0, -2, 4], "offsets[1] = -2 is negative"),
        (
            &[0, 3, 2, 4],
            "offsets[2] = 2 is less than offsets[1] = 3; offsets must not decrease",
        ),
        (&[0, 2, 3], "offsets[2] = 3 but src_pages has 4 values"),
        (&[0, 2, 5], "offsets[2] = 5 but src_pages has 4 values"),
    ];
    for &(offsets, want) in cases {
        let got = refused(offsets, None, None);
        assert!(
            got.starts_with("flat batch: ") && got.contains(want),
            "{got}"
        );
    }
    let got = refused(&[0, 2, 4], Some(&[0, 2]), None);
    assert!(
        got.contains("offsets has 3 values but dst_offsets has 2"),
        "{got}"
    );
    let got = refused(&[0, 2, 4], Some(&[0, 3, 2]), None);
    assert!(got.contains("dst_offsets[2] = 2 is less than"), "{got}");
    let got = refused(&[0, 2, 4], Some(&[0, 2, 3]), None);
    assert!(
        got.contains("dst_offsets[2] = 3 but dst_pages has 4"),
        "{got}"
    );
    let got = refused(&[0, 2, 4], None, Some(&[1]));
    assert!(
        got.contains("n_tokens has 1 values for 2 requests"),
        "{got}"
    );
    let got = refused(&[0, 2, 4], None, Some(&[1, -1]));
    assert!(got.contains("n_tokens[1] = -1 is negative"), "{got}");
    // Shared offsets name the side whose length they miss.
    let short = [5i64, 6, 7];
    let given = FlatRequests::new(&s, &short, &[0, 2, 4]);
    let got = given.requests().unwrap_err().to_string();
    assert!(
        got.contains("offsets[2] = 4 but dst_pages has 3 values")
            && got.contains("offsets serve both sides"),
        "{got}"
    );
    // No requests: one offset, 0, over empty slices.
    let none: [i64; 0] = [];
    assert!(
        FlatRequests::new(&none, &none, &[0])
            .requests()
            .unwrap()
            .is_empty()
    );
}

/// A batch cut into layer slices: every call of every slice and of the seal together send each
/// block of the batch exactly once, no call exceeds its bound, and each call names exactly the
/// requests whose blocks it holds (`requests_in` of its ranges), fused segments included.
#[test]
fn batch_slices_send_every_block_once_in_bounded_calls_naming_their_requests() {
    let layers = 0..6i64;
    let src = KvLayout::mha(0x1000, layers.clone(), 32, 32 * PAGES).build();
    let dst = KvLayout::mha(0x100_0000, layers, 32, 32 * PAGES).build();
    let groups = LayerGroups::fixed(2).unwrap();
    let t = Template::with_layer_groups(
        &src,
        &dst,
        TemplateOptions::default(),
        &GeometryOptions::default(),
        &groups,
    )
    .unwrap();
    let slices = LayerSlices::new(&t, &groups).unwrap();
    for seed in 0..8 {
        let lists = requests(&mut Rng(seed), 10, (PAGES, PAGES));
        let reqs = as_requests(&lists);
        let batch = t.batch().plan(&reqs).unwrap();
        let summary = &batch.summary;
        assert!(summary.n_segments() <= summary.n_requests());
        let cut = slices.of_batch(&t, summary);
        for max in [None, Some(1), Some(3), Some(7)] {
            let mut sent = vec![0u32; summary.n_blocks];
            let all: Vec<usize> = (0..slices.slices().len()).collect();
            let mut parts: Vec<BatchPart<'_>> = all
                .iter()
                .map(|k| BatchPart::Slices(std::slice::from_ref(k)))
                .collect();
            parts.push(BatchPart::Seal);
            for part in parts {
                for call in cut.calls(part, max, &[]).unwrap() {
                    assert!(call.blocks <= max.unwrap_or(usize::MAX), "seed {seed}");
                    let mut held: Vec<usize> = Vec::new();
                    for &(a, b) in &call.ranges {
                        sent[a..b].iter_mut().for_each(|n| *n += 1);
                        held.extend(summary.requests_in(a..b));
                    }
                    held.sort_unstable();
                    held.dedup();
                    assert_eq!(call.requests, held, "seed {seed} max {max:?}");
                    let blocks: usize = call.ranges.iter().map(|(a, b)| b - a).sum();
                    assert_eq!(call.blocks, blocks);
                }
            }
            assert!(sent.iter().all(|&n| n == 1), "seed {seed} max {max:?}");
        }
        // A segment's parts are the slices it has blocks in: all of them for this MHA model.
        for s in 0..cut.n_segments() {
            let (ks, seal) = cut.segment_parts(s);
            assert_eq!(ks, (0..3).collect::<Vec<_>>());
            assert!(!seal);
        }
        let err = cut.calls(BatchPart::Slices(&[3]), None, &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("slice 3 out of range for 3 slices"),
            "{err}"
        );
        assert!(cut.calls(BatchPart::Seal, Some(0), &[]).is_err());
        // Skipped segments are in no call; the others are sent as before.
        let skip: Vec<bool> = (0..cut.n_segments()).map(|s| s % 2 == 0).collect();
        for call in cut
            .calls(BatchPart::Slices(&[0, 1, 2]), Some(3), &skip)
            .unwrap()
        {
            for &r in &call.requests {
                let s = summary.segment_of(r).unwrap();
                assert!(!skip[s], "seed {seed}: segment {s} skipped");
            }
        }
        assert!(cut.calls(BatchPart::Seal, None, &skip[1..]).is_err());
    }
}
