//! Prepped descriptor tables: every descriptor lies inside its side's buffers, a request's
//! descriptor pairs move exactly the bytes of the plan of the same request (and, where every
//! piece is per page, are its blocks one for one), requests are validated as plans are, and
//! what a table cannot express (token plans) or hold (sizes) is an error.

mod support;

use kvplan_core::{DescriptorTables, Request};
use kvplan_core::{
    ErrorClass, GeometryOptions, Layout, LayoutContext, MemoryOrder, PlanError, Side, Template,
    TemplateOptions,
};
use support::blocks::{buffers, byte_map, state_plan, triples};
use support::layouts::{
    ContextBuilder, HEAD_BYTES, KvLayout, bare_entries, heads_per_rank, layer_pool, paged, tp_heads,
};

const SRC: u64 = 0x10_0000;
const DST: u64 = 0x80_0000;
const PAGES: u64 = 8;
const SRC_PAGES: [i64; 5] = [0, 1, 2, 6, 3];
const DST_PAGES: [i64; 5] = [7, 2, 3, 4, 0];

/// Per-layer buffers, `pad` bytes between items (a stride larger than the item), 64 bytes
/// between buffers.
fn per_layer(base: u64, items: &[u64], pad: u64) -> Layout {
    let (mut offsets, mut lens, mut strides, mut at) = (vec![], vec![], vec![], 0);
    for &item in items {
        let stride = item + pad;
        offsets.push(at);
        lens.push(PAGES * stride - pad);
        strides.push(stride);
        at += PAGES * stride + 64;
    }
    bare_entries(base, items, &offsets, lens, strides)
}

/// One cross-layer pool: every layer's item of a page side by side.
fn pool(base: u64, items: &[u64]) -> Layout {
    let ids = (0..items.len() as i64).collect();
    layer_pool(base, PAGES, ids, items.to_vec(), LayoutContext::default())
}

const TOKENS: u64 = 4;
const LAYERS: usize = 2;

/// An MHA rank (K block then V block, per-layer buffers 128 bytes apart) holding `H / tp` heads
/// (at least 1), with a replicated state entry per layer whose slots are strided.
fn mha_rank(
    base: u64,
    heads: u32,
    tp: u32,
    rank: u32,
    order: MemoryOrder,
    page_size: u64,
) -> Layout {
    let item = page_size * u64::from(heads_per_rank(heads, tp)) * HEAD_BYTES;
    let entry = PAGES * item;
    let pages = KvLayout::mha(base, 0..LAYERS as i64, item, entry)
        .spaced(entry + 128)
        .context(
            paged(page_size)
                .tp(rank, tp)
                .attention(tp_heads(heads, tp, order)),
        );
    let state_at = pages.end();
    let state_ptrs = (0..LAYERS as u64).map(|l| state_at + l * 4096).collect();
    pages
        .build()
        .with_state(
            "conv",
            state_ptrs,
            vec![3 * 24 + 16; LAYERS],
            vec![16; LAYERS],
            (0..LAYERS as i64).collect(),
        )
        .unwrap()
        .with_strides(
            // pages keep their item stride; the state slots sit 24 bytes apart
            (0..3 * LAYERS)
                .map(|e| if e < 2 * LAYERS { item } else { 24 })
                .collect(),
        )
        .unwrap()
}

