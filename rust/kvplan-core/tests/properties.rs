//! Properties of run grouping, pairing and emission on random layouts and requests.

mod support;

use kvplan_core::Request;
use kvplan_core::{FlatBuffer, Layout, PlanError, Template, TemplateOptions, group_contiguous};
use proptest::prelude::*;
use support::blocks::{byte_map, triples};
use support::layouts::KvLayout;

/// A random MLA-or-MHA layout pair: src holds a subset of dst's layers (a PP stage).
#[derive(Debug, Clone)]
struct Case {
    src: Layout,
    dst: Layout,
    src_pages: Vec<i64>,
    dst_pages: Vec<i64>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..6,
        0usize..4,
        prop::bool::ANY,
        1u64..5,
        1u64..4,
        1u64..40,
        1u64..40,
        0usize..60,
    )
        .prop_flat_map(
            |(stage_layers, extra_layers, mha, k_item, v_item, src_cap, dst_cap, n_pages)| {
                let pages = (
                    prop::collection::vec(0..src_cap as i64, n_pages),
                    prop::collection::vec(0..dst_cap as i64, n_pages),
                    prop::bool::ANY,
                );
                pages.prop_map(move |(mut src_pages, mut dst_pages, contiguous)| {
                    if contiguous {
                        // Mostly-contiguous requests exercise long runs, not only single pages;
                        // odd page counts hand them over descending (offload order).
                        let n = src_pages.len() as i64;
                        src_pages = (0..n).map(|i| i % src_cap as i64).collect();
                        dst_pages = (0..n).map(|i| (i + 1) % dst_cap as i64).collect();
                        if n % 2 == 1 {
                            src_pages.reverse();
                            dst_pages.reverse();
                        }
                    }
                    let total = stage_layers + extra_layers;
                    let stage_ids: Vec<i64> =
                        (extra_layers..total).map(|l| l as i64 * 4 + 3).collect();
                    let all_ids: Vec<i64> = (0..total).map(|l| l as i64 * 4 + 3).collect();
                    let (item_k, item_v) = (k_item * 8, v_item * 8);
                    let build = |ids: &[i64], base: u64, cap: u64| {
                        if mha {
                            KvLayout::mha(base, ids.to_vec(), item_k, cap * item_k)
                                .v_at(base + 0x100_0000)
                                .v_items(item_v, cap * item_v)
                        } else {
                            KvLayout::mla(base, ids.to_vec(), item_k, cap * item_k)
                        }
                        .spaced(0x10_0000)
                        .build()
                    };
                    Case {
                        src: build(&stage_ids, 0x1000_0000, src_cap),
                        dst: build(&all_ids, 0x9000_0000, dst_cap),
                        src_pages,
                        dst_pages,
                    }
                })
            },
        )
}

/// The obvious planner: one block per (pair, page), in request order.
fn page_by_page(t: &Template, src: &[i64], dst: &[i64]) -> Vec<[u64; 3]> {
    let mut blocks: Vec<[u64; 3]> = Vec::new();
    for pair in t.emitting_pairs() {
        for (&s, &d) in src.iter().zip(dst) {
            blocks.push([
                pair.src_base + s as u64 * pair.item_len,
                pair.dst_base + d as u64 * pair.item_len,
                pair.item_len,
            ]);
        }
    }
    blocks
}

/// Runs taken greedily, each ascending on both sides or descending on both sides, written out
/// step by step: a plan's unit of merging.
fn either_direction_runs(src: &[i64], dst: &[i64]) -> usize {
    let mut runs = 0;
    let mut direction: Option<i64> = None; // the step of the current run once it has two pages
    for i in 0..src.len() {
        let step = (i > 0).then(|| (src[i] - src[i - 1], dst[i] - dst[i - 1]));
        match (step, direction) {
            (Some((a, b)), None) if a == b && a.abs() == 1 => direction = Some(a),
            (Some((a, b)), Some(d)) if a == b && a == d => {}
            _ => {
                runs += 1;
                direction = None;
            }
        }
    }
    runs
}

