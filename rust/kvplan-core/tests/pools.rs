//! Pools of their own (`Layout::with_pool`): each one page index space with its own page size
//! and tokens per row; a request gives each side's pages of each pool, and a row moves once
//! all its tokens are in the request.

use kvplan_core::{
    Lane, Layout, LayoutContext, PlanError, PoolId, Request, Template, TemplateOptions, TokenMap,
    Walk,
};

const ROW: u64 = 24;
const PAGES: u64 = 16;

/// Two MLA layers at `base` (4-token pages of 16-byte tokens); the second in a pool of
/// `pool_page` tokens per page, `per_row` tokens per row.
fn layout(base: u64, pool_page: u64, per_row: u64) -> Layout {
    let ctx = LayoutContext {
        page_size: 4,
        ..LayoutContext::default()
    };
    let pool_item = pool_page / per_row * ROW;
    Layout::mla(
        vec![base, base + (1 << 20)],
        vec![64 * PAGES, pool_item * PAGES],
        vec![64, pool_item],
        Some(vec![0, 1]),
        ctx,
    )
    .unwrap()
    .with_pool(&[1], pool_page, per_row)
    .unwrap()
}

#[test]
fn a_pool_of_rows_is_one_lane_reading_its_own_pages_row_by_row() {
    let (src, dst) = (layout(1 << 30, 8, 4), layout(1 << 40, 16, 4));
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let lanes = &t.token_template().unwrap().lanes;
    assert_eq!(
        lanes[1],
        Lane {
            walk: Walk::All,
            maps: (
                TokenMap::Paged { page_size: 2 },
                TokenMap::Paged { page_size: 4 }
            ),
            pools: (PoolId(1), PoolId(1)),
            tokens_per_row: 4,
        }
    );
    // Rows [skip / 4, n / 4): a delta of tokens 5..14 moves rows 1 and 2 (row 3 waits).
    assert_eq!(lanes[1].slots(5, 14), (1, 3));
    let pages: Vec<i64> = (0..4).collect();
    let pool: Vec<i64> = (0..2).collect();
    let request = Request::tokens(&pages, &pages, 14)
        .skipping(5)
        .with_pool_pages(PoolId(1), Some(&pool[..]), Some(&pool[..]));
    let summary = t.prepare(&request).unwrap();
    assert_eq!(summary.total_bytes, 9 * 16 + 2 * ROW);
}

#[test]
fn pool_values_and_missing_pool_pages_are_refused_typed() {
    let plain = layout(1 << 30, 8, 4);
    for (page, per_row, what) in [
        (6, 4, "page_size must be a multiple of its tokens_per_row"),
        (0, 1, "at least 1"),
    ] {
        let err = layout(1 << 20, 8, 4)
            .with_pool(&[0], page, per_row)
            .unwrap_err();
        assert!(
            matches!(&err, PlanError::InvalidLayout { what: w } if w.contains(what)),
            "{err}"
        );
    }
    let err = plain.clone().with_pool(&[1], 8, 4).unwrap_err();
    assert!(
        err.to_string().contains("already in a pool of its own"),
        "{err}"
    );
    let t = Template::new(&plain, &plain, TemplateOptions::default()).unwrap();
    let pages: Vec<i64> = (0..4).collect();
    let err = t.prepare(&Request::tokens(&pages, &pages, 8)).unwrap_err();
    assert!(
        err.to_string()
            .contains("must give that side's pages of pool 1"),
        "{err}"
    );
    // Published on the wire with its pool table.
    let wire = kvplan_core::exchange::wire::encode(&plain).unwrap();
    assert_eq!(kvplan_core::exchange::wire::decode(&wire).unwrap(), plain);
}

#[test]
fn a_side_keeps_at_most_the_pools_its_requests_carry() {
    let ctx = LayoutContext {
        page_size: 4,
        ..LayoutContext::default()
    };
    let n = kvplan_core::POOLS;
    let mut layout = Layout::mla(
        (0..n as u64).map(|k| (k + 1) << 24).collect(),
        vec![64 * PAGES; n],
        vec![64; n],
        Some((0..n as i64).collect()),
        ctx,
    )
    .unwrap();
    for k in 1..n {
        layout = layout.with_pool(&[k - 1], 4, 1).unwrap();
    }
    let err = layout.with_pool(&[n - 1], 4, 1).unwrap_err();
    assert!(err.to_string().contains("at most 8 pools"), "{err}");
}
