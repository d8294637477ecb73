//! Ring-state plans through the public API ([`Template::plan_ring`], the ring lane of a slot
//! request, over a [`Template`] built from two layouts with [`Layout::with_rings`]), between
//! rings of different sizes.
//!
//! The reference is written here from the definition alone: a ring of `R` rows keeps position
//! `p` of the request in slot `s` at row `s × R + p mod R`, so after `n` positions the rows both
//! rings hold are positions `n − min(R_p, R_d, n) .. n`, each copied from its prefill row to its
//! decode row. Every plan is expanded into the rows it copies and compared with that list, row
//! for row; the run cutting itself is unit-tested in `kernels::rings`.

use kvplan_core::{Layout, LayoutContext, PlanError, Side, Template, TemplateOptions};

/// Bytes of one ring row (one item of a ring-state entry).
const ROW: u64 = 24;
/// Bytes of one page of the full-attention layer beside the rings.
const PAGE: u64 = 64;
/// Request slots every ring buffer holds.
const SLOTS: u64 = 4;

/// One peer: a full-attention MLA layer 0 (16 pages at `base`), then ring-state entries for
/// layers 0 and 1 (`rings` rows per slot, `SLOTS` slots), each row `stride` bytes apart.
fn peer(base: u64, rings: u64, stride: u64) -> Layout {
    let kv = Layout::mla(
        vec![base],
        vec![16 * PAGE],
        vec![PAGE],
        Some(vec![0]),
        LayoutContext::default(),
    )
    .unwrap();
    let ring_bytes = SLOTS * rings * stride;
    let ptrs = vec![base + 0x1_0000, base + 0x2_0000];
    kv.with_state(
        "compressor",
        ptrs,
        vec![ring_bytes; 2],
        vec![ROW; 2],
        vec![0, 1],
    )
    .unwrap()
    .with_strides(vec![PAGE, stride, stride])
    .unwrap()
    .with_rings(vec![None, Some(rings), Some(rings)])
    .unwrap()
}

/// `(src_addr, dst_addr)` of every row the definition copies, per ring pair in pair order.
fn reference_rows(
    (src, dst): (&Layout, &Layout),
    (rs, rd): (u64, u64),
    (src_slot, dst_slot): (u64, u64),
    n: u64,
) -> Vec<(u64, u64)> {
    let live = rs.min(rd).min(n);
    let mut rows = Vec::new();
    for entry in 1..3 {
        let (src_base, dst_base) = (src.parts().data_ptrs[entry], dst.parts().data_ptrs[entry]);
        let (src_stride, dst_stride) = (src.strides()[entry], dst.strides()[entry]);
        for p in n - live..n {
            rows.push((
                src_base + (src_slot * rs + p % rs) * src_stride,
                dst_base + (dst_slot * rd + p % rd) * dst_stride,
            ));
        }
    }
    rows
}

/// The rows a plan copies: each block cut into `ROW`-byte rows, consecutive rows of a block
/// being consecutive in memory (a block of several rows is only sound on packed rows).
fn planned_rows(src_addrs: &[u64], dst_addrs: &[u64], lengths: &[u64]) -> Vec<(u64, u64)> {
    let mut rows = Vec::new();
    for ((&s, &d), &len) in src_addrs.iter().zip(dst_addrs).zip(lengths) {
        assert_eq!(len % ROW, 0, "a block of {len} bytes is not whole rows");
        rows.extend((0..len / ROW).map(|i| (s + i * ROW, d + i * ROW)));
    }
    rows
}

