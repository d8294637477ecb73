//! Pack plans: a prefill at DCP 1 sending to a decode rank at DCP N, planned directly and as a
//! gather into a pack buffer followed by a network plan out of it. Applying gather then network
//! to byte arenas must leave the decode pool byte for byte as the direct plan leaves it (the
//! direct plan itself is checked against the layout definitions in tests/dcp.rs), the pack
//! buffer must be the only thing the two plans share, and the network must move at most one
//! block per entry per destination page run. A staged plan of the same request (gather into a
//! staging region, one network block, scatter) must write the same bytes.

mod support;

use kvplan_core::{
    DcpContext, Layout, MemoryOrder, PackBuffer, Plan, PlanError, Template, TemplateOptions,
};
use kvplan_core::{PackPlanner, Request, StagedPlanner};
use support::blocks::scrambled_pages;
use support::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, dcp, heads, paged};

const LAYERS: u64 = 3;
const HEADS: u32 = 2;
const SRC_BASE: u64 = 0x1000_0000;
const DST_BASE: u64 = 0x2000_0000;
const PACK_BASE: u64 = 0x3000_0000;
const STAGE_BASE: u64 = 0x4000_0000;

#[derive(Clone, Copy, Debug)]
struct Case {
    mha: bool,
    ranks: u32,
    rank: u32,
    interleave: u64,
    page_sizes: (u64, u64),
    tokens: u64,
}

/// A layout with one arena of `capacity` pages per entry, entries back to back from `base`
/// (64 bytes apart); returns it with the arena's size.
fn layout(case: &Case, decode: bool, capacity: u64, base: u64) -> (Layout, u64) {
    let page_size = if decode {
        case.page_sizes.1
    } else {
        case.page_sizes.0
    };
    let kv_heads = if case.mha { HEADS } else { 1 };
    let item = u64::from(kv_heads) * HEAD_BYTES * page_size;
    let span = capacity * item;
    let dealt = if decode {
        dcp(case.ranks, case.rank, case.interleave)
    } else {
        DcpContext::default()
    };
    let context = paged(page_size)
        .model_layers(LAYERS)
        .attention(heads(kv_heads, kv_heads, MemoryOrder::Nhd))
        .dcp(dealt);
    let kind = if case.mha {
        KvLayout::mha
    } else {
        KvLayout::mla
    };
    let pages = kind(base, 0..LAYERS as i64, item, span)
        .spaced(span + 64)
        .context(context);
    let size = pages.end() - base;
    (pages.build(), size)
}

/// `count` distinct pages below `count + 3`, some consecutive, some not (deterministic).
fn pages(count: u64, seed: u64) -> Vec<i64> {
    scrambled_pages(count, count + 3, seed)
}

/// Runs of consecutive indices in a page list.
fn runs(pages: &[i64]) -> usize {
    pages.windows(2).filter(|w| w[1] != w[0] + 1).count() + usize::from(!pages.is_empty())
}

fn apply(plan: &Plan, from: (&[u8], u64), to: (&mut [u8], u64)) {
    for k in 0..plan.lengths.len() {
        let s = (plan.src_addrs[k] - from.1) as usize;
        let d = (plan.dst_addrs[k] - to.1) as usize;
        let len = plan.lengths[k] as usize;
        to.0[d..d + len].copy_from_slice(&from.0[s..s + len]);
    }
}

