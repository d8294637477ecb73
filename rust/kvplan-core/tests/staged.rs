//! Staged plans: a request planned directly and as gather → network → scatter between two
//! staging regions. Executing the three staged plans on byte arenas must leave the decode pool
//! byte for byte as the direct plan leaves it, and both must equal the shared reference copier
//! (tests/support/reference.rs), over TP sizes, head counts, memory orders, PP, page sizes and
//! hybrid state (planned directly). Several writers (prefill TP ranks, PP stages) of one decode
//! rank must tile its staging region with no gap and no overlap; a region one byte short is a
//! typed error and nothing else.

mod support;

use kvplan_core::{
    FlatBuffer, MemoryOrder, Plan, PlanError, Side, StagedCounts, StagedPlan, StagingRegion,
    Template, TemplateOptions, TpSplit, copy_local,
};
use std::collections::HashSet;

use kvplan_core::{Request, StagedPlanner};
use support::blocks::state_plan;
use support::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, kv_pool, paged};
use support::reference::{Arena, apply, reference, reference_every_holder};
use support::staged_cases::{Case, DST_BASE, SRC_BASE, layout};

const SRC_STAGING: u64 = 0x4000_0000;
const DST_STAGING: u64 = 0xC000_0000;

/// Memory of several regions by address, for executing plans between them.
struct Memory {
    regions: Vec<(u64, Vec<u8>)>,
}

impl Memory {
    fn locate(&self, addr: u64, len: u64) -> (usize, usize) {
        for (i, (base, bytes)) in self.regions.iter().enumerate() {
            if addr >= *base && addr + len <= base + bytes.len() as u64 {
                return (i, (addr - base) as usize);
            }
        }
        panic!("block [{addr:#x}, +{len}) lies in no region");
    }

    /// Copies every block, asserting it lies in one region and writes no byte twice.
    fn run(&mut self, plan: &Plan, written: &mut HashSet<(usize, usize)>) {
        for k in 0..plan.lengths.len() {
            let (s, d, len) = (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]);
            assert!(len > 0, "empty block {k}");
            let (i, from) = self.locate(s, len);
            let (j, to) = self.locate(d, len);
            let bytes = self.regions[i].1[from..from + len as usize].to_vec();
            for b in 0..len as usize {
                assert!(written.insert((j, to + b)), "byte written twice");
            }
            self.regions[j].1[to..to + len as usize].copy_from_slice(&bytes);
        }
    }
}

fn region(addr: u64, size: u64) -> StagingRegion {
    StagingRegion { addr, size }
}

/// Plans one (prefill rank, decode rank) pair directly and staged, executes both, and asserts
/// both equal the reference. Returns the staged plan.
fn check_pair(case: &Case, r_p: u32, stage: u32, r_d: u32) -> StagedPlan {
    check_pair_with(case, r_p, stage, r_d, TemplateOptions::default()).0
}