#[test]
fn rings_of_different_sizes_move_exactly_the_rows_both_hold() {
    for (rs, rd) in [(3, 5), (5, 3), (4, 4), (1, 6), (7, 2)] {
        for (stride_s, stride_d) in [(ROW, ROW), (ROW + 8, ROW), (ROW, 2 * ROW)] {
            let src = peer(0x1000_0000, rs, stride_s);
            let dst = peer(0x9000_0000, rd, stride_d);
            let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
            assert_eq!(template.ring_lanes().len(), 2);
            for slots in [(0u64, 0u64), (1, 3), (3, 2)] {
                for n in 0..3 * rs.max(rd) + 2 {
                    let plan = template
                        .plan_ring(slots.0 as i64, slots.1 as i64, n)
                        .unwrap();
                    let want = reference_rows((&src, &dst), (rs, rd), slots, n);
                    let got = planned_rows(&plan.src_addrs, &plan.dst_addrs, &plan.lengths);
                    let case = format!(
                        "R {rs}->{rd}, strides {stride_s}/{stride_d}, slots {slots:?}, n {n}"
                    );
                    assert_eq!(got, want, "{case}");
                    assert_eq!(plan.total_bytes, want.len() as u64 * ROW, "{case}");
                    // One block range per ring pair, each pair's rows in its own range.
                    assert_eq!(plan.pair_offsets.len(), 3, "{case}");
                    let first = plan.pair_offsets[0]..plan.pair_offsets[1];
                    let rows_of_first = planned_rows(
                        &plan.src_addrs[first.clone()],
                        &plan.dst_addrs[first.clone()],
                        &plan.lengths[first],
                    );
                    assert_eq!(rows_of_first, want[..want.len() / 2], "{case}");
                    // Padded rows on either side: one block per row; packed rows: at most one
                    // block per stretch between the two rings' wraps.
                    let live = rs.min(rd).min(n) as usize;
                    let per_pair = plan.lengths.len() / 2;
                    if stride_s == ROW && stride_d == ROW {
                        assert!(per_pair <= 3.min(live), "{case}: {per_pair} blocks");
                    } else {
                        assert_eq!(per_pair, live, "{case}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_ring_plan_never_writes_a_decode_row_twice_nor_outside_its_slot() {
    let (rs, rd) = (6, 4);
    let src = peer(0x1000_0000, rs, ROW);
    let dst = peer(0x9000_0000, rd, ROW);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let dst_slot = 2;
    for n in 0..40 {
        let plan = template.plan_ring(1, dst_slot, n).unwrap();
        let rows = planned_rows(&plan.src_addrs, &plan.dst_addrs, &plan.lengths);
        let mut written: Vec<u64> = rows.iter().map(|&(_, d)| d).collect();
        written.sort_unstable();
        written.dedup();
        assert_eq!(
            written.len(),
            rows.len(),
            "n {n}: a decode row written twice"
        );
        for entry in 1..3 {
            let slot_start = dst.parts().data_ptrs[entry] + dst_slot as u64 * rd * ROW;
            let in_entry = rows
                .iter()
                .filter(|&&(_, d)| d >= dst.parts().data_ptrs[entry])
                .filter(|&&(_, d)| d < dst.parts().data_ptrs[entry] + dst.parts().data_lens[entry]);
            for &(_, d) in in_entry {
                assert!(
                    (slot_start..slot_start + rd * ROW).contains(&d),
                    "n {n}: row {d:#x}"
                );
            }
        }
    }
}

#[test]
fn ring_slots_are_checked_against_each_sides_ring_buffer() {
    let src = peer(0x1000_0000, 3, ROW);
    let dst = peer(0x9000_0000, 5, ROW);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    // Slot SLOTS - 1 is the last whole ring on each side; SLOTS is past the buffer.
    template
        .plan_ring(SLOTS as i64 - 1, SLOTS as i64 - 1, 9)
        .unwrap();
    match template.plan_ring(0, SLOTS as i64, 9) {
        Err(PlanError::IndexOutOfRange {
            side: Side::Dst,
            index,
            capacity,
            ..
        }) => assert_eq!((index, capacity), (SLOTS as i64, SLOTS)),
        other => panic!("expected IndexOutOfRange on the decode side, got {other:?}"),
    }
    match template.plan_ring(-1, 0, 9) {
        Err(PlanError::NegativeIndex {
            side: Side::Src,
            index: -1,
            ..
        }) => {}
        other => panic!("expected NegativeIndex on the prefill side, got {other:?}"),
    }
}

#[test]
fn a_template_without_rings_is_refused_a_ring_plan() {
    let plain = |base: u64| {
        Layout::mla(
            vec![base],
            vec![16 * PAGE],
            vec![PAGE],
            Some(vec![0]),
            LayoutContext::default(),
        )
        .unwrap()
    };
    let template = Template::new(
        &plain(0x1000),
        &plain(0x10_0000),
        TemplateOptions::default(),
    )
    .unwrap();
    assert!(template.ring_lanes().is_empty());
    assert!(matches!(
        template.plan_ring(0, 0, 4),
        Err(PlanError::Geometry { .. })
    ));
}

/// A hybrid peer: the MLA layer, a plain state entry (one slot of `2 × ROW` bytes per request)
/// and the two ring-state entries of [`peer`].
fn hybrid_peer(base: u64, rings: u64, stride: u64) -> Layout {
    let kv = Layout::mla(
        vec![base],
        vec![16 * PAGE],
        vec![PAGE],
        Some(vec![0]),
        LayoutContext::default(),
    )
    .unwrap();
    let ring_bytes = SLOTS * rings * stride;
    kv.with_state(
        "mamba",
        vec![base + 0x3_0000],
        vec![SLOTS * 2 * ROW],
        vec![2 * ROW],
        vec![0],
    )
    .unwrap()
    .with_state(
        "compressor",
        vec![base + 0x1_0000, base + 0x2_0000],
        vec![ring_bytes; 2],
        vec![ROW; 2],
        vec![0, 1],
    )
    .unwrap()
    .with_strides(vec![PAGE, 2 * ROW, stride, stride])
    .unwrap()
    .with_rings(vec![None, None, Some(rings), Some(rings)])
    .unwrap()
}

#[test]
fn a_slot_request_with_positions_plans_its_slots_then_its_ring_rows_in_one_plan() {
    use kvplan_core::Request;
    for (rs, rd) in [(3, 5), (4, 4), (7, 2)] {
        for (stride_s, stride_d) in [(ROW, ROW), (ROW + 8, ROW)] {
            let src = hybrid_peer(0x1000_0000, rs, stride_s);
            let dst = hybrid_peer(0x9000_0000, rd, stride_d);
            let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
            assert_eq!(
                (template.state_pairs().len(), template.ring_lanes().len()),
                (1, 2)
            );
            for slots in [(0i64, 0i64), (1, 3), (3, 2)] {
                let state = template.plan(&Request::slot(slots.0, slots.1)).unwrap();
                assert_eq!(state.pair_offsets, vec![0, 1], "a slot without positions");
                for n in 0..2 * rs.max(rd) + 2 {
                    let case =
                        format!("R {rs}->{rd}, strides {stride_s}/{stride_d}, {slots:?}, n {n}");
                    let request = Request {
                        n_tokens: Some(n),
                        ..Request::slot(slots.0, slots.1)
                    };
                    let whole = template.plan(&request).unwrap();
                    let ring = template.plan_ring(slots.0, slots.1, n).unwrap();
                    // The slot's block, then exactly the ring plan's blocks.
                    let cat = |a: &[u64], b: &[u64]| [a, b].concat();
                    assert_eq!(
                        whole.src_addrs,
                        cat(&state.src_addrs, &ring.src_addrs),
                        "{case}"
                    );
                    assert_eq!(
                        whole.dst_addrs,
                        cat(&state.dst_addrs, &ring.dst_addrs),
                        "{case}"
                    );
                    assert_eq!(whole.lengths, cat(&state.lengths, &ring.lengths), "{case}");
                    assert_eq!(
                        whole.total_bytes,
                        state.total_bytes + ring.total_bytes,
                        "{case}"
                    );
                    assert_eq!(whole.n_runs, 1 + ring.n_runs, "{case}");
                    // One block range per pair: the state pair, then each ring pair.
                    let shifted: Vec<usize> = ring.pair_offsets.iter().map(|o| o + 1).collect();
                    assert_eq!(whole.pair_offsets, cat_offsets(&[0], &shifted), "{case}");
                    // The ring part is the definition's rows.
                    let want: Vec<(u64, u64)> = {
                        let live = rs.min(rd).min(n);
                        let (s, d) = (slots.0 as u64, slots.1 as u64);
                        (2..4)
                            .flat_map(|e| {
                                let (sb, db) = (src.parts().data_ptrs[e], dst.parts().data_ptrs[e]);
                                (n - live..n).map(move |p| {
                                    (
                                        sb + (s * rs + p % rs) * stride_s,
                                        db + (d * rd + p % rd) * stride_d,
                                    )
                                })
                            })
                            .collect()
                    };
                    let got = planned_rows(
                        &whole.src_addrs[1..],
                        &whole.dst_addrs[1..],
                        &whole.lengths[1..],
                    );
                    assert_eq!(got, want, "{case}");
                    // Its summary answers the same size before anything is emitted.
                    let summary = template.prepare(&request).unwrap();
                    assert_eq!(
                        (summary.n_blocks, summary.total_bytes, summary.n_runs()),
                        (whole.lengths.len(), whole.total_bytes, whole.n_runs),
                        "{case}"
                    );
                    assert_eq!(template.blocks().pair_offsets(&summary), whole.pair_offsets);
                }
            }
        }
    }
}

fn cat_offsets(a: &[usize], b: &[usize]) -> Vec<usize> {
    [a, b].concat()
}

#[test]
fn a_slot_request_checks_its_slot_against_the_rings_too() {
    use kvplan_core::Request;
    let src = hybrid_peer(0x1000_0000, 3, ROW);
    let dst = hybrid_peer(0x9000_0000, 5, ROW);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let request = |s: i64, d: i64| Request {
        n_tokens: Some(9),
        ..Request::slot(s, d)
    };
    template
        .plan(&request(SLOTS as i64 - 1, SLOTS as i64 - 1))
        .unwrap();
    assert!(matches!(
        template.plan(&request(0, SLOTS as i64)),
        Err(PlanError::IndexOutOfRange {
            side: Side::Dst,
            ..
        })
    ));
    assert!(matches!(
        template.plan(&request(-1, 0)),
        Err(PlanError::NegativeIndex {
            side: Side::Src,
            index: -1,
            ..
        })
    ));
}

#[test]
fn positions_on_a_template_without_rings_are_refused_naming_the_count() {
    use kvplan_core::Request;
    // Rings removed on both sides: the compressor entries are plain state slots now.
    let src = hybrid_peer(0x1000_0000, 3, ROW)
        .with_rings(vec![None; 4])
        .unwrap();
    let template = Template::new(&src, &src, TemplateOptions::default()).unwrap();
    let err = template
        .plan(&Request {
            n_tokens: Some(7),
            ..Request::slot(0, 0)
        })
        .unwrap_err();
    match &err {
        PlanError::Geometry { what } => {
            assert!(
                what.contains("no ring-state pairs") && what.contains("n_tokens 7"),
                "{what}"
            );
        }
        other => panic!("expected a geometry error, got {other:?}"),
    }
}

#[test]
fn direct_and_staged_plans_plan_ring_rows_the_other_planners_refuse_them() {
    use kvplan_core::{
        BatchPlanner, DescriptorTables, PackBuffer, PackPlanner, Request, StagedPlanner,
    };
    let src = hybrid_peer(0x1000_0000, 3, ROW);
    let dst = hybrid_peer(0x9000_0000, 5, ROW);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let request = Request {
        n_tokens: Some(9),
        ..Request::slot(1, 2)
    };
    let feature = |err: PlanError| match err {
        PlanError::Unsupported {
            planner, feature, ..
        } => (planner, feature),
        PlanError::InRequest { source, .. } => match *source {
            PlanError::Unsupported {
                planner, feature, ..
            } => (planner, feature),
            other => panic!("expected Unsupported, got {other:?}"),
        },
        other => panic!("expected Unsupported, got {other:?}"),
    };
    template.plan(&request).unwrap();
    let batch = BatchPlanner::new(&template).plan(&[request]);
    assert_eq!(feature(batch.unwrap_err()), ("plan_batch", "ring"));
    let pack = PackBuffer {
        addr: 0x5000_0000,
        size: 1 << 20,
    };
    let packed = PackPlanner::new(&template).plan(&request, pack);
    assert_eq!(feature(packed.unwrap_err()), ("plan_packed", "ring"));
    let rows = PackPlanner::new(&template).row_gather(&request, pack);
    assert_eq!(
        feature(rows.unwrap_err()),
        ("plan_row_gather", "state_slot")
    );
    // A staged plan takes the ring rows as more blocks of the direct plan.
    let staged = StagedPlanner::new(&template).counts(&request).unwrap();
    assert_eq!(staged.bytes, template.plan(&request).unwrap().total_bytes);
    let prepped = DescriptorTables::new(&template).indices(&request);
    assert_eq!(feature(prepped.unwrap_err()), ("descriptor_table", "ring"));
}

/// The template holds its ring-state pairs as lanes whose walk is a ring, and that walk's live
/// positions are the rule's: the last `min(R_p, R_d, n)`, the same as a window of
/// `min(R_p, R_d)` tokens.
#[test]
fn ring_lanes_are_ring_walks_with_the_live_position_rule() {
    use kvplan_core::{Lane, PoolId, TokenMap, Walk};
    let src = peer(0x1000_0000, 3, ROW);
    let dst = peer(0x9000_0000, 5, ROW);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let lanes = template.ring_lanes();
    assert_eq!(lanes.len(), 2);
    for (lane, entry) in lanes.iter().zip([1, 2]) {
        let ring = Walk::Ring {
            src_rows: 3,
            dst_rows: 5,
        };
        assert_eq!(lane.walk(), ring);
        assert_eq!(lane.rows(), (3, 5));
        assert_eq!(ring.ring_rows(), Some((3, 5)));
        assert_eq!(Walk::Window(3).ring_rows(), None);
        assert_eq!(
            (lane.pair().src_entry, lane.pair().dst_entry),
            (entry, entry)
        );
        // Through a lane's `slots` (one slot per position): the walk starts at n − min(3, 5, n).
        let as_lane = Lane {
            walk: ring,
            maps: (
                TokenMap::Paged { page_size: 3 },
                TokenMap::Paged { page_size: 5 },
            ),
            pools: (PoolId::PAGES, PoolId::PAGES),
            tokens_per_row: 1,
        };
        for n in 0..12 {
            assert_eq!(as_lane.slots(0, n), (n - 3.min(n), n), "n {n}");
        }
    }
}

/// A few fixed cases, block for block: `(src_row, dst_row, rows)` per block, the same for both
/// ring entries, through the slot request's `prepare` and `plan` and through `plan_ring`.
#[test]
fn ring_rows_of_fixed_cases_are_byte_exact() {
    use kvplan_core::Request;
    type Case = (
        (u64, u64),
        (u64, u64),
        (u64, u64),
        u64,
        &'static [(u64, u64, u64)],
    );
    let cases: [Case; 5] = [
        // R_p 3 < R_d 5 after 7 positions: positions 4, 5, 6, cut where the decode ring wraps
        // (5) and where the prefill ring does (6).
        (
            (3, 5),
            (ROW, ROW),
            (1, 2),
            7,
            &[(4, 14, 1), (5, 10, 1), (3, 11, 1)],
        ),
        // R_p 5 > R_d 3, n 2 below both rings: positions 0, 1, one block.
        ((5, 3), (ROW, ROW), (0, 1), 2, &[(0, 3, 2)]),
        // Equal rings after 10 positions: positions 6..10 wrap once, at 8.
        ((4, 4), (ROW, ROW), (3, 0), 10, &[(14, 2, 2), (12, 0, 2)]),
        // Padded prefill rows: one block per live position.
        (
            (3, 5),
            (ROW + 8, ROW),
            (0, 0),
            7,
            &[(1, 4, 1), (2, 0, 1), (0, 1, 1)],
        ),
        // No positions processed: nothing moves.
        ((3, 5), (ROW, ROW), (2, 2), 0, &[]),
    ];
    for ((rs, rd), (stride_s, stride_d), slots, n, blocks) in cases {
        let case = format!("R {rs}->{rd}, strides {stride_s}/{stride_d}, {slots:?}, n {n}");
        let src = peer(0x1000_0000, rs, stride_s);
        let dst = peer(0x9000_0000, rd, stride_d);
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let (mut want_src, mut want_dst, mut want_len) = (Vec::new(), Vec::new(), Vec::new());
        let mut want_offsets = vec![0];
        for entry in 1..3 {
            let (sb, db) = (src.parts().data_ptrs[entry], dst.parts().data_ptrs[entry]);
            for &(s, d, rows) in blocks {
                want_src.push(sb + s * stride_s);
                want_dst.push(db + d * stride_d);
                want_len.push(rows * ROW);
            }
            want_offsets.push(want_offsets.last().unwrap() + blocks.len());
        }
        let request = Request {
            n_tokens: Some(n),
            ..Request::slot(slots.0 as i64, slots.1 as i64)
        };
        let summary = template.prepare(&request).unwrap();
        assert_eq!(summary.n_blocks, want_len.len(), "{case}");
        assert_eq!(summary.total_bytes, want_len.iter().sum::<u64>(), "{case}");
        let whole = template.plan(&request).unwrap();
        let ring = template
            .plan_ring(slots.0 as i64, slots.1 as i64, n)
            .unwrap();
        for plan in [&whole, &ring] {
            assert_eq!(plan.src_addrs, want_src, "{case}");
            assert_eq!(plan.dst_addrs, want_dst, "{case}");
            assert_eq!(plan.lengths, want_len, "{case}");
            assert_eq!(plan.pair_offsets, want_offsets, "{case}");
            assert_eq!(plan.total_bytes, summary.total_bytes, "{case}");
        }
    }
}
