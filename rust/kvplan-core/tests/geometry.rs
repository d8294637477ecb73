//! Strided entries, fragments and coalescing: a plan's bytes equal a page-by-page,
//! fragment-by-fragment reference, coalesced or not, and every block lies inside its buffers.

mod support;

use kvplan_core::Request;
use kvplan_core::{
    Fragment, Fragments, GeometryOptions, Layout, LayoutContext, LayoutParts, Template,
    TemplateOptions,
};
use proptest::prelude::*;
use support::blocks::{byte_map, triples};
use support::layouts::bare_entries;

const SRC: u64 = 0x1000;
const DST: u64 = 0x10_0000;

/// One side: per entry (offset, stride), packed buffers or one pool, with `cap` pages.
fn side(items: Vec<u64>, pool: bool, pad: u64, cap: u64) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let (mut ptrs, mut lens, mut strides) = (vec![], vec![], vec![]);
    if pool {
        let stride = items.iter().sum::<u64>() + pad;
        let stride = stride.max(1);
        let mut off = 0;
        for &item in &items {
            ptrs.push(off);
            lens.push(cap * stride - off);
            strides.push(stride);
            off += item;
        }
    } else {
        let mut at = 0;
        for &item in &items {
            let stride = item + pad;
            let len = (cap * stride).saturating_sub(pad);
            ptrs.push(at);
            lens.push(len);
            strides.push(stride);
            at += len + 8;
        }
    }
    (ptrs, lens, strides)
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..support::property_config(256) })]

    #[test]
    fn plans_match_the_reference(
        items in prop::collection::vec(prop::sample::select(vec![0u64, 8, 16, 24]), 1..5),
        src_pool in any::<bool>(), dst_pool in any::<bool>(),
        src_pad in prop::sample::select(vec![0u64, 8]), dst_pad in prop::sample::select(vec![0u64, 8]),
        frag in prop::option::of((0u64..8, 0u64..8, 1u64..8)),
        pages in prop::collection::vec((0i64..4, 0i64..4), 0..6),
    ) {
        let cap = 4;
        let (ptrs, lens, strides) = side(items.clone(), src_pool, src_pad, cap);
        let src = bare_entries(SRC, &items, &ptrs, lens, strides);
        let (ptrs, lens, strides) = side(items.clone(), dst_pool, dst_pad, cap);
        let dst = bare_entries(DST, &items, &ptrs, lens, strides);
        // Unique destinations (check_dst_overlap).
        let mut seen = std::collections::HashSet::new();
        let pages: Vec<(i64, i64)> = pages.into_iter().filter(|p| seen.insert(p.1)).collect();
        let (sp, dp): (Vec<i64>, Vec<i64>) = pages.iter().copied().unzip();
        let min_item = items.iter().copied().filter(|&l| l > 0).min().unwrap_or(0);
        let fragments = match frag {
            Some((s, d, l)) if s + l <= min_item && d + l <= min_item => {
                Fragments::Every(vec![Fragment { src_off: s, dst_off: d, len: l }])
            }
            _ => Fragments::Whole,
        };
        let options = TemplateOptions { check_dst_overlap: true, ..TemplateOptions::default() };
        let mut results = vec![];
        for coalesce in [true, false] {
            let geometry = GeometryOptions { fragments: fragments.clone(), coalesce };
            let t = Template::with_geometry(&src, &dst, options, &geometry).unwrap();
            let plan = t.plan(&Request::pages(&sp, &dp)).unwrap();
            // Every block inside the buffers of its group (for one-pair groups: its pair's).
            for k in 0..plan.lengths.len() {
                let (a, b, l) = (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]);
                prop_assert!(l > 0);
                let inside = |layout: &Layout, at: u64| (0..layout.n_entries()).any(|e| {
                    let (p, n) = (layout.parts().data_ptrs[e], layout.parts().data_lens[e]);
                    p <= at && at < p + n
                });
                prop_assert!(inside(&src, a) && inside(&src, a + l - 1));
                prop_assert!(inside(&dst, b) && inside(&dst, b + l - 1));
            }
            let got = byte_map(&triples(&plan));
            // No destination byte written twice.
            prop_assert!(got.windows(2).all(|w| w[0].0 != w[1].0));
            prop_assert_eq!(got.len() as u64, plan.total_bytes);
            results.push(got);
        }
        prop_assert_eq!(&results[0], &results[1]);
        // The reference: every page, every emitting pair, every fragment.
        let mut expected = vec![];
        for (e, &item) in items.iter().enumerate() {
            if item == 0 {
                continue;
            }
            let frags = match &fragments {
                Fragments::Every(f) => f.clone(),
                _ => vec![Fragment { src_off: 0, dst_off: 0, len: item }],
            };
            for &(s, d) in &pages {
                for f in &frags {
                    let a = src.parts().data_ptrs[e] + s as u64 * src.strides()[e] + f.src_off;
                    let b = dst.parts().data_ptrs[e] + d as u64 * dst.strides()[e] + f.dst_off;
                    expected.extend((0..f.len).map(|x| (b + x, a + x)));
                }
            }
        }
        expected.sort_unstable();
        prop_assert_eq!(&results[0], &expected);
    }
}

#[test]
fn a_pool_to_a_pool_is_one_block_per_run() {
    let items = vec![16, 32, 16, 32];
    let ctx = LayoutContext::default;
    let src = Layout::cross_layer(0x1000, 96 * 10, None, items.clone(), None, ctx()).unwrap();
    let dst = Layout::cross_layer(0x9000, 96 * 10, None, items, None, ctx()).unwrap();
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    assert_eq!(t.blocks().groups().len(), 1);
    let plan = t
        .plan(&Request::pages(&[1i32, 2, 3, 7], &[0i32, 1, 2, 9]))
        .unwrap();
    assert_eq!(plan.src_addrs, vec![0x1000 + 96, 0x1000 + 7 * 96]);
    assert_eq!(plan.dst_addrs, vec![0x9000, 0x9000 + 9 * 96]);
    assert_eq!(plan.lengths, vec![3 * 96, 96]);
    let err = Layout::new(
        LayoutParts {
            data_ptrs: vec![0],
            data_lens: vec![64],
            item_lens: vec![16],
            ..Default::default()
        },
        ctx(),
    )
    .unwrap()
    .with_strides(vec![8])
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "entry 0 (None): stride 8 is smaller than its item_len 16; consecutive items would overlap"
    );
}