/// As [`check_pair`] with template options; the prefill rank's bytes are numbered by address
/// and by rank (replicas hold different bytes, so a share shows whose copy it is). Returns the
/// staged plan and the prefill staging bytes after its gather.
fn check_pair_with(
    case: &Case,
    r_p: u32,
    stage: u32,
    r_d: u32,
    options: TemplateOptions,
) -> (StagedPlan, Vec<u8>) {
    let src = layout(case, Side::Src, r_p, stage);
    let dst = layout(case, Side::Dst, r_d, 0);
    let template = Template::new(&src, &dst, options).unwrap();
    let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
    let request = Request::new(&sp, &dp, case.n_tokens());
    let direct = template
        .plan(&Request::new(&sp, &dp, case.n_tokens()))
        .unwrap();
    let mut source = Arena::numbered(&src);
    for byte in &mut source.bytes {
        *byte = ((u32::from(*byte) + 37 * r_p) % 255 + 1) as u8; // never 0
    }
    let want = if options.replicas_send {
        reference_every_holder(&template, &src, &dst, &request, &source)
    } else {
        reference(&template, &src, &dst, &request, None, &source)
    };
    let mut got = Arena::zeroed(&dst);
    apply(&src, &dst, &direct, &source, &mut got);
    assert!(
        got.bytes == want.bytes,
        "direct plan differs from the reference: {case:?}"
    );

    let staged = StagedPlanner::new(&template)
        .plan(
            &Request::new(&sp, &dp, case.n_tokens()),
            region(SRC_STAGING, 1 << 24),
            region(DST_STAGING, 1 << 24),
        )
        .unwrap();
    assert_eq!(staged.direct_blocks, direct.lengths.len());
    assert_eq!(staged.src_staging_bytes, direct.total_bytes);
    let mut memory = Memory {
        regions: vec![
            (source.base, source.bytes.clone()),
            (SRC_STAGING, vec![0; staged.src_staging_bytes as usize]),
            (DST_STAGING, vec![0; staged.dst_staging_bytes as usize]),
            (got.base, vec![0; got.bytes.len()]),
        ],
    };
    // Gather and scatter keep the direct plan's pairs; the network is one range.
    for plan in [&staged.gather, &staged.scatter] {
        assert_eq!(plan.pair_offsets.len(), direct.pair_offsets.len());
        assert_eq!(plan.pair_offsets.last(), Some(&plan.lengths.len()));
    }
    assert_eq!(
        staged.network.pair_offsets,
        [0, staged.network.lengths.len()]
    );
    let mut gathered = Vec::new();
    for plan in [&staged.gather, &staged.network, &staged.scatter] {
        assert_eq!(plan.total_bytes, direct.total_bytes);
        assert_eq!(plan.lengths.iter().sum::<u64>(), direct.total_bytes);
        memory.run(plan, &mut HashSet::default());
        if gathered.is_empty() {
            gathered.clone_from(&memory.regions[1].1);
        }
    }
    assert!(
        memory.regions[3].1 == want.bytes,
        "staged plan differs from the direct plan and the reference: {case:?} r_p={r_p} \
         stage={stage} r_d={r_d}"
    );
    // One network block per request, or per K and V range of a PP stage.
    let most = if case.pp_p == 1 { 1 } else { 2 };
    assert!(
        staged.network.lengths.len() <= most,
        "{case:?}: {:?}",
        staged.network
    );
    // The counts the advice takes without planning are the materialised plan's, and the
    // bytes per pair range it derives them from are the direct plan's.
    let counts = StagedPlanner::new(&template)
        .counts(&Request::new(&sp, &dp, case.n_tokens()))
        .unwrap();
    assert_eq!(
        counts,
        StagedCounts {
            direct_blocks: direct.lengths.len(),
            network_blocks: staged.network.lengths.len(),
            bytes: staged.gather.total_bytes,
        },
        "{case:?} r_p={r_p} stage={stage} r_d={r_d}"
    );
    let summary = template
        .prepare(&Request::new(&sp, &dp, case.n_tokens()))
        .unwrap();
    let planned: Vec<u64> = direct
        .pair_offsets
        .windows(2)
        .map(|r| direct.lengths[r[0]..r[1]].iter().sum())
        .collect();
    assert_eq!(
        template.blocks().pair_bytes(&summary).unwrap(),
        planned,
        "{case:?}"
    );
    // The network stays inside this writer's share of the decode region.
    let (start, end) = staged.dst_staging_range;
    for k in 0..staged.network.lengths.len() {
        let at = staged.network.dst_addrs[k] - DST_STAGING;
        assert!(at >= start && at + staged.network.lengths[k] <= end);
    }
    // State is planned directly and moves its slot whole.
    if case.state {
        let (_, summary) = state_plan(&template, 1, 2);
        assert!(summary.n_blocks <= template.state_pairs().len());
    }
    (staged, gathered)
}