/// Buffers `[ptr, ptr + len)` of a layout, merged where they touch or overlap: a coalesced
/// descriptor of a pool may span the touching buffers of its entries.
fn merged_buffers(layout: &Layout) -> Vec<(u64, u64)> {
    let mut spans = buffers(layout);
    spans.sort_unstable();
    let mut merged: Vec<(u64, u64)> = vec![];
    for (s, e) in spans {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

/// Every descriptor of `side`'s table lies inside the side's buffers (a coalesced piece may
/// span touching buffers of one pool), and none is empty.
fn assert_inside(t: &Template, side: Side, layout: &Layout) {
    let table = DescriptorTables::new(t).table(side).unwrap();
    let spans = merged_buffers(layout);
    for (k, (&a, &n)) in table.addrs.iter().zip(&table.lens).enumerate() {
        assert!(n > 0, "{side} descriptor {k} is empty");
        assert!(
            spans.iter().any(|&(s, e)| s <= a && a + n <= e),
            "{side} descriptor {k} [{a:#x}, +{n}) outside every buffer {spans:x?}"
        );
    }
}

/// A side's runs are its table, one run per piece and moving state pair, expanded in order.
fn assert_runs_are_the_table(t: &Template, side: Side) {
    let tables = DescriptorTables::new(t);
    let (runs, table) = (tables.runs(side).unwrap(), tables.table(side).unwrap());
    let shape = tables.shape().unwrap();
    assert_eq!(runs.len(), shape.pieces + shape.state_pairs, "{side}");
    let (mut addrs, mut lens) = (vec![], vec![]);
    for run in &runs {
        for k in 0..run.count {
            addrs.push(run.base + k * run.stride);
            lens.push(run.len);
        }
    }
    assert_eq!(
        (addrs, lens),
        (table.addrs, table.lens),
        "{side}: runs are not the table"
    );
}

/// `(src, dst, len)` of each descriptor pair of a request.
fn prepped_blocks(t: &Template, request: &Request<'_>) -> Vec<[u64; 3]> {
    let (s_table, d_table) = (
        DescriptorTables::new(t).table(Side::Src).unwrap(),
        DescriptorTables::new(t).table(Side::Dst).unwrap(),
    );
    let idx = DescriptorTables::new(t).indices(request).unwrap();
    assert_eq!(idx.src.len(), idx.dst.len());
    idx.src
        .iter()
        .zip(&idx.dst)
        .map(|(&s, &d)| {
            let (s, d) = (s as usize, d as usize);
            assert_eq!(
                s_table.lens[s], d_table.lens[d],
                "paired descriptors differ in length"
            );
            [s_table.addrs[s], d_table.addrs[d], s_table.lens[s]]
        })
        .collect()
}

/// The whole contract for one template: tables inside the buffers, the same bytes as the plan
/// (the same blocks when every piece is per page), state slots as `plan_state_into`.
fn check(name: &str, src: &Layout, dst: &Layout, coalesce: bool) -> Template {
    let geometry = GeometryOptions {
        coalesce,
        ..GeometryOptions::default()
    };
    let t = Template::with_geometry(src, dst, TemplateOptions::default(), &geometry).unwrap();
    assert_inside(&t, Side::Src, src);
    assert_inside(&t, Side::Dst, dst);
    assert_runs_are_the_table(&t, Side::Src);
    assert_runs_are_the_table(&t, Side::Dst);
    let got = prepped_blocks(&t, &Request::pages(&SRC_PAGES, &DST_PAGES));
    let want = triples(&t.plan(&Request::pages(&SRC_PAGES, &DST_PAGES)).unwrap());
    if t.pieces().iter().all(|p| !p.per_run()) {
        assert_eq!(
            got, want,
            "{name}: descriptor pairs are not the plan's blocks"
        );
    }
    assert_eq!(
        byte_map(&got),
        byte_map(&want),
        "{name}: different bytes than the plan"
    );
    let shape = DescriptorTables::new(&t).shape().unwrap();
    assert_eq!(shape.pieces, t.pieces().len(), "{name}");
    if shape.state_pairs > 0 {
        let got = prepped_blocks(&t, &Request::slot(1, 2));
        let want = triples(&state_plan(&t, 1, 2).0);
        assert_eq!(
            got, want,
            "{name}: state descriptors are not plan_state's blocks"
        );
    }
    t
}

#[test]
fn strided_per_layer_buffers() {
    let items = [48, 32, 64];
    let t = check(
        "strided",
        &per_layer(SRC, &items, 16),
        &per_layer(DST, &items, 8),
        true,
    );
    assert_eq!(
        DescriptorTables::new(&t).shape().unwrap().rows,
        (3 * PAGES, 3 * PAGES)
    );
    // Packed buffers: per-run pieces, still one descriptor per page.
    check(
        "packed",
        &per_layer(SRC, &items, 0),
        &per_layer(DST, &items, 0),
        true,
    );
}

#[test]
fn cross_layer_pools() {
    let items = [48, 32, 64];
    check(
        "pool to per-layer",
        &pool(SRC, &items),
        &per_layer(DST, &items, 0),
        true,
    );
    check(
        "per-layer to pool",
        &per_layer(SRC, &items, 0),
        &pool(DST, &items),
        true,
    );
    // Pool to pool coalesces every layer into one piece: one descriptor per page.
    let t = check("pool to pool", &pool(SRC, &items), &pool(DST, &items), true);
    assert_eq!(
        DescriptorTables::new(&t).shape().unwrap().rows,
        (PAGES, PAGES)
    );
    check(
        "pool to pool, not coalesced",
        &pool(SRC, &items),
        &pool(DST, &items),
        false,
    );
}

#[test]
fn head_sliced_hnd_and_nhd() {
    for order in [MemoryOrder::Hnd, MemoryOrder::Nhd] {
        for (heads, tp_p, r_p, tp_d, r_d) in [(8, 8, 5, 2, 1), (8, 2, 1, 4, 3), (2, 4, 2, 1, 0)] {
            let src = mha_rank(SRC, heads, tp_p, r_p, order, TOKENS);
            let dst = mha_rank(DST, heads, tp_d, r_d, order, TOKENS);
            let name = format!("{order:?} H{heads} TP{tp_p} r{r_p} -> TP{tp_d} r{r_d}");
            let t = check(&name, &src, &dst, true);
            assert!(t.empty_reason().is_none(), "{name}");
            let per_pair = if order == MemoryOrder::Hnd {
                1
            } else {
                TOKENS as usize
            };
            assert_eq!(t.pieces().len(), 2 * LAYERS * per_pair, "{name}");
        }
    }
}

#[test]
fn a_pair_without_shared_heads_has_no_page_descriptors() {
    let src = mha_rank(SRC, 8, 2, 0, MemoryOrder::Hnd, TOKENS);
    let dst = mha_rank(DST, 8, 2, 1, MemoryOrder::Hnd, TOKENS);
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    assert!(t.empty_reason().is_some());
    let shape = DescriptorTables::new(&t).shape().unwrap();
    assert_eq!(
        (shape.pieces, shape.pages, shape.state_start),
        (0, (0, 0), (0, 0))
    );
    let idx = DescriptorTables::new(&t)
        .indices(&Request::pages(&SRC_PAGES, &DST_PAGES))
        .unwrap();
    assert!(idx.src.is_empty() && idx.dst.is_empty());
    // Replicated state still has its one writer: rank 0 writes decode rank 1's copy.
    check("empty pages, state", &src, &dst, true);
}

#[test]
fn requests_are_validated_exactly_as_plans() {
    let items = [48, 32];
    let t = Template::new(
        &pool(SRC, &items),
        &per_layer(DST, &items, 8),
        TemplateOptions::default(),
    )
    .unwrap();
    let cases: [(&[i64], &[i64]); 4] = [
        (&[0, -3], &[1, 2]),
        (&[0, 1], &[2, PAGES as i64]),
        (&[PAGES as i64 + 5], &[0]),
        (&[0, 1], &[2]),
    ];
    for (src, dst) in cases {
        let err = DescriptorTables::new(&t)
            .indices(&Request::pages(src, dst))
            .unwrap_err();
        assert_eq!(err, t.plan(&Request::pages(src, dst)).unwrap_err());
    }
    let err = DescriptorTables::new(&t)
        .indices(&Request::pages(&[0, 1], &[2, PAGES as i64]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::IndexOutOfRange {
                side: Side::Dst,
                index: 8,
                position: 1,
                capacity: 8,
                ..
            }
        ),
        "{err}"
    );
    let src = mha_rank(SRC, 2, 1, 0, MemoryOrder::Hnd, TOKENS);
    let st = Template::new(
        &src,
        &mha_rank(DST, 2, 1, 0, MemoryOrder::Hnd, TOKENS),
        TemplateOptions::default(),
    )
    .unwrap();
    let mut scratch = vec![0u64; 3 * LAYERS];
    for (s, d) in [(-1, 0), (0, 4), (9, 0)] {
        let columns = kvplan_core::Columns::from_flat(&mut scratch, LAYERS);
        let want = st
            .plan_into(&Request::slot(s, d), |_| Ok(columns))
            .map(|(_, summary)| summary)
            .unwrap_err();
        assert_eq!(
            DescriptorTables::new(&st)
                .indices(&Request::slot(s, d))
                .unwrap_err(),
            want
        );
    }
}

#[test]
fn token_templates_are_refused_naming_the_plan_path() {
    let cases = [
        (
            MemoryOrder::Nhd,
            TOKENS,
            MemoryOrder::Hnd,
            TOKENS,
            "memory orders",
        ),
        (
            MemoryOrder::Nhd,
            TOKENS,
            MemoryOrder::Nhd,
            2 * TOKENS,
            "prefill pages hold 4 tokens and decode pages 8",
        ),
    ];
    for (so, sp, d_order, dp, says) in cases {
        let src = mha_rank(SRC, 2, 1, 0, so, sp);
        let dst = mha_rank(DST, 2, 1, 0, d_order, dp);
        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        assert!(t.by_token());
        let errors = [
            DescriptorTables::new(&t).table(Side::Src).unwrap_err(),
            DescriptorTables::new(&t)
                .indices(&Request::pages(&SRC_PAGES, &DST_PAGES))
                .unwrap_err(),
            DescriptorTables::new(&t)
                .indices(&Request::slot(0, 0))
                .unwrap_err(),
        ];
        for err in errors {
            assert!(
                matches!(
                    err,
                    PlanError::Unsupported {
                        planner: "descriptor_table",
                        feature: "token_plan",
                        ..
                    }
                ),
                "{err}"
            );
            assert_eq!(err.class(), ErrorClass::Other);
            let text = err.to_string();
            assert!(
                text.contains(says)
                    && text.contains("Template.plan")
                    && text.contains("submit(plan)"),
                "{text}"
            );
        }
    }
}

#[test]
fn tables_too_large_are_errors_not_aborts() {
    // One byte per page: 2**60 pages per entry fit a buffer but not a table in memory; `n`
    // entries viewing the same buffer (as K and V views of one allocation may).
    let huge = |base: u64, n: usize| {
        KvLayout::mla(base, 0..n as i64, 1, 1 << 60)
            .spaced(0)
            .build()
    };
    let t = Template::new(&huge(0, 1), &huge(1 << 62, 1), TemplateOptions::default()).unwrap();
    let err = DescriptorTables::new(&t).table(Side::Src).unwrap_err();
    assert_eq!(err.class(), ErrorClass::Memory, "{err}");
    // Its runs hold it without expanding it: one run of 2**60 one-byte descriptors.
    let runs = DescriptorTables::new(&t).runs(Side::Src).unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(
        (runs[0].base, runs[0].len, runs[0].stride, runs[0].count),
        (0, 1, 1, 1 << 60)
    );
    // Nine such entries: 9 * 2**60 descriptors, more than an int64 index reaches.
    let t = Template::new(&huge(0, 9), &huge(1 << 62, 9), TemplateOptions::default()).unwrap();
    assert_eq!(t.pieces().len(), 9);
    let err = DescriptorTables::new(&t).shape().unwrap_err();
    assert!(matches!(err, PlanError::Overflow { .. }), "{err}");
    assert!(matches!(
        DescriptorTables::new(&t).table(Side::Dst).unwrap_err(),
        PlanError::Overflow { .. }
    ));
}