fn run(case: &Case) {
    let what = format!("{case:?}");
    let src_pages = pages(case.tokens.div_ceil(case.page_sizes.0), 7);
    let (src, src_size) = layout(case, false, src_pages.len() as u64 + 3, SRC_BASE);
    let dst_map = kvplan_core::rules::dcp::token_map(&layout(case, true, 1, DST_BASE).0);
    let dst_pages = pages(dst_map.pages_for(case.tokens), 11 + u64::from(case.rank));
    let (dst, dst_size) = layout(case, true, dst_pages.len() as u64 + 3, DST_BASE);
    let source: Vec<u8> = (0..src_size)
        .map(|k| (k.wrapping_mul(0x9E37_79B9) >> 7) as u8 | 1)
        .collect();
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let direct = t
        .plan(&Request::tokens(&src_pages, &dst_pages, case.tokens))
        .unwrap();
    let mut want = vec![0u8; dst_size as usize];
    apply(&direct, (&source, SRC_BASE), (&mut want, DST_BASE));

    let size = direct.total_bytes + 5; // a little more than needed: only the start is used
    let pack = PackBuffer {
        addr: PACK_BASE,
        size,
    };
    let packed = PackPlanner::new(&t)
        .plan(&Request::tokens(&src_pages, &dst_pages, case.tokens), pack)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(packed.pack_bytes, direct.total_bytes, "{what}");
    // The same request staged (gather → one network block → scatter) writes the same bytes.
    let region = |addr| kvplan_core::StagingRegion { addr, size };
    let staged = StagedPlanner::new(&t)
        .plan(
            &Request::tokens(&src_pages, &dst_pages, case.tokens),
            region(PACK_BASE),
            region(STAGE_BASE),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (mut stage_src, mut stage_dst) = (vec![0u8; size as usize], vec![0u8; size as usize]);
    let mut staged_pool = vec![0u8; dst_size as usize];
    apply(
        &staged.gather,
        (&source, SRC_BASE),
        (&mut stage_src, PACK_BASE),
    );
    apply(
        &staged.network,
        (&stage_src, PACK_BASE),
        (&mut stage_dst, STAGE_BASE),
    );
    apply(
        &staged.scatter,
        (&stage_dst, STAGE_BASE),
        (&mut staged_pool, DST_BASE),
    );
    assert!(
        staged_pool == want,
        "{what}: staged plan differs from the direct plan"
    );
    let one_block = usize::from(direct.total_bytes > 0);
    assert_eq!(staged.network.lengths.len(), one_block, "{what}");
    let mut buffer = vec![0u8; size as usize];
    let mut got = vec![0u8; dst_size as usize];
    // Every block of both plans stays inside the pack buffer on its pack side.
    for (addr, len) in packed
        .gather
        .dst_addrs
        .iter()
        .zip(&packed.gather.lengths)
        .chain(packed.network.src_addrs.iter().zip(&packed.network.lengths))
    {
        assert!(
            *addr >= PACK_BASE && addr + len <= PACK_BASE + packed.pack_bytes,
            "{what}"
        );
    }
    apply(
        &packed.gather,
        (&source, SRC_BASE),
        (&mut buffer, PACK_BASE),
    );
    apply(&packed.network, (&buffer, PACK_BASE), (&mut got, DST_BASE));
    assert_eq!(
        want.iter().any(|&b| b != 0),
        direct.total_bytes > 0,
        "{what}"
    );
    assert_eq!(
        got, want,
        "{what}: decode pool differs from the direct plan's"
    );
    for plan in [&packed.gather, &packed.network] {
        assert_eq!(plan.total_bytes, direct.total_bytes, "{what}");
        assert_eq!(
            plan.lengths.iter().sum::<u64>(),
            direct.total_bytes,
            "{what}"
        );
        assert_eq!(plan.pair_offsets.len(), direct.pair_offsets.len(), "{what}");
        assert_eq!(
            plan.pair_offsets.last(),
            Some(&plan.lengths.len()),
            "{what}"
        );
    }
    // The row gather: the same network plan, block for block, and a gather that fills the
    // pack buffer byte for byte as the block gather does.
    let (rows, network) = PackPlanner::new(&t)
        .row_gather(&Request::tokens(&src_pages, &dst_pages, case.tokens), pack)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(network, packed.network, "{what}");
    assert_eq!(rows.pack_bytes, packed.pack_bytes, "{what}");
    let mut by_rows = vec![0u8; size as usize];
    let mut copied = 0u64;
    for copy in &rows.copies {
        for (k, &row) in rows.rows[copy.lane].iter().enumerate() {
            let (from, to) = (copy.src_addr(row), copy.pack_addr + k as u64 * copy.len);
            assert!(
                from >= SRC_BASE && from + copy.len <= SRC_BASE + src_size,
                "{what}"
            );
            assert!(
                to >= PACK_BASE && to + copy.len <= PACK_BASE + rows.pack_bytes,
                "{what}"
            );
            let (from, to, n) = (
                (from - SRC_BASE) as usize,
                (to - PACK_BASE) as usize,
                copy.len as usize,
            );
            by_rows[to..to + n].copy_from_slice(&source[from..from + n]);
            copied += copy.len;
        }
    }
    assert_eq!(copied, direct.total_bytes, "{what}");
    assert_eq!(
        by_rows, buffer,
        "{what}: row gather packs other bytes than the block gather"
    );
    let entries = dst.n_entries();
    assert!(
        packed.network.lengths.len() <= entries * runs(&dst_pages),
        "{what}: {} network blocks for {entries} entries x {} destination runs",
        packed.network.lengths.len(),
        runs(&dst_pages)
    );
    // The point of packing: token round robin from a paged prefill is one block per token per
    // entry directly, far fewer through the pack buffer.
    if case.interleave == 1 && case.tokens >= 40 {
        assert_eq!(
            direct.lengths.len() as u64,
            entries as u64 * dst_map.local_count(case.tokens),
            "{what}"
        );
        assert!(
            packed.network.lengths.len() * 2 < direct.lengths.len(),
            "{what}"
        );
    }
}

#[test]
fn gather_then_network_writes_what_the_direct_plan_writes() {
    let mut n = 0;
    for mha in [false, true] {
        for ranks in [2u32, 4] {
            for page_sizes in [(4u64, 4u64), (8, 4), (4, 16)] {
                for interleave in [1, page_sizes.1] {
                    for tokens in [0u64, 1, 45, 70] {
                        for rank in 0..ranks {
                            run(&Case {
                                mha,
                                ranks,
                                rank,
                                interleave,
                                page_sizes,
                                tokens,
                            });
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(n, 2 * (2 + 4) * 3 * 2 * 4);
}

#[test]
fn a_pack_buffer_too_small_names_the_size_needed() {
    let case = Case {
        mha: false,
        ranks: 2,
        rank: 1,
        interleave: 1,
        page_sizes: (4, 4),
        tokens: 16,
    };
    let (src, _) = layout(&case, false, 8, SRC_BASE);
    let (dst, _) = layout(&case, true, 8, DST_BASE);
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    // 8 local tokens x 3 layers x 4 bytes.
    let need = 8 * LAYERS * HEAD_BYTES;
    let pack = |size| PackBuffer {
        addr: PACK_BASE,
        size,
    };
    let err = PackPlanner::new(&t)
        .plan(
            &Request::tokens(&[0i64, 1, 2, 3], &[0i64, 1], 16),
            pack(need - 1),
        )
        .unwrap_err();
    assert!(
        matches!(err, PlanError::PackTooSmall { need: n, have, .. } if n == need && have == need - 1),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!("at least {need} bytes")),
        "{err}"
    );
    let err = PackPlanner::new(&t)
        .row_gather(
            &Request::tokens(&[0i64, 1, 2, 3], &[0i64, 1], 16),
            pack(need - 1),
        )
        .unwrap_err();
    assert!(
        matches!(err, PlanError::PackTooSmall { need: n, .. } if n == need),
        "{err}"
    );
    assert!(
        PackPlanner::new(&t)
            .row_gather(
                &Request::tokens(&[0i64, 1, 2, 3], &[0i64, 1], 16),
                pack(need)
            )
            .is_ok()
    );
    let ok = PackPlanner::new(&t)
        .plan(
            &Request::tokens(&[0i64, 1, 2, 3], &[0i64, 1], 16),
            pack(need),
        )
        .unwrap();
    assert_eq!(ok.network.lengths.len(), LAYERS as usize);
    // A pack buffer whose end overflows the address space is refused, not wrapped.
    let err = PackPlanner::new(&t)
        .plan(
            &Request::tokens(&[0i64, 1, 2, 3], &[0i64, 1], 16),
            PackBuffer {
                addr: u64::MAX - 8,
                size: need,
            },
        )
        .unwrap_err();
    assert!(matches!(err, PlanError::Overflow { .. }), "{err}");
}

/// `packed_block_counts` is `plan_packed` over the model page lists (`0, 1, 2, …`, or every
/// other page): planned on buffers large enough to hold them, block for block the same counts.
#[test]
fn packed_block_counts_are_the_blocks_of_plan_packed_on_the_model_pages() {
    let mut n = 0;
    for mha in [false, true] {
        for (ranks, interleave) in [(2u32, 1u64), (4, 1), (4, 4), (2, 3)] {
            for page_sizes in [(4u64, 4u64), (8, 4), (4, 16)] {
                for tokens in [0u64, 1, 45, 70] {
                    for rank in 0..ranks {
                        let case = Case {
                            mha,
                            ranks,
                            rank,
                            interleave,
                            page_sizes,
                            tokens,
                        };
                        if page_sizes.1 % interleave != 0 && interleave % page_sizes.1 != 0 {
                            continue; // an interleave the decode page does not take
                        }
                        let src_count = tokens.div_ceil(page_sizes.0);
                        let (src, _) = layout(&case, false, 2 * src_count + 2, SRC_BASE);
                        let (dst, _) = layout(&case, true, 2 * src_count + 2, DST_BASE);
                        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
                        let (ms, md) = t.token_template().unwrap().pages_needed(tokens);
                        for fragmented in [false, true] {
                            let step = if fragmented { 2 } else { 1 };
                            let model = |count: u64| -> Vec<i64> {
                                (0..count as i64).map(|k| k * step).collect()
                            };
                            let (sp, dp) = (model(ms), model(md));
                            let direct = t.plan(&Request::tokens(&sp, &dp, tokens)).unwrap();
                            let pack = PackBuffer {
                                addr: PACK_BASE,
                                size: direct.total_bytes,
                            };
                            let packed = PackPlanner::new(&t)
                                .plan(&Request::tokens(&sp, &dp, tokens), pack)
                                .unwrap();
                            let counts = PackPlanner::new(&t).counts(tokens, fragmented).unwrap();
                            let what = format!("{case:?} fragmented={fragmented}");
                            assert_eq!(counts.direct, direct.lengths.len(), "{what}");
                            assert_eq!(counts.gather, packed.gather.lengths.len(), "{what}");
                            assert_eq!(counts.network, packed.network.lengths.len(), "{what}");
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(n > 300, "{n}");
}