/// Every valid (heads, TP) combination with every page-size, order, PP and state variant is
/// listed; a fixed-seed sample of a few hundred is planned for one decode rank and each
/// prefill rank (and stage) that links to it.
#[test]
fn staged_equals_direct_equals_reference() {
    let page_sizes = [(1, 1), (16, 16), (64, 64), (16, 64), (64, 16), (1, 16)];
    let mut cases = Vec::new();
    for heads in [1, 2, 8, 16] {
        for tp_p in [1, 2, 4, 8] {
            for tp_d in [1, 2, 4, 8] {
                if TpSplit::new(heads, tp_p, tp_d).is_err() {
                    continue;
                }
                for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
                    for pp_p in [1, 2] {
                        for &page_sizes in &page_sizes {
                            for state in [false, true] {
                                let tokens = if page_sizes.0 == page_sizes.1 {
                                    2 * page_sizes.0.max(3)
                                } else {
                                    page_sizes.0.max(page_sizes.1) + 5
                                };
                                cases.push(Case {
                                    heads,
                                    tp_p,
                                    tp_d,
                                    order,
                                    pp_p,
                                    page_sizes,
                                    tokens,
                                    state,
                                    layers: 2,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut planned = 0;
    for (i, case) in cases.iter().enumerate() {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        // Every TP 8 → 2 NHD case, and one case in eight of the rest.
        let always = case.tp_p == 8 && case.tp_d == 2 && case.order == MemoryOrder::Nhd;
        if !always && !(seed >> 33).is_multiple_of(8) {
            continue;
        }
        let split = TpSplit::new(case.heads, case.tp_p, case.tp_d).unwrap();
        let r_d = (i as u32) % case.tp_d;
        for r_p in split.peers(Side::Dst, r_d).unwrap() {
            for stage in 0..case.pp_p {
                check_pair(case, r_p, stage, r_d);
                planned += 1;
            }
        }
    }
    assert!(planned > 300, "only {planned} pairs planned");
}

/// TP 8 → 2 (PP 1 and 2): the writers of decode rank 1 (four prefill ranks, each stage) cover
/// its staging region exactly once, and the network is at most two blocks per writer (one per
/// stage and K or V range).
#[test]
fn writers_tile_one_decode_region() {
    for pp_p in [1, 2] {
        let case = Case {
            heads: 8,
            tp_p: 8,
            tp_d: 2,
            order: MemoryOrder::Nhd,
            pp_p,
            page_sizes: (16, 16),
            tokens: 48,
            state: false,
            layers: 4,
        };
        let r_d = 1;
        let mut covered = vec![0u8; 0];
        for r_p in 4..8 {
            for stage in 0..pp_p {
                let staged = check_pair(&case, r_p, stage, r_d);
                assert_eq!(staged.writer, (r_p % 4, 4));
                let want_blocks = if pp_p == 1 { 1 } else { 2 };
                assert_eq!(staged.network.lengths.len(), want_blocks, "{staged:?}");
                if covered.is_empty() {
                    covered = vec![0; staged.dst_staging_bytes as usize];
                }
                assert_eq!(
                    covered.len() as u64,
                    staged.dst_staging_bytes,
                    "r_p={r_p} stage={stage} {staged:?}"
                );
                for k in 0..staged.network.lengths.len() {
                    let at = (staged.network.dst_addrs[k] - DST_STAGING) as usize;
                    for c in &mut covered[at..at + staged.network.lengths[k] as usize] {
                        *c += 1;
                    }
                }
            }
        }
        assert!(
            covered.iter().all(|&c| c == 1),
            "PP {pp_p}: the writers leave a gap or overlap in the decode region"
        );
        // 4 writers × 8 entries (4 layers × K, V) × 48 tokens × 1 head × 4 bytes.
        assert_eq!(covered.len(), 4 * 8 * 48 * 4);
    }
}

/// Replicated prefill heads (heads {1, 2}, TP 8 → 2, 4 → 1, 8 → 1, PP 1 and 2, both memory
/// orders): with `replicas_send` every prefill rank of a decode region is a writer of its own
/// share (writer `r_p mod (tp_p / tp_d)`), staged == direct == reference for each, and the
/// shares tile the region with no gap or overlap, each holding its own rank's copy. Without the
/// option a non-elected replica plans nothing and says why, as before.
#[test]
fn replica_writers_fill_their_own_shares() {
    let every_holder = TemplateOptions {
        replicas_send: true,
        ..TemplateOptions::default()
    };
    let mut shares = 0;
    for heads in [1, 2] {
        for (tp_p, tp_d) in [(8, 2), (4, 1), (8, 1)] {
            for pp_p in [1, 2] {
                for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
                    let case = Case {
                        heads,
                        tp_p,
                        tp_d,
                        order,
                        pp_p,
                        page_sizes: (16, 16),
                        tokens: 40,
                        state: false,
                        layers: 4,
                    };
                    let split = TpSplit::new(heads, tp_p, tp_d).unwrap();
                    let writers = tp_p / tp_d;
                    for r_d in 0..tp_d {
                        // SGLang's writers of decode rank r_d: prefill ranks r_p / writers == r_d.
                        let ranks: Vec<u32> = (r_d * writers..(r_d + 1) * writers).collect();
                        for r_p in split.peers(Side::Dst, r_d).unwrap() {
                            // A holder that is not one of r_d's writers still plans nothing.
                            let src = layout(&case, Side::Src, r_p, 0);
                            let dst = layout(&case, Side::Dst, r_d, 0);
                            let t = Template::new(&src, &dst, every_holder).unwrap();
                            let reason = t.empty_reason();
                            assert_eq!(reason.is_none(), ranks.contains(&r_p), "{reason:?}");
                            if let Some(reason) = reason {
                                assert!(reason.contains("writers"), "{reason}");
                            }
                        }
                        let mut region: Vec<u8> = Vec::new();
                        let mut covered: Vec<u8> = Vec::new();
                        let mut sent = Vec::new();
                        for &r_p in &ranks {
                            for stage in 0..pp_p {
                                let (staged, gathered) =
                                    check_pair_with(&case, r_p, stage, r_d, every_holder);
                                assert_eq!(staged.writer, (r_p % writers, writers));
                                assert!(staged.src_staging_bytes > 0, "{case:?} r_p={r_p}");
                                if region.is_empty() {
                                    region = vec![0; staged.dst_staging_bytes as usize];
                                    covered = vec![0; region.len()];
                                }
                                assert_eq!(region.len() as u64, staged.dst_staging_bytes);
                                let (start, end) = staged.dst_staging_range;
                                let n = &staged.network;
                                for k in 0..n.lengths.len() {
                                    let from = (n.src_addrs[k] - SRC_STAGING) as usize;
                                    let at = (n.dst_addrs[k] - DST_STAGING) as usize;
                                    let len = n.lengths[k] as usize;
                                    assert!(at as u64 >= start && (at + len) as u64 <= end);
                                    region[at..at + len]
                                        .copy_from_slice(&gathered[from..from + len]);
                                    covered[at..at + len].iter_mut().for_each(|c| *c += 1);
                                    sent.push((r_p, at, gathered[from..from + len].to_vec()));
                                }
                                // Without the option only the elected holder sends.
                                let src = layout(&case, Side::Src, r_p, stage);
                                let dst = layout(&case, Side::Dst, r_d, 0);
                                let elected =
                                    Template::new(&src, &dst, TemplateOptions::default()).unwrap();
                                let plan = elected
                                    .plan(&Request::pages(
                                        &case.pages(Side::Src),
                                        &case.pages(Side::Dst),
                                    ))
                                    .unwrap();
                                let is_replica = matches!(
                                    split.link(r_p, r_d).unwrap(),
                                    kvplan_core::Link::Replica { .. }
                                );
                                assert_eq!(plan.lengths.is_empty(), is_replica);
                                assert_eq!(elected.empty_reason().is_some(), is_replica);
                            }
                        }
                        assert!(
                            covered.iter().all(|&c| c == 1),
                            "{case:?} r_d={r_d}: the writers leave a gap or overlap"
                        );
                        // Each share holds its own rank's copy (replicas' bytes differ).
                        for (r_p, at, bytes) in &sent {
                            assert!(
                                region[*at..*at + bytes.len()] == bytes[..],
                                "{case:?} r_d={r_d}: writer {r_p}'s share was overwritten"
                            );
                            shares += 1;
                        }
                        let first = |r: u32| sent.iter().find(|s| s.0 == r).map(|s| &s.2);
                        assert_ne!(first(ranks[0]), first(ranks[1]), "{case:?}");
                    }
                }
            }
        }
    }
    assert!(shares > 100, "only {shares} shares checked");
}

/// A region of exactly the bytes needed works; one byte less is a typed error naming both
/// sizes, on either side.
#[test]
fn staging_regions_of_edge_sizes() {
    let case = Case {
        heads: 8,
        tp_p: 8,
        tp_d: 2,
        order: MemoryOrder::Nhd,
        pp_p: 1,
        page_sizes: (16, 16),
        tokens: 32,
        state: true,
        layers: 2,
    };
    let src = layout(&case, Side::Src, 5, 0);
    let dst = layout(&case, Side::Dst, 1, 0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
    let big = region(DST_STAGING, 1 << 24);
    let staged = StagedPlanner::new(&template)
        .plan(&Request::pages(&sp, &dp), region(SRC_STAGING, 1 << 24), big)
        .unwrap();
    let (src_need, dst_need) = (staged.src_staging_bytes, staged.dst_staging_bytes);
    // 2 layers × K, V × 32 tokens × 1 head × 4 bytes, and 4 writers of that.
    assert_eq!(src_need, 2 * 2 * 32 * 4);
    assert_eq!(dst_need, 4 * src_need);
    assert_eq!(staged.dst_staging_range, (src_need, 2 * src_need));
    let exact = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&sp, &dp),
            region(SRC_STAGING, src_need),
            region(DST_STAGING, dst_need),
        )
        .unwrap();
    assert_eq!(exact, staged);
    let short_src = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&sp, &dp),
            region(SRC_STAGING, src_need - 1),
            big,
        )
        .unwrap_err();
    assert!(
        matches!(short_src, PlanError::StagingTooSmall { region: "prefill", need, have, .. }
            if need == src_need && have == src_need - 1),
        "{short_src:?}"
    );
    let short_dst = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&sp, &dp),
            region(SRC_STAGING, src_need),
            region(DST_STAGING, dst_need - 1),
        )
        .unwrap_err();
    assert!(
        matches!(short_dst, PlanError::StagingTooSmall { region: "decode", need, have, .. }
            if need == dst_need && have == dst_need - 1),
        "{short_dst:?}"
    );
    assert!(short_dst.to_string().contains(&dst_need.to_string()));
    // A region whose end overflows u64 is an error, not a wrapped address.
    let wraps = StagedPlanner::new(&template).plan(
        &Request::pages(&sp, &dp),
        region(u64::MAX - 4, 16),
        big,
    );
    assert!(
        matches!(wraps, Err(PlanError::Overflow { .. })),
        "{wraps:?}"
    );
}

/// A head-sliced NHD request is staged token-major per entry (`[token][sent heads][head]`),
/// SGLang's layout: prefill TP 2 → decode TP 8 sends one of four heads of every token, and
/// byte `t × head` of entry K0's staging is token `t`'s head (the page plan would be
/// slot-major).
#[test]
fn sliced_nhd_staging_is_token_major() {
    let case = Case {
        heads: 8,
        tp_p: 2,
        tp_d: 8,
        order: MemoryOrder::Nhd,
        pp_p: 1,
        page_sizes: (16, 16),
        tokens: 32,
        state: false,
        layers: 2,
    };
    let src = layout(&case, Side::Src, 0, 0);
    let dst = layout(&case, Side::Dst, 1, 0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
    let staged = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&sp, &dp),
            region(SRC_STAGING, 1 << 20),
            region(DST_STAGING, 1 << 20),
        )
        .unwrap();
    // Staging offset → source address, head unit by head unit.
    let mut staged_from = std::collections::HashMap::new();
    let g = &staged.gather;
    for k in 0..g.lengths.len() {
        for u in (0..g.lengths[k]).step_by(HEAD_BYTES as usize) {
            staged_from.insert(g.dst_addrs[k] + u - SRC_STAGING, g.src_addrs[k] + u);
        }
    }
    let k0 = src.parts().data_ptrs[0];
    let token = 4 * HEAD_BYTES; // four heads per prefill token
    for t in 0..32u64 {
        let page = sp[(t / 16) as usize] as u64;
        let want = k0 + page * 16 * token + (t % 16) * token + HEAD_BYTES; // head 1
        assert_eq!(staged_from[&(t * HEAD_BYTES)], want, "token {t}");
    }
}

/// The core's CPU copier executes gather and scatter plans on byte slices, and refuses a block
/// outside its buffers before copying anything.
#[test]
fn copy_local_runs_local_plans_and_checks_blocks() {
    let case = Case {
        heads: 8,
        tp_p: 4,
        tp_d: 2,
        order: MemoryOrder::Nhd,
        pp_p: 1,
        page_sizes: (16, 16),
        tokens: 32,
        state: false,
        layers: 2,
    };
    let src = layout(&case, Side::Src, 1, 0);
    let dst = layout(&case, Side::Dst, 0, 0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
    let staged = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&sp, &dp),
            region(SRC_STAGING, 1 << 20),
            region(DST_STAGING, 1 << 20),
        )
        .unwrap();
    let source = Arena::numbered(&src);
    let request = Request::new(&sp, &dp, None);
    let want = reference(&template, &src, &dst, &request, None, &source);
    let mut staging = vec![0u8; staged.src_staging_bytes as usize];
    let g = &staged.gather;
    let copied = copy_local(
        &g.src_addrs,
        &g.dst_addrs,
        &g.lengths,
        &[kvplan_core::Region {
            base: source.base,
            bytes: &source.bytes,
        }],
        &mut [kvplan_core::RegionMut {
            base: SRC_STAGING,
            bytes: &mut staging,
        }],
    )
    .unwrap();
    assert_eq!(copied, staged.src_staging_bytes);
    // The network by hand (one block here), then the scatter through the copier again.
    let mut decode_staging = vec![0u8; staged.dst_staging_bytes as usize];
    let n = &staged.network;
    for k in 0..n.lengths.len() {
        let (from, to, len) = (
            (n.src_addrs[k] - SRC_STAGING) as usize,
            (n.dst_addrs[k] - DST_STAGING) as usize,
            n.lengths[k] as usize,
        );
        decode_staging[to..to + len].copy_from_slice(&staging[from..from + len]);
    }
    let mut pool = vec![0u8; want.bytes.len()];
    let s = &staged.scatter;
    copy_local(
        &s.src_addrs,
        &s.dst_addrs,
        &s.lengths,
        &[kvplan_core::Region {
            base: DST_STAGING,
            bytes: &decode_staging,
        }],
        &mut [kvplan_core::RegionMut {
            base: want.base,
            bytes: &mut pool,
        }],
    )
    .unwrap();
    assert!(
        pool == want.bytes,
        "copy_local result differs from the reference"
    );
    // A pool one byte short of the block reaching furthest: that block no longer fits, and
    // nothing is copied at all.
    let furthest = (0..s.lengths.len())
        .max_by_key(|&k| s.dst_addrs[k] + s.lengths[k])
        .unwrap();
    let end = s.dst_addrs[furthest] + s.lengths[furthest];
    let mut short = vec![0u8; (end - want.base - 1) as usize];
    let err = copy_local(
        &s.src_addrs,
        &s.dst_addrs,
        &s.lengths,
        &[kvplan_core::Region {
            base: DST_STAGING,
            bytes: &decode_staging,
        }],
        &mut [kvplan_core::RegionMut {
            base: want.base,
            bytes: &mut short,
        }],
    )
    .unwrap_err();
    assert!(
        matches!(err, PlanError::BlockOutsideBuffers { side: Side::Dst, block, .. } if block == furthest),
        "{err:?}"
    );
    assert!(
        short.iter().all(|&b| b == 0),
        "bytes copied before the error"
    );
    let overlap =
        kvplan_core::check_local_buffers(&[(0x1000, 64)], &[(0x1020, 64)], &[]).unwrap_err();
    assert!(
        matches!(overlap, PlanError::BuffersOverlap { .. }),
        "{overlap:?}"
    );
    assert!(
        kvplan_core::check_local_buffers(
            &[(0x1000, 64), (0x1000, 64)],
            &[(0x1040, 8)],
            &[(0x1000, 8)]
        )
        .is_ok()
    );
    let dst_dst =
        kvplan_core::check_local_buffers(&[], &[(0x1000, 64), (0x103f, 1)], &[]).unwrap_err();
    assert!(
        dst_dst.to_string().contains("destination buffer 1"),
        "{dst_dst}"
    );
}

