//! Token plans (different page sizes or memory orders, or `n_tokens`) against the byte-level
//! reference: block shapes, typed errors, and a property test over page sizes, orders, padded
//! strides, page lists and token counts.

mod support;

use kvplan_core::Request;
use kvplan_core::{
    BlockRequest, Layout, LayoutContext, MemoryOrder, PlanError, Side, Template, TemplateOptions,
};
use proptest::prelude::*;
use support::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, heads, paged};
use support::reference::check_plan;

const HEADS: u32 = 2;
const TOKEN: u64 = HEADS as u64 * HEAD_BYTES;

/// K and V of two layers at `page_size`, `pages` pages each, packed or with a padded
/// stride, in an arena starting at `base`.
fn layout(base: u64, page_size: u64, pages: u64, order: Option<MemoryOrder>, pad: u64) -> Layout {
    let item = page_size * TOKEN;
    let stride = item + pad;
    let geometry = order.map(|memory_order| heads(HEADS, HEADS, memory_order));
    KvLayout::mha(base, [0, 1], item, pages * stride)
        .stride(stride)
        .context(paged(page_size).attention(geometry))
        .build()
}

/// Plans the request and compares its bytes with the reference copier (which also checks that
/// no destination byte is written twice and every block stays inside its buffers).
fn check(
    sizes: (u64, u64),
    orders: (Option<MemoryOrder>, Option<MemoryOrder>),
    pads: (u64, u64),
    src_pages: &[i64],
    dst_pages: &[i64],
    n_tokens: Option<u64>,
) {
    let src = layout(0x1000, sizes.0, 16, orders.0, pads.0);
    let dst = layout(0x10_0000, sizes.1, 16, orders.1, pads.1);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let request = Request::new(src_pages, dst_pages, n_tokens);
    let plan = check_plan(&template, &src, &dst, &request, None);
    let n = n_tokens.unwrap_or_else(|| {
        (src_pages.len() as u64 * sizes.0).min(dst_pages.len() as u64 * sizes.1)
    });
    assert_eq!(plan.total_bytes, n * TOKEN * 4);
}

fn pages(n: usize, swaps: &[bool]) -> Vec<i64> {
    // n distinct pages below 16: 0..16 with some positions swapped (runs and breaks).
    let mut v: Vec<i64> = (0..16).collect();
    for (k, &swap) in swaps.iter().enumerate() {
        if swap {
            v.swap(k, (k * 5 + 3) % 16);
        }
    }
    v.truncate(n);
    v
}

#[test]
fn sixteen_to_sixty_four_nhd_contiguous_is_one_block_per_entry() {
    let src = layout(0x1000, 16, 16, Some(MemoryOrder::Nhd), 0);
    let dst = layout(0x10_0000, 64, 4, Some(MemoryOrder::Nhd), 0);
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let plan = t
        .plan(&Request::pages(&(0..8i64).collect::<Vec<_>>(), &[1i64, 2]))
        .unwrap();
    assert_eq!(plan.lengths, vec![128 * TOKEN; 4]);
    // HND: one block per head per segment: 100 tokens over source pages of 16 are 7.
    let src = layout(0x1000, 16, 16, Some(MemoryOrder::Hnd), 0);
    let dst = layout(0x10_0000, 64, 4, Some(MemoryOrder::Hnd), 0);
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let plan = t
        .plan(&Request::tokens(
            &(0..8i64).collect::<Vec<_>>(),
            &[1i64, 2],
            100,
        ))
        .unwrap();
    assert_eq!(plan.lengths.len(), 4 * 2 * 7);
    check(
        (16, 64),
        (Some(MemoryOrder::Hnd), Some(MemoryOrder::Hnd)),
        (0, 0),
        &(0..8).collect::<Vec<_>>(),
        &[1, 2],
        Some(100),
    );
}

#[test]
fn errors_carry_values() {
    let src = layout(0x1000, 16, 16, None, 0);
    let dst = layout(0x10_0000, 64, 4, None, 0);
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let err = t
        .plan(&Request::tokens(&[0i64, 1], &[0i64], 40))
        .unwrap_err();
    assert_eq!(
        err,
        PlanError::TokenCount {
            side: Side::Src,
            list: "pages",
            n_tokens: 40,
            page_size: 16,
            needed: 3,
            given: 2
        }
    );
    let err = t.plan(&Request::pages(&[0i64, 1], &[4i64])).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::IndexOutOfRange {
                side: Side::Dst,
                index: 4,
                ..
            }
        ),
        "{err}"
    );
    let err = t.plan(&Request::pages(&[0i64, -1], &[0i64])).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::NegativeIndex {
                side: Side::Src,
                index: -1,
                position: 1
            }
        ),
        "{err}"
    );
    // Items of different bytes per token.
    let mut bad = layout(0x10_0000, 32, 4, None, 0);
    bad = Layout::new(
        bad.parts().clone(),
        LayoutContext {
            page_size: 64,
            ..LayoutContext::default()
        },
    )
    .unwrap();
    let err = Template::new(&src, &bad, TemplateOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::TokenBytes {
                src_page_size: 16,
                dst_page_size: 64,
                ..
            }
        ),
        "{err}"
    );
    let odd = Layout::new(
        src.parts().clone(),
        LayoutContext {
            page_size: 3,
            ..LayoutContext::default()
        },
    )
    .unwrap();
    let err = Template::new(&odd, &dst, TemplateOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::TokenSize {
                side: Side::Src,
                page_size: 3,
                ..
            }
        ),
        "{err}"
    );
}

