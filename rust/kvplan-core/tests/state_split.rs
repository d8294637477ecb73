//! A TP-split state entry through the one request path: a slot request of a template between
//! prefill and decode layouts of different TP sizes moves the byte slices of the decode rank's
//! slot that the prefill rank holds (module `rules::state_split`); the batch planner plans the
//! same blocks, and the planners that give a state pair one block per slot refuse it.

use kvplan_core::{
    BatchPlanner, DescriptorTables, Feature, LayerGroups, LayerSlices, Layout, LayoutContext,
    PlanError, Planner, Request, StateChannels, Template, TemplateOptions,
};

const BASE: u64 = 1 << 30;

/// A GDN-like layer: a conv state of q|k|v sub-blocks (8, 8, 16 channels of 2 bytes) in 3 rows
/// and a temporal state of 8 heads of 64 bytes, 4 slots each, at TP `tp`, rank `rank`.
fn gdn(tp: u32, rank: u32) -> Layout {
    let context = LayoutContext {
        tp_size: tp,
        tp_rank: rank,
        ..LayoutContext::default()
    };
    let t = u64::from(tp);
    let (conv, temporal) = (3 * 32 / t * 2, 8 / t * 64);
    Layout::mla(vec![], vec![], vec![], None, context)
        .unwrap()
        .with_state(
            "mamba",
            vec![BASE, 2 * BASE],
            vec![4 * conv, 4 * temporal],
            vec![conv, temporal],
            vec![0, 0],
        )
        .unwrap()
        .with_state_channels(vec![
            Some(StateChannels::new(32 / t, 3, &[8, 8, 16]).unwrap()),
            Some(StateChannels::new(8 / t, 1, &[]).unwrap()),
        ])
        .unwrap()
}

fn template(src: &Layout, dst: &Layout) -> Template {
    Template::new(src, dst, TemplateOptions::default()).unwrap()
}

#[test]
fn a_slot_request_moves_the_decode_ranks_slices() {
    // Prefill TP 1 to decode rank 1 of TP 2, slot 2 to slot 1.
    let t = template(&gdn(1, 0), &gdn(2, 1));
    let plan = t.plan(&Request::slot(2, 1)).unwrap();
    let (src_item, dst_item) = (192, 96);
    let mut want = Vec::new();
    for row in 0..3u64 {
        // Each sub-block's second half: channels 4..8, 4..8 and 8..16 of 8, 8 and 16.
        for (src_off, dst_off, len) in [(8, 0, 8), (24, 8, 8), (48, 16, 16)] {
            want.push((
                BASE + 2 * src_item + row * 64 + src_off,
                BASE + dst_item + row * 32 + dst_off,
                len,
            ));
        }
    }
    // The temporal state: heads 4..8 of 8, one block.
    want.push((2 * BASE + 2 * 512 + 256, 2 * BASE + 256, 256));
    let got: Vec<_> = (0..plan.src_addrs.len())
        .map(|k| (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]))
        .collect();
    assert_eq!(got, want);
    assert_eq!(plan.total_bytes, 3 * 32 + 256);
    let offsets = t.pair_offsets(&t.prepare(&Request::slot(2, 1)).unwrap());
    assert_eq!(offsets, vec![0, 9, 10]);

    // A batch of two slot requests is the two plans one after the other.
    let batch = BatchPlanner::new(&t)
        .plan(&[Request::slot(2, 1), Request::slot(0, 3)])
        .unwrap();
    let second = t.plan(&Request::slot(0, 3)).unwrap();
    assert_eq!(
        batch.src_addrs,
        [plan.src_addrs.clone(), second.src_addrs].concat()
    );
    assert_eq!(
        batch.lengths,
        [plan.lengths.clone(), second.lengths].concat()
    );
}

#[test]
fn planners_that_give_a_state_pair_one_block_refuse_sliced_slots() {
    let t = template(&gdn(1, 0), &gdn(2, 1));
    // declared: the `sliced_state` feature, which descriptor tables do not support
    assert!(!Planner::Descriptors.supports(Feature::SlicedState));
    assert!(Planner::Plan.supports(Feature::SlicedState));
    assert!(Planner::Batch.supports(Feature::SlicedState));
    let err = DescriptorTables::new(&t).shape().unwrap_err();
    assert!(
        matches!(&err, PlanError::Unsupported { planner: "descriptor_table",
                 feature: "sliced_state", why } if why.contains("moves 1 state pairs")),
        "{err}"
    );
    // a staged plan of the slot is refused by the slot itself; a page request on the same
    // template moves no state pair, so it does not ask for the feature
    let page = Request::pages(&[] as &[i64], &[] as &[i64]);
    assert!(!t.asked_by(&page).has(Feature::SlicedState));
    assert!(t.asked_by(&Request::slot(0, 0)).has(Feature::SlicedState));
    let err = LayerSlices::new(&t, &LayerGroups::every_layer()).unwrap_err();
    assert!(matches!(err, PlanError::Geometry { .. }), "{err}");
    // Equal TP sizes move each slot whole, as one block: nothing to refuse.
    let whole = template(&gdn(2, 1), &gdn(2, 1));
    assert!(DescriptorTables::new(&whole).shape().is_ok());
    assert_eq!(
        whole.plan(&Request::slot(0, 0)).unwrap().lengths,
        vec![96, 256]
    );
}

#[test]
fn a_layout_with_a_split_round_trips_through_the_wire() {
    let layout = gdn(4, 3);
    let bytes = kvplan_core::exchange::wire::encode(&layout).unwrap();
    let back = kvplan_core::exchange::wire::decode(&bytes).unwrap();
    assert_eq!(back.state_channels(), layout.state_channels());
    assert_eq!(back, layout);
}

#[test]
fn a_split_layout_rebuilt_from_its_entries_keeps_its_splits() {
    // Conversion templates plan on a layout rebuilt from entries (the widened side): the split
    // must survive, or the pair is refused as "one side splits" or, with the other side
    // unsplit, planned by the leading-axis rule.
    let layout = gdn(2, 1);
    let rebuilt =
        Layout::from_entries(layout.entries().to_vec(), layout.context().clone(), None).unwrap();
    assert_eq!(rebuilt.state_channels(), layout.state_channels());
    assert_eq!(rebuilt, layout);
    let plan = template(&gdn(1, 0), &rebuilt)
        .plan(&Request::slot(2, 1))
        .unwrap();
    let want = template(&gdn(1, 0), &gdn(2, 1))
        .plan(&Request::slot(2, 1))
        .unwrap();
    assert_eq!(plan.lengths, want.lengths);
    assert_eq!(plan.src_addrs, want.src_addrs);
}