/// Prefill PP 2 on cross-layer pools: each stage's pool coalesces its layers into one block
/// range, which takes that many consecutive decode slots; the stages' staged plans write what
/// their direct plans write and tile the decode region with one network block each.
#[test]
fn coalesced_pool_stages_take_consecutive_slots() {
    const ITEM: u64 = 32; // one K or V item of a page
    const LAYERS: u64 = 4;
    let pool = |layers: std::ops::Range<i64>, base: u64, pages: u64, stage: u32, pp: u32| {
        let context = paged(4).model_layers(LAYERS).pp(stage, pp);
        kv_pool(base, pages, layers, ITEM, context)
    };
    let dst = pool(0..LAYERS as i64, DST_BASE, 8, 0, 1);
    let (src_pages, dst_pages) = (vec![0i64, 1, 2, 5], vec![6i64, 7, 1, 2]);
    let mut covered = vec![0u8; 0];
    for stage in 0..2u32 {
        let half = LAYERS as i64 / 2;
        let layers = i64::from(stage) * half..i64::from(stage + 1) * half;
        let src = pool(layers, SRC_BASE, 8, stage, 2);
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        assert_eq!(
            template.blocks().groups().len(),
            1,
            "the stage's pairs coalesce into one group"
        );
        let direct = template
            .plan(&Request::pages(&src_pages, &dst_pages))
            .unwrap();
        let staged = StagedPlanner::new(&template)
            .plan(
                &Request::pages(&src_pages, &dst_pages),
                region(SRC_STAGING, 1 << 20),
                region(DST_STAGING, 1 << 20),
            )
            .unwrap();
        let source = Arena::numbered(&src);
        let mut want = Arena::zeroed(&dst);
        apply(&src, &dst, &direct, &source, &mut want);
        let mut memory = Memory {
            regions: vec![
                (source.base, source.bytes.clone()),
                (SRC_STAGING, vec![0; staged.src_staging_bytes as usize]),
                (DST_STAGING, vec![0; staged.dst_staging_bytes as usize]),
                (want.base, vec![0; want.bytes.len()]),
            ],
        };
        for plan in [&staged.gather, &staged.network, &staged.scatter] {
            memory.run(plan, &mut HashSet::default());
        }
        assert!(memory.regions[3].1 == want.bytes, "stage {stage}");
        assert_eq!(staged.network.lengths.len(), 1);
        // 8 decode entries × 4 pages × one item each.
        assert_eq!(staged.dst_staging_bytes, 8 * 4 * ITEM);
        if covered.is_empty() {
            covered = vec![0; staged.dst_staging_bytes as usize];
        }
        let at = (staged.network.dst_addrs[0] - DST_STAGING) as usize;
        assert_eq!(
            at as u64,
            u64::from(stage) * 4 * 4 * ITEM,
            "stage {stage}'s first slot"
        );
        for c in &mut covered[at..at + staged.network.lengths[0] as usize] {
            *c += 1;
        }
    }
    assert!(
        covered.iter().all(|&c| c == 1),
        "the two stages tile the region"
    );
}

