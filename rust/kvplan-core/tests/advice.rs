//! `Template::transfer_advice`: the core's direct-or-staged rule over a request's own counts.
//! The counts it uses are those of the request's direct plan and of its staged plan through
//! any real staging regions (they do not depend on where the regions are), and the choice
//! follows the cost.

mod support;

use kvplan_core::{
    AttentionGeometry, Choice, Layout, MemoryOrder, StagingRegion, Template, TemplateOptions,
    TransferCost, advise,
};
use kvplan_core::{Request, StagedPlanner, transfer_advice};
use support::layouts::{ContextBuilder, KvLayout, paged, tp_heads};

const HEADS: u32 = 8;
const HEAD_DIM: u32 = 64;
const PAGE: u64 = 4;
const LAYERS: usize = 3;
const CAPACITY: u64 = 32;

/// One TP rank's MHA NHD layout at `base`: every layer's K entry, then every V entry, back to
/// back, with heads of `HEAD_DIM` 2-byte elements.
fn layout(base: u64, tp_size: u32, tp_rank: u32) -> Layout {
    let geometry = AttentionGeometry {
        head_dim: HEAD_DIM,
        ..tp_heads(HEADS, tp_size, MemoryOrder::Nhd)
    };
    let item = PAGE * u64::from(geometry.heads_per_rank) * u64::from(HEAD_DIM) * 2;
    KvLayout::mha(base, 0..LAYERS as i64, item, item * CAPACITY)
        .context(paged(PAGE).tp(tp_rank, tp_size).attention(geometry))
        .build()
}

fn template(tp_p: u32, r_p: u32, tp_d: u32) -> Template {
    Template::new(
        &layout(1 << 32, tp_p, r_p),
        &layout(1 << 36, tp_d, 0),
        TemplateOptions::default(),
    )
    .unwrap()
}

fn cost(per_block_s: f64, network: f64, copy: f64) -> TransferCost {
    TransferCost::new(per_block_s, network, copy).unwrap()
}

const SRC: [i64; 6] = [5, 6, 7, 1, 20, 21];
const DST: [i64; 6] = [0, 2, 4, 9, 10, 30];

#[test]
fn counts_are_the_plans_counts_wherever_the_regions_are() {
    for (tp_p, r_p, tp_d) in [(8, 3, 2), (2, 1, 2), (1, 0, 4), (4, 2, 1), (8, 0, 1)] {
        let t = template(tp_p, r_p, tp_d);
        let c = cost(30e-6, 2e9, 10e9);
        let advice = transfer_advice(&t, &Request::pages(&SRC, &DST), &c).unwrap();
        let direct = t.plan(&Request::pages(&SRC, &DST)).unwrap();
        for (src_at, dst_at) in [(1 << 40, 1 << 41), (0x1234_5000, 0x7777_0000)] {
            let region = |addr| StagingRegion {
                addr,
                size: 1 << 30,
            };
            let staged = StagedPlanner::new(&t)
                .plan(&Request::pages(&SRC, &DST), region(src_at), region(dst_at))
                .unwrap();
            let want = advise(
                direct.src_addrs.len(),
                staged.network.src_addrs.len(),
                direct.total_bytes,
                staged.gather.total_bytes,
                staged.scatter.total_bytes,
                &c,
            );
            assert_eq!(advice, want, "TP {tp_p} -> {tp_d}, rank {r_p}");
        }
    }
}

#[test]
fn the_choice_follows_the_cost() {
    // TP 8 -> 2 NHD: one direct block per token per entry, one staged network block.
    let t = template(8, 0, 2);
    let (src, dst): (Vec<i64>, Vec<i64>) = (0..8).map(|p| (p, 2 * p)).unzip();
    let tcp = transfer_advice(&t, &Request::pages(&src, &dst), &cost(30e-6, 2e9, 10e9)).unwrap();
    assert_eq!(tcp.direct_blocks, 8 * PAGE as usize * 2 * LAYERS);
    assert_eq!((tcp.choice, tcp.staged_blocks), (Choice::Staged, 1));
    let free_blocks =
        transfer_advice(&t, &Request::pages(&src, &dst), &cost(1e-12, 2e9, 1e6)).unwrap();
    assert_eq!(free_blocks.choice, Choice::Direct);
}

#[test]
fn a_bad_request_is_the_plans_error() {
    let t = template(8, 0, 2);
    let bad = [0i64, CAPACITY as i64];
    let planned = t.plan(&Request::pages(&[0i64, 1], &bad)).unwrap_err();
    let advised =
        transfer_advice(&t, &Request::pages(&[0i64, 1], &bad), &cost(1e-6, 1e9, 1e9)).unwrap_err();
    assert_eq!(advised, planned);
}