proptest! {
    #![proptest_config(support::property_config(512))]

    /// Runs tile the input exactly: concatenating them gives back both index arrays.
    #[test]
    fn runs_tile_input(pairs in prop::collection::vec((0i64..20, 0i64..20), 0..80)) {
        let (src, dst): (Vec<i64>, Vec<i64>) = pairs.into_iter().unzip();
        let (s, d, l) = group_contiguous(&src, &dst).unwrap();
        let expand = |starts: &[u64]| starts.iter().zip(&l).flat_map(|(&a, &n)| (0..n).map(move |k| (a + k) as i64)).collect::<Vec<_>>();
        prop_assert_eq!(expand(&s), src.clone());
        prop_assert_eq!(expand(&d), dst);
        prop_assert!(l.iter().all(|&n| n >= 1));
        // Maximal: consecutive runs never continue each other on both sides.
        for r in 1..s.len() {
            prop_assert!(!(s[r] == s[r - 1] + l[r - 1] && d[r] == d[r - 1] + l[r - 1]));
        }
    }

    /// Blocks equal page-by-page planning with adjacent blocks merged; every block lies inside
    /// its entry's buffer; bytes are conserved.
    #[test]
    fn plan_matches_page_by_page_and_stays_in_bounds(c in case()) {
        let t = Template::new(&c.src, &c.dst, TemplateOptions::default()).unwrap();
        let plan = t.plan(&Request::pages(&c.src_pages, &c.dst_pages)).unwrap();
        let got = triples(&plan);
        // One block per pair per run (ascending or descending on both sides), never more
        // than SGLang's ascending runs give, and the same copies as page-by-page planning.
        let runs = either_direction_runs(&c.src_pages, &c.dst_pages);
        prop_assert_eq!(got.len(), runs * t.emitting_pairs().len());
        prop_assert_eq!(plan.n_runs, runs);
        prop_assert!(runs <= group_contiguous(&c.src_pages, &c.dst_pages).unwrap().0.len());
        prop_assert_eq!(byte_map(&got), byte_map(&page_by_page(&t, &c.src_pages, &c.dst_pages)));
        let pages = c.src_pages.len() as u64;
        prop_assert_eq!(plan.lengths.iter().sum::<u64>(), pages * t.bytes_per_page());
        prop_assert_eq!(plan.total_bytes, pages * t.bytes_per_page());
        let runs = plan.n_runs.max(1);
        for (k, block) in got.iter().enumerate() {
            let pair = t.emitting_pairs()[k / runs];
            let (src_ptr, src_len) = (c.src.parts().data_ptrs[pair.src_entry], c.src.parts().data_lens[pair.src_entry]);
            let (dst_ptr, dst_len) = (c.dst.parts().data_ptrs[pair.dst_entry], c.dst.parts().data_lens[pair.dst_entry]);
            prop_assert!(block[0] >= src_ptr && block[0] + block[2] <= src_ptr + src_len);
            prop_assert!(block[1] >= dst_ptr && block[1] + block[2] <= dst_ptr + dst_len);
        }
    }

    /// Every pair joins entries of the same layer id and role.
    #[test]
    fn pairs_join_same_layer_and_role(c in case()) {
        let t = Template::new(&c.src, &c.dst, TemplateOptions::default()).unwrap();
        prop_assert_eq!(t.page_pairs().len(), c.src.n_entries());
        for p in t.page_pairs() {
            prop_assert_eq!(c.src.parts().layer_ids[p.src_entry], c.dst.parts().layer_ids[p.dst_entry]);
            prop_assert_eq!(&c.src.parts().roles[p.src_entry], &c.dst.parts().roles[p.dst_entry]);
        }
    }

    /// An index past any buffer's capacity is an error, never a block.
    #[test]
    fn out_of_range_indices_are_errors(c in case(), bump in 0u64..3) {
        prop_assume!(!c.src_pages.is_empty());
        let t = Template::new(&c.src, &c.dst, TemplateOptions::default()).unwrap();
        let mut dst = c.dst_pages.clone();
        let last = dst.len() - 1;
        dst[last] = (c.dst.capacity(0) + bump) as i64;
        let rejected = matches!(t.plan(&Request::pages(&c.src_pages, &dst)), Err(PlanError::IndexOutOfRange { .. }));
        prop_assert!(rejected);
        let mut out = FlatBuffer::zeroed(0);
        let too_small = t.plan_into(&Request::pages(&c.src_pages, &c.dst_pages), |_| Ok(kvplan_core::AsColumns::columns(&mut out)));
        let needed = t.prepare(&Request::pages(&c.src_pages, &c.dst_pages)).unwrap().n_blocks;
        prop_assert_eq!(too_small.is_err(), needed > 0);
    }
}