/// Decode slots need one size per entry pair: K and V items of different sizes under PP are a
/// typed error naming both sizes, not overlapping slots.
#[test]
fn unequal_pairs_have_no_decode_slots() {
    let mha = |base: u64, stage: u32, pp: u32, layers: std::ops::Range<i64>| {
        KvLayout::mha(base, layers, 64, 4096)
            .spaced(4096)
            .v_items(32, 4096)
            .context(paged(4).model_layers(4).pp(stage, pp))
            .build()
    };
    let src = mha(SRC_BASE, 1, 2, 2..4);
    let dst = mha(DST_BASE, 0, 1, 0..4);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let err = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&[0i64, 1], &[3i64, 4]),
            region(SRC_STAGING, 1 << 20),
            region(DST_STAGING, 1 << 20),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::StagingSlotSizes {
                first_pair: 0,
                first_bytes: 128,
                pair: 2,
                bytes: 64
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("128 bytes per entry"), "{err}");
    // At PP 1 the same items are packed back to back: no slots, no error.
    let src = mha(SRC_BASE, 0, 1, 0..4);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let staged = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&[0i64, 1], &[3i64, 4]),
            region(SRC_STAGING, 1 << 20),
            region(DST_STAGING, 1 << 20),
        )
        .unwrap();
    assert_eq!(staged.network.lengths.len(), 1);
    assert_eq!(staged.dst_staging_bytes, 4 * 2 * (64 + 32));
}