fn order() -> impl Strategy<Value = Option<MemoryOrder>> {
    prop_oneof![
        Just(None),
        Just(Some(MemoryOrder::Nhd)),
        Just(Some(MemoryOrder::Hnd))
    ]
}

proptest! {
    #![proptest_config(support::property_config(1000))]
    /// Delta requests: tokens `skip..n` only, `skip` anywhere (inside a page too), against the
    /// same reference; with the reference's first `skip` tokens the decode then holds the whole
    /// request, by the reference's construction.
    #[test]
    fn delta_plans_match_the_reference_from_their_first_token(
        ps in prop::sample::select(vec![1u64, 2, 4, 16, 64]),
        pd in prop::sample::select(vec![1u64, 2, 4, 16, 64]),
        orders in (order(), order()),
        pads in (prop::sample::select(vec![0u64, 8]), prop::sample::select(vec![0u64, 8])),
        src_gaps in prop::collection::vec(any::<bool>(), 16),
        dst_gaps in prop::collection::vec(any::<bool>(), 16),
        per_mille in 0u64..=1000,
        skip_per_mille in 0u64..=1000,
    ) {
        let n = (16 * ps).min(16 * pd).min(200) * per_mille / 1000;
        let skip = n * skip_per_mille / 1000;
        let src_pages = pages(n.div_ceil(ps) as usize, &src_gaps);
        let dst_pages = pages(n.div_ceil(pd) as usize, &dst_gaps);
        let src = layout(0x1000, ps, 16, orders.0, pads.0);
        let dst = layout(0x10_0000, pd, 16, orders.1, pads.1);
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let request = Request::new(&src_pages[..], &dst_pages[..], Some(n)).skipping(skip);
        let plan = check_plan(&template, &src, &dst, &request, None);
        prop_assert_eq!(plan.total_bytes, (n - skip) * TOKEN * 4);
    }
}

/// `layout` with layer 1 a sliding-window layer of `window` tokens.
fn windowed(layout: Layout, window: u64) -> Layout {
    let windows = layout
        .parts()
        .layer_ids
        .iter()
        .map(|&id| (id == Some(1)).then_some(window))
        .collect();
    layout.with_windows(windows).unwrap()
}

proptest! {
    #![proptest_config(support::property_config(1000))]
    /// Sliding-window layers: layer 1 moves only the request's last `window` tokens (from the
    /// delta's first token on), layer 0 every token from it; against the same reference.
    #[test]
    fn window_plans_match_the_reference(
        ps in prop::sample::select(vec![1u64, 2, 4, 16, 64]),
        pd in prop::sample::select(vec![1u64, 2, 4, 16, 64]),
        orders in (order(), order()),
        pads in (prop::sample::select(vec![0u64, 8]), prop::sample::select(vec![0u64, 8])),
        src_gaps in prop::collection::vec(any::<bool>(), 16),
        dst_gaps in prop::collection::vec(any::<bool>(), 16),
        per_mille in 0u64..=1000,
        skip_per_mille in 0u64..=1000,
        window in 1u64..=300,
    ) {
        let n = (16 * ps).min(16 * pd).min(200) * per_mille / 1000;
        let skip = n * skip_per_mille / 1000;
        // At most the 16 pages each buffer holds (a wider window is a layout error), still
        // often wider than the request.
        let window = window.min(16 * ps.min(pd));
        let src_pages = pages(n.div_ceil(ps) as usize, &src_gaps);
        let dst_pages = pages(n.div_ceil(pd) as usize, &dst_gaps);
        let src = windowed(layout(0x1000, ps, 16, orders.0, pads.0), window);
        let dst = windowed(layout(0x10_0000, pd, 16, orders.1, pads.1), window);
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let request = Request::new(&src_pages[..], &dst_pages[..], Some(n)).skipping(skip);
        let plan = check_plan(&template, &src, &dst, &request, None);
        let live = n - skip.max(n.saturating_sub(window));
        prop_assert_eq!(plan.total_bytes, ((n - skip) + live) * TOKEN * 2);
        // Counted without the pages, the same blocks.
        let counted = template
            .count_blocks(BlockRequest::Tokens { n_tokens: n, fragmented: false })
            .unwrap();
        let (model_src, model_dst): (Vec<i64>, Vec<i64>) = (
            (0..src_pages.len() as i64).collect(),
            (0..dst_pages.len() as i64).collect(),
        );
        let contiguous = Request::new(&model_src[..], &model_dst[..], Some(n));
        prop_assert_eq!(counted, template.plan(&contiguous).unwrap().lengths.len());
    }
}

proptest! {
    #![proptest_config(support::property_config(300))]
    #[test]
    fn token_plans_match_a_per_token_reference(
        ps in prop::sample::select(vec![1u64, 2, 4, 16, 32, 64]),
        pd in prop::sample::select(vec![1u64, 2, 4, 16, 32, 64]),
        orders in (order(), order()),
        pads in (prop::sample::select(vec![0u64, 0, 8]), prop::sample::select(vec![0u64, 0, 8])),
        src_gaps in prop::collection::vec(any::<bool>(), 16),
        dst_gaps in prop::collection::vec(any::<bool>(), 16),
        per_mille in 0u64..=1000,
        given in any::<bool>(),
    ) {
        let max_tokens = (16 * ps).min(16 * pd).min(300);
        let n = max_tokens * per_mille / 1000;
        let src_pages = pages(n.div_ceil(ps) as usize, &src_gaps);
        let dst_pages = pages(n.div_ceil(pd) as usize, &dst_gaps);
        check((ps, pd), orders, pads, &src_pages, &dst_pages, given.then_some(n));
    }
}