/// TP 6 → 4 (12 heads): decode rank 1 takes heads 3–5 from two prefill ranks, decode rank 0
/// heads 0–2 from two others, with no fixed writer count a layout could place apart; staging
/// refuses (the direct plan still works).
#[test]
fn tp_sizes_that_do_not_divide_are_refused() {
    assert_eq!(kvplan_core::staging_writer(8, 5, 2).unwrap(), (1, 4));
    assert_eq!(kvplan_core::staging_writer(2, 1, 8).unwrap(), (0, 1));
    let case = Case {
        heads: 12,
        tp_p: 6,
        tp_d: 4,
        order: MemoryOrder::Nhd,
        pp_p: 1,
        page_sizes: (4, 4),
        tokens: 8,
        state: false,
        layers: 2,
    };
    let src = layout(&case, Side::Src, 1, 0);
    let dst = layout(&case, Side::Dst, 0, 0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
    assert!(
        template
            .plan(&Request::pages(&sp, &dp))
            .unwrap()
            .total_bytes
            > 0
    );
    let err = StagedPlanner::new(&template)
        .plan(
            &Request::pages(&sp, &dp),
            region(SRC_STAGING, 1 << 20),
            region(DST_STAGING, 1 << 20),
        )
        .unwrap_err();
    assert!(
        matches!(&err, PlanError::Geometry { what } if what.contains("prefill TP 6, decode TP 4")),
        "{err:?}"
    );
}

/// `plan_staged_into` writes gather and scatter into the caller's two outputs (the allocating
/// `plan_staged` is the same plan), and refuses a scatter output that cannot hold the plan's
/// blocks before writing any of it.
#[test]
fn staged_into_caller_outputs() {
    let case = Case {
        heads: 8,
        tp_p: 8,
        tp_d: 2,
        order: MemoryOrder::Nhd,
        pp_p: 1,
        page_sizes: (16, 16),
        tokens: 48,
        state: false,
        layers: 2,
    };
    let src = layout(&case, Side::Src, 1, 0);
    let dst = layout(&case, Side::Dst, 0, 0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
    let regions = (region(SRC_STAGING, 1 << 20), region(DST_STAGING, 1 << 20));
    let want = StagedPlanner::new(&template)
        .plan(&Request::pages(&sp, &dp), regions.0, regions.1)
        .unwrap();
    let (gather, scatter, summary) = StagedPlanner::new(&template)
        .plan_into(&Request::pages(&sp, &dp), regions.0, regions.1, |shape| {
            Ok((
                FlatBuffer::zeroed(shape.n_blocks),
                FlatBuffer::zeroed(shape.n_blocks),
            ))
        })
        .unwrap();
    let columns = |b: &FlatBuffer, n: usize| {
        let c = b.capacity;
        (
            b.data[..n].to_vec(),
            b.data[c..c + n].to_vec(),
            b.data[2 * c..2 * c + n].to_vec(),
        )
    };
    let of = |p: &Plan| (p.src_addrs.clone(), p.dst_addrs.clone(), p.lengths.clone());
    assert_eq!(columns(&gather, summary.gather.n_blocks), of(&want.gather));
    assert_eq!(
        columns(&scatter, summary.scatter.n_blocks),
        of(&want.scatter)
    );
    assert_eq!(summary.gather.pair_offsets, want.gather.pair_offsets);
    assert_eq!(summary.scatter.pair_offsets, want.scatter.pair_offsets);
    assert_eq!(summary.network, want.network);
    assert_eq!(
        (
            summary.src_staging_bytes,
            summary.direct_blocks,
            summary.writer
        ),
        (want.src_staging_bytes, want.direct_blocks, want.writer)
    );
    // Many blocks (one per token per entry), one network block.
    assert_eq!(want.scatter.lengths.len(), want.direct_blocks);
    assert_eq!(want.network.lengths.len(), 1);

    let err = StagedPlanner::new(&template)
        .plan_into(&Request::pages(&sp, &dp), regions.0, regions.1, |shape| {
            Ok((
                FlatBuffer::zeroed(shape.n_blocks),
                FlatBuffer::zeroed(shape.n_blocks - 1),
            ))
        })
        .unwrap_err();
    let need = want.direct_blocks;
    assert!(
        matches!(err, PlanError::OutputTooSmall { have, need: n } if have == need - 1 && n == need),
        "{err:?}"
    );
}
